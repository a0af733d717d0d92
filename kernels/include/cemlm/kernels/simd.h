// Portable SIMD helpers for the CPU kernels and the sampler: eight floats per register through the
// GCC/Clang vector extension, which compiles to AVX/AVX2 (or wider) when the build targets them
// (CEMLM_CPU_ARCH) and to pairs of SSE registers otherwise. Scalar tails keep every length legal.
#pragma once
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace cemlm::simd {

// `aligned(4)`: loads and stores through these types are unaligned-safe.
typedef float f8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8 __attribute__((vector_size(32), aligned(4)));

inline f8 load(const float* p) { return *reinterpret_cast<const f8*>(p); }
inline void store(float* p, f8 v) { *reinterpret_cast<f8*>(p) = v; }
inline f8 splat(float x) { return f8{} + x; }

inline float hsum(f8 v) {
  float s = 0;
  for (int l = 0; l < 8; ++l) s += v[l];
  return s;
}

// a·b with two independent accumulators so the multiply-add latency chain does not bound it.
inline float dot(const float* a, const float* b, int n) {
  f8 s0 = {}, s1 = {};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 += load(a + i) * load(b + i);
    s1 += load(a + i + 8) * load(b + i + 8);
  }
  if (i + 8 <= n) {
    s0 += load(a + i) * load(b + i);
    i += 8;
  }
  float s = hsum(s0 + s1);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Σ x[i]² for i < n: two float accumulators of 8 lanes, their lanes and the tail summed in double
// (a long row's partial sums stay within float's precision, and no dependency chain bounds it).
inline double sum_squares(const float* x, int n) {
  f8 s0 = {}, s1 = {};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const f8 a = load(x + i), b = load(x + i + 8);
    s0 += a * a;
    s1 += b * b;
  }
  double s = 0;
  for (int l = 0; l < 8; ++l) s += double(s0[l]) + double(s1[l]);
  if (!std::isfinite(s)) {  // a lane overflowed (|x| beyond ~1e19): the whole row in double
    s = 0;
    i = 0;
  }
  for (; i < n; ++i) s += double(x[i]) * x[i];
  return s;
}

// e^x per lane, within 2 ulp of std::exp for x ≤ 88.3 (x = n·ln 2 + r, |r| ≤ ln2/2, e^r by a
// degree-7 polynomial, 2^n written into the exponent bits); lanes below −87.3 (where e^x leaves
// the normal range) give 0, lanes above 88.72 (where it overflows) +inf, as std::exp does.
inline f8 exp(f8 x) {
  const f8 lo = splat(-87.3f);
  const i8 underflow = x < lo, overflow = x > splat(88.7228f);
  x = x < lo ? lo : x;
  x = x > splat(88.3f) ? splat(88.3f) : x;
  // Round x·log2(e) to the nearest integer with the 1.5·2^23 trick (round-to-nearest mode).
  const f8 magic = splat(12582912.0f);
  const f8 n = (x * splat(1.44269504088896341f) + magic) - magic;
  // r = x − n·ln2 with ln2 split in two so that n·ln2_hi is exact.
  const f8 r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
  f8 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  const i8 bits = (__builtin_convertvector(n, i8) + 127) << 23;
  const f8 y = p * std::bit_cast<f8>(bits);
  const i8 inf = std::bit_cast<i8>(splat(std::numeric_limits<float>::infinity()));
  return std::bit_cast<f8>((std::bit_cast<i8>(y) & ~underflow & ~overflow) | (inf & overflow));
}

inline float exp(float x) {
  f8 v = splat(x);
  return exp(v)[0];
}

// Σ e^(x[i] − shift) for i < n, written back into x when kStore. Lanes accumulate in float
// for 512 elements at a time, then in double.
template <bool kStore>
inline double exp_shifted_sum(float* x, int n, float shift) {
  const f8 s = splat(shift);
  double sum = 0;
  int i = 0;
  while (i + 8 <= n) {
    f8 acc = {};
    for (const int end = std::min(n, i + 512); i + 8 <= end; i += 8) {
      const f8 e = exp(load(x + i) - s);
      if constexpr (kStore) store(x + i, e);
      acc += e;
    }
    sum += double(hsum(acc));
  }
  for (; i < n; ++i) {
    const float e = exp(x[i] - shift);
    if constexpr (kStore) x[i] = e;
    sum += e;
  }
  return sum;
}

// x[i] ← e^(x[i] − shift) for i < n; returns the sum of the results.
inline double exp_shifted(float* x, int n, float shift) {
  return exp_shifted_sum<true>(x, n, shift);
}

// Σ e^(x[i] − shift) for i < n, x untouched.
inline double sum_exp_shifted(const float* x, int n, float shift) {
  return exp_shifted_sum<false>(const_cast<float*>(x), n, shift);
}

}  // namespace cemlm::simd
