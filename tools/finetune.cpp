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
// --resume OUT), or while the ranks were still meeting (nothing trained).
#include <signal.h>
#include <unistd.h>

#include <fmt/format.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "commands.h"
#include "common/units.h"
#include "finetune.h"
#include "finetune_flags.h"
#include "model/llama_config.h"
#include "train/trainer.h"

namespace strata::tools {

namespace {
std::atomic<bool> g_stop{false};
std::atomic<int> g_signal{0};
std::atomic<const char*> g_message{""};
static_assert(std::atomic<bool>::is_always_lock_free && std::atomic<int>::is_always_lock_free);
// SIGHUP (the terminal went away) stops like SIGTERM: with a checkpoint.
// SIGXCPU (a soft CPU-time limit below the hard one, `ulimit -S -t`; LSF's
// and PBS's CPU limits send it) too: it comes again each CPU second until the
// hard limit's SIGKILL, so a repeat is not the "second signal" that aborts.
constexpr std::array<int, 4> kStopSignals = {SIGINT, SIGTERM, SIGHUP, SIGXCPU};
std::array<struct sigaction, 4> g_old{};
std::array<bool, 4> g_installed{};
constexpr const char kCpuLimitMessage[] =
    "\nthe soft CPU time limit (ulimit -S -t) is reached: stopping after this step (a checkpoint is saved) before "
    "the hard limit kills the process\n";

void on_stop_signal(int sig) {
  if (g_stop.exchange(true)) {
    if (sig == SIGXCPU) return;  // the limit's reminder: the stop is under way
    // Second signal: the default action (SA_RESETHAND already restored it).
    ::raise(sig);
    return;
  }
  g_signal.store(sig);
  const char* msg = sig == SIGXCPU ? kCpuLimitMessage : g_message.load();
  ssize_t n = ::write(STDERR_FILENO, msg, std::strlen(msg));
  (void)n;
}
}  // namespace

StopSignals::StopSignals(const char* message) {
  g_message.store(message);
  g_stop.store(false);
  g_signal.store(0);
  for (size_t i = 0; i < kStopSignals.size(); ++i) {
    struct sigaction old {};
    // A signal ignored when we started (nohup) stays ignored.
    if (sigaction(kStopSignals[i], nullptr, &old) != 0 || old.sa_handler == SIG_IGN) continue;
    struct sigaction sa {};
    sa.sa_handler = &on_stop_signal;
    sigemptyset(&sa.sa_mask);
    // The second signal gets the default action (not SIGXCPU's repeats).
    sa.sa_flags = kStopSignals[i] == SIGXCPU ? 0 : SA_RESETHAND;
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

void run_finetune(const FinetuneFlags& f) {
  train::TrainerOptions o;
  if (Status st = build_trainer_options(f, &o); !st.ok()) {
    print_error("strata finetune", st);
    set_exit_code(1);
    return;
  }
  StopSignals signals;
  o.stop = signals.flag();
  auto t = train::Trainer::create(o);
  if (!t.ok()) {
    print_error("strata finetune", t.status());
    // A stop signal while the ranks were meeting: nothing trained, nothing to resume.
    const bool interrupted = t.status().code() == StatusCode::kCancelled && signals.stopped();
    set_exit_code(interrupted ? kExitInterrupted : exit_code_for(t.status()));
    return;
  }
  train::Trainer& tr = *t.value();
  // N ranks (mpirun, torchrun): rank 0 speaks for the job; every rank reports its own errors.
  const bool lead = tr.rank() == 0;
  const std::string who = tr.world_size() > 1 ? fmt::format("strata finetune (rank {})", tr.rank()) : "strata finetune";
  const EngineStats s = tr.engine().stats();
  if (lead) {
    std::printf("model %s: %u layers, dim %lu, vocab %lu; %s ops on %s; state: device %s, host %s, NVMe %s\n",
                f.model.c_str(), tr.model_config().num_hidden_layers,
                static_cast<unsigned long>(tr.model_config().hidden_size),
                static_cast<unsigned long>(tr.model_config().vocab_size), tr.ops_name(),
                tr.device_description().c_str(),
                format_bytes(s.tier_bytes[static_cast<int>(Tier::kDevice)]).c_str(),
                format_bytes(s.tier_bytes[static_cast<int>(Tier::kHost)]).c_str(),
                format_bytes(s.tier_bytes[static_cast<int>(Tier::kNvme)]).c_str());
    std::printf("data %s: %lu tokens (%lu training, %lu validation); %lld steps of %u x %u x %u tokens%s%s\n",
                f.data.c_str(), static_cast<unsigned long>(tr.data().tokens()),
                static_cast<unsigned long>(tr.data().train_tokens()), static_cast<unsigned long>(tr.data().val_tokens()),
                static_cast<long long>(f.steps), o.batch, f.seq, o.config.gradient_accumulation_steps,
                tr.world_size() > 1 ? fmt::format(" x {} ranks (state per rank)", tr.world_size()).c_str() : "",
                tr.step() > 0 ? fmt::format(" (resuming at step {})", tr.step()).c_str() : "");
    // The schedule, and where it comes from: a DeepSpeed config without a
    // "scheduler" section keeps its lr constant in DeepSpeed; here --schedule
    // (default cosine) decides, which says so.
    const train::Schedule& sc = o.schedule;
    if (train::is_deepspeed_schedule(sc.kind)) {
      std::printf("lr: %s from the \"scheduler\" section of %s\n", train::schedule_kind_name(sc.kind),
                  f.config.c_str());
    } else {
      std::printf("lr: %s, peak %.3g%s, %lld warm-up steps (--schedule%s)\n", train::schedule_kind_name(sc.kind),
                  sc.lr, sc.kind == train::ScheduleKind::kConstant ? "" : fmt::format(" to {:.3g}", sc.min_lr).c_str(),
                  static_cast<long long>(sc.warmup),
                  f.config.empty() || f.o_schedule->count()
                      ? ""
                      : fmt::format("; {} has no \"scheduler\" section, where DeepSpeed keeps the lr constant: "
                                    "--schedule constant does",
                                    f.config)
                            .c_str());
    }
    // Which precision, whichever of the flags and the config set it.
    std::printf("precision: %s compute copies%s, fp32 masters and gradients, %s optimizer states\n",
                o.config.bf16 ? "bf16" : o.config.fp16.enabled ? "fp16" : "fp32",
                o.config.fp16.enabled ? " with dynamic loss scaling" : "",
                o.config.strata.optimizer_state_dtype == DType::kBF16 ? "bf16" : "fp32");
    if (tr.data().by_document()) {
      const double positions = static_cast<double>(tr.data().train_windows()) * (f.seq + 1);
      std::printf("documents %s: %lu with a target, %lu longer than --seq + 1 (%s), %lu training windows, %lu "
                  "validation; %.1f%% of training positions are padding\n",
                  f.documents.c_str(), static_cast<unsigned long>(tr.data().documents()),
                  static_cast<unsigned long>(tr.data().long_documents()),
                  f.truncate_documents ? "truncated" : "their tails in more windows",
                  static_cast<unsigned long>(tr.data().train_windows()),
                  static_cast<unsigned long>(tr.data().val_windows()),
                  100.0 * static_cast<double>(tr.data().train_padding()) / positions);
    }
    std::fflush(stdout);
  }
  auto r = tr.run();
  if (!r.ok()) {
    print_error(who.c_str(), r.status());
    set_exit_code(exit_code_for(r.status()));
    return;
  }
  if (r->interrupted) {
    if (lead)
      std::printf("interrupted at step %lld; resume with: strata finetune ... --resume %s\n",
                  static_cast<long long>(r->steps_done), r->last_checkpoint.c_str());
    set_exit_code(kExitInterrupted);
    return;
  }
  set_exit_code(0);
  if (!lead) return;
  std::printf("done: %lld steps, %.0f tokens/s", static_cast<long long>(r->steps_done), r->tokens_per_s);
  if (r->initial_val_loss >= 0)
    std::printf(", validation loss %.4f -> %.4f", r->initial_val_loss, r->final_val_loss);
  if (r->initial_val_loss >= 0 && r->export_rounds)
    std::printf(" (of the %s weights trained%s; %s holds them %srounded to %s)", dtype_name(r->trained_dtype),
                r->export_merged ? " and fp32 adapters" : "", r->exported_model.c_str(),
                r->export_merged ? "merged and " : "", dtype_name(r->exported_dtype));
  std::printf("\n");
}

}  // namespace

void register_finetune(CLI::App& app) {
  auto f = std::make_shared<FinetuneFlags>();
  CLI::App* cmd = app.add_subcommand("finetune", "Fine-tune a Hugging Face Llama, Mistral, Qwen2 or Qwen3 model with its state offloaded");
  add_finetune_flags(cmd, f.get());
  cmd->callback([f] { run_finetune(*f); });
}

}  // namespace strata::tools
