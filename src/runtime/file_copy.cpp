#include "runtime/file_copy.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <linux/fs.h>
#include <stdio.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "common/crc32c.h"
#include "common/enum_names.h"
#include "common/log.h"
#include "common/posix_file.h"

namespace strata {

namespace {

constexpr uint64_t kCloneAlign = 4096;  // FICLONERANGE's block alignment on ext4/xfs/btrfs

std::string range_name(const FileRange& r) {
  return r.fd >= 0 && r.path.empty() ? fmt::format("fd {}", r.fd) : r.path;
}

// Opens a range's file. Borrowed descriptors are used as they are unless they
// were opened O_DIRECT (our buffer and offsets are not aligned) or, for a
// destination, write-only (the checksum reads back what landed): those are
// reopened through /proc/self/fd.
Status open_range(const FileRange& r, bool dst, Fd* out) {
  const int mode = dst ? O_RDWR : O_RDONLY;
  if (r.fd >= 0) {
    int fl = ::fcntl(r.fd, F_GETFL);
    if (fl < 0) return Status::from_errno(errno, "fcntl(F_GETFL) on " + range_name(r));
    const bool direct = (fl & O_DIRECT) != 0;
    const bool unreadable = (fl & O_ACCMODE) == O_WRONLY;
    const bool unwritable = dst && (fl & O_ACCMODE) == O_RDONLY;
    if (unwritable)
      return Status(StatusCode::kInvalidArgument, range_name(r) + " is read-only; it cannot be a destination");
    if (!direct && !unreadable) {
      *out = Fd(r.fd, false);
      return {};
    }
    std::string proc = fmt::format("/proc/self/fd/{}", r.fd);
    int fd = ::open(proc.c_str(), mode | O_CLOEXEC);
    if (fd < 0) return Status::from_errno(errno, "reopening " + range_name(r) + " through " + proc);
    *out = Fd(fd, true);
    return {};
  }
  if (r.path.empty()) return Status(StatusCode::kInvalidArgument, "a file range has neither a path nor a descriptor");
  // O_NONBLOCK: a FIFO in a file's place is refused, not waited on.
  int fd = ::open(r.path.c_str(), mode | O_CLOEXEC | O_NONBLOCK | (dst ? O_CREAT : 0), 0600);
  if (fd < 0) return Status::from_errno(errno, std::string("opening ") + r.path + (dst ? " for writing" : ""));
  *out = Fd(fd, true);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Status::from_errno(errno, "stat of " + r.path);
  if (!S_ISREG(st.st_mode)) return Status(StatusCode::kInvalidArgument, r.path + " is not a regular file");
  return {};
}

// Errors that mean "this copy method is not available here", not "the copy
// failed": fall back to the next method.
bool method_refused(int err) {
  return err == EOPNOTSUPP || err == ENOTTY || err == EXDEV || err == EINVAL || err == ENOSYS || err == EBADF ||
         err == ETXTBSY || err == EISDIR || err == EPERM;
}

// The CRC of a stream fed in pieces, and optionally of each block of it.
class StreamCrc {
 public:
  explicit StreamCrc(BlockCrcs* blocks) : blocks_(blocks && blocks->block ? blocks : nullptr) {
    if (blocks_) blocks_->crcs.clear();
  }
  void add(const uint8_t* p, uint64_t n) {
    if (!blocks_) {
      whole_ = crc32c_extend(whole_, p, n);
      return;
    }
    const uint64_t b = blocks_->block;
    while (n > 0) {
      const uint64_t in = pos_ % b;
      if (in != 0 || n < b) {  // the current block, partly
        const uint64_t k = std::min(n, b - in);
        cur_ = crc32c_extend(cur_, p, k);
        p += k, n -= k, pos_ += k;
        if (pos_ % b == 0) end_block(b);
        continue;
      }
      const uint64_t whole_blocks = n / b;  // several blocks at once (three CRC chains)
      const std::size_t first = blocks_->crcs.size();
      blocks_->crcs.resize(first + whole_blocks);
      crc32c_blocks(p, whole_blocks * b, b, blocks_->crcs.data() + first);
      for (uint64_t i = 0; i < whole_blocks; ++i) whole_ = crc32c_combine(whole_, blocks_->crcs[first + i], b);
      p += whole_blocks * b, n -= whole_blocks * b, pos_ += whole_blocks * b;
    }
  }
  uint32_t finish() {
    if (blocks_ && pos_ % blocks_->block != 0) end_block(pos_ % blocks_->block);
    return whole_;
  }

