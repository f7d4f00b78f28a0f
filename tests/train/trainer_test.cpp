// The trainer over the offload engine (train/trainer.h), end to end on small
// random models and the demo text:
//   - everything in RAM and everything on NVMe give bitwise identical losses,
//     gradient norms and final weights (tied and untied embeddings, gradient
//     accumulation, clipping);
//   - train -> checkpoint -> load -> evaluate gives the same validation loss
//     (bitwise), and so does the exported HF model loaded as a new model;
//   - a resumed run continues bitwise identically to an uninterrupted one;
//   - the loss on the demo data falls below a stated threshold in a stated
//     number of steps;
//   - errors: missing model, data too short, out dir not writable, NVMe dir
//     missing, resuming with a different batch;
//   - --device: cpu, cuda (or kUnavailable with the reason), auto; with a GPU
//     the CUDA trainer's losses against the CPU trainer's (skipped without).
// Files under STRATA_TEST_DIR (else /tmp), removed at the end. Label nvme.
#include "train/trainer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/crc32c.h"
#include "model/llama_config.h"
#include "model/llama_init.h"
#include "small_model.h"
#include "train/demo_data.h"
#include "train/run_dir.h"
#include "test_util/gpu.h"

namespace strata::train {
namespace {

namespace fs = std::filesystem;

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* env = std::getenv("STRATA_TEST_DIR");
    std::string tmpl = std::string(env && *env ? env : "/tmp") + "/strata-trainer-test-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    ASSERT_NE(mkdtemp(buf.data()), nullptr);
    dir_ = buf.data();
    data_ = dir_ + "/data.txt";
    ASSERT_TRUE(write_demo_text(data_, 60000).ok());
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  // A small random Llama model (fp32 on disk) in dir_/name.
  std::string make_model(const std::string& name, bool tied, uint32_t layers = 2) {
    model::LlamaConfig c = testing::small_config(layers, tied);
    c.max_position_embeddings = 256;
    const std::string d = dir_ + "/" + name;
    fs::create_directories(d);
    Status st = model::write_random_llama(d, c, model::StDType::kF32, 3);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return d;
  }

  TrainerOptions base(const std::string& model, const std::string& out) {
    TrainerOptions o;
    o.model_dir = model;
    o.data.path = data_;
    o.data.seq = 32;
    o.data.val_fraction = 0.1;
    o.batch = 4;
    o.steps = 4;
    o.schedule.kind = ScheduleKind::kCosine;
    o.schedule.lr = 2e-3;
    o.schedule.warmup = 1;
    o.eval_batches = 4;
    o.out_dir = out;
    o.export_model = false;
    o.progress = ProgressMode::kQuiet;
    o.threads = 2;
    o.config.gradient_clipping = 1.0;
    o.config.optimizer.weight_decay = 0.01;
    return o;
  }
  // Every kind of state of every group on `tier`.
  static void place_all(TrainerOptions* o, Tier tier, const std::string& nvme) {
    GroupTierRule r;
    r.match = "*";
    r.compute = r.master = r.optimizer = r.grad = tier;
    o->config.strata.groups = {r};
    if (tier == Tier::kNvme) o->config.strata.nvme = {NvmeDir{nvme, 0}};
  }

  std::string dir_, data_;
};

struct RunLog {
  std::vector<double> loss, grad_norm;
  std::vector<std::vector<float>> params;
};

RunLog train_and_log(Trainer& t, int steps) {
  RunLog log;
  for (int i = 0; i < steps; ++i) {
    auto r = t.train_step();
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    if (!r.ok()) return log;
    log.loss.push_back(r->loss);
    log.grad_norm.push_back(r->engine.grad_norm);
  }
  const ModelSpec& spec = t.engine().model();
  for (ParamId p = 0; p < spec.params.size(); ++p) {
    std::vector<float> v(spec.params[p].numel());
    EXPECT_TRUE(t.engine().read_param(p, v.data(), DType::kF32).ok());
    log.params.push_back(std::move(v));
  }
  return log;
}

void expect_same(const RunLog& a, const RunLog& b) {
  ASSERT_EQ(a.loss.size(), b.loss.size());
  for (size_t i = 0; i < a.loss.size(); ++i) {
    EXPECT_EQ(a.loss[i], b.loss[i]) << "step " << i;  // bitwise: same arithmetic on every tier
    EXPECT_EQ(a.grad_norm[i], b.grad_norm[i]) << "step " << i;
  }
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t p = 0; p < a.params.size(); ++p)
    EXPECT_EQ(0, std::memcmp(a.params[p].data(), b.params[p].data(), a.params[p].size() * 4)) << "param " << p;
}

