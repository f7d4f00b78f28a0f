// The asynchronous I/O engine: one request interface over three backends.
//
//   auto engine = make_io_engine({.backend = "auto"});          // uring -> aio -> posix
//   auto file = (*engine)->open("/nvme/x", {.write = true, .create = true});
//   IoHandle h = (*engine)->submit({IoOpKind::kWrite, file->get(), 0, bytes, buf});
//   STRATA_RETURN_IF_ERROR(h.wait());
//
// Model. Each engine owns one I/O thread that owns the backend (an io_uring
// ring, a libaio context or a pread/pwrite thread pool). submit() only queues
// the request and returns a handle; the I/O thread splits requests into pieces
// of at most `block_bytes`, keeps up to `queue_depth` pieces in flight, hands
// every batch of new pieces to the kernel with one system call
// (io_uring_submit / io_submit), resubmits the remainder of short transfers,
// retries EINTR/EAGAIN, and completes the request when its last piece is done.
//
// Errors. A request either transfers every byte or completes with an error
// Status naming the operation, length, offset, file and errno text:
//   "read of 1048576 bytes at offset 8388608 in /x/opt.0 failed: Input/output error"
// Reading past the end of a file is an error, never a silent short read.
// Nothing aborts the process.
//
// Alignment (O_DIRECT). Files are opened with O_DIRECT where the filesystem
// allows it. O_DIRECT needs the file offset and length aligned to the
// filesystem's direct-I/O alignment (statx STATX_DIOALIGN, else the block
// device's logical block size, else 4096) and the buffer address aligned to the
// memory alignment. Strata does NOT reject misaligned requests. It splits each
// request at page boundaries (max(alignment, 4096)): the aligned middle goes
// through the O_DIRECT descriptor, and the unaligned head and tail (less than a
// page each) go through a second, buffered descriptor of the same file. Why this
// and not a read-modify-write bounce buffer: a bounce writes whole blocks, so
// two concurrent writes to adjacent byte ranges that share a block would
// overwrite each other's bytes; the page cache merges them correctly, and the
// kernel keeps direct and buffered I/O coherent (a direct read writes back
// dirty cached pages of its range first; a direct write invalidates them).
// Splitting at page (not sector) boundaries keeps the buffered head/tail of a
// request off the pages its direct middle writes. A middle whose buffer address
// is misaligned also goes buffered. So odd sizes, offsets and buffers all work;
// full speed needs aligned offsets, lengths and buffers (the pinned pool's are).
// On filesystems that refuse O_DIRECT (tmpfs: EINVAL at open) the file is
// opened buffered and Strata says so once.
//
// Backend choice. `backend` is "uring", "aio", "posix" or "auto" ("" = the
// STRATA_IO_BACKEND variable, else auto). Auto tries uring, then aio, then
// posix. A named backend that is not built in or does not start here (io_uring
// disabled by sysctl or seccomp, STRATA_IO_URING_DISABLE=1, ...) falls back
// along the same order; the fallback is logged once with the reason and kept
// in fallback_reason(). allow_fallback=false makes that an error instead.
//
// Thread-safety. An IoEngine may be used from any number of threads.
// Completion callbacks run on the engine's I/O thread: keep them short, never
// block in them (no IoHandle::wait, no wait_all); they may submit new requests.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/host_memory.h"
#include "common/status.h"

namespace strata::io {

class FaultInjector;
class IoEngineImpl;

enum class IoOpKind : std::uint8_t { kRead = 0, kWrite = 1 };
const char* io_op_name(IoOpKind op);  // "read" / "write"

// Options for IoEngine::open.
struct IoOpenOptions {
  bool write = false;      // open read-write (else read-only)
  bool create = false;     // create the file (mode below) if missing
  bool truncate = false;   // truncate to 0 bytes
  bool exclusive = false;  // with create: fail with kAlreadyExists if it exists
  bool direct = true;      // O_DIRECT where the filesystem allows it
  unsigned mode = 0600;
};

// An open file. Created by IoEngine::open; owned by the caller through a
// unique_ptr. Must not be destroyed while requests on it are in flight, and
// the engine must outlive it. The accessors are thread-safe.
class IoFile {
 public:
  ~IoFile();
  IoFile(const IoFile&) = delete;
  IoFile& operator=(const IoFile&) = delete;

