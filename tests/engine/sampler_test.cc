// Sampler on crafted logits rows: each parameter's effect, seeded determinism, logprobs under the
// unmodified distribution; StopMatcher across piece boundaries; validate_sampling names fields.
#include "cemlm/engine/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <thread>

#include "cemlm/engine/utf8.h"
#include "ref_log_softmax.h"

namespace cemlm {
namespace {

// Token 3 is the argmax; 1 is second; the rest are well below.
const std::vector<float> kRow = {0.0f, 2.0f, -1.0f, 3.0f, 0.5f, -2.0f, 1.0f, 0.2f};

SamplingParams greedy() {
  SamplingParams p;
  p.temperature = 0;
  return p;
}

int pick(const SamplingParams& p, const std::vector<float>& row = kRow,
         const std::vector<int>& tokens = {}, int n_prompt = 0, uint64_t seed = 1) {
  Sampler s(p, -1, seed);
  auto r = s.sample(row, tokens, n_prompt);
  EXPECT_TRUE(r.ok()) << r.status();
  return r->token;
}

// The set of tokens drawn over many seeds.
std::set<int> support(const SamplingParams& p, int draws = 400) {
  std::set<int> seen;
  for (int i = 0; i < draws; ++i) seen.insert(pick(p, kRow, {}, 0, uint64_t(i)));
  return seen;
}

TEST(Sampler, GreedyPicksTheArgmaxAndTopK1EqualsGreedy) {
  EXPECT_EQ(pick(greedy()), 3);
  SamplingParams p;
  p.top_k = 1;
  EXPECT_EQ(support(p), std::set<int>{3});
}

TEST(Sampler, GreedyBreaksTiesTowardTheLowestId) {
  EXPECT_EQ(pick(greedy(), {1.0f, 5.0f, 5.0f, 0.0f}), 1);
}

TEST(Sampler, TemperatureToZeroApproachesGreedy) {
  SamplingParams p;
  p.temperature = 1e-4f;
  EXPECT_EQ(support(p), std::set<int>{3});
  p.temperature = 1.0f;
  EXPECT_GT(support(p).size(), 4u);
}

// Temperatures so small that logits / T overflow fp32 sample greedily: they once made every
// probability NaN, and the draw fell through to the last token id.
TEST(Sampler, TinyTemperaturesAreGreedyNotTheLastId) {
  for (float t : {1e-6f, 1e-20f, 1e-39f, 1.4e-45f}) {
    SamplingParams p;
    p.temperature = t;
    EXPECT_EQ(support(p), std::set<int>{3}) << t;
  }
}

// Logits near the float maximum over a temperature that is not greedy: logit / T overflowed
// to +inf, every probability became NaN and the draw fell to the last id. Also with a
// repetition penalty that scales such a logit up, and through every filter.
TEST(Sampler, HugeLogitsOverASmallTemperatureDrawTheBestToken) {
  const std::vector<float> row = {-3e38f, 3e38f, 1e38f, 0.0f};
  for (float t : {0.5f, 0.01f, 1e-5f}) {
    SamplingParams p;
    p.temperature = t;
    for (int i = 0; i < 50; ++i) EXPECT_EQ(pick(p, row, {}, 0, uint64_t(i)), 1) << t;
    p.top_p = 0.9f;
    p.min_p = 0.1f;
    p.top_k = 3;
    EXPECT_EQ(pick(p, row), 1) << t;
  }
  SamplingParams p;
  p.temperature = 0.5f;
  p.repetition_penalty = 0.01f;  // 3e38 / 0.01 overflows; token 2's 1e38 too
  EXPECT_EQ(pick(p, row, {1}, 1), 1);
  EXPECT_EQ(pick(p, {-3e38f, 3e38f, 2e38f, 0.0f}, {2}, 1), 2);  // 2e38 / 0.01: the largest float
}

TEST(Sampler, TopKKeepsTheKBest) {
  SamplingParams p;
  p.top_k = 3;
  EXPECT_EQ(support(p), (std::set<int>{3, 1, 6}));
}

TEST(Sampler, TopPCutsTheTail) {
  // Probabilities of kRow: token 3 ≈ 0.58, 1 ≈ 0.21, 6 ≈ 0.079: 0.7 needs tokens 3 and 1.
  SamplingParams p;
  p.top_p = 0.7f;
  EXPECT_EQ(support(p), (std::set<int>{3, 1}));
  p.top_p = 0.5f;
  EXPECT_EQ(support(p), std::set<int>{3});
}

// The nucleus is the smallest best-first prefix whose mass *reaches* top_p: with tied logits the
// mass of k candidates is exactly k / n, and top_p = k / n keeps those k (the lowest ids).
TEST(Sampler, TopPReachedExactlyKeepsNoMoreCandidates) {
  for (int n : {2, 4, 8, 16}) {
    const std::vector<float> row(static_cast<size_t>(n), 0.5f);
    for (int k = 1; k < n; ++k) {
      SamplingParams p;
      p.top_p = float(k) / float(n);
      std::set<int> seen;
      for (int seed = 0; seed < 300; ++seed) seen.insert(pick(p, row, {}, 0, uint64_t(seed)));
      std::set<int> want;
      for (int i = 0; i < k; ++i) want.insert(i);
      EXPECT_EQ(seen, want) << "n " << n << " top_p " << p.top_p;
    }
  }
}

TEST(Sampler, MinPKeepsTokensNearTheBest) {
  // p_i / p_max = exp(x_i - 3): token 1 is at e^-1 ≈ 0.37, token 6 at e^-2 ≈ 0.14.
  SamplingParams p;
  p.min_p = 0.3f;
  EXPECT_EQ(support(p), (std::set<int>{3, 1}));
  p.min_p = 0.1f;
  EXPECT_EQ(support(p), (std::set<int>{3, 1, 6}));
  // min_p = 1 (the largest valid) keeps the best token: p ≥ 1 · p_max holds for it.
  p.min_p = 1.0f;
  EXPECT_EQ(support(p), std::set<int>{3});
  p.top_k = 2;
  EXPECT_EQ(support(p), std::set<int>{3});
}

// The documented rule written the plain way: full sort, double-precision exponentials.
int reference_draw(const std::vector<float>& row, const SamplingParams& p, uint64_t seed) {
  std::vector<std::pair<double, int>> c;
  for (size_t i = 0; i < row.size(); ++i) c.push_back({double(row[i] / p.temperature), int(i)});
  const bool filtered = p.top_k > 0 || p.top_p < 1 || p.min_p > 0;
  if (filtered)
    std::sort(c.begin(), c.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
  size_t n = p.top_k > 0 ? std::min(c.size(), size_t(p.top_k)) : c.size();
  double mx = -1e300;
  for (size_t i = 0; i < n; ++i) mx = std::max(mx, c[i].first);
  double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += (c[i].first = std::exp(c[i].first - mx));
  if (p.top_p < 1) {
    double cum = 0;
    size_t k = 0;
    while (k < n && cum < double(p.top_p) * sum) cum += c[k++].first;
    n = std::max<size_t>(k, 1);
  }
  if (p.min_p > 0) {
    size_t k = 1;
    while (k < n && c[k].first >= double(p.min_p) * c[0].first) ++k;
    n = k;
  }
  // The kept candidates, walked in id order.
  c.resize(n);
  std::sort(c.begin(), c.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  sum = 0;
  for (size_t i = 0; i < n; ++i) sum += c[i].first;
  Rng rng(seed);
  double u = rng.uniform() * sum;
  for (size_t i = 0; i + 1 < n; ++i) {
    u -= c[i].first;
    if (u < 0) return c[i].second;
  }
  return c[n - 1].second;
}

// Random rows of a real vocabulary size under every filter combination: the sampler (which selects
// the kept set without sorting it, with vectorized exponentials) draws what the plain rule does.
TEST(Sampler, FilteredDrawsMatchTheFullSortRule) {
  Rng rng(7);
  int compared = 0;
  for (int row_i = 0; row_i < 20; ++row_i) {
    std::vector<float> row(4096);
    const double spread = 1.0 + row_i % 4 * 2.0;  // flat to peaked distributions
    for (float& x : row) x = float(rng.normal() * spread);
    if (row_i >= 12 && row_i < 16)  // whole numbers: ties by the hundred, broken by id
      for (float& x : row) x = std::round(x);
    if (row_i >= 16) {
      // A few sure tokens over a long tail about 8-10 below them: the tail's mass (from ~0.1%
      // to ~half of the whole) decides whether a nucleus lies among the tokens near the best.
      for (float& x : row) x = float(-(6 + row_i % 4 * 1.5) + 0.5 * rng.normal());
      for (int i = 0; i < 5; ++i) row[size_t(rng.uniform() * 4096)] = float(rng.normal());
    }
    for (float t : {0.7f, 1.0f, 1.5f})
      for (int k : {0, 1, 40, 4095})
        for (float top_p : {1.0f, 0.9f, 0.3f})
          for (float min_p : {0.0f, 0.05f}) {
            SamplingParams p;
            p.temperature = t, p.top_k = k, p.top_p = top_p, p.min_p = min_p;
            for (uint64_t seed : {1u, 2u}) {
              ASSERT_EQ(pick(p, row, {}, 0, seed), reference_draw(row, p, seed))
                  << "row " << row_i << " T " << t << " top_k " << k << " top_p " << top_p
                  << " min_p " << min_p << " seed " << seed;
              ++compared;
            }
          }
  }
  EXPECT_EQ(compared, 20 * 3 * 4 * 3 * 2 * 2);
}

// Rows whose ids near the best hold too little of the mass for the nucleus (a few sure tokens
// over a long tail more than 8 below them, a flat row as a random-init model's): the candidates
// come from the top probability buckets, and the draws still are the plain rule's, over many
// seeds, so that a draw landing in any part of the nucleus would show one left out or added.
TEST(Sampler, NucleusBeyondTheBandMatchesTheFullSortRule) {
  Rng rng(17);
  int beyond_the_band = 0;
  for (int row_i = 0; row_i < 4; ++row_i) {
    std::vector<float> row(8192);
    for (float& x : row) x = row_i < 2 ? float(-11 + 2 * rng.uniform()) : float(rng.normal() * 3);
    if (row_i < 2)
      for (int k = 0; k <= row_i; ++k) row[size_t(rng.uniform() * double(row.size()))] = 0;
    const float best = *std::max_element(row.begin(), row.end());
    for (float top_p : {0.9f, 0.95f}) {
      SamplingParams p;
      p.temperature = 1, p.top_p = top_p;
      for (uint64_t seed = 1; seed <= 60; ++seed) {
        const int want = reference_draw(row, p, seed);
        ASSERT_EQ(pick(p, row, {}, 0, seed), want)
            << "row " << row_i << " top_p " << top_p << " seed " << seed;
        beyond_the_band += row[size_t(want)] < best - 8;
      }
    }
  }
  EXPECT_GT(beyond_the_band, 25);  // the draws reach past the band (39 of 480)
}

// Penalties, logit bias and min_new_tokens before the filters, on random rows, histories and
// parameters: the draw is the documented rule's (reference_draw on the penalized row, the
// argmax when greedy) and the logprob the raw row's.
TEST(Sampler, PenaltiesBiasAndMinNewTokensThenFiltersFollowTheDocumentedOrder) {
  Rng rng(11);
  int compared = 0;
  for (int row_i = 0; row_i < 200; ++row_i) {
    const int V = 50 + row_i % 7 * 30;
    std::vector<float> logits(static_cast<size_t>(V));
    for (float& x : logits) x = float(rng.normal() * (1 + row_i % 3));
    const int n_prompt = int(rng.uniform() * 10), n = n_prompt + int(rng.uniform() * 20);
    std::vector<int> toks;
    for (int i = 0; i < n; ++i) toks.push_back(int(rng.uniform() * V));
    SamplingParams p;
    p.temperature = row_i % 5 == 0 ? 0.0f : float(0.3 + rng.uniform() * 1.5);
    p.top_k = row_i % 4 == 0 ? 0 : int(rng.uniform() * V);
    p.top_p = row_i % 3 == 0 ? 1.0f : float(0.2 + rng.uniform() * 0.8);
    p.min_p = row_i % 2 == 0 ? 0.0f : float(rng.uniform() * 0.3);
    p.repetition_penalty = float(0.5 + rng.uniform() * 2);
    p.presence_penalty = float(rng.uniform() * 4 - 2);
    p.frequency_penalty = float(rng.uniform() * 4 - 2);
    const int eos = int(rng.uniform() * V);
    p.stop_token_ids = {int(rng.uniform() * V)};
    p.min_new_tokens = row_i % 2 ? 100 : 0;
    p.max_new_tokens = 200;
    std::set<int> biased;
    for (int j = 0; j < 5; ++j)
      if (const int id = int(rng.uniform() * V); biased.insert(id).second)
        p.logit_bias.push_back({id, float(rng.uniform() * 20 - 10)});
    ASSERT_TRUE(validate_sampling(p, V, eos).ok());
    std::vector<float> w = logits;
    for (int t : std::set<int>(toks.begin(), toks.end())) {
      float& x = w[size_t(t)];
      x = x > 0 ? x / p.repetition_penalty : x * p.repetition_penalty;
    }
    std::map<int, int> count;
    for (int i = n_prompt; i < n; ++i) ++count[toks[size_t(i)]];
    for (auto [t, c] : count) w[size_t(t)] -= p.presence_penalty + p.frequency_penalty * float(c);
    for (auto [id, b] : p.logit_bias) w[size_t(id)] += b;
    if (n - n_prompt < p.min_new_tokens)
      w[size_t(eos)] = w[size_t(p.stop_token_ids[0])] = -INFINITY;
    for (uint64_t seed : {1u, 2u, 3u}) {
      auto r = Sampler(p, eos, seed).sample(logits, toks, n_prompt);
      ASSERT_TRUE(r.ok());
      const int want = p.temperature == 0 ? int(std::max_element(w.begin(), w.end()) - w.begin())
                                          : reference_draw(w, p, seed);
      ASSERT_EQ(r->token, want) << "row " << row_i << " seed " << seed;
      ASSERT_NEAR(r->logprob, testing_ref::log_softmax(logits, r->token), 1e-5);
      ++compared;
    }
  }
  EXPECT_EQ(compared, 600);
}

TEST(Sampler, RepetitionPenaltyCoversPromptAndGenerated) {
  SamplingParams p = greedy();
  p.repetition_penalty = 2.0f;  // token 3: 3 → 1.5, below token 1's 2
  EXPECT_EQ(pick(p, kRow, {3}, 1), 1);     // in the prompt
  EXPECT_EQ(pick(p, kRow, {0, 3}, 1), 1);  // generated
  EXPECT_EQ(pick(p, kRow, {3, 3, 3}, 3), 1);  // applied once per distinct token
  // A negative logit is multiplied (pushed down), not divided: -0.6 → -1.2 < -1.
  EXPECT_EQ(pick(p, {-0.6f, -1.0f}, {0}, 1), 1);
  p.repetition_penalty = 1.2f;  // token 3 once: 2.5 > 2; it would be 1.74 < 2 if paid thrice
  EXPECT_EQ(pick(p, kRow, {3, 3, 3}, 3), 3);
  EXPECT_EQ(pick(p, kRow, {0, 3, 3, 3}, 1), 3);
}

TEST(Sampler, PresenceAndFrequencyPenaltiesCountGeneratedTokensOnly) {
  SamplingParams p = greedy();
  p.presence_penalty = 1.5f;  // token 3: 3 → 1.5 < 2
  EXPECT_EQ(pick(p, kRow, {3}, 1), 3);  // prompt tokens are not penalized
  EXPECT_EQ(pick(p, kRow, {0, 3}, 1), 1);
  p = greedy();
  p.frequency_penalty = 0.6f;  // once: 2.4 > 2; twice: 1.8 < 2
  EXPECT_EQ(pick(p, kRow, {0, 3}, 1), 3);
  EXPECT_EQ(pick(p, kRow, {0, 3, 3}, 1), 1);
  p.frequency_penalty = -1.0f;  // negative values encourage repeats
  EXPECT_EQ(pick(p, kRow, {0, 5, 5, 5, 5, 5, 5}, 1), 5);
}

// The presence penalty is paid once per distinct generated token, however often it repeats; the
// frequency penalty once per occurrence.
TEST(Sampler, PresencePenaltyIsPaidOncePerDistinctToken) {
  SamplingParams p = greedy();
  p.presence_penalty = 0.6f;  // token 3: 3 → 2.4 > 2 however many times it was generated
  EXPECT_EQ(pick(p, kRow, {0, 3, 3}, 1), 3);
  EXPECT_EQ(pick(p, kRow, {0, 3, 3, 3, 3}, 1), 3);
  p.frequency_penalty = 0.3f;  // twice: 3 − (0.6 + 2 · 0.3) = 1.8 < 2; once: 2.1 > 2
  EXPECT_EQ(pick(p, kRow, {0, 3, 3}, 1), 1);
  EXPECT_EQ(pick(p, kRow, {0, 3}, 1), 3);
}

// A request's sampler draws every token of its stream: each call penalizes the tokens it is given,
// whatever the calls before it saw.
TEST(Sampler, PenaltiesApplyAtEveryCallOfOneSampler) {
  SamplingParams p = greedy();
  p.repetition_penalty = 2.0f;
  Sampler s(p, -1, 1);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(s.sample(kRow, std::vector<int>{3}, 1)->token, 1) << i;
  p = greedy();
  p.presence_penalty = 1.5f;
  Sampler t(p, -1, 1);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(t.sample(kRow, std::vector<int>{0, 3}, 1)->token, 1) << i;
  EXPECT_EQ(t.sample(kRow, std::vector<int>{0, 6}, 1)->token, 3);  // 3 no longer generated
}

TEST(Sampler, SameSeedSameTokensAndTheRngIsPerSampler) {
  SamplingParams p;
  p.seed = 42;
  Sampler a(p, -1, 42), b(p, -1, 42), c(p, -1, 43);
  std::vector<int> ta, tb, tc;
  for (int i = 0; i < 50; ++i) {
    ta.push_back(a.sample(kRow, {}, 0)->token);
    // Interleaving another sampler must not disturb b's sequence.
    ASSERT_TRUE(c.sample(kRow, {}, 0).ok());
    tb.push_back(b.sample(kRow, {}, 0)->token);
  }
  EXPECT_EQ(ta, tb);
  Sampler d(p, -1, 43);
  for (int i = 0; i < 50; ++i) tc.push_back(d.sample(kRow, {}, 0)->token);
  EXPECT_NE(ta, tc);
}

// Samplers share their buffers with every other sampler on the same thread (vocabulary-sized,
// one set a thread): samplers of different vocabularies, penalties and filters drawing in turn on
// one thread give what each gives alone on a thread of its own.
TEST(Sampler, SamplersTakingTurnsOnOneThreadDrawAsAlone) {
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  struct Case {
    int V;
    SamplingParams p;
    std::vector<float> row;
  };
  std::vector<Case> cases(3);
  cases[0].V = 1000, cases[0].p.repetition_penalty = 1.8f, cases[0].p.top_p = 0.7f;
  cases[1].V = 300, cases[1].p.presence_penalty = 1.0f, cases[1].p.frequency_penalty = 0.5f;
  cases[1].p.top_k = 20, cases[1].p.top_logprobs = 5;
  cases[2].V = 50, cases[2].p.min_p = 0.1f, cases[2].p.top_k = 10, cases[2].p.temperature = 2;
  for (Case& c : cases)
    for (int i = 0; i < c.V; ++i) c.row.push_back(normal(gen));
  constexpr int kDraws = 40;
  // The tokens (each fed back, so that the penalties count them) and top alternatives.
  auto run = [&](const std::vector<size_t>& order, std::vector<std::vector<int>>* tokens,
                 std::vector<std::vector<int>>* tops) {
    std::vector<Sampler> samplers;
    for (const Case& c : cases) samplers.emplace_back(c.p, -1, 11);
    tokens->assign(cases.size(), {0, 1, 2, 3});  // a prompt of 4
    tops->assign(cases.size(), {});
    for (int d = 0; d < kDraws; ++d)
      for (size_t i : order) {
        auto r = samplers[i].sample(cases[i].row, (*tokens)[i], 4);
        ASSERT_TRUE(r.ok()) << r.status();
        (*tokens)[i].push_back(r->token);
        for (const TopLogprob& t : r->top) (*tops)[i].push_back(t.token_id);
      }
  };
  std::vector<std::vector<int>> together, together_top;
  run({0, 1, 2}, &together, &together_top);
  for (size_t i = 0; i < cases.size(); ++i) {
    std::vector<std::vector<int>> alone, alone_top;
    std::thread([&] { run({i}, &alone, &alone_top); }).join();  // fresh buffers
    EXPECT_EQ(together[i], alone[i]) << i;
    EXPECT_EQ(together_top[i], alone_top[i]) << i;
  }
  EXPECT_EQ(together_top[1].size(), size_t(5 * kDraws));
}

// Each draw of a sampler takes exactly one uniform from its RNG, whatever token it picks: the
// tokens of one sampler follow the plain rule over the RNG's successive uniforms.
TEST(Sampler, EachDrawTakesExactlyOneUniform) {
  SamplingParams p;
  p.temperature = 1.0f;
  Sampler s(p, -1, 99);
  Rng rng(99);
  double mx = -1e300, sum = 0;
  for (float x : kRow) mx = std::max(mx, double(x));
  std::vector<double> prob;
  for (float x : kRow) sum += prob.emplace_back(std::exp(double(x) - mx));
  std::set<int> seen;
  for (int i = 0; i < 200; ++i) {
    double u = rng.uniform() * sum;
    int want = int(kRow.size()) - 1;
    for (size_t id = 0; id + 1 < kRow.size(); ++id)
      if ((u -= prob[id]) < 0) {
        want = int(id);
        break;
      }
    const auto r = s.sample(kRow, {}, 0);
    ASSERT_TRUE(r.ok());
    ASSERT_EQ(r->token, want) << "draw " << i;
    seen.insert(want);
  }
  EXPECT_GT(seen.size(), 4u);
}

TEST(Sampler, LogprobIsUnderTheUnmodifiedDistribution) {
  SamplingParams p = greedy();
  p.repetition_penalty = 10.0f;
  p.top_logprobs = 3;
  Sampler s(p, -1, 1);
  auto r = s.sample(kRow, std::vector<int>{3}, 1);
  ASSERT_TRUE(r.ok());
  const double lse = double(testing_ref::log_sum_exp(kRow));
  EXPECT_EQ(r->token, 1);
  EXPECT_NEAR(r->logprob, 2.0f - lse, 1e-6);
  ASSERT_EQ(r->top.size(), 3u);
  EXPECT_EQ(r->top[0].token_id, 3);
  EXPECT_NEAR(r->top[0].logprob, 3.0f - lse, 1e-6);
  EXPECT_EQ(r->top[1].token_id, 1);
  EXPECT_EQ(r->top[2].token_id, 6);
  // More alternatives asked for than the vocabulary has: all of them, best first.
  p.top_logprobs = 20;
  Sampler all(p, -1, 1);
  r = all.sample(kRow, {}, 0);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->top.size(), kRow.size());
  EXPECT_EQ(r->top[0].token_id, 3);
  EXPECT_EQ(r->top.back().token_id, 5);
  EXPECT_NEAR(r->top.back().logprob, -2.0f - lse, 1e-6);
  double total = 0;
  for (float x : kRow) total += std::exp(double(x) - lse);
  // A chosen token that was penalized still reports its unmodified logprob, greedy or sampled.
  p = greedy();
  p.presence_penalty = 0.5f;  // token 3: 3 → 2.5, still the best
  r = Sampler(p, -1, 1).sample(kRow, std::vector<int>{0, 3}, 1);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->token, 3);
  EXPECT_NEAR(r->logprob, 3.0f - lse, 1e-6);
  p.temperature = 0.5f;
  p.top_k = 1;
  r = Sampler(p, -1, 1).sample(kRow, std::vector<int>{0, 3}, 1);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->token, 3);
  EXPECT_NEAR(r->logprob, 3.0f - lse, 1e-6);
  EXPECT_NEAR(total, 1.0, 1e-5);
}

// The alternatives are the best by logit, ties to the lower id, best first, on random rows with
// ties by the hundred and on rows that rise with the id (each id displaces the worst so far).
TEST(Sampler, TopAlternativesAreTheFullSortsFirst) {
  Rng rng(13);
  for (int row_i = 0; row_i < 12; ++row_i) {
    std::vector<float> row(4096);
    for (size_t i = 0; i < row.size(); ++i)
      row[i] = row_i < 8 ? float(std::round(rng.normal() * 3)) : float(i % (1000 * row_i)) * 1e-3f;
    std::vector<int> order(row.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return row[size_t(a)] > row[size_t(b)]; });
    for (int k : {1, 5, 20}) {
      SamplingParams p = greedy();
      p.top_logprobs = k;
      auto r = Sampler(p, -1, 1).sample(row, {}, 0);
      ASSERT_TRUE(r.ok());
      ASSERT_EQ(r->top.size(), size_t(k));
      for (int i = 0; i < k; ++i)
        ASSERT_EQ(r->top[size_t(i)].token_id, order[size_t(i)])
            << "row " << row_i << " k " << k << " rank " << i;
    }
  }
}

