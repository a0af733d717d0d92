// CPU paged attention. Long sequences (prefill, training): gather the cached rows, then sgemm per
// head with heads in parallel. Short ones (decode): one query row per work item, keys read in
// place from their blocks (two neighbouring rows of one sequence together where the AVX-512
// passes run, each vector of the cache loaded once for both); when there are fewer rows than
// threads, a long context is split over the threads instead. Either way the shared diagonal's
// scores are computed once per row. A row's result does not depend on the threads (its context
// is attended in chunks at fixed positions, whoever computes them) nor on a neighbour; with
// ctx.batch_invariant (the engine) every row takes the one-row path, so its bits do not depend on
// the batch or on how a prompt was chunked either.
#include "cemlm/kernels/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "attention_avx512.h"
#include "cemlm/kernels/bf16.h"
#include "cemlm/kernels/int8.h"
#include "cemlm/kernels/linear.h"
#include "cemlm/kernels/parallel.h"
#include "cemlm/kernels/simd.h"

namespace cemlm {
namespace {

using simd::dot;

inline void axpy(float a, const float* x, float* y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

// Row → its sequence, for all rows of the batch.
std::vector<int> row_owner(const AttnSeq* seqs, int n_seqs, int* n_rows) {
  int n = 0;
  for (int s = 0; s < n_seqs; ++s) n = std::max(n, seqs[s].row_begin + seqs[s].n_rows);
  std::vector<int> owner(n, -1);
  for (int s = 0; s < n_seqs; ++s)
    for (int r = 0; r < seqs[s].n_rows; ++r) owner[seqs[s].row_begin + r] = s;
  *n_rows = n;
  return owner;
}

// Softmax in place over s[0..n): returns nothing, s becomes probabilities.
inline void softmax_inplace(float* s, int n) {
  float m = s[0];
  for (int j = 1; j < n; ++j) m = std::max(m, s[j]);
  const float inv = float(1.0 / simd::exp_shifted(s, n, m));
  for (int j = 0; j < n; ++j) s[j] *= inv;
}

}  // namespace

KvPoolRef KvPoolRef::keys(const KvLayerView& kv) {
  return {kv.k, kv.k16, kv.k8, kv.k_scale, kv.k_width, kv.n_heads};
}
KvPoolRef KvPoolRef::values(const KvLayerView& kv) {
  return kv.has_values() ? KvPoolRef{kv.v, kv.v16, kv.v8, kv.v_scale, kv.k_width, kv.n_heads}
                         : keys(kv);
}
KvPoolRef KvPoolRef::contexts(const KvLayerView& kv) {
  return {kv.c, kv.c16, kv.c8, kv.c_scale, kv.c_width, 1};
}

namespace {

// One row of `width` numbers at a sequence's position `pos`: fp32, rounded to bf16, or quantized
// to int8 group by group (a group's scale: its largest magnitude / 127; a group holding a NaN or
// an infinity gets a NaN scale, so that it reads back as NaN, as fp32 would keep it).
void put_row(const KvPoolRef& p, const KvLayerView& kv, const int32_t* blocks, int pos,
             const float* row) {
  const int64_t at = kv.entry(blocks, pos, p.width);
  const int cs = kv.column_stride();
  if (p.i8) {
    const int64_t sat = kv.entry(blocks, pos, p.groups);
    const int gw = p.width / p.groups;
    for (int g = 0; g < p.groups; ++g) {
      const float* x = row + g * gw;
      float m = 0.0f;
      bool finite = true;
      for (int i = 0; i < gw; ++i) m = std::max(m, std::fabs(x[i])), finite &= std::isfinite(x[i]);
      // (A finite key near the largest float must not read back infinite, or NaN in a 0 · ∞
      // score: int8_scale's rule.)
      const float s = finite ? int8_scale(m) : NAN;
      p.scale[sat + int64_t(g) * cs] = s;
      for (int i = 0; i < gw; ++i)
        p.i8[at + int64_t(g * gw + i) * cs] =
            s > 0.0f ? int8_t(std::clamp(std::nearbyint(x[i] / s), -127.0f, 127.0f)) : int8_t(0);
    }
  } else if (cs == 1 && p.b16) {
    f32_to_bf16(row, p.b16 + at, p.width);
  } else if (cs == 1) {
    std::memcpy(p.f32 + at, row, sizeof(float) * p.width);
  } else if (p.b16) {
    for (int i = 0; i < p.width; ++i) p.b16[at + int64_t(i) * cs] = f32_to_bf16(row[i]);
  } else {
    for (int i = 0; i < p.width; ++i) p.f32[at + int64_t(i) * cs] = row[i];
  }
}

// kv_write splits its sequences over the threads from this many numbers written. A tiled cache
// puts each of a row's numbers on a line of its own (a column's tokens are contiguous), so a
// decode row's write is a cache miss per number; two threads have twice the misses in flight:
// batch-32 decode steps 4–6% faster on the base shape, 10% on a small model, and 8 rows of the
// small model's 512 numbers each 6% (docs/BENCHMARKS.md, session 34).
constexpr int64_t kParallelWriteFloats = 1 << 11;

}  // namespace

bool tiled_kv_cache_preferred(int block_size) {
  return avx512_attention_built() && block_size % 16 == 0;
}

void kv_write(const ExecCtx&, const KvLayerView& kv, const AttnSeq* seqs, int n_seqs,
              const Tensor& k, const Tensor& v, const Tensor& c) {
  const KvPoolRef keys = KvPoolRef::keys(kv), values = KvPoolRef::values(kv),
                  contexts = KvPoolRef::contexts(kv);
  int64_t rows = 0;
  for (int s = 0; s < n_seqs; ++s) rows += seqs[s].n_rows;
  const int64_t floats = rows * (kv.k_width * (kv.has_values() && !v.empty() ? 2 : 1) +
                                 (kv.has_contexts() && !c.empty() ? kv.c_width : 0));
  parallel_for(n_seqs, floats >= kParallelWriteFloats, [&](int64_t s) {
    const AttnSeq& sq = seqs[s];
    for (int r = 0; r < sq.n_rows; ++r) {
      const int pos = sq.pos_begin + r;
      const int64_t row = sq.row_begin + r;
      put_row(keys, kv, sq.blocks, pos, k.data + row * kv.k_width);
      if (kv.has_values() && !v.empty())
        put_row(values, kv, sq.blocks, pos, v.data + row * kv.k_width);
      if (kv.has_contexts() && !c.empty())
        put_row(contexts, kv, sq.blocks, pos, c.data + row * kv.c_width);
    }
  });
}

namespace {

constexpr int kGemmMinRows = 8;  // below this a sequence's rows take the per-row path

inline bool use_gemm(const AttnSeq& s) { return s.n_rows >= kGemmMinRows; }

// Whether the op runs inside a parallel loop or region (a recursion group's thread, or an OpenMP
// team of one): its own teams then do not fork, whatever OpenMP's nesting settings
// (OMP_NUM_THREADS "2,4" would give an inner region 4 threads, and a team of one's region the 4
// too).
bool in_region() { return in_parallel(); }

// The threads this op's teams use.
int team(bool inside) { return inside ? 1 : compute_threads(); }

// Per thread: every head's scores, for the rows a thread may attend together.
int64_t row_path_floats(int max_ctx, int n_heads, int threads) {
  return kMaxAttnRows * int64_t(n_heads) * max_ctx * threads;
}

// The gathered context, and a score matrix for each thread that takes a head (threads past the
// heads' count get none).
int64_t gemm_path_floats(const AttnSeq& s, const KvLayerView& kv, DiagKind diag, int threads) {
  const int64_t n_ctx = s.pos_begin + s.n_rows, R = s.n_rows;
  int64_t f =
      n_ctx * kv.k_width * (kv.has_values() ? 2 : 1) + R * n_ctx * std::min(threads, kv.n_heads);
  if (diag != DiagKind::kNone) f += n_ctx * kv.c_width;
  if (diag == DiagKind::kShared) f += 2 * R * n_ctx;
  return f;
}

// A row of a pool as contiguous fp32: the row at `at` (its scales at `sat`, for int8), in place,
// or copied (widened from bf16, or int8 times its scales) into `tmp` (width floats).
const float* row_f32(const KvPoolRef& p, int64_t at, int64_t sat, int cs, float* tmp) {
  if (p.i8) {
    const int gw = p.width / p.groups;
    for (int g = 0; g < p.groups; ++g) {
      const float s = p.scale[sat + int64_t(g) * cs];
      for (int i = g * gw; i < (g + 1) * gw; ++i) tmp[i] = float(p.i8[at + int64_t(i) * cs]) * s;
    }
  } else if (cs == 1 && !p.b16) {
    return p.f32 + at;
  } else if (cs == 1) {
    bf16_to_f32(p.b16 + at, tmp, p.width);
  } else {
    for (int i = 0; i < p.width; ++i)
      tmp[i] = p.b16 ? bf16_to_f32(p.b16[at + int64_t(i) * cs]) : p.f32[at + int64_t(i) * cs];
  }
  return tmp;
}

// Token t of the block that holds position j0 (a multiple of the block size) in pool p, as
// contiguous fp32 (row_f32).
const float* token_f32(const KvPoolRef& p, const KvLayerView& kv, const int32_t* blocks, int j0,
                       int t, float* tmp) {
  const int64_t at = kv.entry(blocks, j0, p.width) + kv.token_offset(t, p.width);
  const int64_t sat = p.i8 ? kv.entry(blocks, j0, p.groups) + kv.token_offset(t, p.groups) : 0;
  return row_f32(p, at, sat, kv.column_stride(), tmp);
}

// Copies a sequence's first n_ctx cached rows of one pool into contiguous fp32 [n_ctx, width].
void gather(const KvPoolRef& p, const KvLayerView& kv, const int32_t* blocks, int n_ctx,
            float* out) {
  const int width = p.width;
  for (int j = 0; j < n_ctx; j += kv.block_size) {
    const int n = std::min(kv.block_size, n_ctx - j);
    const int64_t at = kv.entry(blocks, j, width);
    if (kv.tiled || p.i8) {
      for (int t = 0; t < n; ++t) {
        float* dst = out + int64_t(j + t) * width;
        const float* src = token_f32(p, kv, blocks, j, t, dst);
        if (src != dst) std::memcpy(dst, src, sizeof(float) * width);
      }
    } else if (p.b16) {
      bf16_to_f32(p.b16 + at, out + int64_t(j) * width, int64_t(n) * width);
    } else {
      std::memcpy(out + int64_t(j) * width, p.f32 + at, sizeof(float) * n * width);
    }
  }
}

// Scaled, causally masked softmax of each row of S[R, n_ctx]; row r sees columns ≤ pos0 + r.
void masked_softmax_rows(float* S, int R, int n_ctx, int pos0, float scale) {
  for (int r = 0; r < R; ++r) {
    float* row = S + int64_t(r) * n_ctx;
    const int n = pos0 + r + 1;
    for (int j = 0; j < n; ++j) row[j] *= scale;
    softmax_inplace(row, n);
    std::fill(row + n, row + n_ctx, 0.0f);
  }
}

// One sequence with many rows: scores and weighted sums as sgemms, heads in parallel.
void attention_gemm(const ExecCtx& ctx, Tensor out, Tensor out_c, const Tensor& q, const Tensor& qd,
                    DiagKind diag, const KvLayerView& kv, const AttnSeq& s, float scale) {
  const int W = kv.k_width, D = kv.c_width, H = kv.n_heads, dh = W / H;
  const int R = s.n_rows, n_ctx = s.pos_begin + s.n_rows;
  float* kc = ctx.scratch;
  float* vc = kv.has_values() ? kc + int64_t(n_ctx) * W : kc;
  float* next = kc + int64_t(n_ctx) * W * (kv.has_values() ? 2 : 1);
  float* cc = nullptr;
  float* sd = nullptr;
  float* psum = nullptr;
  gather(KvPoolRef::keys(kv), kv, s.blocks, n_ctx, kc);
  if (kv.has_values()) gather(KvPoolRef::values(kv), kv, s.blocks, n_ctx, vc);
  if (diag != DiagKind::kNone) {
    cc = next;
    next += int64_t(n_ctx) * D;
    gather(KvPoolRef::contexts(kv), kv, s.blocks, n_ctx, cc);
  }
  const float* qs = q.data + int64_t(s.row_begin) * W;
  float* os = out.data + int64_t(s.row_begin) * W;
  if (diag == DiagKind::kShared) {  // the diagonal score is shared by every head: once
    sd = next;
    psum = sd + int64_t(R) * n_ctx;
    next = psum + int64_t(R) * n_ctx;
    gemm(false, true, R, n_ctx, D, 1.0f, qd.data + int64_t(s.row_begin) * D, D, cc, D, 0.0f, sd,
         n_ctx);
    std::fill(psum, psum + int64_t(R) * n_ctx, 0.0f);
  }
  // Heads round-robin; the shared diagonal's sum over heads is added in head order (ordered),
  // so the result does not depend on thread timing.
#pragma omp parallel for schedule(static, 1) ordered if (!in_region())
  for (int h = 0; h < H; ++h) {
    float* S = next + int64_t(omp_get_thread_num()) * R * n_ctx;
    if (diag == DiagKind::kShared) std::copy(sd, sd + int64_t(R) * n_ctx, S);
    if (diag == DiagKind::kPerHead)
      gemm(false, true, R, n_ctx, D, 1.0f, qd.data + (int64_t(s.row_begin) * H + h) * D, H * D, cc,
           D, 0.0f, S, n_ctx);
    gemm(false, true, R, n_ctx, dh, 1.0f, qs + h * dh, W, kc + h * dh, W,
         diag == DiagKind::kNone ? 0.0f : 1.0f, S, n_ctx);
    masked_softmax_rows(S, R, n_ctx, s.pos_begin, scale);
    gemm(false, false, R, dh, n_ctx, 1.0f, S, n_ctx, vc + h * dh, W, 0.0f, os + h * dh, W);
    if (diag == DiagKind::kPerHead)
      gemm(false, false, R, D, n_ctx, 1.0f, S, n_ctx, cc, D, 0.0f,
           out_c.data + (int64_t(s.row_begin) * H + h) * D, H * D);
    if (diag == DiagKind::kShared) {
#pragma omp ordered
      for (int64_t e = 0; e < int64_t(R) * n_ctx; ++e) psum[e] += S[e];
    }
  }
  if (diag == DiagKind::kShared)
    gemm(false, false, R, D, n_ctx, 1.0f, psum, n_ctx, cc, D, 0.0f,
         out_c.data + int64_t(s.row_begin) * D, D);
}

// Per-thread room for one widened key (or value) row and one context row.
float* row_buffers(const KvLayerView& kv) {
  thread_local std::vector<float> buf;
  buf.resize(size_t(kv.k_width + kv.c_width));
  return buf.data();
}

// Portable scores of one row: sc[h·n_ctx + j], each token's key row (all heads) and context read
// once. qd: [D] (shared) or [H, D] (per-head); unused for kNone.
void row_scores(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag,
                const float* q, const float* qd, float scale, float* sc) {
  const int W = kv.k_width, D = kv.c_width, H = kv.n_heads, dh = W / H, bs = kv.block_size;
  const KvPoolRef keys = KvPoolRef::keys(kv), contexts = KvPoolRef::contexts(kv);
  float* tk = row_buffers(kv);
  float* tc = tk + W;
  for (int j0 = 0; j0 < n_ctx; j0 += bs) {
    const int n = std::min(bs, n_ctx - j0);
    for (int t = 0; t < n; ++t) {
      const float* kj = token_f32(keys, kv, blocks, j0, t, tk);
      const float* cj =
          diag == DiagKind::kNone ? nullptr : token_f32(contexts, kv, blocks, j0, t, tc);
      const float shared = diag == DiagKind::kShared ? dot(qd, cj, D) : 0.0f;  // once, all heads
      for (int h = 0; h < H; ++h) {
        float e = dot(q + h * dh, kj + h * dh, dh) + shared;
        if (diag == DiagKind::kPerHead) e += dot(qd + int64_t(h) * D, cj, D);
        sc[int64_t(h) * n_ctx + j0 + t] = scale * e;
      }
    }
  }
}

// Portable weighted sums of one row from the weights in sc; the shared diagonal's weight of token
// j is the sum of its heads' weights. out (the keys' or values' sums) or oc (the contexts': [D]
// shared, [H, D] per-head) may be null, and that part is skipped.
void row_sums(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag,
              const float* sc, float* out, float* oc) {
  const int W = kv.k_width, D = kv.c_width, H = kv.n_heads, dh = W / H, bs = kv.block_size;
  const KvPoolRef values = KvPoolRef::values(kv), cpool = KvPoolRef::contexts(kv);
  float* tv = row_buffers(kv);
  float* tc = tv + W;
  const bool contexts = oc && diag != DiagKind::kNone;
  if (out) std::memset(out, 0, sizeof(float) * W);
  if (contexts)
    std::memset(oc, 0, sizeof(float) * (diag == DiagKind::kPerHead ? int64_t(H) * D : D));
  for (int j0 = 0; j0 < n_ctx; j0 += bs) {
    const int n = std::min(bs, n_ctx - j0);
    for (int t = 0; t < n; ++t) {
      const int j = j0 + t;
      const float* vj = out ? token_f32(values, kv, blocks, j0, t, tv) : nullptr;
      const float* cj = contexts ? token_f32(cpool, kv, blocks, j0, t, tc) : nullptr;
      float w = 0.0f;
      for (int h = 0; h < H; ++h) {
        const float p = sc[int64_t(h) * n_ctx + j];
        if (out) axpy(p, vj + h * dh, out + h * dh, dh);
        if (contexts && diag == DiagKind::kPerHead) axpy(p, cj, oc + int64_t(h) * D, D);
        w += p;
      }
      if (contexts && diag == DiagKind::kShared) axpy(w, cj, oc, D);
    }
  }
}

// The two passes over n_ctx cached tokens from `blocks`, read in place block by block, for one
// row or two (AVX-512 where the build, the layout and the diagonal kind allow; the portable loops
// take the rows one by one).
void score_pass(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag,
                const AttnRows& rows, float scale) {
  if (rows_avx512(kv)) return row_scores_avx512(kv, blocks, n_ctx, diag, rows, scale);
  for (int r = 0; r < rows.n; ++r)
    row_scores(kv, blocks, n_ctx, diag, rows.q[r], rows.qd[r], scale, rows.sc[r]);
}
void sum_pass(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag,
              const AttnRows& rows) {
  if (rows_avx512(kv)) return row_sums_avx512(kv, blocks, n_ctx, diag, rows);
  for (int r = 0; r < rows.n; ++r)
    row_sums(kv, blocks, n_ctx, diag, rows.sc[r], rows.out[r], rows.oc[r]);
}

// A row's context is attended in chunks of kChunkTokens tokens (rounded down to whole blocks,
// one block at least) at fixed positions: each chunk's scores are exponentiated against its own
// per-head maximum and its values summed with those weights at once; the chunks' maxima and sums
// make the global softmax (in chunk order), which scales each chunk's value sums and weighs its
// contexts' sums, each chunk's into a partial output, and the partials are added in chunk order.
// Run on one thread (attend_rows), with the chunks shared out over a team (attend_row_split), or
// beside its neighbour row of a prefill (attend_rows), a row does the same arithmetic: its bits do
// not depend on the threads, on the rest of the batch or on how a prompt was chunked.
// 64 tokens (it was 256) lets a lone decode row of 128 tokens or more share its context out: a
// batch-1 step of the base shape at T = 4 on cpu:int8dot ran 4–5% faster; batch 32 (no split)
// and the small shape were unchanged (docs/BENCHMARKS.md, session 19).
constexpr int kChunkTokens = 64;

int chunk_tokens(int block_size) { return std::max(1, kChunkTokens / block_size) * block_size; }

// Per-chunk bookkeeping of one row: n_chunks × H maxima and sums, then n_chunks partial outputs
// of `stride` floats (the output's W columns, then the diagonal context sums' oc_width).
struct RowChunks {
  int n_ctx, chunk, n_chunks, H;
  int64_t stride;
  float* maxima;  // [n_chunks][H]
  float* sums;    // [n_chunks][H]: Σ exp(s − the chunk's maximum)
  float* shares;  // [n_chunks][H]: the chunk's share of the row's softmax, exp(m_c − M) / L
  float* parts;   // [n_chunks][stride]
  int begin(int c) const { return c * chunk; }
  int size(int c) const { return std::min(chunk, n_ctx - c * chunk); }
};

int64_t row_chunks_floats(int n_chunks, int H, int64_t stride) {
  return 3 * int64_t(n_chunks) * H + int64_t(n_chunks) * stride;
}

RowChunks row_chunks(const KvLayerView& kv, int n_ctx, int64_t oc_width, float* mem) {
  RowChunks r;
  r.n_ctx = n_ctx, r.chunk = chunk_tokens(kv.block_size), r.H = kv.n_heads;
  r.n_chunks = (n_ctx + r.chunk - 1) / r.chunk;
  r.stride = kv.k_width + oc_width;
  const int64_t per = int64_t(r.n_chunks) * r.H;
  r.maxima = mem, r.sums = mem + per, r.shares = mem + 2 * per, r.parts = mem + 3 * per;
  return r;
}

// The shares of chunks [c0, c1), once every chunk is scored: per head, M and L over all chunks
// (in chunk order) once, not once per chunk (that took ~1000 exps per 512-token row and layer).
void chunk_shares(const RowChunks& r, int c0, int c1) {
  for (int h = 0; h < r.H; ++h) {
    float M = -INFINITY;
    for (int u = 0; u < r.n_chunks; ++u) M = std::max(M, r.maxima[int64_t(u) * r.H + h]);
    double L = 0;
    for (int u = 0; u < r.n_chunks; ++u)
      L += double(r.sums[int64_t(u) * r.H + h]) *
           std::exp(double(r.maxima[int64_t(u) * r.H + h] - M));
    for (int c = c0; c < c1; ++c)
      r.shares[int64_t(c) * r.H + h] =
          float(std::exp(double(r.maxima[int64_t(c) * r.H + h] - M)) / L);
  }
}

// Chunk c of rows.n rows (row i's bookkeeping rc[i]) whose chunk c holds the same tokens: the
// scores into rows.sc[i] (H·size floats), exponentiated against each head's maximum, and the
// values' sums with those weights into rows.out[i] (the chunk's partial, W floats) while the
// chunk's rows are still in L2 (read again after every chunk's scores, from L3 or memory, they
// took a fifth of a long row's time).
void chunk_scores(const KvLayerView& kv, const int32_t* blocks, const RowChunks* const* rc, int c,
                  DiagKind diag, AttnRows rows, float scale) {
  const int n = rc[0]->size(c), H = kv.n_heads;
  const int32_t* chunk_blocks = blocks + rc[0]->begin(c) / kv.block_size;
  score_pass(kv, chunk_blocks, n, diag, rows, scale);
  for (int i = 0; i < rows.n; ++i)
    for (int h = 0; h < H; ++h) {
      float* sh = rows.sc[i] + int64_t(h) * n;
      float m = sh[0];
      for (int j = 1; j < n; ++j) m = std::max(m, sh[j]);
      rc[i]->maxima[int64_t(c) * H + h] = m;
      if (m == -INFINITY) {  // every score -inf (overflowed): weight 0, not exp(-inf + inf) = NaN
        std::fill(sh, sh + n, 0.0f);
        rc[i]->sums[int64_t(c) * H + h] = 0;
        continue;
      }
      rc[i]->sums[int64_t(c) * H + h] = float(simd::exp_shifted(sh, n, m));
    }
  for (int i = 0; i < rows.n; ++i) rows.oc[i] = nullptr;
  sum_pass(kv, chunk_blocks, n, diag, rows);
}

// With chunk c's share of each row's whole softmax, per head (chunk_shares): its value sums in
// rows.out[i] (the chunk's partial) scaled by it and, with a diagonal, its exponentiated scores
// rows.sc[i] made probabilities and the contexts' sums taken into the partial's [W, stride).
void chunk_sums(const KvLayerView& kv, const int32_t* blocks, const RowChunks* const* rc, int c,
                DiagKind diag, AttnRows rows) {
  const int n = rc[0]->size(c), H = kv.n_heads, W = kv.k_width, dh = W / H;
  const bool contexts = rc[0]->stride > W;
  for (int i = 0; i < rows.n; ++i) {
    for (int h = 0; h < H; ++h) {
      const float f = rc[i]->shares[int64_t(c) * H + h];
      for (int k = 0; k < dh; ++k) rows.out[i][h * dh + k] *= f;
      if (!contexts) continue;
      float* sh = rows.sc[i] + int64_t(h) * n;
      for (int j = 0; j < n; ++j) sh[j] *= f;
    }
    rows.oc[i] = rows.out[i] + W;
    rows.out[i] = nullptr;
  }
  if (contexts) sum_pass(kv, blocks + rc[0]->begin(c) / kv.block_size, n, diag, rows);
}

// One query row, or up to four neighbours of one sequence (row i at the first's position + i,
// attending to i tokens more), against the first n_ctx (+ i) cached tokens, on the calling
// thread. rows: q, qd, out, oc per row; sc[i]: H·(n_ctx + i) floats; mem[i]:
// row_chunks_floats(n_chunks, H, stride). Rows whose chunk holds the same tokens (all but the
// last chunks) go through the passes together, two or four at a time, each cache vector loaded
// once for them.
void attend_rows(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag,
                 const AttnRows& rows, float scale, float* const* mem, int64_t oc_width) {
  const int W = kv.k_width, H = kv.n_heads;
  RowChunks rc[kMaxAttnRows] = {};  // rows.n of them set below
  for (int i = 0; i < rows.n; ++i) rc[i] = row_chunks(kv, n_ctx + i, oc_width, mem[i]);
  // Chunk c's rows in sets of 4, 2 or 1 among those for which it holds the same tokens.
  auto each_set = [&](int c, auto&& pass) {
    auto run = [&](int first, int count) {
      AttnRows sub;
      sub.n = count;
      const RowChunks* set[kMaxAttnRows];
      for (int k = 0; k < count; ++k) {
        const int i = first + k;
        set[k] = &rc[i];
        sub.q[k] = rows.q[i], sub.qd[k] = rows.qd[i];
        sub.sc[k] = rows.sc[i] + int64_t(H) * rc[i].begin(c);
        sub.out[k] = rc[i].parts + c * rc[i].stride;
      }
      pass(set, sub);
    };
    for (int i = 0; i < rows.n;) {
      int same = 1;  // the rows from i on whose chunk c is as long as row i's
      while (i + same < rows.n && rc[i + same].size(c) == rc[i].size(c)) ++same;
      if (c < rc[i].n_chunks)
        for (int done = 0; done < same;) {
          const int k = same - done >= 4 ? 4 : same - done >= 2 ? 2 : 1;
          run(i + done, k);
          done += k;
        }
      i += same;
    }
  };
  const int n_chunks = rc[rows.n - 1].n_chunks;
  for (int c = 0; c < n_chunks; ++c)
    each_set(c, [&](const RowChunks* const* set, const AttnRows& sub) {
      chunk_scores(kv, blocks, set, c, diag, sub, scale);
    });
  for (int i = 0; i < rows.n; ++i) chunk_shares(rc[i], 0, rc[i].n_chunks);
  // The contexts' sums from the last chunk back: the score pass left the last chunks' cache rows
  // in L2 (5–7% off the attention of 32 rows at 256–1024 tokens, docs/BENCHMARKS.md session 20).
  // Each chunk has its own partial, added in chunk order: the same bits in either order.
  for (int c = n_chunks - 1; c >= 0; --c)
    each_set(c, [&](const RowChunks* const* set, const AttnRows& sub) {
      chunk_sums(kv, blocks, set, c, diag, sub);
    });
  for (int i = 0; i < rows.n; ++i) {
    const RowChunks& r = rc[i];
    std::fill(rows.out[i], rows.out[i] + W, 0.0f);
    if (oc_width) std::fill(rows.oc[i], rows.oc[i] + oc_width, 0.0f);
    for (int c = 0; c < r.n_chunks; ++c) {
      const float* part = r.parts + c * r.stride;
      for (int k = 0; k < W; ++k) rows.out[i][k] += part[k];
      for (int64_t k = 0; k < oc_width; ++k) rows.oc[i][k] += part[W + k];
    }
  }
}

// attend_rows for one row with the chunks shared out over the calling parallel region's threads
// (a batch-1 decode step would otherwise read a long cache on one thread), the partial outputs
// added up with the columns split over the threads. row.sc[0]: this thread's H·n_ctx floats;
// mem (shared by the team): row_chunks_floats(n_chunks, H, stride).
void attend_row_split(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag,
                      const AttnRows& row, float scale, float* mem, int64_t oc_width) {
  const int P = team_size(), t = team_thread();
  const RowChunks r = row_chunks(kv, n_ctx, oc_width, mem);
  const RowChunks* set[1] = {&r};
  const int c0 = int(int64_t(r.n_chunks) * t / P), c1 = int(int64_t(r.n_chunks) * (t + 1) / P);
  auto chunk = [&](int c) {
    AttnRows sub = row;
    sub.sc[0] = row.sc[0] + int64_t(r.H) * (r.begin(c) - r.begin(c0));
    sub.out[0] = r.parts + c * r.stride;
    return sub;
  };
  for (int c = c0; c < c1; ++c) chunk_scores(kv, blocks, set, c, diag, chunk(c), scale);
  team_barrier();
  chunk_shares(r, c0, c1);
  for (int c = c0; c < c1; ++c) chunk_sums(kv, blocks, set, c, diag, chunk(c));
  team_barrier();
  const int W = kv.k_width;
  for (int64_t i = r.stride * t / P; i < r.stride * (t + 1) / P; ++i) {
    float v = 0;
    for (int c = 0; c < r.n_chunks; ++c) v += r.parts[c * r.stride + i];
    (i < W ? row.out[0][i] : row.oc[0][i - W]) = v;
  }
}

}  // namespace

int64_t paged_attention_scratch_floats(const AttnSeq* seqs, int n_seqs, const KvLayerView& kv,
                                       DiagKind diag, bool inside, bool batch_invariant) {
  const int threads = team(inside);
  int max_ctx = 0;
  int64_t need = 0;
  for (int i = 0; i < n_seqs; ++i) {
    max_ctx = std::max(max_ctx, seqs[i].pos_begin + seqs[i].n_rows);
    if (!batch_invariant && use_gemm(seqs[i]))
      need = std::max(need, gemm_path_floats(seqs[i], kv, diag, threads));
  }
  return std::max(need, row_path_floats(max_ctx, kv.n_heads, threads));
}

void paged_attention_forward(const ExecCtx& ctx, Tensor out, Tensor out_c, const Tensor& q,
                             const Tensor& qd, DiagKind diag, const KvLayerView& kv,
                             const AttnSeq* seqs, int n_seqs, float scale) {
  const int W = kv.k_width, D = kv.c_width, H = kv.n_heads;
  CEMLM_CHECK(q.dim(-1) == W && out.dim(-1) == W);
  CEMLM_CHECK(diag == DiagKind::kNone || (kv.has_contexts() && !qd.empty() && !out_c.empty()));
  CEMLM_CHECK(ctx.scratch_floats >= paged_attention_scratch_floats(
                                        seqs, n_seqs, kv, diag, in_region(), ctx.batch_invariant));
  int n_rows = 0;
  std::vector<int> owner = row_owner(seqs, n_seqs, &n_rows);
  int max_ctx = 0;
  for (int s = 0; s < n_seqs; ++s) {
    max_ctx = std::max(max_ctx, seqs[s].pos_begin + seqs[s].n_rows);
    if (ctx.batch_invariant || !use_gemm(seqs[s])) continue;
    attention_gemm(ctx, out, out_c, q, qd, diag, kv, seqs[s], scale);
    for (int r = 0; r < seqs[s].n_rows; ++r) owner[seqs[s].row_begin + r] = -1;  // done
  }
  const int64_t oc_width = diag == DiagKind::kNone      ? 0
                           : diag == DiagKind::kPerHead ? int64_t(H) * D
                                                        : D;
  // Row i's pointers, as one row of an AttnRows.
  auto row_of = [&](int i) {
    AttnRows r;
    r.q[0] = q.data + int64_t(i) * W;
    r.qd[0] = oc_width ? qd.data + i * oc_width : nullptr;
    r.out[0] = out.data + int64_t(i) * W;
    r.oc[0] = oc_width ? out_c.data + i * oc_width : nullptr;
    return r;
  };
  auto context_of = [&](int i) {
    const AttnSeq& sq = seqs[owner[i]];
    return sq.pos_begin + (i - sq.row_begin) + 1;
  };
  // Rows too few to occupy every thread, with long contexts, share their chunks out over threads
  // (the same bits as on one thread): a thread for every ctx.attention_split_bytes of the row's
  // cache at most. The split costs a team and two barriers, and its chunks' partial sums: below
  // 512 KiB for two threads it lost (a small model's batch-1 step at 128 tokens, 256 KiB of cache
  // per row, ran 13% faster unsplit under libgomp and 10–15% on cemlm's pool; at 256 tokens they
  // ran alike, at 512 and 1008 the split was 15–25% faster, and on the base shape at 128 tokens,
  // 1 MiB, too; docs/BENCHMARKS.md, sessions 30 and 31).
  const int64_t token_bytes =
      (int64_t(kv.k_width) * (kv.has_values() ? 2 : 1) + (kv.has_contexts() ? kv.c_width : 0)) *
      (kv.int8()   ? 1
       : kv.bf16() ? 2
                   : 4);
  const int threads = compute_threads();
  const int pending = int(std::count_if(owner.begin(), owner.end(), [](int s) { return s >= 0; }));
  const int chunk = chunk_tokens(kv.block_size);
  const int64_t stride = W + oc_width;
  auto chunks_of = [&](int n_ctx) { return (n_ctx + chunk - 1) / chunk; };
  if (threads > 1 && pending < threads && !in_region())
    for (int i = 0; i < n_rows; ++i) {
      if (owner[i] < 0) continue;
      const int n_ctx = context_of(i);
      const int P = int(std::min<int64_t>(
          {threads, n_ctx / kChunkTokens,
           n_ctx * token_bytes / std::max<int64_t>(1, ctx.attention_split_bytes)}));
      if (P < 2) continue;
      thread_local std::vector<float> mem;
      mem.resize(size_t(row_chunks_floats(chunks_of(n_ctx), H, stride)));
      float* mem_data = mem.data();
      const AttnRows row = row_of(i);
      parallel_team(P, [&] {
        AttnRows mine = row;
        mine.sc[0] = ctx.scratch + kMaxAttnRows * int64_t(H) * max_ctx * team_thread();
        attend_row_split(kv, seqs[owner[i]].blocks, n_ctx, diag, mine, scale, mem_data, oc_width);
      });
      owner[i] = -1;
    }
  // The rest one by one, or in fours of neighbours of one sequence (a prefill's rows) where the
  // AVX-512 passes can take several rows at once.
  const int group = rows_avx512(kv) ? kMaxAttnRows : 1;
  std::vector<std::pair<int, int>> units;  // (first row, rows)
  for (int i = 0; i < n_rows;) {
    if (owner[i] < 0) {
      ++i;
      continue;
    }
    int n = 1;
    while (n < group && i + n < n_rows && owner[i + n] == owner[i]) ++n;
    units.emplace_back(i, n);
    i += n;
  }
  // The units claimed one at a time by the threads (each with its own scratch slot and buffers)
  // or on the calling thread alone (slot 0: a caller inside a team passes its own thread's
  // scratch).
  const bool team = !in_region() && units.size() > 1;
  const int64_t per_row = row_chunks_floats(chunks_of(std::max(max_ctx, 1)), H, stride);
  parallel_for_dynamic(int64_t(units.size()), team, [&](int64_t u) {
    float* sc = ctx.scratch + kMaxAttnRows * int64_t(H) * max_ctx * (team ? team_thread() : 0);
    thread_local std::vector<float> mem;
    mem.resize(size_t(kMaxAttnRows * per_row));
    float* row_mem[kMaxAttnRows];
    for (int k = 0; k < kMaxAttnRows; ++k) row_mem[k] = mem.data() + k * per_row;
    const int i = units[size_t(u)].first;
    AttnRows rows;
    rows.n = units[size_t(u)].second;
    for (int k = 0; k < rows.n; ++k) {
      const AttnRows one = row_of(i + k);
      rows.q[k] = one.q[0], rows.qd[k] = one.qd[0], rows.out[k] = one.out[0],
      rows.oc[k] = one.oc[0], rows.sc[k] = sc + k * int64_t(H) * max_ctx;
    }
    attend_rows(kv, seqs[owner[i]].blocks, context_of(i), diag, rows, scale, row_mem, oc_width);
  });
}

}  // namespace cemlm
