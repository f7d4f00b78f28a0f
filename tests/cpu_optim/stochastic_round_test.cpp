// Stochastic rounding of bf16 states (cpu_optim/stochastic_round.h): every
// ISA gives the scalar path's bits and the reference's; the result does not
// depend on how a tensor is split into calls (index_base) or threads; the
// rounding is unbiased and leaves representable values alone; and, the point
// of it, Adam's exp_avg_sq in bf16 follows the gradients where round-to-
// nearest stalls.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_optim/reference.h"
#include "cpu_optim/stochastic_round.h"
#include "test_util.h"

namespace strata::cpu_optim {
namespace {

using testing::Buf;
using testing::ValueGen;

std::vector<OptimizerConfig> sr_configs() {
  std::vector<OptimizerConfig> v;
  OptimizerConfig a;
  a.weight_decay = 0.01;
  v.push_back(a);
  OptimizerConfig ams = a;
  ams.amsgrad = true;
  v.push_back(ams);
  OptimizerConfig l;
  l.kind = OptimizerKind::kLion;
  v.push_back(l);
  OptimizerConfig s;
  s.kind = OptimizerKind::kSgd;
  s.momentum = 0.9;
  v.push_back(s);
  OptimizerConfig g;
  g.kind = OptimizerKind::kAdagrad;
  v.push_back(g);
  return v;
}

// n elements of one tensor with bf16 states, stepped `steps` times in calls
// of `piece` elements (index_base = the piece's offset).
struct Tensor {
  std::vector<float> p, g;
  Buf s[3];
  explicit Tensor(std::size_t n, std::uint64_t seed) : p(n), g(n) {
    ValueGen gen(seed);
    for (auto& x : p) x = gen(DType::kF32);
    for (int k = 0; k < 3; ++k) s[k] = Buf(DType::kBF16, n);
  }
  Status run(const OptimizerConfig& c, int steps, std::size_t piece, ExecOptions exec, bool reference = false,
             std::uint64_t stream = 7, std::uint64_t base = 0) {
    const std::size_t n = p.size();
    for (int t = 1; t <= steps; ++t) {
      ValueGen gen(1000 + t);
      for (auto& x : g) x = gen(DType::kF32) * 1e-3f;
      for (std::size_t off = 0; off < n; off += piece) {
        const std::size_t cnt = std::min(piece, n - off);
        StepBuffers b;
        b.state_rounding = StateRounding::kStochastic;  // opt-in (the default is nearest)
        b.params = p.data() + off;
        b.grads = g.data() + off;
        for (int k = 0; k < state_count(c); ++k) b.state[k] = static_cast<std::uint16_t*>(s[k].data()) + off;
        b.state_dtype = DType::kBF16;
        b.rounding_stream = stream;
        b.index_base = base + off;
        Status st = reference ? reference_step(c, t, b, cnt) : step(c, t, b, cnt, exec);
        if (!st.ok()) return st;
      }
    }
    return Status::ok_status();
  }
  bool same_states(const Tensor& o) const {
    return s[0].bytes == o.s[0].bytes && s[1].bytes == o.s[1].bytes && s[2].bytes == o.s[2].bytes;
  }
};

class StochasticRounding : public ::testing::TestWithParam<Isa> {};

// Every ISA, any thread count and any split into calls: the scalar path's
// bits. Odd piece sizes put vector tails in the middle of the tensor.
TEST_P(StochasticRounding, SameBitsOnEveryIsaThreadCountAndSplit) {
  const Isa isa = GetParam();
  STRATA_SKIP_IF_UNSUPPORTED(isa);
  const std::size_t n = 2 * detail::kStepBlock + 333;
  for (const OptimizerConfig& c : sr_configs()) {
    const std::string name = optimizer_name(c.kind) + std::string(c.amsgrad ? " amsgrad" : "");
    Tensor base(n, 5);
    ASSERT_TRUE(base.run(c, 3, n, ExecOptions{Isa::kScalar, 1}).ok());
    for (std::size_t piece : {n, std::size_t{1000}, std::size_t{37}}) {
      for (int threads : {1, 3}) {
        Tensor r(n, 5);
        ASSERT_TRUE(r.run(c, 3, piece, ExecOptions{isa, threads}).ok());
        EXPECT_TRUE(r.same_states(base)) << name << " on " << isa_name(isa) << ", pieces of " << piece << ", "
                                         << threads << " threads: states differ from scalar in one call";
        EXPECT_EQ(std::memcmp(r.p.data(), base.p.data(), n * 4), 0) << name << " on " << isa_name(isa);
      }
    }
  }
}

// Another stream (tensor), another seed or another step gives other bits;
// the same inputs give the same bits.
TEST_P(StochasticRounding, BitsDependOnStreamSeedAndIndex) {
  const Isa isa = GetParam();
  STRATA_SKIP_IF_UNSUPPORTED(isa);
  const std::size_t n = 4096;
  OptimizerConfig c;
  Tensor a(n, 1), same(n, 1), other_stream(n, 1), shifted(n, 1);
  ASSERT_TRUE(a.run(c, 2, n, ExecOptions{isa, 1}).ok());
  ASSERT_TRUE(same.run(c, 2, n, ExecOptions{isa, 2}).ok());
  ASSERT_TRUE(other_stream.run(c, 2, n, ExecOptions{isa, 1}, false, 8).ok());
  ASSERT_TRUE(shifted.run(c, 2, n, ExecOptions{isa, 1}, false, 7, 4096).ok());
  EXPECT_TRUE(a.same_states(same));
  EXPECT_FALSE(a.same_states(other_stream));
  EXPECT_FALSE(a.same_states(shifted));
}

INSTANTIATE_TEST_SUITE_P(Paths, StochasticRounding, ::testing::ValuesIn(testing::all_isas()),
                         testing::isa_param_name);

// The reference (element by element, in double) rounds with the same bits:
// where its fp32 value equals the kernel's, the bf16 state is identical. For
// SGD's first step (buf = g: exact in both) that is every element.
TEST(StochasticRoundingReference, MatchesKernelBits) {
  const std::size_t n = 5000;
  OptimizerConfig c;
  c.kind = OptimizerKind::kSgd;
  c.momentum = 0.9;
  Tensor k(n, 3), r(n, 3);
  ASSERT_TRUE(k.run(c, 1, 777, ExecOptions{Isa::kAuto, 2}, false, 11, 1ull << 32).ok());
  ASSERT_TRUE(r.run(c, 1, n, ExecOptions{}, true, 11, 1ull << 32).ok());
  EXPECT_TRUE(k.same_states(r));
  // Adam over several steps: states agree with the reference's to the
  // rounding of one bf16 ulp (the fp32 value before rounding may differ in
  // its last bits, which can move the rounding by one ulp).
  OptimizerConfig a;
  Tensor ka(n, 4), ra(n, 4);
  ASSERT_TRUE(ka.run(a, 3, n, ExecOptions{Isa::kAuto, 1}).ok());
  ASSERT_TRUE(ra.run(a, 3, n, ExecOptions{}, true).ok());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < n; ++i)
    for (int s = 0; s < 2; ++s) {
      const float x = ka.s[s].get(i), y = ra.s[s].get(i);
      if (x != y) ++differ;
      ASSERT_LE(std::fabs(x - y), std::ldexp(std::fabs(y), -7) + 1e-38) << "state " << s << " element " << i;
    }
  EXPECT_LT(differ, n / 10) << "the reference should round most elements identically";
}

// A tensor that crosses a 2^32 boundary of the global index: the kernel
// splits the call there (new keys), as the reference does element by element.
TEST(StochasticRoundingReference, CrossesTwoToThe32) {
  const std::size_t n = 3000;
  OptimizerConfig c;
  c.kind = OptimizerKind::kSgd;
  c.momentum = 0.5;
  const std::uint64_t base = (1ull << 32) - 1234;
  Tensor k(n, 9), r(n, 9), whole(n, 9);
  ASSERT_TRUE(k.run(c, 1, 100, ExecOptions{Isa::kAuto, 1}, false, 3, base).ok());
  ASSERT_TRUE(whole.run(c, 1, n, ExecOptions{Isa::kAuto, 2}, false, 3, base).ok());
  ASSERT_TRUE(r.run(c, 1, n, ExecOptions{}, true, 3, base).ok());
  EXPECT_TRUE(k.same_states(r));
  EXPECT_TRUE(whole.same_states(r));
}

// Unbiased: over N = 65536 elements holding the same fp32 value x (SGD's
// first step stores the gradient as the momentum buffer), the mean of the
// stored bf16 values is x within 6 standard errors, sqrt(q(1-q)/N) ulp with q
// the fractional position of x between its bf16 neighbours (at most
// 0.5/256 ulp: a deterministic hash, so this bound cannot flake). Round to
// nearest, for contrast, is off by min(q, 1-q) ulp. A value exactly
// representable in bf16 is stored unchanged, and so are 0, inf and NaN as
// round-to-nearest stores them.
TEST_P(StochasticRounding, UnbiasedAndExactValuesUnchanged) {
  const Isa isa = GetParam();
  STRATA_SKIP_IF_UNSUPPORTED(isa);
  const std::size_t n = 65536;
  OptimizerConfig c;
  c.kind = OptimizerKind::kSgd;
  c.momentum = 0.9;
  const float values[] = {1.0f + 0x1p-9f,  1.0f + 0x1p-12f, 3.0e-4f * 1.37f, -7.77e-10f, 1e-39f /* denormal */,
                          0x1.fep127f * 0.999f, 1.0f, -0.015625f, 0.0f, INFINITY, -INFINITY, NAN};
  for (float x : values) {
    std::vector<float> p(n, 0.0f), g(n, x);
    Buf m(DType::kBF16, n);
    for (std::uint64_t seed : {1ull, 2ull}) {
      StepBuffers b;
      b.state_rounding = StateRounding::kStochastic;  // opt-in (the default is nearest)
      b.params = p.data();
      b.grads = g.data();
      b.state[0] = m.data();
      b.state_dtype = DType::kBF16;
      b.rounding_seed = seed;
      b.rounding_stream = 42;
      ASSERT_TRUE(step(c, 1, b, n, ExecOptions{isa, 2}).ok());
      const float down = bf16_bits_to_f32(static_cast<std::uint16_t>(f32_bits(x) >> 16));
      if ((f32_bits(x) & 0xffff) == 0 || std::isnan(x)) {
        for (std::size_t i = 0; i < n; ++i)
          ASSERT_TRUE(testing::same_bits_or_both_nan(m.get(i), bf16_bits_to_f32(f32_to_bf16_bits(x))))
              << x << " changed at " << i << " to " << m.get(i);
        continue;
      }
      const float up = bf16_bits_to_f32(static_cast<std::uint16_t>((f32_bits(x) >> 16) + 1));
      const double ulp = double(up) - double(down);  // up may be inf: checked separately
      std::size_t ups = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const float y = m.get(i);
        ASSERT_TRUE(y == down || y == up) << x << ": " << y << " is neither neighbour";
        ups += y == up;
      }
      const double q = (f32_bits(x) & 0xffff) / 65536.0;
      const double frac = double(ups) / n;
      const double se = std::sqrt(q * (1 - q) / n);
      EXPECT_LE(std::fabs(frac - q), 6 * se + 1e-12) << x << " seed " << seed << ": rounded up " << frac
                                                     << " of the time, expected " << q;
      if (std::isfinite(up)) {
        double mean = 0;
        for (std::size_t i = 0; i < n; ++i) mean += m.get(i);
        mean /= n;
        EXPECT_LE(std::fabs(mean - double(x)), 6 * se * std::fabs(ulp) + 1e-300) << x << " seed " << seed;
      }
    }
  }
}

