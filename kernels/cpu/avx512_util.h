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

}  // namespace cemlm::avx512
