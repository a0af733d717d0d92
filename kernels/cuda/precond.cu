// CUDA preconditioner (precond.h): the softplus diagonal as one element-wise kernel, the two
// rank-r corrections as four thin fp32 cuBLAS products, like the CPU oracle's sgemms.
#include "cemlm/kernels/cuda/linear.h"
#include "cemlm/kernels/cuda/ops.h"
#include "common.cuh"

namespace cemlm::cuda {
namespace {

__global__ void softplus_scale_kernel(float* out, const float* u, const float* p, int64_t n,
                                      int64_t D) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < n;
       t += int64_t(gridDim.x) * blockDim.x) {
    const float z = p[t % D];
    const float sp = z > 20.0f ? z : log1pf(expf(z));
    out[t] = sp * u[t];
  }
}

}  // namespace

void precond_forward(const ExecCtx& ctx, Tensor out, const Tensor& u, const Tensor& p,
                     const Tensor& Pu, const Tensor& Pv) {
  const int N = int(u.dim(0)), D = int(u.dim(-1)), r = int(Pu.dim(1));
  detail::require_device(u, int64_t(N) * D);
  detail::require_device(out, int64_t(N) * D);
  detail::require_device(p, D);
  detail::require_device(Pu, int64_t(D) * r);
  detail::require_device(Pv, int64_t(D) * r);
  CEMLM_CHECK(out.data != u.data && ctx.scratch_floats >= int64_t(2) * N * r);
  if (N == 0) return;
  const int64_t n = int64_t(N) * D;
  softplus_scale_kernel<<<detail::grid_for(n), detail::kThreads, 0, detail::stream_of(ctx)>>>(
      out.data, u.data, p.data, n, D);
  CEMLM_CUDA_LAUNCH_CHECK();
  float* a = ctx.scratch;                   // [N,r] = u · P_v
  float* b = ctx.scratch + int64_t(N) * r;  // [N,r] = u · P_u
  gemm(ctx, false, false, N, r, D, 1.0f, u.data, D, Pv.data, r, 0.0f, a, r);
  gemm(ctx, false, false, N, r, D, 1.0f, u.data, D, Pu.data, r, 0.0f, b, r);
  gemm(ctx, false, true, N, D, r, 1.0f, a, r, Pu.data, r, 1.0f, out.data, D);  // += P_u (P_vᵀ u)
  gemm(ctx, false, true, N, D, r, 1.0f, b, r, Pv.data, r, 1.0f, out.data, D);  // += P_v (P_uᵀ u)
}

}  // namespace cemlm::cuda
