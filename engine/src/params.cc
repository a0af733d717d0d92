// Parameter layout, flat parameter store, random init and parameter counting.
#include "cemlm/engine/params.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace cemlm {

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

namespace {

void add(std::vector<ParamSpec>& v, std::string name, std::vector<int64_t> shape, InitKind init,
         float std = 0.02f, bool decay = false) {
  v.push_back(ParamSpec{std::move(name), std::move(shape), init, std, decay, 0});
}

void add_precond(std::vector<ParamSpec>& v, const std::string& prefix, int64_t D, int64_t r) {
  if (r == 0) return;
  add(v, prefix + ".precond.p", {D}, InitKind::kSoftplusOne);
  add(v, prefix + ".precond.u", {D, r}, InitKind::kNormal, 0.02f, true);
  add(v, prefix + ".precond.v", {D, r}, InitKind::kZeros, 0.0f, true);
}

}  // namespace

std::vector<ParamSpec> param_layout(const ModelConfig& c) {
  std::vector<ParamSpec> v;
  const int64_t V = c.vocab_size, D = c.d_model, Q = c.qk_dim(), F = c.d_ff;
  if (c.embedding == EmbeddingType::kTable) {
    add(v, "embed.weight", {V, D}, InitKind::kNormal, 0.02f, true);
  } else {
    const LevConfig& l = c.lev;
    add(v, "lev.codebooks", {l.digits, l.base, l.seed_dim}, InitKind::kNormal, 0.02f, true);
    add(v, "lev.seed_proj", {l.heads, l.seed_dim, l.seed_dim}, InitKind::kNormal, 0.02f, true);
    add(v, "lev.ln_weight", {l.heads, l.seed_dim}, InitKind::kOnes);
    add(v, "lev.ln_bias", {l.heads, l.seed_dim}, InitKind::kZeros);
    add(v, "lev.spline", {l.heads, l.seed_dim, l.knots, l.rank}, InitKind::kOnePlusNormal, 0.1f);
    // W_out ~ N(0, 1/(n_h·r)), not MODEL.md's recommended N(0, (0.02/√n_h)²): with the products
    // M ≈ 1 at init this gives the embedding about unit RMS, and the recommended scale trains
    // markedly worse (docs/TRAINING.md, "LEV init"). Init is the trainer's choice, not the model's.
    add(v, "lev.out_proj", {l.heads, l.rank, D}, InitKind::kNormal,
        1.0f / std::sqrt(float(l.heads * l.rank)), true);
  }
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = absl::StrCat("layers.", l);
    add(v, p + ".attn_norm.weight", {D}, InitKind::kOnes);
    add(v, p + ".attn.wq", {Q, D}, InitKind::kNormal, 0.02f, true);
    add(v, p + ".attn.wk", {Q, D}, InitKind::kNormal, 0.02f, true);
    if (c.attention == AttentionType::kStandard) {
      add(v, p + ".attn.wv", {Q, D}, InitKind::kNormal, 0.02f, true);
      add(v, p + ".attn.wo", {D, Q}, InitKind::kNormal, 0.02f, true);
    } else {
      if (c.diag == DiagMode::kShared) add(v, p + ".attn.diag", {D}, InitKind::kZeros);
      if (c.diag == DiagMode::kPerHead) add(v, p + ".attn.diag", {c.n_heads, D}, InitKind::kZeros);
      add_precond(v, p + ".attn", D, c.attn_precond_rank);
    }
    add(v, p + ".mlp_norm.weight", {D}, InitKind::kOnes);
    add(v, p + ".mlp.w_gate", {F, D}, InitKind::kNormal, 0.02f, true);
    add(v, p + ".mlp.w_up", {F, D}, InitKind::kNormal, 0.02f, true);
    if (c.mlp == MlpType::kSwiglu) {
      add(v, p + ".mlp.w_down", {D, F}, InitKind::kNormal, 0.02f, true);
    } else {
      add_precond(v, p + ".mlp", D, c.mlp_precond_rank);
    }
  }
  add(v, "final_norm.weight", {D}, InitKind::kOnes);
  if (!c.tie_output) add(v, "lm_head.weight", {V, D}, InitKind::kNormal, 0.02f, true);
  int64_t off = 0;
  for (auto& s : v) {
    s.offset = off;
    off += s.numel();
  }
  return v;
}

ParamStore::ParamStore(const ModelConfig& c) : specs_(param_layout(c)) {
  for (size_t i = 0; i < specs_.size(); ++i) index_[specs_[i].name] = i;
  data_.assign(specs_.empty() ? 0 : specs_.back().offset + specs_.back().numel(), 0.0f);
}

const ParamSpec* ParamStore::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &specs_[it->second];
}

