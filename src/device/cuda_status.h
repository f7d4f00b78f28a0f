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

// Sticky CUDA errors: after one the process's CUDA context is dead and every
// later call fails the same way (a kernel's illegal address, a failed launch,
// a device assert, an uncorrectable ECC error...). cudaError_t values, stable
// across CUDA releases: cudaErrorECCUncorrectable 214, NvlinkUncorrectable
// 220, IllegalAddress 700, LaunchTimeout 702, ContextIsDestroyed 709, Assert
// 710, HardwareStackError 714, IllegalInstruction 715, MisalignedAddress 716,
// InvalidAddressSpace 717, InvalidPc 718, LaunchFailure 719, TensorMemoryLeak 721,
// Contained 226 (Hopper's error containment: a bad peer access over NVLink,
// some hardware errors), MpsClientTerminated 810, ExternalDevice 911: every
// code driver_types.h says needs the process "terminated and relaunched".
inline bool cuda_error_is_sticky(int rc) {
  switch (rc) {
    case 214: case 220: case 226: case 700: case 702: case 709: case 710: case 714: case 715: case 716:
    case 717: case 718: case 719: case 721: case 810: case 911:
      return true;
    default:
      return false;
  }
}

// `what` names the module and the operation ("cuda: cudaMalloc of 4096
// bytes"); the message is "<what> failed: <err_text>" (or "error <rc>" when
// the module wrote no text). Codes: kOutOfMemory for a CUDA or cuBLAS
// allocation failure, kInvalidArgument for an invalid value (a module's own
// argument checks report it too), kUnavailable for a sticky error (the GPU
// context is lost: nothing can be retried in this process, and the message
// says so), kInternal for anything else.
inline Status cuda_module_status(int rc, const char* err_text, const std::string& what) {
  const std::string text = err_text && err_text[0] ? std::string(err_text) : "error " + std::to_string(rc);
  if (cuda_error_is_sticky(rc))
    return Status(StatusCode::kUnavailable,
                  what + " failed: " + text +
                      "; the GPU context is lost (a sticky CUDA error): no CUDA call can succeed in this process "
                      "any more, restart it (resume from the last checkpoint)");
  const StatusCode code = rc == STRATA_CUDA_ERR_MEMORY_ALLOCATION || rc == STRATA_CUDA_ERR_BLAS_ALLOC_FAILED
                              ? StatusCode::kOutOfMemory
                          : rc == STRATA_CUDA_ERR_INVALID_VALUE ? StatusCode::kInvalidArgument
                                                                : StatusCode::kInternal;
  return Status(code, what + " failed: " + text);
}

}  // namespace strata
