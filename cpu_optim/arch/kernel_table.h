// The contract between the dispatcher and one ISA's kernels: a table of plain
// function pointers (ggml-style), one table per arch/ directory. Internal.
// Freestanding (see types.h).
#pragma once

#include "cpu_optim/types.h"

namespace strata::cpu_optim::detail {

// Everything one step needs, with the per-call constants already computed in
// double (optimizer.cpp) and rounded once to float. Every kernel applies them
// in the same order, so all ISAs give the same bits (see kernels_impl.h).
struct StepArgs {
  OptimizerKind kind;
  DType grad_dtype;
  DType state_dtype;
  DType out_dtype;   // meaningful only when out != nullptr
  bool amsgrad;      // Adam/AdamW: state[2] holds max_exp_avg_sq
  bool l2;           // Adam/Adagrad/SGD: add weight_decay * p to the gradient
  bool decoupled_wd; // AdamW/Lion with weight_decay != 0: p -= lr*wd*p
  bool has_momentum; // SGD: momentum != 0 (state[0] is the momentum buffer)
  bool nesterov;     // SGD
  bool first_step;   // SGD: step == 1, the momentum buffer starts as the gradient
  bool stream_out;   // write params_out with non-temporal stores (it is 64-byte aligned)
  // bf16 states: stochastic rounding (stochastic_round.h), else round to
  // nearest even. The random bits of element i of the buffers are
  // rounding_bits(sr_key[slot], sr_lo0 + i): sr_lo0 is the low word of the
  // global index of element 0, and sr_key[] holds for every element of the
  // call (optimizer.cpp never lets a call straddle a 2^32 boundary).
  bool sr_states;
  uint32_t sr_lo0;
  uint32_t sr_key[3];

  float* params;
  const void* grads;
  void* state[3];
  void* out;

  float grad_scale;    // 1/loss_scale * 1/accumulation * clip coefficient, negated for maximize
  float weight_decay;  // L2 coefficient
  // -(lr * weight_decay), for decoupled decay (AdamW, Lion) applied as
  // p = fma(-lr*wd, p, p) rather than p * (1 - lr*wd): 1 - 1e-5 rounded to
  // fp32 is off by up to 2^-25 relative, which compounds to 3e-5 over 1000
  // steps; -lr*wd itself rounds to within 2^-24 of a tiny number.
  float neg_lr_wd;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float neg_step_size;  // Adam: -lr / (1 - beta1^t); Adagrad: -lr / (1 + (t-1) lr_decay); Lion/SGD: -lr
  float inv_sqrt_bc2;   // Adam: 1 / sqrt(1 - beta2^t)
  float momentum;       // SGD
  float one_minus_dampening;
};

// Updates elements [begin, end) of the buffers in args.
using StepFn = void (*)(const StepArgs& args, size_t begin, size_t end);
// Sum of squares of grads[begin, end) in double, accumulated into 16 lanes
// (element begin+i into lane i % 16, in index order) that are then combined
// by a fixed pairwise tree: the result is the same on every ISA.
using SumSqFn = double (*)(const void* grads, size_t begin, size_t end);
// Gradient accumulation: dst[i] = float(src[i]) (first) or dst[i] + float(src[i])
// over [begin, end), returning the sum of squares of the new dst[begin, end)
// exactly as SumSqFn over them would (same lanes, same order).
using AccumFn = double (*)(float* dst, const void* src, size_t begin, size_t end, bool first);
// dst[begin, end) = round(src[begin, end)) to bf16 or fp16.
using ConvertFn = void (*)(const float* src, void* dst, size_t begin, size_t end);
// b[i] += s * c[i] over [begin, end): the memory-bandwidth ceiling kernel.
using MembwFn = void (*)(float* b, const float* c, float s, size_t begin, size_t end);

struct KernelTable {
  const char* name;
  StepFn (*select_step)(const StepArgs& args);  // never null for valid args
  SumSqFn sumsq[3];                             // by DType
  AccumFn accumulate[3];                        // by the source's DType
  ConvertFn convert[3];                         // by DType; [kF32] is null
  MembwFn membw;
};

// Defined by arch/<isa>/kernels.cpp when that directory is compiled in.
extern const KernelTable kScalarKernels;
extern const KernelTable kAvx2Kernels;
extern const KernelTable kAvx512Kernels;
extern const KernelTable kNeonKernels;

}  // namespace strata::cpu_optim::detail
