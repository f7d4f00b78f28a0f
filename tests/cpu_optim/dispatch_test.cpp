// ISA detection, forcing (API and STRATA_CPU_ISA), and argument validation.
#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "common/tunables.h"
#include "test_util.h"

namespace strata::cpu_optim {
namespace {

TEST(Dispatch, ScalarAlwaysRunsAndBestIsSupported) {
  EXPECT_TRUE(isa_supported(Isa::kScalar));
  EXPECT_TRUE(isa_supported(best_isa()));
  std::printf("  this machine: %s\n", cpu_isa_summary().c_str());
  const CpuFeatures& f = cpu_features();
  if (f.x86) {
    EXPECT_FALSE(isa_supported(Isa::kNeon));
    EXPECT_EQ(isa_supported(Isa::kAvx2), f.avx2 && f.fma && f.f16c);
  }
}

TEST(Dispatch, ParseNames) {
  for (Isa i : {Isa::kAuto, Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kNeon}) {
    auto r = parse_isa(isa_name(i));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r.value(), i);
  }
  EXPECT_EQ(parse_isa("sse9").status().code(), StatusCode::kInvalidArgument);
}

// Forcing an ISA this machine cannot run is an error with a reason, not a SIGILL.
TEST(Dispatch, ForcingUnsupportedIsaIsAnError) {
  std::vector<Isa> missing;
  for (Isa i : {Isa::kAvx2, Isa::kAvx512, Isa::kNeon})
    if (!isa_supported(i)) missing.push_back(i);
  if (missing.empty()) GTEST_SKIP() << "every ISA runs here";
  float p = 1, g = 1;
  StepBuffers b;
  b.params = &p;
  b.grads = &g;
  OptimizerConfig c;
  c.kind = OptimizerKind::kSgd;
  for (Isa i : missing) {
    Status s = step(c, 1, b, 1, ExecOptions{i, 1});
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << isa_name(i);
    EXPECT_NE(s.message().find(isa_name(i)), std::string::npos) << s.message();
    EXPECT_EQ(p, 1.0f) << "nothing may be modified on error";
  }
}

TEST(Dispatch, EnvironmentOverride) {
  ::setenv("STRATA_CPU_ISA", "scalar", 1);
  reload_tunables();
  auto r = resolve_isa(Isa::kAuto);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.value(), Isa::kScalar);
  // An explicit API choice wins over the environment.
  auto r2 = resolve_isa(Isa::kAvx2);
  EXPECT_EQ(r2.ok(), isa_supported(Isa::kAvx2));
  Isa lacking = Isa::kNeon;
  if (!cpu_features().x86) lacking = Isa::kAvx2;
  ::setenv("STRATA_CPU_ISA", isa_name(lacking), 1);
  reload_tunables();
  auto r3 = resolve_isa(Isa::kAuto);
  EXPECT_EQ(r3.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r3.status().message().find("STRATA_CPU_ISA"), std::string::npos) << r3.status().message();
  ::unsetenv("STRATA_CPU_ISA");
  reload_tunables();
  EXPECT_EQ(resolve_isa(Isa::kAuto).value(), best_isa());
}

TEST(Dispatch, ThreadsDefaultToAffinity) {
  EXPECT_GE(detail::resolve_threads(0), 1);
  EXPECT_EQ(detail::resolve_threads(5), 5);
}

