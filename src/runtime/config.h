// Strata's runtime configuration: a plain struct with defaults, read from JSON.
//
// The file format is a superset of DeepSpeed's config so users can bring
// theirs: DeepSpeed's offload keys (zero_optimization.offload_param /
// offload_optimizer, aio, ...) keep DeepSpeed's meaning and defaults, the
// training keys with a clear runtime meaning (fp16 loss scaling, bf16,
// gradient_clipping, gradient_accumulation_steps, Adam/AdamW) are mapped, a
// documented list of DeepSpeed keys that Strata does not act on is accepted
// and reported once, a few keys whose silent omission would change training
// are refused, and Strata's own settings live under "strata". docs/config.md
// ("Config file") has the full table; keep it in step with config.cpp.
//
// Checking is strict: an unknown key, a duplicate key, or an ill-typed or
// out-of-range value is kInvalidArgument with the key's full path, e.g.
//   zero_optimization.offload_optimizer.buffer_count: expected a positive
//   integer, got "four"
// Nothing here throws; nlohmann's exceptions are caught inside config.cpp.
// All functions are pure (no globals besides the once-per-process warning
// about ignored keys) and may be called from any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "cpu_optim/types.h"
#include "runtime/model_spec.h"

namespace strata {

// Where a kind of state has its home. kAuto: the planner decides.
enum class Tier : uint8_t { kAuto = 0, kDevice, kHost, kNvme };
const char* tier_name(Tier tier);  // "auto", "device", "host", "nvme"

// DeepSpeed's offload "device": "none" keeps the state on the accelerator.
// kAuto is Strata's: the offload_* object was absent (or says "device":
// "auto"), so the planner decides from the budgets.
enum class OffloadDevice : uint8_t { kAuto = 0, kNone, kCpu, kNvme };
const char* offload_device_name(OffloadDevice d);  // "auto", "none", "cpu", "nvme"

// zero_optimization.offload_param (DeepSpeed's DeepSpeedZeroOffloadParamConfig).
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kAuto;
  std::string nvme_path;             // added to the NVMe directories (capacity: free space)
  uint64_t buffer_count = 5;         // pinned parameter staging buffers
  uint64_t buffer_size = 100000000;  // elements per staging buffer
  uint64_t max_in_cpu = 1000000000;  // elements of compute copies kept in host RAM when device is nvme
  // Host-resident compute copies in page-locked memory (asynchronous uploads
  // on a GPU). Unset (absent or null, the default): pinned when the device
  // needs pinning and the pinned budget (strata.pinned_memory) holds them
  // next to the staging and optimizer buffers; if the pinned allocation is
  // refused (RLIMIT_MEMLOCK, the driver), pageable, said in the log. false:
  // pageable; true: pinned or an error.
  std::optional<bool> pin_memory = std::nullopt;
  bool operator==(const OffloadParamConfig&) const = default;
};

// zero_optimization.offload_optimizer (DeepSpeedZeroOffloadOptimizerConfig).
struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kAuto;
  std::string nvme_path;
  uint64_t buffer_count = 4;    // pinned buffers in the optimizer-step ring
  bool pin_memory = false;      // host-resident master/states in page-locked memory
  bool pipeline_read = false;   // read chunk k+1 while chunk k is updated
  bool pipeline_write = false;  // write chunk k-1 while chunk k is updated
  bool fast_init = false;       // accepted; Strata's NVMe state init is always streamed
  double ratio = 1.0;           // accepted; < 1 is reported (Strata keeps states off the GPU)
  bool operator==(const OffloadOptimizerConfig&) const = default;
};

struct ZeroConfig {
  // 0..3. One rank: the same for every stage. N ranks (engine.h "Sharding and
  // ranks"): 3 shards everything, 1-2 keep parameters whole on every rank,
  // 0 is refused; a config without "stage" (stage_given false) runs as 3.
  int stage = 0;
  bool stage_given = false;
  OffloadParamConfig offload_param;
  OffloadOptimizerConfig offload_optimizer;
  uint64_t sub_group_size = 1000000000;      // elements per optimizer-step chunk (DeepSpeed default)
  uint64_t prefetch_bucket_size = 50000000;  // stage3_prefetch_bucket_size: elements fetched ahead
  bool operator==(const ZeroConfig&) const = default;
};

