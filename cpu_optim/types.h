// Plain enums and storage types shared by the public C++ interface and the
// per-ISA kernels. Freestanding on purpose (only <stdint.h>/<stddef.h>): the
// NEON kernel is compile-checked on x86 hosts with `clang --target=aarch64
// -ffreestanding`, where no aarch64 C++ library headers exist.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"

namespace strata::cpu_optim {

// Storage type of a buffer (common/dtype.h). Master parameters are always fp32.
using ::strata::DType;

enum class OptimizerKind : uint8_t {
  kAdamW = 0,    // torch.optim.AdamW: decoupled weight decay
  kAdam = 1,     // torch.optim.Adam: weight decay as L2 added to the gradient
  kAdagrad = 2,  // torch.optim.Adagrad
  kLion = 3,     // Chen et al. 2023 (EvoLved Sign Momentum), decoupled weight decay
  kSgd = 4,      // torch.optim.SGD with momentum, dampening, Nesterov
};

// How a state kept in bf16 is rounded when stored (fp32 states are exact).
//   kStochastic: up or down at random, with the probability that makes the
//     stored value unbiased (cpu_optim/stochastic_round.h): with
//     round-to-nearest, Adam's exp_avg_sq stops following gradients whose
//     square is below half an ulp of it. Opt-in: it costs a third of the
//     bf16 kernels' speed and showed no gain on a fine-tune (BENCHMARKS.md).
//   kNearest: round to nearest even, as PyTorch's bf16 state tensors (the
//     default).
enum class StateRounding : uint8_t { kStochastic = 0, kNearest = 1 };

// Instruction sets with a kernel. kAuto = the STRATA_CPU_ISA override if set,
// else the best one this CPU and OS support.
enum class Isa : uint8_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3, kNeon = 4 };

// 16-bit storage types. Distinct structs (not bare uint16_t) so that loads and
// stores overload on them and a bf16 buffer can never be read as fp16.
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

}  // namespace strata::cpu_optim
