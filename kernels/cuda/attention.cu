// CUDA paged attention (cuda/attention.h). A block per (row, head) loads its query (and diagonal
// query) into shared memory, then walks the row's positions in tiles of 32: warps compute the
// tile's scores, warp 0 updates the running max and normaliser, and every thread rescales and
// adds its slice of the value (and context) sums. The shared diagonal's context sum, the same
// for every head, is reduced over heads afterwards in a fixed order (deterministic).
#include <algorithm>
#include <atomic>
#include <vector>

#include "cemlm/kernels/cuda/attention.h"
#include "common.cuh"

namespace cemlm::cuda {
namespace {

constexpr int kTile = 32;  // one lane per position in the softmax update
constexpr int kAttnThreads = 128;

struct AttnArgs {
  float* out = nullptr;  // [N, H·d_h]
  float* oc = nullptr;   // [N, H, D] per-head context sums (out_c, or scratch for shared)
  const float* q = nullptr;
  const float* qd = nullptr;  // [N, qd_heads, D]
  const float* kp = nullptr;
  const float* vp = nullptr;
  const float* cp = nullptr;
  const AttnRow* rows = nullptr;
  int H = 0, dh = 0, W = 0, D = 0, bs = 0;
  int qd_heads = 0;  // 0: no diagonal term; 1: shared; H: per head
  float scale = 1.0f;
};

__global__ void __launch_bounds__(kAttnThreads) attention_kernel(AttnArgs a) {
  extern __shared__ float sm[];
  __shared__ int64_t s_slot[kTile];
  __shared__ float s_m, s_l, s_alpha;
  const bool diag = a.qd_heads > 0;
  const int i = blockIdx.x, h = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  float* sq = sm;                          // [d_h] query
  float* sacc = sq + a.dh;                 // [d_h] value sums
  float* sqd = sacc + a.dh;                // [D] diagonal query
  float* sacc_c = sqd + (diag ? a.D : 0);  // [D] context sums
  float* sp = sacc_c + (diag ? a.D : 0);   // [kTile] scores, then weights
  const AttnRow row = a.rows[i];
  const int n_ctx = row.pos + 1;
  const float* qi = a.q + int64_t(i) * a.W + int64_t(h) * a.dh;
  for (int e = tid; e < a.dh; e += blockDim.x) {
    sq[e] = qi[e];
    sacc[e] = 0.0f;
  }
  if (diag) {
    const float* qdi = a.qd + (int64_t(i) * a.qd_heads + (a.qd_heads > 1 ? h : 0)) * a.D;
    for (int e = tid; e < a.D; e += blockDim.x) {
      sqd[e] = qdi[e];
      sacc_c[e] = 0.0f;
    }
  }
  if (tid == 0) {
    s_m = -INFINITY;
    s_l = 0.0f;
  }
  __syncthreads();
  for (int j0 = 0; j0 < n_ctx; j0 += kTile) {
    const int nt = min(kTile, n_ctx - j0);
    if (tid < nt) {
      const int p = j0 + tid;
      s_slot[tid] = int64_t(row.blocks[p / a.bs]) * a.bs + p % a.bs;
    }
    __syncthreads();
    for (int t = warp; t < nt; t += nwarps) {
      const int64_t slot = s_slot[t];
      const float* kj = a.kp + slot * a.W + int64_t(h) * a.dh;
      float acc = 0.0f;
      for (int e = lane; e < a.dh; e += 32) acc += sq[e] * kj[e];
      if (diag) {
        const float* cj = a.cp + slot * a.D;
        for (int e = lane; e < a.D; e += 32) acc += sqd[e] * cj[e];
      }
      acc = detail::warp_sum(acc);
      if (lane == 0) sp[t] = acc * a.scale;
    }
    __syncthreads();
    if (warp == 0) {
      const float s = lane < nt ? sp[lane] : -INFINITY;
      const float m_old = s_m;
      const float m_new = fmaxf(m_old, detail::warp_max(s));
      // Scores all -inf so far (overflowed): weights 0 against 0, not exp(-inf + inf) = NaN, as
      // the CPU's chunks do.
      const float m_ref = m_new == -INFINITY ? 0.0f : m_new;
      const float p = lane < nt ? expf(s - m_ref) : 0.0f;
      const float sum = detail::warp_sum(p);
      if (lane < nt) sp[lane] = p;
      __syncwarp();  // every lane has read s_m before lane 0 replaces it
      if (lane == 0) {
        const float alpha = expf(m_old - m_ref);  // 0 on the first tile (m_old = −∞)
        s_alpha = alpha;
        s_l = s_l * alpha + sum;
        s_m = m_new;
      }
    }
    __syncthreads();
    const float alpha = s_alpha;
    const float* vh = a.vp + int64_t(h) * a.dh;
    for (int e = tid; e < a.dh; e += blockDim.x) {
      float acc = sacc[e] * alpha;
      for (int t = 0; t < nt; ++t) acc += sp[t] * vh[s_slot[t] * a.W + e];
      sacc[e] = acc;
    }
    if (diag)
      for (int e = tid; e < a.D; e += blockDim.x) {
        float acc = sacc_c[e] * alpha;
        for (int t = 0; t < nt; ++t) acc += sp[t] * a.cp[s_slot[t] * a.D + e];
        sacc_c[e] = acc;
      }
    __syncthreads();  // sp and s_slot are rewritten by the next tile
  }
  const float inv = 1.0f / s_l;
  float* oi = a.out + int64_t(i) * a.W + int64_t(h) * a.dh;
  for (int e = tid; e < a.dh; e += blockDim.x) oi[e] = sacc[e] * inv;
  if (diag) {
    float* oci = a.oc + (int64_t(i) * a.H + h) * a.D;
    for (int e = tid; e < a.D; e += blockDim.x) oci[e] = sacc_c[e] * inv;
  }
}

// out_c[i, e] = Σ_h part[i, h, e], heads in order.
__global__ void sum_heads_kernel(float* out_c, const float* part, int64_t n, int H, int64_t D) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < n;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = t / D, e = t % D;
    float acc = 0.0f;
    for (int h = 0; h < H; ++h) acc += part[(i * H + h) * D + e];
    out_c[t] = acc;
  }
}

