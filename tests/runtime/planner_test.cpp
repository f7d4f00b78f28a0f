// The planner (src/runtime/planner.h) and shard math (model_spec.h): tier
// choices and byte totals checked against arithmetic done by hand.
#include "runtime/planner.h"

#include <gtest/gtest.h>

#include <string>

#include "common/units.h"
#include "model/llama_weights.h"
#include "runtime/model_spec.h"

namespace strata {
namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;

// ------------------------------------------------------------------ shards

TEST(ShardRange, TilesEveryParameterForOneToEightRanks) {
  const uint64_t sizes[] = {0, 1, 7, 2047, 2048, 2049, 1000003, 4096 * 3 + 5, 128256ull * 8192};
  for (uint64_t align : {1ull, 2ull, 2048ull, 4096ull}) {
    for (uint64_t n : sizes) {
      for (uint32_t ws = 1; ws <= 8; ++ws) {
        SCOPED_TRACE(testing::Message() << "numel " << n << " world " << ws << " align " << align);
        uint64_t covered = 0, next = 0;
        const uint64_t padded = shard_range(n, ws, 0, align).padded;
        EXPECT_EQ(padded % align, 0u);
        EXPECT_GE(padded * ws, n);
        // No more padding than needed: one alignment unit per rank at most.
        EXPECT_LT(padded, (n + ws - 1) / ws + align + (n == 0 ? align : 0));
        for (uint32_t r = 0; r < ws; ++r) {
          const ShardRange s = shard_range(n, ws, r, align);
          EXPECT_EQ(s.padded, padded);  // every rank stores the same amount
          EXPECT_EQ(s.begin, next);     // contiguous, in rank order
          EXPECT_LE(s.size(), s.padded);
          EXPECT_LE(s.end, n);
          covered += s.size();
          next = s.end;
        }
        EXPECT_EQ(covered, n);
        EXPECT_EQ(next, n);
      }
    }
  }
}

TEST(ShardRange, ExactValues) {
  // 10 elements over 3 ranks, alignment 2: ceil(10/3) = 4 -> padded 4.
  EXPECT_EQ(shard_range(10, 3, 0, 2), (ShardRange{0, 4, 4}));
  EXPECT_EQ(shard_range(10, 3, 1, 2), (ShardRange{4, 8, 4}));
  EXPECT_EQ(shard_range(10, 3, 2, 2), (ShardRange{8, 10, 4}));
  // 5 elements over 4 ranks, alignment 4: padded 4, the last ranks hold padding only.
  EXPECT_EQ(shard_range(5, 4, 1, 4), (ShardRange{4, 5, 4}));
  EXPECT_EQ(shard_range(5, 4, 2, 4), (ShardRange{5, 5, 4}));
  EXPECT_EQ(shard_range(5, 4, 3, 4), (ShardRange{5, 5, 4}));
}

// ------------------------------------------------------------------ models

// `groups` groups of one parameter each with `elems` bf16 elements.
ModelSpec uniform_model(int groups, uint64_t elems) {
  ModelSpec m;
  for (int i = 0; i < groups; ++i)
    m.params.push_back(ParamSpec{"p" + std::to_string(i), {elems}, DType::kBF16, "g" + std::to_string(i)});
  return m;
}

PlanOptions small_options() {
  PlanOptions o;
  o.device_reserve = 0;
  o.prefetch_depth = 1;
  o.optimizer_chunk = 1 << 18;
  o.optimizer_ring_buffers = 2;
  return o;
}

// The gradient path's pinned pieces of uniform_model(_, 1 Mi): pieces of the
// largest shard (1 Mi elements), 4 in flight plus one scratch, fp32.
constexpr uint64_t kGradPinned = 5 * 4 * kMiB;

Plan plan_ok(const ModelSpec& m, const PlanBudgets& b, const PlanOptions& o) {
  auto r = make_plan(m, b, o);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? r.value() : Plan{};
}

std::string refusal(const ModelSpec& m, const PlanBudgets& b, const PlanOptions& o,
                    StatusCode code = StatusCode::kOutOfBudget) {
  auto r = make_plan(m, b, o);
  EXPECT_FALSE(r.ok());
  if (r.ok()) return "";
  EXPECT_EQ(r.status().code(), code) << r.status().to_string();
  return r.status().message();
}

constexpr int kC = static_cast<int>(StateKind::kCompute);
constexpr int kM = static_cast<int>(StateKind::kMaster);
constexpr int kO = static_cast<int>(StateKind::kOptimizer);
constexpr int kG = static_cast<int>(StateKind::kGrad);
constexpr int kDev = static_cast<int>(Tier::kDevice);
constexpr int kHost = static_cast<int>(Tier::kHost);
constexpr int kNvme = static_cast<int>(Tier::kNvme);

TEST(Planner, SmallModelLandsOnTheDevice) {
  // 4 groups x 1 Mi elements: compute 2 MiB, master 4, states 8, grad 4 per group.
  const ModelSpec m = uniform_model(4, 1 << 20);
  PlanBudgets b{64 * kMiB, 256 * kMiB, 0, {}};
  Plan p = plan_ok(m, b, small_options());
  for (const auto& g : p.groups) {
    EXPECT_EQ(g.tier[kC], Tier::kDevice) << g.name;
    EXPECT_EQ(g.tier[kM], Tier::kHost);
    EXPECT_EQ(g.tier[kO], Tier::kHost);
    EXPECT_EQ(g.tier[kG], Tier::kHost);
  }
  EXPECT_EQ(p.model_numel, 4u << 20);
  EXPECT_EQ(p.bytes[kDev][kC], 8 * kMiB);
  EXPECT_EQ(p.bytes[kHost][kM], 16 * kMiB);
  EXPECT_EQ(p.bytes[kHost][kO], 32 * kMiB);
  EXPECT_EQ(p.bytes[kHost][kG], 16 * kMiB);
  EXPECT_EQ(p.device_buffers, 0u);  // everything resident: nothing to prefetch
  EXPECT_EQ(p.staging_ring, 0u);
  EXPECT_EQ(p.optimizer_ring, 0u);
  EXPECT_EQ(p.nvme_total(), 0u);
  // Per step: bf16 gradients down (2 B/param), updated bf16 copies up.
  EXPECT_EQ(p.forward_backward.h2d, 0u);
  EXPECT_EQ(p.forward_backward.d2h, 8 * kMiB);
  EXPECT_EQ(p.optimizer_step.h2d, 8 * kMiB);
  EXPECT_EQ(p.per_step().nvme_read + p.per_step().nvme_write, 0u);
  EXPECT_EQ(p.cpu_optimizer_numel, 4u << 20);
  EXPECT_NE(p.report().find("g0 .. g3 (4 groups)"), std::string::npos) << p.report();
}

TEST(Planner, BudgetsForceHostThenNvme) {
  const ModelSpec m = uniform_model(4, 1 << 20);
  // Device 7 MiB: 8 MiB of compute copies do not fit, so 2 working buffers
  // (1 in use + 1 prefetched) x 2 MiB = 4 MiB; the 3 MiB left hold g0.
  // Host 36 MiB (plus the 20 MiB of gradient pieces, kGradPinned): staging
  // ring 2 x 2 MiB = 4 MiB; a worst-case optimizer ring
  // 2 x 256 Ki x (4+8+4+4) B = 10 MiB is held back; the 22 MiB left take, in
  // order, compute g1..g3 (6 MiB) and all four gradients (16 MiB). Masters and
  // states go to NVMe: 16 + 32 = 48 MiB.
  PlanBudgets b{7 * kMiB, 36 * kMiB + kGradPinned, 0, {{"/nvme", 1 * kGiB}}};
  Plan p = plan_ok(m, b, small_options());
  EXPECT_EQ(p.device_buffers, 4 * kMiB);
  EXPECT_EQ(p.groups[0].tier[kC], Tier::kDevice);
  EXPECT_EQ(p.groups[1].tier[kC], Tier::kHost);
  EXPECT_EQ(p.groups[2].tier[kC], Tier::kHost);
  EXPECT_EQ(p.groups[3].tier[kC], Tier::kHost);
  for (const auto& g : p.groups) {
    EXPECT_EQ(g.tier[kG], Tier::kHost);
    EXPECT_EQ(g.tier[kM], Tier::kNvme);
    EXPECT_EQ(g.tier[kO], Tier::kNvme);
  }
  EXPECT_EQ(p.staging_ring, 4 * kMiB);
  // Actual ring: master + states per element = 12 B x 256 Ki x 2 buffers.
  EXPECT_EQ(p.optimizer_chunk_bytes, 3 * kMiB);
  EXPECT_EQ(p.optimizer_ring, 6 * kMiB);
  EXPECT_EQ(p.tier_bytes(Tier::kDevice), 2 * kMiB);
  EXPECT_EQ(p.tier_bytes(Tier::kHost), 22 * kMiB);
  EXPECT_EQ(p.nvme_total(), 48 * kMiB);
  EXPECT_EQ(p.grad_pinned, kGradPinned);
  EXPECT_EQ(p.host_total(), 32 * kMiB + kGradPinned);
  EXPECT_EQ(p.device_total(), 6 * kMiB);
  ASSERT_EQ(p.nvme_dir_bytes.size(), 1u);
  EXPECT_EQ(p.nvme_dir_bytes[0], 48 * kMiB);
  // Forward+backward: two slots (1 in use + 1 prefetched; no room for a
  // cached one) for three host groups: g1 uploaded in forward and again in
  // backward, g2 and g3 still in the slots when backward starts.
  EXPECT_EQ(p.forward_backward.h2d, (2 + 1 + 1) * 2 * kMiB);
  EXPECT_EQ(p.forward_backward.nvme_read, 0u);
  EXPECT_EQ(p.forward_backward.d2h, 8 * kMiB);
  // Step: read and write master + states; the device copy of g0 refreshed.
  EXPECT_EQ(p.optimizer_step.nvme_read, 48 * kMiB);
  EXPECT_EQ(p.optimizer_step.nvme_write, 48 * kMiB);
  EXPECT_EQ(p.optimizer_step.h2d, 2 * kMiB);

  // Two micro-batches: the gradients go down twice; of the uploads, the
  // second micro-batch's forward also finds g1 and g2 (the end of backward)
  // in the slots: g1 3 times, g2 once, g3 twice. Not the step's traffic.
  PlanOptions o2 = small_options();
  o2.micro_batches = 2;
  Plan p2 = plan_ok(m, b, o2);
  EXPECT_EQ(p2.forward_backward.h2d, (3 + 1 + 2) * 2 * kMiB);
  EXPECT_EQ(p2.forward_backward.d2h, 16 * kMiB);
  EXPECT_EQ(p2.optimizer_step.nvme_read, 48 * kMiB);
}

TEST(Planner, RefusalSaysWhatIsShortAndByHowMuch) {
  const ModelSpec m = uniform_model(4, 1 << 20);
  PlanBudgets b{7 * kMiB, 36 * kMiB + kGradPinned, 0, {{"/nvme", 40 * kMiB}}};
  EXPECT_EQ(refusal(m, b, small_options()),
            "NVMe: optimizer states 32.0 MiB + fp32 master 16.0 MiB = 48.0 MiB needed but /nvme has 40.0 MiB free: "
            "8.0 MiB short; add a directory or use bf16 optimizer states (saves 16.0 MiB)");
  // bf16 states: 16 MiB of states + 16 MiB of masters = 32 MiB fits in 40.
  PlanOptions bf16 = small_options();
  bf16.optimizer_state_dtype = DType::kBF16;
  Plan p = plan_ok(m, b, bf16);
  EXPECT_EQ(p.bytes[kNvme][kO], 16 * kMiB);
  EXPECT_EQ(p.nvme_total(), 32 * kMiB);

  b.nvme.clear();
  EXPECT_EQ(refusal(m, b, small_options()),
            "NVMe: optimizer states 32.0 MiB + fp32 master 16.0 MiB = 48.0 MiB needed beyond what fits on the device "
            "and the host, but no NVMe directory is configured: 48.0 MiB short; add one (strata.nvme or "
            "offload_optimizer.nvme_path), raise the host budget or use bf16 optimizer states (saves 16.0 MiB)");

  // Device too small even for the working buffers (2 x 2 MiB).
  PlanBudgets tiny{3 * kMiB, 1 * kGiB, 0, {}};
  EXPECT_EQ(refusal(m, tiny, small_options()),
            "device: working buffers need 4.0 MiB (2 x the largest group, 2.0 MiB: 1 in use, 1 prefetched) but "
            "3.0 MiB is usable (3.0 MiB minus the 0 B reserve): 1.0 MiB short; lower strata.prefetch_depth, "
            "strata.held_groups or strata.device_reserve, or raise the device budget");
  // A budget under the reserve: short by the buffers plus what the reserve takes beyond it
  // (4 + 5 - 3 MiB; "4 MiB", the buffers minus nothing usable, would still not fit).
  PlanOptions reserved = small_options();
  reserved.device_reserve = 5 * kMiB;
  EXPECT_EQ(refusal(m, tiny, reserved),
            "device: working buffers need 4.0 MiB (2 x the largest group, 2.0 MiB: 1 in use, 1 prefetched) but "
            "0 B is usable (3.0 MiB minus the 5.0 MiB reserve): 6.0 MiB short; lower strata.prefetch_depth, "
            "strata.held_groups or strata.device_reserve, or raise the device budget");
  // Each group held at once beyond the first is one more buffer.
  PlanOptions held3 = small_options();
  held3.held_groups = 3;
  PlanBudgets five{5 * kMiB, 1 * kGiB, 0, {}};
  EXPECT_NE(refusal(m, five, held3).find("need 8.0 MiB (4 x the largest group, 2.0 MiB: 3 in use, 1 prefetched)"),
            std::string::npos)
      << refusal(m, five, held3);

  // Pinned cap below the staging ring + optimizer ring + gradient pieces (4 + 6 + 20 MiB).
  PlanBudgets pinned{7 * kMiB, 36 * kMiB + kGradPinned, 28 * kMiB, {{"/nvme", 1 * kGiB}}};
  EXPECT_EQ(refusal(m, pinned, small_options()),
            "pinned host memory: buffers need 30.0 MiB (staging 4.0 MiB, optimizer ring 6.0 MiB, gradient pieces "
            "20.0 MiB) but the pinned budget is 28.0 MiB: 2.0 MiB short; raise strata.pinned_memory, or lower "
            "strata.prefetch_depth or strata.optimizer_chunk");
}

TEST(Planner, MultipleNvmeDirectoriesShareByCapacity) {
  const ModelSpec m = uniform_model(4, 1 << 20);
  PlanBudgets b{7 * kMiB, 36 * kMiB + kGradPinned, 0, {{"/a", 64 * kMiB}, {"/b", 32 * kMiB}}};
  Plan p = plan_ok(m, b, small_options());
  ASSERT_EQ(p.nvme_dir_bytes.size(), 2u);
  EXPECT_EQ(p.nvme_dir_bytes[0], 32 * kMiB);
  EXPECT_EQ(p.nvme_dir_bytes[1], 16 * kMiB);
  b.nvme = {{"/a", 20 * kMiB}, {"/b", 20 * kMiB}};
  EXPECT_EQ(refusal(m, b, small_options()),
            "NVMe: optimizer states 32.0 MiB + fp32 master 16.0 MiB = 48.0 MiB needed but the 2 NVMe directories "
            "have 40.0 MiB free: 8.0 MiB short; add a directory or use bf16 optimizer states (saves 16.0 MiB)");
}

// The optimizer hand-off (PlanOptions::optimizer_handoff): the first
// prefetched positions of forward, when NVMe-homed and wholly trainable,
// take their first upload of the step from the optimizer pass, not NVMe.
TEST(Planner, OptimizerHandOffSavesTheFirstGroupsNvmeReads) {
  ModelSpec m = uniform_model(6, 1 << 20);  // 2 MiB of bf16 per group
  PlanBudgets b{64 * kMiB, 256 * kMiB, 0, {{"/nvme", 1 * kGiB}}};
  PlanOptions o = small_options();
  o.prefetch_depth = 2;
  o.overrides = {{"*", Tier::kNvme, Tier::kAuto, Tier::kAuto, Tier::kAuto}};
  o.optimizer_handoff = false;
  const Plan off = plan_ok(m, b, o);
  ASSERT_EQ(off.prefetch_groups, 2u);
  o.optimizer_handoff = true;
  const Plan on = plan_ok(m, b, o);
  EXPECT_EQ(off.forward_backward.nvme_read - on.forward_backward.nvme_read, 2 * 2 * kMiB);
  EXPECT_EQ(on.forward_backward.h2d, off.forward_backward.h2d);  // still uploaded, from the hand-off
  EXPECT_EQ(on.optimizer_step.nvme_read, off.optimizer_step.nvme_read);
  // A frozen first group has no update to hand off: it is read as before.
  m.params[0].trainable = false;
  o.optimizer_handoff = false;
  const Plan frozen_off = plan_ok(m, b, o);
  o.optimizer_handoff = true;
  EXPECT_EQ(frozen_off.forward_backward.nvme_read - plan_ok(m, b, o).forward_backward.nvme_read, 2 * kMiB);
  // N ranks: no hand-off (the copy is gathered, not uploaded).
  m.params[0].trainable = true;
  m.world_size = 2;
  const Plan two = plan_ok(m, b, o);
  o.optimizer_handoff = false;
  EXPECT_EQ(plan_ok(m, b, o).forward_backward.nvme_read, two.forward_backward.nvme_read);
}

TEST(Planner, PerGroupOverrides) {
  const ModelSpec m = uniform_model(4, 1 << 20);
  PlanBudgets b{64 * kMiB, 256 * kMiB, 0, {{"/nvme", 1 * kGiB}}};
  PlanOptions o = small_options();
  o.overrides = {{"g3", Tier::kNvme, Tier::kAuto, Tier::kAuto, Tier::kAuto},
                 {"g[23]", Tier::kAuto, Tier::kNvme, Tier::kNvme, Tier::kAuto},
                 {"g0", Tier::kAuto, Tier::kDevice, Tier::kDevice, Tier::kAuto}};
  Plan p = plan_ok(m, b, o);
  // g0: GPU optimizer (master, states, and so the gradients, on the device).
  EXPECT_EQ(p.groups[0].tier, (std::array<Tier, 4>{Tier::kDevice, Tier::kDevice, Tier::kDevice, Tier::kDevice}));
  EXPECT_TRUE(p.groups[0].forced[kG]);
  EXPECT_EQ(p.groups[1].tier, (std::array<Tier, 4>{Tier::kDevice, Tier::kHost, Tier::kHost, Tier::kHost}));
  EXPECT_EQ(p.groups[2].tier, (std::array<Tier, 4>{Tier::kDevice, Tier::kNvme, Tier::kNvme, Tier::kHost}));
  EXPECT_EQ(p.groups[3].tier, (std::array<Tier, 4>{Tier::kNvme, Tier::kNvme, Tier::kNvme, Tier::kHost}));
  EXPECT_TRUE(p.groups[3].forced[kC]);
  EXPECT_FALSE(p.groups[3].forced[kG]);
  EXPECT_EQ(p.gpu_optimizer_numel, 1u << 20);
  EXPECT_EQ(p.cpu_optimizer_numel, 3u << 20);
  // g0 sends no gradients down; g3's compute copy, the only one off the
  // device, is read from NVMe once per step (it stays in its device slot).
  EXPECT_EQ(p.forward_backward.d2h, 6 * kMiB);
  EXPECT_EQ(p.forward_backward.nvme_read, 2 * kMiB);
  EXPECT_EQ(p.forward_backward.h2d, 2 * kMiB);
  // Step: master+states of g2, g3 (24 MiB) read and written; g3's copy written.
  EXPECT_EQ(p.optimizer_step.nvme_read, 24 * kMiB);
  EXPECT_EQ(p.optimizer_step.nvme_write, 26 * kMiB);
  EXPECT_EQ(p.optimizer_step.h2d, 4 * kMiB);  // g1, g2 copies; g0 updated on the GPU
  EXPECT_NE(p.report().find("nvme* / nvme* / nvme* / host"), std::string::npos) << p.report();

  o.overrides = {{"layers.*", Tier::kHost}};
  EXPECT_EQ(refusal(m, b, o, StatusCode::kInvalidArgument),
            "plan: group rule \"layers.*\" matches no group (groups: g0, g1, g2, g3)");
  o.overrides = {{"g1", Tier::kAuto, Tier::kAuto, Tier::kDevice, Tier::kAuto}};
  EXPECT_EQ(refusal(m, b, o, StatusCode::kInvalidArgument),
            "plan: group g1: the optimizer runs on the device only with the fp32 master, the optimizer states and the "
            "gradients all there (got master auto, optimizer device, grad auto)");
  o.overrides = {{"g*", Tier::kAuto, Tier::kHost, Tier::kHost, Tier::kHost}};
  PlanBudgets small_host{64 * kMiB, 30 * kMiB, 0, {}};
  EXPECT_EQ(refusal(m, small_host, o),
            "host: optimizer states 32.0 MiB + fp32 master 16.0 MiB + fp32 grad accumulator 16.0 MiB = 64.0 MiB "
            "needed by group overrides plus pinned buffers need 20.0 MiB (staging 0 B, gradient pieces 20.0 MiB) but "
            "the host budget is 30.0 MiB: 54.0 MiB short; raise the host budget or move groups to NVMe");
}

TEST(Planner, ConfigOffloadDevicesBecomeOverrides) {
  auto c = parse_config(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "cpu"},
      "offload_optimizer": {"device": "nvme", "nvme_path": "/n", "buffer_count": 3}},
      "gradient_accumulation_steps": 4,
      "strata": {"groups": [{"match": "g0", "compute": "device"}], "optimizer_state_dtype": "bf16"}})");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  PlanOptions o = plan_options_from_config(c.value());
  EXPECT_EQ(o.micro_batches, 4u);
  EXPECT_EQ(o.optimizer_ring_buffers, 3u);
  EXPECT_EQ(o.optimizer_state_dtype, DType::kBF16);
  ASSERT_EQ(o.overrides.size(), 2u);
  EXPECT_EQ(o.overrides[1], (GroupTierRule{"*", Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kAuto}));
  const ModelSpec m = uniform_model(2, 1 << 20);
  Plan p = plan_ok(m, PlanBudgets{4 * kGiB, 1 * kGiB, 0, {{"/n", 1 * kGiB}}}, o);
  EXPECT_EQ(p.groups[0].tier, (std::array<Tier, 4>{Tier::kDevice, Tier::kNvme, Tier::kNvme, Tier::kHost}));
  EXPECT_EQ(p.groups[1].tier, (std::array<Tier, 4>{Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kHost}));
}

