// Row-major products with few rows — decode batches and short prefill chunks — on AVX-512:
// OpenBLAS's Haswell (AVX2) kernels reach ~60 GFLOP/s per core there (they pack the whole
// weight matrix on every call), this ~100–170 (bench numbers in docs/BENCHMARKS.md).
//
// C = beta·C + alpha·A·op(B), A [M, K] untransposed. op(B) is cut into panels of 32 columns; each
// panel is streamed once per tile of 8 rows of A, with 8 × 2 vector accumulators held in
// registers over the whole K loop. Panels of B [K, N] (op = identity) are read in place; panels
// of B [N, K] (op = transpose, the usual weight layout) are first transposed 16 × 16 in registers
// into a [K, 32] buffer, a cost shared by every row tile — or packed once ahead (pack_panels, for
// weights: PackedLinear), then read in place by small_gemm_packed.
//
// A panel's row tiles also prefetch the thread's next panel, shared out over them: without it, a
// weight beyond the caches arrives only while the first tile asks for it — faster than memory
// delivers, so that tile waits — and then the other tiles compute with memory idle. Measured on
// cold weights (two threads, 32 × [2816, 1024]): 107 → 142 GFLOP/s packed; unchanged on hot
// ones. Pulling the whole next panel during the first tile, as it first did, asks memory for it
// at n times the rate the products use it, in bursts: spread over the tiles, 32 × [2816, 1024]
// cold went from 282–295 to 317–352 GFLOP/s on a full-rate Zen 5 (hot: 385–398), and batch-32
// decode steps from 60–64 to 50–60 ms (docs/BENCHMARKS.md, session 17). The next panel is pulled
// as kPrefetchStreams parts side by side, not from its first row to its last: a core's reads of
// one sequential stream came at ~10 GB/s on a Zen 5 guest, of four at ~20 (session 33).
//
// The same tiles also run on bf16 pair panels with AVX512-BF16 dot products (two k per
// instruction, A rounded to bf16) and on int8 quad panels with AVX512-VNNI (four k per
// instruction, A quantized per 32-k block, each block's exact integer sum scaled into fp32): on a
// Zen 4, 32 × [2816, 1024] ran at 416 and 493 GFLOP/s against fp32's 208 (session 19).
#include "gemm_avx512.h"

#if defined(__AVX512F__)

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "avx512_util.h"  // first: it includes immintrin.h with GCC 12's false warnings silenced
#include "cemlm/kernels/bf16.h"
#include "cemlm/kernels/int8.h"
#include "cemlm/kernels/parallel.h"

namespace cemlm {
namespace {

using avx512::lane_mask;
using avx512::reduce16;
using avx512::transpose16;

constexpr int kPanel = 32;  // columns per panel: two vectors of 16 floats
constexpr int kPrefetchStreams = 4;  // parts of the next panel prefetched side by side
constexpr int kTileRows = 8;
// Products smaller than this many flops run on the calling thread (a fork costs more).
constexpr double kParallelFlops = 4e6;

// panel[k][j] = op(B)[k][n0 + j] for j < width, 0 beyond.
void pack_panel(bool trans_b, const float* B, int ldb, int K, int n0, int width, float* panel) {
  if (trans_b && width == kPanel) {
    int k = 0;
    for (; k + 16 <= K; k += 16)
      for (int h = 0; h < 2; ++h)
        transpose16(B + size_t(n0 + 16 * h) * size_t(ldb) + size_t(k), size_t(ldb),
                    panel + size_t(k) * kPanel + 16 * h, kPanel);
    for (; k < K; ++k)
      for (int j = 0; j < kPanel; ++j) panel[size_t(k) * kPanel + j] = B[size_t(n0 + j) * ldb + k];
    return;
  }
  std::memset(panel, 0, sizeof(float) * size_t(K) * kPanel);
  if (trans_b) {
    for (int j = 0; j < width; ++j) {
      const float* col = B + size_t(n0 + j) * size_t(ldb);
      for (int k = 0; k < K; ++k) panel[size_t(k) * kPanel + j] = col[k];
    }
  } else {
    for (int k = 0; k < K; ++k)
      std::memcpy(panel + size_t(k) * kPanel, B + size_t(k) * ldb + n0, sizeof(float) * size_t(width));
  }
}

// A panel: row k's 32 weights start at p + k·stride. W = float; uint16_t for bf16 panels
// (pack_panels' bf16 layout: 16 pairs per row, the low half of pair j column j, the high half
// column j + 16, so that two integer ops give both vectors of floats); int8_t for int8 panels,
// whose rows k of block k / 32 share the scale scales[k / 32]; uint32_t for bf16 pair panels
// (row kk: rows 2kk and 2kk + 1 of op(B) as 32 pairs, column j's pair in element j), which the
// products take with A in bf16 pairs too (InputOf), K counting pairs; uint8_t for int8 quad
// panels (row g: rows 4g … 4g + 3 of op(B) as 32 quads of bytes q + 128, column j's in bytes
// 4j … 4j + 3; the scales of int8_t's, rows g of block g / 8 sharing one), which the products take
// with A quantized too (Q8Row), K counting quads.
template <typename W>
struct PanelOf {
  const W* p;
  size_t stride;
  const float* scales = nullptr;  // int8 panels only
};
using Panel = PanelOf<float>;

// Row k of panel P as two vectors of 16 floats (columns 0–15, 16–31).
inline void load_row(const PanelOf<float>& P, int k, __m512& y0, __m512& y1) {
  const float* row = P.p + size_t(k) * P.stride;
  y0 = _mm512_loadu_ps(row);
  y1 = _mm512_loadu_ps(row + 16);
}
inline void load_row(const PanelOf<uint16_t>& P, int k, __m512& y0, __m512& y1) {
  const __m512i v = _mm512_loadu_si512(P.p + size_t(k) * P.stride);
  y0 = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  y1 = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xFFFF0000u))));
}
#if defined(__AVX512BF16__)
inline void load_row(const PanelOf<uint32_t>& P, int k, __m512i& y0, __m512i& y1) {
  const uint32_t* row = P.p + size_t(k) * P.stride;
  y0 = _mm512_loadu_si512(row);
  y1 = _mm512_loadu_si512(row + 16);
}
#endif
// q · scale rounded to fp32 once, as a dequantized weight stored in fp32 would be.
inline void load_row(const PanelOf<int8_t>& P, int k, __m512& y0, __m512& y1) {
  const int8_t* row = P.p + size_t(k) * P.stride;
  const __m512 s = _mm512_set1_ps(P.scales[k / kQuantBlock]);
  y0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                         reinterpret_cast<const __m128i*>(row)))),
                     s);
  y1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                         reinterpret_cast<const __m128i*>(row + 16)))),
                     s);
}

