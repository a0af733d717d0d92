// The engine over a fake runner: accounting under random submit/cancel/deadline/score sequences,
// preemption and prefix caching leave outputs unchanged, the bounded queue, cancellation and
// deadlines, stop strings across token boundaries, scoring, and request validation by field.
#include "cemlm/engine/engine.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <tuple>

#include "cemlm/engine/model_runner.h"
#include "cemlm/engine/tokenizer.h"
#include "fake_runner.h"
#include "temp_dir.h"
#include "tokenizer_util.h"

namespace cemlm {
namespace {

using testing_fake::FakeOptions;
using testing_fake::FakeRunner;
using testing_tokens::encode_ok;

struct Result {
  std::vector<int> ids;
  std::vector<float> logprobs;
  std::vector<std::vector<TopLogprob>> top;
  std::string text;
  FinishReason reason = FinishReason::kNone;
  absl::Status error;
  Usage usage;
  RequestTimings timings, first_token_timings;  // of the final event; of the first token's
  int finals = 0;
  bool event_after_final = false;
};

// Collects every request's events (the engine calls back from its own thread).
class Collector {
 public:
  EventCallback callback() {
    return [this](const StreamEvent& ev) {
      std::lock_guard<std::mutex> lock(mu_);
      Result& r = results_[ev.id];
      if (r.finals) r.event_after_final = true;
      if (r.ids.empty() && !ev.token_ids.empty()) r.first_token_timings = ev.timings;
      r.ids.insert(r.ids.end(), ev.token_ids.begin(), ev.token_ids.end());
      r.logprobs.insert(r.logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
      r.top.insert(r.top.end(), ev.top_logprobs.begin(), ev.top_logprobs.end());
      r.text += ev.text;
      if (ev.finish_reason == FinishReason::kNone) return;
      ++r.finals;
      ++finals_;
      r.reason = ev.finish_reason;
      r.error = ev.error;
      r.usage = ev.usage;
      r.timings = ev.timings;
      cv_.notify_all();
    };
  }
  // Waits for `n` final events in all (bounded, so a lost event fails instead of hanging).
  bool wait_finals(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(60), [&] { return finals_ >= n; });
  }
  Result get(RequestId id) {
    std::lock_guard<std::mutex> lock(mu_);
    return results_[id];
  }
  std::map<RequestId, Result> all() {
    std::lock_guard<std::mutex> lock(mu_);
    return results_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<RequestId, Result> results_;
  int finals_ = 0;
};

struct Built {
  std::unique_ptr<Engine> engine;
  FakeRunner* runner;  // owned by the engine
};

Built build(FakeOptions fo, EngineOptions eo = {}, std::unique_ptr<Tokenizer> tok = nullptr) {
  auto runner = std::make_unique<FakeRunner>(std::move(fo));
  FakeRunner* raw = runner.get();
  auto e = Engine::create(eo, std::move(runner), std::move(tok));
  EXPECT_TRUE(e.ok()) << e.status();
  return {std::move(*e), raw};
}

GenerateRequest request(std::vector<int> prompt, int max_new, int T = 1,
                        std::optional<uint64_t> seed = std::nullopt) {
  GenerateRequest r;
  r.prompt_ids = std::move(prompt);
  r.recursion_depth = T;
  r.sampling.max_new_tokens = max_new;
  if (seed) {
    r.sampling.seed = seed;
    r.sampling.temperature = 0.9f;
    r.sampling.top_p = 0.95f;
  } else {
    r.sampling.temperature = 0;
  }
  return r;
}

std::vector<int> tokens(int n, int first, int vocab = 64) {
  std::vector<int> t;
  for (int i = 0; i < n; ++i) t.push_back((first + 7 * i) % vocab);
  return t;
}

// Runs `reqs` submitted together and returns their results in order; `submitted` runs once all
// are in.
std::vector<Result> run_all(Engine& e, const std::vector<GenerateRequest>& reqs,
                            const std::function<void()>& submitted = {}) {
  Collector c;
  std::vector<RequestId> ids;
  for (const auto& r : reqs) {
    auto id = e.submit(r, c.callback());
    EXPECT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  if (submitted) submitted();
  EXPECT_TRUE(c.wait_finals(int(ids.size())));
  std::vector<Result> out;
  for (RequestId id : ids) out.push_back(c.get(id));
  return out;
}

void expect_same_outputs(const std::vector<Result>& a, const std::vector<Result>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].ids, b[i].ids) << "request " << i;
    EXPECT_EQ(a[i].logprobs, b[i].logprobs) << "request " << i;
    EXPECT_EQ(a[i].reason, b[i].reason) << "request " << i;
  }
}

// A mix of lengths, T and sampling modes, seeded where sampled.
std::vector<GenerateRequest> mixed_requests() {
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 8; ++i) {
    const int T = 1 + i % 3;
    reqs.push_back(request(tokens(3 + 5 * i % 17, i), 6 + 3 * i % 11, T,
                           i % 2 ? std::optional<uint64_t>(100 + i) : std::nullopt));
  }
  reqs[3].sampling.top_k = 5;
  reqs[5].sampling.repetition_penalty = 1.3f;
  reqs[5].sampling.frequency_penalty = 0.5f;
  reqs[6].sampling.min_p = 0.1f;
  return reqs;
}

// Blocks every forward() until opened, and counts the calls that reached it.
struct Gate {
  void enter() {
    std::unique_lock<std::mutex> lock(mu);
    ++entered;
    cv.notify_all();
    cv.wait(lock, [&] { return open; });
  }
  void wait_entered(int n) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return entered >= n; });
  }
  void release() {
    std::lock_guard<std::mutex> lock(mu);
    open = true;
    cv.notify_all();
  }
  std::mutex mu;
  std::condition_variable cv;
  int entered = 0;
  bool open = false;
};

// By a request's final event, the stats no longer count it: its client may scrape the gauges
// right after its stream's last message (they showed it running, its blocks in use, until the
// next step published).
TEST(Engine, StatsAtTheFinalEventNoLongerCountTheRequest) {
  Built b = build(FakeOptions{});
  Engine* e = b.engine.get();
  std::mutex mu;
  std::condition_variable cv;
  std::optional<EngineStats> at_final;
  auto id = e->submit(request(tokens(20, 1), 4), [&](const StreamEvent& ev) {
    if (ev.finish_reason == FinishReason::kNone) return;
    const EngineStats st = e->stats();  // from the engine's thread, as a scrape could be
    std::lock_guard<std::mutex> lock(mu);
    at_final = st;
    cv.notify_all();
  });
  ASSERT_TRUE(id.ok()) << id.status();
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return at_final.has_value(); }));
  EXPECT_EQ(at_final->running, 0);
  EXPECT_EQ(at_final->kv_blocks_free, at_final->kv_blocks_total);
}

TEST(QueueSeconds, ScheduledRequestsWaitedUntilScheduledTheOthersUntilTheyEnded) {
  RequestTimings t;
  t.submitted = Clock::now();
  t.finished = t.submitted + std::chrono::milliseconds(900);
  // Cancelled, past its deadline or drained while still queued: it waited its whole life.
  EXPECT_NEAR(queue_seconds(t), 0.9, 1e-9);
  t.scheduled = t.submitted + std::chrono::milliseconds(250);
  EXPECT_NEAR(queue_seconds(t), 0.25, 1e-9);
  EXPECT_EQ(queue_seconds(RequestTimings{}), 0.0);           // no times at all
  EXPECT_EQ(seconds_between(t.finished, t.submitted), 0.0);  // backwards
}

// ---- outputs are independent of batching, preemption and the prefix cache ----

TEST(Engine, OutputsAreTheSameAloneAndBatched) {
  const auto reqs = mixed_requests();
  // The first step waits at the gate until every request is in, so the later steps batch them
  // (without it the loop could finish the first request before the next was submitted).
  Gate gate;
  Built batched = build({.favorite = [&](int) { gate.enter(); return -1; }});
  const auto together = run_all(*batched.engine, reqs, [&] { gate.release(); });
  EXPECT_GT(batched.runner->max_rows(), 1);
  std::vector<Result> alone;
  for (const auto& r : reqs) {
    Built b = build({});
    alone.push_back(run_all(*b.engine, {r})[0]);
  }
  expect_same_outputs(together, alone);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(int(together[i].ids.size()), reqs[i].sampling.max_new_tokens);
    EXPECT_EQ(together[i].reason, FinishReason::kLength);
  }
}

TEST(Engine, PreemptionWithATinyCacheKeepsOutputsIdentical) {
  const auto reqs = mixed_requests();
  Built big = build({.num_blocks = 512});
  const auto reference = run_all(*big.engine, reqs);
  for (bool caching : {false, true}) {
    // 12 blocks of 4: the longest request alone needs 10. The first step waits at the gate until
    // every request is in: submitted one by one on a loaded machine, each could end before the
    // next came, with nothing preempted.
    EngineOptions eo;
    eo.max_batch_tokens = 7;
    eo.prefix_caching = caching;
    Gate gate;
    Built tiny = build({.num_blocks = 12,
                        .favorite =
                            [&](int) {
                              gate.enter();
                              return -1;
                            }},
                       eo);
    const auto constrained = run_all(*tiny.engine, reqs, [&] { gate.release(); });
    expect_same_outputs(reference, constrained);
    // No two prompts share a first block: a preempted request readmitted onto its own cached
    // blocks reports no cached prompt tokens (they were computed for it).
    for (size_t i = 0; i < constrained.size(); ++i) {
      EXPECT_EQ(constrained[i].usage.cached_prompt_tokens, 0) << "request " << i;
      // Every request's timings are set and in order, however often it was readmitted.
      const RequestTimings& t = constrained[i].timings;
      EXPECT_LE(t.submitted, t.scheduled) << "request " << i;
      EXPECT_LE(t.scheduled, t.first_token) << "request " << i;
      EXPECT_LE(t.first_token, t.finished) << "request " << i;
    }
    tiny.engine->shutdown(false);
    const EngineStats st = tiny.engine->stats();
    EXPECT_GT(st.preemptions_total, 0) << "the cache was meant to be too small";
    EXPECT_EQ(st.kv_blocks_free, st.kv_blocks_total);
  }
}

// Two low-priority requests fill max_running; a high-priority one submitted while they decode
// preempts the newer of them, finishes first, and every output equals an unconstrained run's.
TEST(Engine, HigherPriorityRequestPreemptsLowerOnesThatStillFinishTheSame) {
  std::vector<GenerateRequest> reqs = {request(tokens(5, 1), 24), request(tokens(6, 2), 24, 2, 7),
                                       request(tokens(4, 3), 3, 1, 9)};
  reqs[2].priority = 5;
  Built ref = build({.num_blocks = 512});
  const auto reference = run_all(*ref.engine, reqs);

  // The first forward waits until the second request is in (so it runs from step 2); the first
  // logits at position 7 (step 4: both decoding) wait until the third is in.
  Gate first, decoding;
  EngineOptions eo;
  eo.max_running = 2;
  std::atomic<bool> started{false}, reached{false};
  Built b = build({.favorite = [&](int pos) {
                    if (!started.exchange(true)) first.enter();
                    if (pos >= 7 && !reached.exchange(true)) decoding.enter();
                    return -1;
                  }},
                  eo);
  Collector c;
  std::mutex mu;
  std::vector<RequestId> finished;
  auto on_event = [&, inner = c.callback()](const StreamEvent& ev) {
    if (ev.finish_reason != FinishReason::kNone) {
      std::lock_guard<std::mutex> lock(mu);
      finished.push_back(ev.id);
    }
    inner(ev);
  };
  std::vector<RequestId> ids;
  ids.push_back(*b.engine->submit(reqs[0], on_event));
  first.wait_entered(1);
  ids.push_back(*b.engine->submit(reqs[1], on_event));
  first.release();
  decoding.wait_entered(1);
  ids.push_back(*b.engine->submit(reqs[2], on_event));
  decoding.release();
  ASSERT_TRUE(c.wait_finals(3));
  std::vector<Result> got;
  for (RequestId id : ids) got.push_back(c.get(id));
  expect_same_outputs(reference, got);
  b.engine->shutdown(false);
  EXPECT_EQ(b.engine->stats().preemptions_total, 1);
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(finished.size(), 3u);
  EXPECT_EQ(finished[0], ids[2]);
}