// Large logits keep their logprobs: a 10-way tie at 1e8 is −ln 10 for each, the chosen token
// and the alternatives alike (taken as max + log Σ in one float, log Σ was lost: 0, probability
// 1); and logits that span more than a float holds give −inf, not NaN, to the hopeless tokens.
TEST(Sampler, LogprobsOfLargeLogits) {
  std::vector<float> row(64, 0.0f);
  for (int i = 20; i < 30; ++i) row[size_t(i)] = 1e8f;
  SamplingParams p;
  p.temperature = 1;
  p.top_logprobs = 12;
  for (uint64_t seed : {1u, 2u, 3u}) {
    auto r = Sampler(p, -1, seed).sample(row, {}, 0);
    ASSERT_TRUE(r.ok());
    EXPECT_GE(r->token, 20);
    EXPECT_LT(r->token, 30);
    EXPECT_NEAR(r->logprob, -std::log(10.0), 1e-6);
    ASSERT_EQ(r->top.size(), 12u);
    for (int i = 0; i < 10; ++i) EXPECT_NEAR(r->top[size_t(i)].logprob, -std::log(10.0), 1e-6);
    EXPECT_EQ(r->top[10].logprob, -1e8f);
  }
  row.assign(4, -std::numeric_limits<float>::max());
  row[2] = std::numeric_limits<float>::max();
  p.top_logprobs = 4;
  auto r = Sampler(p, -1, 1).sample(row, {}, 0);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->token, 2);
  EXPECT_EQ(r->logprob, 0.0f);
  EXPECT_EQ(r->top[3].logprob, -INFINITY);
}

