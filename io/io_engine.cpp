// IoEngine: request splitting, the I/O thread, completion, and backend choice.
#include "io/io_engine.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>

#include "common/enum_names.h"
#include "common/log.h"
#include "common/threads.h"
#include "common/tunables.h"
#include "io/fault_injection.h"
#include "io/io_backend.h"

namespace strata {
template <>
inline constexpr auto kEnumNames<io::IoOpKind> =
    std::to_array<EnumName<io::IoOpKind>>({{io::IoOpKind::kRead, "read"}, {io::IoOpKind::kWrite, "write"}});
}  // namespace strata

namespace strata::io {

const char* io_op_name(IoOpKind op) { return enum_name(op); }

namespace detail {
struct RequestState {
  std::atomic<std::uint32_t> done{0};
  Status status;  // written before `done` is released
};
}  // namespace detail

bool IoHandle::poll() const {
  return !state_ || state_->done.load(std::memory_order_acquire) != 0;
}

Status IoHandle::wait() const {
  if (!state_) return {};
  while (state_->done.load(std::memory_order_acquire) == 0) state_->done.wait(0, std::memory_order_acquire);
  return state_->status;
}

namespace {

constexpr unsigned kMaxRetries = 1000;  // EINTR/EAGAIN storms end as errors, never as hangs
constexpr std::uint64_t kPage = 4096;

std::uint64_t align_up(std::uint64_t v, std::uint64_t a) {
  return (v + a - 1) / a * a;
}

// A request on the I/O thread.
struct Pending {
  std::shared_ptr<detail::RequestState> state;
  IoCallback callback;
  IoCheck check;
  std::vector<IoRequest> parts;
  std::size_t part = 0;      // next part to issue pieces from
  std::uint64_t cursor = 0;  // bytes of parts[part] already issued
  std::uint32_t in_flight = 0;
  Status error;  // first error
  bool issued_all() const { return part >= parts.size(); }
};

// One piece in flight. BackendOp comes first so a BackendOp* is a Piece*.
struct Piece {
  BackendOp op;
  Pending* req = nullptr;
  const IoRequest* part = nullptr;
  std::uint64_t offset = 0;  // file offset of the bytes still to move
  std::uint64_t length = 0;  // bytes still to move
  char* buf = nullptr;
  bool direct = false;
  unsigned retries = 0;
};
static_assert(std::is_standard_layout_v<Piece>);

// Direct-I/O alignment of an open file: statx(STATX_DIOALIGN) where the kernel
// and filesystem report it, else the logical block size of the block device
// under it (sysfs, which also covers partitions), else 4096.
void query_alignment(int fd, std::uint32_t* offset_align, std::uint32_t* mem_align) {
  *offset_align = 0;
  *mem_align = 0;
#ifdef STATX_DIOALIGN
  struct statx sx {};
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
      sx.stx_dio_offset_align > 0) {
    *offset_align = sx.stx_dio_offset_align;
    *mem_align = sx.stx_dio_mem_align;
  }
#endif
  if (*offset_align == 0) {
    struct stat st {};
    if (fstat(fd, &st) == 0) {
      std::string base = "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" + std::to_string(minor(st.st_dev));
      for (const char* rel : {"/queue/logical_block_size", "/../queue/logical_block_size"}) {
        std::ifstream in(base + rel);
        unsigned v = 0;
        if (in >> v && v >= 512 && (v & (v - 1)) == 0) {
          *offset_align = v;
          break;
        }
      }
    }
  }
  if (*offset_align == 0) *offset_align = 4096;
  if (*mem_align == 0) *mem_align = *offset_align;
}

}  // namespace

// ---------------------------------------------------------------- the engine

class IoEngineImpl final : public IoEngine {
 public:
  IoEngineImpl(const IoEngineOptions& o, unsigned qd, std::uint64_t block)
      : options_(o), qd_(qd), block_(block), registrar_(this) {}

