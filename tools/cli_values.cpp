#include "cli_values.h"

#include <cerrno>
#include <cstdlib>
#include <string>

namespace strata::tools {
namespace {

// "" when `text` is a decimal whole number that fits 64 bits (signed, or
// unsigned when `is_unsigned`), rewritten without sign and leading zeros
// where CLI11 would read them otherwise; else why not.
std::string whole_number(std::string& text, bool is_unsigned) {
  const char* range = is_unsigned ? "0 to 18446744073709551615" : "-9223372036854775808 to 9223372036854775807";
  size_t digits = text.find_first_not_of("+-") == 1 ? 1 : 0;
  const bool negative = digits == 1 && text[0] == '-';
  if (text.size() == digits || text.find_first_not_of("0123456789", digits) != std::string::npos)
    return "'" + text + "' is not a whole number (decimal digits; " + range + ")";
  if (negative && is_unsigned) {
    if (text.find_first_not_of('0', 1) == std::string::npos) {  // -0
      text = "0";
      return "";
    }
    return "'" + text + "' is negative: expected " + range;
  }
  errno = 0;
  char* end = nullptr;
  if (is_unsigned)
    (void)std::strtoull(text.c_str(), &end, 10);
  else
    (void)std::strtoll(text.c_str(), &end, 10);
  if (errno == ERANGE) return "'" + text + "' is out of range (" + range + ")";
  // Leading zeros: CLI11 parses with base 0, where "010" is octal.
  size_t first = text.find_first_not_of('0', digits);
  std::string canonical = first == std::string::npos ? "0" : text.substr(first);
  if (negative && canonical != "0") canonical.insert(0, "-");
  text = canonical;
  return "";
}

void add_checks(CLI::App& app) {
  for (CLI::Option* opt : app.get_options()) {
    if (opt->get_expected_max() == 0) continue;  // a flag: no value
    // "INT", or "INT:<what its own check() says>".
    const std::string full = opt->get_type_name(), type = full.substr(0, full.find(':'));
    const bool is_int = type == "INT", is_uint = type == "UINT";
    opt->transform(CLI::Validator(
        [is_int, is_uint](std::string& value) -> std::string {
          if (value.empty()) return "an empty value: give one, or leave the option out";
          if (is_int || is_uint) return whole_number(value, is_uint);
          return "";
        },
        "", "strict value"));
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) add_checks(*sub);
}

}  // namespace

void read_values_strictly(CLI::App& app) { add_checks(app); }

}  // namespace strata::tools
