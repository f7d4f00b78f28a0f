// The tensor-core attention kernels (cuda/train/attention_mma_kernels.cuh),
// their own source, run on the CPU under the SIMT emulation
// (simt_emulator.h): forward, delta, dK/dV and dQ against the CPU attention
// ops (train/cpu_kernels.h, checked against PyTorch elsewhere) run in double
// on the same bf16-rounded q, k, v and dout. Label unit: this runs in every
// CI job; the gpu-labelled tests (tests/train/cuda_ops_test.cpp) run the same
// kernels on a GPU.
//
// Tolerances (normwise: max |got - want| / max |want|), derived from what
// the kernels round beyond their inputs: the probabilities P (forward and
// backward) and dS to bf16, relative 2^-9 = 2.0e-3 each, with sums in fp32.
// An output is a P-weighted mean of v rows (or dS/P-weighted sums of q, k,
// dout rows), so its error is about 2^-9 of the largest row it sums, which
// can be up to ~4x the largest output in these shapes (averaging shrinks
// outputs): 1e-2. The log-sum-exp involves no rounded probability: 1e-5
// (fp32 sums). An index, mask or fragment-layout error gives O(1).
//
// Every run is made twice, with the block's threads scheduled in ascending
// and in descending order: a missing __syncthreads reads the 0xFF fill of
// shared memory or another thread's stale value in one order, so the two
// must agree bit for bit.
#include <gtest/gtest.h>
#include <oneapi/tbb/task_arena.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/float_convert.h"
#include "cuda/simt_emulator.h"
#include "train/cpu_kernels.h"

// (CMake builds this file with -Wno-unknown-pragmas for the kernels' #pragma unroll.)
#define STRATA_CUDA_EMULATE 1
#include "cuda/train/attention_mma_kernels.cuh"

namespace {

namespace am = strata_cuda_train::attn_mma;
namespace cpu = strata::train::cpu;

struct Shape {
  int64_t B, T, H, KVH, hd;
};
std::string name_of(const Shape& s);
void PrintTo(const Shape& s, std::ostream* os) {
  *os << name_of(s);
}

std::string name_of(const Shape& s) {
  return "B" + std::to_string(s.B) + "_T" + std::to_string(s.T) + "_H" + std::to_string(s.H) + "_KV" +
         std::to_string(s.KVH) + "_hd" + std::to_string(s.hd);
}

float round_bf16(float x) {
  return strata::bf16_bits_to_f32(strata::f32_to_bf16_bits(x));
}

struct Result {
  std::vector<float> out, lse, dq, dk, dv;
};

// The four kernels as attention_mma.cu launches them, in the emulation.
template <int HD>
Result run_kernels(const Shape& s, const std::vector<float>& q, const std::vector<float>& k,
                   const std::vector<float>& v, const std::vector<float>& dout, bool reverse) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t n = s.B * s.T;
  Result r{std::vector<float>(n * s.H * HD, nan), std::vector<float>(s.B * s.H * s.T, nan),
           std::vector<float>(n * s.H * HD, nan), std::vector<float>(n * s.KVH * HD, nan),
           std::vector<float>(n * s.KVH * HD, nan)};
  std::vector<float> delta(s.B * s.H * s.T, nan);
  const int T = static_cast<int>(s.T), H = static_cast<int>(s.H), KVH = static_cast<int>(s.KVH);
  const unsigned tiles = static_cast<unsigned>((s.T + am::kTile - 1) / am::kTile);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(HD)));
  const strata_emu::Dim3 block{am::kBlock, 1, 1};
  std::string err = strata_emu::launch(
      {static_cast<unsigned>(s.B) * tiles, static_cast<unsigned>(H), 1}, block, am::fwd_smem(HD),
      [&] {
        am::attn_fwd_mma<HD>(q.data(), k.data(), v.data(), r.out.data(), r.lse.data(), T, H, KVH, scale * am::kLog2e);
      },
      reverse);
  EXPECT_EQ(err, "") << "forward";
  const unsigned delta_blocks = static_cast<unsigned>((n * H + am::kWarps - 1) / am::kWarps);
  err = strata_emu::launch(
      {delta_blocks, 1, 1}, block, 0, [&] { am::attn_delta(r.out.data(), dout.data(), delta.data(), n, T, H, HD); },
      reverse);
  EXPECT_EQ(err, "") << "delta";
  err = strata_emu::launch(
      {static_cast<unsigned>(s.B) * tiles, static_cast<unsigned>(KVH), 1}, block, am::bwd_smem(HD),
      [&] {
        am::attn_bwd_kv_mma<HD>(q.data(), k.data(), v.data(), dout.data(), r.lse.data(), delta.data(), r.dk.data(),
                                r.dv.data(), T, H, KVH, scale * am::kLog2e, scale);
      },
      reverse);
  EXPECT_EQ(err, "") << "dK/dV";
  err = strata_emu::launch(
      {static_cast<unsigned>(s.B) * tiles, static_cast<unsigned>(H), 1}, block, am::bwd_smem(HD),
      [&] {
        am::attn_bwd_q_mma<HD>(q.data(), k.data(), v.data(), dout.data(), r.lse.data(), delta.data(), r.dq.data(), T, H,
                               KVH, scale * am::kLog2e, scale);
      },
      reverse);
  EXPECT_EQ(err, "") << "dQ";
  return r;
}

