// What the runtime and the planner know about a model: its parameters (name,
// shape, compute dtype, group) and how each is split into rank shards.
//
// Pure data and arithmetic: no tensors are allocated, so a 70B description
// costs a few kilobytes. Thread-safe (no shared state).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"

namespace strata {

// Element types: DType, dtype_size and dtype_name from common/dtype.h.

// Learning-rate groups a model may number (the engine keeps a table indexed
// by lr_group and copies it to each step).
inline constexpr uint32_t kMaxLrGroups = 65536;

struct ParamSpec {
  std::string name;             // e.g. "model.layers.3.mlp.up_proj.weight"
  std::vector<uint64_t> shape;  // empty shape: a scalar (1 element)
  DType compute_dtype = DType::kBF16;
  std::string group;  // unit of acquire/release, e.g. "layers.3"
  // false: the optimizer never decays this parameter (weight_decay 0 for it);
  // Hugging Face's Trainer convention for biases and norm weights
  // (hf_no_decay below).
  bool weight_decay = true;
  // false: a frozen parameter (requires_grad=False; a LoRA/PEFT base): its
  // compute copy is placed and streamed like any other, but it has no fp32
  // master, no optimizer state and no gradient accumulator, reduce_grad
  // refuses it and the optimizer never writes it.
  bool trainable = true;
  // The learning-rate group (a torch param_groups index, below kMaxLrGroups):
  // Engine::set_group_lr gives a group its own lr; a group without one
  // follows the step's lr.
  uint32_t lr_group = 0;
  uint64_t numel() const;
};

// Hugging Face Trainer's rule (get_decay_parameter_names): no weight decay
// for parameters whose name contains "bias", "layernorm" or "rmsnorm", or has
// a component "norm" or ending in "_norm" (case-insensitive): biases and the
// RMSNorm weights of a Llama model; embeddings and projections are decayed.
bool hf_no_decay(std::string_view param_name);

// Parameters in the order the trainer first uses them; groups appear in that
// order too (a group's parameters need not be contiguous in the list).
struct ModelSpec {
  std::vector<ParamSpec> params;
  uint32_t world_size = 1;
  uint32_t rank = 0;

  uint64_t numel() const;
  // Group names in order of first appearance.
  std::vector<std::string> group_names() const;
};

// One rank's shard of a flat parameter of `numel` elements. Every rank holds
// `padded` elements of storage (the same on every rank, a multiple of the
// alignment); the first `end - begin` of them are the parameter's elements
// [begin, end), the rest is padding. Ranks past the end hold only padding.
struct ShardRange {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t padded = 0;
  uint64_t size() const { return end - begin; }
  bool operator==(const ShardRange&) const = default;
};

// padded = round_up(ceil(numel / world_size), alignment); rank r covers
// [min(r * padded, numel), min((r + 1) * padded, numel)). Shards of all ranks
// tile [0, numel) exactly. world_size >= 1, rank < world_size, alignment >= 1
// (checked with assert; validate inputs with validate_model_spec first).
ShardRange shard_range(uint64_t numel, uint32_t world_size, uint32_t rank, uint64_t alignment);

// kInvalidArgument naming the parameter for: empty name or group, a zero or
// overflowing dimension, duplicate names, world_size 0, rank >= world_size.
Status validate_model_spec(const ModelSpec& model);

// Llama-architecture decoder (RMSNorm, GQA, SwiGLU), tensor names as Hugging
// Face uses them. Groups: "embed" (embed_tokens), "layers.<i>" (attention,
// MLP and both norms of layer i), "head" (final norm and lm_head, or only the
// norm when embeddings are tied).
struct LlamaShape {
  uint32_t layers = 0;
  uint64_t dim = 0;
  uint32_t heads = 0;
  uint32_t kv_heads = 0;
  uint64_t ffn_dim = 0;
  uint64_t vocab = 0;
  bool tied_embeddings = false;
  DType dtype = DType::kBF16;
  uint64_t head_dim = 0;  // 0: dim / heads (Qwen3 and others give it explicitly)
  bool qkv_bias = false;  // Qwen2: q/k/v projection biases
  bool qk_norm = false;   // Qwen3: per-head q/k RMSNorm weights
  // LoRA adapters (model/llama_weights.h: a bit per kLoraTargets entry; 0:
  // none) of rank lora_rank, in lora_dtype, after each layer's other tensors.
  uint32_t lora_targets = 0;
  uint64_t lora_rank = 0;
  DType lora_dtype = DType::kF32;
  uint64_t head_dim_or_default() const { return head_dim ? head_dim : (heads ? dim / heads : 0); }
};
// The parameters in the weight table's order (model/llama_weights.h: per
// layer the nine base tensors, then the architecture's extra ones, then the
// LoRA adapters), named and shaped by that table.
// kInvalidArgument when dim is not divisible by heads (without an explicit
// head_dim) or heads by kv_heads.
Result<ModelSpec> llama_model_spec(const LlamaShape& shape, uint32_t world_size = 1, uint32_t rank = 0);

}  // namespace strata
