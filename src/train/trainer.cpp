#include "train/trainer.h"

#include "comm/nccl_comm.h"
#include "train/trainer_impl.h"

namespace strata::train {

namespace fs = std::filesystem;

namespace trainer_detail {

Status make_dirs(const std::string& dir, const std::string& what, std::vector<std::string>* made) {
  std::error_code ec;
  std::vector<std::string> missing;  // innermost first
  fs::path p = fs::path(dir).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();  // "out/"
  for (; !p.empty() && p != p.parent_path() && !fs::exists(p, ec); p = p.parent_path()) missing.push_back(p.string());
  fs::create_directories(dir, ec);
  if (ec) return Status::from_errno(ec.value(), what + " " + dir + ": cannot create it");
  if (made != nullptr) made->assign(missing.rbegin(), missing.rend());
  // Writable? A probe file says so before hours of training do.
  const std::string probe = dir + "/.strata-write-probe";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Status::from_errno(errno, what + " " + dir + " is not writable");
  ::close(fd);
  ::unlink(probe.c_str());
  return {};
}

}  // namespace trainer_detail

using namespace trainer_detail;

LlamaDims llama_dims(const model::LlamaConfig& mc) {
  LlamaDims dims;
  dims.dim = static_cast<int64_t>(mc.hidden_size);
  dims.heads = mc.num_attention_heads;
  dims.kv_heads = mc.num_key_value_heads;
  dims.head_dim = static_cast<int64_t>(mc.head_dim());
  dims.ffn_dim = static_cast<int64_t>(mc.intermediate_size);
  dims.vocab = static_cast<int64_t>(mc.vocab_size);
  dims.rms_eps = mc.rms_norm_eps;
  dims.rope_theta = mc.rope.theta;
  if (dims.head_dim > 0 && dims.head_dim % 2 == 0) {
    model::RopeFrequencies f = model::rope_frequencies(mc.rope, dims.head_dim);
    dims.rope_inv_freq = std::move(f.inv_freq);
    dims.rope_attention_scaling = f.attention_scaling;
  }
  dims.tied = mc.tie_word_embeddings;
  dims.qkv_bias = mc.arch == model::ModelArch::kQwen2;
  dims.qk_norm = mc.arch == model::ModelArch::kQwen3;
  return dims;
}

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;
int64_t Trainer::step() const { return impl_->step; }
Engine& Trainer::engine() { return *impl_->engine; }
const TokenDataset& Trainer::data() const { return *impl_->data; }
const model::LlamaConfig& Trainer::model_config() const { return impl_->model.config; }
const char* Trainer::ops_name() const { return impl_->ops->name(); }
const std::string& Trainer::device_description() const { return impl_->device_description; }
uint32_t Trainer::rank() const { return impl_->rank; }
uint32_t Trainer::world_size() const { return impl_->world; }

Result<std::unique_ptr<Trainer>> Trainer::create(const TrainerOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->opt = options;
  Status s = impl->setup();
  if (s.ok()) return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
  // A run that never started leaves nothing behind: the directories it made
  // for OUT (ranks that never met, a budget too small, unreadable weights)
  // are removed once everything of it is closed, with what it wrote there
  // (RunDir::remove_made). The lock is held until its file is gone: another
  // job that opens OUT meanwhile waits on it or fails, and never finds its
  // own lock file removed.
  const std::vector<std::string> made = std::move(impl->made_out_dirs);
  std::unique_ptr<RunDir> held = std::move(impl->run_dir);
  impl.reset();
  RunDir::remove_made(made, held != nullptr);
  held.reset();
  return s;
}

// Each step names the part it checks or builds in its errors (trainer.h,
// create()). The order matters: the device is chosen from the sizes of the
// engine's model, the engine is built on that device, the buffers come from
// its pool, and the weights need the engine.
Status Trainer::Impl::setup() {
  STRATA_RETURN_IF_ERROR(check_options());
  STRATA_RETURN_IF_ERROR(detect_ranks());
  EngineOptions eo;
  Status before = [&]() -> Status {
    STRATA_RETURN_IF_ERROR(resolve_lora());
    STRATA_RETURN_IF_ERROR(open_model());
    STRATA_RETURN_IF_ERROR(open_data());
    STRATA_RETURN_IF_ERROR(check_output_dirs());
    STRATA_ASSIGN_OR_RETURN(eo, engine_options());
    const DeviceSizes z = device_sizes(eo.model);
    return choose_device(z, &eo.config);
  }();
  // N ranks: the others hear of it at once, not after --comm-timeout.
  if (!before.ok()) return fail_before_meeting(std::move(before));
  STRATA_RETURN_IF_ERROR(join_ranks());
  // --resume auto, decided (rank 0's choice, which join_ranks shared): from
  // here a resume_dir says whether this run resumes.
  if (opt.resume_dir == kResumeAuto) opt.resume_dir = resume_from;
  STRATA_RETURN_IF_ERROR(create_engine(std::move(eo)));
  STRATA_RETURN_IF_ERROR(find_params());
  STRATA_RETURN_IF_ERROR(alloc_buffers());
  // Weights: from the checkpoint, or from the model's safetensors.
  if (!opt.resume_dir.empty()) {
    STRATA_RETURN_IF_ERROR(resume(resume_from));
  } else {
    STRATA_RETURN_IF_ERROR(load_weights());
  }
  STRATA_RETURN_IF_ERROR(open_metrics());
  return run_dir ? run_dir->record(settings_json()) : Status();  // N ranks: rank 0's
}

// The values the tool parsed, checked against each other.
Status Trainer::Impl::check_options() {
  if (opt.batch < 1) return Status(StatusCode::kInvalidArgument, "batch must be at least 1");
  if (opt.steps < 0) return Status(StatusCode::kInvalidArgument, "steps must be >= 0");
  if (opt.out_dir.empty()) return Status(StatusCode::kInvalidArgument, "no output directory given");
  if (opt.config.gradient_accumulation_steps < 1)
    return Status(StatusCode::kInvalidArgument, "gradient accumulation steps must be at least 1");
  accum = opt.config.gradient_accumulation_steps;
  seq = opt.data.seq;
  if (opt.model_dir.empty()) return Status(StatusCode::kInvalidArgument, "no model directory given (--model)");
  return {};
}

// The model directory: config and tensor list (headers only), and the
// dimensions the ops compute with.
Status Trainer::Impl::open_model() {
  {
    auto m = model::open_model_dir(opt.model_dir);
    if (!m.ok()) return m.status().with_context("model " + opt.model_dir);
    model = std::move(m).value();
  }
  const model::LlamaConfig& mc = model.config;
  dims = llama_dims(mc);
  if (opt.lora.enabled()) {
    const std::string where = "LoRA adapter " + opt.lora.adapter_dir + "/adapter_config.json";
    STRATA_RETURN_IF_ERROR(resolve_lora_regex(&opt.lora, mc.num_hidden_layers, where));
    STRATA_RETURN_IF_ERROR(check_lora_layers(opt.lora, mc.num_hidden_layers, where));
    dims.lora_targets = opt.lora.targets;
    dims.lora_rank = opt.lora.rank;
    dims.lora_scaling = opt.lora.scaling();
    dims.lora_dropout = static_cast<float>(opt.lora.dropout);
    log_info("LoRA: rank {}, alpha {}{}, dropout {}, targets {}; the base model is frozen", opt.lora.rank,
             opt.lora.alpha, opt.lora.rslora ? " (rsLoRA)" : "", opt.lora.dropout,
             fmt::join(lora_target_names(opt.lora.targets), ","));
  }
  if (mc.rope.type != model::RopeType::kDefault)
    log_info("RoPE: {}", model::rope_describe(mc.rope));
  if (mc.attention_dropout > 0)
    log_warn("config.json sets attention_dropout {}; Strata trains without dropout (transformers would drop "
             "attention probabilities in training mode)",
             mc.attention_dropout);
  if (Status st = dims.validate(); !st.ok()) return st.with_context("model " + opt.model_dir);
  STRATA_RETURN_IF_ERROR(model::check_sequence_length(mc, static_cast<uint64_t>(seq), opt.model_dir));
  if (static_cast<uint64_t>(seq) > mc.max_position_embeddings)
    log_warn("sequence length {} is longer than the model's max_position_embeddings {}", seq,
             mc.max_position_embeddings);
  return {};
}

// The data file; its ids must fit the model's vocabulary.
Status Trainer::Impl::open_data() {
  const model::LlamaConfig& mc = model.config;
  DataOptions dopt = opt.data;
  if (dopt.vocab == 0)
    dopt.vocab = dopt.format == DataFormat::kText ? static_cast<uint32_t>(std::min<uint64_t>(256, mc.vocab_size))
                                                  : static_cast<uint32_t>(std::min<uint64_t>(mc.vocab_size, UINT32_MAX));
  if (dopt.vocab > mc.vocab_size)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("data vocabulary {} is larger than the model's vocab_size {} ({}/config.json)",
                              dopt.vocab, mc.vocab_size, opt.model_dir));
  {
    auto d = TokenDataset::open(dopt);
    if (!d.ok()) return d.status();
    data = std::move(d).value();
    auto f = data->fingerprint();
    if (!f.ok()) return f.status();
    data_fingerprint = *f;
  }
  opt.data = dopt;
  return {};
}

