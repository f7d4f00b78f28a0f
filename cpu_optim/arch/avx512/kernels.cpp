// AVX-512 (F, BW, VL) kernels, compiled with -mavx512f -mavx512bw -mavx512vl
// (plus -mavx2 -mfma -mf16c); called only after dispatch.cpp has checked
// CPUID and the OS's zmm/opmask state support.
//
// bf16 stores use integer round-to-nearest-even rather than AVX512-BF16's
// vcvtneps2bf16: that instruction flushes denormal inputs and outputs to
// zero, which PyTorch's conversion does not, and the loop is bound by memory,
// not by these four integer operations.
#include <immintrin.h>

#include "cpu_optim/arch/kernel_table.h"
#include "cpu_optim/numeric.h"
#include "cpu_optim/stochastic_round.h"

namespace strata::cpu_optim::detail::avx512 {

struct V {
  using F = __m512;
  static constexpr size_t W = 16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F load(const Bf16* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static __m512i round_bf16(F x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
  }
  static void store(Bf16* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(round_bf16(x)));
  }
  static F store_rounded(Bf16* p, F x) {
    __m512i r = round_bf16(x);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
    return _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
  }
  // Stochastic rounding (stochastic_round.h): mix32 on 16 lanes, lane j
  // hashing index lo + j; then (bits + r) >> 16, NaN -> 0x7FC0.
  static __m512i mix32(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kMix32A)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kMix32B)));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  }
  static F store_rounded_sr(Bf16* p, F x, uint32_t lo, uint32_t key) {
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(lo)),
                                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i rnd = _mm512_srli_epi32(mix32(_mm512_xor_si512(idx, _mm512_set1_epi32(static_cast<int>(key)))), 16);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), rnd), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
    return _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
  }
  static void stream(Bf16* p, F x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(round_bf16(x)));
  }
  static void stream(F16* p, F x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_mask_cvtps_ph(_mm256_setzero_si256(), 0xffff, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void fence() { _mm_sfence(); }
  static F load(const F16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(F16* p, F x) {
    // The masked form: gcc 12's plain _mm512_cvtps_ph trips -Wmaybe-uninitialized.
    __m256i h = _mm512_mask_cvtps_ph(_mm256_setzero_si256(), 0xffff, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F sign(F x) {
    const F zero = _mm512_setzero_ps();
    __mmask16 pos = _mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ);
    __mmask16 neg = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ);
    F r = _mm512_mask_blend_ps(pos, zero, _mm512_set1_ps(1.0f));
    return _mm512_mask_blend_ps(neg, r, _mm512_set1_ps(-1.0f));
  }
  template <class T>
  static void sumsq16(const T* g, size_t n, double* lanes) {
    __m512d acc0 = _mm512_loadu_pd(lanes), acc1 = _mm512_loadu_pd(lanes + 8);
    for (size_t i = 0; i < n; i += 16) {
      F x = load(g + i);
      __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
      __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
      acc0 = _mm512_fmadd_pd(lo, lo, acc0);
      acc1 = _mm512_fmadd_pd(hi, hi, acc1);
    }
    _mm512_storeu_pd(lanes, acc0);
    _mm512_storeu_pd(lanes + 8, acc1);
  }
};

}  // namespace strata::cpu_optim::detail::avx512

#define STRATA_CPU_OPTIM_NS avx512
#include "cpu_optim/arch/kernels_impl.h"

namespace strata::cpu_optim::detail {
const KernelTable kAvx512Kernels = avx512::make_table("avx512");
}
