// The run loop of Trainer::run(): steps until the end or a stop request,
// evaluations and checkpoints on their schedules, the final export, the
// metrics file and the progress display (trainer.h, run()).
#include "train/run_dir.h"
#include "train/trainer_impl.h"

namespace strata::train {

using namespace trainer_detail;
namespace fs = std::filesystem;

// ---------------------------------------------------------------- run()

// One run(): the result so far, the progress display and the throughput
// totals. Each member does one part of the job (trainer.h, run()).
class Trainer::Run {
 public:
  explicit Run(Trainer& t)
      : t_(t),
        m_(*t.impl_),
        progress_(m_.opt.progress),
        has_val_(m_.eval_batch_count() > 0),
        eval_n_(m_.eval_batch_count()),
        first_step_(m_.step),
        tokens_per_step_(static_cast<uint64_t>(m_.tokens_per_micro) * m_.accum * m_.world),  // every rank's
        prev_(m_.engine->stats()) {}

  Result<TrainResult> execute() {
    // A resumed run's file holds the plan already (kept by the trim).
    if (m_.opt.resume_dir.empty()) STRATA_RETURN_IF_ERROR(write_plan());
    if (has_val_) {
      // A resumed run's file already holds this evaluation (metrics read as
      // if the run never stopped): printed, not written again.
      STRATA_ASSIGN_OR_RETURN(res_.initial_val_loss, evaluate(/*record=*/m_.opt.resume_dir.empty()));
    }
    // From the first step on, a metrics line that cannot be written (a full
    // disk) ends the run with a checkpoint (Impl::metrics_error).
    m_.metrics_deferred = true;
    if (Status trained = train(); !trained.ok()) return with_metrics_error(trained);
    // Every rank learns whether rank 0's metrics failed (the ranks stopped
    // as on a stop request): each then fails saying so, none exits as if
    // interrupted by a signal.
    STRATA_ASSIGN_OR_RETURN(const bool metrics_stop, m_.any_rank(!m_.metrics_error.ok()));
    if (metrics_stop) {
      progress_.end();
      finish_totals();
      return with_metrics_error({});
    }
    // A stop request that came after the last step: the work is saved, as the
    // signal handler promised, and the final evaluation and export skipped.
    // (N ranks: every stop check is agreed on, Impl::stop_requested.)
    bool late_stop = false;
    if (!res_.interrupted) {
      STRATA_ASSIGN_OR_RETURN(late_stop, m_.stop_requested());
    }
    if (late_stop && m_.step > 0) {
      if (res_.last_checkpoint != checkpoint_dir()) STRATA_RETURN_IF_ERROR(checkpoint());
      res_.interrupted = true;
    }
    progress_.end();
    finish_totals();
    if (res_.interrupted) return res_;
    if (has_val_) {
      // Resumed where the run had ended (no step trained here): the same
      // weights, so the value just printed; written only if the file lacks it
      // (a run stopped after its last checkpoint skipped the evaluation).
      if (m_.step == first_step_ && !m_.opt.resume_dir.empty()) {
        res_.final_val_loss = res_.initial_val_loss;
        if (!m_.metrics_eval_at_resume) STRATA_RETURN_IF_ERROR(write_eval(res_.final_val_loss, 0.0));
      } else {
        STRATA_ASSIGN_OR_RETURN(res_.final_val_loss, evaluate());
      }
    }
    // The final evaluation's line (rank 0's): the trained state saved, no
    // export (every rank decides alike).
    m_.metrics_deferred = false;
    STRATA_ASSIGN_OR_RETURN(const bool metrics_failed, m_.any_rank(!m_.metrics_error.ok()));
    if (metrics_failed) {
      Status saved = res_.last_checkpoint != checkpoint_dir() ? checkpoint() : Status();
      return with_metrics_error(saved);
    }
    // LoRA: the adapter is the run's result, written even with --no-export
    // (which leaves out OUT/model only).
    if (m_.opt.export_model || m_.opt.lora.enabled()) {
      if (Status st = export_model(); !st.ok()) return keep_work(st);
    }
    return res_;
  }

