// The swap store: tensors' bytes in preallocated files on one or more SSDs.
//
// Layout. The store is one linear space of bytes striped over its directories
// in `stripe_bytes` chunks (chunk c lives in directory c % n, at file offset
// (c / n) * stripe_bytes), so a large read or write uses every SSD at once.
// Each tensor gets a range of that space starting on a 4 KiB boundary, so a
// whole-tensor transfer into a pinned buffer is O_DIRECT end to end. Files are
// grown with fallocate as tensors are added (ftruncate where the filesystem
// has none), so a full disk is found when a tensor is added, not mid-step.
//
// Directories. For each configured directory D, Strata uses D/<run> (created
// 0700, with a .strata-run marker) and puts one file per directory and rank
// there: D/<run>/rank00000.stripe0.swap (0600). D itself must be empty, or
// hold Strata's .strata-scratch marker (left by an earlier run), or be missing
// (Strata creates it with the marker); a non-empty D without the marker is
// refused (kAlreadyExists) unless reuse_nonempty_dirs is set, so Strata never
// writes into a directory full of someone else's data. close() (and the
// destructor) remove the run directories and their files; D and its marker
// stay for the next run, unless this store created D (and any missing
// parents): those it removes again while nothing else is in them.
//
// Checksums. With checksum_block = B (a power of two, 4096 or more), the
// store keeps the CRC32C of every B-byte block of every tensor (the last
// block of a tensor may be shorter) in host memory, 4 bytes per block:
// write() computes them from the buffer as it submits, read() verifies them
// on the I/O thread before the request completes, so bytes that changed on
// disk after Strata wrote them (a failing SSD, a stray writer, a torn write)
// fail the read that meets them with kCorrupt naming the tensor, the file
// and the offset, and are never used or checkpointed. Blocks never written
// hold the zeros preallocation gives them. With checksums on, every read
// and write must start on a block boundary and end on one or at the
// tensor's end (kInvalidArgument otherwise: a partial block cannot be
// verified or re-checksummed). Byte-for-byte copies that bypass read/write
// (checkpoints, through file_ranges) use block_checksums/verify_checksums/
// set_checksums.
//
// Thread-safety: add_tensor, read and write may be called from any thread.
// read/write are asynchronous (see IoEngine); the engine must outlive the
// store, and the store must outlive its requests (close() waits for them).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "io/io_engine.h"

namespace strata::io {

struct SwapStoreOptions {
  std::vector<std::string> dirs;            // one per SSD (at least one)
  std::uint64_t stripe_bytes = 4ull << 20;  // striping unit; multiple of 4096
  int rank = 0;                             // goes into file names
  std::string run_name;                     // "" = "strata-run-<pid>-<n>"; the same on all ranks of a job is fine
  bool reuse_nonempty_dirs = false;         // accept a non-empty directory Strata did not create
  std::uint64_t checksum_block = 0;         // 0: no checksums; else a power of two >= 4096 (see above)
};

// One piece of a tensor's bytes in one stripe file (see file_ranges()).
struct SwapFileRange {
  std::string path;        // the stripe file
  int fd = -1;             // its buffered (non-O_DIRECT) descriptor; owned by the store
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
};

// A tensor's place in the store. A small value; copy it freely.
struct SwapTensor {
  std::uint32_t id = 0;
  std::uint64_t base = 0;  // offset in the striped space
  std::uint64_t bytes = 0;
};

class SwapStore {
 public:
  // Creates the run directories and files. Blocking. Errors: kInvalidArgument
  // (no directory, bad stripe size), kAlreadyExists (a non-empty directory
  // Strata did not create), kPermission / kNotFound / kIoError (cannot create
  // the directories or files, with the path).
  static Result<std::unique_ptr<SwapStore>> create(IoEngine& engine, const SwapStoreOptions& options);
  ~SwapStore();  // close(), errors logged

  // Reserves `bytes` for a tensor and preallocates them on disk. Blocking.
  // Errors: kNoSpace (naming the file), kIoError, kInvalidArgument (the store
  // would pass 2^62 bytes).
  Result<SwapTensor> add_tensor(std::string_view name, std::uint64_t bytes);

