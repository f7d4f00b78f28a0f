// The engine on real files, on every backend built in: byte-exact round trips
// at odd sizes, offsets and buffer addresses, many requests in flight, requests
// larger than the queue, reads past the end, fallback when io_uring is off.
#include "io/io_engine.h"

#include <gtest/gtest.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstring>
#include <vector>

#include "io/pinned_pool.h"
#include "io_test_util.h"

namespace strata::io {
namespace {

using testing::fill_pattern;
using testing::TempDir;

std::unique_ptr<IoEngine> make(const std::string& backend, unsigned qd = 8, std::uint64_t block = 1 << 20) {
  IoEngineOptions o;
  o.backend = backend;
  o.allow_fallback = false;
  o.queue_depth = qd;
  o.block_bytes = block;
  auto e = make_io_engine(o);
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  return e.ok() ? std::move(e).value() : nullptr;
}

std::unique_ptr<IoFile> open_rw(IoEngine& e, const std::string& path) {
  IoOpenOptions o;
  o.write = o.create = true;
  auto f = e.open(path, o);
  EXPECT_TRUE(f.ok()) << f.status().to_string();
  return f.ok() ? std::move(f).value() : nullptr;
}

// Reads the file with plain pread: the reference the engine is checked against.
std::vector<unsigned char> slurp(const std::string& path) {
  std::vector<unsigned char> v;
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return v;
  unsigned char buf[65536];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) v.insert(v.end(), buf, buf + n);
  ::close(fd);
  return v;
}

class EngineTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { ASSERT_TRUE(dir_.ok()) << "cannot create a temp directory"; }
  TempDir dir_;
};

struct Range {
  std::uint64_t offset, length;
  std::size_t buf_skew;  // misaligns the buffer address by this many bytes
};

TEST_P(EngineTest, RoundTripOddSizesOffsetsAndBuffers) {
  auto e = make(GetParam(), 8, 256 << 10);
  ASSERT_TRUE(e);
  auto f = open_rw(*e, dir_.file("odd.bin"));
  ASSERT_TRUE(f);
  const std::vector<Range> ranges = {
      {0, 1, 0},
      {1, 1, 0},
      {511, 513, 0},
      {4095, 4098, 3},
      {16384, 4096, 0},
      {24577, (1 << 20) + 7, 0},
      {2 << 20, 4096, 1},
      {(3 << 20) + 100, (3 << 20) + 333, 0},
      {(7 << 20), 12345, 0},
      {(8 << 20) + 4096, 1 << 20, 0},
  };
  std::vector<std::vector<unsigned char>> src, dst;
  std::vector<IoHandle> handles;
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    src.emplace_back(ranges[i].length + 4096 + ranges[i].buf_skew);
    // Page-aligned base inside the vector, then skewed.
    auto* base = src.back().data();
    auto* p = base + (4096 - reinterpret_cast<std::uintptr_t>(base) % 4096) % 4096 + ranges[i].buf_skew;
    fill_pattern(p, ranges[i].length, i + 1);
    handles.push_back(e->submit({IoOpKind::kWrite, f.get(), ranges[i].offset, ranges[i].length, p}));
  }
  for (auto& h : handles) ASSERT_TRUE(h.wait().ok()) << h.wait().to_string();
  ASSERT_TRUE(e->wait_all().ok());

  // The file holds the bytes where they were written.
  auto file = slurp(f->path());
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    std::vector<unsigned char> want(ranges[i].length);
    fill_pattern(want.data(), want.size(), i + 1);
    ASSERT_GE(file.size(), ranges[i].offset + ranges[i].length);
    ASSERT_EQ(0, std::memcmp(file.data() + ranges[i].offset, want.data(), want.size())) << "range " << i;
  }

  // And the engine reads them back.
  handles.clear();
  std::vector<unsigned char*> outs;
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    dst.emplace_back(ranges[i].length + 4096 + 7);
    auto* base = dst.back().data();
    auto* p = base + (4096 - reinterpret_cast<std::uintptr_t>(base) % 4096) % 4096 + (i % 3 == 0 ? 0 : 5);
    outs.push_back(p);
    handles.push_back(e->submit({IoOpKind::kRead, f.get(), ranges[i].offset, ranges[i].length, p}));
  }
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    ASSERT_TRUE(handles[i].wait().ok()) << handles[i].wait().to_string();
    std::vector<unsigned char> want(ranges[i].length);
    fill_pattern(want.data(), want.size(), i + 1);
    EXPECT_EQ(0, std::memcmp(outs[i], want.data(), want.size())) << "range " << i;
  }
  if (f->direct()) {
    EXPECT_GT(e->stats().pieces, e->stats().buffered_pieces) << "aligned middles should go O_DIRECT";
  }
}

