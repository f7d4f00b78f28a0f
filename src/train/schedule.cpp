#include "train/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include "common/enum_names.h"

namespace strata {
template <>
inline constexpr auto kEnumNames<train::ScheduleKind> = std::to_array<EnumName<train::ScheduleKind>>(
    {{train::ScheduleKind::kConstant, "constant"}, {train::ScheduleKind::kLinear, "linear"}, {train::ScheduleKind::kCosine, "cosine"}});
}  // namespace strata

namespace strata::train {

const char* schedule_kind_name(ScheduleKind k) { return enum_name(k); }

Result<ScheduleKind> parse_schedule_kind(std::string_view text) {
  if (auto k = find_enum<ScheduleKind>(text)) return *k;
  return Status(StatusCode::kInvalidArgument,
                "schedule \"" + std::string(text) + "\" is not one of " + enum_name_list<ScheduleKind>());
}

Status validate_schedule(const Schedule& s) {
  auto bad = [](const std::string& what) { return Status(StatusCode::kInvalidArgument, what); };
  if (!(std::isfinite(s.lr) && s.lr > 0)) return bad("learning rate " + std::to_string(s.lr) + " must be > 0");
  if (!(std::isfinite(s.min_lr) && s.min_lr >= 0 && s.min_lr <= s.lr))
    return bad("min_lr " + std::to_string(s.min_lr) + " must be in [0, lr = " + std::to_string(s.lr) + "]");
  if (s.total < 1) return bad("total steps " + std::to_string(s.total) + " must be >= 1");
  if (s.warmup < 0 || s.warmup > s.total)
    return bad("warm-up steps " + std::to_string(s.warmup) + " must be in [0, total steps = " +
               std::to_string(s.total) + "]");
  return {};
}

double schedule_lr(const Schedule& s, int64_t step) {
  step = std::clamp<int64_t>(step, 0, s.total);
  if (step < s.warmup) return s.lr * static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, s.warmup));
  const double decay_steps = static_cast<double>(std::max<int64_t>(1, s.total - s.warmup));
  switch (s.kind) {
    case ScheduleKind::kConstant: return s.lr;
    case ScheduleKind::kLinear: {
      const double f = std::max(0.0, static_cast<double>(s.total - step) / decay_steps);
      return s.min_lr + (s.lr - s.min_lr) * f;
    }
    case ScheduleKind::kCosine: {
      const double p = std::min(1.0, static_cast<double>(step - s.warmup) / decay_steps);
      return s.min_lr + (s.lr - s.min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));
    }
  }
  return s.lr;
}

}  // namespace strata::train
