// CUDA LEV generator (lev.h): one block per token. The per-token hyper-parameter-sized pieces
// (seed, LayerNorm statistics, spline weights, the rank-r product) follow the CPU oracle
// (kernels/cpu/lev.cc) in the same summation orders; threads split the s, r and D loops.
#include "cemlm/kernels/cuda/ops.h"
#include "common.cuh"

namespace cemlm::cuda {
namespace {

struct LevDims {
  int k, b, s, nh, kn, r;
  int64_t D;
};

__device__ float b2(float x) {
  const float a = fabsf(x);
  if (a < 0.5f) return 0.75f - x * x;
  if (a < 1.5f) return 0.5f * (1.5f - a) * (1.5f - a);
  return 0.0f;
}

// Normalised B-spline weights (lev_basis).
__device__ void basis(float zeta, int knots, float* w) {
  double sum = 0;
  for (int q = 0; q < knots; ++q) {
    w[q] = b2((zeta - float(q) / float(knots - 1)) * float(knots - 1));
    sum += w[q];
  }
  const float inv = float(1.0 / sum);
  for (int q = 0; q < knots; ++q) w[q] *= inv;
}

// Shared memory: z[s], u[s], bas[s·kn], m[nh·r].
__global__ void lev_kernel(float* out, const int32_t* ids, int64_t V, LevDims d,
                           const float* codebooks, const float* seed_proj, const float* ln_w,
                           const float* ln_b, const float* spline, const float* out_proj) {
  extern __shared__ float sm[];
  float* z = sm;
  float* u = z + d.s;
  float* bas = u + d.s;
  float* m = bas + d.s * d.kn;
  __shared__ double s_mean;
  __shared__ float s_rs;
  const int64_t token = ids[blockIdx.x];
  if (token < 0 || token >= V) __trap();
  for (int e = threadIdx.x; e < d.s; e += blockDim.x) {
    // z[e] = Σ_j C[j, digit_j, e], j ascending (most significant digit first) as on the CPU.
    float acc = 0.0f;
    int64_t place = 1;
    for (int j = 1; j < d.k; ++j) place *= d.b;
    for (int j = 0; j < d.k; ++j) {
      acc += codebooks[(int64_t(j) * d.b + (token / place) % d.b) * d.s + e];
      place /= d.b;
    }
    z[e] = acc;
  }
  __syncthreads();
  for (int l = 0; l < d.nh; ++l) {
    const float* W = seed_proj + int64_t(l) * d.s * d.s;
    for (int a = threadIdx.x; a < d.s; a += blockDim.x) {
      float acc = 0.0f;
      for (int e = 0; e < d.s; ++e) acc += W[a * d.s + e] * z[e];
      u[a] = acc;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // s is small: serial, in the CPU's order
      double mean = 0;
      for (int a = 0; a < d.s; ++a) mean += u[a];
      mean /= d.s;
      double var = 0;
      for (int a = 0; a < d.s; ++a) var += (u[a] - mean) * (u[a] - mean);
      s_mean = mean;
      s_rs = float(1.0 / sqrt(var / d.s + 1e-5));
    }
    __syncthreads();
    for (int dd = threadIdx.x; dd < d.s; dd += blockDim.x) {
      const float y = ln_w[l * d.s + dd] * float(u[dd] - s_mean) * s_rs + ln_b[l * d.s + dd];
      basis(1.0f / (1.0f + expf(-y)), d.kn, bas + dd * d.kn);
    }
    __syncthreads();
    for (int c = threadIdx.x; c < d.r; c += blockDim.x) {
      float prod = 1.0f;
      for (int dd = 0; dd < d.s; ++dd) {
        const float* S = spline + (int64_t(l) * d.s + dd) * d.kn * d.r;
        float phi = 0.0f;
        for (int q = 0; q < d.kn; ++q) phi += bas[dd * d.kn + q] * S[q * d.r + c];
        prod *= phi;
      }
      m[l * d.r + c] = prod;
    }
    __syncthreads();  // u and bas are reused by the next head
  }
  float* oi = out + int64_t(blockIdx.x) * d.D;
  for (int64_t e = threadIdx.x; e < d.D; e += blockDim.x) {
    float acc = 0.0f;
    for (int l = 0; l < d.nh; ++l)
      for (int c = 0; c < d.r; ++c)
        acc += m[l * d.r + c] * out_proj[(int64_t(l) * d.r + c) * d.D + e];
    oi[e] = acc;
  }
}

}  // namespace

void lev_forward(const ExecCtx& ctx, Tensor out, const int32_t* ids, const LevWeights& w) {
  LevDims d;
  d.k = int(w.codebooks.dim(0)), d.b = int(w.codebooks.dim(1)), d.s = int(w.codebooks.dim(2));
  d.nh = int(w.seed_proj.dim(0)), d.kn = int(w.spline.dim(2)), d.r = int(w.spline.dim(3));
  d.D = out.dim(1);
  const int64_t N = out.dim(0);
  CEMLM_CHECK(d.kn >= 2 && d.k >= 1 && d.b >= 1);
  detail::require_device(out, N * d.D);
  detail::require_device(w.codebooks, int64_t(d.k) * d.b * d.s);
  detail::require_device(w.seed_proj, int64_t(d.nh) * d.s * d.s);
  detail::require_device(w.ln_weight, int64_t(d.nh) * d.s);
  detail::require_device(w.ln_bias, int64_t(d.nh) * d.s);
  detail::require_device(w.spline, int64_t(d.nh) * d.s * d.kn * d.r);
  detail::require_device(w.out_proj, int64_t(d.nh) * d.r * d.D);
  if (N == 0) return;
  CEMLM_CHECK(ids != nullptr && N <= 0x7fffffff);
  int64_t V = 1;  // ids must be < b^k: the largest id the digits can express
  for (int j = 0; j < d.k; ++j) V *= d.b;
  const size_t smem = sizeof(float) * (size_t(2) * d.s + size_t(d.s) * d.kn + size_t(d.nh) * d.r);
  CEMLM_CHECK(smem <= 48 * 1024);
  lev_kernel<<<unsigned(N), 128, smem, detail::stream_of(ctx)>>>(
      out.data, ids, V, d, w.codebooks.data, w.seed_proj.data, w.ln_weight.data, w.ln_bias.data,
      w.spline.data, w.out_proj.data);
  CEMLM_CUDA_LAUNCH_CHECK();
}

}  // namespace cemlm::cuda
