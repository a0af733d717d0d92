// bench/forward: full-sequence CPU forward tokens/s (D=256, L=4, N=256) for the standard model
// and full CEM at T = 1, 2, 4, and achieved matmul GFLOP/s as a fraction of plain gemm calls on the
// same shapes (cemlm's own kernels up to 256 rows, OpenBLAS sgemm above), measured in the same run.
// Prints a table; see docs/BENCHMARKS.md.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "cemlm/engine/cpu_model.h"
#include "cemlm/kernels/linear.h"
#include "machine.h"

namespace {

using namespace cemlm;
using Clock = std::chrono::steady_clock;

ModelConfig bench_config(bool cem) {
  ModelConfig c;
  c.vocab_size = 4096, c.d_model = 256, c.n_layers = 4, c.n_heads = 4, c.head_dim = 64, c.d_ff = 768;
  c.max_seq_len = 1024;
  if (cem) {
    c.attention = AttentionType::kCem, c.diag = DiagMode::kShared, c.attn_precond_rank = 8;
    c.mlp = MlpType::kCem, c.mlp_precond_rank = 8;
  }
  return c;
}

// FLOPs of the sgemm calls of one forward over N tokens: projections, head, and the attention
// products (the gemm path computes the full N×N score block per head, masked afterwards).
double matmul_flops(const ModelConfig& c, int N, int T) {
  const double D = c.d_model, Q = c.qk_dim(), F = c.d_ff, V = c.vocab_size, n = N;
  const double attn = 4 * n * n * Q;  // Q·Kᵀ and P·V over all heads
  const double diag = c.attention == AttentionType::kCem && c.diag != DiagMode::kNone ? 4 * n * n * D : 0;
  double per_layer;
  if (c.attention == AttentionType::kStandard) per_layer = 2 * n * D * Q * 4 + attn;
  else per_layer = 2 * n * D * Q * (1 + 2 * T) + (8.0 * n * D * c.attn_precond_rank + attn + diag) * T;
  if (c.mlp == MlpType::kSwiglu) per_layer += 2 * n * D * F * 3;
  else per_layer += 2 * n * D * F * (1 + 2 * T) + 8.0 * n * D * c.mlp_precond_rank * T;
  return per_layer * c.n_layers + 2 * n * D * V;
}

// sgemm rate on the model's projection and head shapes, weighted like one standard forward.
double sgemm_gflops(const ModelConfig& c, int N) {
  const int D = c.d_model, F = c.d_ff, V = c.vocab_size;
  std::vector<float> x(size_t(N) * F, 0.5f), w(size_t(V) * D, 0.25f), y(size_t(N) * V);
  auto run = [&] {
    for (int l = 0; l < c.n_layers; ++l) {
      for (int i = 0; i < 4; ++i) gemm(false, true, N, D, D, 1, x.data(), D, w.data(), D, 0, y.data(), D);
      for (int i = 0; i < 2; ++i) gemm(false, true, N, F, D, 1, x.data(), D, w.data(), D, 0, y.data(), F);
      gemm(false, true, N, D, F, 1, x.data(), F, w.data(), F, 0, y.data(), D);
    }
    gemm(false, true, N, V, D, 1, x.data(), D, w.data(), D, 0, y.data(), V);
  };
  const double flops = c.n_layers * (4.0 * 2 * N * D * D + 3.0 * 2 * N * D * F) + 2.0 * N * D * V;
  return flops / bench::seconds_per_call(run) / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  cemlm::reexec_with_runtime_env(argv);
  int N = 256;
  const char* usage =
      "usage: bench/forward [TOKENS]\n\nThe full-sequence CPU forward of one TOKENS-token "
      "sequence (default 256), standard and CEM at T = 1, 2, 4:\ntokens/s and matmul GFLOP/s "
      "against plain gemm calls on the same shapes (cemlm's own kernels up to 256 rows, OpenBLAS "
      "sgemm above).\n";
  if (int rc = bench::positional_counts(argc, argv, usage, {&N}); rc >= 0) return rc;
  if (N > bench_config(false).max_seq_len) {
    std::fprintf(stderr, "TOKENS %d must be at most %d\n", N, bench_config(false).max_seq_len);
    return 2;
  }
  std::printf("%s\n", bench::machine_line().c_str());
  const double ref = sgemm_gflops(bench_config(false), N);
  std::printf(
      "plain gemm calls on the model's shapes (cemlm's kernels up to 256 rows, OpenBLAS sgemm "
      "above): %.1f GFLOP/s\n\n",
      ref);
  std::printf("| model | T | tokens/s | ms/forward | matmul GFLOP/s | %% of sgemm |\n");
  std::printf("|---|---|---|---|---|---|\n");
  struct Row { const char* name; bool cem; int T; };
  for (Row r : {Row{"standard", false, 1}, Row{"cem", true, 1}, Row{"cem", true, 2}, Row{"cem", true, 4}}) {
    const ModelConfig c = bench_config(r.cem);
    ParamStore store(c);
    store.init_random(1);
    const Weights w = bind_weights(c, store);
    std::vector<int> ids(N);
    for (int i = 0; i < N; ++i) ids[i] = (i * 97 + 13) % c.vocab_size;
    CpuModel model(c, w);
    KvPool kv(c, N, 1);
    const int32_t block = 0;
    Batch b;
    b.seqs.push_back(BatchSeq{ids.data(), N, 0, r.T, &block, 1, false, true});
    std::vector<float> logits;
    const double s = bench::seconds_per_call([&] { model.forward(b, kv, &logits); });
    const double gf = matmul_flops(c, N, r.T) / s / 1e9;
    std::printf("| %s | %d | %.0f | %.2f | %.1f | %.0f%% |\n", r.name, r.T, N / s, s * 1e3, gf,
                100 * gf / ref);
  }
  return 0;
}
