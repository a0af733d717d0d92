// The CUDA runner against the CPU model (the oracle) for every variant of tiny_models.h: chunked
// prefill and decode over a scattered paged cache at T = 1, 2, 4 (fp32 within 1e-4, bf16 within
// 5e-2), a mixed-T batch decoding with and without CUDA graphs, copy_block, 64 greedy tokens
// identical to the CPU's, and option errors that name the option.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "cemlm/engine/cpu_model.h"
#include "cemlm/engine/cuda_runner.h"
#include "gpu_test_util.h"
#include "tiny_models.h"

namespace cemlm {
namespace {

using gpu_test::random_ids;
using gpu_test::rel_err;
using testing_models::make_config;
using testing_models::randomize;

int argmax(const float* row, int V) { return int(std::max_element(row, row + V) - row); }

class RunnerTest : public ::testing::TestWithParam<testing_models::Variant> {
 protected:
  void SetUp() override {
    CEMLM_SKIP_WITHOUT_GPU();
    cfg_ = make_config(GetParam());
    cfg_.max_seq_len = 128;  // room for a prompt and 64 generated tokens
    store_ = ParamStore(cfg_);
    randomize(store_, 7);
    w_ = bind_weights(cfg_, store_);
  }
  std::unique_ptr<CudaModelRunner> runner(CudaPrecision precision, bool graphs, int block_size,
                                          int64_t n_blocks) {
    CudaRunnerOptions o;
    o.precision = precision;
    o.cuda_graphs = graphs;
    o.block_size = block_size;
    o.kv_cache_memory = n_blocks * block_size * cfg_.kv_bytes_per_token();
    auto r = make_cuda_runner(cfg_, store_, o);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return nullptr;
    EXPECT_EQ(r.value()->num_blocks(), n_blocks);
    return std::move(r).value();
  }
  // Prefill in chunks of 5, 1, 4, 1, … through a reversed block table, comparing every step.
  void chunked_matches_cpu(CudaPrecision precision, double tol, std::initializer_list<int> depths) {
    const int N = 20, bs = 3, n_blocks = 64, V = cfg_.vocab_size;
    auto gpu = runner(precision, true, bs, n_blocks);
    ASSERT_NE(gpu, nullptr);
    for (int T : depths) {
      auto ids = random_ids(N, V, 11 + T);
      CpuModel cpu(cfg_, w_);
      KvPool kv(cfg_, bs, n_blocks);
      std::vector<int32_t> table(n_blocks);
      std::iota(table.begin(), table.end(), 0);
      std::reverse(table.begin(), table.end());
      int pos = 0, chunk = 5;
      while (pos < N) {
        const int n = std::min(chunk, N - pos);
        Batch b;
        b.seqs.push_back(
            BatchSeq{ids.data() + pos, n, pos, T, table.data(), n_blocks, false, true});
        std::vector<float> want, got;
        cpu.forward(b, kv, &want);
        gpu->forward(b, &got);
        ASSERT_EQ(got.size(), size_t(n) * V);
        EXPECT_LT(rel_err(got, want), tol) << "T=" << T << " chunk at " << pos;
        pos += n;
        chunk = chunk == 5 ? 1 : chunk == 1 ? 4 : 1;
      }
    }
  }

