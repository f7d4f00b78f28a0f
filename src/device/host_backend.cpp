#include "device/host_backend.h"

#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>

#include "common/log.h"
#include "common/threads.h"
#include "device/caching_allocator.h"
#include "common/device_numeric.h"

namespace strata {
namespace {

namespace dm = device_math;

constexpr uint64_t kNoError = std::numeric_limits<uint64_t>::max();

// How far a stream's worker has got. Shared with the events recorded on the
// stream so that they stay valid after the stream is destroyed.
struct Progress {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t enqueued = 0;          // sequence number of the last item enqueued
  uint64_t done = 0;              // sequence number of the last item finished (or skipped)
  uint64_t error_seq = kNoError;  // first item that failed
  Status error;
  std::string name;

  // The error as seen by a point `seq` of the stream, or ok.
  Status error_at_locked(uint64_t seq) const { return error_seq <= seq ? error : Status(); }
};

struct Task {
  std::function<Status()> fn;
  const char* what;  // static text naming the operation, for messages
};

class HostStream final : public DeviceStream {
 public:
  HostStream(const DeviceBackend* owner, std::string name) : DeviceStream(owner, name) {
    progress_ = std::make_shared<Progress>();
    progress_->name = std::move(name);
    worker_ = std::thread([this] { run(); });
  }
  // Drains the queue, then joins the worker.
  ~HostStream() override {
    {
      std::lock_guard<std::mutex> lock(progress_->mu);
      stopping_ = true;
    }
    progress_->cv.notify_all();
    worker_.join();
  }

  void enqueue(const char* what, std::function<Status()> fn) {
    {
      std::lock_guard<std::mutex> lock(progress_->mu);
      ++progress_->enqueued;
      queue_.push_back(Task{std::move(fn), what});
    }
    progress_->cv.notify_all();
  }

  const std::shared_ptr<Progress>& progress() const { return progress_; }

 private:
  void run() {
    Progress& p = *progress_;
    std::unique_lock<std::mutex> lock(p.mu);
    for (;;) {
      p.cv.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      Task task = std::move(queue_.front());
      queue_.pop_front();
      const uint64_t seq = p.done + 1;
      const bool failed = p.error_seq != kNoError;
      lock.unlock();
      Status st;
      // A failed stream skips the rest: it would compute on bad inputs.
      if (!failed) st = run_guarded(task.what, task.fn);
      task.fn = nullptr;  // release captures outside the lock
      lock.lock();
      if (!st.ok() && p.error_seq == kNoError) {
        p.error_seq = seq;
        p.error = Status(st.code(), "stream '" + p.name + "': " + task.what + " failed: " + st.message());
      }
      p.done = seq;
      p.cv.notify_all();
    }
  }

  std::shared_ptr<Progress> progress_;
  std::deque<Task> queue_;  // guarded by progress_->mu
  bool stopping_ = false;   // guarded by progress_->mu
  std::thread worker_;
};

class HostEvent final : public DeviceEvent {
 public:
  explicit HostEvent(const DeviceBackend* owner) : DeviceEvent(owner) {}
  struct Point {
    std::shared_ptr<Progress> progress;  // null: never recorded
    uint64_t seq = 0;
  };
  Point get() const {
    std::lock_guard<std::mutex> lock(mu_);
    return point_;
  }
  void set(Point p) {
    std::lock_guard<std::mutex> lock(mu_);
    point_ = std::move(p);
  }

 private:
  mutable std::mutex mu_;
  Point point_;
};

// Blocks until `pt` is reached; returns the error of its stream at that point.
Status wait_point(const HostEvent::Point& pt) {
  if (!pt.progress) return Status();
  Progress& p = *pt.progress;
  std::unique_lock<std::mutex> lock(p.mu);
  p.cv.wait(lock, [&] { return p.done >= pt.seq; });
  return p.error_at_locked(pt.seq);
}

class RamSlabs final : public SlabSource {
 public:
  explicit RamSlabs(bool poison) : poison_(poison) {}
  Result<void*> slab_alloc(std::size_t bytes) override {
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (!p) return Status(StatusCode::kOutOfMemory, "out of host memory for " + std::to_string(bytes) + " bytes");
    if (poison_) std::memset(p, 0xff, bytes);
    return p;
  }
  void slab_free(void* ptr, std::size_t) override { std::free(ptr); }

 private:
  bool poison_;
};

class HostBackend final : public DeviceBackend {
 public:
  explicit HostBackend(const HostBackendOptions& o)
      : slabs_(o.poison_new_memory), pool_(std::make_unique<CachingAllocator>(*this, slabs_, o.budget_bytes, "host")) {}

