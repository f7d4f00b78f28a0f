// Every STRATA_* environment variable is read here, once, and nowhere else.
// docs/config.md documents each one with its default; keep the two in step.
//
// Environment variables override built-in defaults; an explicit setting in a
// config file or API call overrides the environment.
#pragma once

#include <cstdint>
#include <string>

#include "common/log.h"

namespace strata {

struct Tunables {
  LogLevel log_level = LogLevel::kWarn;  // STRATA_LOG_LEVEL
  std::string io_backend;                // STRATA_IO_BACKEND: uring|aio|posix ("" = auto)
  std::string cpu_isa;                   // STRATA_CPU_ISA: avx512|avx2|neon|scalar ("" = best)
  int threads = 0;                       // STRATA_THREADS (0 = the cores this process may use)
  bool io_uring_disable = false;         // STRATA_IO_URING_DISABLE=1 behaves as if io_uring were unavailable
  unsigned io_queue_depth = 32;          // STRATA_IO_QUEUE_DEPTH: I/O pieces in flight per engine (1..4096)
  std::uint64_t io_block_bytes = 1 << 20;  // STRATA_IO_BLOCK_BYTES: largest I/O piece (multiple of 4096, <= 64 MiB)
  bool io_sqpoll = false;                // STRATA_IO_SQPOLL=1: io_uring with a kernel submission thread
  bool cuda_disable = false;             // STRATA_CUDA_DISABLE=1 never loads the CUDA backend
  std::string cuda_module;               // STRATA_CUDA_MODULE: path of libstrata_cuda.so ("" = next to libstrata)
  bool require_gpu = false;              // STRATA_REQUIRE_GPU=1: "auto" never falls back to the host backend
};

// Parsed once on first use; malformed values are reported with log_warn and
// ignored (the default stays).
const Tunables& tunables();

// Re-reads the environment (tests that setenv() call this).
void reload_tunables();

}  // namespace strata
