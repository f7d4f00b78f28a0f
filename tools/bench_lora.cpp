// `strata bench lora`: LoRA fine-tuning with the frozen base streamed from
// NVMe, against the same run with the base in RAM, and the NVMe read rate
// it reaches against the device's read ceiling, all in the same run.
//
// Setup (untimed): a random bf16 Llama-shaped model (--layers, --dim,
// --ffn-dim, --vocab) and random token data in a fresh directory under
// --dir. Two trainers over the same model and data, CPU model ops, LoRA rank
// --rank on every projection:
//   ram   every compute copy in host RAM (the default placement);
//   nvme  the parameters on NVMe under --dir with a host budget (--host-mem)
//         smaller than the frozen base, so each step streams the base in.
// Measured, --reps times, interleaved, medians reported:
//   step      one training step of each trainer (wall time; tokens/s);
//   read      the engine's NVMe bytes read during the nvme trainer's step /
//             its wall time (GB/s);
//   ceiling   an O_DIRECT sequential read of a --ceiling-size file in the same
//             directory (strata bench io's engine and settings: 1 MiB blocks,
//             8 MiB requests, queue depth 32).
// Figures: speed = ram step / nvme step (1.0: streaming costs nothing);
// io = read / ceiling (how much of the device the streaming uses).
// Every file is removed at the end, also on error.
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "commands.h"
#include "common/log.h"
#include "common/units.h"
#include "model/llama_config.h"
#include "model/llama_init.h"
#include "runtime/model_spec.h"
#include "train/trainer.h"

