// The engine: creation (budgets, plan, storage), parameters, acquire/release
// with the device-buffer cache and prefetch by recorded order. Gradients and
// the step: engine_grads.cpp; checkpoints: engine_checkpoint.cpp.
#include "runtime/engine.h"

#include <fmt/format.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>

#include "common/float_convert.h"
#include "common/log.h"
#include "common/units.h"
#include "runtime/engine_impl.h"

namespace strata {

namespace {

uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Free bytes of the filesystem that holds `path` (or would: the nearest
// existing ancestor, since the swap store creates missing directories).
uint64_t free_space(const std::string& path) {
  std::filesystem::path p = std::filesystem::absolute(path);
  std::error_code ec;
  while (!p.empty() && !std::filesystem::exists(p, ec) && p != p.parent_path()) p = p.parent_path();
  struct statvfs s {};
  if (::statvfs(p.c_str(), &s) != 0) return 0;
  return static_cast<uint64_t>(s.f_bavail) * s.f_frsize;
}

// Bytes the pinned pool maps for one buffer (see PinnedPool::allocate).
uint64_t pool_bytes(uint64_t b) { return round_up(b, kHugePageSize); }

}  // namespace

// fp32 -> the compute dtype: cpu_optim's vectorized round-to-nearest-even
// (the same bits as the optimizer's params_out), a copy for fp32.
Status narrow_from_f32(const float* src, DType dtype, uint64_t n, void* dst) {
  if (dtype == DType::kF32) {
    std::memcpy(dst, src, n * 4);
    return {};
  }
  return cpu_optim::convert(src, dst, dtype, n);
}

// ---------------------------------------------------------------- creation

Result<std::unique_ptr<Engine>> Engine::create(const EngineOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  STRATA_RETURN_IF_ERROR(impl->init());
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() = default;

Status Engine::Impl::init() {
  const ModelSpec& model = options.model;
  STRATA_RETURN_IF_ERROR(validate_model_spec(model));
  if (model.params.empty()) return Status(StatusCode::kInvalidArgument, "engine: the model has no parameters");
  const uint32_t ws = std::max(model.world_size, cfg.strata.world_size);
  if (ws > 1)
    return Status(StatusCode::kUnavailable,
                  fmt::format("engine: world_size {} needs the collective layer (all-gather in acquire, "
                              "reduce-scatter in reduce_grad), which is not built yet; run with world_size 1",
                              ws));
  if (cfg.strata.overlap_backward && cfg.fp16.enabled && cfg.fp16.loss_scale == 0)
    return Status(StatusCode::kInvalidArgument,
                  "engine: strata.overlap_backward cannot be combined with fp16 dynamic loss scaling (an overflow "
                  "found after some groups were updated could not skip the step); use bf16, a fixed "
                  "fp16.loss_scale, or turn overlap_backward off");
  if (!cfg.optimizer.bias_correction)
    return Status(StatusCode::kUnavailable,
                  "engine: optimizer.params.bias_correction=false is not supported by the CPU optimizer");
  bool has_bf16 = false, has_f16 = false;
  for (const auto& p : model.params) {
    has_bf16 |= p.compute_dtype == DType::kBF16;
    has_f16 |= p.compute_dtype == DType::kF16;
  }
  if (has_bf16 && has_f16)
    return Status(StatusCode::kUnavailable,
                  "engine: a model mixing bf16 and fp16 compute dtypes is not supported (one optimizer pass "
                  "writes one compute dtype)");
  out_dtype = has_f16 ? DType::kF16 : DType::kBF16;

  // ---- device
  if (options.device != nullptr) {
    dev = options.device;
  } else {
    DeviceBackendOptions d;
    d.kind = options.device_kind;
    d.device = options.device_ordinal;
    d.budget_bytes = cfg.strata.device_memory;  // 0: detect (free device memory)
    STRATA_ASSIGN_OR_RETURN(owned_device, create_device_backend(d));
    dev = owned_device.get();
  }

  // ---- budgets ("detect" = 0)
  PlanBudgets b;
  const PlanBudgets& ov = options.budgets_override;
  b.device_bytes = ov.device_bytes ? ov.device_bytes
                                   : (cfg.strata.device_memory ? cfg.strata.device_memory : dev->memory_stats().budget);
  b.host_bytes = ov.host_bytes ? ov.host_bytes : (cfg.strata.host_memory ? cfg.strata.host_memory : host_memory_available());
  b.pinned_bytes = ov.pinned_bytes ? ov.pinned_bytes : cfg.strata.pinned_memory;
  b.nvme = !ov.nvme.empty() ? ov.nvme : cfg.nvme_dirs();
  for (auto& d : b.nvme)
    if (d.capacity == 0) d.capacity = free_space(d.path);
  PlanOptions po = plan_options_from_config(cfg);
  STRATA_ASSIGN_OR_RETURN(plan, make_plan(model, b, po));
  for (const auto& g : plan.groups)
    for (StateKind k : {StateKind::kMaster, StateKind::kOptimizer, StateKind::kGrad})
      if (g.tier[static_cast<int>(k)] == Tier::kDevice)
        return Status(StatusCode::kUnavailable,
                      fmt::format("engine: group {}: the plan puts the {} on the device, but the device-side "
                                  "optimizer is not wired into the engine yet; place master, optimizer states and "
                                  "gradients on host or nvme (offload_optimizer.device cpu/nvme)",
                                  g.name, state_kind_name(k)));

  // ---- optimizer hyper-parameters
  opt_config.kind = cfg.optimizer.decoupled_weight_decay() ? cpu_optim::OptimizerKind::kAdamW
                                                          : cpu_optim::OptimizerKind::kAdam;
  opt_config.lr = cfg.optimizer.lr;
  opt_config.beta1 = cfg.optimizer.beta1;
  opt_config.beta2 = cfg.optimizer.beta2;
  opt_config.eps = cfg.optimizer.eps;
  opt_config.weight_decay = cfg.optimizer.weight_decay;
  current_lr = cfg.optimizer.lr;

  // ---- loss scaling (DeepSpeed's DynamicLossScaler / static scale)
  if (cfg.fp16.enabled) {
    if (cfg.fp16.loss_scale > 0) {
      scaler.scale = cfg.fp16.loss_scale;
    } else {
      scaler.dynamic = true;
      scaler.scale = std::ldexp(1.0, cfg.fp16.initial_scale_power);
      scaler.hysteresis = cfg.fp16.hysteresis;
    }
  }

  // ---- tracer, I/O
  if (!cfg.strata.trace.empty()) {
    STRATA_ASSIGN_OR_RETURN(tracer, Tracer::open(cfg.strata.trace));
    trace_h2d = tracer->add_track("engine upload stream (h2d)");
    trace_d2h = tracer->add_track("engine download stream (d2h)");
  }
  io::IoEngineOptions io_opts;
  io_opts.backend = cfg.strata.io_backend == IoBackendChoice::kAuto ? "" : io_backend_name(cfg.strata.io_backend);
  io_opts.queue_depth = static_cast<unsigned>(cfg.aio.queue_depth);
  io_opts.block_bytes = cfg.aio.block_size;
  STRATA_ASSIGN_OR_RETURN(io, io::make_io_engine(io_opts));

  // ---- groups and parameters
  group_names = model.group_names();
  std::map<std::string, GroupId, std::less<>> gid;
  groups.resize(group_names.size());
  for (GroupId g = 0; g < group_names.size(); ++g) {
    gid[group_names[g]] = g;
    groups[g].name = group_names[g];
  }
  std::map<std::string, const GroupPlan*, std::less<>> gplan;
  for (const auto& g : plan.groups) gplan[g.name] = &g;
  params.resize(model.params.size());
  for (ParamId i = 0; i < model.params.size(); ++i) {
    const ParamSpec& s = model.params[i];
    ParamState& p = params[i];
    p.name = s.name;
    p.group = gid.at(s.group);
    p.numel = s.numel();
    p.dtype = s.compute_dtype;
    p.shard = shard_range(p.numel, plan.world_size, plan.rank, cfg.strata.shard_alignment);
    const GroupPlan* gp = gplan.at(s.group);
    p.compute.tier = gp->tier[static_cast<int>(StateKind::kCompute)];
    p.master.tier = gp->tier[static_cast<int>(StateKind::kMaster)];
    p.state[0].tier = p.state[1].tier = gp->tier[static_cast<int>(StateKind::kOptimizer)];
    p.grad.tier = gp->tier[static_cast<int>(StateKind::kGrad)];
    groups[p.group].params.push_back(i);
    groups[p.group].compute_tier = p.compute.tier;
  }
  STRATA_RETURN_IF_ERROR(allocate_storage());

  // ---- threads
  uploader = std::thread([this] { uploader_main(); });
  accumulator = std::thread([this] { accumulator_main(); });
  if (cfg.strata.overlap_backward) optimizer_thread = std::thread([this] { optimizer_main(); });
  log_info("engine: {} parameters in {} groups on {} ({} on device, {} host, {} NVMe)", params.size(), groups.size(),
           dev->name(), format_bytes(plan.tier_bytes(Tier::kDevice)), format_bytes(plan.tier_bytes(Tier::kHost)),
           format_bytes(plan.tier_bytes(Tier::kNvme)));
  return {};
}

Status Engine::Impl::allocate_storage() {
  const ModelSpec& model = options.model;
  const size_t state_size = dtype_size(cfg.strata.optimizer_state_dtype);
  bool any_nvme = false;
  for (const auto& p : params)
    any_nvme |= p.compute.tier == Tier::kNvme || p.master.tier == Tier::kNvme || p.state[0].tier == Tier::kNvme ||
                p.grad.tier == Tier::kNvme;
  if (any_nvme) {
    io::SwapStoreOptions so;
    for (const auto& d : cfg.nvme_dirs()) so.dirs.push_back(d.path);
    for (const auto& d : options.budgets_override.nvme)
      if (std::find(so.dirs.begin(), so.dirs.end(), d.path) == so.dirs.end()) so.dirs.push_back(d.path);
    if (so.dirs.empty())
      return Status(StatusCode::kInvalidArgument, "engine: state is planned to NVMe but no NVMe directory is set");
    so.rank = static_cast<int>(plan.rank);
    STRATA_ASSIGN_OR_RETURN(store, io::SwapStore::create(*io, so));
  }

  // Host arena: every host-tier array, 4 KiB aligned.
  uint64_t host_bytes = 0, pinned_bytes = 0;
  const bool pin_compute = cfg.zero.offload_param.pin_memory;
  auto host_size = [&](const ArrayLoc& a, uint64_t bytes, bool compute) {
    if (a.tier != Tier::kHost) return;
    uint64_t& total = compute && pin_compute ? pinned_bytes : host_bytes;
    total += round_up(std::max<uint64_t>(bytes, 1), 4096);
  };
  for (const auto& p : params) {
    const uint64_t n = p.shard.padded;
    host_size(p.compute, n * dtype_size(p.dtype), true);
    host_size(p.master, n * 4, false);
    host_size(p.state[0], n * state_size, false);
    host_size(p.state[1], n * state_size, false);
    host_size(p.grad, n * 4, false);
  }
  if (host_bytes > 0) {
    STRATA_ASSIGN_OR_RETURN(host_arena, alloc_host(host_bytes));
  }
  if (pinned_bytes > 0) {
    STRATA_ASSIGN_OR_RETURN(pinned_arena, dev->alloc_pinned(pinned_bytes));
  }
  uint64_t host_off = 0, pinned_off = 0;
  auto place = [&](ParamState& p, ArrayLoc& a, uint64_t bytes, const char* kind, bool compute) -> Status {
    bytes = std::max<uint64_t>(bytes, 1);
    switch (a.tier) {
      case Tier::kHost: {
        if (compute && pin_compute) {
          a.ptr = static_cast<char*>(pinned_arena.ptr) + pinned_off;
          pinned_off += round_up(bytes, 4096);
        } else {
          a.ptr = static_cast<char*>(host_arena.ptr) + host_off;
          host_off += round_up(bytes, 4096);
        }
        return {};
      }
      case Tier::kNvme: {
        auto t = store->add_tensor(p.name + "." + kind, round_up(bytes, 4096));
        if (!t.ok()) return t.status().with_context(fmt::format("engine: placing {} of {} on NVMe", kind, p.name));
        a.swap = *t;
        return {};
      }
      case Tier::kDevice: {
        auto d = dev->alloc(bytes);
        if (!d.ok())
          return d.status().with_context(fmt::format("engine: placing the {} of {} on the device", kind, p.name));
        a.ptr = *d;
        device_blocks.push_back(*d);
        // Fresh device memory is poisoned on the host backend: start from zeros like every other tier.
        STRATA_RETURN_IF_ERROR(dev->fill_zero_async(a.ptr, bytes, upload));
        return {};
      }
      default:
        return Status(StatusCode::kInternal, fmt::format("engine: {} of {} has no tier", kind, p.name));
    }
  };
  STRATA_ASSIGN_OR_RETURN(upload, dev->create_stream("strata upload"));
  STRATA_ASSIGN_OR_RETURN(download, dev->create_stream("strata download"));
  STRATA_ASSIGN_OR_RETURN(ev_caller, dev->create_event());
  STRATA_ASSIGN_OR_RETURN(ev_download, dev->create_event());
  STRATA_ASSIGN_OR_RETURN(ev_refresh, dev->create_event());
  for (auto& p : params) {
    const uint64_t n = p.shard.padded;
    STRATA_RETURN_IF_ERROR(place(p, p.compute, n * dtype_size(p.dtype), "compute", true));
    STRATA_RETURN_IF_ERROR(place(p, p.master, n * 4, "master", false));
    STRATA_RETURN_IF_ERROR(place(p, p.state[0], n * state_size, "exp_avg", false));
    STRATA_RETURN_IF_ERROR(place(p, p.state[1], n * state_size, "exp_avg_sq", false));
    STRATA_RETURN_IF_ERROR(place(p, p.grad, n * 4, "grad", false));
    p.refresh_from_master = p.compute.tier == Tier::kDevice || p.dtype == DType::kF32;
  }
  STRATA_RETURN_IF_ERROR(dev->synchronize(upload));

  // Group layouts: device slots (256-byte aligned params) and upload staging (4 KiB aligned).
  uint64_t max_count = 0, max_staging = 0;
  bool any_off_device = false, any_nvme_compute = false;
  for (auto& g : groups) {
    STRATA_ASSIGN_OR_RETURN(g.release_event, dev->create_event());
    g.view.resize(g.params.size());
    for (ParamId id : g.params) {
      const ParamState& p = params[id];
      g.slot_offset.push_back(g.slot_bytes);
      g.slot_bytes += round_up(std::max<uint64_t>(p.numel * dtype_size(p.dtype), 1), 256);
      g.staging_offset.push_back(g.staging_bytes);
      g.staging_bytes += round_up(std::max<uint64_t>(p.numel * dtype_size(p.dtype), 1), 4096);
      max_count = std::max(max_count, p.shard.padded);
    }
    if (g.compute_tier == Tier::kDevice) {
      for (size_t i = 0; i < g.params.size(); ++i) g.view[i] = params[g.params[i]].compute.ptr;
    } else {
      any_off_device = true;
      slot_bytes = std::max(slot_bytes, g.slot_bytes);
    }
    if (g.compute_tier == Tier::kNvme) {
      any_nvme_compute = true;
      max_staging = std::max(max_staging, g.staging_bytes);
    }
  }

  // Pinned pool: upload staging, download pieces, accumulation scratch, optimizer ring.
  const uint32_t depth = plan.prefetch_groups;
  piece_elems = round_up(std::min<uint64_t>(max_count, uint64_t{4} << 20), 2048);
  const uint32_t ndl = 4;
  const int nstates = cpu_optim::state_count(opt_config);
  const uint64_t chunk = round_up(std::min<uint64_t>(cfg.strata.optimizer_chunk, max_count), 2048);
  const unsigned ring = static_cast<unsigned>(std::clamp<uint64_t>(cfg.zero.offload_optimizer.buffer_count, 2, 64));
  const uint64_t ring_slot = round_up(chunk * 4, 4096) * 2 + round_up(chunk * state_size, 4096) * nstates +
                             round_up(chunk * dtype_size(out_dtype), 4096);
  const uint32_t nstaging = any_nvme_compute ? 1 + depth : 0;
  uint64_t pool_total = kHugePageSize + pool_bytes(piece_elems * 4) * (ndl + 1) + pool_bytes(ring_slot) * ring +
                        pool_bytes(max_staging) * nstaging;
  if (plan.budgets.pinned_bytes > 0 && pool_total > plan.budgets.pinned_bytes)
    return Status(StatusCode::kOutOfBudget,
                  fmt::format("engine: pinned buffers need {} (optimizer ring {} x {}, {} upload staging x {}, {} "
                              "gradient pieces of {}) but the pinned budget is {}: {} short; lower "
                              "strata.optimizer_chunk or offload_optimizer.buffer_count, or raise strata.pinned_memory",
                              format_bytes(pool_total), ring, format_bytes(ring_slot), nstaging,
                              format_bytes(max_staging), ndl + 1, format_bytes(piece_elems * 4),
                              format_bytes(plan.budgets.pinned_bytes), format_bytes(pool_total - plan.budgets.pinned_bytes)));
  io::PinnedPoolOptions ppo;
  ppo.budget_bytes = pool_total;
  ppo.slab_bytes = kHugePageSize;
  if (dev->host_registrar() != nullptr) ppo.registrars.push_back(dev->host_registrar());
  ppo.registrars.push_back(io->buffer_registrar());
  STRATA_ASSIGN_OR_RETURN(pool, io::PinnedPool::create(ppo));
  for (uint32_t i = 0; i < ndl; ++i) {
    STRATA_ASSIGN_OR_RETURN(auto buf, pool->allocate(piece_elems * 4));
    dl.push_back(std::move(buf));
    dl_free.push_back(i);
  }
  STRATA_ASSIGN_OR_RETURN(scratch, pool->allocate(piece_elems * 4));
  for (uint32_t i = 0; i < nstaging; ++i) {
    STRATA_ASSIGN_OR_RETURN(auto buf, pool->allocate(max_staging));
    staging.push_back(std::move(buf));
    STRATA_ASSIGN_OR_RETURN(auto ev, dev->create_event());
    staging_event.push_back(ev);
  }
  NvmeOptimizerOptions oo;
  oo.chunk_elems = chunk;
  oo.ring_buffers = ring;
  oo.state_dtype = cfg.strata.optimizer_state_dtype;
  oo.out_dtype = out_dtype;
  oo.tracer = tracer.get();
  STRATA_ASSIGN_OR_RETURN(opt, NvmeOptimizer::create(store.get(), *pool, opt_config, oo));

  // Optimizer tensors per group (names borrowed from ParamState::name: params never reallocates now).
  for (auto& g : groups) {
    for (ParamId id : g.params) {
      ParamState& p = params[id];
      OptimizerTensor t;
      t.name = p.name;
      t.count = p.shard.size();
      t.master = p.master.placement();
      t.grads = p.grad.placement();
      for (int s = 0; s < nstates && s < 2; ++s) t.state[s] = p.state[s].placement();
      if (!p.refresh_from_master) t.params_out = p.compute.placement();
      g.tensors.push_back(t);
    }
  }

  // Device slots for gathered groups: one in use, `depth` prefetched, one more
  // to keep the last released group (backward starts with it).
  if (any_off_device) {
    const uint32_t want = 2 + depth;
    for (uint32_t i = 0; i < want; ++i) {
      auto d = dev->alloc(slot_bytes);
      if (!d.ok()) {
        if (d.status().code() == StatusCode::kOutOfBudget && i >= 1 + depth && i > 0) break;
        return d.status().with_context(fmt::format("engine: device buffer {} of {} for gathered groups ({} each)",
                                                   i + 1, want, format_bytes(slot_bytes)));
      }
      DeviceSlot s;
      s.ptr = *d;
      device_blocks.push_back(*d);
      STRATA_ASSIGN_OR_RETURN(s.ready_event, dev->create_event());
      STRATA_ASSIGN_OR_RETURN(s.release_event, dev->create_event());
      slots.push_back(std::move(s));
    }
  }
  size_t max_group_params = 0;
  for (const auto& g : groups) max_group_params = std::max(max_group_params, g.params.size());
  upload_handles.reserve(max_group_params);
  keep_scratch.reserve(plan.prefetch_groups + 1);
  (void)model;
  return {};
}

Engine::Impl::~Impl() {
  stop_threads();
  if (dev != nullptr) {
    if (upload) (void)dev->synchronize(upload);
    if (download) (void)dev->synchronize(download);
  }
  opt.reset();
  staging.clear();
  dl.clear();
  scratch.reset();
  pool.reset();
  if (dev != nullptr) {
    for (auto& s : slots) {
      dev->destroy_event(s.ready_event);
      dev->destroy_event(s.release_event);
    }
    for (auto* e : staging_event) dev->destroy_event(e);
    for (auto& g : groups) dev->destroy_event(g.release_event);
    dev->destroy_event(ev_caller);
    dev->destroy_event(ev_download);
    dev->destroy_event(ev_refresh);
    if (upload) (void)dev->destroy_stream(upload);
    if (download) (void)dev->destroy_stream(download);
    for (void* p : device_blocks) (void)dev->free(p);
    if (pinned_arena.ptr) dev->free_pinned(pinned_arena);
  }
  if (host_arena.ptr) free_host(host_arena);
  if (store) {
    Status st = store->close();
    if (!st.ok()) log_error("engine: closing the swap store: {}", st.message());
  }
  store.reset();
  io.reset();
  if (tracer) {
    Status st = tracer->close();
    if (!st.ok()) log_error("engine: writing the trace: {}", st.message());
  }
}

void Engine::Impl::stop_threads() {
  {
    std::lock_guard<std::mutex> lock(mu);
    stopping = true;
  }
  cv.notify_all();
  if (uploader.joinable()) uploader.join();
  if (accumulator.joinable()) accumulator.join();
  if (optimizer_thread.joinable()) optimizer_thread.join();
}

void Engine::Impl::set_async_error(const Status& st) {
  std::lock_guard<std::mutex> lock(mu);
  if (async_error.ok()) async_error = st;
}

Status Engine::Impl::take_async_error() {
  std::lock_guard<std::mutex> lock(mu);
  Status st = std::move(async_error);
  async_error = Status();
  return st;
}

Status Engine::Impl::sync_io(io::IoHandle h, bool write, uint64_t bytes) {
  Status st = h.wait();
  if (st.ok()) (write ? nvme_write : nvme_read) += bytes;
  return st;
}

Status Engine::Impl::traced_copy(void* dst, const void* src, size_t bytes, CopyKind kind, DeviceStream* s) {
  if (tracer == nullptr || !tracer->enabled()) return dev->copy_async(dst, src, bytes, kind, s);
  auto t0 = std::make_shared<uint64_t>(0);
  STRATA_RETURN_IF_ERROR(dev->host_func_async(s, [t0] {
    *t0 = Tracer::now_ns();
    return Status();
  }));
  STRATA_RETURN_IF_ERROR(dev->copy_async(dst, src, bytes, kind, s));
  Tracer* tr = tracer.get();
  const bool up = kind == CopyKind::kHostToDevice;
  const uint32_t track = up ? trace_h2d : trace_d2h;
  return dev->host_func_async(s, [tr, t0, bytes, up, track] {
    tr->complete(up ? "h2d" : "d2h", trace_cat::kCopy, *t0, Tracer::now_ns(), {{"bytes", uint64_t{bytes}}}, track);
    return Status();
  });
}

// ---------------------------------------------------------------- array helpers

Status Engine::Impl::read_array(const ArrayLoc& a, size_t esz, uint64_t off, uint64_t count, void* dst) {
  const uint64_t bytes = count * esz;
  switch (a.tier) {
    case Tier::kHost:
      std::memcpy(dst, static_cast<const char*>(a.ptr) + off * esz, bytes);
      return {};
    case Tier::kNvme:
      return sync_io(store->read(a.swap, off * esz, bytes, dst), false, bytes);
    case Tier::kDevice:
      STRATA_RETURN_IF_ERROR(
          traced_copy(dst, static_cast<const char*>(a.ptr) + off * esz, bytes, CopyKind::kDeviceToHost, upload));
      d2h += bytes;
      return dev->synchronize(upload);
    default:
      return Status(StatusCode::kInternal, "engine: array without a tier");
  }
}

Status Engine::Impl::write_array(const ArrayLoc& a, size_t esz, uint64_t off, uint64_t count, const void* src) {
  const uint64_t bytes = count * esz;
  switch (a.tier) {
    case Tier::kHost:
      std::memcpy(static_cast<char*>(a.ptr) + off * esz, src, bytes);
      return {};
    case Tier::kNvme:
      return sync_io(store->write(a.swap, off * esz, bytes, src), true, bytes);
    case Tier::kDevice:
      STRATA_RETURN_IF_ERROR(
          traced_copy(static_cast<char*>(a.ptr) + off * esz, src, bytes, CopyKind::kHostToDevice, upload));
      h2d += bytes;
      return dev->synchronize(upload);
    default:
      return Status(StatusCode::kInternal, "engine: array without a tier");
  }
}

// The compute copy rebuilt from the master (round to nearest even, as the
// optimizer's params_out): device-homed and fp32 compute copies.
Status Engine::Impl::refresh_compute(ParamId id) {
  ParamState& p = params[id];
  const size_t esz = dtype_size(p.dtype);
  if (p.compute.tier == Tier::kDevice) STRATA_RETURN_IF_ERROR(dev->wait(upload, groups[p.group].release_event));
  float* f = dl[0].as<float>();
  void* c = dl[1].data();
  const uint64_t n = p.shard.size();
  for (uint64_t off = 0; off < n; off += piece_elems) {
    const uint64_t cnt = std::min(piece_elems, n - off);
    STRATA_RETURN_IF_ERROR(read_array(p.master, 4, off, cnt, f));
    STRATA_RETURN_IF_ERROR(narrow_from_f32(f, p.dtype, cnt, c));
    STRATA_RETURN_IF_ERROR(write_array(p.compute, esz, off, cnt, c));
  }
  return {};
}

Status Engine::Impl::zero_grad(ParamId id) {
  ParamState& p = params[id];
  const uint64_t n = p.shard.size();
  if (p.grad.tier == Tier::kHost) {
    std::memset(p.grad.ptr, 0, n * 4);
    return {};
  }
  std::memset(dl[0].data(), 0, piece_elems * 4);
  for (uint64_t off = 0; off < n; off += piece_elems)
    STRATA_RETURN_IF_ERROR(write_array(p.grad, 4, off, std::min(piece_elems, n - off), dl[0].data()));
  return {};
}

// ---------------------------------------------------------------- model and parameters

const ModelSpec& Engine::model() const { return impl_->options.model; }
const Plan& Engine::plan() const { return impl_->plan; }
DeviceBackend& Engine::device() { return *impl_->dev; }
uint32_t Engine::group_count() const { return static_cast<uint32_t>(impl_->groups.size()); }
const std::string& Engine::group_name(GroupId g) const { return impl_->groups.at(g).name; }
std::span<const ParamId> Engine::group_params(GroupId g) const { return impl_->groups.at(g).params; }

Result<ParamId> Engine::find_param(std::string_view name) const {
  for (ParamId i = 0; i < impl_->params.size(); ++i)
    if (impl_->params[i].name == name) return i;
  return Status(StatusCode::kNotFound, fmt::format("engine: no parameter named '{}'", name));
}

Result<GroupId> Engine::find_group(std::string_view name) const {
  for (GroupId i = 0; i < impl_->groups.size(); ++i)
    if (impl_->groups[i].name == name) return i;
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
  if (id >= I.params.size())
    return Status(StatusCode::kInvalidArgument, fmt::format("engine: load_param: no parameter {}", id));
  STRATA_RETURN_IF_ERROR(check_dtype(dtype, "load_param"));
  if (src == nullptr && I.params[id].numel > 0)
    return Status(StatusCode::kInvalidArgument, "engine: load_param: null source");
  ParamState& p = I.params[id];
  if (I.groups[p.group].acquired)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: load_param({}): its group {} is acquired", p.name, I.groups[p.group].name));
  STRATA_RETURN_IF_ERROR(I.wait_idle());
  I.invalidate_slots();  // a cached or prefetched device copy would be stale
  const size_t in_sz = dtype_size(dtype);
  const size_t esz = dtype_size(p.dtype);
  float* f = I.dl[0].as<float>();
  void* c = I.dl[1].data();
  if (p.compute.tier == Tier::kDevice) STRATA_RETURN_IF_ERROR(I.dev->wait(I.upload, I.groups[p.group].release_event));
  const uint64_t n = p.shard.size();
  for (uint64_t off = 0; off < n; off += I.piece_elems) {
    const uint64_t cnt = std::min(I.piece_elems, n - off);
    widen_to_f32(static_cast<const char*>(src) + (p.shard.begin + off) * in_sz, dtype, cnt, f);
    Status st = I.write_array(p.master, 4, off, cnt, f);
    if (st.ok()) st = narrow_from_f32(f, p.dtype, cnt, c);
    if (st.ok()) st = I.write_array(p.compute, esz, off, cnt, c);
    if (!st.ok()) return st.with_context(fmt::format("engine: load_param({})", p.name));
  }
  return {};
}

Status Engine::read_param(ParamId id, void* dst, DType dtype) {
  Impl& I = *impl_;
  if (id >= I.params.size())
    return Status(StatusCode::kInvalidArgument, fmt::format("engine: read_param: no parameter {}", id));
  STRATA_RETURN_IF_ERROR(check_dtype(dtype, "read_param"));
  STRATA_RETURN_IF_ERROR(I.wait_idle());
  ParamState& p = I.params[id];
  float* f = I.dl[0].as<float>();
  const size_t out_sz = dtype_size(dtype);
  const uint64_t n = p.shard.size();
  for (uint64_t off = 0; off < n; off += I.piece_elems) {
    const uint64_t cnt = std::min(I.piece_elems, n - off);
    Status st = I.read_array(p.master, 4, off, cnt, f);
    if (!st.ok()) return st.with_context(fmt::format("engine: read_param({})", p.name));
    st = narrow_from_f32(f, dtype, cnt, static_cast<char*>(dst) + off * out_sz);
    if (!st.ok()) return st.with_context(fmt::format("engine: read_param({})", p.name));
  }
  return {};
}

// ---------------------------------------------------------------- acquire / release / prefetch

void Engine::Impl::uploader_main() {
  for (;;) {
    int s;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return stopping || !upload_queue.empty(); });
      if (upload_queue.empty()) return;
      s = upload_queue.front();
      upload_queue.pop_front();
      upload_busy = true;
    }
    Status st = upload_group(s);
    {
      std::lock_guard<std::mutex> lock(mu);
      slots[s].error = st;
      slots[s].enqueued = true;
      upload_busy = false;
    }
    cv.notify_all();
  }
}

