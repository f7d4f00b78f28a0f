// The stepper: norm, loss scaling, clipping, the optimizer per group, the
// overlap-with-backward thread and the compute-copy refresh (see stepper.h).
#include "runtime/engine/stepper.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "common/log.h"
#include "common/threads.h"

namespace strata::engine {

// ---------------------------------------------------------------- device outputs

// Each chunk's bf16/fp16 output (an fp32 model's: the master chunk) goes from
// the ring slot to the device-homed compute copy on this stream; the slot's
// event tells the optimizer when it may write the slot's output again.
class Stepper::DeviceUpload final : public DeviceOutput {
 public:
  explicit DeviceUpload(Registry& reg) : reg_(reg) {}
  ~DeviceUpload() override {
    if (stream_ != nullptr) (void)reg_.dev->synchronize(stream_);
    for (DeviceEvent* e : events_) reg_.dev->destroy_event(e);
    if (stream_ != nullptr) (void)reg_.dev->destroy_stream(stream_);
  }
  Status create(unsigned slots) {
    STRATA_ASSIGN_OR_RETURN(stream_, reg_.dev->create_stream("optimizer out"));
    for (unsigned i = 0; i < slots; ++i) {
      STRATA_ASSIGN_OR_RETURN(DeviceEvent * e, reg_.dev->create_event());
      events_.push_back(e);
    }
    return {};
  }
  DeviceStream* stream() const { return stream_; }
  Status copy(unsigned slot, void* dst, const void* src, std::size_t bytes) override {
    STRATA_RETURN_IF_ERROR(reg_.traced_copy(dst, src, bytes, CopyKind::kHostToDevice, stream_));
    reg_.traffic.h2d += bytes;
    return reg_.dev->record(events_[slot], stream_);
  }
  Status wait(unsigned slot) override { return reg_.dev->synchronize(events_[slot]); }
  bool done(unsigned slot) override {
    Result<bool> r = reg_.dev->query(events_[slot]);
    return r.ok() && *r;  // an error is left for wait() to report
  }

