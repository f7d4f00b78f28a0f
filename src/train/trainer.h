// The trainer: fine-tunes a Hugging Face Llama model whose parameters,
// gradients and optimizer states live in the offload engine (runtime/engine.h),
// computing with ModelOps (train/model_ops.h) layer by layer.
//
//   TrainerOptions o;  o.model_dir = "m"; o.data.path = "d.txt"; o.out_dir = "out"; ...
//   STRATA_ASSIGN_OR_RETURN(auto t, Trainer::create(o));   // engine, weights or checkpoint
//   STRATA_ASSIGN_OR_RETURN(TrainResult r, t->run());      // eval, steps, checkpoints, eval, export
//
// One optimizer step = config.gradient_accumulation_steps micro-batches of
// `batch` sequences of `data.seq` tokens. Per micro-batch:
//   begin_micro_batch(last);
//   forward:  acquire embed, embed_forward, release; for each layer: acquire,
//             layer_forward (its input kept: activation checkpointing), release;
//   head:     [tied: acquire embed] acquire head, head_forward_backward
//             (loss and dx), reduce_grad(norm[, lm_head]), release;
//   backward: for each layer in reverse: acquire, layer_backward (recomputes
//             the forward from the kept input), reduce_grad of its 9 params,
//             release;
//   embed:    embed_backward (tied: added to the head's lm_head gradient, see
//             below), reduce_grad(embed_tokens).
// then engine.step(schedule_lr(step)).
//
// Tied embeddings. lm_head is embed_tokens: the head is computed with the
// embedding's pointer (the embed group is acquired next to the head group),
// its gradient goes into a dedicated fp32 [vocab, dim] buffer G that stays
// alive through the layers' backward, embed_backward(accumulate = true) adds
// the embedding's contribution into G, and G is reduced once: the engine
// receives d loss / d embed_tokens = head part + lookup part, exactly the
// gradient of the one shared tensor.
//
// Devices (TrainerOptions::device). The trainer owns the engine's device
// backend and picks it with the ops:
//   auto: the CUDA backend + CudaOps (train/cuda_ops.h) when
//         create_device_backend(kCuda) gives a backend AND create_cuda_ops()
//         succeeds on it (module libstrata_cuda_train.so, cuBLAS, workspace);
//         otherwise the host backend + CpuOps. Logged once, with the reason.
//   cuda: the same, but unavailability is an error (kUnavailable, the reason).
//   cpu:  the host backend + CpuOps.
// Every activation buffer (each layer's kept input, the two dx buffers), the
// gradient buffers (the largest group's, the tied embedding's), the tokens
// and the targets come from engine().device().alloc(): device memory on
// CUDA, RAM on the host backend. Tokens and targets are written into one
// pinned staging buffer and uploaded with copy_async on the trainer's stream
// (the staging buffer is rewritten only after an event says the last upload
// read it). The engine's device reserve counts these buffers (and the CUDA
// ops' workspace). The device budget is strata.device_memory when set;
// otherwise on CUDA the backend's detected budget (free GPU memory less a
// margin, DeviceBackendOptions::budget_bytes = 0), and on the host backend
// max(1 GiB, gradient reserve + the engine's group buffers) + the
// activation buffers.
// Synchronization follows ModelOps::synchronous(): synchronous ops (CPU)
// read memory directly, so the trainer synchronizes its stream after each
// acquire and before the embedding backward overwrites a gradient buffer a
// download may still read; stream-ordered ops (CUDA) get no per-layer
// synchronization at all: acquire/release/reduce_grad order everything on
// the stream. The losses (LossStats) are read only after the stream is
// synchronized at the end of a step's micro-batches (and of an evaluation's
// batches): CudaOps fills them from a host function. Bad token ids on CUDA
// surface as that synchronize's error.
//
// Data position. Step k (0-based, counting every step taken, skipped fp16
// overflow steps included) draws samples k*S .. k*S + S - 1 with
// S = batch * accumulation (data.h): the step count alone says where the data
// is, so a resumed run continues identically.
//
// Checkpoints: every `save_every` steps, engine.save_checkpoint(
// out_dir/checkpoint-<step>) with the trainer's state as the extra JSON
// ({"trainer": {step, tokens, seed, batch, seq, grad_accum, data, schedule,
// last_loss, ...}}); older checkpoint-* beyond `keep` are removed after a
// successful save. resume_dir: engine.load_checkpoint, then the step count
// from the extra JSON; a resumed run must use the same batch, seq,
// accumulation and seed (kInvalidArgument naming the difference otherwise).
//
// Stopping: `stop` (set by a signal handler) is checked after every step:
// the trainer saves out_dir/checkpoint-<step> and returns with
// TrainResult::interrupted set (no final evaluation, no export).
//
// Metrics: JSON lines appended to metrics_path (one object per line; a line
// that cannot be written, a full disk, stops the run with that error; once
// steps are trained, after saving them in a checkpoint, as a stop request
// does, that the error names: N ranks save together):
//   {"event":"plan","micro_batches":..,"uploads_per_micro_batch":..,
//    "forward_backward":{..},"optimizer_step":{..},"per_step":{..}} first
//    (the bytes the placement moves; a resumed run keeps the original's)
//   {"event":"train","step":k,"loss":..,"lr":..,"grad_norm":..,"clip_coef":..,
//    "loss_scale":..,"skipped":..,"tokens":..,"step_s":..,"tokens_per_s":..,
//    "device_bytes":..,"host_bytes":..,"nvme_bytes":..,"nvme_read_bytes":..,
//    "nvme_write_bytes":..,"comm_bytes":..,"gathers_ahead":..,"gathers_reused":..,"io_gbps":..}
//    (*_bytes, gathers_ahead: stage 3's acquires whose all-gather ran ahead, and
//    gathers_reused: those that found their group still gathered: this rank's, since the start)
//   {"event":"eval","step":k,"val_loss":..,"batches":..,"tokens":..}
//   {"event":"checkpoint","step":k,"dir":..,"seconds":..}
// ("step" is the number of optimizer steps done when the line is written.)
//
// Ranks (data parallel, ZeRO stage 3; runtime/engine.h "Sharding and
// ranks"). Launched by `mpirun -np N` or torchrun-style (torchrun
// --no-python, or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and
// MASTER_PORT), each process is one rank (the launcher's environment,
// comm/bootstrap.h) and the trainer joins them on the host backend (CPU ops)
// over the MPI communicator (mpirun) or the TCP one (torchrun style,
// comm/tcp_comm.h). With --device cuda the ranks are GPU ranks, one GPU each
// (LOCAL_RANK), joined over NCCL (rank 0's id over MPI under mpirun, over the
// TCP rendezvous when launched torchrun-style; never run on GPUs yet).
// Rank r's micro-batch m of step k is positions r*b .. r*b+b-1 of the global
// micro-batch of N*b sequences, i.e. samples k*S + m*N*b + r*b ... with
// S = N*b*accumulation: N ranks with batch b see at each step exactly the
// samples a 1-rank run with batch N*b sees, and the engine's step equals a
// 1-rank step of those N*b sequences taken as N micro-batches of b (bit for
// bit with accumulation 1, see the engine). The reported loss is the mean
// over every rank's tokens. Rank 0 owns OUT (its lock, run.json, metrics,
// progress, the export's files, removing old checkpoints); every rank saves
// its shard of each checkpoint into OUT/checkpoint-<step> (committed once
// every rank finished) and resumes from rank 0's choice (a checkpoint
// resumes on another number of ranks with the same global batch, batch x
// ranks: the engine reshards it and the data continues where it was). Validation batches
// are split as training ones: global batch j is N*b windows, rank r evaluates its b,
// and the loss of each global batch is summed over the ranks (N ranks of batch b
// report what one rank of batch N*b reports). A stop request (signal) is
// agreed on: the ranks stop after the same step. The settings must be the
// same on every rank (refused otherwise, naming the rank). A rank that dies
// or stops answering makes the others fail with kUnavailable after
// comm_timeout_s (mpirun ends the job when a rank exits with an error).
//
// Thread-safety: one thread drives a Trainer. Blocking throughout.
// Errors: Status values naming what, where and why (the model directory,
// data file, out dir, NVMe directory, config key); kUnavailable when
// device kCuda cannot run (the loader's reason); nothing aborts.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "common/enum_names.h"
#include "common/status.h"
#include "runtime/config.h"
#include "runtime/engine.h"
#include "train/data.h"
#include "train/lora.h"
#include "train/model_ops.h"
#include "train/schedule.h"

