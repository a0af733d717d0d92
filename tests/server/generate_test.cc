// Generate through a real `cemlm serve` process: streaming contents, 64 concurrent streams with
// mixed T, cancellation, deadlines, a client that stopped answering keepalive pings freeing
// the engine (seen in /metrics) and one that pings while it waits kept, and the bounded queue
// answering RESOURCE_EXHAUSTED.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <map>
#include <thread>

#include "cemlm/server/status_map.h"
#include "client_util.h"
#include "server_process.h"

namespace cemlm::testing_server {
namespace {

using namespace std::chrono_literals;

std::vector<int> some_ids(int n, int salt = 0) {
  std::vector<int> ids;
  for (int i = 0; i < n; ++i) ids.push_back(4 + (i * 37 + salt * 11) % 300);
  return ids;
}

// One HTTP/2 frame: 3-byte length, type, flags, stream id.
std::string h2_frame(uint8_t type, uint8_t flags, uint32_t stream, const std::string& payload) {
  std::string f;
  for (int shift : {16, 8, 0}) f += char((payload.size() >> shift) & 0xFF);
  f += char(type);
  f += char(flags);
  for (int shift : {24, 16, 8, 0}) f += char((stream >> shift) & 0xFF);
  return f + payload;
}

// A call to 127.0.0.1:port sent by hand over HTTP/2, with the headers `extra` added: gRPC's own
// clients never send some legal values (a grpc-timeout of centuries), nor behave as a client
// whose host vanished (one that stops answering PINGs), and they enforce a call's deadline
// themselves (this one leaves it to the server). `stream_window` is the window each stream
// grants the server (0: HTTP/2's default of 65535 bytes); no window update follows.
class RawCall {
 public:
  RawCall(int port, const std::string& path, const std::string& body,
          const std::vector<std::pair<std::string, std::string>>& extra = {},
          uint32_t stream_window = 0) {
    auto literal = [](const std::string& name, const std::string& value) {
      return std::string(1, '\0') + char(name.size()) + name + char(value.size()) + value;
    };
    std::vector<std::pair<std::string, std::string>> fields = {{":method", "POST"},
                                                               {":scheme", "http"},
                                                               {":path", path},
                                                               {":authority", "localhost"},
                                                               {"content-type", "application/grpc"},
                                                               {"te", "trailers"}};
    fields.insert(fields.end(), extra.begin(), extra.end());
    std::string headers;
    for (const auto& [name, value] : fields) headers += literal(name, value);
    std::string message(1, '\0');
    for (int shift : {24, 16, 8, 0}) message += char((body.size() >> shift) & 0xFF);
    std::string settings;
    if (stream_window > 0) {
      settings = {'\0', '\4'};  // SETTINGS_INITIAL_WINDOW_SIZE
      for (int shift : {24, 16, 8, 0}) settings += char((stream_window >> shift) & 0xFF);
    }
    const std::string out = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + h2_frame(4, 0, 0, settings) +
                            h2_frame(1, 4, 1, headers) + h2_frame(0, 1, 1, message + body);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(port));
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sent_ = connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
            write(fd_, out.data(), out.size()) == ssize_t(out.size());
  }
  ~RawCall() { close(fd_); }
  // Sends a PING of the client's own, with `payload` (8 bytes) to find its ACK by.
  bool ping(const std::string& payload) {
    const std::string frame = h2_frame(6, 0, 0, payload);
    return sent_ && write(fd_, frame.data(), frame.size()) == ssize_t(frame.size());
  }
  RawCall(const RawCall&) = delete;
  RawCall& operator=(const RawCall&) = delete;

  enum class End { kStopped, kClosed, kTimedOut };
  // Reads whole frames for up to `limit`, passing each (type, flags, payload) to `stop` until it
  // returns true, or the server closes the connection. SETTINGS are acknowledged, and PINGs when
  // `answer_pings` (the server holds a call's trailers until they are).
  End read_frames(std::chrono::seconds limit, bool answer_pings,
                  const std::function<bool(uint8_t, uint8_t, const std::string&)>& stop) {
    if (!sent_) return End::kClosed;
    std::string in;
    const auto end = std::chrono::steady_clock::now() + limit;
    pollfd p{fd_, POLLIN, 0};
    char buf[4096];
    while (std::chrono::steady_clock::now() < end && poll(&p, 1, 100) >= 0) {
      if (!(p.revents & (POLLIN | POLLHUP | POLLERR))) continue;
      const ssize_t n = read(fd_, buf, sizeof buf);
      if (n <= 0) return End::kClosed;
      in.append(buf, size_t(n));
      while (in.size() >= 9) {
        const size_t len = size_t(uint8_t(in[0])) << 16 | size_t(uint8_t(in[1])) << 8 | uint8_t(in[2]);
        if (in.size() < 9 + len) break;
        const uint8_t type = uint8_t(in[3]), flags = uint8_t(in[4]);
        const std::string payload = in.substr(9, len);
        in.erase(0, 9 + len);
        const bool ack = !(flags & 1) && (type == 4 || (type == 6 && answer_pings));
        const std::string reply = ack ? h2_frame(type, 1, 0, type == 6 ? payload : "") : "";
        if (!reply.empty() && write(fd_, reply.data(), reply.size()) != ssize_t(reply.size()))
          return End::kClosed;
        if (stop(type, flags, payload)) return End::kStopped;
      }
    }
    return End::kTimedOut;
  }

 private:
  int fd_ = -1;
  bool sent_ = false;
};

// The grpc-status of a unary-or-streaming call sent by hand with the header `extra`; -1 when no
// status came within 10 s. The trailers' first "grpc-status" is a literal (name, length, digits).
int raw_grpc_status(int port, const std::string& path, const std::string& body,
                    const std::pair<std::string, std::string>& extra) {
  RawCall call(port, path, body, {extra});
  int status = -1;
  call.read_frames(10s, true, [&](uint8_t type, uint8_t, const std::string& payload) {
    const size_t at = type == 1 ? payload.find("grpc-status") : std::string::npos;
    if (at != std::string::npos && payload.size() > at + 12)
      status = std::stoi(payload.substr(at + 12, size_t(payload[at + 11])));
    return status >= 0;
  });
  return status;
}

// The server's log once it holds `needle` (a call's line is written when the call is done), or
// as it is after 10 s.
std::string log_with(const ServerProcess& server, const std::string& needle) {
  std::string log = server.log();
  for (auto end = std::chrono::steady_clock::now() + 10s;
       log.find(needle) == std::string::npos && std::chrono::steady_clock::now() < end;
       std::this_thread::sleep_for(10ms))
    log = server.log();
  return log;
}

// A request that is still running when a test acts on it, however loaded the machine: this many
// tokens at T = 8 take many seconds on the tiny model (2000 took ~0.4 s, and were done before the
// test's next call in a busy full ctest run). Tests cancel it.
constexpr int kLongRequest = 16000, kLongSeqLen = 16384;

class ServerGenerate : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = make_tiny_model(fresh_temp_dir(), {.max_seq_len = kLongSeqLen});
    server_ = ServerProcess::start(model_);
    ASSERT_TRUE(server_);
  }
  std::string model_;
  std::unique_ptr<ServerProcess> server_;
};