 private:
  Registry& reg_;
  DeviceStream* stream_ = nullptr;
  std::vector<DeviceEvent*> events_;
};

Status Stepper::wait_released(GroupId g) {
  if (!device_homed_[g]) return {};
  return reg_.dev->wait(device_out_->stream(), reg_.groups[g].release_event);
}

// ---------------------------------------------------------------- creation

void Stepper::configure() {
  const Config& cfg = reg_.cfg;
  opt_config_.kind =
      cfg.optimizer.decoupled_weight_decay() ? cpu_optim::OptimizerKind::kAdamW : cpu_optim::OptimizerKind::kAdam;
  opt_config_.lr = cfg.optimizer.lr;
  opt_config_.beta1 = cfg.optimizer.beta1;
  opt_config_.beta2 = cfg.optimizer.beta2;
  opt_config_.eps = cfg.optimizer.eps;
  opt_config_.weight_decay = cfg.optimizer.weight_decay;
  current_lr_ = cfg.optimizer.lr;
  // DeepSpeed's DynamicLossScaler / static scale.
  scaler_.configure(cfg.fp16);

  const size_t state_size = dtype_size(cfg.strata.optimizer_state_dtype);
  const int nstates = cpu_optim::state_count(opt_config_);
  chunk_ = round_up(std::min<uint64_t>(cfg.strata.optimizer_chunk, reg_.max_shard_elems()), reg_.io_quantum);
  ring_ = static_cast<unsigned>(std::clamp<uint64_t>(cfg.zero.offload_optimizer.buffer_count, 2, 64));
  ring_slot_ = round_up(chunk_ * 4, 4096) * 2 + round_up(chunk_ * state_size, 4096) * nstates +
               round_up(chunk_ * dtype_size(reg_.out_dtype), 4096);
}

Status Stepper::allocate(std::function<double(ParamId)> grad_sum_sq) {
  grad_sum_sq_ = std::move(grad_sum_sq);
  // Device-homed compute copies written by the optimizer pass itself (not
  // with overlap_backward: those are rebuilt in step(), once backward is done).
  device_homed_.assign(reg_.groups.size(), 0);
  for (const ParamState& p : reg_.params)
    if (p.trainable && p.compute.tier == Tier::kDevice && !p.refresh_from_master) device_homed_[p.group] = 1;
  NvmeOptimizerOptions oo;
  if (std::find(device_homed_.begin(), device_homed_.end(), 1) != device_homed_.end()) {
    device_out_ = std::make_unique<DeviceUpload>(reg_);
    STRATA_RETURN_IF_ERROR(device_out_->create(ring_));
    oo.device_out = device_out_.get();
  }
  oo.chunk_elems = chunk_;
  oo.ring_buffers = ring_;
  oo.state_dtype = reg_.cfg.strata.optimizer_state_dtype;
  oo.state_rounding = reg_.cfg.strata.optimizer_state_rounding;
  oo.out_dtype = reg_.out_dtype;
  oo.tracer = reg_.tracer.get();
  oo.read_bytes = &reg_.traffic.nvme_read;
  oo.write_bytes = &reg_.traffic.nvme_write;
  STRATA_ASSIGN_OR_RETURN(opt_, NvmeOptimizer::create(reg_.store.get(), *reg_.pool, opt_config_, oo));

  // Optimizer tensors per group (names borrowed from ParamState::name: params never reallocates now).
  const int nstates = cpu_optim::state_count(opt_config_);
  groups_.resize(reg_.groups.size());
  if (reg_.world > 1) rank_stats_.assign(static_cast<size_t>(reg_.world) * groups_.size() * 2, 0.0);
  for (ParamId id = 0; id < reg_.params.size(); ++id)
    if (reg_.params[id].trainable) trainable_.push_back(id);
  for (GroupId gi = 0; gi < reg_.groups.size(); ++gi) {
    for (ParamId id : reg_.groups[gi].params) {
      ParamState& p = reg_.params[id];
      if (!p.trainable) continue;  // frozen: never updated
      ++groups_[gi].trainable;
      OptimizerTensor t;
      t.name = p.name;
      t.count = p.shard.size();
      t.first_index = p.shard.begin;  // stochastic rounding hashes the index in the whole tensor
      t.master = p.master.placement();
      t.grads = p.grad.placement();
      for (int s = 0; s < nstates && s < 2; ++s) t.state[s] = p.state[s].placement();
      if (!p.refresh_from_master) {
        t.params_out = p.compute.tier == Tier::kDevice ? Placement::on_device(p.compute.ptr) : p.compute.placement();
        t.out_is_master = p.dtype == DType::kF32;
      }
      groups_[gi].ids.push_back(id);
      auto& parts = groups_[gi].parts;
      auto it = std::find_if(parts.begin(), parts.end(), [&](const GroupUpdate::Part& q) {
        return q.lr_group == p.lr_group && q.decay == p.weight_decay;
      });
      if (it == parts.end()) it = parts.insert(parts.end(), GroupUpdate::Part{p.lr_group, p.weight_decay, {}, {}});
      it->tensors.push_back(t);
      it->ids.push_back(id);
      if (p.lr_group >= group_hp_.size()) group_hp_.resize(size_t{p.lr_group} + 1);
    }
    size_t widest = 0;
    for (const auto& part : groups_[gi].parts) widest = std::max(widest, part.tensors.size());
    groups_[gi].scratch.reserve(widest);
  }
  return {};
}

void Stepper::plan_pipeline() {
  pipelined_ = reg_.cfg.strata.pipelined_step && !reg_.cfg.strata.overlap_backward && reg_.world == 1;
  pipe_pending_.assign(reg_.groups.size(), 0);
  pipe_reduced_.assign(reg_.params.size(), 0);
  handoff_.assign(reg_.groups.size(), kNoHandoff);
  handoff_dst_.assign(reg_.params.size(), nullptr);
}

Status Stepper::start() {
  if (!reg_.cfg.strata.overlap_backward && !pipelined_) return {};
  return queue_.start("optimizer", [this](const GroupId& g) {
    if (pipelined_)
      run_pipelined_pass();
    else
      run_group_update(g);
  });
}

void Stepper::stop() {
  queue_.stop();
}

Stepper::Stepper(Registry& reg, AsyncError& errors) : reg_(reg), errors_(errors) {}

Stepper::~Stepper() {
  stop();
  opt_.reset();
  device_out_.reset();
}

// ---------------------------------------------------------------- overlap with backward

void Stepper::begin_overlap(int64_t micro_batches) {
  const double m = reg_.cfg.strata.average_micro_batches ? static_cast<double>(micro_batches) : 1.0;
  overlap_scale_ = 1.0 / (m * scaler_.scale);
  const double clip = reg_.cfg.gradient_clipping;
  overlap_coef_ = clip > 0 && prev_norm_ >= 0 ? std::min(1.0, clip / (prev_norm_ + 1e-6)) : 1.0;
  overlap_step_ = steps_ + 1;
  overlap_lr_ = current_lr_;
  overlap_group_hp_ = group_hp_;
  for (auto& g : groups_) {
    g.reduced_last = 0;
    g.queued = g.updated = g.skipped = g.nonfinite = false;
    g.sum_sq = 0;
  }
}

bool Stepper::count_reduced(GroupId gi) {
  GroupUpdate& g = groups_[gi];
  if (++g.reduced_last != g.trainable) return false;
  g.queued = true;
  return true;
}

cpu_optim::OptimizerConfig Stepper::optimizer_config(double lr, double grad_scale) const {
  cpu_optim::OptimizerConfig c = opt_config_;
  c.lr = lr;
  c.grad_scale = grad_scale;
  return c;
}

Status Stepper::set_group_lr(uint32_t lr_group, double lr) {
  bool known = false;
  for (const auto& g : groups_)
    for (const auto& part : g.parts) known = known || part.lr_group == lr_group;
  if (!known)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: set_group_lr: no trainable parameter has lr_group {}", lr_group));
  if (!std::isfinite(lr))
    return Status(StatusCode::kInvalidArgument, fmt::format("engine: set_group_lr({}): lr {} is not finite", lr_group, lr));
  group_hp_[lr_group].lr = lr < 0 ? -1.0 : lr;
  return {};
}

Status Stepper::set_group_betas(uint32_t lr_group, double beta1, double beta2) {
  bool known = false;
  for (const auto& g : groups_)
    for (const auto& part : g.parts) known = known || part.lr_group == lr_group;
  if (!known)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: set_group_betas: no trainable parameter has lr_group {}", lr_group));
  if (opt_config_.kind != cpu_optim::OptimizerKind::kAdamW && opt_config_.kind != cpu_optim::OptimizerKind::kAdam)
    return Status(StatusCode::kInvalidArgument, "engine: set_group_betas: the optimizer has no betas");
  for (double b : {beta1, beta2})
    if (!std::isfinite(b) || b >= 1.0)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("engine: set_group_betas({}): betas ({}, {}) must be in [0, 1) (< 0: the config's)",
                                lr_group, beta1, beta2));
  group_hp_[lr_group].beta1 = beta1 < 0 ? -1.0 : beta1;
  group_hp_[lr_group].beta2 = beta2 < 0 ? -1.0 : beta2;
  return {};
}