// The out dir (created, writable) and every NVMe directory (an existing,
// writable directory) before hours of training depend on them.
Status Trainer::Impl::check_output_dirs() {
  // OUT: made, locked, a dead job's leftovers removed, and which run it
  // continues decided now, before hours of work depend on it (run_dir.h).
  // N ranks: rank 0 owns OUT (and removes what it made if the start fails)
  // and tells the others (join_ranks, which also checks they see it).
  if (rank == 0) {
    STRATA_RETURN_IF_ERROR(make_dirs(opt.out_dir, "out dir", &made_out_dirs));
    STRATA_ASSIGN_OR_RETURN(run_dir, RunDir::open(opt.out_dir));
    bool fresh = opt.resume_dir.empty();
    if (opt.resume_dir == kResumeAuto) {
      // A new run only where OUT holds no checkpoint-<step> at all; else its
      // newest of the run, and one that cannot be used (damaged, another
      // run's) is an error, never a silent start over.
      fresh = list_checkpoint_dirs(opt.out_dir).empty();
      if (!fresh) {
        auto found = select_checkpoint(opt.out_dir);
        if (!found.ok())
          return Status(found.status().code(),
                        fmt::format("--resume auto: {} (--resume auto never starts over where OUT holds "
                                    "checkpoints, even with --overwrite: to start over, leave out --resume auto)",
                                    found.status().message()));
        resume_from = *found;
        log_info("--resume auto: continuing from {}", resume_from);
      }
    }
    if (fresh) {
      std::vector<std::pair<std::string, std::string>> inputs = {{"--model", opt.model_dir},
                                                                 {"--lora-adapter", opt.lora.adapter_dir},
                                                                 {"--data", opt.data.path},
                                                                 {"--loss-mask", opt.data.loss_mask_path},
                                                                 {"--documents", opt.data.documents_path}};
      inputs.insert(inputs.end(), opt.other_inputs.begin(), opt.other_inputs.end());
      STRATA_RETURN_IF_ERROR(run_dir->start_fresh(opt.overwrite, inputs, opt.resume_dir == kResumeAuto));
    } else {
      if (resume_from.empty()) {
        STRATA_ASSIGN_OR_RETURN(resume_from, select_checkpoint(opt.resume_dir));
      }
      STRATA_ASSIGN_OR_RETURN(std::string id, checkpoint_run_id(resume_from));
      STRATA_RETURN_IF_ERROR(run_dir->continue_run(id));
    }
  }
  for (const NvmeDir& nd : opt.config.nvme_dirs()) {
    struct stat st {};
    if (::stat(nd.path.c_str(), &st) != 0) {
      const int err = errno;
      return Status::from_errno(err, "NVMe directory " + nd.path +
                                           (err == ENOENT ? " (offload target; not created here, since a mistyped "
                                                              "path would fill another disk: make it first)"
                                                            : " (offload target)"));
    }
    if (!S_ISDIR(st.st_mode))
      return Status(StatusCode::kInvalidArgument, "NVMe directory " + nd.path + " is not a directory");
    if (::access(nd.path.c_str(), W_OK) != 0) return Status::from_errno(errno, "NVMe directory " + nd.path);
  }
  return {};
}

// The engine's config and model spec (the device fields come later, from
// choose_device()).
Result<EngineOptions> Trainer::Impl::engine_options() {
  // The engine has no device-side optimizer yet: "auto" for the optimizer's
  // state means host RAM (an explicit nvme:DIR or a config's rules still win).
  if (opt.config.zero.offload_optimizer.device == OffloadDevice::kAuto) {
    bool ruled = false;
    for (const GroupTierRule& r : opt.config.strata.groups)
      ruled |= r.master != Tier::kAuto || r.optimizer != Tier::kAuto || r.grad != Tier::kAuto;
    if (!ruled) opt.config.zero.offload_optimizer.device = OffloadDevice::kCpu;
  }
  compute_dtype = opt.config.compute_dtype();
  LlamaShape shape = model.config.shape();
  shape.dtype = compute_dtype;
  if (opt.lora.enabled()) {
    shape.lora_targets = opt.lora.targets;
    shape.lora_rank = opt.lora.rank;
    shape.lora_dtype = DType::kF32;  // PEFT keeps adapters in fp32 beside a bf16/fp16 base
  }
  EngineOptions eo;
  eo.config = opt.config;
  auto spec = llama_model_spec(shape);
  if (!spec.ok()) return spec.status().with_context("model " + opt.model_dir);
  eo.model = std::move(spec).value();
  for (ParamSpec& p : eo.model.params) {
    p.weight_decay = opt.weight_decay_all || !hf_no_decay(p.name);
    // LoRA: everything but the adapters is frozen (PEFT's default).
    if (opt.lora.enabled()) p.trainable = p.name.find(".lora_") != std::string::npos;
  }
  return eo;
}

// What the trainer takes from the device pool next to the engine: the
// gradient buffers (the largest group in fp32, plus the tied embedding's)
// with a 64 MiB margin, and the activations and token buffers; and the
// engine's group buffers. Sets grad_buf_elems and tokens_per_micro.
DeviceSizes Trainer::Impl::device_sizes(const ModelSpec& spec) {
  tokens_per_micro = static_cast<int64_t>(opt.batch) * seq;
  DeviceSizes z = trainer_device_sizes(spec, static_cast<uint64_t>(dims.dim), model.config.num_hidden_layers,
                                       dims.tied, static_cast<uint64_t>(tokens_per_micro),
                                       opt.config.strata.prefetch_depth);
  grad_buf_elems = z.grad_buf_elems;
  return z;
}

// The engine, on the backend choose_device() picked.
Status Trainer::Impl::create_engine(EngineOptions eo) {
  eo.device = backend.get();
  eo.comm = world > 1 ? comm.get() : nullptr;
  eo.budgets_override = opt.budgets_override;
  auto e = Engine::create(eo);
  if (!e.ok()) return e.status().with_context("creating the offload engine");
  engine = std::move(e).value();
  return {};
}

// Groups and parameter ids by Hugging Face name.
Status Trainer::Impl::find_params() {
  STRATA_ASSIGN_OR_RETURN(embed_group, engine->find_group("embed"));
  STRATA_ASSIGN_OR_RETURN(head_group, engine->find_group("head"));
  STRATA_ASSIGN_OR_RETURN(embed_param, engine->find_param(model_weight_name(kEmbedTokens)));
  STRATA_ASSIGN_OR_RETURN(norm_param, engine->find_param(model_weight_name(kFinalNorm)));
  if (dims.tied) {
    lm_head_param = embed_param;
  } else {
    STRATA_ASSIGN_OR_RETURN(lm_head_param, engine->find_param(model_weight_name(kLmHead)));
  }
  for (uint32_t l = 0; l < model.config.num_hidden_layers; ++l) {
    STRATA_ASSIGN_OR_RETURN(GroupId g, engine->find_group("layers." + std::to_string(l)));
    layer_groups.push_back(g);
    LayerArray<ParamId> ids;
    for (LayerTensor t : kAllLayerTensors) {
      if (!dims.has(t)) continue;
      STRATA_ASSIGN_OR_RETURN(ids[t], engine->find_param(layer_weight_name(l, t)));
    }
    layer_param_ids.push_back(ids);
  }
  for (const ParamSpec& ps : engine->model().params) trainable.push_back(ps.trainable);
  return {};
}

