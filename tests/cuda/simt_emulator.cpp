// The fibers, barriers and collectives of simt_emulator.h.
#include "cuda/simt_emulator.h"

#include <ucontext.h>

#include <memory>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define STRATA_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define STRATA_EMU_ASAN 1
#endif
#endif
#ifdef STRATA_EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

namespace strata_emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;  // the kernels keep a few KiB of fragments per thread

enum class State { kRunnable, kAtWarpBarrier, kAtBlockBarrier, kDone };

struct Fiber {
  ucontext_t ctx{};
  std::unique_ptr<char[]> stack;
  Dim3 tid;
  int linear = 0;
  State state = State::kRunnable;
  void* fake_stack = nullptr;  // ASan's, while the fiber is switched out
};

// Values a warp exchanges in one collective.
struct WarpSlots {
  float f[32];
  uint32_t a[32][4];
  uint32_t b[32][2];
  float c[32][4];
  float d[32][4];
  bool d_ready = false;  // the warp's product is computed once, by its first lane past the barrier
};

struct Runner {
  ucontext_t scheduler{};
  const void* scheduler_stack = nullptr;  // the launching thread's stack, for ASan
  size_t scheduler_stack_bytes = 0;
  std::vector<Fiber> fibers;
  std::vector<WarpSlots> warps;
  std::vector<unsigned char> shared;
  Dim3 grid, block, block_idx;
  const std::function<void()>* kernel = nullptr;
  Fiber* current = nullptr;
};

Runner* g_runner = nullptr;

// ASan must be told about every stack switch (or it reports the fibers'
// frames as stack overflows and use-after-returns).
void start_switch(void** fake_stack_save, const void* bottom, size_t bytes) {
#ifdef STRATA_EMU_ASAN
  __sanitizer_start_switch_fiber(fake_stack_save, bottom, bytes);
#else
  (void)fake_stack_save, (void)bottom, (void)bytes;
#endif
}
void finish_switch(void* fake_stack_save, const void** bottom_old, size_t* bytes_old) {
#ifdef STRATA_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake_stack_save, bottom_old, bytes_old);
#else
  (void)fake_stack_save, (void)bottom_old, (void)bytes_old;
#endif
}

void fiber_entry() {
  Runner& r = *g_runner;
  Fiber* self = r.current;
  finish_switch(nullptr, &r.scheduler_stack, &r.scheduler_stack_bytes);
  (*r.kernel)();
  self->state = State::kDone;
  start_switch(nullptr, r.scheduler_stack, r.scheduler_stack_bytes);  // leaving for good: no fake stack kept
  // Returning resumes uc_link, the scheduler.
}

void resume(Fiber& f) {
  Runner& r = *g_runner;
  r.current = &f;
  void* fake = nullptr;
  start_switch(&fake, f.stack.get(), kStackBytes);
  swapcontext(&r.scheduler, &f.ctx);
  finish_switch(fake, nullptr, nullptr);
}

// Called on a fiber: wait at a barrier until the scheduler releases it.
void wait_at(State barrier) {
  Runner& r = *g_runner;
  Fiber* self = r.current;
  self->state = barrier;
  start_switch(&self->fake_stack, r.scheduler_stack, r.scheduler_stack_bytes);
  swapcontext(&self->ctx, &r.scheduler);
  finish_switch(self->fake_stack, nullptr, nullptr);
}

float bf16_value(uint32_t reg, bool high) {
  const uint32_t bits = (high ? reg >> 16 : reg & 0xffffu) << 16;
  return load<float>(&bits);
}

std::string describe_wait(const Runner& r) {
  std::string s = "deadlock in block (" + std::to_string(r.block_idx.x) + ", " + std::to_string(r.block_idx.y) + ", " +
                  std::to_string(r.block_idx.z) + "):";
  const char* names[] = {"running", "at a warp collective", "at __syncthreads", "exited"};
  size_t i = 0;
  while (i < r.fibers.size()) {
    size_t j = i;
    while (j + 1 < r.fibers.size() && r.fibers[j + 1].state == r.fibers[i].state) ++j;
    s += " threads " + std::to_string(i) + "-" + std::to_string(j) + " " + names[static_cast<int>(r.fibers[i].state)] +
         ";";
    i = j + 1;
  }
  return s;
}

// Runs one block to its end. "" or the deadlock.
std::string run_block(Runner& r, bool reverse) {
  const size_t n = r.fibers.size();
  for (size_t i = 0; i < n; ++i) {
    Fiber& f = r.fibers[i];
    f.state = State::kRunnable;
    f.fake_stack = nullptr;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.get();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &r.scheduler;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  // Warp by warp: a warp's lanes run (and pass their warp collectives) until
  // every lane waits at __syncthreads or has exited; then the next warp.
  // So one warp runs a whole phase between two __syncthreads before the
  // others start it: a shared-memory read that a missing barrier leaves
  // unordered sees the other warps' data not yet written (a read too
  // early) or already overwritten (a write too early).
  const size_t warps = n / 32;
  for (;;) {
    for (size_t k = 0; k < warps; ++k) {
      const size_t w = reverse ? warps - 1 - k : k;
      for (;;) {
        for (size_t l = 0; l < 32; ++l) {
          Fiber& f = r.fibers[w * 32 + (reverse ? 31 - l : l)];
          if (f.state == State::kRunnable) resume(f);
        }
        int at_warp = 0;
        for (size_t l = 0; l < 32; ++l) at_warp += r.fibers[w * 32 + l].state == State::kAtWarpBarrier;
        if (at_warp == 0) break;  // at __syncthreads or exited
        if (at_warp < 32) return describe_wait(r) + " (a warp collective needs all 32 lanes of the warp)";
        for (size_t l = 0; l < 32; ++l) r.fibers[w * 32 + l].state = State::kRunnable;
      }
    }
    size_t done = 0;
    for (const Fiber& f : r.fibers) done += f.state == State::kDone;
    if (done == n) return "";
    // Every live thread waits at __syncthreads (exited ones do not count,
    // as on Volta and later): release the block.
    for (Fiber& f : r.fibers)
      if (f.state == State::kAtBlockBarrier) f.state = State::kRunnable;
  }
}

}  // namespace

