// Hugging Face Llama config.json parsing and the tensor list it implies,
// checked against published configs and their published parameter counts.
#include "model/llama_config.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "model/llama_weights.h"

namespace strata::model {
namespace {

const std::string kData = STRATA_MODEL_TEST_DATA;

void expect_error(const Result<LlamaConfig>& r, const std::string& want) {
  ASSERT_FALSE(r.ok()) << "expected an error mentioning " << want;
  EXPECT_NE(r.status().message().find(want), std::string::npos)
      << "message lacks '" << want << "': " << r.status().message();
}

uint64_t param_count(const LlamaConfig& c) {
  uint64_t n = 0;
  for (const auto& d : llama_tensor_decls(c, StDType::kBF16)) n += d.numel();
  return n;
}

TEST(LlamaConfig, Llama2_70B) {
  auto c = load_llama_config(kData + "/llama-70b-config.json");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->hidden_size, 8192u);
  EXPECT_EQ(c->intermediate_size, 28672u);
  EXPECT_EQ(c->num_hidden_layers, 80u);
  EXPECT_EQ(c->num_attention_heads, 64u);
  EXPECT_EQ(c->num_key_value_heads, 8u);
  EXPECT_EQ(c->vocab_size, 32000u);
  EXPECT_EQ(c->max_position_embeddings, 4096u);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c->rope.theta, 10000.0);  // absent: the default
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->torch_dtype, DType::kF16);
  EXPECT_EQ(c->bos_token_id, 1);
  EXPECT_EQ(c->eos_token_id, 2);
  EXPECT_EQ(c->head_dim(), 128u);
  // Published parameter count of Llama-2-70b.
  EXPECT_EQ(param_count(*c), 68'976'648'192ull);
}

TEST(LlamaConfig, SmolLM135MTied) {
  auto c = load_llama_config(kData + "/smollm-135m-config.json");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->num_key_value_heads, 3u);
  EXPECT_EQ(c->torch_dtype, DType::kBF16);
  EXPECT_EQ(param_count(*c), 134'515'008ull);  // no lm_head.weight
  auto decls = llama_tensor_decls(*c, StDType::kBF16);
  EXPECT_EQ(decls.back().name, "model.norm.weight");
}