TEST_P(EngineTest, ManyConcurrentRequestsWithCallbacks) {
  auto e = make(GetParam(), 16, 1 << 20);
  ASSERT_TRUE(e);
  auto f = open_rw(*e, dir_.file("many.bin"));
  ASSERT_TRUE(f);
  constexpr int kN = 300;
  constexpr std::size_t kLen = 20000;  // odd: every request has an unaligned tail
  auto mem = alloc_host(kN * kLen);
  ASSERT_TRUE(mem.ok());
  auto* src = static_cast<unsigned char*>(mem->ptr);
  fill_pattern(src, kN * kLen, 42);
  std::atomic<int> done{0};
  for (int i = 0; i < kN; ++i)
    e->submit({IoOpKind::kWrite, f.get(), i * kLen, kLen, src + i * kLen}, [&](const Status& s) {
      EXPECT_TRUE(s.ok()) << s.to_string();
      done.fetch_add(1);
    });
  EXPECT_TRUE(e->wait_all().ok());
  EXPECT_EQ(done.load(), kN);
  EXPECT_EQ(e->poll(), 0u);

  auto back = alloc_host(kN * kLen);
  ASSERT_TRUE(back.ok());
  std::vector<IoHandle> hs;
  for (int i = kN - 1; i >= 0; --i)  // reverse order, all at once
    hs.push_back(e->submit({IoOpKind::kRead, f.get(), i * kLen, kLen, static_cast<char*>(back->ptr) + i * kLen}));
  EXPECT_TRUE(e->wait_all().ok());
  for (auto& h : hs) EXPECT_TRUE(h.poll());
  EXPECT_EQ(0, std::memcmp(back->ptr, src, kN * kLen));
  // Batches: far fewer submit calls than pieces when many are queued at once.
  EXPECT_LT(e->stats().submit_calls, e->stats().pieces);
  free_host(*mem);
  free_host(*back);
}

TEST_P(EngineTest, RequestLargerThanTheQueue) {
  auto e = make(GetParam(), 4, 64 << 10);
  ASSERT_TRUE(e);
  auto f = open_rw(*e, dir_.file("large.bin"));
  ASSERT_TRUE(f);
  const std::size_t len = (5 << 20) + 123;  // 81 pieces of 64 KiB through 4 slots
  auto a = alloc_host(len), b = alloc_host(len);
  ASSERT_TRUE(a.ok() && b.ok());
  fill_pattern(a->ptr, len, 7);
  ASSERT_TRUE(e->submit({IoOpKind::kWrite, f.get(), 4096, len, a->ptr}).wait().ok());
  ASSERT_TRUE(e->submit({IoOpKind::kRead, f.get(), 4096, len, b->ptr}).wait().ok());
  EXPECT_EQ(0, std::memcmp(a->ptr, b->ptr, len));
  EXPECT_GE(e->stats().pieces, 2 * (len / (64 << 10)));
  free_host(*a);
  free_host(*b);
}

TEST_P(EngineTest, GroupCompletesOnceWithAllParts) {
  auto e = make(GetParam());
  ASSERT_TRUE(e);
  auto f = open_rw(*e, dir_.file("group.bin"));
  ASSERT_TRUE(f);
  auto a = alloc_host(3 << 20);
  ASSERT_TRUE(a.ok());
  fill_pattern(a->ptr, 3 << 20, 9);
  auto* p = static_cast<char*>(a->ptr);
  std::vector<IoRequest> parts = {{IoOpKind::kWrite, f.get(), 0, 1 << 20, p},
                                  {IoOpKind::kWrite, f.get(), 1 << 20, 1 << 20, p + (1 << 20)},
                                  {IoOpKind::kWrite, f.get(), 2 << 20, 1 << 20, p + (2 << 20)}};
  std::atomic<int> calls{0};
  IoHandle h = e->submit_group(parts, [&](const Status& s) {
    EXPECT_TRUE(s.ok());
    calls.fetch_add(1);
  });
  ASSERT_TRUE(h.wait().ok());
  EXPECT_EQ(calls.load(), 1);  // the callback ran before wait() returned
  auto file = slurp(f->path());
  ASSERT_EQ(file.size(), std::size_t{3} << 20);
  EXPECT_EQ(0, std::memcmp(file.data(), a->ptr, 3 << 20));
  free_host(*a);
}

