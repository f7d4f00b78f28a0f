#include "cpu_optim/reference.h"

#include <cmath>

#include "cpu_optim/numeric.h"
#include "cpu_optim/stochastic_round.h"

namespace strata::cpu_optim {
namespace {

double load(const void* base, DType d, std::size_t i) {
  switch (d) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kBF16: return bf16_bits_to_f32(static_cast<const uint16_t*>(base)[i]);
    case DType::kF16: return f16_bits_to_f32(static_cast<const uint16_t*>(base)[i]);
    // Storage-only kinds: step() refuses them before any element is loaded.
    case DType::kU8: case DType::kF64: case DType::kI32: case DType::kI64: break;
  }
  return 0.0;
}

// `r`: 16 random bits for stochastic rounding to bf16, or -1 for round to nearest even.
void store(void* base, DType d, std::size_t i, double x, std::int64_t r = -1) {
  float f = static_cast<float>(x);
  switch (d) {
    case DType::kF32: static_cast<float*>(base)[i] = f; break;
    case DType::kBF16:
      static_cast<uint16_t*>(base)[i] = r < 0 ? f32_to_bf16_bits(f) : f32_to_bf16_bits_sr(f, static_cast<uint32_t>(r));
      break;
    case DType::kF16: static_cast<uint16_t*>(base)[i] = f32_to_f16_bits(f); break;
    case DType::kU8: case DType::kF64: case DType::kI32: case DType::kI64: break;  // refused by step()
  }
}

}  // namespace

void reference_step_element(const OptimizerConfig& c, std::int64_t step, double grad, RefElement& e,
                            RefDetail* detail) {
  const double t = static_cast<double>(step);
  double g = grad * (c.maximize ? -c.grad_scale : c.grad_scale);
  double& p = e.p;
  RefDetail d;
  switch (c.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam: {
      if (c.kind == OptimizerKind::kAdamW) p *= 1.0 - c.lr * c.weight_decay;
      else if (c.weight_decay != 0.0) g += c.weight_decay * p;
      double& m = e.s[0];
      double& v = e.s[1];
      m = c.beta1 * m + (1.0 - c.beta1) * g;
      v = c.beta2 * v + (1.0 - c.beta2) * g * g;
      double vv = v;
      if (c.amsgrad) {
        e.s[2] = std::fmax(e.s[2], v);
        vv = e.s[2];
      }
      const double bc1 = 1.0 - std::pow(c.beta1, t);
      const double bc2 = 1.0 - std::pow(c.beta2, t);
      const double denom = std::sqrt(vv) / std::sqrt(bc2) + c.eps;
      d.update = (c.lr / bc1) * m / denom;
      p -= d.update;
      break;
    }
    case OptimizerKind::kAdagrad: {
      if (c.weight_decay != 0.0) g += c.weight_decay * p;
      const double clr = c.lr / (1.0 + (t - 1.0) * c.lr_decay);
      e.s[0] += g * g;
      d.update = clr * g / (std::sqrt(e.s[0]) + c.eps);
      p -= d.update;
      break;
    }
    case OptimizerKind::kLion: {
      p *= 1.0 - c.lr * c.weight_decay;
      double& m = e.s[0];
      d.lion_c = c.beta1 * m + (1.0 - c.beta1) * g;
      const double sign = d.lion_c > 0 ? 1.0 : (d.lion_c < 0 ? -1.0 : 0.0);
      d.update = c.lr * sign;
      p -= d.update;
      m = c.beta2 * m + (1.0 - c.beta2) * g;
      break;
    }
    case OptimizerKind::kSgd: {
      if (c.weight_decay != 0.0) g += c.weight_decay * p;
      double dp = g;
      if (c.momentum != 0.0) {
        double& buf = e.s[0];
        buf = step == 1 ? g : c.momentum * buf + (1.0 - c.dampening) * g;
        dp = c.nesterov ? g + c.momentum * buf : buf;
      }
      d.update = c.lr * dp;
      p -= d.update;
      break;
    }
  }
  d.g = g;
  if (detail) *detail = d;
}

Status reference_step(const OptimizerConfig& c, std::int64_t step, const StepBuffers& b, std::size_t count) {
  // Reuse step()'s validation by a zero-length call (it touches nothing).
  STRATA_RETURN_IF_ERROR(cpu_optim::step(c, step, b, 0, ExecOptions{Isa::kScalar, 1}));
  if (count && (!b.params || !b.grads)) return Status(StatusCode::kInvalidArgument, "reference_step: null buffer");
  const int ns = state_count(c);
  for (int i = 0; i < ns; ++i)
    if (count && !b.state[i]) return Status(StatusCode::kInvalidArgument, "reference_step: missing state");
  for (std::size_t i = 0; i < count; ++i) {
    RefElement e;
    e.p = b.params[i];
    for (int k = 0; k < ns; ++k) e.s[k] = load(b.state[k], b.state_dtype, i);
    reference_step_element(c, step, load(b.grads, b.grad_dtype, i), e);
    b.params[i] = static_cast<float>(e.p);
    // Stochastic rounding, element by element from its global index (the
    // kernels vectorise the same hash: stochastic_round.h).
    const bool sr = b.state_dtype == DType::kBF16 && b.state_rounding == StateRounding::kStochastic;
    const std::uint64_t gi = b.index_base + i;
    for (int k = 0; k < ns; ++k) {
      const std::int64_t r =
          sr ? rounding_bits(rounding_key(b.rounding_seed, b.rounding_stream, step, static_cast<uint32_t>(gi >> 32), k),
                             static_cast<uint32_t>(gi))
             : -1;
      store(b.state[k], b.state_dtype, i, e.s[k], r);
    }
    if (b.params_out) store(b.params_out, b.out_dtype, i, b.params[i]);
  }
  return Status::ok_status();
}

GradStats reference_grad_stats(const void* grads, DType dtype, std::size_t count, double scale) {
  long double sum = 0.0L;
  bool bad = false;
  for (std::size_t i = 0; i < count; ++i) {
    double g = load(grads, dtype, i);
    if (!std::isfinite(g)) bad = true;
    sum += static_cast<long double>(g) * g;
  }
  GradStats s;
  s.sum_sq = static_cast<double>(sum * scale * scale);
  s.has_inf_nan = bad;
  return s;
}

}  // namespace strata::cpu_optim
