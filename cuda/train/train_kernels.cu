// Kernels of the model ops (see train_kernels.cuh). Plain implementations:
// one block per row for the row-wise ops, per (query row, head) for the fp32
// attention, which keeps no T x T matrix (its section below) but is not tiled
// either: every block reads all its keys from L2/global memory, so long
// sequences (8k and more) are slow with it. Layers with bf16/fp16 weights take
// the tiled tensor-core attention of attention_mma.cu instead. Sums run in a
// fixed order (block reductions of a fixed shape, no floating-point atomics)
// so that every result is the same on every run.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attention_mma.cuh"
#include "common/device_numeric.h"
#include "train_kernels.cuh"

namespace strata_cuda_train {
namespace {

namespace dm = strata::device_math;

constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = 8192;

unsigned grid_for(size_t count) {
  const size_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::max<size_t>(1, std::min(blocks, kMaxBlocks)));
}

__device__ __forceinline__ float ldw(const void* p, int dtype, size_t i) { return dm::load_as_f32(p, dtype, i); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Sum (or max) over the block; every thread gets the result. `sh` holds 32
// floats. blockDim.x must be a multiple of 32. Ends with a barrier, so `sh`
// can be reused right after.
template <bool kMax>
__device__ float block_reduce(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = kMax ? warp_max(v) : warp_sum(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < nwarps ? sh[lane] : (kMax ? -INFINITY : 0.0f);
    w = kMax ? warp_max(w) : warp_sum(w);
    if (lane == 0) sh[0] = w;
  }
  __syncthreads();
  const float r = sh[0];
  __syncthreads();
  return r;
}

// ---------------------------------------------------------------- embedding

__global__ void embed_forward_kernel(const void* table, int dtype, const int32_t* tokens, int64_t d, int64_t vocab,
                                     float* out, uint32_t* bad) {
  const int64_t row = blockIdx.x;
  const int32_t t = tokens[row];
  const bool ok = t >= 0 && t < vocab;
  if (!ok && threadIdx.x == 0) atomicOr(bad, STRATA_CUDA_TRAIN_BAD_TOKEN_FWD);
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x)
    out[row * d + c] = ok ? ldw(table, dtype, static_cast<size_t>(t) * d + c) : 0.0f;
}

// Each thread owns one column of a range of kEmbedRows vocabulary rows and
// walks all tokens in order: the only writer of those elements, so the sum
// runs in token order without atomics (and matches the CPU's order). Costs
// n token reads per (row range, column block): fine for demo vocabularies
// and batches (e.g. 32000 x 8192 tokens: about 2000 blocks of 8192 steps).
constexpr int64_t kEmbedRows = 256;
constexpr int kTokenTile = 1024;

__global__ void embed_backward_kernel(const int32_t* tokens, int64_t n, const float* dx, float* grad, int64_t d,
                                      int64_t vocab, bool accumulate, uint32_t* bad) {
  __shared__ int32_t tile[kTokenTile];
  const int64_t v0 = static_cast<int64_t>(blockIdx.x) * kEmbedRows;
  const int64_t v1 = min(v0 + kEmbedRows, vocab);
  const int64_t col = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const bool active = col < d;
  if (active && !accumulate)
    for (int64_t r = v0; r < v1; ++r) grad[r * d + col] = 0.0f;
  const bool flagger = blockIdx.x == 0 && blockIdx.y == 0;
  for (int64_t base = 0; base < n; base += kTokenTile) {
    const int64_t len = min(static_cast<int64_t>(kTokenTile), n - base);
    __syncthreads();  // the previous tile is no longer read
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      const int32_t t = tokens[base + i];
      tile[i] = t;
      if (flagger && (t < 0 || t >= vocab)) atomicOr(bad, STRATA_CUDA_TRAIN_BAD_TOKEN_BWD);
    }
    __syncthreads();
    if (!active) continue;
    for (int64_t i = 0; i < len; ++i) {
      const int64_t t = tile[i];
      if (t >= v0 && t < v1) grad[t * d + col] += dx[(base + i) * d + col];
    }
  }
}

