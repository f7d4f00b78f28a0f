// Elementwise kernels of the CUDA backend: cast/scale, fp32 accumulate,
// squared norm with inf/NaN count, AdamW. The per-element arithmetic is
// common/device_numeric.h, shared with the host backend's loops, and this file
// is compiled with --fmad=false (cuda/CMakeLists.txt) so that both give the
// same bits. The norm sums in double in a fixed order (per thread, per
// block, then the blocks' partials in one block): the same bits every run.
//
// Grid-stride loops over size_t indices (buffers above 2^31 elements work),
// 256 threads per block, the grid capped so that each thread handles several
// elements. dtypes are template parameters: the conversion branches fold.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/device_numeric.h"
#include "kernels.cuh"

namespace strata_cuda {
namespace {

namespace dm = strata::device_math;

constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = 4096;

unsigned grid_for(size_t count) {
  size_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::min(blocks, kMaxBlocks));
}

template <int T>
__device__ __forceinline__ float ld(const void* p, size_t i) {
  return dm::load_as_f32(p, T, i);
}
template <int T>
__device__ __forceinline__ void st(void* p, size_t i, float v) {
  dm::store_from_f32(p, T, i, v);
}

template <int D, int S>
__global__ void cast_kernel(void* dst, const void* src, size_t count, float scale) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    st<D>(dst, i, dm::apply_scale(ld<S>(src, i), scale));
}

template <int S>
__global__ void accumulate_kernel(float* dst, const void* src, size_t count, float scale) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    dst[i] += dm::apply_scale(ld<S>(src, i), scale);
}

// Each thread sums in double, the block reduces through warp shuffles and
// shared memory in a fixed order and writes its partial; sq_norm_final_kernel
// adds the partials in a fixed order (never atomics on floats: their order,
// and so the norm's last bits, would change from run to run).
template <int T>
__global__ void sq_norm_kernel(const void* src, size_t count, double* part_sum, unsigned long long* part_bad) {
  double sum = 0;
  unsigned long long bad = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const float x = ld<T>(src, i);
    if (isfinite(x)) {
      sum += static_cast<double>(x) * static_cast<double>(x);
    } else {
      ++bad;
    }
  }
  for (int off = 16; off > 0; off >>= 1) {
    sum += __shfl_down_sync(0xffffffffu, sum, off);
    bad += __shfl_down_sync(0xffffffffu, bad, off);
  }
  __shared__ double warp_sum[kThreads / 32];
  __shared__ unsigned long long warp_bad[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    warp_sum[warp] = sum;
    warp_bad[warp] = bad;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0;
    unsigned long long b = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
      s += warp_sum[w];
      b += warp_bad[w];
    }
    part_sum[blockIdx.x] = s;
    part_bad[blockIdx.x] = b;
  }
}

// One block of kNormBlocks threads: thread i takes partial i, then a fixed
// tree; out accumulates across calls (stream order).
constexpr unsigned kNormBlocks = 1024;
__global__ void sq_norm_final_kernel(const double* part_sum, const unsigned long long* part_bad, unsigned n,
                                     strata_cuda_norm_stats_t* out) {
  __shared__ double s[kNormBlocks];
  __shared__ unsigned long long b[kNormBlocks];
  const unsigned i = threadIdx.x;
  s[i] = i < n ? part_sum[i] : 0.0;
  b[i] = i < n ? part_bad[i] : 0ull;
  __syncthreads();
  for (unsigned half = kNormBlocks / 2; half > 0; half >>= 1) {
    if (i < half) {
      s[i] += s[i + half];
      b[i] += b[i + half];
    }
    __syncthreads();
  }
  if (i == 0) {
    out->sum_sq += s[0];
    out->nonfinite += b[0];
  }
}

// O = -1: no compute copy.
template <int G, int O>
__global__ void adamw_kernel(strata_cuda_adamw_t a) {
  dm::AdamWConsts c;
  c.beta1 = a.beta1;
  c.one_minus_beta1 = a.one_minus_beta1;
  c.beta2 = a.beta2;
  c.one_minus_beta2 = a.one_minus_beta2;
  c.eps = a.eps;
  c.neg_lr_wd = a.neg_lr_wd;
  c.neg_step_size = a.neg_step_size;
  c.inv_sqrt_bc2 = a.inv_sqrt_bc2;
  c.grad_scale = a.grad_scale;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.count; i += stride) {
    float p = a.params[i], m = a.exp_avg[i], v = a.exp_avg_sq[i];
    dm::adamw_element(c, ld<G>(a.grads, i), p, m, v);
    a.params[i] = p;
    a.exp_avg[i] = m;
    a.exp_avg_sq[i] = v;
    if constexpr (O >= 0) st<O>(a.out, i, p);
  }
}

bool valid_dtype(int t) {
  return t >= 0 && t <= 2;
}

// The runtime keeps one last error per host thread: every failed call sets
// it (a cudaErrorNotReady query, a refused cudaHostRegister, an allocation
// the caller retries) and only cudaGetLastError() clears it; a launch that
// succeeds leaves it as it was. Cleared before a launch, the
// cudaGetLastError() after it is that launch's error alone (a sticky error
// still comes back: the context returns it again).
void clear_stale_error() { (void)cudaGetLastError(); }

