// `strata finetune`: fine-tunes a Hugging Face Llama model directory on a
// token file, with its state in the offload engine (train/trainer.h).
//
// Precedence: built-in defaults < --config FILE < flags given explicitly.
// --config and the --offload-* flags are alternatives (both: an error).
// --device auto|cuda|cpu picks where the model math runs (train/trainer.h,
// "Devices"); cuda on a machine that cannot run it exits 1 with the reason.
// Exit status: 0 done; 1 a problem the user can fix (the message says what,
// where and why); 2 an internal error; 130 interrupted by SIGINT/SIGTERM after
// the current step finished and a checkpoint was saved (resume with
// --resume OUT).
#include <signal.h>
#include <unistd.h>

#include <fmt/format.h>

#include <array>
#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "common/units.h"
#include "finetune.h"
#include "model/llama_config.h"
#include "runtime/config.h"
#include "train/trainer.h"

namespace strata::tools {

namespace {
std::atomic<bool> g_stop{false};
std::atomic<int> g_signal{0};
static_assert(std::atomic<bool>::is_always_lock_free && std::atomic<int>::is_always_lock_free);
constexpr std::array<int, 2> kStopSignals = {SIGINT, SIGTERM};
std::array<struct sigaction, 2> g_old{};
std::array<bool, 2> g_installed{};

void on_stop_signal(int sig) {
  if (g_stop.exchange(true)) {
    // Second signal: the default action (SA_RESETHAND already restored it).
    ::raise(sig);
    return;
  }
  g_signal.store(sig);
  static const char msg[] = "\nstopping after this step (a checkpoint is saved); signal again to abort now\n";
  ssize_t n = ::write(STDERR_FILENO, msg, sizeof(msg) - 1);
  (void)n;
}
}  // namespace

StopSignals::StopSignals() {
  g_stop.store(false);
  g_signal.store(0);
  for (size_t i = 0; i < kStopSignals.size(); ++i) {
    struct sigaction old {};
    // A signal ignored when we started (nohup) stays ignored.
    if (sigaction(kStopSignals[i], nullptr, &old) != 0 || old.sa_handler == SIG_IGN) continue;
    struct sigaction sa {};
    sa.sa_handler = &on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND;  // the second signal gets the default action
    if (sigaction(kStopSignals[i], &sa, &g_old[i]) == 0) g_installed[i] = true;
  }
}

StopSignals::~StopSignals() {
  for (size_t i = 0; i < kStopSignals.size(); ++i)
    if (g_installed[i]) sigaction(kStopSignals[i], &g_old[i], nullptr);
  g_installed = {};
}

const std::atomic<bool>* StopSignals::flag() const { return &g_stop; }
bool StopSignals::stopped() const { return g_stop.load(); }
int StopSignals::signal_number() const { return g_signal.load(); }

int exit_code_for(const Status& st) {
  if (st.ok()) return 0;
  return st.code() == StatusCode::kInternal ? 2 : 1;
}

namespace {

struct FinetuneFlags {
  std::string model, data, data_format = "text", config, offload_params = "auto", offload_optimizer = "auto";
  uint32_t vocab = 0;
  double val_fraction = 0.05;
  uint64_t seed = 1234;
  int64_t steps = 100;
  uint32_t batch = 4, seq = 256, grad_accum = 1;
  double lr = 1e-4, min_lr = 0, clip = 1.0, weight_decay = 0.0;
  int64_t warmup = 0;
  std::string schedule = "cosine";
  bool fp16 = false, bf16 = false;
  int64_t save_every = 0, eval_every = 0, log_every = 10;
  uint32_t keep = 2, eval_batches = 8;
  std::string out = "finetune-out", resume, trace, metrics, export_dtype, progress = "auto";
  bool no_export = false;
  std::string device_mem, host_mem, device = "auto";
  int threads = 0;
  // Which flags were given (they override --config).
  CLI::Option *o_grad_accum = nullptr, *o_clip = nullptr, *o_wd = nullptr, *o_lr = nullptr, *o_fp16 = nullptr,
              *o_bf16 = nullptr, *o_offp = nullptr, *o_offo = nullptr;
};

Status build_options(const FinetuneFlags& f, train::TrainerOptions* o) {
  o->model_dir = f.model;
  o->data.path = f.data;
  STRATA_ASSIGN_OR_RETURN(o->data.format, train::parse_data_format(f.data_format));
  o->data.vocab = f.vocab;
  o->data.val_fraction = f.val_fraction;
  o->data.seed = f.seed;
  o->data.seq = f.seq;

  Config c;
  if (!f.config.empty()) {
    if (f.o_offp->count() || f.o_offo->count())
      return Status(StatusCode::kInvalidArgument,
                    "--config and --offload-params/--offload-optimizer are alternatives: put the offload targets "
                    "in the config file (zero_optimization.offload_param / offload_optimizer) or drop --config");
    auto r = load_config_file(f.config);
    if (!r.ok()) return r.status();
    c = r.value();
    if (!f.o_lr->count()) o->schedule.lr = c.optimizer.lr;
  }
  if (f.config.empty() || f.o_offp->count())
    STRATA_RETURN_IF_ERROR(
        train::parse_offload_flag(f.offload_params, &c.zero.offload_param.device, &c.zero.offload_param.nvme_path)
            .with_context("--offload-params"));
  if (f.config.empty() || f.o_offo->count())
    STRATA_RETURN_IF_ERROR(train::parse_offload_flag(f.offload_optimizer, &c.zero.offload_optimizer.device,
                                                     &c.zero.offload_optimizer.nvme_path)
                               .with_context("--offload-optimizer"));
  if (f.config.empty() || f.o_grad_accum->count()) c.gradient_accumulation_steps = f.grad_accum;
  if (f.config.empty() || f.o_clip->count()) c.gradient_clipping = f.clip;
  if (f.config.empty() || f.o_wd->count()) c.optimizer.weight_decay = f.weight_decay;
  if (f.fp16 && f.bf16) return Status(StatusCode::kInvalidArgument, "--fp16 and --bf16 exclude each other");
  if (f.o_fp16->count()) {
    c.fp16.enabled = true;
    c.bf16 = false;
  }
  if (f.o_bf16->count()) {
    c.bf16 = true;
    c.fp16.enabled = false;
  }
  if (!f.trace.empty()) c.strata.trace = f.trace;
  if (!f.device_mem.empty()) {
    auto b = parse_bytes(f.device_mem);
    if (!b.ok()) return b.status().with_context("--device-mem");
    c.strata.device_memory = b.value();
  }
  if (!f.host_mem.empty()) {
    auto b = parse_bytes(f.host_mem);
    if (!b.ok()) return b.status().with_context("--host-mem");
    c.strata.host_memory = b.value();
  }
  if (c.gradient_accumulation_steps < 1)
    return Status(StatusCode::kInvalidArgument, "--grad-accum must be at least 1");
  if (!(c.gradient_clipping >= 0)) return Status(StatusCode::kInvalidArgument, "--clip must be >= 0 (0: off)");
  o->config = c;

  if (!f.o_lr->count() && f.config.empty()) o->schedule.lr = f.lr;
  if (f.o_lr->count()) o->schedule.lr = f.lr;
  STRATA_ASSIGN_OR_RETURN(o->schedule.kind, train::parse_schedule_kind(f.schedule));
  o->schedule.min_lr = f.min_lr;
  o->schedule.warmup = f.warmup;
  o->schedule.total = std::max<int64_t>(1, f.steps);
  if (f.steps < 0) return Status(StatusCode::kInvalidArgument, "--steps must be >= 0");
  if (f.steps > 0) STRATA_RETURN_IF_ERROR(train::validate_schedule(o->schedule).with_context("--lr/--min-lr/--warmup"));
  o->steps = f.steps;
  if (f.batch < 1) return Status(StatusCode::kInvalidArgument, "--batch must be at least 1");
  if (f.seq < 1) return Status(StatusCode::kInvalidArgument, "--seq must be at least 1");
  o->batch = f.batch;
  o->eval_every = f.eval_every;
  o->eval_batches = f.eval_batches;
  o->save_every = f.save_every;
  o->keep = f.keep;
  o->out_dir = f.out;
  o->resume_dir = f.resume;
  o->metrics_path = f.metrics;
  o->export_model = !f.no_export;
  o->export_dtype = f.export_dtype;
  o->log_every = f.log_every;
  o->threads = f.threads;
  STRATA_ASSIGN_OR_RETURN(o->device, train::parse_train_device(f.device));
  if (f.progress == "auto") o->progress = train::ProgressMode::kAuto;
  else if (f.progress == "bar") o->progress = train::ProgressMode::kBar;
  else if (f.progress == "lines") o->progress = train::ProgressMode::kLines;
  else if (f.progress == "quiet") o->progress = train::ProgressMode::kQuiet;
  else
    return Status(StatusCode::kInvalidArgument,
                  "--progress \"" + f.progress + "\" is not one of auto, bar, lines, quiet");
  return {};
}

void run_finetune(const FinetuneFlags& f) {
  train::TrainerOptions o;
  if (Status st = build_options(f, &o); !st.ok()) {
    std::fprintf(stderr, "strata finetune: %s\n", st.message().c_str());
    set_exit_code(1);
    return;
  }
  StopSignals signals;
  o.stop = signals.flag();
  auto t = train::Trainer::create(o);
  if (!t.ok()) {
    std::fprintf(stderr, "strata finetune: %s\n", t.status().message().c_str());
    set_exit_code(exit_code_for(t.status()));
    return;
  }
  train::Trainer& tr = *t.value();
  const EngineStats s = tr.engine().stats();
  std::printf("model %s: %u layers, dim %lu, vocab %lu; %s ops on %s; state: device %s, host %s, NVMe %s\n",
              f.model.c_str(), tr.model_config().num_hidden_layers,
              static_cast<unsigned long>(tr.model_config().hidden_size),
              static_cast<unsigned long>(tr.model_config().vocab_size), tr.ops_name(),
              tr.device_description().c_str(),
              format_bytes(s.tier_bytes[static_cast<int>(Tier::kDevice)]).c_str(),
              format_bytes(s.tier_bytes[static_cast<int>(Tier::kHost)]).c_str(),
              format_bytes(s.tier_bytes[static_cast<int>(Tier::kNvme)]).c_str());
  std::printf("data %s: %lu tokens (%lu training, %lu validation); %lld steps of %u x %u x %u tokens%s\n",
              f.data.c_str(), static_cast<unsigned long>(tr.data().tokens()),
              static_cast<unsigned long>(tr.data().train_tokens()), static_cast<unsigned long>(tr.data().val_tokens()),
              static_cast<long long>(f.steps), f.batch, f.seq, o.config.gradient_accumulation_steps,
              tr.step() > 0 ? fmt::format(" (resuming at step {})", tr.step()).c_str() : "");
  std::fflush(stdout);
  auto r = tr.run();
  if (!r.ok()) {
    std::fprintf(stderr, "strata finetune: %s\n", r.status().message().c_str());
    set_exit_code(exit_code_for(r.status()));
    return;
  }
  if (r->interrupted) {
    std::printf("interrupted at step %lld; resume with: strata finetune ... --resume %s\n",
                static_cast<long long>(r->steps_done), r->last_checkpoint.c_str());
    set_exit_code(kExitInterrupted);
    return;
  }
  std::printf("done: %lld steps, %.0f tokens/s", static_cast<long long>(r->steps_done), r->tokens_per_s);
  if (r->initial_val_loss >= 0)
    std::printf(", validation loss %.4f -> %.4f", r->initial_val_loss, r->final_val_loss);
  std::printf("\n");
  set_exit_code(0);
}

}  // namespace

void register_finetune(CLI::App& app) {
  auto f = std::make_shared<FinetuneFlags>();
  CLI::App* cmd = app.add_subcommand("finetune", "Fine-tune a Hugging Face Llama model with its state offloaded");
  cmd->add_option("--model", f->model, "Model directory (config.json + model.safetensors)")->required();
  cmd->add_option("--data", f->data, "Training data file")->required();
  cmd->add_option("--data-format", f->data_format, "text (bytes are tokens) | u16 | u32 (token ids)")
      ->capture_default_str();
  cmd->add_option("--vocab", f->vocab, "Token ids must be below this (0: the model's vocab_size; text: <= 256)")
      ->capture_default_str();
  cmd->add_option("--val-fraction", f->val_fraction, "Last fraction of the file held out for validation (0: none)")
      ->capture_default_str();
  cmd->add_option("--seed", f->seed, "Shuffling seed")->capture_default_str();
  cmd->add_option("--config", f->config, "Offload config (DeepSpeed JSON; docs/config.md)");
  f->o_offp = cmd->add_option("--offload-params", f->offload_params,
                              "Compute copies of the parameters: nvme:DIR | cpu | none | auto")
                  ->capture_default_str();
  f->o_offo = cmd->add_option("--offload-optimizer", f->offload_optimizer,
                              "Master weights and optimizer states: nvme:DIR | cpu | none | auto")
                  ->capture_default_str();
  cmd->add_option("--steps", f->steps, "Optimizer steps in total")->capture_default_str();
  cmd->add_option("--batch", f->batch, "Sequences per micro-batch")->capture_default_str();
  cmd->add_option("--seq", f->seq, "Tokens per sequence")->capture_default_str();
  f->o_lr = cmd->add_option("--lr", f->lr, "Peak learning rate")->capture_default_str();
  cmd->add_option("--min-lr", f->min_lr, "Learning rate at the end of a linear/cosine decay")->capture_default_str();
  cmd->add_option("--warmup", f->warmup, "Linear warm-up steps")->capture_default_str();
  cmd->add_option("--schedule", f->schedule, "constant | linear | cosine (after the warm-up)")->capture_default_str();
  f->o_grad_accum =
      cmd->add_option("--grad-accum", f->grad_accum, "Micro-batches per optimizer step")->capture_default_str();
  f->o_clip = cmd->add_option("--clip", f->clip, "Clip the global gradient norm to this (0: off)")
                  ->capture_default_str();
  f->o_wd = cmd->add_option("--weight-decay", f->weight_decay, "AdamW decoupled weight decay")->capture_default_str();
  f->o_fp16 = cmd->add_flag("--fp16", f->fp16, "fp16 compute copies with dynamic loss scaling (default: fp32)");
  f->o_bf16 = cmd->add_flag("--bf16", f->bf16, "bf16 compute copies (default: fp32)");
  cmd->add_option("--save-every", f->save_every, "Save OUT/checkpoint-<step> every N steps (0: never)")
      ->capture_default_str();
  cmd->add_option("--keep", f->keep, "Checkpoints kept (the newest; 0: all)")->capture_default_str();
  cmd->add_option("--eval-every", f->eval_every, "Validation loss every N steps (0: before and after only)")
      ->capture_default_str();
  cmd->add_option("--eval-batches", f->eval_batches, "Validation batches per evaluation")->capture_default_str();
  cmd->add_option("--out", f->out, "Output directory: metrics, checkpoints, the model")->capture_default_str();
  cmd->add_option("--resume", f->resume, "Continue from a checkpoint dir (or a dir holding checkpoint-<step>)");
  cmd->add_option("--trace", f->trace, "Write a Chrome/Perfetto trace of the engine and the compute");
  cmd->add_option("--metrics", f->metrics, "JSON-lines metrics file (default OUT/metrics.jsonl)");
  cmd->add_flag("--no-export", f->no_export, "Do not write OUT/model at the end");
  cmd->add_option("--export-dtype", f->export_dtype, "fp32 | bf16 | fp16 for OUT/model (default: the model's)");
  cmd->add_option("--device-mem", f->device_mem, "Device memory budget (e.g. 20GiB; default: detect)");
  cmd->add_option("--host-mem", f->host_mem, "Host memory budget (e.g. 64GiB; default: detect)");
  cmd->add_option("--progress", f->progress, "auto | bar | lines | quiet")->capture_default_str();
  cmd->add_option("--log-every", f->log_every, "A progress line every N steps (lines mode)")->capture_default_str();
  cmd->add_option("--threads", f->threads, "CPU compute threads (0: all)")->capture_default_str();
  cmd->add_option("--device", f->device,
                  "Where the model math runs: auto (the GPU when CUDA model ops can run there, else the CPU) | "
                  "cuda (the GPU or exit 1 with the reason) | cpu")
      ->capture_default_str();
  cmd->callback([f] { run_finetune(*f); });
}

}  // namespace strata::tools