 private:
  // Steps until opt.steps, a stop request, or an error; evaluations and
  // checkpoints on their schedules.
  Status train() {
    while (m_.step < m_.opt.steps) {
      STRATA_ASSIGN_OR_RETURN(const bool stopped, m_.stop_requested());
      if (stopped) {  // before this run's first step, or during the last step's save (not saved twice)
        if (res_.last_checkpoint != checkpoint_dir()) STRATA_RETURN_IF_ERROR(checkpoint());
        res_.interrupted = true;
        break;
      }
      STRATA_ASSIGN_OR_RETURN(StepReport r, t_.train_step());
      STRATA_RETURN_IF_ERROR(report_step(r));
      STRATA_RETURN_IF_ERROR(check_skipped(r));
      STRATA_ASSIGN_OR_RETURN(const bool stop, m_.stop_requested());
      if (has_val_ && m_.opt.eval_every > 0 && r.step % m_.opt.eval_every == 0 && r.step < m_.opt.steps && !stop) {
        STRATA_ASSIGN_OR_RETURN(double v, evaluate());
        (void)v;
      }
      if (stop) {
        STRATA_RETURN_IF_ERROR(checkpoint());
        res_.interrupted = true;
        break;
      }
      if (m_.opt.save_every > 0 && r.step % m_.opt.save_every == 0) STRATA_RETURN_IF_ERROR(checkpoint());
    }
    return {};
  }

  // What the engine's placement moves per optimizer step (the planner's
  // model: every group uploaded in forward and again in backward, gradients
  // downloaded once per micro-batch, NVMe states read and written once), so
  // each train line's measured bytes can be held against it
  // (tools/bench_bytes.py).
  Status write_plan() {
    const Plan& p = m_.engine->plan();
    auto link = [](const LinkBytes& l) {
      return json{{"nvme_read_bytes", l.nvme_read}, {"nvme_write_bytes", l.nvme_write}, {"h2d_bytes", l.h2d},
                  {"d2h_bytes", l.d2h}, {"comm_bytes", l.comm}};
    };
    return m_.write_metrics({{"event", "plan"},
                      {"micro_batches", p.options.micro_batches},
                      {"uploads_per_micro_batch", p.options.uploads_per_micro_batch},
                      {"forward_backward", link(p.forward_backward)},
                      {"optimizer_step", link(p.optimizer_step)},
                      {"per_step", link(p.per_step())}});
  }

  // The step's totals, its metrics line and its progress line.
  Status report_step(const StepReport& r) {
    train_seconds_ += r.seconds;
    train_tokens_ += tokens_per_step_;
    if (r.step > first_step_ + 1) {
      warm_seconds_ += r.seconds;
      ++warm_steps_;
    }
    res_.train_losses.push_back(r.loss);
    const EngineStats s = m_.engine->stats();
    const uint64_t io = (s.nvme_read_bytes - prev_.nvme_read_bytes) + (s.nvme_write_bytes - prev_.nvme_write_bytes);
    prev_ = s;
    const double tps = static_cast<double>(tokens_per_step_) / r.seconds;
    const double io_gbps = static_cast<double>(io) / r.seconds / 1e9;
    json j = {{"event", "train"},         {"step", r.step},
              {"loss", r.loss},           {"lr", r.lr},
              {"grad_norm", r.engine.grad_norm}, {"clip_coef", r.engine.clip_coef},
              {"loss_scale", r.engine.loss_scale}, {"skipped", r.engine.skipped},
              {"tokens", m_.tokens_seen}, {"step_s", r.seconds},
              {"tokens_per_s", tps},      {"io_gbps", io_gbps}};
    j.update(m_.stats_json());
    STRATA_RETURN_IF_ERROR(m_.write_metrics(j));
    const uint64_t dev_b = s.tier_bytes[static_cast<int>(Tier::kDevice)];
    const uint64_t host_b = s.tier_bytes[static_cast<int>(Tier::kHost)];
    const uint64_t nvme_b = s.tier_bytes[static_cast<int>(Tier::kNvme)];
    const double eta = (train_seconds_ / static_cast<double>(r.step - first_step_)) *
                       static_cast<double>(m_.opt.steps - r.step);
    const std::string line = fmt::format(
        "step {:>6}/{}  loss {:.4f}  lr {:.2e}  {} tok/s  dev {}  host {}  nvme {}  io {:.2f} GB/s{}", r.step,
        m_.opt.steps, r.loss, r.lr, human_count(tps), format_bytes(dev_b), format_bytes(host_b),
        format_bytes(nvme_b), io_gbps, r.engine.skipped ? "  (skipped: non-finite gradients)" : "");
    progress_.step(line, eta,
                   r.step == first_step_ + 1 || r.step == m_.opt.steps ||
                       r.step % std::max<int64_t>(1, m_.opt.log_every) == 0);
    return {};
  }

