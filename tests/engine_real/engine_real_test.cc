// The engine over the real CPU runner on random-init checkpoints of several variants, with 4-token
// KV blocks so every request crosses block boundaries: outputs are the same alone, batched, under
// preemption and with the prefix cache; greedy logprobs and score() match full_forward; and every
// KV block is available again once the work is done.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/cpu_model.h"
#include "cemlm/engine/engine.h"
#include "packed_weights.h"
#include "ref_log_softmax.h"
#include "temp_dir.h"
#include "tiny_models.h"

namespace cemlm {
namespace {

using testing_models::Variant;

constexpr int kBlockSize = 4;
constexpr int kMaxSeqLen = 40;        // small, so a cache of a few requests' blocks is legal
constexpr int kMaxBatchTokens = 16;   // prompts are prefilled in several chunks
// Batched vs alone, preempted, prefix-cached: the same bits on AVX-512 builds, whose packed
// products and one-row attention are batch-invariant (CpuModel's batch_invariant); elsewhere
// OpenBLAS's products round differently for other row counts.
#if defined(__AVX512F__)
constexpr double kLogprobTol = 0.0;
#else
constexpr double kLogprobTol = 1e-5;
#endif
constexpr double kOracleTol = 1e-4;   // paged engine vs full_forward (other summation orders)

// A standard model, a CEM one with per-head diagonals, and both full-CEM ones (LEV, unit step).
std::vector<Variant> engine_variants() {
  std::vector<Variant> out;
  for (const Variant& v : testing_models::all_variants())
    if (v.name == "llama_tied" || v.name == "cem_perhead" || v.name == "full_cem_lev" ||
        v.name == "full_cem_unit")
      out.push_back(v);
  return out;
}

std::vector<int> random_ids(int n, int vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int> ids(size_t(n), 0);
  for (int& t : ids) t = int(rng.next_u64() % uint64_t(vocab));
  return ids;
}

GenerateRequest request(std::vector<int> prompt, int max_new, int T,
                        std::optional<uint64_t> seed = std::nullopt) {
  GenerateRequest r;
  r.prompt_ids = std::move(prompt);
  r.recursion_depth = T;
  r.sampling.max_new_tokens = max_new;
  r.sampling.temperature = seed ? 0.8f : 0.0f;
  r.sampling.top_p = seed ? 0.9f : 1.0f;
  r.sampling.seed = seed;
  return r;
}

struct Output {
  std::vector<int> ids;
  std::vector<float> logprobs;
  FinishReason reason = FinishReason::kNone;
  Usage usage;
  RequestTimings timings;
};

// Gathers each request's events (called back from the engine thread). Until hold_off() is
// released, the first event waits (bounded): requests submitted back to back then share steps
// however the threads are scheduled, instead of the first finishing before the last arrives.
class Collector {
 public:
  EventCallback callback() {
    return [this](const StreamEvent& ev) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::seconds(120), [&] { return released_; });
      Output& o = out_[ev.id];
      o.ids.insert(o.ids.end(), ev.token_ids.begin(), ev.token_ids.end());
      o.logprobs.insert(o.logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
      if (ev.finish_reason == FinishReason::kNone) return;
      o.reason = ev.finish_reason;
      o.usage = ev.usage;
      o.timings = ev.timings;
      ++finals_;
      cv_.notify_all();
    };
  }
  void release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }
  // Bounded, so a lost final event fails the test instead of hanging it.
  bool wait_finals(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(120), [&] { return finals_ >= n; });
  }
  Output get(RequestId id) {
    std::lock_guard<std::mutex> lock(mu_);
    return out_[id];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<RequestId, Output> out_;
  int finals_ = 0;
  bool released_ = false;
};

// Submits `reqs` back to back and returns their outputs in order.
std::vector<Output> run_all(Engine& e, const std::vector<GenerateRequest>& reqs) {
  Collector c;
  std::vector<RequestId> ids;
  for (const GenerateRequest& r : reqs) {
    auto id = e.submit(r, c.callback());
    EXPECT_TRUE(id.ok()) << id.status();
    if (id.ok()) ids.push_back(*id);
  }
  c.release();
  EXPECT_TRUE(c.wait_finals(int(ids.size())));
  std::vector<Output> out;
  for (RequestId id : ids) out.push_back(c.get(id));
  return out;
}

void expect_same(const Output& got, const Output& want, const std::string& what,
                 double tol = kLogprobTol) {
  EXPECT_EQ(got.ids, want.ids) << what;
  EXPECT_EQ(got.reason, want.reason) << what;
  ASSERT_EQ(got.logprobs.size(), want.logprobs.size()) << what;
  for (size_t i = 0; i < got.logprobs.size(); ++i)
    EXPECT_NEAR(got.logprobs[i], want.logprobs[i], tol) << what << " token " << i;
}

