// `strata bench io`: sequential O_DIRECT write then read of one file per
// backend, bytes verified, GB/s per backend and direction.
//
// The device sees what fio makes it see: --block-sized I/Os, --qd of them in
// flight, refilled as each completes (scripts/bench_io_fio.sh puts the two
// side by side). Strata gets there the way the runtime uses it: a few large
// requests (--request, default 8 MiB) that the engine splits into blocks and
// keeps the queue full with on its own I/O thread. --request=--block makes it
// one request per block instead. Buffers come from the pinned pool registered
// with the engine (io_uring fixed buffers). Every 4 KiB is stamped with its
// offset and checked on the way back.
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_util.h"
#include "commands.h"
#include "common/log.h"
#include "common/units.h"
#include "io/io_engine.h"
#include "io/pinned_pool.h"

namespace strata::tools {
namespace {

using io::IoEngine;
using io::IoOpKind;

struct BenchIoOptions {
  std::string dir;
  std::string size = "2GiB";
  std::string block = "1MiB";
  std::string request = "8MiB";
  unsigned qd = 32;
  std::string backend = "all";
  bool json = false;
  bool keep = false;
};

struct BenchResult {
  std::string backend, op;
  std::uint64_t block = 0, bytes = 0, request = 0;
  unsigned qd = 0;
  double seconds = 0;
  IoEngine::Stats stats;  // cumulative for the engine at the end of this phase
  double gbps() const { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0; }
};

// The stamp that makes every 4 KiB of the file distinct.
inline std::uint64_t stamp(std::uint64_t offset) {
  return offset * 0x9E3779B97F4A7C15ull ^ 0x5354524154410000ull;
}

// Ctrl-C (or SIGTERM/SIGHUP) in the middle of a run must not leave a
// multi-GiB test file behind. The handler removes the current file with
// unlink(2) (async-signal-safe, and the process is about to die anyway, so
// I/O still in flight on the open descriptor does not matter), then dies of
// the same signal with the default action so the caller sees how it ended.
// Signals that were ignored when we started (nohup, background jobs) stay
// ignored. SIGXFSZ is ignored so that a file-size limit (ulimit -f) is an
// EFBIG error, not a kill that leaves the file.
class CleanupOnSignal {
 public:
  CleanupOnSignal() {
    for (std::size_t i = 0; i < kSignals.size(); ++i) {
      struct sigaction old {};
      if (sigaction(kSignals[i], nullptr, &old) != 0 || old.sa_handler == SIG_IGN) continue;
      struct sigaction sa {};
      sa.sa_handler = &CleanupOnSignal::handle;
      sigemptyset(&sa.sa_mask);
      sa.sa_flags = SA_RESETHAND;  // a second Ctrl-C kills at once
      if (sigaction(kSignals[i], &sa, &old_[i]) == 0) installed_[i] = true;
    }
    old_xfsz_ = ::signal(SIGXFSZ, SIG_IGN);
  }
  ~CleanupOnSignal() {
    disarm();
    for (std::size_t i = 0; i < kSignals.size(); ++i)
      if (installed_[i]) sigaction(kSignals[i], &old_[i], nullptr);
    ::signal(SIGXFSZ, old_xfsz_);
  }
  CleanupOnSignal(const CleanupOnSignal&) = delete;
  CleanupOnSignal& operator=(const CleanupOnSignal&) = delete;

  // The file to remove if a signal arrives (before it is created).
  static bool arm(const std::string& path) {
    if (path.size() >= sizeof(path_)) return false;
    armed_.store(false);
    std::memcpy(path_, path.c_str(), path.size() + 1);
    armed_.store(true);
    return true;
  }
  static void disarm() { armed_.store(false); }