cpu_optim::OptimizerConfig Stepper::part_config(const cpu_optim::OptimizerConfig& c, const GroupUpdate::Part& part,
                                                const std::vector<GroupHyper>& group_hp) {
  cpu_optim::OptimizerConfig pc = c;
  if (part.lr_group < group_hp.size()) {
    const GroupHyper& h = group_hp[part.lr_group];
    if (h.lr >= 0) pc.lr = h.lr;
    if (h.beta1 >= 0) pc.beta1 = h.beta1;
    if (h.beta2 >= 0) pc.beta2 = h.beta2;
  }
  if (!part.decay) pc.weight_decay = 0;
  return pc;
}

// Each tensor carries its parameter's own step (updates + 1): torch counts
// state['step'] per parameter, so one skipped in some steps (reduced by no
// micro-batch) corrects its moments by the steps it took.
Status Stepper::step_group(GroupId gi, const cpu_optim::OptimizerConfig& c, int64_t step,
                           const std::vector<GroupHyper>& group_hp, const std::function<bool(ParamId)>& reduced) {
  STRATA_RETURN_IF_ERROR(wait_released(gi));
  std::vector<OptimizerTensor>& some = groups_[gi].scratch;
  for (const auto& part : groups_[gi].parts) {
    const cpu_optim::OptimizerConfig pc = part_config(c, part, group_hp);
    some.clear();
    for (size_t i = 0; i < part.ids.size(); ++i) {
      if (reduced && !reduced(part.ids[i])) continue;  // only the parameters this step reduced
      some.push_back(part.tensors[i]);
      some.back().step = reg_.params[part.ids[i]].updates + 1;
    }
    if (some.empty()) continue;
    STRATA_RETURN_IF_ERROR(opt_->step_part(pc, step, some));
    for (size_t i = 0; i < part.ids.size(); ++i)
      if (!reduced || reduced(part.ids[i])) ++reg_.params[part.ids[i]].updates;
  }
  return {};
}

