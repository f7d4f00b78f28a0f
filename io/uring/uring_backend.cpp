// io_uring backend (liburing).
//
// One ring per engine, owned by the engine's I/O thread (so the ring can be
// IORING_SETUP_SINGLE_ISSUER). submit() only fills SQEs; reap() hands the
// whole batch to the kernel and waits in the same io_uring_submit_and_wait
// call. Registered files and a sparse table of fixed buffers (the pinned
// pool's slabs) skip per-request fd lookup and page pinning. wake() writes an
// eventfd that a multishot poll in the ring watches, so a sleeping I/O thread
// wakes for new requests through the same wait.
#include "io/io_backend.h"
#include "strata/strata_config.h"

#if STRATA_HAVE_URING

#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "common/log.h"
#include "common/tunables.h"

namespace strata::io {
namespace {

constexpr std::uint64_t kWakeTag = ~std::uint64_t{0};
constexpr unsigned kFileSlots = 1024;
constexpr unsigned kBufferSlots = 1024;
constexpr std::size_t kMaxFixedBuffer = std::size_t{1} << 30;  // the kernel's limit per registered buffer

class UringBackend final : public IoBackend {
 public:
  explicit UringBackend(const BackendConfig& c) : cfg_(c) {}
  ~UringBackend() override {
    if (ring_ok_) io_uring_queue_exit(&ring_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }

  const char* name() const override { return "uring"; }

  Status start() override {
    if (tunables().io_uring_disable)
      return Status(StatusCode::kUnavailable, "io_uring is disabled by STRATA_IO_URING_DISABLE=1");
    const unsigned entries = cfg_.queue_depth + 2;  // pieces + the wake poll
    unsigned base = 0;
    if (cfg_.sq_poll) base |= IORING_SETUP_SQPOLL;
    // SINGLE_ISSUER|COOP_TASKRUN (kernel 6.0+) cut completion overhead when one
    // thread owns the ring, which is our case; older kernels say EINVAL.
    int rc = -EINVAL;
    for (unsigned extra : {unsigned{IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_COOP_TASKRUN}, 0u}) {
      io_uring_params p{};
      p.flags = base | extra;
      if (cfg_.sq_poll) p.sq_thread_idle = cfg_.sq_poll_idle_ms;
      rc = io_uring_queue_init_params(entries, &ring_, &p);
      if (rc != -EINVAL) break;
    }
    if (rc < 0) {
      const char* hint = (rc == -EPERM || rc == -ENOSYS)
                             ? " (io_uring is disabled here: sysctl kernel.io_uring_disabled or a seccomp filter)"
                             : "";
      return Status(StatusCode::kUnavailable, std::string("io_uring_queue_init failed: ") + std::strerror(-rc) + hint);
    }
    ring_ok_ = true;
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) return Status::from_errno(errno, "eventfd for the io_uring backend failed");
    arm_wake();
    if (cfg_.register_files && io_uring_register_files_sparse(&ring_, kFileSlots) == 0) {
      for (unsigned i = kFileSlots; i-- > 0;) free_files_.push_back(static_cast<int>(i));
    }
    if (cfg_.fixed_buffers) {
      int r = io_uring_register_buffers_sparse(&ring_, kBufferSlots);
      if (r == 0) {
        for (unsigned i = kBufferSlots; i-- > 0;) free_buffers_.push_back(static_cast<int>(i));
      } else {
        buffers_error_ = -r;
      }
    }
    return {};
  }

  void submit(BackendOp* const* ops, std::size_t n) override {
    for (std::size_t i = 0; i < n; ++i) {
      BackendOp* op = ops[i];
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (!sqe) {  // cannot happen with entries > queue depth, but never drop an op
        io_uring_submit(&ring_);
        sqe = io_uring_get_sqe(&ring_);
      }
      const int fd = op->fixed_file >= 0 ? op->fixed_file : op->fd;
      if (op->kind == IoOpKind::kRead) {
        if (op->fixed_buffer >= 0)
          io_uring_prep_read_fixed(sqe, fd, op->buf, op->length, op->offset, op->fixed_buffer);
        else
          io_uring_prep_read(sqe, fd, op->buf, op->length, op->offset);
      } else {
        if (op->fixed_buffer >= 0)
          io_uring_prep_write_fixed(sqe, fd, op->buf, op->length, op->offset, op->fixed_buffer);
        else
          io_uring_prep_write(sqe, fd, op->buf, op->length, op->offset);
      }
      if (op->fixed_file >= 0) sqe->flags |= IOSQE_FIXED_FILE;
      io_uring_sqe_set_data64(sqe, reinterpret_cast<std::uint64_t>(op));
    }
  }

