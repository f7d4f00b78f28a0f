#include "comm/socket_io.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

namespace strata::comm::net {

uint16_t SockAddr::port() const {
  if (family() == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(ss).sin6_port);
  if (family() == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(ss).sin_port);
  return 0;
}

void SockAddr::set_port(uint16_t port) {
  if (family() == AF_INET6) reinterpret_cast<sockaddr_in6&>(ss).sin6_port = htons(port);
  if (family() == AF_INET) reinterpret_cast<sockaddr_in&>(ss).sin_port = htons(port);
}

std::string to_text(const SockAddr& a) {
  char ip[INET6_ADDRSTRLEN] = "?";
  if (a.family() == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(a.ss).sin_addr, ip, sizeof ip);
    return fmt::format("{}:{}", ip, a.port());
  }
  if (a.family() != AF_INET6) return fmt::format("(address family {})", a.family());
  const in6_addr& in6 = reinterpret_cast<const sockaddr_in6&>(a.ss).sin6_addr;
  if (IN6_IS_ADDR_V4MAPPED(&in6)) {
    ::inet_ntop(AF_INET, in6.s6_addr + 12, ip, sizeof ip);
    return fmt::format("{}:{}", ip, a.port());
  }
  ::inet_ntop(AF_INET6, &in6, ip, sizeof ip);
  const uint32_t zone = reinterpret_cast<const sockaddr_in6&>(a.ss).sin6_scope_id;
  if (zone == 0) return fmt::format("[{}]:{}", ip, a.port());
  char name[IF_NAMESIZE] = {};
  return fmt::format("[{}%{}]:{}", ip, ::if_indextoname(zone, name) ? name : std::to_string(zone).c_str(), a.port());
}

uint32_t link_local_zone(const std::vector<SockAddr>& addrs) {
  for (const SockAddr& a : addrs) {
    if (a.family() != AF_INET6) continue;
    const auto& sa = reinterpret_cast<const sockaddr_in6&>(a.ss);
    if (IN6_IS_ADDR_LINKLOCAL(&sa.sin6_addr) && sa.sin6_scope_id != 0) return sa.sin6_scope_id;
  }
  return 0;
}

std::string host_port_text(const std::string& host, uint16_t port) {
  const bool bare_ipv6 = host.find(':') != std::string::npos && host.front() != '[';
  return bare_ipv6 ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
}

namespace {
thread_local const StopRequested* t_cancel = nullptr;
constexpr int kCancelPollMs = 100;
}  // namespace

CancelScope::CancelScope(const StopRequested& stop) : outer_(t_cancel) {
  if (stop) t_cancel = &stop;
}

CancelScope::~CancelScope() { t_cancel = outer_; }

Status check_cancel(const std::string& what) {
  if (t_cancel == nullptr || !(*t_cancel)()) return Status();
  return Status(StatusCode::kCancelled, fmt::format("{}: interrupted (a stop signal) while waiting", what));
}

int poll_slice(int ms) { return t_cancel == nullptr ? ms : std::min(ms, kCancelPollMs); }

Clock::time_point deadline_after(double seconds) {
  // At most 1e9 s (31 years) ahead: the clock counts nanoseconds in 64 bits
  // (292 years), and a larger double would overflow the cast.
  const double s = std::min(seconds, 1e9);
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<long long>(left, 1 << 30));
}

Result<bool> wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    STRATA_RETURN_IF_ERROR(check_cancel("waiting for a peer"));
    pollfd p{fd, events, 0};
    const int left = ms_left(deadline);
    const int n = ::poll(&p, 1, poll_slice(left));
    if (n > 0) return true;
    if (n == 0) {
      // The deadline passed (not a slice, nor poll's longest wait: ms_left
      // says at most 2^30 ms, 12.4 days, of a longer timeout).
      if (ms_left(deadline) == 0) return false;
      continue;
    }
    if (errno != EINTR) return Status::from_errno(errno, "poll");
  }
}

Status send_all(int fd, const void* data, std::size_t n, Clock::time_point deadline, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    STRATA_ASSIGN_OR_RETURN(bool ready, wait_fd(fd, POLLOUT, deadline));
    if (!ready) return Status(StatusCode::kUnavailable, what + ": timed out sending");
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return Status::from_errno(errno, what + ": send failed");
    }
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return Status();
}

Status recv_all(int fd, void* data, std::size_t n, Clock::time_point deadline, const std::string& what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    STRATA_ASSIGN_OR_RETURN(bool ready, wait_fd(fd, POLLIN, deadline));
    if (!ready) return Status(StatusCode::kUnavailable, what + ": timed out receiving");
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k == 0) return Status(StatusCode::kIoError, what + ": connection closed by the peer");
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return Status::from_errno(errno, what + ": recv failed");
    }
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return Status();
}

