// `strata bench attention`: the CPU trainer's tiled causal attention
// (train/cpu_kernels.h: flash-attention style, O(T) memory) against the
// untiled kernel it replaced (the whole T x T score matrix and its gradient
// per task, 2 T^2 values of scratch per thread), both in fp32 on the same
// inputs in the same run, and both against a GEMM ceiling measured in the
// same run.
//
// For each --seqs length: forward, then backward (which is given the
// forward's output), for --reps rounds, old and new interleaved so drift on
// a shared machine hits both alike; medians reported. Useful FLOPs are the
// causal half only (the old kernel multiplies the whole square, so it runs
// twice as many): 4 b h T(T+1)/2 hd forward, 10 of the same backward (five
// block products, the flash-attention-2 count). The ceiling is one
// single-threaded GEMM of the untiled kernel's typical shape (1024 x 1024 x
// head_dim) times the thread count. The old kernel is skipped (and says so)
// at lengths where its scratch would take more than half the available memory.
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "commands.h"
#include "common/units.h"
#include "train/cpu_kernels.h"

namespace strata::tools {
namespace {

using train::cpu::gemm;

struct BenchAttentionOptions {
  std::string seqs = "512,2048,4096";
  int64_t heads = 8, kv_heads = 2, head_dim = 64, batch = 1;
  int threads = 0;
  int reps = 5;
  bool json = false;
};

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ---- the untiled kernel as it was before the tiling (commit 4f2f02f),
// kept here only as this bench's peer.
class Untiled {
 public:
  Untiled(int slots, int64_t T) : slots_(slots), per_slot_(2 * T * T) {
    buf_.assign(static_cast<size_t>(slots) * static_cast<size_t>(per_slot_), 0.f);
  }
  size_t bytes() const { return buf_.size() * sizeof(float); }

  void forward(const float* q, const float* k, const float* v, float* out, int64_t B, int64_t T,
               int64_t heads, int64_t kv_heads, int64_t hd) {
    const int64_t qd = heads * hd, kvd = kv_heads * hd, group = heads / kv_heads;
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    for_each(B * heads, [&](int64_t task) {
      const int64_t b = task / heads, h = task % heads, kvh = h / group;
      float* p = slot();
      gemm<float>(false, true, T, T, hd, q + b * T * qd + h * hd, qd, k + b * T * kvd + kvh * hd, kvd, p, T,
                  false);
      causal_softmax_rows(p, T, scale);
      gemm<float>(false, false, T, hd, T, p, T, v + b * T * kvd + kvh * hd, kvd, out + b * T * qd + h * hd, qd,
                  false);
    });
  }

  void backward(const float* q, const float* k, const float* v, const float* dout, float* dq, float* dk,
                float* dv, int64_t B, int64_t T, int64_t heads, int64_t kv_heads, int64_t hd) {
    const int64_t qd = heads * hd, kvd = kv_heads * hd, group = heads / kv_heads;
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    for_each(B * kv_heads, [&](int64_t task) {
      const int64_t b = task / kv_heads, kvh = task % kv_heads;
      float* p = slot();
      float* ds = p + T * T;
      const float* kh = k + b * T * kvd + kvh * hd;
      const float* vh = v + b * T * kvd + kvh * hd;
      float* dkh = dk + b * T * kvd + kvh * hd;
      float* dvh = dv + b * T * kvd + kvh * hd;
      for (int64_t gi = 0; gi < group; ++gi) {
        const int64_t h = kvh * group + gi;
        const float* qh = q + b * T * qd + h * hd;
        const float* doh = dout + b * T * qd + h * hd;
        gemm<float>(false, true, T, T, hd, qh, qd, kh, kvd, p, T, false);
        causal_softmax_rows(p, T, scale);
        gemm<float>(false, true, T, T, hd, doh, qd, vh, kvd, ds, T, false);
        for (int64_t i = 0; i < T; ++i) {
          const float* pr = p + i * T;
          float* dr = ds + i * T;
          float dot = 0;
          for (int64_t j = 0; j <= i; ++j) dot += pr[j] * dr[j];
          for (int64_t j = 0; j <= i; ++j) dr[j] = pr[j] * (dr[j] - dot) * scale;
          for (int64_t j = i + 1; j < T; ++j) dr[j] = 0;
        }
        gemm<float>(false, false, T, hd, T, ds, T, kh, kvd, dq + b * T * qd + h * hd, qd, false);
        gemm<float>(true, false, T, hd, T, ds, T, qh, qd, dkh, kvd, gi > 0);
        gemm<float>(true, false, T, hd, T, p, T, doh, qd, dvh, kvd, gi > 0);
      }
    });
  }

