// `strata bench copy`: host<->device copy bandwidth with pinned memory on a
// dedicated stream (the CUDA backend's copy_bandwidth). Needs a GPU.
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "device/cuda_loader.h"

namespace strata::tools {

void register_bench_copy(CLI::App& bench) {
  auto* cmd = bench.add_subcommand("copy", "Host<->device copy bandwidth with pinned memory (needs a GPU)");
  struct Opts {
    std::size_t mib = 256;
    int iters = 10;
    int device = 0;
    bool json = false;
  };
  auto opts = std::make_shared<Opts>();
  cmd->add_option("--mib", opts->mib, "Transfer size in MiB")->check(CLI::Range(1, 65536));
  cmd->add_option("--iters", opts->iters, "Timed iterations (median reported)")->check(CLI::Range(1, 1000));
  cmd->add_option("--device", opts->device, "GPU index")->check(CLI::NonNegativeNumber);
  cmd->add_flag("--json", opts->json, "Print one JSON object");
  cmd->callback([opts] {
    auto cuda = load_cuda_backend();
    if (!cuda.ok()) {
      std::fprintf(stderr, "strata bench copy: %s\n", cuda.status().message().c_str());
      set_exit_code(1);
      return;
    }
    if (opts->device >= cuda->device_count) {
      std::fprintf(stderr, "strata bench copy: --device %d but only %d GPU(s) visible\n", opts->device,
                   cuda->device_count);
      set_exit_code(1);
      return;
    }
    double h2d = 0, d2h = 0;
    char err[256] = {0};
    std::size_t bytes = opts->mib << 20;
    if (cuda->api->copy_bandwidth(opts->device, bytes, opts->iters, &h2d, &d2h, err, sizeof(err)) != 0) {
      std::fprintf(stderr, "strata bench copy: %s\n", err);
      set_exit_code(2);
      return;
    }
    if (opts->json) {
      nlohmann::json j = {{"bytes", bytes}, {"iters", opts->iters}, {"h2d_gbps", h2d}, {"d2h_gbps", d2h}};
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("pinned copy, %zu MiB, median of %d: host->device %.2f GB/s, device->host %.2f GB/s\n", opts->mib,
                  opts->iters, h2d, d2h);
    }
  });
}

}  // namespace strata::tools
