// strata.hpp, the RAII layer over the C API, built as C++17 against the
// public headers only (no internal include path reaches this target's code).
// One-parameter model on the host backend: one AdamW step checked against
// the closed form (tolerance 1e-6), ownership in either destruction order,
// errors carrying their message, a checkpoint round trip through std::string.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "strata/strata.hpp"

namespace {

using strata::api::Engine;
using strata::api::Error;
using strata::api::Stream;

constexpr size_t kN = 8;
const char* const kConfig = R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.5}},
  "zero_optimization": {"offload_param": {"device": "cpu", "buffer_size": 65536},
                        "offload_optimizer": {"device": "cpu"}},
  "strata": {"device_memory": "64MiB", "device_reserve": 0, "optimizer_chunk": 4096}})";

std::string temp_dir() {
  const char* base = getenv("STRATA_TEST_DIR");
  std::string t = std::string(base && *base ? base : "/tmp") + "/strata-hpp-XXXXXX";
  if (!mkdtemp(t.data())) return "";
  return t;
}

Error make_engine(Engine* e) {
  strata_engine_options_t o = Engine::default_options();
  o.config_json = kConfig;
  o.device_kind = STRATA_DEVICE_HOST;
  strata_param_desc_t p = Engine::param("w", "layer", {2, 4}, STRATA_DTYPE_F32);
  return Engine::create(o, &p, 1, e);
}

TEST(StrataHpp, ErrorCarriesCodeAndMessage) {
  Error ok;
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(ok.to_string(), "STRATA_OK");

  strata_engine_options_t o = Engine::default_options();
  EXPECT_EQ(o.struct_size, sizeof(o));
  o.config_json = "{\"strata\": {\"prefetch_depth\": \"two\"}}";
  strata_param_desc_t p = Engine::param("w", "layer", {4}, STRATA_DTYPE_F32);
  Engine e;
  Error err = Engine::create(o, &p, 1, &e);
  EXPECT_EQ(err.code(), STRATA_ERR_INVALID_ARGUMENT);
  EXPECT_NE(err.message().find("strata.prefetch_depth"), std::string::npos) << err.message();
  EXPECT_EQ(err.to_string().rfind("STRATA_ERR_INVALID_ARGUMENT: ", 0), 0u);
  EXPECT_FALSE(e);  // untouched on failure
  // The message was captured: later failures do not change it.
  Engine none;
  uint32_t id;
  EXPECT_FALSE(none.find_param("w", &id).ok());
  EXPECT_NE(err.message().find("prefetch_depth"), std::string::npos);

  strata_param_desc_t deep = Engine::param("w", "layer", {1, 1, 1, 1, 1, 1, 1, 1, 1}, STRATA_DTYPE_F32);
  EXPECT_EQ(Engine::create(Engine::default_options(), &deep, 1, &e).code(), STRATA_ERR_INVALID_ARGUMENT);
}

