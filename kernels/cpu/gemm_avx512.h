// The AVX-512 few-row product behind gemm() (kernels/cpu/linear.cc); see gemm_avx512.cc.
#pragma once
#include <cstdint>

namespace cemlm {

// Rows up to which small_gemm takes a product: past this, OpenBLAS's cache blocking pays off.
constexpr int kSmallGemmMaxRows = 256;

// C[M,N] = beta·C + alpha·A·op(B) with A [M, K] row-major, op(B) = B [K, N] or (trans_b) the
// transpose of B [N, K]. Returns false, touching nothing, when it does not apply: a build without
// AVX-512, or M outside [2, kSmallGemmMaxRows].
bool small_gemm(bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                const float* B, int ldb, float beta, float* C, int ldc);

// Weights pack_panels writes for op(B) [K, N]: whole 32-column panels.
int64_t packed_panels_size(int N, int K);

// Writes op(B) [K, N] (B [N, K] when trans_b, else B [K, N]) in small_gemm's panel layout: panel p
// holds columns [32p, 32p + 32) (zeros past N) as K rows of 32 weights, panels one after another.
// The uint16_t overload stores each weight rounded to bf16 (nearest-even), a row's 32 as 16 pairs
// (column j, column j + 16): half the bytes to stream, the products still in fp32. Returns false,
// writing nothing, on a build without AVX-512.
bool pack_panels(bool trans_b, const float* B, int ldb, int N, int K, float* out);
bool pack_panels(bool trans_b, const float* B, int ldb, int N, int K, uint16_t* out);

// Rows of op(B) (its inner dimension K) that share one int8 scale per panel.
constexpr int kQuantBlock = 32;
// Scales pack_panels' int8 overload writes: one per panel and block of kQuantBlock rows.
int64_t packed_scales_size(int N, int K);
// int8 panels: each block of a panel (32 columns × 32 rows of op(B), fewer at the edges) is
// stored as q = round-to-nearest-even(w / s), s = the block's largest |w| / 127 (q = 0 where s = 0),
// one byte per weight, and s in `scales` (NaN for a block holding a non-finite weight, which
// then stands for NaNs). The products use w' = fp32(q · s): a quarter of the
// fp32 bytes. The blocks are 32 × 32 squares of B whichever way it is packed, so a weight packed
// for W·x and for Wᵀ·x (the tied W_Q and W_up) is quantized the same both ways.
bool pack_panels(bool trans_b, const float* B, int ldb, int N, int K, int8_t* out, float* scales);

// Whether the bf16 pair panels below can be multiplied: this build compiled the AVX512-BF16 dot
// products (with its AVX-512 kernels) and this CPU has them.
bool bf16_dot_supported();

// bf16 pair panels, for products whose inputs are rounded to bf16 too (AVX512-BF16 dot products):
// panel p holds columns [32p, 32p + 32) as ceil(K / 2) rows of 32 pairs, row kk's element j the
// bf16 weights of rows 2kk (low half) and 2kk + 1 (high half; zero past K) of op(B) in column j,
// each rounded to nearest-even as in the uint16_t layout. Returns false, writing nothing, on a
// build without AVX512-BF16.
int64_t packed_pair_panels_size(int N, int K);
bool pack_panels(bool trans_b, const float* B, int ldb, int N, int K, uint32_t* out);

// Whether the int8 quad panels below can be multiplied: this build compiled the AVX512-VNNI dot
// products (with its AVX-512 kernels) and this CPU has them.
bool int8_dot_supported();

// int8 quad panels, for products whose inputs are quantized to int8 too (AVX512-VNNI dot
// products): the q and scales of the int8 panels (same blocks), panel p holding columns
// [32p, 32p + 32) as ceil(K / 4) rows of 32 quads, row g's quad j the bytes q + 128 of rows
// 4g … 4g + 3 (zero q past K) of op(B) in column j. Returns false, writing nothing, on a build
// without AVX512-VNNI.
int64_t packed_quad_panels_size(int N, int K);
bool pack_panels(bool trans_b, const float* B, int ldb, int N, int K, uint8_t* out, float* scales);

// One product of a packed_products call: op(B) [K, N] as pack_panels wrote it (with its scales,
// for int8 and int8 quad panels; else null), and where its results go: C [M, N], leading
// dimension ldc.
template <typename W>
struct PackedTarget {
  const W* panels;
  const float* scales;
  int N;
  float* C;
  int ldc;
};
// The most targets one packed_products call takes.
constexpr int kMaxPackedTargets = 4;

// small_gemm with op(B) already in pack_panels' layout (no per-call transposes), for any M ≥ 1:
// C = beta·C + alpha·A·op(B) for each of n_targets (≤ kMaxPackedTargets) targets that share A
// [M, K] — the projections of one input — run as one product: one split of their panels over the
// threads (one fork where separate calls take one each) and A converted once (the …dot panels).
// Each output is one k-ordered chain of FMAs whatever M, the thread count and the other targets,
// so a row's result has the same bits alone, among other rows or among other targets (batch
// invariance; one row takes several panels at once to hide the FMA latency). With bf16 panels
// each weight is widened to fp32 exactly, so the result has the bits of the fp32 panels of the
// bf16-rounded weight. Only for panels pack_panels wrote (an AVX-512 build).
void packed_products(int M, int K, float alpha, const float* A, int lda, float beta,
                     const PackedTarget<float>* targets, int n_targets);
void packed_products(int M, int K, float alpha, const float* A, int lda, float beta,
                     const PackedTarget<uint16_t>* targets, int n_targets);
// int8 panels: the bits of the fp32 panels of the dequantized weight fp32(q · s).
void packed_products(int M, int K, float alpha, const float* A, int lda, float beta,
                     const PackedTarget<int8_t>* targets, int n_targets);
// bf16 pair panels: A's rows are rounded to bf16 (nearest-even, subnormals to zero) and each
// output is one chain, in k order, of AVX512-BF16 dot products of pairs (a[2kk], a[2kk + 1]) with
// the weights' pairs, accumulated in fp32: not the fp32 product, but the same bits for a row alone
// or among others, as above. Only for panels pack_panels wrote (an AVX512-BF16 build).
void packed_products(int M, int K, float alpha, const float* A, int lda, float beta,
                     const PackedTarget<uint32_t>* targets, int n_targets);
// int8 quad panels: each row of A is quantized per block b of 32 k as the weights are (s_a = the
// block's largest |a| / 127, q_a = a / s_a rounded to nearest-even, 0 where s_a = 0, s_a = NaN
// for a block with a non-finite a), and each output is, over the blocks in k order,
// acc = fma(fp32(Σ_k q_a · q_w), s_a · s_w, acc) with the integer sums exact (AVX512-VNNI), then
// the alpha/beta step: the same bits for a row alone or among others. Only for panels
// pack_panels wrote (an AVX512-VNNI build).
void packed_products(int M, int K, float alpha, const float* A, int lda, float beta,
                     const PackedTarget<uint8_t>* targets, int n_targets);

// c[N] = beta·c + alpha·op(B)ᵀ·a, one row of A times op(B): B [N, K] (trans_b: c[n] = B[n]·a)
// or B [K, N]. Returns false, touching nothing, on a build without AVX-512. Memory-bound: it
// streams B once, from several rows at a time.
bool small_gemv(bool trans_b, int N, int K, float alpha, const float* a, const float* B, int ldb,
                float beta, float* c);

}  // namespace cemlm
