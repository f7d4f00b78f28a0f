// Blocking-with-deadline helpers on TCP sockets, shared by the rendezvous
// (rendezvous.cpp) and the TCP communicator (tcp_comm.cpp). IPv4 only; every
// socket is close-on-exec and nonblocking, calls wait with poll() until their
// deadline.
#pragma once

#include <netinet/in.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "common/status.h"

namespace strata::comm::net {

using Clock = std::chrono::steady_clock;

// Owns a file descriptor (closed on destruction; -1: none).
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Fd& operator=(Fd&& o) noexcept {
    std::swap(fd, o.fd);
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

Clock::time_point deadline_after(double seconds);
// Milliseconds until `deadline` for poll(): 0 once passed.
int ms_left(Clock::time_point deadline);

// Waits for `events` on fd; false on timeout.
Result<bool> wait_fd(int fd, short events, Clock::time_point deadline);

// All n bytes, or kUnavailable (deadline: "<what>: timed out sending"),
// kIoError (the peer closed: "<what>: connection closed by the peer"), or
// the errno of send/recv, each prefixed by `what`.
Status send_all(int fd, const void* data, std::size_t n, Clock::time_point deadline, const std::string& what);
Status recv_all(int fd, void* data, std::size_t n, Clock::time_point deadline, const std::string& what);

// Host name or IPv4 text -> address. kInvalidArgument "<where>: cannot
// resolve <label> '<addr>': ...".
Result<sockaddr_in> resolve(const std::string& addr, uint16_t port, const std::string& where,
                            const char* label = "MASTER_ADDR");

// One connect attempt, finished by `deadline`; TCP_NODELAY set. *refused:
// nothing listens there (ECONNREFUSED), worth retrying.
Result<Fd> connect_once(const sockaddr_in& target, Clock::time_point deadline, const std::string& where, bool* refused);

// Connects, retrying every 50 ms until `deadline` (the peer may not listen
// yet); then kUnavailable "<where>: could not reach <peer> within <timeout_s>
// s (last error: ...)".
Result<Fd> connect_retrying(const sockaddr_in& target, Clock::time_point deadline, const std::string& where,
                            const std::string& peer, double timeout_s);

// A listening socket on every interface at `port` (0: the kernel picks;
// SO_REUSEADDR).
Result<Fd> listen_on(uint16_t port, int backlog, const std::string& where);
// The port a socket is bound to.
uint16_t local_port(int fd);

}  // namespace strata::comm::net
