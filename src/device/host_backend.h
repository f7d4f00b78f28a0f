// HostBackend: the DeviceBackend that needs no GPU. Always available; the
// whole runtime runs and is tested on it, and a CPU-only job runs on it.
//
// - "Device memory" is RAM from the caching allocator under its own budget.
//   Every device-side range given to a copy or kernel is checked against the
//   live allocations when the work is enqueued (kInvalidArgument naming the
//   operation), so runtime bugs that would be a GPU fault show here first.
//   New memory is filled with 0xFF bytes (NaN in fp32/bf16/fp16).
// - Each stream is a FIFO executed by its own worker thread, so a copy stream
//   is a copy thread. Events are (stream progress, sequence number) pairs: a
//   wait blocks the waiting stream's worker until the other stream's worker
//   has finished that many items.
// - Kernels are the plain loops over common/device_numeric.h's element functions
//   (bit-identical to the CUDA kernels' per-element results).
// - Errors inside a stream's work are recorded on the stream (the first one
//   is kept); the stream then skips its remaining work, and the error is
//   returned by synchronize/query of the stream and of events recorded on it
//   after the failure, and passes to streams that wait on such an event.
// - Destroying a stream, or the backend, with work queued drains that work
//   first (the destructor never abandons a running callback).
// - Handles are looked up before use: a destroyed stream or event, or one of
//   another backend, is kInvalidArgument rather than a crash.
#pragma once

#include <memory>

#include "device/device_backend.h"

namespace strata {

struct HostBackendOptions {
  uint64_t budget_bytes = 1ull << 30;
  bool poison_new_memory = true;  // fill fresh blocks with 0xFF
};

// Errors: kInvalidArgument for a zero budget.
Result<std::unique_ptr<DeviceBackend>> create_host_backend(const HostBackendOptions& options);

}  // namespace strata