TEST(LlamaConfig, Llama31RopeIsRead) {
  auto c = load_llama_config(kData + "/llama-3.1-8b-config.json");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->rope.type, RopeType::kLlama3);
  EXPECT_DOUBLE_EQ(c->rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(c->rope.factor, 8.0);
  EXPECT_DOUBLE_EQ(c->rope.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c->rope.high_freq_factor, 4.0);
  EXPECT_DOUBLE_EQ(c->rope.original_max_position_embeddings, 8192.0);
  EXPECT_TRUE(c->rope_scaling.empty());
  EXPECT_EQ(param_count(*c), 8'030'261'248ull);  // published count of Llama-3.1-8B
}

// The 4.x and 5.x layouts of the same settings give the same RoPE; every
// field that changes the math is read (theta inside rope_parameters was
// ignored before: issue 11's silent wrong result).
TEST(LlamaConfig, RopeInBothLayouts) {
  const std::string base = R"("hidden_size":64,"intermediate_size":160,"num_hidden_layers":2,
      "num_attention_heads":4,"vocab_size":256,"max_position_embeddings":4096)";
  struct Case {
    const char* v4;
    const char* v5;
    RopeSettings want;
  };
  RopeSettings def;
  def.theta = 500000;
  RopeSettings lin = def;
  lin.type = RopeType::kLinear;
  lin.factor = 2;
  RopeSettings l3 = def;
  l3.type = RopeType::kLlama3;
  l3.factor = 8, l3.low_freq_factor = 1, l3.high_freq_factor = 4, l3.original_max_position_embeddings = 8192;
  RopeSettings yarn;
  yarn.theta = 1000000;
  yarn.type = RopeType::kYarn;
  yarn.factor = 4, yarn.original_max_position_embeddings = 1024, yarn.beta_fast = 16;
  const Case cases[] = {
      {R"("rope_theta":500000,"rope_scaling":null)", R"("rope_parameters":{"rope_type":"default","rope_theta":500000})",
       def},
      {R"("rope_theta":500000,"rope_scaling":{"type":"linear","factor":2.0})",
       R"("rope_parameters":{"rope_type":"linear","factor":2.0,"rope_theta":500000})", lin},
      {R"("rope_theta":500000,"rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
          "high_freq_factor":4.0,"original_max_position_embeddings":8192})",
       R"("rope_parameters":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
          "original_max_position_embeddings":8192,"rope_theta":500000.0})",
       l3},
      {R"("rope_theta":1000000,"rope_scaling":{"rope_type":"yarn","factor":4.0,"beta_fast":16,
          "original_max_position_embeddings":1024})",
       R"("rope_parameters":{"rope_type":"yarn","factor":4.0,"beta_fast":16,"original_max_position_embeddings":1024,
          "rope_theta":1000000})",
       yarn},
  };
  // yarn without a factor: transformers refuses it ("Missing required keys"), so does Strata.
  for (const char* layout : {R"("rope_scaling":{"type":"yarn","original_max_position_embeddings":1024})",
                             R"("rope_parameters":{"rope_type":"yarn","original_max_position_embeddings":1024})"})
    expect_error(parse_llama_config("{" + base + "," + layout + "}"), "factor\" is required for RoPE type \"yarn\"");
  for (const Case& k : cases) {
    for (const char* layout : {k.v4, k.v5}) {
      SCOPED_TRACE(layout);
      const std::string text = "{" + base + "," + layout + "}";
      auto c = parse_llama_config(text);
      ASSERT_TRUE(c.ok()) << c.status().to_string();
      EXPECT_TRUE(c->rope == k.want) << rope_describe(c->rope) << " vs " << rope_describe(k.want);
      // The export writes the model's own config back: same layout, same
      // RoPE (never a default theta in place of the model's).
      c->torch_dtype = DType::kBF16;
      const std::string out = llama_config_to_json(*c);
      auto back = parse_llama_config(out, "export");
      ASSERT_TRUE(back.ok()) << back.status().to_string();
      EXPECT_TRUE(back->rope == k.want) << out;
      EXPECT_EQ(back->torch_dtype, DType::kBF16);
      EXPECT_EQ(out.find("rope_parameters") != std::string::npos, layout == k.v5) << out;
    }
  }
  // rope_scaling wins over rope_parameters (transformers' priority), and
  // theta inside the object over the top level.
  auto c = parse_llama_config("{" + base + R"(,"rope_theta":10000,"rope_parameters":{"rope_type":"default",
      "rope_theta":250000}})");
  ASSERT_TRUE(c.ok());
  EXPECT_DOUBLE_EQ(c->rope.theta, 250000.0);
  // A top-level original_max_position_embeddings wins (transformers' exception).
  c = parse_llama_config("{" + base + R"(,"original_max_position_embeddings":2048,"rope_parameters":{
      "rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
      "original_max_position_embeddings":8192}})");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_DOUBLE_EQ(c->rope.original_max_position_embeddings, 2048.0);
}