// Stats are published after each engine step, so the last step's release shows up shortly after
// the final event; poll (bounded) instead of reading once.
void expect_all_blocks_available(const Engine& e) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  EngineStats s = e.stats();
  while (s.kv_blocks_free != s.kv_blocks_total && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    s = e.stats();
  }
  EXPECT_EQ(s.kv_blocks_free, s.kv_blocks_total);
  EXPECT_GT(s.kv_blocks_total, 0);
  EXPECT_EQ(s.running, 0);
  EXPECT_EQ(s.waiting, 0);
  EXPECT_EQ(s.kv_cache_usage, 0.0);
}

// Mixed prompt lengths, T and sampling modes (seeded where sampled).
std::vector<GenerateRequest> mixed_requests(int vocab) {
  const int lens[] = {3, 9, 14, 5, 11, 7}, depths[] = {1, 2, 4, 1, 3, 2},
            max_new[] = {10, 7, 12, 9, 6, 11};
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 6; ++i)
    reqs.push_back(request(random_ids(lens[i], vocab, 100 + uint64_t(i)), max_new[i], depths[i],
                           i % 2 ? std::optional<uint64_t>(40 + i) : std::nullopt));
  return reqs;
}

class EngineRealTest : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    cfg_ = testing_models::make_config(GetParam());
    cfg_.max_seq_len = kMaxSeqLen;
    store_ = ParamStore(cfg_);
    testing_models::randomize(store_, 11);
    w_ = bind_weights(cfg_, store_);
    dir_ = testing_temp::fresh_dir("engine_real");
    const absl::Status st = save_checkpoint(dir_, cfg_, store_);
    ASSERT_TRUE(st.ok()) << st;
  }

  // An fp32 cache of n_blocks; a bf16 or int8 cache gets the same bytes, so more blocks.
  std::unique_ptr<Engine> engine(int64_t n_blocks = 256, bool prefix_caching = true,
                                 const std::string& kv_dtype = "fp32",
                                 const std::string& device = "cpu") {
    return engine_of_bytes(n_blocks * block_size_ * cfg_.kv_bytes_per_token(), prefix_caching,
                           kv_dtype, device);
  }
  // A cache of n_blocks of its own dtype.
  std::unique_ptr<Engine> engine_of_blocks(int64_t n_blocks, const std::string& kv_dtype) {
    return engine_of_bytes(
        n_blocks * block_size_ * cfg_.kv_bytes_per_token(*parse_kv_dtype(kv_dtype)), true, kv_dtype,
        "cpu");
  }
  std::unique_ptr<Engine> engine_of_bytes(int64_t bytes, bool prefix_caching,
                                          const std::string& kv_dtype, const std::string& device) {
    EngineOptions o;
    o.model_dir = dir_;
    o.device = device;
    o.block_size = block_size_;
    o.kv_cache_memory = bytes;
    o.kv_cache_dtype = kv_dtype;
    o.max_batch_tokens = kMaxBatchTokens;
    o.prefix_caching = prefix_caching;
    o.threads = 1;  // tiny models gain nothing from more, and ctest -j must not oversubscribe
    auto e = Engine::create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return nullptr;
    const KvDtype dtype = parse_kv_dtype(kv_dtype).value_or(KvDtype::kFp32);
    EXPECT_EQ(e.value()->stats().kv_blocks_total,
              o.kv_cache_memory / (block_size_ * cfg_.kv_bytes_per_token(dtype)));
    return std::move(e).value();
  }

  // log p(ids[i] | ids[<i]) for i ≥ 1 from the full-sequence forward ([0] unused), with the
  // checkpoint's weights or others of the same model.
  std::vector<double> oracle_logprobs(const std::vector<int>& ids, int T) const {
    return oracle_logprobs(ids, T, w_);
  }
  std::vector<double> oracle_logprobs(const std::vector<int>& ids, int T, const Weights& w) const {
    const std::vector<float> logits = full_forward(cfg_, w, ids, T);
    const size_t V = size_t(cfg_.vocab_size);
    std::vector<double> lp(ids.size(), 0.0);
    for (size_t i = 1; i < ids.size(); ++i) {
      const std::span<const float> row = std::span<const float>(logits).subspan((i - 1) * V, V);
      lp[i] = testing_ref::log_softmax(row, ids[i]);
    }
    return lp;
  }

  // A greedy request of n_new tokens at depth T after a 7-token prompt drawn from `seed`: its
  // logprobs match the full-sequence forward with weights `w` and each token is that forward's
  // argmax. Returns the largest gap between its logprobs and the checkpoint weights' oracle.
  double expect_greedy_matches(Engine& e, int T, uint64_t seed, int n_new, const Weights& w) {
    const std::vector<int> prompt = random_ids(7, cfg_.vocab_size, seed);
    const Output o = run_all(e, {request(prompt, n_new, T)})[0];
    EXPECT_EQ(o.ids.size(), size_t(n_new)) << "T=" << T;
    std::vector<int> seq = prompt;
    seq.insert(seq.end(), o.ids.begin(), o.ids.end());
    const std::vector<float> logits = full_forward(cfg_, w, seq, T);
    const auto lp = oracle_logprobs(seq, T, w), lp_checkpoint = oracle_logprobs(seq, T);
    const size_t V = size_t(cfg_.vocab_size);
    double off_checkpoint = 0;
    for (size_t i = 0; i < o.ids.size() && i < o.logprobs.size(); ++i) {
      const size_t pos = prompt.size() + i;  // the generated token's position in seq
      EXPECT_NEAR(o.logprobs[i], lp[pos], kOracleTol) << "T=" << T << " token " << i;
      off_checkpoint = std::max(off_checkpoint, std::fabs(o.logprobs[i] - lp_checkpoint[pos]));
      const float* row = logits.data() + (pos - 1) * V;
      EXPECT_GE(row[o.ids[i]], *std::max_element(row, row + V) - kOracleTol)
          << "T=" << T << " token " << i << " is not the argmax";
    }
    return off_checkpoint;
  }

  ModelConfig cfg_;
  ParamStore store_;
  Weights w_;
  std::string dir_;
  // The engines' block size: kBlockSize (a token-major CPU cache, read by the portable passes), or
  // 16 (tiled, read by the AVX-512 passes where built) where a test runs both.
  int block_size_ = kBlockSize;
};

