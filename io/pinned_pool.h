// The pinned buffer pool: aligned host buffers for I/O and device copies,
// under a hard byte budget.
//
// Memory comes in slabs from alloc_host (2 MiB-aligned, transparent huge
// pages). Every slab is handed to each registrar given at construction (in
// order): the device backend's (cudaHostRegister, so GPU copies from it are
// asynchronous) and the I/O engine's (io_uring fixed buffers). A registrar
// error is the pool's error; the slab is then unregistered and unmapped.
//
// The budget counts mapped slab bytes, i.e. what the pool really holds, so the
// pool never takes more than `budget_bytes` of host memory: an allocation that
// would need more fails with kOutOfBudget saying how much was asked and how
// much is left, before anything is mapped. Slabs stay mapped when their buffers
// are released (pinning is slow); empty slabs are unmapped when a new slab
// would not fit otherwise, or by trim().
//
// Thread-safety: all methods may be called from any thread. PinnedBuffer is a
// move-only owner; it returns its bytes on destruction. The pool must outlive
// its buffers, and the registrars must outlive the pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "common/host_memory.h"
#include "common/status.h"

namespace strata::io {

class PinnedPool;

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& o) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { reset(); }

  void* data() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  std::size_t size() const { return bytes_; }  // as asked
  explicit operator bool() const { return ptr_ != nullptr; }
  // Returns the bytes to the pool now.
  void reset();

 private:
  friend class PinnedPool;
  PinnedPool* pool_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;     // as asked
  std::size_t reserved_ = 0;  // rounded to the pool's alignment
};

struct PinnedPoolOptions {
  std::size_t budget_bytes = 0;                    // hard limit on mapped bytes (> 0)
  std::size_t slab_bytes = std::size_t{64} << 20;  // usual slab size; larger requests get a slab of their own
  std::size_t alignment = 4096;                    // of every buffer (power of two, 512..2 MiB)
  std::vector<HostMemoryRegistrar*> registrars;    // called on every slab; not owned
};

class PinnedPool {
 public:
  // Errors: kInvalidArgument (zero budget, bad alignment). Maps nothing yet.
  static Result<std::unique_ptr<PinnedPool>> create(const PinnedPoolOptions& options);
  // Unregisters and unmaps every slab. Buffers still out are reported with
  // log_error (a bug in the caller) and their slabs leaked rather than freed
  // under them.
  ~PinnedPool();

  // A buffer of `bytes` (> 0), aligned to options.alignment. Blocking only on
  // mmap and registration. Errors: kOutOfBudget ("pinned pool: asked for N
  // bytes, M of the B-byte budget left"), kOutOfMemory (mmap refused),
  // whatever a registrar returns (kOutOfMemory/kPermission), kInvalidArgument.
  Result<PinnedBuffer> allocate(std::size_t bytes);

  // Unmaps slabs with no buffer in them.
  void trim();

  std::size_t budget_bytes() const { return options_.budget_bytes; }
  std::size_t mapped_bytes() const;  // slabs held now (counts against the budget)
  std::size_t used_bytes() const;    // bytes in live buffers (rounded to the alignment)
  std::size_t slab_count() const;

 private:
  struct Slab {
    HostAllocation mem;
    std::size_t used = 0;
    std::map<std::size_t, std::size_t> free;  // offset -> length, coalesced
    std::size_t registered = 0;               // registrars that accepted it (in order)
  };
  explicit PinnedPool(const PinnedPoolOptions& o) : options_(o) {}
  void release(void* ptr, std::size_t reserved);
  bool carve(Slab& s, std::size_t bytes, std::size_t* offset);
  Status map_slab(std::size_t bytes, std::unique_ptr<Slab>* out);
  void unmap_slab(Slab& s);

  PinnedPoolOptions options_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Slab>> slabs_;
  std::size_t mapped_ = 0;
  std::size_t used_ = 0;
  friend class PinnedBuffer;
};

}  // namespace strata::io
