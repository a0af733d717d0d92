// Backward of the element-wise ops (elementwise.h): SiLU, SwiGLU, products, and the CEM
// diagonal's per-head scaling and gathering (MODEL.md §4.2, §5).
// CPU oracle: kernels/cpu/elementwise_backward.cc; test: tests/trainer_grad/.
#pragma once
#include "cemlm/kernels/tensor.h"

namespace cemlm {

// da = dout ⊙ SiLU'(a)                       (da may alias dout)
void silu_backward(const ExecCtx&, Tensor da, const Tensor& dout, const Tensor& a);
// Of out = SiLU(gate) ⊙ up: dgate = dout ⊙ up ⊙ SiLU'(gate), dup = dout ⊙ SiLU(gate).
void swiglu_backward(const ExecCtx&, Tensor dgate, Tensor dup, const Tensor& dout,
                     const Tensor& gate, const Tensor& up);
// Of out = a ⊙ b with respect to a, accumulated: da += dout ⊙ b.
void mul_backward(const ExecCtx&, Tensor da, const Tensor& dout, const Tensor& b);
// Of diag_scale_forward (qd = d ⊙ y per head): dy[N,D] += Σ_h d[h] ⊙ dqd[N,h,D]; dd[H,D] +=
// Σ_i dqd[i,h] ⊙ y[i]. Shared: d, dd [D], dqd [N,D].
void diag_scale_backward(const ExecCtx&, Tensor dy, Tensor dd, const Tensor& dqd, const Tensor& y,
                         const Tensor& d);
// Of diag_gather_forward (u += Σ_h d[h] ⊙ oc[h]): doc[N,H,D] = d[h] ⊙ du; dd[H,D] +=
// Σ_i du[i] ⊙ oc[i,h]. Shared: d, dd [D], oc, doc [N,D].
void diag_gather_backward(const ExecCtx&, Tensor doc, Tensor dd, const Tensor& du, const Tensor& oc,
                          const Tensor& d);

}  // namespace cemlm
