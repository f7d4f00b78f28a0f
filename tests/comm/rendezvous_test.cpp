// The TCP rendezvous with 3 processes on loopback: rank 0 in the test
// process, ranks 1 and 2 forked; over 127.0.0.1, and over ::1, a host name
// and a mix of IPv4 and IPv6 (those skip, saying why, where ::1 is not
// available). Each child checks its own result and
// reports through its exit status. Timeouts of the passing cases are generous
// (the machine may be loaded); the failing ones are short on purpose.
#include "comm/rendezvous.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <functional>
#include <string>
#include <vector>

#include "comm/socket_io.h"
#include "test_util/free_port.h"
#include "test_util/ipv6.h"
#include "test_util/netns.h"

namespace strata::comm {
namespace {

using test::free_port;

// Runs `child` in a forked process; its return value is the exit status.
pid_t spawn(const std::function<int()>& child) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(child());
  return pid;
}

int exit_status(pid_t pid) {
  int st = 0;
  ::waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

RendezvousOptions opts(uint16_t port, int rank, int world, double timeout_s, const std::string& addr = "127.0.0.1") {
  RendezvousOptions o;
  o.addr = addr;
  o.port = port;
  o.rank = rank;
  o.world_size = world;
  o.timeout_s = timeout_s;
  return o;
}

bool contains(const Status& st, const std::string& needle) { return st.message().find(needle) != std::string::npos; }

// A listener on a loopback port the kernel picks (its connections are
// completed by the kernel; nothing here reads them): the fd, *port set.
int loopback_listener(uint16_t* port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof sa;
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  EXPECT_EQ(::listen(fd, 4), 0);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  *port = ntohs(sa.sin_port);
  return fd;
}

TEST(Rendezvous, ThreeRanksGetRankZerosBlob) {
  const uint16_t port = free_port();
  std::vector<uint8_t> blob(128);  // the size of an ncclUniqueId
  for (std::size_t i = 0; i < blob.size(); ++i) blob[i] = static_cast<uint8_t>(i * 7 + 3);
  std::vector<pid_t> kids;
  for (int r = 1; r < 3; ++r)
    kids.push_back(spawn([&, r] {
      auto got = rendezvous_broadcast(opts(port, r, 3, 30), {});
      if (!got.ok()) {
        fprintf(stderr, "rank %d: %s\n", r, got.status().to_string().c_str());
        return 1;
      }
      return *got == blob ? 0 : 2;
    }));
  // Rank 0 starts late: the others retry until it listens.
  ::usleep(200 * 1000);
  auto got = rendezvous_broadcast(opts(port, 0, 3, 30), blob);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(*got, blob);
  for (pid_t k : kids) EXPECT_EQ(exit_status(k), 0);
}

// Rank r names rank 0's host as addrs[r] (MASTER_ADDR differs per rank: one
// host reached by IPv4 and by IPv6); every rank gets rank 0's blob.
void three_ranks_meet(const std::vector<std::string>& addrs) {
  const uint16_t port = free_port();
  const std::vector<uint8_t> blob{1, 2, 3, 4, 5};
  std::vector<pid_t> kids;
  for (int r = 1; r < 3; ++r)
    kids.push_back(spawn([&, r] {
      auto got = rendezvous_broadcast(opts(port, r, 3, 30, addrs[r]), {});
      if (!got.ok()) {
        fprintf(stderr, "rank %d: %s\n", r, got.status().to_string().c_str());
        return 1;
      }
      return *got == blob ? 0 : 2;
    }));
  ::usleep(100 * 1000);
  auto got = rendezvous_broadcast(opts(port, 0, 3, 30, addrs[0]), blob);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(*got, blob);
  for (pid_t k : kids) EXPECT_EQ(exit_status(k), 0);
}

TEST(Rendezvous, ThreeRanksOverIpv6Loopback) {
  STRATA_NEED_IPV6_LOOPBACK();
  three_ranks_meet({"::1", "::1", "::1"});
}

TEST(Rendezvous, ThreeRanksThroughAHostName) { three_ranks_meet({"localhost", "localhost", "localhost"}); }

// Rank 0 serves on the wildcard, dual-stack: rank 1 comes over IPv4, rank 2
// over IPv6.
TEST(Rendezvous, RanksComingOverIpv4AndIpv6Meet) {
  STRATA_NEED_IPV6_LOOPBACK();
  three_ranks_meet({"::1", "127.0.0.1", "::1"});
}

// "[::1]" is not how torch.distributed reads MASTER_ADDR: refused at once
// by name, not retried until the timeout.
TEST(Rendezvous, AnAddressInBracketsIsRefusedNamingIt) {
  const auto t0 = std::chrono::steady_clock::now();
  auto got = rendezvous_broadcast(opts(free_port(), 1, 2, 30, "[::1]"), {});
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(got.status(), "MASTER_ADDR '[::1]': an IPv6 address is written without brackets ('::1')"))
      << got.status().message();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
}

TEST(Rendezvous, WrongWorldSizeIsRefusedOnEveryRank) {
  const uint16_t port = free_port();
  // Rank 1 may come after rank 0 has refused and closed its port, and then
  // retries until its own timeout: a short one keeps the test short.
  auto k1 = spawn([&] {
    auto got = rendezvous_broadcast(opts(port, 1, 3, 3), {});
    return !got.ok() && contains(got.status(), "rank 0 refused the rendezvous") ? 0 : 1;
  });
  auto k2 = spawn([&] {
    auto got = rendezvous_broadcast(opts(port, 2, 4, 30), {});
    if (got.ok()) return 1;
    fprintf(stderr, "rank 2 sees: %s\n", got.status().message().c_str());
    return got.status().code() == StatusCode::kInvalidArgument &&
                   contains(got.status(), "rank 2 says world size 4, rank 0 has 3")
               ? 0
               : 2;
  });
  auto got = rendezvous_broadcast(opts(port, 0, 3, 30), {1, 2, 3});
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(got.status(), "rank 2 says world size 4, rank 0 has 3")) << got.status().message();
  // Rank 1 may have connected before or after rank 2's hello: either it got
  // the refusal or, connecting after rank 0 closed, it times out; both fail.
  const int s1 = exit_status(k1);
  EXPECT_EQ(exit_status(k2), 0);
  EXPECT_TRUE(s1 == 0 || s1 == 1) << s1;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Rank 0 says 3 ranks, the only other one says 2: rank 2 will never come.
// The refusal ends rank 0's wait at once, not at its 60 s timeout (nor after
// a wait for ranks still to come: after a refusal of the launch itself the
// missing ranks may not exist).
TEST(Rendezvous, ARefusalEndsRankZerosWaitAtOnce) {
  const uint16_t port = free_port();
  auto k1 = spawn([&] {
    auto got = rendezvous_broadcast(opts(port, 1, 2, 60), {});
    return !got.ok() && contains(got.status(), "rank 1 says world size 2, rank 0 has 3") ? 0 : 1;
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto got = rendezvous_broadcast(opts(port, 0, 3, 60), {7});
  const double s = seconds_since(t0);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(got.status(), "rank 1 says world size 2, rank 0 has 3")) << got.status().message();
  EXPECT_LT(s, 5.0);
  EXPECT_EQ(exit_status(k1), 0);
}

// Two processes given RANK=1 (and no rank 2): the second to count itself in
// refuses, rank 0 decides at once, and every process fails naming rank 1.
TEST(Rendezvous, TwoProcessesGivenOneRankAreNamed) {
  const uint16_t port = free_port();
  std::vector<pid_t> kids;
  for (int r : {1, 1})
    kids.push_back(spawn([&, r] {
      auto got = rendezvous_broadcast(opts(port, r, 3, 60), {});
      if (got.ok()) return 1;
      fprintf(stderr, "rank %d sees: %s\n", r, got.status().message().c_str());
      return contains(got.status(), "2 processes joined as rank 1 (two processes given RANK=1?)") ? 0 : 2;
    }));
  const auto t0 = std::chrono::steady_clock::now();
  auto got = rendezvous_broadcast(opts(port, 0, 3, 60), {7});
  const double s = seconds_since(t0);
  ASSERT_FALSE(got.ok());
  EXPECT_TRUE(contains(got.status(), "2 processes joined as rank 1")) << got.status().message();
  EXPECT_LT(s, 5.0);
  for (pid_t k : kids) EXPECT_EQ(exit_status(k), 0);
}

// Rank 0 that served the store holds MASTER_PORT while its handle lives: a
// second job given that port fails at once on every rank (before: its rank 1
// could meet this job's rank 0), this job's next exchange meets through the
// held store, and the port is free once the handle is released.
TEST(Rendezvous, AHeldPortTurnsASecondJobAwayAndServesTheNextExchange) {
  const uint16_t port = free_port();
  const std::vector<uint8_t> first{1, 2, 3}, second{4, 5};
  // This job's rank 1: two exchanges (keys "0" and "1").
  auto k1 = spawn([&] {
    auto a = rendezvous_broadcast(opts(port, 1, 2, 60), {});
    if (!a.ok() || *a != first) return 1;
    // The parent's second job runs between the two exchanges.
    ::usleep(1500 * 1000);
    RendezvousOptions o = opts(port, 1, 2, 60);
    o.key = "1";
    auto b = rendezvous_broadcast(o, {});
    if (!b.ok()) fprintf(stderr, "rank 1, second exchange: %s\n", b.status().to_string().c_str());
    return b.ok() && *b == second ? 0 : 2;
  });
  std::shared_ptr<void> held;
  RendezvousOptions o0 = opts(port, 0, 2, 60);
  o0.hold = &held;
  auto got = rendezvous_broadcast(o0, first);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  ASSERT_NE(held, nullptr);
  // Another job on the same port: its rank 1 and its rank 0 fail at once.
  auto other1 = spawn([&] {
    auto g = rendezvous_broadcast(opts(port, 1, 2, 60), {});
    if (g.ok()) return 1;
    fprintf(stderr, "the other job's rank 1 sees: %s\n", g.status().message().c_str());
    return g.status().code() == StatusCode::kAlreadyExists && contains(g.status(), "have already met and left it")
               ? 0
               : 2;
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto other0 = rendezvous_broadcast(opts(port, 0, 2, 60), {9});
  ASSERT_FALSE(other0.ok());
  EXPECT_EQ(other0.status().code(), StatusCode::kAlreadyExists) << other0.status().to_string();
  EXPECT_TRUE(contains(other0.status(), "another rank 0 already leads this rendezvous")) << other0.status().message();
  EXPECT_EQ(exit_status(other1), 0);
  EXPECT_LT(seconds_since(t0), 20.0);
  // This job's second exchange, through the held store.
  RendezvousOptions o1 = opts(port, 0, 2, 60);
  o1.key = "1";
  std::shared_ptr<void> unused;
  o1.hold = &unused;
  auto again = rendezvous_broadcast(o1, second);
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(*again, second);
  EXPECT_EQ(unused, nullptr);  // it served nothing itself
  EXPECT_EQ(exit_status(k1), 0);
  held.reset();  // the port is let go
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  sa.sin_port = htons(port);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0) << std::strerror(errno);
  ::close(fd);
}

// A rank that failed before it could meet the others (its data unreadable,
// say) refuses the exchange: rank 0 and the other rank fail at once with its
// reason, not at their 60 s timeout; the other rank comes a second later
// (slower to start) and still hears it.
TEST(Rendezvous, ARankThatFailedBeforeMeetingIsNamedAtOnce) {
  const uint16_t port = free_port();
  auto k1 = spawn([&] {
    Status st = rendezvous_refuse(opts(port, 1, 3, 60), "data file /d: No such file or directory");
    if (!st.ok()) fprintf(stderr, "rank 1: %s\n", st.to_string().c_str());
    return st.ok() ? 0 : 1;
  });
  auto k2 = spawn([&] {
    ::usleep(1000 * 1000);
    const auto t = std::chrono::steady_clock::now();
    auto got = rendezvous_broadcast(opts(port, 2, 3, 60), {});
    return !got.ok() && contains(got.status(), "rank 0 refused the rendezvous") &&
                   contains(got.status(), "rank 1 failed before the ranks met: data file /d") && seconds_since(t) < 10
               ? 0
               : 1;
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto got = rendezvous_broadcast(opts(port, 0, 3, 60), {7});
  ASSERT_FALSE(got.ok());
  EXPECT_TRUE(contains(got.status(), "rank 1 failed before the ranks met: data file /d: No such file or directory"))
      << got.status().message();
  EXPECT_LT(seconds_since(t0), 20.0);
  EXPECT_EQ(exit_status(k1), 0);
  EXPECT_EQ(exit_status(k2), 0);
}

// Rank 0 failed before meeting: it serves its refusal until every rank has
// heard it (here one that comes late), which they fail with at once; and
// ranks that all failed before meeting all end at once.
TEST(Rendezvous, ARankZeroThatFailedBeforeMeetingIsHeardByEveryRank) {
  const uint16_t port = free_port();
  std::vector<pid_t> kids;
  for (int r = 1; r < 3; ++r)
    kids.push_back(spawn([&, r] {
      if (r == 2) ::usleep(500 * 1000);  // comes after rank 0 has refused
      auto got = rendezvous_broadcast(opts(port, r, 3, 60), {});
      if (got.ok()) return 1;
      fprintf(stderr, "rank %d sees: %s\n", r, got.status().message().c_str());
      return contains(got.status(), "rank 0 refused the rendezvous") &&
                     contains(got.status(), "rank 0 failed before the ranks met: out of budget")
                 ? 0
                 : 2;
    }));
  const auto t0 = std::chrono::steady_clock::now();
  Status st = rendezvous_refuse(opts(port, 0, 3, 60), "out of budget");
  EXPECT_TRUE(st.ok()) << st.to_string();
  for (pid_t k : kids) EXPECT_EQ(exit_status(k), 0);
  EXPECT_LT(seconds_since(t0), 20.0);
  // Every rank failed before meeting: none waits for the others.
  const uint16_t port2 = free_port();
  kids.clear();
  for (int r = 1; r < 3; ++r)
    kids.push_back(spawn([&, r] { return rendezvous_refuse(opts(port2, r, 3, 60), "bad config").ok() ? 0 : 1; }));
  const auto t1 = std::chrono::steady_clock::now();
  st = rendezvous_refuse(opts(port2, 0, 3, 60), "bad config");
  EXPECT_TRUE(st.ok()) << st.to_string();
  for (pid_t k : kids) EXPECT_EQ(exit_status(k), 0);
  EXPECT_LT(seconds_since(t1), 20.0);
}

TEST(Rendezvous, MissingRankTimesOutNamingIt) {
  const uint16_t port = free_port();
  auto k1 = spawn([&] {
    auto got = rendezvous_broadcast(opts(port, 1, 3, 30), {});
    return !got.ok() && contains(got.status(), "never came: rank 2") ? 0 : 1;
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto got = rendezvous_broadcast(opts(port, 0, 3, 1.0), {9});
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(contains(got.status(), "never came: rank 2")) << got.status().message();
  EXPECT_LT(s, 5.0);
  EXPECT_EQ(exit_status(k1), 0);
}

TEST(Rendezvous, NoRankZeroTimesOut) {
  const auto t0 = std::chrono::steady_clock::now();
  auto got = rendezvous_broadcast(opts(free_port(), 1, 2, 0.5), {});
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(contains(got.status(), "could not reach rank 0")) << got.status().message();
  EXPECT_LT(s, 5.0);
}

// Rank 0 first tries MASTER_PORT as a client (torchrun's store may be
// there), and a joining rank retries it until rank 0 serves it: where the
// kernel picks a source port equal to MASTER_PORT (certain here: a range of
// two ports, the even one offered first), the socket connects to itself.
// Each rank must take that for "nothing listens yet", not for a store that
// answered wrongly (a fatal "wrong ping reply" before).
TEST(Rendezvous, AConnectionToItselfIsNotTakenForAStore) {
  test::run_in_netns(40000, 40001, []() -> std::string {
    {  // The premise: a plain connect to 40000 reaches itself here.
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in sa{};
      sa.sin_family = AF_INET;
      sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      sa.sin_port = htons(40000);
      const bool self = ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0 && net::self_connected(fd);
      const linger reset{1, 0};
      ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
      ::close(fd);
      if (!self) return "premise: a connect to 127.0.0.1:40000 did not reach itself";
    }
    auto lead = rendezvous_broadcast(opts(40000, 0, 2, 0.5), {9});
    if (lead.ok() || !contains(lead.status(), "never came: rank 1"))
      return "rank 0: " + (lead.ok() ? std::string("ok") : lead.status().to_string());
    auto join = rendezvous_broadcast(opts(40000, 1, 2, 0.5), {});
    if (join.ok() || !contains(join.status(), "could not reach rank 0"))
      return "rank 1: " + (join.ok() ? std::string("ok") : join.status().to_string());
    return "";
  });
}

// Rank 0's blob is made once MASTER_PORT is taken: a listener the maker
// opens on a port the kernel picks (NCCL's bootstrap root, which
// ncclGetUniqueId starts) can never take MASTER_PORT from the rendezvous.
// Here the kernel's range is 40000-40001 and MASTER_PORT 40001, the odd
// port, which bind() to port 0 is offered first (connect() prefers even
// ones; a free MASTER_PORT found by bind(0), as torchrun and launch_ranks
// find it, is odd too): made before rank 0 listened, the maker's listener
// took 40001 and rank 0's bind failed.
TEST(Rendezvous, TheRootBlobIsMadeOnceMasterPortIsTaken) {
  test::run_in_netns(40000, 40001, []() -> std::string {
    auto listener = [](uint16_t* port) {  // as NCCL's bootstrap root: a kernel-picked port
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in sa{};
      sa.sin_family = AF_INET;
      sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      socklen_t len = sizeof sa;
      *port = 0;
      if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0 && ::listen(fd, 4) == 0 &&
          ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) == 0)
        *port = ntohs(sa.sin_port);
      return fd;
    };
    uint16_t first = 0;  // the premise: such a listener gets 40001 here
    ::close(listener(&first));
    if (first != 40001) return "premise: a listener on a kernel-picked port got " + std::to_string(first);
    for (int round = 0; round < 3; ++round) {
      int root = -1;
      uint16_t root_port = 0;
      auto made = rendezvous_broadcast_lazy(opts(40001, 0, 2, 0.2), [&]() -> Result<std::vector<uint8_t>> {
        root = listener(&root_port);
        return std::vector<uint8_t>{1, 2};
      });
      if (root >= 0) ::close(root);
      if (root_port != 40000)
        return "round " + std::to_string(round) + ": the maker's listener got port " + std::to_string(root_port);
      // (No rank 1: the exchange times out naming it, not a failed bind.)
      if (made.ok() || !contains(made.status(), "never came: rank 1"))
        return "round " + std::to_string(round) + ": rank 0: " +
               (made.ok() ? std::string("ok") : made.status().to_string());
    }
    return "";
  });
}

// A maker that fails refuses the exchange: the other ranks hear why at once.
TEST(Rendezvous, AFailedRootBlobIsHeardByEveryRank) {
  const uint16_t port = free_port();
  auto k1 = spawn([&] {
    auto got = rendezvous_broadcast(opts(port, 1, 2, 60), {});
    return !got.ok() && contains(got.status(), "rank 0 could not make its blob: no NCCL here") ? 0 : 1;
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto got = rendezvous_broadcast_lazy(opts(port, 0, 2, 60), []() -> Result<std::vector<uint8_t>> {
    return Status(StatusCode::kUnavailable, "no NCCL here");
  });
  ASSERT_FALSE(got.ok());
  EXPECT_TRUE(contains(got.status(), "rank 0 could not make its blob: no NCCL here")) << got.status().to_string();
  EXPECT_EQ(got.status().code(), StatusCode::kUnavailable);  // the maker's
  EXPECT_EQ(exit_status(k1), 0);
  EXPECT_LT(seconds_since(t0), 20.0);
}

// Two jobs given one MASTER_PORT (a launcher that only sets the variables,
// so no torchrun agent holds the port): the second job's rank 0 finds the
// first's rank 0 serving there. It must say so, not publish its blob over
// the first job's (which would mix the two jobs' ranks).
TEST(Rendezvous, ASecondJobOnTheSamePortIsNamed) {
  const uint16_t port = free_port();
  // Job A's rank 0 of 2: its rank 1 never comes; it serves for 3 s.
  pid_t a = spawn([&] {
    auto got = rendezvous_broadcast(opts(port, 0, 2, 3.0), {1});
    return !got.ok() && contains(got.status(), "never came: rank 1") ? 0 : 1;
  });
  bool listening = false;  // (a connection that says nothing is dropped by A's store)
  for (int attempt = 0; attempt < 200 && !listening; ++attempt) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa.sin_port = htons(port);
    listening = ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0;
    ::close(fd);
    if (!listening) ::usleep(10000);
  }
  ASSERT_TRUE(listening);
  auto got = rendezvous_broadcast(opts(port, 0, 2, 2.0), {2});
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kAlreadyExists) << got.status().to_string();
  EXPECT_TRUE(contains(got.status(), "another rank 0 already leads this rendezvous (key '0')"))
      << got.status().message();
  EXPECT_TRUE(contains(got.status(), "Give each job its own MASTER_PORT")) << got.status().message();
  EXPECT_EQ(exit_status(a), 0);
}

// MASTER_PORT held a moment by a socket that does not listen (a joining
// rank's connection to itself before its reset, a closing store): rank 0
// finds nothing listening, and its bind fails at first. It tries again
// (a fatal "Address already in use" before), and the ranks meet.
TEST(Rendezvous, APortHeldAMomentIsServedOnceFree) {
  const uint16_t port = free_port();
  int held = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sa.sin_port = htons(port);
  ASSERT_EQ(::bind(held, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);  // bound, not listening
  const std::vector<uint8_t> blob{4, 2};
  pid_t k1 = spawn([&] {
    ::close(held);  // (the parent's copy holds it)
    auto got = rendezvous_broadcast(opts(port, 1, 2, 30), {});
    return got.ok() && *got == blob ? 0 : 1;
  });
  pid_t k0 = spawn([&] {
    ::close(held);
    auto got = rendezvous_broadcast(opts(port, 0, 2, 30), blob);
    if (!got.ok()) std::fprintf(stderr, "rank 0: %s\n", got.status().to_string().c_str());
    return got.ok() && *got == blob ? 0 : 1;
  });
  ::usleep(300000);  // rank 0 has found the port taken by now
  ::close(held);
  EXPECT_EQ(exit_status(k0), 0);
  EXPECT_EQ(exit_status(k1), 0);
}

// MASTER_PORT held by something that takes connections and says nothing
// (a stopped rank 0, a listener that is not a store): the timeout's error
// says that, not only "timed out receiving".
TEST(Rendezvous, AStoreThatNeverAnswersIsNamed) {
  uint16_t port = 0;
  const int fd = loopback_listener(&port);
  for (int rank : {0, 1}) {
    const std::vector<uint8_t> blob = rank == 0 ? std::vector<uint8_t>{1} : std::vector<uint8_t>{};
    auto got = rendezvous_broadcast(opts(port, rank, 2, 0.5), blob);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), StatusCode::kUnavailable);
    EXPECT_TRUE(contains(got.status(), "MASTER_PORT took the connection but never answered the TCPStore handshake"))
        << "rank " << rank << ": " << got.status().message();
  }
  ::close(fd);
}

// Something else connects to MASTER_PORT while rank 0 serves it (a port
// scanner, a stray HTTP client, a wrong magic): those connections are dropped
// and the ranks still meet.
TEST(Rendezvous, StrangersOnThePortAreDroppedAndTheRanksStillMeet) {
  const uint16_t port = free_port();
  int sent[2];  // each stranger writes a byte once it has sent its bytes; rank 1 waits for both
  ASSERT_EQ(::pipe(sent), 0);
  auto stranger = [&](std::string bytes) {
    return spawn([port, bytes, &sent] {
      for (int attempt = 0; attempt < 200; ++attempt) {  // until rank 0 listens
        int fd = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in sa{};
        sa.sin_family = AF_INET;
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        sa.sin_port = htons(port);
        if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0) {
          (void)!::write(fd, bytes.data(), bytes.size());
          (void)!::write(sent[1], "s", 1);
          char c;
          (void)!::read(fd, &c, 1);  // until rank 0 drops it
          ::close(fd);
          return 0;
        }
        ::close(fd);
        ::usleep(20000);
      }
      return 1;
    });
  };
  std::vector<pid_t> kids{stranger("GET / HTTP/1.0\r\n\r\n"), stranger(std::string("\0\x01\x02\x03\x04", 5))};
  const std::vector<uint8_t> blob{7, 7, 7};
  for (int r = 1; r < 3; ++r)
    kids.push_back(spawn([&, r] {
      // The exchange cannot end before rank 1 joins: the strangers come first.
      char c;
      for (int n = 0; r == 1 && n < 2; ++n)
        if (::read(sent[0], &c, 1) != 1) return 2;
      auto got = rendezvous_broadcast(opts(port, r, 3, 30), {});
      return got.ok() && *got == blob ? 0 : 1;
    }));
  auto got = rendezvous_broadcast(opts(port, 0, 3, 30), blob);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  for (pid_t k : kids) EXPECT_EQ(exit_status(k), 0);
  ::close(sent[0]);
  ::close(sent[1]);
}

// MASTER_PORT served by something that is not a TCPStore: rank 0 says so
// instead of publishing the id into it.
TEST(Rendezvous, APortThatIsNotATcpStoreIsNamed) {
  uint16_t port = 0;
  const int fd = loopback_listener(&port);
  pid_t k = spawn([fd] {  // accepts, reads the handshake, answers nonsense
    int c = ::accept(fd, nullptr, nullptr);
    char buf[64];
    (void)!::read(c, buf, sizeof buf);
    (void)!::write(c, "HTTP", 4);
    ::usleep(200000);
    ::close(c);
    return 0;
  });
  auto got = rendezvous_broadcast(opts(port, 0, 2, 5), {1});
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kIoError) << got.status().to_string();
  EXPECT_TRUE(contains(got.status(), "does not answer as a torch TCPStore")) << got.status().message();
  EXPECT_EQ(exit_status(k), 0);
  ::close(fd);
}

TEST(Rendezvous, BadOptions) {
  EXPECT_EQ(rendezvous_broadcast(opts(1, 2, 2, 1), {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rendezvous_broadcast(opts(1, 0, 2, 0), {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rendezvous_broadcast(opts(0, 1, 2, 1), {}).status().code(), StatusCode::kInvalidArgument);
  auto one = rendezvous_broadcast(opts(0, 0, 1, 1), {5});
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(*one, std::vector<uint8_t>{5});
}

}  // namespace
}  // namespace strata::comm
