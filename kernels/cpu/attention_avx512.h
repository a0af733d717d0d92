// The AVX-512 passes of one decode row's attention (kernels/cpu/attention.cc): the scores of 16
// cached tokens at a time, and the weighted sums with their accumulators held in registers.
#pragma once
#include <cstdint>

#include "cemlm/kernels/attention.h"

namespace cemlm {

// sc[h·n_ctx + j] = scale·(q_h·κ_{h,j} + qd·c_j) (qd only for the shared diagonal). Returns false,
// touching nothing, on a build without AVX-512 or for the per-head diagonal.
bool row_scores_avx512(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag,
                       const float* q, const float* qd, float scale, float* sc);

// out = Σ_j p_{h,j} v_{h,j} per head and, for the shared diagonal, oc = Σ_j (Σ_h p_{h,j}) c_j, from
// the weights sc[h·n_ctx + j] (the contexts' sums overwrite row 0 of sc with the head sums); a null
// out or oc skips that part. Returns false, touching nothing, where row_scores_avx512 does, or
// for heads wider than 256.
bool row_sums_avx512(const KvLayerView& kv, const int32_t* blocks, int n_ctx, DiagKind diag,
                     float* sc, float* out, float* oc);

}  // namespace cemlm
