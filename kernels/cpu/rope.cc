// CPU RoPE: table-driven rotation of each head's half-split pairs.
#include "cemlm/kernels/rope.h"

#include <cmath>
#include <vector>

#include "cemlm/kernels/parallel.h"

namespace cemlm {

namespace {

// θ_m = theta^(-2m/d_h), m < d_h/2.
std::vector<double> rope_frequencies(int64_t dh, float theta) {
  std::vector<double> f(size_t(dh / 2));
  for (int64_t m = 0; m < dh / 2; ++m)
    f[size_t(m)] = std::pow(double(theta), -2.0 * double(m) / double(dh));
  return f;
}

void rope_row(float* row, int64_t p, const std::vector<double>& freq) {
  const int64_t half = int64_t(freq.size());
  for (int64_t m = 0; m < half; ++m) {
    const double ang = double(p) * freq[size_t(m)];
    row[m] = float(std::cos(ang));
    row[half + m] = float(std::sin(ang));
  }
}

}  // namespace

void rope_table_init(Tensor table, float theta) {
  const int64_t dh = table.dim(1);
  const std::vector<double> freq = rope_frequencies(dh, theta);
  for (int64_t p = 0; p < table.dim(0); ++p) rope_row(table.data + p * dh, p, freq);
}

void rope_rows_init(const ExecCtx&, Tensor rows, const int32_t* pos, float theta) {
  const int64_t N = rows.dim(0), dh = rows.dim(1);
  const std::vector<double> freq = rope_frequencies(dh, theta);
  parallel_for(N, N * dh > 4096, [&](int64_t i) { rope_row(rows.data + i * dh, pos[i], freq); });
}

void rope_forward(const ExecCtx&, Tensor out, const Tensor& x, const int32_t* pos,
                  const Tensor& table, bool inverse) {
  const int64_t N = x.dim(0), W = x.dim(-1), dh = table.dim(1), half = dh / 2, H = W / dh;
  CEMLM_CHECK(W % dh == 0 && out.numel() == x.numel());
  const float sign = inverse ? -1.0f : 1.0f;
  parallel_for(N, N * W > 4096, [&](int64_t i) {
    CEMLM_CHECK(pos[i] >= 0 && pos[i] < table.dim(0));
    const float* cs = table.data + int64_t(pos[i]) * dh;
    for (int64_t h = 0; h < H; ++h) {
      const float* xi = x.data + i * W + h * dh;
      float* oi = out.data + i * W + h * dh;
      for (int64_t m = 0; m < half; ++m) {
        const float c = cs[m], s = sign * cs[half + m];
        const float a = xi[m], b = xi[m + half];
        oi[m] = a * c - b * s;
        oi[m + half] = b * c + a * s;
      }
    }
  });
}

}  // namespace cemlm
