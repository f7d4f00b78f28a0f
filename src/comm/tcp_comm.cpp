#include "comm/tcp_comm.h"

#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "comm/p2p_communicator.h"
#include "comm/rendezvous.h"
#include "comm/socket_io.h"
#include "common/threads.h"

namespace strata::comm {
namespace {

using net::Clock;
using net::Fd;

// ---- connecting (tcp_comm.h "Connecting"). Integers in host order: every
// supported target is little-endian.

constexpr char kMagic[8] = {'S', 'T', 'R', 'A', 'T', 'A', 'T', 'C'};
constexpr uint32_t kWireVersion = 3;  // 2: IPv6 addresses in the table; 3: the abort frame

struct Blob {  // rank 0 -> every rank, through the rendezvous
  char magic[8];
  uint32_t version;
  uint32_t port;
  uint64_t token;
};
struct Hello {  // rank r -> the rank it connects to
  char magic[8];
  uint32_t version;
  int32_t rank;
  int32_t world;
  uint32_t port;  // rank r's listening port
  uint64_t token;
};
struct Entry {       // rank 0 -> rank r: every rank's address, as rank 0 saw it
  uint8_t addr[16];  // IPv6, an IPv4 address IPv4-mapped; all zero: rank 0's host (it came over loopback)
  uint32_t port;
};
static_assert(sizeof(Blob) == 24 && sizeof(Hello) == 32 && sizeof(Entry) == 20);

struct Link {
  Fd fd;
  net::SockAddr peer;  // where its connection came from
  uint32_t port = 0;   // its listening port
};

// The table's entry for a rank whose connection came from `peer`.
Entry entry_of(const net::SockAddr& peer, uint32_t port) {
  Entry e{};
  e.port = port;
  if (peer.family() == AF_INET6) {
    std::memcpy(e.addr, &reinterpret_cast<const sockaddr_in6&>(peer.ss).sin6_addr, 16);
  } else if (peer.family() == AF_INET) {
    e.addr[10] = e.addr[11] = 0xff;
    std::memcpy(e.addr + 12, &reinterpret_cast<const sockaddr_in&>(peer.ss).sin_addr, 4);
  }
  in6_addr a;
  std::memcpy(&a, e.addr, 16);
  // Loopback (127/8, also IPv4-mapped, or ::1): the rank is on rank 0's host.
  if (IN6_IS_ADDR_LOOPBACK(&a) || (IN6_IS_ADDR_V4MAPPED(&a) && e.addr[12] == 127)) std::memset(e.addr, 0, 16);
  return e;
}

// Where to reach the rank of entry `e`: its address, or where rank 0 is
// reached (`zero`: MASTER_ADDR's addresses) at its port. A link-local
// address (ranks that met over MASTER_ADDR "fe80::...%eth0" are all on that
// link) is reached through the interface rank 0 is.
std::vector<net::SockAddr> targets_of(const Entry& e, std::vector<net::SockAddr> zero) {
  in6_addr a;
  std::memcpy(&a, e.addr, 16);
  if (IN6_IS_ADDR_UNSPECIFIED(&a)) {
    for (auto& z : zero) z.set_port(static_cast<uint16_t>(e.port));
    return zero;
  }
  net::SockAddr t;
  if (IN6_IS_ADDR_V4MAPPED(&a)) {  // as IPv4: the peer's listener may be IPv4 only
    auto& sa = reinterpret_cast<sockaddr_in&>(t.ss);
    sa.sin_family = AF_INET;
    std::memcpy(&sa.sin_addr, e.addr + 12, 4);
    t.len = sizeof sa;
  } else {
    auto& sa = reinterpret_cast<sockaddr_in6&>(t.ss);
    sa.sin6_family = AF_INET6;
    sa.sin6_addr = a;
    if (IN6_IS_ADDR_LINKLOCAL(&a)) sa.sin6_scope_id = net::link_local_zone(zero);
    t.len = sizeof sa;
  }
  t.set_port(static_cast<uint16_t>(e.port));
  return {t};
}

std::string targets_text(const std::vector<net::SockAddr>& targets) {
  std::string s;
  for (const auto& t : targets) s += (s.empty() ? "" : " or ") + net::to_text(t);
  return s;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

// Accepts until every rank in [lo, hi) has connected and said a valid hello
// (same token and world); anything else connecting is closed and ignored.
Result<std::vector<Link>> accept_ranks(int listener, int lo, int hi, int world, uint64_t token,
                                       Clock::time_point deadline, const std::string& where) {
  std::vector<Link> links(static_cast<std::size_t>(world));
  int missing = hi - lo;
  while (missing > 0) {
    STRATA_ASSIGN_OR_RETURN(bool ready, net::wait_fd(listener, POLLIN, deadline));
    if (!ready) {
      std::vector<int> never;
      for (int r = lo; r < hi; ++r)
        if (links[r].fd.fd < 0) never.push_back(r);
      return Status(StatusCode::kUnavailable, fmt::format("{}: rank{} {} never connected before the timeout", where,
                                                          never.size() > 1 ? "s" : "", rank_list(never)));
    }
    net::SockAddr peer;
    peer.len = sizeof peer.ss;
    Fd c(::accept4(listener, reinterpret_cast<sockaddr*>(&peer.ss), &peer.len, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (c.fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) continue;
      return Status::from_errno(errno, where + ": accept failed");
    }
    Hello h{};
    // A stranger that says nothing holds this loop for at most 5 s.
    const auto until = std::min(deadline, Clock::now() + std::chrono::seconds(5));
    if (!net::recv_all(c.fd, &h, sizeof h, until, where).ok()) continue;
    if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0 || h.version != kWireVersion || h.token != token ||
        h.world != world || h.rank < lo || h.rank >= hi || links[h.rank].fd.fd >= 0)
      continue;  // not a rank of this communicator (or a duplicate): ignored
    int one = 1;
    ::setsockopt(c.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    links[h.rank] = Link{std::move(c), peer, h.port};
    --missing;
  }
  return links;
}

// Connects to rank `peer` at one of `targets` (retrying until the deadline)
// and says hello.
Result<Fd> connect_to(const std::vector<net::SockAddr>& targets, int peer, const Hello& hello,
                      Clock::time_point deadline, double timeout_s, const std::string& where) {
  STRATA_ASSIGN_OR_RETURN(Fd fd,
                          net::connect_retrying(targets, deadline, where, fmt::format("rank {}", peer), timeout_s));
  STRATA_RETURN_IF_ERROR(net::send_all(fd.fd, &hello, sizeof hello, deadline, where));
  return fd;
}

// ---- moving data (tcp_comm.h "Moving data")

constexpr uint32_t kFrameMagic = 0x53545246;  // "STRF"
// A rank whose communicator broke sends each peer this frame, its body the
// reason (at most kMaxAbortText bytes), before it closes the connections:
// the peer then names the cause, not only "rank r closed its connection".
constexpr uint32_t kAbortMagic = 0x53545241;  // "STRA"
constexpr std::size_t kMaxAbortText = 2048;
struct Frame {
  uint64_t seq;
  uint32_t phase;
  uint32_t magic;
  uint64_t bytes;
};
static_assert(sizeof(Frame) == 24);
// Bytes moved per peer and direction before the progress thread turns to
// the next ready socket (fairness between peers and directions).
constexpr std::size_t kSlice = 4u << 20;
// Larger than any buffer a collective takes: a header saying more is corrupt.
constexpr uint64_t kMaxMessage = uint64_t{1} << 44;

struct TcpOp;

struct Transfer {
  TcpOp* op = nullptr;
  int peer = 0;
  bool recv = false;
  uint32_t phase = 0;
  char* buf = nullptr;
  std::size_t bytes = 0;
  bool complete = false;
};

struct TcpOp final : P2pOp {
  std::deque<Transfer> transfers;  // stable addresses
  std::size_t pending = 0;
  Status error;
};

using Key = std::pair<uint64_t, uint32_t>;  // (sequence, phase)

struct Peer {
  Fd fd;
  bool open = true;
  // Sending: frames in the order posted; the front one is on the wire.
  std::deque<Transfer*> sendq;
  Frame out{};
  std::size_t out_done = 0;  // bytes of the front frame (header, then body) written
  // Receiving: the frame coming in.
  Frame in{};
  std::size_t in_head = 0;                // header bytes read
  std::size_t in_done = 0;                // body bytes read
  Transfer* in_target = nullptr;          // a posted receive, or
  std::vector<char>* in_early = nullptr;  // a message that came before its receive
  std::string in_abort;                   // an abort frame's reason, coming in
  bool aborting = false;                  // the frame coming in is an abort frame
  std::map<Key, Transfer*> posted;        // receives posted, their message not yet begun
  struct Early {
    std::vector<char> bytes;
    bool complete = false;
  };
  std::map<Key, Early> early;  // messages that came before their receive
};

class TcpCommunicator final : public P2pCommunicator {
 public:
  TcpCommunicator(DeviceBackend* device, int rank, int world, double timeout_s, std::vector<Link> links,
                  std::shared_ptr<void> held_store)
      : P2pCommunicator(device, rank, world, timeout_s),
        held_store_(std::move(held_store)),
        peers_(static_cast<std::size_t>(world)) {
    for (int p = 0; p < world; ++p) peers_[p].fd = std::move(links[p].fd);
  }

  // Not in the constructor: a failure here must not leave a thread behind.
  Status start() {
    if (world_size() == 1) return Status();
    wake_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (wake_.fd < 0) return Status::from_errno(errno, "tcp communicator: eventfd failed");
    STRATA_RETURN_IF_ERROR(
        start_thread(progress_, "tcp communicator: cannot start its progress thread", [this] { progress_loop(); }));
    started_ = true;
    return Status();
  }

  ~TcpCommunicator() override { stop_progress(); }

  const char* backend_name() const override { return "tcp"; }

 private:
  std::unique_ptr<P2pOp> make_op(const char* name, uint64_t seq) override { return new_op<TcpOp>(name, seq); }

  Status post(P2pOp& base, bool recv, void* buf, std::size_t bytes, int peer, int phase) override {
    auto& op = static_cast<TcpOp&>(base);
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return stopped_text(op);
    if (!gave_up_.ok()) return Status(gave_up_.code(), op.where() + ": " + gave_up_.message());
    Peer& p = peers_[peer];
    const Key key{op.seq, static_cast<uint32_t>(phase)};
    // A peer that finished its part and exited has closed: what it sent
    // before may still be waiting here, complete.
    auto early = recv ? p.early.find(key) : p.early.end();
    const bool arrived = early != p.early.end() && early->second.complete;
    if (!p.open && !arrived) return Status(StatusCode::kIoError, closed_text(op, peer));
    Transfer& t = op.transfers.emplace_back();
    t.op = &op;
    t.peer = peer;
    t.recv = recv;
    t.phase = static_cast<uint32_t>(phase);
    t.buf = static_cast<char*>(buf);
    t.bytes = bytes;
    ++op.pending;
    if (!recv) {
      // Written here at once when nothing is queued ahead (a small message
      // then costs no wake-up of the progress thread); what the socket does
      // not take, the progress thread writes.
      p.sendq.push_back(&t);
      if (p.sendq.size() == 1) send_some(peer);
      if (!p.sendq.empty()) wake();
      return Status();
    }
    if (arrived) {
      const std::vector<char>& got = early->second.bytes;
      if (got.size() != bytes) {
        fail_transfer(t, size_text(op, peer, got.size(), bytes));
        return Status();
      }
      if (bytes > 0) std::memcpy(t.buf, got.data(), bytes);
      p.early.erase(early);
      finish(t);
      return Status();
    }
    p.posted[key] = &t;  // an early message still arriving is handed over when complete
    return Status();
  }

  Status wait(P2pOp& base) override {
    auto& op = static_cast<TcpOp&>(base);
    const auto deadline =
        op.start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s()));
    std::unique_lock<std::mutex> lock(mu_);
    // Yielding for the first millisecond (as the MPI backend polls): a
    // collective of small messages is then seen done without a wake-up.
    const auto spin_until = Clock::now() + std::chrono::milliseconds(1);
    while (op.pending > 0 && op.error.ok() && !stopped_ && Clock::now() < spin_until) {
      lock.unlock();
      sched_yield();
      lock.lock();
    }
    for (;;) {
      if (!op.error.ok()) return op.error;
      if (op.pending == 0) {
        op.transfers.clear();
        return Status();
      }
      if (stopped_) return stopped_text(op);
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && Clock::now() >= deadline) break;
    }
    if (!op.error.ok()) return op.error;
    if (op.pending == 0) {  // done right at the deadline
      op.transfers.clear();
      return Status();
    }
    // Timed out: name the first peer still waited on (a receive before a
    // send: a missing receive is the peer that did not send).
    const Transfer* first = nullptr;
    for (const Transfer& t : op.transfers)
      if (!t.complete && (first == nullptr || (t.recv && !first->recv))) first = &t;
    return Status(
        StatusCode::kUnavailable,
        fmt::format("{}: timed out after {:g} s waiting for rank {} ({} of {} bytes)", op.where(), timeout_s(),
                    first ? first->peer : -1, first && first->recv ? "receive" : "send", first ? first->bytes : 0));
  }

