// Checkpoints: the training state saved as a directory of checksummed files,
// made visible atomically, and refused on load when anything is damaged.
//
// Layout (docs/checkpoints.md has the full description and the guarantees):
//
//   <dir>/index.json                 written by rank 0 last: format version,
//                                    step, loss scale, world_size, the shards
//   <dir>/manifest.rank<R>.json      one per rank: its entries and extra state
//   <dir>/<name>.rank<R>.bin         one data file per entry (raw bytes)
//   <dir>/extra.rank<R>.bin          the caller's opaque extra bytes, if any
//
// Every manifest lists, per entry: logical name ("layers.3.attn.q.master"),
// file name, dtype, element count, byte size and CRC32C. Each JSON file also
// carries the CRC32C of its own content (over its canonical compact form), so
// a flipped digit in a manifest is caught like a flipped byte in a data file.
//
// Atomicity. A save writes everything into <dir>.tmp-<token> (a sibling, so on
// the same filesystem), fsyncs every file and the directory, then moves it
// into place: renameat2(RENAME_EXCHANGE) when <dir> already exists (so there
// is never a moment with no checkpoint under <dir>), else rename(); then
// fsyncs the parent and deletes the replaced checkpoint. A crash leaves either
// the old or the new checkpoint under <dir>, never a mixture, plus at worst a
// leftover sibling that cleanup_checkpoint_leftovers() removes. A failed save
// removes its staging directory and leaves <dir> untouched.
//
// Streaming. NVMe-resident state is copied file to file, never whole into RAM
// (runtime/file_copy.h: reflink, else copy_file_range, else a read/write loop
// through one bounded buffer). The CRC32C is computed by reading the bytes
// that landed in the destination through that buffer, so the checksum
// describes what the checkpoint file holds.
//
// Ranks. Each of N ranks writes its own manifest and data files into one
// shared staging directory named by a token all ranks agree on; after all
// have finished (a barrier that is the caller's), rank 0 commits. With
// world_size == 1 commit() does both.
//
// Errors are Status values, never aborts: kInvalidArgument (bad name, dtype/
// size mismatch, misuse), kNotFound / kPermission / kNoSpace / kIoError (file
// system, naming the path), kCorrupt (a damaged checkpoint, naming the
// checkpoint, the file and what is wrong, e.g. "checkpoint /ck/step-20:
// layers.0.master.rank0.bin: checksum 0x1234abcd, manifest says 0x9f00ee12").
//
// Code: checkpoint_writer.cpp (CheckpointWriter, abort_checkpoint_staging),
// checkpoint_reader.cpp (CheckpointReader), checkpoint_cleanup.cpp
// (cleanup_checkpoint_leftovers), checkpoint_manifest.{h,cpp} (the JSON
// files), file_copy.{h,cpp} (the copy engine), common/posix_file.h.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "runtime/file_copy.h"

