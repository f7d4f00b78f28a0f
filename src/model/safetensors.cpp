#include "model/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "common/enum_names.h"
#include "common/float_convert.h"
#include "common/json.h"
#include "common/log.h"
#include "common/posix_file.h"
#include "io/io_engine.h"

// The file format's spellings of its dtypes.
namespace strata {
template <>
inline constexpr auto kEnumNames<model::StDType> = std::to_array<EnumName<model::StDType>>({
    {model::StDType::kBOOL, "BOOL"},
    {model::StDType::kU8, "U8"},
    {model::StDType::kI8, "I8"},
    {model::StDType::kI16, "I16"},
    {model::StDType::kU16, "U16"},
    {model::StDType::kF16, "F16"},
    {model::StDType::kBF16, "BF16"},
    {model::StDType::kI32, "I32"},
    {model::StDType::kU32, "U32"},
    {model::StDType::kF32, "F32"},
    {model::StDType::kF64, "F64"},
    {model::StDType::kI64, "I64"},
    {model::StDType::kU64, "U64"},
    {model::StDType::kF8_E4M3, "F8_E4M3"},
    {model::StDType::kF8_E5M2, "F8_E5M2"},
});
}  // namespace strata

namespace strata::model {
namespace {

using json = nlohmann::json;

struct DTypeSize {
  StDType d;
  size_t size;
};
constexpr DTypeSize kDTypeSizes[] = {
    {StDType::kBOOL, 1}, {StDType::kU8, 1},  {StDType::kI8, 1},  {StDType::kI16, 2},     {StDType::kU16, 2},
    {StDType::kF16, 2},  {StDType::kBF16, 2}, {StDType::kI32, 4}, {StDType::kU32, 4},     {StDType::kF32, 4},
    {StDType::kF64, 8},  {StDType::kI64, 8},  {StDType::kU64, 8}, {StDType::kF8_E4M3, 1}, {StDType::kF8_E5M2, 1},
};

bool mul_overflows(uint64_t a, uint64_t b, uint64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}

// Elements of a shape, or false on overflow.
bool shape_numel(const std::vector<uint64_t>& shape, uint64_t* out) {
  uint64_t n = 1;
  for (uint64_t d : shape)
    if (mul_overflows(n, d, &n)) return false;
  *out = n;
  return true;
}

// `what` may quote a tensor name or value from the file: clipped, so a name of
// megabytes is not echoed whole.
Status corrupt(const std::string& path, const std::string& what) {
  return Status(StatusCode::kCorrupt, fmt::format("{}: {}", path, clip_for_message(what, 1000)));
}

Status pread_full(int fd, void* buf, uint64_t len, uint64_t off, const std::string& path) {
  auto* p = static_cast<char*>(buf);
  while (len > 0) {
    ssize_t n = ::pread(fd, p, len, static_cast<off_t>(off));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::from_errno(errno, fmt::format("read of {} bytes at offset {} in {} failed", len, off, path));
    }
    if (n == 0)
      return corrupt(path, fmt::format("file ends at offset {} inside the header ({} more bytes expected)", off, len));
    p += n;
    off += static_cast<uint64_t>(n);
    len -= static_cast<uint64_t>(n);
  }
  return Status::ok_status();
}

Status write_full(int fd, const void* buf, uint64_t len, const std::string& path) {
  const auto* p = static_cast<const char*>(buf);
  while (len > 0) {
    ssize_t n = ::write(fd, p, len);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::from_errno(errno, fmt::format("write of {} bytes to {} failed", len, path));
    }
    p += n;
    len -= static_cast<uint64_t>(n);
  }
  return Status::ok_status();
}

Status fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::from_errno(errno, "open of directory " + dir + " failed");
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  // Some file systems refuse fsync on directories; the rename is still done.
  if (rc != 0 && err != EINVAL && err != EROFS) return Status::from_errno(err, "fsync of directory " + dir + " failed");
  return Status::ok_status();
}

std::string tmp_name(const std::string& path) {
  return fmt::format("{}.tmp.{}", path, ::getpid());
}

// Float element conversion, element by element (bounded chunks; not a hot path
// compared with the read itself).
float load_as_f32(StDType d, const unsigned char* p, uint64_t i) {
  switch (d) {
    case StDType::kF32: {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      return f;
    }
    case StDType::kBF16: {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return bf16_bits_to_f32(h);
    }
    case StDType::kF16: {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return f16_bits_to_f32(h);
    }
    case StDType::kF64: {
      double v;
      std::memcpy(&v, p + 8 * i, 8);
      return static_cast<float>(v);
    }
    default:
      return 0.0f;
  }
}

