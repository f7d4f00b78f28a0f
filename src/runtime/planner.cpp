#include "runtime/planner.h"

#include <fmt/format.h>
#include <fnmatch.h>

#include <algorithm>
#include <array>
#include <unordered_map>

#include "common/enum_names.h"
#include "common/units.h"

namespace strata {

template <>
inline constexpr auto kEnumNames<StateKind> = std::to_array<EnumName<StateKind>>({
    {StateKind::kCompute, "compute copy"},
    {StateKind::kMaster, "fp32 master"},
    {StateKind::kOptimizer, "optimizer states"},
    {StateKind::kGrad, "fp32 grad accumulator"},
});

const char* state_kind_name(StateKind k) { return enum_name(k); }

LinkBytes& LinkBytes::operator+=(const LinkBytes& o) {
  nvme_read += o.nvme_read;
  nvme_write += o.nvme_write;
  h2d += o.h2d;
  d2h += o.d2h;
  comm += o.comm;
  return *this;
}

namespace {

constexpr int kc(StateKind k) {
  return static_cast<int>(k);
}
constexpr int kt(Tier t) {
  return static_cast<int>(t);
}
constexpr StateKind kKinds[] = {StateKind::kCompute, StateKind::kMaster, StateKind::kOptimizer, StateKind::kGrad};
// Host placement priority: what saves the most NVMe transfers per byte of
// RAM. With M micro-batches per step, a compute copy on NVMe is read twice per
// micro-batch (forward, backward) and written once per step: 2M+1 transfers
// per byte; a gradient is written every micro-batch and read back: 2M; master
// and optimizer states are read and written once per step: 2. Master before
// states: equal traffic, and the master is needed first in the update.
constexpr StateKind kHostOrder[] = {StateKind::kCompute, StateKind::kGrad, StateKind::kMaster, StateKind::kOptimizer};

uint64_t sub0(uint64_t a, uint64_t b) {
  return a > b ? a - b : 0;
}

Status out_of_budget(std::string msg) {
  return Status(StatusCode::kOutOfBudget, std::move(msg));
}

// "optimizer states 56.0 GiB + fp32 master 28.0 GiB", largest first.
std::string breakdown(const std::array<uint64_t, kNumStateKinds>& by_kind) {
  std::vector<std::pair<uint64_t, StateKind>> parts;
  for (StateKind k : kKinds)
    if (by_kind[kc(k)] > 0) parts.emplace_back(by_kind[kc(k)], k);
  std::stable_sort(parts.begin(), parts.end(), [](auto& a, auto& b) { return a.first > b.first; });
  std::string s;
  for (auto& [b, k] : parts) s += fmt::format("{}{} {}", s.empty() ? "" : " + ", state_kind_name(k), format_bytes(b));
  return s;
}

// "<breakdown> need X" / "<kind> needs X" when only one kind is involved.
std::string needs(const std::array<uint64_t, kNumStateKinds>& by_kind) {
  int n = 0;
  uint64_t total = 0;
  StateKind only = StateKind::kCompute;
  for (StateKind k : kKinds)
    if (by_kind[kc(k)] > 0) {
      ++n;
      total += by_kind[kc(k)];
      only = k;
    }
  if (n == 1)
    return fmt::format("{} {} {}", state_kind_name(only), only == StateKind::kOptimizer ? "need" : "needs",
                       format_bytes(total));
  return fmt::format("{} = {} needed", breakdown(by_kind), format_bytes(total));
}

bool glob_match(const std::string& pattern, const std::string& name) {
  return ::fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
}

Tier rule_tier(const GroupTierRule& r, StateKind k) {
  switch (k) {
    case StateKind::kCompute:
      return r.compute;
    case StateKind::kMaster:
      return r.master;
    case StateKind::kOptimizer:
      return r.optimizer;
    case StateKind::kGrad:
      return r.grad;
  }
  return Tier::kAuto;
}

}  // namespace

PlanOptions plan_options_from_config(const Config& c) {
  PlanOptions o;
  o.optimizer_state_dtype = c.strata.optimizer_state_dtype;
  o.device_reserve = c.strata.device_reserve;
  o.prefetch_depth = c.strata.prefetch_depth;
  o.held_groups = c.strata.held_groups;
  o.prefetch_bytes = c.strata.prefetch_bytes;
  o.micro_batches = c.gradient_accumulation_steps;
  o.shard_alignment = c.strata.shard_alignment;
  o.optimizer_chunk = c.strata.optimizer_chunk;
  o.optimizer_ring_buffers = static_cast<uint32_t>(std::min<uint64_t>(c.zero.offload_optimizer.buffer_count, 1024));
  o.replicate_params = c.zero.stage == 1 || c.zero.stage == 2;
  o.defer_grad_reduce = c.zero.stage == 1;
  o.stage_reduce = c.strata.gradient_staging.value_or(true);
  o.optimizer_handoff = c.strata.optimizer_handoff && !c.strata.overlap_backward;
  o.overrides = c.strata.groups;
  GroupTierRule ds;
  ds.match = "*";
  switch (c.zero.offload_param.device) {
    case OffloadDevice::kNone:
      ds.compute = Tier::kDevice;
      break;
    case OffloadDevice::kCpu:
      ds.compute = Tier::kHost;
      break;
    case OffloadDevice::kNvme:
      ds.compute = Tier::kNvme;
      break;
    case OffloadDevice::kAuto:
      break;
  }
  switch (c.zero.offload_optimizer.device) {
    case OffloadDevice::kNone:
      ds.master = ds.optimizer = ds.grad = Tier::kDevice;
      break;
    case OffloadDevice::kCpu:
      ds.master = ds.optimizer = ds.grad = Tier::kHost;
      break;
    case OffloadDevice::kNvme:
      ds.master = ds.optimizer = Tier::kNvme;
      break;
    case OffloadDevice::kAuto:
      break;
  }
  if (!(ds == GroupTierRule{"*"})) o.overrides.push_back(ds);
  return o;
}

uint64_t grad_piece_elems(uint64_t max_trainable_shard, uint32_t world_size) {
  const uint64_t cap = (uint64_t{4} << 20) / std::max<uint32_t>(world_size, 1);
  const uint64_t n = std::max<uint64_t>(std::min(max_trainable_shard, cap), 1);
  return (n + 32767) / 32768 * 32768;
}

uint64_t Plan::tier_bytes(Tier t) const {
  uint64_t s = 0;
  for (uint64_t b : bytes[kt(t)]) s += b;
  return s;
}
uint64_t Plan::device_total() const {
  return tier_bytes(Tier::kDevice) + device_buffers + local_grad_bytes + reduce_buffers + options.device_reserve;
}
uint64_t Plan::host_total() const {
  return tier_bytes(Tier::kHost) + pinned_total();
}
uint64_t Plan::nvme_total() const {
  return tier_bytes(Tier::kNvme);
}
LinkBytes Plan::per_step() const {
  LinkBytes l = forward_backward;
  l += optimizer_step;
  return l;
}

Result<uint64_t> host_budget_beside_ram_device(uint64_t share, uint64_t device_bytes) {
  if (device_bytes >= share)
    return Status(StatusCode::kOutOfBudget,
                  fmt::format("the device budget {} is RAM here and leaves nothing of this rank's MemAvailable {} "
                              "for the host tier; lower the device budget, or give the host budget",
                              format_bytes(device_bytes), format_bytes(share)));
  return share - device_bytes;
}

Result<Plan> make_plan(const ModelSpec& model, const PlanBudgets& budgets, const PlanOptions& opt) {
  STRATA_RETURN_IF_ERROR(validate_model_spec(model));
  if (opt.micro_batches == 0) return Status(StatusCode::kInvalidArgument, "plan: micro_batches must be at least 1");
  if (opt.shard_alignment == 0) return Status(StatusCode::kInvalidArgument, "plan: shard_alignment must be at least 1");
  if (opt.optimizer_chunk == 0) return Status(StatusCode::kInvalidArgument, "plan: optimizer_chunk must be at least 1");
  if (opt.optimizer_ring_buffers == 0)
    return Status(StatusCode::kInvalidArgument, "plan: optimizer_ring_buffers must be at least 1");
  if (opt.optimizer_state_dtype != DType::kF32 && opt.optimizer_state_dtype != DType::kBF16)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("plan: optimizer states are fp32 or bf16, not {}", dtype_name(opt.optimizer_state_dtype)));

