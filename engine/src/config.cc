// config.json parser and writer (MODEL.md §7). Every key is looked up through a Reader that
// records which keys were consumed, so unknown keys are reported by name after parsing.
#include "cemlm/engine/config.h"

#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cemlm/engine/float32.h"
#include "cemlm/engine/status.h"
#include "cemlm/engine/strict_json.h"
#include "nlohmann/json.hpp"

namespace cemlm {
namespace {

using nlohmann::json;

class Reader {
 public:
  Reader(const json& obj, std::string prefix) : obj_(obj), prefix_(std::move(prefix)) {}

  bool has(const std::string& key) const { return obj_.contains(key); }
  // Escaped (a file's key may hold a newline or a right-to-left mark meant to garble the error).
  std::string path(const std::string& key) const { return absl::CHexEscape(prefix_ + key); }

  absl::Status get_int(const std::string& key, int* out, bool required, int64_t lo, int64_t hi) {
    seen_.insert(key);
    if (!obj_.contains(key)) return missing(key, required);
    const json& v = obj_[key];
    // A whole number out of range is said so whatever its form: "3e9", or an integer past 64
    // bits, which is parsed as a float ("4096.0" in range is still not an integer).
    if (const double d = v.is_number_float() ? v.get<double>() : 0.5;
        std::trunc(d) == d && (d < double(lo) || d > double(hi)))
      return absl::InvalidArgumentError(absl::StrCat("config: '", path(key),
                                                     "' = ", exact_number(d), " is out of range [",
                                                     lo, ", ", hi, "]"));
    if (!v.is_number_integer())
      return absl::InvalidArgumentError(absl::StrCat("config: '", path(key), "' must be an integer"));
    // An unsigned value beyond int64 (2^64 - 1) would read as a negative one: say it as given.
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(hi))
      return absl::InvalidArgumentError(absl::StrCat("config: '", path(key), "' = ",
                                                     v.get<uint64_t>(), " is out of range [", lo,
                                                     ", ", hi, "]"));
    int64_t x = v.get<int64_t>();
    if (x < lo || x > hi)
      return absl::InvalidArgumentError(absl::StrCat("config: '", path(key), "' = ", x,
                                                     " is out of range [", lo, ", ", hi, "]"));
    *out = int(x);
    return absl::OkStatus();
  }
  // A positive float in (0, hi].
  absl::Status get_float(const std::string& key, float* out, double hi) {
    seen_.insert(key);
    if (!obj_.contains(key)) return absl::OkStatus();
    const json& v = obj_[key];
    if (!v.is_number())
      return absl::InvalidArgumentError(absl::StrCat("config: '", path(key), "' must be a number"));
    double x = v.get<double>();
    if (!(x > 0 && x <= hi))
      return absl::InvalidArgumentError(absl::StrCat(
          "config: '", path(key), "' = ", exact_number(x), " is out of range (0, ", hi, "]"));
    if (!positive_normal_float(x))  // 1e-50 passes the check above and is 0 as a float
      return absl::InvalidArgumentError(
          absl::StrCat("config: '", path(key), "' = ", exact_number(x), " ", kTooSmallForFloat));
    *out = float(x);
    return absl::OkStatus();
  }
  absl::Status get_bool(const std::string& key, bool* out) {
    seen_.insert(key);
    if (!obj_.contains(key)) return absl::OkStatus();
    if (!obj_[key].is_boolean())
      return absl::InvalidArgumentError(absl::StrCat("config: '", path(key), "' must be true or false"));
    *out = obj_[key].get<bool>();
    return absl::OkStatus();
  }
  absl::Status get_string(const std::string& key, std::string* out, bool required) {
    seen_.insert(key);
    if (!obj_.contains(key)) return missing(key, required);
    if (!obj_[key].is_string())
      return absl::InvalidArgumentError(absl::StrCat("config: '", path(key), "' must be a string"));
    *out = obj_[key].get<std::string>();
    return absl::OkStatus();
  }
  absl::StatusOr<const json*> get_object(const std::string& key, bool required) {
    seen_.insert(key);
    if (!obj_.contains(key)) {
      if (required) return missing(key, true);
      return nullptr;
    }
    if (!obj_[key].is_object())
      return absl::InvalidArgumentError(absl::StrCat("config: '", path(key), "' must be an object"));
    return &obj_[key];
  }
  absl::Status check_unknown() const {
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
      if (!seen_.count(it.key()))
        return absl::InvalidArgumentError(absl::StrCat(
            "config: unknown key '", path(it.key()), "' (remove it or check its spelling)"));
    }
    return absl::OkStatus();
  }

