#include "train/cpu_probe.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "common/float_convert.h"
#include "common/host_memory.h"
#include "common/units.h"

namespace strata::train {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One pass's FLOPs, as the probe sizes itself (not the plan's count): the
// layer's weights forward, recomputed and backward (8 per weight and token),
// its causal attention (about 4 x seq x q_dim per token each way), the head's.
double pass_flops(const LlamaDims& d, int64_t tokens, int64_t seq) {
  const double t = static_cast<double>(tokens);
  const double layer = 8.0 * static_cast<double>(d.layer_params()) * t +
                       4.0 * 4.0 * t * static_cast<double>(seq) * static_cast<double>(d.q_dim()) / 2;
  return layer + 6.0 * static_cast<double>(d.vocab) * static_cast<double>(d.dim) * t;
}

// Weights (dtype), fp32 gradients, the bf16/fp16 conversion buffer and the
// ops' workspace (activations of `tokens`, the head's logits and their
// gradient), generously.
uint64_t probe_bytes(const LlamaDims& d, DType dtype, int64_t tokens) {
  const uint64_t wb = dtype_size(dtype);
  const uint64_t lp = static_cast<uint64_t>(d.layer_params());
  const uint64_t head = static_cast<uint64_t>(d.vocab * d.dim);
  const uint64_t embeds = d.tied ? 1 : 2;
  uint64_t b = lp * (wb + 4) + head * embeds * (wb + 4) + static_cast<uint64_t>(d.dim) * (wb + 4);
  if (dtype != DType::kF32) b += std::max(lp, head) * 4;
  const uint64_t per_token = 16 * d.dim + 6 * d.ffn_dim + 6 * d.q_dim() + 4 * d.kv_dim() + 2 * d.vocab;
  return b + static_cast<uint64_t>(tokens) * per_token * 4;
}

// Fills with small values in the compute dtype (norms near 1, the rest
// within +-0.05): timing only, but no denormals, infinities or NaNs.
void fill(void* p, DType dtype, int64_t n, bool norm, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < n; ++i) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    const float u = static_cast<float>(s >> 40) / static_cast<float>(1 << 24) - 0.5f;  // [-0.5, 0.5)
    const float v = norm ? 1.0f + 0.1f * u : 0.1f * u;
    if (dtype == DType::kF32)
      static_cast<float*>(p)[i] = v;
    else if (dtype == DType::kBF16)
      static_cast<uint16_t*>(p)[i] = f32_to_bf16_bits(v);
    else
      static_cast<uint16_t*>(p)[i] = f32_to_f16_bits(v);
  }
}

}  // namespace

std::string CpuProbe::description() const {
  const std::string width = scale == 1 ? fmt::format("dim {}", dims.dim)
                                       : fmt::format("dim {} (the model's / {})", dims.dim, scale);
  return fmt::format("{}, batch {} x seq {}: layer forward {} + backward {}, head {}, embedding {}", width, batch, seq,
                     format_seconds(layer_forward_s), format_seconds(layer_backward_s), format_seconds(head_s),
                     format_seconds(embed_s));
}

