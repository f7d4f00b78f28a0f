// Every collective of a multi-rank backend, run by each of N processes:
// against the locally computed expected result, sums bit-identical to the
// 1-rank rank-order sum, odd and zero sizes, a 40 MB buffer, several streams
// at once, stream ordering; (RanksTimeout, its own ctest entry) a rank that
// stops participating makes the others fail with an error naming it within
// the timeout; (RanksGiveUp, TCP only) a rank that gives up tells every
// other rank why; and (RanksDeath, TCP only: mpirun ends the whole job) a
// rank that dies makes the others fail at once naming it.
//
// Built twice: test_comm_mpi (mpi_main.cpp: under mpirun -np 2 and 3) and
// test_comm_tcp (tcp_main.cpp: under launch_ranks, torchrun-style). Every
// rank runs the same tests in the same order, so the collectives match.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/host_collectives.h"
#include "comm_pattern.h"
#include "device/host_backend.h"
#include "ranks_world.h"

namespace strata::comm {
namespace {

using test::fill;
using test::rank_order_sum;
using test::same_bits;

// Every rank of g_world meets here. A failure test's silent rank waits in it
// (never touching the communicator under test) until the others have seen
// their failure and come too: no fixed sleep that must outlast the others.
void world_barrier() {
  DeviceBackend* dev = g_world->dev.get();
  auto s = dev->create_stream("world");
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(g_world->comm->barrier(*s).ok());
  Status st = dev->synchronize(*s);
  EXPECT_TRUE(st.ok()) << st.to_string();
  (void)dev->destroy_stream(*s);
}

class Ranks : public ::testing::Test {
 protected:
  void SetUp() override {
    dev_ = g_world->dev.get();
    comm_ = g_world->comm.get();
    rank_ = comm_->rank();
    world_ = comm_->world_size();
    auto s = dev_->create_stream("comm");
    ASSERT_TRUE(s.ok());
    stream_ = *s;
  }
  void TearDown() override {
    for (void* p : bufs_) EXPECT_TRUE(dev_->free(p).ok());
    EXPECT_TRUE(dev_->destroy_stream(stream_).ok());
  }
  template <typename T>
  T* alloc(std::size_t n) {
    auto r = dev_->alloc(n * sizeof(T));
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    bufs_.push_back(*r);
    return static_cast<T*>(*r);
  }
  void sync() {
    Status st = dev_->synchronize(stream_);
    ASSERT_TRUE(st.ok()) << st.to_string();
  }

  DeviceBackend* dev_ = nullptr;
  Communicator* comm_ = nullptr;
  DeviceStream* stream_ = nullptr;
  int rank_ = 0, world_ = 1;
  std::vector<void*> bufs_;
};

uint8_t byte_of(int rank, std::size_t i) { return static_cast<uint8_t>(test::mix(rank * 1000003ull + i)); }

TEST_F(Ranks, AllGatherOddSizes) {
  for (std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{4097}, std::size_t{1000003}}) {
    auto* send = alloc<uint8_t>(bytes + 1);
    auto* recv = alloc<uint8_t>(bytes * world_ + 1);
    for (std::size_t i = 0; i < bytes; ++i) send[i] = byte_of(rank_, i);
    ASSERT_TRUE(comm_->all_gather(send, recv, bytes, stream_).ok());
    sync();
    for (int r = 0; r < world_; ++r)
      for (std::size_t i = 0; i < bytes; ++i)
        ASSERT_EQ(recv[r * bytes + i], byte_of(r, i)) << "bytes " << bytes << " rank " << r << " i " << i;
    // In place: the own slot of recv is the input.
    std::memset(recv, 0, bytes * world_);
    for (std::size_t i = 0; i < bytes; ++i) recv[rank_ * bytes + i] = byte_of(rank_, i);
    ASSERT_TRUE(comm_->all_gather(recv + rank_ * bytes, recv, bytes, stream_).ok());
    sync();
    for (int r = 0; r < world_; ++r)
      for (std::size_t i = 0; i < bytes; ++i) ASSERT_EQ(recv[r * bytes + i], byte_of(r, i));
  }
}

TEST_F(Ranks, ReduceScatterIsTheRankOrderSum) {
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{12345}}) {
    auto* send = alloc<float>(count * world_ + 1);
    auto* recv = alloc<float>(count + 1);
    fill(send, rank_, 0, count * world_, 1);
    ASSERT_TRUE(comm_->reduce_scatter(send, recv, count, stream_).ok());
    sync();
    const auto expect = rank_order_sum(world_, rank_ * count, count, 1);
    EXPECT_TRUE(same_bits(recv, expect.data(), count)) << "count " << count;
  }
}