  Plan plan;
  plan.world_size = model.world_size;
  plan.rank = model.rank;
  plan.budgets = budgets;
  plan.options = opt;
  const uint32_t ws = model.world_size;
  // Stages 1-2 with N ranks: the compute copies are whole on every rank and
  // no acquire gathers (the step all-gathers the updated shards instead).
  const bool replicated = opt.replicate_params && ws > 1;
  const bool gathers = ws > 1 && !replicated;
  const bool deferred = opt.defer_grad_reduce && ws > 1;
  const uint64_t state_elem_bytes = uint64_t{opt.optimizer_states} * dtype_size(opt.optimizer_state_dtype);

  // ---- sizes per group (this rank's padded shards)
  std::unordered_map<std::string, size_t> index;
  for (const auto& p : model.params) {
    auto [it, fresh] = index.emplace(p.group, plan.groups.size());
    if (fresh) plan.groups.push_back(GroupPlan{p.group});
    GroupPlan& g = plan.groups[it->second];
    const uint64_t n = p.numel();
    const ShardRange sr = shard_range(n, ws, model.rank, opt.shard_alignment);
    g.numel += n;
    g.shard_numel += sr.padded;
    if (p.trainable) {
      g.trainable_shard_numel += sr.padded;
      g.trainable_compute_bytes += sr.padded * dtype_size(p.compute_dtype);
      g.max_trainable_shard = std::max(g.max_trainable_shard, sr.padded);
    }
    g.bytes[kc(StateKind::kCompute)] += sr.padded * (replicated ? ws : 1) * dtype_size(p.compute_dtype);
    g.shard_compute_bytes += sr.padded * dtype_size(p.compute_dtype);
    if (deferred && p.trainable) plan.local_grad_bytes += (n * 4 + 255) / 256 * 256;
    g.gathered_compute_bytes += sr.padded * ws * dtype_size(p.compute_dtype);
  }
  // ---- the gradient path's pieces
  {
    uint64_t max_shard = 0;
    for (const auto& g : plan.groups) max_shard = std::max(max_shard, g.max_trainable_shard);
    plan.grad_piece_elems = grad_piece_elems(max_shard, ws);
    std::unordered_map<std::string, uint64_t> pieces;  // per group: its trainable parameters' pieces
    for (const auto& p : model.params)
      if (p.trainable)
        plan.grad_pieces_wanted = std::max(
            plan.grad_pieces_wanted,
            pieces[p.group] += (shard_range(p.numel(), ws, model.rank, opt.shard_alignment).padded +
                                plan.grad_piece_elems - 1) / plan.grad_piece_elems);
  }
  for (auto& g : plan.groups) {
    // Frozen parameters have a compute copy only.
    g.bytes[kc(StateKind::kMaster)] = 4 * g.trainable_shard_numel;
    g.bytes[kc(StateKind::kOptimizer)] = state_elem_bytes * g.trainable_shard_numel;
    g.bytes[kc(StateKind::kGrad)] = 4 * g.trainable_shard_numel;
    plan.model_numel += g.numel;
    plan.shard_numel += g.shard_numel;
  }