  ~IoEngineImpl() override {
    if (!thread_.joinable()) return;
    (void)wait_all_internal();
    {
      // Files must go before their engine; if some did not, detach them so
      // their destructors only close descriptors.
      std::lock_guard<std::mutex> lock(files_mu_);
      if (!files_.empty())
        log_error("I/O engine destroyed with {} file(s) still open (e.g. {}): close files first", files_.size(),
                  (*files_.begin())->path_);
      for (IoFile* f : files_) f->engine_ = nullptr;
    }
    {
      std::lock_guard<std::mutex> lock(in_mu_);
      stop_ = true;
    }
    in_nonempty_.store(true);
    backend_->wake();
    thread_.join();
  }

  Status start(std::unique_ptr<IoBackend> backend) {
    backend_ = std::move(backend);
    slots_.resize(qd_);
    free_.reserve(qd_);
    for (auto& s : slots_) free_.push_back(&s);
    auto fut = started_.get_future();
    STRATA_RETURN_IF_ERROR(start_thread(thread_, "I/O engine: cannot start its thread", [this] { run(started_); }));
    Status st = fut.get();
    if (!st.ok()) {
      thread_.join();
      thread_ = std::thread();
    }
    return st;
  }

  void set_fallback_reason(std::string r) { fallback_reason_ = std::move(r); }

  const char* backend_name() const override { return backend_->name(); }
  const std::string& fallback_reason() const override { return fallback_reason_; }
  unsigned queue_depth() const override { return qd_; }
  std::uint64_t block_bytes() const override { return block_; }

  Result<std::unique_ptr<IoFile>> open(const std::string& path, const IoOpenOptions& o) override;

  IoHandle submit(const IoRequest& request, IoCallback callback) override {
    return submit_group(std::span<const IoRequest>(&request, 1), std::move(callback));
  }

  IoHandle submit_group(std::span<const IoRequest> requests, IoCallback callback) override {
    return submit_checked(requests, {}, std::move(callback));
  }

  IoHandle submit_checked(std::span<const IoRequest> requests, IoCheck check, IoCallback callback) override {
    auto p = std::make_unique<Pending>();
    p->state = std::make_shared<detail::RequestState>();
    p->callback = std::move(callback);
    p->check = std::move(check);
    p->parts.reserve(requests.size());
    for (const IoRequest& r : requests) {
      if (!r.file || (!r.buffer && r.length > 0)) {
        p->error = Status(StatusCode::kInvalidArgument,
                          std::string(io_op_name(r.op)) + " request without a " + (r.file ? "buffer" : "file"));
        break;
      }
      if (r.op == IoOpKind::kWrite && !r.file->writable_) {
        p->error = Status(StatusCode::kInvalidArgument, "write of " + std::to_string(r.length) + " bytes at offset " +
                                                            std::to_string(r.offset) + " in " + r.file->path() +
                                                            " refused: the file was opened read-only");
        break;
      }
      if (r.length > 0) p->parts.push_back(r);
    }
    if (!p->error.ok()) p->parts.clear();
    return enqueue(std::move(p));
  }

  IoHandle submit_failed(Status status, IoCallback callback) override {
    auto p = std::make_unique<Pending>();
    p->state = std::make_shared<detail::RequestState>();
    p->callback = std::move(callback);
    p->error = status.ok() ? Status(StatusCode::kInternal, "submit_failed with an ok status") : std::move(status);
    return enqueue(std::move(p));
  }

  Status wait_all() override { return wait_all_internal(); }
  std::size_t poll() const override { return outstanding_.load(std::memory_order_acquire); }
  HostMemoryRegistrar* buffer_registrar() override { return &registrar_; }

