// CpuOps (the float ops the trainer runs): bitwise determinism across thread
// counts, bf16/fp16 weights, agreement with the double kernels, every GEMM
// ISA build against a double reference, and errors on bad input.
#include <gtest/gtest.h>
#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <cmath>
#include <random>
#include <vector>

#include "cpu_optim/dispatch.h"
#include "ops_test_util.h"
#include "small_model.h"
#include "train/cpu_kernels.h"
#include "train/cpu_ops.h"

namespace strata::train {

namespace cpu {
// The per-ISA float GEMMs (src/train/cpu_gemm*.cpp), called directly here so
// that every build is checked on a machine that runs it.
void gemm_f32_avx2(bool, bool, int64_t, int64_t, int64_t, const float*, int64_t, const float*,
                   int64_t, float*, int64_t, bool);
void gemm_f32_avx512(bool, bool, int64_t, int64_t, int64_t, const float*, int64_t, const float*,
                     int64_t, float*, int64_t, bool);
}  // namespace cpu

namespace {

using testing::DeviceCopy;
using testing::HostModel;
using testing::random_vec;
using testing::run_step;
using testing::StepResult;

LlamaDims mid_dims(bool tied) { return testing::small_dims(/*ffn_dim=*/160, /*vocab=*/300, tied); }

std::unique_ptr<ModelOps> make_ops(const LlamaDims& d, int64_t B, int64_t T, int threads) {
  auto r = create_cpu_ops({.dims = d, .max_batch = B, .max_seq = T, .threads = threads});
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? std::move(*r) : nullptr;
}

struct Batch {
  std::vector<int32_t> tokens, targets;
  std::vector<uint8_t> mask;
};

Batch make_batch(std::mt19937_64& rng, int64_t n, int64_t vocab) {
  Batch b;
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(vocab - 1));
  for (int64_t i = 0; i < n; ++i) {
    b.tokens.push_back(tok(rng));
    b.targets.push_back(i % 11 == 3 ? -100 : tok(rng));
    b.mask.push_back(i % 7 == 5 ? 0 : 1);
  }
  return b;
}

void expect_same_bits(const StepResult& a, const StepResult& b, const char* what) {
  EXPECT_EQ(a.loss.sum, b.loss.sum) << what;
  EXPECT_EQ(a.loss.count, b.loss.count) << what;
  EXPECT_EQ(a.logits, b.logits) << what;
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_EQ(a.grads[i], b.grads[i]) << what << " tensor " << i;
}

class CpuOpsDeterminism : public ::testing::TestWithParam<bool> {};

// B*T = 160 tokens: 3 row blocks, 5 output-feature blocks of the FFN, 2
// chunks-worth of vocab blocks, so every parallel loop has several tasks.
TEST_P(CpuOpsDeterminism, BitwiseAcrossThreadCounts) {
  const bool tied = GetParam();
  // Let arenas of 2 and 3 threads really have them on a small machine
  // (TBB caps workers at the core count by default).
  tbb::global_control allow(tbb::global_control::max_allowed_parallelism, 4);
  std::mt19937_64 rng(21);
  const LlamaDims d = mid_dims(tied);
  const int64_t B = 2, T = 80;
  HostModel m;
  m.init(rng, d, 2, 0.1);
  const Batch batch = make_batch(rng, B * T, d.vocab);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    DeviceCopy w;
    w.make(m, dt);
    StepResult ref;
    {
      auto ops = make_ops(d, B, T, 1);
      ASSERT_TRUE(ops);
      run_step(*ops, m, w, batch.tokens, batch.targets, batch.mask.data(), B, T, &ref);
    }
    EXPECT_GT(ref.loss.count, 0);
    EXPECT_TRUE(std::isfinite(ref.loss.mean()));
    for (int threads : {2, 3}) {
      auto ops = make_ops(d, B, T, threads);
      ASSERT_TRUE(ops);
      StepResult r;
      run_step(*ops, m, w, batch.tokens, batch.targets, batch.mask.data(), B, T, &r);
      expect_same_bits(ref, r, dt == DType::kF32 ? "fp32" : "bf16");
      // And the same object again (no state leaks between calls).
      StepResult again;
      run_step(*ops, m, w, batch.tokens, batch.targets, batch.mask.data(), B, T, &again);
      expect_same_bits(r, again, "repeat");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Tied, CpuOpsDeterminism, ::testing::Bool());

// bf16 weights are converted exactly: the result equals fp32 weights that
// hold the bf16-rounded values, bit for bit. Smaller batches than the
// workspace are fine.
TEST(CpuOps, Bf16WeightsConvertExactly) {
  std::mt19937_64 rng(22);
  const LlamaDims d = mid_dims(false);
  HostModel m;
  m.init(rng, d, 1, 0.1);
  m.round_to_bf16();
  const int64_t B = 1, T = 33;
  const Batch batch = make_batch(rng, B * T, d.vocab);
  auto ops = make_ops(d, 3, 40, 0);
  DeviceCopy w32, w16;
  w32.make(m, DType::kF32);
  w16.make(m, DType::kBF16);
  StepResult a, b;
  run_step(*ops, m, w32, batch.tokens, batch.targets, nullptr, B, T, &a);
  run_step(*ops, m, w16, batch.tokens, batch.targets, nullptr, B, T, &b);
  expect_same_bits(a, b, "bf16 vs rounded fp32");
}

template <typename A, typename B>
double max_rel_diff(const A& a, const B& b) {
  double mx = 0, md = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    mx = std::max(mx, std::abs(static_cast<double>(b[i])));
    md = std::max(md, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  }
  return mx > 0 ? md / mx : md;
}

// The float ops against the double kernels on the same weights: fp32
// rounding only. Tolerance: max |float - double| <= 2e-5 * max |double| per
// tensor (measured ~1e-6; fp32 epsilon is 1.2e-7 and sums run to ~10^3 terms).
TEST(CpuOps, FloatMatchesDouble) {
  std::mt19937_64 rng(23);
  const LlamaDims d = mid_dims(false);
  const int64_t B = 2, T = 40, n = B * T, D = d.dim;
  HostModel m;
  m.init(rng, d, 1, 0.1);
  auto ops = make_ops(d, B, T, 0);
  DeviceCopy w;
  w.make(m, DType::kF32);
  std::vector<float> x = random_vec<float>(rng, n * D), dy = random_vec<float>(rng, n * D);
  std::vector<float> y(n * D), dx(n * D);
  testing::LayerBlob<float> g;
  g.zeros_like(m.layer[0]);
  ASSERT_TRUE(ops->layer_forward(w.layer(0), B, T, x.data(), y.data()).ok());
  ASSERT_TRUE(ops->layer_backward(w.layer(0), B, T, x.data(), dy.data(), dx.data(), g.grads()).ok());

  auto to_d = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
  testing::LayerBlob<double> wd, gd;
  for (LayerTensor t : kAllLayerTensors) wd[t] = to_d(m.layer[0][t]);
  gd.zeros_like(wd);
  cpu::LayerMath<double> layer(d, n, T, tbb::this_task_arena::max_concurrency());
  std::vector<double> xd = to_d(x), dyd = to_d(dy), yd(n * D), dxd(n * D);
  layer.forward(wd.params(), xd.data(), yd.data(), B, T);
  layer.backward(wd.params(), xd.data(), dyd.data(), dxd.data(), gd.grads(), B, T);
  EXPECT_LT(max_rel_diff(y, yd), 2e-5);
  EXPECT_LT(max_rel_diff(dx, dxd), 2e-5);
  for (LayerTensor t : kAllLayerTensors) EXPECT_LT(max_rel_diff(g[t], gd[t]), 2e-5) << testing::label(t);
}

// Every GEMM build this CPU runs, all four transpose cases, odd sizes and
// strides, overwrite and accumulate, against a double reference. Tolerance
// 1e-5 relative to the sum of |products| (k = 300 fp32 terms).
TEST(CpuOps, GemmEveryIsaMatchesReference) {
  using Fn = void (*)(bool, bool, int64_t, int64_t, int64_t, const float*, int64_t, const float*,
                      int64_t, float*, int64_t, bool);
  std::vector<std::pair<const char*, Fn>> fns = {{"dispatched", &cpu::gemm<float>}};
  const auto& f = cpu_optim::cpu_features();
  if (f.avx2 && f.fma && f.f16c) fns.push_back({"avx2", &cpu::gemm_f32_avx2});
  if (f.avx512f && f.avx512bw && f.avx512vl && f.avx2 && f.fma) fns.push_back({"avx512", &cpu::gemm_f32_avx512});
  std::printf("float GEMM dispatched to: %s\n", cpu::gemm_isa());
  std::mt19937_64 rng(24);
  const int64_t m = 37, n = 45, k = 300;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (bool acc : {false, true}) {
        const int64_t lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 5, ldc = n + 2;
        auto a = random_vec<float>(rng, (ta ? k : m) * lda), b = random_vec<float>(rng, (tb ? n : k) * ldb);
        auto c0 = random_vec<float>(rng, m * ldc);
        for (auto& [name, fn] : fns) {
          auto c = c0;
          fn(ta, tb, m, n, k, a.data(), lda, b.data(), ldb, c.data(), ldc, acc);
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) {
              double s = acc ? c0[i * ldc + j] : 0.0, mag = std::abs(s);
              for (int64_t p = 0; p < k; ++p) {
                const double av = ta ? a[p * lda + i] : a[i * lda + p];
                const double bv = tb ? b[j * ldb + p] : b[p * ldb + j];
                s += av * bv;
                mag += std::abs(av * bv);
              }
              ASSERT_NEAR(c[i * ldc + j], s, 1e-5 * mag) << name << " ta=" << ta << " tb=" << tb << " acc=" << acc;
            }
          // The padding columns are untouched.
          for (int64_t i = 0; i < m; ++i) ASSERT_EQ(c[i * ldc + n], c0[i * ldc + n]) << name;
        }
      }
}

TEST(CpuOps, RejectsBadInput) {
  const LlamaDims d = mid_dims(false);
  std::mt19937_64 rng(25);
  HostModel m;
  m.init(rng, d, 1, 0.1);
  DeviceCopy w;
  w.make(m, DType::kF32);
  auto ops = make_ops(d, 2, 16, 1);
  std::vector<int32_t> tok(32, 1);
  std::vector<float> x(32 * d.dim), y(32 * d.dim), logits(32 * d.vocab);
  EXPECT_TRUE(ops->embed_forward(w.embed(), tok.data(), 2, 16, x.data()).ok());
  // Shapes beyond the workspace.
  EXPECT_EQ(ops->embed_forward(w.embed(), tok.data(), 1, 17, x.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ops->layer_forward(w.layer(0), 3, 16, x.data(), y.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ops->layer_forward(w.layer(0), 0, 16, x.data(), y.data()).code(), StatusCode::kInvalidArgument);
  // Token ids outside the vocabulary, naming the position.
  tok[5] = static_cast<int32_t>(d.vocab);
  Status st = ops->embed_forward(w.embed(), tok.data(), 2, 16, x.data());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("position 5"), std::string::npos) << st.message();
  tok[5] = -1;
  EXPECT_EQ(ops->embed_forward(w.embed(), tok.data(), 2, 16, x.data()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ops->embed_backward(tok.data(), 2, 16, x.data(), y.data(), false).code(), StatusCode::kInvalidArgument);
  // Targets: negative is "ignore", >= vocab is an error.
  std::vector<int32_t> tgt(32, -100);
  LossStats loss;
  EXPECT_TRUE(ops->head_loss(w.head(m), x.data(), tgt.data(), nullptr, 2, 16, &loss).ok());
  EXPECT_EQ(loss.count, 0);
  tgt[31] = static_cast<int32_t>(d.vocab + 3);
  EXPECT_EQ(ops->head_loss(w.head(m), x.data(), tgt.data(), nullptr, 2, 16, &loss).code(), StatusCode::kInvalidArgument);
  // Null pointers, a bad dtype, dx aliasing x in the head.
  LayerWeights lw = w.layer(0);
  lw[kVProj] = nullptr;
  EXPECT_EQ(ops->layer_forward(lw, 1, 16, x.data(), y.data()).code(), StatusCode::kInvalidArgument);
  lw = w.layer(0);
  lw.dtype = static_cast<DType>(9);
  EXPECT_EQ(ops->layer_forward(lw, 1, 16, x.data(), y.data()).code(), StatusCode::kInvalidArgument);
  tgt[31] = 0;
  std::vector<float> gn(d.dim), gl(d.vocab * d.dim);
  EXPECT_EQ(ops->head_forward_backward(w.head(m), x.data(), tgt.data(), nullptr, 2, 16, 1.0f, &loss,
                                       x.data(), {.norm = gn.data(), .lm_head = gl.data()})
                .code(),
            StatusCode::kInvalidArgument);
  // Bad dims and sizes at creation.
  LlamaDims bad = d;
  bad.kv_heads = 3;
  EXPECT_EQ(create_cpu_ops({.dims = bad, .max_batch = 1, .max_seq = 4}).status().code(), StatusCode::kInvalidArgument);
  bad = d;
  bad.head_dim = 15;
  EXPECT_EQ(bad.validate().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(create_cpu_ops({.dims = d, .max_batch = 0, .max_seq = 4}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::train
