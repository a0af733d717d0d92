// Every bad input gets INVALID_ARGUMENT with a message naming the field, counted in
// cemlm:request_errors_total{code="INVALID_ARGUMENT"}; API keys on and off; TLS.
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509v3.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "client_util.h"
#include "server_process.h"
#include "tokenizer_util.h"

namespace cemlm::testing_server {
namespace {

using Mutate = std::function<void(v1::GenerateRequest*)>;

struct BadGenerate {
  const char* name;
  Mutate mutate;
  const char* expected;  // a substring of the error message
};

v1::GenerateRequest valid_request() {
  v1::GenerateRequest req;
  req.set_prompt_text("Hello there");
  req.mutable_sampling()->set_max_new_tokens(4);
  return req;
}

class ServerValidation : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = new std::string(make_tiny_model(fresh_temp_dir()));
    server_ = ServerProcess::start(*model_).release();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete model_;
  }
  void SetUp() override { ASSERT_TRUE(server_); }
  static std::string* model_;
  static ServerProcess* server_;
};
std::string* ServerValidation::model_ = nullptr;
ServerProcess* ServerValidation::server_ = nullptr;

TEST_F(ServerValidation, EveryBadGenerateInputNamesItsField) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<BadGenerate> cases = {
      {"empty prompt", [](auto* r) { r->clear_prompt_text(); }, "prompt_text or prompt_ids"},
      {"text and ids", [](auto* r) { r->add_prompt_ids(5); }, "prompt_text and prompt_ids"},
      {"add_bos with ids",
       [](auto* r) {
         r->clear_prompt_text();
         r->add_prompt_ids(5);
         r->set_add_bos(true);
       },
       "add_bos applies to prompt_text only"},
      {"invalid UTF-8", [](auto* r) { r->set_prompt_text("ok \xC3\x28 no"); },
       "prompt_text is not valid UTF-8"},
      {"long request_id", [](auto* r) { r->set_request_id(std::string(257, 'r')); },
       "request_id is 257 bytes; at most 256"},
      {"id out of range",
       [](auto* r) {
         r->clear_prompt_text();
         r->add_prompt_ids(5);
         r->add_prompt_ids(400);
       },
       "prompt_ids[1]"},
      {"negative id",
       [](auto* r) {
         r->clear_prompt_text();
         r->add_prompt_ids(-1);
       },
       "prompt_ids[0]"},
      {"oversize prompt",
       [](auto* r) {
         r->clear_prompt_text();
         for (int i = 0; i < 513; ++i) r->add_prompt_ids(7);
       },
       "prompt_ids has 513 tokens"},
      {"oversize prompt text",  // named as the client sent it, not as the ids it became
       [](auto* r) {
         std::string text;
         for (int i = 0; i < 600; ++i) text += "word" + std::to_string(i) + " ";
         r->set_prompt_text(text);
       },
       "prompt_text (as tokens, BOS included) has "},
      {"prompt text far beyond the context",  // refused by its length, before it is tokenized
       [](auto* r) {
         std::string text;
         while (text.size() < 300000) text += "ab cd ";
         r->set_prompt_text(text);
       },
       "prompt_text is 300000 bytes, more than the model's max_seq_len = 512 tokens can hold"},
      {"T above max", [](auto* r) { r->set_recursion_depth(9); },
       "recursion_depth = 9 exceeds the model's recursion.max = 8"},
      {"negative T", [](auto* r) { r->set_recursion_depth(-1); }, "recursion_depth"},
      {"NaN top_p", [&](auto* r) { r->mutable_sampling()->set_top_p(nan); }, "sampling.top_p"},
      {"top_p above 1", [](auto* r) { r->mutable_sampling()->set_top_p(1.5f); }, "sampling.top_p"},
      {"zero top_p", [](auto* r) { r->mutable_sampling()->set_top_p(0); }, "sampling.top_p"},
      {"NaN temperature", [&](auto* r) { r->mutable_sampling()->set_temperature(nan); },
       "sampling.temperature"},
      {"negative temperature", [](auto* r) { r->mutable_sampling()->set_temperature(-1); },
       "sampling.temperature"},
      {"negative top_k", [](auto* r) { r->mutable_sampling()->set_top_k(-1); }, "sampling.top_k"},
      {"min_p above 1", [](auto* r) { r->mutable_sampling()->set_min_p(2); }, "sampling.min_p"},
      {"zero repetition penalty", [](auto* r) { r->mutable_sampling()->set_repetition_penalty(0); },
       "sampling.repetition_penalty"},
      {"a prompt that fills the context, max_new_tokens unset",
       [](auto* r) {
         r->clear_prompt_text();
         r->mutable_sampling()->clear_max_new_tokens();
         for (int i = 0; i < 512; ++i) r->add_prompt_ids(7);
       },
       "prompt_ids has 512 tokens: the model's max_seq_len = 512 leaves no room to generate"},
      {"a prompt beyond the context, max_new_tokens unset",
       [](auto* r) {
         r->clear_prompt_text();
         r->mutable_sampling()->clear_max_new_tokens();
         for (int i = 0; i < 513; ++i) r->add_prompt_ids(7);
       },
       "prompt_ids has 513 tokens: the model's max_seq_len = 512 leaves no room to generate"},
      {"min_new_tokens beyond the room the prompt leaves, max_new_tokens unset",
       [](auto* r) {
         r->clear_prompt_text();
         r->mutable_sampling()->clear_max_new_tokens();
         r->mutable_sampling()->set_min_new_tokens(20);
         for (int i = 0; i < 500; ++i) r->add_prompt_ids(7);
       },
       "sampling.min_new_tokens = 20 is more than the 12 tokens generated at most with "
       "sampling.max_new_tokens unset (the room the prompt leaves under max_seq_len = 512)"},
      {"min_new_tokens beyond the default max_new_tokens",
       [](auto* r) {
         r->mutable_sampling()->clear_max_new_tokens();
         r->mutable_sampling()->set_min_new_tokens(100);
       },
       "sampling.min_new_tokens = 100 is more than the 64 tokens generated at most with "
       "sampling.max_new_tokens unset (its default)"},
      {"max_new_tokens beyond the context",
       [](auto* r) { r->mutable_sampling()->set_max_new_tokens(600); }, "sampling.max_new_tokens"},
      {"negative max_new_tokens", [](auto* r) { r->mutable_sampling()->set_max_new_tokens(-3); },
       "sampling.max_new_tokens"},
      {"too many stop strings",
       [](auto* r) {
         for (int i = 0; i < 17; ++i) r->mutable_sampling()->add_stop("x" + std::to_string(i));
       },
       "sampling.stop"},
      {"stop string not UTF-8", [](auto* r) { r->mutable_sampling()->add_stop("\xFF"); },
       "sampling.stop[0]"},
      {"stop id out of range", [](auto* r) { r->mutable_sampling()->add_stop_token_ids(999); },
       "sampling.stop_token_ids[0]"},
      {"too many top logprobs",
       [](auto* r) {
         r->set_logprobs(true);
         r->mutable_sampling()->set_top_logprobs(21);
       },
       "sampling.top_logprobs"},
      {"top logprobs without logprobs", [](auto* r) { r->mutable_sampling()->set_top_logprobs(3); },
       "sampling.top_logprobs = 3 needs logprobs: true"},
      {"min_new_tokens above max_new_tokens",
       [](auto* r) { r->mutable_sampling()->set_min_new_tokens(5); },
       "sampling.min_new_tokens must be in [0, sampling.max_new_tokens = 4] (got 5)"},
      {"logit_bias key out of range",
       [](auto* r) { (*r->mutable_sampling()->mutable_logit_bias())[999] = 1; },
       "sampling.logit_bias has the key 999"},
      {"logit_bias beyond 100",
       [](auto* r) { (*r->mutable_sampling()->mutable_logit_bias())[7] = -101; },
       "sampling.logit_bias[7] must be in [-100, 100] (got -101)"},
      // The lowest bad key is named, whatever order the map arrives in.
      {"two logit_bias keys out of range",
       [](auto* r) {
         for (int id : {2000, 999, 1500}) (*r->mutable_sampling()->mutable_logit_bias())[id] = 1;
       },
       "sampling.logit_bias has the key 999"},
  };
  for (const BadGenerate& c : cases) {
    v1::GenerateRequest req = valid_request();
    c.mutate(&req);
    const Stream s = generate(server_->channel(), req);
    EXPECT_EQ(s.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.name;
    EXPECT_NE(s.status.error_message().find(c.expected), std::string::npos)
        << c.name << ": '" << s.status.error_message() << "' does not name " << c.expected;
    EXPECT_TRUE(s.messages.empty()) << c.name;
  }
  const auto m = parse_metrics(server_->metrics_text());
  EXPECT_EQ(metric(m, "cemlm:request_errors_total", "code=\"INVALID_ARGUMENT\""),
            double(cases.size()));
  // The valid request itself goes through.
  EXPECT_TRUE(generate(server_->channel(), valid_request()).status.ok());
}

