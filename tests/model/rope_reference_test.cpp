// RoPE against transformers itself: for each supported type, in the 4.x
// layout (rope_theta + rope_scaling), the 5.x layout (rope_parameters) and
// the config transformers writes with save_pretrained, the inverse
// frequencies and attention scaling Strata derives equal those of
// transformers' LlamaRotaryEmbedding (to one fp32 ulp: transformers' pow is
// torch's fp32 pow, Strata's is correctly rounded), and transformers reads
// both layouts as the same model.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

#include "model/llama_config.h"
#include "model/rope.h"
#include "model_test_util.h"
#include "test_util/reference_python.h"

namespace strata::model {
namespace {

using testing::TempDir;
using testing::write_bytes;

int64_t ulps(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  return std::abs(static_cast<int64_t>(ia) - static_cast<int64_t>(ib));
}

TEST(RopeVsTransformers, FrequenciesOfEveryTypeInEveryLayout) {
  const std::string py = strata::testing::find_reference_python(STRATA_TEST_PYTHON, "torch, transformers");
  if (py.empty()) STRATA_REFERENCE_MISSING("no Python that imports torch and transformers");
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  // head_dim 128 as in Llama 3 / Qwen; 64 for small models.
  const std::string shape64 = R"("hidden_size":256,"intermediate_size":512,"num_hidden_layers":1,
      "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":128,"max_position_embeddings":32768,
      "model_type":"llama","architectures":["LlamaForCausalLM"])";
  const std::string shape128 = R"("hidden_size":512,"intermediate_size":512,"num_hidden_layers":1,
      "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":128,"max_position_embeddings":131072,
      "model_type":"llama","architectures":["LlamaForCausalLM"])";
  struct Case {
    std::string name, shape, v4, v5;
  };
  const std::vector<Case> cases = {
      {"default", shape64, R"("rope_theta":10000.0,"rope_scaling":null)",
       R"("rope_parameters":{"rope_type":"default","rope_theta":10000.0})"},
      {"default_500k", shape128, R"("rope_theta":500000.0)",
       R"("rope_parameters":{"rope_type":"default","rope_theta":500000.0})"},
      {"linear", shape64, R"("rope_theta":10000.0,"rope_scaling":{"type":"linear","factor":4.0})",
       R"("rope_parameters":{"rope_type":"linear","factor":4.0,"rope_theta":10000.0})"},
      {"llama3", shape128,
       R"("rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
          "high_freq_factor":4.0,"original_max_position_embeddings":8192})",
       R"("rope_parameters":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
          "original_max_position_embeddings":8192,"rope_theta":500000.0})"},
      {"llama3_32", shape128,
       R"("rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":32.0,"low_freq_factor":1.0,
          "high_freq_factor":4.0,"original_max_position_embeddings":8192})",
       R"("rope_parameters":{"rope_type":"llama3","factor":32.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
          "original_max_position_embeddings":8192,"rope_theta":500000.0})"},
      {"yarn", shape128,
       R"("rope_theta":1000000.0,"rope_scaling":{"rope_type":"yarn","factor":4.0,
          "original_max_position_embeddings":32768})",
       R"("rope_parameters":{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768,
          "rope_theta":1000000.0})"},
      {"yarn_mscale", shape64,
       R"("rope_theta":10000.0,"rope_scaling":{"rope_type":"yarn","factor":16.0,"beta_fast":24,"beta_slow":2,
          "mscale":0.707,"mscale_all_dim":1.0,"original_max_position_embeddings":2048})",
       R"("rope_parameters":{"rope_type":"yarn","factor":16.0,"beta_fast":24,"beta_slow":2,"mscale":0.707,
          "mscale_all_dim":1.0,"original_max_position_embeddings":2048,"rope_theta":10000.0})"},
      {"yarn_attention_factor_untruncated", shape64,
       R"("rope_theta":10000.0,"rope_scaling":{"rope_type":"yarn","factor":2.0,"attention_factor":1.25,
          "truncate":false,"original_max_position_embeddings":4096})",
       R"("rope_parameters":{"rope_type":"yarn","factor":2.0,"attention_factor":1.25,"truncate":false,
          "original_max_position_embeddings":4096,"rope_theta":10000.0})"},
  };
  std::vector<std::string> dirs;
  for (const Case& c : cases) {
    for (const char* layout : {"v4", "v5"}) {
      const std::string d = dir.file(c.name + "." + layout);
      std::filesystem::create_directories(d);
      write_bytes(d + "/config.json",
                  "{" + c.shape + "," + (std::string(layout) == "v4" ? c.v4 : c.v5) + "}");
      dirs.push_back(d);
    }
  }
  // transformers reads each config, saves it back (its own layout, into
  // <dir>/hf) and prints its rotary embedding's inv_freq and scaling.
  const std::string script = dir.file("rope.py");
  write_bytes(script, R"(import json, sys, torch
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
for d in sys.argv[1:]:
    cfg = AutoConfig.from_pretrained(d)
    cfg.save_pretrained(d + "/hf")
    emb = LlamaRotaryEmbedding(cfg)
    inv = emb.inv_freq.to(torch.float32).tolist()
    print(json.dumps({"dir": d, "inv_freq": [float(x).hex() for x in inv], "scaling": float(emb.attention_scaling)}))
)");
  std::string cmd = py + " " + script;
  for (const auto& d : dirs) cmd += " " + d;
  std::string out;
  ASSERT_EQ(strata::testing::run_capture(cmd, &out), 0) << out;
  std::map<std::string, nlohmann::json> ref;
  for (size_t pos = 0; pos < out.size();) {
    const size_t end = out.find('\n', pos);
    const std::string line = out.substr(pos, end - pos);
    pos = end == std::string::npos ? out.size() : end + 1;
    if (line.rfind("{\"dir\"", 0) != 0) continue;
    auto j = nlohmann::json::parse(line);
    ref[j["dir"].get<std::string>()] = j;
  }
  ASSERT_EQ(ref.size(), dirs.size()) << out;
  int64_t worst = 0;  // over every case
  for (const auto& d : dirs) {
    const auto& r = ref[d];
    std::vector<float> want;
    for (const auto& h : r["inv_freq"]) want.push_back(static_cast<float>(std::strtod(h.get<std::string>().c_str(), nullptr)));
    for (const std::string& which : {d + "/config.json", d + "/hf/config.json"}) {
      SCOPED_TRACE(which);
      auto c = load_llama_config(which);
      ASSERT_TRUE(c.ok()) << c.status().to_string();
      const RopeFrequencies f = rope_frequencies(c->rope, static_cast<int64_t>(c->head_dim()));
      ASSERT_EQ(f.inv_freq.size(), want.size());
      int64_t case_worst = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        case_worst = std::max(case_worst, ulps(f.inv_freq[i], want[i]));
        EXPECT_LE(ulps(f.inv_freq[i], want[i]), 1)
            << "inv_freq[" << i << "] " << f.inv_freq[i] << " vs transformers' " << want[i];
      }
      EXPECT_FLOAT_EQ(f.attention_scaling, static_cast<float>(r["scaling"].get<double>()));
      worst = std::max(worst, case_worst);
    }
    std::printf("%-36s %s\n", std::filesystem::path(d).filename().c_str(),
                rope_describe(load_llama_config(d + "/config.json")->rope).c_str());
  }
  std::printf("largest difference from transformers' inv_freq: %lld ulp\n", static_cast<long long>(worst));
}

}  // namespace
}  // namespace strata::model
