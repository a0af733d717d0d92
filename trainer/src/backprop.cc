// Training forward and backward (see backprop.h). The forward calls the engine's ops in the
// engine's order (engine/src/cpu_model.cc) on whole sequences, one KV block per sequence; the
// backward walks the same list in reverse, through every CEM recursion step.
// Saved: each sub-layer's input h; attention's rotated keys (standard: also the rotated queries,
// the values and the attention output); per CEM attention step, the step input x^t, the rotated
// query, R⁻¹a, the diagonal's context sums and u (with a preconditioner); the MLP gate's
// pre-activation (SwiGLU: also W_up c); per CEM MLP step, x^t, W_up y^t and u. Recomputed: every
// RMSNorm output and 1/rms, d ⊙ y, SiLU(gate), the attention probabilities, the LEV intermediates,
// and the logits (the head and the loss run on row chunks, so [M, V] is never held).
#include "cemlm/trainer/backprop.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <new>
#include <span>
#include <vector>

#include "cemlm/engine/cpu_model.h"
#include "cemlm/engine/cpu_threads.h"
#include "cemlm/engine/sampler.h"
#include "cemlm/kernels/attention.h"
#include "cemlm/kernels/attention_grad.h"
#include "cemlm/kernels/elementwise.h"
#include "cemlm/kernels/elementwise_grad.h"
#include "cemlm/kernels/lev.h"
#include "cemlm/kernels/lev_grad.h"
#include "cemlm/kernels/linear.h"
#include "cemlm/kernels/parallel.h"
#include "cemlm/kernels/precond.h"
#include "cemlm/kernels/precond_grad.h"
#include "cemlm/kernels/rmsnorm.h"
#include "cemlm/kernels/rope.h"

namespace cemlm {
namespace {

constexpr int64_t kHeadRows = 256;  // rows of logits held at once

// −log softmax(logits)[target]; with `grad`, also writes coef·(softmax − onehot) there (it may
// be `logits` itself).
double row_nll(const float* logits, int V, int target, float* grad, float coef) {
  const LogNormalizer norm = log_normalizer(std::span<const float>(logits, size_t(V)));
  const double nll = -norm.logprob(logits[target]);
  if (grad) {
    for (int v = 0; v < V; ++v) grad[v] = coef * std::exp(float(norm.logprob(logits[v])));
    grad[target] -= coef;
  }
  return nll;
}


// Working memory kept per thread between calls: a training loop faults in its activations once,
// not every step (fresh pages cost more than the memory traffic here). Buffers are bump-allocated
// from chunks; rewind() makes the next call reuse them. Contents are not cleared.
class Arena {
 public:
  void rewind() {
    cur_ = 0;
    used_ = 0;
    taken_ = 0;
  }
  int64_t taken() const { return taken_; }  // floats, since the last rewind
  int64_t held() const { return held_; }    // floats, in all chunks
  float* take(int64_t n) {
    n = (n + 15) / 16 * 16;  // 64-byte aligned offsets
    taken_ += n;
    while (cur_ < chunks_.size() && used_ + n > int64_t(chunks_[cur_].size())) {
      ++cur_;
      used_ = 0;
    }
    if (cur_ == chunks_.size()) {
      // A batch too large for the memory left is refused here, before its pages are touched: it
      // grew until the kernel's out-of-memory killer ended the run (or another process) minutes
      // later, each chunk's allocation succeeding.
      const int64_t floats = std::max(n, kChunk);
      if (!memory_left_for(floats * int64_t(sizeof(float)))) throw std::bad_alloc();
      chunks_.emplace_back(size_t(floats));
      held_ += floats;
    }
    float* p = chunks_[cur_].data() + used_;
    used_ += n;
    return p;
  }

 private:
  static constexpr int64_t kChunk = int64_t(1) << 22;  // floats (16 MiB)
  std::deque<std::vector<float>> chunks_;              // deque: chunks never move
  size_t cur_ = 0;
  int64_t used_ = 0, taken_ = 0, held_ = 0;
};

// What one sub-layer keeps for its backward (see the file comment); per-step lists for CEM.
struct Saved {
  std::vector<float*> x;   // step inputs x^0 … x^{T−1}; x[0] is the sub-layer input h
  std::vector<float*> q;   // rotated queries (standard: one)
  std::vector<float*> a;   // standard: attention output; CEM: R⁻¹a per step
  std::vector<float*> oc;  // CEM with a diagonal: context sums per step
  std::vector<float*> u;   // CEM with a preconditioner: u per step
  std::vector<float*> z;   // CEM MLP: W_up y per step
  float* k = nullptr;      // rotated keys
  float* v = nullptr;      // standard: values
  float* gate = nullptr;   // MLP: W_gate c
  float* up = nullptr;     // SwiGLU: W_up c
};

class Backprop {
 public:
  Backprop(const ModelConfig& c, const Weights& w, const Weights& g, const int* ids, int batch,
           int seq_len, int T, Arena& arena);
  double run(float loss_scale);

