#include "common/host_memory.h"

#include <sys/mman.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdint>
#include <string>

namespace strata {

Result<HostAllocation> alloc_host(std::size_t bytes, std::size_t alignment, bool huge_pages) {
  if (bytes == 0) return Status(StatusCode::kInvalidArgument, "alloc_host: zero bytes");
  if (alignment == 0 || (alignment & (alignment - 1)) || alignment > kHugePageSize)
    return Status(StatusCode::kInvalidArgument,
                  "alloc_host: alignment " + std::to_string(alignment) + " is not a power of two <= 2 MiB");
  // Refuse sizes that would wrap when rounded up below (above 2^60 bytes).
  if (bytes > kMaxHostAllocation)
    return Status(StatusCode::kOutOfMemory,
                  "alloc_host: " + std::to_string(bytes) + " bytes is more than any machine can map");
  // mmap gives page alignment; over-map by one huge page and trim both ends so
  // the region starts on a 2 MiB boundary (THP can then back all of it).
  const std::size_t page = 4096;
  std::size_t rounded = (bytes + page - 1) / page * page;
  bool big = huge_pages && rounded >= kHugePageSize;
  std::size_t align = big ? kHugePageSize : std::max(alignment, page);
  if (big) rounded = (rounded + kHugePageSize - 1) / kHugePageSize * kHugePageSize;
  std::size_t span = rounded + (align > page ? align : 0);
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED)
    return Status::from_errno(errno, "alloc_host: mmap of " + std::to_string(span) + " bytes failed");
  auto base = reinterpret_cast<std::uintptr_t>(raw);
  std::uintptr_t start = (base + align - 1) & ~(static_cast<std::uintptr_t>(align) - 1);
  if (start > base) munmap(raw, start - base);
  std::uintptr_t end = start + rounded;
  std::uintptr_t map_end = base + span;
  if (map_end > end) munmap(reinterpret_cast<void*>(end), map_end - end);

  HostAllocation a;
  a.ptr = reinterpret_cast<void*>(start);
  a.bytes = bytes;
  a.mapped_bytes = rounded;
  if (big) a.huge_pages = madvise(a.ptr, rounded, MADV_HUGEPAGE) == 0;
  return a;
}

void free_host(const HostAllocation& a) {
  if (a.ptr) munmap(a.ptr, a.mapped_bytes);
}

uint64_t host_memory_available() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char line[256];
  uint64_t kib = 0;
  while (std::fgets(line, sizeof line, f) != nullptr)
    if (std::sscanf(line, "MemAvailable: %" SCNu64 " kB", &kib) == 1) break;
  std::fclose(f);
  return kib * 1024;
}

}  // namespace strata
