// Helpers shared by the cpu_optim tests.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu_optim/dispatch.h"
#include "cpu_optim/numeric.h"
#include "cpu_optim/optimizer.h"

namespace strata::cpu_optim::testing {

// Every x86/ARM ISA the tests know; each test skips the ones this machine
// (or this binary) cannot run, saying why.
inline const std::vector<Isa>& all_isas() {
  static const std::vector<Isa> v = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kNeon};
  return v;
}

#define STRATA_SKIP_IF_UNSUPPORTED(isa)                                                              \
  do {                                                                                               \
    if (!::strata::cpu_optim::isa_supported(isa))                                                    \
      GTEST_SKIP() << "ISA " << ::strata::cpu_optim::isa_name(isa)                                   \
                   << " cannot run here (not built into this binary, or the CPU/OS lacks it): "     \
                   << ::strata::cpu_optim::cpu_isa_summary();                                        \
  } while (0)

inline std::string isa_param_name(const ::testing::TestParamInfo<Isa>& info) { return isa_name(info.param); }

// A storage-typed buffer of n elements.
struct Buf {
  DType dtype = DType::kF32;
  std::vector<std::uint8_t> bytes;
  Buf() = default;
  Buf(DType d, std::size_t n) : dtype(d), bytes(n * dtype_size(d)) {}
  void* data() { return bytes.empty() ? nullptr : bytes.data(); }
  const void* data() const { return bytes.empty() ? nullptr : bytes.data(); }
  std::size_t size() const { return bytes.size() / dtype_size(dtype); }
  float get(std::size_t i) const {
    switch (dtype) {
      case DType::kF32: { float f; std::memcpy(&f, bytes.data() + 4 * i, 4); return f; }
      case DType::kBF16: { std::uint16_t h; std::memcpy(&h, bytes.data() + 2 * i, 2); return bf16_bits_to_f32(h); }
      case DType::kF16: { std::uint16_t h; std::memcpy(&h, bytes.data() + 2 * i, 2); return f16_bits_to_f32(h); }
      case DType::kU8: case DType::kF64: case DType::kI32: case DType::kI64: break;  // storage only: never built here
    }
    return 0;
  }
  void set(std::size_t i, float f) {
    switch (dtype) {
      case DType::kF32: std::memcpy(bytes.data() + 4 * i, &f, 4); break;
      case DType::kBF16: { std::uint16_t h = f32_to_bf16_bits(f); std::memcpy(bytes.data() + 2 * i, &h, 2); break; }
      case DType::kF16: { std::uint16_t h = f32_to_f16_bits(f); std::memcpy(bytes.data() + 2 * i, &h, 2); break; }
      case DType::kU8: case DType::kF64: case DType::kI32: case DType::kI64: break;  // storage only: never built here
    }
  }
};

// Random values of every kind the optimizer meets: zeros, fp32 denormals,
// tiny and large magnitudes, ordinary ones, both signs. Ranges fit the
// storage dtype (fp16 tops out at 65504 and its denormals start at 6e-8) and
// keep g*g finite in fp32, as it must be for any fp32 Adam.
class ValueGen {
 public:
  explicit ValueGen(std::uint64_t seed) : rng_(seed) {}
  float operator()(DType storage) {
    std::uniform_real_distribution<double> u(0.0, 1.0);
    const double kind = u(rng_);
    const double sign = u(rng_) < 0.5 ? -1.0 : 1.0;
    auto logu = [&](double lo, double hi) { return std::exp(std::log(lo) + u(rng_) * (std::log(hi) - std::log(lo))); };
    const bool f16 = storage == DType::kF16;
    double x;
    if (kind < 0.08) x = 0.0;
    else if (kind < 0.14) x = f16 ? logu(6e-8, 6e-5) : logu(1.5e-45, 1.1e-38);  // denormals
    else if (kind < 0.24) x = f16 ? logu(6e-5, 1e-3) : logu(1e-30, 1e-12);       // tiny
    else if (kind < 0.32) x = f16 ? logu(1e3, 6e4) : logu(1e6, 1e15);           // large
    else x = logu(1e-4, 10.0);
    return static_cast<float>(sign * x);
  }
  std::mt19937_64& rng() { return rng_; }

 private:
  std::mt19937_64 rng_;
};

inline bool same_bits_or_both_nan(float a, float b) {
  if (std::isnan(a) && std::isnan(b)) return true;
  return std::memcmp(&a, &b, 4) == 0;
}

}  // namespace strata::cpu_optim::testing
