// The AVX-512 passes of one attention row (kernels/cpu/attention.cc) over a tiled cache
// (KvLayerView::tiled): the scores of 16 cached tokens at a time, one per lane, and the weighted
// sums of 16 columns at a time with their accumulators held in registers.
#pragma once
#include <cstdint>

#include "cemlm/kernels/attention.h"

namespace cemlm {

// One query row, or two or four of one sequence attending to the same tokens (a prefill's
// neighbours: the rows share each vector of the cache loaded, and each row's bits are those it has
// alone). Row r uses q[r] (H·d_h), qd[r] (D, the shared diagonal's), sc[r] (H·n_ctx scores),
// out[r] (H·d_h) and oc[r] (D); out or oc null (for every row) skips that part of the sums.
constexpr int kMaxAttnRows = 4;
struct AttnRows {
  int n = 1;  // 1, 2 or 4 for the AVX-512 passes
  const float* q[kMaxAttnRows] = {};
  const float* qd[kMaxAttnRows] = {};
  float* sc[kMaxAttnRows] = {};
  float* out[kMaxAttnRows] = {};
  float* oc[kMaxAttnRows] = {};
};

// Whether this build has the AVX-512 passes.
bool avx512_attention_built();

// Whether the AVX-512 passes take this cache: a build with them, and a tiled cache whose blocks
// are multiples of 16 tokens (any diagonal kind).
bool rows_avx512(const KvLayerView& kv);

// Where rows_avx512: sc[r][h·n_ctx + j] = scale·(q_h·κ_{h,j} + qd_(h)·c_j) (the diagonal term
// with qd [D] shared by the heads, or [H, D] per head; none without a diagonal).
void row_scores_avx512(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag,
                       const AttnRows& rows, float scale);

// Where rows_avx512: out = Σ_j p_{h,j} v_{h,j} per head and the contexts' sums, for the shared
// diagonal oc = Σ_j (Σ_h p_{h,j}) c_j, per head oc[h] = Σ_j p_{h,j} c_j, from the weights
// sc[h·n_ctx + j] (the shared diagonal's sums overwrite row 0 of sc with the head sums).
void row_sums_avx512(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag,
                     const AttnRows& rows);

}  // namespace cemlm
