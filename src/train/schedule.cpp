#include "train/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <numbers>
#include <set>
#include <string>

#include "common/enum_names.h"
#include "common/json.h"

namespace strata {
template <>
inline constexpr auto kEnumNames<train::ScheduleKind> = std::to_array<EnumName<train::ScheduleKind>>(
    {{train::ScheduleKind::kConstant, "constant"},
     {train::ScheduleKind::kLinear, "linear"},
     {train::ScheduleKind::kCosine, "cosine"},
     {train::ScheduleKind::kWarmupLR, "WarmupLR"},
     {train::ScheduleKind::kWarmupDecayLR, "WarmupDecayLR"},
     {train::ScheduleKind::kWarmupCosineLR, "WarmupCosineLR"}});
}  // namespace strata

namespace strata::train {

const char* schedule_kind_name(ScheduleKind k) { return enum_name(k); }

bool is_deepspeed_schedule(ScheduleKind k) {
  return k == ScheduleKind::kWarmupLR || k == ScheduleKind::kWarmupDecayLR || k == ScheduleKind::kWarmupCosineLR;
}

Result<ScheduleKind> parse_schedule_kind(std::string_view text) {
  if (auto k = find_enum<ScheduleKind>(text); k && !is_deepspeed_schedule(*k)) return *k;
  return Status(StatusCode::kInvalidArgument,
                "schedule \"" + std::string(text) + "\" is not one of constant, linear, cosine");
}

Result<Schedule> parse_deepspeed_scheduler(std::string_view json_text, double optimizer_lr) {
  using nlohmann::json;
  auto bad = [](const std::string& where, const std::string& why) {
    return Status(StatusCode::kInvalidArgument, fmt::format("scheduler{}: {}", where, why));
  };
  json j;
  JsonError err;
  if (!parse_json(json_text, &j, &err)) return bad("", err.message());
  if (!j.is_object()) return bad("", "must be an object {\"type\": ..., \"params\": {...}}");
  for (auto it = j.begin(); it != j.end(); ++it)
    if (it.key() != "type" && it.key() != "params")
      return bad("." + clip_for_message(it.key()), "unknown key (a section has \"type\" and \"params\")");
  if (!j.contains("type") || !j["type"].is_string()) return bad(".type", "must name the schedule");
  const std::string type = j["type"].get<std::string>();
  Schedule s;
  if (type == "WarmupLR")
    s.kind = ScheduleKind::kWarmupLR;
  else if (type == "WarmupDecayLR")
    s.kind = ScheduleKind::kWarmupDecayLR;
  else if (type == "WarmupCosineLR")
    s.kind = ScheduleKind::kWarmupCosineLR;
  else if (type == "OneCycle" || type == "LRRangeTest")
    return bad(".type", fmt::format("\"{}\" is not supported by strata finetune (strata.torch.initialize follows it); "
                                    "it takes WarmupLR, WarmupDecayLR and WarmupCosineLR",
                                    type));
  else
    return bad(".type", fmt::format("\"{}\" is not one of WarmupLR, WarmupDecayLR, WarmupCosineLR",
                                    clip_for_message(type)));
  const json params = j.contains("params") ? j["params"] : json::object();
  if (!params.is_object()) return bad(".params", "must be an object");
  std::set<std::string> allowed = {"warmup_num_steps", "warmup_type", "last_batch_iteration"};
  if (s.kind == ScheduleKind::kWarmupCosineLR)
    allowed.insert({"total_num_steps", "warmup_min_ratio", "cos_min_ratio"});
  else
    allowed.insert({"warmup_min_lr", "warmup_max_lr"});
  if (s.kind == ScheduleKind::kWarmupDecayLR) allowed.insert("total_num_steps");
  for (auto it = params.begin(); it != params.end(); ++it) {
    const std::string where = ".params." + clip_for_message(it.key());
    if (!allowed.count(it.key())) {
      if (s.kind == ScheduleKind::kWarmupCosineLR && (it.key() == "warmup_min_lr" || it.key() == "warmup_max_lr"))
        return bad(where, "WarmupCosineLR takes ratios of the optimizer's lr (warmup_min_ratio, cos_min_ratio), "
                          "not learning rates (DeepSpeed refuses it too)");
      return bad(where, "not a parameter of " + type);
    }
    const json& v = it.value();
    if (v.is_string() && v.get<std::string>() == "auto")
      return bad(where, "\"auto\" (a Hugging Face Trainer placeholder): give the value");
    if (it.key() == "warmup_type") {
      if (!v.is_string() || (v != "log" && v != "linear"))
        return bad(where, fmt::format("{} is not \"log\" or \"linear\"", clip_for_message(v.dump())));
      s.ds.log_warmup = v == "log";
      continue;
    }
    if (v.is_array()) return bad(where, "one value per parameter group is not supported by strata finetune");
    if (!v.is_number()) return bad(where, fmt::format("must be a number, got {}", clip_for_message(v.dump())));
    const double x = v.get<double>();
    if (!std::isfinite(x)) return bad(where, "must be finite");
    if (it.key() == "last_batch_iteration") {
      if (!v.is_number_integer() || v.get<int64_t>() != -1)
        return bad(where, "only -1 (a fresh schedule; a resumed run continues from its checkpoint)");
    } else if (it.key() == "warmup_num_steps") {
      if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > (int64_t{1} << 40))
        return bad(where, fmt::format("must be a positive integer, got {}", clip_for_message(v.dump())));
      s.ds.warmup_num_steps = v.get<int64_t>();
    } else if (it.key() == "total_num_steps") {
      s.ds.total_num_steps = x;
    } else if (x < 0) {
      return bad(where, fmt::format("must be >= 0, got {}", x));
    } else if (it.key() == "warmup_min_lr") {
      s.ds.warmup_min_lr = x;
    } else if (it.key() == "warmup_max_lr") {
      s.ds.warmup_max_lr = x;
    } else if (it.key() == "warmup_min_ratio") {
      s.ds.warmup_min_ratio = x;
    } else if (it.key() == "cos_min_ratio") {
      s.ds.cos_min_ratio = x;
    }
  }
  if (s.kind != ScheduleKind::kWarmupLR && !params.contains("total_num_steps"))
    return bad(".params.total_num_steps", "is required by " + type);
  s.ds.peak_is_optimizer_lr = s.kind == ScheduleKind::kWarmupCosineLR ||
                              (s.kind == ScheduleKind::kWarmupLR && !params.contains("warmup_max_lr"));
  if (s.kind == ScheduleKind::kWarmupLR && !params.contains("warmup_max_lr")) s.ds.warmup_max_lr = optimizer_lr;
  s.lr = s.kind == ScheduleKind::kWarmupCosineLR ? optimizer_lr : s.ds.warmup_max_lr;
  s.min_lr = 0;
  s.warmup = 0;
  if (!(std::isfinite(optimizer_lr) && optimizer_lr > 0))
    return bad("", fmt::format("the optimizer's lr {} must be > 0", optimizer_lr));
  return s;
}