  // ---- overrides: per kind, the first matching rule that names a tier
  for (const auto& r : opt.overrides) {
    bool any = false;
    for (const auto& g : plan.groups) any = any || glob_match(r.match, g.name);
    if (!any) {
      std::string names;
      for (size_t i = 0; i < plan.groups.size() && i < 4; ++i) names += (i ? ", " : "") + plan.groups[i].name;
      if (plan.groups.size() > 4) names += ", ...";
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("plan: group rule \"{}\" matches no group (groups: {})", r.match, names));
    }
  }
  for (auto& g : plan.groups) {
    for (StateKind k : kKinds) {
      for (const auto& r : opt.overrides) {
        if (!glob_match(r.match, g.name)) continue;
        const Tier t = rule_tier(r, k);
        if (t == Tier::kAuto) continue;
        g.tier[kc(k)] = t;
        g.forced[kc(k)] = true;
        break;
      }
    }
    const bool master_dev = g.tier[kc(StateKind::kMaster)] == Tier::kDevice;
    const bool opt_dev = g.tier[kc(StateKind::kOptimizer)] == Tier::kDevice;
    const bool grad_dev = g.tier[kc(StateKind::kGrad)] == Tier::kDevice;
    if (master_dev != opt_dev || (grad_dev && !master_dev))
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("plan: group {}: the optimizer runs on the device only with the fp32 master, the "
                                "optimizer states and the gradients all there (got master {}, optimizer {}, grad {})",
                                g.name, tier_name(g.tier[kc(StateKind::kMaster)]),
                                tier_name(g.tier[kc(StateKind::kOptimizer)]), tier_name(g.tier[kc(StateKind::kGrad)])));
    if (master_dev && !grad_dev) {
      // A GPU step needs the gradients where it runs: follow the master.
      if (g.forced[kc(StateKind::kGrad)])
        return Status(
            StatusCode::kInvalidArgument,
            fmt::format("plan: group {}: fp32 master on the device needs the gradients there too (got grad {})", g.name,
                        tier_name(g.tier[kc(StateKind::kGrad)])));
      g.tier[kc(StateKind::kGrad)] = Tier::kDevice;
      g.forced[kc(StateKind::kGrad)] = true;
    }
    if (replicated && g.tier[kc(StateKind::kCompute)] == Tier::kNvme)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("plan: group {}: parameters on NVMe (offload_param.device nvme or a group rule) with "
                                "zero_optimization.stage 1 or 2 and {} ranks: stages 1 and 2 keep every parameter "
                                "whole on every rank, on the device or host (as DeepSpeed allows offload_param with "
                                "stage 3 only); use stage 3",
                                g.name, ws));
  }

  auto forced_on = [&](Tier t) {
    std::array<uint64_t, kNumStateKinds> by{};
    for (const auto& g : plan.groups)
      for (StateKind k : kKinds)
        if (g.forced[kc(k)] && g.tier[kc(k)] == t) by[kc(k)] += g.bytes[kc(k)];
    return by;
  };
  auto sum = [](const std::array<uint64_t, kNumStateKinds>& a) {
    uint64_t s = 0;
    for (uint64_t b : a) s += b;
    return s;
  };

  // ---- device: forced state, working buffers, then compute copies first-fit
  const uint64_t usable = sub0(budgets.device_bytes, opt.device_reserve);
  const std::string usable_text = fmt::format("{} is usable ({} minus the {} reserve)", format_bytes(usable),
                                              format_bytes(budgets.device_bytes), format_bytes(opt.device_reserve));
  // How much more device budget `need` takes: past the reserve too, which
  // `usable` (never below 0) hides when the budget is under it.
  auto dev_short = [&](uint64_t need) { return format_bytes(sub0(need + opt.device_reserve, budgets.device_bytes)); };
  const auto dev_forced_by = forced_on(Tier::kDevice);
  const uint64_t dev_forced = sum(dev_forced_by);
  if (dev_forced > usable)
    return out_of_budget(
        fmt::format("device: {} by group overrides but {}: {} short; raise the device budget or "
                    "move groups off the device",
                    needs(dev_forced_by), usable_text, dev_short(dev_forced)));
  uint64_t auto_compute = 0;
  bool some_compute_off_device = false;
  for (const auto& g : plan.groups) {
    if (!g.forced[kc(StateKind::kCompute)])
      auto_compute += g.bytes[kc(StateKind::kCompute)];
    else if (g.tier[kc(StateKind::kCompute)] != Tier::kDevice)
      some_compute_off_device = true;
  }
  const bool need_buffers =
      gathers || some_compute_off_device || dev_forced + plan.local_grad_bytes + auto_compute > usable;
  uint64_t max_gathered = 0;
  for (const auto& g : plan.groups)
    if (gathers || !(g.forced[kc(StateKind::kCompute)] && g.tier[kc(StateKind::kCompute)] == Tier::kDevice))
      max_gathered = std::max(max_gathered, g.gathered_compute_bytes);
  uint32_t depth = opt.prefetch_depth;
  const uint32_t held = std::max<uint32_t>(opt.held_groups, 1);
  if (opt.prefetch_bytes > 0 && max_gathered > 0)
    depth = static_cast<uint32_t>(std::min<uint64_t>(depth, opt.prefetch_bytes / max_gathered));
  if (need_buffers) {
    plan.prefetch_groups = depth;
    plan.held_groups = held;
    plan.device_buffers = uint64_t{held + depth} * max_gathered;
  }
  if (dev_forced + plan.local_grad_bytes > usable)
    return out_of_budget(fmt::format(
        "device: zero_optimization.stage 1 with {} ranks sums each rank's whole gradient on the device ({} fp32) "
        "but {}: {} short; use stage 2 (gradients reduce-scattered every micro-batch, 1/{} on each rank) or raise "
        "the device budget",
        ws, format_bytes(plan.local_grad_bytes), usable_text, dev_short(dev_forced + plan.local_grad_bytes), ws));
  if (dev_forced + plan.local_grad_bytes + plan.device_buffers > usable)
    return out_of_budget(fmt::format(
        "device: working buffers need {} ({} x the largest group, {}: {} in use, {} prefetched){} but {}: {} short; "
        "lower strata.prefetch_depth, strata.held_groups or strata.device_reserve, or raise the device budget",
        format_bytes(plan.device_buffers), held + depth, format_bytes(max_gathered), held, depth,
        dev_forced ? fmt::format(" on top of {} placed by overrides", format_bytes(dev_forced)) : "", usable_text,
        dev_short(dev_forced + plan.local_grad_bytes + plan.device_buffers)));
  // N ranks (not stage 1, whose sums live in local_grad_bytes and are
  // reduce-scattered from there): the reduce-scatters' send buffers, one
  // group's worth when they fit (backward runs ahead of its reduce-scatters),
  // else kGradPieces, else one unstaged (see PlanOptions::stage_reduce).
  Status reduce_short;
  if (ws > 1 && !deferred) {
    const uint64_t piece_bytes = plan.grad_piece_elems * 4;
    const uint64_t taken = dev_forced + plan.local_grad_bytes + plan.device_buffers;
    const uint64_t room = sub0(usable, taken);
    const uint64_t unstaged = (uint64_t{ws} + 1) * piece_bytes;
    auto staged = [&](uint64_t n) { return (n * ws + 1) * piece_bytes; };
    const uint64_t want = std::max<uint64_t>(plan.grad_pieces_wanted, kGradPieces);
    if (opt.stage_reduce && staged(want) <= room) {
      plan.grad_staged = true;
      plan.grad_pieces = static_cast<uint32_t>(std::min<uint64_t>(want, 1u << 20));
    } else if (opt.stage_reduce && staged(kGradPieces) <= room) {
      plan.grad_staged = true;
    }
    plan.reduce_buffers = plan.grad_staged ? staged(plan.grad_pieces) : unstaged;
    if (plan.reduce_buffers > room)  // refused once the state is placed (a shorter tier is the better message)
      reduce_short = out_of_budget(fmt::format(
          "device: the gradients' reduce-scatter needs {} ({} ranks x a {}-element piece, plus one) on top of {} "
          "but {}: {} short; raise the device budget or lower strata.device_reserve",
          format_bytes(plan.reduce_buffers), ws, plan.grad_piece_elems, format_bytes(taken), usable_text,
          dev_short(taken + plan.reduce_buffers)));
  }
  uint64_t dev_free = sub0(usable, dev_forced + plan.local_grad_bytes + plan.device_buffers + plan.reduce_buffers);
  for (auto& g : plan.groups) {
    if (g.forced[kc(StateKind::kCompute)]) continue;
    const uint64_t b = g.bytes[kc(StateKind::kCompute)];
    if (b <= dev_free) {
      g.tier[kc(StateKind::kCompute)] = Tier::kDevice;
      dev_free -= b;
    }
  }

  // ---- host: pinned staging for compute copies that live off the device
  uint64_t max_off_device = 0;
  for (const auto& g : plan.groups)
    if (g.tier[kc(StateKind::kCompute)] != Tier::kDevice)
      max_off_device = std::max(max_off_device, g.bytes[kc(StateKind::kCompute)]);
  plan.staging_ring = uint64_t{1 + depth} * max_off_device;
  plan.grad_pinned = (uint64_t{plan.grad_download_pieces()} + 1) * plan.grad_piece_elems * 4;
  const uint64_t pinned_fixed = plan.staging_ring + plan.grad_pinned;
  const auto host_forced_by = forced_on(Tier::kHost);
  const uint64_t host_forced = sum(host_forced_by);
  if (pinned_fixed + host_forced > budgets.host_bytes)
    return out_of_budget(fmt::format(
        "host: {}{}pinned buffers need {} (staging {}, gradient pieces {}) but the host budget is {}: {} short; "
        "raise the host budget{}",
        host_forced ? needs(host_forced_by) + " by group overrides" : "", host_forced ? " plus " : "",
        format_bytes(pinned_fixed), format_bytes(plan.staging_ring), format_bytes(plan.grad_pinned),
        format_bytes(budgets.host_bytes), format_bytes(pinned_fixed + host_forced - budgets.host_bytes),
        host_forced ? " or move groups to NVMe" : ""));
  uint64_t host_free = budgets.host_bytes - pinned_fixed - host_forced;

  uint64_t auto_rest = 0;
  bool forced_nvme = false;
  for (const auto& g : plan.groups)
    for (StateKind k : kKinds) {
      if (!g.forced[kc(k)] && g.tier[kc(k)] == Tier::kAuto) auto_rest += g.bytes[kc(k)];
      if (g.forced[kc(k)] && g.tier[kc(k)] == Tier::kNvme) forced_nvme = true;
    }
  // The optimizer step touches trainable parameters only (frozen ones have
  // no master, states or gradients and are never written).
  uint64_t max_shard = 0;
  for (const auto& g : plan.groups) max_shard = std::max(max_shard, g.trainable_shard_numel);
  if (!forced_nvme && auto_rest <= host_free) {
    for (auto& g : plan.groups)
      for (StateKind k : kKinds)
        if (g.tier[kc(k)] == Tier::kAuto) g.tier[kc(k)] = Tier::kHost;
  } else {
    // Something goes to NVMe: keep room for the optimizer-step ring at its
    // largest (master, states, gradient and an fp32 compute copy per element).
    const uint64_t worst_ring = uint64_t{opt.optimizer_ring_buffers} * std::min(opt.optimizer_chunk, max_shard) *
                                (4 + state_elem_bytes + 4 + 4);
    const uint64_t reserve = std::min(worst_ring, host_free);
    uint64_t free = host_free - reserve;
    for (StateKind k : kHostOrder)
      for (auto& g : plan.groups) {
        if (g.tier[kc(k)] != Tier::kAuto) continue;
        if (g.bytes[kc(k)] <= free) {
          g.tier[kc(k)] = Tier::kHost;
          free -= g.bytes[kc(k)];
        } else if (replicated && k == StateKind::kCompute) {
          return out_of_budget(fmt::format(
              "host: zero_optimization.stage 1 or 2 with {} ranks keeps every parameter whole on every rank, but "
              "the compute copies of group {} ({}) fit neither the device nor what is left of the host budget "
              "({}); use stage 3 (parameters sharded, and allowed on NVMe) or raise the host budget",
              ws, g.name, format_bytes(g.bytes[kc(k)]), format_bytes(free)));
        } else {
          g.tier[kc(k)] = Tier::kNvme;
        }
      }
    host_free = free + reserve;
  }

  // ---- the optimizer ring, as placed
  uint64_t ring_elem = 0, ring_chunk = 0;
  for (const auto& g : plan.groups) {
    if (g.tier[kc(StateKind::kMaster)] == Tier::kDevice || g.trainable_shard_numel == 0) continue;
    uint64_t per = 0;
    if (g.tier[kc(StateKind::kMaster)] == Tier::kNvme) per += 4;
    if (g.tier[kc(StateKind::kOptimizer)] == Tier::kNvme) per += state_elem_bytes;
    if (g.tier[kc(StateKind::kGrad)] == Tier::kNvme) per += 4;
    if (g.tier[kc(StateKind::kCompute)] == Tier::kNvme)
      per += (g.trainable_compute_bytes + g.trainable_shard_numel - 1) / g.trainable_shard_numel;
    if (per == 0) continue;
    ring_elem = std::max(ring_elem, per);
    ring_chunk = std::max(ring_chunk, std::min(opt.optimizer_chunk, g.trainable_shard_numel));
  }
  plan.optimizer_chunk_bytes = ring_chunk * ring_elem;
  plan.optimizer_ring = uint64_t{opt.optimizer_ring_buffers} * plan.optimizer_chunk_bytes;
  if (plan.optimizer_ring > host_free)
    return out_of_budget(fmt::format(
        "host: the optimizer-step ring needs {} ({} buffers of {}) but only {} of the host budget {} is left: {} "
        "short; "
        "raise the host budget or lower strata.optimizer_chunk",
        format_bytes(plan.optimizer_ring), opt.optimizer_ring_buffers, format_bytes(plan.optimizer_chunk_bytes),
        format_bytes(host_free), format_bytes(budgets.host_bytes), format_bytes(plan.optimizer_ring - host_free)));
  if (budgets.pinned_bytes > 0 && plan.pinned_total() > budgets.pinned_bytes)
    return out_of_budget(fmt::format(
        "pinned host memory: buffers need {} (staging {}, optimizer ring {}, gradient pieces {}) but the pinned "
        "budget is {}: {} short; raise strata.pinned_memory, or lower strata.prefetch_depth or "
        "strata.optimizer_chunk",
        format_bytes(plan.pinned_total()), format_bytes(plan.staging_ring), format_bytes(plan.optimizer_ring),
        format_bytes(plan.grad_pinned),
        format_bytes(budgets.pinned_bytes), format_bytes(plan.pinned_total() - budgets.pinned_bytes)));

  // ---- totals and NVMe
  for (const auto& g : plan.groups)
    for (StateKind k : kKinds) plan.bytes[kt(g.tier[kc(k)])][kc(k)] += g.bytes[kc(k)];
  const uint64_t nvme_need = plan.nvme_total();
  uint64_t nvme_cap = 0;
  for (const auto& d : budgets.nvme) nvme_cap += d.capacity;
  if (nvme_need > nvme_cap) {
    const auto& by = plan.bytes[kt(Tier::kNvme)];
    const uint64_t states = by[kc(StateKind::kOptimizer)];
    std::string bf16 = opt.optimizer_state_dtype == DType::kF32 && states > 0
                           ? fmt::format(" or use bf16 optimizer states (saves {})", format_bytes(states / 2))
                           : "";
    if (budgets.nvme.empty())
      return out_of_budget(fmt::format(
          "NVMe: {} beyond what fits on the device and the host, but no NVMe directory is configured: {} short; "
          "add one (strata.nvme or offload_optimizer.nvme_path), raise the host budget{}",
          needs(by), format_bytes(nvme_need), bf16));
    std::string where =
        budgets.nvme.size() == 1
            ? fmt::format("{} has {} free", budgets.nvme[0].path, format_bytes(nvme_cap))
            : fmt::format("the {} NVMe directories have {} free", budgets.nvme.size(), format_bytes(nvme_cap));
    return out_of_budget(fmt::format("NVMe: {} but {}: {} short; add a directory{}", needs(by), where,
                                     format_bytes(nvme_need - nvme_cap), bf16));
  }
  STRATA_RETURN_IF_ERROR(reduce_short);
  // Spread over the directories in proportion to their capacity (striping
  // keeps every drive busy); floor shares, then the remainder where it fits.
  plan.nvme_dir_bytes.assign(budgets.nvme.size(), 0);
  uint64_t assigned = 0;
  for (size_t i = 0; i < budgets.nvme.size() && nvme_cap > 0; ++i) {
    plan.nvme_dir_bytes[i] = static_cast<uint64_t>((unsigned __int128)nvme_need * budgets.nvme[i].capacity / nvme_cap);
    assigned += plan.nvme_dir_bytes[i];
  }
  for (size_t i = 0; i < budgets.nvme.size() && assigned < nvme_need; ++i) {
    const uint64_t add = std::min(nvme_need - assigned, budgets.nvme[i].capacity - plan.nvme_dir_bytes[i]);
    plan.nvme_dir_bytes[i] += add;
    assigned += add;
  }

  // ---- bytes per step on each link (this rank)
  const uint64_t m = opt.micro_batches;
  const uint64_t ups = uint64_t{opt.uploads_per_micro_batch} * m;
  // Uploads per group and step. The engine's device slots (held + prefetch
  // + one cached when it fits, Uploader::allocate_slots) keep the last groups used: with
  // two acquires per micro-batch (backward in reverse order), the last S
  // slot-using groups of forward are still there when backward starts, and
  // the first S of backward's end when the next micro-batch of the step
  // starts (a step changes the copies: the slots are dropped). When every
  // slot-using group fits in the slots, each is uploaded once per step.
  std::vector<uint64_t> uploads(plan.groups.size(), ups);
  {
    std::vector<size_t> slotted;  // groups that pass through the slots, in order
    for (size_t i = 0; i < plan.groups.size(); ++i)
      if (gathers || plan.groups[i].tier[kc(StateKind::kCompute)] != Tier::kDevice) slotted.push_back(i);
    // The cached slot is allocated when the device budget has room for it.
    const uint64_t placed =
        plan.tier_bytes(Tier::kDevice) + plan.device_buffers + plan.local_grad_bytes + plan.reduce_buffers;
    const bool cached = budgets.device_bytes >= placed && budgets.device_bytes - placed >= max_gathered;
    const size_t slots = need_buffers ? size_t{held} + depth + (cached ? 1 : 0) : 0;
    for (size_t k = 0; k < slotted.size(); ++k) {
      uint64_t& u = uploads[slotted[k]];
      if (slotted.size() <= slots) {
        u = 1;
      } else if (opt.uploads_per_micro_batch >= 2) {
        if (k + slots >= slotted.size()) u -= m;  // a hit when backward starts
        if (k < slots) u -= m - 1;                // a hit when the next micro-batch starts
      }
    }
  }
  // The hand-off (PlanOptions::optimizer_handoff): the first prefetched
  // positions of the acquire order (forward's first groups) whose compute
  // copies are on NVMe and wholly trainable take their first upload of the
  // step from the optimizer's output, not from NVMe.
  std::vector<bool> handed(plan.groups.size(), false);
  if (opt.optimizer_handoff && plan.world_size == 1 && need_buffers)
    for (size_t gi = 0; gi < plan.groups.size() && gi < plan.prefetch_groups; ++gi) {
      const GroupPlan& g = plan.groups[gi];
      handed[gi] = g.tier[kc(StateKind::kCompute)] == Tier::kNvme && g.trainable_shard_numel == g.shard_numel &&
                   uploads[gi] > 0;
    }
  for (size_t gi = 0; gi < plan.groups.size(); ++gi) {
    const GroupPlan& g = plan.groups[gi];
    const uint64_t c = g.bytes[kc(StateKind::kCompute)];
    const uint64_t gr = g.bytes[kc(StateKind::kGrad)];
    switch (g.tier[kc(StateKind::kCompute)]) {
      case Tier::kHost:
        plan.forward_backward.h2d += uploads[gi] * c;
        break;
      case Tier::kNvme:
        plan.forward_backward.nvme_read += (uploads[gi] - (handed[gi] ? 1 : 0)) * c;
        plan.forward_backward.h2d += uploads[gi] * c;
        break;
      default:
        break;
    }
    // Gradients leave the device in the compute dtype, once per micro-batch,
    // and are accumulated in fp32 where the accumulator lives.
    // N ranks: every micro-batch's gradient is reduce-scattered in fp32 (this
    // rank sends its shard's worth to each of N-1 peers) and this rank's
    // shard of the sum leaves the device in fp32; stage 1 does both once per
    // step, from each rank's own sum of its micro-batches on the device.
    // Stage 3 all-gathers the group after every upload (a slot hit reuses the
    // gathered group: uploads[gi]), stages 1-2 once after the step.
    // Frozen parameters (a LoRA base) have no gradient, no update and no
    // new copy to send anywhere: only the trainable ones count from here.
    const uint64_t reduces = deferred ? 1 : m;
    if (g.tier[kc(StateKind::kGrad)] != Tier::kDevice)
      plan.forward_backward.d2h += reduces * (ws > 1 ? 4 * g.trainable_shard_numel : g.trainable_compute_bytes);
    const uint64_t peers = plan.world_size - 1;
    plan.forward_backward.comm += peers * (reduces * gr + (replicated ? 0 : uploads[gi] * c));
    if (replicated) plan.optimizer_step.comm += peers * g.trainable_compute_bytes;
    if (g.tier[kc(StateKind::kGrad)] == Tier::kNvme) {
      plan.forward_backward.nvme_write += reduces * gr;
      plan.forward_backward.nvme_read += (reduces - 1) * gr;
      plan.optimizer_step.nvme_read += gr;
    }
    if (g.tier[kc(StateKind::kMaster)] == Tier::kDevice) {
      plan.gpu_optimizer_numel += g.trainable_shard_numel;
      continue;
    }
    plan.cpu_optimizer_numel += g.trainable_shard_numel;
    for (StateKind k : {StateKind::kMaster, StateKind::kOptimizer})
      if (g.tier[kc(k)] == Tier::kNvme) {
        plan.optimizer_step.nvme_read += g.bytes[kc(k)];
        plan.optimizer_step.nvme_write += g.bytes[kc(k)];
      }
    // The updated compute copy goes from the CPU optimizer to its home.
    if (g.tier[kc(StateKind::kCompute)] == Tier::kDevice) plan.optimizer_step.h2d += g.trainable_compute_bytes;
    if (g.tier[kc(StateKind::kCompute)] == Tier::kNvme) plan.optimizer_step.nvme_write += g.trainable_compute_bytes;
  }
  return plan;
}

