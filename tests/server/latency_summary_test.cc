// bench-serve's latency summary against exact nearest-rank percentiles of the same samples.
#include "latency_summary.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace cemlm::cli {
namespace {

double exact_percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  const auto rank = int64_t(std::ceil(p / 100.0 * double(v.size())));
  return v[size_t(std::clamp<int64_t>(rank, 1, int64_t(v.size())) - 1)];
}

void expect_close(double got, double want, double p) {
  EXPECT_LE(std::fabs(got - want), std::fabs(want) / 2048 + 1e-12)
      << "p" << p << ": got " << got << ", exact " << want;
}

TEST(LatencySummary, PercentilesWithinOneBucketOfTheExactOnes) {
  for (uint32_t seed = 0; seed < 20; ++seed) {
    std::mt19937 rng(seed);
    // Log-normal around 1 ms, spanning µs to seconds, some negative (a server overhead can be).
    std::lognormal_distribution<double> dist(0.0, 3.0);
    std::vector<double> v;
    LatencySummary s;
    const int n = 1 + int(rng() % 5000);
    double sum = 0;
    for (int i = 0; i < n; ++i) {
      const double x = (seed % 4 == 3 && i % 7 == 0 ? -1 : 1) * dist(rng);
      v.push_back(x);
      s.add(x);
      sum += x;
    }
    ASSERT_EQ(s.count(), n);
    EXPECT_NEAR(s.mean(), sum / n, 1e-9 * std::fabs(sum / n) + 1e-12);
    EXPECT_EQ(s.min(), *std::min_element(v.begin(), v.end()));
    EXPECT_EQ(s.max(), *std::max_element(v.begin(), v.end()));
    for (double p : {0.0, 1.0, 10.0, 50.0, 90.0, 99.0, 99.9, 100.0})
      expect_close(s.percentile(p), exact_percentile(v, p), p);
    EXPECT_EQ(s.percentile(100), s.max());
  }
}

TEST(LatencySummary, MemoryDoesNotGrowWithTheSamples) {
  LatencySummary s;
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> dist(0.5, 2.0);  // one octave and a bit either side
  for (int i = 0; i < 2'000'000; ++i) s.add(dist(rng));
  EXPECT_EQ(s.count(), 2'000'000);
  EXPECT_LE(s.buckets(), 3u * 1024);
  EXPECT_NEAR(s.percentile(50), 1.25, 0.01);
}

TEST(LatencySummary, RepeatsMergesAndExtremes) {
  LatencySummary a, b, all;
  a.add(3.0, 4);  // four gaps of one message of 4 tokens
  b.add(1.0);
  b.add(5.0);
  all.merge(a);
  all.merge(b);
  all.merge(LatencySummary{});  // an empty one changes nothing
  EXPECT_EQ(all.count(), 6);
  EXPECT_DOUBLE_EQ(all.mean(), (12.0 + 6.0) / 6);
  EXPECT_EQ(all.min(), 1.0);
  EXPECT_EQ(all.max(), 5.0);
  expect_close(all.percentile(50), 3.0, 50);
  EXPECT_EQ(all.percentile(1), 1.0);  // the extremes exactly, not their buckets' middles
  EXPECT_EQ(all.percentile(100), 5.0);
  a.add(0.0);  // zero and values far past the buckets' range still count
  a.add(1e300);
  EXPECT_EQ(a.count(), 6);
  EXPECT_EQ(a.percentile(1), 0.0);
  EXPECT_EQ(a.percentile(100), 1e300);
  EXPECT_EQ(LatencySummary{}.percentile(50), 0.0);
  EXPECT_EQ(LatencySummary{}.count(), 0);
}

}  // namespace
}  // namespace cemlm::cli
