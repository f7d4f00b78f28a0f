// The engine facade: creation wires the parts (runtime/engine/engine_impl.h), and the
// protocol (begin_micro_batch, acquire/release, reduce_grad, step, parameters,
// stats) checks each call, then hands it to the part that owns the work.
// Checkpoints: engine/checkpointing.cpp.
#include "runtime/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <utility>

#include "common/float_convert.h"
#include "common/log.h"
#include "common/units.h"
#include "cpu_optim/optimizer.h"
#include "runtime/engine/engine_impl.h"

namespace strata {

using engine::narrow_from_f32;
using engine::ParamState;

// ---------------------------------------------------------------- creation

Result<std::unique_ptr<Engine>> Engine::create(const EngineOptions& options) {
  auto impl = std::make_unique<Impl>();
  STRATA_RETURN_IF_ERROR(impl->init(options));
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() = default;

// Everything a step needs is allocated here, each part allocating what it
// owns; the pinned pool is sized once to exactly the parts' buffers, which
// are then taken from it in a fixed order (pieces, staging, optimizer ring).
Status Engine::Impl::init(const EngineOptions& options) {
  STRATA_RETURN_IF_ERROR(reg.init(options));
  stepper.configure();
  STRATA_RETURN_IF_ERROR(reg.allocate_arrays());
  stepper.plan_pipeline();
  if (stepper.pipelined()) reg.await_update = [this](GroupId g) { return stepper.wait_group(g); };
  reg.await_handoff = [this](GroupId g) { return stepper.wait_handoff(g); };
  uploader.lay_out();
  STRATA_RETURN_IF_ERROR(grads.prepare());
  engine::PinnedNeeds needs;
  needs.ring = stepper.ring_buffers();
  needs.ring_slot = stepper.ring_slot_bytes();
  needs.staging = uploader.staging_count();
  needs.staging_bytes = uploader.staging_bytes();
  needs.pieces = grads.pieces() + 1;  // + the accumulation scratch
  needs.piece_bytes = grads.piece_elems() * 4;
  STRATA_RETURN_IF_ERROR(reg.create_pinned_pool(needs));
  STRATA_RETURN_IF_ERROR(grads.allocate());
  STRATA_RETURN_IF_ERROR(uploader.allocate_staging());
  STRATA_RETURN_IF_ERROR(stepper.allocate([this](ParamId id) { return grads.sum_sq(id); }));
  STRATA_RETURN_IF_ERROR(uploader.allocate_slots());

  // ---- threads
  STRATA_RETURN_IF_ERROR(uploader.start());
  STRATA_RETURN_IF_ERROR(grads.start([this](GroupId g) { stepper.queue_update(g); }));
  STRATA_RETURN_IF_ERROR(stepper.start());
  const Plan& plan = reg.plan;
  log_info("engine: {} parameters in {} groups on {} ({} on device, {} host, {} NVMe)", reg.params.size(),
           reg.groups.size(), reg.dev->name(), format_bytes(plan.tier_bytes(Tier::kDevice)),
           format_bytes(plan.tier_bytes(Tier::kHost)), format_bytes(plan.tier_bytes(Tier::kNvme)));
  return {};
}

Engine::Impl::~Impl() {
  if (stepper.pipelined()) {
    stepper.wait_idle();
    if (Status pe = stepper.pipeline_error(); !pe.ok())
      log_error("engine: a pipelined optimizer update failed ({}); the swap state is torn: resume from a checkpoint",
                pe.message());
  }
  // Threads first (in the order work flows: an accumulation may still hand a
  // group to the optimizer thread), then the streams, then each part frees
  // what it owns (members in reverse order; the registry last).
  uploader.stop();
  grads.stop();
  stepper.stop();
  if (reg.dev != nullptr) {
    if (reg.upload) (void)reg.dev->synchronize(reg.upload);
    if (grads.download()) (void)reg.dev->synchronize(grads.download());
  }
}

Status Engine::Impl::wait_idle() {
  Status st = grads.wait_idle();  // the download stream, then the accumulator
  stepper.wait_idle();            // overlapped group updates the accumulator queued, or a pipelined step's
  // The optimizer's read-ahead keeps its bytes, but no read of it may still
  // be in flight when the caller writes state (load_param: the swap store's
  // checksums and the file bytes; array_writes then makes the step drop it).
  stepper.settle_read_ahead();
  // A pipelined step that failed after step() returned left torn state: the
  // engine refuses steps and saves until load_checkpoint (which clears it),
  // and every call that waits here reports it.
  Status pe = stepper.pipeline_error();
  if (!pe.ok()) {
    if (!broken) {
      broken = true;
      broken_status = pe;
    }
    if (st.ok()) st = pe;
  }
  uploader.wait_idle();
  Status up = reg.dev->synchronize(reg.upload);
  if (st.ok()) st = up;
  return st;
}

void Engine::Impl::reset_step() {
  grads.reset_step();
  micro_index = -1;
  overlap_running = false;
}

// ---------------------------------------------------------------- model and parameters

const ModelSpec& Engine::model() const { return impl_->reg.options.model; }
const Plan& Engine::plan() const { return impl_->reg.plan; }
DeviceBackend& Engine::device() { return *impl_->reg.dev; }
uint32_t Engine::group_count() const { return static_cast<uint32_t>(impl_->reg.groups.size()); }
const std::string& Engine::group_name(GroupId g) const { return impl_->reg.groups.at(g).name; }
std::span<const ParamId> Engine::group_params(GroupId g) const { return impl_->reg.groups.at(g).params; }

Result<ParamId> Engine::find_param(std::string_view name) const {
  for (ParamId i = 0; i < impl_->reg.params.size(); ++i)
    if (impl_->reg.params[i].name == name) return i;
  return Status(StatusCode::kNotFound, fmt::format("engine: no parameter named '{}'", name));
}

Result<GroupId> Engine::find_group(std::string_view name) const {
  for (GroupId i = 0; i < impl_->reg.groups.size(); ++i)
    if (impl_->reg.groups[i].name == name) return i;
  return Status(StatusCode::kNotFound, fmt::format("engine: no group named '{}'", name));
}

namespace {
Status check_dtype(DType d, const char* what) {
  if (d == DType::kF32 || d == DType::kBF16 || d == DType::kF16) return {};
  return Status(StatusCode::kInvalidArgument, fmt::format("engine: {}: dtype must be fp32, bf16 or fp16", what));
}
}  // namespace

Status Engine::load_param(ParamId id, const void* src, DType dtype) {
  Impl& I = *impl_;
  if (id >= I.reg.params.size())
    return Status(StatusCode::kInvalidArgument, fmt::format("engine: load_param: no parameter {}", id));
  STRATA_RETURN_IF_ERROR(check_dtype(dtype, "load_param"));
  if (src == nullptr && I.reg.params[id].numel > 0)
    return Status(StatusCode::kInvalidArgument, "engine: load_param: null source");
  ParamState& p = I.reg.params[id];
  if (I.uploader.acquired(p.group))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: load_param({}): its group {} is acquired", p.name, I.reg.groups[p.group].name));
  STRATA_RETURN_IF_ERROR(I.wait_idle());
  I.uploader.invalidate_slots();  // a cached or prefetched device copy would be stale
  const size_t in_sz = dtype_size(dtype);
  const size_t esz = dtype_size(p.dtype);
  const engine::Bounce b = I.grads.bounce();
  float* f = b.f32;
  void* c = b.compute;
  if (p.compute.tier == Tier::kDevice) STRATA_RETURN_IF_ERROR(I.reg.wait_released(id));
  const uint64_t n = p.shard.size();
  for (uint64_t off = 0; off < n; off += b.elems) {
    const uint64_t cnt = std::min(b.elems, n - off);
    widen_to_f32(static_cast<const char*>(src) + (p.shard.begin + off) * in_sz, dtype, cnt, f);
    Status st = p.trainable ? I.reg.write_array(p.master, 4, off, cnt, f) : Status();  // frozen: no master
    if (st.ok()) st = narrow_from_f32(f, p.dtype, cnt, c);
    if (st.ok()) st = I.reg.write_array(p.compute, esz, off, cnt, c);
    if (!st.ok()) return st.with_context(fmt::format("engine: load_param({})", p.name));
  }
  // Stages 1-2: the other ranks' parts of the replica too, before and after
  // this rank's slot (every rank loads the same whole tensor, so no
  // collective is needed; the replica is host or device memory, no NVMe
  // alignment applies).
  if (p.replica == nullptr) return {};
  engine::ArrayLoc whole = p.compute;
  whole.ptr = p.replica;
  for (auto [lo, hi] : {std::pair<uint64_t, uint64_t>{0, p.shard.begin}, {p.shard.end, p.numel}}) {
    for (uint64_t off = lo; off < hi; off += b.elems) {
      const uint64_t cnt = std::min(b.elems, hi - off);
      widen_to_f32(static_cast<const char*>(src) + off * in_sz, dtype, cnt, f);
      Status st = narrow_from_f32(f, p.dtype, cnt, c);
      if (st.ok()) st = I.reg.write_array(whole, esz, off, cnt, c);
      if (!st.ok()) return st.with_context(fmt::format("engine: load_param({})", p.name));
    }
  }
  return {};
}

Status Engine::read_param(ParamId id, void* dst, DType dtype) {
  Impl& I = *impl_;
  if (id >= I.reg.params.size())
    return Status(StatusCode::kInvalidArgument, fmt::format("engine: read_param: no parameter {}", id));
  STRATA_RETURN_IF_ERROR(check_dtype(dtype, "read_param"));
  STRATA_RETURN_IF_ERROR(I.wait_idle());
  ParamState& p = I.reg.params[id];
  const engine::Bounce b = I.grads.bounce();
  float* f = b.f32;
  const size_t out_sz = dtype_size(dtype);
  const uint64_t n = p.shard.size();
  for (uint64_t off = 0; off < n; off += b.elems) {
    const uint64_t cnt = std::min(b.elems, n - off);
    // A frozen parameter's value is its compute copy (it has no master).
    Status st = p.trainable ? I.reg.read_array(p.master, 4, off, cnt, f)
                            : I.reg.read_array(p.compute, dtype_size(p.dtype), off, cnt, b.compute);
    if (st.ok() && !p.trainable) widen_to_f32(b.compute, p.dtype, cnt, f);
    if (!st.ok()) return st.with_context(fmt::format("engine: read_param({})", p.name));
    st = narrow_from_f32(f, dtype, cnt, static_cast<char*>(dst) + off * out_sz);
    if (!st.ok()) return st.with_context(fmt::format("engine: read_param({})", p.name));
  }
  return {};
}

Status Engine::broadcast(void* data, size_t bytes, uint32_t root) {
  Impl& I = *impl_;
  engine::Registry& R = I.reg;
  if (root >= R.world)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: broadcast: root {} is not a rank (world size {})", root, R.world));
  if (data == nullptr && bytes > 0) return Status(StatusCode::kInvalidArgument, "engine: broadcast: null data");
  if (R.world == 1 || bytes == 0) return {};
  STRATA_RETURN_IF_ERROR(I.wait_idle());  // the upload stream and the staging buffer are the pipeline's too
  return R.host_broadcast(data, bytes, static_cast<int>(root)).with_context("engine: broadcast");
}

Status Engine::gather_param(ParamId id, void* dst, DType dtype) {
  Impl& I = *impl_;
  engine::Registry& R = I.reg;
  if (R.world == 1) return read_param(id, dst, dtype);
  if (id >= R.params.size())
    return Status(StatusCode::kInvalidArgument, fmt::format("engine: gather_param: no parameter {}", id));
  STRATA_RETURN_IF_ERROR(check_dtype(dtype, "gather_param"));
  STRATA_RETURN_IF_ERROR(I.wait_idle());
  ParamState& p = R.params[id];
  const engine::Bounce b = I.grads.bounce();
  const size_t out_sz = dtype_size(dtype);
  const uint64_t n = p.shard.size(), padded = p.shard.padded;
  std::vector<float> all(static_cast<size_t>(R.world) * std::min(b.elems, std::max<uint64_t>(padded, 1)));
  // Every rank walks its padded shard in the same pieces; piece k of rank r
  // lands at r * padded + k's offset of the whole tensor.
  for (uint64_t off = 0; off < padded; off += b.elems) {
    const uint64_t cnt = std::min(b.elems, padded - off);
    const uint64_t have = off < n ? std::min(cnt, n - off) : 0;
    Status st = !p.trainable || have == 0 ? Status() : R.read_array(p.master, 4, off, have, b.f32);
    if (st.ok() && !p.trainable && have > 0) {
      st = R.read_array(p.compute, dtype_size(p.dtype), off, have, b.compute);
      if (st.ok()) widen_to_f32(b.compute, p.dtype, have, b.f32);
    }
    if (!st.ok()) return st.with_context(fmt::format("engine: gather_param({})", p.name));
    std::fill(b.f32 + have, b.f32 + cnt, 0.0f);
    float* mine = all.data() + R.rank * cnt;
    std::memcpy(mine, b.f32, cnt * 4);
    st = R.host_all_gather(mine, all.data(), cnt * 4);
    if (!st.ok()) return st.with_context(fmt::format("engine: gather_param({})", p.name));
    for (uint32_t r = 0; r < R.world; ++r) {
      const uint64_t begin = r * padded + off;
      if (begin >= p.numel) continue;
      const uint64_t m = std::min(cnt, p.numel - begin);
      st = narrow_from_f32(all.data() + r * cnt, dtype, m, static_cast<char*>(dst) + begin * out_sz);
      if (!st.ok()) return st.with_context(fmt::format("engine: gather_param({})", p.name));
    }
  }
  return {};
}

namespace {
// The optimizer state array k of p, or why there is none.
Result<const engine::ArrayLoc*> state_of(const engine::Registry& reg, ParamId id, int k, const char* op) {
  if (id >= reg.params.size()) return Status(StatusCode::kInvalidArgument, fmt::format("engine: {}: no parameter {}", op, id));
  const engine::ParamState& p = reg.params[id];
  if (!p.trainable)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: {}({}): a frozen parameter has no optimizer state", op, p.name));
  cpu_optim::OptimizerConfig oc;
  oc.kind = reg.cfg.optimizer.decoupled_weight_decay() ? cpu_optim::OptimizerKind::kAdamW
                                                       : cpu_optim::OptimizerKind::kAdam;
  const int n = std::min(cpu_optim::state_count(oc), 2);
  if (k < 0 || k >= n)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: {}({}): state {} does not exist (the optimizer keeps {})", op, p.name, k, n));
  return &p.state[k];
}
}  // namespace

Status Engine::read_state(ParamId id, int k, float* dst) {
  Impl& I = *impl_;
  STRATA_ASSIGN_OR_RETURN(const engine::ArrayLoc* a, state_of(I.reg, id, k, "read_state"));
  if (dst == nullptr && I.reg.params[id].shard.size() > 0)
    return Status(StatusCode::kInvalidArgument, "engine: read_state: null destination");
  STRATA_RETURN_IF_ERROR(I.wait_idle());
  const ParamState& p = I.reg.params[id];
  const DType sd = I.reg.cfg.strata.optimizer_state_dtype;
  const engine::Bounce b = I.grads.bounce();
  const uint64_t n = p.shard.size();
  for (uint64_t off = 0; off < n; off += b.elems) {
    const uint64_t cnt = std::min(b.elems, n - off);
    Status st = I.reg.read_array(*a, dtype_size(sd), off, cnt, b.compute);
    if (!st.ok()) return st.with_context(fmt::format("engine: read_state({}, {})", p.name, k));
    widen_to_f32(b.compute, sd, cnt, dst + off);
  }
  return {};
}

Status Engine::load_state(ParamId id, int k, const float* src) {
  Impl& I = *impl_;
  STRATA_ASSIGN_OR_RETURN(const engine::ArrayLoc* a, state_of(I.reg, id, k, "load_state"));
  if (src == nullptr) return Status(StatusCode::kInvalidArgument, "engine: load_state: null source");
  STRATA_RETURN_IF_ERROR(I.wait_idle());
  const ParamState& p = I.reg.params[id];
  const DType sd = I.reg.cfg.strata.optimizer_state_dtype;
  const engine::Bounce b = I.grads.bounce();
  const uint64_t n = p.shard.size();
  for (uint64_t off = 0; off < n; off += b.elems) {
    const uint64_t cnt = std::min(b.elems, n - off);
    Status st = narrow_from_f32(src + p.shard.begin + off, sd, cnt, b.compute);
    if (st.ok()) st = I.reg.write_array(*a, dtype_size(sd), off, cnt, b.compute);
    if (!st.ok()) return st.with_context(fmt::format("engine: load_state({}, {})", p.name, k));
  }
  return {};
}

Result<int64_t> Engine::param_steps(ParamId id) const {
  const ParamState& p = impl_->reg.params[id];
  if (!p.trainable)
    return Status(StatusCode::kInvalidArgument, fmt::format("engine: param_steps({}): frozen, no optimizer state", p.name));
  return p.updates;
}

Status Engine::set_param_steps(ParamId id, int64_t steps) {
  Impl& I = *impl_;
  ParamState& p = I.reg.params[id];
  if (!p.trainable)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: set_param_steps({}): frozen, no optimizer state", p.name));
  if (steps < 0 || steps > I.stepper.steps())
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: set_param_steps({}, {}): must be 0..{} (the engine's steps)", p.name, steps,
                              I.stepper.steps()));
  if (I.micro_index >= 0)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: set_param_steps({}): only between steps", p.name));
  I.stepper.wait_idle();  // a pipelined step's updates read the counts
  p.updates = steps;
  return {};
}

// ---------------------------------------------------------------- the training protocol

Status Engine::begin_micro_batch(bool last) {
  Impl& I = *impl_;
  if (I.uploader.acquired_count() > 0)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: begin_micro_batch with {} group(s) still acquired", I.uploader.acquired_count()));
  // overlap_backward updates each group once the last micro-batch reduced
  // it: a micro-batch after that one would reduce into groups already
  // updated (its gradients lost, with no error).
  if (I.overlap_running)
    return Status(StatusCode::kInvalidArgument,
                  "engine: begin_micro_batch after the micro-batch that ended the accumulation (last) with "
                  "strata.overlap_backward: the optimizer is already updating the groups it reduced; step() first, "
                  "or discard_step()");
  STRATA_RETURN_IF_ERROR(I.errors.take());
  ++I.micro_index;
  if (last && I.reg.cfg.strata.overlap_backward) {
    I.overlap_running = true;
    I.stepper.begin_overlap(I.micro_index + 1);
  }
  return {};
}

Result<GroupView> Engine::acquire(GroupId gid, DeviceStream* stream) {
  Impl& I = *impl_;
  if (gid >= I.reg.groups.size())
    return Status(StatusCode::kInvalidArgument, fmt::format("engine: acquire: no group {}", gid));
  const std::string& name = I.reg.groups[gid].name;
  if (I.uploader.holds(gid) >= kMaxHolds)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: acquire({}): held {} times without a release (a release is missing)", name,
                              kMaxHolds));
  if (stream == nullptr) return Status(StatusCode::kInvalidArgument, "engine: acquire: null stream");
  if (I.overlap_running && I.stepper.update_started(gid))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: acquire({}): its optimizer update already started (overlap_backward: every "
                              "parameter of the group was reduced in the last micro-batch)",
                              name));
  STRATA_RETURN_IF_ERROR(I.errors.take());
  return I.uploader.acquire(gid, stream);
}

