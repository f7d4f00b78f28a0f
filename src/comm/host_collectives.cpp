#include "comm/host_collectives.h"

#include <algorithm>
#include <cstring>

namespace strata::comm {
namespace {

// The caller's staging buffer, or one from the backend's pool, freed (after
// `stream`) on scope exit.
struct Staging {
  DeviceBackend* dev;
  DeviceStream* stream;
  HostStaging buf;
  bool owned = false;
  Status get(const HostStaging& given, std::size_t want) {
    if (given.ptr != nullptr && given.bytes > 0) {
      buf = given;
      return {};
    }
    if (want == 0) return {};
    STRATA_ASSIGN_OR_RETURN(buf.ptr, dev->alloc(kHostCollectiveStaging));
    buf.bytes = kHostCollectiveStaging;
    owned = true;
    return {};
  }
  ~Staging() {
    if (owned) (void)dev->free(buf.ptr, stream);
  }
};

}  // namespace

Status all_gather_host(Communicator& comm, DeviceStream* stream, const void* mine, void* all,
                       std::size_t bytes_per_rank, HostStaging staging) {
  const std::size_t world = static_cast<std::size_t>(comm.world_size());
  const std::size_t rank = static_cast<std::size_t>(comm.rank());
  DeviceBackend* dev = comm.device();
  Staging buf{dev, stream, {}};
  STRATA_RETURN_IF_ERROR(buf.get(staging, bytes_per_rank));
  if (bytes_per_rank > 0 && buf.buf.bytes < world)
    return Status(StatusCode::kInvalidArgument, "all_gather_host: staging buffer smaller than one byte per rank");
  // Per round: `step` bytes of every rank's slice (at least one byte).
  const std::size_t step = std::max<std::size_t>(1, std::min(bytes_per_rank, buf.buf.bytes / world));
  auto* out = static_cast<char*>(all);
  const char* in = static_cast<const char*>(mine);
  std::size_t off = 0;
  do {  // one round even for 0 bytes: the collective still matches
    const std::size_t n = std::min(step, bytes_per_rank - off);
    char* d = static_cast<char*>(buf.buf.ptr);
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

Status broadcast_host(Communicator& comm, DeviceStream* stream, void* data, std::size_t bytes, int root,
                      HostStaging staging) {
  DeviceBackend* dev = comm.device();
  Staging buf{dev, stream, {}};
  STRATA_RETURN_IF_ERROR(buf.get(staging, bytes));
  const std::size_t step = std::max<std::size_t>(1, std::min(bytes, buf.buf.bytes));
  void* d = buf.buf.ptr;
  auto* p = static_cast<char*>(data);
  const bool is_root = comm.rank() == root;
  std::size_t off = 0;
  do {
    const std::size_t n = std::min(step, bytes - off);
    Status st;
    if (is_root && n > 0) st = dev->copy_async(d, p + off, n, CopyKind::kHostToDevice, stream);
    if (st.ok()) st = comm.broadcast(n > 0 ? d : nullptr, n, root, stream);
    if (st.ok() && !is_root && n > 0) st = dev->copy_async(p + off, d, n, CopyKind::kDeviceToHost, stream);
    Status sync = dev->synchronize(stream);
    if (!st.ok()) return st;
    if (!sync.ok()) return sync;
    off += n;
  } while (off < bytes);
  return {};
}

}  // namespace strata::comm
