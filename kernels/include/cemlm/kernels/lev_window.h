// The LEV spline window of the generator (kernels/cpu/lev.cc): lev_basis's weights (lev.h) over
// the few knots around ζ where the quadratic B-spline is non-zero, computed without the others (a
// spline's cost no longer grows with its knots). In float for the trainer's forward, in double
// for the table the engines build at load. tests/model/lev_test.cc holds the window to lev_basis.
#pragma once
#include <cmath>

namespace cemlm {

// B2 vanishes 1.5 knots from its centre, so at most four knots have a share; five cover them
// whichever way floor(ζ·(κ−1)) rounds near a knot.
constexpr int kLevWindow = 5;

template <typename T>
inline T lev_b2(T x) {
  const T a = std::fabs(x);
  if (a < T(0.5)) return T(0.75) - x * x;
  if (a < T(1.5)) return T(0.5) * (T(1.5) - a) * (T(1.5) - a);
  return T(0);
}

// w[j] = lev_basis(ζ, knots)[q0 + j] for j < min(kLevWindow, knots) (0 beyond); returns q0. Every
// weight outside the window is exactly 0 in lev_basis too, so the normaliser below adds the same
// non-zero terms in the same order.
template <typename T>
inline int lev_basis_window(T zeta, int knots, T* w) {
  const int n = knots < kLevWindow ? knots : kLevWindow;
  const int first = int(std::floor(zeta * T(knots - 1))) - 2;
  const int q0 = first < 0 ? 0 : first > knots - n ? knots - n : first;
  double sum = 0;
  for (int j = 0; j < kLevWindow; ++j) {
    const int q = q0 + j;
    w[j] = j < n ? lev_b2<T>((zeta - T(q) / T(knots - 1)) * T(knots - 1)) : T(0);
    sum += w[j];
  }
  const T inv = T(1.0 / sum);
  for (int j = 0; j < kLevWindow; ++j) w[j] *= inv;
  return q0;
}

}  // namespace cemlm