void store_from_f32(DType d, void* out, uint64_t i, float f) {
  switch (d) {
    case DType::kF32:
      std::memcpy(static_cast<char*>(out) + 4 * i, &f, 4);
      break;
    case DType::kBF16: {
      uint16_t h = f32_to_bf16_bits(f);
      std::memcpy(static_cast<char*>(out) + 2 * i, &h, 2);
      break;
    }
    case DType::kF16: {
      uint16_t h = f32_to_f16_bits(f);
      std::memcpy(static_cast<char*>(out) + 2 * i, &h, 2);
      break;
    }
    case DType::kU8:
    case DType::kF64:
    case DType::kI32:
    case DType::kI64:
      break;  // storage-only kinds: read() and write_from() refuse them first
  }
}

bool is_float_st(StDType d) {
  return d == StDType::kF32 || d == StDType::kBF16 || d == StDType::kF16 || d == StDType::kF64;
}

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};

}  // namespace

// ------------------------------------------------------------------ dtypes

size_t st_dtype_size(StDType d) {
  for (const auto& r : kDTypeSizes)
    if (r.d == d) return r.size;
  return 0;
}

const char* st_dtype_name(StDType d) { return enum_name(d); }

Result<StDType> parse_st_dtype(std::string_view name) {
  if (std::optional<StDType> d = find_enum<StDType>(name)) return *d;
  return Status(StatusCode::kInvalidArgument, fmt::format("unknown safetensors dtype \"{}\"", name));
}

std::optional<DType> to_dtype(StDType d) {
  switch (d) {
    case StDType::kF32:
      return DType::kF32;
    case StDType::kBF16:
      return DType::kBF16;
    case StDType::kF16:
      return DType::kF16;
    default:
      return std::nullopt;
  }
}

StDType from_dtype(DType d) {
  switch (d) {
    case DType::kF32:
      return StDType::kF32;
    case DType::kBF16:
      return StDType::kBF16;
    case DType::kF16:
      return StDType::kF16;
    case DType::kU8:
      return StDType::kU8;
    case DType::kF64:
      return StDType::kF64;
    case DType::kI32:
      return StDType::kI32;
    case DType::kI64:
      return StDType::kI64;
  }
  return StDType::kF32;
}

uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

uint64_t TensorDecl::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