TEST(Engine, PrefixCacheHitsGiveIdenticalOutputsAndAnotherTNeverHits) {
  const auto prompt = tokens(22, 3);
  Built cached = build({});
  const Result first = run_all(*cached.engine, {request(prompt, 5, 2)})[0];
  EXPECT_EQ(first.usage.cached_prompt_tokens, 0);
  const int64_t before = cached.runner->tokens_processed();
  const Result again = run_all(*cached.engine, {request(prompt, 5, 2)})[0];
  EXPECT_EQ(again.usage.cached_prompt_tokens, 20);  // 5 full blocks of 4; the last token is recomputed
  EXPECT_EQ(cached.runner->tokens_processed() - before, 22 - 20 + 4);
  EXPECT_EQ(again.ids, first.ids);
  EXPECT_EQ(again.logprobs, first.logprobs);
  EXPECT_GE(cached.engine->stats().prefix_cache_hits_total, 20);

  const Result other_t = run_all(*cached.engine, {request(prompt, 5, 3)})[0];
  EXPECT_EQ(other_t.usage.cached_prompt_tokens, 0);
  EngineOptions no_cache;
  no_cache.prefix_caching = false;
  Built plain = build({}, no_cache);
  EXPECT_EQ(run_all(*plain.engine, {request(prompt, 5, 3)})[0].ids, other_t.ids);
  EXPECT_EQ(run_all(*plain.engine, {request(prompt, 5, 2)})[0].ids, first.ids);
}

// Requests reuse the cached blocks of their own scope and salt only; the outputs stay the same.
TEST(Engine, PrefixCacheHitsOnlyWithinAScopeAndSalt) {
  const auto prompt = tokens(22, 3);
  Built b = build({});
  auto req = [&](std::string scope, std::string salt) {
    GenerateRequest r = request(prompt, 5, 2);
    r.cache_scope = std::move(scope);
    r.cache_salt = std::move(salt);
    return r;
  };
  const Result first = run_all(*b.engine, {req("key0", "")})[0];
  EXPECT_EQ(first.usage.cached_prompt_tokens, 0);
  for (const auto& [scope, salt, cached] : std::vector<std::tuple<std::string, std::string, int>>{
           {"key1", "", 0},    // another key
           {"", "", 0},        // no key
           {"", "key0", 0},    // a salt that spells the key is not its scope
           {"key0", "s", 0},   // the key with a salt
           {"key0", "", 20},   // the key again
           {"key0", "s", 20},  // and its salted request again
       }) {
    const Result r = run_all(*b.engine, {req(scope, salt)})[0];
    EXPECT_EQ(r.usage.cached_prompt_tokens, cached) << "scope " << scope << " salt " << salt;
    EXPECT_EQ(r.ids, first.ids);
  }
  GenerateRequest too_long = req("", std::string(kMaxCacheSaltBytes + 1, 'x'));
  const absl::Status st = b.engine->validate(too_long);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("cache_salt has 257 bytes"), std::string::npos) << st;
  EXPECT_TRUE(b.engine->validate(req("", std::string(kMaxCacheSaltBytes, 'x'))).ok());
  EXPECT_EQ(b.engine->validate(req(std::string("a\0b", 3), "")).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Engine, SeededSamplingIsReproducibleAndSeedsDiffer) {
  Built e = build({});
  auto r = request(tokens(5, 1), 20, 1, 7);
  const auto a = run_all(*e.engine, {r, r});
  EXPECT_EQ(a[0].ids, a[1].ids);
  r.sampling.seed = 8;
  EXPECT_NE(run_all(*e.engine, {r})[0].ids, a[0].ids);
}

// ---- accounting ----

TEST(Engine, RandomSubmitCancelDeadlineScoreSequencesLoseNothing) {
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    EngineOptions eo;
    eo.max_batch_tokens = uni(1, 24);
    eo.max_running = uni(1, 6);
    eo.max_waiting = uni(1, 12);
    eo.prefix_caching = uni(0, 1);
    // At least 40 blocks: every request (≤ 36 tokens) fits alone even with 1-token blocks.
    Built b = build({.block_size = uni(1, 5), .num_blocks = uni(40, 80), .max_seq_len = 64}, eo);
    Engine& e = *b.engine;
    Collector c;
    std::vector<RequestId> accepted;
    int rejected = 0;
    const int actions = uni(10, 40);
    for (int a = 0; a < actions; ++a) {
      const int what = uni(0, 9);
      if (what < 6) {
        auto r = request(tokens(uni(1, 16), uni(0, 63)), uni(1, 20), uni(0, 4),
                         uni(0, 1) ? std::optional<uint64_t>(uni(0, 1000)) : std::nullopt);
        r.priority = uni(-1, 1);
        if (uni(0, 4) == 0) r.sampling.stop_token_ids = {uni(0, 63)};
        if (uni(0, 5) == 0) r.deadline = Clock::now() + std::chrono::microseconds(uni(0, 3000));
        auto id = e.submit(r, c.callback());
        if (id.ok()) {
          accepted.push_back(*id);
        } else {
          EXPECT_EQ(id.status().code(), absl::StatusCode::kResourceExhausted) << id.status();
          ++rejected;
        }
      } else if (what < 8 && !accepted.empty()) {
        e.cancel(accepted[size_t(uni(0, int(accepted.size()) - 1))]);
        e.cancel(999999);  // unknown ids are ignored
      } else if (what == 8) {
        auto s = e.score({tokens(uni(2, 30), uni(0, 63)), uni(0, 4)});
        EXPECT_TRUE(s.ok()) << s.status();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(uni(0, 500)));
      }
    }
    const bool cancel_rest = uni(0, 2) == 0;
    if (!cancel_rest) {
      ASSERT_TRUE(c.wait_finals(int(accepted.size())));
    }
    e.shutdown(cancel_rest);
    ASSERT_TRUE(c.wait_finals(int(accepted.size())));
    const auto results = c.all();
    EXPECT_EQ(results.size(), accepted.size());  // no events for unknown ids
    for (RequestId id : accepted) {
      const Result& r = results.at(id);
      EXPECT_EQ(r.finals, 1) << "request " << id;
      EXPECT_FALSE(r.event_after_final) << "request " << id;
      EXPECT_EQ(r.usage.generated_tokens, int(r.ids.size()));
      EXPECT_EQ(r.ids.size(), r.logprobs.size());
      // The only error: displaced from a full queue by a request of higher priority.
      if (r.reason == FinishReason::kError) {
        EXPECT_EQ(r.error.code(), absl::StatusCode::kResourceExhausted) << r.error;
        EXPECT_NE(r.error.message().find("displaced"), std::string::npos) << r.error;
      }
    }
    const EngineStats st = e.stats();
    EXPECT_EQ(st.running, 0);
    EXPECT_EQ(st.waiting, 0);
    EXPECT_EQ(st.kv_blocks_free, st.kv_blocks_total);
    EXPECT_EQ(st.kv_cache_usage, 0.0);
    EXPECT_EQ(e.submit(request({1}, 1), c.callback()).status().code(),
              absl::StatusCode::kUnavailable);
  }
}

// The hit counter is the cached share of prompt_tokens_total, which the server counts at each
// request's first token: a request cancelled during its prefill adds to neither (counted at its
// admission, it read as a hit of a prompt never counted, up to a hit rate over 100%).
TEST(Engine, PrefixHitsCountOnlyForRequestsThatReachTheirFirstToken) {
  // Steps wait at the gate one at a time (each step samples for `other`) while `held`.
  std::mutex mu;
  std::condition_variable cv;
  bool held = false;
  int entered = 0, allowed = 0;
  EngineOptions eo;
  eo.max_batch_tokens = 4;  // the long prompt's prefill takes several steps
  Built b = build({.favorite =
                       [&](int) {
                         std::unique_lock<std::mutex> lock(mu);
                         if (!held) return -1;
                         ++entered;
                         cv.notify_all();
                         cv.wait(lock, [&] { return !held || entered <= allowed; });
                         return -1;
                       }},
                  eo);
  const auto shared = tokens(13, 5);
  ASSERT_EQ(run_all(*b.engine, {request(shared, 1)})[0].reason, FinishReason::kLength);
  auto wait_entered = [&](int n) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return entered >= n; });
  };
  {
    std::lock_guard<std::mutex> lock(mu);
    held = true;
    allowed = 0;
  }
  Collector c;
  auto other = b.engine->submit(request({60, 61}, 50), c.callback());
  ASSERT_TRUE(other.ok());
  wait_entered(1);  // the step of other's prefill
  std::vector<int> long_prompt = shared;
  for (int i = 0; i < 20; ++i) long_prompt.push_back(40 + i % 7);
  auto cut = b.engine->submit(request(long_prompt, 1), c.callback());
  ASSERT_TRUE(cut.ok());
  {
    std::lock_guard<std::mutex> lock(mu);
    allowed = 1;
    cv.notify_all();
  }
  wait_entered(2);  // this step admitted `cut` (12 prompt tokens cached) and runs its first chunk
  b.engine->cancel(*cut);
  {
    std::lock_guard<std::mutex> lock(mu);
    held = false;
    cv.notify_all();
  }
  b.engine->cancel(*other);
  ASSERT_TRUE(c.wait_finals(2));
  const Result r = c.get(*cut);
  EXPECT_EQ(r.reason, FinishReason::kCancelled);
  EXPECT_EQ(r.usage.generated_tokens, 0);
  EXPECT_EQ(r.usage.cached_prompt_tokens, 12);  // it was admitted on the cache's blocks
  b.engine->shutdown(false);
  EXPECT_EQ(b.engine->stats().prefix_cache_hits_total, 0);
}

// Random mixes of priorities, T, seeded sampling and shared prefixes on a cache barely larger than
// the longest request, with scoring calls (that preempt lower priorities) coming in between: every
// request ends as it does alone on a large cache, cached prompt tokens included, and every block
// is free at the end.
TEST(Engine, RandomMixesOnATinyCacheGiveTheOutputsOfAnUnconstrainedRun) {
  int64_t preemptions = 0, hits = 0;
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const std::vector<int> shared = tokens(uni(4, 12), uni(0, 63));
    std::vector<GenerateRequest> reqs;
    for (int i = uni(3, 8); i > 0; --i) {
      std::vector<int> prompt(shared.begin(), shared.begin() + uni(0, int(shared.size())));
      for (int k = uni(prompt.empty() ? 1 : 0, 5); k > 0; --k) prompt.push_back(uni(0, 63));
      auto r = request(prompt, uni(1, 12), uni(1, 3),
                       uni(0, 1) ? std::optional<uint64_t>(uni(1, 1000)) : std::nullopt);
      r.priority = uni(0, 2);
      reqs.push_back(r);
    }
    // The longest request (at most 29 tokens) alone fits: 8 blocks of 4 and a few more.
    EngineOptions eo;
    eo.max_batch_tokens = uni(1, 8);
    eo.max_running = uni(1, 4);
    Gate gate;
    Built tiny = build({.num_blocks = uni(8, 12),
                        .favorite =
                            [&](int) {
                              gate.enter();
                              return -1;
                            }},
                       eo);
    std::vector<Result> got;
    std::thread scorer;
    got = run_all(*tiny.engine, reqs, [&] {
      scorer = std::thread([&] {
        for (int i = 0; i < 3; ++i) {
          ScoreRequest sr{tokens(9, i), 1};
          sr.priority = i;
          // Preempted or not (the calls are ranked among the requests), the unconstrained result.
          const auto s = tiny.engine->score(sr);
          ASSERT_TRUE(s.ok()) << s.status();
          Built big = build({.num_blocks = 512});
          const auto alone = big.engine->score(sr);
          ASSERT_TRUE(alone.ok()) << alone.status();
          EXPECT_EQ(s->nll, alone->nll) << "score " << i;
          for (size_t k = 1; k < sr.ids.size(); ++k)
            EXPECT_EQ(s->logprobs[k], alone->logprobs[k]) << "score " << i << " id " << k;
        }
      });
      gate.release();
    });
    scorer.join();
    int64_t cached = 0;  // of the prompts that were counted (every request reached a token)
    for (size_t i = 0; i < reqs.size(); ++i) {
      ASSERT_GT(got[i].usage.generated_tokens, 0) << "request " << i;
      cached += got[i].usage.cached_prompt_tokens;
      Built big = build({.num_blocks = 512});
      const Result alone = run_all(*big.engine, {reqs[i]})[0];
      EXPECT_EQ(got[i].ids, alone.ids) << "request " << i;
      EXPECT_EQ(got[i].logprobs, alone.logprobs) << "request " << i;
      EXPECT_EQ(got[i].reason, alone.reason) << "request " << i;
      EXPECT_LE(got[i].usage.cached_prompt_tokens, int(reqs[i].prompt_ids.size()) - 1);
    }
    tiny.engine->shutdown(false);
    const EngineStats st = tiny.engine->stats();
    EXPECT_EQ(st.kv_blocks_free, st.kv_blocks_total);
    EXPECT_EQ(st.running + st.waiting, 0);
    // Once per request: a preempted request readmitted on its own blocks adds nothing.
    EXPECT_EQ(st.prefix_cache_hits_total, cached);
    preemptions += st.preemptions_total;
    hits += st.prefix_cache_hits_total;
  }
  EXPECT_GT(preemptions, 0) << "the caches were meant to be too small";
  EXPECT_GT(hits, 0) << "the prompts were meant to share prefixes";
}