template <int D>
void launch_cast_src(int src_dtype, void* dst, const void* src, size_t count, float scale, cudaStream_t stream) {
  const unsigned grid = grid_for(count);
  switch (src_dtype) {
    case 0:
      cast_kernel<D, 0><<<grid, kThreads, 0, stream>>>(dst, src, count, scale);
      break;
    case 1:
      cast_kernel<D, 1><<<grid, kThreads, 0, stream>>>(dst, src, count, scale);
      break;
    default:
      cast_kernel<D, 2><<<grid, kThreads, 0, stream>>>(dst, src, count, scale);
      break;
  }
}

template <int G>
void launch_adamw_grad(const strata_cuda_adamw_t& a, cudaStream_t stream) {
  const unsigned grid = grid_for(a.count);
  if (!a.out) {
    adamw_kernel<G, -1><<<grid, kThreads, 0, stream>>>(a);
    return;
  }
  switch (a.out_dtype) {
    case 0:
      adamw_kernel<G, 0><<<grid, kThreads, 0, stream>>>(a);
      break;
    case 1:
      adamw_kernel<G, 1><<<grid, kThreads, 0, stream>>>(a);
      break;
    default:
      adamw_kernel<G, 2><<<grid, kThreads, 0, stream>>>(a);
      break;
  }
}

}  // namespace

cudaError_t launch_cast(void* dst, int dst_dtype, const void* src, int src_dtype, size_t count, float scale,
                        cudaStream_t stream) {
  if (!valid_dtype(dst_dtype) || !valid_dtype(src_dtype)) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  clear_stale_error();
  switch (dst_dtype) {
    case 0:
      launch_cast_src<0>(src_dtype, dst, src, count, scale, stream);
      break;
    case 1:
      launch_cast_src<1>(src_dtype, dst, src, count, scale, stream);
      break;
    default:
      launch_cast_src<2>(src_dtype, dst, src, count, scale, stream);
      break;
  }
  return cudaGetLastError();
}

cudaError_t launch_accumulate(float* dst, const void* src, int src_dtype, size_t count, float scale,
                              cudaStream_t stream) {
  if (!valid_dtype(src_dtype)) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  clear_stale_error();
  const unsigned grid = grid_for(count);
  switch (src_dtype) {
    case 0:
      accumulate_kernel<0><<<grid, kThreads, 0, stream>>>(dst, src, count, scale);
      break;
    case 1:
      accumulate_kernel<1><<<grid, kThreads, 0, stream>>>(dst, src, count, scale);
      break;
    default:
      accumulate_kernel<2><<<grid, kThreads, 0, stream>>>(dst, src, count, scale);
      break;
  }
  return cudaGetLastError();
}

cudaError_t launch_sq_norm(const void* src, int dtype, size_t count, strata_cuda_norm_stats_t* out,
                           cudaStream_t stream) {
  if (!valid_dtype(dtype)) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  clear_stale_error();
  // At most kNormBlocks partials, in stream-ordered scratch memory.
  const unsigned grid = std::min(grid_for(count), kNormBlocks);
  void* scratch = nullptr;
  cudaError_t e = cudaMallocAsync(&scratch, size_t{grid} * (sizeof(double) + sizeof(unsigned long long)), stream);
  if (e != cudaSuccess) return e;
  auto* part_sum = static_cast<double*>(scratch);
  auto* part_bad = reinterpret_cast<unsigned long long*>(part_sum + grid);
  switch (dtype) {
    case 0:
      sq_norm_kernel<0><<<grid, kThreads, 0, stream>>>(src, count, part_sum, part_bad);
      break;
    case 1:
      sq_norm_kernel<1><<<grid, kThreads, 0, stream>>>(src, count, part_sum, part_bad);
      break;
    default:
      sq_norm_kernel<2><<<grid, kThreads, 0, stream>>>(src, count, part_sum, part_bad);
      break;
  }
  e = cudaGetLastError();
  if (e == cudaSuccess) {
    sq_norm_final_kernel<<<1, kNormBlocks, 0, stream>>>(part_sum, part_bad, grid, out);
    e = cudaGetLastError();
  }
  const cudaError_t f = cudaFreeAsync(scratch, stream);
  return e != cudaSuccess ? e : f;
}

cudaError_t launch_adamw(const strata_cuda_adamw_t& a, cudaStream_t stream) {
  if (!valid_dtype(a.grad_dtype) || (a.out && !valid_dtype(a.out_dtype))) return cudaErrorInvalidValue;
  if (a.count == 0) return cudaSuccess;
  clear_stale_error();
  switch (a.grad_dtype) {
    case 0:
      launch_adamw_grad<0>(a, stream);
      break;
    case 1:
      launch_adamw_grad<1>(a, stream);
      break;
    default:
      launch_adamw_grad<2>(a, stream);
      break;
  }
  return cudaGetLastError();
}

}  // namespace strata_cuda
