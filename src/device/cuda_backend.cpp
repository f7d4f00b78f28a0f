#include "device/cuda_backend.h"

#include <cstddef>
#include <exception>
#include <mutex>
#include <set>

#include "common/log.h"
#include "common/units.h"
#include "device/caching_allocator.h"
#include "device/cuda_status.h"
#include "common/device_numeric.h"

namespace strata {
namespace {

// One call into the table: err text and code to a Status.
struct Err {
  char text[512] = {0};
  Status status(int rc, const std::string& what) const { return cuda_module_status(rc, text, "cuda: " + what); }
};

#define STRATA_CUDA_CALL(what, fn, ...)                            \
  do {                                                             \
    Err _err;                                                      \
    int _rc = api_->fn(__VA_ARGS__, _err.text, sizeof(_err.text)); \
    if (_rc != 0) return _err.status(_rc, what);                   \
  } while (0)

class CudaStream final : public DeviceStream {
 public:
  CudaStream(const DeviceBackend* owner, std::string name, void* s, bool owned = true)
      : DeviceStream(owner, std::move(name)), s_(s), owned_(owned) {}
  void* handle() const { return s_; }
  // False for a wrapped caller stream (wrap_native_stream): never destroyed here.
  bool owned() const { return owned_; }
  void set_error(Status st) {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.ok()) error_ = std::move(st);
  }
  Status error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  void* s_;
  bool owned_;
  mutable std::mutex mu_;
  Status error_;  // first failure of a host function
};

class CudaEvent final : public DeviceEvent {
 public:
  CudaEvent(const DeviceBackend* owner, void* e) : DeviceEvent(owner), e_(e) {}
  void* handle() const { return e_; }

 private:
  void* e_;
};

struct HostFn {
  CudaStream* stream;
  std::function<Status()> fn;
};

// Runs on a CUDA runtime thread. No exception may leave (no C++ frames of
// ours above it), and no CUDA call may be made here.
void host_fn_trampoline(void* user) {
  std::unique_ptr<HostFn> h(static_cast<HostFn*>(user));
  try {
    Status st = h->fn();
    if (!st.ok())
      h->stream->set_error(
          Status(st.code(), "stream '" + h->stream->name() + "': host function failed: " + st.message()));
  } catch (const std::exception& e) {  // bad_alloc building a message: the stream fails, the process lives
    h->stream->set_error(Status(StatusCode::kInternal, std::string("host function threw: ") + e.what()));
  } catch (...) {
    h->stream->set_error(Status(StatusCode::kInternal, "host function threw"));
  }
}

class DeviceSlabs final : public SlabSource {
 public:
  DeviceSlabs(const strata_cuda_api_v1_t* api, int device) : api_(api), device_(device) {}
  Result<void*> slab_alloc(std::size_t bytes) override {
    void* p = nullptr;
    STRATA_CUDA_CALL("cudaMalloc of " + std::to_string(bytes) + " bytes", device_malloc, device_, bytes, &p);
    return p;
  }
  void slab_free(void* ptr, std::size_t) override {
    Err err;
    if (api_->device_free(device_, ptr, err.text, sizeof(err.text)) != 0) log_warn("cudaFree failed: {}", err.text);
  }

 private:
  const strata_cuda_api_v1_t* api_;
  int device_;
};

class CudaDeviceBackend final : public DeviceBackend {
 public:
  CudaDeviceBackend(const strata_cuda_api_v1_t* api, int device, std::string name, uint64_t budget)
      : api_(api),
        device_(device),
        name_(std::move(name)),
        slabs_(api, device),
        registrar_(api, device),
        pool_(std::make_unique<CachingAllocator>(*this, slabs_, budget, "cuda:" + std::to_string(device))) {}

  ~CudaDeviceBackend() override {
    std::set<CudaStream*> streams;
    {
      std::lock_guard<std::mutex> lock(mu_);
      streams.swap(streams_);
    }
    for (CudaStream* s : streams) {
      Status st = destroy_stream_impl(s);
      if (!st.ok()) log_warn("destroying stream at backend shutdown: {}", st.to_string());
    }
    pool_.reset();
    std::set<CudaEvent*> events;
    {
      std::lock_guard<std::mutex> lock(mu_);
      events.swap(events_);
    }
    for (CudaEvent* e : events) destroy_event_impl(e);
  }

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string name() const override { return name_; }
  int ordinal() const override { return device_; }

  Result<void*> alloc(std::size_t bytes) override { return pool_->alloc(bytes); }
  Status free(void* ptr, DeviceStream* after) override {
    if (after) {
      auto s = stream_of(after, "free");
      if (!s.ok()) return s.status();
    }
    return pool_->free(ptr, after);
  }
  DeviceMemoryStats memory_stats() const override { return pool_->stats(); }
  void trim() override { pool_->trim(); }
  HostMemoryRegistrar* host_registrar() override { return &registrar_; }
  bool holds(const void*, std::size_t) const override { return true; }

