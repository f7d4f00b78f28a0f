// The float GEMM compiled for AVX2 + FMA (see gemm_eigen_impl.h for why
// Eigen's namespace is renamed here). Selected at run time by cpu_gemm.cpp.
#define Eigen StrataEigen_avx2
#include "train/gemm_eigen_impl.h"

namespace strata::train::cpu {

void gemm_f32_avx2(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
                   int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
                   bool accumulate) {
  gemm_impl::eigen_gemm<float>(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

}  // namespace strata::train::cpu