  Stats stats() const override {
    Stats s;
    s.requests = st_requests_.load(std::memory_order_relaxed);
    s.pieces = st_pieces_.load(std::memory_order_relaxed);
    s.submit_calls = st_submits_.load(std::memory_order_relaxed);
    s.resubmissions = st_resubmits_.load(std::memory_order_relaxed);
    s.fixed_buffer_pieces = st_fixed_.load(std::memory_order_relaxed);
    s.buffered_pieces = st_buffered_.load(std::memory_order_relaxed);
    return s;
  }

  // Runs fn on the I/O thread (inline when already there) and waits for it.
  template <typename Fn>
  auto run_on_io_thread(Fn fn) -> decltype(fn()) {
    if (std::this_thread::get_id() == thread_id_) return fn();
    std::packaged_task<decltype(fn())()> task(std::move(fn));
    auto fut = task.get_future();
    {
      std::lock_guard<std::mutex> lock(in_mu_);
      in_tasks_.emplace_back([&task] { task(); });
    }
    notify_io_thread();
    return fut.get();
  }

  void forget_file(IoFile* f) {
    if (f->fixed_index_ >= 0) run_on_io_thread([&] { backend_->unregister_file(f->fixed_index_); });
    std::lock_guard<std::mutex> lock(files_mu_);
    files_.erase(f);
  }

 private:
  // Registers pinned-pool slabs as io_uring fixed buffers.
  class Registrar final : public HostMemoryRegistrar {
   public:
    explicit Registrar(IoEngineImpl* e) : e_(e) {}
    const char* name() const override { return "io fixed buffers"; }
    Status register_memory(void* ptr, std::size_t bytes) override {
      if (!e_->options_.fixed_buffers) return {};
      e_->run_on_io_thread([&] {
        int err = 0;
        int idx = e_->backend_->register_buffer(ptr, bytes, &err);
        if (idx >= 0) {
          auto start = reinterpret_cast<std::uintptr_t>(ptr);
          e_->buffers_[start] = {start + bytes, idx};
        } else if (err == ENOMEM || err == EPERM) {
          rlimit lim{};
          getrlimit(RLIMIT_MEMLOCK, &lim);
          std::string limit =
              lim.rlim_cur == RLIM_INFINITY ? std::string("unlimited") : std::to_string(lim.rlim_cur / 1024) + " KiB";
          log_once(LogLevel::kWarn, "io-fixed-buffers-memlock",
                   fmt::format("io_uring could not register {} bytes as fixed buffers ({}): RLIMIT_MEMLOCK "
                               "(`ulimit -l`) is {}; using them as plain buffers. Raise the limit above the "
                               "pinned pool's budget (`ulimit -l unlimited`, LimitMEMLOCK=infinity in systemd, "
                               "or memlock in /etc/security/limits.conf) for faster I/O",
                               bytes, std::strerror(err), limit));
        } else if (err != 0) {
          log_once(LogLevel::kInfo, "io-fixed-buffers-other",
                   fmt::format("io_uring could not register {} bytes as fixed buffers ({}): using plain buffers", bytes,
                               std::strerror(err)));
        }
      });
      return {};
    }
    void unregister_memory(void* ptr) override {
      e_->run_on_io_thread([&] {
        auto it = e_->buffers_.find(reinterpret_cast<std::uintptr_t>(ptr));
        if (it == e_->buffers_.end()) return;
        e_->backend_->unregister_buffer(it->second.index);
        e_->buffers_.erase(it);
      });
    }

   private:
    IoEngineImpl* e_;
  };
  struct BufferRange {
    std::uintptr_t end;
    int index;
  };

  // Nothing after the push can throw: a submit that throws (std::bad_alloc)
  // has enqueued nothing and will never call its callback.
  IoHandle enqueue(std::unique_ptr<Pending> p) {
    IoHandle h(p->state);
    {
      std::lock_guard<std::mutex> lock(in_mu_);
      in_reqs_.push_back(p.get());  // may throw: nothing has changed yet
      p.release();
      // Counted before the I/O thread, which takes in_reqs_ under in_mu_, can complete it.
      outstanding_.fetch_add(1, std::memory_order_acq_rel);
    }
    notify_io_thread();
    return h;
  }

