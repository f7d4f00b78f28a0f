// Portable backend: a pool of threads doing one pread/pwrite per piece.
//
// Works everywhere (no io_uring, no libaio, filesystems without O_DIRECT).
// Each worker moves a piece with one call and reports what the call returned,
// short or -errno; the engine resubmits remainders and retries EINTR, exactly
// as for the kernel-queue backends, so every backend shares one error path.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/threads.h"
#include "io/io_backend.h"

namespace strata::io {
namespace {

class PosixBackend final : public IoBackend {
 public:
  explicit PosixBackend(const BackendConfig& c) : cfg_(c) {}
  ~PosixBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  const char* name() const override { return "posix"; }

  // A worker that cannot start fails the backend by name (the ones started
  // stop in the destructor).
  Status start() override {
    unsigned n = cfg_.posix_threads ? cfg_.posix_threads : 4;
    workers_.reserve(n);
    for (unsigned i = 0; i < n; ++i) {
      std::thread t;
      STRATA_RETURN_IF_ERROR(start_thread(t, "posix I/O backend: cannot start worker thread " + std::to_string(i + 1) +
                                                 " of " + std::to_string(n),
                                          [this] { work(); }));
      workers_.push_back(std::move(t));
    }
    return {};
  }

  void submit(BackendOp* const* ops, std::size_t n) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (std::size_t i = 0; i < n; ++i) work_.push_back(ops[i]);
    }
    if (n == 1)
      work_cv_.notify_one();
    else
      work_cv_.notify_all();
  }

  std::size_t reap(BackendOp** out, std::size_t max, bool block) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (block) done_cv_.wait(lock, [&] { return !done_.empty() || woken_; });
    woken_ = false;
    std::size_t n = 0;
    while (n < max && !done_.empty()) {
      out[n++] = done_.front();
      done_.pop_front();
    }
    return n;
  }

  void wake() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      woken_ = true;
    }
    done_cv_.notify_one();
  }

 private:
  void work() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [&] { return stop_ || !work_.empty(); });
      if (stop_) return;
      BackendOp* op = work_.front();
      work_.pop_front();
      lock.unlock();
      ssize_t r = op->kind == IoOpKind::kRead ? ::pread(op->fd, op->buf, op->length, static_cast<off_t>(op->offset))
                                              : ::pwrite(op->fd, op->buf, op->length, static_cast<off_t>(op->offset));
      op->result = r < 0 ? -static_cast<std::int64_t>(errno) : static_cast<std::int64_t>(r);
      lock.lock();
      done_.push_back(op);
      done_cv_.notify_one();
    }
  }

  BackendConfig cfg_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<BackendOp*> work_, done_;
  bool woken_ = false;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<IoBackend> make_posix_backend(const BackendConfig& config) {
  return std::make_unique<PosixBackend>(config);
}

}  // namespace strata::io
