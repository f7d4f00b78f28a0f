// The gradient path: reduce_grad's downloads and the accumulator thread
// (see grad_path.h).
#include "runtime/engine/grad_path.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "common/float_convert.h"
#include "common/log.h"
#include "common/threads.h"
#include "common/units.h"
#include "cpu_optim/optimizer.h"

namespace strata::engine {

// ---------------------------------------------------------------- creation

Status GradPath::prepare() {
  params_.resize(reg_.params.size());
  // Pieces start at multiples of the norm's blocks (and of the I/O quantum:
  // both powers of two, which grad_piece_elems' 32 Ki divides), so each
  // piece's squares land in whole blocks.
  piece_elems_ = reg_.plan.grad_piece_elems;
  pieces_ = reg_.plan.grad_download_pieces();  // bounce() takes two
  if (piece_elems_ == 0 || piece_elems_ % std::max<uint64_t>(reg_.io_quantum, cpu_optim::kNormBlock) != 0)
    return Status(StatusCode::kInternal, fmt::format("engine: gradient piece of {} elements is not a multiple of the "
                                                     "I/O quantum ({}) and the norm block ({})",
                                                     piece_elems_, reg_.io_quantum, cpu_optim::kNormBlock));
  const std::optional<bool> want = reg_.cfg.strata.gradient_staging;
  const std::optional<bool> narrow = reg_.cfg.strata.gradient_in_compute_dtype;
  if (reg_.world > 1) {
    // N ranks: staged as the plan decided (it fell back when the device
    // budget could not hold the send buffers).
    if (want.value_or(false) && reg_.defer_reduce)
      return Status(StatusCode::kInvalidArgument,
                    "engine: strata.gradient_staging is true with zero_optimization.stage 1, whose reduce_grad adds "
                    "the gradient into this rank's own device sum (reduce-scattered at step()): nothing to stage; "
                    "leave it unset");
    if (want.value_or(false) && !reg_.plan.grad_staged)
      return Status(StatusCode::kOutOfBudget,
                    "engine: strata.gradient_staging is true but the device budget has no room for the "
                    "reduce-scatter's send buffers (see strata plan); leave it unset or raise the device budget");
    if (narrow.value_or(false))
      return Status(StatusCode::kInvalidArgument,
                    "engine: strata.gradient_in_compute_dtype is true with N ranks, whose reduce-scatter sums the "
                    "gradients in fp32; leave it unset");
    staging_ = reg_.plan.grad_staged && !reg_.defer_reduce;
    narrow_ = false;
  } else {
    staging_ = want.value_or(reg_.dev->kind() == DeviceKind::kCuda);
    if (narrow.value_or(false) && !staging_)
      return Status(StatusCode::kInvalidArgument,
                    "engine: strata.gradient_in_compute_dtype is true but gradients are not staged (the rounding "
                    "happens in the staging copy): set strata.gradient_staging true, or leave "
                    "gradient_in_compute_dtype unset");
    narrow_ = staging_ && narrow.value_or(true);
  }
  STRATA_ASSIGN_OR_RETURN(download_, reg_.dev->create_stream("strata download"));
  STRATA_ASSIGN_OR_RETURN(ev_caller_, reg_.dev->create_event());
  STRATA_ASSIGN_OR_RETURN(ev_download_, reg_.dev->create_event());
  for (uint32_t i = 0; i < pieces_; ++i) {
    STRATA_ASSIGN_OR_RETURN(DeviceEvent * e, reg_.dev->create_event());
    ready_.push_back(e);
  }
  if (staging_) {
    STRATA_ASSIGN_OR_RETURN(stage_stream_, reg_.dev->create_stream("strata grad stage"));
    for (uint32_t i = 0; i < pieces_; ++i) {
      STRATA_ASSIGN_OR_RETURN(DeviceEvent * e, reg_.dev->create_event());
      staged_.push_back(e);
    }
  }
  return {};
}

Status GradPath::allocate() {
  for (uint32_t i = 0; i < pieces_; ++i) {
    STRATA_ASSIGN_OR_RETURN(auto buf, reg_.pool->allocate(piece_elems_ * 4));
    dl_.push_back(std::move(buf));
    dl_free_.push_back(i);
  }
  STRATA_ASSIGN_OR_RETURN(scratch_, reg_.pool->allocate(piece_elems_ * 4));
  for (ParamId id = 0; id < reg_.params.size(); ++id)
    if (reg_.params[id].trainable)
      params_[id].block_sq.assign(round_up(reg_.params[id].shard.size(), cpu_optim::kNormBlock) / cpu_optim::kNormBlock, 0.0);
  if (reg_.world > 1) {
    // The plan's reduce_buffers: staged, a send buffer per piece; else one.
    const uint64_t send_bytes = piece_elems_ * 4 * reg_.world;
    if (staging_) {
      auto b = reg_.dev->alloc(send_bytes * pieces_);
      if (!b.ok())
        return b.status().with_context(fmt::format(
            "engine: the gradients' reduce-scatter send buffers ({} x {} on the device, planned; "
            "strata.gradient_staging false does with one)",
            pieces_, format_bytes(send_bytes)));
      stage_block_ = *b;
      for (uint32_t i = 0; i < pieces_; ++i) stage_.push_back(static_cast<char*>(stage_block_) + i * send_bytes);
    } else {
      STRATA_ASSIGN_OR_RETURN(void* send, reg_.dev->alloc(send_bytes));
      send_ = static_cast<float*>(send);
    }
    STRATA_ASSIGN_OR_RETURN(void* recv, reg_.dev->alloc(piece_elems_ * 4));
    recv_ = static_cast<float*>(recv);
  }
  if (reg_.defer_reduce) {
    // Stage 1: every trainable parameter's whole gradient, fp32 (the plan's
    // local_grad_bytes).
    uint64_t total = 0;
    for (const ParamState& p : reg_.params)
      if (p.trainable) total += round_up(p.numel * 4, 256);
    auto b = reg_.dev->alloc(std::max<uint64_t>(total, 256));
    if (!b.ok())
      return b.status().with_context(fmt::format(
          "engine: zero_optimization.stage 1 sums each rank's whole gradient on the device ({})", format_bytes(total)));
    local_block_ = *b;
    local_.assign(reg_.params.size(), nullptr);
    uint64_t off = 0;
    for (ParamId id = 0; id < reg_.params.size(); ++id) {
      if (!reg_.params[id].trainable) continue;
      local_[id] = reinterpret_cast<float*>(static_cast<char*>(local_block_) + off);
      off += round_up(reg_.params[id].numel * 4, 256);
    }
  }
  for (uint32_t i = 0; staging_ && reg_.world == 1 && i < pieces_; ++i) {
    auto b = reg_.dev->alloc(piece_elems_ * 4);
    if (b.ok()) {
      stage_.push_back(*b);
      continue;
    }
    if (reg_.cfg.strata.gradient_staging.has_value())  // asked for: an error
      return b.status().with_context(fmt::format("engine: gradient staging buffers ({} x {} on the device; "
                                                 "strata.gradient_staging false does without)",
                                                 pieces_, format_bytes(piece_elems_ * 4)));
    // The default: without staging (the caller's stream waits for the downloads).
    log_info("engine: no gradient staging ({} x {} of device memory refused: {}); reduce_grad's caller waits for "
             "the downloads",
             pieces_, format_bytes(piece_elems_ * 4), b.status().message());
    for (void* p : stage_) (void)reg_.dev->free(p);
    stage_.clear();
    staging_ = false;
  }
  return {};
}

Status GradPath::start(std::function<void(GroupId)> on_group_done) {
  on_group_done_ = std::move(on_group_done);
  return queue_.start("accumulator", [this](const Job& j) { accumulator_main(j); });
}

void GradPath::stop() {
  queue_.stop();
}

GradPath::~GradPath() {
  stop();
  dl_.clear();
  scratch_.reset();
  if (reg_.dev != nullptr) {
    if (stage_stream_) (void)reg_.dev->synchronize(stage_stream_);
    if (download_) (void)reg_.dev->synchronize(download_);
    reg_.dev->destroy_event(ev_caller_);
    reg_.dev->destroy_event(ev_download_);
    for (DeviceEvent* e : ready_) reg_.dev->destroy_event(e);
    for (DeviceEvent* e : staged_) reg_.dev->destroy_event(e);
    if (stage_block_) (void)reg_.dev->free(stage_block_);
    else
      for (void* b : stage_) (void)reg_.dev->free(b);
    if (stage_stream_) (void)reg_.dev->destroy_stream(stage_stream_);
    if (download_) (void)reg_.dev->destroy_stream(download_);
    if (send_) (void)reg_.dev->free(send_);
    if (recv_) (void)reg_.dev->free(recv_);
    if (local_block_) (void)reg_.dev->free(local_block_);
  }
}

// ---------------------------------------------------------------- the accumulator thread

void GradPath::accumulator_main(const Job& j) {
  Status st;
  if (j.kind == Job::kAccum) st = run_guarded("engine: accumulating a gradient", [&] { return accumulate(j); });
  errors_.set(st);  // before the piece is free: whoever sees the piece sees the error
  if (j.kind == Job::kAccum) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      dl_free_.push_back(j.slot);
    }
    cv_.notify_all();
  } else {
    on_group_done_(j.group);  // every accumulation of the group is done
  }
}

