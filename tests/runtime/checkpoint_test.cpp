// Checkpoints (src/runtime/checkpoint.h):
// round trips from memory and from file ranges with every copy method, every
// kind of damage refused with the file named, atomic replacement, failed and
// crashed saves. Real files under STRATA_TEST_DIR (else /tmp): label nvme.
#include "runtime/checkpoint.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/fs.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/crc32c.h"
#include "test_util/pattern.h"
#include "test_util/temp_dir.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ------------------------------------------------------------------ helpers

// A temp directory named for these tests (test_util/temp_dir.h).
class TempDir : public ::strata::testing::TempDir {
 public:
  explicit TempDir(const char* base = nullptr) : ::strata::testing::TempDir("strata-ck-test", base) {}
};

using ::strata::testing::pattern;

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

// Siblings of `dir` that a save leaves behind (<dir>.tmp-*, <dir>.old-*).
std::vector<std::string> leftovers(const std::string& dir) {
  std::vector<std::string> out;
  const std::string base = fs::path(dir).filename().string();
  for (const auto& e : fs::directory_iterator(fs::path(dir).parent_path())) {
    const std::string n = e.path().filename().string();
    if (n.rfind(base + ".tmp-", 0) == 0 || n.rfind(base + ".old-", 0) == 0) out.push_back(n);
  }
  return out;
}

struct Saved {
  std::string name;
  DType dtype;
  std::vector<uint8_t> bytes;
};

// Saves `entries` from memory as a world_size 1 checkpoint.
Status save_buffers(const std::string& dir, uint64_t step, const std::vector<Saved>& entries,
                    const CheckpointWriteOptions& options = {}) {
  CheckpointInfo info;
  info.step = step;
  info.loss_scale = 1024.0;
  STRATA_ASSIGN_OR_RETURN(auto w, CheckpointWriter::create(dir, info, options));
  for (const auto& e : entries) {
    STRATA_RETURN_IF_ERROR(
        w->add_buffer(e.name, e.dtype, e.bytes.size() / dtype_size(e.dtype), e.bytes.data(), e.bytes.size()));
  }
  return w->commit();
}

std::vector<Saved> small_model() {
  return {{"layers.0.attn.q.master", DType::kF32, pattern(4 * 1001, 1)},
          {"layers.0.attn.q.exp_avg", DType::kF32, pattern(4 * 1001, 2)},
          {"layers.0.attn.q.compute", DType::kBF16, pattern(2 * 4097, 3)},
          {"empty", DType::kF16, {}},
          {"odd", DType::kU8, pattern(3, 4)}};
}

// Re-signs a manifest (and the index's record of it) after a test edited it,
// so that the schema checks behind the checksum can be reached.
void rewrite_manifest(const std::string& dir, const std::function<void(json&)>& edit) {
  auto resign = [](json& doc) {
    doc.erase("self_crc32c");
    const std::string canon = doc.dump();
    char hex[16];
    std::snprintf(hex, sizeof(hex), "0x%08x", crc32c(canon.data(), canon.size()));
    doc["self_crc32c"] = hex;
    return std::string(hex);
  };
  json m = json::parse(read_text(dir + "/manifest.rank0.json"));
  edit(m);
  const std::string mcrc = resign(m);
  write_text(dir + "/manifest.rank0.json", m.dump(2));
  json idx = json::parse(read_text(dir + "/index.json"));
  idx["shards"][0]["manifest_crc32c"] = mcrc;
  resign(idx);
  write_text(dir + "/index.json", idx.dump(2));
}

// Whether files under tmp can share extents (XFS with reflink, btrfs).
bool reflink_supported(const TempDir& tmp) {
  write_file(tmp.file("probe.a"), pattern(4096, 1));
  int a = ::open(tmp.file("probe.a").c_str(), O_RDONLY);
  int b = ::open(tmp.file("probe.b").c_str(), O_WRONLY | O_CREAT, 0600);
  const bool ok = a >= 0 && b >= 0 && ::ioctl(b, FICLONE, a) == 0;
  if (a >= 0) ::close(a);
  if (b >= 0) ::close(b);
  ::unlink(tmp.file("probe.a").c_str());
  ::unlink(tmp.file("probe.b").c_str());
  return ok;
}

bool contains(const std::string& hay, const std::string& needle) {
  return hay.find(needle) != std::string::npos;
}

// ------------------------------------------------------------------ round trips

