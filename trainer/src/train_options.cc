// Training options: the recursion flags' syntax, validation that names the flag, the JSON form
// kept in trainer_state.json (so --resume knows how the run was started), and the default model.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <stdexcept>
#include <type_traits>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cemlm/engine/corpus.h"
#include "cemlm/engine/cpu_threads.h"
#include "cemlm/engine/float32.h"
#include "cemlm/engine/status.h"
#include "cemlm/engine/strict_json.h"
#include "cemlm/engine/tokenizer.h"
#include "cemlm/trainer/train.h"
#include "nlohmann/json.hpp"

namespace cemlm {
namespace {

using nlohmann::json;

absl::Status flag_error(const std::string& flag, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", what));
}

template <typename T>
absl::Status at_least(const std::string& flag, T value, T min) {
  if (value >= min) return absl::OkStatus();
  return flag_error(flag, absl::StrCat("must be at least ", min, " (got ", value, ")"));
}

absl::Status in_range(const std::string& flag, double value, double lo, double hi, bool lo_open,
                      bool hi_open) {
  const bool ok = std::isfinite(value) && (lo_open ? value > lo : value >= lo) &&
                  (hi_open ? value < hi : value <= hi);
  if (ok) return absl::OkStatus();
  return flag_error(flag, absl::StrCat("must be in ", lo_open ? "(" : "[", lo, ", ", hi,
                                       hi_open ? ")" : "]", " (got ", exact_number(value), ")"));
}

// AdamW computes in 32-bit floats (optimizer.cc): a value that passes its range check as a double
// must keep its meaning as a float. An epsilon of 1e-50 is 0 there (0/0 for a row never seen); a
// β of 0.99999999999 is 1, and its moment never moves (β1: no weight changes; β2: NaN).
// The learning rate too: 1e-50 is 0 there, and nothing would train.
absl::Status check_positive_as_float(const std::string& flag, double value, double default_value) {
  if (positive_normal_float(value)) return absl::OkStatus();
  return flag_error(flag, absl::StrCat(exact_number(value), " ", kTooSmallForFloat,
                                       ": raise it (the default is ", default_value, ")"));
}

absl::Status check_beta_as_float(const std::string& flag, double value) {
  if (below_one_as_float(value)) return absl::OkStatus();
  return flag_error(flag, absl::StrFormat("%.15g rounds to 1 as a 32-bit float (what AdamW "
                                          "computes in), where its moment would never move: use "
                                          "at most %.8g",
                                          value, largest_float_below_one()));
}

// A saved option must have its field's type, said as such rather than as nlohmann's type error:
// an integer the field can hold (integer_fits), a number, a string, true or false, an array of
// those; throws std::invalid_argument (options_from_json names the key).
template <typename T>
void check_fits(const json& v, const T&) {
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean())
      throw std::invalid_argument(absl::StrCat("must be true or false (got ", v.dump(), ")"));
  } else if constexpr (std::is_integral_v<T>) {
    using lim = std::numeric_limits<T>;
    if (!integer_fits<T>(v))
      throw std::invalid_argument(
          std::is_same_v<T, uint64_t>
              ? absl::StrCat("must be an integer in [0, 2^64) (got ", v.dump(), ")")
              : absl::StrCat("must be an integer in [", lim::min(), ", ", lim::max(), "] (got ",
                             v.dump(), ")"));
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.is_number())
      throw std::invalid_argument(absl::StrCat("must be a number (got ", v.dump(), ")"));
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string())
      throw std::invalid_argument(absl::StrCat("must be a string (got ", v.dump(), ")"));
  }
}
template <typename T>
void check_fits(const json& v, const std::vector<T>&) {
  if (!v.is_array())
    throw std::invalid_argument(absl::StrCat("must be an array (got ", v.dump(), ")"));
  for (const json& e : v) check_fits(e, T{});
}

}  // namespace

absl::StatusOr<RecursionRange> parse_recursion_range(const std::string& text) {
  const std::vector<std::string> parts = absl::StrSplit(text, '-');
  RecursionRange r;
  if (parts.size() > 2 || !absl::SimpleAtoi(parts[0], &r.min) ||
      !absl::SimpleAtoi(parts.back(), &r.max))
    return flag_error(
        "train-recursion",
        absl::StrCat("'", text, "' is neither a depth T (like 2) nor a range (like 1-4)"));
  if (r.min < 1) return flag_error("train-recursion", absl::StrCat("'", text, "': T starts at 1"));
  if (r.min > r.max)
    return flag_error("train-recursion",
                      absl::StrCat("'", text, "': the range's start is above its end"));
  return r;
}

