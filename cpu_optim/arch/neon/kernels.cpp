// ARM NEON (AArch64 Advanced SIMD) kernels. NEON is part of every AArch64
// CPU, so no run-time check is needed there. On x86 build hosts this file is
// only compile-checked (cpu_optim/CMakeLists.txt), which is why it includes
// nothing beyond freestanding headers.
#include <arm_neon.h>

#include "cpu_optim/arch/kernel_table.h"
#include "cpu_optim/numeric.h"
#include "cpu_optim/stochastic_round.h"

namespace strata::cpu_optim::detail::neon {

struct V {
  using F = float32x4_t;
  static constexpr size_t W = 4;
  static F set1(float x) { return vdupq_n_f32(x); }
  static F load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, F x) { vst1q_f32(p, x); }
  static F load(const Bf16* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
  }
  static uint32x4_t round_bf16(F x) {
    uint32x4_t u = vreinterpretq_u32_f32(x);
    uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), lsb), 16);
    uint32x4_t ordered = vceqq_f32(x, x);  // false only for NaN
    return vbslq_u32(ordered, r, vdupq_n_u32(0x7fc0));
  }
  static void store(Bf16* p, F x) { vst1_u16(reinterpret_cast<uint16_t*>(p), vmovn_u32(round_bf16(x))); }
  static F store_rounded(Bf16* p, F x) {
    uint32x4_t r = round_bf16(x);
    vst1_u16(reinterpret_cast<uint16_t*>(p), vmovn_u32(r));
    return vreinterpretq_f32_u32(vshlq_n_u32(r, 16));
  }
  // Stochastic rounding (stochastic_round.h): mix32 on 4 lanes, lane j
  // hashing index lo + j; then (bits + r) >> 16, NaN -> 0x7FC0.
  static uint32x4_t mix32(uint32x4_t x) {
    x = veorq_u32(x, vshrq_n_u32(x, 16));
    x = vmulq_u32(x, vdupq_n_u32(kMix32A));
    x = veorq_u32(x, vshrq_n_u32(x, 15));
    x = vmulq_u32(x, vdupq_n_u32(kMix32B));
    return veorq_u32(x, vshrq_n_u32(x, 16));
  }
  static F store_rounded_sr(Bf16* p, F x, uint32_t lo, uint32_t key) {
    static const uint32_t kIota[4] = {0, 1, 2, 3};
    const uint32x4_t idx = vaddq_u32(vdupq_n_u32(lo), vld1q_u32(kIota));
    const uint32x4_t rnd = vshrq_n_u32(mix32(veorq_u32(idx, vdupq_n_u32(key))), 16);
    uint32x4_t r = vshrq_n_u32(vaddq_u32(vreinterpretq_u32_f32(x), rnd), 16);
    r = vbslq_u32(vceqq_f32(x, x), r, vdupq_n_u32(0x7fc0));
    vst1_u16(reinterpret_cast<uint16_t*>(p), vmovn_u32(r));
    return vreinterpretq_f32_u32(vshlq_n_u32(r, 16));
  }
  static F load(const F16* p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
  }
  static void store(F16* p, F x) {
    vst1_u16(reinterpret_cast<uint16_t*>(p), vreinterpret_u16_f16(vcvt_f16_f32(x)));
  }
  // No non-temporal stores here: plain ones.
  static void stream(Bf16* p, F x) { store(p, x); }
  static void stream(F16* p, F x) { store(p, x); }
  static void fence() {}
  static F add(F a, F b) { return vaddq_f32(a, b); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F div(F a, F b) { return vdivq_f32(a, b); }
  static F sqrt(F a) { return vsqrtq_f32(a); }
  static F fma(F a, F b, F c) { return vfmaq_f32(c, a, b); }
  // vmaxq_f32 returns NaN if either input is NaN; select instead so that NaN
  // handling matches the x86 kernels (b when unordered).
  static F max(F a, F b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
  static F sign(F x) {
    const F zero = vdupq_n_f32(0.0f);
    F r = vbslq_f32(vcgtq_f32(x, zero), vdupq_n_f32(1.0f), zero);
    return vbslq_f32(vcltq_f32(x, zero), vdupq_n_f32(-1.0f), r);
  }
  template <class T>
  static void sumsq16(const T* g, size_t n, double* lanes) {
    float64x2_t acc[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) acc[k] = vld1q_f64(lanes + 2 * k);
    for (size_t i = 0; i < n; i += 16) {
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        F x = load(g + i + 4 * q);
        float64x2_t lo = vcvt_f64_f32(vget_low_f32(x));
        float64x2_t hi = vcvt_high_f64_f32(x);
        acc[2 * q] = vfmaq_f64(acc[2 * q], lo, lo);
        acc[2 * q + 1] = vfmaq_f64(acc[2 * q + 1], hi, hi);
      }
    }
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) vst1q_f64(lanes + 2 * k, acc[k]);
  }
};

}  // namespace strata::cpu_optim::detail::neon

#define STRATA_CPU_OPTIM_NS neon
#include "cpu_optim/arch/kernels_impl.h"

namespace strata::cpu_optim::detail {
const KernelTable kNeonKernels = neon::make_table("neon");
}
