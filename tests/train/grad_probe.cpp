// grad_probe: the loss and every parameter's gradient of a Hugging Face model
// directory on given tokens, computed by the CPU model ops exactly as the
// trainer wires them (dims from train::llama_dims, weights by the weight
// table's names, tied embeddings accumulated into one gradient). The
// reference test (hf_reference_test.py) compares them per tensor with
// transformers' float64 autograd.
//
//   grad_probe MODEL_DIR TOKENS.u32 B T OUT.safetensors
//
// TOKENS.u32 holds B windows of T+1 token ids; window b's first T are the
// inputs and its last T the targets. OUT gets one fp32 tensor per parameter
// (Hugging Face names) and the mean loss in the metadata ("loss").
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "model/llama_config.h"
#include "model/safetensors.h"
#include "train/model_ops.h"
#include "train/trainer.h"

using namespace strata;
using namespace strata::train;

namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "grad_probe: %s\n", msg.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) return fail("usage: grad_probe MODEL_DIR TOKENS.u32 B T OUT.safetensors");
  const std::string dir = argv[1];
  const int64_t B = std::atoll(argv[3]), T = std::atoll(argv[4]);
  auto md = model::open_model_dir(dir);
  if (!md.ok()) return fail(md.status().to_string());
  const LlamaDims d = llama_dims(md->config);
  if (Status st = d.validate(); !st.ok()) return fail(st.to_string());
  std::vector<uint32_t> win(static_cast<size_t>(B * (T + 1)));
  {
    std::ifstream in(argv[2], std::ios::binary);
    if (!in.read(reinterpret_cast<char*>(win.data()), static_cast<std::streamsize>(win.size() * 4)))
      return fail("cannot read B*(T+1) u32 tokens from " + std::string(argv[2]));
  }
  std::vector<int32_t> inputs(static_cast<size_t>(B * T)), targets(inputs.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      inputs[b * T + t] = static_cast<int32_t>(win[b * (T + 1) + t]);
      targets[b * T + t] = static_cast<int32_t>(win[b * (T + 1) + t + 1]);
    }
  // Every weight in fp32 (exact from bf16/fp16), by name.
  auto reader = model::TensorReader::create();
  if (!reader.ok()) return fail(reader.status().to_string());
  std::map<std::string, std::vector<float>> w, g;
  for (const model::TensorInfo& t : md->tensors) {
    auto& v = w[t.name];
    v.resize(t.numel());
    if (Status st = (*reader)->read(t, DType::kF32, v.data()); !st.ok()) return fail(st.to_string());
    g[t.name].assign(v.size(), 0.0f);
  }
  CpuOpsOptions co;
  co.dims = d;
  co.max_batch = B;
  co.max_seq = T;
  auto ops = create_cpu_ops(co);
  if (!ops.ok()) return fail(ops.status().to_string());
  ModelOps& m = **ops;
  const uint32_t L = md->config.num_hidden_layers;
  const int64_t act = B * T * d.dim;
  std::vector<float> acts(static_cast<size_t>(act * (L + 1))), dx_a(static_cast<size_t>(act)),
      dx_b(static_cast<size_t>(act));
  auto layer_w = [&](uint32_t l) {
    LayerWeights lw;
    lw.dtype = DType::kF32;
    for (LayerTensor t : kAllLayerTensors) lw[t] = d.has(t) ? w[layer_weight_name(l, t)].data() : nullptr;
    return lw;
  };
  const std::string embed = model_weight_name(kEmbedTokens), lm = d.tied ? embed : model_weight_name(kLmHead);
  auto check = [&](const Status& st) {
    if (!st.ok()) {
      std::fprintf(stderr, "grad_probe: %s\n", st.to_string().c_str());
      std::exit(1);
    }
  };
  check(m.embed_forward({.dtype = DType::kF32, .embed_tokens = w[embed].data()}, inputs.data(), B, T, acts.data()));
  for (uint32_t l = 0; l < L; ++l)
    check(m.layer_forward(layer_w(l), B, T, acts.data() + l * act, acts.data() + (l + 1) * act));
  LossStats loss;
  const HeadWeights hw{.dtype = DType::kF32, .norm = w[model_weight_name(kFinalNorm)].data(), .lm_head = w[lm].data()};
  check(m.head_forward_backward(hw, acts.data() + L * act, targets.data(), nullptr, B, T, 1.0f, &loss, dx_a.data(),
                                {.norm = g[model_weight_name(kFinalNorm)].data(), .lm_head = g[lm].data()}));
  for (uint32_t l = L; l-- > 0;) {
    LayerGrads lg;
    for (LayerTensor t : kAllLayerTensors) lg[t] = d.has(t) ? g[layer_weight_name(l, t)].data() : nullptr;
    check(m.layer_backward(layer_w(l), B, T, acts.data() + l * act, dx_a.data(), dx_b.data(), lg));
    std::swap(dx_a, dx_b);
  }
  // pad_token_id: nn.Embedding's padding_idx row takes nothing from the
  // lookup (the trainer's rule, Trainer::Impl's embedding backward).
  const int64_t pad = md->config.pad_token_id;
  std::vector<float> pad_row;
  float* pad_dst = pad >= 0 ? g[embed].data() + pad * d.dim : nullptr;
  if (pad_dst) pad_row.assign(pad_dst, pad_dst + d.dim);
  check(m.embed_backward(inputs.data(), B, T, dx_a.data(), g[embed].data(), /*accumulate=*/d.tied));
  if (pad_dst) std::copy(pad_row.begin(), pad_row.end(), pad_dst);  // the tied head's part, or 0
  std::vector<model::TensorDecl> decls;
  for (const model::TensorInfo& t : md->tensors) decls.push_back({t.name, model::StDType::kF32, t.shape});
  auto wr = model::SafetensorsWriter::create(argv[5], decls,
                                             {{"format", "pt"}, {"loss", fmt::format("{:.17g}", loss.mean())}});
  if (!wr.ok()) return fail(wr.status().to_string());
  for (const model::TensorDecl& t : decls) check((*wr)->write_from(DType::kF32, g[t.name].data(), t.numel()));
  check((*wr)->finish());
  return 0;
}
