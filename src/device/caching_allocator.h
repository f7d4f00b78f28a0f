// The device-memory pool shared by both backends: a caching allocator with
// size classes under a hard byte budget.
//
// Sizes are rounded up to a class (quarter steps between powers of two, at
// most 25% over; 2 MiB steps from 64 MiB up, so large buffers waste little
// budget). A freed block goes to a per-class cache and is handed out again
// for a request of the same class or one up to 25% smaller; the device is
// asked for memory (SlabSource::slab_alloc, e.g. cudaMalloc) only while the
// pool grows, so the steady state of a training loop makes no device
// allocations. The budget caps everything taken from the device: blocks in
// use, cached, and pending stream-ordered frees. When a new block would pass
// it, cached blocks are given back (largest first), then pending frees are
// waited for; only then is kOutOfBudget returned, with nothing leaked.
//
// Stream-ordered free: free(ptr, stream) records an event on the stream; the
// block is reusable once the event completes (checked without blocking on
// each alloc).
//
// Thread-safe (one mutex). The allocator calls the backend's event methods
// while holding its mutex, so those must never call back into it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "device/device_backend.h"

namespace strata {

// Where the pool's blocks come from. Implementations need not be thread-safe
// (the allocator serializes its calls).
class SlabSource {
 public:
  virtual ~SlabSource() = default;
  // Errors: kOutOfMemory when the device refuses.
  virtual Result<void*> slab_alloc(std::size_t bytes) = 0;
  virtual void slab_free(void* ptr, std::size_t bytes) = 0;
};

class CachingAllocator {
 public:
  // `events` provides the events for stream-ordered frees; `device` names the
  // device in messages ("host", "cuda:0").
  CachingAllocator(DeviceBackend& events, SlabSource& source, uint64_t budget, std::string device);
  // Gives every block back to the source. Blocks still handed out are a
  // caller leak: logged (warn) with their count and bytes, then freed.
  // Pending frees are waited for first.
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  Result<void*> alloc(std::size_t bytes);
  Status free(void* ptr, DeviceStream* after);
  DeviceMemoryStats stats() const;
  void trim();

  // True when [ptr, ptr+bytes) lies inside one live block's requested bytes
  // (the host backend checks every device-side range with this).
  bool contains(const void* ptr, std::size_t bytes) const;

  // The size class of a request (exposed for tests).
  static std::size_t size_class(std::size_t bytes);

 private:
  struct Block {
    std::size_t cls;        // bytes taken from the source
    std::size_t requested;  // bytes the caller asked for
  };
  struct Pending {
    void* ptr;
    std::size_t cls;
    DeviceEvent* event;
  };

  void reclaim_pending_locked(bool wait);
  bool release_cached_locked(std::size_t need);
  void release_all_cached_locked();

  DeviceBackend& events_;
  SlabSource& source_;
  const uint64_t budget_;
  const std::string device_;

  mutable std::mutex mu_;
  std::map<uintptr_t, Block> live_;           // by address, for contains()
  std::multimap<std::size_t, void*> cached_;  // by class
  std::deque<Pending> pending_;               // in free order
  std::vector<DeviceEvent*> spare_events_;
  DeviceMemoryStats stats_;
};

}  // namespace strata