Status GradPath::accumulate(const Job& j) {
  ParamState& p = reg_.params[j.param];
  Tracer* tracer = reg_.tracer.get();
  {
    TraceSpan wait(tracer, "wait_download", trace_cat::kRuntime);
    Status st = reg_.dev->synchronize(ready_[j.slot]);
    if (!st.ok())
      return st.with_context(fmt::format("engine: downloading the gradient of {} (elements {}..{})", p.name, j.offset,
                                         j.offset + j.count));
  }
  if (j.count == 0) return {};  // N ranks: a piece wholly in this rank's padding
  const void* src = dl_[j.slot].data();
  TraceSpan span(tracer, "accumulate", trace_cat::kOptim, {{"elements", j.count}, {"first", int{j.first}}});
  // The squares of the new sums go to the piece's norm blocks (pieces start
  // at multiples of the block): at step time the blocks hold the final
  // gradient's, whatever the number of micro-batches.
  double* block_sq = params_[j.param].block_sq.data() + j.offset / cpu_optim::kNormBlock;
  if (p.grad.tier == Tier::kHost) {
    float* dst = static_cast<float*>(p.grad.ptr) + j.offset;
    Status st = cpu_optim::accumulate(dst, src, j.dtype, j.count, j.first, block_sq);
    return st.ok() ? st : st.with_context("engine: accumulating the gradient of " + p.name);
  }
  // NVMe: the same arithmetic through the scratch buffer.
  float* buf = scratch_.as<float>();
  const uint64_t bytes = j.count * 4;
  if (!j.first) {
    const uint64_t t0 = Tracer::now_ns();
    Status st = reg_.sync_io(reg_.store->read(p.grad.swap, j.offset * 4, bytes, buf), false, bytes);
    if (!st.ok())
      return st.with_context(
          fmt::format("engine: reading the gradient of {} (elements {}..{})", p.name, j.offset, j.offset + j.count));
    if (tracer) tracer->complete("nvme_read", trace_cat::kIo, t0, Tracer::now_ns(), {{"bytes", bytes}});
  }
  Status acc = cpu_optim::accumulate(buf, src, j.dtype, j.count, j.first, block_sq);
  if (!acc.ok()) return acc.with_context("engine: accumulating the gradient of " + p.name);
  const uint64_t t0 = Tracer::now_ns();
  Status st = reg_.sync_io(reg_.store->write(p.grad.swap, j.offset * 4, bytes, buf), true, bytes);
  if (!st.ok())
    return st.with_context(
        fmt::format("engine: writing the gradient of {} (elements {}..{})", p.name, j.offset, j.offset + j.count));
  if (tracer) tracer->complete("nvme_write", trace_cat::kIo, t0, Tracer::now_ns(), {{"bytes", bytes}});
  return {};
}

