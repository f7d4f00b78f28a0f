#include "io/swap_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <new>

#include "common/crc32c.h"
#include "common/json.h"
#include "common/log.h"
#include "common/posix_file.h"
#include "common/units.h"

namespace strata::io {
namespace {

constexpr const char* kScratchMarker = ".strata-scratch";
constexpr const char* kRunMarker = ".strata-run";
// "<prefix><pid>-<run name>": a run directory being made (see add below).
constexpr const char* kStagingPrefix = ".strata-run-staging-";

// mkdir -p; `made` (outermost first) gets the directories this call created.
Status make_dirs(const std::string& path, mode_t mode, std::vector<std::string>* made) {
  std::string cur;
  std::size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    cur = path.substr(0, pos);
    if (cur.empty()) continue;
    if (::mkdir(cur.c_str(), mode) == 0)
      made->push_back(cur);
    else if (errno != EEXIST)
      return Status::from_errno(errno, "creating directory " + cur + " failed");
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Status::from_errno(errno, "creating directory " + path + " failed");
  if (!S_ISDIR(st.st_mode)) return Status::from_errno(ENOTDIR, "creating directory " + path + " failed");
  return {};
}

Status write_marker(const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return Status::from_errno(errno, "creating " + path + " failed");
  static const char text[] = "Strata scratch space: Strata may create and remove run directories here.\n";
  ssize_t w = ::write(fd, text, sizeof(text) - 1);
  int err = errno;
  ::close(fd);
  if (w < 0) return Status::from_errno(err, "writing " + path + " failed");
  return {};
}

std::string host_name() {
  char h[256] = {0};
  if (::gethostname(h, sizeof h - 1) != 0) return "?";
  return h;
}

// The run marker says whose directory this is, so that a later run can tell
// a crashed run's leftovers from a live run's files.
// This process's PID namespace ("pid:[4026531836]"; "" when unreadable): a
// pid means something only inside it (containers sharing a host name and a
// scratch directory each have their own).
std::string pid_namespace() {
  char buf[128] = {0};
  const ssize_t n = ::readlink("/proc/self/ns/pid", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

Status write_run_marker(const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Status::from_errno(errno, "creating " + path + " failed");
  const std::string ns = pid_namespace();
  const std::string text = fmt::format("Strata run directory\nhost {}\npid {}\n{}", host_name(), ::getpid(),
                                       ns.empty() ? std::string() : "pidns " + ns + "\n");
  ssize_t w = ::write(fd, text.data(), text.size());
  int err = errno;
  ::close(fd);
  if (w < 0) return Status::from_errno(err, "writing " + path + " failed");
  return {};
}

// True when `run_dir` belongs to a process of this host that no longer
// exists: a run killed before it could remove its files (SIGKILL, OOM, power
// loss). A live process, another host, another PID namespace (a container:
// its pids are not ours to test), an older marker without owner, or
// anything unreadable counts as not stale: when in doubt, keep the files.
bool run_dir_is_stale(const std::string& run_dir) {
  std::FILE* f = std::fopen((run_dir + "/" + kRunMarker).c_str(), "r");
  if (!f) return false;
  char line[512];
  std::string host, ns;
  long pid = 0;
  while (std::fgets(line, sizeof line, f)) {
    char buf[300];
    long p = 0;
    if (std::sscanf(line, "host %299s", buf) == 1) host = buf;
    if (std::sscanf(line, "pidns %299s", buf) == 1) ns = buf;
    if (std::sscanf(line, "pid %ld", &p) == 1) pid = p;
  }
  std::fclose(f);
  if (pid <= 0 || host.empty() || host != host_name()) return false;
  if (!ns.empty() && ns != pid_namespace()) return false;
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

uint64_t tree_bytes(const std::string& path) {
  uint64_t total = 0;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(path, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) == 0 && S_ISREG(st.st_mode))
      total += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return total;
}

std::string default_run_name() {
  static std::atomic<unsigned> counter{0};
  auto ns = std::chrono::steady_clock::now().time_since_epoch().count();
  return fmt::format("strata-run-{}-{:x}-{}", ::getpid(), static_cast<unsigned long long>(ns) & 0xffffff,
                     counter.fetch_add(1));
}

}  // namespace

Result<std::unique_ptr<SwapStore>> SwapStore::create(IoEngine& engine, const SwapStoreOptions& options) {
  if (options.dirs.empty()) return Status(StatusCode::kInvalidArgument, "swap store: no directory given");
  if (options.stripe_bytes == 0 || options.stripe_bytes % 4096 != 0)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("swap store: stripe size {} is not a positive multiple of 4096", options.stripe_bytes));
  if (options.rank < 0) return Status(StatusCode::kInvalidArgument, "swap store: negative rank");
  const std::uint64_t cb = options.checksum_block;
  if (cb != 0 && (cb < 4096 || (cb & (cb - 1)) != 0))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("swap store: checksum block {} is not a power of two of at least 4096 bytes", cb));
  SwapStoreOptions o = options;
  // Absolute now: a caller that changes its working directory later must
  // not make close() remove files in another directory (or none).
  for (auto& d : o.dirs) {
    std::error_code ec;
    std::filesystem::path abs = std::filesystem::absolute(d, ec);
    if (ec)
      return Status(StatusCode::kInvalidArgument, fmt::format("swap store: directory {}: {}", d, ec.message()));
    // Not lexically_normal(): "link/.." is where the kernel says, not the
    // link's directory.
    if (!abs.has_filename() && abs.has_relative_path()) abs = abs.parent_path();  // "dir/" -> "dir"
    d = abs.string();
  }
  if (o.run_name.empty()) o.run_name = default_run_name();
  if (o.run_name.find('/') != std::string::npos || o.run_name == "." || o.run_name == "..")
    return Status(StatusCode::kInvalidArgument, "swap store: bad run name '" + o.run_name + "'");
  std::unique_ptr<SwapStore> store(new SwapStore(engine, o));
  store->stripes_.resize(o.dirs.size());
  for (std::size_t i = 0; i < o.dirs.size(); ++i) {
    Status st = store->prepare_dir(o.dirs[i], &store->stripes_[i]);
    if (!st.ok()) {
      (void)store->close();  // removes what was created so far
      return st;
    }
    Stripe& s = store->stripes_[i];
    s.path = fmt::format("{}/rank{:05d}.stripe{}.swap", s.run_dir, o.rank, i);
    IoOpenOptions fo;
    fo.write = fo.create = fo.exclusive = true;
    fo.mode = 0600;
    auto f = engine.open(s.path, fo);
    if (!f.ok()) {
      s.path.clear();
      (void)store->close();
      return f.status().with_context("swap store");
    }
    s.file = std::move(f).value();
  }
  return store;
}

Status SwapStore::prepare_dir(const std::string& dir_in, Stripe* s) {
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT) return Status::from_errno(errno, "scratch directory " + dir);
    // Made here (DeepSpeed makes a missing nvme_path too), and removed by
    // close() when nothing else is left in it: a mistyped path leaves nothing.
    STRATA_RETURN_IF_ERROR(make_dirs(dir, 0700, &made_dirs_).with_context("scratch directory"));
    STRATA_RETURN_IF_ERROR(write_marker(dir + "/" + kScratchMarker).with_context("scratch directory"));
  } else if (!S_ISDIR(st.st_mode)) {
    return Status(StatusCode::kInvalidArgument,
                  "scratch directory " + dir + ": exists and is not a directory (Not a directory)");
  } else {
    STRATA_ASSIGN_OR_RETURN(std::vector<std::string> names, list_dir(dir));
    // A file system's root (a mounted NVMe drive, DeepSpeed's usual
    // nvme_path) holds lost+found: empty for this purpose.
    std::erase(names, std::string("lost+found"));
    const bool ours = std::find(names.begin(), names.end(), kScratchMarker) != names.end();
    if (!ours && !names.empty() && !options_.reuse_nonempty_dirs) {
      return Status(StatusCode::kAlreadyExists,
                    fmt::format("scratch directory {} is not empty (it holds {}{}) and was not made by Strata (it "
                                "has no {} marker): give an empty or new directory, such as {}/strata (Strata "
                                "makes it)",
                                dir, clip_for_message(names.front()), names.size() > 1 ? ", ..." : "",
                                kScratchMarker, dir == "/" ? "" : dir));
    }
    if (!ours && names.empty())
      STRATA_RETURN_IF_ERROR(write_marker(dir + "/" + kScratchMarker).with_context("scratch directory"));
    // Leftovers of runs that did not shut down cleanly: those of dead
    // processes on this host are removed (their space would otherwise leak
    // on every crash); any other is reported and kept.
    std::vector<std::string> kept;
    uint64_t freed = 0;
    int removed = 0;
    for (const auto& n : names) {
      if (n.rfind(kStagingPrefix, 0) == 0) {
        // A run directory its maker never finished: removed once that
        // process is gone (the pid is in the name; the marker may be absent).
        const long pid = std::strtol(n.c_str() + std::strlen(kStagingPrefix), nullptr, 10);
        if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
          std::error_code ec;
          std::filesystem::remove_all(dir + "/" + n, ec);
        }
        continue;
      }
      if (n.rfind("strata-run-", 0) != 0 || n == options_.run_name) continue;
      const std::string path = dir + "/" + n;
      if (run_dir_is_stale(path)) {
        const uint64_t bytes = tree_bytes(path);
        std::error_code ec;
        std::filesystem::remove_all(path, ec);
        if (!ec) {
          freed += bytes;
          ++removed;
          continue;
        }
        log_warn("scratch directory {}: could not remove {} of a dead run: {}", dir, n, ec.message());
      }
      kept.push_back(n);
    }
    if (removed > 0)
      log_info("scratch directory {}: removed {} run director{} of processes that no longer exist ({})", dir,
               removed, removed == 1 ? "y" : "ies", format_bytes(freed));
    if (!kept.empty())
      log_warn(
          "scratch directory {} holds {} run director{} of other runs, live or on another host (e.g. {}); "
          "remove them when those runs are gone to free the space",
          dir, kept.size(), kept.size() == 1 ? "y" : "ies", kept.front());
  }
  // The run directory appears with its marker or not at all: it is made
  // under a staging name, marked, then renamed. A process killed in between
  // leaves only a staging directory whose name carries its pid (removed
  // below by the next run), never an unmarked run directory that no later
  // run could tell from a live one.
  s->run_dir = dir + "/" + options_.run_name;
  const std::string staging = fmt::format("{}/{}{}-{}", dir, kStagingPrefix, ::getpid(), options_.run_name);
  if (::mkdir(staging.c_str(), 0700) != 0) {
    const int err = errno;
    s->run_dir.clear();
    return Status::from_errno(err, "creating run directory " + staging + " failed");
  }
  if (Status st = write_run_marker(staging + "/" + kRunMarker); !st.ok()) {
    std::error_code ec;
    std::filesystem::remove_all(staging, ec);
    s->run_dir.clear();
    return st.with_context("swap store");
  }
  if (::rename(staging.c_str(), s->run_dir.c_str()) != 0) {
    const int err = errno;
    std::error_code ec;
    std::filesystem::remove_all(staging, ec);
    // Ranks of one job may share a run name: the directory is then theirs.
    const bool shared =
        (err == EEXIST || err == ENOTEMPTY) && ::access((s->run_dir + "/" + kRunMarker).c_str(), F_OK) == 0;
    if (!shared) {
      std::string path = s->run_dir;
      s->run_dir.clear();
      return Status::from_errno(err, "creating run directory " + path + " failed");
    }
  }
  return {};
}

