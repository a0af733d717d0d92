#include "latency_summary.h"

#include <algorithm>
#include <cmath>

namespace cemlm::cli {
namespace {

constexpr int kSubBuckets = 1024;  // per power of two: the middle is within 1/2048
// frexp's exponents of the buckets: from 2^-20 ms (~1 ns) to 2^44 ms (centuries).
constexpr int kMinExp = -19, kMaxExp = 45;

}  // namespace

int32_t LatencySummary::key_of(double ms) {
  const double a = std::fabs(ms);
  if (!(a >= std::ldexp(0.5, kMinExp))) return 0;  // tiny (NaN too)
  int e = 0;
  // a = m 2^e, m in [0.5, 1); what is past the range goes to the last bucket
  const double m = std::frexp(std::min(a, std::ldexp(0.5, kMaxExp)), &e);
  const int sub = std::min(kSubBuckets - 1, int((m - 0.5) * 2 * kSubBuckets));
  const int32_t index = std::min(kMaxExp, e) - kMinExp;
  const int32_t key = 1 + index * kSubBuckets + sub;
  return ms < 0 ? -key : key;
}

double LatencySummary::value_of(int32_t key) {
  if (key == 0) return 0;
  const int32_t k = std::abs(key) - 1;
  const double m = 0.5 + (double(k % kSubBuckets) + 0.5) / (2 * kSubBuckets);
  const double v = std::ldexp(m, int(k / kSubBuckets) + kMinExp);
  return key < 0 ? -v : v;
}

void LatencySummary::add(double ms, int64_t times) {
  if (times <= 0) return;
  if (count_ == 0 || ms < min_) min_ = ms;
  if (count_ == 0 || ms > max_) max_ = ms;
  counts_[key_of(ms)] += times;
  count_ += times;
  sum_ += ms * double(times);
}

void LatencySummary::merge(const LatencySummary& o) {
  if (o.count_ == 0) return;
  if (count_ == 0 || o.min_ < min_) min_ = o.min_;
  if (count_ == 0 || o.max_ > max_) max_ = o.max_;
  for (const auto& [key, n] : o.counts_) counts_[key] += n;
  count_ += o.count_;
  sum_ += o.sum_;
}

double LatencySummary::percentile(double p) const {
  if (count_ == 0) return 0;
  // Nearest rank: the smallest sample with at least p% of them at or below it.
  const int64_t rank =
      std::clamp<int64_t>(int64_t(std::ceil(p / 100.0 * double(count_))), 1, count_);
  // The extremes are known exactly (and the last bucket also holds what is past the range).
  if (rank == 1) return min_;
  if (rank == count_) return max_;
  int64_t seen = 0;
  for (const auto& [key, n] : counts_) {
    seen += n;
    if (seen >= rank) return std::clamp(value_of(key), min_, max_);  // a middle past them: not
  }
  return max_;
}

}  // namespace cemlm::cli
