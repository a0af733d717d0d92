// Sampling parameters of one request and their validation (named-field errors).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace cemlm {

struct SamplingParams {
  float temperature = 1.0f;        // 0 (or below kGreedyBelowTemperature): greedy
  int top_k = 0;                   // 0: off
  float top_p = 1.0f;              // 1: off
  float min_p = 0.0f;              // 0: off
  float repetition_penalty = 1.0f; // 1: off (CTRL-style, on prompt and generated tokens)
  float presence_penalty = 0.0f;   // OpenAI-style, on generated tokens
  float frequency_penalty = 0.0f;
  std::optional<uint64_t> seed;    // same seed ⇒ same output, alone or batched (docs/API.md)
  int max_new_tokens = 64;
  int min_new_tokens = 0;          // end-of-sequence and stop_token_ids are not drawn before this
                                   // many tokens (stop strings still apply)
  std::vector<std::string> stop;   // stop strings (not included in the output)
  std::vector<int> stop_token_ids; // generation ends after such a token (not included in text)
  bool ignore_eos = false;
  int top_logprobs = 0;            // alternatives reported per token (0–20)
  // (token id, bias): added to the id's logit after the penalties, before the temperature and the
  // filters (so divided by the temperature too); each id at most once, each bias in [-100, 100]
  // (-100 in practice bans the token at temperatures up to a few).
  std::vector<std::pair<int, float>> logit_bias;
};

// One alternative token reported with a generated token.
struct TopLogprob {
  int token_id;
  float logprob;
};

// Temperatures below this sample greedily: dividing the logits by a smaller one overflows fp32
// (every probability NaN), and a distribution that sharp is the argmax in practice (vLLM's rule).
inline constexpr float kGreedyBelowTemperature = 1e-5f;
inline bool samples_greedily(const SamplingParams& p) {
  return p.temperature < kGreedyBelowTemperature;
}

inline constexpr int kMaxStopStrings = 16;
inline constexpr int kMaxStopBytes = 1024;  // per stop string: each is held and matched per token
inline constexpr int kMaxStopTokenIds = 1024;  // each is held and compared per token
inline constexpr int kMaxTopLogprobs = 20;
inline constexpr int kMaxLogitBias = 1024;      // entries, each applied per token
inline constexpr float kMaxAbsLogitBias = 100;  // OpenAI's range

// Checks ranges and finiteness; the message names the field, e.g. "sampling.top_p". eos_id (-1:
// none) takes part in the check that min_new_tokens leaves some token to draw.
absl::Status validate_sampling(const SamplingParams& p, int vocab_size, int eos_id = -1);

// For a request that left max_new_tokens unset (the server and `cemlm generate`): the default
// capped to the room a prompt of `prompt_len` tokens leaves under max_seq_len, so that a long
// prompt is not refused for a length nobody asked for. Errors name `prompt_field` when the prompt
// leaves no room, and sampling.min_new_tokens when it asks for more than is left.
absl::Status cap_unset_max_new_tokens(int max_seq_len, int prompt_len,
                                      const std::string& prompt_field, SamplingParams* p);

}  // namespace cemlm