// "aio" (DeepSpeed's swap_tensor/aio_config.py). block_size and queue_depth
// are 0 when the file does not set them: then STRATA_IO_BLOCK_BYTES /
// STRATA_IO_QUEUE_DEPTH decide, then the I/O engine's defaults (1 MiB, 32),
// which suit Strata's engine better than DeepSpeed's libaio defaults (1 MiB, 8).
struct AioConfig {
  uint64_t block_size = 0;            // bytes per I/O request (multiple of 4096, <= 64 MiB); 0: not set
  uint64_t queue_depth = 0;           // requests in flight per queue (1..4096); 0: not set
  uint64_t intra_op_parallelism = 1;  // "thread_count" is the older name
  bool single_submit = false;         // one request per submit call (false: batched)
  bool overlap_events = true;         // submit new requests while completions are reaped
  bool use_gds = false;               // GPUDirect Storage: accepted, reported, not used
  bool operator==(const AioConfig&) const = default;
};

struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;              // 0: dynamic scaling; > 0: a fixed scale
  int initial_scale_power = 16;         // dynamic: the first scale is 2^power
  int loss_scale_window = 1000;         // steps without overflow before the scale doubles
  int hysteresis = 2;                   // overflows tolerated before the scale halves
  bool consecutive_hysteresis = false;  // refill hysteresis after a step without overflow
  double min_loss_scale = 1.0;
  bool operator==(const Fp16Config&) const = default;
};

enum class OptimizerType : uint8_t { kAdam, kAdamW };

// "optimizer": {"type": "Adam"|"AdamW", "params": {...}}. DeepSpeed's "Adam"
// decouples weight decay unless params.adam_w_mode is false; "AdamW" always does.
struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool bias_correction = true;
  bool adam_w_mode = true;
  // True when weight decay is decoupled from the gradient (AdamW).
  bool decoupled_weight_decay() const { return type == OptimizerType::kAdamW || adam_w_mode; }
  bool operator==(const OptimizerConfig&) const = default;
};

struct NvmeDir {
  std::string path;
  uint64_t capacity = 0;  // bytes Strata may use there; 0: the free space when the run starts
  bool operator==(const NvmeDir&) const = default;
};

// One per-group tier override: the first rule whose glob `match` matches a
// group's name wins; kAuto leaves that kind to the planner.
struct GroupTierRule {
  std::string match;  // fnmatch(3) glob over group names, e.g. "layers.*"
  Tier compute = Tier::kAuto;
  Tier master = Tier::kAuto;
  Tier optimizer = Tier::kAuto;
  Tier grad = Tier::kAuto;
  bool operator==(const GroupTierRule&) const = default;
};

enum class IoBackendChoice : uint8_t { kAuto, kUring, kAio, kPosix };
const char* io_backend_name(IoBackendChoice b);  // "auto", "uring", "aio", "posix"

// The "strata" object: Strata's own settings. Byte sizes are integers or
// strings such as "24GiB"; 0 means "detect when the run starts".
struct StrataConfig {
  uint64_t device_memory = 0;                           // device budget (bytes); 0: free device memory at start
  uint64_t device_reserve = 2ull << 30;                 // kept free on the device for activations and workspace
  bool device_reserve_given = false;                    // the config sets device_reserve (strata finetune and plan
                                                        // reserve their buffers' size, or this when larger)
  uint64_t host_memory = 0;                             // host RAM budget for the host tier; 0: detect
  uint64_t pinned_memory = 0;                           // page-locked staging budget (part of host_memory); 0: detect
  std::vector<NvmeDir> nvme;                            // NVMe directories (offload_*.nvme_path are added)
  uint32_t prefetch_depth = 2;                          // groups fetched ahead of the one in use
  uint32_t held_groups = 1;                             // distinct groups the trainer may hold acquired at once
  bool debug_poison_released = false;                   // fill a released gathered group's buffer with NaN
  uint64_t prefetch_bytes = 0;                          // cap on bytes in flight for prefetch; 0: depth decides
  DType optimizer_state_dtype = DType::kF32;           // Adam m and v: fp32 or bf16
  // bf16 states: round to nearest even (the default) or stochastic (unbiased).
  cpu_optim::StateRounding optimizer_state_rounding = cpu_optim::StateRounding::kNearest;
  IoBackendChoice io_backend = IoBackendChoice::kAuto;  // kAuto: STRATA_IO_BACKEND, then best
  bool overlap_backward = false;                        // start a group's optimizer step during backward
  // step() returns once the norm and the decision are made; the groups'
  // updates run on the optimizer thread, each finished before its group is
  // next used (exact: the same bits as a synchronous step).
  bool pipelined_step = true;
  // The next forward's first NVMe-homed groups take the optimizer pass's
  // output (copied to upload staging as it is made) instead of reading it
  // back from NVMe. Exact either way; false only to measure what it saves.
  bool optimizer_handoff = true;
  // reduce_grad first copies each gradient piece into an engine-owned device
  // buffer and the caller's stream waits only for that device-to-device
  // copy; the device -> host download then runs behind it, so backward does
  // not wait for the offload and the caller may reuse its gradient buffer at
  // once. Costs 4 x the gradient piece (<= 16 MiB) x 4 bytes of device
  // memory. Unset: on for CUDA, off on the host backend (whose "device" may
  // be handed host memory); N ranks: off (the reduce-scatter reads the
  // caller's buffer).
  std::optional<bool> gradient_staging = std::nullopt;
  // With staging: an fp32 gradient of a bf16/fp16 parameter is rounded to the
  // parameter's compute dtype (round to nearest even) in the staging copy and
  // downloaded and accumulated from that: half the device -> host bytes, and
  // the gradient a bf16/fp16 torch model has (param.grad in its dtype, as
  // DeepSpeed reduces). false: downloaded as given. Unset: true when staging
  // is on. true without staging is refused.
  std::optional<bool> gradient_in_compute_dtype = std::nullopt;
  // step() averages the gradients over the step's micro-batches (divides by
  // their count, DeepSpeed's engine.backward convention); false: the caller
  // scaled its loss already (torch's `loss / accum`), gradients are summed.
  // N ranks: divided by the number of ranks either way (their mean).
  bool average_micro_batches = true;
  std::string trace;                                    // Chrome trace-event JSON output file; "" = off
  uint32_t world_size = 1;
  uint32_t rank = 0;
  uint64_t shard_alignment = 2048;         // elements; each shard is padded to a multiple
  uint64_t optimizer_chunk = 16ull << 20;  // elements per optimizer-step chunk (Strata default)
  bool swap_checksums = true;              // CRC32C of every block of NVMe-resident state, verified on read
  std::vector<GroupTierRule> groups;       // per-group tier overrides
  bool operator==(const StrataConfig&) const = default;
};

