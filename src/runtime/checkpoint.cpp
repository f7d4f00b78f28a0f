#include "runtime/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/fs.h>
#include <stdio.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "common/log.h"
#include "runtime/crc32c.h"

namespace strata {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

namespace {

constexpr uint64_t kMaxJsonBytes = 256ull << 20;  // a manifest of ~1M entries
constexpr uint64_t kMaxEntryBytes = 1ull << 56;   // 64 PiB: bounds every size sum
constexpr uint32_t kMaxWorldSize = 1u << 20;
constexpr std::size_t kMaxNameBytes = 1024;
constexpr std::size_t kMaxFileStem = 160;
constexpr uint64_t kCloneAlign = 4096;  // FICLONERANGE's block alignment on ext4/xfs/btrfs

// ---------------------------------------------------------------- small file helpers

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
  ~Fd() { reset(); }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0 && owned_) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
  bool owned_ = false;
};

std::string range_name(const FileRange& r) {
  return r.fd >= 0 && r.path.empty() ? fmt::format("fd {}", r.fd) : r.path;
}

std::string join(const std::string& dir, std::string_view name) {
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

// fsync(2) through a fresh descriptor (Linux reports writeback errors to
// every descriptor opened before they are seen). `drop_cache`: a checkpoint
// file is written once and rarely read, so once durable its pages should not
// push the training working set out of the page cache.
Status fsync_path(const std::string& path, bool directory, bool drop_cache = false) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0));
  if (fd < 0) return Status::from_errno(errno, "opening " + path + " to fsync it");
  Status st;
  if (::fsync(fd) != 0) st = Status::from_errno(errno, "fsync of " + path);
  if (st.ok() && drop_cache) ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  return st;
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
  int fd = ::open(r.path.c_str(), mode | O_CLOEXEC | (dst ? O_CREAT : 0), 0600);
  if (fd < 0) return Status::from_errno(errno, std::string("opening ") + r.path + (dst ? " for writing" : ""));
  *out = Fd(fd, true);
  return {};
}

// Errors that mean "this copy method is not available here", not "the copy
// failed": fall back to the next method.
bool method_refused(int err) {
  return err == EOPNOTSUPP || err == ENOTTY || err == EXDEV || err == EINVAL || err == ENOSYS || err == EBADF ||
         err == ETXTBSY || err == EISDIR || err == EPERM;
}

Status crc_of_range(int fd, uint64_t off, uint64_t n, std::span<uint8_t> buf, const std::string& what, uint32_t* crc) {
  while (n > 0) {
    const uint64_t k = std::min<uint64_t>(n, buf.size());
    STRATA_RETURN_IF_ERROR(pread_full(fd, buf.data(), k, off, what));
    *crc = crc32c_extend(*crc, buf.data(), k);
    off += k;
    n -= k;
  }
  return {};
}

std::string hex32(uint32_t v) {
  return fmt::format("0x{:08x}", v);
}

bool parse_hex32(const std::string& s, uint32_t* v) {
  if (s.size() != 10 || s[0] != '0' || s[1] != 'x') return false;
  uint32_t x = 0;
  for (std::size_t i = 2; i < 10; ++i) {
    const char c = s[i];
    uint32_t d;
    if (c >= '0' && c <= '9')
      d = static_cast<uint32_t>(c - '0');
    else if (c >= 'a' && c <= 'f')
      d = static_cast<uint32_t>(c - 'a' + 10);
    else
      return false;
    x = (x << 4) | d;
  }
  *v = x;
  return true;
}

// ---------------------------------------------------------------- self-checksummed JSON

// A manifest carries the CRC32C of its own canonical form: the compact dump of
// the object without "self_crc32c", keys sorted (nlohmann::json's std::map
// order). Parsing and re-dumping is stable (integers exact, doubles shortest
// round-trip), so the file itself can stay pretty-printed and readable.
uint32_t canonical_crc(const json& without_self) {
  const std::string text = without_self.dump();
  return crc32c(text.data(), text.size());
}

std::string with_self_crc(const ordered_json& doc, uint32_t* crc_out) {
  json sorted = json::parse(doc.dump());
  const uint32_t crc = canonical_crc(sorted);
  ordered_json out = doc;
  out["self_crc32c"] = hex32(crc);
  if (crc_out) *crc_out = crc;
  return out.dump(2) + "\n";
}