TEST_F(Ranks, AllReduceIsTheRankOrderSumBitForBit) {
  // Sizes below, at and above the world size (uneven chunks), and 40 MB.
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{5},
                            std::size_t{1001}, std::size_t{10'000'019}}) {
    auto* send = alloc<float>(count + 1);
    auto* recv = alloc<float>(count + 1);
    fill(send, rank_, 0, count, 2);
    ASSERT_TRUE(comm_->all_reduce(send, recv, count, stream_).ok());
    sync();
    const auto expect = rank_order_sum(world_, 0, count, 2);
    EXPECT_TRUE(same_bits(recv, expect.data(), count)) << "count " << count;
    // Run to run: the same bits again, this time in place.
    ASSERT_TRUE(comm_->all_reduce(send, send, count, stream_).ok());
    sync();
    EXPECT_TRUE(same_bits(send, expect.data(), count)) << "in place, count " << count;
    if (count == 10'000'019 && world_ >= 3) {
      // The data make the order visible: summing from the last rank differs.
      std::vector<float> rev(count), part(count);
      fill(rev.data(), world_ - 1, 0, count, 2);
      for (int r = world_ - 2; r >= 0; --r) {
        fill(part.data(), r, 0, count, 2);
        for (std::size_t i = 0; i < count; ++i) rev[i] += part[i];
      }
      EXPECT_FALSE(same_bits(rev.data(), expect.data(), count)) << "test data too tame to show the order";
    }
  }
}

TEST_F(Ranks, BroadcastFromEveryRoot) {
  for (int root = 0; root < world_; ++root) {
    for (std::size_t bytes : {std::size_t{0}, std::size_t{5}, std::size_t{65537}}) {
      auto* buf = alloc<uint8_t>(bytes + 1);
      for (std::size_t i = 0; i < bytes; ++i) buf[i] = rank_ == root ? byte_of(root, i) : 0;
      ASSERT_TRUE(comm_->broadcast(buf, bytes, root, stream_).ok());
      sync();
      for (std::size_t i = 0; i < bytes; ++i) ASSERT_EQ(buf[i], byte_of(root, i)) << "root " << root;
    }
  }
  EXPECT_EQ(comm_->broadcast(nullptr, 0, world_, stream_).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(comm_->barrier(nullptr).code(), StatusCode::kInvalidArgument);
}

// comm/host_collectives.h: host vectors (not backend memory) through device
// staging — a buffer of the call's own (1 MiB) or the caller's (4 KiB, kept
// between calls) — in rounds when larger, `mine` inside or outside `all`.
TEST_F(Ranks, HostCollectivesStageThroughDeviceMemoryInRounds) {
  const std::size_t big = kHostCollectiveStaging + 12345;
  const HostStaging kept{alloc<uint8_t>(4096), 4096};
  for (const HostStaging staging : {HostStaging{}, kept}) {
    for (std::size_t bytes : {std::size_t{0}, std::size_t{8}, big / world_ + 7, big}) {
      std::vector<uint8_t> mine(bytes), all(bytes * world_ + 1, 0);
      for (std::size_t i = 0; i < bytes; ++i) mine[i] = byte_of(rank_, i);
      ASSERT_TRUE(all_gather_host(*comm_, stream_, mine.data(), all.data(), bytes, staging).ok());
      for (int r = 0; r < world_; ++r)
        for (std::size_t i = 0; i < bytes; ++i) ASSERT_EQ(all[r * bytes + i], byte_of(r, i)) << bytes << " " << r;
      std::fill(all.begin(), all.end(), 0);
      std::copy(mine.begin(), mine.end(), all.begin() + rank_ * bytes);
      ASSERT_TRUE(all_gather_host(*comm_, stream_, all.data() + rank_ * bytes, all.data(), bytes, staging).ok());
      for (int r = 0; r < world_; ++r)
        for (std::size_t i = 0; i < bytes; ++i) ASSERT_EQ(all[r * bytes + i], byte_of(r, i)) << bytes << " " << r;
      const int root = world_ - 1;
      std::vector<uint8_t> b(bytes, 0);
      if (rank_ == root) b = mine;
      ASSERT_TRUE(broadcast_host(*comm_, stream_, b.data(), bytes, root, staging).ok());
      for (std::size_t i = 0; i < bytes; ++i) ASSERT_EQ(b[i], byte_of(root, i)) << bytes;
    }
  }
}

TEST_F(Ranks, BarrierWaitsForTheSlowestRank) {
  // The last rank arrives 300 ms late; no rank leaves the barrier before the
  // moment it arrived. The ranks share one host, so steady_clock
  // (CLOCK_MONOTONIC) is one clock for all of them: the last rank's arrival,
  // broadcast afterwards, is compared with each rank's departure. (A wait
  // measured from each rank's own start would fail when a loaded machine
  // starts the ranks' tests far apart.)
  const int last = world_ - 1;
  const auto now_ns = [] {
    return static_cast<int64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count());
  };
  if (rank_ == last) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  int64_t arrived = now_ns();
  ASSERT_TRUE(comm_->barrier(stream_).ok());
  sync();
  const int64_t left = now_ns();
  ASSERT_TRUE(broadcast_host(*comm_, stream_, &arrived, sizeof arrived, last, HostStaging{}).ok());
  EXPECT_GE(left, arrived) << "rank " << rank_ << " left the barrier " << (arrived - left) / 1e6
                           << " ms before rank " << last << " arrived";
}