TEST_P(EngineRealTest, OutputsAreTheSameAloneAndBatched) {
  const auto reqs = mixed_requests(cfg_.vocab_size);
  auto batched = engine();
  ASSERT_NE(batched, nullptr);
  const auto together = run_all(*batched, reqs);
  // Every request was still running when the last one was scheduled: they shared steps.
  Clock::time_point last_scheduled = together[0].timings.scheduled;
  for (const Output& o : together) last_scheduled = std::max(last_scheduled, o.timings.scheduled);
  for (const Output& o : together) EXPECT_TRUE(o.timings.finished > last_scheduled);
  for (size_t i = 0; i < reqs.size(); ++i) {
    auto alone = engine();
    ASSERT_NE(alone, nullptr);
    const Output want = run_all(*alone, {reqs[i]})[0];
    EXPECT_EQ(int(want.ids.size()), reqs[i].sampling.max_new_tokens);
    expect_same(together[i], want, "request " + std::to_string(i));
    expect_all_blocks_available(*alone);
  }
  expect_all_blocks_available(*batched);
}

// A sampled request over a long context (its batch-1 decode rows would split their context over
// the two threads, its prompt chunks take other sizes when batched) gives the same tokens and
// logprobs alone and among requests of other lengths and T: a seeded draw near a bucket edge
// must not flip because a logit moved in its last bit. Its d_ff leaves a tail past the last full
// vector of the element-wise ops, whose position moves with the batch's row count.
TEST_P(EngineRealTest, LongSampledRequestIsTheSameAloneAndBatched) {
  ModelConfig cfg = cfg_;
  cfg.max_seq_len = 700;
  cfg.d_ff = 36;  // not a multiple of the vector width: element-wise tails see every row count
  ParamStore store(cfg);
  testing_models::randomize(store, 12);
  const std::string dir = dir_ + "/long";
  ASSERT_TRUE(save_checkpoint(dir, cfg, store).ok());
  auto make = [&] {
    EngineOptions o;
    o.model_dir = dir;
    o.max_batch_tokens = 48;  // the 600-token prompt takes chunks of other sizes when batched
    o.threads = 2;
    auto e = Engine::create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(e).value() : nullptr;
  };
  GenerateRequest main = request(random_ids(600, cfg.vocab_size, 5), 24, 2, 77);
  main.sampling.temperature = 1.0f;
  main.sampling.top_p = 1.0f;
  std::vector<GenerateRequest> batch = {main, request(random_ids(37, cfg.vocab_size, 6), 30, 4, 8),
                                        request(random_ids(250, cfg.vocab_size, 7), 20, 1)};
  auto alone_engine = make(), batched_engine = make();
  ASSERT_TRUE(alone_engine && batched_engine);
  const Output alone = run_all(*alone_engine, {main})[0];
  const std::vector<Output> together = run_all(*batched_engine, batch);
  ASSERT_EQ(alone.ids.size(), 24u);
  expect_same(together[0], alone, "long sampled request");
}

