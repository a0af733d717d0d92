// AdamW against hand-computed and independently computed updates (decay only where the spec
// asks), the warmup + cosine schedule at known steps, clipping, and exact state save/load.
#include "cemlm/trainer/optimizer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "cemlm/engine/safetensors.h"
#include "trainer_test_util.h"

namespace cemlm {
namespace {

// "a": 2 decayed values, "b": 1 value without decay.
std::vector<ParamSpec> toy_specs() {
  std::vector<ParamSpec> s = {{"a", {2}, InitKind::kNormal, 0.02f, true, 0},
                              {"b", {1}, InitKind::kNormal, 0.02f, false, 2}};
  return s;
}

TEST(AdamW, FirstStepMatchesHandComputation) {
  // Step 1: m̂ = g and v̂ = g², so each value moves by lr·sign(g) after decay θ·(1 − lr·wd).
  AdamWOptions o;
  o.weight_decay = 0.1;
  AdamW opt(toy_specs(), o);
  std::vector<float> p = {1.0f, -2.0f, 3.0f}, g = {0.5f, -1.0f, 2.0f};
  opt.step(p, g, 0.1);
  EXPECT_NEAR(p[0], 1.0 * 0.99 - 0.1, 1e-6);
  EXPECT_NEAR(p[1], -2.0 * 0.99 + 0.1, 1e-6);
  EXPECT_NEAR(p[2], 3.0 - 0.1, 1e-6);  // "b" is not decayed
  EXPECT_EQ(opt.steps(), 1);
}

TEST(AdamW, MinimisesAToyQuadraticLikeTheTextbookUpdate) {
  // f(θ) = ½ Σ k_i (θ_i − c_i)²; reference AdamW in double, written from the paper's formulas,
  // fed the same gradients (so float rounding cannot be amplified near the minimum).
  const std::vector<double> k = {1.0, 4.0, 0.5}, c = {0.3, -0.7, 2.0};
  AdamWOptions o;
  o.beta1 = 0.8;
  o.beta2 = 0.9;
  o.eps = 1e-6;
  o.weight_decay = 0.05;
  AdamW opt(toy_specs(), o);
  std::vector<float> p = {1.0f, 1.0f, -1.0f};
  std::vector<double> ref = {1.0, 1.0, -1.0}, m(3, 0), v(3, 0);
  const bool decay[3] = {true, true, false};
  const double lr = 0.05;
  for (int t = 1; t <= 200; ++t) {
    std::vector<float> g(3);
    for (int i = 0; i < 3; ++i) g[i] = float(k[i] * (p[i] - c[i]));
    opt.step(p, g, lr);
    for (int i = 0; i < 3; ++i) {
      const double gi = g[i];
      if (decay[i]) ref[i] -= lr * o.weight_decay * ref[i];
      m[i] = o.beta1 * m[i] + (1 - o.beta1) * gi;
      v[i] = o.beta2 * v[i] + (1 - o.beta2) * gi * gi;
      const double mh = m[i] / (1 - std::pow(o.beta1, t)), vh = v[i] / (1 - std::pow(o.beta2, t));
      ref[i] -= lr * mh / (std::sqrt(vh) + o.eps);
    }
    for (int i = 0; i < 3; ++i) ASSERT_NEAR(p[i], ref[i], 1e-4) << "step " << t << " value " << i;
  }
}

TEST(AdamW, SavedStateContinuesBitExactly) {
  const std::string dir = testing_trainer::fresh_dir();
  AdamW a(toy_specs(), AdamWOptions{});
  std::vector<float> p = {0.1f, 0.2f, 0.3f}, g = {0.3f, -0.2f, 0.1f};
  for (int t = 0; t < 3; ++t) a.step(p, g, 0.01);
  ASSERT_TRUE(a.save(dir + "/opt.safetensors").ok());
  AdamW b(toy_specs(), AdamWOptions{});
  ASSERT_TRUE(b.load(dir + "/opt.safetensors").ok());
  EXPECT_EQ(b.steps(), 3);
  std::vector<float> q = p;
  a.step(p, g, 0.01);
  b.step(q, g, 0.01);
  EXPECT_EQ(p, q);
  EXPECT_EQ(a.second_moment(), b.second_moment());
}

TEST(AdamW, LoadRefusesStateOfAnotherLayout) {
  const std::string dir = testing_trainer::fresh_dir();
  ASSERT_TRUE(AdamW(toy_specs(), AdamWOptions{}).save(dir + "/opt.safetensors").ok());
  std::vector<ParamSpec> other = {{"a", {3}, InitKind::kNormal, 0.02f, true, 0}};
  const absl::Status st = AdamW(other, AdamWOptions{}).load(dir + "/opt.safetensors");
  EXPECT_FALSE(st.ok());
  other = {{"a", {1}, InitKind::kNormal, 0.02f, true, 0},
           {"b", {2}, InitKind::kNormal, 0.02f, false, 1}};
  const absl::Status st2 = AdamW(other, AdamWOptions{}).load(dir + "/opt.safetensors");
  ASSERT_FALSE(st2.ok());
  EXPECT_NE(st2.message().find("adam_m.a"), std::string::npos) << st2.message();
}

// A negative second moment (a damaged file, or the moments' names swapped) is refused naming the
// file, the tensor and the element: it made the first step NaN, and the run stopped blaming the
// learning rate.
TEST(AdamW, LoadRefusesANegativeSecondMoment) {
  const std::string dir = testing_trainer::fresh_dir();
  const std::string path = dir + "/opt.safetensors";
  const std::vector<float> m_a = {0.5f, -0.25f}, m_b = {0.125f}, v_a = {0.5f, 0.25f};
  const std::vector<float> bad_b = {-1.0f}, good_b = {0.0f};
  auto write = [&](const std::vector<float>& v_b, bool swapped) {
    const std::string m = swapped ? "adam_v." : "adam_m.", v = swapped ? "adam_m." : "adam_v.";
    ASSERT_TRUE(
        write_safetensors(
            path,
            {{m + "a", {2}, m_a}, {m + "b", {1}, m_b}, {v + "a", {2}, v_a}, {v + "b", {1}, v_b}},
            {{"step", "3"}})
            .ok());
  };
  write(good_b, false);
  EXPECT_TRUE(AdamW(toy_specs(), AdamWOptions{}).load(path).ok());  // zero is a second moment
  write(bad_b, false);
  absl::Status st = AdamW(toy_specs(), AdamWOptions{}).load(path);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("opt.safetensors: tensor 'adam_v.b' element 0 is -1, a second "
                              "moment cannot be negative"),
            std::string::npos)
      << st.message();
  write(good_b, true);  // the first moments, with a negative value, read as the second
  st = AdamW(toy_specs(), AdamWOptions{}).load(path);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("tensor 'adam_v.a' element 1 is -0.25"), std::string::npos)
      << st.message();
}