TEST_P(EngineTest, ReadPastEndOfFileIsAnError) {
  auto e = make(GetParam());
  ASSERT_TRUE(e);
  auto f = open_rw(*e, dir_.file("short.bin"));
  ASSERT_TRUE(f);
  auto a = alloc_host(1 << 20);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(e->submit({IoOpKind::kWrite, f.get(), 0, 10000, a->ptr}).wait().ok());
  Status s = e->submit({IoOpKind::kRead, f.get(), 4096, 8192, a->ptr}).wait();
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("end of file"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(f->path()), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("10000 bytes"), std::string::npos) << s.message();
  s = e->submit({IoOpKind::kRead, f.get(), 1 << 20, 4096, a->ptr}).wait();
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s.to_string();
  EXPECT_FALSE(e->wait_all().ok());  // reports the first error since the last wait_all
  EXPECT_TRUE(e->wait_all().ok());   // and then forgets it
  // Exactly the bytes there are: fine.
  EXPECT_TRUE(e->submit({IoOpKind::kRead, f.get(), 0, 10000, a->ptr}).wait().ok());
  free_host(*a);
}

TEST_P(EngineTest, FixedBuffersFromThePinnedPool) {
  auto e = make(GetParam());
  ASSERT_TRUE(e);
  PinnedPoolOptions po;
  po.budget_bytes = 16 << 20;
  po.slab_bytes = 8 << 20;
  po.registrars = {e->buffer_registrar()};
  auto pool = PinnedPool::create(po);
  ASSERT_TRUE(pool.ok());
  auto f = open_rw(*e, dir_.file("fixed.bin"));
  ASSERT_TRUE(f);
  {
    auto a = (*pool)->allocate(4 << 20);
    auto b = (*pool)->allocate(4 << 20);
    ASSERT_TRUE(a.ok() && b.ok());
    fill_pattern(a->data(), a->size(), 3);
    ASSERT_TRUE(e->submit({IoOpKind::kWrite, f.get(), 0, a->size(), a->data()}).wait().ok());
    ASSERT_TRUE(e->submit({IoOpKind::kRead, f.get(), 0, b->size(), b->data()}).wait().ok());
    EXPECT_EQ(0, std::memcmp(a->data(), b->data(), a->size()));
  }
  if (GetParam() == "uring" && f->direct()) {
    EXPECT_GT(e->stats().fixed_buffer_pieces, 0u);
  }
  pool->reset();  // unregisters its slabs from the engine
}

TEST_P(EngineTest, InvalidRequestsCompleteWithAnError) {
  auto e = make(GetParam());
  ASSERT_TRUE(e);
  auto f = open_rw(*e, dir_.file("ro.bin"));
  ASSERT_TRUE(f);
  char c = 0;
  EXPECT_EQ(e->submit({IoOpKind::kRead, nullptr, 0, 1, &c}).wait().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e->submit({IoOpKind::kRead, f.get(), 0, 1, nullptr}).wait().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(e->submit({IoOpKind::kRead, f.get(), 0, 0, nullptr}).wait().ok());  // zero bytes: nothing to do
  auto ro = e->open(f->path(), {});
  ASSERT_TRUE(ro.ok());
  Status s = e->submit({IoOpKind::kWrite, ro->get(), 0, 1, &c}).wait();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("read-only"), std::string::npos);
  auto missing = e->open(dir_.file("nope/x"), {});
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(dir_.file("nope/x")), std::string::npos);
  (void)e->wait_all();
}

// ramfs has no direct I/O: open falls back to the page cache and everything
// still works (tmpfs supports O_DIRECT since Linux 6.6, ramfs never did).
TEST_P(EngineTest, FilesystemWithoutODirectFallsBackToBufferedIo) {
  if (!dir_.mount_fs("ramfs", "ramfs", "")) GTEST_SKIP() << "cannot mount a ramfs here (not permitted)";
  auto e = make(GetParam());
  ASSERT_TRUE(e);
  auto f = open_rw(*e, dir_.file("ramfs/x.bin"));
  ASSERT_TRUE(f);
  EXPECT_FALSE(f->direct());
  std::vector<unsigned char> a(300001), b(300001);
  fill_pattern(a.data(), a.size(), 5);
  ASSERT_TRUE(e->submit({IoOpKind::kWrite, f.get(), 777, a.size(), a.data()}).wait().ok());
  ASSERT_TRUE(e->submit({IoOpKind::kRead, f.get(), 777, b.size(), b.data()}).wait().ok());
  EXPECT_EQ(a, b);
}

