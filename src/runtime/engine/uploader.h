// Uploader: the device copies of the groups the trainer acquires.
//
// Owns: the device slots for gathered (off-device) groups with their ready and
// release events and LRU cache, the pinned upload staging buffers of
// NVMe-homed compute copies, the acquire state of every group (view pointers,
// acquired flag, slot), the prefetch order (recorded and current), the
// acquire/hit/miss/order-change counters, and the uploader thread.
// Thread: acquire/release/prefetch/end_step run on the driving thread; the
// uploader thread runs upload_group(): the NVMe read of a compute copy into
// staging (waiting for the reads) and the host -> device copies on the upload
// stream. Slot state is guarded by mu_ (lock order: mu_, then the queue's).
// Borrows: the registry (groups, params, device, swap store, upload stream,
// tracer, traffic counters, the pinned pool for staging).
// Must not: touch masters, optimizer states or gradients; block acquire longer
// than until its upload is enqueued (a device-homed group: until its
// pipelined optimizer update is done).
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <vector>

#include "runtime/engine/registry.h"
#include "runtime/engine/work_queue.h"

namespace strata::engine {

class Uploader {
 public:
  explicit Uploader(Registry& reg) : reg_(reg) {}
  ~Uploader();
  Uploader(const Uploader&) = delete;
  Uploader& operator=(const Uploader&) = delete;

  // ---- create()
  // Per-group slot and staging layouts (after the registry placed the arrays).
  void lay_out();
  uint32_t staging_count() const;                          // pinned staging buffers wanted
  uint64_t staging_bytes() const { return max_staging_; }  // each
  Status allocate_staging();                               // from the registry's pool
  Status allocate_slots();  // device slots: held_groups in use, prefetch_groups prefetched, one cached
  Status start();
  void stop();  // finishes queued uploads, joins the thread

  // ---- driving thread
  bool acquired(GroupId g) const { return groups_[g].holds > 0; }
  uint32_t holds(GroupId g) const { return groups_[g].holds; }
  uint32_t acquired_count() const { return acquired_count_; }  // distinct groups held
  void* view(GroupId g, size_t i) const { return groups_[g].view[i]; }  // while held
  // The first hold records the acquire in the order, finds or uploads the
  // group's slot and queues prefetches; every hold makes `stream` wait for
  // the upload and returns the same pointers (stable while held).
  Result<GroupView> acquire(GroupId g, DeviceStream* stream);
  // Drops one hold once `stream` passes this point; the last one lets the
  // slot be reused (debug_poison_released: fills it with NaN bytes first).
  Status release(GroupId g, DeviceStream* stream);
  // Blocks until queued and running uploads are done.
  void wait_idle() { queue_.wait_idle(); }
  // Waits for uploads, then drops every slot not in use (compute copies changed).
  void invalidate_slots();
  // step(): the slots are stale; this step's acquires become the order; the
  // next step's first groups start uploading.
  void end_step();

  // ---- the optimizer's output handed to the next step's first uploads
  // step() (driving thread, uploader idle), before the optimizer pass: the
  // groups at the first prefetch positions of the next step's order (this
  // step's acquires, which end_step() records) whose compute copies live on
  // NVMe get a staging buffer each, kept for them; the pass copies its
  // output there as it updates them (Stepper::expect_handoff), and their
  // uploads take it instead of reading back what the pass writes: one NVMe
  // read less per group and step, and the upload waits for the group's
  // update, not its write-back. Returns the groups; handoff_dst() gives the
  // buffer of each parameter (null: none).
  const std::vector<GroupId>& plan_handoff();
  const std::vector<void*>& handoff_dst() const { return handoff_dst_; }
  // Driving thread, no upload queued: forgets the hand-offs (the compute
  // copies changed: set_param, a checkpoint, a failed step).
  void drop_handoffs();

  // ---- stats (any thread)
  uint64_t device_buffer_bytes() const { return slots_.size() * slot_bytes_; }
  uint64_t acquires() const { return acquires_.load(std::memory_order_relaxed); }
  uint64_t hits() const { return hits_.load(std::memory_order_relaxed); }
  uint64_t misses() const { return misses_.load(std::memory_order_relaxed); }
  uint64_t order_changes() const { return order_changes_.load(std::memory_order_relaxed); }
  // Stage 3: acquires whose all-gather was enqueued ahead, by an earlier
  // acquire of the step (never the step's first acquire), and used by it.
  uint64_t gathers_ahead() const { return gathers_ahead_.load(std::memory_order_relaxed); }
  uint64_t gathers_reused() const { return gathers_reused_.load(std::memory_order_relaxed); }
  // Uploads that took the optimizer's output (plan_handoff) instead of an NVMe read.
  uint64_t handoffs() const { return handoffs_.load(std::memory_order_relaxed); }