__global__ void kv_write_kernel(const KvLayerView kv, const AttnRow* rows, const float* k,
                                const float* v, const float* c) {
  const int64_t i = blockIdx.x;
  const AttnRow row = rows[i];
  const int64_t slot =
      int64_t(row.blocks[row.pos / kv.block_size]) * kv.block_size + row.pos % kv.block_size;
  for (int e = threadIdx.x; e < kv.k_width; e += blockDim.x) {
    kv.k[slot * kv.k_width + e] = k[i * kv.k_width + e];
    if (v) kv.v[slot * kv.k_width + e] = v[i * kv.k_width + e];
  }
  if (c)
    for (int e = threadIdx.x; e < kv.c_width; e += blockDim.x)
      kv.c[slot * kv.c_width + e] = c[i * kv.c_width + e];
}

size_t attention_smem_bytes(int dh, int D, bool diag) {
  return sizeof(float) * (size_t(2) * dh + (diag ? size_t(2) * D : 0) + kTile);
}

// What attention_kernel declares statically (s_slot, s_m, s_l, s_alpha), as an upper bound for
// the fast path below; prepare_smem reads the exact figure off the compiled kernel.
constexpr size_t kStaticSmemBound = 1024;
constexpr size_t kDefaultSmem = 48 * 1024;  // per block, static + dynamic, without opting in
constexpr int kMaxDevices = 64;
std::atomic<size_t> g_reserved[kMaxDevices];  // dynamic bytes already allowed, per device

// Reads the device's opt-in limit and the kernel's static shared memory, and raises the kernel's
// dynamic limit to `bytes` when the default 48 KiB would not do (once per device and size: the
// attribute outlives the call).
AttentionSmem prepare_smem(size_t bytes) {
  AttentionSmem s;
  s.dynamic_bytes = bytes;
  int dev = 0, optin = 0;
  cudaFuncAttributes fa{};
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, attention_kernel);
  if (e == cudaSuccess && (dev < 0 || dev >= kMaxDevices)) e = cudaErrorInvalidDevice;
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    s.error = cudaGetErrorString(e);
    return s;
  }
  s.static_bytes = fa.sharedSizeBytes;
  s.device_limit = size_t(optin);
  if (!s.fits() || g_reserved[dev].load() >= bytes) return s;
  if (bytes + s.static_bytes <= kDefaultSmem) {  // allowed as it is
    g_reserved[dev].store(bytes);
    return s;
  }
  e = cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           int(bytes));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    s.error = cudaGetErrorString(e);
    return s;
  }
  g_reserved[dev].store(bytes);
  return s;
}

