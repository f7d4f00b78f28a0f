// The offload engine: the runtime a trainer drives. It owns every byte of the
// model's training state (compute copies, fp32 masters, optimizer states, fp32
// gradient accumulators), places each on its home tier (device / host / NVMe)
// by the planner (runtime/planner.h), and moves it where the trainer needs it:
//
//   auto e = Engine::create({.config = cfg, .model = spec});   // plans, allocates, opens swap files
//   for (p : params) e->load_param(id, data, DType::kBF16);    // initial values (the full tensor)
//   for each optimizer step:
//     for each micro-batch m (last = m == accum - 1):
//       e->begin_micro_batch(last);
//       forward:  for g in groups:           v = e->acquire(g, s); compute(v.ptr[...]); e->release(g, s);
//       backward: for g in reversed groups:  v = e->acquire(g, s); compute grads;
//                                            for p in g: e->reduce_grad(p, grad, dtype, s);
//                                            e->release(g, s);
//     StepResult r = e->step();                                // norm, clipping, loss scale, optimizer
//
// Streams. acquire() returns device pointers and makes the caller's stream
// wait (an event, never a device-wide sync) on the upload. release() lets the
// buffers be reused once the caller's stream has passed that point.
// reduce_grad() reads the caller's gradient buffer on the engine's streams
// after the caller's stream reaches that point; the buffer may be freed or
// overwritten by work enqueued on the caller's stream after the call (the
// caller's stream waits until it was read: with strata.gradient_staging, the
// default on CUDA and with N ranks, only for a device-to-device copy into the
// engine's staging buffers, so backward is not held up by the download to
// host, nor by the N-rank reduce-scatter).
//
// Holds. acquire() of a group already held (a tied weight, a nested module)
// adds a hold and returns the same pointers, which stay put until the last
// hold is released; every release names its stream, and the buffers are
// reused only once every stream that released passed its release. Distinct
// groups held at once: up to strata.held_groups (device buffers are planned
// for that many plus the prefetched ones). strata.debug_poison_released fills
// a gathered group's buffer with NaN at its last release, so a view kept past
// release reads NaN instead of another group's weights (device-homed groups
// are the weights themselves and are never poisoned).
//
// Prefetch. The acquires between two step() calls form the "order". The first
// step records it; later steps upload the next groups of the recorded order
// (NVMe -> pinned staging -> device) while the current one computes, within
// strata.prefetch_depth groups and strata.prefetch_bytes. An acquire that
// differs from the recorded order is detected (stats().order_changes, logged
// once): prefetched groups that are not asked for are dropped and the new
// order is recorded. It may cost speed, never correctness.
//
// Gradients. reduce_grad(p) copies the gradient device -> pinned (download
// stream) and accumulates it in fp32 into p's gradient shard (home: host or
// NVMe; the device tier accumulates with a kernel). The first micro-batch of
// a step writes float(g), later ones add float(g): the same arithmetic on
// every tier, so results do not depend on placement. A parameter reduced
// twice in one micro-batch is an error.
//
// step(). Gradients are averaged over the micro-batches of the step
// (multiplied by 1/micro_batches) and unscaled by the fp16 loss scale; then
//   1. the global L2 norm and inf/NaN check over every gradient shard;
//   2. fp16 dynamic loss scaling: a non-finite gradient skips the step
//      (nothing changes but the scale, which drops by 2 after `hysteresis`
//      overflows; it doubles after `loss_scale_window` clean steps);
//      without fp16 a non-finite gradient also skips the step (reported);
//   3. clipping by gradient_clipping: coefficient min(1, clip / (norm + 1e-6))
//      (DeepSpeed's and torch.nn.utils.clip_grad_norm_'s formula);
//   4. the optimizer over every shard: NVMe-resident state streams through
//      the pinned ring of runtime/nvme_optimizer.h (read k+1 | update k |
//      write k-1) and the updated compute copy is produced in the same pass
//      and written to its home (a device-homed one uploaded from the ring,
//      chunk by chunk, on a stream of its own; with overlap_backward it is
//      rebuilt from the master after the pass, once backward is done).
//      Masters, states and gradients live on host or NVMe: a plan that puts
//      them on the device is refused (no device-side optimizer in the engine yet).
// The gradient accumulators then count as empty.
//
// Pipelined step (strata.pipelined_step, default on; one rank, no
// overlap_backward). step() does 1-3 and returns; 4 runs on the optimizer
// thread, group by group in group order, while the trainer computes the
// next forward: acquire(g) (its upload, or a device-homed group itself) and
// reduce_grad of g's parameters wait for g's update, and every other call
// that reads or writes state waits for all of them. The same arithmetic in
// the same order: bit-identical to the synchronous step. An update that
// fails after step() returned is reported by the next call that meets it
// (acquire, reduce_grad, step, synchronize, read/save/load calls) and leaves
// the engine refusing steps and saves until load_checkpoint, as a failed
// synchronous step does. synchronize() waits for it explicitly.
//
// Overlap with backward (strata.overlap_backward, opt-in). On the last
// micro-batch, a group's optimizer update starts as soon as every parameter
// of that group has been reduced, on the engine's optimizer thread, while the
// trainer computes the backward of earlier groups. Because the global norm is
// not known yet, clipping uses the previous step's norm (the first step is
// not clipped) and fp16 dynamic loss scaling is refused at create() (an
// overflow found after some groups were updated could not skip the step). A
// group whose gradients are non-finite is not updated (reported in
// StepResult). step() then waits for the remaining groups and reports.
// Documented in docs/engine.md; results differ from the non-overlapped mode
// only when clipping is on.
//
// Memory. create() allocates everything a step needs: device buffers come
// from the device backend's budgeted pool, pinned staging and the optimizer
// ring from one pinned pool, host tiers from huge-page host memory, NVMe
// tiers from one SwapStore. acquire/release/reduce_grad/step allocate nothing
// once the first step has run (stats().hot_path_allocs counts them).
//
// Sharding and ranks (ZeRO stage 3; 1-2 below). Every parameter is split into
// world_size shards (model_spec.h's shard_range: rank r owns elements
// [r*padded, r*padded + size)); this rank keeps only its shard of the compute
// copy, master, optimizer states and gradient, each on its home tier. With a
// communicator of N > 1 ranks (EngineOptions::comm):
//   - acquire() all-gathers the group's compute copies into the device buffer
//     (this rank's shard is uploaded, then an in-place all-gather on the
//     upload stream); once an acquire order is recorded (after the first
//     step), the first hold of group k also enqueues the gathers of the next
//     strata.prefetch_depth - 1 groups of the order, so the gather of k+1 runs
//     while the trainer computes k (stats().gathers_ahead counts them). A
//     group is gathered once per upload: an acquire that finds it still in
//     its device buffer (the last groups of forward when backward starts)
//     uses it without a new all-gather (stats().gathers_reused). Which
//     gathers are enqueued, and when, follows from the calls alone (the
//     acquires' first holds, releases, steps), never from the timing of the
//     uploads, so every rank gathers in the same order; an acquire order that
//     changes on every rank at once is followed (gathers enqueued ahead for the
//     old order are not counted as ahead; their groups use them if still in a
//     buffer, else gather again);
//   - reduce_grad() reduce-scatters the gradient: the sum over ranks, in rank
//     order (comm/communicator.h), of each rank's fp32 gradient lands in this
//     rank's shard and is accumulated there as one micro-batch of a 1-rank
//     run would be; step() averages over micro-batches x world_size. The
//     gradient is first packed into the engine's send buffers (planned: one
//     per gradient piece of the largest group), so the caller's stream waits
//     for the packs only and backward runs on while the reduce-scatters drain;
//   - step() sums the per-group squares of every rank (rank order) for the
//     global norm, so clipping and the inf/NaN skip agree on every rank;
//   - checkpoints are written by every rank into one directory (a token from
//     rank 0, then rank 0 commits once every rank finished its shard) and
//     load on any world size (another one is resharded: each rank reads the
//     saved shards that overlap its new one, checksums verified);
//   - gather_param() assembles a whole parameter (export).
// Every rank must make the same calls in the same order (acquire's first
// holds, reduce_grad, step, save/load, gather_param: collectives; releases
// and load_param/load_state too with stage 3, since they decide which
// device buffers are reused and so which gathers run ahead).
// A rank that stops making them makes the others fail after the
// communicator's timeout (kUnavailable naming the peer). With N ranks and
// micro-batches of b sequences, the step equals a 1-rank step of N
// micro-batches (rank order) of b sequences: bit-identical when each rank
// runs one micro-batch per step and clipping does not engage (the norm's
// per-rank partial sums are added in another order than one rank's, so the
// clipping coefficient may differ in the last bits). ZeRO stages 1 and 2
// (zero_optimization.stage < 3) keep the compute copy whole on every rank
// (host or device tier; NVMe refused): acquire() uploads it without a
// collective, load_param() writes it whole, and step() and load_checkpoint()
// end with an all-gather of the updated shards into every rank's copy. Stage
// 2 reduce-scatters every micro-batch's gradient; stage 1 sums each rank's
// micro-batches whole on its device (fp32, the parameters' numel x 4 bytes,
// planned as Plan::local_grad_bytes) and reduce-scatters that sum once, in
// step(): 1/k of stage 2's gradient traffic with k micro-batches per rank.
// Stage 1's sum is (rank 0's micro-batches summed) + (rank 1's) + ..., so
// with more than one micro-batch per rank it differs from the 1-rank run of
// the same micro-batches (summed one by one) in the last bits. On the
// CUDA backend (an NCCL communicator; never run on GPUs yet) stages 1-2 need
// every compute copy on the device (NCCL moves device memory): the plan
// must place them there (kOutOfBudget otherwise). Not with N > 1 yet: stage
// 0, overlap_backward.
//
// Thread-safety: one thread drives an engine (all calls below, except
// stats() and trace_*(), which any thread may call). Calls block only where
// documented.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "device/device_backend.h"
#include "runtime/config.h"
#include "runtime/model_spec.h"
#include "runtime/planner.h"