// ---------------------------------------------------------------- RMSNorm

__global__ void rmsnorm_forward_kernel(const float* x, const void* w, int dtype, float* y, float* rstd, int64_t d,
                                       float eps) {
  __shared__ float sh[32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * d;
  float ss = 0;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) ss += xr[c] * xr[c];
  ss = block_reduce<false>(ss, sh);
  const float r = 1.0f / sqrtf(ss / static_cast<float>(d) + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) y[row * d + c] = ldw(w, dtype, c) * (xr[c] * r);
}

// dx_k = residual_k + r w_k dy_k - r^3 x_k / d * sum_j w_j dy_j x_j
__global__ void rmsnorm_backward_dx_kernel(const float* x, const void* w, int dtype, const float* rstd,
                                           const float* dy, const float* residual, float* dx, int64_t d) {
  __shared__ float sh[32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * d;
  const float* dyr = dy + row * d;
  float dot = 0;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) dot += ldw(w, dtype, c) * dyr[c] * xr[c];
  dot = block_reduce<false>(dot, sh);
  const float r = rstd[row];
  const float coef = r * r * r * dot / static_cast<float>(d);
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    const float g = r * ldw(w, dtype, c) * dyr[c] - coef * xr[c];
    dx[row * d + c] = residual ? residual[row * d + c] + g : g;
  }
}

__global__ void rmsnorm_dw_partial_kernel(const float* x, const float* rstd, const float* dy, float* partial,
                                          int64_t n, int64_t d) {
  // Grid (row chunks, column blocks): the chunks take x, whose limit is
  // 2^31 - 1 (q/k norms have tokens x heads rows: past 65535 chunks of 64).
  const int64_t col = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (col >= d) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRmsPartialRows;
  const int64_t r1 = min(r0 + kRmsPartialRows, n);
  float s = 0;
  for (int64_t r = r0; r < r1; ++r) s += dy[r * d + col] * (x[r * d + col] * rstd[r]);
  partial[static_cast<int64_t>(blockIdx.x) * d + col] = s;
}

__global__ void rmsnorm_dw_final_kernel(const float* partial, int64_t chunks, float* dw, int64_t d) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= d) return;
  float s = 0;
  for (int64_t c = 0; c < chunks; ++c) s += partial[c * d + col];
  dw[col] = s;
}

// ---------------------------------------------------------------- RoPE

__global__ void rope_kernel(float* x, int64_t n, int64_t T, int64_t heads, int64_t hd, const float* cos_table,
                            const float* sin_table, bool inverse) {
  const int64_t half = hd / 2;
  const size_t total = static_cast<size_t>(n) * heads * half;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
    const int64_t i = static_cast<int64_t>(idx % half);
    const int64_t h = static_cast<int64_t>((idx / half) % heads);
    const int64_t r = static_cast<int64_t>(idx / (half * heads));
    const int64_t pos = r % T;
    const float c = cos_table[pos * half + i], s = sin_table[pos * half + i];
    float* p = x + r * heads * hd + h * hd;
    const float x1 = p[i], x2 = p[i + half];
    if (!inverse) {
      p[i] = x1 * c - x2 * s;
      p[i + half] = x2 * c + x1 * s;
    } else {
      p[i] = x1 * c + x2 * s;
      p[i + half] = x2 * c - x1 * s;
    }
  }
}

// ---------------------------------------------------------------- attention
// Flash-attention style, in fp32, without the T x T matrix: the forward keeps
// per query row only the log-sum-exp of its scores (lse, [B, H, T]); the
// backward recomputes each probability from it. Memory O(B H T), not
// O(B H T^2). One block per row (of queries in the forward and for dq, of
// keys for dk/dv); each warp takes every nwarps-th key (or query), with an
// online softmax and a running sum of its own in shared memory, and the warps'
// partials are combined in warp order: the same bits on every run (no atomics).

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / 32;