std::string recursion_range_text(const RecursionRange& r) {
  return r.min == r.max ? std::to_string(r.min) : absl::StrCat(r.min, "-", r.max);
}

absl::StatusOr<std::vector<int>> parse_recursion_list(const std::string& text) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int T = 0;
    if (!absl::SimpleAtoi(part, &T) || T < 1)
      return flag_error("eval-recursion",
                        absl::StrCat("'", text, "' is not a list of depths ≥ 1 like 1,2,4,8"));
    if (std::find(out.begin(), out.end(), T) != out.end())
      return flag_error("eval-recursion",
                        absl::StrCat("'", text, "' names T = ", T, " twice: give each depth once"));
    out.push_back(T);
  }
  return out;
}

absl::Status validate_options(const TrainOptions& o) {
  if (!o.config_path.empty() && !o.init_dir.empty())
    return flag_error("config", "and --init both give the model: pass only one");
  if (o.data.empty()) return flag_error("data", "needs at least one file or directory");
  if (o.out_dir.empty()) return flag_error("out", "must name the checkpoint directory");
  CEMLM_RETURN_IF_ERROR(at_least<int>("vocab-size", o.vocab_size, 0));
  // A new run without --tokenizer trains one of --vocab-size pieces: too few is wrong whatever
  // the corpus (it was refused as the config's vocab_size, after the model was set up, exit 1).
  if (const std::string error = tokenizer_vocab_too_small("--vocab-size", o.vocab_size);
      o.vocab_size > 0 && !o.resume && o.init_dir.empty() && o.tokenizer_path.empty() &&
      !error.empty())
    return absl::InvalidArgumentError(error);
  CEMLM_RETURN_IF_ERROR(in_range("val-fraction", o.val_fraction, 0, 0.5, true, false));
  CEMLM_RETURN_IF_ERROR(at_least<int64_t>("save-every", o.save_every, 1));
  CEMLM_RETURN_IF_ERROR(at_least<int64_t>("steps", o.steps, 1));
  CEMLM_RETURN_IF_ERROR(at_least<int>("batch-size", o.batch_size, 1));
  CEMLM_RETURN_IF_ERROR(at_least<int>("seq-len", o.seq_len, 2));
  CEMLM_RETURN_IF_ERROR(at_least<int>("accum", o.accum, 1));
  CEMLM_RETURN_IF_ERROR(in_range("lr", o.lr, 0, 1, true, false));
  CEMLM_RETURN_IF_ERROR(check_positive_as_float("lr", o.lr, TrainOptions{}.lr));
  if (!(o.min_lr >= 0 && o.min_lr <= o.lr))
    return flag_error("min-lr", absl::StrCat("must be in [0, --lr] = [0, ", exact_number(o.lr),
                                             "] (got ", exact_number(o.min_lr), ")"));
  CEMLM_RETURN_IF_ERROR(at_least<int64_t>("warmup", o.warmup, 0));
  // The decay multiplies each matrix weight by 1 − lr·wd a step: any wd ≥ 0 with lr·wd < 1 (at the
  // peak --lr; it was [0, 1) whatever --lr, which refused PyTorch's usual values of 1 and more).
  if (!(o.adamw.weight_decay >= 0 && o.lr * o.adamw.weight_decay < 1))
    return flag_error(
        "weight-decay",
        absl::StrCat("must be at least 0 with --lr x --weight-decay below 1 (each "
                     "step multiplies the matrices by 1 - lr x wd), got ",
                     exact_number(o.adamw.weight_decay), " at --lr ", exact_number(o.lr)));
  CEMLM_RETURN_IF_ERROR(in_range("beta1", o.adamw.beta1, 0, 1, false, true));
  CEMLM_RETURN_IF_ERROR(check_beta_as_float("beta1", o.adamw.beta1));
  CEMLM_RETURN_IF_ERROR(in_range("beta2", o.adamw.beta2, 0, 1, false, true));
  CEMLM_RETURN_IF_ERROR(check_beta_as_float("beta2", o.adamw.beta2));
  CEMLM_RETURN_IF_ERROR(in_range("adam-eps", o.adamw.eps, 0, 1, true, false));
  CEMLM_RETURN_IF_ERROR(check_positive_as_float("adam-eps", o.adamw.eps, AdamWOptions{}.eps));
  CEMLM_RETURN_IF_ERROR(in_range("clip", o.clip, 0, 1e9, false, false));
  if (o.train_recursion.min < 1 || o.train_recursion.min > o.train_recursion.max)
    return flag_error("train-recursion", absl::StrCat("'", recursion_range_text(o.train_recursion),
                                                      "' must be 1 ≤ min ≤ max"));
  if (o.eval_recursion.empty()) return flag_error("eval-recursion", "needs at least one depth");
  for (int T : o.eval_recursion) CEMLM_RETURN_IF_ERROR(at_least<int>("eval-recursion", T, 1));
  CEMLM_RETURN_IF_ERROR(at_least<int64_t>("eval-every", o.eval_every, 1));
  CEMLM_RETURN_IF_ERROR(at_least<int>("eval-windows", o.eval_windows, 1));
  CEMLM_RETURN_IF_ERROR(in_range("threads", o.threads, 0, kMaxThreads, false, false));
  CEMLM_RETURN_IF_ERROR(in_range("max-minutes", o.max_minutes, 0, 1e9, false, false));
  return absl::OkStatus();
}