TEST(Sampler, NonFiniteLogitsAreAnError) {
  Sampler s(greedy(), -1, 1);
  auto r = s.sample(std::vector<float>{0.0f, NAN, 1.0f}, {}, 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal);
  r = s.sample(std::vector<float>{0.0f, INFINITY}, {}, 0);
  EXPECT_FALSE(r.ok());
  // -inf marks an impossible token and is fine.
  r = s.sample(std::vector<float>{-INFINITY, 1.0f}, {}, 0);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->token, 1);
}

TEST(Sampler, StopTokensAndEos) {
  SamplingParams p;
  p.stop_token_ids = {5, 6};
  Sampler s(p, 2, 1);
  EXPECT_TRUE(s.is_stop_token(2));
  EXPECT_TRUE(s.is_stop_token(5));
  EXPECT_FALSE(s.is_stop_token(3));
  p.ignore_eos = true;
  Sampler t(p, 2, 1);
  EXPECT_FALSE(t.is_stop_token(2));
  EXPECT_TRUE(t.is_stop_token(6));
}

TEST(Sampler, LogitBiasMovesTheDrawNotTheLogprob) {
  const double lse = double(testing_ref::log_sum_exp(kRow));
  SamplingParams p = greedy();
  p.logit_bias = {{5, 100.0f}};  // the worst token (-2) forced
  auto r = Sampler(p, -1, 1).sample(kRow, {}, 0);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->token, 5);
  EXPECT_NEAR(r->logprob, -2.0f - lse, 1e-6);  // the unmodified distribution's
  p.logit_bias = {{3, -100.0f}};               // the best banned: the second best
  EXPECT_EQ(pick(p), 1);
  p.logit_bias = {{3, -0.5f}, {1, 0.6f}};  // 2.5 against 2.6
  EXPECT_EQ(pick(p), 1);
  // Sampled: -100 takes a token out of the support; every other token is still drawn.
  p.temperature = 1;
  p.logit_bias = {{3, -100.0f}, {1, -100.0f}};
  EXPECT_EQ(support(p, 2000), (std::set<int>{0, 2, 4, 5, 6, 7}));
  // After the penalties: a repetition penalty below 1 does not shrink a ban, so -100 still holds.
  p.repetition_penalty = 0.01f;
  p.logit_bias = {{5, -100.0f}};
  for (uint64_t seed = 0; seed < 500; ++seed)
    EXPECT_NE(pick(p, kRow, {5}, 1, seed), 5) << "seed " << seed;
}