Result<void*> Engine::held_ptr(ParamId id) const {
  const Impl& I = *impl_;
  const GroupId g = I.reg.params[id].group;
  if (!I.uploader.acquired(g))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: {}: its group {} is not acquired", I.reg.params[id].name, I.reg.groups[g].name));
  const auto& ps = I.reg.groups[g].params;
  const size_t i = static_cast<size_t>(std::find(ps.begin(), ps.end(), id) - ps.begin());
  return I.uploader.view(g, i);
}

Status Engine::release(GroupId gid, DeviceStream* stream) {
  Impl& I = *impl_;
  if (gid >= I.reg.groups.size())
    return Status(StatusCode::kInvalidArgument, fmt::format("engine: release: no group {}", gid));
  if (!I.uploader.acquired(gid))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: release({}): not acquired", I.reg.groups[gid].name));
  if (stream == nullptr) return Status(StatusCode::kInvalidArgument, "engine: release: null stream");
  return I.uploader.release(gid, stream);
}

Status Engine::reduce_grad(ParamId id, const void* grad, DType dtype, DeviceStream* stream) {
  Impl& I = *impl_;
  if (id >= I.reg.params.size())
    return Status(StatusCode::kInvalidArgument, fmt::format("engine: reduce_grad: no parameter {}", id));
  const engine::ParamState& p = I.reg.params[id];
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: reduce_grad({}): gradient dtype must be fp32, bf16 or fp16", p.name));
  if (grad == nullptr || stream == nullptr)
    return Status(StatusCode::kInvalidArgument, fmt::format("engine: reduce_grad({}): null buffer or stream", p.name));
  if (!p.trainable)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: reduce_grad({}): the parameter is frozen (ParamSpec::trainable false): it has "
                              "no gradient",
                              p.name));
  STRATA_RETURN_IF_ERROR(I.errors.take());
  if (I.micro_index < 0) STRATA_RETURN_IF_ERROR(begin_micro_batch(I.reg.cfg.gradient_accumulation_steps <= 1));
  // Pipelined step: the previous step's update of this group reads the
  // accumulator (it is done long before, unless the trainer skipped forward).
  if (I.stepper.pipelined()) STRATA_RETURN_IF_ERROR(I.stepper.wait_group(p.group));
  STRATA_RETURN_IF_ERROR(I.grads.reduce(id, grad, dtype, stream, I.micro_index));
  // Overlap: the group's update may start once its last parameter's pieces are accumulated.
  if (I.overlap_running && I.stepper.count_reduced(p.group)) STRATA_RETURN_IF_ERROR(I.grads.queue_group_done(p.group));
  return I.grads.end_reduce(stream);
}

