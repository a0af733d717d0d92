// On-device sampling (cuda/sampling.h). Three passes per call: (1) per row, the raw log-sum-exp,
// penalties from token counts, the greedy argmax and the temperature-scaled keys; (2) one
// segmented radix sort (descending, stable: ties keep ascending ids) over the rows that need an
// order (top-k, top-p, min-p); (3) per row, the cuts on the sorted order, then the draw over the
// kept tokens in id order, as block-wide prefix scans in double, mirroring the host Sampler
// (engine/src/sampler.cc).
#include <cfloat>
#include <climits>
#include <cstring>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>
#include <vector>

#include "cemlm/kernels/cuda/sampling.h"
#include "common.cuh"

namespace cemlm::cuda {
namespace {

constexpr int kSampleThreads = 1024;

struct DevRow {
  double uniform;
  float temperature, top_p, min_p, rep, pres, freq;
  int top_k, hist_begin, n_hist, n_prompt, sorted;
};

// log Σ exp(raw) in two parts, as the host's LogNormalizer: max + log_sum in one float loses
// log_sum once |max| passes ~1e5 (a 10-way tie at 1e8 read as probability 1).
struct RowStat {
  float mx;       // the raw row's max; NaN when a logit is NaN
  float log_sum;  // log Σ exp(raw − mx)
  int argmax;     // of the penalized logits, lowest id on ties
};

bool needs_order(const SampleRowSpec& r, int V) {
  return r.temperature > 0 && ((r.top_k > 0 && r.top_k < V) || r.top_p < 1 || r.min_p > 0);
}
bool has_penalty(const SampleRowSpec& r) {
  return r.repetition_penalty != 1.0f || r.presence_penalty != 0 || r.frequency_penalty != 0;
}

// Byte offsets of each region in ctx.scratch (256-aligned).
struct Layout {
  size_t rows = 0, hist = 0, seg_begin = 0, seg_end = 0, cnt_all = 0, cnt_gen = 0, keys_in = 0,
         keys_out = 0, ids_in = 0, ids_out = 0, stats = 0, results = 0, cub = 0, cub_bytes = 0,
         total = 0;
  bool penalties = false, sort = false;
};

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

Layout layout_for(const SampleRowSpec* rows, int N, int V) {
  Layout L;
  size_t hist = 0;
  for (int r = 0; r < N; ++r) {
    hist += size_t(rows[r].n_tokens);
    L.penalties = L.penalties || has_penalty(rows[r]);
    L.sort = L.sort || needs_order(rows[r], V);
  }
  const size_t NV = size_t(N) * size_t(V);
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t here = at;
    at = align256(at + bytes);
    return here;
  };
  L.rows = take(sizeof(DevRow) * N);
  L.hist = take(sizeof(int32_t) * hist);
  L.seg_begin = take(sizeof(int) * N);
  L.seg_end = take(sizeof(int) * N);
  L.cnt_all = take(L.penalties ? sizeof(int) * NV : 0);
  L.cnt_gen = take(L.penalties ? sizeof(int) * NV : 0);
  L.keys_in = take(sizeof(float) * NV);
  L.ids_in = take(sizeof(int32_t) * NV);
  L.keys_out = take(L.sort ? sizeof(float) * NV : 0);
  L.ids_out = take(L.sort ? sizeof(int32_t) * NV : 0);
  L.stats = take(sizeof(RowStat) * N);
  L.results = take(sizeof(SampledToken) * N);
  if (L.sort)
    CEMLM_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
        nullptr, L.cub_bytes, static_cast<const float*>(nullptr), static_cast<float*>(nullptr),
        static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), int(NV), N,
        static_cast<const int*>(nullptr), static_cast<const int*>(nullptr)));
  L.cub = take(L.cub_bytes);
  L.total = at;
  return L;
}

template <typename T>
T* at(const ExecCtx& ctx, size_t offset) {
  return reinterpret_cast<T*>(reinterpret_cast<char*>(ctx.scratch) + offset);
}

// Is (v, i) ahead of (w, j) for the argmax: larger value, then lower id.
__device__ bool ahead(float v, int i, float w, int j) { return v > w || (v == w && i < j); }
__device__ float clamp_finite(float x) { return fminf(fmaxf(x, -FLT_MAX), FLT_MAX); }