std::string options_to_json(const TrainOptions& o) {
  const json j = {{"config", o.config_path},
                  {"init", o.init_dir},
                  {"tokenizer", o.tokenizer_path},
                  {"vocab_size", o.vocab_size},
                  {"data", o.data},
                  {"cache", o.cache_dir},
                  {"val_fraction", o.val_fraction},
                  {"out", o.out_dir},
                  {"save_every", o.save_every},
                  {"steps", o.steps},
                  {"batch_size", o.batch_size},
                  {"seq_len", o.seq_len},
                  {"accum", o.accum},
                  {"lr", o.lr},
                  {"min_lr", o.min_lr},
                  {"warmup", o.warmup},
                  {"weight_decay", o.adamw.weight_decay},
                  {"beta1", o.adamw.beta1},
                  {"beta2", o.adamw.beta2},
                  {"adam_eps", o.adamw.eps},
                  {"clip", o.clip},
                  {"train_recursion", recursion_range_text(o.train_recursion)},
                  {"eval_recursion", o.eval_recursion},
                  {"eval_every", o.eval_every},
                  {"eval_windows", o.eval_windows},
                  {"threads", o.threads},
                  {"seed", o.seed},
                  {"max_minutes", o.max_minutes}};
  return j.dump(2);
}

absl::StatusOr<TrainOptions> options_from_json(const std::string& json_text) {
  // Strict (as config.json is read): a syntax error says where, a key given twice is an error,
  // and nesting is capped (a deeply nested value once overflowed the stack when printed).
  absl::StatusOr<json> parsed = parse_json_strict(json_text);
  if (!parsed.ok())
    return absl::InvalidArgumentError(
        absl::StrCat("training options: ", parsed.status().message(), " (the file is damaged)"));
  const json& j = *parsed;
  if (!j.is_object())
    return absl::InvalidArgumentError("training options: not a JSON object (the file is damaged)");
  TrainOptions o;
  std::string recursion;
  const char* key = "";  // the one being read, named in the error
  std::vector<std::string> known;
  auto get = [&](const char* k, auto& field) {
    key = k;
    known.push_back(k);
    if (!j.contains(k)) throw std::out_of_range("missing (the file is damaged)");
    check_fits(j.at(k), field);
    j.at(k).get_to(field);
  };
  try {
    get("config", o.config_path);
    get("init", o.init_dir);
    get("tokenizer", o.tokenizer_path);
    get("vocab_size", o.vocab_size);
    get("data", o.data);
    get("cache", o.cache_dir);
    get("val_fraction", o.val_fraction);
    get("out", o.out_dir);
    get("save_every", o.save_every);
    get("steps", o.steps);
    get("batch_size", o.batch_size);
    get("seq_len", o.seq_len);
    get("accum", o.accum);
    get("lr", o.lr);
    get("min_lr", o.min_lr);
    get("warmup", o.warmup);
    get("weight_decay", o.adamw.weight_decay);
    get("beta1", o.adamw.beta1);
    get("beta2", o.adamw.beta2);
    get("adam_eps", o.adamw.eps);
    get("clip", o.clip);
    get("train_recursion", recursion);
    get("eval_recursion", o.eval_recursion);
    get("eval_every", o.eval_every);
    get("eval_windows", o.eval_windows);
    get("threads", o.threads);
    get("seed", o.seed);
    get("max_minutes", o.max_minutes);
  } catch (const std::exception& e) {  // nlohmann reports missing keys and wrong types by throwing
    return absl::InvalidArgumentError(absl::StrCat("training options, \"", key, "\": ", e.what()));
  }
  for (const auto& [k, v] : j.items())
    if (std::find(known.begin(), known.end(), k) == known.end())
      return absl::InvalidArgumentError(
          absl::StrCat("training options: unknown key \"", absl::CHexEscape(k),
                       "\" (the file is damaged, or from another cemlm version)"));
  // A seed is an integer in [0, 2^64): a negative one would wrap, and seed another run.
  if (!j.at("seed").is_number_unsigned())
    return absl::InvalidArgumentError(
        "training options, \"seed\": must be an integer in [0, 2^64)");
  CEMLM_ASSIGN_OR_RETURN(o.train_recursion, parse_recursion_range(recursion));
  return o;
}

