#include "model/llama_config.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "common/json.h"
#include "common/log.h"
#include "model/llama_weights.h"

namespace strata::model {
namespace {

using json = nlohmann::json;

// `why` may quote the file's value: clipped, so a 5 MB string is not echoed whole.
Status key_error(const std::string& source, const std::string& key, const std::string& why) {
  return Status(StatusCode::kInvalidArgument, fmt::format("{}: \"{}\" {}", source, key, clip_for_message(why, 300)));
}

std::string shape_str(const std::vector<uint64_t>& s) {
  return fmt::format("[{}]", fmt::join(s, ", "));
}

}  // namespace

LlamaShape LlamaConfig::shape() const {
  LlamaShape s;
  s.layers = num_hidden_layers;
  s.dim = hidden_size;
  s.heads = num_attention_heads;
  s.kv_heads = num_key_value_heads;
  s.ffn_dim = intermediate_size;
  s.vocab = vocab_size;
  s.tied_embeddings = tie_word_embeddings;
  s.dtype = torch_dtype;
  s.head_dim = head_dim_explicit;
  s.qkv_bias = arch == ModelArch::kQwen2;
  s.qk_norm = arch == ModelArch::kQwen3;
  return s;
}

Status check_sequence_length(const LlamaConfig& c, uint64_t seq, const std::string& where) {
  if (!c.sliding_window || seq <= *c.sliding_window) return {};
  return Status(StatusCode::kInvalidArgument,
                fmt::format("model {}: config.json \"sliding_window\" is {}, shorter than the sequence length {}: {} "
                            "attends only to the last {} tokens there, and Strata does not implement sliding-window "
                            "attention; use --seq {} or less",
                            where, *c.sliding_window, seq, model_arch_class(c.arch), *c.sliding_window,
                            *c.sliding_window));
}

Status validate_llama_config(const LlamaConfig& c) {
  auto bad = [](const char* key, const std::string& why) {
    return Status(StatusCode::kInvalidArgument, fmt::format("llama config: \"{}\" {}", key, why));
  };
  if (c.hidden_size == 0) return bad("hidden_size", "must be positive");
  if (c.intermediate_size == 0) return bad("intermediate_size", "must be positive");
  if (c.num_hidden_layers == 0) return bad("num_hidden_layers", "must be positive");
  if (c.num_attention_heads == 0) return bad("num_attention_heads", "must be positive");
  if (c.num_key_value_heads == 0) return bad("num_key_value_heads", "must be positive");
  if (c.vocab_size == 0) return bad("vocab_size", "must be positive");
  // Bounds before anything is sized from the config: a config.json alone must
  // not make Strata (or `strata plan`) allocate without limit. Both are far
  // above any real model (the largest open ones have ~130 layers, ~1e12
  // parameters).
  constexpr uint64_t kMaxLayers = 4096;
  constexpr double kMaxParams = 1e14;
  if (c.num_hidden_layers > kMaxLayers)
    return bad("num_hidden_layers", fmt::format("{} is more than {}: no real model has that many layers (a damaged "
                                                "config?)", c.num_hidden_layers, kMaxLayers));
  {
    const double dim = double(c.hidden_size), ffn = double(c.intermediate_size), vocab = double(c.vocab_size);
    const double q = std::max(dim, double(c.num_attention_heads) * double(c.head_dim()));
    const double per_layer = 4 * dim * q + 3 * dim * ffn + 2 * dim + 3 * q;  // upper bound (GQA shrinks k/v)
    const double total = double(c.num_hidden_layers) * per_layer + 2 * vocab * dim + dim;
    if (!(total <= kMaxParams)) {
      // The key named is the largest factor of the largest term.
      const double layers = double(c.num_hidden_layers) * per_layer;
      const char* key = "hidden_size";
      if (2 * vocab * dim >= layers)
        key = vocab > dim ? "vocab_size" : "hidden_size";
      else if (3 * dim * ffn >= 4 * dim * q)
        key = ffn > dim ? "intermediate_size" : "hidden_size";
      else if (q > dim)
        key = c.head_dim_explicit != 0 ? "head_dim" : "num_attention_heads";
      return bad(key, fmt::format("makes the model too large: hidden_size {}, intermediate_size {}, vocab_size {}, "
                                  "{} layers and {} heads of {} would be about {:.3g} parameters, more than {:.0e} "
                                  "(a damaged config?)",
                                  c.hidden_size, c.intermediate_size, c.vocab_size, c.num_hidden_layers,
                                  c.num_attention_heads, c.head_dim(), total, kMaxParams));
    }
  }
  if (c.head_dim_explicit == 0 && c.hidden_size % c.num_attention_heads != 0)
    return bad("hidden_size", fmt::format("{} is not divisible by num_attention_heads {} (and no head_dim is given)",
                                          c.hidden_size, c.num_attention_heads));
  if (c.head_dim() % 2 != 0 || c.head_dim() == 0)
    return bad("head_dim", fmt::format("is {}; rotary embeddings need an even head_dim", c.head_dim()));
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    return bad("num_attention_heads", fmt::format("{} is not divisible by num_key_value_heads {}",
                                                  c.num_attention_heads, c.num_key_value_heads));
  if (!(c.rms_norm_eps > 0) || !std::isfinite(c.rms_norm_eps))
    return bad("rms_norm_eps", "must be positive and finite");
  if (!(c.rope.theta > 0) || !std::isfinite(c.rope.theta)) return bad("rope_theta", "must be positive and finite");
  if (c.max_position_embeddings == 0) return bad("max_position_embeddings", "must be positive");
  if (!(c.initializer_range >= 0) || !std::isfinite(c.initializer_range))
    return bad("initializer_range", "must be non-negative and finite");
  return Status::ok_status();
}

namespace {

// RoPE as transformers 5 resolves it (RotaryEmbeddingConfigMixin): the
// settings object is `rope_scaling` (4.x) if present, else `rope_parameters`
// (5.x); rope_theta comes from that object, else the top level, else 10000;
// the type from "rope_type", else "type", else default; llama3 and yarn take
// original_max_position_embeddings from the top level if it is there, else
// from the object, else max_position_embeddings. Every key of the object must
// be one this type reads: anything else might change the math and is refused.
Status parse_rope(const json& root, const std::string& source, bool allow_unsupported, LlamaConfig* c) {
  const json* obj = nullptr;
  std::string where;
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    auto it = root.find(key);
    if (it == root.end() || it->is_null()) continue;
    if (!it->is_object()) return key_error(source, key, fmt::format("must be an object or null, got {}", it->dump()));
    if (it->empty()) continue;
    obj = &*it;
    where = key;
    break;
  }
  RopeSettings& r = c->rope;
  auto number = [&](const json& j, const std::string& key, double* out) -> Status {
    if (!j.is_number()) return key_error(source, key, fmt::format("must be a number, got {}", j.dump()));
    *out = j.get<double>();
    if (!std::isfinite(*out)) return key_error(source, key, "must be finite");
    return Status::ok_status();
  };
  if (auto it = root.find("rope_theta"); it != root.end() && !it->is_null())
    STRATA_RETURN_IF_ERROR(number(*it, "rope_theta", &r.theta));
  double partial = 1.0;
  if (auto it = root.find("partial_rotary_factor"); it != root.end() && !it->is_null())
    STRATA_RETURN_IF_ERROR(number(*it, "partial_rotary_factor", &partial));
  if (!obj) {
    if (partial != 1.0)
      return key_error(source, "partial_rotary_factor",
                       fmt::format("is {}; Llama rotates the whole head (only 1 is supported)", partial));
    return Status::ok_status();
  }
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    auto it = obj->find(key);
    if (it == obj->end() || it->is_null()) continue;
    if (!it->is_string())
      return key_error(source, where + "." + key, fmt::format("must be a string, got {}", it->dump()));
    type = it->get<std::string>();
    break;
  }
  // Nested per layer type ({"full_attention": {...}, ...}): not a Llama layout.
  for (auto it = obj->begin(); it != obj->end(); ++it)
    if (it->is_object())
      return key_error(source, where + "." + it.key(),
                       "is an object: per-layer-type RoPE settings are not supported for Llama models");
  if (type == "default") {
    r.type = RopeType::kDefault;
  } else if (type == "linear") {
    r.type = RopeType::kLinear;
  } else if (type == "llama3") {
    r.type = RopeType::kLlama3;
  } else if (type == "yarn") {
    r.type = RopeType::kYarn;
  } else {
    if (allow_unsupported) {
      c->rope_scaling = obj->dump();
      return Status::ok_status();
    }
    return key_error(source, where + ".rope_type",
                     fmt::format("is \"{}\"; Strata implements the RoPE types default, linear, llama3 and yarn",
                                 clip_for_message(type, 100)));
  }
  std::set<std::string> allowed = {"rope_type", "type", "rope_theta", "partial_rotary_factor"};
  std::set<std::string> required;
  switch (r.type) {
    case RopeType::kDefault: break;
    case RopeType::kLinear: allowed.insert("factor"), required = {"factor"}; break;
    case RopeType::kLlama3:
      for (const char* k : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
        allowed.insert(k);
      required = {"factor", "low_freq_factor", "high_freq_factor"};
      break;
    case RopeType::kYarn:
      for (const char* k : {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
                            "beta_slow", "mscale", "mscale_all_dim", "truncate"})
        allowed.insert(k);
      required = {"factor"};  // transformers' _compute_yarn_parameters reads it unconditionally
      break;
  }
  for (auto it = obj->begin(); it != obj->end(); ++it) {
    if (!allowed.count(it.key()))
      return key_error(source, where + "." + clip_for_message(it.key(), 100),
                       fmt::format("is not a setting of RoPE type \"{}\" that Strata knows; it may change the "
                                   "math, so the config is refused",
                                   type));
  }
  for (const auto& k : required) {
    auto it = obj->find(k);
    if (it == obj->end() || it->is_null())
      return key_error(source, where + "." + k, fmt::format("is required for RoPE type \"{}\"", type));
  }
  auto get = [&](const char* key, double* out) -> Status {
    auto it = obj->find(key);
    if (it == obj->end() || it->is_null()) return Status::ok_status();
    return number(*it, where + "." + key, out);
  };
  STRATA_RETURN_IF_ERROR(get("rope_theta", &r.theta));
  STRATA_RETURN_IF_ERROR(get("partial_rotary_factor", &partial));
  if (partial != 1.0)
    return key_error(source, where + ".partial_rotary_factor",
                     fmt::format("is {}; Llama rotates the whole head (only 1 is supported)", partial));
  if (r.type == RopeType::kDefault) return Status::ok_status();

  // original_max_position_embeddings: the top level wins (transformers' Phi-3
  // exception), then the object, then max_position_embeddings.
  if (r.type == RopeType::kLlama3 || r.type == RopeType::kYarn) {
    r.original_max_position_embeddings = static_cast<double>(c->max_position_embeddings);
    STRATA_RETURN_IF_ERROR(get("original_max_position_embeddings", &r.original_max_position_embeddings));
    if (auto it = root.find("original_max_position_embeddings"); it != root.end() && !it->is_null())
      STRATA_RETURN_IF_ERROR(number(*it, "original_max_position_embeddings", &r.original_max_position_embeddings));
  }
  if (auto it = obj->find("factor"); it != obj->end() && !it->is_null())
    STRATA_RETURN_IF_ERROR(number(*it, where + ".factor", &r.factor));
  if (!(r.factor > 0)) return key_error(source, where + ".factor", fmt::format("must be positive, got {}", r.factor));
  // Once per process: a run parses its config (and the copy its export
  // writes back) more than once.
  if (r.factor < 1)
    log_once(LogLevel::kWarn, fmt::format("rope-factor-{}={}", where, r.factor),
             fmt::format("{}: {}.factor is {}; transformers expects a factor of at least 1 (used as given)", source,
                         where, r.factor));
  if (r.type == RopeType::kLlama3 || r.type == RopeType::kYarn) {
    if (!(r.original_max_position_embeddings > 0))
      return key_error(source, where + ".original_max_position_embeddings",
                       fmt::format("must be positive, got {}", r.original_max_position_embeddings));
  }
  if (r.type == RopeType::kLlama3) {
    STRATA_RETURN_IF_ERROR(get("low_freq_factor", &r.low_freq_factor));
    STRATA_RETURN_IF_ERROR(get("high_freq_factor", &r.high_freq_factor));
    if (!(r.low_freq_factor > 0) || !(r.high_freq_factor > r.low_freq_factor))
      return key_error(source, where + ".high_freq_factor",
                       fmt::format("is {} with low_freq_factor {}: need 0 < low_freq_factor < high_freq_factor",
                                   r.high_freq_factor, r.low_freq_factor));
  }
  if (r.type == RopeType::kYarn) {
    double v = 0;
    if (auto it = obj->find("attention_factor"); it != obj->end() && !it->is_null()) {
      STRATA_RETURN_IF_ERROR(number(*it, where + ".attention_factor", &v));
      if (v < 0) return key_error(source, where + ".attention_factor", "must not be negative");
      r.attention_factor = v;
    }
    // transformers: `beta_fast or 32`, `beta_slow or 1` (0 means the default too).
    STRATA_RETURN_IF_ERROR(get("beta_fast", &r.beta_fast));
    STRATA_RETURN_IF_ERROR(get("beta_slow", &r.beta_slow));
    if (r.beta_fast == 0) r.beta_fast = 32;
    if (r.beta_slow == 0) r.beta_slow = 1;
    for (const char* k : {"mscale", "mscale_all_dim"}) {
      if (auto it = obj->find(k); it != obj->end() && !it->is_null()) {
        STRATA_RETURN_IF_ERROR(number(*it, where + "." + k, &v));
        (std::string(k) == "mscale" ? r.mscale : r.mscale_all_dim) = v;
      }
    }
    if (auto it = obj->find("truncate"); it != obj->end() && !it->is_null()) {
      if (!it->is_boolean())
        return key_error(source, where + ".truncate", fmt::format("must be true or false, got {}", it->dump()));
      r.truncate = it->get<bool>();
    }
  }
  return Status::ok_status();
}

constexpr uint64_t kBigWindow = uint64_t{1} << 40;  // sliding_window's bound

}  // namespace

