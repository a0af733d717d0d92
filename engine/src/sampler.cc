// Sampler (see sampler.h). Candidates are ordered by (logit desc, id asc) everywhere so that ties
// never depend on the sort implementation, and each non-greedy draw consumes exactly one uniform.
#include "cemlm/engine/sampler.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"
#include "cemlm/kernels/simd.h"

namespace cemlm {
namespace {

// A penalized logit kept finite: a repetition penalty of 0.01 makes a logit near the float
// maximum +inf, which no shift can take back out of the draw (and one of 100, a logit of -1e37
// -inf). Only a token the model itself gives no probability is -inf: is_out() tokens are left
// as they are by the penalties and the bias (clamped, one once became drawable when every
// other token was held back).
float finite(float x) {
  return std::clamp(x, std::numeric_limits<float>::lowest(), std::numeric_limits<float>::max());
}

bool is_out(float x) { return x == -std::numeric_limits<float>::infinity(); }

bool better(const std::pair<float, int>& a, const std::pair<float, int>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// Reorders cand[0, n) so that its first k entries are, in some order, the k best by `better`,
// for the smallest k whose probability mass reaches `target` (n when none does), and returns k:
// a quickselect on mass, O(n) on average, where sorting a nucleus of most of a flat row cost
// O(n log n) (a random-init model's row, or a high temperature).
size_t select_mass(std::vector<std::pair<float, int>>& cand, size_t n,
                   const std::vector<float>& prob, double target) {
  auto p = [&](size_t i) { return double(prob[size_t(cand[i].second)]); };
  size_t lo = 0, hi = n;  // [0, lo) is kept with mass < target; the answer k lies in (lo, hi]
  double need = target;
  while (hi - lo > 1) {
    // Median of three as the pivot, moved to hi − 1 while the rest is partitioned.
    size_t a = lo, b = lo + (hi - lo) / 2, c = hi - 1;
    if (better(cand[b], cand[a])) std::swap(a, b);
    if (better(cand[c], cand[b])) std::swap(b, c);
    if (better(cand[b], cand[a])) std::swap(a, b);
    std::swap(cand[b], cand[hi - 1]);
    const std::pair<float, int> pivot = cand[hi - 1];
    const size_t mid =
        size_t(std::partition(cand.begin() + long(lo), cand.begin() + long(hi - 1),
                              [&](const std::pair<float, int>& x) { return better(x, pivot); }) -
               cand.begin());
    std::swap(cand[mid], cand[hi - 1]);  // the pivot right after everything better
    double mass = 0;
    for (size_t i = lo; i < mid; ++i) mass += p(i);
    if (mass >= need) {
      hi = mid;  // mass > 0, so mid > lo
      continue;
    }
    if (mass + p(mid) >= need) return mid + 1;
    need -= mass + p(mid);
    lo = mid + 1;
  }
  return std::max<size_t>(hi, 1);
}

// The candidates of a top-p nucleus, as (scaled logit, id) in cand: the ids within 8 of the best
// scaled logit (a probability above 3.4e-4 of the best's) when their mass reaches `target`, else
// those of the top probability buckets that reach it. Such a set is a best-first prefix, so the
// nucleus lies inside it, and the selection runs on it alone: over all V ids it costs 3-4x a
// plain draw where the model is sure of a few tokens.
// The mass must pass the target by a margin, so that sums taken in another order cannot fall
// short of it inside the set.
void nucleus_candidates(const std::vector<float>& work, const std::vector<float>& prob,
                        double target, std::vector<std::pair<float, int>>& cand) {
  constexpr float kBand = -8.0f;
  const size_t V = work.size();
  cand.clear();
  double mass = 0;
  for (size_t i = 0; i < V; ++i)
    if (work[i] > kBand) {
      mass += prob[i];
      cand.push_back({work[i], int(i)});
    }
  if (!cand.empty() && mass >= target * (1 + 1e-6)) return;
  // Else (a flat row: the band held 88% of a N(0, 3²) row's mass, short of top_p = 0.9, and the
  // selection then ran over all V ids) the ids by their probability's float bits, which order
  // them as the probabilities do: the exponent and 3 bits of the mantissa, buckets an eighth of
  // an octave wide. The buckets from the top whose mass reaches the target hold a best-first
  // prefix too.
  constexpr int kShift = 20;
  std::array<double, (std::bit_cast<uint32_t>(1.0f) >> kShift) + 1> bucket_mass{};
  auto bucket = [&](float p) {  // the best's e^0 may pass 1 by a rounding
    return std::min<size_t>(std::bit_cast<uint32_t>(p) >> kShift, bucket_mass.size() - 1);
  };
  for (size_t i = 0; i < V; ++i) bucket_mass[bucket(prob[i])] += prob[i];
  size_t first = 0;  // the lowest bucket kept
  mass = 0;
  for (size_t b = bucket_mass.size(); b-- > 0;)
    if ((mass += bucket_mass[b]) >= target * (1 + 1e-6)) {
      first = b;
      break;
    }
  cand.clear();
  for (size_t i = 0; i < V; ++i)
    if (bucket(prob[i]) >= first) cand.push_back({work[i], int(i)});
}

// The k best (logit, id) pairs of the row by `better`, in cand in no order (k ≤ V): one
// pass over the ids with a heap of the k best so far, its worst at the front, which most ids are
// only compared with. (A band near the best, as for the nucleus, holds fewer than k ids where the
// model is sure of a few tokens, and a selection over all V ids then cost 4x a plain draw.)
void top_k_candidates(std::span<const float> work, size_t k,
                      std::vector<std::pair<float, int>>& cand) {
  cand.clear();
  for (size_t i = 0; i < k; ++i) cand.push_back({work[i], int(i)});
  std::make_heap(cand.begin(), cand.end(), better);  // `better` as "less": the worst in front
  float floor = cand.front().first;
  for (size_t i = k; i < work.size(); ++i) {
    if (!(work[i] > floor)) continue;  // on a tie the front's lower id wins
    std::pop_heap(cand.begin(), cand.end(), better);
    cand.back() = {work[i], int(i)};
    std::push_heap(cand.begin(), cand.end(), better);
    floor = cand.front().first;
  }
}

}  // namespace

// A draw's buffers, a few bytes per token id, one set per thread that samples (the engine's
// compute threads): a set per request was allocated and faulted in at its first draw (7.6 ms
// of a 256k vocabulary's first draw, against 1 ms for the next) and held while it lived (1.4 GB
// for 256 running requests at that vocabulary). Nothing carries over between calls but zeros.
struct Sampler::Scratch {
  std::vector<float> work;
  std::vector<int> counts;                  // per token id; all zero between calls
  std::vector<float> prob;                  // per token id: e^(scaled logit − max)
  std::vector<std::pair<float, int>> cand;  // (scaled logit, id)
  std::vector<uint8_t> keep;                // per token id: kept by the filters
};

LogNormalizer log_normalizer(std::span<const float> x) {
  float mx = -std::numeric_limits<float>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
  for (size_t i = 0; i < x.size(); ++i) {
    nan |= x[i] != x[i];
    mx = std::max(mx, x[i]);
  }
  LogNormalizer n;
  n.max = nan ? std::numeric_limits<float>::quiet_NaN() : mx;
  if (n.finite()) n.log_sum = std::log(simd::sum_exp_shifted(x.data(), int(x.size()), mx));
  return n;
}

absl::StatusOr<double> perplexity_of(double nll) {
  const double p = std::exp(nll);
  if (!std::isfinite(p))
    return absl::OutOfRangeError(absl::StrCat("the perplexity exp(", nll,
                                              ") overflows: the model gives the text almost no "
                                              "probability (a text far from anything it "
                                              "was trained on, or a broken checkpoint)"));
  return p;
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
  const LogNormalizer norm = log_normalizer(logits);
  if (!norm.finite())
    return absl::InternalError(
        "the model produced non-finite logits; check the checkpoint (cemlm score)");
  thread_local Scratch s;
  SampleResult r;
  top_alternatives(s, logits, norm, &r.top);
  std::vector<float>& work = s.work;
  work.assign(logits.begin(), logits.end());
  if (s.counts.size() < logits.size()) s.counts.resize(logits.size(), 0);
  apply_penalties(s, tokens, n_prompt);
  for (const auto& [id, bias] : params_.logit_bias)
    if (float& x = work[size_t(id)]; !is_out(x)) x = finite(x + bias);
  if (int64_t(tokens.size()) - n_prompt < params_.min_new_tokens) {
    // Not yet: the tokens that would end generation get no chance (validation left others).
    constexpr float kOut = -std::numeric_limits<float>::infinity();
    for (int id : params_.stop_token_ids) work[size_t(id)] = kOut;
    if (!params_.ignore_eos && eos_id_ >= 0 && size_t(eos_id_) < work.size())
      work[size_t(eos_id_)] = kOut;
    // What the model leaves possible may be only those tokens: there is then nothing to draw.
    if (std::all_of(work.begin(), work.end(), is_out))
      return absl::FailedPreconditionError(
          "sampling.min_new_tokens: the model gives every token but the stop tokens it holds "
          "back probability 0 here, so no token can be drawn; lower sampling.min_new_tokens");
  }
  r.token = draw(s);
  r.logprob = float(norm.logprob(logits[size_t(r.token)]));
  return r;
}

void Sampler::apply_penalties(Scratch& s, std::span<const int> tokens, int n_prompt) const {
  std::vector<int>& counts = s.counts;
  if (params_.repetition_penalty != 1.0f) {
    const float rp = params_.repetition_penalty;
    // counts marks tokens already penalized: each distinct token is penalized once.
    for (int t : tokens)
      if (counts[size_t(t)]++ == 0) {
        float& x = s.work[size_t(t)];
        if (!is_out(x)) x = finite(x > 0 ? x / rp : x * rp);
      }
    for (int t : tokens) counts[size_t(t)] = 0;
  }
  if (params_.presence_penalty == 0 && params_.frequency_penalty == 0) return;
  const auto generated = tokens.subspan(size_t(n_prompt));
  for (int t : generated) ++counts[size_t(t)];
  for (int t : generated) {
    int& c = counts[size_t(t)];
    if (c == 0) continue;
    float& x = s.work[size_t(t)];
    if (!is_out(x))
      x = finite(x - (params_.presence_penalty + params_.frequency_penalty * float(c)));
    c = 0;
  }
}

int Sampler::draw(Scratch& s) {
  std::vector<float>& work = s.work;
  std::vector<float>& prob = s.prob;
  const size_t V = work.size();
  if (samples_greedily(params_)) {  // the first (lowest id) of the largest
    float best = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : best)
    for (size_t i = 0; i < V; ++i) best = std::max(best, work[i]);
    return int(std::find(work.begin(), work.end(), best) - work.begin());
  }
  // Shifted by the best logit before scaling, so huge logits over a small temperature cannot
  // overflow (they once made every probability NaN and the draw fell to the last id).
  const float inv_t = 1.0f / params_.temperature;
  float mx = -std::numeric_limits<float>::infinity();
  for (float x : work) mx = std::max(mx, x);
  for (float& x : work) x = (x - mx) * inv_t;
  // prob[id] = e^(scaled logit − max), unnormalized; the best token's is 1.
  prob.assign(work.begin(), work.end());
  const double total = simd::exp_shifted(prob.data(), int(V), 0.0f);
  const bool top_k = params_.top_k > 0 && size_t(params_.top_k) < V;
  const bool filtered = top_k || params_.top_p < 1 || params_.min_p > 0;
  double sum = total;
  size_t last = V - 1;  // the last id the draw can land on (kept, with a share above 0)
  if (filtered) {
    // The kept candidates as a set, never sorted: top-k, then the smallest best-first prefix
    // whose mass reaches top_p, then those with p ≥ min_p · p_max.
    // (The nucleus of top-k's lies in the top k.)
    std::vector<std::pair<float, int>>& cand = s.cand;
    if (top_k) {
      top_k_candidates(work, size_t(params_.top_k), cand);
      sum = 0;
      for (const auto& c : cand) sum += prob[size_t(c.second)];
    } else if (params_.top_p < 1) {
      nucleus_candidates(work, prob, double(params_.top_p) * sum, cand);
    } else {
      cand.resize(V);
      for (size_t i = 0; i < V; ++i) cand[i] = {work[i], int(i)};
    }
    size_t n = cand.size();
    if (params_.top_p < 1) n = select_mass(cand, n, prob, double(params_.top_p) * sum);
    float p_max = 0;
    for (size_t i = 0; i < n; ++i) p_max = std::max(p_max, prob[size_t(cand[i].second)]);
    const float threshold = params_.min_p * p_max;  // min_p = 0 keeps all n
    s.keep.assign(V, 0);
    for (size_t i = 0; i < n; ++i) {
      const size_t id = size_t(cand[i].second);
      s.keep[id] = prob[id] >= threshold;
    }
    sum = 0;
    for (size_t i = 0; i < V; ++i)
      if (s.keep[i]) sum += prob[i], last = prob[i] > 0 ? i : last;
  } else {
    while (last > 0 && prob[last] == 0)
      --last;  // a token taken out (min_new_tokens) or underflowed
  }
  double u = rng_.uniform() * sum;
  for (size_t i = 0; i < last; ++i)
    if ((!filtered || s.keep[i]) && (u -= prob[i]) < 0) return int(i);
  return int(last);
}

void Sampler::top_alternatives(Scratch& s, std::span<const float> logits, const LogNormalizer& norm,
                               std::vector<TopLogprob>* out) const {
  const size_t k = std::min(size_t(params_.top_logprobs), logits.size());
  if (k == 0) return;
  std::vector<std::pair<float, int>>& cand = s.cand;
  top_k_candidates(logits, k, cand);
  std::sort(cand.begin(), cand.end(), better);
  for (size_t i = 0; i < k; ++i)
    out->push_back({cand[i].second, float(norm.logprob(cand[i].first))});
}

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  stops_.reserve(stops.size());
  for (std::string& text : stops) {
    if (text.empty()) continue;  // validation refuses it: it would stop before any text
    Stop& s = stops_.emplace_back();
    s.text = std::move(text);
    s.border.assign(s.text.size(), 0);
    for (size_t i = 1, b = 0; i < s.text.size(); ++i) {
      while (b > 0 && s.text[i] != s.text[b]) b = s.border[b - 1];
      if (s.text[i] == s.text[b]) ++b;
      s.border[i] = uint32_t(b);
    }
  }
}

