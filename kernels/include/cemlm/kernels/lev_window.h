// The LEV spline window of both generators (kernels/cpu/lev.cc, kernels/cuda/lev.cu):
// lev_basis's weights (lev.h) over the few knots around ζ where the quadratic B-spline is
// non-zero, computed without the others (a spline's cost no longer grows with its knots). Host and
// device code with no CUDA headers; tests/model/lev_test.cc holds the window to lev_basis.
#pragma once
#include <math.h>

#ifdef __CUDACC__
#define CEMLM_HOST_DEVICE __host__ __device__
#else
#define CEMLM_HOST_DEVICE
#endif

namespace cemlm {

// B2 vanishes 1.5 knots from its centre, so at most four knots have a share; five cover them
// whichever way floor(ζ·(κ−1)) rounds near a knot.
constexpr int kLevWindow = 5;

CEMLM_HOST_DEVICE inline float lev_b2(float x) {
  const float a = fabsf(x);
  if (a < 0.5f) return 0.75f - x * x;
  if (a < 1.5f) return 0.5f * (1.5f - a) * (1.5f - a);
  return 0.0f;
}

// w[j] = lev_basis(ζ, knots)[q0 + j] for j < min(kLevWindow, knots) (0 beyond); returns q0. Every
// weight outside the window is exactly 0 in lev_basis too, so the normaliser below adds the same
// non-zero terms in the same order.
CEMLM_HOST_DEVICE inline int lev_basis_window(float zeta, int knots, float* w) {
  const int n = knots < kLevWindow ? knots : kLevWindow;
  const int first = int(floorf(zeta * float(knots - 1))) - 2;
  const int q0 = first < 0 ? 0 : first > knots - n ? knots - n : first;
  double sum = 0;
#ifdef __CUDA_ARCH__  // the device pass (nvcc's host pass would warn)
#pragma unroll
#endif
  for (int j = 0; j < kLevWindow; ++j) {
    const int q = q0 + j;
    w[j] = j < n ? lev_b2((zeta - float(q) / float(knots - 1)) * float(knots - 1)) : 0.0f;
    sum += w[j];
  }
  const float inv = float(1.0 / sum);
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int j = 0; j < kLevWindow; ++j) w[j] *= inv;
  return q0;
}

}  // namespace cemlm

#undef CEMLM_HOST_DEVICE