TEST_F(TrainerTest, RamAndNvmeGiveIdenticalLosses) {
  for (bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const std::string m = make_model(tied ? "tied" : "untied", tied);
    RunLog logs[2];
    for (int k = 0; k < 2; ++k) {
      TrainerOptions o = base(m, dir_ + "/out" + std::to_string(k) + (tied ? "-tied" : "-untied"));
      o.config.gradient_accumulation_steps = 2;
      const std::string nvme = dir_ + "/nvme" + std::to_string(k);
      fs::create_directories(nvme);
      place_all(&o, k == 0 ? Tier::kHost : Tier::kNvme, nvme);
      auto t = Trainer::create(o);
      ASSERT_TRUE(t.ok()) << t.status().to_string();
      const EngineStats s = (*t)->engine().stats();
      if (k == 0) {
        EXPECT_EQ(s.tier_bytes[static_cast<int>(Tier::kNvme)], 0u);
      } else {
        EXPECT_EQ(s.tier_bytes[static_cast<int>(Tier::kHost)], 0u);
        EXPECT_GT(s.tier_bytes[static_cast<int>(Tier::kNvme)], 0u);
      }
      logs[k] = train_and_log(**t, 4);
      if (k == 1) {
        EXPECT_GT((*t)->engine().stats().nvme_read_bytes, 0u);
      }
    }
    expect_same(logs[0], logs[1]);
    // The model learned something in 4 steps (a sanity check that steps update).
    EXPECT_LT(logs[0].loss.back(), logs[0].loss.front());
  }
}

TEST_F(TrainerTest, CheckpointAndExportReloadGiveTheSameValidationLoss) {
  const std::string m = make_model("m", /*tied=*/true);
  TrainerOptions o = base(m, dir_ + "/out");
  double v1 = 0;
  {
    auto t = Trainer::create(o);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_TRUE((*t)->train_step().ok());
    ASSERT_TRUE((*t)->train_step().ok());
    auto v = (*t)->evaluate();
    ASSERT_TRUE(v.ok()) << v.status().to_string();
    v1 = *v;
    ASSERT_TRUE((*t)->save_checkpoint(dir_ + "/ck").ok());
    ASSERT_TRUE((*t)->export_model(dir_ + "/exported", DType::kF32).ok());
  }
  {
    TrainerOptions r = base(m, dir_ + "/out2");
    r.resume_dir = dir_ + "/ck";
    auto t = Trainer::create(r);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    EXPECT_EQ((*t)->step(), 2);
    auto v = (*t)->evaluate();
    ASSERT_TRUE(v.ok());
    EXPECT_EQ(*v, v1);
  }
  {
    // The exported model (fp32 masters = the fp32 compute copies) as a fresh model.
    TrainerOptions r = base(dir_ + "/exported", dir_ + "/out3");
    auto t = Trainer::create(r);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    EXPECT_EQ((*t)->step(), 0);
    auto v = (*t)->evaluate();
    ASSERT_TRUE(v.ok());
    EXPECT_EQ(*v, v1);
  }
}