TEST(LrSchedule, WarmupThenCosineToTheFloor) {
  const LrSchedule s{1e-3, 1e-4, 10, 110};
  EXPECT_DOUBLE_EQ(s.at(0), 1e-4);  // (0+1)/10 of the peak
  EXPECT_DOUBLE_EQ(s.at(4), 5e-4);
  EXPECT_DOUBLE_EQ(s.at(9), 1e-3);
  EXPECT_DOUBLE_EQ(s.at(10), 1e-3);
  EXPECT_NEAR(s.at(60), 5.5e-4, 1e-15);  // half-way: the mean of peak and floor
  EXPECT_NEAR(s.at(110), 1e-4, 1e-15);
  EXPECT_NEAR(s.at(500), 1e-4, 1e-15);  // past the end: stays at the floor
  const LrSchedule no_warmup{2e-3, 0, 0, 4};
  EXPECT_DOUBLE_EQ(no_warmup.at(0), 2e-3);
  EXPECT_NEAR(no_warmup.at(2), 1e-3, 1e-15);
}

TEST(ClipGradNorm, ScalesOnlyAboveTheLimit) {
  std::vector<float> g = {3.0f, 4.0f};
  EXPECT_DOUBLE_EQ(clip_grad_norm(g, 10.0), 5.0);
  EXPECT_EQ(g, (std::vector<float>{3.0f, 4.0f}));
  EXPECT_DOUBLE_EQ(clip_grad_norm(g, 0.0), 5.0);  // 0: no clipping
  EXPECT_EQ(g, (std::vector<float>{3.0f, 4.0f}));
  EXPECT_DOUBLE_EQ(clip_grad_norm(g, 1.0), 5.0);
  EXPECT_FLOAT_EQ(g[0], 0.6f);
  EXPECT_FLOAT_EQ(g[1], 0.8f);
}

}  // namespace
}  // namespace cemlm
