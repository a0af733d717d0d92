// Dense linear maps with weights stored [out, in] (MODEL.md §1). CPU products go through gemm():
// OpenBLAS, or the AVX-512 few-row kernels (kernels/cpu/gemm_avx512.cc). CPU oracle:
// kernels/cpu/linear.cc; tests: tests/model/gemm_test.cc, linear ops in tests/model/.
#pragma once
#include <initializer_list>
#include <vector>

#include "cemlm/kernels/huge_pages.h"
#include "cemlm/kernels/tensor.h"

namespace cemlm {

// y[N,out] = beta·y + x[N,in] · Wᵀ          (y = W x per row)
void linear_forward(const ExecCtx&, Tensor y, const Tensor& x, const Tensor& W, float beta = 0.0f);
// y[N,in] = beta·y + x[N,out] · W           (y = Wᵀ x per row: the tied transposes W_Qᵀ, W_upᵀ)
void linear_t_forward(const ExecCtx&, Tensor y, const Tensor& x, const Tensor& W, float beta = 0.0f);

// A weight W [out, in] plus, on AVX-512 builds, a copy of it already in the few-row kernel's panel
// layout for one use — W·x (linear_forward: panels of Wᵀ) or Wᵀ·x (linear_t_forward: panels of W)
// — so that products of any row count (decode batches, grouped recursion steps, prefill chunks)
// stream contiguous panels instead of transposing W on every call (W·x) or reading 128 bytes per
// row of W (Wᵀ·x, which on weights beyond the caches runs at a third of the packed rate): a second
// copy of W's bytes. Holds a view of W, which must outlive it; without AVX-512, W is used.
// With WeightDtype::kBf16 the copy holds W rounded to bf16 (half the bytes: a memory-bound
// decode streams half as much; products still accumulate in fp32), and W itself is never read:
// the results are those of the fp32 products with the bf16-rounded W. kInt8: W quantized in
// 32 × 32 blocks of W, one fp32 scale each (a block's largest |w| / 127, weights rounded to the
// nearest multiple), a quarter of the bytes; the results are those of the fp32 products with the
// dequantized W (q · scale in fp32), the same W for both uses of a tied weight. Both need the
// panels: packed_weights_available(). kBf16Dot: the same bf16 W as kBf16, and the products round
// their inputs x to bf16 too (nearest-even, subnormals to zero) and sum the bf16 products in fp32
// with AVX512-BF16 dot products, two k at a time — twice kBf16's arithmetic rate where a product
// is arithmetic-bound (batches, prefill), and no longer the fp32 product of any weight: each sum
// differs from kBf16's by about x's rounding (2⁻⁹ relative). Each row's bits still do not depend
// on the other rows. Needs bf16_dot_available(). kInt8Dot: the same int8 W as kInt8, and the
// products quantize their inputs x the same way (per row, per block of 32 along the product's
// inner dimension, aligned with W's blocks: scale = the block's largest |x| / 127) and sum q_x ·
// q_w exactly in int32 with AVX512-VNNI dot products, four k at a time, each block's sum then
// scaled into an fp32 accumulator (by the product of x's and W's scales; where that overflows,
// by one, then the other): a quarter
// of the fp32 bytes and no widening, so batch 1 runs at the memory's rate; each sum differs from
// kInt8's by about x's quantization (~1/254 of a block's largest |x|). Each row's bits do not
// depend on the other rows. Needs int8_dot_available().
enum class WeightDtype { kFp32, kBf16, kInt8, kBf16Dot, kInt8Dot };
class PackedLinear {
 public:
  enum class Use { kForward, kTransposed };
  PackedLinear() = default;
  explicit PackedLinear(const Tensor& W, Use use = Use::kForward,
                        WeightDtype dtype = WeightDtype::kFp32);
  const Tensor& weight() const { return w_; }
  bool packed() const {
    return !panels_.empty() || !panels_bf16_.empty() || !panels_int8_.empty() ||
           !panels_bf16x2_.empty() || !panels_int8x4_.empty();
  }