std::uint64_t SwapStore::file_bytes_for(std::size_t i, std::uint64_t space) const {
  const std::uint64_t stripe = options_.stripe_bytes;
  const std::uint64_t round = stripe * stripes_.size();
  const std::uint64_t full = space / round * stripe;
  const std::uint64_t rem = space % round;
  const std::uint64_t start = i * stripe;
  return full + (rem > start ? std::min(rem - start, stripe) : 0);
}

Result<SwapTensor> SwapStore::add_tensor(std::string_view name, std::uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return Status(StatusCode::kInvalidArgument, "swap store: add_tensor after close");
  const std::uint64_t base = (end_ + 4095) / 4096 * 4096;
  // Files are addressed with off_t: the space must end below 2^63.
  constexpr std::uint64_t kMaxSpace = std::uint64_t{1} << 62;
  if (bytes > kMaxSpace || base + bytes > kMaxSpace)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("swap store: tensor '{}' of {} bytes does not fit: the store holds at most {} bytes",
                              name, bytes, kMaxSpace));
  const std::uint64_t new_end = base + bytes;
  for (std::size_t i = 0; i < stripes_.size(); ++i) {
    Stripe& s = stripes_[i];
    const std::uint64_t need = file_bytes_for(i, new_end);
    if (need <= s.size) continue;
    Status st = s.file->preallocate(s.size, need - s.size);
    if (!st.ok()) return st.with_context(fmt::format("swap store: adding tensor '{}' of {} bytes", name, bytes));
    s.size = need;
  }
  TensorInfo info;
  info.name = name;
  if (const std::uint64_t b = options_.checksum_block; b != 0) {
    // Unwritten blocks read as the zeros preallocation leaves.
    info.blocks = (bytes + b - 1) / b;
    try {
      info.crcs = std::make_unique<std::uint32_t[]>(info.blocks);
    } catch (const std::bad_alloc&) {
      return Status(StatusCode::kOutOfMemory,
                    fmt::format("swap store: no memory for the {} checksums of tensor '{}'", info.blocks, name));
    }
    const std::vector<char> zeros(b, 0);
    const std::uint32_t zero_crc = crc32c(zeros.data(), b);
    std::fill_n(info.crcs.get(), info.blocks, zero_crc);
    if (bytes % b != 0) info.crcs[info.blocks - 1] = crc32c(zeros.data(), bytes % b);
  }
  end_ = new_end;
  SwapTensor t;
  t.id = next_id_++;
  t.base = base;
  t.bytes = bytes;
  tensors_.push_back(std::move(info));
  return t;
}

