// `strata finetune`'s flags and their parsing: every user string of the
// fine-tuning command line (sizes "24GiB", offload targets "nvme:/path",
// schedule, data format, dtype, device and progress names) becomes a typed
// value here, so train::TrainerOptions carries enums, numbers and paths and
// the trainer only checks them. Precedence: built-in defaults < --config
// FILE < flags given explicitly; --config and the --offload-* flags are
// alternatives. Pure functions of their arguments; main thread.
// Errors: kInvalidArgument naming the flag and the value, or a config file's
// error (load_config_file()).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"
#include "runtime/config.h"
#include "train/trainer.h"

namespace strata::tools {

// "nvme:DIR" | "cpu" | "none" | "auto" (an --offload-* flag) applied to an
// offload device and nvme_path. kInvalidArgument naming the text otherwise.
Status parse_offload_flag(std::string_view text, OffloadDevice* device, std::string* nvme_path);

// "auto" | "cuda" | "cpu" (--device of finetune and demo); kInvalidArgument
// 'device "<text>" is not one of auto, cuda, cpu' otherwise.
Result<train::TrainDevice> parse_train_device(std::string_view text);

// The flags as given (strings where the user writes text), and which of
// them were given (they override --config).
struct FinetuneFlags {
  std::string model, data, data_format = "auto", config, offload_params = "auto", offload_optimizer = "auto";
  std::string loss_mask;
  std::string documents;  // --documents: document starts (windows by document)
  bool truncate_documents = false;
  uint32_t vocab = 0;
  double val_fraction = 0.05;
  uint64_t seed = 1234;
  int64_t steps = 100;
  uint32_t batch = 4, seq = 256, grad_accum = 1;
  double lr = 1e-4, min_lr = 0, clip = 1.0, weight_decay = 0.0;
  bool weight_decay_all = false;
  int64_t warmup = 0;
  std::string schedule = "cosine";
  bool fp16 = false, bf16 = false;
  int64_t save_every = 0, eval_every = 0, log_every = 10;
  uint32_t keep = 2, eval_batches = 8;
  std::string out = "finetune-out", resume, trace, metrics, export_dtype, progress = "auto";
  bool no_export = false, overwrite = false;
  int64_t max_skipped_steps = 20;
  std::string device_mem, host_mem, device = "auto";
  int threads = 0;
  double comm_timeout = 300;
  // LoRA
  uint32_t lora_rank = 0;
  double lora_alpha = 8.0, lora_dropout = 0.0;
  std::string lora_targets, lora_adapter;
  bool lora_rslora = false, lora_merge = false;
  CLI::Option *o_lora_alpha = nullptr, *o_lora_dropout = nullptr, *o_lora_targets = nullptr, *o_lora_rank = nullptr,
              *o_lora_rslora = nullptr;
  CLI::Option *o_batch = nullptr, *o_grad_accum = nullptr, *o_clip = nullptr, *o_wd = nullptr, *o_lr = nullptr,
              *o_fp16 = nullptr, *o_bf16 = nullptr, *o_offp = nullptr, *o_offo = nullptr;
  CLI::Option *o_schedule = nullptr, *o_warmup = nullptr, *o_min_lr = nullptr;
  CLI::Option *o_eval_every = nullptr, *o_eval_batches = nullptr;
};

// DeepSpeed's batch sizes (its runtime/config.py: _set_batch_related_parameters,
// _batch_assertion) with the command's flags standing for the config's keys
// where given (--batch for train_micro_batch_size_per_gpu, --grad-accum for
// gradient_accumulation_steps): with a train_batch_size, two of the three fix
// the third with `world` ranks, one alone means no accumulation, and the
// three must agree (else kInvalidArgument naming them and the config file).
// Without one, the micro-batch is --batch, else the config's, else
// --batch's default. *accum holds the accumulation so far (flag or config)
// and is updated; strata finetune and strata plan both call it.
struct BatchFlags {
  std::string config;        // the --config path, for messages
  uint64_t batch = 0;        // --batch when given, else 0
  uint32_t default_batch = 4;
  bool accum_given = false;  // --grad-accum given (*accum holds it)
};
Status resolve_deepspeed_batch(const BatchFlags& given, const ConfigNotes& notes, uint64_t world, uint32_t* batch,
                               uint32_t* accum);

// Declares the flags on `cmd` (the `finetune` subcommand), bound to *f.
void add_finetune_flags(CLI::App* cmd, FinetuneFlags* f);

// The parsed flags (after CLI11 ran) as trainer options, --config merged in.
Status build_trainer_options(const FinetuneFlags& f, train::TrainerOptions* o);

}  // namespace strata::tools
