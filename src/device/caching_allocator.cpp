#include "device/caching_allocator.h"

#include <algorithm>

#include "common/log.h"
#include "common/units.h"

namespace strata {
namespace {

constexpr std::size_t kMinClass = 1024;
constexpr std::size_t kLargeFrom = std::size_t{64} << 20;
constexpr std::size_t kLargeStep = std::size_t{2} << 20;

std::string bytes_text(uint64_t b) {
  return format_bytes(b) + " (" + std::to_string(b) + " bytes)";
}

}  // namespace

std::size_t CachingAllocator::size_class(std::size_t bytes) {
  if (bytes <= kMinClass) return kMinClass;
  if (bytes >= kLargeFrom) return (bytes + kLargeStep - 1) / kLargeStep * kLargeStep;
  // Quarter steps between powers of two: for bytes in (2^k, 2^(k+1)] the step
  // is 2^(k-2), so the class is at most 25% above the request.
  std::size_t pow2 = std::size_t{1} << (63 - __builtin_clzll(static_cast<unsigned long long>(bytes - 1)));
  std::size_t step = pow2 / 4;
  return (bytes + step - 1) / step * step;
}

CachingAllocator::CachingAllocator(DeviceBackend& events, SlabSource& source, uint64_t budget, std::string device)
    : events_(events), source_(source), budget_(budget), device_(std::move(device)) {
  stats_.budget = budget;
}

CachingAllocator::~CachingAllocator() {
  std::lock_guard<std::mutex> lock(mu_);
  reclaim_pending_locked(/*wait=*/true);
  if (!live_.empty()) {
    uint64_t bytes = 0;
    for (auto& [addr, b] : live_) bytes += b.requested;
    log_warn("device memory on {}: {} blocks ({}) never freed; freeing them with the backend", device_, live_.size(),
             format_bytes(bytes));
    for (auto& [addr, b] : live_) source_.slab_free(reinterpret_cast<void*>(addr), b.cls);
    live_.clear();
  }
  release_all_cached_locked();
  for (DeviceEvent* e : spare_events_) events_.destroy_event(e);
}

void CachingAllocator::reclaim_pending_locked(bool wait) {
  // Frees on different streams complete in any order: scan them all.
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (wait) {
      // A failed stream skips its remaining work, so its event still
      // completes; the error belongs to the stream's owner, not to us.
      (void)events_.synchronize(it->event);
    } else {
      auto done = events_.query(it->event);
      if (done.ok() && !done.value()) {
        ++it;
        continue;
      }
    }
    cached_.emplace(it->cls, it->ptr);
    stats_.pending -= it->cls;
    stats_.cached += it->cls;
    spare_events_.push_back(it->event);
    it = pending_.erase(it);
  }
}

bool CachingAllocator::release_cached_locked(std::size_t need) {
  // Largest first: fewest device frees for the bytes needed.
  while (stats_.reserved + need > budget_ && !cached_.empty()) {
    auto it = std::prev(cached_.end());
    source_.slab_free(it->second, it->first);
    stats_.reserved -= it->first;
    stats_.cached -= it->first;
    ++stats_.slab_frees;
    cached_.erase(it);
  }
  return stats_.reserved + need <= budget_;
}

void CachingAllocator::release_all_cached_locked() {
  for (auto& [cls, ptr] : cached_) {
    source_.slab_free(ptr, cls);
    stats_.reserved -= cls;
    stats_.cached -= cls;
    ++stats_.slab_frees;
  }
  cached_.clear();
}

Result<void*> CachingAllocator::alloc(std::size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (bytes > (std::size_t{1} << 56))
    return Status(StatusCode::kInvalidArgument, "device allocation of " + std::to_string(bytes) + " bytes on " +
                                                    device_ + " is not a plausible size");
  const std::size_t cls = size_class(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  reclaim_pending_locked(/*wait=*/false);

  void* ptr = nullptr;
  std::size_t got = cls;
  auto take_cached = [&] {
    auto it = cached_.lower_bound(cls);
    if (it == cached_.end() || it->first > cls + cls / 4) return false;
    ptr = it->second;
    got = it->first;
    stats_.cached -= got;
    cached_.erase(it);
    return true;
  };
  if (!take_cached()) {
    if (!release_cached_locked(cls) && !pending_.empty()) {
      // Under pressure: wait for the stream-ordered frees, which may also
      // yield a block of the right class.
      reclaim_pending_locked(/*wait=*/true);
      if (!take_cached()) (void)release_cached_locked(cls);
    }
  }
  if (!ptr) {
    if (stats_.reserved + cls > budget_) {
      const uint64_t left = budget_ - std::min<uint64_t>(budget_, stats_.in_use);
      return Status(StatusCode::kOutOfBudget, "device memory budget exceeded on " + device_ + ": asked " +
                                                  bytes_text(bytes) + " (pool class " + format_bytes(cls) +
                                                  "), in use " + bytes_text(stats_.in_use) + ", budget " +
                                                  bytes_text(budget_) + ", left " + bytes_text(left));
    }
    auto slab = source_.slab_alloc(cls);
    if (!slab.ok()) {
      // The device is shorter than the budget says (other processes): drop
      // the cache and try once more before giving up.
      release_all_cached_locked();
      slab = source_.slab_alloc(cls);
      if (!slab.ok())
        return slab.status().with_context("device allocation of " + bytes_text(cls) + " on " + device_ + " (in use " +
                                          bytes_text(stats_.in_use) + ")");
    }
    ptr = slab.value();
    stats_.reserved += cls;
    stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved);
    ++stats_.slab_allocs;
  }
  live_.emplace(reinterpret_cast<uintptr_t>(ptr), Block{got, bytes});
  stats_.in_use += got;
  ++stats_.live_blocks;
  return ptr;
}

Status CachingAllocator::free(void* ptr, DeviceStream* after) {
  if (!ptr) return Status();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == live_.end())
    return Status(StatusCode::kInvalidArgument,
                  "free of a pointer that is not a live device allocation on " + device_ + " (double free?)");
  const std::size_t cls = it->second.cls;
  if (after) {
    DeviceEvent* ev = nullptr;
    if (!spare_events_.empty()) {
      ev = spare_events_.back();
      spare_events_.pop_back();
    } else {
      auto e = events_.create_event();
      if (!e.ok()) return e.status().with_context("stream-ordered free on " + device_);
      ev = e.value();
    }
    Status st = events_.record(ev, after);
    if (!st.ok()) {
      spare_events_.push_back(ev);
      return st.with_context("stream-ordered free on " + device_);
    }
    pending_.push_back(Pending{ptr, cls, ev});
    stats_.pending += cls;
  } else {
    cached_.emplace(cls, ptr);
    stats_.cached += cls;
  }
  live_.erase(it);
  stats_.in_use -= cls;
  --stats_.live_blocks;
  return Status();
}

DeviceMemoryStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CachingAllocator::trim() {
  std::lock_guard<std::mutex> lock(mu_);
  reclaim_pending_locked(/*wait=*/false);
  release_all_cached_locked();
}

bool CachingAllocator::contains(const void* ptr, std::size_t bytes) const {
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.upper_bound(p);
  if (it == live_.begin()) return false;
  --it;
  return p >= it->first && bytes <= it->second.requested && p - it->first <= it->second.requested - bytes;
}

}  // namespace strata
