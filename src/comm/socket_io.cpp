#include "comm/socket_io.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

namespace strata::comm::net {

Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<long long>(left, 1 << 30));
}

Result<bool> wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, ms_left(deadline));
    if (n > 0) return true;
    if (n == 0) return false;
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

Result<sockaddr_in> resolve(const std::string& addr, uint16_t port, const std::string& where, const char* label) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string p = std::to_string(port);
  if (int rc = ::getaddrinfo(addr.c_str(), p.c_str(), &hints, &res); rc != 0)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: cannot resolve {} '{}' to an IPv4 address (IPv4 only): {}", where, label,
                              addr, gai_strerror(rc)));
  sockaddr_in target{};
  std::memcpy(&target, res->ai_addr, sizeof target);
  ::freeaddrinfo(res);
  return target;
}

Result<Fd> connect_once(const sockaddr_in& target, Clock::time_point deadline, const std::string& where,
                        bool* refused) {
  *refused = false;
  Fd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (s.fd < 0) return Status::from_errno(errno, where + ": socket failed");
  int rc = ::connect(s.fd, reinterpret_cast<const sockaddr*>(&target), sizeof target);
  int err = rc == 0 ? 0 : errno;
  if (rc != 0 && err == EINPROGRESS) {
    STRATA_ASSIGN_OR_RETURN(bool ready, wait_fd(s.fd, POLLOUT, deadline));
    err = ETIMEDOUT;
    socklen_t len = sizeof err;
    if (ready) ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &err, &len);
  }
  if (err != 0) {
    *refused = err == ECONNREFUSED;
    return Status::from_errno(err, where + ": connect failed");
  }
  int one = 1;
  ::setsockopt(s.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return s;
}

Result<Fd> connect_retrying(const sockaddr_in& target, Clock::time_point deadline, const std::string& where,
                            const std::string& peer, double timeout_s) {
  for (;;) {
    bool refused = false;
    auto fd = connect_once(target, deadline, where, &refused);
    if (fd.ok()) return fd;
    if (ms_left(deadline) == 0)
      return Status(StatusCode::kUnavailable, fmt::format("{}: could not reach {} within {:g} s (last error: {})",
                                                          where, peer, timeout_s, fd.status().message()));
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(50, ms_left(deadline))));
  }
}

Result<Fd> listen_on(uint16_t port, int backlog, const std::string& where) {
  Fd l(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (l.fd < 0) return Status::from_errno(errno, where + ": socket failed");
  int one = 1;
  ::setsockopt(l.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  sa.sin_port = htons(port);
  if (::bind(l.fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0)
    return Status::from_errno(errno, fmt::format("{}: bind to port {} failed", where, port));
  if (::listen(l.fd, std::max(backlog, 16)) != 0) return Status::from_errno(errno, where + ": listen failed");
  return l;
}

uint16_t local_port(int fd) {
  sockaddr_in sa{};
  socklen_t len = sizeof sa;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) return 0;
  return ntohs(sa.sin_port);
}

}  // namespace strata::comm::net
