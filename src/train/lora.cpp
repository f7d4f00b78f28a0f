#include "train/lora.h"

#include <sys/stat.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "common/json.h"
#include "common/log.h"

namespace strata::train {

using json = nlohmann::json;

float LoraOptions::scaling() const {
  if (rank == 0) return 0.0f;
  return static_cast<float>(rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / rank);
}

namespace {

std::string known_modules() {
  std::string s;
  for (LayerTensor t : kLoraTargets) s += (s.empty() ? "" : ", ") + std::string(lora_module_name(t));
  return s + ", all-linear";
}

Result<uint32_t> target_bit(std::string_view name) {
  for (LayerTensor t : kLoraTargets)
    if (lora_module_name(t) == name) return 1u << lora_target_index(t);
  return Status(StatusCode::kInvalidArgument,
                fmt::format("LoRA target module \"{}\" is not one Strata adapts (known: {})", clip_for_message(name),
                            known_modules()));
}

// "self_attn.q_proj" for kQProj: the module's path inside a layer.
std::string_view module_path(LayerTensor t) {
  std::string_view n = weight_row(t).name;
  return n.substr(0, n.size() - std::string_view(".weight").size());
}

bool all_digits(std::string_view s) {
  return !s.empty() && s.size() <= 9 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// A value that turns a feature off: null, false, 0-free empties.
bool is_off(const json& v) {
  return v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_object() && v.empty()) ||
         (v.is_array() && v.empty()) || (v.is_string() && v.get<std::string>().empty());
}

// PEFT's init_lora_weights, which PEFT runs again whenever it loads the
// adapter. The plain ones only initialise lora_A/lora_B, which the file's
// weights then replace: true, false, "gaussian", "orthogonal", "eva", and
// "lora_ga" (without the gradients preprocess_loraga attaches, it falls back
// to the default). The others change the model PEFT builds from the same
// files, so Strata, which adds the adapter to the base weights as the model
// directory holds them, would train and export another model: PiSSA, CorDA,
// OLoRA and LoftQ replace the base weight by a residual (W - scale*B0*A0, a
// quantized W), MiCA freezes lora_B.
Status check_init_lora_weights(const std::string& path, const json& v) {
  if (v.is_boolean()) return {};
  const std::string s = v.is_string() ? v.get<std::string>() : "";
  std::string low = s;
  for (char& c : low) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  // PEFT compares "gaussian" case-insensitively (init_lora_weights.lower()).
  if (low == "gaussian") return {};
  for (const char* plain : {"orthogonal", "eva", "lora_ga"})
    if (s == plain) return {};
  const char* what = nullptr;
  if (s.rfind("pissa", 0) == 0)
    what = "PiSSA";
  else if (s.rfind("corda", 0) == 0)
    what = "CorDA";
  else if (low == "olora")
    what = "OLoRA";
  else if (s == "loftq")
    what = "LoftQ";
  if (what != nullptr)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: \"init_lora_weights\" is {}: not supported by Strata. When PEFT loads this adapter, "
                              "{} replaces each adapted base weight by a residual computed from it, while Strata adds "
                              "the adapter to the base weights as the model directory holds them (a different model). "
                              "Convert it to a plain LoRA adapter first (PEFT's save_pretrained(..., "
                              "path_initial_model_for_weight_conversion=...)), or train with a fresh adapter",
                              path, clip_for_message(v.dump()), what));
  if (low == "mica")
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: \"init_lora_weights\" is {}: not supported by Strata (MiCA freezes lora_B and "
                              "trains lora_A only)",
                              path, clip_for_message(v.dump())));
  return Status(StatusCode::kInvalidArgument,
                fmt::format("{}: \"init_lora_weights\" is {}: a value this version of Strata does not know (it takes "
                            "true, false, \"gaussian\", \"orthogonal\", \"eva\", \"lora_ga\"); refused rather "
                            "than ignored",
                            path, clip_for_message(v.dump())));
}