// One row of A quantized for the int8 quad panels, per block b of 32 k: q[g] holds k = 4g … 4g + 3
// as int8 (low byte first; zero past K), q = a / s rounded to nearest-even with s = scale[b] =
// the block's largest |a| / 127 (q = 0 where s = 0; s = NaN where the block holds a non-finite a),
// and corr[b] = 128 · Σ q over the block, which the unsigned weights q_w + 128 add to the sums.
struct Q8Row {
  const uint32_t* q;
  const float* scale;
  const int32_t* corr;
};

// Elements per panel row, and panel rows per block of kQuantBlock k (int8 and quad panels).
template <typename W>
constexpr int kRowWidth = std::is_same_v<W, uint8_t> ? 4 * kPanel : kPanel;
template <typename W>
constexpr int kBlockRows = std::is_same_v<W, uint8_t> ? kQuantBlock / 4 : kQuantBlock;

// What a product takes A as: fp32 for the fp32-arithmetic panels, bf16 pairs (the low half the
// even k) for the pair panels, Q8Row (lda 1) for the quad panels. broadcast() spreads one A value
// (one k, or one pair of k) over a vector, madd() adds its products with a panel row's 16 columns
// to acc: one FMA, or one AVX512-BF16 dot product of the pair (both products exact in fp32, each
// added with one rounding).
template <typename W>
using InputOf = std::conditional_t<std::is_same_v<W, uint32_t>, uint32_t,
                                   std::conditional_t<std::is_same_v<W, uint8_t>, Q8Row, float>>;
inline __m512 broadcast(float a) { return _mm512_set1_ps(a); }
inline __m512 madd(__m512 x, __m512 y, __m512 acc) { return _mm512_fmadd_ps(x, y, acc); }
#if defined(__AVX512BF16__)
inline __m512i broadcast(uint32_t a) { return _mm512_set1_epi32(int(a)); }
inline __m512 madd(__m512i x, __m512i y, __m512 acc) {
  return _mm512_dpbf16_ps(acc, __m512bh(x), __m512bh(y));
}
#endif

// Stores the R rows of results acc (two vectors a row) as C = beta·C + alpha·acc.
template <int R>
[[gnu::always_inline]] inline void store_rows(const __m512* acc, float alpha, float beta, float* c,
                                              int ldc, __mmask16 m0, __mmask16 m1) {
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    float* ci = c + size_t(i) * ldc;
    __m512 r0 = _mm512_mul_ps(va, acc[2 * i]), r1 = _mm512_mul_ps(va, acc[2 * i + 1]);
    if (beta != 0.0f) {  // beta = 0 never reads C, which may hold garbage
      r0 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m0, ci), r0);
      r1 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m1, ci + 16), r1);
    }
    _mm512_mask_storeu_ps(ci, m0, r0);
    _mm512_mask_storeu_ps(ci + 16, m1, r1);
  }
}

// The prefetch of the next panel at a row tile's iteration k, one of k = pf_first, pf_first +
// pf_every, … (panel_products: tile t of n has pf_first = kPrefetchStreams·t, pf_every =
// kPrefetchStreams·n): row k / kPrefetchStreams of each of the panel's kPrefetchStreams equal
// parts, into L1 (into L2 only, the four parts were no faster than one).
template <typename W>
[[gnu::always_inline]] inline void prefetch_next(const PanelOf<W>& next, int K, int k) {
  const int part = (K + kPrefetchStreams - 1) / kPrefetchStreams;
  for (int s = 0, row = k / kPrefetchStreams; s < kPrefetchStreams && row < K; ++s, row += part) {
    const char* p = reinterpret_cast<const char*>(next.p + size_t(row) * next.stride);
    for (size_t line = 0; line < sizeof(W) * kRowWidth<W>; line += 64)
      _mm_prefetch(p + line, _MM_HINT_T0);
  }
}

