// Learning-rate schedules: the learning rate of each optimizer step.
//
// `step` below is the number of optimizer steps already taken (0 for the
// first step), exactly as Hugging Face's LambdaLR schedulers count (their
// scheduler.step() runs after optimizer.step(), so step k uses lambda(k)).
// With W = warmup steps, N = total steps, lr = peak, m = min_lr:
//
//   warm-up (all kinds), step < W:  lr * step / max(1, W)
//     (HF get_*_schedule_with_warmup; with W > 0 the first step has lr 0)
//   constant:  lr                                         (get_constant_schedule_with_warmup)
//   linear:    m + (lr - m) * max(0, (N - step) / max(1, N - W))
//                                                          (get_linear_schedule_with_warmup;
//                                                           m = 0 is HF's exactly)
//   cosine:    m + (lr - m) * 0.5 * (1 + cos(pi * p)),  p = min(1, (step - W) / max(1, N - W))
//                                                          (get_cosine_with_min_lr_schedule_with_warmup,
//                                                           num_cycles 0.5; m = 0 is
//                                                           get_cosine_schedule_with_warmup)
// Steps past N keep the value at N (m for linear/cosine).
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string_view>

#include "common/status.h"

namespace strata::train {

enum class ScheduleKind : uint8_t { kConstant, kLinear, kCosine };
const char* schedule_kind_name(ScheduleKind k);  // "constant", "linear", "cosine"
// kInvalidArgument naming the text otherwise.
Result<ScheduleKind> parse_schedule_kind(std::string_view text);

struct Schedule {
  ScheduleKind kind = ScheduleKind::kCosine;
  double lr = 1e-3;      // peak learning rate
  double min_lr = 0.0;   // floor of the linear / cosine decay
  int64_t warmup = 0;    // W
  int64_t total = 1;     // N: the run's optimizer steps
};

// kInvalidArgument naming the field: lr <= 0 or not finite, min_lr < 0 or
// > lr, warmup < 0, total < 1, warmup > total.
Status validate_schedule(const Schedule& s);

// The learning rate for the optimizer step that follows `step` steps taken.
double schedule_lr(const Schedule& s, int64_t step);

}  // namespace strata::train