Status Engine::discard_step(DeviceStream* stream) {
  Impl& I = *impl_;
  if (I.overlap_running)
    for (GroupId g = 0; g < I.reg.groups.size(); ++g)
      if (I.stepper.update_started(g))
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("engine: discard_step: the optimizer already updated group {} in this step "
                                  "(overlap_backward): the weights moved; load a checkpoint instead",
                                  I.reg.groups[g].name));
  Status st;
  if (I.uploader.acquired_count() > 0) {
    if (stream == nullptr) return Status(StatusCode::kInvalidArgument, "engine: discard_step: null stream");
    for (GroupId g = 0; g < I.reg.groups.size(); ++g)
      while (I.uploader.acquired(g)) {
        Status r = I.uploader.release(g, stream);
        if (st.ok() && !r.ok()) st = r.with_context("engine: discard_step: releasing " + I.reg.groups[g].name);
      }
  }
  Status w = I.wait_idle();
  if (st.ok()) st = w;
  (void)I.errors.take();  // the abandoned work's errors go with it
  I.reset_step();
  return st;
}

void Engine::set_lr(double lr) { impl_->stepper.set_lr(lr); }

Status Engine::set_group_lr(uint32_t lr_group, double lr) { return impl_->stepper.set_group_lr(lr_group, lr); }