__global__ void __launch_bounds__(kSampleThreads)
    prepare_kernel(const float* logits, int V, const DevRow* rows, const int32_t* hist,
                   int* cnt_all, int* cnt_gen, float* keys, int32_t* ids, RowStat* stats) {
  __shared__ float redf[32];
  __shared__ double redd[32];
  __shared__ float best_v[32];
  __shared__ int best_i[32];
  const int row = blockIdx.x, tid = threadIdx.x;
  const DevRow R = rows[row];
  const float* x = logits + int64_t(row) * V;
  float mx = -INFINITY;
  bool nan = false;
  for (int v = tid; v < V; v += blockDim.x) {
    nan = nan || isnan(x[v]);
    mx = fmaxf(mx, x[v]);
  }
  mx = detail::block_max(mx, redf);
  double s = 0;
  for (int v = tid; v < V; v += blockDim.x) s += exp(double(x[v] - mx));
  s = detail::block_sum(s, redd);
  const int any_nan = __syncthreads_or(nan);
  const float row_max = any_nan ? NAN : mx, log_sum = float(log(s));

  const bool rep = R.rep != 1.0f, pf = R.pres != 0.0f || R.freq != 0.0f;
  int* ca = cnt_all ? cnt_all + int64_t(row) * V : nullptr;
  int* cg = cnt_gen ? cnt_gen + int64_t(row) * V : nullptr;
  if (rep || pf) {
    for (int t = tid; t < R.n_hist; t += blockDim.x) {
      const int tok = hist[R.hist_begin + t];
      if (rep) atomicAdd(&ca[tok], 1);
      if (pf && t >= R.n_prompt) atomicAdd(&cg[tok], 1);
    }
    __syncthreads();
  }
  const float inv_t = R.temperature > 0 ? 1.0f / R.temperature : 1.0f;
  float bv = -INFINITY;
  int bi = INT_MAX;
  float* key = keys + int64_t(row) * V;
  for (int v = tid; v < V; v += blockDim.x) {
    // Penalized logits stay finite, as the host Sampler's do, and a token the model gives no
    // probability (-inf) keeps none.
    float w = x[v];
    if (rep && ca[v] > 0 && w != -INFINITY) w = clamp_finite(w > 0 ? w / R.rep : w * R.rep);
    if (pf && cg[v] > 0 && w != -INFINITY) w = clamp_finite(w - (R.pres + R.freq * float(cg[v])));
    if (ahead(w, v, bv, bi)) bv = w, bi = v;
    key[v] = w;
    ids[int64_t(row) * V + v] = v;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ahead(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  const int lane = tid & 31, warp = tid >> 5;
  if (lane == 0) best_v[warp] = bv, best_i[warp] = bi;
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < int(blockDim.x >> 5); ++w)
      if (ahead(best_v[w], best_i[w], bv, bi)) bv = best_v[w], bi = best_i[w];
    best_v[0] = bv;
    stats[row] = RowStat{row_max, log_sum, bi};
  }
  __syncthreads();
  // Keys shifted by the best logit before scaling, as the host Sampler's: huge logits over a
  // small temperature cannot overflow to +inf.
  bv = best_v[0];
  for (int v = tid; v < V; v += blockDim.x)
    // −0 as +0: the radix sort tells them apart. Not contracted to an FMA, which keeps the sign
    // of a product that underflows to −0.
    key[v] = __fmul_rn(key[v] - bv, inv_t) + 0.0f;
}

using BlockScan = cub::BlockScan<double, kSampleThreads>;

// Smallest i < n whose inclusive prefix Σ_{j≤i} e(j) reaches `target` (> when strict, ≥
// otherwise); n when none does. Every thread of the block calls it and gets the answer.
template <typename E>
__device__ int first_reaching(E e, int n, double target, bool strict, BlockScan::TempStorage& temp,
                              int* found) {
  double carry = 0;
  for (int base = 0; base < n; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const double v = i < n ? double(e(i)) : 0.0;
    double incl = 0, total = 0;
    BlockScan(temp).InclusiveSum(v, incl, total);
    incl += carry;
    if (threadIdx.x == 0) *found = INT_MAX;
    __syncthreads();
    if (i < n && (strict ? incl > target : incl >= target)) atomicMin(found, i);
    __syncthreads();
    const int f = *found;
    carry += total;
    __syncthreads();  // `temp` and `found` are reused
    if (f != INT_MAX) return f;
  }
  return n;
}