  // A run whose every step is skipped for non-finite gradients must not end
  // "successfully" with an unchanged (or NaN) model. fp16's dynamic loss
  // scaler skips steps while it searches for a scale: those count only once
  // the scale is at its minimum.
  Status check_skipped(const StepReport& r) {
    const bool counts = r.engine.skipped && (!m_.opt.config.fp16.enabled ||
                                             r.engine.loss_scale <= m_.opt.config.fp16.min_loss_scale);
    m_.skipped_in_a_row = counts ? m_.skipped_in_a_row + 1 : (r.engine.skipped ? m_.skipped_in_a_row : 0);
    if (m_.opt.max_skipped_steps <= 0 || m_.skipped_in_a_row < m_.opt.max_skipped_steps) return {};
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("step {}: {} steps in a row were skipped because the gradients were not finite (norm "
                              "{}): the model or the learning rate ({:.3g}) diverged, or the weights hold NaN/Inf; "
                              "the run stops here{}",
                              r.step, m_.skipped_in_a_row, r.engine.grad_norm, r.lr,
                              res_.last_checkpoint.empty() ? "" : "; the last checkpoint is " + res_.last_checkpoint));
  }

  Status write_eval(double val_loss, double seconds) {
    return m_.write_metrics({{"event", "eval"},
                             {"step", m_.step},
                             {"val_loss", val_loss},
                             {"batches", eval_n_},
                             {"tokens", eval_n_ * static_cast<uint64_t>(m_.tokens_per_micro) * m_.world},  // every rank's
                             {"seconds", seconds}});
  }

  // The validation loss, logged to the metrics file and the progress display.
  Result<double> evaluate(bool record = true) {
    const auto t0 = Clock::now();
    STRATA_ASSIGN_OR_RETURN(double v, t_.evaluate());
    if (record) STRATA_RETURN_IF_ERROR(write_eval(v, seconds_since(t0)));
    progress_.say(fmt::format("step {:>6}  validation loss {:.4f}  ({} batches, {:.1f}s)", m_.step, v, eval_n_,
                              seconds_since(t0)));
    return v;
  }

  // The run's outcome once a metrics line could not be written while it
  // trained (rank 0's file; every rank stopped as on a stop request): on
  // rank 0 that error, on the others that rank 0's failed; then where the
  // trained state is saved, or `after`, the error the run ended with after
  // it (a failed save).
  Status with_metrics_error(const Status& after) {
    const Status e = !m_.metrics_error.ok() ? m_.metrics_error
                                             : Status(StatusCode::kIoError,
                                                      fmt::format("rank 0 could not write its metrics file (its "
                                                                  "error says why); the ranks stopped at step {}",
                                                                  m_.step));
    if (!after.ok()) {
      // (A metrics failure that stopped nothing yet: the run's own error.)
      if (m_.metrics_error.ok()) return after;
      return Status(e.code(), fmt::format("{}; then, stopping to save: {}", e.message(), after.message()));
    }
    if (res_.last_checkpoint.empty()) return e;  // (stopped before its first step)
    return Status(e.code(), fmt::format("{}; the trained state is saved in {}: resume with --resume {} once the "
                                        "metrics file can be written",
                                        e.message(), res_.last_checkpoint, m_.opt.out_dir));
  }

