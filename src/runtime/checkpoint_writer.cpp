// CheckpointWriter: one rank's part of a save, staged in <dir>.tmp-<token>
// and, on rank 0, committed by an atomic rename (runtime/checkpoint.h has the
// contract, docs/checkpoints.md the guarantees). The JSON it writes comes from
// checkpoint_manifest.h; NVMe-resident entries stream through file_copy.h.
#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>

#include "common/json.h"
#include "common/log.h"
#include "common/posix_file.h"
#include "runtime/checkpoint.h"
#include "runtime/checkpoint_manifest.h"
#include "common/crc32c.h"

namespace strata {

using json = nlohmann::json;

namespace {

constexpr std::size_t kMaxFileStem = 160;

// "<digits><tail>" at `pos` of `name`, ending the name.
bool digits_then(const std::string& name, size_t pos, std::string_view tail) {
  size_t i = pos;
  while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) ++i;
  return i > pos && name.compare(i, std::string::npos, tail) == 0;
}

// The names a checkpoint writer gives its files: index.json,
// manifest.rank<R>.json, <entry>.rank<R>.bin (extra.rank<R>.bin too).
bool is_checkpoint_file_name(const std::string& name) {
  if (name == "index.json") return true;
  if (name.rfind("manifest.rank", 0) == 0) return digits_then(name, 13, ".json");
  const size_t r = name.rfind(".rank");
  return r != std::string::npos && digits_then(name, r + 5, ".bin");
}

bool valid_token(const std::string& t) {
  if (t.empty() || t.size() > 64) return false;
  for (char c : t) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) return false;
  }
  return true;
}

std::string random_token() {
  std::random_device rd;
  const uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                     static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return fmt::format("{}-{:012x}", ::getpid(), r & 0xFFFFFFFFFFFFull);
}

std::string sanitize_stem(std::string_view name) {
  std::string s;
  s.reserve(std::min(name.size(), kMaxFileStem));
  for (char c : name) {
    if (s.size() >= kMaxFileStem) break;
    const bool keep = std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_';
    s.push_back(keep ? c : '_');
  }
  if (s.empty() || s[0] == '.') s.insert(s.begin(), '_');
  return s;
}

}  // namespace

Result<std::unique_ptr<CheckpointWriter>> CheckpointWriter::create(const std::string& dir_in,
                                                                   const CheckpointInfo& info,
                                                                   const CheckpointWriteOptions& options) {
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (dir.empty() || dir == "/" || base_of(dir) == "." || base_of(dir) == "..") {
    return Status(StatusCode::kInvalidArgument, "checkpoint directory \"" + dir_in + "\" is not a usable name");
  }
  if (options.world_size == 0 || options.world_size > kMaxWorldSize || options.rank >= options.world_size) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("checkpoint {}: rank {} with world_size {}", dir, options.rank, options.world_size));
  }
  if (options.buffer_bytes < 4096 || options.buffer_bytes > (1ull << 30)) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("checkpoint {}: buffer_bytes {} outside [4096, 1 GiB]", dir, options.buffer_bytes));
  }
  if (!std::isfinite(info.loss_scale) || info.loss_scale <= 0) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("checkpoint {}: loss scale {} is not a finite number > 0", dir, info.loss_scale));
  }
  if (info.extra_bytes.size() > (1ull << 32)) {
    return Status(StatusCode::kInvalidArgument, fmt::format("checkpoint {}: extra bytes over 4 GiB", dir));
  }
  std::unique_ptr<CheckpointWriter> w(new CheckpointWriter());
  w->info_ = info;
  w->info_.format_version = kCheckpointFormatVersion;
  w->info_.rank = options.rank;
  w->info_.world_size = options.world_size;
  if (!info.extra_json.empty()) {
    json parsed = json::parse(info.extra_json, nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded()) {
      return Status(StatusCode::kInvalidArgument, fmt::format("checkpoint {}: extra_json is not valid JSON", dir));
    }
    w->info_.extra_json = parsed.dump();
  }
  w->dir_ = dir;
  w->options_ = options;
  if (!options.token.empty() && !valid_token(options.token)) {
    return Status(
        StatusCode::kInvalidArgument,
        fmt::format("checkpoint {}: token \"{}\": use 1-64 letters, digits, '-', '_', '.'", dir, options.token));
  }
  if (options.token.empty() && options.world_size > 1) {
    return Status(
        StatusCode::kInvalidArgument,
        fmt::format("checkpoint {}: world_size {} needs a token shared by all ranks", dir, options.world_size));
  }
  // staging_ is set only once the directory is ours to clean up.
  for (int attempt = 0;; ++attempt) {
    const std::string token = options.token.empty() ? random_token() : options.token;
    const std::string staging = dir + ".tmp-" + token;
    bool ours = ::mkdir(staging.c_str(), 0755) == 0;
    const int err = errno;
    if (!ours && err == EEXIST && options.world_size > 1) {
      struct stat st {};
      ours = ::stat(staging.c_str(), &st) == 0 && S_ISDIR(st.st_mode);  // another rank made it
    }
    if (ours) {
      w->token_ = token;
      w->staging_ = staging;
      break;
    }
    if (err == EEXIST && options.token.empty() && attempt < 8) continue;
    return Status::from_errno(err, "checkpoint " + dir + ": creating the staging directory " + staging);
  }
  return w;
}

