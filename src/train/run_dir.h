// OUT, the output directory of one training run: which job owns it, which run
// it holds, its checkpoints, and what crashed processes left in it. The
// trainer opens it before any expensive work and holds it for the whole run.
//
// What it guarantees (RELIABILITY.md):
//  - One job per OUT: open() takes an advisory lock (flock, released by the
//    kernel when the process dies, kill -9 included) on OUT/.strata.lock; a
//    second job fails at once with kAlreadyExists naming the first one's pid.
//  - A fresh run never mixes with another run's files: start_fresh() refuses
//    an OUT that holds any (run.json, checkpoint-*, metrics.jsonl, model/,
//    adapter/) unless told to overwrite, which removes them first (never
//    one that holds an input of the run: OUT/model given as --model). It writes
//    OUT/run.json with a new run id; every checkpoint carries that id.
//  - A resume takes only this run's checkpoints (select_checkpoint()).
//  - What dead processes left in OUT is removed at open: checkpoint staging
//    and replaced directories (cleanup_checkpoint_leftovers) and export temp
//    files (model/*.tmp.<pid> of processes no longer alive on this host).
//
// Not thread-safe; one RunDir per process and OUT.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace strata::train {

struct CheckpointDirEntry {
  uint64_t step = 0;
  std::string path;
};

// checkpoint-<n> directories directly under `dir`, sorted by n. Names whose
// number does not fit 63 bits, or that are not directories, are skipped.
std::vector<CheckpointDirEntry> list_checkpoint_dirs(const std::string& dir);

class RunDir {
 public:
  // Creates OUT if needed, checks it is writable, takes the lock and removes
  // dead processes' leftovers. Errors name OUT and the cause; kAlreadyExists
  // (another job holds the lock, naming its pid and host).
  static Result<std::unique_ptr<RunDir>> open(const std::string& out);
  ~RunDir();  // releases the lock
  RunDir(const RunDir&) = delete;
  RunDir& operator=(const RunDir&) = delete;

  // A new run: refuses (kAlreadyExists, listing what is there) when OUT holds
  // files of an earlier run, unless `overwrite`, which removes them; then
  // takes a new run id. (A run.json alone, or a metrics file with no line
  // past the plan and the step-0 evaluation, is what a run that failed
  // before its first step leaves: not an earlier run. A stop signal saves
  // checkpoint-0, which is one.)
  // `inputs` (what names it, e.g. "--model"; its path): files the run reads,
  // refused (kInvalidArgument) before anything is removed when one lies in
  // what overwrite would remove.
  // `resume_auto`: the run was told --resume auto and OUT holds no
  // checkpoint (the refusal says --overwrite, not --resume).
  Status start_fresh(bool overwrite, const std::vector<std::pair<std::string, std::string>>& inputs = {},
                     bool resume_auto = false);
  // Continuing a run whose checkpoint carries `run_id` ("" for checkpoints
  // older than run ids): OUT's run.json must name the same run, or OUT must
  // hold no run yet (it takes that id).
  Status continue_run(const std::string& run_id);
  // Writes OUT/run.json (run id, host, time, `settings_json`: the run's
  // settings as a JSON object), once the run is set up.
  Status record(const std::string& settings_json);

  const std::string& path() const { return path_; }
  const std::string& run_id() const { return run_id_; }
  // What the lock file says ("pid P on host H, since T"): N ranks check that
  // each sees rank 0's OUT by reading it there (read_holder).
  const std::string& holder() const { return holder_; }
  // OUT/.strata.lock: the file open() locks (it stays after the run).
  static std::string lock_path(const std::string& out);
  // The lock file's text in `out` ("" when there is none or it cannot be read).
  static std::string read_holder(const std::string& out);
  // A run that never started leaves nothing behind: `made` are the
  // directories creating OUT made (outermost first, OUT last). With the lock
  // `held` by this process, the files a run writes in OUT (run.json,
  // metrics.jsonl, the lock) are removed; then each directory, innermost
  // first, with rmdir, which removes nothing else (a directory holding more
  // stays). Nothing happens when `made` is empty: OUT existed before.
  static void remove_made(const std::vector<std::string>& made, bool held);

 private:
  RunDir() = default;
  Status record_holder();  // writes "pid P on host H, since T" into the lock file
  Status remove_leftovers();
  Status write_run_json(const std::string& settings_json);
  std::string path_;
  std::string run_id_;
  std::string holder_;
  int lock_fd_ = -1;
};

// The checkpoint a `--resume FROM` continues from. FROM is a checkpoint
// directory (index.json), taken as given; or a run's OUT, whose newest
// checkpoint of the run in FROM/run.json is taken (checkpoints of other runs
// are skipped, with a warning naming them). kNotFound naming FROM when it
// holds no checkpoint of its run.
Result<std::string> select_checkpoint(const std::string& from);

// The run id in a checkpoint's trainer state ("" for one made before run
// ids). Reads its index and manifest only.
Result<std::string> checkpoint_run_id(const std::string& checkpoint);

// What a run keeps from start to end (checkpoints and run.json carry it): a
// resumed run with other values would be another run. JSON object text.
// `settings` and `now` are such texts; returns kInvalidArgument naming the
// first key whose value differs (keys absent from `saved`, written by older
// versions, are not compared, except "windows": absent means "packed";
// "data", "loss_mask" and "documents" only warn: a moved file is fine).
Status check_same_settings(const std::string& saved, const std::string& now, const std::string& checkpoint);

// Rewrites the metrics file of a run resumed at `step` without the lines of
// later steps (written after the checkpoint by the run that died), so the
// file reads as if the run had never stopped. Atomic (temp + rename). A
// missing file is fine. *eval_at_step (when given): whether a kept line is
// the evaluation of `step` itself (a run resumed where it ended must not
// write it again).
Status trim_metrics(const std::string& path, int64_t step, bool* eval_at_step = nullptr);

// The run id in DIR/run.json; "" when there is none. kCorrupt for a damaged one.
Result<std::string> read_run_id(const std::string& dir);

}  // namespace strata::train
