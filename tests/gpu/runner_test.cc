// The CUDA runner against the CPU model (the oracle) for every variant of tiny_models.h: chunked
// prefill and decode over a scattered paged cache at T = 1, 2, 4 (fp32 within 1e-4, bf16 within
// 5e-2; the same models widened past a warp and a block within 2e-3), a mixed-T batch decoding
// with and without CUDA graphs, a decode batch growing one sequence at a time over captured
// graphs, more decode shapes than the graph cache holds, copy_block, 64 greedy tokens identical to
// the CPU's, option errors that name the option, and working buffers reserved at startup (an
// oversized --max-batch-tokens is a startup error; a full-budget step after an automatic KV cache
// runs).
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
    prepare(make_config(GetParam()));
  }
  void prepare(ModelConfig cfg) {
    cfg_ = cfg;
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
    o.device_sampling = true;  // Greedy64TokensMatchCpu samples on the device
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
  // The deepest row's context passes the attention kernel's 32-token tile (its running max and
  // sum are rescaled across tiles while shallower rows have stopped).
  const std::vector<int> Ts = {4, 2, 1}, lens = {41, 5, 13};
  const std::vector<std::vector<int32_t>> tables = {
      {0, 5, 9, 12, 15, 18, 22, 24, 26, 28, 30, 31}, {2, 11, 13, 16, 19, 21}, {1, 3, 4, 6, 7, 8}};
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

// The batch ramps up one sequence at a time (each prefilled alone, then all decoded for three
// steps: direct, capture, replay), then shrinks back to sizes seen before, whose graphs were
// captured while the batch was smaller and must still replay with the new contents. Buffers are
// reserved at creation, so nothing moves as the batch grows.
TEST_P(RunnerTest, DecodeBatchGrowingStepByStepReplaysGraphsLikeCpu) {
  const int V = cfg_.vocab_size, bs = 4, per_seq = 24, max_seqs = 6;
  const int n_blocks = per_seq * max_seqs;
  CudaRunnerOptions o;
  o.precision = CudaPrecision::kFp32;
  o.block_size = bs;
  o.kv_cache_memory = int64_t(n_blocks) * bs * cfg_.kv_bytes_per_token();
  o.max_batch_tokens = 16;
  o.max_running = max_seqs;
  auto made = make_cuda_runner(cfg_, store_, o);
  ASSERT_TRUE(made.ok()) << made.status();
  auto gpu = std::move(made).value();
  CpuModel cpu(cfg_, w_);
  KvPool kv(cfg_, bs, n_blocks);
  std::vector<std::vector<int>> seqs;
  std::vector<std::vector<int32_t>> tables;
  std::vector<int> pos;
  // T is non-increasing with the index, as batches need (sorted by recursion, descending).
  auto depth = [](size_t s) { return std::max(1, 4 >> int(s / 2)); };
  auto step = [&](const std::vector<size_t>& which, bool prefill, const std::string& what) {
    Batch b;
    for (size_t s : which) {
      const int n = prefill ? int(seqs[s].size()) : 1;
      b.seqs.push_back(BatchSeq{seqs[s].data() + pos[s], n, pos[s], depth(s), tables[s].data(),
                                int(tables[s].size()), true, false});
    }
    std::vector<float> want, got;
    cpu.forward(b, kv, &want);
    gpu->forward(b, &got);
    ASSERT_EQ(got.size(), which.size() * size_t(V)) << what;
    EXPECT_LT(rel_err(got, want), 1e-4) << what;
    for (size_t i = 0; i < which.size(); ++i) {
      pos[which[i]] += b.seqs[i].n_tokens;
      seqs[which[i]].push_back(argmax(want.data() + i * V, V));
    }
  };
  std::vector<size_t> all;
  for (int grow = 0; grow < max_seqs; ++grow) {
    const size_t s = size_t(grow);
    seqs.push_back(random_ids(3 + grow, V, 500 + grow));
    tables.emplace_back(per_seq);
    for (int i = 0; i < per_seq; ++i) tables[s][size_t(i)] = int32_t(i * max_seqs + grow);
    pos.push_back(0);
    step({s}, true, "prefill of sequence " + std::to_string(s));
    all.push_back(s);
    for (int d = 0; d < 3; ++d)
      step(all, false, "decode of " + std::to_string(all.size()) + " sequences, step " +
                           std::to_string(d));
    if (HasFatalFailure()) return;
  }
  for (size_t n : {size_t(2), size_t(5), size_t(1), size_t(6)})  // replays of earlier captures
    for (int d = 0; d < 2; ++d)
      step(std::vector<size_t>(all.begin(), all.begin() + long(n)), false,
           "decode of the first " + std::to_string(n) + " again, step " + std::to_string(d));
}

// More decode shapes than the runner keeps graphs for (64): three sequences decode the same
// position again and again under every non-increasing profile of T up to recursion.max, each
// twice (run directly, then captured), so that the first profiles' graphs are dropped for newer
// ones; then the first profiles again, captured anew. Every step is the CPU's (decoding a position
// again rewrites its cache entries alike on both).
TEST_P(RunnerTest, GraphsPastTheCacheAreDroppedAndCapturedAgain) {
  const int V = cfg_.vocab_size, bs = 4, n_seqs = 3, per_seq = 4, prompt = 6;
  auto gpu = runner(CudaPrecision::kFp32, true, bs, n_seqs * per_seq);
  ASSERT_NE(gpu, nullptr);
  CpuModel cpu(cfg_, w_);
  KvPool kv(cfg_, bs, n_seqs * per_seq);
  std::vector<std::vector<int>> seqs;
  std::vector<std::vector<int32_t>> tables;
  for (int s = 0; s < n_seqs; ++s) {
    seqs.push_back(random_ids(prompt + 1, V, 700 + s));
    tables.emplace_back(per_seq);
    std::iota(tables.back().begin(), tables.back().end(), s * per_seq);
  }
  auto forward = [&](const std::vector<int>& Ts, bool prefill, const std::string& what) {
    Batch b;
    for (int s = 0; s < n_seqs; ++s) {
      if (Ts[size_t(s)] == 0) continue;
      b.seqs.push_back(BatchSeq{seqs[size_t(s)].data() + (prefill ? 0 : prompt),
                                prefill ? prompt : 1, prefill ? 0 : prompt, Ts[size_t(s)],
                                tables[size_t(s)].data(), per_seq, true, false});
    }
    std::vector<float> want, got;
    cpu.forward(b, kv, &want);
    gpu->forward(b, &got);
    ASSERT_EQ(got.size(), want.size()) << what;
    EXPECT_LT(rel_err(got, want), 1e-4) << what;
  };
  for (int s = 0; s < n_seqs; ++s) {
    std::vector<int> Ts(n_seqs, 0);
    Ts[size_t(s)] = 2;
    forward(Ts, true, "prefill of sequence " + std::to_string(s));
  }
  std::vector<std::vector<int>> profiles;
  for (int a = 1; a <= cfg_.recursion_max; ++a)
    for (int b = 1; b <= a; ++b)
      for (int c = 1; c <= b; ++c) profiles.push_back({a, b, c});
  ASSERT_GT(profiles.size(), size_t(64));  // 120 at recursion.max 8
  auto name = [](const std::vector<int>& Ts) {
    return "T " + std::to_string(Ts[0]) + "," + std::to_string(Ts[1]) + "," + std::to_string(Ts[2]);
  };
  for (const auto& Ts : profiles)
    for (int k = 0; k < 2; ++k) forward(Ts, false, name(Ts) + (k ? ", captured" : ", direct"));
  for (size_t i = 0; i < 8; ++i)
    for (int k = 0; k < 2; ++k) forward(profiles[i], false, name(profiles[i]) + ", again");
}

// A copied block continues as the CPU's copy does, through direct steps and replayed graphs.
TEST_P(RunnerTest, CopyBlockGivesTheSameContinuation) {
  const int bs = 4, n_blocks = 40, V = cfg_.vocab_size;
  for (bool graphs : {false, true}) {
    auto gpu = runner(CudaPrecision::kFp32, graphs, bs, n_blocks);
    ASSERT_NE(gpu, nullptr);
    CpuModel cpu(cfg_, w_);
    KvPool kv(cfg_, bs, n_blocks);
    auto ids = random_ids(8, V, 300);
    const std::vector<int32_t> a = {3, 7, 9}, b = {20, 21, 9};
    Batch prefill;
    prefill.seqs.push_back(BatchSeq{ids.data(), 7, 0, 2, a.data(), 3, true, false});
    std::vector<float> first, want_first, via_a, via_b, want;
    gpu->forward(prefill, &first);
    cpu.forward(prefill, kv, &want_first);
    for (auto [src, dst] : {std::pair{3, 20}, std::pair{7, 21}}) {
      gpu->copy_block(src, dst);
      kv.copy_block(src, dst);
    }
    for (int rep = 0; rep < 2; ++rep)  // the second time, a captured decode step is replayed
      for (const auto* table : {&a, &b}) {
        Batch step;
        step.seqs.push_back(BatchSeq{ids.data() + 7, 1, 7, 2, table->data(), 3, true, false});
        gpu->forward(step, table == &a ? &via_a : &via_b);
        cpu.forward(step, kv, &want);
        EXPECT_LT(rel_err(table == &a ? via_a : via_b, want), 1e-4)
            << (graphs ? "graphs, " : "") << "rep " << rep;
      }
    EXPECT_EQ(via_a, via_b);
  }
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

// The same models widened past a warp and a block of threads (d_model 320, heads of 72, d_ff 520,
// none a multiple of 32), so that the runner's wiring (workspace sizes, strides, launch shapes)
// is checked where every kernel loop runs more than once. The tolerance is wider: at this width
// the randomized weights make the CPU model itself move by up to 4e-4 under a 1e-6 relative
// perturbation of its weights (T = 4), and the GPU's sums round in another order.
class WideRunnerTest : public RunnerTest {
 protected:
  void SetUp() override {
    CEMLM_SKIP_WITHOUT_GPU();
    ModelConfig cfg = make_config(GetParam());
    cfg.d_model = 320;
    cfg.n_heads = 4;
    cfg.head_dim = 72;
    cfg.d_ff = 520;
    prepare(cfg);
  }
};

TEST_P(WideRunnerTest, Fp32ChunkedPrefillAndDecodeMatchCpu) {
  chunked_matches_cpu(CudaPrecision::kFp32, 2e-3, {1, 2, 4});
}

INSTANTIATE_TEST_SUITE_P(Variants, WideRunnerTest,
                         ::testing::ValuesIn(testing_models::all_variants()),
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
  o.max_batch_tokens = 0;
  r = make_cuda_runner(cfg, store, o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--max-batch-tokens"), std::string::npos) << r.status();
  o.max_batch_tokens = 64;
  o.max_running = 0;
  r = make_cuda_runner(cfg, store, o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--max-running"), std::string::npos) << r.status();
  o.max_running = 8;
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
  for (const char* dtype : {"bf16", "int8"}) {  // CPU caches only
    ro.kv_cache_dtype = dtype;
    mr = make_cuda_model_runner("/nonexistent", ro);
    ASSERT_FALSE(mr.ok());
    EXPECT_NE(mr.status().message().find("--kv-cache-dtype"), std::string::npos) << mr.status();
  }
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

// A config that claims more positions than one sequence's cache could hold on the device is
// refused before the weights go up: the RoPE table for 2^30 positions alone would be hundreds of
// GiB of host memory.
TEST(CudaRunnerOptions, MaxSeqLenNoDeviceHoldsIsRefusedFirst) {
  CEMLM_SKIP_WITHOUT_GPU();
  ModelConfig cfg = make_config(testing_models::all_variants()[0]);
  ParamStore store(cfg);
  cfg.max_seq_len = 1 << 30;
  auto r = make_cuda_runner(cfg, store, CudaRunnerOptions{});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("max_seq_len in the model's config.json"), std::string::npos)
      << r.status();
}

// Buffers for a --max-batch-tokens no GPU holds (2^30 rows of logits alone: 262 GB): creation
// fails with RESOURCE_EXHAUSTED naming the flag, instead of the first large step aborting; the
// device is left usable.
TEST(CudaRunnerOptions, OversizedMaxBatchTokensIsAStartupError) {
  CEMLM_SKIP_WITHOUT_GPU();
  const ModelConfig cfg = make_config(testing_models::all_variants()[0]);
  ParamStore store(cfg);
  randomize(store, 3);
  CudaRunnerOptions o;
  o.kv_cache_memory = 1 << 20;
  o.max_batch_tokens = 1 << 30;
  auto r = make_cuda_runner(cfg, store, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_NE(r.status().message().find("--max-batch-tokens"), std::string::npos) << r.status();
  o.max_batch_tokens = 64;
  r = make_cuda_runner(cfg, store, o);
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<int> ids = random_ids(8, cfg.vocab_size, 9);
  const std::vector<int32_t> table = {0};
  Batch b;
  b.seqs.push_back(BatchSeq{ids.data(), 8, 0, 1, table.data(), 1, true, false});
  std::vector<float> logits, want;
  r.value()->forward(b, &logits);
  ASSERT_EQ(logits.size(), size_t(cfg.vocab_size));
  const Weights w = bind_weights(cfg, store);
  CpuModel cpu(cfg, w);
  KvPool kv(cfg, o.block_size, 1);
  cpu.forward(b, kv, &want);
  EXPECT_LT(rel_err(logits, want), 1e-4);
}

// With kv_cache_memory 0 the cache takes 90% of what is free, which used to leave too little for
// the buffers of the first large step. They are reserved first now: a step of max_batch_tokens
// rows, every one wanting logits (a scoring chunk), runs and matches the CPU.
TEST(CudaRunnerOptions, FullBudgetStepRunsAfterAnAutomaticKvCache) {
  CEMLM_SKIP_WITHOUT_GPU();
  ModelConfig cfg = make_config(testing_models::all_variants()[5]);  // CEM, LEV, diagonal
  cfg.max_seq_len = 128;
  ParamStore store(cfg);
  randomize(store, 4);
  const Weights w = bind_weights(cfg, store);
  const int bs = 16, n_seqs = 16, len = 128, V = cfg.vocab_size;
  CudaRunnerOptions o;
  o.precision = CudaPrecision::kFp32;
  o.block_size = bs;
  o.kv_cache_memory = 0;
  o.max_batch_tokens = n_seqs * len;
  o.max_running = n_seqs;
  auto r = make_cuda_runner(cfg, store, o);
  ASSERT_TRUE(r.ok()) << r.status();
  auto gpu = std::move(r).value();
  const int per = len / bs;
  ASSERT_GE(gpu->num_blocks(), int64_t(n_seqs) * per);
  EXPECT_LE(gpu->num_blocks(), int64_t(INT32_MAX));
  std::vector<std::vector<int>> ids;
  std::vector<std::vector<int32_t>> tables;
  Batch b;
  for (int s = 0; s < n_seqs; ++s) {
    ids.push_back(random_ids(len, V, 600 + s));
    tables.emplace_back(per);
    std::iota(tables.back().begin(), tables.back().end(), s * per);
    b.seqs.push_back(
        BatchSeq{ids.back().data(), len, 0, 2, tables.back().data(), per, false, true});
  }
  CpuModel cpu(cfg, w);
  KvPool kv(cfg, bs, n_seqs * per);
  std::vector<float> want, got;
  cpu.forward(b, kv, &want);
  gpu->forward(b, &got);
  ASSERT_EQ(got.size(), size_t(n_seqs) * len * V);
  EXPECT_LT(rel_err(got, want), 1e-4);
}

}  // namespace
}  // namespace cemlm
