// DeviceBackend: what the offload runtime needs from a compute device.
//
// Two implementations: HostBackend (src/device/host_backend.h; "device memory"
// is RAM, streams are worker threads; always available, the whole runtime is
// tested on it) and CudaBackend (src/device/cuda_backend.h; over the CUDA
// module loaded at run time). create_device_backend() picks one.
//
// Why an abstract C++ class and not a ggml-style table of function pointers:
// the one C ABI boundary that matters (a module loaded with dlopen) already
// is such a table (cuda/module_abi.h); above it the runtime wants Status,
// Result<T>, std::function callbacks and RAII, which a C table cannot carry.
// A virtual call costs nanoseconds next to a microsecond kernel launch, and
// "optional entries defaulted" becomes plain default methods (scale_async).
//
// Model (the CUDA one): work is enqueued on streams and runs in enqueue order
// per stream; streams order against each other only through events. Every
// *_async call returns once the work is enqueued: an Ok status means only
// that the arguments were accepted. Errors while the work runs are recorded
// on the stream and returned by the next synchronize()/query() of that stream
// (or of an event recorded on it after the failure): the async error model of
// CUDA and NCCL. Nothing on the hot path synchronizes the whole device.
//
// Memory the work touches must stay valid until the work is done: free device
// memory with free(ptr, stream) (stream-ordered: the block is reused only once
// `stream` has passed this point) and host buffers only after an event or a
// synchronize says the copy finished.
//
// Thread-safety: every method may be called from any thread concurrently.
// Calls enqueueing on the same stream from several threads are ordered as
// the calls are serialized; the caller decides that order.
//
// Handles (DeviceStream*, DeviceEvent*) are owned by the backend that made
// them; pass them back to that backend only, destroy them before it (the
// backend's destructor drains and destroys any left over).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "common/dtype.h"
#include "common/host_memory.h"
#include "common/status.h"

namespace strata {

class DeviceBackend;

enum class DeviceKind { kHost, kCuda };
const char* device_kind_name(DeviceKind kind);

// Element types of device buffers. Values are the C ABI's STRATA_CUDA_DTYPE_*
// and device_math's codes; never renumber.
// Element types: DType from common/dtype.h (codes shared with the CUDA module).

enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice };
const char* copy_kind_name(CopyKind kind);

// cast_async's operands, as every backend checks them: in place (dst == src)
// needs one dtype on both sides, and otherwise the two ranges must not
// overlap (an element would be read after another thread overwrote it).
// kInvalidArgument naming the cast otherwise.
Status check_cast_operands(const void* dst, DType dst_type, const void* src, DType src_type, std::size_t count);

// Opaque handles. Each backend derives its own; the base records the owner so
// that a handle passed to the wrong backend is refused (kInvalidArgument).
class DeviceStream {
 public:
  virtual ~DeviceStream() = default;
  const DeviceBackend* owner() const { return owner_; }
  const std::string& name() const { return name_; }

 protected:
  DeviceStream(const DeviceBackend* owner, std::string name) : owner_(owner), name_(std::move(name)) {}

 private:
  const DeviceBackend* owner_;
  std::string name_;
};

class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
  const DeviceBackend* owner() const { return owner_; }

 protected:
  explicit DeviceEvent(const DeviceBackend* owner) : owner_(owner) {}

 private:
  const DeviceBackend* owner_;
};

// Result of sq_norm_async, in device memory (16 bytes, 8-byte aligned).
// Accumulated in double: squares of fp32 values cannot overflow it, so a
// nonzero `nonfinite` is the one signal of inf/NaN in the inputs (fp16 loss
// scaling overflow). Zero it (fill_zero_async) before the first buffer.
struct NormStats {
  double sum_sq;       // sum of x*x over the finite elements
  uint64_t nonfinite;  // number of inf or NaN elements
};
static_assert(sizeof(NormStats) == 16);

// One AdamW step over `count` elements held in device memory (torch.optim.
// AdamW's math: bias correction, eps added after the sqrt, decoupled weight
// decay; the per-element formula is common/device_numeric.h's adamw_element and is
// bit-identical to cpu_optim's AdamW). Constants are computed in double on
// the host from these fields.
struct AdamWArgs {
  float* params = nullptr;      // fp32 master, updated in place
  float* exp_avg = nullptr;     // m, fp32, in place
  float* exp_avg_sq = nullptr;  // v, fp32, in place
  const void* grads = nullptr;  // gradient, grad_dtype
  DType grad_dtype = DType::kF32;
  void* out = nullptr;  // optional compute copy written from the new params
  DType out_dtype = DType::kBF16;
  std::size_t count = 0;
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  long step = 1;            // 1-based step number (bias correction)
  double grad_scale = 1.0;  // gradients are multiplied by this first (1/loss_scale * clip)
};

