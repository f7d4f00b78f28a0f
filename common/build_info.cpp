#include "common/build_info.h"

#include <fmt/format.h>

#include "strata/strata_config.h"

namespace strata {

std::string build_feature_summary() {
  auto yn = [](int v) { return v ? "yes" : "no"; };
  std::string s;
  s += fmt::format("  io_uring (liburing)  {}\n", yn(STRATA_HAVE_URING));
  s += fmt::format("  libaio               {}\n", yn(STRATA_HAVE_AIO));
  s += fmt::format("  posix I/O pool       yes\n");
  s += fmt::format("  oneTBB               {}\n", yn(STRATA_HAVE_TBB));
  s += fmt::format("  CUDA backend         {}{}\n", yn(STRATA_HAVE_CUDA),
                   STRATA_HAVE_CUDA ? " (sm " STRATA_CUDA_ARCHITECTURES ")" : "");
  s += fmt::format("  NCCL                 {}\n", yn(STRATA_HAVE_NCCL));
  s += fmt::format("  MPI                  {}\n", yn(STRATA_HAVE_MPI));
  if (STRATA_SANITIZE) s += "  sanitizers           address,undefined\n";
  return s;
}

}  // namespace strata
