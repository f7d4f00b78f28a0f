// The planner: which tier (device / host / NVMe) is the home of each kind of
// state of each parameter group, how many bytes that puts on each tier, and
// how many bytes cross each link per training step. Also a step-time
// estimate from given bandwidths (`strata plan`, issue 5).
//
// Pure arithmetic on uint64 byte counts: planning a 70B model allocates a few
// kilobytes. All functions are thread-safe (no shared state). docs/planner.md
// explains the policy and the formulas; keep it in step with planner.cpp.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "runtime/config.h"
#include "runtime/model_spec.h"

namespace strata {

// The four kinds of per-parameter state the runtime keeps.
enum class StateKind : uint8_t {
  kCompute = 0,  // the copy the GPU computes with (compute dtype)
  kMaster,       // fp32 master weights
  kOptimizer,    // Adam m and v (fp32 or bf16 each)
  kGrad,         // fp32 gradient accumulator
};
inline constexpr int kNumStateKinds = 4;
const char* state_kind_name(StateKind k);  // "compute copy", "fp32 master", ...

// Budgets with every "detect" already resolved (the runtime measures free
// device memory, host RAM and disk space; `strata plan` takes flags).
struct PlanBudgets {
  uint64_t device_bytes = 0;  // device memory Strata may use, including the reserve
  uint64_t host_bytes = 0;    // host RAM for the host tier and the pinned buffers
  uint64_t pinned_bytes = 0;  // cap on page-locked buffers (part of host_bytes); 0: no separate cap
  std::vector<NvmeDir> nvme;  // capacity: bytes usable in that directory
};

struct PlanOptions {
  DType optimizer_state_dtype = DType::kF32;
  uint32_t optimizer_states = 2;           // Adam/AdamW: m and v
  uint64_t device_reserve = 2ull << 30;    // activations, workspace: never planned into
  uint32_t prefetch_depth = 2;             // groups uploaded ahead of the one in use
  uint32_t held_groups = 1;                // distinct groups held acquired at once (nested modules)
  uint64_t prefetch_bytes = 0;             // cap on prefetched bytes; 0: depth alone decides
  uint32_t micro_batches = 1;              // gradient accumulation steps per optimizer step
  uint32_t uploads_per_micro_batch = 2;    // forward, and backward with recompute
  uint64_t shard_alignment = 2048;         // elements (see shard_range)
  uint64_t optimizer_chunk = 16ull << 20;  // elements per optimizer-step chunk
  uint32_t optimizer_ring_buffers = 4;     // pinned chunk buffers (offload_optimizer.buffer_count)
  // ZeRO stages 1 and 2 (zero_optimization.stage < 3) with N ranks: every
  // rank keeps the whole compute copy (N x its shard's bytes, on the device or
  // host, never NVMe, as DeepSpeed keeps stage 1/2 parameters on the GPU);
  // master, states and gradients are still 1/N. One rank: no difference.
  bool replicate_params = false;
  // ZeRO stage 1 with N ranks: each rank sums its own micro-batches' whole
  // gradient on the device (fp32, numel x 4 bytes of device memory) and the
  // ranks reduce-scatter it once per step, not once per micro-batch.
  bool defer_grad_reduce = false;
  // Stages 2-3 with N ranks (strata.gradient_staging, unset: true): the
  // gradient path keeps enough device send buffers for one group's gradient
  // (Plan::grad_pieces), so reduce_grad packs each piece into them and the
  // reduce-scatters run behind backward instead of holding it up. The plan
  // falls back to kGradPieces buffers (each group's last ones overlap) when
  // the device budget cannot hold that many, and to none (the reduce-scatter
  // reads the caller's buffer, which the caller's stream waits for) when it
  // cannot hold those either; false asks for none.
  bool stage_reduce = true;
  // strata.optimizer_handoff (and not strata.overlap_backward): one rank's
  // optimizer pass copies the updated compute copy of the next forward's
  // first prefetched NVMe-homed groups into their upload staging, so their
  // first upload of the step reads nothing from NVMe (Uploader::plan_handoff).
  bool optimizer_handoff = true;
  // Tier overrides, first match wins: strata.groups, then the DeepSpeed
  // offload_param / offload_optimizer devices as a "*" rule.
  std::vector<GroupTierRule> overrides;
};

// Options from a parsed config (budgets stay with the caller: they need
// measuring). offload_param.device none|cpu|nvme forces the compute copies to
// device|host|nvme; offload_optimizer.device none forces master, optimizer
// states and gradients to the device, cpu to the host, nvme puts master and
// optimizer states on NVMe (gradients: the planner decides).
PlanOptions plan_options_from_config(const Config& config);

struct GroupPlan {
  std::string name;
  uint64_t numel = 0;                   // elements of the whole group (all ranks)
  uint64_t shard_numel = 0;             // this rank's padded shard elements (sum over params)
  uint64_t trainable_shard_numel = 0;   // of them, trainable (frozen params have no master/states/grads)
  uint64_t trainable_compute_bytes = 0; // the trainable ones' compute copies (what an optimizer step writes)
  uint64_t max_trainable_shard = 0;     // the largest trainable parameter's padded shard
  uint64_t gathered_compute_bytes = 0;  // the full group in compute dtype, as the GPU needs it
  uint64_t shard_compute_bytes = 0;     // this rank's padded shards in compute dtype (what its optimizer writes)
  std::array<Tier, kNumStateKinds> tier{};
  std::array<uint64_t, kNumStateKinds> bytes{};  // this rank's bytes of each kind
  std::array<bool, kNumStateKinds> forced{};     // placed by an override
};

struct LinkBytes {
  uint64_t nvme_read = 0;
  uint64_t nvme_write = 0;
  uint64_t h2d = 0;  // host to device
  uint64_t d2h = 0;  // device to host
  // N ranks (ZeRO stage 3): bytes this rank sends to its peers, (N-1)/N of
  // every all-gather of a group's compute copy and of every fp32 gradient
  // reduce-scatter.
  uint64_t comm = 0;
  LinkBytes& operator+=(const LinkBytes& o);
};

// The gradient path (engine/grad_path.h) moves each parameter's shard in
// pieces of grad_piece_elems() elements, through kGradPieces pinned buffers
// (more with N ranks and staged reduce-scatters: Plan::grad_pieces).
inline constexpr uint32_t kGradPieces = 4;
// Up to 4 Mi elements (4 Mi / N with N ranks: a reduce-scatter sends N
// pieces), rounded up to 32 Ki elements: a multiple of every swap I/O quantum
// (at most 32 Ki elements) and of the gradient norm's blocks.
uint64_t grad_piece_elems(uint64_t max_trainable_shard, uint32_t world_size);

struct Plan {
  std::vector<GroupPlan> groups;
  uint32_t world_size = 1;
  uint32_t rank = 0;
  uint64_t model_numel = 0;  // all parameters, unsharded
  uint64_t shard_numel = 0;  // this rank's padded elements

