// Large aligned host allocations, and the hook that page-locks them.
//
// alloc_host() maps anonymous memory aligned to 2 MiB and asks the kernel for
// transparent huge pages (madvise(MADV_HUGEPAGE)); on these machines huge
// pages were worth up to 40% to memory-bound loops. Memory is returned zeroed.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "common/status.h"

namespace strata {

inline constexpr std::size_t kHugePageSize = std::size_t{2} << 20;
// Larger requests fail with kOutOfMemory (and cannot wrap when rounded up).
inline constexpr std::size_t kMaxHostAllocation = std::size_t{1} << 60;

struct HostAllocation {
  void* ptr = nullptr;
  std::size_t bytes = 0;        // as asked
  std::size_t mapped_bytes = 0; // rounded up to the mapping granularity
  bool huge_pages = false;      // madvise(MADV_HUGEPAGE) accepted
};

// Allocates `bytes` (> 0) aligned to at least `alignment` (a power of two up
// to 2 MiB). huge_pages=false skips the madvise (for comparisons).
// Errors: kInvalidArgument for bad sizes, kOutOfMemory when mmap refuses or
// bytes > kMaxHostAllocation.
Result<HostAllocation> alloc_host(std::size_t bytes, std::size_t alignment = kHugePageSize,
                                  bool huge_pages = true);
void free_host(const HostAllocation& a);

// Bytes the kernel says it can give without swapping (MemAvailable in
// /proc/meminfo); 0 when unknown. For "detect" budgets and sanity checks.
uint64_t host_memory_available();

// Owning RAII wrapper over alloc_host for arrays of trivially copyable T.
template <typename T>
class HostArray {
 public:
  HostArray() = default;
  static Result<HostArray> create(std::size_t count, bool huge_pages = true) {
    if (count > kMaxHostAllocation / sizeof(T))
      return Status(StatusCode::kOutOfMemory, "HostArray: " + std::to_string(count) + " elements of " +
                                                  std::to_string(sizeof(T)) +
                                                  " bytes is more than any machine can map");
    auto a = alloc_host(count ? count * sizeof(T) : sizeof(T), kHugePageSize, huge_pages);
    if (!a.ok()) return a.status();
    HostArray h;
    h.alloc_ = a.value();
    h.count_ = count;
    return h;
  }
  HostArray(HostArray&& o) noexcept : alloc_(o.alloc_), count_(o.count_) { o.alloc_ = {}; o.count_ = 0; }
  HostArray& operator=(HostArray&& o) noexcept {
    if (this != &o) { reset(); alloc_ = o.alloc_; count_ = o.count_; o.alloc_ = {}; o.count_ = 0; }
    return *this;
  }
  HostArray(const HostArray&) = delete;
  HostArray& operator=(const HostArray&) = delete;
  ~HostArray() { reset(); }
  void reset() { if (alloc_.ptr) free_host(alloc_); alloc_ = {}; count_ = 0; }

  T* data() { return static_cast<T*>(alloc_.ptr); }
  const T* data() const { return static_cast<const T*>(alloc_.ptr); }
  std::size_t size() const { return count_; }
  T& operator[](std::size_t i) { return data()[i]; }
  const T& operator[](std::size_t i) const { return data()[i]; }
  bool huge_pages() const { return alloc_.huge_pages; }

 private:
  HostAllocation alloc_;
  std::size_t count_ = 0;
};

// Page-locks host memory for a device backend so that device copies from it
// are asynchronous (cudaHostRegister under CUDA). The pinned pool calls it on
// every slab it maps; without a device backend there is none and memory stays
// ordinary. Implementations must be thread-safe.
class HostMemoryRegistrar {
 public:
  virtual ~HostMemoryRegistrar() = default;
  virtual const char* name() const = 0;
  // Errors: kOutOfMemory / kPermission when the driver refuses (RLIMIT_MEMLOCK).
  virtual Status register_memory(void* ptr, std::size_t bytes) = 0;
  virtual void unregister_memory(void* ptr) = 0;
};

}  // namespace strata
