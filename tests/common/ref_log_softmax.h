// The tests' own log-softmax, in long double and written out plainly: a reference for the
// engine's logprobs that does not share their code (cemlm's is LogNormalizer in sampler.h).
#pragma once
#include <algorithm>
#include <cmath>
#include <span>

namespace cemlm::testing_ref {

// log Σ exp(row).
inline long double log_sum_exp(std::span<const float> row) {
  long double mx = -INFINITY;
  for (float x : row) mx = std::max<long double>(mx, x);
  long double sum = 0;
  for (float x : row) sum += std::exp((long double)x - mx);
  return mx + std::log(sum);
}

// log softmax(row)[id].
inline double log_softmax(std::span<const float> row, int id) {
  return double((long double)row[size_t(id)] - log_sum_exp(row));
}

}  // namespace cemlm::testing_ref