  // The progress thread stops and closes every socket: nothing touches the
  // op's buffers after this, and the peers learn of the failure at once.
  void abandon(P2pOp& /*op*/) override { stop_progress(); }

  // Before the sockets close: each peer whose stream is between two frames
  // gets an abort frame with the reason (best effort: what the socket does
  // not take at once is not sent; that peer sees the connection close).
  void on_broken(const Status& why) override {
    std::string text = why.message();
    if (text.size() > kMaxAbortText) text.resize(kMaxAbortText);
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    for (int q = 0; q < world_size(); ++q) {
      Peer& p = peers_[q];
      if (q == rank() || !p.open || p.out_done != 0) continue;
      const Frame f{~uint64_t{0}, static_cast<uint32_t>(why.code()), kAbortMagic, text.size()};
      iovec iov[2] = {{const_cast<Frame*>(&f), sizeof f}, {text.data(), text.size()}};
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = 2;
      (void)::sendmsg(p.fd.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      // Nothing may follow it (a frame after a partly written abort would
      // be read as its text): no more sends on this connection.
      ::shutdown(p.fd.fd, SHUT_WR);
    }
  }

  // Another collective broke the communicator (its error is the first one,
  // kept by the base class).
  Status stopped_text(const TcpOp& op) {
    Status broken = broken_status();
    return broken.ok() ? Status(StatusCode::kUnavailable, op.where() + ": the communicator stopped") : broken;
  }

  static std::string closed_text(const TcpOp& op, int peer) {
    return fmt::format(
        "{}: rank {} closed its connection (its process exited or was killed, or its communicator "
        "broke)",
        op.where(), peer);
  }
  static std::string size_text(const TcpOp& op, int peer, std::size_t got, std::size_t want) {
    return fmt::format(
        "{}: rank {} sent {} bytes where {} were expected (the ranks enqueued different "
        "collectives)",
        op.where(), peer, got, want);
  }

  // ---- the progress thread's side; every function below runs under mu_.

  void wake() {
    const uint64_t one = 1;
    if (wake_.fd >= 0) (void)!::write(wake_.fd, &one, sizeof one);
  }

  void finish(Transfer& t) {
    t.complete = true;
    if (--t.op->pending == 0) cv_.notify_all();
  }

  void fail_transfer(Transfer& t, std::string text, StatusCode code = StatusCode::kIoError) {
    if (t.op->error.ok()) t.op->error = Status(code, std::move(text));
    cv_.notify_all();
  }

  // A peer's abort frame came: it gave up (`why`, its status `code`). The
  // job cannot go on, so every collective still running fails now, naming
  // that rank and its reason, instead of at its own timeout; so does every
  // later one (post()).
  void peer_gave_up(int peer, const std::string& why, StatusCode code) {
    if (gave_up_.ok()) gave_up_ = Status(code, fmt::format("rank {} gave up: {}", peer, why));
    close_peer(peer, why, /*gave_up=*/true, code);
    for (Peer& p : peers_) {
      auto fail = [&](Transfer* t) { fail_transfer(*t, t->op->where() + ": " + gave_up_.message(), code); };
      for (Transfer* t : p.sendq) fail(t);
      for (auto& [key, t] : p.posted) fail(t);
      if (p.in_target) fail(p.in_target);
    }
  }

  // A peer whose connection closed or failed (or that gave up: `gave_up`,
  // `why` its reason): every transfer still waiting on it fails.
  void close_peer(int peer, const std::string& why, bool gave_up = false, StatusCode code = StatusCode::kIoError) {
    Peer& p = peers_[peer];
    if (!p.open) return;
    p.open = false;
    auto fail = [&](Transfer* t) {
      fail_transfer(*t,
                    gave_up       ? fmt::format("{}: rank {} gave up: {}", t->op->where(), peer, why)
                    : why.empty() ? closed_text(*t->op, peer)
                                  : fmt::format("{}: the connection to rank {} failed: {}", t->op->where(), peer, why),
                    code);
    };
    for (Transfer* t : p.sendq) fail(t);
    for (auto& [key, t] : p.posted) fail(t);
    if (p.in_target) fail(p.in_target);
    p.sendq.clear();
    p.posted.clear();
    p.in_target = nullptr;
    p.fd = Fd();
  }

  // Writes the front frames until the socket is full or a slice is sent.
  void send_some(int peer) {
    Peer& p = peers_[peer];
    std::size_t sent = 0;
    while (p.open && !p.sendq.empty() && sent < kSlice) {
      Transfer& t = *p.sendq.front();
      if (p.out_done == 0) p.out = Frame{t.op->seq, t.phase, kFrameMagic, t.bytes};
      iovec iov[2];
      int n = 0;
      if (p.out_done < sizeof(Frame))
        iov[n++] = {reinterpret_cast<char*>(&p.out) + p.out_done, sizeof(Frame) - p.out_done};
      const std::size_t body_done = p.out_done > sizeof(Frame) ? p.out_done - sizeof(Frame) : 0;
      if (t.bytes > body_done) iov[n++] = {t.buf + body_done, std::min(t.bytes - body_done, kSlice)};
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = static_cast<std::size_t>(n);
      const ssize_t k = ::sendmsg(p.fd.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
        close_peer(peer, errno == EPIPE || errno == ECONNRESET ? "" : std::strerror(errno));
        return;
      }
      p.out_done += static_cast<std::size_t>(k);
      sent += static_cast<std::size_t>(k);
      if (p.out_done == sizeof(Frame) + t.bytes) {
        p.sendq.pop_front();
        p.out_done = 0;
        finish(t);
      }
    }
  }

  // Reads frames until the socket is empty or a slice is read.
  void recv_some(int peer) {
    Peer& p = peers_[peer];
    std::size_t got = 0;
    while (p.open && got < kSlice) {
      if (p.in_head < sizeof(Frame)) {
        const ssize_t k =
            ::recv(p.fd.fd, reinterpret_cast<char*>(&p.in) + p.in_head, sizeof(Frame) - p.in_head, MSG_DONTWAIT);
        if (!read_ok(peer, k)) return;
        p.in_head += static_cast<std::size_t>(k);
        if (p.in_head < sizeof(Frame)) continue;
        if (p.in.magic == kAbortMagic && p.in.bytes <= kMaxAbortText) {
          p.aborting = true;
          p.in_abort.assign(p.in.bytes, '\0');
          p.in_done = 0;
        } else if (p.in.magic != kFrameMagic) {
          close_peer(peer, "a malformed message (not a Strata TCP communicator's)");
          return;
        } else {
          begin_body(peer);
          if (!p.open) return;
        }
      }
      const std::size_t left = p.in.bytes - p.in_done;
      if (left > 0) {
        char* dst = p.aborting ? p.in_abort.data() : p.in_target ? p.in_target->buf : p.in_early->data();
        const ssize_t k = ::recv(p.fd.fd, dst + p.in_done, std::min(left, kSlice), MSG_DONTWAIT);
        if (!read_ok(peer, k)) return;
        p.in_done += static_cast<std::size_t>(k);
        got += static_cast<std::size_t>(k);
      }
      if (p.in_done == p.in.bytes && p.aborting) {
        const uint32_t c = p.in.phase;  // its status code
        peer_gave_up(peer, p.in_abort,
                     c >= 1 && c <= static_cast<uint32_t>(StatusCode::kInternal) ? static_cast<StatusCode>(c)
                                                                                 : StatusCode::kIoError);
        return;
      }
      if (p.in_done == p.in.bytes) end_body(peer);
    }
  }

  // True when k > 0 bytes came; otherwise handles EAGAIN (false), EOF and
  // errors (the peer closes).
  bool read_ok(int peer, ssize_t k) {
    if (k > 0) return true;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
    close_peer(peer, k == 0 || errno == ECONNRESET ? "" : std::strerror(errno));
    return false;
  }

  // A header is in: where its body goes.
  void begin_body(int peer) {
    Peer& p = peers_[peer];
    const Key key{p.in.seq, p.in.phase};
    p.in_done = 0;
    auto posted = p.posted.find(key);
    if (posted != p.posted.end()) {
      Transfer* t = posted->second;
      p.posted.erase(posted);
      if (t->bytes != p.in.bytes) {
        fail_transfer(*t, size_text(*t->op, peer, p.in.bytes, t->bytes));
        close_peer(peer, "it sent a message of another size than the receive posted for it");
        return;
      }
      p.in_target = t;
    } else {
      Peer::Early& e = p.early[key];
      e.complete = false;
      try {
        if (p.in.bytes > kMaxMessage) throw std::bad_alloc();
        e.bytes.resize(p.in.bytes);
      } catch (const std::bad_alloc&) {
        p.early.erase(key);
        close_peer(peer, fmt::format("no memory for a message of {} bytes that came before its receive", p.in.bytes));
        return;
      }
      p.in_early = &e.bytes;
    }
  }

  void end_body(int peer) {
    Peer& p = peers_[peer];
    const Key key{p.in.seq, p.in.phase};
    if (p.in_target) {
      finish(*p.in_target);
    } else {
      // Its receive may have been posted while the message came in.
      auto posted = p.posted.find(key);
      if (posted == p.posted.end()) {
        p.early[key].complete = true;
      } else {
        Transfer* t = posted->second;
        p.posted.erase(posted);
        if (t->bytes != p.in_early->size()) {
          fail_transfer(*t, size_text(*t->op, peer, p.in_early->size(), t->bytes));
        } else {
          if (t->bytes > 0) std::memcpy(t->buf, p.in_early->data(), t->bytes);
          finish(*t);
        }
        p.early.erase(key);
      }
    }
    p.in_target = nullptr;
    p.in_early = nullptr;
    p.in_head = 0;
    p.in_done = 0;
  }

  void progress_loop() {
    std::unique_lock<std::mutex> lock(mu_);
    std::vector<pollfd> fds;
    std::vector<int> who;
    while (!stop_) {
      fds.assign(1, pollfd{wake_.fd, POLLIN, 0});
      who.assign(1, -1);
      for (int p = 0; p < world_size(); ++p) {
        if (p == rank() || !peers_[p].open) continue;
        fds.push_back({peers_[p].fd.fd, static_cast<short>(POLLIN | (peers_[p].sendq.empty() ? 0 : POLLOUT)), 0});
        who.push_back(p);
      }
      lock.unlock();
      const int n = ::poll(fds.data(), fds.size(), 1000);
      lock.lock();
      if (n <= 0) continue;  // EINTR, or idle
      if (fds[0].revents & POLLIN) {
        uint64_t v;
        while (::read(wake_.fd, &v, sizeof v) > 0) {
        }
      }
      for (std::size_t i = 1; i < fds.size(); ++i) {
        const int p = who[i];
        if (fds[i].revents & POLLOUT) send_some(p);
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) recv_some(p);
      }
    }
    for (Peer& p : peers_) p.fd = Fd();  // the peers see the connections close
    stopped_ = true;
    cv_.notify_all();
  }

