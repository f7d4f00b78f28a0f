// The swap store on real directories: round trips, striping over three
// directories (checked in the files themselves), scratch-directory rules,
// cleanup, the real failures: unwritable directories and a full disk, and
// the block checksums: corruption on disk found by the read that meets it.
#include "io/swap_store.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "common/crc32c.h"
#include "io_test_util.h"

namespace strata::io {
namespace {

using testing::fill_pattern;
using testing::TempDir;
namespace fs = std::filesystem;

class SwapStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dir_.ok());
    auto e = make_io_engine({});
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    engine_ = std::move(e).value();
  }
  std::unique_ptr<SwapStore> make_store(std::vector<std::string> dirs, std::uint64_t stripe = 1 << 20) {
    SwapStoreOptions o;
    o.dirs = std::move(dirs);
    o.stripe_bytes = stripe;
    auto s = SwapStore::create(*engine_, o);
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    return s.ok() ? std::move(s).value() : nullptr;
  }
  TempDir dir_;
  std::unique_ptr<IoEngine> engine_;
};

TEST_F(SwapStoreTest, RoundTripTensorsOfOddSizes) {
  auto store = make_store({dir_.file("d0")});
  ASSERT_TRUE(store);
  const std::vector<std::uint64_t> sizes = {1, 4097, (3 << 20) + 5, 0, 12345};
  std::vector<SwapTensor> ts;
  std::vector<std::vector<unsigned char>> data;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    auto t = store->add_tensor("t" + std::to_string(i), sizes[i]);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    EXPECT_EQ(t->base % 4096, 0u);
    ts.push_back(*t);
    data.emplace_back(sizes[i]);
    fill_pattern(data.back().data(), sizes[i], i + 100);
    ASSERT_TRUE(store->write(*t, 0, sizes[i], data.back().data()).wait().ok());
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::vector<unsigned char> back(sizes[i]);
    ASSERT_TRUE(store->read(ts[i], 0, sizes[i], back.data()).wait().ok());
    EXPECT_EQ(back, data[i]) << "tensor " << i;
  }
  // A byte range inside a tensor, and one that is not.
  std::vector<unsigned char> part(1000);
  ASSERT_TRUE(store->read(ts[2], 4099, 1000, part.data()).wait().ok());
  EXPECT_EQ(0, std::memcmp(part.data(), data[2].data() + 4099, 1000));
  EXPECT_EQ(store->read(ts[1], 4000, 98, part.data()).wait().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(store->close().ok());
}

TEST_F(SwapStoreTest, StripesOverThreeDirectories) {
  const std::uint64_t stripe = 64 << 10;
  auto store = make_store({dir_.file("a"), dir_.file("b"), dir_.file("c")}, stripe);
  ASSERT_TRUE(store);
  ASSERT_EQ(store->dir_count(), 3u);
  const std::uint64_t n = (1 << 20) + 3;
  auto t = store->add_tensor("w", n);
  ASSERT_TRUE(t.ok());
  std::vector<unsigned char> src(n), back(n);
  fill_pattern(src.data(), n, 77);
  ASSERT_TRUE(store->write(*t, 0, n, src.data()).wait().ok());
  ASSERT_TRUE(store->read(*t, 0, n, back.data()).wait().ok());
  EXPECT_EQ(src, back);

  // Chunk k of the tensor is chunk k/3 of file k%3: read the files directly.
  std::vector<std::vector<char>> files(3);
  for (int i = 0; i < 3; ++i) {
    std::ifstream in(store->file_path(i), std::ios::binary);
    files[i].assign(std::istreambuf_iterator<char>(in), {});
    EXPECT_NE(store->file_path(i).find("rank00000.stripe" + std::to_string(i)), std::string::npos);
  }
  const std::uint64_t chunks = (n + stripe - 1) / stripe;  // 16 full chunks and one of 3 bytes
  for (std::uint64_t k = 0; k < chunks; ++k) {
    const auto& f = files[k % 3];
    const std::uint64_t off = k / 3 * stripe, len = std::min(stripe, n - k * stripe);
    ASSERT_GE(f.size(), off + len) << "file " << k % 3;
    EXPECT_EQ(0, std::memcmp(f.data() + off, src.data() + k * stripe, len)) << "chunk " << k;
  }
  EXPECT_EQ(files[0].size(), 6 * stripe);
  EXPECT_EQ(files[1].size(), 5 * stripe + 3);  // chunk 16, the 3-byte one, is file 1's sixth
  EXPECT_EQ(files[2].size(), 5 * stripe);
  EXPECT_TRUE(store->close().ok());
}