// The bias is added before the temperature, so it is divided by it with the logits: -100 bans a
// token at ordinary temperatures, but at 1000 it moves the logit by 0.1 and the token stays in
// the draw (docs/API.md says so; it once said -100 bans a token whatever the temperature).
TEST(Sampler, LogitBiasIsScaledByTheTemperature) {
  SamplingParams p;
  p.logit_bias = {{3, -100.0f}};
  p.temperature = 2;
  EXPECT_EQ(support(p, 2000).count(3), 0u);
  p.temperature = 1000;
  EXPECT_EQ(support(p, 2000).count(3), 1u);
}

// The shares of a biased draw are those of softmax(logits + bias): counts over many seeds against
// the exact probabilities (a 4.5-sigma band per token).
TEST(Sampler, LogitBiasGivesTheBiasedDistribution) {
  SamplingParams p;
  p.logit_bias = {{5, 4.0f}, {3, -1.5f}};
  std::vector<double> want(kRow.size());
  double z = 0;
  for (size_t i = 0; i < kRow.size(); ++i) {
    double x = kRow[i];
    for (const auto& [id, b] : p.logit_bias) x += id == int(i) ? b : 0;
    z += want[i] = std::exp(x);
  }
  const int n = 20000;
  std::vector<int> count(kRow.size(), 0);
  for (int i = 0; i < n; ++i) ++count[size_t(pick(p, kRow, {}, 0, uint64_t(i)))];
  for (size_t i = 0; i < kRow.size(); ++i) {
    const double q = want[i] / z, sd = std::sqrt(n * q * (1 - q));
    EXPECT_NEAR(count[i], n * q, 4.5 * sd + 1) << "token " << i;
  }
}