// ---------------------------------------------------------------- driving thread

// One piece of the caller's gradient into the pinned piece dl_[slot]: with
// staging, a device copy on the stage stream first (the caller waits only for
// that), then the download from the staging buffer; on the host backend
// without staging, a memcpy on the download stream (the caller's gradient
// may be any host memory, e.g. a torch CPU tensor). Then the piece's event.
Status GradPath::download_piece(uint32_t slot, const void* src, DType given, DType sent, uint64_t cnt) {
  void* dst = dl_[slot].data();
  const size_t bytes = cnt * dtype_size(sent);
  if (staging_) {
    if (sent != given)  // rounded to the compute dtype on the way (round to nearest even)
      STRATA_RETURN_IF_ERROR(reg_.dev->cast_async(stage_[slot], sent, src, given, cnt, 1.0f, stage_stream_));
    else
      STRATA_RETURN_IF_ERROR(reg_.dev->copy_async(stage_[slot], src, bytes, CopyKind::kDeviceToDevice, stage_stream_));
    STRATA_RETURN_IF_ERROR(reg_.dev->record(staged_[slot], stage_stream_));
    STRATA_RETURN_IF_ERROR(reg_.dev->wait(download_, staged_[slot]));
    STRATA_RETURN_IF_ERROR(reg_.traced_copy(dst, stage_[slot], bytes, CopyKind::kDeviceToHost, download_));
  } else if (reg_.dev->kind() == DeviceKind::kHost) {
    Tracer* tr = reg_.tracer && reg_.tracer->enabled() ? reg_.tracer.get() : nullptr;
    const uint32_t track = reg_.trace_d2h;
    STRATA_RETURN_IF_ERROR(reg_.dev->host_func_async(download_, [dst, src, bytes, tr, track] {
      const uint64_t t0 = tr ? Tracer::now_ns() : 0;
      std::memcpy(dst, src, bytes);
      if (tr) tr->complete("d2h", trace_cat::kCopy, t0, Tracer::now_ns(), {{"bytes", uint64_t{bytes}}}, track);
      return Status();
    }));
  } else {
    STRATA_RETURN_IF_ERROR(reg_.traced_copy(dst, src, bytes, CopyKind::kDeviceToHost, download_));
  }
  return reg_.dev->record(ready_[slot], download_);
}