Status write_new_file(const std::string& path, const std::string& text) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Status::from_errno(errno, "creating " + path);
  Fd guard(fd, true);
  STRATA_RETURN_IF_ERROR(pwrite_full(fd, text.data(), text.size(), 0, path));
  if (::fsync(fd) != 0) return Status::from_errno(errno, "fsync of " + path);
  return {};
}

// ---------------------------------------------------------------- manifest parsing

// Strict reader of one JSON object: every key must be known, every value the
// right type and in bounds. Errors are kCorrupt with "<file>: <key>: why".
class ObjReader {
 public:
  ObjReader(const json& o, std::string where) : o_(o), where_(std::move(where)) {}

  Status corrupt(const std::string& key, const std::string& why) const {
    return Status(StatusCode::kCorrupt, where_ + (key.empty() ? "" : ": " + key) + ": " + why);
  }
  Status check_keys(std::initializer_list<const char*> known) const {
    for (auto it = o_.begin(); it != o_.end(); ++it) {
      bool ok = false;
      for (const char* k : known) ok = ok || it.key() == k;
      if (!ok) return corrupt(it.key(), "unknown key");
    }
    return {};
  }
  Result<const json*> get(const char* key) const {
    auto it = o_.find(key);
    if (it == o_.end()) return corrupt(key, "missing");
    return &*it;
  }
  Result<uint64_t> u64(const char* key, uint64_t max) const {
    STRATA_ASSIGN_OR_RETURN(const json* v, get(key));
    if (!v->is_number_unsigned()) {
      if (v->is_number_integer() && v->get<int64_t>() >= 0) {
        // fallthrough: nlohmann stores non-negative literals as unsigned; be lenient.
      } else {
        return corrupt(key, "expected a non-negative integer, got " + v->dump());
      }
    }
    const uint64_t x = v->get<uint64_t>();
    if (x > max) return corrupt(key, fmt::format("{} is above the limit {}", x, max));
    return x;
  }
  Result<std::string> str(const char* key) const {
    STRATA_ASSIGN_OR_RETURN(const json* v, get(key));
    if (!v->is_string()) return corrupt(key, "expected a string, got " + v->dump());
    return v->get<std::string>();
  }
  Result<uint32_t> crc(const char* key) const {
    STRATA_ASSIGN_OR_RETURN(std::string s, str(key));
    uint32_t v = 0;
    if (!parse_hex32(s, &v)) return corrupt(key, "expected \"0x\" and 8 lower-case hex digits, got \"" + s + "\"");
    return v;
  }
  Result<double> positive_double(const char* key) const {
    STRATA_ASSIGN_OR_RETURN(const json* v, get(key));
    if (!v->is_number()) return corrupt(key, "expected a number, got " + v->dump());
    const double d = v->get<double>();
    if (!std::isfinite(d) || d <= 0) return corrupt(key, fmt::format("expected a finite number > 0, got {}", d));
    return d;
  }

 private:
  const json& o_;
  std::string where_;
};

// Reads and parses a JSON file of a checkpoint, checking size bounds, syntax,
// format name/version and its self checksum. `prefix` is "checkpoint <dir>".
Result<json> load_checked_json(const std::string& dir, const std::string& file, const char* format,
                               const std::string& prefix, uint32_t* self_crc) {
  const std::string path = join(dir, file);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return Status(StatusCode::kNotFound,
                    prefix + ": " + file + " is missing (not a checkpoint, or a save that never committed)");
    }
    return Status::from_errno(err, prefix + ": opening " + file);
  }
  Fd guard(fd, true);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Status::from_errno(errno, prefix + ": stat of " + file);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == 0) return Status(StatusCode::kCorrupt, prefix + ": " + file + ": empty file");
  if (size > kMaxJsonBytes) {
    return Status(StatusCode::kCorrupt,
                  fmt::format("{}: {}: {} bytes, more than a manifest can be ({})", prefix, file, size, kMaxJsonBytes));
  }
  std::string text(size, '\0');
  STRATA_RETURN_IF_ERROR(pread_full(fd, text.data(), size, 0, path).with_context(prefix));
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::parse_error& e) {
    return Status(StatusCode::kCorrupt, fmt::format("{}: {}: not valid JSON at byte {} of {} (truncated or damaged)",
                                                    prefix, file, e.byte, size));
  }
  const std::string where = prefix + ": " + file;
  if (!doc.is_object()) return Status(StatusCode::kCorrupt, where + ": expected a JSON object");
  ObjReader r(doc, where);
  STRATA_ASSIGN_OR_RETURN(std::string fmt_name, r.str("format"));
  if (fmt_name != format)
    return r.corrupt("format", "expected \"" + std::string(format) + "\", got \"" + fmt_name + "\"");
  STRATA_ASSIGN_OR_RETURN(uint64_t version, r.u64("format_version", std::numeric_limits<uint32_t>::max()));
  if (version != kCheckpointFormatVersion) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("{}: format version {} is not supported (this Strata reads version {})", where, version,
                              kCheckpointFormatVersion));
  }
  STRATA_ASSIGN_OR_RETURN(uint32_t want, r.crc("self_crc32c"));
  json body = doc;
  body.erase("self_crc32c");
  const uint32_t got = canonical_crc(body);
  if (got != want) {
    return Status(StatusCode::kCorrupt, fmt::format("{}: checksum {}, file says {}", where, hex32(got), hex32(want)));
  }
  if (self_crc) *self_crc = want;
  return doc;
}