namespace strata::tools {
namespace {

namespace fs = std::filesystem;

struct BenchLoraOptions {
  std::string dir;
  uint32_t layers = 16, heads = 16, kv_heads = 4, rank = 16, reps = 7, batch = 1, seq = 128;
  uint64_t dim = 1024, ffn_dim = 2816, vocab = 8000;
  std::string host_mem = "192MiB";
  std::string ceiling_size = "512MiB";
  int threads = 0;
  bool json = false;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Result<std::unique_ptr<train::Trainer>> make_trainer(const BenchLoraOptions& o, const std::string& work,
                                                     const std::string& name, bool nvme, uint64_t host_budget) {
  train::TrainerOptions t;
  t.model_dir = work + "/model";
  t.data.path = work + "/tokens.u32";
  t.data.format = train::DataFormat::kU32;
  t.data.vocab = 0;  // the model's
  t.data.seq = o.seq;
  t.data.val_fraction = 0;
  t.batch = o.batch;
  t.steps = 1000;
  t.schedule.kind = train::ScheduleKind::kConstant;
  t.schedule.lr = 1e-4;
  t.out_dir = work + "/out-" + name;
  t.export_model = false;
  t.progress = train::ProgressMode::kQuiet;
  t.threads = o.threads;
  t.device = train::TrainDevice::kCpu;
  t.config.bf16 = true;
  t.lora.rank = o.rank;
  t.lora.alpha = 2.0 * o.rank;
  t.lora.targets = kAllLoraTargets;
  t.config.zero.offload_optimizer.device = OffloadDevice::kCpu;
  if (nvme) {
    const std::string swap = work + "/nvme";
    fs::create_directories(swap);
    // The base's compute copies on NVMe; the adapters' masters, moments and
    // gradients (a few MB) in RAM.
    t.config.strata.nvme = {NvmeDir{swap, 0}};
    GroupTierRule r;
    r.match = "*";
    r.compute = Tier::kNvme;
    r.master = r.optimizer = r.grad = Tier::kHost;
    t.config.strata.groups = {r};
    t.config.strata.host_memory = host_budget;
  } else {
    t.config.zero.offload_param.device = OffloadDevice::kCpu;
  }
  return train::Trainer::create(t);
}

Status run(const BenchLoraOptions& o, const std::string& work, uint64_t host_budget, uint64_t ceiling_bytes) {
  model::LlamaConfig c;
  c.num_hidden_layers = o.layers;
  c.hidden_size = o.dim;
  c.num_attention_heads = o.heads;
  c.num_key_value_heads = o.kv_heads;
  c.intermediate_size = o.ffn_dim;
  c.vocab_size = o.vocab;
  c.max_position_embeddings = std::max<uint64_t>(o.seq, 2048);
  c.torch_dtype = DType::kBF16;
  fs::create_directories(work + "/model");
  STRATA_RETURN_IF_ERROR(model::write_random_llama(work + "/model", c, model::StDType::kBF16, 7));
  {
    // Enough tokens for every step of every rep without wrapping much.
    const uint64_t n = static_cast<uint64_t>(o.batch) * (o.seq + 1) * (o.reps + 2) * 2 + 1;
    std::vector<uint32_t> toks(n);
    std::mt19937 rng(5);
    for (auto& t : toks) t = static_cast<uint32_t>(rng() % o.vocab);
    FILE* f = std::fopen((work + "/tokens.u32").c_str(), "wb");
    if (!f || std::fwrite(toks.data(), 4, n, f) != n || std::fclose(f) != 0)
      return Status(StatusCode::kIoError, "writing the bench's token file under " + work);
  }
  STRATA_ASSIGN_OR_RETURN(ModelSpec spec, llama_model_spec(c.shape()));
  const uint64_t base_bytes = spec.numel() * 2;  // bf16
  if (host_budget >= base_bytes)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("--host-mem {} holds the whole frozen base ({}): give less so the base streams from "
                              "NVMe (and if less does not fit the run's buffers, the model is too small for this "
                              "bench: raise --layers or --dim)",
                              format_bytes(host_budget), format_bytes(base_bytes)));
  STRATA_ASSIGN_OR_RETURN(auto ram, make_trainer(o, work, "ram", false, 0));
  STRATA_ASSIGN_OR_RETURN(auto nvme, make_trainer(o, work, "nvme", true, host_budget));
  const EngineStats s0 = nvme->engine().stats();
  if (!o.json)
    std::printf("model: %u layers, dim %lu, ffn %lu, vocab %lu: frozen bf16 base %s; LoRA rank %u on 7 projections; "
                "batch %u x seq %u\nnvme trainer: host budget %s, NVMe holds %s, host %s\n",
                o.layers, static_cast<unsigned long>(o.dim), static_cast<unsigned long>(o.ffn_dim),
                static_cast<unsigned long>(o.vocab), format_bytes(base_bytes).c_str(), o.rank, o.batch, o.seq,
                format_bytes(host_budget).c_str(),
                format_bytes(s0.tier_bytes[static_cast<int>(Tier::kNvme)]).c_str(),
                format_bytes(s0.tier_bytes[static_cast<int>(Tier::kHost)]).c_str());
  // Warm-up step of each (untimed).
  STRATA_RETURN_IF_ERROR(ram->train_step().status());
  STRATA_RETURN_IF_ERROR(nvme->train_step().status());
  STRATA_ASSIGN_OR_RETURN(IoCeiling warm, measure_read_ceiling(work, ceiling_bytes));
  (void)warm;
  std::vector<double> t_ram, t_nvme, read_gbps, ceiling, per_step_read;
  for (uint32_t r = 0; r < o.reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(ram->train_step().status());
    t_ram.push_back(seconds_since(t0));
    const uint64_t before = nvme->engine().stats().nvme_read_bytes;
    t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(nvme->train_step().status());
    const double s = seconds_since(t0);
    t_nvme.push_back(s);
    const uint64_t read = nvme->engine().stats().nvme_read_bytes - before;
    per_step_read.push_back(static_cast<double>(read));
    read_gbps.push_back(static_cast<double>(read) / s / 1e9);
    STRATA_ASSIGN_OR_RETURN(IoCeiling ce, measure_read_ceiling(work, ceiling_bytes));
    ceiling.push_back(ce.read_gbps);
    if (!o.json)
      std::printf("rep %u: ram step %.3f s, nvme step %.3f s (read %s, %.3f GB/s), ceiling read %.3f GB/s\n", r,
                  t_ram.back(), s, format_bytes(read).c_str(), read_gbps.back(), ceiling.back());
  }
  const double tok = static_cast<double>(o.batch) * o.seq;
  const double m_ram = median(t_ram), m_nvme = median(t_nvme), m_read = median(read_gbps), m_ceil = median(ceiling);
  if (o.json) {
    nlohmann::json j{{"base_bytes", base_bytes},
                     {"host_budget", host_budget},
                     {"rank", o.rank},
                     {"tokens_per_step", tok},
                     {"ram_step_s", m_ram},
                     {"nvme_step_s", m_nvme},
                     {"ram_tokens_per_s", tok / m_ram},
                     {"nvme_tokens_per_s", tok / m_nvme},
                     {"speed_ratio", m_ram / m_nvme},
                     {"nvme_read_bytes_per_step", median(per_step_read)},
                     {"nvme_read_gbps", m_read},
                     {"ceiling_read_gbps", m_ceil},
                     {"io_ratio", m_read / m_ceil},
                     {"reps", o.reps}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("medians over %u reps:\n", o.reps);
    std::printf("  tokens/s   ram %.1f   nvme %.1f   nvme / ram = %.3f\n", tok / m_ram, tok / m_nvme, m_ram / m_nvme);
    std::printf("  NVMe read  %s per step at %.3f GB/s; ceiling %.3f GB/s; read / ceiling = %.3f\n",
                format_bytes(static_cast<uint64_t>(median(per_step_read))).c_str(), m_read, m_ceil, m_read / m_ceil);
  }
  return {};
}

void run_bench_lora(const BenchLoraOptions& o) {
  auto fail = [](int code, const std::string& msg) {
    std::fprintf(stderr, "strata bench lora: %s\n", msg.c_str());
    set_exit_code(code);
  };
  struct stat st {};
  if (o.dir.empty()) return fail(1, "--dir is required (a directory on the SSD to measure)");
  if (::stat(o.dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return fail(1, "--dir " + o.dir + " is not an existing directory");
  if (o.reps < 1 || o.rank < 1 || o.layers < 1) return fail(1, "--reps, --rank and --layers must be at least 1");
  auto host = parse_bytes(o.host_mem);
  if (!host.ok()) return fail(1, "--host-mem: " + host.status().message());
  auto ceil = parse_bytes(o.ceiling_size);
  if (!ceil.ok() || *ceil < (8ull << 20) || *ceil % (8ull << 20) != 0)
    return fail(1, "--ceiling-size must be a multiple of 8 MiB");
  const std::string work = fmt::format("{}/strata-bench-lora.{}", o.dir, ::getpid());
  std::error_code ec;
  fs::create_directories(work, ec);
  if (ec) return fail(1, "cannot create " + work + ": " + ec.message());
  Status s = run(o, work, *host, *ceil);
  fs::remove_all(work, ec);
  if (!s.ok()) return fail(s.code() == StatusCode::kInternal ? 2 : 1, s.message());
}

}  // namespace

void register_bench_lora(CLI::App& bench) {
  auto o = std::make_shared<BenchLoraOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "lora", "LoRA with the frozen base streamed from NVMe vs in RAM, and its NVMe read rate vs the device's ceiling");
  cmd->add_option("--dir", o->dir, "Directory on the SSD to measure (model, data and swap files go under it)");
  cmd->add_option("--layers", o->layers, "Decoder layers")->capture_default_str();
  cmd->add_option("--dim", o->dim, "Hidden size")->capture_default_str();
  cmd->add_option("--heads", o->heads, "Attention heads")->capture_default_str();
  cmd->add_option("--kv-heads", o->kv_heads, "Key/value heads")->capture_default_str();
  cmd->add_option("--ffn-dim", o->ffn_dim, "MLP intermediate size")->capture_default_str();
  cmd->add_option("--vocab", o->vocab, "Vocabulary size")->capture_default_str();
  cmd->add_option("--rank", o->rank, "LoRA rank (all seven projections)")->capture_default_str();
  cmd->add_option("--batch", o->batch, "Sequences per step")->capture_default_str();
  cmd->add_option("--seq", o->seq, "Tokens per sequence")->capture_default_str();
  cmd->add_option("--host-mem", o->host_mem, "Host budget of the NVMe run (less than the base)")->capture_default_str();
  cmd->add_option("--ceiling-size", o->ceiling_size, "Bytes the read ceiling reads each rep")->capture_default_str();
  cmd->add_option("--reps", o->reps, "Timed steps per trainer (medians)")->capture_default_str();
  cmd->add_option("--threads", o->threads, "CPU compute threads (0: all)")->capture_default_str();
  cmd->add_flag("--json", o->json, "One JSON object");
  cmd->callback([o] { run_bench_lora(*o); });
}

}  // namespace strata::tools
