// The `strata` command line.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <new>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "cli_values.h"
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

namespace {

// The compute threads need stack: Eigen's GEMM blocks live there, and glibc
// sizes every new thread's stack from RLIMIT_STACK. A soft limit under 8 MiB
// is raised (as far as the hard limit allows); under 1 MiB the command
// refuses with a message instead of a SIGSEGV mid-run (`ulimit -s 128`).
bool enough_stack() {
  constexpr rlim_t kWant = rlim_t{8} << 20, kNeed = rlim_t{1} << 20;
  rlimit rl{};
  if (::getrlimit(RLIMIT_STACK, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= kWant) return true;
  const rlim_t target = rl.rlim_max == RLIM_INFINITY ? kWant : std::min(kWant, rl.rlim_max);
  if (target > rl.rlim_cur) {
    rlimit raised = rl;
    raised.rlim_cur = target;
    if (::setrlimit(RLIMIT_STACK, &raised) == 0) rl = raised;
  }
  if (rl.rlim_cur >= kNeed) return true;
  std::fprintf(stderr,
               "strata: the stack size limit (ulimit -s) is %llu KiB, hard limit %llu KiB: Strata's compute threads "
               "need at least 1024 KiB; raise it (ulimit -s 8192) and run again\n",
               static_cast<unsigned long long>(rl.rlim_cur >> 10), static_cast<unsigned long long>(rl.rlim_max >> 10));
  return false;
}

// A standard descriptor closed by the caller (`strata ... >&-`, a daemon's
// launcher) is opened on /dev/null: otherwise the first file Strata opens
// takes its number, and progress or error text lands in it (the out dir's
// lock record, a checkpoint). False when that cannot be done.
bool standard_fds_open() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    const int got = ::open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);  // the lowest free number: fd
    if (got != fd) {
      if (got >= 0) ::close(got);
      return false;
    }
  }
  return true;
}

// Whether the command line is `strata plan ... --json` (looked at by hand:
// the parser has just refused it).
bool plan_wants_json(int argc, char** argv) {
  if (argc < 2 || std::string_view(argv[1]) != "plan") return false;
  for (int i = 2; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--") return false;
    if (a == "--json") return true;
  }
  return false;
}

}  // namespace
}  // namespace strata::tools

int main(int argc, char** argv) {
  using namespace strata::tools;
  // A write past `ulimit -f` fails with EFBIG, which every command reports as
  // an error naming the file, instead of SIGXFSZ killing the process mid-save.
  ::signal(SIGXFSZ, SIG_IGN);
  // A closed pipe on stdout or stderr (`strata finetune ... | tee log` and
  // Ctrl-C, which ends tee too) makes writes fail with EPIPE instead of
  // SIGPIPE killing the process before it saves: the run still stops after
  // its step, saves and cleans up.
  ::signal(SIGPIPE, SIG_IGN);
  if (!standard_fds_open()) return 1;
  if (!enough_stack()) return 1;
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
  read_values_strictly(app);

  try {
    app.parse(argc, argv);
  } catch (const std::bad_alloc&) {
    // Memory the system refused where no part turned it into an error (the
    // stack unwound: the run's files are cleaned up as after any error).
    rlimit as{};
    if (::getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY)
      std::fprintf(stderr, "strata: out of memory (the address space is limited to %llu bytes: raise `ulimit -v`)\n",
                   static_cast<unsigned long long>(as.rlim_cur));
    else
      std::fprintf(stderr, "strata: out of memory\n");
    return 1;
  } catch (const CLI::ParseError& e) {
    // --help and --version-like calls exit 0; every usage error exits 1.
    const int rc = app.exit(e) == 0 ? 0 : 1;
    // `strata plan --json` promises one JSON object on stdout whatever goes
    // wrong, a misspelt flag or a bad value too.
    if (rc != 0 && plan_wants_json(argc, argv))
      std::printf("%s\n", nlohmann::json({{"fits", false}, {"error", e.what()}}).dump(2).c_str());
    return rc;
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
