// The registry: validation, budgets and the plan, the parameter and group
// lists, and the storage behind every array (see registry.h).
#include "runtime/engine/registry.h"

#include <fmt/format.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <unistd.h>

#include "common/crc32c.h"
#include "common/log.h"
#include "common/units.h"

namespace strata::engine {

namespace {

// Free bytes of the filesystem that holds NVMe directory `path` (or would:
// the nearest existing ancestor, since the swap store creates missing
// directories). A filesystem with no blocks at all (/proc, /sys) holds no
// files: refused here, not reported as "0 B free" by the planner.
Result<uint64_t> free_space(const std::string& path) {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::absolute(path, ec);
  if (ec) return Status(StatusCode::kInvalidArgument, fmt::format("NVMe directory {}: {}", path, ec.message()));
  while (!p.empty() && !std::filesystem::exists(p, ec) && p != p.parent_path()) p = p.parent_path();
  struct statvfs s {};
  if (::statvfs(p.c_str(), &s) != 0)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("NVMe directory {}: cannot read the free space of {}: {}", path, p.string(),
                              std::strerror(errno)));
  if (s.f_blocks == 0)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("NVMe directory {}: {} is on a filesystem without storage (like /proc or /sys: "
                              "0 blocks), which cannot hold the swap files; give a directory on a disk",
                              path, p.string()));
  return static_cast<uint64_t>(s.f_bavail) * s.f_frsize;
}

// Bytes the pinned pool maps for one buffer (see PinnedPool::allocate).
uint64_t pool_bytes(uint64_t b) {
  return round_up(b, kHugePageSize);
}

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

Status Registry::init(const EngineOptions& opts) {
  options = opts;
  STRATA_RETURN_IF_ERROR(set_ranks());
  STRATA_RETURN_IF_ERROR(validate());

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
  if (comm != nullptr && comm->device() != dev)
    return Status(StatusCode::kInvalidArgument,
                  "engine: the communicator works on another device backend than the engine's (create it over "
                  "EngineOptions::device)");
  STRATA_RETURN_IF_ERROR(make_plan_for_budgets());
  {
    const uint64_t chunk = round_up(cfg.strata.optimizer_chunk, 2048);
    io_quantum = std::min<uint64_t>(chunk & (~chunk + 1), 32768);  // lowest set bit
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
  io_opts.faults = options.io_faults;
  STRATA_ASSIGN_OR_RETURN(io, io::make_io_engine(io_opts));
  list_params_and_groups();
  return {};
}

// The world size and rank: the communicator's; the model's and the config's
// (when not the default 1/0) must agree with it. Without a communicator only
// one rank runs.
Status Registry::set_ranks() {
  ModelSpec& model = options.model;
  comm = options.comm;
  if (comm == nullptr) {
    const uint32_t ws = std::max(model.world_size, cfg.strata.world_size);
    if (ws > 1)
      return Status(StatusCode::kUnavailable,
                    fmt::format("engine: world_size {} needs a communicator over the job's ranks "
                                "(EngineOptions::comm: comm::create_communicator under mpirun)",
                                ws));
    return {};
  }
  world = static_cast<uint32_t>(comm->world_size());
  rank = static_cast<uint32_t>(comm->rank());
  auto agree = [&](uint32_t ws, uint32_t rk, const char* what) -> Status {
    if ((ws == 1 && rk == 0) || (ws == world && rk == rank)) return {};
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("engine: {} says rank {} of {}, but the communicator ({}) is rank {} of {}", what, rk,
                              ws, comm->backend_name(), rank, world));
  };
  STRATA_RETURN_IF_ERROR(agree(model.world_size, model.rank, "the model spec"));
  STRATA_RETURN_IF_ERROR(agree(cfg.strata.world_size, cfg.strata.rank, "config strata.world_size/rank"));
  model.world_size = cfg.strata.world_size = world;
  model.rank = cfg.strata.rank = rank;
  if (world > 1) {
    if (cfg.zero.stage == 0 && cfg.zero.stage_given)
      return Status(StatusCode::kUnavailable,
                    fmt::format("engine: zero_optimization.stage 0 (nothing sharded: every rank keeping the whole "
                                "optimizer state) with {} ranks is not built; use stage 1 or 2 (optimizer states and "
                                "gradients sharded, parameters whole on every rank) or 3 (parameters sharded too)",
                                world));
    // Stages 1-2 keep the parameters whole on every rank. Stage 2 reduce-
    // scatters each micro-batch's gradient into the ranks' shards; stage 1
    // sums each rank's micro-batches whole on its device and reduce-scatters
    // that once per step (GradPath "deferred").
    replicated = cfg.zero.stage == 1 || cfg.zero.stage == 2;
    defer_reduce = cfg.zero.stage == 1;
    if (cfg.strata.overlap_backward)
      return Status(StatusCode::kUnavailable,
                    fmt::format("engine: strata.overlap_backward with {} ranks is not built yet (the group updates "
                                "would need the global norm before it exists on every rank); turn it off",
                                world));
  }
  return {};
}