// Grid (B x T, H): query row i of head h in sequence b (x = b T + i: a
// batch past 65535 sequences fits, as the z dimension would not). Shared: q_i [hd], the
// warps' unnormalised outputs [warps, hd], their max and sum.
__global__ void attn_forward_kernel(const float* q, const float* k, const float* v, float* out, float* lse, int64_t T,
                                    int64_t H, int64_t KVH, int64_t hd, float scale) {
  extern __shared__ float smem[];
  __shared__ float wmax[kAttnWarps], wsum[kAttnWarps];
  float* qs = smem;
  float* acc = smem + hd;
  const int64_t i = blockIdx.x % T, h = blockIdx.y, b = blockIdx.x / T;
  const int64_t kvh = h / (H / KVH);
  const int64_t qd = H * hd, kd = KVH * hd;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* qrow = q + (b * T + i) * qd + h * hd;
  for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) qs[c] = qrow[c];
  float* mine = acc + warp * hd;
  for (int64_t c = lane; c < hd; c += 32) mine[c] = 0.0f;
  __syncthreads();
  float m = -INFINITY, l = 0.0f;
  for (int64_t j = warp; j <= i; j += kAttnWarps) {
    const float* krow = k + (b * T + j) * kd + kvh * hd;
    const float* vrow = v + (b * T + j) * kd + kvh * hd;
    float s = 0;
    for (int64_t c = lane; c < hd; c += 32) s += qs[c] * krow[c];
    s = warp_sum(s) * scale;  // every lane has it
    const float m_new = fmaxf(m, s);
    const float corr = expf(m - m_new);  // 0 on the first key (m = -inf)
    const float p = expf(s - m_new);
    l = l * corr + p;
    for (int64_t c = lane; c < hd; c += 32) mine[c] = mine[c] * corr + p * vrow[c];
    m = m_new;
  }
  if (lane == 0) {
    wmax[warp] = m;
    wsum[warp] = l;
  }
  __syncthreads();
  float M = -INFINITY;
  for (int w = 0; w < kAttnWarps; ++w) M = fmaxf(M, wmax[w]);
  float scale_w[kAttnWarps];
  float L = 0.0f;
  for (int w = 0; w < kAttnWarps; ++w) {
    scale_w[w] = wsum[w] > 0.0f ? expf(wmax[w] - M) : 0.0f;  // a warp without keys adds nothing
    L += wsum[w] * scale_w[w];
  }
  const float inv = 1.0f / L;  // row i has keys 0..i: L >= 1
  float* orow = out + (b * T + i) * qd + h * hd;
  for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < kAttnWarps; ++w) o += acc[w * hd + c] * scale_w[w];
    orow[c] = o * inv;
  }
  if (threadIdx.x == 0) lse[(b * H + h) * T + i] = M + logf(L);
}

// Grid (T, H, B): query row i. delta_i = dout_i . out_i (stored for the kv
// kernel); per key j <= i: P_ij = exp(scale q_i.k_j - lse_i),
// dS_ij = P_ij (dout_i.v_j - delta_i); dq_i = scale * sum_j dS_ij k_j.
__global__ void attn_bwd_q_kernel(const float* q, const float* k, const float* v, const float* out,
                                  const float* lse, const float* dout, float* delta, float* dq, int64_t T, int64_t H,
                                  int64_t KVH, int64_t hd, float scale) {
  extern __shared__ float smem[];
  __shared__ float sh[32];
  float* qs = smem;
  float* ds = smem + hd;
  float* acc = smem + 2 * hd;
  const int64_t i = blockIdx.x % T, h = blockIdx.y, b = blockIdx.x / T;
  const int64_t kvh = h / (H / KVH);
  const int64_t qd = H * hd, kd = KVH * hd;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = (b * T + i) * qd + h * hd;
  float dot = 0;
  for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) {
    qs[c] = q[row + c];
    ds[c] = dout[row + c];
    dot += ds[c] * out[row + c];
  }
  float* mine = acc + warp * hd;
  for (int64_t c = lane; c < hd; c += 32) mine[c] = 0.0f;
  const float dl = block_reduce<false>(dot, sh);  // also orders the shared writes above
  const int64_t r = (b * H + h) * T + i;
  if (threadIdx.x == 0) delta[r] = dl;
  const float li = lse[r];
  for (int64_t j = warp; j <= i; j += kAttnWarps) {
    const float* krow = k + (b * T + j) * kd + kvh * hd;
    const float* vrow = v + (b * T + j) * kd + kvh * hd;
    float s = 0, dp = 0;
    for (int64_t c = lane; c < hd; c += 32) {
      s += qs[c] * krow[c];
      dp += ds[c] * vrow[c];
    }
    s = warp_sum(s);
    dp = warp_sum(dp);
    const float p = expf(s * scale - li);
    const float dS = p * (dp - dl);
    for (int64_t c = lane; c < hd; c += 32) mine[c] += dS * krow[c];
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) {
    float g = 0.0f;
    for (int w = 0; w < kAttnWarps; ++w) g += acc[w * hd + c];
    dq[row + c] = g * scale;
  }
}

