#include "train/cpu_kernels.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "model/rope.h"

namespace strata::train::cpu {
namespace {

// f(begin, end) over fixed blocks of `block` items. simple_partitioner with
// grain 1 runs exactly one block per task, so the split never depends on the
// number of threads.
template <typename F>
void for_blocks(int64_t n, int64_t block, F&& f) {
  const int64_t nb = (n + block - 1) / block;
  if (nb <= 0) return;
  if (nb == 1) {
    f(int64_t{0}, n);
    return;
  }
  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, nb, 1),
      [&](const tbb::blocked_range<int64_t>& r) {
        for (int64_t i = r.begin(); i != r.end(); ++i) f(i * block, std::min(n, (i + 1) * block));
      },
      tbb::simple_partitioner());
}

template <typename F>
void for_each_index(int64_t n, F&& f) {
  for_blocks(n, 1, [&](int64_t b, int64_t) { f(b); });
}

// Elementwise loops: big enough blocks to amortise a task.
constexpr int64_t kElemBlock = 16384;

template <typename S>
S sigmoid(S x) {
  return S(1) / (S(1) + std::exp(-x));
}

}  // namespace

// ---------------------------------------------------------------- linear

template <typename S>
void linear_forward(const S* x, const S* w, S* y, int64_t n, int64_t in, int64_t out) {
  for_blocks(n, kRowBlock, [&](int64_t b, int64_t e) {
    gemm<S>(false, true, e - b, out, in, x + b * in, in, w, in, y + b * out, out, false);
  });
}

template <typename S>
void linear_backward_input(const S* dy, const S* w, S* dx, int64_t n, int64_t in, int64_t out,
                           bool accumulate) {
  for_blocks(n, kRowBlock, [&](int64_t b, int64_t e) {
    gemm<S>(false, false, e - b, in, out, dy + b * out, out, w, in, dx + b * in, in, accumulate);
  });
}

template <typename S>
void linear_backward_weight(const S* dy, const S* x, S* dw, int64_t n, int64_t in, int64_t out) {
  // Split over output features: each block's reduction over all n tokens
  // happens inside one GEMM of a fixed shape.
  for_blocks(out, kRowBlock, [&](int64_t b, int64_t e) {
    gemm<S>(true, false, e - b, in, n, dy + b, out, x, in, dw + b * in, in, false);
  });
}

// ---------------------------------------------------------------- RMSNorm

template <typename S>
void rmsnorm_forward(const S* x, const S* w, S* y, S* rstd, int64_t n, int64_t d, double eps) {
  const S seps = static_cast<S>(eps);
  for_blocks(n, kRowBlock, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const S* xr = x + r * d;
      S* yr = y + r * d;
      S ss = 0;
      for (int64_t j = 0; j < d; ++j) ss += xr[j] * xr[j];
      const S rs = S(1) / std::sqrt(ss / static_cast<S>(d) + seps);
      rstd[r] = rs;
      // HF: weight * (x * rsqrt(var + eps)): normalise first, weight last.
      for (int64_t j = 0; j < d; ++j) yr[j] = w[j] * (xr[j] * rs);
    }
  });
}

template <typename S>
void rmsnorm_backward(const S* x, const S* w, const S* rstd, const S* dy, S* dx, S* dw, int64_t n,
                      int64_t d, bool accumulate_dx) {
  const S inv_d = S(1) / static_cast<S>(d);
  for_blocks(n, kRowBlock, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const S* xr = x + r * d;
      const S* dyr = dy + r * d;
      S* dxr = dx + r * d;
      const S rs = rstd[r];
      // xhat = x * rstd; g = dy * w; dx = rstd * (g - xhat * mean(g * xhat)).
      S dot = 0;
      for (int64_t j = 0; j < d; ++j) dot += dyr[j] * w[j] * (xr[j] * rs);
      const S m = dot * inv_d;
      for (int64_t j = 0; j < d; ++j) {
        const S v = rs * (dyr[j] * w[j] - (xr[j] * rs) * m);
        dxr[j] = accumulate_dx ? dxr[j] + v : v;
      }
    }
  });
  // dw[j] = sum_r dy[r, j] * xhat[r, j], rows in order, split over columns.
  if (!dw) return;  // a frozen weight
  for_blocks(d, kRowBlock, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) dw[j] = 0;
    for (int64_t r = 0; r < n; ++r) {
      const S* xr = x + r * d;
      const S* dyr = dy + r * d;
      const S rs = rstd[r];
      for (int64_t j = b; j < e; ++j) dw[j] += dyr[j] * (xr[j] * rs);
    }
  });
}

// ---------------------------------------------------------------- biases

template <typename S>
void add_bias(S* y, const S* b, int64_t n, int64_t cols) {
  for_blocks(n, kRowBlock, [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r)
      for (int64_t j = 0; j < cols; ++j) y[r * cols + j] += b[j];
  });
}

template <typename S>
void bias_backward(const S* dy, S* db, int64_t n, int64_t cols) {
  for_blocks(cols, kRowBlock, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) db[j] = 0;
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = b; j < e; ++j) db[j] += dy[r * cols + j];
  });
}

// ---------------------------------------------------------------- RoPE