// A full queue refuses a request, naming the limit, unless its priority is higher than a queued
// one's: then the lowest-ranked queued request (lowest priority, newest) is displaced, ending
// RESOURCE_EXHAUSTED.
TEST(Engine, FullQueueIsResourceExhaustedSaveForAHigherPriority) {
  Gate gate;
  EngineOptions eo;
  eo.max_running = 1;
  eo.max_waiting = 2;
  Built b = build({.favorite = [&](int) { gate.enter(); return -1; }}, eo);
  Collector c;
  ASSERT_TRUE(b.engine->submit(request({1, 2}, 3), c.callback()).ok());
  gate.wait_entered(1);  // the first request is running, inside forward()
  const RequestId older = *b.engine->submit(request({1, 2}, 3), c.callback());
  const RequestId newer = *b.engine->submit(request({1, 2}, 3), c.callback());
  const auto st = b.engine->submit(request({1, 2}, 3), c.callback());
  EXPECT_EQ(st.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.status().message().find("--max-waiting = 2"), std::string::npos) << st.status();
  GenerateRequest urgent = request({1, 2}, 3);
  urgent.priority = 5;
  const auto taken = b.engine->submit(urgent, c.callback());
  ASSERT_TRUE(taken.ok()) << taken.status();
  gate.release();
  ASSERT_TRUE(c.wait_finals(4));
  const Result displaced = c.get(newer);
  EXPECT_EQ(displaced.reason, FinishReason::kError);
  EXPECT_EQ(displaced.error.code(), absl::StatusCode::kResourceExhausted) << displaced.error;
  EXPECT_NE(displaced.error.message().find("--max-waiting = 2"), std::string::npos)
      << displaced.error;
  EXPECT_TRUE(displaced.ids.empty());
  for (RequestId id : {older, *taken}) EXPECT_EQ(c.get(id).reason, FinishReason::kLength) << id;
  b.engine->shutdown(false);  // the stats of the step that sent the last final are published
  EXPECT_EQ(b.engine->stats().kv_blocks_free, b.engine->stats().kv_blocks_total);
}

// A request taken into the full queue over its bound and cancelled (or past its deadline) before
// the engine's next step displaces nobody: the queued request it would have displaced runs.
TEST(Engine, AnArrivalOverTheBoundEndedAtOnceDisplacesNobody) {
  for (const bool cancel : {true, false}) {
    Gate gate;
    EngineOptions eo;
    eo.max_running = 1;
    eo.max_waiting = 1;
    Built b = build({.favorite =
                         [&](int) {
                           gate.enter();
                           return -1;
                         }},
                    eo);
    Collector c;
    ASSERT_TRUE(b.engine->submit(request({1, 2}, 3), c.callback()).ok());
    gate.wait_entered(1);  // the first request is running, inside forward()
    const RequestId queued = *b.engine->submit(request({1, 2}, 3), c.callback());
    GenerateRequest urgent = request({1, 2}, 3);
    urgent.priority = 5;
    if (!cancel) urgent.deadline = Clock::now();  // past by the next step
    const auto taken = b.engine->submit(urgent, c.callback());
    ASSERT_TRUE(taken.ok()) << taken.status();
    if (cancel) b.engine->cancel(*taken);
    gate.release();
    ASSERT_TRUE(c.wait_finals(3));
    EXPECT_EQ(c.get(*taken).reason, cancel ? FinishReason::kCancelled : FinishReason::kDeadline);
    const Result kept = c.get(queued);
    EXPECT_EQ(kept.reason, FinishReason::kLength) << kept.error;
    b.engine->shutdown(false);
  }
}

// Scoring calls share steps with running generation as chunked prefill does: one chunk
// (max_batch_tokens) per step, not every waiting call's chunk before each step; with no
// generation running they go at once. The slow generation steps (a sleep) only give the three
// calls time to queue chunks side by side; the order checked does not depend on timing.
TEST(Engine, ScoringChunksGoOnePerStepWhileGenerationRuns) {
  EngineOptions eo;
  eo.max_batch_tokens = 4;
  std::atomic<bool> slow{true};
  Built b = build({.favorite = [&](int pos) {
                     if (pos >= 20 && slow) std::this_thread::sleep_for(std::chrono::milliseconds(2));
                     return -1;
                   }},
                  eo);
  Collector c;
  ASSERT_TRUE(b.engine->submit(request(tokens(20, 1), 60), c.callback()).ok());
  std::vector<std::thread> scorers;
  for (int i = 0; i < 3; ++i)
    scorers.emplace_back([&, i] {
      const auto r = b.engine->score({tokens(16, 2 + i), 1});  // 4 chunks, positions < 16
      EXPECT_TRUE(r.ok()) << r.status();
    });
  for (std::thread& t : scorers) t.join();
  slow = false;
  ASSERT_TRUE(c.wait_finals(1));
  b.engine->shutdown(false);
  const std::string& f = b.runner->forwards();
  EXPECT_EQ(std::count(f.begin(), f.end(), 'S'), 12) << f;
  const size_t first = f.find('G'), last = f.rfind('G');
  ASSERT_NE(first, std::string::npos);
  EXPECT_EQ(f.substr(first, last - first).find("SS"), std::string::npos) << f;
  // Every chunk, of every call, went into the engine's one logits buffer (reduced to logprobs
  // there): a call holding its own [chunk, V] until it returned made concurrent calls cost that
  // much each.
  EXPECT_EQ(b.runner->logits_buffers(), 1u);
  // Alone, a call's chunks follow each other.
  Built idle = build({}, eo);
  ASSERT_TRUE(idle.engine->score({tokens(16, 2), 1}).ok());
  idle.engine->shutdown(false);
  EXPECT_EQ(idle.runner->forwards(), "SSSS");
}