TEST(Checkpoint, RoundTripFromBuffers) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string dir = tmp.file("step-20");
  const auto model = small_model();
  CheckpointInfo info;
  info.step = 20;
  info.loss_scale = 65536.0;
  info.extra_json = R"({"data_position": {"epoch": 3, "offset": 123456789012}, "note": "q\"uote"})";
  info.extra_bytes = pattern(777, 11);
  auto w = CheckpointWriter::create(dir, info);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  for (const auto& e : model) {
    ASSERT_TRUE(
        (*w)->add_buffer(e.name, e.dtype, e.bytes.size() / dtype_size(e.dtype), e.bytes.data(), e.bytes.size())
            .ok());
  }
  const std::string staging = (*w)->staging_dir();
  EXPECT_TRUE(fs::exists(staging));
  EXPECT_FALSE(fs::exists(dir)) << "nothing is visible under the final name before commit";
  ASSERT_TRUE((*w)->commit().ok());
  EXPECT_FALSE(fs::exists(staging));
  EXPECT_TRUE(leftovers(dir).empty());
  EXPECT_TRUE(fs::exists(dir + "/index.json"));
  EXPECT_TRUE(fs::exists(dir + "/manifest.rank0.json"));
  EXPECT_TRUE(fs::exists(dir + "/layers.0.attn.q.master.rank0.bin"));

  auto r = CheckpointReader::open(dir);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const auto& got = (*r)->info();
  EXPECT_EQ(got.step, 20u);
  EXPECT_EQ(got.loss_scale, 65536.0);
  EXPECT_EQ(got.world_size, 1u);
  EXPECT_EQ(got.rank, 0u);
  EXPECT_EQ(json::parse(got.extra_json), json::parse(info.extra_json));
  EXPECT_EQ(got.extra_bytes, info.extra_bytes);
  ASSERT_EQ((*r)->entries().size(), model.size());
  for (const auto& e : model) {
    const CheckpointEntry* ce = (*r)->find(e.name);
    ASSERT_NE(ce, nullptr) << e.name;
    EXPECT_EQ(ce->dtype, e.dtype);
    EXPECT_EQ(ce->bytes, e.bytes.size());
    EXPECT_EQ(ce->count, e.bytes.size() / dtype_size(e.dtype));
    EXPECT_EQ(ce->crc32c, crc32c(e.bytes.data(), e.bytes.size()));
    std::vector<uint8_t> back(e.bytes.size());
    ASSERT_TRUE((*r)->read(e.name, back.data(), back.size()).ok()) << e.name;
    EXPECT_EQ(back, e.bytes) << e.name;
  }
  std::vector<uint8_t> wrong(5);
  EXPECT_EQ((*r)->read("layers.0.attn.q.master", wrong.data(), wrong.size()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*r)->read("no.such", wrong.data(), wrong.size()).code(), StatusCode::kNotFound);
}

