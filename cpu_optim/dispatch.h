// Which ISA's kernels run: CPUID (and the OS's register-state support, via
// XGETBV) decide what this machine can run; the STRATA_CPU_ISA environment
// variable or ExecOptions::isa may force a path, and forcing one this machine
// cannot run is an error (kUnavailable), never a SIGILL.
//
// Thread-safety: everything here may be called from any thread; detection
// runs once.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"
#include "cpu_optim/types.h"

namespace strata::cpu_optim {

namespace detail {
struct KernelTable;
}

struct CpuFeatures {
  bool x86 = false;
  bool avx2 = false, fma = false, f16c = false;  // with OS ymm support
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512bf16 = false;  // with OS zmm support
  bool neon = false;
};

// Detected once, on first use.
const CpuFeatures& cpu_features();

// "scalar", "avx2", "avx512", "neon", "auto".
const char* isa_name(Isa isa);
// Accepts the names above; kInvalidArgument otherwise.
Result<Isa> parse_isa(std::string_view name);

// True when this binary contains the ISA's kernels and this CPU/OS runs them.
bool isa_supported(Isa isa);
// The fastest supported ISA (ignores STRATA_CPU_ISA).
Isa best_isa();
// kAuto -> STRATA_CPU_ISA if set, else best_isa(). Errors: kUnavailable when
// the requested (or environment-forced) ISA cannot run here, saying why.
Result<Isa> resolve_isa(Isa requested);

// "avx2 (avx2+fma+f16c yes; avx512f/bw/vl no; avx512bf16 no)"
std::string cpu_isa_summary();

namespace detail {
// The kernel table of a supported ISA (resolve_isa first). Never null for a
// supported ISA.
const KernelTable* kernels_for(Isa isa);
}  // namespace detail

}  // namespace strata::cpu_optim
