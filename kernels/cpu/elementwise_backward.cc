// CPU element-wise backward ops (see elementwise_grad.h). The diagonal's parameter gradient is a
// column sum over rows, kept in double and split over (head, feature) so threads never share it.
#include <cmath>

#include "cemlm/kernels/elementwise.h"
#include "cemlm/kernels/elementwise_grad.h"
#include "cemlm/kernels/parallel.h"

namespace cemlm {
namespace {

inline float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }
// d/dz [z σ(z)] = σ(z) (1 + z (1 − σ(z)))
inline float silu_slope(float z) {
  const float s = sigmoid(z);
  return s * (1.0f + z * (1.0f - s));
}

// dd[h,e] += Σ_i a[i,h,e] · b[i,e]   (a: [N,H,D], b: [N,D])
void diag_param_grad(Tensor dd, const Tensor& a, const Tensor& b) {
  const int64_t N = b.dim(0), D = b.dim(-1), HD = dd.numel();
  parallel_for(HD, N * HD > 65536, [&](int64_t he) {
    const int64_t e = he % D;
    double acc = 0;
    for (int64_t i = 0; i < N; ++i) acc += double(a.data[i * HD + he]) * b.data[i * D + e];
    dd.data[he] += float(acc);
  });
}

}  // namespace

void silu_backward(const ExecCtx&, Tensor da, const Tensor& dout, const Tensor& a) {
  const int64_t n = a.numel();
  CEMLM_CHECK(dout.numel() == n && da.numel() == n);
  parallel_for(n, n > 65536, [&](int64_t i) { da.data[i] = dout.data[i] * silu_slope(a.data[i]); });
}

void swiglu_backward(const ExecCtx&, Tensor dgate, Tensor dup, const Tensor& dout,
                     const Tensor& gate, const Tensor& up) {
  const int64_t n = gate.numel();
  CEMLM_CHECK(up.numel() == n && dout.numel() == n && dgate.numel() == n && dup.numel() == n);
  parallel_for(n, n > 65536, [&](int64_t i) {
    const float g = gate.data[i], o = dout.data[i];
    dgate.data[i] = o * up.data[i] * silu_slope(g);
    dup.data[i] = o * g * sigmoid(g);
  });
}

void mul_backward(const ExecCtx&, Tensor da, const Tensor& dout, const Tensor& b) {
  const int64_t n = dout.numel();
  CEMLM_CHECK(b.numel() == n && da.numel() == n);
  parallel_for(n, n > 65536, [&](int64_t i) { da.data[i] += dout.data[i] * b.data[i]; });
}

void diag_scale_backward(const ExecCtx& ctx, Tensor dy, Tensor dd, const Tensor& dqd,
                         const Tensor& y, const Tensor& d) {
  diag_gather_forward(ctx, dy, dqd, d);
  diag_param_grad(dd, dqd, y);
}

void diag_gather_backward(const ExecCtx& ctx, Tensor doc, Tensor dd, const Tensor& du,
                          const Tensor& oc, const Tensor& d) {
  diag_scale_forward(ctx, doc, du, d);
  diag_param_grad(dd, oc, du);
}

}  // namespace cemlm
