// CPU forward pass (see cpu_model.h). Flat per-layer lists of op calls; all buffers are
// grow-only and reused between steps, so a steady decode loop does not allocate.
#include "cemlm/engine/cpu_model.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <numeric>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "cemlm/kernels/elementwise.h"
#include "cemlm/kernels/lev.h"
#include "cemlm/kernels/linear.h"
#include "cemlm/kernels/parallel.h"
#include "cemlm/kernels/precond.h"
#include "cemlm/kernels/rmsnorm.h"
#include "cemlm/kernels/rope.h"

namespace cemlm {

KvPool::KvPool(const ModelConfig& c, int block_size, int64_t n_blocks, KvDtype dtype)
    : block_size_(block_size),
      n_blocks_(n_blocks),
      dtype_(dtype),
      n_layers_(c.n_layers),
      n_heads_(c.n_heads),
      kw_(c.qk_dim()),
      vw_(c.attention == AttentionType::kStandard ? c.qk_dim() : 0),
      cw_(c.attention == AttentionType::kCem && c.diag != DiagMode::kNone ? c.d_model : 0) {
  const int64_t per = int64_t(n_layers_) * n_blocks * block_size;
  if (dtype == KvDtype::kInt8) {
    k8_.assign(per * kw_, 0), v8_.assign(per * vw_, 0), c8_.assign(per * cw_, 0);
    ks_.assign(per * n_heads_, 0.0f), vs_.assign(vw_ ? per * n_heads_ : 0, 0.0f);
    cs_.assign(cw_ ? per : 0, 0.0f);
  } else if (dtype == KvDtype::kBf16) {
    k16_.assign(per * kw_, 0), v16_.assign(per * vw_, 0), c16_.assign(per * cw_, 0);
  } else {
    k_.assign(per * kw_, 0.0f), v_.assign(per * vw_, 0.0f), c_.assign(per * cw_, 0.0f);
  }
}

int64_t KvPool::blocks_for_budget(const ModelConfig& c, int block_size, int64_t bytes,
                                  KvDtype dtype) {
  // Block tables hold int32 ids: a larger pool (a tiny model's at a budget of hundreds of GB)
  // would give two blocks one id.
  return std::min<int64_t>(bytes / (int64_t(block_size) * c.kv_bytes_per_token(dtype)), INT32_MAX);
}

absl::Status KvPool::check_holds_a_sequence(const ModelConfig& c, int block_size, int64_t blocks,
                                            int64_t budget, KvDtype dtype,
                                            std::string_view advice) {
  const int64_t needed = (c.max_seq_len + block_size - 1) / block_size;
  if (blocks >= needed) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "a KV cache of ", budget, " bytes holds ", blocks, " blocks of ", block_size,
      " tokens, but one sequence of the model's max_seq_len (", c.max_seq_len, ") needs ", needed,
      " (", needed * block_size * c.kv_bytes_per_token(dtype), " bytes); ", std::string(advice)));
}

int64_t KvPool::bytes_per_token() const {
  const size_t bytes =
      sizeof(float) * (k_.size() + v_.size() + c_.size() + ks_.size() + vs_.size() + cs_.size()) +
      sizeof(uint16_t) * (k16_.size() + v16_.size() + c16_.size()) + k8_.size() + v8_.size() +
      c8_.size();
  return int64_t(bytes) / (n_blocks_ * block_size_);
}