 private:
  static void handle(int sig) {
    if (armed_.exchange(false)) ::unlink(path_);
    ::raise(sig);  // SA_RESETHAND restored the default action
  }
  static constexpr std::array<int, 3> kSignals = {SIGINT, SIGTERM, SIGHUP};
  static_assert(std::atomic<bool>::is_always_lock_free);
  static inline std::atomic<bool> armed_{false};
  static inline char path_[4096];
  std::array<struct sigaction, 3> old_{};
  std::array<bool, 3> installed_{};
  void (*old_xfsz_)(int) = SIG_DFL;
};

// Moves the file in requests of `request` bytes (a multiple of the block);
// the engine splits each into block-sized pieces and keeps `qd` pieces in
// flight, so the device sees exactly fio's pattern (bs = block, iodepth = qd)
// while this thread only refills a few large requests and checks the bytes.
// Enough requests are kept queued (>= 2 x qd pieces) that the engine always
// has the next pieces at hand when one completes.
class Runner {
 public:
  Runner(IoEngine& e, io::IoFile& f, std::uint64_t size, std::uint64_t block, std::uint64_t request, unsigned qd)
      : e_(e), f_(f), size_(size), req_(request), slots_(slots_for(size, block, request, qd)) {}

  // Requests kept in flight: enough for 2 x qd pieces, plus one being refilled.
  static unsigned slots_for(std::uint64_t size, std::uint64_t block, std::uint64_t request, unsigned qd) {
    const std::uint64_t want = (2ull * qd * block + request - 1) / request + 1;
    const std::uint64_t requests = size / request + (size % request != 0);  // no wrap near 2^64
    return static_cast<unsigned>(std::max<std::uint64_t>(1, std::min(want, requests)));
  }

  // Buffers: one per slot for writing (also the reference), one for reading.
  Status prepare(io::PinnedPool& pool) {
    for (unsigned i = 0; i < 2 * slots_; ++i) {
      auto b = pool.allocate(req_);
      if (!b.ok()) return b.status();
      bufs_.push_back(std::move(b).value());
    }
    std::uint64_t x = 88172645463325252ull;
    for (unsigned i = 0; i < slots_; ++i) {
      auto* p = bufs_[i].as<std::uint64_t>();
      for (std::size_t k = 0; k < req_ / 8; ++k) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        p[k] = x;
      }
    }
    return {};
  }

  // Returns seconds, or an error (I/O or verification).
  Result<double> run(IoOpKind op) {
    const std::uint64_t requests = (size_ + req_ - 1) / req_;
    slot_req_.assign(slots_, kNone);
    if (op == IoOpKind::kWrite) written_from_.assign(requests, 0);
    free_.clear();
    for (unsigned i = 0; i < slots_; ++i) free_.push_back(i);
    error_ = Status();
    Status verify_error;
    auto t0 = std::chrono::steady_clock::now();
    for (std::uint64_t k = 0; k < requests; ++k) {
      unsigned slot = take_slot();
      if (!error_ok()) break;
      if (op == IoOpKind::kRead && slot_req_[slot] != kNone && verify_error.ok())
        verify_error = verify(slot, slot_req_[slot]);
      slot_req_[slot] = k;
      const std::uint64_t off = k * req_, len = std::min(req_, size_ - off);
      void* buf;
      if (op == IoOpKind::kWrite) {
        buf = bufs_[slot].data();
        written_from_[k] = slot;
        auto* p = static_cast<unsigned char*>(buf);
        for (std::uint64_t s = 0; s < len; s += 4096) {
          std::uint64_t v = stamp(off + s);
          std::memcpy(p + s, &v, 8);
        }
      } else {
        buf = bufs_[slots_ + slot].data();
      }
      e_.submit({op, &f_, off, len, buf}, [this, slot](const Status& st) { give_back(slot, st); });
    }
    Status st = e_.wait_all();
    auto t1 = std::chrono::steady_clock::now();
    if (!st.ok()) return st;
    if (!error_ok()) return error_;
    if (op == IoOpKind::kRead) {
      for (unsigned s = 0; s < slots_ && verify_error.ok(); ++s)
        if (slot_req_[s] != kNone) verify_error = verify(s, slot_req_[s]);
      if (!verify_error.ok()) return verify_error;
    }
    return std::chrono::duration<double>(t1 - t0).count();
  }