// PEFT matches a string target_modules with Python's re.fullmatch; Strata
// with std::regex's ECMAScript grammar, which reads the patterns adapters
// use alike (., *, +, ?, |, (), (?:), [], \d, \w, \., {m,n}, ^, $) but not
// Python's inline flags, named groups, lookbehind, \A / \Z, octal and \U / \N
// escapes, possessive quantifiers or {,n}, nor does Python read POSIX
// classes ([[:alpha:]]): those are refused rather than read another way
// (std::regex takes \Z for "Z", Python [[:alpha:]] for a set).
Result<std::regex> compile_lora_regex(const std::string& pattern) {
  if (pattern.empty()) return Status(StatusCode::kInvalidArgument, "an empty pattern selects no module");
  for (size_t i = 0; i + 1 < pattern.size(); ++i) {
    const char c = pattern[i], d = pattern[i + 1];
    bool escaped = false;  // c follows an odd number of backslashes
    for (size_t j = i; j > 0 && pattern[j - 1] == '\\'; --j) escaped = !escaped;
    if (escaped) continue;
    if (c == '\\' && (d == 'A' || d == 'Z' || d == 'z' || d == 'U' || d == 'N' || (d >= '0' && d <= '9')))
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("\\{} (Python's anchor, octal, back-reference or named escape) is not read alike here",
                                d));
    if (c == '(' && d == '?' && (i + 2 >= pattern.size() || !std::strchr(":=!", pattern[i + 2])))
      return Status(StatusCode::kInvalidArgument,
                    "(?... other than (?:...), (?=...), (?!...) (Python's flags, named groups, lookbehind) is not "
                    "read here");
    if (c == '{' && d == ',')
      return Status(StatusCode::kInvalidArgument, "{,n} (Python's) is not read here: write {0,n}");
    if (std::strchr("*+?}", c) && d == '+')
      return Status(StatusCode::kInvalidArgument, fmt::format("{}+ (a possessive quantifier) is not read here", c));
    if (c == '[' && (d == ':' || d == '.' || d == '='))
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("[{} (a POSIX class, which Python reads as a set) is not read here", d));
  }
  try {
    return std::regex(pattern, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    return Status(StatusCode::kInvalidArgument, fmt::format("not a regular expression ({})", e.what()));
  }
}

}  // namespace

Result<uint32_t> parse_lora_targets(std::string_view csv) {
  uint32_t bits = 0;
  size_t start = 0;
  while (start <= csv.size()) {
    size_t end = csv.find(',', start);
    if (end == std::string_view::npos) end = csv.size();
    std::string_view name = csv.substr(start, end - start);
    while (!name.empty() && name.front() == ' ') name.remove_prefix(1);
    while (!name.empty() && name.back() == ' ') name.remove_suffix(1);
    if (name == "all-linear") {
      bits |= kAllLoraTargets;
    } else if (!name.empty()) {
      STRATA_ASSIGN_OR_RETURN(uint32_t b, target_bit(name));
      bits |= b;
    }
    start = end + 1;
  }
  if (bits == 0) return Status(StatusCode::kInvalidArgument, "no LoRA target modules given (known: " + known_modules() + ")");
  return bits;
}

Result<uint32_t> match_lora_target(std::string_view entry, int64_t* layer) {
  *layer = -1;
  for (LayerTensor t : kLoraTargets) {
    const std::string_view path = module_path(t), name = lora_module_name(t);
    const uint32_t bit = 1u << lora_target_index(t);
    if (entry == name || entry == path) return bit;
    // "<i>.self_attn.q_proj", "layers.<i>.self_attn.q_proj", "model.layers.<i>.self_attn.q_proj"
    if (entry.size() <= path.size() + 1 || !entry.ends_with(path) || entry[entry.size() - path.size() - 1] != '.')
      continue;
    std::string_view head = entry.substr(0, entry.size() - path.size() - 1);
    const size_t dot = head.rfind('.');
    const std::string_view index = dot == std::string_view::npos ? head : head.substr(dot + 1);
    const std::string_view prefix = dot == std::string_view::npos ? std::string_view() : head.substr(0, dot);
    if (!all_digits(index) || !(prefix.empty() || prefix == "layers" || prefix == "model.layers")) continue;
    *layer = std::stoll(std::string(index));
    return bit;
  }
  return Status(StatusCode::kInvalidArgument,
                fmt::format("LoRA target module \"{}\" selects no module Strata adapts: PEFT adapts the modules whose "
                            "full name is it or ends with \".\" + it, and Strata adapts "
                            "model.layers.<i>.self_attn.{{q,k,v,o}}_proj and model.layers.<i>.mlp.{{gate,up,down}}_proj "
                            "(known: {})",
                            clip_for_message(entry), known_modules()));
}