namespace strata::io {
class FaultInjector;
}
namespace strata::comm {
class Communicator;
}

namespace strata {

class CheckpointWriter;
class Tracer;

using ParamId = uint32_t;  // index into ModelSpec::params
using GroupId = uint32_t;  // index into ModelSpec::group_names()

struct EngineOptions {
  Config config;    // tiers, budgets, optimizer, fp16, clipping, accumulation, trace
  ModelSpec model;  // parameters in the order the trainer first uses them
  // The device to run on; not owned, must outlive the engine. Null: the
  // engine creates one (config.strata / DeviceBackendOptions defaults: auto).
  DeviceBackend* device = nullptr;
  DeviceBackendKind device_kind = DeviceBackendKind::kAuto;  // when `device` is null
  int device_ordinal = 0;                                    // CUDA device, when `device` is null
  // Budgets the config leaves at 0 ("detect") are measured: free device
  // memory (the backend's budget), MemAvailable, statvfs free space.
  // Set here to override the measurement (tests): 0 keeps detection.
  PlanBudgets budgets_override;
  // Tests: every NVMe I/O of the engine passes through this fault injector
  // (io/fault_injection.h), so each one can be made to fail in turn.
  std::shared_ptr<io::FaultInjector> io_faults;
  // The ranks of a data-parallel job (comm/communicator.h); not owned, must
  // outlive the engine and be over the same device backend. Null: one rank.
  // Its world size and rank become the plan's (config strata.world_size /
  // strata.rank, when set, must agree).
  comm::Communicator* comm = nullptr;
};

// What the trainer gets from acquire(): one device pointer per parameter of
// the group (the whole, gathered parameter in its compute dtype), in the
// order the parameters appear in ModelSpec. Valid until release().
struct GroupView {
  GroupId group = 0;
  std::span<void* const> ptr;
  std::span<const ParamId> params;
};

struct StepResult {
  int64_t step = 0;            // optimizer steps taken so far (skipped ones not counted)
  bool skipped = false;        // non-finite gradients: nothing was updated
  uint32_t skipped_groups = 0; // overlap mode: groups left alone for non-finite gradients
  double grad_norm = 0;        // global L2 norm of the averaged, unscaled gradients (before clipping)
  double clip_coef = 1;        // applied clipping coefficient (1: none)
  double loss_scale = 1;       // the scale to use for the next micro-batches
  double lr = 0;               // learning rate used
  double seconds = 0;          // wall time of step() (overlap: of the part not hidden)
};

struct EngineStats {
  // State bytes placed per tier (this rank): index Tier value (kDevice, kHost, kNvme).
  uint64_t tier_bytes[4] = {};
  uint64_t device_buffer_bytes = 0;  // device bytes held for gathered groups now
  uint64_t pinned_bytes = 0;         // pinned pool bytes in use
  // Cumulative traffic since create(). NVMe: every read and write the engine
  // submits (uploads, gradients, the optimizer step's chunks, checkpoints).
  uint64_t nvme_read_bytes = 0, nvme_write_bytes = 0;
  uint64_t h2d_bytes = 0, d2h_bytes = 0;
  uint64_t acquires = 0, prefetch_hits = 0, prefetch_misses = 0, order_changes = 0;
  // Chunks of the optimizer step whose masters and moments were read ahead
  // (after the previous step, during forward and backward) and used.
  uint64_t optimizer_read_ahead = 0;
  // Bytes this rank sent to its peers in collectives (all-gathers in acquire,
  // reduce-scatters in reduce_grad, the norm, checkpoints, gather_param):
  // (N-1)/N of each collective's buffer for every all-gather/reduce-scatter.
  uint64_t comm_bytes = 0;
  // Stage 3: acquires whose all-gather was enqueued ahead, by the acquire
  // before, and acquires that found their group still gathered in its device
  // buffer and gathered nothing (see Sharding).
  uint64_t gathers_ahead = 0;
  uint64_t gathers_reused = 0;
  // Uploads of NVMe-homed compute copies taken from the optimizer pass's
  // output instead of read back from NVMe (the next forward's first groups).
  uint64_t optimizer_handoffs = 0;
  uint64_t hot_path_allocs = 0;  // allocations after the first step (should stay 0)
  int64_t steps = 0, skipped_steps = 0;
};

class Engine {
 public:
  // Validates the config and model, resolves "detect" budgets, plans tiers
  // (make_plan: a plan that cannot fit is kOutOfBudget with the planner's
  // message), creates the device backend (if not given), I/O engine, swap
  // store, pinned pool, tracer, and allocates every tier's storage (zeroed).
  // Errors: kInvalidArgument (bad config or model; overlap_backward with
  // fp16 dynamic scaling), kUnavailable (world_size > 1 without a communicator, or with
  // what N ranks do not support yet (see Sharding); master/optimizer
  // states/gradients planned onto the device; bias_correction false; a model
  // mixing bf16 and fp16; a requested backend), kOutOfBudget, I/O and
  // allocation errors naming what failed.
  static Result<std::unique_ptr<Engine>> create(const EngineOptions& options);
  ~Engine();  // waits for in-flight work, closes the trace, removes swap files
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // ---- the model
  const ModelSpec& model() const;
  const Plan& plan() const;
  DeviceBackend& device();
  uint32_t group_count() const;
  const std::string& group_name(GroupId g) const;
  std::span<const ParamId> group_params(GroupId g) const;
  Result<ParamId> find_param(std::string_view name) const;
  Result<GroupId> find_group(std::string_view name) const;

