// The machine's ceilings for the CPU engine, against which bench/engine's steps are read: the fp32
// FMA rate (independent chains of fused multiply-adds on the widest vectors the CPU has) and the
// streaming read bandwidth of an array far larger than the caches, each on 1 thread and on N.
// Usage: bench/peaks [THREADS] (default: the CPUs this process may use).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include "machine.h"

namespace cemlm::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kChains = 12;  // independent accumulators: latency × pipes with room to spare

// Fused multiply-adds on `kChains` registers V of `Lanes` floats, `iters` rounds; returns a value
// depending on all of them so that none is optimized away. Inlined into a function built for the
// vectors' width (GCC's vector types: the multiply-add becomes one vfmadd per register).
typedef float V16 __attribute__((vector_size(64)));
typedef float V8 __attribute__((vector_size(32)));

template <typename V, int Lanes>
[[gnu::always_inline]] inline float fma_chains(long iters) {
  V acc[kChains];
  const V b = V{} + 0.999f, c = V{} + 0.001f;
  for (int i = 0; i < kChains; ++i) acc[i] = V{} + float(i);
  for (long it = 0; it < iters; ++it) {
    // Unrolled, so that the accumulators live in registers (in memory, the loop is bound by
    // their stores and measures a third of the rate).
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = acc[i] * b + c;
  }
  float s = 0;
  for (int i = 0; i < kChains; ++i)
    for (int l = 0; l < Lanes; ++l) s += acc[i][l];
  return s;
}

__attribute__((target("avx512f"))) float fma_chains_512(long iters) {
  return fma_chains<V16, 16>(iters);
}
__attribute__((target("avx2,fma"))) float fma_chains_256(long iters) {
  return fma_chains<V8, 8>(iters);
}

// Sums floats [begin, end) of `a` with four independent vector accumulators: a read stream.
__attribute__((target("avx2"))) float read_sum(const float* a, size_t begin, size_t end) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = begin; i + 32 <= end; i += 32) {
    s0 = _mm256_add_ps(s0, _mm256_load_ps(a + i));
    s1 = _mm256_add_ps(s1, _mm256_load_ps(a + i + 8));
    s2 = _mm256_add_ps(s2, _mm256_load_ps(a + i + 16));
    s3 = _mm256_add_ps(s3, _mm256_load_ps(a + i + 24));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  float s = 0;
  for (float x : lanes) s += x;
  return s;
}

// The best of `reps` runs of `work(thread)` on `threads` threads at once, in seconds.
template <typename Work>
double best_seconds(int threads, int reps, Work work) {
  double best = 1e30;
  std::atomic<float> sink{0};
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { sink = sink + work(t); });
    for (auto& th : pool) th.join();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  if (sink.load() == 12345.0f) std::puts("");  // keeps the sums alive
  return best;
}

}  // namespace
}  // namespace cemlm::bench

int main(int argc, char** argv) {
  using namespace cemlm::bench;
  int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  if (int rc = positional_counts(argc, argv, "usage: bench/peaks [THREADS]\n", {&threads}); rc >= 0)
    return rc;
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f");
  if (!avx512 && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) {
    std::fprintf(stderr, "bench/peaks needs AVX2 and FMA\n");
    return 1;
  }
  std::printf("%s\n", machine_line().c_str());
  const int lanes = avx512 ? 16 : 8;
  const long iters = 20'000'000;
  const size_t n = size_t(1) << 28;  // 1 GiB of floats: past any cache
  std::unique_ptr<float, decltype(&std::free)> a(
      static_cast<float*>(std::aligned_alloc(64, n * sizeof(float))), &std::free);
  if (!a) {
    std::fprintf(stderr, "bench/peaks: cannot allocate the 1 GiB read array\n");
    return 1;
  }
  std::fill(a.get(), a.get() + n, 1.0f);  // touched, so that reads find pages
  std::printf("%-8s %22s %22s\n", "threads", "fp32 FMA GFLOP/s", "read GB/s (1 GiB)");
  for (int t : {1, threads}) {
    const double fma_s = best_seconds(
        t, 5, [&](int) { return avx512 ? fma_chains_512(iters) : fma_chains_256(iters); });
    const double flops = 2.0 * double(iters) * kChains * lanes * t;
    const double read_s = best_seconds(t, 5, [&](int k) {
      const size_t per = n / size_t(t);
      return read_sum(a.get(), size_t(k) * per, size_t(k + 1) * per);
    });
    std::printf("%-8d %22.1f %22.1f\n", t, flops / fma_s / 1e9, double(n) * 4 / read_s / 1e9);
    if (threads == 1) break;  // the one row
  }
  std::printf(
      "(%s vectors; a step's products cannot beat the FMA rate, nor its weight and cache "
      "reads the read rate)\n",
      avx512 ? "AVX-512" : "AVX2");
  return 0;
}