KvLayerView KvPool::layer(int l) {
  const int64_t per = n_blocks_ * block_size_;
  KvLayerView v;
  if (dtype_ == KvDtype::kInt8) {
    v.k8 = k8_.data() + l * per * kw_, v.k_scale = ks_.data() + l * per * n_heads_;
    if (vw_) v.v8 = v8_.data() + l * per * vw_, v.v_scale = vs_.data() + l * per * n_heads_;
    if (cw_) v.c8 = c8_.data() + l * per * cw_, v.c_scale = cs_.data() + l * per;
  } else if (dtype_ == KvDtype::kBf16) {
    v.k16 = k16_.data() + l * per * kw_;
    v.v16 = vw_ ? v16_.data() + l * per * vw_ : nullptr;
    v.c16 = cw_ ? c16_.data() + l * per * cw_ : nullptr;
  } else {
    v.k = k_.data() + l * per * kw_;
    v.v = vw_ ? v_.data() + l * per * vw_ : nullptr;
    v.c = cw_ ? c_.data() + l * per * cw_ : nullptr;
  }
  v.block_size = block_size_;
  v.tiled = tiled_kv_cache_preferred(block_size_);
  v.n_heads = n_heads_;
  v.k_width = kw_;
  v.c_width = cw_;
  return v;
}

template <typename E>
void KvPool::copy_block_in(HugePageVector<E>* pool, int width, int32_t src, int32_t dst) {
  const int64_t per = n_blocks_ * block_size_;
  for (int l = 0; l < n_layers_; ++l) {
    E* base = pool->data() + l * per * width;
    std::memcpy(base + int64_t(dst) * block_size_ * width,
                base + int64_t(src) * block_size_ * width, sizeof(E) * block_size_ * width);
  }
}

void KvPool::copy_block(int32_t src, int32_t dst) {
  for (auto [pool, pool16, pool8, scales, w] :
       {std::tuple{&k_, &k16_, &k8_, &ks_, kw_}, std::tuple{&v_, &v16_, &v8_, &vs_, vw_},
        std::tuple{&c_, &c16_, &c8_, &cs_, cw_}}) {
    if (!w) continue;
    if (dtype_ == KvDtype::kInt8) {
      copy_block_in(pool8, w, src, dst);
      copy_block_in(scales, pool8 == &c8_ ? 1 : n_heads_, src, dst);
    } else if (dtype_ == KvDtype::kBf16) {
      copy_block_in(pool16, w, src, dst);
    } else {
      copy_block_in(pool, w, src, dst);
    }
  }
}

// Sequences [s0, s1) of a batch and their rows [r0, r1). `inner` ranges (one long chunk, or the
// only range) run their recursion steps with every thread inside each op; the others run one
// range per thread, concurrently.
struct SeqRange {
  int s0 = 0, s1 = 0;
  int64_t r0 = 0, r1 = 0;
  bool inner = true;
};

// Per-step row bookkeeping and the hidden-state buffer.
struct CpuModel::Rows {
  int N = 0, Tmax = 1;
  std::vector<int32_t> pos, ids;
  // RoPE for the rows' positions: row i of `rope` is position pos[i]'s (row[i] = i indexes it).
  Tensor rope;
  std::vector<int32_t> row;
  std::vector<float> eta;
  std::vector<AttnSeq> seqs;
  std::vector<int> seq_T;
  std::vector<SeqRange> attn_ranges;  // the CEM attention sub-layers' recursion groups
  float* h = nullptr;
  ExecCtx ctx;
  // Rows of range g still updating at recursion step t (a prefix: seqs sorted by T desc), and in
  // *ns the number of its sequences they belong to.
  int64_t active(const SeqRange& g, int t, int* ns) const {
    int s = g.s0;
    int64_t n = 0;
    while (s < g.s1 && seq_T[s] > t) n += seqs[s++].n_rows;
    *ns = s - g.s0;
    return n;
  }
  SeqRange all() const { return SeqRange{0, int(seqs.size()), 0, N, true}; }
};

