// Causal GQA attention on tensor cores (attention_mma.cu): the kernels
// train_kernels.cu's attention_forward / attention_backward take when the
// layer's weights are bf16 or fp16 and the shape allows it. Same layouts and
// results as those (train_kernels.cuh): q, out, dq [B*T, H*hd]; k, v, dk, dv
// [B*T, KVH*hd]; lse and delta [B, H, T], lse the natural log-sum-exp of each
// query row's scaled scores.
//
// Numerics: q, k, v, dout and the probabilities P and dS are rounded to bf16
// (round to nearest even) as the tensor cores read them; every product
// accumulates in fp32, the softmax runs in fp32. That is what
// torch.autocast's bf16 attention does: relative 2^-9 per rounded operand,
// against the fp32 kernel's 2^-24. fp16 models get bf16 operands too (the
// range of fp16 activations is not guaranteed). Every sum runs in a fixed
// order (no atomics): the same bits on every run.
//
// Each call returns cudaErrorNotSupported, having launched nothing and left
// no error behind, when the shape or the device is outside what the kernels
// do: head_dim not 64 or 128, a device below compute capability 8.0 or a
// module built without sm_80+ code, B * ceil(T / 64) >= 2^31, heads > 65535,
// shared memory per block below what a head size needs (70 KiB at 128), or a
// pointer not 16-byte aligned. The caller then runs the fp32 kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace strata_cuda_train {

// Whether the tensor-core kernels run for this head size on the current
// device (the checks above, less the pointers'). No launch.
bool attention_mma_available(int64_t hd);

cudaError_t attention_mma_forward(const float* q, const float* k, const float* v, float* out, float* lse, int64_t B,
                                  int64_t T, int64_t H, int64_t KVH, int64_t hd, cudaStream_t stream);

// delta [B, H, T] is scratch (rowsum(dout * out)); dq, dk, dv overwritten.
cudaError_t attention_mma_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                                   const float* dout, float* delta, float* dq, float* dk, float* dv, int64_t B,
                                   int64_t T, int64_t H, int64_t KVH, int64_t hd, cudaStream_t stream);

}  // namespace strata_cuda_train