  std::size_t reap(BackendOp** out, std::size_t max, bool block) override {
    // One system call submits the batch and (when blocking) waits.
    int rc = (block && io_uring_cq_ready(&ring_) == 0) ? io_uring_submit_and_wait(&ring_, 1) : io_uring_submit(&ring_);
    // -EINTR/-EAGAIN/-EBUSY: SQEs stay queued and go with the next call;
    // completions are harvested below. Back off on EAGAIN/EBUSY so a kernel
    // short of resources is not hammered in a tight loop; any other error
    // means the ring itself is broken: say so once (pieces then stay pending).
    if (rc == -EAGAIN || rc == -EBUSY) {
      if (io_uring_cq_ready(&ring_) == 0) ::usleep(200);
    } else if (rc < 0 && rc != -EINTR && rc != -ETIME) {
      log_once(LogLevel::kError, "uring-submit-error",
               std::string("io_uring_enter failed: ") + std::strerror(-rc) + "; I/O on this engine may stall");
    }
    std::size_t n = 0;
    io_uring_cqe* cqe;
    unsigned head, seen = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      const std::uint64_t tag = io_uring_cqe_get_data64(cqe);
      if (tag == kWakeTag) {
        std::uint64_t v;
        (void)!::read(wake_fd_, &v, sizeof v);
        if (!(cqe->flags & IORING_CQE_F_MORE)) rearm_ = true;
        continue;
      }
      auto* op = reinterpret_cast<BackendOp*>(tag);
      op->result = cqe->res;
      out[n++] = op;
      if (n == max) break;
    }
    io_uring_cq_advance(&ring_, seen);
    if (rearm_) {
      rearm_ = false;
      arm_wake();
    }
    return n;
  }

  void wake() override {
    std::uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);
  }

  int register_file(int fd) override {
    if (free_files_.empty()) return -1;
    int idx = free_files_.back();
    if (io_uring_register_files_update(&ring_, static_cast<unsigned>(idx), &fd, 1) != 1) return -1;
    free_files_.pop_back();
    return idx;
  }

  void unregister_file(int index) override {
    int none = -1;
    io_uring_register_files_update(&ring_, static_cast<unsigned>(index), &none, 1);
    free_files_.push_back(index);
  }

  int register_buffer(void* ptr, std::size_t bytes, int* err) override {
    *err = 0;
    if (free_buffers_.empty()) {
      *err = buffers_error_ ? buffers_error_ : ENOSPC;
      return -1;
    }
    if (bytes > kMaxFixedBuffer) {
      *err = EINVAL;
      return -1;
    }
    int idx = free_buffers_.back();
    iovec iov{ptr, bytes};
    __u64 tag = 0;
    int r = io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(idx), &iov, &tag, 1);
    if (r < 0) {
      *err = -r;
      return -1;
    }
    free_buffers_.pop_back();
    return idx;
  }

  void unregister_buffer(int index) override {
    iovec iov{nullptr, 0};
    __u64 tag = 0;
    io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(index), &iov, &tag, 1);
    free_buffers_.push_back(index);
  }

 private:
  void arm_wake() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (!sqe) {
      io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
    }
    io_uring_prep_poll_multishot(sqe, wake_fd_, POLLIN);
    io_uring_sqe_set_data64(sqe, kWakeTag);
  }

  BackendConfig cfg_;
  io_uring ring_{};
  bool ring_ok_ = false;
  int wake_fd_ = -1;
  bool rearm_ = false;
  int buffers_error_ = 0;
  std::vector<int> free_files_;
  std::vector<int> free_buffers_;
};

}  // namespace

std::unique_ptr<IoBackend> make_uring_backend(const BackendConfig& config) {
  return std::make_unique<UringBackend>(config);
}

}  // namespace strata::io

#else  // !STRATA_HAVE_URING

namespace strata::io {
std::unique_ptr<IoBackend> make_uring_backend(const BackendConfig&) {
  return nullptr;
}
}  // namespace strata::io

#endif
