#include "finetune_flags.h"

#include <fmt/format.h>
#include <strings.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "common/dtype_parse.h"
#include "common/enum_names.h"
#include "common/units.h"
#include "comm/bootstrap.h"
#include "cpu_optim/dispatch.h"

namespace strata::tools {

Status parse_offload_flag(std::string_view text, OffloadDevice* device, std::string* nvme_path) {
  if (text == "cpu") {
    *device = OffloadDevice::kCpu;
  } else if (text == "none") {
    *device = OffloadDevice::kNone;
  } else if (text == "auto") {
    *device = OffloadDevice::kAuto;
  } else if (text.rfind("nvme:", 0) == 0 && text.size() > 5) {
    *device = OffloadDevice::kNvme;
    *nvme_path = std::string(text.substr(5));
  } else {
    return Status(StatusCode::kInvalidArgument, "offload target \"" + std::string(text) +
                                                    "\" is not one of nvme:DIR, cpu, none, auto");
  }
  return {};
}

Result<train::TrainDevice> parse_train_device(std::string_view text) {
  return parse_enum<train::TrainDevice>(text, "device");
}

void add_finetune_flags(CLI::App* cmd, FinetuneFlags* f) {
  cmd->add_option("--model", f->model, "Model directory (config.json + model.safetensors)")->required();
  cmd->add_option("--data", f->data, "Training data file")->required();
  cmd->add_option("--loss-mask", f->loss_mask,
                  "One byte per token (0/1): train only on tokens marked 1 (tools/prepare_data.py writes it)");
  cmd->add_option("--documents", f->documents,
                  "Where documents start (uint64 token offsets; tools/prepare_data.py writes PREFIX.docs): every "
                  "window lies in one document, padded, as Hugging Face's per-example batches (default: packed)");
  cmd->add_flag("--truncate-documents", f->truncate_documents,
                "With --documents: a document longer than --seq + 1 tokens trains its first window only (TRL's "
                "truncation at max_length = seq + 1; default: its tail continues in more windows)");
  cmd->add_option("--data-format", f->data_format,
                  "auto (*.u32: u32, *.u16: u16, else text) | text (bytes are tokens) | u16 | u32 (token ids)")
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
  f->o_batch = cmd->add_option("--batch", f->batch, "Sequences per micro-batch")->capture_default_str();
  cmd->add_option("--seq", f->seq, "Tokens per sequence")->capture_default_str();
  f->o_lr = cmd->add_option("--lr", f->lr, "Peak learning rate")->capture_default_str();
  f->o_min_lr = cmd->add_option("--min-lr", f->min_lr, "Learning rate at the end of a linear/cosine decay")
                   ->capture_default_str();
  f->o_warmup = cmd->add_option("--warmup", f->warmup, "Linear warm-up steps")->capture_default_str();
  f->o_schedule = cmd->add_option("--schedule", f->schedule,
                                  "constant | linear | cosine (after the warm-up); a --config's DeepSpeed \"scheduler\" "
                                  "section (WarmupLR, WarmupDecayLR, WarmupCosineLR) instead when it has one")
                      ->capture_default_str();
  f->o_grad_accum =
      cmd->add_option("--grad-accum", f->grad_accum, "Micro-batches per optimizer step")->capture_default_str();
  f->o_clip = cmd->add_option("--clip", f->clip, "Clip the global gradient norm to this (0: off)")
                  ->capture_default_str();
  f->o_wd = cmd->add_option("--weight-decay", f->weight_decay, "AdamW decoupled weight decay")->capture_default_str();
  cmd->add_flag("--weight-decay-all", f->weight_decay_all,
                "Weight decay on every parameter (default: Hugging Face's convention: none on biases and norm weights)");
  f->o_fp16 = cmd->add_flag("--fp16", f->fp16, "fp16 compute copies with dynamic loss scaling (default: fp32)");
  f->o_bf16 = cmd->add_flag("--bf16", f->bf16, "bf16 compute copies (default: fp32)");
  f->o_lora_rank = cmd->add_option("--lora-rank", f->lora_rank,
                                   "LoRA: freeze the model and train rank-R adapters (PEFT's LoRA; 0: full fine-tuning)");
  f->o_lora_alpha =
      cmd->add_option("--lora-alpha", f->lora_alpha, "LoRA alpha (scaling alpha / R)")->capture_default_str();
  f->o_lora_dropout = cmd->add_option("--lora-dropout", f->lora_dropout, "LoRA dropout on the adapters' input")
                          ->capture_default_str();
  f->o_lora_targets = cmd->add_option("--lora-targets", f->lora_targets,
                                      "Adapted modules: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj or "
                                      "all-linear (default: q_proj,v_proj, as PEFT)");
  f->o_lora_rslora = cmd->add_flag("--lora-rslora", f->lora_rslora, "rsLoRA scaling: alpha / sqrt(R)");
  cmd->add_option("--lora-adapter", f->lora_adapter,
                  "Start from this PEFT adapter directory (its adapter_config.json sets rank, alpha, dropout, targets)");
  cmd->add_flag("--lora-merge", f->lora_merge,
                "Also export the model with the adapters merged into OUT/model (the adapter goes to OUT/adapter)");
  cmd->add_option("--save-every", f->save_every, "Save OUT/checkpoint-<step> every N steps (0: never)")
      ->capture_default_str();
  cmd->add_option("--keep", f->keep, "Checkpoints kept (the newest; 0: all)")->capture_default_str();
  f->o_eval_every =
      cmd->add_option("--eval-every", f->eval_every, "Validation loss every N steps (0: before and after only)")
          ->capture_default_str();
  f->o_eval_batches =
      cmd->add_option("--eval-batches", f->eval_batches, "Validation batches per evaluation")->capture_default_str();
  cmd->add_option("--out", f->out, "Output directory: metrics, checkpoints, the model")->capture_default_str();
  cmd->add_option("--resume", f->resume,
                  "Continue a run: its out dir (its newest checkpoint) or one checkpoint-<step> dir; auto: --out's "
                  "newest checkpoint if it holds one, else a new run (for a job a launcher restarts: torchrun "
                  "--max-restarts; with --overwrite, what an attempt left before its first checkpoint is replaced)");
  cmd->add_flag("--overwrite", f->overwrite,
                "Start a new run in an out dir that holds an earlier run (removes its checkpoints, metrics, model)");
  cmd->add_option("--max-skipped-steps", f->max_skipped_steps,
                  "Stop with an error after this many steps in a row skipped for non-finite gradients (0: never)")
      ->capture_default_str();
  cmd->add_option("--trace", f->trace, "Write a Chrome/Perfetto trace of the engine and the compute");
  cmd->add_option("--metrics", f->metrics, "JSON-lines metrics file (default OUT/metrics.jsonl)");
  cmd->add_flag("--no-export", f->no_export,
                "Do not write OUT/model at the end (a LoRA run still writes its adapter, OUT/adapter)");
  cmd->add_option("--export-dtype", f->export_dtype, "fp32 | bf16 | fp16 for OUT/model (default: the model's)");
  cmd->add_option("--device-mem", f->device_mem, "Device memory budget (e.g. 20GiB; default: detect)");
  cmd->add_option("--host-mem", f->host_mem, "Host memory budget (e.g. 64GiB; default: detect)");
  cmd->add_option("--progress", f->progress, "auto | bar | lines | quiet")->capture_default_str();
  cmd->add_option("--log-every", f->log_every, "A progress line every N steps (lines mode)")->capture_default_str();
  cmd->add_option("--threads", f->threads, "CPU compute threads (0: all)")->capture_default_str();
  cmd->add_option("--comm-timeout", f->comm_timeout,
                  "With N ranks (mpirun, torchrun): seconds after which a collective another rank never joins fails the run")
      ->capture_default_str();
  cmd->add_option("--device", f->device,
                  "Where the model math runs: auto (the GPU when CUDA model ops can run there, else the CPU) | "
                  "cuda (the GPU or exit 1 with the reason) | cpu")
      ->capture_default_str();
}

namespace {

// The engine's config: the built-in defaults, then --config FILE, then the
// flags given explicitly.
Result<Config> config_from_flags(const FinetuneFlags& f, ConfigNotes* notes) {
  Config c;
  if (!f.config.empty()) {
    if (f.o_offp->count() || f.o_offo->count())
      return Status(StatusCode::kInvalidArgument,
                    "--config and --offload-params/--offload-optimizer are alternatives: put the offload targets "
                    "in the config file (zero_optimization.offload_param / offload_optimizer) or drop --config");
    auto r = load_config_file(f.config, notes);
    if (!r.ok()) return r.status();
    c = r.value();
  }
  if (f.config.empty() || f.o_offp->count())
    STRATA_RETURN_IF_ERROR(
        parse_offload_flag(f.offload_params, &c.zero.offload_param.device, &c.zero.offload_param.nvme_path)
            .with_context("--offload-params"));
  if (f.config.empty() || f.o_offo->count())
    STRATA_RETURN_IF_ERROR(parse_offload_flag(f.offload_optimizer, &c.zero.offload_optimizer.device,
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
  return c;
}

}  // namespace

Status resolve_deepspeed_batch(const BatchFlags& g, const ConfigNotes& n, uint64_t world, uint32_t* batch,
                               uint32_t* accum) {
  const bool mb_flag = g.batch > 0;
  uint64_t mb = mb_flag ? g.batch : n.train_micro_batch_size_per_gpu;
  uint64_t gas = g.accum_given || n.gradient_accumulation_given ? *accum : 0;
  const uint64_t tb = n.train_batch_size;
  if (tb == 0) {
    if (mb > UINT32_MAX)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("{}: train_micro_batch_size_per_gpu {} is too large", g.config, mb));
    *batch = static_cast<uint32_t>(mb ? mb : g.default_batch);
    return Status::ok_status();
  }
  if (mb && !gas)
    gas = tb / mb / world;
  else if (!mb && gas)
    mb = tb / world / gas;
  else if (!mb && !gas)
    gas = 1, mb = tb / world;
  const char* mb_name = mb_flag ? "--batch" : "train_micro_batch_size_per_gpu";
  const char* gas_name = g.accum_given ? "--grad-accum" : "gradient_accumulation_steps";
  if (mb == 0 || gas == 0 || tb != mb * gas * world)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: train_batch_size {} is not {} {} x {} {} x {} rank(s), as DeepSpeed requires "
                              "(--batch and --grad-accum stand for the config's micro-batch and accumulation "
                              "when given)",
                              g.config, tb, mb_name, mb, gas_name, gas, world));
  if (mb > UINT32_MAX || gas > (1u << 20))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}: train_batch_size {} gives a micro-batch of {} x {} accumulation steps: too large",
                              g.config, tb, mb, gas));
  *batch = static_cast<uint32_t>(mb);
  *accum = static_cast<uint32_t>(gas);
  return Status::ok_status();
}