  // bytes[tier][kind] over all groups (tier index: Tier value; kAuto row unused).
  std::array<std::array<uint64_t, kNumStateKinds>, 4> bytes{};
  uint64_t device_buffers = 0;           // gathered groups in use and prefetched
  uint64_t local_grad_bytes = 0;         // stage 1, N ranks: this rank's whole fp32 gradient on the device
  // The gradient path: elements per piece, how many pieces are in flight,
  // and (N ranks) its device buffers: with staged reduce-scatters
  // (grad_staged) grad_pieces send buffers of world_size pieces each, else
  // one; plus one piece, the reduce-scatter's output.
  uint64_t grad_piece_elems = 0;
  uint32_t grad_pieces = kGradPieces;
  bool grad_staged = false;              // N ranks: reduce_grad packs into engine send buffers
  uint64_t reduce_buffers = 0;           // device bytes of the above (N ranks, not stage 1)
  uint64_t grad_pieces_wanted = 0;       // N ranks: pieces of the largest group (what overlap needs)
  // Pinned: the gradient path's download pieces, grad_download_pieces() of
  // grad_piece_elems fp32 elements plus one accumulation scratch piece
  // (engine/grad_path.h takes them from the pinned pool).
  uint64_t grad_pinned = 0;
  uint32_t prefetch_groups = 0;          // how many groups the device buffers prefetch
  uint32_t held_groups = 1;              // how many they hold acquired at once
  uint64_t staging_ring = 0;             // pinned: host/NVMe compute copies on their way up
  uint64_t optimizer_ring = 0;           // pinned: NVMe-resident state chunks in the step
  uint64_t optimizer_chunk_bytes = 0;    // one ring buffer
  std::vector<uint64_t> nvme_dir_bytes;  // per budgets.nvme entry

