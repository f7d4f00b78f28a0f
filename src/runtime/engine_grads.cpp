// The gradient path (reduce_grad: device -> pinned on the download stream,
// fp32 accumulation on the accumulator thread), the step (norm, loss scale,
// clipping, optimizer per group) and the overlap-with-backward mode.
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstring>

#include "common/float_convert.h"
#include "common/log.h"
#include "runtime/engine_impl.h"

namespace strata {

namespace {
// dst[i] += float(src[i]): the one accumulation formula of every tier.
void add_f32(float* dst, const void* src, DType dtype, uint64_t n) {
  switch (dtype) {
    case DType::kF32: {
      const float* s = static_cast<const float*>(src);
      for (uint64_t i = 0; i < n; ++i) dst[i] = dst[i] + s[i];
      return;
    }
    case DType::kBF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (uint64_t i = 0; i < n; ++i) dst[i] = dst[i] + bf16_bits_to_f32(s[i]);
      return;
    }
    default: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (uint64_t i = 0; i < n; ++i) dst[i] = dst[i] + f16_bits_to_f32(s[i]);
      return;
    }
  }
}
}  // namespace

void Engine::Impl::accumulator_main() {
  for (;;) {
    AccumJob j;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return stopping || !accum_queue.empty(); });
      if (accum_queue.empty()) return;
      j = accum_queue.front();
      accum_queue.pop_front();
      accum_busy = true;
    }
    Status st;
    if (j.kind == AccumJob::kAccum) st = accumulate(j);
    {
      std::lock_guard<std::mutex> lock(mu);
      if (j.kind == AccumJob::kAccum) dl_free.push_back(j.slot);
      else opt_queue.push_back(j.group);  // every accumulation of the group is done
      if (!st.ok() && async_error.ok()) async_error = st;
      accum_busy = false;
    }
    cv.notify_all();
  }
}

Status Engine::Impl::accumulate(const AccumJob& j) {
  ParamState& p = params[j.param];
  const void* src = dl[j.slot].data();
  TraceSpan span(tracer.get(), "accumulate", trace_cat::kOptim, {{"elements", j.count}, {"first", int{j.first}}});
  if (p.grad.tier == Tier::kHost) {
    float* dst = static_cast<float*>(p.grad.ptr) + j.offset;
    if (j.first) widen_to_f32(src, j.dtype, j.count, dst);
    else add_f32(dst, src, j.dtype, j.count);
    return {};
  }
  // NVMe: the same arithmetic through the scratch buffer.
  float* buf = scratch.as<float>();
  const uint64_t bytes = j.count * 4;
  if (j.first) {
    widen_to_f32(src, j.dtype, j.count, buf);
  } else {
    const uint64_t t0 = Tracer::now_ns();
    Status st = sync_io(store->read(p.grad.swap, j.offset * 4, bytes, buf), false, bytes);
    if (!st.ok()) return st.with_context(fmt::format("engine: reading the gradient of {} (elements {}..{})", p.name,
                                                    j.offset, j.offset + j.count));
    if (tracer) tracer->complete("nvme_read", trace_cat::kIo, t0, Tracer::now_ns(), {{"bytes", bytes}});
    add_f32(buf, src, j.dtype, j.count);
  }
  const uint64_t t0 = Tracer::now_ns();
  Status st = sync_io(store->write(p.grad.swap, j.offset * 4, bytes, buf), true, bytes);
  if (!st.ok()) return st.with_context(fmt::format("engine: writing the gradient of {} (elements {}..{})", p.name,
                                                  j.offset, j.offset + j.count));
  if (tracer) tracer->complete("nvme_write", trace_cat::kIo, t0, Tracer::now_ns(), {{"bytes", bytes}});
  return {};
}

void Engine::Impl::optimizer_main() {
  for (;;) {
    GroupId g;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return stopping || !opt_queue.empty(); });
      if (opt_queue.empty()) return;
      g = opt_queue.front();
      opt_queue.pop_front();
      opt_busy = true;
    }
    run_group_update(g);
    {
      std::lock_guard<std::mutex> lock(mu);
      opt_busy = false;
    }
    cv.notify_all();
  }
}

cpu_optim::OptimizerConfig Engine::Impl::optimizer_config(double lr, double grad_scale) const {
  cpu_optim::OptimizerConfig c = opt_config;
  c.lr = lr;
  c.grad_scale = grad_scale;
  return c;
}

Status Engine::Impl::group_stats(GroupId gi, double scale) {
  GroupState& g = groups[gi];
  auto r = opt->grad_stats(g.tensors, scale);
  if (!r.ok()) return r.status().with_context(fmt::format("engine: gradient norm of group {}", g.name));
  g.sum_sq = r->sum_sq;
  g.nonfinite = r->has_inf_nan;
  return {};
}