TEST_F(ServerGenerate, StreamsTokensLogprobsAndFinalUsage) {
  v1::GenerateRequest req;
  req.set_prompt_text("The cat sat on the mat.");
  req.set_recursion_depth(3);
  req.set_logprobs(true);
  const std::string request_id = "stream-1" + std::string(248, '-');  // 256 bytes, the most
  req.set_request_id(request_id);
  req.mutable_sampling()->set_max_new_tokens(12);
  req.mutable_sampling()->set_ignore_eos(true);
  req.mutable_sampling()->set_top_logprobs(3);
  req.mutable_sampling()->set_seed(5);
  const Stream s = generate(server_->channel(), req);
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  ASSERT_FALSE(s.messages.empty());
  int logprobs = 0, tops = 0;
  for (size_t i = 0; i < s.messages.size(); ++i) {
    const auto& m = s.messages[i];
    EXPECT_EQ(m.logprobs_size(), m.token_ids_size());
    EXPECT_EQ(m.top_logprobs_size(), m.token_ids_size());
    for (const auto& t : m.top_logprobs()) EXPECT_EQ(t.top_size(), 3);
    for (float lp : m.logprobs()) EXPECT_LE(lp, 0.0f);
    logprobs += m.logprobs_size();
    tops += m.top_logprobs_size();
    const bool last = i + 1 == s.messages.size();
    EXPECT_EQ(m.finish_reason() != v1::FINISH_REASON_UNSPECIFIED, last);
  }
  EXPECT_EQ(s.ids().size(), 12u);
  EXPECT_EQ(logprobs, 12);
  EXPECT_EQ(tops, 12);
  const v1::GenerateResponse& last = s.messages.back();
  EXPECT_EQ(last.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(last.request_id(), request_id);
  EXPECT_EQ(last.usage().generated_tokens(), 12);
  EXPECT_GT(last.usage().prompt_tokens(), 0);
  EXPECT_GT(last.usage().recursion_steps(), 0);
  EXPECT_GT(last.timing().e2e_seconds(), 0);
  EXPECT_GE(last.timing().e2e_seconds(), last.timing().first_token_seconds());

  // The streamed text is the detokenized ids; the same seed gives the same tokens again.
  grpc::ClientContext context;
  v1::DetokenizeRequest dreq;
  const std::vector<int> ids = s.ids();
  dreq.mutable_ids()->Add(ids.begin(), ids.end());
  v1::DetokenizeResponse dresp;
  ASSERT_TRUE(v1::Inference::NewStub(server_->channel())->Detokenize(&context, dreq, &dresp).ok());
  EXPECT_EQ(s.text(), dresp.text());
  EXPECT_EQ(generate(server_->channel(), req).ids(), ids);
  EXPECT_EQ(last.seed(), 5u);  // the request's own seed, reported back
  for (size_t i = 0; i + 1 < s.messages.size(); ++i) EXPECT_EQ(s.messages[i].seed(), 0u);

  // Without a seed one is drawn, and reported: sent back, it gives the same sample.
  req.mutable_sampling()->clear_seed();
  const Stream drawn = generate(server_->channel(), req), other = generate(server_->channel(), req);
  ASSERT_TRUE(drawn.status.ok() && other.status.ok());
  EXPECT_NE(drawn.messages.back().seed(), other.messages.back().seed());
  // Below 2^53, so that a JSON reader holding numbers as doubles (jq, JavaScript) keeps it.
  EXPECT_LT(drawn.messages.back().seed(), uint64_t(1) << 53);
  EXPECT_LT(other.messages.back().seed(), uint64_t(1) << 53);
  req.mutable_sampling()->set_seed(drawn.messages.back().seed());
  EXPECT_EQ(generate(server_->channel(), req).ids(), drawn.ids());
}

// logit_bias and min_new_tokens reach the engine: a +100 bias makes every greedy token its id,
// and the greedy first token, made a stop id, is held back for min_new_tokens tokens.
TEST_F(ServerGenerate, LogitBiasAndMinNewTokensTakeEffect) {
  v1::GenerateRequest req;
  req.set_prompt_text("The cat sat on the mat.");
  req.mutable_sampling()->set_temperature(0);
  req.mutable_sampling()->set_max_new_tokens(6);
  req.mutable_sampling()->set_ignore_eos(true);
  const Stream base = generate(server_->channel(), req);
  ASSERT_TRUE(base.status.ok()) << base.status.error_message();
  const std::vector<int> ids = base.ids();
  ASSERT_EQ(ids.size(), 6u);
  int forced = 5;
  while (std::find(ids.begin(), ids.end(), forced) != ids.end()) ++forced;
  v1::GenerateRequest biased = req;
  (*biased.mutable_sampling()->mutable_logit_bias())[forced] = 100;
  const Stream b = generate(server_->channel(), biased);
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  EXPECT_EQ(b.ids(), std::vector<int>(6, forced));
  v1::GenerateRequest held = req;
  held.mutable_sampling()->add_stop_token_ids(ids[0]);
  const Stream stopped = generate(server_->channel(), held);
  ASSERT_TRUE(stopped.status.ok()) << stopped.status.error_message();
  EXPECT_EQ(stopped.ids(), std::vector<int>{ids[0]});
  held.mutable_sampling()->set_min_new_tokens(4);
  const Stream h = generate(server_->channel(), held);
  ASSERT_TRUE(h.status.ok()) << h.status.error_message();
  const std::vector<int> h_ids = h.ids();
  ASSERT_GE(h_ids.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NE(h_ids[i], ids[0]) << "token " << i;
}

// A deadline centuries away (grpc-timeout allows up to 99999999 hours, ~11400 years) is as good
// as none: gRPC's system_clock deadline wraps past the year 2262, which read as long expired and
// failed the call at once. gRPC's clients cap what they send, so the calls go by hand.
TEST_F(ServerGenerate, ADeadlineCenturiesAwayIsNone) {
  v1::ScoreRequest score;
  for (int id : {5, 6, 7, 8}) score.add_ids(id);
  const std::string generate = ids_request({5, 6, 7}, 3).SerializeAsString();
  for (const char* timeout : {"2562084H", "99999999H", "5S"}) {
    EXPECT_EQ(raw_grpc_status(server_->port(), "/cemlm.v1.Inference/Generate", generate,
                              {"grpc-timeout", timeout}),
              0)
        << timeout;
    EXPECT_EQ(raw_grpc_status(server_->port(), "/cemlm.v1.Inference/Score",
                              score.SerializeAsString(), {"grpc-timeout", timeout}),
              0)
        << timeout;
  }
}

// The same for a body that does not parse: INVALID_ARGUMENT, counted so. The interceptor that
// tells such a body from a call whose deadline passed before its body came read the wrapped
// deadline: the client got gRPC's own UNIMPLEMENTED (Generate) or INTERNAL (Score), and
// requests_total counted DEADLINE_EXCEEDED.
TEST_F(ServerGenerate, AMalformedBodyWithADeadlineCenturiesAwayIsInvalidArgument) {
  const std::string body = "\x08" + std::string(10, '\xff');  // a varint longer than any may be
  const auto before = parse_metrics(server_->metrics_text());
  const std::vector<std::string> methods = {"Generate", "Score"};
  const std::vector<const char*> timeouts = {"2562084H", "99999999H"};
  for (const std::string& m : methods)
    for (const char* timeout : timeouts)
      EXPECT_EQ(raw_grpc_status(server_->port(), "/cemlm.v1.Inference/" + m, body,
                                {"grpc-timeout", timeout}),
                int(grpc::StatusCode::INVALID_ARGUMENT))
          << m << " " << timeout;
  auto count = [&](const auto& series, const std::string& m, const char* code) {
    return metric(series, "cemlm:requests_total",
                  "code=\"" + std::string(code) + "\",method=\"" + m + "\"");
  };
  EXPECT_TRUE(wait_for_metrics(*server_, [&](const auto& now) {
    for (const std::string& m : methods)
      if (count(now, m, "INVALID_ARGUMENT") != count(before, m, "INVALID_ARGUMENT") + 2)
        return false;
    return true;
  }));
  const auto after = parse_metrics(server_->metrics_text());
  for (const std::string& m : methods)
    EXPECT_EQ(count(after, m, "DEADLINE_EXCEEDED"), count(before, m, "DEADLINE_EXCEEDED")) << m;
}

// gRPC writes a log line of its own for each malformed header (here a grpc-timeout holding a
// control byte): those go through the server's log escaped, at most one a second, so that a
// client cannot fill the log with lines of its own bytes.
TEST_F(ServerGenerate, GrpcsOwnLogLinesAreEscapedAndRateLimited) {
  v1::ScoreRequest score;
  for (int id : {5, 6, 7, 8}) score.add_ids(id);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 20; ++i)
    EXPECT_GE(raw_grpc_status(server_->port(), "/cemlm.v1.Inference/Score",
                              score.SerializeAsString(), {"grpc-timeout", "ab\x01" "c"}),
              0);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string log = log_with(*server_, "grpc: Error parsing metadata");
  size_t lines = 0;
  for (size_t at = 0; (at = log.find("grpc: Error parsing metadata", at)) != std::string::npos; ++at)
    ++lines;
  EXPECT_GE(lines, 1u);
  EXPECT_LE(double(lines), 2 + seconds) << log;
  EXPECT_NE(log.find("value=ab\\001c"), std::string::npos) << log;
  EXPECT_EQ(log.find('\x01'), std::string::npos) << log;
}

TEST_F(ServerGenerate, SixtyFourConcurrentStreamsWithMixedT) {
  constexpr int kStreams = 64, kTokens = 6;
  std::vector<Stream> results(kStreams);
  std::vector<std::thread> clients;
  for (int i = 0; i < kStreams; ++i)
    clients.emplace_back([&, i] {
      results[size_t(i)] =
          generate(server_->channel(), ids_request(some_ids(5 + i % 7, i), kTokens, 1 + i % 4));
    });
  for (auto& t : clients) t.join();
  for (int i = 0; i < kStreams; ++i) {
    const Stream& s = results[size_t(i)];
    ASSERT_TRUE(s.status.ok()) << i << ": " << s.status.error_message();
    EXPECT_EQ(s.ids().size(), size_t(kTokens)) << i;
    EXPECT_EQ(s.messages.back().usage().prompt_tokens(), 5 + i % 7);
  }
  // The metrics saw every request, with its own T.
  const auto m = parse_metrics(server_->metrics_text());
  EXPECT_EQ(metric(m, "cemlm:request_success_total", "finished_reason=\"length\""), kStreams);
  EXPECT_EQ(metric(m, "cemlm:recursion_depth_count"), kStreams);
  EXPECT_EQ(metric(m, "cemlm:recursion_depth_sum"), 16 * (1 + 2 + 3 + 4));
  EXPECT_EQ(metric(m, "cemlm:generation_tokens_total"), kStreams * kTokens);
}

// A call with headers past gRPC's 8 KB default (a large bearer token or tracing baggage) is
// served, and the streams beside it on its connection go on: gRPC 1.51 failed the whole
// connection, every stream on it ending RESOURCE_EXHAUSTED.
TEST_F(ServerGenerate, LargeHeadersAreServedBesideOtherStreams) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 60s);
  auto reader = v1::Inference::NewStub(server_->channel())
                    ->Generate(&context, ids_request(some_ids(12), 2000, 8));
  v1::GenerateResponse m;
  ASSERT_TRUE(reader->Read(&m));  // under way on the channel's connection
  grpc::ClientContext big;
  big.AddMetadata("x-baggage", std::string(32 << 10, 'a'));
  v1::ModelInfo info;
  const grpc::Status st = v1::Inference::NewStub(server_->channel())->GetModelInfo(&big, {}, &info);
  EXPECT_TRUE(st.ok()) << st.error_message();
  while (reader->Read(&m)) {
  }
  const grpc::Status stream = reader->Finish();
  EXPECT_TRUE(stream.ok()) << stream.error_message();
}

