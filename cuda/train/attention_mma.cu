// Launches of the tensor-core attention kernels (attention_mma_kernels.cuh,
// which also says how they work): shape and device checks, shared-memory
// limits, grids. The contract is attention_mma.cuh's.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <mutex>
#include <vector>

#include "attention_mma.cuh"
#include "attention_mma_kernels.cuh"

namespace strata_cuda_train {
namespace {

using namespace attn_mma;

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Whether `kernel` has sm_80+ code for the current device and the device
// gives a block `smem` bytes of shared memory; sets the block's limit.
// binaryVersion alone would pass code JIT-compiled from sm_75 PTX (it
// reports the device's arch), whose bodies are __trap(): ptxVersion too.
// Clears any error its queries leave. The answer is kept per (device,
// kernel): a launch costs one lookup, not five runtime queries.
template <typename Kernel>
bool prepare(Kernel kernel, size_t smem) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  struct Entry {
    const void* fn;
    int dev;
    bool ok;
  };
  static std::mutex mu;
  static std::vector<Entry> cache;
  const void* fn = reinterpret_cast<const void*>(kernel);
  std::lock_guard<std::mutex> lock(mu);
  for (const Entry& e : cache)
    if (e.fn == fn && e.dev == dev) return e.ok;
  int major = 0, optin = 0;
  cudaFuncAttributes attr{};
  const bool ok =
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 8 &&
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess &&
      static_cast<size_t>(optin) >= smem && cudaFuncGetAttributes(&attr, kernel) == cudaSuccess &&
      attr.binaryVersion >= 80 && attr.ptxVersion >= 80 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) == cudaSuccess;
  if (!ok) (void)cudaGetLastError();
  cache.push_back({fn, dev, ok});
  return ok;
}

bool shape_ok(int64_t B, int64_t T, int64_t H, int64_t KVH) {
  if (B < 1 || T < 1 || KVH < 1 || H < KVH || H % KVH != 0 || H > 65535 || T > INT32_MAX - kTile) return false;
  const int64_t tiles = (T + kTile - 1) / kTile;
  return B <= INT32_MAX / tiles;
}

float scale_of(int64_t hd) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
}

template <int HD>
cudaError_t forward_hd(const float* q, const float* k, const float* v, float* out, float* lse, int64_t B, int64_t T,
                       int64_t H, int64_t KVH, cudaStream_t stream) {
  if (!prepare(attn_fwd_mma<HD>, fwd_smem(HD))) return cudaErrorNotSupported;
  const dim3 grid(static_cast<unsigned>(B * ((T + kTile - 1) / kTile)), static_cast<unsigned>(H));
  const float sc = scale_of(HD);
  attn_fwd_mma<HD><<<grid, kBlock, fwd_smem(HD), stream>>>(q, k, v, out, lse, static_cast<int>(T), static_cast<int>(H),
                                                           static_cast<int>(KVH), sc * kLog2e);
  return cudaGetLastError();
}

template <int HD>
cudaError_t backward_hd(const float* q, const float* k, const float* v, const float* out, const float* lse,
                        const float* dout, float* delta, float* dq, float* dk, float* dv, int64_t B, int64_t T,
                        int64_t H, int64_t KVH, cudaStream_t stream) {
  if (!prepare(attn_bwd_kv_mma<HD>, bwd_smem(HD)) || !prepare(attn_bwd_q_mma<HD>, bwd_smem(HD)))
    return cudaErrorNotSupported;
  const int64_t tiles = (T + kTile - 1) / kTile;
  const float sc = scale_of(HD);
  const int64_t warps = B * T * H;
  const int64_t delta_blocks = (warps + kWarps - 1) / kWarps;
  if (delta_blocks > INT32_MAX) return cudaErrorNotSupported;
  attn_delta<<<static_cast<unsigned>(delta_blocks), kBlock, 0, stream>>>(out, dout, delta, B * T, static_cast<int>(T),
                                                                         static_cast<int>(H), HD);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  attn_bwd_kv_mma<HD>
      <<<dim3(static_cast<unsigned>(B * tiles), static_cast<unsigned>(KVH)), kBlock, bwd_smem(HD), stream>>>(
          q, k, v, dout, lse, delta, dk, dv, static_cast<int>(T), static_cast<int>(H), static_cast<int>(KVH),
          sc * kLog2e, sc);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  attn_bwd_q_mma<HD>
      <<<dim3(static_cast<unsigned>(B * tiles), static_cast<unsigned>(H)), kBlock, bwd_smem(HD), stream>>>(
          q, k, v, dout, lse, delta, dq, static_cast<int>(T), static_cast<int>(H), static_cast<int>(KVH), sc * kLog2e,
          sc);
  return cudaGetLastError();
}

}  // namespace

bool attention_mma_available(int64_t hd) {
  if (hd == 64) return prepare(attn_fwd_mma<64>, fwd_smem(64)) && prepare(attn_bwd_kv_mma<64>, bwd_smem(64));
  if (hd == 128) return prepare(attn_fwd_mma<128>, fwd_smem(128)) && prepare(attn_bwd_kv_mma<128>, bwd_smem(128));
  return false;
}

cudaError_t attention_mma_forward(const float* q, const float* k, const float* v, float* out, float* lse, int64_t B,
                                  int64_t T, int64_t H, int64_t KVH, int64_t hd, cudaStream_t stream) {
  if (!shape_ok(B, T, H, KVH) || !aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(out))
    return cudaErrorNotSupported;
  if (hd == 64) return forward_hd<64>(q, k, v, out, lse, B, T, H, KVH, stream);
  if (hd == 128) return forward_hd<128>(q, k, v, out, lse, B, T, H, KVH, stream);
  return cudaErrorNotSupported;
}

cudaError_t attention_mma_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                                   const float* dout, float* delta, float* dq, float* dk, float* dv, int64_t B,
                                   int64_t T, int64_t H, int64_t KVH, int64_t hd, cudaStream_t stream) {
  if (!shape_ok(B, T, H, KVH)) return cudaErrorNotSupported;
  for (const void* p : {static_cast<const void*>(q), static_cast<const void*>(k), static_cast<const void*>(v),
                        static_cast<const void*>(dout), static_cast<const void*>(dq), static_cast<const void*>(dk),
                        static_cast<const void*>(dv)})
    if (!aligned16(p)) return cudaErrorNotSupported;
  if (hd == 64) return backward_hd<64>(q, k, v, out, lse, dout, delta, dq, dk, dv, B, T, H, KVH, stream);
  if (hd == 128) return backward_hd<128>(q, k, v, out, lse, dout, delta, dq, dk, dv, B, T, H, KVH, stream);
  return cudaErrorNotSupported;
}

}  // namespace strata_cuda_train
