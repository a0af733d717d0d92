// bench/engine_gpu: the CUDA runner (bf16 serving path) on a 0.4B-parameter model, standard and
// full CEM: decode tokens/s at batch 1, 32, 256 and T = 1, 2, 4, and prefill tokens/s, each as a
// fraction of a roofline measured in the same run: decode against the bytes a step must move
// (weights + KV cache) at the measured device copy bandwidth, prefill against its FLOPs at the
// measured cuBLAS bf16 rate. Prints a table; see docs/BENCHMARKS.md. `--small`: a quick smoke run.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cemlm/engine/cuda_runner.h"
#include "cemlm/kernels/cuda/buffer.h"
#include "cemlm/kernels/cuda/check.h"
#include "machine.h"

namespace {

using namespace cemlm;
using Clock = std::chrono::steady_clock;

struct Setup {
  bool small = false;
  int prompt = 128, decode_steps = 16, prefill_seqs = 16, prefill_len = 512;
  int max_rows = 8192;  // rows per forward when prefilling (a scheduler's token budget)
};

ModelConfig bench_config(bool cem, bool small) {
  ModelConfig c;
  c.vocab_size = 32000, c.d_model = 2048, c.n_layers = 8, c.n_heads = 16, c.head_dim = 128;
  c.d_ff = 5632, c.max_seq_len = 2048;
  if (small)
    c.vocab_size = 4096, c.d_model = 256, c.n_layers = 2, c.n_heads = 4, c.head_dim = 64,
    c.d_ff = 768;
  if (cem) {
    c.attention = AttentionType::kCem, c.diag = DiagMode::kShared, c.attn_precond_rank = 8;
    c.mlp = MlpType::kCem, c.mlp_precond_rank = 8;
  }
  return c;
}

// Deterministic pseudo-random weights, fast (init_random's normals are slow at this size):
// uniform with the layout's std, ones/zeros/softplus-one where the layout says so.
void fill_params(ParamStore& s) {
  for (const ParamSpec& spec : s.specs()) {
    float* p = s.flat().data() + spec.offset;
    const int64_t n = spec.numel();
    const float half_width = spec.std * std::sqrt(3.0f);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      uint64_t z = uint64_t(spec.offset + i) * 0x9e3779b97f4a7c15ULL;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      const float u = float((z ^ (z >> 31)) >> 40) / float(1 << 24) * 2.0f - 1.0f;
      switch (spec.init) {
        case InitKind::kOnes:
          p[i] = 1.0f;
          break;
        case InitKind::kZeros:
          p[i] = 0.01f * u;
          break;  // non-zero: every term costs its time
        case InitKind::kSoftplusOne:
          p[i] = 0.5413248f;
          break;
        case InitKind::kOnePlusNormal:
          p[i] = 1.0f + half_width * u;
          break;
        case InitKind::kNormal:
          p[i] = half_width * u;
          break;
      }
    }
  }
}

// Device-to-device copy bandwidth, counting bytes read and written.
double copy_bandwidth() {
  const size_t bytes = size_t(1) << 31;
  cuda::DeviceBuffer a(bytes), b(bytes);
  cudaEvent_t e0, e1;
  CEMLM_CUDA_CHECK(cudaEventCreate(&e0));
  CEMLM_CUDA_CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i)
    CEMLM_CUDA_CHECK(cudaMemcpy(b.as(), a.as(), bytes, cudaMemcpyDeviceToDevice));
  CEMLM_CUDA_CHECK(cudaEventRecord(e0));
  for (int i = 0; i < 10; ++i)
    CEMLM_CUDA_CHECK(cudaMemcpyAsync(b.as(), a.as(), bytes, cudaMemcpyDeviceToDevice));
  CEMLM_CUDA_CHECK(cudaEventRecord(e1));
  CEMLM_CUDA_CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CEMLM_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  CEMLM_CUDA_CHECK(cudaEventDestroy(e0));
  CEMLM_CUDA_CHECK(cudaEventDestroy(e1));
  return 2.0 * double(bytes) * 10 / (double(ms) * 1e-3);
}