Status validate_schedule(const Schedule& s) {
  auto bad = [](const std::string& what) { return Status(StatusCode::kInvalidArgument, what); };
  if (is_deepspeed_schedule(s.kind))
    return s.total >= 1 ? Status() : bad("total steps " + std::to_string(s.total) + " must be >= 1");
  if (!(std::isfinite(s.lr) && s.lr > 0)) return bad(fmt::format("learning rate {:g} must be > 0", s.lr));
  if (s.lr > std::numeric_limits<float>::max())  // the optimizer computes in fp32
    return bad(fmt::format("learning rate {:g} is past fp32's range (3.4e38)", s.lr));
  if (!(std::isfinite(s.min_lr) && s.min_lr >= 0 && s.min_lr <= s.lr))
    return bad(fmt::format("min_lr {:g} must be in [0, lr = {:g}]", s.min_lr, s.lr));
  if (s.total < 1) return bad("total steps " + std::to_string(s.total) + " must be >= 1");
  if (s.warmup < 0 || s.warmup > s.total)
    return bad("warm-up steps " + std::to_string(s.warmup) + " must be in [0, total steps = " +
               std::to_string(s.total) + "]");
  return {};
}

namespace {

// DeepSpeed's formulas (lr_schedules.py), in its order of operations.
double deepspeed_lr(const Schedule& s, int64_t step) {
  const Schedule::DeepSpeed& d = s.ds;
  const int64_t i = step - 1;  // last_batch_iteration
  const int64_t w = std::max<int64_t>(2, d.warmup_num_steps);
  const double inverse_log_warm_up = 1.0 / std::log(static_cast<double>(w));
  auto warmup_gamma = [&] {
    return d.log_warmup ? inverse_log_warm_up * std::log(static_cast<double>(i + 1))
                        : static_cast<double>(i) / static_cast<double>(w);
  };
  if (s.kind == ScheduleKind::kWarmupCosineLR) {
    if (i < 0) return s.lr * 0.0;
    double ratio;
    if (i < w) {
      ratio = d.warmup_min_ratio + warmup_gamma() * (1.0 - d.warmup_min_ratio);
    } else {
      const double progress =
          std::min(1.0, static_cast<double>(i - w + 1) / std::max(1.0, d.total_num_steps - static_cast<double>(w)));
      const double half_cosine = (1 + std::cos(std::numbers::pi * progress)) / 2;
      ratio = std::max(0.0, d.cos_min_ratio + (1.0 - d.cos_min_ratio) * half_cosine);
    }
    return s.lr * ratio;
  }
  if (i < 0) return d.warmup_min_lr;
  const double delta = d.warmup_max_lr - d.warmup_min_lr;
  double gamma;
  if (i < w)
    gamma = warmup_gamma();
  else if (s.kind == ScheduleKind::kWarmupLR)
    gamma = 1.0;
  else
    gamma = std::max(0.0, (d.total_num_steps - static_cast<double>(i)) /
                              std::max(1.0, d.total_num_steps - static_cast<double>(w)));
  return d.warmup_min_lr + delta * gamma;
}

}  // namespace

double schedule_lr(const Schedule& s, int64_t step) {
  if (is_deepspeed_schedule(s.kind)) return deepspeed_lr(s, step);
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
    default:
      break;
  }
  return s.lr;
}

}  // namespace strata::train
