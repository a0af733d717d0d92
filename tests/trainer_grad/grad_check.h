// Finite-difference helpers for the gradient tests: random fills, and a directional check that
// compares ⟨analytic gradient, v⟩ with a Richardson-extrapolated central difference of the
// objective along v — robust in fp32, where element-wise differences are not.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "cemlm/engine/params.h"

namespace cemlm::grad_check {

inline std::vector<float> randn(size_t n, Rng& rng, double std = 1.0, double mean = 0.0) {
  std::vector<float> v(n);
  for (float& x : v) x = float(mean + std * rng.normal());
  return v;
}

inline double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * b[i];
  return s;
}

// Derivative of `objective` along v at the current value of `x` (restored afterwards):
// (4·D(h/2) − D(h)) / 3 with D(h) = (f(x + h v) − f(x − h v)) / 2h.
inline double directional_fd(const std::function<double()>& objective, float* x,
                             const std::vector<float>& v, double h) {
  const std::vector<float> x0(x, x + v.size());
  auto at = [&](double s) {
    for (size_t i = 0; i < v.size(); ++i) x[i] = float(x0[i] + s * v[i]);
    return objective();
  };
  const double d1 = (at(h) - at(-h)) / (2 * h);
  const double d2 = (at(h / 2) - at(-h / 2)) / h;
  std::copy(x0.begin(), x0.end(), x);
  return (4 * d2 - d1) / 3;
}

// Checks `grad` (the analytic gradient of objective w.r.t. x[0..n)) along a random unit direction
// and along its own direction: |fd − analytic| ≤ rel·|analytic| + abs.
inline void expect_directional(const std::string& what, const std::function<double()>& objective,
                               float* x, const std::vector<float>& grad, Rng& rng, double h,
                               double rel, double abs) {
  std::vector<float> dirs[2] = {randn(grad.size(), rng), grad};
  for (auto& v : dirs) {
    const double norm = std::sqrt(dot(v, v));
    if (norm == 0) continue;
    for (float& e : v) e = float(e / norm);
    const double analytic = dot(grad, v);
    const double fd = directional_fd(objective, x, v, h);
    EXPECT_NEAR(fd, analytic, rel * std::abs(analytic) + abs) << what;
  }
}

}  // namespace cemlm::grad_check
