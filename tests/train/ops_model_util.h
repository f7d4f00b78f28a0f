// A small Llama model in host memory and one training micro-batch through a
// ModelOps, the way the trainer drives it (embed, layers, head, backward in
// reverse, tied embeddings through embed_backward(accumulate)).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "common/float_convert.h"
#include "ops_test_util.h"
#include "train/model_ops.h"

namespace strata::train::testing {

struct HostModel {
  LlamaDims dims;
  int64_t layers = 0;
  std::vector<float> embed, norm, lm_head;  // lm_head empty when tied
  std::vector<LayerBlob<float>> layer;

  void init(std::mt19937_64& rng, const LlamaDims& d, int64_t nlayers, double wscale) {
    dims = d;
    layers = nlayers;
    embed = random_vec<float>(rng, d.vocab * d.dim, 1.0);
    layer.resize(static_cast<size_t>(nlayers));
    for (auto& l : layer) l.init(rng, d, wscale);
    norm = random_vec<float>(rng, d.dim, 0.1, 1.0);
    if (!d.tied) lm_head = random_vec<float>(rng, d.vocab * d.dim, wscale);
  }
  // Every parameter rounded to bf16 (in place, kept as fp32 values).
  void round_to_bf16() {
    auto r = [](std::vector<float>& v) {
      for (float& x : v) x = bf16_bits_to_f32(f32_to_bf16_bits(x));
    };
    r(embed);
    r(norm);
    r(lm_head);
    for (auto& l : layer)
      for (auto* t : l.all()) r(*t);
  }
  const float* head_weight() const { return dims.tied ? embed.data() : lm_head.data(); }
  // All parameters in HF order (embed, layers, norm, lm_head if untied).
  std::vector<const std::vector<float>*> tensors() const {
    std::vector<const std::vector<float>*> t{&embed};
    for (auto& l : layer)
      for (auto* p : const_cast<LayerBlob<float>&>(l).all()) t.push_back(p);
    t.push_back(&norm);
    if (!dims.tied) t.push_back(&lm_head);
    return t;
  }
};

inline std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f32_to_bf16_bits(v[i]);
  return out;
}

// The parameters in one dtype as the engine would hand them out.
struct DeviceCopy {
  DType dtype = DType::kF32;
  std::vector<std::vector<uint16_t>> half;  // bf16 copies, same order as tensors()
  std::vector<const void*> ptr;

  void make(const HostModel& m, DType dt) {
    dtype = dt;
    half.clear();
    ptr.clear();
    for (const auto* t : m.tensors()) {
      if (dt == DType::kF32) {
        ptr.push_back(t->data());
      } else {
        half.push_back(to_bf16(*t));
        ptr.push_back(half.back().data());
      }
    }
    // `half` must not reallocate after taking pointers.
    if (dt != DType::kF32) {
      ptr.clear();
      for (auto& h : half) ptr.push_back(h.data());
    }
  }
  EmbedWeights embed() const { return {dtype, ptr[0]}; }
  LayerWeights layer(int64_t i) const {
    const size_t b = 1 + static_cast<size_t>(i) * 9;
    return {dtype, ptr[b], ptr[b + 1], ptr[b + 2], ptr[b + 3], ptr[b + 4],
            ptr[b + 5], ptr[b + 6], ptr[b + 7], ptr[b + 8]};
  }
  HeadWeights head(const HostModel& m) const {
    const size_t nb = 1 + static_cast<size_t>(m.layers) * 9;
    return {dtype, ptr[nb], m.dims.tied ? ptr[0] : ptr[nb + 1]};
  }
};

struct StepResult {
  LossStats loss;
  std::vector<float> logits;                  // [n, vocab]
  std::vector<std::vector<float>> grads;      // same order as HostModel::tensors()
};

inline void run_step(ModelOps& ops, const HostModel& m, const DeviceCopy& w,
                     const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets,
                     const uint8_t* mask, int64_t B, int64_t T, StepResult* out,
                     float dloss = 1.0f) {
  const LlamaDims& d = m.dims;
  const int64_t n = B * T, D = d.dim;
  std::vector<std::vector<float>> acts(static_cast<size_t>(m.layers + 1),
                                       std::vector<float>(n * D));
  ASSERT_TRUE(ops.embed_forward(w.embed(), tokens.data(), B, T, acts[0].data()).ok());
  for (int64_t l = 0; l < m.layers; ++l)
    ASSERT_TRUE(ops.layer_forward(w.layer(l), B, T, acts[l].data(), acts[l + 1].data()).ok());
  out->logits.assign(n * d.vocab, 0.f);
  ASSERT_TRUE(ops.head_logits(w.head(m), acts[m.layers].data(), B, T, out->logits.data()).ok());

  out->grads.clear();
  for (const auto* t : m.tensors()) out->grads.emplace_back(t->size(), -1.0f);
  const size_t nb = 1 + static_cast<size_t>(m.layers) * 9;
  float* g_head = d.tied ? out->grads[0].data() : out->grads[nb + 1].data();
  std::vector<float> dy(n * D), dx(n * D);
  ASSERT_TRUE(ops.head_forward_backward(w.head(m), acts[m.layers].data(), targets.data(), mask, B,
                                        T, dloss, &out->loss, dy.data(),
                                        {out->grads[nb].data(), g_head})
                  .ok());
  // Evaluation gives the same loss.
  LossStats eval;
  ASSERT_TRUE(ops.head_loss(w.head(m), acts[m.layers].data(), targets.data(), mask, B, T, &eval).ok());
  EXPECT_EQ(eval.sum, out->loss.sum);
  EXPECT_EQ(eval.count, out->loss.count);
  for (int64_t l = m.layers - 1; l >= 0; --l) {
    auto& g = out->grads;
    const size_t b = 1 + static_cast<size_t>(l) * 9;
    LayerGrads lg{g[b].data(),     g[b + 1].data(), g[b + 2].data(), g[b + 3].data(), g[b + 4].data(),
                  g[b + 5].data(), g[b + 6].data(), g[b + 7].data(), g[b + 8].data()};
    ASSERT_TRUE(ops.layer_backward(w.layer(l), B, T, acts[l].data(), dy.data(), dx.data(), lg).ok());
    std::swap(dy, dx);
  }
  // Tied: the head already wrote its part into grads[0]; add the embedding's.
  ASSERT_TRUE(ops.embed_backward(tokens.data(), B, T, dy.data(), out->grads[0].data(), d.tied).ok());
}

}  // namespace strata::train::testing