// Counted before the pass (driving thread): param_steps() and the next step
// see this step's counts without waiting for a pipelined pass. A failed step
// breaks the engine until a checkpoint is loaded, which restores them.
void Stepper::count_updates(const std::function<bool(ParamId)>& reduced) {
  for (ParamId id = 0; id < reg_.params.size(); ++id)
    if (reg_.params[id].trainable && (!reduced || reduced(id))) ++reg_.params[id].updates;
}

Status Stepper::step_all(const cpu_optim::OptimizerConfig& c, int64_t step, const std::vector<GroupHyper>& group_hp,
                         const std::function<bool(ParamId)>& reduced, const std::function<void(GroupId)>& group_done) {
  const size_t ng = groups_.size();
  size_t nparts = 0;
  for (const auto& g : groups_) nparts += g.parts.size();
  pass_configs_.clear();
  pass_configs_.reserve(nparts);  // no reallocation below: the tensors point into it
  pass_tensors_.clear();
  pass_ids_.clear();
  pass_group_end_.assign(ng, 0);
  for (GroupId gi = 0; gi < ng; ++gi) {
    STRATA_RETURN_IF_ERROR(wait_released(gi));
    for (const auto& part : groups_[gi].parts) {
      pass_configs_.push_back(part_config(c, part, group_hp));
      for (size_t i = 0; i < part.ids.size(); ++i) {
        if (reduced && !reduced(part.ids[i])) continue;  // only the parameters this step reduced
        OptimizerTensor t = part.tensors[i];
        t.step = reg_.params[part.ids[i]].updates;
        t.config = &pass_configs_.back();
        pass_tensors_.push_back(t);
        pass_ids_.push_back(part.ids[i]);
      }
    }
    pass_group_end_[gi] = pass_tensors_.size();
  }
  // Hand-offs: a group's compute copies also go to the uploader's buffer
  // as they are updated, if every parameter of the group is in this pass.
  bool any_handoff = false, any_failed = false;
  {
    std::lock_guard<std::mutex> lock(pipe_mu_);
    size_t begin = 0;
    for (GroupId gi = 0; gi < ng; ++gi) {
      const size_t end = pass_group_end_[gi];
      if (handoff_[gi] == kHandoffPending) {
        bool whole = end - begin == reg_.groups[gi].params.size();
        for (size_t k = begin; whole && k < end; ++k) whole = pass_tensors_[k].params_out.present();
        for (size_t k = begin; whole && k < end; ++k) {
          pass_tensors_[k].out_copy = handoff_dst_[pass_ids_[k]];
          whole = pass_tensors_[k].out_copy != nullptr;
        }
        if (whole) {
          any_handoff = true;
        } else {
          for (size_t k = begin; k < end; ++k) pass_tensors_[k].out_copy = nullptr;
          handoff_[gi] = kHandoffFailed;
          any_failed = true;
        }
      }
      begin = end;
    }
  }
  if (any_failed) pipe_cv_.notify_all();  // an upload waiting on one of them reads NVMe instead
  size_t copied_next = 0;  // the first group whose hand-off is not yet reported (optimizer's calling thread)
  auto copied = [&](size_t tensors_copied) {
    bool woke = false;
    {
      std::lock_guard<std::mutex> lock(pipe_mu_);
      while (copied_next < ng && pass_group_end_[copied_next] <= tensors_copied) {
        if (handoff_[copied_next] == kHandoffPending) {
          handoff_[copied_next] = kHandoffReady;
          woke = true;
        }
        ++copied_next;
      }
    }
    if (woke) pipe_cv_.notify_all();
  };
  if (reg_.array_writes.load(std::memory_order_acquire) != ahead_writes_) opt_->drop_prefetch();
  size_t next = 0;  // the first group not yet reported (written under the optimizer's lock, then read here after it)
  auto report = [&](size_t tensors_done) {
    while (next < ng && pass_group_end_[next] <= tensors_done) {
      if (group_done) group_done(static_cast<GroupId>(next));
      ++next;
    }
  };
  Status st = opt_->step(c, step, pass_tensors_, report, any_handoff ? TensorsDone(copied) : TensorsDone());
  resolve_handoffs();
  if (!st.ok())
    return st.with_context(
        fmt::format("engine: optimizer step {} of group {}", step, reg_.groups[std::min(next, ng - 1)].name));
  report(pass_tensors_.size());  // groups after the last tensor (none of theirs updated this step)
  read_ahead();
  return {};
}