// The per-launch form: free when the block fits the default; otherwise a no-op once init (or an
// earlier launch) raised the limit. A model too wide for the device is refused at init.
void reserve_smem(size_t bytes) {
  if (bytes + kStaticSmemBound <= kDefaultSmem) return;
  int dev = 0;
  CEMLM_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 0 && dev < kMaxDevices && g_reserved[dev].load() >= bytes) return;
  const AttentionSmem s = prepare_smem(bytes);
  CEMLM_CHECK(s.error == nullptr && s.fits());  // d_model too wide for one block's shared memory
}

// Host AttnSeq descriptors → the per-row table, staged into ctx.scratch. Every row in
// [0, n_rows) must belong to a sequence (the kernels have no "skip" rows).
const AttnRow* stage_rows(const ExecCtx& ctx, const AttnSeq* seqs, int n_seqs, int* n_rows) {
  int n = 0;
  for (int s = 0; s < n_seqs; ++s) n = std::max(n, seqs[s].row_begin + seqs[s].n_rows);
  std::vector<AttnRow> rows(static_cast<size_t>(n));
  std::vector<char> covered(static_cast<size_t>(n), 0);
  for (int s = 0; s < n_seqs; ++s) {
    CEMLM_CHECK(seqs[s].blocks != nullptr && seqs[s].pos_begin >= 0);
    for (int r = 0; r < seqs[s].n_rows; ++r) {
      rows[size_t(seqs[s].row_begin + r)] = AttnRow{seqs[s].blocks, seqs[s].pos_begin + r, 0};
      covered[size_t(seqs[s].row_begin + r)] = 1;
    }
  }
  CEMLM_CHECK(std::all_of(covered.begin(), covered.end(), [](char c) { return c != 0; }));
  static_assert(sizeof(AttnRow) == 4 * sizeof(float));
  CEMLM_CHECK(ctx.scratch != nullptr && ctx.scratch_floats >= int64_t(4) * n);
  const cudaStream_t stream = detail::stream_of(ctx);
  if (n > 0) {
    CEMLM_CUDA_CHECK(cudaMemcpyAsync(ctx.scratch, rows.data(), sizeof(AttnRow) * rows.size(),
                                     cudaMemcpyHostToDevice, stream));
    CEMLM_CUDA_CHECK(cudaStreamSynchronize(stream));  // `rows` dies on return
  }
  *n_rows = n;
  return reinterpret_cast<const AttnRow*>(ctx.scratch);
}

ExecCtx after_rows(const ExecCtx& ctx, int n_rows) {
  ExecCtx rest = ctx;
  rest.scratch = ctx.scratch + int64_t(4) * n_rows;
  rest.scratch_floats = ctx.scratch_floats - int64_t(4) * n_rows;
  return rest;
}

}  // namespace

AttentionSmem paged_attention_prepare(int head_dim, int d_model, bool diag) {
  return prepare_smem(attention_smem_bytes(head_dim, d_model, diag));
}

void kv_write_rows(const ExecCtx& ctx, const KvLayerView& kv, const AttnRow* rows, int n_rows,
                   const Tensor& k, const Tensor& v, const Tensor& c) {
  CEMLM_CHECK(kv.k != nullptr && kv.block_size > 0);
  // Token-major fp32 only: the tiled, bf16 and int8 layouts are the CPU runner's.
  CEMLM_CHECK(!kv.tiled && !kv.bf16() && !kv.int8());
  detail::require_device(k, int64_t(n_rows) * kv.k_width);
  const bool with_v = kv.v && !v.empty(), with_c = kv.c && !c.empty();
  if (with_v) detail::require_device(v, int64_t(n_rows) * kv.k_width);
  if (with_c) detail::require_device(c, int64_t(n_rows) * kv.c_width);
  if (n_rows == 0) return;
  CEMLM_CHECK(rows != nullptr);
  kv_write_kernel<<<unsigned(n_rows), kAttnThreads, 0, detail::stream_of(ctx)>>>(
      kv, rows, k.data, with_v ? v.data : nullptr, with_c ? c.data : nullptr);
  CEMLM_CUDA_LAUNCH_CHECK();
}

