// CPU RMSNorm: row-parallel; the mean of squares from 16 float lanes summed in double.
#include "cemlm/kernels/rmsnorm.h"

#include <cmath>

#include "cemlm/kernels/parallel.h"
#include "cemlm/kernels/simd.h"

namespace cemlm {

void rmsnorm_forward(const ExecCtx&, Tensor out, Tensor rstd, const Tensor& x, const Tensor& gain,
                     float eps) {
  const int64_t N = x.dim(0), D = x.dim(-1);
  CEMLM_CHECK(gain.numel() == D && out.numel() == x.numel());
  parallel_for(N, N * D > 4096, [&](int64_t i) {
    const float* xi = x.data + i * D;
    float* oi = out.data + i * D;
    const double ss = simd::sum_squares(xi, int(D));
    const float r = float(1.0 / std::sqrt(ss / double(D) + eps));
    if (!rstd.empty()) rstd.data[i] = r;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) oi[d] = gain.data[d] * xi[d] * r;
  });
}

void rmsnorm_backward(const ExecCtx&, Tensor dx, Tensor dgain, const Tensor& dout, const Tensor& x,
                      const Tensor& gain, const Tensor& rstd, bool accumulate_dx) {
  const int64_t N = x.dim(0), D = x.dim(-1);
  // out_d = g_d x_d r  ⇒  dx_d = r (g_d dout_d) − r³/D · x_d Σ_e g_e dout_e x_e
  for (int64_t i = 0; i < N; ++i) {
    const float* xi = x.data + i * D;
    const float* gi = dout.data + i * D;
    const float r = rstd.data[i];
    double dot = 0;
    for (int64_t d = 0; d < D; ++d) dot += double(gain.data[d]) * gi[d] * xi[d];
    const float k = float(dot * r * r * r / double(D));
    if (!dx.empty()) {
      float* di = dx.data + i * D;
      for (int64_t d = 0; d < D; ++d) {
        const float v = r * gain.data[d] * gi[d] - k * xi[d];
        di[d] = accumulate_dx ? di[d] + v : v;
      }
    }
    if (!dgain.empty())
      for (int64_t d = 0; d < D; ++d) dgain.data[d] += gi[d] * xi[d] * r;
  }
}

}  // namespace cemlm
