// Learning-rate schedules against the Hugging Face formulas (schedule.h),
// evaluated here independently in double; tolerance 1e-12 relative.
#include "train/schedule.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

namespace strata::train {
namespace {

TEST(Schedule, ConstantWithWarmup) {
  Schedule s{.kind = ScheduleKind::kConstant, .lr = 1e-3, .min_lr = 0, .warmup = 4, .total = 10, .ds = {}};
  ASSERT_TRUE(validate_schedule(s).ok());
  EXPECT_EQ(schedule_lr(s, 0), 0.0);  // HF: the first step of a warm-up has lr 0
  EXPECT_DOUBLE_EQ(schedule_lr(s, 1), 0.25e-3);
  EXPECT_DOUBLE_EQ(schedule_lr(s, 3), 0.75e-3);
  EXPECT_DOUBLE_EQ(schedule_lr(s, 4), 1e-3);
  EXPECT_DOUBLE_EQ(schedule_lr(s, 9), 1e-3);
  s.warmup = 0;
  EXPECT_DOUBLE_EQ(schedule_lr(s, 0), 1e-3);
}

TEST(Schedule, LinearDecay) {
  Schedule s{.kind = ScheduleKind::kLinear, .lr = 2.0, .min_lr = 0, .warmup = 2, .total = 10, .ds = {}};
  EXPECT_DOUBLE_EQ(schedule_lr(s, 1), 1.0);
  EXPECT_DOUBLE_EQ(schedule_lr(s, 2), 2.0);
  // HF: max(0, (N - step) / (N - W)).
  EXPECT_DOUBLE_EQ(schedule_lr(s, 6), 2.0 * 4.0 / 8.0);
  EXPECT_DOUBLE_EQ(schedule_lr(s, 10), 0.0);
  EXPECT_DOUBLE_EQ(schedule_lr(s, 50), 0.0);  // past the end: stays at the floor
  s.min_lr = 0.5;
  EXPECT_DOUBLE_EQ(schedule_lr(s, 6), 0.5 + 1.5 * 0.5);
  EXPECT_DOUBLE_EQ(schedule_lr(s, 10), 0.5);
}

TEST(Schedule, CosineDecay) {
  Schedule s{.kind = ScheduleKind::kCosine, .lr = 1.0, .min_lr = 0.1, .warmup = 10, .total = 110, .ds = {}};
  EXPECT_DOUBLE_EQ(schedule_lr(s, 5), 0.5);
  EXPECT_DOUBLE_EQ(schedule_lr(s, 10), 1.0);
  for (int64_t step : {10, 20, 35, 60, 85, 109, 110}) {
    const double p = (step - 10) / 100.0;
    const double want = 0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * p));
    EXPECT_NEAR(schedule_lr(s, step), want, 1e-12 * want) << step;
  }
  EXPECT_NEAR(schedule_lr(s, 60), 0.55, 1e-12);  // half way: the mean of peak and floor
  EXPECT_NEAR(schedule_lr(s, 200), 0.1, 1e-12);
}

TEST(Schedule, Validation) {
  Schedule s;
  s.total = 10;
  EXPECT_TRUE(validate_schedule(s).ok());
  s.lr = 0;
  EXPECT_FALSE(validate_schedule(s).ok());
  s.lr = 1e-3;
  s.min_lr = 1e-2;
  EXPECT_FALSE(validate_schedule(s).ok());
  s.min_lr = 0;
  s.warmup = 11;
  EXPECT_NE(validate_schedule(s).message().find("warm-up"), std::string::npos);
  s.warmup = 0;
  s.total = 0;
  EXPECT_FALSE(validate_schedule(s).ok());
  EXPECT_FALSE(parse_schedule_kind("exp").ok());
  EXPECT_EQ(parse_schedule_kind("linear").value(), ScheduleKind::kLinear);
  EXPECT_FALSE(parse_schedule_kind("WarmupLR").ok());  // a config section's, not --schedule's
}

// DeepSpeed's sections (schedule.h; ds_scheduler_reference compares them with
// DeepSpeed's own classes bit for bit): step k's lr is DeepSpeed's at batch
// k - 1, starting from -1.
TEST(Schedule, DeepSpeedSections) {
  auto s = parse_deepspeed_scheduler(
      R"({"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0001, "warmup_max_lr": 0.003,
          "warmup_num_steps": 3, "total_num_steps": 6, "warmup_type": "linear"}})",
      2e-3);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  const double want[] = {1e-4, 1e-4, 1e-4 + 2.9e-3 / 3, 1e-4 + 2.9e-3 * 2 / 3, 3e-3, 1e-4 + 2.9e-3 * 2 / 3,
                         1e-4 + 2.9e-3 / 3, 1e-4, 1e-4};
  for (int k = 0; k < 9; ++k) EXPECT_NEAR(schedule_lr(*s, k), want[k], 1e-15) << k;
  auto w = parse_deepspeed_scheduler(R"({"type": "WarmupLR", "params": {"warmup_num_steps": 4}})", 2e-3);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(schedule_lr(*w, 0), 0.0);
  EXPECT_NEAR(schedule_lr(*w, 2), 2e-3 * std::log(2.0) / std::log(4.0), 1e-18);  // log warm-up to the optimizer's lr
  EXPECT_EQ(schedule_lr(*w, 5), 2e-3);
  auto c = parse_deepspeed_scheduler(R"({"type": "WarmupCosineLR", "params": {"total_num_steps": 6,
      "warmup_num_steps": 2, "warmup_type": "linear", "cos_min_ratio": 0.1}})",
                                     1e-3);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(schedule_lr(*c, 0), 0.0);
  EXPECT_NEAR(schedule_lr(*c, 2), 0.5e-3, 1e-18);
  EXPECT_NEAR(schedule_lr(*c, 4), 1e-3 * (0.1 + 0.9 * 0.5), 1e-15);  // half-way down the cosine
  EXPECT_NEAR(schedule_lr(*c, 100), 1e-4, 1e-15);
  for (const char* bad : {R"({"type": "OneCycle"})", R"({"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}})",
                          R"({"type": "WarmupLR", "params": {"warmup_num_steps": 0}})",
                          R"({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3}})",
                          R"({"type": "WarmupLR", "params": {"last_batch_iteration": 5}})",
                          R"({"type": "WarmupLR", "extra": 1})"})
    EXPECT_EQ(parse_deepspeed_scheduler(bad, 1e-3).status().code(), StatusCode::kInvalidArgument) << bad;
}

}  // namespace
}  // namespace strata::train
