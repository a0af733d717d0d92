// gemm (kernels/cpu/linear.cc) against a double-precision triple loop, for every transpose
// combination, padded leading dimensions, alpha/beta, and the single-row shape that takes the
// sgemv path (one-sequence decode).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "cemlm/engine/params.h"
#include "cemlm/kernels/linear.h"

namespace cemlm {
namespace {

struct Case {
  int M, N, K;
  bool ta, tb;
  float alpha, beta;
};

class GemmTest : public ::testing::TestWithParam<Case> {};

TEST_P(GemmTest, MatchesTripleLoop) {
  const Case c = GetParam();
  Rng rng(uint64_t(c.M * 1000 + c.N * 10 + c.K));
  // Stored shapes (row-major) with 3 columns of padding: A is [M, K] or [K, M], B [K, N] or [N, K].
  const int a_rows = c.ta ? c.K : c.M, a_cols = c.ta ? c.M : c.K;
  const int b_rows = c.tb ? c.N : c.K, b_cols = c.tb ? c.K : c.N;
  const int lda = a_cols + 3, ldb = b_cols + 3, ldc = c.N + 3;
  std::vector<float> A(size_t(a_rows) * lda), B(size_t(b_rows) * ldb), C(size_t(c.M) * ldc);
  for (float& x : A) x = float(rng.normal());
  for (float& x : B) x = float(rng.normal());
  for (float& x : C) x = float(rng.normal());
  const std::vector<float> C0 = C;
  gemm(c.ta, c.tb, c.M, c.N, c.K, c.alpha, A.data(), lda, B.data(), ldb, c.beta, C.data(), ldc);
  for (int i = 0; i < c.M; ++i)
    for (int j = 0; j < c.N; ++j) {
      double s = 0;
      for (int k = 0; k < c.K; ++k) {
        const double a = c.ta ? A[size_t(k) * lda + i] : A[size_t(i) * lda + k];
        const double b = c.tb ? B[size_t(j) * ldb + k] : B[size_t(k) * ldb + j];
        s += a * b;
      }
      const double want = c.alpha * s + c.beta * C0[size_t(i) * ldc + j];
      ASSERT_NEAR(C[size_t(i) * ldc + j], want, 1e-4 * (1 + std::abs(want)))
          << "row " << i << " col " << j;
    }
  // The padding between rows is never written.
  for (int i = 0; i < c.M; ++i)
    for (int j = c.N; j < ldc; ++j) ASSERT_EQ(C[size_t(i) * ldc + j], C0[size_t(i) * ldc + j]);
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (int M : {1, 3, 17})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        v.push_back({M, 29, 37, ta, tb, 1.0f, 0.0f});
        v.push_back({M, 5, 64, ta, tb, -0.5f, 1.0f});
      }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmTest, ::testing::ValuesIn(cases()));

}  // namespace
}  // namespace cemlm
