#include "runtime/model_spec.h"

#include <cctype>

#include <fmt/format.h>

#include <cassert>
#include <limits>
#include <unordered_set>

#include "common/json.h"
#include "model/llama_weights.h"

namespace strata {

bool hf_no_decay(std::string_view name) {
  std::string n(name);
  for (char& c : n) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (n.find("bias") != std::string::npos || n.find("layernorm") != std::string::npos ||
      n.find("rmsnorm") != std::string::npos)
    return true;
  // (?:^|\.)norm(?:$|\.) and _norm(?:$|\.)
  for (size_t pos = n.find("norm"); pos != std::string::npos; pos = n.find("norm", pos + 1)) {
    const bool end = pos + 4 == n.size() || n[pos + 4] == '.';
    if (!end) continue;
    if (pos == 0 || n[pos - 1] == '.' || n[pos - 1] == '_') return true;
  }
  return false;
}

uint64_t ParamSpec::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

uint64_t ModelSpec::numel() const {
  uint64_t n = 0;
  for (const auto& p : params) n += p.numel();
  return n;
}

std::vector<std::string> ModelSpec::group_names() const {
  std::vector<std::string> names;
  std::unordered_set<std::string> seen;
  for (const auto& p : params)
    if (seen.insert(p.group).second) names.push_back(p.group);
  return names;
}

ShardRange shard_range(uint64_t numel, uint32_t world_size, uint32_t rank, uint64_t alignment) {
  assert(world_size >= 1 && rank < world_size && alignment >= 1);
  const uint64_t per_rank = numel / world_size + (numel % world_size != 0);
  ShardRange r;
  r.padded = (per_rank + alignment - 1) / alignment * alignment;
  // A zero-element parameter still gets one aligned slot so every parameter
  // has an address; its range stays empty.
  if (r.padded == 0) r.padded = alignment;
  const uint64_t begin = static_cast<uint64_t>(rank) * r.padded;
  r.begin = begin < numel ? begin : numel;
  r.end = r.begin + r.padded < numel ? r.begin + r.padded : numel;
  return r;
}

namespace {

// A name that may not be text, for a message: clipped, and bytes outside
// printable ASCII as \xNN.
std::string bytes_for_message(std::string_view s) {
  std::string out;
  for (unsigned char c : clip_for_message(s)) out += (c >= 0x20 && c < 0x7F) ? std::string(1, static_cast<char>(c))
                                                                             : fmt::format("\\x{:02x}", c);
  return out;
}

}  // namespace

Status validate_model_spec(const ModelSpec& model) {
  if (model.world_size == 0) return Status(StatusCode::kInvalidArgument, "model: world_size must be at least 1");
  if (model.rank >= model.world_size)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("model: rank {} is out of range for world_size {}", model.rank, model.world_size));
  if (model.params.empty()) return Status(StatusCode::kInvalidArgument, "model: no parameters");
  std::unordered_set<std::string> names;
  for (const auto& p : model.params) {
    if (p.name.empty()) return Status(StatusCode::kInvalidArgument, "model: a parameter has an empty name");
    if (p.group.empty())
      return Status(StatusCode::kInvalidArgument, fmt::format("model: parameter {} has no group", p.name));
    // Names go into checkpoint manifests and traces (JSON): UTF-8 only.
    if (!is_valid_utf8(p.name))
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("model: parameter name \"{}\" is not valid UTF-8", bytes_for_message(p.name)));
    if (!is_valid_utf8(p.group))
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("model: parameter \"{}\"'s group name \"{}\" is not valid UTF-8",
                                bytes_for_message(p.name), bytes_for_message(p.group)));
    if (p.lr_group >= kMaxLrGroups)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("model: parameter {}'s lr_group is {}: at most {} learning-rate groups (0 to {})",
                                p.name, p.lr_group, kMaxLrGroups, kMaxLrGroups - 1));
    if (!names.insert(p.name).second)
      return Status(StatusCode::kInvalidArgument, fmt::format("model: parameter {} is listed twice", p.name));
    if (!is_compute_dtype(p.compute_dtype))
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("model: parameter {} has compute dtype {} (fp32, bf16 or fp16 only)", p.name,
                                dtype_name(p.compute_dtype)));
    // Keep numel * 4 bytes far from overflow: 2^60 elements is beyond any model.
    uint64_t n = 1;
    for (uint64_t d : p.shape) {
      if (d == 0)
        return Status(StatusCode::kInvalidArgument, fmt::format("model: parameter {} has a zero dimension", p.name));
      if (n > (uint64_t{1} << 60) / d)
        return Status(StatusCode::kInvalidArgument, fmt::format("model: parameter {} is too large", p.name));
      n *= d;
    }
  }
  return Status::ok_status();
}

Result<ModelSpec> llama_model_spec(const LlamaShape& s, uint32_t world_size, uint32_t rank) {
  if (s.layers == 0 || s.dim == 0 || s.heads == 0 || s.kv_heads == 0 || s.ffn_dim == 0 || s.vocab == 0)
    return Status(StatusCode::kInvalidArgument,
                  "llama shape: layers, dim, heads, kv_heads, ffn_dim and vocab must be positive");
  if (s.head_dim == 0 && s.dim % s.heads != 0)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("llama shape: dim {} is not divisible by heads {}", s.dim, s.heads));
  if (s.heads % s.kv_heads != 0)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("llama shape: heads {} is not divisible by kv_heads {}", s.heads, s.kv_heads));
  const uint64_t hd = s.head_dim_or_default();
  const uint64_t q_dim = hd * s.heads, kv_dim = hd * s.kv_heads;
  ModelSpec m;
  m.world_size = world_size;
  m.rank = rank;
  auto add = [&](std::string name, std::vector<uint64_t> shape, const std::string& group) {
    m.params.push_back(ParamSpec{std::move(name), std::move(shape), s.dtype, group});
  };
  if (s.lora_targets != 0 && s.lora_rank == 0)
    return Status(StatusCode::kInvalidArgument, "llama shape: LoRA targets without a rank");
  if (s.lora_targets & ~kAllLoraTargets)
    return Status(StatusCode::kInvalidArgument, fmt::format("llama shape: unknown LoRA target bits {:#x}", s.lora_targets));
  const LlamaExtents x{static_cast<int64_t>(s.dim), static_cast<int64_t>(q_dim), static_cast<int64_t>(kv_dim),
                       static_cast<int64_t>(s.ffn_dim), static_cast<int64_t>(s.vocab), static_cast<int64_t>(hd),
                       static_cast<int64_t>(s.lora_rank)};
  add(model_weight_name(kEmbedTokens), weight_row(kEmbedTokens).shape(x), "embed");
  for (uint32_t i = 0; i < s.layers; ++i) {
    const std::string g = fmt::format("layers.{}", i);
    for (LayerTensor t : kAllLayerTensors) {
      if (!layer_has(t, s.qkv_bias, s.qk_norm, s.lora_targets)) continue;
      add(layer_weight_name(i, t), weight_row(t).shape(x), g);
      if (weight_row(t).feature == Feature::kLora) m.params.back().compute_dtype = s.lora_dtype;
    }
  }
  add(model_weight_name(kFinalNorm), weight_row(kFinalNorm).shape(x), "head");
  if (!s.tied_embeddings) add(model_weight_name(kLmHead), weight_row(kLmHead).shape(x), "head");
  STRATA_RETURN_IF_ERROR(validate_model_spec(m));
  return m;
}

}  // namespace strata
