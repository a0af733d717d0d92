// CPU attention backward (see attention_grad.h): sequences in parallel; per sequence and head, five
// sgemms (scores, dP, dq, dk, dv) plus one row pass that recomputes the softmax and forms
// dS = P ⊙ (dP − Σ P dP). The shared diagonal's score and dP terms are the same for every head:
// computed once per sequence. Every sum has a fixed order, so results are deterministic.
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "cemlm/kernels/attention_grad.h"
#include "cemlm/kernels/linear.h"
#include "cemlm/kernels/simd.h"

namespace cemlm {
namespace {

// Shared-diagonal terms of one sequence: its score and dP additions, and the sums over heads of
// dS and P that its gradients need.
struct SharedTerms {
  const float* scores = nullptr;  // [L, L] scale·qd_i·c_j
  const float* dp = nullptr;      // [L, L] doc_i·c_j
  float* ds_sum = nullptr;        // [L, L] Σ_k dS_k
  float* p_sum = nullptr;         // [L, L] Σ_k P_k
};

// In place: P ← softmax_{j≤i}(S), dS ← P ⊙ (dP − Σ_j P dP); entries above the diagonal become 0.
void softmax_backward_rows(float* P, float* dS, int L, const SharedTerms& sh) {
#pragma omp parallel for schedule(static, 4) if (int64_t(L) * L > 16384)
  for (int i = 0; i < L; ++i) {
    float* p = P + int64_t(i) * L;
    float* g = dS + int64_t(i) * L;
    const int n = i + 1;
    if (sh.scores) {
      const float* s2 = sh.scores + int64_t(i) * L;
      const float* g2 = sh.dp + int64_t(i) * L;
      for (int j = 0; j < n; ++j) {
        p[j] += s2[j];
        g[j] += g2[j];
      }
    }
    float m = p[0];
    for (int j = 1; j < n; ++j) m = std::max(m, p[j]);
    // The exponential of the forward softmax (simd::exp), so both passes agree on P.
    const float inv = float(1.0 / simd::exp_shifted(p, n, m));
    double pg = 0;
    for (int j = 0; j < n; ++j) {
      p[j] *= inv;
      pg += double(p[j]) * g[j];
    }
    for (int j = 0; j < n; ++j) g[j] = p[j] * (g[j] - float(pg));
    std::fill(p + n, p + L, 0.0f);
    std::fill(g + n, g + L, 0.0f);
    if (sh.ds_sum) {
      float* ds = sh.ds_sum + int64_t(i) * L;
      float* ps = sh.p_sum + int64_t(i) * L;
      for (int j = 0; j < n; ++j) {
        ds[j] += g[j];
        ps[j] += p[j];
      }
    }
  }
}

}  // namespace

int64_t attention_backward_scratch(DiagKind diag, int seq_len) {
  return int64_t(diag == DiagKind::kShared ? 6 : 2) * seq_len * seq_len * omp_get_max_threads();
}

namespace {

// One sequence (rows r0 … r0 + L − 1), all heads; `P` is this thread's scratch.
void sequence_backward(const AttnTensors& grad, const Tensor& dout, const Tensor& doc,
                       const AttnTensors& in, DiagKind diag, int H, int L, int64_t r0, float scale,
                       float* P) {
  const int W = int(in.q.dim(-1)), dh = W / H;
  const int64_t LL = int64_t(L) * L;
  const bool shared = diag == DiagKind::kShared, per_head = diag == DiagKind::kPerHead;
  const int D = diag == DiagKind::kNone ? 0 : int(in.c.dim(-1));
  const int qdw = per_head ? H * D : D;
  const float* vpool = in.v.empty() ? in.k.data : in.v.data;
  float* dvpool = in.v.empty() ? grad.k.data : grad.v.data;
  float* dS = P + LL;
  const float* cb = D ? in.c.data + r0 * D : nullptr;
  float* dcb = D ? grad.c.data + r0 * D : nullptr;
  const float* qdb = D ? in.qd.data + r0 * qdw : nullptr;
  const float* docb = D ? doc.data + r0 * qdw : nullptr;
  float* dqdb = D ? grad.qd.data + r0 * qdw : nullptr;
  SharedTerms sh;
  if (shared) {
    float* s2 = dS + LL;
    float* g2 = s2 + LL;
    gemm(false, true, L, L, D, scale, qdb, D, cb, D, 0.0f, s2, L);
    gemm(false, true, L, L, D, 1.0f, docb, D, cb, D, 0.0f, g2, L);
    sh = SharedTerms{s2, g2, g2 + LL, g2 + 2 * LL};
    std::fill(sh.ds_sum, sh.ds_sum + 2 * LL, 0.0f);
  }
  for (int h = 0; h < H; ++h) {
    const int64_t off = r0 * W + int64_t(h) * dh;
    const float* qh = in.q.data + off;
    const float* kh = in.k.data + off;
    const float* doh = dout.data + off;
    gemm(false, true, L, L, dh, scale, qh, W, kh, W, 0.0f, P, L);
    gemm(false, true, L, L, dh, 1.0f, doh, W, vpool + off, W, 0.0f, dS, L);
    if (per_head) {
      gemm(false, true, L, L, D, scale, qdb + h * D, qdw, cb, D, 1.0f, P, L);
      gemm(false, true, L, L, D, 1.0f, docb + h * D, qdw, cb, D, 1.0f, dS, L);
    }
    softmax_backward_rows(P, dS, L, sh);
    gemm(false, false, L, dh, L, scale, dS, L, kh, W, 0.0f, grad.q.data + off, W);
    gemm(true, false, L, dh, L, scale, dS, L, qh, W, 1.0f, grad.k.data + off, W);
    gemm(true, false, L, dh, L, 1.0f, P, L, doh, W, 1.0f, dvpool + off, W);
    if (per_head) {
      gemm(false, false, L, D, L, scale, dS, L, cb, D, 0.0f, dqdb + h * D, qdw);
      gemm(true, false, L, D, L, scale, dS, L, qdb + h * D, qdw, 1.0f, dcb, D);
      gemm(true, false, L, D, L, 1.0f, P, L, docb + h * D, qdw, 1.0f, dcb, D);
    }
  }
  if (shared) {
    gemm(false, false, L, D, L, scale, sh.ds_sum, L, cb, D, 0.0f, dqdb, D);
    gemm(true, false, L, D, L, scale, sh.ds_sum, L, qdb, D, 1.0f, dcb, D);
    gemm(true, false, L, D, L, 1.0f, sh.p_sum, L, docb, D, 1.0f, dcb, D);
  }
}

}  // namespace

void attention_backward(const ExecCtx& ctx, const AttnTensors& grad, const Tensor& dout,
                        const Tensor& doc, const AttnTensors& in, DiagKind diag, int n_heads,
                        int seq_len, float scale) {
  const int L = seq_len, H = n_heads;
  const int64_t M = in.q.dim(0),
                per_thread = attention_backward_scratch(diag, L) / omp_get_max_threads();
  const int n_seqs = int(M / L);
  CEMLM_CHECK(M % L == 0 && in.q.dim(-1) % H == 0 && dout.numel() == in.q.numel());
  CEMLM_CHECK(ctx.scratch_floats >= attention_backward_scratch(diag, L));
  CEMLM_CHECK(diag == DiagKind::kNone ||
              (!in.qd.empty() && !doc.empty() && !grad.qd.empty() && !grad.c.empty()));
  // Sequences write disjoint rows: one per thread, each with its own scratch. A lone sequence
  // runs its row passes and sgemms multi-threaded instead.
#pragma omp parallel for schedule(dynamic, 1) if (n_seqs > 1)
  for (int b = 0; b < n_seqs; ++b)
    sequence_backward(grad, dout, doc, in, diag, H, L, int64_t(b) * L, scale,
                      ctx.scratch + per_thread * omp_get_thread_num());
}

}  // namespace cemlm
