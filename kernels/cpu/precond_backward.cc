// CPU preconditioner backward: the input gradient is the forward op applied to dout (P is
// symmetric); the low-rank factors' gradients are four thin products and four rank-r updates.
#include <cmath>
#include <vector>

#include "cemlm/kernels/linear.h"
#include "cemlm/kernels/precond.h"
#include "cemlm/kernels/precond_grad.h"

namespace cemlm {

void precond_backward(const ExecCtx& ctx, Tensor du, Tensor dp, Tensor dPu, Tensor dPv,
                      const Tensor& dout, const Tensor& u, const Tensor& p, const Tensor& Pu,
                      const Tensor& Pv) {
  const int N = int(u.dim(0)), D = int(u.dim(-1)), r = int(Pu.dim(1));
  CEMLM_CHECK(ctx.scratch_floats >= int64_t(4) * N * r && dout.numel() == u.numel());
  precond_forward(ctx, du, dout, p, Pu, Pv);
  // softplus'(p) = σ(p)
  std::vector<double> acc(D, 0.0);
  for (int64_t i = 0; i < N; ++i)
    for (int d = 0; d < D; ++d) acc[d] += double(dout.data[i * D + d]) * u.data[i * D + d];
  for (int d = 0; d < D; ++d) dp.data[d] += float(acc[d] / (1.0 + std::exp(-double(p.data[d]))));
  float* uPv = ctx.scratch;
  float* uPu = uPv + int64_t(N) * r;
  float* gPv = uPu + int64_t(N) * r;
  float* gPu = gPv + int64_t(N) * r;
  gemm(false, false, N, r, D, 1.0f, u.data, D, Pv.data, r, 0.0f, uPv, r);
  gemm(false, false, N, r, D, 1.0f, u.data, D, Pu.data, r, 0.0f, uPu, r);
  gemm(false, false, N, r, D, 1.0f, dout.data, D, Pv.data, r, 0.0f, gPv, r);
  gemm(false, false, N, r, D, 1.0f, dout.data, D, Pu.data, r, 0.0f, gPu, r);
  // out += (u P_v) P_uᵀ + (u P_u) P_vᵀ
  gemm(true, false, D, r, N, 1.0f, dout.data, D, uPv, r, 1.0f, dPu.data, r);
  gemm(true, false, D, r, N, 1.0f, u.data, D, gPv, r, 1.0f, dPu.data, r);
  gemm(true, false, D, r, N, 1.0f, dout.data, D, uPu, r, 1.0f, dPv.data, r);
  gemm(true, false, D, r, N, 1.0f, u.data, D, gPu, r, 1.0f, dPv.data, r);
}

}  // namespace cemlm
