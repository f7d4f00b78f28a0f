// The uploader: acquire/release with the device-slot cache, prefetch by
// recorded order, and the uploader thread (see uploader.h).
#include "runtime/engine/uploader.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"
#include "common/threads.h"
#include "common/units.h"

namespace strata::engine {

// ---------------------------------------------------------------- creation

void Uploader::lay_out() {
  // Group layouts: device slots (256-byte aligned params) and upload staging (4 KiB aligned).
  groups_.resize(reg_.groups.size());
  handoff_stage_.assign(reg_.groups.size(), -1);
  handoff_dst_.assign(reg_.params.size(), nullptr);
  for (GroupId gi = 0; gi < reg_.groups.size(); ++gi) {
    const GroupInfo& info = reg_.groups[gi];
    GroupSlots& g = groups_[gi];
    g.view.resize(info.params.size());
    // N ranks, stage 3: a parameter's slot space holds every rank's padded
    // shard (the all-gather's layout, rank r at r * padded); staging holds
    // this rank's. Stages 1-2 upload the whole replica like one rank.
    const bool gathered = gathers();
    for (ParamId id : info.params) {
      const ParamState& p = reg_.params[id];
      const size_t esz = dtype_size(p.dtype);
      g.slot_offset.push_back(g.slot_bytes);
      g.slot_bytes += round_up(std::max<uint64_t>((gathered ? p.shard.padded * reg_.world : p.numel) * esz, 1), 256);
      g.staging_offset.push_back(g.staging_bytes);
      g.staging_bytes += round_up(std::max<uint64_t>(p.shard.size() * esz, 1), 4096);
    }
    g.direct = info.compute_tier == Tier::kDevice && !gathered;
    if (g.direct) {
      for (size_t i = 0; i < info.params.size(); ++i) {
        const ParamState& p = reg_.params[info.params[i]];
        g.view[i] = p.replica ? p.replica : p.compute.ptr;
      }
    } else {
      any_off_device_ = true;
      slot_bytes_ = std::max(slot_bytes_, g.slot_bytes);
    }
    if (info.compute_tier == Tier::kNvme) {
      any_nvme_compute_ = true;
      max_staging_ = std::max(max_staging_, g.staging_bytes);
    }
  }
}

// ---------------------------------------------------------------- hand-offs

bool Uploader::handoff_eligible(GroupId g) const {
  const GroupInfo& info = reg_.groups[g];
  if (info.compute_tier != Tier::kNvme || groups_[g].direct || reg_.world != 1) return false;
  for (ParamId id : info.params) {
    const ParamState& p = reg_.params[id];
    if (!p.trainable || p.refresh_from_master || p.compute.tier != Tier::kNvme) return false;
  }
  return true;
}

const std::vector<GroupId>& Uploader::plan_handoff() {
  drop_handoffs();
  if (!reg_.cfg.strata.optimizer_handoff || staging_.size() < 2 || reg_.plan.prefetch_groups == 0)
    return handoff_groups_;
  // The order end_step() will record: this step's acquires (the recorded
  // order when there were none). The first positions are what it prefetches.
  const std::vector<GroupId>& next = current_.empty() ? order_ : current_;
  const size_t positions = std::min<size_t>(reg_.plan.prefetch_groups, staging_.size() - 1);
  std::lock_guard<std::mutex> lock(mu_);
  int used = 0;
  for (size_t i = 0; i < next.size() && i < positions; ++i) {
    const GroupId g = next[i];
    if (handoff_stage_[g] >= 0 || !handoff_eligible(g)) continue;
    // Idle: its last copies are done; waited for anyway, as any reuse is.
    if (!reg_.dev->synchronize(staging_event_[used]).ok()) break;
    handoff_stage_[g] = used;
    staging_kept_for_[used] = static_cast<int>(g);
    char* base = static_cast<char*>(staging_[used].data());
    const GroupInfo& info = reg_.groups[g];
    for (size_t k = 0; k < info.params.size(); ++k) handoff_dst_[info.params[k]] = base + groups_[g].staging_offset[k];
    handoff_groups_.push_back(g);
    ++used;
  }
  handoff_writes_ = reg_.array_writes.load(std::memory_order_acquire);
  return handoff_groups_;
}

void Uploader::drop_handoffs() {
  std::lock_guard<std::mutex> lock(mu_);
  std::fill(handoff_stage_.begin(), handoff_stage_.end(), -1);
  std::fill(staging_kept_for_.begin(), staging_kept_for_.end(), -1);
  std::fill(handoff_dst_.begin(), handoff_dst_.end(), nullptr);
  handoff_groups_.clear();
}

uint32_t Uploader::staging_count() const {
  return any_nvme_compute_ ? 1 + reg_.plan.prefetch_groups : 0;
}

Status Uploader::allocate_staging() {
  const uint32_t nstaging = staging_count();
  for (uint32_t i = 0; i < nstaging; ++i) {
    STRATA_ASSIGN_OR_RETURN(auto buf, reg_.pool->allocate(max_staging_));
    staging_.push_back(std::move(buf));
    STRATA_ASSIGN_OR_RETURN(auto ev, reg_.dev->create_event());
    staging_event_.push_back(ev);
  }
  staging_kept_for_.assign(staging_.size(), -1);
  return {};
}

Status Uploader::allocate_slots() {
  // Device slots for gathered groups: one in use, `depth` prefetched, one more
  // to keep the last released group (backward starts with it).
  const uint32_t depth = reg_.plan.prefetch_groups, held = std::max<uint32_t>(reg_.plan.held_groups, 1);
  if (any_off_device_) {
    const uint32_t want = held + depth + 1;
    for (uint32_t i = 0; i < want; ++i) {
      auto d = reg_.dev->alloc(slot_bytes_);
      if (!d.ok()) {
        if (d.status().code() == StatusCode::kOutOfBudget && i >= held + depth) break;
        return d.status().with_context(fmt::format("engine: device buffer {} of {} for gathered groups ({} each)",
                                                   i + 1, want, format_bytes(slot_bytes_)));
      }
      Slot s;
      s.ptr = *d;
      slots_.push_back(s);  // before the events: the destructor frees ptr even if an event fails
      STRATA_ASSIGN_OR_RETURN(slots_.back().ready_event, reg_.dev->create_event());
      STRATA_ASSIGN_OR_RETURN(slots_.back().release_event, reg_.dev->create_event());
    }
  }
  if (gathers()) {
    // Stage 3: every rank keeps the same number of slots (the last one is
    // taken only where the budget allows), so that their slot decisions,
    // and with them their gathers, agree.
    uint64_t mine = slots_.size();
    std::vector<uint64_t> all(reg_.world);
    Status st = reg_.host_all_gather(&mine, all.data(), sizeof(mine));
    if (!st.ok()) return st.with_context("engine: agreeing on the device buffers for gathered groups");
    const uint64_t n = *std::min_element(all.begin(), all.end());
    while (slots_.size() > n) {
      free_slot(slots_.back());
      slots_.pop_back();
    }
  }
  size_t max_group_params = 0;
  for (const auto& g : reg_.groups) max_group_params = std::max(max_group_params, g.params.size());
  upload_handles_.reserve(max_group_params);
  keep_scratch_.reserve(reg_.plan.prefetch_groups + 1);
  return {};
}

void Uploader::free_slot(Slot& s) {
  reg_.dev->destroy_event(s.ready_event);
  reg_.dev->destroy_event(s.release_event);
  (void)reg_.dev->free(s.ptr);
}

Status Uploader::start() {
  return queue_.start("uploader", [this](const int& s) { upload_main(s); });
}

void Uploader::stop() {
  queue_.stop();
}

Uploader::~Uploader() {
  stop();
  staging_.clear();
  if (reg_.dev != nullptr) {
    for (auto& s : slots_) free_slot(s);
    for (auto* e : staging_event_) reg_.dev->destroy_event(e);
  }
}

// ---------------------------------------------------------------- the uploader thread

void Uploader::upload_main(int s) {
  Status st = run_guarded("engine: uploading a group", [&] { return upload_group(s); });
  {
    std::lock_guard<std::mutex> lock(mu_);
    slots_[s].error = st;
    slots_[s].enqueued = true;
  }
  slot_cv_.notify_all();
}

Status Uploader::upload_group(int si) {
  Slot& s = slots_[si];
  int gi, hand;
  {
    std::lock_guard<std::mutex> lock(mu_);
    gi = s.group;
    hand = handoff_stage_[gi];  // one upload takes a hand-off
    handoff_stage_[gi] = -1;
  }
  const GroupInfo& info = reg_.groups[gi];
  const GroupSlots& g = groups_[gi];
  // A hand-off: the optimizer's output, copied to the kept staging buffer
  // as the group was updated (nothing wrote the compute copy since).
  bool from_handoff = false;
  if (hand >= 0 && reg_.await_handoff) {
    TraceSpan wait(reg_.tracer.get(), "wait_update", trace_cat::kRuntime, {{"group", info.name.c_str()}});
    from_handoff =
        reg_.await_handoff(static_cast<GroupId>(gi)) && reg_.array_writes.load(std::memory_order_acquire) == handoff_writes_;
  }
  if (hand >= 0 && !from_handoff) {
    std::lock_guard<std::mutex> lock(mu_);
    staging_kept_for_[hand] = -1;
  }
  if (!from_handoff && reg_.await_update) {  // pipelined step: the compute copy is final once the group's update is
    TraceSpan wait(reg_.tracer.get(), "wait_update", trace_cat::kRuntime, {{"group", info.name.c_str()}});
    Status st = reg_.await_update(static_cast<GroupId>(gi));
    if (!st.ok())
      return st.with_context(fmt::format("engine: uploading group {}: its optimizer update failed", info.name));
  }
  TraceSpan span(reg_.tracer.get(), "upload_group", trace_cat::kRuntime, {{"group", info.name.c_str()}});
  char* stage = nullptr;
  size_t stage_index = 0;
  if (from_handoff) {
    stage_index = static_cast<size_t>(hand);
    stage = static_cast<char*>(staging_[stage_index].data());
    handoffs_.fetch_add(1, std::memory_order_relaxed);
  } else if (info.compute_tier == Tier::kNvme) {
    {
      // Not one kept for a hand-off still to come (plan_handoff keeps one free).
      std::lock_guard<std::mutex> lock(mu_);
      do {
        stage_index = next_staging_++ % staging_.size();
      } while (staging_kept_for_[stage_index] >= 0);
    }
    // The staging buffer is free once the copies out of it (last use) are done.
    STRATA_RETURN_IF_ERROR(reg_.dev->synchronize(staging_event_[stage_index]));
    stage = static_cast<char*>(staging_[stage_index].data());
    const uint64_t t0 = Tracer::now_ns();
    uint64_t total = 0;
    std::vector<io::IoHandle>& handles = upload_handles_;
    handles.clear();
    try {
      for (size_t i = 0; i < info.params.size(); ++i) {
        const ParamState& p = reg_.params[info.params[i]];
        const uint64_t len = p.compute.swap.bytes;  // the whole shard (<= its staging space)
        handles.push_back(reg_.store->read(p.compute.swap, 0, len, stage + g.staging_offset[i]));
        total += len;
      }
    } catch (const std::bad_alloc&) {
      // The reads already submitted land in the staging buffer: not reused before they have.
      for (io::IoHandle& h : handles) (void)h.wait();
      handles.clear();
      throw;
    }
    Status first;
    for (size_t i = 0; i < handles.size(); ++i) {
      Status st = handles[i].wait();
      if (!st.ok() && first.ok())
        first = st.with_context(
            fmt::format("engine: reading the compute copy of {} from NVMe", reg_.params[info.params[i]].name));
    }
    handles.clear();
    STRATA_RETURN_IF_ERROR(first);
    reg_.traffic.nvme_read += total;
    if (reg_.tracer) reg_.tracer->complete("nvme_read", trace_cat::kIo, t0, Tracer::now_ns(), {{"bytes", total}});
  }
  STRATA_RETURN_IF_ERROR(reg_.dev->wait(reg_.upload, s.release_event));
  // This rank's shard (one rank: the whole parameter) to its place in the
  // slot; stage 3 gathers the rest in acquire(). A replica (stages 1-2) is
  // the whole parameter.
  for (size_t i = 0; i < info.params.size(); ++i) {
    const ParamState& p = reg_.params[info.params[i]];
    const size_t esz = dtype_size(p.dtype);
    const uint64_t bytes = (p.replica ? p.numel : p.shard.size()) * esz;
    if (bytes == 0) continue;
    const void* src = stage ? stage + g.staging_offset[i] : p.replica ? p.replica : p.compute.ptr;
    char* dst = static_cast<char*>(s.ptr) + g.slot_offset[i] + (p.replica ? 0 : p.shard.begin * esz);
    if (info.compute_tier == Tier::kDevice) {
      STRATA_RETURN_IF_ERROR(reg_.dev->copy_async(dst, src, bytes, CopyKind::kDeviceToDevice, reg_.upload));
      continue;
    }
    STRATA_RETURN_IF_ERROR(reg_.traced_copy(dst, src, bytes, CopyKind::kHostToDevice, reg_.upload));
    reg_.traffic.h2d += bytes;
  }
  if (stage) STRATA_RETURN_IF_ERROR(reg_.dev->record(staging_event_[stage_index], reg_.upload));
  if (from_handoff) {  // the buffer goes back to the others (its copies are ordered by its event)
    std::lock_guard<std::mutex> lock(mu_);
    staging_kept_for_[stage_index] = -1;
  }
  return reg_.dev->record(s.ready_event, reg_.upload);
}

// ---------------------------------------------------------------- slots and prefetch

// A slot to upload into: free first, else the least recently used cached
// group outside `keep` (the prefetch window). A slot whose upload is still
// queued is passed over with one rank; with stage 3 it is a candidate too
// (start_upload waits for its upload), so the choice depends only on the
// sequence of calls, the same on every rank. Caller holds mu_.
int Uploader::find_victim(const std::vector<GroupId>& keep) {
  int best = -1;
  for (int i = 0; i < static_cast<int>(slots_.size()); ++i) {
    const Slot& s = slots_[i];
    if (s.state == Slot::kFree) return i;
    if (s.state != Slot::kCached || (!s.enqueued && !gathers())) continue;
    if (std::find(keep.begin(), keep.end(), static_cast<GroupId>(s.group)) != keep.end()) continue;
    if (best < 0 || s.lru < slots_[best].lru) best = i;
  }
  return best;
}

// Caller holds mu_ through `lock`. Puts group g into a slot and queues its upload.
Status Uploader::start_upload(GroupId g, bool prefetch, std::unique_lock<std::mutex>& lock) {
  std::vector<GroupId>& keep = keep_scratch_;
  keep.clear();
  if (!recording_ && !order_broken_) {
    const size_t pos = current_.size();
    for (size_t i = pos; i < order_.size() && i < pos + reg_.plan.prefetch_groups; ++i) keep.push_back(order_[i]);
  }
  keep.push_back(g);
  const int v = find_victim(keep);
  if (v < 0) {
    if (prefetch) return Status(StatusCode::kOutOfBudget, "no free device buffer");
    return Status(StatusCode::kOutOfBudget,
                  fmt::format("engine: acquire({}): all {} device buffers for gathered groups ({} each) are in use or "
                              "loading ({} group(s) held; strata.held_groups is {}); release a group first, or raise "
                              "strata.held_groups or the device budget",
                              reg_.groups[g].name, slots_.size(), format_bytes(slot_bytes_), acquired_count_,
                              reg_.plan.held_groups));
  }
  Slot& s = slots_[v];
  // Stage 3 (find_victim): the victim's queued upload goes first.
  if (s.state == Slot::kCached && !s.enqueued) slot_cv_.wait(lock, [&] { return s.enqueued; });
  if (s.group >= 0) groups_[s.group].slot = -1;
  s.group = static_cast<int>(g);
  s.state = Slot::kCached;
  s.enqueued = false;
  s.prefetched = prefetch;
  s.gathered_ahead = false;
  s.gathered = false;
  s.error = Status();
  s.lru = ++lru_clock_;
  groups_[g].slot = v;
  queue_.push(v);
  return {};
}

void Uploader::issue_prefetch() {
  if (recording_ || order_broken_ || reg_.plan.prefetch_groups == 0) return;
  const size_t pos = current_.size();
  std::unique_lock<std::mutex> lock(mu_);
  for (size_t i = pos; i < order_.size() && i < pos + reg_.plan.prefetch_groups; ++i) {
    const GroupId h = order_[i];
    if (groups_[h].direct || groups_[h].slot >= 0 || groups_[h].holds > 0) continue;
    if (!start_upload(h, true, lock).ok()) break;
  }
}

// Stage 3: the all-gathers of the groups that follow in the recorded order,
// up to one less than the prefetch depth, enqueued on the upload stream now,
// behind the gather of the group being acquired, so that the gather of group
// k+1 runs while the trainer computes group k. The last group of the window
// is left out: its shard upload was queued just now and reads behind this
// group's compute; the ones gathered here were queued by an earlier acquire.
// A gather follows its shard's upload on the stream, so this waits until the
// uploader thread has enqueued it. What is gathered depends on the order and
// the slots alone (the same on every rank), never on the uploader's
// progress. A group without a slot, in use, or whose upload failed is left
// to its acquire (which gathers it, or reports the failure).
void Uploader::gather_ahead() {
  const uint32_t depth = reg_.plan.prefetch_groups;
  if (!gathers() || recording_ || order_broken_ || depth < 2) return;
  const size_t pos = current_.size();
  for (size_t i = pos; i < order_.size() && i + 1 < pos + depth; ++i) {
    const GroupId h = order_[i];
    int si;
    {
      std::unique_lock<std::mutex> lock(mu_);
      si = groups_[h].slot;
      if (si < 0 || slots_[si].state == Slot::kInUse || slots_[si].gathered) continue;
      slot_cv_.wait(lock, [&] { return slots_[si].enqueued; });
      if (!slots_[si].error.ok()) continue;
    }
    // A failure to enqueue (a broken communicator) is the group's acquire's
    // to report: it gathers again and fails the same way.
    if (!gather(h, si).ok()) return;
    slots_[si].gathered_ahead = true;
  }
}

// The order broke: gathers enqueued ahead are not used (their groups'
// acquires gather again), since which of those slots survive now depends on
// the victim choices of a new order.
void Uploader::drop_gathers_ahead() {
  for (auto& s : slots_) s.gathered_ahead = false;
}

void Uploader::invalidate_slots() {
  clear_slots();
  drop_handoffs();
}

void Uploader::clear_slots() {
  // Queued or running uploads (prefetches issued at the end of the last
  // step) finish first: the uploader must not mark a slot "enqueued" after
  // the slot was handed to another group. Only this (driving) thread queues
  // uploads, so none can start between the wait and the lock.
  queue_.wait_idle();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& s : slots_) {
    s.gathered = false;
    if (s.state == Slot::kInUse) continue;
    if (s.group >= 0) groups_[s.group].slot = -1;
    s.group = -1;
    s.state = Slot::kFree;
    s.prefetched = false;
    s.gathered_ahead = false;
  }
}