TEST_F(ServerGenerate, CancelMidStreamFreesTheBlocks) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 60s);
  auto reader = v1::Inference::NewStub(server_->channel())
                    ->Generate(&context, ids_request(some_ids(12), kLongRequest, 8));
  v1::GenerateResponse m;
  ASSERT_TRUE(reader->Read(&m));
  context.TryCancel();
  while (reader->Read(&m)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(wait_for_metrics(*server_, [](const auto& s) {
    return metric(s, "cemlm:num_requests_running") == 0 &&
           metric(s, "cemlm:kv_cache_usage_perc") == 0 &&
           metric(s, "cemlm:request_errors_total", "code=\"CANCELLED\"") == 1;
  })) << server_->metrics_text();
  // The request's log line names the client even though the call is torn down by then.
  std::string log;
  for (auto end = std::chrono::steady_clock::now() + 10s;
       log.find("status=CANCELLED") == std::string::npos && std::chrono::steady_clock::now() < end;
       std::this_thread::sleep_for(10ms))
    log = server_->log();
  const size_t line = log.rfind('\n', log.find("status=CANCELLED")) + 1;
  const std::string cancelled = log.substr(line, log.find('\n', line) - line);
  EXPECT_NE(cancelled.find("peer=ipv"), std::string::npos) << cancelled;
}

// A client whose host vanished without closing its connection (a silent network drop): it
// answers no PING, so the server's keepalive closes the connection and cancels the call, freeing
// the engine, instead of generating for nobody until the request's end (its stream never
// drains: the client sends no window update).
TEST(ServerKeepalive, AClientThatStopsAnsweringPingsIsCutOffAndItsCallCancelled) {
  auto server = ServerProcess::start(
      make_tiny_model(fresh_temp_dir(), {.max_seq_len = kLongSeqLen, .tokenizer = false}),
      {"--keepalive-time", "1", "--keepalive-timeout", "1"});
  ASSERT_TRUE(server);
  RawCall call(server->port(), "/cemlm.v1.Inference/Generate",
               ids_request(some_ids(12), kLongRequest, 8).SerializeAsString());
  int pings = 0;
  const RawCall::End end =
      call.read_frames(120s, false, [&](uint8_t type, uint8_t flags, const std::string&) {
        pings += type == 6 && !(flags & 1);
        return false;
      });
  EXPECT_GE(pings, 1);
  EXPECT_EQ(end, RawCall::End::kClosed);
  EXPECT_TRUE(wait_for_metrics(*server, [](const auto& s) {
    return metric(s, "cemlm:num_requests_running") == 0 &&
           metric(s, "cemlm:kv_cache_usage_perc") == 0 &&
           metric(s, "cemlm:request_errors_total", "code=\"CANCELLED\"") == 1;
  })) << server->metrics_text();
}

