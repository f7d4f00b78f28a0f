// CudaBackend: the DeviceBackend over the CUDA module's C table
// (cuda/module_abi.h), which cuda_loader.cpp loads at run time. Nothing
// here links CUDA: a build with this file runs where no driver exists.
//
// - Device memory: the caching allocator (caching_allocator.h) over the
//   table's device_malloc/device_free under the budget; no cudaMalloc once the
//   pool is warm.
// - Streams are non-blocking CUDA streams; events are timing-free CUDA events.
// - Pinned host memory: alloc_host() + cudaHostRegister (CudaHostRegistrar).
// - Errors: a CUDA error code becomes kOutOfMemory (cudaErrorMemoryAllocation),
//   kInvalidArgument (cudaErrorInvalidValue) or kInternal (device/cuda_status.h),
//   with CUDA's name and text and the operation. A failing host
//   function (host_func_async) is recorded on its stream and returned by that
//   stream's synchronize/query; unlike the host backend, CUDA does not skip
//   the stream's later work or fail streams waiting on it.
// - Every call makes the backend's device current on the calling thread.
// Unverified on a GPU until tests/device runs under `ctest -L gpu` there.
#pragma once

#include <memory>

#include "device/cuda_loader.h"
#include "device/device_backend.h"

namespace strata {

// budget_bytes 0 means "detect": the device's free memory now, less 5% (at
// least 512 MiB) for the CUDA context, cuBLAS and other libraries.
// Errors: kInvalidArgument (device ordinal out of range), kOutOfMemory (detect
// found too little free memory),
// kUnavailable (the module's table lacks the device-backend entries: an older
// libstrata_cuda.so), and CUDA's errors describing the device.
Result<std::unique_ptr<DeviceBackend>> create_cuda_backend(const CudaBackend& module, int device,
                                                           uint64_t budget_bytes);

// The CUDA stream (a cudaStream_t) and device ordinal behind a stream of a
// backend made by create_cuda_backend (create_stream or wrap_native_stream),
// for code that launches its own kernels on it (train/cuda_ops.cpp). The
// handle stays owned by the backend. Any thread. Errors: kInvalidArgument for
// null or a stream of another kind of backend.
struct CudaNativeStream {
  void* stream = nullptr;
  int device = 0;
};
Result<CudaNativeStream> cuda_native_stream(DeviceStream* stream);

}  // namespace strata
