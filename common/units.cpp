#include "common/units.h"

#include <fmt/format.h>

#include <cctype>
#include <limits>

namespace strata {
namespace {

Status bad_size(std::string_view text, std::string_view why) {
  return Status(StatusCode::kInvalidArgument, fmt::format("invalid size \"{}\": {}", text, why));
}

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  return true;
}

// Multiplier for a unit text, or 0 when the unit is unknown.
uint64_t unit_multiplier(std::string_view unit) {
  if (unit.empty() || iequals(unit, "B")) return 1;
  static constexpr struct {
    char letter;
    int power;
  } kPrefixes[] = {{'k', 1}, {'m', 2}, {'g', 3}, {'t', 4}, {'p', 5}};
  const char first = static_cast<char>(std::tolower(static_cast<unsigned char>(unit[0])));
  for (const auto& p : kPrefixes) {
    if (first != p.letter) continue;
    std::string_view rest = unit.substr(1);
    uint64_t base;
    if (rest.empty() || iequals(rest, "iB") || iequals(rest, "i"))
      base = 1024;  // bare letter: binary
    else if (iequals(rest, "B"))
      base = 1000;
    else
      return 0;
    uint64_t m = 1;
    for (int i = 0; i < p.power; ++i) m *= base;
    return m;
  }
  return 0;
}

}  // namespace

Result<uint64_t> parse_bytes(std::string_view text) {
  std::string_view s = text;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  if (s.empty()) return bad_size(text, "empty");
  if (s[0] == '-') return bad_size(text, "a size cannot be negative");
  if (s[0] == '+') return bad_size(text, "expected a number of bytes, optionally with a unit like GiB or MB");

  // Integer part, optional fraction, kept exact in 128-bit: "1.5" -> 15 / 10.
  using u128 = unsigned __int128;
  u128 mantissa = 0;
  u128 scale = 1;
  size_t i = 0;
  size_t digits = 0;
  bool in_fraction = false;
  for (; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '.' && !in_fraction) {
      in_fraction = true;
      continue;
    }
    if (!std::isdigit(static_cast<unsigned char>(c))) break;
    ++digits;
    if (digits > 30) return bad_size(text, "too many digits");
    mantissa = mantissa * 10 + static_cast<unsigned>(c - '0');
    if (in_fraction) scale *= 10;
  }
  if (digits == 0) return bad_size(text, "expected a number of bytes, optionally with a unit like GiB or MB");
  std::string_view unit = s.substr(i);
  if (!unit.empty() && unit.front() == ' ') unit.remove_prefix(1);
  const uint64_t mult = unit_multiplier(unit);
  if (mult == 0)
    return bad_size(text,
                    fmt::format("unknown unit \"{}\" (use B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB or PiB)", unit));
  const u128 total = mantissa * mult;  // mantissa < 10^30 and mult <= 1024^5: fits in 128 bits
  if (total % scale != 0) return bad_size(text, "not a whole number of bytes");
  const u128 bytes = total / scale;
  if (bytes > std::numeric_limits<uint64_t>::max()) return bad_size(text, "larger than 2^64-1 bytes");
  return static_cast<uint64_t>(bytes);
}

std::string format_bytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return fmt::format("{} B", bytes);
  double v = static_cast<double>(bytes) / 1024.0;
  int u = 0;
  // Switch unit once the rounded value would print as 1024.0.
  while (v >= 1023.95 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  return fmt::format("{:.1f} {}", v, kUnits[u]);
}

namespace {
// Three significant digits for values in [1, 1000).
std::string three_digits(double v) {
  if (v >= 99.95) return fmt::format("{:.0f}", v);
  if (v >= 9.995) return fmt::format("{:.1f}", v);
  return fmt::format("{:.2f}", v);
}
}  // namespace

std::string format_count(uint64_t n) {
  static const char* const kSuffix[] = {"K", "M", "B", "T"};
  if (n < 1000) return std::to_string(n);
  double v = static_cast<double>(n);
  int i = -1;
  while (v >= 999.5 && i < 3) {
    v /= 1000.0;
    ++i;
  }
  return three_digits(v) + " " + kSuffix[i];
}

std::string format_seconds(double s) {
  if (!(s >= 0.0)) return fmt::format("{} s", s);  // negative or NaN: as is
  if (s == 0.0) return "0 s";
  if (s >= 0.9995) return three_digits(s) + " s";
  if (s >= 0.0009995) return three_digits(s * 1e3) + " ms";
  if (s >= 0.0000009995) return three_digits(s * 1e6) + " us";
  return three_digits(s * 1e9) + " ns";
}

std::string format_rate(double bytes_per_s) {
  if (bytes_per_s >= 1e9) return fmt::format("{:.2f} GB/s", bytes_per_s / 1e9);
  if (bytes_per_s >= 1e6) return fmt::format("{:.1f} MB/s", bytes_per_s / 1e6);
  return fmt::format("{:.0f} B/s", bytes_per_s);
}

}  // namespace strata
