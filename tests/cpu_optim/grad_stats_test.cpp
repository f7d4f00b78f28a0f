// grad_stats(): squared L2 norm and inf/NaN detection, deterministic for any
// thread count and ISA. Tolerance against a long double sum: 1e-12 relative
// (double accumulation over <= 1e6 terms of one sign).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_optim/reference.h"
#include "test_util.h"

namespace strata::cpu_optim {
namespace {

using testing::Buf;
using testing::ValueGen;

class GradStatsTest : public ::testing::TestWithParam<Isa> {};

TEST_P(GradStatsTest, MatchesReferenceAndIsDeterministic) {
  const Isa isa = GetParam();
  STRATA_SKIP_IF_UNSUPPORTED(isa);
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (std::size_t n : {std::size_t{1}, std::size_t{15}, std::size_t{17}, kNormBlock - 1, 5 * kNormBlock + 333}) {
      ValueGen gen(n);
      Buf g(d, n);
      for (std::size_t i = 0; i < n; ++i) g.set(i, gen(d));
      const double scale = 1.0 / 4096;
      const GradStats ref = reference_grad_stats(g.data(), d, n, scale);
      auto base = grad_stats(g.data(), d, n, scale, ExecOptions{Isa::kScalar, 1});
      ASSERT_TRUE(base.ok());
      EXPECT_FALSE(base->has_inf_nan);
      EXPECT_NEAR(base->sum_sq, ref.sum_sq, 1e-12 * ref.sum_sq) << dtype_name(d) << " n=" << n;
      for (int threads : {1, 2, 3, 7}) {
        auto r = grad_stats(g.data(), d, n, scale, ExecOptions{isa, threads});
        ASSERT_TRUE(r.ok()) << r.status().to_string();
        // Same bits as the scalar single-thread result: any ISA, any threads.
        EXPECT_EQ(std::memcmp(&r->sum_sq, &base->sum_sq, sizeof(double)), 0)
            << dtype_name(d) << " n=" << n << " " << isa_name(isa) << " threads=" << threads << ": "
             << r->sum_sq << " vs " << base->sum_sq;
        EXPECT_FALSE(r->has_inf_nan);
      }
    }
  }
}

TEST_P(GradStatsTest, DetectsInfAndNaNAnywhere) {
  const Isa isa = GetParam();
  STRATA_SKIP_IF_UNSUPPORTED(isa);
  const std::size_t n = 3 * kNormBlock + 5;
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (std::size_t pos : {std::size_t{0}, std::size_t{7}, kNormBlock + 3, n - 1}) {
      for (float bad : {inf, -inf, nan}) {
        Buf g(d, n);
        for (std::size_t i = 0; i < n; ++i) g.set(i, 0.5f);
        g.set(pos, bad);
        for (int threads : {1, 3}) {
          auto r = grad_stats(g.data(), d, n, 1.0, ExecOptions{isa, threads});
          ASSERT_TRUE(r.ok());
          EXPECT_TRUE(r->has_inf_nan) << dtype_name(d) << " pos=" << pos << " value=" << bad;
          EXPECT_FALSE(std::isfinite(r->sum_sq));
        }
      }
    }
    // fp16 overflow: a gradient above 65504 stored as fp16 is inf.
    if (d == DType::kF16) {
      Buf g(d, 9);
      for (std::size_t i = 0; i < 9; ++i) g.set(i, 1.0f);
      g.set(4, 70000.0f);
      auto r = grad_stats(g.data(), d, 9, 1.0 / 65536, ExecOptions{isa, 1});
      ASSERT_TRUE(r.ok());
      EXPECT_TRUE(r->has_inf_nan);
    }
  }
}

TEST_P(GradStatsTest, LargestFiniteValuesDoNotOverflow) {
  const Isa isa = GetParam();
  STRATA_SKIP_IF_UNSUPPORTED(isa);
  std::vector<float> g(100, std::numeric_limits<float>::max());
  auto r = grad_stats(g.data(), DType::kF32, g.size(), 1.0, ExecOptions{isa, 2});
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->has_inf_nan);
  EXPECT_NEAR(r->sum_sq, 100.0 * double(g[0]) * double(g[0]), 1e-12 * r->sum_sq);
}

INSTANTIATE_TEST_SUITE_P(Paths, GradStatsTest, ::testing::ValuesIn(testing::all_isas()), testing::isa_param_name);

TEST(GradStats, EmptyAndErrors) {
  auto r = grad_stats(nullptr, DType::kF32, 0);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->sum_sq, 0.0);
  EXPECT_FALSE(r->has_inf_nan);
  auto e = grad_stats(nullptr, DType::kF32, 5);
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
}

// A non-finite pre-scale (1/loss_scale after the scale underflowed to 0) used
// to give an ok result with sum_sq inf or NaN and has_inf_nan false: a
// trainer checking has_inf_nan would then clip with a NaN coefficient. It is
// refused, as step() refuses it.
TEST(GradStats, NonFiniteScaleIsAnError) {
  const float g[5] = {1, 2, 3, 4, 5};
  for (double scale : {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                       std::numeric_limits<double>::quiet_NaN()}) {
    auto r = grad_stats(g, DType::kF32, 5, scale);
    EXPECT_FALSE(r.ok()) << "scale " << scale << " gave sum_sq " << r->sum_sq << ", has_inf_nan " << r->has_inf_nan;
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    }
  }
  auto ok = grad_stats(g, DType::kF32, 5, 0.5);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->sum_sq, 55.0 * 0.25);
}

}  // namespace
}  // namespace strata::cpu_optim
