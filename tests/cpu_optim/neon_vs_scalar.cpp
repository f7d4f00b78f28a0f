// The NEON kernels against the scalar ones, bit for bit, as a plain program
// (no gtest, no TBB: it is cross-compiled for aarch64 and run under
// qemu-aarch64 on x86 hosts; see tests/cpu_optim/CMakeLists.txt). It calls the
// two kernel tables directly with the same StepArgs, over every optimizer and
// dtype combination, odd sizes and several steps, plus grad sum-of-squares,
// conversion and the bandwidth kernel. Exit status 0 = all equal.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cpu_optim/arch/kernel_table.h"
#include "cpu_optim/numeric.h"

using namespace strata::cpu_optim;
using namespace strata::cpu_optim::detail;

namespace {

int g_failures = 0;

size_t dsize(DType d) { return d == DType::kF32 ? 4 : 2; }

struct Buffers {
  std::vector<float> p;
  std::vector<unsigned char> g, s[3], out;
};

float random_value(std::mt19937_64& rng, DType storage) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  double kind = u(rng), sign = u(rng) < 0.5 ? -1 : 1;
  auto logu = [&](double lo, double hi) { return std::exp(std::log(lo) + u(rng) * (std::log(hi) - std::log(lo))); };
  bool f16 = storage == DType::kF16;
  double x = kind < 0.08 ? 0.0
             : kind < 0.14 ? (f16 ? logu(6e-8, 6e-5) : logu(1.5e-45, 1.1e-38))
             : kind < 0.24 ? (f16 ? logu(6e-5, 1e-3) : logu(1e-30, 1e-12))
             : kind < 0.32 ? (f16 ? logu(1e3, 6e4) : logu(1e6, 1e15))
                           : logu(1e-4, 10.0);
  return static_cast<float>(sign * x);
}

void put(std::vector<unsigned char>& b, DType d, size_t i, float x) {
  if (d == DType::kF32) std::memcpy(&b[4 * i], &x, 4);
  else {
    uint16_t h = d == DType::kBF16 ? f32_to_bf16_bits(x) : f32_to_f16_bits(x);
    std::memcpy(&b[2 * i], &h, 2);
  }
}

bool same(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (!(std::isnan(a[i]) && std::isnan(b[i])) && std::memcmp(&a[i], &b[i], 4) != 0) return false;
  return true;
}

void check_step(OptimizerKind kind, bool ams, DType gd, DType sd, int out, size_t n) {
  StepArgs a{};
  a.kind = kind;
  a.grad_dtype = gd;
  a.state_dtype = sd;
  a.out_dtype = out == 2 ? DType::kF16 : DType::kBF16;
  a.amsgrad = ams;
  a.l2 = kind == OptimizerKind::kAdam || kind == OptimizerKind::kAdagrad || kind == OptimizerKind::kSgd;
  a.decoupled_wd = kind == OptimizerKind::kAdamW || kind == OptimizerKind::kLion;
  a.has_momentum = true;
  a.nesterov = n % 2 == 0;
  a.grad_scale = 1.0f / 1024;
  a.weight_decay = 0.01f;
  a.neg_lr_wd = -1e-5f;
  a.beta1 = 0.9f;
  a.one_minus_beta1 = 0.1f;
  a.beta2 = 0.999f;
  a.one_minus_beta2 = 0.001f;
  a.eps = 1e-8f;
  a.inv_sqrt_bc2 = 31.6f;
  a.momentum = 0.9f;
  a.one_minus_dampening = 0.9f;
  int nstates = kind == OptimizerKind::kAdamW || kind == OptimizerKind::kAdam ? (ams ? 3 : 2) : 1;
  std::mt19937_64 rng(n * 131 + static_cast<int>(kind));
  Buffers b[2];
  b[0].p.resize(n);
  b[0].g.resize(n * dsize(gd));
  for (int k = 0; k < 3; ++k) b[0].s[k].assign(k < nstates ? n * dsize(sd) : 0, 0);
  b[0].out.assign(out ? n * 2 : 0, 0);
  for (size_t i = 0; i < n; ++i) b[0].p[i] = random_value(rng, DType::kF32);
  b[1] = b[0];
  const KernelTable* tables[2] = {&kScalarKernels, &kNeonKernels};
  for (int t = 1; t <= 4; ++t) {
    for (size_t i = 0; i < n; ++i) put(b[0].g, gd, i, random_value(rng, gd));
    b[1].g = b[0].g;
    a.first_step = t == 1;
    // bf16 states: stochastic rounding on odd sizes, round to nearest on even
    // ones; a low index word that wraps inside the buffers.
    a.sr_states = n % 2 == 1;
    a.sr_lo0 = 0xffffffffu - static_cast<uint32_t>(n / 2);
    for (int k = 0; k < 3; ++k) a.sr_key[k] = 0x9e3779b9u * static_cast<uint32_t>(t * 3 + k + 1);
    a.neg_step_size = static_cast<float>(-1e-3 / (1 - std::pow(0.9, t)));
    for (int w = 0; w < 2; ++w) {
      StepArgs x = a;
      x.params = b[w].p.data();
      x.grads = b[w].g.data();
      for (int k = 0; k < 3; ++k) x.state[k] = k < nstates ? b[w].s[k].data() : nullptr;
      x.out = out ? b[w].out.data() : nullptr;
      StepFn fn = tables[w]->select_step(x);
      if (!fn) {
        std::printf("no kernel\n");
        ++g_failures;
        return;
      }
      fn(x, 0, n);
    }
    bool ok = same(b[0].p, b[1].p) && b[0].out == b[1].out;
    for (int k = 0; k < 3; ++k) ok = ok && b[0].s[k] == b[1].s[k];
    if (!ok) {
      std::printf("MISMATCH kind=%d ams=%d grad=%d states=%d out=%d n=%zu step=%d\n", static_cast<int>(kind), ams,
                  static_cast<int>(gd), static_cast<int>(sd), out, n, t);
      ++g_failures;
      return;
    }
  }
}

}  // namespace

