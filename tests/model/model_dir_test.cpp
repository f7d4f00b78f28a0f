// Model directories: config.json plus one file or shards, checked against the
// tensors the config implies.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <cstring>

#include <nlohmann/json.hpp>

#include "model/llama_config.h"
#include "model/llama_init.h"
#include "model_test_util.h"

namespace strata::model {
namespace {

using testing::TempDir;

LlamaConfig small_config(bool tied) {
  LlamaConfig c;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = 50;
  c.tie_word_embeddings = tied;
  c.torch_dtype = DType::kBF16;
  return c;
}

// Writes config + weights; each element of tensor k is k + 0.5 (exact in bf16).
void write_model(const std::string& dir, const LlamaConfig& c, std::vector<TensorDecl> decls, uint64_t max_shard) {
  ASSERT_TRUE(save_llama_config(c, dir + "/config.json").ok());
  auto w = ShardedWriter::create(dir, decls, max_shard);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  for (size_t k = 0; k < decls.size(); ++k) {
    std::vector<float> v(decls[k].numel(), static_cast<float>(k) + 0.5f);
    ASSERT_TRUE((*w)->write_from(DType::kF32, v.data(), v.size()).ok());
  }
  ASSERT_TRUE((*w)->finish().ok());
}

void expect_message(const Status& st, std::initializer_list<const char*> parts) {
  EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.to_string();
  for (const char* p : parts)
    EXPECT_NE(st.message().find(p), std::string::npos) << "lacks '" << p << "': " << st.message();
}

TEST(ModelDir, OpensSingleAndShardedModels) {
  for (uint64_t shard : {0ull, 4096ull}) {
    for (bool tied : {false, true}) {
      TempDir dir;
      ASSERT_TRUE(dir.ok());
      const LlamaConfig c = small_config(tied);
      auto decls = llama_tensor_decls(c, StDType::kBF16);
      write_model(dir.path(), c, decls, shard);
      auto m = open_model_dir(dir.path());
      ASSERT_TRUE(m.ok()) << m.status().to_string();
      EXPECT_EQ(m->config.hidden_size, 32u);
      EXPECT_EQ(m->config.tie_word_embeddings, tied);
      ASSERT_EQ(m->tensors.size(), decls.size());
      auto reader = TensorReader::create();
      ASSERT_TRUE(reader.ok());
      for (size_t k = 0; k < decls.size(); ++k) {
        EXPECT_EQ(m->tensors[k].name, decls[k].name);  // llama_model_spec order
        EXPECT_EQ(m->tensors[k].shape, decls[k].shape);
        std::vector<float> v(decls[k].numel());
        ASSERT_TRUE((*reader)->read(m->tensors[k], DType::kF32, v.data()).ok());
        for (float x : v) ASSERT_EQ(x, static_cast<float>(k) + 0.5f) << decls[k].name;
      }
      EXPECT_NE(m->find("model.norm.weight"), nullptr);
      EXPECT_EQ(m->find("lm_head.weight") != nullptr, !tied);
    }
  }
}

TEST(ModelDir, ReportsMissingUnexpectedAndWrongShapes) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const LlamaConfig c = small_config(false);
  auto decls = llama_tensor_decls(c, StDType::kF32);
  decls.erase(decls.begin() + 3);  // layers.0 k_proj
  decls[6].shape = {48, 31};       // layers.0 gate_proj (after the erase)
  decls.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", StDType::kF32, {4}});  // ignored
  decls.push_back({"model.extra.weight", StDType::kF32, {2}});
  write_model(dir.path(), c, decls, 0);
  expect_message(open_model_dir(dir.path()).status(),
                 {"missing (1): model.layers.0.self_attn.k_proj.weight",
                  "wrong shape (1): model.layers.0.mlp.gate_proj.weight is [48, 31], expected [48, 32]",
                  "unexpected (1): model.extra.weight", "2 layers, hidden 32"});
}

TEST(ModelDir, TiedModelMayCarryLmHeadButNotAWrongOne) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  LlamaConfig c = small_config(true);
  auto decls = llama_tensor_decls(small_config(false), StDType::kBF16);  // with lm_head
  write_model(dir.path(), c, decls, 0);
  auto m = open_model_dir(dir.path());
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->find("lm_head.weight"), nullptr);
  decls.back().shape = {50, 16};
  write_model(dir.path(), c, decls, 0);
  expect_message(open_model_dir(dir.path()).status(), {"wrong shape (1): lm_head.weight"});
}

TEST(ModelDir, NonFloatTensorsAndMissingFiles) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  EXPECT_EQ(open_model_dir(dir.path()).status().code(), StatusCode::kNotFound);  // no config.json
  const LlamaConfig c = small_config(false);
  ASSERT_TRUE(save_llama_config(c, dir.file("config.json")).ok());
  auto st = open_model_dir(dir.path()).status();
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_NE(st.message().find("model.safetensors"), std::string::npos) << st.message();
  auto decls = llama_tensor_decls(c, StDType::kBF16);
  decls[1].dtype = StDType::kI16;
  auto w = ShardedWriter::create(dir.path(), decls, 0);
  ASSERT_TRUE(w.ok());
  for (const auto& d : decls) {
    std::vector<unsigned char> z(d.nbytes());
    ASSERT_TRUE((*w)->write(z.data(), z.size()).ok());
  }
  ASSERT_TRUE((*w)->finish().ok());
  expect_message(open_model_dir(dir.path()).status(),
                 {"not F32/BF16/F16 (1): model.layers.0.input_layernorm.weight is I16"});
}

}  // namespace
}  // namespace strata::model

