// safetensors files: header parsing with every bound checked, tensor reads
// through the I/O engine (one tensor or a range of it at a time, converted to
// the requested float type on the way), a streaming atomic writer, and the
// sharded layout (`model.safetensors.index.json`).
//
// Format (https://github.com/huggingface/safetensors): 8-byte little-endian
// header length N, N bytes of JSON
//   {"__metadata__": {str: str}, name: {"dtype": "BF16", "shape": [..],
//    "data_offsets": [begin, end]}, ...}
// then the data region; offsets are relative to its start. The checks match
// the reference implementation: known dtype, shape product * element size ==
// end - begin (no overflow), tensors tile the data region exactly (no hole,
// no overlap, nothing past its end), no duplicate names, N <= 100 MB.
//
// Errors are Status values naming the file, the tensor and the byte offsets
// (kCorrupt for a malformed or truncated file, kNotFound / kIoError /
// kPermission from the file system, kInvalidArgument for bad caller input).
// Nothing here aborts on a bad file.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"

namespace strata::io {
class IoEngine;
class IoFile;
}  // namespace strata::io

namespace strata::model {

// Element types a safetensors file may declare.
enum class StDType : uint8_t {
  kBOOL,
  kU8,
  kI8,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kF64,
  kI64,
  kU64,
  kF8_E4M3,
  kF8_E5M2,
};
size_t st_dtype_size(StDType d);       // bytes per element
const char* st_dtype_name(StDType d);  // "BF16", "F32", ...
// Parses the file's spelling ("BF16"); kInvalidArgument for an unknown name.
Result<StDType> parse_st_dtype(std::string_view name);
// The float types Strata computes with: F32, BF16, F16 (nullopt otherwise).
std::optional<DType> to_dtype(StDType d);
// The same element kind under its safetensors name (U8, F32, F64, I32, ...).
StDType from_dtype(DType d);

// Largest header accepted (the reference implementation's limit).
inline constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;

// One tensor of a file (or of a sharded model: `file` says which).
struct TensorInfo {
  std::string name;
  StDType dtype = StDType::kF32;
  std::vector<uint64_t> shape;  // empty: a scalar
  std::string file;             // path of the .safetensors file holding it
  uint64_t offset = 0;          // absolute byte offset of its data in `file`
  uint64_t nbytes = 0;          // numel() * st_dtype_size(dtype)
  uint64_t numel() const;
};

struct SafetensorsHeader {
  std::string path;
  uint64_t header_len = 0;   // N
  uint64_t data_offset = 0;  // 8 + N: where the data region starts
  uint64_t file_size = 0;
  std::map<std::string, std::string> metadata;
  std::vector<TensorInfo> tensors;  // sorted by offset
  // nullptr when absent.
  const TensorInfo* find(std::string_view name) const;
};

// Parses and checks the JSON header text `json` of a file of `file_size`
// bytes whose header length field is json.size(). `path` is used in messages
// and stored in every TensorInfo. Pure (no I/O); kCorrupt on any violation.
Result<SafetensorsHeader> parse_safetensors_header(std::string_view json, uint64_t file_size, const std::string& path);
// Parses the header of a whole file held in memory (`bytes` is the file;
// its size is the file size): the length field, then as above. Pure; for
// tests and small in-memory files.
Result<SafetensorsHeader> parse_safetensors_file_bytes(std::string_view bytes, const std::string& path);
// Reads only the header of `path` (pread) and parses it. Blocking.
Result<SafetensorsHeader> read_safetensors_header(const std::string& path);

// Reads tensor data through an IoEngine. Files are opened on first use and
// kept open until the reader is destroyed. Thread-safe: read() may be called
// from several threads at once. The engine is borrowed and must outlive the
// reader; with engine == nullptr the reader makes its own (default options).
class TensorReader {
 public:
  static Result<std::unique_ptr<TensorReader>> create(io::IoEngine* engine = nullptr);
  ~TensorReader();
  TensorReader(const TensorReader&) = delete;
  TensorReader& operator=(const TensorReader&) = delete;

  // Reads elements [elem_begin, elem_begin + count) of `t` (count ==
  // UINT64_MAX: to the end) into `out` as `out_dtype` (count * dtype_size
  // bytes). BF16/F16/F32/F64 files convert to any DType (rounding as
  // common/float_convert.h; F64 -> narrower: via fp32). Blocking; memory use is
  // bounded by a staging buffer of a few MiB when a conversion is needed, none
  // otherwise. Errors: kInvalidArgument (range past the tensor, a non-float
  // file dtype), I/O errors naming file and offset.
  Status read(const TensorInfo& t, DType out_dtype, void* out, uint64_t elem_begin = 0, uint64_t count = UINT64_MAX);
  // Raw bytes [byte_begin, byte_begin + bytes) of `t`'s data, no conversion.
  Status read_raw(const TensorInfo& t, uint64_t byte_begin, uint64_t bytes, void* out);

  io::IoEngine* engine() const { return engine_; }