TEST(Checkpoint, WriterRefusesBadEntries) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  auto w = CheckpointWriter::create(tmp.file("ck"), CheckpointInfo{});
  ASSERT_TRUE(w.ok());
  uint8_t b[8] = {};
  EXPECT_EQ((*w)->add_buffer("", DType::kU8, 1, b, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*w)->add_buffer("x", DType::kF32, 3, b, 8).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE((*w)->add_buffer("x", DType::kF32, 2, b, 8).ok());
  EXPECT_EQ((*w)->add_buffer("x", DType::kF32, 2, b, 8).code(), StatusCode::kInvalidArgument);
  // Names that sanitize to the same file get distinct files.
  ASSERT_TRUE((*w)->add_buffer("a/b", DType::kU8, 1, b, 1).ok());
  ASSERT_TRUE((*w)->add_buffer("a_b", DType::kU8, 1, b, 1).ok());
  ASSERT_TRUE((*w)->add_buffer("../../etc/passwd", DType::kU8, 1, b, 1).ok());
  ASSERT_TRUE((*w)->add_buffer("extra", DType::kU8, 1, b, 1).ok());
  std::set<std::string> files;
  for (const auto& e : (*w)->entries()) {
    EXPECT_TRUE(files.insert(e.file).second) << e.file;
    EXPECT_EQ(e.file.find('/'), std::string::npos);
    EXPECT_NE(e.file[0], '.');
  }
  EXPECT_TRUE((*w)->commit().ok());
  EXPECT_TRUE(CheckpointReader::open(tmp.file("ck")).ok());

  CheckpointInfo bad;
  bad.loss_scale = 0;
  EXPECT_EQ(CheckpointWriter::create(tmp.file("ck2"), bad).status().code(), StatusCode::kInvalidArgument);
  bad.loss_scale = 1;
  bad.extra_json = "{not json";
  EXPECT_EQ(CheckpointWriter::create(tmp.file("ck2"), bad).status().code(), StatusCode::kInvalidArgument);
  CheckpointWriteOptions two;
  two.world_size = 2;  // no token
  EXPECT_EQ(CheckpointWriter::create(tmp.file("ck2"), CheckpointInfo{}, two).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(leftovers(tmp.file("ck2")).empty());
}

class CopyMethodTest : public ::testing::TestWithParam<CopyMethod> {};

// A tensor striped over two swap-like files at odd offsets, saved from file
// ranges and loaded back into other file ranges.
TEST_P(CopyMethodTest, RoundTripFromFileRanges) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const auto a = pattern(3 * 4096 + 123, 21), b = pattern(5 * 4096 + 1, 22);
  write_file(tmp.file("swap0"), a);
  write_file(tmp.file("swap1"), b);
  // Aligned whole-block ranges (reflink-able) mixed with odd ones.
  std::vector<FileRange> src = {{tmp.file("swap0"), -1, 4096, 8192},
                                {tmp.file("swap1"), -1, 0, 4096},
                                {tmp.file("swap0"), -1, 7, 1001},
                                {tmp.file("swap1"), -1, 4096, 4097}};
  std::vector<uint8_t> expect;
  for (const auto& r : src) {
    const auto& f = r.path == tmp.file("swap0") ? a : b;
    expect.insert(expect.end(), f.begin() + static_cast<long>(r.offset),
                  f.begin() + static_cast<long>(r.offset + r.length));
  }
  // One more entry through a borrowed descriptor.
  int fd = ::open(tmp.file("swap1").c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  std::vector<FileRange> by_fd = {{"", fd, 100, 999}};

  CheckpointWriteOptions wo;
  wo.copy_method = GetParam();
  wo.buffer_bytes = 4096;  // many pieces
  auto w = CheckpointWriter::create(tmp.file("ck"), CheckpointInfo{}, wo);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  ASSERT_TRUE((*w)->add_file_ranges("striped", DType::kU8, expect.size(), src).ok());
  ASSERT_TRUE((*w)->add_file_ranges("by_fd", DType::kU8, 999, by_fd).ok());
  ASSERT_TRUE((*w)->add_file_ranges("empty", DType::kF32, 0, {}).ok());
  EXPECT_EQ((*w)->add_file_ranges("short", DType::kF32, 1000, by_fd).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE((*w)->commit().ok());
  ::close(fd);
  const CopyStats s = (*w)->copy_stats();
  std::printf("%s: reflink %llu, copy_file_range %llu, read/write %llu bytes\n", copy_method_name(GetParam()),
              (unsigned long long)s.reflink_bytes, (unsigned long long)s.copy_file_range_bytes,
              (unsigned long long)s.read_write_bytes);
  EXPECT_EQ(s.reflink_bytes + s.copy_file_range_bytes + s.read_write_bytes, expect.size() + 999);
  if (GetParam() == CopyMethod::kReadWrite) {
    EXPECT_EQ(s.read_write_bytes, expect.size() + 999);
  }
  const bool reflink = reflink_supported(tmp);
  const bool wants_reflink = GetParam() == CopyMethod::kAuto || GetParam() == CopyMethod::kReflink;
  if (wants_reflink && reflink) {
    EXPECT_EQ(s.reflink_bytes, 8192u + 4096u) << "the two block-aligned ranges are cloned";
  } else if (wants_reflink) {
    std::printf("reflink not supported under %s: the fallback ran (use STRATA_TEST_DIR on XFS or btrfs to test it)\n",
                tmp.path().c_str());
  }
  if (GetParam() == CopyMethod::kCopyFileRange) {
    EXPECT_EQ(s.reflink_bytes, 0u);
  }

  auto r = CheckpointReader::open(tmp.file("ck"), {.copy_method = GetParam(), .buffer_bytes = 4096});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ((*r)->find("striped")->crc32c, crc32c(expect.data(), expect.size()));
  std::vector<uint8_t> back(expect.size());
  ASSERT_TRUE((*r)->read("striped", back.data(), back.size()).ok());
  EXPECT_EQ(back, expect);

  // Stream back into a destination split over two files, one pre-existing.
  write_file(tmp.file("dst1"), std::vector<uint8_t>(20000, 0xEE));
  std::vector<FileRange> dst = {{tmp.file("dst0"), -1, 0, 8192}, {tmp.file("dst1"), -1, 333, expect.size() - 8192}};
  ASSERT_TRUE((*r)->read_to_file_ranges("striped", dst).ok());
  auto d0 = read_file(tmp.file("dst0")), d1 = read_file(tmp.file("dst1"));
  ASSERT_EQ(d0.size(), 8192u);
  EXPECT_TRUE(std::equal(d0.begin(), d0.end(), expect.begin()));
  EXPECT_TRUE(std::equal(expect.begin() + 8192, expect.end(), d1.begin() + 333));
  EXPECT_EQ(d1[332], 0xEE);
  EXPECT_EQ(d1.size(), 20000u) << "destination files are never truncated";
  EXPECT_TRUE((*r)->read_to_file_ranges("empty", {}).ok());
  if (wants_reflink && reflink) {
    EXPECT_GE((*r)->copy_stats().reflink_bytes, 8192u);
  }
}

INSTANTIATE_TEST_SUITE_P(Methods, CopyMethodTest,
                         ::testing::Values(CopyMethod::kAuto, CopyMethod::kReflink, CopyMethod::kCopyFileRange,
                                           CopyMethod::kReadWrite),
                         [](const auto& info) {
                           switch (info.param) {
                             case CopyMethod::kAuto:
                               return std::string("Auto");
                             case CopyMethod::kReflink:
                               return std::string("Reflink");
                             case CopyMethod::kCopyFileRange:
                               return std::string("CopyFileRange");
                             default:
                               return std::string("ReadWrite");
                           }
                         });

TEST(Checkpoint, SourceRangePastEndOfFileIsAnError) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  write_file(tmp.file("src"), pattern(1000, 1));
  auto w = CheckpointWriter::create(tmp.file("ck"), CheckpointInfo{});
  ASSERT_TRUE(w.ok());
  std::vector<FileRange> src = {{tmp.file("src"), -1, 500, 600}};
  Status st = (*w)->add_file_ranges("x", DType::kU8, 600, src);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_TRUE(contains(st.message(), "which has 1000 bytes")) << st.message();
  std::vector<FileRange> missing = {{tmp.file("nope"), -1, 0, 1}};
  EXPECT_EQ((*w)->add_file_ranges("y", DType::kU8, 1, missing).code(), StatusCode::kInvalidArgument)
      << "a failed writer refuses further entries";
  w = Status(StatusCode::kCancelled, "dropped");  // destroys the writer
  EXPECT_TRUE(leftovers(tmp.file("ck")).empty());
  auto w2 = CheckpointWriter::create(tmp.file("ck"), CheckpointInfo{});
  ASSERT_TRUE(w2.ok());
  Status ms = (*w2)->add_file_ranges("y", DType::kU8, 1, missing);
  EXPECT_EQ(ms.code(), StatusCode::kNotFound);
  EXPECT_TRUE(contains(ms.message(), tmp.file("nope"))) << ms.message();
  w2 = Status(StatusCode::kCancelled, "dropped");
  EXPECT_TRUE(leftovers(tmp.file("ck")).empty()) << "a failed writer removes its staging directory";
}

// The swap store keeps O_DIRECT descriptors; the checkpoint code reopens them
// buffered rather than failing on its unaligned buffer. A write-only
// destination descriptor is reopened read-write for the checksum pass.
TEST(Checkpoint, BorrowedDirectAndWriteOnlyDescriptors) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const auto data = pattern(3 * 4096, 31);
  write_file(tmp.file("swap"), data);
  int fd = ::open(tmp.file("swap").c_str(), O_RDONLY | O_DIRECT);
  if (fd < 0) GTEST_SKIP() << "O_DIRECT refused by this filesystem: " << std::strerror(errno);
  for (CopyMethod m : {CopyMethod::kAuto, CopyMethod::kReadWrite}) {
    SCOPED_TRACE(copy_method_name(m));
    const std::string dir = tmp.file(std::string("ck-") + (m == CopyMethod::kAuto ? "auto" : "rw"));
    CheckpointWriteOptions wo;
    wo.copy_method = m;
    auto w = CheckpointWriter::create(dir, CheckpointInfo{}, wo);
    ASSERT_TRUE(w.ok());
    std::vector<FileRange> src = {{"", fd, 5, 10000}};
    Status st = (*w)->add_file_ranges("x", DType::kU8, 10000, src);
    ASSERT_TRUE(st.ok()) << st.to_string();
    ASSERT_TRUE((*w)->commit().ok());
    auto r = CheckpointReader::open(dir, {.copy_method = m});
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    int out = ::open(tmp.file("out").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ASSERT_GE(out, 0);
    std::vector<FileRange> dst = {{"", out, 0, 10000}};
    st = (*r)->read_to_file_ranges("x", dst);
    ::close(out);
    ASSERT_TRUE(st.ok()) << st.to_string();
    const auto back = read_file(tmp.file("out"));
    ASSERT_EQ(back.size(), 10000u);
    EXPECT_TRUE(std::equal(back.begin(), back.end(), data.begin() + 5));
  }
  ::close(fd);
}

TEST(Checkpoint, StreamsA64MiBEntryThroughASmallBuffer) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::size_t n = (64u << 20) + 4097;  // not a multiple of anything
  const auto data = pattern(n, 64);
  write_file(tmp.file("big.swap"), data);
  const uint32_t want = crc32c(data.data(), n);
  CheckpointWriteOptions wo;
  wo.buffer_bytes = 1 << 20;
  auto w = CheckpointWriter::create(tmp.file("ck"), CheckpointInfo{}, wo);
  ASSERT_TRUE(w.ok());
  std::vector<FileRange> src = {{tmp.file("big.swap"), -1, 0, n}};
  ASSERT_TRUE((*w)->add_file_ranges("big", DType::kU8, n, src).ok());
  ASSERT_TRUE((*w)->commit().ok());
  EXPECT_EQ((*w)->entries()[0].crc32c, want);

  auto r = CheckpointReader::open(tmp.file("ck"), {.buffer_bytes = 1 << 20});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  std::vector<FileRange> dst = {{tmp.file("restored.swap"), -1, 0, n}};
  ASSERT_TRUE((*r)->read_to_file_ranges("big", dst).ok());
  const auto back = read_file(tmp.file("restored.swap"));
  ASSERT_EQ(back.size(), n);
  EXPECT_EQ(crc32c(back.data(), n), want);
  EXPECT_TRUE(back == data);
}

