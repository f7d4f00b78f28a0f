// Glue shared by the C API translation units: the one place a Status becomes
// a strata_status_t, and the per-thread last-error text.
#pragma once

#include <cstring>

#include "common/status.h"
#include "strata/strata.h"

namespace strata::capi {

// A C caller may pass any int where an enum is expected; loading an
// out-of-range value as the C++ enum type is undefined, so read its bytes.
template <typename E>
int enum_value(const E& e) {
  static_assert(sizeof(E) == sizeof(int));
  int v;
  std::memcpy(&v, &e, sizeof(v));
  return v;
}

strata_status_t to_c_status(StatusCode code);

// Records st as this thread's last error and returns its C code.
strata_status_t fail(const Status& st);
// Convenience: fail(Status(kInvalidArgument, message)).
strata_status_t invalid(const std::string& message);

}  // namespace strata::capi
