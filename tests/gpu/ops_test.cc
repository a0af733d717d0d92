// Each CUDA op against its CPU oracle on random inputs with odd sizes: fp32 within 1e-5 and the
// bf16 linear path within 2e-2 (relative to the largest reference magnitude).
#include "cemlm/kernels/cuda/ops.h"

#include <gtest/gtest.h>

#include <numeric>

#include "cemlm/kernels/attention.h"
#include "cemlm/kernels/cuda/attention.h"
#include "cemlm/kernels/cuda/linear.h"
#include "cemlm/kernels/elementwise.h"
#include "cemlm/kernels/linear.h"
#include "cemlm/kernels/precond.h"
#include "cemlm/kernels/rmsnorm.h"
#include "cemlm/kernels/rope.h"
#include "gpu_test_util.h"

namespace cemlm {
namespace {

using gpu_test::random_vec;
using gpu_test::rel_err;

constexpr double kFp32Tol = 1e-5, kBf16Tol = 2e-2;

Tensor hview(std::vector<float>& v, std::initializer_list<int64_t> shape) {
  return Tensor(v.data(), shape);
}

class OpsTest : public gpu_test::GpuFixture<> {};

// D = 37 fills part of one 256-thread block; D = 1000 makes threads loop (and all 8 warps reduce).
TEST_F(OpsTest, RmsNorm) {
  const int64_t N = 7;
  for (int64_t D : {37, 1000}) {
    auto x = random_vec(N * D, 1, 3.0f), g = random_vec(D, 2);
    std::vector<float> out(N * D), rstd(N);
    rmsnorm_forward(ExecCtx{}, hview(out, {N, D}), hview(rstd, {N}), hview(x, {N, D}),
                    hview(g, {D}), 1e-5f);
    Tensor dx = dev(x, {N, D}), dout = zeros({N, D}), drstd = zeros({N});
    cuda::rmsnorm_forward(ctx_, dout, drstd, dx, dev(g, {D}), 1e-5f);
    EXPECT_LT(rel_err(host(dout), out), kFp32Tol) << "D=" << D;
    EXPECT_LT(rel_err(host(drstd), rstd), kFp32Tol) << "D=" << D;
    cuda::rmsnorm_forward(ctx_, dx, Tensor{}, dx, dev(g, {D}), 1e-5f);  // in place
    EXPECT_LT(rel_err(host(dx), out), kFp32Tol) << "D=" << D;
  }
}

TEST_F(OpsTest, RopeForwardAndInverse) {
  const int64_t N = 9, H = 3, dh = 10, P = 23;
  std::vector<float> table(P * dh);
  rope_table_init(hview(table, {P, dh}), 10000.0f);
  std::vector<int32_t> pos = {0, 5, 22, 1, 7, 7, 13, 2, 19};
  auto x = random_vec(N * H * dh, 3);
  const Tensor dtable = dev(table, {P, dh});
  for (bool inverse : {false, true}) {
    std::vector<float> out(x.size());
    rope_forward(ExecCtx{}, hview(out, {N, H * dh}), hview(x, {N, H * dh}), pos.data(),
                 hview(table, {P, dh}), inverse);
    Tensor dx = dev(x, {N, H * dh});
    cuda::rope_forward(ctx_, dx, dx, dev_array(pos), dtable, inverse);  // in place
    EXPECT_LT(rel_err(host(dx), out), kFp32Tol) << "inverse=" << inverse;
  }
}

TEST_F(OpsTest, ElementwiseOps) {
  const int64_t N = 7, D = 13, n = N * D;
  auto a = random_vec(n, 4, 3.0f), b = random_vec(n, 5), eta = random_vec(N, 6);
  std::vector<float> out(n);
  silu_forward(ExecCtx{}, hview(out, {N, D}), hview(a, {N, D}));
  Tensor d_out = zeros({N, D});
  cuda::silu_forward(ctx_, d_out, dev(a, {N, D}));
  EXPECT_LT(rel_err(host(d_out), out), kFp32Tol) << "silu";
  swiglu_forward(ExecCtx{}, hview(out, {N, D}), hview(a, {N, D}), hview(b, {N, D}));
  cuda::swiglu_forward(ctx_, d_out, dev(a, {N, D}), dev(b, {N, D}));
  EXPECT_LT(rel_err(host(d_out), out), kFp32Tol) << "swiglu";
  mul_forward(ExecCtx{}, hview(out, {N, D}), hview(a, {N, D}), hview(b, {N, D}));
  cuda::mul_forward(ctx_, d_out, dev(a, {N, D}), dev(b, {N, D}));
  EXPECT_LT(rel_err(host(d_out), out), kFp32Tol) << "mul";
  std::vector<float> x = a;
  axpy_rows_forward(ExecCtx{}, hview(x, {N, D}), hview(b, {N, D}), eta.data());
  Tensor dx = dev(a, {N, D});
  cuda::axpy_rows_forward(ctx_, dx, dev(b, {N, D}), dev_array(eta));
  EXPECT_LT(rel_err(host(dx), x), kFp32Tol) << "axpy_rows";
}

TEST_F(OpsTest, DiagScaleAndGather) {
  const int64_t N = 5, D = 11;
  for (int64_t H : {1, 3}) {  // shared (d [D]) and per-head (d [H, D])
    auto y = random_vec(N * D, 7), d = random_vec(H * D, 8), u = random_vec(N * D, 9),
         oc = random_vec(N * H * D, 10);
    std::vector<float> qd(N * H * D);
    diag_scale_forward(ExecCtx{}, hview(qd, {N, H * D}), hview(y, {N, D}), hview(d, {H * D}));
    Tensor dqd = zeros({N, H * D});
    cuda::diag_scale_forward(ctx_, dqd, dev(y, {N, D}), dev(d, {H * D}));
    EXPECT_LT(rel_err(host(dqd), qd), kFp32Tol) << "diag_scale H=" << H;
    std::vector<float> uu = u;
    diag_gather_forward(ExecCtx{}, hview(uu, {N, D}), hview(oc, {N, H * D}), hview(d, {H * D}));
    Tensor du = dev(u, {N, D});
    cuda::diag_gather_forward(ctx_, du, dev(oc, {N, H * D}), dev(d, {H * D}));
    EXPECT_LT(rel_err(host(du), uu), kFp32Tol) << "diag_gather H=" << H;
  }
}

TEST_F(OpsTest, GatherRows) {
  const int64_t R = 9, D = 7;
  auto src = random_vec(R * D, 11);
  std::vector<int32_t> rows = {8, 0, 3, 3};
  Tensor out = zeros({4, D});
  cuda::gather_rows(ctx_, out, dev(src, {R, D}), dev_array(rows));
  std::vector<float> want;
  for (int32_t r : rows) want.insert(want.end(), src.begin() + r * D, src.begin() + (r + 1) * D);
  EXPECT_EQ(host(out), want);
}

struct LinearCase {
  int64_t N, in, out;
};

class LinearTest : public gpu_test::GpuFixture<::testing::TestWithParam<LinearCase>> {};

TEST_P(LinearTest, Fp32AndBf16MatchCpu) {
  const auto [N, in, out] = GetParam();
  auto x = random_vec(N * in, 12), xt = random_vec(N * out, 13), W = random_vec(out * in, 14, 0.2f),
       y0 = random_vec(N * out, 15), yt0 = random_vec(N * in, 16);
  std::vector<float> y = y0, yt = yt0;
  linear_forward(ExecCtx{}, hview(y, {N, out}), hview(x, {N, in}), hview(W, {out, in}), 1.0f);
  linear_t_forward(ExecCtx{}, hview(yt, {N, in}), hview(xt, {N, out}), hview(W, {out, in}), 0.0f);
  const Tensor dW = dev(W, {out, in});
  Tensor dy = dev(y0, {N, out}), dyt = dev(yt0, {N, in});
  cuda::linear_forward(ctx_, dy, dev(x, {N, in}), dW, 1.0f);
  cuda::linear_t_forward(ctx_, dyt, dev(xt, {N, out}), dW, 0.0f);
  EXPECT_LT(rel_err(host(dy), y), kFp32Tol) << "linear fp32";
  EXPECT_LT(rel_err(host(dyt), yt), kFp32Tol) << "linear_t fp32";

  cuda::DeviceBuffer wb(sizeof(uint16_t) * size_t(out * in));
  cuda::to_bf16(ctx_, wb.as<uint16_t>(), dW.data, out * in);
  const cuda::DeviceWeight w16{nullptr, wb.as<uint16_t>(), out, in};
  set_scratch(cuda::linear_scratch_floats(N, std::max(in, out)));
  dy = dev(y0, {N, out});
  dyt = dev(yt0, {N, in});
  cuda::linear_forward(ctx_, dy, dev(x, {N, in}), w16, 1.0f);
  cuda::linear_t_forward(ctx_, dyt, dev(xt, {N, out}), w16, 0.0f);
  EXPECT_LT(rel_err(host(dy), y), kBf16Tol) << "linear bf16";
  EXPECT_LT(rel_err(host(dyt), yt), kBf16Tol) << "linear_t bf16";
}

INSTANTIATE_TEST_SUITE_P(Shapes, LinearTest,
                         ::testing::Values(LinearCase{7, 33, 19}, LinearCase{1, 65, 129},
                                           LinearCase{37, 127, 61}),
                         [](const auto& info) {
                           const LinearCase& c = info.param;
                           return "n" + std::to_string(c.N) + "_in" + std::to_string(c.in) +
                                  "_out" + std::to_string(c.out);
                         });

TEST_F(OpsTest, GemmTransposes) {
  const int M = 5, N = 7, K = 9;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      auto A = random_vec(M * K, 17), B = random_vec(K * N, 18), C = random_vec(M * N, 19);
      const int lda = ta ? M : K, ldb = tb ? K : N;
      std::vector<float> ref = C;
      gemm(ta, tb, M, N, K, 0.5f, A.data(), lda, B.data(), ldb, 2.0f, ref.data(), N);
      float* dC = dev_array(C);
      cuda::gemm(ctx_, ta, tb, M, N, K, 0.5f, dev_array(A), lda, dev_array(B), ldb, 2.0f, dC, N);
      EXPECT_LT(rel_err(host(dC, C.size()), ref), kFp32Tol) << "ta=" << ta << " tb=" << tb;
    }
}

TEST_F(OpsTest, Precond) {
  const int64_t N = 7, D = 13, r = 3;
  auto u = random_vec(N * D, 20), p = random_vec(D, 21), Pu = random_vec(D * r, 22, 0.3f),
       Pv = random_vec(D * r, 23, 0.3f);
  p[0] = 25.0f;  // the softplus(z) = z branch
  std::vector<float> out(N * D), scratch(2 * N * r);
  ExecCtx cpu;
  cpu.scratch = scratch.data();
  cpu.scratch_floats = int64_t(scratch.size());
  precond_forward(cpu, hview(out, {N, D}), hview(u, {N, D}), hview(p, {D}), hview(Pu, {D, r}),
                  hview(Pv, {D, r}));
  set_scratch(2 * N * r);
  Tensor dout = zeros({N, D});
  cuda::precond_forward(ctx_, dout, dev(u, {N, D}), dev(p, {D}), dev(Pu, {D, r}), dev(Pv, {D, r}));
  EXPECT_LT(rel_err(host(dout), out), kFp32Tol);
}

// Three sequences over a scattered paged cache with block size 3: a prefill chunk long enough
// for the CPU's gemm path, a two-row chunk, and a decode row whose context spans three tiles.
// The tiny widths fit inside a warp; the wide ones (head_dim 72 or 160, d_model 300: not
// multiples of 32, past the 32 lanes of a score's dot product and the 128 threads of the sums)
// make every loop of the kernel stride, and d_model 7000 with the diagonal needs 56 KiB of shared
// memory per block, past the default 48 KiB: the op opts in before its launch.
struct AttnCase {
  const char* name;
  DiagKind diag;
  bool with_v;
  int H = 3, dh = 6, D = 11;
  // The decode row's first 64 scores overflow to -inf in every head (a whole tile of them, and a
  // whole CPU chunk): they get no weight, not NaN.
  bool overflow = false;
};

class AttentionTest : public gpu_test::GpuFixture<::testing::TestWithParam<AttnCase>> {};

TEST_P(AttentionTest, KvWriteAndAttentionMatchCpu) {
  const AttnCase cs = GetParam();
  const int H = cs.H, dh = cs.dh, W = H * dh, D = cs.D, bs = 3, n_blocks = 48;
  const bool diag = cs.diag != DiagKind::kNone;
  const int qd_heads = cs.diag == DiagKind::kPerHead ? H : 1;
  struct S {
    int rows, pos;
  };
  const std::vector<S> shape = {{9, 4}, {2, 0}, {1, 70}};
  std::vector<std::vector<int32_t>> tables(shape.size());
  {
    std::vector<int32_t> perm(n_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::reverse(perm.begin(), perm.end());
    size_t next = 0;
    for (size_t s = 0; s < shape.size(); ++s)
      for (int b = 0; b < (shape[s].pos + shape[s].rows + bs - 1) / bs; ++b)
        tables[s].push_back(perm[next++]);
  }
  const int64_t slots = int64_t(n_blocks) * bs;
  auto k_pool = random_vec(slots * W, 30), v_pool = random_vec(slots * W, 31),
       c_pool = random_vec(slots * D, 32);
  std::vector<AttnSeq> hseqs, dseqs;
  int N = 0;
  for (size_t s = 0; s < shape.size(); ++s) {
    hseqs.push_back(AttnSeq{N, shape[s].rows, shape[s].pos, tables[s].data()});
    dseqs.push_back(AttnSeq{N, shape[s].rows, shape[s].pos, dev_array(tables[s])});
    N += shape[s].rows;
  }
  auto k = random_vec(N * W, 33), v = random_vec(N * W, 34), c = random_vec(N * D, 35),
       q = random_vec(N * W, 36),
       qd = random_vec(N * qd_heads * D, 37, 0.3f * std::sqrt(11.0f / float(D)));  // qd·c ~ 1
  const int64_t oc_w = int64_t(qd_heads) * D;
  if (cs.overflow) {  // the decode row (the last one): -3e19 · 3e19 in the first 64 keys
    for (int h = 0; h < H; ++h) {
      q[size_t(N - 1) * W + h * dh] = 3e19f;
      k[size_t(N - 1) * W + h * dh] = 0.0f;  // its own key scores as the later ones do
      for (int p = 0; p < shape.back().pos; ++p) {
        const int64_t slot = int64_t(tables.back()[p / bs]) * bs + p % bs;
        k_pool[slot * W + h * dh] = p < 64 ? -3e19f : 0.0f;
      }
    }
  }

  KvLayerView hkv{
      k_pool.data(), cs.with_v ? v_pool.data() : nullptr, diag ? c_pool.data() : nullptr, bs, H, W,
      diag ? D : 0};
  KvLayerView dkv{dev_array(k_pool),
                  cs.with_v ? dev_array(v_pool) : nullptr,
                  diag ? dev_array(c_pool) : nullptr,
                  bs,
                  H,
                  W,
                  diag ? D : 0};
  const float scale = 1.0f / std::sqrt(float(dh));

  kv_write(ExecCtx{}, hkv, hseqs.data(), 3, hview(k, {N, W}),
           cs.with_v ? hview(v, {N, W}) : Tensor{}, diag ? hview(c, {N, D}) : Tensor{});
  std::vector<float> out(N * W), out_c(diag ? N * oc_w : 0);
  std::vector<float> scratch(size_t(paged_attention_scratch_floats(hseqs.data(), 3, hkv, cs.diag)));
  ExecCtx cpu;
  cpu.scratch = scratch.data();
  cpu.scratch_floats = int64_t(scratch.size());
  paged_attention_forward(cpu, hview(out, {N, W}), diag ? hview(out_c, {N, oc_w}) : Tensor{},
                          hview(q, {N, W}), diag ? hview(qd, {N, oc_w}) : Tensor{}, cs.diag, hkv,
                          hseqs.data(), 3, scale);

  set_scratch(cuda::paged_attention_scratch_floats(dseqs.data(), 3, dkv, cs.diag));
  cuda::kv_write(ctx_, dkv, dseqs.data(), 3, dev(k, {N, W}), cs.with_v ? dev(v, {N, W}) : Tensor{},
                 diag ? dev(c, {N, D}) : Tensor{});
  Tensor dout = zeros({N, W}), doc = diag ? zeros({N, oc_w}) : Tensor{};
  cuda::paged_attention_forward(ctx_, dout, doc, dev(q, {N, W}),
                                diag ? dev(qd, {N, oc_w}) : Tensor{}, cs.diag, dkv, dseqs.data(), 3,
                                scale);
  EXPECT_EQ(host(dkv.k, k_pool.size()), k_pool) << "keys written";
  if (cs.with_v) {
    EXPECT_EQ(host(dkv.v, v_pool.size()), v_pool) << "values written";
  }
  if (diag) {
    EXPECT_EQ(host(dkv.c, c_pool.size()), c_pool) << "contexts written";
  }
  EXPECT_LT(rel_err(host(dout), out), kFp32Tol) << "out";
  if (diag) {
    EXPECT_LT(rel_err(host(doc), out_c), kFp32Tol) << "out_c";
  }
  const cuda::AttentionSmem smem = cuda::paged_attention_prepare(dh, D, diag);
  EXPECT_TRUE(smem.fits()) << (smem.error ? smem.error : "") << " " << smem.dynamic_bytes;
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, AttentionTest,
    ::testing::Values(AttnCase{"standard", DiagKind::kNone, true},
                      AttnCase{"cem_none", DiagKind::kNone, false},
                      AttnCase{"cem_shared", DiagKind::kShared, false},
                      AttnCase{"cem_per_head", DiagKind::kPerHead, false},
                      AttnCase{"wide_standard", DiagKind::kNone, true, 2, 160, 300},
                      AttnCase{"wide_cem_shared", DiagKind::kShared, false, 2, 72, 300},
                      AttnCase{"wide_cem_per_head", DiagKind::kPerHead, false, 2, 72, 300},
                      AttnCase{"optin_cem_shared", DiagKind::kShared, false, 2, 64, 7000},
                      AttnCase{"overflow_standard", DiagKind::kNone, true, 3, 6, 11, true},
                      AttnCase{"overflow_cem_shared", DiagKind::kShared, false, 3, 6, 11, true}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace cemlm