std::uint32_t* SwapStore::crcs_of(const SwapTensor& t) const {
  std::lock_guard<std::mutex> lock(mu_);
  return t.id < tensors_.size() ? tensors_[t.id].crcs.get() : nullptr;
}

std::uint64_t SwapStore::block_count(const SwapTensor& t) const {
  const std::uint64_t b = options_.checksum_block;
  return b == 0 ? 0 : (t.bytes + b - 1) / b;
}

std::uint64_t SwapStore::checksum_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::uint64_t n = 0;
  for (const TensorInfo& i : tensors_) n += i.blocks * sizeof(std::uint32_t);
  return n;
}

std::string SwapStore::place_of(std::uint64_t v) const {
  const std::uint64_t stripe = options_.stripe_bytes;
  const std::uint64_t n = stripes_.size();
  const std::uint64_t chunk = v / stripe;
  return fmt::format("{} offset {}", stripes_[chunk % n].path, chunk / n * stripe + v % stripe);
}

Status SwapStore::mismatch(const SwapTensor& t, std::uint64_t block, std::uint32_t found, std::uint32_t expected,
                           const char* what) const {
  const std::uint64_t b = options_.checksum_block;
  const std::uint64_t begin = block * b, end = std::min(t.bytes, begin + b);
  std::string name;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (t.id < tensors_.size()) name = tensors_[t.id].name;
  }
  return Status(StatusCode::kCorrupt,
                fmt::format("swap store: {} bytes [{}, {}) of tensor '{}' ({}): CRC32C 0x{:08x}, but Strata wrote "
                            "bytes with CRC32C 0x{:08x}; the swap file changed after it was written (a failing "
                            "disk, or another process writing to it)",
                            what, begin, end, name, place_of(t.base + begin), found, expected));
}