std::string StopMatcher::push(std::string_view piece, bool* stopped) {
  *stopped = false;
  const size_t from = held_.size();
  held_.append(piece);
  // The stop string that completes first in the text wins (the longer one when two end together),
  // wherever the pieces split it: the earliest *start* would depend on whether a longer stop
  // string that began sooner had already arrived when a shorter one inside it completed.
  for (size_t i = from; i < held_.size(); ++i) {
    size_t completed = 0;  // the longest stop string ending at byte i
    for (Stop& s : stops_) {
      size_t m = s.matched;  // below s.text.size(): a complete match ends the stream
      while (m > 0 && s.text[m] != held_[i]) m = s.border[m - 1];
      if (s.text[m] == held_[i]) ++m;
      s.matched = uint32_t(m);
      if (m == s.text.size()) completed = std::max(completed, m);
    }
    if (completed > 0) {  // it starts inside held_: held_ keeps the longest match in progress
      *stopped = true;
      std::string out = held_.substr(0, i + 1 - completed);
      held_.clear();
      for (Stop& s : stops_) s.matched = 0;
      return out;
    }
  }
  // Hold back the longest tail that some stop string starts with.
  size_t keep = 0;
  for (const Stop& s : stops_) keep = std::max(keep, size_t(s.matched));
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::flush() {
  for (Stop& s : stops_) s.matched = 0;
  return std::exchange(held_, {});
}

}  // namespace cemlm
