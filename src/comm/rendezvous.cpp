#include "comm/rendezvous.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "comm/socket_io.h"

namespace strata::comm {
namespace {

using net::Clock;
using net::Fd;
using net::ms_left;
using net::recv_all;
using net::resolve;
using net::send_all;
using net::wait_fd;
constexpr char kMagic[8] = {'S', 'T', 'R', 'A', 'T', 'A', 'R', 'V'};
// 2: the blob's header carries rank 0's decision time left; 3: the leader,
// joined, refused and fetched keys, the ended blob (a rank of another
// version fails at once: "another version")
constexpr uint32_t kVersion = 3;
constexpr uint64_t kMaxBlob = 64u << 20;

// ---- the TCPStore protocol (rendezvous.h)

constexpr uint32_t kValidateMagic = 0x3C85F7CE;
enum Query : uint8_t {
  kValidate = 0,
  kSet = 1,
  kGet = 3,
  kAdd = 4,
  kCheck = 5,
  kWait = 6,
  kCancelWait = 12,
  kPing = 13
};
constexpr uint8_t kStopWaiting = 0, kWaitCanceled = 1, kReady = 0, kNotReady = 1;
constexpr uint64_t kMaxKey = 4096;

void put_u32(std::vector<uint8_t>& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void put_u64(std::vector<uint8_t>& b, uint64_t v) {
  for (int i = 0; i < 8; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void put_bytes(std::vector<uint8_t>& b, const void* p, std::size_t n) {
  put_u64(b, n);
  b.insert(b.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
}
void put_str(std::vector<uint8_t>& b, const std::string& s) { put_bytes(b, s.data(), s.size()); }
uint32_t get_u32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// The verdict: u32 status code, then the message.
std::vector<uint8_t> encode_verdict(const Status& st) {
  std::vector<uint8_t> v;
  put_u32(v, static_cast<uint32_t>(st.code()));
  v.insert(v.end(), st.message().begin(), st.message().end());
  return v;
}
Status decode_verdict(const std::vector<uint8_t>& v, const std::string& where) {
  if (v.size() < 4) return Status(StatusCode::kCorrupt, where + ": a malformed verdict from rank 0");
  const uint32_t c = get_u32(v.data());
  if (c == 0) return Status();
  const auto code = c <= static_cast<uint32_t>(StatusCode::kInternal) ? static_cast<StatusCode>(c) : StatusCode::kInternal;
  return Status(code, std::string(v.begin() + 4, v.end()));
}

struct Keys {
  std::string blob, verdict, leader, refused, failed;
  std::vector<std::string> ack, joined, fetched;  // [r], r >= 1
  Keys(const RendezvousOptions& o) {
    const std::string p = "strata/rendezvous/" + o.key + "/";
    blob = p + "blob";
    verdict = p + "verdict";
    leader = p + "leader";
    refused = p + "refused";
    failed = p + "failed";
    ack.resize(static_cast<std::size_t>(o.world_size));
    joined.resize(static_cast<std::size_t>(o.world_size));
    fetched.resize(static_cast<std::size_t>(o.world_size));
    for (int r = 1; r < o.world_size; ++r) {
      ack[static_cast<std::size_t>(r)] = p + "ack/" + std::to_string(r);
      joined[static_cast<std::size_t>(r)] = p + "joined/" + std::to_string(r);
      fetched[static_cast<std::size_t>(r)] = p + "fetched/" + std::to_string(r);
    }
  }
};

// "STRATARV", u32 version, u32 world size, u64 ms until rank 0 decides (the
// ranks wait that long for its verdict, whatever their own deadline), blob.
constexpr std::size_t kBlobHead = sizeof(kMagic) + 16;
std::vector<uint8_t> encode_blob(const RendezvousOptions& o, const std::vector<uint8_t>& blob,
                                 Clock::time_point deadline) {
  std::vector<uint8_t> v(kMagic, kMagic + sizeof kMagic);
  put_u32(v, kVersion);
  put_u32(v, static_cast<uint32_t>(o.world_size));
  put_u64(v, static_cast<uint64_t>(ms_left(deadline)));
  v.insert(v.end(), blob.begin(), blob.end());
  return v;
}

// What the blob's key holds once the ranks have met: world size 0, no blob.
// A rank that comes later (another job's given the same MASTER_PORT, a
// second process given a rank that already came, a restarted attempt that
// reuses the key) learns at once that this exchange is over, instead of
// joining ranks that have left it.
std::vector<uint8_t> encode_ended() {
  std::vector<uint8_t> v(kMagic, kMagic + sizeof kMagic);
  put_u32(v, kVersion);
  put_u32(v, 0);
  put_u64(v, 0);
  return v;
}

// Rank 0 polls for a refusal this often while it waits for the ranks.
constexpr auto kRefusalPoll = std::chrono::milliseconds(200);

// How long rank 0 that served a refusal goes on serving it for ranks that
// have not come yet (launched with the others, but slower to start): they
// then fail at once with the reason instead of at their timeout without it.
constexpr auto kLateRanks = std::chrono::seconds(15);

// After rank 0's deadline: time for the few requests that publish a verdict.
constexpr auto kGrace = std::chrono::seconds(5);

// One connection to a TCPStore.
class StoreClient {
 public:
  StoreClient(std::string where, Clock::time_point deadline) : where_(std::move(where)), deadline_(deadline) {}
  // Every later request must finish by `deadline` (a verdict published after
  // the exchange's own deadline passed gets a grace period).
  void set_deadline(Clock::time_point deadline) { deadline_ = deadline; }
  void close() { fd_ = Fd(); }

  // One attempt; *refused: nothing listens there (ECONNREFUSED).
  Status connect_once(const std::vector<net::SockAddr>& targets, bool* refused) {
    STRATA_ASSIGN_OR_RETURN(fd_, net::connect_once(targets, deadline_, where_, refused));
    return Status();
  }

  // Retries until the deadline (the store may not listen yet).
  Status connect_retrying(const std::vector<net::SockAddr>& targets, double timeout_s) {
    STRATA_ASSIGN_OR_RETURN(fd_, net::connect_retrying(targets, deadline_, where_, "rank 0", timeout_s));
    return Status();
  }

  // VALIDATE, then a PING that must come back: a TCPStore is listening.
  Status handshake() {
    std::vector<uint8_t> b{kValidate};
    put_u32(b, kValidateMagic);
    b.push_back(kPing);
    const uint32_t nonce = static_cast<uint32_t>(::getpid()) ^ 0x5354u;
    put_u32(b, nonce);
    STRATA_RETURN_IF_ERROR(send_all(fd_.fd, b.data(), b.size(), deadline_, where_ + ": handshake"));
    uint8_t r[4];
    Status st = recv_all(fd_.fd, r, sizeof r, deadline_, where_ + ": handshake");
    if (st.code() == StatusCode::kUnavailable)  // the deadline: connected, but nothing answered
      return Status(st.code(), where_ + ": MASTER_PORT took the connection but never answered the TCPStore "
                                        "handshake (a process there that is not a TCPStore, or a rank 0 that "
                                        "stopped)");
    if (!st.ok()) return st;  // closed: rank 0's previous exchange ending (join retries)
    if (get_u32(r) != nonce)
      return Status(StatusCode::kIoError,
                    where_ + ": MASTER_PORT is served by something that does not answer as a torch TCPStore "
                             "(a wrong ping reply)");
    return Status();
  }

  Status set(const std::string& key, const std::vector<uint8_t>& value) {
    std::vector<uint8_t> b{kSet};
    put_str(b, key);
    put_bytes(b, value.data(), value.size());
    return send_all(fd_.fd, b.data(), b.size(), deadline_, where_ + ": set " + key);
  }

  Result<std::vector<uint8_t>> get(const std::string& key) {
    std::vector<uint8_t> b{kGet};
    put_str(b, key);
    STRATA_RETURN_IF_ERROR(send_all(fd_.fd, b.data(), b.size(), deadline_, where_ + ": get " + key));
    uint8_t n[8];
    STRATA_RETURN_IF_ERROR(recv_all(fd_.fd, n, sizeof n, deadline_, where_ + ": get " + key));
    const uint64_t len = get_u64(n);
    if (len > kMaxBlob + 64)
      return Status(StatusCode::kCorrupt, fmt::format("{}: the store announced {} bytes for {}", where_, len, key));
    std::vector<uint8_t> v(len);
    STRATA_RETURN_IF_ERROR(recv_all(fd_.fd, v.data(), v.size(), deadline_, where_ + ": get " + key));
    return v;
  }

  // The key's integer (a decimal string; absent: 0) plus `delta`, stored
  // and returned in one request: atomic in the store.
  Result<int64_t> add(const std::string& key, int64_t delta) {
    std::vector<uint8_t> b{kAdd};
    put_str(b, key);
    put_u64(b, static_cast<uint64_t>(delta));
    STRATA_RETURN_IF_ERROR(send_all(fd_.fd, b.data(), b.size(), deadline_, where_ + ": add " + key));
    uint8_t r[8];
    STRATA_RETURN_IF_ERROR(recv_all(fd_.fd, r, sizeof r, deadline_, where_ + ": add " + key));
    return static_cast<int64_t>(get_u64(r));
  }

  Result<bool> check(const std::string& key) {
    std::vector<uint8_t> b{kCheck};
    put_u64(b, 1);
    put_str(b, key);
    STRATA_RETURN_IF_ERROR(send_all(fd_.fd, b.data(), b.size(), deadline_, where_ + ": check " + key));
    uint8_t r = 0;
    STRATA_RETURN_IF_ERROR(recv_all(fd_.fd, &r, 1, deadline_, where_ + ": check " + key));
    return r == kReady;
  }

  // Until every key exists (true) or `until` passes (false; the wait is
  // cancelled, as torch's client does, and the connection stays usable).
  Result<bool> wait(const std::vector<std::string>& keys, Clock::time_point until) {
    std::vector<uint8_t> b{kWait};
    put_u64(b, keys.size());
    for (const auto& k : keys) put_str(b, k);
    STRATA_RETURN_IF_ERROR(send_all(fd_.fd, b.data(), b.size(), deadline_, where_ + ": wait"));
    STRATA_ASSIGN_OR_RETURN(bool ready, wait_fd(fd_.fd, POLLIN, until));
    uint8_t r = 0;
    const auto grace = Clock::now() + std::chrono::seconds(5);
    if (ready) {
      STRATA_RETURN_IF_ERROR(recv_all(fd_.fd, &r, 1, grace, where_ + ": wait"));
      if (r != kStopWaiting) return Status(StatusCode::kCorrupt, where_ + ": an unexpected reply to a wait");
      return true;
    }
    const uint8_t cancel = kCancelWait;
    STRATA_RETURN_IF_ERROR(send_all(fd_.fd, &cancel, 1, grace, where_ + ": cancel wait"));
    STRATA_RETURN_IF_ERROR(recv_all(fd_.fd, &r, 1, grace, where_ + ": cancel wait"));
    if (r == kStopWaiting) STRATA_RETURN_IF_ERROR(recv_all(fd_.fd, &r, 1, grace, where_ + ": cancel wait"));
    if (r != kWaitCanceled) return Status(StatusCode::kCorrupt, where_ + ": an unexpected reply to a cancelled wait");
    return false;
  }

 private:
  std::string where_;
  Clock::time_point deadline_;
  Fd fd_;
};

// The ranks' side (rank > 0): the blob, an ack, the verdict.
Result<std::vector<uint8_t>> join(const RendezvousOptions& o, Clock::time_point deadline, const std::string& where) {
  STRATA_ASSIGN_OR_RETURN(std::vector<net::SockAddr> targets, resolve(o.addr, o.port, where));
  StoreClient c(where, deadline);
  const Keys k(o);
  // Until the blob is there. A store that closes the connection first is
  // the server of rank 0's previous exchange, ending: connect again.
  std::vector<uint8_t> v;
  for (;;) {
    STRATA_RETURN_IF_ERROR(c.connect_retrying(targets, o.timeout_s));
    Status st = c.handshake();
    if (st.ok()) {
      Result<bool> came = c.wait({k.blob}, deadline);
      if (came.ok() && !*came)
        return Status(StatusCode::kUnavailable,
                      fmt::format("{}: rank 0 did not answer within {:g} s", where, o.timeout_s));
      if (came.ok()) {
        auto got = c.get(k.blob);
        if (got.ok()) {
          v = std::move(got).value();
          break;
        }
        st = got.status();
      } else {
        st = came.status();
      }
    }
    if (st.code() != StatusCode::kIoError || st.message().find("wrong ping reply") != std::string::npos ||
        ms_left(deadline) == 0)
      return st;
    c.close();
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(20, ms_left(deadline))));
  }
  if (v.size() < kBlobHead || std::memcmp(v.data(), kMagic, sizeof kMagic) != 0)
    return Status(StatusCode::kCorrupt, where + ": rank 0's blob is not a Strata rendezvous");
  if (const uint32_t version = get_u32(v.data() + 8); version != kVersion) {
    // (The ack and refusal keys are where every version since 2 has them.)
    const std::string refusal = fmt::format("rank {} speaks rendezvous version {}, rank 0 version {} (two Strata "
                                            "builds in one job)",
                                            o.rank, kVersion, version);
    const std::vector<uint8_t> text(refusal.begin(), refusal.end());
    (void)c.set(k.ack[static_cast<std::size_t>(o.rank)], text);
    (void)c.set(k.refused, text);
    return Status(StatusCode::kInvalidArgument, fmt::format("{}: {}", where, refusal));
  }
  const uint32_t world = get_u32(v.data() + 12);
  if (world == 0)
    return Status(StatusCode::kAlreadyExists,
                  o.taken_hint.empty()
                      ? fmt::format("{}: the ranks of this rendezvous (key '{}') have already met and left it: this "
                                    "process came after its job started (a second process given RANK={}?), or it "
                                    "belongs to another job given the same MASTER_ADDR:MASTER_PORT (give each job "
                                    "its own MASTER_PORT)",
                                    where, o.key, o.rank)
                      : fmt::format("{}: the ranks of this rendezvous (key '{}') have already met and left it: {}",
                                    where, o.key, o.taken_hint));
  // Rank 0 decides by its own deadline: the verdict is awaited that long
  // (and a grace period), so that every rank returns the same verdict.
  const auto verdict_by =
      std::max(deadline, Clock::now() + std::chrono::milliseconds(get_u64(v.data() + 16)) + kGrace);
  c.set_deadline(verdict_by);
  std::string refusal;
  if (world != static_cast<uint32_t>(o.world_size)) {
    refusal = fmt::format("rank {} says world size {}, rank 0 has {}", o.rank, o.world_size, world);
  } else {
    // Two processes given the same RANK: the second to count itself in
    // refuses, and so the whole rendezvous fails, naming the rank.
    STRATA_ASSIGN_OR_RETURN(const int64_t as, c.add(k.joined[static_cast<std::size_t>(o.rank)], 1));
    if (as > 1)
      refusal = o.taken_hint.empty()
                    ? fmt::format("{} processes joined as rank {} (two processes given RANK={}?)", as, o.rank, o.rank)
                    : fmt::format("{} processes joined as rank {}: {}", as, o.rank, o.taken_hint);
  }
  STRATA_RETURN_IF_ERROR(c.set(k.ack[static_cast<std::size_t>(o.rank)],
                               std::vector<uint8_t>(refusal.begin(), refusal.end())));
  if (!refusal.empty()) {
    // Rank 0 decides at once on a refusal, without waiting for the others.
    STRATA_RETURN_IF_ERROR(c.set(k.refused, std::vector<uint8_t>(refusal.begin(), refusal.end())));
    return Status(StatusCode::kInvalidArgument, fmt::format("{}: {}", where, refusal));
  }
  STRATA_ASSIGN_OR_RETURN(bool decided, c.wait({k.verdict}, verdict_by));
  if (!decided)
    return Status(StatusCode::kUnavailable,
                  fmt::format("{}: rank 0 gave no verdict within {:g} s", where, o.timeout_s));
  STRATA_ASSIGN_OR_RETURN(std::vector<uint8_t> verdict, c.get(k.verdict));
  Status st = decode_verdict(verdict, where);
  // Rank 0 through a store waits for this before it goes on (a store it
  // holds itself must not close under a rank still reading the verdict),
  // and so does a rank 0 that refused before the ranks met.
  const Status told = c.set(k.fetched[static_cast<std::size_t>(o.rank)], {});
  if (st.ok()) STRATA_RETURN_IF_ERROR(told);  // (a refusal: reported as such, whatever the store does now)
  if (!st.ok())
    return Status(st.code(), fmt::format("{}: rank 0 refused the rendezvous: {}", where, st.message()));
  return std::vector<uint8_t>(v.begin() + static_cast<std::ptrdiff_t>(kBlobHead), v.end());
}

// A rank > 0 that failed before the ranks met: its reason as its ack and
// the refusal, once a store answers at MASTER_PORT.
Status refuse_as_joiner(const RendezvousOptions& o, const std::string& refusal, Clock::time_point deadline,
                        const std::string& where) {
  STRATA_ASSIGN_OR_RETURN(std::vector<net::SockAddr> targets, resolve(o.addr, o.port, where));
  StoreClient c(where, deadline);
  const Keys k(o);
  const std::vector<uint8_t> text(refusal.begin(), refusal.end());
  for (;;) {
    STRATA_RETURN_IF_ERROR(c.connect_retrying(targets, o.timeout_s));
    Status st = c.handshake();
    bool sent = false;
    // In this order: rank 0 decides on `refused` (or on the last ack), and
    // finds `failed` there already (it then serves the verdict a while to
    // ranks still to come).
    if (st.ok()) st = c.set(k.failed, text);
    if (st.ok()) st = c.set(k.refused, text);
    sent = st.ok();
    if (st.ok()) st = c.set(k.ack[static_cast<std::size_t>(o.rank)], text);
    if (st.ok()) {  // a request that comes back: the sets are in
      auto done = c.check(k.refused);
      st = done.status();
    }
    // Closed once the refusal went out: rank 0 decided on it and closed its
    // store (it reads what came before a close). Closed before: the server
    // of rank 0's previous exchange, ending: connect again.
    if (sent && st.code() == StatusCode::kIoError) return Status();
    if (st.ok() || st.code() != StatusCode::kIoError || ms_left(deadline) == 0) return st;
    c.close();
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(20, ms_left(deadline))));
  }
}

// Rank 0's verdict from the acks it has (absent: never came) and the first
// refusal (a rank's reason, absent: none).
Status verdict_of(const RendezvousOptions& o, const std::vector<std::optional<std::string>>& acks,
                  const std::optional<std::string>& refused, const std::string& where) {
  // (A refusal's ack may have been overwritten by the rank it refused: a
  // second process given the same RANK.)
  if (refused) return Status(StatusCode::kInvalidArgument, fmt::format("{}: {}", where, *refused));
  std::string missing;
  for (int r = 1; r < o.world_size; ++r) {
    const auto& a = acks[static_cast<std::size_t>(r)];
    if (a && !a->empty()) return Status(StatusCode::kInvalidArgument, fmt::format("{}: {}", where, *a));
    if (!a) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
  }
  if (!missing.empty())
    return Status(StatusCode::kUnavailable, fmt::format("{}: timed out after {:g} s; never came: rank {}", where,
                                                        o.timeout_s, missing));
  return Status();
}

// Rank 0's blob, made unless the exchange is refused already (`refusal`:
// rank 0 failed before the ranks met). A maker that fails (run_blob_maker:
// an error, an exception, a blob too long) refuses it too: `failed` says
// why, `code` keeps its status code.
struct RootBlob {
  std::vector<uint8_t> bytes;
  std::string failed;
  StatusCode code = StatusCode::kInvalidArgument;
  const std::string* given = nullptr;
  // The exchange's refusal (null: none). Points into this object: take it
  // once the object is where it stays.
  const std::string* refusal() const { return given != nullptr ? given : failed.empty() ? nullptr : &failed; }
};

RootBlob make_blob(const BlobMaker& make, const std::string* refusal) {
  RootBlob b;
  b.given = refusal;
  if (refusal != nullptr) return b;
  auto r = make();
  if (r.ok()) {
    b.bytes = std::move(r).value();
  } else {
    b.failed = fmt::format("rank 0 could not make its blob: {}", r.status().message());
    b.code = r.status().code();
  }
  return b;
}

// Rank 0 with a TCPStore at MASTER_ADDR:MASTER_PORT (torchrun's).
// (make: rank 0's blob, made once this store is found to be ours to lead;
// refusal: rank 0 failed before the ranks met; the verdict says so at once.)
Result<std::vector<uint8_t>> lead_through(StoreClient& c, const RendezvousOptions& o, const BlobMaker& make,
                                          Clock::time_point deadline, const std::string& where,
                                          const std::string* refusal) {
  STRATA_RETURN_IF_ERROR(c.handshake());
  const Keys k(o);
  // The key names the job attempt and the communicator: a blob there
  // already is another rank 0's (another job on this MASTER_PORT, served by
  // its rank 0; or a second process given RANK=0). Overwriting it would mix
  // the two jobs' ranks.
  STRATA_ASSIGN_OR_RETURN(const int64_t leaders, c.add(k.leader, 1));
  if (leaders > 1)
    return Status(StatusCode::kAlreadyExists,
                  fmt::format("{}: {} (key '{}') in the store at MASTER_PORT{}", where,
                              o.taken_hint.empty() ? "another rank 0 already leads this rendezvous" : o.taken_hint,
                              o.key,
                              o.taken_hint.empty() ? ": two jobs given the same MASTER_ADDR:MASTER_PORT, or two "
                                                     "processes with RANK=0? Give each job its own MASTER_PORT"
                                                   : ""));
  RootBlob root = make_blob(make, refusal);
  refusal = root.refusal();
  STRATA_RETURN_IF_ERROR(c.set(k.blob, encode_blob(o, root.bytes, deadline)));
  if (refusal != nullptr) STRATA_RETURN_IF_ERROR(c.set(k.refused, std::vector<uint8_t>(refusal->begin(), refusal->end())));
  // Every ack, or a refusal (the store's WAIT is for all keys: a refusal is
  // looked for between slices of it), or the deadline.
  std::vector<std::string> want(k.ack.begin() + 1, k.ack.end());
  bool all = false;
  for (; refusal == nullptr;) {
    STRATA_ASSIGN_OR_RETURN(all, c.wait(want, std::min(deadline, Clock::now() + kRefusalPoll)));
    if (all || ms_left(deadline) == 0) break;
    STRATA_ASSIGN_OR_RETURN(const bool refused, c.check(k.refused));
    if (refused) break;
  }
  c.set_deadline(Clock::now() + kGrace);  // the acks' reads and the verdict, past a timeout too
  std::vector<std::optional<std::string>> acks(static_cast<std::size_t>(o.world_size));
  for (int r = 1; r < o.world_size; ++r) {
    const std::string& key = k.ack[static_cast<std::size_t>(r)];
    bool here = all;
    if (!here) {
      auto cr = c.check(key);
      if (!cr.ok()) return cr.status();
      here = *cr;
    }
    if (!here) continue;
    STRATA_ASSIGN_OR_RETURN(std::vector<uint8_t> a, c.get(key));
    acks[static_cast<std::size_t>(r)] = std::string(a.begin(), a.end());
  }
  // A refusal: rank 0's own, or a rank's (the last written, where several
  // refused at once: any of them fails every rank).
  std::optional<std::string> refused;
  if (refusal != nullptr) {
    refused = *refusal;
  } else {
    STRATA_ASSIGN_OR_RETURN(const bool any_refused, c.check(k.refused));
    if (any_refused) {
      STRATA_ASSIGN_OR_RETURN(std::vector<uint8_t> why, c.get(k.refused));
      refused = std::string(why.begin(), why.end());
    }
  }
  const Status verdict = verdict_of(o, acks, refused, where);
  STRATA_RETURN_IF_ERROR(c.set(k.verdict, encode_verdict(verdict)));
  if (!verdict.ok()) return root.failed.empty() ? verdict : Status(root.code, verdict.message());
  // Every rank has read the blob (it acked).
  STRATA_RETURN_IF_ERROR(c.set(k.blob, encode_ended()));
  // And fetches the verdict, within a grace period past the deadline (they
  // wait that long for it).
  c.set_deadline(std::max(deadline, Clock::now()) + kGrace * 2);
  std::vector<std::string> fetched(k.fetched.begin() + 1, k.fetched.end());
  STRATA_ASSIGN_OR_RETURN(const bool delivered, c.wait(fetched, std::max(deadline, Clock::now()) + kGrace));
  if (!delivered) {
    std::string missing;
    for (int r = 1; r < o.world_size; ++r) {
      STRATA_ASSIGN_OR_RETURN(const bool got, c.check(k.fetched[static_cast<std::size_t>(r)]));
      if (!got) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    }
    if (missing.empty()) return std::move(root.bytes);  // the last came just after the wait
    return Status(StatusCode::kUnavailable,
                  fmt::format("{}: rank {} never fetched rank 0's verdict (it stopped after it acknowledged)", where,
                              missing));
  }
  return std::move(root.bytes);
}

// Rank 0 where nothing listens on MASTER_PORT: the store's few requests
// served here, until every rank that came has the verdict.
class MiniStore {
 public:
  explicit MiniStore(std::string where) : where_(std::move(where)) {}

