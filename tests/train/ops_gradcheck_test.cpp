// Gradient checks of every CPU train op against central finite differences,
// in double precision (the same templated kernels the float ops run).
// Each test defines a scalar f = sum(r * op(inputs)) with a random r (or the
// loss itself), computes the analytic gradient with the op's backward and
// compares it for every element with (f(p + h) - f(p - h)) / 2h, h = 1e-5;
// tolerance |a - n| <= 1e-9 + 1e-6 * max(|a|, |n|) (see ops_test_util.h).
#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include <random>
#include <vector>

#include "ops_test_util.h"
#include "small_model.h"
#include "train/cpu_kernels.h"

namespace strata::train {
namespace {

using testing::check_grad;
using testing::dot;
using testing::LayerBlob;
using testing::random_vec;
using testing::tiny_dims;
using V = std::vector<double>;

int slots() { return tbb::this_task_arena::max_concurrency(); }

TEST(OpsGradCheck, Linear) {
  std::mt19937_64 rng(1);
  // n = 70 > kRowBlock and out = 66 > kRowBlock: several blocks both ways.
  const int64_t n = 70, in = 9, out = 66;
  V x = random_vec<double>(rng, n * in), w = random_vec<double>(rng, out * in);
  V r = random_vec<double>(rng, n * out), y(n * out);
  auto f = [&] {
    cpu::linear_forward(x.data(), w.data(), y.data(), n, in, out);
    return dot(r, y);
  };
  V dx(n * in), dw(out * in, 123.0);  // dw is overwritten, not accumulated
  cpu::linear_backward_input(r.data(), w.data(), dx.data(), n, in, out, false);
  cpu::linear_backward_weight(r.data(), x.data(), dw.data(), n, in, out);
  STRATA_CHECK_GRAD("linear dx", x, dx, f);
  STRATA_CHECK_GRAD("linear dw", w, dw, f);
  // accumulate = true adds to what is there.
  V dx2(n * in, 1.0);
  cpu::linear_backward_input(r.data(), w.data(), dx2.data(), n, in, out, true);
  for (int64_t i = 0; i < n * in; ++i) EXPECT_NEAR(dx2[i] - 1.0, dx[i], 1e-12);
}

TEST(OpsGradCheck, RmsNorm) {
  std::mt19937_64 rng(2);
  const int64_t n = 67, d = 70;
  const double eps = 1e-5;
  V x = random_vec<double>(rng, n * d), w = random_vec<double>(rng, d, 0.2, 1.0);
  V r = random_vec<double>(rng, n * d), y(n * d), rstd(n);
  auto f = [&] {
    cpu::rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), n, d, eps);
    return dot(r, y);
  };
  f();
  V dx(n * d, 7.0), dw(d, 7.0);
  cpu::rmsnorm_backward(x.data(), w.data(), rstd.data(), r.data(), dx.data(), dw.data(), n, d,
                        false);
  STRATA_CHECK_GRAD("rmsnorm dx", x, dx, f);
  STRATA_CHECK_GRAD("rmsnorm dw", w, dw, f);
  // The forward itself: y = w * x / sqrt(mean(x^2) + eps).
  f();
  for (int64_t i = 0; i < n; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += x[i * d + j] * x[i * d + j];
    const double rs = 1 / std::sqrt(ss / d + eps);
    for (int64_t j = 0; j < d; ++j) ASSERT_NEAR(y[i * d + j], w[j] * x[i * d + j] * rs, 1e-12);
  }
}

TEST(OpsGradCheck, Rope) {
  std::mt19937_64 rng(3);
  const int64_t B = 2, T = 5, heads = 3, hd = 8, n = B * T, width = heads * hd;
  cpu::RopeTable<double> table;
  table.init(T, hd, 10000.0);
  V x = random_vec<double>(rng, n * width), r = random_vec<double>(rng, n * width), y;
  auto f = [&] {
    y = x;
    cpu::rope_apply(y.data(), n, T, heads, hd, table, false);
    return dot(r, y);
  };
  V dx = r;
  cpu::rope_apply(dx.data(), n, T, heads, hd, table, true);
  STRATA_CHECK_GRAD("rope dx", x, dx, f);
  // Position 0 is the identity; the rotation pairs i with i + hd/2 at angle
  // pos * theta^(-2i/hd).
  f();
  for (int64_t j = 0; j < width; ++j) EXPECT_NEAR(y[j], x[j], 1e-15);
  const int64_t pos = 3, row = 1 * T + pos, h = 2, i = 1;
  const double ang = static_cast<double>(static_cast<float>(pos) *
                                         static_cast<float>(std::pow(10000.0, -2.0 * i / hd)));
  const double a = x[row * width + h * hd + i], b = x[row * width + h * hd + i + hd / 2];
  EXPECT_NEAR(y[row * width + h * hd + i], a * std::cos(ang) - b * std::sin(ang), 1e-7);
  EXPECT_NEAR(y[row * width + h * hd + i + hd / 2], b * std::cos(ang) + a * std::sin(ang), 1e-7);
}

