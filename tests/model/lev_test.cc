// LEV (MODEL.md §6.2): digits recompose the id, the spline basis is a partition of unity,
// constant spline coefficients make every token's embedding equal, and the precomputed table
// the engine builds at load equals the generator evaluated per token; the CUDA kernel's spline
// window (lev_window.h, which both generators use) equals the full basis, with exact zeros outside
// it.
#include "cemlm/kernels/lev.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "cemlm/engine/cpu_model.h"
#include "cemlm/kernels/lev_window.h"
#include "tiny_models.h"

namespace cemlm {
namespace {

TEST(Lev, DigitsRecompose) {
  for (auto [k, b] : {std::pair{3, 16}, std::pair{2, 8}, std::pair{4, 5}}) {
    int dig[8];
    int64_t top = 1;
    for (int i = 0; i < k; ++i) top *= b;
    for (int64_t t = 0; t < top; t += 7) {
      lev_digits(t, k, b, dig);
      int64_t back = 0;
      for (int j = 0; j < k; ++j) {
        ASSERT_GE(dig[j], 0);
        ASSERT_LT(dig[j], b);
        back = back * b + dig[j];
      }
      ASSERT_EQ(back, t);
    }
  }
}

TEST(Lev, BasisIsPartitionOfUnity) {
  for (int knots : {2, 3, 8, 16}) {
    std::vector<float> w(knots);
    for (float z = 0.001f; z < 1.0f; z += 0.0371f) {
      lev_basis(z, knots, w.data());
      EXPECT_NEAR(std::accumulate(w.begin(), w.end(), 0.0), 1.0, 1e-6);
      for (float x : w) EXPECT_GE(x, 0.0f);
    }
  }
}

// ζ over (0, 1) and its ends, on a fine grid and at every knot and half-knot (where the B-spline
// changes pieces and floor(ζ·(κ−1)) may round either way), for knot counts below, at and above
// the window's five.
TEST(Lev, SplineWindowEqualsTheFullBasis) {
  for (int knots : {2, 3, 4, 5, 6, 7, 16, 256}) {
    std::vector<float> zetas = {0.0f, 1.0f, 1e-7f, 1.0f - 1e-7f};
    for (int i = 1; i < 4000; ++i) zetas.push_back(float(i) / 4000.0f);
    for (int q = 0; q < knots; ++q)
      for (float half : {0.0f, 0.5f})
        for (float nudge : {-1e-6f, 0.0f, 1e-6f})
          zetas.push_back(std::clamp((float(q) + half) / float(knots - 1) + nudge, 0.0f, 1.0f));
    std::vector<float> full(size_t(knots), 0.0f);
    float win[kLevWindow];
    for (float z : zetas) {
      lev_basis(z, knots, full.data());
      const int q0 = lev_basis_window(z, knots, win);
      const int n = std::min(kLevWindow, knots);
      ASSERT_GE(q0, 0);
      ASSERT_LE(q0 + n, knots);
      for (int q = 0; q < knots; ++q) {
        const int j = q - q0;
        if (j < 0 || j >= n)
          ASSERT_EQ(full[size_t(q)], 0.0f) << "knots " << knots << " zeta " << z << " q " << q;
        else
          ASSERT_NEAR(win[j], full[size_t(q)], 1e-6f) << "knots " << knots << " zeta " << z;
      }
      for (int j = n; j < kLevWindow; ++j) ASSERT_EQ(win[j], 0.0f);
    }
  }
}

TEST(Lev, ConstantSplineGivesOneEmbeddingForAllTokens) {
  auto v = testing_models::all_variants()[1];  // llama_lev
  ModelConfig c = testing_models::make_config(v);
  ParamStore s(c);
  testing_models::randomize(s, 3);
  Tensor spline = s.get("lev.spline");
  std::fill(spline.data, spline.data + spline.numel(), 1.0f);
  Weights w = bind_weights(c, s);
  CpuModel m(c, w);
  for (int t = 1; t < c.vocab_size; ++t)
    for (int d = 0; d < c.d_model; ++d) ASSERT_NEAR(m.embedding(t)[d], m.embedding(0)[d], 1e-6);
}

TEST(Lev, PrecomputedTableEqualsPerToken) {
  auto v = testing_models::all_variants()[1];
  ModelConfig c = testing_models::make_config(v);
  ParamStore s(c);
  testing_models::randomize(s, 4);
  Weights w = bind_weights(c, s);
  CpuModel m(c, w);
  const LevWeights lw = lev_weights(w);
  bool differ = false;
  for (int32_t t : {0, 1, 17, 60}) {
    std::vector<float> one(c.d_model);
    lev_forward(ExecCtx{}, Tensor(one.data(), {1, c.d_model}), &t, lw);
    for (int d = 0; d < c.d_model; ++d) ASSERT_EQ(one[d], m.embedding(t)[d]);
    differ |= one[0] != m.embedding(0)[0];
  }
  EXPECT_TRUE(differ);
}

}  // namespace
}  // namespace cemlm