// While generation runs, one scoring chunk shares each step, the highest priority's first. The
// engine is held inside a step while both calls ask for room, so that neither is alone in the
// queue; the priority-1 call (2 chunks) then finishes first unless its thread is starved for the
// ~60 steps of the priority-0 call's chunks.
TEST(Engine, ScoringChunksOfAHigherPriorityGoFirst) {
  std::atomic<bool> hold{false};
  EngineOptions eo;
  eo.max_batch_tokens = 4;
  Built b = build({.favorite = [&hold](int) {
                    while (hold) std::this_thread::sleep_for(std::chrono::milliseconds(1));
                    std::this_thread::sleep_for(std::chrono::milliseconds(1));
                    return -1;
                  }},
                  eo);
  Collector c;
  const auto gen = b.engine->submit(request(tokens(4, 1), 200), c.callback());
  ASSERT_TRUE(gen.ok());
  while (c.get(*gen).ids.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  hold = true;
  std::atomic<int> done{0}, started{0};
  int low_done = 0, high_done = 0;
  auto low = std::async(std::launch::async, [&] {
    ScoreRequest s{tokens(240, 2), 1};  // 60 chunks
    ++started;
    EXPECT_TRUE(b.engine->score(s).ok());
    low_done = ++done;
  });
  auto high = std::async(std::launch::async, [&] {
    ScoreRequest s{tokens(8, 3), 1};  // 2 chunks
    s.priority = 1;
    ++started;
    EXPECT_TRUE(b.engine->score(s).ok());
    high_done = ++done;
  });
  while (started < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // both reach the engine's queue
  hold = false;
  low.get();
  high.get();
  EXPECT_EQ(high_done, 1);
  EXPECT_EQ(low_done, 2);
  b.engine->cancel(*gen);
  ASSERT_TRUE(c.wait_finals(1));
}

// Scoring calls of one priority take turns, a chunk each, oldest chunk first: a short call that
// arrives while a long one runs is done within a few steps, not after all the long one's chunks
// (newest first, the long call's next chunk, queued as its last ended, would always go first).
TEST(Engine, ScoringCallsOfOnePriorityTakeTurns) {
  EngineOptions eo;
  eo.max_batch_tokens = 4;
  Built b = build({.favorite =
                       [](int) {
                         std::this_thread::sleep_for(std::chrono::milliseconds(1));
                         return -1;
                       }},
                  eo);
  Collector c;
  // A generation keeps running, so that each step takes one scoring chunk.
  const auto gen = b.engine->submit(request(tokens(4, 1), 200), c.callback());
  ASSERT_TRUE(gen.ok());
  while (c.get(*gen).ids.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::atomic<int> done{0};
  int long_done = 0, short_done = 0;
  auto long_call = std::async(std::launch::async, [&] {
    EXPECT_TRUE(b.engine->score({tokens(240, 2), 1}).ok());  // 60 chunks, ≥ 4 ms each
    long_done = ++done;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));  // a few of its chunks have run
  auto short_call = std::async(std::launch::async, [&] {
    EXPECT_TRUE(b.engine->score({tokens(8, 3), 1}).ok());  // 2 chunks
    short_done = ++done;
  });
  long_call.get();
  short_call.get();
  EXPECT_EQ(short_done, 1);
  EXPECT_EQ(long_done, 2);
  b.engine->cancel(*gen);
  ASSERT_TRUE(c.wait_finals(1));
}

TEST(Engine, CancelEndsARequestWithinAStepAndFreesItsBlocks) {
  Built b = build({});
  Collector c;
  Engine* e = b.engine.get();
  // Cancels itself from its first token event.
  auto inner = c.callback();
  auto id = e->submit(request(tokens(9, 2), 200, 2), [&, inner](const StreamEvent& ev) {
    inner(ev);
    if (ev.finish_reason == FinishReason::kNone) e->cancel(ev.id);
  });
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(c.wait_finals(1));
  const Result r = c.get(*id);
  EXPECT_EQ(r.reason, FinishReason::kCancelled);
  EXPECT_EQ(r.ids.size(), 1u);  // the cancel lands before the next step
  b.engine->cancel(*id);        // idempotent
  b.engine->shutdown(false);
  EXPECT_EQ(b.engine->stats().kv_blocks_free, b.engine->stats().kv_blocks_total);
}

TEST(Engine, DeadlinesEndRequestsWaitingOrRunning) {
  Built b = build({.favorite = [](int) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return -1;
  }});
  Collector c;
  auto expired = request({1, 2, 3}, 5);
  expired.deadline = Clock::now() - std::chrono::milliseconds(1);
  auto running = request({1, 2, 3}, 200);  // ≥ 200 ms of steps: the deadline comes first
  running.deadline = Clock::now() + std::chrono::milliseconds(30);
  const RequestId a = *b.engine->submit(expired, c.callback());
  const RequestId r = *b.engine->submit(running, c.callback());
  ASSERT_TRUE(c.wait_finals(2));
  EXPECT_EQ(c.get(a).reason, FinishReason::kDeadline);
  EXPECT_EQ(c.get(r).reason, FinishReason::kDeadline);
  EXPECT_LT(c.get(r).ids.size(), 200u);
}

TEST(Engine, ShutdownCancelsEverythingAndRefusesNewWork) {
  Gate gate;
  EngineOptions eo;
  eo.max_waiting = 4;
  Built b = build({.favorite = [&](int) { gate.enter(); return -1; }}, eo);
  Collector c;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(b.engine->submit(request({1, 2}, 50), c.callback()).ok());
  gate.wait_entered(1);
  std::thread stopper([&] { b.engine->shutdown(true); });
  // shutdown() waits for the loop, which waits for the gate; submits race with it until refused
  // (the queue may fill first: that refusal is temporary).
  int accepted = 3;
  for (;;) {
    const auto id = b.engine->submit(request({1}, 50), c.callback());
    if (id.ok()) {
      ++accepted;
      continue;
    }
    if (id.status().code() == absl::StatusCode::kUnavailable) break;
    EXPECT_EQ(id.status().code(), absl::StatusCode::kResourceExhausted) << id.status();
    std::this_thread::yield();
  }
  gate.release();
  stopper.join();
  ASSERT_TRUE(c.wait_finals(accepted));
  const auto all = c.all();
  EXPECT_EQ(int(all.size()), accepted);
  for (const auto& [rid, r] : all) {
    EXPECT_EQ(r.finals, 1);
    EXPECT_EQ(r.reason, FinishReason::kCancelled);
  }
  EXPECT_EQ(b.engine->score({{1, 2, 3}, 0}).status().code(), absl::StatusCode::kUnavailable);
}

// ---- finishing ----

TEST(Engine, EosAndStopTokenIdsEndWithStop) {
  // The script: token 10 everywhere except eos (9) from the logits at position 6, i.e. as the
  // token at position 7, the 5th generated after the 3-token prompt.
  const int eos = 9;
  Built b = build({.eos_id = eos, .favorite = [](int p) { return p == 6 ? 9 : 10; }});
  auto r = request({1, 2, 3}, 20);
  Result res = run_all(*b.engine, {r})[0];
  EXPECT_EQ(res.reason, FinishReason::kStop);
  ASSERT_EQ(res.ids.size(), 5u);
  EXPECT_EQ(res.ids.back(), eos);
  r.sampling.ignore_eos = true;
  res = run_all(*b.engine, {r})[0];
  EXPECT_EQ(res.reason, FinishReason::kLength);
  EXPECT_EQ(res.ids.size(), 20u);
  r.sampling.stop_token_ids = {eos};
  EXPECT_EQ(run_all(*b.engine, {r})[0].ids.size(), 5u);
  // The very first token can be the stop token.
  Built first = build({.eos_id = eos, .favorite = [](int p) { return p == 2 ? 9 : 10; }});
  res = run_all(*first.engine, {request({1, 2, 3}, 20)})[0];
  EXPECT_EQ(res.reason, FinishReason::kStop);
  EXPECT_EQ(res.ids, std::vector<int>{eos});
}

// Non-finite logits end that request with INTERNAL (its blocks freed); the others go on.
TEST(Engine, NonFiniteLogitsEndTheRequestWithAnError) {
  Built b = build({.nan_at = [](int p) { return p == 5; }});
  // A (3 prompt tokens) samples from position 5 at its 4th token; B's prompt covers position 5
  // in its prefill chunk, whose logits come from its last position only.
  const auto res = run_all(*b.engine, {request({1, 2, 3}, 10), request(tokens(10, 4), 6)});
  EXPECT_EQ(res[0].reason, FinishReason::kError);
  EXPECT_EQ(res[0].error.code(), absl::StatusCode::kInternal) << res[0].error;
  EXPECT_EQ(res[0].ids.size(), 3u);
  EXPECT_EQ(res[0].finals, 1);
  EXPECT_EQ(res[1].reason, FinishReason::kLength);
  EXPECT_EQ(res[1].ids.size(), 6u);
  b.engine->shutdown(false);
  EXPECT_EQ(b.engine->stats().kv_blocks_free, b.engine->stats().kv_blocks_total);
}

// A forward that throws (a batch's logits out of memory) ends that batch's requests with
// RESOURCE_EXHAUSTED and frees their blocks; a scoring call it hits returns the error with its
// blocks freed too; the engine goes on serving. (The step thread died with the exception, and a
// scoring call's blocks stayed taken for good.)
TEST(Engine, AForwardThatThrowsEndsItsBatchNotTheEngine) {
  Built b = build({.throw_at = [](int p) { return p == 40; }});
  const auto res = run_all(*b.engine, {request({1, 2, 3}, 60), request(tokens(10, 4), 6)});
  EXPECT_EQ(res[0].reason, FinishReason::kError);
  EXPECT_EQ(res[0].error.code(), absl::StatusCode::kResourceExhausted) << res[0].error;
  EXPECT_NE(res[0].error.message().find("out of memory"), std::string::npos) << res[0].error;
  EXPECT_EQ(res[0].ids.size(), 38u);  // the token fed at position 40 was the 38th generated
  EXPECT_EQ(res[0].finals, 1);
  EXPECT_EQ(res[1].reason, FinishReason::kLength);
  const auto scored = b.engine->score({tokens(50, 2), 1});
  EXPECT_EQ(scored.status().code(), absl::StatusCode::kResourceExhausted) << scored.status();
  EXPECT_EQ(b.engine->stats().kv_blocks_free, b.engine->stats().kv_blocks_total);
  // Still serving: a request that stays below position 40, and a scoring call that does.
  EXPECT_EQ(run_all(*b.engine, {request({7, 8, 9}, 5)})[0].reason, FinishReason::kLength);
  EXPECT_TRUE(b.engine->score({tokens(30, 2), 1}).ok());
  b.engine->shutdown(false);
  EXPECT_EQ(b.engine->stats().kv_blocks_free, b.engine->stats().kv_blocks_total);
}

// A scoring call is counted in stats().scoring while it holds its blocks (its chunks running),
// in neither running nor waiting, and not once it has returned: under Score-only load the
// running and waiting counts read an idle server.
TEST(Engine, ScoringCallsHoldingBlocksAreCounted) {
  std::promise<void> entered, release;
  std::shared_future<void> go = release.get_future().share();
  std::atomic<int> hits{0};
  Built b = build({.favorite = [&](int p) {
    if (p == 5 && hits.fetch_add(1) == 0) {
      entered.set_value();
      go.wait();
    }
    return -1;
  }});
  EXPECT_EQ(b.engine->stats().scoring, 0);
  auto scored = std::async(std::launch::async, [&] { return b.engine->score({tokens(9, 2), 1}); });
  const bool inside =
      entered.get_future().wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  if (!inside) release.set_value();
  ASSERT_TRUE(inside) << "the scoring call never reached position 5";
  const EngineStats during = b.engine->stats();
  release.set_value();
  EXPECT_EQ(during.scoring, 1);
  EXPECT_EQ(during.running, 0);
  EXPECT_EQ(during.waiting, 0);
  ASSERT_TRUE(scored.get().ok());
  EXPECT_EQ(b.engine->stats().scoring, 0);
}

// cancel() of an id not issued yet is ignored: queued while the step thread ran a forward, it
// ended the request that got the id next. And a request cancelled meanwhile is gone from the
// stats before the next step's forward runs (it stayed counted for that whole step).
TEST(Engine, CancelOfAnIdNotYetIssuedIsIgnored) {
  // Two gates in the fake forward: A's decode at position 4, then B's prefill (logits at 1).
  struct Gate {
    std::promise<void> entered, release;
    std::shared_future<void> go = release.get_future().share();
    std::atomic<int> hits{0};
    void pass() {
      if (hits.fetch_add(1) != 0) return;
      entered.set_value();
      go.wait();
    }
  } at4, at1;
  Built b = build({.favorite = [&at4, &at1](int p) {
    if (p == 4) at4.pass();
    if (p == 1) at1.pass();
    return -1;
  }});
  Collector c;
  auto a = b.engine->submit(request({1, 2, 3}, 6), c.callback());
  ASSERT_TRUE(a.ok()) << a.status();
  at4.entered.get_future().wait();  // the step thread is inside A's forward
  b.engine->cancel(*a + 1);         // not issued yet
  auto bb = b.engine->submit(request({5, 6}, 2), c.callback());
  ASSERT_TRUE(bb.ok()) << bb.status();
  EXPECT_EQ(*bb, *a + 1);
  b.engine->cancel(*a);
  at4.release.set_value();
  // Inside B's prefill, A ended just before it. (Bounded: a cancel that ended B instead left
  // this waiting for good, a hang rather than a failure.)
  const bool b_ran =
      at1.entered.get_future().wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  if (!b_ran) at1.release.set_value();
  ASSERT_TRUE(b_ran) << "B never ran: the cancel of its id before it was issued ended it";
  const EngineStats during = b.engine->stats();
  EXPECT_EQ(during.running + during.waiting, 1);
  at1.release.set_value();
  ASSERT_TRUE(c.wait_finals(2));
  EXPECT_EQ(c.get(*bb).reason, FinishReason::kLength);
  EXPECT_EQ(c.get(*bb).ids.size(), 2u);
  EXPECT_EQ(c.get(*a).reason, FinishReason::kCancelled);
  b.engine->shutdown(false);
  EXPECT_EQ(b.engine->stats().kv_blocks_free, b.engine->stats().kv_blocks_total);
}

TEST(Engine, UsageCountsRecursionStepsAndTopLogprobs) {
  Built b = build({});
  auto r = request(tokens(5, 1), 4, 3);
  r.sampling.top_logprobs = 2;
  const Result res = run_all(*b.engine, {r})[0];
  EXPECT_EQ(res.usage.prompt_tokens, 5);
  EXPECT_EQ(res.usage.generated_tokens, 4);
  // Fed tokens: 5 prompt + 3 generated (the last is never fed) × T 3 × 6 CEM sub-layers.
  EXPECT_EQ(res.usage.recursion_steps, 8 * 3 * 6);
  // The timings are in order, the first token's included (here also the last).
  for (int max_new : {1, 4}) {
    auto one = request(tokens(5, 11), max_new);  // a prompt of its own: no cache hits below
    const RequestTimings t = run_all(*b.engine, {one})[0].timings;
    EXPECT_LE(t.submitted, t.scheduled) << max_new;
    EXPECT_LE(t.scheduled, t.first_token) << max_new;
    EXPECT_LE(t.first_token, t.finished) << max_new;
  }
  // The first token's event has them too, up to that token (a server observes the queue time
  // there rather than at the end).
  const Result two = run_all(*b.engine, {request(tokens(5, 12), 2)})[0];
  EXPECT_EQ(two.first_token_timings.submitted, two.timings.submitted);
  EXPECT_EQ(two.first_token_timings.scheduled, two.timings.scheduled);
  EXPECT_EQ(two.first_token_timings.first_token, two.timings.first_token);
  EXPECT_EQ(two.first_token_timings.finished, Clock::time_point{});
  EXPECT_NE(two.first_token_timings.scheduled, Clock::time_point{});
  ASSERT_EQ(res.top.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    ASSERT_EQ(res.top[i].size(), 2u);
    EXPECT_EQ(res.top[i][0].token_id, res.ids[i]);  // greedy picks the best
    EXPECT_FLOAT_EQ(res.top[i][0].logprob, res.logprobs[i]);
    EXPECT_GE(res.top[i][0].logprob, res.top[i][1].logprob);
  }
  // Not asked for: no alternatives at all (not an empty list per token).
  r.sampling.top_logprobs = 0;
  EXPECT_TRUE(run_all(*b.engine, {r})[0].top.empty());
  r.sampling.top_logprobs = 2;
  // Depth 0 is the model's default (1).
  r.recursion_depth = 0;
  EXPECT_EQ(run_all(*b.engine, {r})[0].usage.recursion_steps, 8 * 1 * 6);
}

// ---- scoring ----

TEST(Engine, ScoreMatchesGenerationLogprobsChunkByChunk) {
  EngineOptions eo;
  eo.max_batch_tokens = 3;  // many chunks
  Built b = build({}, eo);
  const auto prompt = tokens(7, 5);
  const Result gen = run_all(*b.engine, {request(prompt, 9, 2)})[0];
  std::vector<int> all = prompt;
  all.insert(all.end(), gen.ids.begin(), gen.ids.end());
  auto s = b.engine->score({all, 2});
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->logprobs.size(), all.size());
  EXPECT_TRUE(std::isnan(s->logprobs[0]));
  double sum = 0;
  for (size_t i = 1; i < all.size(); ++i) sum += s->logprobs[i];
  for (size_t i = 0; i < gen.ids.size(); ++i)
    EXPECT_NEAR(s->logprobs[prompt.size() + i], gen.logprobs[i], 1e-5) << i;
  EXPECT_NEAR(s->nll, -sum / double(all.size() - 1), 1e-9);
  EXPECT_NEAR(s->perplexity, std::exp(s->nll), 1e-9);
  EXPECT_EQ(s->recursion_depth, 2);
  EXPECT_NE(b.engine->score({all, 1})->logprobs[3], s->logprobs[3]);  // T matters
  b.engine->shutdown(false);
  EXPECT_EQ(b.engine->stats().kv_blocks_free, b.engine->stats().kv_blocks_total);
}

// Finite logits whose log-probabilities leave the range of the results are OUT_OF_RANGE (the
// text's, under a model that all but rules it out: not a server error), as `cemlm score` refuses
// them, not an OK answer of −inf or an infinite perplexity; the call's blocks are freed, and a
// text the same logits give a finite answer still scores.
TEST(Engine, ScoreRefusesResultsPastTheirRange) {
  constexpr float kMax = std::numeric_limits<float>::max();
  Built b = build({.spread = [](int p) { return p == 2 ? kMax : p >= 3 ? 1000.0f : 0.0f; }});
  // Token 5 after position 2: log p = −2·FLT_MAX, below a float.
  auto s = b.engine->score({{1, 2, 3, 5}, 1});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kOutOfRange) << s.status();
  EXPECT_NE(s.status().message().find("below the float range at position 2"), std::string::npos)
      << s.status();
  EXPECT_EQ(b.engine->stats().kv_blocks_free, b.engine->stats().kv_blocks_total);
  // Token 0 there has probability 1; token 5 after position 3 has log p = −2000: the mean
  // negative log-likelihood of the 4 tokens scored is about 500, its exp finite.
  s = b.engine->score({{1, 2, 3, 0, 5}, 1});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->logprobs[3], 0.0f);
  EXPECT_EQ(s->logprobs[4], -2000.0f);
  EXPECT_NEAR(s->nll, 500 - (s->logprobs[1] + s->logprobs[2]) / 4, 1e-4);
  EXPECT_NEAR(s->perplexity, std::exp(s->nll), 1e-9 * s->perplexity);
  // Once more after position 4: about 800, whose exp passes a double's range.
  s = b.engine->score({{1, 2, 3, 0, 5, 5}, 1});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kOutOfRange) << s.status();
  EXPECT_NE(s.status().message().find("perplexity"), std::string::npos) << s.status();
  b.engine->shutdown(false);
  EXPECT_EQ(b.engine->stats().kv_blocks_free, b.engine->stats().kv_blocks_total);
}

