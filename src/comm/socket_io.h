// Blocking-with-deadline helpers on TCP sockets, shared by the rendezvous
// (rendezvous.cpp) and the TCP communicator (tcp_comm.cpp). IPv4 and IPv6:
// a name resolves to all its addresses, tried in order, and a listener takes
// both families; every socket is close-on-exec and nonblocking, calls wait
// with poll() until their deadline.
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

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

// An IPv4 or IPv6 socket address.
struct SockAddr {
  sockaddr_storage ss{};
  socklen_t len = 0;
  const sockaddr* sa() const { return reinterpret_cast<const sockaddr*>(&ss); }
  int family() const { return ss.ss_family; }
  uint16_t port() const;
  void set_port(uint16_t port);
};

// "10.0.0.2:29500", "[fd00::2]:29500"; an IPv4-mapped IPv6 address (a
// dual-stack listener's IPv4 peer) prints as IPv4.
std::string to_text(const SockAddr& a);
// The interface (scope id) of the first link-local IPv6 address in `addrs`
// ("fe80::2%eth0" as resolved); 0 when none has one. The link's other hosts
// are reached through the same interface.
uint32_t link_local_zone(const std::vector<SockAddr>& addrs);
// host:port as written in a URL: an IPv6 literal in brackets.
std::string host_port_text(const std::string& host, uint16_t port);

// A stop request to watch: true once the caller wants the wait to end (a
// signal handler's flag: the CLI's std::atomic<bool>, a C caller's int). It
// is called from the waiting thread, so it only reads a flag.
using StopRequested = std::function<bool()>;

// While a CancelScope lives on a thread, every wait of this file on that
// thread (wait_fd and what uses it, connect_retrying's retries) and the
// rendezvous' serving loop call `stop` at least every 100 ms and fail with
// kCancelled "interrupted (a stop signal) while <what>" once it returns true:
// a signal handler's stop flag ends a rank that waits for the others (up to
// the timeout: minutes) at once. Empty: nothing to watch. Scopes nest (the
// inner one's request is watched until it ends). `stop` must outlive the
// scope.
class CancelScope {
 public:
  explicit CancelScope(const StopRequested& stop);
  CancelScope(StopRequested&&) = delete;  // kept by address: must outlive the scope
  ~CancelScope();
  CancelScope(const CancelScope&) = delete;
  CancelScope& operator=(const CancelScope&) = delete;

 private:
  const StopRequested* outer_;
};
// kCancelled naming `what` when this thread's scope flag is set; OK otherwise.
Status check_cancel(const std::string& what);
// The longest one poll() may block on this thread: `ms`, or at most 100
// under a CancelScope.
int poll_slice(int ms);

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

// A host name, IPv4 or IPv6 text ("10.0.0.2", "::1"; as torch.distributed
// reads MASTER_ADDR, an IPv6 address without brackets; a link-local one with
// its interface, "fe80::2%eth0") -> its addresses, IPv4 and IPv6, in
// getaddrinfo's order, none twice; never empty. kInvalidArgument "<where>:
// cannot resolve <label> '<addr>': ..." (a name with no address; an address
// in brackets, or a link-local one without an interface, named as such; a
// name's link-local addresses without an interface are left out).
Result<std::vector<SockAddr>> resolve(const std::string& addr, uint16_t port, const std::string& where,
                                      const char* label = "MASTER_ADDR");

// One connect attempt to each target in order (as torch's TCPStore client
// does), the first that connects returned, all finished by `deadline` (a
// target that does not answer is left after 5 s when others follow);
// TCP_NODELAY set. *refused: none connected and one at least refused
// (ECONNREFUSED: reachable, but nothing listens there yet; or a connection
// to itself, see self_connected()), worth retrying.
// The error names each target and why ("<where>: connect to [::1]:29500
// failed: Connection refused; to 127.0.0.1:29500: Connection refused").
Result<Fd> connect_once(const std::vector<SockAddr>& targets, Clock::time_point deadline, const std::string& where,
                        bool* refused);

// Connects, retrying every 50 ms until `deadline` (the peer may not listen
// yet); then kUnavailable "<where>: could not reach <peer> within <timeout_s>
// s (last error: ...)".
Result<Fd> connect_retrying(const std::vector<SockAddr>& targets, Clock::time_point deadline, const std::string& where,
                            const std::string& peer, double timeout_s);

// A listening socket on every interface at `port` (0: the kernel picks;
// SO_REUSEADDR), for IPv4 and IPv6 peers alike: a dual-stack IPv6 socket
// (IPV6_V6ONLY off; IPv4 peers show as IPv4-mapped addresses), or an IPv4
// one where the kernel has no IPv6.
// *bind_errno (when given): the bind's errno where it failed (EADDRINUSE:
// the port is taken), else 0.
Result<Fd> listen_on(uint16_t port, int backlog, const std::string& where, int* bind_errno = nullptr);
// listen_on(0, ...), but never on port `avoid` (MASTER_PORT): the kernel
// takes the ports of listeners made by bind(0) from the ephemeral range,
// which is where a launcher's free MASTER_PORT comes from too (torchrun
// --standalone, launch_ranks). A rank's listener there, made before rank 0
// serves the rendezvous, would take rank 0's connection to MASTER_PORT and
// answer nothing: every rank would wait out its timeout.
Result<Fd> listen_on_other_port(uint16_t avoid, int backlog, const std::string& where);
// The port a socket is bound to.
uint16_t local_port(int fd);
// True when fd is connected to itself (a TCP "simultaneous open": a connect
// to a port of this host nothing listens on, from a source port the kernel
// picked equal to it). connect_once() counts one as refused.
bool self_connected(int fd);

}  // namespace strata::comm::net
