// CPU linear maps: thin wrappers that express each product as one row-major cblas_sgemm, as an
// matrix-vector product when it has a single row (a one-sequence decode step: sgemm packs the
// whole weight matrix on every call, which for one row costs 2–5× the product itself), or, up to
// a few hundred rows on AVX-512 builds, as small_gemm (gemm_avx512.cc), 1.5–2× OpenBLAS's AVX2
// kernels there. On AVX-512 the one-row products are small_gemv too: OpenBLAS 0.3.21 does not know
// recent Xeons (Sapphire/Emerald Rapids) and falls back to its SSE3 kernels on them.
#include "cemlm/kernels/linear.h"

#include <cblas.h>

#include <type_traits>

#include "gemm_avx512.h"

namespace cemlm {

void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc) {
  if (M == 0 || N == 0) return;
  if (M == 1) {  // C[0, :] = alpha · op(B)ᵀ a + beta · C[0, :], a = op(A)[0, :]
    const int inc_a = trans_a ? lda : 1;
    if (inc_a == 1 && small_gemv(trans_b, N, K, alpha, A, B, ldb, beta, C)) return;
    if (trans_b)  // op(B)ᵀ = B [N, K]
      cblas_sgemv(CblasRowMajor, CblasNoTrans, N, K, alpha, B, ldb, A, inc_a, beta, C, 1);
    else  // B [K, N]
      cblas_sgemv(CblasRowMajor, CblasTrans, K, N, alpha, B, ldb, A, inc_a, beta, C, 1);
    return;
  }
  if (!trans_a && small_gemm(trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void linear_forward(const ExecCtx&, Tensor y, const Tensor& x, const Tensor& W, float beta) {
  const int N = int(x.dim(0)), in = int(x.dim(-1)), out = int(W.dim(0));
  CEMLM_CHECK(W.dim(1) == in && y.dim(-1) == out && y.dim(0) == N);
  gemm(false, true, N, out, in, 1.0f, x.data, in, W.data, in, beta, y.data, out);
}

void linear_t_forward(const ExecCtx&, Tensor y, const Tensor& x, const Tensor& W, float beta) {
  const int N = int(x.dim(0)), out = int(W.dim(0)), in = int(W.dim(1));
  CEMLM_CHECK(x.dim(-1) == out && y.dim(-1) == in && y.dim(0) == N);
  gemm(false, false, N, in, out, 1.0f, x.data, out, W.data, in, beta, y.data, in);
}

PackedLinear::PackedLinear(const Tensor& W, Use use, WeightDtype dtype)
    : w_(W), use_(use), dtype_(dtype) {
  if (W.empty()) return;
  const int out = int(W.dim(0)), in = int(W.dim(1));
  // op(B) is Wᵀ [in, out] for W·x and W [out, in] for Wᵀ·x.
  const bool forward = use == Use::kForward;
  const int n = forward ? out : in, k = forward ? in : out;
  auto pack = [&](auto& panels) {
    panels.resize(size_t(packed_panels_size(n, k)));
    if (!pack_panels(forward, W.data, in, n, k, panels.data())) panels = {};
  };
  switch (dtype) {
    case WeightDtype::kFp32:
      pack(panels_);
      break;
    case WeightDtype::kBf16:
      CEMLM_CHECK(packed_weights_available());  // runners refuse bf16/int8 weights before this
      pack(panels_bf16_);
      break;
    case WeightDtype::kInt8:
      CEMLM_CHECK(packed_weights_available());
      panels_int8_.resize(size_t(packed_panels_size(n, k)));
      scales_.resize(size_t(packed_scales_size(n, k)));
      pack_panels(forward, W.data, in, n, k, panels_int8_.data(), scales_.data());
      break;
    case WeightDtype::kInt8Dot:
      CEMLM_CHECK(int8_dot_available());
      panels_int8x4_.resize(size_t(packed_quad_panels_size(n, k)));
      scales_.resize(size_t(packed_scales_size(n, k)));
      pack_panels(forward, W.data, in, n, k, panels_int8x4_.data(), scales_.data());
      break;
    case WeightDtype::kBf16Dot:
      CEMLM_CHECK(bf16_dot_available());
      panels_bf16x2_.resize(size_t(packed_pair_panels_size(n, k)));
      pack_panels(forward, W.data, in, n, k, panels_bf16x2_.data());
      break;
  }
}

bool PackedLinear::apply(Use use, const Tensor& x, float beta, std::initializer_list<Out> outs) {
  static_assert(kMaxLinearOuts <= kMaxPackedTargets);
  CEMLM_CHECK(outs.size() >= 1 && outs.size() <= size_t(kMaxLinearOuts));
  const bool forward = use == Use::kForward;
  const int N = int(x.dim(0)), inner = int(x.dim(-1));
  const WeightDtype dtype = outs.begin()->W->dtype_;
  for (const Out& o : outs) {
    const PackedLinear& W = *o.W;
    CEMLM_CHECK(W.use_ == use && W.w_.dim(forward ? 1 : 0) == inner &&
                o.y.dim(-1) == W.w_.dim(forward ? 0 : 1) && o.y.dim(0) == N);
    if (!W.packed() || W.dtype_ != dtype) return false;
  }
  // The targets of the panels `member` of each weight (all of one element type E).
  auto run = [&](auto member) {
    using E = typename std::remove_reference_t<decltype(outs.begin()->W->*member)>::value_type;
    PackedTarget<E> targets[kMaxLinearOuts];
    int n = 0;
    for (const Out& o : outs) {
      const int cols = int(o.y.dim(-1));
      targets[n++] = {(o.W->*member).data(), o.W->scales_.empty() ? nullptr : o.W->scales_.data(),
                      cols, o.y.data, cols};
    }
    packed_products(N, inner, 1.0f, x.data, inner, beta, targets, n);
  };
  switch (dtype) {
    case WeightDtype::kFp32:
      run(&PackedLinear::panels_);
      break;
    case WeightDtype::kBf16:
      run(&PackedLinear::panels_bf16_);
      break;
    case WeightDtype::kInt8:
      run(&PackedLinear::panels_int8_);
      break;
    case WeightDtype::kBf16Dot:
      run(&PackedLinear::panels_bf16x2_);
      break;
    case WeightDtype::kInt8Dot:
      run(&PackedLinear::panels_int8x4_);
      break;
  }
  return true;
}

bool packed_weights_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

bool bf16_dot_available() { return bf16_dot_supported(); }
bool int8_dot_available() { return int8_dot_supported(); }

void linear_forward(const ExecCtx& ctx, Tensor y, const Tensor& x, const PackedLinear& W,
                    float beta) {
  if (!PackedLinear::apply(PackedLinear::Use::kForward, x, beta, {{y, &W}}))
    linear_forward(ctx, y, x, W.w_, beta);
}

void linear_t_forward(const ExecCtx& ctx, Tensor y, const Tensor& x, const PackedLinear& W,
                      float beta) {
  if (!PackedLinear::apply(PackedLinear::Use::kTransposed, x, beta, {{y, &W}}))
    linear_t_forward(ctx, y, x, W.w_, beta);
}

void linear_forward(const ExecCtx& ctx, const Tensor& x, std::initializer_list<LinearOut> outs) {
  if (PackedLinear::apply(PackedLinear::Use::kForward, x, 0.0f, outs)) return;
  for (const LinearOut& o : outs) linear_forward(ctx, o.y, x, *o.W);
}

void linear_backward(const ExecCtx&, Tensor dx, Tensor dW, const Tensor& dy, const Tensor& x,
                     const Tensor& W, bool accumulate_dx) {
  const int N = int(dy.dim(0)), out = int(W.dim(0)), in = int(W.dim(1));
  if (!dx.empty())  // dx = dy · W
    gemm(false, false, N, in, out, 1.0f, dy.data, out, W.data, in, accumulate_dx ? 1.0f : 0.0f,
         dx.data, in);
  if (!dW.empty())  // dW += dyᵀ · x
    gemm(true, false, out, in, N, 1.0f, dy.data, out, x.data, in, 1.0f, dW.data, in);
}

void linear_t_backward(const ExecCtx&, Tensor dx, Tensor dW, const Tensor& dy, const Tensor& x,
                       const Tensor& W, bool accumulate_dx) {
  const int N = int(dy.dim(0)), out = int(W.dim(0)), in = int(W.dim(1));
  if (!dx.empty())  // y = x W  ⇒  dx = dy · Wᵀ
    gemm(false, true, N, out, in, 1.0f, dy.data, in, W.data, in, accumulate_dx ? 1.0f : 0.0f,
         dx.data, out);
  if (!dW.empty())  // dW += xᵀ · dy
    gemm(true, false, out, in, N, 1.0f, x.data, out, dy.data, in, 1.0f, dW.data, in);
}

}  // namespace cemlm