TEST_F(SwapStoreTest, PrivateFilesRemovedOnCloseAndDirectoryReusable) {
  const std::string d = dir_.file("scratch");
  ASSERT_TRUE(fs::create_directory(d));  // the user's (empty) directory: it and the marker stay
  std::string run_dir, file;
  {
    auto store = make_store({d});
    ASSERT_TRUE(store);
    run_dir = store->run_dir(0);
    file = store->file_path(0);
    ASSERT_TRUE(store->add_tensor("x", 8192).ok());
    struct stat st {};
    ASSERT_EQ(::stat(file.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_EQ(st.st_size, 8192);  // preallocated
    ASSERT_EQ(::stat(run_dir.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u);
    EXPECT_TRUE(fs::exists(d + "/.strata-scratch"));
  }  // destructor = clean shutdown
  EXPECT_FALSE(fs::exists(file));
  EXPECT_FALSE(fs::exists(run_dir));
  EXPECT_TRUE(fs::exists(d + "/.strata-scratch"));
  auto again = make_store({d});  // Strata's own directory: accepted
  EXPECT_TRUE(again);
}

// A missing directory (a mistyped nvme_path) is made, with its missing
// parents, and removed again by close() while nothing else is in it: a
// parent that gained other files stays.
TEST_F(SwapStoreTest, DirectoriesItMadeAreRemovedOnClose) {
  const std::string top = dir_.file("made"), d = top + "/a/b";
  {
    auto store = make_store({d});
    ASSERT_TRUE(store);
    ASSERT_TRUE(store->add_tensor("x", 8192).ok());
    EXPECT_TRUE(fs::exists(d + "/.strata-scratch"));
  }
  EXPECT_FALSE(fs::exists(top)) << "close() left the directories it made";
  {
    auto store = make_store({d});
    ASSERT_TRUE(store);
    std::ofstream(top + "/a/notes.txt") << "the user's\n";
  }
  EXPECT_FALSE(fs::exists(d));
  EXPECT_TRUE(fs::exists(top + "/a/notes.txt"));
}

// A relative directory is fixed when the store is made: a caller that
// changes its working directory later still gets its files removed (an
// audit found them left behind).
TEST_F(SwapStoreTest, ARelativeDirectoryOutlivesAChdir) {
  const std::string base = dir_.file("base");
  fs::create_directories(base + "/elsewhere");
  const fs::path cwd = fs::current_path();
  fs::current_path(base);
  std::string run_dir, file;
  {
    auto store = make_store({"rel_nv/"});
    ASSERT_TRUE(store);
    run_dir = store->run_dir(0);
    file = store->file_path(0);
    EXPECT_EQ(run_dir.rfind(base + "/rel_nv/", 0), 0u) << run_dir;
    ASSERT_TRUE(store->add_tensor("x", 8192).ok());
    fs::current_path(base + "/elsewhere");
  }
  fs::current_path(cwd);
  EXPECT_FALSE(fs::exists(file));
  EXPECT_FALSE(fs::exists(run_dir));
}

// A run killed with SIGKILL leaves its run directory behind. The next run
// removes those of dead processes on this host, and only those: a live
// process's, another host's and an unmarked one's are kept.
TEST_F(SwapStoreTest, RemovesRunDirectoriesOfDeadProcessesOnly) {
  const std::string d = dir_.file("scratch");
  std::string dead_dir, live_dir;
  {
    auto first = make_store({d});
    ASSERT_TRUE(first);
    ASSERT_TRUE(first->add_tensor("x", 1 << 20).ok());
    dead_dir = first->run_dir(0);
    // Copy it aside before the clean shutdown removes it: it becomes the
    // leftover of a dead process and, with our own pid, of a live one.
    fs::copy(dead_dir, d + "/strata-run-dead", fs::copy_options::recursive);
    fs::copy(dead_dir, d + "/strata-run-live", fs::copy_options::recursive);
    fs::copy(dead_dir, d + "/strata-run-other-host", fs::copy_options::recursive);
    fs::copy(dead_dir, d + "/strata-run-other-pidns", fs::copy_options::recursive);
    fs::create_directory(d + "/strata-run-unmarked");
  }
  char host[256] = {0};
  ASSERT_EQ(::gethostname(host, sizeof host - 1), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // a pid that no longer exists
  auto mark = [&](const std::string& dir, const std::string& h, long pid, const std::string& extra = "") {
    std::ofstream(d + "/" + dir + "/.strata-run") << "Strata run directory\nhost " << h << "\npid " << pid << "\n"
                                                  << extra;
  };
  mark("strata-run-dead", host, child);
  mark("strata-run-live", host, ::getpid());
  mark("strata-run-other-host", std::string(host) + "-elsewhere", child);
  // A run in another PID namespace (a container with the same host name):
  // its pid is not ours to test, so it is kept.
  mark("strata-run-other-pidns", host, child, "pidns pid:[1]\n");
  // A run killed while making its run directory (found by the crash
  // campaign: before the marker was written): only a staging directory
  // naming its pid remains, removed once that pid is gone; a live one stays.
  const std::string dead_staging = ".strata-run-staging-" + std::to_string(child) + "-strata-run-x";
  const std::string live_staging = ".strata-run-staging-" + std::to_string(::getpid()) + "-strata-run-y";
  fs::create_directory(d + "/" + dead_staging);
  fs::create_directory(d + "/" + live_staging);

  auto second = make_store({d});
  ASSERT_TRUE(second);
  EXPECT_FALSE(fs::exists(d + "/" + dead_staging));
  EXPECT_TRUE(fs::exists(d + "/" + live_staging));
  EXPECT_FALSE(fs::exists(d + "/strata-run-dead"));
  EXPECT_TRUE(fs::exists(d + "/strata-run-live"));
  EXPECT_TRUE(fs::exists(d + "/strata-run-other-host"));
  EXPECT_TRUE(fs::exists(d + "/strata-run-other-pidns"));
  EXPECT_TRUE(fs::exists(d + "/strata-run-unmarked"));
  // Its own run directory names its owner.
  std::ifstream m(second->run_dir(0) + "/.strata-run");
  std::string text((std::istreambuf_iterator<char>(m)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("pid " + std::to_string(::getpid())), std::string::npos) << text;
  EXPECT_NE(text.find(std::string("host ") + host), std::string::npos) << text;
  EXPECT_NE(text.find("pidns pid:["), std::string::npos) << text;
}

TEST_F(SwapStoreTest, RefusesANonEmptyDirectoryItDidNotCreate) {
  const std::string d = dir_.file("theirs");
  fs::create_directories(d);
  std::ofstream(d + "/precious.txt") << "keep me";
  SwapStoreOptions o;
  o.dirs = {d};
  auto s = SwapStore::create(*engine_, o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kAlreadyExists);
  EXPECT_NE(s.status().message().find(d), std::string::npos);
  EXPECT_NE(s.status().message().find("it holds precious.txt"), std::string::npos) << s.status().message();
  EXPECT_NE(s.status().message().find(d + "/strata"), std::string::npos) << s.status().message();
  o.reuse_nonempty_dirs = true;
  {
    auto s2 = SwapStore::create(*engine_, o);
    ASSERT_TRUE(s2.ok()) << s2.status().to_string();
    ASSERT_TRUE((*s2)->add_tensor("x", 100).ok());
  }
  EXPECT_TRUE(fs::exists(d + "/precious.txt"));
  EXPECT_EQ(std::distance(fs::directory_iterator(d), fs::directory_iterator()), 1);  // only theirs is left
}

// A file system's root (a mounted drive) holds only lost+found: taken as
// empty, and lost+found is left alone.
TEST_F(SwapStoreTest, AFileSystemRootWithLostAndFoundCountsAsEmpty) {
  const std::string d = dir_.file("mount");
  fs::create_directories(d + "/lost+found");
  SwapStoreOptions o;
  o.dirs = {d};
  {
    auto s = SwapStore::create(*engine_, o);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    ASSERT_TRUE((*s)->add_tensor("x", 100).ok());
  }
  EXPECT_TRUE(fs::is_directory(d + "/lost+found"));
  EXPECT_TRUE(fs::exists(d + "/.strata-scratch"));
  auto again = SwapStore::create(*engine_, o);  // its marker is there now
  ASSERT_TRUE(again.ok()) << again.status().to_string();
}

TEST_F(SwapStoreTest, UnwritableDirectoryUnderARegularFile) {
  // Root ignores permission bits, but nobody can create a directory inside a
  // regular file.
  std::ofstream(dir_.file("plain")) << "x";
  SwapStoreOptions o;
  o.dirs = {dir_.file("plain/sub")};
  auto s = SwapStore::create(*engine_, o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("Not a directory"), std::string::npos) << s.status().message();
  EXPECT_NE(s.status().message().find(dir_.file("plain")), std::string::npos) << s.status().message();
}

TEST_F(SwapStoreTest, UnwritableDirectoryOnAReadOnlyMount) {
  if (!dir_.mount_fs("ro", "tmpfs", "size=1m", MS_RDONLY)) GTEST_SKIP() << "cannot mount a tmpfs here";
  SwapStoreOptions o;
  o.dirs = {dir_.file("ro")};
  auto s = SwapStore::create(*engine_, o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kPermission) << s.status().to_string();
  EXPECT_NE(s.status().message().find("Read-only file system"), std::string::npos) << s.status().message();
}

TEST_F(SwapStoreTest, SecondDirectoryFailingRemovesTheFirstRunDirectory) {
  std::ofstream(dir_.file("plain")) << "x";
  SwapStoreOptions o;
  o.dirs = {dir_.file("good"), dir_.file("plain/bad")};
  auto s = SwapStore::create(*engine_, o);
  ASSERT_FALSE(s.ok());
  // The good directory, which the store made, is gone again.
  EXPECT_FALSE(fs::exists(dir_.file("good")));
  // One that was there stays, holding only the scratch marker.
  ASSERT_TRUE(fs::create_directory(dir_.file("good2")));
  o.dirs = {dir_.file("good2"), dir_.file("plain/bad")};
  ASSERT_FALSE(SwapStore::create(*engine_, o).ok());
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_.file("good2")), fs::directory_iterator()), 1);
}

TEST_F(SwapStoreTest, RealEnospcOnASmallTmpfs) {
  if (!dir_.mount_fs("small", "tmpfs", "size=1m"))
    GTEST_SKIP() << "cannot mount a tmpfs here (see the RLIMIT_FSIZE test)";
  auto store = make_store({dir_.file("small")});
  ASSERT_TRUE(store);
  auto t = store->add_tensor("huge", 4 << 20);  // preallocation finds the full disk
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(t.status().message().find("No space left on device"), std::string::npos) << t.status().message();
  EXPECT_NE(t.status().message().find(store->file_path(0)), std::string::npos) << t.status().message();
  EXPECT_EQ(store->reserved_bytes(), 0u);
  // A write past what the disk holds, straight through the engine.
  IoOpenOptions fo;
  fo.write = fo.create = true;
  auto f = engine_->open(dir_.file("small/direct.bin"), fo);
  ASSERT_TRUE(f.ok());
  std::vector<unsigned char> big(2 << 20, 1);
  Status s = engine_->submit({IoOpKind::kWrite, f->get(), 0, big.size(), big.data()}).wait();
  EXPECT_EQ(s.code(), StatusCode::kNoSpace) << s.to_string();
  EXPECT_NE(s.message().find(dir_.file("small/direct.bin")), std::string::npos) << s.message();
}

TEST_F(SwapStoreTest, RealEfbigFromRlimitFsize) {
  struct rlimit old {};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  auto prev = ::signal(SIGXFSZ, SIG_IGN);  // the write then fails with EFBIG instead of killing us
  struct rlimit lim = old;
  lim.rlim_cur = 1 << 20;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &lim), 0);
  auto store = make_store({dir_.file("fsize")});
  Status add, write;
  if (store) {
    auto t = store->add_tensor("huge", 4 << 20);
    add = t.ok() ? Status() : t.status();
    IoOpenOptions fo;
    fo.write = fo.create = true;
    auto f = engine_->open(dir_.file("fsize/w.bin"), fo);
    if (f.ok()) {
      std::vector<unsigned char> big(2 << 20, 1);
      write = engine_->submit({IoOpKind::kWrite, f->get(), 0, big.size(), big.data()}).wait();
    }
  }
  setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, prev);
  ASSERT_TRUE(store);
  EXPECT_EQ(add.code(), StatusCode::kNoSpace) << add.to_string();
  EXPECT_EQ(write.code(), StatusCode::kNoSpace) << write.to_string();
  EXPECT_NE(write.message().find("File too large"), std::string::npos) << write.message();
}

