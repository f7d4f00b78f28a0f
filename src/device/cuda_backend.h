// CudaBackend: the DeviceBackend over the CUDA module's C table
// (device/cuda_module.h), which cuda_loader.cpp loads at run time. Nothing
// here links CUDA: a build with this file runs where no driver exists.
//
// - Device memory: the caching allocator (caching_allocator.h) over the
//   table's device_malloc/device_free under the budget; no cudaMalloc once the
//   pool is warm.
// - Streams are non-blocking CUDA streams; events are timing-free CUDA events.
// - Pinned host memory: alloc_host() + cudaHostRegister (CudaHostRegistrar).
// - Errors: a CUDA error code becomes kOutOfMemory (cudaErrorMemoryAllocation)
//   or kInternal, with CUDA's name and text and the operation. A failing host
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

// Errors: kInvalidArgument (device ordinal out of range, zero budget),
// kUnavailable (the module's table lacks the device-backend entries: an older
// libstrata_cuda.so), and CUDA's errors describing the device.
Result<std::unique_ptr<DeviceBackend>> create_cuda_backend(const CudaBackend& module, int device,
                                                           uint64_t budget_bytes);

}  // namespace strata