  // Sets parameter p's value from the full (unsharded) tensor `src` of
  // numel elements in `dtype` (host memory): this rank's shard becomes the
  // fp32 master and the compute copy (rounded to the compute dtype).
  // Blocking. Errors: kInvalidArgument (id, dtype), I/O errors.
  Status load_param(ParamId p, const void* src, DType dtype);
  // Copies parameter p (this rank's shard of the fp32 master; world_size 1:
  // the whole tensor) to host memory `dst` in `dtype`. Blocking.
  Status read_param(ParamId p, void* dst, DType dtype);
  // The whole parameter p (numel elements, fp32 master or a frozen one's
  // compute copy) into host memory `dst` in `dtype`, assembled from every
  // rank's shard: a collective (every rank calls it, same p, same order).
  // One rank: read_param. Blocking.
  Status gather_param(ParamId p, void* dst, DType dtype);
  // data[0, bytes) (host memory) on every rank = rank root's: a collective
  // over the engine's communicator (every rank, same bytes and root, same
  // point). What the ranks must agree on and may not: load_param keeps each
  // rank's own src, so initial values made differently on each rank (an
  // unseeded init) are broadcast from one rank first. One rank: nothing.
  // Blocking. kInvalidArgument: root out of range, null data with bytes.
  Status broadcast(void* data, size_t bytes, uint32_t root);
  // The optimizer state of trainable parameter p as fp32 (AdamW: k = 0 the
  // first moment exp_avg, k = 1 the second exp_avg_sq; torch's names), this
  // rank's shard: read to convert a checkpoint to PyTorch/DeepSpeed, loaded to
  // convert one in (bf16 states round to nearest even). Blocking.
  // kInvalidArgument: a frozen parameter, k beyond the optimizer's states.
  Status read_state(ParamId p, int k, float* dst);
  Status load_state(ParamId p, int k, const float* src);
  // Trainable p's own count of optimizer steps that updated it (torch's
  // per-parameter state['step']; its bias correction): the engine's step
  // count unless p was reduced by no micro-batch of some steps. set: to
  // convert a torch/DeepSpeed state in (0..steps()). kInvalidArgument: frozen.
  Result<int64_t> param_steps(ParamId p) const;
  Status set_param_steps(ParamId p, int64_t steps);

