// The engine with N ranks (ZeRO stages 1, 2 and 3 over the MPI communicator),
// under mpirun: every rank runs an N-rank engine and, beside it, a 1-rank engine
// that takes the N ranks' micro-batches as N accumulated micro-batches (rank
// order). runtime/engine.h promises they are bit-identical while clipping
// does not engage:
//   - acquire() gives exactly the 1-rank compute copies (every element):
//     gathered there (stage 3), or whole replicas all-gathered after each
//     step (stages 1-2);
//   - the gradients here are computed from what acquire() returned, so a
//     wrong gather changes every later step;
//   - after the steps, gather_param() equals the 1-rank read_param() and this
//     rank's optimizer states equal its slice of the 1-rank states;
//   - per-rank bytes are 1/N of the 1-rank run's (padded shards; stages 1-2
//     keep the compute copy whole), and the bytes communicated are exactly
//     the stage's volume;
//   - with clipping on, the norm agrees to 1e-12 (rank-order partial sums);
//   - a checkpoint saved by N ranks resumes identically, reshards to 1 rank
//     (exactly the gathered state) and back to N; a save some rank cannot
//     write is committed by nobody.
// The parameters have sizes that do not divide by 2 or 3, one smaller than
// the shard alignment (later ranks own none of it), on host and NVMe tiers
// (stages 1-2: the compute copies on the host, the rest on NVMe).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_comm.h"
#include "common/float_convert.h"
#include "device/host_backend.h"
#include "runtime/engine.h"
#include "test_util/det_random.h"
#include "test_util/mpi_world.h"

namespace strata {
namespace {

struct World {
  std::unique_ptr<DeviceBackend> dev;
  std::unique_ptr<comm::Communicator> comm;
  std::string dir;  // shared by all ranks (rank 0's temp dir, broadcast)
};
World* g_world = nullptr;

float rnd(uint64_t seed, uint64_t i) { return testing::det_uniform(seed, i); }

ModelSpec make_model() {
  ModelSpec m;
  m.params.push_back({"a.weight", {41, 25}, DType::kBF16, "a"});  // 1025
  m.params.push_back({"a.bias", {37}, DType::kBF16, "a"});
  m.params.push_back({"b.weight", {4099}, DType::kBF16, "b"});
  m.params.push_back({"c.weight", {3, 2}, DType::kBF16, "c"});
  m.params.push_back({"c.bias", {5}, DType::kBF16, "c"});
  // Group c has 6 parameters, so 6 gradient pieces: more than kGradPieces.
  m.params.push_back({"c.u", {600}, DType::kBF16, "c"});
  m.params.push_back({"c.v", {7}, DType::kBF16, "c"});
  m.params.push_back({"c.w", {1100}, DType::kBF16, "c"});
  m.params.push_back({"c.x", {3}, DType::kBF16, "c"});
  return m;
}

// Bytes this rank sends in one all-gather of every parameter (bf16 compute
// copies) and in one reduce-scatter of every gradient (fp32): (N-1)/N of
// each padded buffer.
std::pair<uint64_t, uint64_t> sent_per_collective(int world, int rank) {
  uint64_t gather = 0, scatter = 0;
  for (const auto& p : make_model().params) {
    const ShardRange sh = shard_range(p.numel(), world, rank, 512);
    gather += sh.padded * 2 * (world - 1);
    scatter += sh.padded * 4 * (world - 1);
  }
  return {gather, scatter};
}

enum class Place { kHost, kNvme };
struct Case {
  Place place;
  int stage;
  // The gradients handed to reduce_grad live in the backend's memory (as the
  // trainer's and every CUDA caller's do: the engine packs them with the
  // backend's kernels, the GPU path), not in a plain host vector (a host
  // function reads those).
  bool backend_grads = false;
};

void PrintTo(const Case& k, std::ostream* os) {
  *os << (k.place == Place::kHost ? "host" : "nvme") << ", stage " << k.stage
      << (k.backend_grads ? ", backend gradients" : "");
}

Config make_config(Case k, const std::string& nvme, double clip) {
  Config c;
  c.optimizer.type = OptimizerType::kAdamW;
  c.optimizer.lr = 1e-2;
  c.optimizer.weight_decay = 0.01;
  c.gradient_clipping = clip;
  c.zero.stage = k.stage;
  c.zero.stage_given = true;
  c.strata.device_reserve = 1 << 20;
  c.strata.optimizer_chunk = 2048;
  c.strata.shard_alignment = 512;  // 4099 / 3 ranks: shards of 1536
  const Tier t = k.place == Place::kHost ? Tier::kHost : Tier::kNvme;
  // Stages 1-2 keep parameters whole on every rank, never on NVMe.
  c.strata.groups.push_back(GroupTierRule{"*", k.stage == 3 ? t : Tier::kHost, t, t, t});
  if (!nvme.empty()) c.strata.nvme.push_back(NvmeDir{nvme, 0});
  return c;
}

// A run's engine with its stream and gradient buffers.
struct RankRun {
  DeviceBackend* dev = nullptr;
  std::unique_ptr<DeviceBackend> own;
  DeviceStream* s = nullptr;
  std::unique_ptr<Engine> e;
  std::vector<std::vector<float>> grad;
  std::vector<float*> dev_grad;  // backend_grads: each parameter's gradient in backend memory