// Reflink needs a filesystem that shares extents. Where mkfs.xfs and loop
// mounts are available (root in a VM), the test makes a small XFS image so the
// clone path runs by default; elsewhere it skips and says why.
TEST(Checkpoint, ReflinkOnAnXfsLoopImage) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  if (std::system("command -v mkfs.xfs >/dev/null 2>&1") != 0) GTEST_SKIP() << "mkfs.xfs is not installed (xfsprogs)";
  const std::string img = tmp.file("xfs.img");
  { std::ofstream(img).close(); }
  ASSERT_EQ(::truncate(img.c_str(), 320ll << 20), 0);
  if (std::system(("mkfs.xfs -q -m reflink=1 " + img + " >/dev/null 2>&1").c_str()) != 0) {
    GTEST_SKIP() << "mkfs.xfs could not make a reflink filesystem";
  }
  const std::string mnt = tmp.file("xfs");
  ::mkdir(mnt.c_str(), 0700);
  if (std::system(("mount -o loop " + img + " " + mnt + " >/dev/null 2>&1").c_str()) != 0) {
    GTEST_SKIP() << "cannot loop-mount an image here (needs CAP_SYS_ADMIN and /dev/loop*)";
  }
  struct Unmount {
    std::string m;
    ~Unmount() { umount2(m.c_str(), MNT_DETACH); }
  } unmount{mnt};
  const std::size_t n = (8u << 20) + 123;  // aligned start, unaligned end at the source's EOF
  const auto data = pattern(n, 77);
  write_file(mnt + "/swap", data);
  CheckpointWriteOptions wo;
  wo.copy_method = CopyMethod::kReflink;
  auto w = CheckpointWriter::create(mnt + "/ck", CheckpointInfo{}, wo);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  std::vector<FileRange> src = {{mnt + "/swap", -1, 0, n}};
  ASSERT_TRUE((*w)->add_file_ranges("cloned", DType::kU8, n, src).ok());
  ASSERT_TRUE((*w)->commit().ok());
  EXPECT_EQ((*w)->copy_stats().reflink_bytes, n);
  EXPECT_EQ((*w)->entries()[0].crc32c, crc32c(data.data(), n)) << "the clone was read for its checksum";
  auto r = CheckpointReader::open(mnt + "/ck", {.copy_method = CopyMethod::kReflink});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  std::vector<FileRange> dst = {{mnt + "/restored", -1, 0, n}};
  ASSERT_TRUE((*r)->read_to_file_ranges("cloned", dst).ok());
  EXPECT_EQ((*r)->copy_stats().reflink_bytes, n);
  EXPECT_TRUE(read_file(mnt + "/restored") == data);
  // Damage after the clone is still caught: the files no longer share it.
  auto bytes = read_file(mnt + "/ck/cloned.rank0.bin");
  bytes[4096] ^= 1;
  write_file(mnt + "/ck/cloned.rank0.bin", bytes);
  EXPECT_EQ(CheckpointReader::open(mnt + "/ck").status().code(), StatusCode::kCorrupt);
  w = Status(StatusCode::kCancelled, "done");
  r = Status(StatusCode::kCancelled, "done");
}