Result<std::vector<SockAddr>> resolve(const std::string& addr, uint16_t port, const std::string& where,
                                      const char* label) {
  // torch's TCPStore cannot resolve "[::1]" either (it retries until its
  // timeout); torchrun's --master_addr takes brackets and exports without.
  if (addr.size() >= 2 && addr.front() == '[' && addr.back() == ']')
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: cannot resolve {} '{}': an IPv6 address is written without brackets ('{}'), "
                              "as torch.distributed reads it",
                              where, label, addr, addr.substr(1, addr.size() - 2)));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string p = std::to_string(port);
  if (int rc = ::getaddrinfo(addr.c_str(), p.c_str(), &hints, &res); rc != 0)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: cannot resolve {} '{}': {}", where, label, addr,
                              rc == EAI_SYSTEM ? std::strerror(errno) : gai_strerror(rc)));
  std::vector<SockAddr> out;
  int zoneless = 0;
  for (const addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    if ((ai->ai_family != AF_INET && ai->ai_family != AF_INET6) || ai->ai_addrlen > sizeof(sockaddr_storage)) continue;
    SockAddr a;
    std::memcpy(&a.ss, ai->ai_addr, ai->ai_addrlen);
    a.len = ai->ai_addrlen;
    if (a.family() == AF_INET6) {
      const auto& sa = reinterpret_cast<const sockaddr_in6&>(a.ss);
      if (IN6_IS_ADDR_LINKLOCAL(&sa.sin6_addr) && sa.sin6_scope_id == 0) {
        in6_addr literal;
        if (::inet_pton(AF_INET6, addr.c_str(), &literal) == 1) {
          ::freeaddrinfo(res);
          return Status(StatusCode::kInvalidArgument,
                        fmt::format("{}: {} '{}' is a link-local IPv6 address (fe80::/10), which is reached "
                                    "through one interface: name it after the address, as in '{}%eth0'",
                                    where, label, addr, addr));
        }
        ++zoneless;  // a name's link-local address without an interface: unreachable, its others are tried
        continue;
      }
    }
    const bool seen = std::any_of(out.begin(), out.end(), [&](const SockAddr& b) {
      return b.len == a.len && std::memcmp(&b.ss, &a.ss, a.len) == 0;
    });
    if (!seen) out.push_back(a);
  }
  ::freeaddrinfo(res);
  if (out.empty())
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: cannot resolve {} '{}': no IPv4 or IPv6 address{}", where, label, addr,
                              zoneless ? " but link-local ones, which need an interface (fe80::...%eth0)" : ""));
  return out;
}

namespace {

// A target that does not answer at all (a dropped SYN) holds the attempt at
// most this long when other targets follow.
constexpr auto kPerTargetCap = std::chrono::seconds(5);

// One connect to `target`; 0 or the errno.
int connect_one(const SockAddr& target, Clock::time_point deadline, Fd* out) {
  Fd s(::socket(target.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (s.fd < 0) return errno;
  const int rc = ::connect(s.fd, target.sa(), target.len);
  int err = rc == 0 ? 0 : errno;
  if (rc != 0 && err == EINPROGRESS) {
    auto ready = wait_fd(s.fd, POLLOUT, deadline);
    err = ETIMEDOUT;
    socklen_t len = sizeof err;
    if (ready.ok() && *ready) ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &err, &len);
  }
  // A connection to itself: nothing listens on the target port yet. Reset,
  // not closed: a closed one would hold the port a while longer (rank 0
  // could not serve there).
  if (err == 0 && self_connected(s.fd)) {
    const linger reset{1, 0};
    ::setsockopt(s.fd, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
    err = ECONNREFUSED;
  }
  if (err == 0) *out = std::move(s);
  return err;
}

}  // namespace

Result<Fd> connect_once(const std::vector<SockAddr>& targets, Clock::time_point deadline, const std::string& where,
                        bool* refused) {
  *refused = false;
  std::string failed;
  int err = 0;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    const auto until = i + 1 < targets.size() ? std::min(deadline, Clock::now() + kPerTargetCap) : deadline;
    Fd s;
    err = connect_one(targets[i], until, &s);
    if (err == 0) {
      int one = 1;
      ::setsockopt(s.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      *refused = false;  // (an earlier target refused)
      return s;
    }
    *refused = *refused || err == ECONNREFUSED;
    char buf[256];
    const char* why = strerror_r(err, buf, sizeof buf);
    failed += failed.empty() ? fmt::format("{} failed: {}", to_text(targets[i]), why)
                             : fmt::format("; to {}: {}", to_text(targets[i]), why);
  }
  STRATA_RETURN_IF_ERROR(check_cancel(where));  // (a wait above ended early for it)
  if (failed.empty()) return Status(StatusCode::kInvalidArgument, where + ": connect to no address");
  return Status(status_code_from_errno(err), fmt::format("{}: connect to {}", where, failed));
}

Result<Fd> connect_retrying(const std::vector<SockAddr>& targets, Clock::time_point deadline, const std::string& where,
                            const std::string& peer, double timeout_s) {
  for (;;) {
    STRATA_RETURN_IF_ERROR(check_cancel(fmt::format("{}: reaching {}", where, peer)));
    bool refused = false;
    auto fd = connect_once(targets, deadline, where, &refused);
    if (fd.ok()) return fd;
    if (fd.status().code() == StatusCode::kCancelled) return fd.status();
    if (ms_left(deadline) == 0)
      return Status(StatusCode::kUnavailable, fmt::format("{}: could not reach {} within {:g} s (last error: {})",
                                                          where, peer, timeout_s, fd.status().message()));
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(50, ms_left(deadline))));
  }
}