  Status create(const Config& cfg, comm::Communicator* c, bool backend_grads = false) {
    if (c != nullptr) {
      dev = c->device();
    } else {
      STRATA_ASSIGN_OR_RETURN(own, create_host_backend({.budget_bytes = 256ull << 20}));
      dev = own.get();
    }
    EngineOptions eo;
    eo.config = cfg;
    eo.model = make_model();
    eo.device = dev;
    eo.comm = c;
    STRATA_ASSIGN_OR_RETURN(e, Engine::create(eo));
    STRATA_ASSIGN_OR_RETURN(s, dev->create_stream("test"));
    for (const auto& p : eo.model.params) {
      std::vector<float> init(p.numel());
      for (size_t i = 0; i < init.size(); ++i) init[i] = 0.3f * rnd(7 + grad.size(), i);
      STRATA_RETURN_IF_ERROR(e->load_param(static_cast<ParamId>(grad.size()), init.data(), DType::kF32));
      grad.emplace_back(p.numel());
      if (backend_grads) {
        STRATA_ASSIGN_OR_RETURN(void* b, dev->alloc(p.numel() * 4));
        dev_grad.push_back(static_cast<float*>(b));
      }
    }
    return {};
  }
  ~RankRun() {
    e.reset();
    for (float* b : dev_grad) (void)dev->free(b);
    if (s) (void)dev->destroy_stream(s);
  }