// ------------------------------------------------------------------ report

std::string Plan::report() const {
  std::string r;
  auto line = [&](const std::string& s) { r += s + "\n"; };
  line(fmt::format("Plan: {} parameters ({}) in {} groups; world_size {}, rank {} holds {} elements",
                   format_count(model_numel), model_numel, groups.size(), world_size, rank, shard_numel));
  line(fmt::format("      optimizer states: {} x {}, {} micro-batch(es) per step", options.optimizer_states,
                   dtype_name(options.optimizer_state_dtype), options.micro_batches));
  std::string dirs;
  for (size_t i = 0; i < budgets.nvme.size(); ++i)
    dirs += fmt::format("{}{} ({})", i ? ", " : "", budgets.nvme[i].path, format_bytes(budgets.nvme[i].capacity));
  line(fmt::format("Budgets: device {} (reserve {}), host {} (pinned cap {}), NVMe {}",
                   format_bytes(budgets.device_bytes), format_bytes(options.device_reserve),
                   format_bytes(budgets.host_bytes),
                   budgets.pinned_bytes ? format_bytes(budgets.pinned_bytes) : std::string("none"),
                   dirs.empty() ? std::string("none") : dirs));
  line("");
  line(fmt::format("  {:<24}{:>12}{:>12}{:>12}", "", "device", "host", "nvme"));
  for (StateKind k : kKinds)
    line(fmt::format("  {:<24}{:>12}{:>12}{:>12}", state_kind_name(k), format_bytes(bytes[kt(Tier::kDevice)][kc(k)]),
                     format_bytes(bytes[kt(Tier::kHost)][kc(k)]), format_bytes(bytes[kt(Tier::kNvme)][kc(k)])));
  line(fmt::format("  {:<24}{:>12}{:>12}{:>12}", "buffers", format_bytes(device_buffers),
                   format_bytes(staging_ring + optimizer_ring), "-"));
  if (local_grad_bytes)
    line(fmt::format("  {:<24}{:>12}{:>12}{:>12}", "stage-1 local grad", format_bytes(local_grad_bytes), "-", "-"));
  if (reduce_buffers)
    line(fmt::format("  {:<24}{:>12}{:>12}{:>12}", "grad reduce-scatter", format_bytes(reduce_buffers), "-", "-"));
  line(fmt::format("  {:<24}{:>12}{:>12}{:>12}", "reserve", format_bytes(options.device_reserve), "-", "-"));
  line(fmt::format("  {:<24}{:>12}{:>12}{:>12}", "total", format_bytes(device_total()), format_bytes(host_total()),
                   format_bytes(nvme_total())));
  uint64_t cap = 0;
  for (const auto& d : budgets.nvme) cap += d.capacity;
  line(fmt::format("  {:<24}{:>12}{:>12}{:>12}", "budget", format_bytes(budgets.device_bytes),
                   format_bytes(budgets.host_bytes), format_bytes(cap)));
  if (device_buffers)
    line(fmt::format("  device buffers: {} groups ({} in use + {} prefetched)", held_groups + prefetch_groups,
                     held_groups, prefetch_groups));
  if (world_size > 1 && local_grad_bytes == 0)
    line(grad_staged && grad_pieces >= grad_pieces_wanted
             ? fmt::format("  gradient reduce-scatters: behind backward ({} send buffers of {} elements x {} ranks: "
                           "the largest group's gradient)",
                           grad_pieces, grad_piece_elems, world_size)
         : grad_staged
             ? fmt::format("  gradient reduce-scatters: {} send buffers of {} elements x {} ranks, not the {} of the "
                           "largest group (the device budget): backward waits for all but each group's last {}",
                           grad_pieces, grad_piece_elems, world_size, grad_pieces_wanted, grad_pieces)
             : std::string("  gradient reduce-scatters: from the caller's buffer (strata.gradient_staging false, or "
                           "the device budget): backward waits for each"));
  line(fmt::format("  pinned: staging {}, optimizer ring {} ({} x {}), gradient pieces {} ({} x {} elements)",
                   format_bytes(staging_ring), format_bytes(optimizer_ring), options.optimizer_ring_buffers,
                   format_bytes(optimizer_chunk_bytes), format_bytes(grad_pinned),
                   grad_download_pieces() + 1, grad_piece_elems));
  for (size_t i = 0; i < nvme_dir_bytes.size(); ++i)
    line(fmt::format("  {}: {} of {}", budgets.nvme[i].path, format_bytes(nvme_dir_bytes[i]),
                     format_bytes(budgets.nvme[i].capacity)));
  line("");
  line("Groups (compute / master / optimizer / grad):");
  // Runs of consecutive groups with the same placement print as one line.
  for (size_t i = 0; i < groups.size();) {
    size_t j = i + 1;
    while (j < groups.size() && groups[j].tier == groups[i].tier) ++j;
    std::string names =
        j - i == 1 ? groups[i].name : fmt::format("{} .. {} ({} groups)", groups[i].name, groups[j - 1].name, j - i);
    auto mark = [&](StateKind k) {
      bool forced = false;
      for (size_t x = i; x < j; ++x) forced = forced || groups[x].forced[kc(k)];
      return fmt::format("{}{}", tier_name(groups[i].tier[kc(k)]), forced ? "*" : "");
    };
    line(fmt::format("  {:<36} {} / {} / {} / {}", names, mark(StateKind::kCompute), mark(StateKind::kMaster),
                     mark(StateKind::kOptimizer), mark(StateKind::kGrad)));
    i = j;
  }
  bool any_forced = false;
  for (const auto& g : groups)
    for (bool f : g.forced) any_forced = any_forced || f;
  if (any_forced) line("  (* = set by an override)");
  line("");
  line("Moved per step:          forward+backward   optimizer step       total");
  auto row = [&](const char* name, uint64_t a, uint64_t b) {
    line(fmt::format("  {:<22}{:>18}{:>17}{:>12}", name, format_bytes(a), format_bytes(b), format_bytes(a + b)));
  };
  row("NVMe read", forward_backward.nvme_read, optimizer_step.nvme_read);
  row("NVMe write", forward_backward.nvme_write, optimizer_step.nvme_write);
  row("host -> device", forward_backward.h2d, optimizer_step.h2d);
  row("device -> host", forward_backward.d2h, optimizer_step.d2h);
  if (world_size > 1) row("to the other ranks", forward_backward.comm, optimizer_step.comm);
  line(fmt::format("  optimizer: {} elements on the CPU, {} on the device", cpu_optimizer_numel, gpu_optimizer_numel));
  return r;
}