TEST(StrataHpp, OneAdamWStepAndCheckpoint) {
  Engine e;
  Error err = make_engine(&e);
  ASSERT_TRUE(err.ok()) << err.to_string();
  uint32_t w = 0, g = 0;
  ASSERT_TRUE(e.find_param("w", &w).ok());
  ASSERT_TRUE(e.find_group("layer", &g).ok());
  strata_device_kind_t kind;
  std::string dev;
  ASSERT_TRUE(e.device(&kind, &dev).ok());
  EXPECT_EQ(kind, STRATA_DEVICE_HOST);
  std::string plan;
  ASSERT_TRUE(e.plan_report(&plan).ok());
  EXPECT_NE(plan.find("Plan:"), std::string::npos) << plan;

  std::vector<float> p0(kN), grad(kN);
  for (size_t i = 0; i < kN; ++i) {
    p0[i] = 0.25f * static_cast<float>(i) - 1.0f;
    grad[i] = (i % 2 ? 1.0f : -2.0f) * static_cast<float>(i + 1);
  }
  ASSERT_TRUE(e.load_param(w, p0.data(), STRATA_DTYPE_F32, kN).ok());

  Stream s;
  ASSERT_TRUE(e.create_stream("hpp", &s).ok());
  Stream moved = std::move(s);
  EXPECT_FALSE(s);
  ASSERT_TRUE(moved);
  Stream wrapped;
  Error werr = e.wrap_stream(nullptr, &wrapped);
  EXPECT_EQ(werr.code(), STRATA_ERR_INVALID_ARGUMENT);  // host backend
  EXPECT_FALSE(wrapped);

  void* dev_grad = nullptr;
  ASSERT_TRUE(e.device_alloc(kN * sizeof(float), &dev_grad).ok());
  ASSERT_TRUE(e.begin_micro_batch(true).ok());
  void* ptrs[2];
  size_t n = 0;
  ASSERT_TRUE(e.acquire(g, moved, ptrs, 2, &n).ok());
  ASSERT_EQ(n, 1u);
  std::vector<float> seen(kN);
  ASSERT_TRUE(moved.memcpy_async(seen.data(), ptrs[0], kN * sizeof(float), STRATA_COPY_DEVICE_TO_HOST).ok());
  ASSERT_TRUE(moved.memcpy_async(dev_grad, grad.data(), kN * sizeof(float), STRATA_COPY_HOST_TO_DEVICE).ok());
  ASSERT_TRUE(e.reduce_grad(w, dev_grad, STRATA_DTYPE_F32, moved).ok());
  ASSERT_TRUE(e.release(g, moved).ok());
  ASSERT_TRUE(moved.synchronize().ok());
  EXPECT_EQ(seen, p0);
  strata_step_result_t r;
  err = e.step(-1, &r);
  ASSERT_TRUE(err.ok()) << err.to_string();
  EXPECT_EQ(r.step, 1);
  double sq = 0;
  for (float x : grad) sq += double(x) * x;
  EXPECT_NEAR(r.grad_norm, std::sqrt(sq), 1e-6 * std::sqrt(sq));

  // Step 1 of AdamW: m/bc1 = g, sqrt(v/bc2) = |g|, so p -= lr * (wd * p + g / (|g| + eps)).
  std::vector<float> p1(kN);
  ASSERT_TRUE(e.read_param(w, p1.data(), STRATA_DTYPE_F32, kN).ok());
  for (size_t i = 0; i < kN; ++i) {
    double want = p0[i] * (1 - 0.1 * 0.5) - 0.1 * grad[i] / (std::fabs(grad[i]) + 1e-8);
    EXPECT_NEAR(p1[i], want, 1e-6) << i;
  }

  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  ASSERT_TRUE(e.save_checkpoint(dir + "/ck", "{\"epoch\": 7}").ok());
  Engine e2;
  ASSERT_TRUE(make_engine(&e2).ok());
  std::string extra;
  err = e2.load_checkpoint(dir + "/ck", &extra);
  ASSERT_TRUE(err.ok()) << err.to_string();
  EXPECT_NE(extra.find("\"epoch\""), std::string::npos) << extra;
  std::vector<float> p2(kN);
  ASSERT_TRUE(e2.read_param(w, p2.data(), STRATA_DTYPE_F32, kN).ok());
  EXPECT_EQ(p2, p1);
  int64_t steps = 0;
  ASSERT_TRUE(e2.step_count(&steps).ok());
  EXPECT_EQ(steps, 1);
  strata_engine_stats_t st;
  ASSERT_TRUE(e.stats(&st).ok());
  EXPECT_EQ(st.steps, 1);

  ASSERT_TRUE(e.device_free(dev_grad).ok());
  // Engine destroyed before the stream: the stream's destructor must only
  // free its (dead) handle.
  e = Engine();
  EXPECT_FALSE(moved.synchronize().ok());
  EXPECT_TRUE(moved.reset().ok());
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// Frozen, no-weight-decay and lr-group parameters through the C ABI: a
// frozen weight keeps its bits and has no gradient, an undecayed one gets the
// AdamW step without the decay term, a decayed one with it, one in another lr
// group the step with that group's lr.
TEST(StrataHpp, FrozenAndUndecayedParameters) {
  strata_engine_options_t o = Engine::default_options();
  o.config_json = kConfig;
  o.device_kind = STRATA_DEVICE_HOST;
  strata_param_desc_t p[4] = {Engine::param("frozen", "layer", {2, 4}, STRATA_DTYPE_F32),
                              Engine::param("decayed", "layer", {2, 4}, STRATA_DTYPE_F32),
                              Engine::param("undecayed", "layer", {2, 4}, STRATA_DTYPE_F32),
                              Engine::param("slow", "layer", {2, 4}, STRATA_DTYPE_F32)};
  p[0].frozen = 1;
  p[2].no_weight_decay = 1;
  p[3].lr_group = 1;  // its own lr
  Engine e;
  Error err = Engine::create(o, p, 4, &e);
  ASSERT_TRUE(err.ok()) << err.to_string();
  EXPECT_EQ(strata_engine_set_group_lr(e.get(), 7, 0.1), STRATA_ERR_INVALID_ARGUMENT);  // no such group
  ASSERT_EQ(strata_engine_set_group_lr(e.get(), 1, 0.02), STRATA_OK);
  strata_param_info_t info{};
  info.struct_size = sizeof(info);
  ASSERT_EQ(strata_engine_param_info(e.get(), 0, &info), STRATA_OK);
  EXPECT_EQ(info.frozen, 1);
  ASSERT_EQ(strata_engine_param_info(e.get(), 2, &info), STRATA_OK);
  EXPECT_EQ(info.no_weight_decay, 1);
  EXPECT_EQ(info.frozen, 0);
  std::vector<float> p0(kN, 1.0f), grad(kN, 0.5f);
  for (uint32_t i = 0; i < 4; ++i) ASSERT_TRUE(e.load_param(i, p0.data(), STRATA_DTYPE_F32, kN).ok());
  Stream s;
  ASSERT_TRUE(e.create_stream("frozen", &s).ok());
  void* dev_grad = nullptr;
  ASSERT_TRUE(e.device_alloc(kN * sizeof(float), &dev_grad).ok());
  ASSERT_TRUE(s.memcpy_async(dev_grad, grad.data(), kN * sizeof(float), STRATA_COPY_HOST_TO_DEVICE).ok());
  ASSERT_TRUE(e.begin_micro_batch(true).ok());
  void* ptrs[4];
  size_t n = 0;
  ASSERT_TRUE(e.acquire(0, s, ptrs, 4, &n).ok());
  Error frozen = e.reduce_grad(0, dev_grad, STRATA_DTYPE_F32, s);
  EXPECT_EQ(frozen.code(), STRATA_ERR_INVALID_ARGUMENT);
  EXPECT_NE(frozen.to_string().find("frozen"), std::string::npos) << frozen.to_string();
  ASSERT_TRUE(e.reduce_grad(1, dev_grad, STRATA_DTYPE_F32, s).ok());
  ASSERT_TRUE(e.reduce_grad(2, dev_grad, STRATA_DTYPE_F32, s).ok());
  ASSERT_TRUE(e.reduce_grad(3, dev_grad, STRATA_DTYPE_F32, s).ok());
  ASSERT_TRUE(e.release(0, s).ok());
  ASSERT_TRUE(s.synchronize().ok());
  strata_step_result_t r;
  ASSERT_TRUE(e.step(-1, &r).ok());
  std::vector<float> got(kN);
  ASSERT_TRUE(e.read_param(0, got.data(), STRATA_DTYPE_F32, kN).ok());
  EXPECT_EQ(got, p0);
  // One rank: a broadcast from rank 0 leaves the bytes; rank 1 is no rank.
  ASSERT_TRUE(e.broadcast(got.data(), kN * sizeof(float), 0).ok());
  EXPECT_EQ(got, p0);
  Error no_rank = e.broadcast(got.data(), 4, 1);
  EXPECT_EQ(no_rank.code(), STRATA_ERR_INVALID_ARGUMENT);
  EXPECT_NE(no_rank.to_string().find("root 1 is not a rank"), std::string::npos) << no_rank.to_string();
  // lr 0.1, weight decay 0.5: step 1 moves by lr * sign(g) (+ lr * wd * p when decayed).
  ASSERT_TRUE(e.read_param(1, got.data(), STRATA_DTYPE_F32, kN).ok());
  EXPECT_NEAR(got[0], 1.0 * (1 - 0.1 * 0.5) - 0.1 * 0.5 / (0.5 + 1e-8), 1e-6);
  ASSERT_TRUE(e.read_param(2, got.data(), STRATA_DTYPE_F32, kN).ok());
  EXPECT_NEAR(got[0], 1.0 - 0.1 * 0.5 / (0.5 + 1e-8), 1e-6);
  // lr group 1 at lr 0.02 (decayed): the same step with its own lr.
  ASSERT_TRUE(e.read_param(3, got.data(), STRATA_DTYPE_F32, kN).ok());
  EXPECT_NEAR(got[0], 1.0 * (1 - 0.02 * 0.5) - 0.02 * 0.5 / (0.5 + 1e-8), 1e-6);
}

}  // namespace
