// forward_backward against the independent float64 reference (tests/golden/): the loss and the
// gradient of every parameter of every golden case, to the project's error measure rel_error.
#include <span>
#include <string>

#include "cemlm/trainer/backprop.h"
#include "golden_case.h"
#include "gtest/gtest.h"

namespace cemlm::golden {
namespace {

// Relative to each gradient's largest element: the cases' gradients peak at 0.025-0.3, where
// an absolute 1e-4 let 0.4% of the largest element through; they agree to within 3.6e-6.
constexpr double kGradTol = 2e-5, kGradFloor = 1e-6;

class GoldenGrad : public testing::TestWithParam<std::string> {};

TEST_P(GoldenGrad, LossAndEveryGradientMatchTheReference) {
  auto gc = load_case(case_dir(GetParam()));
  ASSERT_TRUE(gc.ok()) << gc.status();
  const ModelConfig& c = gc->checkpoint.config;
  ParamStore grads(c);
  const double loss =
      forward_backward(c, bind_weights(c, gc->checkpoint.params), bind_weights(c, grads),
                       gc->ids.data(), 1, int(gc->ids.size()), gc->T);
  EXPECT_NEAR(loss, gc->loss, 1e-5);
  ASSERT_EQ(gc->grads.size(), grads.specs().size());
  for (const ParamSpec& s : grads.specs()) {
    const std::span<const float> mine(grads.flat().data() + s.offset, size_t(s.numel()));
    EXPECT_LT(rel_error(mine, gc->grads.at(s.name), kGradFloor), kGradTol) << s.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenGrad, testing::ValuesIn(case_names()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace cemlm::golden