  // One output of a product over several weights (linear_forward of a LinearOut list).
  struct Out {
    Tensor y;
    const PackedLinear* W;
  };

 private:
  friend void linear_forward(const ExecCtx&, Tensor, const Tensor&, const PackedLinear&, float);
  friend void linear_t_forward(const ExecCtx&, Tensor, const Tensor&, const PackedLinear&, float);
  friend void linear_forward(const ExecCtx&, const Tensor&, std::initializer_list<Out>);
  // y = beta·y + x·op(W) for each (y, W) of outs from their panels (checking that each W was
  // packed for `use`), any row count, as one product; false, computing nothing, where they are not
  // all packed in one dtype (a build without AVX-512).
  static bool apply(Use use, const Tensor& x, float beta, std::initializer_list<Out> outs);
  Tensor w_;
  Use use_ = Use::kForward;
  WeightDtype dtype_ = WeightDtype::kFp32;
  HugePageVector<float> panels_;          // WeightDtype::kFp32
  HugePageVector<uint16_t> panels_bf16_;  // WeightDtype::kBf16
  HugePageVector<int8_t> panels_int8_;    // WeightDtype::kInt8, with
  std::vector<float> scales_;             // one scale per panel and block of 32 rows
  HugePageVector<uint32_t> panels_bf16x2_;  // WeightDtype::kBf16Dot
  HugePageVector<uint8_t> panels_int8x4_;   // WeightDtype::kInt8Dot, with scales_
};
// Whether this build packs weights (AVX-512): without it PackedLinear uses W unpacked, in fp32.
bool packed_weights_available();
// Whether WeightDtype::kBf16Dot can be used: an AVX-512 build (which compiles its AVX512-BF16 dot
// products whatever the -march) on a CPU that has them (AMD Zen 4 and later, Intel Cooper Lake,
// Sapphire Rapids and later).
bool bf16_dot_available();
// Whether WeightDtype::kInt8Dot can be used: an AVX-512 build on a CPU with AVX512-VNNI (AMD Zen 4
// and later, Intel Cascade Lake, Ice Lake and later).
bool int8_dot_available();
// linear_forward / linear_t_forward with W.weight(), W packed for that use (Use::kForward /
// Use::kTransposed). Where W is packed (AVX-512 builds) each row's result has the same bits
// whatever the other rows of x (batch invariance: the engine's outputs do not depend on what else
// is in the batch); without panels it is the unpacked product.
void linear_forward(const ExecCtx&, Tensor y, const Tensor& x, const PackedLinear& W,
                    float beta = 0.0f);
void linear_t_forward(const ExecCtx&, Tensor y, const Tensor& x, const PackedLinear& W,
                      float beta = 0.0f);
// linear_forward(ctx, y, x, W) for each {y, &W} of outs (at most kMaxLinearOuts, all packed for
// Use::kForward; their inner dimension x's): the projections of one input. Where the weights are
// packed in one dtype it is one product (one split of all their panels over the threads, x
// converted once for the …dot dtypes), each row's bits those of the separate calls.
using LinearOut = PackedLinear::Out;
constexpr int kMaxLinearOuts = 4;
void linear_forward(const ExecCtx&, const Tensor& x, std::initializer_list<LinearOut> outs);
// Backward of linear_forward: dx[N,in] (+= when accumulate), dW[out,in] +=. Either may be empty.
void linear_backward(const ExecCtx&, Tensor dx, Tensor dW, const Tensor& dy, const Tensor& x,
                     const Tensor& W, bool accumulate_dx = false);
// Backward of linear_t_forward: dx[N,out] (+= when accumulate), dW[out,in] +=.
void linear_t_backward(const ExecCtx&, Tensor dx, Tensor dW, const Tensor& dy, const Tensor& x,
                       const Tensor& W, bool accumulate_dx = false);
// C[M,N] = beta·C + alpha·op(A)·op(B), row-major, leading dimensions explicit: the one sgemm
// entry point for ops that work on strided slices (attention heads).
void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc);

}  // namespace cemlm