// Overlap mode: one group's update with the scale and clipping coefficient
// fixed when the last micro-batch began.
void Engine::Impl::run_group_update(GroupId gi) {
  GroupState& g = groups[gi];
  Status st = group_stats(gi, overlap_scale);
  if (st.ok()) {
    if (g.nonfinite) {
      g.skipped = true;
    } else {
      st = opt->step_part(optimizer_config(overlap_lr, overlap_scale * overlap_coef), overlap_step, g.tensors);
      if (!st.ok()) st = st.with_context(fmt::format("engine: optimizer step {} of group {}", overlap_step, g.name));
    }
  }
  g.updated = true;
  if (!st.ok()) set_async_error(st);
}

Status Engine::Impl::wait_idle() {
  Status st = dev->synchronize(download);
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] {
      return accum_queue.empty() && !accum_busy && opt_queue.empty() && !opt_busy && upload_queue.empty() &&
             !upload_busy;
    });
  }
  Status up = dev->synchronize(upload);
  if (st.ok()) st = up;
  return st;
}

void Engine::Impl::scaler_update(bool overflow) {
  const Fp16Config& f = cfg.fp16;
  if (overflow) {
    if (f.hysteresis <= 1 || scaler.hysteresis <= 1) scaler.scale = std::max(scaler.scale / 2, f.min_loss_scale);
    else --scaler.hysteresis;
    scaler.last_overflow_iter = scaler.iter;
  } else {
    if (f.consecutive_hysteresis) scaler.hysteresis = f.hysteresis;
    if ((scaler.iter - scaler.last_overflow_iter) % f.loss_scale_window == 0) {
      if (!f.consecutive_hysteresis) scaler.hysteresis = f.hysteresis;
      scaler.scale *= 2;
    }
  }
  ++scaler.iter;
}

Status Engine::reduce_grad(ParamId id, const void* grad, DType dtype, DeviceStream* stream) {
  Impl& I = *impl_;
  if (id >= I.params.size())
    return Status(StatusCode::kInvalidArgument, fmt::format("engine: reduce_grad: no parameter {}", id));
  ParamState& p = I.params[id];
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: reduce_grad({}): gradient dtype must be fp32, bf16 or fp16", p.name));
  if (grad == nullptr || stream == nullptr)
    return Status(StatusCode::kInvalidArgument, fmt::format("engine: reduce_grad({}): null buffer or stream", p.name));
  STRATA_RETURN_IF_ERROR(I.take_async_error());
  if (I.micro_index < 0) STRATA_RETURN_IF_ERROR(begin_micro_batch(I.cfg.gradient_accumulation_steps <= 1));
  if (p.reduced_micro == I.micro_index)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: reduce_grad({}): reduced twice in micro-batch {}", p.name, I.micro_index));
  p.reduced_micro = I.micro_index;
  const bool first = !p.grad_written;
  p.grad_written = true;
  GroupState& g = I.groups[p.group];
  STRATA_RETURN_IF_ERROR(I.dev->record(I.ev_caller, stream));
  STRATA_RETURN_IF_ERROR(I.dev->wait(I.download, I.ev_caller));
  const size_t esz = dtype_size(dtype);
  const uint64_t n = p.shard.size();
  for (uint64_t off = 0; off < n; off += I.piece_elems) {
    const uint64_t cnt = std::min(I.piece_elems, n - off);
    uint32_t slot;
    {
      std::unique_lock<std::mutex> lock(I.mu);
      while (I.dl_free.empty()) {
        if (I.cv.wait_for(lock, std::chrono::milliseconds(50)) == std::cv_status::timeout) {
          lock.unlock();
          auto q = I.dev->query(I.download);
          if (!q.ok()) return q.status().with_context(fmt::format("engine: reduce_grad({})", p.name));
          lock.lock();
        }
      }
      slot = I.dl_free.back();
      I.dl_free.pop_back();
    }
    STRATA_RETURN_IF_ERROR(I.traced_copy(I.dl[slot].data(), static_cast<const char*>(grad) + (p.shard.begin + off) * esz,
                                         cnt * esz, CopyKind::kDeviceToHost, I.download));
    I.d2h += cnt * esz;
    AccumJob j;
    j.kind = AccumJob::kAccum;
    j.slot = slot;
    j.param = id;
    j.group = p.group;
    j.offset = off;
    j.count = cnt;
    j.dtype = dtype;
    j.first = first;
    Impl* ip = &I;
    STRATA_RETURN_IF_ERROR(I.dev->host_func_async(I.download, [ip, j] {
      {
        std::lock_guard<std::mutex> lock(ip->mu);
        ip->accum_queue.push_back(j);
      }
      ip->cv.notify_all();
      return Status();
    }));
  }
  if (I.overlap_running && ++g.reduced_last == g.params.size()) {
    g.queued = true;
    AccumJob j;
    j.kind = AccumJob::kGroupDone;
    j.group = p.group;
    Impl* ip = &I;
    STRATA_RETURN_IF_ERROR(I.dev->host_func_async(I.download, [ip, j] {
      {
        std::lock_guard<std::mutex> lock(ip->mu);
        ip->accum_queue.push_back(j);
      }
      ip->cv.notify_all();
      return Status();
    }));
  }
  STRATA_RETURN_IF_ERROR(I.dev->record(I.ev_download, I.download));
  return I.dev->wait(stream, I.ev_download);
}