// ------------------------------------------------------------------ damage

class DamagedCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(tmp_.ok());
    dir_ = tmp_.file("step-20");
    ASSERT_TRUE(save_buffers(dir_, 20, small_model()).ok());
  }
  Status open_status(bool verify_all = true) {
    return CheckpointReader::open(dir_, {.verify_all = verify_all}).status();
  }
  TempDir tmp_;
  std::string dir_;
  const std::string file_ = "layers.0.attn.q.master.rank0.bin";
};

TEST_F(DamagedCheckpoint, FlippedByteIsRefusedNamingTheFile) {
  const std::string path = dir_ + "/" + file_;
  auto bytes = read_file(path);
  bytes[1234] ^= 0x10;
  write_file(path, bytes);
  Status st = open_status();
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(st.message(), "checkpoint " + dir_ + ": " + file_ + ": checksum 0x")) << st.message();
  EXPECT_TRUE(contains(st.message(), "manifest says 0x")) << st.message();
  // Without the up-front pass, the read itself refuses the bytes.
  auto r = CheckpointReader::open(dir_, {.verify_all = false});
  ASSERT_TRUE(r.ok());
  std::vector<uint8_t> buf(bytes.size());
  EXPECT_EQ((*r)->read("layers.0.attn.q.master", buf.data(), buf.size()).code(), StatusCode::kCorrupt);
  std::vector<FileRange> dst = {{tmp_.file("out"), -1, 0, bytes.size()}};
  Status rs = (*r)->read_to_file_ranges("layers.0.attn.q.master", dst);
  EXPECT_EQ(rs.code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(rs.message(), file_)) << rs.message();
  EXPECT_EQ((*r)->verify_all().code(), StatusCode::kCorrupt);
  std::vector<uint8_t> ok(4 * 1001);
  EXPECT_TRUE((*r)->read("layers.0.attn.q.exp_avg", ok.data(), ok.size()).ok()) << "other entries still load";
}

TEST(Checkpoint, DamagedExtraBytesAreRefused) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  CheckpointInfo info;
  info.extra_bytes = pattern(100, 3);
  auto w = CheckpointWriter::create(tmp.file("ck"), info);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->commit().ok());
  auto bytes = read_file(tmp.file("ck/extra.rank0.bin"));
  bytes[50] ^= 0xFF;
  write_file(tmp.file("ck/extra.rank0.bin"), bytes);
  Status st = CheckpointReader::open(tmp.file("ck"), {.verify_all = false}).status();
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(st.message(), "extra.rank0.bin: checksum")) << st.message();
}

TEST_F(DamagedCheckpoint, TruncatedDataFile) {
  ASSERT_EQ(::truncate((dir_ + "/" + file_).c_str(), 100), 0);
  Status st = open_status(false);  // sizes are checked even without verify_all
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(st.message(), file_ + ": 100 bytes, manifest says 4004 (truncated)")) << st.message();
}

TEST_F(DamagedCheckpoint, DeletedDataFile) {
  fs::remove(dir_ + "/" + file_);
  Status st = open_status(false);
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(st.message(), file_ + ": missing")) << st.message();
}

// A FIFO in a data file's place (or the extra bytes') is refused at once,
// not waited on (an open without O_NONBLOCK blocks until a writer comes).
TEST_F(DamagedCheckpoint, AFifoInAFilesPlaceIsRefusedNotWaitedOn) {
  for (const std::string& name : {file_, std::string("extra.rank0.bin")}) {
    SCOPED_TRACE(name);
    TempDir tmp;
    ASSERT_TRUE(tmp.ok());
    const std::string dir = tmp.file("ck");
    CheckpointInfo info;
    info.extra_bytes = pattern(100, 3);
    auto w = CheckpointWriter::create(dir, info);
    ASSERT_TRUE(w.ok());
    for (const auto& e : small_model())
      ASSERT_TRUE((*w)->add_buffer(e.name, e.dtype, e.bytes.size() / dtype_size(e.dtype), e.bytes.data(),
                                   e.bytes.size())
                      .ok());
    ASSERT_TRUE((*w)->commit().ok());
    fs::remove(dir + "/" + name);
    ASSERT_EQ(::mkfifo((dir + "/" + name).c_str(), 0600), 0);
    Status st = CheckpointReader::open(dir, {.verify_all = false}).status();
    EXPECT_EQ(st.code(), StatusCode::kCorrupt);
    EXPECT_TRUE(contains(st.message(), name + ": not a regular file")) << st.message();
  }
}

TEST_F(DamagedCheckpoint, TruncatedManifest) {
  const std::string path = dir_ + "/manifest.rank0.json";
  const std::string text = read_text(path);
  write_text(path, text.substr(0, text.size() / 2));
  Status st = open_status();
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(st.message(), "manifest.rank0.json: not valid JSON at byte")) << st.message();
  EXPECT_TRUE(contains(st.message(), "truncated")) << st.message();
  write_text(path, "");
  EXPECT_EQ(open_status().code(), StatusCode::kCorrupt);
}

