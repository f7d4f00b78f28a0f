// What a foreign trainer (the PyTorch package, a C ABI user) needs of the
// engine (issue 12): reduce_grad when things go wrong, discard_step, the
// optimizer state, summed rather than averaged micro-batches. The host backend is wrapped so that the gradient
// download stream's n-th piece fails on demand:
//   - a failed reduce_grad changes nothing: no buffer leaks, many failures in
//     a row never hang, a retry succeeds and the step equals a clean run's;
//   - a failure after part of the gradient was queued leaves the step torn:
//     step() refuses, discard_step() forgets it, the redone step equals a
//     clean run's;
//   - discard_step releases groups still acquired (an exception in forward);
//   - on the host backend the caller's own memory is a valid gradient;
//   - read_state gives AdamW's exp_avg / exp_avg_sq, load_state puts them back;
//   - average_micro_batches false sums the micro-batches' gradients.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "cpu_optim/optimizer.h"
#include "device/device_backend.h"
#include "runtime/engine.h"

namespace strata {
namespace {

// The host backend, with host functions (a piece's copy) and event records
// (a piece's completion) on the stream named "strata download" failing when
// armed: fail_in = k fails the k-th such call from now (1: the next one).
class FlakyBackend final : public DeviceBackend {
 public:
  FlakyBackend() {
    DeviceBackendOptions o;
    o.kind = DeviceBackendKind::kHost;
    o.budget_bytes = 1ull << 30;
    in_ = std::move(create_device_backend(o)).value();
  }
  std::atomic<int> fail_in{0};

  DeviceKind kind() const override { return in_->kind(); }
  std::string name() const override { return in_->name(); }
  Result<void*> alloc(std::size_t bytes) override { return in_->alloc(bytes); }
  Status free(void* ptr, DeviceStream* after) override { return in_->free(ptr, after); }
  DeviceMemoryStats memory_stats() const override { return in_->memory_stats(); }
  void trim() override { in_->trim(); }
  HostMemoryRegistrar* host_registrar() override { return in_->host_registrar(); }
  bool holds(const void* p, std::size_t n) const override { return in_->holds(p, n); }
  Result<DeviceStream*> create_stream(std::string_view name) override { return in_->create_stream(name); }
  Status destroy_stream(DeviceStream* s) override { return in_->destroy_stream(s); }
  Status synchronize(DeviceStream* s) override { return in_->synchronize(s); }
  Result<bool> query(DeviceStream* s) override { return in_->query(s); }
  Result<DeviceEvent*> create_event() override { return in_->create_event(); }
  void destroy_event(DeviceEvent* e) override { in_->destroy_event(e); }
  Status record(DeviceEvent* e, DeviceStream* s) override {
    if (armed(s)) return Status(StatusCode::kIoError, "injected: the download stream refused the piece's event");
    return in_->record(e, s);
  }
  Status wait(DeviceStream* s, DeviceEvent* e) override { return in_->wait(s, e); }
  Result<bool> query(DeviceEvent* e) override { return in_->query(e); }
  Status synchronize(DeviceEvent* e) override { return in_->synchronize(e); }
  Status copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, DeviceStream* s) override {
    return in_->copy_async(dst, src, bytes, kind, s);
  }
  Status fill_bytes_async(void* dst, std::size_t bytes, uint8_t value, DeviceStream* s) override {
    return in_->fill_bytes_async(dst, bytes, value, s);
  }
  Status host_func_async(DeviceStream* s, std::function<Status()> fn) override {
    if (armed(s)) return Status(StatusCode::kIoError, "injected: the download stream refused the piece");
    return in_->host_func_async(s, std::move(fn));
  }
  Status cast_async(void* dst, DType dt, const void* src, DType st, std::size_t n, float scale,
                    DeviceStream* s) override {
    return in_->cast_async(dst, dt, src, st, n, scale, s);
  }
  Status accumulate_async(float* dst, const void* src, DType st, std::size_t n, float scale,
                          DeviceStream* s) override {
    return in_->accumulate_async(dst, src, st, n, scale, s);
  }
  Status sq_norm_async(const void* src, DType t, std::size_t n, NormStats* out, DeviceStream* s) override {
    return in_->sq_norm_async(src, t, n, out, s);
  }
  Status adamw_async(const AdamWArgs& a, DeviceStream* s) override { return in_->adamw_async(a, s); }

