// CPU paged attention. Long sequences (prefill, training): gather the cached rows, then sgemm per
// head with heads in parallel. Short ones (decode): one query row per work item, keys read in
// place from their blocks; when there are fewer such rows than threads, a long context is split
// over the threads instead. Either way the shared diagonal's scores are computed once per row.
// A row's result does not depend on the threads (its context is attended in chunks at fixed
// positions, whoever computes them); with ctx.batch_invariant (the engine) every row takes the
// one-row path, so its bits do not depend on the batch or on how a prompt was chunked either.
#include "cemlm/kernels/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention_avx512.h"
#include "cemlm/kernels/bf16.h"
#include "cemlm/kernels/linear.h"
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

// One row of `width` numbers into slot `slot` of a pool, fp32 or rounded to bf16.
void put_row(float* p32, uint16_t* p16, int64_t slot, int width, const float* row) {
  if (p16)
    f32_to_bf16(row, p16 + slot * width, width);
  else
    std::memcpy(p32 + slot * width, row, sizeof(float) * width);
}

}  // namespace

void kv_write(const ExecCtx&, const KvLayerView& kv, const AttnSeq* seqs, int n_seqs,
              const Tensor& k, const Tensor& v, const Tensor& c) {
  for (int s = 0; s < n_seqs; ++s) {
    const AttnSeq& sq = seqs[s];
    for (int r = 0; r < sq.n_rows; ++r) {
      const int64_t slot = kv.slot(sq.blocks, sq.pos_begin + r);
      const int64_t row = sq.row_begin + r;
      put_row(kv.k, kv.k16, slot, kv.k_width, k.data + row * kv.k_width);
      if (kv.has_values() && !v.empty())
        put_row(kv.v, kv.v16, slot, kv.k_width, v.data + row * kv.k_width);
      if (kv.has_contexts() && !c.empty())
        put_row(kv.c, kv.c16, slot, kv.c_width, c.data + row * kv.c_width);
    }
  }
}

