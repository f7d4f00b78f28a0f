// The NCCL communicator.
// Unit (test_comm, every machine): the module links against the machine's
// libnccl and answers its version through the ABI table; the communicator
// refuses the host backend by name.
// GPU (test_comm_nccl, label gpu): with one rank on the lent GPU, every
// collective through NCCL (the reduce-scatter and all-reduce through the
// ncclSend/ncclRecv exchange with this rank itself and the rank-order sums,
// in chunks of a deliberately small scratch) gives what communicator.h
// specifies, bit for bit; work ordered after a collective on the caller's
// stream sees its result; the factory picks NCCL for a CUDA device.
// Several ranks need several GPUs (NCCL refuses two ranks on one device):
// unverified until a multi-GPU machine runs finetune with N GPU ranks.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "comm/communicator.h"
#include "comm/nccl_comm.h"
#include "comm_pattern.h"
#include "device/host_backend.h"

#if defined(STRATA_TEST_NCCL_MODULE)
#include <dlfcn.h>

#include "cuda/nccl/nccl_module_abi.h"
#endif
#if defined(STRATA_TEST_NCCL_GPU)
#include "device/cuda_backend.h"
#include "device/cuda_loader.h"
#include "test_util/gpu.h"
#endif

namespace strata::comm {
namespace {

#if !defined(STRATA_TEST_NCCL_GPU)

TEST(NcclComm, RefusesTheHostBackendByName) {
  auto dev = create_host_backend({});
  ASSERT_TRUE(dev.ok());
  NcclCommOptions o;
  auto c = create_nccl_communicator(dev->get(), o);
  ASSERT_FALSE(c.ok());
  if (nccl_backend_built()) {
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status().to_string();
    EXPECT_NE(c.status().message().find("CUDA device backend"), std::string::npos) << c.status().to_string();
  } else {
    EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status().to_string();
    EXPECT_NE(c.status().message().find("not in this build"), std::string::npos) << c.status().to_string();
  }
  // A caller's NCCL communicator to split is for the NCCL backend only.
  int fake = 0;
  CommOptions co{CommBackendKind::kMpi, 30.0};
  co.nccl_parent = &fake;
  auto m = create_communicator(dev->get(), co);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument) << m.status().to_string();
  EXPECT_NE(m.status().message().find("NCCL communicator to split"), std::string::npos) << m.status().to_string();
}

#if defined(STRATA_TEST_NCCL_MODULE)
// The module as the communicator loads it: RTLD_NOW resolves every NCCL and
// CUDA runtime symbol, so a libnccl too old for the calls used fails here.
TEST(NcclModule, LoadsAndSpeaksTheAbi) {
  void* h = dlopen(STRATA_TEST_NCCL_MODULE, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(h, nullptr) << dlerror();
  auto fn = reinterpret_cast<strata_nccl_api_v2_fn>(dlsym(h, STRATA_NCCL_API_SYMBOL));
  ASSERT_NE(fn, nullptr);
  const strata_nccl_api_v2_t* api = fn();
  ASSERT_NE(api, nullptr);
  EXPECT_EQ(api->abi_version, STRATA_NCCL_ABI_VERSION);
  EXPECT_GE(api->struct_size, sizeof(strata_nccl_api_v2_t));
  int version = 0;
  char err[256] = {0};
  ASSERT_EQ(api->version(&version, err, sizeof(err)), 0) << err;
  EXPECT_GE(version, 21800) << "NCCL older than 2.18 (non-blocking communicators and ncclCommFinalize)";
  // A failure's code and text: a null communicator is NCCL's invalid argument.
  int state = 0;
  const int rc = api->comm_async_error(nullptr, &state, err, sizeof(err));
  EXPECT_EQ(rc, STRATA_NCCL_ERR_BASE + 4) << err;  // ncclInvalidArgument
  EXPECT_NE(std::string(err).find("ncclCommGetAsyncError"), std::string::npos) << err;
}
#endif

#else  // STRATA_TEST_NCCL_GPU

// Point the loaders at the modules just built (decided once per process).
const bool kModulesSet = [] {
  return setenv("STRATA_CUDA_MODULE", STRATA_TEST_CUDA_MODULE, 1) == 0 &&
         setenv("STRATA_NCCL_MODULE", STRATA_TEST_NCCL_MODULE, 1) == 0;
}();

class NcclOneRank : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = load_cuda_backend();
    if (!m.ok()) STRATA_SKIP_WITHOUT_GPU("no CUDA backend: " << m.status().message());
    auto b = create_cuda_backend(*m, 0, 512ull << 20);
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    dev_ = std::move(*b);
    auto s = dev_->create_stream("caller");
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    stream_ = *s;
  }
  void TearDown() override {
    for (void* p : allocs_) (void)dev_->free(p);
    if (stream_) (void)dev_->destroy_stream(stream_);
  }
  float* device_floats(const std::vector<float>& host) {
    auto p = dev_->alloc(std::max<std::size_t>(host.size(), 1) * 4);
    EXPECT_TRUE(p.ok()) << p.status().to_string();
    allocs_.push_back(*p);
    EXPECT_TRUE(dev_->copy_async(*p, host.data(), host.size() * 4, CopyKind::kHostToDevice, stream_).ok());
    EXPECT_TRUE(dev_->synchronize(stream_).ok());
    return static_cast<float*>(*p);
  }
  std::vector<float> read(const float* d, std::size_t n) {
    std::vector<float> out(n);
    EXPECT_TRUE(dev_->copy_async(out.data(), d, n * 4, CopyKind::kDeviceToHost, stream_).ok());
    Status st = dev_->synchronize(stream_);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return out;
  }
  std::unique_ptr<DeviceBackend> dev_;
  DeviceStream* stream_ = nullptr;
  std::vector<void*> allocs_;
};