TEST(LlamaConfig, RopeSettingsStrataDoesNotImplementAreRefusedByName) {
  const std::string base = R"({"hidden_size":64,"intermediate_size":160,"num_hidden_layers":2,
      "num_attention_heads":4,"vocab_size":256,)";
  struct Bad {
    const char* tail;
    const char* needle;
  };
  const Bad bad[] = {
      {R"("rope_scaling":{"type":"dynamic","factor":2.0}})", "rope_scaling.rope_type\" is \"dynamic\""},
      {R"("rope_parameters":{"rope_type":"longrope","short_factor":[1],"long_factor":[1]}})", "\"longrope\""},
      {R"("rope_parameters":{"rope_type":"linear","factor":2.0,"mrope_section":[1,2]}})",
       "rope_parameters.mrope_section"},
      {R"("rope_parameters":{"rope_type":"default","factor":2.0}})", "rope_parameters.factor"},
      {R"("rope_parameters":{"rope_type":"linear"}})", "is required for RoPE type \"linear\""},
      {R"("rope_parameters":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0}})", "high_freq_factor"},
      {R"("rope_parameters":{"rope_type":"default","partial_rotary_factor":0.5}})", "partial_rotary_factor"},
      {R"("partial_rotary_factor":0.5})", "partial_rotary_factor"},
      {R"("rope_parameters":{"full_attention":{"rope_type":"default"}}})", "per-layer-type"},
      {R"("rope_parameters":"yes"})", "must be an object or null"},
      {R"("rope_parameters":{"rope_type":"default","rope_theta":"big"}})", "rope_parameters.rope_theta"},
      {R"("rope_scaling":{"rope_type":"linear","factor":-2}})", "must be positive"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.tail);
    expect_error(parse_llama_config(base + b.tail), b.needle);
  }
  // Planning accepts a type it cannot train (shapes only) and keeps its text.
  auto c = parse_llama_config(base + R"("rope_scaling":{"type":"dynamic","factor":2.0}})", "config.json", true);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_NE(c->rope_scaling.find("dynamic"), std::string::npos);
}

TEST(LlamaConfig, MistralAndItsSlidingWindow) {
  const std::string base = R"({"hidden_size":64,"intermediate_size":160,"num_hidden_layers":2,
      "num_attention_heads":4,"vocab_size":256,)";
  auto c = parse_llama_config(base + R"("model_type":"mistral","architectures":["MistralForCausalLM"],
      "sliding_window":4096,"num_key_value_heads":2})");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->arch, ModelArch::kMistral);
  EXPECT_EQ(c->sliding_window, std::optional<uint64_t>(4096));
  c = parse_llama_config(base + R"("model_type":"mistral","sliding_window":null,"num_key_value_heads":4})");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_FALSE(c->sliding_window.has_value());
  // Llama's modeling code never reads sliding_window.
  c = parse_llama_config(base + R"("model_type":"llama","sliding_window":16})");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_FALSE(c->sliding_window.has_value());
  expect_error(parse_llama_config(base + R"("model_type":"llama","architectures":["MistralForCausalLM"]})"),
               "but model_type is \"llama\"");
  expect_error(parse_llama_config(base + R"("model_type":"gemma"})"), "supported: \"llama\", \"mistral\"");
  expect_error(parse_llama_config(base + R"("architectures":["GPT2LMHeadModel"]})"), "MistralForCausalLM");
  expect_error(parse_llama_config(base + R"("model_type":"mistral","sliding_window":0})"), "sliding_window");
  // transformers' default num_key_value_heads for an absent key: Mistral 8.
  expect_error(parse_llama_config(base + R"("model_type":"mistral"})"),
               "\"num_key_value_heads\" is absent, so MistralForCausalLM's default 8 applies");
  // An absent sliding_window is MistralConfig's default 4096; absent
  // max_position_embeddings each class's own default.
  c = parse_llama_config(base + R"("model_type":"mistral","num_key_value_heads":2})");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->sliding_window, std::optional<uint64_t>(4096));
  EXPECT_EQ(c->max_position_embeddings, 131072u);
  c = parse_llama_config(base + R"("model_type":"qwen2","num_key_value_heads":2})");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->max_position_embeddings, 32768u);
  c = parse_llama_config(base + R"("model_type":"llama"})");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->max_position_embeddings, 2048u);
  // dtype wins over torch_dtype (transformers 5); rms_norm_eps null and a
  // dropout outside [0, 1] are refused as transformers and torch refuse them.
  c = parse_llama_config(base + R"("model_type":"llama","torch_dtype":"bfloat16","dtype":"float32"})");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->torch_dtype, DType::kF32);
  expect_error(parse_llama_config(base + R"("rms_norm_eps":null})"), "\"rms_norm_eps\" is null");
  expect_error(parse_llama_config(base + R"("attention_dropout":-0.5})"), "\"attention_dropout\" is -0.5");
}

