// safetensors header parsing: every bound the format has, and a fuzz-style
// sweep (every truncation, byte flips in the header) that must only ever give
// an error or a consistent parse (run under ASan/UBSan in CI).
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "model/safetensors.h"
#include "model_test_util.h"

namespace strata::model {
namespace {

using testing::st_bytes;

// Two tensors, hand-written: a F32 [2,3] (24 bytes) at 0 and a BF16 [4] (8
// bytes) at 24.
const std::string kHeader =
    R"({"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[4],"data_offsets":[24,32]},)"
    R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})";

std::string valid_file() {
  return st_bytes(kHeader, std::string(32, '\x11'));
}

Status parse(const std::string& header, size_t data_bytes) {
  return parse_safetensors_file_bytes(st_bytes(header, std::string(data_bytes, '\0')), "x.safetensors").status();
}

void expect_corrupt(const Status& st, const std::string& want) {
  EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.to_string();
  EXPECT_NE(st.message().find(want), std::string::npos) << "message lacks '" << want << "': " << st.message();
  EXPECT_NE(st.message().find("x.safetensors"), std::string::npos) << st.message();
}

TEST(SafetensorsParse, ValidFile) {
  auto h = parse_safetensors_file_bytes(valid_file(), "x.safetensors");
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  EXPECT_EQ(h->header_len, kHeader.size());
  EXPECT_EQ(h->data_offset, 8 + kHeader.size());
  EXPECT_EQ(h->metadata.at("format"), "pt");
  ASSERT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->tensors[0].name, "a");  // sorted by offset
  EXPECT_EQ(h->tensors[0].dtype, StDType::kF32);
  EXPECT_EQ(h->tensors[0].shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(h->tensors[0].offset, h->data_offset);
  EXPECT_EQ(h->tensors[0].nbytes, 24u);
  EXPECT_EQ(h->tensors[1].name, "b");
  EXPECT_EQ(h->tensors[1].offset, h->data_offset + 24);
  EXPECT_EQ(h->find("b")->numel(), 4u);
  EXPECT_EQ(h->find("c"), nullptr);
}

TEST(SafetensorsParse, EmptyAndScalarAndZeroSized) {
  EXPECT_TRUE(parse("{}", 0).ok());
  EXPECT_TRUE(parse(R"({"__metadata__":null})", 0).ok());
  // A scalar (shape []) holds one element; a zero-sized tensor holds none.
  auto st = parse(R"({"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]},)"
                  R"("z":{"dtype":"F32","shape":[0,5],"data_offsets":[8,8]}})",
                  8);
  EXPECT_TRUE(st.ok()) << st.to_string();
}

TEST(SafetensorsParse, LengthField) {
  expect_corrupt(parse_safetensors_file_bytes("abc", "x.safetensors").status(), "less than the 8-byte");
  std::string f = valid_file();
  f[0] = static_cast<char>(f[0] + 1);  // one byte longer than there is... or into the data
  auto st = parse_safetensors_file_bytes(f.substr(0, 8 + kHeader.size()), "x.safetensors").status();
  expect_corrupt(st, "runs past the end of the file");
  std::string huge = f;
  huge[5] = 1;  // 2^40-ish
  expect_corrupt(parse_safetensors_file_bytes(huge, "x.safetensors").status(), "exceeds the limit");
  std::string zero = f;
  std::memset(zero.data(), 0, 8);
  expect_corrupt(parse_safetensors_file_bytes(zero, "x.safetensors").status(), "does not start with '{'");
}

TEST(SafetensorsParse, MalformedJson) {
  expect_corrupt(parse(R"({"a":{"dtype":"F32",)", 0), "malformed header JSON at header byte");
  expect_corrupt(parse("[1,2]", 0), "does not start with '{'");
  expect_corrupt(parse(R"({"a":5})", 0), "tensor \"a\": entry is not an object");
  expect_corrupt(parse(R"({"__metadata__":{"k":1}})", 0), "__metadata__.k is not a string");
  expect_corrupt(parse(R"({"__metadata__":[1]})", 0), "__metadata__ is not an object");
}

TEST(SafetensorsParse, EntryFields) {
  expect_corrupt(parse(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4), "tensor \"a\": missing or non-string");
  expect_corrupt(parse(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", 4), "non-array \"shape\"");
  expect_corrupt(parse(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4), "[begin, end]");
  expect_corrupt(parse(R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}})", 4),
                 "unknown safetensors dtype \"Q4\"");
  expect_corrupt(parse(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4), "non-negative integer");
  expect_corrupt(parse(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4), "non-negative integer");
  expect_corrupt(parse(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", 4), "end before they begin");
  expect_corrupt(parse(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,-4]}})", 4), "not non-negative integers");
}