Status Engine::Impl::upload_group(int si) {
  DeviceSlot& s = slots[si];
  int gi;
  {
    std::lock_guard<std::mutex> lock(mu);
    gi = s.group;
  }
  const GroupState& g = groups[gi];
  TraceSpan span(tracer.get(), "upload_group", trace_cat::kRuntime, {{"group", g.name.c_str()}});
  char* stage = nullptr;
  size_t stage_index = 0;
  if (g.compute_tier == Tier::kNvme) {
    stage_index = next_staging++ % staging.size();
    // The staging buffer is free once the copies out of it (last use) are done.
    STRATA_RETURN_IF_ERROR(dev->synchronize(staging_event[stage_index]));
    stage = static_cast<char*>(staging[stage_index].data());
    const uint64_t t0 = Tracer::now_ns();
    uint64_t total = 0;
    std::vector<io::IoHandle>& handles = upload_handles;
    handles.clear();
    for (size_t i = 0; i < g.params.size(); ++i) {
      const ParamState& p = params[g.params[i]];
      const uint64_t len = round_up(std::max<uint64_t>(p.numel * dtype_size(p.dtype), 1), 4096);
      handles.push_back(store->read(p.compute.swap, 0, len, stage + g.staging_offset[i]));
      total += len;
    }
    Status first;
    for (size_t i = 0; i < handles.size(); ++i) {
      Status st = handles[i].wait();
      if (!st.ok() && first.ok())
        first = st.with_context(fmt::format("engine: reading the compute copy of {} from NVMe", params[g.params[i]].name));
    }
    handles.clear();
    STRATA_RETURN_IF_ERROR(first);
    nvme_read += total;
    if (tracer) tracer->complete("nvme_read", trace_cat::kIo, t0, Tracer::now_ns(), {{"bytes", total}});
  }
  STRATA_RETURN_IF_ERROR(dev->wait(upload, s.release_event));
  for (size_t i = 0; i < g.params.size(); ++i) {
    const ParamState& p = params[g.params[i]];
    const uint64_t bytes = p.numel * dtype_size(p.dtype);
    const void* src = stage ? stage + g.staging_offset[i] : p.compute.ptr;
    STRATA_RETURN_IF_ERROR(
        traced_copy(static_cast<char*>(s.ptr) + g.slot_offset[i], src, bytes, CopyKind::kHostToDevice, upload));
    h2d += bytes;
  }
  if (stage) STRATA_RETURN_IF_ERROR(dev->record(staging_event[stage_index], upload));
  return dev->record(s.ready_event, upload);
}