  // ---- the training protocol (one driving thread)
  // Marks the start of a micro-batch; `last` says it ends the accumulation
  // (overlap mode starts group updates only then). Errors: kInvalidArgument
  // when called while groups are still acquired; a pending asynchronous error.
  // The number of begin_micro_batch() calls since the last step is the
  // micro-batch count the gradients are averaged over (a reduce_grad without
  // any begins one implicitly).
  Status begin_micro_batch(bool last);
  // Blocks only when the group's upload needs a staging buffer that is still
  // in use (the pipeline's back-pressure). A held group gets one more hold
  // (see Holds). Errors: kInvalidArgument (group id, held kMaxHolds times),
  // I/O errors of the upload, kOutOfBudget (a group larger than the device
  // buffer budget: the message says by how much; more than held_groups
  // distinct groups held).
  Result<GroupView> acquire(GroupId g, DeviceStream* stream);
  Status release(GroupId g, DeviceStream* stream);  // drops one hold
  static constexpr uint32_t kMaxHolds = 1u << 16;  // more is a missing release
  // The device pointer of `p` in its held group (what acquire gave).
  // kInvalidArgument when the group is not held.
  Result<void*> held_ptr(ParamId p) const;
  // `grad` is a device buffer of the parameter's full numel in `dtype`
  // (fp32/bf16/fp16); on the host backend any host memory (the caller's, e.g.
  // a torch CPU tensor). Asynchronous (see the header comment). A failed call
  // changes nothing and may be retried, unless the error says part of the
  // gradient was accumulated: then step() refuses until discard_step().
  Status reduce_grad(ParamId p, const void* grad, DType dtype, DeviceStream* stream);
  // Abandons the step in progress (an exception in the caller's forward or
  // backward, a torn reduce_grad): releases every acquired group on `stream`,
  // waits for the gradient work in flight and forgets every gradient of this
  // step (all its micro-batches); the weights and optimizer state are as
  // after the last step(). kInvalidArgument when overlap_backward already
  // started updating a group of this step (the weights moved: reload a
  // checkpoint instead).
  Status discard_step(DeviceStream* stream);
  // Blocks until the engine's background work is done (a pipelined step's
  // updates, uploads, gradient accumulation) and returns the first error of
  // it: a pipelined step's failure (the engine then refuses steps and saves
  // until load_checkpoint), or an I/O error of a prefetch.
  Status synchronize();
  // Whether step() runs pipelined (strata.pipelined_step and the conditions
  // in the header comment).
  bool pipelined_step() const;
  // Blocks until the step is decided (all gradients reduced; with
  // strata.pipelined_step the updates continue in the background, see the
  // header comment; without it, all tiers updated).
  // lr < 0 keeps the current lr (the last lr >= 0 given here or to set_lr; at
  // first config.optimizer.lr). Errors: the first asynchronous error of
  // the step's work (I/O: with tensor and chunk), kInvalidArgument (groups
  // still acquired). lr >= 0 also becomes the current lr (see set_lr).
  // Overlap mode: the groups were updated with the lr current when the last
  // micro-batch began (set_lr before it); an lr given here applies from the
  // next step. After an error the engine refuses further steps unless
  // the state was reloaded from a checkpoint (the NVMe state may be torn).
  Result<StepResult> step(double lr = -1);
  // Sets the learning rate for the following updates (schedulers; needed in
  // overlap mode, where updates start before step()). Negative: ignored.
  void set_lr(double lr);
  // Gives learning-rate group `lr_group` (ParamSpec::lr_group) its own lr for
  // the following updates (a torch scheduler driving several param_groups);
  // lr < 0: the group follows the step's lr again. Like set_lr, set it before
  // the last micro-batch begins in overlap mode. Not part of checkpoints: the
  // caller's scheduler sets it every step. Errors: kInvalidArgument (no
  // parameter has that lr_group, or lr not finite).
  Status set_group_lr(uint32_t lr_group, double lr);
  // The group's own Adam betas from the next update on (< 0: the config's);
  // what a scheduler cycling momentum sets per step. Not checkpointed.
  Status set_group_betas(uint32_t lr_group, double beta1, double beta2);
  // The current loss scale (fp16 dynamic scaling; 1 otherwise): multiply the
  // loss by it before backward.
  double loss_scale() const;
  int64_t step_count() const;

