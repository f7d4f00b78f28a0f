// Registry: what the engine's state is and where each byte of it lives.
//
// Owns: the config, model and plan; every parameter's shard and its arrays
// (compute copy, fp32 master, two optimizer states, fp32 gradient accumulator)
// with their home tier and storage (the host arena, the pinned arena of host
// compute copies, the device blocks of device-homed compute copies, the swap
// store's tensors); the groups; the shared services the parts borrow (the
// device backend, the tracer, the I/O engine, the swap store, the pinned pool,
// the upload stream) and the traffic counters.
// Thread: built by create() on the creating thread; afterwards the layout is
// read-only and any thread may read it. The array helpers run on the driving
// thread while the engine is idle (they use the upload stream and borrowed
// bounce buffers).
// Must not: run work of its own or keep per-step state; the pinned pool is
// created here but its buffers belong to the parts that allocate them.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/host_memory.h"
#include "comm/communicator.h"
#include "comm/host_collectives.h"
#include "io/io_engine.h"
#include "io/pinned_pool.h"
#include "io/swap_store.h"
#include "runtime/engine.h"
#include "runtime/nvme_optimizer.h"
#include "runtime/trace.h"

namespace strata::engine {

inline uint64_t round_up(uint64_t v, uint64_t a) {
  return (v + a - 1) / a * a;
}

// One array of one parameter's shard on its home tier.
struct ArrayLoc {
  Tier tier = Tier::kAuto;  // kDevice, kHost or kNvme once allocated
  void* ptr = nullptr;      // kHost: host memory; kDevice: device memory
  io::SwapTensor swap;      // kNvme
  Placement placement() const {
    if (tier == Tier::kNvme) return Placement::in_swap(swap);
    return Placement::in_host(ptr);
  }
};

struct ParamState {
  std::string name;
  GroupId group = 0;
  uint64_t numel = 0;
  DType dtype = DType::kBF16;  // compute dtype
  bool weight_decay = true;    // ParamSpec::weight_decay
  bool trainable = true;       // ParamSpec::trainable: false = frozen, compute copy only
  int64_t updates = 0;         // optimizer steps that updated it (its bias-correction count)
  uint32_t lr_group = 0;       // ParamSpec::lr_group
  ShardRange shard;
  ArrayLoc compute, master, state[2], grad;  // frozen: master/state/grad unplaced (tier kAuto)
  bool refresh_from_master = false;  // device-homed with overlap_backward: rebuilt from the master in step()
  // Stages 1-2 with N ranks (Registry::replicated): the whole parameter in
  // compute dtype, every rank's padded shard at rank * shard.padded (host or
  // device tier); `compute` is then this rank's slot in it. Null otherwise.
  void* replica = nullptr;
};

struct GroupInfo {
  std::string name;
  std::vector<ParamId> params;
  Tier compute_tier = Tier::kAuto;
  // Device-homed groups: recorded by release(); whoever rewrites the compute
  // copy on the upload stream waits on it first.
  DeviceEvent* release_event = nullptr;
};

// Cumulative traffic (relaxed atomics; stats() may read them on any thread).
struct TrafficCounters {
  std::atomic<uint64_t> nvme_read{0}, nvme_write{0}, h2d{0}, d2h{0}, comm{0};
};

// The pinned buffers every part asks for, so the pool is sized (and checked
// against strata.pinned_memory) once, with one message naming each.
struct PinnedNeeds {
  unsigned ring = 0;           // optimizer ring buffers (stepper)
  uint64_t ring_slot = 0;      // bytes each
  uint32_t staging = 0;        // upload staging buffers (uploader)
  uint64_t staging_bytes = 0;  // bytes each
  uint32_t pieces = 0;         // gradient pieces + accumulation scratch (gradient path)
  uint64_t piece_bytes = 0;    // bytes each
};

// Two pinned buffers of `elems` elements of 4 bytes, borrowed from the
// gradient path while it is idle, for conversions between tiers.
struct Bounce {
  float* f32 = nullptr;
  void* compute = nullptr;
  uint64_t elems = 0;
};

struct Registry {
  EngineOptions options;
  Config& cfg = options.config;
  Plan plan;
  DType out_dtype = DType::kBF16;  // the compute dtype the optimizer writes
  // Every NVMe transfer starts at a multiple of this many elements of its
  // array (optimizer chunks, gradient pieces, bounce pieces; uploads read
  // whole tensors): a power of two, 2048..32768, dividing the optimizer
  // chunk. The swap store's checksum block is io_quantum x 2 bytes, so no
  // transfer splits a block of any array (2- or 4-byte elements).
  uint64_t io_quantum = 2048;
  std::vector<std::string> group_names;
  std::vector<GroupInfo> groups;
  std::vector<ParamState> params;