bool valid_file_name(const std::string& f) {
  if (f.empty() || f.size() > 255 || f[0] == '.') return false;
  for (char c : f) {
    if (c == '/' || c == '\0') return false;
  }
  return true;
}

Result<CkDType> parse_dtype(const std::string& s) {
  for (CkDType t :
       {CkDType::kU8, CkDType::kFp32, CkDType::kBf16, CkDType::kFp16, CkDType::kFp64, CkDType::kI32, CkDType::kI64}) {
    if (s == ck_dtype_name(t)) return t;
  }
  return Status(StatusCode::kCorrupt, "unknown dtype \"" + s + "\"");
}

// One entry object of a manifest.
Result<CheckpointEntry> parse_entry(const json& e, const std::string& where) {
  if (!e.is_object()) return Status(StatusCode::kCorrupt, where + ": expected an object");
  ObjReader r(e, where);
  STRATA_RETURN_IF_ERROR(r.check_keys({"name", "file", "dtype", "count", "bytes", "crc32c"}));
  CheckpointEntry out;
  STRATA_ASSIGN_OR_RETURN(out.name, r.str("name"));
  if (out.name.empty() || out.name.size() > kMaxNameBytes || out.name.find('\0') != std::string::npos) {
    return r.corrupt("name", "empty, over 1024 bytes, or holds a NUL");
  }
  STRATA_ASSIGN_OR_RETURN(out.file, r.str("file"));
  if (!valid_file_name(out.file)) {
    return r.corrupt("file", "\"" + out.file + "\" is not a plain file name inside the checkpoint");
  }
  STRATA_ASSIGN_OR_RETURN(std::string dt, r.str("dtype"));
  auto dtype = parse_dtype(dt);
  if (!dtype.ok()) return r.corrupt("dtype", dtype.status().message());
  out.dtype = *dtype;
  STRATA_ASSIGN_OR_RETURN(out.count, r.u64("count", kMaxEntryBytes));
  STRATA_ASSIGN_OR_RETURN(out.bytes, r.u64("bytes", kMaxEntryBytes));
  if (out.count * ck_dtype_size(out.dtype) != out.bytes) {
    return r.corrupt("bytes", fmt::format("{} elements of {} are {} bytes, not {}", out.count, dt,
                                          out.count * ck_dtype_size(out.dtype), out.bytes));
  }
  STRATA_ASSIGN_OR_RETURN(out.crc32c, r.crc("crc32c"));
  return out;
}

struct ParsedManifest {
  CheckpointInfo info;
  std::vector<CheckpointEntry> entries;
  bool has_extra_file = false;
  CheckpointEntry extra;
  uint32_t self_crc = 0;
};

