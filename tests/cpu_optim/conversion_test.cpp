// fp32 -> bf16 / fp16 rounding (round to nearest even, PyTorch's NaN and
// overflow behaviour) and bf16 / fp16 -> fp32 widening, on every ISA: through
// convert(), through step()'s fused output, and through gradient loads.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "test_util.h"

namespace strata::cpu_optim {
namespace {

struct Edge {
  std::uint32_t in;
  std::uint16_t out;
  const char* what;
};

// Expected values follow PyTorch's c10::BFloat16 (round_to_nearest_even).
const std::vector<Edge>& bf16_edges() {
  static const std::vector<Edge> v = {
      {0x3f800000, 0x3f80, "1.0"},
      {0x3f808000, 0x3f80, "tie, even below: stays"},
      {0x3f818000, 0x3f82, "tie, odd below: rounds up"},
      {0x3f808001, 0x3f81, "just above tie"},
      {0x3f807fff, 0x3f80, "just below tie"},
      {0xbf818000, 0xbf82, "negative tie, odd"},
      {0x7f7fffff, 0x7f80, "FLT_MAX rounds to inf"},
      {0x7f7f7fff, 0x7f7f, "largest that stays finite"},
      {0x7f7f8000, 0x7f80, "tie at the top rounds to inf"},
      {0x7f800000, 0x7f80, "+inf"},
      {0xff800000, 0xff80, "-inf"},
      {0x7fc00000, 0x7fc0, "quiet NaN"},
      {0x7f800001, 0x7fc0, "signalling NaN"},
      {0xffc00001, 0x7fc0, "negative NaN: canonical"},
      {0x7fffffff, 0x7fc0, "NaN with all payload bits (naive rounding would carry)"},
      {0x00000000, 0x0000, "+0"},
      {0x80000000, 0x8000, "-0"},
      {0x00000001, 0x0000, "smallest denormal"},
      {0x00008000, 0x0000, "denormal tie, even"},
      {0x00018000, 0x0002, "denormal tie, odd"},
      {0x00010000, 0x0001, "exact denormal"},
      {0x807fffff, 0x8080, "largest negative denormal rounds to -min normal"},
      {0x00800000, 0x0080, "min normal"},
  };
  return v;
}

// Expected values per IEEE round to nearest even (F16C / ARM fcvt).
const std::vector<Edge>& f16_edges() {
  static const std::vector<Edge> v = {
      {0x3f800000, 0x3c00, "1.0"},
      {0x3f801000, 0x3c00, "1 + 2^-11: tie, even"},
      {0x3f803000, 0x3c02, "1 + 3*2^-11: tie, odd"},
      {0x477fe000, 0x7bff, "65504 (max)"},
      {0x477fefff, 0x7bff, "just below 65520"},
      {0x477ff000, 0x7c00, "65520 rounds to inf"},
      {0x7f7fffff, 0x7c00, "FLT_MAX -> inf"},
      {0x7f800000, 0x7c00, "+inf"},
      {0xff800000, 0xfc00, "-inf"},
      {0x7fc00000, 0x7e00, "quiet NaN"},
      {0xffc00000, 0xfe00, "negative quiet NaN"},
      {0x38800000, 0x0400, "2^-14, min normal"},
      {0x387fc000, 0x03ff, "largest subnormal"},
      {0x387fe000, 0x0400, "tie between largest subnormal and min normal"},
      {0x33800000, 0x0001, "2^-24, min subnormal"},
      {0x33000000, 0x0000, "2^-25: tie, rounds to 0"},
      {0x33000001, 0x0001, "just above 2^-25"},
      {0x33c00000, 0x0002, "1.5*2^-24: tie, odd -> 2"},
      {0x00000001, 0x0000, "fp32 denormal -> 0"},
      {0x80000000, 0x8000, "-0"},
      {0xc0000000, 0xc000, "-2"},
  };
  return v;
}

TEST(Conversion, ScalarBf16Edges) {
  for (const Edge& e : bf16_edges())
    EXPECT_EQ(f32_to_bf16_bits(f32_from_bits(e.in)), e.out) << std::hex << e.in << ": " << e.what;
}

TEST(Conversion, ScalarF16Edges) {
  for (const Edge& e : f16_edges())
    EXPECT_EQ(f32_to_f16_bits(f32_from_bits(e.in)), e.out) << std::hex << e.in << ": " << e.what;
}

TEST(Conversion, ScalarWideningIsExactForAll65536) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    float b = bf16_bits_to_f32(static_cast<std::uint16_t>(h));
    EXPECT_EQ(f32_bits(b), h << 16);
    float f = f16_bits_to_f32(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) continue;
    // Round trip through fp16 is the identity on every non-NaN value.
    ASSERT_EQ(f32_to_f16_bits(f), h) << std::hex << h;
  }
}

