// AVX-512 passes of the decode attention row over a tiled cache (KvLayerView::tiled: within a
// block, each column's tokens contiguous; block sizes that are multiples of 16). A 16-token
// group's values of one column are one vector, so the scores of 16 tokens accumulate side by side
// lane by lane, column after column, with no reduction per token, and each weighted sum keeps 16
// columns' accumulators over a chunk's groups, reduced once at the end.
#include "attention_avx512.h"

#if defined(__AVX512F__)

#include <algorithm>
#include <bit>
#include <cmath>
#include <type_traits>
#include <vector>

#include "avx512_util.h"  // first: it includes immintrin.h with GCC 12's false warnings silenced

namespace cemlm {
namespace {

using avx512::lane_mask;
using avx512::load_row;
using avx512::reduce16;

constexpr int kGroup = 16;      // tokens per vector
constexpr int kSideBySide = 4;  // groups whose scores accumulate together (8 FMA chains)
// How far ahead of its loads the score pass prefetches each group's columns. A decode row's cache
// comes from memory, block after block in no order, and this guest's prefetchers kept only ~30
// GB/s of it in flight with two threads; 2 KB ahead, `bench/attention` at 32 rows × 128 tokens
// went from 19.1 to 14.8 ms (docs/BENCHMARKS.md, session 33).
constexpr int kAheadBytes = 2048;

// A row's 16-token groups [g0, g0 + n) of one pool: group k's column 0, and the lanes that hold
// its tokens (the last group's may be fewer; the others' loads are masked off, so that stale
// entries past the end are never read).
template <typename E>
struct Groups {
  const E* at[kSideBySide];
  __mmask16 lanes[kSideBySide];
  int n;
  int width;  // columns of the pool: prefetches stop at the block's end
};

template <typename E>
Groups<E> groups(const KvLayerView& kv, const E* pool, int width, const int32_t* blocks, int n_ctx,
                 int j0) {
  Groups<E> g;
  g.n = std::min(kSideBySide, (n_ctx - j0 + kGroup - 1) / kGroup);
  g.width = width;
  for (int k = 0; k < g.n; ++k) {
    const int j = j0 + kGroup * k;
    g.at[k] = pool + kv.entry(blocks, j, width);
    g.lanes[k] = lane_mask(n_ctx - j);
  }
  return g;
}

// out[r][k0 + k] lane t = x[r][0, n) · (column values of group k0 + k's token t), for R rows and
// G groups: per block of 64 columns two FMA chains per row and group (even and odd columns), added
// to the total block after block (a long context row's 1024 columns in one chain lost 4–8× the
// accuracy). A row's lanes depend neither on G nor on the other rows, so neither do its bits; the
// rows share each vector of the cache loaded (a prefill's rows read the cache from L3: fewer reads
// per row is most of their gain).
template <int R, int G, typename E>
void col_dots_g(const float* const* x, int n, const Groups<E>& g, int k0, int64_t col0, int64_t cs,
                __m512 (*out)[kSideBySide]) {
  constexpr int kBlock = 64;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int k = 0; k < G; ++k) out[r][k0 + k] = _mm512_setzero_ps();
  const E* const* at = g.at + k0;
  const __mmask16* lanes = g.lanes + k0;
  // Each group's columns kAheadBytes on are prefetched two at a time (the loop's step), up to
  // the block's last column.
  const int64_t ahead = std::max<int64_t>(2, kAheadBytes / (cs * int64_t(sizeof(E))));
  const int64_t pf_bytes = 2 * cs * int64_t(sizeof(E));
  for (int b0 = 0; b0 < n; b0 += kBlock) {
    const int b1 = std::min(n, b0 + kBlock);
    __m512 a0[R][G], a1[R][G];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int k = 0; k < G; ++k) a0[r][k] = _mm512_setzero_ps(), a1[r][k] = _mm512_setzero_ps();
    int i = b0;
    for (; i + 2 <= b1; i += 2) {
      __m512 x0[R], x1[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        x0[r] = _mm512_set1_ps(x[r][i]), x1[r] = _mm512_set1_ps(x[r][i + 1]);
      const int64_t o = (col0 + i) * cs;
      const bool prefetch = col0 + i + ahead + 2 <= g.width;
#pragma GCC unroll 4
      for (int k = 0; k < G; ++k) {
        if (prefetch) {
          const char* p = reinterpret_cast<const char*>(at[k] + o + ahead * cs);
          for (int64_t line = 0; line < pf_bytes; line += 64) _mm_prefetch(p + line, _MM_HINT_T0);
        }
        const __m512 v0 = load_row(lanes[k], at[k] + o);
        const __m512 v1 = load_row(lanes[k], at[k] + o + cs);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          a0[r][k] = _mm512_fmadd_ps(x0[r], v0, a0[r][k]);
          a1[r][k] = _mm512_fmadd_ps(x1[r], v1, a1[r][k]);
        }
      }
    }
    if (i < b1) {
#pragma GCC unroll 4
      for (int k = 0; k < G; ++k) {
        const __m512 v0 = load_row(lanes[k], at[k] + (col0 + i) * cs);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
          a0[r][k] = _mm512_fmadd_ps(_mm512_set1_ps(x[r][i]), v0, a0[r][k]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int k = 0; k < G; ++k)
        out[r][k0 + k] = _mm512_add_ps(out[r][k0 + k], _mm512_add_ps(a0[r][k], a1[r][k]));
  }
}

// col_dots_g over the groups [k0, g.n), G at a time (the accumulators of R rows × G groups × 2
// chains stay in registers: G = 4 for one or two rows, 2 for four).
template <int R, int G, typename E>
void col_dots_from(const float* const* x, int n, const Groups<E>& g, int k0, int64_t col0,
                   int64_t cs, __m512 (*out)[kSideBySide]) {
  const int left = g.n - k0;
  if (left >= G) {
    col_dots_g<R, G>(x, n, g, k0, col0, cs, out);
    if (left > G) col_dots_from<R, G>(x, n, g, k0 + G, col0, cs, out);
  } else if constexpr (G > 1) {
    col_dots_from<R, G - 1>(x, n, g, k0, col0, cs, out);
  }
}

template <int R, typename E>
void col_dots(const float* const* x, int n, const Groups<E>& g, int64_t col0, int64_t cs,
              __m512 (*out)[kSideBySide]) {
  col_dots_from<R, R <= 2 ? 4 : 2>(x, n, g, 0, col0, cs, out);
}

// Where E is int8: dots[r][k] *= group k's scales of scale column `col` (one per token).
template <int R, typename E>
void apply_scales(const Groups<float>& scales, int64_t col, __m512 (*dots)[kSideBySide]) {
  if constexpr (std::is_same_v<E, int8_t>)
    for (int k = 0; k < scales.n; ++k) {
      const __m512 s = _mm512_maskz_loadu_ps(scales.lanes[k], scales.at[k] + col);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) dots[r][k] = _mm512_mul_ps(dots[r][k], s);
    }
}

// The scales of pool p's 16-token groups from j0 (int8 only; empty otherwise).
template <typename E>
Groups<float> scale_groups(const KvLayerView& kv, const KvPoolRef& p, const int32_t* blocks,
                           int n_ctx, int j0) {
  if constexpr (std::is_same_v<E, int8_t>) return groups(kv, p.scale, p.groups, blocks, n_ctx, j0);
  return Groups<float>{};
}

template <int R, typename E>
void scores(const KvLayerView& kv, const E* kpool, const E* cpool, const int32_t* blocks, int n_ctx,
            DiagKind diag, const AttnRows& rows, float scale) {
  const int W = kv.k_width, D = kv.c_width, H = kv.n_heads, dh = W / H;
  const int64_t cs = kv.block_size;
  const __m512 vscale = _mm512_set1_ps(scale);
  const KvPoolRef kref = KvPoolRef::keys(kv), cref = KvPoolRef::contexts(kv);
  for (int j0 = 0; j0 < n_ctx; j0 += kGroup * kSideBySide) {
    const Groups<E> keys = groups(kv, kpool, W, blocks, n_ctx, j0);
    const Groups<E> contexts =
        diag == DiagKind::kNone ? Groups<E>{} : groups(kv, cpool, D, blocks, n_ctx, j0);
    const Groups<float> key_scales = scale_groups<E>(kv, kref, blocks, n_ctx, j0);
    const Groups<float> context_scales =
        diag == DiagKind::kNone ? Groups<float>{} : scale_groups<E>(kv, cref, blocks, n_ctx, j0);
    __m512 diag_term[R][kSideBySide] = {};  // qd·c: the shared diagonal's once, per head's per head
    if (diag == DiagKind::kShared) {
      col_dots<R>(rows.qd, D, contexts, 0, cs, diag_term);
      apply_scales<R, E>(context_scales, 0, diag_term);
    }
    for (int h = 0; h < H; ++h) {
      const float* qh[R];
      for (int r = 0; r < R; ++r) qh[r] = rows.q[r] + int64_t(h) * dh;
      __m512 s[R][kSideBySide];
      col_dots<R>(qh, dh, keys, int64_t(h) * dh, cs, s);
      apply_scales<R, E>(key_scales, h * cs, s);
      if (diag == DiagKind::kPerHead) {
        for (int r = 0; r < R; ++r) qh[r] = rows.qd[r] + int64_t(h) * D;
        col_dots<R>(qh, D, contexts, 0, cs, diag_term);
        apply_scales<R, E>(context_scales, 0, diag_term);
      }
      for (int r = 0; r < R; ++r)
        for (int k = 0; k < keys.n; ++k)
          _mm512_mask_storeu_ps(rows.sc[r] + int64_t(h) * n_ctx + j0 + kGroup * k, keys.lanes[k],
                                _mm512_mul_ps(vscale, _mm512_add_ps(s[r][k], diag_term[r][k])));
    }
  }
}

// dst[r][c] for c < cols (≤ 16 / R) = Σ_j w[r][j]·(column col0 + c of token j) over the tokens
// [0, n_ctx), for R rows: each column's products accumulate on the lanes (token j on lane j % 16),
// group after group in token order, and the lanes are reduced at the end (reduce16, whose sum of
// one accumulator's lanes does not depend on the others: a row's bits are the same alone or
// beside others). Full: cols = 16 / R.
// An int8 pool's weights are scaled by the tokens' scales in scale column `scol` of `sp`, as they
// are loaded.
template <int R, bool Full, typename E>
void col_sums16(const KvLayerView& kv, const E* pool, int width, const KvPoolRef& sp, int scol,
                const int32_t* blocks, int n_ctx, const float* const* w, int64_t col0, int cols,
                float* const* dst) {
  constexpr int C = 16 / R;  // columns per row
  const int64_t cs = kv.block_size;
  __m512 acc[16];
#pragma GCC unroll 16
  for (int c = 0; c < 16; ++c) acc[c] = _mm512_setzero_ps();
  // Group j's block and place in it, walked rather than divided out per group (an integer
  // division per group and 16 / R columns cost as much as their FMAs in four-row prefill sums).
  for (int j = 0, b = 0, t = 0; j < n_ctx; j += kGroup, t += kGroup) {
    if (t == kv.block_size) t = 0, ++b;
    const __mmask16 m = lane_mask(n_ctx - j);
    __m512 p[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) p[r] = _mm512_maskz_loadu_ps(m, w[r] + j);
    if constexpr (std::is_same_v<E, int8_t>) {
      const __m512 s = _mm512_maskz_loadu_ps(
          m, sp.scale + int64_t(blocks[b]) * kv.block_size * sp.groups + t + scol * cs);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) p[r] = _mm512_mul_ps(p[r], s);
    }
    const E* at = pool + int64_t(blocks[b]) * kv.block_size * width + t + col0 * cs;
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const __m512 v = load_row(Full || c < cols ? m : __mmask16(0), at + c * cs);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r * C + c] = _mm512_fmadd_ps(p[r], v, acc[r * C + c]);
    }
  }
  const __m512 sums = reduce16(acc);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)  // row r's lanes [r·C, r·C + cols), moved to the bottom
    _mm512_mask_storeu_ps(
        dst[r], lane_mask(cols),
        r ? _mm512_permutexvar_ps(_mm512_add_epi32(iota, _mm512_set1_epi32(r * C)), sums) : sums);
}