const TensorInfo* SafetensorsHeader::find(std::string_view name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

// ------------------------------------------------------------------ header

Result<SafetensorsHeader> parse_safetensors_header(std::string_view text, uint64_t file_size, const std::string& path) {
  const uint64_t n = text.size();
  if (n > kMaxSafetensorsHeader)
    return corrupt(path, fmt::format("header length {} exceeds the limit of {} bytes", n, kMaxSafetensorsHeader));
  if (file_size < 8 || n > file_size - 8)
    return corrupt(path, fmt::format("header of {} bytes does not fit in a file of {} bytes", n, file_size));
  if (n == 0 || text[0] != '{')
    return corrupt(path, "header does not start with '{' (not a safetensors file, or a corrupt header length)");

  // Duplicate names (nlohmann would keep the last silently) and absurd
  // nesting are refused by parse_json.
  json root;
  JsonError jerr;
  if (!parse_json(text, &root, &jerr)) {
    switch (jerr.kind) {
      case JsonError::kSyntax:
        return corrupt(path, fmt::format("malformed header JSON at header byte {} (file offset {}): {}", jerr.byte,
                                         jerr.byte + 7, jerr.what));
      case JsonError::kDuplicateKey:
        if (jerr.path == jerr.key)
          return corrupt(path, fmt::format("tensor \"{}\" is listed twice in the header", jerr.key));
        [[fallthrough]];
      default:
        return corrupt(path, "header " + jerr.message());
    }
  }
  if (!root.is_object()) return corrupt(path, "header is not a JSON object");

  SafetensorsHeader h;
  h.path = path;
  h.header_len = n;
  h.data_offset = 8 + n;
  h.file_size = file_size;
  const uint64_t data_len = file_size - h.data_offset;

  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (v.is_null()) continue;
      if (!v.is_object()) return corrupt(path, "__metadata__ is not an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) return corrupt(path, fmt::format("__metadata__.{} is not a string", m.key()));
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& why) { return corrupt(path, fmt::format("tensor \"{}\": {}", name, why)); };
    if (!v.is_object()) return bad("entry is not an object");
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto of = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) return bad("missing or non-string \"dtype\"");
    if (sh == v.end() || !sh->is_array()) return bad("missing or non-array \"shape\"");
    if (of == v.end() || !of->is_array() || of->size() != 2) return bad("\"data_offsets\" is not [begin, end]");
    TensorInfo t;
    t.name = name;
    auto d = parse_st_dtype(dt->get<std::string>());
    if (!d.ok()) return bad(d.status().message());
    t.dtype = *d;
    for (const auto& x : *sh) {
      if (!x.is_number_unsigned()) return bad("shape holds something other than a non-negative integer");
      t.shape.push_back(x.get<uint64_t>());
    }
    if (!(*of)[0].is_number_unsigned() || !(*of)[1].is_number_unsigned())
      return bad("data_offsets are not non-negative integers");
    const uint64_t begin = (*of)[0].get<uint64_t>();
    const uint64_t end = (*of)[1].get<uint64_t>();
    if (end < begin) return bad(fmt::format("data_offsets [{}, {}] end before they begin", begin, end));
    uint64_t numel = 0, bytes = 0;
    if (!shape_numel(t.shape, &numel) || mul_overflows(numel, st_dtype_size(t.dtype), &bytes))
      return bad("shape's size overflows 64 bits");
    if (bytes != end - begin)
      return bad(fmt::format("shape {} of {} needs {} bytes but data_offsets [{}, {}] hold {}", fmt::join(t.shape, "x"),
                             st_dtype_name(t.dtype), bytes, begin, end, end - begin));
    if (end > data_len)
      return bad(
          fmt::format("data_offsets [{}, {}] (file offsets [{}, {}]) run past the end of the data region "
                      "({} bytes; file is {} bytes, truncated?)",
                      begin, end, h.data_offset + begin, h.data_offset + end, data_len, file_size));
    t.file = path;
    t.offset = h.data_offset + begin;
    t.nbytes = bytes;
    h.tensors.push_back(std::move(t));
  }

  std::stable_sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.nbytes < b.nbytes;
  });
  // The tensors must tile the data region exactly, as the reference
  // implementation requires.
  uint64_t at = h.data_offset;
  const TensorInfo* prev = nullptr;
  for (const auto& t : h.tensors) {
    if (t.offset > at)
      return corrupt(path, fmt::format("hole of {} bytes at file offsets [{}, {}) before tensor \"{}\"", t.offset - at,
                                       at, t.offset, t.name));
    if (t.offset < at)
      return corrupt(path, fmt::format("tensor \"{}\" at file offsets [{}, {}) overlaps tensor \"{}\" (ends at {})",
                                       t.name, t.offset, t.offset + t.nbytes, prev ? prev->name : "?", at));
    at = t.offset + t.nbytes;
    prev = &t;
  }
  if (at != file_size)
    return corrupt(path, fmt::format("data region ends at file offset {} but the file has {} bytes ({} trailing "
                                     "bytes no tensor covers)",
                                     at, file_size, file_size - at));
  return h;
}

namespace {
// The 8-byte length field against the file size: the checks both the file
// and the in-memory paths make before looking at the JSON.
Result<uint64_t> header_length(const unsigned char* len_bytes, uint64_t size, const std::string& path) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  if (n > kMaxSafetensorsHeader)
    return corrupt(path, fmt::format("header length {} exceeds the limit of {} bytes", n, kMaxSafetensorsHeader));
  if (n > size - 8)
    return corrupt(path, fmt::format("header length {} runs past the end of the file ({} bytes; truncated?)", n, size));
  return n;
}
}  // namespace

Result<SafetensorsHeader> parse_safetensors_file_bytes(std::string_view bytes, const std::string& path) {
  const uint64_t size = bytes.size();
  if (size < 8) return corrupt(path, fmt::format("file has {} bytes, less than the 8-byte header length", size));
  STRATA_ASSIGN_OR_RETURN(uint64_t n, header_length(reinterpret_cast<const unsigned char*>(bytes.data()), size, path));
  return parse_safetensors_header(bytes.substr(8, n), size, path);
}

