// Random traffic against a real `cemlm serve` with a KV cache of two and a half sequences (and a
// queue long enough that none is refused): generations that run to the end, are cancelled by the
// client after a few messages or hit a short deadline, scoring, and invalid requests, from eight
// clients at once. Every call must end the way its kind allows, a seeded request must stream the
// same tokens whatever else runs (preemption resumes it exactly), and afterwards nothing may be
// left running, waiting or holding cache blocks; a SIGTERM in the middle of the traffic still
// exits 0.
#include <gtest/gtest.h>

#include <atomic>
#include <csignal>
#include <iostream>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "client_util.h"
#include "server_process.h"

namespace cemlm::testing_server {
namespace {

using namespace std::chrono_literals;
using grpc::StatusCode;

constexpr int kVocab = 400, kMaxSeq = 128, kMaxT = 8;

// The seeded sampled request every client also sends, against the answer it gets alone.
v1::GenerateRequest reference_request() {
  v1::GenerateRequest req = ids_request({5, 17, 99, 250, 3, 3, 42}, 40, 3);
  req.set_logprobs(true);
  auto* s = req.mutable_sampling();
  s->set_temperature(0.9f);
  s->set_top_p(0.9f);
  s->set_repetition_penalty(1.2f);
  s->set_seed(1234);
  return req;
}

v1::GenerateRequest random_request(std::mt19937_64& rng) {
  auto pick = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<int> ids(size_t(pick(1, 100)));
  for (int& t : ids) t = pick(0, kVocab - 1);
  v1::GenerateRequest req = ids_request(ids, pick(1, kMaxSeq - int(ids.size())), pick(0, kMaxT));
  req.set_logprobs(pick(0, 1) == 1);
  req.set_priority(pick(-1, 1));
  auto* s = req.mutable_sampling();
  s->set_temperature(pick(0, 2) > 0 ? float(pick(1, 20)) / 10.0f : 0.0f);  // a third greedy
  if (pick(0, 2) == 0) s->set_top_k(pick(1, 500));
  if (pick(0, 2) == 0) s->set_top_p(float(pick(5, 100)) / 100.0f);
  if (pick(0, 3) == 0) s->set_min_p(float(pick(0, 30)) / 100.0f);
  if (pick(0, 3) == 0) s->set_frequency_penalty(float(pick(-10, 10)) / 10.0f);
  if (pick(0, 3) == 0) s->add_stop_token_ids(pick(0, kVocab - 1));
  if (req.logprobs() && pick(0, 3) == 0) s->set_top_logprobs(pick(1, 20));
  s->set_seed(rng());
  return req;
}

// One of the invalid requests the server must refuse with INVALID_ARGUMENT.
v1::GenerateRequest invalid_request(std::mt19937_64& rng) {
  v1::GenerateRequest req = ids_request({7, 8, 9}, 4);
  switch (rng() % 6) {
    case 0:
      req.set_recursion_depth(kMaxT + 1);
      break;
    case 1:
      req.add_prompt_ids(kVocab);
      break;
    case 2:
      req.mutable_sampling()->set_top_p(0.0f);
      break;
    case 3:
      req.mutable_sampling()->set_temperature(-1.0f);
      break;
    case 4:
      req.mutable_sampling()->set_max_new_tokens(kMaxSeq);
      break;  // 3 + 128 > max_seq_len
    default:
      req.set_logprobs(true);
      req.mutable_sampling()->set_top_logprobs(21);
      break;
  }
  return req;
}

// Reads a whole stream, cancelling it after `cancel_after` messages when that is ≥ 0.
Stream read_stream(const std::shared_ptr<grpc::Channel>& channel, const v1::GenerateRequest& req,
                   std::chrono::milliseconds timeout, int cancel_after) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  auto reader = v1::Inference::NewStub(channel)->Generate(&context, req);
  Stream s;
  for (v1::GenerateResponse m; reader->Read(&m);) {
    s.messages.push_back(m);
    if (cancel_after >= 0 && int(s.messages.size()) > cancel_after) context.TryCancel();
  }
  s.status = reader->Finish();
  return s;
}

// What a stream that ended OK must look like: one final message, last, with the usage filled.
void expect_complete(const Stream& s, const v1::GenerateRequest& req, const std::string& what) {
  ASSERT_FALSE(s.messages.empty()) << what;
  for (size_t i = 0; i < s.messages.size(); ++i)
    EXPECT_EQ(s.messages[i].finish_reason() != v1::FINISH_REASON_UNSPECIFIED,
              i + 1 == s.messages.size())
        << what << ": message " << i;
  const auto& last = s.messages.back();
  EXPECT_EQ(last.usage().generated_tokens(), int(s.ids().size())) << what;
  EXPECT_LE(int(s.ids().size()), req.sampling().max_new_tokens()) << what;
  EXPECT_EQ(last.usage().prompt_tokens(), req.prompt_ids_size()) << what;
  for (const auto& m : s.messages)
    EXPECT_EQ(m.logprobs_size(), req.logprobs() ? m.token_ids_size() : 0) << what;
}

struct Tally {
  std::mutex mu;
  std::map<std::string, int> counts;
  void add(const std::string& k) {
    std::lock_guard<std::mutex> lock(mu);
    ++counts[k];
  }
};

// One client's share of the storm: `calls` calls of random kinds.
void client(const ServerProcess& server, uint64_t seed, int calls, const Stream& reference,
            Tally* tally) {
  std::mt19937_64 rng(seed);
  const auto channel = server.channel();
  for (int c = 0; c < calls; ++c) {
    const std::string what = "client " + std::to_string(seed) + " call " + std::to_string(c);
    const int kind = int(rng() % 10);
    if (kind < 4) {  // to the end
      const v1::GenerateRequest req = random_request(rng);
      const Stream s = read_stream(channel, req, 120s, -1);
      ASSERT_TRUE(s.status.ok()) << what << ": " << s.status.error_message();
      expect_complete(s, req, what);
      tally->add("complete");
    } else if (kind < 6) {  // cancelled by the client after a few messages
      const Stream s = read_stream(channel, random_request(rng), 120s, int(rng() % 4));
      const StatusCode code = s.status.error_code();
      EXPECT_TRUE(code == StatusCode::CANCELLED || code == StatusCode::OK)
          << what << ": " << code << " " << s.status.error_message();
      tally->add("cancelled");
    } else if (kind < 7) {  // a deadline that may come first
      const Stream s =
          read_stream(channel, random_request(rng), std::chrono::milliseconds(5 + rng() % 200), -1);
      const StatusCode code = s.status.error_code();
      EXPECT_TRUE(code == StatusCode::DEADLINE_EXCEEDED || code == StatusCode::OK)
          << what << ": " << code << " " << s.status.error_message();
      tally->add("deadline");
    } else if (kind < 8) {  // scoring
      v1::ScoreRequest req;
      const int n = 2 + int(rng() % (kMaxSeq - 1));
      for (int i = 0; i < n; ++i) req.add_ids(int(rng() % kVocab));
      req.set_recursion_depth(int(rng() % (kMaxT + 1)));
      v1::ScoreResponse resp;
      const grpc::Status st = score(channel, req, &resp, {"", 120s});
      ASSERT_TRUE(st.ok()) << what << ": " << st.error_message();
      EXPECT_EQ(resp.logprobs_size(), n - 1) << what;
      tally->add("score");
    } else if (kind < 9) {  // invalid
      const v1::GenerateRequest req = invalid_request(rng);
      const Stream s = read_stream(channel, req, 30s, -1);
      EXPECT_EQ(s.status.error_code(), StatusCode::INVALID_ARGUMENT)
          << what << ": " << req.DebugString();
      tally->add("invalid");
    } else {  // the seeded reference, among everything else
      const Stream s = read_stream(channel, reference_request(), 120s, -1);
      ASSERT_TRUE(s.status.ok()) << what << ": " << s.status.error_message();
      EXPECT_EQ(s.ids(), reference.ids()) << what;
      ASSERT_EQ(s.messages.back().finish_reason(), reference.messages.back().finish_reason());
      std::vector<float> got, want;
      for (const auto& m : s.messages)
        got.insert(got.end(), m.logprobs().begin(), m.logprobs().end());
      for (const auto& m : reference.messages)
        want.insert(want.end(), m.logprobs().begin(), m.logprobs().end());
      ASSERT_EQ(got.size(), want.size()) << what;
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_NEAR(got[i], want[i], 1e-4) << what << " token " << i;
      tally->add("reference");
    }
  }
}

class ServerStorm : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = make_tiny_model(fresh_temp_dir(), {.max_seq_len = kMaxSeq, .tokenizer = false});
    // 512 bytes of cache a token: 160K holds 320 tokens, two and a half full sequences.
    server_ = ServerProcess::start(model_, {"--kv-cache-memory", "160K", "--max-waiting", "64",
                                            "--max-batch-tokens", "48", "--shutdown-timeout", "1"});
    ASSERT_TRUE(server_);
    reference_ = read_stream(server_->channel(), reference_request(), 60s, -1);
    ASSERT_TRUE(reference_.status.ok()) << reference_.status.error_message();
  }
  void storm(int clients, int calls, Tally* tally) {
    std::vector<std::thread> threads;
    for (int i = 0; i < clients; ++i)
      threads.emplace_back(
          [&, i] { client(*server_, 1000 + uint64_t(i), calls, reference_, tally); });
    for (std::thread& t : threads) t.join();
  }
  std::string model_;
  std::unique_ptr<ServerProcess> server_;
  Stream reference_;
};

