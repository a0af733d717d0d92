// paged_attention_forward (kernels/cpu/attention.cc) against a double-precision reference written
// straight from MODEL.md §4: one decode row per sequence (the per-row path, AVX-512 where built)
// and multi-row chunks (the gather + sgemm path), for standard attention (separate values) and
// CEM keys with diag none / shared / per-head, heads narrower and wider than a 16-lane vector
// (and wider than 256), more than 16 heads, contexts wider than 256, token counts off the
// 16-token score groups, blocks of 3 and 16 scattered in the pool, contexts shared out over
// threads (the same bits as on one thread), both cache layouts (tiled where the block size is a
// multiple of 16, as the CPU runner lays it out, and token-major), the engine's prefill chunks on
// the one-row path (each row's bits equal to the row attended alone), and both cache dtypes: fp32,
// and bf16 (the reference reads the same rounded entries, so both agree to fp32 rounding). Pool
// entries no row wrote are NaN, so a read past a sequence's end fails the comparison.
#include "cemlm/kernels/attention.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "cemlm/engine/params.h"
#include "cemlm/kernels/bf16.h"

namespace cemlm {
namespace {

struct Case {
  bool values;  // standard attention: a separate value pool
  DiagKind diag;
  int heads, dh, D, block, n_ctx, rows;  // `rows` query rows at the sequence's last positions
  bool bf16;
  int threads = 0;  // OpenMP threads for the call (0: as set)
  bool invariant = false;  // ExecCtx::batch_invariant (the engine's): every row on the one-row path
  bool token_major = false;  // a token-major cache even where the CPU runner tiles it (block % 16)
};

std::string name_of(const Case& c) {
  const char* d = c.diag == DiagKind::kNone     ? "none"
                  : c.diag == DiagKind::kShared ? "shared"
                                                : "perhead";
  return std::string(c.values ? "std" : "cem") + "_" + d + "_h" + std::to_string(c.heads) + "x" +
         std::to_string(c.dh) + "_D" + std::to_string(c.D) + "_bs" + std::to_string(c.block) +
         "_ctx" + std::to_string(c.n_ctx) + "_r" + std::to_string(c.rows) +
         (c.bf16 ? "_bf16" : "_f32") + (c.threads ? "_t" + std::to_string(c.threads) : "") +
         (c.invariant ? "_invariant" : "") + (c.token_major ? "_tokenmajor" : "");
}

class AttentionTest : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionTest, MatchesReference) {
  const Case c = GetParam();
  const int W = c.heads * c.dh, D = c.D, bs = c.block;
  const bool ctx = c.diag != DiagKind::kNone;
  const int n_blocks = (c.n_ctx + bs - 1) / bs + 2;
  Rng rng(uint64_t(W * 131 + D * 7 + c.n_ctx));
  auto normal = [&](std::vector<float>& v) {
    for (float& x : v) x = float(rng.normal());
  };
  // Token j's entries, as the cache will hold them (rounded through bf16 for a bf16 cache).
  std::vector<float> K(size_t(c.n_ctx) * W), V(size_t(c.n_ctx) * W), C(size_t(c.n_ctx) * D);
  normal(K), normal(V), normal(C);
  if (c.bf16)
    for (auto* v : {&K, &V, &C})
      for (float& x : *v) x = bf16_to_f32(f32_to_bf16(x));
  // Pools with the sequence's blocks scattered in reverse order, NaN wherever nothing is written
  // (a read past the sequence's end would show).
  const int64_t slots = int64_t(n_blocks) * bs;
  const uint16_t nan16 = 0x7FC0;
  std::vector<float> k32(slots * W, NAN), v32(slots * W, NAN), c32(slots * D, NAN);
  std::vector<uint16_t> k16(slots * W, nan16), v16(slots * W, nan16), c16(slots * D, nan16);
  std::vector<int32_t> table(static_cast<size_t>(n_blocks));
  std::iota(table.rbegin(), table.rend(), 0);
  KvLayerView kv;
  kv.block_size = bs, kv.n_heads = c.heads, kv.k_width = W, kv.c_width = ctx ? D : 0;
  kv.tiled = bs % 16 == 0 && !c.token_major;  // as the CPU runner lays its cache out
  if (c.bf16) {
    kv.k16 = k16.data(), kv.v16 = c.values ? v16.data() : nullptr,
    kv.c16 = ctx ? c16.data() : nullptr;
  } else {
    kv.k = k32.data(), kv.v = c.values ? v32.data() : nullptr, kv.c = ctx ? c32.data() : nullptr;
  }
  AttnSeq all{0, c.n_ctx, 0, table.data()};
  kv_write(ExecCtx{}, kv, &all, 1, Tensor(K.data(), {c.n_ctx, W}),
           c.values ? Tensor(V.data(), {c.n_ctx, W}) : Tensor{},
           ctx ? Tensor(C.data(), {c.n_ctx, D}) : Tensor{});
  const std::vector<float>& vals = c.values ? V : K;

