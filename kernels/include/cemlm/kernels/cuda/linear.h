// CUDA linear maps through cuBLAS (linear.h's signatures, in cemlm::cuda), plus the serving path:
// weights held as bf16, activations rounded to bf16, products accumulated and written in fp32.
// Row-major [out, in] weights map onto column-major cuBLAS by swapping the operands.
// CUDA: kernels/cuda/linear.cu; tests: tests/gpu/ops_test.cc.
#pragma once
#include <cstdint>

#include "cemlm/kernels/tensor.h"

namespace cemlm::cuda {

// ctx.cublas must be a cublasHandle_t already bound to ctx.cuda_stream (cublasSetStream), so
// that ops never rebind it: rebinding resets the handle's workspace, which graph capture needs.

// fp32 products (CUBLAS_COMPUTE_32F, no TF32): the parity path.
void linear_forward(const ExecCtx&, Tensor y, const Tensor& x, const Tensor& W, float beta = 0.0f);
void linear_t_forward(const ExecCtx&, Tensor y, const Tensor& x, const Tensor& W,
                      float beta = 0.0f);
// Row-major C[M,N] = beta·C + alpha·op(A)·op(B) in fp32, every pointer on the device.
void gemm(const ExecCtx&, bool trans_a, bool trans_b, int M, int N, int K, float alpha,
          const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc);

// A weight matrix [rows = out, cols = in] on the device, as fp32 or as bf16 (raw bits; exactly
// one of the two pointers is set).
struct DeviceWeight {
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
  int64_t rows = 0, cols = 0;
};
// y[N,out] = beta·y + x · Wᵀ and y[N,in] = beta·y + x · W. With bf16 weights x is rounded to bf16
// in ctx.scratch (linear_scratch_floats(N, x width) floats) and accumulated in fp32.
void linear_forward(const ExecCtx&, Tensor y, const Tensor& x, const DeviceWeight& W,
                    float beta = 0.0f);
void linear_t_forward(const ExecCtx&, Tensor y, const Tensor& x, const DeviceWeight& W,
                      float beta = 0.0f);
inline int64_t linear_scratch_floats(int64_t n_rows, int64_t width) {
  return (n_rows * width + 1) / 2;
}

// out[n] = bf16(in[n]) with round-to-nearest-even (weights at load, activations per product).
void to_bf16(const ExecCtx&, uint16_t* out, const float* in, int64_t n);

}  // namespace cemlm::cuda
