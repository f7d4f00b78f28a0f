// Finds and loads the CUDA backend module at run time (see cuda_module.h).
#pragma once

#include <string>

#include "common/host_memory.h"
#include "common/status.h"
#include "cuda/module_abi.h"

namespace strata {

struct CudaBackend {
  const strata_cuda_api_v1_t* api = nullptr;
  std::string module_path;  // where it was loaded from
  int device_count = 0;
};

// Loads the module once per process (thread-safe) and returns it, or why not:
// kUnavailable with the reason (built without CUDA, STRATA_CUDA_DISABLE=1,
// dlopen's error such as a missing libcudart, no visible device). The search
// order is STRATA_CUDA_MODULE, the directory of the running executable and its
// ../lib and ../cuda, then the dynamic linker's path.
Result<CudaBackend> load_cuda_backend();

// Page-locks host memory through the loaded CUDA backend.
class CudaHostRegistrar final : public HostMemoryRegistrar {
 public:
  // `device`: made current before registering (< 0: whichever is current).
  explicit CudaHostRegistrar(const strata_cuda_api_v1_t* api, int device = -1) : api_(api), device_(device) {}
  const char* name() const override { return "cudaHostRegister"; }
  Status register_memory(void* ptr, std::size_t bytes) override;
  void unregister_memory(void* ptr) override;

 private:
  const strata_cuda_api_v1_t* api_;
  int device_;
};

}  // namespace strata
