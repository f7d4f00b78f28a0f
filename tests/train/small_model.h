// The small Llama model the train tests share: its dimensions, random
// weights filled through the weight table (model/llama_weights.h), the
// weights in one dtype as the engine would hand them out, and one training
// micro-batch through a ModelOps the way the trainer drives it (embed,
// layers, head, backward in reverse, tied embeddings through
// embed_backward(accumulate)).
//
// Random draws go tensor by tensor in table order, each from the caller's
// generator, so a test's weights depend only on its seed and dims.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/float_convert.h"
#include "model/llama_config.h"
#include "model/llama_weights.h"
#include "ops_test_util.h"
#include "train/cpu_kernels.h"
#include "train/model_ops.h"

namespace strata::train::testing {

// ---- dimensions

// The small model: 64 wide, 4 heads of 16 over 2 kv heads (grouped-query
// attention). The FFN width and vocabulary vary per test (odd sizes find
// different edge cases in the kernels' blocking).
inline LlamaDims small_dims(int64_t ffn_dim, int64_t vocab, bool tied = false) {
  LlamaDims d;
  d.dim = 64;
  d.heads = 4;
  d.kv_heads = 2;
  d.head_dim = 16;
  d.ffn_dim = ffn_dim;
  d.vocab = vocab;
  d.rms_eps = 1e-5;
  d.rope_theta = 10000.0;
  d.tied = tied;
  return d;
}

// The tiny model of the double-precision gradient checks (every element is
// perturbed, so it is kept to a few thousand parameters).
inline LlamaDims tiny_dims(int64_t kv_heads = 2) {
  LlamaDims d;
  d.dim = 16;
  d.heads = 4;
  d.kv_heads = kv_heads;
  d.head_dim = 4;
  d.ffn_dim = 24;
  d.vocab = 23;
  d.rms_eps = 1e-5;
  d.rope_theta = 10000.0;
  return d;
}

// The small model as a Hugging Face config (the trainer tests write it to
// disk): 64 wide, 4 heads, 2 kv heads, FFN 160, a byte vocabulary, fp32.
inline model::LlamaConfig small_config(uint32_t layers, bool tied) {
  model::LlamaConfig c;
  c.num_hidden_layers = layers;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.intermediate_size = 160;
  c.vocab_size = 256;
  c.tie_word_embeddings = tied;
  c.torch_dtype = DType::kF32;
  return c;
}

// ---- one layer's weights

// normal(offset, scale) per element.
struct InitScale {
  double scale = 1.0, offset = 0.0;
};

// One layer's tensors, each owned, indexed by LayerTensor.
template <typename S>
struct LayerBlob : LayerArray<std::vector<S>> {
  // Every tensor in table order: scale_of(t) gives its distribution.
  template <typename F>
  void init_scaled(std::mt19937_64& rng, const LlamaDims& d, F&& scale_of) {
    for (LayerTensor t : kAllLayerTensors) {
      const InitScale s = scale_of(t);
      (*this)[t] = random_vec<S>(rng, d.numel(t), s.scale, s.offset);
    }
  }
  // Norm weights near 1 (normal(1, 0.1)), the rest normal(0, wscale).
  void init(std::mt19937_64& rng, const LlamaDims& d, double wscale = 0.25) {
    init_scaled(rng, d, [&](LayerTensor t) { return weight_row(t).norm ? InitScale{0.1, 1.0} : InitScale{wscale}; });
  }
  void zeros_like(const LayerBlob& o) {
    for (LayerTensor t : kAllLayerTensors) (*this)[t].assign(o[t].size(), S(0));
  }
  cpu::LayerParams<S> params() const {
    cpu::LayerParams<S> p;
    for (LayerTensor t : kAllLayerTensors) p[t] = (*this)[t].data();
    return p;
  }
  cpu::LayerParamGrads<S> grads() {
    cpu::LayerParamGrads<S> g;
    for (LayerTensor t : kAllLayerTensors) g[t] = (*this)[t].data();
    return g;
  }
  LayerWeights weights() const {
    LayerWeights w;
    w.dtype = DType::kF32;
    for (LayerTensor t : kAllLayerTensors) w[t] = (*this)[t].data();
    return w;
  }
};

// A tensor's name in test messages ("self_attn.q_proj.weight").
inline std::string label(LayerTensor t) { return std::string(weight_row(t).name); }

// ---- a whole model

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
      for (auto& t : l) r(t);
  }

  // All parameters in Hugging Face order (embed, layers, norm, lm_head if
  // untied); the indices below address this list.
  std::vector<const std::vector<float>*> tensors() const {
    std::vector<const std::vector<float>*> t{&embed};
    for (const auto& l : layer)
      for (const auto& p : l) t.push_back(&p);
    t.push_back(&norm);
    if (!dims.tied) t.push_back(&lm_head);
    return t;
  }
  static size_t layer_index(int64_t l, LayerTensor t) {
    return 1 + static_cast<size_t>(l) * kLayerTensorCount + static_cast<size_t>(t);
  }
  size_t norm_index() const { return 1 + static_cast<size_t>(layers) * kLayerTensorCount; }
  size_t lm_head_index() const { return dims.tied ? 0 : norm_index() + 1; }  // tied: the embedding
  // The Hugging Face name of tensors()[i].
  std::string tensor_name(size_t i) const {
    if (i == 0) return model_weight_name(kEmbedTokens);
    if (i < norm_index())
      return layer_weight_name(static_cast<int64_t>((i - 1) / kLayerTensorCount),
                               static_cast<LayerTensor>((i - 1) % kLayerTensorCount));
    return model_weight_name(i == norm_index() ? kFinalNorm : kLmHead);
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
  std::vector<const void*> ptr;             // same order as tensors()

  void make(const HostModel& m, DType dt) {
    dtype = dt;
    half.clear();
    ptr.clear();
    for (const auto* t : m.tensors()) {
      if (dt == DType::kF32) {
        ptr.push_back(t->data());
      } else {
        half.push_back(to_bf16(*t));
      }
    }
    // `half` must not reallocate after taking pointers.
    if (dt != DType::kF32)
      for (auto& h : half) ptr.push_back(h.data());
  }
  EmbedWeights embed() const { return {.dtype = dtype, .embed_tokens = ptr[0]}; }
  LayerWeights layer(int64_t i) const {
    LayerWeights w;
    w.dtype = dtype;
    for (LayerTensor t : kAllLayerTensors) w[t] = ptr[HostModel::layer_index(i, t)];
    return w;
  }
  HeadWeights head(const HostModel& m) const {
    return {.dtype = dtype, .norm = ptr[m.norm_index()], .lm_head = ptr[m.lm_head_index()]};
  }
};