namespace strata::model {
struct LlamaConfig;
}

namespace strata::train {

enum class ProgressMode : uint8_t {
  kAuto,   // a bar when stdout is a terminal, lines otherwise
  kBar,    // one line rewritten in place
  kLines,  // a line every log_every steps
  kQuiet,  // nothing on stdout
};

// Where the model ops run: kAuto the GPU when one is usable, else the CPU;
// kCuda the GPU or an error; kCpu the CPU (host backend).
enum class TrainDevice : uint8_t { kAuto, kCuda, kCpu };

}  // namespace strata::train

// Their names ("auto", "bar", ...; "auto", "cuda", "cpu"): enum_name() gives
// them, the tools parse flags with parse_enum() (common/enum_names.h).
namespace strata {
template <>
inline constexpr auto kEnumNames<train::ProgressMode> = std::to_array<EnumName<train::ProgressMode>>(
    {{train::ProgressMode::kAuto, "auto"},
     {train::ProgressMode::kBar, "bar"},
     {train::ProgressMode::kLines, "lines"},
     {train::ProgressMode::kQuiet, "quiet"}});
template <>
inline constexpr auto kEnumNames<train::TrainDevice> = std::to_array<EnumName<train::TrainDevice>>(
    {{train::TrainDevice::kAuto, "auto"}, {train::TrainDevice::kCuda, "cuda"}, {train::TrainDevice::kCpu, "cpu"}});
}  // namespace strata

