// Causal GQA attention on tensor cores, flash-attention style (see
// attention_mma.cuh for the contract and the numerics).
//
// Shape of the work. Tiles of 64 query rows and 64 keys; a block of 4 warps,
// each warp owning 16 rows of its block's tile. Operands are staged in shared
// memory as bf16 (rows padded by 8 elements, so that the fragment loads below
// hit 32 different banks) and multiplied with
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32.
//   forward  (grid: query tiles x heads): S = Q K^T per key tile, online
//            softmax in fp32 registers, O += P V; writes O / l and the row's
//            log-sum-exp. No T x T matrix anywhere.
//   delta    rowsum(dO * O) per (row, head), one warp each.
//   dK, dV   (grid: key tiles x kv heads): per head of the group and per
//            query tile at or after the key tile, recompute S^T = K Q^T and
//            P^T from the log-sum-exp, dV += P^T dO, dP^T = V dO^T,
//            dS^T = P^T (dP^T - delta), dK += dS^T Q.
//   dQ       (grid: query tiles x heads): per key tile up to the diagonal,
//            recompute P and dS the same way, dQ += dS K.
// dQ has a pass of its own (P and dS recomputed twice) rather than the
// atomicAdd into dQ of FlashAttention-2's backward: every sum here runs in a
// fixed order, so results repeat bit for bit.
//
// Fragments of m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16 with
// floating point type"), lane = 4 g + t:
//   A 16x16 (row): a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..),
//                  a[3] = (g+8, 2t+8..); the lower column in the low 16 bits.
//   B 16x8 (col):  b[0] = (k = 2t..2t+1, n = g), b[1] = (k = 2t+8.., n = g).
//   C 16x8 fp32:   c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..2t+1).
// So the C fragments of two adjacent 8-column tiles are, packed to bf16, the
// A fragment of the 16-column slice they cover: P and dS go from one product
// to the next in registers.
//
// The operands are loaded into fragments with 32-bit (and, for the
// transposed ones, 16-bit) shared-memory loads: simpler than ldmatrix to get
// right before this has run on a GPU, at some cost in shared-memory
// bandwidth. ldmatrix and double-buffered cp.async tiles are the next step
// once a GPU has checked these against the fp32 kernels.
//
// This header holds only device code, so that the same source also runs on
// the CPU: tests/cuda/attention_mma_emulated_test.cpp includes it with
// STRATA_CUDA_EMULATE defined after tests/cuda/simt_emulator.h, which runs
// each block's threads as fibers and supplies the intrinsics used here
// (shuffles, barriers, bf16 rounding, and mma16816 per the fragment layouts
// above). The launches are in attention_mma.cu.
#pragma once

#ifndef STRATA_CUDA_EMULATE
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#endif

#include <cmath>
#include <cstdint>

// Kernel bodies exist for sm_80+ (mma.sync with bf16) and in the emulation.
#if defined(STRATA_CUDA_EMULATE) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
#define STRATA_ATTN_MMA_BODY 1
#else
#define STRATA_ATTN_MMA_BODY 0
#endif