namespace {

// Short sequences (decode rows) are grouped for the CEM attention recursion: each thread runs
// whole recursion steps for the rows of its groups, one parallel region per sub-layer instead of
// one per op (two threads, batch 32, interleaved A/B: 0–18% off a step, never > 3% slower). A
// group holds at most two 8-row product tiles, and there are at least as many groups as threads.
// (Capping a group's cache at 1 MiB so that it stays in L2 across the T steps measured slower: the
// row kernel is bound by its own work, not by where the cache lives, and 3–7-row products waste
// the tiles.)
constexpr int kShortRows = 8;  // sequences with fewer rows are grouped
constexpr int kGroupMaxRows = 16;

std::vector<SeqRange> recursion_groups(const std::vector<AttnSeq>& seqs, int threads) {
  int64_t short_rows = 0;
  for (const AttnSeq& a : seqs) short_rows += a.n_rows < kShortRows ? a.n_rows : 0;
  const int64_t cap = std::clamp<int64_t>((short_rows + threads - 1) / std::max(threads, 1), 1,
                                          kGroupMaxRows);
  std::vector<SeqRange> out;
  for (int s = 0; s < int(seqs.size()); ++s) {
    const AttnSeq& a = seqs[s];
    const bool is_short = a.n_rows < kShortRows;
    SeqRange* last = out.empty() ? nullptr : &out.back();
    if (is_short && last && !last->inner && last->r1 - last->r0 + a.n_rows <= cap) {
      last->s1 = s + 1, last->r1 += a.n_rows;
      continue;
    }
    out.push_back(SeqRange{s, s + 1, a.row_begin, a.row_begin + a.n_rows, !is_short});
  }
  // A single group gains nothing from running beside others: give it every thread instead.
  if (std::count_if(out.begin(), out.end(), [](const SeqRange& g) { return !g.inner; }) == 1)
    for (SeqRange& g : out) g.inner = true;
  return out;
}
}  // namespace

namespace {
enum Buf {
  kH,
  kC,
  kY,
  kQ,
  kK,
  kV,
  kA,
  kU,
  kPU,
  kQD,
  kOC,
  kG,
  kZ,
  kRope,
  kScratch,
  kGroupScratch,
  kFinal,
  kNumBufs
};
Tensor view(float* p, int64_t r, int64_t c) { return Tensor(p, {r, c}); }
}  // namespace

CpuModel::CpuModel(const ModelConfig& c, const Weights& w, bool batch_invariant,
                   WeightDtype weights, bool release_unread)
    : cfg_(c),
      w_(w),
      batch_invariant_(batch_invariant),
      bufs_(kNumBufs) {
  for (const LayerWeights& lw : w.layers) {
    auto fwd = [&](const Tensor& W) { return PackedLinear(W, PackedLinear::Use::kForward, weights); };
    // The tied W_Q and W_up of CEM sub-layers, applied as Wᵀ·x too.
    auto tied = [&](const Tensor& W, bool cem) {
      return cem ? PackedLinear(W, PackedLinear::Use::kTransposed, weights) : PackedLinear();
    };
    const bool cem_attn = c.attention == AttentionType::kCem, cem_mlp = c.mlp == MlpType::kCem;
    PackedLayer& pl = packed_.emplace_back(PackedLayer{
        fwd(lw.wq), fwd(lw.wk), fwd(lw.wv), fwd(lw.wo), fwd(lw.w_gate), fwd(lw.w_up),
        fwd(lw.w_down), tied(lw.wq, cem_attn), tied(lw.w_up, cem_mlp), PackedPrecond(),
        PackedPrecond()});
    if (c.attn_precond_rank > 0) pl.attn_precond = PackedPrecond(lw.attn_p, lw.attn_u, lw.attn_v);
    if (c.mlp_precond_rank > 0) pl.mlp_precond = PackedPrecond(lw.mlp_p, lw.mlp_u, lw.mlp_v);
    // Layer by layer, so that the process never holds a whole second copy of the weights.
    if (release_unread)
      for (const Tensor& t : unread_weights(pl)) release_pages(t.data, t.numel() * sizeof(float));
  }
  lm_head_ = PackedLinear(w.lm_head, PackedLinear::Use::kForward, weights);
  if (release_unread)
    for (const Tensor& t : unread_weights({&lm_head_}))
      release_pages(t.data, t.numel() * sizeof(float));
  if (c.embedding == EmbeddingType::kLev) {
    lev_table_.resize(size_t(c.vocab_size) * c.d_model);
    std::vector<int32_t> all(c.vocab_size);
    for (int i = 0; i < c.vocab_size; ++i) all[i] = i;
    lev_forward_f64(Tensor(lev_table_.data(), {c.vocab_size, c.d_model}), all.data(),
                    lev_weights(w));
  }
}

