// CPU preconditioner: softplus(p) ⊙ u plus the two rank-r corrections as two thin products, their
// weights side by side so that each product is one call with a pre-packed weight.
#include "cemlm/kernels/precond.h"

#include <cmath>

namespace cemlm {

PackedPrecond::PackedPrecond(const Tensor& p, const Tensor& Pu, const Tensor& Pv)
    : dim_(int(Pu.dim(0))), rank_(int(Pu.dim(1))) {
  const int D = dim_, r = rank_;
  CEMLM_CHECK(p.numel() == D && Pv.dim(0) == D && Pv.dim(1) == r);
  softplus_.resize(size_t(D));
  for (int d = 0; d < D; ++d) {
    const float z = p.data[d];
    softplus_[size_t(d)] = z > 20.0f ? z : std::log1p(std::exp(z));
  }
  in_.resize(size_t(2) * r * D), out_.resize(size_t(D) * 2 * r);
  for (int d = 0; d < D; ++d)
    for (int c = 0; c < r; ++c) {
      const float u = Pu.data[int64_t(d) * r + c], v = Pv.data[int64_t(d) * r + c];
      in_[int64_t(c) * D + d] = v, in_[int64_t(r + c) * D + d] = u;      // a = Pvᵀu, b = Puᵀu
      out_[int64_t(d) * 2 * r + c] = u, out_[int64_t(d) * 2 * r + r + c] = v;  // Pu a + Pv b
    }
  in_packed_ = PackedLinear(Tensor(in_.data(), {2 * r, D}));
  out_packed_ = PackedLinear(Tensor(out_.data(), {D, 2 * r}));
}

void precond_forward(const ExecCtx& ctx, Tensor out, const Tensor& u, const PackedPrecond& P) {
  const int64_t N = u.dim(0), D = u.dim(-1);
  CEMLM_CHECK(D == P.dim_ && out.data != u.data && ctx.scratch_floats >= 2 * N * P.rank_);
  const float* sp = P.softplus_.data();
  for (int64_t i = 0; i < N; ++i)
    for (int64_t d = 0; d < D; ++d) out.data[i * D + d] = sp[d] * u.data[i * D + d];
  const Tensor ab(ctx.scratch, {N, 2 * P.rank_});
  linear_forward(ctx, ab, u, P.in_packed_);
  linear_forward(ctx, out, ab, P.out_packed_, 1.0f);
}

void precond_forward(const ExecCtx& ctx, Tensor out, const Tensor& u, const Tensor& p,
                     const Tensor& Pu, const Tensor& Pv) {
  precond_forward(ctx, out, u, PackedPrecond(p, Pu, Pv));
}

}  // namespace cemlm
