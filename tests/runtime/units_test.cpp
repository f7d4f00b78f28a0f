// parse_bytes / format_bytes (common/units.h): every accepted form and
// every refusal, with the exact byte counts.
#include "common/units.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

namespace strata {
namespace {

uint64_t bytes(const char* text) {
  auto r = parse_bytes(text);
  EXPECT_TRUE(r.ok()) << text << ": " << r.status().to_string();
  return r.ok() ? r.value() : 0;
}

std::string error_of(const char* text) {
  auto r = parse_bytes(text);
  EXPECT_FALSE(r.ok()) << text << " parsed as " << (r.ok() ? r.value() : 0);
  if (r.ok()) return "";
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  return r.status().message();
}

TEST(ParseBytes, PlainIntegers) {
  EXPECT_EQ(bytes("0"), 0u);
  EXPECT_EQ(bytes("4096"), 4096u);
  EXPECT_EQ(bytes("4096B"), 4096u);
  EXPECT_EQ(bytes("  4096 "), 4096u);
  EXPECT_EQ(bytes("18446744073709551615"), UINT64_MAX);
}

TEST(ParseBytes, DecimalAndBinaryUnits) {
  EXPECT_EQ(bytes("1KB"), 1000u);
  EXPECT_EQ(bytes("512MB"), 512000000u);
  EXPECT_EQ(bytes("2TB"), 2000000000000u);
  EXPECT_EQ(bytes("1PB"), 1000000000000000u);
  EXPECT_EQ(bytes("1KiB"), 1024u);
  EXPECT_EQ(bytes("512MiB"), 512u << 20);
  EXPECT_EQ(bytes("24GiB"), 24ull << 30);
  EXPECT_EQ(bytes("2TiB"), 2ull << 40);
  EXPECT_EQ(bytes("1PiB"), 1ull << 50);
  // A bare letter is binary, like `ls -h`; units are case-insensitive.
  EXPECT_EQ(bytes("24G"), 24ull << 30);
  EXPECT_EQ(bytes("8k"), 8192u);
  EXPECT_EQ(bytes("24gib"), 24ull << 30);
  EXPECT_EQ(bytes("512mb"), 512000000u);
  EXPECT_EQ(bytes("24 GiB"), 24ull << 30);
}

TEST(ParseBytes, Fractions) {
  EXPECT_EQ(bytes("1.5GiB"), 3ull << 29);
  EXPECT_EQ(bytes("0.5KiB"), 512u);
  EXPECT_EQ(bytes(".5KiB"), 512u);
  EXPECT_EQ(bytes("1.5TiB"), 3ull << 39);
  EXPECT_EQ(bytes("2.5KB"), 2500u);
  EXPECT_EQ(bytes("16383.5PiB"), 32767ull << 49);  // exact 128-bit arithmetic up to the 2^64 limit
}

TEST(ParseBytes, Refusals) {
  EXPECT_EQ(error_of(""), "invalid size \"\": empty");
  EXPECT_EQ(error_of("   "), "invalid size \"   \": empty");
  EXPECT_EQ(error_of("-1"), "invalid size \"-1\": a size cannot be negative");
  EXPECT_EQ(error_of("-5GiB"), "invalid size \"-5GiB\": a size cannot be negative");
  EXPECT_EQ(error_of("0.1KiB"), "invalid size \"0.1KiB\": not a whole number of bytes");
  EXPECT_EQ(error_of("1.5"), "invalid size \"1.5\": not a whole number of bytes");
  EXPECT_EQ(error_of("12XB"),
            "invalid size \"12XB\": unknown unit \"XB\" (use B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB or PiB)");
  EXPECT_EQ(error_of("GiB"), "invalid size \"GiB\": expected a number of bytes, optionally with a unit like GiB or MB");
  EXPECT_EQ(error_of("+5"), "invalid size \"+5\": expected a number of bytes, optionally with a unit like GiB or MB");
  EXPECT_EQ(error_of("18446744073709551616"), "invalid size \"18446744073709551616\": larger than 2^64-1 bytes");
  EXPECT_EQ(error_of("16384PiB"), "invalid size \"16384PiB\": larger than 2^64-1 bytes");
  EXPECT_EQ(error_of("1e9"),
            "invalid size \"1e9\": unknown unit \"e9\" (use B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB or PiB)");
  EXPECT_EQ(error_of("1..5G"),
            "invalid size \"1..5G\": unknown unit \".5G\" (use B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB or PiB)");
  EXPECT_EQ(error_of("24  GiB"),
            "invalid size \"24  GiB\": unknown unit \" GiB\" (use B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB or PiB)");
  EXPECT_EQ(error_of("1234567890123456789012345678901"),
            "invalid size \"1234567890123456789012345678901\": too many digits");
}

TEST(FormatBytes, BinaryUnitsOneDecimal) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.0 KiB");
  EXPECT_EQ(format_bytes(1536), "1.5 KiB");
  EXPECT_EQ(format_bytes((1 << 20) - 1), "1.0 MiB");  // would print 1024.0 KiB
  EXPECT_EQ(format_bytes(24ull << 30), "24.0 GiB");
  EXPECT_EQ(format_bytes(84ull << 30), "84.0 GiB");
  EXPECT_EQ(format_bytes(2000000000000ull), "1.8 TiB");
  EXPECT_EQ(format_bytes(UINT64_MAX), "16.0 EiB");
}

TEST(FormatBytes, RoundTripsThroughParseAtUnitBoundaries) {
  for (int shift = 10; shift <= 50; shift += 10) {
    const uint64_t v = uint64_t{1} << shift;
    const std::string s = format_bytes(v);
    std::string compact = s.substr(0, s.find(' ')) + s.substr(s.find(' ') + 1);
    EXPECT_EQ(bytes(compact.c_str()), v) << s;
  }
}

TEST(FormatRate, DecimalUnits) {
  EXPECT_EQ(format_rate(1.9e9), "1.90 GB/s");
  EXPECT_EQ(format_rate(250e6), "250.0 MB/s");
  EXPECT_EQ(format_rate(12), "12 B/s");
}

TEST(FormatCount, ThreeSignificantDigitsDecimalSuffix) {
  EXPECT_EQ(format_count(0), "0");
  EXPECT_EQ(format_count(999), "999");
  EXPECT_EQ(format_count(1000), "1.00 K");
  EXPECT_EQ(format_count(771200), "771 K");
  EXPECT_EQ(format_count(999499), "999 K");
  EXPECT_EQ(format_count(999500), "1.00 M");  // not "1000 K"
  EXPECT_EQ(format_count(134515008), "135 M");
  EXPECT_EQ(format_count(6738415616ull), "6.74 B");
  EXPECT_EQ(format_count(68976648192ull), "69.0 B");
  EXPECT_EQ(format_count(UINT64_MAX), "18446744 T");
}

TEST(FormatSeconds, UnitThatSuitsTheValue) {
  EXPECT_EQ(format_seconds(0.0), "0 s");
  EXPECT_EQ(format_seconds(6.94), "6.94 s");
  EXPECT_EQ(format_seconds(123.4), "123 s");
  EXPECT_EQ(format_seconds(0.149), "149 ms");
  EXPECT_EQ(format_seconds(0.9999), "1.00 s");
  EXPECT_EQ(format_seconds(0.0000123), "12.3 us");
  EXPECT_EQ(format_seconds(2.5e-9), "2.50 ns");
}

}  // namespace
}  // namespace strata
