// Dense linear maps with weights stored [out, in] (MODEL.md §1). Every CPU matmul goes through
// cblas_sgemm. CPU oracle: kernels/cpu/linear.cc; test: tests/kernels/.
#pragma once
#include "cemlm/kernels/tensor.h"

namespace cemlm {

// y[N,out] = beta·y + x[N,in] · Wᵀ          (y = W x per row)
void linear_forward(const ExecCtx&, Tensor y, const Tensor& x, const Tensor& W, float beta = 0.0f);
// y[N,in] = beta·y + x[N,out] · W           (y = Wᵀ x per row: the tied transposes W_Qᵀ, W_upᵀ)
void linear_t_forward(const ExecCtx&, Tensor y, const Tensor& x, const Tensor& W, float beta = 0.0f);
// Backward of linear_forward: dx[N,in] (+= when accumulate), dW[out,in] +=. Either may be empty.
void linear_backward(const ExecCtx&, Tensor dx, Tensor dW, const Tensor& dy, const Tensor& x,
                     const Tensor& W, bool accumulate_dx = false);
// Backward of linear_t_forward: dx[N,out] (+= when accumulate), dW[out,in] +=.
void linear_t_backward(const ExecCtx&, Tensor dx, Tensor dW, const Tensor& dy, const Tensor& x,
                       const Tensor& W, bool accumulate_dx = false);
// C[M,N] = beta·C + alpha·op(A)·op(B), row-major, leading dimensions explicit: the one sgemm
// entry point for ops that work on strided slices (attention heads).
void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc);

}  // namespace cemlm