// LoRA (issue 11): a bf16 base frozen on NVMe, fp32 adapters with dropout.
// The base's stored bytes are the same before and after training (CRC32C of
// each frozen tensor's compute copy as the engine reads it back from its
// swap file), only adapters have optimizer state, RAM and NVMe placements
// train bit-identically, and a resumed run continues identically.
TEST_F(TrainerTest, LoraTrainsOnlyAdaptersAndLeavesTheNvmeBaseUntouched) {
  const std::string m = make_model("lora", /*tied=*/false);
  auto lora_opts = [&](const std::string& out, Tier tier, const std::string& nvme) {
    TrainerOptions o = base(m, out);
    o.config.bf16 = true;
    o.lora.rank = 4;
    o.lora.alpha = 8;
    o.lora.dropout = 0.1;
    o.lora.targets = kAllLoraTargets;
    o.steps = 6;
    place_all(&o, tier, nvme);
    return o;
  };
  auto frozen_crcs = [](Trainer& t) {
    std::vector<uint32_t> crcs;
    const ModelSpec& spec = t.engine().model();
    for (ParamId p = 0; p < spec.params.size(); ++p) {
      if (spec.params[p].trainable) continue;
      std::vector<uint16_t> v(spec.params[p].numel());
      EXPECT_TRUE(t.engine().read_param(p, v.data(), DType::kBF16).ok()) << spec.params[p].name;
      crcs.push_back(crc32c(v.data(), v.size() * 2));
    }
    return crcs;
  };
  RunLog logs[2];
  for (int k = 0; k < 2; ++k) {
    const std::string nvme = dir_ + "/lora-nvme" + std::to_string(k);
    fs::create_directories(nvme);
    auto t = Trainer::create(lora_opts(dir_ + "/lora-out" + std::to_string(k), k ? Tier::kNvme : Tier::kHost, nvme));
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    const ModelSpec& spec = (*t)->engine().model();
    uint64_t adapters = 0, frozen = 0;
    for (const ParamSpec& ps : spec.params) {
      const bool is_lora = ps.name.find(".lora_") != std::string::npos;
      EXPECT_EQ(ps.trainable, is_lora) << ps.name;
      (is_lora ? adapters : frozen) += 1;
      if (is_lora) {
        EXPECT_EQ(ps.compute_dtype, DType::kF32) << ps.name;
      }
    }
    EXPECT_EQ(adapters, 2u * 14u);  // 2 layers x 7 projections x (A, B)
    const std::vector<uint32_t> before = frozen_crcs(**t);
    EXPECT_EQ(before.size(), frozen);
    logs[k] = train_and_log(**t, 6);
    EXPECT_EQ(frozen_crcs(**t), before) << "a frozen tensor's stored bytes changed";
    if (k == 1) {
      EXPECT_GT((*t)->engine().stats().nvme_read_bytes, 0u);
    }
    // The adapters moved (B started at zero), the loss went down.
    for (ParamId p = 0; p < spec.params.size(); ++p)
      if (spec.params[p].name.ends_with("lora_B.weight")) {
        bool nonzero = false;
        for (float v : logs[k].params[p]) nonzero |= v != 0.0f;
        EXPECT_TRUE(nonzero) << spec.params[p].name;
      }
    EXPECT_LT(logs[k].loss.back(), logs[k].loss.front());
    if (k == 0) {
      ASSERT_TRUE((*t)->export_adapter(dir_ + "/lora-adapter").ok());
      EXPECT_TRUE(fs::exists(dir_ + "/lora-adapter/adapter_config.json"));
      EXPECT_TRUE(fs::exists(dir_ + "/lora-adapter/adapter_model.safetensors"));
    }
  }
  expect_same(logs[0], logs[1]);

  // Interrupted at step 3 and resumed: the same as the straight run (the
  // dropout masks follow the step, not the process).
  const std::string nvme = dir_ + "/lora-nvme-r";
  fs::create_directories(nvme);
  TrainerOptions o = lora_opts(dir_ + "/lora-r", Tier::kNvme, nvme);
  RunLog split;
  {
    auto t = Trainer::create(o);
    ASSERT_TRUE(t.ok());
    RunLog first = train_and_log(**t, 3);
    split.loss = first.loss;
    split.grad_norm = first.grad_norm;
    ASSERT_TRUE((*t)->save_checkpoint(dir_ + "/lora-r/checkpoint-3").ok());
  }
  {
    o.resume_dir = dir_ + "/lora-r";
    auto t = Trainer::create(o);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    RunLog rest = train_and_log(**t, 3);
    split.loss.insert(split.loss.end(), rest.loss.begin(), rest.loss.end());
    split.grad_norm.insert(split.grad_norm.end(), rest.grad_norm.begin(), rest.grad_norm.end());
    split.params = rest.params;
  }
  expect_same(logs[1], split);

  // Starting from the exported adapter gives its weights back.
  {
    TrainerOptions a = base(m, dir_ + "/lora-from-adapter");
    a.config.bf16 = true;
    a.lora.adapter_dir = dir_ + "/lora-adapter";
    auto t = Trainer::create(a);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    const ModelSpec& spec = (*t)->engine().model();
    for (ParamId p = 0; p < spec.params.size(); ++p) {
      if (!spec.params[p].trainable) continue;
      std::vector<float> v(spec.params[p].numel());
      ASSERT_TRUE((*t)->engine().read_param(p, v.data(), DType::kF32).ok());
      EXPECT_EQ(0, std::memcmp(v.data(), logs[0].params[p].data(), v.size() * 4)) << spec.params[p].name;
    }
  }
}