// ------------------------------------------------------------------ step time

double attention_forward_flops_per_token(uint64_t layers, uint64_t heads, uint64_t head_dim, uint64_t seq) {
  return 2.0 * static_cast<double>(seq + 1) * static_cast<double>(heads) * static_cast<double>(head_dim) *
         static_cast<double>(layers);
}

double flops_per_token(uint64_t model_numel, const Workload& work) {
  const double passes = work.activation_checkpointing ? 4.0 : 3.0;  // forward units: fwd, (recompute), bwd = 2
  const uint64_t matmul = model_numel - std::min(model_numel, work.non_matmul_params);
  const double frozen = static_cast<double>(std::min(matmul, work.frozen_matmul_params));
  return passes * (2.0 * static_cast<double>(matmul) + work.attention_forward_flops_per_token) - 2.0 * frozen;
}

double flops_per_token(const Plan& plan, const Workload& work) { return flops_per_token(plan.model_numel, work); }

Result<StepTimeEstimate> predict_step_time(const Plan& plan, const Bandwidths& bw, const Workload& work) {
  if (work.tokens_per_micro_batch == 0)
    return Status(StatusCode::kInvalidArgument, "step time: tokens_per_micro_batch must be positive");
  const LinkBytes fb = plan.forward_backward, st = plan.optimizer_step;
  auto need = [](double v, uint64_t bytes, const char* name) -> Status {
    if (bytes > 0 && !(v > 0))
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("step time: the plan moves data over {} but its bandwidth is not positive", name));
    return Status::ok_status();
  };
  STRATA_RETURN_IF_ERROR(need(bw.h2d, fb.h2d + st.h2d, "host->device"));
  STRATA_RETURN_IF_ERROR(need(bw.d2h, fb.d2h + st.d2h, "device->host"));
  STRATA_RETURN_IF_ERROR(need(bw.link, fb.comm + st.comm, "the link between ranks"));
  STRATA_RETURN_IF_ERROR(need(bw.nvme_read, fb.nvme_read + st.nvme_read, "NVMe read"));
  STRATA_RETURN_IF_ERROR(need(bw.nvme_write, fb.nvme_write + st.nvme_write, "NVMe write"));
  STRATA_RETURN_IF_ERROR(need(bw.cpu_optimizer_params_per_s, plan.cpu_optimizer_numel, "the CPU optimizer"));
  if (!(bw.gpu_flops > 0)) return Status(StatusCode::kInvalidArgument, "step time: gpu_flops must be positive");

  auto secs = [](uint64_t bytes, double rate) { return bytes ? static_cast<double>(bytes) / rate : 0.0; };
  StepTimeEstimate e;
  const double m = plan.options.micro_batches;
  e.compute_s = flops_per_token(plan, work) * static_cast<double>(work.tokens_per_micro_batch) * m / bw.gpu_flops;
  e.h2d_s = secs(fb.h2d, bw.h2d);
  e.d2h_s = secs(fb.d2h, bw.d2h);
  e.nvme_fb_s = secs(fb.nvme_read, bw.nvme_read) + secs(fb.nvme_write, bw.nvme_write);
  e.comm_s = fb.comm > 0 ? secs(fb.comm, bw.link) : 0;
  // On shared cores the copies are the compute cores' work: they add.
  const double device_s = work.shared_cores ? e.compute_s + e.h2d_s + e.d2h_s : std::max({e.compute_s, e.h2d_s, e.d2h_s});
  e.forward_backward_s = std::max({device_s, e.nvme_fb_s, e.comm_s});

  e.nvme_step_s = secs(st.nvme_read, bw.nvme_read) + secs(st.nvme_write, bw.nvme_write);
  e.cpu_optimizer_s =
      plan.cpu_optimizer_numel ? static_cast<double>(plan.cpu_optimizer_numel) / bw.cpu_optimizer_params_per_s : 0.0;
  e.step_h2d_s = secs(st.h2d, bw.h2d);
  if (st.nvme_read + st.nvme_write > 0)
    e.pipeline_fill_s =
        secs(plan.optimizer_chunk_bytes, bw.nvme_read) + secs(plan.optimizer_chunk_bytes, bw.nvme_write);
  e.step_comm_s = secs(st.comm, bw.link);
  const double update_s =
      work.shared_cores ? e.cpu_optimizer_s + e.step_h2d_s : std::max(e.cpu_optimizer_s, e.step_h2d_s);
  e.optimizer_step_s = std::max(e.nvme_step_s, update_s) + e.pipeline_fill_s + e.step_comm_s;
  // What of the step can run while the device computes: all of it on a GPU;
  // none on shared cores, where the step's thread (reads, checksums, the
  // update, writes) takes the cores that compute (measured on the demo, 2
  // cores: the pipelined step hid 2.4 ms of its 9.3 ms; BENCHMARKS.md).
  const double hideable_s = work.shared_cores ? 0.0 : e.optimizer_step_s;
  // The step's NVMe traffic shares the drives with the forward's and
  // backward's: while those keep the drives busy, a step that waits for the
  // drives hides only in their idle share of the window.
  const double drives_busy =
      e.forward_backward_s > 0 ? std::min(1.0, e.nvme_fb_s / e.forward_backward_s) : 0.0;
  const double window_share = e.nvme_step_s >= update_s && e.nvme_step_s > 0 ? 1.0 - drives_busy : 1.0;

  if (work.overlap_backward) {
    // Backward is 4 of 6 (or 6 of 8 with recompute) FLOP units of a
    // micro-batch; only the last micro-batch's backward can hide the step.
    const double bwd_share = work.activation_checkpointing ? 6.0 / 8.0 : 4.0 / 6.0;
    const double window = e.forward_backward_s / m * bwd_share * window_share;
    e.overlap_saved_s = std::min(window, hideable_s);
  } else if (work.pipelined_step && plan.world_size == 1) {
    // Every group's update is queued in order; the next forward's first
    // group waits for its own, so all but the first group's share of the
    // step (by trainable elements) can hide under the next forward: 2 of 6
    // (or of 8 with recompute) FLOP units of a micro-batch.
    uint64_t all = 0, first = 0;
    for (const GroupPlan& g : plan.groups) {
      if (all == 0) first = g.trainable_shard_numel;
      all += g.trainable_shard_numel;
    }
    const double share = all ? static_cast<double>(all - first) / static_cast<double>(all) : 0.0;
    const double fwd_share = work.activation_checkpointing ? 2.0 / 8.0 : 2.0 / 6.0;
    e.pipelined_saved_s = std::min(e.forward_backward_s / m * fwd_share * window_share, hideable_s * share);
  }
  e.total_s = e.forward_backward_s + e.optimizer_step_s - e.overlap_saved_s - e.pipelined_saved_s;

  e.shared_cores = work.shared_cores;
  std::pair<double, const char*> parts[] = {{e.compute_s, work.shared_cores ? "CPU compute" : "GPU compute"},
                                            {e.h2d_s, "host->device (forward/backward)"},
                                            {e.d2h_s, "device->host (gradients)"},
                                            {e.nvme_fb_s, "NVMe (forward/backward)"},
                                            {e.comm_s, "the link between ranks"},
                                            {e.nvme_step_s, "NVMe (optimizer step)"},
                                            {e.cpu_optimizer_s, "CPU optimizer"},
                                            {e.step_h2d_s, "host->device (updated copies)"},
                                            {e.step_comm_s, "the link between ranks (updated shards)"}};
  // The bottleneck is the slowest part of the longer phase.
  const bool fb_longer = e.forward_backward_s >= e.optimizer_step_s;
  double best = -1;
  for (size_t i = 0; i < std::size(parts); ++i) {
    const bool in_fb = i < 5;
    if (in_fb != fb_longer) continue;
    if (parts[i].first > best) {
      best = parts[i].first;
      e.bottleneck = parts[i].second;
    }
  }
  return e;
}

