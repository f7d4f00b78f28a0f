#include "runtime/engine/loss_scaler.h"

#include <algorithm>
#include <cmath>

namespace strata::engine {

void LossScaler::configure(const Fp16Config& f) {
  if (!f.enabled) return;
  if (f.loss_scale > 0) {
    scale = f.loss_scale;
  } else {
    dynamic = true;
    scale = std::ldexp(1.0, f.initial_scale_power);
    hysteresis = f.hysteresis;
  }
}

void LossScaler::update(bool overflow, const Fp16Config& f) {
  if (overflow) {
    if (f.hysteresis <= 1 || hysteresis <= 1)
      scale = std::max(scale / 2, f.min_loss_scale);
    else
      --hysteresis;
    last_overflow_iter = iter;
  } else {
    if (f.consecutive_hysteresis) hysteresis = f.hysteresis;
    // DeepSpeed 0.19's rule: the clean steps since the last overflow (or the
    // start), this one not counted, a positive multiple of the window. So the
    // first doubling comes after window + 1 clean steps, and each next one
    // `window` steps later (apex/Megatron's older rule doubled one step
    // sooner).
    const int64_t stable = iter - last_overflow_iter - 1;
    if (stable > 0 && stable % f.loss_scale_window == 0) {
      if (!f.consecutive_hysteresis) hysteresis = f.hysteresis;
      scale *= 2;
    }
  }
  ++iter;
}

}  // namespace strata::engine