// Grid (T, KVH, B): key row j of kv head kvh. Over the query heads of the
// group and the rows i >= j (each warp every nwarps-th row, heads in order):
// dv_j = sum P_ij dout_i, dk_j = scale * sum dS_ij q_i, with P and dS
// recomputed from lse and delta.
__global__ void attn_bwd_kv_kernel(const float* q, const float* k, const float* v, const float* lse,
                                   const float* delta, const float* dout, float* dk, float* dv, int64_t T, int64_t H,
                                   int64_t KVH, int64_t hd, float scale) {
  extern __shared__ float smem[];
  float* ks = smem;
  float* vs = smem + hd;
  float* dk_acc = smem + 2 * hd;
  float* dv_acc = dk_acc + kAttnWarps * hd;
  const int64_t j = blockIdx.x % T, kvh = blockIdx.y, b = blockIdx.x / T;
  const int64_t group = H / KVH;
  const int64_t qd = H * hd, kd = KVH * hd;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t krow = (b * T + j) * kd + kvh * hd;
  for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) {
    ks[c] = k[krow + c];
    vs[c] = v[krow + c];
  }
  float* mk = dk_acc + warp * hd;
  float* mv = dv_acc + warp * hd;
  for (int64_t c = lane; c < hd; c += 32) mk[c] = mv[c] = 0.0f;
  __syncthreads();
  for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
    for (int64_t i = j + warp; i < T; i += kAttnWarps) {
      const int64_t row = (b * T + i) * qd + h * hd;
      const int64_t r = (b * H + h) * T + i;
      float s = 0, dp = 0;
      for (int64_t c = lane; c < hd; c += 32) {
        s += q[row + c] * ks[c];
        dp += dout[row + c] * vs[c];
      }
      s = warp_sum(s);
      dp = warp_sum(dp);
      const float p = expf(s * scale - lse[r]);
      const float dS = p * (dp - delta[r]);
      for (int64_t c = lane; c < hd; c += 32) {
        mv[c] += p * dout[row + c];
        mk[c] += dS * q[row + c];
      }
    }
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) {
    float gk = 0.0f, gv = 0.0f;
    for (int w = 0; w < kAttnWarps; ++w) {
      gk += dk_acc[w * hd + c];
      gv += dv_acc[w * hd + c];
    }
    dk[krow + c] = gk * scale;
    dv[krow + c] = gv;
  }
}

// ---------------------------------------------------------------- SwiGLU, casts

__global__ void swiglu_forward_kernel(const float* g, const float* u, float* a, size_t count) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const float x = g[i];
    const float sig = 1.0f / (1.0f + expf(-x));
    a[i] = x * sig * u[i];
  }
}

__global__ void swiglu_backward_kernel(float* g, float* u, const float* da, size_t count) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const float x = g[i], up = u[i], d = da[i];
    const float sig = 1.0f / (1.0f + expf(-x));
    const float silu = x * sig;
    g[i] = d * up * (sig * (1.0f + x * (1.0f - sig)));
    u[i] = d * silu;
  }
}

__global__ void cast_kernel(void* dst, int dtype, const float* src, size_t count) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    dm::store_from_f32(dst, dtype, i, src[i]);
}

