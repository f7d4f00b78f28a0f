// Counted holds of acquired groups (issue 12: tied weights, nested modules,
// autograd's saved views), on the host backend with gathered groups (compute
// copies homed in host RAM, so every acquire goes through a device buffer):
//   - a second acquire of a held group returns the same pointers and keeps
//     them until the last release; training through double holds equals
//     training through single ones, bit for bit;
//   - holds released on two different streams: the buffer is reused only
//     after both;
//   - strata.held_groups distinct groups may be held at once; one more than
//     the device buffers allow is refused by name;
//   - debug_poison_released: a view read after the last release is NaN, and
//     the next acquire has the right weights again;
//   - discard_step drops every hold.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "device/host_backend.h"
#include "runtime/engine.h"

namespace strata {
namespace {

constexpr int kGroups = 4;
constexpr uint64_t kNumel = 4096;

struct HoldRig {
  std::unique_ptr<DeviceBackend> dev;
  std::unique_ptr<Engine> engine;
  DeviceStream* stream = nullptr;

  explicit HoldRig(uint32_t prefetch = 0, uint32_t held = 1, bool poison = false) {
    dev = create_host_backend({}).value();
    EngineOptions eo;
    for (int g = 0; g < kGroups; ++g)
      eo.model.params.push_back({fmt::format("l{}.weight", g), {kNumel}, DType::kF32, fmt::format("l{}", g)});
    eo.config.optimizer.lr = 1e-2;
    eo.config.zero.offload_optimizer.device = OffloadDevice::kCpu;
    eo.config.zero.offload_param.device = OffloadDevice::kCpu;
    eo.config.strata.device_memory = 64ull << 20;
    eo.config.strata.device_reserve = 1ull << 20;
    eo.config.strata.prefetch_depth = prefetch;
    eo.config.strata.held_groups = held;
    eo.config.strata.debug_poison_released = poison;
    eo.device = dev.get();
    auto e = Engine::create(eo);
    EXPECT_TRUE(e.ok()) << e.status().to_string();
    engine = std::move(e).value();
    stream = dev->create_stream("caller").value();
    for (int g = 0; g < kGroups; ++g) {
      std::vector<float> w(kNumel);
      for (uint64_t i = 0; i < kNumel; ++i) w[i] = 0.01f * static_cast<float>(g + 1) + 1e-5f * static_cast<float>(i);
      EXPECT_TRUE(engine->load_param(g, w.data(), DType::kF32).ok());
    }
  }
  ~HoldRig() {
    engine.reset();
    (void)dev->destroy_stream(stream);
  }
  float first(const GroupView& v) {
    EXPECT_TRUE(dev->synchronize(stream).ok());
    return *static_cast<const float*>(v.ptr[0]);
  }
  std::vector<float> weights(ParamId p) {
    std::vector<float> v(kNumel);
    EXPECT_TRUE(engine->read_param(p, v.data(), DType::kF32).ok());
    return v;
  }
  // One step: each group acquired (`twice`: held twice, as a tied weight
  // is), its gradient a function of the weight it sees, released.
  void step(bool twice) {
    ASSERT_TRUE(engine->begin_micro_batch(true).ok());
    std::vector<float> g(kNumel);
    for (int gi = kGroups - 1; gi >= 0; --gi) {
      auto v = engine->acquire(gi, stream);
      ASSERT_TRUE(v.ok()) << v.status().to_string();
      if (twice) {
        auto again = engine->acquire(gi, stream);
        ASSERT_TRUE(again.ok()) << again.status().to_string();
        ASSERT_EQ(again->ptr[0], v->ptr[0]);
      }
      ASSERT_TRUE(dev->synchronize(stream).ok());
      const float* w = static_cast<const float*>(v->ptr[0]);
      for (uint64_t i = 0; i < kNumel; ++i) g[i] = w[i] - 0.02f;
      ASSERT_TRUE(engine->reduce_grad(gi, g.data(), DType::kF32, stream).ok());
      ASSERT_TRUE(engine->release(gi, stream).ok());
      if (twice) {
        ASSERT_TRUE(engine->release(gi, stream).ok());
      }
    }
    auto r = engine->step(1e-2);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
  }
};

TEST(EngineHolds, ASecondAcquireSharesTheBufferAndTrainingIsUnchanged) {
  HoldRig once, twice;
  for (int s = 0; s < 3; ++s) {
    once.step(false);
    twice.step(true);
  }
  for (int p = 0; p < kGroups; ++p) EXPECT_EQ(once.weights(p), twice.weights(p)) << "param " << p;

  HoldRig r;
  auto a = r.engine->acquire(1, r.stream);
  ASSERT_TRUE(a.ok());
  auto b = r.engine->acquire(1, r.stream);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(a->ptr[0], b->ptr[0]);
  ASSERT_TRUE(r.engine->release(1, r.stream).ok());
  // Still held once: a micro-batch cannot begin, the pointer still has l1.
  EXPECT_FALSE(r.engine->begin_micro_batch(true).ok());
  EXPECT_FLOAT_EQ(r.first(*a), 0.02f);
  ASSERT_TRUE(r.engine->release(1, r.stream).ok());
  EXPECT_FALSE(r.engine->release(1, r.stream).ok());  // not held any more
  EXPECT_TRUE(r.engine->begin_micro_batch(true).ok());
}

TEST(EngineHolds, ReleasesOnTwoStreamsBothGateReuse) {
  HoldRig r;
  DeviceStream* other = r.dev->create_stream("other").value();
  auto a = r.engine->acquire(0, r.stream);
  ASSERT_TRUE(a.ok());
  auto b = r.engine->acquire(0, other);
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(a->ptr[0], b->ptr[0]);
  // `other` still reads the buffer when the last release comes (on
  // r.stream, which is idle): the slot must not be overwritten until `other`
  // passes its own, earlier release.
  float seen = -1;
  const float* p = static_cast<const float*>(b->ptr[0]);
  ASSERT_TRUE(r.dev->host_func_async(other, [&seen, p] {
                     std::this_thread::sleep_for(std::chrono::milliseconds(50));
                     seen = *p;
                     return Status();
                   }).ok());
  ASSERT_TRUE(r.engine->release(0, other).ok());
  ASSERT_TRUE(r.engine->release(0, r.stream).ok());
  // Enough other groups to recycle every device buffer (prefetch 0, held 1:
  // two buffers).
  for (int g = 1; g < kGroups; ++g) {
    auto v = r.engine->acquire(g, r.stream);
    ASSERT_TRUE(v.ok()) << v.status().to_string();
    ASSERT_TRUE(r.engine->release(g, r.stream).ok());
  }
  ASSERT_TRUE(r.dev->synchronize(r.stream).ok());
  ASSERT_TRUE(r.dev->synchronize(other).ok());
  EXPECT_FLOAT_EQ(seen, 0.01f);
  (void)r.dev->destroy_stream(other);
}

TEST(EngineHolds, HeldGroupsPlansBuffersForDistinctHolds) {
  {
    // held_groups 1, prefetch 0: two buffers (one held, one cached); a third
    // distinct group held at once is refused by name.
    HoldRig r(0, 1);
    ASSERT_TRUE(r.engine->acquire(0, r.stream).ok());
    ASSERT_TRUE(r.engine->acquire(1, r.stream).ok());
    auto c = r.engine->acquire(2, r.stream);
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), StatusCode::kOutOfBudget);
    EXPECT_NE(c.status().message().find("strata.held_groups"), std::string::npos) << c.status().to_string();
    ASSERT_TRUE(r.engine->discard_step(r.stream).ok());
  }
  {
    HoldRig r(0, 3);
    EXPECT_EQ(r.engine->plan().held_groups, 3u);
    for (int g = 0; g < 4; ++g) {
      auto v = r.engine->acquire(g, r.stream);
      ASSERT_TRUE(v.ok()) << "group " << g << ": " << v.status().to_string();
    }
    // Every held view has its own group's weights.
    for (int g = 0; g < 4; ++g) {
      auto v = r.engine->acquire(g, r.stream);  // one more hold: the same buffer
      ASSERT_TRUE(v.ok());
      EXPECT_FLOAT_EQ(r.first(*v), 0.01f * static_cast<float>(g + 1)) << "group " << g;
    }
    // discard_step drops every hold, however many.
    ASSERT_TRUE(r.engine->discard_step(r.stream).ok());
    EXPECT_TRUE(r.engine->begin_micro_batch(true).ok());
  }
}