void paged_attention_rows(const ExecCtx& ctx, Tensor out, Tensor out_c, const Tensor& q,
                          const Tensor& qd, DiagKind diag, const KvLayerView& kv,
                          const AttnRow* rows, int n_rows, float scale) {
  const int W = kv.k_width, D = kv.c_width, H = kv.n_heads;
  CEMLM_CHECK(H >= 1 && W % H == 0 && kv.k != nullptr && kv.block_size > 0);
  CEMLM_CHECK(!kv.tiled && !kv.bf16() && !kv.int8());  // as kv_write_rows
  detail::require_device(q, int64_t(n_rows) * W);
  detail::require_device(out, int64_t(n_rows) * W);
  const int qd_heads = diag == DiagKind::kNone ? 0 : diag == DiagKind::kShared ? 1 : H;
  if (qd_heads) {
    CEMLM_CHECK(kv.c != nullptr && D > 0);
    detail::require_device(qd, int64_t(n_rows) * qd_heads * D);
    detail::require_device(out_c, int64_t(n_rows) * qd_heads * D);
  }
  if (n_rows == 0) return;
  CEMLM_CHECK(rows != nullptr && H <= 65535);
  AttnArgs a;
  a.out = out.data;
  a.q = q.data;
  a.qd = qd_heads ? qd.data : nullptr;
  a.kp = kv.k;
  a.vp = kv.v ? kv.v : kv.k;
  a.cp = kv.c;
  a.rows = rows;
  a.H = H, a.dh = W / H, a.W = W, a.D = D, a.bs = kv.block_size;
  a.qd_heads = qd_heads;
  a.scale = scale;
  if (diag == DiagKind::kShared) {
    CEMLM_CHECK(ctx.scratch != nullptr &&
                ctx.scratch_floats >= paged_attention_rows_scratch_floats(n_rows, kv, diag));
    a.oc = ctx.scratch;
  } else if (diag == DiagKind::kPerHead) {
    a.oc = out_c.data;
  }
  const size_t smem = attention_smem_bytes(a.dh, D, qd_heads > 0);
  reserve_smem(smem);
  const cudaStream_t stream = detail::stream_of(ctx);
  attention_kernel<<<dim3(unsigned(n_rows), unsigned(H)), kAttnThreads, smem, stream>>>(a);
  CEMLM_CUDA_LAUNCH_CHECK();
  if (diag == DiagKind::kShared) {
    const int64_t n = int64_t(n_rows) * D;
    sum_heads_kernel<<<detail::grid_for(n), detail::kThreads, 0, stream>>>(out_c.data, a.oc, n, H,
                                                                           D);
    CEMLM_CUDA_LAUNCH_CHECK();
  }
}

void kv_write(const ExecCtx& ctx, const KvLayerView& kv, const AttnSeq* seqs, int n_seqs,
              const Tensor& k, const Tensor& v, const Tensor& c) {
  int n_rows = 0;
  const AttnRow* rows = stage_rows(ctx, seqs, n_seqs, &n_rows);
  kv_write_rows(ctx, kv, rows, n_rows, k, v, c);
}

int64_t paged_attention_scratch_floats(const AttnSeq* seqs, int n_seqs, const KvLayerView& kv,
                                       DiagKind diag) {
  int n = 0;
  for (int s = 0; s < n_seqs; ++s) n = std::max(n, seqs[s].row_begin + seqs[s].n_rows);
  return int64_t(4) * n + paged_attention_rows_scratch_floats(n, kv, diag);
}

void paged_attention_forward(const ExecCtx& ctx, Tensor out, Tensor out_c, const Tensor& q,
                             const Tensor& qd, DiagKind diag, const KvLayerView& kv,
                             const AttnSeq* seqs, int n_seqs, float scale) {
  int n_rows = 0;
  const AttnRow* rows = stage_rows(ctx, seqs, n_seqs, &n_rows);
  paged_attention_rows(after_rows(ctx, n_rows), out, out_c, q, qd, diag, kv, rows, n_rows, scale);
}

}  // namespace cemlm::cuda
