// libstrata_cuda.so: the CUDA device backend, loaded by the runtime with
// dlopen (src/device/cuda_loader.cpp). Exports only strata_cuda_api_v1.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels.cuh"
#include "cuda/module_abi.h"

namespace {

// src/device/cuda_status.h names the sticky errors by number (it builds
// without CUDA's headers): they are these.
static_assert(cudaErrorECCUncorrectable == 214 && cudaErrorNvlinkUncorrectable == 220 && cudaErrorContained == 226 &&
                  cudaErrorIllegalAddress == 700 && cudaErrorLaunchTimeout == 702 &&
                  cudaErrorContextIsDestroyed == 709 && cudaErrorAssert == 710 && cudaErrorHardwareStackError == 714 &&
                  cudaErrorIllegalInstruction == 715 && cudaErrorMisalignedAddress == 716 &&
                  cudaErrorInvalidAddressSpace == 717 && cudaErrorInvalidPc == 718 && cudaErrorLaunchFailure == 719 &&
                  cudaErrorTensorMemoryLeak == 721 && cudaErrorMpsClientTerminated == 810 &&
                  cudaErrorExternalDevice == 911,
              "src/device/cuda_status.h's sticky error codes");
static_assert(cudaErrorInvalidValue == STRATA_CUDA_ERR_INVALID_VALUE &&
                  cudaErrorMemoryAllocation == STRATA_CUDA_ERR_MEMORY_ALLOCATION,
              "cuda/module_abi.h's error codes are cudaError_t values");

// Reports e, and clears the thread's last error so that it is not taken
// for a later launch's (kernels.cu); a sticky error comes back regardless.
int fail(cudaError_t e, const char* what, char* err, size_t err_len) {
  if (err && err_len) std::snprintf(err, err_len, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
  (void)cudaGetLastError();
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

// ---- device backend entry points: make the device current, do one call.

#define CUDA_ON(device) CUDA_TRY(cudaSetDevice(device))

int device_malloc(int device, size_t bytes, void** out, char* err, size_t err_len) {
  *out = nullptr;
  CUDA_ON(device);
  CUDA_TRY(cudaMalloc(out, bytes));
  return 0;
}

int device_free(int device, void* ptr, char* err, size_t err_len) {
  CUDA_ON(device);
  CUDA_TRY(cudaFree(ptr));
  return 0;
}

int stream_create(int device, void** out, char* err, size_t err_len) {
  *out = nullptr;
  CUDA_ON(device);
  cudaStream_t s = nullptr;
  CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  *out = s;
  return 0;
}

int stream_destroy(int device, void* stream, char* err, size_t err_len) {
  CUDA_ON(device);
  CUDA_TRY(cudaStreamDestroy(static_cast<cudaStream_t>(stream)));
  return 0;
}

int stream_synchronize(int device, void* stream, char* err, size_t err_len) {
  CUDA_ON(device);
  CUDA_TRY(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  return 0;
}

int stream_query(int device, void* stream, int* done, char* err, size_t err_len) {
  *done = 0;
  CUDA_ON(device);
  cudaError_t e = cudaStreamQuery(static_cast<cudaStream_t>(stream));
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();  // "not yet" is no error; it must not linger (see fail())
    return 0;
  }
  CUDA_TRY(e);
  *done = 1;
  return 0;
}

int event_create(int device, void** out, char* err, size_t err_len) {
  *out = nullptr;
  CUDA_ON(device);
  cudaEvent_t e = nullptr;
  CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  *out = e;
  return 0;
}

int event_destroy(int device, void* event, char* err, size_t err_len) {
  CUDA_ON(device);
  CUDA_TRY(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
  return 0;
}

int event_record(int device, void* event, void* stream, char* err, size_t err_len) {
  CUDA_ON(device);
  CUDA_TRY(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
  return 0;
}

int stream_wait_event(int device, void* stream, void* event, char* err, size_t err_len) {
  CUDA_ON(device);
  CUDA_TRY(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
  return 0;
}

int event_query(int device, void* event, int* done, char* err, size_t err_len) {
  *done = 0;
  CUDA_ON(device);
  cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();  // "not yet" is no error; it must not linger (see fail())
    return 0;
  }
  CUDA_TRY(e);
  *done = 1;
  return 0;
}

int event_synchronize(int device, void* event, char* err, size_t err_len) {
  CUDA_ON(device);
  CUDA_TRY(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  return 0;
}

int memcpy_async(int device, void* dst, const void* src, size_t bytes, void* stream, char* err, size_t err_len) {
  CUDA_ON(device);
  CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)));
  return 0;
}

int memset_async(int device, void* dst, int value, size_t bytes, void* stream, char* err, size_t err_len) {
  CUDA_ON(device);
  CUDA_TRY(cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(stream)));
  return 0;
}

int launch_host_func(int device, void* stream, void (*fn)(void*), void* user, char* err, size_t err_len) {
  CUDA_ON(device);
  CUDA_TRY(cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), fn, user));
  return 0;
}

