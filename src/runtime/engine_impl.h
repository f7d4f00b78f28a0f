// Engine internals shared by engine.cpp (create, parameters, acquire/release,
// prefetch), engine_grads.cpp (reduce_grad, step, overlap) and
// engine_checkpoint.cpp. Not a public header.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "io/io_engine.h"
#include "io/pinned_pool.h"
#include "io/swap_store.h"
#include "runtime/engine.h"
#include "runtime/nvme_optimizer.h"
#include "runtime/trace.h"

namespace strata {

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
  ShardRange shard;
  ArrayLoc compute, master, state[2], grad;
  // Per step (driving thread).
  bool grad_written = false;       // a micro-batch of this step wrote the accumulator
  int64_t reduced_micro = -1;      // micro-batch index of the last reduce_grad
  bool refresh_from_master = false;  // compute copy rebuilt from the master after a step
};

struct GroupState {
  std::string name;
  std::vector<ParamId> params;
  Tier compute_tier = Tier::kAuto;
  std::vector<uint64_t> slot_offset;     // per param: offset in a device slot
  std::vector<uint64_t> staging_offset;  // per param: offset in an upload staging buffer
  uint64_t slot_bytes = 0, staging_bytes = 0;
  std::vector<void*> view;          // pointers handed out by acquire()
  int slot = -1;                    // device slot holding the group (off-device homes)
  bool acquired = false;
  DeviceEvent* release_event = nullptr;  // device-homed groups: last release
  std::vector<OptimizerTensor> tensors;  // for the NvmeOptimizer, names borrowed from ParamState
  // Overlap mode, per step.
  uint32_t reduced_last = 0;  // params reduced in the last micro-batch
  bool queued = false;        // handed to the optimizer thread
  bool updated = false;       // optimizer ran (or was skipped for non-finite grads)
  bool skipped = false;
  double sum_sq = 0;
  bool nonfinite = false;
};

struct DeviceSlot {
  void* ptr = nullptr;
  int group = -1;
  enum State { kFree, kLoading, kCached, kInUse } state = kFree;
  bool enqueued = false;  // the upload is on the upload stream (ready_event recorded)
  bool prefetched = false;
  uint64_t lru = 0;
  Status error;
  DeviceEvent* ready_event = nullptr;
  DeviceEvent* release_event = nullptr;
};

struct AccumJob {
  enum Kind { kAccum, kGroupDone } kind = kAccum;
  uint32_t slot = 0;  // download slot
  ParamId param = 0;
  GroupId group = 0;
  uint64_t offset = 0, count = 0;  // elements of the shard
  DType dtype = DType::kF32;
  bool first = false;
};

// DeepSpeed's DynamicLossScaler state.
struct LossScaler {
  bool dynamic = false;
  double scale = 1;
  int64_t iter = 0;
  int64_t last_overflow_iter = -1;
  int hysteresis = 1;  // remaining
};

struct Engine::Impl {
  EngineOptions options;
  Config& cfg = options.config;
  Plan plan;
  std::vector<std::string> group_names;
  std::vector<GroupState> groups;
  std::vector<ParamState> params;

  std::unique_ptr<DeviceBackend> owned_device;
  DeviceBackend* dev = nullptr;
  std::unique_ptr<Tracer> tracer;
  std::unique_ptr<io::IoEngine> io;
  std::unique_ptr<io::SwapStore> store;
  std::unique_ptr<io::PinnedPool> pool;
  std::unique_ptr<NvmeOptimizer> opt;
  cpu_optim::OptimizerConfig opt_config;
  DType out_dtype = DType::kBF16;

  // Host tier arena and device-resident compute copies.
  HostAllocation host_arena;
  HostAllocation pinned_arena;  // host compute copies with offload_param.pin_memory
  std::vector<void*> device_blocks;

  DeviceStream* upload = nullptr;
  DeviceStream* download = nullptr;
  DeviceEvent* ev_caller = nullptr;   // caller's stream point before a download
  DeviceEvent* ev_download = nullptr; // download done: the caller's stream waits
  DeviceEvent* ev_refresh = nullptr;

  // Device buffers for gathered groups.
  std::vector<DeviceSlot> slots;
  uint64_t slot_bytes = 0;
  uint64_t lru_clock = 0;
  // Upload staging (NVMe-homed compute copies).
  std::vector<io::PinnedBuffer> staging;
  std::vector<DeviceEvent*> staging_event;
  size_t next_staging = 0;  // uploader thread only

