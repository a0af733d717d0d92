// On-device sampling against the host Sampler (engine/sampler.h) given the same per-request
// uniform draw: greedy, penalties, temperature, top-k, top-p and min-p pick the same token with
// the same logprob, on random rows and on rows of whole numbers (ties cut by the filters).
#include "cemlm/kernels/cuda/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <span>

#include "cemlm/engine/sampler.h"
#include "gpu_test_util.h"

namespace cemlm {
namespace {

using gpu_test::random_vec;

cuda::SampleRowSpec spec_of(const SamplingParams& p, uint64_t seed, const std::vector<int>& hist,
                            int n_prompt) {
  cuda::SampleRowSpec s;
  s.temperature = samples_greedily(p) ? 0.0f : p.temperature;
  s.top_k = p.top_k;
  s.top_p = p.top_p;
  s.min_p = p.min_p;
  s.repetition_penalty = p.repetition_penalty;
  s.presence_penalty = p.presence_penalty;
  s.frequency_penalty = p.frequency_penalty;
  s.uniform = Rng(seed).uniform();  // the Sampler's one draw for this token
  s.tokens = hist.data();
  s.n_tokens = int(hist.size());
  s.n_prompt = n_prompt;
  return s;
}

SamplingParams params(float temperature, int top_k, float top_p, float min_p, float rep = 1.0f,
                      float presence = 0.0f, float frequency = 0.0f) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  p.repetition_penalty = rep;
  p.presence_penalty = presence;
  p.frequency_penalty = frequency;
  return p;
}

class SamplingTest : public gpu_test::GpuFixture<> {
 protected:
  // Every case below on the rows `logits` [N, V], each row with its own seed, against the host;
  // logprobs within `tol` relative to their size (absolute below 1).
  void expect_matches_host(const std::vector<float>& logits, int N, int V, const char* rows_name,
                           double tol = 1e-4);
};

void SamplingTest::expect_matches_host(const std::vector<float>& logits, int N, int V,
                                       const char* rows_name, double tol) {
  // The history repeats tokens so counts above one matter; prompt first, then generated.
  const std::vector<int> hist = {7, 3, 3, V - 1, 0, 12, 7, 7, 5, 3};
  const int n_prompt = 5;
  const std::vector<std::pair<const char*, SamplingParams>> cases = {
      {"greedy", params(0, 0, 1, 0)},
      {"greedy_penalties", params(0, 0, 1, 0, 1.3f, 0.5f, 0.2f)},
      {"temperature", params(0.8f, 0, 1, 0)},
      {"top_k", params(1.0f, 40, 1, 0)},
      {"top_k_top_p", params(0.7f, 20, 0.9f, 0)},
      {"top_p", params(1.0f, 0, 0.5f, 0)},
      {"min_p", params(1.0f, 0, 1, 0.05f)},
      {"top_k_1", params(1.3f, 1, 1, 0)},
      {"all", params(1.2f, 50, 0.8f, 0.02f, 1.1f, 0.3f, 0.1f)},
  };
  const Tensor dl = dev(logits, {N, V});
  for (size_t c = 0; c < cases.size(); ++c) {
    const SamplingParams& p = cases[c].second;
    std::vector<cuda::SampleRowSpec> specs;
    for (int r = 0; r < N; ++r) specs.push_back(spec_of(p, 100 * c + r, hist, n_prompt));
    set_scratch(cuda::sample_rows_scratch_floats(specs.data(), N, V));
    std::vector<cuda::SampledToken> got(N);
    cuda::sample_rows(ctx_, dl, specs.data(), N, got.data());
    for (int r = 0; r < N; ++r) {
      Sampler host_sampler(p, -1, 100 * c + r);
      auto want = host_sampler.sample(std::span<const float>(logits.data() + size_t(r) * V, V),
                                      hist, n_prompt);
      ASSERT_TRUE(want.ok()) << want.status();
      EXPECT_EQ(got[r].token, want->token) << rows_name << " " << cases[c].first << " row " << r;
      EXPECT_NEAR(got[r].logprob, want->logprob, tol * std::max(1.0, std::abs(double(want->logprob))))
          << rows_name << " " << cases[c].first << " row " << r;
    }
  }
}

TEST_F(SamplingTest, MatchesHostSampler) {
  const int N = 9, V = 4099;  // V spans several 1024-thread scan chunks
  expect_matches_host(random_vec(size_t(N) * V, 40, 2.0f), N, V, "random");
}

// One call whose rows differ in everything: settings (greedy, sorted filters, penalties, plain
// temperature), history length (none included) and prompt length, some rows with -inf logits (a
// token the model rules out) where top-k cuts. Rows that all shared one history and one setting
// would not see a row read another's history or settings.
TEST_F(SamplingTest, RowsWithTheirOwnSettingsAndHistoriesMatchTheHost) {
  const int V = 2053;
  const std::vector<SamplingParams> row_params = {
      params(0, 0, 1, 0),
      params(1.2f, 50, 0.8f, 0.02f, 1.1f, 0.3f, 0.1f),
      params(0.8f, 0, 1, 0),
      params(0, 0, 1, 0, 1.3f, 0.5f, 0.2f),
      params(1.0f, 3, 1, 0),
      params(1.0f, 0, 0.5f, 0),
      params(1.0f, 0, 1, 0.05f, 1.0f, 0.0f, 0.4f),
      params(0.7f, 20, 0.9f, 0),
  };
  const int N = int(row_params.size());
  auto logits = random_vec(size_t(N) * V, 44, 2.0f);
  for (int r : {1, 4, 7})  // -inf on every 97th token (ruled out by the model): top-k rows too
    for (int v = 0; v < V; v += 97) logits[size_t(r) * V + size_t(v)] = -INFINITY;
  std::vector<std::vector<int>> hists(static_cast<size_t>(N));
  std::vector<int> n_prompts(static_cast<size_t>(N));
  // Each row's history holds its own best tokens (so that its penalties change its pick, and a
  // row that read another's history would pick otherwise), some of them twice.
  for (int r = 0; r < N; ++r) {
    const float* row = logits.data() + size_t(r) * V;
    std::vector<int> best(static_cast<size_t>(V));
    std::iota(best.begin(), best.end(), 0);
    std::partial_sort(best.begin(), best.begin() + 3, best.end(),
                      [&](int a, int b) { return row[a] > row[b]; });
    for (int i = 0; i < r; ++i) hists[size_t(r)].push_back(best[size_t(i % 3)]);
    n_prompts[size_t(r)] = int(hists[size_t(r)].size()) / 2;
  }
  std::vector<cuda::SampleRowSpec> specs;
  for (int r = 0; r < N; ++r)
    specs.push_back(
        spec_of(row_params[size_t(r)], 500 + r, hists[size_t(r)], n_prompts[size_t(r)]));
  set_scratch(cuda::sample_rows_scratch_floats(specs.data(), N, V));
  std::vector<cuda::SampledToken> got(static_cast<size_t>(N));
  cuda::sample_rows(ctx_, dev(logits, {N, V}), specs.data(), N, got.data());
  for (int r = 0; r < N; ++r) {
    Sampler host_sampler(row_params[size_t(r)], -1, 500 + r);
    auto want = host_sampler.sample(std::span<const float>(logits.data() + size_t(r) * V, V),
                                    hists[size_t(r)], n_prompts[size_t(r)]);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got[size_t(r)].token, want->token) << "row " << r;
    EXPECT_NEAR(got[size_t(r)].logprob, want->logprob,
                1e-4 * std::max(1.0, std::abs(double(want->logprob))))
        << "row " << r;
  }
}

