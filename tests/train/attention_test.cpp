// The tiled CPU attention (train/cpu_kernels.h) against a plain O(T^2)
// reference written here in double: forward and dq, dk, dv at sequence
// lengths around the tile size, grouped-query groups 1, 2 and 4, batches of
// two; in double (tolerance 1e-12 relative to the largest reference value:
// only the summation order differs) and in float, as the trainer runs it
// (2e-5: fp32 rounding over a few hundred terms). Then determinism (the
// same bits twice and under arenas of 1, 2 and 3 threads), a finite-
// difference check across tiles, and a long sequence (T = 8192) whose
// scratch stays a few tiles per thread.
#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ops_test_util.h"
#include "train/cpu_kernels.h"

namespace strata::train {
namespace {

using testing::dot;
using testing::random_vec;
using V = std::vector<double>;

struct Shape {
  int64_t B, T, H, KV, hd;
};

// q, k, v, dout of a shape; q and k scaled so that some rows are peaked.
struct Inputs {
  V q, k, v, dout;
  Inputs(const Shape& s, uint64_t seed) {
    std::mt19937_64 rng(seed);
    const int64_t n = s.B * s.T;
    q = random_vec<double>(rng, n * s.H * s.hd, 1.5);
    k = random_vec<double>(rng, n * s.KV * s.hd, 1.5);
    v = random_vec<double>(rng, n * s.KV * s.hd);
    dout = random_vec<double>(rng, n * s.H * s.hd);
  }
};

struct Outputs {
  V out, dq, dk, dv;
};

// Causal GQA softmax attention and its gradients, the whole T x T matrix of
// each (batch, head) at once: the textbook formulas.
Outputs reference(const Shape& s, const Inputs& in) {
  const int64_t T = s.T, H = s.H, KV = s.KV, hd = s.hd, n = s.B * T, group = H / KV;
  const int64_t qd = H * hd, kvd = KV * hd;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  Outputs o{V(n * qd), V(n * qd), V(n * kvd), V(n * kvd)};
  V p(T * T), ds(T * T);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kvh = h / group;
      auto q = [&](int64_t t) { return &in.q[(b * T + t) * qd + h * hd]; };
      auto dO = [&](int64_t t) { return &in.dout[(b * T + t) * qd + h * hd]; };
      auto k = [&](int64_t t) { return &in.k[(b * T + t) * kvd + kvh * hd]; };
      auto v = [&](int64_t t) { return &in.v[(b * T + t) * kvd + kvh * hd]; };
      auto dotp = [&](const double* a, const double* c) {
        double acc = 0;
        for (int64_t x = 0; x < hd; ++x) acc += a[x] * c[x];
        return acc;
      };
      for (int64_t i = 0; i < T; ++i) {
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j <= i; ++j) mx = std::max(mx, p[i * T + j] = scale * dotp(q(i), k(j)));
        for (int64_t j = 0; j <= i; ++j) sum += p[i * T + j] = std::exp(p[i * T + j] - mx);
        for (int64_t j = 0; j <= i; ++j) p[i * T + j] /= sum;
        double* out = &o.out[(b * T + i) * qd + h * hd];
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t x = 0; x < hd; ++x) out[x] += p[i * T + j] * v(j)[x];
        // dS = P (dP - rowsum(P dP)) scale, dP = dO V^T.
        double rowdot = 0;
        for (int64_t j = 0; j <= i; ++j) rowdot += p[i * T + j] * (ds[i * T + j] = dotp(dO(i), v(j)));
        for (int64_t j = 0; j <= i; ++j) ds[i * T + j] = p[i * T + j] * (ds[i * T + j] - rowdot) * scale;
        double* dq = &o.dq[(b * T + i) * qd + h * hd];
        for (int64_t j = 0; j <= i; ++j) {
          double* dk = &o.dk[(b * T + j) * kvd + kvh * hd];
          double* dv = &o.dv[(b * T + j) * kvd + kvh * hd];
          for (int64_t x = 0; x < hd; ++x) {
            dq[x] += ds[i * T + j] * k(j)[x];
            dk[x] += ds[i * T + j] * q(i)[x];
            dv[x] += p[i * T + j] * dO(i)[x];
          }
        }
      }
    }
  return o;
}

// The kernel in scalar type S, in the calling thread's arena.
template <typename S>
std::vector<std::vector<S>> run_kernel(const Shape& s, const Inputs& in) {
  auto cast = [](const V& x) { return std::vector<S>(x.begin(), x.end()); };
  const int64_t n = s.B * s.T;
  std::vector<S> q = cast(in.q), k = cast(in.k), v = cast(in.v), dout = cast(in.dout);
  std::vector<S> out(n * s.H * s.hd, S(7)), lse(n * s.H), dq(q.size(), S(7)), dk(k.size(), S(7)),
      dv(v.size(), S(7));  // 7: outputs are overwritten, not accumulated
  cpu::AttnScratch<S> scratch;
  scratch.init(tbb::this_task_arena::max_concurrency(), s.hd);
  cpu::attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), s.B, s.T, s.H, s.KV,
                         s.hd, scratch);
  cpu::attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), dout.data(),
                          dq.data(), dk.data(), dv.data(), s.B, s.T, s.H, s.KV, s.hd, scratch);
  return {out, dq, dk, dv, lse};
}

