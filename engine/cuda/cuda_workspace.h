// Sizes of the CUDA runner's working memory (engine/cuda/cuda_runner.cc) as pure functions of the
// model and a step's shape: init reserves the worst step the engine's limits allow
// (--max-batch-tokens, --max-running), and every step checks that it fits what was reserved.
// Host-only (no CUDA headers), so a CPU test checks the sizing: tests/gpu/workspace_test.cc.
#pragma once
#include <algorithm>
#include <array>
#include <climits>
#include <cstddef>
#include <cstdint>

#include "cemlm/engine/config.h"
#include "cemlm/engine/cpu_model.h"
#include "cemlm/engine/cuda_runner.h"
#include "cemlm/kernels/cuda/attention.h"
#include "cemlm/kernels/cuda/linear.h"

namespace cemlm {

// The runner's activation buffers, one [rows, width] fp32 array each.
enum CudaBuf {
  kH,        // [N, D] hidden states
  kC,        // [N, D] a sub-layer's normalised input
  kY,        // [N, D] a recursion step's normalised state
  kQ,        // [N, Q] queries
  kK,        // [N, Q] keys
  kV,        // [N, Q] values
  kA,        // [N, Q] attention output
  kU,        // [N, D] a step's update
  kPU,       // [N, D] the preconditioned update
  kQD,       // [N, H·D or D] diagonal queries
  kOC,       // [N, H·D or D] diagonal context sums
  kG,        // [N, F] MLP gate
  kZ,        // [N, F] MLP hidden
  kFinal,    // [M, D] rows that want logits, normalised
  kScratch,  // ops' scratch (attention head sums, preconditioner, bf16 inputs)
  kLogits,   // [M, V]
  kNumBufs
};

inline const char* cuda_buf_name(int b) {
  static const char* const names[kNumBufs] = {
      "hidden states",  "sub-layer inputs", "recursion states",  "queries",
      "keys",           "values",           "attention outputs", "updates",
      "preconditioned updates", "diagonal queries", "diagonal context sums", "MLP gates",
      "MLP hidden states", "final rows", "op scratch", "logits"};
  return b >= 0 && b < kNumBufs ? names[b] : "?";
}

// What a step asks of the buffers.
struct CudaStepShape {
  int64_t rows = 0;           // N: tokens fed
  int64_t logits_rows = 0;    // M: rows whose logits come back (<= N)
  int64_t table_entries = 0;  // block-table entries staged, over all sequences
};

// The shape of a batch as the runner stages it (its plan does the same walk).
inline CudaStepShape cuda_step_shape(const Batch& batch, int block_size) {
  CudaStepShape s;
  for (const BatchSeq& q : batch.seqs) {
    s.rows += q.n_tokens;
    s.logits_rows += q.want_all_logits ? q.n_tokens : q.want_logits ? 1 : 0;
    s.table_entries += (int64_t(q.pos_begin) + q.n_tokens + block_size - 1) / block_size;
  }
  return s;
}

// Byte offsets of a step's tables in the one staged upload: ids, pos, eta, out_rows, the
// 16-byte AttnRow array, block tables. All but the tables' depend only on N and M.
struct CudaStageLayout {
  size_t off_pos = 0, off_eta = 0, off_out = 0, off_rows = 0, off_tables = 0, bytes = 0;
};

inline size_t cuda_align16(size_t x) { return (x + 15) / 16 * 16; }

inline CudaStageLayout cuda_stage_layout(const CudaStepShape& s) {
  const size_t n = size_t(s.rows), m = size_t(s.logits_rows);
  CudaStageLayout L;
  L.off_pos = cuda_align16(4 * n);
  L.off_eta = cuda_align16(L.off_pos + 4 * n);
  L.off_out = cuda_align16(L.off_eta + 4 * n);
  L.off_rows = cuda_align16(L.off_out + 4 * m);
  L.off_tables = cuda_align16(L.off_rows + sizeof(cuda::AttnRow) * n);
  L.bytes = L.off_tables + 4 * size_t(s.table_entries);
  return L;
}

struct CudaWorkspace {
  std::array<size_t, kNumBufs> buf_bytes{};  // device, each at least 4 (never empty)
  size_t stage_bytes = 0;                    // device, and as much pinned host memory
  size_t device_bytes() const {
    size_t t = stage_bytes;
    for (size_t b : buf_bytes) t += b;
    return t;
  }
};

// Bytes of every buffer for a step of this shape. Each grows with N and M (monotone), so the
// reservation for the largest step covers every smaller one.
inline CudaWorkspace cuda_workspace_bytes(const ModelConfig& cfg, CudaPrecision precision,
                                          const CudaStepShape& s) {
  const int64_t N = s.rows, M = s.logits_rows, D = cfg.d_model, Q = cfg.qk_dim(), F = cfg.d_ff,
                H = cfg.n_heads, V = cfg.vocab_size;
  const DiagKind kind = diag_kind(cfg);
  const int64_t oc = kind == DiagKind::kPerHead ? H * D : kind == DiagKind::kShared ? D : 0;
  const int64_t rank = std::max({cfg.attn_precond_rank, cfg.mlp_precond_rank, 1});
  KvLayerView kv;  // only the widths matter here
  kv.n_heads = int(H);
  kv.k_width = int(Q);
  kv.c_width =
      cfg.attention == AttentionType::kCem && cfg.diag != DiagMode::kNone ? int(D) : 0;
  int64_t scratch =
      std::max(cuda::paged_attention_rows_scratch_floats(int(N), kv, kind), 2 * N * rank);
  if (precision == CudaPrecision::kBf16)
    scratch = std::max(scratch, cuda::linear_scratch_floats(N, std::max({D, Q, F})));
  const int64_t floats[kNumBufs] = {N * D, N * D,  N * D,  N * Q, N * Q, N * Q, N * Q,   N * D,
                                    N * D, N * oc, N * oc, N * F, N * F, M * D, scratch, M * V};
  CudaWorkspace w;
  for (int b = 0; b < kNumBufs; ++b)
    w.buf_bytes[size_t(b)] = sizeof(float) * size_t(std::max<int64_t>(floats[b], 1));
  w.stage_bytes = cuda_stage_layout(s).bytes;
  return w;
}

// The largest step the engine can send with these limits: N = M = max_batch_tokens (a scoring
// chunk wants every row's logits), and up to max_running sequences, each with a block table as
// long as max_seq_len needs.
inline CudaStepShape cuda_worst_step(const ModelConfig& cfg, const CudaRunnerOptions& o) {
  CudaStepShape s;
  s.rows = std::max(o.max_batch_tokens, 1);
  s.logits_rows = s.rows;
  const int64_t seqs = std::min<int64_t>(std::max(o.max_running, 1), s.rows);
  const int64_t bs = std::max(o.block_size, 1);
  s.table_entries = seqs * ((int64_t(cfg.max_seq_len) + bs - 1) / bs);
  return s;
}

// Rows the on-device sampler is reserved for (forward_sample returns one token per logits row):
// one per running sequence, and never more than a step has rows or the sampler's int item count
// (rows · vocab) allows.
inline int cuda_sample_rows(const ModelConfig& cfg, const CudaRunnerOptions& o) {
  const int64_t rows = std::min<int64_t>(std::max(o.max_running, 1), std::max(o.max_batch_tokens, 1));
  return int(std::min<int64_t>(rows, INT_MAX / std::max(cfg.vocab_size, 1)));
}

}  // namespace cemlm