// A size whose end wraps past 2^64 used to be accepted: the tensor then
// overlapped the ones before it (its reads and writes landed on their bytes).
TEST_F(SwapStoreTest, TensorSizeThatWrapsIsRefused) {
  auto store = make_store({dir_.file("wrap")});
  ASSERT_TRUE(store);
  auto a = store->add_tensor("a", 10000);
  ASSERT_TRUE(a.ok());
  auto huge = store->add_tensor("huge", ~std::uint64_t{0} - 4096);
  EXPECT_FALSE(huge.ok()) << "tensor at " << huge->base << " of " << huge->bytes << " bytes";
  if (!huge.ok()) {
    EXPECT_EQ(huge.status().code(), StatusCode::kInvalidArgument) << huge.status().to_string();
    EXPECT_NE(huge.status().message().find("huge"), std::string::npos) << huge.status().message();
  }
  EXPECT_EQ(store->reserved_bytes(), 10000u);
  std::vector<unsigned char> buf(100);
  if (huge.ok()) {  // it must not reach tensor a's bytes
    EXPECT_FALSE(store->write(*huge, ~std::uint64_t{0} - 4096 - huge->base, 100, buf.data()).wait().ok());
  }
  EXPECT_TRUE(store->close().ok());
}

TEST_F(SwapStoreTest, RankIsInTheFileNames) {
  SwapStoreOptions o;
  o.dirs = {dir_.file("r")};
  o.rank = 3;
  o.run_name = "strata-run-job42";
  auto s = SwapStore::create(*engine_, o);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ((*s)->file_path(0), dir_.file("r/strata-run-job42/rank00003.stripe0.swap"));
  o.rank = 4;  // another rank of the same job shares the run directory
  auto s2 = SwapStore::create(*engine_, o);
  ASSERT_TRUE(s2.ok()) << s2.status().to_string();
  s->reset();
  EXPECT_TRUE(fs::exists(dir_.file("r/strata-run-job42")));  // rank 4 still uses it
  s2->reset();
  EXPECT_FALSE(fs::exists(dir_.file("r/strata-run-job42")));
}