Status Registry::validate() {
  const ModelSpec& model = options.model;
  STRATA_RETURN_IF_ERROR(validate_model_spec(model));
  if (model.params.empty()) return Status(StatusCode::kInvalidArgument, "engine: the model has no parameters");
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
  return {};
}

// N ranks: how many run on this host (this one included), from an
// all-gather of a host id (the host name and the kernel's boot id). A
// collective: every rank calls it.
Result<uint32_t> Registry::ranks_on_this_host() {
  char name[256] = {};
  (void)::gethostname(name, sizeof(name) - 1);
  std::string id = name;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char boot[64] = {};
    if (std::fgets(boot, sizeof(boot), f)) id += boot;
    std::fclose(f);
  }
  const double mine = static_cast<double>(crc32c(id.data(), id.size()));
  std::vector<double> all(world, 0.0);
  STRATA_ASSIGN_OR_RETURN(DeviceStream * s, dev->create_stream("strata host census"));
  Status st = comm::all_gather_host(*comm, s, &mine, all.data(), sizeof(double), {});
  Status gone = dev->destroy_stream(s);
  STRATA_RETURN_IF_ERROR(st.with_context("engine: counting the ranks on this host"));
  STRATA_RETURN_IF_ERROR(gone);
  return static_cast<uint32_t>(std::count(all.begin(), all.end(), mine));
}

// Budgets left at 0 ("detect") are measured; the plan must keep master,
// optimizer states and gradients off the device. N ranks on one host share
// its RAM and its drives: a host budget or NVMe free space detected here is
// this rank's share of it (a budget given is this rank's own), less the
// device budget on the host backend, whose device memory is RAM as well.
Status Registry::make_plan_for_budgets() {
  PlanBudgets b;
  const PlanBudgets& ov = options.budgets_override;
  uint32_t local = 1;
  if (world > 1) {
    STRATA_ASSIGN_OR_RETURN(local, ranks_on_this_host());
    local = std::max<uint32_t>(local, 1);
  }
  b.device_bytes = ov.device_bytes ? ov.device_bytes
                                   : (cfg.strata.device_memory ? cfg.strata.device_memory : dev->memory_stats().budget);
  if (ov.host_bytes || cfg.strata.host_memory) {
    b.host_bytes = ov.host_bytes ? ov.host_bytes : cfg.strata.host_memory;
  } else {
    const uint64_t share = host_memory_available() / local;
    b.host_bytes = share;
    // On the host backend the device is RAM too: its budget (the trainer's
    // activations, the device tier) comes out of the same MemAvailable, or
    // the two tiers together would plan more RAM than there is. A device
    // budget nobody gave is the backend's own default, a quarter of the
    // host's MemAvailable (device_backend.cpp): each of the ranks here plans
    // with a quarter of its share instead.
    if (dev->kind() == DeviceKind::kHost) {
      if (!ov.device_bytes && !cfg.strata.device_memory) b.device_bytes = std::min(b.device_bytes, share / 4);
      auto host = host_budget_beside_ram_device(share, b.device_bytes);
      if (!host.ok())
        return host.status().with_context(
            local > 1 ? fmt::format("engine, host backend, {} ranks on this host (strata.device_memory, "
                                    "strata.host_memory)",
                                    local)
                      : std::string("engine, host backend (strata.device_memory, strata.host_memory)"));
      b.host_bytes = *host;
    }
    if (local > 1 || dev->kind() == DeviceKind::kHost)
      log_info("engine: host budget {} (MemAvailable{}{})", format_bytes(b.host_bytes),
               local > 1 ? fmt::format(" shared by the {} ranks on this host", local) : std::string(),
               dev->kind() == DeviceKind::kHost
                   ? fmt::format(", less the host backend's device budget {}: it is RAM too",
                                 format_bytes(b.device_bytes))
                   : std::string());
  }
  b.pinned_bytes = ov.pinned_bytes ? ov.pinned_bytes : cfg.strata.pinned_memory;
  b.nvme = !ov.nvme.empty() ? ov.nvme : cfg.nvme_dirs();
  for (auto& d : b.nvme) {
    if (d.capacity == 0) {
      STRATA_ASSIGN_OR_RETURN(d.capacity, free_space(d.path));
      d.capacity /= local;  // the ranks here may share the drive; a conservative share
    }
  }
  PlanOptions po = plan_options_from_config(cfg);
  STRATA_ASSIGN_OR_RETURN(plan, make_plan(options.model, b, po));
  // Stages 1-2 on GPU ranks: the all-gather after each step writes every
  // rank's replica, and NCCL moves device memory only.
  if (world > 1 && replicated && dev->kind() != DeviceKind::kHost)
    for (const auto& g : plan.groups)
      if (g.tier[static_cast<int>(StateKind::kCompute)] != Tier::kDevice)
        return Status(StatusCode::kOutOfBudget,
                      fmt::format("engine: group {}: zero_optimization.stage {} with {} GPU ranks keeps every "
                                  "parameter whole on every GPU (the all-gather after each step writes it there), "
                                  "but the plan puts this group's parameters on {}; raise the device budget, or use "
                                  "stage 3 (parameters sharded, and allowed on host or NVMe)",
                                  g.name, cfg.zero.stage, world, tier_name(g.tier[static_cast<int>(StateKind::kCompute)])));
  for (const auto& g : plan.groups)
    for (StateKind k : {StateKind::kMaster, StateKind::kOptimizer, StateKind::kGrad})
      if (g.tier[static_cast<int>(k)] == Tier::kDevice)
        return Status(StatusCode::kUnavailable,
                      fmt::format("engine: group {}: the plan puts the {} on the device, but the device-side "
                                  "optimizer is not wired into the engine yet; place master, optimizer states and "
                                  "gradients on host or nvme (offload_optimizer.device cpu/nvme)",
                                  g.name, state_kind_name(k)));
  return {};
}

