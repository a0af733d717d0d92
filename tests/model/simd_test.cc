// kernels/include/cemlm/kernels/simd.h against the standard library: the vector exponential's
// error over the whole float range it serves, its underflow to 0 and overflow to +inf, the
// dot/sum helpers on lengths that exercise every tail, and SiLU / RMSNorm at extreme inputs.
#include "cemlm/kernels/simd.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cemlm/engine/params.h"
#include "cemlm/kernels/elementwise.h"
#include "cemlm/kernels/rmsnorm.h"

namespace cemlm {
namespace {

TEST(Simd, ExpIsWithinTwoUlpOfStdExp) {
  double worst = 0;
  float worst_x = 0;
  for (float x = -87.0f; x <= 88.0f; x += 0.001953125f) {
    const double want = std::exp(double(x));
    const double got = simd::exp(x);
    const double ulp = std::ldexp(1.0, std::ilogb(want) - 23);
    if (std::abs(got - want) / ulp > worst) worst = std::abs(got - want) / ulp, worst_x = x;
  }
  EXPECT_LE(worst, 2.0) << "at x = " << worst_x;
  EXPECT_EQ(simd::exp(0.0f), 1.0f);
}

TEST(Simd, ExpUnderflowsToZeroAndVectorLanesAgreeWithScalar) {
  EXPECT_EQ(simd::exp(-100.0f), 0.0f);
  EXPECT_EQ(simd::exp(-1e30f), 0.0f);
  simd::f8 v = {-3.0f, -1.0f, 0.0f, 0.5f, 1.0f, 2.0f, -90.0f, 10.0f};
  const simd::f8 e = simd::exp(v);
  for (int l = 0; l < 8; ++l) EXPECT_EQ(e[l], simd::exp(v[l])) << "lane " << l;
  EXPECT_EQ(e[6], 0.0f);
}

// Lanes beyond float's range overflow to +inf like std::exp (they once saturated at e^88.3, so
// SiLU of a very negative number was not 0), and NaN stays NaN.
TEST(Simd, ExpOverflowsToInfinityLikeStdExp) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {88.8f, 100.0f, 1e30f, inf}) EXPECT_EQ(simd::exp(x), inf) << x;
  const simd::f8 v = {88.8f, 1e30f, 0.0f, -1e30f, 88.0f, inf, -inf, 1.0f};
  const simd::f8 e = simd::exp(v);
  for (int l = 0; l < 8; ++l) EXPECT_EQ(e[l], simd::exp(v[l])) << "lane " << l;
  EXPECT_TRUE(std::isnan(simd::exp(simd::splat(std::nanf("")))[0]));
}

// The kernels built on these helpers at extreme magnitudes: SiLU of very negative inputs is 0 in
// every lane, a length's last n mod 8 values included; RMSNorm of a row whose squares overflow float is ±g (it
// once came out all zeros).
TEST(Simd, SiluAndRmsnormAtExtremeMagnitudes) {
  std::vector<float> z(17, -1e30f), out(17, 1.0f);
  silu_forward(ExecCtx{}, Tensor(out.data(), {17}), Tensor(z.data(), {17}));
  for (int i = 0; i < 17; ++i) EXPECT_EQ(out[size_t(i)], 0.0f) << i;
  const int D = 33;
  std::vector<float> x(D, 3e19f), g(D, 2.0f), y(D);
  x[5] = -3e19f;
  rmsnorm_forward(ExecCtx{}, Tensor(y.data(), {1, D}), Tensor{}, Tensor(x.data(), {1, D}),
                  Tensor(g.data(), {D}), 1e-5f);
  for (int d = 0; d < D; ++d) EXPECT_NEAR(y[size_t(d)], d == 5 ? -2.0f : 2.0f, 1e-5) << d;
}

TEST(Simd, DotAndExpSumsMatchPlainLoopsForEveryTail) {
  Rng rng(3);
  std::vector<int> lengths;
  for (int n = 0; n <= 41; ++n) lengths.push_back(n);
  for (int n : {511, 512, 513, 1500}) lengths.push_back(n);  // across float accumulation chunks
  for (int n : lengths) {
    std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
    for (float& x : a) x = float(rng.normal());
    for (float& x : b) x = float(rng.normal());
    double d = 0, s = 0;
    for (int i = 0; i < n; ++i) d += double(a[i]) * b[i], s += std::exp(double(a[i]) - 0.5);
    EXPECT_NEAR(simd::dot(a.data(), b.data(), n), d, 1e-5 * (1 + std::abs(d))) << n;
    EXPECT_NEAR(simd::sum_exp_shifted(a.data(), n, 0.5f), s, 1e-6 * (1 + s)) << n;
    std::vector<float> e = a;
    EXPECT_NEAR(simd::exp_shifted(e.data(), n, 0.5f), s, 1e-6 * (1 + s)) << n;
    for (int i = 0; i < n; ++i) {
      const double want = std::exp(double(a[size_t(i)]) - 0.5);
      EXPECT_NEAR(e[size_t(i)], want, 3e-7 * want) << n;
    }
  }
}

// SiLU and SwiGLU work over the flat [N, F] buffer: a row's bits must be the same whatever N is
// (the engine's batch invariance), also for widths that are not a multiple of the vector width,
// and stay within 2 ulp-ish of the scalar formula.
TEST(Simd, SiluRowsHaveTheSameBitsWhateverTheRowCount) {
  Rng rng(11);
  for (int F : {1, 3, 7, 8, 9, 13, 300, 4099}) {
    const int N = 5;
    std::vector<float> gate(size_t(N) * F), up(gate.size());
    for (float& x : gate) x = float(3 * rng.normal());
    for (float& x : up) x = float(rng.normal());
    std::vector<float> all_silu(gate.size()), all_swiglu(gate.size());
    silu_forward(ExecCtx{}, Tensor(all_silu.data(), {N, F}), Tensor(gate.data(), {N, F}));
    swiglu_forward(ExecCtx{}, Tensor(all_swiglu.data(), {N, F}), Tensor(gate.data(), {N, F}),
                   Tensor(up.data(), {N, F}));
    for (int rows = 1; rows <= N; ++rows) {
      std::vector<float> s(size_t(rows) * F), w(s.size());
      silu_forward(ExecCtx{}, Tensor(s.data(), {rows, F}), Tensor(gate.data(), {rows, F}));
      swiglu_forward(ExecCtx{}, Tensor(w.data(), {rows, F}), Tensor(gate.data(), {rows, F}),
                     Tensor(up.data(), {rows, F}));
      for (size_t i = 0; i < s.size(); ++i) {
        ASSERT_EQ(std::memcmp(&s[i], &all_silu[i], 4), 0) << "F=" << F << " rows=" << rows << " i=" << i;
        ASSERT_EQ(std::memcmp(&w[i], &all_swiglu[i], 4), 0) << "F=" << F << " rows=" << rows << " i=" << i;
      }
    }
    for (size_t i = 0; i < gate.size(); ++i) {
      const double z = gate[i], want = z / (1 + std::exp(-z));
      EXPECT_NEAR(all_silu[i], want, 1e-6 * (1 + std::abs(want))) << F << " " << i;
      EXPECT_NEAR(all_swiglu[i], want * up[i], 1e-6 * (1 + std::abs(want * up[i]))) << F << " " << i;
    }
  }
}

}  // namespace
}  // namespace cemlm
