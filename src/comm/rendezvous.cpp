#include "comm/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include <fmt/format.h>

namespace strata::comm {
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kMagic[8] = {'S', 'T', 'R', 'A', 'T', 'A', 'R', 'V'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kMaxBlob = 64u << 20;

struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Fd& operator=(Fd&& o) noexcept {
    std::swap(fd, o.fd);
    return *this;
  }
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<long long>(left, 1 << 30));
}

// Waits for `events` on fd; false on timeout.
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

struct Hello {
  char magic[8];
  uint32_t version, rank, world;
};
static_assert(sizeof(Hello) == 20);

struct ReplyHeader {
  uint32_t code;
  uint32_t pad;
  uint64_t length;
};
static_assert(sizeof(ReplyHeader) == 16);

Status send_reply(int fd, StatusCode code, const void* data, std::size_t n, Clock::time_point deadline,
                  const std::string& what) {
  ReplyHeader h{static_cast<uint32_t>(code), 0, n};
  STRATA_RETURN_IF_ERROR(send_all(fd, &h, sizeof h, deadline, what));
  return send_all(fd, data, n, deadline, what);
}

Result<std::vector<uint8_t>> serve(const RendezvousOptions& o, const std::vector<uint8_t>& blob,
                                   Clock::time_point deadline, const std::string& where) {
  Fd listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (listener.fd < 0) return Status::from_errno(errno, where + ": socket failed");
  int one = 1;
  ::setsockopt(listener.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  sa.sin_port = htons(o.port);
  if (::bind(listener.fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0)
    return Status::from_errno(errno, fmt::format("{}: bind to port {} failed", where, o.port));
  if (::listen(listener.fd, o.world_size) != 0) return Status::from_errno(errno, where + ": listen failed");

  std::vector<Fd> peers(static_cast<std::size_t>(o.world_size));
  int joined = 0;
  Status failure;
  while (joined < o.world_size - 1) {
    STRATA_ASSIGN_OR_RETURN(bool ready, wait_fd(listener.fd, POLLIN, deadline));
    if (!ready) {
      std::string missing;
      for (int r = 1; r < o.world_size; ++r)
        if (peers[r].fd < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      failure = Status(StatusCode::kUnavailable,
                       fmt::format("{}: timed out after {:g} s: {} of {} ranks joined; never came: rank {}", where,
                                   o.timeout_s, joined, o.world_size - 1, missing));
      break;
    }
    Fd conn(::accept4(listener.fd, nullptr, nullptr, SOCK_CLOEXEC));
    if (conn.fd < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
      failure = Status::from_errno(errno, where + ": accept failed");
      break;
    }
    Hello h{};
    Status st = recv_all(conn.fd, &h, sizeof h, deadline, where + ": hello of a connecting rank");
    if (!st.ok()) continue;  // not one of ours, or it died: the others may still come
    std::string bad;
    if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0 || h.version != kVersion)
      bad = "a connection that is not a Strata rendezvous (or another protocol version)";
    else if (h.world != static_cast<uint32_t>(o.world_size))
      bad = fmt::format("rank {} says world size {}, rank 0 has {}", h.rank, h.world, o.world_size);
    else if (h.rank == 0 || h.rank >= h.world)
      bad = fmt::format("a rank {} connected (expected 1..{})", h.rank, o.world_size - 1);
    else if (peers[h.rank].fd >= 0)
      bad = fmt::format("rank {} connected twice", h.rank);
    if (!bad.empty()) {
      failure = Status(StatusCode::kInvalidArgument, fmt::format("{}: {}", where, bad));
      (void)send_reply(conn.fd, failure.code(), failure.message().data(), failure.message().size(), deadline, where);
      break;
    }
    peers[h.rank] = std::move(conn);
    ++joined;
  }
  // Everyone connected gets the blob, or the failure.
  const auto reply_deadline = failure.ok() ? deadline : Clock::now() + std::chrono::seconds(2);
  for (int r = 1; r < o.world_size; ++r) {
    if (peers[r].fd < 0) continue;
    Status st = failure.ok() ? send_reply(peers[r].fd, StatusCode::kOk, blob.data(), blob.size(), reply_deadline,
                                          fmt::format("{}: reply to rank {}", where, r))
                             : send_reply(peers[r].fd, failure.code(), failure.message().data(),
                                          failure.message().size(), reply_deadline, where);
    if (failure.ok() && !st.ok()) failure = st;
  }
  if (!failure.ok()) return failure;
  return blob;
}

Result<std::vector<uint8_t>> join(const RendezvousOptions& o, Clock::time_point deadline, const std::string& where) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(o.port);
  if (int rc = ::getaddrinfo(o.addr.c_str(), port.c_str(), &hints, &res); rc != 0)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: cannot resolve MASTER_ADDR '{}': {}", where, o.addr, gai_strerror(rc)));
  sockaddr_in target{};
  std::memcpy(&target, res->ai_addr, sizeof target);
  ::freeaddrinfo(res);

  Fd conn;
  int last_errno = 0;
  for (;;) {
    Fd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (s.fd < 0) return Status::from_errno(errno, where + ": socket failed");
    int rc = ::connect(s.fd, reinterpret_cast<sockaddr*>(&target), sizeof target);
    if (rc != 0 && errno == EINPROGRESS) {
      STRATA_ASSIGN_OR_RETURN(bool ready, wait_fd(s.fd, POLLOUT, deadline));
      int err = ETIMEDOUT;
      socklen_t len = sizeof err;
      if (ready) ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc == 0) {
      conn = std::move(s);
      break;
    }
    last_errno = errno;
    if (ms_left(deadline) == 0)
      return Status(StatusCode::kUnavailable,
                    fmt::format("{}: could not reach rank 0 within {:g} s (last error: {})", where, o.timeout_s,
                                std::strerror(last_errno)));
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(50, ms_left(deadline))));
  }
  int one = 1;
  ::setsockopt(conn.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  Hello h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.version = kVersion;
  h.rank = static_cast<uint32_t>(o.rank);
  h.world = static_cast<uint32_t>(o.world_size);
  STRATA_RETURN_IF_ERROR(send_all(conn.fd, &h, sizeof h, deadline, where + ": hello"));
  ReplyHeader r{};
  Status st = recv_all(conn.fd, &r, sizeof r, deadline, where + ": waiting for rank 0's reply");
  if (!st.ok()) {
    if (st.code() == StatusCode::kUnavailable)
      return Status(StatusCode::kUnavailable,
                    fmt::format("{}: rank 0 did not answer within {:g} s", where, o.timeout_s));
    return st;
  }
  if (r.length > kMaxBlob)
    return Status(StatusCode::kCorrupt, fmt::format("{}: rank 0 announced {} bytes (limit {})", where, r.length, kMaxBlob));
  std::vector<uint8_t> data(r.length);
  STRATA_RETURN_IF_ERROR(recv_all(conn.fd, data.data(), data.size(), deadline, where + ": rank 0's blob"));
  if (r.code != 0) {
    const auto code = r.code <= static_cast<uint32_t>(StatusCode::kInternal) ? static_cast<StatusCode>(r.code)
                                                                             : StatusCode::kInternal;
    return Status(code, fmt::format("{}: rank 0 refused the rendezvous: {}", where,
                                    std::string(data.begin(), data.end())));
  }
  return data;
}

}  // namespace

Result<std::vector<uint8_t>> rendezvous_broadcast(const RendezvousOptions& o, const std::vector<uint8_t>& root_blob) {
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("rendezvous: rank {} of world size {} is out of range", o.rank, o.world_size));
  if (!(o.timeout_s > 0))
    return Status(StatusCode::kInvalidArgument, fmt::format("rendezvous: timeout_s must be > 0 (got {})", o.timeout_s));
  if (root_blob.size() > kMaxBlob)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("rendezvous: blob of {} bytes exceeds {}", root_blob.size(), kMaxBlob));
  if (o.world_size == 1) return root_blob;
  if (o.port == 0) return Status(StatusCode::kInvalidArgument, "rendezvous: port 0 (set MASTER_PORT)");
  if (o.rank != 0 && o.addr.empty())
    return Status(StatusCode::kInvalidArgument, "rendezvous: empty address (set MASTER_ADDR)");
  const std::string where =
      fmt::format("rendezvous at {}:{} (rank {} of {})", o.addr.empty() ? "*" : o.addr, o.port, o.rank, o.world_size);
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.timeout_s));
  return o.rank == 0 ? serve(o, root_blob, deadline, where) : join(o, deadline, where);
}

}  // namespace strata::comm