void Registry::list_params_and_groups() {
  const ModelSpec& model = options.model;
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
    p.weight_decay = s.weight_decay;
    p.trainable = s.trainable;
    p.lr_group = s.lr_group;
    p.shard = shard_range(p.numel, plan.world_size, plan.rank, cfg.strata.shard_alignment);
    const GroupPlan* gp = gplan.at(s.group);
    p.compute.tier = gp->tier[static_cast<int>(StateKind::kCompute)];
    p.master.tier = gp->tier[static_cast<int>(StateKind::kMaster)];
    p.state[0].tier = p.state[1].tier = gp->tier[static_cast<int>(StateKind::kOptimizer)];
    p.grad.tier = gp->tier[static_cast<int>(StateKind::kGrad)];
    if (!p.trainable) p.master.tier = p.state[0].tier = p.state[1].tier = p.grad.tier = Tier::kAuto;
    groups[p.group].params.push_back(i);
    groups[p.group].compute_tier = p.compute.tier;
  }
}

// N ranks share one run directory name (rank 0's, broadcast), so the ranks'
// swap files sit side by side in one run directory of a shared NVMe
// directory instead of each rank warning about the others' directories.
// Always exchanged with N ranks: the plans (and whether any state is on NVMe)
// may differ between ranks, the sequence of collectives must not.
Result<std::string> Registry::agree_run_name() {
  char buf[96] = {};
  if (rank == 0) {
    const std::string n = fmt::format("strata-run-{}-{:08x}-job", ::getpid(), static_cast<uint32_t>(std::random_device{}()));
    std::memcpy(buf, n.data(), std::min(n.size(), sizeof(buf) - 1));
  }
  STRATA_RETURN_IF_ERROR(host_broadcast(buf, sizeof(buf)));
  buf[sizeof(buf) - 1] = 0;
  return std::string(buf);
}

