// `strata plan`: where a model's state would live (device / host / NVMe), how
// many bytes cross each link per step, and a predicted step time, for a
// Hugging Face Llama config of any size (nothing is allocated for the model:
// a 70B plan is arithmetic on a few kilobytes, src/runtime/planner.h).
//
// Bandwidths: given by flags, else measured here in a few seconds (NVMe read
// and write through the I/O engine with O_DIRECT in the first --nvme
// directory, the CPU AdamW step on 16M parameters; host<->device copies when
// this machine has a GPU), else assumed (GPU FLOP/s always; host<->device
// without a GPU here: the defaults describe an H100/H200-class card on
// PCIe 5.0 and are printed as "assumed"). --device cpu plans the host
// backend: its copies are one thread's memcpy (measured), they and the
// optimizer step take the cores that compute (Workload::shared_cores), and
// the compute rate is measured on one layer and the head of the model
// (train/cpu_probe.h) unless --gpu-tflops gives it.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "commands.h"
#include "finetune_flags.h"
#include "common/dtype_parse.h"
#include "common/host_memory.h"
#include "common/units.h"
#include "cpu_optim/optimizer.h"
#include "device/cuda_backend.h"
#include "device/cuda_loader.h"
#include "io/io_engine.h"
#include "model/llama_config.h"
#include "runtime/config.h"
#include "runtime/planner.h"
#include "comm/nccl_comm.h"
#include "train/cpu_probe.h"
#include "train/cuda_ops.h"
#include "train/device_sizes.h"
#include "train/lora.h"
#include "train/trainer.h"

