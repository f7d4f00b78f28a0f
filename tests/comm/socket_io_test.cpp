// The socket helpers' addresses (comm/socket_io.h): MASTER_ADDR as IPv4,
// IPv6 or a host name, brackets refused by name, a connect that tries each
// resolved address in turn, and a listener that takes IPv4 and IPv6 peers;
// in a network namespace with a narrowed ephemeral range, a listener that
// never takes MASTER_PORT and a connection to itself counted as refused.
// The IPv6 cases skip, saying why, where ::1 is not available.
#include "comm/socket_io.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <string>
#include <vector>

#include "test_util/ipv6.h"
#include "test_util/netns.h"

namespace strata::comm::net {
namespace {

bool contains(const Status& st, const std::string& needle) { return st.message().find(needle) != std::string::npos; }

std::vector<SockAddr> must_resolve(const std::string& addr, uint16_t port) {
  auto r = resolve(addr, port, "test");
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? *r : std::vector<SockAddr>{};
}

// Accepts one connection on `listener` and returns where it came from.
std::string accept_peer(int listener) {
  auto ready = wait_fd(listener, POLLIN, deadline_after(10));
  if (!ready.ok() || !*ready) return "(nothing came)";
  SockAddr peer;
  peer.len = sizeof peer.ss;
  Fd c(::accept4(listener, reinterpret_cast<sockaddr*>(&peer.ss), &peer.len, SOCK_CLOEXEC));
  return c.fd < 0 ? "(accept failed)" : to_text(peer);
}

TEST(SocketIo, ResolvesIpv4Ipv6AndHostNames) {
  auto v4 = must_resolve("127.0.0.1", 29500);
  ASSERT_EQ(v4.size(), 1u);
  EXPECT_EQ(v4[0].family(), AF_INET);
  EXPECT_EQ(to_text(v4[0]), "127.0.0.1:29500");
  auto v6 = must_resolve("::1", 29500);
  ASSERT_EQ(v6.size(), 1u);
  EXPECT_EQ(v6[0].family(), AF_INET6);
  EXPECT_EQ(v6[0].port(), 29500);
  EXPECT_EQ(to_text(v6[0]), "[::1]:29500");
  // An IPv4-mapped address (how a dual-stack listener sees an IPv4 peer)
  // prints as the IPv4 address it is.
  auto mapped = must_resolve("::ffff:10.1.2.3", 7);
  ASSERT_EQ(mapped.size(), 1u);
  EXPECT_EQ(to_text(mapped[0]), "10.1.2.3:7");
  auto host = must_resolve("localhost", 1);
  ASSERT_FALSE(host.empty());
  for (const auto& a : host) {
    EXPECT_TRUE(a.family() == AF_INET || a.family() == AF_INET6) << a.family();
    EXPECT_EQ(a.port(), 1);
  }
  EXPECT_EQ(host_port_text("::1", 29500), "[::1]:29500");
  EXPECT_EQ(host_port_text("node0", 29500), "node0:29500");
}

// torch.distributed cannot resolve "[::1]" (its TCPStore retries until its
// timeout): refused at once, saying how to write it.
TEST(SocketIo, AnAddressInBracketsIsRefusedNamingIt) {
  auto r = resolve("[::1]", 29500, "rendezvous at [::1]:29500 (rank 1 of 2)");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(r.status(),
                       "cannot resolve MASTER_ADDR '[::1]': an IPv6 address is written without brackets ('::1')"))
      << r.status().message();
}

// A link-local address is reached through one interface: with it
// ("fe80::2%lo") it resolves with that interface as its zone, printed and
// found again by link_local_zone (the TCP communicator reaches the other
// ranks' link-local addresses through it); without it, connect() would fail
// with EINVAL: refused, saying how to write it. (Ranks meeting over
// link-local addresses: tcp_ranks_netns.)
TEST(SocketIo, ALinkLocalAddressNeedsItsInterface) {
  auto r = resolve("fe80::2", 29500, "rendezvous at [fe80::2]:29500 (rank 1 of 2)");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(r.status(), "MASTER_ADDR 'fe80::2' is a link-local IPv6 address")) << r.status().message();
  EXPECT_TRUE(contains(r.status(), "'fe80::2%eth0'")) << r.status().message();
  STRATA_NEED_IPV6_LOOPBACK();
  auto zoned = must_resolve("fe80::2%lo", 29500);
  ASSERT_EQ(zoned.size(), 1u);
  EXPECT_EQ(to_text(zoned[0]), "[fe80::2%lo]:29500");
  EXPECT_NE(link_local_zone(zoned), 0u);
  EXPECT_EQ(link_local_zone(must_resolve("::1", 1)), 0u);
  EXPECT_EQ(link_local_zone(must_resolve("127.0.0.1", 1)), 0u);
}

