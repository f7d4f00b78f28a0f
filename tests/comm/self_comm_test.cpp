// The one-rank communicator and the factory.
#include "comm/self_comm.h"

#include <gtest/gtest.h>

#include <cstring>

#include "comm/communicator.h"
#include "comm/nccl_comm.h"
#include "comm_pattern.h"
#include "device/host_backend.h"

namespace strata::comm {
namespace {

TEST(SelfComm, CollectivesAreCopies) {
  auto dev = create_host_backend({});
  ASSERT_TRUE(dev.ok());
  auto c = create_communicator(dev->get(), {CommBackendKind::kSelf, 1.0});
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  Communicator& comm = **c;
  EXPECT_EQ(comm.rank(), 0);
  EXPECT_EQ(comm.world_size(), 1);
  auto stream = (*dev)->create_stream("comm");
  ASSERT_TRUE(stream.ok());
  const std::size_t n = 1001;
  auto a = (*dev)->alloc(n * 4), b = (*dev)->alloc(n * 4);
  ASSERT_TRUE(a.ok() && b.ok());
  auto* src = static_cast<float*>(*a);
  auto* dst = static_cast<float*>(*b);
  test::fill(src, 0, 0, n);
  ASSERT_TRUE(comm.all_reduce(src, dst, n, *stream).ok());
  ASSERT_TRUE((*dev)->synchronize(*stream).ok());
  EXPECT_TRUE(test::same_bits(dst, test::rank_order_sum(1, 0, n).data(), n));
  std::memset(dst, 0, n * 4);
  ASSERT_TRUE(comm.reduce_scatter(src, dst, n, *stream).ok());
  ASSERT_TRUE(comm.all_gather(src, dst, 0, *stream).ok());
  ASSERT_TRUE(comm.barrier(*stream).ok());
  ASSERT_TRUE(comm.broadcast(dst, n * 4, 0, *stream).ok());
  ASSERT_TRUE((*dev)->synchronize(*stream).ok());
  EXPECT_TRUE(test::same_bits(dst, src, n));
  EXPECT_EQ(comm.broadcast(dst, 4, 1, *stream).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE((*dev)->free(*a).ok());
  ASSERT_TRUE((*dev)->free(*b).ok());
  ASSERT_TRUE((*dev)->destroy_stream(*stream).ok());
}

TEST(CommFactory, SaysWhyABackendIsUnavailable) {
  auto dev = create_host_backend({});
  ASSERT_TRUE(dev.ok());
  // NCCL takes CUDA buffers: over the host backend it is refused by name
  // (or, in a build without it, said to be missing).
  auto nccl = create_communicator(dev->get(), {CommBackendKind::kNccl, 1.0});
  ASSERT_FALSE(nccl.ok());
  EXPECT_EQ(nccl.status().code(), nccl_backend_built() ? StatusCode::kInvalidArgument : StatusCode::kUnavailable)
      << nccl.status().to_string();
  EXPECT_NE(nccl.status().message().find(nccl_backend_built() ? "CUDA device backend" : "NCCL"), std::string::npos)
      << nccl.status().to_string();
  if (!mpi_backend_built()) {
    auto mpi = create_communicator(dev->get(), {CommBackendKind::kMpi, 1.0});
    ASSERT_FALSE(mpi.ok());
    EXPECT_EQ(mpi.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(mpi.status().message().find("libopenmpi-dev"), std::string::npos);
  }
  EXPECT_EQ(create_communicator(dev->get(), {CommBackendKind::kSelf, 0.0}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(create_communicator(nullptr, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(parse_comm_backend_kind("tcp").status().code(), StatusCode::kInvalidArgument);
  auto mpi_kind = parse_comm_backend_kind("mpi");
  ASSERT_TRUE(mpi_kind.ok());
  EXPECT_EQ(*mpi_kind, CommBackendKind::kMpi);
}

}  // namespace
}  // namespace strata::comm