Result<SafetensorsHeader> read_safetensors_header(const std::string& path) {
  // O_NONBLOCK: a FIFO in place of the file is refused below, not waited on.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return Status::from_errno(errno, "open of " + path + " failed");
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Status::from_errno(errno, "stat of " + path + " failed");
  if (!S_ISREG(st.st_mode)) return Status(StatusCode::kInvalidArgument, path + " is not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) return corrupt(path, fmt::format("file has {} bytes, less than the 8-byte header length", size));
  unsigned char len_bytes[8];
  STRATA_RETURN_IF_ERROR(pread_full(fd, len_bytes, 8, 0, path));
  STRATA_ASSIGN_OR_RETURN(uint64_t n, header_length(len_bytes, size, path));
  std::string text(n, '\0');
  STRATA_RETURN_IF_ERROR(pread_full(fd, text.data(), n, 8, path));
  return parse_safetensors_header(text, size, path);
}

// ------------------------------------------------------------------ reader

Result<std::unique_ptr<TensorReader>> TensorReader::create(io::IoEngine* engine) {
  std::unique_ptr<TensorReader> r(new TensorReader());
  if (engine == nullptr) {
    STRATA_ASSIGN_OR_RETURN(r->owned_engine_, io::make_io_engine({}));
    r->engine_ = r->owned_engine_.get();
  } else {
    r->engine_ = engine;
  }
  return r;
}

TensorReader::~TensorReader() {
  // Files must close before an owned engine stops.
  files_.clear();
}

Result<io::IoFile*> TensorReader::file_for(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = files_.find(path);
  if (it != files_.end()) return it->second.get();
  io::IoOpenOptions o;
  o.direct = true;
  STRATA_ASSIGN_OR_RETURN(auto f, engine_->open(path, o));
  io::IoFile* p = f.get();
  files_.emplace(path, std::move(f));
  return p;
}

Status TensorReader::read_raw(const TensorInfo& t, uint64_t byte_begin, uint64_t bytes, void* out) {
  if (byte_begin > t.nbytes || bytes > t.nbytes - byte_begin)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("read of bytes [{}, {}) of tensor \"{}\" ({} bytes) is out of range", byte_begin,
                              byte_begin + bytes, t.name, t.nbytes));
  if (bytes == 0) return Status::ok_status();
  STRATA_ASSIGN_OR_RETURN(io::IoFile * f, file_for(t.file));
  io::IoHandle h = engine_->submit({io::IoOpKind::kRead, f, t.offset + byte_begin, bytes, out});
  Status st = h.wait();
  if (!st.ok()) return st.with_context(fmt::format("tensor \"{}\"", t.name));
  return st;
}

Status TensorReader::read(const TensorInfo& t, DType out_dtype, void* out, uint64_t elem_begin, uint64_t count) {
  if (!is_compute_dtype(out_dtype))
    return Status(StatusCode::kInvalidArgument, fmt::format("tensor \"{}\": read converts to fp32, bf16 or fp16, not {}",
                                                            t.name, dtype_name(out_dtype)));
  const uint64_t numel = t.numel();
  if (elem_begin > numel)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("tensor \"{}\": element {} is past its {} elements", t.name, elem_begin, numel));
  if (count == UINT64_MAX) count = numel - elem_begin;
  if (count > numel - elem_begin)
    return Status(StatusCode::kInvalidArgument, fmt::format("tensor \"{}\": elements [{}, {}) are past its {} elements",
                                                            t.name, elem_begin, elem_begin + count, numel));
  if (!is_float_st(t.dtype))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("tensor \"{}\" in {} has dtype {}, not a float type Strata can read", t.name, t.file,
                              st_dtype_name(t.dtype)));
  const uint64_t esz = st_dtype_size(t.dtype);
  if (to_dtype(t.dtype) == out_dtype) return read_raw(t, elem_begin * esz, count * esz, out);

  if (count == 0) return Status::ok_status();
  // Convert through two staging buffers: the next chunk is read while this
  // one is converted. Small tensors get small buffers.
  const uint64_t kStage = std::min<uint64_t>(4u << 20, (count * esz + 4095) / 4096 * 4096);
  const uint64_t chunk_elems = kStage / esz;
  std::unique_ptr<void, AlignedFree> bufs[2];
  for (auto& b : bufs) {
    b.reset(std::aligned_alloc(4096, kStage));
    if (!b) return Status(StatusCode::kOutOfMemory, "staging buffer for a tensor read");
  }
  STRATA_ASSIGN_OR_RETURN(io::IoFile * f, file_for(t.file));
  auto submit = [&](uint64_t i, int slot) {
    const uint64_t n = std::min(chunk_elems, count - i);
    return engine_->submit({io::IoOpKind::kRead, f, t.offset + (elem_begin + i) * esz, n * esz, bufs[slot].get()});
  };
  io::IoHandle pending[2];
  pending[0] = submit(0, 0);
  int slot = 0;
  for (uint64_t i = 0; i < count; i += chunk_elems, slot ^= 1) {
    const uint64_t n = std::min(chunk_elems, count - i);
    if (i + chunk_elems < count) pending[slot ^ 1] = submit(i + chunk_elems, slot ^ 1);
    Status st = pending[slot].wait();
    if (!st.ok()) {
      (void)pending[slot ^ 1].wait();  // never leave a read into a buffer we free
      return st.with_context(fmt::format("tensor \"{}\"", t.name));
    }
    const auto* src = static_cast<const unsigned char*>(bufs[slot].get());
    for (uint64_t k = 0; k < n; ++k) store_from_f32(out_dtype, out, i + k, load_as_f32(t.dtype, src, k));
  }
  return Status::ok_status();
}