#if defined(__AVX512VNNI__)
// S rows of A against quad panels: per block of 8 panel rows (32 k), the integer sums of
// (q_w + 128) · q_a by vpdpbusd, exact in int32; corr taken off; converted to fp32 (exact: below
// 2^24) and added as acc = fma(sum, s_a · s_w, acc), blocks in k order. panels[p] is row i's p-th
// panel (S = 1: P panels of one row; P = 1: one panel for S rows). Each output has the same bits
// whatever S and P.
template <int S, int P, bool kPrefetch>
[[gnu::always_inline]] inline void q8_rows(int K, const Q8Row* a, const PanelOf<uint8_t>* panels,
                                           PanelOf<uint8_t> next, int pf_first, int pf_every,
                                           __m512* acc) {
  static_assert(S == 1 || P == 1);
  int countdown = pf_first;
  for (int g0 = 0, b = 0; g0 < K; g0 += kBlockRows<uint8_t>, ++b) {
    __m512i sum[2 * S * P];
#pragma GCC unroll 16
    for (int i = 0; i < 2 * S * P; ++i) sum[i] = _mm512_setzero_si512();
    const int g1 = std::min(K, g0 + kBlockRows<uint8_t>);
    for (int g = g0; g < g1; ++g) {
      if constexpr (kPrefetch) {
        if (countdown-- == 0) {
          prefetch_next(next, K, g);
          countdown = pf_every - 1;
        }
      }
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        const uint8_t* row = panels[p].p + size_t(g) * panels[p].stride;
        const __m512i y0 = _mm512_loadu_si512(row), y1 = _mm512_loadu_si512(row + 64);
#pragma GCC unroll 4
        for (int i = 0; i < S; ++i) {
          const __m512i x = _mm512_set1_epi32(int(a[S == 1 ? 0 : i].q[g]));
          sum[2 * (i + p)] = _mm512_dpbusd_epi32(sum[2 * (i + p)], y0, x);
          sum[2 * (i + p) + 1] = _mm512_dpbusd_epi32(sum[2 * (i + p) + 1], y1, x);
        }
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
      for (int i = 0; i < S; ++i) {
        const Q8Row& r = a[S == 1 ? 0 : i];
        const __m512i corr = _mm512_set1_epi32(r.corr[b]);
        // The scales' product, unless it overflows (past ~5e42: blocks of very large inputs and
        // weights, where a block whose integer sum is 0 gave 0 * inf = NaN); then one scale, and
        // the other (in that order always, a huge x with small weights would overflow instead).
        const float sx = r.scale[b], sw = panels[p].scales[b], both = sx * sw;
        const bool finite = std::isfinite(both);
        const __m512 first = _mm512_set1_ps(finite ? both : sx);
        const __m512 second = _mm512_set1_ps(sw);
        for (int h = 0; h < 2; ++h) {
          __m512& out = acc[2 * (i + p) + h];
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum[2 * (i + p) + h], corr));
          out = finite ? _mm512_fmadd_ps(dot, first, out)
                       : _mm512_fmadd_ps(_mm512_mul_ps(dot, first), second, out);
        }
      }
  }
}
#endif

// C[0..R) × [0, 32) (masked by m0, m1) = beta·C + alpha · A[0..R) · P; with kPrefetch, also
// prefetches part of panel `next` at its iterations pf_first, pf_first + pf_every, …
// (prefetch_next).
template <int R, bool kPrefetch, typename W>
void tile(int K, const InputOf<W>* a, int lda, PanelOf<W> P, PanelOf<W> next, int pf_first,
          int pf_every, float alpha, float beta, float* c, int ldc, __mmask16 m0, __mmask16 m1) {
  // The loops over R must be unrolled for acc to live in registers (-O2 does not unroll them).
  __m512 acc[2 * R];
#pragma GCC unroll 16
  for (int i = 0; i < 2 * R; ++i) acc[i] = _mm512_setzero_ps();
  if constexpr (std::is_same_v<W, uint8_t>) {
#if defined(__AVX512VNNI__)
    // Four rows at a time (their fp32 and int32 sums fill 16 registers), the panel re-read from
    // L1 by the second four; only the first prefetches.
    constexpr int S0 = std::min(R, 4);
    q8_rows<S0, 1, kPrefetch>(K, a, &P, next, pf_first, pf_every, acc);
    if constexpr (R > 4) q8_rows<R - 4, 1, false>(K, a + 4 * lda, &P, next, 0, 1, acc + 8);
    store_rows<R>(acc, alpha, beta, c, ldc, m0, m1);
#endif
    return;
  } else {
    // Iterations until the next prefetch (k = pf_first, pf_first + pf_every, …).
    int countdown = pf_first;
    for (int k = 0; k < K; ++k) {
      if constexpr (kPrefetch) {
        if (countdown-- == 0) {
          prefetch_next(next, K, k);
          countdown = pf_every - 1;
        }
      }
      decltype(broadcast(*a)) y0, y1;
      load_row(P, k, y0, y1);
      // Row i's value is read at base[i / 4] + (i % 4)·lda, lda and 3·lda in registers, the
      // second base and both strides hidden from the optimizer: left to itself, GCC kept one
      // pointer per row and, short of general registers, moved three of them through vector
      // registers on every k (batch-32 decode steps 2–3% faster without, docs/BENCHMARKS.md,
      // session 34).
      const InputOf<W>* base[2] = {a + k, a + (R > 4 ? 4 * size_t(lda) : 0) + k};
      size_t l1 = size_t(lda), l3 = 3 * l1;
      asm("" : "+r"(base[1]), "+r"(l1), "+r"(l3));
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const InputOf<W>* b = base[i / 4];
      const auto x = broadcast(i % 4 == 0   ? *b
                               : i % 4 == 1 ? b[l1]
                               : i % 4 == 2 ? b[2 * l1]
                                            : b[l3]);
      acc[2 * i] = madd(x, y0, acc[2 * i]);
      acc[2 * i + 1] = madd(x, y1, acc[2 * i + 1]);
    }
    }
  store_rows<R>(acc, alpha, beta, c, ldc, m0, m1);
  }
}

