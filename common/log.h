// Minimal leveled logging to stderr. Level from STRATA_LOG_LEVEL
// (error|warn|info|debug; default warn). log_once() prints a message the first
// time a key is seen, for fallbacks that would otherwise repeat per request.
// log_status() prints an error Status, and at level debug the file:line
// frames it passed (Status::trace_string()).
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>

#include "common/enum_names.h"

namespace strata {

class Status;

enum class LogLevel { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };
template <>
inline constexpr auto kEnumNames<LogLevel> = std::to_array<EnumName<LogLevel>>(
    {{LogLevel::kError, "error"}, {LogLevel::kWarn, "warn"}, {LogLevel::kInfo, "info"}, {LogLevel::kDebug, "debug"}});

LogLevel log_level();
void set_log_level(LogLevel level);
void log_message(LogLevel level, std::string_view text);
// Returns true if this call printed (the first one for `key`).
bool log_once(LogLevel level, std::string_view key, std::string_view text);
// "<what>: <message>" at `level`; when the log level is debug, followed by
// the Status's trace ("  at src/runtime/engine.cpp:812" lines).
void log_status(LogLevel level, std::string_view what, const Status& status);

template <typename... Args>
void log_error(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() >= LogLevel::kError) log_message(LogLevel::kError, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void log_warn(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() >= LogLevel::kWarn) log_message(LogLevel::kWarn, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void log_info(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() >= LogLevel::kInfo) log_message(LogLevel::kInfo, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void log_debug(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() >= LogLevel::kDebug) log_message(LogLevel::kDebug, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace strata