DiagKind diag_kind(const ModelConfig& c) {
  if (c.attention != AttentionType::kCem) return DiagKind::kNone;
  return c.diag == DiagMode::kShared    ? DiagKind::kShared
         : c.diag == DiagMode::kPerHead ? DiagKind::kPerHead
                                        : DiagKind::kNone;
}

LevWeights lev_weights(const Weights& w) {
  return LevWeights{w.lev_codebooks, w.lev_seed_proj, w.lev_ln_weight,
                    w.lev_ln_bias,   w.lev_spline,    w.lev_out_proj};
}

std::vector<Tensor> CpuModel::unread_weights(std::initializer_list<const PackedLinear*> packed) const {
  std::vector<Tensor> out;
  for (const PackedLinear* p : packed) {
    const Tensor& w = p->weight();
    if (!p->packed() || w.empty() || w.data == w_.embed.data) continue;
    if (std::none_of(out.begin(), out.end(), [&](const Tensor& t) { return t.data == w.data; }))
      out.push_back(w);  // once: a tied W_Q or W_up is packed for both uses
  }
  return out;
}

std::vector<Tensor> CpuModel::unread_weights(const PackedLayer& pl) const {
  return unread_weights({&pl.wq, &pl.wk, &pl.wv, &pl.wo, &pl.w_gate, &pl.w_up, &pl.w_down,
                         &pl.wq_t, &pl.w_up_t});
}

std::vector<Tensor> CpuModel::weights_left_unread() const {
  std::vector<Tensor> out = unread_weights({&lm_head_});
  for (const PackedLayer& pl : packed_) {
    const std::vector<Tensor> layer = unread_weights(pl);
    out.insert(out.end(), layer.begin(), layer.end());
  }
  return out;
}

const float* CpuModel::embedding(int token) const {
  const float* base = lev_table_.empty() ? w_.embed.data : lev_table_.data();
  return base + int64_t(token) * cfg_.d_model;
}

int64_t CpuModel::first_nonfinite_embedding() const {
  return first_nonfinite_row(lev_table_.data(), int64_t(lev_table_.size()) / cfg_.d_model,
                             cfg_.d_model);
}

int64_t first_nonfinite_row(const float* rows_data, int64_t rows, int64_t width) {
  const float* end = rows_data + rows * width;
  const float* bad = std::find_if(rows_data, end, [](float x) { return !std::isfinite(x); });
  return bad == end ? -1 : (bad - rows_data) / width;
}

absl::Status lev_embedding_error(int64_t token) {
  return absl::InvalidArgumentError(absl::StrCat(
      "the LEV embedding of token ", token,
      " is not finite, though every weight is: the product of its seed_dim spline factors "
      "overflows a float (lev.spline, lev.out_proj too large for embedding.lev.seed_dim); the "
      "checkpoint cannot serve that token: use another, or retrain it"));
}

int64_t CpuModel::qd_width() const {
  switch (diag_kind(cfg_)) {
    case DiagKind::kPerHead:
      return int64_t(cfg_.n_heads) * cfg_.d_model;
    case DiagKind::kShared:
      return cfg_.d_model;
    default:
      return 0;
  }
}

float* CpuModel::buf(size_t i, int64_t n) {
  if (int64_t(bufs_[i].size()) < n) bufs_[i].resize(n);
  return bufs_[i].data();
}

void CpuModel::forward(const Batch& batch, KvPool& kv, std::vector<float>* logits) {
  Rows r;
  const int64_t M = final_rows(batch, kv, r);
  if (M == 0) return;
  const int64_t D = cfg_.d_model, V = cfg_.vocab_size;
  logits->resize(size_t(M * V));
  linear_forward(r.ctx, view(logits->data(), M, V), view(buf(kFinal, M * D), M, D), lm_head_);
}