TEST_F(TrainerTest, ResumedRunContinuesIdentically) {
  const std::string m = make_model("m", /*tied=*/false);
  TrainerOptions o = base(m, dir_ + "/a");
  o.steps = 6;
  o.config.gradient_accumulation_steps = 2;
  RunLog straight;
  {
    auto t = Trainer::create(o);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    straight = train_and_log(**t, 6);
  }
  RunLog split;
  o.out_dir = dir_ + "/b";
  {
    auto t = Trainer::create(o);
    ASSERT_TRUE(t.ok());
    RunLog first = train_and_log(**t, 3);
    split.loss = first.loss;
    split.grad_norm = first.grad_norm;
    ASSERT_TRUE((*t)->save_checkpoint(dir_ + "/b/checkpoint-3").ok());
  }
  {
    TrainerOptions r = o;
    r.resume_dir = dir_ + "/b";  // a directory holding checkpoint-<step>: the newest is taken
    auto t = Trainer::create(r);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_EQ((*t)->step(), 3);
    RunLog rest = train_and_log(**t, 3);
    split.loss.insert(split.loss.end(), rest.loss.begin(), rest.loss.end());
    split.grad_norm.insert(split.grad_norm.end(), rest.grad_norm.begin(), rest.grad_norm.end());
    split.params = rest.params;
  }
  expect_same(straight, split);

  // Resuming with another batch size would read other data: refused.
  TrainerOptions bad = o;
  bad.resume_dir = dir_ + "/b/checkpoint-3";
  bad.batch = 2;
  auto t = Trainer::create(bad);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("batch"), std::string::npos) << t.status().message();
}

TEST_F(TrainerTest, RunWritesMetricsCheckpointsAndModel) {
  const std::string m = make_model("m", /*tied=*/true, 1);
  TrainerOptions o = base(m, dir_ + "/out");
  o.steps = 5;
  o.save_every = 2;
  o.keep = 1;
  o.eval_every = 2;
  o.export_model = true;
  auto t = Trainer::create(o);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  auto r = (*t)->run();
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->steps_done, 5);
  EXPECT_EQ(r->train_losses.size(), 5u);
  EXPECT_GT(r->initial_val_loss, 0);
  EXPECT_LT(r->final_val_loss, r->initial_val_loss);
  // keep = 1: only the newest periodic checkpoint is left.
  EXPECT_FALSE(fs::exists(dir_ + "/out/checkpoint-2"));
  EXPECT_TRUE(fs::exists(dir_ + "/out/checkpoint-4/index.json"));
  EXPECT_TRUE(fs::exists(dir_ + "/out/model/config.json"));
  EXPECT_TRUE(fs::exists(dir_ + "/out/model/model.safetensors"));
  std::ifstream f(dir_ + "/out/metrics.jsonl");
  int train = 0, eval = 0, ck = 0, plan = 0;
  for (std::string line; std::getline(f, line);) {
    // The placement's bytes per step, once, before the steps; every train
    // line carries the cumulative bytes to hold against it.
    if (line.find("\"event\":\"plan\"") != std::string::npos) {
      EXPECT_EQ(train, 0);
      EXPECT_NE(line.find("\"per_step\":{"), std::string::npos) << line;
      EXPECT_NE(line.find("\"h2d_bytes\""), std::string::npos) << line;
      ++plan;
    }
    if (line.find("\"event\":\"train\"") != std::string::npos) {
      EXPECT_NE(line.find("\"h2d_bytes\""), std::string::npos) << line;
      EXPECT_NE(line.find("\"d2h_bytes\""), std::string::npos) << line;
    }
    train += line.find("\"event\":\"train\"") != std::string::npos;
    eval += line.find("\"event\":\"eval\"") != std::string::npos;
    ck += line.find("\"event\":\"checkpoint\"") != std::string::npos;
  }
  EXPECT_EQ(train, 5);
  EXPECT_EQ(plan, 1);
  EXPECT_EQ(eval, 1 + 2 + 1);  // before, steps 2 and 4, after
  EXPECT_EQ(ck, 2);
}