namespace {
struct ArchName {
  ModelArch arch;
  const char* type;
  const char* cls;
};
constexpr ArchName kArchNames[] = {{ModelArch::kLlama, "llama", "LlamaForCausalLM"},
                                   {ModelArch::kMistral, "mistral", "MistralForCausalLM"},
                                   {ModelArch::kQwen2, "qwen2", "Qwen2ForCausalLM"},
                                   {ModelArch::kQwen3, "qwen3", "Qwen3ForCausalLM"}};
}  // namespace

const char* model_arch_type(ModelArch a) { return kArchNames[static_cast<int>(a)].type; }
const char* model_arch_class(ModelArch a) { return kArchNames[static_cast<int>(a)].cls; }

Result<LlamaConfig> parse_llama_config(std::string_view text, const std::string& source, bool allow_rope_scaling) {
  json root;
  JsonError jerr;
  if (!parse_json(text, &root, &jerr)) return Status(StatusCode::kCorrupt, source + ": " + jerr.message());
  if (!root.is_object()) return Status(StatusCode::kCorrupt, source + ": not a JSON object");
  LlamaConfig c;
  c.source_json = root.dump();

  auto get_uint = [&](const char* key, bool required, uint64_t* out, uint64_t max) -> Status {
    auto it = root.find(key);
    if (it == root.end() || it->is_null()) {
      if (required) return key_error(source, key, "is missing");
      return Status::ok_status();
    }
    if (!it->is_number_unsigned() || it->get<uint64_t>() > max)
      return key_error(source, key, fmt::format("must be a non-negative integer up to {}, got {}", max, it->dump()));
    *out = it->get<uint64_t>();
    return Status::ok_status();
  };
  auto get_double = [&](const char* key, double* out) -> Status {
    auto it = root.find(key);
    if (it == root.end() || it->is_null()) return Status::ok_status();
    if (!it->is_number()) return key_error(source, key, fmt::format("must be a number, got {}", it->dump()));
    *out = it->get<double>();
    return Status::ok_status();
  };
  auto get_token = [&](const char* key, int64_t* out) -> Status {
    auto it = root.find(key);
    if (it == root.end() || it->is_null()) return Status::ok_status();
    const json* v = &*it;
    if (v->is_array() && !v->empty()) v = &(*v)[0];
    if (!v->is_number_integer()) return key_error(source, key, fmt::format("must be an integer, got {}", it->dump()));
    *out = v->get<int64_t>();
    return Status::ok_status();
  };
  auto get_bool = [&](const char* key, bool* out) -> Status {
    auto it = root.find(key);
    if (it == root.end() || it->is_null()) return Status::ok_status();
    if (!it->is_boolean()) return key_error(source, key, fmt::format("must be true or false, got {}", it->dump()));
    *out = it->get<bool>();
    return Status::ok_status();
  };

  // The architecture: model_type and architectures must agree with each other.
  bool typed = false;
  if (auto it = root.find("model_type"); it != root.end() && !it->is_null()) {
    const std::string v = it->is_string() ? it->get<std::string>() : "";
    const ArchName* found = nullptr;
    for (const ArchName& a : kArchNames)
      if (v == a.type) found = &a;
    if (!found)
      return key_error(source, "model_type",
                       fmt::format("is {}; supported: \"llama\", \"mistral\", \"qwen2\", \"qwen3\"",
                                   clip_for_message(it->dump(), 100)));
    c.arch = found->arch;
    typed = true;
  }
  if (auto it = root.find("architectures"); it != root.end() && !it->is_null()) {
    if (!it->is_array()) return key_error(source, "architectures", "must be a list of names");
    for (const auto& a : *it) {
      const std::string v = a.is_string() ? a.get<std::string>() : "";
      const ArchName* found = nullptr;
      for (const ArchName& n : kArchNames)
        if (v == n.cls) found = &n;
      if (!found)
        return key_error(source, "architectures",
                         fmt::format("names {}; supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                                     "Qwen3ForCausalLM",
                                     clip_for_message(a.dump(), 100)));
      const ModelArch arch = found->arch;
      if (typed && arch != c.arch)
        return key_error(source, "architectures",
                         fmt::format("names {} but model_type is \"{}\"", v, model_arch_type(c.arch)));
      c.arch = arch;
      typed = true;
    }
  }
  // Mistral's attention sees the last sliding_window tokens (null: all).
  // Llama's modeling code never reads the key.
  // Absent: MistralConfig's default, 4096.
  if (c.arch == ModelArch::kMistral) {
    uint64_t w = 4096;
    STRATA_RETURN_IF_ERROR(get_uint("sliding_window", false, &w, kBigWindow));
    if (auto it = root.find("sliding_window"); it == root.end() || !it->is_null()) {
      if (w == 0) return key_error(source, "sliding_window", "must be positive or null");
      c.sliding_window = w;
    }
  }
  // Qwen2/3 (transformers' __post_init__): sliding_window counts only with
  // use_sliding_window; layer_types (written by transformers 5) says which
  // layers slide, else those from max_window_layers on do.
  if (c.arch == ModelArch::kQwen2 || c.arch == ModelArch::kQwen3) {
    bool use = false;
    STRATA_RETURN_IF_ERROR(get_bool("use_sliding_window", &use));
    uint64_t w = 4096, max_window_layers = 28;
    bool have_w = true;
    if (auto it = root.find("sliding_window"); it != root.end() && it->is_null()) have_w = false;
    STRATA_RETURN_IF_ERROR(get_uint("sliding_window", false, &w, kBigWindow));
    STRATA_RETURN_IF_ERROR(get_uint("max_window_layers", false, &max_window_layers, kBigWindow));
    if (have_w && w == 0) return key_error(source, "sliding_window", "must be positive or null");
    const bool window = use && have_w;
    bool any_sliding = false;
    uint64_t n_layers = 0;
    STRATA_RETURN_IF_ERROR(get_uint("num_hidden_layers", true, &n_layers, UINT32_MAX));
    if (auto it = root.find("layer_types"); it != root.end() && !it->is_null()) {
      if (!it->is_array() || it->size() != n_layers)
        return key_error(source, "layer_types", fmt::format("must list num_hidden_layers ({}) layer types", n_layers));
      for (const auto& t : *it) {
        const std::string v = t.is_string() ? t.get<std::string>() : "";
        if (v == "sliding_attention")
          any_sliding = true;
        else if (v != "full_attention")
          return key_error(source, "layer_types",
                           fmt::format("holds {}; known: \"full_attention\", \"sliding_attention\"",
                                       clip_for_message(t.dump(), 100)));
      }
      if (any_sliding && !window)
        return key_error(source, "layer_types",
                         "marks sliding-attention layers but there is no sliding window (use_sliding_window is false "
                         "or sliding_window null)");
    } else {
      any_sliding = window && n_layers > max_window_layers;
    }
    if (any_sliding) c.sliding_window = w;
  }
  // A quantized checkpoint (bitsandbytes, GPTQ, AWQ, FP8, compressed-tensors):
  // its weights are packed integers or scaled floats that transformers
  // dequantizes through the named method; Strata trains float weights only.
  if (auto it = root.find("quantization_config"); it != root.end() && !it->is_null()) {
    std::string method = "?";
    if (it->is_object())
      if (auto m = it->find("quant_method"); m != it->end() && m->is_string()) method = m->get<std::string>();
    return key_error(source, "quantization_config",
                     fmt::format("is present (quant_method \"{}\"): Strata trains bf16, fp16 or fp32 weights, not "
                                 "quantized ones; use the unquantized model (or dequantize it: transformers' "
                                 "dequantize() then save_pretrained)",
                                 clip_for_message(method, 100)));
  }
  constexpr uint64_t k32 = UINT32_MAX;
  constexpr uint64_t kBig = uint64_t{1} << 40;
  uint64_t layers = 0, heads = 0, kv = 0;
  STRATA_RETURN_IF_ERROR(get_uint("hidden_size", true, &c.hidden_size, kBig));
  STRATA_RETURN_IF_ERROR(get_uint("intermediate_size", true, &c.intermediate_size, kBig));
  STRATA_RETURN_IF_ERROR(get_uint("num_hidden_layers", true, &layers, k32));
  STRATA_RETURN_IF_ERROR(get_uint("num_attention_heads", true, &heads, k32));
  STRATA_RETURN_IF_ERROR(get_uint("vocab_size", true, &c.vocab_size, kBig));
  // transformers' defaults when the key is absent: Mistral 8, Qwen2/3 32,
  // Llama the head count; null means the head count everywhere.
  kv = c.arch == ModelArch::kMistral ? 8 : (c.arch == ModelArch::kQwen2 || c.arch == ModelArch::kQwen3) ? 32 : heads;
  const bool kv_absent = root.find("num_key_value_heads") == root.end();
  if (auto it = root.find("num_key_value_heads"); it != root.end() && it->is_null()) kv = heads;
  STRATA_RETURN_IF_ERROR(get_uint("num_key_value_heads", false, &kv, k32));
  if (kv_absent && kv != heads && (kv == 0 || heads % kv != 0))
    return key_error(source, "num_key_value_heads",
                     fmt::format("is absent, so {}'s default {} applies, and num_attention_heads {} is not divisible "
                                 "by it; give num_key_value_heads",
                                 model_arch_class(c.arch), kv, heads));
  c.num_hidden_layers = static_cast<uint32_t>(layers);
  c.num_attention_heads = static_cast<uint32_t>(heads);
  c.num_key_value_heads = static_cast<uint32_t>(kv);
  // Absent: each config class's default (it sets llama3's and yarn's
  // original context when those do not).
  c.max_position_embeddings = c.arch == ModelArch::kMistral ? 131072
                              : (c.arch == ModelArch::kQwen2 || c.arch == ModelArch::kQwen3) ? 32768
                                                                                               : 2048;
  STRATA_RETURN_IF_ERROR(get_uint("max_position_embeddings", false, &c.max_position_embeddings, kBig));
  // null: transformers' RMSNorm would add None (a TypeError at the first forward).
  if (auto it = root.find("rms_norm_eps"); it != root.end() && it->is_null())
    return key_error(source, "rms_norm_eps", "is null; transformers cannot run such a model (give a number)");
  STRATA_RETURN_IF_ERROR(get_double("rms_norm_eps", &c.rms_norm_eps));
  STRATA_RETURN_IF_ERROR(get_double("initializer_range", &c.initializer_range));
  STRATA_RETURN_IF_ERROR(get_double("attention_dropout", &c.attention_dropout));
  if (!(c.attention_dropout >= 0 && c.attention_dropout <= 1))
    return key_error(source, "attention_dropout",
                     fmt::format("is {}: a dropout probability is in [0, 1] (torch refuses it)", c.attention_dropout));
  STRATA_RETURN_IF_ERROR(get_bool("tie_word_embeddings", &c.tie_word_embeddings));
  STRATA_RETURN_IF_ERROR(get_token("bos_token_id", &c.bos_token_id));
  STRATA_RETURN_IF_ERROR(get_token("eos_token_id", &c.eos_token_id));
  // nn.Embedding(vocab, hidden, padding_idx=pad_token_id): an integer in
  // [-vocab, vocab), a negative one counted from the end; torch refuses
  // anything else, so does Strata.
  if (auto it = root.find("pad_token_id"); it != root.end() && !it->is_null()) {
    const int64_t vocab = static_cast<int64_t>(std::min<uint64_t>(c.vocab_size, INT64_MAX));
    if (!it->is_number_integer())
      return key_error(source, "pad_token_id",
                       fmt::format("must be an integer (nn.Embedding's padding_idx) or null, got {}",
                                   clip_for_message(it->dump(), 100)));
    const bool neg = it->is_number_integer() && !it->is_number_unsigned();
    const int64_t v = neg ? it->get<int64_t>() : static_cast<int64_t>(std::min<uint64_t>(it->get<uint64_t>(), INT64_MAX));
    if (v >= vocab || v < -vocab)
      return key_error(source, "pad_token_id",
                       fmt::format("is {}, outside the vocabulary (vocab_size {}): nn.Embedding's padding_idx must "
                                   "be in [-vocab_size, vocab_size)",
                                   v, c.vocab_size));
    c.pad_token_id = v < 0 ? v + vocab : v;
  }

  // Newer transformers write "dtype", older "torch_dtype"; with both,
  // transformers 5 takes "dtype" (torch_dtype is its deprecated alias).
  c.torch_dtype = DType::kF32;
  c.dtype_given = false;
  for (const char* key : {"dtype", "torch_dtype"}) {
    auto it = root.find(key);
    if (it == root.end() || it->is_null()) continue;
    c.dtype_given = true;
    const std::string v = it->is_string() ? it->get<std::string>() : it->dump();
    if (v == "bfloat16")
      c.torch_dtype = DType::kBF16;
    else if (v == "float16")
      c.torch_dtype = DType::kF16;
    else if (v == "float32")
      c.torch_dtype = DType::kF32;
    else
      return key_error(source, key,
                       fmt::format("is {}; expected \"bfloat16\", \"float16\" or \"float32\"", it->dump()));
    break;
  }
  // Biases: Llama reads attention_bias (q/k/v/o) and mlp_bias, Qwen3
  // attention_bias (q/k/v/o); Mistral's and Qwen2's layers fix theirs
  // (Qwen2: q/k/v biases always) and ignore the keys, as transformers does.
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    const bool read = c.arch == ModelArch::kLlama || (c.arch == ModelArch::kQwen3 && std::string(key) == "attention_bias");
    if (!read) continue;
    bool b = false;
    STRATA_RETURN_IF_ERROR(get_bool(key, &b));
    if (b)
      return key_error(source, key,
                       fmt::format("is true; {} layers with these bias terms are not supported", model_arch_class(c.arch)));
  }
  // null too: transformers would look up ACT2FN[None] and fail to build it.
  // "swish" is torch.nn.SiLU in transformers' ACT2FN: the same function.
  if (auto it = root.find("hidden_act"); it != root.end()) {
    if (!it->is_string() || (it->get<std::string>() != "silu" && it->get<std::string>() != "swish"))
      return key_error(source, "hidden_act",
                       fmt::format("is {}; only \"silu\" (SwiGLU; \"swish\" is the same) is supported", it->dump()));
  }
  // head_dim: explicit (transformers 5 reads it for every one of these
  // architectures), Qwen3's default 128 when absent, else hidden / heads.
  if (auto it = root.find("head_dim"); it != root.end() && !it->is_null()) {
    if (!it->is_number_unsigned() || it->get<uint64_t>() == 0 || it->get<uint64_t>() > 4096)
      return key_error(source, "head_dim", fmt::format("must be an integer in 1..4096, got {}", it->dump()));
    c.head_dim_explicit = it->get<uint64_t>();
  } else if (it == root.end() && c.arch == ModelArch::kQwen3) {
    c.head_dim_explicit = 128;
  }
  if (c.head_dim_explicit && c.head_dim_explicit == (c.num_attention_heads ? c.hidden_size / c.num_attention_heads : 0) &&
      c.hidden_size % std::max<uint32_t>(c.num_attention_heads, 1) == 0)
    c.head_dim_explicit = 0;  // the same as derived: one spelling
  STRATA_RETURN_IF_ERROR(parse_rope(root, source, allow_rope_scaling, &c));
  STRATA_RETURN_IF_ERROR(validate_llama_config(c).with_context(source));
  return c;
}