CheckpointWriter::~CheckpointWriter() {
  // A finished shard of an N-rank save belongs to the save now: rank 0
  // commits it, or removes it with abort_checkpoint_staging().
  if (!committed_ && !(options_.world_size > 1 && finished_ && !failed_)) cleanup();
}

void CheckpointWriter::cleanup() {
  if (staging_.empty()) return;
  // World size 1 owns the whole staging directory; with N ranks each rank
  // removes only its own files (rank 0 removes the directory via
  // abort_checkpoint_staging once every rank has stopped).
  if (options_.world_size == 1) {
    Status st = remove_tree(staging_);
    if (!st.ok()) log_warn("checkpoint {}: {}", dir_, st.message());
  } else {
    for (const auto& f : files_) ::unlink(join_path(staging_, f).c_str());
  }
  files_.clear();
}

Status CheckpointWriter::fail(Status st) {
  failed_ = true;
  cleanup();
  return st;
}

Status CheckpointWriter::add_entry_file(std::string_view name, DType dtype, uint64_t count, uint64_t bytes,
                                        std::string* file, int* fd) {
  if (failed_) return Status(StatusCode::kInvalidArgument, "checkpoint " + dir_ + ": writer failed earlier");
  if (finished_)
    return Status(StatusCode::kInvalidArgument, "checkpoint " + dir_ + ": entry added after finish_shard()");
  if (name.empty() || name.size() > kMaxNameBytes || name.find('\0') != std::string_view::npos) {
    return Status(
        StatusCode::kInvalidArgument,
        "checkpoint " + dir_ + ": entry name must be 1-1024 bytes without NUL: \"" + std::string(name) + "\"");
  }
  for (const auto& e : entries_) {
    if (e.name == name) {
      return Status(StatusCode::kInvalidArgument,
                    "checkpoint " + dir_ + ": entry \"" + std::string(name) + "\" added twice");
    }
  }
  const uint64_t esize = dtype_size(dtype);
  if (count > kMaxEntryBytes / esize || count * esize != bytes) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("checkpoint {}: entry \"{}\": {} elements of {} are not {} bytes", dir_, name, count,
                              dtype_name(dtype), bytes));
  }
  // Files are named after the entry so a person can find them; characters a
  // file name cannot hold become '_', and clashes get a ~N suffix.
  const std::string stem = sanitize_stem(name);
  const std::string suffix = fmt::format(".rank{}.bin", options_.rank);
  const std::string reserved = fmt::format("extra.rank{}.bin", options_.rank);
  std::string candidate = stem + suffix;
  for (int n = 2;; ++n) {
    bool clash = candidate == reserved;
    for (const auto& f : files_) clash = clash || f == candidate;
    if (!clash) break;
    candidate = fmt::format("{}~{}{}", stem, n, suffix);
  }
  const std::string path = join_path(staging_, candidate);
  int f = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (f < 0) return fail(Status::from_errno(errno, "checkpoint " + dir_ + ": creating " + path));
  files_.push_back(candidate);
  *file = candidate;
  *fd = f;
  return {};
}

Status CheckpointWriter::add_buffer(std::string_view name, DType dtype, uint64_t count, const void* data,
                                    uint64_t bytes) {
  if (bytes > 0 && data == nullptr) return Status(StatusCode::kInvalidArgument, "checkpoint " + dir_ + ": null data");
  std::string file;
  int fd = -1;
  STRATA_RETURN_IF_ERROR(add_entry_file(name, dtype, count, bytes, &file, &fd));
  Fd guard(fd, true);
  // Checksum and write piece by piece so each piece is checksummed while it
  // is still in the CPU cache (one pass over memory, not two).
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t crc = 0;
  for (uint64_t off = 0; off < bytes;) {
    const uint64_t n = std::min<uint64_t>(bytes - off, options_.buffer_bytes);
    crc = crc32c_extend(crc, p + off, n);
    Status st = pwrite_full(fd, p + off, n, off, join_path(staging_, file));
    if (!st.ok()) return fail(st.with_context("checkpoint " + dir_ + ": entry \"" + std::string(name) + "\""));
    off += n;
  }
  entries_.push_back({std::string(name), file, dtype, count, bytes, crc});
  stats_.buffer_bytes += bytes;
  return {};
}