// The reason for all this: Adam with a constant gradient g = 1 from zero
// moments has v_t = 1 - beta2^t. In bf16 with round-to-nearest, v stalls
// once its per-step change 0.001 (1 - v) falls below half an ulp: at
// v = 0.25 (half an ulp 2^-10 > 0.00075). Stochastically rounded, the mean
// over 1024 elements follows 1 - beta2^t (0.993 after 5000 steps).
TEST_P(StochasticRounding, AdamSecondMomentFollowsTheGradient) {
  const Isa isa = GetParam();
  STRATA_SKIP_IF_UNSUPPORTED(isa);
  const std::size_t n = 1024;
  OptimizerConfig c;
  c.lr = 0.0;
  c.weight_decay = 0.0;
  double mean[2] = {0, 0};
  for (int mode = 0; mode < 2; ++mode) {
    std::vector<float> p(n, 0.0f), g(n, 1.0f);
    Buf m(DType::kBF16, n), v(DType::kBF16, n);
    for (int t = 1; t <= 5000; ++t) {
      StepBuffers b;
      b.params = p.data();
      b.grads = g.data();
      b.state[0] = m.data();
      b.state[1] = v.data();
      b.state_dtype = DType::kBF16;
      b.state_rounding = mode == 0 ? StateRounding::kStochastic : StateRounding::kNearest;
      ASSERT_TRUE(step(c, t, b, n, ExecOptions{isa, 1}).ok());
    }
    for (std::size_t i = 0; i < n; ++i) mean[mode] += v.get(i);
    mean[mode] /= n;
  }
  const double want = 1.0 - std::pow(0.999, 5000.0);
  EXPECT_NEAR(mean[0], want, 0.01) << "stochastic rounding: mean v after 5000 steps";
  EXPECT_LT(mean[1], 0.5) << "round to nearest was expected to stall (if it no longer does, revisit the default)";
  std::printf("  mean v after 5000 steps of g = 1: fp32 %.4f, bf16 stochastic %.4f, bf16 nearest %.4f\n", want,
              mean[0], mean[1]);
}

TEST(StochasticRoundingArgs, BadIndexBaseIsRefused) {
  OptimizerConfig c;
  float p = 0, g = 0;
  std::uint16_t m = 0, v = 0;
  StepBuffers b;
  b.state_rounding = StateRounding::kStochastic;  // opt-in (the default is nearest)
  b.params = &p;
  b.grads = &g;
  b.state[0] = &m;
  b.state[1] = &v;
  b.state_dtype = DType::kBF16;
  b.index_base = ~std::uint64_t{0} - 1;
  Status st = step(c, 1, b, 1);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("index_base"), std::string::npos) << st.to_string();
  b.index_base = 0;
  b.state_rounding = static_cast<StateRounding>(9);
  st = step(c, 1, b, 1);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("rounding"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace strata::cpu_optim
