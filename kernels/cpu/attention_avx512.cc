// AVX-512 passes of the decode attention row (see attention_avx512.h). Scores: 16 tokens' dot
// products accumulate side by side and are reduced together, one vector of 16 scores per head;
// the cache is read token by token, each token's key row and context whole and in order (16
// heads' dot products reduced together, then a 16 × 16 transpose to per-head vectors): reading
// one head's 256 bytes of 16 tokens 4 KB apart, then the next head's, took 2–15% longer at batch
// 32 (docs/BENCHMARKS.md, session 19), for the same bits.
// Sums: each head's output (≤ 256 floats) stays in registers while the tokens stream by; the
// shared diagonal's context sum likewise, 256 columns at a time.
#include "attention_avx512.h"

#if defined(__AVX512F__)

#include <algorithm>
#include <utility>
#include <vector>

#include "avx512_util.h"  // first: it includes immintrin.h with GCC 12's false warnings silenced

namespace cemlm {
namespace {

using avx512::lane_mask;
using avx512::load_row;
using avx512::reduce16;
using avx512::RowSum;
using avx512::transpose16;

// Lane t = x[0, n) · rows[t][col0, col0 + n) for n ≤ 16·V: token by token (one row pointer live
// at a time, two FMA chains each, 16 tokens side by side), then reduced together.
template <int V, typename E>
__m512 dots16_v(const float* x, const E* const* rows, int col0, int n) {
  const __mmask16 last = lane_mask(n - 16 * (V - 1));
  __m512 acc[16];
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    const E* row = rows[t] + col0;
    __m512 a[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i) {
      const __mmask16 m = i == V - 1 ? last : __mmask16(0xFFFF);
      a[i % 2] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + 16 * i), load_row(m, row + 16 * i),
                                 a[i % 2]);
    }
    acc[t] = _mm512_add_ps(a[0], a[1]);
  }
  return reduce16(acc);
}

// Lane h = q[h·dh, …) · key[h·dh, …) for heads h < `heads` (≤ 16) of one token's key row, dh ≤
// 16·V; lanes from `heads` on are 0. Each head's dot product is dots16_v's (the same two FMA chains
// and reduction), so its bits are too; the key row is read in order.
template <int V, typename E>
__m512 head_dots_v(const float* q, const E* key, int dh, int heads) {
  const __mmask16 last = lane_mask(dh - 16 * (V - 1));
  __m512 acc[16];
#pragma GCC unroll 16
  for (int h = 0; h < 16; ++h) {
    __m512 a[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    if (h < heads) {
#pragma GCC unroll 16
      for (int i = 0; i < V; ++i) {
        const __mmask16 m = i == V - 1 ? last : __mmask16(0xFFFF);
        a[i % 2] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + h * dh + 16 * i),
                                   load_row(m, key + h * dh + 16 * i), a[i % 2]);
      }
    }
    acc[h] = _mm512_add_ps(a[0], a[1]);
  }
  return reduce16(acc);
}

// dots16_v<V> and head_dots_v<V> for V = 1 … 16 (structs: __m512's attributes do not survive
// std::array, nor a function pointer type as a template argument).
template <typename E>
struct DotsTable {
  __m512 (*fn[16])(const float*, const E* const*, int, int);
  auto operator[](int i) const { return fn[i]; }
};
template <typename E>
struct HeadDotsTable {
  __m512 (*fn[16])(const float*, const E*, int, int);
  auto operator[](int i) const { return fn[i]; }
};

template <typename E, int... I>
constexpr DotsTable<E> dots_table(std::integer_sequence<int, I...>) {
  return {{&dots16_v<I + 1, E>...}};
}
template <typename E, int... I>
constexpr HeadDotsTable<E> head_dots_table(std::integer_sequence<int, I...>) {
  return {{&head_dots_v<I + 1, E>...}};
}

// Lane t = x[0, n) · rows[t][0, n), 256 columns at a time.
template <typename E>
inline __m512 dots16(const float* x, const E* const* rows, int n) {
  static constexpr DotsTable<E> kDots = dots_table<E>(std::make_integer_sequence<int, 16>{});
  __m512 s = _mm512_setzero_ps();
  for (int c0 = 0; c0 < n; c0 += 256) {
    const int w = std::min(256, n - c0);
    s = _mm512_add_ps(s, kDots[(w + 15) / 16 - 1](x + c0, rows, c0, w));
  }
  return s;
}

