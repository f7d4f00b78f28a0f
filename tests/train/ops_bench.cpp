// strata_train_ops_bench: throughput of one decoder layer's forward and
// backward (with its recompute) on the CPU ops, in GFLOP/s, next to a
// ceiling measured in the same run (one single-threaded GEMM of the layer's
// largest shape, times the thread count).
//
//   strata_train_ops_bench [dim ffn heads kv_heads B T threads reps]
//   defaults: 256 688 8 4 4 256 0 5  (B*T = 1024 tokens; threads 0 = all)
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "small_model.h"
#include "train/cpu_kernels.h"
#include "train/cpu_ops.h"

using namespace strata;
using namespace strata::train;
namespace fixture = strata::train::testing;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<float> rnd(std::mt19937_64& rng, int64_t n, float scale) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (argv[i][0] == '-' || std::atol(argv[i]) < 0 || (std::atol(argv[i]) == 0 && argv[i][0] != '0')) {
      std::fprintf(stderr, "usage: %s [dim ffn heads kv_heads B T threads reps] (non-negative integers)\n", argv[0]);
      return std::strcmp(argv[i], "-h") == 0 || std::strcmp(argv[i], "--help") == 0 ? 0 : 1;
    }
  }
  auto arg = [&](int i, long def) { return argc > i ? std::atol(argv[i]) : def; };
  LlamaDims d;
  d.dim = arg(1, 256);
  d.ffn_dim = arg(2, 688);
  d.heads = arg(3, 8);
  d.kv_heads = arg(4, 4);
  d.head_dim = d.dim / d.heads;
  d.vocab = 256;
  const int64_t B = arg(5, 4), T = arg(6, 256), n = B * T;
  const int threads = static_cast<int>(arg(7, 0));
  const int reps = static_cast<int>(std::max(1L, arg(8, 5)));

  auto r = create_cpu_ops({.dims = d, .max_batch = B, .max_seq = T, .threads = threads});
  if (!r.ok()) {
    std::fprintf(stderr, "%s\n", r.status().to_string().c_str());
    return 1;
  }
  ModelOps& ops = **r;
  std::mt19937_64 rng(1);
  const int64_t D = d.dim, qd = d.q_dim(), kvd = d.kv_dim(), F = d.ffn_dim;
  // The test fixture's layer (weights through the weight table): norms
  // normal(0, 1), the rest normal(0, 0.05).
  fixture::LayerBlob<float> weights, grads;
  weights.init_scaled(rng, d, [](LayerTensor t) {
    return fixture::InitScale{weight_row(t).norm ? 1.0 : 0.05};
  });
  grads.zeros_like(weights);
  const LayerWeights w = weights.weights();
  const LayerGrads lg = grads.grads();
  auto x = rnd(rng, n * D, 1.f), dy = rnd(rng, n * D, 1e-3f);
  std::vector<float> y(n * D), dx(n * D);

  // FLOPs: the linears, and attention over the causal half of the score
  // matrix (the tiled kernel skips key blocks above the diagonal): two block
  // products forward, seven backward (P and dS are computed in both passes).
  const double lin = 2.0 * n * (D * qd + 2.0 * D * kvd + qd * D + 3.0 * D * F);
  const double att_f = 4.0 * B * d.heads * (double(T) * (T + 1) / 2) * d.head_dim;
  const double fwd = lin + att_f;
  const double bwd = fwd /*recompute*/ + 2 * lin + 3.5 * att_f;

  auto time_it = [&](auto&& fn) {
    fn();  // warm-up (first-touch, caches)
    double best = 1e30;
    for (int i = 0; i < reps; ++i) {
      const double t0 = now();
      fn();
      best = std::min(best, now() - t0);
    }
    return best;
  };
  const double tf = time_it([&] { (void)ops.layer_forward(w, B, T, x.data(), y.data()); });
  const double tb = time_it([&] { (void)ops.layer_backward(w, B, T, x.data(), dy.data(), dx.data(), lg); });

  // Ceiling: one single-threaded GEMM [n, D] x [D, F] with the same kernel.
  auto a = rnd(rng, n * D, 1.f);
  std::vector<float> c(n * F);
  const double tg = time_it([&] {
    cpu::gemm<float>(false, true, n, F, D, a.data(), D, weights[kGateProj].data(), D, c.data(), F, false);
  });
  const int conc = threads > 0 ? threads : tbb::this_task_arena::max_concurrency();
  const double ceil1 = 2.0 * n * D * F / tg / 1e9;

  std::printf("layer dim=%ld ffn=%ld heads=%ld kv_heads=%ld head_dim=%ld, B=%ld T=%ld (%ld tokens), "
              "%d threads, gemm isa %s\n",
              long(D), long(F), long(d.heads), long(d.kv_heads), long(d.head_dim), long(B), long(T),
              long(n), conc, cpu_ops_gemm_isa());
  std::printf("  forward            %8.2f ms  %7.1f GFLOP/s\n", tf * 1e3, fwd / tf / 1e9);
  std::printf("  backward+recompute %8.2f ms  %7.1f GFLOP/s\n", tb * 1e3, bwd / tb / 1e9);
  std::printf("  fwd+bwd            %8.2f ms  %7.1f GFLOP/s  %.0f tokens/s per layer\n",
              (tf + tb) * 1e3, (fwd + bwd) / (tf + tb) / 1e9, n / (tf + tb));
  std::printf("  ceiling: 1-thread GEMM %ldx%ldx%ld %.1f GFLOP/s (x%d threads = %.1f)\n", long(n),
              long(F), long(D), ceil1, conc, ceil1 * conc);
  return 0;
}
