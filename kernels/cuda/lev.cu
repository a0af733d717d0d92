// CUDA LEV generator (lev.h): one block per token. The per-token hyper-parameter-sized pieces
// (seed, LayerNorm statistics, spline weights, the rank-r product) follow the CPU oracle
// (kernels/cpu/lev.cc) in the same summation orders; threads split the s, r and D loops.
#include "cemlm/kernels/lev_window.h"
#include "cemlm/kernels/cuda/ops.h"
#include "common.cuh"

namespace cemlm::cuda {
namespace {

struct LevDims {
  int k, b, s, nh, kn, r;
  int64_t D;
};

// Shared memory: z[s] (the token's seed), u[s] (a head's projection, then each dimension's
// spline coordinate), m[r] (the head's rank-r product). It grows with s and r only, never with
// the knots: at the config's limits (s, r <= 4096) it is 48 KiB.
__global__ void lev_kernel(float* out, const int32_t* ids, int64_t V, LevDims d,
                           const float* codebooks, const float* seed_proj, const float* ln_w,
                           const float* ln_b, const float* spline, const float* out_proj) {
  extern __shared__ float sm[];
  float* z = sm;
  float* u = z + d.s;
  float* m = u + d.s;
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
  float* oi = out + int64_t(blockIdx.x) * d.D;
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
    for (int dd = threadIdx.x; dd < d.s; dd += blockDim.x) {  // u[dd] becomes its zeta
      const float y = ln_w[l * d.s + dd] * float(u[dd] - s_mean) * s_rs + ln_b[l * d.s + dd];
      u[dd] = 1.0f / (1.0f + expf(-y));
    }
    for (int c = threadIdx.x; c < d.r; c += blockDim.x) m[c] = 1.0f;
    __syncthreads();
    // Each thread owns its columns c of m; every thread derives the (few) weights itself. Only
    // the window's knots have a share (lev_window.h): the sums skip zeros only, in the CPU's order.
    for (int dd = 0; dd < d.s; ++dd) {
      float w[kLevWindow];
      const int q0 = lev_basis_window(u[dd], d.kn, w);
      const int n = min(kLevWindow, d.kn);
      const float* S = spline + ((int64_t(l) * d.s + dd) * d.kn + q0) * d.r;
      for (int c = threadIdx.x; c < d.r; c += blockDim.x) {
        float phi = 0.0f;
#pragma unroll
        for (int j = 0; j < kLevWindow; ++j)
          if (j < n) phi += w[j] * S[int64_t(j) * d.r + c];
        m[c] *= phi;
      }
    }
    __syncthreads();
    // out += m · out_proj[l], per head into the row as on the CPU (same order of additions).
    const float* O = out_proj + int64_t(l) * d.r * d.D;
    for (int64_t e = threadIdx.x; e < d.D; e += blockDim.x) {
      float acc = l == 0 ? 0.0f : oi[e];
      for (int c = 0; c < d.r; ++c) acc += m[c] * O[int64_t(c) * d.D + e];
      oi[e] = acc;
    }
    __syncthreads();  // u and m are reused by the next head
  }
  if (d.nh == 0)
    for (int64_t e = threadIdx.x; e < d.D; e += blockDim.x) oi[e] = 0.0f;
}

// Lets lev_kernel take `bytes` of dynamic shared memory. Past the default 48 KiB (static
// included) it opts in, which every sm_80+ device allows up to at least 99 KiB, more than the
// largest config the parser accepts needs.
void reserve_lev_smem(size_t bytes) {
  cudaFuncAttributes fa{};
  CEMLM_CUDA_CHECK(cudaFuncGetAttributes(&fa, lev_kernel));
  if (bytes + fa.sharedSizeBytes <= 48 * 1024) return;
  int dev = 0, optin = 0;
  CEMLM_CUDA_CHECK(cudaGetDevice(&dev));
  CEMLM_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  CEMLM_CHECK(bytes + fa.sharedSizeBytes <= size_t(optin));
  CEMLM_CUDA_CHECK(
      cudaFuncSetAttribute(lev_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
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
  const size_t smem = sizeof(float) * (size_t(2) * d.s + size_t(d.r));
  reserve_lev_smem(smem);
  lev_kernel<<<unsigned(N), 128, smem, detail::stream_of(ctx)>>>(
      out.data, ids, V, d, w.codebooks.data, w.seed_proj.data, w.ln_weight.data, w.ln_bias.data,
      w.spline.data, w.out_proj.data);
  CEMLM_CUDA_LAUNCH_CHECK();
}

}  // namespace cemlm::cuda
