// Scalar fp32 <-> bf16 / fp16 conversions, bit-exact with the SIMD kernels.
//
// fp32 -> bf16 is round-to-nearest-even on the bit pattern, exactly as
// PyTorch's c10::BFloat16 does it: denormals are kept (not flushed), values
// that round past the largest finite bf16 become inf, and every NaN becomes
// the canonical quiet NaN 0x7FC0. (AVX512-BF16's vcvtneps2bf16 flushes
// denormals to zero, which is why no kernel uses it for stored values.)
//
// fp32 -> fp16 is round-to-nearest-even as F16C's vcvtps2ph and ARM's fcvtn
// do it: overflow to inf, gradual underflow, NaN quieted keeping the top
// payload bits. fp16/bf16 -> fp32 is exact.
//
// Freestanding (see types.h): no <cstring>, <cmath>.
#pragma once

#include "common/float_convert.h"
#include "cpu_optim/types.h"

namespace strata::cpu_optim {

// The conversions themselves are shared with the device backends.
using ::strata::bf16_bits_to_f32;
using ::strata::f16_bits_to_f32;
using ::strata::f32_bits;
using ::strata::f32_from_bits;
using ::strata::f32_to_bf16_bits;
using ::strata::f32_to_f16_bits;

inline float to_f32(float x) { return x; }
inline float to_f32(Bf16 x) { return bf16_bits_to_f32(x.bits); }
inline float to_f32(F16 x) { return f16_bits_to_f32(x.bits); }

}  // namespace strata::cpu_optim