void Uploader::end_step() {
  // Cached device copies are stale now (the hand-offs planned for this
  // step's update are kept); the acquires of this step become the order.
  clear_slots();
  if (!current_.empty()) {
    if (!recording_ && !order_broken_ && current_ != order_) ++order_changes_;
    if (recording_ || order_broken_ || current_ != order_) order_ = current_;
    recording_ = false;
  }
  order_broken_ = false;
  current_.clear();
  // The next step's first groups start uploading now (from the updated
  // compute copies), so its first acquire does not wait for them.
  issue_prefetch();
}

// ---------------------------------------------------------------- acquire / release

Result<GroupView> Uploader::acquire(GroupId gid, DeviceStream* stream) {
  const GroupInfo& info = reg_.groups[gid];
  GroupSlots& g = groups_[gid];
  ++acquires_;
  if (g.holds > 0) {
    // Held already (a tied weight, a nested module): the same pointers; this
    // stream waits for the upload too.
    if (!g.direct) {
      int si;
      {
        std::lock_guard<std::mutex> lock(mu_);
        si = g.slot;
      }
      STRATA_RETURN_IF_ERROR(reg_.dev->wait(stream, slots_[si].ready_event));
    }
    ++hits_;
    ++g.holds;
    return GroupView{gid, g.view, info.params};
  }
  // The order: compare with the recorded one.
  const size_t pos = current_.size();
  if (!recording_ && !order_broken_ && (pos >= order_.size() || order_[pos] != gid)) {
    order_broken_ = true;
    drop_gathers_ahead();
    ++order_changes_;
    if (!order_change_logged_) {
      order_change_logged_ = true;
      log_info(
          "engine: the acquire order changed (acquire #{} is {}, recorded {}); prefetch drops what was not "
          "asked for and records the new order (logged once)",
          pos + 1, info.name, pos < order_.size() ? reg_.groups[order_[pos]].name : std::string("nothing"));
    }
  }
  current_.push_back(gid);
  if (g.direct) {
    // Pipelined step: the optimizer writes the copy itself (and has waited
    // for its uploads) by the time the group's update is done.
    if (reg_.await_update) {
      TraceSpan wait(reg_.tracer.get(), "wait_update", trace_cat::kRuntime, {{"group", info.name.c_str()}});
      Status st = reg_.await_update(gid);
      if (!st.ok())
        return st.with_context(fmt::format("engine: acquire({}): its optimizer update failed", info.name));
    }
    g.holds = 1;
    g.last_release = nullptr;
    ++acquired_count_;
    return GroupView{gid, g.view, info.params};
  }
  int si;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (g.slot >= 0) {
      ++hits_;
    } else {
      ++misses_;
      STRATA_RETURN_IF_ERROR(start_upload(gid, false, lock));
    }
    si = g.slot;
    slots_[si].state = Slot::kInUse;
  }
  issue_prefetch();
  Status err;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!slots_[si].enqueued) {  // the trainer waits for the upload (a prefetch miss, or one still running)
      TraceSpan wait(reg_.tracer.get(), "acquire_wait", trace_cat::kRuntime, {{"group", info.name.c_str()}});
      slot_cv_.wait(lock, [&] { return slots_[si].enqueued; });
    }
    err = slots_[si].error;
    if (!err.ok()) {
      slots_[si].state = Slot::kFree;
      slots_[si].group = -1;
      slots_[si].gathered_ahead = false;
      slots_[si].gathered = false;
      g.slot = -1;
    }
  }
  if (!err.ok()) return err.with_context(fmt::format("engine: acquire({})", info.name));
  if (gathers()) {
    if (slots_[si].gathered_ahead) {  // enqueued by the acquire before (ready_event covers it)
      slots_[si].gathered_ahead = false;
      ++gathers_ahead_;
    } else if (slots_[si].gathered) {  // a hit: the slot still holds the gathered group
      ++gathers_reused_;
    } else {
      STRATA_RETURN_IF_ERROR(gather(gid, si));
    }
    gather_ahead();
  }
  STRATA_RETURN_IF_ERROR(reg_.dev->wait(stream, slots_[si].ready_event));
  for (size_t i = 0; i < info.params.size(); ++i) g.view[i] = static_cast<char*>(slots_[si].ptr) + g.slot_offset[i];
  g.holds = 1;
  g.last_release = nullptr;
  ++acquired_count_;
  return GroupView{gid, g.view, info.params};
}