TEST(Planner, ShardsAcrossRanks) {
  // 3 groups of 10000 bf16 elements over 4 ranks with alignment 2048: each
  // rank holds ceil(10000/4) = 2500 -> 4096 padded elements per group.
  ModelSpec m = uniform_model(3, 10000);
  m.world_size = 4;
  m.rank = 3;
  PlanOptions o = small_options();
  Plan p = plan_ok(m, PlanBudgets{1 * kGiB, 1 * kGiB, 0, {}}, o);
  EXPECT_EQ(p.shard_numel, 3u * 4096);
  EXPECT_EQ(p.groups[0].bytes[kC], 4096u * 2);
  EXPECT_EQ(p.groups[0].gathered_compute_bytes, 4096u * 4 * 2);
  // Gathering needs device buffers even when every shard is resident.
  EXPECT_EQ(p.device_buffers, 2u * 4096 * 4 * 2);
  EXPECT_EQ(p.bytes[kHost][kO], 3u * 4096 * 8);
  // Sent to the 3 other ranks per step: every upload's all-gather (the 3
  // groups fit in the device buffers: each is uploaded and gathered once per
  // step, backward's acquires find them gathered) and one fp32 gradient
  // reduce-scatter.
  EXPECT_EQ(p.forward_backward.comm, 3u * 3 * (4096 * 2 + 4096 * 4));
  EXPECT_EQ(p.optimizer_step.comm, 0u);
  Bandwidths bw{1e9, 1e9, 1e9, 1e9, 1e9, 1e12, 1e6};
  Workload w;
  w.tokens_per_micro_batch = 1;
  auto e = predict_step_time(p, bw, w);
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  EXPECT_DOUBLE_EQ(e->comm_s, p.forward_backward.comm / 1e6);
  EXPECT_EQ(e->bottleneck, "the link between ranks");
  bw.link = 0;
  EXPECT_FALSE(predict_step_time(p, bw, w).ok());  // bytes to send and no link

  // Stages 1-2: the compute copies stay whole (4 ranks x 4096 padded), so no
  // gathering buffers; per step one fp32 reduce-scatter per micro-batch
  // during backward and one all-gather of this rank's shard after the update.
  o.replicate_params = true;
  Plan r = plan_ok(m, PlanBudgets{1 * kGiB, 1 * kGiB, 0, {}}, o);
  EXPECT_EQ(r.groups[0].bytes[kC], 4u * 4096 * 2);
  EXPECT_EQ(r.groups[0].bytes[kO], 4096u * 8);
  EXPECT_EQ(r.device_buffers, 0u);
  EXPECT_EQ(r.forward_backward.comm, 3u * 3 * 4096 * 4);
  EXPECT_EQ(r.optimizer_step.comm, 3u * 3 * 4096 * 2);
  bw.link = 1e6;
  auto er = predict_step_time(r, bw, w);
  ASSERT_TRUE(er.ok()) << er.status().to_string();
  EXPECT_DOUBLE_EQ(er->step_comm_s, r.optimizer_step.comm / 1e6);
  EXPECT_GE(er->optimizer_step_s, er->step_comm_s);
  // Stage 1 with 3 micro-batches: each rank's whole fp32 gradient on the
  // device (3 x 10000 x 4 bytes, 256-aligned), one reduce-scatter and one
  // fp32 download of the shard per step instead of 3; stage 2 sends 3.
  o.micro_batches = 3;
  Plan s2 = plan_ok(m, PlanBudgets{1 * kGiB, 1 * kGiB, 0, {}}, o);
  EXPECT_EQ(s2.local_grad_bytes, 0u);
  EXPECT_EQ(s2.forward_backward.comm, 3u * 3 * 3 * 4096 * 4);
  o.defer_grad_reduce = true;
  Plan s1 = plan_ok(m, PlanBudgets{1 * kGiB, 1 * kGiB, 0, {}}, o);
  EXPECT_EQ(s1.local_grad_bytes, 3u * 40192);
  EXPECT_EQ(s1.forward_backward.comm, 3u * 3 * 4096 * 4);
  EXPECT_EQ(s1.forward_backward.d2h, 3u * 4096 * 4);
  EXPECT_EQ(s1.optimizer_step.comm, s2.optimizer_step.comm);
  // Stage 1 reduce-scatters from its own sums (no send buffers planned).
  EXPECT_EQ(s1.reduce_buffers, 0u);
  EXPECT_EQ(s1.device_total(), s2.device_total() - s2.reduce_buffers + s1.local_grad_bytes);
  EXPECT_NE(s1.report().find("stage-1 local grad"), std::string::npos);
  // A device budget without room for the sum is refused by name.
  auto small = make_plan(m, PlanBudgets{s1.options.device_reserve + 100000, 1 * kGiB, 0, {}}, o);
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("use stage 2"), std::string::npos) << small.status().message();
  o.defer_grad_reduce = false;
  o.micro_batches = 1;
  // Parameters on NVMe are refused with stages 1-2 (kept whole on every rank).
  o.overrides.push_back(GroupTierRule{"*", Tier::kNvme, Tier::kAuto, Tier::kAuto, Tier::kAuto});
  auto bad = make_plan(m, PlanBudgets{1 * kGiB, 1 * kGiB, 0, {{"/n", 1 * kGiB}}}, o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("use stage 3"), std::string::npos) << bad.status().message();
  // ... and so is an automatic placement that would need NVMe for them.
  o.overrides.clear();
  // (Host: 80 KiB and the gradient path's pinned pieces, 5 x 32 Ki fp32.)
  bad = make_plan(m, PlanBudgets{64 * 1024, 80 * 1024 + 5 * 32768 * 4, 0, {{"/n", 1 * kGiB}}}, o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("stage 1 or 2"), std::string::npos) << bad.status().message();
  m.world_size = 1;
  m.rank = 0;
  EXPECT_EQ(plan_ok(m, PlanBudgets{1 * kGiB, 1 * kGiB, 0, {}}, o).forward_backward.comm, 0u);
}