TEST_F(NcclOneRank, EveryCollectiveIsWhatCommunicatorHSays) {
  NcclCommOptions o;
  o.timeout_s = 60;
  o.scratch_bytes = 4096;  // 1023 floats: the 3001-element calls run in 3 chunks
  auto c = create_nccl_communicator(dev_.get(), o);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  Communicator& comm = **c;
  EXPECT_EQ(comm.world_size(), 1);
  EXPECT_STREQ(comm.backend_name(), "nccl");
  const std::size_t n = 3001;
  std::vector<float> in(n), zeros(n, 0.0f);
  test::fill(in.data(), 0, 0, n);
  const std::vector<float> want = test::rank_order_sum(1, 0, n);
  float* src = device_floats(in);
  float* dst = device_floats(zeros);

  ASSERT_TRUE(comm.reduce_scatter(src, dst, n, stream_).ok());
  EXPECT_TRUE(test::same_bits(read(dst, n).data(), want.data(), n)) << "reduce_scatter";
  ASSERT_TRUE(dev_->fill_zero_async(dst, n * 4, stream_).ok());
  ASSERT_TRUE(comm.all_reduce(src, dst, n, stream_).ok());
  EXPECT_TRUE(test::same_bits(read(dst, n).data(), want.data(), n)) << "all_reduce";
  // In place; then the caller's stream keeps going behind the collective
  // without a host synchronize in between.
  float* both = device_floats(in);
  ASSERT_TRUE(comm.all_reduce(both, both, n, stream_).ok());
  ASSERT_TRUE(dev_->copy_async(dst, both, n * 4, CopyKind::kDeviceToDevice, stream_).ok());
  EXPECT_TRUE(test::same_bits(read(dst, n).data(), want.data(), n)) << "all_reduce in place";
  ASSERT_TRUE(dev_->fill_zero_async(dst, n * 4, stream_).ok());
  ASSERT_TRUE(comm.all_gather(src, dst, n * 4, stream_).ok());
  EXPECT_TRUE(test::same_bits(read(dst, n).data(), in.data(), n)) << "all_gather";
  ASSERT_TRUE(comm.all_gather(dst, dst, n * 4, stream_).ok());  // in place
  ASSERT_TRUE(comm.broadcast(dst, n * 4, 0, stream_).ok());
  ASSERT_TRUE(comm.barrier(stream_).ok());
  ASSERT_TRUE(comm.reduce_scatter(src, dst, 0, stream_).ok());  // empty: still a collective
  EXPECT_TRUE(test::same_bits(read(dst, n).data(), in.data(), n)) << "broadcast";
  EXPECT_EQ(comm.broadcast(dst, 4, 1, stream_).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(comm.reduce_scatter(src, src + 1, 4, stream_).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(dev_->synchronize(stream_).ok());
}

// Collectives from two streams get one order (the comm stream), and the
// second stream's result waits for its own inputs, not the first's.
TEST_F(NcclOneRank, TwoCallerStreamsShareTheCommStream) {
  auto c = create_nccl_communicator(dev_.get(), NcclCommOptions{});
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  auto other = dev_->create_stream("other");
  ASSERT_TRUE(other.ok());
  const std::size_t n = 1 << 20;
  std::vector<float> a(n), b(n), zeros(n, 0.0f);
  test::fill(a.data(), 0, 0, n, 1);
  test::fill(b.data(), 0, 0, n, 2);
  float* da = device_floats(a);
  float* db = device_floats(b);
  float* ra = device_floats(zeros);
  float* rb = device_floats(zeros);
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE((*c)->reduce_scatter(da, ra, n, stream_).ok());
    ASSERT_TRUE((*c)->all_reduce(db, rb, n, *other).ok());
  }
  ASSERT_TRUE(dev_->synchronize(*other).ok());
  EXPECT_TRUE(test::same_bits(read(ra, n).data(), a.data(), n));
  EXPECT_TRUE(test::same_bits(read(rb, n).data(), b.data(), n));
  ASSERT_TRUE(dev_->destroy_stream(*other).ok());
}

// A trainer's own communicator (the C ABI's nccl_comm): the engine's is a
// child split from it, whose collectives work, and destroying the child
// leaves the parent working.
TEST_F(NcclOneRank, SplitsTheCallersCommunicator) {
  void* h = dlopen(STRATA_TEST_NCCL_MODULE, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(h, nullptr) << dlerror();
  const strata_nccl_api_v2_t* api = reinterpret_cast<strata_nccl_api_v2_fn>(dlsym(h, STRATA_NCCL_API_SYMBOL))();
  ASSERT_NE(api, nullptr);
  char err[512] = {0};
  std::vector<uint8_t> id(STRATA_NCCL_UNIQUE_ID_BYTES);
  ASSERT_EQ(api->unique_id(id.data(), err, sizeof(err)), 0) << err;
  void* parent = nullptr;
  ASSERT_EQ(api->comm_init(0, id.data(), 1, 0, 60.0, nullptr, &parent, err, sizeof(err)), 0) << err;
  {
    CommOptions co{CommBackendKind::kNccl, 60.0};
    co.nccl_parent = parent;
    auto c = create_communicator(dev_.get(), co);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    EXPECT_EQ((*c)->world_size(), 1);
    EXPECT_EQ((*c)->rank(), 0);
    const std::size_t n = 777;
    std::vector<float> in(n), zeros(n, 0.0f);
    test::fill(in.data(), 0, 0, n);
    float* src = device_floats(in);
    float* dst = device_floats(zeros);
    ASSERT_TRUE((*c)->reduce_scatter(src, dst, n, stream_).ok());
    const std::vector<float> want = test::rank_order_sum(1, 0, n);
    EXPECT_TRUE(test::same_bits(read(dst, n).data(), want.data(), n));
  }
  int state = -1;
  ASSERT_EQ(api->comm_async_error(parent, &state, err, sizeof(err)), 0) << err;
  EXPECT_EQ(state, 0);  // ncclSuccess: the parent is untouched
  EXPECT_EQ(api->comm_finalize_destroy(0, parent, 60.0, err, sizeof(err)), 0) << err;
}

// Rank 0 of 2 whose peer never comes waits in NCCL's own join
// (ncclCommInitRankConfig, non-blocking, polled); a stop request ends that
// wait at once with kCancelled, where the timeout would take 120 s, and the
// half-made communicator is aborted: the GPU takes a new one.
TEST_F(NcclOneRank, AStopRequestEndsNcclsJoin) {
  using Clock = std::chrono::steady_clock;
  NcclCommOptions o;
  o.rank = 0;
  o.world_size = 2;
  o.timeout_s = 120.0;
  o.share_id = [](const BlobMaker& make) -> Result<std::vector<uint8_t>> { return make(); };
  const Clock::time_point t0 = Clock::now();
  bool asked = false;
  o.cancel = [&] { return asked = asked || Clock::now() - t0 > std::chrono::seconds(2); };
  auto c = create_nccl_communicator(dev_.get(), o);
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kCancelled) << c.status().to_string();
  EXPECT_NE(c.status().message().find("interrupted (a stop signal) while waiting"), std::string::npos)
      << c.status().to_string();
  EXPECT_NE(c.status().message().find("joining rank 0 of 2"), std::string::npos) << c.status().to_string();
  EXPECT_TRUE(asked);
  EXPECT_LT(took, 30.0);
  auto one = create_nccl_communicator(dev_.get(), NcclCommOptions{});
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  EXPECT_EQ((*one)->world_size(), 1);
}

TEST_F(NcclOneRank, TheFactoryPicksNcclForACudaDevice) {
  for (const char* v : {"RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"}) unsetenv(v);
  auto n = create_communicator(dev_.get(), {CommBackendKind::kNccl, 30.0});
  ASSERT_TRUE(n.ok()) << n.status().to_string();
  EXPECT_STREQ((*n)->backend_name(), "nccl");
  auto a = create_communicator(dev_.get(), {CommBackendKind::kAuto, 30.0});
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_STREQ((*a)->backend_name(), "self");  // one rank needs no transport
  auto m = create_communicator(dev_.get(), {CommBackendKind::kMpi, 30.0});
  EXPECT_FALSE(m.ok());
}

#endif  // STRATA_TEST_NCCL_GPU

}  // namespace
}  // namespace strata::comm