namespace strata::tools {
namespace {

using json = nlohmann::json;

// Assumed figures (printed as such): an H100/H200-class GPU on PCIe 5.0 x16
// (about 50 GB/s each way with pinned memory), 400 TFLOP/s sustained bf16
// dense matmul (about 40% of an H100 SXM's peak), one PCIe 4.0 NVMe drive,
// and a CPU AdamW step bound by ~20 GB/s of memory bandwidth at 28 bytes per
// parameter.
constexpr double kAssumedH2dGBps = 50;
constexpr double kAssumedGpuTflops = 400;
constexpr double kAssumedLinkGBps = 12.5;
constexpr double kAssumedNvmeReadGBps = 6;
constexpr double kAssumedNvmeWriteGBps = 4;
constexpr double kAssumedCpuAdamParamsPerS = 0.7e9;
constexpr double kAssumedMemcpyGBps = 8;  // --device cpu --no-measure: one thread's memcpy

struct PlanCliOptions {
  std::string model;
  std::string gpu_mem;
  std::string host_mem;
  std::string pinned_mem;
  std::string nvme;
  std::string nvme_capacity;
  std::string config;
  std::string dtype;
  std::string optimizer_states;
  uint64_t batch = 1;
  uint64_t seq = 2048;
  uint32_t grad_accum = 0;
  bool no_checkpointing = false;
  bool measure = true;
  double h2d_gbps = 0, d2h_gbps = 0, nvme_read_gbps = 0, nvme_write_gbps = 0;
  double cpu_adam_params_per_s = 0, gpu_tflops = 0;
  uint32_t world_size = 0;  // 0: the config's (1)
  uint32_t ranks_per_host = 0;  // 0: every rank on this host
  CLI::Option* batch_opt = nullptr;
  double link_gbps = 0;
  std::string measure_size = "256MiB";
  std::string device = "cuda";  // cuda: a GPU; cpu: the host backend (strata finetune --device cpu)
  int threads = 0;              // --device cpu: the compute threads measured (0: all)
  uint32_t lora_rank = 0;       // LoRA: a frozen base and rank-R adapters (strata finetune --lora-rank)
  std::string lora_targets;     // PEFT module names (default q_proj,v_proj)
  bool json = false;
};

// --json: every refusal is also one JSON object on stdout, so a script
// reading it never gets nothing.
bool json_errors = false;

int fail(const std::string& msg) {
  std::fprintf(stderr, "strata plan: %s\n", msg.c_str());
  if (json_errors) std::printf("%s\n", nlohmann::json({{"fits", false}, {"error", msg}}).dump(2).c_str());
  return 1;
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

struct Figure {
  double value = 0;
  std::string source;  // "given", "measured", "assumed"
  std::string note;
};

// NVMe read and write through the I/O engine: one file of `bytes` in `dir`,
// written with 8 MiB requests 16 deep, fsync'd, read back (O_DIRECT: from the
// drive, not the page cache), removed.
// This machine's first GPU, when the CUDA module loads and sees one: its
// name and the memory Strata could use there (free memory less the
// backend's margin, as a "detect" budget gets it). Probed once.
struct ThisGpu {
  CudaBackend module;
  std::string name;
  uint64_t free_bytes = 0;
};
Result<ThisGpu> this_gpu() {
  static const Result<ThisGpu> probed = []() -> Result<ThisGpu> {
    STRATA_ASSIGN_OR_RETURN(CudaBackend module, load_cuda_backend());
    if (module.device_count == 0) return Status(StatusCode::kUnavailable, "no GPU is visible");
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<DeviceBackend> dev, create_cuda_backend(module, 0, 0));
    return ThisGpu{module, dev->name(), dev->memory_stats().budget};
  }();
  return probed;
}

Status measure_nvme(const std::string& dir, uint64_t bytes, Figure* rd, Figure* wr) {
  constexpr uint64_t kReq = 8ull << 20;
  constexpr int kDepth = 16;
  bytes = std::max(kReq, bytes / kReq * kReq);
  STRATA_ASSIGN_OR_RETURN(auto engine, io::make_io_engine({}));
  const std::string path = fmt::format("{}/strata-plan-probe.{}", dir, ::getpid());
  io::IoOpenOptions oo;
  oo.write = true;
  oo.create = true;
  oo.truncate = true;
  STRATA_ASSIGN_OR_RETURN(auto file, engine->open(path, oo));
  struct Remover {
    std::string p;
    ~Remover() { ::unlink(p.c_str()); }
  } remover{path};
  STRATA_ASSIGN_OR_RETURN(auto buf, HostArray<unsigned char>::create(kReq * kDepth));
  for (uint64_t i = 0; i < kReq * kDepth; ++i) buf.data()[i] = static_cast<unsigned char>(i * 131 + 7);
  STRATA_RETURN_IF_ERROR(file->preallocate(0, bytes));
  auto pass = [&](io::IoOpKind op) -> Result<double> {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<io::IoRequest> reqs;
    for (uint64_t off = 0; off < bytes; off += kReq)
      reqs.push_back({op, file.get(), off, kReq, buf.data() + (off / kReq % kDepth) * kReq});
    // The engine keeps queue_depth pieces in flight; submitting them all at
    // once lets it batch.
    for (const auto& r : reqs) engine->submit(r);
    STRATA_RETURN_IF_ERROR(engine->wait_all());
    if (op == io::IoOpKind::kWrite) STRATA_RETURN_IF_ERROR(file->sync());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  STRATA_ASSIGN_OR_RETURN(double tw, pass(io::IoOpKind::kWrite));
  STRATA_ASSIGN_OR_RETURN(double tr, pass(io::IoOpKind::kRead));
  const std::string note = fmt::format("{} in {}, {} backend{}", format_bytes(bytes), dir, engine->backend_name(),
                                       file->direct() ? ""
                                                      : ", buffered: the file system refuses O_DIRECT, so this "
                                                        "is page-cache speed");
  *wr = {bytes / tw, "measured", note};
  *rd = {bytes / tr, "measured", note};
  return Status::ok_status();
}

// The CPU AdamW step (fp32 master, fp32 grads, `state_dtype` moments, bf16
// copy out) on 16M parameters: the median of 3 steps after a warm-up.
Result<Figure> measure_cpu_adam(DType state_dtype) {
  constexpr size_t n = 16u << 20;
  STRATA_ASSIGN_OR_RETURN(auto p, HostArray<float>::create(n));
  STRATA_ASSIGN_OR_RETURN(auto g, HostArray<float>::create(n));
  STRATA_ASSIGN_OR_RETURN(auto m, HostArray<unsigned char>::create(n * dtype_size(state_dtype)));
  STRATA_ASSIGN_OR_RETURN(auto v, HostArray<unsigned char>::create(n * dtype_size(state_dtype)));
  STRATA_ASSIGN_OR_RETURN(auto out, HostArray<uint16_t>::create(n));
  for (size_t i = 0; i < n; ++i) {
    p.data()[i] = 0.01f * static_cast<float>(i % 101);
    g.data()[i] = 0.001f * static_cast<float>(i % 37);
  }
  std::memset(m.data(), 0, n * dtype_size(state_dtype));
  std::memset(v.data(), 0, n * dtype_size(state_dtype));
  cpu_optim::OptimizerConfig cfg;
  cfg.kind = cpu_optim::OptimizerKind::kAdamW;
  cfg.lr = 1e-4;
  cfg.weight_decay = 0.01;
  cpu_optim::StepBuffers b;
  b.params = p.data();
  b.grads = g.data();
  b.state[0] = m.data();
  b.state[1] = v.data();
  b.state_dtype = state_dtype;
  b.params_out = out.data();
  std::vector<double> times;
  for (int s = 1; s <= 4; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(cpu_optim::step(cfg, s, b, n));
    if (s > 1) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return Figure{n / median(times), "measured",
                fmt::format("AdamW on 16M parameters, {} moments", dtype_name(state_dtype))};
}

// --device cpu: the host backend copies with memcpy on its stream threads, one
// copy per thread. The median of 5 copies of 64 MiB (past the caches) after
// a warm-up that also faults both buffers in.
Figure measure_memcpy() {
  constexpr size_t n = 64u << 20;
  auto src = HostArray<unsigned char>::create(n);
  auto dst = HostArray<unsigned char>::create(n);
  if (!src.ok() || !dst.ok()) return {kAssumedMemcpyGBps * 1e9, "assumed", "memcpy on one thread (no memory to measure)"};
  std::memset(src->data(), 1, n);
  std::memset(dst->data(), 0, n);
  std::vector<double> times;
  volatile unsigned char sink = 0;
  for (int i = 0; i < 6; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dst->data(), src->data(), n);
    sink = sink + dst->data()[(static_cast<size_t>(i) * 4099u) % n];  // the copy is used: not elided
    if (i > 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return {n / median(times), "measured", "memcpy of 64 MiB on one thread: the host backend's copies"};
}

// --device cpu: the CPU ops' micro-batch at the model's shape (one layer,
// the head and the embedding timed, train/cpu_probe.h), as the rate that
// gives that time for the FLOPs this plan counts (Workload): the head's
// softmax, the embedding and the conversions of bf16 weights are in it.
Result<Figure> measure_cpu_compute(const model::LlamaConfig& mc, const LlamaShape& shape, const PlanCliOptions& o) {
  train::LlamaDims dims = train::llama_dims(mc);
  if (shape.lora_rank > 0) {  // the adapters run too (their scale does not change the time)
    dims.lora_targets = shape.lora_targets;
    dims.lora_rank = static_cast<int64_t>(shape.lora_rank);
    dims.lora_scaling = 1.0f;
  }
  auto p = train::probe_cpu_compute(dims, shape.layers, shape.dtype, static_cast<int64_t>(o.batch),
                                    static_cast<int64_t>(o.seq), {.threads = o.threads, .frozen = o.lora_rank > 0});
  if (!p.ok()) return p.status();
  const train::LlamaDims& d = p->dims;
  const uint64_t layers = shape.layers, vocab_dim = static_cast<uint64_t>(d.vocab * d.dim);
  const uint64_t numel = layers * static_cast<uint64_t>(d.layer_params()) + static_cast<uint64_t>(d.dim) +
                         vocab_dim * (d.tied ? 1 : 2);
  Workload w;
  w.activation_checkpointing = !o.no_checkpointing;
  w.attention_forward_flops_per_token = attention_forward_flops_per_token(
      layers, static_cast<uint64_t>(d.heads), static_cast<uint64_t>(d.head_dim), static_cast<uint64_t>(p->seq));
  w.non_matmul_params = d.tied ? 0 : vocab_dim;
  if (o.lora_rank > 0) {  // the probe ran a frozen base and trainable adapters
    uint64_t adapters = 0;
    for (LayerTensor t : kAllLayerTensors)
      if (weight_row(t).feature == Feature::kLora) adapters += static_cast<uint64_t>(d.numel(t));
    w.frozen_matmul_params = numel - layers * adapters - w.non_matmul_params;
  }
  const double tokens = static_cast<double>(p->batch * p->seq);
  return Figure{flops_per_token(numel, w) * tokens / p->micro_batch_s, "measured",
                fmt::format("{}, {}",
                            o.threads == 1  ? std::string("1 thread")
                            : o.threads > 1 ? fmt::format("{} threads", o.threads)
                                            : std::string("all threads"),
                            p->description())};
}

json link_json(const LinkBytes& l) {
  return {{"nvme_read", l.nvme_read}, {"nvme_write", l.nvme_write}, {"h2d", l.h2d}, {"d2h", l.d2h}, {"comm", l.comm}};
}

json plan_json(const Plan& plan) {
  json tiers = json::object();
  for (Tier t : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
    json kinds = json::object();
    for (int k = 0; k < kNumStateKinds; ++k)
      kinds[state_kind_name(static_cast<StateKind>(k))] = plan.bytes[static_cast<int>(t)][k];
    tiers[tier_name(t)] = kinds;
  }
  json groups = json::array();
  for (const auto& g : plan.groups) {
    json tier = json::object();
    for (int k = 0; k < kNumStateKinds; ++k) tier[state_kind_name(static_cast<StateKind>(k))] = tier_name(g.tier[k]);
    groups.push_back({{"name", g.name}, {"numel", g.numel}, {"tiers", tier}});
  }
  json dirs = json::array();
  for (size_t i = 0; i < plan.nvme_dir_bytes.size(); ++i)
    dirs.push_back({{"path", plan.budgets.nvme[i].path},
                    {"bytes", plan.nvme_dir_bytes[i]},
                    {"capacity", plan.budgets.nvme[i].capacity}});
  return {{"model_numel", plan.model_numel},
          {"state_bytes", tiers},
          {"device_total", plan.device_total()},
          {"host_total", plan.host_total()},
          {"nvme_total", plan.nvme_total()},
          {"device_buffers", plan.device_buffers},
          {"local_grad_bytes", plan.local_grad_bytes},  // stage 1, N ranks
          {"reduce_buffers", plan.reduce_buffers},      // N ranks, stages 2-3
          {"grad_pieces", plan.grad_pieces},
          {"grad_staged", plan.grad_staged},
          {"staging_ring", plan.staging_ring},
          {"optimizer_ring", plan.optimizer_ring},
          {"grad_pinned", plan.grad_pinned},
          {"pinned_total", plan.pinned_total()},
          {"nvme_dirs", dirs},
          {"forward_backward", link_json(plan.forward_backward)},
          {"optimizer_step", link_json(plan.optimizer_step)},
          {"per_step", link_json(plan.per_step())},
          {"groups", groups}};
}

int run(PlanCliOptions o) {  // a copy: the batch is resolved into it
  json_errors = o.json;
  for (auto [v, flag] : {std::pair{o.h2d_gbps, "--h2d-gbps"},
                         {o.d2h_gbps, "--d2h-gbps"},
                         {o.nvme_read_gbps, "--nvme-read-gbps"},
                         {o.nvme_write_gbps, "--nvme-write-gbps"},
                         {o.cpu_adam_params_per_s, "--cpu-adam-params-per-s"},
                         {o.gpu_tflops, "--gpu-tflops"},
                         {o.link_gbps, "--link-gbps"}})
    if (!(v >= 0) || !std::isfinite(v)) return fail(fmt::format("{} must be a positive number", flag));
  if (o.device == "cpu" && o.gpu_tflops <= 0 && !o.measure)
    return fail("--device cpu --no-measure: give --gpu-tflops, this CPU's sustained forward+backward rate "
                "(without --no-measure, plan measures it); the assumed 400 TFLOP/s is a GPU's");
  if (o.threads < 0) return fail("--threads must be 0 (all) or more");
  if (o.model.empty()) return fail("--model is required: a model directory or a config.json");
  const std::string cfg_path = is_dir(o.model) ? o.model + "/config.json" : o.model;
  auto lc = model::load_llama_config(cfg_path, /*allow_rope_scaling=*/true);
  if (!lc.ok()) return fail(lc.status().message());
  std::vector<std::string> notes;
  if (is_dir(o.model)) {
    // A model directory's weights must match its config (headers only: cheap
    // at any size). A directory with only config.json plans from it.
    auto md = model::open_model_dir(o.model);
    if (md.ok())
      notes.push_back(fmt::format("weights in {} checked: {} tensors match config.json", o.model, md->tensors.size()));
    else if (md.status().code() == StatusCode::kNotFound && lc->rope_scaling.empty())
      notes.push_back(fmt::format("no weights in {}: planned from config.json alone", o.model));
    else if (lc->rope_scaling.empty())
      return fail(md.status().message());
  }

  Config ds;
  ConfigNotes config_notes;
  if (!o.config.empty()) {
    auto c = load_config_file(o.config, &config_notes);
    if (!c.ok()) return fail(c.status().message());
    ds = std::move(*c);
  }
  PlanOptions options = plan_options_from_config(ds);
  if (!o.optimizer_states.empty()) {
    auto d = parse_dtype(o.optimizer_states);
    if (!d.ok() || *d == DType::kF16)
      return fail("--optimizer-states '" + o.optimizer_states + "': expected fp32|bf16");
    options.optimizer_state_dtype = *d;
  }
  if (o.batch == 0) return fail("--batch must be at least 1");
  if (o.seq == 0) return fail("--seq must be at least 1");
  if (o.batch > (1ull << 20) || o.seq > (1ull << 24)) return fail("--batch or --seq is implausibly large");
  // What strata finetune would refuse is not planned.
  if (Status st = model::check_sequence_length(*lc, o.seq, o.model); !st.ok()) return fail(st.message());
  // N ranks: rank 0's shard (every rank's is the same size but the last's,
  // which is no larger).
  const uint32_t world = o.world_size > 0 ? o.world_size : ds.strata.world_size;
  if (world > (1u << 20)) return fail("--world-size is implausibly large");
  // The ranks sharing this host's RAM and drives: what is detected here is
  // split between them, as the engine splits it (a budget given is per rank).
  if (o.ranks_per_host > std::max<uint32_t>(world, 1))
    return fail(fmt::format("--ranks-per-host {} is more than the {} rank(s) of --world-size", o.ranks_per_host,
                            std::max<uint32_t>(world, 1)));
  const uint32_t per_host = o.ranks_per_host > 0 ? std::min(o.ranks_per_host, world) : world;
  {
    // The micro-batch and accumulation strata finetune takes: the flags, else
    // the config's DeepSpeed batch keys (train_batch_size with the ranks).
    uint32_t accum = o.grad_accum > 0 ? o.grad_accum : std::max<uint32_t>(1, ds.gradient_accumulation_steps), batch = 0;
    BatchFlags given{o.config, o.batch_opt->count() ? o.batch : 0, static_cast<uint32_t>(o.batch), o.grad_accum > 0};
    Status s = resolve_deepspeed_batch(given, config_notes, std::max<uint32_t>(1, world), &batch, &accum);
    if (!s.ok()) return fail(s.message());
    if (batch > (1u << 20)) return fail("the micro-batch is implausibly large");
    o.batch = batch;
    options.micro_batches = accum;
  }

  LlamaShape shape = lc->shape();
  shape.dtype = ds.compute_dtype();  // as strata finetune: fp32 unless bf16/fp16 (or --dtype) says otherwise
  if (!o.dtype.empty()) {
    auto d = parse_dtype(o.dtype);
    if (!d.ok()) return fail("--dtype: " + d.status().message());
    shape.dtype = *d;
  }
  if (o.lora_rank > 0) {
    shape.lora_rank = o.lora_rank;
    shape.lora_targets = train::kLoraDefaultTargets;
    if (!o.lora_targets.empty()) {
      auto t = train::parse_lora_targets(o.lora_targets);
      if (!t.ok()) return fail("--lora-targets: " + t.status().message());
      shape.lora_targets = *t;
    }
    shape.lora_dtype = DType::kF32;  // PEFT keeps adapters in fp32, as strata finetune does
  } else if (!o.lora_targets.empty()) {
    return fail("--lora-targets needs --lora-rank R");
  }
  auto spec = llama_model_spec(shape, world, 0);
  if (!spec.ok()) return fail(spec.status().message());
  // LoRA: everything but the adapters is frozen (PEFT's default, strata
  // finetune's): no master, moments or gradients for the base.
  uint64_t trainable_numel = 0, frozen_numel = 0;
  for (ParamSpec& p : spec->params) {
    if (o.lora_rank > 0) p.trainable = p.name.find(".lora_") != std::string::npos;
    (p.trainable ? trainable_numel : frozen_numel) += p.numel();
  }
  if (o.lora_rank > 0)
    notes.push_back(fmt::format("LoRA rank {} on {}: {} trainable parameters, the base's {} frozen", o.lora_rank,
                                fmt::join(train::lora_target_names(shape.lora_targets), ","),
                                format_count(trainable_numel), format_count(frozen_numel)));

  // Budgets: flags, else the config, else detected here.
  PlanBudgets budgets;
  if (!lc->rope_scaling.empty()) {
    // Planned from the shapes; finetune trains only the RoPE types it
    // implements: say so here, with finetune's own refusal.
    auto strict = model::load_llama_config(cfg_path);
    notes.push_back("rope_scaling is ignored for planning (shapes only)" +
                    (strict.ok() ? std::string() : "; strata finetune refuses this model: " + strict.status().message()));
  }
  if (!o.gpu_mem.empty()) {
    auto b = parse_bytes(o.gpu_mem);
    if (!b.ok()) return fail("--gpu-mem: " + b.status().message());
    budgets.device_bytes = *b;
  } else if (ds.strata.device_memory) {
    budgets.device_bytes = ds.strata.device_memory;
  } else if (o.device == "cpu") {
    // Set with the reserve below, as strata finetune --device cpu sets it.
  } else if (auto gpu = this_gpu(); gpu.ok()) {
    budgets.device_bytes = gpu->free_bytes;
    notes.push_back(fmt::format("GPU budget: free memory of {} here, {} (set --gpu-mem to plan for another GPU)",
                                gpu->name, format_bytes(gpu->free_bytes)));
  } else {
    return fail("--gpu-mem is required here (" + gpu.status().message() +
                "): the GPU memory Strata may use, e.g. 24GiB or 80GB");
  }
  bool host_detected = false;  // MemAvailable: its note is made once the device budget is known
  if (!o.host_mem.empty()) {
    auto b = parse_bytes(o.host_mem);
    if (!b.ok()) return fail("--host-mem: " + b.status().message());
    budgets.host_bytes = *b;
  } else if (ds.strata.host_memory) {
    budgets.host_bytes = ds.strata.host_memory;
  } else {
    budgets.host_bytes = available_memory();
    if (budgets.host_bytes == 0) return fail("--host-mem is required (MemAvailable is unknown here)");
    budgets.host_bytes /= per_host;
    host_detected = true;
  }
  if (!o.pinned_mem.empty()) {
    auto b = parse_bytes(o.pinned_mem);
    if (!b.ok()) return fail("--pinned-mem: " + b.status().message());
    budgets.pinned_bytes = *b;
  } else {
    budgets.pinned_bytes = ds.strata.pinned_memory;
  }
  if (!o.nvme.empty()) {
    for (const auto& d : split_commas(o.nvme)) budgets.nvme.push_back({d, 0});
    if (budgets.nvme.empty()) return fail("--nvme '" + o.nvme + "': no directory named");
  } else {
    budgets.nvme = ds.nvme_dirs();
  }
  if (!o.nvme_capacity.empty()) {
    auto caps = split_commas(o.nvme_capacity);
    if (budgets.nvme.empty()) return fail("--nvme-capacity needs --nvme");
    if (caps.size() != 1 && caps.size() != budgets.nvme.size())
      return fail(fmt::format("--nvme-capacity gives {} sizes for {} directories (give one, or one per directory)",
                              caps.size(), budgets.nvme.size()));
    for (size_t i = 0; i < budgets.nvme.size(); ++i) {
      auto b = parse_bytes(caps.size() == 1 ? caps[0] : caps[i]);
      if (!b.ok()) return fail("--nvme-capacity: " + b.status().message());
      budgets.nvme[i].capacity = *b;
    }
  }
  for (auto& d : budgets.nvme) {
    if (d.capacity != 0) continue;
    if (!is_dir(d.path)) {
      struct stat st {};
      return fail(::stat(d.path.c_str(), &st) == 0
                      ? fmt::format("NVMe directory {} is not a directory", d.path)
                      : fmt::format("NVMe directory {} does not exist (or give --nvme-capacity)", d.path));
    }
    struct statvfs vfs {};
    if (::statvfs(d.path.c_str(), &vfs) != 0)
      return fail(fmt::format("statvfs of {} failed: {}", d.path, std::strerror(errno)));
    d.capacity = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize / per_host;
    notes.push_back(fmt::format("{}: {} free here{} (set --nvme-capacity to plan for another size)", d.path,
                                format_bytes(d.capacity),
                                per_host > 1 ? fmt::format(", each of the {} ranks on this host's share", per_host) : ""));
  }

  // The device reserve: what strata finetune holds beside the placement at
  // this batch and sequence length (train/device_sizes.h: gradient buffers,
  // layer inputs, activation buffers, on a GPU the model ops' workspace), or
  // the config's strata.device_reserve when larger, as the trainer does.
  {
    const train::DeviceSizes z =
        train::trainer_device_sizes(*spec, lc->hidden_size, lc->num_hidden_layers, lc->tie_word_embeddings,
                                    o.batch * o.seq, ds.strata.prefetch_depth);
    uint64_t workspace = 0;
    std::string ws_note;
    if (o.device != "cpu") {
      train::CudaOpsOptions co;
      co.dims = train::llama_dims(*lc);
      if (o.lora_rank > 0) {
        co.dims.lora_targets = shape.lora_targets;
        co.dims.lora_rank = o.lora_rank;
      }
      co.max_batch = static_cast<int64_t>(o.batch);
      co.max_seq = static_cast<int64_t>(o.seq);
      auto ws = train::cuda_ops_workspace_bytes(co);
      if (ws.ok()) {
        workspace = *ws;
        ws_note = fmt::format(", the CUDA model ops' workspace {}", format_bytes(train::pool_bytes(workspace)));
      } else {
        ws_note = fmt::format("; not counted: the CUDA model ops' workspace, known only where the CUDA module "
                              "loads ({})",
                              ws.status().message());
      }
    }
    const uint64_t needed = z.reserve(workspace, o.device != "cpu" && world > 1 ? comm::kNcclDefaultScratch : 0);
    if (budgets.device_bytes == 0) {  // --device cpu, no budget given: strata finetune's (trainer.cpp, use_host)
      budgets.device_bytes = std::max<uint64_t>(1ull << 30, z.reserve_base + z.group_buffers) + z.extra;
      notes.push_back(fmt::format("device budget {}: RAM, as strata finetune --device cpu sets it (the working set "
                                  "at batch {} x seq {}; --gpu-mem sets another)",
                                  format_bytes(budgets.device_bytes), o.batch, o.seq));
    }
    if (host_detected) {
      // --device cpu: the device budget is RAM too, and comes out of the
      // same MemAvailable (as the engine detects it, registry.cpp).
      const uint64_t share = budgets.host_bytes;
      if (o.device == "cpu") {
        auto host = host_budget_beside_ram_device(share, budgets.device_bytes);
        if (!host.ok()) return fail("--device cpu (--gpu-mem, --host-mem): " + host.status().message());
        budgets.host_bytes = *host;
      }
      notes.push_back(fmt::format(
          "host budget: MemAvailable here, {}{}{} (set --host-mem to plan for another machine)",
          format_bytes(share),
          per_host > 1 ? fmt::format(", a 1/{} share for each of the {} ranks on this host (--ranks-per-host)",
                                     per_host, per_host)
                       : "",
          o.device == "cpu" ? fmt::format(", less the device budget {} (RAM too with --device cpu): {}",
                                          format_bytes(budgets.device_bytes), format_bytes(budgets.host_bytes))
                            : ""));
    }
    const bool larger = ds.strata.device_reserve_given && ds.strata.device_reserve > needed;
    options.device_reserve = larger ? ds.strata.device_reserve : needed;
    notes.push_back(fmt::format("device reserve {}{}: strata finetune's fp32 gradient buffer {}, layer inputs and "
                                "activation buffers for batch {} x seq {} {}{}",
                                format_bytes(options.device_reserve),
                                larger ? " (the config's strata.device_reserve)" : "", format_bytes(z.grad_bytes),
                                o.batch, o.seq, format_bytes(z.extra), ws_note));
  }

  auto plan = make_plan(*spec, budgets, options);
  if (!plan.ok()) {
    const bool budget = plan.status().code() == StatusCode::kOutOfBudget;
    std::string what = budget ? fmt::format("{} ({} parameters) does not fit: {}", cfg_path, format_count(spec->numel()),
                                            plan.status().message())
                              : plan.status().message();
    // NVMe helps where states do not fit, not the device's working set.
    if (budget && budgets.nvme.empty() && plan.status().message().rfind("device:", 0) != 0)
      what += " (here: --nvme DIR[,DIR], with --nvme-capacity SIZE to plan for a drive elsewhere)";
    if (budget && plan.status().message().rfind("device:", 0) == 0 && options.device_reserve > budgets.device_bytes / 4)
      what += fmt::format(" (the {} reserve is mostly strata finetune's activations for batch {} x seq {}: a "
                          "smaller --batch or --seq lowers it)",
                          format_bytes(options.device_reserve), o.batch, o.seq);
    return fail(what);
  }

  // Bandwidths.
  const bool cpu_device = o.device == "cpu";
  const bool measure = o.measure;
  Figure h2d{kAssumedH2dGBps * 1e9, "assumed", "PCIe 5.0 x16, pinned memory; measure with `strata bench copy`"};
  Figure d2h = h2d;
  Figure gpu{kAssumedGpuTflops * 1e12, "assumed", "H100/H200-class, bf16 dense matmul at ~40% of peak"};
  Figure nvr{kAssumedNvmeReadGBps * 1e9, "assumed", "one PCIe 4.0 NVMe drive"};
  Figure nvw{kAssumedNvmeWriteGBps * 1e9, "assumed", "one PCIe 4.0 NVMe drive"};
  Figure cpu{kAssumedCpuAdamParamsPerS, "assumed", "AdamW at ~20 GB/s of memory bandwidth"};
  if (o.h2d_gbps > 0) h2d = {o.h2d_gbps * 1e9, "given", ""};
  if (o.d2h_gbps > 0)
    d2h = {o.d2h_gbps * 1e9, "given", ""};
  else if (o.h2d_gbps > 0)
    d2h = {o.h2d_gbps * 1e9, "given", "same as --h2d-gbps"};
  if (o.gpu_tflops > 0) gpu = {o.gpu_tflops * 1e12, "given", ""};
  if (o.nvme_read_gbps > 0) nvr = {o.nvme_read_gbps * 1e9, "given", ""};
  if (o.nvme_write_gbps > 0) nvw = {o.nvme_write_gbps * 1e9, "given", ""};
  if (o.cpu_adam_params_per_s > 0) cpu = {o.cpu_adam_params_per_s, "given", ""};
  Figure link{kAssumedLinkGBps * 1e9, "assumed", "100 Gb/s between ranks; ranks on one host share memory bandwidth"};
  if (o.link_gbps > 0) link = {o.link_gbps * 1e9, "given", ""};
  if (measure && !budgets.nvme.empty() && (o.nvme_read_gbps <= 0 || o.nvme_write_gbps <= 0)) {
    auto size = parse_bytes(o.measure_size);
    if (!size.ok() || *size == 0)
      return fail("--measure-size '" + o.measure_size + "': expected a size such as 256MiB");
    const std::string& dir = budgets.nvme[0].path;
    struct statvfs vfs {};
    Figure r, w;
    Status st = Status::ok_status();
    if (!is_dir(dir)) {
      st = Status(StatusCode::kNotFound, dir + " does not exist");
    } else if (::statvfs(dir.c_str(), &vfs) == 0 && static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize < 2 * *size) {
      st = Status(StatusCode::kNoSpace, fmt::format("less than {} free in {}", format_bytes(2 * *size), dir));
    } else {
      st = measure_nvme(dir, *size, &r, &w);
    }
    if (st.ok()) {
      if (o.nvme_read_gbps <= 0) nvr = r;
      if (o.nvme_write_gbps <= 0) nvw = w;
    } else {
      notes.push_back("NVMe not measured (" + st.message() + "): assumed figures used");
    }
    // Every directory is striped: the figure above is one drive's.
    if (budgets.nvme.size() > 1 && st.ok())
      notes.push_back(
          "NVMe measured in the first directory only; if the others are separate drives, the "
          "striped bandwidth is higher (give --nvme-read-gbps / --nvme-write-gbps)");
  }
  if (cpu_device && o.h2d_gbps <= 0) {
    // The host backend's copies: memcpy on one of its stream threads (a
    // given --h2d-gbps already stands for --d2h-gbps too).
    h2d = measure ? measure_memcpy() : Figure{kAssumedMemcpyGBps * 1e9, "assumed", "memcpy on one thread"};
    if (o.d2h_gbps <= 0) d2h = h2d;
  }
  if (!cpu_device && measure && (o.h2d_gbps <= 0 || o.d2h_gbps <= 0)) {
    // Pinned host<->device copies on this machine's GPU, when it has one.
    if (auto gpu = this_gpu(); gpu.ok()) {
      double up = 0, down = 0;
      char err[256] = {0};
      if (gpu->module.api->copy_bandwidth(0, 256u << 20, 5, &up, &down, err, sizeof err) == 0) {
        const std::string why = "pinned, 256 MiB copies on " + gpu->name;
        if (o.h2d_gbps <= 0) h2d = {up * 1e9, "measured", why};
        if (o.d2h_gbps <= 0) d2h = {down * 1e9, "measured", why};
      } else {
        notes.push_back(std::string("host<->device not measured (") + err + "): assumed figures used");
      }
    }
  }
  if (measure && o.cpu_adam_params_per_s <= 0) {
    auto c = measure_cpu_adam(options.optimizer_state_dtype);
    if (c.ok())
      cpu = *c;
    else
      notes.push_back("CPU optimizer not measured (" + c.status().message() + "): assumed figure used");
  }
  if (cpu_device && o.gpu_tflops <= 0) {
    auto c = measure_cpu_compute(*lc, shape, o);
    if (!c.ok())
      return fail("--device cpu: this CPU's compute rate could not be measured (" + c.status().message() +
                  "); give --gpu-tflops");
    gpu = *c;
  }
  Bandwidths bw;
  bw.h2d = h2d.value;
  bw.d2h = d2h.value;
  bw.nvme_read = nvr.value;
  bw.nvme_write = nvw.value;
  bw.cpu_optimizer_params_per_s = cpu.value;
  bw.gpu_flops = gpu.value;
  bw.link = link.value;
  Workload work;
  work.tokens_per_micro_batch = o.batch * o.seq;
  work.activation_checkpointing = !o.no_checkpointing;
  work.overlap_backward = ds.strata.overlap_backward;
  work.pipelined_step = ds.strata.pipelined_step;
  work.shared_cores = cpu_device;
  work.attention_forward_flops_per_token =
      attention_forward_flops_per_token(shape.layers, shape.heads, shape.head_dim_or_default(), o.seq);
  work.non_matmul_params = shape.tied_embeddings ? 0 : shape.vocab * shape.dim;  // the input embedding: a lookup
  // Frozen weights still pass gradients to their inputs, but compute none of
  // their own (the untied embedding is a lookup either way).
  if (frozen_numel > 0) work.frozen_matmul_params = frozen_numel - std::min(frozen_numel, work.non_matmul_params);
  auto est = predict_step_time(*plan, bw, work);
  if (!est.ok()) return fail(est.status().message());
  const double tokens_per_step = static_cast<double>(work.tokens_per_micro_batch) * options.micro_batches;
  const double token_flops = flops_per_token(*plan, work);

  if (o.json) {
    auto fig = [](const Figure& f, double scale) {
      return json{{"value", f.value / scale}, {"source", f.source}, {"note", f.note}};
    };
    json out = {{"fits", true},
                {"model",
                 {{"config", cfg_path},
                  {"params", spec->numel()},
                  {"trainable_params", trainable_numel},
                  {"lora_rank", o.lora_rank},
                  {"layers", shape.layers},
                  {"dim", shape.dim},
                  {"heads", shape.heads},
                  {"kv_heads", shape.kv_heads},
                  {"ffn_dim", shape.ffn_dim},
                  {"vocab", shape.vocab},
                  {"tied_embeddings", shape.tied_embeddings},
                  {"compute_dtype", dtype_name(shape.dtype)}}},
                {"budgets", {{"device", budgets.device_bytes}, {"host", budgets.host_bytes}}},
                {"plan", plan_json(*plan)},
                {"bandwidths",
                 {{"h2d_GBps", fig(h2d, 1e9)},
                  {"d2h_GBps", fig(d2h, 1e9)},
                  {"nvme_read_GBps", fig(nvr, 1e9)},
                  {"nvme_write_GBps", fig(nvw, 1e9)},
                  {"cpu_adam_params_per_s", fig(cpu, 1)},
                  {"gpu_TFLOPs", fig(gpu, 1e12)},
                  {"link_GBps", fig(link, 1e9)}}},
                {"workload",
                 {{"batch", o.batch},
                  {"seq", o.seq},
                  {"micro_batches", options.micro_batches},
                  {"tokens_per_step", tokens_per_step},
                  {"flops_per_token", token_flops},
                  {"activation_checkpointing", work.activation_checkpointing},
                  {"device", o.device}}},
                {"estimate",
                 {{"compute_s", est->compute_s},
                  {"h2d_s", est->h2d_s},
                  {"d2h_s", est->d2h_s},
                  {"nvme_fb_s", est->nvme_fb_s},
                  {"comm_s", est->comm_s},
                  {"step_comm_s", est->step_comm_s},
                  {"forward_backward_s", est->forward_backward_s},
                  {"nvme_step_s", est->nvme_step_s},
                  {"cpu_optimizer_s", est->cpu_optimizer_s},
                  {"optimizer_step_s", est->optimizer_step_s},
                  {"total_s", est->total_s},
                  {"tokens_per_s", tokens_per_step / est->total_s},
                  {"bottleneck", est->bottleneck}}},
                {"notes", notes}};
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("Model: %s: %s, %u layers, dim %llu, %u heads (%u kv) of %llu, ffn %llu, vocab %llu%s; %s compute\n",
              cfg_path.c_str(), model::model_arch_class(lc->arch), shape.layers,
              static_cast<unsigned long long>(shape.dim), shape.heads, shape.kv_heads,
              static_cast<unsigned long long>(shape.head_dim_or_default()),
              static_cast<unsigned long long>(shape.ffn_dim), static_cast<unsigned long long>(shape.vocab),
              shape.tied_embeddings ? ", tied embeddings" : "", dtype_name(shape.dtype));
  for (const auto& n : notes) std::printf("note: %s\n", n.c_str());
  std::printf("\n%s\n", plan->report().c_str());
  auto line = [](const char* what, const Figure& f, const std::string& value) {
    std::printf("  %-22s %-14s %s%s\n", what, value.c_str(), f.source.c_str(),
                f.note.empty() ? "" : (" (" + f.note + ")").c_str());
  };
  std::printf("Bandwidths:\n");
  line("host->device", h2d, format_rate(h2d.value));
  line("device->host", d2h, format_rate(d2h.value));
  line("NVMe read", nvr, format_rate(nvr.value));
  line("NVMe write", nvw, format_rate(nvw.value));
  line("CPU optimizer", cpu, fmt::format("{:.2f} G param/s", cpu.value / 1e9));
  line(cpu_device ? "CPU (the device)" : "GPU", gpu, gpu.value >= 99.95e12 ? fmt::format("{:.0f} TFLOP/s", gpu.value / 1e12)
                                         : fmt::format("{:.3g} TFLOP/s", gpu.value / 1e12));
  if (world > 1) line("link between ranks", link, format_rate(link.value));
  std::printf(
      "\nWorkload: batch %llu x seq %llu = %llu tokens per micro-batch, %u micro-batch(es) per step; "
      "%.3g FLOP per token (%s)\n",
      static_cast<unsigned long long>(o.batch), static_cast<unsigned long long>(o.seq),
      static_cast<unsigned long long>(work.tokens_per_micro_batch), options.micro_batches, token_flops,
      work.frozen_matmul_params > 0
          ? (work.activation_checkpointing
                 ? "8 x trainable and 6 x frozen matmul weights + 4 x attention's forward: forward, recompute, backward"
                 : "6 x trainable and 4 x frozen matmul weights + 3 x attention's forward")
      : work.activation_checkpointing ? "8 x matmul weights + 4 x attention's forward: forward, recompute, backward"
                                      : "6 x matmul weights + 3 x attention's forward");
  std::printf("%s", est->report().c_str());
  std::printf("Predicted: %s per optimizer step, %.0f tokens/s (bottleneck: %s)\n",
              format_seconds(est->total_s).c_str(), tokens_per_step / est->total_s, est->bottleneck.c_str());
  return 0;
}

}  // namespace

void register_plan(CLI::App& app) {
  auto o = std::make_shared<PlanCliOptions>();
  CLI::App* cmd = app.add_subcommand(
      "plan", "Where each part of a model's training state would live, bytes moved per step, predicted step time");
  cmd->add_option("--model", o->model, "Model directory or config.json (Hugging Face Llama)");
  cmd->add_option("--gpu-mem", o->gpu_mem, "GPU memory Strata may use, e.g. 24GiB (default: --config, else the free memory of this machine's GPU)");
  cmd->add_option("--host-mem", o->host_mem, "Host RAM budget (default: MemAvailable here)");
  cmd->add_option("--pinned-mem", o->pinned_mem, "Cap on page-locked buffers (default: none)");
  cmd->add_option("--nvme", o->nvme, "NVMe directories, comma-separated (default: none, or from --config)");
  cmd->add_option("--nvme-capacity", o->nvme_capacity,
                  "Bytes usable per NVMe directory: one size for all or one per directory (default: free space)");
  cmd->add_option("--config", o->config, "DeepSpeed/Strata JSON config (offload devices, optimizer state dtype, ...)");
  cmd->add_option("--dtype", o->dtype, "Compute dtype bf16|fp16|fp32 (default: the config's bf16/fp16 section, else fp32, as strata finetune: "
                  "its --bf16 is --dtype bf16 here)");
  cmd->add_option("--optimizer-states", o->optimizer_states,
                  "Adam moment dtype fp32|bf16 (default: fp32, or the config's)");
  o->batch_opt = cmd->add_option("--batch", o->batch, "Sequences per micro-batch (default: 1, or the config's DeepSpeed "
                                 "batch keys as strata finetune takes them)")
                     ->capture_default_str();
  cmd->add_option("--seq", o->seq, "Tokens per sequence")->capture_default_str();
  cmd->add_option("--grad-accum", o->grad_accum, "Micro-batches per optimizer step (default: 1, or the config's)");
  cmd->add_flag("--no-activation-checkpointing", o->no_checkpointing, "Plan without recomputing activations");
  cmd->add_flag("--measure,!--no-measure", o->measure,
                "Measure NVMe and CPU optimizer speed (and with --device cpu the compute rate) here (a few seconds; default) or use assumed figures");
  cmd->add_option("--measure-size", o->measure_size, "Bytes written and read by the NVMe measurement")
      ->capture_default_str();
  cmd->add_option("--h2d-gbps", o->h2d_gbps, "Host->device GB/s (default: assumed 50, PCIe 5.0 x16)");
  cmd->add_option("--d2h-gbps", o->d2h_gbps, "Device->host GB/s (default: --h2d-gbps or assumed 50)");
  cmd->add_option("--nvme-read-gbps", o->nvme_read_gbps, "NVMe read GB/s, all directories (default: measured)");
  cmd->add_option("--nvme-write-gbps", o->nvme_write_gbps, "NVMe write GB/s, all directories (default: measured)");
  cmd->add_option("--cpu-adam-params-per-s", o->cpu_adam_params_per_s,
                  "CPU optimizer parameters per second (default: measured)");
  cmd->add_option("--world-size", o->world_size,
                  "Data-parallel ranks (each rank holds 1/N of every state; with zero_optimization.stage 1 or 2 the "
                  "parameters stay whole on every rank; default 1, or the config's)");
  cmd->add_option("--ranks-per-host", o->ranks_per_host,
                  "Ranks sharing one host (default: all --world-size, as mpirun -np N here): the host memory and "
                  "NVMe space detected are split between them; --host-mem and --nvme-capacity are per rank");
  cmd->add_option("--link-gbps", o->link_gbps,
                  "GB/s one rank sends to the others (default: assumed 12.5, a 100 Gb/s network)");
  cmd->add_option("--gpu-tflops", o->gpu_tflops,
                  "Sustained GPU TFLOP/s (default: assumed 400, H100/H200 class); with --device cpu, the CPU's "
                  "(default: measured, one layer and the head of the model at its shape)");
  cmd->add_option("--lora-rank", o->lora_rank,
                  "LoRA: plan a frozen base with rank-R adapters, as strata finetune --lora-rank (0: full fine-tuning)");
  cmd->add_option("--lora-targets", o->lora_targets,
                  "LoRA's adapted modules, as strata finetune --lora-targets (default: q_proj,v_proj, as PEFT)");
  cmd->add_option("--threads", o->threads,
                  "--device cpu: compute threads the measurement uses, as strata finetune --threads (0: all)")
      ->capture_default_str();
  cmd->add_option("--device", o->device,
                  "cuda: the model computes on a GPU; cpu: on this CPU (the host backend, strata finetune --device "
                  "cpu), where host<->device copies are memcpys and they and the optimizer's update take the cores "
                  "that compute")
      ->check(CLI::IsMember({"cuda", "cpu"}))
      ->capture_default_str();
  cmd->add_flag("--json", o->json, "Print the plan and the estimate as one JSON object");
  for (CLI::Option* opt : cmd->get_options()) opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // Given, each must be positive: 0 is no setting (it used to mean "the
  // default" without a word).
  for (const char* name : {"--batch", "--seq", "--grad-accum", "--h2d-gbps", "--d2h-gbps", "--nvme-read-gbps",
                           "--nvme-write-gbps", "--cpu-adam-params-per-s", "--world-size", "--ranks-per-host",
                           "--link-gbps", "--gpu-tflops"})
    cmd->get_option(name)->check(CLI::Validator(
        [](std::string& v) {
          char* end = nullptr;
          const double x = std::strtod(v.c_str(), &end);
          return end != v.c_str() && *end == '\0' && x > 0 ? std::string()
                                                           : "is " + v + ": give a positive number, or leave the "
                                                             "flag out for the default";
        },
        "POSITIVE"));
  cmd->callback([o] { set_exit_code(run(*o)); });
}

}  // namespace strata::tools