// A score call already past its deadline, or whose caller has already gone, takes no room: it
// preempted a running request of lower priority for nothing, then ended.
TEST(Engine, AScoreCallAlreadyGivenUpPreemptsNothing) {
  FakeOptions fo;
  fo.block_size = 4;
  fo.num_blocks = 16;
  fo.favorite = [](int) {  // slow enough that the request is still decoding when scores come
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    return -1;
  };
  Built b = build(std::move(fo));
  Collector c;
  auto id = b.engine->submit(request(tokens(8, 3), 50), c.callback());
  ASSERT_TRUE(id.ok()) << id.status();
  const auto until = Clock::now() + std::chrono::seconds(60);
  while (c.get(*id).ids.empty() && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_FALSE(c.get(*id).ids.empty());
  ScoreRequest late{tokens(56, 4), 1};  // 14 blocks: more than the request leaves free
  late.priority = 5;
  late.deadline = Clock::now() - std::chrono::seconds(1);
  auto s = b.engine->score(late);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDeadlineExceeded) << s.status();
  ScoreRequest gone = late;
  gone.deadline.reset();
  gone.cancelled = [] { return true; };
  s = b.engine->score(gone);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kCancelled) << s.status();
  EXPECT_EQ(b.engine->stats().preemptions_total, 0);
  ASSERT_TRUE(c.wait_finals(1));
  EXPECT_EQ(c.get(*id).ids.size(), 50u);
  b.engine->shutdown(false);
  EXPECT_EQ(b.engine->stats().kv_blocks_free, b.engine->stats().kv_blocks_total);
}

// A score call stops between chunks once its deadline has passed or its caller gave up, with
// the status that says which, and frees the blocks it held; a live call is not disturbed.
TEST(Engine, ScoreStopsAtItsDeadlineOrCancellation) {
  EngineOptions eo;
  eo.max_batch_tokens = 4;  // 40 tokens: 10 chunks
  std::atomic<int> last_pos{-1};  // the furthest position computed
  Built b = build({.favorite =
                       [&](int pos) {
                         if (pos > last_pos) last_pos = pos;
                         return -1;
                       }},
                  eo);
  const std::vector<int> ids = tokens(40, 3);
  ScoreRequest late{ids, 1};
  late.deadline = Clock::now() - std::chrono::milliseconds(1);
  auto s = b.engine->score(late);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDeadlineExceeded) << s.status();
  EXPECT_NE(s.status().message().find("deadline exceeded waiting for the 10 KV blocks"),
            std::string::npos)
      << s.status();
  ScoreRequest gives_up{ids, 1};
  gives_up.cancelled = [&] { return last_pos >= 11; };  // gone once 3 chunks are in
  s = b.engine->score(gives_up);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kCancelled) << s.status();
  EXPECT_NE(s.status().message().find("after scoring 12 of 40 tokens"), std::string::npos)
      << s.status();
  EXPECT_EQ(b.engine->stats().kv_blocks_free, b.engine->stats().kv_blocks_total);
  ScoreRequest in_time{ids, 1};
  in_time.deadline = Clock::now() + std::chrono::hours(1);
  in_time.cancelled = [] { return false; };
  s = b.engine->score(in_time);
  ASSERT_TRUE(s.ok()) << s.status();
  const auto plain = b.engine->score({ids, 1});
  for (size_t i = 1; i < ids.size(); ++i) EXPECT_EQ(s->logprobs[i], plain->logprobs[i]) << i;
  b.engine->shutdown(false);
}

