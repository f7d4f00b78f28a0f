#include "train/run_dir.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "common/json.h"
#include "common/log.h"
#include "common/posix_file.h"
#include "model/safetensors.h"
#include "runtime/checkpoint.h"

namespace strata::train {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kLockFile = ".strata.lock";
constexpr const char* kRunFile = "run.json";
constexpr const char* kCheckpointPrefix = "checkpoint-";

std::string this_host() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

// 128 random bits as hex: unique across machines and restarts.
std::string new_run_id() {
  std::random_device rd;
  std::mt19937_64 g((uint64_t(rd()) << 32) ^ rd() ^ uint64_t(std::chrono::system_clock::now().time_since_epoch().count()));
  return fmt::format("{:016x}{:016x}", g(), g());
}

std::string utc_now() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

bool process_alive(long pid) { return pid > 0 && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM); }

// "<n>" of "checkpoint-<n>" when it is all digits and fits 63 bits.
bool parse_step(const std::string& name, uint64_t* step) {
  if (name.rfind(kCheckpointPrefix, 0) != 0) return false;
  const std::string num = name.substr(std::char_traits<char>::length(kCheckpointPrefix));
  if (num.empty() || num.size() > 18 || num.find_first_not_of("0123456789") != std::string::npos) return false;
  *step = std::stoull(num);
  return true;
}

// Whether a metrics file records nothing trained: empty, or only the lines a
// run writes before its first step (its plan, the step-0 evaluation), as a
// run that failed (an error, a crash, kill -9) before step 1 leaves it. Any
// other file (another line, a blank one, unreadable, larger than such a file
// can be, not a regular file) counts as a run's, as every non-empty file did
// before: --overwrite removes it, and the trainer's open_metrics() refuses to
// replace one that is not Strata's.
bool trained_nothing(const fs::path& path) {
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);  // fails on a FIFO: never opened
  if (ec || size > (1u << 20)) return false;
  std::ifstream f(path, std::ios::binary);
  std::string line;
  while (std::getline(f, line)) {
    json j;
    JsonError err;
    if (!parse_json(line, &j, &err) || !j.is_object()) return false;
    const auto event = j.find("event");
    const auto step = j.find("step");
    if (event == j.end() || !event->is_string()) return false;
    const bool plan = *event == "plan";
    const bool eval_0 = *event == "eval" && step != j.end() && step->is_number_integer() && *step == 0;
    if (!plan && !eval_0) return false;
  }
  return f.eof();
}

}  // namespace

std::vector<CheckpointDirEntry> list_checkpoint_dirs(const std::string& dir) {
  std::vector<CheckpointDirEntry> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    uint64_t step = 0;
    std::error_code dec;
    if (!parse_step(it->path().filename().string(), &step) || !it->is_directory(dec)) continue;
    out.push_back({step, it->path().string()});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  return out;
}

Result<std::string> read_run_id(const std::string& dir) {
  const std::string path = join_path(dir, kRunFile);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ENOENT) return std::string();
    return Status::from_errno(errno, "run file " + path);
  }
  Fd f(fd, /*owned=*/true);
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Status::from_errno(errno, "run file " + path);
  if (!S_ISREG(st.st_mode) || st.st_size > (1 << 20))
    return Status(StatusCode::kCorrupt, "run file " + path + " is not a regular file of at most 1 MiB");
  std::string text(static_cast<size_t>(st.st_size), '\0');
  STRATA_RETURN_IF_ERROR(pread_full(fd, text.data(), text.size(), 0, path));
  json j;
  JsonError err;
  if (!parse_json(text, &j, &err)) return Status(StatusCode::kCorrupt, "run file " + path + ": " + err.message());
  if (!j.is_object() || !j.contains("run_id") || !j["run_id"].is_string())
    return Status(StatusCode::kCorrupt, "run file " + path + ": no \"run_id\" string");
  return j["run_id"].get<std::string>();
}

Result<std::string> checkpoint_run_id(const std::string& checkpoint) {
  CheckpointOpenOptions o;
  o.verify_all = false;  // index and manifest (self-checksummed) only
  STRATA_ASSIGN_OR_RETURN(auto r, CheckpointReader::open(checkpoint, o));
  const std::string& extra = r->info().extra_json;
  if (extra.empty()) return std::string();
  json j = json::parse(extra, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("trainer") || !j["trainer"].is_object())
    return std::string();
  const json& t = j["trainer"];
  return t.contains("run_id") && t["run_id"].is_string() ? t["run_id"].get<std::string>() : std::string();
}

