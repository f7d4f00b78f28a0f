// Kernels of the model ops (see train_kernels.cuh). Plain, correct
// implementations sized for the trainer's demo models: one block per row for
// the row-wise ops, per (query row, head, batch) for attention, with the
// T x T probabilities materialised in the caller's workspace. Sums run in a
// fixed order (block reductions of a fixed shape, no floating-point atomics)
// so that every result is the same on every run.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

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
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= d) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRmsPartialRows;
  const int64_t r1 = min(r0 + kRmsPartialRows, n);
  float s = 0;
  for (int64_t r = r0; r < r1; ++r) s += dy[r * d + col] * (x[r * d + col] * rstd[r]);
  partial[static_cast<int64_t>(blockIdx.y) * d + col] = s;
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
// Grid (T, H, B): one block per query row i of head h in sequence b.
// Shared memory: one row of hd floats. P rows are [T] floats at
// P + ((b*H + h)*T + i)*T.

constexpr int kAttnThreads = 128;

// Scores by one warp per key (lanes split head_dim: coalesced reads of k),
// then max-subtracted softmax over j <= i in fp32.
__global__ void attn_softmax_kernel(const float* q, const float* k, float* P, int64_t T, int64_t H, int64_t KVH,
                                    int64_t hd, float scale) {
  extern __shared__ float qs[];
  __shared__ float sh[32];
  const int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t kvh = h / (H / KVH);
  const int64_t qd = H * hd, kd = KVH * hd;
  const float* qrow = q + (b * T + i) * qd + h * hd;
  for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) qs[c] = qrow[c];
  __syncthreads();
  float* prow = P + ((b * H + h) * T + i) * T;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int64_t j = warp; j <= i; j += nwarps) {
    const float* krow = k + (b * T + j) * kd + kvh * hd;
    float s = 0;
    for (int64_t c = lane; c < hd; c += 32) s += qs[c] * krow[c];
    s = warp_sum(s);
    if (lane == 0) prow[j] = s * scale;
  }
  __syncthreads();
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) m = fmaxf(m, prow[j]);
  m = block_reduce<true>(m, sh);
  float sum = 0;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) {
    const float e = expf(prow[j] - m);
    prow[j] = e;
    sum += e;
  }
  sum = block_reduce<false>(sum, sh);
  const float inv = 1.0f / sum;
  for (int64_t j = threadIdx.x; j < T; j += blockDim.x) prow[j] = j <= i ? prow[j] * inv : 0.0f;
}

// out[i, h, c] = sum_{j <= i} P[i, j] v[j, kvh, c]; threads split head_dim.
__global__ void attn_pv_kernel(const float* P, const float* v, float* out, int64_t T, int64_t H, int64_t KVH,
                               int64_t hd) {
  const int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t kvh = h / (H / KVH);
  const int64_t qd = H * hd, kd = KVH * hd;
  const float* prow = P + ((b * H + h) * T + i) * T;
  for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) {
    float s = 0;
    for (int64_t j = 0; j <= i; ++j) s += prow[j] * v[(b * T + j) * kd + kvh * hd + c];
    out[(b * T + i) * qd + h * hd + c] = s;
  }
}

// Per query row: dP_j = dout_i . v_j, delta = sum_j P_ij dP_j,
// dS_ij = P_ij (dP_j - delta), dq_i = scale * sum_j dS_ij k_j.
__global__ void attn_bwd_rows_kernel(const float* k, const float* v, const float* P, const float* dout, float* dS,
                                     float* dq, int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale) {
  extern __shared__ float ds[];
  __shared__ float sh[32];
  const int64_t i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t kvh = h / (H / KVH);
  const int64_t qd = H * hd, kd = KVH * hd;
  const float* drow = dout + (b * T + i) * qd + h * hd;
  for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) ds[c] = drow[c];
  __syncthreads();
  const float* prow = P + ((b * H + h) * T + i) * T;
  float* srow = dS + ((b * H + h) * T + i) * T;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int64_t j = warp; j <= i; j += nwarps) {
    const float* vrow = v + (b * T + j) * kd + kvh * hd;
    float s = 0;
    for (int64_t c = lane; c < hd; c += 32) s += ds[c] * vrow[c];
    s = warp_sum(s);
    if (lane == 0) srow[j] = s;  // dP for now
  }
  __syncthreads();
  float delta = 0;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) delta += prow[j] * srow[j];
  delta = block_reduce<false>(delta, sh);
  for (int64_t j = threadIdx.x; j < T; j += blockDim.x) srow[j] = j <= i ? prow[j] * (srow[j] - delta) : 0.0f;
  __syncthreads();
  for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) {
    float s = 0;
    for (int64_t j = 0; j <= i; ++j) s += srow[j] * k[(b * T + j) * kd + kvh * hd + c];
    dq[(b * T + i) * qd + h * hd + c] = s * scale;
  }
}