 private:
  float* take(int64_t n) { return arena_.take(n); }
  Tensor rows(float* p, int64_t width) const { return Tensor(p, {M_, width}); }
  KvLayerView kv(float* k, float* v, float* c) const {
    return KvLayerView{k, v, c, N_, H_, Q_, D_};
  }
  void copy_rows(float* dst, const float* src) const {
    std::memcpy(dst, src, sizeof(float) * M_ * D_);
  }
  // dpu_ = η · dx_, then du through the preconditioner when there is one; returns du.
  Tensor step_grad(const Tensor& p, const Tensor& Pu, const Tensor& Pv, const Tensor& gp,
                   const Tensor& gPu, const Tensor& gPv, int rank, float* u);
  // The next recursion state: x^{t+1} = x^t + η·(P(u) or u), into `next`.
  void step_update(float* next, const float* x, const Tensor& u, const Tensor& p, const Tensor& Pu,
                   const Tensor& Pv, int rank);
  void embed_forward();
  void embed_backward();
  void attn_standard_forward(int l);
  void attn_standard_backward(int l);
  void attn_cem_forward(int l);
  void attn_cem_backward(int l);
  void mlp_swiglu_forward(int l);
  void mlp_swiglu_backward(int l);
  void mlp_cem_forward(int l);
  void mlp_cem_backward(int l);
  double head_backward(float loss_scale);