void Stepper::read_ahead() {
  ahead_tensors_.clear();
  for (const auto& g : groups_)
    for (const auto& part : g.parts) ahead_tensors_.insert(ahead_tensors_.end(), part.tensors.begin(), part.tensors.end());
  // Read before the reads are issued: a write completing after this point
  // changes the count, and the step drops what was read.
  ahead_writes_ = reg_.array_writes.load(std::memory_order_acquire);
  opt_->prefetch(ahead_tensors_);
}

// The norm's squares were summed while the gradients were accumulated
// (GradPath::sum_sq): no pass over the gradients here. Parameters in the
// group's order, each one's blocks in order: the same sum on every tier.
Status Stepper::group_stats(GroupId gi, double scale) {
  GroupUpdate& g = groups_[gi];
  double total = 0;
  for (ParamId id : g.ids) total += grad_sum_sq_(id);
  g.nonfinite = !std::isfinite(total);  // squares of finite floats cannot overflow the double sum
  g.sum_sq = total * (scale * scale);
  return {};
}

// N ranks: every rank's per-group sums of squares and inf/NaN flags are
// all-gathered and added in rank order, so every rank has the same norm and
// the same skip decision.
Status Stepper::combine_ranks_stats() {
  const size_t ng = groups_.size(), per_rank = ng * 2;
  double* mine = rank_stats_.data() + reg_.rank * per_rank;
  for (size_t g = 0; g < ng; ++g) {
    mine[2 * g] = groups_[g].sum_sq;
    mine[2 * g + 1] = groups_[g].nonfinite ? 1.0 : 0.0;
  }
  const uint64_t bytes = per_rank * sizeof(double);
  double* all = rank_stats_.data();
  Status st = reg_.host_all_gather(mine, all, bytes);
  if (!st.ok()) return st.with_context("engine: step(): combining the gradient norm over ranks");
  for (size_t g = 0; g < ng; ++g) {
    double sq = 0;
    bool bad = false;
    for (uint32_t r = 0; r < reg_.world; ++r) {
      sq += all[r * per_rank + 2 * g];
      bad = bad || all[r * per_rank + 2 * g + 1] != 0.0;
    }
    groups_[g].sum_sq = sq;
    groups_[g].nonfinite = bad;
  }
  return {};
}

// Overlap mode: one group's update with the scale and clipping coefficient
// fixed when the last micro-batch began.
void Stepper::run_group_update(GroupId gi, const std::function<bool(ParamId)>& reduced) {
  GroupUpdate& g = groups_[gi];
  Status st = run_guarded("engine: an overlapped group update", [&] {
    STRATA_RETURN_IF_ERROR(group_stats(gi, overlap_scale_));
    if (g.nonfinite) {
      g.skipped = true;
      return Status();
    }
    Status s = step_group(gi, optimizer_config(overlap_lr_, overlap_scale_ * overlap_coef_), overlap_step_,
                          overlap_group_hp_, reduced);
    if (!s.ok())
      s = s.with_context(fmt::format("engine: optimizer step {} of group {}", overlap_step_, reg_.groups[gi].name));
    return s;
  });
  g.updated = true;
  if (!st.ok()) errors_.set(st);
}

// ---------------------------------------------------------------- pipelined step

