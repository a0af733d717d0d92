// Low-rank-plus-diagonal preconditioner of a CEM sub-layer (MODEL.md §4.3):
// P(u) = softplus(p) ⊙ u + P_u (P_vᵀ u) + P_v (P_uᵀ u).
// CPU oracle: kernels/cpu/precond.cc; test: tests/model/precond_test.cc.
#pragma once
#include <vector>

#include "cemlm/kernels/linear.h"
#include "cemlm/kernels/tensor.h"

namespace cemlm {

// A preconditioner's weights laid out for repeated use (the engine's recursion steps):
// softplus(p) evaluated once, and the two rank-r corrections as two products with pre-packed
// weights, [a | b] = u·[P_v | P_u], then out += [a | b]·[P_u | P_v]ᵀ. Copies what it needs
// (2·D·(2r + 1) floats plus the packed copies); movable, not copyable (it packs its own arrays).
class PackedPrecond {
 public:
  PackedPrecond() = default;
  PackedPrecond(const Tensor& p, const Tensor& Pu, const Tensor& Pv);
  PackedPrecond(PackedPrecond&&) = default;
  PackedPrecond& operator=(PackedPrecond&&) = default;
  PackedPrecond(const PackedPrecond&) = delete;
  PackedPrecond& operator=(const PackedPrecond&) = delete;

 private:
  friend void precond_forward(const ExecCtx&, Tensor, const Tensor&, const PackedPrecond&);
  int dim_ = 0, rank_ = 0;
  std::vector<float> softplus_;
  std::vector<float> in_, out_;  // [2r, D] = [P_v | P_u]ᵀ and [D, 2r] = [P_u | P_v]
  PackedLinear in_packed_, out_packed_;
};

// out[N,D] = P(u[N,D]). Scratch: 2·N·r floats. out must not alias u.
void precond_forward(const ExecCtx&, Tensor out, const Tensor& u, const PackedPrecond& P);
// The same from the weights as stored: p[D], Pu[D,r], Pv[D,r] (packs them for this one call).
void precond_forward(const ExecCtx&, Tensor out, const Tensor& u, const Tensor& p, const Tensor& Pu,
                     const Tensor& Pv);

}  // namespace cemlm