// One row of A against P consecutive packed panels (2P accumulators: P independent chains keep the
// FMA units busy where one panel's two would wait on their latency). Each output is the same
// k-ordered chain of madd()s, then the same alpha/beta step, as tile<R>'s for any R: a row's
// product has the same bits whatever the number of rows it came with. masks: P pairs, for ragged
// N. Panel p is first's data + p·panel_size (and its scales first's + p·scales_size).
template <int P, typename W>
void row_panels(int K, const InputOf<W>* a, PanelOf<W> first, int64_t panel_size,
                int64_t scales_size, float alpha, float beta, float* c, const __mmask16* masks) {
  PanelOf<W> panel[P];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
    panel[p] = {first.p + p * panel_size, first.stride,
                first.scales ? first.scales + p * scales_size : nullptr};
  __m512 acc[2 * P];
#pragma GCC unroll 16
  for (int i = 0; i < 2 * P; ++i) acc[i] = _mm512_setzero_ps();
  if constexpr (std::is_same_v<W, uint8_t>) {
#if defined(__AVX512VNNI__)
    q8_rows<1, P, false>(K, a, panel, PanelOf<W>{nullptr, 0}, 0, 1, acc);
#endif
  } else {
    for (int k = 0; k < K; ++k) {
      const auto x = broadcast(a[k]);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        std::remove_const_t<decltype(x)> y0, y1;
        load_row(panel[p], k, y0, y1);
        acc[2 * p] = madd(x, y0, acc[2 * p]);
        acc[2 * p + 1] = madd(x, y1, acc[2 * p + 1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)  // panel p's results are one row of 32 columns
    store_rows<1>(acc + 2 * p, alpha, beta, c + p * kPanel, 0, masks[2 * p], masks[2 * p + 1]);
}

constexpr int kRowPanels = 4;  // panels per row_panels call
template <typename W>
using RowPanelsFn = void (*)(int, const InputOf<W>*, PanelOf<W>, int64_t, int64_t, float, float,
                             float*, const __mmask16*);
template <typename W>
constexpr RowPanelsFn<W> kRowPanelsFns[kRowPanels + 1] = {
    nullptr, &row_panels<1, W>, &row_panels<2, W>, &row_panels<3, W>, &row_panels<4, W>};

template <typename W>
using TileFn = void (*)(int, const InputOf<W>*, int, PanelOf<W>, PanelOf<W>, int, int, float, float,
                        float*, int, __mmask16, __mmask16);
// kTiles<W>[prefetch][rows]
template <typename W>
constexpr TileFn<W> kTiles[2][kTileRows + 1] = {
    {nullptr, &tile<1, false, W>, &tile<2, false, W>, &tile<3, false, W>, &tile<4, false, W>,
     &tile<5, false, W>, &tile<6, false, W>, &tile<7, false, W>, &tile<8, false, W>},
    {nullptr, &tile<1, true, W>, &tile<2, true, W>, &tile<3, true, W>, &tile<4, true, W>,
     &tile<5, true, W>, &tile<6, true, W>, &tile<7, true, W>, &tile<8, true, W>}};

// c[n0, n0 + rows) ← beta·c + alpha·B[n]·a for rows ≤ 16 rows of B [N, K]: one accumulator per row,
// the K tail masked, the 16 sums reduced together.
void gemv_rows(int rows, int K, float alpha, const float* a, const float* B, int ldb, float beta,
               float* c) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const float* row[16];
  for (int i = 0; i < 16; ++i) row[i] = B + size_t(std::min(i, rows - 1)) * size_t(ldb);
  for (int k = 0; k < K; k += 16) {
    const __mmask16 m = lane_mask(K - k);
    const __m512 x = _mm512_maskz_loadu_ps(m, a + k);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
      acc[i] = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(m, row[i] + k), acc[i]);
  }
  const __mmask16 out = lane_mask(rows);
  __m512 r = _mm512_mul_ps(_mm512_set1_ps(alpha), reduce16(acc));
  if (beta != 0.0f) r = _mm512_fmadd_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(out, c), r);
  _mm512_mask_storeu_ps(c, out, r);
}

// c[n0, n0 + width) ← beta·c + alpha·Σ_k a[k]·B[k, n0 …] for width ≤ 16·V columns of B [K, N]:
// the columns' sums stay in registers while the rows stream by, two rows at a time.
template <int V>
struct GemvCols {
  static void run(int width, int K, float alpha, const float* a, const float* B, int ldb,
                  float beta, float* c) {
    avx512::RowSum<V> sum(width);
    int k = 0;
    for (; k + 2 <= K; k += 2)
      sum.add2(a[k], B + size_t(k) * size_t(ldb), a[k + 1], B + size_t(k + 1) * size_t(ldb));
    if (k < K) sum.add(a[k], B + size_t(k) * size_t(ldb));
    sum.store(c, alpha, beta);
  }
};