 private:
  TensorReader() = default;
  Result<io::IoFile*> file_for(const std::string& path);
  std::unique_ptr<io::IoEngine> owned_engine_;
  io::IoEngine* engine_ = nullptr;
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<io::IoFile>> files_;
};

// A tensor to be written: name, file dtype, shape.
struct TensorDecl {
  std::string name;
  StDType dtype = StDType::kBF16;
  std::vector<uint64_t> shape;
  uint64_t numel() const;
  uint64_t nbytes() const { return numel() * st_dtype_size(dtype); }
};

// Streams one safetensors file: the tensor list is given up front, the header
// (sorted JSON keys, padded with spaces to a multiple of 8 bytes) is written
// at create(), then each tensor's bytes in the declared order, in any number
// of write() calls. The file is written under "<path>.tmp.<pid>" and renamed
// over `path` by finish() after fsync (atomic: readers never see a partial
// file). Destroying an unfinished writer removes the temporary file. Not
// thread-safe. Blocking.
class SafetensorsWriter {
 public:
  // kInvalidArgument: duplicate/empty names, "__metadata__" as a name, a
  // size that overflows; file-system errors from creating the temp file.
  static Result<std::unique_ptr<SafetensorsWriter>> create(const std::string& path, std::vector<TensorDecl> tensors,
                                                           std::map<std::string, std::string> metadata = {
                                                               {"format", "pt"}});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Appends raw bytes in the file dtype; may span tensor boundaries.
  // kInvalidArgument when more bytes are written than declared.
  Status write(const void* data, uint64_t bytes);
  // Appends `count` elements of `src_dtype`, converted to the dtype of the
  // tensor being written (which must be F32, BF16 or F16); must not cross
  // into the next tensor.
  Status write_from(DType src_dtype, const void* src, uint64_t count);
  // The tensor the next byte belongs to (nullptr when all are written).
  const TensorDecl* current() const;
  // Data bytes still to be written (all tensors).
  uint64_t remaining() const { return ends_.empty() ? 0 : ends_.back() - written_; }
  // Checks every declared byte was written, fsyncs, renames, fsyncs the
  // directory. kInvalidArgument when bytes are missing.
  Status finish();

 private:
  SafetensorsWriter() = default;
  Status write_all(const void* data, uint64_t bytes);
  std::string path_, tmp_path_;
  int fd_ = -1;
  std::vector<TensorDecl> tensors_;
  std::vector<uint64_t> ends_;  // cumulative data end of each tensor
  uint64_t written_ = 0;        // data bytes written
  bool finished_ = false;
};

// model.safetensors.index.json
struct SafetensorsIndex {
  uint64_t total_size = 0;                        // metadata.total_size (0 if absent)
  std::map<std::string, std::string> weight_map;  // tensor name -> file name (relative to the index)
};
// kCorrupt naming the key for a malformed index; a weight_map file name that
// is absolute or contains "/.." is refused (kCorrupt).
Result<SafetensorsIndex> read_safetensors_index(const std::string& path);
// Atomic (temp + rename).
Status write_safetensors_index(const std::string& path, const SafetensorsIndex& index);

// Reads every tensor of a single file or a sharded model in `dir`:
// "model.safetensors" if present, else "model.safetensors.index.json" and
// the shards it names (each shard's header checked; every weight_map entry
// must be in its file and every tensor of a shard in the weight_map).
// kNotFound when neither file exists.
Result<std::vector<TensorInfo>> read_model_tensors(const std::string& dir);

// Writes a model as one file or as shards of at most `max_shard_bytes` of
// data each (0: one file). Tensors are assigned to shards in order; a tensor
// larger than the limit gets a shard of its own. With one shard the output is
// DIR/model.safetensors; otherwise DIR/model-0000k-of-0000n.safetensors plus
// DIR/model.safetensors.index.json. Same streaming interface as
// SafetensorsWriter (write / write_from / finish). Destroying an unfinished
// writer removes what it wrote (the open shard's temp file, the shards it
// completed). Not thread-safe. Blocking.
class ShardedWriter {
 public:
  static Result<std::unique_ptr<ShardedWriter>> create(const std::string& dir, std::vector<TensorDecl> tensors,
                                                       uint64_t max_shard_bytes);
  ~ShardedWriter();
  Status write(const void* data, uint64_t bytes);
  Status write_from(DType src_dtype, const void* src, uint64_t count);
  const TensorDecl* current() const;
  Status finish();
  // File names (relative to dir), in shard order.
  const std::vector<std::string>& files() const { return files_; }

 private:
  ShardedWriter() = default;
  Status advance();  // opens the next shard when the current one is complete
  std::string dir_;
  std::vector<std::vector<TensorDecl>> shards_;
  std::vector<std::string> files_;
  size_t shard_ = 0;
  size_t completed_ = 0;  // shards finished (renamed into place)
  std::unique_ptr<SafetensorsWriter> writer_;
  uint64_t total_size_ = 0;
  bool finished_ = false;
};

// Writes `content` to `path` atomically: "<path>.tmp.<pid>", fsync, rename,
// fsync of the directory. Blocking. File-system errors name the path.
Status write_file_atomic(const std::string& path, std::string_view content);

}  // namespace strata::model
