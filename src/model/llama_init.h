// Random initialisation of a Llama model as Hugging Face does it
// (LlamaPreTrainedModel._init_weights): every linear and embedding weight
// normal(0, initializer_range), every RMSNorm weight 1.
//
// Deterministic by seed and independent of thread count, order and machine:
// element i of tensor `name` is a pure function of (seed, name, i) — a
// splitmix64 counter-based generator feeding Box-Muller — so any range of any
// tensor can be produced alone (streamed to disk or into a shard) and gives
// the same bits as producing the whole model at once. Thread-safe (pure).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"
#include "model/llama_config.h"

namespace strata::model {

// Standard normal sample number `i` of stream `stream` under `seed`.
float init_normal(uint64_t seed, uint64_t stream, uint64_t i);

// True for the weights initialised to ones: the RMSNorm weights of the weight
// table (model/llama_weights.h), "model.norm.weight" and a layer's
// "model.layers.<i>.input_layernorm.weight" / "...post_attention_layernorm.weight".
bool is_norm_weight(std::string_view name);

// Elements [begin, begin + count) of tensor `name`'s initial value, as fp32.
void llama_init_values(std::string_view name, uint64_t seed, double stddev, uint64_t begin, uint64_t count, float* out);

// Writes DIR/config.json and the weights (one file, or shards of at most
// max_shard_bytes; 0 = one file) of a freshly initialised model, streaming
// (memory use: a few MiB whatever the model size). `dir` must exist.
// Blocking; `stop` (a signal handler's flag), when set, ends it between
// chunks of 1M elements with kCancelled. A write that fails or is stopped
// leaves none of its files. Errors: from validate_llama_config and the
// writers.
Status write_random_llama(const std::string& dir, const LlamaConfig& config, StDType dtype, uint64_t seed,
                          uint64_t max_shard_bytes = 0, const std::atomic<bool>* stop = nullptr);

}  // namespace strata::model
