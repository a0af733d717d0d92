// bf16 ⇄ fp32 on the host: the upper half of an fp32, rounded to nearest-even (NaN stays NaN),
// finite values saturating at ±3.3895e38, bf16's largest: rounded, a weight within 0.4% of
// FLT_MAX became inf, which made a checkpoint that loads as fp32 fail every request as bf16.
// Used by the CPU's bf16 weights and KV cache; the CUDA kernels have their own device conversions.
#pragma once
#include <bit>
#include <cstdint>

namespace cemlm {

inline uint16_t f32_to_bf16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  const uint16_t h = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  const bool finite = (u & 0x7FFFFFFFu) < 0x7F800000u;
  return finite && (h & 0x7FFFu) == 0x7F80u ? uint16_t(h - 1) : h;
}

inline float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(uint32_t(h) << 16); }

inline void f32_to_bf16(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(x[i]);
}

inline void bf16_to_f32(const uint16_t* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(x[i]);
}

}  // namespace cemlm
