// LoRA fine-tuning as PEFT does it: the settings, PEFT's adapter directory
// (adapter_config.json + adapter_model.safetensors) in and out, the
// adapters' initialisation and the merge into the base weights.
//
// Math (model_ops.h, LlamaDims::lora_*): for each targeted projection W
// [out, in], y = x W^T (+ bias) + lora_B(lora_A(dropout(x))) * scaling with
// lora_A [r, in], lora_B [out, r], scaling = lora_alpha / r (rsLoRA:
// lora_alpha / sqrt(r)). The base model is frozen (the engine's
// ParamSpec::trainable = false); only the adapters train, in fp32 (PEFT's
// autocast_adapter_dtype) beside a base in its compute dtype.
//
// Names: the engine's adapter parameters are the weight table's LoRA rows
// ("model.layers.3.self_attn.q_proj.lora_A.weight"); PEFT's file prefixes
// them with "base_model.model." (peft_tensor_name).
//
// Pure functions and file I/O; no state; thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/llama_weights.h"

namespace strata::train {

struct LoraOptions {
  uint32_t rank = 0;        // r; 0: LoRA off (full fine-tuning) unless adapter_dir is set
  double alpha = 8.0;       // lora_alpha (PEFT's default)
  double dropout = 0.0;     // lora_dropout, on the adapters' input in training
  // Adapted projections: a bit per kLoraTargets entry (model/llama_weights.h);
  // 0: PEFT's default for Llama-family models, q_proj and v_proj.
  uint32_t targets = 0;
  // An adapter whose target_modules names modules of some layers only
  // ("model.layers.3.self_attn.q_proj", as PEFT writes "all-linear"): target
  // bit -> the layers named. A target absent here is adapted in every layer.
  // Strata adapts a projection in every layer or none (checked against the
  // model, check_lora_layers).
  std::map<uint32_t, std::set<uint32_t>> target_layers;
  // An adapter whose target_modules is a regular expression (PEFT:
  // re.fullmatch against every module's full name): targets and
  // target_layers come from it once the layer count is known
  // (resolve_lora_regex); until then targets is 0.
  std::string target_regex;
  bool rslora = false;      // use_rslora: scaling alpha / sqrt(r)
  // Start from this PEFT adapter directory: its adapter_config.json gives
  // r, lora_alpha, lora_dropout, target_modules and use_rslora (flags given
  // as well must agree), its adapter_model.safetensors the weights.
  std::string adapter_dir;
  bool merge = false;       // also export the base with the adapters merged (OUT/model)

  bool enabled() const { return rank > 0 || !adapter_dir.empty(); }
  float scaling() const;
};

// PEFT's default targets for Llama-family models: q_proj and v_proj.
inline constexpr uint32_t kLoraDefaultTargets =
    (1u << lora_target_index(kQProj)) | (1u << lora_target_index(kVProj));

// "q_proj,k_proj" (PEFT's module names), or "all-linear" (every projection)
// -> target bits. kInvalidArgument naming an unknown module and the known ones.
Result<uint32_t> parse_lora_targets(std::string_view csv);
// One entry of a PEFT target_modules list, matched as PEFT matches it: the
// modules whose full name equals it or ends with "." + it. Strata's modules
// are model.layers.<i>.self_attn.{q,k,v,o}_proj and .mlp.{gate,up,down}_proj,
// so "q_proj", "self_attn.q_proj", "layers.3.self_attn.q_proj" and
// "model.layers.3.self_attn.q_proj" are understood; *layer is the layer an
// entry names, -1 for every layer. kInvalidArgument for an entry that selects
// no module Strata adapts (PEFT would adapt another module, or none).
Result<uint32_t> match_lora_target(std::string_view entry, int64_t* layer);
// With o->target_regex set: the modules of a `layers`-layer model it matches
// whole (model.layers.<i>.self_attn.q_proj, ...) become o->targets and
// o->target_layers, for check_lora_layers. kInvalidArgument, naming the
// pattern, when it selects lm_head or model.embed_tokens (not adapted here)
// or no projection at all. No-op without a pattern.
Status resolve_lora_regex(LoraOptions* o, uint32_t layers, const std::string& where);
// kInvalidArgument when o's target_layers leave a target out of some of the
// model's `layers` layers (or name a layer it does not have).
Status check_lora_layers(const LoraOptions& o, uint32_t layers, const std::string& where);
// Bits -> the module names, in table order.
std::vector<std::string> lora_target_names(uint32_t targets);

// Reads dir/adapter_config.json into *o (rank, alpha, dropout, targets,
// rslora). Every field that changes the math is read or refused by name:
// peft_type must be LORA; bias "none"; no DoRA, rank/alpha patterns,
// layers_to_transform, modules_to_save, fan_in_fan_out, ...; a field this
// version does not know is accepted only at an "off" value (null, false, {},
// [], ""). kNotFound / kInvalidArgument naming the file and field.
Status read_peft_adapter_config(const std::string& dir, LoraOptions* o);
// adapter_config.json as PEFT writes it for these settings.
std::string peft_adapter_config_json(const LoraOptions& o, const std::string& base_model);

// "base_model.model." + the engine's parameter name.
std::string peft_tensor_name(std::string_view param_name);

// PEFT's default initialisation (init_lora_weights=True): lora_A
// kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)); lora_B
// zeros (the adapted model starts equal to the base). `t` is a LoRA row.
void lora_init(LayerTensor t, uint64_t rows, uint64_t cols, std::mt19937_64& rng, float* out);

}  // namespace strata::train