namespace strata::train {

inline const char* train_device_name(TrainDevice device) { return enum_name(device); }

// Typed values only: the tools parse the command line (tools/finetune_flags.h)
// and the trainer checks what they parsed (create()'s errors).
struct TrainerOptions {
  std::string model_dir;  // config.json + model.safetensors (or sharded)
  // Data file and split. data.vocab 0: the model's vocab_size (text: at most 256).
  DataOptions data;
  // The engine's config, resolved (the tool merges --config and flags). Its
  // precision keys choose the compute dtype; optimizer.lr is ignored (the
  // schedule gives every step's lr).
  Config config;
  Schedule schedule;  // total: set from `steps`
  int64_t steps = 100;  // optimizer steps for the whole run (a resumed run counts the earlier ones)
  // Weight decay (config.optimizer.weight_decay) on every parameter; false:
  // Hugging Face Trainer's convention, none on biases and norm weights
  // (hf_no_decay in runtime/model_spec.h).
  bool weight_decay_all = false;
  // LoRA (train/lora.h): rank > 0 or an adapter dir freezes the base model
  // and trains adapters; the export is then a PEFT adapter (OUT/adapter),
  // plus the merged model with lora.merge.
  LoraOptions lora;
  uint32_t batch = 4;   // sequences per micro-batch
  int64_t eval_every = 0;     // 0: only before training and at the end
  uint32_t eval_batches = 8;  // validation batches per evaluation (capped at the distinct ones)
  int64_t save_every = 0;     // 0: no periodic checkpoints
  uint32_t keep = 2;          // periodic checkpoints kept (the newest); 0: keep all
  std::string out_dir;        // created if missing
  // A checkpoint-<step> dir, or a run's out dir (its newest checkpoint is
  // taken); or kResumeAuto: out_dir's newest checkpoint of its run where it
  // holds one, else a new run (as with "" and `overwrite`), so that one
  // command line serves a job a launcher restarts (torchrun --max-restarts).
  std::string resume_dir;
  bool overwrite = false;     // a fresh run into an out dir holding an earlier run removes that run's files
  // Other files the caller read for this run ({what names it, path}: the
  // --config file): overwrite never removes them (nor model_dir, the data).
  std::vector<std::pair<std::string, std::string>> other_inputs;
  // Consecutive steps skipped for non-finite gradients after which the run
  // stops with an error (a NaN model never "succeeds"); 0: never.
  int64_t max_skipped_steps = 20;
  std::string metrics_path;   // "": out_dir/metrics.jsonl
  bool export_model = true;   // write out_dir/model (config.json + safetensors) at the end
  std::optional<DType> export_dtype;  // unset: the model's torch_dtype
  ProgressMode progress = ProgressMode::kAuto;
  int64_t log_every = 10;     // kLines: a line every N steps (and the first and last)
  int threads = 0;            // CPU ops threads; 0: TBB's default
  const std::atomic<bool>* stop = nullptr;  // set asynchronously: finish the step, save, return
  // Where the model ops run (see "Devices" above).
  TrainDevice device = TrainDevice::kAuto;
  // Tests: the planner's budgets (0 fields: detect / the trainer's choice).
  PlanBudgets budgets_override;
  // N ranks: a collective not done this many seconds after it started fails
  // (a dead or hung rank). > 0.
  double comm_timeout_s = 300;
};

// The dimensions the model ops compute a config's model with (sizes, RoPE
// frequencies of its type, tied embeddings, the architecture's features; no
// LoRA). Call LlamaDims::validate() on the result.
LlamaDims llama_dims(const model::LlamaConfig& config);

// TrainerOptions::resume_dir: continue out_dir's run if it has a checkpoint.
inline constexpr const char* kResumeAuto = "auto";

struct TrainResult {
  int64_t steps_done = 0;        // optimizer steps done in total (including before a resume)
  int64_t steps_this_run = 0;
  double initial_val_loss = -1;  // -1: no validation part
  double final_val_loss = -1;
  std::vector<double> train_losses;  // one per step of this run
  double tokens_per_s = 0;           // training tokens / training wall time (evaluation excluded)
  double train_seconds = 0;
  double mean_step_seconds = 0;      // over the steps after the first (warm)
  bool interrupted = false;
  std::string last_checkpoint;  // "" when none was written
  std::string exported_model;   // "" when not exported (LoRA: only with LoraOptions::merge)
  // The exported model's dtype, and whether it rounds the weights the
  // validation loss was computed with (an fp32 run exported to bf16/fp16).
  DType exported_dtype = DType::kF32, trained_dtype = DType::kF32;  // the latter: the compute copies'
  bool export_rounds = false;
  bool export_merged = false;  // LoRA adapters merged into the exported model
  std::string exported_adapter; // LoRA: the PEFT adapter directory written at the end
};

struct StepReport {
  int64_t step = 0;  // steps done after this one
  double loss = 0;   // mean over the step's micro-batches' tokens
  double lr = 0;
  StepResult engine;
  double seconds = 0;
};

class Trainer {
 public:
  // Opens the model dir and data, builds the engine (plans tiers, creates swap
  // files), loads the weights (or the checkpoint given by resume_dir), opens
  // the metrics file. Errors name the part: "model <dir>: ...",
  // "data <file>: ...", "out dir <dir>: ...", "NVMe directory <dir>: ...".
  static Result<std::unique_ptr<Trainer>> create(const TrainerOptions& options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // The whole job: evaluation, steps until options.steps (checkpoints, stop
  // requests), evaluation, export.
  Result<TrainResult> run();

  // The parts, for tests and tools.
  Result<StepReport> train_step();
  // Validation loss over the fixed batches: the mean of each batch's mean
  // over its counted targets (Hugging Face Trainer's eval_loss; batches with
  // no target left out); kInvalidArgument without a validation part.
  Result<double> evaluate();
  Status save_checkpoint(const std::string& dir);
  // Writes dir/config.json + dir/model.safetensors (HF layout) from the fp32
  // masters, in `dtype`. LoRA: the frozen base with the adapters merged
  // (W + scaling * B A, computed in fp32).
  Status export_model(const std::string& dir, DType dtype);
  // LoRA: writes dir/adapter_config.json + dir/adapter_model.safetensors
  // (fp32) as PEFT saves them; PeftModel.from_pretrained loads them.
  // kInvalidArgument when the run trains no adapters.
  Status export_adapter(const std::string& dir);

  int64_t step() const;
  Engine& engine();
  const TokenDataset& data() const;
  const model::LlamaConfig& model_config() const;
  const char* ops_name() const;  // "cpu" | "cuda"
  // The device in words and why it was chosen, e.g. "cuda:0 (NVIDIA H200,
  // ...)" or "cpu (host backend): no CUDA device backend: <reason>".
  const std::string& device_description() const;
  // This process's rank and the number of ranks (1 without mpirun).
  uint32_t rank() const;
  uint32_t world_size() const;

 private:
  struct Impl;
  class Run;  // run()'s state and parts (trainer.cpp)
  explicit Trainer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::train
