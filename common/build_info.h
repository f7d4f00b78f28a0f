// What this binary was built with (compile time). strata --version prints it
// together with what the running machine offers (run-time probes).
#pragma once

#include <string>

namespace strata {

// One line per optional part: "  io_uring   yes (liburing 2.3)" etc.
std::string build_feature_summary();
// The version line with its commit is STRATA_VERSION_STRING in strata/git_commit.h,
// generated at each build and included only where it is reported.

}  // namespace strata