template <typename S>
void RopeTable<S>::init(int64_t max_seq_, int64_t head_dim, double theta, const std::vector<float>& inv_freq,
                        float scaling) {
  max_seq = max_seq_;
  half = head_dim / 2;
  cos.assign(static_cast<size_t>(max_seq * half), S(0));
  sin.assign(static_cast<size_t>(max_seq * half), S(0));
  // HF: the angles are pos * inv_freq in fp32 (inv_freq a float tensor, from
  // model/rope.h here); cos/sin times the attention scaling. The double build
  // uses the same rounded frequencies so both builds compute the same function.
  std::vector<float> freqs = inv_freq;
  if (freqs.empty()) {
    model::RopeSettings r;
    r.theta = theta;
    freqs = model::rope_frequencies(r, head_dim).inv_freq;
  }
  for (int64_t i = 0; i < half; ++i) {
    for (int64_t t = 0; t < max_seq; ++t) {
      const float angle = static_cast<float>(t) * freqs[static_cast<size_t>(i)];
      S c = static_cast<S>(std::cos(static_cast<double>(angle)));
      S s = static_cast<S>(std::sin(static_cast<double>(angle)));
      if (scaling != 1.0f) c = c * static_cast<S>(scaling), s = s * static_cast<S>(scaling);
      cos[t * half + i] = c;
      sin[t * half + i] = s;
    }
  }
}

template <typename S>
void rope_apply(S* x, int64_t n, int64_t T, int64_t heads, int64_t head_dim,
                const RopeTable<S>& table, bool inverse) {
  const int64_t half = head_dim / 2;
  const int64_t width = heads * head_dim;
  for_blocks(n, kRowBlock, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t pos = r % T;
      const S* c = table.cos.data() + pos * half;
      const S* s = table.sin.data() + pos * half;
      for (int64_t h = 0; h < heads; ++h) {
        S* v = x + r * width + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const S a = v[i], bb = v[i + half];
          if (!inverse) {
            // q * cos + rotate_half(q) * sin, rotate_half(q) = (-q2, q1).
            v[i] = a * c[i] - bb * s[i];
            v[i + half] = bb * c[i] + a * s[i];
          } else {
            v[i] = a * c[i] + bb * s[i];
            v[i + half] = bb * c[i] - a * s[i];
          }
        }
      }
    }
  });
}

// ---------------------------------------------------------------- attention

template <typename S>
int64_t AttnScratch<S>::values_per_slot(int64_t head_dim) {
  constexpr int64_t tile = kAttnQBlock * kAttnKBlock;
  // forward: scores/probabilities, the output accumulator, running max and sum;
  // backward: P and dS, and each query row's L and D.
  const int64_t fwd = tile + kAttnQBlock * head_dim + 2 * kAttnQBlock;
  const int64_t bwd = 2 * tile + 2 * kAttnQBlock;
  return std::max(fwd, bwd);
}

template <typename S>
void AttnScratch<S>::init(int slots_, int64_t head_dim) {
  slots = slots_;
  per_slot = values_per_slot(head_dim);
  buf.assign(static_cast<size_t>(slots) * static_cast<size_t>(per_slot), S(0));
}

template <typename S>
S* AttnScratch<S>::slot() {
  int idx = tbb::this_task_arena::current_thread_index();
  // Outside any arena (cannot happen inside for_blocks) the index is
  // "not initialized"; clamp so a misuse stays memory-safe.
  if (idx < 0 || idx >= slots) idx = 0;
  return buf.data() + static_cast<size_t>(idx) * static_cast<size_t>(per_slot);
}

namespace {

// Keys a query row sees in the key block starting at j0 of nk keys: query
// i0 + r sees keys <= i0 + r (0 for a block wholly in its future).
inline int64_t causal_keys(int64_t i0, int64_t r, int64_t j0, int64_t nk) {
  return std::clamp<int64_t>(i0 + r - j0 + 1, 0, nk);
}

// D and L of the nq query rows from i0 of head h: D_r = dO_r . O_r (the
// row's sum of P * dP), L_r from the forward.
template <typename S>
void attn_rows_dl(const S* out, const S* dout, const S* lse, int64_t b, int64_t T, int64_t h,
                  int64_t heads, int64_t hd, int64_t i0, int64_t nq, S* d_rows, S* l_rows) {
  const int64_t qd = heads * hd;
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t row = b * T + i0 + r;
    const S* o = out + row * qd + h * hd;
    const S* g = dout + row * qd + h * hd;
    S dot = 0;
    for (int64_t c = 0; c < hd; ++c) dot += g[c] * o[c];
    d_rows[r] = dot;
    l_rows[r] = lse[row * heads + h];
  }
}

// A slot's layout in the backward: the P and dS tiles, then the query rows' D and L.
template <typename S>
struct AttnBwdSlot {
  S *p, *ds, *d_rows, *l_rows;
  explicit AttnBwdSlot(S* slot)
      : p(slot),
        ds(p + kAttnQBlock * kAttnKBlock),
        d_rows(ds + kAttnQBlock * kAttnKBlock),
        l_rows(d_rows + kAttnQBlock) {}
};

