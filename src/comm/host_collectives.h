// Collectives on host memory, for the small agreements of a multi-rank job
// (a run name, a checkpoint token, per-rank flags and norms, a trainer's
// settings) and for exports: the communicator's collectives take device
// memory (CUDA memory for NCCL), so these copy the host bytes into a device
// buffer, run the collective there, copy the result back and wait for it.
// On every backend the bytes take the same way (the host backend's "device"
// is RAM), so the path CUDA ranks use is the one the host-backend tests run.
// The device buffer is the caller's `staging` (callers on a per-step path
// keep one, so nothing is allocated per call), or, when none is given, one
// of kHostCollectiveStaging bytes from the backend's pool for the call.
// Calls larger than the buffer go in rounds.
// Blocking: they return when the result is in host memory. Collectives:
// every rank calls them at the same point, with the same sizes.
#pragma once

#include <cstddef>

#include "comm/communicator.h"

namespace strata::comm {

inline constexpr std::size_t kHostCollectiveStaging = 1u << 20;

// Device memory of the communicator's backend for the calls below.
struct HostStaging {
  void* ptr = nullptr;
  std::size_t bytes = 0;
};

// all[r * bytes_per_rank, (r + 1) * bytes_per_rank) = rank r's mine, for every
// rank; `mine` may point at this rank's slot of `all`.
Status all_gather_host(Communicator& comm, DeviceStream* stream, const void* mine, void* all,
                       std::size_t bytes_per_rank, HostStaging staging = {});

// data[0, bytes) on every rank = root's.
Status broadcast_host(Communicator& comm, DeviceStream* stream, void* data, std::size_t bytes, int root,
                      HostStaging staging = {});

}  // namespace strata::comm
