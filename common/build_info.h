// What this binary was built with (compile time). strata --version prints it
// together with what the running machine offers (run-time probes).
#pragma once

#include <string>

namespace strata {

// One line per optional part: "  io_uring   yes (liburing 2.3)" etc.
std::string build_feature_summary();
const char* version_string();  // "0.1.0 (commit abc123, RelWithDebInfo)"

}  // namespace strata