Result run(const Shape& s, const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
           const std::vector<float>& dout, bool reverse) {
  if (s.hd == 64) return run_kernels<64>(s, q, k, v, dout, reverse);
  return run_kernels<128>(s, q, k, v, dout, reverse);
}

double normwise_err(const std::vector<float>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, mag = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, std::abs(got[i] - want[i]));
    mag = std::max(mag, std::abs(want[i]));
  }
  return mag > 0 ? diff / mag : diff;
}

class AttentionMmaEmulated : public ::testing::TestWithParam<Shape> {};

TEST_P(AttentionMmaEmulated, MatchesTheCpuOpsOnRoundedInputs) {
  const Shape s = GetParam();
  const int64_t n = s.B * s.T;
  std::mt19937_64 rng(1234 + s.T * 7 + s.hd);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto randn = [&](int64_t count, float scale) {
    std::vector<float> x(count);
    for (float& e : x) e = scale * nd(rng);
    return x;
  };
  // Scores of spread about 2.25 (q.k / sqrt(hd) with |q|, |k| ~ 1.5 sqrt(hd)):
  // peaked enough that a wrong key or mask changes the output.
  const std::vector<float> q = randn(n * s.H * s.hd, 1.5f), k = randn(n * s.KVH * s.hd, 1.5f),
                           v = randn(n * s.KVH * s.hd, 1.0f), dout = randn(n * s.H * s.hd, 1.0f);

  // The reference: the CPU ops in double on the bf16-rounded inputs.
  auto rounded = [](const std::vector<float>& x) {
    std::vector<double> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) r[i] = round_bf16(x[i]);
    return r;
  };
  const std::vector<double> qd = rounded(q), kd = rounded(k), vd = rounded(v), dod = rounded(dout);
  std::vector<double> out(n * s.H * s.hd), lse(n * s.H), dq(qd.size()), dk(kd.size()), dv(vd.size());
  cpu::AttnScratch<double> scratch;
  scratch.init(tbb::this_task_arena::max_concurrency(), s.hd);
  cpu::attention_forward(qd.data(), kd.data(), vd.data(), out.data(), lse.data(), s.B, s.T, s.H, s.KVH, s.hd, scratch);
  cpu::attention_backward(qd.data(), kd.data(), vd.data(), out.data(), lse.data(), dod.data(), dq.data(), dk.data(),
                          dv.data(), s.B, s.T, s.H, s.KVH, s.hd, scratch);
  // The CPU keeps lse as [n, heads]; the CUDA kernels as [B, heads, T].
  std::vector<double> lse_bht(lse.size());
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t t = 0; t < s.T; ++t) lse_bht[(b * s.H + h) * s.T + t] = lse[(b * s.T + t) * s.H + h];

  const Result up = run(s, q, k, v, dout, /*reverse=*/false);
  const Result down = run(s, q, k, v, dout, /*reverse=*/true);
  struct Check {
    const char* what;
    const std::vector<float>& got;
    const std::vector<float>& again;
    const std::vector<double>& want;
    double tol;
  };
  for (const Check& c : {Check{"out", up.out, down.out, out, 1e-2}, Check{"lse", up.lse, down.lse, lse_bht, 1e-5},
                         Check{"dq", up.dq, down.dq, dq, 1e-2}, Check{"dk", up.dk, down.dk, dk, 1e-2},
                         Check{"dv", up.dv, down.dv, dv, 1e-2}}) {
    double mag = 0;
    for (double w : c.want) mag = std::max(mag, std::abs(w));
    // With one key per row (T = 1) P is 1 and dS is 0: dq and dk are zero.
    const bool zero_expected = s.T == 1 && (c.want.data() == dq.data() || c.want.data() == dk.data());
    if (!zero_expected) {
      EXPECT_GT(mag, 0.0) << c.what << ": the reference is all zeros (a vacuous check)";
    }
    const double e = normwise_err(c.got, c.want);
    EXPECT_LE(e, c.tol) << c.what << ": normwise error " << e << " (tolerance " << c.tol << ")";
    EXPECT_TRUE(std::memcmp(c.got.data(), c.again.data(), c.got.size() * sizeof(float)) == 0)
        << c.what << ": threads scheduled in the other order give other bits (a missing barrier?)";
  }
}