// One (query block i, key block j) tile of the backward: t.p = P = exp(scale
// Q_i K_j^T - L) and t.ds = dS = P (dO_i V_j^T - D) scale [nq, nk], both 0
// where causality masks; t.d_rows and t.l_rows hold the block's D and L.
// Both backward passes run this on the same inputs, so they see the same bits.
template <typename S>
void attn_tile_grads(const S* qi, const S* doi, int64_t qd, const S* kj, const S* vj, int64_t kvd,
                     int64_t nq, int64_t nk, int64_t hd, int64_t i0, int64_t j0, S scale,
                     const AttnBwdSlot<S>& t) {
  gemm<S>(false, true, nq, nk, hd, qi, qd, kj, kvd, t.p, nk, false);
  gemm<S>(false, true, nq, nk, hd, doi, qd, vj, kvd, t.ds, nk, false);
  for (int64_t r = 0; r < nq; ++r) {
    S* pr = t.p + r * nk;
    S* dr = t.ds + r * nk;
    const int64_t valid = causal_keys(i0, r, j0, nk);
    for (int64_t c = 0; c < valid; ++c) {
      const S p = std::exp(pr[c] * scale - t.l_rows[r]);
      pr[c] = p;
      dr[c] = p * (dr[c] - t.d_rows[r]) * scale;
    }
    for (int64_t c = valid; c < nk; ++c) pr[c] = dr[c] = 0;
  }
}

}  // namespace

template <typename S>
void attention_forward(const S* q, const S* k, const S* v, S* out, S* lse, int64_t B, int64_t T,
                       int64_t heads, int64_t kv_heads, int64_t hd, AttnScratch<S>& scratch) {
  const int64_t qd = heads * hd, kvd = kv_heads * hd, group = heads / kv_heads;
  const int64_t nqb = (T + kAttnQBlock - 1) / kAttnQBlock;
  const S scale = S(1) / std::sqrt(static_cast<S>(hd));
  constexpr S kNegInf = -std::numeric_limits<S>::infinity();
  // One task per (batch, head, query block): it alone writes those rows of
  // out and lse.
  for_each_index(B * heads * nqb, [&](int64_t task) {
    const int64_t b = task / (heads * nqb), h = task / nqb % heads, i0 = task % nqb * kAttnQBlock;
    const int64_t nq = std::min(kAttnQBlock, T - i0), kvh = h / group;
    S* s = scratch.slot();
    S* acc = s + kAttnQBlock * kAttnKBlock;  // [nq, hd], unnormalised output
    S* m = acc + kAttnQBlock * hd;           // running max of the scaled scores
    S* l = m + kAttnQBlock;                  // running sum of exp(score - m)
    std::fill(m, m + nq, kNegInf);
    std::fill(l, l + nq, S(0));
    const S* qi = q + (b * T + i0) * qd + h * hd;
    const S* kh = k + b * T * kvd + kvh * hd;
    const S* vh = v + b * T * kvd + kvh * hd;
    // Key blocks in order up to the diagonal; the first one (key 0) is seen by
    // every row, so m is finite from then on.
    for (int64_t j0 = 0; j0 < i0 + nq; j0 += kAttnKBlock) {
      const int64_t nk = std::min(kAttnKBlock, i0 + nq - j0);
      gemm<S>(false, true, nq, nk, hd, qi, qd, kh + j0 * kvd, kvd, s, nk, false);
      for (int64_t r = 0; r < nq; ++r) {
        S* sr = s + r * nk;
        const int64_t valid = causal_keys(i0, r, j0, nk);
        S mx = m[r];
        for (int64_t c = 0; c < valid; ++c) {
          sr[c] *= scale;
          mx = std::max(mx, sr[c]);
        }
        S sum = 0;
        for (int64_t c = 0; c < valid; ++c) {
          sr[c] = std::exp(sr[c] - mx);
          sum += sr[c];
        }
        for (int64_t c = valid; c < nk; ++c) sr[c] = 0;
        if (j0 > 0 && mx != m[r]) {  // rescale what the earlier blocks summed
          const S corr = std::exp(m[r] - mx);
          l[r] *= corr;
          for (int64_t c = 0; c < hd; ++c) acc[r * hd + c] *= corr;
        }
        l[r] += sum;
        m[r] = mx;
      }
      gemm<S>(false, false, nq, hd, nk, s, nk, vh + j0 * kvd, kvd, acc, hd, j0 > 0);
    }
    for (int64_t r = 0; r < nq; ++r) {
      const int64_t row = b * T + i0 + r;
      const S inv = S(1) / l[r];
      S* o = out + row * qd + h * hd;
      for (int64_t c = 0; c < hd; ++c) o[c] = acc[r * hd + c] * inv;
      lse[row * heads + h] = m[r] + std::log(l[r]);
    }
  });
}

