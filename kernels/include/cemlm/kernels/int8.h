// The scale of symmetric int8 quantization (q = round(x / s) in [-127, 127], read back as q · s),
// one rule for the int8 KV cache, the int8 weight panels and the int8 dot products' inputs.
#pragma once
#include <cmath>
#include <limits>

namespace cemlm {

// For a group whose largest |x| is `absmax` (finite): absmax / 127, one float lower where that
// rounded up so far that 127 · s overflows (absmax near the largest float), which would read a
// finite value back as infinite.
inline float int8_scale(float absmax) {
  float s = absmax / 127.0f;
  if (s * 127.0f > std::numeric_limits<float>::max()) s = std::nextafter(s, 0.0f);
  return s;
}

}  // namespace cemlm
