// The one parameter-layout table (name, shape, offset, init, decay) for a config (MODEL.md §8).
// It drives random init, checkpoint IO and the optimizer; ParamStore owns one flat fp32 buffer
// laid out by it, and Weights binds named views of that buffer for the forward/backward code.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "cemlm/engine/config.h"
#include "cemlm/kernels/huge_pages.h"
#include "cemlm/kernels/tensor.h"

namespace cemlm {

enum class InitKind {
  kNormal,       // N(0, std²)
  kOnes,         // norm gains, LEV LayerNorm weight
  kZeros,        // LEV LayerNorm bias, P_v, diag
  kSoftplusOne,  // p = log(e − 1): softplus(p) = 1
  kOnePlusNormal // 1 + N(0, std²): LEV spline coefficients
};

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  InitKind init = InitKind::kNormal;
  float std = 0.02f;
  bool weight_decay = false;  // AdamW decays matrices only
  int64_t offset = 0;         // in floats, into the flat buffer
  int64_t numel() const;
};

// The layout in canonical order; offsets are filled in.
std::vector<ParamSpec> param_layout(const ModelConfig& c);

class ParamStore {
 public:
  ParamStore() = default;
  explicit ParamStore(const ModelConfig& c);  // zero-filled

  const std::vector<ParamSpec>& specs() const { return specs_; }
  // All parameters in one buffer, on huge pages when large (kernels/huge_pages.h).
  HugePageVector<float>& flat() { return data_; }
  const HugePageVector<float>& flat() const { return data_; }
  int64_t size() const { return int64_t(data_.size()); }
  const ParamSpec* find(const std::string& name) const;
  Tensor get(const std::string& name);
  Tensor get(const ParamSpec& s);
  // MODEL.md's recommended init (except LEV's W_out: see param_layout), deterministic for a seed.
  void init_random(uint64_t seed);

 private:
  std::vector<ParamSpec> specs_;
  std::map<std::string, size_t> index_;
  HugePageVector<float> data_;
};

// Named views of one model's parameters (or of their gradients: same layout).
struct LayerWeights {
  Tensor attn_norm, wq, wk, wv, wo, diag, attn_p, attn_u, attn_v;
  Tensor mlp_norm, w_gate, w_up, w_down, mlp_p, mlp_u, mlp_v;
};
struct Weights {
  Tensor embed;  // table
  Tensor lev_codebooks, lev_seed_proj, lev_ln_weight, lev_ln_bias, lev_spline, lev_out_proj;
  std::vector<LayerWeights> layers;
  Tensor final_norm, lm_head;  // lm_head aliases embed when tied
};
Weights bind_weights(const ModelConfig& c, ParamStore& store);

// Parameter counts for `cemlm inspect` and GetModelInfo.
struct ParamCounts {
  int64_t total = 0, embedding = 0, head = 0, per_layer = 0, attention = 0, mlp = 0, norms = 0;
};
ParamCounts count_params(const ModelConfig& c);
// The Llama-style baseline of the same shape: standard attention, SwiGLU, untied table.
ModelConfig baseline_of(const ModelConfig& c);

// Small deterministic RNG (splitmix64 + Box–Muller) so init and sampling do not depend on the
// standard library's distribution implementations.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next_u64();
  double uniform();  // [0, 1)
  double normal();
  uint64_t state() const { return state_; }
  void set_state(uint64_t s) { state_ = s; has_spare_ = false; }

 private:
  uint64_t state_;
  bool has_spare_ = false;
  double spare_ = 0;
};

}  // namespace cemlm