// N ranks, stages 2-3: the gradient path's send buffers hold the largest
// group's gradient pieces, so backward runs ahead of its reduce-scatters;
// fewer when the device budget is short, then one unstaged.
TEST(Planner, ReduceScatterSendBuffersHoldTheLargestGroup) {
  // Group "a": 3 x 300000 elements + 1 x 10 (a norm); "b": 1 x 100000. Over
  // 2 ranks the largest trainable shard is 150016 -> one piece of 163840
  // (a multiple of 32768): 4 pieces for "a", 1 for "b".
  ModelSpec m;
  for (int i = 0; i < 3; ++i) m.params.push_back(ParamSpec{"a" + std::to_string(i), {300000}, DType::kBF16, "a"});
  m.params.push_back(ParamSpec{"a_norm", {10}, DType::kBF16, "a"});
  m.params.push_back(ParamSpec{"b0", {100000}, DType::kBF16, "b"});
  m.world_size = 2;
  m.rank = 1;
  PlanOptions o = small_options();
  o.shard_alignment = 16;
  Plan p = plan_ok(m, PlanBudgets{1 * kGiB, 1 * kGiB, 0, {}}, o);
  const uint64_t piece = 163840;
  EXPECT_EQ(p.grad_piece_elems, piece);
  EXPECT_EQ(p.grad_pieces_wanted, 4u);
  EXPECT_TRUE(p.grad_staged);
  EXPECT_EQ(p.grad_pieces, 4u);
  EXPECT_EQ(p.reduce_buffers, (4 * 2 + 1) * piece * 4);
  EXPECT_NE(p.report().find("behind backward"), std::string::npos) << p.report();
  // Six pieces in "a": more than kGradPieces.
  for (int i = 3; i < 5; ++i) m.params.push_back(ParamSpec{"a" + std::to_string(i), {300000}, DType::kBF16, "a"});
  p = plan_ok(m, PlanBudgets{1 * kGiB, 1 * kGiB, 0, {}}, o);
  EXPECT_EQ(p.grad_pieces_wanted, 6u);
  EXPECT_EQ(p.grad_pieces, 6u);
  EXPECT_EQ(p.reduce_buffers, (6 * 2 + 1) * piece * 4);
  EXPECT_EQ(p.device_total(), p.tier_bytes(Tier::kDevice) + p.device_buffers + p.reduce_buffers);
  // A device budget with room for kGradPieces send buffers but not six.
  const uint64_t fixed = p.device_buffers;  // the gathered groups in use and prefetched
  p = plan_ok(m, PlanBudgets{fixed + (4 * 2 + 1) * piece * 4 + 1000, 1 * kGiB, 0, {}}, o);
  EXPECT_TRUE(p.grad_staged);
  EXPECT_EQ(p.grad_pieces, kGradPieces);
  EXPECT_NE(p.report().find("not the 6 of the largest group"), std::string::npos) << p.report();
  // Room for one unstaged send buffer only.
  p = plan_ok(m, PlanBudgets{fixed + 3 * piece * 4, 1 * kGiB, 0, {}}, o);
  EXPECT_FALSE(p.grad_staged);
  EXPECT_EQ(p.reduce_buffers, 3 * piece * 4);
  EXPECT_NE(p.report().find("from the caller's buffer"), std::string::npos) << p.report();
  // Not even that: refused by name.
  EXPECT_NE(refusal(m, PlanBudgets{fixed + 1000, 1 * kGiB, 0, {}}, o).find("reduce-scatter needs"), std::string::npos);
  // strata.gradient_staging false: unstaged at any budget.
  o.stage_reduce = false;
  p = plan_ok(m, PlanBudgets{1 * kGiB, 1 * kGiB, 0, {}}, o);
  EXPECT_FALSE(p.grad_staged);
  EXPECT_EQ(p.reduce_buffers, 3 * piece * 4);
  // One rank: no reduce-scatter, kGradPieces download pieces of up to 4 Mi elements.
  m.world_size = 1;
  m.rank = 0;
  o.stage_reduce = true;
  p = plan_ok(m, PlanBudgets{1 * kGiB, 1 * kGiB, 0, {}}, o);
  EXPECT_EQ(p.reduce_buffers, 0u);
  EXPECT_EQ(p.grad_pieces, kGradPieces);
  EXPECT_EQ(p.grad_piece_elems, 300000u / 32768 * 32768 + 32768);
  EXPECT_EQ(grad_piece_elems(100 << 20, 1), 4u << 20);
  EXPECT_EQ(grad_piece_elems(100 << 20, 3), (4u << 20) / 3 / 32768 * 32768 + 32768);
}

