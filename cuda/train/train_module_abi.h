// The ABI between the trainer (train/cuda_ops.cpp) and the CUDA model-ops
// module libstrata_cuda_train.so (cuda/train/).
//
// Why a second module rather than more entries in libstrata_cuda.so: the ops
// need cuBLAS (libcublas + libcublasLt, several hundred MiB that the dynamic
// linker maps and relocates at dlopen). The device backend is loaded by every
// CUDA build of Strata, including runs that only offload an optimizer or
// benchmark copies; keeping cuBLAS in its own module keeps it off that load
// path, so a machine with a driver and libcudart but no libcublas still gets
// the CUDA backend, and a missing libcublas is reported only to the trainer,
// as the reason create_cuda_ops() returns kUnavailable.
//
// Like cuda/module_abi.h: the module exports one C symbol,
// strata_cuda_train_api_v1, returning a table of plain C function pointers
// that starts with its size and ABI version; a loader reads only fields that
// lie within struct_size. Every function returns 0 on success or a nonzero
// STRATA_CUDA_ERR_* code (cuda/module_abi.h: a cudaError_t, or
// STRATA_CUDA_ERR_BLAS_BASE + a cublasStatus_t) and writes the text to err
// (NUL-terminated, truncated to err_len).
//
// Memory: the module allocates no device memory per call. The caller asks
// workspace_bytes() for a configuration, allocates that much device memory
// (from the device backend's budgeted pool) and hands it to ctx_create; the
// context carves its activation buffers, the attention scratch, the RoPE
// tables and cuBLAS's workspace out of it. cuBLAS's handle itself is created
// once per context.
//
// Streams: a context enqueues everything on the one cudaStream_t it was
// created with; calls only enqueue (kernel launch errors come back at once,
// errors of running work at the stream's synchronize). One thread drives a
// context at a time.
//
// Every activation is fp32 row-major [n = B*T, width]; weights are in
// `dtype` (STRATA_CUDA_DTYPE_*, cuda/module_abi.h) in Hugging Face's
// shapes; gradients are fp32 and overwritten (see train/model_ops.h, whose
// semantics these functions implement one for one).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "cuda/module_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

#define STRATA_CUDA_TRAIN_ABI_VERSION 5u

// Bits of strata_cuda_train_report_t::bad_ids.
#define STRATA_CUDA_TRAIN_BAD_TOKEN_FWD 1u  // embed_forward saw a token outside [0, vocab)
#define STRATA_CUDA_TRAIN_BAD_TOKEN_BWD 2u  // embed_backward saw one
#define STRATA_CUDA_TRAIN_BAD_TARGET 4u     // a target >= vocab (negative ones are ignored positions)

typedef struct strata_cuda_train_dims_s {
  int64_t dim, heads, kv_heads, head_dim, ffn_dim, vocab;
  double rms_eps, rope_theta;
  int64_t max_tokens;  // B*T capacity
  int64_t max_seq;     // T capacity
  int32_t allow_tf32;  // fp32 GEMMs may use TF32 tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32)
  // 0: layers with bf16/fp16 weights run attention on tensor cores (bf16
  // operands, fp32 accumulation: cuda/train/attention_mma.cuh) where head_dim
  // and the device allow it; 1: always the fp32 attention kernels.
  int32_t attention_fp32;
  // RoPE inverse frequencies (head_dim / 2 floats, model/rope.h), read only
  // during ctx_create; NULL: rope_theta^(-2i/head_dim). The cos/sin tables
  // are multiplied by rope_attention_scaling (1 except yarn).
  const float* rope_inv_freq;
  double rope_attention_scaling;
  // Architecture features (the layer tensors they bring are given only when
  // set): Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm before RoPE.
  int32_t qkv_bias, qk_norm;
  // LoRA (train/lora.h): a bit per adapted projection (Q, K, V, O, GATE, UP,
  // DOWN, in that order; 0: none), the rank, y += lora_B(lora_A(dropout(x)))
  // * lora_scaling, dropout probability on the adapters' input.
  uint32_t lora_targets;
  int32_t lora_reserved;
  int64_t lora_rank;
  float lora_scaling, lora_dropout;
} strata_cuda_train_dims_t;

// Device-side results, copied to the host by report_copy_async. Same layout
// on both sides (no padding surprises: 8 + 8 + 4 + 4).
typedef struct strata_cuda_train_report_s {
  double loss_sum;     // last head call: sum of the per-position losses (position order, double)
  int64_t loss_count;  // positions that counted
  uint32_t bad_ids;    // STRATA_CUDA_TRAIN_BAD_* seen since the last report_copy_async
  uint32_t reserved;
} strata_cuda_train_report_t;

// The tensors of one decoder layer, in the order of the weight table
// (model/llama_weights.h's LayerTensor; train/cuda_ops.cpp static_asserts
// that every value matches).
enum strata_cuda_train_layer_tensor {
  STRATA_CUDA_TRAIN_INPUT_NORM = 0,  // input_layernorm [dim]
  STRATA_CUDA_TRAIN_Q_PROJ,          // [heads*head_dim, dim]
  STRATA_CUDA_TRAIN_K_PROJ,          // [kv_heads*head_dim, dim]
  STRATA_CUDA_TRAIN_V_PROJ,          // [kv_heads*head_dim, dim]
  STRATA_CUDA_TRAIN_O_PROJ,          // [dim, heads*head_dim]
  STRATA_CUDA_TRAIN_POST_NORM,       // post_attention_layernorm [dim]
  STRATA_CUDA_TRAIN_GATE_PROJ,       // [ffn_dim, dim]
  STRATA_CUDA_TRAIN_UP_PROJ,         // [ffn_dim, dim]
  STRATA_CUDA_TRAIN_DOWN_PROJ,       // [dim, ffn_dim]
  STRATA_CUDA_TRAIN_Q_BIAS,          // qkv_bias: [heads*head_dim]
  STRATA_CUDA_TRAIN_K_BIAS,          // [kv_heads*head_dim]
  STRATA_CUDA_TRAIN_V_BIAS,          // [kv_heads*head_dim]
  STRATA_CUDA_TRAIN_Q_NORM,          // qk_norm: [head_dim]
  STRATA_CUDA_TRAIN_K_NORM,          // [head_dim]
  STRATA_CUDA_TRAIN_LORA_FIRST,      // LoRA: (A [r, in], B [out, r]) per projection, Q..DOWN order
  STRATA_CUDA_TRAIN_LAYER_TENSORS = STRATA_CUDA_TRAIN_LORA_FIRST + 14
};