int cast(int device, void* dst, int dst_dtype, const void* src, int src_dtype, size_t count, float scale,
         void* stream, char* err, size_t err_len) {
  CUDA_ON(device);
  CUDA_TRY(strata_cuda::launch_cast(dst, dst_dtype, src, src_dtype, count, scale, static_cast<cudaStream_t>(stream)));
  return 0;
}

int accumulate(int device, float* dst, const void* src, int src_dtype, size_t count, float scale, void* stream,
               char* err, size_t err_len) {
  CUDA_ON(device);
  CUDA_TRY(strata_cuda::launch_accumulate(dst, src, src_dtype, count, scale, static_cast<cudaStream_t>(stream)));
  return 0;
}

int sq_norm(int device, const void* src, int dtype, size_t count, strata_cuda_norm_stats_t* out, void* stream,
            char* err, size_t err_len) {
  CUDA_ON(device);
  CUDA_TRY(strata_cuda::launch_sq_norm(src, dtype, count, out, static_cast<cudaStream_t>(stream)));
  return 0;
}

int adamw(int device, const strata_cuda_adamw_t* args, void* stream, char* err, size_t err_len) {
  CUDA_ON(device);
  CUDA_TRY(strata_cuda::launch_adamw(*args, static_cast<cudaStream_t>(stream)));
  return 0;
}

int mem_get_info(int device, size_t* free_bytes, size_t* total_bytes, char* err, size_t err_len) {
  CUDA_ON(device);
  CUDA_TRY(cudaMemGetInfo(free_bytes, total_bytes));
  return 0;
}

int host_register_on(int device, void* ptr, size_t bytes, char* err, size_t err_len) {
  CUDA_ON(device);
  CUDA_TRY(cudaHostRegister(ptr, bytes, cudaHostRegisterPortable));
  return 0;
}

int host_unregister_on(int device, void* ptr, char* err, size_t err_len) {
  CUDA_ON(device);
  CUDA_TRY(cudaHostUnregister(ptr));
  return 0;
}

int stream_device(void* stream, int* device, char* err, size_t err_len) {
  *device = -1;
  CUDA_TRY(cudaStreamGetDevice(static_cast<cudaStream_t>(stream), device));
  return 0;
}

#undef CUDA_ON

const strata_cuda_api_v1_t kApi = {
    sizeof(strata_cuda_api_v1_t),
    STRATA_CUDA_ABI_VERSION,
    device_count,
    device_describe,
    host_register,
    host_unregister,
    copy_bandwidth,
    // appended
    device_malloc,
    device_free,
    stream_create,
    stream_destroy,
    stream_synchronize,
    stream_query,
    event_create,
    event_destroy,
    event_record,
    stream_wait_event,
    event_query,
    event_synchronize,
    memcpy_async,
    memset_async,
    launch_host_func,
    cast,
    accumulate,
    sq_norm,
    adamw,
    mem_get_info,
    stream_device,
    host_register_on,
    host_unregister_on,
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const strata_cuda_api_v1_t* strata_cuda_api_v1(void) { return &kApi; }