// col_sums16 over columns [col0, col0 + n_cols), 16 / R at a time.
template <int R, typename E>
void col_sums(const KvLayerView& kv, const E* pool, int width, const KvPoolRef& sp, int scol,
              const int32_t* blocks, int n_ctx, const float* const* w, int col0, int n_cols,
              float* const* dst) {
  constexpr int C = 16 / R;
  for (int c0 = 0; c0 < n_cols; c0 += C) {
    const int cols = std::min(C, n_cols - c0);
    float* d[R];
    for (int r = 0; r < R; ++r) d[r] = dst[r] + c0;
    if (cols == C)
      col_sums16<R, true>(kv, pool, width, sp, scol, blocks, n_ctx, w, col0 + c0, cols, d);
    else
      col_sums16<R, false>(kv, pool, width, sp, scol, blocks, n_ctx, w, col0 + c0, cols, d);
  }
}

template <int R, typename E>
void sums(const KvLayerView& kv, const E* vpool, const E* cpool, const int32_t* blocks, int n_ctx,
          DiagKind diag, const AttnRows& rows) {
  const int W = kv.k_width, D = kv.c_width, H = kv.n_heads, dh = W / H;
  const KvPoolRef vref = KvPoolRef::values(kv), cref = KvPoolRef::contexts(kv);
  if (rows.out[0])
    for (int h = 0; h < H; ++h) {
      const float* w[R];
      float* d[R];
      for (int r = 0; r < R; ++r)
        w[r] = rows.sc[r] + int64_t(h) * n_ctx, d[r] = rows.out[r] + h * dh;
      col_sums<R>(kv, vpool, W, vref, h, blocks, n_ctx, w, h * dh, dh, d);
    }
  if (diag == DiagKind::kNone || !rows.oc[0]) return;
  if (diag == DiagKind::kPerHead) {  // each head's own context sums, [H, D]
    for (int h = 0; h < H; ++h) {
      const float* w[R];
      float* d[R];
      for (int r = 0; r < R; ++r)
        w[r] = rows.sc[r] + int64_t(h) * n_ctx, d[r] = rows.oc[r] + int64_t(h) * D;
      col_sums<R>(kv, cpool, D, cref, 0, blocks, n_ctx, w, 0, D, d);
    }
    return;
  }
  // The shared diagonal weighs token j by the sum of its heads' probabilities.
  for (int r = 0; r < R; ++r) {
    float* sc = rows.sc[r];
    for (int h = 1; h < H; ++h)
      for (int j = 0; j < n_ctx; j += 16) {
        const __mmask16 m = lane_mask(n_ctx - j);
        _mm512_mask_storeu_ps(sc + j, m,
                              _mm512_add_ps(_mm512_maskz_loadu_ps(m, sc + j),
                                            _mm512_maskz_loadu_ps(m, sc + int64_t(h) * n_ctx + j)));
      }
  }
  const float* w[R];
  for (int r = 0; r < R; ++r) w[r] = rows.sc[r];
  col_sums<R>(kv, cpool, D, cref, 0, blocks, n_ctx, w, 0, D, rows.oc);
}

}  // namespace

