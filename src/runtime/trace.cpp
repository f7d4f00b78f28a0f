#include "runtime/trace.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>

#include "common/log.h"
#include "common/posix_file.h"

namespace strata {

namespace {

constexpr uint32_t kChunkEvents = 1024;
constexpr uint32_t kTrackTidBase = 0x40000000;  // above any Linux tid (pid_max <= 2^22)

struct Event {
  const char* name;
  const char* cat;
  uint64_t begin_ns;
  uint64_t end_ns;
  uint32_t track;
  int nargs;
  TraceArg args[kTraceMaxArgs];
  std::string copied_name;  // complete_copy only
};
// trace.h and docs/tracing.md quote this size for the memory cap.
static_assert(sizeof(Event) == 168 || sizeof(void*) != 8, "update the event size in trace.h and docs/tracing.md");

std::atomic<uint64_t> g_next_tracer_id{1};

struct TlsCache {
  uint64_t tracer_id = 0;
  Tracer::ThreadBuffer* buffer = nullptr;
};
thread_local TlsCache t_cache;

void append_escaped(fmt::memory_buffer& out, std::string_view s) {
  for (char c : s) {
    switch (c) {
      case '"':
        out.append(std::string_view("\\\""));
        break;
      case '\\':
        out.append(std::string_view("\\\\"));
        break;
      case '\n':
        out.append(std::string_view("\\n"));
        break;
      case '\t':
        out.append(std::string_view("\\t"));
        break;
      case '\r':
        out.append(std::string_view("\\r"));
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          fmt::format_to(std::back_inserter(out), "\\u{:04x}", static_cast<unsigned>(c));
        } else {
          out.push_back(c);
        }
    }
  }
}

void append_string(fmt::memory_buffer& out, std::string_view s) {
  out.push_back('"');
  append_escaped(out, s);
  out.push_back('"');
}

// Microseconds with nanosecond digits: Chrome's "ts"/"dur" unit is µs.
void append_us(fmt::memory_buffer& out, uint64_t ns) {
  fmt::format_to(std::back_inserter(out), "{}.{:03}", ns / 1000, ns % 1000);
}

Status write_all(int fd, const char* p, std::size_t n, const std::string& path, uint64_t* offset) {
  while (n > 0) {
    ssize_t r = ::write(fd, p, n);
    if (r < 0) {
      if (errno == EINTR) continue;
      return Status::from_errno(errno, fmt::format("writing the trace {} at offset {}", path, *offset));
    }
    p += r;
    n -= static_cast<std::size_t>(r);
    *offset += static_cast<uint64_t>(r);
  }
  return {};
}

}  // namespace

// Events of one thread in a singly linked list of fixed chunks. Only the
// owning thread writes; close() reads concurrently. Publication is by the
// release store of `count` (and of `next` for a new chunk), so the reader
// sees only whole events.
struct Tracer::ThreadBuffer {
  struct Chunk {
    Event events[kChunkEvents];
    std::atomic<uint32_t> count{0};
    std::atomic<Chunk*> next{nullptr};
  };
  ThreadBuffer() : head(new Chunk), tail(head) {}
  ~ThreadBuffer() {
    Chunk* c = head;
    while (c) {
      Chunk* n = c->next.load(std::memory_order_relaxed);
      delete c;
      c = n;
    }
  }
  uint32_t tid = 0;
  std::string name;  // guarded by the tracer's mutex
  Chunk* head;
  Chunk* tail;  // owner only
};

Tracer::Tracer() = default;

Tracer::~Tracer() {
  Status st = close();
  if (!st.ok()) log_warn("trace: {}", st.message());
}

Tracer& Tracer::disabled() {
  static Tracer t;
  return t;
}

uint64_t Tracer::now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

Result<std::unique_ptr<Tracer>> Tracer::open(const std::string& path, const TraceOptions& options) {
  if (path.empty()) return Status(StatusCode::kInvalidArgument, "trace: empty file name");
  // Never over another file (the data, the weights) or into a FIFO.
  STRATA_RETURN_IF_ERROR(check_replaceable(path, "trace file", R"({"traceEvents":)"));
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::from_errno(errno, "creating the trace file " + path);
  std::unique_ptr<Tracer> t(new Tracer());
  t->fd_ = fd;
  t->path_ = path;
  t->options_ = options;
  t->id_ = g_next_tracer_id.fetch_add(1, std::memory_order_relaxed);
  t->origin_ns_ = now_ns();
  t->enabled_.store(true, std::memory_order_release);
  return t;
}