 private:
  struct Slot {
    void* ptr = nullptr;
    int group = -1;
    enum State { kFree, kLoading, kCached, kInUse } state = kFree;
    bool enqueued = false;  // the upload is on the upload stream (ready_event recorded)
    bool prefetched = false;
    // Stage 3: the group's all-gather is enqueued ahead of its acquire, which
    // has not consumed it yet (driving thread only).
    bool gathered_ahead = false;
    // Stage 3: a gather of the group into this slot has been enqueued since
    // its upload, so the slot holds the whole group and a hit needs no new
    // gather (driving thread only; cleared when the slot takes another group
    // and at every step, which changes the copies).
    bool gathered = false;
    uint64_t lru = 0;
    Status error;
    DeviceEvent* ready_event = nullptr;
    DeviceEvent* release_event = nullptr;
  };
  struct GroupSlots {
    std::vector<uint64_t> slot_offset;     // per param: offset in a device slot
    std::vector<uint64_t> staging_offset;  // per param: offset in an upload staging buffer
    uint64_t slot_bytes = 0, staging_bytes = 0;
    std::vector<void*> view;  // pointers handed out by acquire()
    int slot = -1;            // device slot holding the group (off-device homes; mu_)
    uint32_t holds = 0;       // acquires not yet released
    bool direct = false;      // device-homed, not gathered: the view is the compute copy (replica) itself
    DeviceStream* last_release = nullptr;  // stream of this hold's last release (joins streams)
  };

  Status gather(GroupId g, int slot);  // driving thread, N ranks (stage 3)
  void gather_ahead();                 // driving thread, stage 3: the next groups of the order
  void drop_gathers_ahead();           // driving thread: the order broke
  bool gathers() const { return reg_.world > 1 && !reg_.replicated; }
  void upload_main(int slot);                         // uploader thread
  Status upload_group(int slot);                      // uploader thread
  int find_victim(const std::vector<GroupId>& keep);  // mu_ held
  // mu_ held through `lock` (stage 3 may wait on slot_cv_ with it).
  Status start_upload(GroupId g, bool prefetch, std::unique_lock<std::mutex>& lock);
  void issue_prefetch();
  void free_slot(Slot& s);  // its events and device memory
  void clear_slots();       // invalidate_slots() without dropping the hand-offs
  bool handoff_eligible(GroupId g) const;

  Registry& reg_;
  std::vector<GroupSlots> groups_;
  uint32_t acquired_count_ = 0;

  std::mutex mu_;
  std::condition_variable slot_cv_;  // a slot's upload was enqueued (or failed)
  std::vector<Slot> slots_;
  uint64_t slot_bytes_ = 0;
  uint64_t lru_clock_ = 0;
  WorkQueue<int> queue_;  // slot indices to upload

  // Upload staging (NVMe-homed compute copies).
  uint64_t max_staging_ = 0;
  bool any_off_device_ = false, any_nvme_compute_ = false;
  std::vector<io::PinnedBuffer> staging_;
  std::vector<DeviceEvent*> staging_event_;
  size_t next_staging_ = 0;  // uploader thread only
  // Hand-offs (plan_handoff): per group its staging buffer, per staging
  // buffer the group it is kept for (-1: none; both mu_); per parameter
  // where the pass copies it; the array writes counted when planned (a
  // write since makes the upload read the store instead).
  std::vector<int> handoff_stage_;
  std::vector<int> staging_kept_for_;
  std::vector<GroupId> handoff_groups_;
  std::vector<void*> handoff_dst_;
  uint64_t handoff_writes_ = 0;
  // Scratch kept between calls so acquire and the uploader allocate nothing:
  std::vector<io::IoHandle> upload_handles_;  // uploader thread only
  std::vector<GroupId> keep_scratch_;         // start_upload, under mu_

  // Prefetch order (driving thread).
  std::vector<GroupId> order_;    // recorded
  std::vector<GroupId> current_;  // this step's acquires
  bool recording_ = true;         // no usable order yet
  bool order_broken_ = false;     // this step deviated
  bool order_change_logged_ = false;

  std::atomic<uint64_t> acquires_{0}, hits_{0}, misses_{0}, order_changes_{0}, gathers_ahead_{0},
      gathers_reused_{0}, handoffs_{0};
};

}  // namespace strata::engine