 private:
  bool armed(DeviceStream* s) {
    return s != nullptr && s->name() == "strata download" && fail_in.load() > 0 && fail_in.fetch_sub(1) == 1;
  }
  std::unique_ptr<DeviceBackend> in_;
};

// Two groups: "big" (a 5M-element weight: two 4M-element download pieces)
// and "small".
constexpr uint64_t kBig = 5u << 20, kSmall = 300;

struct Rig {
  FlakyBackend dev;
  std::unique_ptr<Engine> engine;
  DeviceStream* stream = nullptr;
  GroupId big = 0, small = 0;

  explicit Rig(uint32_t accum = 1, bool average = true) {
    EngineOptions eo;
    eo.config.gradient_accumulation_steps = accum;
    eo.config.strata.average_micro_batches = average;
    eo.model.params = {{"big.weight", {kBig}, DType::kF32, "big"}, {"small.weight", {kSmall}, DType::kF32, "small"}};
    eo.config.optimizer.lr = 1e-2;
    eo.config.optimizer.weight_decay = 0.01;
    eo.config.gradient_clipping = 0.0;  // unclipped (the config's default clips at 1.0, as DeepSpeed's)
    eo.config.zero.offload_optimizer.device = OffloadDevice::kCpu;
    eo.config.zero.offload_param.device = OffloadDevice::kCpu;
    eo.config.strata.device_memory = 512ull << 20;
    eo.config.strata.device_reserve = 64ull << 20;
    eo.device = &dev;
    auto e = Engine::create(eo);
    EXPECT_TRUE(e.ok()) << e.status().to_string();
    engine = std::move(e).value();
    stream = dev.create_stream("caller").value();
    big = engine->find_group("big").value();
    small = engine->find_group("small").value();
    std::vector<float> w(kBig);
    for (uint64_t i = 0; i < kBig; ++i) w[i] = 0.001f * static_cast<float>(i % 997);
    EXPECT_TRUE(engine->load_param(0, w.data(), DType::kF32).ok());
    EXPECT_TRUE(engine->load_param(1, w.data(), DType::kF32).ok());
  }
  ~Rig() {
    engine.reset();
    (void)dev.destroy_stream(stream);
  }
  // The caller's own gradient memory (not the backend's pool).
  static std::vector<float> grad(uint64_t n, float s) {
    std::vector<float> g(n);
    for (uint64_t i = 0; i < n; ++i) g[i] = s * static_cast<float>(static_cast<int64_t>(i % 13) - 6);
    return g;
  }
  Status reduce_all(const std::vector<float>& gb, const std::vector<float>& gs) {
    STRATA_RETURN_IF_ERROR(engine->reduce_grad(0, gb.data(), DType::kF32, stream));
    return engine->reduce_grad(1, gs.data(), DType::kF32, stream);
  }
  std::vector<float> weights(ParamId p) {
    std::vector<float> v(engine->model().params[p].numel());
    EXPECT_TRUE(engine->read_param(p, v.data(), DType::kF32).ok());
    return v;
  }
};

std::vector<std::vector<float>> clean_run(int steps) {
  Rig r;
  const auto gb = Rig::grad(kBig, 0.01f), gs = Rig::grad(kSmall, 0.02f);
  for (int s = 0; s < steps; ++s) {
    EXPECT_TRUE(r.engine->begin_micro_batch(true).ok());
    EXPECT_TRUE(r.reduce_all(gb, gs).ok());
    EXPECT_TRUE(r.engine->step(1e-2).ok());
  }
  return {r.weights(0), r.weights(1)};
}

TEST(EngineReduce, FailedCallsChangeNothingLeakNothingAndARetrySucceeds) {
  const auto want = clean_run(2);
  Rig r;
  const auto gb = Rig::grad(kBig, 0.01f), gs = Rig::grad(kSmall, 0.02f);
  for (int s = 0; s < 2; ++s) {
    ASSERT_TRUE(r.engine->begin_micro_batch(true).ok());
    // Ten failures of the first piece in a row: more than the engine has
    // piece buffers, so a leak would hang the next call.
    for (int k = 0; k < 10; ++k) {
      r.dev.fail_in = 1;
      Status st = r.engine->reduce_grad(1, gs.data(), DType::kF32, r.stream);
      ASSERT_FALSE(st.ok());
      EXPECT_NE(st.message().find("nothing was accumulated"), std::string::npos) << st.to_string();
      // The first piece's completion event (after its copy) failing is the same.
      r.dev.fail_in = 2;
      st = r.engine->reduce_grad(1, gs.data(), DType::kF32, r.stream);
      ASSERT_FALSE(st.ok());
      EXPECT_NE(st.message().find("may be retried"), std::string::npos) << st.to_string();
    }
    r.dev.fail_in = 0;
    ASSERT_TRUE(r.reduce_all(gb, gs).ok());
    auto res = r.engine->step(1e-2);
    ASSERT_TRUE(res.ok()) << res.status().to_string();
  }
  EXPECT_EQ(r.weights(0), want[0]);
  EXPECT_EQ(r.weights(1), want[1]);
}

TEST(EngineReduce, ATornReduceBlocksTheStepUntilDiscarded) {
  const auto want = clean_run(1);
  Rig r;
  const auto gb = Rig::grad(kBig, 0.01f), gs = Rig::grad(kSmall, 0.02f);
  const auto before = r.weights(0);
  ASSERT_TRUE(r.engine->begin_micro_batch(true).ok());
  ASSERT_TRUE(r.engine->reduce_grad(1, gs.data(), DType::kF32, r.stream).ok());
  r.dev.fail_in = 3;  // piece 0 copied and its event recorded, piece 1's copy refused
  Status st = r.engine->reduce_grad(0, gb.data(), DType::kF32, r.stream);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("torn"), std::string::npos) << st.to_string();
  auto refused = r.engine->step(1e-2);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("discard_step"), std::string::npos) << refused.status().to_string();
  EXPECT_EQ(r.weights(0), before);  // nothing moved
  // An exception in the redo's forward leaves a group acquired: discard
  // releases it too.
  ASSERT_TRUE(r.engine->discard_step(r.stream).ok());
  ASSERT_TRUE(r.engine->acquire(r.big, r.stream).ok());
  ASSERT_TRUE(r.engine->discard_step(r.stream).ok());
  ASSERT_TRUE(r.engine->begin_micro_batch(true).ok());
  ASSERT_TRUE(r.engine->acquire(r.big, r.stream).ok());
  ASSERT_TRUE(r.engine->release(r.big, r.stream).ok());
  ASSERT_TRUE(r.reduce_all(gb, gs).ok());
  auto res = r.engine->step(1e-2);
  ASSERT_TRUE(res.ok()) << res.status().to_string();
  EXPECT_EQ(res->step, 1);
  EXPECT_EQ(r.weights(0), want[0]);
  EXPECT_EQ(r.weights(1), want[1]);
}