  Status listen(uint16_t port, int backlog, int* bind_errno) {
    STRATA_ASSIGN_OR_RETURN(listener_, net::listen_on(port, backlog, where_, bind_errno));
    return Status();
  }

  // For serving from another thread: stop() (any thread) ends serve_until()
  // at once, false.
  Status make_stoppable() {
    wake_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (wake_.fd < 0) return Status::from_errno(errno, where_ + ": eventfd");
    return Status();
  }
  void stop() {
    stop_ = true;
    const uint64_t one = 1;
    if (wake_.fd >= 0) (void)!::write(wake_.fd, &one, sizeof one);
  }
  void close() {
    conns_.clear();
    listener_ = Fd();
  }

  void set(const std::string& key, std::vector<uint8_t> value) {
    kv_[key] = std::move(value);
    wake();
  }
  // As torch's store: the value is a decimal string (absent or not a
  // number: 0 before the add).
  int64_t add(const std::string& key, int64_t delta) {
    int64_t v = 0;
    auto it = kv_.find(key);
    if (it != kv_.end()) {
      const std::string text(it->second.begin(), it->second.end());
      char* end = nullptr;
      const long long parsed = std::strtoll(text.c_str(), &end, 10);
      if (end != text.c_str()) v = parsed;
    }
    v = static_cast<int64_t>(static_cast<uint64_t>(v) + static_cast<uint64_t>(delta));  // wraps, never UB
    const std::string out = std::to_string(v);
    set(key, std::vector<uint8_t>(out.begin(), out.end()));
    return v;
  }
  bool has(const std::string& key) const { return kv_.count(key) != 0; }
  const std::vector<uint8_t>& at(const std::string& key) const { return kv_.at(key); }
  int gets_of(const std::string& key) const {
    auto it = gets_.find(key);
    return it == gets_.end() ? 0 : it->second;
  }