  // ---- checkpoints (docs/checkpoints.md): the full training state
  // Saves compute copies, masters, optimizer states, step, loss-scale state
  // and the caller's `extra_json` (e.g. the data position) to `dir`
  // atomically (staging dir, fsync, rename). NVMe-resident state is streamed
  // file to file. Blocking; only between steps.
  Status save_checkpoint(const std::string& dir, std::string_view extra_json = {});
  // Verifies every checksum first, then restores; the model (names, shapes,
  // dtypes) must match. *extra_json receives the caller's state.
  // Errors: kCorrupt naming the damaged file, kInvalidArgument on a model
  // mismatch (naming the parameter), kNotFound.
  Status load_checkpoint(const std::string& dir, std::string* extra_json = nullptr);

  // ---- observability
  EngineStats stats() const;
  Tracer* tracer();  // null when config.strata.trace is ""
  // Caller compute spans on the trace (category "compute"); no-ops without a
  // trace. Spans nest; `name` must stay valid until its trace_end().
  void trace_begin(const char* name);
  void trace_end();

  struct Impl;  // internal (runtime/engine/engine_impl.h)

 private:
  // One rank's part of a checkpoint (engine/checkpointing.cpp). `keep` null:
  // one rank, committed here; else finished and handed back for N ranks.
  Status save_shard(const std::string& dir, std::string_view extra_json, const std::string& token,
                    std::unique_ptr<CheckpointWriter>* keep = nullptr);
  Status load_shard(const std::string& dir, std::string* extra_json);
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