Result<ParsedManifest> parse_manifest(const std::string& dir, uint32_t rank, const std::string& prefix) {
  const std::string file = fmt::format("manifest.rank{}.json", rank);
  ParsedManifest m;
  STRATA_ASSIGN_OR_RETURN(json doc, load_checked_json(dir, file, "strata-checkpoint-manifest", prefix, &m.self_crc));
  const std::string where = prefix + ": " + file;
  ObjReader r(doc, where);
  STRATA_RETURN_IF_ERROR(r.check_keys({"format", "format_version", "self_crc32c", "rank", "world_size", "step",
                                       "loss_scale", "extra_json", "extra_bytes", "entries"}));
  STRATA_ASSIGN_OR_RETURN(uint64_t ws, r.u64("world_size", kMaxWorldSize));
  STRATA_ASSIGN_OR_RETURN(uint64_t rk, r.u64("rank", kMaxWorldSize));
  if (ws == 0) return r.corrupt("world_size", "is 0");
  if (rk != rank) return r.corrupt("rank", fmt::format("{} in the file of rank {}", rk, rank));
  if (rk >= ws) return r.corrupt("rank", fmt::format("{} is not below world_size {}", rk, ws));
  m.info.world_size = static_cast<uint32_t>(ws);
  m.info.rank = static_cast<uint32_t>(rk);
  STRATA_ASSIGN_OR_RETURN(m.info.step, r.u64("step", std::numeric_limits<uint64_t>::max()));
  STRATA_ASSIGN_OR_RETURN(m.info.loss_scale, r.positive_double("loss_scale"));
  STRATA_ASSIGN_OR_RETURN(const json* extra_json, r.get("extra_json"));
  if (!extra_json->is_null()) m.info.extra_json = extra_json->dump();
  STRATA_ASSIGN_OR_RETURN(const json* extra_bytes, r.get("extra_bytes"));
  if (!extra_bytes->is_null()) {
    if (!extra_bytes->is_object()) return r.corrupt("extra_bytes", "expected an object or null");
    ObjReader xr(*extra_bytes, where + ": extra_bytes");
    STRATA_RETURN_IF_ERROR(xr.check_keys({"file", "bytes", "crc32c"}));
    m.has_extra_file = true;
    m.extra.name = "(extra bytes)";
    m.extra.dtype = CkDType::kU8;
    STRATA_ASSIGN_OR_RETURN(m.extra.file, xr.str("file"));
    if (!valid_file_name(m.extra.file)) return xr.corrupt("file", "not a plain file name inside the checkpoint");
    STRATA_ASSIGN_OR_RETURN(m.extra.bytes, xr.u64("bytes", 1ull << 32));
    m.extra.count = m.extra.bytes;
    STRATA_ASSIGN_OR_RETURN(m.extra.crc32c, xr.crc("crc32c"));
  }
  STRATA_ASSIGN_OR_RETURN(const json* entries, r.get("entries"));
  if (!entries->is_array()) return r.corrupt("entries", "expected an array");
  std::set<std::string> names, files;
  if (m.has_extra_file) files.insert(m.extra.file);
  for (std::size_t i = 0; i < entries->size(); ++i) {
    STRATA_ASSIGN_OR_RETURN(CheckpointEntry e, parse_entry((*entries)[i], fmt::format("{}: entries[{}]", where, i)));
    if (!names.insert(e.name).second) return r.corrupt("entries", "the name \"" + e.name + "\" appears twice");
    if (!files.insert(e.file).second) return r.corrupt("entries", "the file \"" + e.file + "\" appears twice");
    m.entries.push_back(std::move(e));
  }
  return m;
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

Status remove_tree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return Status::from_errno(ec.value(), "removing " + path);
  return {};
}

}  // namespace

// ---------------------------------------------------------------- names

const char* ck_dtype_name(CkDType t) {
  switch (t) {
    case CkDType::kU8:
      return "u8";
    case CkDType::kFp32:
      return "fp32";
    case CkDType::kBf16:
      return "bf16";
    case CkDType::kFp16:
      return "fp16";
    case CkDType::kFp64:
      return "fp64";
    case CkDType::kI32:
      return "i32";
    case CkDType::kI64:
      return "i64";
  }
  return "?";
}

uint64_t ck_dtype_size(CkDType t) {
  switch (t) {
    case CkDType::kU8:
      return 1;
    case CkDType::kBf16:
    case CkDType::kFp16:
      return 2;
    case CkDType::kFp32:
    case CkDType::kI32:
      return 4;
    case CkDType::kFp64:
    case CkDType::kI64:
      return 8;
  }
  return 1;
}

CkDType ck_dtype_from(DType t) {
  switch (t) {
    case DType::kF32:
      return CkDType::kFp32;
    case DType::kBF16:
      return CkDType::kBf16;
    case DType::kF16:
      return CkDType::kFp16;
  }
  return CkDType::kU8;
}

const char* copy_method_name(CopyMethod m) {
  switch (m) {
    case CopyMethod::kAuto:
      return "auto";
    case CopyMethod::kReflink:
      return "reflink";
    case CopyMethod::kCopyFileRange:
      return "copy_file_range";
    case CopyMethod::kReadWrite:
      return "read/write";
  }
  return "?";
}