TEST_F(DamagedCheckpoint, FlippedDigitInManifestFailsItsChecksum) {
  const std::string path = dir_ + "/manifest.rank0.json";
  std::string text = read_text(path);
  const auto pos = text.find("\"count\": 1001");
  ASSERT_NE(pos, std::string::npos);
  text[pos + 9] = '2';  // 2001 elements: still valid JSON
  write_text(path, text);
  Status st = open_status();
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_TRUE(contains(st.message(), "manifest.rank0.json: checksum 0x")) << st.message();
}

TEST_F(DamagedCheckpoint, IndexDamage) {
  const std::string path = dir_ + "/index.json";
  std::string text = read_text(path);
  auto pos = text.find("\"step\": 20");
  ASSERT_NE(pos, std::string::npos);
  text[pos + 8] = '3';
  write_text(path, text);
  EXPECT_EQ(open_status().code(), StatusCode::kCorrupt);
  fs::remove(path);
  Status st = open_status();
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_TRUE(contains(st.message(), "index.json is missing")) << st.message();
  EXPECT_EQ(CheckpointReader::open(tmp_.file("nothing-here")).status().code(), StatusCode::kNotFound);
}

TEST_F(DamagedCheckpoint, NewerFormatVersionIsRefused) {
  const std::string path = dir_ + "/index.json";
  std::string text = read_text(path);
  auto pos = text.find("\"format_version\": 1");
  ASSERT_NE(pos, std::string::npos);
  text.replace(pos, 19, "\"format_version\": 2");
  write_text(path, text);
  Status st = open_status();
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_TRUE(contains(st.message(), "format version 2 is not supported")) << st.message();
}

TEST_F(DamagedCheckpoint, SchemaChecksBehindAValidChecksum) {
  struct Case {
    const char* what;
    std::function<void(json&)> edit;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"path traversal", [](json& m) { m["entries"][0]["file"] = "../../etc/passwd"; }, "not a plain file name"},
      {"size mismatch", [](json& m) { m["entries"][0]["bytes"] = 4000; }, "are 4004 bytes, not 4000"},
      {"unknown key", [](json& m) { m["entries"][1]["shape"] = json::array({7}); }, "shape: unknown key"},
      {"bad dtype", [](json& m) { m["entries"][1]["dtype"] = "fp8"; }, "unknown dtype"},
      {"duplicate name", [](json& m) { m["entries"][1]["name"] = m["entries"][0]["name"]; }, "appears twice"},
      {"negative count", [](json& m) { m["entries"][0]["count"] = -1; }, "non-negative integer"},
      {"huge count", [](json& m) { m["entries"][0]["count"] = 1ull << 62; }, "above the limit"},
      {"bad crc text", [](json& m) { m["entries"][0]["crc32c"] = "1234"; }, "hex digits"},
      {"bad loss scale", [](json& m) { m["loss_scale"] = -1.0; }, "finite number > 0"},
      {"rank mismatch", [](json& m) { m["rank"] = 1; }, "in the file of rank 0"},
      {"step mismatch", [](json& m) { m["step"] = 21; }, "index.json says"},
  };
  const std::string mpath = dir_ + "/manifest.rank0.json", ipath = dir_ + "/index.json";
  const std::string m0 = read_text(mpath), i0 = read_text(ipath);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    write_text(mpath, m0);
    write_text(ipath, i0);
    rewrite_manifest(dir_, c.edit);
    Status st = open_status(false);
    EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.to_string();
    EXPECT_TRUE(contains(st.message(), c.expect)) << st.message();
  }
  // And the unedited re-signed manifest is accepted (the helper is sound).
  write_text(mpath, m0);
  write_text(ipath, i0);
  rewrite_manifest(dir_, [](json&) {});
  EXPECT_TRUE(open_status().ok());
}

TEST_F(DamagedCheckpoint, RankOutsideWorldSize) {
  auto r = CheckpointReader::open(dir_, {.rank = 1});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(r.status().message(), "world_size 1")) << r.status().message();
}

// ------------------------------------------------------------------ atomicity

TEST(Checkpoint, ReplacesAnExistingCheckpointAtomically) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string dir = tmp.file("latest");
  ASSERT_TRUE(save_buffers(dir, 1, small_model()).ok());
  std::vector<Saved> v2 = {{"only", DType::kF32, pattern(4 * 5, 99)}};
  ASSERT_TRUE(save_buffers(dir, 2, v2).ok());
  auto r = CheckpointReader::open(dir);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ((*r)->info().step, 2u);
  ASSERT_EQ((*r)->entries().size(), 1u);
  EXPECT_FALSE(fs::exists(dir + "/layers.0.attn.q.master.rank0.bin")) << "no file of the old checkpoint remains";
  EXPECT_TRUE(leftovers(dir).empty());
}

TEST(Checkpoint, RefusesToReplaceSomethingThatIsNotACheckpoint) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string dir = tmp.file("home");
  fs::create_directory(dir);
  write_text(dir + "/precious.txt", "keep me");
  Status st = save_buffers(dir, 1, small_model());
  EXPECT_EQ(st.code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE(contains(st.message(), "not a Strata checkpoint")) << st.message();
  EXPECT_EQ(read_text(dir + "/precious.txt"), "keep me");
  EXPECT_TRUE(leftovers(dir).empty());
  write_text(tmp.file("plainfile"), "x");
  EXPECT_EQ(save_buffers(tmp.file("plainfile"), 1, small_model()).code(), StatusCode::kAlreadyExists);
  // An empty directory (made by a launcher script) is fine to fill.
  fs::create_directory(tmp.file("empty"));
  EXPECT_TRUE(save_buffers(tmp.file("empty"), 1, small_model()).ok());
}

