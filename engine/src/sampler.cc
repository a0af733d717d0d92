// Sampler (see sampler.h). Candidates are ordered by (logit desc, id asc) everywhere so that ties
// never depend on the sort implementation, and each non-greedy draw consumes exactly one uniform.
#include "cemlm/engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>


namespace cemlm {
namespace {

bool better(const std::pair<float, int>& a, const std::pair<float, int>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

}  // namespace

float log_sum_exp(std::span<const float> x) {
  float mx = -std::numeric_limits<float>::infinity();
  for (float v : x) {
    if (std::isnan(v)) return v;
    mx = std::max(mx, v);
  }
  if (!std::isfinite(mx)) return mx;
  double sum = 0;
  for (float v : x) sum += std::exp(double(v - mx));
  return mx + float(std::log(sum));
}

Sampler::Sampler(const SamplingParams& params, int eos_id, uint64_t seed)
    : params_(params), eos_id_(eos_id), rng_(seed) {}

bool Sampler::is_stop_token(int token) const {
  if (token == eos_id_ && !params_.ignore_eos) return true;
  return std::find(params_.stop_token_ids.begin(), params_.stop_token_ids.end(), token) !=
         params_.stop_token_ids.end();
}

absl::StatusOr<SampleResult> Sampler::sample(std::span<const float> logits,
                                             std::span<const int> tokens, int n_prompt) {
  const float lse = log_sum_exp(logits);
  if (!std::isfinite(lse))
    return absl::FailedPreconditionError(
        "the model produced non-finite logits; check the checkpoint (cemlm score)");
  SampleResult r;
  top_alternatives(logits, lse, &r.top);
  work_.assign(logits.begin(), logits.end());
  counts_.resize(logits.size(), 0);
  apply_penalties(tokens, n_prompt);
  r.token = draw();
  r.logprob = logits[size_t(r.token)] - lse;
  return r;
}

void Sampler::apply_penalties(std::span<const int> tokens, int n_prompt) {
  if (params_.repetition_penalty != 1.0f) {
    const float rp = params_.repetition_penalty;
    // counts_ marks tokens already penalized: each distinct token is penalized once.
    for (int t : tokens)
      if (counts_[size_t(t)]++ == 0) {
        float& x = work_[size_t(t)];
        x = x > 0 ? x / rp : x * rp;
      }
    for (int t : tokens) counts_[size_t(t)] = 0;
  }
  if (params_.presence_penalty == 0 && params_.frequency_penalty == 0) return;
  const auto generated = tokens.subspan(size_t(n_prompt));
  for (int t : generated) ++counts_[size_t(t)];
  for (int t : generated) {
    int& c = counts_[size_t(t)];
    if (c == 0) continue;
    work_[size_t(t)] -= params_.presence_penalty + params_.frequency_penalty * float(c);
    c = 0;
  }
}

int Sampler::draw() {
  if (params_.temperature == 0)
    return int(std::max_element(work_.begin(), work_.end()) - work_.begin());
  const float inv_t = 1.0f / params_.temperature;
  cand_.clear();
  for (size_t i = 0; i < work_.size(); ++i) cand_.push_back({work_[i] * inv_t, int(i)});
  size_t n = cand_.size();
  if (params_.top_k > 0 && size_t(params_.top_k) < n) {
    n = size_t(params_.top_k);
    std::nth_element(cand_.begin(), cand_.begin() + long(n - 1), cand_.end(), better);
  }
  // Filtered draws walk the kept candidates best first, so any implementation agrees on them.
  if (n < cand_.size() || params_.top_p < 1 || params_.min_p > 0)
    std::sort(cand_.begin(), cand_.begin() + long(n), better);
  float mx = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < n; ++i) mx = std::max(mx, cand_[i].first);
  double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += (cand_[i].first = std::exp(cand_[i].first - mx));
  if (params_.top_p < 1) {
    double cum = 0;
    size_t k = 0;
    while (k < n && cum < double(params_.top_p) * sum) cum += cand_[k++].first;
    n = std::max<size_t>(k, 1);
  }
  if (params_.min_p > 0) {
    const float threshold = params_.min_p * cand_[0].first;  // sorted: [0] is the most likely
    size_t k = 1;
    while (k < n && cand_[k].first >= threshold) ++k;
    n = k;
  }
  sum = 0;
  for (size_t i = 0; i < n; ++i) sum += cand_[i].first;
  double u = rng_.uniform() * sum;
  for (size_t i = 0; i + 1 < n; ++i) {
    u -= cand_[i].first;
    if (u < 0) return cand_[i].second;
  }
  return cand_[n - 1].second;
}

void Sampler::top_alternatives(std::span<const float> logits, float lse,
                               std::vector<TopLogprob>* out) {
  const size_t k = std::min(size_t(params_.top_logprobs), logits.size());
  if (k == 0) return;
  cand_.clear();
  for (size_t i = 0; i < logits.size(); ++i) cand_.push_back({logits[i], int(i)});
  std::partial_sort(cand_.begin(), cand_.begin() + long(k), cand_.end(), better);
  for (size_t i = 0; i < k; ++i) out->push_back({cand_[i].second, cand_[i].first - lse});
}

std::string StopMatcher::push(std::string_view piece, bool* stopped) {
  *stopped = false;
  held_.append(piece);
  size_t cut = std::string::npos;
  for (const std::string& s : stops_) cut = std::min(cut, held_.find(s));
  if (cut != std::string::npos) {
    *stopped = true;
    std::string out = held_.substr(0, cut);
    held_.clear();
    return out;
  }
  // Hold back the longest tail of held_ that is a proper prefix of some stop string.
  size_t keep = 0;
  for (const std::string& s : stops_)
    for (size_t k = std::min(s.size() - 1, held_.size()); k > keep; --k)
      if (held_.compare(held_.size() - k, k, s, 0, k) == 0) {
        keep = k;
        break;
      }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::flush() { return std::exchange(held_, {}); }

}  // namespace cemlm