// ---------------------------------------------------------------- cross-entropy

__device__ __forceinline__ bool counts(const int32_t* targets, const uint8_t* mask, int64_t r, int64_t vocab) {
  const int32_t t = targets[r];
  return t >= 0 && t < vocab && (mask == nullptr || mask[r] != 0);
}

__global__ void ce_count_kernel(const int32_t* targets, const uint8_t* mask, int64_t n, int64_t vocab,
                                strata_cuda_train_report_t* report) {
  __shared__ unsigned long long total;
  __shared__ unsigned bad;
  if (threadIdx.x == 0) {
    total = 0;
    bad = 0;
  }
  __syncthreads();
  unsigned long long c = 0;
  unsigned b = 0;
  for (int64_t r = threadIdx.x; r < n; r += blockDim.x) {
    if (targets[r] >= vocab) b = 1;
    if (counts(targets, mask, r, vocab)) ++c;
  }
  atomicAdd(&total, c);  // integer: the order does not matter
  if (b) atomicOr(&bad, 1u);
  __syncthreads();
  if (threadIdx.x == 0) {
    report->loss_count = static_cast<int64_t>(total);
    if (bad) report->bad_ids |= STRATA_CUDA_TRAIN_BAD_TARGET;
  }
}

__global__ void cross_entropy_kernel(float* logits, const int32_t* targets, const uint8_t* mask, int64_t vocab,
                                     float dloss, bool grad, const strata_cuda_train_report_t* report,
                                     double* row_loss) {
  __shared__ float sh[32];
  const int64_t r = blockIdx.x;
  float* row = logits + r * vocab;
  const bool on = counts(targets, mask, r, vocab);
  float m = -INFINITY;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) m = fmaxf(m, row[c]);
  m = block_reduce<true>(m, sh);
  float sum = 0;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) sum += expf(row[c] - m);
  sum = block_reduce<false>(sum, sh);
  const int32_t t = on ? targets[r] : -1;
  if (threadIdx.x == 0) {
    // (m - row[t]) is exact when the target is near the max (Sterbenz), and
    // the log in double keeps a confident row's small loss from cancelling
    // in fp32 (the CPU's cross_entropy_rows works in double too).
    row_loss[r] = on ? static_cast<double>(m - row[t]) + log(static_cast<double>(sum)) : 0.0;
  }
  if (!grad) return;
  __syncthreads();  // row[t] is read above before it is overwritten below
  const int64_t count = report->loss_count;
  const float gs = (on && count > 0) ? dloss / static_cast<float>(count) : 0.0f;
  if (!on || count == 0) {
    // A row that does not count has an exact zero gradient, as on the CPU
    // (cross_entropy_rows): not 0 * p, which is NaN where its logits
    // overflowed (m = inf). Same value for the whole block: no barrier.
    for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) row[c] = 0.0f;
    return;
  }
  const float inv = 1.0f / sum;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
    const float p = expf(row[c] - m) * inv;
    row[c] = gs * (p - (c == t ? 1.0f : 0.0f));
  }
}

// One warp: lanes load 32 consecutive losses, lane 0 adds them in order.
__global__ void loss_sum_kernel(const double* row_loss, int64_t n, strata_cuda_train_report_t* report) {
  __shared__ double buf[32];
  double s = 0;
  for (int64_t base = 0; base < n; base += 32) {
    const int64_t r = base + threadIdx.x;
    buf[threadIdx.x] = r < n ? row_loss[r] : 0.0;
    __syncwarp();
    if (threadIdx.x == 0)
      for (int i = 0; i < 32 && base + i < n; ++i) s += buf[i];
    __syncwarp();
  }
  if (threadIdx.x == 0) report->loss_sum = s;
}


// ---------------------------------------------------------------- biases, LoRA

__global__ void add_bias_kernel(float* y, const void* b, int dtype, size_t count, int64_t cols) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    y[i] += ldw(b, dtype, i % static_cast<size_t>(cols));
}