int main() {
  int cases = 0;
  for (size_t n : {size_t{1}, size_t{3}, size_t{4}, size_t{5}, size_t{17}, size_t{64}, size_t{1027}})
    for (OptimizerKind k : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kAdagrad,
                            OptimizerKind::kLion, OptimizerKind::kSgd})
      for (bool ams : {false, true})
        for (DType gd : {DType::kF32, DType::kBF16, DType::kF16})
          for (DType sd : {DType::kF32, DType::kBF16})
            for (int out = 0; out < 3; ++out) {
              if (ams && k != OptimizerKind::kAdamW && k != OptimizerKind::kAdam) continue;
              check_step(k, ams, gd, sd, out, n);
              ++cases;
            }
  // Sum of squares, conversions and the bandwidth kernel.
  std::mt19937_64 rng(1);
  const size_t n = 40000 + 13;
  std::vector<float> src(n);
  for (auto& x : src) x = random_value(rng, DType::kF32);
  std::vector<unsigned char> gb(n * 2);
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    std::vector<unsigned char> g(n * dsize(d));
    for (size_t i = 0; i < n; ++i) put(g, d, i, src[i]);
    double s0 = kScalarKernels.sumsq[static_cast<int>(d)](g.data(), 5, n);
    double s1 = kNeonKernels.sumsq[static_cast<int>(d)](g.data(), 5, n);
    if (std::memcmp(&s0, &s1, 8) != 0) {
      std::printf("MISMATCH sumsq dtype=%d: %.17g vs %.17g\n", static_cast<int>(d), s0, s1);
      ++g_failures;
    }
    ++cases;
    // Gradient accumulation (first, then adding) and its squares.
    std::vector<float> a0(src.rbegin(), src.rend()), a1 = a0;
    for (bool first : {true, false, false}) {
      double q0 = kScalarKernels.accumulate[static_cast<int>(d)](a0.data(), g.data(), 3, n, first);
      double q1 = kNeonKernels.accumulate[static_cast<int>(d)](a1.data(), g.data(), 3, n, first);
      if (std::memcmp(&q0, &q1, 8) != 0 || std::memcmp(a0.data(), a1.data(), n * 4) != 0) {
        std::printf("MISMATCH accumulate dtype=%d first=%d: %.17g vs %.17g\n", static_cast<int>(d), int{first}, q0, q1);
        ++g_failures;
      }
      ++cases;
    }
  }
  for (DType d : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> c0(n), c1(n);
    std::mt19937 bits(2);
    std::vector<float> any(n);
    for (auto& x : any) x = f32_from_bits(bits());
    kScalarKernels.convert[static_cast<int>(d)](any.data(), c0.data(), 0, n);
    kNeonKernels.convert[static_cast<int>(d)](any.data(), c1.data(), 0, n);
    if (c0 != c1) {
      std::printf("MISMATCH convert dtype=%d\n", static_cast<int>(d));
      ++g_failures;
    }
    ++cases;
  }
  std::vector<float> b0(n, 1.5f), b1(n, 1.5f);
  kScalarKernels.membw(b0.data(), src.data(), 0.25f, 3, n);
  kNeonKernels.membw(b1.data(), src.data(), 0.25f, 3, n);
  if (!same(b0, b1)) {
    std::printf("MISMATCH membw\n");
    ++g_failures;
  }
  ++cases;
  std::printf("neon_vs_scalar: %d cases, %d mismatches\n", cases, g_failures);
  return g_failures ? 1 : 0;
}