TEST(EngineReduce, DiscardedMicroBatchesLeaveNoTrace) {
  const auto want = clean_run(1);
  Rig r;
  const auto gb = Rig::grad(kBig, 0.01f), gs = Rig::grad(kSmall, 0.02f);
  // A whole micro-batch of other gradients, then discarded. The buffers are
  // read on the engine's stream: they must live until discard_step (which
  // waits for the work in flight) returns.
  const auto other_b = Rig::grad(kBig, 5.0f), other_s = Rig::grad(kSmall, -3.0f);
  ASSERT_TRUE(r.engine->begin_micro_batch(true).ok());
  ASSERT_TRUE(r.reduce_all(other_b, other_s).ok());
  ASSERT_TRUE(r.engine->discard_step(nullptr).ok());
  ASSERT_TRUE(r.engine->begin_micro_batch(true).ok());
  ASSERT_TRUE(r.reduce_all(gb, gs).ok());
  ASSERT_TRUE(r.engine->step(1e-2).ok());
  EXPECT_EQ(r.weights(0), want[0]);
  EXPECT_EQ(r.weights(1), want[1]);
}

// The norm is summed while the gradients are accumulated (no pass over them
// at step time): it must be the accumulated gradient's own, bit for bit —
// each parameter's grad_stats over its whole fp32 sum, scaled, groups in
// order — across a 5M-element parameter's two download pieces, after a
// discarded micro-batch, and with a parameter left out of a step.
TEST(EngineReduce, TheNormIsTheAccumulatedGradientsOwnBitForBit) {
  Rig r(3);
  auto norm_of = [](const std::vector<std::vector<float>>& sums, double scale) {
    double total = 0;
    for (const auto& g : sums) {  // one parameter per group, groups in order
      auto st = cpu_optim::grad_stats(g.data(), DType::kF32, g.size(), 1.0);
      total += st->sum_sq * (scale * scale);
    }
    return std::sqrt(total);
  };
  // A discarded micro-batch of large gradients first: its squares must not count.
  const auto junk_b = Rig::grad(kBig, 50.0f), junk_s = Rig::grad(kSmall, 70.0f);
  ASSERT_TRUE(r.engine->begin_micro_batch(false).ok());
  ASSERT_TRUE(r.reduce_all(junk_b, junk_s).ok());
  ASSERT_TRUE(r.engine->discard_step(nullptr).ok());
  std::vector<std::vector<float>> gb, gs;
  for (int m = 0; m < 3; ++m) {
    gb.push_back(Rig::grad(kBig, 0.01f * static_cast<float>(m + 1)));
    gs.push_back(Rig::grad(kSmall, -0.3f + 0.1f * static_cast<float>(m)));
    for (uint64_t i = 0; i < kBig; i += 4099) gb[m][i] += 1e-3f * static_cast<float>(i % 7);
  }
  std::vector<float> sum_b(kBig, 0.0f), sum_s(kSmall, 0.0f);
  for (int m = 0; m < 3; ++m) {
    ASSERT_TRUE(r.engine->begin_micro_batch(m == 2).ok());
    ASSERT_TRUE(r.reduce_all(gb[m], gs[m]).ok());
    for (uint64_t i = 0; i < kBig; ++i) sum_b[i] = m == 0 ? gb[m][i] : sum_b[i] + gb[m][i];
    for (uint64_t i = 0; i < kSmall; ++i) sum_s[i] = m == 0 ? gs[m][i] : sum_s[i] + gs[m][i];
  }
  auto res = r.engine->step(1e-2);
  ASSERT_TRUE(res.ok()) << res.status().to_string();
  EXPECT_EQ(res->grad_norm, norm_of({sum_b, sum_s}, 1.0 / 3)) << res->grad_norm;
  // Next step: only "big" is reduced; "small" contributes nothing.
  for (int m = 0; m < 3; ++m) {
    ASSERT_TRUE(r.engine->begin_micro_batch(m == 2).ok());
    ASSERT_TRUE(r.engine->reduce_grad(0, gb[2 - m].data(), DType::kF32, r.stream).ok());
  }
  for (uint64_t i = 0; i < kBig; ++i) sum_b[i] = (gb[2][i] + gb[1][i]) + gb[0][i];
  res = r.engine->step(1e-2);
  ASSERT_TRUE(res.ok()) << res.status().to_string();
  EXPECT_EQ(res->grad_norm, norm_of({sum_b}, 1.0 / 3)) << res->grad_norm;
}

