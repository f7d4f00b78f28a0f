// The body of the row-major GEMM over Eigen, included by one translation
// unit per ISA (cpu_gemm.cpp: generic x86-64; cpu_gemm_avx2.cpp,
// cpu_gemm_avx512.cpp: compiled with that ISA's flags). Each such TU first
// renames Eigen's namespace with a macro (`#define Eigen StrataEigen_<isa>`)
// so that the Eigen template instances compiled with different flags are
// different symbols: without that, the linker would keep one copy of each
// (the ODR lets it) and could run AVX-512 code on a CPU without it.
//
// Include only after defining STRATA_GEMM_FN (the function's name).
#pragma once

#ifndef EIGEN_DONT_PARALLELIZE
#define EIGEN_DONT_PARALLELIZE  // one thread pool: TBB's (train/cpu_kernels.h)
#endif
#include <Eigen/Core>

#include <cstdint>

namespace strata::train::cpu::gemm_impl {
namespace {

template <typename S>
void eigen_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const S* a,
                int64_t lda, const S* b, int64_t ldb, S* c, int64_t ldc, bool accumulate) {
  using Mat = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using CMap = Eigen::Map<const Mat, 0, Eigen::OuterStride<>>;
  using MMap = Eigen::Map<Mat, 0, Eigen::OuterStride<>>;
  MMap cm(c, m, n, Eigen::OuterStride<>(ldc));
  if (k == 0) {
    if (!accumulate) cm.setZero();
    return;
  }
  // A stored [m, k] or, transposed, [k, m]; B stored [k, n] or [n, k].
  CMap am(a, trans_a ? k : m, trans_a ? m : k, Eigen::OuterStride<>(lda));
  CMap bm(b, trans_b ? n : k, trans_b ? k : n, Eigen::OuterStride<>(ldb));
  auto run = [&](const auto& lhs, const auto& rhs) {
    if (accumulate) {
      cm.noalias() += lhs * rhs;
    } else {
      cm.noalias() = lhs * rhs;
    }
  };
  if (!trans_a && !trans_b) {
    run(am, bm);
  } else if (!trans_a && trans_b) {
    run(am, bm.transpose());
  } else if (trans_a && !trans_b) {
    run(am.transpose(), bm);
  } else {
    run(am.transpose(), bm.transpose());
  }
}

}  // namespace
}  // namespace strata::train::cpu::gemm_impl