// For each cache dtype: requests preempted on a tiny cache (recomputed from their tokens) end with
// the outputs of a cache roomy enough for all.
TEST_P(EngineRealTest, PreemptionKeepsOutputsIdentical) {
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 6; ++i)
    reqs.push_back(request(random_ids(8 + i, cfg_.vocab_size, 200 + uint64_t(i)), 12, 1 + i % 3,
                           i % 2 ? std::optional<uint64_t>(7 + i) : std::nullopt));
  for (auto [dtype, bs] : {std::pair{"fp32", kBlockSize}, std::pair{"bf16", kBlockSize},
                           std::pair{"int8", kBlockSize}, std::pair{"int8", 16}}) {
    SCOPED_TRACE(std::string(dtype) + " block size " + std::to_string(bs));
    block_size_ = bs;
    auto roomy = engine(256, true, dtype);
    ASSERT_NE(roomy, nullptr);
    const auto want = run_all(*roomy, reqs);
    // The runner's minimum is one max_seq_len sequence (10 blocks of 4, 3 of 16); the largest
    // request needs 7 of 4 or 2 of 16, so a second one running beside it must wait or preempt.
    auto tiny = engine_of_blocks(kMaxSeqLen / bs + 1, dtype);
    ASSERT_NE(tiny, nullptr);
    const auto got = run_all(*tiny, reqs);
    EXPECT_GT(tiny->stats().preemptions_total, 0);
    EXPECT_EQ(roomy->stats().preemptions_total, 0);
    for (size_t i = 0; i < reqs.size(); ++i)
      expect_same(got[i], want[i], "request " + std::to_string(i));
    expect_all_blocks_available(*tiny);
    expect_all_blocks_available(*roomy);
  }
}

TEST_P(EngineRealTest, ScoringDuringGenerationOnATinyCacheChangesNothing) {
  const auto reqs = mixed_requests(cfg_.vocab_size);
  auto roomy = engine();
  ASSERT_NE(roomy, nullptr);
  const auto want = run_all(*roomy, reqs);
  auto tiny = engine(kMaxSeqLen / kBlockSize + 1);
  ASSERT_NE(tiny, nullptr);
  Collector c;
  std::vector<RequestId> ids;
  for (const GenerateRequest& r : reqs) {
    auto id = tiny->submit(r, c.callback());
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  c.release();
  // Scoring needs most of the cache, so it preempts whatever runs.
  const std::vector<int> text = random_ids(kMaxSeqLen, cfg_.vocab_size, 5);
  for (int T : {1, 2}) {
    auto scored = tiny->score({text, T});
    ASSERT_TRUE(scored.ok()) << scored.status();
    const auto lp = oracle_logprobs(text, T);
    for (size_t i = 1; i < text.size(); ++i)
      EXPECT_NEAR(scored->logprobs[i], lp[i], kOracleTol) << "T=" << T << " position " << i;
  }
  ASSERT_TRUE(c.wait_finals(int(ids.size())));
  for (size_t i = 0; i < reqs.size(); ++i)
    expect_same(c.get(ids[i]), want[i], "request " + std::to_string(i));
  expect_all_blocks_available(*tiny);
}

// For each cache dtype: prompts sharing full blocks reuse them (not across T) with the outputs of
// an engine without prefix caching.
TEST_P(EngineRealTest, PrefixCacheServesSharedPromptsWithIdenticalOutput) {
  const std::vector<int> prompt = random_ids(20, cfg_.vocab_size, 300);
  std::vector<int> shared(prompt.begin(), prompt.begin() + 18);
  for (int t : random_ids(3, cfg_.vocab_size, 301)) shared.push_back(t);
  const GenerateRequest first = request(prompt, 8, 2);
  const GenerateRequest same = request(prompt, 8, 2);
  const GenerateRequest sharing = request(shared, 8, 2, 99);
  const GenerateRequest other_t = request(shared, 8, 1, 99);

  for (auto [dtype, bs] : {std::pair{"fp32", kBlockSize}, std::pair{"bf16", kBlockSize},
                           std::pair{"int8", kBlockSize}, std::pair{"int8", 16}}) {
    SCOPED_TRACE(std::string(dtype) + " block size " + std::to_string(bs));
    block_size_ = bs;
    auto cold = engine(256, /*prefix_caching=*/false, dtype);
    ASSERT_NE(cold, nullptr);
    const auto want = run_all(*cold, {first, sharing, other_t});
    EXPECT_EQ(cold->stats().prefix_cache_hits_total, 0);

    auto warm = engine(256, true, dtype);
    ASSERT_NE(warm, nullptr);
    const Output a = run_all(*warm, {first})[0];
    EXPECT_EQ(a.usage.cached_prompt_tokens, 0);
    const Output b = run_all(*warm, {sharing})[0];
    // The 18 shared tokens hold 4 full blocks of 4, or one of 16.
    EXPECT_EQ(b.usage.cached_prompt_tokens, 18 / bs * bs);
    const Output a2 = run_all(*warm, {same})[0];
    EXPECT_GT(a2.usage.cached_prompt_tokens, 0);
    EXPECT_LT(a2.usage.cached_prompt_tokens, int(prompt.size()));
    const Output c = run_all(*warm, {other_t})[0];
    EXPECT_EQ(c.usage.cached_prompt_tokens, 0) << "cached blocks must not serve another T";
    EXPECT_EQ(warm->stats().prefix_cache_hits_total,
              b.usage.cached_prompt_tokens + a2.usage.cached_prompt_tokens);

    expect_same(a, want[0], "first");
    expect_same(b, want[1], "sharing a prefix");
    expect_same(a2, want[0], "repeated prompt");
    expect_same(c, want[2], "other T");
    expect_all_blocks_available(*warm);
    expect_all_blocks_available(*cold);
  }
}

TEST_P(EngineRealTest, GreedyLogprobsMatchTheFullForward) {
  auto e = engine();
  ASSERT_NE(e, nullptr);
  for (int T : {1, 2, 4}) expect_greedy_matches(*e, T, 400 + uint64_t(T), 14, w_);
  expect_all_blocks_available(*e);
}

TEST_P(EngineRealTest, ScoreMatchesFullForwardNll) {
  auto e = engine();
  ASSERT_NE(e, nullptr);
  const std::vector<int> ids = random_ids(kMaxSeqLen - 3, cfg_.vocab_size, 500);
  for (int T : {1, 2, 4}) {
    auto got = e->score({ids, T});
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->recursion_depth, T);
    EXPECT_TRUE(std::isnan(got->logprobs[0]));
    const auto lp = oracle_logprobs(ids, T);
    double sum = 0;
    for (size_t i = 1; i < ids.size(); ++i) {
      EXPECT_NEAR(got->logprobs[i], lp[i], kOracleTol) << "T=" << T << " position " << i;
      sum += lp[i];
    }
    const double nll = -sum / double(ids.size() - 1);
    EXPECT_NEAR(got->nll, nll, kOracleTol) << "T=" << T;
    EXPECT_NEAR(got->perplexity, std::exp(nll), kOracleTol * std::exp(nll)) << "T=" << T;
  }
  expect_all_blocks_available(*e);
}