// Whether a target_modules list entry that selects no projection names
// another module of these models (PEFT would adapt the embedding or the
// head, and refuses norms and whole layers): PEFT's rule, the full name or a
// "."-suffix of one, over Llama/Mistral/Qwen2/Qwen3's module names.
bool names_another_module(std::string_view entry) {
  static const char* const kGlobal[] = {"model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb",
                                        "lm_head"};
  static const char* const kPerLayer[] = {"self_attn", "mlp", "mlp.act_fn", "input_layernorm",
                                          "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm",
                                          "self_attn.rotary_emb"};
  auto suffix_of = [&](std::string_view name) {
    return entry == name || (name.size() > entry.size() && name.ends_with(entry) &&
                             name[name.size() - entry.size() - 1] == '.');
  };
  for (const char* g : kGlobal)
    if (suffix_of(g)) return true;
  // "model.layers.<i>[.<module>]", "layers.<i>...", "<i>...": the layer's
  // index stands for any layer.
  std::string_view rest = entry;
  for (std::string_view p : {"model.layers.", "layers."})
    if (rest.starts_with(p)) {
      rest.remove_prefix(p.size());
      break;
    }
  const size_t dot = rest.find('.');
  const std::string_view index = rest.substr(0, dot);
  if (!index.empty() && all_digits(index)) {
    if (dot == std::string_view::npos) return true;  // a whole decoder layer
    rest.remove_prefix(dot + 1);
    for (const char* m : kPerLayer)
      if (rest == m) return true;
    return false;
  }
  for (const char* m : kPerLayer)
    if (suffix_of(std::string("model.layers.0.") + m)) return true;
  return false;
}

Status resolve_lora_regex(LoraOptions* o, uint32_t layers, const std::string& where) {
  if (o->target_regex.empty()) return {};
  auto bad = [&](const std::string& why) {
    return Status(StatusCode::kInvalidArgument, fmt::format("{}: target_modules is the pattern \"{}\", which {}",
                                                            where, clip_for_message(o->target_regex), why));
  };
  auto re = compile_lora_regex(o->target_regex);
  if (!re.ok()) return bad(std::string(re.status().message()));
  // The model's other modules (Llama, Qwen2 and Qwen3 name them alike): PEFT
  // adapts the embedding and the head and refuses the rest (decoder layers,
  // norms); Strata adapts only the projections.
  std::vector<std::string> others = {"", "model", "model.embed_tokens", "model.layers", "model.norm",
                                     "model.rotary_emb", "lm_head"};
  for (uint32_t l = 0; l < layers; ++l)
    for (const char* m : {"", ".self_attn", ".mlp", ".mlp.act_fn", ".input_layernorm", ".post_attention_layernorm"})
      others.push_back(fmt::format("model.layers.{}{}", l, m));
  for (const std::string& other : others)
    if (std::regex_match(other, *re))
      return bad(fmt::format("selects the module \"{}\": Strata adapts only the attention and MLP projections ({})",
                             other, known_modules()));
  uint32_t bits = 0;
  o->target_layers.clear();
  for (LayerTensor t : kLoraTargets) {
    const uint32_t bit = 1u << lora_target_index(t);
    for (uint32_t l = 0; l < layers; ++l)
      if (std::regex_match(fmt::format("model.layers.{}.{}", l, module_path(t)), *re)) {
        o->target_layers[bit].insert(l);
        bits |= bit;
      }
  }
  if (bits == 0)
    return bad("selects none of model.layers.<i>.self_attn.{q,k,v,o}_proj and model.layers.<i>.mlp.{gate,up,down}_proj "
               "(PEFT matches the whole module name)");
  o->targets = bits;
  return {};
}