  const std::string& path() const { return path_; }
  // True when O_DIRECT is in effect (false on filesystems that refuse it).
  bool direct() const { return direct_fd_ >= 0; }
  // Granularity at which requests are split between the direct and buffered
  // descriptors: max(direct-I/O offset alignment, page size).
  std::uint32_t offset_alignment() const { return offset_align_; }
  // Buffer address alignment O_DIRECT needs here (statx dio_mem_align or the
  // logical block size).
  std::uint32_t memory_alignment() const { return mem_align_; }
  // Current size in bytes (fstat). Errors: kIoError.
  Result<std::uint64_t> size() const;
  // Reserves [offset, offset+bytes) on disk with fallocate, extending the file;
  // where the filesystem has no fallocate, extends it with ftruncate (said
  // once). Errors: kNoSpace (ENOSPC/EFBIG), kIoError.
  Status preallocate(std::uint64_t offset, std::uint64_t bytes);
  // fdatasync. Blocking.
  Status sync();

  // Descriptors, for backends and tests. buffered_fd() is always valid.
  int buffered_fd() const { return buffered_fd_; }
  int direct_fd() const { return direct_fd_; }
  int fixed_index() const { return fixed_index_; }

 private:
  friend class IoEngineImpl;
  IoFile() = default;
  IoEngineImpl* engine_ = nullptr;
  std::string path_;
  int buffered_fd_ = -1;
  int direct_fd_ = -1;
  int fixed_index_ = -1;  // registered-file slot of direct_fd_ (io_uring), -1 = none
  bool writable_ = false;
  std::uint32_t offset_align_ = 4096;
  std::uint32_t mem_align_ = 4096;
};

// One transfer: `length` bytes between `buffer` and `file` at `offset`.
// The buffer and the file must stay valid until the request completes.
struct IoRequest {
  IoOpKind op = IoOpKind::kRead;
  IoFile* file = nullptr;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  void* buffer = nullptr;
};

// Called once, on the I/O thread, when a request (or group) completes.
using IoCallback = std::function<void(const Status&)>;
// Runs on the I/O thread once every byte of a request moved, before its
// callback; an error it returns becomes the request's status (handle and
// callback). The swap store verifies block checksums of what was read with it.
using IoCheck = std::function<Status()>;

namespace detail {
struct RequestState;
}

// A waitable handle for a submitted request. Copyable; all copies refer to the
// same request. Thread-safe. A default-constructed handle is complete and ok.
class IoHandle {
 public:
  IoHandle() = default;
  // True once the request is complete (its callback, if any, has returned).
  // Non-blocking.
  bool poll() const;
  // Blocks until complete; returns the request's status. May be called many
  // times and from several threads. Must not be called on the I/O thread.
  Status wait() const;

 private:
  friend class IoEngineImpl;
  explicit IoHandle(std::shared_ptr<detail::RequestState> s) : state_(std::move(s)) {}
  std::shared_ptr<detail::RequestState> state_;
};

struct IoEngineOptions {
  std::string backend;             // "uring" | "aio" | "posix" | "auto"; "" = STRATA_IO_BACKEND, else auto
  bool allow_fallback = true;      // false: an unavailable backend is an error (kUnavailable)
  unsigned queue_depth = 0;        // pieces in flight; 0 = STRATA_IO_QUEUE_DEPTH (32)
  std::uint64_t block_bytes = 0;   // largest piece; 0 = STRATA_IO_BLOCK_BYTES (1 MiB). Multiple of 4096, <= 64 MiB
  bool sq_poll = false;            // io_uring: kernel submission thread (IORING_SETUP_SQPOLL); also STRATA_IO_SQPOLL=1
  unsigned sq_poll_idle_ms = 100;  // io_uring: SQPOLL thread idle time before it sleeps
  bool register_files = true;      // io_uring: registered (fixed) files
  bool fixed_buffers = true;       // io_uring: buffers registered through buffer_registrar() used as fixed buffers
  unsigned posix_threads = 0;      // posix: worker threads; 0 = min(queue_depth, 16)
  // Tests: wraps the backend in a fault-injecting one (io/fault_injection.h).
  std::shared_ptr<FaultInjector> faults;
};

class IoEngine {
 public:
  virtual ~IoEngine() = default;  // waits for every request in flight, then stops the I/O thread