template <typename S>
void attention_backward(const S* q, const S* k, const S* v, const S* out, const S* lse,
                        const S* dout, S* dq, S* dk, S* dv, int64_t B, int64_t T, int64_t heads,
                        int64_t kv_heads, int64_t hd, AttnScratch<S>& scratch) {
  const int64_t qd = heads * hd, kvd = kv_heads * hd, group = heads / kv_heads;
  const int64_t nqb = (T + kAttnQBlock - 1) / kAttnQBlock, nkb = (T + kAttnKBlock - 1) / kAttnKBlock;
  const S scale = S(1) / std::sqrt(static_cast<S>(hd));
  // Pass 1, dK and dV: one task per (batch, kv head, key block) owns those
  // rows and sums into them over the group's query heads, then the query
  // blocks, in that order.
  for_each_index(B * kv_heads * nkb, [&](int64_t task) {
    const int64_t b = task / (kv_heads * nkb), kvh = task / nkb % kv_heads,
                  j0 = task % nkb * kAttnKBlock;
    const int64_t nk = std::min(kAttnKBlock, T - j0);
    const AttnBwdSlot<S> t(scratch.slot());
    const S* kj = k + (b * T + j0) * kvd + kvh * hd;
    const S* vj = v + (b * T + j0) * kvd + kvh * hd;
    S* dkj = dk + (b * T + j0) * kvd + kvh * hd;
    S* dvj = dv + (b * T + j0) * kvd + kvh * hd;
    bool first = true;
    for (int64_t gi = 0; gi < group; ++gi) {
      const int64_t h = kvh * group + gi;
      // From the query block holding row j0: earlier rows do not see these keys.
      for (int64_t i0 = j0 / kAttnQBlock * kAttnQBlock; i0 < T; i0 += kAttnQBlock) {
        const int64_t nq = std::min(kAttnQBlock, T - i0);
        const S* qi = q + (b * T + i0) * qd + h * hd;
        const S* doi = dout + (b * T + i0) * qd + h * hd;
        attn_rows_dl(out, dout, lse, b, T, h, heads, hd, i0, nq, t.d_rows, t.l_rows);
        attn_tile_grads(qi, doi, qd, kj, vj, kvd, nq, nk, hd, i0, j0, scale, t);
        gemm<S>(true, false, nk, hd, nq, t.p, nk, doi, qd, dvj, kvd, !first);   // dV += P^T dO
        gemm<S>(true, false, nk, hd, nq, t.ds, nk, qi, qd, dkj, kvd, !first);  // dK += dS^T Q
        first = false;
      }
    }
  });
  // Pass 2, dQ: one task per (batch, head, query block) owns those rows and
  // sums over the key blocks in order. Recomputing P and dS here (instead of
  // adding into dQ from pass 1) keeps every output written by one task.
  for_each_index(B * heads * nqb, [&](int64_t task) {
    const int64_t b = task / (heads * nqb), h = task / nqb % heads, i0 = task % nqb * kAttnQBlock;
    const int64_t nq = std::min(kAttnQBlock, T - i0), kvh = h / group;
    const AttnBwdSlot<S> t(scratch.slot());
    const S* qi = q + (b * T + i0) * qd + h * hd;
    const S* doi = dout + (b * T + i0) * qd + h * hd;
    const S* kh = k + b * T * kvd + kvh * hd;
    const S* vh = v + b * T * kvd + kvh * hd;
    S* dqi = dq + (b * T + i0) * qd + h * hd;
    attn_rows_dl(out, dout, lse, b, T, h, heads, hd, i0, nq, t.d_rows, t.l_rows);
    for (int64_t j0 = 0; j0 < i0 + nq; j0 += kAttnKBlock) {
      const int64_t nk = std::min(kAttnKBlock, T - j0);
      attn_tile_grads(qi, doi, qd, kh + j0 * kvd, vh + j0 * kvd, kvd, nq, nk, hd, i0, j0, scale, t);
      gemm<S>(false, false, nq, hd, nk, t.ds, nk, kh + j0 * kvd, kvd, dqi, qd, j0 > 0);  // dQ += dS K
    }
  });
}

// ---------------------------------------------------------------- SwiGLU

template <typename S>
void swiglu_forward(const S* g, const S* u, S* a, int64_t count) {
  for_blocks(count, kElemBlock, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) a[i] = g[i] * sigmoid(g[i]) * u[i];
  });
}

template <typename S>
void swiglu_backward(const S* g, const S* u, const S* da, S* dg, S* du, int64_t count) {
  for_blocks(count, kElemBlock, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const S gi = g[i], ui = u[i], dai = da[i];
      const S sg = sigmoid(gi);
      const S silu = gi * sg;
      dg[i] = dai * ui * (sg * (S(1) + gi * (S(1) - sg)));
      du[i] = dai * silu;
    }
  });
}

// ---------------------------------------------------------------- embedding

template <typename S>
void embed_forward(const S* table, const int32_t* tokens, S* out, int64_t n, int64_t d) {
  for_blocks(n, kRowBlock, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      std::memcpy(out + r * d, table + static_cast<int64_t>(tokens[r]) * d, sizeof(S) * d);
  });
}

template <typename S>
void embed_backward(const int32_t* tokens, const S* dx, S* grad, int64_t n, int64_t d,
                    int64_t vocab, bool accumulate) {
  if (!accumulate) {
    for_blocks(vocab, kRowBlock, [&](int64_t b, int64_t e) {
      std::fill(grad + b * d, grad + e * d, S(0));
    });
  }
  // Column blocks: a repeated token adds its rows in token order.
  for_blocks(d, kRowBlock, [&](int64_t b, int64_t e) {
    for (int64_t r = 0; r < n; ++r) {
      S* gr = grad + static_cast<int64_t>(tokens[r]) * d;
      const S* xr = dx + r * d;
      for (int64_t j = b; j < e; ++j) gr[j] += xr[j];
    }
  });
}

// ---------------------------------------------------------------- cross-entropy

template <typename S>
void cross_entropy_rows(S* logits, const int32_t* targets, const uint8_t* mask, int64_t n,
                        int64_t vocab, bool write_grad, S grad_scale, double* row_loss) {
  for_blocks(n, kRowBlock / 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      S* lr = logits + r * vocab;
      if (!ce_counts(targets, mask, r)) {
        row_loss[r] = 0;
        if (write_grad) std::fill(lr, lr + vocab, S(0));
        continue;
      }
      S mx = -std::numeric_limits<S>::infinity();
      for (int64_t j = 0; j < vocab; ++j) mx = std::max(mx, lr[j]);
      double sum = 0;
      for (int64_t j = 0; j < vocab; ++j) sum += static_cast<double>(std::exp(lr[j] - mx));
      const double lse = static_cast<double>(mx) + std::log(sum);
      const int64_t t = targets[r];
      row_loss[r] = lse - static_cast<double>(lr[t]);
      if (write_grad) {
        const S slse = static_cast<S>(lse);
        for (int64_t j = 0; j < vocab; ++j) lr[j] = grad_scale * std::exp(lr[j] - slse);
        lr[t] -= grad_scale;
      }
    }
  });
}

