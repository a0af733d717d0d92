// The model's forward pass on the CPU (fp32, the oracle for every faster path): one batch of
// sequence chunks over a paged KV cache, and the full-sequence forward built on it. Each CEM
// sub-layer runs the batch's largest T; a row stops updating after its own T (rows are ordered
// by T descending so the rows still updating at step t form a prefix). Keys are written once.
#pragma once
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "cemlm/engine/config.h"
#include "cemlm/engine/model_runner.h"
#include "cemlm/engine/params.h"
#include "cemlm/kernels/attention.h"
#include "cemlm/kernels/huge_pages.h"
#include "cemlm/kernels/lev.h"
#include "cemlm/kernels/linear.h"
#include "cemlm/kernels/precond.h"

namespace cemlm {

// Paged KV storage for all layers: [L][n_blocks, block_size, width] per kind (MODEL.md §9), as
// fp32, bf16 (half the bytes, entries rounded to bf16) or int8 (a quarter, plus a float scale per
// head of a key or value row and per context row; see KvLayerView).
class KvPool {
 public:
  KvPool(const ModelConfig& c, int block_size, int64_t n_blocks, KvDtype dtype = KvDtype::kFp32);
  static int64_t blocks_for_budget(const ModelConfig& c, int block_size, int64_t bytes,
                                   KvDtype dtype = KvDtype::kFp32);
  // OK when `blocks` (of `budget` bytes) hold one max_seq_len sequence, else INVALID_ARGUMENT
  // saying how much it needs, then `advice`.
  static absl::Status check_holds_a_sequence(const ModelConfig& c, int block_size, int64_t blocks,
                                             int64_t budget, KvDtype dtype,
                                             std::string_view advice);
  KvLayerView layer(int l);
  int block_size() const { return block_size_; }
  int64_t num_blocks() const { return n_blocks_; }
  KvDtype dtype() const { return dtype_; }
  // The bytes its pools hold per token (all layers, scales included), from what it allocated.
  int64_t bytes_per_token() const;
  void copy_block(int32_t src, int32_t dst);

 private:
  template <typename E>
  void copy_block_in(HugePageVector<E>* pool, int width, int32_t src, int32_t dst);

  int block_size_;
  int64_t n_blocks_;
  KvDtype dtype_;
  int n_layers_, n_heads_, kw_, vw_, cw_;  // numbers per token per layer per kind
  HugePageVector<float> k_, v_, c_;           // fp32 pools
  HugePageVector<uint16_t> k16_, v16_, c16_;  // bf16 pools
  HugePageVector<int8_t> k8_, v8_, c8_;       // int8 pools
  HugePageVector<float> ks_, vs_, cs_;        // their scales: H, H and 1 per token per layer
};

struct SeqRange;  // a range of a batch's sequences (cpu_model.cc)

class CpuModel {
 public:
  // `w` must outlive the model. Precomputes the LEV table and the RoPE table, and packs the weights
  // for the few-row kernels (PackedLinear: a second copy of each weight, a third of the tied W_Q
  // and W_up of CEM sub-layers, which serve both as W·x and as Wᵀ·x). batch_invariant (the engine's
  // runner): each row's logits and cache entries have the same bits whatever else is in the batch
  // or how its prompt was chunked (ExecCtx::batch_invariant; on AVX-512 builds, whose packed
  // products are row-invariant, see linear.h; elsewhere within float rounding), so that a seeded
  // request samples the same tokens alone or batched; off (the full-sequence oracle, the trainer's
  // evaluation), a prefill chunk's attention runs as sgemms, which round differently. weights: the
  // packed copies' dtype (kBf16: every product weight — W_Q, W_K, W_V, W_O, the MLP's and the head
  // — rounded to bf16, half the bytes; embeddings, norms, diagonals and preconditioners stay fp32);
  // kInt8: the same weights in int8 with block scales. Both need packed_weights_available().
  // release_unread (a runner that owns `w`): give the pages of weights_left_unread() back to the
  // system as they are packed (reading them later gives zeros).
  CpuModel(const ModelConfig& c, const Weights& w, bool batch_invariant = false,
           WeightDtype weights = WeightDtype::kFp32, bool release_unread = false);
  const ModelConfig& config() const { return cfg_; }
  // See ModelRunner::forward.
  void forward(const Batch& batch, KvPool& kv, std::vector<float>* logits);
  // The same logits handed to `sink` at most `rows_per_call` rows at a time, in order ([rows, V]
  // from logits row `first`, valid during the call), so that a long sequence's [N, V] is never
  // held at once. A call's rows may round differently in their last bits (fewer rows, another
  // product kernel).
  using LogitsSink = std::function<void(int64_t first, int64_t rows, const float* logits)>;
  void forward(const Batch& batch, KvPool& kv, int64_t rows_per_call, const LogitsSink& sink);
  // Embedding rows for ids (the precomputed table, or the table weight).
  const float* embedding(int token) const;
  // The first token whose precomputed LEV embedding holds a non-finite value, or -1 (always -1
  // for a table embedding, whose weights were checked finite at load): finite LEV weights can
  // still overflow the product over seed_dim (see lev_embedding_error).
  int64_t first_nonfinite_embedding() const;
  // The weights of `w` this model never reads after construction: those it applies only through
  // packed copies (all product weights on AVX-512 builds), except one that aliases a weight it
  // does read (a tied head is the embedding table).
  std::vector<Tensor> weights_left_unread() const;

