// CPU preconditioner: the two rank-r corrections are four thin sgemms.
#include "cemlm/kernels/precond.h"

#include <algorithm>
#include <cmath>

#include "cemlm/kernels/linear.h"

namespace cemlm {

void precond_forward(const ExecCtx& ctx, Tensor out, const Tensor& u, const Tensor& p,
                     const Tensor& Pu, const Tensor& Pv) {
  const int N = int(u.dim(0)), D = int(u.dim(-1)), r = int(Pu.dim(1));
  CEMLM_CHECK(out.data != u.data && ctx.scratch_floats >= int64_t(2) * N * r);
  constexpr int kTile = 256;  // softplus once per feature and tile, rows read in order
  for (int d0 = 0; d0 < D; d0 += kTile) {
    const int n = std::min(kTile, D - d0);
    float sp[kTile];
    for (int d = 0; d < n; ++d) {
      const float z = p.data[d0 + d];
      sp[d] = z > 20.0f ? z : std::log1p(std::exp(z));
    }
    for (int64_t i = 0; i < int64_t(N); ++i)
      for (int d = 0; d < n; ++d) out.data[i * D + d0 + d] = sp[d] * u.data[i * D + d0 + d];
  }
  float* a = ctx.scratch;          // [N,r] = u · P_v
  float* b = ctx.scratch + N * r;  // [N,r] = u · P_u
  gemm(false, false, N, r, D, 1.0f, u.data, D, Pv.data, r, 0.0f, a, r);
  gemm(false, false, N, r, D, 1.0f, u.data, D, Pu.data, r, 0.0f, b, r);
  gemm(false, true, N, D, r, 1.0f, a, r, Pu.data, r, 1.0f, out.data, D);  // += P_u (P_vᵀ u)
  gemm(false, true, N, D, r, 1.0f, b, r, Pv.data, r, 1.0f, out.data, D);  // += P_v (P_uᵀ u)
}

}  // namespace cemlm