namespace strata::model {
namespace {

// init-model's library half: what it writes opens, and holds exactly the
// values llama_init_values gives (norms 1, others ~ normal(0, std)).
TEST(ModelDir, RandomInitWritesWhatInitValuesGive) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  LlamaConfig c = small_config(false);
  c.initializer_range = 0.05;
  ASSERT_TRUE(write_random_llama(dir.path(), c, StDType::kF32, 11, 8192).ok());
  auto m = open_model_dir(dir.path());
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_DOUBLE_EQ(m->config.initializer_range, 0.05);
  auto reader = TensorReader::create();
  ASSERT_TRUE(reader.ok());
  double sum = 0, sum_sq = 0;
  uint64_t count = 0;
  for (const auto& t : m->tensors) {
    std::vector<float> got(t.numel()), want(t.numel());
    ASSERT_TRUE((*reader)->read(t, DType::kF32, got.data()).ok());
    llama_init_values(t.name, 11, 0.05, 0, t.numel(), want.data());
    ASSERT_EQ(got, want) << t.name;
    if (is_norm_weight(t.name)) {
      for (float x : got) ASSERT_EQ(x, 1.0f);
    } else {
      for (float x : got) sum += x, sum_sq += double(x) * x, ++count;
    }
  }
  // ~45k samples: mean within 5 sigma of 0, std within 2% of 0.05.
  const double mean = sum / count, sd = std::sqrt(sum_sq / count - mean * mean);
  EXPECT_LT(std::abs(mean), 5 * 0.05 / std::sqrt(double(count)));
  EXPECT_NEAR(sd, 0.05, 0.001);
  // Ranges give the same values as the whole; other seeds give others.
  float a[3], b[10];
  llama_init_values("x.weight", 11, 1.0, 7, 3, a);
  llama_init_values("x.weight", 11, 1.0, 0, 10, b);
  EXPECT_EQ(0, std::memcmp(a, b + 7, sizeof a));
  EXPECT_NE(init_normal(11, 5, 0), init_normal(12, 5, 0));
  EXPECT_NE(init_normal(11, 5, 0), init_normal(11, 6, 0));
}


// A config.json without "dtype"/"torch_dtype": transformers 5 loads the model
// in its weights' dtype (from_pretrained's dtype "auto"); Strata did float32,
// exporting bf16 weights as f32 (twice the size, another dtype).
TEST(ModelDir, NoDtypeInConfigTakesTheWeights) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const LlamaConfig c = small_config(false);
  auto decls = llama_tensor_decls(c, StDType::kBF16);
  write_model(dir.path(), c, decls, 0);
  {
    std::ifstream in(dir.file("config.json"));
    nlohmann::json j = nlohmann::json::parse(in);
    j.erase("torch_dtype");
    j.erase("dtype");
    std::ofstream(dir.file("config.json")) << j.dump();
  }
  auto lc = load_llama_config(dir.file("config.json"));
  ASSERT_TRUE(lc.ok());
  EXPECT_FALSE(lc->dtype_given);
  auto m = open_model_dir(dir.path());
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->config.torch_dtype, DType::kBF16);
  // Weights of two dtypes: which one is for the config to say, by name.
  decls[2].dtype = StDType::kF32;
  std::filesystem::remove(dir.file("model.safetensors"));
  auto w = ShardedWriter::create(dir.path(), decls, 0);
  ASSERT_TRUE(w.ok());
  for (const auto& d : decls) {
    std::vector<float> v(d.numel(), 1.0f);
    ASSERT_TRUE((*w)->write_from(DType::kF32, v.data(), v.size()).ok());
  }
  ASSERT_TRUE((*w)->finish().ok());
  auto mixed = open_model_dir(dir.path());
  ASSERT_FALSE(mixed.ok());
  EXPECT_EQ(mixed.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(mixed.status().message().find("config.json names no dtype and the weights mix BF16"), std::string::npos)
      << mixed.status().message();
}

TEST(ModelDir, APickleIsNamedWithItsConversion) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  ASSERT_TRUE(save_llama_config(small_config(false), dir.file("config.json")).ok());
  std::ofstream(dir.file("pytorch_model.bin")) << "PK";
  auto st = open_model_dir(dir.path()).status();
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_NE(st.message().find("it holds pytorch_model.bin"), std::string::npos) << st.message();
}


// A model written over a sharded one (init-model --force) leaves none of the
// old shards behind.
TEST(ModelDir, RewritingRemovesTheShardsOfTheOldIndex) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const LlamaConfig c = small_config(false);
  const auto decls = llama_tensor_decls(c, StDType::kBF16);
  write_model(dir.path(), c, decls, 4096);
  size_t shards = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path()))
    shards += e.path().filename().string().starts_with("model-");
  ASSERT_GT(shards, 2u);
  write_model(dir.path(), c, decls, 1 << 20);  // now fewer, other names
  size_t after = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path()))
    after += e.path().filename().string().starts_with("model-");
  auto idx = read_safetensors_index(dir.file("model.safetensors.index.json"));
  std::set<std::string> named;
  if (idx.ok())
    for (const auto& [k, f] : idx->weight_map) named.insert(f);
  EXPECT_EQ(after, named.size()) << "stale shards stayed";
  write_model(dir.path(), c, decls, 0);  // one file
  for (const auto& e : std::filesystem::directory_iterator(dir.path()))
    EXPECT_FALSE(e.path().filename().string().starts_with("model-")) << e.path();
  ASSERT_TRUE(open_model_dir(dir.path()).ok());
}

}  // namespace
}  // namespace strata::model