TEST(EngineHolds, PoisonedReleaseMakesAStaleViewNaN) {
  HoldRig r(1, 1, /*poison=*/true);
  auto a = r.engine->acquire(2, r.stream);
  ASSERT_TRUE(a.ok());
  EXPECT_FLOAT_EQ(r.first(*a), 0.03f);
  const float* stale = static_cast<const float*>(a->ptr[0]);
  ASSERT_TRUE(r.engine->release(2, r.stream).ok());
  ASSERT_TRUE(r.dev->synchronize(r.stream).ok());
  for (uint64_t i = 0; i < kNumel; i += 511) EXPECT_TRUE(std::isnan(stale[i])) << i;
  // The next acquire uploads it again.
  auto b = r.engine->acquire(2, r.stream);
  ASSERT_TRUE(b.ok());
  EXPECT_FLOAT_EQ(r.first(*b), 0.03f);
  ASSERT_TRUE(r.engine->release(2, r.stream).ok());
  // Training with poisoning on equals training without.
  HoldRig plain(1, 1, false), poisoned(1, 1, true);
  for (int s = 0; s < 2; ++s) {
    plain.step(false);
    poisoned.step(true);
  }
  for (int p = 0; p < kGroups; ++p) EXPECT_EQ(plain.weights(p), poisoned.weights(p)) << "param " << p;
}

}  // namespace
}  // namespace strata
