// Loader for the golden cases: the checkpoint through load_checkpoint, ids.json through
// nlohmann-json, expected.safetensors through the project's SafetensorsFile.
#include "golden_case.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "cemlm/engine/safetensors.h"
#include "cemlm/engine/status.h"
#include "nlohmann/json.hpp"

namespace cemlm::golden {
namespace {

namespace fs = std::filesystem;

absl::StatusOr<std::string> read_text(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", path.string(),
                                                   "': regenerate with tests/golden/make_golden.py"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::Status parse_ids(const fs::path& path, int vocab_size, GoldenCase& gc) {
  CEMLM_ASSIGN_OR_RETURN(const std::string text, read_text(path));
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  const std::string where = path.string();
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": not a JSON object"));
  if (!j.contains("T") || !j["T"].is_number_integer() || j["T"].get<int>() < 1)
    return absl::InvalidArgumentError(absl::StrCat(where, ": 'T' must be an integer >= 1"));
  gc.T = j["T"].get<int>();
  if (!j.contains("ids") || !j["ids"].is_array() || j["ids"].size() < 2)
    return absl::InvalidArgumentError(absl::StrCat(where, ": 'ids' must be an array of >= 2 ids"));
  for (const auto& id : j["ids"]) {
    if (!id.is_number_integer() || id.get<int>() < 0 || id.get<int>() >= vocab_size)
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": 'ids' holds ", id.dump(), ", not an id in [0, ", vocab_size, ")"));
    gc.ids.push_back(id.get<int>());
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> read_shaped(const SafetensorsFile& f, const std::string& name,
                                               const std::vector<int64_t>& shape) {
  const TensorInfo* t = f.find(name);
  if (t == nullptr)
    return absl::NotFoundError(absl::StrCat(f.path(), ": missing tensor '", name, "'"));
  if (t->shape != shape)
    return absl::InvalidArgumentError(absl::StrCat(f.path(), ": tensor '", name, "' has shape ",
                                                   shape_string(t->shape), ", expected ",
                                                   shape_string(shape)));
  return f.read_f32(name);
}

absl::Status read_expected(const fs::path& path, GoldenCase& gc) {
  CEMLM_ASSIGN_OR_RETURN(const SafetensorsFile f, SafetensorsFile::open(path.string()));
  const ModelConfig& c = gc.checkpoint.config;
  CEMLM_ASSIGN_OR_RETURN(gc.logits,
                         read_shaped(f, "logits", {int64_t(gc.ids.size()), c.vocab_size}));
  CEMLM_ASSIGN_OR_RETURN(const std::vector<float> loss, read_shaped(f, "loss", {1}));
  gc.loss = loss[0];
  for (const ParamSpec& s : gc.checkpoint.params.specs()) {
    CEMLM_ASSIGN_OR_RETURN(gc.grads[s.name], read_shaped(f, "grad." + s.name, s.shape));
  }
  const size_t expected_count = 2 + gc.grads.size();
  if (f.tensors().size() != expected_count)
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": holds ", f.tensors().size(),
                                                   " tensors, expected ", expected_count,
                                                   " (logits, loss, one grad per parameter)"));
  return absl::OkStatus();
}

}  // namespace

const std::vector<std::string>& case_names() {
  static const std::vector<std::string> names = {
      "llama_tied", "cem_none_t2", "cem_shared_precond_t3", "cem_perhead_unit_t2", "lev_std"};
  return names;
}

std::string case_dir(const std::string& name) {
  const char* src = std::getenv("CEMLM_SOURCE_DIR");
  return (fs::path(src ? src : ".") / "tests" / "golden" / "data" / name).string();
}

absl::StatusOr<GoldenCase> load_case(const std::string& dir) {
  GoldenCase gc;
  gc.name = fs::path(dir).filename().string();
  CEMLM_ASSIGN_OR_RETURN(gc.checkpoint, load_checkpoint(dir));
  CEMLM_RETURN_IF_ERROR(parse_ids(fs::path(dir) / "ids.json", gc.checkpoint.config.vocab_size, gc));
  CEMLM_RETURN_IF_ERROR(read_expected(fs::path(dir) / "expected.safetensors", gc));
  return gc;
}

double rel_error(std::span<const float> a, std::span<const float> b, double floor) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, scale = floor;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(double(a[i]) - double(b[i]));
    if (!std::isfinite(d)) return std::numeric_limits<double>::infinity();  // NaN must not pass
    diff = std::max(diff, d);
    scale = std::max(scale, std::abs(double(b[i])));
  }
  return diff / scale;
}

}  // namespace cemlm::golden
