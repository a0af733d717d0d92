// AVX-512 helpers shared by the CPU kernels built for it (gemm_avx512.cc, attention_avx512.cc).
// Include only inside `#if defined(__AVX512F__)`, before anything else that includes immintrin.h.
#pragma once
// GCC 12's AVX-512 headers trip -W(maybe-)uninitialized in their own casts and masked loads (GCC
// bug 105593, fixed in 13); the warnings are located in the header, silenced here for it alone.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstdint>
#include <utility>

namespace cemlm::avx512 {

// The first n of 16 lanes (none for n ≤ 0, all for n ≥ 16).
inline __mmask16 lane_mask(int n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// Lane t of the result = the sum of acc[t]'s 16 lanes: pairs, then quadruples within each
// 128-bit lane, then across lanes (15 adds instead of 16 full horizontal reductions).
inline __m512 reduce16(const __m512* acc) {
  __m512 r1[8], r2[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x·, y·, x·, y·] of acc 2i, 2i+1
    r1[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                          _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: element m holds acc 4i + m
    const __m512d a = _mm512_castps_pd(r1[2 * i]), b = _mm512_castps_pd(r1[2 * i + 1]);
    r2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 r30 = _mm512_add_ps(_mm512_shuffle_f32x4(r2[0], r2[1], 0x88),
                                   _mm512_shuffle_f32x4(r2[0], r2[1], 0xdd));
  const __m512 r31 = _mm512_add_ps(_mm512_shuffle_f32x4(r2[2], r2[3], 0x88),
                                   _mm512_shuffle_f32x4(r2[2], r2[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(r30, r31, 0x88), _mm512_shuffle_f32x4(r30, r31, 0xdd));
}

// dst[j·ldd + i] = src[i·lds + j] for a 16 × 16 tile.
inline void transpose16(const float* src, size_t lds, float* dst, size_t ldd) {
  __m512 r[16], t[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + size_t(i) * lds);
    // Interleave pairs of rows, then pairs of pairs: lane L of r[4q + j] becomes column 4L + j of
    // rows 4q..4q+3.
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  // Gather lane L of the four row groups: column 4L + j.
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __m512 even01 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
    const __m512 odd01 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
    const __m512 even23 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    const __m512 odd23 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
    t[j] = _mm512_shuffle_f32x4(even01, even23, 0x88);
    t[8 + j] = _mm512_shuffle_f32x4(even01, even23, 0xdd);
    t[4 + j] = _mm512_shuffle_f32x4(odd01, odd23, 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(odd01, odd23, 0xdd);
  }
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) _mm512_storeu_ps(dst + size_t(j) * ldd, t[j]);
}

// 16 lanes of a row (masked): fp32 as is, bf16 bit patterns widened into the upper half.
inline __m512 load_row(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_row(__mmask16 m, const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// int8 integers as floats (their scales are applied by the caller).
inline __m512 load_row(__mmask16 m, const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

// Σ_r w_r·row_r over the first `width` ≤ 16·V columns, held in registers while the rows stream
// by. V is a compile-time count so that the accumulators are registers, not memory (see
// for_vectors); with V ≤ 8 there are two sets of them, add2's two rows going one to each, so
// that a short row still keeps 2V independent FMA chains in flight.
template <int V>
class RowSum {
 public:
  static_assert(V >= 1 && V <= 16);
  explicit RowSum(int width) : last_(lane_mask(width - 16 * (V - 1))) {
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i) {
      acc_[0][i] = _mm512_setzero_ps();
      acc_[kSets - 1][i] = _mm512_setzero_ps();
    }
  }
  template <typename E>
  void add(float w, const E* row) {
    add_to<0>(w, row);
  }
  template <typename E>
  void add2(float w0, const E* row0, float w1, const E* row1) {
    add_to<0>(w0, row0);
    add_to<kSets - 1>(w1, row1);
  }
  // dst[0, width) = alpha·sum + beta·dst (dst is not read when beta = 0).
  void store(float* dst, float alpha = 1.0f, float beta = 0.0f) const {
    const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i) {
      __m512 r = kSets == 2 ? _mm512_add_ps(acc_[0][i], acc_[1][i]) : acc_[0][i];
      if (alpha != 1.0f) r = _mm512_mul_ps(va, r);
      if (beta != 0.0f) r = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(mask(i), dst + 16 * i), r);
      _mm512_mask_storeu_ps(dst + 16 * i, mask(i), r);
    }
  }

 private:
  static constexpr int kSets = V <= 8 ? 2 : 1;
  __mmask16 mask(int i) const { return i == V - 1 ? last_ : __mmask16(0xFFFF); }
  template <int S, typename E>
  void add_to(float w, const E* row) {
    const __m512 p = _mm512_set1_ps(w);
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i)
      acc_[S][i] = _mm512_fmadd_ps(p, load_row(mask(i), row + 16 * i), acc_[S][i]);
  }
  __m512 acc_[kSets][V];
  __mmask16 last_;
};

// Op<V>::run(args…) for V = v (1 ≤ v ≤ 16): a run-time vector count to a compile-time one.
template <template <int> class Op, typename... Args>
inline void for_vectors(int v, Args&&... args) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (void)((v == I + 1 ? (Op<I + 1>::run(args...), true) : false) || ...);
  }(std::make_integer_sequence<int, 16>{});
}

}  // namespace cemlm::avx512