// Matrices below this many bytes are read by the calling thread alone (a fork costs more), and a
// product takes at most one thread per 128 KiB of matrix, so that many cores do not fork for a
// small weight. At 256 KiB (a 256 × 256 fp32 weight) the split already pays: a batch-1 decode
// step on two threads took 25–28% less than with 1 MiB (docs/BENCHMARKS.md, session 5).
constexpr double kParallelGemvBytes = 1 << 18;

// Panel p of a panel_products call: its weights, where its results go (C at its first column,
// leading dimension ldc) and its width (32, fewer for a product's last panel).
template <typename W>
struct PanelJob {
  PanelOf<W> panel;
  float* c;
  int ldc;
  int width;
};

// Drives the row tiles over `panels` 32-column panels (of one product, or of several that share
// A), split over threads when the products' `flops` are enough. job(p) gives panel p (packing it
// if need be) and its outputs; stored(p) gives the panel only where it is already in memory as it
// will be read ({nullptr, 0} otherwise), for the prefetch.
template <typename W, typename Job, typename Stored>
void panel_products(int M, int K, double flops, float alpha, const InputOf<W>* A, int lda,
                    float beta, int panels, Job job, Stored stored) {
  const bool parallel = flops >= kParallelFlops && !in_parallel();
  parallel_for(panels, parallel, [&](int64_t p) {
    const PanelJob<W> j = job(int(p));
    const PanelOf<W> next = p + 1 < panels ? stored(p + 1) : PanelOf<W>{nullptr, 0};
    const __mmask16 m0 = lane_mask(j.width), m1 = lane_mask(j.width - 16);
    const int tiles = (M + kTileRows - 1) / kTileRows;
    for (int t = 0; t < tiles; ++t) {
      const int m = t * kTileRows, pf_first = kPrefetchStreams * t;
      kTiles<W>[next.p != nullptr && pf_first < K][std::min(kTileRows, M - m)](
          K, A + size_t(m) * lda, lda, j.panel, next, pf_first, kPrefetchStreams * tiles, alpha,
          beta, j.c + size_t(m) * j.ldc, j.ldc, m0, m1);
    }
  });
}

inline bool small_gemm_applies(int M, int K) { return M >= 2 && M <= kSmallGemmMaxRows && K >= 1; }

// The threads a one-row product over `bytes` of weight takes (1: the calling thread alone).
int gemv_threads(double bytes) {
  if (bytes < kParallelGemvBytes || in_parallel()) return 1;
  return int(std::min<double>(compute_threads(), std::max(1.0, 2 * bytes / kParallelGemvBytes)));
}

}  // namespace

bool small_gemm(bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                const float* B, int ldb, float beta, float* C, int ldc) {
  if (!small_gemm_applies(M, K)) return false;
  // op(B) = B with a whole panel: read in place.
  auto in_place = [&](int p) {
    const int n0 = p * kPanel;
    return !trans_b && N - n0 >= kPanel ? Panel{B + n0, size_t(ldb)} : Panel{nullptr, 0};
  };
  auto job = [&](int p) {
    const int n0 = p * kPanel, width = std::min(kPanel, N - n0);
    PanelJob<float> j{in_place(p), C + n0, ldc, width};
    if (!j.panel.p) {
      thread_local std::vector<float> buffer;  // kept between calls: no allocation per product
      buffer.resize(size_t(K) * kPanel);
      pack_panel(trans_b, B, ldb, K, n0, width, buffer.data());
      j.panel = Panel{buffer.data(), size_t(kPanel)};
    }
    return j;
  };
  panel_products<float>(M, K, 2.0 * M * N * K, alpha, A, lda, beta, (N + kPanel - 1) / kPanel, job,
                        in_place);
  return true;
}

int64_t packed_panels_size(int N, int K) { return int64_t((N + kPanel - 1) / kPanel) * kPanel * K; }

bool pack_panels(bool trans_b, const float* B, int ldb, int N, int K, float* out) {
  for (int n0 = 0; n0 < N; n0 += kPanel)
    pack_panel(trans_b, B, ldb, K, n0, std::min(kPanel, N - n0), out + int64_t(n0) * K);
  return true;
}

bool pack_panels(bool trans_b, const float* B, int ldb, int N, int K, uint16_t* out) {
  std::vector<float> panel(size_t(K) * kPanel);
  for (int n0 = 0; n0 < N; n0 += kPanel) {
    pack_panel(trans_b, B, ldb, K, n0, std::min(kPanel, N - n0), panel.data());
    uint16_t* o = out + int64_t(n0) * K;
    for (int k = 0; k < K; ++k)
      for (int j = 0; j < 16; ++j) {
        o[size_t(k) * kPanel + 2 * j] = f32_to_bf16(panel[size_t(k) * kPanel + j]);
        o[size_t(k) * kPanel + 2 * j + 1] = f32_to_bf16(panel[size_t(k) * kPanel + 16 + j]);
      }
  }
  return true;
}

bool bf16_dot_supported() {
#if defined(__AVX512BF16__)
  static const bool cpu_has_it = __builtin_cpu_supports("avx512bf16");
  return cpu_has_it;
#else
  return false;
#endif
}

int64_t packed_pair_panels_size(int N, int K) {
  return int64_t((N + kPanel - 1) / kPanel) * kPanel * ((K + 1) / 2);
}