Tracer::ThreadBuffer* Tracer::register_thread() {
  const uint32_t tid = static_cast<uint32_t>(::syscall(SYS_gettid));
  std::lock_guard<std::mutex> lock(mu_);
  // A thread that alternates between two tracers comes back here; find its
  // buffer rather than making a second one.
  for (auto& b : buffers_) {
    if (b->tid == tid) return b.get();
  }
  auto b = std::make_unique<ThreadBuffer>();
  b->tid = tid;
  char name[64] = {};
  if (pthread_getname_np(pthread_self(), name, sizeof(name)) == 0 && name[0] != '\0') {
    b->name = name;
  } else {
    b->name = fmt::format("thread {}", tid);
  }
  chunks_.fetch_add(1, std::memory_order_relaxed);
  buffers_.push_back(std::move(b));
  return buffers_.back().get();
}

Tracer::ThreadBuffer* Tracer::buffer_for_this_thread() {
  if (t_cache.tracer_id == id_) [[likely]] {
    return t_cache.buffer;
  }
  ThreadBuffer* b = register_thread();
  t_cache.tracer_id = id_;
  t_cache.buffer = b;
  return b;
}

void Tracer::complete_args(const char* name, const char* cat, uint64_t begin_ns, uint64_t end_ns, const TraceArg* args,
                           int nargs, uint32_t track) {
  if (!enabled()) return;
  record(name, std::string_view(), cat, begin_ns, end_ns, args, nargs, track);
}