// A scoring chunk waiting for its turn is withdrawn once its call's client gives up (cancel or
// deadline): the call ends then, not after the chunks ahead of it. Here the engine is held inside
// the generation step that follows the call's first chunk, so that its second waits; the call
// must withdraw it (it then looks at its cancellation again, to say so) while the engine is held,
// and that chunk never runs.
TEST(Engine, AQueuedScoringChunkIsWithdrawnWhenItsCallGivesUp) {
  EngineOptions eo;
  eo.max_batch_tokens = 4;
  std::atomic<bool> prefilled{false}, armed{false}, hold{true}, give_up{false};
  std::atomic<int> held{0}, looks_armed{0}, looks_after{0};
  Built b = build({.favorite =
                       [&](int pos) {
                         if (pos < 20) {  // the generation's prompt, or the call's chunk
                           if (prefilled) armed = true;
                           return -1;
                         }
                         if (armed && hold) {
                           ++held;
                           while (hold) std::this_thread::sleep_for(std::chrono::milliseconds(1));
                         }
                         // Slow enough that it still runs when the call starts.
                         std::this_thread::sleep_for(std::chrono::milliseconds(1));
                         return -1;
                       }},
                  eo);
  Collector c;
  const auto gen = b.engine->submit(request(tokens(20, 1), 230), c.callback());
  ASSERT_TRUE(gen.ok());
  while (c.get(*gen).ids.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  prefilled = true;
  ScoreRequest s{tokens(8, 3), 1};  // 2 chunks, positions below the generation's
  s.cancelled = [&] {
    if (!give_up) {
      looks_armed += armed;  // after the first chunk: before the second is queued
      return false;
    }
    ++looks_after;
    return true;
  };
  auto scored = std::async(std::launch::async, [&] { return b.engine->score(s); });
  // (The generation has ~230 ms of steps left to be held in.)
  const auto armed_by = Clock::now() + std::chrono::seconds(20);
  while ((held == 0 || looks_armed == 0) && Clock::now() < armed_by)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_TRUE(held > 0 && looks_armed > 0) << "the generation ended before the call's chunk";
  give_up = true;
  // Not a timing bound: before the fix the call waited on the held engine without looking.
  const auto until = Clock::now() + std::chrono::seconds(20);
  while (looks_after < 2 && Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_GE(looks_after, 2) << "the call did not give up while its chunk waited";
  hold = false;
  const auto r = scored.get();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled) << r.status();
  EXPECT_NE(r.status().message().find("cancelled after scoring 4 of 8 tokens"), std::string::npos)
      << r.status();
  b.engine->cancel(*gen);
  ASSERT_TRUE(c.wait_finals(1));
  b.engine->shutdown(false);
  const std::string& f = b.runner->forwards();
  EXPECT_EQ(std::count(f.begin(), f.end(), 'S'), 1) << f;  // the withdrawn chunk never ran
  EXPECT_EQ(b.engine->stats().kv_blocks_free, b.engine->stats().kv_blocks_total);
}

// With no generation running, chunks still go one a pass: a chunk queued behind another call's
// running chunk is withdrawn when its call gives up (the loop took every queued chunk at once,
// and the call then waited for the chunks ahead of it and computed its own for nobody). The
// generation is held in its last two steps while both calls get their room and queue their
// chunks; the first chunk after it ends is held until the other call has given up.
TEST(Engine, WithNoGenerationAQueuedChunkIsStillWithdrawn) {
  EngineOptions eo;
  eo.max_batch_tokens = 16;
  constexpr int M = 10;  // the generation's last step computes position 18 + M
  std::atomic<int> g_held{0}, s_held{0}, started{0}, first_looks{0};
  std::atomic<int> looks_after[2] = {0, 0};
  std::atomic<bool> rel1{false}, rel2{false}, rel3{false}, give_up{false};
  auto wait_for = [](const std::function<bool()>& done, int seconds = 20) {
    const auto until = Clock::now() + std::chrono::seconds(seconds);
    while (!done() && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return done();
  };
  auto hold_until = [](const std::atomic<bool>& released) {
    while (!released) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  // Whatever fails, the engine is let go before what waits for it is destroyed (the engine, then
  // the calls' futures, each has one of these declared after it).
  struct Release {
    std::atomic<bool>*r1, *r2, *r3;
    ~Release() { *r1 = *r2 = *r3 = true; }
  };
  Built b = build({.favorite =
                       [&](int pos) {
                         if (pos == 17 + M) g_held = 1, hold_until(rel1);
                         if (pos == 18 + M) g_held = 2, hold_until(rel2);
                         if (pos == 0 && rel2 && s_held++ == 0) hold_until(rel3);
                         return -1;
                       }},
                  eo);
  const Release release_engine{&rel1, &rel2, &rel3};
  Collector c;
  const auto gen = b.engine->submit(request(tokens(20, 1), M), c.callback());
  ASSERT_TRUE(gen.ok());
  ASSERT_TRUE(wait_for([&] { return g_held == 1; }));
  auto call = [&](int index) {
    ScoreRequest s{tokens(8, 3 + 2 * index), 1};  // one chunk
    s.cancelled = [&, index] {
      if (!give_up) {
        ++first_looks;  // its room is granted: its chunk is queued next
        return false;
      }
      ++looks_after[index];
      return true;
    };
    ++started;
    return b.engine->score(s);
  };
  auto a = std::async(std::launch::async, call, 0);
  auto other = std::async(std::launch::async, call, 1);
  const Release release_calls{&rel1, &rel2, &rel3};
  ASSERT_TRUE(wait_for([&] { return started == 2; }));
  // Their room jobs reach the held loop (else one is served a pass later: the test then checks
  // the withdrawal of a chunk queued behind a running one, not of one taken with it).
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  rel1 = true;
  ASSERT_TRUE(wait_for([&] { return g_held == 2; }));
  wait_for([&] { return first_looks >= 2; }, 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // from their looks to their queue
  rel2 = true;                                                 // the generation ends in this step
  ASSERT_TRUE(wait_for([&] { return s_held > 0 && first_looks >= 2; }));
  give_up = true;
  // The held chunk's call looks once (its chunk runs); the other withdraws its chunk: a look
  // that gives up, then one that says so.
  EXPECT_TRUE(wait_for([&] { return looks_after[0] >= 2 || looks_after[1] >= 2; }));
  rel3 = true;
  const auto ra = a.get(), rb = other.get();
  EXPECT_TRUE(ra.ok() != rb.ok()) << ra.status() << " / " << rb.status();
  const absl::Status& gave_up = ra.ok() ? rb.status() : ra.status();
  EXPECT_EQ(gave_up.code(), absl::StatusCode::kCancelled) << gave_up;
  EXPECT_NE(gave_up.message().find("cancelled after scoring 0 of 8"), std::string::npos) << gave_up;
  ASSERT_TRUE(c.wait_finals(1));
  b.engine->shutdown(false);
  const std::string& f = b.runner->forwards();
  EXPECT_EQ(std::count(f.begin(), f.end(), 'S'), 1) << f;  // the withdrawn chunk never ran
}

// Score chunks run on the engine thread; a shutdown that begins while a score call is under way
// lets it finish (same logprobs as an undisturbed call), then stops. The runner holds the call's
// first chunk until shutdown() has begun, so the two surely overlap.
TEST(Engine, ScoreUnderWayWhenShutdownBeginsFinishes) {
  EngineOptions eo;
  eo.max_batch_tokens = 3;  // many chunks after the held one
  const auto ids = tokens(20, 8);
  Built ref = build({}, eo);
  const auto want = ref.engine->score({ids, 2});
  ASSERT_TRUE(want.ok()) << want.status();

  std::mutex mu;
  std::condition_variable cv;
  bool held = false, go = false;
  FakeOptions fo;
  fo.favorite = [&](int) {
    std::unique_lock<std::mutex> lock(mu);
    if (!held) {
      held = true;
      cv.notify_all();
      cv.wait_for(lock, std::chrono::seconds(60), [&] { return go; });
    }
    return -1;
  };
  Built b = build(fo, eo);
  auto scored = std::async(std::launch::async, [&] { return b.engine->score({ids, 2}); });
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return held; }));
  }
  auto stopped = std::async(std::launch::async, [&] { b.engine->shutdown(false); });
  // shutdown() waits for the score call, which waits for the held chunk.
  EXPECT_EQ(stopped.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout);
  {
    std::lock_guard<std::mutex> lock(mu);
    go = true;
  }
  cv.notify_all();
  ASSERT_EQ(scored.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  const auto got = scored.get();
  ASSERT_TRUE(got.ok()) << got.status();
  for (size_t i = 1; i < ids.size(); ++i) EXPECT_EQ(got->logprobs[i], want->logprobs[i]) << i;
  ASSERT_EQ(stopped.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  EXPECT_EQ(b.engine->score({ids, 2}).status().code(), absl::StatusCode::kUnavailable);
}

// A shutdown that cancels what runs (the server's once --shutdown-timeout is over) ends a score
// call under way at its next chunk, UNAVAILABLE, its blocks freed: it waited for every chunk of
// the text, however long. The runner holds the call's first chunk until shutdown() has begun.
TEST(Engine, ScoreUnderWayIsEndedByAShutdownThatCancels) {
  EngineOptions eo;
  eo.max_batch_tokens = 3;
  Gate gate;
  Built b = build({.favorite =
                       [&](int) {
                         gate.enter();
                         return -1;
                       }},
                  eo);
  auto scored = std::async(std::launch::async, [&] { return b.engine->score({tokens(20, 8), 2}); });
  gate.wait_entered(1);
  std::thread stopper([&] { b.engine->shutdown(true); });
  // Refused once shutdown() has begun (the queue may fill first: that refusal is temporary).
  Collector c;
  for (;;) {
    const auto id = b.engine->submit(request({1}, 1), c.callback());
    if (!id.ok() && id.status().code() == absl::StatusCode::kUnavailable) break;
    std::this_thread::yield();
  }
  gate.release();
  stopper.join();
  const auto got = scored.get();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_NE(got.status().message().find("after scoring 3 of 20 tokens"), std::string::npos)
      << got.status();
  EXPECT_EQ(b.engine->stats().kv_blocks_free, b.engine->stats().kv_blocks_total);
}

// Scoring calls on a cache too small for them and the running requests: they wait for room or
// preempt, and the requests still finish the same.
TEST(Engine, ScoringOnAFullCacheLeavesRunningRequestsTheSame) {
  // 16 blocks of 4: a 60-token score needs 15 of them.
  const auto reqs = mixed_requests();
  Built ref = build({.num_blocks = 512});
  const auto reference = run_all(*ref.engine, reqs);
  Built b = build({.num_blocks = 16});
  Collector c;
  std::vector<RequestId> ids;
  for (const auto& r : reqs) ids.push_back(*b.engine->submit(r, c.callback()));
  for (int i = 0; i < 5; ++i) {
    ScoreRequest s{tokens(60, i), 1};
    s.priority = i % 2;
    ASSERT_TRUE(b.engine->score(s).ok()) << i;
  }
  ASSERT_TRUE(c.wait_finals(int(ids.size())));
  std::vector<Result> got;
  for (RequestId id : ids) got.push_back(c.get(id));
  expect_same_outputs(reference, got);
}

// A scoring call that finds the cache full preempts a running request of lower priority, and
// waits for one of its own priority to finish instead (first come, first served).
TEST(Engine, ScoreWaitsForEqualPrioritiesAndPreemptsLowerOnes) {
  const GenerateRequest gen = request(tokens(8, 3), 40);  // up to 48 tokens: 12 blocks
  Built ref = build({.num_blocks = 512});
  const auto reference = run_all(*ref.engine, {gen});
  for (int priority : {0, 1}) {
    std::atomic<int> steps{0};
    // 20 ms a step (0.8 s for the request): it is still running when the call comes, however
    // late a loaded machine runs this thread.
    Built b = build({.num_blocks = 16, .favorite = [&](int) {
                       ++steps;
                       std::this_thread::sleep_for(std::chrono::milliseconds(20));
                       return -1;
                     }});
    Collector c;
    const RequestId id = *b.engine->submit(gen, c.callback());
    while (steps.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ScoreRequest s{tokens(60, 9), 1};  // 15 blocks: more than the request leaves
    s.priority = priority;
    ASSERT_TRUE(b.engine->score(s).ok()) << priority;
    EXPECT_EQ(b.engine->stats().preemptions_total, priority) << priority;
    ASSERT_TRUE(c.wait_finals(1));
    expect_same_outputs(reference, {c.get(id)});
  }
}

// The scene of the next tests, on 16 blocks of 4 with 4-token chunks: a request (8-token prompt)
// holds at 10 tokens (3 blocks) until `sent`, then 50 ms for a Score of 48 ids to take 12 of the
// 13 blocks free; its rows are paced (3 ms each) so that the Score's first chunk is queued before
// the request needs a fifth block, 6 steps on. Only the Score's chunks give position 0 logits:
// `first_chunks` counts its starts, and `at_first_chunk` runs in the first.
struct ScoreBesideRequest {
  EngineOptions engine_options() const {
    EngineOptions eo;
    eo.max_batch_tokens = 4;
    return eo;
  }
  FakeOptions runner_options() {
    return {.num_blocks = 16, .favorite = [this](int p) {
              if (p == 0 && first_chunks++ == 0 && at_first_chunk) at_first_chunk();
              if (p == 9 && !gated.exchange(true)) {
                while (!sent) std::this_thread::sleep_for(std::chrono::milliseconds(1));
                std::this_thread::sleep_for(std::chrono::milliseconds(50));
              }
              std::this_thread::sleep_for(std::chrono::milliseconds(3));
              return -1;
            }};
  }
  const ScoreRequest score{tokens(48, 9), 1};  // 12 blocks
  std::atomic<bool> sent{false};
  std::atomic<int> first_chunks{0};
  std::function<void()> at_first_chunk;

 private:
  std::atomic<bool> gated{false};
};

// A running request of higher priority that needs a block takes it from a Score of lower
// priority, which starts over once there is room again: the request preempted itself (and redid
// its tokens after the Score), the Score's blocks being nobody's to take.
TEST(Engine, ARunningRequestTakesTheBlocksOfALowerPriorityScore) {
  ScoreBesideRequest scene;
  GenerateRequest gen = request(tokens(8, 3), 40);  // 48 tokens: 12 of 16 blocks
  gen.priority = 5;
  Built ref = build({.num_blocks = 512}, scene.engine_options());
  const auto reference = run_all(*ref.engine, {gen});
  const auto alone = ref.engine->score(scene.score);
  ASSERT_TRUE(alone.ok()) << alone.status();
  Built b = build(scene.runner_options(), scene.engine_options());
  Collector c;
  const RequestId id = *b.engine->submit(gen, c.callback());
  scene.sent = true;
  const auto got = b.engine->score(scene.score);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(scene.first_chunks.load(), 2) << "the Score was not preempted and started over";
  EXPECT_EQ(b.engine->stats().preemptions_total, 1) << "the request was preempted too";
  for (size_t i = 1; i < scene.score.ids.size(); ++i)
    EXPECT_EQ(got->logprobs[i], alone->logprobs[i]) << i;
  EXPECT_EQ(got->nll, alone->nll);
  ASSERT_TRUE(c.wait_finals(1));
  expect_same_outputs(reference, {c.get(id)});
  EXPECT_EQ(b.engine->stats().kv_blocks_free, 16);
}

// A Score preempted while a shutdown lets requests finish waits for room again and finishes,
// as a preempted generation request does (it ended UNAVAILABLE).
TEST(Engine, AScorePreemptedDuringAGracefulShutdownFinishes) {
  ScoreBesideRequest scene;
  GenerateRequest gen = request(tokens(8, 3), 40);
  gen.priority = 5;
  Built ref = build({.num_blocks = 512}, scene.engine_options());
  const auto alone = ref.engine->score(scene.score);
  ASSERT_TRUE(alone.ok()) << alone.status();
  std::atomic<bool> scoring{false}, stop_called{false};
  scene.at_first_chunk = [&] {  // holds the Score's first chunk until shutdown() is under way
    scoring = true;
    while (!stop_called) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  Built b = build(scene.runner_options(), scene.engine_options());
  Collector c;
  const RequestId id = *b.engine->submit(gen, c.callback());
  scene.sent = true;
  std::thread stopper;
  auto stop = std::async(std::launch::async, [&] {
    while (!scoring) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    stopper = std::thread([&] { b.engine->shutdown(false); });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    stop_called = true;
  });
  const auto got = b.engine->score(scene.score);
  stop.get();
  stopper.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(scene.first_chunks.load(), 2) << "the Score was not preempted and started over";
  EXPECT_EQ(got->nll, alone->nll);
  ASSERT_TRUE(c.wait_finals(1));
  EXPECT_EQ(c.get(id).reason, FinishReason::kLength);
}

// A preempted Score keeps its place among requests of its priority: it is queued for room at
// once, so a later request of its priority is not admitted into the blocks it lost (and then
// waited for, since equal priorities never make way).
TEST(Engine, APreemptedScoreKeepsItsPlaceBeforeLaterRequestsOfItsPriority) {
  ScoreBesideRequest scene;
  const GenerateRequest first = request(tokens(8, 3), 28);  // 9 of 16 blocks at the end
  const GenerateRequest later = request(tokens(8, 5), 40);
  std::atomic<bool> scoring{false};
  scene.at_first_chunk = [&] { scoring = true; };
  Built b = build(scene.runner_options(), scene.engine_options());
  Collector c;
  const RequestId a = *b.engine->submit(first, c.callback());
  scene.sent = true;
  RequestId z = 0;
  auto send_later = std::async(std::launch::async, [&] {
    while (!scoring) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    z = *b.engine->submit(later, c.callback());
  });
  const auto got = b.engine->score(scene.score);
  send_later.get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(scene.first_chunks.load(), 2) << "the Score was not preempted and started over";
  EXPECT_EQ(c.get(a).finals, 1);
  EXPECT_EQ(c.get(z).finals, 0) << "the Score waited for a later request of its priority";
  ASSERT_TRUE(c.wait_finals(2));
}

// One request of priority 5 running (20 ms a step, one running at a time) and one of priority 5
// waiting for it, on a cache of `num_blocks`; a priority-0 Score is then sent.
struct RunningAndWaiting {
  RunningAndWaiting(int num_blocks, const GenerateRequest& first, const GenerateRequest& second) {
    EngineOptions one_at_a_time;
    one_at_a_time.max_running = 1;
    b = build({.num_blocks = num_blocks,
               .favorite =
                   [this](int) {
                     ++steps;
                     std::this_thread::sleep_for(std::chrono::milliseconds(20));
                     return -1;
                   }},
              one_at_a_time);
    GenerateRequest r0 = first, r1 = second;
    r0.priority = r1.priority = 5;
    running = *b.engine->submit(r0, c.callback());
    waiting = *b.engine->submit(r1, c.callback());
    for (int i = 0; i < 5000 && (steps.load() == 0 || b.engine->stats().waiting == 0); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::atomic<int> steps{0};
  Collector c;
  Built b;  // after c: the engine goes first, and calls no callback of a collector gone
  RequestId running = 0, waiting = 0;
};

// A Score of lower priority does not take the blocks a finished request frees while a request of
// higher priority waits for them: it waits its turn, as a generation request of its priority would
// (it took them, and the higher-priority request waited for it).
TEST(Engine, ScoreDoesNotTakeBlocksAHigherPriorityWaitsFor) {
  // 7 and 12 of 16 blocks; the Score needs 15.
  RunningAndWaiting r(16, request(tokens(8, 3), 20), request(tokens(8, 4), 40));
  ASSERT_EQ(r.b.engine->stats().waiting, 1);
  ASSERT_TRUE(r.b.engine->score({tokens(60, 9), 1}).ok());
  EXPECT_EQ(r.c.get(r.running).finals, 1);
  EXPECT_EQ(r.c.get(r.waiting).finals, 1) << "the score went ahead of the waiting request";
  ASSERT_TRUE(r.c.wait_finals(2));
}

// Nor does it wait for a higher-priority request that waits for a --max-running slot only, the
// cache nearly empty: it left a priority-0 Score waiting as long as higher-priority traffic kept
// the queue non-empty.
TEST(Engine, ScoreDoesNotWaitForAHigherPriorityThatWaitsOnlyForASlot) {
  // 60 steps of 20 ms (1.2 s at least) on 64 blocks; the Score needs 2.
  RunningAndWaiting r(64, request(tokens(8, 3), 60), request(tokens(8, 4), 4));
  ASSERT_EQ(r.b.engine->stats().waiting, 1);
  ASSERT_TRUE(r.b.engine->score({tokens(8, 9), 1}).ok());
  EXPECT_EQ(r.c.get(r.running).finals, 0) << "the score waited for the running request to end";
  ASSERT_TRUE(r.c.wait_finals(2));
  EXPECT_EQ(r.c.get(r.waiting).finals, 1);
}

// A Generate request that keeps 3 to 15 of 16 blocks taken for at least 1 s (50 steps of a
// 20 ms forward), so that a 60-token score (15 blocks) must wait, and is still running when a
// test acts on that, however late a loaded machine runs the test's thread.
struct BusyEngine {
  std::atomic<int> steps{0};
  std::mutex mu;
  std::vector<int> positions;  // of every logits row the runner made, in order
  Collector c;  // outlives the engine, which calls it
  Built b;
  explicit BusyEngine(int max_waiting)
      : b(build({.num_blocks = 16,
                 .favorite =
                     [this](int p) {
                       ++steps;
                       {
                         std::lock_guard lock(mu);
                         positions.push_back(p);
                       }
                       std::this_thread::sleep_for(std::chrono::milliseconds(20));
                       return -1;
                     }},
                {.max_waiting = max_waiting})) {
    EXPECT_TRUE(b.engine->submit(request(tokens(8, 1), 50), c.callback()).ok());
    while (steps.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Waits until `n` calls count as waiting; false if `pending` ended first.
  template <typename F>
  bool waiting(int n, F& pending) {
    while (b.engine->stats().waiting < n)
      if (pending.wait_for(std::chrono::milliseconds(1)) != std::future_status::timeout)
        return false;
    return true;
  }
};

// At most max_waiting scoring calls wait for room; one more is refused at once, naming the limit,
// and a waiting call ends when its caller gives up or its deadline passes.
TEST(Engine, WaitingScoringCallsAreBounded) {
  BusyEngine busy(1);
  Engine& e = *busy.b.engine;
  std::atomic<bool> give_up{false};
  ScoreRequest waits{tokens(60, 2), 1};
  waits.cancelled = [&] { return give_up.load(); };
  auto waiting = std::async(std::launch::async, [&] { return e.score(waits); });
  ASSERT_TRUE(busy.waiting(1, waiting));
  const auto refused = e.score({tokens(60, 3), 1});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("--max-waiting = 1"), std::string::npos)
      << refused.status();
  give_up = true;
  EXPECT_EQ(waiting.get().status().code(), absl::StatusCode::kCancelled);
  ScoreRequest late{tokens(60, 4), 1};
  late.deadline = Clock::now();
  EXPECT_EQ(e.score(late).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(e.score({tokens(60, 3), 1}).ok()) << "waits for the request to finish";
  ASSERT_TRUE(busy.c.wait_finals(1));
  EXPECT_EQ(e.stats().preemptions_total, 0);
  EXPECT_EQ(e.stats().kv_blocks_free, 16);
}

// Scoring calls are served first come, first served within a priority: a small one that would
// fit waits behind a large one waiting for room, instead of taking the blocks held for it.
TEST(Engine, ScoringCallsDoNotOvertakeAWaitingOneOfTheirPriority) {
  BusyEngine busy(4);
  Engine& e = *busy.b.engine;
  std::atomic<bool> give_up{false};
  ScoreRequest large{tokens(60, 2), 1};
  large.cancelled = [&] { return give_up.load(); };
  auto first = std::async(std::launch::async, [&] { return e.score(large); });
  ASSERT_TRUE(busy.waiting(1, first));
  auto second = std::async(std::launch::async, [&] { return e.score({tokens(6, 3), 1}); });
  EXPECT_TRUE(busy.waiting(2, second)) << "the small call did not wait behind the large one";
  // It keeps waiting (each retry is behind the large call) while the request holds the cache:
  // here for 10 more of its tokens (the request, the only Generate one, makes 50).
  auto generated = [&] { return busy.c.all().begin()->second.ids.size(); };
  const size_t seen = generated();
  // Else the wait below would never end.
  ASSERT_LE(seen + 10, 50u) << "the request was nearly done before both calls waited";
  while (generated() < seen + 10) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(second.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "the small call overtook the large one";
  give_up = true;
  EXPECT_EQ(first.get().status().code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(second.get().ok());
  ASSERT_TRUE(busy.c.wait_finals(1));
}

// A call waiting behind another (it sleeps until the first in line changes, rather than try for
// room every millisecond) still ends at its deadline, or when its caller gives up, while the
// first waits on.
TEST(Engine, ACallWaitingBehindAnotherStillEndsAtItsDeadlineOrCancellation) {
  BusyEngine busy(4);
  Engine& e = *busy.b.engine;
  std::atomic<bool> give_up_first{false}, give_up_third{false};
  ScoreRequest large{tokens(60, 2), 1};
  large.cancelled = [&] { return give_up_first.load(); };
  auto first = std::async(std::launch::async, [&] { return e.score(large); });
  ASSERT_TRUE(busy.waiting(1, first));
  ScoreRequest timed{tokens(6, 3), 1};
  timed.deadline = Clock::now() + std::chrono::milliseconds(200);
  auto second = std::async(std::launch::async, [&] { return e.score(timed); });
  ScoreRequest cancelled{tokens(6, 4), 1};
  cancelled.cancelled = [&] { return give_up_third.load(); };
  auto third = std::async(std::launch::async, [&] { return e.score(cancelled); });
  EXPECT_EQ(second.get().status().code(), absl::StatusCode::kDeadlineExceeded);
  give_up_third = true;
  EXPECT_EQ(third.get().status().code(), absl::StatusCode::kCancelled);
  give_up_first = true;  // (room comes once the busy request's ~1 s of steps end)
  const absl::StatusCode code = first.get().status().code();
  EXPECT_TRUE(code == absl::StatusCode::kCancelled || code == absl::StatusCode::kOk) << code;
  ASSERT_TRUE(busy.c.wait_finals(1));
  EXPECT_EQ(e.stats().waiting, 0);
}

// Scoring calls waiting for room (one first in line, one behind it) end UNAVAILABLE when a
// shutdown begins, while the running request they wait for still runs to its end.
TEST(Engine, ScoringCallsWaitingForRoomEndAtAShutdown) {
  BusyEngine busy(4);
  Engine& e = *busy.b.engine;
  auto first = std::async(std::launch::async, [&] { return e.score({tokens(60, 2), 1}); });
  ASSERT_TRUE(busy.waiting(1, first));
  auto second = std::async(std::launch::async, [&] { return e.score({tokens(60, 3), 1}); });
  ASSERT_TRUE(busy.waiting(2, second));
  std::thread stopper([&] { e.shutdown(false); });
  for (auto* call : {&first, &second}) {
    const auto got = call->get();
    EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
    EXPECT_NE(got.status().message().find("shutting down"), std::string::npos) << got.status();
  }
  stopper.join();
  ASSERT_TRUE(busy.c.wait_finals(1));
  const Result r = busy.c.all().begin()->second;
  EXPECT_EQ(r.ids.size(), 50u);
  EXPECT_EQ(r.reason, FinishReason::kLength);
  EXPECT_EQ(e.stats().waiting, 0);
  EXPECT_EQ(e.stats().kv_blocks_free, 16);
}

// Blocks are held for a waiting scoring call: a request of its priority submitted after it is not
// admitted into them, so the call gets its room first (here as soon as the busy request ends).
TEST(Engine, AWaitingScoringCallIsNotStarvedByLaterRequestsOfItsPriority) {
  BusyEngine busy(4);
  Engine& e = *busy.b.engine;
  auto scored = std::async(std::launch::async, [&] { return e.score({tokens(60, 2), 1}); });
  ASSERT_TRUE(busy.waiting(1, scored));
  // A 3-token prompt: its logits rows are at positions 2 to 51; the scored text has rows at every
  // position 0 to 59, the busy request at 7 to 56. The runner's order says which ran first,
  // whenever this thread gets to look (counting the later request's tokens once the call returned
  // raced a loaded machine's scheduler). Once the busy request ends, the later one may run in the
  // one block the hold leaves free (its rows at positions 2 and 3) until the call's thread, which
  // a loaded machine may wake late, sends its first chunk; a row at 4 to 6 needs a second block,
  // one of those held for the call.
  const auto later = e.submit(request(tokens(3, 5), 50), busy.c.callback());
  ASSERT_TRUE(later.ok()) << later.status();
  ASSERT_TRUE(scored.get().ok());
  ASSERT_TRUE(busy.c.wait_finals(2));
  EXPECT_EQ(busy.c.get(*later).ids.size(), 50u);
  std::lock_guard lock(busy.mu);
  const std::vector<int>& p = busy.positions;
  const size_t scored_first = size_t(std::find(p.begin(), p.end(), 0) - p.begin());
  ASSERT_LT(scored_first, p.size());
  const auto before = std::count_if(p.begin(), p.begin() + long(scored_first),
                                    [](int x) { return x >= 4 && x <= 6; });
  EXPECT_EQ(before, 0) << "the later request took blocks held for the waiting call";
}

// ---- validation ----

std::string submit_error(Engine& e, const GenerateRequest& r) {
  Collector c;
  auto st = e.submit(r, c.callback());
  EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e.validate(r).code(), absl::StatusCode::kInvalidArgument);
  return std::string(st.status().message());
}

TEST(Engine, BadRequestsAreRefusedNamingTheField) {
  Built b = build({.vocab = 64, .num_blocks = 40, .max_seq_len = 200});
  Engine& e = *b.engine;
  const std::vector<std::pair<std::string, GenerateRequest>> cases = {
      {"prompt_ids is empty", request({}, 4)},
      {"prompt_ids has 201 tokens", request(std::vector<int>(201, 1), 4)},
      {"prompt_ids[1] = 64", request({1, 64}, 4)},
      {"prompt_ids[0] = -3", request({-3}, 4)},
      {"recursion_depth = 9 exceeds the model's recursion.max = 8", request({1}, 4, 9)},
      {"recursion_depth = -1", request({1}, 4, -1)},
      {"max_seq_len = 200; shorten the prompt or lower sampling.max_new_tokens (64 when not set)",
       request(std::vector<int>(150, 1), 60)},
      {"the cache holds 40", request(std::vector<int>(150, 1), 12)},
      {"sampling.stop needs a tokenizer",
       [] {
         auto r = request({1}, 4);
         r.sampling.stop = {"x"};
         return r;
       }()},
      {"sampling.top_p",
       [] {
         auto r = request({1}, 4);
         r.sampling.top_p = 2;
         return r;
       }()},
      {"sampling.stop_token_ids[0] = 64",
       [] {
         auto r = request({1}, 4);
         r.sampling.stop_token_ids = {64};
         return r;
       }()},
  };
  for (const auto& [want, req] : cases)
    EXPECT_NE(submit_error(e, req).find(want), std::string::npos) << want << " vs "
                                                                  << submit_error(e, req);
  EXPECT_NE(e.submit(request({1}, 4), nullptr).status().message().find("on_event"),
            std::string::npos);
  EXPECT_TRUE(e.validate(request({1}, 4)).ok());
  // Exactly max_seq_len tokens, in exactly the cache's blocks: accepted.
  EXPECT_TRUE(e.validate(request({1}, 4, 8)).ok());  // recursion.max itself
  Built exact = build({.vocab = 64, .num_blocks = 50, .max_seq_len = 200});
  EXPECT_TRUE(exact.engine->validate(request(std::vector<int>(150, 1), 50)).ok());
  EXPECT_FALSE(exact.engine->validate(request(std::vector<int>(150, 1), 51)).ok());
  // The last token is never fed back: 150 + 11 tokens keep 160 in the cache, its 40 blocks of 4,
  // and run to their end (one more was refused).
  const auto full = run_all(e, {request(std::vector<int>(150, 1), 11)});
  EXPECT_EQ(full[0].reason, FinishReason::kLength);
  EXPECT_EQ(full[0].ids.size(), 11u);
}

TEST(Engine, BadScoreRequestsAreRefusedNamingTheField) {
  Built b = build({.num_blocks = 10, .max_seq_len = 100});
  const std::vector<std::pair<std::string, ScoreRequest>> cases = {
      {"ids is empty", {{}, 0}},
      {"ids has 1 token", {{5}, 0}},
      {"ids[2] = 64", {{1, 2, 64}, 0}},
      {"recursion_depth = 12", {{1, 2}, 12}},
      {"the cache holds 10", {std::vector<int>(41, 1), 0}},
  };
  for (const auto& [want, req] : cases) {
    auto st = b.engine->score(req);
    EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument) << want;
    EXPECT_NE(st.status().message().find(want), std::string::npos)
        << want << " vs " << st.status();
  }
  // The limits' own values are accepted: 40 tokens fill exactly the cache's 10 blocks of 4.
  const auto full = b.engine->score({std::vector<int>(40, 1), 0});
  EXPECT_TRUE(full.ok()) << full.status();
}

// A pool of more blocks than the host can keep records of (a tiny model's cache at a huge budget)
// is an error status naming the flags, not an exception through the caller (the engine's thread
// was then destroyed joinable: std::terminate).
TEST(Engine, BlockRecordsBeyondMemoryAreRefusedNotACrash) {
  std::ifstream mode_file("/proc/sys/vm/overcommit_memory");
  int mode = 0;
  if (mode_file >> mode && mode == 1)
    GTEST_SKIP() << "vm.overcommit_memory = 1: the records' 240 GB would be granted, then touched";
  class HugePool final : public ModelRunner {
   public:
    const ModelConfig& config() const override { return small_.config(); }
    int block_size() const override { return small_.block_size(); }
    int64_t num_blocks() const override { return INT32_MAX; }
    void forward(const Batch&, std::vector<float>*) override { std::abort(); }
    void copy_block(int32_t, int32_t) override { std::abort(); }

   private:
    FakeRunner small_{FakeOptions{}};
  };
  auto e = Engine::create(EngineOptions{}, std::make_unique<HugePool>(), nullptr);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kResourceExhausted) << e.status();
  EXPECT_NE(e.status().message().find("out of memory for the bookkeeping of the KV cache's "
                                      "2147483647 blocks"),
            std::string::npos)
      << e.status();
  EXPECT_NE(e.status().message().find("; lower --kv-cache-memory"), std::string::npos) << e.status();
}

TEST(Engine, BadOptionsAreRefusedNamingTheOption) {
  EngineOptions eo;
  eo.max_batch_tokens = 0;
  auto e = Engine::create(eo, std::make_unique<FakeRunner>(FakeOptions{}), nullptr);
  EXPECT_NE(e.status().message().find("max_batch_tokens"), std::string::npos) << e.status();
  eo = {};
  eo.max_waiting = -1;
  e = Engine::create(eo, std::make_unique<FakeRunner>(FakeOptions{}), nullptr);
  EXPECT_NE(e.status().message().find("max_waiting"), std::string::npos) << e.status();
  eo = {};
  eo.max_running = 0;
  e = Engine::create(eo, std::make_unique<FakeRunner>(FakeOptions{}), nullptr);
  EXPECT_NE(e.status().message().find("max_running"), std::string::npos) << e.status();
  eo = {};
  eo.step_thread_nice = 20;
  e = Engine::create(eo, std::make_unique<FakeRunner>(FakeOptions{}), nullptr);
  EXPECT_NE(e.status().message().find("step_thread_nice"), std::string::npos) << e.status();
  eo.step_thread_nice = 19;  // the bound itself is valid
  e = Engine::create(eo, std::make_unique<FakeRunner>(FakeOptions{}), nullptr);
  EXPECT_TRUE(e.ok()) << e.status();
}

// A model directory whose tokenizer.model cannot even be looked at (a symbolic link to itself, a
// name too long) is an error naming the file: the throwing std::filesystem::exists() ended the
// process, after a server had already begun to listen.
TEST(Engine, ATokenizerPathThatCannotBeCheckedIsAnError) {
  const std::filesystem::path dir = testing_temp::fresh_dir("tokenizer_loop");
  std::ofstream(dir / "config.json") << R"({"architecture": "cemlm", "format_version": 1,
    "vocab_size": 300, "d_model": 16, "n_layers": 1, "n_heads": 2, "head_dim": 4, "d_ff": 24,
    "max_seq_len": 64, "embedding": {"type": "table"}, "attention": {"type": "cem"},
    "mlp": {"type": "cem"}})";
  std::filesystem::create_symlink(dir / "tokenizer.model", dir / "tokenizer.model");
  EngineOptions eo;
  eo.model_dir = dir.string();
  auto e = Engine::create(eo);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << e.status();
  EXPECT_NE(e.status().message().find((dir / "tokenizer.model").string()), std::string::npos)
      << e.status();
  EXPECT_NE(e.status().message().find("symbolic links"), std::string::npos) << e.status();
  eo.model_dir = (dir / std::string(300, 'd')).string();  // config.json says so first
  e = Engine::create(eo);
  EXPECT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("File name too long"), std::string::npos) << e.status();
}

// config.json is read first: one that is wrong is the error, before tokenizer.model is loaded
// (which takes seconds and ~25× the bytes of a large one; its error was the one shown, and an
// unreadable directory was blamed on the tokenizer).
TEST(Engine, TheConfigIsCheckedBeforeTheTokenizer) {
  const std::filesystem::path dir = testing_temp::fresh_dir("config_first");
  std::ofstream(dir / "config.json") << R"({"architecture": "cemlm"})";
  std::ofstream(dir / "tokenizer.model") << "not a tokenizer";
  EngineOptions eo;
  eo.model_dir = dir.string();
  auto e = Engine::create(eo);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("config"), std::string::npos) << e.status();
  EXPECT_EQ(e.status().message().find("tokenizer"), std::string::npos) << e.status();
}

// ---- text: streaming detokenization and stop strings (needs a real tokenizer) ----

class EngineText : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::filesystem::path dir = testing_temp::fresh_dir("engine_text");
    {
      std::ofstream f(dir / "corpus.txt");
      for (int i = 0; i < 30; ++i)
        f << "the quick brown fox jumps over the lazy dog. stop here and then go on.\n"
          << "hello world, the end is near; the end of the line is here.\n";
    }
    TokenizerTrainOptions o;
    o.inputs = {(dir / "corpus.txt").string()};
    o.vocab_size = 320;
    o.out_path = (dir / "tokenizer.model").string();
    std::string error;
    ASSERT_TRUE(train_tokenizer(o, &error)) << error;
    path_ = new std::string(o.out_path);
  }
  static std::unique_ptr<Tokenizer> load() {
    std::string error;
    auto t = Tokenizer::load(*path_, &error);
    EXPECT_TRUE(t) << error;
    return t;
  }
  // An engine whose greedy output after `prompt` is `script` (then anything).
  Built scripted(const std::vector<int>& prompt, const std::vector<int>& script) {
    auto tok = load();
    const int vocab = tok->vocab_size();
    const int start = int(prompt.size()) - 1;
    return build({.vocab = vocab,
                  .favorite = [script, start](int p) {
                    const int i = p - start;
                    return i >= 0 && i < int(script.size()) ? script[size_t(i)] : -1;
                  }},
                 {}, std::move(tok));
  }
  static std::string* path_;
};
std::string* EngineText::path_ = nullptr;

TEST_F(EngineText, StreamedTextIsTheDecodedContinuation) {
  auto tok = load();
  const auto prompt = encode_ok(*tok, "the quick brown");
  const auto script = encode_ok(*tok, " fox jumps over the lazy dog");
  Built b = scripted(prompt, script);
  auto r = request(prompt, int(script.size()));
  const Result res = run_all(*b.engine, {r})[0];
  EXPECT_EQ(res.ids, script);
  EXPECT_EQ(res.text, " fox jumps over the lazy dog");
  // Ended by a stop token: its own text is left out.
  ASSERT_GE(script.size(), 3u);
  ASSERT_EQ(std::count(script.begin(), script.begin() + 3, script[2]), 1);
  r.sampling.stop_token_ids = {script[2]};
  const Result stopped = run_all(*b.engine, {r})[0];
  EXPECT_EQ(stopped.reason, FinishReason::kStop);
  EXPECT_EQ(stopped.ids, std::vector<int>(script.begin(), script.begin() + 3));
  EXPECT_EQ(stopped.text, tok->decode(std::vector<int>(script.begin(), script.begin() + 2)));
  EXPECT_FALSE(stopped.text.empty());
}

TEST_F(EngineText, StopStringsSpanningTokensCutTheText) {
  auto tok = load();
  const auto prompt = encode_ok(*tok, "hello");
  const std::string continuation = " world, the end is near; the end of the line";
  const auto script = encode_ok(*tok, continuation);
  // "d is n" is split across tokens (no single piece holds it).
  const std::string stop = "d is n";
  bool spans = true;
  for (int id : script) spans &= tok->decode(std::vector<int>{id}).find(stop) == std::string::npos;
  ASSERT_TRUE(spans);
  Built b = scripted(prompt, script);
  auto r = request(prompt, int(script.size()));
  r.sampling.stop = {"no such text", stop};
  const Result res = run_all(*b.engine, {r})[0];
  EXPECT_EQ(res.reason, FinishReason::kStop);
  EXPECT_EQ(res.text, " world, the en");
  EXPECT_LT(res.ids.size(), script.size());
  // Held-back text that turns out not to be a stop string is released.
  r.sampling.stop = {"the end of the page"};
  const Result full = run_all(*b.engine, {r})[0];
  EXPECT_EQ(full.reason, FinishReason::kLength);
  EXPECT_EQ(full.text, continuation);
  // The text ends in "line", which may start a stop string: held back, then released when the
  // request ends at max_new_tokens.
  r.sampling.stop = {"line is here"};
  const Result held = run_all(*b.engine, {r})[0];
  EXPECT_EQ(held.reason, FinishReason::kLength);
  EXPECT_EQ(held.text, continuation);
}

}  // namespace
}  // namespace cemlm