// --data-format: "auto" reads the file's suffix (prepare_data writes .u32);
// a format that contradicts a .u16/.u32 suffix is refused (a u32 file read
// as text or u16 trained on garbage, with a normal-looking loss).
static Status data_format_of(const FinetuneFlags& f, train::DataFormat* out) {
  auto ends_with = [&](std::string_view suffix) {  // in any case, as prepare_data's suffixes
    return f.data.size() >= suffix.size() &&
           strcasecmp(f.data.c_str() + f.data.size() - suffix.size(), std::string(suffix).c_str()) == 0;
  };
  const char* named = ends_with(".u32") ? "u32" : ends_with(".u16") ? "u16" : nullptr;
  if (f.data_format == "auto") {
    STRATA_ASSIGN_OR_RETURN(*out, train::parse_data_format(named ? named : "text"));
    return Status::ok_status();
  }
  auto fmt_given = train::parse_data_format(f.data_format);
  if (!fmt_given.ok()) return fmt_given.status().with_context("--data-format");
  *out = *fmt_given;
  if (named && f.data_format != named)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("--data-format {}, but {}'s name says {} token ids: drop --data-format (auto reads "
                              "the suffix) or rename the file",
                              f.data_format, f.data, named));
  return Status::ok_status();
}

Status build_trainer_options(const FinetuneFlags& f, train::TrainerOptions* o) {
  o->model_dir = f.model;
  if (!f.config.empty()) o->other_inputs.push_back({"--config", f.config});
  o->data.path = f.data;
  o->data.loss_mask_path = f.loss_mask;
  o->data.documents_path = f.documents;
  o->data.truncate_documents = f.truncate_documents;
  STRATA_RETURN_IF_ERROR(data_format_of(f, &o->data.format));
  o->data.vocab = f.vocab;
  o->data.val_fraction = f.val_fraction;
  o->data.seed = f.seed;
  o->data.seq = f.seq;

  ConfigNotes notes;
  STRATA_ASSIGN_OR_RETURN(o->config, config_from_flags(f, &notes));
  if (f.o_batch->count() && f.batch < 1) return Status(StatusCode::kInvalidArgument, "--batch must be at least 1");
  {
    STRATA_ASSIGN_OR_RETURN(comm::LaunchInfo launch, comm::detect_launch());
    BatchFlags given{f.config, f.o_batch->count() ? f.batch : 0, f.batch, f.o_grad_accum->count() > 0};
    STRATA_RETURN_IF_ERROR(resolve_deepspeed_batch(given, notes, static_cast<uint64_t>(launch.world_size), &o->batch,
                                                   &o->config.gradient_accumulation_steps));
  }

  // --lr wins; else the config file's optimizer.params.lr (absent:
  // DeepSpeed's 1e-3); else --lr's default. "auto" there is filled from --lr
  // (given or its default), as Hugging Face fills it from its arguments.
  const bool lr_auto = std::find(notes.auto_keys.begin(), notes.auto_keys.end(), "optimizer.params.lr") !=
                       notes.auto_keys.end();
  o->schedule.lr = !f.config.empty() && !f.o_lr->count() && !lr_auto ? o->config.optimizer.lr : f.lr;
  if (lr_auto) o->config.optimizer.lr = f.lr;
  if (!notes.scheduler_json.empty()) {
    // The config's DeepSpeed "scheduler" section sets the schedule; the
    // flags that would set another are refused rather than one ignored.
    for (const CLI::Option* given : {f.o_schedule, f.o_warmup, f.o_min_lr})
      if (given->count())
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("{} and the \"scheduler\" section of {} both set the learning-rate schedule; "
                                  "keep one",
                                  given->get_name(), f.config));
    auto ds = train::parse_deepspeed_scheduler(notes.scheduler_json, o->schedule.lr);
    if (!ds.ok()) return ds.status().with_context(f.config);
    if (f.o_lr->count() && !ds->ds.peak_is_optimizer_lr)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("--lr and the \"scheduler\" section of {} both set the peak learning rate ({} "
                                "takes it from warmup_max_lr{}); keep one",
                                f.config, train::schedule_kind_name(ds->kind),
                                ds->kind == train::ScheduleKind::kWarmupDecayLR ? ", default 0.001" : ""));
    o->schedule = *ds;
  } else {
    auto kind = train::parse_schedule_kind(f.schedule);
    if (!kind.ok()) return kind.status().with_context("--schedule");
    o->schedule.kind = *kind;
    if (o->schedule.kind == train::ScheduleKind::kConstant && f.o_min_lr->count())
      return Status(StatusCode::kInvalidArgument,
                    "--min-lr is the end of a linear or cosine decay; --schedule constant keeps --lr (after "
                    "--warmup): drop --min-lr or choose --schedule linear/cosine");
    o->schedule.min_lr = f.min_lr;
    o->schedule.warmup = f.warmup;
  }
  o->schedule.total = std::max<int64_t>(1, f.steps);
  if (f.steps < 0) return Status(StatusCode::kInvalidArgument, "--steps must be >= 0");
  // Named by where the peak came from: --lr, or the config's optimizer.params.lr.
  const std::string lr_from =
      !f.config.empty() && !f.o_lr->count() && !lr_auto ? f.config + ": optimizer.params.lr" : std::string("--lr");
  if (f.steps > 0)
    STRATA_RETURN_IF_ERROR(train::validate_schedule(o->schedule).with_context(lr_from + "/--min-lr/--warmup"));
  o->steps = f.steps;
  o->weight_decay_all = f.weight_decay_all;
  if (!f.lora_adapter.empty()) {
    for (CLI::Option* opt : {f.o_lora_rank, f.o_lora_alpha, f.o_lora_dropout, f.o_lora_targets, f.o_lora_rslora})
      if (opt->count())
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("{} and --lora-adapter: the adapter's adapter_config.json sets the LoRA settings; "
                                  "drop {}",
                                  opt->get_name(), opt->get_name()));
    o->lora.adapter_dir = f.lora_adapter;
  } else if (f.lora_rank > 0) {
    o->lora.rank = f.lora_rank;
    o->lora.alpha = f.lora_alpha;
    o->lora.dropout = f.lora_dropout;
    o->lora.rslora = f.lora_rslora;
    if (!f.lora_targets.empty()) {
      auto t = train::parse_lora_targets(f.lora_targets);
      if (!t.ok()) return t.status().with_context("--lora-targets");
      o->lora.targets = *t;
    }
    if (!(f.lora_dropout >= 0 && f.lora_dropout < 1))
      return Status(StatusCode::kInvalidArgument, fmt::format("--lora-dropout {} is outside [0, 1)", f.lora_dropout));
  } else {
    for (CLI::Option* opt : {f.o_lora_alpha, f.o_lora_dropout, f.o_lora_targets, f.o_lora_rslora})
      if (opt->count())
        return Status(StatusCode::kInvalidArgument,
                      fmt::format("{} needs LoRA: give --lora-rank R (or --lora-adapter DIR)", opt->get_name()));
  }
  o->lora.merge = f.lora_merge;
  if (f.lora_merge && f.no_export)
    return Status(StatusCode::kInvalidArgument,
                  "--lora-merge writes the merged model to OUT/model, which --no-export leaves out: drop one "
                  "(the adapter, OUT/adapter, is written either way)");
  if (f.seq < 1) return Status(StatusCode::kInvalidArgument, "--seq must be at least 1");
  // Counts a user may mistype: refused by name before any expensive work.
  auto in_range = [](const char* flag, int64_t v, int64_t lo, int64_t hi) -> Status {
    if (v < lo || v > hi)
      return Status(StatusCode::kInvalidArgument, fmt::format("{} {} is outside [{}, {}]", flag, v, lo, hi));
    return {};
  };
  STRATA_RETURN_IF_ERROR(in_range("--save-every", f.save_every, 0, INT64_MAX));
  STRATA_RETURN_IF_ERROR(in_range("--eval-every", f.eval_every, 0, INT64_MAX));
  for (const CLI::Option* given : {f.o_eval_every, f.o_eval_batches})
    if (given->count() && f.val_fraction == 0 && (given != f.o_eval_every || f.eval_every > 0))
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("{} with --val-fraction 0: there is no validation part to evaluate on; drop {} or "
                                "hold out a part (--val-fraction, default 0.05)",
                                given->get_name(), given->get_name()));
  STRATA_RETURN_IF_ERROR(in_range("--log-every", f.log_every, 1, INT64_MAX));
  STRATA_RETURN_IF_ERROR(in_range("--grad-accum", f.grad_accum, 1, 1 << 16));
  STRATA_RETURN_IF_ERROR(in_range("--eval-batches", f.eval_batches, 1, 1 << 20));
  STRATA_RETURN_IF_ERROR(in_range("--threads", f.threads, 0, 1 << 16));
  STRATA_RETURN_IF_ERROR(in_range("--max-skipped-steps", f.max_skipped_steps, 0, INT64_MAX));
  auto finite_nonneg = [](const char* flag, double v) -> Status {
    if (!std::isfinite(v) || v < 0)
      return Status(StatusCode::kInvalidArgument, fmt::format("{} {} must be finite and >= 0", flag, v));
    return {};
  };
  STRATA_RETURN_IF_ERROR(finite_nonneg("--weight-decay", o->config.optimizer.weight_decay));
  STRATA_RETURN_IF_ERROR(finite_nonneg("--clip", o->config.gradient_clipping));
  // (As the C ABI's comm_timeout_s: a deadline further off would overflow
  // the clock's nanoseconds; 1e7 s is 115 days.)
  if (!(std::isfinite(f.comm_timeout) && f.comm_timeout > 0 && f.comm_timeout <= 1e7))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("--comm-timeout {:g} must be > 0 and at most 1e7 seconds (115 days)", f.comm_timeout));
  if (!(f.val_fraction >= 0 && f.val_fraction <= 0.9))
    return Status(StatusCode::kInvalidArgument, fmt::format("--val-fraction {} is outside [0, 0.9]", f.val_fraction));
  // STRATA_CPU_ISA naming an ISA this CPU lacks fails here, not at step 1.
  STRATA_RETURN_IF_ERROR(cpu_optim::resolve_isa(cpu_optim::Isa::kAuto).status().with_context("STRATA_CPU_ISA"));
  o->overwrite = f.overwrite;
  o->max_skipped_steps = f.max_skipped_steps;
  o->eval_every = f.eval_every;
  o->eval_batches = f.eval_batches;
  o->save_every = f.save_every;
  o->keep = f.keep;
  o->out_dir = f.out;
  o->resume_dir = f.resume;
  o->metrics_path = f.metrics;
  o->export_model = !f.no_export;
  if (!f.export_dtype.empty()) {
    auto d = parse_dtype(f.export_dtype);
    if (!d.ok()) return d.status().with_context("--export-dtype");
    o->export_dtype = *d;
  }
  o->log_every = f.log_every;
  o->threads = f.threads;
  o->comm_timeout_s = f.comm_timeout;
  STRATA_ASSIGN_OR_RETURN(o->device, parse_train_device(f.device));
  STRATA_ASSIGN_OR_RETURN(o->progress, parse_enum<train::ProgressMode>(f.progress, "--progress"));
  return {};
}

}  // namespace strata::tools
