// AVX-512 passes of the decode attention row (see attention_avx512.h). Scores: 16 tokens' dot
// products accumulate side by side and are reduced together, one vector of 16 scores per head.
// Sums: each head's output (≤ 256 floats) stays in registers while the tokens stream by; the
// shared diagonal's context sum likewise, 256 columns at a time.
#include "attention_avx512.h"

#if defined(__AVX512F__)

#include "avx512_util.h"  // first: it includes immintrin.h with GCC 12's false warnings silenced

#include <algorithm>

namespace cemlm {
namespace {

using avx512::lane_mask;
using avx512::load_row;
using avx512::reduce16;
using avx512::RowSum;

// Lane t = x[0, n) · rows[t][0, n).
template <typename E>
inline __m512 dots16(const float* x, const E* const* rows, int n) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  for (int k = 0; k < n; k += 16) {
    const __mmask16 m = lane_mask(n - k);
    const __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_fmadd_ps(xv, load_row(m, rows[t] + k), acc[t]);
  }
  return reduce16(acc);
}

// acc[0, width) (≤ 256 floats) = Σ_j w[j]·pool[slot(j)·stride + col0 …], written to dst.
template <typename E>
void weighted_sum(const KvLayerView& kv, const int32_t* blocks, int n_ctx, const float* w,
                  const E* pool, int stride, int col0, int width, float* dst) {
  RowSum sum(width);
  const int bs = kv.block_size;
  for (int j0 = 0; j0 < n_ctx; j0 += bs) {
    const E* base = pool + int64_t(blocks[j0 / bs]) * bs * stride + col0;
    const int n = std::min(bs, n_ctx - j0);
    for (int t = 0; t < n; ++t) sum.add(w[j0 + t], base + int64_t(t) * stride);
  }
  sum.store(dst);
}

}  // namespace

namespace {

template <typename E>
void scores(const KvLayerView& kv, const E* kpool, const E* cpool, const int32_t* blocks, int n_ctx,
            bool shared_diag, const float* q, const float* qd, float scale, float* sc) {
  const int W = kv.k_width, D = kv.c_width, H = kv.n_heads, dh = W / H;
  const __m512 vscale = _mm512_set1_ps(scale);
  const E* keys[16];
  const E* ctx[16];
  for (int j0 = 0; j0 < n_ctx; j0 += 16) {
    const int n = std::min(16, n_ctx - j0);
    for (int t = 0; t < 16; ++t) {  // lanes past the end repeat the last token, then are dropped
      const int64_t slot = kv.slot(blocks, j0 + std::min(t, n - 1));
      keys[t] = kpool + slot * W;
      ctx[t] = shared_diag ? cpool + slot * D : nullptr;
    }
    const __m512 shared = shared_diag ? dots16(qd, ctx, D) : _mm512_setzero_ps();
    const __mmask16 m = lane_mask(n);
    for (int h = 0; h < H; ++h) {
      const E* kh[16];
      for (int t = 0; t < 16; ++t) kh[t] = keys[t] + h * dh;
      const __m512 s = _mm512_mul_ps(vscale, _mm512_add_ps(dots16(q + h * dh, kh, dh), shared));
      _mm512_mask_storeu_ps(sc + int64_t(h) * n_ctx + j0, m, s);
    }
  }
}

template <typename E>
void sums(const KvLayerView& kv, const E* vpool, const E* cpool, const int32_t* blocks, int n_ctx,
          bool shared_diag, float* sc, float* out, float* oc) {
  const int W = kv.k_width, D = kv.c_width, H = kv.n_heads, dh = W / H;
  for (int h = 0; h < H; ++h)
    weighted_sum(kv, blocks, n_ctx, sc + int64_t(h) * n_ctx, vpool, W, h * dh, dh, out + h * dh);
  if (!shared_diag) return;
  // The shared diagonal weighs token j by the sum of its heads' probabilities.
  for (int h = 1; h < H; ++h)
    for (int j = 0; j < n_ctx; j += 16) {
      const __mmask16 m = lane_mask(n_ctx - j);
      _mm512_mask_storeu_ps(sc + j, m,
                            _mm512_add_ps(_mm512_maskz_loadu_ps(m, sc + j),
                                          _mm512_maskz_loadu_ps(m, sc + int64_t(h) * n_ctx + j)));
    }
  for (int c0 = 0; c0 < D; c0 += 256)
    weighted_sum(kv, blocks, n_ctx, sc, cpool, D, c0, std::min(256, D - c0), oc + c0);
}

}  // namespace

bool row_scores_avx512(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag,
                       const float* q, const float* qd, float scale, float* sc) {
  if (diag == DiagKind::kPerHead) return false;
  const bool shared = diag == DiagKind::kShared;
  if (kv.bf16())
    scores(kv, kv.k16, kv.c16, blocks, n_ctx, shared, q, qd, scale, sc);
  else
    scores(kv, kv.k, kv.c, blocks, n_ctx, shared, q, qd, scale, sc);
  return true;
}

bool row_sums_avx512(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag,
                     float* sc, float* out, float* oc) {
  if (diag == DiagKind::kPerHead || kv.k_width / kv.n_heads > 256) return false;
  const bool shared = diag == DiagKind::kShared;
  if (kv.bf16())
    sums(kv, kv.has_values() ? kv.v16 : kv.k16, kv.c16, blocks, n_ctx, shared, sc, out, oc);
  else
    sums(kv, kv.has_values() ? kv.v : kv.k, kv.c, blocks, n_ctx, shared, sc, out, oc);
  return true;
}

}  // namespace cemlm

#else  // no AVX-512 in this build: attention.cc's portable loops do all of it

namespace cemlm {
bool row_scores_avx512(const KvLayerView&, const int32_t*, int, DiagKind, const float*,
                       const float*, float, float*) {
  return false;
}
bool row_sums_avx512(const KvLayerView&, const int32_t*, int, DiagKind, float*, float*, float*) {
  return false;
}
}  // namespace cemlm

#endif
