// Per-element arithmetic shared by the host backend's loops and the CUDA
// kernels (cuda/kernels.cu includes this header), so both backends run the
// same operations in the same order and give the same bits.
//
// Bit-compatibility rests on three things: (1) the conversions below are
// integer bit manipulation, not hardware converts (whose NaN encodings differ
// between x86, PTX and PyTorch); (2) every fused multiply-add is an explicit
// fmaf(), and the CUDA module is compiled with --fmad=false and the host loops
// with -ffp-contract=off, so no compiler fuses anything else; (3) sqrtf and
// '/' are IEEE round-to-nearest on both (nvcc's default -prec-sqrt/-prec-div;
// never build the module with --use_fast_math).
//
// Conventions match cpu_optim/numeric.h (and PyTorch's c10::BFloat16):
//   fp32 -> bf16: round to nearest even on the bit pattern, denormals kept,
//                 overflow to inf, every NaN becomes the quiet NaN 0x7FC0.
//   fp32 -> fp16: round to nearest even, gradual underflow, overflow to inf,
//                 NaN quieted keeping sign and top payload bits.
//   bf16/fp16 -> fp32 is exact.
// The AdamW element is the cpu_optim AdamW formula term for term, so GPU-held
// and host-held optimizer state produce the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/float_convert.h"

namespace strata::device_math {

// The conversions are shared with cpu_optim (common/float_convert.h).
STRATA_HD uint16_t f32_to_bf16(float f) { return f32_to_bf16_bits(f); }
STRATA_HD float bf16_to_f32(uint16_t h) { return bf16_bits_to_f32(h); }
STRATA_HD uint16_t f32_to_f16(float f) { return f32_to_f16_bits(f); }
STRATA_HD float f16_to_f32(uint16_t h) { return f16_bits_to_f32(h); }

// Element types by the same codes as DType / STRATA_CUDA_DTYPE_*.
enum : int { kF32 = 0, kBf16 = 1, kF16 = 2 };

STRATA_HD float load_as_f32(const void* base, int dtype, size_t i) {
  if (dtype == kF32) return static_cast<const float*>(base)[i];
  uint16_t h = static_cast<const uint16_t*>(base)[i];
  return dtype == kBf16 ? bf16_to_f32(h) : f16_to_f32(h);
}
STRATA_HD void store_from_f32(void* base, int dtype, size_t i, float v) {
  if (dtype == kF32) {
    static_cast<float*>(base)[i] = v;
  } else {
    static_cast<uint16_t*>(base)[i] = dtype == kBf16 ? f32_to_bf16(v) : f32_to_f16(v);
  }
}

// x * scale, except that scale 1 leaves x untouched: a multiply quiets (x86)
// or canonicalizes (CUDA: 0x7fffffff) NaN payloads, and a plain widening
// cast should keep every bit. NaN stays NaN either way.
STRATA_HD float apply_scale(float x, float scale) {
  return scale == 1.0f ? x : x * scale;
}

// Constants of one AdamW step, computed once in double on the host and
// rounded to fp32 (the same as cpu_optim's StepArgs).
struct AdamWConsts {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float eps;
  float neg_lr_wd;      // -(lr * weight_decay); 0 disables decoupled decay
  float neg_step_size;  // -lr / (1 - beta1^t)
  float inv_sqrt_bc2;   // 1 / sqrt(1 - beta2^t)
  float grad_scale;     // multiplies each gradient first (loss unscale, clipping)
};

inline AdamWConsts adamw_consts(double lr, double beta1, double beta2, double eps, double weight_decay, long step,
                                double grad_scale) {
  const double t = static_cast<double>(step);
  const double bc1 = 1.0 - std::pow(beta1, t);
  const double bc2 = 1.0 - std::pow(beta2, t);
  AdamWConsts c;
  c.beta1 = static_cast<float>(beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  c.neg_lr_wd = static_cast<float>(-(lr * weight_decay));
  c.neg_step_size = static_cast<float>(-lr / bc1);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.grad_scale = static_cast<float>(grad_scale);
  return c;
}

// torch.optim.AdamW (single tensor):
//   p -= lr*wd*p;  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g;
//   p += -(lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)
// with the fused multiply-adds where cpu_optim has them.
STRATA_HD void adamw_element(const AdamWConsts& c, float g_in, float& p, float& m, float& v) {
  const float g = g_in * c.grad_scale;
  if (c.neg_lr_wd != 0.0f) p = fmaf(c.neg_lr_wd, p, p);
  m = fmaf(c.beta1, m, c.one_minus_beta1 * g);
  v = fmaf(c.one_minus_beta2 * g, g, c.beta2 * v);
  const float denom = fmaf(sqrtf(v), c.inv_sqrt_bc2, c.eps);
  p = fmaf(c.neg_step_size, m / denom, p);
}

}  // namespace strata::device_math
