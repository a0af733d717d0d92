// bench/train: training throughput of `cemlm train`'s default model (and its standard baseline):
// tokens/s of whole steps (forward, backward through every recursion step, clipping, AdamW) at
// T = 1, 2, 4, and the achieved matmul GFLOP/s as a fraction of plain gemm calls on the same shapes
// (forward, dX and dW of every linear map; the attention products; cemlm's own kernels up to 256
// rows, OpenBLAS sgemm above), measured in the same run. See
// docs/BENCHMARKS.md.
#include "cemlm/trainer/train.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cemlm/kernels/linear.h"
#include "cemlm/trainer/backprop.h"
#include "cemlm/trainer/optimizer.h"
#include "machine.h"

namespace {

using namespace cemlm;
using Clock = std::chrono::steady_clock;

// A product done as a triple of sgemms like a linear map's y = x·Wᵀ [n, out, in], dx = dy·W and
// dW = dyᵀ·x, `triples` times per training step (forward + backward).
struct Product {
  int n, out, in;
  double triples;
};

// Every sgemm of one step at depth T over `batch` sequences of `seq` tokens: the linear maps
// (N = batch·seq rows), and the attention products per sequence and head (the gemm path): the
// forward's Q·Kᵀ and P·V, the backward's recomputed scores, dP, dq, dk and dv — seven sgemms of
// 2·seq²·d_h FLOPs each; the CEM diagonal adds seven of 2·seq²·D per sequence (shared: once for
// all heads; per-head: for each head).
std::vector<Product> products(const ModelConfig& c, int T, int batch, int seq) {
  const int D = c.d_model, Q = c.qk_dim(), F = c.d_ff, N = batch * seq, L = c.n_layers;
  const bool cem = c.attention == AttentionType::kCem;
  const double steps = cem ? T : 1;  // attention passes per layer
  std::vector<Product> v;
  auto precond = [&](int r) {
    if (r > 0) v.push_back({N, r, D, 2.0 * T * L}), v.push_back({N, D, r, 2.0 * T * L});
  };
  if (!cem) {
    v.push_back({N, Q, D, 3.0 * L});
    v.push_back({N, D, Q, 1.0 * L});
  } else {
    v.push_back({N, Q, D, (1.0 + 2 * T) * L});  // W_K once, W_Q and W_Qᵀ per step
    precond(c.attn_precond_rank);
  }
  if (c.mlp == MlpType::kSwiglu) {
    v.push_back({N, F, D, 2.0 * L});
    v.push_back({N, D, F, 1.0 * L});
  } else {
    v.push_back({N, F, D, (1.0 + 2 * T) * L});  // W_gate once, W_up and W_upᵀ per step
    precond(c.mlp_precond_rank);
  }
  v.push_back({N, c.vocab_size, D, 1.0});
  v.push_back({seq, seq, c.head_dim, 7.0 / 3 * c.n_heads * batch * L * steps});
  if (cem && c.diag != DiagMode::kNone)
    v.push_back({seq, seq, D, 7.0 / 3 * (c.diag == DiagMode::kPerHead ? c.n_heads : 1) * batch * L * steps});
  return v;
}

double step_flops(const std::vector<Product>& ps) {
  double f = 0;
  for (const Product& p : ps) f += p.triples * 3 * 2.0 * p.n * p.out * p.in;
  return f;
}

// sgemm GFLOP/s on the step's own shapes, each weighted by how often the step does it.
double sgemm_gflops(const std::vector<Product>& ps) {
  double seconds = 0;
  for (const Product& p : ps) {
    std::vector<float> x(size_t(p.n) * p.in, 0.5f), w(size_t(p.out) * p.in, 0.25f),
        y(size_t(p.n) * p.out, 0.125f), dw(w.size());
    const double s = bench::seconds_per_call(
        [&] {
          gemm(false, true, p.n, p.out, p.in, 1, x.data(), p.in, w.data(), p.in, 0, y.data(), p.out);
          gemm(false, false, p.n, p.in, p.out, 1, y.data(), p.out, w.data(), p.in, 0, x.data(), p.in);
          gemm(true, false, p.out, p.in, p.n, 1, y.data(), p.out, x.data(), p.in, 1, dw.data(), p.in);
        },
        0.3);
    seconds += p.triples * s;
  }
  return step_flops(ps) / seconds / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  cemlm::reexec_with_runtime_env(argv);
  int batch = TrainOptions{}.batch_size, seq = TrainOptions{}.seq_len;
  const std::string usage = absl::StrCat(
      "usage: bench/train [BATCH [SEQ_LEN]]\n\nTraining throughput of `cemlm train`'s default "
      "model and its standard baseline at T = 1, 2, 4:\nwhole steps of BATCH sequences of SEQ_LEN "
      "tokens (defaults ",
      batch, " and ", seq, ", at most max_seq_len ", default_model_config().max_seq_len, ").\n");
  if (int rc = bench::positional_counts(argc, argv, usage.c_str(), {&batch, &seq}); rc >= 0)
    return rc;
  if (seq < 2 || seq > default_model_config().max_seq_len) {
    std::fprintf(stderr, "SEQ_LEN %d must be in [2, %d]\n", seq,
                 default_model_config().max_seq_len);
    return 2;
  }
  if (int64_t(batch) * seq > (int64_t(1) << 20)) {  // activations of GBs a token row
    std::fprintf(stderr, "BATCH %d × SEQ_LEN %d must be at most %d tokens\n", batch, seq, 1 << 20);
    return 2;
  }
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
    const auto ps = products(r.c, r.T, batch, seq);
    const double gf = step_flops(ps) / s / 1e9, ref = sgemm_gflops(ps);
    std::printf("| %s | %.2fM | %d | %.0f | %.1f | %.1f | %.1f | %.0f%% |\n",
                r.c.variant_name().c_str(), double(params.size()) / 1e6, r.T, N / s, s * 1e3, gf,
                ref, 100 * gf / ref);
  }
  return 0;
}
