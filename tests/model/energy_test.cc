// The CEM updates are gradient steps (MODEL.md §4.2, §5.2): the direction the ops compute equals
// −∇ of the stated energy, checked by central finite differences on an energy written here
// directly from the formulas (double precision, rotation by its definition).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "cemlm/engine/params.h"
#include "cemlm/kernels/attention.h"
#include "cemlm/kernels/elementwise.h"
#include "cemlm/kernels/linear.h"
#include "cemlm/kernels/rope.h"

namespace cemlm {
namespace {

constexpr int D = 8, H = 2, dh = 4, Q = H * dh, NCTX = 5;
constexpr float kTheta = 10000.0f;

std::vector<float> randn(size_t n, Rng& rng, double s = 0.5) {
  std::vector<float> v(n);
  for (float& x : v) x = float(rng.normal() * s);
  return v;
}

// R_p applied to one head vector, from MODEL.md §2.
std::vector<double> rotate(const std::vector<double>& v, int p) {
  std::vector<double> o(dh);
  for (int m = 0; m < dh / 2; ++m) {
    const double th = std::pow(double(kTheta), -2.0 * m / dh), c = std::cos(p * th), s = std::sin(p * th);
    o[m] = v[m] * c - v[m + dh / 2] * s;
    o[m + dh / 2] = v[m + dh / 2] * c + v[m] * s;
  }
  return o;
}

struct AttnSetup {
  std::vector<float> wq, wk, ctx, d;  // ctx: [NCTX, D]; d: [D] shared or [H, D] per head
  DiagKind diag;
};

// E_i(y) = −τ Σ_k log Σ_{j≤i} exp(yᵀ A_k c_j / τ) for the query at position i = NCTX − 1.
double attn_energy(const AttnSetup& s, const std::vector<double>& y) {
  const double tau = std::sqrt(double(dh));
  const int i = NCTX - 1;
  double E = 0;
  for (int k = 0; k < H; ++k) {
    std::vector<double> qh(dh, 0);
    for (int a = 0; a < dh; ++a)
      for (int e = 0; e < D; ++e) qh[a] += s.wq[(k * dh + a) * D + e] * y[e];
    qh = rotate(qh, i);
    std::vector<double> sc(NCTX);
    double mx = -1e300;
    for (int j = 0; j < NCTX; ++j) {
      std::vector<double> kh(dh, 0);
      for (int a = 0; a < dh; ++a)
        for (int e = 0; e < D; ++e) kh[a] += s.wk[(k * dh + a) * D + e] * s.ctx[j * D + e];
      kh = rotate(kh, j);
      double v = 0;
      for (int a = 0; a < dh; ++a) v += qh[a] * kh[a];
      if (s.diag != DiagKind::kNone) {
        const float* dk = s.d.data() + (s.diag == DiagKind::kPerHead ? k * D : 0);
        for (int e = 0; e < D; ++e) v += dk[e] * y[e] * s.ctx[j * D + e];
      }
      sc[j] = v / tau;
      mx = std::max(mx, sc[j]);
    }
    double z = 0;
    for (double v : sc) z += std::exp(v - mx);
    E += -tau * (mx + std::log(z));
  }
  return E;
}

// u = W_Qᵀ concat_k(R_iᵀ Σ_j p κ_j) + ω, computed with the engine's ops as the model does.
std::vector<float> attn_update(const AttnSetup& s, const std::vector<float>& y) {
  std::vector<float> rope_tab(NCTX * dh), keys(NCTX * Q), kpool(NCTX * Q), cpool(NCTX * D);
  KvLayerView kv{kpool.data(), nullptr, s.diag == DiagKind::kNone ? nullptr : cpool.data(), NCTX, H, Q, D};
  const int32_t block = 0;
  AttnSeq all{0, NCTX, 0, &block};
  AttnSeq one{0, 1, NCTX - 1, &block};
  ExecCtx ctx;
  std::vector<float> scratch(paged_attention_scratch_floats(&one, 1, kv, s.diag));
  ctx.scratch = scratch.data();
  ctx.scratch_floats = int64_t(scratch.size());
  Tensor tab(rope_tab.data(), {NCTX, dh});
  rope_table_init(tab, kTheta);
  std::vector<int32_t> pos(NCTX);
  for (int j = 0; j < NCTX; ++j) pos[j] = j;
  const Tensor ctx_t(const_cast<float*>(s.ctx.data()), {NCTX, D});
  const Tensor wq(const_cast<float*>(s.wq.data()), {Q, D}), wk(const_cast<float*>(s.wk.data()), {Q, D});
  linear_forward(ctx, Tensor(keys.data(), {NCTX, Q}), ctx_t, wk);
  rope_forward(ctx, Tensor(keys.data(), {NCTX, Q}), Tensor(keys.data(), {NCTX, Q}), pos.data(), tab, false);
  kv_write(ctx, kv, &all, 1, Tensor(keys.data(), {NCTX, Q}), Tensor{}, ctx_t);
  // One query row at the last position.
  std::vector<float> q(Q), a(Q), u(D), qd(H * D), oc(H * D);
  int32_t qpos = NCTX - 1;
  Tensor yt(const_cast<float*>(y.data()), {1, D}), qt(q.data(), {1, Q}), at(a.data(), {1, Q});
  linear_forward(ctx, qt, yt, wq);
  rope_forward(ctx, qt, qt, &qpos, tab, false);
  const int64_t w = s.diag == DiagKind::kPerHead ? H * D : D;
  Tensor dt(const_cast<float*>(s.d.data()), {int64_t(s.d.size())});
  if (s.diag != DiagKind::kNone) diag_scale_forward(ctx, Tensor(qd.data(), {1, w}), yt, dt);
  paged_attention_forward(ctx, at, s.diag == DiagKind::kNone ? Tensor{} : Tensor(oc.data(), {1, w}),
                          qt, s.diag == DiagKind::kNone ? Tensor{} : Tensor(qd.data(), {1, w}),
                          s.diag, kv, &one, 1, 1.0f / std::sqrt(float(dh)));
  rope_forward(ctx, at, at, &qpos, tab, true);
  linear_t_forward(ctx, Tensor(u.data(), {1, D}), at, wq);
  if (s.diag != DiagKind::kNone) diag_gather_forward(ctx, Tensor(u.data(), {1, D}), Tensor(oc.data(), {1, w}), dt);
  return u;
}

class AttnEnergy : public ::testing::TestWithParam<DiagKind> {};

TEST_P(AttnEnergy, UpdateIsNegativeGradient) {
  Rng rng(42);
  AttnSetup s;
  s.diag = GetParam();
  s.wq = randn(Q * D, rng);
  s.wk = randn(Q * D, rng);
  s.ctx = randn(NCTX * D, rng, 1.0);
  s.d = randn(s.diag == DiagKind::kPerHead ? H * D : D, rng);
  const std::vector<float> y = randn(D, rng, 1.0);
  const std::vector<float> u = attn_update(s, y);
  const double h = 1e-5;
  for (int m = 0; m < D; ++m) {
    std::vector<double> yp(y.begin(), y.end()), ym(y.begin(), y.end());
    yp[m] += h;
    ym[m] -= h;
    const double g = -(attn_energy(s, yp) - attn_energy(s, ym)) / (2 * h);
    EXPECT_NEAR(u[m], g, 1e-4 * std::max(1.0, std::fabs(g))) << "coordinate " << m;
  }
}

INSTANTIATE_TEST_SUITE_P(Diag, AttnEnergy,
                         ::testing::Values(DiagKind::kNone, DiagKind::kShared, DiagKind::kPerHead));

TEST(MlpEnergy, UpdateIsNegativeGradient) {
  constexpr int F = 12;
  Rng rng(9);
  const auto wup = randn(F * D, rng), gate = randn(F, rng), y = randn(D, rng, 1.0);
  ExecCtx ctx;
  std::vector<float> z(F), u(D);
  Tensor W(const_cast<float*>(wup.data()), {F, D}), zt(z.data(), {1, F});
  linear_forward(ctx, zt, Tensor(const_cast<float*>(y.data()), {1, D}), W);
  mul_forward(ctx, zt, zt, Tensor(const_cast<float*>(gate.data()), {1, F}));
  linear_t_forward(ctx, Tensor(u.data(), {1, D}), zt, W);
  auto energy = [&](const std::vector<double>& yy) {  // −½ Σ_m g_m (W_up y)_m²
    double E = 0;
    for (int m = 0; m < F; ++m) {
      double a = 0;
      for (int e = 0; e < D; ++e) a += wup[m * D + e] * yy[e];
      E -= 0.5 * gate[m] * a * a;
    }
    return E;
  };
  for (int m = 0; m < D; ++m) {
    std::vector<double> yp(y.begin(), y.end()), ym(y.begin(), y.end());
    yp[m] += 1e-5;
    ym[m] -= 1e-5;
    const double g = -(energy(yp) - energy(ym)) / 2e-5;
    EXPECT_NEAR(u[m], g, 1e-4 * std::max(1.0, std::fabs(g))) << "coordinate " << m;
  }
}

}  // namespace
}  // namespace cemlm