Status check_lora_layers(const LoraOptions& o, uint32_t layers, const std::string& where) {
  for (const auto& [bit, named] : o.target_layers) {
    std::string module;
    for (LayerTensor t : kLoraTargets)
      if (bit == (1u << lora_target_index(t))) module = std::string(module_path(t));
    if (!named.empty() && *named.rbegin() >= layers)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("{}: target_modules names model.layers.{}.{}, but the model has {} layers", where,
                                *named.rbegin(), module, layers));
    if (named.size() != layers) {
      std::vector<uint32_t> missing;
      for (uint32_t l = 0; l < layers && missing.size() < 8; ++l)
        if (!named.count(l)) missing.push_back(l);
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("{}: target_modules adapts {} in {} of the model's {} layers (not in layers {}{}): "
                                "Strata adapts a projection in every layer or in none",
                                where, module, named.size(), layers, fmt::join(missing, ", "),
                                layers - named.size() > missing.size() ? ", ..." : ""));
    }
  }
  return {};
}

std::vector<std::string> lora_target_names(uint32_t targets) {
  std::vector<std::string> out;
  for (LayerTensor t : kLoraTargets)
    if (targets & (1u << lora_target_index(t))) out.emplace_back(lora_module_name(t));
  return out;
}

Status read_peft_adapter_config(const std::string& dir, LoraOptions* o) {
  const std::string path = dir + "/adapter_config.json";
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    return Status::from_errno(errno, "LoRA adapter " + dir + ": no adapter_config.json (a PEFT adapter directory has one)");
  if (!S_ISREG(st.st_mode)) return Status(StatusCode::kInvalidArgument, path + " is not a regular file");
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (!in.good() && !in.eof()) return Status(StatusCode::kIoError, "read of " + path + " failed");
  json j;
  JsonError err;
  if (!parse_json(ss.str(), &j, &err)) return Status(StatusCode::kInvalidArgument, path + ": " + err.message());
  if (!j.is_object()) return Status(StatusCode::kInvalidArgument, path + ": not a JSON object");
  auto bad = [&](const std::string& key, const std::string& why) {
    return Status(StatusCode::kInvalidArgument, fmt::format("{}: \"{}\" {}", path, key, why));
  };
  // Read.
  if (!j.contains("peft_type") || j["peft_type"] != "LORA")
    return bad("peft_type", fmt::format("is {}: Strata trains LoRA adapters only (\"LORA\")",
                                        j.contains("peft_type") ? clip_for_message(j["peft_type"].dump()) : "missing"));
  if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int64_t>() < 1 || j["r"].get<int64_t>() > 65536)
    return bad("r", "must be an integer rank in [1, 65536]");
  o->rank = j["r"].get<uint32_t>();
  if (j.contains("lora_alpha")) {
    if (!j["lora_alpha"].is_number() || !std::isfinite(j["lora_alpha"].get<double>()))
      return bad("lora_alpha", "must be a number");
    o->alpha = j["lora_alpha"].get<double>();
  }
  if (j.contains("lora_dropout") && !j["lora_dropout"].is_null()) {
    const json& d = j["lora_dropout"];
    if (!d.is_number() || !(d.get<double>() >= 0 && d.get<double>() < 1)) return bad("lora_dropout", "must be in [0, 1)");
    o->dropout = d.get<double>();
  }
  if (j.contains("use_rslora") && !j["use_rslora"].is_null()) {
    if (!j["use_rslora"].is_boolean()) return bad("use_rslora", "must be true or false");
    o->rslora = j["use_rslora"].get<bool>();
  }
  {
    const json& t = j.contains("target_modules") ? j["target_modules"] : json();
    uint32_t bits = 0;
    o->target_regex.clear();
    if (t.is_string()) {
      // PEFT: "all-linear", else a regular expression that must match a
      // module's whole name (so "q_proj" alone selects nothing); resolved
      // against the model's layers later (resolve_lora_regex).
      const std::string s = t.get<std::string>();
      if (s == "all-linear") {
        bits = kAllLoraTargets;
      } else {
        auto re = compile_lora_regex(s);
        if (!re.ok())
          return bad("target_modules", fmt::format("is the pattern {}: {}", clip_for_message(t.dump()),
                                                   re.status().message()));
        o->target_regex = s;
      }
    } else if (t.is_array() && !t.empty()) {
      // PEFT's list: short names, suffixes, or full module names (PEFT
      // writes "all-linear" as the full names of every layer's projections).
      // An entry naming no module of the model is ignored, as PEFT ignores it
      // (lists written for several model families: "c_attn"); one naming a
      // module Strata does not adapt is refused.
      std::set<uint32_t> every_layer;
      std::vector<std::string> unmatched;
      o->target_layers.clear();
      for (const json& n : t) {
        if (!n.is_string()) return bad("target_modules", "must list module names");
        int64_t layer = -1;
        const std::string entry = n.get<std::string>();
        auto b = match_lora_target(entry, &layer);
        if (!b.ok() && !names_another_module(entry)) {
          unmatched.push_back(clip_for_message(entry, 60));
          continue;
        }
        if (!b.ok()) return b.status().with_context(path + ": \"target_modules\"");
        bits |= *b;
        if (layer < 0)
          every_layer.insert(*b);
        else
          o->target_layers[*b].insert(static_cast<uint32_t>(layer));
      }
      for (uint32_t b : every_layer) o->target_layers.erase(b);
      if (bits == 0)
        return bad("target_modules",
                   fmt::format("selects no module of the model ({}): Strata adapts "
                               "model.layers.<i>.self_attn.{{q,k,v,o}}_proj and model.layers.<i>.mlp.{{gate,up,down}}_proj "
                               "(known: {})",
                               fmt::join(unmatched, ", "), known_modules()));
      if (!unmatched.empty())
        log_warn("{}: target_modules {} name no module of this model; ignored, as PEFT ignores them", path,
                 fmt::join(unmatched, ", "));
    } else if (j.contains("target_parameters") && !is_off(j["target_parameters"])) {
      return bad("target_parameters", fmt::format("is {} (adapts parameters, not modules): not supported by Strata",
                                                  clip_for_message(j["target_parameters"].dump())));
    } else {
      return bad("target_modules", "must name the adapted modules");
    }
    o->targets = bits;
  }
  // Must be at PEFT's "off" value: each changes the math or the layout.
  static const std::map<std::string, std::string> kMustBeOff = {
      {"fan_in_fan_out", "stores weights transposed (Conv1D models)"},
      {"use_dora", "DoRA adds a magnitude vector"},
      {"rank_pattern", "gives some modules another rank"},
      {"alpha_pattern", "gives some modules another alpha"},
      {"layers_to_transform", "adapts only some layers"},
      {"layers_pattern", "adapts only some layers"},
      {"modules_to_save", "trains and saves whole modules beside the adapters"},
      {"exclude_modules", "excludes modules from the targets"},
      {"lora_bias", "adds a bias to lora_B"},
      {"use_qalora", "QA-LoRA pools the input"},
      {"target_parameters", "adapts parameters, not modules"},
      {"trainable_token_indices", "trains some embedding rows"},
      {"layer_replication", "replicates layers"},
      {"megatron_config", "Megatron parallel layers"},
      {"alora_invocation_tokens", "activated LoRA"},
      {"use_bdlora", "block-diagonal LoRA"},
      {"ensure_weight_tying", "ties adapted embeddings"},
      // LoRA variants PEFT switches on by their config (extra tensors, another forward).
      {"kasa_config", "KaSA truncates the base weights and adds a diagonal"},
      {"velora_config", "VeLoRA compresses the activations"},
      {"monteclora_config", "MonteCLoRA samples the adapters"},
      {"arrow_config", "Arrow routes between adapters"},
  };
  // Metadata and settings that only matter when PEFT creates fresh weights
  // (the file's weights are used as they are).
  static const std::set<std::string> kMetadata = {
      "peft_type", "r", "lora_alpha", "lora_dropout", "use_rslora", "target_modules", "task_type", "auto_mapping",
      "peft_version", "base_model_name_or_path", "revision", "inference_mode", "init_lora_weights", "megatron_core",
      "qalora_group_size", "loftq_config", "eva_config", "corda_config", "lora_ga_config", "runtime_config"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    if (k == "bias") {
      if (it.value() != "none")
        return bad("bias", fmt::format("is {}: Strata trains no biases beside the adapters (\"none\")",
                                       clip_for_message(it.value().dump())));
      continue;
    }
    if (k == "task_type" && !it.value().is_null() && it.value() != "CAUSAL_LM")
      return bad("task_type", fmt::format("is {}: Strata fine-tunes causal language models (\"CAUSAL_LM\")",
                                          clip_for_message(it.value().dump())));
    if (k == "init_lora_weights") STRATA_RETURN_IF_ERROR(check_init_lora_weights(path, it.value()));
    if (kMetadata.count(k)) continue;
    auto off = kMustBeOff.find(k);
    if (off != kMustBeOff.end()) {
      // A variant's sub-config is on whenever it is not null (PEFT: `is not
      // None`; {} builds its defaults).
      const bool variant = k.ends_with("_config") && k != "megatron_config";
      if (variant ? !it.value().is_null() : !is_off(it.value()))
        return bad(k, fmt::format("is {} ({}): not supported by Strata", clip_for_message(it.value().dump()),
                                  off->second));
      continue;
    }
    if (!is_off(it.value()))
      return bad(clip_for_message(k), fmt::format("is {}: a setting this version of Strata does not know; refused "
                                                  "rather than ignored",
                                                  clip_for_message(it.value().dump())));
  }
  return Status::ok_status();
}