 private:
  template <typename F>
  static void for_each(int64_t n, F&& f) {
    tbb::parallel_for(  // one index per task, as the library's for_each_index
        tbb::blocked_range<int64_t>(0, n, 1),
        [&](const tbb::blocked_range<int64_t>& r) {
          for (int64_t i = r.begin(); i != r.end(); ++i) f(i);
        },
        tbb::simple_partitioner());
  }
  float* slot() {
    int idx = tbb::this_task_arena::current_thread_index();
    if (idx < 0 || idx >= slots_) idx = 0;
    return buf_.data() + static_cast<size_t>(idx) * static_cast<size_t>(per_slot_);
  }
  static void causal_softmax_rows(float* p, int64_t T, float scale) {
    for (int64_t i = 0; i < T; ++i) {
      float* row = p + i * T;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j <= i; ++j) mx = std::max(mx, row[j] *= scale);
      float sum = 0;
      for (int64_t j = 0; j <= i; ++j) sum += row[j] = std::exp(row[j] - mx);
      const float inv = 1.f / sum;
      for (int64_t j = 0; j <= i; ++j) row[j] *= inv;
      for (int64_t j = i + 1; j < T; ++j) row[j] = 0;
    }
  }
  int slots_;
  int64_t per_slot_;
  std::vector<float> buf_;
};

std::vector<float> rnd(std::mt19937_64& rng, int64_t n) {
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

// max |a - b| / max |b|.
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double err = 0, mag = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    err = std::max(err, static_cast<double>(std::abs(a[i] - b[i])));
    mag = std::max(mag, static_cast<double>(std::abs(b[i])));
  }
  return mag > 0 ? err / mag : err;
}

struct Row {
  int64_t T = 0;
  bool old_ran = false;
  double new_fwd = 0, new_bwd = 0, old_fwd = 0, old_bwd = 0, flops = 0, max_rel_diff = 0;
  size_t new_scratch = 0, old_scratch = 0;
};

int fail(const std::string& msg) {
  std::fprintf(stderr, "strata bench attention: %s\n", msg.c_str());
  return 1;
}