// Smallest i in [1, n) with e(i) < threshold; n when none.
template <typename E>
__device__ int first_below(E e, int n, float threshold, int* found) {
  if (threadIdx.x == 0) *found = n;
  __syncthreads();
  for (int i = 1 + threadIdx.x; i < n; i += blockDim.x)
    if (e(i) < threshold) atomicMin(found, i);
  __syncthreads();
  const int f = *found;
  __syncthreads();
  return f;
}

__global__ void __launch_bounds__(kSampleThreads)
    draw_kernel(const float* logits, int V, const DevRow* rows, const RowStat* stats,
                const float* keys_in, const float* keys_out, const int32_t* ids_out,
                SampledToken* results) {
  __shared__ BlockScan::TempStorage temp;
  __shared__ double redd[32];
  __shared__ int found, last_kept;
  const int row = blockIdx.x;
  const DevRow R = rows[row];
  const RowStat st = stats[row];
  if (!isfinite(st.mx)) {
    if (threadIdx.x == 0) results[row] = SampledToken{-1, NAN};
    return;
  }
  int token = st.argmax;
  if (R.temperature > 0) {
    const float* key = keys_in + int64_t(row) * V;
    // The kept set: the first n of the sorted order (top-k, the top-p prefix, the min-p cut), or
    // every token. Sorted order is (key desc, id asc), so token i is kept exactly when it is not
    // behind the n-th candidate (kc, ic).
    float kc = -INFINITY;
    int ic = V - 1;
    if (R.sorted) {
      const float* sk = keys_out + int64_t(row) * V;
      auto es = [sk](int i) { return expf(sk[i]); };
      int n = V;
      if (R.top_k > 0 && R.top_k < n) n = R.top_k;
      if (R.top_p < 1.0f) {
        double sum = 0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) sum += es(i);
        sum = detail::block_sum(sum, redd);
        const int f = first_reaching(es, n, double(R.top_p) * sum, false, temp, &found);
        n = f < n ? f + 1 : n;
      }
      if (R.min_p > 0.0f) n = first_below(es, n, R.min_p * es(0), &found);
      kc = sk[n - 1];
      ic = ids_out[int64_t(row) * V + n - 1];
    }
    auto kept = [key, kc, ic](int i) { return key[i] > kc || (key[i] == kc && i <= ic); };
    auto e = [key, kept](int i) { return kept(i) ? expf(key[i]) : 0.0f; };
    // As the host Sampler draws: the kept candidates walked in id order.
    if (threadIdx.x == 0) last_kept = 0;
    double sum = 0;
    int last = -1;
    for (int i = threadIdx.x; i < V; i += blockDim.x)
      if (const float ei = e(i); ei > 0) sum += ei, last = i;  // the last with a share
    __syncthreads();
    atomicMax(&last_kept, last);
    sum = detail::block_sum(sum, redd);  // synchronizes the block: last_kept is final
    token = first_reaching(e, last_kept, R.uniform * sum, true, temp, &found);
  }
  if (threadIdx.x == 0)
    results[row] = SampledToken{
        token, float((double(logits[int64_t(row) * V + token]) - st.mx) - double(st.log_sum))};
}

}  // namespace

int64_t sample_rows_scratch_floats(const SampleRowSpec* rows, int n_rows, int vocab) {
  return int64_t((layout_for(rows, n_rows, vocab).total + sizeof(float) - 1) / sizeof(float));
}

int64_t sample_rows_max_scratch_floats(int n_rows, int vocab, int history) {
  CEMLM_CHECK(n_rows >= 0 && vocab >= 1 && history >= 0 && int64_t(n_rows) * vocab <= INT_MAX);
  SampleRowSpec worst;  // sorted (top_p < 1) and penalised: every optional region is taken
  worst.top_p = 0.5f;
  worst.repetition_penalty = 2.0f;
  worst.n_tokens = history;
  const std::vector<SampleRowSpec> rows(size_t(n_rows), worst);
  return sample_rows_scratch_floats(rows.data(), n_rows, vocab);
}

