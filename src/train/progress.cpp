#include "train/progress.h"

#include <unistd.h>

#include <fmt/format.h>

#include <cstdio>

namespace strata::train {

Progress::Progress(ProgressMode mode) : mode_(mode) {
  if (mode_ == ProgressMode::kAuto) mode_ = ::isatty(STDOUT_FILENO) != 0 ? ProgressMode::kBar : ProgressMode::kLines;
}

void Progress::say(const std::string& line) const {
  if (mode_ == ProgressMode::kQuiet) return;
  if (mode_ == ProgressMode::kBar) std::printf("\r\033[K");
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

void Progress::step(const std::string& line, double eta_seconds, bool as_line) const {
  if (mode_ == ProgressMode::kBar) {
    std::printf("\r\033[K%s  eta %s", line.c_str(), human_seconds(eta_seconds).c_str());
    std::fflush(stdout);
  } else if (mode_ == ProgressMode::kLines && as_line) {
    say(line);
  }
}

void Progress::end() const {
  if (mode_ != ProgressMode::kBar) return;
  std::printf("\n");
  std::fflush(stdout);
}

std::string human_count(double v) {
  if (v >= 1e9) return fmt::format("{:.2f}G", v / 1e9);
  if (v >= 1e6) return fmt::format("{:.2f}M", v / 1e6);
  if (v >= 1e3) return fmt::format("{:.1f}k", v / 1e3);
  return fmt::format("{:.0f}", v);
}

std::string human_seconds(double s) {
  if (!(s >= 0) || s > 1e8) return "?";
  const int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, (t / 60) % 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

}  // namespace strata::train