TEST_F(ServerValidation, BadScoreTokenizeDetokenizeInputsNameTheirField) {
  auto stub = v1::Inference::NewStub(server_->channel());
  struct Case {
    const char* name;
    v1::ScoreRequest req;
    const char* expected;
  };
  std::vector<Case> cases(6);
  cases[0] = {"empty",
              {},
              "text or ids is required (the input is empty; an empty text cannot be "
              "told from none: a Score needs at least 2 tokens)"};
  cases[1].name = "one token";
  cases[1].req.add_ids(5);
  cases[1].expected = "ids has 1 token";
  cases[2].name = "bad UTF-8";
  cases[2].req.set_text("\xE2\x82");
  cases[2].expected = "text is not valid UTF-8";
  cases[3].name = "T above max";
  cases[3].req.set_text("Hello there");
  cases[3].req.set_recursion_depth(12);
  cases[3].expected = "recursion_depth = 12";
  cases[4].name = "text beyond the context";
  for (int i = 0; i < 600; ++i) cases[4].req.mutable_text()->append("word" + std::to_string(i) + " ");
  cases[4].expected = "text (as tokens, BOS included) has ";
  cases[5].name = "add_bos with ids";
  cases[5].req.add_ids(5);
  cases[5].req.add_ids(6);
  cases[5].req.set_add_bos(false);
  cases[5].expected = "add_bos applies to text only";
  for (const Case& c : cases) {
    v1::ScoreResponse resp;
    const grpc::Status st = score(server_->channel(), c.req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.name;
    EXPECT_NE(st.error_message().find(c.expected), std::string::npos) << st.error_message();
  }
  {
    grpc::ClientContext context;
    v1::TokenizeRequest req;
    req.set_text("\xC0\xAF");  // an overlong '/'
    v1::TokenizeResponse resp;
    const grpc::Status st = stub->Tokenize(&context, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find("text is not valid UTF-8"), std::string::npos);
  }
  {
    // Refused by its length, as a prompt is, before seconds of tokenizing: the model's
    // context cannot hold it.
    grpc::ClientContext context;
    v1::TokenizeRequest req;
    while (req.text().size() < 300000) req.mutable_text()->append("ab cd ");
    v1::TokenizeResponse resp;
    const grpc::Status st = stub->Tokenize(&context, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find("text is 300000 bytes, more than the model's max_seq_len"),
              std::string::npos)
        << st.error_message();
  }
  {
    grpc::ClientContext context;
    v1::DetokenizeRequest req;
    req.add_ids(3);
    req.add_ids(-4);
    v1::DetokenizeResponse resp;
    const grpc::Status st = stub->Detokenize(&context, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    // Worded as the other calls word a bad id.
    EXPECT_NE(st.error_message().find("ids[1] = -4 is not a token id in [0, "), std::string::npos)
        << st.error_message();
  }
  {
    // More ids than any text the server takes could have, refused before decoding.
    grpc::ClientContext context;
    v1::DetokenizeRequest req;
    for (int i = 0; i < 300000; ++i) req.add_ids(5);
    v1::DetokenizeResponse resp;
    const grpc::Status st = stub->Detokenize(&context, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find("ids has 300000 ids; at most"), std::string::npos)
        << st.error_message();
  }
  {
    // Ids of the longest text: their text is bounded as texts are (4 × max_seq_len × the
    // longest piece), before it is made; as many as fit are decoded, one more is refused.
    std::string error;
    const auto tok = Tokenizer::load(*model_ + "/tokenizer.model", &error);
    ASSERT_NE(tok, nullptr) << error;
    int longest = 0;
    int64_t text = 0;
    for (int id = 0; id < tok->vocab_size(); ++id)
      if (const int64_t t = tok->decoded_bytes_bound(std::vector<int>{id}); t > text)
        longest = id, text = t;
    const int max_seq_len = TinyModelOptions{}.max_seq_len;  // the fixture's model
    const int64_t most = int64_t(4) * max_seq_len * tok->max_piece_bytes();
    const int fit = int(most / text);
    for (int extra : {0, 1}) {
      grpc::ClientContext context;
      v1::DetokenizeRequest req;
      for (int i = 0; i < fit + extra; ++i) req.add_ids(longest);
      v1::DetokenizeResponse resp;
      const grpc::Status st = stub->Detokenize(&context, req, &resp);
      if (extra == 0) {
        ASSERT_TRUE(st.ok()) << st.error_message();
        EXPECT_EQ(int64_t(resp.text().size()), fit * text);
        continue;
      }
      EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_NE(st.error_message().find(absl::StrCat("ids: their text would have ",
                                                     (fit + 1) * text, " bytes, more than the ",
                                                     most, " a Detokenize may return")),
                std::string::npos)
          << st.error_message();
    }
  }
}

// Fields the server's proto lacks are kept by protobuf and held for the whole call: at most 64 KiB
// of them pass (a newer client's new fields), in the request or a message inside it; more are
// refused at once, naming the message, for every method.
TEST_F(ServerValidation, RequestsPaddedWithUnknownFieldsAreRefused) {
  auto stub = v1::Inference::NewStub(server_->channel());
  auto pad = [](google::protobuf::Message* m, size_t bytes) {
    m->GetReflection()->MutableUnknownFields(m)->AddLengthDelimited(1000, std::string(bytes, 'p'));
  };
  auto expect_refused = [](const grpc::Status& st, const std::string& message) {
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << message;
    EXPECT_NE(st.error_message().find("the request holds fields that this server's " + message +
                                      " does not have (in it or the messages in it), taking "),
              std::string::npos)
        << st.error_message();
  };
  for (size_t bytes : {size_t(100), size_t(100) << 10}) {
    const bool refused = bytes > 65536;
    v1::GenerateRequest top = valid_request(), nested = valid_request();
    pad(&top, bytes);
    pad(nested.mutable_sampling(), bytes);
    for (const v1::GenerateRequest& req : {top, nested}) {
      const grpc::Status st = generate(server_->channel(), req).status;
      if (refused)
        expect_refused(st, "cemlm.v1.GenerateRequest");
      else
        EXPECT_TRUE(st.ok()) << st.error_message();
    }
    grpc::ClientContext tc, dc, ic, sc;
    v1::TokenizeRequest treq;
    treq.set_text("Hello");
    pad(&treq, bytes);
    v1::TokenizeResponse tresp;
    v1::DetokenizeRequest dreq;
    dreq.add_ids(5);
    pad(&dreq, bytes);
    v1::DetokenizeResponse dresp;
    v1::GetModelInfoRequest ireq;
    pad(&ireq, bytes);
    v1::ModelInfo iresp;
    v1::ScoreRequest sreq;
    sreq.set_text("Hello there");
    pad(&sreq, bytes);
    v1::ScoreResponse sresp;
    const std::pair<grpc::Status, std::string> unary[] = {
        {stub->Tokenize(&tc, treq, &tresp), "cemlm.v1.TokenizeRequest"},
        {stub->Detokenize(&dc, dreq, &dresp), "cemlm.v1.DetokenizeRequest"},
        {stub->GetModelInfo(&ic, ireq, &iresp), "cemlm.v1.GetModelInfoRequest"},
        {stub->Score(&sc, sreq, &sresp), "cemlm.v1.ScoreRequest"}};
    for (const auto& [st, message] : unary)
      if (refused)
        expect_refused(st, message);
      else
        EXPECT_TRUE(st.ok()) << message << ": " << st.error_message();
  }
}

// Training encodes every document as `BOS ids EOS`, so text inputs start with the same BOS unless
// the request sets add_bos = false; ids are used as given.
TEST_F(ServerValidation, TextInputsStartWithTheBosOfTrainingDocuments) {
  auto stub = v1::Inference::NewStub(server_->channel());
  const std::string text = "A journey of a thousand miles";
  std::vector<int> plain, with_bos;
  for (bool add : {false, true}) {
    grpc::ClientContext context;
    v1::TokenizeRequest req;
    req.set_text(text);
    req.set_add_bos(add);
    v1::TokenizeResponse resp;
    ASSERT_TRUE(stub->Tokenize(&context, req, &resp).ok());
    (add ? with_bos : plain).assign(resp.ids().begin(), resp.ids().end());
  }
  ASSERT_EQ(with_bos.size(), plain.size() + 1);
  ASSERT_EQ(with_bos[0], 1);  // the tiny model's tokenizer: unk 0, bos 1

  v1::ScoreRequest sreq;
  sreq.set_text(text);
  v1::ScoreResponse sresp;
  ASSERT_TRUE(score(server_->channel(), sreq, &sresp).ok());
  EXPECT_EQ(std::vector<int>(sresp.token_ids().begin(), sresp.token_ids().end()), with_bos);
  EXPECT_EQ(sresp.logprobs_size(), int(plain.size()));  // every token of the text is scored
  sreq.set_add_bos(false);
  ASSERT_TRUE(score(server_->channel(), sreq, &sresp).ok());
  EXPECT_EQ(std::vector<int>(sresp.token_ids().begin(), sresp.token_ids().end()), plain);

  // Greedy generation from the text is generation from the ids it stands for.
  auto run = [&](const std::vector<int>* ids, std::optional<bool> add_bos) {
    v1::GenerateRequest req;
    if (ids) {
      for (int id : *ids) req.add_prompt_ids(id);
    } else {
      req.set_prompt_text(text);
    }
    if (add_bos) req.set_add_bos(*add_bos);
    req.mutable_sampling()->set_temperature(0);
    req.mutable_sampling()->set_max_new_tokens(6);
    req.mutable_sampling()->set_ignore_eos(true);
    return generate(server_->channel(), req);
  };
  const Stream by_text = run(nullptr, std::nullopt), by_ids = run(&with_bos, std::nullopt);
  const Stream no_bos = run(nullptr, false), by_plain_ids = run(&plain, std::nullopt);
  for (const Stream* s : {&by_text, &by_ids, &no_bos, &by_plain_ids}) {
    ASSERT_TRUE(s->status.ok()) << s->status.error_message();
    ASSERT_FALSE(s->messages.empty());
  }
  EXPECT_EQ(by_text.messages.back().usage().prompt_tokens(), int(with_bos.size()));
  EXPECT_EQ(by_text.ids(), by_ids.ids());
  EXPECT_EQ(no_bos.messages.back().usage().prompt_tokens(), int(plain.size()));
  EXPECT_EQ(no_bos.ids(), by_plain_ids.ids());
}

TEST_F(ServerValidation, TokenizeRoundTripsAndInfoDescribesTheModel) {
  auto stub = v1::Inference::NewStub(server_->channel());
  const std::string text = "Fortune favours the bold, café";
  grpc::ClientContext c1, c2, c3;
  v1::TokenizeRequest treq;
  treq.set_text(text);
  treq.set_add_bos(true);
  v1::TokenizeResponse tresp;
  ASSERT_TRUE(stub->Tokenize(&c1, treq, &tresp).ok());
  ASSERT_GT(tresp.ids_size(), 1);
  EXPECT_EQ(tresp.pieces_size(), tresp.ids_size());
  v1::ModelInfo info;
  ASSERT_TRUE(stub->GetModelInfo(&c2, {}, &info).ok());
  EXPECT_EQ(tresp.ids(0), info.bos_id());
  v1::DetokenizeRequest dreq;
  dreq.mutable_ids()->CopyFrom(tresp.ids());
  v1::DetokenizeResponse dresp;
  ASSERT_TRUE(stub->Detokenize(&c3, dreq, &dresp).ok());
  EXPECT_EQ(dresp.text(), text);
  EXPECT_EQ(info.model_name(), "model");
  EXPECT_EQ(info.architecture(), "cemlm");
  EXPECT_EQ(info.vocab_size(), 400);
  EXPECT_EQ(info.max_context(), 512);
  EXPECT_EQ(info.default_recursion_depth(), 1);
  EXPECT_EQ(info.max_recursion_depth(), 8);
  EXPECT_GT(info.parameters(), 0);
  EXPECT_GT(info.kv_bytes_per_token(), 0);
  EXPECT_EQ(info.device(), "cpu:fp32");
  EXPECT_TRUE(info.has_tokenizer());
  EXPECT_FALSE(info.variant().empty());
}

// With --threads 1 the server tokenizes or decodes one text at a time: many Tokenize, Detokenize,
// Score and Generate (prompt_text: tokenized on a text worker, off gRPC's callback threads) calls
// at once all get their own answer, and calls that fail while holding the slot (a text that is
// not UTF-8) give it back (else every later call would wait to its deadline).
TEST(ServerTextSlots, TextCallsAtOnceAllAnswerAndFailedOnesGiveTheirSlotBack) {
  const std::string model = make_tiny_model(fresh_temp_dir());
  auto server = ServerProcess::start(model, {"--threads", "1"});
  ASSERT_TRUE(server);
  // Said at start-up, with the rest of the serving line (after health turned SERVING).
  std::string log = server->log();
  for (auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
       log.find(" blas=") == std::string::npos && std::chrono::steady_clock::now() < end;
       std::this_thread::sleep_for(std::chrono::milliseconds(10)))
    log = server->log();
  EXPECT_NE(log.find(" texts_at_once=1 "), std::string::npos) << log;
  auto stub = v1::Inference::NewStub(server->channel());
  auto tokenize = [&](const std::string& text, v1::TokenizeResponse* resp) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::TokenizeRequest req;
    req.set_text(text);
    return stub->Tokenize(&context, req, resp);
  };
  for (int i = 0; i < 8; ++i) {
    v1::TokenizeResponse resp;
    EXPECT_EQ(tokenize("bad \xC3\x28", &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    v1::ScoreRequest sreq;
    sreq.set_text("bad \xE2\x82");
    v1::ScoreResponse sresp;
    EXPECT_EQ(score(server->channel(), sreq, &sresp).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    v1::GenerateRequest greq = valid_request();
    greq.set_prompt_text("bad \xC3\x28");
    EXPECT_EQ(generate(server->channel(), greq).status.error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  const int kTexts = 6;
  std::vector<std::string> texts;
  std::vector<v1::TokenizeResponse> want(kTexts);
  std::vector<v1::ScoreResponse> want_score(kTexts);
  std::vector<std::vector<int>> want_ids(kTexts);
  auto generate_text = [&](const std::string& text) {
    v1::GenerateRequest greq = valid_request();
    greq.mutable_sampling()->set_temperature(0);  // greedy
    greq.set_prompt_text(text);
    return generate(server->channel(), greq);
  };
  for (int i = 0; i < kTexts; ++i) {
    texts.push_back(
        absl::StrCat("Text number ", i, " says ", std::string(size_t(i) * 7, 'a'), " and café"));
    ASSERT_TRUE(tokenize(texts.back(), &want[size_t(i)]).ok());
    v1::ScoreRequest sreq;
    sreq.set_text(texts.back());
    ASSERT_TRUE(score(server->channel(), sreq, &want_score[size_t(i)]).ok());
    const Stream g = generate_text(texts.back());
    ASSERT_TRUE(g.status.ok()) << g.status.error_message();
    want_ids[size_t(i)] = g.ids();
  }
  std::atomic<int> wrong{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 12; ++c)
    clients.emplace_back([&, c] {
      for (int k = 0; k < 6; ++k) {
        const size_t i = size_t(c + k) % kTexts;
        v1::TokenizeResponse got;
        if (!tokenize(texts[i], &got).ok() ||
            got.SerializeAsString() != want[i].SerializeAsString())
          ++wrong;
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
        v1::DetokenizeRequest dreq;
        dreq.mutable_ids()->CopyFrom(want[i].ids());
        v1::DetokenizeResponse dresp;
        if (!stub->Detokenize(&context, dreq, &dresp).ok() || dresp.text() != texts[i]) ++wrong;
        v1::ScoreRequest sreq;
        sreq.set_text(texts[i]);
        v1::ScoreResponse sresp;
        if (!score(server->channel(), sreq, &sresp).ok() ||
            !std::equal(sresp.token_ids().begin(), sresp.token_ids().end(),
                        want_score[i].token_ids().begin(), want_score[i].token_ids().end()) ||
            std::abs(sresp.nll() - want_score[i].nll()) > 1e-5)
          ++wrong;
        if (const Stream g = generate_text(texts[i]); !g.status.ok() || g.ids() != want_ids[i])
          ++wrong;
      }
    });
  for (auto& t : clients) t.join();
  EXPECT_EQ(wrong.load(), 0) << "of " << 12 * 6 * 4 << " calls";
}

// `n` Tokenize calls of 200 KB texts at once, each taking the server's text slot a while (for a
// model whose context lets such texts in); counts those that succeed in *ok. Returns once they
// are in line.
std::vector<std::thread> line_of_long_texts(const ServerProcess& server, int n,
                                            std::atomic<int>* ok) {
  auto long_text = std::make_shared<std::string>();
  for (int i = 0; long_text->size() < 200000; ++i)
    *long_text += absl::StrCat("fortune number ", i, " says the line is long ");
  std::vector<std::thread> line;
  for (int i = 0; i < n; ++i)
    line.emplace_back([&server, long_text, ok] {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
      v1::TokenizeRequest req;
      req.set_text(*long_text);
      v1::TokenizeResponse resp;
      if (v1::Inference::NewStub(server.channel())->Tokenize(&context, req, &resp).ok()) ++*ok;
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the line forms
  return line;
}

// A text refused for what it is (longer than any prompt, not UTF-8) is answered at once, without
// waiting for a text slot: behind a line of long texts it took the caller's whole deadline and
// ended DEADLINE_EXCEEDED instead of naming its field (and an oversize Generate waited on one of
// gRPC's callback threads).
TEST(ServerTextSlots, ATextRefusedForWhatItIsWaitsForNoSlot) {
  // One slot (--threads 1); a context that lets texts of 200 KB in, each a while to tokenize.
  const std::string model = make_tiny_model(fresh_temp_dir(), {.max_seq_len = 16384});
  auto server = ServerProcess::start(model);
  ASSERT_TRUE(server);
  // Texts of 200 KB in line for the one slot: tokenizing them one after another takes longer
  // than the refused calls' deadline (their order does not matter: none waits in the fix).
  constexpr int kLine = 24;
  std::atomic<int> line_ok{0};
  std::vector<std::thread> line = line_of_long_texts(*server, kLine, &line_ok);
  const CallOptions quick{.timeout = std::chrono::milliseconds(1500)};
  // A good text beside a bad field is refused for the field at once too (such calls waited for
  // the slot and the tokenizing before the field was looked at): all at once, while the line is
  // long.
  using Spoil = std::function<void(v1::GenerateRequest&, v1::ScoreRequest&)>;
  const std::vector<std::pair<std::string, Spoil>> spoiled = {
      {"set only one of prompt_text and prompt_ids",
       [](v1::GenerateRequest& g, v1::ScoreRequest&) { g.add_prompt_ids(1); }},
      {"sampling.temperature",
       [](v1::GenerateRequest& g, v1::ScoreRequest&) {
         g.mutable_sampling()->set_temperature(-1);
       }},
      {"recursion_depth",
       [](v1::GenerateRequest& g, v1::ScoreRequest&) { g.set_recursion_depth(99); }},
      {"sampling.top_logprobs = 2 needs logprobs",
       [](v1::GenerateRequest& g, v1::ScoreRequest&) {
         g.mutable_sampling()->set_top_logprobs(2);
       }},
      {"set only one of text and ids",
       [](v1::GenerateRequest&, v1::ScoreRequest& s) { s.add_ids(1); }},
      {"recursion_depth",
       [](v1::GenerateRequest&, v1::ScoreRequest& s) { s.set_recursion_depth(99); }}};
  std::vector<grpc::Status> spoiled_status(spoiled.size());
  std::vector<std::thread> spoiled_calls;
  for (size_t i = 0; i < spoiled.size(); ++i)
    spoiled_calls.emplace_back([&, i] {
      v1::GenerateRequest greq = valid_request();
      greq.clear_prompt_ids();
      greq.set_prompt_text("a fine text");
      v1::ScoreRequest sreq;
      sreq.set_text("a fine text");
      spoiled[i].second(greq, sreq);
      v1::ScoreResponse sresp;
      spoiled_status[i] = i < 4 ? generate(server->channel(), greq, quick).status
                                : score(server->channel(), sreq, &sresp, quick);
    });
  for (auto& t : spoiled_calls) t.join();
  for (size_t i = 0; i < spoiled.size(); ++i) {
    EXPECT_EQ(spoiled_status[i].error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << spoiled[i].first << ": " << spoiled_status[i].error_message();
    EXPECT_NE(spoiled_status[i].error_message().find(spoiled[i].first), std::string::npos)
        << spoiled_status[i].error_message();
  }
  // Past max_text_bytes (4 × max_seq_len × the longest piece, of a few bytes here), within
  // gRPC's 4 MiB.
  const std::string oversize(size_t(3) << 20, 'a');
  for (const std::string& bad : {oversize, std::string("bad \xC3\x28")}) {
    const std::string why =
        bad.size() > 100 ? "bytes, more than the model's max_seq_len" : "is not valid UTF-8";
    v1::GenerateRequest greq = valid_request();
    greq.set_prompt_text(bad);
    const grpc::Status g = generate(server->channel(), greq, quick).status;
    EXPECT_EQ(g.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << g.error_message();
    EXPECT_NE(g.error_message().find(why), std::string::npos) << g.error_message();
    EXPECT_TRUE(g.error_message().starts_with("prompt_text ")) << g.error_message();
    v1::ScoreRequest sreq;
    sreq.set_text(bad);
    v1::ScoreResponse sresp;
    const grpc::Status s = score(server->channel(), sreq, &sresp, quick);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find(why), std::string::npos) << s.error_message();
    grpc::ClientContext context;
    prepare(&context, quick);
    v1::TokenizeRequest treq;
    treq.set_text(bad);
    v1::TokenizeResponse tresp;
    const grpc::Status t =
        v1::Inference::NewStub(server->channel())->Tokenize(&context, treq, &tresp);
    EXPECT_EQ(t.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << t.error_message();
    EXPECT_NE(t.error_message().find(why), std::string::npos) << t.error_message();
  }
  for (auto& t : line) t.join();
  EXPECT_EQ(line_ok.load(), kLine);
}

// The calls refused for a full line: each one not OK is RESOURCE_EXHAUSTED saying `message`.
int count_refused(const std::vector<grpc::Status>& status, const std::string& message) {
  int refused = 0;
  for (const grpc::Status& st : status) {
    if (st.ok()) continue;
    ++refused;
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_NE(st.error_message().find(message), std::string::npos) << st.error_message();
  }
  return refused;
}

// Generate calls whose text waits for its turn to be tokenized each hold their request, and only
// gRPC's streams per connection bounded them: at most --max-waiting wait; more are refused,
// naming the bound, and the rest are served.
TEST(ServerTextSlots, GenerateCallsWaitingForTheirTextAreBounded) {
  const std::string model = make_tiny_model(fresh_temp_dir(), {.max_seq_len = 16384});
  auto server = ServerProcess::start(model, {"--threads", "1", "--max-waiting", "1"});
  ASSERT_TRUE(server);
  // The one text slot stays taken by a line of long texts while the Generate calls arrive.
  std::atomic<int> line_ok{0};
  std::vector<std::thread> line = line_of_long_texts(*server, 16, &line_ok);
  // One job runs (its worker waits for the slot), one waits; the rest are refused.
  constexpr int kCalls = 6;
  std::vector<grpc::Status> status(kCalls);
  std::vector<std::thread> calls;
  auto text_request = [] {
    v1::GenerateRequest req = valid_request();
    req.clear_prompt_ids();
    req.set_prompt_text("a fine text");
    return req;
  };
  for (int i = 0; i < kCalls; ++i)
    calls.emplace_back([&, i] {
      status[size_t(i)] = generate(server->channel(), text_request(),
                                   CallOptions{.timeout = std::chrono::seconds(300)})
                              .status;
    });
  for (auto& t : calls) t.join();
  const int refused = count_refused(
      status,
      "1 Generate calls already wait for their prompt_text to be tokenized (--max-waiting)");
  EXPECT_GE(refused, 2);
  EXPECT_LE(refused, kCalls - 1);
  for (auto& t : line) t.join();
  EXPECT_TRUE(generate(server->channel(), text_request()).status.ok()) << "room again";
}

// Tokenize, Detokenize and Score calls that wait for their text's turn each hold a gRPC thread,
// and nothing bounded them (1,000 Tokenize calls at once took a server to 2,752 threads): at most
// 32 a text slot wait; more are refused at once, naming the bound, and the rest are served.
TEST(ServerTextSlots, UnaryCallsWaitingForTheirTextAreBounded) {
  const std::string model = make_tiny_model(fresh_temp_dir(), {.max_seq_len = 16384});
  auto server = ServerProcess::start(model, {"--threads", "1"});
  ASSERT_TRUE(server);
  std::string long_text;
  for (int i = 0; long_text.size() < 200000; ++i)
    long_text += absl::StrCat("fortune number ", i, " says the line is long ");
  constexpr int kCalls = 33 + 24;  // one tokenized, 32 waiting, and more
  std::vector<grpc::Status> status(kCalls);
  std::vector<std::thread> calls;
  for (int i = 0; i < kCalls; ++i)
    calls.emplace_back([&, i] {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
      v1::TokenizeRequest req;
      req.set_text(long_text);
      v1::TokenizeResponse resp;
      status[size_t(i)] = v1::Inference::NewStub(server->channel())->Tokenize(&context, req, &resp);
    });
  for (auto& t : calls) t.join();
  const int refused = count_refused(status,
                                    "32 calls already wait for one of the 1 texts tokenized at "
                                    "once (32 a --threads thread); retry later");
  EXPECT_GE(refused, 1);
  EXPECT_LE(refused, kCalls - 33);
  const auto m = parse_metrics(server->metrics_text());
  EXPECT_EQ(metric(m, "cemlm:requests_total", "code=\"RESOURCE_EXHAUSTED\",method=\"Tokenize\""),
            refused);
  v1::TokenizeRequest req;
  req.set_text("room again");
  v1::TokenizeResponse resp;
  grpc::ClientContext context;
  EXPECT_TRUE(v1::Inference::NewStub(server->channel())->Tokenize(&context, req, &resp).ok());
}

// SentencePiece's load runs a model's self-test samples and logs those that fail, raw: a file's
// terminal escapes and line ends reached the terminal of `cemlm generate` and the log of `cemlm
// serve` (a CR LF there starts a forged line). The error says the self-test failed; nothing of
// the samples is written.
TEST(ServerTokenizer, AFailedSelfTestWritesNoneOfTheModelsBytes) {
  const std::string model = make_tiny_model(fresh_temp_dir());
  std::string tokenizer;
  {
    std::ifstream in(model + "/tokenizer.model", std::ios::binary);
    tokenizer.assign(std::istreambuf_iterator<char>(in), {});
  }
  ASSERT_FALSE(tokenizer.empty());
  // ModelProto field 4 (self_test_data) holding one sample (1): input (1) and expected (2).
  auto field = [](int number, const std::string& bytes) {
    std::string out(1, char(number << 3 | 2));
    for (size_t n = bytes.size();; n >>= 7) {
      out += char((n & 0x7F) | (n >= 0x80 ? 0x80 : 0));
      if (n < 0x80) break;
    }
    return out + bytes;
  };
  const std::string nasty = "\x1b]0;title\x07\x1b[2J\r\nFAKE OK";
  std::ofstream(model + "/tokenizer.model", std::ios::binary)
      << tokenizer << field(4, field(1, field(1, nasty) + field(2, nasty + " x")));
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"generate", "--model", model, "--prompt", "hi"},
        std::vector<std::string>{"serve", "--model", model, "--port", "0"}}) {
    std::string out, err;
    EXPECT_EQ(run_cemlm(args, &out, &err), 1) << args[0] << ": " << err;
    EXPECT_NE(err.find("its self_test_data samples do not encode to the pieces it gives"),
              std::string::npos)
        << args[0] << ": " << err;
    EXPECT_EQ(err.find_first_of("\x1b\x07\r"), std::string::npos)
        << args[0] << ": " << absl::CHexEscape(err);
  }
}

// A tokenizer.model that SentencePiece loads but that refuses to encode some texts: such a text
// is INVALID_ARGUMENT naming its field (it once aborted the server), and the command-line tools
// name their flag; the server goes on serving.
TEST(ServerTokenizer, ATextTheTokenizerRefusesNamesItsField) {
  const std::string model = make_tiny_model(fresh_temp_dir(), {.tokenizer = false});
  std::ofstream(model + "/tokenizer.model", std::ios::binary) << testing_tokens::kRefusesSpaceX;
  auto server = ServerProcess::start(model);
  ASSERT_TRUE(server);
  auto stub = v1::Inference::NewStub(server->channel());
  v1::GenerateRequest req = valid_request();
  req.set_prompt_text(" x");
  const Stream refused = generate(server->channel(), req);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.status.error_message().find(
                "prompt_text: the tokenizer cannot encode this text (SentencePiece: "),
            std::string::npos)
      << refused.status.error_message();
  grpc::ClientContext context;
  v1::TokenizeRequest treq;
  treq.set_text(" x");
  v1::TokenizeResponse tresp;
  const grpc::Status tokenize = stub->Tokenize(&context, treq, &tresp);
  EXPECT_EQ(tokenize.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(tokenize.error_message().find("text: the tokenizer cannot encode"), std::string::npos)
      << tokenize.error_message();
  req.set_prompt_text("a");
  const Stream served = generate(server->channel(), req);
  EXPECT_TRUE(served.status.ok()) << served.status.error_message();
  std::string out, err;
  EXPECT_EQ(run_cemlm({"generate", "--model", model, "--prompt", " x"}, &out, &err), 1);
  EXPECT_NE(err.find("--prompt: the tokenizer cannot encode"), std::string::npos) << err;
  EXPECT_EQ(run_cemlm({"score", "--model", model, "--text", " x a"}, &out, &err), 1);
  EXPECT_NE(err.find("--text: the tokenizer cannot encode"), std::string::npos) << err;
}

// requests_total has a series for every method and gRPC code from the start (at 0), so a panel of
// its rates by method and code sees a pair's first error: a series born at it has no rate there.
TEST_F(ServerValidation, RequestsTotalHasEveryMethodAndCode) {
  const auto m = parse_metrics(server_->metrics_text());
  std::map<std::string, int> methods_per_code;
  for (const auto& [key, value] : m) {
    if (key.rfind("cemlm:requests_total{", 0) != 0) continue;
    const size_t at = key.find("code=\"");
    ASSERT_NE(at, std::string::npos) << key;
    ++methods_per_code[key.substr(at + 6, key.find('"', at + 6) - at - 6)];
  }
  EXPECT_EQ(methods_per_code.size(), 17u);  // OK .. UNAUTHENTICATED
  for (const auto& [code, methods] : methods_per_code) EXPECT_EQ(methods, 5) << code;
  EXPECT_EQ(methods_per_code.count("DATA_LOSS"), 1u);
}

// An empty input's error says what to send instead, with this model's own BOS id.
TEST_F(ServerValidation, AnEmptyPromptSaysToSendTheBosId) {
  auto stub = v1::Inference::NewStub(server_->channel());
  grpc::ClientContext context;
  v1::ModelInfo info;
  ASSERT_TRUE(stub->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok());
  ASSERT_GE(info.bos_id(), 0);
  v1::GenerateRequest req = valid_request();
  req.clear_prompt_text();
  const Stream s = generate(server_->channel(), req);
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.status.error_message().find(absl::StrCat(
                "to start from the BOS alone, send prompt_ids = [", info.bos_id(), "])")),
            std::string::npos)
      << s.status.error_message();
}

// Without a tokenizer (and so without a BOS), text is refused naming the id list to send instead
// where the request has one, and an empty prompt's error suggests no BOS id.
TEST(ServerNoTokenizer, ErrorsSuggestOnlyWhatTheRequestCanSend) {
  auto server = ServerProcess::start(make_tiny_model(fresh_temp_dir(), {.tokenizer = false}));
  ASSERT_TRUE(server);
  auto stub = v1::Inference::NewStub(server->channel());
  v1::GenerateRequest req = valid_request();
  Stream s = generate(server->channel(), req);
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.status.error_message().find(
                "prompt_text: this model has no tokenizer; send prompt_ids instead"),
            std::string::npos)
      << s.status.error_message();
  req.clear_prompt_text();
  s = generate(server->channel(), req);
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.status.error_message().find("prompt_text or prompt_ids is required"),
            std::string::npos)
      << s.status.error_message();
  EXPECT_EQ(s.status.error_message().find("BOS"), std::string::npos) << s.status.error_message();
  grpc::ClientContext context;
  v1::TokenizeRequest treq;
  treq.set_text("Hello");
  v1::TokenizeResponse tresp;
  const grpc::Status tokenize = stub->Tokenize(&context, treq, &tresp);
  EXPECT_EQ(tokenize.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // TokenizeRequest has no id list to send instead.
  EXPECT_EQ(tokenize.error_message(), "text: this model has no tokenizer");
  // Its tokens have no text: `cemlm client generate` streaming them printed an empty line, exit 0.
  std::string out, err;
  EXPECT_EQ(run_cemlm({"client", "generate", "--addr", server->addr(), "--prompt-ids", "5,6",
                       "--max-new-tokens", "3"},
                      &out, &err),
            2);
  EXPECT_NE(err.find("the server's model has no tokenizer, so its tokens have no text to stream; "
                     "add --json"),
            std::string::npos)
      << err;
  ASSERT_EQ(run_cemlm({"client", "generate", "--addr", server->addr(), "--prompt-ids", "5,6",
                       "--max-new-tokens", "3", "--ignore-eos", "--json"},
                      &out, &err),
            0)
      << err;
  EXPECT_EQ(nlohmann::json::parse(out)["ids"].size(), 3u) << out;
}

TEST(ServerAuth, ApiKeysGuardInferenceButNotHealth) {
  const std::string dir = fresh_temp_dir();
  const std::string model = make_tiny_model(dir), keys = dir + "/keys.txt";
  // A byte-order mark before the first key (Windows editors write one) is not part of it.
  std::ofstream(keys) << "\xEF\xBB\xBF" "alpha-key\n# keys of the test\n\n  beta-key  \n";
  auto server = ServerProcess::start(model, {"--api-key-file", keys});
  ASSERT_TRUE(server);
  const v1::GenerateRequest req = valid_request();
  const auto first_refusal = std::chrono::steady_clock::now();
  for (const std::string bad : {"", "wrong", "alpha", "alpha-key2", "alpha-keyalpha-key"}) {
    const Stream s = generate(server->channel(), req, {bad});
    EXPECT_EQ(s.status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << "key '" << bad << "'";
  }
  v1::ScoreRequest sreq;
  sreq.set_text("Hello there");
  v1::ScoreResponse sresp;
  EXPECT_EQ(score(server->channel(), sreq, &sresp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(generate(server->channel(), req, {"alpha-key"}).status.ok());
  EXPECT_TRUE(generate(server->channel(), req, {"beta-key"}).status.ok());
  EXPECT_TRUE(score(server->channel(), sreq, &sresp, {"beta-key"}).ok());
  // The scheme's case does not matter (RFC 7235); another scheme is refused.
  const std::chrono::milliseconds t(30000);
  EXPECT_TRUE(generate(server->channel(), req, {"alpha-key", t, "bearer"}).status.ok());
  EXPECT_TRUE(generate(server->channel(), req, {"alpha-key", t, "BEARER"}).status.ok());
  EXPECT_EQ(generate(server->channel(), req, {"alpha-key", t, "Basic"}).status.error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  // Spaces after the scheme, or at the end, are none of the key (RFC 9110), as in the key file.
  EXPECT_TRUE(generate(server->channel(), req, {"alpha-key", t, "Bearer "}).status.ok());
  EXPECT_TRUE(generate(server->channel(), req, {"alpha-key  ", t}).status.ok());
  // Two keys, whichever comes first: no telling which one a proxy on the way added.
  for (const auto& keys : {std::pair{"alpha-key", "wrong"}, {"wrong", "alpha-key"}}) {
    grpc::ClientContext context;
    prepare(&context, {keys.first});
    context.AddMetadata("authorization", std::string("Bearer ") + keys.second);
    v1::ModelInfo info;
    const grpc::Status st =
        v1::Inference::NewStub(server->channel())->GetModelInfo(&context, {}, &info);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED) << keys.first;
    EXPECT_NE(st.error_message().find("2 'authorization' metadata entries"), std::string::npos)
        << st.error_message();
  }
  EXPECT_EQ(health(server->channel()), "SERVING");  // no key needed
  const auto m = parse_metrics(server->metrics_text());
  EXPECT_EQ(metric(m, "cemlm:request_errors_total", "code=\"UNAUTHENTICATED\""), 9);
  // Refusals are logged at most once a second, without the caller's own client id: a client
  // without a key cannot fill the disk. (The bound is read from this test's own clock.)
  v1::GenerateRequest tagged = req;
  tagged.set_request_id("unauthenticated-caller-id");
  EXPECT_EQ(generate(server->channel(), tagged, {"wrong"}).status.error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  for (int i = 0; i < 40; ++i) score(server->channel(), sreq, &sresp, {"wrong"});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - first_refusal).count();
  const std::string log = server->log();
  EXPECT_EQ(log.find("unauthenticated-caller-id"), std::string::npos);
  size_t lines = 0;  // of the 50 refusals
  for (size_t at = 0; (at = log.find("status=UNAUTHENTICATED", at)) != std::string::npos; ++at)
    ++lines;
  EXPECT_GE(lines, 1u);
  EXPECT_LE(double(lines), 2 + seconds) << log;
  // The command-line client takes its key from CEMLM_API_KEY too (out of `ps` and the shell's
  // history); --api-key wins over it.
  std::string out_info, err_info;
  ::setenv("CEMLM_API_KEY", "beta-key", 1);
  EXPECT_EQ(run_cemlm({"client", "info", "--addr", server->addr()}, &out_info, &err_info), 0)
      << err_info;
  EXPECT_NE(run_cemlm({"client", "info", "--addr", server->addr(), "--api-key", "wrong"}, &out_info,
                      &err_info),
            0);
  EXPECT_NE(err_info.find("UNAUTHENTICATED"), std::string::npos) << err_info;
  // Its error says where the key came from, or that none was sent, and what gives one.
  EXPECT_NE(err_info.find("(the key sent, from --api-key, is not one the server takes"),
            std::string::npos)
      << err_info;
  ::setenv("CEMLM_API_KEY", "wrong", 1);
  EXPECT_NE(run_cemlm({"client", "info", "--addr", server->addr()}, &out_info, &err_info), 0);
  EXPECT_NE(err_info.find("(the key sent, from $CEMLM_API_KEY, is not one"), std::string::npos)
      << err_info;
  ::unsetenv("CEMLM_API_KEY");
  EXPECT_NE(run_cemlm({"client", "info", "--addr", server->addr()}, &out_info, &err_info), 0);
  EXPECT_NE(err_info.find("missing API key: send the metadata 'authorization: Bearer <key>' (no "
                          "key was sent: give one with --api-key, or in $CEMLM_API_KEY)"),
            std::string::npos)
      << err_info;
  // An empty --api-key-file is a mistake, not "no keys"; so is an empty --tls-cert/--tls-key
  // (it served plaintext), host, metrics host or model name.
  std::string out;
  for (const char* flag : {"--api-key-file", "--tls-cert", "--tls-key", "--host", "--metrics-host",
                           "--model-name", "--model"}) {
    std::string empty_err;
    EXPECT_EQ(run_cemlm({"serve", "--model", model, flag, ""}, &out, &empty_err), 2) << flag;
    EXPECT_NE(empty_err.find(std::string("error: ") + flag + " is empty: name "), std::string::npos)
        << empty_err;
  }
  // A --model that names no checkpoint is refused before the server listens: the ports line,
  // which scripts wait for, went out first.
  {
    std::string missing_out, missing_err;
    EXPECT_EQ(run_cemlm({"serve", "--model", fresh_temp_dir() + "/none", "--port", "0",
                         "--metrics-port", "0"},
                        &missing_out, &missing_err),
              1);
    EXPECT_EQ(missing_out, "");
    EXPECT_NE(missing_err.find("config.json"), std::string::npos) << missing_err;
  }
  // So is a key file that is not there, named.
  const std::string bad = fresh_temp_dir() + "/keys.txt";
  std::string err;
  EXPECT_NE(run_cemlm({"serve", "--model", model, "--api-key-file", bad}, &out, &err), 0);
  EXPECT_NE(err.find("--api-key-file: '" + bad + "' does not exist"), std::string::npos) << err;
  // And a key no client can send (gRPC metadata values are printable ASCII): refused by line.
  std::ofstream(bad) << "good-key\n# a comment: \xC3\xA9 is fine here\ncl\xC3\xA9\n";
  err.clear();
  EXPECT_NE(run_cemlm({"serve", "--model", model, "--api-key-file", bad}, &out, &err), 0);
  EXPECT_NE(err.find("line 3 of '" + bad + "' holds a byte no client can send"), std::string::npos)
      << err;
  // And a comment after a key, which made the whole line the key (a '#' inside a word is kept).
  std::ofstream(bad) << "good#key\n# ok\ntok1   # the ops team\n";
  err.clear();
  EXPECT_NE(run_cemlm({"serve", "--model", model, "--api-key-file", bad}, &out, &err), 0);
  EXPECT_NE(err.find("line 3 of '" + bad +
                     "': a '#' after a space reads as a comment after the "
                     "key"),
            std::string::npos)
      << err;
}

// Each key's requests reuse the prefix cache's blocks among themselves only (a tenant would learn
// from cached_prompt_tokens or the time to first token what another's prompts held), unless the
// server shares them; a cache_salt splits them further, and one too long is refused by name.
TEST(ServerAuth, PrefixCacheIsPerKeyUnlessShared) {
  const std::string dir = fresh_temp_dir();
  const std::string model = make_tiny_model(dir), keys = dir + "/keys.txt";
  std::ofstream(keys) << "key-a\nkey-b max_priority=3\n";
  std::vector<int> shared(40);  // two full 16-token blocks
  for (size_t i = 0; i < shared.size(); ++i) shared[i] = int(i % 50) + 3;
  for (const bool per_key : {true, false}) {
    SCOPED_TRACE(per_key ? "--prefix-cache-scope key (default)" : "--prefix-cache-scope shared");
    std::vector<std::string> args = {"--api-key-file", keys};
    if (!per_key) args.insert(args.end(), {"--prefix-cache-scope", "shared"});
    auto server = ServerProcess::start(model, args);
    ASSERT_TRUE(server);
    auto cached = [&](const std::string& key, const std::string& salt) {
      v1::GenerateRequest req = ids_request(shared, 2, 1);
      req.set_cache_salt(salt);
      const Stream s = generate(server->channel(), req, {key});
      EXPECT_TRUE(s.status.ok()) << s.status.error_message();
      return s.messages.empty() ? -1 : s.messages.back().usage().cached_prompt_tokens();
    };
    EXPECT_EQ(cached("key-a", ""), 0);
    EXPECT_EQ(cached("key-a", ""), 32);
    EXPECT_EQ(cached("key-b", ""), per_key ? 0 : 32);
    EXPECT_EQ(cached("key-b", ""), 32);
    EXPECT_EQ(cached("key-a", "user-1"), 0);
    EXPECT_EQ(cached("key-a", "user-1"), 32);
    EXPECT_EQ(cached("key-b", "user-1"), per_key ? 0 : 32);
  }
  auto server = ServerProcess::start(model, {});
  ASSERT_TRUE(server);
  v1::GenerateRequest req = valid_request();
  req.set_cache_salt(std::string(257, 's'));
  const grpc::Status st = generate(server->channel(), req).status;
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("cache_salt has 257 bytes; send at most 256"),
            std::string::npos)
      << st.error_message();
  req.set_cache_salt(std::string(256, 's'));
  EXPECT_TRUE(generate(server->channel(), req).status.ok());
}

// How many of a 20-token prompt's tokens (one full 16-token block) the prefix cache held for a
// call with `key`: -2 when the key is refused, -1 on another failure.
int cached_with_key(const ServerProcess& server, const std::string& key) {
  std::vector<int> prompt(20);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int(i % 50) + 3;
  const Stream s = generate(server.channel(), ids_request(prompt, 2, 1), {key});
  if (!s.status.ok()) return s.status.error_code() == grpc::StatusCode::UNAUTHENTICATED ? -2 : -1;
  return s.messages.empty() ? -1 : s.messages.back().usage().cached_prompt_tokens();
}

// SIGHUP reads --api-key-file again: a key removed stops working and a new one works, with no
// restart (a Secret changes in place); a key kept keeps its prefix-cache blocks, and a new key
// never gets another's (by line, the new first key would have had the old first key's cache);
// a file that does not load leaves the keys as they were. It ended the process, undrained.
TEST(ServerAuth, SighupReadsTheKeysAgain) {
  const std::string dir = fresh_temp_dir();
  const std::string model = make_tiny_model(dir), keys = dir + "/keys.txt";
  std::ofstream(keys) << "key-a\nkey-b\n";
  auto server = ServerProcess::start(model, {"--api-key-file", keys});
  ASSERT_TRUE(server);
  auto cached = [&](const std::string& key) { return cached_with_key(*server, key); };
  auto reload = [&](const std::string& content, const std::string& logged) {
    std::ofstream(keys, std::ios::trunc) << content;
    ASSERT_EQ(::kill(server->pid(), SIGHUP), 0);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (server->log().find(logged) == std::string::npos &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ASSERT_NE(server->log().find(logged), std::string::npos) << server->log();
  };
  EXPECT_EQ(cached("key-a"), 0);
  EXPECT_EQ(cached("key-a"), 16);
  EXPECT_EQ(cached("key-c"), -2);
  reload("key-c\nkey-a\n", "SIGHUP: api keys read again from " + keys + ": 2 keys");
  EXPECT_EQ(cached("key-b"), -2);
  EXPECT_EQ(cached("key-c"), 0);  // not key-a's blocks, though it is now the first line
  EXPECT_EQ(cached("key-a"), 16);
  reload("key-c\nkey-c\n", "the keys served are unchanged");
  EXPECT_EQ(cached("key-a"), 16);
  EXPECT_EQ(cached("key-b"), -2);
  EXPECT_EQ(health(server->channel()), "SERVING");
}

// A key's line may cap the priority its calls ask for, and --max-priority caps it for the keys
// whose lines do not (and for servers without keys): above the cap, PERMISSION_DENIED naming it,
// for Generate and Score alike. Without either, any client could preempt every other.
TEST(ServerAuth, PriorityIsCappedByTheKeyOrTheServer) {
  const std::string dir = fresh_temp_dir();
  const std::string model = make_tiny_model(dir), keys = dir + "/keys.txt";
  std::ofstream(keys) << "batch-key max_priority=-1\nlive-key\tmax_priority=10\nplain-key\n"
                         "spaced key  max_priority=3\nabc/DEF+ ghIJ==\nkey ending in=\n";
  auto server = ServerProcess::start(model, {"--api-key-file", keys, "--max-priority", "5"});
  ASSERT_TRUE(server);
  // The start-up line says what holds (and that the gRPC quota is the default's).
  EXPECT_NE(server->log().find("api_keys=true grpc_memory=256M max_priority=5"), std::string::npos)
      << server->log();
  auto generate_at = [&](const std::string& key, int priority) {
    v1::GenerateRequest req = valid_request();
    req.set_priority(priority);
    return generate(server->channel(), req, {key}).status;
  };
  auto score_at = [&](const std::string& key, int priority) {
    v1::ScoreRequest req;
    req.set_text("Hello there");
    req.set_priority(priority);
    v1::ScoreResponse resp;
    return score(server->channel(), req, &resp, {key});
  };
  const struct {
    std::string key;
    int most;
    std::string whose;
  } cases[] = {{"batch-key", -1, "this API key may ask for"},
               {"live-key", 10, "this API key may ask for"},
               {"spaced key", 3, "this API key may ask for"},
               {"plain-key", 5, "this server allows (--max-priority)"},
               // Keys with spaces whose last word holds '=' but reads as no option.
               {"abc/DEF+ ghIJ==", 5, "this server allows (--max-priority)"},
               {"key ending in=", 5, "this server allows (--max-priority)"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.key);
    EXPECT_TRUE(generate_at(c.key, c.most).ok());
    EXPECT_TRUE(generate_at(c.key, -100).ok());
    EXPECT_TRUE(score_at(c.key, c.most).ok());
    for (const grpc::Status& st : {generate_at(c.key, c.most + 1), score_at(c.key, c.most + 1)}) {
      EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
      EXPECT_NE(st.error_message().find(absl::StrCat("priority = ", c.most + 1, " is above ",
                                                     c.most, ", the most ", c.whose)),
                std::string::npos)
          << st.error_message();
    }
  }
  // A wrong key is still UNAUTHENTICATED, whatever its priority.
  EXPECT_EQ(generate_at("wrong", 100).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  const auto m = parse_metrics(server->metrics_text());
  EXPECT_EQ(metric(m, "cemlm:request_errors_total", "code=\"PERMISSION_DENIED\""), 12);
  server.reset();
  // Without keys, --max-priority alone.
  auto open = ServerProcess::start(model, {"--max-priority", "0", "--grpc-memory", "0"});
  ASSERT_TRUE(open);
  EXPECT_NE(open->log().find("api_keys=false grpc_memory=unbounded max_priority=0"),
            std::string::npos)
      << open->log();
  v1::GenerateRequest req = valid_request();
  req.set_priority(1);
  EXPECT_EQ(generate(open->channel(), req).status.error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  req.set_priority(0);
  EXPECT_TRUE(generate(open->channel(), req).status.ok());
  // A max_priority= that is no int32 is refused at start, by line.
  for (const std::string bad : {"max_priority=high", "max_priority=", "max_priority=3000000000"}) {
    std::ofstream(keys) << "good-key\nother-key " << bad << "\n";
    std::string out, err;
    EXPECT_NE(run_cemlm({"serve", "--model", model, "--api-key-file", keys}, &out, &err), 0);
    EXPECT_NE(
        err.find("line 2 of '" + keys + "': '" + bad + "' is not max_priority=N with N an integer"),
        std::string::npos)
        << err;
  }
  // So is a cap written any other way (each would have made a key of the whole line: the cap
  // alone one that anyone could guess), and a key given twice (which line's cap would hold?).
  for (const std::string bad :
       {"max_priority=5", "other-key max_priority= 5", "other-key max_priority = 5",
        "other-key max_priority=5 # ops", "MAX_PRIORITY=5", "other-key Max_Priority=0",
        "other-key max-priority=0"}) {
    std::ofstream(keys) << "good-key\n" << bad << "\n";
    std::string out, err;
    EXPECT_NE(run_cemlm({"serve", "--model", model, "--api-key-file", keys}, &out, &err), 0);
    EXPECT_NE(err.find("line 2 of '" + keys + "': write a key's cap as its line's last word"),
              std::string::npos)
        << bad << ": " << err;
  }
  // An option misspelt after the key would have become part of it, its cap lost.
  for (const std::string bad :
       {"other-key max_priorty=5", "other-key priority=5", "other key\tmaxPriority=5"}) {
    std::ofstream(keys) << "good-key\n" << bad << "\n";
    std::string out, err;
    EXPECT_NE(run_cemlm({"serve", "--model", model, "--api-key-file", keys}, &out, &err), 0);
    EXPECT_NE(err.find("line 2 of '" + keys + "': '" + bad.substr(bad.find_last_of(" \t") + 1) +
                       "' after the key reads as an option"),
              std::string::npos)
        << bad << ": " << err;
  }
  std::ofstream(keys) << "good-key max_priority=0\n# comment\ngood-key\n";
  std::string out, err;
  EXPECT_NE(run_cemlm({"serve", "--model", model, "--api-key-file", keys}, &out, &err), 0);
  EXPECT_NE(err.find("line 3 of '" + keys + "' repeats the key of line 1"), std::string::npos)
      << err;
}

TEST_F(ServerValidation, WithoutKeysAnyAuthorizationIsIgnored) {
  EXPECT_TRUE(generate(server_->channel(), valid_request(), {"whatever"}).status.ok());
  EXPECT_TRUE(generate(server_->channel(), valid_request()).status.ok());
}

// One call of `method` with `body` as its serialized request, whatever the method's type.
grpc::Status raw_call(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                      const std::string& body, const std::string& api_key = "",
                      std::chrono::milliseconds timeout = std::chrono::milliseconds(10000)) {
  grpc::GenericStub stub(channel);
  grpc::Slice slice(body);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ClientContext ctx;
  prepare(&ctx, {api_key, timeout});
  grpc::CompletionQueue cq;
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
      stub.PrepareUnaryCall(&ctx, method, request, &cq);
  call->StartCall();
  grpc::ByteBuffer reply;
  grpc::Status status;
  call->Finish(&reply, &status, nullptr);
  void* tag = nullptr;
  bool ok = false;
  if (!cq.Next(&tag, &ok)) return grpc::Status(grpc::StatusCode::UNKNOWN, "no completion");
  return status;
}

// With API keys on, a wrong key is UNAUTHENTICATED first, whatever the body: a caller without
// one learned the request types' names from INVALID_ARGUMENT, and was counted and logged as a
// client with a malformed body.
TEST(ServerAuth, AMalformedBodyWithoutAKeyIsUnauthenticated) {
  const std::string dir = fresh_temp_dir();
  const std::string model = make_tiny_model(dir), keys = dir + "/keys.txt";
  std::ofstream(keys) << "alpha-key\n";
  auto server = ServerProcess::start(model, {"--api-key-file", keys});
  ASSERT_TRUE(server);
  const std::string body = "\x08" + std::string(10, '\xff');  // a varint longer than any may be
  for (const std::string m : {"Generate", "Score", "GetModelInfo"}) {
    for (const std::string key : {"", "wrong"}) {
      const grpc::Status st = raw_call(server->channel(), "/cemlm.v1.Inference/" + m, body, key);
      EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED)
          << m << " key '" << key << "': " << st.error_message();
    }
    const grpc::Status st =
        raw_call(server->channel(), "/cemlm.v1.Inference/" + m, body, "alpha-key");
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << m << ": " << st.error_message();
  }
  const auto metrics = parse_metrics(server->metrics_text());
  EXPECT_EQ(metric(metrics, "cemlm:request_errors_total", "code=\"UNAUTHENTICATED\""), 6);
}

// tests/server/body_flood.py against `server`: 200 slow 4 MB bodies without a key on one
// connection (`tls`: "tls" or ""); its JSON summary, or null when it failed.
nlohmann::json body_flood(const ServerProcess& server, const std::string& dir,
                          const std::string& tls) {
  const std::string out = dir + "/flood.json";
  const std::string cmd = "/usr/bin/python3 '" + std::string(std::getenv("CEMLM_SOURCE_DIR")) +
                          "/tests/server/body_flood.py' " + std::to_string(server.port()) + " " +
                          std::to_string(server.pid()) + " 200 60 " + tls + " > '" + out + "'";
  if (std::system(cmd.c_str()) != 0) return nullptr;
  std::ifstream in(out);
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

// Streams that send all of a large body but its last byte, without a key, are held by gRPC before
// the service sees them. --grpc-memory bounds what they hold: gRPC resets streams
// (ENHANCE_YOUR_CALM, RESOURCE_EXHAUSTED at a gRPC client) once it is over the quota, and the
// server then answers a client with a key as before. Without the quota (--grpc-memory 0) the same
// flood's 800 MB all stay held, none reset: measured 1.06 GB resident against 0.36 GB with 32M.
TEST(ServerSecurity, SlowBodiesCannotHoldMoreThanTheGrpcMemory) {
  if (std::system("/usr/bin/python3 -c 'import h2' 2>/dev/null") != 0)
    GTEST_SKIP() << "python3-h2 is not installed (scripts/setup.sh installs it for the tests)";
  const std::string dir = fresh_temp_dir();
  const std::string model = make_tiny_model(dir), keys = dir + "/keys.txt";
  std::ofstream(keys) << "alpha-key\n";
  auto server = ServerProcess::start(model, {"--api-key-file", keys, "--grpc-memory", "32M"});
  ASSERT_TRUE(server);
  const nlohmann::json flood = body_flood(*server, dir, "");
  SCOPED_TRACE(flood.dump());
  EXPECT_GT(flood["resets"].get<int>(), 0);
  EXPECT_EQ(flood["codes"], nlohmann::json::array({11}));  // ENHANCE_YOUR_CALM
  // 200 bodies of 4 MB: 800 MB held without the quota.
  EXPECT_LT(flood["rss_peak_kb"].get<int64_t>() - flood["rss_before_kb"].get<int64_t>(), 400'000);
  EXPECT_TRUE(generate(server->channel(), valid_request(), {"alpha-key"}).status.ok());
  EXPECT_EQ(health(server->channel()), "SERVING");
}

// A call whose deadline passes before its body is sent reaches the server with no message, as a
// malformed body does; it is counted DEADLINE_EXCEEDED, not as a malformed body the client sent
// (a loaded server that read a call late counted it so).
// A Generate call of which the client sends the headers only, then does `after_headers` (with the
// call's context) and waits for its status.
grpc::Status headers_only(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* ctx,
                          const std::function<void(grpc::ClientContext*)>& after_headers,
                          const std::string& method = "Generate") {
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(ctx, "/cemlm.v1.Inference/" + method, &cq);
  void* tag = nullptr;
  bool ok = false;
  call->StartCall(reinterpret_cast<void*>(1));
  if (!cq.Next(&tag, &ok)) return grpc::Status(grpc::StatusCode::INTERNAL, "no start");
  after_headers(ctx);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(2));
  while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(2)) {
  }
  return status;
}

TEST_F(ServerValidation, ADeadlineBeforeTheBodyIsNoMalformedBody) {
  const auto before = parse_metrics(server_->metrics_text());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
  const grpc::Status status = headers_only(server_->channel(), &ctx, [](grpc::ClientContext*) {
    std::this_thread::sleep_for(std::chrono::seconds(1));  // past the deadline, whatever the load
  });
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  const std::string labels = "method=\"Generate\"";
  EXPECT_TRUE(wait_for_metrics(*server_, [&](const auto& now) {
    return metric(now, "cemlm:requests_total", "code=\"DEADLINE_EXCEEDED\"," + labels) ==
           metric(before, "cemlm:requests_total", "code=\"DEADLINE_EXCEEDED\"," + labels) + 1;
  }));
  const auto after = parse_metrics(server_->metrics_text());
  EXPECT_EQ(metric(after, "cemlm:requests_total", "code=\"INVALID_ARGUMENT\"," + labels),
            metric(before, "cemlm:requests_total", "code=\"INVALID_ARGUMENT\"," + labels));
  EXPECT_EQ(server_->log().find("not a valid cemlm.v1.GenerateRequest"), std::string::npos)
      << server_->log();
}

// Likewise a call its client cancels before sending the body: counted CANCELLED, never as a
// malformed body (gRPC may not have marked the call cancelled yet when its status is made: 9 of
// 10 such Generate cancels within 2 ms of the headers counted INVALID_ARGUMENT and were logged,
// and 2-15% of the unary methods' until they looked again for a few milliseconds).
TEST_F(ServerValidation, ACancelBeforeTheBodyIsNoMalformedBody) {
  constexpr int kCalls = 20;
  for (const char* method : {"Generate", "Score", "Tokenize", "Detokenize", "GetModelInfo"}) {
    const auto before = parse_metrics(server_->metrics_text());
    for (int i = 0; i < kCalls; ++i) {
      grpc::ClientContext ctx;
      const grpc::Status status = headers_only(
          server_->channel(), &ctx, [](grpc::ClientContext* c) { c->TryCancel(); }, method);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
    }
    auto sum = [&](const std::map<std::string, double>& m, const char* code) {
      return metric(m, "cemlm:requests_total",
                    std::string("code=\"") + code + "\",method=\"" + method + "\"");
    };
    EXPECT_TRUE(wait_for_metrics(*server_, [&](const auto& now) {
      return sum(now, "CANCELLED") + sum(now, "INVALID_ARGUMENT") >=
             sum(before, "CANCELLED") + sum(before, "INVALID_ARGUMENT") + kCalls;
    })) << method;
    const auto after = parse_metrics(server_->metrics_text());
    EXPECT_EQ(sum(after, "CANCELLED"), sum(before, "CANCELLED") + kCalls) << method;
    EXPECT_EQ(sum(after, "INVALID_ARGUMENT"), sum(before, "INVALID_ARGUMENT")) << method;
  }
  EXPECT_EQ(server_->log().find("is not a valid cemlm.v1."), std::string::npos) << server_->log();
}

// A unary call with no message within the slack of its deadline (20 ms) is that deadline's cancel
// on its way, whose client has already seen DEADLINE_EXCEEDED: it waits for its deadline and
// counts as such, unlogged, whatever its body (2 of 300 GetModelInfo calls with 1 ms deadlines
// counted INVALID_ARGUMENT and were logged as malformed bodies).
TEST_F(ServerValidation, NoBodyNearItsDeadlineCountsAsTheDeadline) {
  for (const char* method : {"Score", "GetModelInfo"}) {
    const auto before = parse_metrics(server_->metrics_text());
    auto count = [&](const std::map<std::string, double>& m, const char* code) {
      return metric(m, "cemlm:requests_total",
                    std::string("code=\"") + code + "\",method=\"" + method + "\"");
    };
    const grpc::Status st =
        raw_call(server_->channel(), std::string("/cemlm.v1.Inference/") + method,
                 "\x08" + std::string(10, '\xff'), "", std::chrono::milliseconds(10));
    EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
        << method << ": " << st.error_message();
    EXPECT_TRUE(wait_for_metrics(*server_, [&](const auto& now) {
      return count(now, "DEADLINE_EXCEEDED") == count(before, "DEADLINE_EXCEEDED") + 1;
    })) << method;
    const auto after = parse_metrics(server_->metrics_text());
    EXPECT_EQ(count(after, "INVALID_ARGUMENT"), count(before, "INVALID_ARGUMENT")) << method;
  }
  EXPECT_EQ(server_->log().find("is not a valid cemlm.v1."), std::string::npos) << server_->log();
}

// Unset, max_new_tokens is the default (64) capped to the room the prompt leaves: a long prompt
// gets the tokens that fit rather than an error about a length the client never asked for.
TEST_F(ServerValidation, UnsetMaxNewTokensFitsTheRoomLeft) {
  v1::GenerateRequest req = valid_request();
  req.clear_prompt_text();
  req.mutable_sampling()->clear_max_new_tokens();
  req.mutable_sampling()->set_ignore_eos(true);
  for (int i = 0; i < 500; ++i) req.add_prompt_ids(7);
  Stream s = generate(server_->channel(), req);
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_EQ(s.ids().size(), 12u);
  EXPECT_EQ(s.messages.back().finish_reason(), v1::FINISH_REASON_LENGTH);
  req.clear_prompt_ids();
  req.add_prompt_ids(7);
  s = generate(server_->channel(), req);
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_EQ(s.ids().size(), 64u);  // the default, where it fits
}

// A body that does not parse as the method's message (gRPC itself answered UNIMPLEMENTED or
// INTERNAL without a message, uncounted and unlogged): INVALID_ARGUMENT naming the message type,
// counted per method, logged at most once a second; the server serves on.
TEST_F(ServerValidation, UnparseableRequestBodyNamesTheMessageType) {
  const auto before = parse_metrics(server_->metrics_text());
  const std::vector<std::string> methods = {"Generate", "Score", "Tokenize", "Detokenize",
                                            "GetModelInfo"};
  for (const std::string& m : methods) {
    // Field 1 as a varint of ten 0xff bytes: longer than any varint may be.
    const grpc::Status st =
        raw_call(server_->channel(), "/cemlm.v1.Inference/" + m, "\x08" + std::string(10, '\xff'));
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << m << ": " << st.error_message();
    EXPECT_NE(st.error_message().find("not a valid cemlm.v1." + m + "Request message"),
              std::string::npos)
        << st.error_message();
  }
  ASSERT_TRUE(wait_for_metrics(*server_, [&](const auto& now) {
    for (const std::string& m : methods) {
      const std::string labels = "code=\"INVALID_ARGUMENT\",method=\"" + m + "\"";
      if (metric(now, "cemlm:requests_total", labels) !=
          metric(before, "cemlm:requests_total", labels) + 1)
        return false;
    }
    return true;
  }));
  // A Generate request whose request_id (a proto string) is not UTF-8 does not parse either.
  v1::GenerateRequest req = valid_request();
  std::string body;
  ASSERT_TRUE(req.SerializeToString(&body));
  body += std::string("\x3a\x02\xc3\x28", 4);  // field 7, 2 bytes: a broken UTF-8 sequence
  const grpc::Status st = raw_call(server_->channel(), "/cemlm.v1.Inference/Generate", body);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_NE(st.error_message().find("request_id"), std::string::npos) << st.error_message();
  // Logged (the first call at least: later ones within a second of a line are left out), once
  // the call is over (Generate's are looked at then: see ACancelBeforeTheBodyIsNoMalformedBody).
  std::string log = server_->log();
  for (int i = 0; i < 300 && log.find("Generate peer=") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    log = server_->log();
  }
  EXPECT_NE(log.find("Generate peer="), std::string::npos) << log;
  EXPECT_NE(log.find("status=INVALID_ARGUMENT message=\"the request body is not a valid "
                     "cemlm.v1.GenerateRequest"),
            std::string::npos)
      << log;
  // Protobuf's own line about the bytes goes through the server's log (prefixed, escaped), not
  // raw onto stderr; the other requests' messages do not speak of a string field they lack.
  EXPECT_EQ(log.find("[libprotobuf"), std::string::npos) << log;
  EXPECT_NE(log.find("error protobuf: String field \\'cemlm.v1.GenerateRequest.request_id\\' "
                     "contains invalid UTF-8"),
            std::string::npos)
      << log;
  const grpc::Status score = raw_call(server_->channel(), "/cemlm.v1.Inference/Score", "\x08");
  EXPECT_EQ(score.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << score.error_message();
  EXPECT_EQ(score.error_message().find("request_id"), std::string::npos) << score.error_message();
  EXPECT_TRUE(generate(server_->channel(), valid_request()).status.ok());
}

// A body over the 4 MiB the server reads is refused by gRPC itself, before any interceptor or
// handler (so it is not in requests_total: gRPC 1.51 offers no hook there), and the server serves
// on; just under the limit, the service answers (the prompt is too long for the model).
TEST_F(ServerValidation, OversizeRequestBodyIsRefused) {
  v1::GenerateRequest req = valid_request();
  req.set_prompt_text(std::string(5 << 20, 'a'));
  std::string body;
  ASSERT_TRUE(req.SerializeToString(&body));
  const grpc::Status st = raw_call(server_->channel(), "/cemlm.v1.Inference/Generate", body);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_NE(st.error_message().find("larger than max"), std::string::npos) << st.error_message();
  req.set_prompt_text(std::string((4 << 20) - 64, 'a'));
  ASSERT_TRUE(req.SerializeToString(&body));
  const grpc::Status under = raw_call(server_->channel(), "/cemlm.v1.Inference/Generate", body);
  EXPECT_EQ(under.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << under.error_message();
  EXPECT_TRUE(generate(server_->channel(), valid_request()).status.ok());
}

// A self-signed certificate for localhost and 127.0.0.1 and its key, as dir/cert.pem and
// dir/key.pem; false when openssl is missing.
bool make_certificate(const std::string& dir) {
  const std::string openssl =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost -addext "
      "subjectAltName=IP:127.0.0.1,DNS:localhost -keyout " +
      dir + "/key.pem -out " + dir + "/cert.pem >/dev/null 2>&1";
  return std::system(openssl.c_str()) == 0;
}

// Client credentials that trust dir/cert.pem.
std::shared_ptr<grpc::ChannelCredentials> trusting(const std::string& dir) {
  std::ifstream pem_in(dir + "/cert.pem");
  std::stringstream pem;
  pem << pem_in.rdbuf();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = pem.str();
  return grpc::SslCredentials(ssl);
}

// A self-signed certificate for localhost and 127.0.0.1 (or the subjectAltName `names`) valid
// from `from` to `to` seconds from now (dates the openssl command cannot set), and its key, as
// dir/cert.pem and dir/key.pem.
void make_certificate_between(const std::string& dir, long from, long to,
                              const char* names = "IP:127.0.0.1,DNS:localhost") {
  EVP_PKEY* key = EVP_EC_gen("P-256");
  X509* x = X509_new();
  X509_set_version(x, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(x), 1);
  X509_gmtime_adj(X509_getm_notBefore(x), from);
  X509_gmtime_adj(X509_getm_notAfter(x), to);
  X509_set_pubkey(x, key);
  X509_NAME* name = X509_get_subject_name(x);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>("localhost"), -1, -1, 0);
  X509_set_issuer_name(x, name);
  X509V3_CTX ctx;
  X509V3_set_ctx(&ctx, x, x, nullptr, nullptr, 0);
  X509_EXTENSION* san = X509V3_EXT_conf_nid(nullptr, &ctx, NID_subject_alt_name, names);
  X509_add_ext(x, san, -1);
  X509_EXTENSION_free(san);
  X509_sign(x, key, EVP_sha256());
  std::FILE* cert = std::fopen((dir + "/cert.pem").c_str(), "w");
  PEM_write_X509(cert, x);
  std::fclose(cert);
  std::FILE* pkey = std::fopen((dir + "/key.pem").c_str(), "w");
  PEM_write_PrivateKey(pkey, key, nullptr, nullptr, 0, nullptr, nullptr);
  std::fclose(pkey);
  X509_free(x);
  EVP_PKEY_free(key);
}

// A certificate that has expired, or is not valid yet, is refused at start, naming the flag and
// the date: every TLS client failed while health said SERVING. One that expires within a week
// serves, warned of.
TEST(ServerTls, ACertificateOutOfItsDatesIsRefused) {
  const std::string dir = fresh_temp_dir(), model = make_tiny_model(dir);
  const std::string cert = dir + "/cert.pem", key = dir + "/key.pem";
  constexpr long kDay = 24 * 3600;
  for (const auto& [from, to, said] : {std::tuple{-2 * kDay, -kDay, "' expired on "},
                                       std::tuple{kDay, 2 * kDay, "' is not valid until "}}) {
    make_certificate_between(dir, from, to);
    // Killed after 60 s: a server that took the certificate would serve until then.
    CemlmRun run({"serve", "--model", model, "--host", "127.0.0.1", "--port", "0", "--metrics-port",
                  "0", "--tls-cert", cert, "--tls-key", key});
    ASSERT_GT(run.pid(), 0);
    std::promise<void> ended;
    std::thread backstop([&, done = ended.get_future()] {
      if (done.wait_for(std::chrono::seconds(60)) != std::future_status::ready)
        ::kill(run.pid(), SIGKILL);
    });
    std::string out, err;
    const int rc = run.wait(&out, &err);
    ended.set_value();
    backstop.join();
    EXPECT_EQ(rc, 1) << said << ": " << err;
    EXPECT_NE(err.find("--tls-cert '" + cert + said), std::string::npos) << err;
  }
  make_certificate_between(dir, -kDay, 3 * kDay);
  auto server = ServerProcess::start(model, {"--tls-cert", cert, "--tls-key", key}, trusting(dir));
  ASSERT_TRUE(server);
  EXPECT_TRUE(generate(server->channel(), valid_request()).status.ok());
  EXPECT_NE(server->log().find("--tls-cert '" + cert + "' expires on "), std::string::npos)
      << server->log();
}

TEST(ServerTls, ServesOverTls) {
  const std::string dir = fresh_temp_dir();
  const std::string cert = dir + "/cert.pem", key = dir + "/key.pem";
  if (!make_certificate(dir))
    GTEST_SKIP() << "openssl is not installed (scripts/setup.sh installs it for the tests)";
  // Read at start only: gRPC's static pair (the other TLS tests watch the files).
  auto server = ServerProcess::start(
      make_tiny_model(dir), {"--tls-cert", cert, "--tls-key", key, "--tls-reload-interval", "0"},
      trusting(dir));
  ASSERT_TRUE(server);
  EXPECT_TRUE(generate(server->channel(), valid_request()).status.ok());
  std::string out;
  EXPECT_EQ(run_cemlm({"client", "health", "--addr", server->addr(), "--tls-ca", cert}, &out), 0);
  EXPECT_EQ(out, "SERVING\n");
  // A plaintext client gets nowhere.
  auto plain = grpc::CreateChannel(server->addr(), grpc::InsecureChannelCredentials());
  EXPECT_FALSE(generate(plain, valid_request(), {"", std::chrono::milliseconds(2000)}).status.ok());
  // A CA file that is no PEM certificate is named (gRPC said "empty address list").
  std::string err;
  std::ofstream(dir + "/notes.txt") << "not a certificate\n";
  EXPECT_EQ(
      run_cemlm({"client", "health", "--addr", server->addr(), "--tls-ca", dir + "/notes.txt"},
                &out, &err),
      2);
  EXPECT_NE(err.find("--tls-ca: '" + dir + "/notes.txt' holds no PEM certificate"),
            std::string::npos)
      << err;
  // The client's connection errors say what to change, without gRPC's own log lines before them
  // ("E1206 … ssl_transport_security.cc:1501] Handshake failed …"): plaintext against TLS, a
  // CA that did not sign the server's certificate, TLS against plaintext.
  const std::string other = fresh_temp_dir(), elsewhere = fresh_temp_dir();
  ASSERT_TRUE(make_certificate(other));
  auto plaintext = ServerProcess::start(make_tiny_model(fresh_temp_dir()));
  ASSERT_TRUE(plaintext);
  // A server whose certificate names another host.
  make_certificate_between(elsewhere, -3600, 3600, "DNS:wrong.example");
  auto misnamed = ServerProcess::start_listening(
      make_tiny_model(elsewhere),
      {"--tls-cert", elsewhere + "/cert.pem", "--tls-key", elsewhere + "/key.pem"},
      trusting(elsewhere));
  ASSERT_TRUE(misnamed);
  for (const auto& [args, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--addr", server->addr()},
            "(a server with TLS on closes plaintext connections: is "
            "--tls-ca missing?)"},
           {{"--addr", server->addr(), "--tls-ca", other + "/cert.pem"},
            "certificate verify failed (the server's certificate is not signed by a --tls-ca "
            "certificate, or is out of its dates: expired, or not valid yet by this machine's "
            "clock)"},
           {{"--addr", plaintext->addr(), "--tls-ca", cert},
            "(the server does not speak TLS: leave out --tls-ca)"},
           {{"--addr", misnamed->addr(), "--tls-ca", elsewhere + "/cert.pem"},
            "is not in peer certificate (the server's certificate does not name the host of "
            "--addr: connect by a name or address it holds)"}}) {
    std::vector<std::string> cmd = {"client", "health"};
    cmd.insert(cmd.end(), args.begin(), args.end());
    EXPECT_EQ(run_cemlm(cmd, &out, &err), 1) << err;
    EXPECT_TRUE(err.starts_with("error: UNAVAILABLE: ")) << err;
    EXPECT_NE(err.find(says), std::string::npos) << err;
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  }
}

// Under TLS, a call of cemlm.v1.Inference without a valid key is refused as its headers arrive
// (gRPC's auth filter), so the slow-body flood of SlowBodiesCannotHoldMoreThanTheGrpcMemory gets
// no body read at all: every stream answered UNAUTHENTICATED at once, counted as the service
// counts refused keys. Health stays open and a valid key is served. (On plaintext the service
// checks keys once the body has arrived: the quota bounds that case.)
TEST(ServerTls, CallsWithoutAKeyAreRefusedBeforeTheirBodies) {
  if (std::system("/usr/bin/python3 -c 'import h2' 2>/dev/null") != 0)
    GTEST_SKIP() << "python3-h2 is not installed (scripts/setup.sh installs it for the tests)";
  const std::string dir = fresh_temp_dir();
  if (!make_certificate(dir))
    GTEST_SKIP() << "openssl is not installed (scripts/setup.sh installs it for the tests)";
  std::ofstream(dir + "/keys.txt") << "alpha-key\n";
  auto server =
      ServerProcess::start(make_tiny_model(dir),
                           {"--tls-cert", dir + "/cert.pem", "--tls-key", dir + "/key.pem",
                            "--api-key-file", dir + "/keys.txt", "--grpc-memory", "0"},
                           trusting(dir));
  ASSERT_TRUE(server);
  const nlohmann::json flood = body_flood(*server, dir, "tls");
  SCOPED_TRACE(flood.dump());
  EXPECT_EQ(flood["grpc_status"], nlohmann::json({{"16", 200}}));
  // The streams' first windows at most (64 KiB each), not their 800 MB of bodies.
  EXPECT_LT(flood["sent"].get<int64_t>(), 200 * 65536 + 1);
  EXPECT_LT(flood["rss_peak_kb"].get<int64_t>() - flood["rss_before_kb"].get<int64_t>(), 100'000);
  EXPECT_EQ(health(server->channel()), "SERVING");
  EXPECT_TRUE(generate(server->channel(), valid_request(), {"alpha-key"}).status.ok());
  EXPECT_EQ(generate(server->channel(), valid_request(), {"wrong"}).status.error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  const auto m = parse_metrics(server->metrics_text());
  EXPECT_EQ(metric(m, "cemlm:request_errors_total", "code=\"UNAUTHENTICATED\""), 201);
  EXPECT_EQ(metric(m, "cemlm:requests_total", "code=\"UNAUTHENTICATED\",method=\"Generate\""), 201);
}

// Health through a new channel that trusts dir/cert.pem only, every 100 ms until it answers
// SERVING (true) or fails to (false), or 60 s pass (gRPC reads the files every second here).
bool serves_certificate_of(const ServerProcess& server, const std::string& dir, bool expect) {
  for (int i = 0; i < 600; ++i) {
    if ((health(grpc::CreateChannel(server.addr(), trusting(dir))) == "SERVING") == expect)
      return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

// The end (notAfter) of the certificate in `path`, in Unix seconds.
double not_after_of(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "r");
  X509* cert = f ? PEM_read_X509(f, nullptr, nullptr, nullptr) : nullptr;
  if (f) std::fclose(f);
  EXPECT_NE(cert, nullptr) << path;
  if (!cert) return -1;
  ASN1_TIME* epoch = ASN1_TIME_set(nullptr, 0);
  int days = 0, seconds = 0;
  EXPECT_EQ(ASN1_TIME_diff(&days, &seconds, epoch, X509_get0_notAfter(cert)), 1);
  ASN1_TIME_free(epoch);
  X509_free(cert);
  return double(days) * 86400 + seconds;
}

// Whether cemlm:tls_certificate_expiry_timestamp_seconds comes to read `end` (within 30 s).
bool exports_certificate_end(const ServerProcess& server, double end) {
  return wait_for_metrics(server, [end](const auto& m) {
    return metric(m, "cemlm:tls_certificate_expiry_timestamp_seconds") == end;
  });
}

// Whether the server's log holds `text`, looked for every 100 ms for up to 60 s.
bool log_says(const ServerProcess& server, const std::string& text) {
  for (int i = 0; i < 600; ++i) {
    if (server.log().find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

// With --tls-reload-interval, a renewed pair written over the files serves new connections
// without a restart, and the log says so; a file replaced by something that cannot serve is
// named in the log (new connections fail meanwhile), and a good pair written back serves again.
TEST(ServerTls, ARenewedCertificateServesWithoutARestart) {
  const std::string dir = fresh_temp_dir(), old_pair = dir + "/old", new_pair = dir + "/new";
  const std::string live = dir + "/live";
  for (const std::string& d : {old_pair, new_pair, live}) std::filesystem::create_directory(d);
  constexpr long kDay = 24 * 3600;
  make_certificate_between(old_pair, -kDay, 30 * kDay);
  make_certificate_between(new_pair, -kDay, 40 * kDay);  // another end: the gauge changes
  for (const char* f : {"/cert.pem", "/key.pem"})
    std::filesystem::copy_file(old_pair + f, live + f);
  auto server = ServerProcess::start(make_tiny_model(dir),
                                     {"--tls-cert", live + "/cert.pem", "--tls-key",
                                      live + "/key.pem", "--tls-reload-interval", "1"},
                                     trusting(old_pair));
  ASSERT_TRUE(server);
  EXPECT_TRUE(generate(server->channel(), valid_request()).status.ok());
  EXPECT_TRUE(exports_certificate_end(*server, not_after_of(old_pair + "/cert.pem")));
  // As a Secret's update lands: each file replaced whole, the key first.
  for (const char* f : {"/key.pem", "/cert.pem"}) {
    std::filesystem::copy_file(new_pair + f, live + f + std::string(".tmp"));
    std::filesystem::rename(live + f + std::string(".tmp"), live + f);
  }
  ASSERT_TRUE(serves_certificate_of(*server, new_pair, true)) << server->log();
  EXPECT_TRUE(serves_certificate_of(*server, old_pair, false));
  // The server's look at the files and gRPC's read run on timers of their own.
  EXPECT_TRUE(log_says(*server, "TLS: --tls-cert '" + live +
                                    "/cert.pem' and --tls-key changed: connections made from "
                                    "now on get the certificate of CN=localhost, valid until "))
      << server->log();
  EXPECT_TRUE(exports_certificate_end(*server, not_after_of(new_pair + "/cert.pem")));
  // The connection the test opened first keeps its session.
  EXPECT_TRUE(generate(server->channel(), valid_request()).status.ok());

  // A file that cannot be read changes nothing: gRPC keeps what it read last.
  std::filesystem::rename(live + "/cert.pem", live + "/cert.moved");
  EXPECT_TRUE(log_says(*server, "TLS: --tls-cert: cannot read '" + live + "/cert.pem' (now)"))
      << server->log();
  EXPECT_TRUE(serves_certificate_of(*server, new_pair, true));
  std::filesystem::rename(live + "/cert.moved", live + "/cert.pem");

  // A certificate not valid yet is logged as such (the gauge reads 0: clients refuse it), then
  // as valid once it is.
  make_certificate_between(new_pair, 8, 50 * kDay);
  for (const char* f : {"/key.pem", "/cert.pem"}) {
    std::filesystem::copy_file(new_pair + f, live + f + std::string(".tmp"));
    std::filesystem::rename(live + f + std::string(".tmp"), live + f);
  }
  EXPECT_TRUE(log_says(*server, "/cert.pem' is not valid until ")) << server->log();
  EXPECT_TRUE(exports_certificate_end(*server, 0));
  EXPECT_TRUE(log_says(*server, "/cert.pem' is valid now")) << server->log();
  EXPECT_TRUE(exports_certificate_end(*server, not_after_of(new_pair + "/cert.pem")));
  EXPECT_TRUE(serves_certificate_of(*server, new_pair, true)) << server->log();

  // An empty file (one being copied over: cp truncates it first) is no pair: the server goes on
  // serving what it had. gRPC read the files itself, and an empty key ended the process on an
  // assertion in its TLS code (SIGABRT).
  std::ofstream(live + "/key.pem", std::ios::trunc).close();
  EXPECT_TRUE(log_says(*server, "TLS: --tls-key '" + live + "/key.pem' is empty (now)"))
      << server->log();
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // gRPC's reads, a second apart
  EXPECT_TRUE(serves_certificate_of(*server, new_pair, true)) << server->log();
  EXPECT_TRUE(generate(server->channel(), valid_request()).status.ok());
  std::filesystem::copy_file(new_pair + "/key.pem", live + "/key.pem",
                             std::filesystem::copy_options::overwrite_existing);

  std::ofstream(live + "/cert.pem") << "not a certificate\n";
  EXPECT_TRUE(serves_certificate_of(*server, new_pair, false));
  EXPECT_TRUE(log_says(*server, "TLS: the files changed: --tls-cert '" + live +
                                    "/cert.pem' holds no PEM certificate"))
      << server->log();
  EXPECT_TRUE(exports_certificate_end(*server, 0));
  std::filesystem::copy_file(new_pair + "/cert.pem", live + "/cert.pem",
                             std::filesystem::copy_options::overwrite_existing);
  EXPECT_TRUE(serves_certificate_of(*server, new_pair, true)) << server->log();
}

// With --api-key-reload-interval, a key file whose text changes is served without a signal (as a
// Kubernetes Secret updates): keys kept keep their prefix-cache blocks. A text that does not load
// or a file that goes away is logged once and leaves the keys as they were; a SIGHUP reload is
// not done again by the next look; a file being written is not taken half-way.
TEST(ServerAuth, AChangedKeyFileIsReadWithoutASignal) {
  const std::string dir = fresh_temp_dir();
  const std::string model = make_tiny_model(dir), keys = dir + "/keys.txt";
  std::ofstream(keys) << "key-a\nkey-b\n";
  auto server =
      ServerProcess::start(model, {"--api-key-file", keys, "--api-key-reload-interval", "1"});
  ASSERT_TRUE(server);
  auto cached = [&](const std::string& key) { return cached_with_key(*server, key); };
  auto replace = [&](const std::string& text) {  // whole, as a Secret's update lands
    std::ofstream(keys + ".tmp") << text;
    std::filesystem::rename(keys + ".tmp", keys);
  };
  auto times_logged = [&](const std::string& text) {
    const std::string log = server->log();
    int n = 0;
    for (size_t at = log.find(text); at != std::string::npos; at = log.find(text, at + 1)) ++n;
    return n;
  };
  const std::string changed = "--api-key-file changed: ";
  EXPECT_EQ(cached("key-a"), 0);
  EXPECT_EQ(cached("key-a"), 16);
  EXPECT_EQ(cached("key-c"), -2);
  replace("key-c\nkey-a\n");
  ASSERT_TRUE(log_says(*server, changed + "api keys read again from " + keys + ": 2 keys"))
      << server->log();
  EXPECT_EQ(cached("key-b"), -2);
  EXPECT_EQ(cached("key-c"), 0);
  EXPECT_EQ(cached("key-a"), 16);

  replace("key-c\nkey-c\n");
  const std::string refused = changed + "--api-key-file: line 2 of '" + keys +
                              "' repeats the key of line 1; list each key once; the keys served "
                              "are unchanged";
  ASSERT_TRUE(log_says(*server, refused)) << server->log();
  EXPECT_EQ(cached("key-a"), 16);
  std::filesystem::remove(keys);
  const std::string gone =
      changed + "--api-key-file: '" + keys + "' does not exist; the keys served are unchanged";
  ASSERT_TRUE(log_says(*server, gone)) << server->log();
  EXPECT_EQ(cached("key-a"), 16);
  EXPECT_EQ(cached("key-b"), -2);
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // two more looks at least
  EXPECT_EQ(times_logged(refused), 1) << server->log();
  EXPECT_EQ(times_logged(gone), 1) << server->log();

  replace("key-d\n");
  ASSERT_EQ(::kill(server->pid(), SIGHUP), 0);
  ASSERT_TRUE(log_says(*server, "SIGHUP: api keys read again from " + keys + ": 1 keys"))
      << server->log();
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  const std::string applied = changed + "api keys read again";
  EXPECT_EQ(times_logged(applied), 1) << server->log();
  EXPECT_EQ(cached("key-a"), -2);
  EXPECT_EQ(cached("key-d"), 0);

  // A file written in place by a writer still at work: the looks meanwhile find a part of it (a
  // key cut short, which would be a key) written lately, and wait until it has settled.
  {
    std::ofstream out(keys, std::ios::trunc);
    out << "key-f" << std::flush;
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // a look at least
    out << "ull\n";
  }
  ASSERT_TRUE(log_says(*server, changed + "api keys read again from " + keys + ": 1 keys"))
      << server->log();
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  EXPECT_EQ(times_logged(applied), 2) << server->log();
  EXPECT_EQ(cached("key-f"), -2);
  EXPECT_EQ(cached("key-full"), 0);
  EXPECT_EQ(health(server->channel()), "SERVING");
}

// --tls-reload-interval or --api-key-reload-interval out of its range, or one of --tls-cert and
// --tls-key without the other, is a usage error (exit 2) naming the flag.
TEST(ServerTls, ReloadIntervalAndHalfAPairAreUsageErrors) {
  const std::string dir = fresh_temp_dir(), model = make_tiny_model(dir);
  make_certificate_between(dir, -3600, 3600);
  for (const auto& [args, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--tls-reload-interval", "-1"}, "--tls-reload-interval -1 must be in [0, 86400]"},
           {{"--tls-reload-interval", "86401"},
            "--tls-reload-interval 86401 must be in [0, 86400]"},
           {{"--api-key-reload-interval", "-1"},
            "--api-key-reload-interval -1 must be in [0, 86400] seconds (0: read --api-key-file "
            "at start and on SIGHUP only)"},
           {{"--tls-cert", dir + "/cert.pem"}, "--tls-cert and --tls-key must be given together"},
           {{"--tls-key", dir + "/key.pem"}, "--tls-cert and --tls-key must be given together"}}) {
    std::vector<std::string> cmd = {
        "serve", "--model", model, "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"};
    cmd.insert(cmd.end(), args.begin(), args.end());
    std::string out, err;
    EXPECT_EQ(run_cemlm(cmd, &out, &err), 2) << says << ": " << err;
    EXPECT_NE(err.find(says), std::string::npos) << err;
  }
}

// The server names the TLS file it cannot use, instead of failing to listen on a free port.
TEST(ServerTls, BadCertificateOrKeyIsNamed) {
  const std::string dir = fresh_temp_dir();
  const std::string cert = dir + "/cert.pem", key = dir + "/key.pem", other = dir + "/other.pem";
  const std::string encrypted = dir + "/encrypted.pem";
  if (!make_certificate(dir) ||
      std::system(("openssl genrsa -out " + other + " 2048 >/dev/null 2>&1").c_str()) != 0 ||
      std::system(("openssl pkey -in " + key + " -aes256 -passout pass:secret -out " + encrypted +
                   " >/dev/null 2>&1")
                      .c_str()) != 0)
    GTEST_SKIP() << "openssl is not installed (scripts/setup.sh installs it for the tests)";
  const std::string model = make_tiny_model(dir), notes = dir + "/notes.txt";
  const std::string damaged = dir + "/damaged.pem";
  std::ofstream(notes) << "not PEM\n";
  std::ofstream(damaged) << "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
  // A chain with another certificate before the server's own.
  const std::string reversed = dir + "/reversed.pem";
  std::filesystem::create_directory(dir + "/ca");
  make_certificate_between(dir + "/ca", -3600, 3600);
  std::ofstream(reversed) << std::ifstream(dir + "/ca/cert.pem").rdbuf()
                          << std::ifstream(cert).rdbuf();
  struct Case {
    std::string cert, key, message;
  };
  const std::vector<Case> cases = {
      {notes, key, "--tls-cert '" + notes + "' holds no PEM certificate"},
      {cert, notes, "--tls-key '" + notes + "' holds no PEM private key"},
      {cert, other,
       "--tls-cert and --tls-key are not a valid certificate chain and its private key"},
      {cert, encrypted, "--tls-key '" + encrypted + "' is encrypted (protected by a passphrase)"},
      {damaged, key, "--tls-cert '" + damaged + "' holds a PEM block OpenSSL cannot read"},
      {reversed, key,
       "--tls-cert '" + reversed + "' holds the certificate of --tls-key '" + key +
           "' in place 2 of its chain: put the server's own certificate first"},
      {cert, damaged, "--tls-key '" + damaged + "' holds no PEM private key"},
  };
  for (const Case& c : cases) {
    std::string out, err;
    EXPECT_EQ(run_cemlm({"serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
                         "--metrics-port", "0", "--tls-cert", c.cert, "--tls-key", c.key},
                        &out, &err),
              1)
        << c.message;
    EXPECT_NE(err.find(c.message), std::string::npos) << err;
  }
}

}  // namespace
}  // namespace cemlm::testing_server
