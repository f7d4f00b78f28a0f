#include "device/cuda_loader.h"

#include <cstddef>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "common/log.h"
#include "common/tunables.h"
#include "strata/strata_config.h"

namespace strata {
namespace {

std::string dir_of(const std::string& p) {
  auto slash = p.rfind('/');
  return slash == std::string::npos ? "." : p.substr(0, slash);
}

std::string exe_dir() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  buf[n] = '\0';
  return dir_of(buf);
}

// The directory of the binary this code is in: libstrata.so inside a Python
// process or another trainer (where /proc/self/exe is the interpreter), the
// strata executable itself when linked statically.
std::string this_object_dir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&exe_dir), &info) == 0 || !info.dli_fname) return "";
  char real[PATH_MAX];
  if (!realpath(info.dli_fname, real)) return dir_of(info.dli_fname);
  return dir_of(real);
}

// A module file that exists but does not load (a missing libcudart, an ABI
// mismatch) is worth a warning; no GPU is not.
bool g_module_broken = false;

Result<CudaBackend> load_once() {
  if (!STRATA_HAVE_CUDA) return Status(StatusCode::kUnavailable, "this build has no CUDA backend (STRATA_CUDA=OFF)");
  if (tunables().cuda_disable) return Status(StatusCode::kUnavailable, "disabled by STRATA_CUDA_DISABLE=1");

  // Where the build and `cmake --install` put the module: next to the
  // executable (build tree: tools/), in <prefix>/lib/strata/ next to an
  // installed libstrata.so or below an installed bin/strata.
  std::vector<std::string> candidates;
  if (!tunables().cuda_module.empty()) {
    candidates.push_back(tunables().cuda_module);
  } else {
    std::vector<std::string> dirs;
    for (const std::string& d : {this_object_dir(), exe_dir()}) {
      if (d.empty()) continue;
      for (const std::string& sub : {std::string(""), std::string("/strata"), std::string("/../lib/strata"),
                                     std::string("/../lib"), std::string("/../cuda")}) {
        const std::string c = d + sub + "/libstrata_cuda.so";
        if (std::find(candidates.begin(), candidates.end(), c) == candidates.end()) candidates.push_back(c);
      }
    }
    candidates.push_back("libstrata_cuda.so");
  }
  std::string errors;
  for (const auto& path : candidates) {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      const char* e = dlerror();
      // A missing file is expected for most candidates; a present file that
      // fails to load (e.g. libcudart.so.13 missing) is the interesting reason.
      if (access(path.c_str(), F_OK) == 0) {
        g_module_broken = true;
        errors += (errors.empty() ? "" : "; ") + std::string(e ? e : path.c_str());
      } else if (path.find('/') == std::string::npos) {
        errors += (errors.empty() ? "" : "; ") + std::string(e ? e : path.c_str());
      }
      continue;
    }
    auto fn = reinterpret_cast<strata_cuda_api_v1_fn>(dlsym(handle, STRATA_CUDA_API_SYMBOL));
    if (!fn) {
      g_module_broken = true;
      errors += "; " + path + " has no symbol " STRATA_CUDA_API_SYMBOL;
      dlclose(handle);
      continue;
    }
    const strata_cuda_api_v1_t* api = fn();
    if (!api || api->abi_version != STRATA_CUDA_ABI_VERSION || api->struct_size < sizeof(strata_cuda_api_v1_t)) {
      dlclose(handle);
      g_module_broken = true;
      return Status(StatusCode::kUnavailable, path + " speaks another backend ABI version; rebuild Strata");
    }
    CudaBackend b;
    b.api = api;
    char real[PATH_MAX];
    b.module_path = realpath(path.c_str(), real) ? std::string(real) : path;
    char err[256] = {0};
    if (api->device_count(&b.device_count, err, sizeof(err)) != 0 || b.device_count == 0) {
      // Keep the module loaded (unloading CUDA runtimes is unsafe); report why.
      return Status(StatusCode::kUnavailable,
                    "no CUDA device: " + std::string(err[0] ? err : "no visible GPU") + " (module " + b.module_path +
                        ")");
    }
    return b;
  }
  return Status(StatusCode::kUnavailable,
                "CUDA backend module not loadable: " + (errors.empty() ? std::string("libstrata_cuda.so not found") : errors));
}

}  // namespace

Result<CudaSiblingModule> load_cuda_sibling_module(const char* file_name, const char* symbol,
                                                   const char* env_override) {
  STRATA_ASSIGN_OR_RETURN(CudaBackend backend, load_cuda_backend());
  std::vector<std::string> candidates;
  if (env_override)
    if (const char* env = std::getenv(env_override); env && env[0]) candidates.push_back(env);
  if (backend.module_path.find('/') != std::string::npos)
    candidates.push_back(dir_of(backend.module_path) + "/" + file_name);
  const std::string exe = exe_dir();
  for (const char* sub : {"/", "/../lib/", "/../cuda/"}) candidates.push_back(exe + sub + file_name);
  candidates.push_back(file_name);
  std::string errors;
  for (const auto& path : candidates) {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      const char* e = dlerror();
      // A present file that fails to load is the interesting reason; absent
      // candidates are expected.
      if (access(path.c_str(), F_OK) == 0 || path.find('/') == std::string::npos)
        errors += (errors.empty() ? "" : "; ") + std::string(e ? e : path.c_str());
      continue;
    }
    void* fn = dlsym(handle, symbol);
    if (!fn) {
      errors += (errors.empty() ? "" : "; ") + path + " has no symbol " + symbol;
      dlclose(handle);
      continue;
    }
    return CudaSiblingModule{fn, path};
  }
  return Status(StatusCode::kUnavailable,
                errors.empty() ? std::string(file_name) + " not found next to " + backend.module_path : errors);
}

Result<CudaBackend> load_cuda_backend() {
  static std::once_flag once;
  static Result<CudaBackend> result = Status(StatusCode::kInternal, "not loaded");
  std::call_once(once, [] {
    result = load_once();
    if (!result.ok())
      log_once(g_module_broken ? LogLevel::kWarn : LogLevel::kInfo, "cuda-backend",
               "using the host backend: " + result.status().message());
  });
  return result;
}

Status CudaHostRegistrar::register_memory(void* ptr, std::size_t bytes) {
  char err[256] = {0};
  const bool on = device_ >= 0 && api_->struct_size >= offsetof(strata_cuda_api_v1_t, host_register_on) +
                                                          sizeof(api_->host_register_on);
  if ((on ? api_->host_register_on(device_, ptr, bytes, err, sizeof(err))
          : api_->host_register(ptr, bytes, err, sizeof(err))) != 0)
    return Status(StatusCode::kOutOfMemory, "cudaHostRegister of " + std::to_string(bytes) + " bytes failed: " + err +
                                                " (page-locked memory is limited by RLIMIT_MEMLOCK; raise `ulimit -l`)");
  return Status();
}

void CudaHostRegistrar::unregister_memory(void* ptr) {
  char err[256] = {0};
  const bool on = device_ >= 0 && api_->struct_size >= offsetof(strata_cuda_api_v1_t, host_unregister_on) +
                                                          sizeof(api_->host_unregister_on);
  if ((on ? api_->host_unregister_on(device_, ptr, err, sizeof(err)) : api_->host_unregister(ptr, err, sizeof(err))) !=
      0)
    log_warn("cudaHostUnregister failed: {}", err);
}

}  // namespace strata