Status CheckpointWriter::add_file_ranges(std::string_view name, DType dtype, uint64_t count,
                                         std::span<const FileRange> ranges, BlockCrcs* blocks) {
  uint64_t total = 0;
  for (const auto& r : ranges) {
    if (r.length > kMaxEntryBytes || total + r.length > kMaxEntryBytes) {
      return Status(StatusCode::kInvalidArgument,
                    "checkpoint " + dir_ + ": entry \"" + std::string(name) + "\" too large");
    }
    total += r.length;
  }
  std::string file;
  int fd = -1;
  STRATA_RETURN_IF_ERROR(add_entry_file(name, dtype, count, total, &file, &fd));
  Fd guard(fd, true);
  if (buffer_.empty()) {
    // The copy buffer (8 MiB by default): refused cleanly, not std::bad_alloc,
    // under a small `ulimit -v`.
    try {
      buffer_.resize(options_.buffer_bytes);
    } catch (const std::bad_alloc&) {
      return fail(Status(StatusCode::kOutOfMemory,
                         fmt::format("checkpoint {}: cannot allocate a {}-byte copy buffer", dir_, options_.buffer_bytes)));
    }
  }
  FileRange dst;
  dst.path = join_path(staging_, file);
  dst.fd = fd;
  dst.length = total;
  auto crc = copy_file_ranges(ranges, std::span<const FileRange>(&dst, 1), options_.copy_method, buffer_, &stats_, blocks);
  if (!crc.ok()) return fail(crc.status().with_context("checkpoint " + dir_ + ": entry \"" + std::string(name) + "\""));
  entries_.push_back({std::string(name), file, dtype, count, total, *crc});
  return {};
}

Status CheckpointWriter::finish_shard() {
  if (failed_) return Status(StatusCode::kInvalidArgument, "checkpoint " + dir_ + ": writer failed earlier");
  if (finished_) return {};
  const std::string prefix = "checkpoint " + dir_;
  CheckpointEntry extra;  // the extra bytes' file, when there are any
  if (!info_.extra_bytes.empty()) {
    const std::string file = fmt::format("extra.rank{}.bin", options_.rank);
    const std::string path = join_path(staging_, file);
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return fail(Status::from_errno(errno, prefix + ": creating " + path));
    files_.push_back(file);
    Fd guard(fd, true);
    Status st = pwrite_full(fd, info_.extra_bytes.data(), info_.extra_bytes.size(), 0, path);
    if (!st.ok()) return fail(st.with_context(prefix));
    extra.file = file;
    extra.bytes = info_.extra_bytes.size();
    extra.crc32c = crc32c(info_.extra_bytes.data(), info_.extra_bytes.size());
  }
  // Data files were written without fsync so their writeback could overlap;
  // one pass now makes them durable before the manifest that names them.
  for (const auto& f : files_) {
    Status st = fsync_path(join_path(staging_, f), false, /*drop_cache=*/true);
    if (!st.ok()) return fail(st.with_context(prefix));
  }
  const std::string file = manifest_file_name(options_.rank);
  Status st = write_new_file(join_path(staging_, file),
                             manifest_text(info_, info_.extra_bytes.empty() ? nullptr : &extra, entries_));
  files_.push_back(file);
  if (!st.ok()) return fail(st.with_context(prefix));
  st = fsync_path(staging_, true);
  if (!st.ok()) return fail(st.with_context(prefix));
  finished_ = true;
  return {};
}

