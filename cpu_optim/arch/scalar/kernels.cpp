// Portable scalar kernels: one element per "vector". Always compiled; the
// fallback on any CPU and the bit-exact baseline the SIMD tests compare to.
#include "cpu_optim/arch/kernel_table.h"
#include "cpu_optim/numeric.h"
#include "cpu_optim/stochastic_round.h"

namespace strata::cpu_optim::detail::scalar {

struct V {
  using F = float;
  static constexpr size_t W = 1;
  static F set1(float x) { return x; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static F load(const Bf16* p) { return bf16_bits_to_f32(p->bits); }
  static void store(Bf16* p, F x) { p->bits = f32_to_bf16_bits(x); }
  static F store_rounded(Bf16* p, F x) {
    p->bits = f32_to_bf16_bits(x);
    return bf16_bits_to_f32(p->bits);
  }
  static F store_rounded_sr(Bf16* p, F x, uint32_t lo, uint32_t key) {
    p->bits = f32_to_bf16_bits_sr(x, rounding_bits(key, lo));
    return bf16_bits_to_f32(p->bits);
  }
  static F load(const F16* p) { return f16_bits_to_f32(p->bits); }
  static void store(F16* p, F x) { p->bits = f32_to_f16_bits(x); }
  // No non-temporal stores here: plain ones.
  static void stream(Bf16* p, F x) { store(p, x); }
  static void stream(F16* p, F x) { store(p, x); }
  static void fence() {}
  static F add(F a, F b) { return a + b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return __builtin_sqrtf(a); }
  static F fma(F a, F b, F c) { return __builtin_fmaf(a, b, c); }
  static F max(F a, F b) { return a > b ? a : b; }  // maxps semantics: b when unordered
  static F sign(F x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }
  template <class T>
  static void sumsq16(const T* g, size_t n, double* lanes) {
    for (size_t i = 0; i < n; ++i) {
      double x = static_cast<double>(to_f32(g[i]));
      lanes[i % 16] += x * x;
    }
  }
};

}  // namespace strata::cpu_optim::detail::scalar

#define STRATA_CPU_OPTIM_NS scalar
#include "cpu_optim/arch/kernels_impl.h"

namespace strata::cpu_optim::detail {
const KernelTable kScalarKernels = scalar::make_table("scalar");
}