struct DeviceMemoryStats {
  uint64_t budget = 0;    // hard cap on bytes taken from the device
  uint64_t reserved = 0;  // bytes taken from the device (in use + cached + pending)
  uint64_t in_use = 0;    // bytes of size classes handed out and not freed
  uint64_t cached = 0;    // freed blocks kept for reuse
  uint64_t pending = 0;   // freed on a stream that has not reached the free yet
  uint64_t peak_reserved = 0;
  uint64_t live_blocks = 0;
  uint64_t slab_allocs = 0;  // device allocations made (cudaMalloc calls); flat once warm
  uint64_t slab_frees = 0;
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  virtual DeviceKind kind() const = 0;
  // "host" or "cuda:0 (NVIDIA H200, sm_90, ...)". Constant; any thread.
  virtual std::string name() const = 0;
  // The CUDA device ordinal (0 on the host backend).
  virtual int ordinal() const { return 0; }

  // ---- device memory (pooled, under a hard budget; see caching_allocator.h)
  // Returns a 256-byte aligned block of at least `bytes` (0 counts as 1).
  // Contents undefined (the host backend fills new memory with 0xFF bytes, a
  // NaN in every float format, so reads of unwritten memory show). Blocks are
  // reused from the cache; device allocations happen only while the pool
  // grows. Errors: kOutOfBudget when the budget cannot hold it even after
  // dropping cached blocks (the message says asked, in use, cached, budget and
  // left; nothing is leaked), kOutOfMemory when the device itself refuses.
  // May block while waiting for stream-ordered frees under budget pressure.
  virtual Result<void*> alloc(std::size_t bytes) = 0;
  // Returns a block. With `after` null the caller guarantees no enqueued work
  // uses it; otherwise the block becomes reusable once `after` reaches this
  // point (stream-ordered, like cudaFreeAsync). Never blocks.
  // Errors: kInvalidArgument for a pointer this backend did not hand out.
  virtual Status free(void* ptr, DeviceStream* after = nullptr) = 0;
  virtual DeviceMemoryStats memory_stats() const = 0;
  // Gives cached (unused) blocks back to the device. Not for the hot path
  // (cudaFree synchronizes the device).
  virtual void trim() = 0;

  // ---- pinned host memory (not under the device budget)
  // Whether [ptr, ptr + bytes) is memory this backend's kernels may take as
  // device memory. Host backend: inside one live allocation of its pool (a
  // caller's plain host buffer is not); CUDA: true (its callers hand device
  // pointers by contract; cudaPointerGetAttributes per call would cost more
  // than it checks). Any thread.
  virtual bool holds(const void* ptr, std::size_t bytes) const = 0;
  // The registrar page-locks host memory for asynchronous copies (the pinned
  // pool of io/ registers its slabs with it); null when the backend does not
  // need pinning (host). Valid as long as the backend.
  virtual HostMemoryRegistrar* host_registrar() = 0;
  // alloc_host() (2 MiB aligned, huge pages, zeroed) plus registration.
  // Errors: those of alloc_host; kOutOfMemory/kPermission when pinning is
  // refused (RLIMIT_MEMLOCK; the message says so).
  Result<HostAllocation> alloc_pinned(std::size_t bytes);
  void free_pinned(const HostAllocation& a);

  // ---- streams: in-order queues of work
  // `name` appears in error messages and traces. Errors: kOutOfMemory /
  // kInternal when the device cannot make one.
  virtual Result<DeviceStream*> create_stream(std::string_view name) = 0;
  // Blocks until the stream's work is done, then destroys it; returns the
  // stream's pending error, if any. Null is a no-op.
  virtual Status destroy_stream(DeviceStream* stream) = 0;
  // Blocks until all work enqueued so far is done; returns the first error
  // of the stream (sticky: a failed stream stays failed; destroy it).
  virtual Status synchronize(DeviceStream* stream) = 0;
  // True when all work enqueued so far is done; the stream's error if failed.
  virtual Result<bool> query(DeviceStream* stream) = 0;
  // Wraps a stream made outside Strata (CUDA: a cudaStream_t such as
  // PyTorch's current stream; null is CUDA's legacy default stream) so the
  // runtime can order its work against the caller's. The backend does not own
  // the native stream: destroy_stream() on the wrapper blocks until the work
  // enqueued so far is done, then frees only the wrapper; the caller keeps the
  // native stream (on this backend's device) alive until then. `name` appears
  // in messages. Errors: kInvalidArgument on a backend without native streams
  // (the host backend; this default).
  virtual Result<DeviceStream*> wrap_native_stream(void* native, std::string_view name);