TEST(EngineForeign, OptimizerStateIsTorchsAndRoundTrips) {
  Rig r;
  const auto gb = Rig::grad(kBig, 0.01f), gs = Rig::grad(kSmall, 0.02f);
  for (int s = 0; s < 2; ++s) {
    ASSERT_TRUE(r.engine->begin_micro_batch(true).ok());
    ASSERT_TRUE(r.reduce_all(gb, gs).ok());
    ASSERT_TRUE(r.engine->step(1e-2).ok());
  }
  // The same gradient twice: exp_avg = (0.1 * 0.9 + 0.1) g, exp_avg_sq = (0.001 * 0.999 + 0.001) g^2.
  std::vector<float> m(kSmall), v(kSmall);
  ASSERT_TRUE(r.engine->read_state(1, 0, m.data()).ok());
  ASSERT_TRUE(r.engine->read_state(1, 1, v.data()).ok());
  for (uint64_t i = 0; i < kSmall; ++i) {
    const double g = gs[i];
    EXPECT_NEAR(m[i], 0.19 * g, 1e-7 + 1e-6 * std::abs(0.19 * g)) << i;
    EXPECT_NEAR(v[i], 0.001999 * g * g, 1e-12 + 1e-6 * 0.001999 * g * g) << i;
  }
  // Into a fresh engine: the same state, the same next step.
  Rig fresh;
  for (ParamId p : {ParamId{0}, ParamId{1}}) {
    ASSERT_TRUE(fresh.engine->load_param(p, r.weights(p).data(), DType::kF32).ok());
    for (int k = 0; k < 2; ++k) {
      std::vector<float> st(r.engine->model().params[p].numel()), back(st.size());
      ASSERT_TRUE(r.engine->read_state(p, k, st.data()).ok());
      ASSERT_TRUE(fresh.engine->load_state(p, k, st.data()).ok());
      ASSERT_TRUE(fresh.engine->read_state(p, k, back.data()).ok());
      EXPECT_EQ(back, st);
    }
  }
  std::vector<float> out(kSmall);
  EXPECT_FALSE(r.engine->read_state(1, 2, out.data()).ok());  // AdamW keeps two
  EXPECT_FALSE(r.engine->read_state(7, 0, out.data()).ok());
}

