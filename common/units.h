// Byte sizes as people write them: "24GiB", "512MB", "1.5 TiB", "4096".
//
// One parser for the whole project (config files, command-line flags), so that
// "24G" means the same thing everywhere. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace strata {

// Parses a byte count. Accepted forms (surrounding spaces ignored, one optional
// space between number and unit, unit case-insensitive):
//   "4096", "4096B"                          bytes
//   "512KB" "512MB" "24GB" "2TB" "1PB"       decimal (SI): powers of 1000
//   "512KiB" "512MiB" "24GiB" "2TiB" "1PiB"  binary (IEC): powers of 1024
//   "512K" "24G" ...                         a bare letter is binary, like `ls -h`
//   "1.5GiB"                                 a fraction, if the result is a whole
//                                            number of bytes
// Returns kInvalidArgument (message names the text and says why) for an empty
// string, a sign, an unknown unit, a fraction that is not a whole number of
// bytes, or a value above 2^64-1.
Result<uint64_t> parse_bytes(std::string_view text);

// Formats with a binary unit and one decimal: 512 -> "512 B", 1536 -> "1.5 KiB",
// 25769803776 -> "24.0 GiB". Rounds to nearest; for reports, not round trips.
std::string format_bytes(uint64_t bytes);

// Formats a rate in decimal units per second: 1.9e9 -> "1.90 GB/s" (device
// bandwidths are quoted in decimal units by vendors and by fio).
std::string format_rate(double bytes_per_s);

// Formats a count of things (parameters) with a decimal suffix and three
// significant digits: 771200 -> "771 K", 6738415616 -> "6.74 B",
// 68976648192 -> "69.0 B", 999 -> "999".
std::string format_count(uint64_t n);

// Formats a duration with three significant digits in the unit that suits
// it: 0.0000123 -> "12.3 us", 0.149 -> "149 ms", 6.94 -> "6.94 s".
std::string format_seconds(double s);

}  // namespace strata
