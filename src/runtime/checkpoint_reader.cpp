// CheckpointReader: opens one rank's part of a committed checkpoint, checks
// it (runtime/checkpoint.h has the contract) and hands out verified bytes,
// into memory or streamed into file ranges through file_copy.h.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "common/posix_file.h"
#include "runtime/checkpoint.h"
#include "runtime/checkpoint_manifest.h"
#include "common/crc32c.h"

namespace strata {

Result<std::unique_ptr<CheckpointReader>> CheckpointReader::open(const std::string& dir_in,
                                                                 const CheckpointOpenOptions& options) {
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const std::string prefix = "checkpoint " + dir;
  if (options.buffer_bytes < 4096 || options.buffer_bytes > (1ull << 30)) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: buffer_bytes {} outside [4096, 1 GiB]", prefix, options.buffer_bytes));
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return Status::from_errno(errno, prefix);
  if (!S_ISDIR(st.st_mode)) return Status(StatusCode::kInvalidArgument, prefix + ": not a directory");

  STRATA_ASSIGN_OR_RETURN(ParsedIndex index, parse_index(dir, options.rank, prefix));
  STRATA_ASSIGN_OR_RETURN(ParsedManifest m, parse_manifest(dir, options.rank, prefix));
  if (m.self_crc != index.manifest_crc) {
    return Status(StatusCode::kCorrupt,
                  fmt::format("{}: {}: checksum {}, index.json says {} (from another checkpoint?)", prefix,
                              index.manifest, hex32(m.self_crc), hex32(index.manifest_crc)));
  }
  if (m.info.world_size != index.world_size || m.info.step != index.step || m.info.loss_scale != index.loss_scale) {
    return Status(StatusCode::kCorrupt,
                  fmt::format("{}: {} says world_size {}, step {}, loss scale {}; index.json says {}, {}, {}", prefix,
                              index.manifest, m.info.world_size, m.info.step, m.info.loss_scale, index.world_size,
                              index.step, index.loss_scale));
  }

  std::unique_ptr<CheckpointReader> rd(new CheckpointReader());
  rd->dir_ = dir;
  rd->options_ = options;
  rd->info_ = std::move(m.info);
  rd->entries_ = std::move(m.entries);
  rd->has_extra_file_ = m.has_extra_file;
  rd->extra_entry_ = m.extra;
  for (const auto& e : rd->entries_) STRATA_RETURN_IF_ERROR(rd->check_entry_file(e, false));
  if (rd->has_extra_file_) {
    STRATA_RETURN_IF_ERROR(rd->check_entry_file(rd->extra_entry_, false));
    rd->info_.extra_bytes.resize(rd->extra_entry_.bytes);
    const std::string path = join_path(dir, rd->extra_entry_.file);
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // checked a regular file above
    if (fd < 0) return Status::from_errno(errno, prefix + ": opening " + rd->extra_entry_.file);
    Fd guard(fd, true);
    STRATA_RETURN_IF_ERROR(pread_full(fd, rd->info_.extra_bytes.data(), rd->extra_entry_.bytes, 0, path));
    const uint32_t got = crc32c(rd->info_.extra_bytes.data(), rd->extra_entry_.bytes);
    if (got != rd->extra_entry_.crc32c) {
      return Status(StatusCode::kCorrupt,
                    fmt::format("{}: {}: checksum {}, manifest says {}", prefix, rd->extra_entry_.file, hex32(got),
                                hex32(rd->extra_entry_.crc32c)));
    }
  }
  if (options.verify_all) STRATA_RETURN_IF_ERROR(rd->verify_all());
  return rd;
}

const CheckpointEntry* CheckpointReader::find(std::string_view name) const {
  for (const auto& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

namespace {

// Opens an entry's data file and checks that it is a regular file of the size
// the manifest records; the errors name the checkpoint and the file.
Result<Fd> open_entry_file(const std::string& dir, const CheckpointEntry& e, const std::string& prefix) {
  const std::string path = join_path(dir, e.file);
  // O_NONBLOCK: a FIFO put in its place is refused below, not waited on.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return Status(StatusCode::kCorrupt, prefix + ": missing (the manifest lists it)");
    return Status::from_errno(err, prefix + ": open");
  }
  Fd guard(fd, true);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Status::from_errno(errno, prefix + ": stat");
  if (!S_ISREG(st.st_mode)) return Status(StatusCode::kCorrupt, prefix + ": not a regular file");
  if (static_cast<uint64_t>(st.st_size) != e.bytes) {
    return Status(StatusCode::kCorrupt, fmt::format("{}: {} bytes, manifest says {}{}", prefix, st.st_size, e.bytes,
                                                    static_cast<uint64_t>(st.st_size) < e.bytes ? " (truncated)" : ""));
  }
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  return guard;
}

Status checksum_mismatch(const std::string& prefix, uint32_t got, uint32_t want) {
  return Status(StatusCode::kCorrupt,
                fmt::format("{}: checksum {}, manifest says {}", prefix, hex32(got), hex32(want)));
}

}  // namespace

Status CheckpointReader::check_entry_file(const CheckpointEntry& e, bool checksum) {
  const std::string prefix = "checkpoint " + dir_ + ": " + e.file;
  STRATA_ASSIGN_OR_RETURN(Fd fd, open_entry_file(dir_, e, prefix));
  if (!checksum) return {};
  if (buffer_.empty()) buffer_.resize(options_.buffer_bytes);
  uint32_t crc = 0;
  STRATA_RETURN_IF_ERROR(crc32c_of_file(fd.get(), 0, e.bytes, buffer_, join_path(dir_, e.file), &crc));
  if (crc != e.crc32c) return checksum_mismatch(prefix, crc, e.crc32c);
  return {};
}

Status CheckpointReader::verify_all() {
  for (const auto& e : entries_) STRATA_RETURN_IF_ERROR(check_entry_file(e, true));
  if (has_extra_file_) STRATA_RETURN_IF_ERROR(check_entry_file(extra_entry_, true));
  return {};
}

Status CheckpointReader::read(std::string_view name, void* dst, uint64_t dst_bytes) {
  const CheckpointEntry* e = find(name);
  if (!e) {
    return Status(StatusCode::kNotFound,
                  fmt::format("checkpoint {}: no entry \"{}\" for rank {}", dir_, name, info_.rank));
  }
  const std::string prefix = "checkpoint " + dir_ + ": " + e->file;
  if (dst_bytes != e->bytes) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: entry \"{}\" has {} bytes, the buffer {}", prefix, name, e->bytes, dst_bytes));
  }
  const std::string path = join_path(dir_, e->file);
  STRATA_ASSIGN_OR_RETURN(Fd fd, open_entry_file(dir_, *e, prefix));
  auto* p = static_cast<unsigned char*>(dst);
  uint32_t crc = 0;
  for (uint64_t off = 0; off < e->bytes;) {
    const uint64_t n = std::min<uint64_t>(e->bytes - off, options_.buffer_bytes);
    Status s = pread_full(fd.get(), p + off, n, off, path);
    if (!s.ok()) return s.with_context("checkpoint " + dir_);
    crc = crc32c_extend(crc, p + off, n);  // while the piece is in cache
    off += n;
  }
  if (crc != e->crc32c) return checksum_mismatch(prefix, crc, e->crc32c);
  stats_.buffer_bytes += e->bytes;
  return {};
}

Status CheckpointReader::read_to_file_ranges(std::string_view name, std::span<const FileRange> ranges,
                                             BlockCrcs* blocks) {
  const CheckpointEntry* e = find(name);
  if (!e) {
    return Status(StatusCode::kNotFound,
                  fmt::format("checkpoint {}: no entry \"{}\" for rank {}", dir_, name, info_.rank));
  }
  const std::string prefix = "checkpoint " + dir_ + ": " + e->file;
  STRATA_RETURN_IF_ERROR(check_entry_file(*e, false));
  if (buffer_.empty()) buffer_.resize(options_.buffer_bytes);
  FileRange src;
  src.path = join_path(dir_, e->file);
  src.length = e->bytes;
  auto crc = copy_file_ranges(std::span<const FileRange>(&src, 1), ranges, options_.copy_method, buffer_, &stats_, blocks);
  if (!crc.ok()) return crc.status().with_context(prefix);
  if (*crc != e->crc32c) return checksum_mismatch(prefix, *crc, e->crc32c);
  return {};
}

}  // namespace strata