std::string peft_adapter_config_json(const LoraOptions& o, const std::string& base_model) {
  json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["auto_mapping"] = nullptr;
  j["base_model_name_or_path"] = base_model;
  j["revision"] = nullptr;
  j["inference_mode"] = true;
  j["r"] = o.rank;
  j["lora_alpha"] = o.alpha;
  j["lora_dropout"] = o.dropout;
  j["target_modules"] = lora_target_names(o.targets);
  j["use_rslora"] = o.rslora;
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["init_lora_weights"] = true;
  j["use_dora"] = false;
  j["modules_to_save"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["layers_pattern"] = nullptr;
  j["rank_pattern"] = json::object();
  j["alpha_pattern"] = json::object();
  j["exclude_modules"] = nullptr;
  j["lora_bias"] = false;
  // The rest of what PEFT 0.21 writes for a LoraConfig, at the values that
  // mean "off" (its defaults): a reader sees every field as PEFT wrote it.
  for (const char* k : {"megatron_config", "trainable_token_indices", "eva_config", "corda_config", "lora_ga_config",
                        "velora_config", "alora_invocation_tokens", "monteclora_config", "layer_replication",
                        "target_parameters", "use_bdlora", "arrow_config", "kasa_config"})
    j[k] = nullptr;
  j["megatron_core"] = "megatron.core";
  j["loftq_config"] = json::object();
  j["use_qalora"] = false;
  j["qalora_group_size"] = 16;
  j["ensure_weight_tying"] = false;
  return j.dump(2) + "\n";
}

std::string peft_tensor_name(std::string_view param_name) { return "base_model.model." + std::string(param_name); }

void lora_init(LayerTensor t, uint64_t rows, uint64_t cols, std::mt19937_64& rng, float* out) {
  const uint64_t n = rows * cols;
  const bool is_a = (static_cast<int>(t) - kQLoraA) % 2 == 0;
  if (!is_a) {
    for (uint64_t i = 0; i < n; ++i) out[i] = 0.0f;
    return;
  }
  // torch.nn.init.kaiming_uniform_(a=sqrt(5)) on [r, in]: fan_in = in,
  // gain = sqrt(2 / (1 + 5)), bound = gain * sqrt(3 / fan_in) = 1 / sqrt(in).
  const double bound = 1.0 / std::sqrt(static_cast<double>(cols));
  std::uniform_real_distribution<double> u(-bound, bound);
  for (uint64_t i = 0; i < n; ++i) out[i] = static_cast<float>(u(rng));
}

}  // namespace strata::train