// Rank 0's listener: dual-stack, so ranks that name its host by IPv4 and by
// IPv6 both reach it.
TEST(SocketIo, TheListenerTakesIpv4AndIpv6Peers) {
  STRATA_NEED_IPV6_LOOPBACK();
  auto l = listen_on(0, 4, "test");
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  const uint16_t port = local_port(l->fd);
  ASSERT_NE(port, 0);
  bool refused = false;
  auto c4 = connect_once(must_resolve("127.0.0.1", port), deadline_after(10), "test", &refused);
  ASSERT_TRUE(c4.ok()) << c4.status().to_string();
  EXPECT_EQ(accept_peer(l->fd).rfind("127.0.0.1:", 0), 0u);
  auto c6 = connect_once(must_resolve("::1", port), deadline_after(10), "test", &refused);
  ASSERT_TRUE(c6.ok()) << c6.status().to_string();
  EXPECT_EQ(accept_peer(l->fd).rfind("[::1]:", 0), 0u);
}

// Each resolved address is tried in order: [::1] refuses (nothing listens
// there), 127.0.0.1 takes it; with nothing listening at either, the error
// names both and says "refused" (worth retrying).
TEST(SocketIo, ConnectTriesEachAddressInTurn) {
  STRATA_NEED_IPV6_LOOPBACK();
  Fd l(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));  // IPv4 only
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(l.fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  ASSERT_EQ(::listen(l.fd, 4), 0);
  const uint16_t port = local_port(l.fd);
  std::vector<SockAddr> both = must_resolve("::1", port);
  const auto v4 = must_resolve("127.0.0.1", port);
  both.insert(both.end(), v4.begin(), v4.end());
  bool refused = true;
  auto c = connect_once(both, deadline_after(10), "test", &refused);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_FALSE(refused);
  l = Fd();  // nothing listens at either now
  auto none = connect_once(both, deadline_after(10), "test", &refused);
  ASSERT_FALSE(none.ok());
  EXPECT_TRUE(refused);
  const std::string p = std::to_string(port);
  EXPECT_TRUE(contains(none.status(), "test: connect to [::1]:" + p + " failed: Connection refused; to 127.0.0.1:" + p +
                                          ": Connection refused"))
      << none.status().message();
}

// A timeout of "effectively never" (1e10 s, 1e300) is a deadline far off,
// not one that overflowed into the past (every wait failed at once).
TEST(SocketIo, AHugeTimeoutIsAFarDeadline) {
  for (double s : {1e10, 1e12, 1e300}) {
    const auto d = deadline_after(s);
    EXPECT_GT(d - Clock::now(), std::chrono::hours(24 * 365 * 10)) << s;
    EXPECT_GT(ms_left(d), 0) << s;
  }
}

// A rank's listener is made by bind(0) before rank 0 serves MASTER_PORT,
// and a free MASTER_PORT is the kernel's pick from the same ephemeral range
// (launchers take one so). One that landed there took rank 0's connection
// and answered nothing: every rank waited out its timeout (seen once in CI,
// tcp_comm_death_np3). With the range narrowed to two ports, bind(0) offers
// the odd one first.
TEST(SocketIo, TheRanksListenerNeverTakesMasterPort) {
  test::run_in_netns(40000, 40001, []() -> std::string {
    {  // The premise: left alone, the kernel offers 40001 first.
      auto plain = listen_on(0, 4, "test");
      if (!plain.ok()) return plain.status().to_string();
      if (local_port(plain->fd) != 40001)
        return "premise: bind(0) offered " + std::to_string(local_port(plain->fd)) + " first, not 40001";
    }
    auto l = listen_on_other_port(40001, 4, "test");
    if (!l.ok()) return l.status().to_string();
    if (local_port(l->fd) != 40000) return "listening on port " + std::to_string(local_port(l->fd));
    // 40001 was only held while the other port was picked: free again.
    auto master = listen_on(40001, 4, "test");
    return master.ok() ? "" : master.status().to_string();
  });
}

// A connect to a port of this host that nothing listens on, from a source
// port the kernel picked equal to it, connects the socket to itself (a TCP
// simultaneous open). Taken for a store, it answered rank 0's handshake
// with its own bytes ("a wrong ping reply": a fatal error), and it held
// MASTER_PORT so that rank 0 could not serve it. With a one-port range the
// kernel has no other source port to pick: the attempt must count as
// refused, and leave the port free.
TEST(SocketIo, AConnectionToItselfCountsAsRefused) {
  test::run_in_netns(40000, 40000, []() -> std::string {
    bool refused = false;
    auto c = connect_once(must_resolve("127.0.0.1", 40000), deadline_after(10), "test", &refused);
    if (c.ok()) return "connected (to itself: " + std::to_string(self_connected(c->fd)) + ")";
    if (!refused) return "not counted as refused: " + c.status().to_string();
    if (!contains(c.status(), "test: connect to 127.0.0.1:40000 failed: Connection refused"))
      return c.status().to_string();
    auto l = listen_on(40000, 4, "test");
    return l.ok() ? "" : "the port was not left free: " + l.status().to_string();
  });
}

}  // namespace
}  // namespace strata::comm::net
