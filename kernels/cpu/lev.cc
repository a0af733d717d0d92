// CPU LEV generator: one token per work item; small per-token buffers live on the stack-sized
// vectors of each thread (sizes are the LEV hyper-parameters, independent of N).
#include "cemlm/kernels/lev.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace cemlm {
namespace {

inline float b2(float x) {
  const float a = std::fabs(x);
  if (a < 0.5f) return 0.75f - x * x;
  if (a < 1.5f) return 0.5f * (1.5f - a) * (1.5f - a);
  return 0.0f;
}

}  // namespace

void lev_digits(int64_t token, int k, int b, int* digits) {
  for (int j = k - 1; j >= 0; --j) {
    digits[j] = int(token % b);
    token /= b;
  }
}

void lev_basis(float zeta, int knots, float* w) {
  double sum = 0;
  for (int q = 0; q < knots; ++q) {
    w[q] = b2((zeta - float(q) / float(knots - 1)) * float(knots - 1));
    sum += w[q];
  }
  const float inv = float(1.0 / sum);
  for (int q = 0; q < knots; ++q) w[q] *= inv;
}

void lev_forward(const ExecCtx&, Tensor out, const int32_t* ids, const LevWeights& w) {
  const int k = int(w.codebooks.dim(0)), b = int(w.codebooks.dim(1)), s = int(w.codebooks.dim(2));
  const int nh = int(w.seed_proj.dim(0)), kn = int(w.spline.dim(2)), r = int(w.spline.dim(3));
  const int64_t N = out.dim(0), D = out.dim(1);
#pragma omp parallel
  {
    std::vector<float> z(s), u(s), basis(kn), m(r);
    std::vector<int> dig(k);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      lev_digits(ids[i], k, b, dig.data());
      std::fill(z.begin(), z.end(), 0.0f);
      for (int j = 0; j < k; ++j) {
        const float* row = w.codebooks.data + (int64_t(j) * b + dig[j]) * s;
        for (int e = 0; e < s; ++e) z[e] += row[e];
      }
      float* oi = out.data + i * D;
      std::memset(oi, 0, sizeof(float) * D);
      for (int l = 0; l < nh; ++l) {
        const float* W = w.seed_proj.data + int64_t(l) * s * s;
        double mean = 0;
        for (int a = 0; a < s; ++a) {
          float acc = 0;
          for (int e = 0; e < s; ++e) acc += W[a * s + e] * z[e];
          u[a] = acc;
          mean += acc;
        }
        mean /= s;
        double var = 0;
        for (int a = 0; a < s; ++a) var += (u[a] - mean) * (u[a] - mean);
        const float rs = float(1.0 / std::sqrt(var / s + 1e-5));
        std::fill(m.begin(), m.end(), 1.0f);
        for (int d = 0; d < s; ++d) {
          const float y = w.ln_weight.data[l * s + d] * float(u[d] - mean) * rs + w.ln_bias.data[l * s + d];
          lev_basis(1.0f / (1.0f + std::exp(-y)), kn, basis.data());
          const float* S = w.spline.data + (int64_t(l) * s + d) * kn * r;
          for (int c = 0; c < r; ++c) {
            float phi = 0;
            for (int q = 0; q < kn; ++q) phi += basis[q] * S[q * r + c];
            m[c] *= phi;
          }
        }
        const float* O = w.out_proj.data + int64_t(l) * r * D;
        for (int c = 0; c < r; ++c)
          for (int64_t e = 0; e < D; ++e) oi[e] += m[c] * O[c * D + e];
      }
    }
  }
}

}  // namespace cemlm
