// Shared helpers of the CUDA kernels: context accessors, device-tensor checks, launch geometry
// and warp/block reductions. Internal to kernels/cuda/.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cemlm/kernels/cuda/check.h"
#include "cemlm/kernels/tensor.h"

namespace cemlm::cuda::detail {

inline cudaStream_t stream_of(const ExecCtx& ctx) {
  CEMLM_CHECK(ctx.device == Device::kCuda);
  return static_cast<cudaStream_t>(ctx.cuda_stream);
}

// Catches host tensors handed to a CUDA op (the commonest pointer mix-up).
inline void require_device(const Tensor& t) { CEMLM_CHECK(t.empty() || t.device == Device::kCuda); }
inline void require_device(const Tensor& t, int64_t numel) {
  CEMLM_CHECK(!t.empty() && t.device == Device::kCuda && t.numel() == numel);
}

constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n items (capped: the loop covers the rest).
inline unsigned grid_for(int64_t n, int threads = kThreads) {
  const int64_t b = (n + threads - 1) / threads;
  return unsigned(b < 1 ? 1 : (b > 65536 ? 65536 : b));
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// `red` is __shared__ storage of 32 elements. The call starts with a barrier (a previous call may
// still be reading `red`) but does not end with one: threads may still read `red` after some
// have returned, so a caller must synchronize before writing `red` itself.
template <typename T>
__device__ T block_sum(T v, T* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // `red` may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T t = lane < nw ? red[lane] : T(0);
  t = warp_sum(t);
  return t;
}

__device__ __forceinline__ float block_max(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = lane < nw ? red[lane] : -INFINITY;
  return warp_max(t);
}

}  // namespace cemlm::cuda::detail