// Buffers. New pool memory is undefined (0xFF on the host backend): the
// activations start zeroed, so nothing depends on what was there.
Status Trainer::Impl::alloc_buffers() {
  DeviceBackend& dev = *backend;
  const ModelSpec& spec = engine->model();
  const size_t act = static_cast<size_t>(tokens_per_micro * dims.dim);
  auto alloc = [&](size_t bytes, const char* what, auto** out) -> Status {
    auto a = dev.alloc(bytes);
    if (!a.ok()) return a.status().with_context(what);
    *out = static_cast<std::remove_pointer_t<decltype(out)>>(a.value());
    return dev.fill_zero_async(a.value(), bytes, stream);
  };
  STRATA_RETURN_IF_ERROR(alloc(grad_buf_elems * sizeof(float), "gradient buffer", &grad_buf));
  if (dims.tied && trainable[embed_param])
    STRATA_RETURN_IF_ERROR(
        alloc(spec.params[embed_param].numel() * sizeof(float), "tied embedding gradient buffer", &tied_grad));
  if (dims.tied && trainable[embed_param] && model.config.pad_token_id >= 0)
    STRATA_RETURN_IF_ERROR(alloc(static_cast<size_t>(dims.dim) * sizeof(float), "padding row buffer", &pad_row));
  STRATA_RETURN_IF_ERROR(alloc(act * (layer_groups.size() + 1) * sizeof(float), "activation buffers", &acts));
  STRATA_RETURN_IF_ERROR(alloc(act * sizeof(float), "activation gradient buffer", &dx_a));
  STRATA_RETURN_IF_ERROR(alloc(act * sizeof(float), "activation gradient buffer", &dx_b));
  STRATA_RETURN_IF_ERROR(alloc(static_cast<size_t>(tokens_per_micro) * sizeof(int32_t), "token buffer", &inputs));
  STRATA_RETURN_IF_ERROR(alloc(static_cast<size_t>(tokens_per_micro) * sizeof(int32_t), "target buffer", &targets));
  {
    auto a = dev.alloc_pinned(2 * static_cast<size_t>(tokens_per_micro) * sizeof(int32_t));
    if (!a.ok()) return a.status().with_context("pinned token staging buffer");
    staging = a.value();
    inputs_host = static_cast<int32_t*>(staging.ptr);
    targets_host = inputs_host + tokens_per_micro;
  }
  {
    auto ev = dev.create_event();
    if (!ev.ok()) return ev.status().with_context("token upload event");
    upload_done = ev.value();
  }
  if (Status st = dev.synchronize(stream); !st.ok()) return st.with_context("zeroing the trainer's buffers");
  batch_tokens.assign(static_cast<size_t>(opt.batch) * (seq + 1), 0);
  batch_mask.assign(batch_tokens.size(), 1);
  losses.assign(std::max<uint64_t>({uint64_t{accum}, eval_batch_count(), 1}), LossStats{});
  return {};
}

// Metrics: a fresh file for a fresh run; a resumed run appends.
Status Trainer::Impl::open_metrics() {
  if (rank != 0) return {};  // N ranks: rank 0 writes the metrics
  const std::string mpath = opt.metrics_path.empty() ? opt.out_dir + "/metrics.jsonl" : opt.metrics_path;
  // Never over another file (--metrics naming the data or the weights) or
  // into a FIFO: a metrics file of an earlier run (or none) only.
  STRATA_RETURN_IF_ERROR(check_replaceable(mpath, "metrics file", R"("event":)"));
  // A resumed run continues the file as if it had never stopped.
  if (!opt.resume_dir.empty()) STRATA_RETURN_IF_ERROR(trim_metrics(mpath, step, &metrics_eval_at_resume));
  metrics = std::fopen(mpath.c_str(), opt.resume_dir.empty() ? "w" : "a");
  if (!metrics) return Status::from_errno(errno, "metrics file " + mpath + ": cannot open for writing");
  metrics_file = mpath;
  return {};
}

// The backend, the trainer's stream and the ops, and the engine's device
// budget and reserve in *cfg (see "Devices" in trainer.h).
Status Trainer::Impl::choose_device(const DeviceSizes& z, Config* cfg) {
  if (world > 1 && opt.device == TrainDevice::kCuda) {
    // GPU ranks: one GPU each (LOCAL_RANK), meeting over NCCL (join_ranks).
    Status cuda = try_cuda(z, cfg);
    if (!cuda.ok())
      return Status(cuda.code(), fmt::format("--device cuda with {} GPU ranks: rank {} cannot train on GPU {} (its "
                                             "LOCAL_RANK): {}",
                                             world, rank, local_rank, cuda.message()));
    device_description = fmt::format("{} (rank {} of {} over NCCL)", backend->name(), rank, world);
    log_once(LogLevel::kInfo, "trainer-device",
             fmt::format("trainer: CUDA model ops on {} (rank {} of {} over NCCL)", backend->name(), rank, world));
    return {};
  }
  if (world > 1) {
    // Host ranks (--device cpu or auto) meet over MPI (mpirun) or TCP
    // (torchrun style) on the host backend.
    const char* over = launcher == comm::Launcher::kMpirun ? "MPI" : "TCP";
    device_description = fmt::format("cpu (host backend; rank {} of {} over {})", rank, world, over);
    log_once(LogLevel::kInfo, "trainer-device",
             fmt::format("trainer: CPU model ops on the host backend ({} ranks over {})", world, over));
    return use_host(z, cfg);
  }
  if (opt.device == TrainDevice::kCpu) {
    device_description = "cpu (host backend; --device cpu)";
    log_once(LogLevel::kInfo, "trainer-device", "trainer: CPU model ops on the host backend (--device cpu)");
    return use_host(z, cfg);
  }
  Status cuda = try_cuda(z, cfg);
  if (cuda.ok()) {
    device_description = backend->name();
    log_once(LogLevel::kInfo, "trainer-device",
             fmt::format("trainer: CUDA model ops on {} (device budget {}, reserve {})", backend->name(),
                         format_bytes(cfg->strata.device_memory), format_bytes(cfg->strata.device_reserve)));
    return {};
  }
  if (opt.device == TrainDevice::kCuda)
    return Status(cuda.code(), "--device cuda: cannot train on the GPU: " + cuda.message());
  // auto: a machine without a GPU is the normal case (info); a GPU the ops
  // cannot use is worth a warning.
  auto module = load_cuda_backend();
  const bool gpu = module.ok() && module->device_count > 0;
  device_description = "cpu (host backend): " + cuda.message();
  log_once(gpu ? LogLevel::kWarn : LogLevel::kInfo, "trainer-device",
           "trainer: CPU model ops on the host backend (--device auto): " + cuda.message());
  return use_host(z, cfg);
}

// The trainer reserves what its buffers take; a config's
// strata.device_reserve is kept free as well when it asks for more.
static uint64_t given_reserve(uint64_t needed, const StrataConfig& s) {
  if (!s.device_reserve_given || s.device_reserve <= needed) return needed;
  log_once(LogLevel::kInfo, "trainer-reserve",
           fmt::format("trainer: device reserve {} (strata.device_reserve; the trainer's buffers take {})",
                       format_bytes(s.device_reserve), format_bytes(needed)));
  return s.device_reserve;
}

Status Trainer::Impl::try_cuda(const DeviceSizes& z, Config* cfg) {
  CudaOpsOptions co;
  co.dims = dims;
  co.max_batch = opt.batch;
  co.max_seq = seq;
  // The workspace size loads the model-ops module (and the device module
  // before it): where either is missing this is the reason.
  STRATA_ASSIGN_OR_RETURN(uint64_t workspace, cuda_ops_workspace_bytes(co));
  // N GPU ranks: the NCCL communicator's scratch comes from the same pool.
  const uint64_t reserve =
      given_reserve(z.reserve(workspace, world > 1 ? uint64_t{comm::kNcclDefaultScratch} : 0), cfg->strata);
  // The budget: --device-mem / strata.device_memory when given, else 0:
  // the backend detects it (the GPU's free memory less a margin for the CUDA
  // context and libraries), and the planner gets the same figure.
  DeviceBackendOptions d;
  d.kind = DeviceBackendKind::kCuda;
  d.device = local_rank;
  d.budget_bytes = cfg->strata.device_memory;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<DeviceBackend> b, create_device_backend(d));
  const uint64_t budget = b->memory_stats().budget;
  STRATA_ASSIGN_OR_RETURN(DeviceStream* s, b->create_stream("train"));
  auto o = create_cuda_ops(*b, s, co);
  if (!o.ok()) {
    (void)b->destroy_stream(s);
    return o.status();
  }
  backend = std::move(b);
  stream = s;
  ops = std::move(o).value();
  sync_ops = ops->synchronous();
  cfg->strata.device_memory = budget;
  cfg->strata.device_reserve = reserve;
  return {};
}

Status Trainer::Impl::use_host(const DeviceSizes& z, Config* cfg) {
  // The working set (activations of every layer, gradient and group
  // buffers) is RAM here: one that cannot fit is refused now, by the flags
  // that size it, not met by the kernel's OOM killer midway (--batch 1000000).
  const uint64_t need = z.reserve_base + z.extra + z.group_buffers;
  // (N ranks on one host each compare with all of it: this catches the
  // impossible, the engine's budget divides the rest.)
  const uint64_t avail = host_memory_available();
  if (avail > 0 && need > avail)
    return Status(StatusCode::kOutOfBudget,
                  fmt::format("--device cpu: a micro-batch of --batch {} x --seq {} needs {} of RAM for the layers' "
                              "activations and the gradient and group buffers ({} of them activations), but {} is "
                              "available (MemAvailable); lower --batch or --seq (--grad-accum keeps the tokens per "
                              "step)",
                              opt.batch, seq, format_bytes(need), format_bytes(z.extra), format_bytes(avail)));
  // The "device" is RAM. The budget keeps what the engine's group buffers had
  // before the activations moved into the pool (at least 1 GiB), plus them.
  cfg->strata.device_reserve = given_reserve(z.reserve(), cfg->strata);
  if (cfg->strata.device_memory == 0)
    cfg->strata.device_memory = std::max<uint64_t>(1ull << 30, z.reserve_base + z.group_buffers) + z.extra;
  DeviceBackendOptions d;
  d.kind = DeviceBackendKind::kHost;
  d.budget_bytes = cfg->strata.device_memory;
  STRATA_ASSIGN_OR_RETURN(backend, create_device_backend(d));
  STRATA_ASSIGN_OR_RETURN(stream, backend->create_stream("train"));
  CpuOpsOptions co;
  co.dims = dims;
  co.max_batch = opt.batch;
  co.max_seq = seq;
  co.threads = opt.threads;
  STRATA_ASSIGN_OR_RETURN(ops, create_cpu_ops(co));
  sync_ops = ops->synchronous();
  return {};
}

