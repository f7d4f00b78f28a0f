// libaio backend (Linux native AIO, io_submit/io_getevents).
//
// A sliding window: the engine refills the queue as pieces complete, and each
// refill goes to the kernel as one io_submit of the whole batch. Completions
// also bump an eventfd (io_set_eventfd) that wake() writes too, so the I/O
// thread sleeps in one place whether it waits for completions or for new
// requests. Native AIO is asynchronous only with O_DIRECT; buffered pieces
// (unaligned heads and tails, O_DIRECT-less filesystems) complete inside
// io_submit, which is correct, just synchronous.
#include "io/io_backend.h"
#include "strata/strata_config.h"

#if STRATA_HAVE_AIO

#include <libaio.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <vector>

namespace strata::io {
namespace {

static_assert(sizeof(iocb) <= sizeof(BackendOp::scratch), "an iocb must fit in BackendOp::scratch");

class AioBackend final : public IoBackend {
 public:
  explicit AioBackend(const BackendConfig& c) : cfg_(c) {}
  ~AioBackend() override {
    if (ctx_) io_destroy(ctx_);
    if (event_fd_ >= 0) ::close(event_fd_);
  }

  const char* name() const override { return "aio"; }

  Status start() override {
    int rc = io_setup(static_cast<int>(cfg_.queue_depth), &ctx_);
    if (rc < 0) {
      ctx_ = nullptr;
      const char* hint = rc == -EAGAIN ? " (raise /proc/sys/fs/aio-max-nr)" : "";
      return Status(StatusCode::kUnavailable, std::string("io_setup failed: ") + std::strerror(-rc) + hint);
    }
    event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (event_fd_ < 0) return Status::from_errno(errno, "eventfd for the aio backend failed");
    events_.resize(cfg_.queue_depth);
    ptrs_.reserve(cfg_.queue_depth);
    return {};
  }

  void submit(BackendOp* const* ops, std::size_t n) override {
    for (std::size_t i = 0; i < n; ++i) {
      BackendOp* op = ops[i];
      auto* cb = reinterpret_cast<iocb*>(op->scratch);
      if (op->kind == IoOpKind::kRead)
        io_prep_pread(cb, op->fd, op->buf, op->length, static_cast<long long>(op->offset));
      else
        io_prep_pwrite(cb, op->fd, op->buf, op->length, static_cast<long long>(op->offset));
      io_set_eventfd(cb, event_fd_);
      cb->data = op;
      backlog_.push_back(op);
    }
    flush();
  }

  std::size_t reap(BackendOp** out, std::size_t max, bool block) override {
    if (!backlog_.empty()) flush();
    std::size_t n = take_failed(out, max);
    if (n > 0) return n;
    n = get_events(out, max);
    if (n > 0 || !block) return n;
    if (!backlog_.empty() && in_kernel_ == 0) {
      // io_submit refused (EAGAIN) with nothing of ours in flight, so no
      // completion will ever wake us: back off briefly, then complete the
      // front piece with -EAGAIN. The engine retries EAGAIN a bounded number
      // of times and then fails the request, instead of spinning forever.
      ::usleep(1000);
      BackendOp* op = backlog_.front();
      backlog_.pop_front();
      op->result = -EAGAIN;
      out[0] = op;
      return 1;
    }
    pollfd p{event_fd_, POLLIN, 0};
    (void)::poll(&p, 1, -1);
    std::uint64_t v;
    (void)!::read(event_fd_, &v, sizeof v);
    return get_events(out, max);
  }

  void wake() override {
    std::uint64_t one = 1;
    (void)!::write(event_fd_, &one, sizeof one);
  }

 private:
  // One io_submit for everything queued. A short count leaves the rest queued
  // for the next call; an error belongs to the first iocb, which completes
  // with it, and the rest are tried again.
  void flush() {
    while (!backlog_.empty()) {
      ptrs_.clear();
      for (BackendOp* op : backlog_) ptrs_.push_back(reinterpret_cast<iocb*>(op->scratch));
      int rc = io_submit(ctx_, static_cast<long>(ptrs_.size()), ptrs_.data());
      if (rc > 0) {
        in_kernel_ += static_cast<unsigned>(rc);
        backlog_.erase(backlog_.begin(), backlog_.begin() + rc);
        continue;
      }
      if (rc == -EAGAIN || rc == -EINTR || rc == 0) return;  // kernel queue full: retry after completions
      BackendOp* op = backlog_.front();
      backlog_.pop_front();
      op->result = rc;
      failed_.push_back(op);
    }
  }

  std::size_t take_failed(BackendOp** out, std::size_t max) {
    std::size_t n = 0;
    while (n < max && !failed_.empty()) {
      out[n++] = failed_.back();
      failed_.pop_back();
    }
    return n;
  }

  std::size_t get_events(BackendOp** out, std::size_t max) {
    if (in_kernel_ == 0) return 0;
    timespec zero{0, 0};
    long want = static_cast<long>(std::min<std::size_t>(max, events_.size()));
    int rc;
    do {
      rc = io_getevents(ctx_, 0, want, events_.data(), &zero);
    } while (rc == -EINTR);
    if (rc <= 0) return 0;
    for (int i = 0; i < rc; ++i) {
      auto* op = static_cast<BackendOp*>(events_[i].data);
      // res holds bytes or -errno in an unsigned long.
      op->result = static_cast<std::int64_t>(static_cast<long>(events_[i].res));
      out[i] = op;
    }
    in_kernel_ -= static_cast<unsigned>(rc);
    return static_cast<std::size_t>(rc);
  }

  BackendConfig cfg_;
  io_context_t ctx_ = nullptr;
  int event_fd_ = -1;
  unsigned in_kernel_ = 0;
  std::deque<BackendOp*> backlog_;
  std::vector<BackendOp*> failed_;
  std::vector<iocb*> ptrs_;
  std::vector<io_event> events_;
};

}  // namespace

std::unique_ptr<IoBackend> make_aio_backend(const BackendConfig& config) {
  return std::make_unique<AioBackend>(config);
}

}  // namespace strata::io

#else  // !STRATA_HAVE_AIO

namespace strata::io {
std::unique_ptr<IoBackend> make_aio_backend(const BackendConfig&) {
  return nullptr;
}
}  // namespace strata::io

#endif