// A failed call changes nothing when no piece was queued yet (the usual case:
// the first copy is refused), and the caller may retry; a failure after some
// pieces were queued leaves this step's gradient of p torn: torn() says so
// and the step must be discarded (Engine::discard_step). Every piece buffer
// taken is given back on every path (a failed call never leaks one).
Status GradPath::reduce(ParamId id, const void* grad, DType dtype, DeviceStream* stream, int64_t micro_index) {
  ParamState& p = reg_.params[id];
  ParamGrad& pg = params_[id];
  if (pg.reduced_micro == micro_index)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: reduce_grad({}): reduced twice in micro-batch {}", p.name, micro_index));
  const bool first = !pg.written;
  STRATA_RETURN_IF_ERROR(reg_.dev->record(ev_caller_, stream));
  STRATA_RETURN_IF_ERROR(reg_.dev->wait(staging_ ? stage_stream_ : download_, ev_caller_));
  const size_t esz = dtype_size(dtype);
  const uint64_t n = p.shard.size();
  // What crosses to the host: the gradient as given, or an fp32 one rounded
  // to the parameter's 16-bit compute dtype (strata.gradient_in_compute_dtype).
  const DType sent = narrow_ && dtype == DType::kF32 && dtype_size(p.dtype) == 2 ? p.dtype : dtype;
  uint64_t queued = 0;
  auto give_back = [&](uint32_t slot) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      dl_free_.push_back(slot);
    }
    cv_.notify_all();
  };
  auto failed = [&](Status st) {
    if (queued == 0)
      return st.with_context(fmt::format("engine: reduce_grad({}): nothing was accumulated; the call may be retried",
                                         p.name));
    pg.reduced_micro = micro_index;
    pg.written = true;
    torn_ = fmt::format("reduce_grad({}) failed after {} of its {} elements were queued ({})", p.name, queued, n,
                        st.message());
    return st.with_context(fmt::format("engine: reduce_grad({}): part of the gradient was accumulated; this step's "
                                       "gradients are torn: discard the step (Engine::discard_step)",
                                       p.name));
  };
  if (reg_.defer_reduce) {
    // Stage 1: into this rank's own sum; the ranks meet at step().
    Status st = add_local(id, grad, dtype, first);
    if (!st.ok())  // one operation: refused before anything ran
      return st.with_context(
          fmt::format("engine: reduce_grad({}): nothing was accumulated; the call may be retried", p.name));
    pg.reduced_micro = micro_index;
    pg.written = true;
    return {};
  }
  // N ranks: every rank walks the padded shard length in the same pieces (the
  // reduce-scatters must match), accumulating the elements of its own shard.
  const bool scatter = reg_.world > 1;
  const uint64_t walk = scatter ? p.shard.padded : n;
  for (uint64_t off = 0; off < walk; off += piece_elems_) {
    const uint64_t cnt = std::min(piece_elems_, walk - off);
    auto taken = take_slot();
    if (!taken.ok()) return failed(taken.status());
    const uint32_t slot = *taken;
    const char* src = static_cast<const char*>(grad) + (p.shard.begin + off) * esz;
    const size_t bytes = cnt * dtype_size(sent);
    Status st;
    if (scatter) {
      st = staging_ ? reduce_scatter_piece(p, grad, dtype, off, cnt, static_cast<float*>(stage_[slot]), stage_stream_,
                                           staged_[slot], dl_[slot].as<float>())
                    : reduce_scatter_piece(p, grad, dtype, off, cnt, send_, download_, nullptr, dl_[slot].as<float>());
      if (st.ok()) st = reg_.dev->record(ready_[slot], download_);
    } else {
      st = download_piece(slot, src, dtype, sent, cnt);
    }
    if (!st.ok()) {
      // Copies into the piece may have been enqueued: it is given back once
      // the streams got past them.
      Status s1 = staging_ ? reg_.dev->synchronize(stage_stream_) : Status();
      if (reg_.dev->synchronize(download_).ok() && s1.ok()) give_back(slot);
      return failed(st);
    }
    if (!scatter) reg_.traffic.d2h += bytes;
    // N ranks: the padding is not accumulated. The accumulator waits for the piece's event.
    queue_accum(slot, id, off, scatter ? (off < n ? std::min(cnt, n - off) : 0) : cnt, scatter ? DType::kF32 : sent,
                first);
    ++queued;
  }
  pg.reduced_micro = micro_index;
  pg.written = true;
  return {};
}