bool avx512_attention_built() { return true; }

bool rows_avx512(const KvLayerView& kv) { return kv.tiled && kv.block_size % kGroup == 0; }

void row_scores_avx512(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag,
                       const AttnRows& rows, float scale) {
  auto run = [&](const auto* kpool, const auto* cpool, const AttnRows& q, float qscale) {
    switch (q.n) {
      case 1:
        return scores<1>(kv, kpool, cpool, blocks, n_ctx, diag, q, qscale);
      case 2:
        return scores<2>(kv, kpool, cpool, blocks, n_ctx, diag, q, qscale);
      default:
        return scores<4>(kv, kpool, cpool, blocks, n_ctx, diag, q, qscale);
    }
  };
  if (kv.bf16()) return run(kv.k16, kv.c16, rows, scale);
  if (!kv.int8()) return run(kv.k, kv.c, rows, scale);
  // The int8 dots sum q · the raw values (up to ±127) before their scale, over d_h (or D) terms:
  // q is taken 2^-shift times and the result 2^shift times (exact but for subnormals), with
  // 2^shift ≥ 127 · 2 · terms, so that a sum cannot overflow where each |q| is finite (a huge
  // query with small keys gave NaN where the fp32 scores are finite).
  const int qd_width = diag == DiagKind::kNone     ? 0
                       : diag == DiagKind::kShared ? kv.c_width
                                                   : kv.n_heads * kv.c_width;
  const int terms = std::max(kv.k_width / kv.n_heads, qd_width ? kv.c_width : 0);
  const int shift = 8 + int(std::bit_width(unsigned(terms)));
  const float down_by = std::ldexp(1.0f, -shift), up_by = std::ldexp(1.0f, shift);
  const int width = kv.k_width + qd_width;
  thread_local std::vector<float> scaled;
  scaled.resize(size_t(rows.n) * width);
  AttnRows down = rows;
  for (int r = 0; r < rows.n; ++r) {
    float* q = scaled.data() + size_t(r) * width;
    for (int i = 0; i < kv.k_width; ++i) q[i] = rows.q[r][i] * down_by;
    for (int i = 0; i < qd_width; ++i) q[kv.k_width + i] = rows.qd[r][i] * down_by;
    down.q[r] = q;
    down.qd[r] = qd_width ? q + kv.k_width : nullptr;
  }
  run(kv.k8, kv.c8, down, scale * up_by);
}

