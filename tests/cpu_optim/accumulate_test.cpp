// accumulate(): the engine's gradient accumulation kernel. The sum it writes
// is the scalar loop's bit for bit on every ISA and thread count, and the
// block squares it returns add up to grad_stats() of the result bit for bit
// (the engine's norm relies on that to skip its separate pass).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "test_util.h"

namespace strata::cpu_optim {
namespace {

using testing::Buf;
using testing::ValueGen;

class AccumulateTest : public ::testing::TestWithParam<Isa> {};

// The formula: dst = float(src) or dst + float(src), one fp32 add.
void reference(std::vector<float>& dst, const Buf& src, bool first) {
  for (std::size_t i = 0; i < dst.size(); ++i) dst[i] = first ? src.get(i) : dst[i] + src.get(i);
}

TEST_P(AccumulateTest, SumAndBlockSquaresMatchTheScalarLoopAndGradStats) {
  const Isa isa = GetParam();
  STRATA_SKIP_IF_UNSUPPORTED(isa);
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (std::size_t n : {std::size_t{1}, std::size_t{15}, std::size_t{2049}, kNormBlock, 3 * kNormBlock + 333}) {
      const std::size_t nblocks = (n + kNormBlock - 1) / kNormBlock;
      for (int threads : {1, 3}) {
        std::vector<float> want(n), got(n, 123.0f);  // `first` must overwrite, not add
        std::vector<double> sq(nblocks, -1.0);
        for (int micro = 0; micro < 3; ++micro) {
          ValueGen gen(n + micro);
          Buf g(d, n);
          for (std::size_t i = 0; i < n; ++i) g.set(i, gen(d));
          reference(want, g, micro == 0);
          Status st = accumulate(got.data(), g.data(), d, n, micro == 0, sq.data(), ExecOptions{isa, threads});
          ASSERT_TRUE(st.ok()) << st.to_string();
          ASSERT_EQ(std::memcmp(got.data(), want.data(), n * 4), 0)
              << dtype_name(d) << " n=" << n << " micro=" << micro << " " << isa_name(isa);
          double total = 0;
          for (std::size_t b = 0; b < nblocks; ++b) {
            const std::size_t lo = b * kNormBlock, cnt = std::min(n, lo + kNormBlock) - lo;
            auto block = grad_stats(want.data() + lo, DType::kF32, cnt, 1.0, ExecOptions{Isa::kScalar, 1});
            ASSERT_TRUE(block.ok());
            EXPECT_EQ(std::memcmp(&sq[b], &block->sum_sq, 8), 0) << "block " << b << ": " << sq[b] << " vs "
                                                                 << block->sum_sq;
            total += sq[b];
          }
          auto whole = grad_stats(want.data(), DType::kF32, n, 1.0, ExecOptions{Isa::kScalar, 1});
          ASSERT_TRUE(whole.ok());
          EXPECT_EQ(std::memcmp(&total, &whole->sum_sq, 8), 0) << total << " vs " << whole->sum_sq;
        }
      }
    }
  }
}

TEST_P(AccumulateTest, NonFiniteElementsMakeTheirBlockNonFinite) {
  const Isa isa = GetParam();
  STRATA_SKIP_IF_UNSUPPORTED(isa);
  const std::size_t n = 3 * kNormBlock + 5;
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (std::size_t pos : {std::size_t{0}, kNormBlock + 3, n - 1}) {
      Buf g(d, n);
      for (std::size_t i = 0; i < n; ++i) g.set(i, 0.25f);
      g.set(pos, std::numeric_limits<float>::infinity());
      std::vector<float> acc(n, 1.0f);
      std::vector<double> sq(4);
      ASSERT_TRUE(accumulate(acc.data(), g.data(), d, n, false, sq.data(), ExecOptions{isa, 2}).ok());
      for (std::size_t b = 0; b < 4; ++b)
        EXPECT_EQ(std::isfinite(sq[b]), b != pos / kNormBlock) << dtype_name(d) << " pos=" << pos << " block " << b;
    }
  }
  // An fp16 gradient above 65504 is inf; the largest finite fp32 values
  // squared do not overflow the double.
  std::vector<float> big(100, std::numeric_limits<float>::max());
  std::vector<float> acc(100);
  double sq = 0;
  ASSERT_TRUE(accumulate(acc.data(), big.data(), DType::kF32, 100, true, &sq, ExecOptions{isa, 1}).ok());
  EXPECT_TRUE(std::isfinite(sq));
}

INSTANTIATE_TEST_SUITE_P(Paths, AccumulateTest, ::testing::ValuesIn(testing::all_isas()), testing::isa_param_name);

TEST(Accumulate, NoSquaresAndErrors) {
  float dst[3] = {1, 2, 3};
  const float src[3] = {1, 1, 1};
  ASSERT_TRUE(accumulate(dst, src, DType::kF32, 3, false, nullptr).ok());
  EXPECT_EQ(dst[2], 4.0f);
  EXPECT_TRUE(accumulate(nullptr, nullptr, DType::kF32, 0, true, nullptr).ok());
  EXPECT_EQ(accumulate(dst, nullptr, DType::kF32, 3, true, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(accumulate(dst, src, DType::kU8, 3, true, nullptr).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::cpu_optim