// Before min_new_tokens generated tokens, end-of-sequence and the stop ids are not drawn, greedy
// or sampled, filtered or not; from then on they are. Tokens given as the prompt do not count.
TEST(Sampler, MinNewTokensHoldsBackTheStopTokens) {
  SamplingParams p = greedy();
  p.min_new_tokens = 2;
  p.stop_token_ids = {1};
  const int eos = 3;  // the argmax; 1 is the second best
  auto draw = [&](const SamplingParams& q, int generated, uint64_t seed = 1) {
    std::vector<int> tokens = {0, 0, 0};  // the prompt
    tokens.resize(3 + size_t(generated), 4);
    auto r = Sampler(q, eos, seed).sample(kRow, tokens, 3);
    EXPECT_TRUE(r.ok());
    return r.ok() ? r->token : -1;
  };
  EXPECT_EQ(draw(p, 0), 6);  // 3 and 1 held back: the third best
  EXPECT_EQ(draw(p, 1), 6);
  EXPECT_EQ(draw(p, 2), 3);
  p.ignore_eos = true;  // eos is then an ordinary token
  EXPECT_EQ(draw(p, 0), 3);
  p.ignore_eos = false;
  {  // the reported logprob stays the unmodified one
    auto r = Sampler(p, eos, 1).sample(kRow, std::vector<int>{0}, 1);
    ASSERT_TRUE(r.ok());
    EXPECT_NEAR(r->logprob, double(1.0L - testing_ref::log_sum_exp(kRow)), 1e-6);
  }
  for (const int top_k : {0, 2}) {
    p.temperature = 1, p.top_k = top_k;
    std::set<int> seen;
    for (uint64_t seed = 0; seed < 400; ++seed) seen.insert(draw(p, 1, seed));
    EXPECT_EQ(seen.count(3) + seen.count(1), 0u) << "top_k " << top_k;
    EXPECT_GT(seen.size(), top_k ? 1u : 4u) << "top_k " << top_k;
  }
}