void row_sums_avx512(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag,
                     const AttnRows& rows) {
  auto run = [&](const auto* vpool, const auto* cpool) {
    switch (rows.n) {
      case 1:
        return sums<1>(kv, vpool, cpool, blocks, n_ctx, diag, rows);
      case 2:
        return sums<2>(kv, vpool, cpool, blocks, n_ctx, diag, rows);
      default:
        return sums<4>(kv, vpool, cpool, blocks, n_ctx, diag, rows);
    }
  };
  if (kv.int8())
    run(kv.has_values() ? kv.v8 : kv.k8, kv.c8);
  else if (kv.bf16())
    run(kv.has_values() ? kv.v16 : kv.k16, kv.c16);
  else
    run(kv.has_values() ? kv.v : kv.k, kv.c);
}

}  // namespace cemlm

#else  // no AVX-512 in this build: attention.cc's portable loops do all of it

namespace cemlm {
bool avx512_attention_built() { return false; }
bool rows_avx512(const KvLayerView&) { return false; }
void row_scores_avx512(const KvLayerView&, const int32_t*, int, DiagKind, const AttnRows&, float) {}
void row_sums_avx512(const KvLayerView&, const int32_t*, int, DiagKind, const AttnRows&) {}
}  // namespace cemlm

#endif