namespace {

constexpr int kGemmMinRows = 8;  // below this a sequence's rows take the per-row path

inline bool use_gemm(const AttnSeq& s) { return s.n_rows >= kGemmMinRows; }

// Whether the op runs inside a parallel region, active or not (a recursion group's thread, or a
// team of one). Its own regions then do not fork, whatever the nesting settings (OMP_NUM_THREADS
// "2,4" would give an inner region 4 threads, and a team of one's region the 4 too).
bool in_region() { return omp_get_level() > 0; }

// The threads this op's parallel regions use.
int team(bool inside) { return inside ? 1 : omp_get_max_threads(); }

// Per thread: every head's scores.
int64_t row_path_floats(int max_ctx, int n_heads, int threads) {
  return int64_t(n_heads) * max_ctx * threads;
}

int64_t gemm_path_floats(const AttnSeq& s, const KvLayerView& kv, DiagKind diag, int threads) {
  const int64_t n_ctx = s.pos_begin + s.n_rows, R = s.n_rows;
  int64_t f = n_ctx * kv.k_width * (kv.has_values() ? 2 : 1) + R * n_ctx * threads;
  if (diag != DiagKind::kNone) f += n_ctx * kv.c_width;
  if (diag == DiagKind::kShared) f += 2 * R * n_ctx;
  return f;
}

// Copies a sequence's first n_ctx cached rows of one pool (fp32 p32, or bf16 p16 widened) into
// contiguous fp32 [n_ctx, width].
void gather(const float* p32, const uint16_t* p16, int width, const KvLayerView& kv,
            const int32_t* blocks, int n_ctx, float* out) {
  for (int j = 0; j < n_ctx; j += kv.block_size) {
    const int n = std::min(kv.block_size, n_ctx - j);
    const int64_t at = kv.slot(blocks, j) * width;
    if (p16)
      bf16_to_f32(p16 + at, out + int64_t(j) * width, int64_t(n) * width);
    else
      std::memcpy(out + int64_t(j) * width, p32 + at, sizeof(float) * n * width);
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
  gather(kv.k, kv.k16, W, kv, s.blocks, n_ctx, kc);
  if (kv.has_values()) gather(kv.v, kv.v16, W, kv, s.blocks, n_ctx, vc);
  if (diag != DiagKind::kNone) {
    cc = next;
    next += int64_t(n_ctx) * D;
    gather(kv.c, kv.c16, D, kv, s.blocks, n_ctx, cc);
  }
  const float* qs = q.data + int64_t(s.row_begin) * W;
  float* os = out.data + int64_t(s.row_begin) * W;
  if (diag == DiagKind::kShared) {  // the diagonal score is shared by every head: once
    sd = next;
    psum = sd + int64_t(R) * n_ctx;
    next = psum + int64_t(R) * n_ctx;
    gemm(false, true, R, n_ctx, D, 1.0f, qd.data + int64_t(s.row_begin) * D, D, cc, D, 0.0f, sd, n_ctx);
    std::fill(psum, psum + int64_t(R) * n_ctx, 0.0f);
  }
  // Heads round-robin; the shared diagonal's sum over heads is added in head order (ordered),
  // so the result does not depend on thread timing.
#pragma omp parallel for schedule(static, 1) ordered if (!in_region())
  for (int h = 0; h < H; ++h) {
    float* S = next + int64_t(omp_get_thread_num()) * R * n_ctx;
    if (diag == DiagKind::kShared) std::copy(sd, sd + int64_t(R) * n_ctx, S);
    if (diag == DiagKind::kPerHead)
      gemm(false, true, R, n_ctx, D, 1.0f, qd.data + (int64_t(s.row_begin) * H + h) * D, H * D, cc, D,
           0.0f, S, n_ctx);
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

// Row `slot` of a pool as fp32: in place, or widened from bf16 into `tmp` (width floats).
const float* row_f32(const float* p32, const uint16_t* p16, int64_t slot, int width, float* tmp) {
  if (!p16) return p32 + slot * width;
  bf16_to_f32(p16 + slot * width, tmp, width);
  return tmp;
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
  float* tk = row_buffers(kv);
  float* tc = tk + W;
  for (int j0 = 0; j0 < n_ctx; j0 += bs) {
    const int64_t slot0 = int64_t(blocks[j0 / bs]) * bs;
    const int n = std::min(bs, n_ctx - j0);
    for (int t = 0; t < n; ++t) {
      const float* kj = row_f32(kv.k, kv.k16, slot0 + t, W, tk);
      const float* cj = diag == DiagKind::kNone ? nullptr : row_f32(kv.c, kv.c16, slot0 + t, D, tc);
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
  const float* v32 = kv.has_values() ? kv.v : kv.k;
  const uint16_t* v16 = kv.has_values() ? kv.v16 : kv.k16;
  float* tv = row_buffers(kv);
  float* tc = tv + W;
  const bool contexts = oc && diag != DiagKind::kNone;
  if (out) std::memset(out, 0, sizeof(float) * W);
  if (contexts)
    std::memset(oc, 0, sizeof(float) * (diag == DiagKind::kPerHead ? int64_t(H) * D : D));
  for (int j0 = 0; j0 < n_ctx; j0 += bs) {
    const int64_t slot0 = int64_t(blocks[j0 / bs]) * bs;
    const int n = std::min(bs, n_ctx - j0);
    for (int t = 0; t < n; ++t) {
      const int j = j0 + t;
      const float* vj = out ? row_f32(v32, v16, slot0 + t, W, tv) : nullptr;
      const float* cj = contexts ? row_f32(kv.c, kv.c16, slot0 + t, D, tc) : nullptr;
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

// A row's two passes over n_ctx cached tokens from `blocks`, read in place block by block
// (AVX-512 where the build and the diagonal kind allow). sc: H·n_ctx floats.
void score_pass(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag,
                const float* q, const float* qd, float scale, float* sc) {
  if (!row_scores_avx512(kv, blocks, n_ctx, diag, q, qd, scale, sc))
    row_scores(kv, blocks, n_ctx, diag, q, qd, scale, sc);
}
void sum_pass(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag, float* sc,
              float* out, float* oc) {
  if (!row_sums_avx512(kv, blocks, n_ctx, diag, sc, out, oc))
    row_sums(kv, blocks, n_ctx, diag, sc, out, oc);
}

// A row's context is attended in chunks of kChunkTokens tokens (rounded down to whole blocks,
// one block at least) at fixed positions: each chunk's scores are exponentiated against its own
// per-head maximum and its values summed with those weights at once; the chunks' maxima and sums
// make the global softmax (in chunk order), which scales each chunk's value sums and weighs its
// contexts' sums, each chunk's into a partial output, and the partials are added in chunk order.
// Run on one thread (attend_row) or with the chunks shared out over a team (attend_row_split), a
// row does the same arithmetic: its bits do not depend on the threads or on the rest of the batch.
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

// Chunk c's scores into s (H·size floats), exponentiated against each head's maximum, and the
// values' sums with those weights into part[0, W) while the chunk's rows are still in L2 (read
// again after every chunk's scores, from L3 or memory, they took a fifth of a long row's time).
void chunk_scores(const KvLayerView& kv, const int32_t* blocks, const RowChunks& r, int c,
                  DiagKind diag, const float* q, const float* qd, float scale, float* s,
                  float* part) {
  const int n = r.size(c);
  const int32_t* chunk_blocks = blocks + r.begin(c) / kv.block_size;
  score_pass(kv, chunk_blocks, n, diag, q, qd, scale, s);
  for (int h = 0; h < r.H; ++h) {
    float* sh = s + int64_t(h) * n;
    float m = sh[0];
    for (int j = 1; j < n; ++j) m = std::max(m, sh[j]);
    r.maxima[int64_t(c) * r.H + h] = m;
    r.sums[int64_t(c) * r.H + h] = float(simd::exp_shifted(sh, n, m));
  }
  sum_pass(kv, chunk_blocks, n, diag, s, part, nullptr);
}

// With chunk c's share of the whole row's softmax, per head (chunk_shares): its value sums in
// part[0, W) scaled by it and, with a diagonal, its exponentiated scores s made probabilities and
// the contexts' sums taken into part[W, stride).
void chunk_sums(const KvLayerView& kv, const int32_t* blocks, const RowChunks& r, int c,
                DiagKind diag, float* s, float* part) {
  const int n = r.size(c), dh = kv.k_width / r.H;
  const bool contexts = r.stride > kv.k_width;
  for (int h = 0; h < r.H; ++h) {
    const float f = r.shares[int64_t(c) * r.H + h];
    for (int i = 0; i < dh; ++i) part[h * dh + i] *= f;
    if (!contexts) continue;
    float* sh = s + int64_t(h) * n;
    for (int j = 0; j < n; ++j) sh[j] *= f;
  }
  if (contexts)
    sum_pass(kv, blocks + r.begin(c) / kv.block_size, n, diag, s, nullptr, part + kv.k_width);
}

// One query row against its sequence's first n_ctx cached tokens, on the calling thread.
// sc: H·n_ctx floats; mem: row_chunks_floats(n_chunks, H, stride).
void attend_row(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag,
                const float* q, const float* qd, float scale, float* sc, float* mem, float* out,
                float* oc, int64_t oc_width) {
  const RowChunks r = row_chunks(kv, n_ctx, oc_width, mem);
  for (int c = 0; c < r.n_chunks; ++c)
    chunk_scores(kv, blocks, r, c, diag, q, qd, scale, sc + int64_t(r.H) * r.begin(c),
                 r.parts + c * r.stride);
  chunk_shares(r, 0, r.n_chunks);
  // The contexts' sums from the last chunk back: the score pass left the last chunks' cache rows
  // in L2 (5–7% off the attention of 32 rows at 256–1024 tokens, docs/BENCHMARKS.md session 20).
  // Each chunk has its own partial, added in chunk order: the same bits in either order.
  for (int c = r.n_chunks - 1; c >= 0; --c)
    chunk_sums(kv, blocks, r, c, diag, sc + int64_t(r.H) * r.begin(c), r.parts + c * r.stride);
  const int W = kv.k_width;
  std::fill(out, out + W, 0.0f);
  if (oc_width) std::fill(oc, oc + oc_width, 0.0f);
  for (int c = 0; c < r.n_chunks; ++c)
    for (int64_t i = 0; i < r.stride; ++i)
      (i < W ? out[i] : oc[i - W]) += r.parts[c * r.stride + i];
}

// attend_row with the chunks shared out over the calling parallel region's threads (a batch-1
// decode step would otherwise read a long cache on one thread), the partial outputs added up
// with the columns split over the threads. sc: this thread's H·n_ctx floats; mem (shared by the
// team): row_chunks_floats(n_chunks, H, stride).
void attend_row_split(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag,
                      const float* q, const float* qd, float scale, float* sc, float* mem,
                      float* out, float* oc, int64_t oc_width) {
  const int P = omp_get_num_threads(), t = omp_get_thread_num();
  const RowChunks r = row_chunks(kv, n_ctx, oc_width, mem);
  const int c0 = int(int64_t(r.n_chunks) * t / P), c1 = int(int64_t(r.n_chunks) * (t + 1) / P);
  auto mine = [&](int c) { return sc + int64_t(r.H) * (r.begin(c) - r.begin(c0)); };
  for (int c = c0; c < c1; ++c)
    chunk_scores(kv, blocks, r, c, diag, q, qd, scale, mine(c), r.parts + c * r.stride);
#pragma omp barrier
  chunk_shares(r, c0, c1);
  for (int c = c0; c < c1; ++c) chunk_sums(kv, blocks, r, c, diag, mine(c), r.parts + c * r.stride);
#pragma omp barrier
  const int W = kv.k_width;
  for (int64_t i = r.stride * t / P; i < r.stride * (t + 1) / P; ++i) {
    float v = 0;
    for (int c = 0; c < r.n_chunks; ++c) v += r.parts[c * r.stride + i];
    (i < W ? out[i] : oc[i - W]) = v;
  }
}

}  // namespace

int64_t paged_attention_scratch_floats(const AttnSeq* seqs, int n_seqs, const KvLayerView& kv,
                                       DiagKind diag, bool inside) {
  const int threads = team(inside);
  int max_ctx = 0;
  int64_t need = 0;
  for (int i = 0; i < n_seqs; ++i) {
    max_ctx = std::max(max_ctx, seqs[i].pos_begin + seqs[i].n_rows);
    if (use_gemm(seqs[i])) need = std::max(need, gemm_path_floats(seqs[i], kv, diag, threads));
  }
  return std::max(need, row_path_floats(max_ctx, kv.n_heads, threads));
}

void paged_attention_forward(const ExecCtx& ctx, Tensor out, Tensor out_c, const Tensor& q,
                             const Tensor& qd, DiagKind diag, const KvLayerView& kv,
                             const AttnSeq* seqs, int n_seqs, float scale) {
  const int W = kv.k_width, D = kv.c_width, H = kv.n_heads;
  CEMLM_CHECK(q.dim(-1) == W && out.dim(-1) == W);
  CEMLM_CHECK(diag == DiagKind::kNone || (kv.has_contexts() && !qd.empty() && !out_c.empty()));
  CEMLM_CHECK(ctx.scratch_floats >=
              paged_attention_scratch_floats(seqs, n_seqs, kv, diag, in_region()));
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
  // Rows too few to occupy every thread, with long contexts, share their chunks out over threads
  // (the same bits as on one thread).
  const int threads = omp_get_max_threads();
  const int pending = int(std::count_if(owner.begin(), owner.end(), [](int s) { return s >= 0; }));
  const int chunk = chunk_tokens(kv.block_size);
  const int64_t stride = W + oc_width;
  auto chunks_of = [&](int n_ctx) { return (n_ctx + chunk - 1) / chunk; };
  if (threads > 1 && pending < threads && !in_region())
    for (int i = 0; i < n_rows; ++i) {
      const int s = owner[i];
      if (s < 0) continue;
      const int n_ctx = seqs[s].pos_begin + (i - seqs[s].row_begin) + 1;
      const int P = std::min(threads, n_ctx / kChunkTokens);
      if (P < 2) continue;
      thread_local std::vector<float> mem;
      mem.resize(size_t(row_chunks_floats(chunks_of(n_ctx), H, stride)));
      float* mem_data = mem.data();
#pragma omp parallel num_threads(P)
      attend_row_split(kv, seqs[s].blocks, n_ctx, diag, q.data + int64_t(i) * W,
                       oc_width ? qd.data + i * oc_width : nullptr, scale,
                       ctx.scratch + int64_t(H) * max_ctx * omp_get_thread_num(), mem_data,
                       out.data + int64_t(i) * W, oc_width ? out_c.data + i * oc_width : nullptr,
                       oc_width);
      owner[i] = -1;
    }
#pragma omp parallel if (!in_region())
  {
    float* sc = ctx.scratch + int64_t(H) * max_ctx * omp_get_thread_num();
    thread_local std::vector<float> mem;
    mem.resize(size_t(row_chunks_floats(chunks_of(std::max(max_ctx, 1)), H, stride)));
#pragma omp for schedule(dynamic, 2)
    for (int i = 0; i < n_rows; ++i) {
      const int s = owner[i];
      if (s < 0) continue;
      const AttnSeq& sq = seqs[s];
      attend_row(kv, sq.blocks, sq.pos_begin + (i - sq.row_begin) + 1, diag, q.data + int64_t(i) * W,
                 oc_width ? qd.data + i * oc_width : nullptr, scale, sc, mem.data(),
                 out.data + int64_t(i) * W, oc_width ? out_c.data + i * oc_width : nullptr,
                 oc_width);
    }
  }
}

}  // namespace cemlm
