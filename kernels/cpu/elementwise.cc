// CPU element-wise ops (see elementwise.h).
#include "cemlm/kernels/elementwise.h"

#include <algorithm>
#include <cmath>

#include "cemlm/kernels/simd.h"

namespace cemlm {
namespace {

inline float silu(float z) { return z / (1.0f + std::exp(-z)); }

// out[i] = SiLU(a[i]) · (b ? b[i] : 1): eight lanes at a time through simd::exp (within 2 ulp of
// std::exp, and +inf where std::exp overflows, so very negative z gives −0 in lanes and tail
// alike).
void silu_times(float* out, const float* a, const float* b, int64_t n) {
  constexpr int64_t kChunk = 4096;  // per thread item
#pragma omp parallel for schedule(static) if (n > 8192)
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t end = std::min(n, c + kChunk);
    int64_t i = c;
    for (; i + 8 <= end; i += 8) {
      const simd::f8 z = simd::load(a + i);
      simd::f8 s = z / (simd::splat(1.0f) + simd::exp(-z));
      if (b) s *= simd::load(b + i);
      simd::store(out + i, s);
    }
    for (; i < end; ++i) out[i] = silu(a[i]) * (b ? b[i] : 1.0f);
  }
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
#pragma omp parallel for schedule(static) if (n > 8192)
  for (int64_t i = 0; i < n; ++i) out.data[i] = a.data[i] * b.data[i];
}

void axpy_rows_forward(const ExecCtx&, Tensor x, const Tensor& u, const float* eta) {
  const int64_t N = u.dim(0), D = u.dim(-1);
#pragma omp parallel for schedule(static) if (N * D > 4096)
  for (int64_t i = 0; i < N; ++i)
    for (int64_t d = 0; d < D; ++d) x.data[i * D + d] += eta[i] * u.data[i * D + d];
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