TEST_F(ServerStorm, RandomTrafficLeavesNothingBehind) {
  Tally tally;
  storm(8, 60, &tally);
  for (const auto& [kind, n] : tally.counts) std::cout << kind << ": " << n << " calls\n";
  for (const char* kind : {"complete", "cancelled", "deadline", "score", "invalid", "reference"})
    EXPECT_GT(tally.counts[kind], 0) << "the storm never made a call of kind " << kind;
  EXPECT_TRUE(wait_for_metrics(*server_, [](const auto& m) {
    return metric(m, "cemlm:num_requests_running") == 0 &&
           metric(m, "cemlm:num_requests_waiting") == 0 &&
           metric(m, "cemlm:kv_cache_usage_perc") == 0;
  })) << server_->metrics_text();
  // The cache is small enough that the traffic had to preempt (else the test checks less).
  EXPECT_GT(metric(parse_metrics(server_->metrics_text()), "cemlm:num_preemptions_total"), 0)
      << server_->metrics_text();
  const Stream after = read_stream(server_->channel(), reference_request(), 60s, -1);
  EXPECT_EQ(after.ids(), reference_.ids());
}

TEST_F(ServerStorm, SigtermDuringTrafficExitsZero) {
  // Clients keep streaming (some cancelling) until the server stops answering; every call ends
  // with a status a draining server may give.
  std::atomic<bool> stopped = false;
  std::vector<std::thread> clients;
  for (int i = 0; i < 6; ++i)
    clients.emplace_back([&, i] {
      std::mt19937_64 rng(2000 + uint64_t(i));
      while (!stopped) {
        const Stream s = read_stream(server_->channel(), random_request(rng), 60s,
                                     rng() % 3 == 0 ? int(rng() % 4) : -1);
        const StatusCode code = s.status.error_code();
        EXPECT_TRUE(code == StatusCode::OK || code == StatusCode::CANCELLED ||
                    code == StatusCode::UNAVAILABLE || code == StatusCode::RESOURCE_EXHAUSTED)
            << code << " " << s.status.error_message();
        if (code == StatusCode::UNAVAILABLE) stopped = true;
      }
    });
  std::this_thread::sleep_for(1500ms);
  server_->signal(SIGTERM);
  EXPECT_EQ(server_->wait_exit(30s), 0) << server_->log();
  stopped = true;
  for (std::thread& t : clients) t.join();
}

}  // namespace
}  // namespace cemlm::testing_server
