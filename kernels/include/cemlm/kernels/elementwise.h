// Element-wise pieces of the MLPs and the recursive updates (MODEL.md §5, §4.2):
// SiLU gating, the CEM diagonal's per-head scaling, and row-scaled residual adds.
// CPU oracle: kernels/cpu/elementwise.cc; tests: tests/model/simd_test.cc (extreme inputs),
// tests/golden/ (whole models against a float64 PyTorch reference), tests/trainer_grad/.
#pragma once
#include "cemlm/kernels/tensor.h"

namespace cemlm {

// out = SiLU(a)            (same shapes; out may alias a)
void silu_forward(const ExecCtx&, Tensor out, const Tensor& a);
// out = SiLU(gate) ⊙ up
void swiglu_forward(const ExecCtx&, Tensor out, const Tensor& gate, const Tensor& up);
// out = a ⊙ b              (out may alias a)
void mul_forward(const ExecCtx&, Tensor out, const Tensor& a, const Tensor& b);
// x[i,:] += eta[i] · u[i,:]     (per-row step sizes: rows of one batch may have different T)
void axpy_rows_forward(const ExecCtx&, Tensor x, const Tensor& u, const float* eta);
// qd[N,H,D] = d[H,D] ⊙ y[N,D] per head (shared: d[D], qd[N,D])
void diag_scale_forward(const ExecCtx&, Tensor qd, const Tensor& y, const Tensor& d);
// u[N,D] += Σ_h d[h] ⊙ oc[N,h,D]   (shared: d[D], oc[N,D])
void diag_gather_forward(const ExecCtx&, Tensor u, const Tensor& oc, const Tensor& d);

}  // namespace cemlm