Tensor ParamStore::get(const ParamSpec& s) {
  Tensor t;
  t.data = data_.data() + s.offset;
  for (int64_t d : s.shape) t.shape[t.ndim++] = d;
  return t;
}

Tensor ParamStore::get(const std::string& name) {
  const ParamSpec* s = find(name);
  return s ? get(*s) : Tensor{};
}

void ParamStore::init_random(uint64_t seed) {
  Rng rng(seed);
  const float softplus_one = std::log(std::exp(1.0f) - 1.0f);
  for (const auto& s : specs_) {
    float* p = data_.data() + s.offset;
    for (int64_t i = 0; i < s.numel(); ++i) {
      switch (s.init) {
        case InitKind::kNormal: p[i] = float(rng.normal() * s.std); break;
        case InitKind::kOnes: p[i] = 1.0f; break;
        case InitKind::kZeros: p[i] = 0.0f; break;
        case InitKind::kSoftplusOne: p[i] = softplus_one; break;
        case InitKind::kOnePlusNormal: p[i] = 1.0f + float(rng.normal() * s.std); break;
      }
    }
  }
}

Weights bind_weights(const ModelConfig& c, ParamStore& s) {
  Weights w;
  w.embed = s.get("embed.weight");
  w.lev_codebooks = s.get("lev.codebooks");
  w.lev_seed_proj = s.get("lev.seed_proj");
  w.lev_ln_weight = s.get("lev.ln_weight");
  w.lev_ln_bias = s.get("lev.ln_bias");
  w.lev_spline = s.get("lev.spline");
  w.lev_out_proj = s.get("lev.out_proj");
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = absl::StrCat("layers.", l);
    LayerWeights lw;
    lw.attn_norm = s.get(p + ".attn_norm.weight");
    lw.wq = s.get(p + ".attn.wq");
    lw.wk = s.get(p + ".attn.wk");
    lw.wv = s.get(p + ".attn.wv");
    lw.wo = s.get(p + ".attn.wo");
    lw.diag = s.get(p + ".attn.diag");
    lw.attn_p = s.get(p + ".attn.precond.p");
    lw.attn_u = s.get(p + ".attn.precond.u");
    lw.attn_v = s.get(p + ".attn.precond.v");
    lw.mlp_norm = s.get(p + ".mlp_norm.weight");
    lw.w_gate = s.get(p + ".mlp.w_gate");
    lw.w_up = s.get(p + ".mlp.w_up");
    lw.w_down = s.get(p + ".mlp.w_down");
    lw.mlp_p = s.get(p + ".mlp.precond.p");
    lw.mlp_u = s.get(p + ".mlp.precond.u");
    lw.mlp_v = s.get(p + ".mlp.precond.v");
    w.layers.push_back(lw);
  }
  w.final_norm = s.get("final_norm.weight");
  w.lm_head = c.tie_output ? w.embed : s.get("lm_head.weight");
  return w;
}

ParamCounts count_params(const ModelConfig& c) {
  ParamCounts pc;
  for (const auto& s : param_layout(c)) {
    const int64_t n = s.numel();
    pc.total += n;
    if (s.name.rfind("embed.", 0) == 0 || s.name.rfind("lev.", 0) == 0) {
      pc.embedding += n;
    } else if (s.name.rfind("lm_head.", 0) == 0) {
      pc.head += n;
    } else if (s.name.find("_norm.") != std::string::npos) {
      pc.norms += n;
    } else if (s.name.find(".attn.") != std::string::npos) {
      pc.attention += n;
    } else if (s.name.find(".mlp.") != std::string::npos) {
      pc.mlp += n;
    }
  }
  pc.per_layer = (pc.total - pc.embedding - pc.head - c.d_model) / c.n_layers;
  return pc;
}

ModelConfig baseline_of(const ModelConfig& c) {
  ModelConfig b = c;
  b.embedding = EmbeddingType::kTable;
  b.tie_output = false;
  b.attention = AttentionType::kStandard;
  b.diag = DiagMode::kNone;
  b.attn_precond_rank = 0;
  b.mlp = MlpType::kSwiglu;
  b.mlp_precond_rank = 0;
  return b;
}

uint64_t Rng::next_u64() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

double Rng::uniform() { return double(next_u64() >> 11) * (1.0 / 9007199254740992.0); }

double Rng::normal() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  double u1 = uniform(), u2 = uniform();
  if (u1 < 1e-300) u1 = 1e-300;
  const double r = std::sqrt(-2.0 * std::log(u1)), a = 2.0 * M_PI * u2;
  spare_ = r * std::sin(a);
  has_spare_ = true;
  return r * std::cos(a);
}

}  // namespace cemlm
