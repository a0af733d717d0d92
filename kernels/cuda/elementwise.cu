// CUDA element-wise ops (elementwise.h) and the row gather; grid-stride loops, one element per
// thread per step, the same float expressions as the CPU oracle (kernels/cpu/elementwise.cc).
#include "cemlm/kernels/cuda/ops.h"
#include "common.cuh"

namespace cemlm::cuda {
namespace {

__device__ __forceinline__ float silu(float z) { return z / (1.0f + expf(-z)); }

#define CEMLM_GRID_STRIDE(i, n)                                             \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); \
       i += int64_t(gridDim.x) * blockDim.x)

__global__ void silu_kernel(float* out, const float* a, int64_t n) {
  CEMLM_GRID_STRIDE(i, n) out[i] = silu(a[i]);
}

__global__ void swiglu_kernel(float* out, const float* gate, const float* up, int64_t n) {
  CEMLM_GRID_STRIDE(i, n) out[i] = silu(gate[i]) * up[i];
}

__global__ void mul_kernel(float* out, const float* a, const float* b, int64_t n) {
  CEMLM_GRID_STRIDE(i, n) out[i] = a[i] * b[i];
}

__global__ void axpy_rows_kernel(float* x, const float* u, const float* eta, int64_t n, int64_t D) {
  CEMLM_GRID_STRIDE(i, n) x[i] += eta[i / D] * u[i];
}

// qd[i,h,e] = d[h,e] · y[i,e]
__global__ void diag_scale_kernel(float* qd, const float* y, const float* d, int64_t n, int64_t H,
                                  int64_t D) {
  CEMLM_GRID_STRIDE(t, n) {
    const int64_t e = t % D, h = (t / D) % H, i = t / (D * H);
    qd[t] = d[h * D + e] * y[i * D + e];
  }
}

// u[i,e] += Σ_h d[h,e] · oc[i,h,e], heads in order as on the CPU.
__global__ void diag_gather_kernel(float* u, const float* oc, const float* d, int64_t n, int64_t H,
                                   int64_t D) {
  CEMLM_GRID_STRIDE(t, n) {
    const int64_t e = t % D, i = t / D;
    float acc = u[t];
    for (int64_t h = 0; h < H; ++h) acc += d[h * D + e] * oc[(i * H + h) * D + e];
    u[t] = acc;
  }
}

__global__ void gather_rows_kernel(float* out, const float* src, const int32_t* rows, int64_t n,
                                   int64_t D, int64_t R) {
  CEMLM_GRID_STRIDE(t, n) {
    const int64_t m = t / D, r = rows[m];
    if (r < 0 || r >= R) __trap();
    out[t] = src[r * D + t % D];
  }
}

#undef CEMLM_GRID_STRIDE

template <typename Kernel, typename... Args>
void launch(const ExecCtx& ctx, int64_t n, Kernel k, Args... args) {
  if (n == 0) return;
  k<<<detail::grid_for(n), detail::kThreads, 0, detail::stream_of(ctx)>>>(args..., n);
  CEMLM_CUDA_LAUNCH_CHECK();
}

}  // namespace

void silu_forward(const ExecCtx& ctx, Tensor out, const Tensor& a) {
  const int64_t n = a.numel();
  detail::require_device(a, n);
  detail::require_device(out, n);
  launch(ctx, n, silu_kernel, out.data, static_cast<const float*>(a.data));
}

void swiglu_forward(const ExecCtx& ctx, Tensor out, const Tensor& gate, const Tensor& up) {
  const int64_t n = gate.numel();
  detail::require_device(gate, n);
  detail::require_device(up, n);
  detail::require_device(out, n);
  launch(ctx, n, swiglu_kernel, out.data, static_cast<const float*>(gate.data),
         static_cast<const float*>(up.data));
}

void mul_forward(const ExecCtx& ctx, Tensor out, const Tensor& a, const Tensor& b) {
  const int64_t n = a.numel();
  detail::require_device(a, n);
  detail::require_device(b, n);
  detail::require_device(out, n);
  launch(ctx, n, mul_kernel, out.data, static_cast<const float*>(a.data),
         static_cast<const float*>(b.data));
}

void axpy_rows_forward(const ExecCtx& ctx, Tensor x, const Tensor& u, const float* eta) {
  const int64_t N = u.dim(0), D = u.dim(-1);
  detail::require_device(u, N * D);
  CEMLM_CHECK(!x.empty() && x.device == Device::kCuda && x.numel() >= N * D);
  CEMLM_CHECK(N == 0 || eta != nullptr);
  if (N * D == 0) return;
  axpy_rows_kernel<<<detail::grid_for(N * D), detail::kThreads, 0, detail::stream_of(ctx)>>>(
      x.data, u.data, eta, N * D, D);
  CEMLM_CUDA_LAUNCH_CHECK();
}

void diag_scale_forward(const ExecCtx& ctx, Tensor qd, const Tensor& y, const Tensor& d) {
  const int64_t N = y.dim(0), D = y.dim(-1), H = d.numel() / D;
  CEMLM_CHECK(H >= 1 && d.numel() == H * D);
  detail::require_device(y, N * D);
  detail::require_device(d, H * D);
  detail::require_device(qd, N * H * D);
  if (N == 0) return;
  diag_scale_kernel<<<detail::grid_for(N * H * D), detail::kThreads, 0, detail::stream_of(ctx)>>>(
      qd.data, y.data, d.data, N * H * D, H, D);
  CEMLM_CUDA_LAUNCH_CHECK();
}

void diag_gather_forward(const ExecCtx& ctx, Tensor u, const Tensor& oc, const Tensor& d) {
  const int64_t N = u.dim(0), D = u.dim(-1), H = d.numel() / D;
  CEMLM_CHECK(H >= 1 && d.numel() == H * D);
  detail::require_device(u, N * D);
  detail::require_device(d, H * D);
  detail::require_device(oc, N * H * D);
  if (N == 0) return;
  diag_gather_kernel<<<detail::grid_for(N * D), detail::kThreads, 0, detail::stream_of(ctx)>>>(
      u.data, oc.data, d.data, N * D, H, D);
  CEMLM_CUDA_LAUNCH_CHECK();
}

void gather_rows(const ExecCtx& ctx, Tensor out, const Tensor& src, const int32_t* rows) {
  const int64_t M = out.dim(0), D = out.dim(-1), R = src.dim(0);
  CEMLM_CHECK(src.dim(-1) == D);
  detail::require_device(out, M * D);
  detail::require_device(src, R * D);
  if (M == 0) return;
  CEMLM_CHECK(rows != nullptr);
  gather_rows_kernel<<<detail::grid_for(M * D), detail::kThreads, 0, detail::stream_of(ctx)>>>(
      out.data, src.data, rows, M * D, D, R);
  CEMLM_CUDA_LAUNCH_CHECK();
}

}  // namespace cemlm::cuda
