// gemm (kernels/cpu/linear.cc) against a double-precision triple loop, for every transpose
// combination, padded leading dimensions, alpha/beta, the single-row shape that takes the sgemv
// path (one-sequence decode), and the few-row shapes of small_gemm on AVX-512 builds: every row
// remainder of its 8-row tiles, whole and ragged 32-column panels, K off the 16 × 16 transpose
// grid, the threaded split, and beta = 0 over a C full of NaN (which must not be read); and the
// one-row groups of small_gemv (ragged 16-row and 128-column groups, K tails, the threaded split).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cemlm/engine/params.h"
#include "cemlm/kernels/blas_select.h"
#include "cemlm/kernels/linear.h"
#include "packed_weights.h"

namespace cemlm {
namespace {

struct Case {
  int M, N, K;
  bool ta, tb;
  float alpha, beta;
  bool nan_c = false;  // C starts as NaN (only with beta = 0)
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
  for (float& x : C) x = c.nan_c ? std::nanf("") : float(rng.normal());
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
      const double want = c.alpha * s + (c.nan_c ? 0.0 : c.beta * C0[size_t(i) * ldc + j]);
      ASSERT_NEAR(C[size_t(i) * ldc + j], want, 1e-4 * (1 + std::abs(want)))
          << "row " << i << " col " << j;
    }
  // The padding between rows is never written.
  for (int i = 0; i < c.M; ++i)
    for (int j = c.N; j < ldc; ++j)
      ASSERT_TRUE(std::memcmp(&C[size_t(i) * ldc + j], &C0[size_t(i) * ldc + j], sizeof(float)) == 0);
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (int M : {1, 3, 17})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        v.push_back({M, 29, 37, ta, tb, 1.0f, 0.0f});
        v.push_back({M, 5, 64, ta, tb, -0.5f, 1.0f});
      }
  // Few-row products (small_gemm on AVX-512): rows 2..9 and 15, 40 cover every tile remainder;
  // N = 71 is two whole panels and a ragged one, K = 37 two transposed 16-blocks and a tail.
  for (int M : {2, 4, 5, 6, 7, 8, 9, 15, 40})
    for (bool tb : {false, true}) {
      v.push_back({M, 71, 37, false, tb, 1.0f, 0.0f});
      v.push_back({M, 64, 48, false, tb, 0.75f, -1.5f});
    }
  for (bool tb : {false, true}) {
    v.push_back({33, 100, 700, false, tb, 1.0f, 0.0f});    // above the threading threshold
    v.push_back({256, 96, 20, false, tb, 1.0f, 1.0f});     // the largest small_gemm shape
    v.push_back({257, 40, 20, false, tb, 1.0f, 0.0f});     // just past it: OpenBLAS
    v.push_back({12, 50, 33, false, tb, 2.0f, 0.0f, true});  // beta = 0 never reads C
    v.push_back({1, 50, 33, false, tb, 2.0f, 0.0f, true});
    // One-row products (small_gemv on AVX-512): 16-row groups with a ragged last one and K
    // tails; more than one 128-column group with a ragged one; above the 256 KiB threading size.
    v.push_back({1, 35, 17, false, tb, 1.0f, 0.5f});
    v.push_back({1, 600, 9, false, tb, -1.0f, 1.0f});
    v.push_back({1, 700, 400, false, tb, 1.0f, 0.0f});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmTest, ::testing::ValuesIn(cases()));

// y[r0, r0 + n) = beta·y + x[r0, r0 + n) · op(W) through a packed weight (linear_t_forward when
// it was packed transposed); x and y have xw and yw columns.
void packed_rows(const PackedLinear& w, bool transposed, std::vector<float>& x, int xw, int r0, int n,
                 float beta, std::vector<float>* y, int yw) {
  const Tensor xt(x.data() + size_t(r0) * xw, {n, xw}), yt(y->data() + size_t(r0) * yw, {n, yw});
  if (transposed)
    linear_t_forward(ExecCtx{}, yt, xt, w, beta);
  else
    linear_forward(ExecCtx{}, yt, xt, w, beta);
}

// A PackedLinear gives linear_forward's (Use::kForward) or linear_t_forward's (Use::kTransposed)
// product to within rounding (a double-precision loop), for one row, few rows, more than 256 rows,
// whole and ragged panels, K off the transpose grid, beta ≠ 0; and, where it packs (AVX-512), each
// row's result has the same bits whatever the number of rows it came with and the threads (batch
// invariance: a row alone, in every 1..9-row slice, and in the whole batch).
TEST(PackedLinear, MatchesTheWeightAndEachRowsBitsIgnoreTheOtherRows) {
  for (const bool transposed : {false, true})
    for (auto [M, out, in] : {std::tuple{1, 64, 32}, {2, 71, 37}, {8, 64, 48}, {9, 100, 700},
                              {33, 256, 256}, {32, 96, 200}, {256, 40, 20}, {300, 40, 20},
                              {5, 200, 1400}}) {
      Rng rng(uint64_t(M * 7 + out));
      // x · op(W) with x [M, xw] and a result [M, yw].
      const int xw = transposed ? out : in, yw = transposed ? in : out;
      std::vector<float> W(size_t(out) * in), x(size_t(M) * xw), y0(size_t(M) * yw);
      for (float& v : W) v = float(rng.normal());
      for (float& v : x) v = float(rng.normal());
      for (float& v : y0) v = float(rng.normal());
      const Tensor Wt(W.data(), {out, in});
      const PackedLinear packed(
          Wt, transposed ? PackedLinear::Use::kTransposed : PackedLinear::Use::kForward);
      auto product = [&](int r0, int n, float beta, std::vector<float>* y) {
        packed_rows(packed, transposed, x, xw, r0, n, beta, y, yw);
      };
      for (float beta : {0.0f, 1.0f}) {
        std::vector<float> got = y0;
        product(0, M, beta, &got);
        for (int i = 0; i < M; i += 7)
          for (int j = 0; j < yw; ++j) {
            double s = beta * y0[size_t(i) * yw + j];
            for (int k = 0; k < xw; ++k)
              s += double(x[size_t(i) * xw + k]) *
                   (transposed ? W[size_t(k) * in + j] : W[size_t(j) * in + k]);
            ASSERT_NEAR(got[size_t(i) * yw + j], s, 1e-4 * (1 + std::abs(s)))
                << "transposed=" << transposed << " M=" << M;
          }
        if (!packed.packed()) continue;  // OpenBLAS: other row counts may round otherwise
        for (int n = 1; n <= std::min(M, 9); ++n) {
          std::vector<float> slices = y0;
          for (int r0 = 0; r0 < M; r0 += n) product(r0, std::min(n, M - r0), beta, &slices);
          ASSERT_EQ(std::memcmp(slices.data(), got.data(), sizeof(float) * got.size()), 0)
              << "transposed=" << transposed << " M=" << M << " out=" << out << " in=" << in
              << " beta=" << beta << ": rows in slices of " << n;
        }
      }
    }
}

// x · op(W) for W [out, in] (every 97th weight 4× the others, so that int8 blocks' scales differ)
// and x [M, xw] (every 31st input 8×), y0 [M, yw]: random, with y = W x per row (kForward) or
// y = Wᵀ x (kTransposed).
struct ProductCase {
  int M, out, in;
  bool transposed;
  int xw, yw;
  std::vector<float> W, x, y0;
  PackedLinear::Use use() const {
    return transposed ? PackedLinear::Use::kTransposed : PackedLinear::Use::kForward;
  }
  std::string name() const {
    return "transposed=" + std::to_string(transposed) + " M=" + std::to_string(M) +
           " out=" + std::to_string(out) + " in=" + std::to_string(in);
  }
};

// Calls check(c) on the shapes the low-precision products are checked on, both uses: one row, few
// rows, ragged panels and quantization blocks, K odd and off the multiples of 4 and 32, more rows
// than a tile holds.
template <typename Check>
void for_each_product_case(uint64_t seed, Check check) {
  for (const bool transposed : {false, true})
    for (auto [M, out, in] : {std::tuple{1, 64, 32},
                              {1, 200, 1400},
                              {2, 71, 37},
                              {8, 64, 48},
                              {9, 100, 700},
                              {33, 256, 256},
                              {300, 40, 21}}) {
      Rng rng(seed + uint64_t(M * 13 + out));
      ProductCase c{M,  out, in, transposed, transposed ? out : in, transposed ? in : out,
                    {}, {},  {}};
      c.W.resize(size_t(out) * in), c.x.resize(size_t(M) * c.xw), c.y0.resize(size_t(M) * c.yw);
      for (float& v : c.W) v = float(rng.normal());
      for (size_t i = 0; i < c.W.size(); i += 97) c.W[i] *= 4.0f;
      for (float& v : c.x) v = float(rng.normal());
      for (size_t i = 0; i < c.x.size(); i += 31) c.x[i] *= 8.0f;
      for (float& v : c.y0) v = float(rng.normal());
      check(c);
    }
}

// `w`'s products of c.x's rows taken all at once and in slices of 1, 2, 3, 8 and 9 rows (onto
// c.y0, beta) all have the bits of `want`: batch invariance.
void expect_rows_in_slices_give(const PackedLinear& w, ProductCase& c, float beta,
                                const std::vector<float>& want, const std::string& what) {
  for (int n : {c.M, 1, 2, 3, 8, 9}) {
    if (n > c.M) continue;
    std::vector<float> got = c.y0;
    for (int r0 = 0; r0 < c.M; r0 += n)
      packed_rows(w, c.transposed, c.x, c.xw, r0, std::min(n, c.M - r0), beta, &got, c.yw);
    for (size_t e = 0; e < got.size(); ++e)
      ASSERT_EQ(std::bit_cast<uint32_t>(got[e]), std::bit_cast<uint32_t>(want[e]))
          << what << " " << c.name() << " beta=" << beta << ", rows in slices of " << n
          << ": element " << e << " is " << got[e] << ", not " << want[e];
  }
}

// A bf16 or int8 PackedLinear gives, bit for bit, the fp32 PackedLinear of the weight it stands
// for (bf16: rounded to nearest-even; int8: dequantized per 32 × 32 block of W, whichever the
// use): the panels widen each weight exactly and keep the fp32 panels' FMA chains. For each
// product case, beta ≠ 0, and rows taken in slices of 1..9 (batch invariance). Checked against
// weights rounded here (tests/common/packed_weights.h), so a missed or wrong rounding, a swapped
// pair of columns, a block's scale applied to another block or a panel read at the wrong stride
// all fail it.
TEST(PackedLinear, LowPrecisionWeightsGiveTheFp32ProductsOfTheWeightTheyStandFor) {
  if (!packed_weights_available()) GTEST_SKIP() << "a build without AVX-512 packs no weights";
  for (const WeightDtype dtype : {WeightDtype::kBf16, WeightDtype::kInt8})
    for_each_product_case(13, [&](ProductCase& c) {
      std::vector<float> rounded = c.W;
      testing_weights::round_like_packed(dtype, rounded.data(), c.out, c.in);
      const PackedLinear low(Tensor(c.W.data(), {c.out, c.in}), c.use(), dtype);
      const PackedLinear reference(Tensor(rounded.data(), {c.out, c.in}), c.use(),
                                   WeightDtype::kFp32);
      ASSERT_TRUE(low.packed());
      for (float beta : {0.0f, 1.0f}) {
        std::vector<float> want = c.y0;
        packed_rows(reference, c.transposed, c.x, c.xw, 0, c.M, beta, &want, c.yw);
        expect_rows_in_slices_give(low, c, beta, want, "dtype=" + std::to_string(int(dtype)));
      }
    });
}

// A kBf16Dot PackedLinear multiplies the bf16-rounded weight by the bf16-rounded input, summing
// in fp32: within 2e-5 of Σ|terms| (K ≤ 1400 fp32 additions of exact bf16 products) of that
// product taken in double, for each product case (odd K: a last pair half empty), beta ≠ 0; and
// far from it with the input left in fp32 (the input is rounded: the tolerance could not hide
// that). Rows in slices of 1..9 give the same bits (batch invariance).
TEST(PackedLinear, Bf16DotMultipliesBf16InputsByBf16Weights) {
  if (!bf16_dot_available()) GTEST_SKIP() << "this build has no AVX512-BF16";
  for_each_product_case(11, [&](ProductCase& c) {
    std::vector<float> Wr = c.W, xr = c.x;
    testing_weights::round_like_packed(WeightDtype::kBf16Dot, Wr.data(), c.out, c.in);
    testing_weights::round_like_packed(WeightDtype::kBf16, xr.data(), c.M, c.xw);
    const PackedLinear packed(Tensor(c.W.data(), {c.out, c.in}), c.use(), WeightDtype::kBf16Dot);
    ASSERT_TRUE(packed.packed());
    for (float beta : {0.0f, 1.0f}) {
      std::vector<float> want = c.y0;
      packed_rows(packed, c.transposed, c.x, c.xw, 0, c.M, beta, &want, c.yw);
      double far_from_fp32_x = 0;
      for (int i = 0; i < c.M; ++i)
        for (int j = 0; j < c.yw; ++j) {
          double s = beta * c.y0[size_t(i) * c.yw + j], s_fp32_x = s, magnitude = std::fabs(s);
          for (int k = 0; k < c.xw; ++k) {
            const double w = c.transposed ? Wr[size_t(k) * c.in + j] : Wr[size_t(j) * c.in + k];
            s += double(xr[size_t(i) * c.xw + k]) * w;
            s_fp32_x += double(c.x[size_t(i) * c.xw + k]) * w;
            magnitude += std::fabs(double(xr[size_t(i) * c.xw + k]) * w);
          }
          const double tol = 2e-5 * magnitude;
          ASSERT_NEAR(want[size_t(i) * c.yw + j], s, tol)
              << c.name() << " beta=" << beta << " row " << i << " column " << j;
          far_from_fp32_x = std::max(far_from_fp32_x, std::fabs(s_fp32_x - s) / tol);
        }
      EXPECT_GT(far_from_fp32_x, 10) << "the inputs were not rounded to bf16?";
      expect_rows_in_slices_give(packed, c, beta, want, "bf16dot");
    }
  });
}

// int8 quantization of a block of values as WeightDtype::kInt8 and kInt8Dot define it: the scale
// is int8_scale(the largest |v|) (its / 127), q = v / scale rounded to nearest-even (0 where the
// scale is 0).
float block_scale(const std::vector<float>& block) {
  float absmax = 0;
  for (float v : block) absmax = std::max(absmax, std::fabs(v));
  return int8_scale(absmax);
}
int int8_q(float v, float scale) {
  return scale > 0 ? int(std::clamp(std::nearbyint(v / scale), -127.0f, 127.0f)) : 0;
}

// A kInt8Dot PackedLinear gives, bit for bit, what its definition (linear.h, gemm_avx512.h) says,
// computed here in scalar code: W quantized per 32 × 32 block, each row of x per block of 32 k,
// the blocks' integer sums Σ q_x · q_w exact, and acc = fma(sum, s_x · s_w, acc) over the blocks
// (fma(sum · s_x, s_w, acc) where s_x · s_w overflows)
// in k order; for one row, few rows, ragged panels, K not a multiple of 4 or 32, both uses,
// beta ≠ 0; rows in slices of 1..9 give the same bits (batch invariance).
TEST(PackedLinear, Int8DotIsTheExactSumOfQuantizedBlocks) {
  if (!int8_dot_available()) GTEST_SKIP() << "this build or CPU has no AVX512-VNNI";
  for_each_product_case(17, [&](ProductCase& c) {
    const int out = c.out, in = c.in;
    // W's q and scales, per 32 × 32 block of W.
    const int bw = (in + 31) / 32;
    std::vector<float> w_scale(size_t((out + 31) / 32) * bw);
    std::vector<int> w_q(c.W.size());
    for (int r0 = 0; r0 < out; r0 += 32)
      for (int c0 = 0; c0 < in; c0 += 32) {
        std::vector<float> block;
        for (int r = r0; r < std::min(out, r0 + 32); ++r)
          for (int k = c0; k < std::min(in, c0 + 32); ++k) block.push_back(c.W[size_t(r) * in + k]);
        const float s = w_scale[size_t(r0 / 32) * bw + c0 / 32] = block_scale(block);
        for (int r = r0; r < std::min(out, r0 + 32); ++r)
          for (int k = c0; k < std::min(in, c0 + 32); ++k)
            w_q[size_t(r) * in + k] = int8_q(c.W[size_t(r) * in + k], s);
      }
    const PackedLinear packed(Tensor(c.W.data(), {out, in}), c.use(), WeightDtype::kInt8Dot);
    ASSERT_TRUE(packed.packed());
    for (float beta : {0.0f, 1.0f}) {
      std::vector<float> want(c.y0.size());
      for (int i = 0; i < c.M; ++i) {
        const float* xi = c.x.data() + size_t(i) * c.xw;
        for (int j = 0; j < c.yw; ++j) {
          float acc = 0;
          for (int k0 = 0; k0 < c.xw; k0 += 32) {
            const int k1 = std::min(c.xw, k0 + 32);
            const float sx = block_scale(std::vector<float>(xi + k0, xi + k1));
            int64_t sum = 0;
            for (int k = k0; k < k1; ++k)  // op(W)[k][j]: W[j][k], or W[k][j] transposed
              sum += int64_t(int8_q(xi[k], sx)) *
                     w_q[c.transposed ? size_t(k) * in + j : size_t(j) * in + k];
            const float sw = c.transposed ? w_scale[size_t(k0 / 32) * bw + j / 32]
                                          : w_scale[size_t(j / 32) * bw + k0 / 32];
            acc = std::isfinite(sx * sw) ? std::fma(float(sum), sx * sw, acc)
                                         : std::fma(float(sum) * sx, sw, acc);
          }
          const float y = c.y0[size_t(i) * c.yw + j];
          want[size_t(i) * c.yw + j] = beta != 0.0f ? std::fma(beta, y, acc) : acc;
        }
      }
      expect_rows_in_slices_give(packed, c, beta, want, "int8dot");
    }
  });
}

// A kInt8Dot input block holding a NaN or an infinity makes its row's outputs NaN (it would
// poison an fp32 product) rather than an undefined quantization; the other rows stay finite.
TEST(PackedLinear, Int8DotInputBlockWithANonFiniteValueGivesNaNsInItsRow) {
  if (!int8_dot_available()) GTEST_SKIP() << "this build or CPU has no AVX512-VNNI";
  std::vector<float> W(64 * 64, 0.5f), y(3 * 64);
  const PackedLinear packed(Tensor(W.data(), {64, 64}), PackedLinear::Use::kForward,
                            WeightDtype::kInt8Dot);
  for (const float bad : {std::nanf(""), INFINITY}) {
    std::vector<float> x(3 * 64, 1.0f);
    x[64 + 40] = bad;  // row 1, second block
    linear_forward(ExecCtx{}, Tensor(y.data(), {3, 64}), Tensor(x.data(), {3, 64}), packed);
    for (int i = 0; i < 3; ++i)
      for (int n = 0; n < 64; ++n)
        EXPECT_EQ(std::isnan(y[size_t(i) * 64 + n]), i == 1) << "bad=" << bad << " row " << i;
  }
}

// Scales whose product is past the float range (1e21 / 127 · 1e22 / 127 ≈ 6e38): a block's sum
// is scaled by one, then the other. With the product, the block below (its integer sum 0, the
// largest x and w at different k) gave 0 · inf = NaN for a true 1e22.
TEST(PackedLinear, Int8DotScalesPastTheFloatRangeInProductStayFinite) {
  if (!int8_dot_available()) GTEST_SKIP() << "this build or CPU has no AVX512-VNNI";
  std::vector<float> W(32 * 32, 0.0f), x(32, 0.0f), y(32);
  W[0] = 0.1f;   // row 0 (output 0), k = 0
  W[1] = 1e22f;  // row 0, k = 1
  x[0] = 1e21f;
  x[1] = 1.0f;
  const PackedLinear packed(Tensor(W.data(), {32, 32}), PackedLinear::Use::kForward,
                            WeightDtype::kInt8Dot);
  linear_forward(ExecCtx{}, Tensor(y.data(), {1, 32}), Tensor(x.data(), {1, 32}), packed);
  for (int n = 0; n < 32; ++n) EXPECT_TRUE(std::isfinite(y[n])) << "output " << n << " = " << y[n];
  // Quantized, x[1] and W[0] are 0 (below half a step of their blocks): the sum is 0 exactly.
  EXPECT_EQ(y[0], 0.0f);
  // Nor does a huge x with small weights overflow in the first of two scales: the product
  // (1e35 / 127 · 1e-3 / 127) is finite and taken whole, y = 32 · 1e35 · 1e-3 as in fp32.
  std::fill(W.begin(), W.end(), 1e-3f);
  std::fill(x.begin(), x.end(), 1e35f);
  const PackedLinear small(Tensor(W.data(), {32, 32}), PackedLinear::Use::kForward,
                           WeightDtype::kInt8Dot);
  linear_forward(ExecCtx{}, Tensor(y.data(), {1, 32}), Tensor(x.data(), {1, 32}), small);
  for (int n = 0; n < 32; ++n) EXPECT_NEAR(y[n] / 3.2e33f, 1.0f, 1e-2f) << "output " << n;
}

// An int8 block holding the largest float stands for finite weights: its scale, that / 127,
// rounded up, so the weight read back as 127 · scale = infinity, and every output it fed was too.
TEST(PackedLinear, Int8BlockHoldingTheLargestFloatStaysFinite) {
  if (!packed_weights_available()) GTEST_SKIP() << "a build without AVX-512 packs no weights";
  std::vector<float> W(64 * 64, 0.5f), x(64, 0.0f), y(64);
  W[5 * 64 + 40] = std::numeric_limits<float>::max();
  x[40] = 1e-30f;
  const PackedLinear packed(Tensor(W.data(), {64, 64}), PackedLinear::Use::kForward,
                            WeightDtype::kInt8);
  linear_forward(ExecCtx{}, Tensor(y.data(), {1, 64}), Tensor(x.data(), {1, 64}), packed);
  for (int n = 0; n < 64; ++n) EXPECT_TRUE(std::isfinite(y[n])) << "output " << n << " = " << y[n];
  EXPECT_NEAR(y[5], 3.4e8f, 0.01e8f);  // the largest float (within the scale's step) times 1e-30
}

// An int8 block holding a NaN or an infinity stands for NaNs (as the weight would poison an fp32
// product) rather than for an undefined conversion: the outputs that block feeds are NaN, the
// others finite.
TEST(PackedLinear, Int8BlockWithANonFiniteWeightGivesNaNsWhereItIsUsed) {
  if (!packed_weights_available()) GTEST_SKIP() << "a build without AVX-512 packs no weights";
  for (const float bad : {std::nanf(""), INFINITY}) {
    std::vector<float> W(64 * 64, 0.5f), x(64, 1.0f), y(64);
    W[5 * 64 + 40] = bad;  // block (rows 0-31, columns 32-63) of W
    const PackedLinear packed(Tensor(W.data(), {64, 64}), PackedLinear::Use::kForward,
                              WeightDtype::kInt8);
    linear_forward(ExecCtx{}, Tensor(y.data(), {1, 64}), Tensor(x.data(), {1, 64}), packed);
    for (int n = 0; n < 64; ++n)  // outputs 0-31 read that block, 32-63 do not
      EXPECT_EQ(std::isnan(y[n]), n < 32) << "bad=" << bad << " output " << n << " = " << y[n];
  }
}

// Only AVX-512 processors left with OpenBLAS's generic or AVX2 kernels get other ones.
// linear_forward over several weights sharing one input (the projections of one input, one
// product where they are packed alike) gives each output the bits of its own linear_forward call,
// for every weight dtype this machine runs: one row (the one-row groups, split over threads for
// the larger cases), few rows and more than a tile (the row tiles over all targets' panels,
// threaded), outputs of different and ragged widths, K off the panel and block grids; and with
// weights of two dtypes, each output from its own weight's product.
TEST(PackedLinear, ProjectionsOfOneInputGiveTheBitsOfSeparateProducts) {
  std::vector<WeightDtype> dtypes = {WeightDtype::kFp32};
  if (packed_weights_available())
    dtypes.insert(dtypes.end(), {WeightDtype::kBf16, WeightDtype::kInt8});
  if (bf16_dot_available()) dtypes.push_back(WeightDtype::kBf16Dot);
  if (int8_dot_available()) dtypes.push_back(WeightDtype::kInt8Dot);
  const std::vector<std::vector<int>> widths = {{64, 64}, {71, 200, 33}, {256, 96, 128, 40}};
  for (const WeightDtype dtype : dtypes)
    for (int M : {1, 3, 9, 40})
      for (int in : {37, 256, 700})
        for (const std::vector<int>& outs : widths) {
          Rng rng(uint64_t(M * 131 + in + outs.size()));
          std::vector<std::vector<float>> W(outs.size());
          std::vector<PackedLinear> packed;
          packed.reserve(outs.size());
          for (size_t t = 0; t < outs.size(); ++t) {
            W[t].resize(size_t(outs[t]) * in);
            for (float& v : W[t]) v = float(rng.normal());
            packed.emplace_back(Tensor(W[t].data(), {outs[t], in}), PackedLinear::Use::kForward,
                                dtype);
          }
          std::vector<float> x(size_t(M) * in);
          for (float& v : x) v = float(rng.normal());
          const Tensor xt(x.data(), {M, in});
          // y[t] garbage first (beta 0 must not read it), then each output's separate product.
          std::vector<std::vector<float>> got(outs.size()), want(outs.size());
          for (size_t t = 0; t < outs.size(); ++t) {
            got[t].assign(size_t(M) * outs[t], std::nanf(""));
            want[t].assign(size_t(M) * outs[t], 0.0f);
            linear_forward(ExecCtx{}, Tensor(want[t].data(), {M, outs[t]}), xt, packed[t]);
          }
          auto y = [&](size_t t) { return Tensor(got[t].data(), {M, outs[t]}); };
          if (outs.size() == 2)
            linear_forward(ExecCtx{}, xt, {{y(0), &packed[0]}, {y(1), &packed[1]}});
          else if (outs.size() == 3)
            linear_forward(ExecCtx{}, xt,
                           {{y(0), &packed[0]}, {y(1), &packed[1]}, {y(2), &packed[2]}});
          else
            linear_forward(
                ExecCtx{}, xt,
                {{y(0), &packed[0]}, {y(1), &packed[1]}, {y(2), &packed[2]}, {y(3), &packed[3]}});
          for (size_t t = 0; t < outs.size(); ++t)
            for (size_t e = 0; e < got[t].size(); ++e)
              ASSERT_EQ(std::bit_cast<uint32_t>(got[t][e]), std::bit_cast<uint32_t>(want[t][e]))
                  << "dtype " << int(dtype) << " M=" << M << " in=" << in << " output " << t
                  << " of " << outs.size() << ", element " << e << ": " << got[t][e] << ", not "
                  << want[t][e];
        }
  // Weights of two dtypes: each output from its own weight's product.
  if (!packed_weights_available()) return;
  Rng rng(7);
  const int M = 5, in = 96, out = 80;
  std::vector<float> W0(size_t(out) * in), W1(size_t(out) * in), x(size_t(M) * in);
  for (auto* v : {&W0, &W1, &x})
    for (float& e : *v) e = float(rng.normal());
  const PackedLinear fp32(Tensor(W0.data(), {out, in})),
      bf16(Tensor(W1.data(), {out, in}), PackedLinear::Use::kForward, WeightDtype::kBf16);
  const Tensor xt(x.data(), {M, in});
  std::vector<float> a(size_t(M) * out), b(a.size()), a_want(a.size()), b_want(a.size());
  linear_forward(ExecCtx{}, xt,
                 {{Tensor(a.data(), {M, out}), &fp32}, {Tensor(b.data(), {M, out}), &bf16}});
  linear_forward(ExecCtx{}, Tensor(a_want.data(), {M, out}), xt, fp32);
  linear_forward(ExecCtx{}, Tensor(b_want.data(), {M, out}), xt, bf16);
  EXPECT_EQ(std::memcmp(a.data(), a_want.data(), sizeof(float) * a.size()), 0);
  EXPECT_EQ(std::memcmp(b.data(), b_want.data(), sizeof(float) * b.size()), 0);
}

TEST(BlasSelect, BetterKernelsOnlyForAvx512LeftBelowIt) {
  EXPECT_EQ(better_openblas_core("Prescott", true, true), "Cooperlake");
  EXPECT_EQ(better_openblas_core("prescott", true, false), "SkylakeX");
  EXPECT_EQ(better_openblas_core("Core2", true, false), "SkylakeX");
  EXPECT_EQ(better_openblas_core("Prescott", false, false), "");  // no AVX-512: generic is right
  // AVX2 kernels on an AVX-512 processor (AMD Zen 4 under 0.3.21) are replaced ...
  EXPECT_EQ(better_openblas_core("Haswell", true, true), "Cooperlake");
  EXPECT_EQ(better_openblas_core("Zen", true, false), "SkylakeX");
  // ... but kept where the processor has no AVX-512, and an AVX-512 match is kept.
  EXPECT_EQ(better_openblas_core("Haswell", false, false), "");
  EXPECT_EQ(better_openblas_core("Zen", false, false), "");
  EXPECT_EQ(better_openblas_core("SkylakeX", true, true), "");
  EXPECT_EQ(better_openblas_core("Cooperlake", true, true), "");
  const std::string d = blas_description();
  EXPECT_EQ(d.rfind("OpenBLAS ", 0), 0u) << d;
  EXPECT_NE(d.find(" kernels"), std::string::npos) << d;
}

// The description says when OPENBLAS_CORETYPE came from the environment, not from cemlm's re-exec
// (which marks its own choice).
TEST(BlasSelect, DescriptionNamesACoretypeFromTheEnvironment) {
  auto saved = [](const char* name) {
    const char* v = std::getenv(name);
    return v ? std::optional<std::string>(v) : std::nullopt;
  };
  const auto core = saved("OPENBLAS_CORETYPE"), mark = saved(kOpenblasCoretypeChosenEnv);
  const std::string note = "(OPENBLAS_CORETYPE from the environment";
  setenv("OPENBLAS_CORETYPE", "Haswell", 1);
  unsetenv(kOpenblasCoretypeChosenEnv);
  EXPECT_NE(blas_description().find(note), std::string::npos) << blas_description();
  setenv(kOpenblasCoretypeChosenEnv, "1", 1);
  EXPECT_EQ(blas_description().find(note), std::string::npos) << blas_description();
  unsetenv("OPENBLAS_CORETYPE");
  unsetenv(kOpenblasCoretypeChosenEnv);
  EXPECT_EQ(blas_description().find(note), std::string::npos) << blas_description();
  if (core) setenv("OPENBLAS_CORETYPE", core->c_str(), 1);
  if (mark) setenv(kOpenblasCoretypeChosenEnv, mark->c_str(), 1);
}

// OpenMP's waits are bounded (GOMP_SPINCOUNT) unless the environment chose a policy; the
// description says which, for the server's start-up log.
TEST(RuntimeEnv, SpinCountIsSetUnlessTheEnvironmentChoseAWaitPolicy) {
  auto saved = [](const char* name) {
    const char* v = std::getenv(name);
    return v ? std::optional<std::string>(v) : std::nullopt;
  };
  const char* names[] = {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", kOpenmpSpinCountChosenEnv};
  std::optional<std::string> before[3];
  for (int i = 0; i < 3; ++i) before[i] = saved(names[i]), unsetenv(names[i]);
  auto sets_spins = [] {
    for (const auto& [name, value] : runtime_env_to_set())
      if (name == "GOMP_SPINCOUNT") return value;
    return std::string();
  };
  EXPECT_EQ(sets_spins(), kOpenmpSpinCount);
  setenv("GOMP_SPINCOUNT", kOpenmpSpinCount, 1);
  setenv(kOpenmpSpinCountChosenEnv, "1", 1);  // as after the re-exec
  EXPECT_EQ(sets_spins(), "");
  EXPECT_NE(openmp_wait_description().find("spin 1000 rounds, then sleep (cemlm's default"),
            std::string::npos)
      << openmp_wait_description();
  unsetenv(kOpenmpSpinCountChosenEnv);
  setenv("GOMP_SPINCOUNT", "50", 1);
  EXPECT_EQ(openmp_wait_description(), "OpenMP waits: GOMP_SPINCOUNT=50 from the environment");
  unsetenv("GOMP_SPINCOUNT");
  setenv("OMP_WAIT_POLICY", "passive", 1);
  EXPECT_EQ(sets_spins(), "");
  EXPECT_EQ(openmp_wait_description(),
            "OpenMP waits: OMP_WAIT_POLICY=passive from the environment");
  for (int i = 0; i < 3; ++i)
    before[i] ? (void)setenv(names[i], before[i]->c_str(), 1) : (void)unsetenv(names[i]);
}

}  // namespace
}  // namespace cemlm