namespace strata_cuda_train {
namespace attn_mma {

constexpr int kTile = 64;  // query rows per block (forward, dQ), keys per block (dK, dV)
constexpr int kWarps = 4;  // 16 rows of the tile each
constexpr int kBlock = kWarps * 32;
constexpr int kPad = 8;  // bf16 elements of padding per shared row
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Shared bytes: the forward stages Q, K and V tiles (bf16, padded rows); the
// backward Q, dO, K and V tiles and two floats per row (log-sum-exp, delta).
constexpr size_t tile_bytes(int hd) {
  return static_cast<size_t>(kTile) * (hd + kPad) * sizeof(uint16_t);
}
constexpr size_t fwd_smem(int hd) {
  return 3 * tile_bytes(hd);
}
constexpr size_t bwd_smem(int hd) {
  return 4 * tile_bytes(hd) + 2 * kTile * sizeof(float);
}

// The few operations that differ between the GPU and the emulation: bf16
// rounding and the wide loads and stores (plain casts on the GPU, memcpy on
// the host, where the casts would break C++'s aliasing rules).
#ifndef STRATA_CUDA_EMULATE
#define STRATA_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
__device__ __forceinline__ uint16_t bf16_bits(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
__device__ __forceinline__ uint32_t ld32(const uint16_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}
__device__ __forceinline__ float4 ld_f4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ void st_u2(uint16_t* p, uint2 v) {
  *reinterpret_cast<uint2*>(p) = v;
}
__device__ __forceinline__ void st_f2(float* p, float2 v) {
  *reinterpret_cast<float2*>(p) = v;
}
#else
__device__ __forceinline__ uint16_t bf16_bits(float x) {
  return strata_emu::bf16_bits(x);
}
__device__ __forceinline__ uint32_t ld32(const uint16_t* p) {
  return strata_emu::load<uint32_t>(p);
}
__device__ __forceinline__ float4 ld_f4(const float* p) {
  return strata_emu::load<float4>(p);
}
__device__ __forceinline__ void st_u2(uint16_t* p, uint2 v) {
  strata_emu::store(p, v);
}
__device__ __forceinline__ void st_f2(float* p, float2 v) {
  strata_emu::store(p, v);
}
#endif
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return static_cast<uint32_t>(bf16_bits(lo)) | (static_cast<uint32_t>(bf16_bits(hi)) << 16);
}
__device__ __forceinline__ uint32_t ld2x16(const uint16_t* lo, const uint16_t* hi) {
  return static_cast<uint32_t>(*lo) | (static_cast<uint32_t>(*hi) << 16);
}

// d += a * b (16x16 bf16 times 16x8 bf16, fp32 accumulation).
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(STRATA_CUDA_EMULATE)
  strata_emu::mma16816_bf16(d, a, b0, b1);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// A fragment of the 16x16 slice at (r0, c0) of a row-major shared tile
// (element (r, c) at s[r * stride + c]).
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const uint16_t* s, int stride, int r0, int c0, int g, int t) {
  const uint16_t* p = s + (r0 + g) * stride + c0 + 2 * t;
  a[0] = ld32(p);
  a[1] = ld32(p + 8 * stride);
  a[2] = ld32(p + 8);
  a[3] = ld32(p + 8 * stride + 8);
}

// B fragment (16 x 8) whose element (k, n) is s[(n0 + n) * stride + k0 + k]:
// the tile holds B's transpose row-major (K for Q K^T, Q for K Q^T, ...).
__device__ __forceinline__ void load_b_t(uint32_t& b0, uint32_t& b1, const uint16_t* s, int stride, int k0, int n0,
                                         int g, int t) {
  const uint16_t* p = s + (n0 + g) * stride + k0 + 2 * t;
  b0 = ld32(p);
  b1 = ld32(p + 8);
}

// B fragment (16 x 8) whose element (k, n) is s[(k0 + k) * stride + n0 + n]:
// the tile holds B row-major (V for P V, dO for P^T dO, ...).
__device__ __forceinline__ void load_b(uint32_t& b0, uint32_t& b1, const uint16_t* s, int stride, int k0, int n0, int g,
                                       int t) {
  const uint16_t* p = s + (k0 + 2 * t) * stride + n0 + g;
  b0 = ld2x16(p, p + stride);
  b1 = ld2x16(p + 8 * stride, p + 9 * stride);
}

// The A fragment of the 16-column slice covered by the C fragments c0 (its
// columns 0-7) and c1 (columns 8-15), rounded to bf16.
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack2(c0[0], c0[1]);
  a[1] = pack2(c0[2], c0[3]);
  a[2] = pack2(c1[0], c1[1]);
  a[3] = pack2(c1[2], c1[3]);
}

