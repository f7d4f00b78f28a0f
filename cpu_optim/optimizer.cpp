#include "cpu_optim/optimizer.h"

#include <sched.h>

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include "common/enum_names.h"
#include "common/tunables.h"
#include "cpu_optim/arch/kernel_table.h"
#include "cpu_optim/dispatch.h"
#include "cpu_optim/stochastic_round.h"

namespace strata {
template <>
inline constexpr auto kEnumNames<cpu_optim::OptimizerKind> = std::to_array<EnumName<cpu_optim::OptimizerKind>>({
    {cpu_optim::OptimizerKind::kAdamW, "adamw"},
    {cpu_optim::OptimizerKind::kAdam, "adam"},
    {cpu_optim::OptimizerKind::kAdagrad, "adagrad"},
    {cpu_optim::OptimizerKind::kLion, "lion"},
    {cpu_optim::OptimizerKind::kSgd, "sgd"},
});
}  // namespace strata

namespace strata::cpu_optim {
namespace detail {

int resolve_threads(int requested) {
  if (requested > 0) return requested;
  if (tunables().threads > 0) return tunables().threads;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  return 1;
}

namespace {
// Creating a task_arena per call would cost more than a small chunk's update;
// keep one per thread count for the life of the process.
tbb::task_arena& arena_for(int threads) {
  static std::mutex mu;
  static std::map<int, std::unique_ptr<tbb::task_arena>> arenas;
  std::lock_guard<std::mutex> lock(mu);
  auto& a = arenas[threads];
  if (!a) {
    a = std::make_unique<tbb::task_arena>(threads);
    a->initialize();
  }
  return *a;
}
}  // namespace

void parallel_blocks(std::size_t nblocks, int threads, void (*fn)(void*, std::size_t, std::size_t), void* ctx) {
  if (nblocks == 0) return;
  if (threads <= 1 || nblocks == 1) {
    fn(ctx, 0, nblocks);
    return;
  }
  // static_partitioner: contiguous, near-equal runs of blocks per thread, so
  // each thread streams one region (hardware prefetchers like that) and the
  // split is the same on every call. Results never depend on it: the update
  // is element-wise and norms are reduced per fixed block.
  //
  // The workers run with the caller's floating-point settings (MXCSR: flush
  // to zero, denormals as zero), captured on each call: the cached arena's
  // threads would otherwise keep the mode of whoever ran them first, and a
  // caller that flushes denormals (torch.set_flush_denormal) got other bits
  // from 2 threads than from 1.
  tbb::task_group_context fp(tbb::task_group_context::isolated,
                             tbb::task_group_context::default_traits | tbb::task_group_context::fp_settings);
  fp.capture_fp_settings();
  arena_for(threads).execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<std::size_t>(0, nblocks, 1),
        [&](const tbb::blocked_range<std::size_t>& r) { fn(ctx, r.begin(), r.end()); },
        tbb::static_partitioner(), fp);
  });
}

}  // namespace detail

