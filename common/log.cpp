#include "common/log.h"

#include <atomic>
#include <cstdio>
#include <mutex>
#include <set>
#include <string>

#include "common/enum_names.h"
#include "common/status.h"
#include "common/tunables.h"

namespace strata {
namespace {

std::atomic<int> g_level{-1};
std::mutex g_mu;

}  // namespace

LogLevel log_level() {
  int v = g_level.load(std::memory_order_relaxed);
  if (v < 0) {
    v = static_cast<int>(tunables().log_level);
    g_level.store(v, std::memory_order_relaxed);
  }
  return static_cast<LogLevel>(v);
}

void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level)); }

void log_message(LogLevel level, std::string_view text) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(stderr, "strata %s: %.*s\n", enum_name(level), static_cast<int>(text.size()), text.data());
}

void log_status(LogLevel level, std::string_view what, const Status& status) {
  if (log_level() < level) return;
  std::string text(what);
  text += ": ";
  text += status.message();
  if (log_level() >= LogLevel::kDebug) {
    const std::string trace = status.trace_string();
    if (!trace.empty()) {
      text += '\n';
      text.append(trace, 0, trace.size() - 1);  // log_message ends the line
    }
  }
  log_message(level, text);
}

bool log_once(LogLevel level, std::string_view key, std::string_view text) {
  static std::set<std::string, std::less<>> seen;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (seen.count(key)) return false;
    seen.emplace(key);
  }
  if (log_level() >= level) log_message(level, text);
  return true;
}

}  // namespace strata
