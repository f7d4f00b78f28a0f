// The pinned pool: alignment, reuse, the hard budget, registrars, and no leaks
// on any error path (LeakSanitizer checks the last under STRATA_SANITIZE).
#include "io/pinned_pool.h"

#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <thread>
#include <vector>

namespace strata::io {
namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

std::unique_ptr<PinnedPool> make_pool(std::size_t budget, std::size_t slab = 4 * MiB,
                                      std::vector<HostMemoryRegistrar*> regs = {}) {
  PinnedPoolOptions o;
  o.budget_bytes = budget;
  o.slab_bytes = slab;
  o.registrars = std::move(regs);
  auto p = PinnedPool::create(o);
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  return p.ok() ? std::move(p).value() : nullptr;
}

class CountingRegistrar : public HostMemoryRegistrar {
 public:
  explicit CountingRegistrar(int fail_on = -1) : fail_on_(fail_on) {}
  const char* name() const override { return "counting"; }
  Status register_memory(void* p, std::size_t) override {
    if (calls_++ == fail_on_) return Status(StatusCode::kOutOfMemory, "refused (test)");
    live_.insert(p);
    return {};
  }
  void unregister_memory(void* p) override { live_.erase(p); }
  std::set<void*> live_;
  int calls_ = 0;
  int fail_on_;
};

TEST(PinnedPool, AlignedBuffersAndReuse) {
  auto pool = make_pool(16 * MiB);
  ASSERT_TRUE(pool);
  auto a = pool->allocate(1);
  auto b = pool->allocate(5000);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a->data()) % 4096, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b->data()) % 4096, 0u);
  EXPECT_EQ(b->size(), 5000u);
  std::memset(b->data(), 1, b->size());
  EXPECT_EQ(pool->slab_count(), 1u);
  EXPECT_EQ(pool->used_bytes(), 4096u + 8192u);
  void* first = a->data();
  a->reset();
  auto c = pool->allocate(4096);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->data(), first);  // freed space is used again
  PinnedBuffer moved = std::move(c).value();
  EXPECT_TRUE(moved);
  moved.reset();
  b->reset();
  EXPECT_EQ(pool->used_bytes(), 0u);
  EXPECT_EQ(pool->mapped_bytes(), 4 * MiB);  // slabs stay for the next buffers
  pool->trim();
  EXPECT_EQ(pool->mapped_bytes(), 0u);
}

TEST(PinnedPool, BudgetExceededSaysHowMuchWasAskedAndIsLeft) {
  auto pool = make_pool(10 * MiB, 4 * MiB);
  ASSERT_TRUE(pool);
  auto big = pool->allocate(6 * MiB);  // a slab of its own
  ASSERT_TRUE(big.ok());
  auto more = pool->allocate(3 * MiB);  // the rest of the budget (4 MiB) as a usual slab
  ASSERT_TRUE(more.ok()) << more.status().to_string();
  auto over = pool->allocate(2 * MiB);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kOutOfBudget);
  const std::string& m = over.status().message();
  EXPECT_NE(m.find("asked for 2097152 bytes"), std::string::npos) << m;
  EXPECT_NE(m.find("only 0 of the 10485760-byte budget"), std::string::npos) << m;
  EXPECT_LE(pool->mapped_bytes(), 10 * MiB);
  // One request larger than the whole budget.
  EXPECT_EQ(pool->allocate(11 * MiB).status().code(), StatusCode::kOutOfBudget);
  // Releasing the big one makes room again (its slab is unmapped at once).
  big->reset();
  EXPECT_EQ(pool->mapped_bytes(), 4 * MiB);
  auto again = pool->allocate(5 * MiB);
  EXPECT_TRUE(again.ok()) << again.status().to_string();
}

// Sizes near 2^64 used to wrap to 0 when rounded to the alignment: the pool
// then handed out a "SIZE_MAX-byte" buffer carved from a 4 MiB slab.
TEST(PinnedPool, HugeRequestsAreOverBudgetNotWrapped) {
  auto pool = make_pool(16 * MiB);
  ASSERT_TRUE(pool);
  for (std::size_t bytes : {~std::size_t{0}, ~std::size_t{0} - 100, ~std::size_t{0} - 4095}) {
    auto b = pool->allocate(bytes);
    EXPECT_FALSE(b.ok()) << bytes << " bytes gave a buffer of " << b->size();
    if (!b.ok()) {
      EXPECT_EQ(b.status().code(), StatusCode::kOutOfBudget);
      EXPECT_NE(b.status().message().find("asked for " + std::to_string(bytes) + " bytes"), std::string::npos)
          << b.status().message();
    }
  }
  EXPECT_EQ(pool->used_bytes(), 0u);
  EXPECT_EQ(pool->mapped_bytes(), 0u);
}

TEST(PinnedPool, EmptySlabsAreGivenBackBeforeRefusing) {
  auto pool = make_pool(8 * MiB, 4 * MiB);
  ASSERT_TRUE(pool);
  {
    auto a = pool->allocate(4 * MiB);
    auto b = pool->allocate(4 * MiB);
    ASSERT_TRUE(a.ok() && b.ok());
  }
  EXPECT_EQ(pool->mapped_bytes(), 8 * MiB);
  auto big = pool->allocate(8 * MiB);  // needs both empty slabs unmapped first
  EXPECT_TRUE(big.ok()) << big.status().to_string();
}

TEST(PinnedPool, RegistrarsSeeEverySlabAndFailuresLeaveNothingBehind) {
  CountingRegistrar ok_reg;
  CountingRegistrar failing(/*fail_on=*/1);  // refuses the second slab
  {
    auto pool = make_pool(64 * MiB, 2 * MiB, {&ok_reg, &failing});
    ASSERT_TRUE(pool);
    auto a = pool->allocate(2 * MiB);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(ok_reg.live_.size(), 1u);
    EXPECT_EQ(failing.live_.size(), 1u);
    auto b = pool->allocate(2 * MiB);
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), StatusCode::kOutOfMemory);
    EXPECT_NE(b.status().message().find("counting"), std::string::npos) << b.status().message();
    // The refused slab was unregistered from the first registrar and unmapped.
    EXPECT_EQ(ok_reg.live_.size(), 1u);
    EXPECT_EQ(pool->mapped_bytes(), 2 * MiB);
  }
  EXPECT_TRUE(ok_reg.live_.empty());
  EXPECT_TRUE(failing.live_.empty());
}

TEST(PinnedPool, RejectsBadOptions) {
  PinnedPoolOptions o;
  EXPECT_EQ(PinnedPool::create(o).status().code(), StatusCode::kInvalidArgument);
  o.budget_bytes = MiB;
  o.alignment = 3000;
  EXPECT_EQ(PinnedPool::create(o).status().code(), StatusCode::kInvalidArgument);
  o.alignment = 4096;
  auto p = PinnedPool::create(o);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)->allocate(0).status().code(), StatusCode::kInvalidArgument);
}

TEST(PinnedPool, ConcurrentAllocateAndRelease) {
  auto pool = make_pool(32 * MiB, 4 * MiB);
  ASSERT_TRUE(pool);
  std::vector<std::thread> ts;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        auto b = pool->allocate(4096 * (1 + (i + t) % 64));
        if (!b.ok()) {
          failures.fetch_add(1);
          continue;
        }
        std::memset(b->data(), t, b->size());
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(pool->used_bytes(), 0u);
  EXPECT_LE(pool->mapped_bytes(), 32 * MiB);
}

}  // namespace
}  // namespace strata::io