Status Registry::allocate_arrays() {
  const size_t state_size = dtype_size(cfg.strata.optimizer_state_dtype);
  STRATA_ASSIGN_OR_RETURN(upload, dev->create_stream("strata upload"));
  std::string run_name;
  if (world > 1) {
    // The host collectives' device buffer, kept: step() agrees on the norm
    // through it without allocating.
    STRATA_ASSIGN_OR_RETURN(comm_staging.ptr, dev->alloc(kCommStagingBytes));
    comm_staging.bytes = kCommStagingBytes;
    auto n = agree_run_name();
    if (!n.ok()) return n.status().with_context("engine: agreeing on the swap run directory with the other ranks");
    run_name = *n;
  }
  bool any_nvme = false;
  for (const auto& p : params)
    any_nvme |= p.compute.tier == Tier::kNvme || p.master.tier == Tier::kNvme || p.state[0].tier == Tier::kNvme ||
                p.grad.tier == Tier::kNvme;  // frozen params' unplaced arrays are kAuto
  if (any_nvme) {
    io::SwapStoreOptions so;
    for (const auto& d : cfg.nvme_dirs()) so.dirs.push_back(d.path);
    for (const auto& d : options.budgets_override.nvme)
      if (std::find(so.dirs.begin(), so.dirs.end(), d.path) == so.dirs.end()) so.dirs.push_back(d.path);
    if (so.dirs.empty())
      return Status(StatusCode::kInvalidArgument, "engine: state is planned to NVMe but no NVMe directory is set");
    so.rank = static_cast<int>(plan.rank);
    so.run_name = run_name;
    so.checksum_block = cfg.strata.swap_checksums ? io_quantum * 2 : 0;
    STRATA_ASSIGN_OR_RETURN(store, io::SwapStore::create(*io, so));
  }

  // Host arena: every host-tier array, 4 KiB aligned; host compute copies
  // in a pinned arena of their own (offload_param.pin_memory).
  uint64_t host_bytes = 0, compute_bytes = 0;
  auto host_size = [&](const ArrayLoc& a, uint64_t bytes, bool compute) {
    if (a.tier != Tier::kHost) return;
    (compute ? compute_bytes : host_bytes) += round_up(std::max<uint64_t>(bytes, 1), 4096);
  };
  // Stages 1-2 with N ranks: the compute copy is the whole parameter in the
  // all-gather's layout (rank r's padded shard at r * padded).
  const uint64_t compute_span = replicated ? world : 1;
  for (const auto& p : params) {
    const uint64_t n = p.shard.padded;
    host_size(p.compute, n * compute_span * dtype_size(p.dtype), true);
    host_size(p.master, n * 4, false);
    host_size(p.state[0], n * state_size, false);
    host_size(p.state[1], n * state_size, false);
    host_size(p.grad, n * 4, false);
  }
  bool pin_compute = false;
  if (compute_bytes > 0) {
    const std::optional<bool> asked = cfg.zero.offload_param.pin_memory;
    if (asked.has_value()) {
      pin_compute = *asked;
    } else if (dev->host_registrar() != nullptr) {
      // Unset: pinned when the device needs pinned memory for asynchronous
      // uploads and the pinned budget holds it next to the pool's buffers.
      const uint64_t cap = plan.budgets.pinned_bytes;
      pin_compute = cap == 0 || compute_bytes + plan.pinned_total() <= cap;
      if (!pin_compute)
        log_info("engine: host compute copies ({}) in pageable memory: the pinned budget {} holds {} of buffers "
                 "besides (set offload_param.pin_memory to choose)",
                 format_bytes(compute_bytes), format_bytes(cap), format_bytes(plan.pinned_total()));
    }
  }
  if (pin_compute) {
    auto a = dev->alloc_pinned(compute_bytes);
    if (a.ok()) {
      pinned_arena = *a;
    } else if (cfg.zero.offload_param.pin_memory.has_value()) {
      return a.status().with_context(
          fmt::format("engine: pinning the host compute copies ({}; offload_param.pin_memory true)",
                      format_bytes(compute_bytes)));
    } else {
      log_info("engine: host compute copies ({}) in pageable memory: pinning them was refused ({})",
               format_bytes(compute_bytes), a.status().message());
      pin_compute = false;
    }
  }
  if (!pin_compute) host_bytes += compute_bytes;
  if (host_bytes > 0) {
    STRATA_ASSIGN_OR_RETURN(host_arena, alloc_host(host_bytes));
  }
  uint64_t host_off = 0, pinned_off = 0;
  // `bytes`: the padded shard's; NVMe tensors hold exactly the shard (every
  // transfer of them then ends on a checksum block or at the tensor's end).
  auto place = [&](ParamState& p, ArrayLoc& a, uint64_t bytes, const char* kind, bool compute) -> Status {
    const uint64_t exact = p.shard.padded ? bytes / p.shard.padded * p.shard.size() : 0;
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
        auto t = store->add_tensor(p.name + "." + kind, exact);
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
  for (auto& p : params) {
    const uint64_t n = p.shard.padded;
    if (replicated) {
      if (p.compute.tier == Tier::kNvme)  // the planner refuses it; never a shard-sized file read as a whole
        return Status(StatusCode::kInternal, fmt::format("engine: {}: a replicated compute copy on NVMe", p.name));
      STRATA_RETURN_IF_ERROR(place(p, p.compute, n * world * dtype_size(p.dtype), "compute", true));
      // Everything that works on this rank's shard of the compute copy (the
      // optimizer's output, load_param, checkpoints) sees its own slot.
      p.replica = p.compute.ptr;
      p.compute.ptr = static_cast<char*>(p.replica) + uint64_t{rank} * n * dtype_size(p.dtype);
    } else {
      STRATA_RETURN_IF_ERROR(place(p, p.compute, n * dtype_size(p.dtype), "compute", true));
    }
    if (p.trainable) {
      STRATA_RETURN_IF_ERROR(place(p, p.master, n * 4, "master", false));
      STRATA_RETURN_IF_ERROR(place(p, p.state[0], n * state_size, "exp_avg", false));
      STRATA_RETURN_IF_ERROR(place(p, p.state[1], n * state_size, "exp_avg_sq", false));
      STRATA_RETURN_IF_ERROR(place(p, p.grad, n * 4, "grad", false));
    }
    // The optimizer pass writes every compute copy (bf16/fp16 converted,
    // fp32 as a copy of the updated master; device-homed ones uploaded from
    // its ring), except device-homed ones with overlap_backward: the pass
    // runs while backward still reads them, so they are rebuilt from the
    // master in step().
    p.refresh_from_master = p.trainable && p.compute.tier == Tier::kDevice && cfg.strata.overlap_backward;
  }
  STRATA_RETURN_IF_ERROR(dev->synchronize(upload));
  for (auto& g : groups) {
    STRATA_ASSIGN_OR_RETURN(g.release_event, dev->create_event());
  }
  return {};
}

uint64_t Registry::max_shard_elems() const {
  uint64_t m = 0;
  for (const auto& p : params)
    if (p.trainable) m = std::max(m, p.shard.padded);  // frozen parameters never pass through the optimizer
  return std::max<uint64_t>(m, 1);
}

// Pinned pool: upload staging, download pieces, accumulation scratch, optimizer ring.
Status Registry::create_pinned_pool(const PinnedNeeds& n) {
  uint64_t pool_total = kHugePageSize + pool_bytes(n.piece_bytes) * n.pieces + pool_bytes(n.ring_slot) * n.ring +
                        pool_bytes(n.staging_bytes) * n.staging;
  if (plan.budgets.pinned_bytes > 0 && pool_total > plan.budgets.pinned_bytes)
    return Status(
        StatusCode::kOutOfBudget,
        fmt::format("engine: pinned buffers need {} (optimizer ring {} x {}, {} upload staging x {}, {} "
                    "gradient pieces of {}) but the pinned budget is {}: {} short; lower "
                    "strata.optimizer_chunk or offload_optimizer.buffer_count, or raise strata.pinned_memory",
                    format_bytes(pool_total), n.ring, format_bytes(n.ring_slot), n.staging,
                    format_bytes(n.staging_bytes), n.pieces, format_bytes(n.piece_bytes),
                    format_bytes(plan.budgets.pinned_bytes), format_bytes(pool_total - plan.budgets.pinned_bytes)));
  io::PinnedPoolOptions ppo;
  ppo.budget_bytes = pool_total;
  ppo.slab_bytes = kHugePageSize;
  if (dev->host_registrar() != nullptr) ppo.registrars.push_back(dev->host_registrar());
  ppo.registrars.push_back(io->buffer_registrar());
  STRATA_ASSIGN_OR_RETURN(pool, io::PinnedPool::create(ppo));
  return {};
}

Registry::~Registry() {
  // The parts have returned their pinned buffers and device blocks by now.
  pool.reset();
  if (dev != nullptr) {
    for (auto& g : groups) dev->destroy_event(g.release_event);
    if (upload) (void)dev->destroy_stream(upload);
    for (void* p : device_blocks) (void)dev->free(p);
    if (comm_staging.ptr) (void)dev->free(comm_staging.ptr);
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

// ---------------------------------------------------------------- collectives

Status Registry::blocking_collective(const std::function<Status(DeviceStream*)>& op) {
  Status st = op(upload);
  Status sync = dev->synchronize(upload);
  return st.ok() ? sync : st;
}

Status Registry::host_all_gather(const void* mine, void* all, size_t bytes_per_rank) {
  STRATA_RETURN_IF_ERROR(comm::all_gather_host(*comm, upload, mine, all, bytes_per_rank, comm_staging));
  traffic.comm += bytes_per_rank * (world - 1);
  return {};
}

Status Registry::host_broadcast(void* data, size_t bytes, int root) {
  STRATA_RETURN_IF_ERROR(comm::broadcast_host(*comm, upload, data, bytes, root, comm_staging));
  if (rank == static_cast<uint32_t>(root)) traffic.comm += bytes * (world - 1);
  return {};
}

// One in-place all-gather per parameter, all enqueued on the upload stream
// (behind the release of a device-homed group) and waited for once.
Status Registry::gather_replicas(const std::vector<ParamId>& ids) {
  uint64_t sent = 0;
  Status st = blocking_collective(
      [&](DeviceStream* s) -> Status {
        for (ParamId id : ids) {
          const ParamState& p = params[id];
          if (p.compute.tier == Tier::kDevice) STRATA_RETURN_IF_ERROR(wait_released(id));
          const uint64_t per_rank = p.shard.padded * dtype_size(p.dtype);
          Status st = comm->all_gather(p.compute.ptr, p.replica, per_rank, s);
          if (!st.ok()) return st.with_context(fmt::format("engine: all-gathering the updated {}", p.name));
          sent += per_rank * (world - 1);
        }
        return {};
      });
  if (st.ok()) traffic.comm += sent;
  return st;
}

// ---------------------------------------------------------------- array helpers

Status Registry::sync_io(io::IoHandle h, bool write, uint64_t bytes) {
  Status st = h.wait();
  if (st.ok()) (write ? traffic.nvme_write : traffic.nvme_read) += bytes;
  return st;
}

Status Registry::traced_copy(void* dst, const void* src, size_t bytes, CopyKind kind, DeviceStream* s) {
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

Status Registry::read_array(const ArrayLoc& a, size_t esz, uint64_t off, uint64_t count, void* dst) {
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
      traffic.d2h += bytes;
      return dev->synchronize(upload);
    default:
      return Status(StatusCode::kInternal, "engine: array without a tier");
  }
}

Status Registry::write_array(const ArrayLoc& a, size_t esz, uint64_t off, uint64_t count, const void* src) {
  const uint64_t bytes = count * esz;
  switch (a.tier) {
    case Tier::kHost:
      std::memcpy(static_cast<char*>(a.ptr) + off * esz, src, bytes);
      return {};
    case Tier::kNvme: {
      Status st = sync_io(store->write(a.swap, off * esz, bytes, src), true, bytes);
      array_writes.fetch_add(1, std::memory_order_acq_rel);  // after the write: see the read-ahead
      return st;
    }
    case Tier::kDevice:
      STRATA_RETURN_IF_ERROR(
          traced_copy(static_cast<char*>(a.ptr) + off * esz, src, bytes, CopyKind::kHostToDevice, upload));
      traffic.h2d += bytes;
      return dev->synchronize(upload);
    default:
      return Status(StatusCode::kInternal, "engine: array without a tier");
  }
}

Status Registry::wait_released(ParamId id) {
  return dev->wait(upload, groups[params[id].group].release_event);
}

// The compute copy rebuilt from the master (round to nearest even, as the
// optimizer's params_out): device-homed ones with overlap_backward.
Status Registry::refresh_compute(ParamId id, const Bounce& b) {
  ParamState& p = params[id];
  const size_t esz = dtype_size(p.dtype);
  if (p.compute.tier == Tier::kDevice) STRATA_RETURN_IF_ERROR(wait_released(id));
  float* f = b.f32;
  void* c = b.compute;
  const uint64_t n = p.shard.size();
  for (uint64_t off = 0; off < n; off += b.elems) {
    const uint64_t cnt = std::min(b.elems, n - off);
    STRATA_RETURN_IF_ERROR(read_array(p.master, 4, off, cnt, f));
    STRATA_RETURN_IF_ERROR(narrow_from_f32(f, p.dtype, cnt, c));
    STRATA_RETURN_IF_ERROR(write_array(p.compute, esz, off, cnt, c));
  }
  return {};
}

}  // namespace strata::engine