// Grid (T, KVH, B): key row j of kv head kvh. Sums over the query heads of
// the group and the rows i >= j, in that order:
// dv_j = sum P_ij dout_i, dk_j = scale * sum dS_ij q_i.
__global__ void attn_bwd_kv_kernel(const float* q, const float* P, const float* dS, const float* dout, float* dk,
                                   float* dv, int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale) {
  const int64_t j = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int64_t group = H / KVH;
  const int64_t qd = H * hd, kd = KVH * hd;
  for (int64_t c = threadIdx.x; c < hd; c += blockDim.x) {
    float sk = 0, sv = 0;
    for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
      const int64_t pbase = (b * H + h) * T * T;
      for (int64_t i = j; i < T; ++i) {
        const int64_t qi = (b * T + i) * qd + h * hd + c;
        sv += P[pbase + i * T + j] * dout[qi];
        sk += dS[pbase + i * T + j] * q[qi];
      }
    }
    dk[(b * T + j) * kd + kvh * hd + c] = sk * scale;
    dv[(b * T + j) * kd + kvh * hd + c] = sv;
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
    const float lse = m + logf(sum);
    row_loss[r] = on ? static_cast<double>(lse - row[t]) : 0.0;
  }
  if (!grad) return;
  __syncthreads();  // row[t] is read above before it is overwritten below
  const int64_t count = report->loss_count;
  const float gs = (on && count > 0) ? dloss / static_cast<float>(count) : 0.0f;
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
__global__ void lora_dropout_kernel(float* dst, const float* src, uint64_t seed, int target, size_t count, float p,
                                    bool add) {
  const float keep = 1.0f / (1.0f - p);
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float v = lora_keep(seed, target, i, p) ? src[i] * keep : 0.0f;
    dst[i] = add ? dst[i] + v : v;
  }
}

}  // namespace

// ---------------------------------------------------------------- launchers

cudaError_t embed_forward(const void* table, int dtype, const int32_t* tokens, int64_t n, int64_t d, int64_t vocab,
                          float* out, uint32_t* bad, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
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
  const dim3 grid(static_cast<unsigned>((vocab + kEmbedRows - 1) / kEmbedRows),
                  static_cast<unsigned>((d + kThreads - 1) / kThreads));
  if (!grid_ok(grid)) return cudaErrorInvalidConfiguration;
  embed_backward_kernel<<<grid, kThreads, 0, stream>>>(tokens, n, dx, grad, d, vocab, accumulate, bad);
  return cudaGetLastError();
}

cudaError_t rmsnorm_forward(const float* x, const void* w, int dtype, float* y, float* rstd, int64_t n, int64_t d,
                            float eps, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  rmsnorm_forward_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(x, w, dtype, y, rstd, d, eps);
  return cudaGetLastError();
}

cudaError_t rmsnorm_backward(const float* x, const void* w, int dtype, const float* rstd, const float* dy,
                             const float* residual, float* dx, float* dw, float* partial, int64_t n, int64_t d,
                             cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  rmsnorm_backward_dx_kernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(x, w, dtype, rstd, dy, residual, dx,
                                                                                  d);
  if (!dw) return cudaGetLastError();  // a frozen weight
  const int64_t chunks = (n + kRmsPartialRows - 1) / kRmsPartialRows;
  const unsigned cols = static_cast<unsigned>((d + kThreads - 1) / kThreads);
  if (!grid_ok(dim3(cols, static_cast<unsigned>(chunks)))) return cudaErrorInvalidConfiguration;
  rmsnorm_dw_partial_kernel<<<dim3(cols, static_cast<unsigned>(chunks)), kThreads, 0, stream>>>(x, rstd, dy, partial,
                                                                                               n, d);
  rmsnorm_dw_final_kernel<<<cols, kThreads, 0, stream>>>(partial, chunks, dw, d);
  return cudaGetLastError();
}

cudaError_t rope(float* x, int64_t n, int64_t T, int64_t heads, int64_t hd, const float* cos_table,
                 const float* sin_table, bool inverse, cudaStream_t stream) {
  const size_t total = static_cast<size_t>(n) * heads * (hd / 2);
  if (total == 0) return cudaSuccess;
  rope_kernel<<<grid_for(total), kThreads, 0, stream>>>(x, n, T, heads, hd, cos_table, sin_table, inverse);
  return cudaGetLastError();
}

