// `cemlm bench-serve` against a scripted server: what it reports of streams that fail part-way,
// and requests that could not fit the model's context.
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "cemlm/v1/inference.grpc.pb.h"
#include "server_process.h"

namespace cemlm::testing_server {
namespace {

// Answers GetModelInfo (a context of 64 tokens), and Generate with two one-token messages, then:
// for an even request
// ("bench-0", "bench-2", ...) INTERNAL, for an odd one a last message with a third token and
// FINISH_REASON_LENGTH.
class ScriptedInference final : public v1::Inference::Service {
  grpc::Status GetModelInfo(grpc::ServerContext*, const v1::GetModelInfoRequest*,
                            v1::ModelInfo* info) override {
    info->set_vocab_size(100);
    info->set_max_context(64);
    info->set_default_recursion_depth(3);
    return grpc::Status::OK;
  }
  grpc::Status Generate(grpc::ServerContext*, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    v1::GenerateResponse token;
    token.add_token_ids(7);
    for (int i = 0; i < 2; ++i) writer->Write(token);
    const int index = std::stoi(request->request_id().substr(std::string("bench-").size()));
    if (index % 2 == 0) return grpc::Status(grpc::StatusCode::INTERNAL, "scripted failure");
    token.set_finish_reason(v1::FINISH_REASON_LENGTH);
    token.mutable_timing()->set_e2e_seconds(0.001);
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
  void TearDown() override {
    if (server_) server_->Shutdown();
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