class ConversionPath : public ::testing::TestWithParam<Isa> {};

TEST_P(ConversionPath, EdgesThroughConvertAndFusedOutput) {
  const Isa isa = GetParam();
  STRATA_SKIP_IF_UNSUPPORTED(isa);
  for (DType d : {DType::kBF16, DType::kF16}) {
    const auto& edges = d == DType::kBF16 ? bf16_edges() : f16_edges();
    // Each edge at every position of a vector (and in the tail): 37 copies.
    std::vector<float> src;
    std::vector<std::uint16_t> want;
    for (int rep = 0; rep < 37; ++rep)
      for (const Edge& e : edges) {
        src.push_back(f32_from_bits(e.in));
        want.push_back(e.out);
      }
    std::vector<std::uint16_t> got(src.size());
    ASSERT_TRUE(convert(src.data(), got.data(), d, src.size(), ExecOptions{isa, 2}).ok());
    for (std::size_t i = 0; i < src.size(); ++i)
      ASSERT_EQ(got[i], want[i]) << dtype_name(d) << " on " << isa_name(isa) << ": input 0x" << std::hex
                                 << f32_bits(src[i]) << " (" << edges[i % edges.size()].what << ")";
    // Fused output of a step that leaves params as they are: SGD, lr = 0.
    OptimizerConfig c;
    c.kind = OptimizerKind::kSgd;
    c.lr = 0.0;
    std::vector<float> p = src, g(src.size(), 0.0f);
    std::vector<std::uint16_t> out(src.size());
    StepBuffers b;
    b.params = p.data();
    b.grads = g.data();
    b.params_out = out.data();
    b.out_dtype = d;
    ASSERT_TRUE(step(c, 1, b, p.size(), ExecOptions{isa, 1}).ok());
    for (std::size_t i = 0; i < src.size(); ++i)
      ASSERT_EQ(out[i], want[i]) << "fused " << dtype_name(d) << " output on " << isa_name(isa) << ": 0x" << std::hex
                                 << f32_bits(src[i]);
  }
}

TEST_P(ConversionPath, RandomBitPatternsMatchScalar) {
  const Isa isa = GetParam();
  STRATA_SKIP_IF_UNSUPPORTED(isa);
  std::mt19937 rng(5);
  const std::size_t n = 1 << 20;
  std::vector<float> src(n);
  for (auto& x : src) x = f32_from_bits(rng());
  for (DType d : {DType::kBF16, DType::kF16}) {
    std::vector<std::uint16_t> got(n);
    ASSERT_TRUE(convert(src.data(), got.data(), d, n, ExecOptions{isa, 2}).ok());
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint16_t want = d == DType::kBF16 ? f32_to_bf16_bits(src[i]) : f32_to_f16_bits(src[i]);
      ASSERT_EQ(got[i], want) << dtype_name(d) << " on " << isa_name(isa) << ": 0x" << std::hex << f32_bits(src[i]);
    }
  }
}

// Loads of bf16/fp16 gradients widen exactly: SGD with lr = 1, maximize and
// params 0 writes p = g.
TEST_P(ConversionPath, GradientLoadsWidenExactly) {
  const Isa isa = GetParam();
  STRATA_SKIP_IF_UNSUPPORTED(isa);
  for (DType d : {DType::kBF16, DType::kF16}) {
    std::vector<std::uint16_t> g(65536);
    for (std::uint32_t h = 0; h < 65536; ++h) g[h] = static_cast<std::uint16_t>(h);
    std::vector<float> p(65536, 0.0f);
    OptimizerConfig c;
    c.kind = OptimizerKind::kSgd;
    c.lr = 1.0;
    c.maximize = true;
    StepBuffers b;
    b.params = p.data();
    b.grads = g.data();
    b.grad_dtype = d;
    ASSERT_TRUE(step(c, 1, b, p.size(), ExecOptions{isa, 2}).ok());
    for (std::uint32_t h = 0; h < 65536; ++h) {
      const float want = d == DType::kBF16 ? bf16_bits_to_f32(g[h]) : f16_bits_to_f32(g[h]);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(p[h])) << std::hex << h;
      } else {
        // 0 + 1*(-(-g)) is g, except that -0 becomes +0 (0 + -0 = +0).
        ASSERT_EQ(p[h], want) << dtype_name(d) << " on " << isa_name(isa) << ": 0x" << std::hex << h;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, ConversionPath, ::testing::ValuesIn(testing::all_isas()), testing::isa_param_name);

}  // namespace
}  // namespace strata::cpu_optim