  // Reads/writes `length` bytes of tensor `t` starting at `offset` within the
  // tensor, to/from `buffer` (pinned and 4 KiB-aligned for full speed; any
  // buffer works). Asynchronous: one handle (and callback) for the whole
  // range, whatever number of stripes it spans. A range outside the tensor
  // completes with kInvalidArgument. Memory refused on the way (std::bad_alloc,
  // `ulimit -v`) is thrown: then nothing was submitted and the callback is
  // never called.
  IoHandle read(const SwapTensor& t, std::uint64_t offset, std::uint64_t length, void* buffer,
                IoCallback callback = {});
  IoHandle write(const SwapTensor& t, std::uint64_t offset, std::uint64_t length, const void* buffer,
                 IoCallback callback = {});

  // Where bytes [offset, offset+length) of tensor `t` lie on disk, in order:
  // one range per stripe piece (adjacent pieces in one file merged), so a
  // caller can stream a tensor file to file (checkpoints: copy_file_range,
  // reflink). The descriptors are the store's buffered ones (valid until
  // close(); the kernel keeps them coherent with the O_DIRECT requests);
  // do not close them, and do not use them while requests on the same bytes
  // are in flight. Blocking-free (arithmetic only); any thread.
  // Errors: kInvalidArgument (range outside the tensor, or after close()).
  Result<std::vector<SwapFileRange>> file_ranges(const SwapTensor& t, std::uint64_t offset,
                                                 std::uint64_t length) const;

  // Checksums (see the header comment); all need checksum_block != 0.
  std::uint64_t checksum_block() const { return options_.checksum_block; }
  // Number of blocks of tensor `t` (ceil(bytes / checksum_block)).
  std::uint64_t block_count(const SwapTensor& t) const;
  // kCorrupt naming the first block whose CRC differs from crcs[i] (the
  // CRCs of the tensor's bytes from offset 0, as crc32c_blocks computes
  // them), with the tensor, file and offset; kInvalidArgument if crcs does
  // not have block_count(t) entries.
  Status verify_checksums(const SwapTensor& t, std::span<const std::uint32_t> crcs) const;
  // Records crcs as the tensor's block checksums (after the caller put those
  // bytes into the files itself, e.g. a checkpoint load). Not concurrent with
  // read/write of the same tensor.
  Status set_checksums(const SwapTensor& t, std::span<const std::uint32_t> crcs);
  // Host memory the checksums take.
  std::uint64_t checksum_bytes() const;

  // Waits for this store's requests, then removes its files and run
  // directories.
  // Idempotent. Errors: the first removal failure (kIoError).
  Status close();

  std::size_t dir_count() const { return stripes_.size(); }
  const std::string& run_dir(std::size_t i) const { return stripes_[i].run_dir; }
  const std::string& file_path(std::size_t i) const { return stripes_[i].path; }
  std::uint64_t reserved_bytes() const;  // size of the striped space in use
  std::uint64_t stripe_bytes() const { return options_.stripe_bytes; }

 private:
  struct Stripe {
    std::string run_dir;
    std::string path;
    std::unique_ptr<IoFile> file;
    std::uint64_t size = 0;  // preallocated bytes
  };
  SwapStore(IoEngine& e, const SwapStoreOptions& o) : engine_(e), options_(o) {}
  Status prepare_dir(const std::string& dir, Stripe* s);
  std::uint64_t file_bytes_for(std::size_t i, std::uint64_t space) const;
  IoHandle transfer(IoOpKind op, const SwapTensor& t, std::uint64_t offset, std::uint64_t length, void* buffer,
                    IoCallback callback);
  // The tensor's CRC table (null without checksums or for an unknown id).
  std::uint32_t* crcs_of(const SwapTensor& t) const;
  std::vector<std::string> made_dirs_;  // directories prepare_dir created (outermost first): close() removes them
  // Where virtual byte v lies: "<file> offset <o>".
  std::string place_of(std::uint64_t v) const;
  Status mismatch(const SwapTensor& t, std::uint64_t block, std::uint32_t found, std::uint32_t expected,
                  const char* what) const;

  IoEngine& engine_;
  SwapStoreOptions options_;
  std::vector<Stripe> stripes_;
  mutable std::mutex mu_;
  std::uint64_t end_ = 0;  // end of the striped space in use
  std::uint32_t next_id_ = 0;
  struct TensorInfo {
    std::string name;
    std::unique_ptr<std::uint32_t[]> crcs;  // checksum_block != 0: one per block
    std::uint64_t blocks = 0;
  };
  std::deque<TensorInfo> tensors_;  // by id; elements never move (deque)
  bool closed_ = false;
  std::shared_ptr<std::atomic<std::size_t>> inflight_ = std::make_shared<std::atomic<std::size_t>>(0);
};

}  // namespace strata::io
