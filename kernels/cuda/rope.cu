// CUDA RoPE: one thread per (row, head, pair), reading the same double-computed cos/sin table as
// the CPU oracle (kernels/cpu/rope.cc). Positions are checked on the device: a bad one traps.
#include "cemlm/kernels/cuda/ops.h"
#include "common.cuh"

namespace cemlm::cuda {
namespace {

__global__ void rope_kernel(float* out, const float* x, const int32_t* pos, const float* table,
                            int64_t N, int64_t W, int64_t dh, int64_t P, float sign) {
  const int64_t half = dh / 2, pairs_per_row = W / 2, total = N * pairs_per_row;
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < total;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = t / pairs_per_row, r = t % pairs_per_row, h = r / half, m = r % half;
    const int32_t p = pos[i];
    if (p < 0 || p >= P) __trap();  // CEMLM_CHECK's device counterpart
    const float c = table[p * dh + m], s = sign * table[p * dh + half + m];
    const float* xi = x + i * W + h * dh;
    float* oi = out + i * W + h * dh;
    const float a = xi[m], b = xi[m + half];
    oi[m] = a * c - b * s;
    oi[m + half] = b * c + a * s;
  }
}

}  // namespace

void rope_forward(const ExecCtx& ctx, Tensor out, const Tensor& x, const int32_t* pos,
                  const Tensor& table, bool inverse) {
  const int64_t N = x.dim(0), W = x.dim(-1), P = table.dim(0), dh = table.dim(1);
  CEMLM_CHECK(dh % 2 == 0 && W % dh == 0);
  detail::require_device(x, N * W);
  detail::require_device(out, N * W);
  detail::require_device(table, P * dh);
  if (N == 0) return;
  CEMLM_CHECK(pos != nullptr);
  const int64_t total = N * (W / 2);
  rope_kernel<<<detail::grid_for(total), detail::kThreads, 0, detail::stream_of(ctx)>>>(
      out.data, x.data, pos, table.data, N, W, dh, P, inverse ? -1.0f : 1.0f);
  CEMLM_CUDA_LAUNCH_CHECK();
}

}  // namespace cemlm::cuda