Result<std::unique_ptr<RunDir>> RunDir::open(const std::string& out) {
  std::unique_ptr<RunDir> d(new RunDir());
  d->path_ = out;
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) return Status::from_errno(ec.value(), "out dir " + out + ": cannot create it");
  const std::string lock = lock_path(out);
  // Whether this call made the lock file: if it then fails while holding the
  // lock (a full disk refusing the pid), it removes the file again, so a new
  // OUT it failed in holds nothing (the trainer removes the directory). A job
  // that removes its lock file does so while holding the lock, so a lock taken
  // on a file no longer at `lock` (opened just before the removal) is
  // worthless: the path is opened and locked again.
  bool created = false;
  for (int attempt = 0; attempt < 8; ++attempt) {
    if (d->lock_fd_ >= 0) ::close(d->lock_fd_);
    d->lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    created = d->lock_fd_ >= 0;
    if (d->lock_fd_ < 0 && errno == EEXIST) d->lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (d->lock_fd_ < 0) {
      if (errno == ENOENT) continue;  // removed meanwhile
      return Status::from_errno(errno, "out dir " + out + " is not writable (lock file " + lock + ")");
    }
    if (::flock(d->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err != EWOULDBLOCK) return Status::from_errno(err, "out dir " + out + ": locking " + lock);
      char buf[256] = {};
      const ssize_t n = ::pread(d->lock_fd_, buf, sizeof(buf) - 1, 0);
      std::string holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
      while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
      return Status(StatusCode::kAlreadyExists,
                    fmt::format("out dir {} is in use by another strata job ({}); wait for it to end, or give this "
                                "run another --out",
                                out, holder.empty() ? "its pid is not recorded yet" : holder));
    }
    struct stat held {}, now {};
    if (::fstat(d->lock_fd_, &held) == 0 && ::stat(lock.c_str(), &now) == 0 && held.st_dev == now.st_dev &&
        held.st_ino == now.st_ino)
      break;
    if (attempt == 7)
      return Status(StatusCode::kUnavailable,
                    fmt::format("out dir {}: its lock file {} kept being replaced while locking it", out, lock));
  }
  if (d->lock_fd_ < 0) return Status::from_errno(ENOENT, "out dir " + out + " is not writable (lock file " + lock + ")");
  Status s = d->record_holder();
  if (s.ok()) s = d->remove_leftovers();
  if (s.ok()) {
    auto id = read_run_id(out);
    if (id.ok()) d->run_id_ = std::move(*id);
    s = id.status();
  }
  if (s.ok()) return d;
  if (created) ::unlink(lock.c_str());  // still locked: nobody else holds it
  return s;
}

// Records who holds the lock, for the message another job gets.
Status RunDir::record_holder() {
  const std::string me = fmt::format("pid {} on host {}, since {}", ::getpid(), this_host(), utc_now());
  // A short write (a disk with a few bytes left) sets no errno: say so.
  errno = ENOSPC;
  if (::ftruncate(lock_fd_, 0) != 0 || ::pwrite(lock_fd_, me.data(), me.size(), 0) != ssize_t(me.size()))
    return Status::from_errno(errno, "out dir " + path_ + ": writing " + lock_path(path_));
  holder_ = me;
  return Status();
}

