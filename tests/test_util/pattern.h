// Deterministic test bytes: the same for a (size, seed) on every run and
// machine (xorshift64), different for different seeds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace strata::testing {

inline std::vector<uint8_t> pattern(std::size_t n, uint64_t seed) {
  std::vector<uint8_t> v(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<uint8_t>(x >> 24);
  }
  return v;
}

}  // namespace strata::testing