 private:
  static constexpr std::uint64_t kNone = ~std::uint64_t{0};

  unsigned take_slot() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !free_.empty() || !error_.ok(); });
    if (free_.empty()) return 0;
    unsigned s = free_.back();
    free_.pop_back();
    return s;
  }
  // Runs on the I/O thread: return the slot and wake the submitter.
  void give_back(unsigned slot, const Status& st) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back(slot);
      if (!st.ok() && error_.ok()) error_ = st;
    }
    cv_.notify_one();
  }
  bool error_ok() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_.ok();
  }
  // Request k was written from buffer written_from_[k] with its own stamps;
  // the stamps overwrite only the first 8 bytes of each 4 KiB, so the rest of
  // that buffer is still the reference.
  Status verify(unsigned slot, std::uint64_t k) {
    const auto* got = static_cast<const unsigned char*>(bufs_[slots_ + slot].data());
    const auto* ref = static_cast<const unsigned char*>(bufs_[written_from_[k]].data());
    const std::uint64_t off = k * req_, len = std::min(req_, size_ - off);
    for (std::uint64_t s = 0; s < len; s += 4096) {
      std::uint64_t v;
      std::memcpy(&v, got + s, 8);
      if (v != stamp(off + s) || std::memcmp(got + s + 8, ref + s + 8, 4088) != 0)
        return Status(StatusCode::kCorrupt, fmt::format("verification failed: the 4 KiB at offset {} of {} read back "
                                                        "different bytes than were written",
                                                        off + s, f_.path()));
    }
    return {};
  }

  IoEngine& e_;
  io::IoFile& f_;
  std::uint64_t size_, req_;
  unsigned slots_;
  std::vector<io::PinnedBuffer> bufs_;
  std::vector<std::uint64_t> slot_req_;      // request each slot holds
  std::vector<std::uint32_t> written_from_;  // write buffer of each request
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<unsigned> free_;
  Status error_;
};

// Runs one backend; kUnavailable when it does not start here.
Status bench_backend(const BenchIoOptions& o, const std::string& backend, std::uint64_t size, std::uint64_t block,
                     std::uint64_t request, std::vector<BenchResult>* out) {
  io::IoEngineOptions eo;
  eo.backend = backend;
  eo.allow_fallback = false;
  eo.queue_depth = o.qd;
  eo.block_bytes = block;
  STRATA_ASSIGN_OR_RETURN(auto engine, io::make_io_engine(eo));
  const unsigned slots = Runner::slots_for(size, block, request, o.qd);
  io::PinnedPoolOptions po;
  po.budget_bytes = 2ull * slots * request + (4ull << 20);
  po.slab_bytes = std::min<std::uint64_t>(2ull * slots * request, 256ull << 20);
  po.registrars = {engine->buffer_registrar()};
  STRATA_ASSIGN_OR_RETURN(auto pool, io::PinnedPool::create(po));
  const std::string path = fmt::format("{}/strata-bench-io.{}.{}.dat", o.dir, backend, ::getpid());
  if (!o.keep && !CleanupOnSignal::arm(path))
    return Status(StatusCode::kInvalidArgument, "the path " + path + " is too long");
  io::IoOpenOptions fo;
  fo.write = fo.create = fo.truncate = true;
  auto opened = engine->open(path, fo);
  if (!opened.ok()) {
    CleanupOnSignal::disarm();  // not ours to remove (an existing file we could not open)
    return opened.status();
  }
  auto file = std::move(opened).value();
  Status st = [&]() -> Status {
    if (!file->direct()) return Status(StatusCode::kUnavailable, "the filesystem of " + o.dir + " refuses O_DIRECT");
    // Like fio, lay the file out first so that writes do not also allocate.
    STRATA_RETURN_IF_ERROR(file->preallocate(0, size));
    Runner r(*engine, *file, size, block, request, o.qd);
    STRATA_RETURN_IF_ERROR(r.prepare(*pool));
    for (IoOpKind op : {IoOpKind::kWrite, IoOpKind::kRead}) {
      // Untimed: flush the device's write cache between the phases, as the
      // fio script's `sync` does, so reads do not start against a dirty cache.
      if (op == IoOpKind::kRead) STRATA_RETURN_IF_ERROR(file->sync());
      STRATA_ASSIGN_OR_RETURN(double secs, r.run(op));
      BenchResult res{backend, io::io_op_name(op), block, size, request, o.qd, secs, engine->stats()};
      out->push_back(res);
      if (!o.json)
        std::printf("%-6s %-5s  %10s  block %-8s qd %-4u %8.3f s  %7.3f GB/s\n", backend.c_str(), res.op.c_str(),
                    format_bytes(size).c_str(), format_bytes(block).c_str(), o.qd, secs, res.gbps());
      std::fflush(stdout);
    }
    return {};
  }();
  file.reset();
  if (!o.keep) ::unlink(path.c_str());
  CleanupOnSignal::disarm();
  return st;
}