// ------------------------------------------------------------------ writer

Status write_file_atomic(const std::string& path, std::string_view content) {
  const std::string tmp = tmp_name(path);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::from_errno(errno, "create of " + tmp + " failed");
  Status st = write_full(fd, content.data(), content.size(), tmp);
  if (st.ok() && ::fsync(fd) != 0) st = Status::from_errno(errno, "fsync of " + tmp + " failed");
  if (::close(fd) != 0 && st.ok()) st = Status::from_errno(errno, "close of " + tmp + " failed");
  if (st.ok() && ::rename(tmp.c_str(), path.c_str()) != 0)
    st = Status::from_errno(errno, "rename of " + tmp + " to " + path + " failed");
  if (!st.ok()) {
    ::unlink(tmp.c_str());
    return st;
  }
  return fsync_dir(parent_of(path));
}

Result<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::create(const std::string& path,
                                                                     std::vector<TensorDecl> tensors,
                                                                     std::map<std::string, std::string> metadata) {
  json root = json::object();
  if (!metadata.empty()) root["__metadata__"] = metadata;
  std::vector<uint64_t> ends;
  uint64_t at = 0;
  for (const auto& t : tensors) {
    if (t.name.empty()) return Status(StatusCode::kInvalidArgument, path + ": a tensor has an empty name");
    if (t.name == "__metadata__")
      return Status(StatusCode::kInvalidArgument, path + ": \"__metadata__\" cannot name a tensor");
    if (root.contains(t.name))
      return Status(StatusCode::kInvalidArgument, fmt::format("{}: tensor \"{}\" is declared twice", path, t.name));
    uint64_t numel = 0, bytes = 0, end = 0;
    if (!shape_numel(t.shape, &numel) || mul_overflows(numel, st_dtype_size(t.dtype), &bytes) ||
        __builtin_add_overflow(at, bytes, &end))
      return Status(StatusCode::kInvalidArgument, fmt::format("{}: tensor \"{}\" is too large", path, t.name));
    root[t.name] = {{"dtype", st_dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {at, end}}};
    ends.push_back(end);
    at = end;
  }
  std::string text = root.dump();
  // Pad with spaces so the data region starts 8-byte aligned (as the
  // reference writer does).
  text.append((8 - text.size() % 8) % 8, ' ');
  if (text.size() > kMaxSafetensorsHeader)
    return Status(StatusCode::kInvalidArgument, fmt::format("{}: header of {} bytes exceeds the {}-byte limit", path,
                                                            text.size(), kMaxSafetensorsHeader));

  std::unique_ptr<SafetensorsWriter> w(new SafetensorsWriter());
  w->path_ = path;
  w->tmp_path_ = tmp_name(path);
  w->tensors_ = std::move(tensors);
  w->ends_ = std::move(ends);
  w->fd_ = ::open(w->tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd_ < 0) return Status::from_errno(errno, "create of " + w->tmp_path_ + " failed");
  unsigned char len_bytes[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(n >> (8 * i));
  STRATA_RETURN_IF_ERROR(w->write_all(len_bytes, 8));
  STRATA_RETURN_IF_ERROR(w->write_all(text.data(), text.size()));
  return w;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_ && !tmp_path_.empty()) ::unlink(tmp_path_.c_str());
}

Status SafetensorsWriter::write_all(const void* data, uint64_t bytes) {
  return write_full(fd_, data, bytes, tmp_path_);
}

const TensorDecl* SafetensorsWriter::current() const {
  for (size_t i = 0; i < ends_.size(); ++i)
    if (written_ < ends_[i]) return &tensors_[i];
  return nullptr;
}

Status SafetensorsWriter::write(const void* data, uint64_t bytes) {
  if (finished_ || fd_ < 0) return Status(StatusCode::kInvalidArgument, path_ + ": write after finish");
  if (bytes > remaining())
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: write of {} bytes but only {} declared bytes remain", path_, bytes, remaining()));
  STRATA_RETURN_IF_ERROR(write_all(data, bytes));
  written_ += bytes;
  return Status::ok_status();
}