// A small GQA model: 64 wide, 8 heads of 8 over 2 kv heads, FFN 160, vocab 100.
LlamaConfig small_gqa_config(uint32_t layers) {
  LlamaConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 160;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 2;
  c.vocab_size = 100;
  return c;
}

// The Hugging Face names and shapes, spelled out independently of
// llama_model_spec, for a small GQA model.
TEST(LlamaConfig, TensorNamesAndShapesMatchHuggingFace) {
  const LlamaConfig c = small_gqa_config(2);
  std::vector<std::pair<std::string, std::vector<uint64_t>>> want = {{"model.embed_tokens.weight", {100, 64}}};
  for (int i = 0; i < 2; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    want.push_back({p + "input_layernorm.weight", {64}});
    want.push_back({p + "self_attn.q_proj.weight", {64, 64}});
    want.push_back({p + "self_attn.k_proj.weight", {16, 64}});  // kv heads * head_dim = 2 * 8
    want.push_back({p + "self_attn.v_proj.weight", {16, 64}});
    want.push_back({p + "self_attn.o_proj.weight", {64, 64}});
    want.push_back({p + "post_attention_layernorm.weight", {64}});
    want.push_back({p + "mlp.gate_proj.weight", {160, 64}});
    want.push_back({p + "mlp.up_proj.weight", {160, 64}});
    want.push_back({p + "mlp.down_proj.weight", {64, 160}});
  }
  want.push_back({"model.norm.weight", {64}});
  want.push_back({"lm_head.weight", {100, 64}});
  auto decls = llama_tensor_decls(c, StDType::kF32);
  ASSERT_EQ(decls.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(decls[i].name, want[i].first);
    EXPECT_EQ(decls[i].shape, want[i].second) << want[i].first;
  }
  // ...and the runtime's groups: embed, layers.<i>, head.
  auto spec = llama_model_spec(c.shape());
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(spec->group_names(), (std::vector<std::string>{"embed", "layers.0", "layers.1", "head"}));
}

// The weight table (model/llama_weights.h), which the ops and the trainer
// index by, names and shapes every tensor exactly as llama_model_spec lists
// them (the runtime spells its own list; this keeps the two one).
// LoRA adapters: PEFT's names and shapes (spelled out here, not taken from
// the table), after each layer's model tensors, only for the targets given.
TEST(LlamaConfig, LoraAdaptersInTheModelSpecArePeftsNamesAndShapes) {
  LlamaConfig c = small_gqa_config(2);
  LlamaShape s = c.shape();
  s.lora_rank = 4;
  s.lora_targets = (1u << lora_target_index(kQProj)) | (1u << lora_target_index(kVProj)) |
                   (1u << lora_target_index(kDownProj));
  auto spec = llama_model_spec(s);
  ASSERT_TRUE(spec.ok()) << spec.status().to_string();
  std::vector<std::pair<std::string, std::vector<uint64_t>>> lora;
  for (const ParamSpec& p : spec->params)
    if (p.name.find("lora_") != std::string::npos) {
      lora.push_back({p.name, p.shape});
      EXPECT_EQ(p.compute_dtype, DType::kF32) << p.name;
    }
  const std::vector<std::pair<std::string, std::vector<uint64_t>>> want = {
      {"model.layers.0.self_attn.q_proj.lora_A.weight", {4, 64}},
      {"model.layers.0.self_attn.q_proj.lora_B.weight", {64, 4}},
      {"model.layers.0.self_attn.v_proj.lora_A.weight", {4, 64}},
      {"model.layers.0.self_attn.v_proj.lora_B.weight", {16, 4}},
      {"model.layers.0.mlp.down_proj.lora_A.weight", {4, 160}},
      {"model.layers.0.mlp.down_proj.lora_B.weight", {64, 4}},
      {"model.layers.1.self_attn.q_proj.lora_A.weight", {4, 64}},
      {"model.layers.1.self_attn.q_proj.lora_B.weight", {64, 4}},
      {"model.layers.1.self_attn.v_proj.lora_A.weight", {4, 64}},
      {"model.layers.1.self_attn.v_proj.lora_B.weight", {16, 4}},
      {"model.layers.1.mlp.down_proj.lora_A.weight", {4, 160}},
      {"model.layers.1.mlp.down_proj.lora_B.weight", {64, 4}},
  };
  EXPECT_EQ(lora, want);
  for (LayerTensor t : kLoraTargets) EXPECT_EQ(std::string(lora_module_name(t)).size() > 0, true);
  EXPECT_EQ(lora_module_name(kGateProj), "gate_proj");
  EXPECT_EQ(lora_module_name(kOProj), "o_proj");
  s.lora_rank = 0;
  EXPECT_FALSE(llama_model_spec(s).ok());  // targets without a rank
}