TEST(Planner, RejectsBadInput) {
  ModelSpec m = uniform_model(1, 10);
  m.rank = 1;
  EXPECT_EQ(refusal(m, PlanBudgets{}, PlanOptions{}, StatusCode::kInvalidArgument),
            "model: rank 1 is out of range for world_size 1");
  m = uniform_model(2, 10);
  m.params[1].name = "p0";
  EXPECT_EQ(refusal(m, PlanBudgets{}, PlanOptions{}, StatusCode::kInvalidArgument),
            "model: parameter p0 is listed twice");
  m = uniform_model(1, 10);
  m.params[0].shape = {10, 0};
  EXPECT_EQ(refusal(m, PlanBudgets{}, PlanOptions{}, StatusCode::kInvalidArgument),
            "model: parameter p0 has a zero dimension");
}

// ------------------------------------------------------------------ 70B

// Llama-3-70B shape: 80 layers, dim 8192, 64 query / 8 KV heads (head dim
// 128, so K and V project to 1024), FFN 28672, vocab 128256, untied head.
constexpr uint64_t kEmbed = 128256ull * 8192;                        // 1,050,673,152
constexpr uint64_t kAttn = 2 * 8192ull * 8192 + 2 * 1024ull * 8192;  // q, o + k, v
constexpr uint64_t kMlp = 3 * 28672ull * 8192;
constexpr uint64_t kLayer = kAttn + kMlp + 2 * 8192;  // + two RMSNorm weights
constexpr uint64_t kHead = kEmbed + 8192;             // lm_head + final norm
constexpr uint64_t kTotal = kEmbed + 80 * kLayer + kHead;

