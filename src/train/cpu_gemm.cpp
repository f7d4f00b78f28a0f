// gemm<S>: the generic x86-64 (SSE2) Eigen build for double and as the float
// fallback, and the run-time choice of the float kernel through cpu_optim's
// ISA detection (which also honours STRATA_CPU_ISA, so the generic path can
// be forced and tested on any machine).
#define Eigen StrataEigen_generic
#include "train/gemm_eigen_impl.h"

#include "common/log.h"
#include "cpu_optim/dispatch.h"
#include "train/cpu_kernels.h"

namespace strata::train::cpu {

#if STRATA_TRAIN_GEMM_X86
void gemm_f32_avx2(bool, bool, int64_t, int64_t, int64_t, const float*, int64_t, const float*,
                   int64_t, float*, int64_t, bool);
void gemm_f32_avx512(bool, bool, int64_t, int64_t, int64_t, const float*, int64_t, const float*,
                     int64_t, float*, int64_t, bool);
#endif

namespace {

using GemmF32 = void (*)(bool, bool, int64_t, int64_t, int64_t, const float*, int64_t,
                         const float*, int64_t, float*, int64_t, bool);

void gemm_f32_generic(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
                      int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
                      bool accumulate) {
  gemm_impl::eigen_gemm<float>(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

struct Choice {
  GemmF32 fn;
  const char* name;
};

Choice choose() {
  Result<cpu_optim::Isa> isa = cpu_optim::resolve_isa(cpu_optim::Isa::kAuto);
  if (!isa.ok()) {
    // An unusable STRATA_CPU_ISA: cpu_optim refuses it; the ops stay correct
    // on the generic kernel and say so once.
    log_warn("train ops: {}; using the generic GEMM", isa.status().message());
    return {&gemm_f32_generic, "generic"};
  }
#if STRATA_TRAIN_GEMM_X86
  if (*isa == cpu_optim::Isa::kAvx512) return {&gemm_f32_avx512, "avx512"};
  if (*isa == cpu_optim::Isa::kAvx2) return {&gemm_f32_avx2, "avx2"};
#endif
  return {&gemm_f32_generic, "generic"};
}

const Choice& choice() {
  static const Choice c = choose();
  return c;
}

}  // namespace

template <>
void gemm<float>(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
                 bool accumulate) {
  choice().fn(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

template <>
void gemm<double>(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const double* a,
                  int64_t lda, const double* b, int64_t ldb, double* c, int64_t ldc,
                  bool accumulate) {
  gemm_impl::eigen_gemm<double>(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

const char* gemm_isa() { return choice().name; }

}  // namespace strata::train::cpu