 private:
  struct Rows;
  // Every layer over the batch's rows; leaves the final-normalised rows that want logits in
  // buf(kFinal) and returns their number (0: nothing to do).
  int64_t final_rows(const Batch& batch, KvPool& kv, Rows& r);
  void attention_standard(int l, Rows& r, KvPool& kv);
  void attention_cem(int l, Rows& r, KvPool& kv);
  // The T recursion steps of one CEM attention sub-layer for the rows of one range of sequences.
  void attention_cem_steps(int l, const Rows& r, const KvLayerView& view_l,
                           const SeqRange& g, const ExecCtx& ctx);
  void mlp_swiglu(int l, Rows& r);
  void mlp_cem(int l, Rows& r);
  float* buf(size_t i, int64_t n);
  // Floats a row of the diag term's query (and of its attention output) takes: [H, D] per head,
  // [D] shared, none without the term.
  int64_t qd_width() const;

  // The weights applied as W·x, the tied ones applied as Wᵀ·x (wq_t, w_up_t: CEM sub-layers only),
  // and the CEM sub-layers' preconditioners (when their rank is > 0).
  struct PackedLayer {
    PackedLinear wq, wk, wv, wo, w_gate, w_up, w_down, wq_t, w_up_t;
    PackedPrecond attn_precond, mlp_precond;
  };

  // The weights behind these packed ones that the model never reads (see weights_left_unread).
  std::vector<Tensor> unread_weights(std::initializer_list<const PackedLinear*> packed) const;
  std::vector<Tensor> unread_weights(const PackedLayer& pl) const;

  ModelConfig cfg_;
  const Weights& w_;
  bool batch_invariant_;
  std::vector<PackedLayer> packed_;
  PackedLinear lm_head_;
  std::vector<float> lev_table_;  // [V, D] when the embedding is LEV
  std::vector<std::vector<float>> bufs_;
};

// The attention kernels' view of the config's diagonal mode (kNone for standard attention).
DiagKind diag_kind(const ModelConfig& c);
// The LEV generator's weights out of a model's named views.
LevWeights lev_weights(const Weights& w);
// The first of `rows` rows of `width` floats that holds a non-finite value, or -1.
int64_t first_nonfinite_row(const float* rows_data, int64_t rows, int64_t width);
// The error of a LEV embedding that is not finite at `token` though every weight is (the product
// over seed_dim overflows), where every use of the token would fail on non-finite logits.
absl::Status lev_embedding_error(int64_t token);

// Logits [N, V] of a whole sequence at recursion T: the reference path used by `cemlm score`,
// tests and the trainer's checks (one contiguous block holds the sequence). release_weights (a
// caller done with `w`, as `cemlm score` is): the model gives back the pages of the weights it
// packed (CpuModel's release_unread), so that the weights are not held twice.
std::vector<float> full_forward(const ModelConfig& c, const Weights& w, const std::vector<int>& ids,
                                int T, bool release_weights = false);
// The same, handing the logits to `sink` `rows_per_call` rows at a time (CpuModel::forward).
void full_forward(const ModelConfig& c, const Weights& w, const std::vector<int>& ids, int T,
                  bool release_weights, int64_t rows_per_call, const CpuModel::LogitsSink& sink);

}  // namespace cemlm