Status SwapStore::verify_checksums(const SwapTensor& t, std::span<const std::uint32_t> crcs) const {
  const std::uint32_t* table = crcs_of(t);
  if (!table || crcs.size() != block_count(t))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("swap store: verify_checksums with {} checksums for tensor {} ({} blocks{})", crcs.size(),
                              t.id, block_count(t), table ? "" : ", checksums off"));
  for (std::size_t i = 0; i < crcs.size(); ++i)
    if (crcs[i] != table[i]) return mismatch(t, i, crcs[i], table[i], "copying");
  return {};
}

Status SwapStore::set_checksums(const SwapTensor& t, std::span<const std::uint32_t> crcs) {
  std::uint32_t* table = crcs_of(t);
  if (!table || crcs.size() != block_count(t))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("swap store: set_checksums with {} checksums for tensor {} ({} blocks{})", crcs.size(),
                              t.id, block_count(t), table ? "" : ", checksums off"));
  std::copy(crcs.begin(), crcs.end(), table);
  return {};
}

std::uint64_t SwapStore::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return end_;
}

IoHandle SwapStore::transfer(IoOpKind op, const SwapTensor& t, std::uint64_t offset, std::uint64_t length, void* buffer,
                             IoCallback callback) {
  if (offset > t.bytes || length > t.bytes - offset || t.base + t.bytes > reserved_bytes()) {
    return engine_.submit_failed(
        Status(StatusCode::kInvalidArgument,
               fmt::format("swap store: {} of {} bytes at offset {} is outside tensor {} ({} bytes)", io_op_name(op),
                           length, offset, t.id, t.bytes)),
        std::move(callback));
  }
  std::uint32_t* table = nullptr;
  if (const std::uint64_t b = options_.checksum_block; b != 0 && length > 0) {
    table = crcs_of(t);
    if (offset % b != 0 || (length % b != 0 && offset + length != t.bytes) || !table) {
      return engine_.submit_failed(
          Status(StatusCode::kInvalidArgument,
                 fmt::format("swap store: {} of {} bytes at offset {} in tensor {} does not cover whole {}-byte "
                             "checksum blocks",
                             io_op_name(op), length, offset, t.id, b)),
          std::move(callback));
    }
    // The table says what Strata last meant the disk to hold, from the moment
    // the write is submitted: a write that fails leaves blocks that no longer
    // match, so a later read of them fails instead of returning stale bytes.
    if (op == IoOpKind::kWrite) crc32c_blocks(buffer, length, b, table + offset / b);
  }
  const std::uint64_t stripe = options_.stripe_bytes;
  const std::uint64_t n = stripes_.size();
  std::vector<IoRequest> parts;
  std::uint64_t v = t.base + offset;
  std::uint64_t left = length;
  char* buf = static_cast<char*>(buffer);
  while (left > 0) {
    const std::uint64_t chunk = v / stripe;
    const std::uint64_t within = v % stripe;
    const std::uint64_t len = std::min(left, stripe - within);
    IoFile* file = stripes_[chunk % n].file.get();
    const std::uint64_t file_off = chunk / n * stripe + within;
    // With one directory consecutive chunks are contiguous: one request.
    if (!parts.empty() && parts.back().file == file && parts.back().offset + parts.back().length == file_off)
      parts.back().length += len;
    else
      parts.push_back(IoRequest{op, file, file_off, len, buf});
    v += len;
    buf += len;
    left -= len;
  }
  // Count this store's requests so close() waits for exactly them. The
  // counter is shared with the callback, which may still be returning on the
  // I/O thread after close() has seen zero and the store is gone.
  inflight_->fetch_add(1);
  auto counter = inflight_;
  // Memory refused from here to the submit (the check, the engine's request):
  // nothing was submitted, so the callback that uncounts it never runs.
  try {
    IoCheck check;
    if (table && op == IoOpKind::kRead) {
      check = [this, t, offset, length, buffer, table]() -> Status {
        const std::uint64_t b = options_.checksum_block;
        const char* p = static_cast<const char*>(buffer);
        std::uint32_t got[48];  // a multiple of 3: crc32c_blocks runs three blocks at once
        for (std::uint64_t done = 0; done < length;) {
          const std::uint64_t n = std::min<std::uint64_t>(length - done, b * 48);
          crc32c_blocks(p + done, n, b, got);
          for (std::uint64_t i = 0; i < (n + b - 1) / b; ++i) {
            const std::uint64_t block = (offset + done) / b + i;
            if (got[i] != table[block]) return mismatch(t, block, got[i], table[block], "reading");
          }
          done += n;
        }
        return {};
      };
    }
    return engine_.submit_checked(parts, std::move(check), [counter, cb = std::move(callback)](const Status& st) {
      if (cb) cb(st);
      if (counter->fetch_sub(1) == 1) counter->notify_all();
    });
  } catch (const std::bad_alloc&) {
    if (counter->fetch_sub(1) == 1) counter->notify_all();
    throw;
  }
}

