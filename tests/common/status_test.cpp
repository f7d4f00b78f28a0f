#include "common/status.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cerrno>
#include <new>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <string>

#include "common/enum_names.h"
#include "common/threads.h"

namespace strata {
namespace {

TEST(Status, OkByDefault) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.to_string(), "OK");
}

TEST(Status, FromErrnoNamesWhatAndWhy) {
  Status s = Status::from_errno(EIO, "read of 4096 bytes at offset 0 in /x failed");
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.message(), "read of 4096 bytes at offset 0 in /x failed: Input/output error");
  EXPECT_EQ(Status::from_errno(ENOSPC, "w").code(), StatusCode::kNoSpace);
  EXPECT_EQ(Status::from_errno(EACCES, "w").code(), StatusCode::kPermission);
  EXPECT_EQ(Status::from_errno(ENOENT, "w").code(), StatusCode::kNotFound);
}

// An errno that a soft limit of the process caused says which limit (the
// user raises it with ulimit); other errnos say nothing more.
TEST(Status, FromErrnoNamesTheLimitBehindIt) {
  rlimit files{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &files), 0);
  EXPECT_EQ(Status::from_errno(EMFILE, "opening m/model.safetensors failed").message(),
            "opening m/model.safetensors failed: Too many open files (this process may have " +
                std::to_string(files.rlim_cur) + " files open: raise `ulimit -n`)");
  rlimit size{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &size), 0);
  rlimit lower = size;
  lower.rlim_cur = rlim_t{1} << 40;  // far above anything this test writes
  if (size.rlim_max != RLIM_INFINITY && size.rlim_max < lower.rlim_cur) lower.rlim_cur = size.rlim_max;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lower), 0);
  const std::string with_limit = Status::from_errno(EFBIG, "w").message();
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &size), 0);
  EXPECT_EQ(with_limit, "w: File too large (files are limited to " + std::to_string(lower.rlim_cur) +
                            " bytes: raise `ulimit -f`)");
  if (size.rlim_cur == RLIM_INFINITY) {
    EXPECT_EQ(Status::from_errno(EFBIG, "w").message(), "w: File too large");
  }
  EXPECT_EQ(Status::from_errno(ENOSPC, "w").message(), "w: No space left on device");
}

TEST(Status, WithContextPrefixes) {
  Status s(StatusCode::kCorrupt, "bad checksum");
  EXPECT_EQ(s.with_context("loading /ckpt").message(), "loading /ckpt: bad checksum");
  EXPECT_TRUE(Status().with_context("x").ok());
}

Result<std::string> maybe(bool good) {
  if (!good) return Status(StatusCode::kNotFound, "nothing");
  return std::string("value");
}

Status chain(bool good, std::string* out) {
  STRATA_ASSIGN_OR_RETURN(*out, maybe(good));
  return Status();
}

TEST(Result, CarriesValueOrStatus) {
  auto a = maybe(true);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a.value(), "value");
  auto b = maybe(false);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kNotFound);
  std::string out;
  EXPECT_TRUE(chain(true, &out).ok());
  EXPECT_EQ(out, "value");
  EXPECT_EQ(chain(false, &out).code(), StatusCode::kNotFound);
  Result<std::string> c = a;
  c = b;
  EXPECT_FALSE(c.ok());
}

// ---- trace: the macros add file:line on the error path only.

Status fail_here() { return Status(StatusCode::kIoError, "disk on fire"); }
constexpr int kFailLine = __LINE__ + 2;  // the STRATA_RETURN_IF_ERROR below
Status pass_once() {
  STRATA_RETURN_IF_ERROR(fail_here());
  return Status();
}
constexpr int kAssignLine = __LINE__ + 2;
Result<int> pass_twice() {
  STRATA_ASSIGN_OR_RETURN(int unused, Result<int>(pass_once()));
  return unused;
}
Status recurse(int depth) {
  if (depth == 0) return fail_here();
  STRATA_RETURN_IF_ERROR(recurse(depth - 1));
  return Status();
}

TEST(StatusTrace, MacrosRecordFileAndLine) {
  Status s = pass_once();
  ASSERT_FALSE(s.ok());
  // The message and to_string() read as without a trace.
  EXPECT_EQ(s.message(), "disk on fire");
  EXPECT_EQ(s.to_string(), "IoError: disk on fire");
  std::vector<StatusFrame> t = s.trace();
  ASSERT_EQ(t.size(), 1u);
  // Relative to the source root, not an absolute or build-relative path.
  EXPECT_EQ(t[0].file, "tests/common/status_test.cpp");
  EXPECT_EQ(t[0].line, kFailLine);

  Result<int> r = pass_twice();
  ASSERT_FALSE(r.ok());
  t = r.status().trace();
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].line, kFailLine);  // innermost first
  EXPECT_EQ(t[1].line, kAssignLine);
  EXPECT_EQ(r.status().trace_string(), "  at tests/common/status_test.cpp:" + std::to_string(kFailLine) +
                                           "\n  at tests/common/status_test.cpp:" + std::to_string(kAssignLine) +
                                           "\n");
}

