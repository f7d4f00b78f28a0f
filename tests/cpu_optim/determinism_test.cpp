// Bit-identical results for any thread count (1, 2, 3, 7) and on every ISA;
// odd sizes (vector tails) touch nothing past the end.
#include <gtest/gtest.h>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cpu_optim/membw.h"
#include "test_util.h"

namespace strata::cpu_optim {
namespace {

using testing::Buf;
using testing::ValueGen;

struct Variant {
  const char* name;
  OptimizerConfig cfg;
  DType gd, sd;
  bool out;
  DType od;
};

std::vector<Variant> setups() {
  std::vector<Variant> v;
  OptimizerConfig a;
  a.weight_decay = 0.01;
  a.amsgrad = true;
  v.push_back({"adamw_amsgrad_bf16grad_outbf16", a, DType::kBF16, DType::kF32, true, DType::kBF16});
  OptimizerConfig b;
  b.kind = OptimizerKind::kAdam;
  b.weight_decay = 0.01;
  v.push_back({"adam_fp16grad_bf16states_outfp16", b, DType::kF16, DType::kBF16, true, DType::kF16});
  OptimizerConfig l;
  l.kind = OptimizerKind::kLion;
  l.weight_decay = 0.1;
  v.push_back({"lion_fp32", l, DType::kF32, DType::kF32, false, DType::kBF16});
  OptimizerConfig s;
  s.kind = OptimizerKind::kSgd;
  s.momentum = 0.9;
  s.nesterov = true;
  v.push_back({"sgd_nesterov_bf16states", s, DType::kF32, DType::kBF16, true, DType::kBF16});
  OptimizerConfig g;
  g.kind = OptimizerKind::kAdagrad;
  v.push_back({"adagrad_bf16grad", g, DType::kBF16, DType::kF32, false, DType::kBF16});
  return v;
}

// Buffers with `pad` canary bytes after the last element of each.
struct Bufs {
  std::vector<float> p;
  Buf g, s[3], out;
  static constexpr std::size_t kPad = 64;
  Bufs(const Variant& su, std::size_t n, std::uint64_t seed) {
    ValueGen gen(seed);
    p.resize(n + kPad);
    g = Buf(su.gd, n + kPad);
    for (int k = 0; k < 3; ++k) s[k] = Buf(su.sd, n + kPad);
    out = Buf(su.od, n + kPad);
    for (std::size_t i = 0; i < n + kPad; ++i) {
      p[i] = i < n ? gen(DType::kF32) : 1234.5f;
      g.set(i, i < n ? gen(su.gd) : 77.0f);
      for (int k = 0; k < 3; ++k) s[k].set(i, i < n ? std::fabs(gen(su.sd)) : 55.0f);
      out.set(i, 99.0f);
    }
  }
  StepBuffers buffers(const Variant& su) {
    StepBuffers b;
    b.params = p.data();
    b.grads = g.data();
    b.grad_dtype = su.gd;
    for (int k = 0; k < state_count(su.cfg); ++k) b.state[k] = s[k].data();
    b.state_dtype = su.sd;
    if (su.out) {
      b.params_out = out.data();
      b.out_dtype = su.od;
    }
    return b;
  }
  bool operator==(const Bufs& o) const {
    if (p.size() != o.p.size()) return false;
    for (std::size_t i = 0; i < p.size(); ++i)
      if (!testing::same_bits_or_both_nan(p[i], o.p[i])) return false;
    return g.bytes == o.g.bytes && s[0].bytes == o.s[0].bytes && s[1].bytes == o.s[1].bytes &&
           s[2].bytes == o.s[2].bytes && out.bytes == o.out.bytes;
  }
  void expect_canaries(std::size_t n, const std::string& what) const {
    for (std::size_t i = n; i < n + kPad; ++i) {
      ASSERT_EQ(p[i], 1234.5f) << what << ": params written past the end at " << i;
      ASSERT_EQ(g.get(i), 77.0f) << what << ": grads written at " << i;
      for (int k = 0; k < 3; ++k) ASSERT_EQ(s[k].get(i), 55.0f) << what << ": state[" << k << "] past the end at " << i;
      ASSERT_EQ(out.get(i), 99.0f) << what << ": params_out past the end at " << i;
    }
  }
};

class Determinism : public ::testing::TestWithParam<Isa> {};

// Several blocks (detail::kStepBlock elements each) plus a ragged end, so
// different thread counts split the work differently.
TEST_P(Determinism, BitIdenticalAcrossThreadCounts) {
  const Isa isa = GetParam();
  STRATA_SKIP_IF_UNSUPPORTED(isa);
  const std::size_t n = 3 * detail::kStepBlock + 1237;
  for (const Variant& su : setups()) {
    Bufs base(su, n, 42);
    for (int t = 1; t <= 3; ++t) ASSERT_TRUE(step(su.cfg, t, base.buffers(su), n, ExecOptions{isa, 1}).ok());
    for (int threads : {2, 3, 7}) {
      Bufs r(su, n, 42);
      for (int t = 1; t <= 3; ++t) ASSERT_TRUE(step(su.cfg, t, r.buffers(su), n, ExecOptions{isa, threads}).ok());
      EXPECT_TRUE(r == base) << su.name << " on " << isa_name(isa) << ": " << threads
                             << " threads differ from 1 thread";
    }
    // And the same bits as the scalar path.
    Bufs sc(su, n, 42);
    for (int t = 1; t <= 3; ++t) ASSERT_TRUE(step(su.cfg, t, sc.buffers(su), n, ExecOptions{Isa::kScalar, 2}).ok());
    EXPECT_TRUE(sc == base) << su.name << ": " << isa_name(isa) << " differs from scalar";
  }
}

#if defined(__x86_64__)
// The caller's floating-point mode (flush to zero, denormals as zero: what
// torch.set_flush_denormal(True) sets) holds on every worker thread: the
// cached arena's threads kept the mode of whoever ran them first, so 2
// threads flushed denormals the caller kept, or the other way round.
TEST(DeterminismFp, WorkersTakeTheCallersFloatingPointMode) {
  const std::size_t n = 4 * detail::kStepBlock;
  OptimizerConfig c;
  c.kind = OptimizerKind::kSgd;
  c.lr = 0.5;
  auto run = [&](int threads) {
    std::vector<float> p(n, 3e-39f), g(n, 1e-39f);
    StepBuffers b;
    b.params = p.data();
    b.grads = g.data();
    EXPECT_TRUE(step(c, 1, b, n, ExecOptions{Isa::kAuto, threads}).ok());
    return p;
  };
  const unsigned saved = _mm_getcsr();
  const std::vector<float> kept = run(2);  // the 2-thread arena first runs without flushing
  ASSERT_NE(kept[n - 1], 0.0f);           // 3e-39 - 0.5e-39: a denormal, kept
  _mm_setcsr(saved | 0x8040);              // FTZ | DAZ
  const std::vector<float> one = run(1), two = run(2);
  _mm_setcsr(saved);
  EXPECT_EQ(one[n - 1], 0.0f);
  EXPECT_EQ(std::memcmp(one.data(), two.data(), n * sizeof(float)), 0) << "2 threads ignored the caller's FTZ/DAZ";
  EXPECT_EQ(std::memcmp(run(2).data(), kept.data(), n * sizeof(float)), 0) << "the workers kept FTZ/DAZ";
}
#endif

TEST_P(Determinism, OddSizesStayInBounds) {
  const Isa isa = GetParam();
  STRATA_SKIP_IF_UNSUPPORTED(isa);
  const std::vector<std::size_t> sizes = {1,  2,  3,  5,   7,    8,    9,    15,   16,    17,   31,
                                          33, 63, 65, 127, 1023, 1025, 4097, 32767, 32769, 65537};
  for (const Variant& su : setups()) {
    for (std::size_t n : sizes) {
      const std::string what = std::string(su.name) + " n=" + std::to_string(n) + " " + isa_name(isa);
      Bufs r(su, n, n), sc(su, n, n);
      for (int t = 1; t <= 2; ++t) {
        ASSERT_TRUE(step(su.cfg, t, r.buffers(su), n, ExecOptions{isa, 2}).ok()) << what;
        ASSERT_TRUE(step(su.cfg, t, sc.buffers(su), n, ExecOptions{Isa::kScalar, 1}).ok()) << what;
      }
      r.expect_canaries(n, what);
      EXPECT_TRUE(r == sc) << what << ": differs from the scalar path";
    }
  }
}

// A 64-byte aligned params_out takes the non-temporal store path; the bits
// must be the same as with plain stores (scalar) and as convert().
TEST_P(Determinism, AlignedOutputTakesStreamingPathWithSameBits) {
  const Isa isa = GetParam();
  STRATA_SKIP_IF_UNSUPPORTED(isa);
  const std::size_t n = 2 * detail::kStepBlock + 77;
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  auto alloc = [](std::size_t bytes) { return std::unique_ptr<void, Free>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)); };
  for (DType od : {DType::kBF16, DType::kF16}) {
    auto p = alloc(n * 4), g = alloc(n * 4), m = alloc(n * 4), v = alloc(n * 4), out = alloc(n * 2), want = alloc(n * 2);
    ValueGen gen(9);
    auto* pf = static_cast<float*>(p.get());
    auto* gf = static_cast<float*>(g.get());
    for (std::size_t i = 0; i < n; ++i) {
      pf[i] = gen(DType::kF32);
      gf[i] = gen(DType::kF32);
    }
    std::memset(m.get(), 0, n * 4);
    std::memset(v.get(), 0, n * 4);
    OptimizerConfig c;
    StepBuffers b;
    b.params = pf;
    b.grads = gf;
    b.state[0] = m.get();
    b.state[1] = v.get();
    b.params_out = out.get();
    b.out_dtype = od;
    ASSERT_TRUE(step(c, 1, b, n, ExecOptions{isa, 3}).ok());
    ASSERT_TRUE(convert(pf, want.get(), od, n, ExecOptions{Isa::kScalar, 1}).ok());
    EXPECT_EQ(std::memcmp(out.get(), want.get(), n * 2), 0) << dtype_name(od) << " on " << isa_name(isa);
  }
}

TEST_P(Determinism, MembwKernel) {
  const Isa isa = GetParam();
  STRATA_SKIP_IF_UNSUPPORTED(isa);
  for (std::size_t n : {std::size_t{1}, std::size_t{17}, std::size_t{1000}, 2 * detail::kStepBlock + 3}) {
    std::vector<float> b(n + 8, 1.0f), c(n + 8, 2.0f);
    for (std::size_t i = 0; i < n; ++i) b[i] = 0.5f * float(i % 13);
    std::vector<float> want = b;
    for (std::size_t i = 0; i < n; ++i) want[i] = std::fma(0.25f, c[i], b[i]);
    ASSERT_TRUE(membw_rmw(b.data(), c.data(), 0.25f, n, ExecOptions{isa, 3}).ok());
    EXPECT_EQ(std::memcmp(b.data(), want.data(), b.size() * 4), 0) << "n=" << n;
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, Determinism, ::testing::ValuesIn(testing::all_isas()), testing::isa_param_name);

}  // namespace
}  // namespace strata::cpu_optim