// A checkpoint the user added files to (DeepSpeed writes only its own files
// into a tag directory): replacing it would delete them, so it is refused,
// naming them. An audit found metrics.json and tokenizer/ deleted.
TEST(Checkpoint, RefusesToReplaceACheckpointHoldingTheUsersFiles) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string dir = tmp.file("best");
  ASSERT_TRUE(save_buffers(dir, 1, small_model()).ok());
  write_text(dir + "/metrics.json", "{}");
  fs::create_directory(dir + "/tokenizer");
  Status st = save_buffers(dir, 2, small_model());
  EXPECT_EQ(st.code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE(contains(st.message(), "also holds files Strata did not write (metrics.json, tokenizer)"))
      << st.message();
  EXPECT_EQ(read_text(dir + "/metrics.json"), "{}");
  auto r = CheckpointReader::open(dir);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ((*r)->info().step, 1u);
  EXPECT_TRUE(leftovers(dir).empty());
  fs::remove(dir + "/metrics.json");
  fs::remove(dir + "/tokenizer");
  EXPECT_TRUE(save_buffers(dir, 2, small_model()).ok());  // only its own files: replaced
}

void expect_old_intact(const std::string& dir) {
  auto r = CheckpointReader::open(dir);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ((*r)->info().step, 1u);
  EXPECT_EQ((*r)->entries().size(), small_model().size());
}

TEST(Checkpoint, FailedSaveUnderAFileSizeLimitLeavesTheOldOneIntact) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string dir = tmp.file("ck");
  ASSERT_TRUE(save_buffers(dir, 1, small_model()).ok());
  // RLIMIT_FSIZE makes a write past 1 MiB fail with EFBIG (root or not);
  // SIGXFSZ would kill the process, so it is ignored for the test.
  struct rlimit old {};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  auto old_handler = signal(SIGXFSZ, SIG_IGN);
  struct rlimit lim = old;
  lim.rlim_cur = 1 << 20;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &lim), 0);
  std::vector<Saved> big = {{"big", DType::kU8, pattern(3 << 20, 5)}};
  Status st = save_buffers(dir, 2, big);
  // And a streamed entry, through every method.
  write_text(tmp.file("dummy"), "");
  setrlimit(RLIMIT_FSIZE, &old);
  write_file(tmp.file("src"), pattern(3 << 20, 6));
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &lim), 0);
  Status st2;
  {
    CheckpointWriteOptions wo;
    wo.copy_method = CopyMethod::kReadWrite;
    auto w = CheckpointWriter::create(dir, CheckpointInfo{}, wo);
    ASSERT_TRUE(w.ok());
    std::vector<FileRange> src = {{tmp.file("src"), -1, 0, 3 << 20}};
    st2 = (*w)->add_file_ranges("big", DType::kU8, 3 << 20, src);
  }
  setrlimit(RLIMIT_FSIZE, &old);
  signal(SIGXFSZ, old_handler);
  EXPECT_EQ(st.code(), StatusCode::kNoSpace) << st.to_string();
  EXPECT_TRUE(contains(st.message(), "File too large")) << st.message();
  EXPECT_EQ(st2.code(), StatusCode::kNoSpace) << st2.to_string();
  expect_old_intact(dir);
  EXPECT_TRUE(leftovers(dir).empty()) << "the staging directory was removed";
}

TEST(Checkpoint, FailedSaveOnAFullFilesystemLeavesTheOldOneIntact) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  if (!tmp.mount_tmpfs("small", "size=2m")) GTEST_SKIP() << "cannot mount a tmpfs here (needs CAP_SYS_ADMIN)";
  const std::string dir = tmp.file("small/ck");
  ASSERT_TRUE(save_buffers(dir, 1, small_model()).ok());
  std::vector<Saved> big = {{"big", DType::kU8, pattern(3 << 20, 5)}};
  Status st = save_buffers(dir, 2, big);
  EXPECT_EQ(st.code(), StatusCode::kNoSpace) << st.to_string();
  EXPECT_TRUE(contains(st.message(), "big.rank0.bin")) << st.message();
  expect_old_intact(dir);
  EXPECT_TRUE(leftovers(dir).empty());
}

TEST(Checkpoint, SaveUnderARegularFileFailsCleanly) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  write_text(tmp.file("file"), "x");
  Status st = save_buffers(tmp.file("file/ck"), 1, small_model());
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.to_string();
  EXPECT_TRUE(contains(st.message(), tmp.file("file/ck.tmp-"))) << st.message();
  Status st2 = save_buffers(tmp.file("missing-parent/ck"), 1, small_model());
  EXPECT_EQ(st2.code(), StatusCode::kNotFound) << st2.to_string();
}