// torch skips a parameter whose grad is None: no update, no weight decay,
// its moments kept. A parameter no micro-batch of a step reduced is the same.
TEST(EngineForeign, AParameterNoMicroBatchReducedIsLeftAlone) {
  Rig r;
  const auto gb = Rig::grad(kBig, 0.01f), gs = Rig::grad(kSmall, 0.02f);
  ASSERT_TRUE(r.engine->begin_micro_batch(true).ok());
  ASSERT_TRUE(r.reduce_all(gb, gs).ok());
  ASSERT_TRUE(r.engine->step(1e-2).ok());
  const auto w1 = r.weights(1), w0 = r.weights(0);
  std::vector<float> m1(kSmall), m1_after(kSmall);
  ASSERT_TRUE(r.engine->read_state(1, 0, m1.data()).ok());
  ASSERT_TRUE(r.engine->begin_micro_batch(true).ok());
  ASSERT_TRUE(r.engine->reduce_grad(0, gb.data(), DType::kF32, r.stream).ok());  // only the big one
  ASSERT_TRUE(r.engine->step(1e-2).ok());
  EXPECT_EQ(r.weights(1), w1);  // weight decay 0.01 did not touch it
  ASSERT_TRUE(r.engine->read_state(1, 0, m1_after.data()).ok());
  EXPECT_EQ(m1_after, m1);
  EXPECT_NE(r.weights(0), w0);
}