// N ranks, stage 3: every rank's shard into the slot, an in-place all-gather per
// parameter on the upload stream behind the upload of this rank's shard.
// Enqueued on the driving thread by the group's first hold or, ahead of it,
// by the acquire before (gather_ahead); once per upload of the slot: a hit on
// a slot that still holds the gathered group (Slot::gathered) uses it as it
// is (DeepSpeed's stage3_max_reuse_distance, here as far as the slots
// reach). Which slots survive follows from the calls alone (find_victim), so
// every rank skips the same gathers.
Status Uploader::gather(GroupId gid, int si) {
  const GroupInfo& info = reg_.groups[gid];
  const GroupSlots& g = groups_[gid];
  const uint64_t peers = reg_.world - 1;
  for (size_t i = 0; i < info.params.size(); ++i) {
    const ParamState& p = reg_.params[info.params[i]];
    const uint64_t per_rank = p.shard.padded * dtype_size(p.dtype);
    char* base = static_cast<char*>(slots_[si].ptr) + g.slot_offset[i];
    Status st = reg_.comm->all_gather(base + p.shard.begin * dtype_size(p.dtype), base, per_rank, reg_.upload);
    if (!st.ok()) return st.with_context(fmt::format("engine: acquire({}): gathering {}", info.name, p.name));
    reg_.traffic.comm += per_rank * peers;
  }
  slots_[si].gathered = true;
  return reg_.dev->record(slots_[si].ready_event, reg_.upload);
}

