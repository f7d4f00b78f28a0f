#include "cpu_optim/dispatch.h"

#include <string>

#include "common/enum_names.h"
#include "common/log.h"
#include "common/tunables.h"
#include "cpu_optim/arch/kernel_table.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define STRATA_CPU_OPTIM_X86 1
#else
#define STRATA_CPU_OPTIM_X86 0
#endif

namespace strata {
template <>
inline constexpr auto kEnumNames<cpu_optim::Isa> = std::to_array<EnumName<cpu_optim::Isa>>({
    {cpu_optim::Isa::kAuto, "auto"},
    {cpu_optim::Isa::kScalar, "scalar"},
    {cpu_optim::Isa::kAvx2, "avx2"},
    {cpu_optim::Isa::kAvx512, "avx512"},
    {cpu_optim::Isa::kNeon, "neon"},
});
}  // namespace strata

namespace strata::cpu_optim {
namespace {

#if STRATA_CPU_OPTIM_X86
// XGETBV(0): which register state the OS saves on context switch. A CPU may
// report AVX-512 while the OS (or hypervisor) does not enable zmm state; the
// instructions then fault, so CPUID alone is not enough.
unsigned long long xgetbv0() {
  unsigned eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}
#endif

CpuFeatures detect() {
  CpuFeatures f;
#if STRATA_CPU_OPTIM_X86
  f.x86 = true;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  const bool has_fma = c & (1u << 12);
  const bool has_f16c = c & (1u << 29);
  const bool has_avx = c & (1u << 28);
  if (!osxsave || !has_avx) return f;
  const unsigned long long xcr0 = xgetbv0();
  const bool os_ymm = (xcr0 & 0x6) == 0x6;     // SSE + AVX state
  const bool os_zmm = (xcr0 & 0xe6) == 0xe6;   // + opmask, ZMM_Hi256, Hi16_ZMM
  if (!os_ymm) return f;
  unsigned a7 = 0, b7 = 0, c7 = 0, d7 = 0;
  if (__get_cpuid_count(7, 0, &a7, &b7, &c7, &d7)) {
    f.avx2 = b7 & (1u << 5);
    f.fma = has_fma;
    f.f16c = has_f16c;
    if (os_zmm) {
      f.avx512f = b7 & (1u << 16);
      f.avx512bw = b7 & (1u << 30);
      f.avx512vl = b7 & (1u << 31);
      unsigned a71 = 0, b71 = 0, c71 = 0, d71 = 0;
      if (a7 >= 1 && __get_cpuid_count(7, 1, &a71, &b71, &c71, &d71)) f.avx512bf16 = a71 & (1u << 5);
    }
  }
#elif defined(__aarch64__)
  f.neon = true;  // Advanced SIMD is mandatory on AArch64
#endif
  return f;
}

bool avx2_ok(const CpuFeatures& f) { return f.avx2 && f.fma && f.f16c; }
bool avx512_ok(const CpuFeatures& f) { return avx2_ok(f) && f.avx512f && f.avx512bw && f.avx512vl; }

const detail::KernelTable* compiled_table(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return &detail::kScalarKernels;
#if STRATA_CPU_OPTIM_X86
    case Isa::kAvx2: return &detail::kAvx2Kernels;
    case Isa::kAvx512: return &detail::kAvx512Kernels;
#endif
#if defined(__aarch64__)
    case Isa::kNeon: return &detail::kNeonKernels;
#endif
    default: return nullptr;
  }
}

const char* missing_reason(Isa isa) {
  switch (isa) {
    case Isa::kAvx2: return "needs avx2+fma+f16c with OS ymm state support";
    case Isa::kAvx512: return "needs avx512f+avx512bw+avx512vl (and avx2+fma+f16c) with OS zmm state support";
    case Isa::kNeon: return "needs an AArch64 CPU (this binary has no NEON kernels)";
    default: return "not built in";
  }
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

const char* isa_name(Isa isa) { return enum_name(isa); }

Result<Isa> parse_isa(std::string_view name) {
  if (std::optional<Isa> i = find_enum<Isa>(name)) return *i;
  return Status(StatusCode::kInvalidArgument,
                "unknown CPU ISA '" + std::string(name) + "' (expected " + enum_name_list<Isa>("|") + ")");
}

bool isa_supported(Isa isa) {
  if (!compiled_table(isa)) return false;
  const CpuFeatures& f = cpu_features();
  switch (isa) {
    case Isa::kScalar: return true;
    case Isa::kAvx2: return avx2_ok(f);
    case Isa::kAvx512: return avx512_ok(f);
    case Isa::kNeon: return f.neon;
    case Isa::kAuto: return true;
  }
  return false;
}

Isa best_isa() {
  for (Isa i : {Isa::kAvx512, Isa::kAvx2, Isa::kNeon})
    if (isa_supported(i)) return i;
  return Isa::kScalar;
}

Result<Isa> resolve_isa(Isa requested) {
  const char* source = "requested";
  if (requested == Isa::kAuto) {
    const std::string& env = tunables().cpu_isa;
    if (env.empty()) return best_isa();
    auto parsed = parse_isa(env);
    if (!parsed.ok()) return parsed.status();
    requested = parsed.value();
    source = "STRATA_CPU_ISA";
  }
  if (requested == Isa::kAuto) return best_isa();
  if (!isa_supported(requested))
    return Status(StatusCode::kUnavailable, std::string("CPU optimizer ISA '") + isa_name(requested) + "' (" +
                                                source + ") cannot run on this machine: " +
                                                missing_reason(requested));
  return requested;
}

std::string cpu_isa_summary() {
  const CpuFeatures& f = cpu_features();
  std::string chosen;
  auto r = resolve_isa(Isa::kAuto);
  chosen = r.ok() ? isa_name(r.value()) : "error: " + r.status().message();
  if (!tunables().cpu_isa.empty() && r.ok()) chosen += " (forced by STRATA_CPU_ISA)";
  if (f.x86) {
    auto yn = [](bool b) { return b ? "yes" : "no"; };
    chosen += std::string(" (avx2+fma+f16c ") + yn(avx2_ok(f)) + "; avx512f/bw/vl " + yn(avx512_ok(f)) +
              "; avx512bf16 " + yn(f.avx512bf16) + ")";
  } else if (f.neon) {
    chosen += " (aarch64 advanced simd)";
  }
  return chosen;
}

namespace detail {
const KernelTable* kernels_for(Isa isa) { return isa_supported(isa) ? compiled_table(isa) : nullptr; }
}  // namespace detail

}  // namespace strata::cpu_optim