struct AttnCase {
  int64_t heads, kv_heads;
};
class OpsGradCheckAttention : public ::testing::TestWithParam<AttnCase> {};

TEST_P(OpsGradCheckAttention, GroupedQueryCausal) {
  const auto [H, KV] = GetParam();
  std::mt19937_64 rng(4 + H * 10 + KV);
  const int64_t B = 2, T = 7, hd = 6, n = B * T;
  cpu::AttnScratch<double> scratch;
  scratch.init(slots(), hd);
  V q = random_vec<double>(rng, n * H * hd), k = random_vec<double>(rng, n * KV * hd),
    v = random_vec<double>(rng, n * KV * hd), r = random_vec<double>(rng, n * H * hd),
    out(n * H * hd), lse(n * H);
  auto f = [&] {
    cpu::attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), B, T, H, KV, hd,
                           scratch);
    return dot(r, out);
  };
  V dq(q.size(), 5.0), dk(k.size(), 5.0), dv(v.size(), 5.0);
  f();  // out and lse of these inputs
  cpu::attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), r.data(), dq.data(),
                          dk.data(), dv.data(), B, T, H, KV, hd, scratch);
  STRATA_CHECK_GRAD("attention dq", q, dq, f);
  STRATA_CHECK_GRAD("attention dk", k, dk, f);
  STRATA_CHECK_GRAD("attention dv", v, dv, f);
  // Causality: the first token of each sequence attends only to itself, so
  // its output is its own value row (of its kv head).
  f();
  const int64_t group = H / KV;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < hd; ++j)
        EXPECT_NEAR(out[(b * T) * H * hd + h * hd + j], v[(b * T) * KV * hd + (h / group) * hd + j],
                    1e-14);
}

INSTANTIATE_TEST_SUITE_P(Heads, OpsGradCheckAttention,
                         ::testing::Values(AttnCase{4, 2}, AttnCase{4, 4}, AttnCase{4, 1},
                                           AttnCase{6, 3}),
                         [](const auto& info) {
                           return "heads" + std::to_string(info.param.heads) + "_kv" +
                                  std::to_string(info.param.kv_heads);
                         });

TEST(OpsGradCheck, SwiGlu) {
  std::mt19937_64 rng(5);
  const int64_t count = 50;
  V g = random_vec<double>(rng, count, 2.0), u = random_vec<double>(rng, count),
    r = random_vec<double>(rng, count), a(count);
  auto f = [&] {
    cpu::swiglu_forward(g.data(), u.data(), a.data(), count);
    return dot(r, a);
  };
  V dg(count), du(count);
  cpu::swiglu_backward(g.data(), u.data(), r.data(), dg.data(), du.data(), count);
  STRATA_CHECK_GRAD("swiglu dg", g, dg, f);
  STRATA_CHECK_GRAD("swiglu du", u, du, f);
  // du may alias da.
  V da = r, dg2(count);
  cpu::swiglu_backward(g.data(), u.data(), da.data(), dg2.data(), da.data(), count);
  EXPECT_EQ(dg2, dg);
  EXPECT_EQ(da, du);
}

