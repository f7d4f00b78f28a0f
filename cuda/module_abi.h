// The ABI between the runtime and the CUDA backend module (libstrata_cuda.so).
//
// The CUDA backend is a separate shared module loaded with dlopen() at run
// time, so one build of Strata starts on machines without a GPU, an NVIDIA
// driver or the CUDA runtime libraries, and picks the host backend there.
// The module exports one C symbol, strata_cuda_api_v1, returning a table of
// plain C function pointers. The table starts with its size so fields can be
// appended without breaking older loaders: a loader reads only fields that lie
// within struct_size.
//
// Every function returns 0 on success or a nonzero STRATA_CUDA_ERR_* code
// (below); on error, the text is written to err (NUL-terminated, truncated to
// err_len).
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define STRATA_CUDA_ABI_VERSION 1u

// Return codes of both CUDA modules (this one and cuda/train/), decoded in
// one place on the host (device/cuda_status.h). A CUDA runtime error is its
// cudaError_t value (1 .. STRATA_CUDA_ERR_BLAS_BASE - 1); a cuBLAS error
// (the train module only) is STRATA_CUDA_ERR_BLAS_BASE + its cublasStatus_t.
// The modules static_assert the values they name against CUDA's headers.
#define STRATA_CUDA_OK 0
#define STRATA_CUDA_ERR_INVALID_VALUE 1      // cudaErrorInvalidValue; also a module's own argument checks
#define STRATA_CUDA_ERR_MEMORY_ALLOCATION 2  // cudaErrorMemoryAllocation
#define STRATA_CUDA_ERR_BLAS_BASE 1000
#define STRATA_CUDA_ERR_BLAS_ALLOC_FAILED (STRATA_CUDA_ERR_BLAS_BASE + 3)  // CUBLAS_STATUS_ALLOC_FAILED

#define STRATA_CUDA_DTYPE_F32 0
#define STRATA_CUDA_DTYPE_BF16 1
#define STRATA_CUDA_DTYPE_F16 2

// Same layout as strata::NormStats (device_backend.h).
typedef struct strata_cuda_norm_stats_s {
  double sum_sq;
  unsigned long long nonfinite;
} strata_cuda_norm_stats_t;

// One AdamW step; the constants are computed in double by the caller and
// rounded to float (device_math::adamw_consts), so both backends use the
// same values. out may be NULL (no compute copy).
typedef struct strata_cuda_adamw_s {
  float* params;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grads;
  int grad_dtype;
  int out_dtype;
  void* out;
  size_t count;
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float neg_lr_wd, neg_step_size, inv_sqrt_bc2, grad_scale;
} strata_cuda_adamw_t;