  // The I/O thread announces `sleeping_` before it blocks and re-checks
  // `in_nonempty_`; submitters set `in_nonempty_` then check `sleeping_`. With
  // sequentially consistent accesses one side always sees the other, so a
  // request is never left waiting, and a busy I/O thread costs no wake-ups.
  void notify_io_thread() {
    in_nonempty_.store(true);
    if (sleeping_.load()) backend_->wake();
  }

  Status wait_all_internal() {
    std::size_t v;
    while ((v = outstanding_.load(std::memory_order_acquire)) != 0) outstanding_.wait(v);
    std::lock_guard<std::mutex> lock(err_mu_);
    Status s = std::move(first_error_);
    first_error_ = Status();
    return s;
  }

  // ------------------------------------------------------------ I/O thread
  void run(std::promise<Status>& started) {
    thread_id_ = std::this_thread::get_id();
    Status st = backend_->start();
    started.set_value(st);
    if (!st.ok()) return;
    std::vector<BackendOp*> batch;
    std::vector<BackendOp*> done(qd_);
    batch.reserve(qd_);
    for (;;) {
      bool stop = take_incoming();
      if (stop && in_flight_ == 0 && issue_queue_.empty() && retry_.empty()) break;
      fill(batch);
      if (!batch.empty()) {
        backend_->submit(batch.data(), batch.size());
        st_submits_.fetch_add(1, std::memory_order_relaxed);
        st_pieces_.fetch_add(batch.size(), std::memory_order_relaxed);
        batch.clear();
      }
      sleeping_.store(true);
      bool block = !in_nonempty_.load();
      std::size_t n = backend_->reap(done.data(), done.size(), block);
      sleeping_.store(false);
      for (std::size_t i = 0; i < n; ++i) on_complete(reinterpret_cast<Piece*>(done[i]));
    }
  }

  bool take_incoming() {
    std::vector<Pending*> reqs;
    std::vector<std::function<void()>> tasks;
    bool stop;
    {
      std::lock_guard<std::mutex> lock(in_mu_);
      reqs.swap(in_reqs_);
      tasks.swap(in_tasks_);
      in_nonempty_.store(false);
      stop = stop_;
    }
    for (auto& t : tasks) t();
    for (Pending* p : reqs) {
      if (p->issued_all()) {
        complete(p);  // invalid or already failed: nothing to issue
      } else {
        issue_queue_.push_back(p);
      }
    }
    return stop;
  }

  // Takes the next piece of the request at the front of the queue.
  void next_piece(Pending* r, Piece* p) {
    const IoRequest& part = r->parts[r->part];
    IoFile* f = part.file;
    std::uint64_t off = part.offset + r->cursor;
    std::uint64_t rem = part.length - r->cursor;
    char* buf = static_cast<char*>(part.buffer) + r->cursor;
    std::uint64_t len;
    bool direct = false;
    if (!f->direct()) {
      len = std::min(rem, block_);
    } else {
      const std::uint64_t a = f->offset_align_;
      if (off % a != 0) {
        len = std::min(rem, align_up(off, a) - off);  // unaligned head: through the page cache
      } else if (rem < a) {
        len = rem;  // unaligned tail
      } else {
        len = std::min(rem / a * a, block_);
        direct = reinterpret_cast<std::uintptr_t>(buf) % f->mem_align_ == 0;
        if (!direct)
          log_once(LogLevel::kInfo, "io-misaligned-buffer",
                   fmt::format("a buffer not aligned to {} bytes is used through the page cache (O_DIRECT needs "
                               "aligned buffers; the pinned pool's are)",
                               f->mem_align_));
      }
    }
    p->req = r;
    p->part = &part;
    p->offset = off;
    p->length = len;
    p->buf = buf;
    p->direct = direct;
    p->retries = 0;
    r->cursor += len;
    if (r->cursor == part.length) {
      ++r->part;
      r->cursor = 0;
    }
  }

