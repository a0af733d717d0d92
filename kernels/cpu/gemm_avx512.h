// The AVX-512 few-row product behind gemm() (kernels/cpu/linear.cc); see gemm_avx512.cc.
#pragma once

namespace cemlm {

// Rows up to which small_gemm takes a product: past this, OpenBLAS's cache blocking pays off.
constexpr int kSmallGemmMaxRows = 256;

// C[M,N] = beta·C + alpha·A·op(B) with A [M, K] row-major, op(B) = B [K, N] or (trans_b) the
// transpose of B [N, K]. Returns false, touching nothing, when it does not apply: a build without
// AVX-512, or M outside [2, kSmallGemmMaxRows].
bool small_gemm(bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                const float* B, int ldb, float beta, float* C, int ldc);

}  // namespace cemlm