struct StepResult {
  LossStats loss;
  std::vector<float> logits;              // [n, vocab]
  std::vector<std::vector<float>> grads;  // same order as HostModel::tensors()
};

inline void run_step(ModelOps& ops, const HostModel& m, const DeviceCopy& w, const std::vector<int32_t>& tokens,
                     const std::vector<int32_t>& targets, const uint8_t* mask, int64_t B, int64_t T, StepResult* out,
                     float dloss = 1.0f) {
  const LlamaDims& d = m.dims;
  const int64_t n = B * T, D = d.dim;
  std::vector<std::vector<float>> acts(static_cast<size_t>(m.layers + 1), std::vector<float>(n * D));
  ASSERT_TRUE(ops.embed_forward(w.embed(), tokens.data(), B, T, acts[0].data()).ok());
  for (int64_t l = 0; l < m.layers; ++l)
    ASSERT_TRUE(ops.layer_forward(w.layer(l), B, T, acts[l].data(), acts[l + 1].data()).ok());
  out->logits.assign(n * d.vocab, 0.f);
  ASSERT_TRUE(ops.head_logits(w.head(m), acts[m.layers].data(), B, T, out->logits.data()).ok());

  out->grads.clear();
  for (const auto* t : m.tensors()) out->grads.emplace_back(t->size(), -1.0f);
  std::vector<float> dy(n * D), dx(n * D);
  const HeadGrads hg{.norm = out->grads[m.norm_index()].data(), .lm_head = out->grads[m.lm_head_index()].data()};
  ASSERT_TRUE(
      ops.head_forward_backward(w.head(m), acts[m.layers].data(), targets.data(), mask, B, T, dloss, &out->loss,
                                dy.data(), hg)
          .ok());
  // Evaluation gives the same loss.
  LossStats eval;
  ASSERT_TRUE(ops.head_loss(w.head(m), acts[m.layers].data(), targets.data(), mask, B, T, &eval).ok());
  EXPECT_EQ(eval.sum, out->loss.sum);
  EXPECT_EQ(eval.count, out->loss.count);
  for (int64_t l = m.layers - 1; l >= 0; --l) {
    LayerGrads lg;
    for (LayerTensor t : kAllLayerTensors) lg[t] = out->grads[HostModel::layer_index(l, t)].data();
    ASSERT_TRUE(ops.layer_backward(w.layer(l), B, T, acts[l].data(), dy.data(), dx.data(), lg).ok());
    std::swap(dy, dx);
  }
  // Tied: the head already wrote its part into grads[0]; add the embedding's.
  ASSERT_TRUE(ops.embed_backward(tokens.data(), B, T, dy.data(), out->grads[0].data(), d.tied).ok());
}

}  // namespace strata::train::testing