// A crash at each stage of commit (the child _exits inside the hook), then
// cleanup_checkpoint_leftovers: the directory holds the old or the new
// checkpoint, complete, and nothing else is left.
TEST(Checkpoint, CrashAtEveryCommitStageLeavesOneCompleteCheckpoint) {
  struct Stage {
    const char* name;
    uint64_t expect_step;
  };
  for (Stage s : {Stage{"staged", 1}, Stage{"exchanged", 2}, Stage{"renamed", 2}, Stage{"committed", 2}}) {
    SCOPED_TRACE(s.name);
    TempDir tmp;
    ASSERT_TRUE(tmp.ok());
    const std::string dir = tmp.file("ck");
    ASSERT_TRUE(save_buffers(dir, 1, small_model()).ok());
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      CheckpointWriteOptions wo;
      const std::string stage = s.name;
      wo.stage_hook = [stage](std::string_view at) {
        if (at == stage) _exit(0);
      };
      std::vector<Saved> v2 = {{"only", DType::kF32, pattern(40, 9)}};
      (void)save_buffers(dir, 2, v2, wo);
      _exit(3);  // the hook should have fired
    }
    int wstatus = 0;
    ASSERT_EQ(waitpid(pid, &wstatus, 0), pid);
    ASSERT_TRUE(WIFEXITED(wstatus));
    ASSERT_EQ(WEXITSTATUS(wstatus), 0);
    // Before cleanup, the directory already holds a complete checkpoint.
    auto before = CheckpointReader::open(dir);
    ASSERT_TRUE(before.ok()) << before.status().to_string();
    EXPECT_EQ((*before)->info().step, s.expect_step);
    ASSERT_TRUE(cleanup_checkpoint_leftovers(dir).ok());
    EXPECT_TRUE(leftovers(dir).empty());
    auto after = CheckpointReader::open(dir);
    ASSERT_TRUE(after.ok()) << after.status().to_string();
    EXPECT_EQ((*after)->info().step, s.expect_step);
  }
}

TEST(Checkpoint, CleanupRestoresARenamedAwayCheckpoint) {
  // The two-rename fallback (filesystems without RENAME_EXCHANGE) can crash
  // between its renames; simulate that state by hand.
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string dir = tmp.file("ck");
  ASSERT_TRUE(save_buffers(dir, 1, small_model()).ok());
  fs::rename(dir, dir + ".old-123-abc");
  fs::create_directory(dir + ".tmp-123-abc");  // the half-written new one
  write_text(dir + ".tmp-123-abc/partial.rank0.bin", "xx");
  EXPECT_EQ(CheckpointReader::open(dir).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(cleanup_checkpoint_leftovers(dir).ok());
  EXPECT_TRUE(leftovers(dir).empty());
  expect_old_intact(dir);
}

TEST(Checkpoint, AbandonedWriterLeavesNothing) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string dir = tmp.file("ck");
  {
    auto w = CheckpointWriter::create(dir, CheckpointInfo{});
    ASSERT_TRUE(w.ok());
    auto d = pattern(100, 1);
    ASSERT_TRUE((*w)->add_buffer("x", DType::kU8, 100, d.data(), 100).ok());
    ASSERT_TRUE((*w)->finish_shard().ok());
  }
  EXPECT_FALSE(fs::exists(dir));
  EXPECT_TRUE(leftovers(dir).empty());
}

// ------------------------------------------------------------------ ranks

TEST(Checkpoint, TwoRanksWriteOneCheckpoint) {
  TempDir tmp;
  ASSERT_TRUE(tmp.ok());
  const std::string dir = tmp.file("ck");
  CheckpointInfo info;
  info.step = 7;
  info.loss_scale = 128;
  std::vector<std::unique_ptr<CheckpointWriter>> w;
  for (uint32_t r = 0; r < 2; ++r) {
    CheckpointWriteOptions wo;
    wo.rank = r;
    wo.world_size = 2;
    wo.token = "step7";
    CheckpointInfo ri = info;
    ri.extra_bytes = pattern(10 + r, r);  // per-rank RNG state, say
    auto cw = CheckpointWriter::create(dir, ri, wo);
    ASSERT_TRUE(cw.ok()) << cw.status().to_string();
    w.push_back(std::move(*cw));
  }
  // Both ranks hold a shard of the same parameter under the same name.
  for (uint32_t r = 0; r < 2; ++r) {
    auto d = pattern(4 * 10, 100 + r);
    ASSERT_TRUE(w[r]->add_buffer("layers.0.master", DType::kF32, 10, d.data(), d.size()).ok());
  }
  ASSERT_TRUE(w[0]->finish_shard().ok());
  // Rank 1 has not finished: rank 0 cannot commit.
  {
    CheckpointWriteOptions wo;
    wo.world_size = 2;
    wo.token = "other";
    auto lone = CheckpointWriter::create(tmp.file("ck2"), info, wo);
    ASSERT_TRUE(lone.ok());
    Status st = (*lone)->commit();
    EXPECT_EQ(st.code(), StatusCode::kNotFound);
    EXPECT_TRUE(contains(st.message(), "rank 1 has not finished")) << st.message();
    ASSERT_TRUE(abort_checkpoint_staging(tmp.file("ck2"), "other").ok());
    EXPECT_TRUE(leftovers(tmp.file("ck2")).empty());
  }
  EXPECT_EQ(w[1]->commit().code(), StatusCode::kInvalidArgument) << "only rank 0 commits";
  ASSERT_TRUE(w[1]->finish_shard().ok());
  ASSERT_TRUE(w[0]->commit().ok());
  w[1].reset();  // a finished rank's writer leaves its files alone once committed
  for (uint32_t r = 0; r < 2; ++r) {
    auto rd = CheckpointReader::open(dir, {.rank = r});
    ASSERT_TRUE(rd.ok()) << rd.status().to_string();
    EXPECT_EQ((*rd)->info().world_size, 2u);
    EXPECT_EQ((*rd)->info().step, 7u);
    EXPECT_EQ((*rd)->info().extra_bytes, pattern(10 + r, r));
    std::vector<uint8_t> back(40);
    ASSERT_TRUE((*rd)->read("layers.0.master", back.data(), 40).ok());
    EXPECT_EQ(back, pattern(40, 100 + r));
  }
  EXPECT_TRUE(fs::exists(dir + "/layers.0.master.rank1.bin"));
  EXPECT_EQ(CheckpointReader::open(dir, {.rank = 2}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata
