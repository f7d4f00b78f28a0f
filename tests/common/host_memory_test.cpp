#include "common/host_memory.h"

#include <gtest/gtest.h>

#include <cstdint>

namespace strata {
namespace {

TEST(HostMemory, AlignedAndZeroed) {
  for (std::size_t bytes : {std::size_t{1}, std::size_t{4097}, std::size_t{3} << 20, std::size_t{5} << 20}) {
    auto a = alloc_host(bytes);
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    auto p = reinterpret_cast<std::uintptr_t>(a->ptr);
    EXPECT_EQ(p % 4096, 0u);
    if (bytes >= kHugePageSize) {
      EXPECT_EQ(p % kHugePageSize, 0u);
    }
    auto* c = static_cast<unsigned char*>(a->ptr);
    EXPECT_EQ(c[0], 0);
    EXPECT_EQ(c[bytes - 1], 0);
    c[bytes - 1] = 7;  // writable to the last byte
    free_host(a.value());
  }
}

TEST(HostMemory, RejectsBadArguments) {
  EXPECT_EQ(alloc_host(0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_host(10, 3).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_host(10, kHugePageSize * 2).status().code(), StatusCode::kInvalidArgument);
}

// Sizes near 2^64 used to wrap when rounded up to pages: alloc_host(SIZE_MAX)
// returned a 2 MiB mapping claiming SIZE_MAX bytes, and HostArray<float> of
// 2^62+1 elements a 4-byte one that callers then overran.
TEST(HostMemory, SizesThatWouldOverflowAreRefused) {
  constexpr std::size_t kMax = ~std::size_t{0};
  for (std::size_t bytes : {kMax, kMax - 4095, kMax - kHugePageSize, kMax / 2 + 1}) {
    auto a = alloc_host(bytes);
    EXPECT_FALSE(a.ok()) << bytes << " bytes gave " << a->mapped_bytes << " mapped bytes";
    if (a.ok())
      free_host(a.value());
    else
      EXPECT_EQ(a.status().code(), StatusCode::kOutOfMemory) << a.status().to_string();
  }
  auto h = HostArray<float>::create((std::size_t{1} << 62) + 1);
  EXPECT_FALSE(h.ok()) << "a HostArray whose byte size wraps must be refused";
  if (h.ok()) {
    EXPECT_EQ(h.value().size(), (std::size_t{1} << 62) + 1);
  } else {
    EXPECT_EQ(h.status().code(), StatusCode::kOutOfMemory) << h.status().to_string();
  }
}

TEST(HostMemory, HostArrayMoves) {
  auto r = HostArray<float>::create(1000);
  ASSERT_TRUE(r.ok());
  HostArray<float> a = std::move(r.value());
  a[999] = 1.5f;
  HostArray<float> b = std::move(a);
  EXPECT_EQ(b[999], 1.5f);
  EXPECT_EQ(a.data(), nullptr);
}

}  // namespace
}  // namespace strata
