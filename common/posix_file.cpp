#include "common/posix_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <system_error>

namespace strata {

void Fd::reset() {
  if (fd_ >= 0 && owned_) ::close(fd_);
  fd_ = -1;
}

std::string join_path(const std::string& dir, std::string_view name) {
  return dir + "/" + std::string(name);
}

std::string parent_of(const std::string& path) {
  auto pos = path.find_last_of('/');
  if (pos == std::string::npos) return ".";
  if (pos == 0) return "/";
  return path.substr(0, pos);
}

std::string base_of(const std::string& path) {
  auto pos = path.find_last_of('/');
  return pos == std::string::npos ? path : path.substr(pos + 1);
}

Status pread_full(int fd, void* buf, uint64_t n, uint64_t off, const std::string& what) {
  auto* p = static_cast<unsigned char*>(buf);
  while (n > 0) {
    const std::size_t want = static_cast<std::size_t>(std::min<uint64_t>(n, 1ull << 30));
    ssize_t r = ::pread(fd, p, want, static_cast<off_t>(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      return Status::from_errno(errno, fmt::format("read of {} bytes at offset {} in {} failed", want, off, what));
    }
    if (r == 0) {
      return Status(StatusCode::kIoError,
                    fmt::format("read of {} bytes at offset {} in {} failed: unexpected end of file", want, off, what));
    }
    p += r;
    n -= static_cast<uint64_t>(r);
    off += static_cast<uint64_t>(r);
  }
  return {};
}

Status pwrite_full(int fd, const void* buf, uint64_t n, uint64_t off, const std::string& what) {
  const auto* p = static_cast<const unsigned char*>(buf);
  while (n > 0) {
    const std::size_t want = static_cast<std::size_t>(std::min<uint64_t>(n, 1ull << 30));
    ssize_t r = ::pwrite(fd, p, want, static_cast<off_t>(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      return Status::from_errno(errno, fmt::format("write of {} bytes at offset {} in {} failed", want, off, what));
    }
    // A short write (disk nearly full, signal) is resubmitted; the error, if
    // any, comes from the retry.
    p += r;
    n -= static_cast<uint64_t>(r);
    off += static_cast<uint64_t>(r);
  }
  return {};
}

Status fsync_path(const std::string& path, bool directory, bool drop_cache) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0));
  if (fd < 0) return Status::from_errno(errno, "opening " + path + " to fsync it");
  Status st;
  if (::fsync(fd) != 0) st = Status::from_errno(errno, "fsync of " + path);
  if (st.ok() && drop_cache) ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  return st;
}

Status write_new_file(const std::string& path, const std::string& text) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Status::from_errno(errno, "creating " + path);
  Fd guard(fd, true);
  STRATA_RETURN_IF_ERROR(pwrite_full(fd, text.data(), text.size(), 0, path));
  if (::fsync(fd) != 0) return Status::from_errno(errno, "fsync of " + path);
  return {};
}

Result<std::vector<std::string>> list_dir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return Status::from_errno(errno, "listing " + dir + " failed");
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(std::move(n));
  }
  ::closedir(d);
  return names;
}

Status remove_tree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return Status::from_errno(ec.value(), "removing " + path);
  return {};
}

Status check_replaceable(const std::string& path, const std::string& what, std::string_view own_marker) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return {};
    return Status::from_errno(errno, what + " " + path);
  }
  if (S_ISCHR(st.st_mode)) return {};  // /dev/null, a terminal: written as they are
  if (!S_ISREG(st.st_mode))
    return Status(StatusCode::kInvalidArgument,
                  what + " " + path + " exists and is not a regular file (a FIFO, directory, socket or block device)");
  if (st.st_size == 0) return {};
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return Status::from_errno(errno, what + " " + path);
  Fd f(fd, /*owned=*/true);
  std::string head(4096, '\0');
  ssize_t n;
  do {
    n = ::pread(fd, head.data(), head.size(), 0);
  } while (n < 0 && errno == EINTR);
  head.resize(n > 0 ? static_cast<size_t>(n) : 0);
  head = head.substr(0, head.find('\n'));  // the first line
  if (head.find(own_marker) != std::string::npos) return {};
  return Status(StatusCode::kAlreadyExists,
                what + " " + path + " exists and is not a file Strata wrote (" + std::to_string(st.st_size) +
                    " bytes): refusing to overwrite it; name another file, or remove it");
}

}  // namespace strata
