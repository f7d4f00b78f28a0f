#include <string>

#include "capi/c_api_util.h"
#include "common/enum_names.h"
#include "strata/git_commit.h"
#include "strata/strata.h"

namespace strata::capi {
namespace {
thread_local std::string t_last_error;
}

strata_status_t to_c_status(StatusCode code) {
  // StatusCode's values are the ABI's by construction (status.h); keep this
  // switch so a new internal code can never leak an unknown number.
  switch (code) {
    case StatusCode::kOk: return STRATA_OK;
    case StatusCode::kInvalidArgument: return STRATA_ERR_INVALID_ARGUMENT;
    case StatusCode::kIoError: return STRATA_ERR_IO;
    case StatusCode::kNoSpace: return STRATA_ERR_NO_SPACE;
    case StatusCode::kOutOfBudget: return STRATA_ERR_OUT_OF_BUDGET;
    case StatusCode::kOutOfMemory: return STRATA_ERR_OUT_OF_MEMORY;
    case StatusCode::kNotFound: return STRATA_ERR_NOT_FOUND;
    case StatusCode::kPermission: return STRATA_ERR_PERMISSION;
    case StatusCode::kUnavailable: return STRATA_ERR_UNAVAILABLE;
    case StatusCode::kCorrupt: return STRATA_ERR_CORRUPT;
    case StatusCode::kAlreadyExists: return STRATA_ERR_ALREADY_EXISTS;
    case StatusCode::kCancelled: return STRATA_ERR_CANCELLED;
    case StatusCode::kInternal: return STRATA_ERR_INTERNAL;
  }
  return STRATA_ERR_INTERNAL;
}

strata_status_t fail(const Status& st) {
  t_last_error = st.message();
  return to_c_status(st.code());
}

strata_status_t invalid(const std::string& message) { return fail(Status(StatusCode::kInvalidArgument, message)); }

}  // namespace strata::capi

namespace strata {
template <>
inline constexpr auto kEnumNames<strata_status_t> = std::to_array<EnumName<strata_status_t>>({
    {STRATA_OK, "STRATA_OK"},
    {STRATA_ERR_INVALID_ARGUMENT, "STRATA_ERR_INVALID_ARGUMENT"},
    {STRATA_ERR_IO, "STRATA_ERR_IO"},
    {STRATA_ERR_NO_SPACE, "STRATA_ERR_NO_SPACE"},
    {STRATA_ERR_OUT_OF_BUDGET, "STRATA_ERR_OUT_OF_BUDGET"},
    {STRATA_ERR_OUT_OF_MEMORY, "STRATA_ERR_OUT_OF_MEMORY"},
    {STRATA_ERR_NOT_FOUND, "STRATA_ERR_NOT_FOUND"},
    {STRATA_ERR_PERMISSION, "STRATA_ERR_PERMISSION"},
    {STRATA_ERR_UNAVAILABLE, "STRATA_ERR_UNAVAILABLE"},
    {STRATA_ERR_CORRUPT, "STRATA_ERR_CORRUPT"},
    {STRATA_ERR_ALREADY_EXISTS, "STRATA_ERR_ALREADY_EXISTS"},
    {STRATA_ERR_CANCELLED, "STRATA_ERR_CANCELLED"},
    {STRATA_ERR_INTERNAL, "STRATA_ERR_INTERNAL"},
});
}  // namespace strata

extern "C" {

const char* strata_status_string(strata_status_t status) {
  return strata::enum_name(status, "STRATA_ERR_UNKNOWN");
}

const char* strata_last_error(void) { return strata::capi::t_last_error.c_str(); }

const char* strata_version(void) { return STRATA_VERSION_STRING; }

int strata_api_version(void) { return STRATA_API_VERSION; }

}  // extern "C"
