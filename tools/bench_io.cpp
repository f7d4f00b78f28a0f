// Placeholder until the I/O engine lands.
#include "commands.h"
namespace strata::tools {
void register_bench_io(CLI::App&) {}
std::string io_runtime_summary() { return ""; }
}
