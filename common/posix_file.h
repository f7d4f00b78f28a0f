// Small POSIX file helpers: an owning-or-borrowing descriptor, full-length
// pread/pwrite loops, fsync through a fresh descriptor, create-write-fsync of
// a new file, recursive removal, directory listing, '/'-path splitting, and
// the check before a user-named output file replaces what is there.
//
// Owns nothing beyond the descriptors an Fd holds. Every call blocks and is
// safe from any thread for distinct descriptors. Errors are Status values
// (Status::from_errno) whose text names the operation and the path; nothing
// here retries beyond EINTR and short transfers, logs, or aborts.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace strata {

// A file descriptor that is closed on destruction when `owned`, or only
// borrowed (left open) when not. Move-only.
class Fd {
 public:
  Fd() = default;
  Fd(int fd, bool owned) : fd_(fd), owned_(owned) {}
  Fd(Fd&& o) noexcept : fd_(o.fd_), owned_(o.owned_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept {
    reset();
    fd_ = o.fd_;
    owned_ = o.owned_;
    o.fd_ = -1;
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  void reset();

 private:
  int fd_ = -1;
  bool owned_ = false;
};

// "<dir>/<name>".
std::string join_path(const std::string& dir, std::string_view name);
// The directory part of `path`: "." when it has no '/', "/" for "/x".
std::string parent_of(const std::string& path);
// The part after the last '/' (all of `path` when it has none).
std::string base_of(const std::string& path);

// Reads exactly `n` bytes at `off` (requests of at most 1 GiB, resubmitting
// short reads). Errors: from_errno "read of <n> bytes at offset <off> in
// <what> failed", or kIoError "...: unexpected end of file".
Status pread_full(int fd, void* buf, uint64_t n, uint64_t off, const std::string& what);
// Writes exactly `n` bytes at `off`; a short write is resubmitted and the
// error, if any, comes from the retry ("write of <n> bytes at offset <off> in
// <what> failed").
Status pwrite_full(int fd, const void* buf, uint64_t n, uint64_t off, const std::string& what);

// fsync(2) of `path` (a directory when `directory`) through a fresh
// descriptor: Linux reports writeback errors to every descriptor opened
// before they are seen. `drop_cache` then advises the kernel to drop the
// file's pages (for data written once and rarely read).
Status fsync_path(const std::string& path, bool directory, bool drop_cache = false);

// Creates `path` (0644; kAlreadyExists if it exists), writes `text` and
// fsyncs the file (not its directory).
Status write_new_file(const std::string& path, const std::string& text);

// Removes `path` and everything under it; a missing path is fine.
Status remove_tree(const std::string& path);

// The names in directory `dir` but "." and "..", in readdir order. Errors:
// from_errno "listing <dir> failed".
Result<std::vector<std::string>> list_dir(const std::string& dir);

// Before a file Strata writes from the start (a metrics or trace file named
// by the user) replaces what is at `path`: fine when nothing is there, an
// empty regular file, one whose first line holds `own_marker` (a file of the
// same kind, from an earlier run), or a character device (/dev/null);
// otherwise kAlreadyExists (another file: data, weights, notes) or
// kInvalidArgument (a FIFO, directory, socket or block device), naming
// `what` and the path. Never blocks (a FIFO is not opened).
Status check_replaceable(const std::string& path, const std::string& what, std::string_view own_marker);

}  // namespace strata