TEST_P(EngineTest, FileOutlivingItsEngineIsDetached) {
  auto e = make(GetParam());
  ASSERT_TRUE(e);
  auto f = open_rw(*e, dir_.file("late.bin"));
  ASSERT_TRUE(f);
  e.reset();  // logs an error; the file's destructor must not touch the engine
  f.reset();
}

std::string backend_name(const ::testing::TestParamInfo<std::string>& info) {
  return info.param;
}
// The buffered open creates the file, the O_DIRECT one fails (here: out of
// descriptors): the file it created is removed, not left empty (a swap
// store's run directory would stay behind it).
TEST_P(EngineTest, AFailedOpenLeavesNoFileItCreated) {
  auto e = make(GetParam());
  ASSERT_TRUE(e);
  const std::string path = dir_.file("emfile.bin");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const int lowest = ::open("/dev/null", O_RDONLY);  // the next descriptor open() returns
    ::close(lowest);
    const rlimit rl{static_cast<rlim_t>(lowest + 1), static_cast<rlim_t>(lowest + 1)};
    if (lowest < 0 || ::setrlimit(RLIMIT_NOFILE, &rl) != 0) ::_exit(4);
    IoOpenOptions o;
    o.write = o.create = o.exclusive = true;
    auto f = e->open(path, o);
    const bool emfile = !f.ok() && f.status().message().find("Too many open files") != std::string::npos;
    ::_exit(f.ok() ? 2 : !emfile ? 5 : ::access(path.c_str(), F_OK) == 0 ? 3 : 0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "2: opened anyway, 3: the file was left, 4: setrlimit failed, 5: another error";
}

INSTANTIATE_TEST_SUITE_P(Backends, EngineTest, ::testing::ValuesIn(testing::backends()), backend_name);

// ---------------------------------------------------------------- choice and fallback

TEST(UringOptions, SqpollAndNoRegistration) {
  Status probe = io_backend_probe("uring");
  if (!probe.ok()) GTEST_SKIP() << "io_uring is not available here: " << probe.message();
  TempDir dir_;
  ASSERT_TRUE(dir_.ok());
  for (bool sqpoll : {true, false}) {
    IoEngineOptions o;
    o.backend = "uring";
    o.allow_fallback = false;
    o.sq_poll = sqpoll;
    o.register_files = !sqpoll;
    o.fixed_buffers = !sqpoll;
    auto e = make_io_engine(o);
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    auto f = open_rw(**e, dir_.file(sqpoll ? "sqpoll.bin" : "plain.bin"));
    ASSERT_TRUE(f);
    auto a = alloc_host(3 << 20), b = alloc_host(3 << 20);
    ASSERT_TRUE(a.ok() && b.ok());
    fill_pattern(a->ptr, 3 << 20, 21);
    ASSERT_TRUE((*e)->submit({IoOpKind::kWrite, f.get(), 8192, (3 << 20) - 5, a->ptr}).wait().ok());
    ASSERT_TRUE((*e)->submit({IoOpKind::kRead, f.get(), 8192, (3 << 20) - 5, b->ptr}).wait().ok());
    EXPECT_EQ(0, std::memcmp(a->ptr, b->ptr, (3 << 20) - 5));
    free_host(*a);
    free_host(*b);
  }
}

TEST(EngineChoice, RejectsBadOptions) {
  IoEngineOptions o;
  o.backend = "spdk";
  EXPECT_EQ(make_io_engine(o).status().code(), StatusCode::kInvalidArgument);
  o.backend = "posix";
  o.queue_depth = 5000;
  EXPECT_EQ(make_io_engine(o).status().code(), StatusCode::kInvalidArgument);
  o.queue_depth = 8;
  o.block_bytes = 1000;
  EXPECT_EQ(make_io_engine(o).status().code(), StatusCode::kInvalidArgument);
}

TEST(EngineChoice, UringForcedUnavailableFallsBack) {
  testing::ScopedEnv off("STRATA_IO_URING_DISABLE", "1");
  IoEngineOptions o;
  o.backend = "uring";
  auto e = make_io_engine(o);
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  EXPECT_STRNE((*e)->backend_name(), "uring");
  EXPECT_FALSE((*e)->fallback_reason().empty());
  o.backend = "auto";
  auto e2 = make_io_engine(o);
  ASSERT_TRUE(e2.ok());
  EXPECT_STRNE((*e2)->backend_name(), "uring");
  o.backend = "uring";
  o.allow_fallback = false;
  auto e3 = make_io_engine(o);
  EXPECT_EQ(e3.status().code(), StatusCode::kUnavailable);
  EXPECT_FALSE(io_backend_probe("uring").ok());
  EXPECT_TRUE(io_backend_probe("posix").ok());
}

// The real thing a container does: a seccomp filter that makes
// io_uring_setup fail with EPERM. Run in a child process so the filter does
// not outlive the test.
TEST(EngineChoice, UringBlockedBySeccompFallsBack) {
  if (!io_backend_probe("uring").ok()) GTEST_SKIP() << "io_uring is not available here anyway";
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) _exit(3);
    IoEngineOptions o;
    o.backend = "uring";
    auto e = make_io_engine(o);
    if (!e.ok()) _exit(4);
    if (std::string((*e)->backend_name()) == "uring") _exit(5);
    if ((*e)->fallback_reason().find("Operation not permitted") == std::string::npos) _exit(6);
    o.allow_fallback = false;
    _exit(make_io_engine(o).status().code() == StatusCode::kUnavailable ? 0 : 7);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 3) GTEST_SKIP() << "cannot install a seccomp filter here";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3 no filter, 4 no engine, 5 still uring, 6 no reason, 7 no kUnavailable";
}

