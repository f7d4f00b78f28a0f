// Kernel launchers of the model-ops module (train_kernels.cu), called by
// train_module.cu. Each enqueues on `stream` and returns the launch error
// only. Layouts and semantics: train/model_ops.h (activations fp32 row-major
// [n = B*T, width], token (b, t) in row b*T + t). Weight pointers are in
// `dtype` (STRATA_CUDA_DTYPE_*). Every kernel is deterministic: no atomics on
// floating-point values, every sum in a fixed order.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/train/train_module_abi.h"

namespace strata_cuda_train {

// Rows per partial sum of the RMSNorm weight gradient (rmsnorm_backward's
// `partial` scratch holds ceil(n / kRmsPartialRows) * d floats).
constexpr int64_t kRmsPartialRows = 64;

// out[i, :] = table[tokens[i], :]; a token outside [0, vocab) gives a zero
// row and sets STRATA_CUDA_TRAIN_BAD_TOKEN_FWD in *bad.
cudaError_t embed_forward(const void* table, int dtype, const int32_t* tokens, int64_t n, int64_t d,
                          int64_t vocab, float* out, uint32_t* bad, cudaStream_t stream);
// grad[v, :] (=|+=) sum over i with tokens[i] == v of dx[i, :], in token
// order. Tokens outside [0, vocab) are skipped and flagged
// (STRATA_CUDA_TRAIN_BAD_TOKEN_BWD).
cudaError_t embed_backward(const int32_t* tokens, int64_t n, const float* dx, float* grad, int64_t d,
                           int64_t vocab, bool accumulate, uint32_t* bad, cudaStream_t stream);

// y = w * (x * rstd), rstd[r] = 1 / sqrt(mean(x[r]^2) + eps).
cudaError_t rmsnorm_forward(const float* x, const void* w, int dtype, float* y, float* rstd, int64_t n,
                            int64_t d, float eps, cudaStream_t stream);
// dx = residual + d/dx (residual may be null; dx may equal residual), dw
// overwritten (through `partial`; null: frozen, not computed).
cudaError_t rmsnorm_backward(const float* x, const void* w, int dtype, const float* rstd, const float* dy,
                             const float* residual, float* dx, float* dw, float* partial, int64_t n, int64_t d,
                             cudaStream_t stream);

// In place on x[n, heads*hd]; position of row r is r % T; cos/sin tables
// [max_seq, hd/2]. inverse: the transposed rotation (backward).
cudaError_t rope(float* x, int64_t n, int64_t T, int64_t heads, int64_t hd, const float* cos_table,
                 const float* sin_table, bool inverse, cudaStream_t stream);

// Causal GQA attention, flash-attention style (no T x T matrix). q, out
// [B*T, H*hd]; k, v [B*T, KVH*hd]; hd <= 1024. lse [B, H, T] receives each
// query row's log-sum-exp of its scaled scores (the backward recomputes the
// probabilities from it). tensor_cores: the tiled bf16 tensor-core kernels
// of attention_mma.cuh where they apply (head_dim 64 or 128, sm_80+), the
// fp32 kernels otherwise; the forward and the backward of one layer must
// pass the same value.
cudaError_t attention_forward(const float* q, const float* k, const float* v, float* out, float* lse, int64_t B,
                              int64_t T, int64_t H, int64_t KVH, int64_t hd, bool tensor_cores, cudaStream_t stream);
// From the forward's out and lse and dout: delta [B, H, T] scratch; dq, dk,
// dv overwritten.
cudaError_t attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                               const float* dout, float* delta, float* dq, float* dk, float* dv, int64_t B, int64_t T,
                               int64_t H, int64_t KVH, int64_t hd, bool tensor_cores, cudaStream_t stream);
// Which of the two kernels attention_forward runs with these arguments on the
// current device (a static string).
const char* attention_kernel(bool tensor_cores, int64_t hd);

// a = silu(g) * u.
cudaError_t swiglu_forward(const float* g, const float* u, float* a, size_t count, cudaStream_t stream);
// In place: g becomes dg, u becomes du.
cudaError_t swiglu_backward(float* g, float* u, const float* da, size_t count, cudaStream_t stream);

// y[n, cols] += b (broadcast over rows; b in dtype).
cudaError_t add_bias(float* y, const void* b, int dtype, int64_t n, int64_t cols, cudaStream_t stream);
// out[cols] = column sums of dy[n, cols], rows in order (a bias gradient).
cudaError_t col_sum(const float* dy, float* out, int64_t n, int64_t cols, cudaStream_t stream);
// dst = src * s, or dst += src * s with add.
cudaError_t scale(float* dst, const float* src, float s, size_t count, bool add, cudaStream_t stream);
// LoRA dropout: dst = src * keep / (1 - p) (keep drawn per (seed, target,
// first + element) exactly as the CPU ops draw it), or dst += that with add.
cudaError_t lora_dropout(float* dst, const float* src, uint64_t seed, int target, uint64_t first, size_t count, float p,
                         bool add, cudaStream_t stream);

// dst (dtype bf16/fp16) = round(src).
cudaError_t cast_from_f32(void* dst, int dtype, const float* src, size_t count, cudaStream_t stream);

// report->loss_count = positions that count (target >= 0, mask null or
// non-zero); a target >= vocab counts as ignored and sets
// STRATA_CUDA_TRAIN_BAD_TARGET.
cudaError_t ce_count(const int32_t* targets, const uint8_t* mask, int64_t n, int64_t vocab,
                     strata_cuda_train_report_t* report, cudaStream_t stream);
// Per row of logits [rows, vocab]: row_loss = lse - logit[target] (0 when
// ignored); with grad, logits become (dloss / report->loss_count) *
// (softmax - onehot) (0 rows when ignored or no position counts).
cudaError_t cross_entropy(float* logits, const int32_t* targets, const uint8_t* mask, int64_t rows, int64_t vocab,
                          float dloss, bool grad, const strata_cuda_train_report_t* report, double* row_loss,
                          cudaStream_t stream);
// report->loss_sum = sum of row_loss[0..n) in order, in double.
cudaError_t loss_sum(const double* row_loss, int64_t n, strata_cuda_train_report_t* report, cudaStream_t stream);

}  // namespace strata_cuda_train
