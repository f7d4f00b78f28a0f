// libstrata_cuda.so: the CUDA device backend, loaded by the runtime with
// dlopen (src/device/cuda_loader.cpp). Exports only strata_cuda_api_v1.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "device/cuda_module.h"

namespace {

int fail(cudaError_t e, const char* what, char* err, size_t err_len) {
  if (err && err_len) std::snprintf(err, err_len, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
  return static_cast<int>(e);
}

#define CUDA_TRY(expr)                                          \
  do {                                                          \
    cudaError_t _e = (expr);                                    \
    if (_e != cudaSuccess) return fail(_e, #expr, err, err_len); \
  } while (0)

int device_count(int* count, char* err, size_t err_len) {
  *count = 0;
  cudaError_t e = cudaGetDeviceCount(count);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
    *count = 0;
    (void)cudaGetLastError();  // clear the sticky-free error state
    fail(e, "cudaGetDeviceCount", err, err_len);
    return 0;
  }
  CUDA_TRY(e);
  return 0;
}

int device_describe(int device, char* out, size_t out_len, char* err, size_t err_len) {
  cudaDeviceProp p;
  CUDA_TRY(cudaGetDeviceProperties(&p, device));
  int driver = 0, runtime = 0;
  CUDA_TRY(cudaDriverGetVersion(&driver));
  CUDA_TRY(cudaRuntimeGetVersion(&runtime));
  std::snprintf(out, out_len, "%s, sm_%d%d, %.1f GiB, driver %d runtime %d", p.name, p.major, p.minor,
                static_cast<double>(p.totalGlobalMem) / (1024.0 * 1024 * 1024), driver, runtime);
  return 0;
}

int host_register(void* ptr, size_t bytes, char* err, size_t err_len) {
  CUDA_TRY(cudaHostRegister(ptr, bytes, cudaHostRegisterPortable));
  return 0;
}

int host_unregister(void* ptr, char* err, size_t err_len) {
  CUDA_TRY(cudaHostUnregister(ptr));
  return 0;
}

// Pinned buffers, one dedicated non-blocking stream, events around each copy;
// the median over iters is robust against a noisy first transfer.
int copy_bandwidth(int device, size_t bytes, int iters, double* h2d_gbps, double* d2h_gbps, char* err,
                   size_t err_len) {
  *h2d_gbps = *d2h_gbps = 0;
  if (iters < 1) iters = 1;
  CUDA_TRY(cudaSetDevice(device));
  void* host = nullptr;
  void* dev = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  int rc = 0;
  std::vector<float> h2d, d2h;
  auto cleanup = [&] {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
    if (dev) cudaFree(dev);
    if (host) cudaFreeHost(host);
  };
#define CUDA_TRY_CLEAN(expr)                          \
  do {                                                \
    cudaError_t _e = (expr);                          \
    if (_e != cudaSuccess) {                          \
      rc = fail(_e, #expr, err, err_len);             \
      cleanup();                                      \
      return rc;                                      \
    }                                                 \
  } while (0)
  CUDA_TRY_CLEAN(cudaHostAlloc(&host, bytes, cudaHostAllocDefault));
  CUDA_TRY_CLEAN(cudaMalloc(&dev, bytes));
  CUDA_TRY_CLEAN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUDA_TRY_CLEAN(cudaEventCreate(&start));
  CUDA_TRY_CLEAN(cudaEventCreate(&stop));
  std::memset(host, 1, bytes);
  for (int i = 0; i <= iters; ++i) {  // iteration 0 warms up
    float ms = 0;
    CUDA_TRY_CLEAN(cudaEventRecord(start, stream));
    CUDA_TRY_CLEAN(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream));
    CUDA_TRY_CLEAN(cudaEventRecord(stop, stream));
    CUDA_TRY_CLEAN(cudaEventSynchronize(stop));
    CUDA_TRY_CLEAN(cudaEventElapsedTime(&ms, start, stop));
    if (i) h2d.push_back(ms);
    CUDA_TRY_CLEAN(cudaEventRecord(start, stream));
    CUDA_TRY_CLEAN(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, stream));
    CUDA_TRY_CLEAN(cudaEventRecord(stop, stream));
    CUDA_TRY_CLEAN(cudaEventSynchronize(stop));
    CUDA_TRY_CLEAN(cudaEventElapsedTime(&ms, start, stop));
    if (i) d2h.push_back(ms);
  }
#undef CUDA_TRY_CLEAN
  auto median = [](std::vector<float>& v) {
    std::sort(v.begin(), v.end());
    return static_cast<double>(v[v.size() / 2]);
  };
  *h2d_gbps = static_cast<double>(bytes) / (median(h2d) * 1e-3) / 1e9;
  *d2h_gbps = static_cast<double>(bytes) / (median(d2h) * 1e-3) / 1e9;
  cleanup();
  return 0;
}

const strata_cuda_api_v1_t kApi = {
    sizeof(strata_cuda_api_v1_t), STRATA_CUDA_ABI_VERSION, device_count, device_describe,
    host_register,              host_unregister,         copy_bandwidth,
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const strata_cuda_api_v1_t* strata_cuda_api_v1(void) { return &kApi; }
