// libstrata_cuda_train.so: the trainer's model ops on CUDA, loaded by
// train/cuda_ops.cpp with dlopen (ABI: cuda/train/train_module_abi.h). Exports
// only strata_cuda_train_api_v1.
//
// Matrix products go through cuBLAS (cublasGemmEx). With bf16 or fp16
// weights both operands are in that dtype (activations are rounded to it
// just before the product, into the context's low-precision scratch) and
// cuBLAS accumulates in fp32 (CUBLAS_COMPUTE_32F) into fp32 outputs: "bf16
// compute with fp32 accumulation", as autocast does. With fp32 weights the
// product is a plain fp32 GEMM (CUBLAS_COMPUTE_32F, no TF32 unless the
// context allows it). Attention of bf16/fp16 layers runs on tensor cores
// (attention_mma.cuh: bf16 operands, fp32 accumulation) where head_dim and
// the GPU allow it. Everything else (norms, RoPE, fp32 attention, SwiGLU,
// cross-entropy, embedding) is fp32 kernels in train_kernels.cu.
//
// Row-major products with a column-major library: a row-major [r, c] matrix
// is the column-major [c, r] matrix, its transpose, so row-major
// C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands
// and keep the transpose flags (gemm() below).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <new>
#include <vector>

#include "cuda/train/train_module_abi.h"
#include "train_kernels.cuh"

namespace k = strata_cuda_train;

struct strata_cuda_train_ctx_s {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  strata_cuda_train_dims_t d{};
  int64_t chunk = 0;  // logits rows per head chunk

  float *cos_t = nullptr, *sin_t = nullptr;
  // Saved by the forward (recomputed in backward): per token.
  float *rstd1 = nullptr, *rstd2 = nullptr, *n1 = nullptr, *q = nullptr, *k = nullptr, *v = nullptr;
  float *att = nullptr, *h = nullptr, *n2 = nullptr, *g = nullptr, *u = nullptr, *a = nullptr;
  float *lse = nullptr, *delta = nullptr;  // attention: per query row [B, heads, T]
  // Backward scratch.
  float *dbig = nullptr, *dh = nullptr, *datt = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;
  float *dn = nullptr, *partial = nullptr;
  // Qwen3's q/k norms: q and k before them, their rstd, gradient scratch.
  float *q_raw = nullptr, *k_raw = nullptr, *rstd_q = nullptr, *rstd_k = nullptr, *dq_raw = nullptr, *dk_raw = nullptr;
  // LoRA: x A^T [n, r] and its gradient, the adapter's output or scaled
  // output gradient [n, widest], the dropped-out input [n, widest].
  float *lora_xa = nullptr, *lora_dxa = nullptr, *lora_out = nullptr, *lora_xd = nullptr;
  float* logits = nullptr;  // [chunk, vocab]
  double* row_loss = nullptr;
  void* lp[2] = {nullptr, nullptr};  // activations rounded to the weights' dtype
  void* blas_ws = nullptr;
  size_t blas_ws_bytes = 0;
  strata_cuda_train_report_t* report = nullptr;
};

