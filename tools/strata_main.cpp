// The `strata` command line.
#include <signal.h>

#include <cstdio>
#include <string>

#include "commands.h"
#include "common/log.h"
#include "version.h"

namespace strata::tools {
namespace {
int g_exit_code = 0;
}

void set_exit_code(int code) { g_exit_code = code; }
int exit_code() { return g_exit_code; }

void print_error(std::string_view command, const Status& st) {
  std::fprintf(stderr, "%.*s: %s\n", static_cast<int>(command.size()), command.data(), st.message().c_str());
  if (log_level() >= LogLevel::kDebug) std::fprintf(stderr, "%s", st.trace_string().c_str());
}

}  // namespace strata::tools

int main(int argc, char** argv) {
  using namespace strata::tools;
  // A write past `ulimit -f` fails with EFBIG, which every command reports as
  // an error naming the file, instead of SIGXFSZ killing the process mid-save.
  ::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"strata: offload engine for fine-tuning models larger than GPU memory"};
  app.require_subcommand(0, 1);
  bool version = false;
  app.add_flag("--version", version, "Print the version and the features built in and available here");

  CLI::App* bench = app.add_subcommand("bench", "Measure a part against a ceiling measured in the same run");
  bench->require_subcommand(1);
  register_bench_io(*bench);
  register_bench_adam(*bench);
  register_bench_accumulate(*bench);
  register_bench_copy(*bench);
  register_bench_step(*bench);
  register_bench_lora(*bench);
  register_bench_attention(*bench);
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
    std::printf("%s", version_text().c_str());
    return 0;
  }
  if (app.get_subcommands().empty()) {
    // No command is a usage error (as `strata bench` alone is).
    std::fprintf(stderr, "%s", app.help().c_str());
    return 1;
  }
  return exit_code();
}