  // An export that failed (a value its dtype cannot hold, a full disk)
  // loses no training: the ranks save the last step's checkpoint, if the
  // schedule did not, and the error says how to export it again.
  Status keep_work(const Status& failed) {
    // Only what another dtype, more disk or a path can fix (a NaN master
    // cannot be exported in any dtype).
    const StatusCode c = failed.code();
    const bool fixable = c == StatusCode::kInvalidArgument || c == StatusCode::kNoSpace || c == StatusCode::kIoError ||
                         c == StatusCode::kPermission || c == StatusCode::kNotFound ||
                         c == StatusCode::kAlreadyExists;  // a path in the way (OUT/model a file)
    // N ranks: only a failure every rank saw (rank 0's write outcome, shared;
    // a value no rank can export) lets them save together. One rank's own
    // (a read failing in a gather) ends it as before: its peers see it leave
    // at once instead of waiting in a collective it will never join.
    if (m_.step == 0 || !fixable || (m_.world > 1 && !m_.export_failure_agreed)) return failed;
    if (res_.last_checkpoint != checkpoint_dir()) {
      if (Status saved = checkpoint(); !saved.ok())
        return Status(failed.code(), fmt::format("{}; saving the trained state in a checkpoint failed too: {}",
                                                 failed.message(), saved.message()));
    }
    return Status(failed.code(),
                  fmt::format("{}; the trained state is saved in {}: export it again with --resume {} --steps {} "
                              "(with another --export-dtype, or room on the disk)",
                              failed.message(), res_.last_checkpoint, m_.opt.out_dir, m_.step));
  }

  // --keep: an older checkpoint of this run goes only if it holds nothing
  // but what the save wrote (a file a user put there keeps it, with a
  // warning naming it).
  // Whether `path` is a checkpoint of this run (else --keep leaves it, and
  // says so once).
  bool is_ours(const std::string& path) {
    auto id = checkpoint_run_id(path);
    if (!id.ok()) {
      log_once(LogLevel::kWarn, "keep-" + path,
               fmt::format("--keep: leaving {} in place: it is not a checkpoint Strata can read ({})", path,
                           id.status().message()));
      return false;
    }
    if (*id != m_.run_dir->run_id()) {
      log_once(LogLevel::kWarn, "keep-" + path,
               fmt::format("--keep: leaving {} in place: it belongs to another run", path));
      return false;
    }
    return true;
  }