// ---------------------------------------------------------------- file-to-file copy

Result<uint32_t> copy_file_ranges(std::span<const FileRange> src, std::span<const FileRange> dst, CopyMethod method,
                                  std::span<uint8_t> buffer, CopyStats* stats) {
  if (buffer.size() < 4096) return Status(StatusCode::kInvalidArgument, "copy buffer under 4096 bytes");
  uint64_t src_total = 0, dst_total = 0;
  for (const auto* side : {&src, &dst}) {
    uint64_t& total = side == &src ? src_total : dst_total;
    for (const auto& r : *side) {
      if (r.length > kMaxEntryBytes || total + r.length > kMaxEntryBytes) {
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
  uint32_t crc = 0;
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
        STRATA_RETURN_IF_ERROR(crc_of_range(d, doff, piece, buffer, dname, &crc));
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
        STRATA_RETURN_IF_ERROR(crc_of_range(d, doff, static_cast<uint64_t>(r), buffer, dname, &crc));
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
    crc = crc32c_extend(crc, buffer.data(), n);
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
  return crc;
}

// ---------------------------------------------------------------- writer

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
    for (const auto& f : files_) ::unlink(join(staging_, f).c_str());
  }
  files_.clear();
}

Status CheckpointWriter::fail(Status st) {
  failed_ = true;
  cleanup();
  return st;
}

Status CheckpointWriter::add_entry_file(std::string_view name, CkDType dtype, uint64_t count, uint64_t bytes,
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
  const uint64_t esize = ck_dtype_size(dtype);
  if (count > kMaxEntryBytes / esize || count * esize != bytes) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("checkpoint {}: entry \"{}\": {} elements of {} are not {} bytes", dir_, name, count,
                              ck_dtype_name(dtype), bytes));
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
  const std::string path = join(staging_, candidate);
  int f = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (f < 0) return fail(Status::from_errno(errno, "checkpoint " + dir_ + ": creating " + path));
  files_.push_back(candidate);
  *file = candidate;
  *fd = f;
  return {};
}

Status CheckpointWriter::add_buffer(std::string_view name, CkDType dtype, uint64_t count, const void* data,
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
    Status st = pwrite_full(fd, p + off, n, off, join(staging_, file));
    if (!st.ok()) return fail(st.with_context("checkpoint " + dir_ + ": entry \"" + std::string(name) + "\""));
    off += n;
  }
  entries_.push_back({std::string(name), file, dtype, count, bytes, crc});
  stats_.buffer_bytes += bytes;
  return {};
}

Status CheckpointWriter::add_file_ranges(std::string_view name, CkDType dtype, uint64_t count,
                                         std::span<const FileRange> ranges) {
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
  if (buffer_.empty()) buffer_.resize(options_.buffer_bytes);
  FileRange dst;
  dst.path = join(staging_, file);
  dst.fd = fd;
  dst.length = total;
  auto crc = copy_file_ranges(ranges, std::span<const FileRange>(&dst, 1), options_.copy_method, buffer_, &stats_);
  if (!crc.ok()) return fail(crc.status().with_context("checkpoint " + dir_ + ": entry \"" + std::string(name) + "\""));
  entries_.push_back({std::string(name), file, dtype, count, total, *crc});
  return {};
}