bool pack_panels(bool trans_b, const float* B, int ldb, int N, int K, uint32_t* out) {
#if defined(__AVX512BF16__)
  const int pairs = (K + 1) / 2;
  std::vector<float> panel(size_t(2 * pairs) * kPanel);  // an odd K's last row stays zero
  for (int n0 = 0; n0 < N; n0 += kPanel) {
    pack_panel(trans_b, B, ldb, K, n0, std::min(kPanel, N - n0), panel.data());
    uint32_t* o = out + int64_t(n0) * pairs;
    for (size_t kk = 0; kk < size_t(pairs); ++kk)
      for (size_t j = 0; j < kPanel; ++j)
        o[kk * kPanel + j] = f32_to_bf16(panel[2 * kk * kPanel + j]) |
                             uint32_t(f32_to_bf16(panel[(2 * kk + 1) * kPanel + j])) << 16;
  }
  return true;
#else
  (void)trans_b, (void)B, (void)ldb, (void)N, (void)K, (void)out;
  return false;
#endif
}

int64_t packed_scales_size(int N, int K) {
  return int64_t((N + kPanel - 1) / kPanel) * ((K + kQuantBlock - 1) / kQuantBlock);
}

bool pack_panels(bool trans_b, const float* B, int ldb, int N, int K, int8_t* out, float* scales) {
  std::vector<float> panel(size_t(K) * kPanel);
  const int blocks = (K + kQuantBlock - 1) / kQuantBlock;
  for (int n0 = 0; n0 < N; n0 += kPanel) {
    pack_panel(trans_b, B, ldb, K, n0, std::min(kPanel, N - n0), panel.data());
    int8_t* o = out + int64_t(n0) * K;
    float* panel_scales = scales + int64_t(n0 / kPanel) * blocks;
    for (int b = 0; b < blocks; ++b) {
      const size_t first = size_t(b) * kQuantBlock * kPanel;
      const size_t last = std::min(size_t(b + 1) * kQuantBlock, size_t(K)) * kPanel;
      float absmax = 0;
      bool finite = true;
      for (size_t i = first; i < last; ++i) {
        finite = finite && std::isfinite(panel[i]);
        absmax = std::max(absmax, std::fabs(panel[i]));
      }
      // A block holding a NaN or an infinity stands for NaNs, as it would poison an fp32 product.
      const float scale = finite ? int8_scale(absmax) : std::numeric_limits<float>::quiet_NaN();
      panel_scales[b] = scale;
      for (size_t i = first; i < last; ++i)
        o[i] = scale > 0 ? int8_t(std::clamp(std::nearbyint(panel[i] / scale), -127.0f, 127.0f)) : 0;
    }
  }
  return true;
}

bool int8_dot_supported() {
#if defined(__AVX512VNNI__)
  static const bool cpu_has_it = __builtin_cpu_supports("avx512vnni");
  return cpu_has_it;
#else
  return false;
#endif
}

int64_t packed_quad_panels_size(int N, int K) {
  return int64_t((N + kPanel - 1) / kPanel) * kPanel * 4 * ((K + 3) / 4);
}

bool pack_panels(bool trans_b, const float* B, int ldb, int N, int K, uint8_t* out, float* scales) {
#if defined(__AVX512VNNI__)
  // Each panel quantized as the int8 panels are (the same q and scales), then regrouped by quads.
  const int quads = (K + 3) / 4, blocks = (K + kQuantBlock - 1) / kQuantBlock;
  std::vector<int8_t> q(size_t(K) * kPanel);
  for (int n0 = 0; n0 < N; n0 += kPanel) {
    pack_panels(trans_b, trans_b ? B + size_t(n0) * size_t(ldb) : B + n0, ldb,
                std::min(kPanel, N - n0), K, q.data(), scales + int64_t(n0 / kPanel) * blocks);
    uint8_t* o = out + int64_t(n0) * 4 * quads;
    for (size_t g = 0; g < size_t(quads); ++g)
      for (size_t j = 0; j < kPanel; ++j)
        for (size_t t = 0; t < 4; ++t) {
          const size_t k = 4 * g + t;
          o[(g * kPanel + j) * 4 + t] = uint8_t((k < size_t(K) ? q[k * kPanel + j] : 0) + 128);
        }
  }
  return true;
#else
  (void)trans_b, (void)B, (void)ldb, (void)N, (void)K, (void)out, (void)scales;
  return false;
#endif
}

namespace {
#if defined(__AVX512VNNI__)
// a[0, K) as Q8Row's q (quads), scale and corr, per block of kQuantBlock.
void quantize_row(const float* a, int K, uint32_t* q, float* scale, int32_t* corr) {
  if (K % 4) q[K / 4] = 0;  // the bytes past K of a last, partial quad
  char* bytes = reinterpret_cast<char*>(q);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int k0 = 0, b = 0; k0 < K; k0 += kQuantBlock, ++b) {
    const __mmask16 m0 = lane_mask(K - k0), m1 = lane_mask(K - k0 - 16);
    const __m512 v0 = _mm512_maskz_loadu_ps(m0, a + k0),
                 v1 = _mm512_maskz_loadu_ps(m1, a + k0 + 16);
    constexpr int kNonFinite = 0x01 | 0x08 | 0x10 | 0x80;  // quiet NaN, ±infinity, signaling NaN
    const bool finite =
        (_mm512_fpclass_ps_mask(v0, kNonFinite) | _mm512_fpclass_ps_mask(v1, kNonFinite)) == 0;
    const float absmax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float s = finite ? int8_scale(absmax) : std::numeric_limits<float>::quiet_NaN();
    __m512i q0 = _mm512_setzero_si512(), q1 = _mm512_setzero_si512();
    if (s > 0) {
      const __m512 vs = _mm512_set1_ps(s);
      constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(v0, vs), kNearest));
      q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(v1, vs), kNearest));
      q0 = _mm512_min_epi32(_mm512_max_epi32(q0, lo), hi);
      q1 = _mm512_min_epi32(_mm512_max_epi32(q1, lo), hi);
    }
    scale[b] = s;
    corr[b] = 128 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    _mm_mask_storeu_epi8(bytes + k0, m0, _mm512_cvtepi32_epi8(q0));
    _mm_mask_storeu_epi8(bytes + k0 + 16, m1, _mm512_cvtepi32_epi8(q1));
  }
}
#endif