struct Config {
  ZeroConfig zero;
  AioConfig aio;
  Fp16Config fp16;
  bool bf16 = false;  // bf16.enabled
  OptimizerConfig optimizer;
  double gradient_clipping = 1.0;  // max global L2 norm; 0: off (1.0: DeepSpeed's default, as in 0.19)
  uint32_t gradient_accumulation_steps = 1;
  StrataConfig strata;

  // The compute dtype the precision keys ask for: bf16, fp16, else fp32.
  DType compute_dtype() const;
  // strata.nvme plus offload_param/offload_optimizer.nvme_path (capacity 0:
  // detect), without duplicates, in that order.
  std::vector<NvmeDir> nvme_dirs() const;
  bool operator==(const Config&) const = default;
};

// Keys found but not acted on (full paths, e.g. "train_batch_size",
// "zero_optimization.overlap_comm"), and notes about values Strata accepts
// but treats differently from DeepSpeed. Each list is in the order the
// parser checks keys (section by section), not necessarily file order.
struct ConfigNotes {
  std::vector<std::string> ignored_keys;
  std::vector<std::string> warnings;
  // DeepSpeed's batch sizes as the file gives them (0 / false: absent, null
  // or "auto"): the engine does not batch; a trainer derives and checks its
  // batch from them as DeepSpeed does (strata finetune and plan:
  // tools/finetune_flags.h resolve_deepspeed_batch; strata.torch).
  uint64_t train_batch_size = 0;
  uint64_t train_micro_batch_size_per_gpu = 0;
  bool gradient_accumulation_given = false;
  // The "scheduler" section's JSON ("" when absent or null): the engine
  // takes each step's lr from its caller; strata finetune follows it
  // (train::parse_deepspeed_scheduler), a C caller is warned that it is not
  // used.
  std::string scheduler_json;
  // Keys given as "auto" (paths, e.g. "optimizer.params.lr"): parsed as
  // absent; Hugging Face fills them from its arguments, and strata finetune
  // from its flags (--lr for optimizer.params.lr).
  std::vector<std::string> auto_keys;
};

// Parses a config from JSON text. `origin` names the text in messages (a file
// path, or "<string>"). Malformed JSON: kInvalidArgument
//   "<origin>: malformed JSON at byte 57 (line 4, column 12): <what>".
// Key errors: kInvalidArgument "<origin>: <path>: <what>". On success the
// ignored keys are logged once per process (one warning listing them) and
// returned in *notes when given.
Result<Config> parse_config(std::string_view json_text, std::string_view origin = "<string>",
                            ConfigNotes* notes = nullptr);

// Reads and parses a file. Missing file: kNotFound "config file <path> does
// not exist"; unreadable: the errno's status naming the path.
Result<Config> load_config_file(const std::string& path, ConfigNotes* notes = nullptr);

// The resolved config as JSON text (2-space indent), every key present with
// its value; parse_config(config_to_json(c)) == c.
std::string config_to_json(const Config& config);

}  // namespace strata
