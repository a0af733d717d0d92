// validate_sampling: range and finiteness checks of SamplingParams. Each message names the field
// and the accepted range so a client can fix its request. Comparisons are written so that NaN fails.
#include "cemlm/engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cemlm/engine/float32.h"
#include "cemlm/engine/status.h"
#include "cemlm/engine/utf8.h"

namespace cemlm {
namespace {

absl::Status out_of_range(const char* field, const std::string& range, const std::string& got) {
  return absl::InvalidArgumentError(
      absl::StrCat("sampling.", field, " must be ", range, " (got ", got, ")"));
}

absl::Status check(bool ok, const char* field, const std::string& range, float value) {
  if (ok) return absl::OkStatus();
  return out_of_range(field, range, exact_number(value));
}
absl::Status check(bool ok, const char* field, const std::string& range, int value) {
  if (ok) return absl::OkStatus();
  return out_of_range(field, range, absl::StrCat(value));
}

absl::Status check_stops(const SamplingParams& p, int vocab_size) {
  if (p.stop.size() > size_t(kMaxStopStrings))
    return absl::InvalidArgumentError(absl::StrCat("sampling.stop has ", p.stop.size(),
                                                   " strings; at most ", kMaxStopStrings));
  for (size_t i = 0; i < p.stop.size(); ++i) {
    if (p.stop[i].empty())
      return absl::InvalidArgumentError(absl::StrCat(
          "sampling.stop[", i, "] is empty (it would stop at once); remove it or give its text"));
    if (p.stop[i].size() > size_t(kMaxStopBytes))
      return absl::InvalidArgumentError(absl::StrCat("sampling.stop[", i, "] is ",
                                                     p.stop[i].size(), " bytes; at most ",
                                                     kMaxStopBytes));
    if (const size_t valid = utf8_valid_prefix(p.stop[i]); valid != p.stop[i].size())
      return absl::InvalidArgumentError(
          absl::StrCat("sampling.stop[", i, "] is not valid UTF-8 (bad byte at offset ", valid,
                       "): stop strings match the generated text, which is; send its UTF-8 "
                       "bytes, or use sampling.stop_token_ids for a token"));
  }
  if (p.stop_token_ids.size() > size_t(kMaxStopTokenIds))
    return absl::InvalidArgumentError(absl::StrCat("sampling.stop_token_ids has ",
                                                   p.stop_token_ids.size(), " ids; at most ",
                                                   kMaxStopTokenIds));
  for (size_t i = 0; i < p.stop_token_ids.size(); ++i) {
    const int id = p.stop_token_ids[i];
    if (id < 0 || id >= vocab_size)
      return absl::InvalidArgumentError(absl::StrCat("sampling.stop_token_ids[", i, "] = ", id,
                                                     " is not a token id in [0, ", vocab_size, ")"));
  }
  return absl::OkStatus();
}

absl::Status check_logit_bias(const SamplingParams& p, int vocab_size) {
  if (p.logit_bias.size() > size_t(kMaxLogitBias))
    return absl::InvalidArgumentError(absl::StrCat("sampling.logit_bias has ", p.logit_bias.size(),
                                                   " entries; at most ", kMaxLogitBias));
  // (Sets of at most kMaxLogitBias ids, not vocabulary-sized tables: a check before the model is
  // known runs with the largest vocabulary there is.)
  std::set<int> seen;
  for (const auto& [id, bias] : p.logit_bias) {
    if (id < 0 || id >= vocab_size)
      return absl::InvalidArgumentError(absl::StrCat("sampling.logit_bias has the key ", id,
                                                     ", not a token id in [0, ", vocab_size, ")"));
    if (!seen.insert(id).second)
      return absl::InvalidArgumentError(
          absl::StrCat("sampling.logit_bias has the token id ", id, " more than once"));
    const std::string field = absl::StrCat("logit_bias[", id, "]");
    CEMLM_RETURN_IF_ERROR(check(std::isfinite(bias) && std::fabs(bias) <= kMaxAbsLogitBias,
                                field.c_str(), "in [-100, 100]", bias));
  }
  return absl::OkStatus();
}

// With min_new_tokens, the stop tokens are taken out of the draw until then: some other must stay.
absl::Status check_min_new_tokens(const SamplingParams& p, int vocab_size, int eos_id) {
  CEMLM_RETURN_IF_ERROR(check(
      p.min_new_tokens >= 0 && p.min_new_tokens <= p.max_new_tokens, "min_new_tokens",
      absl::StrCat("in [0, sampling.max_new_tokens = ", p.max_new_tokens, "]"), p.min_new_tokens));
  if (p.min_new_tokens == 0) return absl::OkStatus();
  std::set<int> stops(p.stop_token_ids.begin(), p.stop_token_ids.end());  // in range: checked
  if (!p.ignore_eos && eos_id >= 0 && eos_id < vocab_size) stops.insert(eos_id);
  if (int64_t(stops.size()) >= int64_t(vocab_size))
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.min_new_tokens = ", p.min_new_tokens,
                     " leaves no token to draw: every id in [0, ", vocab_size,
                     ") ends generation (sampling.stop_token_ids and end-of-sequence)"));
  return absl::OkStatus();
}

}  // namespace