  void prune_checkpoint(const std::string& path) {
    auto keep_it = [&](const std::string& why) {
      log_once(LogLevel::kWarn, "keep-" + path, fmt::format("--keep: leaving {} in place: {}", path, why));
    };
    auto files = checkpoint_files(path);
    if (!files.ok()) return keep_it(files.status().message());
    const std::set<std::string> ours(files->begin(), files->end());
    std::error_code ec;
    for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (!ours.count(name)) return keep_it("it holds " + name + ", which no save of Strata wrote");
    }
    if (ec) return keep_it("listing it failed: " + ec.message());
    fs::remove_all(path, ec);
    if (ec) log_warn("could not remove old checkpoint {}: {}", path, ec.message());
  }

  std::string checkpoint_dir() const { return m_.opt.out_dir + "/checkpoint-" + std::to_string(m_.step); }

  // out_dir/checkpoint-<step>, then the oldest beyond `keep` removed.
  Status checkpoint() {
    const auto t0 = Clock::now();
    const std::string dir = checkpoint_dir();
    STRATA_RETURN_IF_ERROR(t_.save_checkpoint(dir));
    res_.last_checkpoint = dir;
    STRATA_RETURN_IF_ERROR(
        m_.write_metrics({{"event", "checkpoint"}, {"step", m_.step}, {"dir", dir}, {"seconds", seconds_since(t0)}}));
    if (m_.opt.keep > 0 && m_.rank == 0) {  // N ranks: rank 0 owns OUT
      // The newest --keep of this run's checkpoints stay; older ones of it go.
      auto cks = list_checkpoint_dirs(m_.opt.out_dir);
      uint32_t kept = 0;
      for (auto it = cks.rbegin(); it != cks.rend(); ++it) {
        if (it->path == dir || !is_ours(it->path)) {
          kept += it->path == dir;
          continue;
        }
        if (kept < m_.opt.keep) {
          ++kept;
          continue;
        }
        prune_checkpoint(it->path);
      }
    }
    progress_.say(fmt::format("step {:>6}  saved {} ({:.1f}s)", m_.step, dir, seconds_since(t0)));
    return {};
  }

  void finish_totals() {
    res_.steps_done = m_.step;
    res_.steps_this_run = m_.step - first_step_;
    res_.train_seconds = train_seconds_;
    res_.tokens_per_s = train_seconds_ > 0 ? static_cast<double>(train_tokens_) / train_seconds_ : 0;
    res_.mean_step_seconds = warm_steps_ > 0 ? warm_seconds_ / static_cast<double>(warm_steps_)
                                             : (res_.steps_this_run > 0 ? train_seconds_ / res_.steps_this_run : 0);
  }

  // out_dir/model in opt.export_dtype (the model's own dtype when unset).
  // LoRA: the PEFT adapter in out_dir/adapter (always), and the merged model
  // only when asked (the base did not change).
  Status export_model() {
    if (m_.opt.lora.enabled()) {
      const std::string adir = m_.opt.out_dir + "/adapter";
      if (Status st = t_.export_adapter(adir); !st.ok()) return st.with_context("exporting the LoRA adapter to " + adir);
      res_.exported_adapter = adir;
      progress_.say(fmt::format("exported the LoRA adapter (PEFT format, fp32) to {}", adir));
      if (!m_.opt.lora.merge || !m_.opt.export_model) return {};
    }
    const DType dt = m_.opt.export_dtype.value_or(m_.model.config.torch_dtype);
    const std::string dir = m_.opt.out_dir + "/model";
    if (Status st = t_.export_model(dir, dt); !st.ok()) return st.with_context("exporting the model to " + dir);
    res_.exported_model = dir;
    res_.exported_dtype = dt;
    res_.trained_dtype = m_.compute_dtype;
    // LoRA merged: W + s B A is rounded as a whole, where the evaluation added
    // the fp32 adapters' output to the base's.
    res_.export_merged = m_.opt.lora.enabled();
    res_.export_rounds = dtype_size(dt) < dtype_size(m_.compute_dtype) || (res_.export_merged && dt != DType::kF32);
    progress_.say(fmt::format("exported the {}model ({}) to {}", m_.opt.lora.enabled() ? "merged " : "",
                              dtype_name(dt), dir));
    return {};
  }

  Trainer& t_;
  Impl& m_;
  TrainResult res_;
  Progress progress_;
  const bool has_val_;     // the data has a validation part
  const uint64_t eval_n_;  // validation batches per evaluation
  const int64_t first_step_;
  const uint64_t tokens_per_step_;
  EngineStats prev_;  // the engine's counters after the previous step
  double train_seconds_ = 0, warm_seconds_ = 0;
  int64_t warm_steps_ = 0;
  uint64_t train_tokens_ = 0;
};

Result<TrainResult> Trainer::run() {
  Result<TrainResult> r = Run(*this).execute();
  // A new OUT whose run failed before its first step (the plan line refused
  // by a full disk, an I/O error in step 1) is removed as when create() fails:
  // nothing trained, nothing saved.
  if (!r.ok() && impl_->step == 0 && impl_->resume_from.empty() && impl_->run_dir &&
      list_checkpoint_dirs(impl_->opt.out_dir).empty()) {
    RunDir::remove_made(impl_->made_out_dirs, /*held=*/true);
    impl_->made_out_dirs.clear();
  }
  return r;
}

}  // namespace strata::train