int run_bench_attention(const BenchAttentionOptions& o) {
  std::vector<int64_t> seqs;
  {
    std::stringstream ss(o.seqs);
    std::string tok;
    while (std::getline(ss, tok, ',')) {
      char* end = nullptr;
      const long v = std::strtol(tok.c_str(), &end, 10);
      if (tok.empty() || *end != '\0' || v < 1 || v > (1 << 20))
        return fail("--seqs: '" + tok + "' is not a sequence length in [1, 1048576]");
      seqs.push_back(v);
    }
  }
  if (o.heads < 1 || o.kv_heads < 1 || o.heads % o.kv_heads != 0)
    return fail("--heads must be a positive multiple of --kv-heads");
  if (o.head_dim < 1 || o.batch < 1 || o.reps < 1 || o.threads < 0)
    return fail("--head-dim, --batch and --reps must be >= 1, --threads >= 0");
  const int64_t H = o.heads, KV = o.kv_heads, hd = o.head_dim, B = o.batch;

  tbb::task_arena arena(o.threads > 0 ? o.threads : tbb::task_arena::automatic);
  std::vector<Row> rows;
  double ceiling = 0;
  int conc = 0;
  arena.execute([&] {
    conc = tbb::this_task_arena::max_concurrency();
    std::mt19937_64 rng(1);
    {  // ceiling: best of 5 single-threaded GEMMs 1024 x 1024 x hd
      const int64_t m = 1024;
      auto a = rnd(rng, m * hd), b = rnd(rng, m * hd);
      std::vector<float> c(m * m);
      double best = 1e30;
      for (int i = 0; i < 6; ++i) {
        const double t0 = now();
        gemm<float>(false, true, m, m, hd, a.data(), hd, b.data(), hd, c.data(), m, false);
        if (i > 0) best = std::min(best, now() - t0);
      }
      ceiling = 2.0 * m * m * hd / best * conc;
    }
    for (int64_t T : seqs) {
      Row row;
      row.T = T;
      const int64_t n = B * T;
      auto q = rnd(rng, n * H * hd), k = rnd(rng, n * KV * hd), v = rnd(rng, n * KV * hd),
           dO = rnd(rng, n * H * hd);
      std::vector<float> out(q.size()), lse(n * H), dq(q.size()), dk(k.size()), dv(v.size());
      std::vector<float> out_old(q.size()), dq_old(q.size()), dk_old(k.size()), dv_old(v.size());
      train::cpu::AttnScratch<float> scratch;
      scratch.init(conc, hd);
      row.new_scratch = scratch.bytes();
      row.old_scratch = static_cast<size_t>(conc) * 2 * T * T * sizeof(float);
      const uint64_t avail = available_memory();
      std::unique_ptr<Untiled> old;
      if (avail == 0 || row.old_scratch < avail / 2) old = std::make_unique<Untiled>(conc, T);
      row.old_ran = old != nullptr;
      std::vector<double> nf, nb, of, ob;
      for (int r = 0; r <= o.reps; ++r) {  // round 0 warms up (first touch, caches)
        double t0 = now();
        train::cpu::attention_forward(q.data(), k.data(), v.data(), out.data(), lse.data(), B, T, H, KV, hd,
                                      scratch);
        double t1 = now();
        train::cpu::attention_backward(q.data(), k.data(), v.data(), out.data(), lse.data(), dO.data(),
                                       dq.data(), dk.data(), dv.data(), B, T, H, KV, hd, scratch);
        double t2 = now();
        if (r > 0) nf.push_back(t1 - t0), nb.push_back(t2 - t1);
        if (!old) continue;
        t0 = now();
        old->forward(q.data(), k.data(), v.data(), out_old.data(), B, T, H, KV, hd);
        t1 = now();
        old->backward(q.data(), k.data(), v.data(), dO.data(), dq_old.data(), dk_old.data(), dv_old.data(), B,
                      T, H, KV, hd);
        t2 = now();
        if (r > 0) of.push_back(t1 - t0), ob.push_back(t2 - t1);
      }
      row.new_fwd = median(nf);
      row.new_bwd = median(nb);
      if (old) {
        row.old_fwd = median(of);
        row.old_bwd = median(ob);
        row.max_rel_diff = std::max({rel_diff(out, out_old), rel_diff(dq, dq_old), rel_diff(dk, dk_old),
                                     rel_diff(dv, dv_old)});
      }
      row.flops = 14.0 * B * H * hd * (static_cast<double>(T) * (T + 1) / 2);
      rows.push_back(row);
    }
  });

  if (o.json) {
    nlohmann::json j{{"heads", H}, {"kv_heads", KV}, {"head_dim", hd}, {"batch", B}, {"threads", conc},
                     {"reps", o.reps}, {"gemm_isa", train::cpu::gemm_isa()}, {"ceiling_flops", ceiling}};
    for (const Row& r : rows) {
      nlohmann::json x{{"seq", r.T},           {"new_fwd_s", r.new_fwd},          {"new_bwd_s", r.new_bwd},
                       {"new_scratch_bytes", r.new_scratch}, {"old_scratch_bytes", r.old_scratch},
                       {"useful_flops", r.flops}, {"old_ran", r.old_ran}};
      if (r.old_ran) {
        x["old_fwd_s"] = r.old_fwd;
        x["old_bwd_s"] = r.old_bwd;
        x["max_rel_diff"] = r.max_rel_diff;
      }
      j["rows"].push_back(x);
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("attention: B=%ld heads=%ld kv_heads=%ld head_dim=%ld, fp32, %d threads, gemm isa %s, "
              "medians of %d\nceiling: 1-thread GEMM 1024x1024x%ld x %d threads = %.1f GFLOP/s\n",
              long(B), long(H), long(KV), long(hd), conc, train::cpu::gemm_isa(), o.reps, long(hd), conc,
              ceiling / 1e9);
  for (const Row& r : rows) {
    const double tn = r.new_fwd + r.new_bwd;
    std::printf("T=%-6ld tiled   fwd %8.2f ms  bwd %8.2f ms  total %8.2f ms  %6.1f GFLOP/s (%.2f of ceiling)  "
                "scratch %s\n",
                long(r.T), r.new_fwd * 1e3, r.new_bwd * 1e3, tn * 1e3, r.flops / tn / 1e9, r.flops / tn / ceiling,
                format_bytes(r.new_scratch).c_str());
    if (!r.old_ran) {
      std::printf("         untiled skipped: its scratch (%s) exceeds half the available memory\n",
                  format_bytes(r.old_scratch).c_str());
      continue;
    }
    const double to = r.old_fwd + r.old_bwd;
    std::printf("         untiled fwd %8.2f ms  bwd %8.2f ms  total %8.2f ms  %6.1f GFLOP/s (%.2f of ceiling)  "
                "scratch %s\n",
                r.old_fwd * 1e3, r.old_bwd * 1e3, to * 1e3, r.flops / to / 1e9, r.flops / to / ceiling,
                format_bytes(r.old_scratch).c_str());
    std::printf("         untiled / tiled time %.2f; max relative difference %.1e\n", to / tn, r.max_rel_diff);
  }
  return 0;
}

}  // namespace

void register_bench_attention(CLI::App& bench) {
  auto o = std::make_shared<BenchAttentionOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "attention", "The CPU trainer's tiled attention vs the untiled kernel it replaced, and a GEMM ceiling");
  cmd->add_option("--seqs", o->seqs, "Sequence lengths, comma-separated")->capture_default_str();
  cmd->add_option("--heads", o->heads, "Query heads")->capture_default_str();
  cmd->add_option("--kv-heads", o->kv_heads, "Key/value heads")->capture_default_str();
  cmd->add_option("--head-dim", o->head_dim, "Head dimension")->capture_default_str();
  cmd->add_option("--batch", o->batch, "Sequences")->capture_default_str();
  cmd->add_option("--reps", o->reps, "Timed rounds (medians)")->capture_default_str();
  cmd->add_option("--threads", o->threads, "CPU threads (0: all)")->capture_default_str();
  cmd->add_flag("--json", o->json, "One JSON object");
  cmd->callback([o] { set_exit_code(run_bench_attention(*o)); });
}

}  // namespace strata::tools