TEST(Validation, BadArgumentsAreRejectedAndNothingIsTouched) {
  float p[4] = {1, 2, 3, 4}, g[4] = {1, 1, 1, 1}, m[4] = {}, v[4] = {};
  StepBuffers b;
  b.params = p;
  b.grads = g;
  b.state[0] = m;
  b.state[1] = v;
  OptimizerConfig ok;
  ASSERT_TRUE(step(ok, 1, b, 0).ok());
  auto expect_invalid = [&](const OptimizerConfig& c, std::int64_t t, const StepBuffers& bb, const char* what) {
    Status s = step(c, t, bb, 4);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what << ": " << s.to_string();
    EXPECT_FALSE(s.message().empty());
    EXPECT_EQ(p[0], 1.0f) << what;
  };
  expect_invalid(ok, 0, b, "step 0");
  OptimizerConfig c = ok;
  c.lr = -1;
  expect_invalid(c, 1, b, "negative lr");
  c = ok;
  c.beta1 = 1.0;
  expect_invalid(c, 1, b, "beta1 = 1");
  c = ok;
  c.eps = std::nan("");
  expect_invalid(c, 1, b, "NaN eps");
  // Finite doubles past fp32's range: they became inf in the kernels (every
  // parameter NaN, status OK); torch refuses them converting to float.
  c = ok;
  c.lr = 1e39;
  expect_invalid(c, 1, b, "lr past fp32");
  EXPECT_EQ(step(c, 1, b, 4).message(), "cpu_optim: invalid learning rate 1e+39 (expected 0 to 3.4e38, fp32's largest)");
  c = ok;
  c.grad_scale = -1e39;
  expect_invalid(c, 1, b, "grad_scale past fp32");
  c = ok;
  c.weight_decay = 1e300;
  expect_invalid(c, 1, b, "weight_decay past fp32");
  c = ok;
  c.amsgrad = true;
  expect_invalid(c, 1, b, "amsgrad without state[2]");
  c = ok;
  c.kind = OptimizerKind::kSgd;
  c.nesterov = true;
  c.momentum = 0.9;
  c.dampening = 0.1;
  expect_invalid(c, 1, b, "nesterov with dampening");
  StepBuffers bb = b;
  bb.params = nullptr;
  expect_invalid(ok, 1, bb, "null params");
  bb = b;
  bb.state[1] = nullptr;
  expect_invalid(ok, 1, bb, "missing exp_avg_sq");
  bb = b;
  bb.state_dtype = DType::kF16;
  expect_invalid(ok, 1, bb, "fp16 states");
  bb = b;
  bb.params_out = m;
  bb.out_dtype = DType::kF32;
  expect_invalid(ok, 1, bb, "fp32 params_out");
  // Buffers sharing bytes (an audit: params_out over params wrote bf16 into
  // the fp32 masters and returned OK).
  bb = b;
  bb.params_out = p;
  bb.out_dtype = DType::kBF16;
  expect_invalid(ok, 1, bb, "params_out over params");
  EXPECT_EQ(step(ok, 1, bb, 4).message(), "cpu_optim: params and params_out overlap: each buffer must be its own memory");
  bb = b;
  bb.state[1] = m + 2;
  expect_invalid(ok, 1, bb, "exp_avg_sq inside exp_avg");
  bb = b;
  bb.grads = v;
  expect_invalid(ok, 1, bb, "grads over exp_avg_sq");
  c = ok;
  c.kind = static_cast<OptimizerKind>(99);
  expect_invalid(c, 1, b, "unknown optimizer");
  EXPECT_EQ(convert(p, m, DType::kF32, 4).code(), StatusCode::kInvalidArgument);
}

TEST(Validation, NamesAndSizes) {
  EXPECT_EQ(parse_dtype("bf16").value(), DType::kBF16);
  EXPECT_EQ(parse_dtype("float16").value(), DType::kF16);
  EXPECT_FALSE(parse_dtype("int8").ok());
  EXPECT_EQ(parse_optimizer("lion").value(), OptimizerKind::kLion);
  EXPECT_FALSE(parse_optimizer("rmsprop").ok());
  OptimizerConfig c;
  StepBuffers b;
  b.params = reinterpret_cast<float*>(8);
  EXPECT_EQ(bytes_per_param(c, b), 28u);  // fp32 AdamW: p r/w 8, g 4, m r/w 8, v r/w 8
  b.state_dtype = DType::kBF16;
  b.grad_dtype = DType::kBF16;
  b.params_out = b.params;
  EXPECT_EQ(bytes_per_param(c, b), 8u + 2 + 8 + 2);
}

}  // namespace
}  // namespace strata::cpu_optim