// A slot to upload into: free first, else the least recently used cached
// group outside `keep` (the prefetch window). Caller holds mu.
int Engine::Impl::find_victim(const std::vector<GroupId>& keep) {
  int best = -1;
  for (int i = 0; i < static_cast<int>(slots.size()); ++i) {
    const DeviceSlot& s = slots[i];
    if (s.state == DeviceSlot::kFree) return i;
    if (s.state != DeviceSlot::kCached || !s.enqueued) continue;
    if (std::find(keep.begin(), keep.end(), static_cast<GroupId>(s.group)) != keep.end()) continue;
    if (best < 0 || s.lru < slots[best].lru) best = i;
  }
  return best;
}

// Caller holds mu. Puts group g into a slot and queues its upload.
Status Engine::Impl::start_upload(GroupId g, bool prefetch) {
  std::vector<GroupId>& keep = keep_scratch;
  keep.clear();
  if (!recording && !order_broken) {
    const size_t pos = current.size();
    for (size_t i = pos; i < order.size() && i < pos + plan.prefetch_groups; ++i) keep.push_back(order[i]);
  }
  keep.push_back(g);
  const int v = find_victim(keep);
  if (v < 0) {
    if (prefetch) return Status(StatusCode::kOutOfBudget, "no free device buffer");
    return Status(StatusCode::kOutOfBudget,
                  fmt::format("engine: acquire({}): all {} device buffers for gathered groups ({} each) are in use or "
                              "loading; release a group first, or raise the device budget",
                              groups[g].name, slots.size(), format_bytes(slot_bytes)));
  }
  DeviceSlot& s = slots[v];
  if (s.group >= 0) groups[s.group].slot = -1;
  s.group = static_cast<int>(g);
  s.state = DeviceSlot::kCached;
  s.enqueued = false;
  s.prefetched = prefetch;
  s.error = Status();
  s.lru = ++lru_clock;
  groups[g].slot = v;
  upload_queue.push_back(v);
  cv.notify_all();
  return {};
}