Status CheckpointWriter::commit() {
  const std::string prefix = "checkpoint " + dir_;
  if (committed_) return {};
  if (options_.rank != 0) return Status(StatusCode::kInvalidArgument, prefix + ": commit() is rank 0's call");
  STRATA_RETURN_IF_ERROR(finish_shard());
  auto hook = [&](std::string_view stage) {
    if (options_.stage_hook) options_.stage_hook(stage);
  };

  // Every rank's manifest must be there and agree with ours.
  std::vector<uint32_t> manifest_crcs;
  for (uint32_t r = 0; r < options_.world_size; ++r) {
    auto m = parse_manifest(staging_, r, prefix + " (staging " + staging_ + ")");
    if (!m.ok()) {
      Status st = m.status().code() == StatusCode::kNotFound
                      ? Status(StatusCode::kNotFound,
                               fmt::format("{}: rank {} has not finished its shard (no manifest.rank{}.json in {})",
                                           prefix, r, r, staging_))
                      : m.status();
      return fail(st);
    }
    if (m->info.world_size != options_.world_size || m->info.step != info_.step ||
        m->info.loss_scale != info_.loss_scale) {
      return fail(Status(StatusCode::kInvalidArgument,
                         fmt::format("{}: rank {} wrote world_size {}, step {}, loss scale {}; rank 0 has {}, {}, {}",
                                     prefix, r, m->info.world_size, m->info.step, m->info.loss_scale,
                                     options_.world_size, info_.step, info_.loss_scale)));
    }
    manifest_crcs.push_back(m->self_crc);
  }

  // Refuse to replace something that is not a checkpoint (a typo must not
  // delete a home directory).
  struct stat st {};
  bool target_exists = false;
  if (::lstat(dir_.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) {
      return fail(
          Status(StatusCode::kAlreadyExists, prefix + ": exists and is not a directory; refusing to replace it"));
    }
    // A checkpoint the user added files to (metrics, a tokenizer) is not
    // replaced either: that would delete them (DeepSpeed leaves them alone).
    struct stat ist {};
    const bool has_index = ::stat(join_path(dir_, "index.json").c_str(), &ist) == 0;
    auto names = list_dir(dir_);
    if (!names.ok()) return fail(names.status().with_context(prefix));
    std::vector<std::string> foreign;
    for (const std::string& name : *names)
      if (!has_index || !is_checkpoint_file_name(name)) foreign.push_back(name);
    if (!has_index && !foreign.empty()) {
      return fail(Status(StatusCode::kAlreadyExists,
                         prefix + ": exists and is not a Strata checkpoint (no index.json); refusing to replace it"));
    }
    if (!foreign.empty()) {
      std::sort(foreign.begin(), foreign.end());
      return fail(Status(StatusCode::kAlreadyExists,
                         fmt::format("{}: the checkpoint there also holds files Strata did not write ({}); "
                                     "replacing it would delete them: move them, or save to another directory",
                                     prefix, names_for_message(foreign))));
    }
    target_exists = true;
  }

  Status s = write_new_file(join_path(staging_, "index.json"),
                            index_text(info_.step, info_.loss_scale, options_.world_size, manifest_crcs));
  files_.push_back("index.json");
  if (s.ok()) s = fsync_path(staging_, true);
  if (!s.ok()) return fail(s.with_context(prefix));
  hook("staged");

  const std::string parent = parent_of(dir_);
  std::string replaced;  // where the previous checkpoint ended up
  if (target_exists) {
    // RENAME_EXCHANGE swaps the two names in one step: <dir> always holds a
    // complete checkpoint, old or new.
    if (::renameat2(AT_FDCWD, staging_.c_str(), AT_FDCWD, dir_.c_str(), RENAME_EXCHANGE) == 0) {
      replaced = staging_;
      hook("exchanged");
    } else {
      const int err = errno;
      if (err != EINVAL && err != ENOSYS && err != EOPNOTSUPP) {
        return fail(Status::from_errno(err, prefix + ": exchanging " + staging_ + " with " + dir_));
      }
      // No exchange on this filesystem: rename the old one away first. A crash
      // between the two renames leaves no <dir>; cleanup_checkpoint_leftovers
      // renames <dir>.old-<token> back.
      replaced = dir_ + ".old-" + token_;
      if (::rename(dir_.c_str(), replaced.c_str()) != 0) {
        return fail(Status::from_errno(errno, prefix + ": renaming the old checkpoint to " + replaced));
      }
      hook("renamed_old");
      if (::rename(staging_.c_str(), dir_.c_str()) != 0) {
        const int err2 = errno;
        if (::rename(replaced.c_str(), dir_.c_str()) != 0) {
          log_error("checkpoint {}: could not move the old checkpoint back from {}: {}", dir_, replaced,
                    strerror(errno));
        }
        return fail(Status::from_errno(err2, prefix + ": renaming " + staging_ + " to " + dir_));
      }
    }
  } else if (::rename(staging_.c_str(), dir_.c_str()) != 0) {
    return fail(Status::from_errno(errno, prefix + ": renaming " + staging_ + " to " + dir_));
  }
  committed_ = true;
  staging_.clear();
  hook("renamed");
  Status ps = fsync_path(parent, true);
  if (!ps.ok()) {
    // The new checkpoint is in place but the rename may not survive a power
    // cut; say so rather than pretending.
    return ps.with_context(prefix + ": committed, but the parent directory could not be synced");
  }
  if (!replaced.empty()) {
    Status rs = remove_tree(replaced);
    if (!rs.ok()) log_warn("checkpoint {}: removing the replaced checkpoint: {}", dir_, rs.message());
  }
  hook("committed");
  return {};
}

Status abort_checkpoint_staging(const std::string& dir, const std::string& token) {
  if (!valid_token(token))
    return Status(StatusCode::kInvalidArgument, "abort_checkpoint_staging: bad token \"" + token + "\"");
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  return remove_tree(d + ".tmp-" + token);
}

}  // namespace strata
