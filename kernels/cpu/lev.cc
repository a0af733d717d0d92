// CPU LEV generator: one token per work item; small per-token buffers live on the stack-sized
// vectors of each thread (sizes are the LEV hyper-parameters, independent of N).
#include "cemlm/kernels/lev.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cemlm/kernels/lev_window.h"

namespace cemlm {

void lev_digits(int64_t token, int k, int b, int* digits) {
  for (int j = k - 1; j >= 0; --j) {
    digits[j] = int(token % b);
    token /= b;
  }
}

void lev_basis(float zeta, int knots, float* w) {
  double sum = 0;
  for (int q = 0; q < knots; ++q) {
    w[q] = lev_b2((zeta - float(q) / float(knots - 1)) * float(knots - 1));
    sum += w[q];
  }
  const float inv = float(1.0 / sum);
  for (int q = 0; q < knots; ++q) w[q] *= inv;
}

namespace {

// Embed(ids[i]) for each i in T arithmetic, rounded to float once at the end. T = float keeps the
// trainer's summation orders; T = double is the engines' table (lev_forward_f64).
template <typename T>
void lev_rows(Tensor out, const int32_t* ids, const LevWeights& w) {
  const int k = int(w.codebooks.dim(0)), b = int(w.codebooks.dim(1)), s = int(w.codebooks.dim(2));
  const int nh = int(w.seed_proj.dim(0)), kn = int(w.spline.dim(2)), r = int(w.spline.dim(3));
  const int64_t N = out.dim(0), D = out.dim(1);
  constexpr bool kFloat = std::is_same_v<T, float>;
  // W_seed transposed, so that u = W_seed z vectorizes across u with each u_a still summed in
  // the order of b.
  std::vector<T> seed_t(size_t(nh) * s * s);
  for (int l = 0; l < nh; ++l)
    for (int a = 0; a < s; ++a)
      for (int e = 0; e < s; ++e)
        seed_t[(size_t(l) * s + e) * s + a] = T(w.seed_proj.data[(int64_t(l) * s + a) * s + e]);
#pragma omp parallel
  {
    std::vector<T> z(s), u(s), m(r), phi(r), row_acc(kFloat ? 0 : D);
    std::vector<int> dig(k);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      lev_digits(ids[i], k, b, dig.data());
      std::fill(z.begin(), z.end(), T(0));
      for (int j = 0; j < k; ++j) {
        const float* row = w.codebooks.data + (int64_t(j) * b + dig[j]) * s;
        for (int e = 0; e < s; ++e) z[e] += T(row[e]);
      }
      // float sums straight into the output row; double into row_acc, rounded at the end.
      T* oi;
      if constexpr (kFloat)
        oi = out.data + i * D;
      else
        oi = row_acc.data();
      std::fill(oi, oi + D, T(0));
      for (int l = 0; l < nh; ++l) {
        const T* Wt = seed_t.data() + size_t(l) * s * s;
        T* ul = u.data();
        std::fill(ul, ul + s, T(0));
        for (int e = 0; e < s; ++e) {
          const T ze = z[e];
#pragma omp simd
          for (int a = 0; a < s; ++a) ul[a] += Wt[e * s + a] * ze;
        }
        double mean = 0;
        for (int a = 0; a < s; ++a) mean += u[a];
        mean /= s;
        double var = 0;
        for (int a = 0; a < s; ++a) var += (u[a] - mean) * (u[a] - mean);
        const T rs = T(1.0 / std::sqrt(var / s + 1e-5));
        std::fill(m.begin(), m.end(), T(1));
        for (int d = 0; d < s; ++d) {
          const T y =
              T(w.ln_weight.data[l * s + d]) * T(u[d] - mean) * rs + T(w.ln_bias.data[l * s + d]);
          // Only the window's knots have a share: the other terms of the sum are exact zeros.
          T basis[kLevWindow];
          const int q0 = lev_basis_window<T>(T(1) / (T(1) + std::exp(-y)), kn, basis);
          const int n = std::min(kLevWindow, kn);
          const float* S = w.spline.data + ((int64_t(l) * s + d) * kn + q0) * r;
          T* p = phi.data();
          std::fill(p, p + r, T(0));
          for (int j = 0; j < n; ++j) {
            const T bj = basis[j];
#pragma omp simd
            for (int c = 0; c < r; ++c) p[c] += bj * T(S[int64_t(j) * r + c]);
          }
          for (int c = 0; c < r; ++c) m[c] *= p[c];
        }
        // Vectorized across the row (GCC's -O2 would not): the order of each sum is kept.
        const float* O = w.out_proj.data + int64_t(l) * r * D;
        for (int c = 0; c < r; ++c) {
          const T mc = m[c];
#pragma omp simd
          for (int64_t e = 0; e < D; ++e) oi[e] += mc * T(O[c * D + e]);
        }
      }
      if constexpr (!kFloat)
        for (int64_t e = 0; e < D; ++e) out.data[i * D + e] = float(oi[e]);
    }
  }
}

}  // namespace

void lev_forward(const ExecCtx&, Tensor out, const int32_t* ids, const LevWeights& w) {
  lev_rows<float>(out, ids, w);
}

void lev_forward_f64(Tensor out, const int32_t* ids, const LevWeights& w) {
  lev_rows<double>(out, ids, w);
}

}  // namespace cemlm