// The targets' panels numbered as one sequence, target i's from first[i] (first[n] = the total),
// each target's from its own first column.
struct PanelCount {
  int first[kMaxPackedTargets + 1] = {0};
  int target_of(int p) const {
    int i = 0;
    while (p >= first[i + 1]) ++i;
    return i;
  }
};

template <typename W>
void packed_products_of(int M, int K, float alpha, const InputOf<W>* A, int lda, float beta,
                        const PackedTarget<W>* targets, int n_targets) {
  if (n_targets > kMaxPackedTargets) std::abort();  // a caller's bug: linear.cc checks first
  const int64_t panel_size = int64_t(kRowWidth<W>) * K;
  const int64_t scales_size = (K + kBlockRows<W> - 1) / kBlockRows<W>;
  PanelCount panels, groups;  // groups: of kRowPanels panels of one target, for one row
  double columns = 0;
  for (int i = 0; i < n_targets; ++i) {
    const int n = (targets[i].N + kPanel - 1) / kPanel;
    panels.first[i + 1] = panels.first[i] + n;
    groups.first[i + 1] = groups.first[i] + (n + kRowPanels - 1) / kRowPanels;
    columns += targets[i].N;
  }
  if (M <= 0 || panels.first[n_targets] == 0) return;
  // Panel q of target i.
  auto panel = [&](int i, int q) {
    const PackedTarget<W>& t = targets[i];
    return PanelOf<W>{t.panels + q * panel_size, size_t(kRowWidth<W>),
                      t.scales ? t.scales + q * scales_size : nullptr};
  };
  if (M == 1) {  // groups of kRowPanels panels, split over threads like a one-row product's
    const int n_groups = groups.first[n_targets];
    const int threads =
        std::min(n_groups, gemv_threads(double(sizeof(W)) * kRowWidth<W> / kPanel * columns * K));
    parallel_for(
        n_groups, threads > 1,
        [&](int64_t group) {
          const int g = int(group), i = groups.target_of(g);
          const PackedTarget<W>& t = targets[i];
          const int p0 = (g - groups.first[i]) * kRowPanels;
          const int np = std::min(kRowPanels, panels.first[i + 1] - panels.first[i] - p0);
          __mmask16 masks[2 * kRowPanels];
          for (int p = 0; p < np; ++p) {
            const int width = std::min(kPanel, t.N - (p0 + p) * kPanel);
            masks[2 * p] = lane_mask(width), masks[2 * p + 1] = lane_mask(width - 16);
          }
          kRowPanelsFns<W>[np](K, A, panel(i, p0), panel_size, scales_size, alpha, beta,
                               t.C + int64_t(p0) * kPanel, masks);
        },
        threads);
    return;
  }
  auto job = [&](int p) {
    const int i = panels.target_of(p), q = p - panels.first[i];
    const PackedTarget<W>& t = targets[i];
    return PanelJob<W>{panel(i, q), t.C + int64_t(q) * kPanel, t.ldc,
                       std::min(kPanel, t.N - q * kPanel)};
  };
  panel_products<W>(M, K, 2.0 * M * columns * K, alpha, A, lda, beta, panels.first[n_targets], job,
                    [&](int p) { return job(p).panel; });
}
}  // namespace

void packed_products(int M, int K, float alpha, const float* A, int lda, float beta,
                     const PackedTarget<float>* targets, int n_targets) {
  packed_products_of(M, K, alpha, A, lda, beta, targets, n_targets);
}

void packed_products(int M, int K, float alpha, const float* A, int lda, float beta,
                     const PackedTarget<uint16_t>* targets, int n_targets) {
  packed_products_of(M, K, alpha, A, lda, beta, targets, n_targets);
}

void packed_products(int M, int K, float alpha, const float* A, int lda, float beta,
                     const PackedTarget<int8_t>* targets, int n_targets) {
  packed_products_of(M, K, alpha, A, lda, beta, targets, n_targets);
}

