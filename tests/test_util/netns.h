// Runs a check in a network namespace of its own (a forked child: unshare,
// loopback up), with the kernel's ephemeral port range narrowed to
// [lo, hi], so that the ports bind(0) and connect() pick are known: a test
// can make the kernel hand out MASTER_PORT, or connect a socket to itself.
// The range is the namespace's own (net.ipv4.ip_local_port_range is per
// namespace); nothing outside changes.
//
// The check returns "" when it passed, or what went wrong. Where namespaces
// cannot be made (no CAP_SYS_ADMIN) the test skips saying why, or fails
// under STRATA_REQUIRE_NETNS=1, as CI runs it.
#pragma once

#include <gtest/gtest.h>
#include <net/if.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

namespace strata::test {

namespace netns_detail {

// In the child: 0, or why the namespace could not be set up.
inline std::string enter(int lo, int hi) {
  if (::unshare(CLONE_NEWNET) != 0) return std::string("unshare(CLONE_NEWNET): ") + std::strerror(errno);
  const int s = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  ifreq ifr{};
  std::strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
  const bool up = s >= 0 && ::ioctl(s, SIOCGIFFLAGS, &ifr) == 0 && ((ifr.ifr_flags |= IFF_UP), true) &&
                  ::ioctl(s, SIOCSIFFLAGS, &ifr) == 0;
  const int err = errno;
  if (s >= 0) ::close(s);
  if (!up) return std::string("bringing up lo: ") + std::strerror(err);
  FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "w");
  if (f == nullptr) return std::string("opening ip_local_port_range: ") + std::strerror(errno);
  const bool written = std::fprintf(f, "%d %d", lo, hi) > 0;
  if (std::fclose(f) != 0 || !written) return std::string("writing ip_local_port_range: ") + std::strerror(errno);
  return "";
}

}  // namespace netns_detail

// Exit codes of the child: 0 passed, 1 failed (the reason on stderr), 77 no
// namespace (the reason on stderr).
inline void run_in_netns(int lo, int hi, const std::function<std::string()>& check) {
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(pipefd[0]);
    std::string why = netns_detail::enter(lo, hi);
    int code = 77;
    if (why.empty()) {
      why = check();
      code = why.empty() ? 0 : 1;
    }
    (void)!::write(pipefd[1], why.data(), why.size());
    ::_exit(code);
  }
  ::close(pipefd[1]);
  std::string why;
  char buf[512];
  for (ssize_t k; (k = ::read(pipefd[0], buf, sizeof buf)) != 0;) {
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) break;
    why.append(buf, static_cast<std::size_t>(k));
  }
  ::close(pipefd[0]);
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  ASSERT_TRUE(WIFEXITED(st)) << "the namespace's child was killed by signal " << WTERMSIG(st);
  if (WEXITSTATUS(st) == 77) {
    const char* req = std::getenv("STRATA_REQUIRE_NETNS");
    if (req != nullptr && std::strcmp(req, "1") == 0) FAIL() << "STRATA_REQUIRE_NETNS=1: " << why;
    GTEST_SKIP() << "no network namespace: " << why;
  }
  EXPECT_EQ(WEXITSTATUS(st), 0) << why;
}

}  // namespace strata::test
