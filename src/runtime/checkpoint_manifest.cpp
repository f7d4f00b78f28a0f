#include "runtime/checkpoint_manifest.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "common/json.h"
#include "common/posix_file.h"
#include "common/crc32c.h"

namespace strata {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

namespace {

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

}  // namespace

// A manifest carries the CRC32C of its own canonical form: the compact dump of
// the object without "self_crc32c", keys sorted (nlohmann::json's std::map
// order). Parsing and re-dumping is stable (integers exact, doubles shortest
// round-trip), so the file itself can stay pretty-printed and readable.
uint32_t canonical_crc(const json& without_self) {
  const std::string text = without_self.dump();
  return crc32c(text.data(), text.size());
}

namespace {

std::string with_self_crc(const ordered_json& doc) {
  json sorted = json::parse(doc.dump());
  const uint32_t crc = canonical_crc(sorted);
  ordered_json out = doc;
  out["self_crc32c"] = hex32(crc);
  return out.dump(2) + "\n";
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
  const std::string path = join_path(dir, file);
  // O_NONBLOCK: a FIFO in place of the file is refused below, not waited on.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
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
  if (!S_ISREG(st.st_mode)) return Status(StatusCode::kCorrupt, prefix + ": " + file + " is not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == 0) return Status(StatusCode::kCorrupt, prefix + ": " + file + ": empty file");
  if (size > kMaxJsonBytes) {
    return Status(StatusCode::kCorrupt,
                  fmt::format("{}: {}: {} bytes, more than a manifest can be ({})", prefix, file, size, kMaxJsonBytes));
  }
  std::string text(size, '\0');
  STRATA_RETURN_IF_ERROR(pread_full(fd, text.data(), size, 0, path).with_context(prefix));
  json doc;
  JsonError jerr;
  if (!parse_json(text, &doc, &jerr)) {
    if (jerr.kind == JsonError::kSyntax)
      return Status(StatusCode::kCorrupt, fmt::format("{}: {}: not valid JSON at byte {} of {} (truncated or damaged)",
                                                      prefix, file, jerr.byte, size));
    return Status(StatusCode::kCorrupt, fmt::format("{}: {}: {}", prefix, file, jerr.message()));
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

// Exact names only (dtype_name's), unlike parse_dtype() for command lines:
// a manifest is machine-written, and every kind a checkpoint stores is valid.
Result<DType> parse_entry_dtype(const std::string& s) {
  for (DType t : {DType::kU8, DType::kF32, DType::kBF16, DType::kF16, DType::kF64, DType::kI32, DType::kI64}) {
    if (s == dtype_name(t)) return t;
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
  auto dtype = parse_entry_dtype(dt);
  if (!dtype.ok()) return r.corrupt("dtype", dtype.status().message());
  out.dtype = *dtype;
  STRATA_ASSIGN_OR_RETURN(out.count, r.u64("count", kMaxEntryBytes));
  STRATA_ASSIGN_OR_RETURN(out.bytes, r.u64("bytes", kMaxEntryBytes));
  if (out.count * dtype_size(out.dtype) != out.bytes) {
    return r.corrupt("bytes", fmt::format("{} elements of {} are {} bytes, not {}", out.count, dt,
                                          out.count * dtype_size(out.dtype), out.bytes));
  }
  STRATA_ASSIGN_OR_RETURN(out.crc32c, r.crc("crc32c"));
  return out;
}

}  // namespace

std::string hex32(uint32_t v) {
  return fmt::format("0x{:08x}", v);
}

std::string manifest_file_name(uint32_t rank) {
  return fmt::format("manifest.rank{}.json", rank);
}

// ---------------------------------------------------------------- writing

std::string manifest_text(const CheckpointInfo& info, const CheckpointEntry* extra,
                          std::span<const CheckpointEntry> entries) {
  ordered_json extra_bytes = nullptr;
  if (extra) extra_bytes = {{"file", extra->file}, {"bytes", extra->bytes}, {"crc32c", hex32(extra->crc32c)}};
  ordered_json doc;
  doc["format"] = "strata-checkpoint-manifest";
  doc["format_version"] = kCheckpointFormatVersion;
  doc["rank"] = info.rank;
  doc["world_size"] = info.world_size;
  doc["step"] = info.step;
  doc["loss_scale"] = info.loss_scale;
  doc["extra_json"] = info.extra_json.empty() ? ordered_json(nullptr) : ordered_json::parse(info.extra_json);
  doc["extra_bytes"] = extra_bytes;
  ordered_json list = ordered_json::array();
  for (const auto& e : entries) {
    list.push_back({{"name", e.name},
                    {"file", e.file},
                    {"dtype", dtype_name(e.dtype)},
                    {"count", e.count},
                    {"bytes", e.bytes},
                    {"crc32c", hex32(e.crc32c)}});
  }
  doc["entries"] = std::move(list);
  return with_self_crc(doc);
}

std::string index_text(uint64_t step, double loss_scale, uint32_t world_size, std::span<const uint32_t> manifest_crcs) {
  ordered_json shards = ordered_json::array();
  for (uint32_t r = 0; r < manifest_crcs.size(); ++r) {
    shards.push_back({{"rank", r}, {"manifest", manifest_file_name(r)}, {"manifest_crc32c", hex32(manifest_crcs[r])}});
  }
  ordered_json index;
  index["format"] = "strata-checkpoint";
  index["format_version"] = kCheckpointFormatVersion;
  index["step"] = step;
  index["loss_scale"] = loss_scale;
  index["world_size"] = world_size;
  index["shards"] = std::move(shards);
  return with_self_crc(index);
}

// ---------------------------------------------------------------- parsing

Result<ParsedManifest> parse_manifest(const std::string& dir, uint32_t rank, const std::string& prefix) {
  const std::string file = manifest_file_name(rank);
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
    m.extra.dtype = DType::kU8;
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

Result<ParsedIndex> parse_index(const std::string& dir, uint32_t rank, const std::string& prefix) {
  STRATA_ASSIGN_OR_RETURN(json index, load_checked_json(dir, "index.json", "strata-checkpoint", prefix, nullptr));
  const std::string where = prefix + ": index.json";
  ObjReader r(index, where);
  STRATA_RETURN_IF_ERROR(
      r.check_keys({"format", "format_version", "self_crc32c", "step", "loss_scale", "world_size", "shards"}));
  ParsedIndex out;
  STRATA_ASSIGN_OR_RETURN(out.world_size, r.u64("world_size", kMaxWorldSize));
  const uint64_t ws = out.world_size;
  if (ws == 0) return r.corrupt("world_size", "is 0");
  STRATA_ASSIGN_OR_RETURN(out.step, r.u64("step", std::numeric_limits<uint64_t>::max()));
  STRATA_ASSIGN_OR_RETURN(out.loss_scale, r.positive_double("loss_scale"));
  STRATA_ASSIGN_OR_RETURN(const json* shards, r.get("shards"));
  if (!shards->is_array() || shards->size() != ws) {
    return r.corrupt("shards", fmt::format("expected an array of world_size ({}) shards", ws));
  }
  if (rank >= ws) {
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: rank {} asked for, but the checkpoint has world_size {}", prefix, rank, ws));
  }
  const json& shard = (*shards)[rank];
  if (!shard.is_object()) return r.corrupt("shards", "entries must be objects");
  ObjReader sr(shard, fmt::format("{}: shards[{}]", where, rank));
  STRATA_RETURN_IF_ERROR(sr.check_keys({"rank", "manifest", "manifest_crc32c"}));
  STRATA_ASSIGN_OR_RETURN(uint64_t srank, sr.u64("rank", kMaxWorldSize));
  STRATA_ASSIGN_OR_RETURN(out.manifest, sr.str("manifest"));
  STRATA_ASSIGN_OR_RETURN(out.manifest_crc, sr.crc("manifest_crc32c"));
  if (srank != rank || out.manifest != manifest_file_name(rank)) {
    return sr.corrupt("", fmt::format("names rank {} / {}", srank, out.manifest));
  }
  return out;
}

}  // namespace strata
