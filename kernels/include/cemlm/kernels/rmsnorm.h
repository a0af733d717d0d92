// RMSNorm over the last dimension (MODEL.md §1): out = g ⊙ x / sqrt(mean(x²) + eps).
// CPU oracle: kernels/cpu/rmsnorm.cc; tests: tests/model/simd_test.cc (extreme inputs),
// tests/golden/ (whole models against a float64 PyTorch reference), tests/trainer_grad/.
#pragma once
#include "cemlm/kernels/tensor.h"

namespace cemlm {

// out[N,D], rstd[N] (optional: 1/sqrt(mean(x²)+eps) per row), x[N,D], gain[D]. out may alias x.
void rmsnorm_forward(const ExecCtx&, Tensor out, Tensor rstd, const Tensor& x, const Tensor& gain,
                     float eps);
// dx[N,D] (+= when accumulate), dgain[D] +=; rstd from the forward.
void rmsnorm_backward(const ExecCtx&, Tensor dx, Tensor dgain, const Tensor& dout, const Tensor& x,
                      const Tensor& gain, const Tensor& rstd, bool accumulate_dx = false);

}  // namespace cemlm
