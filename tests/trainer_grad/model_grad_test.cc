// Whole-model gradient checks of forward_backward: every variant of tests/model/tiny_models.h
// (together they cover every embedding, attention, diagonal, preconditioner, MLP and step-size
// option) at T = 1, 2, 3 against finite differences of forward_loss, one parameter tensor at a
// time; the loss against the engine's full_forward; loss_scale, accumulation, batching,
// determinism.
#include <cmath>
#include <ostream>
#include <string>
#include <vector>

#include "cemlm/engine/cpu_model.h"
#include "cemlm/trainer/backprop.h"
#include "grad_check.h"
#include "gtest/gtest.h"
#include "tiny_models.h"

namespace cemlm {
namespace {

using testing_models::Variant;

constexpr int kBatch = 2, kSeq = 7;

struct Case {
  Variant v;
  int T;
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.v.name << " T=" << c.T; }

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (const Variant& v : testing_models::all_variants())
    for (int T : {1, 2, 3}) out.push_back({v, T});
  return out;
}

// A tiny model with perturbed weights, a fixed batch of ids, and a zeroed gradient store.
struct Fixture {
  ModelConfig c;
  ParamStore params, grads;
  std::vector<int> ids;
  explicit Fixture(const Variant& v, int batch = kBatch, int seq = kSeq)
      : c(testing_models::make_config(v)), params(c), grads(c) {
    testing_models::randomize(params, 11);
    Rng rng(12);
    for (int i = 0; i < batch * seq; ++i) ids.push_back(int(rng.next_u64() % c.vocab_size));
  }
  double backward(int T, int batch = kBatch, int seq = kSeq, float scale = 1.0f) {
    return forward_backward(c, bind_weights(c, params), bind_weights(c, grads), ids.data(), batch,
                            seq, T, scale);
  }
};

double engine_nll(const ModelConfig& c, const Weights& w, const std::vector<int>& ids, int batch,
                  int seq, int T) {
  double total = 0;
  for (int b = 0; b < batch; ++b) {
    const std::vector<int> row(ids.begin() + b * seq, ids.begin() + (b + 1) * seq);
    const std::vector<float> logits = full_forward(c, w, row, T);
    for (int i = 0; i + 1 < seq; ++i) {
      const float* l = logits.data() + int64_t(i) * c.vocab_size;
      double mx = l[0], z = 0;
      for (int v = 1; v < c.vocab_size; ++v) mx = std::max(mx, double(l[v]));
      for (int v = 0; v < c.vocab_size; ++v) z += std::exp(l[v] - mx);
      total += mx + std::log(z) - l[row[i + 1]];
    }
  }
  return total / (double(batch) * (seq - 1));
}

class ModelGrad : public testing::TestWithParam<Case> {};

TEST_P(ModelGrad, EveryParameterMatchesFiniteDifferences) {
  const Case cs = GetParam();
  Fixture fx(cs.v);
  fx.backward(cs.T);
  const Weights w = bind_weights(fx.c, fx.params);
  auto loss = [&] { return forward_loss(fx.c, w, fx.ids.data(), kBatch, kSeq, cs.T); };
  Rng rng(13);
  for (const ParamSpec& s : fx.params.specs()) {
    const float* g = fx.grads.flat().data() + s.offset;
    const std::vector<float> grad(g, g + s.numel());
    grad_check::expect_directional(s.name, loss, fx.params.flat().data() + s.offset, grad, rng,
                                   /*h=*/2e-2, /*rel=*/2e-3, /*abs=*/2e-4);
  }
}

TEST_P(ModelGrad, LossMatchesTheEngine) {
  const Case cs = GetParam();
  Fixture fx(cs.v);
  const Weights w = bind_weights(fx.c, fx.params);
  const double ref = engine_nll(fx.c, w, fx.ids, kBatch, kSeq, cs.T);
  EXPECT_NEAR(fx.backward(cs.T), ref, 1e-5);
  EXPECT_NEAR(forward_loss(fx.c, w, fx.ids.data(), kBatch, kSeq, cs.T), ref, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Variants, ModelGrad, testing::ValuesIn(all_cases()), [](const auto& info) {
  return info.param.v.name + "_T" + std::to_string(info.param.T);
});

Variant full_cem() { return testing_models::all_variants()[5]; }  // LEV, shared diag, both precond

// The memory estimate the trainer checks before its first step is a lower bound of what a call
// takes, and the bulk of it where the rows are many: the part that grows with the batch.
TEST_P(ModelGrad, MinBytesBoundWhatACallTakes) {
  const Case& k = GetParam();
  constexpr int kRows = 24, kLong = 48;  // 1,152 rows: the head's 256 and the scratch are small
  Fixture f(k.v, kRows, kLong);
  f.backward(k.T, kRows, kLong);
  const int64_t min_bytes = forward_backward_min_bytes(f.c, kRows, kLong, k.T);
  const int64_t arena_bytes = min_bytes - int64_t(kRows) * kLong * 16;  // less the per-row ints
  const int64_t taken = last_forward_backward_floats() * int64_t(sizeof(float));
  EXPECT_LE(arena_bytes, taken);
  EXPECT_GE(double(arena_bytes), 0.9 * double(taken)) << arena_bytes << " of " << taken;
}

TEST(ModelGradProperties, LossScaleScalesAndCallsAccumulate) {
  Fixture a(full_cem()), b(full_cem());
  const double la = a.backward(2);
  EXPECT_DOUBLE_EQ(b.backward(2, kBatch, kSeq, 0.5f), la);
  b.backward(2, kBatch, kSeq, 1.5f);  // 0.5 + 1.5 = 2 times the gradient
  for (int64_t i = 0; i < a.grads.size(); ++i)
    ASSERT_NEAR(b.grads.flat()[i], 2 * a.grads.flat()[i], 1e-6 + 1e-5 * std::abs(a.grads.flat()[i]))
        << i;
}

TEST(ModelGradProperties, BatchIsTheMeanOfItsRows) {
  Fixture whole(full_cem()), rows(full_cem());
  const double loss = whole.backward(2);
  double sum = 0;
  for (int b = 0; b < kBatch; ++b)
    sum += forward_backward(rows.c, bind_weights(rows.c, rows.params),
                            bind_weights(rows.c, rows.grads), rows.ids.data() + b * kSeq, 1, kSeq,
                            2, 1.0f / kBatch);
  EXPECT_NEAR(loss, sum / kBatch, 1e-6);
  for (int64_t i = 0; i < whole.grads.size(); ++i)
    ASSERT_NEAR(whole.grads.flat()[i], rows.grads.flat()[i],
                1e-6 + 1e-4 * std::abs(rows.grads.flat()[i]))
        << i;
}

// Bit-identical gradients from call to call, whatever the threads' timing: resumed training must
// replay exactly. Four heads and 48-token rows (the attention's sgemm path) give threads room to
// interleave; 7-token rows take the per-row path.
TEST(ModelGradProperties, RepeatedCallsAreBitIdentical) {
  for (const Variant& v : {full_cem(), testing_models::all_variants()[6]}) {
    for (int seq : {7, 48}) {
      ModelConfig c = testing_models::make_config(v);
      c.n_heads = 4;
      c.d_model = 32;
      ParamStore p(c), first(c);
      testing_models::randomize(p, 5);
      Rng rng(6);
      std::vector<int> ids(3 * seq);
      for (int& id : ids) id = int(rng.next_u64() % c.vocab_size);
      const double loss =
          forward_backward(c, bind_weights(c, p), bind_weights(c, first), ids.data(), 3, seq, 3);
      for (int rep = 0; rep < 4; ++rep) {
        ParamStore g(c);
        EXPECT_EQ(
            forward_backward(c, bind_weights(c, p), bind_weights(c, g), ids.data(), 3, seq, 3),
            loss)
            << v.name << " seq " << seq;
        EXPECT_EQ(g.flat(), first.flat()) << v.name << " seq " << seq;
      }
    }
  }
}

// With a tied table, the embedding's gradient has both the input and the output contribution.
TEST(ModelGradProperties, TiedEmbeddingGetsTheHeadGradient) {
  Variant tied = testing_models::all_variants()[0];
  ASSERT_TRUE(tied.tied);
  Fixture fx(tied);
  fx.backward(1);
  const Tensor g = fx.grads.get("embed.weight");
  // Tokens that never occur in the input still get a gradient, through the head.
  std::vector<bool> seen(fx.c.vocab_size, false);
  for (int id : fx.ids) seen[id] = true;
  int unseen = 0;
  for (int v = 0; v < fx.c.vocab_size; ++v) {
    if (seen[v]) continue;
    ++unseen;
    double n = 0;
    for (int e = 0; e < fx.c.d_model; ++e) n += std::abs(g.data[int64_t(v) * fx.c.d_model + e]);
    EXPECT_GT(n, 0) << v;
  }
  EXPECT_GT(unseen, 0);
}

}  // namespace
}  // namespace cemlm