void Engine::Impl::issue_prefetch() {
  if (recording || order_broken || plan.prefetch_groups == 0) return;
  const size_t pos = current.size();
  std::lock_guard<std::mutex> lock(mu);
  for (size_t i = pos; i < order.size() && i < pos + plan.prefetch_groups; ++i) {
    const GroupId h = order[i];
    if (groups[h].compute_tier == Tier::kDevice || groups[h].slot >= 0 || groups[h].acquired) continue;
    if (!start_upload(h, true).ok()) break;
  }
}

void Engine::Impl::invalidate_slots() {
  // Queued or running uploads (prefetches issued at the end of the last
  // step) finish first: the uploader must not mark a slot "enqueued" after
  // the slot was handed to another group.
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return upload_queue.empty() && !upload_busy; });
  for (auto& s : slots) {
    if (s.state == DeviceSlot::kInUse) continue;
    if (s.group >= 0) groups[s.group].slot = -1;
    s.group = -1;
    s.state = DeviceSlot::kFree;
    s.prefetched = false;
  }
}

Status Engine::begin_micro_batch(bool last) {
  Impl& I = *impl_;
  if (I.acquired_count > 0)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: begin_micro_batch with {} group(s) still acquired", I.acquired_count));
  STRATA_RETURN_IF_ERROR(I.take_async_error());
  ++I.micro_index;
  I.last_micro = last;
  if (last && I.cfg.strata.overlap_backward) {
    I.overlap_running = true;
    I.overlap_scale = 1.0 / (static_cast<double>(I.micro_index + 1) * I.scaler.scale);
    const double clip = I.cfg.gradient_clipping;
    I.overlap_coef = clip > 0 && I.prev_norm >= 0 ? std::min(1.0, clip / (I.prev_norm + 1e-6)) : 1.0;
    I.overlap_step = I.steps + 1;
    I.overlap_lr = I.current_lr;
    for (auto& g : I.groups) {
      g.reduced_last = 0;
      g.queued = g.updated = g.skipped = g.nonfinite = false;
      g.sum_sq = 0;
    }
  }
  return {};
}