  ~HostBackend() override {
    // Drain streams first: their work may still use pool memory and the
    // allocator's pending frees wait on their events.
    std::set<DeviceStream*> streams;
    {
      std::lock_guard<std::mutex> lock(mu_);
      streams.swap(streams_);
    }
    for (DeviceStream* s : streams) delete s;
    pool_.reset();  // returns its events through destroy_event
    std::set<DeviceEvent*> events;
    {
      std::lock_guard<std::mutex> lock(mu_);
      events.swap(events_);
    }
    for (DeviceEvent* e : events) delete e;
  }

  DeviceKind kind() const override { return DeviceKind::kHost; }
  std::string name() const override { return "host"; }

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
  HostMemoryRegistrar* host_registrar() override { return nullptr; }

  Result<DeviceStream*> create_stream(std::string_view name) override {
    HostStream* s = nullptr;
    try {
      s = new HostStream(this, std::string(name));
    } catch (const std::system_error& e) {  // std::thread could not start one
      return thread_start_error("host device backend: no worker thread for stream '" + std::string(name) + "'", e);
    }
    std::lock_guard<std::mutex> lock(mu_);
    streams_.insert(s);
    return static_cast<DeviceStream*>(s);
  }

  // Host streams are Strata's worker threads; there is no outside stream to
  // order against, so a caller's (CUDA) stream handle cannot mean anything here.
  Result<DeviceStream*> wrap_native_stream(void*, std::string_view name) override {
    return Status(StatusCode::kInvalidArgument,
                  "host device backend: cannot wrap native stream '" + std::string(name) +
                      "': native (CUDA) streams exist only on the cuda backend; use a stream made by create_stream");
  }

  Status destroy_stream(DeviceStream* stream) override {
    if (!stream) return Status();
    STRATA_ASSIGN_OR_RETURN(HostStream * s, stream_of(stream, "destroy_stream"));
    {
      std::lock_guard<std::mutex> lock(mu_);
      streams_.erase(s);
    }
    auto progress = s->progress();
    delete s;  // drains
    std::lock_guard<std::mutex> lock(progress->mu);
    return progress->error;
  }

  Status synchronize(DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(HostStream * s, stream_of(stream, "synchronize"));
    Progress& p = *s->progress();
    std::unique_lock<std::mutex> lock(p.mu);
    const uint64_t target = p.enqueued;
    p.cv.wait(lock, [&] { return p.done >= target; });
    return p.error;
  }

  Result<bool> query(DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(HostStream * s, stream_of(stream, "query"));
    Progress& p = *s->progress();
    std::lock_guard<std::mutex> lock(p.mu);
    if (!p.error.ok()) return p.error;
    return p.done >= p.enqueued;
  }

  Result<DeviceEvent*> create_event() override {
    auto* e = new HostEvent(this);
    std::lock_guard<std::mutex> lock(mu_);
    events_.insert(e);
    return static_cast<DeviceEvent*>(e);
  }

  void destroy_event(DeviceEvent* event) override {
    if (!event) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (events_.erase(event) == 0) {
        log_error("destroy_event: not a live event of this backend (destroyed, or another backend's); ignored");
        return;
      }
    }
    delete event;  // waits hold their own copy of the point
  }

  Status record(DeviceEvent* event, DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(HostEvent * e, event_of(event, "record"));
    STRATA_ASSIGN_OR_RETURN(HostStream * s, stream_of(stream, "record"));
    Progress& p = *s->progress();
    uint64_t seq;
    {
      std::lock_guard<std::mutex> lock(p.mu);
      seq = p.enqueued;
    }
    e->set({s->progress(), seq});
    return Status();
  }

  Status wait(DeviceStream* stream, DeviceEvent* event) override {
    STRATA_ASSIGN_OR_RETURN(HostStream * s, stream_of(stream, "wait"));
    STRATA_ASSIGN_OR_RETURN(HostEvent * e, event_of(event, "wait"));
    HostEvent::Point pt = e->get();
    if (!pt.progress) return Status();  // never recorded: complete
    s->enqueue("wait for an event", [pt = std::move(pt)]() -> Status {
      Status st = wait_point(pt);
      if (!st.ok()) return Status(st.code(), "the event waited on comes after a failure: " + st.message());
      return st;
    });
    return Status();
  }

  Result<bool> query(DeviceEvent* event) override {
    STRATA_ASSIGN_OR_RETURN(HostEvent * e, event_of(event, "query"));
    HostEvent::Point pt = e->get();
    if (!pt.progress) return true;
    Progress& p = *pt.progress;
    std::lock_guard<std::mutex> lock(p.mu);
    Status st = p.error_at_locked(pt.seq);
    if (!st.ok()) return st;
    return p.done >= pt.seq;
  }

  Status synchronize(DeviceEvent* event) override {
    STRATA_ASSIGN_OR_RETURN(HostEvent * e, event_of(event, "synchronize"));
    return wait_point(e->get());
  }