absl::Status validate_sampling(const SamplingParams& p, int vocab_size, int eos_id) {
  CEMLM_RETURN_IF_ERROR(check(std::isfinite(p.temperature) && p.temperature >= 0, "temperature",
                              "a finite number >= 0 (0 = greedy, as is anything below 1e-5)",
                              p.temperature));
  CEMLM_RETURN_IF_ERROR(check(p.top_k >= 0, "top_k", ">= 0 (0 = off)", p.top_k));
  CEMLM_RETURN_IF_ERROR(check(p.top_p > 0 && p.top_p <= 1, "top_p", "in (0, 1]", p.top_p));
  CEMLM_RETURN_IF_ERROR(check(p.min_p >= 0 && p.min_p <= 1, "min_p", "in [0, 1]", p.min_p));
  // (Below 0.01 a logit divided by it can overflow fp32; nothing useful lies beyond 100.)
  CEMLM_RETURN_IF_ERROR(check(p.repetition_penalty >= 0.01f && p.repetition_penalty <= 100,
                              "repetition_penalty", "in [0.01, 100] (1 = off)",
                              p.repetition_penalty));
  CEMLM_RETURN_IF_ERROR(check(p.presence_penalty >= -2 && p.presence_penalty <= 2,
                              "presence_penalty", "in [-2, 2]", p.presence_penalty));
  CEMLM_RETURN_IF_ERROR(check(p.frequency_penalty >= -2 && p.frequency_penalty <= 2,
                              "frequency_penalty", "in [-2, 2]", p.frequency_penalty));
  CEMLM_RETURN_IF_ERROR(check(p.max_new_tokens >= 1, "max_new_tokens", ">= 1", p.max_new_tokens));
  CEMLM_RETURN_IF_ERROR(check(p.top_logprobs >= 0 && p.top_logprobs <= kMaxTopLogprobs,
                              "top_logprobs", absl::StrCat("in [0, ", kMaxTopLogprobs, "]"),
                              p.top_logprobs));
  CEMLM_RETURN_IF_ERROR(check_stops(p, vocab_size));
  CEMLM_RETURN_IF_ERROR(check_logit_bias(p, vocab_size));
  return check_min_new_tokens(p, vocab_size, eos_id);
}

absl::Status cap_unset_max_new_tokens(int max_seq_len, int prompt_len,
                                      const std::string& prompt_field, SamplingParams* p) {
  const int room = max_seq_len - prompt_len;
  if (room < 1)
    return absl::InvalidArgumentError(absl::StrCat(
        prompt_field, " has ", prompt_len, " tokens: the model's max_seq_len = ", max_seq_len,
        " leaves no room to generate; shorten the prompt"));
  p->max_new_tokens = std::min(p->max_new_tokens, room);
  // validate_sampling's range would cite a max_new_tokens the client never gave.
  if (p->min_new_tokens > p->max_new_tokens)
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling.min_new_tokens = ", p->min_new_tokens, " is more than the ", p->max_new_tokens,
        " tokens generated at most with sampling.max_new_tokens unset (",
        p->max_new_tokens == room
            ? absl::StrCat("the room the prompt leaves under max_seq_len = ", max_seq_len)
            : std::string("its default"),
        "); lower it, or set sampling.max_new_tokens"));
  return absl::OkStatus();
}

}  // namespace cemlm