void CpuModel::forward(const Batch& batch, KvPool& kv, int64_t rows_per_call,
                       const LogitsSink& sink) {
  CEMLM_CHECK(rows_per_call > 0);
  Rows r;
  const int64_t M = final_rows(batch, kv, r);
  const int64_t D = cfg_.d_model, V = cfg_.vocab_size;
  std::vector<float> logits(size_t(std::min(M, rows_per_call) * V));
  float* fin = buf(kFinal, M * D);
  for (int64_t first = 0; first < M; first += rows_per_call) {
    const int64_t rows = std::min(rows_per_call, M - first);
    linear_forward(r.ctx, view(logits.data(), rows, V), view(fin + first * D, rows, D), lm_head_);
    sink(first, rows, logits.data());
  }
}

int64_t CpuModel::final_rows(const Batch& batch, KvPool& kv, Rows& r) {
  const int D = cfg_.d_model, Q = cfg_.qk_dim(), F = cfg_.d_ff, V = cfg_.vocab_size;
  for (const BatchSeq& s : batch.seqs) {
    CEMLM_CHECK(s.recursion >= 1 && s.n_tokens >= 1);
    CEMLM_CHECK(r.seq_T.empty() || r.seq_T.back() >= s.recursion);
    CEMLM_CHECK(int64_t(s.n_blocks) * kv.block_size() >= s.pos_begin + s.n_tokens);
    CEMLM_CHECK(s.pos_begin + s.n_tokens <= cfg_.max_seq_len);
    r.seqs.push_back(AttnSeq{r.N, s.n_tokens, s.pos_begin, s.block_table});
    r.seq_T.push_back(s.recursion);
    for (int i = 0; i < s.n_tokens; ++i) {
      CEMLM_CHECK(s.tokens[i] >= 0 && s.tokens[i] < V);
      r.ids.push_back(s.tokens[i]);
      r.pos.push_back(s.pos_begin + i);
      r.eta.push_back(cfg_.step(s.recursion));
    }
    r.N += s.n_tokens;
  }
  if (r.N == 0) return 0;
  r.Tmax = r.seq_T.front();
  const int64_t N = r.N;
  const int rank = std::max(cfg_.attn_precond_rank, cfg_.mlp_precond_rank);
  const DiagKind kind = diag_kind(cfg_);
  const int64_t scratch = std::max<int64_t>(
      paged_attention_scratch_floats(r.seqs.data(), int(r.seqs.size()), kv.layer(0), kind,
                                     /*in_region=*/false, batch_invariant_),
      2 * N * std::max(rank, 1));
  r.ctx.scratch = buf(kScratch, scratch);
  r.ctx.scratch_floats = scratch;
  r.ctx.batch_invariant = batch_invariant_;
  r.rope = view(buf(kRope, N * cfg_.head_dim), N, cfg_.head_dim);
  rope_rows_init(r.ctx, r.rope, r.pos.data(), cfg_.rope_theta);
  r.row.resize(size_t(N));
  std::iota(r.row.begin(), r.row.end(), 0);
  // Sized once per step for the largest use.
  buf(kC, N * D), buf(kY, N * D), buf(kQ, N * Q), buf(kK, N * Q), buf(kV, N * Q), buf(kA, N * Q);
  buf(kU, N * D), buf(kPU, N * D), buf(kQD, N * qd_width()), buf(kOC, N * qd_width());
  buf(kG, N * F);
  buf(kZ, N * F);
  r.h = buf(kH, N * D);
  if (cfg_.attention == AttentionType::kCem)
    r.attn_ranges = recursion_groups(r.seqs, compute_threads());
  for (int64_t i = 0; i < N; ++i) std::memcpy(r.h + i * D, embedding(r.ids[i]), sizeof(float) * D);

  for (int l = 0; l < cfg_.n_layers; ++l) {
    if (cfg_.attention == AttentionType::kCem) attention_cem(l, r, kv);
    else attention_standard(l, r, kv);
    if (cfg_.mlp == MlpType::kCem) mlp_cem(l, r);
    else mlp_swiglu(l, r);
  }

  std::vector<int64_t> out_rows;
  for (size_t s = 0; s < batch.seqs.size(); ++s) {
    const AttnSeq& a = r.seqs[s];
    if (batch.seqs[s].want_all_logits)
      for (int i = 0; i < a.n_rows; ++i) out_rows.push_back(a.row_begin + i);
    else if (batch.seqs[s].want_logits)
      out_rows.push_back(a.row_begin + a.n_rows - 1);
  }
  const int64_t M = int64_t(out_rows.size());
  float* fin = buf(kFinal, M * D);
  for (int64_t i = 0; i < M; ++i) std::memcpy(fin + i * D, r.h + out_rows[i] * D, sizeof(float) * D);
  rmsnorm_forward(r.ctx, view(fin, M, D), Tensor{}, view(fin, M, D), w_.final_norm, cfg_.norm_eps);
  return M;
}