Status SafetensorsWriter::write_from(DType src_dtype, const void* src, uint64_t count) {
  if (!is_compute_dtype(src_dtype))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: write_from converts from fp32, bf16 or fp16, not {}", path_, dtype_name(src_dtype)));
  const TensorDecl* t = current();
  if (t == nullptr) return Status(StatusCode::kInvalidArgument, path_ + ": every declared tensor is already written");
  auto dst = to_dtype(t->dtype);
  if (!dst)
    return Status(StatusCode::kInvalidArgument, fmt::format("{}: tensor \"{}\" has dtype {}: write_from converts "
                                                            "to F32, BF16 or F16 only",
                                                            path_, t->name, st_dtype_name(t->dtype)));
  const size_t idx = static_cast<size_t>(t - tensors_.data());
  const uint64_t esz = st_dtype_size(t->dtype);
  const uint64_t left = (ends_[idx] - written_) / esz;
  if (count > left)
    return Status(
        StatusCode::kInvalidArgument,
        fmt::format("{}: {} elements would run past tensor \"{}\" ({} elements left)", path_, count, t->name, left));
  if (*dst == src_dtype) return write(src, count * esz);
  constexpr uint64_t kChunk = 1u << 16;
  std::vector<unsigned char> buf(kChunk * esz);
  const auto* s = static_cast<const unsigned char*>(src);
  const StDType sst = from_dtype(src_dtype);
  for (uint64_t i = 0; i < count; i += kChunk) {
    const uint64_t n = std::min(kChunk, count - i);
    for (uint64_t k = 0; k < n; ++k) store_from_f32(*dst, buf.data(), k, load_as_f32(sst, s, i + k));
    STRATA_RETURN_IF_ERROR(write(buf.data(), n * esz));
  }
  return Status::ok_status();
}

Status SafetensorsWriter::finish() {
  if (finished_) return Status::ok_status();
  if (fd_ < 0) return Status(StatusCode::kInvalidArgument, path_ + ": writer is not open");
  if (remaining() != 0) {
    const TensorDecl* t = current();
    return Status(StatusCode::kInvalidArgument, fmt::format("{}: {} declared bytes were never written (tensor \"{}\" "
                                                            "onwards)",
                                                            path_, remaining(), t ? t->name : "?"));
  }
  if (::fsync(fd_) != 0) return Status::from_errno(errno, "fsync of " + tmp_path_ + " failed");
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) return Status::from_errno(errno, "close of " + tmp_path_ + " failed");
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0)
    return Status::from_errno(errno, "rename of " + tmp_path_ + " to " + path_ + " failed");
  finished_ = true;
  return fsync_dir(parent_of(path_));
}

// ------------------------------------------------------------------ sharded

Result<SafetensorsIndex> read_safetensors_index(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return Status::from_errno(errno, "open of " + path + " failed");
  if (struct stat st {}; ::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status(StatusCode::kInvalidArgument, path + " is not a regular file");
  }
  std::string text;
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int err = errno;
      ::close(fd);
      return Status::from_errno(err, "read of " + path + " failed");
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > (256u << 20)) {
      ::close(fd);
      return corrupt(path, "index is larger than 256 MiB");
    }
  }
  ::close(fd);
  json root;
  JsonError jerr;
  if (!parse_json(text, &root, &jerr)) return corrupt(path, jerr.message());
  if (!root.is_object()) return corrupt(path, "not a JSON object");
  SafetensorsIndex idx;
  if (auto m = root.find("metadata"); m != root.end() && !m->is_null()) {
    if (!m->is_object()) return corrupt(path, "\"metadata\" is not an object");
    if (auto ts = m->find("total_size"); ts != m->end()) {
      if (!ts->is_number_unsigned()) return corrupt(path, "\"metadata.total_size\" is not a non-negative integer");
      idx.total_size = ts->get<uint64_t>();
    }
  }
  auto wm = root.find("weight_map");
  if (wm == root.end() || !wm->is_object()) return corrupt(path, "\"weight_map\" is missing or not an object");
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it.value().is_string()) return corrupt(path, fmt::format("\"weight_map.{}\" is not a file name", it.key()));
    std::string f = it.value().get<std::string>();
    if (f.empty() || f[0] == '/' || f.find("..") != std::string::npos)
      return corrupt(path,
                     fmt::format("\"weight_map.{}\" names \"{}\", which is not a file next to the index", it.key(), f));
    idx.weight_map[it.key()] = std::move(f);
  }
  return idx;
}