Result<LlamaConfig> load_llama_config(const std::string& path, bool allow_rope_scaling) {
  // A FIFO or device would block the read (or never end): refused.
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    return Status(StatusCode::kInvalidArgument, path + " is not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::from_errno(errno, "open of " + path + " failed");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status(StatusCode::kIoError, "read of " + path + " failed");
  return parse_llama_config(ss.str(), path, allow_rope_scaling);
}

Status copy_model_side_files(const std::string& from, const std::string& to, std::vector<std::string>* copied) {
  static const char* const kFiles[] = {"tokenizer.json",    "tokenizer_config.json", "tokenizer.model",
                                       "special_tokens_map.json", "added_tokens.json", "vocab.json",
                                       "merges.txt",        "chat_template.jinja",   "generation_config.json"};
  copied->clear();
  for (const char* name : kFiles) {
    const std::string src = from + "/" + name;
    struct stat st {};
    if (::stat(src.c_str(), &st) != 0) continue;
    if (!S_ISREG(st.st_mode)) {  // a directory, a FIFO, /dev/zero: never read
      log_warn("{} is not a regular file: not copied to {}", src, to);
      continue;
    }
    std::ifstream in(src, std::ios::binary);
    if (!in) return Status::from_errno(errno, "open of " + src + " failed");
    std::ostringstream ss;
    ss << in.rdbuf();
    if (in.bad()) return Status(StatusCode::kIoError, "read of " + src + " failed");
    STRATA_RETURN_IF_ERROR(write_file_atomic(to + "/" + name, ss.str()));
    copied->push_back(name);
  }
  return {};
}

std::string llama_config_to_json(const LlamaConfig& c) {
  const char* dtype = c.torch_dtype == DType::kBF16 ? "bfloat16" : c.torch_dtype == DType::kF16 ? "float16" : "float32";
  if (!c.source_json.empty()) {
    // The model's own config: every field (RoPE in its layout, generation
    // settings, ...) as it was; only the dtype follows the exported weights.
    // Used only while the fields Strata reads still say what it says (a
    // config edited after parsing is written from its fields).
    json src = json::parse(c.source_json, nullptr, false);
    auto same = parse_llama_config(c.source_json, "source", !c.rope_scaling.empty());
    const bool unchanged =
        same.ok() && same->hidden_size == c.hidden_size && same->intermediate_size == c.intermediate_size &&
        same->num_hidden_layers == c.num_hidden_layers && same->num_attention_heads == c.num_attention_heads &&
        same->num_key_value_heads == c.num_key_value_heads && same->vocab_size == c.vocab_size &&
        same->rms_norm_eps == c.rms_norm_eps && same->rope == c.rope &&
        same->max_position_embeddings == c.max_position_embeddings &&
        same->tie_word_embeddings == c.tie_word_embeddings && same->bos_token_id == c.bos_token_id &&
        same->eos_token_id == c.eos_token_id && same->initializer_range == c.initializer_range &&
        same->attention_dropout == c.attention_dropout && same->rope_scaling == c.rope_scaling &&
        same->arch == c.arch && same->sliding_window == c.sliding_window &&
        same->head_dim_explicit == c.head_dim_explicit;
    if (unchanged && src.is_object()) {
      bool set = false;
      for (const char* key : {"torch_dtype", "dtype"}) {
        if (src.contains(key)) src[key] = dtype, set = true;
      }
      if (!set) src["torch_dtype"] = dtype;
      return src.dump(2) + "\n";
    }
  }
  json j = {
      {"architectures", {model_arch_class(c.arch)}},
      {"model_type", model_arch_type(c.arch)},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"head_dim", c.head_dim()},
      {"vocab_size", c.vocab_size},
      {"rms_norm_eps", c.rms_norm_eps},
      {"rope_theta", c.rope.theta},
      {"rope_scaling", nullptr},
      {"max_position_embeddings", c.max_position_embeddings},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"mlp_bias", false},
      {"initializer_range", c.initializer_range},
      {"pretraining_tp", 1},
      {"use_cache", true},
      {"torch_dtype", dtype},
  };
  j["bos_token_id"] = c.bos_token_id >= 0 ? json(c.bos_token_id) : json(nullptr);
  j["eos_token_id"] = c.eos_token_id >= 0 ? json(c.eos_token_id) : json(nullptr);
  if (!c.rope_scaling.empty()) {
    j["rope_scaling"] = json::parse(c.rope_scaling, nullptr, false);
  } else if (c.rope.type != RopeType::kDefault) {
    const RopeSettings& r = c.rope;
    json s = {{"rope_type", rope_type_name(r.type)}, {"factor", r.factor}};
    if (r.type == RopeType::kLlama3) {
      s["low_freq_factor"] = r.low_freq_factor;
      s["high_freq_factor"] = r.high_freq_factor;
    }
    if (r.type == RopeType::kLlama3 || r.type == RopeType::kYarn)
      s["original_max_position_embeddings"] = r.original_max_position_embeddings;
    if (r.type == RopeType::kYarn) {
      s["beta_fast"] = r.beta_fast;
      s["beta_slow"] = r.beta_slow;
      s["truncate"] = r.truncate;
      if (r.attention_factor) s["attention_factor"] = *r.attention_factor;
      if (r.mscale) s["mscale"] = *r.mscale;
      if (r.mscale_all_dim) s["mscale_all_dim"] = *r.mscale_all_dim;
    }
    j["rope_scaling"] = s;
  }
  return j.dump(2) + "\n";
}

