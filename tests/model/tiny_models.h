// Tiny model configurations covering every variant of MODEL.md, with random weights that
// exercise every term (non-unit gains, non-zero diagonals and P_v), for the model tests; and
// weights that overflow the backward, for the checks that refuse non-finite gradients.
#pragma once
#include <ostream>
#include <string>
#include <vector>

#include "cemlm/engine/config.h"
#include "cemlm/engine/params.h"

namespace cemlm::testing_models {

struct Variant {
  std::string name;
  EmbeddingType emb;
  bool tied;
  AttentionType attn;
  DiagMode diag;
  int attn_rank;
  MlpType mlp;
  int mlp_rank;
  StepSize step = StepSize::kInverseT;
};
// How gtest prints a variant parameter (else the struct's raw bytes, a heap pointer among them).
inline void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

inline std::vector<Variant> all_variants() {
  using A = AttentionType;
  using M = MlpType;
  return {
      {"llama_tied", EmbeddingType::kTable, true, A::kStandard, DiagMode::kNone, 0, M::kSwiglu, 0},
      {"llama_lev", EmbeddingType::kLev, false, A::kStandard, DiagMode::kNone, 0, M::kSwiglu, 0},
      {"cem_none", EmbeddingType::kTable, false, A::kCem, DiagMode::kNone, 0, M::kSwiglu, 0},
      {"cem_shared_p", EmbeddingType::kTable, false, A::kCem, DiagMode::kShared, 3, M::kSwiglu, 0},
      {"cem_perhead", EmbeddingType::kTable, false, A::kCem, DiagMode::kPerHead, 0, M::kCem, 0},
      {"full_cem_lev", EmbeddingType::kLev, false, A::kCem, DiagMode::kShared, 2, M::kCem, 2},
      {"full_cem_unit", EmbeddingType::kTable, false, A::kCem, DiagMode::kPerHead, 2, M::kCem, 2,
       StepSize::kUnit},
  };
}

inline ModelConfig make_config(const Variant& v, int vocab = 61) {
  ModelConfig c;
  c.vocab_size = vocab;
  c.d_model = 16;
  c.n_layers = 2;
  c.n_heads = 2;
  c.head_dim = 6;
  c.d_ff = 24;
  c.max_seq_len = 64;
  c.embedding = v.emb;
  c.tie_output = v.tied;
  if (v.emb == EmbeddingType::kLev) c.lev = LevConfig{2, 5, 4, 3, 2, 8};
  c.attention = v.attn;
  c.diag = v.diag;
  c.attn_precond_rank = v.attn_rank;
  c.mlp = v.mlp;
  c.mlp_precond_rank = v.mlp_rank;
  c.step_size = v.step;
  return c;
}

// Recommended init, then every parameter perturbed so that no term is trivially zero or one.
inline void randomize(ParamStore& s, uint64_t seed) {
  s.init_random(seed);
  Rng rng(seed ^ 0xabcdefULL);
  for (const auto& spec : s.specs()) {
    float* p = s.flat().data() + spec.offset;
    const bool big = spec.name.find("lev.") != std::string::npos && spec.name != "lev.spline";
    for (int64_t i = 0; i < spec.numel(); ++i) p[i] += float(rng.normal() * (big ? 0.5 : 0.15));
  }
}

inline void scale_param(ParamStore& s, const std::string& name, float factor) {
  const ParamSpec* spec = s.find(name);
  for (int64_t i = 0; i < spec->numel(); ++i) s.flat()[spec->offset + i] *= factor;
}

// Weights (of a model with a table embedding and an untied head) whose forward stays finite but
// whose backward overflows fp32, for the checks that refuse non-finite gradients: the head ×1e30
// (a loss ~1e30) over an embedding ×1e-15 that the first RMSNorm (eps 1e-37) scales back up.
// That norm's backward divides by the tiny RMS: the embedding's gradient reaches ~1e45.
inline void overflow_the_backward(ModelConfig& c, ParamStore& s) {
  c.norm_eps = 1e-37f;
  scale_param(s, "embed.weight", 1e-15f);
  scale_param(s, "lm_head.weight", 1e30f);
}

}  // namespace cemlm::testing_models
