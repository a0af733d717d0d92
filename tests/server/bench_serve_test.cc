// `cemlm bench-serve` against a scripted server: what it reports of streams that fail part-way,
// requests that could not fit the model's context or its recursion depths, the prompts' seed and
// the prefix cache's share, a server gone silent, and Ctrl-C; with `cemlm client generate`, a
// stream message that does not parse.
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "cemlm/v1/inference.grpc.pb.h"
#include "server_process.h"

namespace cemlm::testing_server {
namespace {

// Answers GetModelInfo (a context of 64 tokens, recursion depths up to 4), and Generate with two
// one-token messages, then: for an even request ("bench-0", "bench-2", ...) INTERNAL, for an odd
// one a last message with a third token, FINISH_REASON_LENGTH and usage (1 prompt token cached).
// A prompt of kSilentLen tokens gets the two messages and then nothing until it is cancelled (a
// server gone silent), counted in `silent`. One of kSlowLen: "bench-0" waits 1.5 s for its first
// message (queued, or a long prefill), the others get a token every 100 ms for 1.5 s. One of
// kGarbledLen gets a message whose text is not UTF-8 (no GenerateResponse parses from it), then
// 64 tokens and a final message: counted in `garbled_ended`. One of kClosedLen ends, after its two
// messages, UNAVAILABLE "Socket closed" (as a server killed mid-stream).
constexpr int kSilentLen = 5, kSlowLen = 6, kGarbledLen = 7, kClosedLen = 8;
class ScriptedInference final : public v1::Inference::Service {
 public:
  std::atomic<int> silent{0};
  std::atomic<int> garbled_ended{0};