  Result<DeviceStream*> create_stream(std::string_view name) override {
    void* s = nullptr;
    STRATA_CUDA_CALL("cudaStreamCreate", stream_create, device_, &s);
    auto* st = new CudaStream(this, std::string(name), s);
    std::lock_guard<std::mutex> lock(mu_);
    streams_.insert(st);
    return static_cast<DeviceStream*>(st);
  }

  Result<DeviceStream*> wrap_native_stream(void* native, std::string_view name) override {
    // A stream of another GPU would order nothing against this device's work.
    if (native != nullptr && api_->struct_size >= offsetof(strata_cuda_api_v1_t, stream_device) +
                                                      sizeof(api_->stream_device)) {
      Err err;
      int dev = -1;
      if (api_->stream_device(native, &dev, err.text, sizeof(err.text)) != 0)
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("wrap_native_stream({}): not a CUDA stream of this process ({})", name, err.text));
      if (dev != device_)
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("wrap_native_stream({}): the stream belongs to GPU {}, the engine uses GPU {} (make "
                                  "the engine's device the caller's: strata_engine_options_t.device_ordinal)",
                                  name, dev, device_));
    }
    auto* st = new CudaStream(this, std::string(name), native, /*owned=*/false);
    std::lock_guard<std::mutex> lock(mu_);
    streams_.insert(st);
    return static_cast<DeviceStream*>(st);
  }

  Status destroy_stream(DeviceStream* stream) override {
    if (!stream) return Status();
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, stream_of(stream, "destroy_stream"));
    {
      std::lock_guard<std::mutex> lock(mu_);
      streams_.erase(s);
    }
    return destroy_stream_impl(s);
  }

  Status synchronize(DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, stream_of(stream, "synchronize"));
    STRATA_CUDA_CALL("synchronize of stream '" + s->name() + "'", stream_synchronize, device_, s->handle());
    return s->error();
  }

  Result<bool> query(DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, stream_of(stream, "query"));
    int done = 0;
    STRATA_CUDA_CALL("query of stream '" + s->name() + "'", stream_query, device_, s->handle(), &done);
    Status st = s->error();
    if (!st.ok()) return st;
    return done != 0;
  }

  Result<DeviceEvent*> create_event() override {
    void* e = nullptr;
    STRATA_CUDA_CALL("cudaEventCreate", event_create, device_, &e);
    auto* ev = new CudaEvent(this, e);
    std::lock_guard<std::mutex> lock(mu_);
    events_.insert(ev);
    return static_cast<DeviceEvent*>(ev);
  }

  void destroy_event(DeviceEvent* event) override {
    if (!event) return;
    auto ev = event_of(event, "destroy_event");
    if (!ev.ok()) {
      log_error("{}", ev.status().to_string());
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (events_.erase(ev.value()) == 0) {
        log_error("destroy_event: unknown or already destroyed event; ignored");
        return;
      }
    }
    destroy_event_impl(ev.value());
  }

  Status record(DeviceEvent* event, DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(CudaEvent * e, event_of(event, "record"));
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, stream_of(stream, "record"));
    STRATA_CUDA_CALL("cudaEventRecord on stream '" + s->name() + "'", event_record, device_, e->handle(), s->handle());
    return Status();
  }

  Status wait(DeviceStream* stream, DeviceEvent* event) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, stream_of(stream, "wait"));
    STRATA_ASSIGN_OR_RETURN(CudaEvent * e, event_of(event, "wait"));
    STRATA_CUDA_CALL("cudaStreamWaitEvent on stream '" + s->name() + "'", stream_wait_event, device_, s->handle(),
                     e->handle());
    return Status();
  }

  Result<bool> query(DeviceEvent* event) override {
    STRATA_ASSIGN_OR_RETURN(CudaEvent * e, event_of(event, "query"));
    int done = 0;
    STRATA_CUDA_CALL("cudaEventQuery", event_query, device_, e->handle(), &done);
    return done != 0;
  }

  Status synchronize(DeviceEvent* event) override {
    STRATA_ASSIGN_OR_RETURN(CudaEvent * e, event_of(event, "synchronize"));
    STRATA_CUDA_CALL("cudaEventSynchronize", event_synchronize, device_, e->handle());
    return Status();
  }

  Status copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, stream_of(stream, "copy_async"));
    if (bytes == 0) return Status();
    if (!dst || !src) return Status(StatusCode::kInvalidArgument, "copy_async: null pointer");
    STRATA_CUDA_CALL(std::string(copy_kind_name(kind)) + " copy of " + std::to_string(bytes) + " bytes on stream '" +
                         s->name() + "'",
                     memcpy_async, device_, dst, src, bytes, s->handle());
    return Status();
  }

  Status fill_bytes_async(void* dst, std::size_t bytes, uint8_t value, DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, stream_of(stream, "fill_bytes_async"));
    if (bytes == 0) return Status();
    STRATA_CUDA_CALL("cudaMemsetAsync of " + std::to_string(bytes) + " bytes", memset_async, device_, dst,
                     static_cast<int>(value), bytes, s->handle());
    return Status();
  }

  Status host_func_async(DeviceStream* stream, std::function<Status()> fn) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, stream_of(stream, "host_func_async"));
    if (!fn) return Status(StatusCode::kInvalidArgument, "host_func_async: empty function");
    auto h = std::make_unique<HostFn>(HostFn{s, std::move(fn)});
    Err err;
    int rc = api_->launch_host_func(device_, s->handle(), host_fn_trampoline, h.get(), err.text, sizeof(err.text));
    if (rc != 0) return err.status(rc, "cudaLaunchHostFunc on stream '" + s->name() + "'");
    h.release();  // owned by the trampoline now
    return Status();
  }

  Status cast_async(void* dst, DType dst_type, const void* src, DType src_type, std::size_t count, float scale,
                    DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, stream_of(stream, "cast_async"));
    STRATA_RETURN_IF_ERROR(check_cast_operands(dst, dst_type, src, src_type, count));
    STRATA_CUDA_CALL(std::string("cast kernel ") + dtype_name(src_type) + "->" + dtype_name(dst_type), cast, device_,
                     dst, static_cast<int>(dst_type), src, static_cast<int>(src_type), count, scale, s->handle());
    return Status();
  }

  Status accumulate_async(float* dst, const void* src, DType src_type, std::size_t count, float scale,
                          DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, stream_of(stream, "accumulate_async"));
    STRATA_CUDA_CALL("accumulate kernel", accumulate, device_, dst, src, static_cast<int>(src_type), count, scale,
                     s->handle());
    return Status();
  }

  Status sq_norm_async(const void* src, DType type, std::size_t count, NormStats* out, DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, stream_of(stream, "sq_norm_async"));
    if (reinterpret_cast<uintptr_t>(out) % alignof(NormStats) != 0)
      return Status(StatusCode::kInvalidArgument, "sq_norm_async: result must be 8-byte aligned");
    STRATA_CUDA_CALL("squared-norm kernel", sq_norm, device_, src, static_cast<int>(type), count,
                     reinterpret_cast<strata_cuda_norm_stats_t*>(out), s->handle());
    return Status();
  }

  Status adamw_async(const AdamWArgs& a, DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(CudaStream * s, stream_of(stream, "adamw_async"));
    if (a.step < 1) return Status(StatusCode::kInvalidArgument, "adamw_async: step must be >= 1 (1-based)");
    const device_math::AdamWConsts c =
        device_math::adamw_consts(a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.step, a.grad_scale);
    strata_cuda_adamw_t k{};
    k.params = a.params;
    k.exp_avg = a.exp_avg;
    k.exp_avg_sq = a.exp_avg_sq;
    k.grads = a.grads;
    k.grad_dtype = static_cast<int>(a.grad_dtype);
    k.out_dtype = static_cast<int>(a.out_dtype);
    k.out = a.out;
    k.count = a.count;
    k.beta1 = c.beta1;
    k.one_minus_beta1 = c.one_minus_beta1;
    k.beta2 = c.beta2;
    k.one_minus_beta2 = c.one_minus_beta2;
    k.eps = c.eps;
    k.neg_lr_wd = c.neg_lr_wd;
    k.neg_step_size = c.neg_step_size;
    k.inv_sqrt_bc2 = c.inv_sqrt_bc2;
    k.grad_scale = c.grad_scale;
    STRATA_CUDA_CALL("AdamW kernel", adamw, device_, &k, s->handle());
    return Status();
  }

 private:
  Result<CudaStream*> stream_of(DeviceStream* s, const char* op) {
    if (!s) return Status(StatusCode::kInvalidArgument, std::string(op) + ": null stream");
    if (s->owner() != this)
      return Status(StatusCode::kInvalidArgument,
                    std::string(op) + ": stream '" + s->name() + "' belongs to another backend");
    return static_cast<CudaStream*>(s);
  }
  Result<CudaEvent*> event_of(DeviceEvent* e, const char* op) {
    if (!e) return Status(StatusCode::kInvalidArgument, std::string(op) + ": null event");
    if (e->owner() != this)
      return Status(StatusCode::kInvalidArgument, std::string(op) + ": the event belongs to another backend");
    return static_cast<CudaEvent*>(e);
  }
  // Drains first: host functions still queued point at the stream object.
  Status destroy_stream_impl(CudaStream* s) {
    std::unique_ptr<CudaStream> owned(s);
    Err err;
    Status result;
    int rc = api_->stream_synchronize(device_, s->handle(), err.text, sizeof(err.text));
    if (rc != 0) result = err.status(rc, "synchronize of stream '" + s->name() + "' before destroying it");
    if (s->owned()) {
      rc = api_->stream_destroy(device_, s->handle(), err.text, sizeof(err.text));
      if (rc != 0 && result.ok()) result = err.status(rc, "cudaStreamDestroy of '" + s->name() + "'");
    }
    if (result.ok()) result = s->error();
    return result;
  }
  void destroy_event_impl(CudaEvent* e) {
    std::unique_ptr<CudaEvent> owned(e);
    Err err;
    if (api_->event_destroy(device_, e->handle(), err.text, sizeof(err.text)) != 0)
      log_warn("cudaEventDestroy failed: {}", err.text);
  }

  const strata_cuda_api_v1_t* api_;
  const int device_;
  const std::string name_;
  DeviceSlabs slabs_;
  CudaHostRegistrar registrar_;
  std::unique_ptr<CachingAllocator> pool_;
  std::mutex mu_;
  std::set<CudaStream*> streams_;
  std::set<CudaEvent*> events_;
};

}  // namespace

