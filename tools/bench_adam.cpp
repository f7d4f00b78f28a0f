// Placeholder until the CPU optimizers land.
#include "commands.h"
namespace strata::tools {
void register_bench_adam(CLI::App&) {}
std::string cpu_optim_runtime_summary() { return ""; }
}
