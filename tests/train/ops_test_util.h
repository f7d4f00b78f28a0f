// Helpers of the train-ops tests: random tensors and a central
// finite-difference gradient check. The shared small model (dims, weights,
// a training step) is small_model.h.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "train/cpu_kernels.h"

namespace strata::train::testing {

template <typename S>
std::vector<S> random_vec(std::mt19937_64& rng, int64_t n, double scale = 1.0, double offset = 0.0) {
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<S> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<S>(offset + scale * dist(rng));
  return v;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Compares grad[i] with (f(p + h e_i) - f(p - h e_i)) / 2h for every i
// (param is perturbed in place and restored). Passes when
// |analytic - numeric| <= atol + rtol * max(|analytic|, |numeric|).
// In double with h = 1e-5 the numeric derivative is good to ~1e-10 relative
// (truncation h^2 f''' / 6, rounding 1e-16 |f| / h), so rtol 1e-6 leaves a
// wide margin while any real mistake (a missing term, a wrong index) shows
// up as an O(1) relative error.
struct GradCheckResult {
  double max_abs_err = 0, max_rel_err = 0;
  int64_t failures = 0;
};

inline GradCheckResult check_grad(const std::string& name, std::vector<double>& param,
                                  const std::vector<double>& grad,
                                  const std::function<double()>& f, double h = 1e-5,
                                  double rtol = 1e-6, double atol = 1e-9) {
  GradCheckResult res;
  EXPECT_EQ(param.size(), grad.size()) << name;
  for (size_t i = 0; i < param.size(); ++i) {
    const double saved = param[i];
    param[i] = saved + h;
    const double fp = f();
    param[i] = saved - h;
    const double fm = f();
    param[i] = saved;
    const double num = (fp - fm) / (2 * h);
    const double err = std::abs(num - grad[i]);
    const double mag = std::max(std::abs(num), std::abs(grad[i]));
    res.max_abs_err = std::max(res.max_abs_err, err);
    if (mag > 1e-12) res.max_rel_err = std::max(res.max_rel_err, err / mag);
    if (err > atol + rtol * mag) {
      if (res.failures < 5)
        ADD_FAILURE() << name << "[" << i << "]: analytic " << grad[i] << " numeric " << num;
      ++res.failures;
    }
  }
  return res;
}

// The standard check: every element of every tensor.
#define STRATA_CHECK_GRAD(name, param, grad, f)                                 \
  do {                                                                          \
    auto _r = ::strata::train::testing::check_grad(name, param, grad, f);       \
    EXPECT_EQ(_r.failures, 0) << name << ": max abs err " << _r.max_abs_err     \
                              << " max rel err " << _r.max_rel_err;             \
  } while (0)

}  // namespace strata::train::testing
