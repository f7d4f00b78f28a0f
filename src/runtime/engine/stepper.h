// Stepper: what step() does to the accumulated gradients.
//
// Owns: the optimizer hyper-parameters and the NvmeOptimizer (its pinned
// ring and its read-ahead), the stream and ring events that upload the optimizer's output to
// device-homed compute copies, each group's optimizer tensors, the loss scaler, the step count,
// the learning rate, the previous step's norm (overlap clipping), the
// overlap-with-backward bookkeeping of every group, and the optimizer thread
// (overlap mode only) with its queue.
// Thread: update()/begin_overlap()/count_reduced() on the driving thread;
// run_group_update() on the optimizer thread for groups the accumulator hands
// over (queue_update, called on the accumulator thread), and on the driving
// thread in step() for groups that were not complete.
// Borrows: the registry (params, groups, swap store, pool, tracer, the array
// helpers for the compute-copy refresh), the engine's AsyncError, and bounce
// buffers from the gradient path (passed to update()).
// Must not: change the order of the norm's summation (each parameter's
// blocks in order, parameters in group order, groups in order) or of the
// per-group updates; touch device slots (the uploader drops them after the
// step); write a device-homed compute copy before its group's release event
// (the update's upload stream waits on it).
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>


#include "runtime/engine/async_error.h"
#include "runtime/engine/loss_scaler.h"
#include "runtime/engine/registry.h"
#include "runtime/engine/work_queue.h"

namespace strata::engine {

// A learning-rate group's own hyper-parameters; < 0: the step's lr, the
// config's betas.
struct GroupHyper {
  double lr = -1.0, beta1 = -1.0, beta2 = -1.0;
};

class Stepper {
 public:
  Stepper(Registry& reg, AsyncError& errors);
  ~Stepper();
  Stepper(const Stepper&) = delete;
  Stepper& operator=(const Stepper&) = delete;

  // ---- create()
  // Hyper-parameters, lr and loss scale from the config; the ring's size.
  void configure();
  unsigned ring_buffers() const { return ring_; }
  uint64_t ring_slot_bytes() const { return ring_slot_; }
  // The NvmeOptimizer (ring from the registry's pool) and the group tensors;
  // grad_sum_sq(p): the sum of squares of p's accumulated gradient (the
  // norm's part, GradPath::sum_sq).
  Status allocate(std::function<double(ParamId)> grad_sum_sq);
  // After the arrays are placed: whether step() runs pipelined (below).
  void plan_pipeline();
  Status start();     // the optimizer thread, with strata.overlap_backward or a pipelined step
  void stop();        // finishes queued group updates, joins the thread
  void wait_idle() { queue_.wait_idle(); }
  // Driving thread, engine idle: waits for the optimizer's read-ahead and
  // forgets it (before the state it read is replaced).
  void drop_read_ahead() {
    if (opt_) opt_->drop_prefetch();
  }
  // Driving thread, engine idle: waits until no read of the read-ahead is in
  // flight (it stays usable).
  void settle_read_ahead() {
    if (opt_) opt_->settle_prefetch();
  }
  // Any thread: chunks the optimizer took from its read-ahead (read_ahead()).
  uint64_t read_ahead_hits() const { return opt_ ? opt_->prefetch_hits() : 0; }

  // ---- overlap with backward
  // begin_micro_batch(last): fixes the scale, lr and clipping coefficient of
  // the step's group updates; `micro_batches` counts the step's micro-batches.
  void begin_overlap(int64_t micro_batches);
  bool update_started(GroupId g) const { return groups_[g].queued; }
  // One more parameter of g reduced in the last micro-batch; true (and the
  // group counts as queued) when that was its last one.
  bool count_reduced(GroupId g);
  // Accumulator thread: every gradient of g is in; update it.
  void queue_update(GroupId g) { queue_.push(g); }

  // ---- pipelined step (strata.pipelined_step; one rank, no overlap_backward)
  // step() computes the norm and the decision (the norm's squares are
  // already summed), then hands one pass over every group (step_all, which
  // also writes the compute copies, on the device too) to the optimizer
  // thread and returns: each group counts as updated as soon as its compute
  // copies are final (on the host or device: updated and uploaded, not
  // waiting for the master's and moments' write-back; in the swap store:
  // written back), so the update of group k runs while the trainer
  // computes the next forward of the groups before k. Exactly the same
  // arithmetic as the synchronous step. After the pass the optimizer reads
  // the next step's first chunks ahead (read_ahead()), during the next
  // forward and backward. Whoever touches a group's compute copy or gradient
  // first waits for its update: the uploader before reading the compute
  // copy, acquire of a device-homed group before handing it out, reduce_grad
  // before accumulating, everything else through wait_idle().
  bool pipelined() const { return pipelined_; }
  // Any thread: blocks while g's update is queued or running; the first
  // error of a pipelined update (sticky until restore(): the state is torn).
  Status wait_group(GroupId g);
  Status pipeline_error();