// A server with one running slot, taken by a request (its first token read) that runs until
// end() cancels it: a request sent meanwhile waits in the queue.
struct OneSlotTaken {
  OneSlotTaken()
      : server(ServerProcess::start(
            make_tiny_model(fresh_temp_dir(), {.max_seq_len = kLongSeqLen, .tokenizer = false}),
            {"--max-running", "1"})) {
    if (!server) return;
    call = v1::Inference::NewStub(server->channel())
               ->Generate(&context, ids_request(some_ids(12), kLongRequest, 8));
    v1::GenerateResponse first;
    running = call->Read(&first);
  }
  // Cancels the long request; its status (CANCELLED unless it ended by itself).
  grpc::StatusCode end() {
    context.TryCancel();
    for (v1::GenerateResponse m; call->Read(&m);) {
    }
    return call->Finish().error_code();
  }
  std::unique_ptr<ServerProcess> server;
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> call;
  bool running = false;
};

// A client that pings its connection while its call waits with nothing to receive (here a
// request queued behind a long one; a Score waiting for cache room, or a long prefill, alike):
// gRPC's default allowed a ping every 5 minutes without data, so the fourth ping closed the
// connection (GOAWAY too_many_pings) and the waiting call failed UNAVAILABLE "Too many pings".
// The pings are sent by hand, each 1.3 s after the server acknowledged the last: so the server
// sees them at least that far apart however loaded the machine (a gRPC client's keepalive timer
// gave no such bound, and a 12 s wait for its pings), and the old policy's strikes come for
// certain: there the fifth ping (one after the call began may pass free) closed the connection.
TEST(ServerKeepalive, AClientsOwnPingsWhileItsCallWaitsAreNoAbuse) {
  OneSlotTaken slot;
  ASSERT_TRUE(slot.server);
  ASSERT_TRUE(slot.running);  // the next request waits in the queue

  RawCall waiting(slot.server->port(), "/cemlm.v1.Inference/Generate",
                  ids_request(some_ids(4), 2).SerializeAsString());
  int data_frames = 0, status = -1;
  bool goaway = false;
  // Every frame but the pings' ACKs: the waiting call's own (none before the long one ends).
  auto note = [&](uint8_t type, const std::string& payload) {
    goaway |= type == 7;
    data_frames += type == 0;
    const size_t at = type == 1 ? payload.find("grpc-status") : std::string::npos;
    if (at != std::string::npos && payload.size() > at + 12)
      status = std::stoi(payload.substr(at + 12, size_t(payload[at + 11])));
  };
  for (int i = 0; i < 6; ++i) {
    if (i > 0) std::this_thread::sleep_for(1300ms);
    const std::string payload = "ping-" + std::to_string(100 + i);
    ASSERT_TRUE(waiting.ping(payload)) << i;
    const RawCall::End end =
        waiting.read_frames(30s, true, [&](uint8_t type, uint8_t flags, const std::string& p) {
          if (type == 6 && (flags & 1)) return p == payload;
          note(type, p);
          return goaway;
        });
    ASSERT_FALSE(goaway) << "ping " << i + 1 << " closed the connection (too_many_pings)";
    ASSERT_TRUE(end == RawCall::End::kStopped)
        << "ping " << i + 1
        << (end == RawCall::End::kTimedOut ? ": no ACK in 30 s"
                                           : ": the server closed the connection (too_many_pings)");
  }
  EXPECT_EQ(data_frames, 0) << "the call did not wait: the pings were not all without data";
  // Still running when cancelled, so the other call waited through all the pings.
  EXPECT_EQ(slot.end(), grpc::StatusCode::CANCELLED)
      << "the long request ended by itself: lengthen it";
  const RawCall::End end =
      waiting.read_frames(30s, true, [&](uint8_t type, uint8_t, const std::string& p) {
        note(type, p);
        return status >= 0 || goaway;
      });
  EXPECT_FALSE(goaway);
  EXPECT_TRUE(end != RawCall::End::kClosed) << "the server closed the connection (too_many_pings)";
  EXPECT_EQ(status, 0) << "the waiting call did not end OK";
  EXPECT_GE(data_frames, 1);
}

// A client keeping its connection warm between calls (its keepalive with calls or without) is no
// abuse either: gRPC allowed pings on a connection without calls only every 2 hours, and closed
// it after a few (GOAWAY too_many_pings).
TEST(ServerKeepalive, AClientsOwnPingsBetweenCallsAreNoAbuse) {
  auto server = ServerProcess::start(make_tiny_model(fresh_temp_dir(), {.tokenizer = false}));
  ASSERT_TRUE(server);
  RawCall call(server->port(), "/cemlm.v1.Inference/GetModelInfo", "");
  int status = -1;
  bool goaway = false;
  auto note = [&](uint8_t type, const std::string& payload) {
    goaway |= type == 7;
    const size_t at = type == 1 ? payload.find("grpc-status") : std::string::npos;
    if (at != std::string::npos && payload.size() > at + 12)
      status = std::stoi(payload.substr(at + 12, size_t(payload[at + 11])));
  };
  call.read_frames(30s, true, [&](uint8_t type, uint8_t, const std::string& p) {
    note(type, p);
    return status >= 0;
  });
  ASSERT_EQ(status, 0) << "GetModelInfo did not end OK";
  // The connection has no call now. Pings 1.3 s apart (after each ACK), as many as closed it.
  for (int i = 0; i < 6; ++i) {
    if (i > 0) std::this_thread::sleep_for(1300ms);
    const std::string payload = "idle-" + std::to_string(100 + i);
    ASSERT_TRUE(call.ping(payload)) << i;
    const RawCall::End end =
        call.read_frames(30s, true, [&](uint8_t type, uint8_t flags, const std::string& p) {
          if (type == 6 && (flags & 1)) return p == payload;
          note(type, p);
          return goaway;
        });
    ASSERT_FALSE(goaway) << "ping " << i + 1 << " closed the connection (too_many_pings)";
    ASSERT_TRUE(end == RawCall::End::kStopped)
        << "ping " << i + 1 << (end == RawCall::End::kTimedOut ? ": no ACK in 30 s" : ": closed");
  }
}

// The token counters move as tokens stream, not when the request ends (a dashboard's tokens/s
// would otherwise lag by a whole generation).
TEST_F(ServerGenerate, TokenCountersMoveWhileStreaming) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 60s);
  auto reader = v1::Inference::NewStub(server_->channel())
                    ->Generate(&context, ids_request(some_ids(12), kLongRequest, 8));
  int streamed = 0;
  for (v1::GenerateResponse m; streamed < 5 && reader->Read(&m);) streamed += m.token_ids_size();
  ASSERT_GE(streamed, 5);
  // Counted on the engine thread before the tokens were written to us.
  const auto m = parse_metrics(server_->metrics_text());
  EXPECT_EQ(metric(m, "cemlm:prompt_tokens_total"), 12);
  EXPECT_GE(metric(m, "cemlm:generation_tokens_total"), streamed);
  EXPECT_EQ(metric(m, "cemlm:e2e_request_latency_seconds_count"), 0);  // still running
  context.TryCancel();
  for (v1::GenerateResponse m; reader->Read(&m);) {
  }
  reader->Finish();
}