namespace {
float attn_scale(int64_t hd) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd))); }
unsigned hd_threads(int64_t hd) { return static_cast<unsigned>(std::min<int64_t>(((hd + 31) / 32) * 32, 1024)); }
}  // namespace

cudaError_t attention_forward(const float* q, const float* k, const float* v, float* out, float* P, int64_t B,
                              int64_t T, int64_t H, int64_t KVH, int64_t hd, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(H), static_cast<unsigned>(B));
  if (!grid_ok(grid)) return cudaErrorInvalidConfiguration;
  const size_t smem = static_cast<size_t>(hd) * sizeof(float);
  attn_softmax_kernel<<<grid, kAttnThreads, smem, stream>>>(q, k, P, T, H, KVH, hd, attn_scale(hd));
  attn_pv_kernel<<<grid, hd_threads(hd), 0, stream>>>(P, v, out, T, H, KVH, hd);
  return cudaGetLastError();
}

cudaError_t attention_backward(const float* q, const float* k, const float* v, const float* P, const float* dout,
                               float* dS, float* dq, float* dk, float* dv, int64_t B, int64_t T, int64_t H,
                               int64_t KVH, int64_t hd, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(H), static_cast<unsigned>(B));
  if (!grid_ok(grid)) return cudaErrorInvalidConfiguration;
  const size_t smem = static_cast<size_t>(hd) * sizeof(float);
  attn_bwd_rows_kernel<<<grid, kAttnThreads, smem, stream>>>(k, v, P, dout, dS, dq, T, H, KVH, hd, attn_scale(hd));
  const dim3 kv_grid(static_cast<unsigned>(T), static_cast<unsigned>(KVH), static_cast<unsigned>(B));
  attn_bwd_kv_kernel<<<kv_grid, hd_threads(hd), 0, stream>>>(q, P, dS, dout, dk, dv, T, H, KVH, hd, attn_scale(hd));
  return cudaGetLastError();
}

cudaError_t swiglu_forward(const float* g, const float* u, float* a, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  swiglu_forward_kernel<<<grid_for(count), kThreads, 0, stream>>>(g, u, a, count);
  return cudaGetLastError();
}

cudaError_t swiglu_backward(float* g, float* u, const float* da, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  swiglu_backward_kernel<<<grid_for(count), kThreads, 0, stream>>>(g, u, da, count);
  return cudaGetLastError();
}

cudaError_t cast_from_f32(void* dst, int dtype, const float* src, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  cast_kernel<<<grid_for(count), kThreads, 0, stream>>>(dst, dtype, src, count);
  return cudaGetLastError();
}

cudaError_t ce_count(const int32_t* targets, const uint8_t* mask, int64_t n, int64_t vocab,
                     strata_cuda_train_report_t* report, cudaStream_t stream) {
  ce_count_kernel<<<1, 1024, 0, stream>>>(targets, mask, n, vocab, report);
  return cudaGetLastError();
}

cudaError_t cross_entropy(float* logits, const int32_t* targets, const uint8_t* mask, int64_t rows, int64_t vocab,
                          float dloss, bool grad, const strata_cuda_train_report_t* report, double* row_loss,
                          cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  cross_entropy_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(logits, targets, mask, vocab, dloss, grad,
                                                                              report, row_loss);
  return cudaGetLastError();
}

cudaError_t loss_sum(const double* row_loss, int64_t n, strata_cuda_train_report_t* report, cudaStream_t stream) {
  loss_sum_kernel<<<1, 32, 0, stream>>>(row_loss, n, report);
  return cudaGetLastError();
}

cudaError_t add_bias(float* y, const void* b, int dtype, int64_t n, int64_t cols, cudaStream_t stream) {
  const size_t count = static_cast<size_t>(n) * cols;
  if (count == 0) return cudaSuccess;
  add_bias_kernel<<<grid_for(count), kThreads, 0, stream>>>(y, b, dtype, count, cols);
  return cudaGetLastError();
}

cudaError_t col_sum(const float* dy, float* out, int64_t n, int64_t cols, cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  col_sum_kernel<<<static_cast<unsigned>((cols + kThreads - 1) / kThreads), kThreads, 0, stream>>>(dy, out, n, cols);
  return cudaGetLastError();
}

cudaError_t scale(float* dst, const float* src, float s, size_t count, bool add, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  scale_kernel<<<grid_for(count), kThreads, 0, stream>>>(dst, src, s, count, add);
  return cudaGetLastError();
}

cudaError_t lora_dropout(float* dst, const float* src, uint64_t seed, int target, size_t count, float p, bool add,
                         cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  lora_dropout_kernel<<<grid_for(count), kThreads, 0, stream>>>(dst, src, seed, target, count, p, add);
  return cudaGetLastError();
}

}  // namespace strata_cuda_train