void packed_products(int M, int K, float alpha, const float* A, int lda, float beta,
                     const PackedTarget<uint8_t>* targets, int n_targets) {
#if defined(__AVX512VNNI__)
  if (M <= 0) return;
  // Each row of A quantized once for every panel of every target.
  const int quads = (K + 3) / 4, blocks = (K + kQuantBlock - 1) / kQuantBlock;
  thread_local std::vector<uint32_t> q;  // kept between calls: no allocation per product
  thread_local std::vector<float> scale;
  thread_local std::vector<int32_t> corr;
  thread_local std::vector<Q8Row> rows;
  q.resize(size_t(M) * size_t(quads));
  scale.resize(size_t(M) * size_t(blocks));
  corr.resize(size_t(M) * size_t(blocks));
  rows.resize(size_t(M));
  for (int m = 0; m < M; ++m) {
    const size_t qm = size_t(m) * size_t(quads), bm = size_t(m) * size_t(blocks);
    quantize_row(A + size_t(m) * lda, K, q.data() + qm, scale.data() + bm, corr.data() + bm);
    rows[size_t(m)] = {q.data() + qm, scale.data() + bm, corr.data() + bm};
  }
  packed_products_of(M, quads, alpha, rows.data(), 1, beta, targets, n_targets);
#else
  (void)M, (void)K, (void)alpha, (void)A, (void)lda, (void)beta, (void)targets, (void)n_targets;
  std::abort();  // unreachable: pack_panels packs no quads on these builds
#endif
}

void packed_products(int M, int K, float alpha, const float* A, int lda, float beta,
                     const PackedTarget<uint32_t>* targets, int n_targets) {
#if defined(__AVX512BF16__)
  if (M <= 0) return;
  // Each row of A as bf16 pairs, converted once for every panel of every target
  // (vcvtneps2bf16: nearest-even, subnormals to zero); an odd K's last pair is (a[K - 1], 0).
  const int pairs = (K + 1) / 2;
  thread_local std::vector<uint32_t> a;  // kept between calls: no allocation per product
  a.resize(size_t(M) * size_t(pairs));
  for (int m = 0; m < M; ++m) {
    uint32_t* row = a.data() + size_t(m) * size_t(pairs);
    if (K % 2) row[K / 2] = 0;
    for (int k = 0; k < K; k += 16) {
      const __mmask16 mask = lane_mask(K - k);
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, A + size_t(m) * lda + k));
      _mm256_mask_storeu_epi16(reinterpret_cast<char*>(row) + 2 * size_t(k), mask, __m256i(h));
    }
  }
  packed_products_of(M, pairs, alpha, a.data(), pairs, beta, targets, n_targets);
#else
  (void)M, (void)K, (void)alpha, (void)A, (void)lda, (void)beta, (void)targets, (void)n_targets;
  std::abort();  // unreachable: pack_panels packs no pairs on these builds
#endif
}

bool small_gemv(bool trans_b, int N, int K, float alpha, const float* a, const float* B, int ldb,
                float beta, float* c) {
  if (N < 1 || K < 1) return false;
  const int threads = gemv_threads(4.0 * N * K);
  const bool parallel = threads > 1;
  if (trans_b) {  // one row of outputs per row of B [N, K]
    const int groups = (N + 15) / 16;
    parallel_for(
        groups, parallel,
        [&](int64_t g) {
          gemv_rows(std::min(16, N - 16 * int(g)), K, alpha, a, B + size_t(16 * g) * size_t(ldb),
                    ldb, beta, c + 16 * g);
        },
        threads);
  } else {  // column groups of B [K, N]: 128 wide, so that a 256-wide product splits in two
    constexpr int kCols = 128;
    const int groups = (N + kCols - 1) / kCols;
    parallel_for(
        groups, parallel,
        [&](int64_t g) {
          const int width = std::min(kCols, N - kCols * int(g));
          avx512::for_vectors<GemvCols>((width + 15) / 16, width, K, alpha, a, B + kCols * g, ldb,
                                        beta, c + kCols * g);
        },
        threads);
  }
  return true;
}

}  // namespace cemlm

#else  // no AVX-512 in this build: every product goes to OpenBLAS

#include <cstdlib>

namespace cemlm {
bool small_gemm(bool, int, int, int, float, const float*, int, const float*, int, float, float*,
                int) {
  return false;
}
bool small_gemv(bool, int, int, float, const float*, const float*, int, float, float*) {
  return false;
}
int64_t packed_panels_size(int, int) { return 0; }
bool pack_panels(bool, const float*, int, int, int, float*) { return false; }
bool pack_panels(bool, const float*, int, int, int, uint16_t*) { return false; }
int64_t packed_scales_size(int, int) { return 0; }
bool pack_panels(bool, const float*, int, int, int, int8_t*, float*) { return false; }
bool bf16_dot_supported() { return false; }
int64_t packed_pair_panels_size(int, int) { return 0; }
bool pack_panels(bool, const float*, int, int, int, uint32_t*) { return false; }
bool int8_dot_supported() { return false; }
int64_t packed_quad_panels_size(int, int) { return 0; }
bool pack_panels(bool, const float*, int, int, int, uint8_t*, float*) { return false; }
// Unreachable: pack_panels packs nothing on these builds.
void packed_products(int, int, float, const float*, int, float, const PackedTarget<float>*, int) {
  std::abort();
}
void packed_products(int, int, float, const float*, int, float, const PackedTarget<uint16_t>*,
                     int) {
  std::abort();
}
void packed_products(int, int, float, const float*, int, float, const PackedTarget<int8_t>*, int) {
  std::abort();
}
void packed_products(int, int, float, const float*, int, float, const PackedTarget<uint8_t>*, int) {
  std::abort();
}
void packed_products(int, int, float, const float*, int, float, const PackedTarget<uint32_t>*,
                     int) {
  std::abort();
}
}  // namespace cemlm

#endif