void run_bench_io(const BenchIoOptions& o) {
  auto fail = [](int code, const std::string& msg) {
    std::fprintf(stderr, "strata bench io: %s\n", msg.c_str());
    set_exit_code(code);
  };
  struct stat st {};
  if (o.dir.empty()) return fail(1, "--dir is required");
  if (::stat(o.dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return fail(1, "--dir " + o.dir + " is not an existing directory");
  auto size = parse_bytes(o.size);
  auto block = parse_bytes(o.block);
  if (!size.ok()) return fail(1, "--size: " + size.status().message());
  if (!block.ok()) return fail(1, "--block: " + block.status().message());
  if (*size == 0) return fail(1, "--size must be more than 0 bytes");
  if (*block == 0) return fail(1, "--block must be more than 0 bytes");
  if (*block % 4096 != 0 || *block > (64ull << 20))
    return fail(1, "--block " + o.block + ": must be a multiple of 4 KiB, at most 64 MiB (O_DIRECT)");
  if (*size % *block != 0) return fail(1, fmt::format("--size {} is not a multiple of --block {}", o.size, o.block));
  auto request = parse_bytes(o.request);
  if (!request.ok()) return fail(1, "--request: " + request.status().message());
  // Default 8 MiB, but never smaller than a block; rounded down to blocks.
  std::uint64_t req = std::max<std::uint64_t>(*request, *block) / *block * *block;
  if (req > (1ull << 30)) return fail(1, "--request " + o.request + ": at most 1 GiB");
  if (o.qd < 1 || o.qd > 4096) return fail(1, fmt::format("--qd {}: expected 1..4096", o.qd));
  std::vector<std::string> backends;
  if (o.backend == "all")
    backends = io::io_backends_built();
  else if (o.backend == "uring" || o.backend == "aio" || o.backend == "posix")
    backends = {o.backend};
  else
    return fail(1, "--backend " + o.backend + ": expected uring, aio, posix or all");
  // Every backend's buffers (the pinned pool) live at once during its run:
  // never ask for more than half of this machine's memory (an OOM kill
  // would leave the test file behind).
  {
    const std::uint64_t pool = 2ull * Runner::slots_for(*size, *block, req, o.qd) * req;
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    const std::uint64_t phys = pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * page : 0;
    if (phys > 0 && pool > phys / 2)
      return fail(1, fmt::format("--qd {} x --block {} (in --request {} pieces) needs {} of buffers, more than "
                                 "half of this machine's {} of memory: lower --qd, --block or --request",
                                 o.qd, o.block, format_bytes(req), format_bytes(pool), format_bytes(phys)));
  }
  // Free space for the file plus a margin. Filesystems that do not count
  // blocks (ramfs: f_blocks == 0) report 0 free: no check there.
  constexpr std::uint64_t kMargin = 64ull << 20;
  struct statvfs vfs {};
  if (::statvfs(o.dir.c_str(), &vfs) == 0 && vfs.f_blocks > 0) {
    const std::uint64_t avail = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (*size > avail || avail - *size < kMargin)
      return fail(1, fmt::format("{} has {} free, not enough for a {} test file and a {} margin", o.dir,
                                 format_bytes(avail), o.size, format_bytes(kMargin)));
  }
  CleanupOnSignal cleanup;

  std::vector<BenchResult> results;
  nlohmann::json skipped = nlohmann::json::array();
  for (const auto& b : backends) {
    Status s = bench_backend(o, b, *size, *block, req, &results);
    if (s.ok()) continue;
    if (s.code() == StatusCode::kUnavailable && o.backend == "all") {
      skipped.push_back({{"backend", b}, {"reason", s.message()}});
      if (!o.json) std::printf("%-6s skipped: %s\n", b.c_str(), s.message().c_str());
      continue;
    }
    return fail(s.code() == StatusCode::kCorrupt || s.code() == StatusCode::kInternal ? 2 : 1,
                b + ": " + s.to_string());
  }
  if (results.empty()) {
    std::string why;
    for (const auto& k : skipped)
      why += (why.empty() ? "" : "; ") + k["backend"].get<std::string>() + ": " + k["reason"].get<std::string>();
    return fail(1, "no backend could run in " + o.dir + " (" + why + ")");
  }
  if (o.json) {
    nlohmann::json j;
    j["dir"] = o.dir;
    j["verified"] = true;
    j["results"] = nlohmann::json::array();
    for (const auto& r : results)
      j["results"].push_back({{"backend", r.backend},
                              {"op", r.op},
                              {"block_bytes", r.block},
                              {"queue_depth", r.qd},
                              {"request_bytes", r.request},
                              {"bytes", r.bytes},
                              {"seconds", r.seconds},
                              {"gbps", r.gbps()},
                              {"engine",
                               {{"pieces", r.stats.pieces},
                                {"submit_calls", r.stats.submit_calls},
                                {"fixed_buffer_pieces", r.stats.fixed_buffer_pieces},
                                {"buffered_pieces", r.stats.buffered_pieces},
                                {"resubmissions", r.stats.resubmissions}}}});
    if (!skipped.empty()) j["skipped"] = skipped;
    std::printf("%s\n", j.dump(2).c_str());
  }
}

}  // namespace

Result<IoCeiling> measure_read_ceiling(const std::string& dir, std::uint64_t bytes) {
  BenchIoOptions o;
  o.dir = dir;
  o.json = true;  // quiet
  const std::uint64_t block = 1ull << 20, request = 8ull << 20;
  std::vector<BenchResult> res;
  auto st = bench_backend(o, "uring", bytes, block, request, &res);
  if (st.code() == StatusCode::kUnavailable) {
    res.clear();
    st = bench_backend(o, "aio", bytes, block, request, &res);
  }
  STRATA_RETURN_IF_ERROR(st);
  IoCeiling c;
  for (const BenchResult& r : res) (r.op == "read" ? c.read_gbps : c.write_gbps) = r.gbps();
  return c;
}

void register_bench_io(CLI::App& bench) {
  auto o = std::make_shared<BenchIoOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "io", "O_DIRECT sequential write then read (verified) per I/O backend; compare with scripts/bench_io_fio.sh");
  cmd->add_option("--dir", o->dir, "Directory for the test file (on the SSD to measure)");
  cmd->add_option("--size", o->size, "File size (2GiB, 512MiB, ...)")->capture_default_str();
  cmd->add_option("--block", o->block, "Size of each I/O the device sees (fio's bs: 1MiB, 128KiB, ...)")
      ->capture_default_str();
  cmd->add_option("--qd", o->qd, "Block-sized I/Os in flight (fio's iodepth)")->capture_default_str();
  cmd->add_option("--request", o->request,
                  "Bytes per engine request; the engine splits it into --block pieces (--request=--block: one "
                  "request per block)")
      ->capture_default_str();
  cmd->add_option("--backend", o->backend, "uring|aio|posix|all")->capture_default_str();
  cmd->add_flag("--json", o->json, "One JSON object with a `results` list");
  cmd->add_flag("--keep", o->keep, "Keep the test files");
  cmd->callback([o] { run_bench_io(*o); });
}

}  // namespace strata::tools