// N ranks: every rank reaches the agreement, whether its own read failed or
// not, so the others learn of it at once and a rank that read other weights
// is named.
Status Trainer::Impl::load_weights() {
  uint32_t crc = 0;
  Status st = read_weights(&crc);
  STRATA_RETURN_IF_ERROR(agree_on_weights(st.ok(), crc));
  return st;
}

Status Trainer::Impl::read_weights(uint32_t* crc_out) {
  STRATA_ASSIGN_OR_RETURN(auto reader, model::TensorReader::create());
  const ModelSpec& spec = engine->model();
  std::vector<float> buf;
  // LoRA: the adapter file's tensors (checked against the adapters this run
  // has: none missing, none left over), or PEFT's initialisation.
  std::vector<model::TensorInfo> adapter;
  if (!opt.lora.adapter_dir.empty()) {
    const std::string path = opt.lora.adapter_dir + "/adapter_model.safetensors";
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0 && errno == ENOENT &&
        ::stat((opt.lora.adapter_dir + "/adapter_model.bin").c_str(), &st) == 0)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("LoRA adapter {}: it holds adapter_model.bin (a PyTorch pickle), and Strata reads "
                                "adapter_model.safetensors only (it never unpickles files); convert it with PEFT: "
                                "PeftModel.from_pretrained(base, \"{}\").save_pretrained(DIR) writes safetensors",
                                opt.lora.adapter_dir, opt.lora.adapter_dir));
    auto h = model::read_safetensors_header(path);
    if (!h.ok()) return h.status().with_context("LoRA adapter " + opt.lora.adapter_dir);
    adapter = std::move(h->tensors);
    std::set<std::string> want;
    for (const ParamSpec& ps : spec.params)
      if (ps.trainable) want.insert(peft_tensor_name(ps.name));
    for (const model::TensorInfo& t : adapter)
      if (!want.count(t.name))
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("LoRA adapter {}: tensor {} is not an adapter of this model and these targets "
                                  "(adapter_config.json: {}); refused rather than ignored",
                                  path, clip_for_message(t.name), fmt::join(lora_target_names(opt.lora.targets), ",")));
  }
  STRATA_RETURN_IF_ERROR(model::check_tied_head(model, *reader));
  std::mt19937_64 rng(opt.data.seed ^ 0x10a4a11ce5ull);
  uint32_t& crc = *crc_out;  // of every value loaded, in order: N ranks compare it
  for (ParamId p = 0; p < spec.params.size(); ++p) {
    const ParamSpec& ps = spec.params[p];
    if (opt.lora.enabled() && ps.trainable) {
      STRATA_RETURN_IF_ERROR(lora_initial(ps, adapter, *reader, rng, &buf));
      if (world > 1) crc = crc32c_extend(crc, buf.data(), buf.size() * sizeof(float));
      STRATA_RETURN_IF_ERROR(engine->load_param(p, buf.data(), DType::kF32));
      continue;
    }
    const model::TensorInfo* t = model.find(ps.name);
    if (!t)
      return Status(StatusCode::kNotFound, "model " + opt.model_dir + ": tensor " + ps.name + " is missing");
    buf.resize(ps.numel());
    if (Status st = reader->read(*t, DType::kF32, buf.data()); !st.ok())
      return st.with_context("model " + opt.model_dir + ": tensor " + ps.name);
    // A NaN/Inf weight would make every step skip and the run "succeed".
    const auto bad = std::find_if(buf.begin(), buf.end(), [](float v) { return !std::isfinite(v); });
    if (bad != buf.end())
      return Status(StatusCode::kCorrupt,
                    fmt::format("model {}: tensor {} holds a non-finite value ({}) at element {} of {}: the "
                                "weights are damaged",
                                opt.model_dir, ps.name, *bad, bad - buf.begin(), buf.size()));
    // fp16 compute copies: a weight past fp16's range would be inf in every
    // forward (every step skipped, the run "succeeding" on NaN losses).
    if (compute_dtype == DType::kF16) {
      const auto big = std::find_if(buf.begin(), buf.end(), [](float v) { return std::fabs(v) >= 65520.0f; });
      if (big != buf.end())
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("model {}: tensor {} holds {} at element {} of {}, beyond fp16's range (+-65504): "
                                  "fp16 compute copies cannot hold it; train in bf16 or fp32",
                                  opt.model_dir, ps.name, *big, big - buf.begin(), buf.size()));
    }
    if (world > 1) crc = crc32c_extend(crc, buf.data(), buf.size() * sizeof(float));
    STRATA_RETURN_IF_ERROR(engine->load_param(p, buf.data(), DType::kF32));
  }
  return {};
}

// LoRA settings: the adapter directory's config, or the flags with PEFT's
// default targets.
Status Trainer::Impl::resolve_lora() {
  LoraOptions& l = opt.lora;
  if (!l.adapter_dir.empty()) STRATA_RETURN_IF_ERROR(read_peft_adapter_config(l.adapter_dir, &l));
  if (!l.enabled()) {
    if (l.merge) return Status(StatusCode::kInvalidArgument, "--lora-merge needs LoRA (--lora-rank or --lora-adapter)");
    return {};
  }
  if (l.targets == 0 && l.target_regex.empty()) l.targets = kLoraDefaultTargets;  // a pattern: open_model
  if (!(l.dropout >= 0 && l.dropout < 1))
    return Status(StatusCode::kInvalidArgument, fmt::format("LoRA dropout {} is outside [0, 1)", l.dropout));
  if (!std::isfinite(l.alpha)) return Status(StatusCode::kInvalidArgument, "LoRA alpha must be finite");
  return {};
}

Status Trainer::Impl::lora_initial(const ParamSpec& ps, const std::vector<model::TensorInfo>& adapter,
                                   model::TensorReader& reader, std::mt19937_64& rng, std::vector<float>* buf) {
  buf->resize(ps.numel());
  if (opt.lora.adapter_dir.empty()) {
    LayerTensor t = kQLoraA;
    for (LayerTensor c : kAllLayerTensors)
      if (ps.name.ends_with(weight_row(c).name)) t = c;
    lora_init(t, ps.shape[0], ps.shape[1], rng, buf->data());
    return {};
  }
  const std::string name = peft_tensor_name(ps.name);
  const std::string where = "LoRA adapter " + opt.lora.adapter_dir + "/adapter_model.safetensors";
  const model::TensorInfo* t = nullptr;
  for (const model::TensorInfo& a : adapter)
    if (a.name == name) t = &a;
  if (!t) return Status(StatusCode::kNotFound, where + ": tensor " + name + " is missing");
  if (t->shape != ps.shape)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: tensor {} is [{}], expected [{}] (r = {})", where, name, fmt::join(t->shape, ", "),
                              fmt::join(ps.shape, ", "), opt.lora.rank));
  if (Status st = reader.read(*t, DType::kF32, buf->data()); !st.ok()) return st.with_context(where + ": " + name);
  const auto bad = std::find_if(buf->begin(), buf->end(), [](float v) { return !std::isfinite(v); });
  if (bad != buf->end())
    return Status(StatusCode::kCorrupt, fmt::format("{}: tensor {} holds a non-finite value at element {}", where,
                                                    name, bad - buf->begin()));
  return {};
}