std::string StepTimeEstimate::report() const {
  auto t = [](double s) { return format_seconds(s); };
  std::string r;
  r += fmt::format("Predicted step: {} (bottleneck: {})\n", t(total_s), bottleneck);
  const std::string ranks = comm_s > 0 ? fmt::format(", other ranks {}", t(comm_s)) : std::string();
  const std::string gather =
      step_comm_s > 0 ? fmt::format(" + all-gather to the other ranks {}", t(step_comm_s)) : std::string();
  const char* add = shared_cores ? " + " : ", ";  // shared cores: the parts add instead of overlapping
  r += fmt::format("  forward+backward {} = max({} compute {}{}host->device {}{}device->host {}, NVMe {}{})\n",
                   t(forward_backward_s), shared_cores ? "CPU" : "GPU", t(compute_s), add, t(h2d_s), add, t(d2h_s),
                   t(nvme_fb_s), ranks);
  r += fmt::format("  optimizer step   {} = max(NVMe {}, CPU optimizer {}{}host->device {}) + pipeline fill {}{}\n",
                   t(optimizer_step_s), t(nvme_step_s), t(cpu_optimizer_s), add, t(step_h2d_s), t(pipeline_fill_s),
                   gather);
  if (shared_cores)
    r += "  (the device is this CPU: copies and the optimizer step take the cores that compute, so they add)\n";
  if (overlap_saved_s > 0) r += fmt::format("  hidden under backward: {}\n", t(overlap_saved_s));
  if (pipelined_saved_s > 0) r += fmt::format("  hidden under the next forward (pipelined step): {}\n", t(pipelined_saved_s));
  return r;
}

}  // namespace strata