  // Download slots and scratch (elements of fp32 each).
  uint64_t piece_elems = 0;
  std::vector<io::PinnedBuffer> dl;
  std::vector<uint32_t> dl_free;  // guarded by mu
  io::PinnedBuffer scratch;       // accumulator thread: fp32 read-add-write

  // Threads: uploader, accumulator, optimizer (overlap mode).
  std::mutex mu;
  std::condition_variable cv;
  std::deque<int> upload_queue;  // slot indices
  // Scratch kept between calls so acquire and the uploader allocate nothing:
  std::vector<io::IoHandle> upload_handles;  // uploader thread only
  std::vector<GroupId> keep_scratch;         // start_upload, under mu
  std::deque<AccumJob> accum_queue;
  std::deque<GroupId> opt_queue;
  bool upload_busy = false, accum_busy = false, opt_busy = false;
  bool stopping = false;
  std::thread uploader, accumulator, optimizer_thread;
  Status async_error;  // first asynchronous error, returned at the next call (mu)

  // Protocol state (driving thread).
  int64_t micro_index = -1;  // micro-batches begun in this step, minus one
  bool last_micro = false;
  bool overlap_running = false;  // last micro-batch of an overlap step in progress
  uint32_t acquired_count = 0;
  bool broken = false;  // a step failed: refuse steps until load_checkpoint
  Status broken_status;
  int64_t steps = 0;
  std::atomic<int64_t> steps_atomic{0};  // mirror of steps for stats()
  double current_lr = 0;   // config lr, then the last set_lr()/step(lr)
  double overlap_lr = 0;   // lr of this overlap step's group updates
  LossScaler scaler;
  double prev_norm = -1;  // overlap clipping: the previous step's norm (< 0: none yet)
  double overlap_coef = 1, overlap_scale = 1;
  int64_t overlap_step = 0;
  bool first_step_done = false;

  // Prefetch order.
  std::vector<GroupId> order;    // recorded
  std::vector<GroupId> current;  // this step's acquires
  bool recording = true;         // no usable order yet
  bool order_broken = false;     // this step deviated
  bool order_change_logged = false;

  // Stats (relaxed atomics; stats() may run on any thread).
  std::atomic<uint64_t> nvme_read{0}, nvme_write{0}, h2d{0}, d2h{0};
  std::atomic<uint64_t> acquires{0}, hits{0}, misses{0}, order_changes{0}, hot_allocs{0};
  std::atomic<int64_t> skipped_steps{0};
  uint32_t trace_h2d = 0, trace_d2h = 0;
  std::mutex trace_mu;
  std::vector<uint64_t> trace_stack;  // trace_begin times (guarded by trace_mu)
  std::vector<const char*> trace_names;

  ~Impl();
  Status init();
  Status allocate_storage();
  void stop_threads();

  // Threads.
  void uploader_main();
  void accumulator_main();
  void optimizer_main();
  Status upload_group(int slot_index);
  Status accumulate(const AccumJob& j);
  void run_group_update(GroupId g);
  void set_async_error(const Status& st);
  Status take_async_error();
  Status wait_idle();  // downloads, accumulations, uploads and group updates done

  // Array helpers (driving thread, engine idle): chunked through `dl[0]`.
  Status read_array(const ArrayLoc& a, size_t esz, uint64_t off, uint64_t count, void* dst);
  Status write_array(const ArrayLoc& a, size_t esz, uint64_t off, uint64_t count, const void* src);
  Status refresh_compute(ParamId p);
  Status zero_grad(ParamId p);
  Status sync_io(io::IoHandle h, bool write, uint64_t bytes);

  // acquire helpers
  int find_victim(const std::vector<GroupId>& keep);
  Status start_upload(GroupId g, bool prefetch);
  void issue_prefetch();
  void invalidate_slots();

  // Step helpers.
  cpu_optim::OptimizerConfig optimizer_config(double lr, double grad_scale) const;
  Status group_stats(GroupId g, double scale);
  void scaler_update(bool overflow);
  Status traced_copy(void* dst, const void* src, size_t bytes, CopyKind kind, DeviceStream* s);
};

// fp32 -> compute dtype (cpu_optim::convert's round to nearest even; fp32 copies).
// The other way is widen_to_f32 (common/float_convert.h).
Status narrow_from_f32(const float* src, DType dtype, uint64_t n, void* dst);

}  // namespace strata