// Stages rows [0, valid) of a tile from fp32 global memory (row r at
// src + r * row_stride, hd floats, 16-byte aligned) into shared bf16; rows
// from `valid` to kTile become zeros. Every thread of the block takes part.
template <int HD>
__device__ __forceinline__ void stage_tile(uint16_t* dst, const float* src, int64_t row_stride, int valid) {
  constexpr int kStride = HD + kPad;
  constexpr int kVecs = HD / 4;
  for (int i = threadIdx.x; i < kTile * kVecs; i += kBlock) {
    const int r = i / kVecs, c = (i % kVecs) * 4;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < valid) x = ld_f4(src + r * row_stride + c);
    uint2 packed;
    packed.x = pack2(x.x, x.y);
    packed.y = pack2(x.z, x.w);
    st_u2(dst + r * kStride + c, packed);
  }
}

// Rows [0, valid) of a [B, H, T] row vector (at src), times `mul`; zeros
// after.
__device__ __forceinline__ void stage_rows(float* dst, const float* src, int valid, float mul) {
  for (int i = threadIdx.x; i < kTile; i += kBlock) dst[i] = i < valid ? src[i] * mul : 0.0f;
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// ------------------------------------------------------------------ forward
// Grid (B * query tiles, H). Thread (warp w, g, t) owns query rows
// r0 = q0 + 16 w + g and r0 + 8, and of each 8-column piece of S and O the
// columns 2t, 2t + 1. Scores are kept in log2 units (scale * log2 e folded
// in), so the exponentials are exp2f.
template <int HD>
__global__ void __launch_bounds__(kBlock)
    attn_fwd_mma(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                 float* __restrict__ out, float* __restrict__ lse, int T, int H, int KVH, float scale_log2) {
#if STRATA_ATTN_MMA_BODY
  constexpr int S = HD + kPad;
  STRATA_DYNAMIC_SHARED(smem_raw);
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* ks = qs + kTile * S;
  uint16_t* vs = ks + kTile * S;
  const int ntiles = (T + kTile - 1) / kTile;
  const int qt = static_cast<int>(blockIdx.x % ntiles);
  const int64_t b = blockIdx.x / ntiles;
  const int h = blockIdx.y, kvh = h / (H / KVH);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t qd = static_cast<int64_t>(H) * HD, kd = static_cast<int64_t>(KVH) * HD;
  const int q0 = qt * kTile;
  stage_tile<HD>(qs, q + (b * T + q0) * qd + h * HD, qd, min(kTile, T - q0));
  __syncthreads();
  uint32_t qf[HD / 16][4];
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) load_a(qf[kk], qs, S, warp * 16, kk * 16, g, t);

  float o[HD / 8][4];
#pragma unroll
  for (int dn = 0; dn < HD / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const int rows[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};

  for (int kt = 0; kt <= qt; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // every warp is done with the previous K and V tiles
    stage_tile<HD>(ks, k + (b * T + k0) * kd + kvh * HD, kd, min(kTile, T - k0));
    stage_tile<HD>(vs, v + (b * T + k0) * kd + kvh * HD, kd, min(kTile, T - k0));
    __syncthreads();
    float s[kTile / 8][4];
#pragma unroll
    for (int nt = 0; nt < kTile / 8; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t b0, b1;
        load_b_t(b0, b1, ks, S, kk * 16, nt * 8, g, t);
        mma16816(s[nt], qf[kk], b0, b1);
      }
    }
    // Causal mask (key <= row; rows past T see nothing), scale, row maxima.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < kTile / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = rows[e >> 1], key = k0 + nt * 8 + 2 * t + (e & 1);
        const float x = (key <= row && row < T) ? s[nt][e] * scale_log2 : -INFINITY;
        s[nt][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    float corr[2], base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m[r], quad_max(mx[r]));
      base[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet: exp2f(-inf) = 0 below
      corr[r] = exp2f(m[r] - base[r]);              // 0 on the row's first keys (m = -inf)
      m[r] = m_new;
    }
    float psum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < kTile / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = exp2f(s[nt][e] - base[e >> 1]);
        s[nt][e] = p;
        psum[e >> 1] += p;
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = l[r] * corr[r] + psum[r];  // this thread's columns; quad sum at the end
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn) {
      o[dn][0] *= corr[0];
      o[dn][1] *= corr[0];
      o[dn][2] *= corr[1];
      o[dn][3] *= corr[1];
    }
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      uint32_t pa[4];
      c_to_a(pa, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int dn = 0; dn < HD / 8; ++dn) {
        uint32_t b0, b1;
        load_b(b0, b1, vs, S, kk * 16, dn * 8, g, t);
        mma16816(o[dn], pa, b0, b1);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float L = quad_sum(l[r]);  // row r has key 0 at least: L >= 1 when row < T
    if (rows[r] >= T) continue;
    const float inv = 1.0f / L;
    float* orow = out + (b * T + rows[r]) * qd + h * HD;
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn)
      st_f2(orow + dn * 8 + 2 * t, make_float2(o[dn][2 * r] * inv, o[dn][2 * r + 1] * inv));
    if (t == 0) lse[(b * H + h) * T + rows[r]] = (m[r] + log2f(L)) * kLn2;
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // code for an arch below sm_80: prepare() refuses it, so it never runs
#endif
}

