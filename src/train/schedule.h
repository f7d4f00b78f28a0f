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
//
// DeepSpeed's warm-up schedules (a DeepSpeed config's "scheduler" section;
// deepspeed.runtime.lr_schedules 0.19.8, as strata.torch's lr_schedules.py),
// with i = step - 1 (DeepSpeed's last_batch_iteration when the optimizer
// step that follows `step` steps runs: the engine steps its scheduler after
// each optimizer step, starting from -1), W = max(2, warmup_num_steps) and
// g = log(i + 1) / log(W) ("log" warm-up) or i / W ("linear"):
//   WarmupLR:        i < 0: min;  i < W: min + (max - min) * g;  then max
//   WarmupDecayLR:   as WarmupLR, then min + (max - min) *
//                    max(0, (T - i) / max(1, T - W))   (T = total_num_steps)
//   WarmupCosineLR:  lr * ratio, lr the optimizer's; i < 0: 0; i < W:
//                    wmr + g * (1 - wmr); then max(0, cmr + (1 - cmr) *
//                    (1 + cos(pi * min(1, (i - W + 1) / max(1, T - W)))) / 2)
// (min/max: warmup_min_lr/warmup_max_lr; wmr/cmr: warmup_min_ratio,
// cos_min_ratio). Unlike DeepSpeed, a step skipped for non-finite gradients
// (fp16 overflow) still advances the schedule, as it does for the kinds above.
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string_view>

#include "common/status.h"

namespace strata::train {

enum class ScheduleKind : uint8_t { kConstant, kLinear, kCosine, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR };
// "constant", "linear", "cosine", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"
const char* schedule_kind_name(ScheduleKind k);
// kInvalidArgument naming the text otherwise.
Result<ScheduleKind> parse_schedule_kind(std::string_view text);

struct Schedule {
  ScheduleKind kind = ScheduleKind::kCosine;
  double lr = 1e-3;      // peak learning rate
  double min_lr = 0.0;   // floor of the linear / cosine decay
  int64_t warmup = 0;    // W
  int64_t total = 1;     // N: the run's optimizer steps
  // The DeepSpeed kinds' parameters (lr above: WarmupCosineLR's peak).
  struct DeepSpeed {
    double warmup_min_lr = 0.0, warmup_max_lr = 0.001;
    int64_t warmup_num_steps = 1000;
    bool log_warmup = true;  // warmup_type "log"; false: "linear"
    double total_num_steps = 0;
    double warmup_min_ratio = 0.0, cos_min_ratio = 0.0001;
    // The peak is the optimizer's lr (WarmupLR without warmup_max_lr,
    // WarmupCosineLR); false: the section sets it (then --lr has no say).
    bool peak_is_optimizer_lr = false;
    bool operator==(const DeepSpeed&) const = default;
  } ds;
};

// True for the DeepSpeed kinds.
bool is_deepspeed_schedule(ScheduleKind k);

// A DeepSpeed config's "scheduler" section (its JSON) as a Schedule, with
// DeepSpeed's parameter names and defaults; `optimizer_lr` is the
// optimizer's lr (WarmupLR's default warmup_max_lr, WarmupCosineLR's peak).
// Refused by name (kInvalidArgument "scheduler...: why"): a type other than
// the three above (OneCycle and LRRangeTest are strata.torch's only), an
// unknown key, "auto" (a Hugging Face Trainer placeholder), per-group
// lists, a last_batch_iteration other than -1, a missing total_num_steps,
// warmup_min_lr/warmup_max_lr on WarmupCosineLR (DeepSpeed refuses them
// too), values of the wrong type or range.
Result<Schedule> parse_deepspeed_scheduler(std::string_view json_text, double optimizer_lr);

// kInvalidArgument naming the field: lr <= 0 or not finite, min_lr < 0 or
// > lr, warmup < 0, total < 1, warmup > total (the DeepSpeed kinds: their
// parameters are checked by parse_deepspeed_scheduler; only total here).
Status validate_schedule(const Schedule& s);

// The learning rate for the optimizer step that follows `step` steps taken.
double schedule_lr(const Schedule& s, int64_t step);

}  // namespace strata::train
