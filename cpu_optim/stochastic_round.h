// Stochastic rounding of fp32 to bf16 for optimizer states, and the counter-
// based hash that supplies its random bits: the one definition used by every
// ISA's kernels (scalar, AVX2, AVX-512, NEON vectorise mix32 lane by lane) and
// by the reference, so all of them round the same element the same way.
//
// Why: with round-to-nearest bf16 moments, exp_avg_sq's per-step change
// (1 - beta2 = 0.001 of g^2) is below bf16's resolution (2^-8) relative to v,
// so v stops following the gradients (BENCHMARKS.md, issue 13). Rounding up
// with probability (x - down) / (up - down) makes the stored value unbiased,
// E[round(x)] = x, so small updates survive on average.
//
// The rounding: bits = f32_bits(x) + r, truncated to the top 16 bits, with r
// 16 uniform random bits. A value exactly representable in bf16 (low 16 bits
// zero) is unchanged; inf stays inf; every NaN becomes 0x7FC0 as with
// round-to-nearest (common/float_convert.h); a finite value above the largest
// finite bf16 rounds up to inf with the probability of its distance to it.
//
// The random bits of one element are a pure function of
//   (seed, stream: an optional tensor identity, 0 in the runtime and the C
//    ABI, step, the element's global index within the tensor, the state
//    slot 0..2)
// never of a stateful generator, thread or chunk: results are bit-identical
// across ISAs, thread counts, chunkings (the NVMe ring updates a tensor chunk
// by chunk: each call passes the global index of its first element), RAM and
// NVMe tiers, ranks (a shard passes its offset in the full tensor) and a
// checkpoint resume (the step count is in the checkpoint).
//
// Per element: r = mix32(lo32(index) ^ key) >> 16, where key is a 64-bit
// splitmix chain of (seed, stream, step, index >> 32, slot), computed once per
// kernel call (a call never straddles a 2^32 boundary of the global index:
// optimizer.cpp splits there). mix32 is a bijection of 32-bit words with full
// avalanche (the "lowbias32" constants), so distinct elements of one call get
// distinct words, and only 32-bit integer multiply/xor/shift is needed per
// lane.
//
// Freestanding (see types.h): compiled for aarch64 without a C++ library.
#pragma once

#include <stdint.h>

#include "common/float_convert.h"

namespace strata::cpu_optim {

// The default seed of stochastic rounding (StepBuffers::rounding_seed).
inline constexpr uint64_t kDefaultRoundingSeed = 0x5354524154415352ull;  // "STRATASR"

// Chris Wellons' lowbias32: two multiply-xorshift rounds.
inline constexpr uint32_t kMix32A = 0x7feb352du;
inline constexpr uint32_t kMix32B = 0x846ca68bu;
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= kMix32A;
  x ^= x >> 15;
  x *= kMix32B;
  x ^= x >> 16;
  return x;
}

// splitmix64's finaliser.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The key of the elements of one (seed, stream, step, index >> 32, slot).
inline uint32_t rounding_key(uint64_t seed, uint64_t stream, int64_t step, uint32_t index_hi, int slot) {
  uint64_t h = mix64(seed + 0x9e3779b97f4a7c15ull);
  h = mix64(h ^ stream);
  h = mix64(h ^ static_cast<uint64_t>(step));
  h = mix64(h ^ ((static_cast<uint64_t>(index_hi) << 2) | static_cast<uint64_t>(slot & 3)));
  return static_cast<uint32_t>(h >> 32);
}

// The 16 random bits of the element whose global index has low word `lo`.
inline uint32_t rounding_bits(uint32_t key, uint32_t lo) { return mix32(lo ^ key) >> 16; }

// fp32 -> bf16 rounded up or down with `r` (16 random bits, < 2^16).
inline uint16_t f32_to_bf16_bits_sr(float f, uint32_t r) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  // inf (low 16 bits zero) stays inf: r < 2^16 cannot carry.
  return static_cast<uint16_t>((u + r) >> 16);
}

}  // namespace strata::cpu_optim
