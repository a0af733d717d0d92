// The trainer's random init where it departs from MODEL.md's recommendation: LEV's output
// projection W_out is scaled so that a fresh LEV embedding has about unit RMS (the recommended
// 0.02/√n_h gives ~0.08 and trains worse: docs/TRAINING.md, "LEV init"); the other LEV tensors
// keep the recommended init.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cemlm/engine/config.h"
#include "cemlm/engine/cpu_model.h"
#include "cemlm/engine/params.h"
#include "cemlm/kernels/lev.h"

namespace cemlm {
namespace {

ModelConfig lev_config(int seed_dim, int knots) {
  auto c = parse_config(absl::StrCat(
      R"({"architecture": "cemlm", "format_version": 1, "vocab_size": 4096, "d_model": 128,
          "n_layers": 2, "n_heads": 4, "head_dim": 32, "d_ff": 512,
          "embedding": {"type": "lev", "lev": {"digits": 3, "seed_dim": )",
      seed_dim, R"(, "knots": )", knots, R"(, "rank": 16, "heads": 4}},
          "attention": {"type": "cem"}, "mlp": {"type": "cem"}})"));
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

double rms(const float* p, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += double(p[i]) * p[i];
  return std::sqrt(sum / double(n));
}

TEST(LevInit, OutputProjectionGivesTheEmbeddingUnitScale) {
  for (auto [seed_dim, knots] : {std::pair{16, 8}, std::pair{64, 16}}) {
    SCOPED_TRACE(absl::StrCat("seed_dim ", seed_dim, ", knots ", knots));
    const ModelConfig c = lev_config(seed_dim, knots);
    ParamStore s(c);
    s.init_random(1);
    const Tensor out = s.get("lev.out_proj");
    const double want = 1.0 / std::sqrt(double(c.lev.heads * c.lev.rank));
    EXPECT_NEAR(rms(out.data, out.numel()), want, 0.03 * want);
    const Tensor code = s.get("lev.codebooks");  // unchanged: MODEL.md's N(0, 0.02²)
    EXPECT_NEAR(rms(code.data, code.numel()), 0.02, 0.002);

    std::vector<int32_t> ids(size_t(c.vocab_size));
    for (int32_t t = 0; t < c.vocab_size; ++t) ids[size_t(t)] = t;
    std::vector<float> table(size_t(c.vocab_size) * c.d_model);
    const Weights w = bind_weights(c, s);
    lev_forward(ExecCtx{}, Tensor(table.data(), {c.vocab_size, c.d_model}), ids.data(),
                lev_weights(w));
    const double e = rms(table.data(), int64_t(table.size()));
    EXPECT_GT(e, 0.5);
    EXPECT_LT(e, 2.0);
  }
}

}  // namespace
}  // namespace cemlm
