// Per-op backward checks against finite differences: each op's objective is Σ r ⊙ out for a
// random r, differentiated along random directions of every input (grad_check.h). Covers the
// lead's RMSNorm backward, RoPE's inverse as its adjoint, attention (every diagonal mode, tied and
// separate values), the preconditioner, the LEV generator and the element-wise ops.
#include <omp.h>

#include <cstring>
#include <ostream>
#include <vector>

#include "cemlm/engine/params.h"
#include "cemlm/kernels/attention.h"
#include "cemlm/kernels/attention_grad.h"
#include "cemlm/kernels/elementwise.h"
#include "cemlm/kernels/elementwise_grad.h"
#include "cemlm/kernels/lev.h"
#include "cemlm/kernels/lev_grad.h"
#include "cemlm/kernels/precond.h"
#include "cemlm/kernels/precond_grad.h"
#include "cemlm/kernels/rmsnorm.h"
#include "cemlm/kernels/rope.h"
#include "grad_check.h"
#include "gtest/gtest.h"

namespace cemlm {
namespace {

using grad_check::dot;
using grad_check::expect_directional;
using grad_check::randn;

constexpr double kH = 1e-2, kRel = 2e-3, kAbs = 2e-4;

Tensor t2(std::vector<float>& v, int64_t r, int64_t c) { return Tensor(v.data(), {r, c}); }
Tensor t1(std::vector<float>& v) { return Tensor(v.data(), {int64_t(v.size())}); }

ExecCtx ctx_with(std::vector<float>& scratch) {
  ExecCtx ctx;
  ctx.scratch = scratch.data();
  ctx.scratch_floats = int64_t(scratch.size());
  return ctx;
}

TEST(OpsGrad, RmsNorm) {
  Rng rng(1);
  const int N = 3, D = 8;
  auto x = randn(N * D, rng), g = randn(D, rng, 0.3, 1.0), r = randn(N * D, rng);
  std::vector<float> out(N * D), rstd(N), dx(N * D), dg(D, 0.0f);
  auto f = [&] {
    rmsnorm_forward(ExecCtx{}, t2(out, N, D), Tensor{}, t2(x, N, D), t1(g), 1e-5f);
    return dot(out, r);
  };
  rmsnorm_forward(ExecCtx{}, t2(out, N, D), t1(rstd), t2(x, N, D), t1(g), 1e-5f);
  rmsnorm_backward(ExecCtx{}, t2(dx, N, D), t1(dg), t2(r, N, D), t2(x, N, D), t1(g), t1(rstd));
  expect_directional("x", f, x.data(), dx, rng, kH, kRel, kAbs);
  expect_directional("gain", f, g.data(), dg, rng, kH, kRel, kAbs);
}

// The backward of a rotation is the inverse rotation (R_pᵀ = R_{−p}), which the trainer uses.
TEST(OpsGrad, RopeInverseIsTheAdjoint) {
  Rng rng(2);
  const int N = 3, dh = 8, W = 2 * dh;
  std::vector<float> table(10 * dh), out(N * W), dx(N * W);
  rope_table_init(Tensor(table.data(), {10, dh}), 100.0f);
  const std::vector<int32_t> pos{0, 3, 9};
  auto x = randn(N * W, rng), r = randn(N * W, rng);
  for (bool inverse : {false, true}) {
    auto f = [&] {
      rope_forward(ExecCtx{}, t2(out, N, W), t2(x, N, W), pos.data(),
                   Tensor(table.data(), {10, dh}), inverse);
      return dot(out, r);
    };
    rope_forward(ExecCtx{}, t2(dx, N, W), t2(r, N, W), pos.data(), Tensor(table.data(), {10, dh}),
                 !inverse);
    expect_directional(inverse ? "inverse" : "forward", f, x.data(), dx, rng, kH, kRel, kAbs);
  }
}

struct AttnCase {
  const char* name;
  DiagKind diag;
  bool values_are_keys;
};
void PrintTo(const AttnCase& c, std::ostream* os) { *os << c.name; }

class AttentionGrad : public testing::TestWithParam<AttnCase> {};

TEST_P(AttentionGrad, MatchesFiniteDifferences) {
  const AttnCase ac = GetParam();
  Rng rng(3);
  const int S = 2, L = 9, H = 2, dh = 4, W = H * dh, D = 6, M = S * L;  // L ≥ 8: the sgemm path
  const bool diag = ac.diag != DiagKind::kNone;
  const int qdw = ac.diag == DiagKind::kPerHead ? H * D : D;
  const float scale = 0.7f;
  auto q = randn(M * W, rng), k = randn(M * W, rng), v = randn(M * W, rng), c = randn(M * D, rng);
  auto qd = randn(M * qdw, rng, 0.5), r = randn(M * W, rng), rc = randn(M * qdw, rng);
  std::vector<float> out(M * W), oc(M * qdw);
  const std::vector<int32_t> blocks{0, 1};
  const AttnSeq seqs[2] = {{0, L, 0, &blocks[0]}, {L, L, 0, &blocks[1]}};
  const KvLayerView kv{
      k.data(), ac.values_are_keys ? nullptr : v.data(), diag ? c.data() : nullptr, L, H, W, D};
  std::vector<float> fwd_scratch(paged_attention_scratch_floats(seqs, 2, kv, ac.diag));
  auto f = [&] {
    paged_attention_forward(ctx_with(fwd_scratch), t2(out, M, W), diag ? t2(oc, M, qdw) : Tensor{},
                            t2(q, M, W), diag ? t2(qd, M, qdw) : Tensor{}, ac.diag, kv, seqs, 2,
                            scale);
    return dot(out, r) + (diag ? dot(oc, rc) : 0.0);
  };
  std::vector<float> dq(M * W), dqd(M * qdw), dk(M * W, 0.0f), dv(M * W, 0.0f), dc(M * D, 0.0f);
  std::vector<float> scratch(attention_backward_scratch(ac.diag, L));
  const AttnTensors grad{t2(dq, M, W), diag ? t2(dqd, M, qdw) : Tensor{}, t2(dk, M, W),
                         t2(dv, M, W), diag ? t2(dc, M, D) : Tensor{}};
  const AttnTensors in{t2(q, M, W), diag ? t2(qd, M, qdw) : Tensor{}, t2(k, M, W),
                       ac.values_are_keys ? Tensor{} : t2(v, M, W), diag ? t2(c, M, D) : Tensor{}};
  attention_backward(ctx_with(scratch), grad, t2(r, M, W), diag ? t2(rc, M, qdw) : Tensor{}, in,
                     ac.diag, H, L, scale);
  expect_directional("q", f, q.data(), dq, rng, kH, kRel, kAbs);
  expect_directional("k", f, k.data(), dk, rng, kH, kRel, kAbs);
  if (!ac.values_are_keys) expect_directional("v", f, v.data(), dv, rng, kH, kRel, kAbs);
  if (diag) {
    expect_directional("qd", f, qd.data(), dqd, rng, kH, kRel, kAbs);
    expect_directional("c", f, c.data(), dc, rng, kH, kRel, kAbs);
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, AttentionGrad,
                         testing::Values(AttnCase{"standard", DiagKind::kNone, false},
                                         AttnCase{"cem_none", DiagKind::kNone, true},
                                         AttnCase{"cem_shared", DiagKind::kShared, true},
                                         AttnCase{"cem_per_head", DiagKind::kPerHead, true},
                                         AttnCase{"separate_values_shared", DiagKind::kShared,
                                                  false}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(OpsGrad, Preconditioner) {
  Rng rng(4);
  const int N = 4, D = 6, R = 2;
  auto u = randn(N * D, rng), p = randn(D, rng, 0.5, 0.5), Pu = randn(D * R, rng, 0.5),
       Pv = randn(D * R, rng, 0.5), r = randn(N * D, rng);
  std::vector<float> out(N * D), du(N * D), dp(D, 0.0f), dPu(D * R, 0.0f), dPv(D * R, 0.0f);
  std::vector<float> scratch(4 * N * R);
  auto f = [&] {
    precond_forward(ctx_with(scratch), t2(out, N, D), t2(u, N, D), t1(p), t2(Pu, D, R),
                    t2(Pv, D, R));
    return dot(out, r);
  };
  precond_backward(ctx_with(scratch), t2(du, N, D), t1(dp), t2(dPu, D, R), t2(dPv, D, R),
                   t2(r, N, D), t2(u, N, D), t1(p), t2(Pu, D, R), t2(Pv, D, R));
  expect_directional("u", f, u.data(), du, rng, kH, kRel, kAbs);
  expect_directional("p", f, p.data(), dp, rng, kH, kRel, kAbs);
  expect_directional("P_u", f, Pu.data(), dPu, rng, kH, kRel, kAbs);
  expect_directional("P_v", f, Pv.data(), dPv, rng, kH, kRel, kAbs);
}

TEST(OpsGrad, LevBasisSlopes) {
  const int kn = 5;
  std::vector<float> w(kn), ref(kn), slope(kn), up(kn), down(kn);
  for (float zeta : {0.01f, 0.1f, 0.2f, 0.37f, 0.5f, 0.62f, 0.9f, 0.99f}) {
    lev_basis(zeta, kn, ref.data());
    lev_basis_grad(zeta, kn, w.data(), slope.data());
    const float h = 1e-3f;
    lev_basis(zeta + h, kn, up.data());
    lev_basis(zeta - h, kn, down.data());
    for (int q = 0; q < kn; ++q) {
      EXPECT_NEAR(w[q], ref[q], 1e-6) << "zeta " << zeta << " q " << q;
      EXPECT_NEAR(slope[q], (up[q] - down[q]) / (2 * h), 2e-2 * std::abs(slope[q]) + 2e-3)
          << "zeta " << zeta << " q " << q;
    }
  }
}

TEST(OpsGrad, Lev) {
  Rng rng(5);
  const int k = 2, b = 4, s = 3, kn = 5, R = 2, nh = 2, D = 5;
  auto code = randn(k * b * s, rng, 0.5), seed = randn(nh * s * s, rng, 0.5),
       lnw = randn(nh * s, rng, 0.2, 1.0), lnb = randn(nh * s, rng, 0.3),
       spline = randn(nh * s * kn * R, rng, 0.3, 1.0), outp = randn(nh * R * D, rng, 0.5);
  const std::vector<int32_t> ids{0, 5, 15, 5, 9, 6};
  const int N = int(ids.size());
  auto r = randn(N * D, rng);
  auto views = [&](std::vector<float>* v) {
    return LevWeights{Tensor(v[0].data(), {k, b, s}),      Tensor(v[1].data(), {nh, s, s}),
                      Tensor(v[2].data(), {nh, s}),        Tensor(v[3].data(), {nh, s}),
                      Tensor(v[4].data(), {nh, s, kn, R}), Tensor(v[5].data(), {nh, R, D})};
  };
  std::vector<float> w[6] = {code, seed, lnw, lnb, spline, outp};
  std::vector<float> g[6];
  for (int i = 0; i < 6; ++i) g[i].assign(w[i].size(), 0.0f);
  std::vector<float> out(N * D), scratch(N * nh * R);
  auto f = [&] {
    lev_forward(ExecCtx{}, t2(out, N, D), ids.data(), views(w));
    return dot(out, r);
  };
  lev_backward(ctx_with(scratch), views(g), t2(r, N, D), ids.data(), views(w));
  const char* names[6] = {"codebooks", "seed_proj", "ln_weight", "ln_bias", "spline", "out_proj"};
  for (int i = 0; i < 6; ++i)
    expect_directional(names[i], f, w[i].data(), g[i], rng, kH, kRel, kAbs);
}

// A coordinate whose sigmoid saturates (ζ = 1 in float from y ≈ 16.6 on) keeps its gradient: the
// slope ζ(1 − ζ) taken from the float ζ was exactly 0 there (and 100–200% off from y ≈ 16).
// σ'(y) = σ'(−y): its ln_bias gradient has the size of e^{−y} times the chain's other factors.
TEST(OpsGrad, LevSaturatedSigmoidKeepsItsGradient) {
  Rng rng(6);
  const int k = 2, b = 4, s = 3, kn = 5, R = 2, nh = 1, D = 5;
  auto code = randn(k * b * s, rng, 0.5), seed = randn(nh * s * s, rng, 0.5),
       lnw = std::vector<float>(nh * s, 0.0f), spline = randn(nh * s * kn * R, rng, 0.3, 1.0),
       outp = randn(nh * R * D, rng, 0.5);
  const std::vector<int32_t> ids{3};
  auto r = randn(D, rng);
  for (float bias : {18.0f, 30.0f}) {
    auto lnb = std::vector<float>(nh * s, bias);  // y = bias exactly (ln_weight 0)
    std::vector<float> w[6] = {code, seed, lnw, lnb, spline, outp}, g[6];
    for (int i = 0; i < 6; ++i) g[i].assign(w[i].size(), 0.0f);
    std::vector<float> scratch(nh * R);
    lev_backward(ctx_with(scratch),
                 LevWeights{Tensor(g[0].data(), {k, b, s}), Tensor(g[1].data(), {nh, s, s}),
                            Tensor(g[2].data(), {nh, s}), Tensor(g[3].data(), {nh, s}),
                            Tensor(g[4].data(), {nh, s, kn, R}), Tensor(g[5].data(), {nh, R, D})},
                 t2(r, 1, D), ids.data(),
                 LevWeights{Tensor(w[0].data(), {k, b, s}), Tensor(w[1].data(), {nh, s, s}),
                            Tensor(w[2].data(), {nh, s}), Tensor(w[3].data(), {nh, s}),
                            Tensor(w[4].data(), {nh, s, kn, R}), Tensor(w[5].data(), {nh, R, D})});
    for (int e = 0; e < s; ++e) {
      EXPECT_TRUE(std::isfinite(g[3][e])) << bias;
      EXPECT_NE(g[3][e], 0.0f) << "ln_bias[" << e << "] at y = " << bias;
      EXPECT_LT(std::abs(g[3][e]), 1e3 * std::exp(-bias)) << "ln_bias[" << e << "]";
    }
  }
}

// The gradients' bits do not depend on the thread count (a run resumed on another machine goes
// on as it would have): tokens are summed in fixed spans, then the spans in order.
TEST(OpsGrad, LevSameBitsOnAnyThreadCount) {
  Rng rng(9);
  const int k = 2, b = 8, s = 4, kn = 5, R = 3, nh = 2, D = 6, N = 203;
  std::vector<float> w[6] = {randn(k * b * s, rng, 0.5),
                             randn(nh * s * s, rng, 0.5),
                             randn(nh * s, rng, 0.2, 1.0),
                             randn(nh * s, rng, 0.3),
                             randn(nh * s * kn * R, rng, 0.3, 1.0),
                             randn(nh * R * D, rng, 0.5)};
  auto views = [&](std::vector<float>* v) {
    return LevWeights{Tensor(v[0].data(), {k, b, s}),      Tensor(v[1].data(), {nh, s, s}),
                      Tensor(v[2].data(), {nh, s}),        Tensor(v[3].data(), {nh, s}),
                      Tensor(v[4].data(), {nh, s, kn, R}), Tensor(v[5].data(), {nh, R, D})};
  };
  std::vector<int32_t> ids(N);
  for (int i = 0; i < N; ++i) ids[i] = int32_t(rng.next_u64() % (b * b));
  auto r = randn(N * D, rng);
  std::vector<float> scratch(N * nh * R);
  auto grads = [&](int threads) {
    const int before = omp_get_max_threads();
    omp_set_num_threads(threads);
    std::vector<std::vector<float>> g(6);
    std::vector<float> gv[6];
    for (int i = 0; i < 6; ++i) gv[i].assign(w[i].size(), 0.0f);
    lev_backward(ctx_with(scratch), views(gv), t2(r, N, D), ids.data(), views(w));
    omp_set_num_threads(before);
    for (int i = 0; i < 6; ++i) g[i] = gv[i];
    return g;
  };
  const auto one = grads(1);
  for (int threads : {2, 3, 7}) {
    const auto many = grads(threads);
    for (int i = 0; i < 6; ++i)
      EXPECT_EQ(0, std::memcmp(one[i].data(), many[i].data(), sizeof(float) * one[i].size()))
          << "tensor " << i << " with " << threads << " threads";
  }
}

TEST(OpsGrad, SiluAndSwiglu) {
  Rng rng(6);
  const int n = 20;
  auto a = randn(n, rng, 2.0), up = randn(n, rng), r = randn(n, rng);
  std::vector<float> out(n), da(n), dgate(n), dup(n);
  auto silu = [&] {
    silu_forward(ExecCtx{}, t1(out), t1(a));
    return dot(out, r);
  };
  silu_backward(ExecCtx{}, t1(da), t1(r), t1(a));
  expect_directional("silu", silu, a.data(), da, rng, kH, kRel, kAbs);
  auto swiglu = [&] {
    swiglu_forward(ExecCtx{}, t1(out), t1(a), t1(up));
    return dot(out, r);
  };
  swiglu_backward(ExecCtx{}, t1(dgate), t1(dup), t1(r), t1(a), t1(up));
  expect_directional("gate", swiglu, a.data(), dgate, rng, kH, kRel, kAbs);
  expect_directional("up", swiglu, up.data(), dup, rng, kH, kRel, kAbs);
}

TEST(OpsGrad, MulAccumulates) {
  Rng rng(7);
  const int n = 12;
  auto a = randn(n, rng), b = randn(n, rng), r = randn(n, rng);
  std::vector<float> out(n), da(n, 1.0f);
  auto f = [&] {
    mul_forward(ExecCtx{}, t1(out), t1(a), t1(b));
    return dot(out, r);
  };
  mul_backward(ExecCtx{}, t1(da), t1(r), t1(b));
  for (float& x : da) x -= 1.0f;  // it added to what was there
  expect_directional("a", f, a.data(), da, rng, kH, kRel, kAbs);
}

class DiagGrad : public testing::TestWithParam<bool> {};

TEST_P(DiagGrad, ScaleAndGather) {
  const bool per_head = GetParam();
  Rng rng(8);
  const int N = 3, H = per_head ? 2 : 1, D = 5;
  auto y = randn(N * D, rng), d = randn(H * D, rng), oc = randn(N * H * D, rng);
  auto rq = randn(N * H * D, rng), ru = randn(N * D, rng);
  const Tensor dview = per_head ? Tensor(d.data(), {H, D}) : Tensor(d.data(), {D});
  std::vector<float> qd(N * H * D), u(N * D), dy(N * D, 0.0f), dd(H * D, 0.0f), doc(N * H * D),
      dd2(H * D, 0.0f);
  auto scale = [&] {
    diag_scale_forward(ExecCtx{}, Tensor(qd.data(), {N, H * D}), t2(y, N, D), dview);
    return dot(qd, rq);
  };
  diag_scale_backward(ExecCtx{}, t2(dy, N, D), Tensor(dd.data(), {H * D}),
                      Tensor(rq.data(), {N, H * D}), t2(y, N, D), dview);
  expect_directional("scale: y", scale, y.data(), dy, rng, kH, kRel, kAbs);
  expect_directional("scale: d", scale, d.data(), dd, rng, kH, kRel, kAbs);
  auto gather = [&] {
    std::fill(u.begin(), u.end(), 0.0f);
    diag_gather_forward(ExecCtx{}, t2(u, N, D), Tensor(oc.data(), {N, H * D}), dview);
    return dot(u, ru);
  };
  diag_gather_backward(ExecCtx{}, Tensor(doc.data(), {N, H * D}), Tensor(dd2.data(), {H * D}),
                       t2(ru, N, D), Tensor(oc.data(), {N, H * D}), dview);
  expect_directional("gather: oc", gather, oc.data(), doc, rng, kH, kRel, kAbs);
  expect_directional("gather: d", gather, d.data(), dd2, rng, kH, kRel, kAbs);
}

INSTANTIATE_TEST_SUITE_P(Modes, DiagGrad, testing::Bool(),
                         [](const auto& info) { return info.param ? "per_head" : "shared"; });

}  // namespace
}  // namespace cemlm
