// The CUDA backend module: loads where a GPU is, and otherwise reports why
// not instead of failing. Labelled gpu; skips with the reason on machines
// without a device.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "common/host_memory.h"
#include "common/tunables.h"
#include "device/cuda_loader.h"
#include "strata/strata_config.h"
#include "test_util/gpu.h"

namespace strata {
namespace {

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef STRATA_TEST_CUDA_MODULE
    setenv("STRATA_CUDA_MODULE", STRATA_TEST_CUDA_MODULE, 1);
    reload_tunables();
#endif
  }
};

TEST_F(CudaBackendTest, LoadsOrSaysWhy) {
  auto b = load_cuda_backend();
  if (!b.ok()) {
    EXPECT_EQ(b.status().code(), StatusCode::kUnavailable);
    EXPECT_FALSE(b.status().message().empty());
    STRATA_SKIP_WITHOUT_GPU("no usable CUDA backend here: " << b.status().message());
  }
  EXPECT_GT(b->device_count, 0);
  char desc[256] = {0}, err[256] = {0};
  ASSERT_EQ(b->api->device_describe(0, desc, sizeof(desc), err, sizeof(err)), 0) << err;
  EXPECT_NE(std::strstr(desc, "sm_"), nullptr) << desc;
}

TEST_F(CudaBackendTest, RegistersHostMemory) {
  auto b = load_cuda_backend();
  if (!b.ok()) STRATA_SKIP_WITHOUT_GPU("no usable CUDA backend here: " << b.status().message());
  auto mem = alloc_host(8 << 20);
  ASSERT_TRUE(mem.ok());
  CudaHostRegistrar reg(b->api);
  Status st = reg.register_memory(mem->ptr, mem->bytes);
  ASSERT_TRUE(st.ok()) << st.to_string();
  reg.unregister_memory(mem->ptr);
  free_host(mem.value());
}

TEST_F(CudaBackendTest, CopyBandwidthIsPlausible) {
  auto b = load_cuda_backend();
  if (!b.ok()) STRATA_SKIP_WITHOUT_GPU("no usable CUDA backend here: " << b.status().message());
  double h2d = 0, d2h = 0;
  char err[256] = {0};
  ASSERT_EQ(b->api->copy_bandwidth(0, 64 << 20, 3, &h2d, &d2h, err, sizeof(err)), 0) << err;
  // PCIe 3 x16 gives ~12 GB/s pinned; anything under 1 GB/s means pageable memory or a broken stream.
  EXPECT_GT(h2d, 1.0);
  EXPECT_GT(d2h, 1.0);
}

}  // namespace
}  // namespace strata