TEST(StatusTrace, KeptThroughCopiesAndContext) {
  Status s = pass_once();
  Status copy = s;
  EXPECT_EQ(copy.trace().size(), 1u);
  Status ctx = s.with_context("loading x");
  EXPECT_EQ(ctx.message(), "loading x: disk on fire");
  EXPECT_EQ(ctx.trace().size(), 1u);
  Status assigned;
  assigned = ctx;
  EXPECT_EQ(assigned.trace_string(), s.trace_string());
}

TEST(StatusTrace, OkStatusHasNone) {
  Status ok;
  ok.add_frame(__FILE__, __LINE__);  // ignored: nothing went wrong
  EXPECT_TRUE(ok.trace().empty());
  EXPECT_EQ(ok.trace_string(), "");
  EXPECT_TRUE(Status(StatusCode::kNotFound, "x").trace().empty());
}

TEST(StatusTrace, BoundedAndCounted) {
  Status s = recurse(Status::kMaxTraceFrames + 3);
  EXPECT_EQ(s.trace().size(), Status::kMaxTraceFrames);
  EXPECT_EQ(s.trace_frames_dropped(), 3u);
  const std::string text = s.trace_string();
  EXPECT_NE(text.find("  ... 3 more\n"), std::string::npos) << text;
}

// ---- enum names (common/enum_names.h)

enum class Color { kRed, kGreen, kBlue, kUnnamed };

}  // namespace

template <>
inline constexpr auto kEnumNames<Color> = std::to_array<EnumName<Color>>(
    {{Color::kRed, "red"}, {Color::kGreen, "green"}, {Color::kBlue, "blue"}, {Color::kRed, "rouge"}});

namespace {

TEST(EnumNames, NamesAliasesAndErrors) {
  static_assert(enum_name(Color::kGreen) == std::string_view("green"));
  EXPECT_STREQ(enum_name(Color::kRed), "red");  // the first row, not the alias
  EXPECT_STREQ(enum_name(Color::kUnnamed), "?");
  EXPECT_STREQ(enum_name(Color::kUnnamed, "Unknown"), "Unknown");
  EXPECT_EQ(find_enum<Color>("rouge"), Color::kRed);
  EXPECT_EQ(find_enum<Color>("BLUE"), std::nullopt);
  EXPECT_EQ(find_enum<Color>("BLUE", /*ignore_case=*/true), Color::kBlue);
  EXPECT_EQ(enum_name_list<Color>(), "red, green, blue");
  EXPECT_EQ(enum_name_list<Color>("|"), "red|green|blue");
  EXPECT_EQ(enum_name_list<Color>(", ", "\"", " or "), "\"red\", \"green\" or \"blue\"");
  EXPECT_EQ(parse_enum<Color>("green", "color").value(), Color::kGreen);
  Result<Color> bad = parse_enum<Color>("mauve", "--color");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "--color \"mauve\" is not one of red, green, blue");
  EXPECT_STREQ(status_code_name(StatusCode::kNoSpace), "NoSpace");
  EXPECT_STREQ(status_code_name(static_cast<StatusCode>(99)), "Unknown");
}

// A worker thread's exception becomes its Status (an exception leaving a
// thread ends the process: std::bad_alloc under `ulimit -v` did, mid-run).
TEST(Threads, ExceptionsBecomeStatuses) {
  Status oom = run_guarded("engine: uploading a group", []() -> Status { throw std::bad_alloc(); });
  EXPECT_EQ(oom.code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(oom.message().rfind("engine: uploading a group: out of memory", 0), 0u) << oom.message();
  Status odd = run_guarded("x", []() -> Status { throw std::runtime_error("boom"); });
  EXPECT_EQ(odd.code(), StatusCode::kInternal);
  EXPECT_EQ(odd.message(), "x: unexpected exception: boom");
  EXPECT_EQ(run_guarded("x", [] { return Status(StatusCode::kNoSpace, "full"); }).message(), "full");
  std::thread t;
  int ran = 0;
  ASSERT_TRUE(start_thread(t, "test thread", [&] { ran = 1; }).ok());
  t.join();
  EXPECT_EQ(ran, 1);
  Status st = thread_start_error("engine: cannot start the uploader thread",
                                 std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again)));
  EXPECT_EQ(st.code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(st.message().rfind("engine: cannot start the uploader thread: Resource temporarily unavailable", 0), 0u)
      << st.message();
}

}  // namespace
}  // namespace strata