 private:
  absl::Status missing(const std::string& key, bool required) const {
    if (!required) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("config: missing required key '", path(key), "'"));
  }
  const json& obj_;
  std::string prefix_;
  std::set<std::string> seen_;
};

template <typename E>
absl::Status get_enum(Reader& r, const std::string& key, E* out, bool required,
                      std::initializer_list<std::pair<const char*, E>> choices) {
  std::string s;
  if (!r.has(key)) return r.get_string(key, &s, required);
  if (auto st = r.get_string(key, &s, required); !st.ok()) return st;
  std::string names;
  for (auto& [name, value] : choices) {
    if (s == name) {
      *out = value;
      return absl::OkStatus();
    }
    absl::StrAppend(&names, names.empty() ? "" : ", ", "\"", name, "\"");
  }
  return absl::InvalidArgumentError(absl::StrCat("config: '", r.path(key), "' = \"",
                                                 absl::CHexEscape(s), "\" is not one of ", names));
}

constexpr int64_t kBig = 1 << 24;

absl::Status parse_lev(Reader& emb, ModelConfig& c) {
  auto lev_obj = emb.get_object("lev", c.embedding == EmbeddingType::kLev);
  if (!lev_obj.ok()) return lev_obj.status();
  if (*lev_obj == nullptr) return absl::OkStatus();
  if (c.embedding != EmbeddingType::kLev)
    return absl::InvalidArgumentError(
        "config: 'embedding.lev' is only allowed when 'embedding.type' is \"lev\"");
  Reader lev(**lev_obj, "embedding.lev.");
  CEMLM_RETURN_IF_ERROR(lev.get_int("digits", &c.lev.digits, true, 1, 8));
  CEMLM_RETURN_IF_ERROR(lev.get_int("seed_dim", &c.lev.seed_dim, true, 1, 4096));
  CEMLM_RETURN_IF_ERROR(lev.get_int("knots", &c.lev.knots, true, 2, 1024));
  CEMLM_RETURN_IF_ERROR(lev.get_int("rank", &c.lev.rank, true, 1, 4096));
  CEMLM_RETURN_IF_ERROR(lev.get_int("heads", &c.lev.heads, true, 1, 256));
  CEMLM_RETURN_IF_ERROR(lev.check_unknown());
  int64_t b = 1;
  for (;; ++b) {
    int64_t p = 1;
    for (int i = 0; i < c.lev.digits && p < c.vocab_size; ++i) p *= b;
    if (p >= c.vocab_size) break;
  }
  c.lev.base = int(b);
  return absl::OkStatus();
}

absl::Status parse_precond(Reader& r, const std::string& sub, bool is_cem, int d_model, int* rank) {
  CEMLM_RETURN_IF_ERROR(r.get_int("precond_rank", rank, false, 0, d_model));
  if (!is_cem && *rank != 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "config: '", sub, ".precond_rank' only applies to \"cem\" sub-layers; remove it"));
  return absl::OkStatus();
}