// dots16's lanes with each row read whole and in order, four rows side by side (eight FMA chains,
// each vector of x loaded once for the four): a row's partial dot product over each 256-column
// chunk is dots16_v's (two FMA chains), kept until every row is done, and the chunks are reduced
// and added in dots16's order: the same bits. One row at a time, its two chains 8 deep per chunk
// held a prefill's rows (their cache in L2) to the FMA latency. part: 16·16·ceil(n / 256) floats.
template <typename E>
__m512 dots16_by_row(const float* x, const E* const* rows, int n, float* part) {
  constexpr int kSide = 4;
  const int chunks = (n + 255) / 256;
  for (int t0 = 0; t0 < 16; t0 += kSide)
    for (int c = 0; c < chunks; ++c) {
      const int c0 = 256 * c, V = (std::min(256, n - c0) + 15) / 16;
      const __mmask16 last = lane_mask(n - c0 - 16 * (V - 1));
      const float* xc = x + c0;
      const E* row[kSide];
      __m512 a0[kSide], a1[kSide];
#pragma GCC unroll 4
      for (int k = 0; k < kSide; ++k)
        row[k] = rows[t0 + k] + c0, a0[k] = _mm512_setzero_ps(), a1[k] = _mm512_setzero_ps();
      int i = 0;
      for (; i + 1 < V; i += 2) {
        const __mmask16 m1 = i + 1 == V - 1 ? last : __mmask16(0xFFFF);
        const __m512 x0 = _mm512_loadu_ps(xc + 16 * i);
        const __m512 x1 = _mm512_maskz_loadu_ps(m1, xc + 16 * (i + 1));
#pragma GCC unroll 4
        for (int k = 0; k < kSide; ++k) {
          a0[k] = _mm512_fmadd_ps(x0, load_row(0xFFFF, row[k] + 16 * i), a0[k]);
          a1[k] = _mm512_fmadd_ps(x1, load_row(m1, row[k] + 16 * (i + 1)), a1[k]);
        }
      }
      if (i < V) {  // V odd: the last vector, on the first chain
        const __m512 xl = _mm512_maskz_loadu_ps(last, xc + 16 * i);
#pragma GCC unroll 4
        for (int k = 0; k < kSide; ++k)
          a0[k] = _mm512_fmadd_ps(xl, load_row(last, row[k] + 16 * i), a0[k]);
      }
#pragma GCC unroll 4
      for (int k = 0; k < kSide; ++k)
        _mm512_storeu_ps(part + 16 * (16 * c + t0 + k), _mm512_add_ps(a0[k], a1[k]));
    }
  __m512 s = _mm512_setzero_ps();
  for (int c = 0; c < chunks; ++c) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_loadu_ps(part + 16 * (16 * c + t));
    s = _mm512_add_ps(s, reduce16(acc));
  }
  return s;
}

// dst[0, width) (width ≤ 16·V) = Σ_j w[j]·pool[slot(j)·stride + col0 …], two tokens at a time.
template <int V>
struct WeightedSum {
  template <typename E>
  static void run(const KvLayerView& kv, const int32_t* blocks, int n_ctx, const float* w,
                  const E* pool, int stride, int col0, int width, float* dst) {
    RowSum<V> sum(width);
    const int bs = kv.block_size;
    for (int j0 = 0; j0 < n_ctx; j0 += bs) {
      const E* base = pool + int64_t(blocks[j0 / bs]) * bs * stride + col0;
      const float* wj = w + j0;
      const int n = std::min(bs, n_ctx - j0);
      int t = 0;
      for (; t + 2 <= n; t += 2)
        sum.add2(wj[t], base + int64_t(t) * stride, wj[t + 1], base + int64_t(t + 1) * stride);
      if (t < n) sum.add(wj[t], base + int64_t(t) * stride);
    }
    sum.store(dst);
  }
};