Status CheckpointWriter::finish_shard() {
  if (failed_) return Status(StatusCode::kInvalidArgument, "checkpoint " + dir_ + ": writer failed earlier");
  if (finished_) return {};
  const std::string prefix = "checkpoint " + dir_;
  ordered_json extra_bytes = nullptr;
  if (!info_.extra_bytes.empty()) {
    const std::string file = fmt::format("extra.rank{}.bin", options_.rank);
    const std::string path = join(staging_, file);
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return fail(Status::from_errno(errno, prefix + ": creating " + path));
    files_.push_back(file);
    Fd guard(fd, true);
    Status st = pwrite_full(fd, info_.extra_bytes.data(), info_.extra_bytes.size(), 0, path);
    if (!st.ok()) return fail(st.with_context(prefix));
    extra_bytes = {{"file", file},
                   {"bytes", info_.extra_bytes.size()},
                   {"crc32c", hex32(crc32c(info_.extra_bytes.data(), info_.extra_bytes.size()))}};
  }
  // Data files were written without fsync so their writeback could overlap;
  // one pass now makes them durable before the manifest that names them.
  for (const auto& f : files_) {
    Status st = fsync_path(join(staging_, f), false, /*drop_cache=*/true);
    if (!st.ok()) return fail(st.with_context(prefix));
  }
  ordered_json doc;
  doc["format"] = "strata-checkpoint-manifest";
  doc["format_version"] = kCheckpointFormatVersion;
  doc["rank"] = options_.rank;
  doc["world_size"] = options_.world_size;
  doc["step"] = info_.step;
  doc["loss_scale"] = info_.loss_scale;
  doc["extra_json"] = info_.extra_json.empty() ? ordered_json(nullptr) : ordered_json::parse(info_.extra_json);
  doc["extra_bytes"] = extra_bytes;
  ordered_json list = ordered_json::array();
  for (const auto& e : entries_) {
    list.push_back({{"name", e.name},
                    {"file", e.file},
                    {"dtype", ck_dtype_name(e.dtype)},
                    {"count", e.count},
                    {"bytes", e.bytes},
                    {"crc32c", hex32(e.crc32c)}});
  }
  doc["entries"] = std::move(list);
  const std::string file = fmt::format("manifest.rank{}.json", options_.rank);
  Status st = write_new_file(join(staging_, file), with_self_crc(doc, nullptr));
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
  ordered_json shards = ordered_json::array();
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
    shards.push_back(
        {{"rank", r}, {"manifest", fmt::format("manifest.rank{}.json", r)}, {"manifest_crc32c", hex32(m->self_crc)}});
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
    struct stat ist {};
    const bool has_index = ::stat(join(dir_, "index.json").c_str(), &ist) == 0;
    bool empty = true;
    if (!has_index) {
      if (DIR* d = ::opendir(dir_.c_str())) {
        while (dirent* e = ::readdir(d)) {
          if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) empty = false;
        }
        ::closedir(d);
      }
    }
    if (!has_index && !empty) {
      return fail(Status(StatusCode::kAlreadyExists,
                         prefix + ": exists and is not a Strata checkpoint (no index.json); refusing to replace it"));
    }
    target_exists = true;
  }

  ordered_json index;
  index["format"] = "strata-checkpoint";
  index["format_version"] = kCheckpointFormatVersion;
  index["step"] = info_.step;
  index["loss_scale"] = info_.loss_scale;
  index["world_size"] = options_.world_size;
  index["shards"] = std::move(shards);
  Status s = write_new_file(join(staging_, "index.json"), with_self_crc(index, nullptr));
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