// Registered buffers are charged to RLIMIT_MEMLOCK unless the process has
// CAP_IPC_LOCK. A child drops the capability and lowers the limit: the pool's
// slabs cannot be registered, and I/O must still work on the same buffers.
TEST(UringOptions, FixedBuffersRefusedByMemlockFallBackToPlainBuffers) {
  if (!io_backend_probe("uring").ok()) GTEST_SKIP() << "io_uring is not available here";
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct caps[2]{};
    if (syscall(SYS_capget, &hdr, caps) != 0) _exit(3);
    caps[CAP_TO_INDEX(CAP_IPC_LOCK)].effective &= ~CAP_TO_MASK(CAP_IPC_LOCK);
    caps[CAP_TO_INDEX(CAP_IPC_LOCK)].permitted &= ~CAP_TO_MASK(CAP_IPC_LOCK);
    if (syscall(SYS_capset, &hdr, caps) != 0) _exit(3);
    rlimit lim{64 << 10, 64 << 10};
    if (setrlimit(RLIMIT_MEMLOCK, &lim) != 0) _exit(3);
    IoEngineOptions o;
    o.backend = "uring";
    o.allow_fallback = false;
    auto e = make_io_engine(o);
    if (!e.ok()) _exit(4);
    PinnedPoolOptions po;
    po.budget_bytes = 8 << 20;
    po.slab_bytes = 4 << 20;
    po.registrars = {(*e)->buffer_registrar()};
    auto pool = PinnedPool::create(po);
    if (!pool.ok()) _exit(4);
    auto a = (*pool)->allocate(1 << 20);
    auto b = (*pool)->allocate(1 << 20);
    if (!a.ok() || !b.ok()) _exit(5);  // the pool must not fail because registration did
    IoOpenOptions fo;
    fo.write = fo.create = true;
    auto f = (*e)->open(dir.file("memlock.bin"), fo);
    if (!f.ok()) _exit(4);
    fill_pattern(a->data(), a->size(), 8);
    if (!(*e)->submit({IoOpKind::kWrite, f->get(), 0, a->size(), a->data()}).wait().ok()) _exit(6);
    if (!(*e)->submit({IoOpKind::kRead, f->get(), 0, b->size(), b->data()}).wait().ok()) _exit(6);
    if (std::memcmp(a->data(), b->data(), a->size()) != 0) _exit(7);
    if ((*e)->stats().fixed_buffer_pieces != 0) _exit(8);  // nothing was registered
    a->reset();
    b->reset();
    pool->reset();
    f->reset();
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 3) GTEST_SKIP() << "cannot drop CAP_IPC_LOCK or set RLIMIT_MEMLOCK here";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "4 setup, 5 pool failed, 6 I/O failed, 7 bytes differ, 8 registered anyway";
}

TEST(EngineChoice, AutoPicksTheFirstBackendThatWorks) {
  auto e = make_io_engine({});
  ASSERT_TRUE(e.ok());
  std::string first;
  for (const auto& b : io_backends_built())
    if (first.empty() && io_backend_probe(b).ok()) first = b;
  EXPECT_EQ((*e)->backend_name(), first);
  // Anything but io_uring is a fallback with a reason (not built, or not working here).
  EXPECT_EQ((*e)->fallback_reason().empty(), first == "uring") << (*e)->fallback_reason();
}

}  // namespace
}  // namespace strata::io
