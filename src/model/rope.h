// Rotary position embeddings: the settings a Hugging Face config gives
// (transformers 4.x `rope_theta` + `rope_scaling`, or 5.x `rope_parameters`)
// and the inverse frequencies they define, as transformers computes them
// (modeling_rope_utils.py: default, linear, llama3, yarn).
//
//   RopeSettings r;  // parse_llama_config fills it
//   RopeFrequencies f = rope_frequencies(r, head_dim);
//   // angle(pos, i) = float(pos) * f.inv_freq[i] (fp32);
//   // cos/sin tables = fp32 cos/sin(angle) * f.attention_scaling
//
// Precision: transformers computes inv_freq with fp32 torch ops; Strata
// evaluates the same formulas step by step with the same fp32 roundings
// where torch rounds (the powers theta^(2i/d) in double, rounded once, so
// they may differ from torch's fp32 pow by one unit in the last place).
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace strata::model {

enum class RopeType : uint8_t { kDefault = 0, kLinear, kLlama3, kYarn };
const char* rope_type_name(RopeType t);  // "default", "linear", "llama3", "yarn"

struct RopeSettings {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;  // rope_theta
  // linear, llama3, yarn: the context extension factor.
  double factor = 1.0;
  // llama3, yarn: the pre-training context length.
  double original_max_position_embeddings = 0;
  // llama3
  double low_freq_factor = 1.0, high_freq_factor = 4.0;
  // yarn (transformers' defaults)
  std::optional<double> attention_factor;
  double beta_fast = 32.0, beta_slow = 1.0;
  std::optional<double> mscale, mscale_all_dim;
  bool truncate = true;
  bool operator==(const RopeSettings&) const = default;
};

struct RopeFrequencies {
  std::vector<float> inv_freq;   // head_dim / 2 values
  float attention_scaling = 1.0f;  // multiplies cos and sin (yarn)
};

// The frequencies for an even head_dim.
RopeFrequencies rope_frequencies(const RopeSettings& r, int64_t head_dim);

// "default theta=10000", "llama3 theta=500000 factor=8 low=1 high=4 original=8192", ...
std::string rope_describe(const RopeSettings& r);

}  // namespace strata::model