// What must stay the same for the whole run (run_dir.h, check_same_settings).
std::string Trainer::Impl::settings_json() const {
  const OptimizerConfig& o = opt.config.optimizer;
  json t;
  t["seed"] = opt.data.seed;
  // The global micro-batch (batch x ranks): what the data order depends on,
  // so a checkpoint resumes on another number of ranks with the same global
  // batch (the engine reshards it). One rank: --batch, as always.
  t["batch"] = static_cast<uint64_t>(opt.batch) * world;
  t["seq"] = seq;
  t["grad_accum"] = accum;
  // Files by their absolute path (the same file reached from another
  // directory is the same data; the warning on a resume names real moves).
  auto where = [](const std::string& p) -> std::string {
    if (p.empty()) return p;
    std::error_code ec;
    const auto abs = std::filesystem::weakly_canonical(p, ec);
    return ec ? p : abs.string();
  };
  t["data"] = where(opt.data.path);
  t["data_format"] = data_format_name(opt.data.format);
  t["loss_mask"] = where(opt.data.loss_mask_path);
  if (!opt.data.documents_path.empty()) t["documents"] = where(opt.data.documents_path);
  t["windows"] = opt.data.documents_path.empty()    ? "packed"
                 : opt.data.truncate_documents ? "by document, truncated"
                                               : "by document";
  // What the data holds, as far as the sample order goes: a file moved is
  // fine (its path only warns), one with other contents is another run (and
  // ranks reading different copies would disagree on their collectives).
  if (data) {
    t["data_shape"] = {{"tokens", data->tokens()},
                       {"train_windows", data->train_windows()},
                       {"val_windows", data->val_windows()}};
    if (data_fingerprint) t["data_shape"]["crc32c"] = *data_fingerprint;
  }
  t["val_fraction"] = opt.data.val_fraction;
  // What the model computes (beyond the shapes the checkpoint checks): a
  // resume with another config.json of the same shapes would mix two models.
  const model::LlamaConfig& mc = model.config;
  t["model"] = {{"model_type", model::model_arch_type(mc.arch)},
                {"hidden_size", mc.hidden_size},
                {"intermediate_size", mc.intermediate_size},
                {"num_hidden_layers", mc.num_hidden_layers},
                {"num_attention_heads", mc.num_attention_heads},
                {"num_key_value_heads", mc.num_key_value_heads},
                {"head_dim", mc.head_dim()},
                {"vocab_size", mc.vocab_size},
                {"rms_norm_eps", mc.rms_norm_eps},
                {"rope", model::rope_describe(mc.rope)},
                {"sliding_window", mc.sliding_window ? json(*mc.sliding_window) : json(nullptr)},
                {"pad_token_id", mc.pad_token_id >= 0 ? json(mc.pad_token_id) : json(nullptr)},
                {"tie_word_embeddings", mc.tie_word_embeddings}};
  t["schedule"] = {{"kind", schedule_kind_name(opt.schedule.kind)},
                   {"lr", opt.schedule.lr},
                   {"min_lr", opt.schedule.min_lr},
                   {"warmup", opt.schedule.warmup},
                   {"total", opt.steps}};
  if (is_deepspeed_schedule(opt.schedule.kind)) {  // only then: older runs' settings stay as they were
    const Schedule::DeepSpeed& d = opt.schedule.ds;
    t["schedule"]["deepspeed"] = {{"warmup_min_lr", d.warmup_min_lr},       {"warmup_max_lr", d.warmup_max_lr},
                                  {"warmup_num_steps", d.warmup_num_steps}, {"log_warmup", d.log_warmup},
                                  {"total_num_steps", d.total_num_steps},   {"warmup_min_ratio", d.warmup_min_ratio},
                                  {"cos_min_ratio", d.cos_min_ratio}};
  }
  t["optimizer"] = {{"beta1", o.beta1},
                    {"beta2", o.beta2},
                    {"eps", o.eps},
                    {"weight_decay", o.weight_decay},
                    {"weight_decay_all", opt.weight_decay_all},
                    {"gradient_clipping", opt.config.gradient_clipping}};
  if (opt.lora.enabled())
    t["lora"] = {{"rank", opt.lora.rank},
                 {"alpha", opt.lora.alpha},
                 {"dropout", opt.lora.dropout},
                 {"targets", lora_target_names(opt.lora.targets)},
                 {"rslora", opt.lora.rslora}};
  return t.dump();
}

std::string Trainer::Impl::extra_json() const {
  json t = json::parse(settings_json());
  t["step"] = step;
  t["tokens"] = tokens_seen;
  t["last_loss"] = last_loss;
  t["run_id"] = run_dir ? run_dir->run_id() : run_id;
  return json{{"trainer", t}}.dump();
}

Status Trainer::Impl::resume(const std::string& dir) {
  std::string extra;
  if (Status st = engine->load_checkpoint(dir, &extra); !st.ok()) {
    st = st.with_context("resume from " + dir);
    if (st.code() != StatusCode::kCorrupt) return st;
    // Name the newest older checkpoint of this run that verifies, if any
    // (the user decides whether to go back to it).
    const auto cks = list_checkpoint_dirs(parent_of(dir));
    bool older = false;
    for (auto it = cks.rbegin(); it != cks.rend(); ++it) {
      if (!older) {
        older = it->path == dir || base_of(it->path) == base_of(dir);
        continue;
      }
      auto id = checkpoint_run_id(it->path);
      if (!id.ok() || !run_dir || *id != run_dir->run_id()) continue;
      if (CheckpointReader::open(it->path).ok())
        return Status(st.code(),
                      st.message() + fmt::format("; {} is intact: resume from it with --resume {}", it->path, it->path));
    }
    return st;
  }
  json j = json::parse(extra, nullptr, false);
  if (j.is_discarded() || !j.contains("trainer") || !j["trainer"].is_object())
    return Status(StatusCode::kCorrupt, "resume from " + dir + ": the checkpoint has no trainer state "
                                        "(not written by strata finetune?)");
  const json& t = j["trainer"];
  auto mismatch = [&](const char* key, const json& now) -> Status {
    if (!t.contains(key) || t[key] != now)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("resume from {}: the checkpoint was made with {} = {}, this run has {}{}: the data "
                                "order would differ; use the same value",
                                dir, key, t.contains(key) ? t[key].dump() : "(absent)", now.dump(),
                                std::string_view(key) == "batch"
                                    ? fmt::format(" (the global batch: --batch {} x {} rank(s))", opt.batch, world)
                                    : std::string()));
    return {};
  };
  STRATA_RETURN_IF_ERROR(mismatch("batch", static_cast<uint64_t>(opt.batch) * world));  // global: batch x ranks
  STRATA_RETURN_IF_ERROR(mismatch("seq", seq));
  STRATA_RETURN_IF_ERROR(mismatch("grad_accum", accum));
  STRATA_RETURN_IF_ERROR(mismatch("seed", opt.data.seed));
  STRATA_RETURN_IF_ERROR(check_same_settings(t.dump(), settings_json(), dir));
  step = t.value("step", int64_t{0});
  tokens_seen = t.value("tokens", uint64_t{0});
  last_loss = t.value("last_loss", 0.0);
  log_info("resumed run {} from {} at step {}", run_dir ? run_dir->run_id() : run_id, dir, step);
  return {};
}

json Trainer::Impl::stats_json() const {
  const EngineStats s = engine->stats();
  return json{{"device_bytes", s.tier_bytes[static_cast<int>(Tier::kDevice)]},
              {"host_bytes", s.tier_bytes[static_cast<int>(Tier::kHost)]},
              {"nvme_bytes", s.tier_bytes[static_cast<int>(Tier::kNvme)]},
              {"nvme_read_bytes", s.nvme_read_bytes},
              {"nvme_write_bytes", s.nvme_write_bytes},
              {"h2d_bytes", s.h2d_bytes},
              {"d2h_bytes", s.d2h_bytes},
              {"comm_bytes", s.comm_bytes},
              {"gathers_ahead", s.gathers_ahead},
              {"gathers_reused", s.gathers_reused}};
}

// A line that cannot be written (a full disk) stops the run: the file is the
// run's record, and a resume drops a cut last line.
Status Trainer::Impl::write_metrics(const json& j) {
  if (!metrics) return {};
  const std::string line = j.dump() + "\n";
  errno = 0;
  if (std::fwrite(line.data(), 1, line.size(), metrics) != line.size() || std::fflush(metrics) != 0) {
    const int err = errno != 0 ? errno : EIO;
    std::fclose(metrics);  // once failed, nothing more is written (the next line would follow a cut one)
    metrics = nullptr;
    Status st = Status::from_errno(err, fmt::format("metrics file {}: cannot write the {} line at step {}",
                                                    metrics_file, j.value("event", std::string("?")), step));
    if (!metrics_deferred) return st;
    log_error("{}: the run saves a checkpoint and stops", st.message());
    metrics_error = std::move(st);
  }
  return {};
}

Result<GroupView> Trainer::Impl::acquire(GroupId g) {
  auto v = engine->acquire(g, stream);
  if (!v.ok()) return v.status();
  // Synchronous (CPU) ops read the buffers directly: wait for the upload (and
  // for every earlier reduce_grad's download of the gradient buffer, and the
  // token upload, which the stream also waits on) before computing.
  // Stream-ordered ops need nothing: their work queues behind the upload.
  if (sync_ops) STRATA_RETURN_IF_ERROR(backend->synchronize(stream));
  return v;
}

// batch_tokens -> pinned staging -> inputs/targets (device), on the stream.
// The targets of batch_tokens / batch_mask that count in the loss (as
// stage_tokens makes them: position t's target is token t+1, counted where
// its mask byte is 1).
uint64_t Trainer::Impl::counted_targets() const {
  const int64_t B = opt.batch, T = seq;
  uint64_t n = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) n += batch_mask[b * (T + 1) + t + 1] ? 1 : 0;
  return n;
}

