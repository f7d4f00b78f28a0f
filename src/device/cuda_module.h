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
// Every function returns 0 on success or a nonzero CUDA error code; on error,
// the text is written to err (NUL-terminated, truncated to err_len).
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define STRATA_CUDA_ABI_VERSION 1u

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
} strata_cuda_api_v1_t;

typedef const strata_cuda_api_v1_t* (*strata_cuda_api_v1_fn)(void);
#define STRATA_CUDA_API_SYMBOL "strata_cuda_api_v1"

#ifdef __cplusplus
}
#endif
