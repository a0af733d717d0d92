// paged_attention_forward (kernels/cpu/attention.cc) against a double-precision reference written
// straight from MODEL.md §4: one decode row per sequence (the per-row path, AVX-512 where built)
// and multi-row chunks (the gather + sgemm path), for standard attention (separate values) and
// CEM keys with diag none / shared / per-head, heads narrower and wider than a 16-lane vector
// (and wider than 256), more than 16 heads, contexts wider than 256, token counts off the
// 16-token score groups, blocks of 3 and 16 scattered in the pool, contexts shared out over
// threads (the same bits as on one thread), both cache layouts (tiled where the block size is a
// multiple of 16, as the CPU runner lays it out, and token-major), the engine's prefill chunks on
// the one-row path (each row's bits equal to the row attended alone), and the three cache dtypes:
// fp32, bf16 and int8 (the reference reads the entries as the cache holds them — rounded to bf16,
// or quantized by its own int8 rounding — so all agree to fp32 rounding). Pool entries (and int8
// scales) no row wrote are NaN, so a read past a sequence's end fails the comparison. Also: the
// cache write of many sequences at once (split over threads) against each written alone.
#include "cemlm/kernels/attention.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "cemlm/engine/params.h"
#include "cemlm/kernels/bf16.h"

namespace cemlm {
namespace {

enum class Dt { kF32, kBf16, kInt8 };

struct Case {
  bool values;  // standard attention: a separate value pool
  DiagKind diag;
  int heads, dh, D, block, n_ctx, rows;  // `rows` query rows at the sequence's last positions
  Dt dtype;
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
         (c.dtype == Dt::kBf16   ? "_bf16"
          : c.dtype == Dt::kInt8 ? "_int8"
                                 : "_f32") +
         (c.threads ? "_t" + std::to_string(c.threads) : "") + (c.invariant ? "_invariant" : "") +
         (c.token_major ? "_tokenmajor" : "");
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
  // Token j's entries, as the cache will hold them: rounded through bf16 for a bf16 cache; for an
  // int8 cache, each group (a key or value row's head, a context row) as the nearest multiple of
  // its largest magnitude / 127.
  std::vector<float> K(size_t(c.n_ctx) * W), V(size_t(c.n_ctx) * W), C(size_t(c.n_ctx) * D);
  normal(K), normal(V), normal(C);
  if (c.dtype == Dt::kBf16)
    for (auto* v : {&K, &V, &C})
      for (float& x : *v) x = bf16_to_f32(f32_to_bf16(x));
  if (c.dtype == Dt::kInt8)
    for (auto [v, group] : {std::pair{&K, c.dh}, std::pair{&V, c.dh}, std::pair{&C, D}})
      for (size_t g = 0; g < v->size(); g += size_t(group)) {
        float* x = v->data() + g;
        double m = 0;
        for (int i = 0; i < group; ++i) m = std::max(m, std::fabs(double(x[i])));
        const float step = float(m) / 127.0f;
        for (int i = 0; i < group; ++i) x[i] = std::nearbyint(x[i] / step) * step;  // ties to even
      }
  // Pools with the sequence's blocks scattered in reverse order, NaN wherever nothing is written
  // (a read past the sequence's end would show).
  const int64_t slots = int64_t(n_blocks) * bs;
  const uint16_t nan16 = 0x7FC0;
  std::vector<float> k32(slots * W, NAN), v32(slots * W, NAN), c32(slots * D, NAN);
  std::vector<uint16_t> k16(slots * W, nan16), v16(slots * W, nan16), c16(slots * D, nan16);
  std::vector<int8_t> k8(slots * W, 127), v8(slots * W, 127), c8(slots * D, 127);
  std::vector<float> ks(slots * c.heads, NAN), vs(slots * c.heads, NAN), cscale(slots, NAN);
  std::vector<int32_t> table(static_cast<size_t>(n_blocks));
  std::iota(table.rbegin(), table.rend(), 0);
  KvLayerView kv;
  kv.block_size = bs, kv.n_heads = c.heads, kv.k_width = W, kv.c_width = ctx ? D : 0;
  kv.tiled = bs % 16 == 0 && !c.token_major;  // as the CPU runner lays its cache out
  if (c.dtype == Dt::kBf16) {
    kv.k16 = k16.data(), kv.v16 = c.values ? v16.data() : nullptr,
    kv.c16 = ctx ? c16.data() : nullptr;
  } else if (c.dtype == Dt::kInt8) {
    kv.k8 = k8.data(), kv.k_scale = ks.data();
    if (c.values) kv.v8 = v8.data(), kv.v_scale = vs.data();
    if (ctx) kv.c8 = c8.data(), kv.c_scale = cscale.data();
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
  ex.attention_split_bytes = 1;  // rows fewer than threads split wherever their chunks allow
  const int threads_before = omp_get_max_threads();
  if (c.threads) omp_set_num_threads(c.threads);
  // Exactly the scratch it asks for, then a guard that must stay untouched.
  const int64_t need = paged_attention_scratch_floats(&seq, 1, kv, c.diag, false, c.invariant);
  constexpr int kGuard = 4096;
  std::vector<float> scratch(size_t(need + kGuard), 12345.0f);
  ex.scratch = scratch.data(), ex.scratch_floats = need;
  paged_attention_forward(ex, Tensor(out.data(), {R, W}),
                          ctx ? Tensor(oc.data(), {R, qd_w}) : Tensor{}, Tensor(q.data(), {R, W}),
                          ctx ? Tensor(qd.data(), {R, qd_w}) : Tensor{}, c.diag, kv, &seq, 1,
                          scale);
  for (int i = 0; i < kGuard; ++i)
    ASSERT_EQ(scratch[size_t(need + i)], 12345.0f) << "wrote past its scratch at " << need + i;
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
  for (Dt dt : {Dt::kF32, Dt::kBf16, Dt::kInt8}) {
    for (int rows : {1, 9}) {  // the per-row path; the gather + sgemm path (≥ 8 rows)
      v.push_back({true, DiagKind::kNone, 3, 6, 16, 3, 37, rows, dt});
      v.push_back({false, DiagKind::kNone, 2, 40, 16, 16, 50, rows, dt});
      v.push_back({false, DiagKind::kShared, 4, 16, 300, 16, 33, rows, dt});
      v.push_back({false, DiagKind::kShared, 2, 6, 16, 3, 17, rows, dt});
      v.push_back({false, DiagKind::kPerHead, 2, 8, 24, 3, 21, rows, dt});
    }
    v.push_back({false, DiagKind::kShared, 4, 64, 256, 16, 144, 1, dt});    // the bench's shape
    v.push_back({false, DiagKind::kShared, 1, 6, 16, 16, 1, 1, dt});        // a single token
    v.push_back({false, DiagKind::kShared, 16, 64, 1024, 16, 136, 1, dt});  // bench --shape base
    // 20 heads of 16 columns, 7 of 48, and one wider than the 256-column register sums.
    v.push_back({true, DiagKind::kNone, 20, 16, 32, 16, 45, 1, dt});
    v.push_back({false, DiagKind::kNone, 7, 48, 32, 16, 40, 1, dt});
    v.push_back({false, DiagKind::kShared, 1, 272, 24, 16, 20, 1, dt});
    // Odd head and context widths: a 64-column block's last column alone.
    v.push_back({false, DiagKind::kShared, 3, 7, 25, 16, 90, 1, dt});
    v.push_back({true, DiagKind::kNone, 2, 5, 16, 32, 70, 1, dt});
    v.push_back({false, DiagKind::kPerHead, 2, 5, 33, 16, 60, 1, dt});
    // Long contexts with fewer rows than threads: 64-token chunks shared out over 2, 3 (uneven
    // shares) and 4 threads (512-token blocks make 512-token chunks, 3 over 4 threads: one share
    // is empty); each also against one thread, bit for bit. 130 tokens: the shortest split, two
    // chunks and a third of two tokens.
    v.push_back({false, DiagKind::kShared, 4, 64, 256, 16, 700, 1, dt, 2});
    v.push_back({false, DiagKind::kShared, 4, 64, 256, 16, 130, 1, dt, 2});
    v.push_back({false, DiagKind::kShared, 2, 40, 48, 16, 1000, 2, dt, 3});
    v.push_back({false, DiagKind::kPerHead, 2, 8, 24, 3, 800, 1, dt, 3});
    v.push_back({true, DiagKind::kNone, 3, 6, 16, 512, 1100, 1, dt, 4});
    // The engine's prefill chunks: many rows of one sequence, each on the one-row path, each
    // against itself alone bit for bit; contexts across 64-token chunks, rows off any multiple.
    v.push_back({false, DiagKind::kShared, 4, 64, 256, 16, 150, 37, dt, 0, true});
    v.push_back({false, DiagKind::kShared, 16, 64, 1024, 32, 200, 70, dt, 0, true});
    v.push_back({false, DiagKind::kNone, 3, 40, 16, 16, 90, 23, dt, 0, true});
    v.push_back({true, DiagKind::kNone, 2, 16, 16, 48, 75, 10, dt, 0, true});
    v.push_back({false, DiagKind::kShared, 2, 6, 16, 3, 40, 12, dt, 0, true});
    v.push_back({false, DiagKind::kPerHead, 2, 8, 24, 16, 40, 12, dt, 0, true});
    v.push_back({false, DiagKind::kPerHead, 4, 16, 48, 16, 300, 1, dt, 2});  // split, tiled
    // The gemm path with more threads than heads (a score matrix for each head's thread only).
    v.push_back({false, DiagKind::kShared, 2, 6, 16, 3, 40, 12, dt, 4});
    v.push_back({false, DiagKind::kPerHead, 1, 8, 24, 16, 40, 9, dt, 3});
    v.push_back({true, DiagKind::kNone, 2, 16, 16, 16, 60, 20, dt, 4});
    v.push_back({false, DiagKind::kShared, 4, 64, 256, 16, 130, 20, dt, 2, true});
    // The token-major layout where the runner would tile (the portable passes read it).
    v.push_back({false, DiagKind::kShared, 4, 64, 256, 16, 144, 1, dt, 0, false, true});
    v.push_back({true, DiagKind::kNone, 3, 6, 16, 16, 37, 9, dt, 0, true, true});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionTest, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return name_of(info.param); });

// An int8 cache keeps what fp32 keeps of odd rows: a key with a NaN or an infinity makes the row's
// output NaN (its group's scale is NaN), and an all-zero key group reads back as zeros.
TEST(Int8Cache, NonFiniteAndZeroGroupsReadBackAsFp32Would) {
  const int H = 2, dh = 16, W = H * dh;
  for (int bs : {16, 3}) {  // tiled (AVX-512 passes where built), token-major (portable)
    for (float poison : {0.5f, INFINITY, NAN}) {  // 0.5: no poison
      std::vector<float> K(2 * W, 0.5f);
      for (int i = 0; i < dh; ++i) K[i] = 0.0f;  // token 0, head 0: all zero
      K[W + dh + 3] = poison;                    // token 1, head 1
      std::vector<int8_t> k8(size_t(bs) * W, 0);
      std::vector<float> ks(size_t(bs) * H, NAN), q(W, 1.0f), out(W, 0.0f);
      const int32_t table[1] = {0};
      KvLayerView kv;
      kv.block_size = bs, kv.n_heads = H, kv.k_width = W, kv.tiled = bs % 16 == 0;
      kv.k8 = k8.data(), kv.k_scale = ks.data();
      const AttnSeq write{0, 2, 0, table}, row{0, 1, 1, table};
      kv_write(ExecCtx{}, kv, &write, 1, Tensor(K.data(), {2, W}), Tensor{}, Tensor{});
      std::vector<float> scratch(
          size_t(paged_attention_scratch_floats(&row, 1, kv, DiagKind::kNone)));
      ExecCtx ex;
      ex.scratch = scratch.data(), ex.scratch_floats = int64_t(scratch.size());
      paged_attention_forward(ex, Tensor(out.data(), {1, W}), Tensor{}, Tensor(q.data(), {1, W}),
                              Tensor{}, DiagKind::kNone, kv, &row, 1, 0.25f);
      for (int i = 0; i < dh; ++i) {  // head 0: weights of 0 (score 0) and 0.5 (score 2)
        const double p1 = 1.0 / (1.0 + std::exp(-2.0));
        EXPECT_NEAR(out[i], 0.5 * p1, 1e-6) << "bs " << bs << " column " << i;
      }
      for (int i = dh; i < W; ++i)
        EXPECT_EQ(std::isnan(out[i]), !std::isfinite(poison))
            << "bs " << bs << " poison " << poison << " column " << i << " " << out[i];
    }
  }
}

// A key group whose largest magnitude is the largest float is finite and must read back finite:
// with scale = max / 127 rounded up, 127 · scale overflowed to infinity, and the row's score
// (0 · ∞ on the portable pass) or its weighted sum (on the AVX-512 one) came out NaN or infinite
// where fp32 keeps a finite key.
TEST(Int8Cache, TheLargestFloatReadsBackFinite) {
  const int H = 2, dh = 16, W = H * dh;
  for (int bs : {16, 3}) {  // tiled (AVX-512 passes where built), token-major (portable)
    std::vector<float> K(W, 0.5f), q(W, 0.0f), out(W, 0.0f);
    K[0] = std::numeric_limits<float>::max();
    std::vector<int8_t> k8(size_t(bs) * W, 0);
    std::vector<float> ks(size_t(bs) * H, NAN);
    const int32_t table[1] = {0};
    KvLayerView kv;
    kv.block_size = bs, kv.n_heads = H, kv.k_width = W, kv.tiled = bs % 16 == 0;
    kv.k8 = k8.data(), kv.k_scale = ks.data();
    const AttnSeq one{0, 1, 0, table};
    kv_write(ExecCtx{}, kv, &one, 1, Tensor(K.data(), {1, W}), Tensor{}, Tensor{});
    std::vector<float> scratch(
        size_t(paged_attention_scratch_floats(&one, 1, kv, DiagKind::kNone)));
    ExecCtx ex;
    ex.scratch = scratch.data(), ex.scratch_floats = int64_t(scratch.size());
    // One token: its weight is 1, so the output is the key (the values of a CEM cache) read back.
    paged_attention_forward(ex, Tensor(out.data(), {1, W}), Tensor{}, Tensor(q.data(), {1, W}),
                            Tensor{}, DiagKind::kNone, kv, &one, 1, 0.25f);
    EXPECT_TRUE(std::isfinite(out[0])) << "bs " << bs << ": " << out[0];
    EXPECT_NEAR(out[0] / K[0], 1.0, 1e-6) << "bs " << bs;
    for (int i = 1; i < W; ++i)
      EXPECT_TRUE(std::isfinite(out[i])) << "bs " << bs << " column " << i;
  }
}

// A query near the largest float against small int8 keys: the scores are finite (q·k ≈ 4e34),
// but the tiled passes summed q times the raw int8 values (up to ±127) over d_h terms before the
// keys' scales, which overflowed (from |q| ~ 1e34), and the row came out NaN where token-major
// blocks and fp32 keep a finite mix. Two tokens, so that the weights depend on the scores; both
// kinds of blocks, and a diagonal term.
TEST(Int8Cache, AHugeQueryWithSmallKeysScoresFinite) {
  const int H = 2, dh = 64, W = H * dh, D = 8;
  for (int bs : {16, 3})
    for (DiagKind diag : {DiagKind::kNone, DiagKind::kShared, DiagKind::kPerHead}) {
      std::vector<float> K(2 * W), C(2 * D), q(W, 3e38f), out(W, 0.0f);
      for (int i = 0; i < 2 * W; ++i) K[size_t(i)] = (i % 3 + 1) * 1e-6f;
      for (int i = 0; i < 2 * D; ++i) C[size_t(i)] = (i % 2 + 1) * 1e-6f;
      const int qd_width = diag == DiagKind::kPerHead ? H * D : D;
      std::vector<float> qd(size_t(qd_width), 3e38f),
          oc(size_t(qd_width), 0.0f);  // [H, D] per head
      std::vector<int8_t> k8(size_t(bs) * W, 0), c8(size_t(bs) * D, 0);
      std::vector<float> ks(size_t(bs) * H, NAN), cs(size_t(bs), NAN);
      const int32_t table[1] = {0};
      KvLayerView kv;
      kv.block_size = bs, kv.n_heads = H, kv.k_width = W, kv.c_width = D, kv.tiled = bs % 16 == 0;
      kv.k8 = k8.data(), kv.k_scale = ks.data(), kv.c8 = c8.data(), kv.c_scale = cs.data();
      const AttnSeq both{0, 2, 0, table}, last{0, 1, 1, table};
      const bool with_diag = diag != DiagKind::kNone;
      kv_write(ExecCtx{}, kv, &both, 1, Tensor(K.data(), {2, W}), Tensor{},
               with_diag ? Tensor(C.data(), {2, D}) : Tensor{});
      std::vector<float> scratch(size_t(paged_attention_scratch_floats(&last, 1, kv, diag)));
      ExecCtx ex;
      ex.batch_invariant = true;
      ex.scratch = scratch.data(), ex.scratch_floats = int64_t(scratch.size());
      paged_attention_forward(
          ex, Tensor(out.data(), {1, W}), with_diag ? Tensor(oc.data(), {1, qd_width}) : Tensor{},
          Tensor(q.data(), {1, W}), with_diag ? Tensor(qd.data(), {1, qd_width}) : Tensor{}, diag,
          kv, &last, 1, 0.25f);
      for (int i = 0; i < W; ++i)
        EXPECT_TRUE(std::isfinite(out[size_t(i)]))
            << "bs " << bs << " diag " << int(diag) << " column " << i << " = " << out[size_t(i)];
    }
}

// A prefill's neighbour rows share their passes: a later token's key must not reach an earlier
// row even when it is NaN (were rows whose last chunks end a few tokens apart to share them, a
// zero weight times NaN would be NaN), and each row keeps its bits alone.
TEST(AttentionRows, ALaterTokensNaNKeyStaysOutOfEarlierRows) {
  const int H = 2, dh = 16, W = H * dh, n_ctx = 40, R = 8, poisoned = 37;
  for (int bs : {16, 3}) {  // tiled (AVX-512 passes where built), token-major (portable)
    const int n_blocks = (n_ctx + bs - 1) / bs;
    Rng rng(7);
    std::vector<float> K(size_t(n_ctx) * W), q(size_t(R) * W);
    for (float& x : K) x = float(rng.normal());
    for (float& x : q) x = float(rng.normal());
    K[size_t(poisoned) * W + 3] = NAN;
    std::vector<float> pool(size_t(n_blocks) * bs * W, 0.0f);
    std::vector<int32_t> table(static_cast<size_t>(n_blocks));
    std::iota(table.begin(), table.end(), 0);
    KvLayerView kv;
    kv.block_size = bs, kv.n_heads = H, kv.k_width = W, kv.tiled = bs % 16 == 0, kv.k = pool.data();
    const AttnSeq all{0, n_ctx, 0, table.data()}, rows{0, R, n_ctx - R, table.data()};
    kv_write(ExecCtx{}, kv, &all, 1, Tensor(K.data(), {n_ctx, W}), Tensor{}, Tensor{});
    std::vector<float> scratch(
        size_t(paged_attention_scratch_floats(&rows, 1, kv, DiagKind::kNone)));
    ExecCtx ex;
    ex.batch_invariant = true;  // the engine's: every row on the one-row path
    ex.scratch = scratch.data(), ex.scratch_floats = int64_t(scratch.size());
    std::vector<float> out(size_t(R) * W, 0.0f);
    paged_attention_forward(ex, Tensor(out.data(), {R, W}), Tensor{}, Tensor(q.data(), {R, W}),
                            Tensor{}, DiagKind::kNone, kv, &rows, 1, 0.25f);
    for (int r = 0; r < R; ++r) {
      const int pos = n_ctx - R + r;
      std::vector<float> alone(W, 0.0f);
      const AttnSeq one{0, 1, pos, table.data()};
      paged_attention_forward(ex, Tensor(alone.data(), {1, W}), Tensor{},
                              Tensor(q.data() + size_t(r) * W, {1, W}), Tensor{}, DiagKind::kNone,
                              kv, &one, 1, 0.25f);
      for (int i = 0; i < W; ++i) {
        // Head 0 holds the NaN: rows from the poisoned position on are NaN there.
        EXPECT_EQ(std::isnan(out[size_t(r) * W + i]), pos >= poisoned && i < dh)
            << "bs " << bs << " position " << pos << " column " << i;
        EXPECT_EQ(std::bit_cast<uint32_t>(out[size_t(r) * W + i]),
                  std::bit_cast<uint32_t>(alone[i]))
            << "bs " << bs << " position " << pos << " column " << i;
      }
    }
  }
}

// A chunk whose every score overflowed to -inf for a head gets no weight, as in a softmax over
// the whole row: the one-row path (the engine's) scored each 64-token chunk against its own
// maximum, exp(-inf - -inf) = NaN, and the row came out NaN where the many-row path gives a
// finite mix of the later tokens' values. Both paths, tiled and token-major blocks.
TEST(AttentionRows, AChunkWhoseScoresAllOverflowGetsNoWeight) {
  const int H = 2, dh = 8, W = H * dh, n_ctx = 101, overflowed = 64;
  const float scale = 1.0f / std::sqrt(float(dh));
  for (int bs : {16, 5}) {
    const int n_blocks = (n_ctx + bs - 1) / bs;
    Rng rng(3);
    std::vector<float> K(size_t(n_ctx) * W), V(size_t(n_ctx) * W), q(W);
    for (float& x : K) x = float(rng.normal());
    for (float& x : V) x = float(rng.normal());
    for (float& x : q) x = float(rng.normal());
    // Each head's first query number meets -3e19 in the first 64 tokens' keys (a product past
    // fp32's range: score -inf) and 0 in the later ones (ordinary scores).
    for (int h = 0; h < H; ++h) {
      q[h * dh] = 3e19f;
      for (int t = 0; t < n_ctx; ++t) K[size_t(t) * W + h * dh] = t < overflowed ? -3e19f : 0.0f;
    }
    std::vector<float> kp(size_t(n_blocks) * bs * W), vp(kp.size());
    std::vector<int32_t> table(static_cast<size_t>(n_blocks));
    std::iota(table.begin(), table.end(), 0);
    KvLayerView kv;
    kv.block_size = bs, kv.n_heads = H, kv.k_width = W, kv.tiled = bs % 16 == 0;
    kv.k = kp.data(), kv.v = vp.data();
    const AttnSeq all{0, n_ctx, 0, table.data()}, row{0, 1, n_ctx - 1, table.data()};
    kv_write(ExecCtx{}, kv, &all, 1, Tensor(K.data(), {n_ctx, W}), Tensor(V.data(), {n_ctx, W}),
             Tensor{});
    // The reference: the later tokens' values, weighted by their scores' softmax, per head.
    std::vector<double> want(W, 0.0);
    for (int h = 0; h < H; ++h) {
      std::vector<double> s;
      for (int t = overflowed; t < n_ctx; ++t) {
        double dot = 0;
        for (int d = 0; d < dh; ++d) dot += double(q[h * dh + d]) * K[size_t(t) * W + h * dh + d];
        s.push_back(dot * scale);
      }
      const double m = *std::max_element(s.begin(), s.end());
      double z = 0;
      for (double& x : s) z += (x = std::exp(x - m));
      for (int t = overflowed; t < n_ctx; ++t)
        for (int d = 0; d < dh; ++d)
          want[h * dh + d] += s[t - overflowed] / z * V[size_t(t) * W + h * dh + d];
    }
    std::vector<float> scratch(
        size_t(paged_attention_scratch_floats(&row, 1, kv, DiagKind::kNone)));
    for (bool invariant : {true, false}) {
      ExecCtx ex;
      ex.batch_invariant = invariant;
      ex.scratch = scratch.data(), ex.scratch_floats = int64_t(scratch.size());
      std::vector<float> out(W, NAN);
      paged_attention_forward(ex, Tensor(out.data(), {1, W}), Tensor{}, Tensor(q.data(), {1, W}),
                              Tensor{}, DiagKind::kNone, kv, &row, 1, scale);
      for (int i = 0; i < W; ++i)
        EXPECT_NEAR(out[i], want[i], 1e-4) << "bs " << bs << " invariant " << invariant << " " << i;
    }
  }
}

// The cache of one layer for `n_blocks` blocks in one dtype, every entry and scale no row wrote
// NaN (fp32, bf16) or an odd pattern (int8), with keys, values and contexts.
struct Pools {
  std::vector<float> k, v, c, ks, vs, cs;
  std::vector<uint16_t> k16, v16, c16;
  std::vector<int8_t> k8, v8, c8;
  KvLayerView view;
  Pools(Dt dt, int bs, int n_blocks, int H, int W, int D) {
    const size_t n = size_t(n_blocks) * size_t(bs);
    view.block_size = bs, view.n_heads = H, view.k_width = W, view.c_width = D;
    view.tiled = bs % 16 == 0;
    if (dt == Dt::kF32) {
      k.assign(n * W, NAN), v.assign(n * W, NAN), c.assign(n * D, NAN);
      view.k = k.data(), view.v = v.data(), view.c = c.data();
    } else if (dt == Dt::kBf16) {
      k16.assign(n * W, 0xFFFF), v16.assign(n * W, 0xFFFF), c16.assign(n * D, 0xFFFF);
      view.k16 = k16.data(), view.v16 = v16.data(), view.c16 = c16.data();
    } else {
      k8.assign(n * W, 0x55), v8.assign(n * W, 0x55), c8.assign(n * D, 0x55);
      ks.assign(n * H, NAN), vs.assign(n * H, NAN), cs.assign(n, NAN);
      view.k8 = k8.data(), view.v8 = v8.data(), view.c8 = c8.data();
      view.k_scale = ks.data(), view.v_scale = vs.data(), view.c_scale = cs.data();
    }
  }
  bool same_bytes(const Pools& o) const {
    auto eq = [](const auto& a, const auto& b) {
      // (An empty vector's data() may be null, which memcmp must not be given.)
      return a.size() == b.size() &&
             (a.empty() ||
              std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0);  // NaNs too
    };
    return eq(k, o.k) && eq(v, o.v) && eq(c, o.c) && eq(ks, o.ks) && eq(vs, o.vs) && eq(cs, o.cs) &&
           eq(k16, o.k16) && eq(v16, o.v16) && eq(c16, o.c16) && eq(k8, o.k8) && eq(v8, o.v8) &&
           eq(c8, o.c8);
  }
};

// kv_write of many sequences in one call, their rows enough to split them over threads, writes
// every entry as writing each sequence alone does, bit for bit, in the three dtypes and both
// layouts; an fp32 cache holds the rows' own numbers at their positions.
TEST(KvWrite, ManySequencesAtOnceWriteWhatEachWouldAlone) {
  const int H = 4, dh = 64, W = H * dh, D = 384, n_seqs = 32;
  struct RestoreThreads {
    int before = omp_get_max_threads();
    ~RestoreThreads() { omp_set_num_threads(before); }
  } restore;
  omp_set_num_threads(4);  // the split runs whatever the machine's cores
  for (Dt dt : {Dt::kF32, Dt::kBf16, Dt::kInt8})
    for (int bs : {16, 3}) {  // tiled, token-major
      // Sequence s: 1 + s % 3 rows from position 5·s (some across a block boundary), its blocks
      // scattered over the pool.
      std::vector<AttnSeq> seqs;
      std::vector<std::vector<int32_t>> tables;
      int rows = 0, n_blocks = 0;
      for (int s = 0; s < n_seqs; ++s) {
        const AttnSeq sq{rows, 1 + s % 3, 5 * s, nullptr};
        tables.emplace_back((sq.pos_begin + sq.n_rows + bs - 1) / bs);
        n_blocks += int(tables.back().size());
        rows += sq.n_rows;
        seqs.push_back(sq);
      }
      std::vector<int32_t> order(static_cast<size_t>(n_blocks));
      std::iota(order.begin(), order.end(), 0);
      Rng rng(uint64_t(bs) * 10 + uint64_t(dt));
      for (size_t i = order.size() - 1; i > 0; --i)
        std::swap(order[i], order[rng.next_u64() % (i + 1)]);
      for (int s = 0, next = 0; s < n_seqs; ++s) {
        for (int32_t& b : tables[size_t(s)]) b = order[size_t(next++)];
        seqs[size_t(s)].blocks = tables[size_t(s)].data();
      }
      std::vector<float> K(size_t(rows) * W), V(size_t(rows) * W), C(size_t(rows) * D);
      for (auto* x : {&K, &V, &C})
        for (float& f : *x) f = float(rng.normal());
      const Tensor k(K.data(), {rows, W}), v(V.data(), {rows, W}), c(C.data(), {rows, D});
      ASSERT_GE(int64_t(rows) * (2 * W + D), 1 << 11) << "too few numbers to split";
      Pools together(dt, bs, n_blocks, H, W, D), alone(dt, bs, n_blocks, H, W, D);
      kv_write(ExecCtx{}, together.view, seqs.data(), n_seqs, k, v, c);
      for (const AttnSeq& sq : seqs) kv_write(ExecCtx{}, alone.view, &sq, 1, k, v, c);
      EXPECT_TRUE(together.same_bytes(alone)) << "dtype " << int(dt) << ", block size " << bs;
      if (dt != Dt::kF32) continue;
      const KvLayerView& kv = together.view;
      for (const AttnSeq& sq : seqs)
        for (int r = 0; r < sq.n_rows; ++r) {
          const int pos = sq.pos_begin + r, row = sq.row_begin + r, cs = kv.column_stride();
          for (int i = 0; i < W; ++i) {
            ASSERT_EQ(kv.k[kv.entry(sq.blocks, pos, W) + int64_t(i) * cs], K[size_t(row) * W + i])
                << "bs " << bs << " position " << pos << " key column " << i;
            ASSERT_EQ(kv.v[kv.entry(sq.blocks, pos, W) + int64_t(i) * cs], V[size_t(row) * W + i]);
          }
          for (int i = 0; i < D; ++i)
            ASSERT_EQ(kv.c[kv.entry(sq.blocks, pos, D) + int64_t(i) * cs], C[size_t(row) * D + i]);
        }
    }
}

TEST(Bf16, RoundsToNearestEvenAndSaturates) {
  auto bits = [](uint32_t u) { return f32_to_bf16(std::bit_cast<float>(u)); };
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(bits(0x3F808000u), 0x3F80);  // halfway, even below: stays
  EXPECT_EQ(bits(0x3F818000u), 0x3F82);  // halfway, odd below: up to even
  EXPECT_EQ(bits(0x3F808001u), 0x3F81);  // past halfway: up
  EXPECT_EQ(bits(0x3F807FFFu), 0x3F80);  // below halfway: down
  EXPECT_EQ(bits(0xBF818000u), 0xBF82);  // the sign does not matter
  // Finite values past bf16's largest (0x7F7F, 3.3895e38) saturate: rounded to nearest they
  // were infinity, and a finite weight made a model that serves as fp32 fail every request.
  EXPECT_EQ(bits(0x7F7FFFFFu), 0x7F7F);  // the largest float
  EXPECT_EQ(bits(0xFF7FFFFFu), 0xFF7F);
  EXPECT_EQ(bits(0x7F7F8000u), 0x7F7F);  // halfway past 0x7F7F, which is odd
  EXPECT_EQ(bits(0x7F7F7FFFu), 0x7F7F);
  EXPECT_EQ(bits(0x7F800000u), 0x7F80);  // infinity stays
  EXPECT_EQ(bits(0xFF800000u), 0xFF80);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  EXPECT_TRUE(std::isnan(bf16_to_f32(bits(0x7F800001u))));  // a NaN whose payload sits low
  EXPECT_EQ(bf16_to_f32(0x4049), 3.140625f);
}

}  // namespace
}  // namespace cemlm
