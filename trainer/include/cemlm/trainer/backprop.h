// Loss and gradient of the model over a batch of token sequences (MODEL.md §3): the training
// forward (the engine's ops, activations kept) and its backward through every sub-layer and every
// recursion step. trainer/src/backprop.cc says which activations are saved and which recomputed.
#pragma once
#include <cstdint>

#include "cemlm/engine/config.h"
#include "cemlm/engine/params.h"

namespace cemlm {

// ids: [batch, seq_len] row-major token ids (seq_len >= 2). Loss = mean over the batch of each
// row's mean next-token NLL (MODEL.md §3: −(1/(N−1)) Σ_{i<N−1} log softmax(logits_i)[t_{i+1}]).
// Adds loss_scale·∂loss/∂θ into `grads` (views of a ParamStore with the same layout as the
// params, see bind_weights), returns the loss. Every row uses recursion depth T. The activations'
// memory is kept per thread for the next call (a training loop allocates it once); more of it
// than the machine (or its cgroup) has left throws std::bad_alloc before it is taken.
double forward_backward(const ModelConfig& c, const Weights& w, const Weights& grads,
                        const int* ids, int batch, int seq_len, int T, float loss_scale = 1.0f);
// The bytes forward_backward takes at least, growing with the rows (batch × seq_len): what it
// keeps of each row for the backward (trainer/src/backprop.cc's list) and its sub-layer buffers;
// not the head's logits (256 rows at a time), the scratch, nor LEV's table of the batch's ids.
int64_t forward_backward_min_bytes(const ModelConfig& c, int batch, int seq_len, int T);
// The floats the last forward_backward on this thread took from its working memory, and the
// bytes that memory holds (kept for the next call).
int64_t last_forward_backward_floats();
int64_t forward_backward_held_bytes();
// Loss only (no gradient), same definition, computed with the engine's forward (CpuModel).
double forward_loss(const ModelConfig& c, const Weights& w, const int* ids, int batch, int seq_len,
                    int T);

}  // namespace cemlm