void CpuModel::attention_standard(int l, Rows& r, KvPool& kv) {
  const LayerWeights& lw = w_.layers[l];
  const PackedLayer& pw = packed_[l];
  const int64_t N = r.N, D = cfg_.d_model, Q = cfg_.qk_dim();
  Tensor h = view(r.h, N, D), c = view(buf(kC, 0), N, D), q = view(buf(kQ, 0), N, Q),
         k = view(buf(kK, 0), N, Q), v = view(buf(kV, 0), N, Q), a = view(buf(kA, 0), N, Q);
  rmsnorm_forward(r.ctx, c, Tensor{}, h, lw.attn_norm, cfg_.norm_eps);
  linear_forward(r.ctx, c, {{q, &pw.wq}, {k, &pw.wk}, {v, &pw.wv}});
  rope_forward(r.ctx, q, q, r.row.data(), r.rope, false);
  rope_forward(r.ctx, k, k, r.row.data(), r.rope, false);
  const KvLayerView view_l = kv.layer(l);
  kv_write(r.ctx, view_l, r.seqs.data(), int(r.seqs.size()), k, v, Tensor{});
  paged_attention_forward(r.ctx, a, Tensor{}, q, Tensor{}, DiagKind::kNone, view_l, r.seqs.data(),
                          int(r.seqs.size()), 1.0f / std::sqrt(float(cfg_.head_dim)));
  linear_forward(r.ctx, h, a, pw.wo, 1.0f);
}

void CpuModel::attention_cem(int l, Rows& r, KvPool& kv) {
  const LayerWeights& lw = w_.layers[l];
  const PackedLayer& pw = packed_[l];
  const int64_t N = r.N, D = cfg_.d_model, Q = cfg_.qk_dim();
  const bool diag = cfg_.diag != DiagMode::kNone;
  Tensor c = view(buf(kC, 0), N, D), k = view(buf(kK, 0), N, Q);
  // The context and the keys come from the sub-layer input, once, whatever T is; so does the first
  // step's query (its normalised input is c): one product of c for both.
  rmsnorm_forward(r.ctx, c, Tensor{}, view(r.h, N, D), lw.attn_norm, cfg_.norm_eps);
  linear_forward(r.ctx, c, {{k, &pw.wk}, {view(buf(kQ, 0), N, Q), &pw.wq}});
  rope_forward(r.ctx, k, k, r.row.data(), r.rope, false);
  const KvLayerView view_l = kv.layer(l);
  kv_write(r.ctx, view_l, r.seqs.data(), int(r.seqs.size()), k, Tensor{}, diag ? c : Tensor{});
  // The recursion steps: rows are independent given the cache, so ranges run in any order.
  std::vector<const SeqRange*> side;
  for (const SeqRange& g : r.attn_ranges)
    if (g.inner) attention_cem_steps(l, r, view_l, g, r.ctx);
    else side.push_back(&g);
  if (side.empty()) return;
  int64_t per_thread = 0;  // scratch of one group's ops
  for (const SeqRange* g : side)  // each group's ops run inside the region below, on one thread
    per_thread = std::max(
        per_thread, std::max<int64_t>(paged_attention_scratch_floats(
                                          r.seqs.data() + g->s0, g->s1 - g->s0, view_l,
                                          diag_kind(cfg_), /*in_region=*/true, batch_invariant_),
                                      2 * (g->r1 - g->r0) * std::max(cfg_.attn_precond_rank, 1)));
  float* scratch = buf(kGroupScratch, per_thread * compute_threads());
  parallel_for_dynamic(int64_t(side.size()), true, [&](int64_t i) {
    ExecCtx ctx = r.ctx;
    ctx.scratch = scratch + per_thread * team_thread();
    ctx.scratch_floats = per_thread;
    attention_cem_steps(l, r, view_l, *side[i], ctx);
  });
}