  ModelConfig cfg_;
  ParamStore store_;
  Weights w_;
};

TEST_P(RunnerTest, Fp32ChunkedPrefillAndDecodeMatchCpu) {
  chunked_matches_cpu(CudaPrecision::kFp32, 1e-4, {1, 2, 4});
}

TEST_P(RunnerTest, Bf16StaysCloseToCpu) { chunked_matches_cpu(CudaPrecision::kBf16, 5e-2, {2}); }

// Three sequences with T = 4, 2, 1 prefilled together, then decoded together for five steps
// (with graphs: run, capture, then three replays), feeding the CPU's greedy tokens to both.
TEST_P(RunnerTest, MixedDepthBatchDecodesLikeCpu) {
  const int V = cfg_.vocab_size, bs = 4, n_blocks = 32;
  const std::vector<int> Ts = {4, 2, 1}, lens = {9, 5, 13};
  const std::vector<std::vector<int32_t>> tables = {
      {0, 5, 9, 12, 15, 18}, {2, 11, 13, 16, 19, 21}, {1, 3, 4, 6, 7, 8}};
  for (bool graphs : {false, true}) {
    auto gpu = runner(CudaPrecision::kFp32, graphs, bs, n_blocks);
    ASSERT_NE(gpu, nullptr);
    CpuModel cpu(cfg_, w_);
    KvPool kv(cfg_, bs, n_blocks);
    std::vector<std::vector<int>> seqs;
    for (size_t s = 0; s < Ts.size(); ++s) seqs.push_back(random_ids(lens[s], V, 200 + s));
    std::vector<int> pos(Ts.size(), 0);
    for (int step = 0; step < 6; ++step) {
      Batch b;
      for (size_t s = 0; s < Ts.size(); ++s) {
        const int n = step == 0 ? lens[s] : 1;
        b.seqs.push_back(BatchSeq{seqs[s].data() + pos[s], n, pos[s], Ts[s], tables[s].data(),
                                  int(tables[s].size()), true, false});
      }
      std::vector<float> want, got;
      cpu.forward(b, kv, &want);
      gpu->forward(b, &got);
      ASSERT_EQ(got.size(), Ts.size() * V);
      EXPECT_LT(rel_err(got, want), 1e-4) << "graphs=" << graphs << " step " << step;
      for (size_t s = 0; s < Ts.size(); ++s) {
        pos[s] += b.seqs[s].n_tokens;
        seqs[s].push_back(argmax(want.data() + s * V, V));
      }
    }
  }
}

TEST_P(RunnerTest, CopyBlockGivesTheSameContinuation) {
  const int bs = 4, n_blocks = 40, V = cfg_.vocab_size;
  auto gpu = runner(CudaPrecision::kFp32, false, bs, n_blocks);
  ASSERT_NE(gpu, nullptr);
  auto ids = random_ids(8, V, 300);
  const std::vector<int32_t> a = {3, 7, 9}, b = {20, 21, 9};
  Batch prefill;
  prefill.seqs.push_back(BatchSeq{ids.data(), 7, 0, 2, a.data(), 3, true, false});
  std::vector<float> first, via_a, via_b;
  gpu->forward(prefill, &first);
  gpu->copy_block(3, 20);
  gpu->copy_block(7, 21);
  for (const auto* table : {&a, &b}) {
    Batch step;
    step.seqs.push_back(BatchSeq{ids.data() + 7, 1, 7, 2, table->data(), 3, true, false});
    gpu->forward(step, table == &a ? &via_a : &via_b);
  }
  EXPECT_EQ(via_a, via_b);
}

// Greedy generation in fp32: the device sampler's argmax equals the CPU's for 64 tokens.
TEST_P(RunnerTest, Greedy64TokensMatchCpu) {
  const int bs = 16, n_blocks = 8, V = cfg_.vocab_size, T = 2, prompt = 8, gen = 64;
  auto gpu = runner(CudaPrecision::kFp32, true, bs, n_blocks);
  ASSERT_NE(gpu, nullptr);
  std::vector<int32_t> table(n_blocks);
  std::iota(table.begin(), table.end(), 0);
  CpuModel cpu(cfg_, w_);
  KvPool kv(cfg_, bs, n_blocks);
  std::vector<int> cpu_ids = random_ids(prompt, V, 400), gpu_ids = cpu_ids;
  cuda::SampleRowSpec greedy;
  greedy.temperature = 0.0f;
  for (int i = 0; i < gen; ++i) {
    const int pos = i == 0 ? 0 : prompt + i - 1, n = i == 0 ? prompt : 1;
    Batch bc, bg;
    bc.seqs.push_back(
        BatchSeq{cpu_ids.data() + pos, n, pos, T, table.data(), n_blocks, true, false});
    bg.seqs.push_back(
        BatchSeq{gpu_ids.data() + pos, n, pos, T, table.data(), n_blocks, true, false});
    std::vector<float> logits;
    cpu.forward(bc, kv, &logits);
    cpu_ids.push_back(argmax(logits.data(), V));
    std::vector<cuda::SampledToken> out;
    gpu->forward_sample(bg, std::span<const cuda::SampleRowSpec>(&greedy, 1), &out);
    ASSERT_EQ(out.size(), 1u);
    gpu_ids.push_back(out[0].token);
    ASSERT_EQ(gpu_ids.back(), cpu_ids.back()) << "token " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, RunnerTest, ::testing::ValuesIn(testing_models::all_variants()),
                         [](const auto& info) { return info.param.name; });

// Bad options are refused before any device work, with the option named.
TEST(CudaRunnerOptions, ErrorsNameTheOption) {
  const ModelConfig cfg = make_config(testing_models::all_variants()[0]);
  ParamStore store(cfg);
  CudaRunnerOptions o;
  o.block_size = 0;
  auto r = make_cuda_runner(cfg, store, o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("block_size"), std::string::npos) << r.status();
  o.block_size = 16;
  o.kv_cache_memory = -1;
  r = make_cuda_runner(cfg, store, o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("kv_cache_memory"), std::string::npos) << r.status();
  ParamStore wrong(make_config(testing_models::all_variants()[2]));
  o.kv_cache_memory = 1 << 20;
  r = make_cuda_runner(cfg, wrong, o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("parameters"), std::string::npos) << r.status();
  // The plugin's own entry point (make_model_runner would stop earlier when the plugin library
  // is not beside the test): the device string and the KV dtype are checked before any loading.
  RunnerOptions ro;
  ro.device = "cuda:fp16";
  auto mr = make_cuda_model_runner("/nonexistent", ro);
  ASSERT_FALSE(mr.ok());
  EXPECT_NE(mr.status().message().find("\"cuda:fp16\" is not one of"), std::string::npos)
      << mr.status();
  ro.device = "cuda";
  ro.kv_cache_dtype = "bf16";
  mr = make_cuda_model_runner("/nonexistent", ro);
  ASSERT_FALSE(mr.ok());
  EXPECT_NE(mr.status().message().find("--kv-cache-dtype"), std::string::npos) << mr.status();
}

TEST(CudaRunnerOptions, TooSmallKvCacheNamesTheFlag) {
  CEMLM_SKIP_WITHOUT_GPU();
  const ModelConfig cfg = make_config(testing_models::all_variants()[0]);
  ParamStore store(cfg);
  CudaRunnerOptions o;
  o.kv_cache_memory = 1024;
  auto r = make_cuda_runner(cfg, store, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("kv-cache-memory"), std::string::npos) << r.status();
}

}  // namespace
}  // namespace cemlm
