// CUDA RMSNorm: one block per row; the mean of squares is accumulated in double like the CPU
// oracle (kernels/cpu/rmsnorm.cc) so both round the same way.
#include "cemlm/kernels/cuda/ops.h"
#include "common.cuh"

namespace cemlm::cuda {
namespace {

__global__ void rmsnorm_kernel(float* out, float* rstd, const float* x, const float* gain,
                               int64_t D, float eps) {
  __shared__ double red[32];
  const int64_t i = blockIdx.x;
  const float* xi = x + i * D;
  double ss = 0;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) ss += double(xi[d]) * xi[d];
  ss = detail::block_sum(ss, red);
  const float r = float(1.0 / sqrt(ss / double(D) + eps));
  if (rstd && threadIdx.x == 0) rstd[i] = r;
  float* oi = out + i * D;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) oi[d] = gain[d] * xi[d] * r;
}

}  // namespace

void rmsnorm_forward(const ExecCtx& ctx, Tensor out, Tensor rstd, const Tensor& x,
                     const Tensor& gain, float eps) {
  const int64_t N = x.dim(0), D = x.dim(-1);
  detail::require_device(x, N * D);
  detail::require_device(out, N * D);
  detail::require_device(gain, D);
  detail::require_device(rstd);
  CEMLM_CHECK(rstd.empty() || rstd.numel() >= N);
  if (N == 0) return;
  CEMLM_CHECK(N <= 0x7fffffff);
  rmsnorm_kernel<<<unsigned(N), detail::kThreads, 0, detail::stream_of(ctx)>>>(
      out.data, rstd.data, x.data, gain.data, D, eps);
  CEMLM_CUDA_LAUNCH_CHECK();
}

}  // namespace cemlm::cuda
