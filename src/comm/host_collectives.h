// Collectives on host memory, for the small agreements of a multi-rank job
// (a run name, a checkpoint token, per-rank flags and norms, a trainer's
// settings) and for exports: the communicator's collectives take device
// memory (CUDA memory for NCCL), so these copy the host bytes into a device
// buffer (from the backend's caching pool), run the collective there, copy
// the result back and wait for it. On every backend the bytes take the same
// way (the host backend's "device" is RAM), so the path CUDA ranks use is
// the one the host-backend tests run. Large calls go in rounds of at most
// kHostCollectiveStaging bytes of device memory.
// Blocking: they return when the result is in host memory. Collectives:
// every rank calls them at the same point, with the same sizes.
#pragma once

#include <cstddef>

#include "comm/communicator.h"

namespace strata::comm {

inline constexpr std::size_t kHostCollectiveStaging = 1u << 20;

// all[r * bytes_per_rank, (r + 1) * bytes_per_rank) = rank r's mine, for every
// rank; `mine` may point at this rank's slot of `all`.
Status all_gather_host(Communicator& comm, DeviceStream* stream, const void* mine, void* all,
                       std::size_t bytes_per_rank);

// data[0, bytes) on every rank = root's.
Status broadcast_host(Communicator& comm, DeviceStream* stream, void* data, std::size_t bytes, int root);

}  // namespace strata::comm