TEST(LlamaConfig, WeightTableMatchesTheModelSpec) {
  for (ModelArch arch : {ModelArch::kLlama, ModelArch::kMistral, ModelArch::kQwen2, ModelArch::kQwen3})
  for (bool tied : {false, true}) {
    SCOPED_TRACE(model_arch_type(arch));
    LlamaConfig c = small_gqa_config(3);
    c.arch = arch;
    // Qwen3: an explicit head_dim (12 x 8 = 96 wide queries on a 64-wide model).
    if (arch == ModelArch::kQwen3) c.head_dim_explicit = 12;
    const int64_t hd = static_cast<int64_t>(c.head_dim());
    const LlamaExtents x{.dim = 64, .q_dim = 8 * hd, .kv_dim = 2 * hd, .ffn_dim = 160, .vocab = 100, .head_dim = hd};
    c.tie_word_embeddings = tied;
    std::vector<std::pair<std::string, std::vector<uint64_t>>> want = {
        {model_weight_name(kEmbedTokens), weight_row(kEmbedTokens).shape(x)}};
    for (uint32_t l = 0; l < c.num_hidden_layers; ++l)
      for (LayerTensor t : kAllLayerTensors) {
        const Feature f = weight_row(t).feature;
        if ((f == Feature::kQkvBias && arch != ModelArch::kQwen2) || (f == Feature::kQkNorm && arch != ModelArch::kQwen3) ||
            f == Feature::kLora)
          continue;
        want.push_back({layer_weight_name(l, t), weight_row(t).shape(x)});
      }
    want.push_back({model_weight_name(kFinalNorm), weight_row(kFinalNorm).shape(x)});
    if (!tied) want.push_back({model_weight_name(kLmHead), weight_row(kLmHead).shape(x)});
    auto spec = llama_model_spec(c.shape());
    ASSERT_TRUE(spec.ok()) << spec.status().to_string();
    ASSERT_EQ(spec->params.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(spec->params[i].name, want[i].first);
      EXPECT_EQ(spec->params[i].shape, want[i].second) << want[i].first;
    }
  }
  // The norms the table marks are the ones Hugging Face initialises to ones.
  EXPECT_TRUE(weight_row(kInputNorm).norm && weight_row(kPostNorm).norm && weight_row(kFinalNorm).norm);
  EXPECT_EQ(layer_weight_name(7, kQProj), "model.layers.7.self_attn.q_proj.weight");
}