// ------------------------------------------------------------------ backward
// delta[b, h, i] = sum_c dout[row, h, c] * out[row, h, c]; one warp per
// (row, head), lanes over c, then a fixed butterfly.
static __global__ void attn_delta(const float* __restrict__ out, const float* __restrict__ dout,
                                  float* __restrict__ delta, int64_t rows, int T, int H, int hd) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (idx >= rows * H) return;
  const int lane = threadIdx.x & 31;
  const int64_t r = idx / H;
  const int h = static_cast<int>(idx % H);
  const float* o = out + (r * H + h) * hd;
  const float* d = dout + (r * H + h) * hd;
  float s = 0.0f;
  for (int c = lane; c < hd; c += 32) s += o[c] * d[c];
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) delta[((r / T) * H + h) * T + r % T] = s;
}

// Grid (B * key tiles, KVH). Warp w owns keys kw = k0 + 16 w .. + 15 and
// accumulates their dK and dV over the group's heads and the query tiles
// from the key tile on, in 16-query slices (ascending: a fixed order). C
// fragments here are (key, query) for S^T / dP^T and (key, d) for dK / dV.
template <int HD>
__global__ void __launch_bounds__(kBlock)
    attn_bwd_kv_mma(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                    const float* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                    float* __restrict__ dk, float* __restrict__ dv, int T, int H, int KVH, float scale_log2,
                    float scale) {
#if STRATA_ATTN_MMA_BODY
  constexpr int S = HD + kPad;
  STRATA_DYNAMIC_SHARED(smem_raw);
  uint16_t* ks = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* vs = ks + kTile * S;
  uint16_t* qs = vs + kTile * S;
  uint16_t* dos = qs + kTile * S;
  float* lse2 = reinterpret_cast<float*>(dos + kTile * S);  // log2 units
  float* dl = lse2 + kTile;
  const int ntiles = (T + kTile - 1) / kTile;
  const int kt = static_cast<int>(blockIdx.x % ntiles);
  const int64_t b = blockIdx.x / ntiles;
  const int kvh = blockIdx.y, group = H / KVH;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t qd = static_cast<int64_t>(H) * HD, kd = static_cast<int64_t>(KVH) * HD;
  const int k0 = kt * kTile, kw = k0 + warp * 16;
  stage_tile<HD>(ks, k + (b * T + k0) * kd + kvh * HD, kd, min(kTile, T - k0));
  stage_tile<HD>(vs, v + (b * T + k0) * kd + kvh * HD, kd, min(kTile, T - k0));

  float dk_acc[HD / 8][4], dv_acc[HD / 8][4];
#pragma unroll
  for (int dn = 0; dn < HD / 8; ++dn)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[dn][e] = dv_acc[dn][e] = 0.0f;
  const int keys[2] = {kw + g, kw + g + 8};

  for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
    for (int qt = kt; qt < ntiles; ++qt) {
      const int q0 = qt * kTile, valid = min(kTile, T - q0);
      __syncthreads();  // every warp is done with the previous Q, dO, lse, delta
      stage_tile<HD>(qs, q + (b * T + q0) * qd + h * HD, qd, valid);
      stage_tile<HD>(dos, dout + (b * T + q0) * qd + h * HD, qd, valid);
      stage_rows(lse2, lse + (b * H + h) * T + q0, valid, kLog2e);
      stage_rows(dl, delta + (b * H + h) * T + q0, valid, 1.0f);
      __syncthreads();
      for (int qc = 0; qc < kTile / 16; ++qc) {
        const int qs0 = q0 + qc * 16;
        if (qs0 >= T) break;
        if (qs0 + 15 < kw) continue;  // every query of the slice precedes every key of the warp
        float st[2][4], dpt[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
          uint32_t ka[4], va[4];
          load_a(ka, ks, S, warp * 16, kk * 16, g, t);
          load_a(va, vs, S, warp * 16, kk * 16, g, t);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            uint32_t b0, b1;
            load_b_t(b0, b1, qs, S, kk * 16, qc * 16 + nt * 8, g, t);
            mma16816(st[nt], ka, b0, b1);
            load_b_t(b0, b1, dos, S, kk * 16, qc * 16 + nt * 8, g, t);
            mma16816(dpt[nt], va, b0, b1);
          }
        }
        // P^T and dS^T; masked entries are set to 0 (never computed from a
        // row's lse, which rows past T do not have).
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int ql = qc * 16 + nt * 8 + 2 * t + (e & 1), query = q0 + ql, key = keys[e >> 1];
            const bool on = key <= query && query < T;
            const float p = on ? exp2f(st[nt][e] * scale_log2 - lse2[ql]) : 0.0f;
            st[nt][e] = p;
            dpt[nt][e] = on ? p * (dpt[nt][e] - dl[ql]) : 0.0f;
          }
        uint32_t pa[4], dsa[4];
        c_to_a(pa, st[0], st[1]);
        c_to_a(dsa, dpt[0], dpt[1]);
#pragma unroll
        for (int dn = 0; dn < HD / 8; ++dn) {
          uint32_t b0, b1;
          load_b(b0, b1, dos, S, qc * 16, dn * 8, g, t);
          mma16816(dv_acc[dn], pa, b0, b1);
          load_b(b0, b1, qs, S, qc * 16, dn * 8, g, t);
          mma16816(dk_acc[dn], dsa, b0, b1);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (keys[r] >= T) continue;
    const int64_t base = (b * T + keys[r]) * kd + kvh * HD;
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn) {
      st_f2(dk + base + dn * 8 + 2 * t, make_float2(dk_acc[dn][2 * r] * scale, dk_acc[dn][2 * r + 1] * scale));
      st_f2(dv + base + dn * 8 + 2 * t, make_float2(dv_acc[dn][2 * r], dv_acc[dn][2 * r + 1]));
    }
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // code for an arch below sm_80: prepare() refuses it, so it never runs
#endif
}

