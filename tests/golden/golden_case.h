// Golden cases from the independent float64 reference (tests/golden/reference.py, written by
// make_golden.py): a checkpoint, the token ids and T, and the expected logits, mean NLL and
// gradient of that NLL for every parameter. Engine and trainer tests load them through here
// (library cemlm_golden); tests/golden/README.md documents the files.
#pragma once
#include <map>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cemlm/engine/checkpoint.h"

namespace cemlm::golden {

struct GoldenCase {
  std::string name;
  Checkpoint checkpoint;
  std::vector<int> ids;
  int T = 1;
  std::vector<float> logits;  // [N, V], row i predicts ids[i + 1]
  float loss = 0;             // mean next-token NLL over the N − 1 scored tokens (MODEL.md §3)
  std::map<std::string, std::vector<float>> grads;  // param name → dNLL/dparam, in its layout shape
};

// Every case make_golden.py writes.
const std::vector<std::string>& case_names();
// $CEMLM_SOURCE_DIR/tests/golden/data/<name>.
std::string case_dir(const std::string& name);
// Loads a case directory; every file and field is checked, errors name the file and the field.
absl::StatusOr<GoldenCase> load_case(const std::string& dir);

// max|a − b| / max(floor, max|b|), the project's error measure for logits and gradients (floor
// 1); infinity when the sizes differ or a value is not finite. Gradients, all far below 1, are
// measured against their own largest element (a small floor).
double rel_error(std::span<const float> a, std::span<const float> b, double floor = 1);

}  // namespace cemlm::golden
