// File-to-file copies that never hold a whole tensor in RAM: reflink
// (FICLONERANGE) where the filesystem shares extents and the range is
// block-aligned, else copy_file_range, else a read/write loop through one
// bounded buffer; each copy returns the CRC32C of the bytes that landed in
// the destination (for a reflink: the clone; for copy_file_range: the range
// just copied, still in the page cache), so the checksum describes what the
// destination holds. Checkpoint saves and loads stream NVMe-resident state
// through it.
//
// Owns nothing between calls: the caller passes the only staging buffer.
// Blocking; thread-safe for distinct files. Errors are Status values naming
// the files and offsets; a method the filesystem refuses (EOPNOTSUPP, EXDEV,
// EINVAL, ...) is not an error but a fall-back to the next one.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace strata {

// Largest total a copy (and a checkpoint entry) may have: 64 PiB, so every
// size sum stays far from overflow.
inline constexpr uint64_t kMaxCopyBytes = 1ull << 56;

// A byte range of a file: by path (opened and closed by the checkpoint code)
// or by an open descriptor (fd >= 0; borrowed, never closed; an O_DIRECT
// descriptor is reopened buffered through /proc/self/fd). A tensor striped
// over several swap files is a list of ranges, read or written in order.
struct FileRange {
  std::string path;
  int fd = -1;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// How file-to-file copies move bytes. kAuto tries reflink, then
// copy_file_range, then read/write, falling back per copy when one is refused
// (EOPNOTSUPP, EXDEV, EINVAL, ...). The others force a method (still falling
// back if it is refused): for tests and benchmarks.
enum class CopyMethod : uint8_t { kAuto = 0, kReflink, kCopyFileRange, kReadWrite };
const char* copy_method_name(CopyMethod m);

// Bytes moved by each method, summed over a writer's or reader's copies.
struct CopyStats {
  uint64_t reflink_bytes = 0;
  uint64_t copy_file_range_bytes = 0;
  uint64_t read_write_bytes = 0;
  uint64_t buffer_bytes = 0;  // entries added from memory / read into memory
};

// The CRC32C of every `block`-byte piece of a copy's stream (the last may be
// shorter), as crc32c_blocks gives them: the swap store's block checksums,
// so a checkpoint save can check that the NVMe state it copied is what
// Strata wrote, and a load can record what it put there.
struct BlockCrcs {
  uint64_t block = 0;           // in: bytes per block (0: none computed)
  std::vector<uint32_t> crcs;  // out
};

// Copies `length` bytes from the concatenation of `src` ranges to the
// concatenation of `dst` ranges (same total length), returning the CRC32C of
// the bytes that landed in `dst`. Uses `buffer` (>= 4096 bytes) as the only
// staging memory. Destination paths are created (0600) if missing, never
// truncated. Errors: kInvalidArgument (totals differ or exceed
// kMaxCopyBytes, small buffer, read-only destination descriptor), kIoError
// for a source range past the end of its file ("range [a, b) ends at byte b
// of /x, which has M bytes"), and the file system's errors naming the files.
// With `blocks`, also the CRC of each blocks->block bytes that landed (one
// checksum pass still: the whole CRC is combined from the blocks').
Result<uint32_t> copy_file_ranges(std::span<const FileRange> src, std::span<const FileRange> dst, CopyMethod method,
                                  std::span<uint8_t> buffer, CopyStats* stats, BlockCrcs* blocks = nullptr);

// Extends `*crc` (CRC32C) over `n` bytes of `fd` at `off`, reading through
// `buf`; `what` names the file in errors.
Status crc32c_of_file(int fd, uint64_t off, uint64_t n, std::span<uint8_t> buf, const std::string& what, uint32_t* crc);

}  // namespace strata