namespace {

template <class Fn>
void run_blocks(std::size_t nblocks, int threads, Fn& fn) {
  detail::parallel_blocks(
      nblocks, threads, [](void* c, std::size_t b0, std::size_t b1) { (*static_cast<Fn*>(c))(b0, b1); }, &fn);
}

Status invalid(const std::string& what) { return Status(StatusCode::kInvalidArgument, "cpu_optim: " + what); }

bool valid_dtype(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

// A value the kernels use in fp32 must fit one (lr 1e39 became inf and every
// parameter NaN; torch refuses such a value converting it to float).
constexpr double kF32Max = std::numeric_limits<float>::max();

std::string num(double x) {
  char b[32];
  std::snprintf(b, sizeof(b), "%g", x);
  return b;
}

Status check_config(const OptimizerConfig& c, std::int64_t step) {
  auto nonneg = [](double x) { return x >= 0.0 && x <= kF32Max; };
  auto beta_ok = [](double b) { return b >= 0.0 && b < 1.0; };
  if (step < 1) return invalid("step number " + std::to_string(step) + " must be >= 1 (1 on the first step)");
  if (!nonneg(c.lr)) return invalid("invalid learning rate " + num(c.lr) + " (expected 0 to 3.4e38, fp32's largest)");
  if (!nonneg(c.weight_decay)) return invalid("invalid weight_decay " + num(c.weight_decay));
  if (!(std::fabs(c.grad_scale) <= kF32Max)) return invalid("grad_scale " + num(c.grad_scale) + " must be finite in fp32");
  switch (c.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam:
      if (!nonneg(c.eps)) return invalid("invalid eps " + num(c.eps));
      [[fallthrough]];
    case OptimizerKind::kLion:
      if (!beta_ok(c.beta1)) return invalid("invalid beta1 " + num(c.beta1) + " (expected [0, 1))");
      if (!beta_ok(c.beta2)) return invalid("invalid beta2 " + num(c.beta2) + " (expected [0, 1))");
      break;
    case OptimizerKind::kAdagrad:
      if (!nonneg(c.eps)) return invalid("invalid eps " + num(c.eps));
      if (!nonneg(c.lr_decay)) return invalid("invalid lr_decay " + num(c.lr_decay));
      break;
    case OptimizerKind::kSgd:
      if (!nonneg(c.momentum)) return invalid("invalid momentum " + num(c.momentum));
      if (!(std::fabs(c.dampening) <= kF32Max)) return invalid("invalid dampening " + num(c.dampening));
      if (c.nesterov && (c.momentum <= 0.0 || c.dampening != 0.0))
        return invalid("nesterov momentum requires a momentum and zero dampening");
      break;
    default:
      return invalid("unknown optimizer kind " + std::to_string(static_cast<int>(c.kind)));
  }
  return Status::ok_status();
}

Result<const detail::KernelTable*> table_for(Isa requested) {
  STRATA_ASSIGN_OR_RETURN(Isa isa, resolve_isa(requested));
  const detail::KernelTable* t = detail::kernels_for(isa);
  if (!t) return Status(StatusCode::kInternal, std::string("no kernels for supported ISA ") + isa_name(isa));
  return t;
}

}  // namespace

int state_count(const OptimizerConfig& c) {
  switch (c.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam: return c.amsgrad ? 3 : 2;
    case OptimizerKind::kAdagrad:
    case OptimizerKind::kLion: return 1;
    case OptimizerKind::kSgd: return c.momentum != 0.0 ? 1 : 0;
  }
  return 0;
}

std::size_t bytes_per_param(const OptimizerConfig& c, const StepBuffers& b) {
  std::size_t n = 2 * sizeof(float) + dtype_size(b.grad_dtype);
  n += static_cast<std::size_t>(state_count(c)) * 2 * dtype_size(b.state_dtype);
  if (b.params_out) n += dtype_size(b.out_dtype);
  return n;
}

Status step(const OptimizerConfig& c, std::int64_t t, const StepBuffers& b, std::size_t count,
            const ExecOptions& exec) {
  STRATA_RETURN_IF_ERROR(check_config(c, t));
  if (!valid_dtype(b.grad_dtype)) return invalid("invalid gradient dtype");
  if (b.state_dtype != DType::kF32 && b.state_dtype != DType::kBF16)
    return invalid(std::string("state dtype ") + dtype_name(b.state_dtype) + " is not supported (fp32 or bf16)");
  if (b.params_out && b.out_dtype != DType::kBF16 && b.out_dtype != DType::kF16)
    return invalid(std::string("params_out dtype ") + dtype_name(b.out_dtype) + " is not supported (bf16 or fp16)");
  if (b.state_rounding != StateRounding::kStochastic && b.state_rounding != StateRounding::kNearest)
    return invalid("unknown state rounding " + std::to_string(static_cast<int>(b.state_rounding)));
  if (b.index_base > (~std::uint64_t{0} >> 1) - count)
    return invalid("index_base " + std::to_string(b.index_base) + " + count " + std::to_string(count) +
                   " is out of range (< 2^63)");
  const int nstates = state_count(c);
  if (count > 0) {
    if (!b.params) return invalid("params is null");
    if (!b.grads) return invalid("grads is null");
    for (int i = 0; i < nstates; ++i)
      if (!b.state[i])
        return invalid(std::string(optimizer_name(c.kind)) + (c.amsgrad ? " (amsgrad)" : "") + " needs " +
                       std::to_string(nstates) + " state buffers; state[" + std::to_string(i) + "] is null");
  }
  STRATA_ASSIGN_OR_RETURN(const detail::KernelTable* table, table_for(exec.isa));
  if (count == 0) return Status::ok_status();
  {
    // Every buffer is read or written element by element in one pass: two
    // that share bytes would read what the pass already wrote (params_out
    // over params wrote bf16 into the fp32 masters, and returned OK).
    struct Range {
      const char* name;
      std::uintptr_t lo, hi;
    };
    Range ranges[6];
    std::size_t n = 0;
    auto add = [&](const char* name, const void* p, std::size_t elem) {
      const auto lo = reinterpret_cast<std::uintptr_t>(p);
      if (p) ranges[n++] = {name, lo, lo + elem * count};
    };
    static const char* const kStateNames[3] = {"state[0]", "state[1]", "state[2]"};
    add("params", b.params, 4);
    add("grads", b.grads, dtype_size(b.grad_dtype));
    for (int i = 0; i < nstates; ++i) add(kStateNames[i], b.state[i], dtype_size(b.state_dtype));
    add("params_out", b.params_out, dtype_size(b.out_dtype));
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = i + 1; j < n; ++j)
        if (ranges[i].lo < ranges[j].hi && ranges[j].lo < ranges[i].hi)
          return invalid(std::string(ranges[i].name) + " and " + ranges[j].name +
                         " overlap: each buffer must be its own memory");
  }