typedef struct strata_cuda_train_layer_s {
  int dtype;       // the model's tensors
  int lora_dtype;  // the adapters' (fp32)
  // LoRA dropout of this call: on (training) with this seed; the forward and
  // the backward of one micro-batch pass the same seed.
  int lora_dropout_on;
  int reserved;
  uint64_t lora_seed;
  // The micro-batch's first token row in the whole run: the mask of element
  // (row, i) of an adapter's input of width `in` is drawn at index
  // (lora_row0 + row) * in + i.
  uint64_t lora_row0;
  // Indexed by strata_cuda_train_layer_tensor; tensors the model does not
  // have (dims' features) are NULL.
  const void* tensors[STRATA_CUDA_TRAIN_LAYER_TENSORS];
} strata_cuda_train_layer_t;

// NULL for a tensor the model has: frozen (its gradient is not computed).
typedef struct strata_cuda_train_layer_grads_s {
  float* tensors[STRATA_CUDA_TRAIN_LAYER_TENSORS];  // indexed by strata_cuda_train_layer_tensor
} strata_cuda_train_layer_grads_t;

// One head call: forward only (dx == NULL: loss), forward and backward
// (dx != NULL: loss, dx, grad_norm, grad_lm_head), or logits only
// (logits != NULL: targets, mask, dx ignored).
typedef struct strata_cuda_train_head_s {
  int dtype;
  const void* norm;
  const void* lm_head;
  const float* x;
  const int32_t* targets;  // device
  const uint8_t* mask;     // device or NULL
  int64_t B, T;
  float dloss;
  float* dx;
  float* grad_norm;     // NULL: frozen
  float* grad_lm_head;  // NULL: frozen
  float* logits;
} strata_cuda_train_head_t;

typedef struct strata_cuda_train_ctx_s strata_cuda_train_ctx_t;  // opaque

typedef struct strata_cuda_train_api_v1_s {
  uint32_t struct_size;  // sizeof(strata_cuda_train_api_v1_t) of the module
  uint32_t abi_version;  // STRATA_CUDA_TRAIN_ABI_VERSION of the module

  // Bytes of device workspace a context of these dims needs (256-byte aligned
  // pieces included). Pure arithmetic; no CUDA call.
  int (*workspace_bytes)(const strata_cuda_train_dims_t* dims, size_t* out, char* err, size_t err_len);
  // Creates the cuBLAS handle (bound to `stream`, workspace set), carves
  // `workspace` (device memory of workspace_bytes(dims) bytes, owned by the
  // caller, valid until ctx_destroy) and uploads the RoPE tables. Blocks
  // until the upload is done (once, at creation).
  int (*ctx_create)(int device, void* stream, const strata_cuda_train_dims_t* dims, void* workspace,
                    size_t workspace_bytes, strata_cuda_train_ctx_t** out, char* err, size_t err_len);
  // Destroys the cuBLAS handle. The caller synchronizes the stream first and
  // frees the workspace after.
  int (*ctx_destroy)(strata_cuda_train_ctx_t* ctx, char* err, size_t err_len);

  int (*embed_forward)(strata_cuda_train_ctx_t* ctx, int dtype, const void* table, const int32_t* tokens,
                       int64_t n, float* x_out, char* err, size_t err_len);
  int (*embed_backward)(strata_cuda_train_ctx_t* ctx, const int32_t* tokens, int64_t n, const float* dx,
                        float* grad, int accumulate, char* err, size_t err_len);
  int (*layer_forward)(strata_cuda_train_ctx_t* ctx, const strata_cuda_train_layer_t* w, int64_t B, int64_t T,
                       const float* x_in, float* x_out, char* err, size_t err_len);
  int (*layer_backward)(strata_cuda_train_ctx_t* ctx, const strata_cuda_train_layer_t* w, int64_t B, int64_t T,
                        const float* x_in, const float* dy, float* dx, const strata_cuda_train_layer_grads_t* g,
                        char* err, size_t err_len);
  int (*head)(strata_cuda_train_ctx_t* ctx, const strata_cuda_train_head_t* args, char* err, size_t err_len);
  // Enqueues a copy of the context's report to `host_dst` (pinned host
  // memory, sizeof(strata_cuda_train_report_t)) and then clears bad_ids.
  int (*report_copy_async)(strata_cuda_train_ctx_t* ctx, strata_cuda_train_report_t* host_dst, char* err,
                           size_t err_len);
  // ABI 4: which attention kernel layer calls with weights in `dtype` run on
  // this context's device (a static string, never NULL).
  const char* (*attention_kernel)(strata_cuda_train_ctx_t* ctx, int dtype);
} strata_cuda_train_api_v1_t;

typedef const strata_cuda_train_api_v1_t* (*strata_cuda_train_api_v1_fn)(void);
#define STRATA_CUDA_TRAIN_API_SYMBOL "strata_cuda_train_api_v1"

#ifdef __cplusplus
}
#endif