// max |got - want| / max |want|.
template <typename S>
double rel_err(const std::vector<S>& got, const V& want) {
  double err = 0, mag = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::abs(static_cast<double>(got[i]) - want[i]));
    mag = std::max(mag, std::abs(want[i]));
  }
  return mag > 0 ? err / mag : err;
}

struct Case {
  int64_t T, H, KV;
};
class CpuAttention : public ::testing::TestWithParam<Case> {};

TEST_P(CpuAttention, MatchesReference) {
  const auto [T, H, KV] = GetParam();
  const Shape s{2, T, H, KV, 12};
  const Inputs in(s, static_cast<uint64_t>(T * 100 + H * 10 + KV));
  const Outputs ref = reference(s, in);
  const char* names[] = {"out", "dq", "dk", "dv"};
  const V* want[] = {&ref.out, &ref.dq, &ref.dk, &ref.dv};
  const auto d = run_kernel<double>(s, in);
  const auto f = run_kernel<float>(s, in);
  for (int i = 0; i < 4; ++i) {
    EXPECT_LT(rel_err(d[i], *want[i]), 1e-12) << "double " << names[i];
    EXPECT_LT(rel_err(f[i], *want[i]), 2e-5) << "float " << names[i];
  }
}

INSTANTIATE_TEST_SUITE_P(
    Lengths, CpuAttention,
    ::testing::Values(Case{1, 2, 2}, Case{63, 4, 2}, Case{64, 4, 1}, Case{65, 2, 2},
                      Case{65, 4, 1}, Case{200, 4, 2}, Case{200, 2, 2}, Case{200, 4, 1},
                      Case{517, 4, 1}, Case{517, 2, 2}, Case{517, 4, 2}),
    [](const auto& info) {
      std::string name = "T";  // appended piecewise: GCC 12's -Wrestrict misfires on "T" + string
      name += std::to_string(info.param.T);
      name += "_heads" + std::to_string(info.param.H);
      name += "_kv" + std::to_string(info.param.KV);
      return name;
    });

// The same bits on a second run and under arenas of 1, 2 and 3 threads.
TEST(CpuAttention, DeterministicAcrossRunsAndThreadCounts) {
  const Shape s{2, 300, 4, 2, 16};
  const Inputs in(s, 99);
  std::vector<std::vector<std::vector<float>>> runs;
  for (int threads : {2, 2, 1, 3}) {
    tbb::task_arena arena(threads);
    arena.execute([&] { runs.push_back(run_kernel<float>(s, in)); });
  }
  for (size_t r = 1; r < runs.size(); ++r)
    for (size_t t = 0; t < runs[0].size(); ++t) {
      ASSERT_EQ(runs[r][t].size(), runs[0][t].size());
      EXPECT_EQ(std::memcmp(runs[r][t].data(), runs[0][t].data(), runs[0][t].size() * sizeof(float)), 0)
          << "run " << r << " output " << t;
    }
}

// Central finite differences over a sequence of three tiles (the last partial).
TEST(CpuAttention, GradientsMatchFiniteDifferencesAcrossTiles) {
  const int64_t B = 1, T = 2 * cpu::kAttnQBlock + 5, H = 2, KV = 1, hd = 4, n = B * T;
  std::mt19937_64 rng(5);
  V q = random_vec<double>(rng, n * H * hd), k = random_vec<double>(rng, n * KV * hd),
    v = random_vec<double>(rng, n * KV * hd), r = random_vec<double>(rng, n * H * hd),
    out(n * H * hd), lse(n * H);
  cpu::AttnScratch<double> scratch;
  scratch.init(tbb::this_task_arena::max_concurrency(), hd);
  auto f = [&] {
    cpu::attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), B, T, H, KV, hd,
                           scratch);
    return dot(r, out);
  };
  f();
  V dq(q.size()), dk(k.size()), dv(v.size());
  cpu::attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), r.data(), dq.data(),
                          dk.data(), dv.data(), B, T, H, KV, hd, scratch);
  STRATA_CHECK_GRAD("attention dq", q, dq, f);
  STRATA_CHECK_GRAD("attention dk", k, dk, f);
  STRATA_CHECK_GRAD("attention dv", v, dv, f);
}

