// Plain scalar references for the optimizers, written from PyTorch's
// formulas in double precision, for tests (and as readable documentation of
// the math). Not vectorized, not parallel, not fast.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"
#include "cpu_optim/optimizer.h"

namespace strata::cpu_optim {

// One parameter with its states, in double.
struct RefElement {
  double p = 0.0;
  double s[3] = {0.0, 0.0, 0.0};  // state slots as in StepBuffers::state
};

// What a test needs to judge the result of one element's step.
struct RefDetail {
  double g = 0.0;        // the gradient actually used (scaled, with L2 term)
  double update = 0.0;   // the term subtracted from the (decayed) parameter
  double lion_c = 0.0;   // Lion: the argument of sign()
};

// One step of one element in double. `grad` is the raw gradient (before
// grad_scale/maximize). Constants computed in double, as step() does.
void reference_step_element(const OptimizerConfig& config, std::int64_t step, double grad, RefElement& e,
                            RefDetail* detail = nullptr);

// reference_step_element over buffers in their storage dtypes: values are
// read, updated in double and written back rounded to nearest even (double ->
// fp32 -> bf16/fp16 for 16-bit storage), except bf16 states with
// StateRounding::kStochastic: double -> fp32, then stochastically to bf16 with
// the random bits step() uses (stochastic_round.h), element by element from
// index_base + i. Same validation as step().
Status reference_step(const OptimizerConfig& config, std::int64_t step, const StepBuffers& buffers,
                      std::size_t count);

// Sum of (scale*g)^2 in long double, and whether any g is inf/NaN.
GradStats reference_grad_stats(const void* grads, DType dtype, std::size_t count, double scale);

}  // namespace strata::cpu_optim