  // Stops the progress thread and waits until it has stopped; the first
  // caller joins it (only that thread touches progress_ after start()).
  void stop_progress() {
    std::unique_lock<std::mutex> lock(mu_);
    if (!started_) return;
    stop_ = true;
    wake();
    cv_.wait(lock, [this] { return stopped_; });
    if (joining_) return;
    joining_ = true;
    lock.unlock();
    progress_.join();
  }

  std::shared_ptr<void> held_store_;  // rank 0: the rendezvous store it serves, MASTER_PORT held (rendezvous.h)
  std::vector<Peer> peers_;
  Status gave_up_;  // a peer's abort frame came: "rank r gave up: <its reason>"
  Fd wake_;  // eventfd: posted sends and stop requests wake the progress thread
  std::thread progress_;
  std::mutex mu_;  // guards everything the progress thread touches
  std::condition_variable cv_;
  bool started_ = false, stop_ = false, stopped_ = false, joining_ = false;
};

}  // namespace

Result<std::unique_ptr<Communicator>> create_tcp_communicator(DeviceBackend* device, const TcpCommOptions& o) {
  if (device == nullptr) return Status(StatusCode::kInvalidArgument, "tcp communicator: null device backend");
  if (device->kind() != DeviceKind::kHost)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("tcp communicator: needs the host device backend (got {}); CUDA buffers need NCCL",
                              device->name()));
  if (!(o.timeout_s > 0))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("tcp communicator: timeout_s must be > 0 (got {})", o.timeout_s));
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("tcp communicator: rank {} of world size {} is out of range", o.rank, o.world_size));
  const int rank = o.rank, world = o.world_size;
  std::vector<Link> links(static_cast<std::size_t>(world));
  std::shared_ptr<void> held_store;
  if (world > 1) {
    const std::string where = fmt::format("tcp communicator (rank {} of {})", rank, world);
    const auto deadline = net::deadline_after(o.timeout_s);
    STRATA_ASSIGN_OR_RETURN(Fd listener, net::listen_on_other_port(o.master_port, world, where));
    const uint32_t my_port = net::local_port(listener.fd);
    std::vector<uint8_t> blob;
    if (rank == 0) {
      Blob b{};
      std::memcpy(b.magic, kMagic, sizeof kMagic);
      b.version = kWireVersion;
      b.port = my_port;
      std::random_device rd;
      b.token = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(::getpid());
      blob.resize(sizeof b);
      std::memcpy(blob.data(), &b, sizeof b);
    }
    RendezvousOptions ro;
    ro.addr = o.master_addr;
    ro.port = o.master_port;
    ro.rank = rank;
    ro.world_size = world;
    ro.timeout_s = o.timeout_s;
    ro.key = o.key;
    ro.taken_hint = o.taken_hint;
    ro.hold = o.hold_store ? &held_store : nullptr;
    STRATA_ASSIGN_OR_RETURN(std::vector<uint8_t> got, rendezvous_broadcast(ro, blob));
    Blob b{};
    if (got.size() == sizeof b) std::memcpy(&b, got.data(), sizeof b);
    if (got.size() != sizeof b || std::memcmp(b.magic, kMagic, sizeof kMagic) != 0 || b.version != kWireVersion)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("{}: rank 0's rendezvous answer under key '{}' is not a TCP communicator's (version "
                                "{}; another kind of exchange under the same key?)",
                                where, o.key, b.version));
    Hello hello{};
    std::memcpy(hello.magic, kMagic, sizeof kMagic);
    hello.version = kWireVersion;
    hello.rank = rank;
    hello.world = world;
    hello.port = my_port;
    hello.token = b.token;
    std::vector<Entry> table(static_cast<std::size_t>(world));
    if (rank == 0) {
      STRATA_ASSIGN_OR_RETURN(links, accept_ranks(listener.fd, 1, world, world, b.token, deadline, where));
      // A rank that reached rank 0 over loopback is on rank 0's host: 0 in
      // the table says "where you reach rank 0" (MASTER_ADDR as each rank
      // resolves it), not 127.x or ::1, which other hosts cannot reach.
      for (int r = 1; r < world; ++r) table[r] = entry_of(links[r].peer, links[r].port);
      for (int r = 1; r < world; ++r)
        STRATA_RETURN_IF_ERROR(net::send_all(links[r].fd.fd, table.data(), table.size() * sizeof(Entry), deadline,
                                             fmt::format("{}: sending the address table to rank {}", where, r)));
    } else {
      STRATA_ASSIGN_OR_RETURN(
          std::vector<net::SockAddr> zero,
          net::resolve(o.master_addr.empty() ? "127.0.0.1" : o.master_addr, static_cast<uint16_t>(b.port), where));
      STRATA_ASSIGN_OR_RETURN(links[0].fd, connect_to(zero, 0, hello, deadline, o.timeout_s, where));
      STRATA_RETURN_IF_ERROR(net::recv_all(links[0].fd.fd, table.data(), table.size() * sizeof(Entry), deadline,
                                           where + ": the address table from rank 0"));
      for (int q = 1; q < rank; ++q) {
        const std::vector<net::SockAddr> to = targets_of(table[q], zero);
        STRATA_ASSIGN_OR_RETURN(links[q].fd, connect_to(to, q, hello, deadline, o.timeout_s,
                                                        fmt::format("{} (to {})", where, targets_text(to))));
      }
      if (rank + 1 < world) {
        STRATA_ASSIGN_OR_RETURN(auto higher,
                                accept_ranks(listener.fd, rank + 1, world, world, b.token, deadline, where));
        for (int r = rank + 1; r < world; ++r) links[r] = std::move(higher[r]);
      }
    }
  }
  auto comm = std::make_unique<TcpCommunicator>(device, rank, world, o.timeout_s, std::move(links),
                                                 std::move(held_store));
  STRATA_RETURN_IF_ERROR(comm->start());
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace strata::comm