absl::Status parse_into(const json& root, ModelConfig& c) {
  if (!root.is_object()) return absl::InvalidArgumentError("config: top level must be a JSON object");
  Reader r(root, "");
  std::string arch;
  CEMLM_RETURN_IF_ERROR(r.get_string("architecture", &arch, true));
  if (arch != "cemlm")
    return absl::InvalidArgumentError(absl::StrCat("config: 'architecture' = \"",
                                                   absl::CHexEscape(arch), "\" must be \"cemlm\""));
  int version = 0;
  CEMLM_RETURN_IF_ERROR(r.get_int("format_version", &version, true, 1, 1));
  CEMLM_RETURN_IF_ERROR(r.get_int("vocab_size", &c.vocab_size, true, 2, kBig));
  CEMLM_RETURN_IF_ERROR(r.get_int("d_model", &c.d_model, true, 1, 65536));
  CEMLM_RETURN_IF_ERROR(r.get_int("n_layers", &c.n_layers, true, 1, 1024));
  CEMLM_RETURN_IF_ERROR(r.get_int("n_heads", &c.n_heads, true, 1, 1024));
  CEMLM_RETURN_IF_ERROR(r.get_int("head_dim", &c.head_dim, true, 2, 4096));
  if (c.head_dim % 2)
    return absl::InvalidArgumentError(
        absl::StrCat("config: 'head_dim' = ", c.head_dim, " must be even (RoPE pairs dims)"));
  CEMLM_RETURN_IF_ERROR(r.get_int("d_ff", &c.d_ff, true, 1, 1 << 20));
  CEMLM_RETURN_IF_ERROR(r.get_int("max_seq_len", &c.max_seq_len, false, 1, 1 << 22));
  CEMLM_RETURN_IF_ERROR(r.get_float("norm_eps", &c.norm_eps, 1.0));
  CEMLM_RETURN_IF_ERROR(r.get_float("rope_theta", &c.rope_theta, 1e12));

  auto emb_obj = r.get_object("embedding", true);
  if (!emb_obj.ok()) return emb_obj.status();
  Reader emb(**emb_obj, "embedding.");
  CEMLM_RETURN_IF_ERROR(get_enum(emb, "type", &c.embedding, true,
                                 {{"table", EmbeddingType::kTable}, {"lev", EmbeddingType::kLev}}));
  CEMLM_RETURN_IF_ERROR(emb.get_bool("tie_output", &c.tie_output));
  if (c.tie_output && c.embedding != EmbeddingType::kTable)
    return absl::InvalidArgumentError(
        "config: 'embedding.tie_output' = true is only allowed with 'embedding.type' = \"table\"");
  CEMLM_RETURN_IF_ERROR(parse_lev(emb, c));
  CEMLM_RETURN_IF_ERROR(emb.check_unknown());

  auto attn_obj = r.get_object("attention", true);
  if (!attn_obj.ok()) return attn_obj.status();
  Reader attn(**attn_obj, "attention.");
  CEMLM_RETURN_IF_ERROR(get_enum(attn, "type", &c.attention, true,
                                 {{"standard", AttentionType::kStandard}, {"cem", AttentionType::kCem}}));
  CEMLM_RETURN_IF_ERROR(get_enum(
      attn, "diag", &c.diag, false,
      {{"none", DiagMode::kNone}, {"shared", DiagMode::kShared}, {"per_head", DiagMode::kPerHead}}));
  if (c.attention != AttentionType::kCem && c.diag != DiagMode::kNone)
    return absl::InvalidArgumentError(
        "config: 'attention.diag' only applies to \"cem\" attention; remove it or set \"none\"");
  CEMLM_RETURN_IF_ERROR(parse_precond(attn, "attention", c.attention == AttentionType::kCem,
                                      c.d_model, &c.attn_precond_rank));
  CEMLM_RETURN_IF_ERROR(attn.check_unknown());

  auto mlp_obj = r.get_object("mlp", true);
  if (!mlp_obj.ok()) return mlp_obj.status();
  Reader mlp(**mlp_obj, "mlp.");
  CEMLM_RETURN_IF_ERROR(
      get_enum(mlp, "type", &c.mlp, true, {{"swiglu", MlpType::kSwiglu}, {"cem", MlpType::kCem}}));
  CEMLM_RETURN_IF_ERROR(
      parse_precond(mlp, "mlp", c.mlp == MlpType::kCem, c.d_model, &c.mlp_precond_rank));
  CEMLM_RETURN_IF_ERROR(mlp.check_unknown());

  auto rec_obj = r.get_object("recursion", false);
  if (!rec_obj.ok()) return rec_obj.status();
  if (*rec_obj) {
    Reader rec(**rec_obj, "recursion.");
    CEMLM_RETURN_IF_ERROR(rec.get_int("max", &c.recursion_max, false, 1, 64));
    CEMLM_RETURN_IF_ERROR(rec.get_int("default", &c.recursion_default, false, 1, c.recursion_max));
    CEMLM_RETURN_IF_ERROR(get_enum(rec, "step_size", &c.step_size, false,
                                   {{"inverse_T", StepSize::kInverseT}, {"unit", StepSize::kUnit}}));
    CEMLM_RETURN_IF_ERROR(rec.check_unknown());
  }
  CEMLM_RETURN_IF_ERROR(r.get_int("bos_id", &c.bos_id, false, 0, c.vocab_size - 1));
  CEMLM_RETURN_IF_ERROR(r.get_int("eos_id", &c.eos_id, false, 0, c.vocab_size - 1));
  return r.check_unknown();
}

