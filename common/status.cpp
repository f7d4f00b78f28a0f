#include "common/status.h"

#include <cerrno>
#include <cstring>

namespace strata {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kIoError: return "IoError";
    case StatusCode::kNoSpace: return "NoSpace";
    case StatusCode::kOutOfBudget: return "OutOfBudget";
    case StatusCode::kOutOfMemory: return "OutOfMemory";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kPermission: return "Permission";
    case StatusCode::kUnavailable: return "Unavailable";
    case StatusCode::kCorrupt: return "Corrupt";
    case StatusCode::kAlreadyExists: return "AlreadyExists";
    case StatusCode::kCancelled: return "Cancelled";
    case StatusCode::kInternal: return "Internal";
  }
  return "Unknown";
}

StatusCode status_code_from_errno(int err) {
  switch (err) {
    case 0: return StatusCode::kOk;
    case ENOSPC:
    case EFBIG:
    case EDQUOT: return StatusCode::kNoSpace;
    case ENOMEM: return StatusCode::kOutOfMemory;
    case ENOENT:
    case ENOTDIR: return StatusCode::kNotFound;
    case EACCES:
    case EPERM:
    case EROFS: return StatusCode::kPermission;
    case EEXIST:
    case ENOTEMPTY: return StatusCode::kAlreadyExists;
    case ENOSYS:
    case EOPNOTSUPP: return StatusCode::kUnavailable;
    case EINVAL: return StatusCode::kInvalidArgument;
    case ECANCELED: return StatusCode::kCancelled;
    default: return StatusCode::kIoError;
  }
}

Status Status::from_errno(int err, const std::string& what) {
  char buf[256];
  // GNU strerror_r returns a pointer that may or may not be buf.
  const char* text = strerror_r(err, buf, sizeof(buf));
  return Status(status_code_from_errno(err), what + ": " + text);
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  return std::string(status_code_name(code_)) + ": " + message_;
}

Status Status::with_context(const std::string& context) const {
  if (ok()) return *this;
  return Status(code_, context + ": " + message_);
}

}  // namespace strata
