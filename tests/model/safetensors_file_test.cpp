// safetensors files on disk: the streaming writer, reads through the I/O
// engine with dtype conversion, shards and the index, truncated files, and a
// cross-check against the reference Python implementation when available.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "common/float_convert.h"
#include "model/safetensors.h"
#include "model_test_util.h"
#include "test_util/reference_python.h"

namespace strata::model {
namespace {

using testing::read_bytes;
using testing::TempDir;
using testing::write_bytes;

std::vector<unsigned char> pattern(uint64_t n, uint32_t seed) {
  std::vector<unsigned char> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

bool exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

TEST(SafetensorsFile, WriteThenReadRawBytes) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string path = dir.file("a.safetensors");
  std::vector<TensorDecl> decls = {{"w", StDType::kF32, {3, 5}},
                                   {"b", StDType::kBF16, {7}},
                                   {"h", StDType::kF16, {2, 2}},
                                   {"ids", StDType::kI64, {3}},
                                   {"empty", StDType::kF32, {0}}};
  uint64_t total = 0;
  for (const auto& d : decls) total += d.nbytes();
  auto data = pattern(total, 1);
  {
    auto w = SafetensorsWriter::create(path, decls);
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    EXPECT_EQ((*w)->current()->name, "w");
    // Odd-sized pieces that straddle tensor boundaries.
    uint64_t at = 0;
    for (uint64_t step : {5u, 50u, 1u, 13u}) {
      ASSERT_TRUE((*w)->write(data.data() + at, step).ok());
      at += step;
    }
    EXPECT_EQ((*w)->current()->name, "b");  // 69 bytes in: w is 60, b 14
    ASSERT_TRUE((*w)->write(data.data() + at, total - at).ok());
    EXPECT_EQ((*w)->current(), nullptr);
    EXPECT_FALSE(exists(path));  // only the temp file until finish
    ASSERT_TRUE((*w)->finish().ok());
  }
  EXPECT_EQ(std::filesystem::directory_iterator(dir.path())->path().filename(), "a.safetensors");
  const std::string bytes = read_bytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes.substr(8, 40).rfind("{\"__metadata__\":{\"format\":\"pt\"}", 0), 0u) << bytes.substr(8, 60);
  EXPECT_EQ(bytes.size(), 8 + n + total);

  auto h = read_safetensors_header(path);
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  ASSERT_EQ(h->tensors.size(), decls.size());
  auto reader = TensorReader::create();
  ASSERT_TRUE(reader.ok()) << reader.status().to_string();
  uint64_t at = 0;
  for (const auto& d : decls) {
    const TensorInfo* t = h->find(d.name);
    ASSERT_NE(t, nullptr) << d.name;
    EXPECT_EQ(t->shape, d.shape);
    EXPECT_EQ(t->dtype, d.dtype);
    std::vector<unsigned char> got(d.nbytes() + 1);
    ASSERT_TRUE((*reader)->read_raw(*t, 0, d.nbytes(), got.data()).ok());
    EXPECT_EQ(0, std::memcmp(got.data(), data.data() + at, d.nbytes())) << d.name;
    at += d.nbytes();
  }
  // Sub-range and out-of-range.
  unsigned char two[2];
  ASSERT_TRUE((*reader)->read_raw(*h->find("w"), 58, 2, two).ok());
  EXPECT_EQ(0, std::memcmp(two, data.data() + 58, 2));
  EXPECT_EQ((*reader)->read_raw(*h->find("w"), 59, 2, two).code(), StatusCode::kInvalidArgument);
  std::vector<float> f(1);
  auto st = (*reader)->read(*h->find("ids"), DType::kF32, f.data());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("I64"), std::string::npos) << st.message();
}