  void prepare(Piece* p) {
    IoFile* f = p->part->file;
    BackendOp& op = p->op;
    op.kind = p->part->op;
    op.direct = p->direct;
    op.fd = p->direct ? f->direct_fd_ : f->buffered_fd_;
    op.fixed_file = p->direct ? f->fixed_index_ : -1;
    op.offset = p->offset;
    op.length = static_cast<std::uint32_t>(p->length);
    op.buf = p->buf;
    op.result = 0;
    op.fixed_buffer = -1;
    if (!buffers_.empty()) {
      auto b = reinterpret_cast<std::uintptr_t>(p->buf);
      auto it = buffers_.upper_bound(b);
      if (it != buffers_.begin()) {
        --it;
        if (b + p->length <= it->second.end) op.fixed_buffer = it->second.index;
      }
    }
    if (op.fixed_buffer >= 0) st_fixed_.fetch_add(1, std::memory_order_relaxed);
    if (!p->direct) st_buffered_.fetch_add(1, std::memory_order_relaxed);
  }

  void fill(std::vector<BackendOp*>& batch) {
    while (in_flight_ < qd_) {
      Piece* p;
      if (!retry_.empty()) {
        p = retry_.back();
        retry_.pop_back();
      } else {
        if (issue_queue_.empty()) break;
        Pending* r = issue_queue_.front();
        p = free_.back();
        free_.pop_back();
        next_piece(r, p);
        ++r->in_flight;
        if (r->issued_all()) issue_queue_.pop_front();
      }
      prepare(p);
      batch.push_back(&p->op);
      ++in_flight_;
    }
  }

  std::string describe(const Piece* p) const {
    return fmt::format("{} of {} bytes at offset {} in {} failed", io_op_name(p->part->op), p->length, p->offset,
                       p->part->file->path_);
  }

  void on_complete(Piece* p) {
    --in_flight_;
    Pending* r = p->req;
    const std::int64_t res = p->op.result;
    Status err;
    if (res < 0) {
      const int e = static_cast<int>(-res);
      if ((e == EINTR || e == EAGAIN) && ++p->retries <= kMaxRetries) {
        st_resubmits_.fetch_add(1, std::memory_order_relaxed);
        retry_.push_back(p);
        return;
      }
      if (e == ECANCELED) {
        // The engine cancels nothing: the kernel did, when io_uring could not
        // start the worker thread a request needs (RLIMIT_NPROC, a pids
        // cgroup). An I/O error naming that, not an interruption.
        err = Status(StatusCode::kIoError,
                     describe(p) + ": Operation canceled by the kernel: io_uring could not start a worker thread for it" +
                         thread_limit_hint() + "; STRATA_IO_BACKEND=aio needs no such thread");
      } else {
        err = Status::from_errno(e, describe(p));
      }
    } else if (res == 0) {
      if (p->part->op == IoOpKind::kRead) {
        struct stat st {};
        std::string size = fstat(p->part->file->buffered_fd_, &st) == 0
                               ? " (the file is " + std::to_string(st.st_size) + " bytes)"
                               : std::string();
        err = Status(StatusCode::kIoError, describe(p) + ": end of file" + size);
      } else {
        err = Status(StatusCode::kIoError, describe(p) + ": the write made no progress");
      }
    } else if (static_cast<std::uint64_t>(res) < p->length) {
      // Short transfer: resubmit the remainder (through the page cache if it
      // is no longer aligned for O_DIRECT).
      p->offset += static_cast<std::uint64_t>(res);
      p->buf += res;
      p->length -= static_cast<std::uint64_t>(res);
      p->retries = 0;
      if (p->direct) {
        const IoFile* f = p->part->file;
        p->direct = p->offset % f->offset_align_ == 0 && p->length % f->offset_align_ == 0 &&
                    reinterpret_cast<std::uintptr_t>(p->buf) % f->mem_align_ == 0;
      }
      st_resubmits_.fetch_add(1, std::memory_order_relaxed);
      retry_.push_back(p);
      return;
    }
    free_.push_back(p);
    --r->in_flight;
    if (!err.ok()) fail(r, std::move(err));
    if (r->issued_all() && r->in_flight == 0) complete(r);
  }

  // First error wins; no further pieces of the request are issued, the ones
  // in flight finish, then the request completes with the error.
  void fail(Pending* r, Status err) {
    if (r->error.ok()) r->error = std::move(err);
    if (!r->issued_all()) {
      r->part = r->parts.size();
      auto it = std::find(issue_queue_.begin(), issue_queue_.end(), r);
      if (it != issue_queue_.end()) issue_queue_.erase(it);
    }
  }

  void complete(Pending* r) {
    if (r->error.ok() && r->check) {
      try {
        r->error = r->check();
      } catch (const std::exception& e) {
        r->error = Status(StatusCode::kInternal, std::string("an I/O check threw: ") + e.what());
      }
    }
    if (r->callback) {
      try {
        r->callback(r->error);
      } catch (const std::exception& e) {
        log_error("an I/O completion callback threw: {}", e.what());
      } catch (...) {
        log_error("an I/O completion callback threw");
      }
    }
    if (!r->error.ok()) {
      std::lock_guard<std::mutex> lock(err_mu_);
      if (first_error_.ok()) first_error_ = r->error;
    }
    r->state->status = std::move(r->error);
    r->state->done.store(1, std::memory_order_release);
    r->state->done.notify_all();
    delete r;
    st_requests_.fetch_add(1, std::memory_order_relaxed);
    if (outstanding_.fetch_sub(1, std::memory_order_acq_rel) == 1) outstanding_.notify_all();
  }

  friend class IoFile;

  IoEngineOptions options_;
  const unsigned qd_;
  const std::uint64_t block_;
  std::unique_ptr<IoBackend> backend_;
  std::string fallback_reason_;
  Registrar registrar_;
  std::promise<Status> started_;  // a member: the I/O thread may still be inside set_value when start() returns
  std::thread thread_;
  std::thread::id thread_id_;

  // Submitters -> I/O thread.
  std::mutex in_mu_;
  std::vector<Pending*> in_reqs_;
  std::vector<std::function<void()>> in_tasks_;
  bool stop_ = false;
  std::atomic<bool> in_nonempty_{false};
  std::atomic<bool> sleeping_{false};

  // I/O thread only.
  std::deque<Pending*> issue_queue_;
  std::vector<Piece*> retry_;
  std::vector<Piece> slots_;
  std::vector<Piece*> free_;
  unsigned in_flight_ = 0;
  std::map<std::uintptr_t, BufferRange> buffers_;

  std::mutex files_mu_;
  std::set<IoFile*> files_;  // open files (to detach them if the engine goes first)

  std::atomic<std::size_t> outstanding_{0};
  std::mutex err_mu_;
  Status first_error_;

  std::atomic<std::uint64_t> st_requests_{0}, st_pieces_{0}, st_submits_{0}, st_resubmits_{0}, st_fixed_{0},
      st_buffered_{0};
};

// ---------------------------------------------------------------- files

IoFile::~IoFile() {
  if (engine_) engine_->forget_file(this);
  if (direct_fd_ >= 0) ::close(direct_fd_);
  if (buffered_fd_ >= 0) ::close(buffered_fd_);
}

Result<std::uint64_t> IoFile::size() const {
  struct stat st {};
  if (fstat(buffered_fd_, &st) != 0) return Status::from_errno(errno, "fstat of " + path_ + " failed");
  return static_cast<std::uint64_t>(st.st_size);
}