// ---------------------------------------------------------------- checksums

class SwapChecksumTest : public SwapStoreTest {
 protected:
  std::unique_ptr<SwapStore> make_checked(std::vector<std::string> dirs, std::uint64_t block = 8192,
                                          std::uint64_t stripe = 64 << 10) {
    SwapStoreOptions o;
    o.dirs = std::move(dirs);
    o.stripe_bytes = stripe;
    o.checksum_block = block;
    auto s = SwapStore::create(*engine_, o);
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    return s.ok() ? std::move(s).value() : nullptr;
  }
  // Flips one byte of the files at virtual offset `v` behind the store's back.
  static void flip_byte(const SwapStore& store, const SwapTensor& t, std::uint64_t at) {
    auto r = store.file_ranges(t, at, 1);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    const int fd = ::open((*r)[0].path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    unsigned char c = 0;
    ASSERT_EQ(::pread(fd, &c, 1, static_cast<off_t>((*r)[0].offset)), 1);
    c ^= 0x40;
    ASSERT_EQ(::pwrite(fd, &c, 1, static_cast<off_t>((*r)[0].offset)), 1);
    ::close(fd);
  }
};

TEST_F(SwapChecksumTest, RoundTripsAndNeverWrittenBlocksReadAsZeros) {
  auto store = make_checked({dir_.file("a"), dir_.file("b")});
  ASSERT_TRUE(store);
  const std::uint64_t n = 5 * 8192 + 100;  // a short last block
  auto t = store->add_tensor("layers.0.w.master", n);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(store->block_count(*t), 6u);
  EXPECT_EQ(store->checksum_bytes(), 6u * 4);
  std::vector<unsigned char> zeros(n, 1);
  ASSERT_TRUE(store->read(*t, 0, n, zeros.data()).wait().ok());
  EXPECT_TRUE(std::all_of(zeros.begin(), zeros.end(), [](unsigned char c) { return c == 0; }));
  std::vector<unsigned char> data(n), back(n);
  fill_pattern(data.data(), n, 7);
  ASSERT_TRUE(store->write(*t, 0, 2 * 8192, data.data()).wait().ok());
  ASSERT_TRUE(store->write(*t, 2 * 8192, n - 2 * 8192, data.data() + 2 * 8192).wait().ok());
  ASSERT_TRUE(store->read(*t, 8192, n - 8192, back.data() + 8192).wait().ok());
  ASSERT_TRUE(store->read(*t, 0, 8192, back.data()).wait().ok());
  EXPECT_EQ(back, data);
  // The table is the CRC of each block, as crc32c_blocks gives it.
  std::vector<std::uint32_t> crcs(6);
  crc32c_blocks(data.data(), n, 8192, crcs.data());
  EXPECT_TRUE(store->verify_checksums(*t, crcs).ok());
}

TEST_F(SwapChecksumTest, ABitFlippedOnDiskFailsTheReadThatMeetsItNamingTensorFileAndOffset) {
  auto store = make_checked({dir_.file("a")});
  ASSERT_TRUE(store);
  const std::uint64_t n = 8 * 8192;
  auto other = store->add_tensor("other", 8192);
  auto t = store->add_tensor("layers.3.mlp.up.exp_avg", n);
  ASSERT_TRUE(t.ok() && other.ok());
  std::vector<unsigned char> data(n), back(n);
  fill_pattern(data.data(), n, 3);
  ASSERT_TRUE(store->write(*t, 0, n, data.data()).wait().ok());
  flip_byte(*store, *t, 5 * 8192 + 17);
  // Reads of other blocks still work; the one holding the flip fails.
  ASSERT_TRUE(store->read(*t, 0, 5 * 8192, back.data()).wait().ok());
  bool called = false;
  Status in_callback;
  Status st = store->read(*t, 4 * 8192, 4 * 8192, back.data(), [&](const Status& s) {
                     called = true;
                     in_callback = s;
                   }).wait();
  EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.to_string();
  EXPECT_TRUE(called);
  EXPECT_EQ(in_callback.code(), StatusCode::kCorrupt);
  const std::string m = st.to_string();
  EXPECT_NE(m.find("layers.3.mlp.up.exp_avg"), std::string::npos) << m;
  EXPECT_NE(m.find("bytes [40960, 49152)"), std::string::npos) << m;
  EXPECT_NE(m.find(store->file_path(0)), std::string::npos) << m;
  // t starts one 4 KiB-aligned tensor (8192 bytes) after `other`.
  EXPECT_NE(m.find("offset " + std::to_string(8192 + 5 * 8192)), std::string::npos) << m;
  // A checkpoint-style copy finds it too.
  std::vector<std::uint32_t> crcs(8);
  fill_pattern(data.data(), n, 3);
  data[5 * 8192 + 17] ^= 0x40;
  crc32c_blocks(data.data(), n, 8192, crcs.data());
  EXPECT_EQ(store->verify_checksums(*t, crcs).code(), StatusCode::kCorrupt);
  // Rewriting the block makes it good again.
  fill_pattern(data.data(), n, 3);
  ASSERT_TRUE(store->write(*t, 5 * 8192, 8192, data.data() + 5 * 8192).wait().ok());
  ASSERT_TRUE(store->read(*t, 0, n, back.data()).wait().ok());
  EXPECT_EQ(back, data);
}

TEST_F(SwapChecksumTest, GarbageInUnwrittenSpaceIsFoundToo) {
  auto store = make_checked({dir_.file("a")}, 4096);
  ASSERT_TRUE(store);
  auto t = store->add_tensor("grads", 3 * 4096);
  ASSERT_TRUE(t.ok());
  flip_byte(*store, *t, 4096);
  std::vector<unsigned char> back(3 * 4096);
  EXPECT_EQ(store->read(*t, 0, 3 * 4096, back.data()).wait().code(), StatusCode::kCorrupt);
}

TEST_F(SwapChecksumTest, TransfersThatSplitABlockAreRefused) {
  auto store = make_checked({dir_.file("a")});
  ASSERT_TRUE(store);
  const std::uint64_t n = 3 * 8192 + 10;
  auto t = store->add_tensor("w", n);
  ASSERT_TRUE(t.ok());
  std::vector<unsigned char> buf(n);
  for (auto [off, len] : {std::pair<std::uint64_t, std::uint64_t>{4096, 8192}, {0, 4096}, {8192, 8193}}) {
    EXPECT_EQ(store->write(*t, off, len, buf.data()).wait().code(), StatusCode::kInvalidArgument) << off << "+" << len;
    EXPECT_EQ(store->read(*t, off, len, buf.data()).wait().code(), StatusCode::kInvalidArgument) << off << "+" << len;
  }
  // Whole blocks, and a range that ends at the tensor's end, are fine.
  EXPECT_TRUE(store->write(*t, 8192, n - 8192, buf.data()).wait().ok());
  EXPECT_TRUE(store->read(*t, 2 * 8192, n - 2 * 8192, buf.data()).wait().ok());
  EXPECT_TRUE(store->read(*t, 0, 0, buf.data()).wait().ok());
}

TEST_F(SwapChecksumTest, SetChecksumsAfterACopyBehindTheStore) {
  auto store = make_checked({dir_.file("a"), dir_.file("b")}, 4096, 4096);
  ASSERT_TRUE(store);
  const std::uint64_t n = 5 * 4096;
  auto t = store->add_tensor("w", n);
  ASSERT_TRUE(t.ok());
  std::vector<unsigned char> data(n), back(n);
  fill_pattern(data.data(), n, 11);
  // Put the bytes in place through file_ranges, as a checkpoint load does.
  auto ranges = store->file_ranges(*t, 0, n);
  ASSERT_TRUE(ranges.ok());
  std::uint64_t at = 0;
  for (const auto& r : *ranges) {
    ASSERT_EQ(::pwrite(r.fd, data.data() + at, r.length, static_cast<off_t>(r.offset)),
              static_cast<ssize_t>(r.length));
    at += r.length;
  }
  EXPECT_EQ(store->read(*t, 0, n, back.data()).wait().code(), StatusCode::kCorrupt);
  std::vector<std::uint32_t> crcs(5);
  crc32c_blocks(data.data(), n, 4096, crcs.data());
  ASSERT_TRUE(store->set_checksums(*t, crcs).ok());
  ASSERT_TRUE(store->read(*t, 0, n, back.data()).wait().ok());
  EXPECT_EQ(back, data);
  EXPECT_EQ(store->set_checksums(*t, std::span<const std::uint32_t>(crcs.data(), 4)).code(),
            StatusCode::kInvalidArgument);
}

TEST_F(SwapChecksumTest, BadBlockSizesAreRefused) {
  for (std::uint64_t b : {std::uint64_t{1}, std::uint64_t{2048}, std::uint64_t{12288}}) {
    SwapStoreOptions o;
    o.dirs = {dir_.file("x")};
    o.checksum_block = b;
    EXPECT_EQ(SwapStore::create(*engine_, o).status().code(), StatusCode::kInvalidArgument) << b;
  }
}

}  // namespace
}  // namespace strata::io