TEST(SafetensorsParse, SizesAndOffsets) {
  expect_corrupt(parse(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4),
                 "shape 2 of F32 needs 8 bytes but data_offsets [0, 4] hold 4");
  expect_corrupt(parse(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0),
                 "overflows 64 bits");
  expect_corrupt(parse(R"({"a":{"dtype":"BF16","shape":[9223372036854775808],"data_offsets":[0,0]}})", 0),
                 "overflows 64 bits");
  expect_corrupt(parse(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4),
                 "run past the end of the data region");
  expect_corrupt(parse(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8), "hole of 4 bytes");
  expect_corrupt(parse(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                       8),
                 "overlaps tensor");
  expect_corrupt(parse(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 6), "2 trailing bytes");
  expect_corrupt(parse(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                       R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                       8),
                 "tensor \"a\" is listed twice");
}

// Whatever parses must be self-consistent: tensors inside the file, tiling
// the data region, sizes matching shapes.
void check_consistent(const SafetensorsHeader& h, uint64_t file_size) {
  uint64_t at = h.data_offset;
  for (const auto& t : h.tensors) {
    ASSERT_EQ(t.offset, at);
    ASSERT_EQ(t.nbytes, t.numel() * st_dtype_size(t.dtype));
    at += t.nbytes;
  }
  ASSERT_EQ(at, file_size);
}

TEST(SafetensorsParse, EveryTruncationIsAnError) {
  const std::string f = valid_file();
  for (size_t len = 0; len < f.size(); ++len) {
    auto h = parse_safetensors_file_bytes(std::string_view(f).substr(0, len), "x.safetensors");
    EXPECT_FALSE(h.ok()) << "truncated at " << len;
    if (!h.ok()) {
      EXPECT_EQ(h.status().code(), StatusCode::kCorrupt) << h.status().to_string();
    }
  }
}

TEST(SafetensorsParse, ByteFlipsGiveErrorsOrConsistentParses) {
  const std::string f = valid_file();
  const uint8_t flips[] = {0x01, 0x02, 0x08, 0x20, 0x40, 0x80, 0xff};
  size_t ok = 0, bad = 0;
  for (size_t pos = 0; pos < 8 + kHeader.size(); ++pos) {
    for (uint8_t x : flips) {
      std::string g = f;
      g[pos] = static_cast<char>(static_cast<uint8_t>(g[pos]) ^ x);
      auto h = parse_safetensors_file_bytes(g, "x.safetensors");
      if (h.ok()) {
        ++ok;
        check_consistent(*h, g.size());
      } else {
        ++bad;
        EXPECT_EQ(h.status().code(), StatusCode::kCorrupt) << h.status().to_string();
      }
    }
  }
  // Most flips must be caught (a flip inside a name or the metadata value is
  // legitimately still valid).
  EXPECT_GT(bad, ok);
  // Random multi-byte damage, seeded.
  std::mt19937_64 rng(12345);
  for (int i = 0; i < 3000; ++i) {
    std::string g = f;
    const int n = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < n; ++k) g[rng() % (8 + kHeader.size())] = static_cast<char>(rng());
    if (rng() % 4 == 0) g.resize(rng() % g.size());
    auto h = parse_safetensors_file_bytes(g, "x.safetensors");
    if (h.ok()) check_consistent(*h, g.size());
  }
}

TEST(SafetensorsParse, DTypeNames) {
  for (const char* n : {"BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64",
                        "F8_E4M3", "F8_E5M2"}) {
    auto d = parse_st_dtype(n);
    ASSERT_TRUE(d.ok()) << n;
    EXPECT_STREQ(st_dtype_name(*d), n);
  }
  EXPECT_EQ(st_dtype_size(StDType::kBF16), 2u);
  EXPECT_EQ(st_dtype_size(StDType::kF64), 8u);
  EXPECT_FALSE(parse_st_dtype("bf16").ok());  // the file spelling is upper case
  EXPECT_EQ(to_dtype(StDType::kBF16), DType::kBF16);
  EXPECT_FALSE(to_dtype(StDType::kI64).has_value());
  EXPECT_EQ(from_dtype(DType::kF16), StDType::kF16);
}

}  // namespace
}  // namespace strata::model
