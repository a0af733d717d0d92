// Low-rank-plus-diagonal preconditioner of a CEM sub-layer (MODEL.md §4.3):
// P(u) = softplus(p) ⊙ u + P_u (P_vᵀ u) + P_v (P_uᵀ u).
// CPU oracle: kernels/cpu/precond.cc; test: tests/kernels/.
#pragma once
#include "cemlm/kernels/tensor.h"

namespace cemlm {

// out[N,D] = P(u[N,D]); p[D], Pu[D,r], Pv[D,r]. Scratch: 2·N·r floats. out must not alias u.
void precond_forward(const ExecCtx&, Tensor out, const Tensor& u, const Tensor& p, const Tensor& Pu,
                     const Tensor& Pv);

}  // namespace cemlm