  // "uring", "aio" or "posix": the backend in use.
  virtual const char* backend_name() const = 0;
  // Why a backend earlier in the fallback order was not used ("" if none).
  virtual const std::string& fallback_reason() const = 0;
  virtual unsigned queue_depth() const = 0;
  virtual std::uint64_t block_bytes() const = 0;

  // Opens (or creates) a file for this engine. Blocking. Errors from open(2)
  // mapped with the path: kNotFound, kPermission, kAlreadyExists, kIoError.
  virtual Result<std::unique_ptr<IoFile>> open(const std::string& path, const IoOpenOptions& options) = 0;

  // Queues a request; never blocks on I/O. An invalid request (no file or
  // buffer, write to a read-only file) completes with kInvalidArgument.
  virtual IoHandle submit(const IoRequest& request, IoCallback callback = {}) = 0;
  // Queues several requests that complete together: one handle and one
  // callback, whose status is the first error among them. After that error
  // no further pieces of the group are issued; pieces already in flight
  // finish before the group completes (the same holds for one request).
  virtual IoHandle submit_group(std::span<const IoRequest> requests, IoCallback callback = {}) = 0;
  // The same with a check run when every byte moved (see IoCheck).
  virtual IoHandle submit_checked(std::span<const IoRequest> requests, IoCheck check, IoCallback callback = {}) = 0;
  // A request that completes with `status` (not ok) through the same path as
  // real ones (callback on the I/O thread); for layers above that find an
  // error before any I/O.
  virtual IoHandle submit_failed(Status status, IoCallback callback = {}) = 0;

  // Blocks until no request is in flight (requests other threads submit
  // meanwhile are waited for too); returns the first error among requests
  // completed since the previous wait_all (then forgets it). Not on the I/O
  // thread.
  virtual Status wait_all() = 0;
  // Non-blocking: the number of requests not yet complete.
  virtual std::size_t poll() const = 0;

  // A HostMemoryRegistrar that registers memory as io_uring fixed buffers, so
  // reads and writes into it skip per-request page pinning. Give it to the
  // PinnedPool. Never fails: when the kernel refuses (RLIMIT_MEMLOCK), requests
  // use the same memory as plain buffers and Strata says so once. Other
  // backends accept and ignore it. Lives as long as the engine.
  virtual HostMemoryRegistrar* buffer_registrar() = 0;

  // Counters (relaxed; for tests and benchmarks).
  struct Stats {
    std::uint64_t requests = 0;       // requests completed
    std::uint64_t pieces = 0;         // pieces handed to the backend (incl. resubmissions)
    std::uint64_t submit_calls = 0;   // batches handed to the backend (one syscall each)
    std::uint64_t resubmissions = 0;  // short transfers and EINTR/EAGAIN retried
    std::uint64_t fixed_buffer_pieces = 0;
    std::uint64_t buffered_pieces = 0;  // pieces that went through the page cache
  };
  virtual Stats stats() const = 0;
};

// Creates an engine (see the header comment for the fallback order).
// Errors: kInvalidArgument (unknown backend name, bad queue depth or block
// size), kUnavailable (allow_fallback=false and the backend does not start).
Result<std::unique_ptr<IoEngine>> make_io_engine(const IoEngineOptions& options = {});

// Backends compiled into this build, in fallback order.
std::vector<std::string> io_backends_built();
// Tries to start `backend` here without fallback; ok, or why not.
Status io_backend_probe(const std::string& backend);

}  // namespace strata::io