TEST(OpsGradCheck, Embedding) {
  std::mt19937_64 rng(6);
  const int64_t vocab = 11, d = 70, n = 9;
  const std::vector<int32_t> tokens = {3, 0, 3, 10, 7, 3, 0, 5, 10};  // repeats on purpose
  V table = random_vec<double>(rng, vocab * d), r = random_vec<double>(rng, n * d), x(n * d);
  auto f = [&] {
    cpu::embed_forward(table.data(), tokens.data(), x.data(), n, d);
    return dot(r, x);
  };
  V grad(vocab * d, 9.0);
  cpu::embed_backward(tokens.data(), r.data(), grad.data(), n, d, vocab, false);
  STRATA_CHECK_GRAD("embedding dtable", table, grad, f);
  // accumulate = true adds (tied embeddings add the head's gradient).
  V acc(vocab * d, 1.0);
  cpu::embed_backward(tokens.data(), r.data(), acc.data(), n, d, vocab, true);
  for (int64_t i = 0; i < vocab * d; ++i) EXPECT_NEAR(acc[i] - 1.0, grad[i], 1e-12);
}

TEST(OpsGradCheck, CrossEntropyMasked) {
  std::mt19937_64 rng(7);
  const int64_t n = 9, vocab = 11;
  const std::vector<int32_t> targets = {1, -100, 10, 0, 4, -100, 7, 7, 2};
  const std::vector<uint8_t> mask = {1, 1, 1, 0, 1, 1, 1, 0, 1};
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) count += cpu::ce_counts(targets.data(), mask.data(), i);
  ASSERT_EQ(count, 5);
  V logits = random_vec<double>(rng, n * vocab, 3.0);
  std::vector<double> row_loss(n);
  auto f = [&] {
    V tmp = logits;
    cpu::cross_entropy_rows(tmp.data(), targets.data(), mask.data(), n, vocab, false, 0.0,
                            row_loss.data());
    double s = 0;
    for (double l : row_loss) s += l;
    return s / static_cast<double>(count);
  };
  // Loss against a direct log-softmax.
  f();
  for (int64_t i = 0; i < n; ++i) {
    if (!cpu::ce_counts(targets.data(), mask.data(), i)) {
      EXPECT_EQ(row_loss[i], 0.0);
      continue;
    }
    double mx = -1e300, s = 0;
    for (int64_t j = 0; j < vocab; ++j) mx = std::max(mx, logits[i * vocab + j]);
    for (int64_t j = 0; j < vocab; ++j) s += std::exp(logits[i * vocab + j] - mx);
    EXPECT_NEAR(row_loss[i], mx + std::log(s) - logits[i * vocab + targets[i]], 1e-12);
  }
  V grad = logits;
  cpu::cross_entropy_rows(grad.data(), targets.data(), mask.data(), n, vocab, true,
                          1.0 / static_cast<double>(count), row_loss.data());
  STRATA_CHECK_GRAD("cross-entropy dlogits", logits, grad, f);
}

// Qwen2's q/k/v biases and Qwen3's per-head q/k norms with a head_dim that
// is not dim / heads: every gradient, biases and norm weights included,
// against central differences.
TEST(OpsGradCheck, WholeLayerWithBiasesQkNormsAndAnExplicitHeadDim) {
  for (int variant = 0; variant < 2; ++variant) {
    SCOPED_TRACE(variant == 0 ? "qwen2: q/k/v biases" : "qwen3: q/k norms, head_dim 6");
    std::mt19937_64 rng(19 + variant);
    LlamaDims dims = tiny_dims();
    if (variant == 0) {
      dims.qkv_bias = true;
    } else {
      dims.qk_norm = true;
      dims.head_dim = 6;  // q_dim 24 != dim 16
    }
    const int64_t B = 2, T = 5, n = B * T;
    cpu::LayerMath<double> layer(dims, n, T, slots());
    LayerBlob<double> w, gw;
    w.init(rng, dims, 0.3);
    V x = random_vec<double>(rng, n * dims.dim), r = random_vec<double>(rng, n * dims.dim), y(n * dims.dim);
    auto f = [&] {
      layer.forward(w.params(), x.data(), y.data(), B, T);
      return dot(r, y);
    };
    gw.zeros_like(w);
    V dx(n * dims.dim);
    layer.backward(w.params(), x.data(), r.data(), dx.data(), gw.grads(), B, T);
    STRATA_CHECK_GRAD("layer dx", x, dx, f);
    int extra = 0;
    for (LayerTensor t : kAllLayerTensors) {
      if (!dims.has(t)) continue;
      if (static_cast<int>(t) >= kBaseLayerTensorCount) ++extra;
      STRATA_CHECK_GRAD("layer d" + testing::label(t), w[t], gw[t], f);
    }
    EXPECT_EQ(extra, variant == 0 ? 3 : 2);
  }
}