// Grid (B * query tiles, H). Warp w owns query rows r0 = q0 + 16 w + g and
// r0 + 8 (as in the forward) and sums dS K over the key tiles up to the
// diagonal, in 16-key slices (ascending).
template <int HD>
__global__ void __launch_bounds__(kBlock)
    attn_bwd_q_mma(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                   const float* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                   float* __restrict__ dq, int T, int H, int KVH, float scale_log2, float scale) {
#if STRATA_ATTN_MMA_BODY
  constexpr int S = HD + kPad;
  STRATA_DYNAMIC_SHARED(smem_raw);
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* dos = qs + kTile * S;
  uint16_t* ks = dos + kTile * S;
  uint16_t* vs = ks + kTile * S;
  float* lse2 = reinterpret_cast<float*>(vs + kTile * S);
  float* dl = lse2 + kTile;
  const int ntiles = (T + kTile - 1) / kTile;
  const int qt = static_cast<int>(blockIdx.x % ntiles);
  const int64_t b = blockIdx.x / ntiles;
  const int h = blockIdx.y, kvh = h / (H / KVH);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t qd = static_cast<int64_t>(H) * HD, kd = static_cast<int64_t>(KVH) * HD;
  const int q0 = qt * kTile, valid = min(kTile, T - q0), qw = q0 + warp * 16;
  stage_tile<HD>(qs, q + (b * T + q0) * qd + h * HD, qd, valid);
  stage_tile<HD>(dos, dout + (b * T + q0) * qd + h * HD, qd, valid);
  stage_rows(lse2, lse + (b * H + h) * T + q0, valid, kLog2e);
  stage_rows(dl, delta + (b * H + h) * T + q0, valid, 1.0f);
  __syncthreads();
  uint32_t qf[HD / 16][4], dof[HD / 16][4];
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    load_a(qf[kk], qs, S, warp * 16, kk * 16, g, t);
    load_a(dof[kk], dos, S, warp * 16, kk * 16, g, t);
  }
  const int rl[2] = {warp * 16 + g, warp * 16 + g + 8};  // rows within the tile
  float dq_acc[HD / 8][4];
