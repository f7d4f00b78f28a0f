#include "version.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>

#include "common/build_info.h"
#include "cpu_optim/dispatch.h"
#include "device/cuda_loader.h"
#include "io/io_engine.h"
#include "strata/git_commit.h"

namespace strata::tools {

std::string io_runtime_summary() {
  std::string line;
  for (const auto& b : io::io_backends_built()) {
    Status s = io::io_backend_probe(b);
    if (!line.empty()) line += ", ";
    line += b + (s.ok() ? " yes" : " no (" + s.message() + ")");
  }
  for (const char* b : {"uring", "aio"}) {
    auto built = io::io_backends_built();
    if (std::find(built.begin(), built.end(), b) == built.end()) line += std::string(", ") + b + " not built";
  }
  return fmt::format("  {:<21}{}\n", "io backends here", line);
}

std::string cpu_optim_runtime_summary() {
  return "  cpu optimizer ISA    " + cpu_optim::cpu_isa_summary() + "\n";
}

std::string device_runtime_summary() {
  auto cuda = load_cuda_backend();
  if (!cuda.ok()) return "  device backend       host (" + cuda.status().message() + ")\n";
  std::string s = "  device backend       cuda (" + cuda->module_path + ")\n";
  for (int d = 0; d < cuda->device_count; ++d) {
    char desc[256] = {0}, err[256] = {0};
    if (cuda->api->device_describe(d, desc, sizeof(desc), err, sizeof(err)) == 0)
      s += "  gpu " + std::to_string(d) + "                " + desc + "\n";
    else
      s += "  gpu " + std::to_string(d) + "                (" + err + ")\n";
  }
  return s;
}

std::string version_text() {
  return fmt::format("strata {}\nbuilt with:\n{}on this machine:\n{}{}{}", STRATA_VERSION_STRING, build_feature_summary(),
                     io_runtime_summary(), cpu_optim_runtime_summary(), device_runtime_summary());
}

}  // namespace strata::tools