Result<CudaNativeStream> cuda_native_stream(DeviceStream* stream) {
  if (!stream) return Status(StatusCode::kInvalidArgument, "cuda_native_stream: null stream");
  if (!stream->owner() || stream->owner()->kind() != DeviceKind::kCuda)
    return Status(StatusCode::kInvalidArgument,
                  "cuda_native_stream: stream '" + stream->name() + "' does not belong to a CUDA backend");
  CudaNativeStream out;
  out.stream = static_cast<CudaStream*>(stream)->handle();
  out.device = static_cast<const CudaDeviceBackend*>(stream->owner())->ordinal();
  return out;
}

Result<std::unique_ptr<DeviceBackend>> create_cuda_backend(const CudaBackend& module, int device,
                                                           uint64_t budget_bytes) {
  const strata_cuda_api_v1_t* api = module.api;
  if (!api) return Status(StatusCode::kInvalidArgument, "cuda device backend: the module is not loaded");
  // The loader accepts any table at least as large as the one it was built
  // with; check again here so that this file stays right if the loader's
  // rule is ever relaxed to the base fields.
  if (api->struct_size < offsetof(strata_cuda_api_v1_t, adamw) + sizeof(api->adamw))
    return Status(StatusCode::kUnavailable,
                  module.module_path + " predates the device-backend entries (streams, kernels); rebuild it");
  if (device < 0 || device >= module.device_count)
    return Status(StatusCode::kInvalidArgument, "cuda device " + std::to_string(device) + " does not exist (" +
                                                    std::to_string(module.device_count) + " visible)");
  char desc[256] = {0};
  Err err;
  if (api->device_describe(device, desc, sizeof(desc), err.text, sizeof(err.text)) != 0)
    return Status(StatusCode::kUnavailable, std::string("cuda device ") + std::to_string(device) + ": " + err.text);
  if (budget_bytes == 0) {
    // "Detect": what is free now, less a margin for the CUDA context's own
    // growth, cuBLAS workspaces and other libraries in the process (5%, at
    // least 512 MiB).
    if (api->struct_size < offsetof(strata_cuda_api_v1_t, mem_get_info) + sizeof(api->mem_get_info))
      return Status(StatusCode::kUnavailable, module.module_path + " cannot report free memory; rebuild it");
    size_t free_bytes = 0, total_bytes = 0;
    if (api->mem_get_info(device, &free_bytes, &total_bytes, err.text, sizeof(err.text)) != 0)
      return Status(StatusCode::kUnavailable,
                    "cuda device " + std::to_string(device) + ": cannot read free memory: " + err.text);
    const uint64_t margin = std::max<uint64_t>(free_bytes / 20, 512ull << 20);
    if (free_bytes <= margin + (256ull << 20))
      return Status(StatusCode::kOutOfMemory, "cuda device " + std::to_string(device) + " has only " +
                                                  format_bytes(free_bytes) + " free of " +
                                                  format_bytes(total_bytes) + ": too little to run on");
    budget_bytes = free_bytes - margin;
  }
  std::string name = "cuda:" + std::to_string(device) + " (" + desc + ")";
  return std::unique_ptr<DeviceBackend>(new CudaDeviceBackend(api, device, std::move(name), budget_bytes));
}

}  // namespace strata