// A bf16 or int8 cache (--kv-cache-dtype bf16 / int8): half the bytes per token, or a quarter
// plus the scales, so more blocks for the same budget; a request's tokens and logprobs are the
// same alone and batched (AVX-512 builds: the entries are rounded from batch-invariant fp32 values,
// whatever the prefill chunks; elsewhere within 1e-3, as other row counts' products can tip a
// key's rounding); and the keys' rounding moves the logprobs only slightly
// off the fp32 oracle (tolerance 3e-2 for bf16, 5e-2 for int8; tiny models measured at most
// 4e-3 / 1.2e-2), but moves them.
TEST_P(EngineRealTest, LowPrecisionCacheHoldsMoreTokensAndStaysClose) {
  const auto reqs = mixed_requests(cfg_.vocab_size);
  for (auto [name, tol, bs] :
       {std::tuple{"bf16", 3e-2, kBlockSize}, std::tuple{"int8", 5e-2, kBlockSize},
        std::tuple{"bf16", 3e-2, 16}, std::tuple{"int8", 5e-2, 16}}) {
    SCOPED_TRACE(std::string(name) + " block size " + std::to_string(bs));
    block_size_ = bs;
    auto batched = engine(256, true, name);
    ASSERT_NE(batched, nullptr);
    if (std::string(name) == "bf16") {
      EXPECT_EQ(batched->info().kv_bytes_per_token, cfg_.kv_bytes_per_token() / 2);
    } else {  // a byte per number, and four per head of a key or value row or per context row
      const int64_t rows = cfg_.attention == AttentionType::kStandard ? 2 : 1;
      const bool contexts = cfg_.attention == AttentionType::kCem && cfg_.diag != DiagMode::kNone;
      EXPECT_EQ(batched->info().kv_bytes_per_token,
                cfg_.kv_bytes_per_token() / 4 +
                    4 * cfg_.n_layers * (rows * cfg_.n_heads + (contexts ? 1 : 0)));
    }
    const auto together = run_all(*batched, reqs);
    for (size_t i = 0; i < reqs.size(); ++i) {
      auto alone = engine(256, true, name);
      ASSERT_NE(alone, nullptr);
      expect_same(together[i], run_all(*alone, {reqs[i]})[0], "request " + std::to_string(i),
                  kLogprobTol > 0 ? 1e-3 : 0.0);
    }
    const std::vector<int> ids = random_ids(kMaxSeqLen - 3, cfg_.vocab_size, 501);
    double worst = 0;
    for (int T : {1, 2}) {
      auto got = batched->score({ids, T});
      ASSERT_TRUE(got.ok()) << got.status();
      const auto lp = oracle_logprobs(ids, T);
      for (size_t i = 1; i < ids.size(); ++i)
        worst = std::max(worst, std::fabs(got->logprobs[i] - lp[i]));
    }
    EXPECT_LT(worst, tol);
    EXPECT_GT(worst, 0.0) << "the cache's rounding changed nothing: is it used?";
    expect_all_blocks_available(*batched);
  }
}

