// The one-rank communicator, the factory, and the TCP backend's one-rank,
// refusal and stop-flag cases.
#include "comm/self_comm.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/nccl_comm.h"
#include "comm/tcp_comm.h"
#include "comm_pattern.h"
#include "device/host_backend.h"
#include "test_util/free_port.h"

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
  EXPECT_EQ(parse_comm_backend_kind("gloo").status().code(), StatusCode::kInvalidArgument);
  auto mpi_kind = parse_comm_backend_kind("mpi");
  ASSERT_TRUE(mpi_kind.ok());
  EXPECT_EQ(*mpi_kind, CommBackendKind::kMpi);
  auto tcp_kind = parse_comm_backend_kind("tcp");
  ASSERT_TRUE(tcp_kind.ok());
  EXPECT_EQ(*tcp_kind, CommBackendKind::kTcp);
}

// The TCP backend with no launcher is one rank (no socket, no thread), and
// its collectives are the 1-rank results; bad options are refused by name.
// (N ranks: tcp_comm_np2/np3, collectives_test.cpp.)
TEST(TcpComm, OneRankWithoutALauncher) {
  auto dev = create_host_backend(HostBackendOptions{});
  ASSERT_TRUE(dev.ok());
  auto made = create_communicator(dev->get(), {CommBackendKind::kTcp, 5.0});
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  Communicator& c = **made;
  EXPECT_STREQ(c.backend_name(), "tcp");
  EXPECT_EQ(c.world_size(), 1);
  auto stream = (*dev)->create_stream("comm");
  ASSERT_TRUE(stream.ok());
  std::vector<float> a{1.5f, -2.0f, 3.25f}, b(3, 0.0f);
  ASSERT_TRUE(c.all_reduce(a.data(), b.data(), 3, *stream).ok());
  ASSERT_TRUE(c.reduce_scatter(a.data(), a.data() + 3, 0, *stream).ok());
  std::vector<uint8_t> bytes{7, 8, 9}, all(3);
  ASSERT_TRUE(c.all_gather(bytes.data(), all.data(), 3, *stream).ok());
  ASSERT_TRUE(c.broadcast(bytes.data(), 3, 0, *stream).ok());
  ASSERT_TRUE(c.barrier(*stream).ok());
  ASSERT_TRUE((*dev)->synchronize(*stream).ok());
  EXPECT_EQ(b, a);
  EXPECT_EQ(all, bytes);
  EXPECT_EQ(c.broadcast(bytes.data(), 3, 1, *stream).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE((*dev)->destroy_stream(*stream).ok());

  TcpCommOptions bad;
  bad.rank = 2;
  bad.world_size = 2;
  auto r = create_tcp_communicator(dev->get(), bad);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("rank 2 of world size 2"), std::string::npos) << r.status().to_string();
  bad.rank = 0;
  bad.timeout_s = 0;
  EXPECT_EQ(create_tcp_communicator(dev->get(), bad).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(create_tcp_communicator(nullptr, {}).status().code(), StatusCode::kInvalidArgument);
}

// Rank 1 of 2 whose rank 0 never comes: the rendezvous names it within the
// timeout (no thread or socket left behind).
TEST(TcpComm, AMissingRankZeroIsNamedWithinTheTimeout) {
  auto dev = create_host_backend(HostBackendOptions{});
  ASSERT_TRUE(dev.ok());
  TcpCommOptions o;
  o.master_addr = "127.0.0.1";
  o.master_port = 1;  // nothing listens on port 1
  o.rank = 1;
  o.world_size = 2;
  o.timeout_s = 0.5;
  const auto t0 = std::chrono::steady_clock::now();
  auto r = create_tcp_communicator(dev->get(), o);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().to_string();
  EXPECT_NE(r.status().message().find("rank 0"), std::string::npos) << r.status().to_string();
  EXPECT_LT(s, 10.0);
}

// Ranks given by the caller (a process group's rank, world size and store)
// are checked, and refused with a backend whose ranks are its own.
TEST(TcpComm, GivenRanksAreCheckedByName) {
  auto dev = create_host_backend(HostBackendOptions{});
  ASSERT_TRUE(dev.ok());
  LaunchInfo li;
  li.launcher = Launcher::kTorchrun;
  li.rank = 0;
  li.world_size = 1;
  CommOptions o;
  o.kind = CommBackendKind::kTcp;
  o.ranks = li;
  auto one = create_communicator(dev->get(), o);  // rank 0 of 1: no store needed
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  EXPECT_EQ((*one)->world_size(), 1);
  o.ranks->world_size = 2;
  auto no_store = create_communicator(dev->get(), o);
  EXPECT_EQ(no_store.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_store.status().message().find("without the store's address and port"), std::string::npos)
      << no_store.status().to_string();
  o.ranks->rank = 3;
  EXPECT_NE(create_communicator(dev->get(), o).status().message().find("given rank 3 of world size 2"),
            std::string::npos);
  o.ranks->rank = 0;
  o.kind = CommBackendKind::kSelf;
  auto self = create_communicator(dev->get(), o);
  EXPECT_EQ(self.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(self.status().message().find("ranks were given with the self backend"), std::string::npos)
      << self.status().to_string();
}

// An IPv6 address in brackets (not how torch.distributed reads MASTER_ADDR)
// is refused at once, naming it.
TEST(TcpComm, AMasterAddrInBracketsIsRefusedNamingIt) {
  auto dev = create_host_backend(HostBackendOptions{});
  ASSERT_TRUE(dev.ok());
  TcpCommOptions o;
  o.master_addr = "[::1]";
  o.master_port = 1;
  o.rank = 1;
  o.world_size = 2;
  o.timeout_s = 30;
  auto r = create_tcp_communicator(dev->get(), o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
  EXPECT_NE(r.status().message().find("'[::1]': an IPv6 address is written without brackets ('::1')"),
            std::string::npos)
      << r.status().to_string();
}

// A stop flag (the CLI's signal handler) set while a rank waits for the
// others ends the wait at once with kCancelled, rank 0 (serving the store,
// waiting for rank 1) and rank 1 (retrying to reach a rank 0 that is not
// there) alike, instead of at the 120 s timeout.
TEST(TcpComm, AStopFlagEndsTheWaitForTheOtherRanks) {
  auto dev = create_host_backend(HostBackendOptions{});
  ASSERT_TRUE(dev.ok());
  for (int rank : {0, 1}) {
    const uint16_t port = strata::test::free_port();  // nothing listens there afterwards
    ASSERT_NE(port, 0);
    std::atomic<bool> stop{false};
    CommOptions o;
    o.kind = CommBackendKind::kTcp;
    o.timeout_s = 120;
    o.ranks = LaunchInfo{Launcher::kTorchrun, rank, 2, 0, "127.0.0.1", port};
    o.cancel = [&stop] { return stop.load(); };
    std::thread signal([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      stop.store(true);
    });
    const auto t0 = std::chrono::steady_clock::now();
    auto r = create_communicator(dev->get(), o);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    signal.join();
    ASSERT_FALSE(r.ok()) << "rank " << rank;
    EXPECT_EQ(r.status().code(), StatusCode::kCancelled) << r.status().to_string();
    EXPECT_NE(r.status().message().find("interrupted (a stop signal) while waiting"), std::string::npos)
        << r.status().to_string();
    EXPECT_LT(s, 30.0) << "rank " << rank << " waited past the stop";
  }
}

}  // namespace
}  // namespace strata::comm
