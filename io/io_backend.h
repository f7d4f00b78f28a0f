// The backend interface under IoEngine (internal to io/).
//
// A backend moves single pieces: each BackendOp is at most one block, already
// split and (for O_DIRECT descriptors) aligned by the engine. The engine's I/O
// thread is the only caller of every method except wake(), so a backend needs
// no locking of its own for the ring or context it owns. Per-op errors are
// reported through BackendOp::result (-errno), never by failing submit().
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "io/io_engine.h"

namespace strata::io {

struct BackendOp {
  IoOpKind kind = IoOpKind::kRead;
  bool direct = false;  // fd is an O_DIRECT descriptor
  int fd = -1;
  int fixed_file = -1;    // registered-file index of fd, -1 = none (uring only)
  int fixed_buffer = -1;  // registered-buffer index covering [buf, buf+length), -1 = none
  std::uint64_t offset = 0;
  std::uint32_t length = 0;
  void* buf = nullptr;
  std::int64_t result = 0;  // set by the backend: bytes moved (may be short) or -errno
  // Backend scratch space (the libaio backend keeps its iocb here).
  alignas(8) unsigned char scratch[64];
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  virtual const char* name() const = 0;

  // Called once, on the I/O thread, before anything else. kUnavailable when
  // the mechanism does not work here (the engine then falls back).
  virtual Status start() = 0;

  // Hands `n` ops to the kernel; the engine never has more than queue_depth
  // ops outstanding. Backends that can (uring) defer the system call to the
  // next reap() so that submission and waiting share one call.
  virtual void submit(BackendOp* const* ops, std::size_t n) = 0;

  // Collects completed ops into `out` (at most `max`). With `block`, waits
  // until at least one op completes or wake() is called; may then return 0.
  virtual std::size_t reap(BackendOp** out, std::size_t max, bool block) = 0;

  // Thread-safe: makes a blocking reap() return soon.
  virtual void wake() = 0;

  // Optional: registered files and buffers. register_* return the index, or
  // -1 when the backend has none or the kernel refused (see `why`).
  virtual int register_file(int /*fd*/) { return -1; }
  virtual void unregister_file(int /*index*/) {}
  virtual int register_buffer(void* /*ptr*/, std::size_t /*bytes*/, int* err) {
    if (err) *err = 0;
    return -1;
  }
  virtual void unregister_buffer(int /*index*/) {}
};

struct BackendConfig {
  unsigned queue_depth = 32;
  bool sq_poll = false;
  unsigned sq_poll_idle_ms = 100;
  bool register_files = true;
  bool fixed_buffers = true;
  unsigned posix_threads = 0;
};

// Factories; each returns nullptr when the backend is not compiled in.
std::unique_ptr<IoBackend> make_uring_backend(const BackendConfig& config);
std::unique_ptr<IoBackend> make_aio_backend(const BackendConfig& config);
std::unique_ptr<IoBackend> make_posix_backend(const BackendConfig& config);

}  // namespace strata::io
