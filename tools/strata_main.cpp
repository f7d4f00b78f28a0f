// The `strata` command line.
#include <cstdio>
#include <string>

#include "commands.h"
#include "common/build_info.h"
#include "common/tunables.h"
#include "device/cuda_loader.h"

namespace strata::tools {
namespace {
int g_exit_code = 0;
}

void set_exit_code(int code) { g_exit_code = code; }
int exit_code() { return g_exit_code; }

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

}  // namespace strata::tools

int main(int argc, char** argv) {
  using namespace strata::tools;
  CLI::App app{"strata: offload engine for fine-tuning models larger than GPU memory"};
  app.require_subcommand(0, 1);
  bool version = false;
  app.add_flag("--version", version, "Print the version and the features built in and available here");

  CLI::App* bench = app.add_subcommand("bench", "Measure a part against a ceiling measured in the same run");
  bench->require_subcommand(1);
  register_bench_io(*bench);
  register_bench_adam(*bench);
  register_bench_copy(*bench);
  register_bench_step(*bench);
  register_init_model(app);
  register_plan(app);
  register_finetune(app);
  register_demo(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version-like calls exit 0; every usage error exits 1.
    return app.exit(e) == 0 ? 0 : 1;
  }
  if (version) {
    std::printf("strata %s\nbuilt with:\n%s", strata::version_string(), strata::build_feature_summary().c_str());
    std::printf("on this machine:\n%s%s%s", io_runtime_summary().c_str(), cpu_optim_runtime_summary().c_str(),
                device_runtime_summary().c_str());
    return 0;
  }
  if (app.get_subcommands().empty()) {
    // No command is a usage error (as `strata bench` alone is).
    std::fprintf(stderr, "%s", app.help().c_str());
    return 1;
  }
  return exit_code();
}
