// fp32 <-> bf16 / fp16 conversions on bit patterns: the one definition used by
// the CPU optimizer kernels (every ISA), the host device backend and the CUDA
// kernels, so all of them round the same way and give the same bits.
//
// fp32 -> bf16: round to nearest even on the bit pattern, exactly as
//   PyTorch's c10::BFloat16: denormals kept (not flushed), values that round
//   past the largest finite bf16 become inf, every NaN becomes the quiet NaN
//   0x7FC0. (AVX512-BF16's vcvtneps2bf16 flushes denormals to zero, which is
//   why no kernel uses it for stored values.)
// fp32 -> fp16: round to nearest even as F16C's vcvtps2ph and ARM's fcvtn do
//   it: overflow to inf, gradual underflow, NaN quieted keeping the sign and
//   the top payload bits.
// bf16 / fp16 -> fp32 is exact.
//
// Freestanding on purpose (only <stdint.h>): the NEON kernel is compile-checked
// with `clang --target=aarch64 -ffreestanding`, where no C++ library exists,
// and nvcc compiles it for the device.
#pragma once

#include <stdint.h>

#include "common/dtype.h"

#if defined(__CUDACC__)
#define STRATA_HD __host__ __device__ __forceinline__
#else
#define STRATA_HD inline
#endif

namespace strata {

STRATA_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
#endif
}

STRATA_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
#endif
}

STRATA_HD uint16_t f32_to_bf16_bits(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

STRATA_HD float bf16_bits_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

STRATA_HD uint16_t f32_to_f16_bits(float f) {
  uint32_t x = f32_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // NaN
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (ax >= 0x38800000u) {                                              // normal fp16 (>= 2^-14)
    uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));  // rebias 127 -> 15
  }
  uint32_t e = ax >> 23;
  if (e < 102) return static_cast<uint16_t>(sign);  // below 2^-25: rounds to zero
  // Subnormal fp16: value / 2^-24, rounded to nearest even. A carry into bit
  // 10 yields the smallest normal, which is the right answer.
  uint32_t m = (ax & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126 - e;  // 14..24
  uint32_t r = m >> shift;
  uint32_t rem = m & ((1u << shift) - 1);
  uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

STRATA_HD float f16_bits_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return f32_from_bits(sign | ((exp + 112) << 23) | (mant << 13));
  float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // 2^-24; exact since mant < 2^10
  return f32_from_bits(sign | f32_bits(v));
}

// dst[i] = float(src[i]) for n elements of an fp32, bf16 or fp16 array
// (exact). Host code; the one widening loop of the runtime and the CPU ops.
inline void widen_to_f32(const void* src, DType dtype, size_t n, float* dst) {
  if (dtype == DType::kF32) {
    const float* s = static_cast<const float*>(src);
    for (size_t i = 0; i < n; ++i) dst[i] = s[i];
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src);
  if (dtype == DType::kBF16) {
    for (size_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_f32(s[i]);
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = f16_bits_to_f32(s[i]);
  }
}

}  // namespace strata
