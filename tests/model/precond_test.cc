// The preconditioner (kernels/cpu/precond.cc) against MODEL.md §4.3 evaluated in double:
// P(u) = softplus(p) ⊙ u + P_u (P_vᵀ u) + P_v (P_uᵀ u), for the packed form the engine applies
// at every recursion step and for the one-call form the trainer uses, over one row (the decode
// products' one-row path), few rows and many, widths off the 32-column panels, and large p
// (softplus's linear branch).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "cemlm/engine/params.h"
#include "cemlm/kernels/precond.h"

namespace cemlm {
namespace {

class PrecondTest : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(PrecondTest, PackedAndOneCallMatchTheFormula) {
  const auto [N, D, r] = GetParam();
  Rng rng(uint64_t(N * 100 + D * 10 + r));
  std::vector<float> u(size_t(N) * D), p(static_cast<size_t>(D)), Pu(size_t(D) * r), Pv(size_t(D) * r);
  for (float& x : u) x = float(rng.normal());
  for (int d = 0; d < D; ++d) p[size_t(d)] = d % 7 == 0 ? 25.0f + float(d % 3) : float(rng.normal());
  for (float& x : Pu) x = float(0.3 * rng.normal());
  for (float& x : Pv) x = float(0.3 * rng.normal());
  std::vector<double> want(size_t(N) * D);
  for (int i = 0; i < N; ++i) {
    const float* ui = u.data() + size_t(i) * D;
    std::vector<double> a(static_cast<size_t>(r)), b(static_cast<size_t>(r));  // P_vᵀ u, P_uᵀ u
    for (int c = 0; c < r; ++c)
      for (int d = 0; d < D; ++d) {
        a[size_t(c)] += double(Pv[size_t(d) * r + c]) * ui[d];
        b[size_t(c)] += double(Pu[size_t(d) * r + c]) * ui[d];
      }
    for (int d = 0; d < D; ++d) {
      double v = std::log1p(std::exp(double(p[size_t(d)]))) * ui[d];
      for (int c = 0; c < r; ++c)
        v += double(Pu[size_t(d) * r + c]) * a[size_t(c)] + double(Pv[size_t(d) * r + c]) * b[size_t(c)];
      want[size_t(i) * D + d] = v;
    }
  }
  const Tensor tp(p.data(), {D}), tu(Pu.data(), {D, r}), tv(Pv.data(), {D, r});
  const PackedPrecond packed(tp, tu, tv);
  std::vector<float> scratch(size_t(2) * N * r);
  ExecCtx ctx;
  ctx.scratch = scratch.data();
  ctx.scratch_floats = int64_t(scratch.size());
  for (bool one_call : {false, true}) {
    std::vector<float> out(size_t(N) * D, std::nanf(""));
    if (one_call)
      precond_forward(ctx, Tensor(out.data(), {N, D}), Tensor(u.data(), {N, D}), tp, tu, tv);
    else
      precond_forward(ctx, Tensor(out.data(), {N, D}), Tensor(u.data(), {N, D}), packed);
    for (size_t k = 0; k < out.size(); ++k)
      ASSERT_NEAR(out[k], want[k], 1e-5 * (1 + std::abs(want[k])))
          << (one_call ? "one call" : "packed") << ", element " << k;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, PrecondTest,
                         ::testing::Values(std::tuple{1, 256, 8}, std::tuple{3, 37, 3},
                                           std::tuple{32, 256, 8}, std::tuple{17, 100, 16},
                                           std::tuple{300, 64, 1}),
                         [](const auto& info) {
                           return "n" + std::to_string(std::get<0>(info.param)) + "_d" +
                                  std::to_string(std::get<1>(info.param)) + "_r" +
                                  std::to_string(std::get<2>(info.param));
                         });

}  // namespace
}  // namespace cemlm
