// Backward of the Leviathan embedding generator (lev.h, MODEL.md §6.2): through the output
// projection, the rank-r separable product, the normalised B-spline basis (whose normaliser
// depends on ζ), the sigmoid, the LayerNorm (population variance), the seed projection and the
// codebooks. CPU oracle: kernels/cpu/lev_backward.cc; test: tests/trainer_grad/.
#pragma once
#include <cstdint>

#include "cemlm/kernels/lev.h"

namespace cemlm {

// The normalised weights B_q(ζ) of lev_basis and their derivatives dB_q/dζ.
void lev_basis_grad(float zeta, int knots, float* weights, float* slopes);

// Adds the gradient of Σ_i dout[i]·Embed(ids[i]) into g (views shaped like w's). An id may repeat
// (its contributions add); summing dout per distinct id first is cheaper.
// Scratch: N·n_h·r floats (N = dout rows).
void lev_backward(const ExecCtx&, const LevWeights& g, const Tensor& dout, const int32_t* ids,
                  const LevWeights& w);

}  // namespace cemlm