  // Constants in double, rounded once to fp32 (DeepSpeed's fp32 1 - beta2
  // carries a 1.3e-5 relative error into v). Decoupled weight decay uses
  // -lr*wd, not 1 - lr*wd (see StepArgs::neg_lr_wd).
  detail::StepArgs a{};
  a.kind = c.kind;
  a.grad_dtype = b.grad_dtype;
  a.state_dtype = b.state_dtype;
  a.out_dtype = b.out_dtype;
  a.params = b.params;
  a.grads = b.grads;
  for (int i = 0; i < 3; ++i) a.state[i] = i < nstates ? b.state[i] : nullptr;
  a.out = b.params_out;
  // Non-temporal stores for the write-only output when it is aligned: they
  // skip the read-for-ownership of its lines; measured here (2 threads,
  // 128M params, interleaved A/B): +2..10% params/s with --out-bf16.
  a.stream_out = b.params_out && (reinterpret_cast<std::uintptr_t>(b.params_out) % 64) == 0;
  const double lr = c.lr, wd = c.weight_decay;
  a.grad_scale = static_cast<float>(c.maximize ? -c.grad_scale : c.grad_scale);
  a.weight_decay = static_cast<float>(wd);
  a.neg_lr_wd = static_cast<float>(-(lr * wd));
  a.beta1 = static_cast<float>(c.beta1);
  a.one_minus_beta1 = static_cast<float>(1.0 - c.beta1);
  a.beta2 = static_cast<float>(c.beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
  a.eps = static_cast<float>(c.eps);
  a.momentum = static_cast<float>(c.momentum);
  a.one_minus_dampening = static_cast<float>(1.0 - c.dampening);
  a.l2 = wd != 0.0 && c.kind != OptimizerKind::kAdamW && c.kind != OptimizerKind::kLion;
  a.decoupled_wd = wd != 0.0 && (c.kind == OptimizerKind::kAdamW || c.kind == OptimizerKind::kLion);
  a.sr_states = b.state_dtype == DType::kBF16 && b.state_rounding == StateRounding::kStochastic;
  a.amsgrad = c.amsgrad;
  a.has_momentum = c.momentum != 0.0;
  a.nesterov = c.nesterov;
  a.first_step = t == 1;
  const double td = static_cast<double>(t);
  switch (c.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam: {
      const double bc1 = 1.0 - std::pow(c.beta1, td);
      const double bc2 = 1.0 - std::pow(c.beta2, td);
      a.neg_step_size = static_cast<float>(-lr / bc1);
      a.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
      break;
    }
    case OptimizerKind::kAdagrad:
      a.neg_step_size = static_cast<float>(-lr / (1.0 + (td - 1.0) * c.lr_decay));
      break;
    case OptimizerKind::kLion:
    case OptimizerKind::kSgd:
      a.neg_step_size = static_cast<float>(-lr);
      break;
  }
  detail::StepFn fn = table->select_step(a);
  if (!fn) return Status(StatusCode::kInternal, "cpu_optim: no kernel for this dtype combination");

  // Stochastic rounding: the keys hold for one value of the global index's
  // high word, so a range that crosses a multiple of 2^32 is updated in
  // pieces, each with keys of its own (stochastic_round.h).
  const std::uint64_t base = b.index_base;
  auto set_keys = [&](detail::StepArgs& x, std::uint64_t global) {
    for (int k = 0; k < 3; ++k)
      x.sr_key[k] = rounding_key(b.rounding_seed, b.rounding_stream, t, static_cast<std::uint32_t>(global >> 32), k);
  };
  a.sr_lo0 = static_cast<std::uint32_t>(base);
  if (a.sr_states) set_keys(a, base);
  auto run = [&](std::size_t lo, std::size_t hi) {
    if (!a.sr_states) return fn(a, lo, hi);
    while (lo < hi) {
      const std::uint64_t g = base + lo;
      const std::uint64_t next = ((g >> 32) + 1) << 32;  // index_base + count < 2^64 - 2^32: checked above
      const std::size_t stop = static_cast<std::size_t>(std::min<std::uint64_t>(hi, next - base));
      if ((g >> 32) == (base >> 32)) {
        fn(a, lo, stop);
      } else {
        detail::StepArgs x = a;
        set_keys(x, g);
        fn(x, lo, stop);
      }
      lo = stop;
    }
  };
  const int threads = detail::resolve_threads(exec.threads);
  const std::size_t nblocks = (count + detail::kStepBlock - 1) / detail::kStepBlock;
  auto body = [&](std::size_t b0, std::size_t b1) { run(b0 * detail::kStepBlock, std::min(count, b1 * detail::kStepBlock)); };
  run_blocks(nblocks, threads, body);
  return Status::ok_status();
}

Result<GradStats> grad_stats(const void* grads, DType dtype, std::size_t count, double scale,
                             const ExecOptions& exec) {
  if (!valid_dtype(dtype)) return invalid("invalid gradient dtype");
  if (count > 0 && !grads) return invalid("grads is null");
  if (!std::isfinite(scale)) return invalid("grad_stats: scale " + std::to_string(scale) + " is not finite");
  STRATA_ASSIGN_OR_RETURN(const detail::KernelTable* table, table_for(exec.isa));
  GradStats out;
  if (count == 0) return out;
  const std::size_t nblocks = (count + kNormBlock - 1) / kNormBlock;
  std::vector<double> partial(nblocks);
  detail::SumSqFn fn = table->sumsq[static_cast<int>(dtype)];
  auto body = [&](std::size_t b0, std::size_t b1) {
    for (std::size_t blk = b0; blk < b1; ++blk)
      partial[blk] = fn(grads, blk * kNormBlock, std::min(count, (blk + 1) * kNormBlock));
  };
  run_blocks(nblocks, detail::resolve_threads(exec.threads), body);
  double total = 0.0;
  for (double p : partial) total += p;  // fixed order: bit-identical for any thread count
  // Squares of finite floats cannot overflow a double sum, so a non-finite
  // total means a non-finite gradient.
  out.has_inf_nan = !std::isfinite(total);
  out.sum_sq = total * (scale * scale);
  return out;
}

Status accumulate(float* dst, const void* src, DType src_dtype, std::size_t count, bool first, double* block_sq,
                  const ExecOptions& exec) {
  if (!valid_dtype(src_dtype)) return invalid("accumulate: invalid gradient dtype");
  if (count > 0 && (!dst || !src)) return invalid("accumulate: null buffer");
  STRATA_ASSIGN_OR_RETURN(const detail::KernelTable* table, table_for(exec.isa));
  detail::AccumFn fn = table->accumulate[static_cast<int>(src_dtype)];
  const std::size_t nblocks = (count + kNormBlock - 1) / kNormBlock;
  auto body = [&](std::size_t b0, std::size_t b1) {
    for (std::size_t blk = b0; blk < b1; ++blk) {
      const double sq = fn(dst, src, blk * kNormBlock, std::min(count, (blk + 1) * kNormBlock), first);
      if (block_sq) block_sq[blk] = sq;
    }
  };
  run_blocks(nblocks, detail::resolve_threads(exec.threads), body);
  return Status::ok_status();
}

Status convert(const float* src, void* dst, DType dst_dtype, std::size_t count, const ExecOptions& exec) {
  if (dst_dtype != DType::kBF16 && dst_dtype != DType::kF16)
    return invalid(std::string("convert: destination dtype ") + dtype_name(dst_dtype) + " (expected bf16 or fp16)");
  if (count > 0 && (!src || !dst)) return invalid("convert: null buffer");
  STRATA_ASSIGN_OR_RETURN(const detail::KernelTable* table, table_for(exec.isa));
  detail::ConvertFn fn = table->convert[static_cast<int>(dst_dtype)];
  const std::size_t nblocks = (count + detail::kStepBlock - 1) / detail::kStepBlock;
  auto body = [&](std::size_t b0, std::size_t b1) {
    fn(src, dst, b0 * detail::kStepBlock, std::min(count, b1 * detail::kStepBlock));
  };
  run_blocks(nblocks, detail::resolve_threads(exec.threads), body);
  return Status::ok_status();
}

const char* optimizer_name(OptimizerKind k) { return enum_name(k); }

Result<OptimizerKind> parse_optimizer(const char* name) {
  std::string n = name ? name : "";
  if (std::optional<OptimizerKind> k = find_enum<OptimizerKind>(n)) return *k;
  return invalid("unknown optimizer '" + n + "' (expected " + enum_name_list<OptimizerKind>("|") + ")");
}

}  // namespace strata::cpu_optim