// N ranks: on `pack_stream`, rank r's elements [off, off + cnt) of its
// padded shard, taken from every rank's full gradient and widened to fp32
// (zeros past numel), are packed rank by rank into the send buffer (device
// memory); then, on the download stream (after `packed` when packing ran on
// another stream), the reduce-scatter leaves the rank-order sum of this rank's piece
// over all ranks (comm/communicator.h's fixed order) in the device buffer
// recv_, and a device-to-host copy brings it into `out`. The packing is the
// backend's cast kernel (exact for bf16/fp16 -> fp32) whenever the gradient
// is backend memory (always on CUDA; on the host backend when the caller
// allocated it from the backend, as the trainer does), else, for a plain
// host buffer on the host backend, one host function with the same result:
// host-backend runs with backend-allocated gradients take CUDA's path.
Status GradPath::reduce_scatter_piece(const ParamState& p, const void* grad, DType dtype, uint64_t off, uint64_t cnt,
                                      float* send, DeviceStream* pack_stream, DeviceEvent* packed, float* out) {
  const uint32_t world = reg_.world;
  const uint64_t padded = p.shard.padded, numel = p.numel;
  const size_t esz = dtype_size(dtype);
  if (!reg_.dev->holds(grad, numel * esz)) {
    STRATA_RETURN_IF_ERROR(reg_.dev->host_func_async(pack_stream, [=] {
      for (uint32_t r = 0; r < world; ++r) {
        const uint64_t begin = r * padded + off;
        const uint64_t have = begin < numel ? std::min(cnt, numel - begin) : 0;
        float* d = send + static_cast<uint64_t>(r) * cnt;
        widen_to_f32(static_cast<const char*>(grad) + begin * esz, dtype, have, d);
        std::fill(d + have, d + cnt, 0.0f);
      }
      return Status();
    }));
  } else {
    for (uint32_t r = 0; r < world; ++r) {
      const uint64_t begin = r * padded + off;
      const uint64_t have = begin < numel ? std::min(cnt, numel - begin) : 0;
      float* d = send + static_cast<uint64_t>(r) * cnt;
      if (have > 0)
        STRATA_RETURN_IF_ERROR(reg_.dev->cast_async(d, DType::kF32, static_cast<const char*>(grad) + begin * esz,
                                                    dtype, have, 1.0f, pack_stream));
      if (have < cnt) STRATA_RETURN_IF_ERROR(reg_.dev->fill_zero_async(d + have, (cnt - have) * 4, pack_stream));
    }
  }
  if (pack_stream != download_) {
    STRATA_RETURN_IF_ERROR(reg_.dev->record(packed, pack_stream));
    STRATA_RETURN_IF_ERROR(reg_.dev->wait(download_, packed));
  }
  STRATA_RETURN_IF_ERROR(reg_.comm->reduce_scatter(send, recv_, cnt, download_));
  reg_.traffic.comm += cnt * 4 * (world - 1);
  STRATA_RETURN_IF_ERROR(reg_.dev->copy_async(out, recv_, cnt * 4, CopyKind::kDeviceToHost, download_));
  reg_.traffic.d2h += cnt * 4;
  return {};
}

