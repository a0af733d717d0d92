// CPU element-wise ops (see elementwise.h).
#include "cemlm/kernels/elementwise.h"

#include <cmath>

namespace cemlm {
namespace {
inline float silu(float z) { return z / (1.0f + std::exp(-z)); }
}  // namespace

void silu_forward(const ExecCtx&, Tensor out, const Tensor& a) {
  const int64_t n = a.numel();
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) out.data[i] = silu(a.data[i]);
}

void swiglu_forward(const ExecCtx&, Tensor out, const Tensor& gate, const Tensor& up) {
  const int64_t n = gate.numel();
  CEMLM_CHECK(up.numel() == n && out.numel() == n);
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) out.data[i] = silu(gate.data[i]) * up.data[i];
}

void mul_forward(const ExecCtx&, Tensor out, const Tensor& a, const Tensor& b) {
  const int64_t n = a.numel();
  CEMLM_CHECK(b.numel() == n && out.numel() == n);
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) out.data[i] = a.data[i] * b.data[i];
}

void axpy_rows_forward(const ExecCtx&, Tensor x, const Tensor& u, const float* eta) {
  const int64_t N = u.dim(0), D = u.dim(-1);
#pragma omp parallel for schedule(static) if (N * D > 65536)
  for (int64_t i = 0; i < N; ++i)
    for (int64_t d = 0; d < D; ++d) x.data[i * D + d] += eta[i] * u.data[i * D + d];
}

void diag_scale_forward(const ExecCtx&, Tensor qd, const Tensor& y, const Tensor& d) {
  const int64_t N = y.dim(0), D = y.dim(-1), H = d.numel() / D;
  for (int64_t i = 0; i < N; ++i)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < D; ++e) qd.data[(i * H + h) * D + e] = d.data[h * D + e] * y.data[i * D + e];
}

void diag_gather_forward(const ExecCtx&, Tensor u, const Tensor& oc, const Tensor& d) {
  const int64_t N = u.dim(0), D = u.dim(-1), H = d.numel() / D;
  for (int64_t i = 0; i < N; ++i)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < D; ++e) u.data[i * D + e] += d.data[h * D + e] * oc.data[(i * H + h) * D + e];
}

}  // namespace cemlm