TEST(Planner70B, ParameterCount) {
  static_assert(kLayer == 855654400);
  static_assert(kTotal == 70553706496ull);
  auto m = llama_model_spec({80, 8192, 64, 8, 28672, 128256});
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->numel(), kTotal);
  EXPECT_EQ(m->params.size(), 1u + 80 * 9 + 2);
  EXPECT_EQ(m->group_names().size(), 82u);
}

TEST(Planner70B, On24GiBGpu64GiBHost2TBNvme) {
  auto m = llama_model_spec({80, 8192, 64, 8, 28672, 128256});
  ASSERT_TRUE(m.ok());
  const PlanBudgets b{24 * kGiB, 64 * kGiB, 0, {{"/nvme", 2000000000000ull}}};
  const PlanOptions o;  // defaults: 2 GiB reserve, prefetch depth 2, 4 x 16 Mi-element ring, fp32 states
  auto r = make_plan(m.value(), b, o);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const Plan& p = r.value();

  // Every shape is a multiple of 2048 elements: no padding, 18 bytes/param.
  EXPECT_EQ(p.shard_numel, kTotal);
  uint64_t all = 0;
  for (int t : {kDev, kHost, kNvme})
    for (int k : {kC, kM, kO, kG}) all += p.bytes[t][k];
  EXPECT_EQ(all, 18 * kTotal);
  EXPECT_EQ(p.bytes[kDev][kC] + p.bytes[kHost][kC] + p.bytes[kNvme][kC], 2 * kTotal);

  // Device: 22 GiB usable. Buffers: 3 x the largest group (head, 2 x kHead B).
  const uint64_t usable = 22 * kGiB;
  EXPECT_EQ(p.device_buffers, 3 * 2 * kHead);
  // First fit in order: embed, then as many 2 x kLayer layers as fit: 8.
  const uint64_t dev_free = usable - 3 * 2 * kHead - 2 * kEmbed;
  ASSERT_EQ(dev_free / (2 * kLayer), 8u);
  EXPECT_EQ(p.bytes[kDev][kC], 2 * kEmbed + 8 * 2 * kLayer);
  EXPECT_EQ(p.groups[0].tier[kC], Tier::kDevice);
  EXPECT_EQ(p.groups[8].tier[kC], Tier::kDevice);  // layers.7
  EXPECT_NE(p.groups[9].tier[kC], Tier::kDevice);  // layers.8

  // Host: 64 GiB - staging (3 x the head) - the worst-case ring
  // (4 x 16 Mi x 20 B) holds 35 more layers' compute copies (compute copies
  // come first); nothing else fits in what remains: the smallest other item
  // is the head's compute copy (2 x kHead B), then a layer's gradient.
  const uint64_t staging = 3 * 2 * kHead;
  const uint64_t worst_ring = 4ull * (16 << 20) * 20;
  const uint64_t host_free = 64 * kGiB - staging - worst_ring;
  ASSERT_EQ(host_free / (2 * kLayer), 35u);
  ASSERT_LT(host_free - 35 * 2 * kLayer, 2 * kHead);
  EXPECT_EQ(p.staging_ring, staging);
  EXPECT_EQ(p.bytes[kHost][kC], 35 * 2 * kLayer);
  EXPECT_EQ(p.bytes[kHost][kM] + p.bytes[kHost][kO] + p.bytes[kHost][kG], 0u);
  EXPECT_EQ(p.groups[43].tier[kC], Tier::kHost);  // layers.42
  EXPECT_EQ(p.groups[44].tier[kC], Tier::kNvme);  // layers.43

  // NVMe: 37 layers' + the head's compute copies, and all of master,
  // optimizer states and gradients.
  const uint64_t nvme_compute = 37 * 2 * kLayer + 2 * kHead;
  EXPECT_EQ(p.bytes[kNvme][kC], nvme_compute);
  EXPECT_EQ(p.bytes[kNvme][kM], 4 * kTotal);
  EXPECT_EQ(p.bytes[kNvme][kO], 8 * kTotal);
  EXPECT_EQ(p.bytes[kNvme][kG], 4 * kTotal);
  EXPECT_EQ(p.nvme_total(), nvme_compute + 16 * kTotal);
  EXPECT_EQ(p.nvme_total(), 1194279092224ull);
  // The ring as placed: 18 B per element (master, states, grad, bf16 copy).
  EXPECT_EQ(p.optimizer_chunk_bytes, (16ull << 20) * 18);
  EXPECT_EQ(p.optimizer_ring, 4 * (16ull << 20) * 18);

  // Per step, one micro-batch: off-device copies up twice (NVMe ones read
  // twice) but for the last groups of forward, still in the device slots
  // when backward starts (the head and the last layers: all NVMe-homed);
  // bf16 grads down, fp32 grads written during backward and read by the
  // step, master+states read and written, updated copies to the device and
  // to NVMe.
  const uint64_t host_compute = 35 * 2 * kLayer;
  const uint64_t room = b.device_bytes - p.bytes[kDev][kC] - p.device_buffers;
  const uint64_t slots = p.held_groups + p.prefetch_groups + (room >= 2 * kHead ? 1 : 0);
  ASSERT_GE(slots, 3u);
  const uint64_t hits = 2 * kHead + (slots - 1) * 2 * kLayer;
  EXPECT_EQ(p.forward_backward.h2d, 2 * (host_compute + nvme_compute) - hits);
  EXPECT_EQ(p.forward_backward.nvme_read, 2 * nvme_compute - hits);
  EXPECT_EQ(p.forward_backward.d2h, 2 * kTotal);
  EXPECT_EQ(p.forward_backward.nvme_write, 4 * kTotal);
  EXPECT_EQ(p.optimizer_step.nvme_read, 4 * kTotal + 12 * kTotal);
  EXPECT_EQ(p.optimizer_step.nvme_write, 12 * kTotal + nvme_compute);
  EXPECT_EQ(p.optimizer_step.h2d, 2 * kEmbed + 8 * 2 * kLayer);

  const std::string report = p.report();
  EXPECT_NE(report.find("embed .. layers.7 (9 groups)"), std::string::npos) << report;
  EXPECT_NE(report.find("layers.8 .. layers.42 (35 groups)"), std::string::npos) << report;
  EXPECT_NE(report.find("70.6 B parameters"), std::string::npos) << report;

  // 1 TB is not enough: say how much is missing and what bf16 states would save.
  PlanBudgets small = b;
  small.nvme[0].capacity = 1000000000000ull;
  auto refused = make_plan(m.value(), small, o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfBudget);
  EXPECT_EQ(refused.status().message(),
            "NVMe: optimizer states 525.7 GiB + fp32 master 262.8 GiB + fp32 grad accumulator 262.8 GiB + compute copy "
            "60.9 GiB = 1.1 TiB needed but /nvme has 931.3 GiB free: 180.9 GiB short; add a directory or use bf16 "
            "optimizer states (saves 262.8 GiB)");
}