const Dim3& thread_idx() {
  return g_runner->current->tid;
}
const Dim3& block_idx() {
  return g_runner->block_idx;
}
const Dim3& block_dim() {
  return g_runner->block;
}
unsigned char* dynamic_shared() {
  return g_runner->shared.data();
}

void syncthreads() {
  wait_at(State::kAtBlockBarrier);
}

float shfl_xor(float v, int lane_mask) {
  Runner& r = *g_runner;
  const int lane = r.current->linear & 31;
  WarpSlots& s = r.warps[r.current->linear >> 5];
  s.f[lane] = v;
  wait_at(State::kAtWarpBarrier);
  const float got = s.f[(lane ^ lane_mask) & 31];
  wait_at(State::kAtWarpBarrier);  // nobody overwrites the slots before every lane has read
  return got;
}

void mma16816_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  Runner& r = *g_runner;
  const int lane = r.current->linear & 31;
  WarpSlots& s = r.warps[r.current->linear >> 5];
  for (int i = 0; i < 4; ++i) {
    s.a[lane][i] = a[i];
    s.c[lane][i] = d[i];
  }
  s.b[lane][0] = b0;
  s.b[lane][1] = b1;
  s.d_ready = false;
  wait_at(State::kAtWarpBarrier);
  if (!s.d_ready) {
    // A(row, col): lane 4 (row % 8) + (col % 8) / 2, register (row >= 8) +
    // 2 (col >= 8), the high half for an odd column. B(k, n): lane
    // 4 n + (k % 8) / 2, register k >= 8, the high half for an odd k.
    float A[16][16], B[16][8];
    for (int row = 0; row < 16; ++row)
      for (int col = 0; col < 16; ++col)
        A[row][col] = bf16_value(s.a[4 * (row % 8) + (col % 8) / 2][(row >= 8 ? 1 : 0) + (col >= 8 ? 2 : 0)], col & 1);
    for (int k = 0; k < 16; ++k)
      for (int n = 0; n < 8; ++n) B[k][n] = bf16_value(s.b[4 * n + (k % 8) / 2][k >= 8 ? 1 : 0], k & 1);
    // D = A B + C, lane by lane: c_i at row group + 8 (i >= 2), column
    // 2 threadID_in_group + (i & 1).
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < 4; ++i) {
        const int row = (l >> 2) + (i >= 2 ? 8 : 0), col = 2 * (l & 3) + (i & 1);
        float acc = s.c[l][i];
        for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];  // bf16 x bf16 is exact in fp32
        s.d[l][i] = acc;
      }
    s.d_ready = true;
  }
  for (int i = 0; i < 4; ++i) d[i] = s.d[lane][i];
  wait_at(State::kAtWarpBarrier);  // nobody overwrites the slots before every lane has read
}

uint16_t bf16_bits(float x) {
  const uint32_t u = load<uint32_t>(&x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

std::string launch(Dim3 grid, Dim3 block, size_t shared_bytes, const std::function<void()>& kernel, bool reverse) {
  const size_t n = static_cast<size_t>(block.x) * block.y * block.z;
  if (n == 0 || n % 32 != 0 || n > 1024)
    return "a block of " + std::to_string(n) + " threads (32 to 1024, whole warps)";
  if (g_runner) return "another launch is running";
  Runner r;
  r.grid = grid;
  r.block = block;
  r.kernel = &kernel;
  r.fibers.resize(n);
  r.warps.resize(n / 32);
  for (size_t i = 0; i < n; ++i) {
    Fiber& f = r.fibers[i];
    f.stack = std::make_unique<char[]>(kStackBytes);
    f.linear = static_cast<int>(i);
    f.tid = {static_cast<unsigned>(i % block.x), static_cast<unsigned>((i / block.x) % block.y),
             static_cast<unsigned>(i / (static_cast<size_t>(block.x) * block.y))};
  }
  g_runner = &r;
  std::string err;
  for (unsigned z = 0; z < grid.z && err.empty(); ++z)
    for (unsigned y = 0; y < grid.y && err.empty(); ++y)
      for (unsigned x = 0; x < grid.x && err.empty(); ++x) {
        r.block_idx = {x, y, z};
        r.shared.assign(shared_bytes, 0xFF);
        err = run_block(r, reverse);
      }
  g_runner = nullptr;
  return err;
}

}  // namespace strata_emu