Result<Fd> listen_on(uint16_t port, int backlog, const std::string& where, int* bind_errno) {
  if (bind_errno != nullptr) *bind_errno = 0;
  // Dual-stack where the kernel has IPv6 (rank 0 listens on the wildcard:
  // MASTER_ADDR may name it by either family); IPv4 where it has none.
  Fd l(::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  int err = l.fd < 0 ? errno : 0, zero = 0, one = 1;
  if (l.fd >= 0 && ::setsockopt(l.fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero) != 0) {
    err = errno;
    l = Fd();
  }
  if (l.fd < 0 && err != EAFNOSUPPORT && err != EPROTONOSUPPORT && err != ENOPROTOOPT && err != EINVAL)
    return Status::from_errno(err, where + ": socket failed");
  SockAddr a;
  if (l.fd >= 0) {
    auto& sa6 = reinterpret_cast<sockaddr_in6&>(a.ss);
    sa6.sin6_family = AF_INET6;
    sa6.sin6_addr = in6addr_any;
    a.len = sizeof sa6;
  } else {
    l = Fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (l.fd < 0) return Status::from_errno(errno, where + ": socket failed");
    auto& sa4 = reinterpret_cast<sockaddr_in&>(a.ss);
    sa4.sin_family = AF_INET;
    sa4.sin_addr.s_addr = htonl(INADDR_ANY);
    a.len = sizeof sa4;
  }
  a.set_port(port);
  ::setsockopt(l.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(l.fd, a.sa(), a.len) != 0) {
    if (bind_errno != nullptr) *bind_errno = errno;
    return Status::from_errno(errno, fmt::format("{}: bind to port {} failed", where, port));
  }
  if (::listen(l.fd, std::max(backlog, 16)) != 0) return Status::from_errno(errno, where + ": listen failed");
  return l;
}

Result<Fd> listen_on_other_port(uint16_t avoid, int backlog, const std::string& where) {
  STRATA_ASSIGN_OR_RETURN(Fd l, listen_on(0, backlog, where));
  if (avoid == 0 || local_port(l.fd) != avoid) return l;
  // Held while the next is made, so that the kernel picks another port.
  const Fd held = std::move(l);
  return listen_on(0, backlog, where);
}

bool self_connected(int fd) {
  SockAddr me, peer;
  me.len = peer.len = sizeof me.ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&me.ss), &me.len) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer.ss), &peer.len) != 0)
    return false;
  if (me.family() != peer.family() || me.port() != peer.port()) return false;
  if (me.family() == AF_INET)
    return reinterpret_cast<const sockaddr_in&>(me.ss).sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in&>(peer.ss).sin_addr.s_addr;
  if (me.family() != AF_INET6) return false;
  const auto &a = reinterpret_cast<const sockaddr_in6&>(me.ss), &b = reinterpret_cast<const sockaddr_in6&>(peer.ss);
  return std::memcmp(&a.sin6_addr, &b.sin6_addr, sizeof a.sin6_addr) == 0 && a.sin6_scope_id == b.sin6_scope_id;
}

uint16_t local_port(int fd) {
  SockAddr a;
  a.len = sizeof a.ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a.ss), &a.len) != 0) return 0;
  return a.port();
}

}  // namespace strata::comm::net