void Tracer::record(const char* name, std::string_view copied_name, const char* cat, uint64_t begin_ns, uint64_t end_ns,
                    const TraceArg* args, int nargs, uint32_t track) {
  ThreadBuffer* b = buffer_for_this_thread();
  ThreadBuffer::Chunk* c = b->tail;
  uint32_t n = c->count.load(std::memory_order_relaxed);
  if (n == kChunkEvents) {
    // The cap is checked per chunk, so the shared counter is touched once per
    // kChunkEvents events, not per event.
    if ((chunks_.fetch_add(1, std::memory_order_relaxed) + 1) * kChunkEvents > options_.max_events) {
      chunks_.fetch_sub(1, std::memory_order_relaxed);
      dropped_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    auto* fresh = new ThreadBuffer::Chunk;
    c->next.store(fresh, std::memory_order_release);
    b->tail = c = fresh;
    n = 0;
  }
  Event& e = c->events[n];
  e.name = name;
  e.cat = cat;
  e.begin_ns = begin_ns;
  e.end_ns = end_ns < begin_ns ? begin_ns : end_ns;
  e.track = track;
  e.nargs = std::clamp(nargs, 0, kTraceMaxArgs);
  for (int i = 0; i < e.nargs; ++i) e.args[i] = args[i];
  if (!name) e.copied_name.assign(copied_name);
  c->count.store(n + 1, std::memory_order_release);
}

void Tracer::complete(const char* name, const char* cat, uint64_t begin_ns, uint64_t end_ns,
                      std::initializer_list<TraceArg> args, uint32_t track) {
  if (!enabled()) return;
  record(name, std::string_view(), cat, begin_ns, end_ns, args.begin(), static_cast<int>(args.size()), track);
}

void Tracer::complete_copy(std::string_view name, const char* cat, uint64_t begin_ns, uint64_t end_ns,
                           std::initializer_list<TraceArg> args, uint32_t track) {
  if (!enabled()) return;
  record(nullptr, name, cat, begin_ns, end_ns, args.begin(), static_cast<int>(args.size()), track);
}

void Tracer::set_thread_name(std::string_view name) {
  if (!enabled()) return;
  ThreadBuffer* b = buffer_for_this_thread();
  std::lock_guard<std::mutex> lock(mu_);
  b->name.assign(name);
}

uint32_t Tracer::add_track(std::string_view name) {
  if (!enabled()) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  tracks_.emplace_back(name);
  return kTrackTidBase + static_cast<uint32_t>(tracks_.size());
}

Status Tracer::close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_ || fd_ < 0) {
    closed_ = true;
    return close_status_;
  }
  closed_ = true;
  enabled_.store(false, std::memory_order_release);
  const int pid = static_cast<int>(::getpid());

  struct Ref {
    const Event* e;
    uint32_t tid;
  };
  std::vector<Ref> events;
  for (auto& b : buffers_) {
    for (auto* c = b->head; c != nullptr; c = c->next.load(std::memory_order_acquire)) {
      const uint32_t n = c->count.load(std::memory_order_acquire);
      for (uint32_t i = 0; i < n; ++i)
        events.push_back({&c->events[i], c->events[i].track ? c->events[i].track : b->tid});
    }
  }
  // By timeline, then start time, the enclosing span first: viewers nest
  // spans by order, and a file sorted like this reads well as text too.
  std::stable_sort(events.begin(), events.end(), [](const Ref& a, const Ref& b) {
    if (a.tid != b.tid) return a.tid < b.tid;
    if (a.e->begin_ns != b.e->begin_ns) return a.e->begin_ns < b.e->begin_ns;
    return a.e->end_ns > b.e->end_ns;
  });

  fmt::memory_buffer out;
  uint64_t offset = 0;
  Status st;
  auto flush = [&](bool force) {
    if (!st.ok() || (!force && out.size() < (1u << 20))) return;
    st = write_all(fd_, out.data(), out.size(), path_, &offset);
    out.clear();
  };
  fmt::format_to(
      std::back_inserter(out),
      "{{\"traceEvents\":[\n{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{},\"tid\":0,\"args\":{{\"name\":", pid);
  append_string(out, options_.process_name);
  out.append(std::string_view("}}"));
  for (auto& b : buffers_) {
    fmt::format_to(std::back_inserter(out),
                   ",\n{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":{},\"tid\":{},\"args\":{{\"name\":", pid,
                   b->tid);
    append_string(out, b->name);
    out.append(std::string_view("}}"));
  }
  for (std::size_t i = 0; i < tracks_.size(); ++i) {
    fmt::format_to(std::back_inserter(out),
                   ",\n{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":{},\"tid\":{},\"args\":{{\"name\":", pid,
                   kTrackTidBase + i + 1);
    append_string(out, tracks_[i]);
    out.append(std::string_view("}}"));
  }
  for (const Ref& r : events) {
    const Event& e = *r.e;
    out.append(std::string_view(",\n{\"name\":"));
    append_string(out, e.name ? std::string_view(e.name) : std::string_view(e.copied_name));
    out.append(std::string_view(",\"cat\":"));
    append_string(out, e.cat ? e.cat : "");
    out.append(std::string_view(",\"ph\":\"X\",\"ts\":"));
    append_us(out, e.begin_ns > origin_ns_ ? e.begin_ns - origin_ns_ : 0);
    out.append(std::string_view(",\"dur\":"));
    append_us(out, e.end_ns - e.begin_ns);
    fmt::format_to(std::back_inserter(out), ",\"pid\":{},\"tid\":{}", pid, r.tid);
    if (e.nargs > 0) {
      out.append(std::string_view(",\"args\":{"));
      for (int a = 0; a < e.nargs; ++a) {
        const TraceArg& arg = e.args[a];
        if (a) out.push_back(',');
        append_string(out, arg.key ? arg.key : "");
        out.push_back(':');
        switch (arg.kind) {
          case TraceArg::Kind::kInt:
            fmt::format_to(std::back_inserter(out), "{}", arg.i);
            break;
          case TraceArg::Kind::kUint:
            fmt::format_to(std::back_inserter(out), "{}", arg.u);
            break;
          case TraceArg::Kind::kDouble:
            // JSON has no inf/nan.
            if (std::isfinite(arg.d))
              fmt::format_to(std::back_inserter(out), "{}", arg.d);
            else
              append_string(out, fmt::format("{}", arg.d));
            break;
          case TraceArg::Kind::kString:
            append_string(out, arg.s ? arg.s : "");
            break;
        }
      }
      out.push_back('}');
    }
    out.push_back('}');
    flush(false);
  }
  fmt::format_to(std::back_inserter(out), "\n],\"displayTimeUnit\":\"ns\",\"otherData\":{{\"dropped_events\":{}}}}}\n",
                 dropped_.load(std::memory_order_relaxed));
  flush(true);
  if (::close(fd_) != 0 && st.ok()) st = Status::from_errno(errno, "closing the trace " + path_);
  fd_ = -1;
  close_status_ = st;
  return st;
}

void TraceSpan::start(Tracer* tracer, const char* name, const char* cat, std::initializer_list<TraceArg> args) {
  tracer_ = tracer;
  name_ = name;
  cat_ = cat;
  for (const TraceArg& a : args) {
    if (nargs_ == kTraceMaxArgs) break;
    args_[nargs_++] = a;
  }
  begin_ns_ = Tracer::now_ns();
}

void TraceSpan::finish() {
  tracer_->complete_args(name_, cat_, begin_ns_, Tracer::now_ns(), args_, nargs_);
}

}  // namespace strata