namespace strata {

inline constexpr uint32_t kCheckpointFormatVersion = 1;

// An entry's element type is a DType (common/dtype.h), any of them: it says
// what the bytes are; the checkpoint never converts. Manifests store
// dtype_name(): "u8", "fp32", "bf16", "fp16", "fp64", "i32", "i64".
// FileRange, CopyMethod and CopyStats come from runtime/file_copy.h.
struct CheckpointEntry {
  std::string name;  // logical name, unique within a rank
  std::string file;  // data file name inside the checkpoint directory
  DType dtype = DType::kU8;
  uint64_t count = 0;  // elements
  uint64_t bytes = 0;  // count * dtype_size(dtype)
  uint32_t crc32c = 0;
};

// What a checkpoint says about the run (same on every rank) and this rank.
struct CheckpointInfo {
  uint32_t format_version = kCheckpointFormatVersion;
  uint64_t step = 0;
  double loss_scale = 1.0;  // finite, > 0
  uint32_t world_size = 1;
  uint32_t rank = 0;
  std::string extra_json;            // the caller's JSON (canonical compact form on load); "" = none
  std::vector<uint8_t> extra_bytes;  // the caller's opaque bytes (checksummed like an entry)
};

struct CheckpointWriteOptions {
  uint32_t rank = 0;
  uint32_t world_size = 1;
  // Names the staging directory <dir>.tmp-<token>. "" picks "<pid>-<random>"
  // (world_size 1 only: N ranks must pass the same token, e.g. chosen by rank
  // 0 and broadcast). Letters, digits, '-', '_' and '.' only.
  std::string token;
  CopyMethod copy_method = CopyMethod::kAuto;
  uint64_t buffer_bytes = 8ull << 20;  // the bounded streaming buffer (>= 4096)
  // Called at the named stages of commit: "staged" (index.json durable),
  // "exchanged" (RENAME_EXCHANGE done) or "renamed_old" (fallback: old moved
  // away), "renamed" (new in place), "committed" (old deleted). Tests use it
  // to simulate a crash (fork + _exit). Leave empty.
  std::function<void(std::string_view stage)> stage_hook;
};

// Writes one rank's part of a checkpoint. Not thread-safe: one thread uses a
// writer. Every call blocks until its bytes are written (not yet fsynced:
// finish_shard() fsyncs). A writer that fails, or is destroyed before
// commit(), removes what it wrote: with world_size 1 the whole staging
// directory; with N ranks its own files, unless its shard was finished (it
// then belongs to the save: rank 0 commits it, or removes the staging
// directory with abort_checkpoint_staging()).
class CheckpointWriter {
 public:
  // Creates (or, with N ranks, joins) the staging directory <dir>.tmp-<token>.
  // `dir`'s parent must exist. Errors: kInvalidArgument (rank >= world_size,
  // bad token, buffer too small, empty dir), kNotFound / kPermission /
  // kNoSpace / kIoError from mkdir, naming the path; kAlreadyExists when
  // world_size is 1, a token was given, and that staging directory exists.
  static Result<std::unique_ptr<CheckpointWriter>> create(const std::string& dir, const CheckpointInfo& info,
                                                          const CheckpointWriteOptions& options = {});
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Adds an entry from memory: `bytes` must equal count * size(dtype).
  // Errors: kInvalidArgument (empty/duplicate/over-long name, NUL in it,
  // size mismatch), I/O errors naming the file.
  Status add_buffer(std::string_view name, DType dtype, uint64_t count, const void* data, uint64_t bytes);
  // Adds an entry streamed from file ranges (concatenated in order), never
  // holding more than buffer_bytes in memory. The ranges' total length must
  // equal count * size(dtype); a range past the end of its file is kIoError
  // ("... ends at byte N of /x, which has M bytes"). With `blocks`, also the
  // CRC of each blocks->block bytes copied (the engine checks them against
  // the swap store's before the checkpoint can count).
  Status add_file_ranges(std::string_view name, DType dtype, uint64_t count, std::span<const FileRange> ranges,
                         BlockCrcs* blocks = nullptr);

  // Writes this rank's manifest, fsyncs it, every data file and the staging
  // directory. After this, no add_*; with N ranks the caller then waits until
  // every rank has finished before rank 0 commits.
  Status finish_shard();

  // Rank 0 only: checks that every rank's manifest is present and agrees,
  // writes index.json, fsyncs, and moves the staging directory to `dir`
  // (see the header comment). Calls finish_shard() first if it has not run.
  // On error the staging directory is removed and `dir` is untouched (or, in
  // the one window after the exchange, holds the new complete checkpoint).
  Status commit();

  const CopyStats& copy_stats() const { return stats_; }
  const std::vector<CheckpointEntry>& entries() const { return entries_; }
  const std::string& staging_dir() const { return staging_; }

 private:
  CheckpointWriter() = default;
  Status add_entry_file(std::string_view name, DType dtype, uint64_t count, uint64_t bytes, std::string* file, int* fd);
  Status fail(Status st);  // marks the writer failed and cleans up
  void cleanup();