// LoRA adapters on all seven projections (random A and B, so every path
// matters), with and without dropout (a fixed seed: the same mask in the
// forward and the backward's recomputation), the base frozen (null
// gradients: not computed, buffers untouched) or trained.
TEST(OpsGradCheck, WholeLayerWithLoraAdapters) {
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(variant == 0 ? "lora, base trained" : variant == 1 ? "lora, base frozen" : "lora + dropout, base frozen, qwen2");
    std::mt19937_64 rng(31 + variant);
    LlamaDims dims = tiny_dims();
    dims.lora_targets = kAllLoraTargets;
    dims.lora_rank = 3;
    dims.lora_scaling = 1.7f;
    if (variant == 2) {
      dims.lora_dropout = 0.3f;
      dims.qkv_bias = true;
    }
    const cpu::LoraDropout dr{variant == 2, 0x5eed, 7};
    const int64_t B = 2, T = 5, n = B * T;
    cpu::LayerMath<double> layer(dims, n, T, slots());
    LayerBlob<double> w, gw;
    w.init(rng, dims, 0.3);
    V x = random_vec<double>(rng, n * dims.dim), r = random_vec<double>(rng, n * dims.dim), y(n * dims.dim);
    auto f = [&] {
      layer.forward(w.params(), x.data(), y.data(), B, T, dr);
      return dot(r, y);
    };
    gw.zeros_like(w);
    cpu::LayerParamGrads<double> g = gw.grads();
    const bool frozen = variant > 0;
    if (frozen)
      for (LayerTensor t : kAllLayerTensors)
        if (weight_row(t).feature != Feature::kLora) g[t] = nullptr;
    V dx(n * dims.dim);
    layer.backward(w.params(), x.data(), r.data(), dx.data(), g, B, T, dr);
    STRATA_CHECK_GRAD("layer dx", x, dx, f);
    int adapters = 0;
    for (LayerTensor t : kAllLayerTensors) {
      if (!dims.has(t)) continue;
      if (weight_row(t).feature == Feature::kLora) ++adapters;
      if (frozen && weight_row(t).feature != Feature::kLora) {
        for (double v : gw[t]) ASSERT_EQ(v, 0.0) << testing::label(t) << ": a frozen tensor's buffer was written";
        continue;
      }
      STRATA_CHECK_GRAD("layer d" + testing::label(t), w[t], gw[t], f);
    }
    EXPECT_EQ(adapters, 14);
    if (variant == 2) {  // dropout changes the output; off (evaluation) it is the plain adapter
      V y_drop(n * dims.dim), y_eval(n * dims.dim);
      layer.forward(w.params(), x.data(), y_drop.data(), B, T, dr);
      layer.forward(w.params(), x.data(), y_eval.data(), B, T, {});
      EXPECT_NE(y_drop, y_eval);
      V y_other(n * dims.dim);
      layer.forward(w.params(), x.data(), y_other.data(), B, T, {true, 0x5eed + 1, 7});
      EXPECT_NE(y_drop, y_other);
      // The masks follow the sequence, not the micro-batch: row b of a batch
      // whose first row is 7 draws as a batch of one whose first row is
      // 7 + b x T (N ranks of batch 1 = one rank of batch N).
      for (int64_t b = 0; b < B; ++b) {
        V y1(T * dims.dim);
        layer.forward(w.params(), x.data() + b * T * dims.dim, y1.data(), 1, T,
                      {true, 0x5eed, 7 + static_cast<uint64_t>(b * T)});
        for (int64_t i = 0; i < T * dims.dim; ++i) ASSERT_NEAR(y1[i], y_drop[b * T * dims.dim + i], 1e-12) << b;
      }
      layer.forward(w.params(), x.data(), y_other.data(), B, T, {true, 0x5eed, 7 + T});
      EXPECT_NE(y_drop, y_other);  // another offset, other masks
    }
  }
}