// Weights of `store` (a copy of the checkpoint's) with every product weight replaced by what a
// runner with `dtype` weights computes with (tests/common/packed_weights.h); the head gets a copy
// of its own (`head`), since a tied head aliases the embedding table, which stays fp32.
Weights low_precision_weights(const ModelConfig& c, ParamStore& store, WeightDtype dtype,
                              std::vector<float>* head) {
  Weights w = bind_weights(c, store);
  auto round = [&](const Tensor& t) {
    testing_weights::round_like_packed(dtype, t.data, t.dim(0), t.dim(1));
  };
  for (LayerWeights& lw : w.layers)
    for (Tensor* t : {&lw.wq, &lw.wk, &lw.wv, &lw.wo, &lw.w_gate, &lw.w_up, &lw.w_down})
      if (!t->empty()) round(*t);
  head->assign(w.lm_head.data, w.lm_head.data + w.lm_head.numel());
  w.lm_head = Tensor(head->data(), {w.lm_head.dim(0), w.lm_head.dim(1)});
  round(w.lm_head);
  return w;
}

// --device cpu:bf16 and cpu:int8 (product weights in bf16, or int8 with block scales; fp32
// arithmetic) compute the model whose product weights are the checkpoint's rounded that way:
// greedy logprobs, the argmax and score() match full_forward on those weights at the fp32
// oracle's tolerance, for T ∈ {1, 2, 4}; requests give the same bits alone and batched; and the
// logprobs do move off the unrounded model's (the test would notice the weights not being used).
TEST_P(EngineRealTest, LowPrecisionWeightsComputeTheModelWithRoundedWeights) {
  if (!packed_weights_available()) GTEST_SKIP() << "bf16 and int8 weights need an AVX-512 build";
  for (auto [device, dtype] : {std::pair{"cpu:bf16", WeightDtype::kBf16},
                               std::pair{"cpu:int8", WeightDtype::kInt8}}) {
    SCOPED_TRACE(device);
    ParamStore rounded_store(cfg_);
    std::copy(store_.flat().begin(), store_.flat().end(), rounded_store.flat().begin());
    std::vector<float> head;
    const Weights rounded = low_precision_weights(cfg_, rounded_store, dtype, &head);
    auto e = engine(256, true, "fp32", device);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->info().device, device);
    double off_unrounded = 0;
    for (int T : {1, 2, 4}) {
      off_unrounded =
          std::max(off_unrounded, expect_greedy_matches(*e, T, 600 + uint64_t(T), 12, rounded));
      const std::vector<int> ids = random_ids(kMaxSeqLen - 3, cfg_.vocab_size, 610 + uint64_t(T));
      auto got = e->score({ids, T});
      ASSERT_TRUE(got.ok()) << got.status();
      const auto slp = oracle_logprobs(ids, T, rounded);
      for (size_t i = 1; i < ids.size(); ++i)
        EXPECT_NEAR(got->logprobs[i], slp[i], kOracleTol) << "score T=" << T << " position " << i;
    }
    EXPECT_GT(off_unrounded, 10 * kOracleTol) << "the weights changed nothing: are they used?";

    const auto reqs = mixed_requests(cfg_.vocab_size);
    const auto together = run_all(*e, reqs);
    for (size_t i = 0; i < reqs.size(); ++i) {
      auto alone = engine(256, true, "fp32", device);
      ASSERT_NE(alone, nullptr);
      expect_same(together[i], run_all(*alone, {reqs[i]})[0], "request " + std::to_string(i));
    }
    expect_all_blocks_available(*e);
  }
}