Status save_llama_config(const LlamaConfig& c, const std::string& path) {
  STRATA_RETURN_IF_ERROR(validate_llama_config(c));
  return write_file_atomic(path, llama_config_to_json(c));
}

std::vector<TensorDecl> llama_tensor_decls(const LlamaConfig& c, StDType dtype) {
  std::vector<TensorDecl> out;
  auto spec = llama_model_spec(c.shape());
  if (!spec.ok()) return out;
  for (auto& p : spec->params) out.push_back(TensorDecl{p.name, dtype, p.shape});
  return out;
}

const TensorInfo* ModelDir::find(std::string_view name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

Result<ModelDir> open_model_dir(const std::string& dir) {
  ModelDir m;
  m.dir = dir;
  struct stat st {};
  if (::stat(dir.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
    return Status(StatusCode::kInvalidArgument,
                  dir + " is a file, not a model directory (config.json beside model.safetensors or its shards)");
  STRATA_ASSIGN_OR_RETURN(m.config, load_llama_config(dir + "/config.json"));
  STRATA_ASSIGN_OR_RETURN(std::vector<TensorInfo> found, read_model_tensors(dir));
  std::map<std::string, TensorInfo*> by_name;
  for (auto& t : found) by_name[t.name] = &t;

  std::vector<std::string> missing, wrong_shape, wrong_dtype, unexpected;
  std::set<std::string> used;
  LlamaConfig untied = m.config;
  untied.tie_word_embeddings = false;
  for (const auto& d : llama_tensor_decls(untied, StDType::kF32)) {
    const bool optional = m.config.tie_word_embeddings && d.name == weight_row(kLmHead).name;
    auto it = by_name.find(d.name);
    if (it == by_name.end()) {
      if (!optional) missing.push_back(d.name);
      continue;
    }
    used.insert(d.name);
    const TensorInfo& t = *it->second;
    if (t.shape != d.shape)
      wrong_shape.push_back(fmt::format("{} is {}, expected {}", d.name, shape_str(t.shape), shape_str(d.shape)));
    else if (!to_dtype(t.dtype))
      wrong_dtype.push_back(fmt::format("{} is {}", d.name, st_dtype_name(t.dtype)));
    if (!optional)
      m.tensors.push_back(t);
    else
      m.tied_head = t;
  }
  for (const auto& t : found) {
    if (used.count(t.name)) continue;
    if (t.name.size() >= 21 && t.name.ends_with(".rotary_emb.inv_freq")) continue;
    unexpected.push_back(t.name);
  }
  if (missing.empty() && wrong_shape.empty() && wrong_dtype.empty() && unexpected.empty()) {
    // No dtype in config.json: transformers 5 loads the model in its weights'
    // dtype (from_pretrained's dtype "auto"), and so does Strata; weights of
    // several dtypes leave it to the config, by name.
    if (!m.config.dtype_given && !m.tensors.empty()) {
      const StDType first = m.tensors.front().dtype;
      for (const TensorInfo& t : m.tensors)
        if (t.dtype != first)
          return Status(StatusCode::kInvalidArgument,
                        fmt::format("{}/config.json names no dtype and the weights mix {} ({}) and {} ({}): add "
                                    "\"dtype\": \"bfloat16\", \"float16\" or \"float32\" to it",
                                    dir, st_dtype_name(first), m.tensors.front().name, st_dtype_name(t.dtype), t.name));
      m.config.torch_dtype = *to_dtype(first);
      m.config.dtype_given = true;
    }
    return m;
  }

  auto list = [](const char* what, const std::vector<std::string>& v) -> std::string {
    if (v.empty()) return "";
    constexpr size_t kShow = 5;
    std::string s = fmt::format("; {} ({}): ", what, v.size());
    for (size_t i = 0; i < v.size() && i < kShow; ++i) s += (i ? ", " : "") + v[i];
    if (v.size() > kShow) s += fmt::format(", ... ({} more)", v.size() - kShow);
    return s;
  };
  std::string msg = fmt::format(
      "{}: the weights do not match config.json ({} layers, hidden {}, {} heads, {} kv heads, "
      "ffn {}, vocab {}{})",
      dir, m.config.num_hidden_layers, m.config.hidden_size, m.config.num_attention_heads, m.config.num_key_value_heads,
      m.config.intermediate_size, m.config.vocab_size, m.config.tie_word_embeddings ? ", tied embeddings" : "");
  msg += list("missing", missing);
  msg += list("wrong shape", wrong_shape);
  msg += list("not F32/BF16/F16", wrong_dtype);
  msg += list("unexpected", unexpected);
  return Status(StatusCode::kCorrupt, msg);
}

Status check_tied_head(const ModelDir& m, TensorReader& reader) {
  if (!m.tied_head) return {};
  const TensorInfo* embed = m.find(weight_row(kEmbedTokens).name);
  if (embed == nullptr || embed->numel() != m.tied_head->numel())
    return Status(StatusCode::kInternal, m.dir + ": the tied embedding to compare lm_head.weight with is missing");
  const uint64_t n = embed->numel();
  constexpr uint64_t kChunk = 1u << 20;
  std::vector<float> a(std::min(n, kChunk)), b(a.size());
  for (uint64_t at = 0; at < n; at += kChunk) {
    const uint64_t count = std::min(kChunk, n - at);
    STRATA_RETURN_IF_ERROR(reader.read(*embed, DType::kF32, a.data(), at, count));
    STRATA_RETURN_IF_ERROR(reader.read(*m.tied_head, DType::kF32, b.data(), at, count));
    uint64_t i = 0;  // values, as torch.equal (transformers' test): -0 equals 0
    while (i < count && a[i] == b[i]) ++i;
    if (i == count) continue;
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: config.json ties the embeddings (tie_word_embeddings), but the weights' "
                              "lm_head.weight differs from model.embed_tokens.weight (element {}: {} against {}); "
                              "transformers 5 would use lm_head.weight untied, older versions the embedding. Set "
                              "\"tie_word_embeddings\": false to train them untied, or remove lm_head.weight",
                              m.dir, at + i, b[i], a[i]));
  }
  return {};
}

}  // namespace strata::model