  Status copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(HostStream * s, stream_of(stream, "copy_async"));
    if (bytes == 0) return Status();
    if (!dst || !src) return Status(StatusCode::kInvalidArgument, "copy_async: null pointer");
    const bool dst_dev = kind != CopyKind::kDeviceToHost;
    const bool src_dev = kind != CopyKind::kHostToDevice;
    if (dst_dev) STRATA_RETURN_IF_ERROR(check_device(dst, bytes, "copy_async destination", kind));
    if (src_dev) STRATA_RETURN_IF_ERROR(check_device(src, bytes, "copy_async source", kind));
    const char* what = kind == CopyKind::kHostToDevice   ? "host-to-device copy"
                       : kind == CopyKind::kDeviceToHost ? "device-to-host copy"
                                                         : "device-to-device copy";
    s->enqueue(what, [=] {
      std::memmove(dst, src, bytes);
      return Status();
    });
    return Status();
  }

  Status fill_bytes_async(void* dst, std::size_t bytes, uint8_t value, DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(HostStream * s, stream_of(stream, "fill_bytes_async"));
    if (bytes == 0) return Status();
    STRATA_RETURN_IF_ERROR(check_device(dst, bytes, "fill_bytes_async"));
    s->enqueue("fill bytes", [=] {
      std::memset(dst, value, bytes);
      return Status();
    });
    return Status();
  }

  Status host_func_async(DeviceStream* stream, std::function<Status()> fn) override {
    STRATA_ASSIGN_OR_RETURN(HostStream * s, stream_of(stream, "host_func_async"));
    if (!fn) return Status(StatusCode::kInvalidArgument, "host_func_async: empty function");
    s->enqueue("host function", std::move(fn));
    return Status();
  }

  Status cast_async(void* dst, DType dst_type, const void* src, DType src_type, std::size_t count, float scale,
                    DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(HostStream * s, stream_of(stream, "cast_async"));
    STRATA_RETURN_IF_ERROR(check_dtype(dst_type, "cast_async"));
    STRATA_RETURN_IF_ERROR(check_dtype(src_type, "cast_async"));
    if (count == 0) return Status();
    STRATA_RETURN_IF_ERROR(check_device(dst, count * dtype_size(dst_type), "cast_async destination"));
    STRATA_RETURN_IF_ERROR(check_device(src, count * dtype_size(src_type), "cast_async source"));
    STRATA_RETURN_IF_ERROR(check_cast_operands(dst, dst_type, src, src_type, count));
    const int dt = static_cast<int>(dst_type), st = static_cast<int>(src_type);
    s->enqueue("cast", [=] {
      for (std::size_t i = 0; i < count; ++i)
        dm::store_from_f32(dst, dt, i, dm::apply_scale(dm::load_as_f32(src, st, i), scale));
      return Status();
    });
    return Status();
  }

  Status accumulate_async(float* dst, const void* src, DType src_type, std::size_t count, float scale,
                          DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(HostStream * s, stream_of(stream, "accumulate_async"));
    STRATA_RETURN_IF_ERROR(check_dtype(src_type, "accumulate_async"));
    if (count == 0) return Status();
    STRATA_RETURN_IF_ERROR(check_device(dst, count * sizeof(float), "accumulate_async destination"));
    STRATA_RETURN_IF_ERROR(check_device(src, count * dtype_size(src_type), "accumulate_async source"));
    const int st = static_cast<int>(src_type);
    s->enqueue("accumulate", [=] {
      for (std::size_t i = 0; i < count; ++i) dst[i] += dm::apply_scale(dm::load_as_f32(src, st, i), scale);
      return Status();
    });
    return Status();
  }

  Status sq_norm_async(const void* src, DType type, std::size_t count, NormStats* out, DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(HostStream * s, stream_of(stream, "sq_norm_async"));
    STRATA_RETURN_IF_ERROR(check_dtype(type, "sq_norm_async"));
    STRATA_RETURN_IF_ERROR(check_device(out, sizeof(NormStats), "sq_norm_async result"));
    if (reinterpret_cast<uintptr_t>(out) % alignof(NormStats) != 0)
      return Status(StatusCode::kInvalidArgument, "sq_norm_async: result must be 8-byte aligned");
    if (count) STRATA_RETURN_IF_ERROR(check_device(src, count * dtype_size(type), "sq_norm_async source"));
    const int t = static_cast<int>(type);
    s->enqueue("squared norm", [=] {
      double sum = 0;
      uint64_t bad = 0;
      for (std::size_t i = 0; i < count; ++i) {
        const float x = dm::load_as_f32(src, t, i);
        if (std::isfinite(x)) {
          sum += static_cast<double>(x) * static_cast<double>(x);
        } else {
          ++bad;
        }
      }
      out->sum_sq += sum;
      out->nonfinite += bad;
      return Status();
    });
    return Status();
  }