// A held-back token that is the last id is not drawn either (the draw's fall-through, for a sum
// rounded above the tokens' shares, lands on the last id with a share, not on the last id).
TEST(Sampler, AHeldBackLastIdIsNotDrawn) {
  SamplingParams p;
  p.min_new_tokens = 1;
  const std::vector<float> flat(16, 0.0f);
  for (uint64_t seed = 0; seed < 3000; ++seed) {
    auto r = Sampler(p, 15, seed).sample(flat, {}, 0);
    ASSERT_TRUE(r.ok());
    ASSERT_NE(r->token, 15) << "seed " << seed;
  }
}

// When the model gives probability 0 (-inf) to every token min_new_tokens leaves, nothing can be
// drawn: an error naming min_new_tokens, greedy or sampled, penalized or not. (Before, the draw
// fell through to a held-back stop token, or took a token of probability 0.)
TEST(Sampler, NothingLeftToDrawUnderMinNewTokensIsAnError) {
  const std::vector<float> row = {-INFINITY, -INFINITY, 0.0f};  // all on the eos, 2
  for (const float temperature : {0.0f, 1.0f})
    for (const float repetition : {1.0f, 1.5f}) {
      SamplingParams p;
      p.temperature = temperature;
      p.repetition_penalty = repetition;
      p.presence_penalty = repetition - 1;
      p.min_new_tokens = 1;
      ASSERT_TRUE(validate_sampling(p, 3, 2).ok());
      auto r = Sampler(p, 2, 1).sample(row, std::vector<int>{0, 1}, 2);
      ASSERT_FALSE(r.ok()) << "temperature " << temperature << " repetition " << repetition
                           << ": drew " << r->token;
      EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_NE(r.status().message().find("min_new_tokens"), std::string::npos);
    }
  // A finite logit that a penalty takes past the float range is clamped, not taken out: it is
  // still the model's only token with a probability.
  const std::vector<float> huge = {-INFINITY, -1e37f, -INFINITY};
  for (const float temperature : {0.0f, 1.0f}) {
    SamplingParams q;
    q.temperature = temperature;
    q.repetition_penalty = 100;
    auto r = Sampler(q, -1, 1).sample(huge, std::vector<int>{1}, 1);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->token, 1) << "temperature " << temperature;
    q.min_new_tokens = 1;
    r = Sampler(q, 0, 1).sample(huge, std::vector<int>{1}, 1);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->token, 1) << "temperature " << temperature;
  }
  // One token left with a probability: it is the only one drawn, penalized or not.
  const std::vector<float> one = {-INFINITY, -30.0f, 0.0f};
  SamplingParams p;
  p.min_new_tokens = 1;
  p.repetition_penalty = 1.5f;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    auto r = Sampler(p, 2, seed).sample(one, std::vector<int>{0, 1}, 2);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->token, 1) << "seed " << seed;
  }
}

TEST(StopMatcher, MatchesAcrossPiecesAndHoldsBackPossiblePrefixes) {
  StopMatcher m({"END", "xyz"});
  bool stopped = false;
  EXPECT_EQ(m.push("hello E", &stopped), "hello ");  // "E" may start "END"
  EXPECT_FALSE(stopped);
  EXPECT_EQ(m.push("N", &stopped), "");
  EXPECT_EQ(m.push("Dtail", &stopped), "");
  EXPECT_TRUE(stopped);

  StopMatcher n({"END"});
  EXPECT_EQ(n.push("EN", &stopped), "");
  EXPECT_EQ(n.push("x", &stopped), "ENx");  // resolved: not a stop string
  EXPECT_EQ(n.push("ab EN", &stopped), "ab ");
  EXPECT_EQ(n.flush(), "EN");
}

TEST(StopMatcher, CutsAtTheEarliestStopString) {
  StopMatcher m({"bc", "a"});
  bool stopped = false;
  EXPECT_EQ(m.push("xbca", &stopped), "x");
  EXPECT_TRUE(stopped);
  // "bc" completes inside "abcd": it wins however the text arrives.
  for (const std::vector<std::string>& pieces :
       {std::vector<std::string>{"abcd"}, {"ab", "c", "d"}, {"a", "bcd"}, {"abc", "d"}}) {
    StopMatcher both({"abcd", "bc"});
    std::string out;
    for (const std::string& piece : pieces) {
      out += both.push(piece, &stopped);
      if (stopped) break;
    }
    EXPECT_TRUE(stopped);
    EXPECT_EQ(out, "a") << pieces.size() << " pieces";
  }
  // Two ending together: the longer one (which starts first) wins.
  for (const std::vector<std::string>& stops :
       {std::vector<std::string>{"bc", "abc"}, std::vector<std::string>{"abc", "bc"}}) {
    StopMatcher same_end(stops);
    EXPECT_EQ(same_end.push("xabcd", &stopped), "x") << stops[0];
    EXPECT_TRUE(stopped);
  }
  StopMatcher none({});
  EXPECT_EQ(none.push("anything", &stopped), "anything");
  EXPECT_FALSE(stopped);
}

