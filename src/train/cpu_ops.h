// CpuOps: ModelOps (train/model_ops.h) on the CPU.
//
// Matrix products are Eigen 3.4 GEMMs (train/gemm_eigen_impl.h), one build
// per x86 ISA chosen at run time through cpu_optim's ISA dispatch (avx512,
// avx2+fma, generic x86-64; STRATA_CPU_ISA forces one); everything else is
// plain C++ loops. Parallelism comes only from oneTBB: the ops run in their
// own tbb::task_arena of `threads` threads and split every loop into fixed
// blocks (train/cpu_kernels.h); Eigen's own threading is compiled out
// (EIGEN_DONT_PARALLELIZE), so TBB and Eigen never oversubscribe the cores.
// Results are bitwise identical for every thread count.
//
// Blocking: every call runs to completion on the calling thread plus the
// arena's workers. Thread-safety: one thread at a time per object (it owns
// one workspace); distinct objects are independent.
//
// Memory: create() allocates the activations of one layer for max_batch *
// max_seq tokens (attention adds one log-sum-exp per token and head; it is
// tiled, so no max_seq x max_seq matrix exists), the attention scratch (a few
// 64 x 64 tiles per arena thread, whatever max_seq is), the RoPE table
// (max_seq x head_dim) and the head's chunked logits. Weights in fp32 are used in place; bf16/fp16
// weights are converted into one buffer of max(layer_params, vocab*dim + dim)
// floats, allocated by the first call that needs it and reused after, so
// steady-state calls allocate nothing.
#pragma once

#include <memory>

#include "train/model_ops.h"

namespace strata::train {

// The GEMM kernel the float ops use here ("generic", "avx2", "avx512").
const char* cpu_ops_gemm_isa();

// create_cpu_ops(CpuOpsOptions) is declared in train/model_ops.h.

}  // namespace strata::train