  // Serves until done() (and every reply is sent) or `until`; false then.
  Result<bool> serve_until(const std::function<bool()>& done, Clock::time_point until) {
    auto accept_again = Clock::now();  // accept paused until then (out of descriptors)
    for (;;) {
      // Dropped connections leave (strangers or reconnecting ranks must not
      // grow the poll set without bound).
      conns_.erase(std::remove_if(conns_.begin(), conns_.end(), [](const Conn& c) { return c.fd.fd < 0; }),
                   conns_.end());
      bool flushed = true;
      for (const auto& c : conns_) flushed = flushed && c.out.empty();
      if (stop_) return false;
      if (done() && flushed) return true;
      if (ms_left(until) == 0) return false;
      STRATA_RETURN_IF_ERROR(net::check_cancel(where_));
      const bool accepting = Clock::now() >= accept_again;
      std::vector<pollfd> p{{listener_.fd, static_cast<short>(accepting ? POLLIN : 0), 0}};
      for (const auto& c : conns_)
        p.push_back({c.fd.fd, static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
      const std::size_t polled = conns_.size();  // p[1 .. polled]; an accept below adds one after them
      if (wake_.fd >= 0) p.push_back({wake_.fd, POLLIN, 0});  // last: after the connections
      const int wait_ms = accepting ? ms_left(until) : std::min(ms_left(until), 50);
      const int n = ::poll(p.data(), p.size(), net::poll_slice(wait_ms));
      if (n < 0 && errno != EINTR) return Status::from_errno(errno, where_ + ": poll");
      if (n <= 0) continue;
      if (wake_.fd >= 0 && (p.back().revents & POLLIN)) {
        uint64_t v;
        while (::read(wake_.fd, &v, sizeof v) > 0) {
        }
      }
      if (p[0].revents & POLLIN) {
        Fd c(::accept4(listener_.fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (c.fd >= 0) {
          int one = 1;
          ::setsockopt(c.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          Conn conn;
          conn.fd = std::move(c);
          conns_.push_back(std::move(conn));
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
          accept_again = Clock::now() + std::chrono::milliseconds(50);  // EMFILE and the like: not a busy loop
        }
      }
      for (std::size_t i = 0; i < polled; ++i) {
        Conn& c = conns_[i];
        if (c.fd.fd < 0) continue;
        if (p[i + 1].revents & (POLLIN | POLLHUP | POLLERR)) read_from(c);
        if (c.fd.fd >= 0 && !c.out.empty()) write_to(c);
      }
    }
  }

 private:
  struct Conn {
    Fd fd;
    std::vector<uint8_t> in, out;
    bool validated = false;
    std::vector<std::string> waiting;  // keys of a pending WAIT
  };

  void drop(Conn& c) {
    c.fd = Fd();
    c.in.clear();
    c.out.clear();
    c.waiting.clear();
  }

  void read_from(Conn& c) {
    uint8_t buf[4096];
    bool gone = false;
    for (;;) {
      const ssize_t k = ::recv(c.fd.fd, buf, sizeof buf, 0);
      if (k > 0) {
        c.in.insert(c.in.end(), buf, buf + k);
        continue;
      }
      if (k < 0 && (errno == EINTR)) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      gone = true;  // closed, or an error: what it sent before still counts (a refusing rank's ack)
      break;
    }
    std::size_t used = 0;
    for (;;) {
      const long r = parse(c, c.in.data() + used, c.in.size() - used);
      if (r < 0) {
        drop(c);  // not the protocol
        return;
      }
      if (r == 0) break;
      used += static_cast<std::size_t>(r);
    }
    c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(used));
    if (gone) drop(c);
  }

  void write_to(Conn& c) {
    while (!c.out.empty()) {
      const ssize_t k = ::send(c.fd.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (k > 0) {
        c.out.erase(c.out.begin(), c.out.begin() + k);
        continue;
      }
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      drop(c);
      return;
    }
  }

  // One request from p[0..n): bytes consumed, 0 when incomplete, -1 when
  // malformed or unknown.
  long parse(Conn& c, const uint8_t* p, std::size_t n) {
    std::size_t at = 1;
    auto need = [&](std::size_t k) { return at + k <= n; };
    auto str = [&](std::string* out) -> int {  // 1 ok, 0 incomplete, -1 bad
      if (!need(8)) return 0;
      const uint64_t len = get_u64(p + at);
      if (len > kMaxBlob + 64) return -1;
      if (!need(8 + len)) return 0;
      out->assign(reinterpret_cast<const char*>(p + at + 8), len);
      at += 8 + len;
      return 1;
    };
    if (n == 0) return 0;
    const uint8_t q = p[0];
    if (!c.validated && q != kValidate) return -1;
    switch (q) {
      case kValidate:
        if (!need(4)) return 0;
        if (get_u32(p + 1) != kValidateMagic) return -1;
        c.validated = true;
        return 5;
      case kPing:
        if (!need(4)) return 0;
        c.out.insert(c.out.end(), p + 1, p + 5);
        return 5;
      case kSet: {
        std::string key, value;
        int r = str(&key);
        if (r <= 0) return r;
        r = str(&value);
        if (r <= 0) return r;
        if (key.size() > kMaxKey) return -1;
        set(key, std::vector<uint8_t>(value.begin(), value.end()));
        return static_cast<long>(at);
      }
      case kAdd: {
        std::string key;
        const int r = str(&key);
        if (r <= 0) return r;
        if (!need(8)) return 0;
        if (key.size() > kMaxKey) return -1;
        const int64_t delta = static_cast<int64_t>(get_u64(p + at));
        at += 8;
        put_u64(c.out, static_cast<uint64_t>(add(key, delta)));
        return static_cast<long>(at);
      }
      case kGet: {
        std::string key;
        const int r = str(&key);
        if (r <= 0) return r;
        auto it = kv_.find(key);
        if (it == kv_.end()) {
          put_u64(c.out, 0);  // an empty value, as torch's (libuv) store answers
        } else {
          put_bytes(c.out, it->second.data(), it->second.size());
        }
        ++gets_[key];
        return static_cast<long>(at);
      }
      case kCheck:
      case kWait: {
        if (!need(8)) return 0;
        const uint64_t k = get_u64(p + 1);
        if (k > 1024) return -1;
        at = 9;
        std::vector<std::string> keys(k);
        for (auto& key : keys) {
          const int r = str(&key);
          if (r <= 0) return r;
        }
        if (q == kCheck) {
          bool all = true;
          for (const auto& key : keys) all = all && has(key);
          c.out.push_back(all ? kReady : kNotReady);
        } else if (keys.empty()) {
          c.out.push_back(kStopWaiting);
        } else {
          c.waiting = std::move(keys);
          wake();
        }
        return static_cast<long>(at);
      }
      case kCancelWait:
        c.waiting.clear();
        c.out.push_back(kWaitCanceled);
        return 1;
      default:
        return -1;
    }
  }

  // Answers every WAIT whose keys all exist now.
  void wake() {
    for (auto& c : conns_) {
      if (c.fd.fd < 0 || c.waiting.empty()) continue;
      bool all = true;
      for (const auto& key : c.waiting) all = all && has(key);
      if (!all) continue;
      c.waiting.clear();
      c.out.push_back(kStopWaiting);
    }
  }

  std::string where_;
  Fd listener_;
  std::vector<Conn> conns_;
  std::map<std::string, std::vector<uint8_t>> kv_;
  std::map<std::string, int> gets_;
  Fd wake_;  // make_stoppable(): stop() wakes the poll
  std::atomic<bool> stop_{false};
};

// Serves `s` (its exchange over) in a thread of its own until the handle
// is released: MASTER_PORT stays taken, as torch's rank-0 TCPStore holds it
// for its process group's life, so that a second job given the same port
// fails at once (its rank 0 finds the leader key taken, its other ranks
// find the exchange ended) instead of meeting this job's ranks, and this
// job's later exchanges are served there (through lead_through).
std::shared_ptr<void> keep_serving(std::unique_ptr<MiniStore> s) {
  struct Keeper {
    std::unique_ptr<MiniStore> store;
    std::thread thread;
    ~Keeper() {
      store->stop();
      if (thread.joinable()) thread.join();
    }
  };
  if (!s->make_stoppable().ok()) return nullptr;  // (no eventfd): not held, the store closes
  auto k = std::make_shared<Keeper>();
  MiniStore* store = s.get();
  k->store = std::move(s);
  try {
    k->thread = std::thread([store] {
      try {
        (void)store->serve_until([] { return false; }, net::deadline_after(1e9));
      } catch (...) {  // (no memory): the port is let go below
      }
      store->close();
    });
  } catch (const std::system_error&) {  // no thread: not held, the store closes
    return nullptr;
  }
  return k;
}

// True once every rank has heard the verdict: fetched it, or refused.
std::function<bool()> heard_by_all(const MiniStore& s, const RendezvousOptions& o, const Keys& k) {
  return [&s, &o, &k] {
    for (int r = 1; r < o.world_size; ++r) {
      const auto i = static_cast<std::size_t>(r);
      if (!s.has(k.fetched[i]) && !(s.has(k.ack[i]) && !s.at(k.ack[i]).empty())) return false;
    }
    return true;
  };
}

// (s: listening on MASTER_PORT.)
Result<std::vector<uint8_t>> lead_alone(std::unique_ptr<MiniStore> s, const RendezvousOptions& o,
                                        const BlobMaker& make, Clock::time_point deadline, const std::string& where,
                                        const std::string* refusal) {
  const Keys k(o);
  s->add(k.leader, 1);
  RootBlob root = make_blob(make, refusal);
  refusal = root.refusal();
  s->set(k.blob, encode_blob(o, root.bytes, deadline));
  if (refusal != nullptr) {
    // Rank 0 failed before the ranks met, or could not make its blob: the
    // verdict says so at once, and the store stays until every rank has
    // heard it (fetched the verdict, or refused itself): up to the deadline
    // (rendezvous_refuse's caller chose it), a failed maker's up to
    // kLateRanks.
    s->set(k.refused, std::vector<uint8_t>(refusal->begin(), refusal->end()));
    s->set(k.verdict, encode_verdict(verdict_of(o, {}, *refusal, where)));
    const auto until = root.failed.empty() ? deadline : std::min(deadline, Clock::now() + kLateRanks);
    STRATA_RETURN_IF_ERROR(s->serve_until(heard_by_all(*s, o, k), until).status());
    return Status(root.code, fmt::format("{}: {}", where, *refusal));
  }
  auto all_acked = [&] {
    if (s->has(k.refused)) return true;  // decided at once
    for (int r = 1; r < o.world_size; ++r)
      if (!s->has(k.ack[static_cast<std::size_t>(r)])) return false;
    return true;
  };
  STRATA_RETURN_IF_ERROR(s->serve_until(all_acked, deadline).status());
  std::vector<std::optional<std::string>> acks(static_cast<std::size_t>(o.world_size));
  int came = 0;  // the ranks that wait for the verdict: one per rank counted in (a refusing one left)
  for (int r = 1; r < o.world_size; ++r) {
    const std::string& key = k.ack[static_cast<std::size_t>(r)];
    if (s->has(k.joined[static_cast<std::size_t>(r)])) ++came;
    if (!s->has(key)) continue;
    acks[static_cast<std::size_t>(r)] = std::string(s->at(key).begin(), s->at(key).end());
  }
  std::optional<std::string> refused;
  if (s->has(k.refused)) refused = std::string(s->at(k.refused).begin(), s->at(k.refused).end());
  const Status verdict = verdict_of(o, acks, refused, where);
  s->set(k.verdict, encode_verdict(verdict));
  // Every rank that came fetches the verdict, within a grace period past
  // the deadline (they wait that long for it).
  const auto until = std::max(deadline, Clock::now()) + kGrace;
  auto delivered = [&] { return s->gets_of(k.verdict) >= came; };
  STRATA_ASSIGN_OR_RETURN(bool all, s->serve_until(delivered, until));
  if (refused && s->has(k.failed)) {
    // A rank that failed before the ranks met: the others were launched with
    // it, and those slower to start hear it too (a while: rank 0's own error
    // is not held back long). Not after a refusal of the launch itself
    // (another world size, a rank given twice): the missing ranks may not
    // exist.
    (void)s->serve_until(heard_by_all(*s, o, k), std::min(until, Clock::now() + kLateRanks));
  }
  if (!verdict.ok()) return verdict;
  if (!all)
    return Status(StatusCode::kUnavailable,
                  fmt::format("{}: {} of {} ranks fetched the verdict before the timeout", where,
                              s->gets_of(k.verdict), came));
  s->set(k.blob, encode_ended());
  if (o.hold != nullptr) *o.hold = keep_serving(std::move(s));
  return std::move(root.bytes);
}

// (make: rank 0's blob, made once MASTER_PORT is taken; refusal: rank 0
// failed before the ranks met.)
Result<std::vector<uint8_t>> lead(const RendezvousOptions& o, const BlobMaker& make, Clock::time_point deadline,
                                  const std::string& where, const std::string* refusal = nullptr) {
  STRATA_ASSIGN_OR_RETURN(std::vector<net::SockAddr> targets,
                          resolve(o.addr.empty() ? "127.0.0.1" : o.addr, o.port, where));
  // A socket may hold MASTER_PORT a moment after nothing answered there (a
  // joining rank's connection to itself, reset at once; a closing store):
  // the bind is tried again for a while, a store there taken if one comes.
  const auto give_up = std::min(deadline, Clock::now() + std::chrono::seconds(2));
  for (;;) {
    StoreClient c(where, deadline);
    bool refused = false;
    // MASTER_PORT taken (a store there, or this listener): the blob is
    // made there, once the store is found to be ours to lead.
    Status st = c.connect_once(targets, &refused);
    if (st.ok()) return lead_through(c, o, make, deadline, where, refusal);
    if (!refused) return st;
    auto s = std::make_unique<MiniStore>(where);
    int bind_errno = 0;
    Status listening = s->listen(o.port, o.world_size, &bind_errno);
    if (listening.ok()) return lead_alone(std::move(s), o, make, deadline, where, refusal);
    if (bind_errno != EADDRINUSE || Clock::now() >= give_up) return listening;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// The options' checks both calls share.
Status check_options(const RendezvousOptions& o) {
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("rendezvous: rank {} of world size {} is out of range", o.rank, o.world_size));
  if (!(o.timeout_s > 0))
    return Status(StatusCode::kInvalidArgument, fmt::format("rendezvous: timeout_s must be > 0 (got {})", o.timeout_s));
  if (o.world_size == 1) return Status();
  if (o.port == 0) return Status(StatusCode::kInvalidArgument, "rendezvous: port 0 (set MASTER_PORT)");
  if (o.rank != 0 && o.addr.empty())
    return Status(StatusCode::kInvalidArgument, "rendezvous: empty address (set MASTER_ADDR)");
  return Status();
}

std::string where_of(const RendezvousOptions& o) {
  return fmt::format("rendezvous at {} (rank {} of {})", net::host_port_text(o.addr.empty() ? "*" : o.addr, o.port),
                     o.rank, o.world_size);
}

}  // namespace

Result<std::vector<uint8_t>> run_blob_maker(const BlobMaker& make, std::size_t max_bytes) {
  if (!make) return Status(StatusCode::kInvalidArgument, "no blob maker");
  Result<std::vector<uint8_t>> made = Status(StatusCode::kInternal, "the blob maker returned nothing");
  try {
    made = make();
  } catch (const std::exception& e) {
    return Status(StatusCode::kInternal, e.what());
  }
  if (made.ok() && made->size() > max_bytes)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("its blob has {} bytes, more than the {} every rank receives", made->size(), max_bytes));
  return made;
}

Result<std::vector<uint8_t>> rendezvous_broadcast(const RendezvousOptions& o, const std::vector<uint8_t>& root_blob) {
  return rendezvous_broadcast_lazy(o, [&root_blob]() -> Result<std::vector<uint8_t>> { return root_blob; });
}

Result<std::vector<uint8_t>> rendezvous_broadcast_lazy(const RendezvousOptions& o, const BlobMaker& make_root_blob) {
  STRATA_RETURN_IF_ERROR(check_options(o));
  // Rank 0's blob, checked where it is made.
  BlobMaker make = [&make_root_blob] { return run_blob_maker(make_root_blob, kMaxBlob); };
  if (o.world_size == 1) return make();
  const std::string where = where_of(o);
  const auto deadline = net::deadline_after(o.timeout_s);
  return o.rank == 0 ? lead(o, make, deadline, where) : join(o, deadline, where);
}

Status rendezvous_refuse(const RendezvousOptions& o, const std::string& why) {
  STRATA_RETURN_IF_ERROR(check_options(o));
  if (o.world_size == 1) return Status();
  const std::string where = where_of(o);
  const auto deadline = net::deadline_after(o.timeout_s);
  std::string refusal = fmt::format("rank {} failed before the ranks met: {}", o.rank, why);
  if (refusal.size() > 4096) refusal = refusal.substr(0, 4093) + "...";
  if (o.rank != 0) return refuse_as_joiner(o, refusal, deadline, where);
  Result<std::vector<uint8_t>> led = lead(o, nullptr, deadline, where, &refusal);
  // Its refusal, published: done. (Anything else: why it could not be.)
  if (!led.ok() && led.status().code() == StatusCode::kInvalidArgument &&
      led.status().message().find(refusal) != std::string::npos)
    return Status();
  return led.ok() ? Status(StatusCode::kInternal, where + ": a refusing rank 0 met the ranks") : led.status();
}

}  // namespace strata::comm
