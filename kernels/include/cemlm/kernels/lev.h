// Leviathan embedding generator (MODEL.md §6.2): token id → base-b digits → summed codebook rows
// → per head: seed projection, LayerNorm, sigmoid, quadratic B-spline weights, rank-r separable
// product → output projection, summed over heads.
// CPU oracle: kernels/cpu/lev.cc; test: tests/model/lev_test.cc.
#pragma once
#include <cstdint>

#include "cemlm/kernels/tensor.h"

namespace cemlm {

struct LevWeights {
  Tensor codebooks;  // [k, b, s]
  Tensor seed_proj;  // [n_h, s, s]
  Tensor ln_weight;  // [n_h, s]
  Tensor ln_bias;    // [n_h, s]
  Tensor spline;     // [n_h, s, κ, r]
  Tensor out_proj;   // [n_h, r, D]
};

// digit_j(t) = floor(t / b^(k−1−j)) mod b, most significant first.
void lev_digits(int64_t token, int k, int b, int* digits);
// Normalised quadratic B-spline weights of ζ ∈ (0,1) on κ uniform knots (partition of unity).
void lev_basis(float zeta, int knots, float* weights);
// out[N, D] = Embed(ids[i]), in float arithmetic (the trainer's forward, which its backward
// follows).
void lev_forward(const ExecCtx&, Tensor out, const int32_t* ids, const LevWeights& w);
// The same in double, each row rounded to float once: the table the engines precompute at load
// (MODEL.md §6.2). In float, ζ's rounding times (κ − 1) knots, compounded by the product over s,
// passes MODEL.md's 1e-4 at fine splines (κ = 1024: 3e-4).
void lev_forward_f64(Tensor out, const int32_t* ids, const LevWeights& w);

}  // namespace cemlm
