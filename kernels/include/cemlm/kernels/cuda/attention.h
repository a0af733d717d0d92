// CUDA paged attention and cache writes (attention.h's ops, in cemlm::cuda). One thread block per
// (row, head) walks the row's cached positions in tiles of 32 with an online softmax, so any
// context length runs in fixed shared memory. CUDA: kernels/cuda/attention.cu;
// tests: tests/gpu/ops_test.cc.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cemlm/kernels/attention.h"

namespace cemlm::cuda {

// A batch row as the kernels see it: its sequence's block table (device memory) and its
// position; the row attends to cached positions 0 … pos.
struct AttnRow {
  const int32_t* blocks = nullptr;
  int32_t pos = 0;
  int32_t reserved = 0;
};

// The CPU signatures. `seqs` is a host array whose `blocks` point to device memory; KvLayerView
// pools and every Tensor are device memory. The per-row table is staged through ctx.scratch
// (synchronously from pageable memory), so these suit tests and one-off calls; the runner builds
// its AttnRow array on the device once per step and calls the *_rows forms.
// Scratch: paged_attention_scratch_floats(...) floats (kv_write: 4 per row).
void kv_write(const ExecCtx&, const KvLayerView& kv, const AttnSeq* seqs, int n_seqs,
              const Tensor& k, const Tensor& v, const Tensor& c);
void paged_attention_forward(const ExecCtx&, Tensor out, Tensor out_c, const Tensor& q,
                             const Tensor& qd, DiagKind diag, const KvLayerView& kv,
                             const AttnSeq* seqs, int n_seqs, float scale);
int64_t paged_attention_scratch_floats(const AttnSeq* seqs, int n_seqs, const KvLayerView& kv,
                                       DiagKind diag);

// The same ops over a device AttnRow array of n_rows (rows[i] describes batch row i).
// paged_attention_rows needs paged_attention_rows_scratch_floats(n_rows, kv, diag) floats of
// scratch (the shared diagonal's per-head context sums); kv_write_rows none.
void kv_write_rows(const ExecCtx&, const KvLayerView& kv, const AttnRow* rows, int n_rows,
                   const Tensor& k, const Tensor& v, const Tensor& c);
void paged_attention_rows(const ExecCtx&, Tensor out, Tensor out_c, const Tensor& q,
                          const Tensor& qd, DiagKind diag, const KvLayerView& kv,
                          const AttnRow* rows, int n_rows, float scale);
inline int64_t paged_attention_rows_scratch_floats(int n_rows, const KvLayerView& kv,
                                                  DiagKind diag) {
  return diag == DiagKind::kShared ? int64_t(n_rows) * kv.n_heads * kv.c_width : 0;
}

// Shared memory of one attention block for a model, and what the current device allows.
struct AttentionSmem {
  size_t dynamic_bytes = 0;  // the query (and diagonal query) and their sums
  size_t static_bytes = 0;   // the kernel's own (cudaFuncGetAttributes)
  size_t device_limit = 0;   // cudaDevAttrMaxSharedMemoryPerBlockOptin
  const char* error = nullptr;  // a failed CUDA call's message; the sizes are then unset
  bool fits() const { return error == nullptr && dynamic_bytes + static_bytes <= device_limit; }
};
// Readies paged attention for a model on the current device, once, before any step (the ops
// would otherwise do it on their first launch): when one block needs more than the default
// 48 KiB, raises the kernel's dynamic shared-memory limit; when it needs more than the device
// allows, changes nothing and says so (fits() false). Never aborts.
AttentionSmem paged_attention_prepare(int head_dim, int d_model, bool diag);

}  // namespace cemlm::cuda
