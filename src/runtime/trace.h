// Tracing: Chrome / Perfetto trace-event JSON of what the runtime did and when,
// so a user can see whether NVMe reads, host<->device copies, optimizer chunks
// and their own compute overlap. Open the file in https://ui.perfetto.dev or
// chrome://tracing. docs/tracing.md describes the categories and event names.
//
//   auto tracer = Tracer::open("/tmp/step.trace.json");   // Result<unique_ptr>
//   {
//     TraceSpan span(**tracer, "nvme_read", trace_cat::kIo, {{"bytes", n}});
//     ... the work ...
//   }                                                     // one "X" event
//   (*tracer)->close();                                    // writes the file
//
// Cost. A disabled tracer (Tracer::disabled(), or a default-constructed one,
// or one already closed) costs one predictable branch per span and touches no
// shared memory. An enabled tracer appends each event to a buffer owned by the
// calling thread: no lock, no shared atomic per event (a thread takes the
// tracer's mutex once, on its first event, and a global counter is touched
// once per 1024 events for the memory cap). Events are formatted only at
// close().
//
// Thread-safety. complete(), TraceSpan, set_thread_name() and add_track() may
// be called from any thread at any time, also concurrently with close(): an
// event that races with close() is either in the file or dropped, never torn.
// The Tracer must outlive every thread's use of it (spans in flight included).
//
// Lifetimes. Event names, categories and argument keys are `const char*` that
// must live as long as the tracer (string literals); complete_copy() copies a
// name built at run time. String argument values are also borrowed.
#pragma once

#include <atomic>
#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace strata {

// The categories the runtime uses ("cat" in the file; Perfetto can filter by it).
namespace trace_cat {
inline constexpr const char kIo[] = "io";            // nvme_read, nvme_write
inline constexpr const char kCopy[] = "copy";        // h2d, d2h
inline constexpr const char kOptim[] = "optim";      // optimizer_chunk
inline constexpr const char kCompute[] = "compute";  // the caller's own spans (forward, backward, ...)
inline constexpr const char kRuntime[] = "runtime";  // acquire/release waits, checkpoint save/load
}  // namespace trace_cat

// One "args" value of an event: an integer, a double or a borrowed string.
struct TraceArg {
  enum class Kind : uint8_t { kInt, kUint, kDouble, kString };
  const char* key = nullptr;
  Kind kind = Kind::kInt;
  union {
    int64_t i;
    uint64_t u;
    double d;
    const char* s;
  };

  TraceArg() : i(0) {}
  template <std::signed_integral T>
  TraceArg(const char* k, T v) : key(k), kind(Kind::kInt), i(static_cast<int64_t>(v)) {}
  template <std::unsigned_integral T>
  TraceArg(const char* k, T v) : key(k), kind(Kind::kUint), u(static_cast<uint64_t>(v)) {}
  TraceArg(const char* k, double v) : key(k), kind(Kind::kDouble), d(v) {}
  TraceArg(const char* k, const char* v) : key(k), kind(Kind::kString), s(v) {}
};
inline constexpr int kTraceMaxArgs = 4;  // further args are ignored

struct TraceOptions {
  std::string process_name = "strata";
  // Cap on buffered events (168 bytes each: 1 Mi events = 168 MiB); events past it are counted
  // as dropped and the count is written to the file ("otherData").
  uint64_t max_events = 1u << 20;
};

class Tracer {
 public:
  // A disabled tracer: every call is a no-op, close() returns ok.
  Tracer();
  ~Tracer();  // close(); an error is logged
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  // Creates (truncates) `path` now, so that a path that cannot be written is
  // reported before the run rather than at its end. Errors: the open(2)
  // failure as a Status naming the path (kNotFound, kPermission, ...).
  static Result<std::unique_ptr<Tracer>> open(const std::string& path, const TraceOptions& options = {});
  // A shared disabled tracer, for code that always wants a reference.
  static Tracer& disabled();

  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