 private:
  grpc::Status GetModelInfo(grpc::ServerContext*, const v1::GetModelInfoRequest*,
                            v1::ModelInfo* info) override {
    info->set_vocab_size(100);
    info->set_max_context(64);
    info->set_default_recursion_depth(3);
    info->set_max_recursion_depth(4);
    return grpc::Status::OK;
  }
  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    v1::GenerateResponse token;
    token.add_token_ids(7);
    for (int i = 0; i < 2; ++i) writer->Write(token);
    if (request->prompt_ids_size() == kSilentLen) {
      ++silent;
      while (!context->IsCancelled()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    }
    if (request->prompt_ids_size() == kGarbledLen) {
      v1::GenerateResponse garbled;
      garbled.set_text("\xff\xfe");
      writer->Write(garbled);
      for (int i = 0; i < 64; ++i) writer->Write(token);
      token.set_finish_reason(v1::FINISH_REASON_LENGTH);
      writer->Write(token);
      ++garbled_ended;
      return grpc::Status::OK;
    }
    if (request->prompt_ids_size() == kClosedLen)
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "Socket closed");
    const int index = std::stoi(request->request_id().substr(std::string("bench-").size()));
    if (request->prompt_ids_size() == kSlowLen) {
      for (int i = 0; i < 15; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        if (index > 0) writer->Write(token);
      }
      token.set_finish_reason(v1::FINISH_REASON_LENGTH);
      writer->Write(token);
      return grpc::Status::OK;
    }
    if (index % 2 == 0) return grpc::Status(grpc::StatusCode::INTERNAL, "scripted failure");
    token.set_finish_reason(v1::FINISH_REASON_LENGTH);
    token.mutable_timing()->set_e2e_seconds(0.001);
    token.mutable_usage()->set_prompt_tokens(request->prompt_ids_size());
    token.mutable_usage()->set_cached_prompt_tokens(1);
    writer->Write(token);
    return grpc::Status::OK;
  }
};

// A failed stream's tokens and timings are not those of an answer: of 8 requests, the 4 that
// fail after two tokens each count as errors only, and every latency row holds the 4 answers'
// samples alone (one first token and two inter-token gaps each), not the failed streams' partial
// ones.
class BenchServe : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_TRUE(server_ && port_ > 0);
  }
  void TearDown() override {  // the silent handlers end once their calls are cancelled
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  // bench-serve against it, 2 streams of 3 new tokens and prompts of `prompt_len` at a time;
  // returns the exit code, the output in *out.
  int bench_scripted(int requests, int prompt_len, const char* stall_timeout, std::string* out) {
    return run_cemlm(
        {"bench-serve", "--addr", "127.0.0.1:" + std::to_string(port_), "--concurrency", "2",
         "--requests", std::to_string(requests), "--max-new-tokens", "3", "--prompt-len",
         std::to_string(prompt_len), "--stall-timeout", stall_timeout},
        out);
  }
  ScriptedInference service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(BenchServe, StreamsThatFailPartWayAreLeftOutOfTheLatencies) {
  const int port = port_;
  std::string out;
  EXPECT_EQ(run_cemlm({"bench-serve", "--addr", "127.0.0.1:" + std::to_string(port),
                       "--concurrency", "2", "--requests", "8", "--max-new-tokens", "3"},
                      &out),
            1);  // errors: exit 1
  EXPECT_NE(out.find("ok 4  errors 4  INTERNAL=4"), std::string::npos) << out;
  // Without --recursion, the T the server runs: its model's default, not "0".
  EXPECT_NE(out.find("  T 3 (the model's default)  "), std::string::npos) << out;
  EXPECT_NE(out.find("INTERNAL, first: scripted failure"), std::string::npos) << out;
  // The last column of each row is its sample count.
  auto count_of = [&](const std::string& row) {
    const size_t at = out.find(row);
    if (at == std::string::npos) return std::string("missing");
    const size_t end = out.find('\n', at);
    const std::string line = out.substr(at, end - at);
    return line.substr(line.find_last_of(' ') + 1);
  };
  EXPECT_EQ(count_of("ttft"), "4") << out;
  EXPECT_EQ(count_of("inter-token"), "8") << out;
  EXPECT_EQ(count_of("e2e (client)"), "4") << out;
  // The answers' prompt tokens (32 each) and those the prefix cache served (1 each).
  EXPECT_NE(out.find("prompt tokens 128, of which served from the prefix cache 4"),
            std::string::npos)
      << out;
}

// A --recursion outside the model's depths would make every request an error: refused before any
// is sent, naming the flag (the header called -1 the model's default).
TEST_F(BenchServe, ARecursionTheModelDoesNotRunIsRefusedUpFront) {
  const std::string addr = "127.0.0.1:" + std::to_string(port_);
  for (const char* T : {"5", "-1"}) {
    std::string out, err;
    EXPECT_EQ(run_cemlm({"bench-serve", "--addr", addr, "--requests", "2", "--max-new-tokens", "3",
                         "--recursion", T},
                        &out, &err),
              2);
    EXPECT_NE(err.find(std::string("--recursion ") + T + " is outside [0, 4]"), std::string::npos)
        << err;
    EXPECT_EQ(out, "");
  }
}

// The prompts' seed is drawn unless given, and printed: the same seed twice sends the same
// prompts, which a real server's prefix cache then serves (a sweep measured cached prefills).
TEST_F(BenchServe, ThePromptsSeedIsDrawnAndPrinted) {
  const std::string addr = "127.0.0.1:" + std::to_string(port_);
  auto seed_of = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {"bench-serve", "--addr",           addr, "--requests",
                                     "2",           "--max-new-tokens", "3"};
    args.insert(args.end(), extra.begin(), extra.end());
    std::string out;
    run_cemlm(args, &out);
    const size_t at = out.find("  seed ");
    return at == std::string::npos ? std::string("none")
                                   : out.substr(at + 7, out.find('\n', at) - at - 7);
  };
  EXPECT_EQ(seed_of({"--seed", "42"}), "42");
  const std::string a = seed_of({}), b = seed_of({});
  EXPECT_NE(a, "none");
  EXPECT_NE(a, b);  // 2^-32 to fail by chance
  // --help says so, and no "(default: 0)" after it (nor "(default: 1)" after --connections',
  // computed from --concurrency).
  std::string help;
  EXPECT_EQ(run_cemlm({"bench-serve", "--help"}, &help), 0);
  for (const char* flag : {"--seed N\n", "--connections N\n"}) {
    const size_t at = help.find(flag);
    ASSERT_NE(at, std::string::npos) << flag << help;
    const std::string block = help.substr(at, help.find("\n  --", at + 1) - at);
    EXPECT_NE(block.find("default: "), std::string::npos) << block;
    EXPECT_EQ(block.find("(default: 0)"), std::string::npos) << block;
    EXPECT_EQ(block.find("(default: 1)"), std::string::npos) << block;
  }
}

// More streams than the connections carry (the server runs 1,000 at once on one) would wait in the
// client, their wait counted as server overhead: refused when --connections is given.
TEST_F(BenchServe, MoreStreamsThanTheConnectionsCarryAreRefused) {
  std::string out, err;
  EXPECT_EQ(run_cemlm({"bench-serve", "--addr", "127.0.0.1:" + std::to_string(port_),
                       "--concurrency", "1001", "--requests", "1001", "--connections", "1"},
                      &out, &err),
            2);
  EXPECT_NE(err.find("--concurrency 1001 is more streams than --connections 1 carry"),
            std::string::npos)
      << err;
}

// A stream with no message for --stall-timeout (a server stopped, its host lost) ends the run
// with what completed, the streams in flight counted STALLED: it waited forever.
TEST_F(BenchServe, AServerGoneSilentStopsTheRun) {
  std::string out;
  EXPECT_EQ(bench_scripted(6, kSilentLen, "1", &out), 1);
  EXPECT_NE(out.find("ok 0  errors 2  STALLED=2"), std::string::npos) << out;
  EXPECT_NE(out.find("run stopped: 4 requests never sent"), std::string::npos) << out;
  EXPECT_EQ(service_.silent.load(), 2);
}

