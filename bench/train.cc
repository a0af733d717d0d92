// bench/train: training throughput of `cemlm train`'s default model (and its standard baseline):
// tokens/s of whole steps (forward, backward through every recursion step, clipping, AdamW) at
// T = 1, 2, 4, and the achieved dense-matmul GFLOP/s as a fraction of OpenBLAS sgemm on the same
// shapes (forward, dX and dW of every linear map), measured in the same run. See
// docs/BENCHMARKS.md.
#include "cemlm/trainer/train.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cemlm/kernels/linear.h"
#include "cemlm/trainer/backprop.h"
#include "cemlm/trainer/optimizer.h"
#include "machine.h"

namespace {

using namespace cemlm;
using Clock = std::chrono::steady_clock;

// A linear map W [out, in] applied `uses` times per forward (W or Wᵀ: same three shapes).
struct Linear {
  int out, in;
  double uses;
};

// The dense matmuls of one forward at depth T (attention scores excluded: not dense matmuls).
std::vector<Linear> linears(const ModelConfig& c, int T) {
  const int D = c.d_model, Q = c.qk_dim(), F = c.d_ff;
  std::vector<Linear> v;
  auto precond = [&](int r) {
    if (r > 0) v.push_back({r, D, 2.0 * T * c.n_layers}), v.push_back({D, r, 2.0 * T * c.n_layers});
  };
  if (c.attention == AttentionType::kStandard) {
    v.push_back({Q, D, 3.0 * c.n_layers});
    v.push_back({D, Q, 1.0 * c.n_layers});
  } else {
    v.push_back({Q, D, (1.0 + 2 * T) * c.n_layers});  // W_K once, W_Q and W_Qᵀ per step
    precond(c.attn_precond_rank);
  }
  if (c.mlp == MlpType::kSwiglu) {
    v.push_back({F, D, 2.0 * c.n_layers});
    v.push_back({D, F, 1.0 * c.n_layers});
  } else {
    v.push_back({F, D, (1.0 + 2 * T) * c.n_layers});  // W_gate once, W_up and W_upᵀ per step
    precond(c.mlp_precond_rank);
  }
  v.push_back({c.vocab_size, D, 1.0});
  return v;
}

// Training does each forward matmul three times over: y = x·Wᵀ, dx = dy·W, dW = dyᵀ·x.
double train_flops(const std::vector<Linear>& ls, int N) {
  double f = 0;
  for (const Linear& l : ls) f += l.uses * 3 * 2.0 * N * l.out * l.in;
  return f;
}

// sgemm GFLOP/s on the step's own shapes, each weighted by how often the step does it.
double sgemm_gflops(const std::vector<Linear>& ls, int N) {
  double flops = 0, seconds = 0;
  for (const Linear& l : ls) {
    std::vector<float> x(size_t(N) * l.in, 0.5f), w(size_t(l.out) * l.in, 0.25f),
        y(size_t(N) * l.out, 0.125f), dw(w.size());
    const double s = bench::seconds_per_call(
        [&] {
          gemm(false, true, N, l.out, l.in, 1, x.data(), l.in, w.data(), l.in, 0, y.data(), l.out);
          gemm(false, false, N, l.in, l.out, 1, y.data(), l.out, w.data(), l.in, 0, x.data(), l.in);
          gemm(true, false, l.out, l.in, N, 1, y.data(), l.out, x.data(), l.in, 1, dw.data(), l.in);
        },
        0.3);
    flops += l.uses * 3 * 2.0 * N * l.out * l.in;
    seconds += l.uses * s;
  }
  return flops / seconds / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const int batch = argc > 1 ? std::atoi(argv[1]) : TrainOptions{}.batch_size;
  const int seq = argc > 2 ? std::atoi(argv[2]) : TrainOptions{}.seq_len;
  const int N = batch * seq;
  std::printf("%s\n", bench::machine_line().c_str());
  std::printf("one training step = forward + backward (batch %d × %d tokens) + clip + AdamW\n\n",
              batch, seq);
  std::printf(
      "| model | params | T | tokens/s | ms/step | matmul GFLOP/s | sgemm GFLOP/s | %% of sgemm "
      "|\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  const ModelConfig cem = default_model_config();
  struct Row {
    ModelConfig c;
    int T;
  };
  for (const Row& r : {Row{baseline_of(cem), 1}, Row{cem, 1}, Row{cem, 2}, Row{cem, 4}}) {
    ParamStore params(r.c), grads(r.c);
    params.init_random(1);
    const Weights w = bind_weights(r.c, params), gw = bind_weights(r.c, grads);
    AdamW opt(params.specs(), AdamWOptions{});
    std::vector<int> ids(N);
    for (int i = 0; i < N; ++i) ids[i] = (i * 97 + 13) % r.c.vocab_size;
    const double s = bench::seconds_per_call(
        [&] {
          std::fill(grads.flat().begin(), grads.flat().end(), 0.0f);
          forward_backward(r.c, w, gw, ids.data(), batch, seq, r.T);
          clip_grad_norm(grads.flat(), 1.0);
          opt.step(params.flat(), grads.flat(), 1e-4);
        },
        3.0);
    const auto ls = linears(r.c, r.T);
    const double gf = train_flops(ls, N) / s / 1e9, ref = sgemm_gflops(ls, N);
    std::printf("| %s | %.2fM | %d | %.0f | %.1f | %.1f | %.1f | %.0f%% |\n",
                r.c.variant_name().c_str(), double(params.size()) / 1e6, r.T, N / s, s * 1e3, gf,
                ref, 100 * gf / ref);
  }
  return 0;
}
