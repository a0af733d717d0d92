// Backward of the CEM preconditioner P(u) = softplus(p) ⊙ u + P_u (P_vᵀ u) + P_v (P_uᵀ u)
// (precond.h, MODEL.md §4.3). CPU oracle: kernels/cpu/precond_backward.cc; test:
// tests/trainer_grad/.
#pragma once
#include "cemlm/kernels/tensor.h"

namespace cemlm {

// du[N,D] = P(dout) (P is symmetric); dp[D], dPu[D,r], dPv[D,r] +=. Scratch: 4·N·r floats.
// du must not alias dout.
void precond_backward(const ExecCtx&, Tensor du, Tensor dp, Tensor dPu, Tensor dPv,
                      const Tensor& dout, const Tensor& u, const Tensor& p, const Tensor& Pu,
                      const Tensor& Pv);

}  // namespace cemlm
