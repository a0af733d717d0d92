// Sampler (see sampler.h). Candidates are ordered by (logit desc, id asc) everywhere so that ties
// never depend on the sort implementation, and each non-greedy draw consumes exactly one uniform.
#include "cemlm/engine/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include "cemlm/kernels/simd.h"

namespace cemlm {
namespace {

bool better(const std::pair<float, int>& a, const std::pair<float, int>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// An upper bound, found in O(n) before sorting anything, on how many of the best candidates the
// top-p and min-p filters keep: top-p from a histogram of the candidates' probabilities in octaves
// (all of an octave's tokens rank above the next octave's), min-p by counting p ≥ min_p · p_max.
// `prob` is normalized so that the best candidate has p = 1.
size_t filter_reach(const std::vector<std::pair<float, int>>& cand, size_t n,
                    const std::vector<float>& prob, double sum, float top_p, float min_p) {
  constexpr int kOctaves = 64;
  double mass[kOctaves] = {};
  size_t count[kOctaves] = {}, above_min_p = 0;
  for (size_t i = 0; i < n; ++i) {
    const float p = prob[size_t(cand[i].second)];
    const int octave = std::min(kOctaves - 1, 127 - int(std::bit_cast<uint32_t>(p) >> 23));
    mass[octave] += p;
    ++count[octave];
    above_min_p += p >= min_p;
  }
  size_t reach = min_p > 0 ? above_min_p : n;
  if (top_p < 1) {
    double cum = 0;
    size_t k = 0;
    for (int o = 0; o < kOctaves && cum < double(top_p) * sum; ++o) cum += mass[o], k += count[o];
    reach = std::min(reach, k);
  }
  return std::max<size_t>(reach, 1);
}

}  // namespace

float log_sum_exp(std::span<const float> x) {
  float mx = -std::numeric_limits<float>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
  for (size_t i = 0; i < x.size(); ++i) {
    nan |= x[i] != x[i];
    mx = std::max(mx, x[i]);
  }
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  if (!std::isfinite(mx)) return mx;
  return mx + float(std::log(simd::sum_exp_shifted(x.data(), int(x.size()), mx)));
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
  const size_t V = work_.size();
  if (params_.temperature == 0) {  // the first (lowest id) of the largest
    float best = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : best)
    for (size_t i = 0; i < V; ++i) best = std::max(best, work_[i]);
    return int(std::find(work_.begin(), work_.end(), best) - work_.begin());
  }
  const float inv_t = 1.0f / params_.temperature;
  float mx = -std::numeric_limits<float>::infinity();
  for (float& x : work_) mx = std::max(mx, x *= inv_t);
  // prob_[id] = e^(scaled logit − max), unnormalized; the best token's is 1.
  prob_.assign(work_.begin(), work_.end());
  const double total = simd::exp_shifted(prob_.data(), int(V), mx);
  const bool top_k = params_.top_k > 0 && size_t(params_.top_k) < V;
  if (!top_k && params_.top_p >= 1 && params_.min_p <= 0) {  // no filter: walk in id order
    double u = rng_.uniform() * total;
    for (size_t i = 0; i + 1 < V; ++i) {
      u -= prob_[i];
      if (u < 0) return int(i);
    }
    return int(V - 1);
  }
  // Filtered: candidates best first. Only as long a prefix as the filters reach gets sorted
  // (a nucleus is usually a few dozen tokens of thousands); a strict total order makes any
  // prefix length give the same sequence.
  cand_.clear();
  for (size_t i = 0; i < V; ++i) cand_.push_back({work_[i], int(i)});
  size_t n = V, sorted = 0;
  double sum = total;
  auto ensure_sorted = [&](size_t want) {
    if (want <= sorted) return;
    const size_t upto = std::min(n, std::max({want, 2 * sorted, size_t(64)}));
    std::partial_sort(cand_.begin() + long(sorted), cand_.begin() + long(upto),
                      cand_.begin() + long(n), better);
    sorted = upto;
  };
  if (top_k) {
    n = size_t(params_.top_k);
    std::nth_element(cand_.begin(), cand_.begin() + long(n - 1), cand_.end(), better);
    ensure_sorted(n);
    sum = 0;
    for (size_t i = 0; i < n; ++i) sum += prob_[size_t(cand_[i].second)];
  }
  auto p = [&](size_t i) { return prob_[size_t(cand_[i].second)]; };
  // One partial sort of the prefix the filters can reach; the walks below extend it only if the
  // bound's rounding fell short.
  ensure_sorted(filter_reach(cand_, n, prob_, sum, params_.top_p, params_.min_p));
  if (params_.top_p < 1) {
    double cum = 0;
    size_t k = 0;
    while (k < n && cum < double(params_.top_p) * sum) {
      ensure_sorted(k + 1);
      cum += p(k++);
    }
    n = std::max<size_t>(k, 1);
  }
  ensure_sorted(1);
  if (params_.min_p > 0) {
    const float threshold = params_.min_p * p(0);
    size_t k = 1;
    while (k < n) {
      ensure_sorted(k + 1);
      if (p(k) < threshold) break;
      ++k;
    }
    n = k;
  }
  sum = 0;
  for (size_t i = 0; i < n; ++i) sum += p(i);
  double u = rng_.uniform() * sum;
  for (size_t i = 0; i + 1 < n; ++i) {
    u -= p(i);
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