typedef struct strata_cuda_api_v1_s {
  uint32_t struct_size;  // sizeof(strata_cuda_api_v1_t) of the module
  uint32_t abi_version;  // STRATA_CUDA_ABI_VERSION of the module

  // Number of visible devices (0 when the driver is missing or no GPU).
  int (*device_count)(int* count, char* err, size_t err_len);
  // "NVIDIA H200, sm_90, 139.8 GiB, driver 13000 runtime 13000"
  int (*device_describe)(int device, char* out, size_t out_len, char* err, size_t err_len);
  // Page-locks existing host memory (cudaHostRegister, portable flag).
  int (*host_register)(void* ptr, size_t bytes, char* err, size_t err_len);
  int (*host_unregister)(void* ptr, char* err, size_t err_len);
  // Measures host->device and device->host copy bandwidth in GB/s with
  // `bytes`-sized pinned buffers on a dedicated stream, median of `iters`.
  int (*copy_bandwidth)(int device, size_t bytes, int iters, double* h2d_gbps, double* d2h_gbps, char* err,
                        size_t err_len);

  // ---- Appended for the device backend (src/device/cuda_backend.cpp). -----
  // Each function takes the device ordinal and makes it current on the
  // calling thread first (the CUDA runtime's current device is per thread).
  // Streams and events are opaque cudaStream_t / cudaEvent_t values. All
  // *_async-style functions only enqueue; errors of the running work come
  // back from stream/event synchronize and query.

  // Device memory for the pool's blocks (cudaMalloc / cudaFree). Not for the
  // hot path: cudaFree synchronizes the device.
  int (*device_malloc)(int device, size_t bytes, void** out, char* err, size_t err_len);
  int (*device_free)(int device, void* ptr, char* err, size_t err_len);

  // A non-blocking stream (does not synchronize with the legacy stream 0).
  int (*stream_create)(int device, void** out, char* err, size_t err_len);
  int (*stream_destroy)(int device, void* stream, char* err, size_t err_len);
  int (*stream_synchronize)(int device, void* stream, char* err, size_t err_len);
  // *done = 1 when all work is finished, 0 when not (cudaErrorNotReady).
  int (*stream_query)(int device, void* stream, int* done, char* err, size_t err_len);

  // Events without timing (cheaper to record and wait on).
  int (*event_create)(int device, void** out, char* err, size_t err_len);
  int (*event_destroy)(int device, void* event, char* err, size_t err_len);
  int (*event_record)(int device, void* event, void* stream, char* err, size_t err_len);
  int (*stream_wait_event)(int device, void* stream, void* event, char* err, size_t err_len);
  int (*event_query)(int device, void* event, int* done, char* err, size_t err_len);
  int (*event_synchronize)(int device, void* event, char* err, size_t err_len);

  // cudaMemcpyAsync with cudaMemcpyDefault (unified addressing tells the
  // direction); cudaMemsetAsync.
  int (*memcpy_async)(int device, void* dst, const void* src, size_t bytes, void* stream, char* err,
                      size_t err_len);
  int (*memset_async)(int device, void* dst, int value, size_t bytes, void* stream, char* err, size_t err_len);
  // cudaLaunchHostFunc: fn(user) runs on a CUDA thread when the stream gets
  // there; fn must not call CUDA.
  int (*launch_host_func)(int device, void* stream, void (*fn)(void*), void* user, char* err, size_t err_len);

  // Kernels (cuda/kernels.cu). dtypes are STRATA_CUDA_DTYPE_*; a kernel
  // returns the launch error only.
  // dst[i] = convert(float(src[i]) * scale); dst == src allowed for one dtype.
  int (*cast)(int device, void* dst, int dst_dtype, const void* src, int src_dtype, size_t count, float scale,
              void* stream, char* err, size_t err_len);
  // dst[i] += float(src[i]) * scale, dst fp32.
  int (*accumulate)(int device, float* dst, const void* src, int src_dtype, size_t count, float scale,
                    void* stream, char* err, size_t err_len);
  // out->sum_sq += sum of squares (double) of the finite elements,
  // out->nonfinite += number of inf/NaN elements; out is device memory.
  int (*sq_norm)(int device, const void* src, int dtype, size_t count, strata_cuda_norm_stats_t* out,
                 void* stream, char* err, size_t err_len);
  int (*adamw)(int device, const strata_cuda_adamw_t* args, void* stream, char* err, size_t err_len);

  // Appended after the first release (read only when struct_size covers it):
  // free and total device memory (cudaMemGetInfo), for "detect" budgets.
  int (*mem_get_info)(int device, size_t* free_bytes, size_t* total_bytes, char* err, size_t err_len);
  // The device a (non-NULL) caller stream belongs to (cudaStreamGetDevice),
  // so a wrapped stream of another GPU is refused before any work is ordered on it.
  int (*stream_device)(void* stream, int* device, char* err, size_t err_len);
  // host_register with `device` made current first: registering creates a
  // CUDA context on the current device, which must be the engine's (a stray
  // context on GPU 0 costs hundreds of MiB there).
  int (*host_register_on)(int device, void* ptr, size_t bytes, char* err, size_t err_len);
  // host_unregister with `device` made current first (for the same reason:
  // unregistering on a thread whose current device is another GPU would
  // create a context there).
  int (*host_unregister_on)(int device, void* ptr, char* err, size_t err_len);
} strata_cuda_api_v1_t;

typedef const strata_cuda_api_v1_t* (*strata_cuda_api_v1_fn)(void);
#define STRATA_CUDA_API_SYMBOL "strata_cuda_api_v1"

#ifdef __cplusplus
}
#endif