  // Monotonic clock in nanoseconds (CLOCK_MONOTONIC, like steady_clock).
  static uint64_t now_ns();

  // Records a complete ("X") event from begin_ns to end_ns (now_ns() values)
  // on the calling thread, or on `track` (see add_track).
  void complete(const char* name, const char* cat, uint64_t begin_ns, uint64_t end_ns,
                std::initializer_list<TraceArg> args = {}, uint32_t track = 0);
  // The same with a name built at run time (copied; one allocation).
  void complete_copy(std::string_view name, const char* cat, uint64_t begin_ns, uint64_t end_ns,
                     std::initializer_list<TraceArg> args = {}, uint32_t track = 0);
  void complete_args(const char* name, const char* cat, uint64_t begin_ns, uint64_t end_ns, const TraceArg* args,
                     int nargs, uint32_t track = 0);

  // Names the calling thread in the trace (a "thread_name" metadata event).
  // Without it a thread gets its pthread name (pthread_setname_np), read when
  // it records its first event.
  void set_thread_name(std::string_view name);

  // A named timeline that is not a CPU thread (a CUDA copy stream, an I/O
  // queue), for events whose times were measured elsewhere. Returns a track
  // id for complete(); 0 when disabled. Events on one track should nest or
  // follow each other, as on a thread.
  uint32_t add_track(std::string_view name);

  // Writes every buffered event and closes the file; later events are
  // dropped. Idempotent. Errors: a write/close failure naming the path.
  Status close();

  const std::string& path() const { return path_; }
  uint64_t dropped_events() const { return dropped_.load(std::memory_order_relaxed); }

  struct ThreadBuffer;  // one per (tracer, thread); defined in trace.cpp

 private:
  void record(const char* name, std::string_view copied_name, const char* cat, uint64_t begin_ns, uint64_t end_ns,
              const TraceArg* args, int nargs, uint32_t track);
  ThreadBuffer* buffer_for_this_thread();
  ThreadBuffer* register_thread();

  std::atomic<bool> enabled_{false};
  uint64_t id_ = 0;  // unique per enabled tracer; keys the thread-local cache
  int fd_ = -1;
  std::string path_;
  TraceOptions options_;
  uint64_t origin_ns_ = 0;
  std::mutex mu_;  // registration, tracks, close
  std::vector<std::unique_ptr<ThreadBuffer>> buffers_;
  std::vector<std::string> tracks_;
  std::atomic<uint64_t> chunks_{0};
  std::atomic<uint64_t> dropped_{0};
  bool closed_ = false;
  Status close_status_;
};

// Records one complete event for the lifetime of the span (RAII). With a
// disabled tracer (or nullptr) it does nothing beyond one branch.
class TraceSpan {
 public:
  TraceSpan(Tracer& tracer, const char* name, const char* cat, std::initializer_list<TraceArg> args = {})
      : TraceSpan(&tracer, name, cat, args) {}
  TraceSpan(Tracer* tracer, const char* name, const char* cat, std::initializer_list<TraceArg> args = {}) {
    if (tracer != nullptr && tracer->enabled()) [[unlikely]] {
      start(tracer, name, cat, args);
    }
  }
  ~TraceSpan() {
    if (tracer_ != nullptr) [[unlikely]] {
      finish();
    }
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

  // Adds an argument known only at the end (bytes actually moved, status).
  void add_arg(TraceArg arg) {
    if (tracer_ != nullptr && nargs_ < kTraceMaxArgs) args_[nargs_++] = arg;
  }
  bool active() const { return tracer_ != nullptr; }

 private:
  void start(Tracer* tracer, const char* name, const char* cat, std::initializer_list<TraceArg> args);
  void finish();

  Tracer* tracer_ = nullptr;
  const char* name_ = nullptr;
  const char* cat_ = nullptr;
  uint64_t begin_ns_ = 0;
  int nargs_ = 0;
  TraceArg args_[kTraceMaxArgs];
};

}  // namespace strata