// cuBLAS rate on an 8192³ product in the runner's bf16 form (bf16 inputs, fp32 output).
double bf16_gemm_rate() {
  const int n = 8192;
  cuda::DeviceBuffer A(size_t(n) * n * 2), B(size_t(n) * n * 2), C(size_t(n) * n * 4);
  CEMLM_CUDA_CHECK(cudaMemset(A.as(), 0x3c, A.bytes()));  // bf16 ≈ 0.011: finite, non-zero
  CEMLM_CUDA_CHECK(cudaMemset(B.as(), 0x3c, B.bytes()));
  cublasHandle_t h;
  CEMLM_CUBLAS_CHECK(cublasCreate(&h));
  const float alpha = 1, beta = 0;
  auto run = [&] {
    CEMLM_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, A.as(),
                                    CUDA_R_16BF, n, B.as(), CUDA_R_16BF, n, &beta, C.as(),
                                    CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  for (int i = 0; i < 3; ++i) run();
  CEMLM_CUDA_CHECK(cudaDeviceSynchronize());
  const auto t0 = Clock::now();
  for (int i = 0; i < 10; ++i) run();
  CEMLM_CUDA_CHECK(cudaDeviceSynchronize());
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  CEMLM_CUBLAS_CHECK(cublasDestroy(h));
  return 2.0 * n * double(n) * n * 10 / s;
}

int recurrences(const ModelConfig& c, int T, bool attention) {
  return (attention ? c.attention == AttentionType::kCem : c.mlp == MlpType::kCem) ? T : 0;
}

// Bytes one decode step must move at least: every weight matrix each time a product reads it
// (bf16), the precond factors (fp32), the KV cache each attention call reads, the new entries.
double decode_bytes(const ModelConfig& c, int T, int batch, int ctx) {
  const double D = c.d_model, Q = c.qk_dim(), F = c.d_ff, V = c.vocab_size;
  const int Ta = recurrences(c, T, true), Tm = recurrences(c, T, false);
  const double kv_token = double(c.kv_floats_per_token_layer()) * 4;
  double per_layer = 0;
  per_layer += Ta ? D * Q * (1 + 2 * Ta) * 2 + 4 * D * c.attn_precond_rank * 4 * Ta : 4 * D * Q * 2;
  per_layer += Tm ? D * F * (1 + 2 * Tm) * 2 + 4 * D * c.mlp_precond_rank * 4 * Tm : 3 * D * F * 2;
  per_layer += double(batch) * ctx * kv_token * std::max(Ta, 1) + batch * kv_token;
  return per_layer * c.n_layers + V * D * 2;
}

// FLOPs of one forward over `rows` new tokens whose contexts average `ctx`: the products
// (matmuls) and the attention scores and sums (with the CEM diagonal's), plus the head rows.
double step_flops(const ModelConfig& c, int T, double rows, double ctx, double head_rows) {
  const double D = c.d_model, Q = c.qk_dim(), F = c.d_ff, V = c.vocab_size;
  const int Ta = recurrences(c, T, true), Tm = recurrences(c, T, false);
  const double diag = c.diag == DiagMode::kNone ? 0 : c.diag == DiagMode::kShared ? 1 : c.n_heads;
  double per_row = 0;
  per_row += Ta ? 2 * D * Q * (1 + 2 * Ta) + 8 * D * c.attn_precond_rank * Ta : 8 * D * Q;
  per_row += Tm ? 2 * D * F * (1 + 2 * Tm) + 8 * D * c.mlp_precond_rank * Tm : 6 * D * F;
  per_row +=
      4 * ctx * (Q + diag * D * (c.attention == AttentionType::kCem ? 1 : 0)) * std::max(Ta, 1);
  return rows * per_row * c.n_layers + 2 * head_rows * D * V;
}

// A bump allocator of whole sequences' block tables over the runner's pool.
struct Tables {
  std::vector<std::vector<int32_t>> t;
  Tables(int n_seqs, int len, int bs, int64_t n_blocks) {
    const int per = (len + bs - 1) / bs;
    CEMLM_CHECK(int64_t(n_seqs) * per <= n_blocks);
    for (int s = 0; s < n_seqs; ++s) {
      t.emplace_back(per);
      for (int b = 0; b < per; ++b) t.back()[size_t(b)] = s * per + b;
    }
  }
};

// Prefills `seqs` sequences of `len` tokens, at most max_rows rows per forward.
double prefill(CudaModelRunner& r, const Tables& tables, const std::vector<int>& ids, int seqs,
               int len, int T, int max_rows) {
  const auto t0 = Clock::now();
  const int per = std::max(1, max_rows / len);
  std::vector<float> logits;
  for (int s0 = 0; s0 < seqs; s0 += per) {
    Batch b;
    for (int s = s0; s < std::min(seqs, s0 + per); ++s)
      b.seqs.push_back(BatchSeq{ids.data(), len, 0, T, tables.t[size_t(s)].data(),
                                int(tables.t[size_t(s)].size()), true, false});
    r.forward(b, &logits);
  }
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void print_row(const char* phase, const ModelConfig& c, int T, int batch, double tokens_s,
               double ms, double floor_ms) {
  std::printf("| %s | %s | %d | %d | %.0f | %.3f | %.3f | %.0f%% |\n", phase,
              c.attention == AttentionType::kCem ? "cem" : "standard", T, batch, tokens_s, ms,
              floor_ms, 100 * floor_ms / ms);
  std::fflush(stdout);
}

void bench_model(bool cem, const Setup& su, double bw, double rate) {
  const ModelConfig c = bench_config(cem, su.small);
  CudaRunnerOptions o;
  o.precision = CudaPrecision::kBf16;
  o.kv_cache_memory = int64_t(16) << 30;
  o.device_sampling = true;  // its decode rows sample on the device
  std::unique_ptr<CudaModelRunner> runner;
  {
    ParamStore store(c);
    fill_params(store);
    auto r = make_cuda_runner(c, store, o);
    if (!r.ok()) {
      std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
      std::exit(1);
    }
    runner = std::move(r).value();
  }
  const std::vector<int> Ts = cem ? std::vector<int>{1, 2, 4} : std::vector<int>{1};
  std::vector<int> ids(size_t(std::max(su.prefill_len, su.prompt + su.decode_steps + 4)));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int((i * 97 + 13) % size_t(c.vocab_size));
  for (int T : Ts) {
    const Tables pt(su.prefill_seqs, su.prefill_len, o.block_size, runner->num_blocks());
    prefill(*runner, pt, ids, su.prefill_seqs, su.prefill_len, T, su.max_rows);  // warm-up
    double s = 0;
    for (int i = 0; i < 3; ++i)
      s += prefill(*runner, pt, ids, su.prefill_seqs, su.prefill_len, T, su.max_rows) / 3;
    const double rows = double(su.prefill_seqs) * su.prefill_len;
    const double flops = step_flops(c, T, rows, su.prefill_len / 2.0, su.prefill_seqs);
    print_row("prefill", c, T, su.prefill_seqs, rows / s, s * 1e3, flops / rate * 1e3);
  }
  for (int T : Ts)
    for (int B : {1, 32, 256}) {
      const int len = su.prompt + 4 + su.decode_steps;
      const Tables tables(B, len, o.block_size, runner->num_blocks());
      prefill(*runner, tables, ids, B, su.prompt, T, su.max_rows);
      cuda::SampleRowSpec greedy;
      greedy.temperature = 0.0f;
      const std::vector<cuda::SampleRowSpec> specs(size_t(B), greedy);
      std::vector<cuda::SampledToken> out;
      auto step = [&](int pos) {
        Batch b;
        for (int s = 0; s < B; ++s)
          b.seqs.push_back(BatchSeq{ids.data() + pos, 1, pos, T, tables.t[size_t(s)].data(),
                                    int(tables.t[size_t(s)].size()), true, false});
        runner->forward_sample(b, specs, &out);
      };
      int pos = su.prompt;
      for (int i = 0; i < 4; ++i) step(pos++);  // direct run, graph capture, replays
      const auto t0 = Clock::now();
      for (int i = 0; i < su.decode_steps; ++i) step(pos++);
      const double s = std::chrono::duration<double>(Clock::now() - t0).count() / su.decode_steps;
      const double bytes = decode_bytes(c, T, B, su.prompt + 4 + su.decode_steps / 2);
      print_row("decode", c, T, B, B / s, s * 1e3, bytes / bw * 1e3);
    }
}

}  // namespace

int main(int argc, char** argv) {
  cemlm::reexec_with_runtime_env(argv);
  Setup su;
  const char* usage =
      "usage: bench/engine_gpu [--small]\n\nThe CUDA runner's decode and prefill throughput "
      "against measured rooflines (device copy\nbandwidth, cuBLAS bf16 rate); --small: a smaller "
      "model and fewer steps. Needs a GPU.\n";
  if (argc > 1 && (!std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")))
    return std::fputs(usage, stdout), 0;
  su.small = argc > 1 && std::strcmp(argv[1], "--small") == 0;
  if (argc > 2 || (argc == 2 && !su.small)) {
    std::fprintf(stderr, "unexpected argument '%s'\n%s", argv[argc - 1], usage);
    return 2;
  }
  if (su.small) su.prefill_seqs = 4, su.prefill_len = 256, su.decode_steps = 8;
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::fprintf(stderr, "engine_gpu: no CUDA device visible\n");
    return 2;
  }
  cudaDeviceProp prop;
  CEMLM_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s\n", bench::machine_line(/*gpu=*/true).c_str());
  std::printf("GPU: %s, %d SMs, %.1f GiB\n", prop.name, prop.multiProcessorCount,
              double(prop.totalGlobalMem) / double(1 << 30));
  const double bw = copy_bandwidth(), rate = bf16_gemm_rate();
  std::printf("measured: device copy %.0f GB/s (read + write), cuBLAS bf16 %.0f TFLOP/s\n",
              bw / 1e9, rate / 1e12);
  std::printf(
      "model: D=%d L=%d H=%d d_h=%d F=%d V=%d, bf16 weights; decode after a %d-token "
      "prompt, greedy on the device; prefill %d×%d tokens\n\n",
      bench_config(false, su.small).d_model, bench_config(false, su.small).n_layers,
      bench_config(false, su.small).n_heads, bench_config(false, su.small).head_dim,
      bench_config(false, su.small).d_ff, bench_config(false, su.small).vocab_size, su.prompt,
      su.prefill_seqs, su.prefill_len);
  std::printf(
      "| phase | model | T | batch (seqs) | tokens/s | ms/step | roofline ms | %% of roofline |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  bench_model(false, su, bw, rate);
  bench_model(true, su, bw, rate);
  std::printf(
      "\nroofline: decode = (weights read + KV read/written) / copy bandwidth; prefill = "
      "(matmul + attention FLOPs) / cuBLAS bf16 rate. ms/step: prefill = the whole %d×%d "
      "batch in forwards of at most %d rows.\n",
      su.prefill_seqs, su.prefill_len, su.max_rows);
  return 0;
}
