// Status and Result<T>: how errors travel inside Strata.
//
// No exceptions cross module boundaries. A function that can fail returns a
// Status (or a Result<T> holding either a value or a non-ok Status). The text
// of a Status says what failed, where and why, e.g.
//   "read of 1048576 bytes at offset 8388608 in /nvme/run/opt.0 failed:
//    Input/output error".
// The C API converts a Status to strata_status_t exactly once, at the boundary.
//
// Trace. STRATA_RETURN_IF_ERROR and STRATA_ASSIGN_OR_RETURN add the
// file:line they passed an error through (as NCCL's check macros log it), so
// a failure deep in the engine can be followed up to the caller that saw it.
// The first kMaxTraceFrames frames are kept (the innermost: where it went
// wrong); later ones are only counted. An ok Status carries no trace and
// allocates nothing; the trace lives on the heap and is copied with the
// Status, on the error path only. message() and to_string() never include
// it: tests, logs and the C API's last-error text read as before. Tools print
// trace_string() at log level debug (common/log.h, log_status()).
#pragma once

#include <cassert>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata {

// Numeric values are the C ABI's strata_status_t values; never renumber.
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // bad input from the caller or a config file
  kIoError = 2,          // an I/O call failed (EIO, EBADF, ...)
  kNoSpace = 3,          // disk full (ENOSPC, EFBIG, EDQUOT)
  kOutOfBudget = 4,      // a memory budget (pinned, device, ...) would be exceeded
  kOutOfMemory = 5,      // the system refused memory
  kNotFound = 6,         // a file or object does not exist
  kPermission = 7,       // EACCES / EPERM
  kUnavailable = 8,      // a feature is missing (io_uring disabled, no GPU, ...)
  kCorrupt = 9,          // data failed a check (checksum, header bounds)
  kAlreadyExists = 10,   // refusing to overwrite or reuse something
  kCancelled = 11,
  kInternal = 12,        // a bug in Strata
};

const char* status_code_name(StatusCode code);

// One place an error passed: `file` relative to the source root
// ("src/runtime/engine.cpp"), pointing into a string literal.
struct StatusFrame {
  std::string_view file;
  int line = 0;
};

class [[nodiscard]] Status {
 public:
  static constexpr size_t kMaxTraceFrames = 8;

  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  // Copying an ok Status copies no trace (and allocates nothing).
  Status(const Status& o) : code_(o.code_), message_(o.message_), trace_(o.trace_ ? o.copy_trace() : nullptr) {}
  Status(Status&&) noexcept = default;
  Status& operator=(const Status& o) {
    if (this != &o) *this = Status(o);
    return *this;
  }
  Status& operator=(Status&&) noexcept = default;
  ~Status() = default;

  static Status ok_status() { return {}; }
  // Maps an errno value to a StatusCode and appends strerror's text:
  // from_errno(EIO, "read of 4096 bytes at offset 0 in /x failed")
  //   -> kIoError, "read of 4096 bytes at offset 0 in /x failed: Input/output error"
  static Status from_errno(int err, const std::string& what);

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "IoError: read of ... failed: ..." (or "OK"). No trace.
  std::string to_string() const;

  // Prefixes context to the message: "loading config: " + message. Keeps the trace.
  Status with_context(const std::string& context) const;

  // Records that the error passed `file`:`line` (`file` must be a string
  // literal, normally __FILE__). No-op on an ok Status. The check macros
  // call it; code that rethrows a Status by hand may too.
  void add_frame(const char* file, int line);
  // The frames, innermost first (empty for an ok Status or one no macro passed).
  std::vector<StatusFrame> trace() const;
  // Frames recorded past kMaxTraceFrames (not kept).
  uint32_t trace_frames_dropped() const;
  // "  at src/runtime/engine.cpp:812\n" per frame ("  ... N more\n" after
  // them when some were dropped); "" without a trace.
  std::string trace_string() const;

 private:
  struct Trace;
  struct TraceDeleter {
    void operator()(Trace* t) const;
  };
  std::unique_ptr<Trace, TraceDeleter> copy_trace() const;

  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  std::unique_ptr<Trace, TraceDeleter> trace_;  // null when ok or untraced
};

StatusCode status_code_from_errno(int err);

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : ok_(true) { new (&storage_.value) T(std::move(value)); }  // NOLINT
  Result(Status status) : ok_(false), status_(std::move(status)) {              // NOLINT
    assert(!status_.ok() && "Result built from an ok Status has no value");
  }
  Result(const Result& o) : ok_(o.ok_), status_(o.status_) {
    if (ok_) new (&storage_.value) T(o.storage_.value);
  }
  Result(Result&& o) noexcept : ok_(o.ok_), status_(std::move(o.status_)) {
    if (ok_) new (&storage_.value) T(std::move(o.storage_.value));
  }
  Result& operator=(Result o) {
    this->~Result();
    new (this) Result(std::move(o));
    return *this;
  }
  ~Result() {
    if (ok_) storage_.value.~T();
  }

  bool ok() const { return ok_; }
  const Status& status() const& { return status_; }
  Status status() && { return std::move(status_); }
  T& value() & {
    assert(ok_);
    return storage_.value;
  }
  const T& value() const& {
    assert(ok_);
    return storage_.value;
  }
  T&& value() && {
    assert(ok_);
    return std::move(storage_.value);
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }

 private:
  bool ok_;
  Status status_;
  union Storage {
    Storage() {}
    ~Storage() {}
    T value;
  } storage_;
};

}  // namespace strata

// Propagates a non-ok Status to the caller, adding this file:line to its trace.
#define STRATA_RETURN_IF_ERROR(expr)           \
  do {                                         \
    ::strata::Status _st = (expr);             \
    if (!_st.ok()) {                           \
      _st.add_frame(__FILE__, __LINE__);       \
      return _st;                              \
    }                                          \
  } while (0)

#define STRATA_CONCAT_INNER_(a, b) a##b
#define STRATA_CONCAT_(a, b) STRATA_CONCAT_INNER_(a, b)
// STRATA_ASSIGN_OR_RETURN(auto file, open_file(path)); the error path adds
// this file:line to the Status's trace.
#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_ASSIGN_OR_RETURN_IMPL_(STRATA_CONCAT_(_res_, __LINE__), lhs, expr)
#define STRATA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr)            \
  auto tmp = (expr);                                             \
  if (!tmp.ok()) {                                               \
    ::strata::Status _st = std::move(tmp).status();              \
    _st.add_frame(__FILE__, __LINE__);                           \
    return _st;                                                  \
  }                                                              \
  lhs = std::move(tmp).value()