Status Stepper::queue_pipeline(const cpu_optim::OptimizerConfig& c, const std::function<bool(ParamId)>& reduced) {
  pipe_config_ = c;
  pipe_step_ = steps_ + 1;
  pipe_group_hp_ = group_hp_;
  for (ParamId id = 0; id < reg_.params.size(); ++id) pipe_reduced_[id] = !reduced || reduced(id);
  {
    std::lock_guard<std::mutex> lock(pipe_mu_);
    for (GroupId g = 0; g < groups_.size(); ++g) pipe_pending_[g] = 1;
  }
  queue_.push(0);  // one pass over every group (the value is not used)
  return {};
}

void Stepper::run_pipelined_pass() {
  Status st = pipeline_error();  // after a failure the state is torn: nothing more is applied
  if (st.ok()) {
    st = run_guarded("engine: the pipelined optimizer step", [&] {
      return step_all(pipe_config_, pipe_step_, pipe_group_hp_, [this](ParamId id) { return pipe_reduced_[id] != 0; },
                      [this](GroupId g) {
                        {
                          std::lock_guard<std::mutex> lock(pipe_mu_);
                          pipe_pending_[g] = 0;
                        }
                        pipe_cv_.notify_all();
                      });
    });
  }
  resolve_handoffs();  // whatever the pass did not make (it failed, or never ran), no upload waits for
  {
    std::lock_guard<std::mutex> lock(pipe_mu_);
    for (auto& p : pipe_pending_) p = 0;  // after a failure the waiters get the error
    if (!st.ok() && pipe_error_.ok()) pipe_error_ = st;
  }
  pipe_cv_.notify_all();
  if (!st.ok()) errors_.set(st);
}

// ---------------------------------------------------------------- hand-offs

void Stepper::expect_handoff(const std::vector<GroupId>& groups, const std::vector<void*>& dst) {
  std::lock_guard<std::mutex> lock(pipe_mu_);
  std::fill(handoff_.begin(), handoff_.end(), kNoHandoff);
  for (GroupId g : groups) handoff_[g] = kHandoffPending;
  handoff_dst_ = dst;
}

bool Stepper::wait_handoff(GroupId g) {
  std::unique_lock<std::mutex> lock(pipe_mu_);
  pipe_cv_.wait(lock, [&] { return handoff_[g] != kHandoffPending; });
  return handoff_[g] == kHandoffReady;
}

void Stepper::resolve_handoffs() {
  {
    std::lock_guard<std::mutex> lock(pipe_mu_);
    for (auto& h : handoff_)
      if (h == kHandoffPending) h = kHandoffFailed;
  }
  pipe_cv_.notify_all();
}

Status Stepper::wait_group(GroupId g) {
  std::unique_lock<std::mutex> lock(pipe_mu_);
  pipe_cv_.wait(lock, [&] { return pipe_pending_[g] == 0; });
  return pipe_error_;
}

Status Stepper::pipeline_error() {
  std::lock_guard<std::mutex> lock(pipe_mu_);
  return pipe_error_;
}

// ---------------------------------------------------------------- step

double Stepper::begin_step(bool overlap, double lr) {
  const double lr_used = overlap ? overlap_lr_ : (lr >= 0 ? lr : current_lr_);
  if (lr >= 0) current_lr_ = lr;
  return lr_used;
}