TEST_F(SamplingTest, TiesAtTheFilterBoundaryMatchTheHost) {
  // Whole-number logits in [-4, 4]: hundreds of tokens share each value, so top-k, the top-p
  // prefix and the min-p cut all end inside a run of ties, which the lower ids win.
  const int N = 6, V = 2053;
  auto logits = random_vec(size_t(N) * V, 42, 2.0f);
  for (float& x : logits) x = std::round(x);
  expect_matches_host(logits, N, V, "ties");
}

// Logits near the float maximum: scaled by 1 / temperature before the shift, they overflowed
// to +inf on the host (every probability NaN, the last id drawn); both now shift first.
TEST_F(SamplingTest, HugeLogitsMatchTheHost) {
  const int N = 4, V = 1031;
  auto logits = random_vec(size_t(N) * V, 43);  // |x| < 5 here: within the float range
  for (float& x : logits) x *= 5e37f;
  expect_matches_host(logits, N, V, "huge", 1e-5);
}

TEST_F(SamplingTest, NonFiniteRowGivesNoToken) {
  const int N = 2, V = 33;
  auto logits = random_vec(size_t(N) * V, 41);
  logits[V + 5] = std::nanf("");
  std::vector<cuda::SampleRowSpec> specs(N);
  specs[0].temperature = specs[1].temperature = 0.0f;
  set_scratch(cuda::sample_rows_scratch_floats(specs.data(), N, V));
  std::vector<cuda::SampledToken> got(N);
  cuda::sample_rows(ctx_, dev(logits, {N, V}), specs.data(), N, got.data());
  EXPECT_GE(got[0].token, 0);
  EXPECT_EQ(got[1].token, -1);
}

// Large logits keep their logprob on the device as on the host: a 10-way tie at 1e8 is -ln 10
// (max + log-sum in one float lost the log-sum: 0, probability 1).
TEST_F(SamplingTest, LogprobsOfLargeLogits) {
  const int V = 64;
  std::vector<float> logits(V, 0.0f);
  for (int i = 20; i < 30; ++i) logits[size_t(i)] = 1e8f;
  const std::vector<int> hist;
  for (const float temperature : {0.0f, 1.0f}) {
    const cuda::SampleRowSpec spec = spec_of(params(temperature, 0, 1.0f, 0.0f), 7, hist, 0);
    set_scratch(cuda::sample_rows_scratch_floats(&spec, 1, V));
    cuda::SampledToken got{};
    cuda::sample_rows(ctx_, dev(logits, {1, V}), &spec, 1, &got);
    EXPECT_GE(got.token, 20);
    EXPECT_LT(got.token, 30);
    EXPECT_NEAR(got.logprob, -std::log(10.0), 1e-6) << "temperature " << temperature;
  }
}

}  // namespace
}  // namespace cemlm