// out[c] = sum over rows of dy[r, c], rows in order (one thread per column).
__global__ void col_sum_kernel(const float* dy, float* out, int64_t n, int64_t cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0;
  for (int64_t r = 0; r < n; ++r) s += dy[r * cols + c];
  out[c] = s;
}

__global__ void scale_kernel(float* dst, const float* src, float scale, size_t count, bool add) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = add ? dst[i] + src[i] * scale : src[i] * scale;
}

// The CPU ops' draw (train/cpu_kernels.cpp lora_keep), bit for bit.
__device__ __forceinline__ bool lora_keep(uint64_t seed, int target, uint64_t i, float p) {
  uint64_t z = seed ^ (static_cast<uint64_t>(target + 1) * 0x9E3779B97F4A7C15ull) ^ (i * 0xD1B54A32D192ED03ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * 0x1p-24f >= p;
}

// add = false: dst = dropout(src); add = true: dst += dropout(src) (the
// backward through the same mask).
__global__ void lora_dropout_kernel(float* dst, const float* src, uint64_t seed, int target, uint64_t first,
                                    size_t count, float p, bool add) {
  const float keep = 1.0f / (1.0f - p);
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float v = lora_keep(seed, target, first + i, p) ? src[i] * keep : 0.0f;
    dst[i] = add ? dst[i] + v : v;
  }
}

}  // namespace

// ---------------------------------------------------------------- launchers

namespace {
// The runtime keeps one last error per host thread: every failed call sets
// it (a cudaErrorNotReady query, a refused cudaHostRegister, an allocation
// the caller retries) and only cudaGetLastError() clears it; a launch that
// succeeds leaves it as it was. Cleared before a launch, the
// cudaGetLastError() after it is that launch's error alone (a sticky error
// still comes back: the context returns it again).
void clear_stale_error() { (void)cudaGetLastError(); }
}  // namespace

cudaError_t embed_forward(const void* table, int dtype, const int32_t* tokens, int64_t n, int64_t d, int64_t vocab,
                          float* out, uint32_t* bad, cudaStream_t stream) {
  clear_stale_error();
  if (n == 0) return cudaSuccess;
  if (n > INT32_MAX) return cudaErrorInvalidConfiguration;  // one block per row: grid x
  embed_forward_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(table, dtype, tokens, d, vocab, out, bad);
  return cudaGetLastError();
}

namespace {
// Grid limits: x up to 2^31 - 1, y and z up to 65535 (launching beyond them
// fails with a launch error that names nothing; refuse it before).
bool grid_ok(const dim3& g) { return g.x >= 1 && g.y >= 1 && g.y <= 65535 && g.z >= 1 && g.z <= 65535; }
}  // namespace

cudaError_t embed_backward(const int32_t* tokens, int64_t n, const float* dx, float* grad, int64_t d, int64_t vocab,
                           bool accumulate, uint32_t* bad, cudaStream_t stream) {
  clear_stale_error();
  const dim3 grid(static_cast<unsigned>((vocab + kEmbedRows - 1) / kEmbedRows),
                  static_cast<unsigned>((d + kThreads - 1) / kThreads));
  if (!grid_ok(grid)) return cudaErrorInvalidConfiguration;
  embed_backward_kernel<<<grid, kThreads, 0, stream>>>(tokens, n, dx, grad, d, vocab, accumulate, bad);
  return cudaGetLastError();
}

cudaError_t rmsnorm_forward(const float* x, const void* w, int dtype, float* y, float* rstd, int64_t n, int64_t d,
                            float eps, cudaStream_t stream) {
  clear_stale_error();
  if (n == 0) return cudaSuccess;
  if (n > INT32_MAX) return cudaErrorInvalidConfiguration;  // one block per row: grid x
  rmsnorm_forward_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(x, w, dtype, y, rstd, d, eps);
  return cudaGetLastError();
}