std::string RunDir::read_holder(const std::string& out) {
  const int fd = ::open(lock_path(out).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return "";
  char buf[256] = {};
  const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  ::close(fd);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
}

std::string RunDir::lock_path(const std::string& out) { return join_path(out, kLockFile); }

void RunDir::remove_made(const std::vector<std::string>& made, bool held) {
  if (made.empty()) return;
  const std::string& out = made.back();
  if (held) {
    for (const char* name : {kRunFile, "metrics.jsonl"}) ::unlink(join_path(out, name).c_str());
    ::unlink(lock_path(out).c_str());
  }
  for (auto d = made.rbegin(); d != made.rend() && ::rmdir(d->c_str()) == 0; ++d) {
  }
}

RunDir::~RunDir() {
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flock
}

// Under the lock no other (current) job writes here, so staging directories
// are a dead job's; temp files of atomic writes are removed only when their
// pid is dead.
Status RunDir::remove_leftovers() {
  std::error_code ec;
  std::vector<std::string> checkpoint_dirs;
  for (fs::directory_iterator it(path_, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    for (const char* mark : {".tmp-", ".old-"}) {
      const size_t at = name.find(mark);
      uint64_t step = 0;
      if (at != std::string::npos && parse_step(name.substr(0, at), &step))
        checkpoint_dirs.push_back(join_path(path_, name.substr(0, at)));
    }
  }
  std::sort(checkpoint_dirs.begin(), checkpoint_dirs.end());
  checkpoint_dirs.erase(std::unique(checkpoint_dirs.begin(), checkpoint_dirs.end()), checkpoint_dirs.end());
  for (const std::string& c : checkpoint_dirs) {
    if (Status st = cleanup_checkpoint_leftovers(c); !st.ok())
      return st.with_context("out dir " + path_ + ": removing what an interrupted save left");
    log_info("out dir {}: removed what an interrupted save of {} left", path_, base_of(c));
  }
  // write_file_atomic's "<name>.tmp.<pid>" files of a dead process: OUT's own
  // (run.json, killed mid-write) and the export's.
  for (const std::string& dir : {path_, join_path(path_, "model")})
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const size_t at = name.rfind(".tmp.");
    if (at == std::string::npos) continue;
    const std::string pid = name.substr(at + 5);
    if (pid.empty() || pid.size() > 9 || pid.find_first_not_of("0123456789") != std::string::npos) continue;
    if (process_alive(std::stol(pid))) continue;
    std::error_code rec;
    fs::remove(it->path(), rec);
    if (rec) return Status::from_errno(rec.value(), "removing the interrupted export's " + it->path().string());
    log_info("out dir {}: removed {} (a write interrupted by the death of process {})", path_, name, pid);
  }
  return {};
}

Status RunDir::write_run_json(const std::string& settings_json) {
  json settings = json::parse(settings_json, nullptr, false);
  if (settings.is_discarded()) settings = json::object();
  json j = {{"format", "strata-run"},      {"version", 1},      {"run_id", run_id_},
            {"created", utc_now()},        {"host", this_host()}, {"settings", settings}};
  return model::write_file_atomic(join_path(path_, kRunFile), j.dump(2) + "\n");
}

Status RunDir::start_fresh(bool overwrite, const std::vector<std::pair<std::string, std::string>>& inputs,
                           bool resume_auto) {
  std::vector<std::string> found;
  bool checkpoint = false;  // a checkpoint-<step> to continue from
  std::error_code ec;
  for (fs::directory_iterator it(path_, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    uint64_t step = 0;
    std::error_code sec;
    // A metrics file of no trained step, or a run.json alone: a run that
    // failed before its first step (a bad flag, no GPU, an I/O error in step
    // 1) left nothing worth keeping.
    if (name == "metrics.jsonl" && trained_nothing(it->path())) continue;
    // adapter/: a LoRA run's export, when it holds what one writes (a user's
    // own adapter/ directory is neither counted nor removed).
    const bool adapter = name == "adapter" && (fs::exists(it->path() / "adapter_config.json", sec) ||
                                               fs::exists(it->path() / "adapter_model.safetensors", sec));
    const bool saved = parse_step(name, &step);
    checkpoint = checkpoint || saved;
    if (name == kRunFile || name == "metrics.jsonl" || name == "model" || adapter || saved) found.push_back(name);
  }
  if (found.size() == 1 && found[0] == kRunFile) found.clear();
  if (ec) return Status::from_errno(ec.value(), "out dir " + path_ + ": listing it");
  if (!found.empty()) {
    std::sort(found.begin(), found.end());
    if (!overwrite) {
      const std::string list = names_for_message(found, 6);
      // No checkpoint (the run failed or was killed before its first save):
      // --resume could not continue it.
      if (resume_auto || !checkpoint)
        return Status(StatusCode::kAlreadyExists,
                      fmt::format("{}out dir {} holds an earlier run ({}{}) but no checkpoint to "
                                  "continue from: start over with --overwrite (removes them), or give another --out",
                                  resume_auto ? "--resume auto: " : "", path_, list,
                                  run_id_.empty() ? "" : ", run " + run_id_));
      // A launcher's restart of this job (the same command line again).
      const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
      const bool restarted = restart != nullptr && *restart != '\0' && std::strcmp(restart, "0") != 0;
      return Status(StatusCode::kAlreadyExists,
                    fmt::format("out dir {} holds an earlier run ({}{}): continue it with --resume {}, start over "
                                "with --overwrite (removes them), or give another --out{}",
                                path_, list, run_id_.empty() ? "" : ", run " + run_id_, path_,
                                restarted ? fmt::format(" (torchrun restarted this job, TORCHELASTIC_RESTART_COUNT={}: "
                                                        "--resume auto continues from OUT's newest checkpoint on a "
                                                        "restart)",
                                                        restart)
                                          : ""));
    }
    // Continuing from one's own export (--model OUT/model --out OUT) must
    // not delete it before it is read.
    for (const std::string& name : found) {
      std::error_code cec;
      const fs::path gone = fs::weakly_canonical(join_path(path_, name), cec);
      for (const auto& [flag, input] : inputs) {
        if (input.empty() || cec) continue;
        std::error_code iec;
        const fs::path in = fs::weakly_canonical(input, iec);
        if (iec) continue;
        const fs::path rel = in.lexically_relative(gone);
        if (!rel.empty() && *rel.begin() != "..")
          return Status(StatusCode::kInvalidArgument,
                        fmt::format("--overwrite would remove {}, which holds {} {} (an input of this run): give "
                                    "another --out, or move it out of {} first",
                                    join_path(path_, name), flag, input, path_));
      }
    }
    for (const std::string& name : found) {
      std::error_code rec;
      fs::remove_all(join_path(path_, name), rec);
      if (rec) return Status::from_errno(rec.value(), "--overwrite: removing " + join_path(path_, name));
    }
    log_info("out dir {}: --overwrite removed the earlier run's {} entries", path_, found.size());
  }
  run_id_ = new_run_id();
  return {};
}

Status RunDir::continue_run(const std::string& run_id) {
  if (!run_id_.empty() && !run_id.empty() && run_id_ != run_id)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("out dir {} holds run {}, the checkpoint belongs to run {}: resume into that run's "
                              "own out dir, or use another --out",
                              path_, run_id_, run_id));
  if (!run_id_.empty()) return {};
  // OUT holds no run yet (a new --out for an existing checkpoint, or a run
  // made before run ids): adopt the checkpoint's id, or give it one.
  run_id_ = run_id.empty() ? new_run_id() : run_id;
  return {};
}

Status RunDir::record(const std::string& settings_json) { return write_run_json(settings_json); }

Result<std::string> select_checkpoint(const std::string& from) {
  std::error_code ec;
  // (exists() is false on an error too: a loop of links, a name too long,
  // a directory that may not be searched; named as such, not as missing.)
  const bool there = fs::exists(from, ec);
  if (ec) return Status(StatusCode::kIoError, fmt::format("resume: cannot read {}: {}", from, ec.message()));
  if (!there) return Status(StatusCode::kNotFound, "resume: " + from + " does not exist");
  const bool checkpoint = fs::exists(join_path(from, "index.json"), ec);
  if (ec) return Status(StatusCode::kIoError, fmt::format("resume: cannot read {}: {}", from, ec.message()));
  if (checkpoint) return from;
  STRATA_ASSIGN_OR_RETURN(std::string run, read_run_id(from));
  const auto cks = list_checkpoint_dirs(from);
  if (cks.empty())
    return Status(StatusCode::kNotFound, "resume: " + from + " is neither a checkpoint nor a directory holding "
                                         "checkpoint-<step> directories");
  std::vector<std::string> others;
  std::vector<std::string> rejected;  // "checkpoint-4: why", newest first
  Status damaged;  // the newest checkpoint's, when its index or manifest is damaged
  for (auto it = cks.rbegin(); it != cks.rend(); ++it) {
    if (run.empty()) return it->path;  // a run made before run ids: the newest
    auto id = checkpoint_run_id(it->path);
    if (!id.ok()) {
      if (id.status().code() != StatusCode::kNotFound && id.status().code() != StatusCode::kCorrupt)
        return id.status().with_context("resume: reading " + it->path);
      // A save stages its checkpoint beside the directory and renames it into
      // place whole, so a checkpoint-<step> without its index or manifest
      // (kNotFound) was damaged afterwards (or not written by Strata): like
      // a corrupt one, it is not skipped in silence.
      const Status why = id.status().code() == StatusCode::kNotFound
                             ? Status(StatusCode::kCorrupt, id.status().message() +
                                                                " (a save puts a checkpoint in place whole: this one "
                                                                "lost files since, or Strata did not write it)")
                             : id.status();
      rejected.push_back(fmt::format("{} (damaged: {})", base_of(it->path), why.message()));
      if (damaged.ok()) damaged = why;
      continue;
    }
    if (*id == run && !damaged.ok() && CheckpointReader::open(it->path).ok())
      return Status(damaged.code(), fmt::format("resume: the newest checkpoint is damaged ({}); {} is intact: "
                                                "resume from it with --resume {}",
                                                damaged.message(), it->path, it->path));
    if (*id == run) {
      if (!others.empty())
        log_warn("resume: skipped {} (another run's checkpoints in {})", fmt::join(others, ", "), from);
      return it->path;
    }
    others.push_back(base_of(it->path));
  }
  return Status(StatusCode::kNotFound,
                fmt::format("resume: {} holds no usable checkpoint{}{}{}: start over with --overwrite, or give "
                            "another --out",
                            from, run.empty() ? "" : " of its run " + run,
                            others.empty() ? "" : fmt::format(" (other runs': {})", fmt::join(others, ", ")),
                            rejected.empty() ? "" : fmt::format("; rejected: {}", fmt::join(rejected, "; "))));
}

Status check_same_settings(const std::string& saved_text, const std::string& now_text, const std::string& checkpoint) {
  const json saved = json::parse(saved_text, nullptr, false), now = json::parse(now_text, nullptr, false);
  if (!saved.is_object() || !now.is_object()) return {};
  // Flattened comparison: "schedule.lr", "optimizer.weight_decay", ...
  std::function<Status(const json&, const json&, const std::string&)> cmp = [&](const json& a, const json& b,
                                                                               const std::string& prefix) -> Status {
    for (auto it = a.begin(); it != a.end(); ++it) {
      const std::string key = prefix.empty() ? it.key() : prefix + "." + it.key();
      if (!b.contains(it.key())) continue;
      const json& bv = b[it.key()];
      if (it->is_object() && bv.is_object()) {
        STRATA_RETURN_IF_ERROR(cmp(*it, bv, key));
        continue;
      }
      if (*it == bv) continue;
      // A constant schedule has no end lr: runs of earlier versions saved
      // a --min-lr given with it, which is refused now (it did nothing).
      if (key == "schedule.min_lr" && a.value("kind", "") == "constant") continue;
      if (key == "data" || key == "loss_mask" || key == "documents") {
        log_warn("resume: the checkpoint was trained on {} {}, this run reads {}", key, it->dump(), bv.dump());
        continue;
      }
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("resume from {}: the run was started with {} = {}, this run has {}: a resumed run "
                                "continues the same run; to change it, start a new run (another --out, or "
                                "--overwrite)",
                                checkpoint, key, it->dump(), bv.dump()));
    }
    return {};
  };
  // How the data is cut first (it changes the data's shape too, which would
  // be named instead). Older runs wrote no "windows": they were packed.
  const json saved_windows = saved.contains("windows") ? saved["windows"] : json("packed");
  if (now.contains("windows") && now["windows"] != saved_windows)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("resume from {}: the run was started with windows = {}, this run has {}: a "
                              "resumed run continues the same run; to change it, start a new run (another --out, "
                              "or --overwrite)",
                              checkpoint, saved_windows.dump(), now["windows"].dump()));
  return cmp(saved, now, "");
}

