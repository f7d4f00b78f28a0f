// Whether this machine can run a test over IPv6 loopback (::1): tests of the
// IPv6 paths skip, saying why, where the kernel has IPv6 off (net.ipv6 sysctl
// disable_ipv6 on lo, or no IPv6 at all: ipv6.disable=1) or ::1 cannot be
// bound. With STRATA_REQUIRE_IPV6=1 (CI, whose machines have ::1) such a
// test fails instead of skipping.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

namespace strata::test {

// "" when ::1 works; otherwise the reason.
inline std::string ipv6_loopback_missing() {
  std::ifstream f("/proc/sys/net/ipv6/conf/lo/disable_ipv6");
  int disabled = 0;
  if (f >> disabled && disabled != 0) return "IPv6 is disabled on lo (/proc/sys/net/ipv6/conf/lo/disable_ipv6 = 1)";
  const int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
  if (fd < 0) return std::string("no IPv6 socket: ") + std::strerror(errno);
  sockaddr_in6 sa{};
  sa.sin6_family = AF_INET6;
  sa.sin6_addr = in6addr_loopback;
  const int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return std::string("cannot bind [::1]: ") + std::strerror(err);
  return "";
}

// STRATA_REQUIRE_IPV6=1: a missing ::1 fails the IPv6 tests.
inline bool ipv6_required() {
  const char* e = std::getenv("STRATA_REQUIRE_IPV6");
  return e != nullptr && std::string(e) == "1";
}

}  // namespace strata::test

// In a gtest body: skips (or, under STRATA_REQUIRE_IPV6=1, fails) naming why
// when ::1 cannot be used.
#define STRATA_NEED_IPV6_LOOPBACK()                                                     \
  do {                                                                                  \
    if (auto why_ = ::strata::test::ipv6_loopback_missing(); !why_.empty()) {          \
      if (::strata::test::ipv6_required()) GTEST_FAIL() << why_ << " (STRATA_REQUIRE_IPV6=1)"; \
      GTEST_SKIP() << why_;                                                             \
    }                                                                                   \
  } while (0)
