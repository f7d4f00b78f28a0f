// Test data for the collectives: a value per (rank, index) whose sums depend
// on the order of the adds (signs and exponents vary), and the reference
// sums computed the way communicator.h specifies.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace strata::comm::test {

inline uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Rank r's value at index i of buffer `salt`: +-[1,2) * 2^[-12, 12].
inline float value(int rank, std::size_t i, uint64_t salt = 0) {
  const uint64_t h = mix((static_cast<uint64_t>(rank) << 48) ^ (salt << 40) ^ i);
  const float m = 1.0f + static_cast<float>(h & 0xffffff) / 16777216.0f;
  const int e = static_cast<int>((h >> 24) % 25) - 12;
  return ((h >> 40) & 1 ? -1.0f : 1.0f) * std::ldexp(m, e);
}

inline void fill(float* out, int rank, std::size_t begin, std::size_t n, uint64_t salt = 0) {
  for (std::size_t i = 0; i < n; ++i) out[i] = value(rank, begin + i, salt);
}

// The 1-rank reference: acc = p_0; acc += p_1; ... over elements
// [begin, begin+n) of the ranks' buffers.
inline std::vector<float> rank_order_sum(int world, std::size_t begin, std::size_t n, uint64_t salt = 0) {
  std::vector<float> acc(n), part(n);
  fill(acc.data(), 0, begin, n, salt);
  for (int r = 1; r < world; ++r) {
    fill(part.data(), r, begin, n, salt);
    for (std::size_t i = 0; i < n; ++i) acc[i] += part[i];
  }
  return acc;
}

inline bool same_bits(const float* a, const float* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(float)) == 0;
}

}  // namespace strata::comm::test
