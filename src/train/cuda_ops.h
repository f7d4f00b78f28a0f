// CudaOps: ModelOps (train/model_ops.h) on a CUDA device, through the module
// libstrata_cuda_train.so (cuda/train/, ABI cuda/train/train_module_abi.h) that
// this file loads with dlopen at run time. Nothing here links CUDA: a CUDA
// build of Strata starts where no driver or cuBLAS exists and
// create_cuda_ops() then says why it cannot run (kUnavailable).
//
// Math: matrix products in cuBLAS; with bf16/fp16 weights both operands are
// in that dtype (fp32 activations are rounded to it just before the product)
// and cuBLAS accumulates in fp32 into fp32 results ("bf16 compute, fp32
// accumulation", like torch.autocast); with fp32 weights they are fp32 GEMMs
// without TF32 (unless allow_tf32). Attention with bf16/fp16 weights runs on
// tensor cores (bf16 q, k, v and probabilities, fp32 sums and softmax, as
// autocast does) where head_dim is 64 or 128 and the GPU is sm_80+. Norms,
// RoPE, fp32 attention, SwiGLU, the cross-entropy and the embedding are
// fp32 kernels. Agreement with CpuOps is
// checked (tests/train/cuda_ops_test.cpp) to 1e-4 normwise with fp32 weights
// and 2e-2 with bf16/fp16 weights (the activations' rounding); it is not bit
// equality. Every kernel sums in a
// fixed order (no floating-point atomics): results repeat run to run on the
// same GPU. The embedding gradient sums in token order, as the CPU does.
//
// Memory: create_cuda_ops() allocates one workspace from the backend's
// budgeted device pool (activations of one layer for max_batch * max_seq
// tokens, the attention's per-row log-sum-exp and delta, 2 x 4 * heads *
// max_tokens bytes, head logits in chunks of at most 2^24 values, the
// rounded-activation scratch and 32 MiB for cuBLAS) plus one small pinned
// buffer; calls allocate nothing. The attention is flash-attention style:
// no T x T matrix (the backward recomputes the probabilities from the
// log-sum-exp), so memory is linear in the sequence length. Unverified on a
// GPU: the kernels have never run (the gpu-labelled tests compare them with
// the CPU ops; the tensor-core attention's source also runs on the CPU
// under tests/cuda/simt_emulator.h).
//
// Asynchrony (device_backend.h's model): every pointer is device memory
// (tokens, targets and mask too) and every call only enqueues on the stream
// given at creation; Ok means the work was accepted. Two results come back
// only through the stream:
//   - LossStats: head_forward_backward / head_loss write *loss from a host
//     function when the stream gets there; read it after synchronizing the
//     stream, and keep it alive until then.
//   - Ids outside [0, vocab) (tokens; targets >= vocab) cannot be seen by the
//     call: the kernels treat them as zero rows / ignored positions and the
//     stream's next synchronize()/query() fails with kInvalidArgument naming
//     the op. The stream is then failed (sticky): destroy it.
// Argument errors that are visible on the host (sizes, null pointers,
// dtypes, dx aliasing x in the head) are returned by the call.
//
// Thread-safety: one thread drives one CudaOps (it owns one workspace). The
// backend and stream are not owned; they must outlive the ops.
#pragma once

#include <memory>
#include <string>

#include "device/device_backend.h"
#include "train/model_ops.h"

namespace strata::train {

struct CudaOpsOptions {
  LlamaDims dims;
  int64_t max_batch = 1;
  int64_t max_seq = 1;
  // fp32-weight GEMMs may use TF32 tensor cores (about 1e-3 relative error).
  bool allow_tf32 = false;
  // Layers with bf16/fp16 weights run attention on tensor cores (tiled,
  // bf16 operands and probabilities, fp32 accumulation and softmax, like
  // torch.autocast's attention) where head_dim is 64 or 128 and the GPU is
  // sm_80 or newer; true keeps them on the fp32 attention kernels.
  bool attention_fp32 = false;
};

// `backend` must be a CUDA backend (create_device_backend / create_cuda_backend)
// and `stream` one of its streams. Blocks while it creates the cuBLAS handle
// and uploads the RoPE tables. Errors: kUnavailable (no CUDA module, no GPU,
// libstrata_cuda_train.so or cuBLAS missing: the loader's reason),
// kInvalidArgument (dims, capacities, a host backend or a foreign stream),
// kOutOfBudget / kOutOfMemory (the workspace; the message says how much).
Result<std::unique_ptr<ModelOps>> create_cuda_ops(DeviceBackend& backend, DeviceStream* stream,
                                                  const CudaOpsOptions& options);

// Device bytes create_cuda_ops() would take for these options (the
// workspace), or why it cannot say (kUnavailable: module not loadable,
// kInvalidArgument: options). Loads the module.
Result<uint64_t> cuda_ops_workspace_bytes(const CudaOpsOptions& options);

// Which attention kernel `ops` (made by create_cuda_ops) runs for layers with
// weights in `dtype` on its device, in words: "tensor-core bf16 ..." or
// "fp32 ...". kInvalidArgument when `ops` is not CUDA ops.
Result<std::string> cuda_ops_attention_kernel(const ModelOps& ops, DType dtype);

// Loads libstrata_cuda_train.so once per process (thread-safe) and returns
// where it came from, or why not (kUnavailable). Search order: the directory
// libstrata_cuda.so was loaded from, the running executable's directory and
// its ../lib and ../cuda, then the dynamic linker's path.
Result<std::string> load_cuda_train_module();

}  // namespace strata::train
