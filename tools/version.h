// `strata --version`: the version, the features this binary was built with
// (common/build_info.h) and what this machine offers at run time (I/O
// backends that work here, the CPU optimizer ISA chosen, the CUDA device
// backend and its GPUs). Probes the machine each call (opens a test file per
// I/O backend, loads the CUDA module); prints nothing itself. Main thread.
#pragma once

#include <string>

namespace strata::tools {

// The whole text, ending in a newline:
//   strata 0.1.0 (commit ..., RelWithDebInfo)
//   built with:
//     io_uring (liburing)  yes
//     ...
//   on this machine:
//     io backends here     uring yes, aio yes, posix yes
//     cpu optimizer ISA    avx512 (...)
//     device backend       host (...)
std::string version_text();

// The "on this machine" lines, one per part.
std::string io_runtime_summary();         // which I/O backends work here
std::string cpu_optim_runtime_summary();  // the CPU optimizer ISA chosen
std::string device_runtime_summary();     // the CUDA backend loaded? its GPUs

}  // namespace strata::tools