Status Trainer::Impl::stage_tokens() {
  // The last upload must have read the staging buffer before it is rewritten
  // (on CUDA the host may be ahead of the stream by a whole micro-batch).
  STRATA_RETURN_IF_ERROR(backend->synchronize(upload_done));
  const int64_t B = opt.batch, T = seq;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      inputs_host[b * T + t] = batch_tokens[b * (T + 1) + t];
      // A masked target is ignored (negative), as HF's labels of -100.
      targets_host[b * T + t] = batch_mask[b * (T + 1) + t + 1] ? batch_tokens[b * (T + 1) + t + 1] : -100;
    }
  const size_t bytes = static_cast<size_t>(tokens_per_micro) * sizeof(int32_t);
  STRATA_RETURN_IF_ERROR(backend->copy_async(inputs, inputs_host, bytes, CopyKind::kHostToDevice, stream));
  STRATA_RETURN_IF_ERROR(backend->copy_async(targets, targets_host, bytes, CopyKind::kHostToDevice, stream));
  return backend->record(upload_done, stream);
}

const void* Trainer::Impl::ptr_of(const GroupView& v, ParamId p) const {
  for (size_t i = 0; i < v.params.size(); ++i)
    if (v.params[i] == p) return v.ptr[i];
  return nullptr;
}

LayerWeights Trainer::Impl::layer_weights(const GroupView& v, size_t layer, bool training) const {
  const LayerArray<ParamId>& ids = layer_param_ids[layer];
  LayerWeights w;
  w.dtype = compute_dtype;
  w.lora_dtype = DType::kF32;
  w.lora_dropout_on = training && dims.lora_dropout > 0;
  // A seed per layer (splitmix-style mixing of the data seed and the layer);
  // the rows are keyed by the micro-batch's first sample (model_ops.h): the
  // same masks on N ranks of batch b as on one rank of batch N x b, and
  // other masks on every rank.
  w.lora_seed = (opt.data.seed + 0x9E3779B97F4A7C15ull) ^ (0xC2B2AE3D27D4EB4Full * (layer + 1));
  w.lora_row0 = micro_first_sample * static_cast<uint64_t>(seq);
  for (LayerTensor t : kAllLayerTensors) w[t] = dims.has(t) ? ptr_of(v, ids[t]) : nullptr;
  return w;
}

HeadWeights Trainer::Impl::head_weights(const GroupView& ev, const GroupView& hv) const {
  return {.dtype = compute_dtype,
          .norm = ptr_of(hv, norm_param),
          .lm_head = dims.tied ? ptr_of(ev, embed_param) : ptr_of(hv, lm_head_param)};
}

// Embedding and layers; acts[l] = input of layer l, acts[L] = input of the head.
Status Trainer::Impl::forward(const int32_t* tokens, bool training) {
  const size_t act = static_cast<size_t>(tokens_per_micro * dims.dim);
  const int64_t B = opt.batch, T = seq;
  {
    engine->trace_begin("embed_forward");
    STRATA_ASSIGN_OR_RETURN(GroupView v, acquire(embed_group));
    const EmbedWeights w{.dtype = compute_dtype, .embed_tokens = ptr_of(v, embed_param)};
    Status st = ops->embed_forward(w, tokens, B, T, acts);
    STRATA_RETURN_IF_ERROR(engine->release(embed_group, stream));
    engine->trace_end();
    STRATA_RETURN_IF_ERROR(st);
  }
  for (size_t l = 0; l < layer_groups.size(); ++l) {
    engine->trace_begin("layer_forward");
    STRATA_ASSIGN_OR_RETURN(GroupView v, acquire(layer_groups[l]));
    const LayerWeights w = layer_weights(v, l, training);
    Status st = ops->layer_forward(w, B, T, acts + l * act, acts + (l + 1) * act);
    STRATA_RETURN_IF_ERROR(engine->release(layer_groups[l], stream));
    engine->trace_end();
    STRATA_RETURN_IF_ERROR(st);
  }
  return {};
}

Status Trainer::Impl::micro_batch(bool last, double weight, LossStats* loss) {
  const size_t act = static_cast<size_t>(tokens_per_micro * dims.dim);
  const int64_t B = opt.batch, T = seq;
  const size_t L = layer_groups.size();
  STRATA_RETURN_IF_ERROR(engine->begin_micro_batch(last));
  STRATA_RETURN_IF_ERROR(forward(inputs, true));

  // Head: loss, dx and the head's gradients.
  const float dloss = static_cast<float>(engine->loss_scale() * weight);
  {
    engine->trace_begin("head_forward_backward");
    GroupView ev{};
    if (dims.tied) {
      STRATA_ASSIGN_OR_RETURN(ev, acquire(embed_group));
    }
    STRATA_ASSIGN_OR_RETURN(GroupView hv, acquire(head_group));
    const HeadWeights w = head_weights(ev, hv);
    const uint64_t dim = static_cast<uint64_t>(dims.dim);
    // Frozen tensors (LoRA) get no gradient buffer: the ops skip them.
    const HeadGrads g{.norm = grad_if_trainable(norm_param, grad_buf),
                      .lm_head = grad_if_trainable(lm_head_param, dims.tied ? tied_grad : grad_buf + dim)};
    Status st = ops->head_forward_backward(w, acts + L * act, targets, nullptr, B, T, dloss, loss, dx_a, g);
    if (st.ok() && g.norm) st = engine->reduce_grad(norm_param, grad_buf, DType::kF32, stream);
    if (st.ok() && !dims.tied && g.lm_head)
      st = engine->reduce_grad(lm_head_param, grad_buf + dim, DType::kF32, stream);
    Status rel = engine->release(head_group, stream);
    if (dims.tied && rel.ok()) rel = engine->release(embed_group, stream);
    engine->trace_end();
    STRATA_RETURN_IF_ERROR(st);
    STRATA_RETURN_IF_ERROR(rel);
  }

  // Layers in reverse: dy in dx_a, dx into dx_b, then swap.
  const ModelSpec& spec = engine->model();
  for (size_t l = L; l-- > 0;) {
    engine->trace_begin("layer_backward");
    STRATA_ASSIGN_OR_RETURN(GroupView v, acquire(layer_groups[l]));
    const auto& id = layer_param_ids[l];
    const LayerWeights w = layer_weights(v, l, true);
    // The layer's trainable gradients one after the other in grad_buf, in
    // table order (frozen tensors: null, not computed).
    LayerGrads g;
    float* cursor = grad_buf;
    for (LayerTensor t : kAllLayerTensors) {
      if (!dims.has(t) || !trainable[id[t]]) continue;
      g[t] = cursor;
      cursor += spec.params[id[t]].numel();
    }
    Status st = ops->layer_backward(w, B, T, acts + l * act, dx_a, dx_b, g);
    for (LayerTensor t : kAllLayerTensors) {
      if (!st.ok()) break;
      if (!g[t]) continue;
      st = engine->reduce_grad(id[t], g[t], DType::kF32, stream);
    }
    Status rel = engine->release(layer_groups[l], stream);
    engine->trace_end();
    STRATA_RETURN_IF_ERROR(st);
    STRATA_RETURN_IF_ERROR(rel);
    std::swap(dx_a, dx_b);
  }

  // Embedding: no weights needed, only the gradient (none when frozen).
  if (!trainable[embed_param]) return {};
  engine->trace_begin("embed_backward");
  // Synchronous ops: the stream must have finished downloading the last
  // layer's gradients before grad_buf is overwritten (stream-ordered ops
  // queue behind that download).
  if (sync_ops) STRATA_RETURN_IF_ERROR(backend->synchronize(stream));
  float* ge = dims.tied ? tied_grad : grad_buf;
  // transformers' nn.Embedding(padding_idx=pad_token_id): the lookup adds
  // nothing to that row (a tied head's part of it stays).
  const int64_t pad = model.config.pad_token_id;
  float* pad_dst = pad >= 0 ? ge + pad * dims.dim : nullptr;
  const size_t row_bytes = static_cast<size_t>(dims.dim) * sizeof(float);
  // Synchronous ops work on host memory here and now; stream-ordered ones
  // (CUDA) queue the row's copies around the kernel.
  auto copy_row = [&](float* dst, const float* src) -> Status {
    if (sync_ops) {
      src ? std::memcpy(dst, src, row_bytes) : std::memset(dst, 0, row_bytes);
      return {};
    }
    return src ? backend->copy_async(dst, src, row_bytes, CopyKind::kDeviceToDevice, stream)
               : backend->fill_zero_async(dst, row_bytes, stream);
  };
  Status st;
  if (pad_dst && dims.tied) st = copy_row(pad_row, pad_dst);
  if (st.ok()) st = ops->embed_backward(inputs, B, T, dx_a, ge, /*accumulate=*/dims.tied);
  if (st.ok() && pad_dst) st = copy_row(pad_dst, dims.tied ? pad_row : nullptr);
  if (st.ok()) st = engine->reduce_grad(embed_param, ge, DType::kF32, stream);
  engine->trace_end();
  return st;
}

