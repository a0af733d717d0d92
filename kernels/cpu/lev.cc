// CPU LEV generator: one token per work item; small per-token buffers live on the stack-sized
// vectors of each thread (sizes are the LEV hyper-parameters, independent of N).
#include "cemlm/kernels/lev.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
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

// The generator up to the output projection, in T arithmetic: for a token, every head's rank-r
// product M_ℓ (MODEL.md §6.2), one thread's buffers reused across tokens.
template <typename T>
class LevProducts {
 public:
  explicit LevProducts(const LevWeights& w)
      : w_(w),
        k_(int(w.codebooks.dim(0))),
        b_(int(w.codebooks.dim(1))),
        s_(int(w.codebooks.dim(2))),
        nh_(int(w.seed_proj.dim(0))),
        kn_(int(w.spline.dim(2))),
        r_(int(w.spline.dim(3))),
        seed_t_(size_t(nh_) * s_ * s_),
        z_(size_t(s_)),
        u_(size_t(s_)),
        phi_(size_t(r_)),
        dig_(size_t(k_)) {
    // W_seed transposed, so that u = W_seed z vectorizes across u with each u_a still summed in
    // the order of b.
    for (int l = 0; l < nh_; ++l)
      for (int a = 0; a < s_; ++a)
        for (int e = 0; e < s_; ++e)
          seed_t_[(size_t(l) * s_ + e) * s_ + a] =
              T(w.seed_proj.data[(int64_t(l) * s_ + a) * s_ + e]);
  }

  // m[ℓ·r + c] = M_ℓ[c] of `token`.
  void operator()(int32_t token, T* m) {
    const int s = s_, r = r_, kn = kn_;
    lev_digits(token, k_, b_, dig_.data());
    std::fill(z_.begin(), z_.end(), T(0));
    for (int j = 0; j < k_; ++j) {
      const float* row = w_.codebooks.data + (int64_t(j) * b_ + dig_[size_t(j)]) * s;
      for (int e = 0; e < s; ++e) z_[size_t(e)] += T(row[e]);
    }
    for (int l = 0; l < nh_; ++l) {
      const T* Wt = seed_t_.data() + size_t(l) * s * s;
      T* ul = u_.data();
      std::fill(ul, ul + s, T(0));
      for (int e = 0; e < s; ++e) {
        const T ze = z_[size_t(e)];
#pragma omp simd
        for (int a = 0; a < s; ++a) ul[a] += Wt[e * s + a] * ze;
      }
      double mean = 0;
      for (int a = 0; a < s; ++a) mean += ul[a];
      mean /= s;
      double var = 0;
      for (int a = 0; a < s; ++a) var += (ul[a] - mean) * (ul[a] - mean);
      const T rs = T(1.0 / std::sqrt(var / s + 1e-5));
      T* ml = m + int64_t(l) * r;
      std::fill(ml, ml + r, T(1));
      for (int d = 0; d < s; ++d) {
        const T y =
            T(w_.ln_weight.data[l * s + d]) * T(ul[d] - mean) * rs + T(w_.ln_bias.data[l * s + d]);
        // Only the window's knots have a share: the other terms of the sum are exact zeros.
        T basis[kLevWindow];
        const int q0 = lev_basis_window<T>(T(1) / (T(1) + std::exp(-y)), kn, basis);
        const int n = std::min(kLevWindow, kn);
        const float* S = w_.spline.data + ((int64_t(l) * s + d) * kn + q0) * r;
        T* p = phi_.data();
        std::fill(p, p + r, T(0));
        for (int j = 0; j < n; ++j) {
          const T bj = basis[j];
#pragma omp simd
          for (int c = 0; c < r; ++c) p[c] += bj * T(S[int64_t(j) * r + c]);
        }
        for (int c = 0; c < r; ++c) ml[c] *= p[c];
      }
    }
  }

 private:
  const LevWeights& w_;
  const int k_, b_, s_, nh_, kn_, r_;
  std::vector<T> seed_t_, z_, u_, phi_;
  std::vector<int> dig_;
};

}  // namespace

void lev_forward(const ExecCtx&, Tensor out, const int32_t* ids, const LevWeights& w) {
  const int nh = int(w.seed_proj.dim(0)), r = int(w.spline.dim(3));
  const int64_t N = out.dim(0), D = out.dim(1);
#pragma omp parallel
  {
    LevProducts<float> products(w);
    std::vector<float> m(size_t(nh) * r);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      products(ids[i], m.data());
      // Head by head, each sum in the order of (ℓ, c): the trainer's backward follows it.
      // Vectorized across the row (GCC's -O2 would not).
      float* oi = out.data + i * D;
      std::fill(oi, oi + D, 0.0f);
      for (int64_t lc = 0; lc < int64_t(nh) * r; ++lc) {
        const float mc = m[size_t(lc)];
        const float* O = w.out_proj.data + lc * D;
#pragma omp simd
        for (int64_t e = 0; e < D; ++e) oi[e] += mc * O[e];
      }
    }
  }
}

void lev_forward_f64(Tensor out, const int32_t* ids, const LevWeights& w) {
  const int64_t K = w.seed_proj.dim(0) * w.spline.dim(3), N = out.dim(0), D = out.dim(1);
  const std::vector<double> out_proj(w.out_proj.data, w.out_proj.data + K * D);  // [K, D]
  // A chunk of tokens' products, then their projection as one dgemm (the per-token loop's D-wide
  // double sums took most of a large table's time), rounded to float once.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(N, (int64_t(1) << 22) / D));
  std::vector<double> m(size_t(chunk * K)), rows(size_t(chunk * D));
  for (int64_t first = 0; first < N; first += chunk) {
    const int64_t n = std::min(chunk, N - first);
#pragma omp parallel
    {
      LevProducts<double> products(w);
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) products(ids[first + i], m.data() + i * K);
    }
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(n), int(D), int(K), 1.0, m.data(),
                int(K), out_proj.data(), int(D), 0.0, rows.data(), int(D));
    for (int64_t i = 0; i < n * D; ++i) out.data[first * D + i] = float(rows[size_t(i)]);
  }
}

}  // namespace cemlm