  const int R = c.rows, qd_w = c.diag == DiagKind::kPerHead ? c.heads * D : D;
  std::vector<float> q(size_t(R) * W), qd(size_t(R) * qd_w), out(size_t(R) * W, NAN),
      oc(size_t(R) * qd_w, NAN);
  normal(q), normal(qd);
  const AttnSeq seq{0, R, c.n_ctx - R, table.data()};
  const float scale = 1.0f / std::sqrt(float(c.dh));
  ExecCtx ex;
  ex.batch_invariant = c.invariant;
  const int threads_before = omp_get_max_threads();
  if (c.threads) omp_set_num_threads(c.threads);
  std::vector<float> scratch(size_t(paged_attention_scratch_floats(&seq, 1, kv, c.diag)));
  ex.scratch = scratch.data(), ex.scratch_floats = int64_t(scratch.size());
  paged_attention_forward(ex, Tensor(out.data(), {R, W}),
                          ctx ? Tensor(oc.data(), {R, qd_w}) : Tensor{}, Tensor(q.data(), {R, W}),
                          ctx ? Tensor(qd.data(), {R, qd_w}) : Tensor{}, c.diag, kv, &seq, 1,
                          scale);
  if (c.threads > 1 && (R < 8 || c.invariant)) {
    // The rows' context shared out over the threads gives the bits of one thread doing it all
    // (a batch-1 row must not round otherwise than the same row inside a batch).
    std::vector<float> out1(out.size(), NAN), oc1(oc.size(), NAN);
    omp_set_num_threads(1);
    paged_attention_forward(ex, Tensor(out1.data(), {R, W}),
                            ctx ? Tensor(oc1.data(), {R, qd_w}) : Tensor{},
                            Tensor(q.data(), {R, W}), ctx ? Tensor(qd.data(), {R, qd_w}) : Tensor{},
                            c.diag, kv, &seq, 1, scale);
    EXPECT_EQ(std::memcmp(out1.data(), out.data(), sizeof(float) * out.size()), 0);
    EXPECT_TRUE(!ctx || std::memcmp(oc1.data(), oc.data(), sizeof(float) * oc.size()) == 0);
  }
  omp_set_num_threads(threads_before);
  if (c.invariant) {
    // Each row alone, as a decode step would attend it: the same bits as inside the chunk (a
    // prompt's cache must not depend on how it was chunked).
    for (int r = 0; r < R; ++r) {
      std::vector<float> out1(W, NAN), oc1(qd_w, NAN);
      const AttnSeq one{0, 1, c.n_ctx - R + r, table.data()};
      paged_attention_forward(ex, Tensor(out1.data(), {1, W}),
                              ctx ? Tensor(oc1.data(), {1, qd_w}) : Tensor{},
                              Tensor(q.data() + size_t(r) * W, {1, W}),
                              ctx ? Tensor(qd.data() + size_t(r) * qd_w, {1, qd_w}) : Tensor{},
                              c.diag, kv, &one, 1, scale);
      EXPECT_EQ(std::memcmp(out1.data(), out.data() + size_t(r) * W, sizeof(float) * W), 0)
          << "row " << r;
      EXPECT_TRUE(!ctx ||
                  std::memcmp(oc1.data(), oc.data() + size_t(r) * qd_w, sizeof(float) * qd_w) == 0)
          << "row " << r;
    }
  }