void CpuModel::attention_cem_steps(int l, const Rows& r, const KvLayerView& view_l,
                                   const SeqRange& g, const ExecCtx& ctx) {
  const LayerWeights& lw = w_.layers[l];
  const PackedLayer& pw = packed_[l];
  const int64_t D = cfg_.d_model, Q = cfg_.qk_dim(), r0 = g.r0;
  const bool diag = cfg_.diag != DiagMode::kNone;
  const DiagKind kind = diag_kind(cfg_);
  const float scale = 1.0f / std::sqrt(float(cfg_.head_dim));
  // The range's sequences with rows counted from r0, like the views below.
  std::vector<AttnSeq> seqs(r.seqs.begin() + g.s0, r.seqs.begin() + g.s1);
  for (AttnSeq& a : seqs) a.row_begin -= int(r0);
  const int32_t* row = r.row.data() + r0;  // into r.rope
  auto rows = [&](Buf b, int64_t n, int64_t width) {
    return view(bufs_[b].data() + r0 * width, n, width);
  };
  for (int t = 0; t < r.Tmax; ++t) {
    int ns = 0;
    const int64_t n = r.active(g, t, &ns);
    if (n == 0) break;
    // x⁰ = h, so the first step's normalised query input is the context c itself.
    Tensor x = view(r.h + r0 * D, n, D), y = rows(t == 0 ? kC : kY, n, D), q = rows(kQ, n, Q),
           a = rows(kA, n, Q), u = rows(kU, n, D), pu = rows(kPU, n, D),
           qd = rows(kQD, n, qd_width()), oc = rows(kOC, n, qd_width());
    if (t > 0) {  // the first step's query is attention_cem's
      rmsnorm_forward(ctx, y, Tensor{}, x, lw.attn_norm, cfg_.norm_eps);
      linear_forward(ctx, q, y, pw.wq);
    }
    rope_forward(ctx, q, q, row, r.rope, false);
    if (diag) diag_scale_forward(ctx, qd, y, lw.diag);
    paged_attention_forward(ctx, a, diag ? oc : Tensor{}, q, diag ? qd : Tensor{}, kind, view_l,
                            seqs.data(), ns, scale);
    rope_forward(ctx, a, a, row, r.rope, true);
    linear_t_forward(ctx, u, a, pw.wq_t);
    if (diag) diag_gather_forward(ctx, u, oc, lw.diag);
    if (cfg_.attn_precond_rank > 0) precond_forward(ctx, pu, u, pw.attn_precond);
    axpy_rows_forward(ctx, x, cfg_.attn_precond_rank > 0 ? pu : u, r.eta.data() + r0);
  }
}