// ---------------------------------------------------------------- layer

namespace {
template <typename S>
void resize(std::vector<S>& v, int64_t n) {
  v.assign(static_cast<size_t>(n), S(0));
}
template <typename S>
void add_into(S* y, const S* a, int64_t count) {
  for_blocks(count, kElemBlock, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) y[i] = a[i] + y[i];
  });
}
template <typename S>
void copy(S* dst, const S* src, int64_t count) {
  if (dst == src) return;
  for_blocks(count, kElemBlock, [&](int64_t b, int64_t e) {
    std::memcpy(dst + b, src + b, sizeof(S) * (e - b));
  });
}
}  // namespace

template <typename S>
LayerMath<S>::LayerMath(const LlamaDims& dims, int64_t max_tokens, int64_t max_seq,
                        int attn_slots)
    : d_(dims), max_tokens_(max_tokens) {
  const int64_t n = max_tokens, D = dims.dim, qd = dims.q_dim(), kvd = dims.kv_dim(),
                F = dims.ffn_dim;
  rope_.init(max_seq, dims.head_dim, dims.rope_theta, dims.rope_inv_freq, dims.rope_attention_scaling);
  scratch_.init(attn_slots, dims.head_dim);
  resize(rstd1_, n);
  resize(n1_, n * D);
  resize(q_, n * qd);
  resize(k_, n * kvd);
  resize(v_, n * kvd);
  resize(att_, n * qd);
  resize(lse_, n * dims.heads);
  resize(h_, n * D);
  resize(rstd2_, n);
  resize(n2_, n * D);
  resize(g_, n * F);
  resize(u_, n * F);
  resize(a_, n * F);
  resize(dh_, n * D);
  resize(dbig_, n * F);
  resize(dbig2_, n * F);
  resize(dq_, n * qd);
  resize(dk_, n * kvd);
  resize(dv_, n * kvd);
  resize(datt_, n * qd);
  resize(dn_, n * D);
  if (dims.qk_norm) {
    resize(q_raw_, n * qd);
    resize(k_raw_, n * kvd);
    resize(rstd_q_, n * dims.heads);
    resize(rstd_k_, n * dims.kv_heads);
    resize(dq_raw_, n * qd);
    resize(dk_raw_, n * kvd);
  }
  if (dims.lora_targets) {
    const int64_t widest = std::max({D, qd, kvd, F});
    resize(lora_xa_, n * dims.lora_rank);
    resize(lora_dxa_, n * dims.lora_rank);
    resize(lora_out_, n * widest);
    if (dims.lora_dropout > 0) resize(lora_xd_, n * widest);
  }
}