Result<CpuProbe> probe_cpu_compute(const LlamaDims& model, int64_t layers, DType dtype, int64_t batch, int64_t seq,
                                   const CpuProbeOptions& o) {
  STRATA_RETURN_IF_ERROR(model.validate());
  if (layers < 1 || batch < 1 || seq < 1)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("cpu probe: layers {}, batch {}, seq {}: each must be at least 1", layers, batch, seq));
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16)
    return Status(StatusCode::kInvalidArgument, "cpu probe: the compute dtype must be fp32, bf16 or fp16");
  const int reps = std::max(1, o.reps);

  // Fewer tokens first (batch 1, then shorter), then a narrower model.
  CpuProbe p;
  LlamaDims d = model;
  int64_t B = batch, T = seq, k = 1;
  const int64_t min_seq = std::min<int64_t>(seq, 256);  // shorter rows run the GEMMs below their rate
  auto fits = [&] { return pass_flops(d, B * T, T) <= o.max_flops && probe_bytes(d, dtype, B * T) <= o.max_bytes; };
  while (!fits()) {
    if (B > 1) {
      B = 1;
    } else if (T > min_seq) {
      T = std::max(min_seq, T / 2);
    } else if (d.kv_heads % 2 != 0 || d.dim % 2 != 0 || d.ffn_dim % 2 != 0 || d.vocab < 512) {
      // No narrower model keeps every size whole and the GQA ratio: past the
      // FLOP budget only, it runs (longer); past the memory, it cannot.
      if (probe_bytes(d, dtype, B * T) <= o.max_bytes) break;
      return Status(StatusCode::kOutOfMemory,
                    fmt::format("cpu probe: {} at {} tokens needs {} (more than {}) and cannot be narrowed further",
                                d.to_string(), B * T, format_bytes(probe_bytes(d, dtype, B * T)),
                                format_bytes(o.max_bytes)));
    } else {
      // Halve the width: hidden size, heads, kv heads, FFN, vocabulary.
      k *= 2;
      d.heads /= 2;
      d.kv_heads /= 2;
      d.dim /= 2;
      d.ffn_dim /= 2;
      d.vocab /= 2;
    }
  }
  p.dims = d;
  p.scale = k;
  p.batch = B;
  p.seq = T;
  const int64_t n = B * T;

  auto ops_r = create_cpu_ops({.dims = d, .max_batch = B, .max_seq = T, .threads = o.threads});
  if (!ops_r.ok()) return ops_r.status();
  ModelOps& ops = **ops_r;

  // The layer's tensors and gradients (LoRA adapters in fp32, as PEFT keeps
  // them), the head, the embedding.
  const size_t wb = dtype_size(dtype);
  const LlamaExtents ext = d.extents();
  auto is_lora = [](LayerTensor t) { return weight_row(t).feature == Feature::kLora; };
  auto tensor_bytes = [&](LayerTensor t) { return is_lora(t) ? size_t{4} : wb; };
  size_t wbytes = 0, gelems = 0;
  for (LayerTensor t : kAllLayerTensors)
    if (d.has(t)) {
      wbytes += static_cast<size_t>(weight_row(t).numel(ext)) * tensor_bytes(t);
      gelems += static_cast<size_t>(weight_row(t).numel(ext));
    }
  const size_t head_elems = static_cast<size_t>(d.vocab * d.dim);
  auto w = HostArray<unsigned char>::create(wbytes);
  auto g = HostArray<float>::create(gelems);
  auto emb = HostArray<unsigned char>::create(head_elems * wb);
  auto lm = HostArray<unsigned char>::create(d.tied ? 1 : head_elems * wb);
  auto norm = HostArray<unsigned char>::create(static_cast<size_t>(d.dim) * wb);
  auto g_head = HostArray<float>::create(head_elems);
  auto g_norm = HostArray<float>::create(static_cast<size_t>(d.dim));
  auto x = HostArray<float>::create(static_cast<size_t>(n * d.dim));
  auto y = HostArray<float>::create(static_cast<size_t>(n * d.dim));
  auto dy = HostArray<float>::create(static_cast<size_t>(n * d.dim));
  auto tokens = HostArray<int32_t>::create(static_cast<size_t>(n));
  for (const Status& st : {w.status(), g.status(), emb.status(), lm.status(), norm.status(), g_head.status(),
                           g_norm.status(), x.status(), y.status(), dy.status(), tokens.status()})
    if (!st.ok()) return st.with_context("cpu probe: weights and activations");

  LayerWeights lw;
  lw.dtype = dtype;
  lw.lora_dtype = DType::kF32;
  lw.lora_dropout_on = d.lora_dropout > 0;
  LayerGrads lg{};
  size_t wo = 0, go = 0;
  uint64_t seed = 1;
  for (LayerTensor t : kAllLayerTensors) {
    if (!d.has(t)) continue;
    const int64_t ne = weight_row(t).numel(ext);
    fill(w->data() + wo, is_lora(t) ? DType::kF32 : dtype, ne, weight_row(t).norm, seed++);
    lw[t] = w->data() + wo;
    lg[t] = o.frozen && !is_lora(t) ? nullptr : g->data() + go;  // adapters train over a frozen base
    wo += static_cast<size_t>(ne) * tensor_bytes(t);
    go += static_cast<size_t>(ne);
  }
  fill(emb->data(), dtype, static_cast<int64_t>(head_elems), false, seed++);
  if (!d.tied) fill(lm->data(), dtype, static_cast<int64_t>(head_elems), false, seed++);
  fill(norm->data(), dtype, d.dim, true, seed++);
  fill(x->data(), DType::kF32, n * d.dim, false, seed++);
  for (int64_t i = 0; i < n; ++i) (*tokens)[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919) % d.vocab);
  const EmbedWeights ew{.dtype = dtype, .embed_tokens = emb->data()};
  const HeadWeights hw{.dtype = dtype, .norm = norm->data(), .lm_head = d.tied ? emb->data() : lm->data()};
  const HeadGrads hg = o.frozen ? HeadGrads{} : HeadGrads{.norm = g_norm->data(), .lm_head = g_head->data()};

  std::vector<double> tf, tb, th, te;
  // At least `reps` timed passes, more (up to 25) while they total under a
  // second: a small model's passes take milliseconds, and the median of a
  // few is at the mercy of one hiccup of a shared machine.
  double timed = 0;
  for (int r = 0; r <= reps || (r <= 25 && timed < 1.0); ++r) {  // r == 0: the warm-up (first touch, caches)
    LossStats loss;
    auto t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(ops.embed_forward(ew, tokens->data(), B, T, y->data()));
    const double e1 = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(ops.layer_forward(lw, B, T, x->data(), y->data()));
    const double f = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(ops.head_forward_backward(hw, y->data(), tokens->data(), nullptr, B, T, 1.0f, &loss,
                                                     dy->data(), hg));
    const double h = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(ops.layer_backward(lw, B, T, x->data(), dy->data(), y->data(), lg));
    const double b = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    if (!o.frozen)  // a frozen embedding needs no gradient
      STRATA_RETURN_IF_ERROR(ops.embed_backward(tokens->data(), B, T, y->data(), g_head->data(), d.tied));
    const double e2 = seconds_since(t0);
    if (r == 0) continue;
    timed += f + h + b + e1 + e2;
    tf.push_back(f);
    tb.push_back(b);
    th.push_back(h);
    te.push_back(e1 + e2);
  }
  p.layer_forward_s = median(tf);
  p.layer_backward_s = median(tb);
  p.head_s = median(th);
  p.embed_s = median(te);
  p.micro_batch_s =
      static_cast<double>(layers) * (p.layer_forward_s + p.layer_backward_s) + p.head_s + p.embed_s;
  return p;
}

}  // namespace strata::train