TEST(OpsGradCheck, WholeLayer) {
  std::mt19937_64 rng(8);
  const LlamaDims dims = tiny_dims();
  const int64_t B = 2, T = 5, n = B * T;
  cpu::LayerMath<double> layer(dims, n, T, slots());
  LayerBlob<double> w, gw;
  w.init(rng, dims, 0.3);
  V x = random_vec<double>(rng, n * dims.dim), r = random_vec<double>(rng, n * dims.dim),
    y(n * dims.dim);
  auto f = [&] {
    layer.forward(w.params(), x.data(), y.data(), B, T);
    return dot(r, y);
  };
  gw.zeros_like(w);
  V dx(n * dims.dim);
  layer.backward(w.params(), x.data(), r.data(), dx.data(), gw.grads(), B, T);
  STRATA_CHECK_GRAD("layer dx", x, dx, f);
  for (LayerTensor t : kAllLayerTensors) STRATA_CHECK_GRAD("layer d" + testing::label(t), w[t], gw[t], f);

  // In place: y may be x, dx may be dy; the results are the same bits.
  f();
  V xy = x;
  layer.forward(w.params(), xy.data(), xy.data(), B, T);
  EXPECT_EQ(xy, y);
  V d_inplace = r;
  LayerBlob<double> gw2;
  gw2.zeros_like(w);
  layer.backward(w.params(), x.data(), d_inplace.data(), d_inplace.data(), gw2.grads(), B, T);
  EXPECT_EQ(d_inplace, dx);
  EXPECT_EQ(gw2[kQProj], gw[kQProj]);
}

TEST(OpsGradCheck, WholeLayerMultiQuery) {
  std::mt19937_64 rng(9);
  const LlamaDims dims = tiny_dims(/*kv_heads=*/1);
  const int64_t B = 1, T = 6, n = B * T;
  cpu::LayerMath<double> layer(dims, n, T, slots());
  LayerBlob<double> w, gw;
  w.init(rng, dims, 0.3);
  gw.zeros_like(w);
  V x = random_vec<double>(rng, n * dims.dim), r = random_vec<double>(rng, n * dims.dim),
    y(n * dims.dim), dx(n * dims.dim);
  auto f = [&] {
    layer.forward(w.params(), x.data(), y.data(), B, T);
    return dot(r, y);
  };
  layer.backward(w.params(), x.data(), r.data(), dx.data(), gw.grads(), B, T);
  STRATA_CHECK_GRAD("mqa layer dx", x, dx, f);
  STRATA_CHECK_GRAD("mqa layer dk", w[kKProj], gw[kKProj], f);
  STRATA_CHECK_GRAD("mqa layer dv", w[kVProj], gw[kVProj], f);
  STRATA_CHECK_GRAD("mqa layer dq", w[kQProj], gw[kQProj], f);
}

TEST(OpsGradCheck, HeadChunkedMasked) {
  std::mt19937_64 rng(10);
  const LlamaDims dims = tiny_dims();
  const int64_t n = 10;
  // Chunks of 3 rows: 4 chunks, the last one short.
  cpu::HeadMath<double> head(dims, n, /*chunk_rows=*/3);
  ASSERT_EQ(head.chunk_rows(), 3);
  V norm = random_vec<double>(rng, dims.dim, 0.1, 1.0),
    lm = random_vec<double>(rng, dims.vocab * dims.dim, 0.5), x = random_vec<double>(rng, n * dims.dim);
  const std::vector<int32_t> targets = {5, 22, -100, 0, 3, 3, -100, 17, 9, 1};
  const std::vector<uint8_t> mask = {1, 1, 1, 1, 0, 1, 1, 1, 1, 1};
  const double dloss = 1.7;
  LossStats loss;
  auto f = [&] {
    LossStats l;
    head.run(norm.data(), lm.data(), x.data(), targets.data(), mask.data(), n, 0.0, &l, nullptr,
             nullptr, nullptr);
    return dloss * l.mean();
  };
  V dx(n * dims.dim), dnorm(dims.dim), dlm(lm.size(), 3.0);
  head.run(norm.data(), lm.data(), x.data(), targets.data(), mask.data(), n, dloss, &loss, dx.data(),
           dnorm.data(), dlm.data());
  EXPECT_EQ(loss.count, 7);
  EXPECT_NEAR(dloss * loss.mean(), f(), 1e-14);
  STRATA_CHECK_GRAD("head dx", x, dx, f);
  STRATA_CHECK_GRAD("head dnorm", norm, dnorm, f);
  STRATA_CHECK_GRAD("head dlm_head", lm, dlm, f);

  // The same with one chunk gives the same loss (to rounding: the chunks
  // change only the order of the lm_head gradient's sum).
  cpu::HeadMath<double> one(dims, n);
  ASSERT_EQ(one.chunk_rows(), n);
  V dx1(n * dims.dim), dnorm1(dims.dim), dlm1(lm.size());
  LossStats loss1;
  one.run(norm.data(), lm.data(), x.data(), targets.data(), mask.data(), n, dloss, &loss1,
          dx1.data(), dnorm1.data(), dlm1.data());
  EXPECT_EQ(loss1.sum, loss.sum);
  for (size_t i = 0; i < dlm.size(); ++i) EXPECT_NEAR(dlm1[i], dlm[i], 1e-14);

  // Nothing counts: loss 0 and zero gradients (not NaN).
  const std::vector<int32_t> none(n, -100);
  LossStats l0;
  head.run(norm.data(), lm.data(), x.data(), none.data(), nullptr, n, 1.0, &l0, dx.data(),
           dnorm.data(), dlm.data());
  EXPECT_EQ(l0.count, 0);
  EXPECT_EQ(l0.mean(), 0.0);
  for (double g : dx) ASSERT_EQ(g, 0.0);
  for (double g : dlm) ASSERT_EQ(g, 0.0);
  for (double g : dnorm) ASSERT_EQ(g, 0.0);
}