// Compute counts attention (it grows with the sequence: a long-context
// fine-tune is not 8 x params per token) and not the input embedding of an
// untied model (a lookup, no matmul). Llama-3-8B's shape, counted by hand.
TEST(Planner, ComputeCountsAttentionAndNotTheEmbeddingLookup) {
  auto m = llama_model_spec({32, 4096, 32, 8, 14336, 128256});
  ASSERT_TRUE(m.ok());
  auto r = make_plan(m.value(), PlanBudgets{80 * kGiB, 256 * kGiB, 0, {}}, PlanOptions{});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const Plan& p = r.value();
  const double numel = static_cast<double>(p.model_numel);
  const double embed = 128256.0 * 4096;
  // Per layer and token, forward: q.k over (seq+1)/2 keys and the weighted
  // sum of as many values, 2 FLOP per multiply-add, 32 heads x 128.
  for (uint64_t seq : {2048ull, 4096ull, 32768ull}) {
    const double attn = 32 * 2.0 * (2.0 * (seq + 1) / 2.0) * 32 * 128;
    EXPECT_DOUBLE_EQ(attention_forward_flops_per_token(32, 32, 128, seq), attn) << seq;
  }
  Bandwidths bw{25e9, 25e9, 12e9, 6e9, 2e9, 400e12, 0};
  Workload w;
  w.tokens_per_micro_batch = 4096;
  const double before = flops_per_token(p, w);
  EXPECT_DOUBLE_EQ(before, 8.0 * numel);  // nothing set: every parameter a matmul weight
  w.attention_forward_flops_per_token = attention_forward_flops_per_token(32, 32, 128, 4096);
  w.non_matmul_params = 128256ull * 4096;
  const double attn = w.attention_forward_flops_per_token;
  EXPECT_DOUBLE_EQ(flops_per_token(p, w), 4.0 * (2.0 * (numel - embed) + attn));
  auto e = predict_step_time(p, bw, w);
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  EXPECT_NEAR(e->compute_s, 4.0 * (2.0 * (numel - embed) + attn) * 4096 / 400e12, 1e-12);
  // At 4096 tokens attention is ~7% of the matmuls; at 32768 more than half.
  EXPECT_NEAR(attn / (2.0 * (numel - embed)), 0.072, 0.005);
  EXPECT_GT(attention_forward_flops_per_token(32, 32, 128, 32768) / (2.0 * (numel - embed)), 0.5);
  // Without recompute: 3 forward units instead of 4.
  w.activation_checkpointing = false;
  EXPECT_DOUBLE_EQ(flops_per_token(p, w), 3.0 * (2.0 * (numel - embed) + attn));
}