void sample_rows(const ExecCtx& ctx, const Tensor& logits, const SampleRowSpec* rows, int n_rows,
                 SampledToken* out) {
  if (n_rows == 0) return;
  const int V = int(logits.dim(-1));
  CEMLM_CHECK(V >= 1 && logits.dim(0) == n_rows);
  CEMLM_CHECK(int64_t(n_rows) * V <= INT_MAX);  // cub's item count is an int
  detail::require_device(logits, int64_t(n_rows) * V);
  const Layout L = layout_for(rows, n_rows, V);
  CEMLM_CHECK(ctx.scratch != nullptr &&
              ctx.scratch_floats >= sample_rows_scratch_floats(rows, n_rows, V));
  const cudaStream_t stream = detail::stream_of(ctx);

  // Row parameters, token histories and sort segments: one upload.
  std::vector<char> host(L.cnt_all);
  auto* dr = reinterpret_cast<DevRow*>(host.data() + L.rows);
  auto* hist = reinterpret_cast<int32_t*>(host.data() + L.hist);
  auto* seg_begin = reinterpret_cast<int*>(host.data() + L.seg_begin);
  auto* seg_end = reinterpret_cast<int*>(host.data() + L.seg_end);
  int hb = 0;
  for (int r = 0; r < n_rows; ++r) {
    const SampleRowSpec& s = rows[r];
    CEMLM_CHECK(s.temperature >= 0 && s.top_p > 0 && s.top_p <= 1 && s.min_p >= 0 && s.min_p <= 1 &&
                s.top_k >= 0 && s.repetition_penalty > 0);
    CEMLM_CHECK(s.n_tokens >= 0 && s.n_prompt >= 0 && s.n_prompt <= s.n_tokens);
    CEMLM_CHECK(s.uniform >= 0 && s.uniform < 1);
    CEMLM_CHECK(s.n_tokens == 0 || s.tokens != nullptr);
    for (int t = 0; t < s.n_tokens; ++t) CEMLM_CHECK(s.tokens[t] >= 0 && s.tokens[t] < V);
    if (s.n_tokens) std::memcpy(hist + hb, s.tokens, sizeof(int32_t) * size_t(s.n_tokens));
    const bool sorted = needs_order(s, V);
    dr[r] = DevRow{s.uniform,          s.temperature,       s.top_p, s.min_p, s.repetition_penalty,
                   s.presence_penalty, s.frequency_penalty, s.top_k, hb,      s.n_tokens,
                   s.n_prompt,         sorted ? 1 : 0};
    seg_begin[r] = r * V;
    seg_end[r] = sorted ? (r + 1) * V : r * V;  // empty segment: not sorted
    hb += s.n_tokens;
  }
  CEMLM_CUDA_CHECK(
      cudaMemcpyAsync(ctx.scratch, host.data(), host.size(), cudaMemcpyHostToDevice, stream));
  int* cnt_all = L.penalties ? at<int>(ctx, L.cnt_all) : nullptr;
  int* cnt_gen = L.penalties ? at<int>(ctx, L.cnt_gen) : nullptr;
  if (L.penalties) CEMLM_CUDA_CHECK(cudaMemsetAsync(cnt_all, 0, L.keys_in - L.cnt_all, stream));
  const auto* d_rows = at<DevRow>(ctx, L.rows);
  prepare_kernel<<<unsigned(n_rows), kSampleThreads, 0, stream>>>(
      logits.data, V, d_rows, at<int32_t>(ctx, L.hist), cnt_all, cnt_gen, at<float>(ctx, L.keys_in),
      at<int32_t>(ctx, L.ids_in), at<RowStat>(ctx, L.stats));
  CEMLM_CUDA_LAUNCH_CHECK();
  if (L.sort) {
    size_t bytes = L.cub_bytes;
    CEMLM_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortPairsDescending(
        at<void>(ctx, L.cub), bytes, at<const float>(ctx, L.keys_in), at<float>(ctx, L.keys_out),
        at<const int32_t>(ctx, L.ids_in), at<int32_t>(ctx, L.ids_out), n_rows * V, n_rows,
        at<const int>(ctx, L.seg_begin), at<const int>(ctx, L.seg_end), 0, 32, stream));
  }
  draw_kernel<<<unsigned(n_rows), kSampleThreads, 0, stream>>>(
      logits.data, V, d_rows, at<RowStat>(ctx, L.stats), at<float>(ctx, L.keys_in),
      L.sort ? at<float>(ctx, L.keys_out) : nullptr, L.sort ? at<int32_t>(ctx, L.ids_out) : nullptr,
      at<SampledToken>(ctx, L.results));
  CEMLM_CUDA_LAUNCH_CHECK();
  CEMLM_CUDA_CHECK(cudaMemcpyAsync(out, at<SampledToken>(ctx, L.results),
                                   sizeof(SampledToken) * size_t(n_rows), cudaMemcpyDeviceToHost,
                                   stream));
  CEMLM_CUDA_CHECK(cudaStreamSynchronize(stream));  // also keeps `host` alive for its upload
}

}  // namespace cemlm::cuda
