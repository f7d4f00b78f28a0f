// AVX2 + FMA + F16C kernels (compiled with -mavx2 -mfma -mf16c; called only
// after dispatch.cpp has checked CPUID and the OS's ymm state support).
#include <immintrin.h>

#include "cpu_optim/arch/kernel_table.h"
#include "cpu_optim/numeric.h"
#include "cpu_optim/stochastic_round.h"

namespace strata::cpu_optim::detail::avx2 {

struct V {
  using F = __m256;
  static constexpr size_t W = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F load(const Bf16* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // Round to nearest even on the bit pattern; NaN -> 0x7FC0 (numeric.h).
  // Returns the bf16 values in the low halves of 32-bit lanes.
  static __m256i round_bf16(F x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  }
  static void store_lanes(Bf16* p, __m256i r) {
    // packus works per 128-bit lane; values are <= 0xffff so nothing saturates.
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static void store(Bf16* p, F x) { store_lanes(p, round_bf16(x)); }
  // store(p, x), returning the value as stored (without reloading it).
  static F store_rounded(Bf16* p, F x) {
    __m256i r = round_bf16(x);
    store_lanes(p, r);
    return _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
  }
  // Stochastic rounding (stochastic_round.h): mix32 on 8 lanes, lane j
  // hashing index lo + j; then (bits + r) >> 16, NaN -> 0x7FC0.
  static __m256i mix32(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kMix32A)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kMix32B)));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  }
  static F store_rounded_sr(Bf16* p, F x, uint32_t lo, uint32_t key) {
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(lo)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i rnd = _mm256_srli_epi32(mix32(_mm256_xor_si256(idx, _mm256_set1_epi32(static_cast<int>(key)))), 16);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), rnd), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    store_lanes(p, r);
    return _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
  }
  static void stream(Bf16* p, F x) {
    __m256i r = round_bf16(x);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static void stream(F16* p, F x) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void fence() { _mm_sfence(); }
  static F load(const F16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(F16* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F sign(F x) {
    const F zero = _mm256_setzero_ps();
    F pos = _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_GT_OQ), _mm256_set1_ps(1.0f));
    F neg = _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_LT_OQ), _mm256_set1_ps(-1.0f));
    return _mm256_or_ps(pos, neg);
  }
  template <class T>
  static void sumsq16(const T* g, size_t n, double* lanes) {
    // Four named accumulators (not an array: gcc keeps arrays of vectors on
    // the stack here, which made this loop 4x slower).
    __m256d a0 = _mm256_loadu_pd(lanes), a1 = _mm256_loadu_pd(lanes + 4), a2 = _mm256_loadu_pd(lanes + 8),
            a3 = _mm256_loadu_pd(lanes + 12);
    for (size_t i = 0; i < n; i += 16) {
      F x0 = load(g + i), x1 = load(g + i + 8);
      __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(x0)), d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(x0, 1));
      __m256d d2 = _mm256_cvtps_pd(_mm256_castps256_ps128(x1)), d3 = _mm256_cvtps_pd(_mm256_extractf128_ps(x1, 1));
      a0 = _mm256_fmadd_pd(d0, d0, a0);
      a1 = _mm256_fmadd_pd(d1, d1, a1);
      a2 = _mm256_fmadd_pd(d2, d2, a2);
      a3 = _mm256_fmadd_pd(d3, d3, a3);
    }
    _mm256_storeu_pd(lanes, a0);
    _mm256_storeu_pd(lanes + 4, a1);
    _mm256_storeu_pd(lanes + 8, a2);
    _mm256_storeu_pd(lanes + 12, a3);
  }
};

}  // namespace strata::cpu_optim::detail::avx2

#define STRATA_CPU_OPTIM_NS avx2
#include "cpu_optim/arch/kernels_impl.h"

namespace strata::cpu_optim::detail {
const KernelTable kAvx2Kernels = avx2::make_table("avx2");
}