void Engine::set_lr(double lr) {
  if (lr >= 0) impl_->current_lr = lr;
}

Result<StepResult> Engine::step(double lr) {
  Impl& I = *impl_;
  const auto t0 = std::chrono::steady_clock::now();
  if (I.acquired_count > 0)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: step() with {} group(s) still acquired", I.acquired_count));
  if (I.broken)
    return Status(I.broken_status.code(),
                  fmt::format("engine: an earlier step failed ({}); the state may be torn: load a checkpoint "
                              "before stepping again",
                              I.broken_status.message()));
  auto reset_step = [&] {
    for (auto& p : I.params) {
      p.grad_written = false;
      p.reduced_micro = -1;
    }
    I.micro_index = -1;
    I.overlap_running = false;
  };
  auto fail = [&](Status st) {
    I.broken = true;
    I.broken_status = st;
    reset_step();
    return st;
  };
  Status st = I.wait_idle();
  Status ae = I.take_async_error();
  if (st.ok()) st = ae;
  if (!st.ok()) return fail(st);
  const bool overlap = I.overlap_running;
  const double lr_used = overlap ? I.overlap_lr : (lr >= 0 ? lr : I.current_lr);
  if (lr >= 0) I.current_lr = lr;
  const int64_t micro = std::max<int64_t>(1, I.micro_index + 1);
  // A parameter no micro-batch reduced has a zero gradient this step.
  for (ParamId id = 0; id < I.params.size(); ++id)
    if (!I.params[id].grad_written) {
      Status z = I.zero_grad(id);
      if (!z.ok()) return fail(z.with_context("engine: zeroing an unreduced gradient"));
    }
  StepResult r;
  r.lr = lr_used;
  bool updated_any = false;
  if (overlap) {
    for (GroupId g = 0; g < I.groups.size(); ++g)
      if (!I.groups[g].updated) I.run_group_update(g);
    Status e = I.take_async_error();
    if (!e.ok()) return fail(e);
    double sum = 0;
    for (auto& g : I.groups) {
      sum += g.sum_sq;
      if (g.skipped) ++r.skipped_groups;
    }
    r.grad_norm = std::sqrt(sum);
    r.clip_coef = I.overlap_coef;
    updated_any = r.skipped_groups < I.groups.size();
    r.skipped = !updated_any;
    if (std::isfinite(r.grad_norm)) I.prev_norm = r.grad_norm;
    if (r.skipped_groups > 0)
      log_warn("engine: step {}: {} group(s) had non-finite gradients and were not updated", I.overlap_step,
               r.skipped_groups);
  } else {
    const double scale = 1.0 / (static_cast<double>(micro) * I.scaler.scale);
    double sum = 0;
    bool nonfinite = false;
    for (GroupId g = 0; g < I.groups.size(); ++g) {
      Status s = I.group_stats(g, scale);
      if (!s.ok()) return fail(s);
      sum += I.groups[g].sum_sq;
      nonfinite = nonfinite || I.groups[g].nonfinite;
    }
    r.grad_norm = std::sqrt(sum);
    if (nonfinite) {
      r.skipped = true;
      if (I.scaler.dynamic) I.scaler_update(true);
      else if (!I.cfg.fp16.enabled)
        log_warn("engine: step {}: non-finite gradients; the step is skipped", I.steps + 1);
    } else {
      const double clip = I.cfg.gradient_clipping;
      r.clip_coef = clip > 0 ? std::min(1.0, clip / (r.grad_norm + 1e-6)) : 1.0;
      const auto oc = I.optimizer_config(lr_used, scale * r.clip_coef);
      for (auto& g : I.groups) {
        Status s = I.opt->step_part(oc, I.steps + 1, g.tensors);
        if (!s.ok()) return fail(s.with_context(fmt::format("engine: optimizer step {} of group {}", I.steps + 1, g.name)));
      }
      updated_any = true;
      if (I.scaler.dynamic) I.scaler_update(false);
      I.prev_norm = r.grad_norm;
    }
  }
  if (updated_any) {
    ++I.steps;
    for (ParamId id = 0; id < I.params.size(); ++id) {
      if (!I.params[id].refresh_from_master) continue;
      if (overlap && I.groups[I.params[id].group].skipped) continue;
      Status s = I.refresh_compute(id);
      if (!s.ok()) return fail(s.with_context("engine: updating the compute copy of " + I.params[id].name));
    }
  } else {
    ++I.skipped_steps;
  }
  // Cached device copies are stale now; the acquires of this step become the order.
  I.invalidate_slots();
  if (!I.current.empty()) {
    if (!I.recording && !I.order_broken && I.current != I.order) ++I.order_changes;
    if (I.recording || I.order_broken || I.current != I.order) I.order = I.current;
    I.recording = false;
  }
  I.order_broken = false;
  I.current.clear();
  reset_step();
  // The next step's first groups start uploading now (from the updated
  // compute copies), so its first acquire does not wait for them.
  I.issue_prefetch();
  I.first_step_done = true;
  I.steps_atomic.store(I.steps, std::memory_order_relaxed);
  r.step = I.steps;
  r.loss_scale = I.scaler.scale;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace strata
