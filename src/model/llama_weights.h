// The Llama weight table: every tensor of a Llama-architecture decoder, its
// Hugging Face name and its shape as a function of the model's dimensions.
// The one place these are spelled: the model files (llama_model_spec's order
// is checked against it in tests/model), the CPU and CUDA ops, the CUDA
// module's C ABI (static_asserted in train/cuda_ops.cpp) and the trainer's
// wiring of engine parameters to ops all index by these enums.
//
// Code indexes per-layer tensors by name, never by position:
//   LayerArray<const void*> w;  w[kQProj] = ...;
// LayerArray accepts only a LayerTensor as index and cannot be brace-
// initialised positionally, so a wrong order does not compile. A new
// architecture's tensors (Qwen2's q/k/v biases, Qwen3's q/k norms) are new
// rows here, not new structs.
//
// Pure constexpr data; no state; usable from any thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

// The tensors of one decoder layer (also the engine's parameter order within
// a layer group). The first kBaseLayerTensorCount are every architecture's
// (and the CUDA module's strata_cuda_train_layer_t::tensors, in this order);
// the rest belong to one architecture or one fine-tuning method each
// (WeightRow::feature): Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm
// weights, and the LoRA adapters of the seven projections (PEFT's names and
// shapes: lora_A [r, in], lora_B [out, r]). A model without a feature has no
// such tensor (layer_has / LlamaDims::has, numel 0).
enum LayerTensor : int {
  kInputNorm,  // input_layernorm
  kQProj,
  kKProj,
  kVProj,
  kOProj,
  kPostNorm,  // post_attention_layernorm
  kGateProj,
  kUpProj,
  kDownProj,
  kQBias,  // Qwen2
  kKBias,
  kVBias,
  kQNorm,  // Qwen3: RMSNorm over each head's head_dim, before RoPE
  kKNorm,
  // LoRA (PEFT): y = base(x) + lora_B(lora_A(dropout(x))) * scaling, for the
  // projections the run targets (layer_has: one bit per adapted projection).
  kQLoraA,
  kQLoraB,
  kKLoraA,
  kKLoraB,
  kVLoraA,
  kVLoraB,
  kOLoraA,
  kOLoraB,
  kGateLoraA,
  kGateLoraB,
  kUpLoraA,
  kUpLoraB,
  kDownLoraA,
  kDownLoraB,
  kLayerTensorCount
};
inline constexpr int kBaseLayerTensorCount = kQBias;

// Which models have a tensor.
enum class Feature : uint8_t {
  kAlways,
  kQkvBias,  // Qwen2: q_proj/k_proj/v_proj have biases
  kQkNorm,   // Qwen3: q_norm/k_norm per head
  kLora,     // a LoRA adapter of WeightRow::adapts (when the run targets it)
};

// The tensors outside the layers.
enum ModelTensor : int { kEmbedTokens, kFinalNorm, kLmHead, kModelTensorCount };

// The model dimensions a shape is made of.
enum class Extent : uint8_t {
  kOne,    // a 1-D tensor's missing second dimension
  kDim,    // hidden_size
  kQDim,   // num_attention_heads * head_dim
  kKvDim,  // num_key_value_heads * head_dim
  kFfnDim, // intermediate_size
  kVocab,  // vocab_size
  kHeadDim,  // head_dim
  kLoraRank, // the LoRA rank r
};

struct LlamaExtents {
  int64_t dim = 0, q_dim = 0, kv_dim = 0, ffn_dim = 0, vocab = 0, head_dim = 0, lora_rank = 0;
  constexpr int64_t of(Extent e) const {
    switch (e) {
      case Extent::kOne: return 1;
      case Extent::kDim: return dim;
      case Extent::kQDim: return q_dim;
      case Extent::kKvDim: return kv_dim;
      case Extent::kFfnDim: return ffn_dim;
      case Extent::kVocab: return vocab;
      case Extent::kHeadDim: return head_dim;
      case Extent::kLoraRank: return lora_rank;
    }
    return 0;
  }
};

struct WeightRow {
  int id;                 // the row's LayerTensor / ModelTensor (checked below)
  std::string_view name;  // Hugging Face name; for layer rows the part after "model.layers.<i>."
  Extent rows, cols;      // row-major [rows, cols]; cols == kOne: 1-D [rows]
  bool norm;              // an RMSNorm weight (Hugging Face initialises it to ones)
  Feature feature = Feature::kAlways;
  int adapts = -1;        // kLora rows: the LayerTensor (a projection) the adapter belongs to

  constexpr int64_t numel(const LlamaExtents& x) const { return x.of(rows) * x.of(cols); }
  // [rows] or [rows, cols], as safetensors and the engine spell shapes.
  std::vector<uint64_t> shape(const LlamaExtents& x) const {
    if (cols == Extent::kOne) return {static_cast<uint64_t>(x.of(rows))};
    return {static_cast<uint64_t>(x.of(rows)), static_cast<uint64_t>(x.of(cols))};
  }
};