Status write_safetensors_index(const std::string& path, const SafetensorsIndex& index) {
  json root = {{"metadata", {{"total_size", index.total_size}}}, {"weight_map", index.weight_map}};
  return write_file_atomic(path, root.dump(2) + "\n");
}

Result<std::vector<TensorInfo>> read_model_tensors(const std::string& dir) {
  const std::string single = dir + "/model.safetensors";
  const std::string index_path = dir + "/model.safetensors.index.json";
  struct stat st {};
  if (::stat(single.c_str(), &st) == 0) {
    STRATA_ASSIGN_OR_RETURN(auto h, read_safetensors_header(single));
    return std::move(h.tensors);
  }
  if (::stat(index_path.c_str(), &st) != 0) {
    // PyTorch pickles (pytorch_model.bin, or its index) are never unpickled
    // here: say how to convert them rather than only what is missing.
    const bool pickle = ::stat((dir + "/pytorch_model.bin").c_str(), &st) == 0 ||
                        ::stat((dir + "/pytorch_model.bin.index.json").c_str(), &st) == 0;
    return Status(StatusCode::kNotFound,
                  fmt::format("{}: neither model.safetensors nor model.safetensors.index.json is there{}", dir,
                              pickle ? "; it holds pytorch_model.bin (a PyTorch pickle, which Strata never "
                                       "unpickles): convert it with transformers: AutoModelForCausalLM."
                                       "from_pretrained(DIR).save_pretrained(NEW_DIR) writes safetensors"
                                     : ""));
  }
  STRATA_ASSIGN_OR_RETURN(auto idx, read_safetensors_index(index_path));
  std::vector<std::string> files;  // in first-mention order of sorted names: deterministic
  std::set<std::string> seen;
  for (const auto& [name, f] : idx.weight_map)
    if (seen.insert(f).second) files.push_back(f);
  std::sort(files.begin(), files.end());
  std::vector<TensorInfo> out;
  for (const auto& f : files) {
    STRATA_ASSIGN_OR_RETURN(auto h, read_safetensors_header(dir + "/" + f));
    for (auto& t : h.tensors) {
      auto it = idx.weight_map.find(t.name);
      if (it == idx.weight_map.end())
        return corrupt(index_path, fmt::format("tensor \"{}\" of {} is not in the weight_map", t.name, f));
      if (it->second != f)
        return corrupt(index_path,
                       fmt::format("tensor \"{}\" is mapped to {} but is (also) in {}", t.name, it->second, f));
      out.push_back(std::move(t));
    }
  }
  if (out.size() != idx.weight_map.size()) {
    std::set<std::string> have;
    for (const auto& t : out) have.insert(t.name);
    for (const auto& [name, f] : idx.weight_map)
      if (!have.count(name))
        return corrupt(index_path,
                       fmt::format("weight_map names tensor \"{}\" in {}, which does not hold it", name, f));
  }
  // total_size is informational: files written by other tools do not always
  // agree with the sum of tensor bytes, so it is not checked.
  return out;
}

// ShardedWriter

Result<std::unique_ptr<ShardedWriter>> ShardedWriter::create(const std::string& dir, std::vector<TensorDecl> tensors,
                                                             uint64_t max_shard_bytes) {
  std::unique_ptr<ShardedWriter> w(new ShardedWriter());
  w->dir_ = dir;
  uint64_t cur = 0;
  for (auto& t : tensors) {
    uint64_t numel = 0, bytes = 0;
    if (!shape_numel(t.shape, &numel) || mul_overflows(numel, st_dtype_size(t.dtype), &bytes))
      return Status(StatusCode::kInvalidArgument, fmt::format("{}: tensor \"{}\" is too large", dir, t.name));
    if (w->shards_.empty() || (max_shard_bytes != 0 && cur > 0 && cur + bytes > max_shard_bytes)) {
      w->shards_.emplace_back();
      cur = 0;
    }
    cur += bytes;
    w->total_size_ += bytes;
    w->shards_.back().push_back(std::move(t));
  }
  if (w->shards_.empty()) w->shards_.emplace_back();
  const size_t n = w->shards_.size();
  for (size_t i = 0; i < n; ++i)
    w->files_.push_back(n == 1 ? std::string("model.safetensors")
                               : fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n));
  STRATA_ASSIGN_OR_RETURN(w->writer_, SafetensorsWriter::create(dir + "/" + w->files_[0], w->shards_[0]));
  return w;
}