// A request's queue time is observed at its first token (it was observed at its end, so that an
// alert on queue times lagged the queue by whole generations); one that never started, at its
// end.
TEST(ServerQueue, QueueTimeIsObservedAtTheFirstTokenOrAtTheEnd) {
  OneSlotTaken slot;
  ASSERT_TRUE(slot.server);
  ASSERT_TRUE(slot.running);
  ServerProcess* server = slot.server.get();
  auto m = parse_metrics(server->metrics_text());
  EXPECT_EQ(metric(m, "cemlm:request_queue_time_seconds_count"), 1);
  EXPECT_EQ(metric(m, "cemlm:e2e_request_latency_seconds_count"), 0);  // still running

  // Behind the long one, this one waits until its deadline ends it.
  grpc::ClientContext waiting_context;
  waiting_context.set_deadline(std::chrono::system_clock::now() + 300ms);
  auto waiting = v1::Inference::NewStub(server->channel())
                     ->Generate(&waiting_context, ids_request(some_ids(4), 2));
  for (v1::GenerateResponse r; waiting->Read(&r);) {
  }
  EXPECT_EQ(waiting->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(wait_for_metrics(*server, [](const auto& now) {
    return metric(now, "cemlm:e2e_request_latency_seconds_count") == 1;
  })) << server->metrics_text();
  m = parse_metrics(server->metrics_text());
  EXPECT_EQ(metric(m, "cemlm:request_queue_time_seconds_count"), 2);
  EXPECT_EQ(metric(m, "cemlm:time_to_first_token_seconds_count"), 1);

  EXPECT_EQ(slot.end(), grpc::StatusCode::CANCELLED)
      << "the long request ended by itself: lengthen it";
  EXPECT_TRUE(wait_for_metrics(*server, [](const auto& now) {
    return metric(now, "cemlm:e2e_request_latency_seconds_count") == 2;
  })) << server->metrics_text();
  // Not observed twice.
  EXPECT_EQ(metric(parse_metrics(server->metrics_text()), "cemlm:request_queue_time_seconds_count"),
            2);
}

// A client's request_id goes into the server's log escaped: it cannot forge log lines.
TEST_F(ServerGenerate, RequestIdCannotForgeLogLines) {
  v1::GenerateRequest req = ids_request(some_ids(4), 2);
  req.set_request_id("evil\" status=OK\nforged line");
  ASSERT_TRUE(generate(server_->channel(), req).status.ok());
  const std::string log = log_with(*server_, "client_id=");
  EXPECT_NE(log.find(R"(client_id="evil\" status=OK\nforged line")"), std::string::npos) << log;
  EXPECT_EQ(log.find("\nforged line"), std::string::npos) << log;
}

TEST_F(ServerGenerate, DeadlineEndsTheRequest) {
  // The deadline comes first, but only once the call has reached the engine: 50 ms could pass on
  // a loaded machine before the server had read the call, which then never ran (and was counted
  // as a malformed body). The request takes many seconds.
  const Stream s =
      generate(server_->channel(), ids_request(some_ids(12), kLongRequest, 8), {"", 1s});
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(wait_for_metrics(*server_, [](const auto& m) {
    return metric(m, "cemlm:num_requests_running") == 0 &&
           metric(m, "cemlm:kv_cache_usage_perc") == 0 &&
           metric(m, "cemlm:request_errors_total", "code=\"DEADLINE_EXCEEDED\"") == 1;
  })) << server_->metrics_text();
  // Its log line says deadline, not cancelled (the engine's own reason).
  const std::string log = log_with(*server_, "status=DEADLINE_EXCEEDED");
  EXPECT_NE(log.find("finish=deadline status=DEADLINE_EXCEEDED"), std::string::npos) << log;
}

// Unary calls are logged too: every failure, and every Score.
TEST_F(ServerGenerate, UnaryCallsAreLogged) {
  v1::ScoreRequest bad;
  bad.add_ids(1);
  v1::ScoreResponse resp;
  EXPECT_EQ(score(server_->channel(), bad, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::ScoreRequest good;
  for (int id : some_ids(5)) good.add_ids(id);
  EXPECT_TRUE(score(server_->channel(), good, &resp).ok());
  const std::string want_bad = "Score peer=", want_ok = "status=OK latency_ms=";
  const std::string log = log_with(*server_, want_ok);  // the later line
  const size_t at = log.find(want_bad);
  ASSERT_NE(at, std::string::npos) << log;
  EXPECT_NE(log.find("status=INVALID_ARGUMENT", at), std::string::npos) << log;
  EXPECT_NE(log.find("scoring needs at least 2", at), std::string::npos) << log;
  EXPECT_NE(log.find(want_ok, at), std::string::npos) << log;
}

// Checks requests_total of `method` against the codes its clients saw: every call ended OK or
// DEADLINE_EXCEEDED. The deadlines are at most half of how long a call takes, so every late answer
// comes long after the deadline, never in the transit time between the client's deadline and the
// server's, which no server could tell from one in time. A call whose deadline's cancellation
// reached a loaded server more than 20 ms before the server's own deadline (its clock starts when
// it reads the call) is counted CANCELLED: no server can tell that from a client's cancel.
void expect_counted_as_seen(const ServerProcess& server, const char* method,
                            std::map<grpc::StatusCode, int> seen, int calls) {
  const std::string in = std::string("method=\"") + method + "\"";
  EXPECT_TRUE(wait_for_metrics(server, [&](const auto& m) {
    return metric(m, "cemlm:requests_total", in) ==
           calls;  // may still run after the client gave up
  })) << server.metrics_text();
  const auto m = parse_metrics(server.metrics_text());
  const auto counted = [&](const char* code) {
    return int(metric(m, "cemlm:requests_total", std::string("code=\"") + code + "\"," + in));
  };
  EXPECT_EQ(seen[grpc::StatusCode::OK] + seen[grpc::StatusCode::DEADLINE_EXCEEDED], calls);
  EXPECT_EQ(counted("OK"), seen[grpc::StatusCode::OK]) << server.metrics_text();
  EXPECT_EQ(counted("DEADLINE_EXCEEDED") + counted("CANCELLED"),
            seen[grpc::StatusCode::DEADLINE_EXCEEDED])
      << server.metrics_text();
}

// Timeouts of a quarter and a half of `took` (the fastest of the calls made in time), a few of
// each: long enough for the call to reach the server, short enough to end inside its work.
std::vector<std::chrono::milliseconds> timeouts_within(std::chrono::steady_clock::duration took) {
  std::vector<std::chrono::milliseconds> out;
  for (int i = 0; i < 3; ++i)
    for (double f : {0.25, 0.5})
      out.push_back(std::chrono::duration_cast<std::chrono::milliseconds>(took * f));
  return out;
}

// Every unary call is counted (and logged) under the code its client saw. gRPC sends no status
// for a call cancelled meanwhile, so a Score whose last chunk ended past its deadline, which
// returned OK, ended DEADLINE_EXCEEDED for its client; so did one that the deadline's own
// cancellation stopped between two chunks, which returned CANCELLED. Counted as returned, a
// server too slow for its clients' deadlines showed only OK calls (or client cancellations) and
// its error-rate alert stayed quiet.
TEST(ServerDeadlines, UnaryCallsCountTheCodeTheirClientsSaw) {
  const std::string model = make_tiny_model(fresh_temp_dir(), {.max_seq_len = 4096});
  // One chunk of 4096 ids (its end past the deadline was counted OK), then eight of 512.
  for (const char* chunk : {"4096", "512"}) {
    auto server = ServerProcess::start(model, {"--max-batch-tokens", chunk});
    ASSERT_TRUE(server);
    v1::ScoreRequest req;
    for (int id : some_ids(4096)) req.add_ids(id);
    req.set_recursion_depth(8);
    v1::ScoreResponse resp;
    auto took = std::chrono::steady_clock::duration::max();
    std::map<grpc::StatusCode, int> seen;
    int calls = 0;
    for (int i = 0; i < 2; ++i) {
      const auto start = std::chrono::steady_clock::now();
      ASSERT_TRUE(score(server->channel(), req, &resp, {"", 120s}).ok());
      took = std::min(took, std::chrono::steady_clock::now() - start);
      ++seen[grpc::StatusCode::OK];
      ++calls;
    }
    for (const auto timeout : timeouts_within(took)) {
      ++seen[score(server->channel(), req, &resp, {"", timeout}).error_code()];
      ++calls;
    }
    expect_counted_as_seen(*server, "Score", seen, calls);
  }
}

// The same for Generate: the engine checks deadlines between its steps, so a request whose one
// step (a 4000-token prefill, then its one token) ended past the deadline finished normally, and
// was counted OK and a success though its client saw DEADLINE_EXCEEDED.
TEST(ServerDeadlines, StreamsCountTheCodeTheirClientsSaw) {
  const std::string model = make_tiny_model(fresh_temp_dir(), {.max_seq_len = 4096});
  auto server = ServerProcess::start(model, {"--max-batch-tokens", "4096"});
  ASSERT_TRUE(server);
  std::map<grpc::StatusCode, int> seen;
  int calls = 0;
  // Each call's prompt its own: a prefix-cache hit would make it take no time.
  auto request = [&] { return ids_request(some_ids(4000, calls + 1), 1, 8); };
  auto took = std::chrono::steady_clock::duration::max();
  for (int i = 0; i < 2; ++i) {
    const auto start = std::chrono::steady_clock::now();
    ASSERT_TRUE(generate(server->channel(), request(), {"", 120s}).status.ok());
    took = std::min(took, std::chrono::steady_clock::now() - start);
    ++seen[grpc::StatusCode::OK];
    ++calls;
  }
  for (const auto timeout : timeouts_within(took)) {
    ++seen[generate(server->channel(), request(), {"", timeout}).status.error_code()];
    ++calls;
  }
  expect_counted_as_seen(*server, "Generate", seen, calls);
  const auto m = parse_metrics(server->metrics_text());
  EXPECT_EQ(metric(m, "cemlm:request_success_total"),
            metric(m, "cemlm:requests_total", "code=\"OK\",method=\"Generate\""));
}

TEST(ServerQueue, FullQueueAnswersResourceExhausted) {
  const std::string model = make_tiny_model(fresh_temp_dir());
  // One running and one waiting slot, and prefills of 480 tokens in 16-token chunks keep them
  // taken for a while.
  auto server = ServerProcess::start(
      model, {"--max-running", "1", "--max-waiting", "1", "--max-batch-tokens", "16"});
  ASSERT_TRUE(server);
  constexpr int kClients = 32;
  std::vector<grpc::StatusCode> codes(kClients);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i)
    clients.emplace_back([&, i] {
      const Stream s = generate(server->channel(), ids_request(some_ids(480, i), 2));
      codes[size_t(i)] = s.status.error_code();
    });
  for (auto& t : clients) t.join();
  int exhausted = 0;
  for (grpc::StatusCode c : codes) {
    EXPECT_TRUE(c == grpc::StatusCode::OK || c == grpc::StatusCode::RESOURCE_EXHAUSTED) << c;
    exhausted += c == grpc::StatusCode::RESOURCE_EXHAUSTED;
  }
  EXPECT_GT(exhausted, 0);
  EXPECT_LT(exhausted, kClients);
  const auto m = parse_metrics(server->metrics_text());
  EXPECT_EQ(metric(m, "cemlm:request_errors_total", "code=\"RESOURCE_EXHAUSTED\""), exhausted);
}

// A stream the engine has finished stays open, its output held, until the client reads it; at
// most --max-running + --max-waiting such streams, or clients that never read would hold memory
// without a bound. The unread clients here announce a 1 KiB window (no BDP growth), so most of
// their 150 tokens with 20 alternatives each stays on the server.
// Two streams of 150 tokens with 20 alternatives each, whose client announces a 1 KiB window (no
// BDP growth) and never reads: most of their output stays on the server. Returns once the engine
// has finished both.
struct UnreadStreams {
  UnreadStreams(const ServerProcess& server) {
    channel = small_window_channel(server.addr());
    auto stub = v1::Inference::NewStub(channel);
    v1::GenerateRequest req = ids_request(some_ids(8), 150);
    req.set_logprobs(true);
    req.mutable_sampling()->set_top_logprobs(20);
    req.mutable_sampling()->set_ignore_eos(true);
    for (int i = 0; i < 2; ++i) {
      readers[i] = stub->Generate(&contexts[i], req);
      // Finished in the engine: nothing running or waiting, its tokens counted.
      EXPECT_TRUE(wait_for_metrics(server, [&](const auto& m) {
        return metric(m, "cemlm:generation_tokens_total") >= 150 * (i + 1) &&
               metric(m, "cemlm:num_requests_running") == 0;
      }));
    }
  }
  std::shared_ptr<grpc::Channel> channel;
  grpc::ClientContext contexts[2];
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> readers[2];
};

// A short stream, tried every 20 ms for up to 10 s while it is RESOURCE_EXHAUSTED.
Stream generate_once_admitted(const ServerProcess& server) {
  Stream s;
  for (int attempt = 0; attempt < 500; ++attempt) {
    s = generate(server.channel(), ids_request(some_ids(4), 2));
    if (s.status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) break;
    std::this_thread::sleep_for(20ms);
  }
  return s;
}

TEST(ServerQueue, StreamsNotYetReadCountAgainstTheBound) {
  const std::string model = make_tiny_model(fresh_temp_dir());
  auto server = ServerProcess::start(
      model, {"--max-running", "1", "--max-waiting", "1", "--unread-timeout", "600"});
  ASSERT_TRUE(server);
  UnreadStreams unread(*server);
  // The engine is idle, yet a third stream is refused.
  const Stream refused = generate(server->channel(), ids_request(some_ids(4), 2));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.status.error_message().find("holds 2 finished Generate streams"),
            std::string::npos)
      << refused.status.error_message();
  // What an operator sees: the engine idle, two streams unread.
  EXPECT_TRUE(wait_for_metrics(*server, [](const auto& m) {
    return metric(m, "cemlm:num_unread_streams") == 2 && metric(m, "cemlm:num_requests_running") == 0;
  }));
  for (grpc::ClientContext& c : unread.contexts) c.TryCancel();
  const Stream after = generate_once_admitted(*server);  // the cancelled streams close soon
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_TRUE(wait_for_metrics(*server, [](const auto& m) {
    return metric(m, "cemlm:num_unread_streams") == 0;
  }));
}

// Clients that read every stream are not refused for unread streams while they are no more than
// the bound: a stream counted until gRPC had finished it (OnDone), a moment after its client got
// the end, and the client's next request could come first; 4 closed-loop clients here saw a few
// refusals a thousand requests. A stream now stops counting once its last message is written,
// before its status goes out.
TEST(ServerQueue, ClientsThatReadEverythingAreNotRefusedAsUnread) {
  const std::string model = make_tiny_model(fresh_temp_dir());
  auto server = ServerProcess::start(model, {"--max-running", "2", "--max-waiting", "2"});
  ASSERT_TRUE(server);
  constexpr int kClients = 4, kEach = 250;
  std::vector<std::vector<grpc::Status>> errors(kClients);
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c)
    clients.emplace_back([&, c] {
      for (int i = 0; i < kEach; ++i)
        if (const Stream s =
                generate(server->channel(), ids_request(some_ids(4, c * kEach + i), 1));
            !s.status.ok())
          errors[size_t(c)].push_back(s.status);
    });
  for (auto& t : clients) t.join();
  for (int c = 0; c < kClients; ++c)
    for (const grpc::Status& st : errors[size_t(c)])
      ADD_FAILURE() << "client " << c << ": " << st.error_code() << " " << st.error_message();
  EXPECT_TRUE(wait_for_metrics(
      *server, [](const auto& m) { return metric(m, "cemlm:num_unread_streams") == 0; }));
}

// One client that stopped reading cannot keep other clients' streams out for as long as its
// connection lasts: at the bound, streams unread for --unread-timeout are cancelled (their output
// undelivered, as their log lines say and cemlm:unread_streams_cancelled_total counts) and new
// streams get in.
TEST(ServerQueue, StreamsUnreadPastTheTimeoutMakeRoom) {
  const std::string model = make_tiny_model(fresh_temp_dir());
  auto server = ServerProcess::start(
      model, {"--max-running", "1", "--max-waiting", "1", "--unread-timeout", "1"});
  ASSERT_TRUE(server);
  const char* const kCancelledTotal = "cemlm:unread_streams_cancelled_total";
  // There from the start, at 0, so that a dashboard's rate of it needs no `or`.
  const std::string fresh = server->metrics_text();
  EXPECT_NE(fresh.find(std::string("\n") + kCancelledTotal + "{"), std::string::npos) << fresh;
  EXPECT_EQ(metric(parse_metrics(fresh), kCancelledTotal), 0);
  UnreadStreams unread(*server);
  const Stream after = generate_once_admitted(*server);  // refused until they waited 1 s
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
  // The stale ones were cancelled: at least one, or there was no room; a younger one may still
  // be whole when read now.
  int cancelled = 0;
  for (auto& reader : unread.readers) {
    for (v1::GenerateResponse m; reader->Read(&m);) {
    }
    const grpc::StatusCode code = reader->Finish().error_code();
    EXPECT_TRUE(code == grpc::StatusCode::OK || code == grpc::StatusCode::CANCELLED) << code;
    cancelled += code == grpc::StatusCode::CANCELLED;
  }
  EXPECT_GE(cancelled, 1);
  // Each counted before its cancellation reached the client, so by now.
  EXPECT_EQ(metric(parse_metrics(server->metrics_text()), kCancelledTotal), cancelled);
  const std::string log = log_with(*server, "undelivered=unread_timeout");
  // Logged as its client saw it.
  EXPECT_NE(log.find("finish=length status=CANCELLED latency_ms="), std::string::npos) << log;
  EXPECT_NE(log.find("undelivered=unread_timeout"), std::string::npos) << log;
}

// A stream the engine finished whose client never got its end counts (and is logged) as its client
// saw it: DEADLINE_EXCEEDED when the call's deadline ended it while the last messages waited for
// the client to read, CANCELLED when the client cancelled it then. Both were counted OK, and as
// successes. (Those the server cancels unread, at --unread-timeout, stay counted as the engine
// finished them.) One timed call goes by hand, so that only the server's deadline ends it; the
// other's gRPC client cancels it by its own timer before the server's deadline (by the rounding of
// the timeout it sent, and by how late the server read the headers): within 20 ms plus 2% of the
// call's time, that is the deadline's cancel.
TEST(ServerQueue, AFinishedStreamItsClientNeverGotCountsAsItsClientSawIt) {
  const std::string model = make_tiny_model(fresh_temp_dir());
  auto server = ServerProcess::start(model, {"--unread-timeout", "600"});
  ASSERT_TRUE(server);
  // Most of the output (~80 KB a stream, more than even gRPC's default window) stays on the server.
  auto stub = v1::Inference::NewStub(small_window_channel(server->addr()));
  v1::GenerateRequest req = ids_request(some_ids(8), 400);
  req.set_logprobs(true);
  req.mutable_sampling()->set_top_logprobs(20);
  // Long enough for the engine to finish first however loaded the machine (if it does not, the
  // engine ends it DEADLINE_EXCEEDED, as checked below).
  RawCall timed(server->port(), "/cemlm.v1.Inference/Generate", req.SerializeAsString(),
                {{"grpc-timeout", "10S"}}, 1024);
  grpc::ClientContext cancelled;
  auto cancelled_reader = stub->Generate(&cancelled, req);
  // A gRPC client's deadline too: it sends 10.55 s rounded up (10.6 s: 10600m), and its own timer
  // cancels the call ~50 ms before the server's deadline, which counted it CANCELLED.
  grpc::ClientContext client_timed;
  client_timed.set_deadline(std::chrono::system_clock::now() + 10550ms);
  auto client_timed_reader = stub->Generate(&client_timed, req);
  ASSERT_TRUE(wait_for_metrics(*server, [](const auto& m) {
    return metric(m, "cemlm:generation_tokens_total") >= 1200 &&
           metric(m, "cemlm:num_requests_running") == 0 &&
           metric(m, "cemlm:num_requests_waiting") == 0;
  })) << server->metrics_text();
  cancelled.TryCancel();
  // The server ends the timed call at its deadline: trailers or a reset.
  int status = -1;
  const RawCall::End end =
      timed.read_frames(60s, true, [&](uint8_t type, uint8_t, const std::string& payload) {
        const size_t at = type == 1 ? payload.find("grpc-status") : std::string::npos;
        if (at != std::string::npos && payload.size() > at + 12)
          status = std::stoi(payload.substr(at + 12, size_t(payload[at + 11])));
        return status >= 0 || type == 3;
      });
  EXPECT_EQ(end, RawCall::End::kStopped);
  EXPECT_TRUE(status == -1 || status == int(grpc::StatusCode::DEADLINE_EXCEEDED)) << status;
  EXPECT_EQ(client_timed_reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(wait_for_metrics(*server, [](const auto& m) {
    return metric(m, "cemlm:requests_total", "method=\"Generate\"") == 3;
  })) << server->metrics_text();
  const auto m = parse_metrics(server->metrics_text());
  EXPECT_EQ(metric(m, "cemlm:requests_total", "code=\"DEADLINE_EXCEEDED\",method=\"Generate\""), 2);
  EXPECT_EQ(metric(m, "cemlm:requests_total", "code=\"CANCELLED\",method=\"Generate\""), 1);
  EXPECT_EQ(metric(m, "cemlm:request_success_total"), 0);
  EXPECT_EQ(metric(m, "cemlm:unread_streams_cancelled_total"), 0);
  for (v1::GenerateResponse r; cancelled_reader->Read(&r);) {
  }
  EXPECT_FALSE(cancelled_reader->Finish().ok());
  const std::string log = log_with(*server, "status=DEADLINE_EXCEEDED");
  EXPECT_NE(log.find("finish=length status=DEADLINE_EXCEEDED"), std::string::npos) << log;
}

// At shutdown, streams whose clients stopped reading are cancelled once stale rather than hold the
// drain for all of --shutdown-timeout (120 s here; it took that long before).
TEST(ServerQueue, ADrainCancelsStreamsLeftUnread) {
  const std::string model = make_tiny_model(fresh_temp_dir());
  auto server = ServerProcess::start(model, {"--unread-timeout", "1", "--shutdown-timeout", "120"});
  ASSERT_TRUE(server);
  UnreadStreams unread(*server);
  server->signal(SIGTERM);
  EXPECT_EQ(server->wait_exit(60s), 0) << server->log();
  EXPECT_NE(server->log().find("undelivered=unread_timeout"), std::string::npos) << server->log();
}

// Streams still unread when the drain's time is up are cut by gRPC at the end of the shutdown:
// their clients see UNAVAILABLE, and so the log says (they were logged CANCELLED, cancelled by
// their clients). A stream whose last message gRPC took just before it stopped was sent as far as
// the server can tell, and stays OK.
TEST(ServerQueue, StreamsCutAtTheEndOfAShutdownAreUnavailable) {
  const std::string model = make_tiny_model(fresh_temp_dir());
  auto server =
      ServerProcess::start(model, {"--unread-timeout", "600", "--shutdown-timeout", "0.2"});
  ASSERT_TRUE(server);
  UnreadStreams unread(*server);
  server->signal(SIGTERM);
  EXPECT_EQ(server->wait_exit(60s), 0) << server->log();
  for (auto& reader : unread.readers) {
    for (v1::GenerateResponse r; reader->Read(&r);) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  const std::string log = server->log();
  size_t lines = 0;
  for (size_t at = log.find("finish=length status="); at != std::string::npos;
       at = log.find("finish=length status=", at + 1)) {
    ++lines;
    const std::string_view line = std::string_view(log).substr(at);
    EXPECT_TRUE(line.starts_with("finish=length status=UNAVAILABLE ") ||
                line.starts_with("finish=length status=OK "))
        << log;
  }
  EXPECT_EQ(lines, 2u) << log;
}

// With the engine full (one running, one waiting), a higher priority still gets in through
// serve: the queued request of lower priority is displaced (open streams of the engine's are not
// the unread-stream bound's to refuse).
TEST(ServerQueue, AHigherPriorityDisplacesAQueuedRequest) {
  const std::string model = make_tiny_model(fresh_temp_dir(), {.max_seq_len = kLongSeqLen});
  auto server = ServerProcess::start(model, {"--max-running", "1", "--max-waiting", "1"});
  ASSERT_TRUE(server);
  grpc::ClientContext running_ctx;
  auto stub = v1::Inference::NewStub(server->channel());
  auto running = stub->Generate(&running_ctx, ids_request(some_ids(8), kLongRequest, 8));
  // Calls on separate streams may reach the engine in either order: the long one must be running
  // before the short one is sent, or the short one could run (and end) first.
  if (!wait_for_metrics(
          *server, [](const auto& m) { return metric(m, "cemlm:num_requests_running") == 1; })) {
    running_ctx.TryCancel();
    FAIL() << "the long request never ran";
  }
  Stream queued;
  std::thread waiter([&] { queued = generate(server->channel(), ids_request(some_ids(8, 1), 4)); });
  if (!wait_for_metrics(*server, [](const auto& m) {
        return metric(m, "cemlm:num_requests_running") == 1 &&
               metric(m, "cemlm:num_requests_waiting") == 1;
      })) {
    running_ctx.TryCancel();
    waiter.join();
    FAIL() << "never one request running and one waiting";
  }
  v1::GenerateRequest urgent = ids_request(some_ids(8, 2), 4);
  urgent.set_priority(5);
  Stream taken;
  std::thread taker([&] { taken = generate(server->channel(), urgent); });
  waiter.join();  // displaced at once
  EXPECT_EQ(queued.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(queued.status.error_message().find("displaced"), std::string::npos)
      << queued.status.error_message();
  running_ctx.TryCancel();
  taker.join();
  EXPECT_TRUE(taken.status.ok()) << taken.status.error_message();
  EXPECT_EQ(taken.ids().size(), 4u);
}

// A call its client cancelled is counted CANCELLED, as its client saw it, whatever the server
// answered after the cancel. Here the engine is held by a long prefill step while a queued
// request's client cancels it and a higher priority then displaces it: the engine's next pass
// displaces it (RESOURCE_EXHAUSTED) before it reads the cancel, and the call was counted
// RESOURCE_EXHAUSTED, an error its client never saw (the error-rate alert counts it).
TEST(ServerQueue, ACancelledCallIsCountedCancelledWhateverTheServerAnsweredAfter) {
  const std::string model = make_tiny_model(fresh_temp_dir(), {.max_seq_len = 4096});
  auto server = ServerProcess::start(
      model, {"--max-running", "1", "--max-waiting", "1", "--max-batch-tokens", "4096"});
  ASSERT_TRUE(server);
  auto stub = v1::Inference::NewStub(server->channel());
  for (int round = 0; round < 2; ++round) {
    // A 4000-token prompt at T = 8 in one step: long enough for the calls below (its later tokens
    // keep the running slot taken, so that the urgent request displaces the queued one).
    Stream held;
    std::thread holder([&] {
      held = generate(server->channel(), ids_request(some_ids(4000, 10 + round), 20, 8));
    });
    ASSERT_TRUE(wait_for_metrics(*server, [](const auto& m) {
      return metric(m, "cemlm:num_requests_running") == 1;
    })) << server->metrics_text();
    grpc::ClientContext queued_ctx;
    auto queued = stub->Generate(&queued_ctx, ids_request(some_ids(8, 1 + round), 4));
    std::this_thread::sleep_for(200ms);  // submitted (a cancel before the handler ends it there)
    queued_ctx.TryCancel();
    v1::GenerateRequest urgent = ids_request(some_ids(8, 3 + round), 4);
    urgent.set_priority(5);
    const Stream taken = generate(server->channel(), urgent);
    holder.join();
    for (v1::GenerateResponse r; queued->Read(&r);) {
    }
    EXPECT_EQ(queued->Finish().error_code(), grpc::StatusCode::CANCELLED);
    EXPECT_TRUE(held.status.ok()) << held.status.error_message();
    EXPECT_TRUE(taken.status.ok()) << taken.status.error_message();
  }
  ASSERT_TRUE(wait_for_metrics(*server, [](const auto& m) {
    return metric(m, "cemlm:requests_total", "method=\"Generate\"") == 6;
  })) << server->metrics_text();
  const auto m = parse_metrics(server->metrics_text());
  EXPECT_EQ(metric(m, "cemlm:requests_total", "code=\"CANCELLED\",method=\"Generate\""), 2)
      << server->metrics_text();
  EXPECT_EQ(metric(m, "cemlm:request_errors_total", "code=\"RESOURCE_EXHAUSTED\""), 0)
      << server->metrics_text();
}

}  // namespace
}  // namespace cemlm::testing_server