TEST(LlamaConfig, DefaultsAndRoundTrip) {
  auto c = parse_llama_config(R"({"hidden_size":64,"intermediate_size":160,"num_hidden_layers":2,
      "num_attention_heads":4,"vocab_size":256})");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->num_key_value_heads, 4u);   // defaults to the head count
  EXPECT_EQ(c->torch_dtype, DType::kF32);  // absent: float32, as transformers loads it
  EXPECT_EQ(c->bos_token_id, -1);
  c->torch_dtype = DType::kBF16;
  c->tie_word_embeddings = true;
  c->rope.theta = 500000;
  c->eos_token_id = 7;
  auto back = parse_llama_config(llama_config_to_json(*c), "round trip");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->hidden_size, 64u);
  EXPECT_EQ(back->num_key_value_heads, 4u);
  EXPECT_EQ(back->torch_dtype, DType::kBF16);
  EXPECT_TRUE(back->tie_word_embeddings);
  EXPECT_DOUBLE_EQ(back->rope.theta, 500000.0);
  EXPECT_EQ(back->eos_token_id, 7);
  EXPECT_EQ(back->bos_token_id, -1);
  EXPECT_NE(llama_config_to_json(*c).find("\"head_dim\": 16"), std::string::npos);
}

TEST(LlamaConfig, ErrorsNameTheKey) {
  const std::string base = R"("intermediate_size":160,"num_hidden_layers":2,"num_attention_heads":4,"vocab_size":256)";
  expect_error(parse_llama_config("{" + base + "}", "cfg.json"), "cfg.json: \"hidden_size\" is missing");
  expect_error(parse_llama_config(R"({"hidden_size":"64",)" + base + "}"), "\"hidden_size\" must be a non-negative");
  expect_error(parse_llama_config(R"({"hidden_size":-64,)" + base + "}"), "\"hidden_size\"");
  expect_error(parse_llama_config(R"({"hidden_size":66,)" + base + "}"), "not divisible by num_attention_heads");
  expect_error(parse_llama_config(R"({"hidden_size":64,"num_key_value_heads":3,)" + base + "}"),
               "not divisible by num_key_value_heads");
  // An explicit head_dim is read (transformers 5 reads it for Llama too).
  auto hd = parse_llama_config(R"({"hidden_size":64,"head_dim":32,)" + base + "}");
  ASSERT_TRUE(hd.ok()) << hd.status().to_string();
  EXPECT_EQ(hd->head_dim(), 32u);
  EXPECT_EQ(llama_model_spec(hd->shape())->params[2].shape, (std::vector<uint64_t>{32 * hd->num_attention_heads, 64}));
  expect_error(parse_llama_config(R"({"hidden_size":64,"head_dim":7,)" + base + "}"), "even head_dim");
  EXPECT_TRUE(parse_llama_config(R"({"hidden_size":64,"head_dim":16,)" + base + "}").ok());
  expect_error(parse_llama_config(R"({"hidden_size":64,"torch_dtype":"int8",)" + base + "}"), "\"torch_dtype\"");
  expect_error(parse_llama_config(R"({"hidden_size":64,"model_type":"gpt2",)" + base + "}"), "\"model_type\"");
  expect_error(parse_llama_config(R"({"hidden_size":64,"architectures":["GPT2LMHeadModel"],)" + base + "}"),
               "\"architectures\"");
  expect_error(parse_llama_config(R"({"hidden_size":64,"attention_bias":true,)" + base + "}"), "\"attention_bias\"");
  expect_error(parse_llama_config(R"({"hidden_size":64,"hidden_act":"gelu",)" + base + "}"), "\"hidden_act\"");
  EXPECT_TRUE(parse_llama_config(R"({"hidden_size":64,"hidden_act":"swish",)" + base + "}").ok());  // nn.SiLU
  // pad_token_id: nn.Embedding's padding_idx, an integer in [-vocab, vocab).
  {
    auto p5 = parse_llama_config(R"({"hidden_size":64,"pad_token_id":5,)" + base + "}");
    ASSERT_TRUE(p5.ok());
    EXPECT_EQ(p5->pad_token_id, 5);
    auto neg = parse_llama_config(R"({"hidden_size":64,"pad_token_id":-1,)" + base + "}");
    ASSERT_TRUE(neg.ok());
    EXPECT_EQ(neg->pad_token_id, 255);
    EXPECT_EQ(parse_llama_config(R"({"hidden_size":64,"pad_token_id":null,)" + base + "}")->pad_token_id, -1);
    EXPECT_EQ(parse_llama_config("{\"hidden_size\":64," + base + "}")->pad_token_id, -1);
  }
  expect_error(parse_llama_config(R"({"hidden_size":64,"pad_token_id":256,)" + base + "}"),
               "\"pad_token_id\" is 256, outside the vocabulary (vocab_size 256)");
  expect_error(parse_llama_config(R"({"hidden_size":64,"pad_token_id":-257,)" + base + "}"), "\"pad_token_id\"");
  expect_error(parse_llama_config(R"({"hidden_size":64,"pad_token_id":"0",)" + base + "}"),
               "\"pad_token_id\" must be an integer");
  // A quantized checkpoint is refused by name (with or without its method).
  expect_error(parse_llama_config(R"({"hidden_size":64,"quantization_config":{"quant_method":"bitsandbytes",)"
                                  R"("load_in_4bit":true},)" + base + "}"),
               "\"quantization_config\" is present (quant_method \"bitsandbytes\")");
  expect_error(parse_llama_config(R"({"hidden_size":64,"quantization_config":{},)" + base + "}"),
               "\"quantization_config\" is present");
  EXPECT_TRUE(parse_llama_config(R"({"hidden_size":64,"quantization_config":null,)" + base + "}").ok());
  // null: transformers cannot build it (ACT2FN[None]); not taken as the default.
  expect_error(parse_llama_config(R"({"hidden_size":64,"hidden_act":null,)" + base + "}"), "\"hidden_act\" is null");
  expect_error(parse_llama_config(R"({"hidden_size":64,"rms_norm_eps":0,)" + base + "}"), "\"rms_norm_eps\"");
  expect_error(parse_llama_config(R"({"hidden_size":64,"tie_word_embeddings":1,)" + base + "}"),
               "\"tie_word_embeddings\" must be true or false");
  expect_error(parse_llama_config(R"({"hidden_size":64,)" + base), "malformed JSON");
  expect_error(load_llama_config("/nonexistent/config.json"), "/nonexistent/config.json");
}

