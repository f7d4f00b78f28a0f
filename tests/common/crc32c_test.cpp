// CRC32C (common/crc32c.h): known vectors, hardware vs portable, streaming,
// per-block checksums (swap files) and combine.
#include "common/crc32c.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "test_util/pattern.h"

namespace strata {
namespace {

using ::strata::testing::pattern;

TEST(Crc32c, KnownVectors) {
  // RFC 3720 appendix B.4 and the classic check value.
  std::vector<uint8_t> zeros(32, 0), ones(32, 0xFF), inc(32), dec(32);
  for (int i = 0; i < 32; ++i) inc[i] = static_cast<uint8_t>(i), dec[i] = static_cast<uint8_t>(31 - i);
  const char* check = "123456789";
  for (auto fn : {&crc32c_extend_portable, &crc32c_extend_hw, &crc32c_extend}) {
    EXPECT_EQ(fn(0, check, 9), 0xE3069283u);
    EXPECT_EQ(fn(0, "", 0), 0u);
    EXPECT_EQ(fn(0, zeros.data(), 32), 0x8A9136AAu);
    EXPECT_EQ(fn(0, ones.data(), 32), 0x62A8AB43u);
    EXPECT_EQ(fn(0, inc.data(), 32), 0x46DD794Eu);
    EXPECT_EQ(fn(0, dec.data(), 32), 0x113FDB5Cu);
  }
  std::printf("crc32c implementation: %s\n", crc32c_impl_name());
}

TEST(Crc32c, HardwareAgreesWithPortableAtEveryLengthAndAlignment) {
  if (!crc32c_hw_available()) GTEST_SKIP() << "this CPU has no CRC32C instructions";
  auto data = pattern((1 << 20) + 64, 7);
  for (std::size_t off = 0; off < 9; ++off) {
    for (std::size_t len = 0; len < 600; ++len) {
      ASSERT_EQ(crc32c_extend_hw(0x12345678u, data.data() + off, len),
                crc32c_extend_portable(0x12345678u, data.data() + off, len))
          << "offset " << off << " length " << len;
    }
  }
  EXPECT_EQ(crc32c_extend_hw(0, data.data() + 3, 1 << 20), crc32c_extend_portable(0, data.data() + 3, 1 << 20));
}

TEST(Crc32c, ExtendChunkByChunkEqualsWhole) {
  auto data = pattern(100003, 9);
  const uint32_t whole = crc32c(data.data(), data.size());
  for (std::size_t chunk : {1u, 7u, 64u, 4096u, 65536u}) {
    uint32_t c = 0, p = 0;
    for (std::size_t i = 0; i < data.size(); i += chunk) {
      const std::size_t n = std::min(chunk, data.size() - i);
      c = crc32c_extend(c, data.data() + i, n);
      p = crc32c_extend_portable(p, data.data() + i, n);
    }
    EXPECT_EQ(c, whole) << chunk;
    EXPECT_EQ(p, whole) << chunk;
  }
}

TEST(Crc32c, BlocksEqualOneCrcPerBlockAtEveryShape) {
  auto data = pattern(7 * 4096 + 123, 5);
  for (std::size_t block : {8u, 13u, 4096u, 8192u, 65536u}) {
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, block - 1, block, 3 * block, 3 * block + 5, 7 * block,
                          data.size()}) {
      if (n > data.size()) continue;
      std::vector<uint32_t> got((n + block - 1) / block, 0xDEADBEEF);
      crc32c_blocks(data.data(), n, block, got.data());
      for (std::size_t i = 0; i < got.size(); ++i) {
        const std::size_t len = std::min(block, n - i * block);
        ASSERT_EQ(got[i], crc32c_extend_portable(0, data.data() + i * block, len))
            << "block " << block << " n " << n << " piece " << i;
      }
    }
  }
}

TEST(Crc32c, CombineEqualsTheCrcOfTheConcatenation) {
  auto data = pattern(200000, 3);
  for (std::size_t split : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4096}, std::size_t{65537},
                            data.size()}) {
    const uint32_t a = crc32c(data.data(), split);
    const uint32_t b = crc32c(data.data() + split, data.size() - split);
    EXPECT_EQ(crc32c_combine(a, b, data.size() - split), crc32c(data.data(), data.size())) << split;
  }
  // Blocks combined in order give the whole file's CRC (what a checkpoint
  // records) from the swap store's block checksums.
  std::vector<uint32_t> blocks((data.size() + 4095) / 4096);
  crc32c_blocks(data.data(), data.size(), 4096, blocks.data());
  uint32_t whole = 0;
  for (std::size_t i = 0; i < blocks.size(); ++i)
    whole = crc32c_combine(whole, blocks[i], std::min<std::size_t>(4096, data.size() - i * 4096));
  EXPECT_EQ(whole, crc32c(data.data(), data.size()));
}

}  // namespace
}  // namespace strata