  std::string dir_, staging_, token_;
  CheckpointInfo info_;
  CheckpointWriteOptions options_;
  std::vector<CheckpointEntry> entries_;
  std::vector<std::string> files_;  // every file this writer created (relative)
  std::vector<uint8_t> buffer_;
  CopyStats stats_;
  bool finished_ = false, committed_ = false, failed_ = false;
};

// Removes a staging directory of an aborted N-rank save (rank 0, after every
// rank stopped writing). Missing is fine.
Status abort_checkpoint_staging(const std::string& dir, const std::string& token);

// Removes what a crashed save left beside `dir`: <dir>.tmp-* and <dir>.old-*
// siblings. If `dir` itself is missing and a complete replaced checkpoint is
// found beside it (a crash inside the two-rename fallback), it is renamed
// back to `dir` first. Not while another process may be saving to `dir`,
// unless `keep_live_owners`: then a leftover whose token names a process
// alive on this host ("<pid>-...", not this one) is left alone (the library's
// saves, which hold no lock on the directory).
Status cleanup_checkpoint_leftovers(const std::string& dir, bool keep_live_owners = false);

// The names of the files a committed checkpoint directory holds: index.json,
// every rank's manifest, data files and extra bytes' file, as its index and
// manifests list them (read and checked, the data files are not). Lets a
// caller that prunes old checkpoints remove only what a save wrote.
Result<std::vector<std::string>> checkpoint_files(const std::string& dir);

struct CheckpointOpenOptions {
  uint32_t rank = 0;
  // Read every data file and check its checksum during open(), so that a
  // damaged checkpoint is refused before any data is handed out (costs one
  // full read of this rank's files). Reads check again either way.
  bool verify_all = true;
  CopyMethod copy_method = CopyMethod::kAuto;
  uint64_t buffer_bytes = 8ull << 20;
};

// Reads one rank's part of a committed checkpoint. Not thread-safe.
class CheckpointReader {
 public:
  // Parses and checks index.json and manifest.rank<R>.json (every field
  // bounded, their own checksums, format version == 1, shard agrees with the
  // index), checks every data file's size, then (verify_all) every checksum.
  // Errors: kNotFound (no directory, or no index.json: not a checkpoint or
  // never committed), kCorrupt (anything damaged, including a missing,
  // truncated or overlong data file, naming the file and what is wrong),
  // kUnavailable (a format version this build does not read),
  // kInvalidArgument (rank outside world_size, naming both), I/O errors.
  static Result<std::unique_ptr<CheckpointReader>> open(const std::string& dir,
                                                        const CheckpointOpenOptions& options = {});

  const CheckpointInfo& info() const { return info_; }
  const std::vector<CheckpointEntry>& entries() const { return entries_; }
  const CheckpointEntry* find(std::string_view name) const;  // nullptr if absent

  // Reads a whole entry into `dst` (`dst_bytes` must equal its size) and
  // checks its checksum. Returns ok only for verified bytes; on kCorrupt the
  // buffer's contents are unspecified.
  Status read(std::string_view name, void* dst, uint64_t dst_bytes);
  // Streams an entry into file ranges (total length == entry size), reflink /
  // copy_file_range / read-write as for saves, checking the checksum of the
  // bytes that landed. On kCorrupt the ranges hold unverified bytes. With
  // `blocks`, also the CRC of each blocks->block bytes that landed.
  Status read_to_file_ranges(std::string_view name, std::span<const FileRange> ranges, BlockCrcs* blocks = nullptr);
  // Re-reads every data file and checks sizes and checksums (what open()
  // does with verify_all).
  Status verify_all();

  const CopyStats& copy_stats() const { return stats_; }

 private:
  CheckpointReader() = default;
  Status check_entry_file(const CheckpointEntry& e, bool checksum);
  std::string dir_;
  CheckpointInfo info_;
  CheckpointOpenOptions options_;
  std::vector<CheckpointEntry> entries_;
  CheckpointEntry extra_entry_;  // the extra bytes' file, when present
  bool has_extra_file_ = false;
  std::vector<uint8_t> buffer_;
  CopyStats stats_;
};

}  // namespace strata