void GradPath::queue_accum(uint32_t slot, ParamId id, uint64_t offset, uint64_t count, DType dtype, bool first) {
  Job j;
  j.kind = Job::kAccum;
  j.slot = slot;
  j.param = id;
  j.group = reg_.params[id].group;
  j.offset = offset;
  j.count = count;
  j.dtype = dtype;
  j.first = first;
  queue_.push(j);
}

Result<uint32_t> GradPath::take_slot() {
  std::unique_lock<std::mutex> lock(mu_);
  while (dl_free_.empty()) {
    if (cv_.wait_for(lock, std::chrono::milliseconds(50)) == std::cv_status::timeout) {
      lock.unlock();
      auto q = reg_.dev->query(download_);  // a failed download never frees its piece
      if (!q.ok()) return q.status();
      lock.lock();
    }
  }
  const uint32_t slot = dl_free_.back();
  dl_free_.pop_back();
  return slot;
}

// Stage 1. The backend's cast or accumulate kernel on the download stream
// (which waits for the caller's) when the gradient is backend memory (always
// on CUDA); for a plain host buffer on the host backend one host function
// with cpu_optim::accumulate. Both compute dst = float(g) or dst + float(g)
// in fp32 with no FMA: the same bits.
Status GradPath::add_local(ParamId id, const void* grad, DType dtype, bool first) {
  float* dst = local_[id];
  const uint64_t n = reg_.params[id].numel;
  if (!reg_.dev->holds(grad, n * dtype_size(dtype)))
    return reg_.dev->host_func_async(download_,
                                     [=] { return cpu_optim::accumulate(dst, grad, dtype, n, first, nullptr); });
  if (first) return reg_.dev->cast_async(dst, DType::kF32, grad, dtype, n, 1.0f, download_);
  return reg_.dev->accumulate_async(dst, grad, dtype, n, 1.0f, download_);
}

