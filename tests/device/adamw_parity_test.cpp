// The two AdamW element formulas must stay one: cpu_optim's kernels (what the
// CPU optimizer and the NVMe step run) and common/device_numeric.h's adamw_element
// (what the host device backend and the CUDA kernels run). The engine may put
// one group's optimizer state on the GPU and another's on the host, so the
// same data must give the same bits on both paths. This test runs both over
// 60 steps with weight decay, a gradient scale and bf16 gradients, on every
// ISA this CPU has, and compares every bit.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/float_convert.h"
#include "cpu_optim/dispatch.h"
#include "cpu_optim/optimizer.h"
#include "common/device_numeric.h"

namespace strata {
namespace {

namespace dm = device_math;
using cpu_optim::Isa;

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

struct Case {
  DType grad;
  double grad_scale;
  double weight_decay;
};

void run(Isa isa, const Case& c) {
  const std::size_t n = 10007;  // not a multiple of any vector width
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f);
  for (auto& x : p) x = normal(rng);
  std::vector<float> pe = p, me = m, ve = v;  // device_math's element formula
  std::vector<float> g(n);
  std::vector<uint16_t> gb(n);

  cpu_optim::OptimizerConfig cfg;
  cfg.kind = cpu_optim::OptimizerKind::kAdamW;
  cfg.lr = 3e-3;
  cfg.beta1 = 0.9;
  cfg.beta2 = 0.95;
  cfg.eps = 1e-8;
  cfg.weight_decay = c.weight_decay;
  cfg.grad_scale = c.grad_scale;
  cpu_optim::ExecOptions exec;
  exec.isa = isa;
  exec.threads = 2;

  for (int step = 1; step <= 60; ++step) {
    for (std::size_t i = 0; i < n; ++i) {
      g[i] = normal(rng) * (i % 97 == 0 ? 1e-30f : 0.05f);  // some denormal-range gradients
      gb[i] = f32_to_bf16_bits(g[i]);
    }
    cpu_optim::StepBuffers b;
    b.params = p.data();
    b.grads = c.grad == DType::kBF16 ? static_cast<const void*>(gb.data()) : g.data();
    b.grad_dtype = c.grad;
    b.state[0] = m.data();
    b.state[1] = v.data();
    b.state_dtype = DType::kF32;
    ASSERT_TRUE(cpu_optim::step(cfg, step, b, n, exec).ok());

    const auto k = dm::adamw_consts(cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, step, c.grad_scale);
    for (std::size_t i = 0; i < n; ++i) {
      const float gi = c.grad == DType::kBF16 ? bf16_bits_to_f32(gb[i]) : g[i];
      dm::adamw_element(k, gi, pe[i], me[i], ve[i]);
    }
  }
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(bits(p[i]), bits(pe[i])) << cpu_optim::isa_name(isa) << " param " << i;
    ASSERT_EQ(bits(m[i]), bits(me[i])) << cpu_optim::isa_name(isa) << " exp_avg " << i;
    ASSERT_EQ(bits(v[i]), bits(ve[i])) << cpu_optim::isa_name(isa) << " exp_avg_sq " << i;
  }
}

class AdamWParity : public ::testing::TestWithParam<Isa> {};

TEST_P(AdamWParity, CpuOptimAndDeviceFormulaGiveTheSameBits) {
  const Isa isa = GetParam();
  if (!cpu_optim::isa_supported(isa)) GTEST_SKIP() << cpu_optim::isa_name(isa) << " is not supported by this CPU";
  run(isa, {DType::kF32, 1.0, 0.0});
  run(isa, {DType::kF32, 0.37, 0.1});
  run(isa, {DType::kBF16, 1.0 / 3.0, 0.01});
}

INSTANTIATE_TEST_SUITE_P(Isas, AdamWParity, ::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kNeon),
                         [](const auto& info) { return std::string(cpu_optim::isa_name(info.param)); });

}  // namespace
}  // namespace strata
