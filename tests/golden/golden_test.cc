// The CPU engine's full forward against the independent float64 reference (reference.py): one
// parameterised test per golden case, plus checks that the golden data itself is complete and
// discriminating, and that the loader names what is wrong with a damaged case.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "cemlm/engine/cpu_model.h"
#include "cemlm/engine/safetensors.h"
#include "golden_case.h"
#include "gtest/gtest.h"
#include "temp_dir.h"

namespace cemlm::golden {
namespace {

namespace fs = std::filesystem;

constexpr double kLogitTol = 1e-5;  // fp32 vs float64; the reference run in fp32 lands near 1e-6

GoldenCase load_or_die(const std::string& name) {
  auto gc = load_case(case_dir(name));
  EXPECT_TRUE(gc.ok()) << gc.status();
  return gc.ok() ? std::move(*gc) : GoldenCase{};
}

std::vector<float> forward(GoldenCase& gc, int T) {
  const Weights w = bind_weights(gc.checkpoint.config, gc.checkpoint.params);
  return full_forward(gc.checkpoint.config, w, gc.ids, T);
}

double mean_nll(const std::vector<float>& logits, const std::vector<int>& ids, int V) {
  double total = 0;
  for (size_t i = 0; i + 1 < ids.size(); ++i) {
    const float* row = logits.data() + i * V;
    double mx = row[0], sum = 0;
    for (int v = 1; v < V; ++v) mx = std::max(mx, double(row[v]));
    for (int v = 0; v < V; ++v) sum += std::exp(double(row[v]) - mx);
    total += mx + std::log(sum) - row[ids[i + 1]];
  }
  return total / double(ids.size() - 1);
}

class GoldenTest : public testing::TestWithParam<std::string> {};

TEST_P(GoldenTest, ForwardMatchesReference) {
  GoldenCase gc = load_or_die(GetParam());
  ASSERT_FALSE(gc.ids.empty());
  const std::vector<float> logits = forward(gc, gc.T);
  EXPECT_LT(rel_error(logits, gc.logits), kLogitTol) << gc.checkpoint.config.variant_name();
  EXPECT_NEAR(mean_nll(logits, gc.ids, gc.checkpoint.config.vocab_size), gc.loss, 1e-5);
}

TEST_P(GoldenTest, ExpectedLossAgreesWithExpectedLogits) {
  GoldenCase gc = load_or_die(GetParam());
  ASSERT_FALSE(gc.ids.empty());
  EXPECT_NEAR(mean_nll(gc.logits, gc.ids, gc.checkpoint.config.vocab_size), gc.loss, 1e-5);
}

// Every parameter influences the reference loss, so an engine that drops a term cannot pass.
TEST_P(GoldenTest, EveryParameterHasANonZeroGradient) {
  GoldenCase gc = load_or_die(GetParam());
  ASSERT_EQ(gc.grads.size(), gc.checkpoint.params.specs().size());
  for (const auto& [name, g] : gc.grads) {
    float mx = 0;
    for (float x : g) mx = std::max(mx, std::abs(x));
    EXPECT_GT(mx, 1e-6f) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenTest, testing::ValuesIn(case_names()),
                         [](const auto& info) { return info.param; });

// Every case with a CEM sub-layer, at another T, must miss its reference by far more than the
// tolerance (one test over the cases: those without CEM have nothing to check).
TEST(GoldenCases, CemCasesDependOnT) {
  int cem_cases = 0;
  for (const std::string& name : case_names()) {
    GoldenCase gc = load_or_die(name);
    const ModelConfig& c = gc.checkpoint.config;
    if (gc.ids.empty() || (c.attention != AttentionType::kCem && c.mlp != MlpType::kCem)) continue;
    ++cem_cases;
    EXPECT_GT(rel_error(forward(gc, gc.T + 1), gc.logits), 1e3 * kLogitTol) << name;
  }
  EXPECT_GE(cem_cases, 3);
}

// A copy of one case in a fresh temp dir, for the loader's error paths.
fs::path copy_case(const std::string& tag) {
  const fs::path dst = testing_temp::fresh_dir("golden_" + tag);
  fs::copy(case_dir("lev_std"), dst);
  return dst;
}

void write_ids(const fs::path& dir, const std::string& text) {
  std::ofstream(dir / "ids.json") << text;
}

TEST(GoldenLoader, MissingCaseNamesTheDirectory) {
  auto gc = load_case(case_dir("no_such_case"));
  ASSERT_FALSE(gc.ok());
  EXPECT_NE(gc.status().message().find("no_such_case"), std::string::npos) << gc.status();
}

TEST(GoldenLoader, BadTIsRefusedByName) {
  const fs::path dir = copy_case("bad_t");
  write_ids(dir, R"({"ids": [1, 2, 3], "T": 0})");
  auto gc = load_case(dir.string());
  ASSERT_FALSE(gc.ok());
  EXPECT_NE(gc.status().message().find("'T'"), std::string::npos) << gc.status();
}

TEST(GoldenLoader, OutOfRangeIdIsRefusedByName) {
  const fs::path dir = copy_case("bad_id");
  write_ids(dir, R"({"ids": [1, 61], "T": 1})");
  auto gc = load_case(dir.string());
  ASSERT_FALSE(gc.ok());
  EXPECT_NE(gc.status().message().find("'ids'"), std::string::npos) << gc.status();
}

TEST(GoldenLoader, MissingGradientIsRefusedByName) {
  const fs::path dir = copy_case("no_grad");
  {
    auto f = SafetensorsFile::open((dir / "expected.safetensors").string());
    ASSERT_TRUE(f.ok()) << f.status();
    std::vector<std::vector<float>> values;
    values.reserve(f->tensors().size());  // the spans below point into it
    std::vector<NamedTensor> kept;
    for (const TensorInfo& t : f->tensors()) {
      if (t.name == "grad.final_norm.weight") continue;
      values.push_back(*f->read_f32(t.name));
      kept.push_back({t.name, t.shape, values.back()});
    }
    ASSERT_TRUE(write_safetensors((dir / "expected.safetensors").string(), kept).ok());
  }
  auto gc = load_case(dir.string());
  ASSERT_FALSE(gc.ok());
  EXPECT_NE(gc.status().message().find("grad.final_norm.weight"), std::string::npos) << gc.status();
}

}  // namespace
}  // namespace cemlm::golden