TEST_F(Ranks, OrderedOnTheStreamAndConcurrentAcrossStreams) {
  // Three streams, each: a host function writes the input, an all_reduce,
  // a host function checks the result; collectives of different streams run
  // at the same time (each rank enqueues them in the same order).
  constexpr int kStreams = 3, kRounds = 4;
  constexpr std::size_t n = 100'003;
  std::vector<DeviceStream*> streams;
  for (int s = 0; s < kStreams; ++s) {
    auto made = dev_->create_stream("comm" + std::to_string(s));
    ASSERT_TRUE(made.ok());
    streams.push_back(*made);
  }
  std::vector<float*> bufs;
  for (int s = 0; s < kStreams; ++s) bufs.push_back(alloc<float>(n));
  std::vector<std::vector<float>> expect;
  for (int k = 0; k < kRounds * kStreams; ++k) expect.push_back(rank_order_sum(world_, 0, n, 10 + k));
  std::atomic<int> checked{0};
  for (int k = 0; k < kRounds; ++k)
    for (int s = 0; s < kStreams; ++s) {
      float* b = bufs[s];
      const uint64_t salt = 10 + k * kStreams + s;
      ASSERT_TRUE(dev_->host_func_async(streams[s], [=, this] {
                    fill(b, rank_, 0, n, salt);
                    return Status();
                  }).ok());
      ASSERT_TRUE(comm_->all_reduce(b, b, n, streams[s]).ok());
      ASSERT_TRUE(dev_->host_func_async(streams[s], [&, b, k, s] {
                    if (same_bits(b, expect[k * kStreams + s].data(), n)) ++checked;
                    return Status();
                  }).ok());
    }
  for (DeviceStream* s : streams) {
    Status st = dev_->destroy_stream(s);
    EXPECT_TRUE(st.ok()) << st.to_string();
  }
  EXPECT_EQ(checked.load(), kRounds * kStreams);
}

// A rank that stops participating (alive, but never enqueues the collective):
// the others fail within the timeout with an error naming it, and the
// communicator stays broken.
TEST(RanksTimeout, SilentRankIsNamedWithinTheTimeout) {
  DeviceBackend* dev = g_world->dev.get();
  const double timeout_s = 1.5;
  auto made = make_communicator(dev, timeout_s);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  Communicator& comm = **made;
  const int world = comm.world_size(), silent = world - 1;
  ASSERT_GE(world, 2);
  auto stream = dev->create_stream("comm");
  ASSERT_TRUE(stream.ok());
  std::vector<float> buf(1000, 1.0f);
  if (comm.rank() == silent) {
    world_barrier();  // silent until the others have given up
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(comm.all_reduce(buf.data(), buf.data(), buf.size(), *stream).ok());  // accepted
    Status st = dev->synchronize(*stream);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.code(), StatusCode::kUnavailable);
    // Its own timeout, or (TCP) another waiting rank's, which gave up a
    // moment earlier and said why: either way the silent rank is named.
    const std::string where = "all_reduce #0 on rank " + std::to_string(comm.rank()) + " of " +
                              std::to_string(world) + " (" + comm.backend_name() + "): ";
    EXPECT_NE(st.message().find(where), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("timed out after 1.5 s waiting for rank " + std::to_string(silent)),
              std::string::npos)
        << st.message();
    // (A peer that started its collective earlier may give up a little
    // before this rank's own 1.5 s.)
    if (st.message().find("gave up") == std::string::npos) {
      EXPECT_GE(s, 1.4);
    }
    EXPECT_LT(s, 5.0) << "the error came later than the test's 5 s bound";
    // Broken: later collectives fail at once with the first error.
    Status again = comm.barrier(*stream);
    EXPECT_EQ(again.code(), StatusCode::kUnavailable);
    EXPECT_NE(again.message().find("broken by an earlier failure"), std::string::npos) << again.message();
    world_barrier();
  }
  (void)dev->destroy_stream(*stream);
  // The job goes on: a fresh communicator still works on every rank.
  made = Result<std::unique_ptr<Communicator>>(Status(StatusCode::kCancelled, "dropped"));
  auto fresh = make_communicator(dev, 120);
  ASSERT_TRUE(fresh.ok());
  auto s2 = dev->create_stream("comm2");
  ASSERT_TRUE(s2.ok());
  ASSERT_TRUE((*fresh)->barrier(*s2).ok());
  Status st = dev->destroy_stream(*s2);
  EXPECT_TRUE(st.ok()) << st.to_string();
}