// LoRA (a frozen base, rank-16 adapters on q_proj and v_proj, as `strata
// plan --lora-rank 16`): the base has no master, moments or gradient, so
// nothing of it is downloaded, updated or uploaded again, and its backward
// computes no weight gradient (6 FLOP per weight and token, not 8).
TEST(Planner, LoraMovesAndUpdatesOnlyTheAdapters) {
  LlamaShape shape{32, 4096, 32, 8, 14336, 128256};
  shape.lora_rank = 16;
  shape.lora_targets = (1u << lora_target_index(kQProj)) | (1u << lora_target_index(kVProj));
  shape.lora_dtype = DType::kF32;
  auto m = llama_model_spec(shape);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  uint64_t trainable = 0, frozen = 0;
  for (ParamSpec& p : m->params) {
    p.trainable = p.name.find(".lora_") != std::string::npos;
    (p.trainable ? trainable : frozen) += p.numel();
  }
  // Per layer: q's A [16, 4096] and B [4096, 16], v's A [16, 4096] and B [1024, 16].
  EXPECT_EQ(trainable, 32u * 16 * (4096 + 4096 + 4096 + 1024));
  auto r = make_plan(m.value(), PlanBudgets{24 * kGiB, 64 * kGiB, 0, {}}, PlanOptions{});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const Plan& p = r.value();
  EXPECT_EQ(p.cpu_optimizer_numel + p.gpu_optimizer_numel, trainable);
  uint64_t masters = 0, adapter_compute = 0;
  for (const GroupPlan& g : p.groups) {
    masters += g.bytes[kM];
    adapter_compute += g.trainable_compute_bytes;
  }
  EXPECT_EQ(masters, 4 * trainable);
  EXPECT_EQ(adapter_compute, 4 * trainable);  // fp32 adapters
  // The base's bf16 copies (16 GB) fit the device: uploaded never, so only
  // the adapters' gradients come down (in their fp32 compute dtype) and only
  // their updated copies go up.
  EXPECT_EQ(p.forward_backward.h2d, 0u);
  EXPECT_EQ(p.forward_backward.d2h, 4 * trainable);
  EXPECT_EQ(p.optimizer_step.h2d, 4 * trainable);
  Workload w;
  w.tokens_per_micro_batch = 4096;
  w.non_matmul_params = 128256ull * 4096;
  const double full = flops_per_token(p, w);
  w.frozen_matmul_params = frozen - w.non_matmul_params;
  EXPECT_DOUBLE_EQ(flops_per_token(p, w), full - 2.0 * static_cast<double>(frozen - w.non_matmul_params));
  w.activation_checkpointing = false;
  const double m_all = static_cast<double>(p.model_numel - w.non_matmul_params);
  EXPECT_DOUBLE_EQ(flops_per_token(p, w), 6.0 * m_all - 2.0 * static_cast<double>(frozen - w.non_matmul_params));
}

// Llama-3-70B on a 24 GiB GPU, 64 GiB host and 2 TB of NVMe, default options.
Result<Plan> plan_70b() {
  auto m = llama_model_spec({80, 8192, 64, 8, 28672, 128256});
  if (!m.ok()) return m.status();
  return make_plan(m.value(), PlanBudgets{24 * kGiB, 64 * kGiB, 0, {{"/nvme", 2000000000000ull}}}, PlanOptions{});
}