Status trim_metrics(const std::string& path, int64_t step, bool* eval_at_step) {
  if (eval_at_step) *eval_at_step = false;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) return {};  // /dev/null: nothing to trim
  FILE* in = std::fopen(path.c_str(), "r");
  if (!in) return errno == ENOENT ? Status() : Status::from_errno(errno, "metrics file " + path);
  std::string kept, line;
  size_t dropped = 0;
  char buf[4096];
  bool ok = true;
  while (ok) {
    line.clear();
    while (std::fgets(buf, sizeof(buf), in)) {
      line += buf;
      if (!line.empty() && line.back() == '\n') break;
    }
    if (line.empty()) break;
    const json j = json::parse(line, nullptr, false);
    // A torn last line (killed mid-write) or a later step: dropped.
    if (line.back() != '\n' || j.is_discarded() || !j.is_object() || j.value("step", int64_t{0}) > step) {
      ++dropped;
      continue;
    }
    if (eval_at_step && j.value("step", int64_t{0}) == step && j.value("event", std::string()) == "eval")
      *eval_at_step = true;
    kept += line;
  }
  ok = !std::ferror(in);
  std::fclose(in);
  if (!ok) return Status::from_errno(EIO, "metrics file " + path + ": read failed");
  if (dropped == 0) return {};
  log_info("resume: {} lines of {} after step {} removed (written after the checkpoint)", dropped, path, step);
  return model::write_file_atomic(path, kept);
}

}  // namespace strata::train