Status Engine::set_group_betas(uint32_t lr_group, double beta1, double beta2) {
  return impl_->stepper.set_group_betas(lr_group, beta1, beta2);
}

bool Engine::pipelined_step() const { return impl_->stepper.pipelined(); }

Status Engine::synchronize() {
  Impl& I = *impl_;
  Status st = I.wait_idle();
  Status ae = I.errors.take();
  return st.ok() ? ae : st;
}

Result<StepResult> Engine::step(double lr) {
  Impl& I = *impl_;
  const auto t0 = std::chrono::steady_clock::now();
  if (I.uploader.acquired_count() > 0)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: step() with {} group(s) still acquired", I.uploader.acquired_count()));
  // Refused before anything runs (the update would fail in the background
  // and leave the engine broken).
  if (!std::isfinite(lr))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: step({}): the lr must be finite (>= 0, or < 0 to keep the current one)", lr));
  if (I.broken)
    return Status(I.broken_status.code(),
                  fmt::format("engine: an earlier step failed ({}); the state may be torn: load a checkpoint "
                              "before stepping again",
                              I.broken_status.message()));
  auto fail = [&](Status st) {
    I.broken = true;
    I.broken_status = st;
    I.uploader.drop_handoffs();
    I.reset_step();
    return st;
  };
  if (!I.grads.torn().empty())
    return Status(StatusCode::kInvalidArgument,
                  "engine: step(): this step's gradients are torn (" + I.grads.torn() +
                      "): discard_step() and run the step's micro-batches again");
  Status st = I.wait_idle();
  Status ae = I.errors.take();
  if (st.ok()) st = ae;
  // Stage 1: the ranks' summed micro-batches meet once, here.
  if (st.ok() && I.reg.defer_reduce) {
    st = I.grads.reduce_deferred();
    Status e2 = I.errors.take();
    if (st.ok()) st = e2;
  }
  if (!st.ok()) return fail(st);
  const bool overlap = I.overlap_running;
  const double lr_used = I.stepper.begin_step(overlap, lr);
  const int64_t micro = std::max<int64_t>(1, I.micro_index + 1);
  Status z = I.grads.zero_unwritten();
  if (!z.ok()) return fail(z);
  // The next forward's first NVMe-homed groups take the optimizer's output
  // as it is made instead of reading it back (one pass over every group:
  // not with overlap_backward, whose groups update one by one in backward).
  if (!overlap) I.stepper.expect_handoff(I.uploader.plan_handoff(), I.uploader.handoff_dst());
  StepResult r;
  // A parameter no micro-batch of this step reduced is left alone (torch
  // skips a parameter whose grad is None): no update, no decay.
  Status u = I.stepper.update(overlap, lr_used, micro, I.grads.bounce(), r,
                              [&I](ParamId p) { return I.grads.written(p); });
  if (!u.ok()) return fail(u);
  I.uploader.end_step();
  I.reset_step();
  I.stepper.finish_step(r);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// ---------------------------------------------------------------- observability

EngineStats Engine::stats() const {
  const Impl& I = *impl_;
  EngineStats s;
  for (int t = 0; t < 4; ++t) s.tier_bytes[t] = I.reg.plan.tier_bytes(static_cast<Tier>(t));
  s.device_buffer_bytes = I.uploader.device_buffer_bytes();
  s.pinned_bytes = I.reg.pool ? I.reg.pool->used_bytes() : 0;
  s.nvme_read_bytes = I.reg.traffic.nvme_read.load(std::memory_order_relaxed);
  s.nvme_write_bytes = I.reg.traffic.nvme_write.load(std::memory_order_relaxed);
  s.h2d_bytes = I.reg.traffic.h2d.load(std::memory_order_relaxed);
  s.d2h_bytes = I.reg.traffic.d2h.load(std::memory_order_relaxed);
  s.acquires = I.uploader.acquires();
  s.prefetch_hits = I.uploader.hits();
  s.prefetch_misses = I.uploader.misses();
  s.order_changes = I.uploader.order_changes();
  s.gathers_ahead = I.uploader.gathers_ahead();
  s.gathers_reused = I.uploader.gathers_reused();
  s.optimizer_handoffs = I.uploader.handoffs();
  s.optimizer_read_ahead = I.stepper.read_ahead_hits();
  s.comm_bytes = I.reg.traffic.comm.load(std::memory_order_relaxed);
  s.hot_path_allocs = I.hot_allocs.load(std::memory_order_relaxed);
  s.steps = I.stepper.steps_published();
  s.skipped_steps = I.stepper.skipped_steps();
  return s;
}

Tracer* Engine::tracer() { return impl_->reg.tracer.get(); }

void Engine::trace_begin(const char* name) {
  Impl& I = *impl_;
  if (!I.reg.tracer) return;
  std::lock_guard<std::mutex> lock(I.trace_mu);
  I.trace_stack.push_back(Tracer::now_ns());
  I.trace_names.push_back(name);
}

void Engine::trace_end() {
  Impl& I = *impl_;
  if (!I.reg.tracer) return;
  std::lock_guard<std::mutex> lock(I.trace_mu);
  if (I.trace_stack.empty()) return;
  I.reg.tracer->complete_copy(I.trace_names.back(), trace_cat::kCompute, I.trace_stack.back(), Tracer::now_ns());
  I.trace_stack.pop_back();
  I.trace_names.pop_back();
}

double Engine::loss_scale() const { return impl_->stepper.loss_scale(); }
int64_t Engine::step_count() const { return impl_->stepper.steps(); }

}  // namespace strata
