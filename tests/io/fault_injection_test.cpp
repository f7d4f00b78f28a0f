// Every error path of the engine, reached through the fault-injecting backend
// wrapper, on every backend: EIO on read and write, ENOSPC, short transfers,
// EINTR/EAGAIN retries, latency, and errors inside groups.
#include "io/fault_injection.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "io_test_util.h"

namespace strata::io {
namespace {

using testing::fill_pattern;
using testing::TempDir;

constexpr std::uint64_t kBlock = 256 << 10;

// These tests need no real disk: they run on tmpfs (/dev/shm) where there is
// one, which keeps them in the `unit` label (and under the sanitizers).
const char* scratch_root() {
  return ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : nullptr;
}

class FaultTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    faults_ = std::make_shared<FaultInjector>();
    IoEngineOptions o;
    o.backend = GetParam();
    o.allow_fallback = false;
    o.queue_depth = 4;
    o.block_bytes = kBlock;
    o.faults = faults_;
    auto e = make_io_engine(o);
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    engine_ = std::move(e).value();
    IoOpenOptions fo;
    fo.write = fo.create = true;
    auto f = engine_->open(dir_.file("f.bin"), fo);
    ASSERT_TRUE(f.ok()) << f.status().to_string();
    file_ = std::move(f).value();
    auto a = alloc_host(kLen), b = alloc_host(kLen);
    ASSERT_TRUE(a.ok() && b.ok());
    src_ = *a;
    dst_ = *b;
    fill_pattern(src_.ptr, kLen, 11);
  }
  void TearDown() override {
    file_.reset();
    engine_.reset();
    free_host(src_);
    free_host(dst_);
  }
  Status write(std::uint64_t off, std::uint64_t len) {
    return engine_->submit({IoOpKind::kWrite, file_.get(), off, len, src_.ptr}).wait();
  }
  Status read(std::uint64_t off, std::uint64_t len) {
    return engine_->submit({IoOpKind::kRead, file_.get(), off, len, dst_.ptr}).wait();
  }
  std::string piece_error(const char* op, std::uint64_t len, std::uint64_t off, const char* text) {
    return std::string(op) + " of " + std::to_string(len) + " bytes at offset " + std::to_string(off) + " in " +
           file_->path() + " failed: " + text;
  }

  static constexpr std::size_t kLen = 4 << 20;
  TempDir dir_{scratch_root()};
  std::shared_ptr<FaultInjector> faults_;
  std::unique_ptr<IoEngine> engine_;
  std::unique_ptr<IoFile> file_;
  HostAllocation src_, dst_;
};

TEST_P(FaultTest, EioOnReadNamesTheFailingPiece) {
  ASSERT_TRUE(write(0, kLen).ok());
  faults_->set_plan({.op = IoOpKind::kRead, .fail_nth = 2, .fail_errno = EIO});
  Status s = read(0, kLen);
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.message(), piece_error("read", kBlock, kBlock, "Input/output error"));
  EXPECT_EQ(faults_->faults_injected(), 1u);
  // The engine is still fine afterwards.
  faults_->set_plan({});
  ASSERT_TRUE(read(0, kLen).ok());
  EXPECT_EQ(0, std::memcmp(src_.ptr, dst_.ptr, kLen));
}

TEST_P(FaultTest, EioOnWrite) {
  faults_->set_plan({.op = IoOpKind::kWrite, .fail_nth = 3, .fail_errno = EIO});
  Status s = write(0, kLen);
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.message(), piece_error("write", kBlock, 2 * kBlock, "Input/output error"));
  EXPECT_FALSE(engine_->wait_all().ok());
}

TEST_P(FaultTest, NoSpaceOnWriteAfterTheFirstPieces) {
  faults_->set_plan({.op = IoOpKind::kWrite, .fail_nth = 2, .fail_errno = ENOSPC, .fail_after = true});
  Status s = write(0, kLen);
  EXPECT_EQ(s.code(), StatusCode::kNoSpace);
  EXPECT_NE(s.message().find("No space left on device"), std::string::npos) << s.message();
}

TEST_P(FaultTest, ShortTransfersAreResubmitted) {
  faults_->set_plan({.op = std::nullopt, .short_every = 1});  // every piece moves half of what it asked
  const std::uint64_t off = 4096 * 3 + 17, len = kLen - 4096 * 5 - 3;
  ASSERT_TRUE(write(off, len).ok());
  ASSERT_TRUE(read(off, len).ok());
  EXPECT_EQ(0, std::memcmp(src_.ptr, dst_.ptr, len));
  EXPECT_GT(faults_->shorts_injected(), 10u);
  EXPECT_GT(engine_->stats().resubmissions, 10u);
}

TEST_P(FaultTest, EintrAndEagainAreRetried) {
  ASSERT_TRUE(write(0, kLen).ok());
  faults_->set_plan({.op = std::nullopt, .fail_nth = 1, .fail_errno = EINTR});
  EXPECT_TRUE(read(0, kLen).ok());
  faults_->set_plan({.op = std::nullopt, .fail_nth = 3, .fail_errno = EAGAIN});
  EXPECT_TRUE(read(0, kLen).ok());
  EXPECT_EQ(0, std::memcmp(src_.ptr, dst_.ptr, kLen));
  EXPECT_EQ(faults_->faults_injected(), 2u);
}

TEST_P(FaultTest, EndlessEagainEndsAsAnErrorNotAHang) {
  ASSERT_TRUE(write(0, 4096).ok());
  faults_->set_plan({.op = std::nullopt, .fail_nth = 1, .fail_errno = EAGAIN, .fail_after = true});
  Status s = read(0, 4096);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("Resource temporarily unavailable"), std::string::npos) << s.message();
}

TEST_P(FaultTest, LatencyIsAdded) {
  faults_->set_plan({.op = std::nullopt, .latency_us = 5000});
  auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(write(0, 4 * kBlock).ok());
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(ms, 19);
}

TEST_P(FaultTest, ErrorInAGroupWaitsForTheOtherParts) {
  ASSERT_TRUE(write(0, kLen).ok());
  faults_->set_plan({.op = IoOpKind::kRead, .fail_nth = 1, .fail_errno = EIO});
  auto* d = static_cast<char*>(dst_.ptr);
  std::vector<IoRequest> parts = {{IoOpKind::kRead, file_.get(), 0, kBlock, d},
                                  {IoOpKind::kRead, file_.get(), kBlock, kLen - kBlock, d + kBlock}};
  int calls = 0;
  Status cb_status;
  IoHandle h = engine_->submit_group(parts, [&](const Status& s) {
    ++calls;
    cb_status = s;
  });
  Status s = h.wait();
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(cb_status.code(), StatusCode::kIoError);
  // Nothing left running. The I/O thread wakes the handle's waiter just
  // before it drops its in-flight count, so poll() right after wait() could
  // still see 1 (this failed once in 424 tests under load, issue 10): wait
  // for the engine to be idle, which returns the group's error once more.
  EXPECT_EQ(engine_->wait_all().code(), StatusCode::kIoError);
  EXPECT_EQ(engine_->poll(), 0u);
}

std::string backend_name(const ::testing::TestParamInfo<std::string>& info) {
  return info.param;
}
INSTANTIATE_TEST_SUITE_P(Backends, FaultTest, ::testing::ValuesIn(testing::backends()), backend_name);

}  // namespace
}  // namespace strata::io
