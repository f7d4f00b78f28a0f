// mpi_broadcast_blob (how the NCCL id travels under mpirun), run by every
// rank of test_comm_mpi: rank 0's blob reaches every rank; a maker that fails
// on rank 0 (an error, an exception, a blob too long) fails every rank at
// once with its reason and code, instead of leaving them in the broadcast
// until the timeout.
#include <gtest/gtest.h>

#include <chrono>
#include <stdexcept>
#include <vector>

#include "comm/mpi_comm.h"
#include "ranks_world.h"

namespace strata::comm {
namespace {

using Clock = std::chrono::steady_clock;
using Blob = Result<std::vector<uint8_t>>;

MpiCommOptions options() {
  MpiCommOptions o;
  o.timeout_s = 60;  // a failure must come long before it
  return o;
}

TEST(MpiBlob, RankZerosBlobReachesEveryRankPadded) {
  int calls = 0;
  auto got = mpi_broadcast_blob(
      [&]() -> Blob {
        ++calls;
        return std::vector<uint8_t>{1, 2, 3};
      },
      128, options());
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  ASSERT_EQ(got->size(), 128u);
  EXPECT_EQ((*got)[0], 1);
  EXPECT_EQ((*got)[2], 3);
  EXPECT_EQ((*got)[3], 0);
  EXPECT_EQ(calls, g_world->comm->rank() == 0 ? 1 : 0);  // made on rank 0 only
}

void expect_every_rank_fails(const std::function<Blob()>& make, StatusCode code, const std::string& why) {
  const auto start = Clock::now();
  auto got = mpi_broadcast_blob(make, 128, options());
  const double s = std::chrono::duration<double>(Clock::now() - start).count();
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), code) << got.status().to_string();
  EXPECT_NE(got.status().message().find("rank 0 could not make its blob: " + why), std::string::npos)
      << got.status().to_string();
  EXPECT_LT(s, 30.0) << "rank " << g_world->comm->rank() << " waited for the timeout";
}

TEST(MpiBlob, AFailedMakerFailsEveryRankWithItsReasonAndCode) {
  expect_every_rank_fails([]() -> Blob { return Status(StatusCode::kUnavailable, "no NCCL here"); },
                          StatusCode::kUnavailable, "no NCCL here");
}

TEST(MpiBlob, AThrowingMakerFailsEveryRank) {
  expect_every_rank_fails([]() -> Blob { throw std::runtime_error("the maker threw"); }, StatusCode::kInternal,
                          "the maker threw");
}

TEST(MpiBlob, ABlobLongerThanEveryRankReceivesIsRefused) {
  expect_every_rank_fails([]() -> Blob { return std::vector<uint8_t>(129, 7); }, StatusCode::kInvalidArgument,
                          "its blob has 129 bytes, more than the 128 every rank receives");
}

}  // namespace
}  // namespace strata::comm