#pragma unroll
  for (int dn = 0; dn < HD / 8; ++dn) dq_acc[dn][0] = dq_acc[dn][1] = dq_acc[dn][2] = dq_acc[dn][3] = 0.0f;

  for (int kt = 0; kt <= qt; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // every warp is done with the previous K and V tiles
    stage_tile<HD>(ks, k + (b * T + k0) * kd + kvh * HD, kd, min(kTile, T - k0));
    stage_tile<HD>(vs, v + (b * T + k0) * kd + kvh * HD, kd, min(kTile, T - k0));
    __syncthreads();
    for (int kc = 0; kc < kTile / 16; ++kc) {
      const int ks0 = k0 + kc * 16;
      if (ks0 > qw + 15) break;  // every key of the slice follows every row of the warp
      float s[2][4], dp[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          uint32_t b0, b1;
          load_b_t(b0, b1, ks, S, kk * 16, kc * 16 + nt * 8, g, t);
          mma16816(s[nt], qf[kk], b0, b1);
          load_b_t(b0, b1, vs, S, kk * 16, kc * 16 + nt * 8, g, t);
          mma16816(dp[nt], dof[kk], b0, b1);
        }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row_l = rl[e >> 1], query = q0 + row_l, key = ks0 + nt * 8 + 2 * t + (e & 1);
          const bool on = key <= query && query < T;
          const float p = on ? exp2f(s[nt][e] * scale_log2 - lse2[row_l]) : 0.0f;
          dp[nt][e] = on ? p * (dp[nt][e] - dl[row_l]) : 0.0f;
        }
      uint32_t dsa[4];
      c_to_a(dsa, dp[0], dp[1]);
#pragma unroll
      for (int dn = 0; dn < HD / 8; ++dn) {
        uint32_t b0, b1;
        load_b(b0, b1, ks, S, kc * 16, dn * 8, g, t);
        mma16816(dq_acc[dn], dsa, b0, b1);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int query = q0 + rl[r];
    if (query >= T) continue;
    float* row = dq + (b * T + query) * qd + h * HD;
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn)
      st_f2(row + dn * 8 + 2 * t, make_float2(dq_acc[dn][2 * r] * scale, dq_acc[dn][2 * r + 1] * scale));
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // code for an arch below sm_80: prepare() refuses it, so it never runs
#endif
}

}  // namespace attn_mma
}  // namespace strata_cuda_train