  for (int r = 0; r < R; ++r) {
    const int n = c.n_ctx - R + r + 1;  // causal: positions 0 … pos
    std::vector<double> want(W, 0.0), want_c(qd_w, 0.0);
    for (int h = 0; h < c.heads; ++h) {
      std::vector<double> s(n);
      for (int j = 0; j < n; ++j) {
        double e = 0;
        for (int i = 0; i < c.dh; ++i)
          e += double(q[r * W + h * c.dh + i]) * K[size_t(j) * W + h * c.dh + i];
        const float* qdr =
            qd.data() + size_t(r) * qd_w + (c.diag == DiagKind::kPerHead ? h * D : 0);
        for (int i = 0; ctx && i < D; ++i) e += double(qdr[i]) * C[size_t(j) * D + i];
        s[j] = scale * e;
      }
      const double m = *std::max_element(s.begin(), s.end());
      double z = 0;
      for (double& x : s) z += (x = std::exp(x - m));
      for (int j = 0; j < n; ++j) {
        const double p = s[j] / z;
        for (int i = 0; i < c.dh; ++i) want[h * c.dh + i] += p * vals[size_t(j) * W + h * c.dh + i];
        double* wc = want_c.data() + (c.diag == DiagKind::kPerHead ? h * D : 0);
        for (int i = 0; ctx && i < D; ++i) wc[i] += p * C[size_t(j) * D + i];
      }
    }
    for (int i = 0; i < W; ++i)
      ASSERT_NEAR(out[size_t(r) * W + i], want[i], 2e-5 * (1 + std::fabs(want[i])))
          << "row " << r << " out " << i;
    // The shared diagonal's weights add up to H (each head's probabilities): its sums' rounding
    // grows with H (16 heads over 1024 columns came within 10% of 2e-5 on the portable passes).
    const double tol_c = 2e-5 * (c.diag == DiagKind::kShared ? c.heads : 1);
    for (int i = 0; ctx && i < qd_w; ++i)
      ASSERT_NEAR(oc[size_t(r) * qd_w + i], want_c[i], tol_c * (1 + std::fabs(want_c[i])))
          << "row " << r << " context sum " << i;
  }
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (bool bf16 : {false, true}) {
    for (int rows : {1, 9}) {  // the per-row path; the gather + sgemm path (≥ 8 rows)
      v.push_back({true, DiagKind::kNone, 3, 6, 16, 3, 37, rows, bf16});
      v.push_back({false, DiagKind::kNone, 2, 40, 16, 16, 50, rows, bf16});
      v.push_back({false, DiagKind::kShared, 4, 16, 300, 16, 33, rows, bf16});
      v.push_back({false, DiagKind::kShared, 2, 6, 16, 3, 17, rows, bf16});
      v.push_back({false, DiagKind::kPerHead, 2, 8, 24, 3, 21, rows, bf16});
    }
    v.push_back({false, DiagKind::kShared, 4, 64, 256, 16, 144, 1, bf16});  // the bench's shape
    v.push_back({false, DiagKind::kShared, 1, 6, 16, 16, 1, 1, bf16});      // a single token
    v.push_back({false, DiagKind::kShared, 16, 64, 1024, 16, 136, 1, bf16});  // bench --shape base
    // 20 heads of 16 columns, 7 of 48, and one wider than the 256-column register sums.
    v.push_back({true, DiagKind::kNone, 20, 16, 32, 16, 45, 1, bf16});
    v.push_back({false, DiagKind::kNone, 7, 48, 32, 16, 40, 1, bf16});
    v.push_back({false, DiagKind::kShared, 1, 272, 24, 16, 20, 1, bf16});
    // Long contexts with fewer rows than threads: 64-token chunks shared out over 2, 3 (uneven
    // shares) and 4 threads (512-token blocks make 512-token chunks, 3 over 4 threads: one share
    // is empty); each also against one thread, bit for bit. 130 tokens: the shortest split, two
    // chunks and a third of two tokens.
    v.push_back({false, DiagKind::kShared, 4, 64, 256, 16, 700, 1, bf16, 2});
    v.push_back({false, DiagKind::kShared, 4, 64, 256, 16, 130, 1, bf16, 2});
    v.push_back({false, DiagKind::kShared, 2, 40, 48, 16, 1000, 2, bf16, 3});
    v.push_back({false, DiagKind::kPerHead, 2, 8, 24, 3, 800, 1, bf16, 3});
    v.push_back({true, DiagKind::kNone, 3, 6, 16, 512, 1100, 1, bf16, 4});
    // The engine's prefill chunks: many rows of one sequence, each on the one-row path, each
    // against itself alone bit for bit; contexts across 64-token chunks, rows off any multiple.
    v.push_back({false, DiagKind::kShared, 4, 64, 256, 16, 150, 37, bf16, 0, true});
    v.push_back({false, DiagKind::kShared, 16, 64, 1024, 32, 200, 70, bf16, 0, true});
    v.push_back({false, DiagKind::kNone, 3, 40, 16, 16, 90, 23, bf16, 0, true});
    v.push_back({true, DiagKind::kNone, 2, 16, 16, 48, 75, 10, bf16, 0, true});
    v.push_back({false, DiagKind::kShared, 2, 6, 16, 3, 40, 12, bf16, 0, true});
    v.push_back({false, DiagKind::kPerHead, 2, 8, 24, 16, 40, 12, bf16, 0, true});
    v.push_back({false, DiagKind::kPerHead, 4, 16, 48, 16, 300, 1, bf16, 2});  // split, tiled
    v.push_back({false, DiagKind::kShared, 4, 64, 256, 16, 130, 20, bf16, 2, true});
    // The token-major layout where the runner would tile (the portable passes read it).
    v.push_back({false, DiagKind::kShared, 4, 64, 256, 16, 144, 1, bf16, 0, false, true});
    v.push_back({true, DiagKind::kNone, 3, 6, 16, 16, 37, 9, bf16, 0, true, true});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionTest, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return name_of(info.param); });

TEST(Bf16, RoundsToNearestEven) {
  auto bits = [](uint32_t u) { return f32_to_bf16(std::bit_cast<float>(u)); };
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(bits(0x3F808000u), 0x3F80);  // halfway, even below: stays
  EXPECT_EQ(bits(0x3F818000u), 0x3F82);  // halfway, odd below: up to even
  EXPECT_EQ(bits(0x3F808001u), 0x3F81);  // past halfway: up
  EXPECT_EQ(bits(0x3F807FFFu), 0x3F80);  // below halfway: down
  EXPECT_EQ(bits(0xBF818000u), 0xBF82);  // the sign does not matter
  EXPECT_EQ(bits(0x7F7FFFFFu), 0x7F80);  // the largest float rounds to infinity
  EXPECT_EQ(bits(0x7F800000u), 0x7F80);  // infinity stays
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  EXPECT_TRUE(std::isnan(bf16_to_f32(bits(0x7F800001u))));  // a NaN whose payload sits low
  EXPECT_EQ(bf16_to_f32(0x4049), 3.140625f);
}

}  // namespace
}  // namespace cemlm