const char* diag_name(DiagMode d) {
  return d == DiagMode::kNone ? "none" : d == DiagMode::kShared ? "shared" : "per_head";
}

}  // namespace

int64_t ModelConfig::kv_floats_per_token_layer() const {
  if (attention == AttentionType::kStandard) return 2LL * qk_dim();
  return qk_dim() + (diag != DiagMode::kNone ? d_model : 0);
}

int64_t ModelConfig::kv_bytes_per_token(KvDtype dtype) const {
  const int64_t floats = kv_floats_per_token_layer() * n_layers;
  if (dtype == KvDtype::kFp32) return 4 * floats;
  if (dtype == KvDtype::kBf16) return 2 * floats;
  const int64_t rows = attention == AttentionType::kStandard ? 2 : 1;  // keys (and values)
  const int64_t scales =
      rows * n_heads + (attention == AttentionType::kCem && diag != DiagMode::kNone);
  return floats + 4 * scales * n_layers;
}

std::optional<KvDtype> parse_kv_dtype(const std::string& name) {
  if (name == "fp32") return KvDtype::kFp32;
  if (name == "bf16") return KvDtype::kBf16;
  if (name == "int8") return KvDtype::kInt8;
  return std::nullopt;
}

std::string ModelConfig::variant_name() const {
  std::string s = attention == AttentionType::kCem
                      ? absl::StrCat("cem-attn(", diag_name(diag), ",r", attn_precond_rank, ")")
                      : "std-attn";
  absl::StrAppend(&s, mlp == MlpType::kCem ? absl::StrCat("+cem-mlp(r", mlp_precond_rank, ")")
                                           : std::string("+swiglu"));
  absl::StrAppend(&s, embedding == EmbeddingType::kLev ? "+lev" : tie_output ? "+table(tied)" : "+table");
  return s;
}

absl::StatusOr<ModelConfig> parse_config(const std::string& json_text) {
  absl::StatusOr<json> root = parse_json_strict(json_text);
  if (!root.ok()) {
    // The hint fits a syntax error, not a NUL byte, deep nesting or a number beyond a double.
    const bool syntax = absl::StrContains(root.status().message(), "syntax error");
    return absl::InvalidArgumentError(absl::StrCat("config: ", root.status().message(),
                                                   syntax ? " (check commas, quotes and braces)" : ""));
  }
  ModelConfig c;
  CEMLM_RETURN_IF_ERROR(parse_into(*root, c));
  return c;
}