cudaError_t rmsnorm_backward(const float* x, const void* w, int dtype, const float* rstd, const float* dy,
                             const float* residual, float* dx, float* dw, float* partial, int64_t n, int64_t d,
                             cudaStream_t stream) {
  clear_stale_error();
  if (n == 0) return cudaSuccess;
  if (n > INT32_MAX) return cudaErrorInvalidConfiguration;  // one block per row: grid x
  rmsnorm_backward_dx_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(x, w, dtype, rstd, dy, residual, dx,
                                                                                  d);
  if (!dw) return cudaGetLastError();  // a frozen weight
  const int64_t chunks = (n + kRmsPartialRows - 1) / kRmsPartialRows;
  const unsigned cols = static_cast<unsigned>((d + kThreads - 1) / kThreads);
  if (!grid_ok(dim3(static_cast<unsigned>(chunks), cols))) return cudaErrorInvalidConfiguration;
  rmsnorm_dw_partial_kernel<<<dim3(static_cast<unsigned>(chunks), cols), kThreads, 0, stream>>>(x, rstd, dy, partial,
                                                                                               n, d);
  rmsnorm_dw_final_kernel<<<cols, kThreads, 0, stream>>>(partial, chunks, dw, d);
  return cudaGetLastError();
}

cudaError_t rope(float* x, int64_t n, int64_t T, int64_t heads, int64_t hd, const float* cos_table,
                 const float* sin_table, bool inverse, cudaStream_t stream) {
  clear_stale_error();
  const size_t total = static_cast<size_t>(n) * heads * (hd / 2);
  if (total == 0) return cudaSuccess;
  rope_kernel<<<grid_for(total), kThreads, 0, stream>>>(x, n, T, heads, hd, cos_table, sin_table, inverse);
  return cudaGetLastError();
}

namespace {
float attn_scale(int64_t hd) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd))); }
}  // namespace

const char* attention_kernel(bool tensor_cores, int64_t hd) {
  if (tensor_cores && attention_mma_available(hd)) return "tensor-core bf16 (mma.sync m16n8k16, 64x64 tiles)";
  return "fp32 (one block per query row)";
}

cudaError_t attention_forward(const float* q, const float* k, const float* v, float* out, float* lse, int64_t B,
                              int64_t T, int64_t H, int64_t KVH, int64_t hd, bool tensor_cores, cudaStream_t stream) {
  clear_stale_error();
  if (tensor_cores) {
    const cudaError_t e = attention_mma_forward(q, k, v, out, lse, B, T, H, KVH, hd, stream);
    if (e != cudaErrorNotSupported) return e;
  }
  if (B * T > INT32_MAX) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(B * T), static_cast<unsigned>(H));
  if (!grid_ok(grid) || hd > 1024) return cudaErrorInvalidConfiguration;
  const size_t smem = static_cast<size_t>(hd) * (1 + kAttnWarps) * sizeof(float);
  attn_forward_kernel<<<grid, kAttnThreads, smem, stream>>>(q, k, v, out, lse, T, H, KVH, hd, attn_scale(hd));
  return cudaGetLastError();
}

cudaError_t attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                               const float* dout, float* delta, float* dq, float* dk, float* dv, int64_t B, int64_t T,
                               int64_t H, int64_t KVH, int64_t hd, bool tensor_cores, cudaStream_t stream) {
  clear_stale_error();
  if (tensor_cores) {
    const cudaError_t e = attention_mma_backward(q, k, v, out, lse, dout, delta, dq, dk, dv, B, T, H, KVH, hd, stream);
    if (e != cudaErrorNotSupported) return e;
  }
  if (B * T > INT32_MAX) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(B * T), static_cast<unsigned>(H));
  const dim3 kv_grid(static_cast<unsigned>(B * T), static_cast<unsigned>(KVH));
  if (!grid_ok(grid) || !grid_ok(kv_grid) || hd > 1024) return cudaErrorInvalidConfiguration;
  const size_t q_smem = static_cast<size_t>(hd) * (2 + kAttnWarps) * sizeof(float);
  attn_bwd_q_kernel<<<grid, kAttnThreads, q_smem, stream>>>(q, k, v, out, lse, dout, delta, dq, T, H, KVH, hd,
                                                            attn_scale(hd));
  const size_t kv_smem = static_cast<size_t>(hd) * (2 + 2 * kAttnWarps) * sizeof(float);
  attn_bwd_kv_kernel<<<kv_grid, kAttnThreads, kv_smem, stream>>>(q, k, v, lse, delta, dout, dk, dv, T, H, KVH, hd,
                                                                 attn_scale(hd));
  return cudaGetLastError();
}