Result<StepReport> Trainer::train_step() {
  Impl& m = *impl_;
  const auto t0 = Clock::now();
  // N ranks: rank r takes positions r*b .. r*b+b-1 of each global
  // micro-batch of N*b sequences (trainer.h, "Ranks").
  const uint64_t global_micro = static_cast<uint64_t>(m.opt.batch) * m.world;
  const uint64_t S = global_micro * m.accum;
  const int64_t T = m.seq;
  auto first_of = [&](uint32_t mb) {
    return static_cast<uint64_t>(m.step) * S + static_cast<uint64_t>(mb) * global_micro +
           static_cast<uint64_t>(m.rank) * m.opt.batch;
  };
  // The step's loss is the mean over every counted target of the step, on
  // every rank, and so is its gradient (Hugging Face Trainer's
  // num_items_in_batch weighting): each micro-batch's loss (a mean over its
  // own targets) weighs count_mb * M * N / count_step, since the engine
  // averages the M micro-batches and N ranks. With a loss mask the counts
  // differ (a micro-batch of 5 targets would weigh as one of 500); without
  // one every weight is exactly 1.
  std::vector<double> weight(m.accum, 1.0);
  if (m.data->has_loss_mask()) {
    double mine = 0;
    for (uint32_t mb = 0; mb < m.accum; ++mb) {
      STRATA_RETURN_IF_ERROR(m.data->train_batch(first_of(mb), m.opt.batch, m.batch_tokens, m.batch_mask));
      weight[mb] = static_cast<double>(m.counted_targets());
      mine += weight[mb];
    }
    double all = mine;
    if (m.world > 1) {
      std::vector<double> gathered;
      STRATA_RETURN_IF_ERROR(m.all_gather(&mine, 1, &gathered));
      all = 0;
      for (double c : gathered) all += c;
    }
    // x M whether or not the engine averages the micro-batches: an all-ones
    // mask then weighs exactly 1, as no mask does.
    for (double& w : weight) w = all > 0 ? w * m.accum * m.world / all : 1.0;
  }
  for (uint32_t mb = 0; mb < m.accum; ++mb) {
    STRATA_RETURN_IF_ERROR(m.data->train_batch(first_of(mb), m.opt.batch, m.batch_tokens, m.batch_mask));
    STRATA_RETURN_IF_ERROR(m.stage_tokens());
    m.losses[mb] = LossStats{};
    m.micro_first_sample = first_of(mb);
    STRATA_RETURN_IF_ERROR(m.micro_batch(mb + 1 == m.accum, weight[mb], &m.losses[mb]));
  }
  // Every reduce_grad must have been read before step() (it waits for the
  // engine's own work; the stream's downloads are ordered before it by the
  // engine, but the last buffer is ours to keep valid until then). This is
  // also where stream-ordered ops have written the losses (and report bad
  // token ids).
  STRATA_RETURN_IF_ERROR(m.backend->synchronize(m.stream));
  LossStats total;
  for (uint32_t mb = 0; mb < m.accum; ++mb) {
    total.sum += m.losses[mb].sum;
    total.count += m.losses[mb].count;
  }
  if (m.world > 1) {  // the loss over every rank's tokens
    const double mine[2] = {static_cast<double>(total.sum), static_cast<double>(total.count)};
    std::vector<double> all;
    STRATA_RETURN_IF_ERROR(m.all_gather(mine, 2, &all));
    total = LossStats{};
    for (uint32_t r = 0; r < m.world; ++r) {
      total.sum += all[2 * r];
      total.count += static_cast<decltype(total.count)>(all[2 * r + 1]);
    }
  }
  if (total.count == 0)  // every target of the step masked: loss 0 and a zero gradient (HF would give NaN)
    log_once(LogLevel::kWarn, "trainer.no-targets",
             fmt::format("step {}: the loss mask leaves no target in this step's windows: its loss is reported "
                         "as 0 and its gradient is zero (AdamW still moves the weights by its moments); said once",
                         m.step + 1));
  Schedule sched = m.opt.schedule;
  sched.total = std::max<int64_t>(1, m.opt.steps);
  const double lr = schedule_lr(sched, m.step);
  STRATA_ASSIGN_OR_RETURN(StepResult r, m.engine->step(lr));
  ++m.step;
  m.tokens_seen += S * static_cast<uint64_t>(T);  // every rank's
  m.last_loss = total.mean();
  StepReport rep;
  rep.step = m.step;
  rep.loss = total.mean();
  rep.lr = lr;
  rep.engine = r;
  rep.seconds = seconds_since(t0);
  return rep;
}

Result<double> Trainer::evaluate() {
  Impl& m = *impl_;
  const uint64_t n = m.eval_batch_count();
  if (n == 0)
    return Status(StatusCode::kInvalidArgument, "data " + m.opt.data.path + " has no validation part to evaluate on");
  const int64_t B = m.opt.batch, T = m.seq;
  const size_t act = static_cast<size_t>(m.tokens_per_micro * m.dims.dim);
  const size_t L = m.layer_groups.size();
  // Global validation batch j is windows j*N*b .. of N*b (N ranks of batch
  // b): rank r evaluates its b of them, as in training, so N ranks of batch
  // b report what one rank of batch N*b reports. The last batch holds the
  // windows left (as a DataLoader's last batch): a rank's rows past the end
  // are all padding, no target (every rank still runs the forward, whose
  // stage-3 gathers are collectives).
  const uint64_t global_batch = static_cast<uint64_t>(m.opt.batch) * m.world;
  const uint64_t windows = m.data->val_windows();
  const size_t row = static_cast<size_t>(T + 1);
  for (uint64_t j = 0; j < n; ++j) {
    const uint64_t first = j * global_batch + static_cast<uint64_t>(m.rank) * m.opt.batch;
    const uint64_t real = first < windows ? std::min<uint64_t>(m.opt.batch, windows - first) : 0;
    if (real > 0)
      STRATA_RETURN_IF_ERROR(m.data->val_windows(first, static_cast<uint32_t>(real),
                                                 std::span(m.batch_tokens).first(real * row),
                                                 std::span(m.batch_mask).first(real * row)));
    std::fill(m.batch_tokens.begin() + static_cast<std::ptrdiff_t>(real * row), m.batch_tokens.end(), 0);
    std::fill(m.batch_mask.begin() + static_cast<std::ptrdiff_t>(real * row), m.batch_mask.end(), 0);
    STRATA_RETURN_IF_ERROR(m.stage_tokens());
    STRATA_RETURN_IF_ERROR(m.forward(m.inputs, false));
    GroupView ev{};
    if (m.dims.tied) {
      STRATA_ASSIGN_OR_RETURN(ev, m.acquire(m.embed_group));
    }
    STRATA_ASSIGN_OR_RETURN(GroupView hv, m.acquire(m.head_group));
    const HeadWeights w = m.head_weights(ev, hv);
    m.losses[j] = LossStats{};
    Status st = m.ops->head_loss(w, m.acts + L * act, m.targets, nullptr, B, T, &m.losses[j]);
    Status rel = m.engine->release(m.head_group, m.stream);
    if (m.dims.tied && rel.ok()) rel = m.engine->release(m.embed_group, m.stream);
    STRATA_RETURN_IF_ERROR(st);
    STRATA_RETURN_IF_ERROR(rel);
  }
  // Stream-ordered ops write the losses when the stream gets there.
  STRATA_RETURN_IF_ERROR(m.backend->synchronize(m.stream));
  std::vector<LossStats> batches(m.losses.begin(), m.losses.begin() + static_cast<std::ptrdiff_t>(n));
  if (m.world > 1) {  // each global batch's sum and count over every rank
    std::vector<double> mine(2 * n), all;
    for (uint64_t j = 0; j < n; ++j) {
      mine[2 * j] = batches[j].sum;
      mine[2 * j + 1] = static_cast<double>(batches[j].count);
    }
    STRATA_RETURN_IF_ERROR(m.all_gather(mine.data(), mine.size(), &all));
    for (uint64_t j = 0; j < n; ++j) {
      batches[j] = LossStats{};
      for (uint32_t r = 0; r < m.world; ++r) {
        batches[j].sum += all[r * 2 * n + 2 * j];
        batches[j].count += static_cast<int64_t>(all[r * 2 * n + 2 * j + 1]);
      }
    }
  }
  // Hugging Face Trainer's eval_loss (one process, batch N*b): each batch's
  // mean loss over its counted targets, weighted by the windows it holds. A
  // batch with no counted target has a NaN loss there, which the Trainer
  // leaves out (logging_nan_inf_filter); so does this.
  double sum = 0, weight = 0;
  for (uint64_t j = 0; j < n; ++j) {
    if (batches[j].count == 0) continue;
    const double held = static_cast<double>(std::min<uint64_t>(global_batch, windows - j * global_batch));
    sum += held * batches[j].mean();
    weight += held;
  }
  return weight > 0 ? sum / weight : 0.0;
}