// A long sequence: the scratch is a few tiles per thread whatever T is (the
// untiled kernel needed 2 T^2 values per thread: 512 MiB here), and sampled
// rows of the output and of the gradients match the reference computed for
// those rows alone.
TEST(CpuAttention, LongSequenceScratchStaysSmall) {
  const int64_t B = 1, T = 8192, H = 2, KV = 1, hd = 8, n = B * T;
  cpu::AttnScratch<float> scratch;
  const int slots = tbb::this_task_arena::max_concurrency();
  scratch.init(slots, hd);
  const int64_t tile = cpu::kAttnQBlock * cpu::kAttnKBlock;
  EXPECT_EQ(scratch.per_slot, cpu::AttnScratch<float>::values_per_slot(hd));
  EXPECT_LE(scratch.per_slot, 2 * tile + cpu::kAttnQBlock * (hd + 2));
  EXPECT_EQ(scratch.bytes(), static_cast<size_t>(slots) * scratch.per_slot * sizeof(float));
  EXPECT_LT(scratch.bytes(), static_cast<size_t>(slots) * 64 * 1024);  // vs 512 MiB per slot untiled

  std::mt19937_64 rng(8);
  std::vector<float> q = random_vec<float>(rng, n * H * hd), k = random_vec<float>(rng, n * KV * hd),
                     v = random_vec<float>(rng, n * KV * hd), dO = random_vec<float>(rng, n * H * hd);
  std::vector<float> out(n * H * hd), lse(n * H), dq(q.size()), dk(k.size()), dv(v.size());
  cpu::attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), B, T, H, KV, hd, scratch);
  cpu::attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), dO.data(), dq.data(),
                          dk.data(), dv.data(), B, T, H, KV, hd, scratch);

  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  const int64_t h = 1, qd = H * hd;  // head 1 reads kv head 0
  // Row i's probabilities over keys 0..i, and D_i = sum_j P_ij dP_ij.
  auto probs = [&](int64_t i, V& p, double& d) {
    p.assign(i + 1, 0);
    double mx = -1e300, sum = 0;
    for (int64_t j = 0; j <= i; ++j) {
      double sc = 0;
      for (int64_t x = 0; x < hd; ++x) sc += double(q[i * qd + h * hd + x]) * k[j * hd + x];
      mx = std::max(mx, p[j] = sc * scale);
    }
    for (int64_t j = 0; j <= i; ++j) sum += p[j] = std::exp(p[j] - mx);
    d = 0;
    for (int64_t j = 0; j <= i; ++j) {
      p[j] /= sum;
      double dp = 0;
      for (int64_t x = 0; x < hd; ++x) dp += double(dO[i * qd + h * hd + x]) * v[j * hd + x];
      d += p[j] * dp;
    }
  };
  V p;
  double d = 0;
  for (int64_t i : {int64_t{0}, int64_t{1}, T / 2 - 1, T - 1}) {
    probs(i, p, d);
    for (int64_t x = 0; x < hd; ++x) {
      double o = 0, g = 0;
      for (int64_t j = 0; j <= i; ++j) {
        double dp = 0;
        for (int64_t y = 0; y < hd; ++y) dp += double(dO[i * qd + h * hd + y]) * v[j * hd + y];
        o += p[j] * v[j * hd + x];
        g += p[j] * (dp - d) * scale * k[j * hd + x];
      }
      EXPECT_NEAR(out[i * qd + h * hd + x], o, 1e-5) << "out row " << i;
      EXPECT_NEAR(dq[i * qd + h * hd + x], g, 1e-4) << "dq row " << i;
    }
  }
  // dv of the last keys: only the last rows see them (both heads add in).
  for (int64_t j : {T - 1, T - cpu::kAttnKBlock - 3}) {
    V want(hd, 0.0);
    for (int64_t hh = 0; hh < H; ++hh)
      for (int64_t i = j; i < T; ++i) {
        // Row i's probability of key j, from its log-sum-exp in double.
        double mx = -1e300, sum = 0;
        V sc(i + 1);
        for (int64_t jj = 0; jj <= i; ++jj) {
          double a = 0;
          for (int64_t x = 0; x < hd; ++x) a += double(q[i * qd + hh * hd + x]) * k[jj * hd + x];
          mx = std::max(mx, sc[jj] = a * scale);
        }
        for (int64_t jj = 0; jj <= i; ++jj) sum += std::exp(sc[jj] - mx);
        const double pij = std::exp(sc[j] - mx) / sum;
        for (int64_t x = 0; x < hd; ++x) want[x] += pij * dO[i * qd + hh * hd + x];
      }
    for (int64_t x = 0; x < hd; ++x) EXPECT_NEAR(dv[j * hd + x], want[x], 1e-4) << "dv row " << j;
  }
}

}  // namespace
}  // namespace strata::train
