// CPU paged attention: one query row per work item (OpenMP over all rows of the batch); keys
// are read in place from their blocks, scores kept in per-thread scratch. The shared diagonal's
// score row is computed once per query row and reused by every head.
#include "cemlm/kernels/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace cemlm {
namespace {

inline float dot(const float* a, const float* b, int n) {
  float s = 0;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline int64_t slot_of(const KvLayerView& kv, const int32_t* blocks, int pos) {
  return int64_t(blocks[pos / kv.block_size]) * kv.block_size + pos % kv.block_size;
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
  double z = 0;
  for (int j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    z += s[j];
  }
  const float inv = float(1.0 / z);
  for (int j = 0; j < n; ++j) s[j] *= inv;
}

}  // namespace

void kv_write(const ExecCtx&, const KvLayerView& kv, const AttnSeq* seqs, int n_seqs,
              const Tensor& k, const Tensor& v, const Tensor& c) {
  for (int s = 0; s < n_seqs; ++s) {
    const AttnSeq& sq = seqs[s];
    for (int r = 0; r < sq.n_rows; ++r) {
      const int64_t slot = slot_of(kv, sq.blocks, sq.pos_begin + r);
      const int64_t row = sq.row_begin + r;
      std::memcpy(kv.k + slot * kv.k_width, k.data + row * kv.k_width, sizeof(float) * kv.k_width);
      if (kv.v && !v.empty())
        std::memcpy(kv.v + slot * kv.k_width, v.data + row * kv.k_width, sizeof(float) * kv.k_width);
      if (kv.c && !c.empty())
        std::memcpy(kv.c + slot * kv.c_width, c.data + row * kv.c_width, sizeof(float) * kv.c_width);
    }
  }
}

void paged_attention_forward(const ExecCtx& ctx, Tensor out, Tensor out_c, const Tensor& q,
                             const Tensor& qd, DiagKind diag, const KvLayerView& kv,
                             const AttnSeq* seqs, int n_seqs, float scale) {
  const int W = kv.k_width, D = kv.c_width, H = kv.n_heads, dh = W / H;
  CEMLM_CHECK(q.dim(-1) == W && out.dim(-1) == W);
  CEMLM_CHECK(diag == DiagKind::kNone || (kv.c && !qd.empty() && !out_c.empty()));
  int n_rows = 0;
  const std::vector<int> owner = row_owner(seqs, n_seqs, &n_rows);
  int max_ctx = 0;
  for (int s = 0; s < n_seqs; ++s) max_ctx = std::max(max_ctx, seqs[s].pos_begin + seqs[s].n_rows);
  CEMLM_CHECK(ctx.scratch_floats >= int64_t(2) * max_ctx * omp_get_max_threads());
  const float* vpool = kv.v ? kv.v : kv.k;
  const int64_t oc_width = diag == DiagKind::kPerHead ? int64_t(H) * D : D;
#pragma omp parallel
  {
    float* sc = ctx.scratch + int64_t(2) * max_ctx * omp_get_thread_num();
    float* dsc = sc + max_ctx;
#pragma omp for schedule(dynamic, 2)
    for (int i = 0; i < n_rows; ++i) {
      const int s = owner[i];
      if (s < 0) continue;
      const AttnSeq& sq = seqs[s];
      const int n_ctx = sq.pos_begin + (i - sq.row_begin) + 1;
      if (diag == DiagKind::kShared) {  // identical for every head: once per row
        const float* qdi = qd.data + int64_t(i) * D;
        for (int j = 0; j < n_ctx; ++j)
          dsc[j] = dot(qdi, kv.c + slot_of(kv, sq.blocks, j) * D, D);
      }
      float* oc = diag == DiagKind::kNone ? nullptr : out_c.data + i * oc_width;
      if (oc) std::memset(oc, 0, sizeof(float) * oc_width);
      for (int h = 0; h < H; ++h) {
        const float* qi = q.data + int64_t(i) * W + h * dh;
        const float* qdi = diag == DiagKind::kPerHead ? qd.data + (int64_t(i) * H + h) * D : nullptr;
        for (int j = 0; j < n_ctx; ++j) {
          const int64_t slot = slot_of(kv, sq.blocks, j);
          float e = dot(qi, kv.k + slot * W + h * dh, dh);
          if (diag == DiagKind::kShared) e += dsc[j];
          if (qdi) e += dot(qdi, kv.c + slot * D, D);
          sc[j] = scale * e;
        }
        softmax_inplace(sc, n_ctx);
        float* oi = out.data + int64_t(i) * W + h * dh;
        std::memset(oi, 0, sizeof(float) * dh);
        float* och = diag == DiagKind::kPerHead ? oc + int64_t(h) * D : oc;
        for (int j = 0; j < n_ctx; ++j) {
          const int64_t slot = slot_of(kv, sq.blocks, j);
          const float p = sc[j];
          const float* vj = vpool + slot * W + h * dh;
          for (int d = 0; d < dh; ++d) oi[d] += p * vj[d];
          if (och) {
            const float* cj = kv.c + slot * D;
            for (int d = 0; d < D; ++d) och[d] += p * cj[d];
          }
        }
      }
    }
  }
}

}  // namespace cemlm