// An export that fails leaves no config.json (a directory with one is a
// whole model), not even an older one.
TEST_F(TrainerTest, AFailedExportLeavesNoConfig) {
  const std::string m = make_model("m", /*tied=*/true, 1);
  auto t = Trainer::create(base(m, dir_ + "/out"));
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  const std::string dir = dir_ + "/export";
  fs::create_directories(dir + "/model.safetensors/in-the-way");  // the rename over it fails
  std::ofstream(dir + "/config.json") << "{}";
  Status st = (*t)->export_model(dir, DType::kF32);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.to_string().find("model.safetensors"), std::string::npos) << st.to_string();
  EXPECT_FALSE(fs::exists(dir + "/config.json"));
  fs::remove_all(dir + "/model.safetensors");
  ASSERT_TRUE((*t)->export_model(dir, DType::kF32).ok());
  EXPECT_TRUE(fs::exists(dir + "/config.json"));
}

// A metrics line that cannot be written (here /dev/full: ENOSPC at the
// flush) stops the run with an error naming the file; a resumed run keeps
// the file's plan line and adds none.
TEST_F(TrainerTest, MetricsWriteFailureStopsTheRunAndResumeAddsNoPlanLine) {
  const std::string m = make_model("m", /*tied=*/true, 1);
  TrainerOptions o = base(m, dir_ + "/full");
  o.steps = 3;
  o.metrics_path = "/dev/full";
  {
    auto t = Trainer::create(o);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    auto r = (*t)->run();
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("metrics file /dev/full: cannot write the plan line"), std::string::npos)
        << r.status().to_string();
    EXPECT_NE(r.status().to_string().find("No space left on device"), std::string::npos) << r.status().to_string();
  }
  o.metrics_path.clear();
  o.out_dir = dir_ + "/resumed";
  o.steps = 4;
  o.save_every = 2;
  {
    auto t = Trainer::create(o);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_TRUE((*t)->run().ok());
  }
  o.resume_dir = dir_ + "/resumed/checkpoint-2";  // the lines of steps 3 and 4 are written again
  {
    auto t = Trainer::create(o);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    auto r = (*t)->run();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
  }
  std::ifstream f(dir_ + "/resumed/metrics.jsonl");
  int plan = 0, train = 0;
  for (std::string line; std::getline(f, line);) {
    plan += line.find("\"event\":\"plan\"") != std::string::npos;
    train += line.find("\"event\":\"train\"") != std::string::npos;
  }
  EXPECT_EQ(plan, 1);
  EXPECT_EQ(train, 4);
}

// The demo's configuration scaled down to run in well under a minute on two
// cores: the validation loss on the demo text must fall from ~5.5 (random
// init: ln 256 = 5.55) below 1.5 nats per byte within 100 steps (it reaches
// about 1.0; the grammar's entropy is about 0.35).
TEST_F(TrainerTest, LossFallsOnDemoData) {
  const auto t0 = std::chrono::steady_clock::now();
  const model::LlamaConfig c = testing::small_config(/*layers=*/2, /*tied=*/true);
  const std::string m = dir_ + "/demo-model";
  fs::create_directories(m);
  ASSERT_TRUE(model::write_random_llama(m, c, model::StDType::kF32, 1).ok());
  TrainerOptions o = base(m, dir_ + "/out");
  o.data.seq = 64;
  o.batch = 8;
  o.steps = 100;
  o.schedule.lr = 5e-3;
  o.schedule.min_lr = 5e-4;
  o.schedule.warmup = 5;
  o.config.optimizer.weight_decay = 0;
  o.eval_batches = 4;
  const std::string nvme = dir_ + "/nvme";
  fs::create_directories(nvme);
  o.config.zero.offload_param = {.device = OffloadDevice::kNvme, .nvme_path = nvme};
  o.config.zero.offload_optimizer.device = OffloadDevice::kNvme;
  o.config.zero.offload_optimizer.nvme_path = nvme;
  auto t = Trainer::create(o);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  auto r = (*t)->run();
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("demo data: validation loss %.4f -> %.4f in %lld steps, %.1f s, %.0f tokens/s\n", r->initial_val_loss,
              r->final_val_loss, static_cast<long long>(r->steps_done), secs, r->tokens_per_s);
  EXPECT_GT(r->initial_val_loss, 5.0);
  EXPECT_LT(r->final_val_loss, 1.5);
}