// Not one stream's silence: a request queued behind others, or in a long prefill, waits for its
// first message while the server answers the rest (it was counted STALLED, with every working
// stream, and the run ended).
TEST_F(BenchServe, AStreamWaitingWhileOthersAreAnsweredIsNoStall) {
  std::string out;
  EXPECT_EQ(bench_scripted(2, kSlowLen, "1", &out), 0);
  EXPECT_NE(out.find("ok 2  errors 0"), std::string::npos) << out;
}

// A message that does not parse ends its call at once, cancelled, as INTERNAL: gRPC's own parse
// ended the read as the stream's end would, and the client waited forever for a status behind
// the messages the server went on sending (bench-serve counted such a stream STALLED at its
// --stall-timeout, a server silent no more).
TEST_F(BenchServe, AMessageThatDoesNotParseEndsTheCall) {
  const std::string addr = "127.0.0.1:" + std::to_string(port_);
  std::string out, err;
  EXPECT_EQ(run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "1,2,3,4,5,6,7",
                       "--json", "--timeout", "20"},
                      &out, &err),
            1);
  EXPECT_NE(err.find("error: INTERNAL: a message of the server's Generate stream does not parse"),
            std::string::npos)
      << err;
  EXPECT_EQ(bench_scripted(2, kGarbledLen, "10", &out), 1);
  EXPECT_NE(out.find("ok 0  errors 2  INTERNAL=2"), std::string::npos) << out;
  EXPECT_NE(out.find("INTERNAL, first: a message of the server's Generate stream does not parse"),
            std::string::npos)
      << out;
  EXPECT_EQ(service_.garbled_ended.load(), 3);
}

// A connection closed after the server answered is not a plaintext client refused by a TLS
// server: no hint to add --tls-ca (the server killed mid-stream got one).
TEST_F(BenchServe, AStreamClosedAfterAnswersGetsNoTlsHint) {
  std::string out, err;
  EXPECT_EQ(run_cemlm({"client", "generate", "--addr", "127.0.0.1:" + std::to_string(port_),
                       "--prompt-ids", "1,2,3,4,5,6,7,8", "--json"},
                      &out, &err),
            1);
  EXPECT_NE(err.find("error: UNAVAILABLE: Socket closed\n"), std::string::npos) << err;
  EXPECT_EQ(err.find("--tls-ca"), std::string::npos) << err;
}

// Ctrl-C stops the run: the streams in flight are cancelled, no more are sent, and the report of
// what completed is printed (it was lost with the process); exit 130.
TEST_F(BenchServe, CtrlCReportsWhatCompleted) {
  CemlmRun run({"bench-serve", "--addr", "127.0.0.1:" + std::to_string(port_), "--concurrency", "2",
                "--requests", "6", "--max-new-tokens", "3", "--prompt-len",
                std::to_string(kSilentLen), "--stall-timeout", "60"});  // a backstop
  ASSERT_GT(run.pid(), 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (service_.silent.load() < 2 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_EQ(service_.silent.load(), 2);
  ASSERT_EQ(::kill(run.pid(), SIGINT), 0);
  std::string out;
  EXPECT_EQ(run.wait(&out), 130);
  EXPECT_NE(out.find("ok 0  errors 0"), std::string::npos) << out;
  EXPECT_NE(out.find("run stopped: 4 requests never sent (Ctrl-C; 2 streams cancelled)"),
            std::string::npos)
      << out;
}

// A prompt and a generation that cannot fit the model's context would make every request an
// error: refused before any is sent, naming both flags and the context.
TEST_F(BenchServe, RequestsLongerThanTheContextAreRefusedUpFront) {
  const std::string addr = "127.0.0.1:" + std::to_string(port_);
  std::string out, err;
  EXPECT_EQ(run_cemlm({"bench-serve", "--addr", addr, "--requests", "2", "--prompt-len", "60",
                       "--max-new-tokens", "8"},
                      &out, &err),
            2);
  EXPECT_NE(err.find("--prompt-len 60 + --max-new-tokens 8 exceeds the model's context of 64"),
            std::string::npos)
      << err;
  // Exactly the context is fine (the scripted answers are then counted).
  EXPECT_EQ(run_cemlm({"bench-serve", "--addr", addr, "--requests", "2", "--prompt-len", "61",
                       "--max-new-tokens", "3"},
                      &out),
            1);  // the scripted server fails one of the two
  EXPECT_NE(out.find("ok 1  errors 1"), std::string::npos) << out;
}

}  // namespace
}  // namespace cemlm::testing_server
