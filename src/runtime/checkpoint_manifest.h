// The JSON files of a checkpoint (index.json, manifest.rank<R>.json): their
// text as the writer saves it, and the strict parser the reader and rank 0's
// commit use. Each file carries the CRC32C of its own canonical form, so a
// flipped digit in a manifest is caught like a flipped byte in a data file.
// docs/checkpoints.md describes the fields.
//
// Internal to the checkpoint code (checkpoint_writer.cpp,
// checkpoint_reader.cpp); callers use runtime/checkpoint.h. Pure functions
// plus blocking reads of one file; thread-safe. Parsing bounds every field and
// refuses unknown keys: errors are kCorrupt "<prefix>: <file>: <key>: why",
// kNotFound for a missing file, kUnavailable for another format version.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <nlohmann/json.hpp>
#include <vector>

#include "runtime/checkpoint.h"

namespace strata {

// Limits of the format: a parser refuses anything larger.
inline constexpr uint64_t kMaxJsonBytes = 256ull << 20;    // a manifest of ~1M entries
inline constexpr uint64_t kMaxEntryBytes = kMaxCopyBytes;  // 64 PiB: bounds every size sum
inline constexpr uint32_t kMaxWorldSize = 1u << 20;
inline constexpr std::size_t kMaxNameBytes = 1024;

// "0x" and 8 lower-case hex digits: how checksums are stored and named in errors.
std::string hex32(uint32_t v);
// The CRC32C of a manifest's or index's canonical form (the compact dump of
// the object without "self_crc32c", keys sorted): what "self_crc32c" holds.
uint32_t canonical_crc(const nlohmann::json& without_self);
// "manifest.rank<R>.json".
std::string manifest_file_name(uint32_t rank);

// The text of manifest.rank<info.rank>.json for `entries` and, when `extra`
// is not null, the file holding info.extra_bytes (its file, bytes, crc32c).
// info.extra_json must be valid JSON or empty.
std::string manifest_text(const CheckpointInfo& info, const CheckpointEntry* extra,
                          std::span<const CheckpointEntry> entries);
// The text of index.json: one shard per rank, naming its manifest and that
// manifest's own checksum (manifest_crcs[r]).
std::string index_text(uint64_t step, double loss_scale, uint32_t world_size, std::span<const uint32_t> manifest_crcs);

struct ParsedManifest {
  CheckpointInfo info;  // rank, world_size, step, loss_scale, extra_json (extra_bytes not read)
  std::vector<CheckpointEntry> entries;
  bool has_extra_file = false;
  CheckpointEntry extra;  // the extra bytes' file, when has_extra_file
  uint32_t self_crc = 0;
};
// Reads and checks <dir>/manifest.rank<rank>.json; `prefix` ("checkpoint
// <dir>") starts every error text.
Result<ParsedManifest> parse_manifest(const std::string& dir, uint32_t rank, const std::string& prefix);

struct ParsedIndex {
  uint64_t world_size = 0;
  uint64_t step = 0;
  double loss_scale = 1.0;
  std::string manifest;  // rank's manifest file name
  uint32_t manifest_crc = 0;
};
// Reads and checks <dir>/index.json and its shard for `rank`. Also
// kInvalidArgument when rank >= the checkpoint's world_size.
Result<ParsedIndex> parse_index(const std::string& dir, uint32_t rank, const std::string& prefix);

}  // namespace strata