void CpuModel::mlp_swiglu(int l, Rows& r) {
  const LayerWeights& lw = w_.layers[l];
  const PackedLayer& pw = packed_[l];
  const int64_t N = r.N, D = cfg_.d_model, F = cfg_.d_ff;
  Tensor h = view(r.h, N, D), c = view(buf(kC, 0), N, D), g = view(buf(kG, 0), N, F),
         z = view(buf(kZ, 0), N, F);
  rmsnorm_forward(r.ctx, c, Tensor{}, h, lw.mlp_norm, cfg_.norm_eps);
  linear_forward(r.ctx, c, {{g, &pw.w_gate}, {z, &pw.w_up}});
  swiglu_forward(r.ctx, z, g, z);
  linear_forward(r.ctx, h, z, pw.w_down, 1.0f);
}

void CpuModel::mlp_cem(int l, Rows& r) {
  const LayerWeights& lw = w_.layers[l];
  const PackedLayer& pw = packed_[l];
  const int64_t N = r.N, D = cfg_.d_model, F = cfg_.d_ff;
  Tensor c = view(buf(kC, 0), N, D), g = view(buf(kG, 0), N, F);
  // The gate comes from the fixed sub-layer input, once; so does the first step's W_up·y (its y is
  // c): one product of c for both.
  rmsnorm_forward(r.ctx, c, Tensor{}, view(r.h, N, D), lw.mlp_norm, cfg_.norm_eps);
  linear_forward(r.ctx, c, {{g, &pw.w_gate}, {view(buf(kZ, 0), N, F), &pw.w_up}});
  silu_forward(r.ctx, g, g);
  for (int t = 0; t < r.Tmax; ++t) {
    int ns = 0;
    const int64_t n = r.active(r.all(), t, &ns);
    // x⁰ = h: the first step's y is the sub-layer's normalised input c.
    Tensor x = view(r.h, n, D), y = view(t == 0 ? c.data : buf(kY, 0), n, D),
           z = view(buf(kZ, 0), n, F), u = view(buf(kU, 0), n, D), pu = view(buf(kPU, 0), n, D);
    if (t > 0) {  // the first step's W_up·y is above
      rmsnorm_forward(r.ctx, y, Tensor{}, x, lw.mlp_norm, cfg_.norm_eps);
      linear_forward(r.ctx, z, y, pw.w_up);
    }
    mul_forward(r.ctx, z, z, view(g.data, n, F));
    linear_t_forward(r.ctx, u, z, pw.w_up_t);
    if (cfg_.mlp_precond_rank > 0) precond_forward(r.ctx, pu, u, pw.mlp_precond);
    axpy_rows_forward(r.ctx, x, cfg_.mlp_precond_rank > 0 ? pu : u, r.eta.data());
  }
}

namespace {

// Runs `f(model, batch, kv)` on the whole of `ids` in one block, every row's logits wanted.
template <typename F>
void on_full_sequence(const ModelConfig& c, const Weights& w, const std::vector<int>& ids, int T,
                      bool release_weights, F f) {
  const int n = int(ids.size());
  CpuModel model(c, w, /*batch_invariant=*/false, WeightDtype::kFp32, release_weights);
  KvPool kv(c, n, 1);
  const int32_t block = 0;
  Batch b;
  b.seqs.push_back(BatchSeq{ids.data(), n, 0, T, &block, 1, false, true});
  f(model, b, kv);
}

}  // namespace

std::vector<float> full_forward(const ModelConfig& c, const Weights& w, const std::vector<int>& ids,
                                int T, bool release_weights) {
  std::vector<float> logits;
  on_full_sequence(c, w, ids, T, release_weights,
                   [&](CpuModel& m, const Batch& b, KvPool& kv) { m.forward(b, kv, &logits); });
  return logits;
}

void full_forward(const ModelConfig& c, const Weights& w, const std::vector<int>& ids, int T,
                  bool release_weights, int64_t rows_per_call, const CpuModel::LogitsSink& sink) {
  on_full_sequence(c, w, ids, T, release_weights, [&](CpuModel& m, const Batch& b, KvPool& kv) {
    m.forward(b, kv, rows_per_call, sink);
  });
}

}  // namespace cemlm
