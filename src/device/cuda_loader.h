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

// A second CUDA module (the model ops' libstrata_cuda_train.so, the NCCL
// communicator's libstrata_nccl.so) loaded the way the device backend's is:
// the device backend's module first (no point, and no driver, without it),
// then `file_name` from `env_override`'s value when that variable is set,
// the directory the device backend's module came from, the executable's
// directory and its ../lib and ../cuda, and the dynamic linker's path.
// Returns the module's `symbol` (the caller checks the ABI it returns) and
// where it came from; never unloaded (CUDA libraries do not unload safely).
// Errors: kUnavailable with why (the device backend's reason; dlopen's text
// for a file that exists but does not load, e.g. a missing libcublas or
// libnccl; "not found next to ...").
struct CudaSiblingModule {
  void* symbol = nullptr;
  std::string path;
};
Result<CudaSiblingModule> load_cuda_sibling_module(const char* file_name, const char* symbol,
                                                   const char* env_override = nullptr);

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