inline constexpr std::array<WeightRow, kLayerTensorCount> kLayerWeights = {{
    {kInputNorm, "input_layernorm.weight", Extent::kDim, Extent::kOne, true},
    {kQProj, "self_attn.q_proj.weight", Extent::kQDim, Extent::kDim, false},
    {kKProj, "self_attn.k_proj.weight", Extent::kKvDim, Extent::kDim, false},
    {kVProj, "self_attn.v_proj.weight", Extent::kKvDim, Extent::kDim, false},
    {kOProj, "self_attn.o_proj.weight", Extent::kDim, Extent::kQDim, false},
    {kPostNorm, "post_attention_layernorm.weight", Extent::kDim, Extent::kOne, true},
    {kGateProj, "mlp.gate_proj.weight", Extent::kFfnDim, Extent::kDim, false},
    {kUpProj, "mlp.up_proj.weight", Extent::kFfnDim, Extent::kDim, false},
    {kDownProj, "mlp.down_proj.weight", Extent::kDim, Extent::kFfnDim, false},
    {kQBias, "self_attn.q_proj.bias", Extent::kQDim, Extent::kOne, false, Feature::kQkvBias},
    {kKBias, "self_attn.k_proj.bias", Extent::kKvDim, Extent::kOne, false, Feature::kQkvBias},
    {kVBias, "self_attn.v_proj.bias", Extent::kKvDim, Extent::kOne, false, Feature::kQkvBias},
    {kQNorm, "self_attn.q_norm.weight", Extent::kHeadDim, Extent::kOne, true, Feature::kQkNorm},
    {kKNorm, "self_attn.k_norm.weight", Extent::kHeadDim, Extent::kOne, true, Feature::kQkNorm},
    {kQLoraA, "self_attn.q_proj.lora_A.weight", Extent::kLoraRank, Extent::kDim, false, Feature::kLora, kQProj},
    {kQLoraB, "self_attn.q_proj.lora_B.weight", Extent::kQDim, Extent::kLoraRank, false, Feature::kLora, kQProj},
    {kKLoraA, "self_attn.k_proj.lora_A.weight", Extent::kLoraRank, Extent::kDim, false, Feature::kLora, kKProj},
    {kKLoraB, "self_attn.k_proj.lora_B.weight", Extent::kKvDim, Extent::kLoraRank, false, Feature::kLora, kKProj},
    {kVLoraA, "self_attn.v_proj.lora_A.weight", Extent::kLoraRank, Extent::kDim, false, Feature::kLora, kVProj},
    {kVLoraB, "self_attn.v_proj.lora_B.weight", Extent::kKvDim, Extent::kLoraRank, false, Feature::kLora, kVProj},
    {kOLoraA, "self_attn.o_proj.lora_A.weight", Extent::kLoraRank, Extent::kQDim, false, Feature::kLora, kOProj},
    {kOLoraB, "self_attn.o_proj.lora_B.weight", Extent::kDim, Extent::kLoraRank, false, Feature::kLora, kOProj},
    {kGateLoraA, "mlp.gate_proj.lora_A.weight", Extent::kLoraRank, Extent::kDim, false, Feature::kLora, kGateProj},
    {kGateLoraB, "mlp.gate_proj.lora_B.weight", Extent::kFfnDim, Extent::kLoraRank, false, Feature::kLora, kGateProj},
    {kUpLoraA, "mlp.up_proj.lora_A.weight", Extent::kLoraRank, Extent::kDim, false, Feature::kLora, kUpProj},
    {kUpLoraB, "mlp.up_proj.lora_B.weight", Extent::kFfnDim, Extent::kLoraRank, false, Feature::kLora, kUpProj},
    {kDownLoraA, "mlp.down_proj.lora_A.weight", Extent::kLoraRank, Extent::kFfnDim, false, Feature::kLora, kDownProj},
    {kDownLoraB, "mlp.down_proj.lora_B.weight", Extent::kDim, Extent::kLoraRank, false, Feature::kLora, kDownProj},
}};

inline constexpr std::array<WeightRow, kModelTensorCount> kModelWeights = {{
    {kEmbedTokens, "model.embed_tokens.weight", Extent::kVocab, Extent::kDim, false},
    {kFinalNorm, "model.norm.weight", Extent::kDim, Extent::kOne, true},
    {kLmHead, "lm_head.weight", Extent::kVocab, Extent::kDim, false},
}};

