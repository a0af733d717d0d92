// CPU element-wise ops (see elementwise.h).
#include "cemlm/kernels/elementwise.h"

#include <algorithm>

#include "cemlm/kernels/parallel.h"
#include "cemlm/kernels/simd.h"

namespace cemlm {
namespace {

// SiLU(z) · m over eight lanes: simd::exp is within 2 ulp of std::exp, and +inf where std::exp
// overflows, so very negative z gives −0.
inline simd::f8 silu_times8(simd::f8 z, simd::f8 m) {
  return z / (simd::splat(1.0f) + simd::exp(-z)) * m;
}

// out[i] = SiLU(a[i]) · (b ? b[i] : 1). Every value goes through the same lane arithmetic (the
// last n mod 8 through a zero-padded vector): a row's bits must not depend on how many rows share
// the flat buffer, or a request's output would depend on its batch.
void silu_times(float* out, const float* a, const float* b, int64_t n) {
  constexpr int64_t kChunk = 4096;  // per thread item
  parallel_for((n + kChunk - 1) / kChunk, n > 8192, [&](int64_t chunk) {
    const int64_t c = chunk * kChunk, end = std::min(n, c + kChunk);
    int64_t i = c;
    for (; i + 8 <= end; i += 8)
      simd::store(out + i,
                  silu_times8(simd::load(a + i), b ? simd::load(b + i) : simd::splat(1.0f)));
    if (i < end) {
      float z[8] = {}, m[8] = {}, r[8];
      std::copy(a + i, a + end, z);
      if (b)
        std::copy(b + i, b + end, m);
      else
        std::fill(m, m + (end - i), 1.0f);
      simd::store(r, silu_times8(simd::load(z), simd::load(m)));
      std::copy(r, r + (end - i), out + i);
    }
  });
}

}  // namespace

void silu_forward(const ExecCtx&, Tensor out, const Tensor& a) {
  silu_times(out.data, a.data, nullptr, a.numel());
}

void swiglu_forward(const ExecCtx&, Tensor out, const Tensor& gate, const Tensor& up) {
  const int64_t n = gate.numel();
  CEMLM_CHECK(up.numel() == n && out.numel() == n);
  silu_times(out.data, gate.data, up.data, n);
}

void mul_forward(const ExecCtx&, Tensor out, const Tensor& a, const Tensor& b) {
  const int64_t n = a.numel();
  CEMLM_CHECK(b.numel() == n && out.numel() == n);
  parallel_for(n, n > 8192, [&](int64_t i) { out.data[i] = a.data[i] * b.data[i]; });
}

void axpy_rows_forward(const ExecCtx&, Tensor x, const Tensor& u, const float* eta) {
  const int64_t N = u.dim(0), D = u.dim(-1);
  parallel_for(N, N * D > 4096, [&](int64_t i) {
    for (int64_t d = 0; d < D; ++d) x.data[i * D + d] += eta[i] * u.data[i * D + d];
  });
}

void diag_scale_forward(const ExecCtx&, Tensor qd, const Tensor& y, const Tensor& d) {
  const int64_t N = y.dim(0), D = y.dim(-1), H = d.numel() / D;
  for (int64_t i = 0; i < N; ++i)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < D; ++e) qd.data[(i * H + h) * D + e] = d.data[h * D + e] * y.data[i * D + e];
}

void diag_gather_forward(const ExecCtx&, Tensor u, const Tensor& oc, const Tensor& d) {
  const int64_t N = u.dim(0), D = u.dim(-1), H = d.numel() / D;
  for (int64_t i = 0; i < N; ++i)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < D; ++e) u.data[i * D + e] += d.data[h * D + e] * oc.data[(i * H + h) * D + e];
}

}  // namespace cemlm