// A two-layer model end to end (embedding, layers, head, tied embeddings),
// checked against finite differences of the loss on the embedding: the
// gradient that flows through every op and through the tied path.
TEST(OpsGradCheck, TiedModelEndToEnd) {
  std::mt19937_64 rng(11);
  LlamaDims dims = tiny_dims();
  dims.tied = true;
  const int64_t B = 2, T = 4, n = B * T, D = dims.dim;
  cpu::LayerMath<double> layer(dims, n, T, slots());
  cpu::HeadMath<double> head(dims, n);
  LayerBlob<double> l0, l1;
  l0.init(rng, dims, 0.3);
  l1.init(rng, dims, 0.3);
  V embed = random_vec<double>(rng, dims.vocab * D, 0.5), norm = random_vec<double>(rng, D, 0.1, 1.0);
  const std::vector<int32_t> tokens = {1, 5, 5, 22, 0, 7, 1, 3};
  const std::vector<int32_t> targets = {5, 5, 22, -100, 7, 1, 3, 9};
  V x0(n * D), x1(n * D), x2(n * D);
  auto forward = [&] {
    cpu::embed_forward(embed.data(), tokens.data(), x0.data(), n, D);
    layer.forward(l0.params(), x0.data(), x1.data(), B, T);
    layer.forward(l1.params(), x1.data(), x2.data(), B, T);
  };
  auto f = [&] {
    forward();
    LossStats l;
    head.run(norm.data(), embed.data(), x2.data(), targets.data(), nullptr, n, 0.0, &l, nullptr,
             nullptr, nullptr);
    return l.mean();
  };
  forward();
  V dx2(n * D), dx1(n * D), dx0(n * D), dnorm(D), g_embed(embed.size());
  LossStats loss;
  head.run(norm.data(), embed.data(), x2.data(), targets.data(), nullptr, n, 1.0, &loss, dx2.data(),
           dnorm.data(), g_embed.data());
  LayerBlob<double> g0, g1;
  g0.zeros_like(l0);
  g1.zeros_like(l1);
  layer.backward(l1.params(), x1.data(), dx2.data(), dx1.data(), g1.grads(), B, T);
  layer.backward(l0.params(), x0.data(), dx1.data(), dx0.data(), g0.grads(), B, T);
  cpu::embed_backward(tokens.data(), dx0.data(), g_embed.data(), n, D, dims.vocab, true);
  STRATA_CHECK_GRAD("tied embed", embed, g_embed, f);
  STRATA_CHECK_GRAD("model norm", norm, dnorm, f);
  STRATA_CHECK_GRAD("layer0 gate", l0[kGateProj], g0[kGateProj], f);
  STRATA_CHECK_GRAD("layer0 input_layernorm", l0[kInputNorm], g0[kInputNorm], f);
}

}  // namespace
}  // namespace strata::train
