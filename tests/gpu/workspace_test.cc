// The CUDA runner's workspace sizing (engine/cuda/cuda_workspace.h), host-only: it runs in every
// build, CUDA or not. The reservation for the options' largest step covers every batch the
// engine can send within --max-batch-tokens / --max-running, and grows with those limits.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <random>

#include "cuda_workspace.h"
#include "tiny_models.h"

namespace cemlm {
namespace {

using testing_models::all_variants;
using testing_models::make_config;

void expect_covers(const CudaWorkspace& big, const CudaWorkspace& small, const std::string& why) {
  for (int b = 0; b < kNumBufs; ++b)
    EXPECT_LE(small.buf_bytes[size_t(b)], big.buf_bytes[size_t(b)]) << cuda_buf_name(b) << why;
  EXPECT_LE(small.stage_bytes, big.stage_bytes) << why;
}

TEST(CudaWorkspace, GrowsWithTheLimits) {
  for (const auto& v : all_variants()) {
    const ModelConfig cfg = make_config(v);
    for (CudaPrecision p : {CudaPrecision::kBf16, CudaPrecision::kFp32}) {
      CudaRunnerOptions o;
      o.max_batch_tokens = 64;
      o.max_running = 8;
      const CudaWorkspace base = cuda_workspace_bytes(cfg, p, cuda_worst_step(cfg, o));
      o.max_batch_tokens = 4096;
      const CudaWorkspace more_tokens = cuda_workspace_bytes(cfg, p, cuda_worst_step(cfg, o));
      expect_covers(more_tokens, base, " tokens " + v.name);
      EXPECT_GT(more_tokens.device_bytes(), base.device_bytes()) << v.name;
      // A scoring chunk wants every row's logits: M = N.
      EXPECT_EQ(more_tokens.buf_bytes[kLogits], sizeof(float) * 4096 * size_t(cfg.vocab_size));
      o.max_running = 64;
      const CudaWorkspace more_seqs = cuda_workspace_bytes(cfg, p, cuda_worst_step(cfg, o));
      expect_covers(more_seqs, more_tokens, " sequences " + v.name);
      EXPECT_GT(more_seqs.stage_bytes, more_tokens.stage_bytes) << v.name;  // more block tables
    }
  }
}

TEST(CudaWorkspace, WorstStepCoversEveryBatchWithinTheLimits) {
  std::mt19937 rng(5);
  for (const auto& v : all_variants()) {
    const ModelConfig cfg = make_config(v);
    for (auto [tokens, running, bs] : {std::tuple{32, 4, 16}, std::tuple{7, 32, 3},
                                       std::tuple{200, 200, 1}, std::tuple{1, 1, 64}}) {
      CudaRunnerOptions o;
      o.max_batch_tokens = tokens;
      o.max_running = running;
      o.block_size = bs;
      for (CudaPrecision p : {CudaPrecision::kBf16, CudaPrecision::kFp32}) {
        const CudaWorkspace reserved = cuda_workspace_bytes(cfg, p, cuda_worst_step(cfg, o));
        for (int trial = 0; trial < 200; ++trial) {
          // A batch as the scheduler or the scorer builds it: at most `running` sequences and
          // `tokens` tokens, each sequence within max_seq_len.
          const int n_seqs = 1 + int(rng() % uint32_t(std::min(running, tokens)));
          std::vector<std::vector<int>> ids;
          std::vector<std::vector<int32_t>> tables;
          Batch b;
          int budget = tokens;
          for (int s = 0; s < n_seqs && budget > 0; ++s) {
            const int left = budget - (n_seqs - s - 1);
            const int n = std::max(1, std::min(left, 1 + int(rng() % uint32_t(left))));
            const int n_tok = std::min(n, cfg.max_seq_len);
            const int pos = int(rng() % uint32_t(cfg.max_seq_len - n_tok + 1));
            const int n_blocks = (pos + n_tok + bs - 1) / bs;
            ids.emplace_back(size_t(n_tok), 0);
            tables.emplace_back(size_t(n_blocks), 0);
            BatchSeq q{ids.back().data(), n_tok, pos, 1, tables.back().data(), n_blocks};
            q.want_all_logits = rng() % 4 == 0;
            q.want_logits = !q.want_all_logits && rng() % 2 == 0;
            b.seqs.push_back(q);
            budget -= n_tok;
          }
          const CudaStepShape shape = cuda_step_shape(b, bs);
          ASSERT_LE(shape.rows, tokens);
          expect_covers(reserved, cuda_workspace_bytes(cfg, p, shape),
                        " " + v.name + " trial " + std::to_string(trial));
        }
      }
    }
  }
}

TEST(CudaWorkspace, StageLayoutIsAlignedAndDisjoint) {
  for (auto [n, m, t] : {std::tuple{1, 0, 1}, std::tuple{3, 3, 7}, std::tuple{517, 9, 1000}}) {
    const CudaStageLayout L = cuda_stage_layout(CudaStepShape{n, m, t});
    for (size_t off : {L.off_pos, L.off_eta, L.off_out, L.off_rows, L.off_tables})
      EXPECT_EQ(off % 16, 0u);
    EXPECT_GE(L.off_pos, 4u * size_t(n));
    EXPECT_GE(L.off_eta, L.off_pos + 4u * size_t(n));
    EXPECT_GE(L.off_out, L.off_eta + 4u * size_t(n));
    EXPECT_GE(L.off_rows, L.off_out + 4u * size_t(m));
    EXPECT_GE(L.off_tables, L.off_rows + sizeof(cuda::AttnRow) * size_t(n));
    EXPECT_EQ(L.bytes, L.off_tables + 4u * size_t(t));
  }
}

TEST(CudaWorkspace, SampleRowsStayWithinTheSamplersItemCount) {
  ModelConfig cfg = make_config(all_variants()[0]);
  CudaRunnerOptions o;
  o.max_running = 256;
  o.max_batch_tokens = 100;
  EXPECT_EQ(cuda_sample_rows(cfg, o), 100);  // never more rows than a step has
  o.max_batch_tokens = 8192;
  EXPECT_EQ(cuda_sample_rows(cfg, o), 256);
  cfg.vocab_size = 1 << 24;
  EXPECT_EQ(cuda_sample_rows(cfg, o), INT_MAX / (1 << 24));
}

}  // namespace
}  // namespace cemlm