Status GradPath::reduce_deferred() {
  for (ParamId id = 0; id < params_.size(); ++id) {
    if (!params_[id].written || local_[id] == nullptr) continue;
    const ParamState& p = reg_.params[id];
    const uint64_t n = p.shard.size();
    for (uint64_t off = 0; off < p.shard.padded; off += piece_elems_) {
      const uint64_t cnt = std::min(piece_elems_, p.shard.padded - off);
      STRATA_ASSIGN_OR_RETURN(const uint32_t slot, take_slot());
      Status st =
          reduce_scatter_piece(p, local_[id], DType::kF32, off, cnt, send_, download_, nullptr, dl_[slot].as<float>());
      if (st.ok()) st = reg_.dev->record(ready_[slot], download_);
      if (!st.ok()) {
        if (reg_.dev->synchronize(download_).ok()) {
          std::lock_guard<std::mutex> lock(mu_);
          dl_free_.push_back(slot);
        }
        return st.with_context(fmt::format("engine: step(): reducing the summed gradient of {} over the ranks",
                                           p.name));
      }
      // The step's whole sum: written (first), its norm blocks from it.
      queue_accum(slot, id, off, off < n ? std::min(cnt, n - off) : 0, DType::kF32, true);
    }
  }
  return wait_idle();
}

// Behind the group's pieces in the queue: the accumulator gets there after
// adding every one of them.
Status GradPath::queue_group_done(GroupId g) {
  Job j;
  j.kind = Job::kGroupDone;
  j.group = g;
  queue_.push(j);
  return {};
}

Status GradPath::end_reduce(DeviceStream* stream) {
  DeviceStream* reads = staging_ ? stage_stream_ : download_;
  STRATA_RETURN_IF_ERROR(reg_.dev->record(ev_download_, reads));
  return reg_.dev->wait(stream, ev_download_);
}

Status GradPath::wait_idle() {
  Status st = staging_ ? reg_.dev->synchronize(stage_stream_) : Status();
  Status dl = reg_.dev->synchronize(download_);
  if (st.ok()) st = dl;
  queue_.wait_idle();
  return st;
}

Status GradPath::zero_grad(ParamId id) {
  ParamState& p = reg_.params[id];
  if (!p.trainable) return {};  // frozen: no accumulator
  const uint64_t n = p.shard.size();
  if (p.grad.tier == Tier::kHost) {
    std::memset(p.grad.ptr, 0, n * 4);
    return {};
  }
  std::memset(dl_[0].data(), 0, piece_elems_ * 4);
  for (uint64_t off = 0; off < n; off += piece_elems_)
    STRATA_RETURN_IF_ERROR(reg_.write_array(p.grad, 4, off, std::min(piece_elems_, n - off), dl_[0].data()));
  return {};
}

// A parameter no micro-batch reduced has a zero gradient this step.
Status GradPath::zero_unwritten() {
  for (ParamId id = 0; id < params_.size(); ++id)
    if (!params_[id].written) {
      Status z = zero_grad(id);
      if (!z.ok()) return z.with_context("engine: zeroing an unreduced gradient");
    }
  return {};
}

double GradPath::sum_sq(ParamId id) const {
  double total = 0;
  for (double b : params_[id].block_sq) total += b;  // blocks in order: grad_stats's association
  return total;
}

void GradPath::reset_step() {
  for (auto& pg : params_) {
    pg.written = false;
    pg.reduced_micro = -1;
    std::fill(pg.block_sq.begin(), pg.block_sq.end(), 0.0);
  }
  torn_.clear();
}

}  // namespace strata::engine
