// CUDA linear maps (see cuda/linear.h). A row-major product C = op(A)·op(B) is the column-major
// product Cᵀ = op(B)ᵀ·op(A)ᵀ, so every call passes B first; no data is transposed.
#include <cuda_bf16.h>

#include "cemlm/kernels/cuda/linear.h"
#include "common.cuh"

namespace cemlm::cuda {
namespace {

cublasHandle_t handle_of(const ExecCtx& ctx) {
  CEMLM_CHECK(ctx.cublas != nullptr);
  auto h = static_cast<cublasHandle_t>(ctx.cublas);
  cudaStream_t bound = nullptr;
  CEMLM_CUBLAS_CHECK(cublasGetStream(h, &bound));
  CEMLM_CHECK(bound == detail::stream_of(ctx));  // see linear.h: the owner binds it once
  return h;
}

cublasOperation_t op(bool t) { return t ? CUBLAS_OP_T : CUBLAS_OP_N; }

// Nearest-even, finite values saturating at ±bf16's largest (as the host's f32_to_bf16): a
// finite weight within 0.4% of FLT_MAX would round to inf.
__global__ void to_bf16_kernel(__nv_bfloat16* out, const float* in, int64_t n) {
  constexpr float kMax = 3.38953139e38f;  // bf16 0x7F7F
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float x = in[i];
    out[i] = __float2bfloat16_rn(isfinite(x) ? fminf(fmaxf(x, -kMax), kMax) : x);
  }
}

// Row-major C[M,N] = beta·C + op(A)·op(B) with A, B bf16 and C fp32, fp32 accumulation.
void gemm_bf16(const ExecCtx& ctx, bool ta, bool tb, int M, int N, int K, const void* A, int lda,
               const void* B, int ldb, float beta, float* C, int ldc) {
  const float alpha = 1.0f;
  CEMLM_CUBLAS_CHECK(cublasGemmEx(handle_of(ctx), op(tb), op(ta), N, M, K, &alpha, B, CUDA_R_16BF,
                                  ldb, A, CUDA_R_16BF, lda, &beta, C, CUDA_R_32F, ldc,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void check_linear(const Tensor& y, const Tensor& x, int64_t n_rows, int64_t in, int64_t out) {
  detail::require_device(x, n_rows * in);
  detail::require_device(y, n_rows * out);
  CEMLM_CHECK(x.dim(0) == n_rows && y.dim(0) == n_rows);
  CEMLM_CHECK(n_rows <= 0x7fffffff && in <= 0x7fffffff && out <= 0x7fffffff);
}

// x rounded to bf16 into ctx.scratch.
const void* bf16_input(const ExecCtx& ctx, const Tensor& x) {
  const int64_t n = x.numel();
  CEMLM_CHECK(ctx.scratch != nullptr &&
              ctx.scratch_floats >= linear_scratch_floats(x.dim(0), x.dim(-1)));
  auto* xb = reinterpret_cast<uint16_t*>(ctx.scratch);
  to_bf16(ctx, xb, x.data, n);
  return xb;
}

}  // namespace

void gemm(const ExecCtx& ctx, bool trans_a, bool trans_b, int M, int N, int K, float alpha,
          const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  if (M == 0 || N == 0) return;
  CEMLM_CUBLAS_CHECK(cublasGemmEx(handle_of(ctx), op(trans_b), op(trans_a), N, M, K, &alpha, B,
                                  CUDA_R_32F, ldb, A, CUDA_R_32F, lda, &beta, C, CUDA_R_32F, ldc,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void linear_forward(const ExecCtx& ctx, Tensor y, const Tensor& x, const Tensor& W, float beta) {
  const int64_t N = x.dim(0), in = x.dim(-1), out = W.dim(0);
  CEMLM_CHECK(W.ndim == 2 && W.dim(1) == in);
  detail::require_device(W, out * in);
  check_linear(y, x, N, in, out);
  gemm(ctx, false, true, int(N), int(out), int(in), 1.0f, x.data, int(in), W.data, int(in), beta,
       y.data, int(out));
}

void linear_t_forward(const ExecCtx& ctx, Tensor y, const Tensor& x, const Tensor& W, float beta) {
  const int64_t N = x.dim(0), out = W.dim(0), in = W.dim(1);
  CEMLM_CHECK(W.ndim == 2);
  detail::require_device(W, out * in);
  check_linear(y, x, N, out, in);
  gemm(ctx, false, false, int(N), int(in), int(out), 1.0f, x.data, int(out), W.data, int(in), beta,
       y.data, int(in));
}

void linear_forward(const ExecCtx& ctx, Tensor y, const Tensor& x, const DeviceWeight& W,
                    float beta) {
  CEMLM_CHECK((W.f32 == nullptr) != (W.bf16 == nullptr));
  if (W.f32) {
    linear_forward(ctx, y, x, Tensor(const_cast<float*>(W.f32), {W.rows, W.cols}, Device::kCuda),
                   beta);
    return;
  }
  const int64_t N = x.dim(0), in = W.cols, out = W.rows;
  check_linear(y, x, N, in, out);
  if (N == 0) return;
  gemm_bf16(ctx, false, true, int(N), int(out), int(in), bf16_input(ctx, x), int(in), W.bf16,
            int(in), beta, y.data, int(out));
}

void linear_t_forward(const ExecCtx& ctx, Tensor y, const Tensor& x, const DeviceWeight& W,
                      float beta) {
  CEMLM_CHECK((W.f32 == nullptr) != (W.bf16 == nullptr));
  if (W.f32) {
    linear_t_forward(ctx, y, x, Tensor(const_cast<float*>(W.f32), {W.rows, W.cols}, Device::kCuda),
                     beta);
    return;
  }
  const int64_t N = x.dim(0), out = W.rows, in = W.cols;
  check_linear(y, x, N, out, in);
  if (N == 0) return;
  gemm_bf16(ctx, false, false, int(N), int(in), int(out), bf16_input(ctx, x), int(out), W.bf16,
            int(in), beta, y.data, int(in));
}

void to_bf16(const ExecCtx& ctx, uint16_t* out, const float* in, int64_t n) {
  if (n == 0) return;
  CEMLM_CHECK(out != nullptr && in != nullptr);
  to_bf16_kernel<<<detail::grid_for(n), detail::kThreads, 0, detail::stream_of(ctx)>>>(
      reinterpret_cast<__nv_bfloat16*>(out), in, n);
  CEMLM_CUDA_LAUNCH_CHECK();
}

}  // namespace cemlm::cuda