TEST(SafetensorsFile, ReadConvertsDTypes) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string path = dir.file("c.safetensors");
  // 3M elements: several 4 MiB staging chunks for the converting reads.
  const uint64_t n = 3'000'000;
  std::vector<float> src(n);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (auto& x : src) x = nd(rng);
  src[0] = 1e-40f;    // a denormal
  src[1] = 70000.0f;  // overflows fp16
  auto w = SafetensorsWriter::create(path, {{"f32", StDType::kF32, {n}},
                                            {"bf16", StDType::kBF16, {n}},
                                            {"f16", StDType::kF16, {n}},
                                            {"f64", StDType::kF64, {4}}});
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->write_from(DType::kF32, src.data(), n).ok());
  ASSERT_TRUE((*w)->write_from(DType::kF32, src.data(), n / 2).ok());  // in two calls
  ASSERT_TRUE((*w)->write_from(DType::kF32, src.data() + n / 2, n - n / 2).ok());
  EXPECT_EQ((*w)->write_from(DType::kF32, src.data(), n + 1).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE((*w)->write_from(DType::kF32, src.data(), n).ok());
  const double f64[4] = {1.5, -2.25, 1e300, 0.1};
  EXPECT_EQ((*w)->write_from(DType::kF32, src.data(), 4).code(), StatusCode::kInvalidArgument);  // F64: raw only
  ASSERT_TRUE((*w)->write(f64, sizeof f64).ok());
  ASSERT_TRUE((*w)->finish().ok());

  auto h = read_safetensors_header(path);
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  auto reader = TensorReader::create();
  ASSERT_TRUE(reader.ok());
  auto& r = **reader;

  // Stored values: the writer rounds exactly as float_convert.h does.
  std::vector<uint16_t> bf(n), hf(n);
  ASSERT_TRUE(r.read(*h->find("bf16"), DType::kBF16, bf.data()).ok());
  ASSERT_TRUE(r.read(*h->find("f16"), DType::kF16, hf.data()).ok());
  for (uint64_t i = 0; i < n; ++i) {
    ASSERT_EQ(bf[i], f32_to_bf16_bits(src[i])) << i;
    ASSERT_EQ(hf[i], f32_to_f16_bits(src[i])) << i;
  }
  // Widening reads are exact; narrowing reads round once, from the file value.
  std::vector<float> out(n);
  ASSERT_TRUE(r.read(*h->find("bf16"), DType::kF32, out.data()).ok());
  for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(f32_bits(out[i]), f32_bits(bf16_bits_to_f32(bf[i]))) << i;
  ASSERT_TRUE(r.read(*h->find("f16"), DType::kF32, out.data()).ok());
  for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(f32_bits(out[i]), f32_bits(f16_bits_to_f32(hf[i]))) << i;
  EXPECT_TRUE(std::isinf(out[1]));
  std::vector<uint16_t> conv(n);
  ASSERT_TRUE(r.read(*h->find("f32"), DType::kBF16, conv.data()).ok());
  EXPECT_EQ(conv, bf);
  ASSERT_TRUE(r.read(*h->find("bf16"), DType::kF16, conv.data()).ok());
  for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(conv[i], f32_to_f16_bits(bf16_bits_to_f32(bf[i]))) << i;
  float d4[4];
  ASSERT_TRUE(r.read(*h->find("f64"), DType::kF32, d4).ok());
  EXPECT_EQ(d4[0], 1.5f);
  EXPECT_EQ(d4[1], -2.25f);
  EXPECT_TRUE(std::isinf(d4[2]));
  EXPECT_EQ(d4[3], 0.1f);

  // A range crossing a staging-chunk boundary (2M bf16 elements = 4 MiB).
  const uint64_t b = 2'097'100, c = 300;
  std::vector<float> part(c);
  ASSERT_TRUE(r.read(*h->find("bf16"), DType::kF32, part.data(), b, c).ok());
  for (uint64_t i = 0; i < c; ++i) ASSERT_EQ(part[i], bf16_bits_to_f32(bf[b + i])) << i;
  ASSERT_TRUE(r.read(*h->find("f32"), DType::kF32, part.data(), n - c).ok());  // count: to the end
  EXPECT_EQ(0, std::memcmp(part.data(), src.data() + n - c, c * 4));
  EXPECT_EQ(r.read(*h->find("f32"), DType::kF32, part.data(), n - 1, 2).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.read(*h->find("f32"), DType::kF32, part.data(), n + 1, 0).code(), StatusCode::kInvalidArgument);
}

