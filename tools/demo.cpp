// `strata demo`: a small fine-tune, start to finish, with its parameters and
// optimizer states on NVMe, in a temporary directory:
//   1. a randomly initialised Llama model (init-model's code),
//   2. training text from a small grammar (train/demo_data.h), generated here,
//   3. validation loss, training with the loss printed as it falls, validation
//      loss again, and the figures (tokens/s, wall time),
//   4. the directory removed (also on Ctrl-C / SIGTERM), unless --keep.
// Sized to finish in about a minute on two CPU cores with no GPU; with a GPU
// (--device auto, the default) the model math runs there (train/trainer.h).
#include <signal.h>
#include <unistd.h>

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "common/units.h"
#include "finetune.h"
#include "finetune_flags.h"
#include "model/llama_config.h"
#include "model/llama_init.h"
#include "train/demo_data.h"
#include "train/trainer.h"

namespace strata::tools {
namespace {

namespace fs = std::filesystem;

struct DemoFlags {
  std::string dir;
  int64_t steps = 150;
  bool keep = false;
  int threads = 0;
  bool quiet = false;
  std::string device = "auto";
};

// The demo model: 4 layers, dim 128, GQA 4/2 heads, SwiGLU 352, byte vocab,
// tied embeddings: about 0.8M parameters, fp32 on disk.
model::LlamaConfig demo_model_config() {
  model::LlamaConfig c;
  c.num_hidden_layers = 4;
  c.hidden_size = 128;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.intermediate_size = 352;
  c.vocab_size = 256;
  c.max_position_embeddings = 512;
  c.tie_word_embeddings = true;
  c.torch_dtype = DType::kF32;
  return c;
}

constexpr const char* kOwnerFile = ".strata-demo-owner";  // "<pid> <host>" of the demo using the directory

std::string host_name() {
  char buf[256] = {};
  return ::gethostname(buf, sizeof(buf) - 1) == 0 ? buf : "?";
}

// Directories of earlier demos under `parent` whose process died without
// removing them (SIGKILL, a crash): removed, as the swap store reclaims its
// run directories. Only this host's, only dead pids, never a --keep one
// (those have no owner file).
void reclaim_dead_demos(const std::string& parent) {
  std::error_code ec;
  for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("strata-demo-", 0) != 0) continue;
    std::FILE* f = std::fopen((it->path() / kOwnerFile).c_str(), "r");
    if (!f) continue;
    long pid = 0;
    char host[256] = {};
    const int n = std::fscanf(f, "%ld %255s", &pid, host);
    std::fclose(f);
    if (n != 2 || pid <= 0 || host_name() != host) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM) continue;  // alive
    std::error_code rec;
    fs::remove_all(it->path(), rec);
    if (!rec) std::printf("removed %s, left by a demo that died (pid %ld)\n", it->path().c_str(), pid);
  }
}

class TempDir {
 public:
  explicit TempDir(bool keep) : keep_(keep) {}
  ~TempDir() { remove(); }
  Status make(const std::string& parent) {
    reclaim_dead_demos(parent);
    std::string tmpl = parent + "/strata-demo-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (!mkdtemp(buf.data())) return Status::from_errno(errno, "demo: cannot make a directory under " + parent);
    path_ = buf.data();
    if (!keep_) {
      if (std::FILE* f = std::fopen((path_ + "/" + kOwnerFile).c_str(), "w")) {
        std::fprintf(f, "%ld %s\n", static_cast<long>(::getpid()), host_name().c_str());
        std::fclose(f);
      }
    }
    return {};
  }
  void remove() {
    if (path_.empty() || keep_) return;
    std::error_code ec;
    fs::remove_all(path_, ec);
    if (ec) std::fprintf(stderr, "strata demo: could not remove %s: %s\n", path_.c_str(), ec.message().c_str());
    path_.clear();
  }
  const std::string& path() const { return path_; }