// LoRA dropout: a counter-based draw per (seed, target, element), so the
// backward's recomputation and any thread count give the same mask.
inline bool lora_keep(uint64_t seed, int target, int64_t i, float p) {
  uint64_t z = seed ^ (static_cast<uint64_t>(target + 1) * 0x9E3779B97F4A7C15ull) ^
               (static_cast<uint64_t>(i) * 0xD1B54A32D192ED03ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * 0x1p-24f >= p;
}

// The adapters' input: x, or its dropout (kept elements scaled by 1/(1-p),
// as torch.nn.Dropout) in lora_xd_.
template <typename S>
const S* LayerMath<S>::lora_input(int ti, const S* x, int64_t n, int64_t in, const LoraDropout& dr) {
  if (!dr.on || !(d_.lora_dropout > 0)) return x;
  S* xd = lora_xd_.data();
  const float p = d_.lora_dropout;
  const S keep = S(1) / (S(1) - static_cast<S>(p));
  const int64_t first = static_cast<int64_t>(dr.row0) * in;  // the element index in the whole run
  for_blocks(n, kRowBlock, [&](int64_t b, int64_t e) {
    for (int64_t i = b * in; i < e * in; ++i)
      xd[i] = lora_keep(dr.seed, ti, first + i, p) ? x[i] * keep : S(0);
  });
  return xd;
}

// y[n, out] += lora_B(lora_A(dropout(x))) * scaling (PEFT's order: the
// adapter's product first, then the scaling, then the sum).
template <typename S>
void LayerMath<S>::lora_forward(const LayerParams<S>& p, LayerTensor proj, const S* x, S* y, int64_t n,
                                int64_t in, int64_t out, const LoraDropout& dr) {
  if (!d_.has(lora_a_of(proj))) return;
  const int ti = lora_target_index(proj);
  const int64_t r = d_.lora_rank;
  const S* xin = lora_input(ti, x, n, in, dr);
  linear_forward(xin, p[lora_a_of(proj)], lora_xa_.data(), n, in, r);
  S* t = lora_out_.data();
  linear_forward(lora_xa_.data(), p[lora_b_of(proj)], t, n, r, out);
  const S sc = static_cast<S>(d_.lora_scaling);
  for_blocks(n, kRowBlock, [&](int64_t b, int64_t e) {
    for (int64_t i = b * out; i < e * out; ++i) y[i] += t[i] * sc;
  });
}

// The adapters' backward for the projection's output gradient dy[n, out]:
// their gradients (overwritten; null: frozen) and dx[n, in] += the input
// gradient through them. Recomputes the adapter's forward (xa = dropout(x) A^T).
template <typename S>
void LayerMath<S>::lora_backward(const LayerParams<S>& p, LayerTensor proj, const S* x, const S* dy, S* dx,
                                 const LayerParamGrads<S>& g, int64_t n, int64_t in, int64_t out,
                                 const LoraDropout& dr) {
  if (!d_.has(lora_a_of(proj))) return;
  const LayerTensor ta = lora_a_of(proj), tb = lora_b_of(proj);
  const int ti = lora_target_index(proj);
  const int64_t r = d_.lora_rank;
  const S* xin = lora_input(ti, x, n, in, dr);
  S* xa = lora_xa_.data();
  linear_forward(xin, p[ta], xa, n, in, r);
  S* dys = lora_out_.data();  // d(lora_B(xa)) = dy * scaling
  const S sc = static_cast<S>(d_.lora_scaling);
  for_blocks(n, kRowBlock, [&](int64_t b, int64_t e) {
    for (int64_t i = b * out; i < e * out; ++i) dys[i] = dy[i] * sc;
  });
  if (g[tb]) linear_backward_weight(dys, xa, g[tb], n, r, out);
  S* dxa = lora_dxa_.data();
  linear_backward_input(dys, p[tb], dxa, n, r, out, false);
  if (g[ta]) linear_backward_weight(dxa, xin, g[ta], n, in, r);
  if (xin == x) {
    linear_backward_input(dxa, p[ta], dx, n, in, r, true);
    return;
  }
  // Through the dropout: the same mask and scale.
  S* t = lora_xd_.data();
  linear_backward_input(dxa, p[ta], t, n, in, r, false);
  const float pd = d_.lora_dropout;
  const S keep = S(1) / (S(1) - static_cast<S>(pd));
  const int64_t first = static_cast<int64_t>(dr.row0) * in;
  for_blocks(n, kRowBlock, [&](int64_t b, int64_t e) {
    for (int64_t i = b * in; i < e * in; ++i)
      if (lora_keep(dr.seed, ti, first + i, pd)) dx[i] += t[i] * keep;
  });
}

template <typename S>
void LayerMath<S>::run_forward(const LayerParams<S>& p, const S* x, int64_t B, int64_t T, const LoraDropout& dr) {
  const int64_t n = B * T, D = d_.dim, qd = d_.q_dim(), kvd = d_.kv_dim(), F = d_.ffn_dim;
  rmsnorm_forward(x, p[kInputNorm], n1_.data(), rstd1_.data(), n, D, d_.rms_eps);
  linear_forward(n1_.data(), p[kQProj], q_.data(), n, D, qd);
  linear_forward(n1_.data(), p[kKProj], k_.data(), n, D, kvd);
  linear_forward(n1_.data(), p[kVProj], v_.data(), n, D, kvd);
  if (d_.qkv_bias) {  // Qwen2: q/k/v = n1 W^T + b
    add_bias(q_.data(), p[kQBias], n, qd);
    add_bias(k_.data(), p[kKBias], n, kvd);
    add_bias(v_.data(), p[kVBias], n, kvd);
  }
  lora_forward(p, kQProj, n1_.data(), q_.data(), n, D, qd, dr);
  lora_forward(p, kKProj, n1_.data(), k_.data(), n, D, kvd, dr);
  lora_forward(p, kVProj, n1_.data(), v_.data(), n, D, kvd, dr);
  if (d_.qk_norm) {  // Qwen3: RMSNorm over each head's head_dim, before RoPE
    copy(q_raw_.data(), q_.data(), n * qd);
    copy(k_raw_.data(), k_.data(), n * kvd);
    rmsnorm_forward(q_raw_.data(), p[kQNorm], q_.data(), rstd_q_.data(), n * d_.heads, d_.head_dim, d_.rms_eps);
    rmsnorm_forward(k_raw_.data(), p[kKNorm], k_.data(), rstd_k_.data(), n * d_.kv_heads, d_.head_dim, d_.rms_eps);
  }
  rope_apply(q_.data(), n, T, d_.heads, d_.head_dim, rope_, false);
  rope_apply(k_.data(), n, T, d_.kv_heads, d_.head_dim, rope_, false);
  attention_forward(q_.data(), k_.data(), v_.data(), att_.data(), lse_.data(), B, T, d_.heads,
                    d_.kv_heads, d_.head_dim, scratch_);
  linear_forward(att_.data(), p[kOProj], h_.data(), n, qd, D);
  lora_forward(p, kOProj, att_.data(), h_.data(), n, qd, D, dr);
  add_into(h_.data(), x, n * D);  // h = x + attn
  rmsnorm_forward(h_.data(), p[kPostNorm], n2_.data(), rstd2_.data(), n, D,
                  d_.rms_eps);
  linear_forward(n2_.data(), p[kGateProj], g_.data(), n, D, F);
  lora_forward(p, kGateProj, n2_.data(), g_.data(), n, D, F, dr);
  linear_forward(n2_.data(), p[kUpProj], u_.data(), n, D, F);
  lora_forward(p, kUpProj, n2_.data(), u_.data(), n, D, F, dr);
  swiglu_forward(g_.data(), u_.data(), a_.data(), n * F);
}

template <typename S>
void LayerMath<S>::forward(const LayerParams<S>& p, const S* x, S* y, int64_t B, int64_t T, const LoraDropout& dr) {
  run_forward(p, x, B, T, dr);
  const int64_t n = B * T;
  // x is not read again, so y may be x.
  linear_forward(a_.data(), p[kDownProj], y, n, d_.ffn_dim, d_.dim);
  lora_forward(p, kDownProj, a_.data(), y, n, d_.ffn_dim, d_.dim, dr);
  add_into(y, h_.data(), n * d_.dim);  // y = h + mlp
}

// A frozen tensor (null gradient) gets no gradient computed; the input
// gradient flows through it all the same.
template <typename S>
void LayerMath<S>::backward(const LayerParams<S>& p, const S* x, const S* dy, S* dx,
                            const LayerParamGrads<S>& g, int64_t B, int64_t T, const LoraDropout& dr) {
  run_forward(p, x, B, T, dr);
  const int64_t n = B * T, D = d_.dim, qd = d_.q_dim(), kvd = d_.kv_dim(), F = d_.ffn_dim;
  auto weight_grad = [&](LayerTensor t, const S* dyt, const S* xt, int64_t in, int64_t out) {
    if (g[t]) linear_backward_weight(dyt, xt, g[t], n, in, out);
  };
  S* dh = dh_.data();
  copy(dh, dy, n * D);  // dy may be dx: read it once, here
  // MLP: y = h + down(a), a = silu(gate(n2)) * up(n2).
  S* da = dbig_.data();
  S* dgate = dbig2_.data();
  linear_backward_input(dh, p[kDownProj], da, n, F, D, false);
  weight_grad(kDownProj, dh, a_.data(), F, D);
  lora_backward(p, kDownProj, a_.data(), dh, da, g, n, F, D, dr);
  swiglu_backward(g_.data(), u_.data(), da, dgate, /*du=*/da, n * F);
  S* dn = dn_.data();
  linear_backward_input(dgate, p[kGateProj], dn, n, D, F, false);
  linear_backward_input(da, p[kUpProj], dn, n, D, F, true);
  weight_grad(kGateProj, dgate, n2_.data(), D, F);
  weight_grad(kUpProj, da, n2_.data(), D, F);
  lora_backward(p, kGateProj, n2_.data(), dgate, dn, g, n, D, F, dr);
  lora_backward(p, kUpProj, n2_.data(), da, dn, g, n, D, F, dr);
  rmsnorm_backward(h_.data(), p[kPostNorm], rstd2_.data(), dn, dh,
                   g[kPostNorm], n, D, /*accumulate_dx=*/true);
  // Attention: h = x + o_proj(att).
  linear_backward_input(dh, p[kOProj], datt_.data(), n, qd, D, false);
  weight_grad(kOProj, dh, att_.data(), qd, D);
  lora_backward(p, kOProj, att_.data(), dh, datt_.data(), g, n, qd, D, dr);
  attention_backward(q_.data(), k_.data(), v_.data(), att_.data(), lse_.data(), datt_.data(),
                     dq_.data(), dk_.data(), dv_.data(), B, T, d_.heads, d_.kv_heads, d_.head_dim,
                     scratch_);
  rope_apply(dq_.data(), n, T, d_.heads, d_.head_dim, rope_, true);
  rope_apply(dk_.data(), n, T, d_.kv_heads, d_.head_dim, rope_, true);
  if (d_.qk_norm) {  // through the per-head norms to the projections' outputs
    rmsnorm_backward(q_raw_.data(), p[kQNorm], rstd_q_.data(), dq_.data(), dq_raw_.data(), g[kQNorm],
                     n * d_.heads, d_.head_dim, false);
    rmsnorm_backward(k_raw_.data(), p[kKNorm], rstd_k_.data(), dk_.data(), dk_raw_.data(), g[kKNorm],
                     n * d_.kv_heads, d_.head_dim, false);
    dq_.swap(dq_raw_);
    dk_.swap(dk_raw_);
  }
  if (d_.qkv_bias) {
    if (g[kQBias]) bias_backward(dq_.data(), g[kQBias], n, qd);
    if (g[kKBias]) bias_backward(dk_.data(), g[kKBias], n, kvd);
    if (g[kVBias]) bias_backward(dv_.data(), g[kVBias], n, kvd);
  }
  linear_backward_input(dq_.data(), p[kQProj], dn, n, D, qd, false);
  linear_backward_input(dk_.data(), p[kKProj], dn, n, D, kvd, true);
  linear_backward_input(dv_.data(), p[kVProj], dn, n, D, kvd, true);
  weight_grad(kQProj, dq_.data(), n1_.data(), D, qd);
  weight_grad(kKProj, dk_.data(), n1_.data(), D, kvd);
  weight_grad(kVProj, dv_.data(), n1_.data(), D, kvd);
  lora_backward(p, kQProj, n1_.data(), dq_.data(), dn, g, n, D, qd, dr);
  lora_backward(p, kKProj, n1_.data(), dk_.data(), dn, g, n, D, kvd, dr);
  lora_backward(p, kVProj, n1_.data(), dv_.data(), dn, g, n, D, kvd, dr);
  copy(dx, dh, n * D);
  rmsnorm_backward(x, p[kInputNorm], rstd1_.data(), dn, dx, g[kInputNorm], n, D,
                   /*accumulate_dx=*/true);
}

// ---------------------------------------------------------------- head

template <typename S>
HeadMath<S>::HeadMath(const LlamaDims& dims, int64_t max_tokens, int64_t chunk_rows)
    : d_(dims), max_tokens_(max_tokens) {
  // At most ~8M logits at a time (32 MiB in fp32), whole row blocks.
  constexpr int64_t kMaxLogits = int64_t{8} << 20;
  int64_t c = std::max<int64_t>(1, kMaxLogits / dims.vocab);
  if (c > kRowBlock) c -= c % kRowBlock;
  if (chunk_rows > 0) c = chunk_rows;
  chunk_ = std::min(c, max_tokens);
  resize(xn_, max_tokens * dims.dim);
  resize(rstd_, max_tokens);
  resize(logits_, chunk_ * dims.vocab);
  resize(dxn_, max_tokens * dims.dim);
  row_loss_.assign(static_cast<size_t>(max_tokens), 0.0);
}

template <typename S>
void HeadMath<S>::run(const S* norm_w, const S* lm_head, const S* x, const int32_t* targets,
                      const uint8_t* mask, int64_t n, S dloss, LossStats* loss, S* dx,
                      S* grad_norm, S* grad_lm_head) {
  const int64_t D = d_.dim, V = d_.vocab;
  const bool grad = dx != nullptr;
  rmsnorm_forward(x, norm_w, xn_.data(), rstd_.data(), n, D, d_.rms_eps);
  int64_t count = 0;
  for (int64_t r = 0; r < n; ++r) count += ce_counts(targets, mask, r) ? 1 : 0;
  const S scale = count > 0 ? dloss / static_cast<S>(count) : S(0);
  for (int64_t c0 = 0; c0 < n; c0 += chunk_) {
    const int64_t rows = std::min(chunk_, n - c0);
    S* lg = logits_.data();
    const S* xc = xn_.data() + c0 * D;
    linear_forward(xc, lm_head, lg, rows, D, V);
    cross_entropy_rows(lg, targets + c0, mask ? mask + c0 : nullptr, rows, V, grad, scale,
                       row_loss_.data() + c0);
    if (!grad) continue;
    linear_backward_input(lg, lm_head, dxn_.data() + c0 * D, rows, D, V, false);
    // grad_lm_head (+)= dlogits^T xn over the chunks in order (null: frozen).
    if (grad_lm_head) for_blocks(V, kRowBlock, [&](int64_t b, int64_t e) {
      gemm<S>(true, false, e - b, D, rows, lg + b, V, xc, D, grad_lm_head + b * D, D, c0 > 0);
    });
  }
  if (grad) {
    rmsnorm_backward(x, norm_w, rstd_.data(), dxn_.data(), dx, grad_norm, n, D, false);
  }
  if (loss) {
    double sum = 0;
    for (int64_t r = 0; r < n; ++r) sum += row_loss_[r];
    loss->sum = sum;
    loss->count = count;
  }
}

template <typename S>
void HeadMath<S>::logits(const S* norm_w, const S* lm_head, const S* x, int64_t n, S* out) {
  rmsnorm_forward(x, norm_w, xn_.data(), rstd_.data(), n, d_.dim, d_.rms_eps);
  linear_forward(xn_.data(), lm_head, out, n, d_.dim, d_.vocab);
}

// ---------------------------------------------------------------- instances

#define STRATA_TRAIN_INSTANTIATE(S)                                                             \
  template void add_bias<S>(S*, const S*, int64_t, int64_t);                                      \
  template void bias_backward<S>(const S*, S*, int64_t, int64_t);                                \
  template void linear_forward<S>(const S*, const S*, S*, int64_t, int64_t, int64_t);          \
  template void linear_backward_input<S>(const S*, const S*, S*, int64_t, int64_t, int64_t,    \
                                         bool);                                                 \
  template void linear_backward_weight<S>(const S*, const S*, S*, int64_t, int64_t, int64_t);  \
  template void rmsnorm_forward<S>(const S*, const S*, S*, S*, int64_t, int64_t, double);      \
  template void rmsnorm_backward<S>(const S*, const S*, const S*, const S*, S*, S*, int64_t,   \
                                    int64_t, bool);                                             \
  template struct RopeTable<S>;                                                                 \
  template void rope_apply<S>(S*, int64_t, int64_t, int64_t, int64_t, const RopeTable<S>&,     \
                              bool);                                                            \
  template struct AttnScratch<S>;                                                               \
  template void attention_forward<S>(const S*, const S*, const S*, S*, S*, int64_t, int64_t,   \
                                     int64_t, int64_t, int64_t, AttnScratch<S>&);               \
  template void attention_backward<S>(const S*, const S*, const S*, const S*, const S*,        \
                                      const S*, S*, S*, S*, int64_t, int64_t, int64_t, int64_t, \
                                      int64_t, AttnScratch<S>&);                                \
  template void swiglu_forward<S>(const S*, const S*, S*, int64_t);                             \
  template void swiglu_backward<S>(const S*, const S*, const S*, S*, S*, int64_t);              \
  template void embed_forward<S>(const S*, const int32_t*, S*, int64_t, int64_t);               \
  template void embed_backward<S>(const int32_t*, const S*, S*, int64_t, int64_t, int64_t,      \
                                  bool);                                                        \
  template void cross_entropy_rows<S>(S*, const int32_t*, const uint8_t*, int64_t, int64_t,    \
                                      bool, S, double*);                                        \
  template class LayerMath<S>;                                                                  \
  template class HeadMath<S>;

STRATA_TRAIN_INSTANTIATE(float)
STRATA_TRAIN_INSTANTIATE(double)

#undef STRATA_TRAIN_INSTANTIATE

}  // namespace strata::train::cpu