// An unfinished write leaves nothing of its own: the open shard's temp file
// goes with its writer, and the shards it completed are removed (without the
// index and the rest they are no model); a file it never wrote (an older
// model's shard of the same name) stays.
ShardedWriter::~ShardedWriter() {
  if (finished_ || shards_.size() < 2) return;
  writer_.reset();
  for (size_t s = 0; s < completed_ && s < files_.size(); ++s) (void)::unlink((dir_ + "/" + files_[s]).c_str());
}

Status ShardedWriter::advance() {
  while (writer_ && writer_->remaining() == 0 && shard_ + 1 < shards_.size()) {
    STRATA_RETURN_IF_ERROR(writer_->finish());
    completed_ = shard_ + 1;
    ++shard_;
    STRATA_ASSIGN_OR_RETURN(writer_, SafetensorsWriter::create(dir_ + "/" + files_[shard_], shards_[shard_]));
  }
  return Status::ok_status();
}

const TensorDecl* ShardedWriter::current() const {
  if (!writer_) return nullptr;
  if (const TensorDecl* t = writer_->current()) return t;
  for (size_t s = shard_ + 1; s < shards_.size(); ++s)
    if (!shards_[s].empty()) return &shards_[s].front();
  return nullptr;
}

Status ShardedWriter::write(const void* data, uint64_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (bytes > 0) {
    STRATA_RETURN_IF_ERROR(advance());
    const uint64_t n = std::min(bytes, writer_->remaining());
    if (n == 0)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("{}: write of {} bytes past the declared tensors", dir_, bytes));
    STRATA_RETURN_IF_ERROR(writer_->write(p, n));
    p += n;
    bytes -= n;
  }
  return Status::ok_status();
}

Status ShardedWriter::write_from(DType src_dtype, const void* src, uint64_t count) {
  STRATA_RETURN_IF_ERROR(advance());
  return writer_->write_from(src_dtype, src, count);
}

Status ShardedWriter::finish() {
  if (finished_) return Status::ok_status();
  STRATA_RETURN_IF_ERROR(advance());
  if (shard_ + 1 != shards_.size() || writer_->remaining() != 0)
    return Status(StatusCode::kInvalidArgument, fmt::format("{}: not every declared tensor was written", dir_));
  STRATA_RETURN_IF_ERROR(writer_->finish());
  completed_ = shards_.size();
  const std::string index_path = dir_ + "/model.safetensors.index.json";
  const std::string single = dir_ + "/model.safetensors";
  // The shards an earlier index named (init-model --force over a sharded
  // model): removed below unless this model wrote the same names, so no
  // stale shard stays beside the new model. Only plain *.safetensors names
  // in this directory (an index naming "../x" removes nothing).
  std::vector<std::string> stale;
  {
    struct stat st {};
    if (::stat(index_path.c_str(), &st) == 0) {
      auto old = read_safetensors_index(index_path);
      if (old.ok()) {
        std::set<std::string> now(files_.begin(), files_.end());
        for (const auto& [name, file] : old->weight_map)
          if (!now.count(file) && file.find('/') == std::string::npos && file.ends_with(".safetensors") &&
              file != "model.safetensors" && std::find(stale.begin(), stale.end(), file) == stale.end())
            stale.push_back(file);
      }
    }
  }
  if (shards_.size() == 1) {
    // A stale index next to the new single file would describe other data.
    if (::unlink(index_path.c_str()) != 0 && errno != ENOENT)
      return Status::from_errno(errno, "removing stale " + index_path + " failed");
  } else {
    SafetensorsIndex idx;
    idx.total_size = total_size_;
    for (size_t s = 0; s < shards_.size(); ++s)
      for (const auto& t : shards_[s]) idx.weight_map[t.name] = files_[s];
    STRATA_RETURN_IF_ERROR(write_safetensors_index(index_path, idx));
    // model.safetensors takes precedence when loading: a stale one must go.
    if (::unlink(single.c_str()) != 0 && errno != ENOENT)
      return Status::from_errno(errno, "removing stale " + single + " failed");
  }
  finished_ = true;  // the new model is whole: nothing below may remove it
  for (const std::string& f : stale)
    if (::unlink((dir_ + "/" + f).c_str()) != 0 && errno != ENOENT)
      log_warn("{}: the earlier index's shard {} stays ({}); the new index does not name it", dir_, f,
               std::strerror(errno));
  return Status::ok_status();
}

}  // namespace strata::model
