// A CPU emulation of the few CUDA features Strata's warp-level kernels use,
// so that their source runs in every CI job, where there is no GPU
// (cuda/train/attention_mma_kernels.cuh is written against it).
//
// Each block's threads run as fibers (ucontext) on the calling thread, one
// at a time, each until it reaches a barrier: __syncthreads() (the block) or
// a warp collective (__shfl_xor_sync, mma16816_bf16), which exchange values
// through per-warp slots between two warp barriers. A warp runs a whole
// phase (up to the next __syncthreads) before the next warp starts it;
// blocks run one after another. What this catches: wrong indices, tiles,
// masks and fragment layouts (the kernel's numbers against a reference), a
// missing __syncthreads (a warp that runs ahead reads shared memory the
// others have not written yet, the 0xFF fill, or overwrites what they have
// still to read; launch() runs the warps in ascending or descending order,
// and the two must agree), and barriers reached by only part of a warp (a
// deadlock, reported by launch() with who waits where). What it cannot: timing, occupancy, bank conflicts, the
// hardware's own rounding inside an mma (here products are exact and sums
// run in fp32 in k order; the tensor cores sum in an unspecified order).
//
// mma16816_bf16 implements mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
// from the PTX ISA's fragment layouts ("Matrix fragments for mma.m16n8k16
// with floating point type"), lane = 4 * groupID + threadID_in_group:
//   A: a_i (i = 0..7, two per 32-bit register, low half first):
//      row = groupID for i in {0,1,4,5}, groupID + 8 otherwise;
//      col = 2 * threadID_in_group + (i & 1), + 8 for i >= 4.
//   B: b_i (i = 0..3): row (k) = 2 * threadID_in_group + (i & 1), + 8 for
//      i >= 2; col (n) = groupID.
//   C, D (fp32): c_i: row = groupID for i < 2, groupID + 8 otherwise;
//      col = 2 * threadID_in_group + (i & 1).
//
// Not thread-safe: one launch at a time per process.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>

namespace strata_emu {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

const Dim3& thread_idx();
const Dim3& block_idx();
const Dim3& block_dim();
// This block's dynamic shared memory (filled with 0xFF bytes, a NaN in bf16
// and fp32, before the block starts).
unsigned char* dynamic_shared();

void syncthreads();
float shfl_xor(float v, int lane_mask);
// d += A B for the calling lane's fragments (see the layouts above).
void mma16816_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
uint16_t bf16_bits(float x);  // round to nearest even; NaN stays NaN

// Runs `kernel` for every block of `grid` with `block` threads each and
// `shared_bytes` of dynamic shared memory; threads run in ascending order of
// threadIdx, or descending with `reverse`. Returns "" or what went wrong (a
// deadlock: which threads wait at which barrier).
std::string launch(Dim3 grid, Dim3 block, size_t shared_bytes, const std::function<void()>& kernel,
                   bool reverse = false);

template <typename T, typename P>
inline T load(const P* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename P, typename T>
inline void store(P* p, const T& v) {
  std::memcpy(p, &v, sizeof v);
}

}  // namespace strata_emu

// The CUDA spellings the kernels use.
struct float2 {
  float x, y;
};
struct float4 {
  float x, y, z, w;
};
struct uint2 {
  uint32_t x, y;
};
inline float2 make_float2(float x, float y) {
  return {x, y};
}
inline float4 make_float4(float x, float y, float z, float w) {
  return {x, y, z, w};
}
inline int min(int a, int b) {
  return a < b ? a : b;
}

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define threadIdx (::strata_emu::thread_idx())
#define blockIdx (::strata_emu::block_idx())
#define blockDim (::strata_emu::block_dim())
#define __syncthreads() ::strata_emu::syncthreads()
#define __shfl_xor_sync(mask, v, lane_mask) ::strata_emu::shfl_xor((v), (lane_mask))
#define STRATA_DYNAMIC_SHARED(name) unsigned char* name = ::strata_emu::dynamic_shared()