Result<GroupView> Engine::acquire(GroupId gid, DeviceStream* stream) {
  Impl& I = *impl_;
  if (gid >= I.groups.size())
    return Status(StatusCode::kInvalidArgument, fmt::format("engine: acquire: no group {}", gid));
  GroupState& g = I.groups[gid];
  if (g.acquired)
    return Status(StatusCode::kInvalidArgument, fmt::format("engine: acquire({}): already acquired", g.name));
  if (stream == nullptr) return Status(StatusCode::kInvalidArgument, "engine: acquire: null stream");
  if (I.overlap_running && g.queued)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: acquire({}): its optimizer update already started (overlap_backward: every "
                              "parameter of the group was reduced in the last micro-batch)",
                              g.name));
  STRATA_RETURN_IF_ERROR(I.take_async_error());
  ++I.acquires;
  // The order: compare with the recorded one.
  const size_t pos = I.current.size();
  if (!I.recording && !I.order_broken && (pos >= I.order.size() || I.order[pos] != gid)) {
    I.order_broken = true;
    ++I.order_changes;
    if (!I.order_change_logged) {
      I.order_change_logged = true;
      log_info("engine: the acquire order changed (acquire #{} is {}, recorded {}); prefetch drops what was not "
               "asked for and records the new order (logged once)",
               pos + 1, g.name, pos < I.order.size() ? I.groups[I.order[pos]].name : std::string("nothing"));
    }
  }
  I.current.push_back(gid);
  if (g.compute_tier == Tier::kDevice) {
    g.acquired = true;
    ++I.acquired_count;
    return GroupView{gid, g.view, g.params};
  }
  int si;
  {
    std::lock_guard<std::mutex> lock(I.mu);
    if (g.slot >= 0) {
      ++I.hits;
    } else {
      ++I.misses;
      STRATA_RETURN_IF_ERROR(I.start_upload(gid, false));
    }
    si = g.slot;
    I.slots[si].state = DeviceSlot::kInUse;
  }
  I.issue_prefetch();
  Status err;
  {
    std::unique_lock<std::mutex> lock(I.mu);
    I.cv.wait(lock, [&] { return I.slots[si].enqueued; });
    err = I.slots[si].error;
    if (!err.ok()) {
      I.slots[si].state = DeviceSlot::kFree;
      I.slots[si].group = -1;
      g.slot = -1;
    }
  }
  if (!err.ok()) return err.with_context(fmt::format("engine: acquire({})", g.name));
  STRATA_RETURN_IF_ERROR(I.dev->wait(stream, I.slots[si].ready_event));
  for (size_t i = 0; i < g.params.size(); ++i) g.view[i] = static_cast<char*>(I.slots[si].ptr) + g.slot_offset[i];
  g.acquired = true;
  ++I.acquired_count;
  return GroupView{gid, g.view, g.params};
}