  const ModelConfig& c_;
  const Weights& w_;
  const Weights& g_;
  const int B_, N_, T_, D_, Q_, F_, H_;
  const int64_t M_;
  const DiagKind diag_;
  const int64_t qdw_;  // width of d ⊙ y rows: D, or H·D per head
  const float eta_, scale_;
  std::vector<int32_t> ids_, pos_, blocks_, uniq_, slot_;  // slot_[i]: index of ids_[i] in uniq_
  std::vector<float> etas_, rope_;
  std::vector<AttnSeq> seqs_;
  Tensor rope_table_;
  ExecCtx ctx_;
  Arena& arena_;            // every buffer of M rows
  std::vector<float*> hs_;  // sub-layer inputs: hs_[2l] attention, hs_[2l+1] MLP, hs_[2L] final
  std::vector<Saved> attn_, mlp_;
  // Work buffers. Forward and backward uses of one buffer never overlap in time.
  float *c_buf_, *y_, *u_, *pu_, *dx_, *dy_, *dc_, *du_, *rstd_, *rstd_c_;
  float *qa_, *da_, *dk_, *dv_, *qd_, *dqd_, *doc_;
  float *f1_, *f2_, *f3_, *f4_;
};

Backprop::Backprop(const ModelConfig& c, const Weights& w, const Weights& g, const int* ids,
                   int batch, int seq_len, int T, Arena& arena)
    : c_(c),
      w_(w),
      g_(g),
      B_(batch),
      N_(seq_len),
      T_(T),
      D_(c.d_model),
      Q_(c.qk_dim()),
      F_(c.d_ff),
      H_(c.n_heads),
      M_(int64_t(batch) * seq_len),
      diag_(diag_kind(c)),
      qdw_(c.diag == DiagMode::kPerHead ? int64_t(c.n_heads) * c.d_model : c.d_model),
      eta_(c.step(T)),
      scale_(1.0f / std::sqrt(float(c.head_dim))),
      arena_(arena) {
  CEMLM_CHECK(batch >= 1 && seq_len >= 2 && seq_len <= c.max_seq_len && T >= 1);
  ids_.assign(ids, ids + M_);
  for (int64_t i = 0; i < M_; ++i) {
    CEMLM_CHECK(ids_[i] >= 0 && ids_[i] < c.vocab_size);
    pos_.push_back(int32_t(i % N_));
  }
  for (int b = 0; b < B_; ++b) blocks_.push_back(b);
  for (int b = 0; b < B_; ++b) seqs_.push_back(AttnSeq{b * N_, N_, 0, &blocks_[b]});
  etas_.assign(M_, eta_);
  rope_.resize(size_t(N_) * c.head_dim);
  rope_table_ = Tensor(rope_.data(), {N_, c.head_dim});
  rope_table_init(rope_table_, c.rope_theta);
  if (c.embedding == EmbeddingType::kLev) {
    uniq_ = ids_;
    std::sort(uniq_.begin(), uniq_.end());
    uniq_.erase(std::unique(uniq_.begin(), uniq_.end()), uniq_.end());
    for (int32_t id : ids_)
      slot_.push_back(int32_t(std::lower_bound(uniq_.begin(), uniq_.end(), id) - uniq_.begin()));
  }
  for (int i = 0; i <= 2 * c.n_layers; ++i) hs_.push_back(take(M_ * D_));
  const bool standard = c.attention == AttentionType::kStandard;
  // Only the view's shape (which pools exist) matters for the forward attention's scratch size.
  const KvLayerView shape =
      kv(hs_[0], standard ? hs_[0] : nullptr, diag_ != DiagKind::kNone ? hs_[0] : nullptr);
  const int rank = std::max({c.attn_precond_rank, c.mlp_precond_rank, 1});
  const int64_t scratch = std::max({paged_attention_scratch_floats(seqs_.data(), B_, shape, diag_),
                                    int64_t(4) * M_ * rank, attention_backward_scratch(diag_, N_),
                                    int64_t(uniq_.size()) * c.lev.heads * c.lev.rank});
  ctx_.scratch = take(scratch);
  ctx_.scratch_floats = scratch;
  attn_.resize(c.n_layers);
  mlp_.resize(c.n_layers);
  for (float** p : {&c_buf_, &y_, &u_, &pu_, &dx_, &dy_, &dc_, &du_}) *p = take(M_ * D_);
  rstd_ = take(M_);
  rstd_c_ = take(M_);
  for (float** p : {&qa_, &da_, &dk_}) *p = take(M_ * Q_);
  dv_ = c.attention == AttentionType::kStandard ? take(M_ * Q_) : nullptr;
  for (float** p : {&qd_, &dqd_, &doc_}) *p = diag_ == DiagKind::kNone ? nullptr : take(M_ * qdw_);
  for (float** p : {&f1_, &f2_, &f3_, &f4_}) *p = take(M_ * F_);
}

double Backprop::run(float loss_scale) {
  embed_forward();
  for (int l = 0; l < c_.n_layers; ++l) {
    if (c_.attention == AttentionType::kCem)
      attn_cem_forward(l);
    else
      attn_standard_forward(l);
    if (c_.mlp == MlpType::kCem)
      mlp_cem_forward(l);
    else
      mlp_swiglu_forward(l);
  }
  const double loss = head_backward(loss_scale);
  for (int l = c_.n_layers - 1; l >= 0; --l) {
    if (c_.mlp == MlpType::kCem)
      mlp_cem_backward(l);
    else
      mlp_swiglu_backward(l);
    if (c_.attention == AttentionType::kCem)
      attn_cem_backward(l);
    else
      attn_standard_backward(l);
  }
  embed_backward();
  return loss;
}

void Backprop::embed_forward() {
  float* h0 = hs_[0];
  if (c_.embedding == EmbeddingType::kTable) {
    for (int64_t i = 0; i < M_; ++i)
      std::memcpy(h0 + i * D_, w_.embed.data + int64_t(ids_[i]) * D_, sizeof(float) * D_);
    return;
  }
  const int64_t U = int64_t(uniq_.size());
  float* table = take(U * D_);  // Embed depends on the id only: once per distinct id
  lev_forward(ctx_, Tensor(table, {U, D_}), uniq_.data(), lev_weights(w_));
  for (int64_t i = 0; i < M_; ++i)
    std::memcpy(h0 + i * D_, table + int64_t(slot_[i]) * D_, sizeof(float) * D_);
}

void Backprop::embed_backward() {
  if (c_.embedding == EmbeddingType::kTable) {
    for (int64_t i = 0; i < M_; ++i) {
      float* dst = g_.embed.data + int64_t(ids_[i]) * D_;
      for (int e = 0; e < D_; ++e) dst[e] += dx_[i * D_ + e];
    }
    return;
  }
  const int64_t U = int64_t(uniq_.size());
  float* dtable = take(U * D_);
  std::fill(dtable, dtable + U * D_, 0.0f);
  for (int64_t i = 0; i < M_; ++i) {
    float* dst = dtable + int64_t(slot_[i]) * D_;
    for (int e = 0; e < D_; ++e) dst[e] += dx_[i * D_ + e];
  }
  lev_backward(ctx_, lev_weights(g_), Tensor(dtable, {U, D_}), uniq_.data(), lev_weights(w_));
}

Tensor Backprop::step_grad(const Tensor& p, const Tensor& Pu, const Tensor& Pv, const Tensor& gp,
                           const Tensor& gPu, const Tensor& gPv, int rank, float* u) {
  const int64_t n = M_ * D_;
  parallel_for(n, n > 65536, [&](int64_t i) { pu_[i] = eta_ * dx_[i]; });
  if (rank == 0) return rows(pu_, D_);
  precond_backward(ctx_, rows(du_, D_), gp, gPu, gPv, rows(pu_, D_), rows(u, D_), p, Pu, Pv);
  return rows(du_, D_);
}

void Backprop::step_update(float* next, const float* x, const Tensor& u, const Tensor& p,
                           const Tensor& Pu, const Tensor& Pv, int rank) {
  if (rank > 0) precond_forward(ctx_, rows(pu_, D_), u, p, Pu, Pv);
  copy_rows(next, x);
  axpy_rows_forward(ctx_, rows(next, D_), rank > 0 ? rows(pu_, D_) : u, etas_.data());
}

void Backprop::attn_standard_forward(int l) {
  const LayerWeights& lw = w_.layers[l];
  Saved& s = attn_[l];
  float* h = hs_[2 * l];
  const Tensor c = rows(c_buf_, D_);
  rmsnorm_forward(ctx_, c, Tensor{}, rows(h, D_), lw.attn_norm, c_.norm_eps);
  s.q = {take(M_ * Q_)};
  s.a = {take(M_ * Q_)};
  s.k = take(M_ * Q_);
  s.v = take(M_ * Q_);
  const Tensor q = rows(s.q[0], Q_), k = rows(s.k, Q_), a = rows(s.a[0], Q_);
  linear_forward(ctx_, q, c, lw.wq);
  linear_forward(ctx_, k, c, lw.wk);
  linear_forward(ctx_, rows(s.v, Q_), c, lw.wv);
  rope_forward(ctx_, q, q, pos_.data(), rope_table_, false);
  rope_forward(ctx_, k, k, pos_.data(), rope_table_, false);
  paged_attention_forward(ctx_, a, Tensor{}, q, Tensor{}, DiagKind::kNone, kv(s.k, s.v, nullptr),
                          seqs_.data(), B_, scale_);
  copy_rows(hs_[2 * l + 1], h);
  linear_forward(ctx_, rows(hs_[2 * l + 1], D_), a, lw.wo, 1.0f);
}

void Backprop::attn_standard_backward(int l) {
  const LayerWeights& lw = w_.layers[l];
  const LayerWeights& lg = g_.layers[l];
  const Saved& s = attn_[l];
  const Tensor dx = rows(dx_, D_), c = rows(c_buf_, D_), dc = rows(dc_, D_), dq = rows(qa_, Q_),
               dk = rows(dk_, Q_), dv = rows(dv_, Q_), da = rows(da_, Q_);
  linear_backward(ctx_, da, lg.wo, dx, rows(s.a[0], Q_), lw.wo);
  std::fill(dk_, dk_ + M_ * Q_, 0.0f);
  std::fill(dv_, dv_ + M_ * Q_, 0.0f);
  attention_backward(
      ctx_, AttnTensors{dq, Tensor{}, dk, dv, Tensor{}}, da, Tensor{},
      AttnTensors{rows(s.q[0], Q_), Tensor{}, rows(s.k, Q_), rows(s.v, Q_), Tensor{}},
      DiagKind::kNone, H_, N_, scale_);
  rope_forward(ctx_, dq, dq, pos_.data(), rope_table_, true);  // R_pᵀ = R_{−p}
  rope_forward(ctx_, dk, dk, pos_.data(), rope_table_, true);
  const Tensor h = rows(hs_[2 * l], D_), rstd(rstd_c_, {M_});
  rmsnorm_forward(ctx_, c, rstd, h, lw.attn_norm, c_.norm_eps);
  linear_backward(ctx_, dc, lg.wq, dq, c, lw.wq);
  linear_backward(ctx_, dc, lg.wk, dk, c, lw.wk, true);
  linear_backward(ctx_, dc, lg.wv, dv, c, lw.wv, true);
  rmsnorm_backward(ctx_, dx, lg.attn_norm, dc, h, lw.attn_norm, rstd, true);
}

void Backprop::attn_cem_forward(int l) {
  const LayerWeights& lw = w_.layers[l];
  Saved& s = attn_[l];
  const bool diag = diag_ != DiagKind::kNone;
  const int rank = c_.attn_precond_rank;
  const Tensor c = rows(c_buf_, D_), y = rows(y_, D_), a = rows(qa_, Q_);
  const Tensor qd = diag ? rows(qd_, qdw_) : Tensor{};
  s.x = {hs_[2 * l]};
  rmsnorm_forward(ctx_, c, Tensor{}, rows(s.x[0], D_), lw.attn_norm, c_.norm_eps);
  s.k = take(M_ * Q_);
  const Tensor k = rows(s.k, Q_);
  linear_forward(ctx_, k, c, lw.wk);
  rope_forward(ctx_, k, k, pos_.data(), rope_table_, false);
  const KvLayerView view = kv(s.k, nullptr, diag ? c_buf_ : nullptr);
  for (int t = 0; t < T_; ++t) {
    const Tensor x = rows(s.x[t], D_);
    s.q.push_back(take(M_ * Q_));
    s.a.push_back(take(M_ * Q_));
    if (diag) s.oc.push_back(take(M_ * qdw_));
    if (rank > 0) s.u.push_back(take(M_ * D_));
    const Tensor q = rows(s.q[t], Q_), ar = rows(s.a[t], Q_);
    const Tensor oc = diag ? rows(s.oc[t], qdw_) : Tensor{};
    const Tensor u = rows(rank > 0 ? s.u[t] : u_, D_);
    rmsnorm_forward(ctx_, y, Tensor{}, x, lw.attn_norm, c_.norm_eps);
    linear_forward(ctx_, q, y, lw.wq);
    rope_forward(ctx_, q, q, pos_.data(), rope_table_, false);
    if (diag) diag_scale_forward(ctx_, qd, y, lw.diag);
    paged_attention_forward(ctx_, a, oc, q, qd, diag_, view, seqs_.data(), B_, scale_);
    rope_forward(ctx_, ar, a, pos_.data(), rope_table_, true);
    linear_t_forward(ctx_, u, ar, lw.wq);
    if (diag) diag_gather_forward(ctx_, u, oc, lw.diag);
    float* next = t + 1 < T_ ? take(M_ * D_) : hs_[2 * l + 1];
    if (t + 1 < T_) s.x.push_back(next);
    step_update(next, x.data, u, lw.attn_p, lw.attn_u, lw.attn_v, rank);
  }
}

void Backprop::attn_cem_backward(int l) {
  const LayerWeights& lw = w_.layers[l];
  const LayerWeights& lg = g_.layers[l];
  const Saved& s = attn_[l];
  const bool diag = diag_ != DiagKind::kNone;
  const int rank = c_.attn_precond_rank;
  const Tensor dx = rows(dx_, D_), c = rows(c_buf_, D_), y = rows(y_, D_), dy = rows(dy_, D_),
               dc = rows(dc_, D_), dq = rows(qa_, Q_), da = rows(da_, Q_), dk = rows(dk_, Q_),
               rstd(rstd_, {M_}), rstd_c(rstd_c_, {M_});
  const Tensor qd = diag ? rows(qd_, qdw_) : Tensor{}, dqd = diag ? rows(dqd_, qdw_) : Tensor{},
               doc = diag ? rows(doc_, qdw_) : Tensor{};
  const Tensor h = rows(s.x[0], D_);
  rmsnorm_forward(ctx_, c, rstd_c, h, lw.attn_norm, c_.norm_eps);
  std::fill(dk_, dk_ + M_ * Q_, 0.0f);
  std::fill(dc_, dc_ + M_ * D_, 0.0f);
  for (int t = T_ - 1; t >= 0; --t) {
    const Tensor x = rows(s.x[t], D_);
    const Tensor du = step_grad(lw.attn_p, lw.attn_u, lw.attn_v, lg.attn_p, lg.attn_u, lg.attn_v,
                                rank, rank > 0 ? s.u[t] : nullptr);
    if (diag) diag_gather_backward(ctx_, doc, lg.diag, du, rows(s.oc[t], qdw_), lw.diag);
    linear_t_backward(ctx_, da, lg.wq, du, rows(s.a[t], Q_), lw.wq);
    rope_forward(ctx_, da, da, pos_.data(), rope_table_, false);  // (R⁻¹)ᵀ = R
    rmsnorm_forward(ctx_, y, rstd, x, lw.attn_norm, c_.norm_eps);
    if (diag) diag_scale_forward(ctx_, qd, y, lw.diag);
    attention_backward(
        ctx_, AttnTensors{dq, dqd, dk, Tensor{}, diag ? dc : Tensor{}}, da, doc,
        AttnTensors{rows(s.q[t], Q_), qd, rows(s.k, Q_), Tensor{}, diag ? c : Tensor{}}, diag_, H_,
        N_, scale_);
    rope_forward(ctx_, dq, dq, pos_.data(), rope_table_, true);
    linear_backward(ctx_, dy, lg.wq, dq, y, lw.wq);
    if (diag) diag_scale_backward(ctx_, dy, lg.diag, dqd, y, lw.diag);
    rmsnorm_backward(ctx_, dx, lg.attn_norm, dy, x, lw.attn_norm, rstd, true);
  }
  // Keys and contexts were fixed for the sub-layer: their gradient summed over every step.
  rope_forward(ctx_, dk, dk, pos_.data(), rope_table_, true);
  linear_backward(ctx_, dc, lg.wk, dk, c, lw.wk, true);
  rmsnorm_backward(ctx_, dx, lg.attn_norm, dc, h, lw.attn_norm, rstd_c, true);
}

void Backprop::mlp_swiglu_forward(int l) {
  const LayerWeights& lw = w_.layers[l];
  Saved& s = mlp_[l];
  float* h = hs_[2 * l + 1];
  const Tensor c = rows(c_buf_, D_), act = rows(f1_, F_);
  rmsnorm_forward(ctx_, c, Tensor{}, rows(h, D_), lw.mlp_norm, c_.norm_eps);
  s.gate = take(M_ * F_);
  s.up = take(M_ * F_);
  linear_forward(ctx_, rows(s.gate, F_), c, lw.w_gate);
  linear_forward(ctx_, rows(s.up, F_), c, lw.w_up);
  swiglu_forward(ctx_, act, rows(s.gate, F_), rows(s.up, F_));
  copy_rows(hs_[2 * l + 2], h);
  linear_forward(ctx_, rows(hs_[2 * l + 2], D_), act, lw.w_down, 1.0f);
}

void Backprop::mlp_swiglu_backward(int l) {
  const LayerWeights& lw = w_.layers[l];
  const LayerWeights& lg = g_.layers[l];
  const Saved& s = mlp_[l];
  const Tensor dx = rows(dx_, D_), c = rows(c_buf_, D_), dc = rows(dc_, D_), act = rows(f1_, F_),
               dact = rows(f2_, F_), dgate = rows(f3_, F_), dup = rows(f4_, F_),
               gate = rows(s.gate, F_), up = rows(s.up, F_), h = rows(hs_[2 * l + 1], D_),
               rstd_c(rstd_c_, {M_});
  swiglu_forward(ctx_, act, gate, up);
  linear_backward(ctx_, dact, lg.w_down, dx, act, lw.w_down);
  swiglu_backward(ctx_, dgate, dup, dact, gate, up);
  rmsnorm_forward(ctx_, c, rstd_c, h, lw.mlp_norm, c_.norm_eps);
  linear_backward(ctx_, dc, lg.w_gate, dgate, c, lw.w_gate);
  linear_backward(ctx_, dc, lg.w_up, dup, c, lw.w_up, true);
  rmsnorm_backward(ctx_, dx, lg.mlp_norm, dc, h, lw.mlp_norm, rstd_c, true);
}

void Backprop::mlp_cem_forward(int l) {
  const LayerWeights& lw = w_.layers[l];
  Saved& s = mlp_[l];
  const int rank = c_.mlp_precond_rank;
  const Tensor c = rows(c_buf_, D_), y = rows(y_, D_), g = rows(f1_, F_), m = rows(f2_, F_);
  s.x = {hs_[2 * l + 1]};
  rmsnorm_forward(ctx_, c, Tensor{}, rows(s.x[0], D_), lw.mlp_norm, c_.norm_eps);
  s.gate = take(M_ * F_);
  linear_forward(ctx_, rows(s.gate, F_), c, lw.w_gate);
  silu_forward(ctx_, g, rows(s.gate, F_));
  for (int t = 0; t < T_; ++t) {
    const Tensor x = rows(s.x[t], D_);
    s.z.push_back(take(M_ * F_));
    if (rank > 0) s.u.push_back(take(M_ * D_));
    const Tensor z = rows(s.z[t], F_), u = rows(rank > 0 ? s.u[t] : u_, D_);
    rmsnorm_forward(ctx_, y, Tensor{}, x, lw.mlp_norm, c_.norm_eps);
    linear_forward(ctx_, z, y, lw.w_up);
    mul_forward(ctx_, m, z, g);
    linear_t_forward(ctx_, u, m, lw.w_up);
    float* next = t + 1 < T_ ? take(M_ * D_) : hs_[2 * l + 2];
    if (t + 1 < T_) s.x.push_back(next);
    step_update(next, x.data, u, lw.mlp_p, lw.mlp_u, lw.mlp_v, rank);
  }
}

void Backprop::mlp_cem_backward(int l) {
  const LayerWeights& lw = w_.layers[l];
  const LayerWeights& lg = g_.layers[l];
  const Saved& s = mlp_[l];
  const int rank = c_.mlp_precond_rank;
  const Tensor dx = rows(dx_, D_), c = rows(c_buf_, D_), y = rows(y_, D_), dy = rows(dy_, D_),
               dc = rows(dc_, D_), g = rows(f1_, F_), m = rows(f2_, F_), dm = rows(f3_, F_),
               dg = rows(f4_, F_), gate = rows(s.gate, F_), h = rows(s.x[0], D_), rstd(rstd_, {M_}),
               rstd_c(rstd_c_, {M_});
  silu_forward(ctx_, g, gate);
  std::fill(f4_, f4_ + M_ * F_, 0.0f);
  for (int t = T_ - 1; t >= 0; --t) {
    const Tensor x = rows(s.x[t], D_), z = rows(s.z[t], F_);
    const Tensor du = step_grad(lw.mlp_p, lw.mlp_u, lw.mlp_v, lg.mlp_p, lg.mlp_u, lg.mlp_v, rank,
                                rank > 0 ? s.u[t] : nullptr);
    rmsnorm_forward(ctx_, y, rstd, x, lw.mlp_norm, c_.norm_eps);
    mul_forward(ctx_, m, z, g);
    linear_t_backward(ctx_, dm, lg.w_up, du, m, lw.w_up);  // W_up used transposed ...
    mul_backward(ctx_, dg, dm, z);                         // the gate is shared by every step
    mul_forward(ctx_, dm, dm, g);
    linear_backward(ctx_, dy, lg.w_up, dm, y, lw.w_up);  // ... and forward
    rmsnorm_backward(ctx_, dx, lg.mlp_norm, dy, x, lw.mlp_norm, rstd, true);
  }
  silu_backward(ctx_, dg, dg, gate);
  rmsnorm_forward(ctx_, c, rstd_c, h, lw.mlp_norm, c_.norm_eps);
  linear_backward(ctx_, dc, lg.w_gate, dg, c, lw.w_gate);
  rmsnorm_backward(ctx_, dx, lg.mlp_norm, dc, h, lw.mlp_norm, rstd_c, true);
}

double Backprop::head_backward(float loss_scale) {
  const int V = c_.vocab_size;
  const int64_t R = std::min(kHeadRows, M_);
  const double n_scored = double(B_) * (N_ - 1);
  const float coef = float(loss_scale / n_scored);
  float *fin = take(R * D_), *dfin = take(R * D_), *logits = take(R * V), *rstd = take(R);
  std::vector<double> nll(size_t(M_), 0.0);  // summed in row order: the loss is deterministic
  float* hL = hs_[2 * c_.n_layers];
  for (int64_t r0 = 0; r0 < M_; r0 += R) {
    const int64_t n = std::min(R, M_ - r0);
    const Tensor x(hL + r0 * D_, {n, D_}), f(fin, {n, D_}), df(dfin, {n, D_}), lo(logits, {n, V}),
        rs(rstd, {n});
    rmsnorm_forward(ctx_, f, rs, x, w_.final_norm, c_.norm_eps);
    linear_forward(ctx_, lo, f, w_.lm_head);
    parallel_for(n, true, [&](int64_t i) {
      const int64_t row = r0 + i;
      float* li = logits + i * V;
      if (pos_[row] == N_ - 1)  // the last position predicts nothing
        std::fill(li, li + V, 0.0f);
      else
        nll[row] = row_nll(li, V, ids_[row + 1], li, coef);
    });
    linear_backward(ctx_, df, g_.lm_head, lo, f, w_.lm_head);
    rmsnorm_backward(ctx_, Tensor(dx_ + r0 * D_, {n, D_}), g_.final_norm, df, x, w_.final_norm, rs);
  }
  double total = 0;
  for (double v : nll) total += v;
  return total / n_scored;
}

}  // namespace

namespace {
thread_local Arena arena;  // forward_backward's working memory on this thread
}  // namespace

double forward_backward(const ModelConfig& c, const Weights& w, const Weights& grads,
                        const int* ids, int batch, int seq_len, int T, float loss_scale) {
  // Refused before any of it is taken, as the arena refuses its chunks: what the arena holds from
  // earlier calls is in use already, not needed again.
  if (!memory_left_for(forward_backward_min_bytes(c, batch, seq_len, T) -
                       arena.held() * int64_t(sizeof(float))))
    throw std::bad_alloc();
  arena.rewind();
  Backprop bp(c, w, grads, ids, batch, seq_len, T, arena);
  return bp.run(loss_scale);
}

int64_t forward_backward_min_bytes(const ModelConfig& c, int batch, int seq_len, int T) {
  const int64_t D = c.d_model, Q = c.qk_dim(), F = c.d_ff, L = c.n_layers;
  const bool standard = c.attention == AttentionType::kStandard;
  const int64_t qdw = diag_kind(c) == DiagKind::kNone ? 0
                      : c.diag == DiagMode::kPerHead  ? int64_t(c.n_heads) * D
                                                      : D;
  // Backprop's constructor: the sub-layer inputs, the buffers of a sub-layer, 1/rms twice.
  int64_t floats = (2 * L + 1) * D + 8 * D + 2 + 3 * Q + (standard ? Q : 0) + 3 * qdw + 4 * F;
  // Per layer, what the forward keeps for the backward (the file comment's list).
  floats +=
      L *
      (standard ? 4 * Q : Q + T * (2 * Q + qdw + (c.attn_precond_rank > 0 ? D : 0)) + (T - 1) * D);
  floats +=
      L * (c.mlp == MlpType::kCem ? F + T * (F + (c.mlp_precond_rank > 0 ? D : 0)) + (T - 1) * D
                                  : 2 * F);
  // Each row's id, position, step size and LEV slot; past int64 (no machine's), its largest.
  int64_t bytes = 0;
  if (__builtin_mul_overflow(int64_t(batch) * seq_len, floats * int64_t(sizeof(float)) + 16,
                             &bytes))
    return INT64_MAX;
  return bytes;
}

int64_t last_forward_backward_floats() { return arena.taken(); }
int64_t forward_backward_held_bytes() { return arena.held() * int64_t(sizeof(float)); }

double forward_loss(const ModelConfig& c, const Weights& w, const int* ids, int batch, int seq_len,
                    int T) {
  CEMLM_CHECK(batch >= 1 && seq_len >= 2 && T >= 1);
  CpuModel model(c, w);
  KvPool kv(c, seq_len, 1);
  const int32_t block = 0;
  std::vector<float> logits;
  double total = 0;
  for (int b = 0; b < batch; ++b) {
    const int* row = ids + int64_t(b) * seq_len;
    Batch one;
    one.seqs.push_back(BatchSeq{row, seq_len, 0, T, &block, 1, false, true});
    model.forward(one, kv, &logits);
    for (int i = 0; i + 1 < seq_len; ++i)
      total +=
          row_nll(logits.data() + int64_t(i) * c.vocab_size, c.vocab_size, row[i + 1], nullptr, 0);
  }
  return total / (double(batch) * (seq_len - 1));
}

}  // namespace cemlm