// --device: cpu always works on the host backend; cuda either runs the CUDA
// ops or fails with kUnavailable naming the reason (no GPU, no module).
// (Parsing the flag: tests/tools/finetune_flags_test.cpp.)
TEST_F(TrainerTest, DeviceChoice) {
  const std::string m = make_model("m", /*tied=*/true, 1);
  TrainerOptions o = base(m, dir_ + "/cpu");
  o.device = TrainDevice::kCpu;
  {
    auto t = Trainer::create(o);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    EXPECT_STREQ((*t)->ops_name(), "cpu");
    EXPECT_EQ((*t)->engine().device().kind(), DeviceKind::kHost);
    EXPECT_EQ((*t)->device_description().rfind("cpu", 0), 0u) << (*t)->device_description();
    ASSERT_TRUE((*t)->train_step().ok());
  }
  o.out_dir = dir_ + "/cuda";
  o.device = TrainDevice::kCuda;
  auto t = Trainer::create(o);
  if (t.ok()) {
    EXPECT_STREQ((*t)->ops_name(), "cuda");
    EXPECT_EQ((*t)->engine().device().kind(), DeviceKind::kCuda);
  } else {
    EXPECT_EQ(t.status().code(), StatusCode::kUnavailable) << t.status().to_string();
    EXPECT_NE(t.status().message().find("--device cuda: cannot train on the GPU: "), std::string::npos)
        << t.status().message();
  }
  // auto is one of the two, and says which.
  o.out_dir = dir_ + "/auto";
  o.device = TrainDevice::kAuto;
  auto a = Trainer::create(o);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_STREQ((*a)->ops_name(), t.ok() ? "cuda" : "cpu");
}

// The CUDA trainer against the CPU trainer on the same model and data (fp32
// weights; the ops agree to 1e-4 normwise, train/cuda_ops.h). The first
// step's loss is a forward pass over the initial weights: 1e-4 relative.
// Its gradient norm: 1e-3 relative. Later steps follow AdamW updates, which
// amplify tiny gradient differences (about sign(g) * lr per element for
// small g): losses 1e-2 relative. Skipped without a usable GPU.
TEST_F(TrainerTest, CudaMatchesCpu) {
  for (bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const std::string m = make_model(tied ? "tied" : "untied", tied);
    RunLog logs[2];
    double val[2] = {0, 0};
    for (int k = 0; k < 2; ++k) {
      TrainerOptions o = base(m, dir_ + "/out" + std::to_string(k) + (tied ? "t" : "u"));
      o.config.gradient_accumulation_steps = 2;
      o.device = k == 0 ? TrainDevice::kCpu : TrainDevice::kCuda;
      auto t = Trainer::create(o);
      if (k == 1 && !t.ok() && t.status().code() == StatusCode::kUnavailable)
        STRATA_SKIP_WITHOUT_GPU("no usable GPU: " << t.status().message());
      ASSERT_TRUE(t.ok()) << t.status().to_string();
      ASSERT_STREQ((*t)->ops_name(), k == 0 ? "cpu" : "cuda");
      logs[k] = train_and_log(**t, 4);
      auto v = (*t)->evaluate();
      ASSERT_TRUE(v.ok()) << v.status().to_string();
      val[k] = *v;
    }
    ASSERT_EQ(logs[0].loss.size(), 4u);
    ASSERT_EQ(logs[1].loss.size(), 4u);
    EXPECT_NEAR(logs[1].loss[0], logs[0].loss[0], 1e-4 * logs[0].loss[0]);
    EXPECT_NEAR(logs[1].grad_norm[0], logs[0].grad_norm[0], 1e-3 * logs[0].grad_norm[0]);
    for (size_t i = 1; i < 4; ++i)
      EXPECT_NEAR(logs[1].loss[i], logs[0].loss[i], 1e-2 * logs[0].loss[i]) << "step " << i;
    EXPECT_NEAR(val[1], val[0], 1e-2 * val[0]);
    EXPECT_LT(logs[1].loss.back(), logs[1].loss.front());
  }
}

