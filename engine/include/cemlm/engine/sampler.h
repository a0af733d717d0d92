// Per-request token sampler: penalties, temperature, top-k/top-p/min-p, a seeded RNG owned by the
// request (so the same seed gives the same tokens alone, batched, or after a preemption), stop
// tokens, and the chosen token's logprob under the UNMODIFIED model distribution. StopMatcher cuts
// the detokenized text at stop strings that may span token boundaries.
#pragma once
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "cemlm/engine/params.h"
#include "cemlm/engine/sampling.h"

namespace cemlm {

// The log-normalizer log Σ exp(x) of a row of logits, kept in two parts: the row's max and
// log Σ exp(x − max), which lies in [0, log V]. A log-probability taken as (x − max) − log_sum
// keeps its precision when the logits are large, where max + log_sum in one float would lose
// log_sum (from |max| ≈ 1e5 up: a 10-way tie at 1e8 read as probability 1).
struct LogNormalizer {
  float max = 0;       // NaN when a logit is NaN, ±inf when the largest is infinite
  double log_sum = 0;  // log Σ exp(x − max) when max is finite
  bool finite() const { return std::isfinite(max); }
  // log softmax(row)[i] for x = row[i], in double: below −FLT_MAX it is −inf once made a float.
  double logprob(float x) const { return (double(x) - double(max)) - log_sum; }
};
LogNormalizer log_normalizer(std::span<const float> x);

// exp(nll) of a mean negative log-likelihood; OUT_OF_RANGE when it overflows (past nll ≈ 709: a
// broken checkpoint, or a text the model all but rules out), as the server's Score and `cemlm
// score` refuse a non-finite result.
absl::StatusOr<double> perplexity_of(double nll);

struct SampleResult {
  int token = -1;
  float logprob = 0;             // log_softmax(raw logits)[token]
  std::vector<TopLogprob> top;   // the params' top_logprobs best raw alternatives, best first
};

// Order of operations: repetition penalty (prompt + generated), presence and frequency
// penalties (generated), logit bias, then (before min_new_tokens generated tokens) the stop
// tokens taken out, then temperature 0 → argmax (lowest id on ties); otherwise divide by
// the temperature, keep top-k, then the top-p nucleus, then tokens with p ≥ min_p · p_max, and
// draw exactly one uniform u from the request's RNG: the token is where u · Σp falls in the
// cumulative sum of the kept candidates, walked in id order. "Best" orders candidates by scaled
// logit desc, then id asc, so the kept set never depends on how ties are sorted.
class Sampler {
 public:
  Sampler(const SamplingParams& params, int eos_id, uint64_t seed);

  // `logits`: the raw row [V]; `tokens`: prompt then generated tokens, `n_prompt` of the former.
  // INTERNAL when the model produced a non-finite logit (a fault of the server, not the request);
  // FAILED_PRECONDITION when min_new_tokens holds back the only tokens the model gives a
  // probability (nothing is left to draw).
  absl::StatusOr<SampleResult> sample(std::span<const float> logits, std::span<const int> tokens,
                                      int n_prompt);
  // True for a stop token id, and for eos unless ignore_eos. Generation ends after it.
  bool is_stop_token(int token) const;
  const SamplingParams& params() const { return params_; }

 private:
  struct Scratch;  // vocabulary-sized buffers, one set per thread (sampler.cc)
  void apply_penalties(Scratch& s, std::span<const int> tokens, int n_prompt) const;
  int draw(Scratch& s);  // from s.work, already penalized and scaled by 1/temperature
  void top_alternatives(Scratch& s, std::span<const float> logits, const LogNormalizer& norm,
                        std::vector<TopLogprob>* out) const;

  SamplingParams params_;
  int eos_id_;
  Rng rng_;
};

// Matches stop strings on a stream of text pieces. Text that could still grow into a stop string
// is held back until it resolves; when one completes, the text before it is released and the
// rest is dropped. Of several, the one whose end comes first in the text wins, so the output does
// not depend on how the text splits into pieces. Stop strings must be valid UTF-8, so held-back
// cuts fall on character bounds. Each stop string is followed by a Knuth–Morris–Pratt automaton,
// so a piece costs its bytes × the stop strings, however long they are or how much is held.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);
  // Appends `piece`; returns the text now safe to emit. Sets *stopped when a stop string completed.
  std::string push(std::string_view piece, bool* stopped);
  // The held-back text, at the end of a stream that did not stop (a push after it starts anew).
  std::string flush();

 private:
  struct Stop {
    std::string text;
    std::vector<uint32_t> border;  // border[k]: the longest proper border of text's first k + 1
    uint32_t matched = 0;          // the longest tail of the stream that text starts with
  };
  std::vector<Stop> stops_;
  std::string held_;  // the stream's tail that some stop string starts with (the longest of them)
};

}  // namespace cemlm
