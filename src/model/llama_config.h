// Hugging Face Llama models on disk: config.json (LlamaForCausalLM) and a
// model directory (config.json + model.safetensors or a sharded index).
//
//   STRATA_ASSIGN_OR_RETURN(ModelDir m, open_model_dir("/models/tiny"));
//   STRATA_ASSIGN_OR_RETURN(ModelSpec spec, llama_model_spec(m.config.shape()));
//   STRATA_ASSIGN_OR_RETURN(auto reader, TensorReader::create());
//   STRATA_RETURN_IF_ERROR(reader->read(*m.find("model.norm.weight"), DType::kF32, buf));
//
// Pure functions and value types; thread-safe. Blocking file I/O where noted.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "model/rope.h"
#include "model/safetensors.h"
#include "runtime/model_spec.h"

namespace strata::model {

// The architectures of the Llama family Strata implements. They share the
// weight table (model/llama_weights.h) and the ops: Mistral adds a sliding
// attention window, Qwen2 q/k/v biases (and Qwen2/3 per-layer sliding
// windows), Qwen3 per-head q/k RMSNorm and an explicit head_dim.
enum class ModelArch : uint8_t { kLlama = 0, kMistral, kQwen2, kQwen3 };
const char* model_arch_type(ModelArch a);   // config.json model_type: "llama", "mistral", "qwen2", "qwen3"
const char* model_arch_class(ModelArch a);  // architectures: "LlamaForCausalLM", ...

struct LlamaConfig {
  ModelArch arch = ModelArch::kLlama;
  // Attention of some or all layers sees the last `sliding_window` tokens
  // (Mistral: every layer; Qwen2/3: the layers layer_types marks
  // "sliding_attention"); unset: none. The trainer refuses a sequence longer
  // than the window (sliding attention is not implemented), so it never
  // changes the math silently.
  std::optional<uint64_t> sliding_window;
  uint64_t head_dim_explicit = 0;  // config.json head_dim (Qwen3's default 128); 0: hidden / heads
  uint64_t hidden_size = 0;
  uint64_t intermediate_size = 0;
  uint32_t num_hidden_layers = 0;
  uint32_t num_attention_heads = 0;
  uint32_t num_key_value_heads = 0;  // config default: num_attention_heads
  uint64_t vocab_size = 0;
  double rms_norm_eps = 1e-6;
  // RoPE from either layout: transformers 4.x (`rope_theta`, `rope_scaling`)
  // or 5.x (`rope_parameters`), resolved as transformers resolves them.
  RopeSettings rope;
  uint64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  DType torch_dtype = DType::kBF16;  // "bfloat16" | "float16" | "float32"
  // config.json names its dtype ("dtype" or "torch_dtype"); false: float32
  // here, and open_model_dir takes the weights' dtype, as transformers 5's
  // from_pretrained (dtype "auto") does.
  bool dtype_given = true;
  int64_t bos_token_id = -1;         // -1: absent / null (a list: its first id)
  int64_t eos_token_id = -1;
  // pad_token_id: transformers builds nn.Embedding(padding_idx=pad_token_id),
  // whose lookup gives that row no gradient (normalized into 0..vocab-1; -1:
  // absent / null).
  int64_t pad_token_id = -1;
  double initializer_range = 0.02;  // std of the normal init (init-model)
  double attention_dropout = 0.0;   // training-mode dropout in transformers; Strata has none (warned)
  // JSON text of a RoPE scaling Strata does not implement (dynamic, longrope,
  // ...); only ever set when parsing with allow_rope_scaling (planning needs
  // shapes only; the trainer refuses it).
  std::string rope_scaling;
  // The config.json object as read (compact JSON), so an export writes the
  // model's own config back (same layout, same fields) with only the dtype
  // changed. Empty for configs made by Strata.
  std::string source_json;

