#include "common/status.h"

#include <sys/resource.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <string>

#include "common/enum_names.h"

namespace strata {

template <>
inline constexpr auto kEnumNames<StatusCode> = std::to_array<EnumName<StatusCode>>({
    {StatusCode::kOk, "OK"},
    {StatusCode::kInvalidArgument, "InvalidArgument"},
    {StatusCode::kIoError, "IoError"},
    {StatusCode::kNoSpace, "NoSpace"},
    {StatusCode::kOutOfBudget, "OutOfBudget"},
    {StatusCode::kOutOfMemory, "OutOfMemory"},
    {StatusCode::kNotFound, "NotFound"},
    {StatusCode::kPermission, "Permission"},
    {StatusCode::kUnavailable, "Unavailable"},
    {StatusCode::kCorrupt, "Corrupt"},
    {StatusCode::kAlreadyExists, "AlreadyExists"},
    {StatusCode::kCancelled, "Cancelled"},
    {StatusCode::kInternal, "Internal"},
});

const char* status_code_name(StatusCode code) { return enum_name(code, "Unknown"); }

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

namespace {

// The resource limit behind an errno, when a soft limit of this process
// caused it (the user can raise it: ulimit), as a hint; "" otherwise.
std::string limit_hint(int err) {
  rlimit r{};
  if (err == EMFILE && ::getrlimit(RLIMIT_NOFILE, &r) == 0)
    return " (this process may have " + std::to_string(r.rlim_cur) + " files open: raise `ulimit -n`)";
  if (err == EFBIG && ::getrlimit(RLIMIT_FSIZE, &r) == 0 && r.rlim_cur != RLIM_INFINITY)
    return " (files are limited to " + std::to_string(r.rlim_cur) + " bytes: raise `ulimit -f`)";
  return "";
}

}  // namespace

Status Status::from_errno(int err, const std::string& what) {
  char buf[256];
  // GNU strerror_r returns a pointer that may or may not be buf.
  const char* text = strerror_r(err, buf, sizeof(buf));
  return Status(status_code_from_errno(err), what + ": " + text + limit_hint(err));
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  return std::string(status_code_name(code_)) + ": " + message_;
}

Status Status::with_context(const std::string& context) const {
  if (ok()) return *this;
  Status out(code_, context + ": " + message_);
  out.trace_ = copy_trace();
  return out;
}

// ------------------------------------------------------------------ trace

struct Status::Trace {
  struct Frame {
    const char* file;  // __FILE__: a string literal, never freed
    int line;
  };
  std::array<Frame, kMaxTraceFrames> frames;
  uint32_t count = 0;
  uint32_t dropped = 0;
};

void Status::TraceDeleter::operator()(Trace* t) const { delete t; }

std::unique_ptr<Status::Trace, Status::TraceDeleter> Status::copy_trace() const {
  if (!trace_) return nullptr;
  return std::unique_ptr<Trace, TraceDeleter>(new Trace(*trace_));
}

void Status::add_frame(const char* file, int line) {
  if (ok()) return;
  if (!trace_) trace_.reset(new Trace());
  if (trace_->count < kMaxTraceFrames) {
    trace_->frames[trace_->count++] = {file, line};
  } else {
    ++trace_->dropped;
  }
}

namespace {

// __FILE__ is the path the compiler was given: absolute, or relative to the
// build directory (ccache's base_dir rewrites it so). Every file of the tree
// is given the same way, so this file's own __FILE__ less "common/status.cpp"
// is the prefix to drop.
std::string_view source_relative(std::string_view file) {
  static constexpr std::string_view kSelf = __FILE__;
  static constexpr std::string_view kSuffix = "common/status.cpp";
  static const std::string_view root =
      kSelf.size() >= kSuffix.size() && kSelf.substr(kSelf.size() - kSuffix.size()) == kSuffix
          ? kSelf.substr(0, kSelf.size() - kSuffix.size())
          : std::string_view();
  if (!root.empty() && file.substr(0, root.size()) == root) file.remove_prefix(root.size());
  return file;
}

}  // namespace

std::vector<StatusFrame> Status::trace() const {
  std::vector<StatusFrame> out;
  if (!trace_) return out;
  out.reserve(trace_->count);
  for (uint32_t i = 0; i < trace_->count; ++i)
    out.push_back({source_relative(trace_->frames[i].file), trace_->frames[i].line});
  return out;
}

uint32_t Status::trace_frames_dropped() const { return trace_ ? trace_->dropped : 0; }

std::string Status::trace_string() const {
  std::string s;
  for (const StatusFrame& f : trace()) {
    s += "  at ";
    s += f.file;
    s += ':';
    s += std::to_string(f.line);
    s += '\n';
  }
  if (uint32_t d = trace_frames_dropped(); d > 0) s += "  ... " + std::to_string(d) + " more\n";
  return s;
}

}  // namespace strata