// Random stop strings (multi-byte characters included) over texts split at random: the output
// is the whole text cut before the stop string that ends first (the longer on a tie), never
// depends on the split, stops at the piece that completes it, and each piece is valid UTF-8.
TEST(StopMatcher, RandomSplitsGiveTheWholeTextsCut) {
  std::mt19937 rng(5);
  const std::vector<std::string> alphabet = {"a", "b", "\xC3\xA9", "\xE2\x82\xAC", "ab"};
  auto random_text = [&](int most) {
    std::string s;
    for (int i = 0, n = 1 + int(rng() % unsigned(most)); i < n; ++i)
      s += alphabet[rng() % alphabet.size()];
    return s;
  };
  int stops_seen = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::vector<std::string> stops, pieces;
    // Long ones too, over a small alphabet, so the automata fall back through nested borders.
    for (int i = 0, n = int(rng() % 4); i < n; ++i) stops.push_back(random_text(iter % 3 ? 4 : 12));
    for (int i = 0, n = 1 + int(rng() % 8); i < n; ++i)
      pieces.push_back(rng() % 5 == 0 ? std::string() : random_text(3));
    std::string text;
    for (const std::string& piece : pieces) text += piece;
    size_t cut = std::string::npos, end = std::string::npos;
    for (const std::string& s : stops)
      if (const size_t at = text.find(s); at != std::string::npos)
        if (at + s.size() < end || (at + s.size() == end && at < cut))
          cut = at, end = at + s.size();
    StopMatcher m(stops);
    std::string out;
    bool stopped = false;
    size_t fed = 0, last = 0;
    for (const std::string& piece : pieces) {
      const std::string o = m.push(piece, &stopped);
      ASSERT_TRUE(is_valid_utf8(o)) << "iter " << iter;
      out += o;
      fed += last = piece.size();
      if (stopped) break;
      // Emitted at once: all but the longest tail of the text so far that a stop string starts.
      size_t held = 0;
      for (const std::string& s : stops)
        for (size_t k = std::min(s.size() - 1, fed); k > held; --k)
          if (text.compare(fed - k, k, s, 0, k) == 0) held = k;
      ASSERT_EQ(out, text.substr(0, fed - held)) << "iter " << iter;
    }
    if (!stopped) out += m.flush();
    ASSERT_EQ(out, text.substr(0, cut)) << "iter " << iter;
    ASSERT_EQ(stopped, cut != std::string::npos) << "iter " << iter;
    if (stopped) {
      ++stops_seen;
      ASSERT_TRUE(fed - last < end && end <= fed) << "iter " << iter;
    }
  }
  EXPECT_GT(stops_seen, 1000);
}

// ---- validate_sampling ----

std::string error_of(const SamplingParams& p) {
  const absl::Status st = validate_sampling(p, 100);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  return std::string(st.message());
}

TEST(ValidateSampling, DefaultsAreValid) { EXPECT_TRUE(validate_sampling({}, 100).ok()); }

// Every documented bound is itself accepted.
TEST(ValidateSampling, EveryBoundIsAccepted) {
  const std::vector<std::function<void(SamplingParams&)>> cases = {
      [](SamplingParams& p) { p.temperature = 0; },
      [](SamplingParams& p) { p.top_k = 0; },
      [](SamplingParams& p) { p.top_p = 1; },
      [](SamplingParams& p) { p.min_p = 1; },
      [](SamplingParams& p) { p.min_p = 0; },
      [](SamplingParams& p) { p.repetition_penalty = 0.01f; },
      [](SamplingParams& p) { p.repetition_penalty = 100; },
      [](SamplingParams& p) { p.presence_penalty = -2, p.frequency_penalty = 2; },
      [](SamplingParams& p) { p.presence_penalty = 2, p.frequency_penalty = -2; },
      [](SamplingParams& p) { p.max_new_tokens = 1; },
      [](SamplingParams& p) { p.top_logprobs = kMaxTopLogprobs; },
      [](SamplingParams& p) { p.stop.assign(kMaxStopStrings, "x"); },
      [](SamplingParams& p) { p.stop = {std::string(kMaxStopBytes, 'a')}; },
      [](SamplingParams& p) {
        p.stop_token_ids = {0, 99};
      },
      [](SamplingParams& p) { p.stop_token_ids.assign(kMaxStopTokenIds, 7); },
      [](SamplingParams& p) { p.min_new_tokens = p.max_new_tokens; },
      [](SamplingParams& p) {
        p.logit_bias = {{0, -100.0f}, {99, 100.0f}};
      },
      [](SamplingParams& p) {  // every id of the vocabulary once
        for (int i = 0; i < 100; ++i) p.logit_bias.push_back({i, 1.0f});
      },
      // Every id but one ends generation: min_new_tokens still leaves that one.
      [](SamplingParams& p) {
        p.min_new_tokens = 3;
        for (int i = 0; i < 99; ++i) p.stop_token_ids.push_back(i);
      },
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SamplingParams p;
    cases[i](p);
    EXPECT_TRUE(validate_sampling(p, 100).ok()) << "case " << i << ": " << validate_sampling(p, 100);
  }
  SamplingParams p;  // as many biases as allowed, in a larger vocabulary
  for (int i = 0; i < kMaxLogitBias; ++i) p.logit_bias.push_back({i, -1.0f});
  EXPECT_TRUE(validate_sampling(p, 4096).ok()) << validate_sampling(p, 4096);
}