  // ---- the optimizer's output handed to the uploader (Uploader::plan_handoff)
  // Driving thread, engine idle, before update(): the pass also copies the
  // updated compute copies of `groups` to dst[param] (OptimizerTensor::
  // out_copy) as it updates them. A group whose every parameter is not in
  // the pass (one not reduced this step) or whose step is skipped gets none.
  void expect_handoff(const std::vector<GroupId>& groups, const std::vector<void*>& dst);
  // Any thread: blocks while g's copy is still to be made; whether it was
  // made (false: read the compute copy from where it lives, after
  // wait_group()).
  bool wait_handoff(GroupId g);

  // ---- step() (driving thread, engine idle)
  // The lr of this step (overlap: the one fixed by begin_overlap); lr >= 0
  // also becomes the current lr.
  double begin_step(bool overlap, double lr);
  // Norm, loss scaling, clipping and the optimizer over every group (which
  // writes every compute copy; overlap_backward: device-homed ones are
  // rebuilt from the masters after it). Fills r's norm, coefficient, skip fields.
  // Errors are the step's failure (the engine turns broken).
  // `reduced` (may be empty): which parameters a micro-batch of this step
  // reduced; the others are left alone (no update, no decay, moments kept),
  // as torch skips a parameter whose grad is None.
  Status update(bool overlap, double lr_used, int64_t micro_batches, const Bounce& bounce, StepResult& r,
                const std::function<bool(ParamId)>& reduced = {});
  // Publishes the step count; r.step and r.loss_scale.
  void finish_step(StepResult& r);

  void set_lr(double lr) {
    if (lr >= 0) current_lr_ = lr;
  }
  // Driving thread. lr < 0: the group follows the step's lr.
  Status set_group_lr(uint32_t lr_group, double lr);
  // Driving thread. beta < 0: the config's (a torch scheduler cycling
  // momentum sets them per step, e.g. DeepSpeed's OneCycle).
  Status set_group_betas(uint32_t lr_group, double beta1, double beta2);
  double loss_scale() const { return scaler_.scale; }
  int64_t steps() const { return steps_; }
  int64_t steps_published() const { return steps_atomic_.load(std::memory_order_relaxed); }
  int64_t skipped_steps() const { return skipped_steps_.load(std::memory_order_relaxed); }

  // ---- checkpoints
  const LossScaler& scaler() const { return scaler_; }
  double prev_norm() const { return prev_norm_; }
  double current_lr() const { return current_lr_; }
  const cpu_optim::OptimizerConfig& optimizer_config() const { return opt_config_; }
  // The restored state of a checkpoint at step `steps`.
  void restore(int64_t steps, const LossScaler& scaler, double prev_norm, double lr);

 private:
  struct GroupUpdate {
    std::vector<ParamId> ids;  // the group's trainable parameters, in order (the norm sums over these)
    // The same tensors split by (lr group, weight decay): the update runs once
    // per part, with that group's lr and weight_decay 0 for undecayed parts.
    struct Part {
      uint32_t lr_group = 0;
      bool decay = true;
      std::vector<OptimizerTensor> tensors;
      std::vector<ParamId> ids;  // the tensors' parameters, in the same order
    };
    std::vector<Part> parts;
    std::vector<OptimizerTensor> scratch;  // one part's tensors with their steps (no allocation per step)
    uint32_t trainable = 0;  // params that are not frozen (reduce_grad counts to this)
    // Overlap mode, per step.
    uint32_t reduced_last = 0;  // params reduced in the last micro-batch
    bool queued = false;        // handed to the optimizer thread
    bool updated = false;       // optimizer ran (or was skipped for non-finite grads)
    bool skipped = false;
    double sum_sq = 0;
    bool nonfinite = false;
  };

  cpu_optim::OptimizerConfig optimizer_config(double lr, double grad_scale) const;
  // c with a part's own hyper-parameters: its lr group's lr and betas when
  // set (from `group_hp`), weight_decay 0 for an undecayed part.
  static cpu_optim::OptimizerConfig part_config(const cpu_optim::OptimizerConfig& c, const GroupUpdate::Part& part,
                                                const std::vector<GroupHyper>& group_hp);
  // The optimizer over group g's tensors, part by part (overlap_backward:
  // groups are complete one at a time, in backward's order).
  Status step_group(GroupId g, const cpu_optim::OptimizerConfig& c, int64_t step, const std::vector<GroupHyper>& group_hp,
                    const std::function<bool(ParamId)>& reduced = {});
  // Synchronous and pipelined steps: one pass of the optimizer over every
  // group's tensors in group order (each part with its own
  // hyper-parameters), so the ring's reads run ahead across group
  // boundaries instead of filling and draining once per group.
  // group_done(g) (optional) hears, in order, that group g's compute copies
  // are final (NvmeOptimizer's TensorsDone); it runs under the optimizer's lock. The
  // update counts of this step's parameters are already advanced
  // (count_updates).
  Status step_all(const cpu_optim::OptimizerConfig& c, int64_t step, const std::vector<GroupHyper>& group_hp,
                  const std::function<bool(ParamId)>& reduced, const std::function<void(GroupId)>& group_done);
  void count_updates(const std::function<bool(ParamId)>& reduced);
  // After a complete pass (not with overlap_backward, whose groups come in
  // backward's order): the optimizer reads the first chunks of the next
  // pass ahead, during the next forward and backward. Dropped by step_all
  // when a write_array came in between (Registry::array_writes).
  void read_ahead();
  Status queue_pipeline(const cpu_optim::OptimizerConfig& c, const std::function<bool(ParamId)>& reduced);
  // Hand-offs still expected become failed (no pass made them), waking the waiters.
  void resolve_handoffs();
  void run_pipelined_pass();  // optimizer thread
  Status group_stats(GroupId g, double scale);
  Status combine_ranks_stats();  // N ranks: the norm's parts of every rank
  // optimizer thread (every parameter of the group was reduced), or driving
  // thread in step() with `reduced`.
  void run_group_update(GroupId g, const std::function<bool(ParamId)>& reduced = {});

