// Trainer internals shared by trainer.cpp (set-up, weights, checkpoints,
// the forward/backward of a step) and trainer_run.cpp (the run loop: steps,
// evaluations, checkpoints, export, progress). Not a public header.
#pragma once

#include "train/trainer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <type_traits>

#include "comm/bootstrap.h"
#include "comm/communicator.h"
#include "comm/host_collectives.h"
#include "common/crc32c.h"
#include "common/host_memory.h"
#include "common/json.h"
#include "common/log.h"
#include "common/posix_file.h"
#include "common/units.h"
#include "device/cuda_loader.h"
#include "model/llama_config.h"
#include "model/safetensors.h"
#include "runtime/checkpoint.h"
#include "runtime/model_spec.h"
#include "train/cuda_ops.h"
#include "train/device_sizes.h"
#include "train/progress.h"
#include "train/run_dir.h"

namespace strata::train {
namespace trainer_detail {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Creates `dir` and checks it is writable (a probe file); `what` names it in
// errors. `made`: the directories it created, outermost first.
Status make_dirs(const std::string& dir, const std::string& what, std::vector<std::string>* made = nullptr);

}  // namespace trainer_detail

using trainer_detail::Clock;
using json = nlohmann::json;

// ---------------------------------------------------------------- Impl

struct Trainer::Impl {
  TrainerOptions opt;
  model::ModelDir model;
  LlamaDims dims;
  uint32_t accum = 1;
  int64_t seq = 0;
  int64_t tokens_per_micro = 0;  // B*T
  std::unique_ptr<TokenDataset> data;
  std::optional<uint32_t> data_fingerprint;  // TokenDataset::fingerprint(), in the resume settings
  // The engine's device (not owned by the engine: declared before it, and
  // ~Impl resets the engine first).
  std::unique_ptr<DeviceBackend> backend;
  // N ranks (trainer.h, "Ranks"): the communicator over `backend`; rank 0 of
  // 1 without one.
  std::unique_ptr<comm::Communicator> comm;
  comm::HostStaging comm_staging;  // N ranks: the per-step agreements' device buffer
  uint32_t rank = 0, world = 1;
  int local_rank = 0;  // N GPU ranks: this rank's GPU (the launcher's LOCAL_RANK)
  comm::Launcher launcher = comm::Launcher::kNone;  // N host ranks: MPI (mpirun) or TCP (torchrun style)
  std::string run_id;  // ranks other than 0 (no RunDir): rank 0's run id
  std::string device_description;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<ModelOps> ops;
  bool sync_ops = true;  // ops->synchronous(): synchronize before computing
  DeviceStream* stream = nullptr;
  DType compute_dtype = DType::kF32;

  // Groups and where each parameter sits in its group's view.
  GroupId embed_group = 0, head_group = 0;
  std::vector<GroupId> layer_groups;
  ParamId embed_param = 0, norm_param = 0, lm_head_param = 0;
  std::vector<LayerArray<ParamId>> layer_param_ids;
  // Per ParamId: trains (false: frozen, e.g. a LoRA base).
  std::vector<bool> trainable;
  uint64_t micro_first_sample = 0;  // the current micro-batch's first sample (LoRA dropout masks)
  // Validation batches per evaluation: --eval-batches, capped at the
  // distinct global batches (batch x ranks windows each); 0 without a
  // validation part.
  uint64_t eval_batch_count() const {
    return std::min<uint64_t>(opt.eval_batches, data->val_batches(opt.batch * world));
  }

  // Buffers, all from backend->alloc (device memory; RAM on the host
  // backend). grad_buf: the largest group's fp32 gradients (reduce_grad
  // copies from it); tied_grad: the embedding's [vocab, dim] gradient, kept
  // through the backward when embeddings are tied; acts: (layers + 1) x
  // [B*T, dim], each layer's input, then the head's; dx_a, dx_b: [B*T, dim];
  // inputs, targets: [B*T] token ids.
  float* grad_buf = nullptr;
  uint64_t grad_buf_elems = 0;
  float* tied_grad = nullptr;
  // pad_token_id (transformers' nn.Embedding padding_idx): its row gets no
  // gradient from the lookup; pad_row keeps the head's part of it across
  // embed_backward when embeddings are tied ([dim] floats).
  float* pad_row = nullptr;
  float* acts = nullptr;
  float* dx_a = nullptr;
  float* dx_b = nullptr;
  int32_t* inputs = nullptr;
  int32_t* targets = nullptr;
  // Host side of the token upload: pinned [inputs | targets], rewritten only
  // once `upload_done` (recorded after the copies) has completed.
  HostAllocation staging;
  int32_t* inputs_host = nullptr;
  int32_t* targets_host = nullptr;
  DeviceEvent* upload_done = nullptr;
  std::vector<int32_t> batch_tokens;  // B x (T+1)
  std::vector<uint8_t> batch_mask;    // B x (T+1): the loss mask of the same positions
  // One per micro-batch / evaluation batch, written by the ops (on CUDA from
  // a host function, possibly after the call returned): never resized after
  // setup, read only after the stream is synchronized.
  std::vector<LossStats> losses;

