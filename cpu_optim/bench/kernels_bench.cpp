// Google Benchmark microbenchmarks of the CPU optimizer kernels, per ISA and
// dtype combination. A program, not a test: `strata_cpu_optim_bench
// --benchmark_filter=AdamW`. Unsupported ISAs report SkipWithError.
// Sizes: 1M elements (mostly cache-resident on big L3s) and 32M (memory).
#include <benchmark/benchmark.h>

#include <cstring>
#include <string>

#include "common/host_memory.h"
#include "cpu_optim/dispatch.h"
#include "cpu_optim/membw.h"
#include "cpu_optim/optimizer.h"

namespace {
using namespace strata;
using namespace strata::cpu_optim;

struct Arrays {
  HostArray<float> p;
  HostArray<std::uint8_t> g, s0, s1, out;
};

Arrays make(std::size_t n, DType gd, DType sd) {
  Arrays a;
  a.p = std::move(HostArray<float>::create(n).value());
  a.g = std::move(HostArray<std::uint8_t>::create(n * dtype_size(gd)).value());
  a.s0 = std::move(HostArray<std::uint8_t>::create(n * dtype_size(sd)).value());
  a.s1 = std::move(HostArray<std::uint8_t>::create(n * dtype_size(sd)).value());
  a.out = std::move(HostArray<std::uint8_t>::create(n * 2).value());
  for (std::size_t i = 0; i < n; ++i) a.p[i] = 0.01f * static_cast<float>(i % 101);
  std::memset(a.g.data(), 0x3c, a.g.size());  // small positive values in every dtype
  // Touch every page now, so that first-touch faults are not timed.
  std::memset(a.s0.data(), 0, a.s0.size());
  std::memset(a.s1.data(), 0, a.s1.size());
  std::memset(a.out.data(), 0, a.out.size());
  return a;
}

void run_step(benchmark::State& st, Isa isa, OptimizerKind kind, DType gd, DType sd, bool out) {
  if (!isa_supported(isa)) {
    st.SkipWithError((std::string(isa_name(isa)) + " not supported on this CPU").c_str());
    return;
  }
  const std::size_t n = static_cast<std::size_t>(st.range(0));
  const int threads = static_cast<int>(st.range(1));
  Arrays a = make(n, gd, sd);
  OptimizerConfig c;
  c.kind = kind;
  c.weight_decay = 0.01;
  c.momentum = kind == OptimizerKind::kSgd ? 0.9 : 0.0;
  StepBuffers b;
  b.params = a.p.data();
  b.grads = a.g.data();
  b.grad_dtype = gd;
  b.state[0] = a.s0.data();
  b.state[1] = a.s1.data();
  b.state_dtype = sd;
  if (out) b.params_out = a.out.data();
  ExecOptions ex{isa, threads};
  std::int64_t t = 1;
  if (Status s = step(c, t, b, n, ex); !s.ok()) {  // warm-up (thread pool, pages)
    st.SkipWithError(s.to_string().c_str());
    return;
  }
  for (auto _ : st) {
    Status s = step(c, ++t, b, n, ex);
    if (!s.ok()) {
      st.SkipWithError(s.to_string().c_str());
      return;
    }
  }
  st.SetItemsProcessed(st.iterations() * static_cast<std::int64_t>(n));
  st.SetBytesProcessed(st.iterations() * static_cast<std::int64_t>(n * bytes_per_param(c, b)));
}

void run_membw(benchmark::State& st, Isa isa) {
  if (!isa_supported(isa)) {
    st.SkipWithError("ISA not supported on this CPU");
    return;
  }
  const std::size_t n = static_cast<std::size_t>(st.range(0));
  auto b = HostArray<float>::create(n).value();
  auto c = HostArray<float>::create(n).value();
  (void)membw_rmw(b.data(), c.data(), 1e-3f, n, ExecOptions{isa, static_cast<int>(st.range(1))});  // warm-up
  for (auto _ : st) (void)membw_rmw(b.data(), c.data(), 1e-3f, n, ExecOptions{isa, static_cast<int>(st.range(1))});
  st.SetBytesProcessed(st.iterations() * static_cast<std::int64_t>(n * kMembwBytesPerElement));
}

void run_norm(benchmark::State& st, Isa isa, DType gd) {
  if (!isa_supported(isa)) {
    st.SkipWithError("ISA not supported on this CPU");
    return;
  }
  const std::size_t n = static_cast<std::size_t>(st.range(0));
  auto g = HostArray<std::uint8_t>::create(n * dtype_size(gd)).value();
  std::memset(g.data(), 0x3c, g.size());
  for (auto _ : st) benchmark::DoNotOptimize(grad_stats(g.data(), gd, n, 1.0, ExecOptions{isa, static_cast<int>(st.range(1))}));
  st.SetBytesProcessed(st.iterations() * static_cast<std::int64_t>(n * dtype_size(gd)));
}

void sizes(benchmark::internal::Benchmark* b) {
  for (long n : {1L << 20, 32L << 20})
    for (long t : {1L, 2L}) b->Args({n, t});
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

#define STEP_BENCH(name, isa, kind, gd, sd, out)                                               \
  void name(benchmark::State& st) { run_step(st, isa, OptimizerKind::kind, DType::gd, DType::sd, out); } \
  BENCHMARK(name)->Apply(sizes)

STEP_BENCH(AdamW_f32_scalar, Isa::kScalar, kAdamW, kF32, kF32, false);
STEP_BENCH(AdamW_f32_avx2, Isa::kAvx2, kAdamW, kF32, kF32, false);
STEP_BENCH(AdamW_f32_avx512, Isa::kAvx512, kAdamW, kF32, kF32, false);
STEP_BENCH(AdamW_f32_outbf16_avx2, Isa::kAvx2, kAdamW, kF32, kF32, true);
STEP_BENCH(AdamW_f32_outbf16_avx512, Isa::kAvx512, kAdamW, kF32, kF32, true);
STEP_BENCH(AdamW_bf16grad_bf16state_avx2, Isa::kAvx2, kAdamW, kBF16, kBF16, false);
STEP_BENCH(AdamW_bf16grad_bf16state_avx512, Isa::kAvx512, kAdamW, kBF16, kBF16, false);
STEP_BENCH(AdamW_f16grad_avx2, Isa::kAvx2, kAdamW, kF16, kF32, false);
STEP_BENCH(Adagrad_f32_avx2, Isa::kAvx2, kAdagrad, kF32, kF32, false);
STEP_BENCH(Lion_f32_avx2, Isa::kAvx2, kLion, kF32, kF32, false);
STEP_BENCH(Sgd_f32_avx2, Isa::kAvx2, kSgd, kF32, kF32, false);

void Membw_avx2(benchmark::State& st) { run_membw(st, Isa::kAvx2); }
BENCHMARK(Membw_avx2)->Apply(sizes);
void Membw_avx512(benchmark::State& st) { run_membw(st, Isa::kAvx512); }
BENCHMARK(Membw_avx512)->Apply(sizes);
void GradNorm_f32_avx2(benchmark::State& st) { run_norm(st, Isa::kAvx2, DType::kF32); }
BENCHMARK(GradNorm_f32_avx2)->Apply(sizes);
void GradNorm_bf16_avx512(benchmark::State& st) { run_norm(st, Isa::kAvx512, DType::kBF16); }
BENCHMARK(GradNorm_bf16_avx512)->Apply(sizes);

}  // namespace

BENCHMARK_MAIN();