SavesLeft saves_left_beside(const std::filesystem::path& out) {
  namespace fs = std::filesystem;
  const fs::path parent = out.has_parent_path() ? out.parent_path() : fs::path(".");
  const std::string prefix = out.filename().string() + ".tmp-";
  auto digits = [](std::string_view s) {
    return !s.empty() &&
           std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  // Exactly "<pid>-<n>" (or "<pid>-<n>.old") after the prefix: anything else there is not a
  // save's, and stays.
  auto is_save = [&](std::string_view rest) {
    const size_t dash = rest.find('-');
    return dash != std::string::npos && digits(rest.substr(0, dash)) &&
           digits(rest.substr(dash + 1));
  };
  SavesLeft left;
  std::error_code ec;
  for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with(prefix)) continue;
    const std::string_view rest = std::string_view(name).substr(prefix.size());
    if (is_save(rest)) left.unfinished.push_back(it->path());
    if (rest.ends_with(".old") && is_save(rest.substr(0, rest.size() - 4)))
      left.aside.push_back(it->path());
  }
  return left;
}

std::filesystem::path SavesLeft::latest_aside() const {
  if (aside.empty()) return {};
  return *std::max_element(aside.begin(), aside.end(), [](const auto& a, const auto& b) {
    std::error_code e;
    return std::filesystem::last_write_time(a, e) < std::filesystem::last_write_time(b, e);
  });
}

absl::StatusOr<TrainOptions> load_run_options(const std::string& out_dir, int64_t* step) {
  std::filesystem::path dir(out_dir);
  std::error_code ec;
  if (const std::filesystem::path out = checkpoint_target_path(out_dir);
      !std::filesystem::exists(out, ec) && !ec)
    if (const std::filesystem::path aside = saves_left_beside(out).latest_aside(); !aside.empty())
      dir = aside;
  const std::string path = (dir / kTrainerStateFile).string();
  std::string text, error;
  if (!read_file(path, &text, &error, kMaxTrainerStateBytes))
    return absl::NotFoundError(
        absl::StrCat("--resume: ", error, " (is --out the directory of a `cemlm train` run?)"));
  // Strict, as options_from_json: a syntax error is said as one, not as missing "options".
  absl::StatusOr<json> parsed = parse_json_strict(text);
  if (!parsed.ok())
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", parsed.status().message(), " (the file is damaged)"));
  const json& j = *parsed;
  if (!j.is_object() || !j.contains("options"))
    return absl::InvalidArgumentError(absl::StrCat(path, ": no \"options\" (the file is damaged)"));
  auto opts = options_from_json(j["options"].dump());
  if (!opts.ok())
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", opts.status().message()));
  if (step)
    *step = j.contains("step") && j["step"].is_number_unsigned() ? j["step"].get<int64_t>() : 0;
  return opts;
}

ModelConfig default_model_config() {
  ModelConfig c;
  c.vocab_size = 4096;
  c.d_model = 128;
  c.n_layers = 4;
  c.n_heads = 4;
  c.head_dim = 32;
  c.d_ff = 512;
  c.max_seq_len = 512;
  c.embedding = EmbeddingType::kTable;
  c.attention = AttentionType::kCem;
  c.diag = DiagMode::kShared;
  c.attn_precond_rank = 8;
  c.mlp = MlpType::kCem;
  c.mlp_precond_rank = 8;
  c.recursion_default = 2;
  c.recursion_max = 8;
  return c;
}

}  // namespace cemlm
