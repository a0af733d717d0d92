// CPU LEV backward: one token per work item recomputes the forward intermediates, then walks them
// back; small parameter gradients accumulate in the copies of a fixed number of token spans
// (whichever thread runs a span) summed in span order, so the bits do not depend on the thread
// count, and the output projection's gradient is one sgemm over the products M saved in scratch.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cemlm/kernels/lev_grad.h"
#include "cemlm/kernels/linear.h"

namespace cemlm {
namespace {

// B2(x) and B2'(x) of MODEL.md §6.2.
inline void b2_with_slope(float x, float* v, float* dv) {
  const float a = std::fabs(x);
  if (a < 0.5f) {
    *v = 0.75f - x * x;
    *dv = -2.0f * x;
  } else if (a < 1.5f) {
    *v = 0.5f * (1.5f - a) * (1.5f - a);
    *dv = (x > 0 ? -1.0f : 1.0f) * (1.5f - a);
  } else {
    *v = *dv = 0.0f;
  }
}

struct LevDims {
  int k, b, s, nh, kn, r, D;
  explicit LevDims(const LevWeights& w)
      : k(int(w.codebooks.dim(0))),
        b(int(w.codebooks.dim(1))),
        s(int(w.codebooks.dim(2))),
        nh(int(w.seed_proj.dim(0))),
        kn(int(w.spline.dim(2))),
        r(int(w.spline.dim(3))),
        D(int(w.out_proj.dim(2))) {}
};

// Gradient accumulators (all but the output projection's) of one span of tokens.
struct LevGrads {
  std::vector<double> g_code, g_seed, g_lnw, g_lnb, g_spline;
  explicit LevGrads(const LevDims& d)
      : g_code(size_t(d.k) * d.b * d.s),
        g_seed(size_t(d.nh) * d.s * d.s),
        g_lnw(size_t(d.nh) * d.s),
        g_lnb(size_t(d.nh) * d.s),
        g_spline(size_t(d.nh) * d.s * d.kn * d.r) {}
  void add(const LevGrads& o) {
    auto sum = [](std::vector<double>& a, const std::vector<double>& b) {
      for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
    };
    sum(g_code, o.g_code), sum(g_seed, o.g_seed), sum(g_lnw, o.g_lnw), sum(g_lnb, o.g_lnb),
        sum(g_spline, o.g_spline);
  }
};

// One thread's working memory.
struct LevThread {
  std::vector<float> z, dz, u, nrm, zeta, basis, slope, phi, pre, suf, dphi, dn, dM;
  std::vector<int> dig;
  explicit LevThread(const LevDims& d)
      : z(d.s),
        dz(d.s),
        u(d.s),
        nrm(d.s),
        zeta(d.s),
        basis(d.s * d.kn),
        slope(d.s * d.kn),
        phi(d.s * d.r),
        pre((d.s + 1) * d.r),
        suf(d.r),
        dphi(d.s * d.r),
        dn(d.s),
        dM(d.r),
        dig(d.k) {}
};

// Head l of one token: forward to M (written to m_out), then back from dM to dz (+=).
void head_backward(const LevDims& d, const LevWeights& w, int l, const float* dout, float* m_out,
                   LevThread& t, LevGrads& g) {
  const int s = d.s, kn = d.kn, r = d.r;
  const float* W = w.seed_proj.data + int64_t(l) * s * s;
  double mean = 0;
  for (int a = 0; a < s; ++a) {
    float acc = 0;
    for (int e = 0; e < s; ++e) acc += W[a * s + e] * t.z[e];
    t.u[a] = acc;
    mean += acc;
  }
  mean /= s;
  double var = 0;
  for (int a = 0; a < s; ++a) var += (t.u[a] - mean) * (t.u[a] - mean);
  const float rs = float(1.0 / std::sqrt(var / s + 1e-5));
  const float* gam = w.ln_weight.data + l * s;
  const float* S = w.spline.data + int64_t(l) * s * kn * r;
  std::fill(t.pre.begin(), t.pre.begin() + r, 1.0f);
  for (int e = 0; e < s; ++e) {
    t.nrm[e] = float(t.u[e] - mean) * rs;
    const float y = gam[e] * t.nrm[e] + w.ln_bias.data[l * s + e];
    t.zeta[e] = 1.0f / (1.0f + std::exp(-y));
    lev_basis_grad(t.zeta[e], kn, &t.basis[e * kn], &t.slope[e * kn]);
    for (int c = 0; c < r; ++c) {
      float phi = 0;
      for (int q = 0; q < kn; ++q) phi += t.basis[e * kn + q] * S[(e * kn + q) * r + c];
      t.phi[e * r + c] = phi;
      t.pre[(e + 1) * r + c] = t.pre[e * r + c] * phi;  // M = Π φ, in the forward's order
    }
  }
  std::copy(t.pre.begin() + s * r, t.pre.begin() + (s + 1) * r, m_out);
  const float* O = w.out_proj.data + int64_t(l) * r * d.D;
  for (int c = 0; c < r; ++c) {
    float acc = 0;
    for (int e = 0; e < d.D; ++e) acc += O[c * d.D + e] * dout[e];
    t.dM[c] = acc;
  }
  std::fill(t.suf.begin(), t.suf.end(), 1.0f);  // dφ[e,c] = dM[c] Π_{e'≠e} φ[e',c]
  for (int e = s - 1; e >= 0; --e)
    for (int c = 0; c < r; ++c) {
      t.dphi[e * r + c] = t.dM[c] * t.pre[e * r + c] * t.suf[c];
      t.suf[c] *= t.phi[e * r + c];
    }
  double dn_mean = 0, dn_nrm = 0;
  for (int e = 0; e < s; ++e) {
    double dzeta = 0;
    for (int q = 0; q < kn; ++q) {
      double dB = 0;
      double* gS = &g.g_spline[((int64_t(l) * s + e) * kn + q) * r];
      for (int c = 0; c < r; ++c) {
        gS[c] += double(t.basis[e * kn + q]) * t.dphi[e * r + c];
        dB += double(S[(e * kn + q) * r + c]) * t.dphi[e * r + c];
      }
      dzeta += dB * t.slope[e * kn + q];
    }
    // σ'(y) = ζ(1 − ζ), from y: a float ζ rounds to 1 from y ≈ 16.6 on, which zeroed it (and
    // 1 − ζ loses digits well before that).
    const double y = gam[e] * t.nrm[e] + w.ln_bias.data[l * s + e], ey = std::exp(-std::abs(y));
    const double dy = dzeta * ey / ((1.0 + ey) * (1.0 + ey));
    g.g_lnw[l * s + e] += dy * t.nrm[e];
    g.g_lnb[l * s + e] += dy;
    t.dn[e] = float(dy * gam[e]);
    dn_mean += t.dn[e];
    dn_nrm += double(t.dn[e]) * t.nrm[e];
  }
  dn_mean /= s;
  dn_nrm /= s;
  for (int a = 0; a < s; ++a) {  // LayerNorm: du = rs (dn − mean(dn) − n̂ mean(dn n̂))
    const float du = rs * float(t.dn[a] - dn_mean - t.nrm[a] * dn_nrm);
    double* gW = &g.g_seed[(int64_t(l) * s + a) * s];
    for (int e = 0; e < s; ++e) {
      gW[e] += double(du) * t.z[e];
      t.dz[e] += W[a * s + e] * du;
    }
  }
}

void add_into(Tensor g, const std::vector<double>& acc) {
  for (size_t i = 0; i < acc.size(); ++i) g.data[i] += float(acc[i]);
}

}  // namespace

void lev_basis_grad(float zeta, int knots, float* w, float* dw) {
  double sum = 0, dsum = 0;
  const float span = float(knots - 1);
  for (int q = 0; q < knots; ++q) {
    b2_with_slope((zeta - float(q) / span) * span, &w[q], &dw[q]);
    dw[q] *= span;
    sum += w[q];
    dsum += dw[q];
  }
  // B_q = w_q / Σw  ⇒  B_q' = (w_q' − B_q Σw') / Σw
  const float inv = float(1.0 / sum);
  for (int q = 0; q < knots; ++q) {
    w[q] *= inv;
    dw[q] = float((dw[q] - w[q] * dsum) / sum);
  }
}

void lev_backward(const ExecCtx& ctx, const LevWeights& g, const Tensor& dout, const int32_t* ids,
                  const LevWeights& w) {
  const LevDims d(w);
  const int64_t N = dout.dim(0), nhr = int64_t(d.nh) * d.r;
  CEMLM_CHECK(dout.dim(1) == d.D && ctx.scratch_floats >= N * nhr);
  float* m_all = ctx.scratch;  // [N, n_h·r] products M, for the output projection's gradient
  // kSpans fixed spans of consecutive tokens, each with its accumulators, added in span order
  // afterwards: the same bits on any number of threads (the accumulators were per thread before,
  // and a resumed run on another thread count drifted from the run it continued).
  constexpr int kSpans = 64;
  const int spans = int(std::min<int64_t>(kSpans, std::max<int64_t>(N, 1)));
  const LevGrads zero(d);
  std::vector<LevGrads> acc(size_t(spans), zero);
#pragma omp parallel
  {
    LevThread t(d);
#pragma omp for schedule(dynamic, 1)
    for (int q = 0; q < spans; ++q)
      for (int64_t i = N * q / spans; i < N * (q + 1) / spans; ++i) {
        lev_digits(ids[i], d.k, d.b, t.dig.data());
        std::fill(t.z.begin(), t.z.end(), 0.0f);
        for (int j = 0; j < d.k; ++j) {
          const float* row = w.codebooks.data + (int64_t(j) * d.b + t.dig[j]) * d.s;
          for (int e = 0; e < d.s; ++e) t.z[e] += row[e];
        }
        std::fill(t.dz.begin(), t.dz.end(), 0.0f);
        for (int l = 0; l < d.nh; ++l)
          head_backward(d, w, l, dout.data + i * d.D, m_all + i * nhr + int64_t(l) * d.r, t,
                        acc[size_t(q)]);
        for (int j = 0; j < d.k; ++j)
          for (int e = 0; e < d.s; ++e)
            acc[size_t(q)].g_code[(int64_t(j) * d.b + t.dig[j]) * d.s + e] += t.dz[e];
      }
  }
  for (int q = 1; q < spans; ++q) acc[0].add(acc[size_t(q)]);
  add_into(g.codebooks, acc[0].g_code);
  add_into(g.seed_proj, acc[0].g_seed);
  add_into(g.ln_weight, acc[0].g_lnw);
  add_into(g.ln_bias, acc[0].g_lnb);
  add_into(g.spline, acc[0].g_spline);
  // out = Σ_l Σ_c M[l,c] W_out[l,c,:]  ⇒  dW_out[n_h·r, D] += Mᵀ dout
  gemm(true, false, int(nhr), d.D, int(N), 1.0f, m_all, int(nhr), dout.data, d.D, 1.0f,
       g.out_proj.data, d.D);
}

}  // namespace cemlm