  std::unique_ptr<DeviceBackend> owned_device;
  DeviceBackend* dev = nullptr;
  // The data-parallel ranks (EngineOptions::comm; null: one rank). Collectives
  // are enqueued from the driving thread only, in program order.
  comm::Communicator* comm = nullptr;
  uint32_t world = 1, rank = 0;
  // ZeRO stage 1 or 2 with N ranks: parameters whole on every rank
  // (ParamState::replica), all-gathered after each step and checkpoint load
  // (gather_replicas) instead of in every acquire (stage 3).
  bool replicated = false;
  // ZeRO stage 1 with N ranks: gradients summed whole on each rank's device,
  // reduce-scattered once per step (GradPath::reduce_deferred).
  bool defer_reduce = false;
  std::unique_ptr<Tracer> tracer;
  uint32_t trace_h2d = 0, trace_d2h = 0;  // tracer tracks of the two streams
  std::unique_ptr<io::IoEngine> io;
  std::unique_ptr<io::SwapStore> store;
  std::unique_ptr<io::PinnedPool> pool;
  // Host tier arena and device-resident compute copies.
  HostAllocation host_arena;
  HostAllocation pinned_arena;  // host compute copies with offload_param.pin_memory
  std::vector<void*> device_blocks;
  // Uploads and the array helpers' device copies.
  DeviceStream* upload = nullptr;

  TrafficCounters traffic;
  // Swap-store writes made by write_array (counted once each is complete):
  // the optimizer's read-ahead of masters and moments is dropped when this
  // changed after it was issued (set_param, set_optimizer_state; a
  // checkpoint load drops it in Stepper::restore).
  std::atomic<uint64_t> array_writes{0};
  // Pipelined step (Stepper::wait_group): blocks until group g's optimizer
  // update is applied; its error if it failed. Empty when step() is
  // synchronous. Set once by Engine::Impl::init; called by the uploader
  // thread before it reads a compute copy.
  std::function<Status(GroupId)> await_update;
  // Whether the optimizer's output of group g was copied for the uploader
  // (Uploader::plan_handoff), blocking while that copy is still to be made.
  // Set once by Engine::Impl::init; called by the uploader thread.
  std::function<bool(GroupId)> await_handoff;

  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;
  ~Registry();

  // Validates config and model, creates the device (if not given), resolves
  // budgets, plans, opens the tracer and I/O engine, lists params and groups.
  Status init(const EngineOptions& opts);
  // The swap store, the arenas, the upload stream; every array placed
  // (zeroed) on its home tier; the release events of the groups.
  Status allocate_arrays();
  // Checks `needs` against the pinned budget and creates the pool.
  Status create_pinned_pool(const PinnedNeeds& needs);
  // The largest trainable parameter's padded shard (at least 1): what the
  // optimizer ring is sized by (the gradient pieces: Plan::grad_piece_elems).
  uint64_t max_shard_elems() const;

  // ---- array helpers (driving thread, engine idle)
  Status read_array(const ArrayLoc& a, size_t esz, uint64_t off, uint64_t count, void* dst);
  Status write_array(const ArrayLoc& a, size_t esz, uint64_t off, uint64_t count, const void* src);
  // The compute copy rebuilt from the master (ParamState::refresh_from_master).
  Status refresh_compute(ParamId p, const Bounce& b);
  // The upload stream waits for the last release of p's (device-homed) group.
  Status wait_released(ParamId p);
  Status sync_io(io::IoHandle h, bool write, uint64_t bytes);
  // ---- collectives (driving thread; world > 1)
  // Collectives on the upload stream, waited for (engine idle).
  Status blocking_collective(const std::function<Status(DeviceStream*)>& op);
  // Blocking collectives on host memory (comm/host_collectives.h: through
  // comm_staging, device memory as NCCL needs) on the upload stream; the
  // bytes sent count into traffic.comm.
  static constexpr size_t kCommStagingBytes = 64u << 10;
  comm::HostStaging comm_staging;  // N ranks: allocated with the arrays
  Status host_all_gather(const void* mine, void* all, size_t bytes_per_rank);
  Status host_broadcast(void* data, size_t bytes, int root = 0);
  // Stages 1-2: every rank's shard of each listed parameter's compute copy
  // into every rank's replica (in place; engine idle). All ranks pass the
  // same list.
  Status gather_replicas(const std::vector<ParamId>& ids);
  // copy_async with h2d/d2h trace events timed by host functions (only when tracing).
  Status traced_copy(void* dst, const void* src, size_t bytes, CopyKind kind, DeviceStream* s);

 private:
  Status set_ranks();
  Result<std::string> agree_run_name();
  Status validate();
  Status make_plan_for_budgets();
  Result<uint32_t> ranks_on_this_host();
  void list_params_and_groups();
};

// fp32 -> compute dtype (cpu_optim::convert's round to nearest even; fp32 copies).
// The other way is widen_to_f32 (common/float_convert.h).
Status narrow_from_f32(const float* src, DType dtype, uint64_t n, void* dst);

}  // namespace strata::engine
