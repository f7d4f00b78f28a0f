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