  Status adamw_async(const AdamWArgs& a, DeviceStream* stream) override {
    STRATA_ASSIGN_OR_RETURN(HostStream * s, stream_of(stream, "adamw_async"));
    STRATA_RETURN_IF_ERROR(check_dtype(a.grad_dtype, "adamw_async"));
    if (a.out) STRATA_RETURN_IF_ERROR(check_dtype(a.out_dtype, "adamw_async"));
    if (a.step < 1) return Status(StatusCode::kInvalidArgument, "adamw_async: step must be >= 1 (1-based)");
    if (a.count == 0) return Status();
    const std::size_t n = a.count;
    STRATA_RETURN_IF_ERROR(check_device(a.params, n * 4, "adamw_async params"));
    STRATA_RETURN_IF_ERROR(check_device(a.exp_avg, n * 4, "adamw_async exp_avg"));
    STRATA_RETURN_IF_ERROR(check_device(a.exp_avg_sq, n * 4, "adamw_async exp_avg_sq"));
    STRATA_RETURN_IF_ERROR(check_device(a.grads, n * dtype_size(a.grad_dtype), "adamw_async grads"));
    if (a.out) STRATA_RETURN_IF_ERROR(check_device(a.out, n * dtype_size(a.out_dtype), "adamw_async out"));
    const dm::AdamWConsts c = dm::adamw_consts(a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.step, a.grad_scale);
    float* p = a.params;
    float* m = a.exp_avg;
    float* v = a.exp_avg_sq;
    const void* g = a.grads;
    void* out = a.out;
    const int gt = static_cast<int>(a.grad_dtype), ot = static_cast<int>(a.out_dtype);
    s->enqueue("AdamW", [=] {
      for (std::size_t i = 0; i < n; ++i) {
        dm::adamw_element(c, dm::load_as_f32(g, gt, i), p[i], m[i], v[i]);
        if (out) dm::store_from_f32(out, ot, i, p[i]);
      }
      return Status();
    });
    return Status();
  }

 private:
  // Looks the handle up before touching it, so that a stream of another
  // backend or one already destroyed is an error here, not a crash.
  Result<HostStream*> stream_of(DeviceStream* s, const char* op) {
    if (!s) return Status(StatusCode::kInvalidArgument, std::string(op) + ": null stream");
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (streams_.count(s) == 0)
        return Status(StatusCode::kInvalidArgument,
                      std::string(op) + ": not a live stream of this backend (destroyed, or another backend's)");
    }
    if (s->owner() != this)
      return Status(StatusCode::kInvalidArgument,
                    std::string(op) + ": stream '" + s->name() + "' belongs to another backend");
    return static_cast<HostStream*>(s);
  }
  Result<HostEvent*> event_of(DeviceEvent* e, const char* op) {
    if (!e) return Status(StatusCode::kInvalidArgument, std::string(op) + ": null event");
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (events_.count(e) == 0)
        return Status(StatusCode::kInvalidArgument,
                      std::string(op) + ": not a live event of this backend (destroyed, or another backend's)");
    }
    if (e->owner() != this)
      return Status(StatusCode::kInvalidArgument, std::string(op) + ": the event belongs to another backend");
    return static_cast<HostEvent*>(e);
  }
  bool holds(const void* ptr, std::size_t bytes) const override { return pool_->contains(ptr, bytes); }
  Status check_device(const void* p, std::size_t bytes, const char* what) const {
    if (!pool_->contains(p, bytes))
      return Status(StatusCode::kInvalidArgument,
                    std::string(what) + ": " + std::to_string(bytes) +
                        " bytes are not inside one live device allocation (host pointer, freed block or overrun?)");
    return Status();
  }
  Status check_device(const void* p, std::size_t bytes, const char* what, CopyKind kind) const {
    Status st = check_device(p, bytes, what);
    if (!st.ok()) return st.with_context(copy_kind_name(kind));
    return st;
  }
  static Status check_dtype(DType t, const char* op) {
    if (t != DType::kF32 && t != DType::kBF16 && t != DType::kF16)
      return Status(StatusCode::kInvalidArgument,
                    std::string(op) + ": unknown dtype " + std::to_string(static_cast<int>(t)));
    return Status();
  }

  RamSlabs slabs_;
  std::unique_ptr<CachingAllocator> pool_;
  mutable std::mutex mu_;  // guards the sets below
  std::set<DeviceStream*> streams_;
  std::set<DeviceEvent*> events_;
};

}  // namespace

Result<std::unique_ptr<DeviceBackend>> create_host_backend(const HostBackendOptions& options) {
  if (options.budget_bytes == 0)
    return Status(StatusCode::kInvalidArgument, "host device backend: the memory budget must be > 0");
  return std::unique_ptr<DeviceBackend>(new HostBackend(options));
}

}  // namespace strata