absl::StatusOr<ModelConfig> load_config(const std::string& path) {
  // Why it cannot be read: a directory opens fine and reads as nothing ("not valid JSON").
  struct stat sb {};
  if (::stat(path.c_str(), &sb) == 0 && S_ISDIR(sb.st_mode))
    return absl::InvalidArgumentError(
        absl::StrCat("config: '", path, "' is a directory, not a config.json file"));
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) {
    const int err = errno;
    const std::string msg = absl::StrCat("config: cannot open '", path, "': ", std::strerror(err));
    if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError(msg);
    if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
    return absl::FailedPreconditionError(msg);
  }
  // A config.json is a few hundred bytes; reading stops past kMaxConfigBytes (a mistaken path
  // such as a checkpoint's weights, or /dev/zero, is not read into memory whole).
  constexpr size_t kMaxConfigBytes = 1 << 20;
  std::string text;
  char buf[1 << 16];
  size_t got = 0;
  while (text.size() <= kMaxConfigBytes && (got = std::fread(buf, 1, sizeof buf, f)) > 0)
    text.append(buf, got);
  const int read_err = std::ferror(f) ? errno : 0;
  std::fclose(f);
  if (read_err != 0)
    return absl::FailedPreconditionError(
        absl::StrCat("config: cannot read '", path, "': ", std::strerror(read_err)));
  if (text.size() > kMaxConfigBytes)
    return absl::InvalidArgumentError(
        absl::StrCat("config: '", path, "' is over ", kMaxConfigBytes,
                     " bytes, not a config.json (which is a few hundred): check the path"));
  auto c = parse_config(text);
  if (!c.ok()) return absl::Status(c.status().code(), absl::StrCat(path, ": ", c.status().message()));
  return c;
}

absl::Status check_recursion_depth(const ModelConfig& c, int depth, const std::string& field) {
  if (depth < 0)
    return absl::InvalidArgumentError(absl::StrCat(
        field, " = ", depth, " must be >= 0 (0 = the model's default, ", c.recursion_default, ")"));
  if (depth > c.recursion_max)
    return absl::InvalidArgumentError(absl::StrCat(
        field, " = ", depth, " exceeds the model's recursion.max = ", c.recursion_max));
  return absl::OkStatus();
}

std::string config_to_json(const ModelConfig& c) {
  json j;
  j["architecture"] = "cemlm";
  j["format_version"] = 1;
  j["vocab_size"] = c.vocab_size;
  j["d_model"] = c.d_model;
  j["n_layers"] = c.n_layers;
  j["n_heads"] = c.n_heads;
  j["head_dim"] = c.head_dim;
  j["d_ff"] = c.d_ff;
  j["max_seq_len"] = c.max_seq_len;
  j["norm_eps"] = c.norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["embedding"]["type"] = c.embedding == EmbeddingType::kLev ? "lev" : "table";
  j["embedding"]["tie_output"] = c.tie_output;
  if (c.embedding == EmbeddingType::kLev)
    j["embedding"]["lev"] = {{"digits", c.lev.digits}, {"seed_dim", c.lev.seed_dim},
                             {"knots", c.lev.knots}, {"rank", c.lev.rank}, {"heads", c.lev.heads}};
  j["attention"]["type"] = c.attention == AttentionType::kCem ? "cem" : "standard";
  if (c.attention == AttentionType::kCem) {
    j["attention"]["diag"] = diag_name(c.diag);
    j["attention"]["precond_rank"] = c.attn_precond_rank;
  }
  j["mlp"]["type"] = c.mlp == MlpType::kCem ? "cem" : "swiglu";
  if (c.mlp == MlpType::kCem) j["mlp"]["precond_rank"] = c.mlp_precond_rank;
  j["recursion"] = {{"default", c.recursion_default}, {"max", c.recursion_max},
                    {"step_size", c.step_size == StepSize::kUnit ? "unit" : "inverse_T"}};
  if (c.bos_id >= 0) j["bos_id"] = c.bos_id;
  if (c.eos_id >= 0) j["eos_id"] = c.eos_id;
  return j.dump(2) + "\n";
}

}  // namespace cemlm