namespace llama_weights_detail {
template <size_t N>
constexpr bool rows_in_enum_order(const std::array<WeightRow, N>& t) {
  for (size_t i = 0; i < N; ++i)
    if (t[i].id != static_cast<int>(i)) return false;
  return true;
}
}  // namespace llama_weights_detail
static_assert(llama_weights_detail::rows_in_enum_order(kLayerWeights), "kLayerWeights rows out of enum order");
namespace llama_weights_detail {
// LoRA rows come in (A, B) pairs, A [r, in] and B [out, r] of the projection
// they adapt.
constexpr bool lora_rows_pair_up() {
  for (const WeightRow& r : kLayerWeights) {
    if (r.feature != Feature::kLora) continue;
    if (r.adapts < 0 || r.adapts >= kBaseLayerTensorCount) return false;
    const WeightRow& base = kLayerWeights[static_cast<size_t>(r.adapts)];
    const bool is_a = (r.id - kQLoraA) % 2 == 0;
    if (is_a && (r.rows != Extent::kLoraRank || r.cols != base.cols)) return false;
    if (!is_a && (r.rows != base.rows || r.cols != Extent::kLoraRank)) return false;
  }
  return true;
}
}  // namespace llama_weights_detail
static_assert(llama_weights_detail::lora_rows_pair_up(), "LoRA rows must be (A [r, in], B [out, r]) pairs");
static_assert(llama_weights_detail::rows_in_enum_order(kModelWeights), "kModelWeights rows out of enum order");

constexpr const WeightRow& weight_row(LayerTensor t) { return kLayerWeights[static_cast<size_t>(t)]; }
constexpr const WeightRow& weight_row(ModelTensor t) { return kModelWeights[static_cast<size_t>(t)]; }

// The projections LoRA can adapt (PEFT's target_modules names), in table
// order, and each one's adapter rows.
inline constexpr std::array<LayerTensor, 7> kLoraTargets = {kQProj, kKProj, kVProj, kOProj,
                                                            kGateProj, kUpProj, kDownProj};
constexpr int lora_target_index(LayerTensor proj) {
  for (size_t i = 0; i < kLoraTargets.size(); ++i)
    if (kLoraTargets[i] == proj) return static_cast<int>(i);
  return -1;
}
constexpr LayerTensor lora_a_of(LayerTensor proj) { return static_cast<LayerTensor>(kQLoraA + 2 * lora_target_index(proj)); }
constexpr LayerTensor lora_b_of(LayerTensor proj) { return static_cast<LayerTensor>(kQLoraB + 2 * lora_target_index(proj)); }
// "q_proj" for kQProj: the module name PEFT's target_modules lists.
inline std::string_view lora_module_name(LayerTensor proj) {
  std::string_view n = weight_row(proj).name;  // "self_attn.q_proj.weight"
  n = n.substr(n.find('.') + 1);
  return n.substr(0, n.find('.'));
}
// A bit per LoRA target (1u << lora_target_index).
inline constexpr uint32_t kAllLoraTargets = (1u << kLoraTargets.size()) - 1;

// Which tensors a model has: its architecture's features and the LoRA
// targets of the run (bits as above; 0: no LoRA).
constexpr bool layer_has(LayerTensor t, bool qkv_bias, bool qk_norm, uint32_t lora_targets) {
  const WeightRow& r = weight_row(t);
  switch (r.feature) {
    case Feature::kAlways: return true;
    case Feature::kQkvBias: return qkv_bias;
    case Feature::kQkNorm: return qk_norm;
    case Feature::kLora: return (lora_targets >> lora_target_index(static_cast<LayerTensor>(r.adapts))) & 1u;
  }
  return false;
}

// Every LayerTensor in order, for loops: for (LayerTensor t : kAllLayerTensors).
inline constexpr std::array<LayerTensor, kLayerTensorCount> kAllLayerTensors = [] {
  std::array<LayerTensor, kLayerTensorCount> a{};
  for (int i = 0; i < kLayerTensorCount; ++i) a[static_cast<size_t>(i)] = static_cast<LayerTensor>(i);
  return a;
}();

// "model.layers.<layer>.self_attn.q_proj.weight"
inline std::string layer_weight_name(int64_t layer, LayerTensor t) {
  return "model.layers." + std::to_string(layer) + "." + std::string(weight_row(t).name);
}
inline std::string model_weight_name(ModelTensor t) { return std::string(weight_row(t).name); }

// One value per layer tensor, indexed only by LayerTensor. Not an aggregate:
// it cannot be filled by position.
template <typename T>
class LayerArray {
 public:
  constexpr LayerArray() = default;
  constexpr T& operator[](LayerTensor t) { return v_[static_cast<size_t>(t)]; }
  constexpr const T& operator[](LayerTensor t) const { return v_[static_cast<size_t>(t)]; }
  constexpr auto begin() { return v_.begin(); }
  constexpr auto end() { return v_.end(); }
  constexpr auto begin() const { return v_.begin(); }
  constexpr auto end() const { return v_.end(); }
  static constexpr size_t size() { return kLayerTensorCount; }

 private:
  std::array<T, kLayerTensorCount> v_{};
};

}  // namespace strata