IoHandle SwapStore::read(const SwapTensor& t, std::uint64_t offset, std::uint64_t length, void* buffer,
                         IoCallback callback) {
  return transfer(IoOpKind::kRead, t, offset, length, buffer, std::move(callback));
}

IoHandle SwapStore::write(const SwapTensor& t, std::uint64_t offset, std::uint64_t length, const void* buffer,
                          IoCallback callback) {
  return transfer(IoOpKind::kWrite, t, offset, length, const_cast<void*>(buffer), std::move(callback));
}

Result<std::vector<SwapFileRange>> SwapStore::file_ranges(const SwapTensor& t, std::uint64_t offset,
                                                          std::uint64_t length) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return Status(StatusCode::kInvalidArgument, "swap store: file_ranges after close()");
  }
  if (offset > t.bytes || length > t.bytes - offset || t.base + t.bytes > reserved_bytes())
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("swap store: range of {} bytes at offset {} is outside tensor {} ({} bytes)", length,
                              offset, t.id, t.bytes));
  const std::uint64_t stripe = options_.stripe_bytes;
  const std::uint64_t n = stripes_.size();
  std::vector<SwapFileRange> out;
  std::uint64_t v = t.base + offset;
  std::uint64_t left = length;
  while (left > 0) {
    const std::uint64_t chunk = v / stripe;
    const std::uint64_t within = v % stripe;
    const std::uint64_t len = std::min(left, stripe - within);
    const Stripe& s = stripes_[chunk % n];
    const std::uint64_t file_off = chunk / n * stripe + within;
    if (!out.empty() && out.back().path == s.path && out.back().offset + out.back().length == file_off)
      out.back().length += len;
    else
      out.push_back(SwapFileRange{s.path, s.file->buffered_fd(), file_off, len});
    v += len;
    left -= len;
  }
  return out;
}

