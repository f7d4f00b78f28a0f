// The one decoder of the CUDA modules' return codes (STRATA_CUDA_ERR_*,
// cuda/module_abi.h): the device backend (device/cuda_backend.cpp) and the
// trainer's CUDA ops (train/cuda_ops.cpp) both turn a module's code and error
// text into a Status here, so both modules' codes mean the same thing.
// Pure function; thread-safe.
#pragma once

#include <string>

#include "common/status.h"
#include "cuda/module_abi.h"

namespace strata {

// `what` names the module and the operation ("cuda: cudaMalloc of 4096
// bytes"); the message is "<what> failed: <err_text>" (or "error <rc>" when
// the module wrote no text). Codes: kOutOfMemory for a CUDA or cuBLAS
// allocation failure, kInvalidArgument for an invalid value (a module's own
// argument checks report it too), kInternal for anything else.
inline Status cuda_module_status(int rc, const char* err_text, const std::string& what) {
  const StatusCode code = rc == STRATA_CUDA_ERR_MEMORY_ALLOCATION || rc == STRATA_CUDA_ERR_BLAS_ALLOC_FAILED
                              ? StatusCode::kOutOfMemory
                          : rc == STRATA_CUDA_ERR_INVALID_VALUE ? StatusCode::kInvalidArgument
                                                                : StatusCode::kInternal;
  const std::string text = err_text && err_text[0] ? std::string(err_text) : "error " + std::to_string(rc);
  return Status(code, what + " failed: " + text);
}

}  // namespace strata