TEST(Planner70B, PredictedStepTime) {
  auto r = plan_70b();
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const Plan& p = r.value();
  Bandwidths bw;
  bw.h2d = 25e9;
  bw.d2h = 25e9;
  bw.nvme_read = 12e9;
  bw.nvme_write = 6e9;
  bw.cpu_optimizer_params_per_s = 2e9;
  bw.gpu_flops = 300e12;
  Workload w;
  w.tokens_per_micro_batch = 8192;
  auto e = predict_step_time(p, bw, w);
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  const double T = static_cast<double>(kTotal);
  EXPECT_NEAR(e->compute_s, 8.0 * T * 8192 / 300e12, 1e-9);
  EXPECT_NEAR(e->nvme_fb_s,
              static_cast<double>(p.forward_backward.nvme_read) / 12e9 +
                  static_cast<double>(p.forward_backward.nvme_write) / 6e9,
              1e-9);
  EXPECT_NEAR(
      e->nvme_step_s,
      static_cast<double>(p.optimizer_step.nvme_read) / 12e9 + static_cast<double>(p.optimizer_step.nvme_write) / 6e9,
      1e-9);
  EXPECT_NEAR(e->cpu_optimizer_s, T / 2e9, 1e-9);
  EXPECT_NEAR(e->pipeline_fill_s, (16 << 20) * 18.0 / 12e9 + (16 << 20) * 18.0 / 6e9, 1e-12);
  EXPECT_NEAR(e->optimizer_step_s, e->nvme_step_s + e->pipeline_fill_s, 1e-9);  // NVMe-bound
  EXPECT_NEAR(e->total_s, e->forward_backward_s + e->optimizer_step_s, 1e-9);
  EXPECT_EQ(e->bottleneck, "NVMe (optimizer step)");
  EXPECT_NE(e->report().find("bottleneck: NVMe (optimizer step)"), std::string::npos);

  // Forward and backward keep the drives busy all along here (bound by NVMe),
  // and the step waits for them too: no part of it hides under either.
  EXPECT_EQ(e->forward_backward_s, e->nvme_fb_s);
  for (bool overlap : {true, false}) {
    Workload h = w;
    h.overlap_backward = overlap;
    h.pipelined_step = !overlap;
    auto none = predict_step_time(p, bw, h);
    ASSERT_TRUE(none.ok());
    EXPECT_EQ(none->overlap_saved_s + none->pipelined_saved_s, 0.0) << overlap;
  }
  // A GPU 20x slower: compute-bound forward and backward, the drives idle for
  // part of them.
  bw.gpu_flops = 15e12;
  e = predict_step_time(p, bw, w);
  ASSERT_TRUE(e.ok());
  // Overlap with backward hides at most the last backward (6/8 of compute here,
  // one micro-batch), and of it only the share in which forward and backward
  // leave the drives idle (this step waits for NVMe).
  const double idle = 1.0 - std::min(1.0, e->nvme_fb_s / e->forward_backward_s);
  ASSERT_GT(idle, 0.0);
  ASSERT_LT(idle, 1.0);
  w.overlap_backward = true;
  auto o = predict_step_time(p, bw, w);
  ASSERT_TRUE(o.ok());
  EXPECT_NEAR(o->overlap_saved_s, std::min(o->forward_backward_s * 0.75 * idle, o->optimizer_step_s), 1e-9);
  EXPECT_NEAR(o->total_s, e->total_s - o->overlap_saved_s, 1e-9);

  // A pipelined step hides at most the next forward (2/8 of a micro-batch
  // with recompute), and not with overlap_backward.
  w.pipelined_step = true;
  auto both = predict_step_time(p, bw, w);
  ASSERT_TRUE(both.ok());
  EXPECT_EQ(both->pipelined_saved_s, 0.0);
  w.overlap_backward = false;
  auto pl = predict_step_time(p, bw, w);
  ASSERT_TRUE(pl.ok());
  // Every group is queued; the first group's update is waited for by the
  // next forward's first acquire, the rest can hide.
  uint64_t all = 0;
  for (const GroupPlan& g : p.groups) all += g.trainable_shard_numel;
  const uint64_t queued = all - p.groups.front().trainable_shard_numel;
  ASSERT_GT(queued, 0u);
  EXPECT_NEAR(pl->pipelined_saved_s,
              std::min(pl->forward_backward_s * 0.25 * idle, pl->optimizer_step_s * double(queued) / double(all)),
              1e-9);
  EXPECT_GT(pl->pipelined_saved_s, 0.0);
  EXPECT_NEAR(pl->total_s, e->total_s - pl->pipelined_saved_s, 1e-9);
  EXPECT_NE(pl->report().find("hidden under the next forward"), std::string::npos);
  w.overlap_backward = true;
  w.pipelined_step = false;

  bw.nvme_read = 0;
  auto bad = predict_step_time(p, bw, w);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "step time: the plan moves data over NVMe read but its bandwidth is not positive");
}

// The host backend (Workload::shared_cores): copies and the CPU update take
// the cores that compute, so the copies add to compute, the update to the
// step's NVMe time, and nothing of the step hides.
TEST(Planner70B, SharedCoresAddCopiesAndTheUpdateToCompute) {
  auto r = plan_70b();
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const Plan& p = r.value();
  ASSERT_GT(p.forward_backward.h2d, 0u);
  ASSERT_GT(p.forward_backward.d2h, 0u);
  Bandwidths bw{8e9, 8e9, 12e9, 6e9, 2e9, 1e12, 0};
  Workload w;
  w.tokens_per_micro_batch = 8192;
  w.pipelined_step = true;
  auto gpu = predict_step_time(p, bw, w);
  ASSERT_TRUE(gpu.ok());
  EXPECT_GT(gpu->pipelined_saved_s, 0.0);
  w.shared_cores = true;
  auto cpu = predict_step_time(p, bw, w);
  ASSERT_TRUE(cpu.ok()) << cpu.status().to_string();
  EXPECT_EQ(cpu->compute_s, gpu->compute_s);
  EXPECT_EQ(cpu->h2d_s, gpu->h2d_s);
  EXPECT_NEAR(cpu->forward_backward_s, std::max(cpu->compute_s + cpu->h2d_s + cpu->d2h_s, cpu->nvme_fb_s), 1e-9);
  EXPECT_GT(cpu->forward_backward_s, gpu->forward_backward_s);
  const double cores = cpu->cpu_optimizer_s + cpu->step_h2d_s;
  EXPECT_NEAR(cpu->optimizer_step_s, std::max(cpu->nvme_step_s, cores) + cpu->pipeline_fill_s, 1e-9);
  EXPECT_EQ(cpu->pipelined_saved_s, 0.0);
  EXPECT_NEAR(cpu->total_s, cpu->forward_backward_s + cpu->optimizer_step_s, 1e-9);
  EXPECT_NE(cpu->report().find("CPU compute"), std::string::npos);
  EXPECT_NE(cpu->report().find("take the cores that compute"), std::string::npos);
  EXPECT_EQ(gpu->report().find("take the cores that compute"), std::string::npos);

  // An update slower than the NVMe traffic sets the step; overlap_backward
  // hides nothing either.
  bw.cpu_optimizer_params_per_s = 1e6;
  w.overlap_backward = true;
  w.pipelined_step = false;
  auto slow = predict_step_time(p, bw, w);
  ASSERT_TRUE(slow.ok());
  EXPECT_NEAR(slow->optimizer_step_s, slow->cpu_optimizer_s + slow->step_h2d_s + slow->pipeline_fill_s, 1e-6);
  EXPECT_EQ(slow->overlap_saved_s, 0.0);
  EXPECT_EQ(slow->bottleneck, "CPU optimizer");
}

// Hugging Face Trainer's no-decay rule (get_decay_parameter_names' patterns).
TEST(ModelSpec, HfNoDecayNames) {
  for (const char* n : {"model.layers.0.input_layernorm.weight", "model.layers.3.post_attention_layernorm.weight",
                        "model.norm.weight", "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_norm.weight",
                        "norm", "encoder.LayerNorm.weight", "model.layers.1.RMSNorm.weight"})
    EXPECT_TRUE(hf_no_decay(n)) << n;
  for (const char* n : {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
                        "model.layers.0.mlp.down_proj.weight", "model.normalizer.weight", "abnorm.weight"})
    EXPECT_FALSE(hf_no_decay(n)) << n;
}

}  // namespace
}  // namespace strata
