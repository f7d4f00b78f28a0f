// Glue shared by the C API translation units: the one place a Status becomes
// a strata_status_t, and the per-thread last-error text.
#pragma once

#include <cstring>
#include <string>

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

// A caller built against an older header passes a smaller struct; one built
// against a newer header a larger one, whose extra fields we do not know.
// Version 1 of each struct is the first, so every field of it must be present.
template <typename T>
Status check_struct(const T* p, const char* what) {
  if (!p) return Status(StatusCode::kInvalidArgument, std::string(what) + " is NULL");
  if (p->struct_size < sizeof(T))
    return Status(StatusCode::kInvalidArgument, std::string(what) + ".struct_size is " +
                                                    std::to_string(p->struct_size) + ", expected at least " +
                                                    std::to_string(sizeof(T)) + " (set it to sizeof the struct)");
  return Status();
}

// A struct that grew since its first version: struct_size may also be
// `oldest` (the size of the first version with struct_size checks, e.g.
// offsetof the first field API 7 added) or anything between; the caller
// reads or writes only the fields within struct_size (fits()).
template <typename T>
Status check_struct_since(const T* p, const char* what, size_t oldest) {
  if (!p) return Status(StatusCode::kInvalidArgument, std::string(what) + " is NULL");
  if (p->struct_size < oldest)
    return Status(StatusCode::kInvalidArgument, std::string(what) + ".struct_size is " +
                                                    std::to_string(p->struct_size) + ", expected at least " +
                                                    std::to_string(oldest) + " (set it to sizeof the struct)");
  return Status();
}
// Whether the field at byte `offset` of `size` bytes lies within p's struct_size.
template <typename T>
bool fits(const T* p, size_t offset, size_t size) {
  return p->struct_size >= offset + size;
}

strata_status_t to_c_status(StatusCode code);

// Records st as this thread's last error and returns its C code.
strata_status_t fail(const Status& st);
// Convenience: fail(Status(kInvalidArgument, message)).
strata_status_t invalid(const std::string& message);

}  // namespace strata::capi