  // ---- events: a point in a stream
  virtual Result<DeviceEvent*> create_event() = 0;
  // Safe while work that waits on it is still queued (waits captured the
  // event's position when they were enqueued). Null is a no-op.
  virtual void destroy_event(DeviceEvent* event) = 0;
  // Captures the stream's current end: the event completes when everything
  // enqueued on `stream` so far is done. Re-recording moves it. An event never
  // recorded counts as complete.
  virtual Status record(DeviceEvent* event, DeviceStream* stream) = 0;
  // Work enqueued on `stream` after this call starts only once `event` (as
  // last recorded before this call) completes. Does not block the caller.
  // If the event's stream failed, `stream` fails too (host backend).
  virtual Status wait(DeviceStream* stream, DeviceEvent* event) = 0;
  virtual Result<bool> query(DeviceEvent* event) = 0;
  virtual Status synchronize(DeviceEvent* event) = 0;

  // ---- copies and host callbacks (asynchronous)
  // The host side should be pinned memory (alloc_pinned or registered): from
  // pageable memory CUDA silently serializes the copy. Device ranges are
  // checked against live allocations on the host backend (kInvalidArgument).
  virtual Status copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, DeviceStream* stream) = 0;
  // Sets every byte of dst[0, bytes) to `value` (0xFF: NaN in fp32/bf16/fp16).
  virtual Status fill_bytes_async(void* dst, std::size_t bytes, uint8_t value, DeviceStream* stream) = 0;
  Status fill_zero_async(void* dst, std::size_t bytes, DeviceStream* stream) {
    return fill_bytes_async(dst, bytes, 0, stream);
  }
  // Runs `fn` on a backend thread once the stream reaches this point; later
  // work on the stream waits for it. A non-ok return is the stream's error.
  // `fn` must not call this backend (CUDA forbids API calls in host
  // functions; the host backend would deadlock on a synchronize) and should
  // be short.
  virtual Status host_func_async(DeviceStream* stream, std::function<Status()> fn) = 0;

  // ---- kernels (asynchronous; all arithmetic in fp32 unless stated)
  // dst[i] = convert(float(src[i]) * scale). Any pair of dtypes; dst == src
  // with the same dtype is in-place scaling. Other overlap is not allowed.
  virtual Status cast_async(void* dst, DType dst_type, const void* src, DType src_type, std::size_t count, float scale,
                            DeviceStream* stream) = 0;
  // data[i] *= scale, rounded back to `type`.
  Status scale_async(void* data, DType type, std::size_t count, float scale, DeviceStream* stream) {
    return cast_async(data, type, data, type, count, scale, stream);
  }
  // dst[i] += float(src[i]) * scale (fp32 gradient accumulation).
  virtual Status accumulate_async(float* dst, const void* src, DType src_type, std::size_t count, float scale,
                                  DeviceStream* stream) = 0;
  // out->sum_sq += sum of float(src[i])^2 in double over finite elements;
  // out->nonfinite += count of inf/NaN. `out` is device memory. Both are
  // deterministic: the host backend sums in index order; CUDA in a fixed
  // tree (per-block partials, then one block adds them in block order) that
  // depends only on count, so not the same bits as the host's.
  virtual Status sq_norm_async(const void* src, DType type, std::size_t count, NormStats* out,
                               DeviceStream* stream) = 0;
  virtual Status adamw_async(const AdamWArgs& args, DeviceStream* stream) = 0;
};

enum class DeviceBackendKind { kAuto, kCuda, kHost };
// "auto" | "cuda" | "host"; kInvalidArgument names the text otherwise.
Result<DeviceBackendKind> parse_device_backend_kind(std::string_view text);

struct DeviceBackendOptions {
  DeviceBackendKind kind = DeviceBackendKind::kAuto;
  int device = 0;                      // CUDA device ordinal
  // Hard cap on device memory taken by the pool. 0: detect (cuda: the free
  // device memory less a margin, see create_cuda_backend; host: a quarter of
  // MemAvailable, at least 256 MiB).
  uint64_t budget_bytes = 1ull << 30;
};

// Picks the backend: kCuda requires the CUDA module with a device (else the
// loader's reason, kUnavailable); kHost always works; kAuto is cuda when
// loadable with a device, else host. Logs once (info) which it chose and why.
// Errors: kUnavailable (cuda asked, not usable), kInvalidArgument (device
// ordinal out of range), kOutOfMemory (a detected budget found too little).
Result<std::unique_ptr<DeviceBackend>> create_device_backend(const DeviceBackendOptions& options);

}  // namespace strata
