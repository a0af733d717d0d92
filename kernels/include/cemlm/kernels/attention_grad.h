// Backward of causal attention (attention.h: scores, softmax, value and context sums) for the
// trainer, whose sequences are whole and contiguous (one block each). Probabilities are recomputed
// per sequence and head as sgemms over the full [L, L] score matrix (the causal mask zeroes its
// upper triangle). CPU oracle: kernels/cpu/attention_backward.cc; test: tests/trainer_grad/.
#pragma once
#include <cstdint>

#include "cemlm/kernels/attention.h"

namespace cemlm {

// Rows are n_seqs sequences of seq_len positions: row b·seq_len + i sits at position i and
// attends to rows b·seq_len … b·seq_len + i.
struct AttnTensors {
  Tensor q;   // [M, H·d_h] rotated queries
  Tensor qd;  // [M, D] (shared) or [M, H, D] (per-head) diagonal queries; empty for kNone
  Tensor k;   // [M, H·d_h] rotated keys
  Tensor v;   // [M, H·d_h] values; empty: the values are the keys (CEM)
  Tensor c;   // [M, D] contexts; empty for kNone
};

// Floats of ctx.scratch that attention_backward needs (6·seq_len² per OpenMP thread with the
// shared diagonal, else 2·seq_len²).
int64_t attention_backward_scratch(DiagKind diag, int seq_len);

// Backward of paged_attention_forward over such sequences. dout [M, H·d_h], doc (the gradient of
// out_c, shaped like it; empty for kNone). Writes grad.q and grad.qd; adds into grad.k, grad.v and
// grad.c. When in.v is empty the value gradient is added into grad.k (grad.v is ignored).
void attention_backward(const ExecCtx&, const AttnTensors& grad, const Tensor& dout,
                        const Tensor& doc, const AttnTensors& in, DiagKind diag, int n_heads,
                        int seq_len, float scale);

}  // namespace cemlm