// WeightedSum for two heads at once, their columns `gap` apart in each row (V ≤ 4: two sums of
// 2V chains each): each head's sum is the same chain of FMAs as alone, so the same bits, with
// twice the independent work per token and both heads' slices of a row read together.
template <int V>
struct HeadPairSum {
  template <typename E>
  static void run(const KvLayerView& kv, const int32_t* blocks, int n_ctx, const float* w0,
                  const float* w1, const E* pool, int stride, int col0, int gap, int width,
                  float* dst0, float* dst1) {
    RowSum<V> a(width), b(width);
    const int bs = kv.block_size;
    for (int j0 = 0; j0 < n_ctx; j0 += bs) {
      const E* base = pool + int64_t(blocks[j0 / bs]) * bs * stride + col0;
      const float* u = w0 + j0;
      const float* v = w1 + j0;
      const int n = std::min(bs, n_ctx - j0);
      int t = 0;
      for (; t + 2 <= n; t += 2) {
        const E* r0 = base + int64_t(t) * stride;
        const E* r1 = r0 + stride;
        a.add2(u[t], r0, u[t + 1], r1);
        b.add2(v[t], r0 + gap, v[t + 1], r1 + gap);
      }
      if (t < n) {
        a.add(u[t], base + int64_t(t) * stride);
        b.add(v[t], base + int64_t(t) * stride + gap);
      }
    }
    a.store(dst0);
    b.store(dst1);
  }
};

template <typename E>
void weighted_sum(const KvLayerView& kv, const int32_t* blocks, int n_ctx, const float* w,
                  const E* pool, int stride, int col0, int width, float* dst) {
  avx512::for_vectors<WeightedSum>((width + 15) / 16, kv, blocks, n_ctx, w, pool, stride, col0,
                                   width, dst);
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
  thread_local std::vector<float> part_buffer;  // dots16_by_row's partial sums
  part_buffer.resize(size_t(256) * ((D + 255) / 256));
  float* part = part_buffer.data();
  for (int j0 = 0; j0 < n_ctx; j0 += 16) {
    const int n = std::min(16, n_ctx - j0);
    int b = j0 / kv.block_size, o = j0 % kv.block_size;  // walked, not divided, per token
    for (int t = 0; t < 16; ++t) {  // lanes past the end repeat the last token, then are dropped
      const int64_t slot = int64_t(blocks[b]) * kv.block_size + o;
      keys[t] = kpool + slot * W;
      ctx[t] = shared_diag ? cpool + slot * D : nullptr;
      if (t + 1 < n && ++o == kv.block_size) o = 0, ++b;
    }
    const __m512 shared = shared_diag ? dots16_by_row(qd, ctx, D, part) : _mm512_setzero_ps();
    const __mmask16 m = lane_mask(n);
    if (dh <= 256) {  // token by token, each key row read in order; 16 heads at a time
      static constexpr HeadDotsTable<E> kHeadDots =
          head_dots_table<E>(std::make_integer_sequence<int, 16>{});
      const auto head_dots = kHeadDots[(dh + 15) / 16 - 1];
      alignas(64) float by_token[16 * 16], by_head[16 * 16];
      for (int h0 = 0; h0 < H; h0 += 16) {
        const int heads = std::min(16, H - h0);
        for (int t = 0; t < 16; ++t)
          _mm512_store_ps(by_token + 16 * t, head_dots(q + h0 * dh, keys[t] + h0 * dh, dh, heads));
        transpose16(by_token, 16, by_head, 16);
        for (int h = 0; h < heads; ++h) {
          const __m512 s =
              _mm512_mul_ps(vscale, _mm512_add_ps(_mm512_load_ps(by_head + 16 * h), shared));
          _mm512_mask_storeu_ps(sc + int64_t(h0 + h) * n_ctx + j0, m, s);
        }
      }
      continue;
    }
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
  if (out) {
    int h = 0;
    if (dh <= 64)  // two heads at a time
      for (; h + 2 <= H; h += 2) {
        const float* w0 = sc + int64_t(h) * n_ctx;
        const float* w1 = w0 + n_ctx;
        float* d0 = out + h * dh;
        float* d1 = d0 + dh;
        switch ((dh + 15) / 16) {
          case 1:
            HeadPairSum<1>::run(kv, blocks, n_ctx, w0, w1, vpool, W, h * dh, dh, dh, d0, d1);
            break;
          case 2:
            HeadPairSum<2>::run(kv, blocks, n_ctx, w0, w1, vpool, W, h * dh, dh, dh, d0, d1);
            break;
          case 3:
            HeadPairSum<3>::run(kv, blocks, n_ctx, w0, w1, vpool, W, h * dh, dh, dh, d0, d1);
            break;
          default:
            HeadPairSum<4>::run(kv, blocks, n_ctx, w0, w1, vpool, W, h * dh, dh, dh, d0, d1);
        }
      }
    for (; h < H; ++h)
      weighted_sum(kv, blocks, n_ctx, sc + int64_t(h) * n_ctx, vpool, W, h * dh, dh, out + h * dh);
  }
  if (!shared_diag || !oc) return;
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