// Every release records the group's release event on its stream; when the
// holds used several streams, each release first makes its stream wait for
// the previous release's point, so the last record covers them all.
Status Uploader::release(GroupId gid, DeviceStream* stream) {
  GroupSlots& g = groups_[gid];
  const bool device_home = g.direct;
  DeviceEvent* ev;
  if (device_home) {
    ev = reg_.groups[gid].release_event;
  } else {
    std::lock_guard<std::mutex> lock(mu_);
    ev = slots_[g.slot].release_event;
  }
  if (g.last_release != nullptr && g.last_release != stream) STRATA_RETURN_IF_ERROR(reg_.dev->wait(stream, ev));
  const bool last = g.holds == 1;
  Status st;
  if (last && !device_home && reg_.cfg.strata.debug_poison_released) {
    // Debug: whatever still reads the released buffer reads NaN (0xFF bytes
    // are NaN in fp32, bf16 and fp16); the slot is not kept as a cache.
    std::lock_guard<std::mutex> lock(mu_);
    Slot& s = slots_[g.slot];
    st = reg_.dev->fill_bytes_async(s.ptr, slot_bytes_, 0xFF, stream);
  }
  if (st.ok()) st = reg_.dev->record(ev, stream);
  g.last_release = stream;
  --g.holds;
  if (!last) return st;
  --acquired_count_;
  if (device_home) return st;
  std::lock_guard<std::mutex> lock(mu_);
  Slot& s = slots_[g.slot];
  s.prefetched = false;
  s.lru = ++lru_clock_;
  if (reg_.cfg.strata.debug_poison_released) {
    s.state = Slot::kFree;
    s.group = -1;
    g.slot = -1;
  } else {
    s.state = Slot::kCached;
  }
  return st;
}

}  // namespace strata::engine
