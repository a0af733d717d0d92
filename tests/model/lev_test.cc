// LEV (MODEL.md §6.2): digits recompose the id, the spline basis is a partition of unity,
// constant spline coefficients make every token's embedding equal, and the precomputed table
// the engine builds at load matches an independent long-double evaluation of the formula, fine
// splines included; the generator's spline window (lev_window.h) equals the full basis, with exact
// zeros outside it.
#include "cemlm/kernels/lev.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>

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

// Embed(t) of MODEL.md §6.2 in long double, from the spec alone: every knot's B2 weight (no
// window), plain loops.
std::vector<long double> reference_embedding(const ModelConfig& c, const LevWeights& w, int64_t t) {
  const LevConfig& L = c.lev;
  const int s = L.seed_dim, kn = L.knots, r = L.rank;
  std::vector<long double> z(size_t(s), 0.0L), out(size_t(c.d_model), 0.0L);
  int64_t place = 1;
  for (int j = 1; j < L.digits; ++j) place *= L.base;
  for (int j = 0; j < L.digits; ++j, place /= L.base)
    for (int e = 0; e < s; ++e)
      z[size_t(e)] += w.codebooks.data[(int64_t(j) * L.base + (t / place) % L.base) * s + e];
  auto b2 = [](long double x) {
    const long double a = std::fabs(x);
    return a < 0.5L ? 0.75L - x * x : a < 1.5L ? 0.5L * (1.5L - a) * (1.5L - a) : 0.0L;
  };
  for (int l = 0; l < L.heads; ++l) {
    std::vector<long double> u(size_t(s), 0.0L);
    long double mean = 0, var = 0;
    for (int a = 0; a < s; ++a) {
      for (int e = 0; e < s; ++e)
        u[size_t(a)] += w.seed_proj.data[(int64_t(l) * s + a) * s + e] * z[size_t(e)];
      mean += u[size_t(a)] / s;
    }
    for (int a = 0; a < s; ++a) var += (u[size_t(a)] - mean) * (u[size_t(a)] - mean) / s;
    std::vector<long double> M(size_t(r), 1.0L);
    for (int d = 0; d < s; ++d) {
      const long double y =
          w.ln_weight.data[l * s + d] * (u[size_t(d)] - mean) / std::sqrt(var + 1e-5L) +
          w.ln_bias.data[l * s + d];
      const long double zeta = 1.0L / (1.0L + std::exp(-y));
      std::vector<long double> wq(static_cast<size_t>(kn));
      long double sum = 0;
      for (int q = 0; q < kn; ++q) sum += wq[size_t(q)] = b2((zeta - q / (kn - 1.0L)) * (kn - 1));
      for (int c2 = 0; c2 < r; ++c2) {
        long double phi = 0;
        for (int q = 0; q < kn; ++q)
          phi += wq[size_t(q)] / sum * w.spline.data[((int64_t(l) * s + d) * kn + q) * r + c2];
        M[size_t(c2)] *= phi;
      }
    }
    for (int c2 = 0; c2 < r; ++c2)
      for (int64_t e = 0; e < c.d_model; ++e)
        out[size_t(e)] += M[size_t(c2)] * w.out_proj.data[(int64_t(l) * r + c2) * c.d_model + e];
  }
  return out;
}

// max |table − reference| / max |reference| over every token.
double table_error(const ModelConfig& c, const Weights& w, const float* table) {
  long double err = 0, scale = 0;
  for (int64_t t = 0; t < c.vocab_size; ++t) {
    const std::vector<long double> ref = reference_embedding(c, lev_weights(w), t);
    for (int64_t e = 0; e < c.d_model; ++e) {
      err = std::max(err, std::fabs(table[t * c.d_model + e] - ref[size_t(e)]));
      scale = std::max(scale, std::fabs(ref[size_t(e)]));
    }
  }
  return double(err / scale);
}

// The engine's table against the long-double formula, at the tiny model's coarse spline and at
// fine ones (1024 knots over 16 seed dimensions, LayerNorm gains ×4) where fp32's rounding of ζ,
// times κ − 1 and compounded by the product over s, lands 2e-5 to 4e-5 off (1e-4 at larger s).
TEST(Lev, PrecomputedTableMatchesTheFormulaInLongDouble) {
  for (const auto& [knots, seed_dim, gain] :
       {std::tuple{8, 4, 1.0f}, std::tuple{1024, 16, 1.0f}, std::tuple{1024, 16, 4.0f}}) {
    ModelConfig c = testing_models::make_config(testing_models::all_variants()[1]);  // llama_lev
    c.lev.knots = knots;
    c.lev.seed_dim = seed_dim;
    ParamStore s(c);
    testing_models::randomize(s, 4);
    testing_models::scale_param(s, "lev.ln_weight", gain);
    Weights w = bind_weights(c, s);
    CpuModel m(c, w);
    EXPECT_LT(table_error(c, w, m.embedding(0)), 1e-6)
        << "knots " << knots << " seed_dim " << seed_dim << " gain " << gain;
  }
}

}  // namespace
}  // namespace cemlm