Status SwapStore::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return {};
    closed_ = true;
  }
  // Requests of this store hold its files; let them finish first.
  std::size_t v;
  while ((v = inflight_->load()) != 0) inflight_->wait(v);
  Status first;
  auto note = [&](Status st) {
    if (first.ok() && !st.ok()) first = std::move(st);
  };
  for (Stripe& s : stripes_) {
    s.file.reset();
    if (!s.path.empty() && ::unlink(s.path.c_str()) != 0 && errno != ENOENT)
      note(Status::from_errno(errno, "removing " + s.path + " failed"));
    if (s.run_dir.empty()) continue;
    // The run directory may be shared with other ranks: remove it (and its
    // marker) only when nothing else is left in it.
    auto names = list_dir(s.run_dir);
    if (names.ok() && (names->empty() || (names->size() == 1 && names->front() == kRunMarker))) {
      ::unlink((s.run_dir + "/" + kRunMarker).c_str());
      if (::rmdir(s.run_dir.c_str()) != 0 && errno != ENOENT && errno != ENOTEMPTY)
        note(Status::from_errno(errno, "removing " + s.run_dir + " failed"));
    }
  }
  // Directories this store made, innermost first, while they hold nothing
  // but the scratch marker (another rank or run still using one keeps it).
  for (auto it = made_dirs_.rbegin(); it != made_dirs_.rend(); ++it) {
    auto names = list_dir(*it);
    if (!names.ok()) break;
    if (names->size() == 1 && names->front() == kScratchMarker) ::unlink((*it + "/" + kScratchMarker).c_str());
    if (::rmdir(it->c_str()) != 0) break;
  }
  made_dirs_.clear();
  return first;
}

SwapStore::~SwapStore() {
  Status st = close();
  if (!st.ok()) log_error("swap store: {}", st.to_string());
}

}  // namespace strata::io
