// Each `strata` subcommand lives in its own file and registers itself on the
// CLI11 app here. A callback returns the process exit code through
// set_exit_code(): 0 ok, 1 failure the user can fix (bad input), 2 internal.
#pragma once

#include <CLI/CLI.hpp>

#include <string_view>

#include "common/status.h"

namespace strata::tools {

void set_exit_code(int code);
int exit_code();

// "<command>: <message>" on stderr; at log level debug (STRATA_LOG_LEVEL=debug)
// followed by the file:line frames the error passed ("  at src/...:N").
void print_error(std::string_view command, const Status& st);

// `strata bench io ...` (tools/bench_io.cpp)
void register_bench_io(CLI::App& bench);
// `strata bench accumulate ...` (tools/bench_accumulate.cpp): gradient accumulation vs bandwidth
void register_bench_accumulate(CLI::App& bench);
// `strata bench adam ...` (tools/bench_adam.cpp)
void register_bench_adam(CLI::App& bench);

// `strata bench step ...` (tools/bench_step.cpp): the pipelined optimizer step over NVMe
void register_bench_step(CLI::App& bench);

// `strata bench lora ...` (tools/bench_lora.cpp): LoRA with the base on NVMe vs in RAM
void register_bench_lora(CLI::App& bench);

// `strata bench copy ...` (tools/bench_copy.cpp): host<->device bandwidth
void register_bench_copy(CLI::App& bench);

// `strata bench attention ...` (tools/bench_attention.cpp): the CPU attention, tiled vs untiled
void register_bench_attention(CLI::App& bench);

// `strata finetune ...` (tools/finetune.cpp) and `strata demo` (tools/demo.cpp)
void register_finetune(CLI::App& app);
void register_demo(CLI::App& app);

// `strata init-model ...` (tools/init_model.cpp) and `strata plan ...` (tools/plan.cpp)
void register_init_model(CLI::App& app);
void register_plan(CLI::App& app);

}  // namespace strata::tools