Status Stepper::update(bool overlap, double lr_used, int64_t micro, const Bounce& bounce, StepResult& r,
                       const std::function<bool(ParamId)>& reduced) {
  r.lr = lr_used;
  bool updated_any = false;
  // Hand-offs the pass does not make (a skipped step, overlap_backward, an
  // error before the pass) fail here; the pass resolves its own.
  bool pass_queued = false;
  struct ResolveAtExit {
    Stepper* s;
    const bool* queued;
    ~ResolveAtExit() {
      if (!*queued) s->resolve_handoffs();
    }
  } resolve_at_exit{this, &pass_queued};
  if (overlap) {
    for (GroupId g = 0; g < groups_.size(); ++g)
      if (!groups_[g].updated) run_group_update(g, reduced);
    Status e = errors_.take();
    if (!e.ok()) return e;
    double sum = 0;
    for (auto& g : groups_) {
      sum += g.sum_sq;
      if (g.skipped) ++r.skipped_groups;
    }
    r.grad_norm = std::sqrt(sum);
    r.clip_coef = overlap_coef_;
    updated_any = r.skipped_groups < groups_.size();
    r.skipped = !updated_any;
    if (std::isfinite(r.grad_norm)) prev_norm_ = r.grad_norm;
    if (r.skipped_groups > 0)
      log_warn("engine: step {}: {} group(s) had non-finite gradients and were not updated", overlap_step_,
               r.skipped_groups);
  } else {
    // N ranks: the sum of every rank's micro-batches, averaged over all of
    // them; a caller that averaged its own micro-batches (average false)
    // still gets the mean over ranks, as a data-parallel all-reduce gives.
    const double m = (reg_.cfg.strata.average_micro_batches ? static_cast<double>(micro) : 1.0) * reg_.world;
    const double scale = 1.0 / (m * scaler_.scale);
    double sum = 0;
    bool nonfinite = false;
    for (GroupId g = 0; g < groups_.size(); ++g) STRATA_RETURN_IF_ERROR(group_stats(g, scale));
    if (reg_.world > 1) STRATA_RETURN_IF_ERROR(combine_ranks_stats());
    for (GroupId g = 0; g < groups_.size(); ++g) {
      sum += groups_[g].sum_sq;
      nonfinite = nonfinite || groups_[g].nonfinite;
    }
    r.grad_norm = std::sqrt(sum);
    if (nonfinite) {
      r.skipped = true;
      if (scaler_.dynamic)
        scaler_.update(true, reg_.cfg.fp16);
      else if (!reg_.cfg.fp16.enabled)
        log_warn("engine: step {}: non-finite gradients; the step is skipped", steps_ + 1);
    } else {
      const double clip = reg_.cfg.gradient_clipping;
      r.clip_coef = clip > 0 ? std::min(1.0, clip / (r.grad_norm + 1e-6)) : 1.0;
      const auto oc = optimizer_config(lr_used, scale * r.clip_coef);
      count_updates(reduced);
      if (pipelined_) {
        STRATA_RETURN_IF_ERROR(queue_pipeline(oc, reduced));
        pass_queued = true;
      } else {
        STRATA_RETURN_IF_ERROR(step_all(oc, steps_ + 1, group_hp_, reduced, {}));
      }
      updated_any = true;
      if (scaler_.dynamic) scaler_.update(false, reg_.cfg.fp16);
      prev_norm_ = r.grad_norm;
    }
  }
  if (updated_any) {
    ++steps_;
    // overlap_backward: the device-homed compute copies, which the pass
    // could not write while backward read them (every other compute copy
    // was written by the optimizer pass).
    for (ParamId id = 0; id < reg_.params.size(); ++id) {
      if (!reg_.params[id].refresh_from_master) continue;
      if (overlap && groups_[reg_.params[id].group].skipped) continue;
      Status s = reg_.refresh_compute(id, bounce);
      if (!s.ok()) return s.with_context("engine: updating the compute copy of " + reg_.params[id].name);
    }
    // Stages 1-2: each rank updated its shard of the compute copies; every
    // rank needs them whole (the decision to update is the same on every
    // rank: the norm and the inf/NaN flags were combined).
    if (reg_.replicated) STRATA_RETURN_IF_ERROR(reg_.gather_replicas(trainable_));
  } else {
    ++skipped_steps_;
  }
  return {};
}

void Stepper::finish_step(StepResult& r) {
  steps_atomic_.store(steps_, std::memory_order_relaxed);
  r.step = steps_;
  r.loss_scale = scaler_.scale;
}

void Stepper::restore(int64_t steps, const LossScaler& scaler, double prev_norm, double lr) {
  {
    std::lock_guard<std::mutex> lock(pipe_mu_);
    pipe_error_ = Status();  // the torn state was replaced
  }
  resolve_handoffs();  // nothing restored was handed off
  steps_ = steps;
  scaler_ = scaler;
  prev_norm_ = prev_norm;
  current_lr_ = lr;
  opt_->drop_prefetch();  // load_shard dropped it; nothing may survive a restore
  opt_->set_completed_step(steps_);
  steps_atomic_.store(steps_, std::memory_order_relaxed);
}

}  // namespace strata::engine
