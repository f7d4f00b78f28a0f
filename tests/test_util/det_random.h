// A deterministic generator for test data: the same bits on every run,
// machine and rank (a splitmix-style hash of (seed, index) to [-1, 1)).
#pragma once

#include <cstdint>

namespace strata::testing {

inline float det_uniform(uint64_t seed, uint64_t i) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull + 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 29;
  return static_cast<float>(static_cast<double>(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

}  // namespace strata::testing