Status Trainer::save_checkpoint(const std::string& dir) {
  return impl_->engine->save_checkpoint(dir, impl_->extra_json());
}

// N ranks: every rank assembles each tensor (gather_param is a collective),
// rank 0 writes the files.
// A value the export dtype cannot hold (it would be written as inf, and no
// loader, Strata's included, takes the file back) is refused naming it.
static Status check_export_range(const std::string& name, const std::vector<float>& v, DType dtype) {
  // The smallest magnitudes that round to inf: 65520 for fp16; bf16's largest
  // finite value plus half an ulp (0x7F7F8000).
  const float limit = dtype == DType::kF16 ? 65520.0f : dtype == DType::kBF16 ? std::bit_cast<float>(0x7F7F8000u)
                                                                              : INFINITY;
  const auto bad = std::find_if(v.begin(), v.end(), [&](float x) { return !(std::fabs(x) < limit); });
  if (bad == v.end()) return {};
  if (!std::isfinite(*bad))
    return Status(StatusCode::kCorrupt, fmt::format("tensor {} holds a non-finite value ({}) at element {} of {}", name,
                                                    *bad, bad - v.begin(), v.size()));
  return Status(StatusCode::kInvalidArgument,
                fmt::format("tensor {} holds {} at element {} of {}, beyond {}'s range: it would be written as inf; "
                            "export in {} (--export-dtype)",
                            name, *bad, bad - v.begin(), v.size(), dtype_name(dtype),
                            dtype == DType::kF16 ? "bf16 or fp32" : "fp32"));
}

// N ranks: what rank 0's writing came to (`wst` there), given to every rank
// so all fail alike or none does (each then saves its part, keep_work).
static Status rank0_outcome(Engine& engine, uint32_t rank, uint32_t world, Status wst, const std::string& what) {
  if (world <= 1) return wst;
  int32_t code = rank == 0 ? static_cast<int32_t>(wst.code()) : 0;
  STRATA_RETURN_IF_ERROR(engine.broadcast(&code, sizeof(code), 0));
  if (rank != 0 && code != 0)
    return Status(static_cast<StatusCode>(code), "rank 0 could not write " + what + " (its error says why)");
  return wst;
}

namespace {

// Rank 0's writing of an export (N ranks: every rank gathers, rank 0
// writes). Its first failed write stops the writing (the temp file goes with
// the writer), never the gathers the other ranks take part in; `st` is the
// outcome rank0_outcome shares.
struct ExportWriter {
  std::unique_ptr<model::SafetensorsWriter> w;
  Status st;
  void fail(Status s) {
    if (st.ok() && !s.ok()) st = std::move(s);
    if (!st.ok()) w.reset();
  }
  // Makes `dir` (`what` names it in errors), removes its `last` file (written
  // last: a directory holding it is a whole export, and no stale one stays)
  // and opens `file` there for `decls`.
  void open(const std::string& dir, const char* what, const char* last, const char* file,
            const std::vector<model::TensorDecl>& decls) {
    fail(make_dirs(dir, what));
    if (st.ok()) {
      std::error_code ec;
      fs::remove(dir + "/" + last, ec);
      if (ec) fail(Status::from_errno(ec.value(), fmt::format("{} {}: cannot remove the old {}", what, dir, last)));
    }
    if (!st.ok()) return;
    auto created = model::SafetensorsWriter::create(dir + "/" + file, decls);
    if (created.ok())
      w = std::move(created).value();
    else
      fail(created.status());
  }
};

}  // namespace

Status Trainer::export_model(const std::string& dir, DType dtype) {
  Impl& m = *impl_;
  const bool writes = m.rank == 0;
  // A directory this export made is removed again if the export fails (the
  // writers remove their own files): no empty OUT/model left behind.
  std::error_code exists_ec;
  const bool made = writes && !fs::exists(dir, exists_ec) && !exists_ec;
  Status st = [&]() -> Status {
    model::LlamaConfig cfg = m.model.config;
    cfg.torch_dtype = dtype;
    std::vector<model::TensorDecl> decls = model::llama_tensor_decls(cfg, model::from_dtype(dtype));
    // Rank 0 writes (ExportWriter); all ranks learn the outcome at the end
    // (the trainer then saves the trained state on every rank, keep_work).
    // config.json comes last: a directory that has it is a whole model.
    ExportWriter out;
    if (writes) out.open(dir, "export dir", "config.json", "model.safetensors", decls);
    std::vector<float> buf, a, b;
    for (const model::TensorDecl& d : decls) {
      STRATA_ASSIGN_OR_RETURN(ParamId p, m.engine->find_param(d.name));
      buf.resize(d.numel());
      STRATA_RETURN_IF_ERROR(m.engine->gather_param(p, buf.data(), DType::kF32));
      // LoRA: W + scaling * B A for an adapted projection (PEFT's merge).
      const std::string a_name = d.name.substr(0, d.name.size() - 7) + ".lora_A.weight";  // "<module>.weight"
      if (m.opt.lora.enabled() && d.name.ends_with(".weight") && m.engine->find_param(a_name).ok()) {
        const std::string b_name = d.name.substr(0, d.name.size() - 7) + ".lora_B.weight";
        STRATA_ASSIGN_OR_RETURN(ParamId pa, m.engine->find_param(a_name));
        STRATA_ASSIGN_OR_RETURN(ParamId pb, m.engine->find_param(b_name));
        const uint64_t r = m.opt.lora.rank, out = d.shape[0], in = d.shape[1];
        a.resize(r * in);
        b.resize(out * r);
        STRATA_RETURN_IF_ERROR(m.engine->gather_param(pa, a.data(), DType::kF32));
        STRATA_RETURN_IF_ERROR(m.engine->gather_param(pb, b.data(), DType::kF32));
        const double sc = m.opt.lora.scaling();
        for (uint64_t i = 0; i < out; ++i)
          for (uint64_t j = 0; j < in; ++j) {
            double acc = 0;
            for (uint64_t k = 0; k < r; ++k) acc += static_cast<double>(b[i * r + k]) * a[k * in + j];
            buf[i * in + j] = static_cast<float>(buf[i * in + j] + sc * acc);
          }
      }
      // Every rank holds the whole tensor here and checks it, so all ranks
      // fail at the same one.
      if (Status range = check_export_range(d.name, buf, dtype); !range.ok()) {
        m.export_failure_agreed = true;
        return range;
      }
      if (out.w) out.fail(out.w->write_from(DType::kF32, buf.data(), d.numel()));
    }
    if (out.w) out.fail(out.w->finish());
    if (out.w) {
      std::vector<std::string> copied;  // the tokenizer and generation config, as the base model has them
      out.fail(model::copy_model_side_files(m.opt.model_dir, dir, &copied));
      if (out.st.ok()) out.fail(model::save_llama_config(cfg, dir + "/config.json"));
    }
    Status agreed = rank0_outcome(*m.engine, m.rank, m.world, std::move(out.st), "the export to " + dir);
    if (!agreed.ok()) m.export_failure_agreed = true;
    return agreed;
  }();
  if (!st.ok() && made) {
    std::error_code ec;
    fs::remove(dir, ec);  // only if empty
  }
  return st;
}

Status Trainer::export_adapter(const std::string& dir) {
  Impl& m = *impl_;
  if (!m.opt.lora.enabled()) return Status(StatusCode::kInvalidArgument, "this run trains no LoRA adapters");
  const bool writes = m.rank == 0;  // N ranks: every rank gathers, rank 0 writes
  std::vector<model::TensorDecl> decls;
  std::vector<ParamId> ids;
  const ModelSpec& spec = m.engine->model();
  for (ParamId p = 0; p < spec.params.size(); ++p) {
    if (!spec.params[p].trainable) continue;
    decls.push_back({peft_tensor_name(spec.params[p].name), model::StDType::kF32, spec.params[p].shape});
    ids.push_back(p);
  }
  // As export_model; adapter_config.json comes last.
  ExportWriter out;
  if (writes) out.open(dir, "adapter dir", "adapter_config.json", "adapter_model.safetensors", decls);
  std::vector<float> buf;
  for (ParamId p : ids) {
    buf.resize(spec.params[p].numel());
    STRATA_RETURN_IF_ERROR(m.engine->gather_param(p, buf.data(), DType::kF32));
    if (out.w) out.fail(out.w->write_from(DType::kF32, buf.data(), buf.size()));
  }
  if (out.w) out.fail(out.w->finish());
  if (out.w) {
    std::error_code ec;
    const std::string base = fs::absolute(m.opt.model_dir, ec).lexically_normal().string();
    out.fail(model::write_file_atomic(dir + "/adapter_config.json", peft_adapter_config_json(m.opt.lora, base)));
  }
  Status agreed = rank0_outcome(*m.engine, m.rank, m.world, std::move(out.st), "the adapter to " + dir);
  if (!agreed.ok()) m.export_failure_agreed = true;
  return agreed;
}

}  // namespace strata::train