  LinkBytes forward_backward;  // per optimizer step (all micro-batches)
  LinkBytes optimizer_step;
  uint64_t cpu_optimizer_numel = 0;  // elements the CPU optimizer updates per step
  uint64_t gpu_optimizer_numel = 0;

  PlanBudgets budgets;
  PlanOptions options;

  uint64_t tier_bytes(Tier t) const;  // state only, no buffers
  uint64_t device_total() const;      // state + device buffers + reserve
  uint64_t host_total() const;        // state + pinned rings and gradient pieces
  uint64_t nvme_total() const;
  uint64_t pinned_total() const { return staging_ring + optimizer_ring + grad_pinned; }
  // Download pieces the gradient path keeps in flight: grad_pieces, at least
  // the two its bounce through a piece takes.
  uint32_t grad_download_pieces() const { return grad_pieces > 2 ? grad_pieces : 2; }
  LinkBytes per_step() const;
  // Multi-line human-readable report (tiers, groups, traffic per step).
  std::string report() const;
};

// Plans `model` into `budgets`. Statuses:
//  kInvalidArgument: bad model (validate_model_spec), bad options, an
//    override that cannot work (optimizer states on the device without the
//    master there too, ...), or an override matching no group.
//  kOutOfBudget: it cannot fit; the message says which tier is short, by how
//    much, and what would make it fit, e.g. "NVMe: optimizer states (56.0
//    GiB) and fp32 master (28.0 GiB) need 84.0 GiB but /nvme has 60.0 GiB
//    free: 24.0 GiB short; add a directory, or use bf16 optimizer states
//    (saves 28.0 GiB)".
Result<Plan> make_plan(const ModelSpec& model, const PlanBudgets& budgets, const PlanOptions& options);

// The host budget detected beside a device whose memory is RAM (the host
// backend: strata finetune --device cpu, strata plan --device cpu): `share`,
// this rank's MemAvailable, less `device_bytes`, or the two tiers would plan
// the same RAM. kOutOfBudget, naming both, when the device budget takes it all.
Result<uint64_t> host_budget_beside_ram_device(uint64_t share, uint64_t device_bytes);

// Measured or assumed speeds, in bytes/s, parameters/s and FLOP/s.
struct Bandwidths {
  double h2d = 0;
  double d2h = 0;
  double nvme_read = 0;  // all NVMe directories together
  double nvme_write = 0;
  double cpu_optimizer_params_per_s = 0;
  double gpu_flops = 0;  // sustained dense matmul throughput
  double link = 0;       // N ranks: bytes/s one rank sends to its peers
};

struct Workload {
  uint64_t tokens_per_micro_batch = 0;   // per rank
  bool activation_checkpointing = true;  // recompute forward in backward
  // What the parameter count leaves out (set from the model's shape:
  // attention_workload(); both 0: every parameter a matmul weight, no
  // attention). Forward FLOPs per token of attention's scores and weighted
  // sums over all layers, and parameters that are no matmul weight (an
  // untied input embedding is a lookup).
  double attention_forward_flops_per_token = 0;
  uint64_t non_matmul_params = 0;
  // Frozen matmul weights (a LoRA base): their backward computes the input's
  // gradient but not their own, 2 FLOP per weight and token fewer.
  uint64_t frozen_matmul_params = 0;
  bool overlap_backward = false;         // optimizer may start during the last backward
  // strata.pipelined_step (the engine's default; off here unless set): the
  // optimizer step runs behind the next forward (one rank; all but the first
  // group's update can hide).
  bool pipelined_step = false;
  // The device is this machine's CPU (the host backend, `strata finetune
  // --device cpu`): host<->device copies are memcpys and the optimizer step
  // runs on the cores that compute, so neither overlaps compute: the copies
  // add to compute, the CPU update to the step's NVMe time, and no part of
  // the step hides under forward or backward. NVMe transfers during forward
  // and backward, done by the drive, still overlap.
  bool shared_cores = false;
};

// Causal attention over sequences of `seq` tokens: each query sees (seq+1)/2
// keys on average; the scores (q·k) and the weighted sum of values cost
// 2 x heads x head_dim FLOP per key each: 2 x (seq+1) x heads x head_dim per
// layer and token, forward.
double attention_forward_flops_per_token(uint64_t layers, uint64_t heads, uint64_t head_dim, uint64_t seq);

// FLOPs of one token's forward and backward (and recompute): 2 per matmul
// weight forward, 4 backward (2 for a frozen one), 2 more recomputed;
// attention in the same proportions (the backward of both products is twice
// the forward).
double flops_per_token(const Plan& plan, const Workload& work);
// The same for a model of `model_numel` parameters (a plan's model_numel).
double flops_per_token(uint64_t model_numel, const Workload& work);

struct StepTimeEstimate {
  double compute_s = 0;  // GPU forward+backward, all micro-batches
  double h2d_s = 0;      // uploads during forward/backward
  double d2h_s = 0;      // gradient downloads
  double nvme_fb_s = 0;  // NVMe reads+writes during forward/backward
  double comm_s = 0;     // N ranks: all-gathers and reduce-scatters (overlapped with the rest)
  double forward_backward_s = 0;
  double nvme_step_s = 0;  // NVMe reads+writes of the optimizer step
  double cpu_optimizer_s = 0;
  double step_h2d_s = 0;       // updated compute copies sent to the device
  double pipeline_fill_s = 0;  // first read and last write of the step
  double step_comm_s = 0;      // stages 1-2, N ranks: the all-gather of the updated shards, after the update
  double optimizer_step_s = 0;
  double overlap_saved_s = 0;  // step time hidden under backward (overlap_backward)
  double pipelined_saved_s = 0;  // step time hidden under the next forward (pipelined step)
  double total_s = 0;
  bool shared_cores = false;  // Workload::shared_cores: the report says the parts add
  std::string bottleneck;  // the part that sets the time, e.g. "NVMe (optimizer step)"
  std::string report() const;
};

// Estimates one optimizer step (all micro-batches). Overlap assumptions (see
// docs/planner.md): during forward/backward, compute, uploads, downloads and
// NVMe traffic overlap fully and the slowest sets the time; NVMe reads and
// writes share the drives (their times add). The optimizer step is a
// pipeline: NVMe traffic, the CPU update and uploads of updated copies
// overlap, plus the first chunk's read and the last chunk's write. With
// overlap_backward the step may hide under the last micro-batch's backward;
// with a pipelined step, under the next step's first forward (each group's
// update must finish before its forward, so at most that forward's length).
// With shared_cores the copies add to compute, the CPU update to the step's
// NVMe time, and nothing of the step hides.
// kInvalidArgument when a bandwidth the plan needs is zero or negative, or
// tokens_per_micro_batch is zero.
Result<StepTimeEstimate> predict_step_time(const Plan& plan, const Bandwidths& bw, const Workload& work);

}  // namespace strata