// --device cpu:bf16dot and cpu:int8dot (the weights of cpu:bf16 / cpu:int8, and the products'
// inputs rounded to bf16 / quantized to int8 too, summed with dot-product instructions): score()
// and greedy logprobs stay within 3e-2 (bf16) / 1e-1 (int8) of the fp32 oracle on the rounded
// weights, for T ∈ {1, 2, 4}, and move off it by more than the oracle's tolerance, which cpu:bf16
// and cpu:int8 keep (the inputs are rounded); a request's tokens and logprobs are the same alone
// and batched (the rounded inputs are, being those of batch-invariant fp32 values).
TEST_P(EngineRealTest, DotDevicesStayCloseToTheirWeightsModel) {
  struct Case {
    const char* device;
    WeightDtype dtype;
    bool available;
    double tol;
  };
  for (const Case& c : {Case{"cpu:bf16dot", WeightDtype::kBf16Dot, bf16_dot_available(), 3e-2},
                        Case{"cpu:int8dot", WeightDtype::kInt8Dot, int8_dot_available(), 1e-1}}) {
    SCOPED_TRACE(c.device);
    if (!c.available) continue;  // refused instead: UnknownKvCacheDtypeOrDeviceIsRefused
    ParamStore rounded_store(cfg_);
    std::copy(store_.flat().begin(), store_.flat().end(), rounded_store.flat().begin());
    std::vector<float> head;
    const Weights rounded = low_precision_weights(cfg_, rounded_store, c.dtype, &head);
    auto e = engine(256, true, "fp32", c.device);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->info().device, c.device);
    double worst = 0;
    for (int T : {1, 2, 4}) {
      const std::vector<int> ids = random_ids(kMaxSeqLen - 3, cfg_.vocab_size, 620 + uint64_t(T));
      auto got = e->score({ids, T});
      ASSERT_TRUE(got.ok()) << got.status();
      const auto lp = oracle_logprobs(ids, T, rounded);
      for (size_t i = 1; i < ids.size(); ++i)
        worst = std::max(worst, std::fabs(got->logprobs[i] - lp[i]));
      const std::vector<int> prompt = random_ids(7, cfg_.vocab_size, 630 + uint64_t(T));
      const Output o = run_all(*e, {request(prompt, 12, T)})[0];
      ASSERT_EQ(o.ids.size(), 12u) << "T=" << T;
      std::vector<int> seq = prompt;
      seq.insert(seq.end(), o.ids.begin(), o.ids.end());
      const auto glp = oracle_logprobs(seq, T, rounded);
      for (size_t i = 0; i < o.ids.size(); ++i)
        worst = std::max(worst, std::fabs(o.logprobs[i] - glp[prompt.size() + i]));
    }
    EXPECT_LT(worst, c.tol);
    EXPECT_GT(worst, 10 * kOracleTol) << "the inputs were not rounded?";
    const auto reqs = mixed_requests(cfg_.vocab_size);
    const auto together = run_all(*e, reqs);
    for (size_t i = 0; i < reqs.size(); ++i) {
      auto alone = engine(256, true, "fp32", c.device);
      ASSERT_NE(alone, nullptr);
      expect_same(together[i], run_all(*alone, {reqs[i]})[0], "request " + std::to_string(i));
    }
    expect_all_blocks_available(*e);
  }
}

// The step thread (which runs the request callbacks) takes step_thread_nice on top of the
// process's niceness; out-of-range values are refused.
TEST_P(EngineRealTest, StepThreadRunsAtTheAddedNiceness) {
  EngineOptions o;
  o.model_dir = dir_;
  o.threads = 1;
  const int base = getpriority(PRIO_PROCESS, id_t(syscall(SYS_gettid)));
  if (base > 12) GTEST_SKIP() << "the test process already runs at niceness " << base;
  o.step_thread_nice = 7;
  auto e = Engine::create(o);
  ASSERT_TRUE(e.ok()) << e.status();
  std::mutex mu;
  std::condition_variable cv;
  int seen = -100;
  auto id = (*e)->submit(request(random_ids(4, cfg_.vocab_size, 9), 2, 1, std::nullopt),
                         [&](const StreamEvent& ev) {
                           if (ev.finish_reason == FinishReason::kNone) return;
                           std::lock_guard lock(mu);
                           seen = getpriority(PRIO_PROCESS, id_t(syscall(SYS_gettid)));
                           cv.notify_all();
                         });
  ASSERT_TRUE(id.ok()) << id.status();
  std::unique_lock lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return seen != -100; }));
  EXPECT_EQ(seen, base + 7);
  for (int bad : {-1, 20}) {
    o.step_thread_nice = bad;
    auto refused = Engine::create(o);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("step_thread_nice = " + std::to_string(bad)),
              std::string::npos)
        << refused.status();
  }
}

int thread_count() {
  int n = 0;
  for ([[maybe_unused]] const auto& task : std::filesystem::directory_iterator("/proc/self/task"))
    ++n;
  return n;
}

