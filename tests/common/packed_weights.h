// What a PackedLinear of each WeightDtype multiplies by, written from WeightDtype's definition
// (kernels/include/cemlm/kernels/linear.h) independently of the kernels: the bf16- and
// int8-weight tests compare the packed products and the engine against the fp32 products and
// the fp32 oracle on these weights.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cemlm/kernels/bf16.h"
#include "cemlm/kernels/int8.h"
#include "cemlm/kernels/linear.h"

namespace cemlm::testing_weights {

// Replaces W [out, in] (row-major) by the weight `dtype` computes with: bf16 rounding to nearest
// even (kBf16 and kBf16Dot, which also rounds the products' inputs); int8 (kInt8 and kInt8Dot): 32
// × 32 blocks of W, each weight q·s in fp32 with s = the block's largest |w| / 127 and q = w / s
// rounded to the nearest integer (ties to even), q = 0 where s = 0.
inline void round_like_packed(WeightDtype dtype, float* W, int64_t out, int64_t in) {
  if (dtype == WeightDtype::kBf16 || dtype == WeightDtype::kBf16Dot) {
    for (int64_t i = 0; i < out * in; ++i) W[i] = bf16_to_f32(f32_to_bf16(W[i]));
    return;
  }
  if (dtype != WeightDtype::kInt8 && dtype != WeightDtype::kInt8Dot) return;
  constexpr int64_t kB = 32;
  for (int64_t r0 = 0; r0 < out; r0 += kB)
    for (int64_t c0 = 0; c0 < in; c0 += kB) {
      const int64_t r1 = std::min(out, r0 + kB), c1 = std::min(in, c0 + kB);
      float absmax = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) absmax = std::max(absmax, std::fabs(W[r * in + c]));
      const float s = int8_scale(absmax);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          float& w = W[r * in + c];
          w = s > 0 ? std::nearbyint(w / s) * s : 0.0f;
        }
    }
}

}  // namespace cemlm::testing_weights
