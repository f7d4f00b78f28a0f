// LossScaler: fp16 loss scaling as DeepSpeed's DynamicLossScaler (or a fixed
// scale; 1 without fp16).
//
// Owns: the scale and the overflow bookkeeping (saved in engine checkpoints).
// Thread: the driving thread (step(), begin_micro_batch, checkpoints).
// Must not: decide whether a step is skipped; the stepper does, and calls
// update() once per step that had finite or non-finite gradients.
#pragma once

#include <cstdint>

#include "runtime/config.h"

namespace strata::engine {

struct LossScaler {
  bool dynamic = false;
  double scale = 1;
  int64_t iter = 0;
  int64_t last_overflow_iter = -1;
  int hysteresis = 1;  // remaining

  // The starting state for `f` (a fixed fp16.loss_scale, or dynamic from
  // 2^initial_scale_power); unchanged without fp16.
  void configure(const Fp16Config& f);
  // One step of the dynamic scaler: an overflow halves the scale once
  // `hysteresis` overflows were seen (never below min_loss_scale); a clean
  // step doubles it when the clean steps before it since the last overflow
  // are a positive multiple of loss_scale_window (DeepSpeed 0.19's
  // DynamicLossScaler.update_scale, step for step).
  void update(bool overflow, const Fp16Config& f);
};

}  // namespace strata::engine