TEST_F(TrainerTest, Errors) {
  const std::string m = make_model("m", true, 1);
  auto expect_error = [&](const TrainerOptions& o, const std::string& want) {
    auto t = Trainer::create(o);
    ASSERT_FALSE(t.ok()) << "expected an error containing: " << want;
    EXPECT_NE(t.status().message().find(want), std::string::npos) << t.status().message();
  };
  TrainerOptions o = base(dir_ + "/nope", dir_ + "/out");
  expect_error(o, dir_ + "/nope");
  o = base(m, dir_ + "/out");
  const std::string tiny = dir_ + "/tiny.txt";
  std::ofstream(tiny) << "too short";
  o.data.path = tiny;
  expect_error(o, "too short");
  o = base(m, dir_ + "/out");
  o.data.path = dir_ + "/missing.txt";
  expect_error(o, "missing.txt");
  // An out dir below a regular file cannot be created.
  o = base(m, tiny + "/out");
  expect_error(o, "out dir " + tiny + "/out");
  o = base(m, dir_ + "/out");
  o.config.zero.offload_param.device = OffloadDevice::kNvme;
  o.config.zero.offload_param.nvme_path = dir_ + "/no-such-nvme";
  expect_error(o, "NVMe directory " + dir_ + "/no-such-nvme");
  o = base(m, dir_ + "/out");
  o.data.vocab = 100;
  o.data.format = DataFormat::kU32;
  o.data.vocab = 300;  // larger than the model's 256
  expect_error(o, "vocab_size 256");
}

// What a resume compares (run_dir.h): a changed key is named; keys an older
// run did not write are not compared, except "windows" (absent: packed); a
// constant schedule's min_lr (accepted by earlier versions, refused now) is
// not compared; a moved data file only warns.
TEST(ResumeSettings, NamesTheChangeAndKeepsOlderRunsResumable) {
  const std::string old_run = R"({"seq": 64, "data": "a.txt", "schedule": {"kind": "constant", "lr": 0.001, "min_lr": 1e-5}})";
  EXPECT_TRUE(check_same_settings(old_run, R"({"seq": 64, "data": "b.txt", "schedule": {"kind": "constant", "lr": 0.001,
      "min_lr": 0}, "windows": "packed", "model": {"rope": "default theta=10000"}})", "ck").ok());
  Status st = check_same_settings(old_run, R"({"seq": 32, "schedule": {"kind": "constant", "lr": 0.001}})", "ck");
  EXPECT_NE(st.message().find("seq = 64, this run has 32"), std::string::npos) << st.message();
  st = check_same_settings(old_run, R"({"seq": 64, "windows": "by document"})", "ck");
  EXPECT_NE(st.message().find(R"(windows = "packed", this run has "by document")"), std::string::npos) << st.message();
  st = check_same_settings(R"({"schedule": {"kind": "cosine", "min_lr": 1e-5}})",
                           R"({"schedule": {"kind": "cosine", "min_lr": 0}})", "ck");
  EXPECT_NE(st.message().find("schedule.min_lr = 1e-05, this run has 0"), std::string::npos) << st.message();
  st = check_same_settings(R"({"model": {"rope": "default theta=10000"}, "data_shape": {"tokens": 5}})",
                           R"({"model": {"rope": "default theta=500000"}, "data_shape": {"tokens": 5}})", "ck");
  EXPECT_NE(st.message().find("model.rope"), std::string::npos) << st.message();
  st = check_same_settings(R"({"data_shape": {"tokens": 5}})", R"({"data_shape": {"tokens": 6}})", "ck");
  EXPECT_NE(st.message().find("data_shape.tokens = 5, this run has 6"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace strata::train