  int64_t step = 0;  // optimizer steps done
  uint64_t tokens_seen = 0;
  double last_loss = 0;
  FILE* metrics = nullptr;
  std::string metrics_file;  // its path, for messages
  bool metrics_eval_at_resume = false;  // the file holds the evaluation of the step resumed at
  // While steps are trained (RunLoop): a metrics line that cannot be written
  // is kept here instead of ending the run at once; the run then stops as on
  // a stop request (agreed on by every rank), saves, and fails with it.
  bool metrics_deferred = false;
  Status metrics_error;
  // N ranks: the export failed on every rank alike (rank 0's write outcome,
  // shared; a value no rank can export), so all may save together.
  bool export_failure_agreed = false;
  bool warned_order = false;
  std::unique_ptr<RunDir> run_dir;  // OUT, locked for the whole run
  std::vector<std::string> made_out_dirs;  // what creating OUT made, outermost first (Trainer::create)
  std::string resume_from;          // the checkpoint resume() loads
  int64_t skipped_in_a_row = 0;     // consecutive skipped steps

  ~Impl() {
    if (metrics) std::fclose(metrics);
    if (!backend) return;
    // Work still queued (after an error mid-step) reads these buffers and
    // writes `losses`: drain it first. The ops go next (CudaOps synchronizes
    // the stream and frees its workspace to the backend), the stream before
    // the engine, the engine before its backend.
    if (stream) (void)backend->synchronize(stream);
    ops.reset();
    for (void* p : {static_cast<void*>(grad_buf), static_cast<void*>(tied_grad), static_cast<void*>(pad_row),
                    static_cast<void*>(acts),
                    static_cast<void*>(dx_a), static_cast<void*>(dx_b), static_cast<void*>(inputs),
                    static_cast<void*>(targets)})
      if (p) (void)backend->free(p);
    if (upload_done) backend->destroy_event(upload_done);
    if (staging.ptr) backend->free_pinned(staging);
    if (comm_staging.ptr) (void)backend->free(comm_staging.ptr);
    if (stream) (void)backend->destroy_stream(stream);
    engine.reset();
    comm.reset();
    backend.reset();
  }

  // create(): setup() runs the parts below in order.
  Status setup();
  Status check_options();
  Status open_model();
  Status open_data();
  Status check_output_dirs();
  Result<EngineOptions> engine_options();
  DeviceSizes device_sizes(const ModelSpec& spec);
  Status create_engine(EngineOptions eo);
  Status find_params();
  Status alloc_buffers();
  Status open_metrics();
  Status load_weights();
  Status read_weights(uint32_t* crc);  // load_weights without the ranks' agreement
  Status resolve_lora();
  // A LoRA parameter's initial value: the adapter file's tensor or PEFT's init.
  Status lora_initial(const ParamSpec& ps, const std::vector<model::TensorInfo>& adapter, model::TensorReader& reader,
                      std::mt19937_64& rng, std::vector<float>* buf);
  Status resume(const std::string& dir);
  Status choose_device(const DeviceSizes& z, Config* cfg);
  Status try_cuda(const DeviceSizes& z, Config* cfg);
  Status use_host(const DeviceSizes& z, Config* cfg);
  // Ranks (trainer_ranks.cpp).
  Status detect_ranks();  // the launcher's environment: rank, world
  Status join_ranks();    // the communicator; rank 0's run id, checkpoint and settings
  comm::CommOptions comm_options() const;   // what join_ranks() creates the communicator with
  Status fail_before_meeting(Status error);  // tells the other ranks (comm::refuse_to_meet); returns error
  // Every rank's n doubles, rank by rank (a collective on `stream`).
  Status all_gather(const double* mine, size_t n, std::vector<double>* all);
  Result<bool> any_rank(bool mine);  // true when it is true on some rank
  Result<std::vector<uint32_t>> ranks_where(bool mine);  // the ranks where it is true, in order
  Result<bool> stop_requested();     // opt.stop or metrics_error, agreed on by every rank
  Status stage_tokens();
  uint64_t counted_targets() const;
  Status forward(const int32_t* tokens, bool keep_for_backward);
  // weight: the micro-batch's share of the step's loss gradient (see
  // Trainer::train_step; 1 when every micro-batch counts as many targets).
  Status micro_batch(bool last, double weight, LossStats* loss);
  Result<GroupView> acquire(GroupId g);
  const void* ptr_of(const GroupView& v, ParamId p) const;
  // training: LoRA dropout on, seeded by (data seed, micro-batch, layer).
  LayerWeights layer_weights(const GroupView& v, size_t layer, bool training) const;
  float* grad_if_trainable(ParamId p, float* buf) const { return trainable[p] ? buf : nullptr; }
  // ev: the embedding's view (read only when embeddings are tied).
  HeadWeights head_weights(const GroupView& ev, const GroupView& hv) const;
  Status write_metrics(const json& j);
  std::string extra_json() const;
  std::string settings_json() const;
  // settings_json() and what else every rank must share (trainer_ranks.cpp).
  std::string rank_settings_json() const;
  // N ranks: every rank loaded its weights (`loaded`) and the same ones (a
  // checksum of what each read), else kInvalidArgument naming the ranks
  // that failed or differ. A collective: every rank calls it.
  Status agree_on_weights(bool loaded, uint32_t crc);
  json stats_json() const;
};

}  // namespace strata::train