namespace {

using Ctx = strata_cuda_train_ctx_s;

constexpr size_t kBlasWorkspace = 32u << 20;  // cuBLAS's recommendation for Hopper
constexpr int64_t kLogitsElems = 1 << 24;     // fp32 logits of one head chunk: 64 MiB
static_assert(cudaErrorInvalidValue == STRATA_CUDA_ERR_INVALID_VALUE &&
                  cudaErrorMemoryAllocation == STRATA_CUDA_ERR_MEMORY_ALLOCATION,
              "cuda/module_abi.h's error codes are cudaError_t values");
static_assert(STRATA_CUDA_ERR_BLAS_BASE + CUBLAS_STATUS_ALLOC_FAILED == STRATA_CUDA_ERR_BLAS_ALLOC_FAILED,
              "cuda/module_abi.h's cuBLAS codes are STRATA_CUDA_ERR_BLAS_BASE + cublasStatus_t");

// Reports e, and clears the thread's last error so that it is not taken
// for a later launch's (train_kernels.cu); a sticky error comes back regardless.
int fail(cudaError_t e, const char* what, char* err, size_t err_len) {
  if (err && err_len) std::snprintf(err, err_len, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
  (void)cudaGetLastError();
  return static_cast<int>(e);
}
int blas_fail(cublasStatus_t s, const char* what, char* err, size_t err_len) {
  if (err && err_len) std::snprintf(err, err_len, "%s: %s (%s)", what, cublasGetStatusString(s), cublasGetStatusName(s));
  return STRATA_CUDA_ERR_BLAS_BASE + static_cast<int>(s);
}
int invalid(const char* what, char* err, size_t err_len) { return fail(cudaErrorInvalidValue, what, err, err_len); }
bool bad_dtype(int dtype) { return dtype < STRATA_CUDA_DTYPE_F32 || dtype > STRATA_CUDA_DTYPE_F16; }
// bf16/fp16 layers run attention on tensor cores (bf16 operands, as autocast
// does) unless the context asked for fp32 attention.
bool attention_tensor_cores(const Ctx* c, int dtype) {
  return dtype != STRATA_CUDA_DTYPE_F32 && !c->d.attention_fp32;
}

#define CUDA_TRY(expr)                                           \
  do {                                                           \
    cudaError_t _e = (expr);                                     \
    if (_e != cudaSuccess) return fail(_e, #expr, err, err_len); \
  } while (0)
#define BLAS_TRY(expr)                                                     \
  do {                                                                     \
    cublasStatus_t _s = (expr);                                            \
    if (_s != CUBLAS_STATUS_SUCCESS) return blas_fail(_s, #expr, err, err_len); \
  } while (0)
#define TRY(expr)             \
  do {                        \
    int _rc = (expr);         \
    if (_rc != 0) return _rc; \
  } while (0)

// ---- workspace: one block carved into 256-byte aligned pieces. With a null
// base it only counts (workspace_bytes).
struct Carver {
  char* base = nullptr;
  size_t used = 0;
  template <typename T>
  T* take(size_t count) {
    T* p = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += (std::max<size_t>(count, 1) * sizeof(T) + 255) & ~size_t{255};
    return p;
  }
};

int64_t logits_chunk(const strata_cuda_train_dims_t& d) {
  return std::min<int64_t>(d.max_tokens, std::max<int64_t>(1, kLogitsElems / d.vocab));
}

void carve(Ctx& c, Carver& cv) {
  const auto& d = c.d;
  const size_t n = static_cast<size_t>(d.max_tokens), S = static_cast<size_t>(d.max_seq);
  const size_t D = d.dim, Q = d.heads * d.head_dim, K = d.kv_heads * d.head_dim, F = d.ffn_dim, V = d.vocab;
  const size_t half = d.head_dim / 2;
  c.chunk = logits_chunk(d);
  c.cos_t = cv.take<float>(S * half);
  c.sin_t = cv.take<float>(S * half);
  c.rstd1 = cv.take<float>(n);
  c.rstd2 = cv.take<float>(n);
  c.n1 = cv.take<float>(n * D);
  c.q = cv.take<float>(n * Q);
  c.k = cv.take<float>(n * K);
  c.v = cv.take<float>(n * K);
  c.att = cv.take<float>(n * Q);
  c.h = cv.take<float>(n * D);
  c.n2 = cv.take<float>(n * D);
  c.g = cv.take<float>(n * F);
  c.u = cv.take<float>(n * F);
  c.a = cv.take<float>(n * F);
  // B*T <= n, so B*heads*T <= heads*n.
  c.lse = cv.take<float>(static_cast<size_t>(d.heads) * n);
  c.delta = cv.take<float>(static_cast<size_t>(d.heads) * n);
  c.dbig = cv.take<float>(n * F);
  c.dh = cv.take<float>(n * D);
  c.datt = cv.take<float>(n * Q);
  c.dq = cv.take<float>(n * Q);
  c.dk = cv.take<float>(n * K);
  c.dv = cv.take<float>(n * K);
  c.dn = cv.take<float>(n * D);
  // The RMSNorm weight-gradient partials: the layer norms' [n, D] and the
  // q/k norms' [n * heads, head_dim].
  const size_t R = k::kRmsPartialRows;
  c.partial = cv.take<float>(std::max((n + R - 1) / R * D, (n * d.heads + R - 1) / R * d.head_dim));
  const bool qkn = d.qk_norm != 0, lora = d.lora_targets != 0;
  c.q_raw = cv.take<float>(qkn ? n * Q : 0);
  c.k_raw = cv.take<float>(qkn ? n * K : 0);
  c.rstd_q = cv.take<float>(qkn ? n * d.heads : 0);
  c.rstd_k = cv.take<float>(qkn ? n * d.kv_heads : 0);
  c.dq_raw = cv.take<float>(qkn ? n * Q : 0);
  c.dk_raw = cv.take<float>(qkn ? n * K : 0);
  const size_t widest = std::max({D, Q, F});
  const size_t r = lora ? static_cast<size_t>(d.lora_rank) : 0;
  c.lora_xa = cv.take<float>(n * r);
  c.lora_dxa = cv.take<float>(n * r);
  c.lora_out = cv.take<float>(lora ? n * widest : 0);
  c.lora_xd = cv.take<float>(lora && d.lora_dropout > 0 ? n * widest : 0);
  c.logits = cv.take<float>(static_cast<size_t>(c.chunk) * V);
  c.row_loss = cv.take<double>(n);
  const size_t lp_elems = std::max(n * std::max({D, Q, F}), static_cast<size_t>(c.chunk) * V);
  c.lp[0] = cv.take<uint16_t>(lp_elems);
  c.lp[1] = cv.take<uint16_t>(lp_elems);
  c.report = cv.take<strata_cuda_train_report_t>(1);
  c.blas_ws_bytes = kBlasWorkspace;
  c.blas_ws = cv.take<char>(kBlasWorkspace);
}

int check_dims(const strata_cuda_train_dims_t* d, char* err, size_t err_len) {
  if (!d) return invalid("null dims", err, err_len);
  if (d->dim <= 0 || d->heads <= 0 || d->kv_heads <= 0 || d->head_dim <= 0 || d->head_dim % 2 != 0 ||
      d->heads % d->kv_heads != 0 || d->ffn_dim <= 0 || d->vocab <= 0 || d->max_tokens <= 0 || d->max_seq <= 0 ||
      d->max_seq > d->max_tokens || d->rms_eps <= 0 || d->rope_theta <= 0)
    return invalid("invalid model dims or capacities", err, err_len);
  // cuBLAS takes int sizes and leading dimensions; grids take 65535 heads.
  const int64_t widest = std::max({d->dim, d->heads * d->head_dim, d->ffn_dim, d->vocab});
  if (widest > INT_MAX || d->max_tokens > INT_MAX || d->heads > 65535 || d->head_dim > 1024 ||
      d->max_tokens / d->max_seq > 65535)
    return invalid("model dims beyond the kernels' limits (widths < 2^31, heads <= 65535, head_dim <= 1024, "
                   "batch <= 65535)",
                   err, err_len);
  if (d->lora_targets & ~0x7fu) return invalid("unknown LoRA target bits", err, err_len);
  if (d->lora_targets && (d->lora_rank < 1 || d->lora_rank > INT_MAX || !(d->lora_dropout >= 0.0f) ||
                          !(d->lora_dropout < 1.0f)))
    return invalid("LoRA needs a rank >= 1 and a dropout in [0, 1)", err, err_len);
  return 0;
}

// Whether the model has layer tensor t (dims' features).
bool has_tensor(const strata_cuda_train_dims_t& d, int t) {
  if (t < STRATA_CUDA_TRAIN_Q_BIAS) return true;
  if (t <= STRATA_CUDA_TRAIN_V_BIAS) return d.qkv_bias != 0;
  if (t <= STRATA_CUDA_TRAIN_K_NORM) return d.qk_norm != 0;
  return (d.lora_targets >> ((t - STRATA_CUDA_TRAIN_LORA_FIRST) / 2)) & 1u;
}

// LoRA targets in the ABI's order.
enum LoraTarget { kLoraQ, kLoraK, kLoraV, kLoraO, kLoraGate, kLoraUp, kLoraDown };
int lora_a(int target) { return STRATA_CUDA_TRAIN_LORA_FIRST + 2 * target; }
int lora_b(int target) { return STRATA_CUDA_TRAIN_LORA_FIRST + 2 * target + 1; }

// ---- GEMM

cudaDataType_t cuda_type(int dtype) {
  return dtype == STRATA_CUDA_DTYPE_BF16 ? CUDA_R_16BF : dtype == STRATA_CUDA_DTYPE_F16 ? CUDA_R_16F : CUDA_R_32F;
}

struct Mat {
  const void* p;
  int dtype;
  int64_t ld;  // row length of the row-major storage
};

// Row-major C[M, N] = op(A) op(B) + beta C, where op(A) is A stored [M, K]
// or, with ta, A^T with A stored [K, M]; the same for B.
int gemm(Ctx* c, bool ta, bool tb, int64_t M, int64_t N, int64_t K, Mat A, Mat B, float* C, int64_t ldc, float beta,
         char* err, size_t err_len) {
  const float alpha = 1.0f;
  const cublasComputeType_t compute = (A.dtype == STRATA_CUDA_DTYPE_F32 && c->d.allow_tf32)
                                          ? CUBLAS_COMPUTE_32F_FAST_TF32
                                          : CUBLAS_COMPUTE_32F;
  BLAS_TRY(cublasGemmEx(c->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N),
                        static_cast<int>(M), static_cast<int>(K), &alpha, B.p, cuda_type(B.dtype),
                        static_cast<int>(B.ld), A.p, cuda_type(A.dtype), static_cast<int>(A.ld), &beta, C, CUDA_R_32F,
                        static_cast<int>(ldc), compute, CUBLAS_GEMM_DEFAULT));
  return 0;
}

// An fp32 activation [rows, cols] as a GEMM operand in the weights' dtype:
// itself for fp32, else rounded into scratch slot `slot`.
int act(Ctx* c, const float* x, int64_t rows, int64_t cols, int dtype, int slot, Mat* out, char* err,
        size_t err_len) {
  if (dtype == STRATA_CUDA_DTYPE_F32) {
    *out = Mat{x, dtype, cols};
    return 0;
  }
  CUDA_TRY(k::cast_from_f32(c->lp[slot], dtype, x, static_cast<size_t>(rows * cols), c->stream));
  *out = Mat{c->lp[slot], dtype, cols};
  return 0;
}

// nn.Linear without bias, W [out, in]:
//   y[n, out] (beta) = x W^T;  dx[n, in] (beta) = dy W;  dW[out, in] = dy^T x.
int linear_fwd(Ctx* c, Mat x, const void* w, int dtype, int64_t n, int64_t in, int64_t out, float* y, float beta,
               char* err, size_t err_len) {
  return gemm(c, false, true, n, out, in, x, Mat{w, dtype, in}, y, out, beta, err, err_len);
}
int linear_bwd_x(Ctx* c, Mat dy, const void* w, int dtype, int64_t n, int64_t in, int64_t out, float* dx, float beta,
                 char* err, size_t err_len) {
  return gemm(c, false, false, n, in, out, dy, Mat{w, dtype, in}, dx, in, beta, err, err_len);
}
int linear_bwd_w(Ctx* c, Mat dy, Mat x, int64_t n, int64_t in, int64_t out, float* dw, float beta, char* err,
                 size_t err_len) {
  return gemm(c, true, false, out, in, n, dy, x, dw, in, beta, err, err_len);
}

// ---- the layer

// A tensor the model has without a pointer.
bool missing(const strata_cuda_train_dims_t& d, const void* const (&tensors)[STRATA_CUDA_TRAIN_LAYER_TENSORS]) {
  for (int t = 0; t < STRATA_CUDA_TRAIN_LAYER_TENSORS; ++t)
    if (has_tensor(d, t) && !tensors[t]) return true;
  return false;
}

int check_layer(const Ctx* c, const strata_cuda_train_layer_t* w, int64_t B, int64_t T, char* err, size_t err_len) {
  if (!w || missing(c->d, w->tensors)) return invalid("null layer weight", err, err_len);
  if (bad_dtype(w->dtype)) return invalid("weight dtype outside fp32/bf16/fp16", err, err_len);
  if (c->d.lora_targets && w->lora_dtype != STRATA_CUDA_DTYPE_F32)
    return invalid("LoRA adapters must be fp32", err, err_len);
  if (B < 1 || T < 1 || T > c->d.max_seq || B * T > c->d.max_tokens)
    return invalid("B, T beyond the workspace", err, err_len);
  return 0;
}

// ---- LoRA (fp32 adapters, fp32 GEMMs on the fp32 activations)

bool lora_on(const Ctx* c, int target) { return (c->d.lora_targets >> target) & 1u; }
bool lora_dropping(const Ctx* c, const strata_cuda_train_layer_t* w) {
  return w->lora_dropout_on && c->d.lora_dropout > 0.0f;
}

// The adapters' input: x, or its dropout in lora_xd.
int lora_input(Ctx* c, const strata_cuda_train_layer_t* w, int target, const float* x, int64_t n, int64_t in,
               const float** out, char* err, size_t err_len) {
  *out = x;
  if (!lora_dropping(c, w)) return 0;
  CUDA_TRY(k::lora_dropout(c->lora_xd, x, w->lora_seed, target, w->lora_row0 * static_cast<uint64_t>(in),
                           static_cast<size_t>(n * in), c->d.lora_dropout, false, c->stream));
  *out = c->lora_xd;
  return 0;
}

// y[n, out] += lora_B(lora_A(dropout(x))) * scaling.
int lora_fwd(Ctx* c, const strata_cuda_train_layer_t* w, int target, const float* x, float* y, int64_t n, int64_t in,
             int64_t out, char* err, size_t err_len) {
  if (!lora_on(c, target)) return 0;
  const int64_t r = c->d.lora_rank;
  const int f32 = STRATA_CUDA_DTYPE_F32;
  const float* xin = nullptr;
  TRY(lora_input(c, w, target, x, n, in, &xin, err, err_len));
  TRY(linear_fwd(c, Mat{xin, f32, in}, w->tensors[lora_a(target)], f32, n, in, r, c->lora_xa, 0.0f, err, err_len));
  TRY(linear_fwd(c, Mat{c->lora_xa, f32, r}, w->tensors[lora_b(target)], f32, n, r, out, c->lora_out, 0.0f, err,
                 err_len));
  CUDA_TRY(k::scale(y, c->lora_out, c->d.lora_scaling, static_cast<size_t>(n * out), true, c->stream));
  return 0;
}

// The adapters' gradients (null: frozen) for the projection's output
// gradient dy[n, out], and dx[n, in] += the input gradient through them.
int lora_bwd(Ctx* c, const strata_cuda_train_layer_t* w, const strata_cuda_train_layer_grads_t* g, int target,
             const float* x, const float* dy, float* dx, int64_t n, int64_t in, int64_t out, char* err,
             size_t err_len) {
  if (!lora_on(c, target)) return 0;
  const int64_t r = c->d.lora_rank;
  const int f32 = STRATA_CUDA_DTYPE_F32;
  const void* A = w->tensors[lora_a(target)];
  const void* Bw = w->tensors[lora_b(target)];
  const float* xin = nullptr;
  TRY(lora_input(c, w, target, x, n, in, &xin, err, err_len));
  TRY(linear_fwd(c, Mat{xin, f32, in}, A, f32, n, in, r, c->lora_xa, 0.0f, err, err_len));
  CUDA_TRY(k::scale(c->lora_out, dy, c->d.lora_scaling, static_cast<size_t>(n * out), false, c->stream));
  const Mat dys{c->lora_out, f32, out};
  if (float* gb = g->tensors[lora_b(target)])
    TRY(linear_bwd_w(c, dys, Mat{c->lora_xa, f32, r}, n, r, out, gb, 0.0f, err, err_len));
  TRY(linear_bwd_x(c, dys, Bw, f32, n, r, out, c->lora_dxa, 0.0f, err, err_len));
  if (float* ga = g->tensors[lora_a(target)])
    TRY(linear_bwd_w(c, Mat{c->lora_dxa, f32, r}, Mat{xin, f32, in}, n, in, r, ga, 0.0f, err, err_len));
  if (!lora_dropping(c, w))
    return linear_bwd_x(c, Mat{c->lora_dxa, f32, r}, A, f32, n, in, r, dx, 1.0f, err, err_len);
  // Through the dropout (stream order: the dA product above has read lora_xd).
  TRY(linear_bwd_x(c, Mat{c->lora_dxa, f32, r}, A, f32, n, in, r, c->lora_xd, 0.0f, err, err_len));
  CUDA_TRY(k::lora_dropout(dx, c->lora_xd, w->lora_seed, target, w->lora_row0 * static_cast<uint64_t>(in),
                           static_cast<size_t>(n * in), c->d.lora_dropout, true, c->stream));
  return 0;
}

// A weight gradient dW = dy^T x unless the weight is frozen (null).
int weight_grad(Ctx* c, float* dw, Mat dy, Mat x, int64_t n, int64_t in, int64_t out, char* err, size_t err_len) {
  return dw ? linear_bwd_w(c, dy, x, n, in, out, dw, 0.0f, err, err_len) : 0;
}

// Computes and keeps every activation the backward needs; y (may equal x)
// only when non-null.
int layer_run_forward(Ctx* c, const strata_cuda_train_layer_t* w, int64_t B, int64_t T, const float* x, float* y,
                      char* err, size_t err_len) {
  const auto& d = c->d;
  const int dt = w->dtype;
  const int64_t n = B * T, D = d.dim, Q = d.heads * d.head_dim, K = d.kv_heads * d.head_dim, F = d.ffn_dim;
  cudaStream_t s = c->stream;
  CUDA_TRY(k::rmsnorm_forward(x, w->tensors[STRATA_CUDA_TRAIN_INPUT_NORM], dt, c->n1, c->rstd1, n, D,
                              static_cast<float>(d.rms_eps), s));
  Mat x1;
  TRY(act(c, c->n1, n, D, dt, 0, &x1, err, err_len));
  TRY(linear_fwd(c, x1, w->tensors[STRATA_CUDA_TRAIN_Q_PROJ], dt, n, D, Q, c->q, 0.0f, err, err_len));
  TRY(linear_fwd(c, x1, w->tensors[STRATA_CUDA_TRAIN_K_PROJ], dt, n, D, K, c->k, 0.0f, err, err_len));
  TRY(linear_fwd(c, x1, w->tensors[STRATA_CUDA_TRAIN_V_PROJ], dt, n, D, K, c->v, 0.0f, err, err_len));
  if (d.qkv_bias) {  // Qwen2: q/k/v = n1 W^T + b
    CUDA_TRY(k::add_bias(c->q, w->tensors[STRATA_CUDA_TRAIN_Q_BIAS], dt, n, Q, s));
    CUDA_TRY(k::add_bias(c->k, w->tensors[STRATA_CUDA_TRAIN_K_BIAS], dt, n, K, s));
    CUDA_TRY(k::add_bias(c->v, w->tensors[STRATA_CUDA_TRAIN_V_BIAS], dt, n, K, s));
  }
  TRY(lora_fwd(c, w, kLoraQ, c->n1, c->q, n, D, Q, err, err_len));
  TRY(lora_fwd(c, w, kLoraK, c->n1, c->k, n, D, K, err, err_len));
  TRY(lora_fwd(c, w, kLoraV, c->n1, c->v, n, D, K, err, err_len));
  if (d.qk_norm) {  // Qwen3: RMSNorm over each head's head_dim, before RoPE
    CUDA_TRY(cudaMemcpyAsync(c->q_raw, c->q, static_cast<size_t>(n * Q) * sizeof(float), cudaMemcpyDeviceToDevice, s));
    CUDA_TRY(cudaMemcpyAsync(c->k_raw, c->k, static_cast<size_t>(n * K) * sizeof(float), cudaMemcpyDeviceToDevice, s));
    CUDA_TRY(k::rmsnorm_forward(c->q_raw, w->tensors[STRATA_CUDA_TRAIN_Q_NORM], dt, c->q, c->rstd_q, n * d.heads,
                                d.head_dim, static_cast<float>(d.rms_eps), s));
    CUDA_TRY(k::rmsnorm_forward(c->k_raw, w->tensors[STRATA_CUDA_TRAIN_K_NORM], dt, c->k, c->rstd_k, n * d.kv_heads,
                                d.head_dim, static_cast<float>(d.rms_eps), s));
  }
  CUDA_TRY(k::rope(c->q, n, T, d.heads, d.head_dim, c->cos_t, c->sin_t, false, s));
  CUDA_TRY(k::rope(c->k, n, T, d.kv_heads, d.head_dim, c->cos_t, c->sin_t, false, s));
  CUDA_TRY(k::attention_forward(c->q, c->k, c->v, c->att, c->lse, B, T, d.heads, d.kv_heads, d.head_dim,
                                attention_tensor_cores(c, dt), s));
  // h = x + o_proj(att): the residual first, the product added by cuBLAS (beta 1).
  CUDA_TRY(cudaMemcpyAsync(c->h, x, static_cast<size_t>(n * D) * sizeof(float), cudaMemcpyDeviceToDevice, s));
  Mat at;
  TRY(act(c, c->att, n, Q, dt, 0, &at, err, err_len));
  TRY(linear_fwd(c, at, w->tensors[STRATA_CUDA_TRAIN_O_PROJ], dt, n, Q, D, c->h, 1.0f, err, err_len));
  TRY(lora_fwd(c, w, kLoraO, c->att, c->h, n, Q, D, err, err_len));
  CUDA_TRY(k::rmsnorm_forward(c->h, w->tensors[STRATA_CUDA_TRAIN_POST_NORM], dt, c->n2, c->rstd2, n, D,
                              static_cast<float>(d.rms_eps), s));
  Mat x2;
  TRY(act(c, c->n2, n, D, dt, 0, &x2, err, err_len));
  TRY(linear_fwd(c, x2, w->tensors[STRATA_CUDA_TRAIN_GATE_PROJ], dt, n, D, F, c->g, 0.0f, err, err_len));
  TRY(linear_fwd(c, x2, w->tensors[STRATA_CUDA_TRAIN_UP_PROJ], dt, n, D, F, c->u, 0.0f, err, err_len));
  TRY(lora_fwd(c, w, kLoraGate, c->n2, c->g, n, D, F, err, err_len));
  TRY(lora_fwd(c, w, kLoraUp, c->n2, c->u, n, D, F, err, err_len));
  CUDA_TRY(k::swiglu_forward(c->g, c->u, c->a, static_cast<size_t>(n * F), s));
  if (!y) return 0;
  CUDA_TRY(cudaMemcpyAsync(y, c->h, static_cast<size_t>(n * D) * sizeof(float), cudaMemcpyDeviceToDevice, s));
  Mat am;
  TRY(act(c, c->a, n, F, dt, 0, &am, err, err_len));
  TRY(linear_fwd(c, am, w->tensors[STRATA_CUDA_TRAIN_DOWN_PROJ], dt, n, F, D, y, 1.0f, err, err_len));
  return lora_fwd(c, w, kLoraDown, c->a, y, n, F, D, err, err_len);
}

int layer_forward(Ctx* c, const strata_cuda_train_layer_t* w, int64_t B, int64_t T, const float* x_in, float* x_out,
                  char* err, size_t err_len) {
  TRY(check_layer(c, w, B, T, err, err_len));
  if (!x_in || !x_out) return invalid("null activation", err, err_len);
  CUDA_TRY(cudaSetDevice(c->device));
  return layer_run_forward(c, w, B, T, x_in, x_out, err, err_len);
}

int layer_backward(Ctx* c, const strata_cuda_train_layer_t* w, int64_t B, int64_t T, const float* x, const float* dy,
                   float* dx, const strata_cuda_train_layer_grads_t* g, char* err, size_t err_len) {
  TRY(check_layer(c, w, B, T, err, err_len));
  // A null gradient is a frozen tensor's: not computed.
  if (!x || !dy || !dx || !g) return invalid("null activation or gradient", err, err_len);
  CUDA_TRY(cudaSetDevice(c->device));
  TRY(layer_run_forward(c, w, B, T, x, nullptr, err, err_len));
  const auto& d = c->d;
  const int dt = w->dtype;
  const int64_t n = B * T, D = d.dim, Q = d.heads * d.head_dim, K = d.kv_heads * d.head_dim, F = d.ffn_dim;
  cudaStream_t s = c->stream;
  float* const* gt = g->tensors;
  // MLP: y = h + down(a), a = silu(g) * u.
  Mat dym, am;
  TRY(act(c, dy, n, D, dt, 0, &dym, err, err_len));
  TRY(linear_bwd_x(c, dym, w->tensors[STRATA_CUDA_TRAIN_DOWN_PROJ], dt, n, F, D, c->dbig, 0.0f, err, err_len));
  TRY(act(c, c->a, n, F, dt, 1, &am, err, err_len));
  TRY(weight_grad(c, gt[STRATA_CUDA_TRAIN_DOWN_PROJ], dym, am, n, F, D, err, err_len));
  TRY(lora_bwd(c, w, g, kLoraDown, c->a, dy, c->dbig, n, F, D, err, err_len));
  CUDA_TRY(k::swiglu_backward(c->g, c->u, c->dbig, static_cast<size_t>(n * F), s));  // g, u := dg, du
  Mat dgm, dum, x2;
  TRY(act(c, c->g, n, F, dt, 0, &dgm, err, err_len));
  TRY(linear_bwd_x(c, dgm, w->tensors[STRATA_CUDA_TRAIN_GATE_PROJ], dt, n, D, F, c->dn, 0.0f, err, err_len));
  TRY(act(c, c->n2, n, D, dt, 1, &x2, err, err_len));
  TRY(weight_grad(c, gt[STRATA_CUDA_TRAIN_GATE_PROJ], dgm, x2, n, D, F, err, err_len));
  TRY(act(c, c->u, n, F, dt, 0, &dum, err, err_len));
  TRY(linear_bwd_x(c, dum, w->tensors[STRATA_CUDA_TRAIN_UP_PROJ], dt, n, D, F, c->dn, 1.0f, err, err_len));
  TRY(weight_grad(c, gt[STRATA_CUDA_TRAIN_UP_PROJ], dum, x2, n, D, F, err, err_len));
  TRY(lora_bwd(c, w, g, kLoraGate, c->n2, c->g, c->dn, n, D, F, err, err_len));
  TRY(lora_bwd(c, w, g, kLoraUp, c->n2, c->u, c->dn, n, D, F, err, err_len));
  // dh = dy + d(post-attention norm)
  CUDA_TRY(k::rmsnorm_backward(c->h, w->tensors[STRATA_CUDA_TRAIN_POST_NORM], dt, c->rstd2, c->dn, dy, c->dh,
                               gt[STRATA_CUDA_TRAIN_POST_NORM], c->partial, n, D, s));
  // Attention: h = x + o(attn(rope(q), rope(k), v)).
  Mat dhm, atm;
  TRY(act(c, c->dh, n, D, dt, 0, &dhm, err, err_len));
  TRY(linear_bwd_x(c, dhm, w->tensors[STRATA_CUDA_TRAIN_O_PROJ], dt, n, Q, D, c->datt, 0.0f, err, err_len));
  TRY(act(c, c->att, n, Q, dt, 1, &atm, err, err_len));
  TRY(weight_grad(c, gt[STRATA_CUDA_TRAIN_O_PROJ], dhm, atm, n, Q, D, err, err_len));
  TRY(lora_bwd(c, w, g, kLoraO, c->att, c->dh, c->datt, n, Q, D, err, err_len));
  CUDA_TRY(k::attention_backward(c->q, c->k, c->v, c->att, c->lse, c->datt, c->delta, c->dq, c->dk, c->dv, B, T,
                                 d.heads, d.kv_heads, d.head_dim, attention_tensor_cores(c, dt), s));
  CUDA_TRY(k::rope(c->dq, n, T, d.heads, d.head_dim, c->cos_t, c->sin_t, true, s));
  CUDA_TRY(k::rope(c->dk, n, T, d.kv_heads, d.head_dim, c->cos_t, c->sin_t, true, s));
  float* dq = c->dq;
  float* dk = c->dk;
  if (d.qk_norm) {  // through the per-head norms to the projections' outputs
    CUDA_TRY(k::rmsnorm_backward(c->q_raw, w->tensors[STRATA_CUDA_TRAIN_Q_NORM], dt, c->rstd_q, c->dq, nullptr,
                                 c->dq_raw, gt[STRATA_CUDA_TRAIN_Q_NORM], c->partial, n * d.heads, d.head_dim, s));
    CUDA_TRY(k::rmsnorm_backward(c->k_raw, w->tensors[STRATA_CUDA_TRAIN_K_NORM], dt, c->rstd_k, c->dk, nullptr,
                                 c->dk_raw, gt[STRATA_CUDA_TRAIN_K_NORM], c->partial, n * d.kv_heads, d.head_dim, s));
    dq = c->dq_raw;
    dk = c->dk_raw;
  }
  if (d.qkv_bias) {
    if (gt[STRATA_CUDA_TRAIN_Q_BIAS]) CUDA_TRY(k::col_sum(dq, gt[STRATA_CUDA_TRAIN_Q_BIAS], n, Q, s));
    if (gt[STRATA_CUDA_TRAIN_K_BIAS]) CUDA_TRY(k::col_sum(dk, gt[STRATA_CUDA_TRAIN_K_BIAS], n, K, s));
    if (gt[STRATA_CUDA_TRAIN_V_BIAS]) CUDA_TRY(k::col_sum(c->dv, gt[STRATA_CUDA_TRAIN_V_BIAS], n, K, s));
  }
  Mat x1, dqm, dkm, dvm;
  TRY(act(c, c->n1, n, D, dt, 1, &x1, err, err_len));
  TRY(act(c, dq, n, Q, dt, 0, &dqm, err, err_len));
  TRY(linear_bwd_x(c, dqm, w->tensors[STRATA_CUDA_TRAIN_Q_PROJ], dt, n, D, Q, c->dn, 0.0f, err, err_len));
  TRY(weight_grad(c, gt[STRATA_CUDA_TRAIN_Q_PROJ], dqm, x1, n, D, Q, err, err_len));
  TRY(act(c, dk, n, K, dt, 0, &dkm, err, err_len));
  TRY(linear_bwd_x(c, dkm, w->tensors[STRATA_CUDA_TRAIN_K_PROJ], dt, n, D, K, c->dn, 1.0f, err, err_len));
  TRY(weight_grad(c, gt[STRATA_CUDA_TRAIN_K_PROJ], dkm, x1, n, D, K, err, err_len));
  TRY(act(c, c->dv, n, K, dt, 0, &dvm, err, err_len));
  TRY(linear_bwd_x(c, dvm, w->tensors[STRATA_CUDA_TRAIN_V_PROJ], dt, n, D, K, c->dn, 1.0f, err, err_len));
  TRY(weight_grad(c, gt[STRATA_CUDA_TRAIN_V_PROJ], dvm, x1, n, D, K, err, err_len));
  TRY(lora_bwd(c, w, g, kLoraQ, c->n1, dq, c->dn, n, D, Q, err, err_len));
  TRY(lora_bwd(c, w, g, kLoraK, c->n1, dk, c->dn, n, D, K, err, err_len));
  TRY(lora_bwd(c, w, g, kLoraV, c->n1, c->dv, c->dn, n, D, K, err, err_len));
  // dx = dh + d(input norm); dx may equal dy, which is no longer read.
  CUDA_TRY(k::rmsnorm_backward(x, w->tensors[STRATA_CUDA_TRAIN_INPUT_NORM], dt, c->rstd1, c->dn, c->dh, dx,
                               gt[STRATA_CUDA_TRAIN_INPUT_NORM], c->partial, n, D, s));
  return 0;
}

// ---- embedding and head

int embed_forward(Ctx* c, int dtype, const void* table, const int32_t* tokens, int64_t n, float* x_out, char* err,
                  size_t err_len) {
  if (!table || !tokens || !x_out) return invalid("null pointer", err, err_len);
  if (bad_dtype(dtype)) return invalid("weight dtype outside fp32/bf16/fp16", err, err_len);
  if (n < 1 || n > c->d.max_tokens) return invalid("token count beyond the workspace", err, err_len);
  CUDA_TRY(cudaSetDevice(c->device));
  CUDA_TRY(k::embed_forward(table, dtype, tokens, n, c->d.dim, c->d.vocab, x_out, &c->report->bad_ids, c->stream));
  return 0;
}

int embed_backward(Ctx* c, const int32_t* tokens, int64_t n, const float* dx, float* grad, int accumulate, char* err,
                   size_t err_len) {
  if (!tokens || !dx || !grad) return invalid("null pointer", err, err_len);
  if (n < 1 || n > c->d.max_tokens) return invalid("token count beyond the workspace", err, err_len);
  CUDA_TRY(cudaSetDevice(c->device));
  CUDA_TRY(k::embed_backward(tokens, n, dx, grad, c->d.dim, c->d.vocab, accumulate != 0, &c->report->bad_ids,
                             c->stream));
  return 0;
}

int head(Ctx* c, const strata_cuda_train_head_t* h, char* err, size_t err_len) {
  if (!h || !h->norm || !h->lm_head || !h->x) return invalid("null pointer", err, err_len);
  if (bad_dtype(h->dtype)) return invalid("weight dtype outside fp32/bf16/fp16", err, err_len);
  if (h->B < 1 || h->T < 1 || h->T > c->d.max_seq || h->B * h->T > c->d.max_tokens)
    return invalid("B, T beyond the workspace", err, err_len);
  const bool logits_only = h->logits != nullptr;
  const bool grad = !logits_only && h->dx != nullptr;
  if (!logits_only && !h->targets) return invalid("null targets", err, err_len);
  // grad_norm / grad_lm_head null: frozen, not computed.
  CUDA_TRY(cudaSetDevice(c->device));
  const auto& d = c->d;
  const int dt = h->dtype;
  const int64_t n = h->B * h->T, D = d.dim, V = d.vocab;
  cudaStream_t s = c->stream;
  CUDA_TRY(k::rmsnorm_forward(h->x, h->norm, dt, c->n1, c->rstd1, n, D, static_cast<float>(d.rms_eps), s));
  if (logits_only) {
    Mat xm;
    TRY(act(c, c->n1, n, D, dt, 0, &xm, err, err_len));
    return linear_fwd(c, xm, h->lm_head, dt, n, D, V, h->logits, 0.0f, err, err_len);
  }
  CUDA_TRY(k::ce_count(h->targets, h->mask, n, V, c->report, s));
  for (int64_t r0 = 0; r0 < n; r0 += c->chunk) {
    const int64_t rows = std::min(c->chunk, n - r0);
    Mat xm;
    TRY(act(c, c->n1 + r0 * D, rows, D, dt, 0, &xm, err, err_len));
    TRY(linear_fwd(c, xm, h->lm_head, dt, rows, D, V, c->logits, 0.0f, err, err_len));
    CUDA_TRY(k::cross_entropy(c->logits, h->targets + r0, h->mask ? h->mask + r0 : nullptr, rows, V, h->dloss, grad,
                              c->report, c->row_loss + r0, s));
    if (!grad) continue;
    Mat lm;
    TRY(act(c, c->logits, rows, V, dt, 1, &lm, err, err_len));
    TRY(linear_bwd_x(c, lm, h->lm_head, dt, rows, D, V, c->dn + r0 * D, 0.0f, err, err_len));
    if (h->grad_lm_head)
      TRY(linear_bwd_w(c, lm, xm, rows, D, V, h->grad_lm_head, r0 == 0 ? 0.0f : 1.0f, err, err_len));
  }
  CUDA_TRY(k::loss_sum(c->row_loss, n, c->report, s));
  if (grad)
    CUDA_TRY(k::rmsnorm_backward(h->x, h->norm, dt, c->rstd1, c->dn, nullptr, h->dx, h->grad_norm, c->partial, n, D,
                                 s));
  return 0;
}

// ---- context

int workspace_bytes(const strata_cuda_train_dims_t* dims, size_t* out, char* err, size_t err_len) {
  *out = 0;
  TRY(check_dims(dims, err, err_len));
  Ctx c;
  c.d = *dims;
  Carver cv;
  carve(c, cv);
  *out = cv.used;
  return 0;
}

// The RoPE tables as train/model_ops.h defines them: inv_freq in double
// rounded to float, angle = float(pos) * inv_freq in fp32 (as HF computes).
void rope_tables(const strata_cuda_train_dims_t& d, std::vector<float>& cos_t, std::vector<float>& sin_t) {
  const int64_t half = d.head_dim / 2;
  cos_t.resize(static_cast<size_t>(d.max_seq * half));
  sin_t.resize(cos_t.size());
  const float scale = d.rope_attention_scaling > 0 ? static_cast<float>(d.rope_attention_scaling) : 1.0f;
  for (int64_t i = 0; i < half; ++i) {
    const float inv_freq =
        d.rope_inv_freq ? d.rope_inv_freq[i]
                        : static_cast<float>(std::pow(d.rope_theta, -2.0 * static_cast<double>(i) /
                                                                        static_cast<double>(d.head_dim)));
    for (int64_t p = 0; p < d.max_seq; ++p) {
      const float angle = static_cast<float>(p) * inv_freq;
      cos_t[static_cast<size_t>(p * half + i)] = static_cast<float>(std::cos(static_cast<double>(angle))) * scale;
      sin_t[static_cast<size_t>(p * half + i)] = static_cast<float>(std::sin(static_cast<double>(angle))) * scale;
    }
  }
}

int ctx_destroy(Ctx* c, char* err, size_t err_len) {
  if (!c) return 0;
  int rc = 0;
  if (c->blas) {
    cudaSetDevice(c->device);
    cublasStatus_t st = cublasDestroy(c->blas);
    if (st != CUBLAS_STATUS_SUCCESS) rc = blas_fail(st, "cublasDestroy", err, err_len);
  }
  delete c;
  return rc;
}

int ctx_create(int device, void* stream, const strata_cuda_train_dims_t* dims, void* workspace, size_t ws_bytes,
               Ctx** out, char* err, size_t err_len) {
  *out = nullptr;
  size_t need = 0;
  TRY(workspace_bytes(dims, &need, err, err_len));
  if (!workspace || ws_bytes < need) return invalid("workspace missing or smaller than workspace_bytes()", err, err_len);
  CUDA_TRY(cudaSetDevice(device));
  Ctx* c = new (std::nothrow) Ctx;
  if (!c) return fail(cudaErrorMemoryAllocation, "context", err, err_len);
  c->device = device;
  c->stream = static_cast<cudaStream_t>(stream);
  c->d = *dims;
  c->d.rope_inv_freq = nullptr;  // the caller's array is read below, during this call only
  Carver cv;
  cv.base = static_cast<char*>(workspace);
  carve(*c, cv);
  std::vector<float> cos_t, sin_t;
  rope_tables(*dims, cos_t, sin_t);
  auto setup = [&]() -> int {
    BLAS_TRY(cublasCreate(&c->blas));
    BLAS_TRY(cublasSetStream(c->blas, c->stream));
    BLAS_TRY(cublasSetWorkspace(c->blas, c->blas_ws, c->blas_ws_bytes));
    BLAS_TRY(cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH));
    CUDA_TRY(cudaMemcpyAsync(c->cos_t, cos_t.data(), cos_t.size() * sizeof(float), cudaMemcpyHostToDevice, c->stream));
    CUDA_TRY(cudaMemcpyAsync(c->sin_t, sin_t.data(), sin_t.size() * sizeof(float), cudaMemcpyHostToDevice, c->stream));
    CUDA_TRY(cudaMemsetAsync(c->report, 0, sizeof(strata_cuda_train_report_t), c->stream));
    CUDA_TRY(cudaStreamSynchronize(c->stream));  // the host tables go out of scope
    return 0;
  };
  const int rc = setup();
  if (rc != 0) {
    char ignored[8];
    ctx_destroy(c, ignored, sizeof(ignored));
    return rc;
  }
  *out = c;
  return 0;
}

int report_copy_async(Ctx* c, strata_cuda_train_report_t* host_dst, char* err, size_t err_len) {
  if (!host_dst) return invalid("null report destination", err, err_len);
  CUDA_TRY(cudaSetDevice(c->device));
  CUDA_TRY(cudaMemcpyAsync(host_dst, c->report, sizeof(*host_dst), cudaMemcpyDeviceToHost, c->stream));
  CUDA_TRY(cudaMemsetAsync(&c->report->bad_ids, 0, sizeof(c->report->bad_ids), c->stream));
  return 0;
}

const char* attention_kernel(Ctx* c, int dtype) {
  if (cudaSetDevice(c->device) != cudaSuccess) {
    (void)cudaGetLastError();
    return "unknown (cudaSetDevice failed)";
  }
  return k::attention_kernel(!bad_dtype(dtype) && attention_tensor_cores(c, dtype), c->d.head_dim);
}

const strata_cuda_train_api_v1_t kApi = {
    sizeof(strata_cuda_train_api_v1_t),
    STRATA_CUDA_TRAIN_ABI_VERSION,
    workspace_bytes,
    ctx_create,
    ctx_destroy,
    embed_forward,
    embed_backward,
    layer_forward,
    layer_backward,
    head,
    report_copy_async,
    attention_kernel,
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const strata_cuda_train_api_v1_t* strata_cuda_train_api_v1(void) {
  return &kApi;
}