Status IoFile::preallocate(std::uint64_t offset, std::uint64_t bytes) {
  if (bytes == 0) return {};
  int rc;
  do {
    rc = ::fallocate(buffered_fd_, 0, static_cast<off_t>(offset), static_cast<off_t>(bytes));
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return {};
  const int err = errno;
  if (err == EOPNOTSUPP || err == ENOSYS) {
    log_once(
        LogLevel::kInfo, "io-no-fallocate",
        "the filesystem of " + path_ + " has no fallocate: extending files with ftruncate (space is not reserved)");
    STRATA_ASSIGN_OR_RETURN(std::uint64_t cur, size());
    if (cur >= offset + bytes) return {};
    if (::ftruncate(buffered_fd_, static_cast<off_t>(offset + bytes)) == 0) return {};
    return Status::from_errno(errno, fmt::format("extending {} to {} bytes failed", path_, offset + bytes));
  }
  return Status::from_errno(err, fmt::format("preallocating {} bytes at offset {} in {} failed", bytes, offset, path_));
}

Status IoFile::sync() {
  if (::fdatasync(buffered_fd_) != 0) return Status::from_errno(errno, "fdatasync of " + path_ + " failed");
  return {};
}

Result<std::unique_ptr<IoFile>> IoEngineImpl::open(const std::string& path, const IoOpenOptions& o) {
  int flags = (o.write ? O_RDWR : O_RDONLY) | O_CLOEXEC;
  if (o.create) flags |= O_CREAT;
  if (o.create && o.exclusive) flags |= O_EXCL;
  if (o.truncate) flags |= O_TRUNC;
  std::unique_ptr<IoFile> f(new IoFile());
  f->path_ = path;
  f->writable_ = o.write;
  // Whether this open creates the file (a later failure then removes it):
  // known for certain by creating it exclusively first.
  bool creates = false;
  if (o.create) {
    f->buffered_fd_ = ::open(path.c_str(), flags | O_EXCL, static_cast<mode_t>(o.mode));
    creates = f->buffered_fd_ >= 0;
    if (!creates && errno == EEXIST && !o.exclusive)
      f->buffered_fd_ = ::open(path.c_str(), flags, static_cast<mode_t>(o.mode));
  } else {
    f->buffered_fd_ = ::open(path.c_str(), flags, static_cast<mode_t>(o.mode));
  }
  if (f->buffered_fd_ < 0) return Status::from_errno(errno, "opening " + path + " failed");
  if (o.direct) {
    int dflags = (flags & ~(O_CREAT | O_EXCL | O_TRUNC)) | O_DIRECT;
    f->direct_fd_ = ::open(path.c_str(), dflags);
    if (f->direct_fd_ < 0) {
      const int err = errno;
      if (err != EINVAL) {
        if (creates) ::unlink(path.c_str());  // no empty file left behind (EMFILE, ENOMEM)
        return Status::from_errno(err, "opening " + path + " with O_DIRECT failed");
      }
      struct stat st {};
      fstat(f->buffered_fd_, &st);
      log_once(LogLevel::kWarn, fmt::format("io-no-odirect-{}", static_cast<unsigned long>(st.st_dev)),
               fmt::format("the filesystem of {} refuses O_DIRECT: using buffered I/O (the page cache) for files "
                           "on it",
                           path));
    }
  }
  std::uint32_t oa = 4096, ma = 4096;
  query_alignment(f->direct() ? f->direct_fd_ : f->buffered_fd_, &oa, &ma);
  f->offset_align_ = std::max<std::uint32_t>(oa, kPage);
  f->mem_align_ = ma;
  if (f->direct() && options_.register_files) {
    int fd = f->direct_fd_;
    f->fixed_index_ = run_on_io_thread([&] { return backend_->register_file(fd); });
  }
  f->engine_ = this;
  std::lock_guard<std::mutex> lock(files_mu_);
  files_.insert(f.get());
  return f;
}

// ---------------------------------------------------------------- factory

namespace {

std::unique_ptr<IoBackend> make_backend(const std::string& name, const BackendConfig& c) {
  if (name == "uring") return make_uring_backend(c);
  if (name == "aio") return make_aio_backend(c);
  return make_posix_backend(c);
}

const char* build_option(const std::string& name) {
  return name == "uring" ? "STRATA_URING" : "STRATA_AIO";
}

}  // namespace

std::vector<std::string> io_backends_built() {
  std::vector<std::string> v;
  BackendConfig c;
  if (make_uring_backend(c)) v.push_back("uring");
  if (make_aio_backend(c)) v.push_back("aio");
  v.push_back("posix");
  return v;
}

Result<std::unique_ptr<IoEngine>> make_io_engine(const IoEngineOptions& options) {
  const Tunables& t = tunables();
  std::string name = options.backend.empty() ? t.io_backend : options.backend;
  if (name.empty()) name = "auto";
  std::vector<std::string> order;
  if (name == "auto" || name == "uring")
    order = {"uring", "aio", "posix"};
  else if (name == "aio")
    order = {"aio", "posix"};
  else if (name == "posix")
    order = {"posix"};
  else
    return Status(StatusCode::kInvalidArgument,
                  "unknown I/O backend '" + name + "' (expected uring, aio, posix or auto)");

  const unsigned qd = options.queue_depth ? options.queue_depth : t.io_queue_depth;
  if (qd < 1 || qd > 4096)
    return Status(StatusCode::kInvalidArgument, "I/O queue depth " + std::to_string(qd) + " is not in 1..4096");
  const std::uint64_t block = options.block_bytes ? options.block_bytes : t.io_block_bytes;
  if (block < kPage || block % kPage != 0 || block > (std::uint64_t{64} << 20))
    return Status(StatusCode::kInvalidArgument,
                  "I/O block size " + std::to_string(block) + " is not a multiple of 4096 in 4 KiB..64 MiB");

  BackendConfig c;
  c.queue_depth = qd;
  c.sq_poll = options.sq_poll || t.io_sqpoll;
  c.sq_poll_idle_ms = options.sq_poll_idle_ms;
  c.register_files = options.register_files;
  c.fixed_buffers = options.fixed_buffers;
  c.posix_threads = options.posix_threads ? options.posix_threads : std::min(qd, 16u);

  std::string reasons;
  for (const std::string& candidate : order) {
    std::string why;
    auto backend = make_backend(candidate, c);
    if (!backend) {
      why = fmt::format("{} is not built in ({}=OFF or its library was missing at build time)", candidate,
                        build_option(candidate));
    } else {
      if (options.faults) backend = wrap_with_faults(std::move(backend), options.faults);
      auto engine = std::make_unique<IoEngineImpl>(options, qd, block);
      Status st = engine->start(std::move(backend));
      if (st.ok()) {
        if (!reasons.empty()) {
          engine->set_fallback_reason(reasons);
          log_once(LogLevel::kWarn, "io-fallback-to-" + candidate,
                   fmt::format("I/O backend: {}; using {}", reasons, candidate));
        }
        return std::unique_ptr<IoEngine>(std::move(engine));
      }
      why = st.message();
    }
    if (!options.allow_fallback) return Status(StatusCode::kUnavailable, why);
    // Said once when every backend failed alike (the engine's own thread could not start).
    if (reasons.find(why) == std::string::npos) reasons += (reasons.empty() ? "" : "; ") + why;
  }
  return Status(StatusCode::kUnavailable, "no I/O backend works here: " + reasons);
}

Status io_backend_probe(const std::string& backend) {
  IoEngineOptions o;
  o.backend = backend;
  o.allow_fallback = false;
  o.queue_depth = 4;
  auto e = make_io_engine(o);
  return e.ok() ? Status() : e.status();
}

}  // namespace strata::io
