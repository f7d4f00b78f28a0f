// Every command's option values are read strictly: what CLI11 2.1 would
// quietly bend is refused by name before a command runs.
//  - whole numbers (INT, UINT options) must be decimal and fit 64 bits: CLI11
//    clamps "99999999999999999999" to INT64_MAX, wraps "-5" to 2^64 - 5 for
//    unsigned options and reads "010" as octal 8;
//  - an empty value ("--lr ''", "--device-mem $UNSET") is refused: CLI11 reads
//    it as 0 or as the option's default.
// The narrower types' ranges stay CLI11's check (it refuses values that do
// not fit the option's type).
#pragma once

#include <CLI/CLI.hpp>

namespace strata::tools {

// Adds the checks to every option of `app` and of its subcommands, at any
// depth. Call once, after every command registered its options.
void read_values_strictly(CLI::App& app);

}  // namespace strata::tools