Status cleanup_checkpoint_leftovers(const std::string& dir_in) {
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const std::string parent = parent_of(dir), base = base_of(dir);
  const std::string tmp_prefix = base + ".tmp-", old_prefix = base + ".old-";
  std::vector<std::string> tmps, olds;
  DIR* d = ::opendir(parent.c_str());
  if (!d) return Status::from_errno(errno, "listing " + parent);
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n.rfind(tmp_prefix, 0) == 0) tmps.push_back(join(parent, n));
    if (n.rfind(old_prefix, 0) == 0) olds.push_back(join(parent, n));
  }
  ::closedir(d);
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0 && errno == ENOENT) {
    for (auto it = olds.begin(); it != olds.end(); ++it) {
      struct stat ist {};
      if (::stat(join(*it, "index.json").c_str(), &ist) != 0) continue;
      if (::rename(it->c_str(), dir.c_str()) != 0)
        return Status::from_errno(errno, "renaming " + *it + " back to " + dir);
      log_warn("checkpoint {}: restored the previous checkpoint from {} (a save was interrupted)", dir, *it);
      olds.erase(it);
      STRATA_RETURN_IF_ERROR(fsync_path(parent, true));
      break;
    }
  }
  Status first;
  for (const auto& p : tmps) {
    Status s = remove_tree(p);
    if (!s.ok() && first.ok()) first = s;
  }
  for (const auto& p : olds) {
    Status s = remove_tree(p);
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

// ---------------------------------------------------------------- reader

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

  STRATA_ASSIGN_OR_RETURN(json index, load_checked_json(dir, "index.json", "strata-checkpoint", prefix, nullptr));
  const std::string where = prefix + ": index.json";
  ObjReader r(index, where);
  STRATA_RETURN_IF_ERROR(
      r.check_keys({"format", "format_version", "self_crc32c", "step", "loss_scale", "world_size", "shards"}));
  STRATA_ASSIGN_OR_RETURN(uint64_t ws, r.u64("world_size", kMaxWorldSize));
  if (ws == 0) return r.corrupt("world_size", "is 0");
  STRATA_ASSIGN_OR_RETURN(uint64_t step, r.u64("step", std::numeric_limits<uint64_t>::max()));
  STRATA_ASSIGN_OR_RETURN(double loss_scale, r.positive_double("loss_scale"));
  STRATA_ASSIGN_OR_RETURN(const json* shards, r.get("shards"));
  if (!shards->is_array() || shards->size() != ws) {
    return r.corrupt("shards", fmt::format("expected an array of world_size ({}) shards", ws));
  }
  if (options.rank >= ws) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: rank {} asked for, but the checkpoint has world_size {}", prefix, options.rank, ws));
  }
  const json& shard = (*shards)[options.rank];
  if (!shard.is_object()) return r.corrupt("shards", "entries must be objects");
  ObjReader sr(shard, fmt::format("{}: shards[{}]", where, options.rank));
  STRATA_RETURN_IF_ERROR(sr.check_keys({"rank", "manifest", "manifest_crc32c"}));
  STRATA_ASSIGN_OR_RETURN(uint64_t srank, sr.u64("rank", kMaxWorldSize));
  STRATA_ASSIGN_OR_RETURN(std::string mfile, sr.str("manifest"));
  STRATA_ASSIGN_OR_RETURN(uint32_t mcrc, sr.crc("manifest_crc32c"));
  if (srank != options.rank || mfile != fmt::format("manifest.rank{}.json", options.rank)) {
    return sr.corrupt("", fmt::format("names rank {} / {}", srank, mfile));
  }

  STRATA_ASSIGN_OR_RETURN(ParsedManifest m, parse_manifest(dir, options.rank, prefix));
  if (m.self_crc != mcrc) {
    return Status(StatusCode::kCorrupt,
                  fmt::format("{}: {}: checksum {}, index.json says {} (from another checkpoint?)", prefix, mfile,
                              hex32(m.self_crc), hex32(mcrc)));
  }
  if (m.info.world_size != ws || m.info.step != step || m.info.loss_scale != loss_scale) {
    return Status(StatusCode::kCorrupt,
                  fmt::format("{}: {} says world_size {}, step {}, loss scale {}; index.json says {}, {}, {}", prefix,
                              mfile, m.info.world_size, m.info.step, m.info.loss_scale, ws, step, loss_scale));
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
    const std::string path = join(dir, rd->extra_entry_.file);
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
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
  const std::string path = join(dir, e.file);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
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
  return Status(StatusCode::kCorrupt, fmt::format("{}: checksum {}, manifest says {}", prefix, hex32(got), hex32(want)));
}

}  // namespace

Status CheckpointReader::check_entry_file(const CheckpointEntry& e, bool checksum) {
  const std::string prefix = "checkpoint " + dir_ + ": " + e.file;
  STRATA_ASSIGN_OR_RETURN(Fd fd, open_entry_file(dir_, e, prefix));
  if (!checksum) return {};
  if (buffer_.empty()) buffer_.resize(options_.buffer_bytes);
  uint32_t crc = 0;
  STRATA_RETURN_IF_ERROR(crc_of_range(fd.get(), 0, e.bytes, buffer_, join(dir_, e.file), &crc));
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
  const std::string path = join(dir_, e->file);
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

Status CheckpointReader::read_to_file_ranges(std::string_view name, std::span<const FileRange> ranges) {
  const CheckpointEntry* e = find(name);
  if (!e) {
    return Status(StatusCode::kNotFound,
                  fmt::format("checkpoint {}: no entry \"{}\" for rank {}", dir_, name, info_.rank));
  }
  const std::string prefix = "checkpoint " + dir_ + ": " + e->file;
  STRATA_RETURN_IF_ERROR(check_entry_file(*e, false));
  if (buffer_.empty()) buffer_.resize(options_.buffer_bytes);
  FileRange src;
  src.path = join(dir_, e->file);
  src.length = e->bytes;
  auto crc = copy_file_ranges(std::span<const FileRange>(&src, 1), ranges, options_.copy_method, buffer_, &stats_);
  if (!crc.ok()) return crc.status().with_context(prefix);
  if (*crc != e->crc32c) return checksum_mismatch(prefix, *crc, e->crc32c);
  return {};
}

}  // namespace strata