Status Engine::release(GroupId gid, DeviceStream* stream) {
  Impl& I = *impl_;
  if (gid >= I.groups.size())
    return Status(StatusCode::kInvalidArgument, fmt::format("engine: release: no group {}", gid));
  GroupState& g = I.groups[gid];
  if (!g.acquired)
    return Status(StatusCode::kInvalidArgument, fmt::format("engine: release({}): not acquired", g.name));
  if (stream == nullptr) return Status(StatusCode::kInvalidArgument, "engine: release: null stream");
  g.acquired = false;
  --I.acquired_count;
  if (g.compute_tier == Tier::kDevice) return I.dev->record(g.release_event, stream);
  std::lock_guard<std::mutex> lock(I.mu);
  DeviceSlot& s = I.slots[g.slot];
  Status st = I.dev->record(s.release_event, stream);
  s.state = DeviceSlot::kCached;
  s.prefetched = false;
  s.lru = ++I.lru_clock;
  return st;
}

// ---------------------------------------------------------------- observability

EngineStats Engine::stats() const {
  const Impl& I = *impl_;
  EngineStats s;
  for (int t = 0; t < 4; ++t) s.tier_bytes[t] = I.plan.tier_bytes(static_cast<Tier>(t));
  s.device_buffer_bytes = I.slots.size() * I.slot_bytes;
  s.pinned_bytes = I.pool ? I.pool->used_bytes() : 0;
  s.nvme_read_bytes = I.nvme_read.load(std::memory_order_relaxed);
  s.nvme_write_bytes = I.nvme_write.load(std::memory_order_relaxed);
  s.h2d_bytes = I.h2d.load(std::memory_order_relaxed);
  s.d2h_bytes = I.d2h.load(std::memory_order_relaxed);
  s.acquires = I.acquires.load(std::memory_order_relaxed);
  s.prefetch_hits = I.hits.load(std::memory_order_relaxed);
  s.prefetch_misses = I.misses.load(std::memory_order_relaxed);
  s.order_changes = I.order_changes.load(std::memory_order_relaxed);
  s.hot_path_allocs = I.hot_allocs.load(std::memory_order_relaxed);
  s.steps = I.steps_atomic.load(std::memory_order_relaxed);
  s.skipped_steps = I.skipped_steps.load(std::memory_order_relaxed);
  return s;
}

Tracer* Engine::tracer() { return impl_->tracer.get(); }

void Engine::trace_begin(const char* name) {
  Impl& I = *impl_;
  if (!I.tracer) return;
  std::lock_guard<std::mutex> lock(I.trace_mu);
  I.trace_stack.push_back(Tracer::now_ns());
  I.trace_names.push_back(name);
}

void Engine::trace_end() {
  Impl& I = *impl_;
  if (!I.tracer) return;
  std::lock_guard<std::mutex> lock(I.trace_mu);
  if (I.trace_stack.empty()) return;
  I.tracer->complete_copy(I.trace_names.back(), trace_cat::kCompute, I.trace_stack.back(), Tracer::now_ns());
  I.trace_stack.pop_back();
  I.trace_names.pop_back();
}

double Engine::loss_scale() const { return impl_->scaler.scale; }
int64_t Engine::step_count() const { return impl_->steps; }

}  // namespace strata