// Every forward and OpenMP region of an engine runs on its step thread, the model's loading and
// scoring included, so the threads that call it never get an OpenMP team of their own and no
// thread outlives the engine. (libgomp stops spinning at its barriers once it manages more threads
// than cores: a team left on the caller's thread made batch-1 decode 5–8× slower.) Checked in a
// fresh process, whose main thread has started no OpenMP team.
TEST_P(EngineRealTest, NoThreadOutlivesTheEngine) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        const int before = thread_count();
        int rc = 0;
        {
          EngineOptions o;
          o.model_dir = dir_;
          o.block_size = kBlockSize;
          o.max_batch_tokens = kMaxBatchTokens;
          o.threads = 2;  // a team, whatever the machine
          auto e = Engine::create(o);
          if (!e.ok()) rc = 2;
          if (rc == 0 && !(*e)->score({random_ids(12, cfg_.vocab_size, 3), 2}).ok()) rc = 3;
          if (rc == 0 &&
              run_all(**e, {request(random_ids(5, cfg_.vocab_size, 4), 4, 2)})[0].reason !=
                  FinishReason::kLength)
            rc = 4;
        }
        // The engine joins its thread as it goes; that thread's OpenMP workers end right after.
        for (int i = 0; i < 2000 && rc == 0 && thread_count() > before; ++i)
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        if (rc == 0 && thread_count() != before) rc = 1;
        // A threadsafe death test's child re-runs SetUp (a directory of its own) and ends here.
        std::filesystem::remove_all(dir_);
        std::_Exit(rc);
      },
      ::testing::ExitedWithCode(0), "");
}

// A KV budget far beyond the machine's memory is an error status naming the flag, not a crash
// (the model loads on the engine thread, where an escaping exception would end the process).
TEST_P(EngineRealTest, KvBudgetBeyondMemoryIsRefusedNotACrash) {
  EngineOptions o;
  o.model_dir = dir_;
  o.block_size = kBlockSize;
  o.kv_cache_memory = int64_t(1) << 52;  // 4 PiB
  auto e = Engine::create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kResourceExhausted) << e.status();
  EXPECT_NE(e.status().message().find("--kv-cache-memory"), std::string::npos) << e.status();
}

// An unknown device or KV-cache dtype is refused naming the flag and the choices; so is a device
// this build cannot run.
TEST_P(EngineRealTest, UnknownKvCacheDtypeOrDeviceIsRefused) {
  std::vector<std::tuple<const char*, const char*, const char*>> cases = {
      {"cpu", "fp16", "--kv-cache-dtype \"fp16\" is not one of fp32, bf16, int8"},
      {"cpu:fp16", "fp32",
       "--device \"cpu:fp16\" is not one of cpu, cpu:fp32, cpu:bf16, cpu:bf16dot, cpu:int8, "
       "cpu:int8dot, cuda, cuda:bf16, cuda:fp32"}};
  if (!packed_weights_available())
    cases.emplace_back("cpu:int8", "fp32", "--device cpu:int8: this build has no AVX-512 kernels");
  if (packed_weights_available() && !bf16_dot_available())
    cases.emplace_back("cpu:bf16dot", "fp32",
                       "--device cpu:bf16dot: this CPU has no AVX512-BF16 dot products");
  if (packed_weights_available() && !int8_dot_available())
    cases.emplace_back("cpu:int8dot", "fp32",
                       "--device cpu:int8dot: this CPU has no AVX512-VNNI dot products");
  for (auto [device, dtype, message] : cases) {
    EngineOptions o;
    o.model_dir = dir_;
    o.device = device;
    o.kv_cache_dtype = dtype;
    auto e = Engine::create(o);
    ASSERT_FALSE(e.ok());
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(e.status().message().find(message), std::string::npos) << e.status();
  }
}

// Finite LEV weights whose product over seed_dim overflows give a non-finite embedding: the engine
// refuses the checkpoint at start-up, naming the token and the tensors, where it served and failed
// every request on "non-finite logits".
TEST(EngineRealLoad, AnEmbeddingTableThatOverflowsIsRefusedAtStart) {
  const std::vector<Variant> variants = testing_models::all_variants();
  const Variant lev = *std::find_if(variants.begin(), variants.end(),
                                    [](const Variant& v) { return v.name == "full_cem_lev"; });
  ModelConfig cfg = testing_models::make_config(lev);
  cfg.lev.seed_dim = 160;  // 2^160 is past the float range
  ParamStore store(cfg);
  testing_models::randomize(store, 3);
  const ParamSpec* spline = store.find("lev.spline");
  std::fill_n(store.flat().data() + spline->offset, spline->numel(), 2.0f);
  const std::string dir = testing_temp::fresh_dir("engine_real") + "/overflow";
  ASSERT_TRUE(save_checkpoint(dir, cfg, store).ok());
  EngineOptions o;
  o.model_dir = dir;
  o.threads = 1;
  auto e = Engine::create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << e.status();
  EXPECT_NE(e.status().message().find("the LEV embedding of token 0 is not finite"),
            std::string::npos)
      << e.status();
  EXPECT_NE(e.status().message().find("lev.spline"), std::string::npos) << e.status();
}

INSTANTIATE_TEST_SUITE_P(Variants, EngineRealTest, ::testing::ValuesIn(engine_variants()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace cemlm
