// Half-split rotary position embedding (MODEL.md §2) applied per head, with an inverse mode
// (R_pᵀ = R_{−p}) used by CEM attention to rotate outputs back and by every backward pass.
// CPU oracle: kernels/cpu/rope.cc; tests: tests/golden/ (whole models against a float64 PyTorch
// reference), tests/model/model_test.cc (paged decode = full forward), tests/trainer_grad/.
#pragma once
#include <cstdint>

#include "cemlm/kernels/tensor.h"

namespace cemlm {

// table[P, d_h]: cos(pθ_m) in [:, 0:d_h/2], sin(pθ_m) in [:, d_h/2:]; computed in double.
void rope_table_init(Tensor table, float theta);
// rows[N, d_h]: row i is rope_table_init's row pos[i], bit for bit (a batch's positions only: a
// whole table costs max_seq_len × d_h floats however short the sequences served).
void rope_rows_init(const ExecCtx&, Tensor rows, const int32_t* pos, float theta);
// out[N, H·d_h] = R_pos (x) per head (R_posᵀ when inverse); out may alias x. pos[N] < P.
void rope_forward(const ExecCtx&, Tensor out, const Tensor& x, const int32_t* pos,
                  const Tensor& table, bool inverse);

}  // namespace cemlm