// Issue 10: a small config.json that would make Strata allocate without bound,
// or that says one thing twice, is refused before anything is sized from it.
TEST(LlamaConfig, HostileConfigsAreRefused) {
  const std::string rest = R"("intermediate_size":160,"num_attention_heads":4,"vocab_size":256)";
  expect_error(parse_llama_config(R"({"hidden_size":64,"num_hidden_layers":4294967295,)" + rest + "}"),
               "\"num_hidden_layers\" 4294967295 is more than 4096");
  expect_error(parse_llama_config(R"({"hidden_size":4294967296,"num_hidden_layers":2,)" + rest + "}"),
               "parameters, more than 1e+14");
  // The key named is the one at fault.
  const std::string dims = R"("hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4)";
  expect_error(parse_llama_config("{" + dims + R"(,"intermediate_size":160,"vocab_size":1000000000000})"),
               "\"vocab_size\" makes the model too large");
  expect_error(parse_llama_config("{" + dims + R"(,"intermediate_size":1000000000000,"vocab_size":256})"),
               "\"intermediate_size\" makes the model too large");
  expect_error(parse_llama_config(R"({"hidden_size":64,"hidden_size":128,"num_hidden_layers":2,)" + rest + "}"),
               "hidden_size: duplicate key");
  std::string deep = R"({"hidden_size":64,"num_hidden_layers":2,)" + rest + R"(,"x":)";
  for (int i = 0; i < 100000; ++i) deep += "[";
  expect_error(parse_llama_config(deep), "nested deeper than 64 levels");
  // A 5 MB value is not echoed whole.
  auto big = parse_llama_config(R"({"hidden_size":64,"num_hidden_layers":2,"torch_dtype":")" +
                                std::string(5 << 20, 'k') + "\"," + rest + "}");
  expect_error(big, "\"torch_dtype\" is");
  EXPECT_LT(big.status().message().size(), 1000u);
}

}  // namespace
}  // namespace strata::model
