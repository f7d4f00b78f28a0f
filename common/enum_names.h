// Names of enum values: one constexpr table per enum, instead of a switch per
// name function and a hand-written loop per parser.
//
//   template <>
//   inline constexpr auto kEnumNames<Tier> = std::to_array<EnumName<Tier>>(
//       {{Tier::kAuto, "auto"}, {Tier::kDevice, "device"}, {Tier::kHost, "host"}, {Tier::kNvme, "nvme"}});
//
//   enum_name(Tier::kHost)              -> "host"   ("?" for a value without a row)
//   find_enum<Tier>("nvme")             -> Tier::kNvme (std::nullopt when no row matches)
//   parse_enum<Tier>("disk", "tier")    -> kInvalidArgument
//                                          'tier "disk" is not one of auto, device, host, nvme'
//   enum_name_list<Tier>(", ")          -> "auto, device, host, nvme"
//
// The first row of a value gives its name; later rows with the same value are
// aliases that find_enum/parse_enum accept and the lists leave out. A table
// lists its rows in the order messages should show them.
//
// A table must be visible wherever these functions are used for its enum (a
// header, or the one .cpp that uses it); using them for an enum without a
// table is a compile error. Header-only, no state: callable from any thread.
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "common/status.h"

namespace strata {

template <typename E>
struct EnumName {
  E value;
  const char* name;
};

// Specialize per enum in namespace strata (see above). The primary has no rows.
template <typename E>
inline constexpr std::nullptr_t kEnumNames = nullptr;

namespace enum_names_detail {
template <typename E>
constexpr const auto& table() {
  static_assert(!std::is_same_v<std::remove_cv_t<decltype(kEnumNames<E>)>, std::nullptr_t>,
                "no kEnumNames<E> table is visible here (common/enum_names.h)");
  return kEnumNames<E>;
}
template <typename E>
constexpr bool first_row_of_value(size_t i) {
  const auto& t = table<E>();
  for (size_t j = 0; j < i; ++j)
    if (t[j].value == t[i].value) return false;
  return true;
}
}  // namespace enum_names_detail

// The name of `value`; `unknown` for a value no row has (a corrupt byte, a
// value added to the enum but not to its table).
template <typename E>
constexpr const char* enum_name(E value, const char* unknown = "?") {
  for (const EnumName<E>& row : enum_names_detail::table<E>())
    if (row.value == value) return row.name;
  return unknown;
}

// The value whose name or alias is `text` (exact match; ignore_case compares
// ASCII letters case-insensitively).
template <typename E>
constexpr std::optional<E> find_enum(std::string_view text, bool ignore_case = false) {
  auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
  for (const EnumName<E>& row : enum_names_detail::table<E>()) {
    const std::string_view name = row.name;
    if (name.size() != text.size()) continue;
    bool eq = true;
    for (size_t i = 0; i < name.size() && eq; ++i)
      eq = ignore_case ? lower(name[i]) == lower(text[i]) : name[i] == text[i];
    if (eq) return row.value;
  }
  return std::nullopt;
}

// The names (not the aliases) in table order, `sep` between them, each
// between `quote`s; `last_sep` (when given) before the last one:
// enum_name_list<Tier>(", ", "\"", " or ") -> "\"auto\", \"device\", \"host\" or \"nvme\"".
template <typename E>
std::string enum_name_list(std::string_view sep = ", ", std::string_view quote = "",
                           std::string_view last_sep = {}) {
  const auto& t = enum_names_detail::table<E>();
  size_t count = 0;
  for (size_t i = 0; i < t.size(); ++i) count += enum_names_detail::first_row_of_value<E>(i) ? 1 : 0;
  std::string out;
  size_t k = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    if (!enum_names_detail::first_row_of_value<E>(i)) continue;
    if (k > 0) out += (k + 1 == count && !last_sep.empty()) ? last_sep : sep;
    out += quote;
    out += t[i].name;
    out += quote;
    ++k;
  }
  return out;
}

// find_enum, or kInvalidArgument: '<what> "<text>" is not one of a, b, c'.
template <typename E>
Result<E> parse_enum(std::string_view text, std::string_view what) {
  if (std::optional<E> v = find_enum<E>(text)) return *v;
  return Status(StatusCode::kInvalidArgument,
                std::string(what) + " \"" + std::string(text) + "\" is not one of " + enum_name_list<E>());
}

}  // namespace strata
