// Kernel launchers of the CUDA backend module (kernels.cu), called by the
// module's C table (backend_module.cu). Each enqueues on `stream` and returns
// the launch error only; the work's own errors surface at synchronize.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/module_abi.h"

namespace strata_cuda {

cudaError_t launch_cast(void* dst, int dst_dtype, const void* src, int src_dtype, size_t count, float scale,
                        cudaStream_t stream);
cudaError_t launch_accumulate(float* dst, const void* src, int src_dtype, size_t count, float scale,
                              cudaStream_t stream);
cudaError_t launch_sq_norm(const void* src, int dtype, size_t count, strata_cuda_norm_stats_t* out,
                           cudaStream_t stream);
cudaError_t launch_adamw(const strata_cuda_adamw_t& args, cudaStream_t stream);

}  // namespace strata_cuda