TEST(SafetensorsFile, WriterRefusesBadInputAndCleansUp) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string path = dir.file("x.safetensors");
  EXPECT_EQ(SafetensorsWriter::create(path, {{"a", StDType::kF32, {1}}, {"a", StDType::kF32, {1}}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(SafetensorsWriter::create(path, {{"__metadata__", StDType::kF32, {1}}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(SafetensorsWriter::create(path, {{"a", StDType::kF32, {1ull << 40, 1ull << 40}}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(SafetensorsWriter::create(dir.file("no/such/dir.safetensors"), {}).status().code(), StatusCode::kNotFound);
  {
    auto w = SafetensorsWriter::create(path, {{"a", StDType::kF32, {4}}});
    ASSERT_TRUE(w.ok());
    float x[5] = {};
    EXPECT_EQ((*w)->write(x, 20).code(), StatusCode::kInvalidArgument);
    ASSERT_TRUE((*w)->write(x, 8).ok());
    auto st = (*w)->finish();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("8 declared bytes were never written"), std::string::npos) << st.message();
  }
  // The unfinished writer left nothing behind.
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(SafetensorsFile, EveryTruncationIsAnErrorAndCorruptFilesNeverCrashReads) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string good = dir.file("good.safetensors");
  {
    auto w = SafetensorsWriter::create(good, {{"a", StDType::kBF16, {3, 3}}, {"b", StDType::kF32, {5}}});
    ASSERT_TRUE(w.ok());
    auto d = pattern(38, 3);
    ASSERT_TRUE((*w)->write(d.data(), d.size()).ok());
    ASSERT_TRUE((*w)->finish().ok());
  }
  const std::string bytes = read_bytes(good);
  const std::string bad = dir.file("bad.safetensors");
  for (size_t len = 0; len < bytes.size(); ++len) {
    write_bytes(bad, bytes.substr(0, len));
    auto h = read_safetensors_header(bad);
    ASSERT_FALSE(h.ok()) << "truncated at " << len;
    EXPECT_EQ(h.status().code(), StatusCode::kCorrupt) << h.status().to_string();
    EXPECT_NE(h.status().message().find(bad), std::string::npos) << h.status().message();
  }
  // Damaged headers: whatever still parses must read without error.
  auto reader = TensorReader::create();
  ASSERT_TRUE(reader.ok());
  std::mt19937 rng(99);
  uint64_t hlen = 0;
  std::memcpy(&hlen, bytes.data(), 8);
  for (int i = 0; i < 300; ++i) {
    std::string g = bytes;
    g[rng() % (8 + hlen)] ^= static_cast<char>(1 + rng() % 255);
    write_bytes(bad, g);
    auto h = read_safetensors_header(bad);
    if (!h.ok()) continue;
    for (const auto& t : h->tensors) {
      std::vector<unsigned char> buf(t.nbytes + 1);
      EXPECT_TRUE((*reader)->read_raw(t, 0, t.nbytes, buf.data()).ok());
    }
  }
  EXPECT_EQ(read_safetensors_header(dir.file("missing")).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(read_safetensors_header(dir.path()).status().code(), StatusCode::kInvalidArgument);
}

// A sharded write that stops half-way (an error, a stop signal) leaves no
// file of its own: neither the shards it completed nor the open one's temp
// file; a file of the same name it never wrote stays.
TEST(SafetensorsFile, AnUnfinishedShardedWriteLeavesNothing) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::vector<TensorDecl> decls;
  for (int i = 0; i < 6; ++i) decls.push_back({"t" + std::to_string(i), StDType::kF32, {256}});
  uint64_t total = 0;
  for (const auto& d : decls) total += d.nbytes();
  auto data = pattern(total, 3);
  std::string last;
  {
    auto w = ShardedWriter::create(dir.path(), decls, 2048);
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    ASSERT_GT((*w)->files().size(), 2u);
    last = (*w)->files().back();
    write_bytes(dir.file(last), "an older model's shard of the same name");  // never written by this writer
    ASSERT_TRUE((*w)->write(data.data(), total - 100).ok());  // every shard but the last one complete
    std::error_code ec;
    ASSERT_TRUE(std::filesystem::exists(dir.file((*w)->files()[0]), ec));
  }
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) left.push_back(e.path().filename().string());
  EXPECT_EQ(left, std::vector<std::string>{last});
}

TEST(SafetensorsFile, ShardsAndIndex) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::vector<TensorDecl> decls;
  for (int i = 0; i < 10; ++i) decls.push_back({"t" + std::to_string(i), StDType::kF32, {uint64_t(100 + 50 * i)}});
  decls.push_back({"big", StDType::kF32, {2000}});  // larger than a shard: its own
  uint64_t total = 0;
  for (const auto& d : decls) total += d.nbytes();
  auto data = pattern(total, 5);
  auto w = ShardedWriter::create(dir.path(), decls, 2048);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  ASSERT_TRUE((*w)->write(data.data(), 1000).ok());
  ASSERT_TRUE((*w)->write(data.data() + 1000, total - 1000).ok());
  ASSERT_TRUE((*w)->finish().ok());
  const auto files = (*w)->files();
  ASSERT_GT(files.size(), 3u);
  EXPECT_EQ(files[0], "model-00001-of-0000" + std::to_string(files.size()) + ".safetensors");
  auto idx = read_safetensors_index(dir.file("model.safetensors.index.json"));
  ASSERT_TRUE(idx.ok()) << idx.status().to_string();
  EXPECT_EQ(idx->total_size, total);
  EXPECT_EQ(idx->weight_map.size(), decls.size());
  EXPECT_EQ(idx->weight_map.at("big"), files.back());
  for (const auto& f : files) {
    auto h = read_safetensors_header(dir.file(f));
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    uint64_t data_bytes = h->file_size - h->data_offset;
    EXPECT_TRUE(data_bytes <= 2048 || h->tensors.size() == 1) << f;
  }
  auto tensors = read_model_tensors(dir.path());
  ASSERT_TRUE(tensors.ok()) << tensors.status().to_string();
  ASSERT_EQ(tensors->size(), decls.size());
  auto reader = TensorReader::create();
  ASSERT_TRUE(reader.ok());
  uint64_t at = 0;
  for (const auto& d : decls) {
    const TensorInfo* t = nullptr;
    for (const auto& x : *tensors)
      if (x.name == d.name) t = &x;
    ASSERT_NE(t, nullptr);
    std::vector<unsigned char> got(d.nbytes());
    ASSERT_TRUE((*reader)->read_raw(*t, 0, d.nbytes(), got.data()).ok());
    EXPECT_EQ(0, std::memcmp(got.data(), data.data() + at, d.nbytes())) << d.name;
    at += d.nbytes();
  }

  // A broken index: a name pointing outside the directory, a tensor the shard
  // does not hold.
  write_bytes(dir.file("model.safetensors.index.json"), R"({"metadata":{},"weight_map":{"t0":"../x.safetensors"}})");
  auto e = read_model_tensors(dir.path());
  EXPECT_EQ(e.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(e.status().message().find("not a file next to the index"), std::string::npos) << e.status().message();
  std::string wm;
  for (const char* name : {"t0", "t1", "t2", "nope"})
    wm += fmt::format("{}\"{}\":\"{}\"", wm.empty() ? "" : ",", name, files[0]);
  write_bytes(dir.file("model.safetensors.index.json"), "{\"weight_map\":{" + wm + "}}");
  e = read_model_tensors(dir.path());
  EXPECT_EQ(e.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(e.status().message().find("\"nope\""), std::string::npos) << e.status().message();
}

// The reference implementation (Python safetensors + torch) reads what
// Strata writes and Strata reads what it writes.
TEST(SafetensorsFile, PythonReferenceInterop) {
  const std::string py = strata::testing::find_reference_python(STRATA_TEST_PYTHON, "torch, safetensors.torch");
  if (py.empty())
    STRATA_REFERENCE_MISSING("no Python with torch and safetensors (configure with -DSTRATA_TEST_PYTHON=/path/to/python)");
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  // Values exact in every dtype: (i % 17 - 8) / 4.
  auto value = [](uint64_t i) { return static_cast<float>(static_cast<int>(i % 17) - 8) / 4.0f; };
  const uint64_t n = 1000;
  std::vector<float> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = value(i);
  {
    auto w = SafetensorsWriter::create(
        dir.file("strata.safetensors"),
        {{"x.bf16", StDType::kBF16, {10, 100}}, {"y.f32", StDType::kF32, {n}}, {"z.f16", StDType::kF16, {n}}});
    ASSERT_TRUE(w.ok());
    for (int k = 0; k < 3; ++k) ASSERT_TRUE((*w)->write_from(DType::kF32, v.data(), n).ok());
    ASSERT_TRUE((*w)->finish().ok());
  }
  const std::string script = dir.file("check.py");
  write_bytes(script, R"(import sys, torch
from safetensors.torch import load_file, save_file
d = sys.argv[1]
t = load_file(d + "/strata.safetensors")
ref = ((torch.arange(1000) % 17) - 8).float() / 4
assert t["x.bf16"].dtype == torch.bfloat16 and list(t["x.bf16"].shape) == [10, 100]
assert torch.equal(t["x.bf16"].float().flatten(), ref)
assert t["y.f32"].dtype == torch.float32 and torch.equal(t["y.f32"], ref)
assert t["z.f16"].dtype == torch.float16 and torch.equal(t["z.f16"].float(), ref)
save_file({"p.bf16": ref.reshape(20, 50).bfloat16(), "q.f16": ref.half(), "r.f32": ref * 3,
           "s.i64": torch.arange(5)}, d + "/python.safetensors", metadata={"format": "pt"})
print("ok")
)");
  const std::string cmd = py + " " + script + " " + dir.path() + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  ASSERT_EQ(::pclose(p), 0) << out;
  ASSERT_NE(out.find("ok"), std::string::npos) << out;

  auto h = read_safetensors_header(dir.file("python.safetensors"));
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  EXPECT_EQ(h->metadata.at("format"), "pt");
  auto reader = TensorReader::create();
  ASSERT_TRUE(reader.ok());
  std::vector<float> got(n);
  ASSERT_EQ(h->find("p.bf16")->shape, (std::vector<uint64_t>{20, 50}));
  ASSERT_TRUE((*reader)->read(*h->find("p.bf16"), DType::kF32, got.data()).ok());
  EXPECT_EQ(got, v);
  ASSERT_TRUE((*reader)->read(*h->find("q.f16"), DType::kF32, got.data()).ok());
  EXPECT_EQ(got, v);
  ASSERT_TRUE((*reader)->read(*h->find("r.f32"), DType::kF32, got.data()).ok());
  for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], v[i] * 3) << i;
  int64_t ids[5];
  ASSERT_TRUE((*reader)->read_raw(*h->find("s.i64"), 0, 40, ids).ok());
  for (int i = 0; i < 5; ++i) EXPECT_EQ(ids[i], i);
}

}  // namespace
}  // namespace strata::model
