// Latency samples (ms) kept in memory that does not grow with the run: exact count, mean, min
// and max; percentiles from log-spaced buckets (1,024 to each power of two), each within 1/2048
// of the nearest-rank value. bench-serve records every inter-token gap, and a vector of them grew
// by ~1 GB an hour at 40K tokens/s.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>

namespace cemlm::cli {

class LatencySummary {
 public:
  void add(double ms, int64_t times = 1);
  void merge(const LatencySummary& o);
  int64_t count() const { return count_; }
  double mean() const { return count_ > 0 ? sum_ / double(count_) : 0; }
  double min() const { return min_; }
  double max() const { return max_; }
  // Nearest-rank percentile p in [0, 100], to within 1/2048 of it; 0 when empty.
  double percentile(double p) const;
  // Buckets holding samples (a map node each): at most 133,121 whatever the count.
  std::size_t buckets() const { return counts_.size(); }

 private:
  // Bucket of a value: its sign times 1 + (octave, sub-bucket) index; 0 for |ms| < 2^kMinExp
  // (~1 ns). Ordered as the values are.
  static int32_t key_of(double ms);
  static double value_of(int32_t key);  // the middle of the bucket
  std::map<int32_t, int64_t> counts_;
  int64_t count_ = 0;
  double sum_ = 0, min_ = 0, max_ = 0;
};

}  // namespace cemlm::cli
