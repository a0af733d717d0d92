// Model configuration (MODEL.md §7): the parsed, validated form of config.json, shared by the
// engine, the trainer and every tool. Parsing is strict: unknown, missing, mistyped or
// out-of-range keys are errors that name the key.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace cemlm {

enum class EmbeddingType { kTable, kLev };
enum class AttentionType { kStandard, kCem };
enum class DiagMode { kNone, kShared, kPerHead };
enum class MlpType { kSwiglu, kCem };
enum class StepSize { kInverseT, kUnit };

// How a KV cache holds its entries (--kv-cache-dtype): fp32; bf16 (CPU); int8 (CPU) with a float
// scale per head of each key or value row and one per context row (KvLayerView).
enum class KvDtype { kFp32, kBf16, kInt8 };
// "fp32", "bf16", "int8"; nullopt for anything else.
std::optional<KvDtype> parse_kv_dtype(const std::string& name);

struct LevConfig {
  int digits = 0, seed_dim = 0, knots = 0, rank = 0, heads = 0;
  int base = 0;  // derived: smallest b with b^digits >= vocab_size
};

struct ModelConfig {
  int vocab_size = 0, d_model = 0, n_layers = 0, n_heads = 0, head_dim = 0, d_ff = 0;
  int max_seq_len = 2048;
  float norm_eps = 1e-5f;
  float rope_theta = 10000.0f;
  EmbeddingType embedding = EmbeddingType::kTable;
  bool tie_output = false;
  LevConfig lev;
  AttentionType attention = AttentionType::kStandard;
  DiagMode diag = DiagMode::kNone;
  int attn_precond_rank = 0;
  MlpType mlp = MlpType::kSwiglu;
  int mlp_precond_rank = 0;
  int recursion_default = 1, recursion_max = 8;
  StepSize step_size = StepSize::kInverseT;
  int bos_id = -1, eos_id = -1;  // -1: take from the tokenizer

  int qk_dim() const { return n_heads * head_dim; }
  // A CEM sub-layer: the recursion depth T changes the model's function.
  bool has_cem() const { return attention == AttentionType::kCem || mlp == MlpType::kCem; }
  float step(int T) const { return step_size == StepSize::kInverseT ? 1.0f / float(T) : 1.0f; }
  // Floats cached per layer per token (MODEL.md §9).
  int64_t kv_floats_per_token_layer() const;
  // Cache bytes per token over all layers: an int8 cache adds its scales (4 bytes per head of a
  // key or value row, 4 per context row).
  int64_t kv_bytes_per_token(KvDtype dtype = KvDtype::kFp32) const;
  // Short human-readable name, e.g. "cem-attn(shared,r8)+cem-mlp(r8)+lev".
  std::string variant_name() const;
};

absl::StatusOr<ModelConfig> parse_config(const std::string& json_text);
absl::StatusOr<ModelConfig> load_config(const std::string& path);
std::string config_to_json(const ModelConfig& c);
// A requested recursion depth: 0 (the model's recursion.default) up to recursion.max. The error
// names `field` ("recursion_depth" for a request, "--recursion" for a command).
absl::Status check_recursion_depth(const ModelConfig& c, int depth, const std::string& field);

}  // namespace cemlm