  uint64_t head_dim() const {
    if (head_dim_explicit) return head_dim_explicit;
    return num_attention_heads ? hidden_size / num_attention_heads : 0;
  }
  // The runtime's view: layers, dim, heads, kv_heads, ffn_dim, vocab, tied,
  // dtype = torch_dtype.
  LlamaShape shape() const;
};

// kInvalidArgument naming the field: a zero size, hidden_size not divisible
// by num_attention_heads, heads not divisible by kv heads, eps or theta not
// positive and finite.
Status validate_llama_config(const LlamaConfig& c);

// A sequence of `seq` tokens within the model's sliding window (Strata does
// not implement sliding-window attention: a longer one would change the
// math), else kInvalidArgument naming `where` (the model) and the window.
Status check_sequence_length(const LlamaConfig& c, uint64_t seq, const std::string& where);

// Parses config.json text. `source` (a path) prefixes messages. Errors
// (kInvalidArgument / kCorrupt for bad JSON) name the key: missing required
// key, wrong type, a model_type other than "llama"/"mistral" or architectures
// other than LlamaForCausalLM/MistralForCausalLM (or the two disagreeing),
// head_dim != hidden_size / num_attention_heads,
// a RoPE type other than default/linear/llama3/yarn (allow_rope_scaling
// keeps its text in LlamaConfig::rope_scaling instead), a missing or unknown
// key in the RoPE settings, partial_rotary_factor other than 1, attention_bias
// / mlp_bias true, hidden_act other than "silu", unknown torch_dtype (absent:
// float32 and dtype_given false). Other keys are ones Llama's modeling
// code in transformers never reads (generation settings, token ids, ...):
// ignored, as transformers ignores them.
Result<LlamaConfig> parse_llama_config(std::string_view json_text, const std::string& source = "config.json",
                                       bool allow_rope_scaling = false);
// Reads and parses a file. Blocking.
Result<LlamaConfig> load_llama_config(const std::string& path, bool allow_rope_scaling = false);
// config.json text: the source config (source_json) with its dtype set to
// torch_dtype, or, for a config Strata made, Hugging Face's 4.x layout
// (architectures, model_type, every field above, head_dim, hidden_act "silu",
// rope_theta and rope_scaling, ...).
std::string llama_config_to_json(const LlamaConfig& c);
// Writes llama_config_to_json atomically (temp + fsync + rename). Blocking.
Status save_llama_config(const LlamaConfig& c, const std::string& path);

// Hugging Face tensor names and shapes for a config (the same list, order and
// shapes as llama_model_spec(c.shape())).
std::vector<TensorDecl> llama_tensor_decls(const LlamaConfig& c, StDType dtype);

// A model directory, checked.
struct ModelDir {
  std::string dir;
  LlamaConfig config;
  // Every expected tensor, in llama_model_spec order, with its file, offset,
  // file dtype and shape (dtypes may differ from torch_dtype and between
  // tensors; any of F32/BF16/F16 is accepted).
  std::vector<TensorInfo> tensors;
  // Tied embeddings whose files still carry lm_head.weight: that tensor (not
  // in `tensors`). Whoever reads the weights must check it equals the
  // embedding (check_tied_head): transformers 5 unties a head that differs
  // and uses it, older versions use the embedding.
  std::optional<TensorInfo> tied_head;
  const TensorInfo* find(std::string_view name) const;
};

// With m.tied_head: OK when lm_head.weight holds the embedding's values
// (compared as fp32, chunk by chunk), else kInvalidArgument naming both
// tensors and the first element that differs.
Status check_tied_head(const ModelDir& m, TensorReader& reader);

// Opens DIR/config.json and the weights (read_model_tensors), then checks
// every expected Hugging Face tensor is present with the right shape and a
// float dtype. A model with tied embeddings may still carry lm_head.weight
// (ModelDir::tied_head; it must have the right shape). Errors: kNotFound (no config.json /
// weights), kCorrupt listing missing, unexpected and wrong-shaped tensors
// (the first few of each, and how many), errors from the parsers. Rotary
// caches (`*.rotary_emb.inv_freq`) are ignored. Blocking (reads headers only).
Result<ModelDir> open_model_dir(const std::string& dir);

// The files beside config.json and the weights that make a directory a model
// transformers loads whole (AutoTokenizer, generate()): tokenizer.json,
// tokenizer_config.json, tokenizer.model, special_tokens_map.json,
// added_tokens.json, vocab.json, merges.txt, chat_template.jinja,
// generation_config.json. Those of `from` that exist (regular files) are
// copied to `to`, each atomically; *copied lists them. Errors name the file.
Status copy_model_side_files(const std::string& from, const std::string& to, std::vector<std::string>* copied);

}  // namespace strata::model