 private:
  bool keep_;
  std::string path_;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int run_demo(const DemoFlags& f) {
  const auto t0 = std::chrono::steady_clock::now();
  std::string parent = f.dir;
  if (parent.empty()) {
    const char* tmp = std::getenv("TMPDIR");  // the POSIX convention, not a Strata tunable
    parent = tmp && *tmp ? tmp : "/tmp";
  }
  if (f.steps < 1) {
    std::fprintf(stderr, "strata demo: --steps must be at least 1\n");
    return 1;
  }
  // As finetune: checked before the temp dir is made (100000 threads crashed).
  if (f.threads < 0 || f.threads > (1 << 16)) {
    std::fprintf(stderr, "strata demo: --threads %d is outside [0, 65536]\n", f.threads);
    return 1;
  }
  auto device = parse_train_device(f.device);
  if (!device.ok()) {
    std::fprintf(stderr, "strata demo: --device: %s\n", device.status().message().c_str());
    return 1;
  }
  StopSignals signals;  // before anything is created: Ctrl-C always cleans up
  TempDir tmp(f.keep);
  if (Status st = tmp.make(parent); !st.ok()) {
    print_error("strata demo", st);
    return 1;
  }
  const std::string& d = tmp.path();
  std::printf("strata demo in %s%s\n", d.c_str(), f.keep ? " (kept: --keep)" : " (removed at the end)");

  // 1. model, 2. data.
  const model::LlamaConfig mc = demo_model_config();
  const std::string model_dir = d + "/model";
  std::error_code ec;
  fs::create_directories(model_dir, ec);
  if (Status st = model::write_random_llama(model_dir, mc, model::StDType::kF32, /*seed=*/1); !st.ok()) {
    std::fprintf(stderr, "strata demo: making the model: %s\n", st.message().c_str());
    return exit_code_for(st);
  }
  const std::string data = d + "/data.txt";
  constexpr uint64_t kDataBytes = 400000;
  if (Status st = train::write_demo_text(data, kDataBytes); !st.ok()) {
    print_error("strata demo", st);
    return exit_code_for(st);
  }
  const std::string sample = train::demo_text(160).substr(0, 120);
  std::printf("model: %u layers, dim %lu, %u heads (%u kv), vocab %lu (bytes), tied embeddings, random init\n",
              mc.num_hidden_layers, static_cast<unsigned long>(mc.hidden_size),
              mc.num_attention_heads, mc.num_key_value_heads,
              static_cast<unsigned long>(mc.vocab_size));
  std::printf("data: %s, %lu bytes of generated text, e.g.\n  %s\n", data.c_str(),
              static_cast<unsigned long>(kDataBytes), [&] {
                std::string s = sample;
                for (size_t i = 0; i < s.size(); ++i)
                  if (s[i] == '\n') s.replace(i, 1, "\n  "), i += 2;
                return s;
              }().c_str());

  // 3. train with parameters and optimizer states on NVMe (this directory).
  const std::string nvme = d + "/nvme";
  fs::create_directories(nvme, ec);
  train::TrainerOptions o;
  o.model_dir = model_dir;
  o.data.path = data;
  o.data.seq = 128;
  o.data.val_fraction = 0.05;
  o.data.seed = 1234;
  o.batch = 8;
  o.steps = f.steps;
  o.schedule.kind = train::ScheduleKind::kCosine;
  o.schedule.lr = 3e-3;
  o.schedule.min_lr = 3e-4;
  o.schedule.warmup = 10;
  o.config.zero.offload_param.device = OffloadDevice::kNvme;
  o.config.zero.offload_param.nvme_path = nvme;
  o.config.zero.offload_optimizer.device = OffloadDevice::kNvme;
  o.config.zero.offload_optimizer.nvme_path = nvme;
  o.config.gradient_clipping = 1.0;
  o.config.optimizer.weight_decay = 0.0;
  o.eval_every = 50;
  o.eval_batches = 8;
  o.out_dir = d + "/out";
  o.export_model = true;
  o.log_every = 10;
  o.threads = f.threads;
  o.device = device.value();
  o.progress = f.quiet ? train::ProgressMode::kQuiet : train::ProgressMode::kLines;
  o.stop = signals.flag();
  auto t = train::Trainer::create(o);
  if (!t.ok()) {
    print_error("strata demo", t.status());
    return exit_code_for(t.status());
  }
  const EngineStats s = t.value()->engine().stats();
  std::printf("engine: %s ops on %s; state on device %s, host %s, NVMe %s (%s)\n", t.value()->ops_name(),
              t.value()->device_description().c_str(),
              format_bytes(s.tier_bytes[static_cast<int>(Tier::kDevice)]).c_str(),
              format_bytes(s.tier_bytes[static_cast<int>(Tier::kHost)]).c_str(),
              format_bytes(s.tier_bytes[static_cast<int>(Tier::kNvme)]).c_str(), nvme.c_str());
  std::printf("training %lld steps of %u x %u tokens (AdamW, cosine lr %.0e -> %.0e, warm-up %lld)\n",
              static_cast<long long>(o.steps), o.batch, o.data.seq, o.schedule.lr, o.schedule.min_lr,
              static_cast<long long>(o.schedule.warmup));
  std::fflush(stdout);
  auto r = t.value()->run();
  if (!r.ok()) {
    print_error("strata demo", r.status());
    return exit_code_for(r.status());
  }
  if (r->interrupted) {
    if (f.keep)
      std::printf("interrupted at step %lld; %s kept (--keep), its checkpoint in out/\n",
                  static_cast<long long>(r->steps_done), d.c_str());
    else
      std::printf("interrupted at step %lld; removing %s\n", static_cast<long long>(r->steps_done), d.c_str());
    return kExitInterrupted;
  }
  const EngineStats e = t.value()->engine().stats();
  t.value().reset();  // closes the engine: swap files go before the directory does
  std::printf("\nvalidation loss: %.4f before, %.4f after (nats per byte; uniform guessing is %.4f)\n",
              r->initial_val_loss, r->final_val_loss, std::log(256.0));
  std::printf("training: %.0f tokens/s, %.3f s per step; NVMe read %s, written %s\n", r->tokens_per_s,
              r->mean_step_seconds, format_bytes(e.nvme_read_bytes).c_str(),
              format_bytes(e.nvme_write_bytes).c_str());
  std::printf("wall time %.1f s\n", seconds_since(t0));
  if (f.keep) std::printf("kept %s (model: out/model, metrics: out/metrics.jsonl)\n", d.c_str());
  if (!(r->final_val_loss < r->initial_val_loss)) {
    std::fprintf(stderr, "strata demo: the validation loss did not fall\n");
    return 2;
  }
  return 0;
}

}  // namespace

void register_demo(CLI::App& app) {
  auto f = std::make_shared<DemoFlags>();
  CLI::App* cmd = app.add_subcommand(
      "demo", "A small fine-tune with parameters and optimizer states on NVMe, in a temporary directory");
  cmd->add_option("--dir", f->dir, "Where to make the temporary directory (default $TMPDIR or /tmp)");
  cmd->add_option("--steps", f->steps, "Training steps")->capture_default_str();
  cmd->add_flag("--keep", f->keep, "Keep the directory (model, data, metrics, checkpoints)");
  cmd->add_option("--threads", f->threads, "CPU compute threads (0: all)")->capture_default_str();
  cmd->add_flag("--quiet", f->quiet, "No per-step lines: the set-up lines and the summary only");
  cmd->add_option("--device", f->device, "auto (the GPU when CUDA model ops can run there, else the CPU) | cuda | cpu")
      ->capture_default_str();
  cmd->callback([f] { set_exit_code(run_demo(*f)); });
}

}  // namespace strata::tools