  // One micro-batch "of rank `who`": every group acquired in order, its
  // gradients computed from the gathered weights, reduced, released. The
  // gathered weights of every acquire are appended to `seen`. `dyadic`:
  // gradients that are multiples of 1/64 in [-1, 1] instead (any sum of a
  // few of them is exact in fp32, whatever the order).
  // `order`: the groups in that order instead of 0, 1, 2.
  // `shared`: one gradient buffer for every parameter (backend memory when
  // dev_grad is, else host memory), overwritten with NaN as soon as the
  // stream has passed each reduce_grad. `gate(g, before)`: called before and
  // after group g's reduce_grads.
  // With `forward` set, every group is first acquired in order (its weights
  // appended to `seen`) and released, and the pass above then runs in the
  // reverse order: a trainer's forward and backward (two acquires per
  // micro-batch, as the planner counts them).
  bool forward = false;
  Status micro_batch(int step, int who, bool last, std::vector<std::vector<uint16_t>>* seen, bool dyadic = false,
                     const std::vector<GroupId>* order = nullptr, float* shared = nullptr,
                     const std::function<Status(GroupId, bool)>& gate = {}) {
    STRATA_RETURN_IF_ERROR(e->begin_micro_batch(last));
    const GroupId groups = e->group_count();
    for (GroupId k = 0; forward && k < groups; ++k) {
      const GroupId g = order ? (*order)[k] : k;
      STRATA_ASSIGN_OR_RETURN(GroupView v, e->acquire(g, s));
      STRATA_RETURN_IF_ERROR(dev->synchronize(s));
      for (size_t i = 0; i < v.params.size(); ++i) {
        const auto* w = static_cast<const uint16_t*>(v.ptr[i]);
        if (seen) seen->emplace_back(w, w + grad[v.params[i]].size());
      }
      STRATA_RETURN_IF_ERROR(e->release(g, s));
    }
    for (GroupId j = 0; j < groups; ++j) {
      const GroupId k = forward ? groups - 1 - j : j;
      const GroupId g = order ? (*order)[k] : k;
      STRATA_ASSIGN_OR_RETURN(GroupView v, e->acquire(g, s));
      STRATA_RETURN_IF_ERROR(dev->synchronize(s));
      if (gate) STRATA_RETURN_IF_ERROR(gate(g, true));
      for (size_t i = 0; i < v.params.size(); ++i) {
        const ParamId p = v.params[i];
        auto& gr = grad[p];
        const auto* w = static_cast<const uint16_t*>(v.ptr[i]);
        if (seen) seen->emplace_back(w, w + gr.size());
        for (size_t k = 0; k < gr.size(); ++k)
          gr[k] = dyadic ? std::round(64.0f * rnd(1000 * step + 10 * who + p, k)) / 64.0f
                         : 0.5f * bf16_bits_to_f32(w[k]) + rnd(1000 * step + 10 * who + p, k);
        float* src = shared ? shared : dev_grad.empty() ? gr.data() : dev_grad[p];
        if (src != gr.data()) std::memcpy(src, gr.data(), gr.size() * 4);  // host backend memory is RAM
        STRATA_RETURN_IF_ERROR(e->reduce_grad(p, src, DType::kF32, s));
        if (shared) {  // the caller's buffer is free once the stream passed reduce_grad
          STRATA_RETURN_IF_ERROR(dev->synchronize(s));
          std::fill(shared, shared + gr.size(), std::nanf(""));
        }
      }
      if (gate) STRATA_RETURN_IF_ERROR(gate(g, false));
      STRATA_RETURN_IF_ERROR(e->release(g, s));
    }
    return dev->synchronize(s);
  }
};

class EngineMpi : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    comm_ = g_world->comm.get();
    rank_ = comm_->rank();
    world_ = comm_->world_size();
    base_ = g_world->dir + "/" + std::to_string(counter_++);  // the same on every rank
    if (rank_ == 0) std::filesystem::create_directories(base_);
    barrier();
  }
  void barrier() {
    auto s = g_world->dev->create_stream("barrier");
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE(comm_->barrier(*s).ok());
    ASSERT_TRUE(g_world->dev->synchronize(*s).ok());
    ASSERT_TRUE(g_world->dev->destroy_stream(*s).ok());
  }
  // The N-rank run (swap dir shared by the ranks) and this process's 1-rank
  // reference (its own swap dir).
  void create_pair(RankRun& multi, RankRun& ref, double clip = 0) {
    Status s = multi.create(config(clip, "multi"), comm_, GetParam().backend_grads);
    ASSERT_TRUE(s.ok()) << s.to_string();
    s = ref.create(config(clip, "ref" + std::to_string(rank_)), nullptr, GetParam().backend_grads);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  // Both runs two steps, then the N-rank one saves base_/ck.
  std::string train_and_save(RankRun& multi, RankRun& ref) {
    create_pair(multi, ref);
    compare(multi, ref, 0, 2, 0);
    const std::string ck = base_ + "/ck";
    Status s = multi.e->save_checkpoint(ck, R"({"who":"test"})");
    EXPECT_TRUE(s.ok()) << s.to_string();
    return ck;
  }
  Config config(double clip, const std::string& sub) {
    return make_config(GetParam(), GetParam().place == Place::kNvme ? base_ + "/" + sub : "", clip);
  }
  // N ranks vs 1 rank over `steps` steps; true when every gathered weight and
  // step result matched (clip 0: bit for bit).
  void compare(RankRun& multi, RankRun& ref, int first_step, int steps, double clip) {
    for (int st = first_step; st < first_step + steps; ++st) {
      std::vector<std::vector<uint16_t>> mine, want;
      Status mb = multi.micro_batch(st, rank_, true, &mine);
      ASSERT_TRUE(mb.ok()) << mb.to_string();
      for (int m = 0; m < world_; ++m) {
        Status s = ref.micro_batch(st, m, m == world_ - 1, m == 0 ? &want : nullptr);
        ASSERT_TRUE(s.ok()) << s.to_string();
      }
      ASSERT_EQ(mine.size(), want.size());
      for (size_t i = 0; i < mine.size(); ++i) ASSERT_EQ(mine[i], want[i]) << "step " << st << " acquire " << i;
      auto a = multi.e->step();
      auto b = ref.e->step();
      ASSERT_TRUE(a.ok()) << a.status().to_string();
      ASSERT_TRUE(b.ok()) << b.status().to_string();
      if (clip == 0) {
        EXPECT_EQ(a->clip_coef, 1.0);
        EXPECT_NEAR(a->grad_norm, b->grad_norm, 1e-12 * b->grad_norm);
      } else {
        EXPECT_LT(a->clip_coef, 1.0);  // engaged
        EXPECT_NEAR(a->clip_coef, b->clip_coef, 1e-12);
      }
      EXPECT_EQ(a->skipped, b->skipped);
    }
  }
  void expect_weights(RankRun& multi, RankRun& ref, double tol) {
    const ModelSpec spec = make_model();
    for (ParamId p = 0; p < spec.params.size(); ++p) {
      const uint64_t n = spec.params[p].numel();
      std::vector<float> got(n), want(n);
      ASSERT_TRUE(multi.e->gather_param(p, got.data(), DType::kF32).ok());
      ASSERT_TRUE(ref.e->read_param(p, want.data(), DType::kF32).ok());
      for (uint64_t i = 0; i < n; ++i) {
        if (tol == 0) {
          ASSERT_EQ(got[i], want[i]) << spec.params[p].name << "[" << i << "]";
        } else {
          ASSERT_NEAR(got[i], want[i], tol) << spec.params[p].name << "[" << i << "]";
        }
      }
      // This rank's slice of the optimizer states.
      const ShardRange sh = shard_range(n, world_, rank_, 512);
      std::vector<float> ms(sh.size()), mr(n);
      for (int k = 0; k < 2; ++k) {
        Status st = multi.e->read_state(p, k, ms.data());
        ASSERT_TRUE(st.ok()) << st.to_string();
        ASSERT_TRUE(ref.e->read_state(p, k, mr.data()).ok());
        for (uint64_t i = 0; i < sh.size(); ++i) {
          if (tol == 0) {
            ASSERT_EQ(ms[i], mr[sh.begin + i]) << spec.params[p].name << " state " << k << "[" << i << "]";
          } else {
            ASSERT_NEAR(ms[i], mr[sh.begin + i], tol) << spec.params[p].name << " state " << k;
          }
        }
      }
    }
  }

  comm::Communicator* comm_ = nullptr;
  int rank_ = 0, world_ = 1;
  std::string base_;
  static inline int counter_ = 0;
};

TEST_P(EngineMpi, EqualsOneRankRunOfNMicroBatches) {
  RankRun multi, ref;
  ASSERT_NO_FATAL_FAILURE(create_pair(multi, ref));
  EXPECT_EQ(multi.e->plan().world_size, static_cast<uint32_t>(world_));
  compare(multi, ref, 0, 4, 0);
  expect_weights(multi, ref, 0);
}

// Forward and backward acquire every group (backward in reverse order). A
// stage-3 acquire that finds its group still gathered in a device buffer
// (backward's first groups, and with 2 micro-batches the next forward's
// first ones) gathers nothing: the bytes sent per step are the plan's, which
// counts one gather per upload (the slots it keeps), with prefetch depths 0
// (2 buffers for 3 groups: some groups gathered twice per micro-batch) to 2
// (every group once per step), 1 and 2 micro-batches. Every gathered weight
// and the final weights and states stay the 1-rank run's, bit for bit
// (dyadic gradients: exact sums over micro-batches in any order).
TEST_P(EngineMpi, AHitUsesTheGatheredGroupAndTheBytesAreThePlans) {
  const uint64_t norm_bytes = 3 * 2 * 8 * (world_ - 1);
  for (uint32_t micro : {1u, 2u}) {
    for (uint32_t depth : {0u, 1u, 2u}) {
      SCOPED_TRACE("micro-batches " + std::to_string(micro) + ", prefetch_depth " + std::to_string(depth));
      const std::string tag = std::to_string(micro) + "-" + std::to_string(depth);
      Config cm = config(0, "multi" + tag), cr = config(0, "ref" + std::to_string(rank_) + "-" + tag);
      cm.strata.prefetch_depth = cr.strata.prefetch_depth = depth;
      cm.gradient_accumulation_steps = micro;
      cr.gradient_accumulation_steps = micro * world_;
      RankRun multi, ref;
      multi.forward = ref.forward = true;
      Status s = multi.create(cm, comm_, GetParam().backend_grads);
      ASSERT_TRUE(s.ok()) << s.to_string();
      s = ref.create(cr, nullptr, GetParam().backend_grads);
      ASSERT_TRUE(s.ok()) << s.to_string();
      const Plan& plan = multi.e->plan();
      const uint64_t want = plan.forward_backward.comm + plan.optimizer_step.comm + norm_bytes;
      uint64_t reused = 0;
      for (int st = 0; st < 3; ++st) {
        const EngineStats before = multi.e->stats();
        for (uint32_t mb = 0; mb < micro; ++mb) {
          std::vector<std::vector<uint16_t>> mine, theirs;
          s = multi.micro_batch(st, static_cast<int>(mb) * world_ + rank_, mb + 1 == micro, &mine, true);
          ASSERT_TRUE(s.ok()) << s.to_string();
          for (int r = 0; r < world_; ++r) {
            const int who = static_cast<int>(mb) * world_ + r;
            s = ref.micro_batch(st, who, mb + 1 == micro && r + 1 == world_, r == 0 ? &theirs : nullptr, true);
            ASSERT_TRUE(s.ok()) << s.to_string();
          }
          ASSERT_EQ(mine, theirs) << "step " << st << " micro-batch " << mb;
        }
        auto a = multi.e->step();
        ASSERT_TRUE(a.ok()) << a.status().to_string();
        ASSERT_TRUE(ref.e->step().ok());
        const EngineStats after = multi.e->stats();
        EXPECT_EQ(after.comm_bytes - before.comm_bytes, want) << "step " << st;
        reused += after.gathers_reused - before.gathers_reused;
      }
      if (GetParam().stage == 3)
        EXPECT_GT(reused, 0u);
      else
        EXPECT_EQ(reused, 0u);  // stages 1-2 gather nothing in acquire
      expect_weights(multi, ref, 0);
    }
  }
}

TEST_P(EngineMpi, ClippingAgreesAcrossRanks) {
  RankRun multi, ref;
  ASSERT_NO_FATAL_FAILURE(create_pair(multi, ref, 0.05));
  compare(multi, ref, 0, 3, 0.05);
  expect_weights(multi, ref, 1e-6);
}

// Per-rank state bytes are the padded shard's (stages 1-2: the compute copy
// whole); the bytes sent per step are one all-gather of every group (compute
// dtype: in acquire for stage 3, after the step for stages 1-2) and one
// reduce-scatter of every gradient (fp32), (N-1)/N of each buffer, plus the
// norm's few bytes: ZeRO's 3 x and 2 x the parameters' bytes (one acquire per
// micro-batch here).
TEST_P(EngineMpi, BytesAreOneNthAndCommunicationIsTheStages) {
  RankRun multi, ref;
  ASSERT_NO_FATAL_FAILURE(create_pair(multi, ref));
  const ModelSpec spec = make_model();
  uint64_t gather = 0, scatter = 0, shard_elems = 0;
  for (const auto& p : spec.params) {
    const ShardRange sh = shard_range(p.numel(), world_, rank_, 512);
    gather += sh.padded * 2 * (world_ - 1);
    scatter += sh.padded * 4 * (world_ - 1);
    shard_elems += sh.padded;
  }
  const Tier tier = GetParam().place == Place::kHost ? Tier::kHost : Tier::kNvme;
  // compute (bf16) + master, two moments, gradient (fp32) per padded element.
  const uint64_t compute = shard_elems * 2 * (GetParam().stage == 3 ? 1 : world_);
  const uint64_t rest = shard_elems * (4 + 4 + 4 + 4);
  if (GetParam().place == Place::kHost || GetParam().stage == 3) {
    EXPECT_EQ(multi.e->plan().tier_bytes(tier), compute + rest);
  } else {
    EXPECT_EQ(multi.e->plan().tier_bytes(Tier::kHost), compute);
    EXPECT_EQ(multi.e->plan().tier_bytes(Tier::kNvme), rest);
  }
  const uint64_t before = multi.e->stats().comm_bytes;
  ASSERT_TRUE(multi.micro_batch(0, rank_, true, nullptr).ok());
  ASSERT_TRUE(multi.e->step().ok());
  const uint64_t norm_bytes = 3 * 2 * 8 * (world_ - 1);  // 3 groups x {sum_sq, flag} doubles
  EXPECT_EQ(multi.e->stats().comm_bytes - before, gather + scatter + norm_bytes);
  (void)ref;
}

TEST_P(EngineMpi, CheckpointResumesIdentically) {
  RankRun multi, ref;
  std::string ck;
  ASSERT_NO_FATAL_FAILURE(ck = train_and_save(multi, ref));
  ASSERT_FALSE(::testing::Test::HasFailure());
  Status s;
  EXPECT_TRUE(std::filesystem::exists(ck + "/manifest.rank" + std::to_string(world_ - 1) + ".json"));
  // Two more steps, then back to the checkpoint and the same two steps again.
  std::vector<std::vector<uint16_t>> first, again;
  for (int st = 2; st < 4; ++st) {
    ASSERT_TRUE(multi.micro_batch(st, rank_, true, &first).ok());
    ASSERT_TRUE(multi.e->step().ok());
  }
  std::string extra;
  s = multi.e->load_checkpoint(ck, &extra);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(extra, R"({"who":"test"})");
  for (int st = 2; st < 4; ++st) {
    ASSERT_TRUE(multi.micro_batch(st, rank_, true, &again).ok());
    ASSERT_TRUE(multi.e->step().ok());
  }
  EXPECT_EQ(first, again);
}

// N ranks -> 1 rank -> N ranks: the 1-rank engine that loads the N-rank
// checkpoint holds exactly the gathered state (weights, both moments, step
// counts), and N fresh ranks loading the 1-rank checkpoint then train exactly
// as that 1-rank engine does with N micro-batches (shards of different
// padding each way: 512-element alignment here, whole tensors there).
TEST_P(EngineMpi, CheckpointReshardsToOneRankAndBack) {
  RankRun multi, ref;
  std::string ck;
  ASSERT_NO_FATAL_FAILURE(ck = train_and_save(multi, ref));
  ASSERT_FALSE(::testing::Test::HasFailure());
  Status s;

  RankRun one;  // this process's own 1-rank engine
  ASSERT_TRUE(one.create(config(0, "one" + std::to_string(rank_)), nullptr).ok());
  std::string extra;
  s = one.e->load_checkpoint(ck, &extra);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(extra, R"({"who":"test"})");
  EXPECT_EQ(one.e->step_count(), 2);
  expect_weights(multi, one, 0);  // gathered N-rank state == the resharded 1-rank state

  const std::string ck1 = base_ + "/ck1-" + std::to_string(rank_);
  ASSERT_TRUE(one.e->save_checkpoint(ck1).ok());
  RankRun back;
  ASSERT_TRUE(back.create(config(0, "back"), comm_).ok());
  s = back.e->load_checkpoint(ck1);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(back.e->step_count(), 2);
  compare(back, one, 2, 2, 0);
  expect_weights(back, one, 0);
}

// A rank that cannot write its shard (its checkpoint parent directory does
// not exist there) fails the save on every rank and nothing is committed.
TEST_P(EngineMpi, SaveThatOneRankCannotWriteCommitsNothing) {
  RankRun multi;
  ASSERT_TRUE(multi.create(config(0, "multi"), comm_).ok());
  ASSERT_TRUE(multi.micro_batch(0, rank_, true, nullptr).ok());
  ASSERT_TRUE(multi.e->step().ok());
  // The last rank is told another (missing) parent: its writer fails at create.
  const std::string ck = rank_ == world_ - 1 ? base_ + "/missing/ck" : base_ + "/ck";
  Status s = multi.e->save_checkpoint(ck);
  EXPECT_FALSE(s.ok());
  if (rank_ == 0) {
    EXPECT_NE(s.message().find("rank(s) " + std::to_string(world_ - 1)), std::string::npos) << s.message();
  }
  barrier();
  EXPECT_FALSE(std::filesystem::exists(base_ + "/ck"));
  for (const auto& e : std::filesystem::directory_iterator(base_))
    EXPECT_EQ(e.path().filename().string().rfind("ck.tmp-", 0), std::string::npos) << e.path();
}

// Stage 3: once the first step recorded the acquire order, each acquire
// enqueues the all-gathers of the next prefetch_depth - 1 groups of the order
// and their acquires use them (every acquire of a step but its first, with
// depth 2 or 3 and three groups). Every gathered weight stays the 1-rank
// run's, and the bytes sent per step stay one gather and one reduce-scatter
// of every group (nothing gathered twice). An order that changes on every
// rank at once (c, a, b from the third step) is followed: that step gathers
// nothing ahead, the next ones along the new order. Depth 1, and stages 1-2
// (no gathers in acquire), gather nothing ahead.
TEST_P(EngineMpi, GathersRunAheadAlongTheRecordedOrder) {
  const auto [gather, scatter] = sent_per_collective(world_, rank_);
  const uint64_t norm_bytes = 3 * 2 * 8 * (world_ - 1);
  const std::vector<uint32_t> depths = GetParam().stage == 3 ? std::vector<uint32_t>{1, 2, 3} : std::vector<uint32_t>{2};
  for (uint32_t depth : depths) {
    SCOPED_TRACE("prefetch_depth " + std::to_string(depth));
    RankRun multi, ref;
    const std::string tag = std::to_string(depth);
    Config cm = config(0, "multi" + tag), cr = config(0, "ref" + std::to_string(rank_) + "-" + tag);
    cm.strata.prefetch_depth = depth;
    Status s = multi.create(cm, comm_, GetParam().backend_grads);
    ASSERT_TRUE(s.ok()) << s.to_string();
    s = ref.create(cr, nullptr, GetParam().backend_grads);
    ASSERT_TRUE(s.ok()) << s.to_string();
    const std::vector<GroupId> changed{2, 0, 1};
    const bool ahead = GetParam().stage == 3 && depth >= 2;
    const uint64_t want_ahead[] = {0, 2, 0, 2, 2};  // per step: recording, along, changed, along the new order
    for (int st = 0; st < 5; ++st) {
      const std::vector<GroupId>* order = st >= 2 ? &changed : nullptr;
      const EngineStats before = multi.e->stats();
      std::vector<std::vector<uint16_t>> mine, want;
      s = multi.micro_batch(st, rank_, true, &mine, false, order);
      ASSERT_TRUE(s.ok()) << s.to_string();
      for (int m = 0; m < world_; ++m) {
        s = ref.micro_batch(st, m, m == world_ - 1, m == 0 ? &want : nullptr, false, order);
        ASSERT_TRUE(s.ok()) << s.to_string();
      }
      ASSERT_EQ(mine, want) << "step " << st;
      auto a = multi.e->step();
      ASSERT_TRUE(a.ok()) << a.status().to_string();
      ASSERT_TRUE(ref.e->step().ok());
      const EngineStats after = multi.e->stats();
      EXPECT_EQ(after.gathers_ahead - before.gathers_ahead, ahead ? want_ahead[st] : 0) << "step " << st;
      EXPECT_EQ(after.comm_bytes - before.comm_bytes, gather + scatter + norm_bytes) << "step " << st;
    }
    expect_weights(multi, ref, 0);
  }
}

// Backward is not held up by the gradients' reduce-scatters (stages 2-3):
// reduce_grad packs each piece into the engine's send buffers, which the plan
// sizes for the largest group (group c: 6 pieces), and the caller's stream
// waits only for that. Proof without timing: rank 0 reduces a whole group and
// waits for its stream, and only then lets the other ranks start that
// group's reduce_grads, so none of the group's reduce-scatters can have run
// (a stream that waited for them would hang until the communicator's
// timeout). The caller's one gradient buffer is overwritten with NaN as soon
// as its stream passes each reduce_grad, and the run still equals the 1-rank
// run bit for bit. Stage 1 reduce-scatters at step() and plans no send
// buffers.
TEST_P(EngineMpi, BackwardRunsAheadOfTheReduceScatters) {
  RankRun multi, ref;
  ASSERT_NO_FATAL_FAILURE(create_pair(multi, ref));
  const Plan& plan = multi.e->plan();
  if (GetParam().stage == 1) {
    EXPECT_EQ(plan.reduce_buffers, 0u);
    EXPECT_FALSE(plan.grad_staged);
    return;
  }
  ASSERT_TRUE(plan.grad_staged);
  EXPECT_EQ(plan.grad_pieces_wanted, 6u);
  EXPECT_EQ(plan.grad_pieces, 6u);
  EXPECT_EQ(plan.reduce_buffers, (6 * uint64_t(world_) + 1) * plan.grad_piece_elems * 4);
  uint64_t largest = 0;
  for (const auto& p : make_model().params) largest = std::max<uint64_t>(largest, p.numel());
  std::vector<float> host_buf(largest);
  float* shared = host_buf.data();
  void* dev_buf = nullptr;
  if (GetParam().backend_grads) {
    auto b = multi.dev->alloc(largest * 4);
    ASSERT_TRUE(b.ok());
    dev_buf = *b;
    shared = static_cast<float*>(dev_buf);
  }
  auto flag = [&](int st, GroupId g) { return base_ + "/reduced-" + std::to_string(st) + "-" + std::to_string(g); };
  for (int st = 0; st < 3; ++st) {
    auto gate = [&](GroupId g, bool before) -> Status {
      if (rank_ == 0) {
        if (!before) std::ofstream(flag(st, g)).put('1');  // its stream has passed every reduce_grad of g
        return {};
      }
      if (!before) return {};
      for (int i = 0; i < 60000 && !std::filesystem::exists(flag(st, g)); ++i) ::usleep(1000);
      if (!std::filesystem::exists(flag(st, g)))
        return Status(StatusCode::kUnavailable,
                      "rank 0 did not get past its reduce_grads of group " + std::to_string(g) + " in 60 s");
      return {};
    };
    std::vector<std::vector<uint16_t>> mine, want;
    Status s = multi.micro_batch(st, rank_, true, &mine, false, nullptr, shared, gate);
    ASSERT_TRUE(s.ok()) << s.to_string();
    for (int m = 0; m < world_; ++m) {
      s = ref.micro_batch(st, m, m == world_ - 1, m == 0 ? &want : nullptr);
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
    ASSERT_EQ(mine, want) << "step " << st;
    auto a = multi.e->step();
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    ASSERT_TRUE(ref.e->step().ok());
  }
  expect_weights(multi, ref, 0);
  if (dev_buf) (void)multi.dev->free(dev_buf);
}

// Two micro-batches per rank. Stage 1 sums each rank's on its device and
// reduce-scatters that once per step; stages 2 and 3 reduce-scatter every
// micro-batch. With gradients whose sums are exact in any order, every stage
// equals the 1-rank run of the N x 2 micro-batches bit for bit (weights and
// states), and the bytes sent per step are one reduce-scatter for stage 1,
// two for the others, plus one all-gather of every group (stage 3: in the
// first micro-batch's acquires, the second's find the groups still gathered
// in the device buffers; stages 1-2: after the step) and the norm's.
TEST_P(EngineMpi, StageOneReducesEachRanksMicroBatchesOncePerStep) {
  RankRun multi, ref;
  ASSERT_NO_FATAL_FAILURE(create_pair(multi, ref));
  const auto [gather, scatter] = sent_per_collective(world_, rank_);
  const int stage = GetParam().stage;
  const uint64_t norm_bytes = 3 * 2 * 8 * (world_ - 1);
  const uint64_t want = (stage == 1 ? 1 : 2) * scatter + gather + norm_bytes;
  for (int st = 0; st < 3; ++st) {
    const uint64_t before = multi.e->stats().comm_bytes;
    for (int m = 0; m < 2; ++m) {
      Status s = multi.micro_batch(st, 2 * rank_ + m, m == 1, nullptr, true);
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
    for (int who = 0; who < 2 * world_; ++who) {
      Status s = ref.micro_batch(st, who, who == 2 * world_ - 1, nullptr, true);
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
    auto a = multi.e->step();
    auto b = ref.e->step();
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    EXPECT_NEAR(a->grad_norm, b->grad_norm, 1e-12 * b->grad_norm);
    EXPECT_EQ(multi.e->stats().comm_bytes - before, want) << "step " << st;
  }
  expect_weights(multi, ref, 0);
}

INSTANTIATE_TEST_SUITE_P(Stages, EngineMpi,
                         ::testing::Values(Case{Place::kHost, 3}, Case{Place::kNvme, 3, true}, Case{Place::kHost, 2},
                                           Case{Place::kNvme, 2, true}, Case{Place::kHost, 1},
                                           Case{Place::kNvme, 1, true}),
                         [](const auto& info) {
                           return std::string(info.param.place == Place::kHost ? "Host" : "Nvme") + "Stage" +
                                  std::to_string(info.param.stage) + (info.param.backend_grads ? "BackendGrads" : "");
                         });

// Refused by name: stage 0 (nothing sharded) with N ranks; parameters on
// NVMe with stages 1-2 (kept whole on every rank, as DeepSpeed allows
// offload_param with stage 3 only).
TEST(EngineMpiRefusals, StageZeroAndReplicatedParamsOnNvme) {
  comm::Communicator* c = g_world->comm.get();
  EngineOptions eo;
  eo.model = make_model();
  eo.device = c->device();
  eo.comm = c;
  eo.config = make_config(Case{Place::kHost, 0}, "", 0);
  auto e = Engine::create(eo);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("stage 0"), std::string::npos) << e.status().message();
  eo.config = make_config(Case{Place::kHost, 2}, g_world->dir, 0);
  eo.config.strata.groups[0].compute = Tier::kNvme;
  e = Engine::create(eo);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("stage 1 or 2"), std::string::npos) << e.status().message();
  EXPECT_NE(e.status().message().find("use stage 3"), std::string::npos) << e.status().message();
  // Gradient staging options that N ranks cannot honour are refused by name.
  eo.config = make_config(Case{Place::kHost, 1}, "", 0);
  eo.config.strata.gradient_staging = true;  // stage 1 sums into its own buffer: nothing to stage
  e = Engine::create(eo);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("stage 1"), std::string::npos) << e.status().message();
  eo.config = make_config(Case{Place::kHost, 3}, "", 0);
  eo.config.strata.gradient_in_compute_dtype = true;  // the reduce-scatter sums fp32
  e = Engine::create(eo);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("gradient_in_compute_dtype"), std::string::npos) << e.status().message();
  // true, but the device budget holds only the unstaged send buffer: refused
  // (unset, the same budget trains unstaged).
  eo.config = make_config(Case{Place::kHost, 3}, "", 0);
  auto fits = Engine::create(eo);
  ASSERT_TRUE(fits.ok()) << fits.status().to_string();
  const Plan roomy = (*fits)->plan();
  fits->reset();
  ASSERT_TRUE(roomy.grad_staged);
  const uint64_t piece = roomy.grad_piece_elems * 4;
  eo.config.strata.device_memory = eo.config.strata.device_reserve + roomy.device_buffers + (c->world_size() + 1) * piece;
  fits = Engine::create(eo);
  ASSERT_TRUE(fits.ok()) << fits.status().to_string();
  EXPECT_FALSE((*fits)->plan().grad_staged);
  fits->reset();
  eo.config.strata.gradient_staging = true;
  e = Engine::create(eo);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kOutOfBudget) << e.status().to_string();
  EXPECT_NE(e.status().message().find("gradient_staging"), std::string::npos) << e.status().message();
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  using namespace strata;
  strata::testing::MpiWorld mw;
  if (!strata::testing::open_mpi_world(&mw, 120, 256ull << 20)) return 1;
  World world{std::move(mw.dev), std::move(mw.comm), {}};
  // Rank 0's temp directory, broadcast so every rank uses the same one.
  char path[256] = {};
  if (world.comm->rank() == 0) {
    const char* base = std::getenv("STRATA_TEST_DIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/strata-engine-mpi-XXXXXX";
    std::strncpy(path, tmpl.c_str(), sizeof(path) - 1);
    if (::mkdtemp(path) == nullptr) {
      perror("mkdtemp");
      return 1;
    }
  }
  {
    auto s = world.dev->create_stream("setup");
    if (!s.ok() || !world.comm->broadcast(path, sizeof(path), 0, *s).ok() || !world.dev->synchronize(*s).ok()) {
      fprintf(stderr, "broadcasting the temp dir failed\n");
      return 1;
    }
    (void)world.dev->destroy_stream(*s);
  }
  world.dir = path;
  g_world = &world;
  const int rc = RUN_ALL_TESTS();
  {
    auto s = world.dev->create_stream("teardown");
    if (s.ok()) {
      (void)world.comm->barrier(*s);
      (void)world.dev->synchronize(*s);
      (void)world.dev->destroy_stream(*s);
    }
  }
  if (world.comm->rank() == 0) std::filesystem::remove_all(world.dir);
  world.comm.reset();
  world.dev.reset();
  comm::finalize_mpi();
  return rc;
}
