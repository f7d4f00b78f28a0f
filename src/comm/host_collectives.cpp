#include "comm/host_collectives.h"

#include <algorithm>
#include <cstring>

namespace strata::comm {
namespace {

// A device buffer from the backend's pool, freed (after `stream`) on scope exit.
struct Staging {
  DeviceBackend* dev;
  DeviceStream* stream;
  void* ptr = nullptr;
  ~Staging() {
    if (ptr) (void)dev->free(ptr, stream);
  }
};

}  // namespace

Status all_gather_host(Communicator& comm, DeviceStream* stream, const void* mine, void* all,
                       std::size_t bytes_per_rank) {
  const std::size_t world = static_cast<std::size_t>(comm.world_size());
  const std::size_t rank = static_cast<std::size_t>(comm.rank());
  DeviceBackend* dev = comm.device();
  // Per round: `step` bytes of every rank's slice (at least one byte).
  const std::size_t step = std::max<std::size_t>(1, std::min(bytes_per_rank, kHostCollectiveStaging / world));
  Staging buf{dev, stream};
  if (bytes_per_rank > 0) {
    STRATA_ASSIGN_OR_RETURN(buf.ptr, dev->alloc(step * world));
  }
  auto* out = static_cast<char*>(all);
  const char* in = static_cast<const char*>(mine);
  std::size_t off = 0;
  do {  // one round even for 0 bytes: the collective still matches
    const std::size_t n = std::min(step, bytes_per_rank - off);
    char* d = static_cast<char*>(buf.ptr);
    Status st;
    if (n > 0) st = dev->copy_async(d + rank * n, in + off, n, CopyKind::kHostToDevice, stream);
    if (st.ok()) st = comm.all_gather(n > 0 ? d + rank * n : nullptr, d, n, stream);
    for (std::size_t r = 0; st.ok() && n > 0 && r < world; ++r)
      if (r != rank) st = dev->copy_async(out + r * bytes_per_rank + off, d + r * n, n, CopyKind::kDeviceToHost, stream);
    Status sync = dev->synchronize(stream);
    if (!st.ok()) return st;
    if (!sync.ok()) return sync;
    off += n;
  } while (off < bytes_per_rank);
  // This rank's own slot last: `mine` may be it.
  if (out + rank * bytes_per_rank != in && bytes_per_rank > 0) std::memmove(out + rank * bytes_per_rank, in, bytes_per_rank);
  return {};
}

Status broadcast_host(Communicator& comm, DeviceStream* stream, void* data, std::size_t bytes, int root) {
  DeviceBackend* dev = comm.device();
  const std::size_t step = std::max<std::size_t>(1, std::min(bytes, kHostCollectiveStaging));
  Staging buf{dev, stream};
  if (bytes > 0) {
    STRATA_ASSIGN_OR_RETURN(buf.ptr, dev->alloc(step));
  }
  auto* p = static_cast<char*>(data);
  const bool is_root = comm.rank() == root;
  std::size_t off = 0;
  do {
    const std::size_t n = std::min(step, bytes - off);
    Status st;
    if (is_root && n > 0) st = dev->copy_async(buf.ptr, p + off, n, CopyKind::kHostToDevice, stream);
    if (st.ok()) st = comm.broadcast(n > 0 ? buf.ptr : nullptr, n, root, stream);
    if (st.ok() && !is_root && n > 0) st = dev->copy_async(p + off, buf.ptr, n, CopyKind::kDeviceToHost, stream);
    Status sync = dev->synchronize(stream);
    if (!st.ok()) return st;
    if (!sync.ok()) return sync;
    off += n;
  } while (off < bytes);
  return {};
}

}  // namespace strata::comm