TEST(ValidateSampling, EveryBadFieldIsNamed) {
  const std::vector<std::pair<std::string, std::function<void(SamplingParams&)>>> cases = {
      {"sampling.temperature", [](SamplingParams& p) { p.temperature = -0.1f; }},
      {"sampling.temperature", [](SamplingParams& p) { p.temperature = NAN; }},
      {"sampling.temperature", [](SamplingParams& p) { p.temperature = INFINITY; }},
      {"sampling.top_k", [](SamplingParams& p) { p.top_k = -1; }},
      {"sampling.top_p must be in (0, 1]", [](SamplingParams& p) { p.top_p = 0; }},
      {"sampling.top_p", [](SamplingParams& p) { p.top_p = 1.5f; }},
      {"sampling.top_p", [](SamplingParams& p) { p.top_p = NAN; }},
      {"sampling.min_p", [](SamplingParams& p) { p.min_p = -0.5f; }},
      {"sampling.min_p", [](SamplingParams& p) { p.min_p = NAN; }},
      {"sampling.repetition_penalty", [](SamplingParams& p) { p.repetition_penalty = 0; }},
      {"sampling.repetition_penalty must be in [0.01, 100]",
       [](SamplingParams& p) { p.repetition_penalty = 1e-30f; }},
      {"sampling.repetition_penalty", [](SamplingParams& p) { p.repetition_penalty = INFINITY; }},
      {"sampling.presence_penalty", [](SamplingParams& p) { p.presence_penalty = 2.5f; }},
      {"sampling.presence_penalty", [](SamplingParams& p) { p.presence_penalty = NAN; }},
      {"sampling.frequency_penalty", [](SamplingParams& p) { p.frequency_penalty = -3; }},
      {"sampling.frequency_penalty", [](SamplingParams& p) { p.frequency_penalty = NAN; }},
      {"sampling.max_new_tokens", [](SamplingParams& p) { p.max_new_tokens = 0; }},
      {"sampling.top_logprobs", [](SamplingParams& p) { p.top_logprobs = 21; }},
      {"sampling.top_logprobs", [](SamplingParams& p) { p.top_logprobs = -1; }},
      {"sampling.stop has 17", [](SamplingParams& p) { p.stop.assign(17, "x"); }},
      {"sampling.stop[1] is empty (it would stop at once); remove it",
       [](SamplingParams& p) {
         p.stop = {"a", ""};
       }},
      {"sampling.stop[0] is not valid UTF-8 (bad byte at offset 2)",
       [](SamplingParams& p) { p.stop = {"ab\xff"}; }},
      {"sampling.stop[1] is 1025 bytes; at most 1024",
       [](SamplingParams& p) {
         p.stop = {std::string(1024, 'a'), std::string(1025, 'b')};
       }},
      {"sampling.stop_token_ids[1] = 100",
       [](SamplingParams& p) {
         p.stop_token_ids = {1, 100};
       }},
      {"sampling.stop_token_ids[0] = -1", [](SamplingParams& p) { p.stop_token_ids = {-1}; }},
      // A client's 4 million ids held ~300 MB and were scanned at every token (a fuzzing run).
      {"sampling.stop_token_ids has 1025 ids; at most 1024",
       [](SamplingParams& p) { p.stop_token_ids.assign(1025, 7); }},
      {"sampling.min_new_tokens must be in [0, sampling.max_new_tokens = 64] (got 65)",
       [](SamplingParams& p) { p.min_new_tokens = 65; }},
      {"sampling.min_new_tokens must be in [0, sampling.max_new_tokens = 64] (got -1)",
       [](SamplingParams& p) { p.min_new_tokens = -1; }},
      {"sampling.logit_bias has the key 100, not a token id in [0, 100)",
       [](SamplingParams& p) {
         p.logit_bias = {{3, 1.0f}, {100, 1.0f}};
       }},
      {"sampling.logit_bias has the key -1",
       [](SamplingParams& p) {
         p.logit_bias = {{-1, 1.0f}};
       }},
      {"sampling.logit_bias has the token id 7 more than once",
       [](SamplingParams& p) {
         p.logit_bias = {{7, 1.0f}, {8, 1.0f}, {7, 2.0f}};
       }},
      {"sampling.logit_bias[7] must be in [-100, 100] (got 100.00001)",
       [](SamplingParams& p) {
         p.logit_bias = {{7, 100.00001f}};
       }},
      {"sampling.logit_bias[7] must be in [-100, 100] (got nan)",
       [](SamplingParams& p) {
         p.logit_bias = {{7, NAN}};
       }},
      {"sampling.logit_bias[7] must be in [-100, 100] (got -inf)",
       [](SamplingParams& p) {
         p.logit_bias = {{7, -INFINITY}};
       }},
      {"sampling.logit_bias has 1025 entries; at most 1024",
       [](SamplingParams& p) {
         p.logit_bias.assign(1025, {7, 1.0f});
       }},
  };
  for (const auto& [want, edit] : cases) {
    SamplingParams p;
    edit(p);
    EXPECT_NE(error_of(p).find(want), std::string::npos) << want << " vs " << error_of(p);
  }
}

// With min_new_tokens, stop ids and end-of-sequence that cover the whole vocabulary leave nothing
// to draw; without it, or with ignore_eos, they are fine.
TEST(ValidateSampling, MinNewTokensMustLeaveATokenToDraw) {
  SamplingParams p;
  for (int i = 0; i < 100; ++i)
    if (i != 42) p.stop_token_ids.push_back(i);
  p.min_new_tokens = 1;
  const absl::Status st = validate_sampling(p, 100, 42);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("sampling.min_new_tokens = 1 leaves no token to draw"),
            std::string::npos)
      << st;
  EXPECT_TRUE(validate_sampling(p, 100, -1).ok());
  p.ignore_eos = true;
  EXPECT_TRUE(validate_sampling(p, 100, 42).ok());
  p.ignore_eos = false, p.min_new_tokens = 0;
  EXPECT_TRUE(validate_sampling(p, 100, 42).ok());
}

TEST(ValidateSampling, ValuesPrintWithEnoughDigitsToTellThemFromTheBound) {
  // StrCat's 6 digits would print "(got 1)" for a top_p just above 1, and "(got 2)" for a
  // presence_penalty just above 2.
  const std::vector<std::pair<std::string, std::function<void(SamplingParams&)>>> cases = {
      {"(got 1.0000001)", [](SamplingParams& p) { p.top_p = 1.0000001f; }},
      {"(got 1.0000001)", [](SamplingParams& p) { p.min_p = 1.0000001f; }},
      {"(got 2.0000002)", [](SamplingParams& p) { p.presence_penalty = 2.0000002f; }},
      {"(got -2.0000002)", [](SamplingParams& p) { p.frequency_penalty = -2.0000002f; }},
      {"(got 100.00001)", [](SamplingParams& p) { p.repetition_penalty = 100.00001f; }},
      {"(got 0.0099999)", [](SamplingParams& p) { p.repetition_penalty = 0.0099999f; }},
      {"(got -1e-07)", [](SamplingParams& p) { p.temperature = -1e-7f; }},
      {"(got nan)", [](SamplingParams& p) { p.top_p = NAN; }},
      // Integers print whole, however large.
      {"(got -2147483647)", [](SamplingParams& p) { p.max_new_tokens = -2147483647; }},
      {"(got 2000000000)", [](SamplingParams& p) { p.top_logprobs = 2000000000; }},
  };
  for (const auto& [want, edit] : cases) {
    SamplingParams p;
    edit(p);
    EXPECT_NE(error_of(p).find(want), std::string::npos) << want << " vs " << error_of(p);
  }
}

}  // namespace
}  // namespace cemlm