// Head sizes 64 and 128; T of one row, less than a tile, one tile plus one,
// and several tiles with a partial last one; batch > 1; GQA groups of 1, 2, 4.
// (Small: the emulation switches fibers twice per lane per collective, about
// a microsecond each; these take 5 s together, 25 s under ASan.)
INSTANTIATE_TEST_SUITE_P(Shapes, AttentionMmaEmulated,
                         ::testing::Values(Shape{1, 1, 2, 1, 64}, Shape{2, 17, 4, 2, 64}, Shape{1, 65, 2, 2, 128},
                                           Shape{1, 130, 4, 1, 64}, Shape{2, 100, 2, 1, 128}),
                         [](const auto& info) { return name_of(info.param); });

// The emulator itself: a deadlock is reported, not hung.
TEST(SimtEmulator, ABarrierReachedByPartOfTheBlockIsReported) {
  const std::string err = strata_emu::launch({1, 1, 1}, {64, 1, 1}, 0, [] {
    if (threadIdx.x < 32) __syncthreads();
  });
  // Threads 32-63 exit; 0-31 then pass the barrier (exited threads do not
  // count, as on Volta and later): no deadlock.
  EXPECT_EQ(err, "");
  const std::string err2 = strata_emu::launch({1, 1, 1}, {64, 1, 1}, 0, [] {
    if (threadIdx.x < 16) (void)__shfl_xor_sync(0xffffffffu, 1.0f, 1);
  });
  EXPECT_NE(err2.find("warp collective"), std::string::npos) << err2;
}

// The emulated mma against a plain product, with every element distinct, so
// that a layout error in the emulator (which the kernels' test would share)
// cannot cancel out: A(r, c) = r + c / 16, B(k, n) = n - k / 8, both exact
// in bf16.
TEST(SimtEmulator, MmaComputesTheProductOfTheDocumentedFragments) {
  std::vector<float> d_all(32 * 4);
  const std::string err = strata_emu::launch({1, 1, 1}, {32, 1, 1}, 0, [&] {
    const int lane = static_cast<int>(threadIdx.x), g = lane >> 2, t = lane & 3;
    auto A = [](int r, int c) { return static_cast<float>(r) + static_cast<float>(c) / 16.0f; };
    auto B = [](int kk, int nn) { return static_cast<float>(nn) - static_cast<float>(kk) / 8.0f; };
    auto pack = [](float lo, float hi) {
      return static_cast<uint32_t>(strata_emu::bf16_bits(lo)) |
             (static_cast<uint32_t>(strata_emu::bf16_bits(hi)) << 16);
    };
    const uint32_t a[4] = {pack(A(g, 2 * t), A(g, 2 * t + 1)), pack(A(g + 8, 2 * t), A(g + 8, 2 * t + 1)),
                           pack(A(g, 2 * t + 8), A(g, 2 * t + 9)), pack(A(g + 8, 2 * t + 8), A(g + 8, 2 * t + 9))};
    const uint32_t b0 = pack(B(2 * t, g), B(2 * t + 1, g)), b1 = pack(B(2 * t + 8, g), B(2 * t + 9, g));
    float d[4] = {0, 0, 0, 0};
    strata_emu::mma16816_bf16(d, a, b0, b1);
    for (int i = 0; i < 4; ++i) d_all[lane * 4 + i] = d[i];
  });
  ASSERT_EQ(err, "");
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      const int row = (lane >> 2) + (i >= 2 ? 8 : 0), col = 2 * (lane & 3) + (i & 1);
      double want = 0;
      for (int kk = 0; kk < 16; ++kk) want += (row + kk / 16.0) * (col - kk / 8.0);
      EXPECT_DOUBLE_EQ(d_all[lane * 4 + i], want) << "lane " << lane << " element " << i;
    }
}

}  // namespace