  // The optimizer's output to device-homed compute copies: one stream, an
  // event per ring slot (NvmeOptimizer waits on a slot's before reusing it).
  class DeviceUpload;
  // Before the update of g writes its device-homed compute copies: the
  // upload stream waits for the group's last release (backward's reads).
  Status wait_released(GroupId g);

  Registry& reg_;
  AsyncError& errors_;
  std::unique_ptr<DeviceUpload> device_out_;  // null: no device-homed trainable compute copy
  std::vector<uint8_t> device_homed_;         // per group: a trainable compute copy on the device (written by the pass)
  cpu_optim::OptimizerConfig opt_config_;
  uint64_t chunk_ = 0;
  unsigned ring_ = 0;
  uint64_t ring_slot_ = 0;
  std::unique_ptr<NvmeOptimizer> opt_;
  std::function<double(ParamId)> grad_sum_sq_;
  std::vector<GroupUpdate> groups_;
  std::vector<double> rank_stats_;  // N ranks: world x groups x {sum_sq, nonfinite} (all-gathered)
  std::vector<ParamId> trainable_;  // what a step updates (stages 1-2 all-gather them after it)
  // step_all's pass (driving thread, or the optimizer thread for a pipelined
  // step): every group's tensors in order, one config per part (reserved:
  // the tensors point into it), where each group's tensors end.
  std::vector<OptimizerTensor> pass_tensors_;
  std::vector<cpu_optim::OptimizerConfig> pass_configs_;
  std::vector<ParamId> pass_ids_;  // each pass tensor's parameter
  std::vector<size_t> pass_group_end_;
  std::vector<OptimizerTensor> ahead_tensors_;  // read_ahead's list: every trainable tensor in pass order
  uint64_t ahead_writes_ = 0;                   // Registry::array_writes when the read-ahead was issued
  WorkQueue<GroupId> queue_;  // overlap: groups whose gradients are complete; pipelined: groups to update

  // Pipelined step. Set on the driving thread before the groups are queued,
  // read by the optimizer thread (the queue orders them).
  bool pipelined_ = false;
  cpu_optim::OptimizerConfig pipe_config_;
  int64_t pipe_step_ = 0;
  std::vector<GroupHyper> pipe_group_hp_;
  std::vector<uint8_t> pipe_reduced_;  // per param: reduced in the step being applied
  std::mutex pipe_mu_;
  std::condition_variable pipe_cv_;
  std::vector<uint8_t> pipe_pending_;  // per group (pipe_mu_)
  Status pipe_error_;                  // first failed update (pipe_mu_), until restore()

  // Hand-offs (expect_handoff): per group, under pipe_mu_ (pipe_cv_ wakes
  // the waiters); the destinations per parameter, set on the driving thread
  // before the pass is run or queued.
  enum : uint8_t { kNoHandoff, kHandoffPending, kHandoffReady, kHandoffFailed };
  std::vector<uint8_t> handoff_;
  std::vector<void*> handoff_dst_;
  LossScaler scaler_;
  int64_t steps_ = 0;
  std::atomic<int64_t> steps_atomic_{0};  // mirror of steps_ for stats()
  std::atomic<int64_t> skipped_steps_{0};
  double current_lr_ = 0;  // config lr, then the last set_lr()/step(lr)
  std::vector<GroupHyper> group_hp_;          // per lr group (driving thread)
  std::vector<GroupHyper> overlap_group_hp_;  // snapshot at begin_overlap, read by the optimizer thread
  double prev_norm_ = -1;  // overlap clipping: the previous step's norm (< 0: none yet)
  // Overlap: fixed by begin_overlap for this step's group updates.
  double overlap_lr_ = 0;
  double overlap_coef_ = 1, overlap_scale_ = 1;
  int64_t overlap_step_ = 0;
};

}  // namespace strata::engine