// A rank that gives up (here: rank 1, the shortest timeout, waiting for
// silent rank 2) tells the others why before it closes: rank 0, which would
// wait 60 s for rank 2, fails at once naming rank 1's reason, rank 2. TCP
// with 3 ranks only (the abort frame, tcp_comm.h): ctest tcp_comm_timeout_np3.
TEST(RanksGiveUp, AGiveUpReachesEveryRankWithItsReason) {
  DeviceBackend* dev = g_world->dev.get();
  const int rank = g_world->comm->rank();
  auto made = make_communicator(dev, rank == 1 ? 3.0 : 60.0);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  Communicator& comm = **made;
  ASSERT_STREQ(comm.backend_name(), "tcp");
  ASSERT_EQ(comm.world_size(), 3);
  auto stream = dev->create_stream("comm");
  ASSERT_TRUE(stream.ok());
  std::vector<float> buf(1000, 1.0f);
  if (rank == 2) {
    world_barrier();  // silent until the others have failed
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(comm.all_reduce(buf.data(), buf.data(), buf.size(), *stream).ok());
    Status st = dev->synchronize(*stream);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
    EXPECT_NE(st.message().find("timed out after 3 s waiting for rank 2"), std::string::npos) << st.message();
    if (rank == 0) {
      EXPECT_NE(st.message().find("rank 1 gave up: all_reduce #0 on rank 1 of 3 (tcp)"), std::string::npos)
          << st.message();
      EXPECT_LT(s, 15.0) << "rank 0 waited for its own timeout: " << st.message();
      Status again = comm.barrier(*stream);  // and so does every later collective
      EXPECT_NE(again.message().find("rank 1 gave up"), std::string::npos) << again.message();
    }
    world_barrier();
  }
  (void)dev->destroy_stream(*stream);
}

// A rank that dies (its process exits mid-job, as when killed): its
// connections close, and every rank waiting on it fails at once naming it,
// long before the timeout. TCP only: Open MPI's mpirun ends the whole job
// instead (docs/comm.md).
TEST(RanksDeath, ADeadRankIsNamedAtOnce) {
  DeviceBackend* dev = g_world->dev.get();
  auto made = make_communicator(dev, 60);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  Communicator& comm = **made;
  const int world = comm.world_size(), dead = world - 1;
  ASSERT_GE(world, 2);
  // Two streams, a collective waiting on each when the rank dies: both fail
  // (the communicator breaks once, from two threads), and the error kept is
  // the first one, naming the rank.
  DeviceStream* streams[2];
  for (auto*& s : streams) {
    auto made_stream = dev->create_stream("comm");
    ASSERT_TRUE(made_stream.ok());
    s = *made_stream;
  }
  std::vector<float> a(1000, 1.0f), b(100'000, 2.0f);
  if (comm.rank() == dead) {
    // A moment in which the others are surely waiting, then gone without a word.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ::_exit(0);
  }
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(comm.all_reduce(a.data(), a.data(), a.size(), streams[0]).ok());
  ASSERT_TRUE(comm.all_gather(b.data(), b.data(), 0, streams[1]).ok());  // matches, completes
  ASSERT_TRUE(comm.reduce_scatter(b.data(), b.data() + b.size() - 10, 10, streams[1]).ok());
  Status st = dev->synchronize(streams[0]);
  Status st1 = dev->synchronize(streams[1]);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(st.ok());
  ASSERT_FALSE(st1.ok());
  // The dead rank, or a living one whose communicator broke on it first
  // (it closes its connections too): either way a rank named, in seconds.
  for (const Status* e : {&st, &st1}) {
    EXPECT_NE(e->message().find("closed its connection"), std::string::npos) << e->message();
    EXPECT_EQ(e->message().find("the communicator stopped"), std::string::npos) << e->message();
  }
  EXPECT_NE(st.message().find("all_reduce #0 on rank " + std::to_string(comm.rank())), std::string::npos)
      << st.message();
  EXPECT_LT(s, 20.0) << "the error came late: " << st.message();
  Status again = comm.barrier(streams[0]);
  EXPECT_NE(again.message().find("broken by an earlier failure"), std::string::npos) << again.message();
  EXPECT_NE(again.message().find("closed its connection"), std::string::npos) << again.message();
  for (DeviceStream* stream : streams) (void)dev->destroy_stream(stream);
}
}  // namespace
}  // namespace strata::comm