// torch counts state['step'] per parameter: a parameter skipped in a step
// corrects its moments by the steps it took. "small" reduced in steps 1 and 3
// of one engine ends bit-identical to "small" reduced in steps 1 and 2 of
// another; its count survives a checkpoint (saved after step 2, loaded in a
// third engine, step 3 there equals step 3 here) and can be set from outside.
TEST(EngineForeign, EachParameterCountsItsOwnSteps) {
  const auto gb = Rig::grad(kBig, 0.01f), gs1 = Rig::grad(kSmall, 0.02f), gs3 = Rig::grad(kSmall, -0.03f);
  auto both = [&](Rig& r, const std::vector<float>& gs) {
    ASSERT_TRUE(r.engine->begin_micro_batch(true).ok());
    ASSERT_TRUE(r.reduce_all(gb, gs).ok());
    ASSERT_TRUE(r.engine->step(1e-2).ok());
  };
  Rig skipped, straight;
  both(skipped, gs1);
  ASSERT_TRUE(skipped.engine->begin_micro_batch(true).ok());
  ASSERT_TRUE(skipped.engine->reduce_grad(0, gb.data(), DType::kF32, skipped.stream).ok());
  ASSERT_TRUE(skipped.engine->step(1e-2).ok());
  EXPECT_EQ(skipped.engine->param_steps(0).value(), 2);
  EXPECT_EQ(skipped.engine->param_steps(1).value(), 1);
  char tmpl[] = "/tmp/strata-param-steps-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = std::string(tmpl) + "/ckpt";
  ASSERT_TRUE(skipped.engine->save_checkpoint(dir, "").ok());
  both(skipped, gs3);
  EXPECT_EQ(skipped.engine->param_steps(1).value(), 2);
  both(straight, gs1);
  both(straight, gs3);
  EXPECT_EQ(skipped.weights(1), straight.weights(1));

  Rig resumed;
  ASSERT_TRUE(resumed.engine->load_checkpoint(dir).ok());
  EXPECT_EQ(resumed.engine->param_steps(1).value(), 1);
  both(resumed, gs3);
  EXPECT_EQ(resumed.weights(1), skipped.weights(1));
  EXPECT_EQ(resumed.weights(0), skipped.weights(0));

  // Set from outside (a converted torch state): within 0..steps, between steps.
  EXPECT_FALSE(resumed.engine->set_param_steps(1, 4).ok());
  EXPECT_FALSE(resumed.engine->set_param_steps(1, -1).ok());
  ASSERT_TRUE(resumed.engine->set_param_steps(1, 3).ok());
  EXPECT_EQ(resumed.engine->param_steps(1).value(), 3);
  ASSERT_TRUE(resumed.engine->begin_micro_batch(true).ok());
  EXPECT_FALSE(resumed.engine->set_param_steps(1, 2).ok());
  std::filesystem::remove_all(tmpl);
}

TEST(EngineForeign, SummedMicroBatchesWhenTheCallerAveraged) {
  const auto want = clean_run(1);
  Rig r(/*accum=*/2, /*average=*/false);
  // torch's loss / accum: each micro-batch brings half the gradient.
  const auto gb = Rig::grad(kBig, 0.005f), gs = Rig::grad(kSmall, 0.01f);
  ASSERT_TRUE(r.engine->begin_micro_batch(false).ok());
  ASSERT_TRUE(r.reduce_all(gb, gs).ok());
  ASSERT_TRUE(r.engine->begin_micro_batch(true).ok());
  ASSERT_TRUE(r.reduce_all(gb, gs).ok());
  ASSERT_TRUE(r.engine->step(1e-2).ok());
  EXPECT_EQ(r.weights(0), want[0]);
  EXPECT_EQ(r.weights(1), want[1]);
}

}  // namespace
}  // namespace strata
