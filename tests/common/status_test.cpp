#include "common/status.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <string>

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

}  // namespace
}  // namespace strata