cudaError_t swiglu_forward(const float* g, const float* u, float* a, size_t count, cudaStream_t stream) {
  clear_stale_error();
  if (count == 0) return cudaSuccess;
  swiglu_forward_kernel<<<grid_for(count), kThreads, 0, stream>>>(g, u, a, count);
  return cudaGetLastError();
}

cudaError_t swiglu_backward(float* g, float* u, const float* da, size_t count, cudaStream_t stream) {
  clear_stale_error();
  if (count == 0) return cudaSuccess;
  swiglu_backward_kernel<<<grid_for(count), kThreads, 0, stream>>>(g, u, da, count);
  return cudaGetLastError();
}

cudaError_t cast_from_f32(void* dst, int dtype, const float* src, size_t count, cudaStream_t stream) {
  clear_stale_error();
  if (count == 0) return cudaSuccess;
  cast_kernel<<<grid_for(count), kThreads, 0, stream>>>(dst, dtype, src, count);
  return cudaGetLastError();
}

cudaError_t ce_count(const int32_t* targets, const uint8_t* mask, int64_t n, int64_t vocab,
                     strata_cuda_train_report_t* report, cudaStream_t stream) {
  clear_stale_error();
  ce_count_kernel<<<1, 1024, 0, stream>>>(targets, mask, n, vocab, report);
  return cudaGetLastError();
}

cudaError_t cross_entropy(float* logits, const int32_t* targets, const uint8_t* mask, int64_t rows, int64_t vocab,
                          float dloss, bool grad, const strata_cuda_train_report_t* report, double* row_loss,
                          cudaStream_t stream) {
  clear_stale_error();
  if (rows == 0) return cudaSuccess;
  if (rows > INT32_MAX) return cudaErrorInvalidConfiguration;  // one block per row: grid x
  cross_entropy_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(logits, targets, mask, vocab, dloss, grad,
                                                                              report, row_loss);
  return cudaGetLastError();
}

cudaError_t loss_sum(const double* row_loss, int64_t n, strata_cuda_train_report_t* report, cudaStream_t stream) {
  clear_stale_error();
  loss_sum_kernel<<<1, 32, 0, stream>>>(row_loss, n, report);
  return cudaGetLastError();
}

cudaError_t add_bias(float* y, const void* b, int dtype, int64_t n, int64_t cols, cudaStream_t stream) {
  clear_stale_error();
  const size_t count = static_cast<size_t>(n) * cols;
  if (count == 0) return cudaSuccess;
  add_bias_kernel<<<grid_for(count), kThreads, 0, stream>>>(y, b, dtype, count, cols);
  return cudaGetLastError();
}

cudaError_t col_sum(const float* dy, float* out, int64_t n, int64_t cols, cudaStream_t stream) {
  clear_stale_error();
  if (cols == 0) return cudaSuccess;
  col_sum_kernel<<<static_cast<unsigned>((cols + kThreads - 1) / kThreads), kThreads, 0, stream>>>(dy, out, n, cols);
  return cudaGetLastError();
}

cudaError_t scale(float* dst, const float* src, float s, size_t count, bool add, cudaStream_t stream) {
  clear_stale_error();
  if (count == 0) return cudaSuccess;
  scale_kernel<<<grid_for(count), kThreads, 0, stream>>>(dst, src, s, count, add);
  return cudaGetLastError();
}

cudaError_t lora_dropout(float* dst, const float* src, uint64_t seed, int target, uint64_t first, size_t count, float p,
                         bool add, cudaStream_t stream) {
  clear_stale_error();
  if (count == 0) return cudaSuccess;
  lora_dropout_kernel<<<grid_for(count), kThreads, 0, stream>>>(dst, src, seed, target, first, count, p, add);
  return cudaGetLastError();
}

}  // namespace strata_cuda_train
