// Causal attention over a paged KV cache, shared by standard attention (MODEL.md §4.1) and each
// CEM recursion step (§4.2): scores q·κ (+ the CEM diagonal term qd·c), softmax over j ≤ i, and
// the weighted sums of values (κ itself for CEM) and of contexts c (for the diagonal's ω).
// CPU oracle: kernels/cpu/attention.cc; tests: tests/model/attention_test.cc (against float64),
// tests/model/model_test.cc.
#pragma once
#include <cstdint>

#include "cemlm/kernels/tensor.h"

namespace cemlm {

// One layer's slice of the paged cache. Pools are [n_blocks, block_size, width]; block b of a
// sequence's table holds its positions [b·block_size, (b+1)·block_size). The pools are fp32 (k, v,
// c) or, on the CPU only, bf16 bit patterns (k16, v16, c16) or int8 with scales (k8, v8, c8): one
// of the three sets is set. An int8 entry stands for its integer times its group's scale; a key or
// value row has a scale per head (pools k_scale, v_scale of width n_heads), a context row one
// (c_scale, width 1): the scale is the group's largest magnitude / 127 (the next float down where
// 127 times it would overflow), the integers the nearest to value / scale, ties to even (kv_write).
// Within a block, entries are token-major (token t's row contiguous: the CUDA cache, and the CPU's
// for block sizes off a multiple of 16) or, when `tiled` (the CPU runner's for block sizes that are
// multiples of 16), column-major: column i of the block's tokens contiguous, so that 16 tokens'
// values of one column fill a vector and the AVX-512 passes need no reductions per token. Scale
// pools follow the same layout as pools of their width.
struct KvLayerView {
  float* k = nullptr;  // [.., H·d_h] rotated keys
  float* v = nullptr;  // [.., H·d_h] values; null for CEM (values are the keys)
  float* c = nullptr;  // [.., D] normalised contexts; null unless the CEM diagonal term is on
  int block_size = 0;
  int n_heads = 0;
  int k_width = 0;  // H·d_h
  int c_width = 0;  // D
  uint16_t* k16 = nullptr;  // the same pools stored as bf16
  uint16_t* v16 = nullptr;
  uint16_t* c16 = nullptr;
  int8_t* k8 = nullptr;  // the same pools stored as int8, with their scales
  int8_t* v8 = nullptr;
  int8_t* c8 = nullptr;
  float* k_scale = nullptr;  // [.., H]
  float* v_scale = nullptr;  // [.., H]
  float* c_scale = nullptr;  // [.., 1]
  bool tiled = false;  // column-major blocks (above)

  bool bf16() const { return k16 != nullptr; }
  bool int8() const { return k8 != nullptr; }
  // Where a sequence's position `pos` (through its block table) has its column 0 in a pool of
  // `width` columns, and the distance from one column to the next.
  int64_t entry(const int32_t* blocks, int pos, int width) const {
    const int64_t b = blocks[pos / block_size], t = pos % block_size;
    return tiled ? b * block_size * width + t : (b * block_size + t) * width;
  }
  int column_stride() const { return tiled ? block_size : 1; }
  // Token t of a block: its column 0's distance from the block's, in a pool of `width` columns.
  int64_t token_offset(int t, int width) const { return tiled ? t : int64_t(t) * width; }
  bool has_values() const { return v != nullptr || v16 != nullptr || v8 != nullptr; }
  bool has_contexts() const { return c != nullptr || c16 != nullptr || c8 != nullptr; }
};

// One kind of a layer's cache (keys, values or contexts) in whichever dtype it is stored: one of
// f32, b16, i8 is set; an int8 row's `groups` scales (columns width / groups each) are in `scale`.
struct KvPoolRef {
  float* f32 = nullptr;
  uint16_t* b16 = nullptr;
  int8_t* i8 = nullptr;
  float* scale = nullptr;
  int width = 0, groups = 1;
  static KvPoolRef keys(const KvLayerView& kv);
  static KvPoolRef values(const KvLayerView& kv);  // the keys where the view has no values
  static KvPoolRef contexts(const KvLayerView& kv);
};

// Rows [row_begin, row_begin + n_rows) of the batch belong to one sequence whose row r sits at
// position pos_begin + r and attends to cached positions 0 … pos_begin + r.
struct AttnSeq {
  int row_begin = 0, n_rows = 0, pos_begin = 0;
  const int32_t* blocks = nullptr;
};

enum class DiagKind { kNone, kShared, kPerHead };

// Whether a CPU cache of `block_size`-token blocks is best tiled (KvLayerView::tiled) for this
// build's attention: with the AVX-512 passes and blocks of a multiple of 16 tokens.
bool tiled_kv_cache_preferred(int block_size);

// Writes row r's entries (k[r], v[r], c[r]; v/c when the view has them) at its position, rounded
// to the nearest bf16 for a bf16 cache, quantized with their scales for an int8 one; the sequences
// split over the compute threads where the rows are many (no two sequences write one entry).
void kv_write(const ExecCtx&, const KvLayerView& kv, const AttnSeq* seqs, int n_seqs,
              const Tensor& k /*[N,H·d_h]*/, const Tensor& v /*[N,H·d_h] or empty*/,
              const Tensor& c /*[N,D] or empty*/);

// out[N, H·d_h]  = Σ_j p_{k,ij} v_{k,j}          (v = κ when kv.v is null)
// out_c          = shared: [N, D] Σ_k Σ_j p_{k,ij} c_j;  per-head: [N, H, D] Σ_j p_{k,ij} c_j; else empty
// s_{k,ij} = scale·(q_{k,i}·κ_{k,j} + qd_{(k),i}·c_j), qd = [N, D] (shared) or [N, H, D] (per-head).
// Scratch: paged_attention_scratch_floats(...) floats in ctx.scratch. Sequences with many rows
// (prefill chunks, training) take a gather + sgemm path; short ones (decode) a per-row path.
// Called inside an OpenMP parallel region, it runs on the calling thread alone.
void paged_attention_forward(const ExecCtx&, Tensor out, Tensor out_c, const Tensor& q,
                             const Tensor& qd, DiagKind diag, const KvLayerView& kv,
                             const AttnSeq* seqs, int n_seqs, float scale);

// `in_region`: the call will be made inside a parallel region (one thread's scratch), else by a
// thread outside any (scratch for every thread of the team it starts). `batch_invariant`: the
// ExecCtx's, which leaves the gemm path (and its scratch, a score matrix per thread) out.
int64_t paged_attention_scratch_floats(const AttnSeq* seqs, int n_seqs, const KvLayerView& kv,
                                       DiagKind diag, bool in_region = false,
                                       bool batch_invariant = false);

}  // namespace cemlm