 private:
  void end_block(uint64_t len) {
    blocks_->crcs.push_back(cur_);
    whole_ = crc32c_combine(whole_, cur_, len);
    cur_ = 0;
  }
  BlockCrcs* blocks_;
  uint32_t whole_ = 0, cur_ = 0;
  uint64_t pos_ = 0;
};

Status crc_of_file(int fd, uint64_t off, uint64_t n, std::span<uint8_t> buf, const std::string& what, StreamCrc* crc) {
  while (n > 0) {
    const uint64_t k = std::min<uint64_t>(n, buf.size());
    STRATA_RETURN_IF_ERROR(pread_full(fd, buf.data(), k, off, what));
    crc->add(buf.data(), k);
    off += k;
    n -= k;
  }
  return {};
}

}  // namespace

Status crc32c_of_file(int fd, uint64_t off, uint64_t n, std::span<uint8_t> buf, const std::string& what,
                      uint32_t* crc) {
  while (n > 0) {
    const uint64_t k = std::min<uint64_t>(n, buf.size());
    STRATA_RETURN_IF_ERROR(pread_full(fd, buf.data(), k, off, what));
    *crc = crc32c_extend(*crc, buf.data(), k);
    off += k;
    n -= k;
  }
  return {};
}

template <>
inline constexpr auto kEnumNames<CopyMethod> = std::to_array<EnumName<CopyMethod>>({{CopyMethod::kAuto, "auto"},
                                                                                   {CopyMethod::kReflink, "reflink"},
                                                                                   {CopyMethod::kCopyFileRange, "copy_file_range"},
                                                                                   {CopyMethod::kReadWrite, "read/write"}});

const char* copy_method_name(CopyMethod m) { return enum_name(m); }

Result<uint32_t> copy_file_ranges(std::span<const FileRange> src, std::span<const FileRange> dst, CopyMethod method,
                                  std::span<uint8_t> buffer, CopyStats* stats, BlockCrcs* blocks) {
  if (buffer.size() < 4096) return Status(StatusCode::kInvalidArgument, "copy buffer under 4096 bytes");
  uint64_t src_total = 0, dst_total = 0;
  for (const auto* side : {&src, &dst}) {
    uint64_t& total = side == &src ? src_total : dst_total;
    for (const auto& r : *side) {
      if (r.length > kMaxCopyBytes || total + r.length > kMaxCopyBytes) {
        return Status(StatusCode::kInvalidArgument, "file ranges add up to more than 2^56 bytes");
      }
      total += r.length;
    }
  }
  if (src_total != dst_total) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("copy of {} source bytes into {} destination bytes", src_total, dst_total));
  }
  std::vector<Fd> sfd(src.size()), dfd(dst.size());
  std::vector<uint64_t> src_size(src.size());
  for (std::size_t i = 0; i < src.size(); ++i) {
    STRATA_RETURN_IF_ERROR(open_range(src[i], false, &sfd[i]));
    struct stat st {};
    if (::fstat(sfd[i].get(), &st) != 0) return Status::from_errno(errno, "stat of " + range_name(src[i]));
    src_size[i] = static_cast<uint64_t>(st.st_size);
    if (S_ISREG(st.st_mode) && (src[i].length > src_size[i] || src[i].offset > src_size[i] - src[i].length)) {
      return Status(StatusCode::kIoError, fmt::format("range [{}, {}) ends at byte {} of {}, which has {} bytes",
                                                      src[i].offset, src[i].offset + src[i].length,
                                                      src[i].offset + src[i].length, range_name(src[i]), src_size[i]));
    }
    ::posix_fadvise(sfd[i].get(), static_cast<off_t>(src[i].offset), static_cast<off_t>(src[i].length),
                    POSIX_FADV_SEQUENTIAL);
  }
  for (std::size_t i = 0; i < dst.size(); ++i) STRATA_RETURN_IF_ERROR(open_range(dst[i], true, &dfd[i]));

  bool try_reflink = method == CopyMethod::kAuto || method == CopyMethod::kReflink;
  bool try_cfr = method != CopyMethod::kReadWrite;
  StreamCrc crc(blocks);
  std::size_t si = 0, di = 0;
  uint64_t sdone = 0, ddone = 0;  // bytes done within the current ranges
  CopyStats local;
  while (true) {
    while (si < src.size() && sdone == src[si].length) ++si, sdone = 0;
    while (di < dst.size() && ddone == dst[di].length) ++di, ddone = 0;
    if (si == src.size() || di == dst.size()) break;
    const int s = sfd[si].get(), d = dfd[di].get();
    const uint64_t soff = src[si].offset + sdone, doff = dst[di].offset + ddone;
    const uint64_t piece = std::min(src[si].length - sdone, dst[di].length - ddone);
    const std::string sname = range_name(src[si]), dname = range_name(dst[di]);

    if (try_reflink && soff % kCloneAlign == 0 && doff % kCloneAlign == 0 &&
        (piece % kCloneAlign == 0 || soff + piece == src_size[si])) {
      file_clone_range fcr{};
      fcr.src_fd = s;
      fcr.src_offset = soff;
      fcr.src_length = piece;
      fcr.dest_offset = doff;
      if (::ioctl(d, FICLONERANGE, &fcr) == 0) {
        // The clone shares the source's extents: read it once for the checksum.
        STRATA_RETURN_IF_ERROR(crc_of_file(d, doff, piece, buffer, dname, &crc));
        local.reflink_bytes += piece;
        sdone += piece;
        ddone += piece;
        continue;
      }
      const int err = errno;
      if (!method_refused(err)) {
        return Status::from_errno(err, fmt::format("reflink of {} bytes from {} to {}", piece, sname, dname));
      }
      log_once(LogLevel::kDebug, "checkpoint-reflink",
               fmt::format("reflink refused ({}); copying instead", strerror(err)));
      try_reflink = false;
    }

    const uint64_t n = std::min<uint64_t>(piece, buffer.size());
    if (try_cfr) {
      loff_t a = static_cast<loff_t>(soff), b = static_cast<loff_t>(doff);
      ssize_t r = ::copy_file_range(s, &a, d, &b, n, 0);
      if (r > 0) {
        // Checksum what landed: the pages were just written and are cached.
        STRATA_RETURN_IF_ERROR(crc_of_file(d, doff, static_cast<uint64_t>(r), buffer, dname, &crc));
        local.copy_file_range_bytes += static_cast<uint64_t>(r);
        sdone += static_cast<uint64_t>(r);
        ddone += static_cast<uint64_t>(r);
        continue;
      }
      if (r == 0) {
        return Status(StatusCode::kIoError,
                      fmt::format("copy of {} bytes at offset {} in {}: unexpected end of file", n, soff, sname));
      }
      const int err = errno;
      if (err == EINTR) continue;
      if (!method_refused(err)) {
        return Status::from_errno(err, fmt::format("copy_file_range of {} bytes from {} (offset {}) to {} (offset {})",
                                                   n, sname, soff, dname, doff));
      }
      log_once(LogLevel::kDebug, "checkpoint-cfr",
               fmt::format("copy_file_range refused ({}); using read/write", strerror(err)));
      try_cfr = false;
    }
    STRATA_RETURN_IF_ERROR(pread_full(s, buffer.data(), n, soff, sname));
    crc.add(buffer.data(), n);
    STRATA_RETURN_IF_ERROR(pwrite_full(d, buffer.data(), n, doff, dname));
    local.read_write_bytes += n;
    sdone += n;
    ddone += n;
  }
  if (stats) {
    stats->reflink_bytes += local.reflink_bytes;
    stats->copy_file_range_bytes += local.copy_file_range_bytes;
    stats->read_write_bytes += local.read_write_bytes;
  }
  return crc.finish();
}

}  // namespace strata
