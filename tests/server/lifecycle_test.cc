// The server as a whole: SIGTERM drain (finish in flight, or cancel at --shutdown-timeout; exit
// 0 either way), the metrics exposition and its counters, Score against `cemlm score`,
// reflection, and the `cemlm client` / `cemlm bench-serve` / Python clients against it.
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/byte_buffer.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "cemlm/engine/checkpoint.h"
#include "cemlm/kernels/blas_select.h"
#include "cemlm/kernels/linear.h"
#include "client_util.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "server_process.h"

extern "C" char* openblas_get_corename(void);

namespace cemlm::testing_server {
namespace {

using namespace std::chrono_literals;

std::vector<int> prompt(int n) {
  std::vector<int> ids;
  for (int i = 0; i < n; ++i) ids.push_back(4 + (i * 53) % 300);
  return ids;
}

bool wait_for_health(const ServerProcess& s, const std::string& want) {
  for (auto end = std::chrono::steady_clock::now() + 10s; std::chrono::steady_clock::now() < end;
       std::this_thread::sleep_for(5ms))
    if (health(s.channel()) == want) return true;
  return false;
}

// In both, a generation must still be in flight while the test looks at the draining server. On
// a fast, idle machine the tiny model makes 300 tokens in ~20 ms, under the 50 ms shutdown timeout
// (a flake seen in CI), and a loaded machine can hold the test back for as long as a generation
// of thousands takes. So the first test reads its stream through a 1 KiB window: the server cannot
// end the call (and exit) before the test has read it, however far the engine got. The second,
// whose request the shutdown timeout cancels, asks for 16000 tokens at T=8 (many seconds).
constexpr int kLongContext = 16384;

TEST(ServerDrain, SigtermFinishesWhatIsInFlightThenExitsZero) {
  auto server = ServerProcess::start(
      make_tiny_model(fresh_temp_dir(), {.max_seq_len = kLongContext}),
      {"--shutdown-timeout", "120", "--unread-timeout", "600"});  // the test reads it late
  ASSERT_TRUE(server);
  constexpr int kTokens = 1500;
  const auto channel = small_window_channel(server->addr());
  grpc::ClientContext context;
  auto reader =
      v1::Inference::NewStub(channel)->Generate(&context, ids_request(prompt(12), kTokens, 8));
  v1::GenerateResponse m;
  ASSERT_TRUE(reader->Read(&m));
  int tokens = m.token_ids_size();
  server->signal(SIGTERM);
  // Draining, it sent its connections a GOAWAY and stopped listening: a new call finds no
  // server (UNAVAILABLE), while the stream in flight goes on.
  EXPECT_TRUE(wait_for_health(*server, "error 14"));
  const Stream late = generate(server->channel(), ids_request(prompt(4), 2));
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  for (; reader->Read(&m);) tokens += m.token_ids_size();
  const grpc::Status st = reader->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(tokens, kTokens);
  EXPECT_EQ(m.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(server->wait_exit(30s), 0) << server->log();
}

// A client balancing over two servers loses no call while one drains: the draining one sends its
// connections a GOAWAY at once, so the client's calls go to the other. (It only refused them:
// every call the client sent it failed UNAVAILABLE for as long as the drain lasted, which on
// Kubernetes meant every rollout.)
TEST(ServerDrain, AClientOfTwoServersLosesNoCallWhileOneDrains) {
  const std::string model = make_tiny_model(fresh_temp_dir(), {.max_seq_len = kLongContext});
  auto draining = ServerProcess::start(
      model, {"--shutdown-timeout", "120", "--unread-timeout", "600"});  // the test reads it late
  auto other = ServerProcess::start(model);
  ASSERT_TRUE(draining && other);
  grpc::ChannelArguments args;
  args.SetServiceConfigJSON(R"({"loadBalancingConfig": [{"round_robin": {}}]})");
  const auto both = grpc::CreateCustomChannel("ipv4:" + draining->addr() + "," + other->addr(),
                                              grpc::InsecureChannelCredentials(), args);
  for (int i = 0; i < 4; ++i)  // connected to both
    ASSERT_TRUE(generate(both, ids_request(prompt(4), 2)).status.ok());
  // A stream that keeps the drain going until the test has read it (see above).
  const auto window = small_window_channel(draining->addr());
  grpc::ClientContext context;
  auto reader =
      v1::Inference::NewStub(window)->Generate(&context, ids_request(prompt(12), 1500, 8));
  v1::GenerateResponse m;
  ASSERT_TRUE(reader->Read(&m));
  draining->signal(SIGTERM);
  EXPECT_TRUE(wait_for_health(*draining, "error 14"));
  int failed = 0;
  std::string first_error;
  for (int i = 0; i < 24; ++i) {
    const grpc::Status st = generate(both, ids_request(prompt(4), 2)).status;
    if (!st.ok() && failed++ == 0) first_error = st.error_message();
  }
  EXPECT_EQ(failed, 0) << first_error;
  int tokens = m.token_ids_size();
  for (; reader->Read(&m);) tokens += m.token_ids_size();
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_EQ(tokens, 1500);
  EXPECT_EQ(draining->wait_exit(30s), 0) << draining->log();
}

// What the service does not see does not hold the exit: an idle client channel and an open
// reflection stream (grpcurl's) were waited for by gRPC's Shutdown, which a drain now begins at
// once, up to its deadline (here 10 minutes), with nothing in flight.
TEST(ServerDrain, ConnectionsWithoutRequestsDoNotHoldTheExit) {
  auto server =
      ServerProcess::start(make_tiny_model(fresh_temp_dir()), {"--shutdown-timeout", "600"});
  ASSERT_TRUE(server);
  ASSERT_TRUE(generate(server->channel(), ids_request(prompt(4), 2)).status.ok());  // then idle
  grpc::GenericStub stub(server->channel());
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  auto call = stub.PrepareCall(
      &context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  call->StartCall(reinterpret_cast<void*>(1));
  void* got = nullptr;
  bool ok = false;
  ASSERT_TRUE(cq.Next(&got, &ok) && ok);  // open, and left so
  server->signal(SIGTERM);
  EXPECT_EQ(server->wait_exit(30s), 0) << server->log();
  context.TryCancel();
  grpc::Status st;
  call->Finish(&st, reinterpret_cast<void*>(2));
  while (cq.Next(&got, &ok) && got != reinterpret_cast<void*>(2)) {
  }
  cq.Shutdown();
  while (cq.Next(&got, &ok)) {
  }
}

TEST(ServerDrain, ShutdownTimeoutCancelsTheRestAndExitsZero) {
  auto server = ServerProcess::start(make_tiny_model(fresh_temp_dir(), {.max_seq_len = kLongContext}),
                                     {"--shutdown-timeout", "0.05"});
  ASSERT_TRUE(server);
  grpc::ClientContext context;
  auto reader = v1::Inference::NewStub(server->channel())
                    ->Generate(&context, ids_request(prompt(12), kLongContext - 96, 8));
  v1::GenerateResponse m;
  ASSERT_TRUE(reader->Read(&m));
  server->signal(SIGINT);
  while (reader->Read(&m)) {
  }
  const grpc::Status st = reader->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  EXPECT_EQ(server->wait_exit(30s), 0) << server->log();
}

// A Score under way when --shutdown-timeout runs out ends UNAVAILABLE too, and the server exits
// 0: the engine's shutdown waited for its last chunk (16000 tokens at T=8 in chunks of 16: many
// seconds, past the pod's grace period).
TEST(ServerDrain, ShutdownTimeoutEndsAScoreUnderWay) {
  auto server =
      ServerProcess::start(make_tiny_model(fresh_temp_dir(), {.max_seq_len = kLongContext}),
                           {"--shutdown-timeout", "0.05", "--max-batch-tokens", "16"});
  ASSERT_TRUE(server);
  v1::ScoreRequest req;
  for (int id : prompt(kLongContext - 96)) req.add_ids(id);
  req.set_recursion_depth(8);
  grpc::Status st;
  std::thread caller([&] {
    v1::ScoreResponse resp;
    st = score(server->channel(), req, &resp, {.timeout = 600s});
  });
  // Under way once it holds its blocks.
  EXPECT_TRUE(wait_for_metrics(
      *server, [](const auto& m) { return metric(m, "cemlm:kv_cache_usage_perc") > 0; }));
  server->signal(SIGTERM);
  caller.join();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  EXPECT_EQ(server->wait_exit(30s), 0) << server->log();
}

// A signal while the model loads (here a 2 GiB KV cache being allocated and touched: seconds)
// ends the process at once, exit 0, without serving: the signal used to wait for the load to end
// (which could outlast a pod's grace period) and health then said SERVING for a moment.
TEST(ServerDrain, SignalWhileTheModelLoadsExitsAtOnce) {
  auto server = ServerProcess::start_listening(make_tiny_model(fresh_temp_dir()),
                                               {"--kv-cache-memory", "2G"});
  ASSERT_TRUE(server);
  server->signal(SIGTERM);  // at once: zero-filling 2 GiB takes a fast machine 0.2 s or more
  EXPECT_EQ(server->wait_exit(30s), 0) << server->log();
  const std::string log = server->log();
  EXPECT_NE(log.find("signal 15 while the model loads: exiting"), std::string::npos) << log;
  EXPECT_EQ(log.find("serving model="), std::string::npos) << log;
}

// Unary calls refused while the model loads are logged at most once a second (the line says how
// many were left out): a client polling through a load wrote a line for each, hundreds a second.
TEST(ServerHealth, CallsRefusedWhileLoadingAreLoggedOnceASecond) {
  auto server = ServerProcess::start_listening(make_tiny_model(fresh_temp_dir()),
                                               {"--kv-cache-memory", "2G"});
  ASSERT_TRUE(server);
  auto stub = v1::Inference::NewStub(server->channel());
  const auto start = std::chrono::steady_clock::now();
  int refused = 0;
  for (int i = 0; i < 2000; ++i) {
    grpc::ClientContext context;
    v1::ModelInfo info;
    const grpc::Status st = stub->GetModelInfo(&context, {}, &info);
    if (st.error_code() != grpc::StatusCode::UNAVAILABLE) break;
    ++refused;
  }
  // Generate calls refused before they start too (each wrote a "generate rejected" line).
  int streams_refused = 0;
  for (int i = 0; i < 200; ++i) {
    const Stream s = generate(server->channel(), ids_request({5, 6, 7}, 2, 1));
    if (s.status.error_code() != grpc::StatusCode::UNAVAILABLE) break;
    ++streams_refused;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (health(server->channel()) != "SERVING" && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(10ms);
  ASSERT_EQ(health(server->channel()), "SERVING") << server->log();
  const std::string log = server->log();
  size_t lines = 0, stream_lines = 0;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) {
    if (line.find("status=UNAVAILABLE") == std::string::npos) continue;
    lines += line.find("GetModelInfo peer=") != std::string::npos;
    stream_lines += line.find("generate rejected") != std::string::npos;
  }
  EXPECT_LE(double(lines), 2 + seconds) << refused << " calls refused in " << seconds << " s";
  EXPECT_LE(double(stream_lines), 2 + seconds)
      << streams_refused << " streams refused in " << seconds << " s";
  if (refused > 0) {
    EXPECT_GE(lines, 1u) << log;
  }
  if (refused > 1) {
    EXPECT_NE(log.find("refused_since_last_line="), std::string::npos) << log;
  }
}

// A model sure enough that the warm-up's text (token 0 after token 0) gets a perplexity past a
// double's serves: that judges the text, not the model (serve exited 1 after its ports line,
// where `cemlm generate` ran it). Score answers such a text OUT_OF_RANGE, not INTERNAL (a server
// error, which the alerts count).
TEST(ServerHealth, AModelSureOfItsTokensServes) {
  const std::string dir = fresh_temp_dir(), sure = dir + "/sure";
  absl::StatusOr<Checkpoint> ck = load_checkpoint(make_tiny_model(dir));
  ASSERT_TRUE(ck.ok()) << ck.status();
  const Tensor head = ck->params.get("lm_head.weight");
  for (int64_t i = 0; i < head.numel(); ++i) head.data[i] *= 1e6f;
  ASSERT_TRUE(save_checkpoint(sure, ck->config, ck->params, ck->tokenizer_path).ok());
  auto server = ServerProcess::start(sure);
  ASSERT_TRUE(server);
  EXPECT_TRUE(generate(server->channel(), ids_request({3, 4, 5}, 4, 1)).status.ok());
  v1::ScoreRequest req;
  req.add_ids(0), req.add_ids(0);
  v1::ScoreResponse resp;
  const grpc::Status st = score(server->channel(), req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::OUT_OF_RANGE) << st.error_message();
  EXPECT_NE(st.error_message().find("overflows: the model gives the text almost no probability"),
            std::string::npos)
      << st.error_message();
}

// Watch streams the status: NOT_SERVING while the model loads (if it still loads when the stream
// starts), SERVING once the server serves, NOT_SERVING when a drain begins, each change once; a
// name the server does not have is SERVICE_UNKNOWN; every stream ends when the server stops.
// (gRPC's default health service, which ours replaces, started SERVING before the model loaded.)
TEST(ServerHealth, WatchFollowsTheLifecycle) {
  using grpc::health::v1::HealthCheckResponse;
  auto server = ServerProcess::start_listening(make_tiny_model(fresh_temp_dir()),
                                               {"--kv-cache-memory", "1G"});
  ASSERT_TRUE(server);
  auto stub = grpc::health::v1::Health::NewStub(server->channel());
  grpc::ClientContext contexts[3];
  std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> streams[3];
  const char* names[3] = {"", "cemlm.v1.Inference", "no.such.Service"};
  for (int i = 0; i < 3; ++i) {
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(names[i]);
    streams[i] = stub->Watch(&contexts[i], req);
  }
  HealthCheckResponse r;
  ASSERT_TRUE(streams[2]->Read(&r));
  EXPECT_EQ(r.status(), HealthCheckResponse::SERVICE_UNKNOWN);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(streams[i]->Read(&r)) << names[i];
    if (r.status() == HealthCheckResponse::NOT_SERVING) {  // still loading
      ASSERT_TRUE(streams[i]->Read(&r)) << names[i];
    }
    EXPECT_EQ(r.status(), HealthCheckResponse::SERVING) << names[i];
  }
  server->signal(SIGTERM);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(streams[i]->Read(&r)) << names[i];
    EXPECT_EQ(r.status(), HealthCheckResponse::NOT_SERVING) << names[i];
  }
  EXPECT_EQ(server->wait_exit(30s), 0) << server->log();
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE(streams[i]->Read(&r)) << names[i] << ": " << r.status();
    EXPECT_FALSE(streams[i]->Finish().ok()) << names[i];
  }
}

class ServerLifecycle : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = make_tiny_model(fresh_temp_dir());
    server_ = ServerProcess::start(model_);
    ASSERT_TRUE(server_);
  }
  std::string model_;
  std::unique_ptr<ServerProcess> server_;
};

v1::ModelInfo model_info(const ServerProcess& s) {
  auto stub = v1::Inference::NewStub(s.channel());
  grpc::ClientContext context;
  v1::ModelInfo info;
  EXPECT_TRUE(stub->GetModelInfo(&context, {}, &info).ok());
  return info;
}

// The server runs its products on the best OpenBLAS kernels for this machine: those this test
// process loaded, unless they are generic or AVX2 ones on an AVX-512 processor, which `cemlm`
// replaces (OPENBLAS_CORETYPE and a re-exec) before it starts.
// The soft open-files limit goes up to the hard one: gRPC accepts no connection again once accept()
// has failed for lack of a descriptor (a fuzzing run lost the port for good at a limit of 160).
TEST(ServerFiles, TheSoftOpenFilesLimitGoesUpToTheHardOne) {
  rlimit mine{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &mine), 0);
  if (mine.rlim_max != RLIM_INFINITY && mine.rlim_max <= 256)
    GTEST_SKIP() << "the hard limit here is " << mine.rlim_max << ": nothing to raise";
  rlimit low = mine;
  low.rlim_cur = 256;  // the server inherits it
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  auto server = ServerProcess::start(make_tiny_model(fresh_temp_dir()));
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &mine), 0);
  ASSERT_TRUE(server);
  std::ifstream in("/proc/" + std::to_string(server->pid()) + "/limits");
  std::string line;
  while (std::getline(in, line) && !line.starts_with("Max open files")) {
  }
  std::istringstream fields(line.substr(std::string("Max open files").size()));
  std::string soft, hard;
  fields >> soft >> hard;
  const std::string want = mine.rlim_max == RLIM_INFINITY ? std::to_string(1 << 20)
                                                          : std::to_string(mine.rlim_max);
  EXPECT_EQ(soft, want) << line;
  EXPECT_EQ(hard, mine.rlim_max == RLIM_INFINITY ? "unlimited" : want) << line;
}

TEST_F(ServerLifecycle, LogsTheBlasKernelsItChose) {
  const std::string here = openblas_get_corename();
  std::string want = better_openblas_core_here();
  if (want.empty() || std::getenv("OPENBLAS_CORETYPE")) want = here;
  // The line comes right after health turned SERVING (all that start() waited for).
  std::string log = server_->log();
  for (auto end = std::chrono::steady_clock::now() + 10s;
       log.find(" blas=") == std::string::npos && std::chrono::steady_clock::now() < end;
       std::this_thread::sleep_for(10ms))
    log = server_->log();
  EXPECT_NE(log.find(", " + want + " kernels"), std::string::npos) << "want " << want << " in\n"
                                                                     << log;
}

// `cemlm serve FLAGS` exits non-zero without serving; returns what it wrote on stderr.
// `status`: 2 for a flag's value refused for itself (a usage error, "error: …"), 1 for what
// fails with the flags accepted.
std::string refused_serve(const std::string& model, const std::string& flags, int status) {
  const std::string log = fresh_temp_dir() + "/serve.log";
  const int rc = std::system(("'" CEMLM_BIN "' serve --model '" + model +
                              "' --port 0 --metrics-port 0 " + flags + " 2>'" + log + "'")
                                 .c_str());
  EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == status) << flags << ": " << rc;
  std::ifstream in(log);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// --kv-cache-dtype bf16 serves with half the cache bytes per token, int8 with a little over a
// quarter, --device cpu:bf16 with bf16
// weights (ModelInfo says which device); an unknown dtype or device, an --engine-nice out of
// range or a zero --max-running/--max-waiting/--max-batch-tokens is refused at start with a
// message naming the flag, a usage error (exit 2).
TEST_F(ServerLifecycle, KvCacheDtypeDeviceAndEngineNiceFlags) {
  // bf16 weights need the AVX-512 kernels; a build without them refuses the device (below).
  const std::string device = packed_weights_available() ? "cpu:bf16" : "cpu";
  auto bf16 = ServerProcess::start(
      model_, {"--kv-cache-dtype", "bf16", "--device", device, "--engine-nice", "0"});
  ASSERT_TRUE(bf16);
  const int64_t fp32_bytes = model_info(*server_).kv_bytes_per_token();
  EXPECT_GT(fp32_bytes, 0);
  EXPECT_EQ(model_info(*bf16).kv_bytes_per_token() * 2, fp32_bytes);
  // "cpu" is "cpu:fp32": one configuration, one name (on dashboards too).
  EXPECT_EQ(model_info(*bf16).device(), device == "cpu" ? "cpu:fp32" : device);
  EXPECT_EQ(model_info(*server_).device(), "cpu:fp32");
  if (!packed_weights_available()) {
    const std::string err = refused_serve(model_, "--device cpu:int8", 2);
    EXPECT_NE(err.find("--device cpu:int8: this build has no AVX-512 kernels"), std::string::npos)
        << err;
  }
  const Stream s = generate(bf16->channel(), ids_request(prompt(9), 5, 2));
  EXPECT_TRUE(s.status.ok()) << s.status.error_message();
  bf16.reset();
  // int8: a byte per cached number, plus a 4-byte scale per head of each key or value row.
  auto int8 = ServerProcess::start(model_, {"--kv-cache-dtype", "int8", "--engine-nice", "0"});
  ASSERT_TRUE(int8);
  const v1::ModelInfo int8_info = model_info(*int8), fp32_info = model_info(*server_);
  const int64_t int8_bytes = int8_info.kv_bytes_per_token();
  EXPECT_GT(int8_bytes, fp32_bytes / 4);
  EXPECT_LT(int8_bytes, fp32_bytes / 3);
  EXPECT_EQ(int8_info.kv_cache_dtype(), "int8");
  EXPECT_EQ(fp32_info.kv_cache_dtype(), "fp32");
  // The same --kv-cache-memory holds more than three times the tokens.
  EXPECT_GT(int8_info.kv_cache_capacity_tokens(), 3 * fp32_info.kv_cache_capacity_tokens());
  const Stream s8 = generate(int8->channel(), ids_request(prompt(9), 5, 2));
  EXPECT_TRUE(s8.status.ok()) << s8.status.error_message();
  EXPECT_EQ(s8.ids().size(), 5u);
  std::string err = refused_serve(model_, "--kv-cache-dtype fp16", 2);
  EXPECT_NE(err.find("--kv-cache-dtype \"fp16\" is not one of fp32, bf16, int8"), std::string::npos)
      << err;
  err = refused_serve(model_, "--engine-nice 20", 2);
  EXPECT_NE(err.find("--engine-nice 20 must be in [0, 19]"), std::string::npos) << err;
  for (const char* flag : {"--max-running", "--max-waiting", "--max-batch-tokens"}) {
    err = refused_serve(model_, std::string(flag) + " 0", 2);
    EXPECT_NE(err.find(std::string(flag) + " 0 must be at least 1"), std::string::npos) << err;
  }
  const std::pair<std::string, std::string> bad[] = {
      {"--port 99999", "--port 99999 is not a port"},
      {"--port -5", "--port -5 is not a port"},
      {"--metrics-port 70000", "--metrics-port 70000 is not a port"},
      {"--shutdown-timeout -1", "--shutdown-timeout -1 must be in [0, 1e6] seconds"},
      // Past the bound the drain deadline overflowed into the past: no drain at all.
      {"--shutdown-timeout inf", "--shutdown-timeout inf must be in [0, 1e6] seconds"},
      {"--shutdown-timeout 1e10", "--shutdown-timeout 1e+10 must be in [0, 1e6] seconds"},
      // Quoted as given: with 6 digits it read "1e+06 must be in [0, 1e6]".
      {"--shutdown-timeout 1000000.1", "--shutdown-timeout 1000000.1 must be in [0, 1e6] seconds"},
      {"--unread-timeout 0.9999999", "--unread-timeout 0.9999999 must be in [1, 1e6] seconds"},
      {"--keepalive-time -1", "--keepalive-time -1 must be 0 (no pings) or at least 0.001 seconds"},
      // gRPC counts in whole milliseconds: less was 0 ms (pings without a pause).
      {"--keepalive-time 0.0004",
       "--keepalive-time 4e-04 must be 0 (no pings) or at least 0.001 seconds"},
      {"--grpc-memory lots",
       "--grpc-memory: expected bytes like 256M or 1G (0: no bound), got "
       "'lots'"},
      {"--grpc-memory 1M", "--grpc-memory 1M is under 16M, too little for gRPC to serve"},
      {"--keepalive-timeout 0", "--keepalive-timeout 0 must be at least 0.001 seconds"},
      {"--keepalive-timeout nan", "--keepalive-timeout nan must be at least 0.001 seconds"},
      {"--keepalive-timeout 1e-4", "--keepalive-timeout 1e-04 must be at least 0.001 seconds"},
      {"--threads -3", "--threads -3 must be >= 0"},
      // Past the system's thread limit, the load crashed (SIGSEGV) after the port line.
      {"--threads 100000", "--threads 100000 must be >= 0 and at most 1024"},
      {"--device cuda:fp16",
       "--device \"cuda:fp16\" is not one of cpu, cpu:fp32, cpu:bf16, cpu:bf16dot, cpu:int8, "
       "cpu:int8dot, cuda"},
      {"--model-name m\xFFx", "--model-name is not valid UTF-8 (bad byte at offset 1)"},
      // A line break split the log lines that carry the name.
      {"--model-name 'm\nx'", "--model-name holds a control character (byte 0x0a at offset 1)"},
      {"--kv-cache-memory 0K", "--kv-cache-memory 0K holds no KV cache: give its size, like 4G"},
      {"--prefix-cache-scope tenant", "--prefix-cache-scope \"tenant\" is not one of key, shared"}};
  for (const auto& [flags, message] : bad) {
    err = refused_serve(model_, flags, 2);
    EXPECT_NE(err.find(message), std::string::npos) << flags << ": " << err;
    EXPECT_EQ(err.find("listening"), std::string::npos) << flags << ": refused only after listening";
  }
  // The default name, the directory's, must be UTF-8 too (it is a metric label).
  const std::string odd = fresh_temp_dir() + "/m\xFFx";
  std::filesystem::create_directory_symlink(std::filesystem::absolute(model_), odd);
  err = refused_serve(odd, "", 1);
  EXPECT_NE(err.find("the model directory's name (the default --model-name) is not valid UTF-8"),
            std::string::npos)
      << err;
}

// The default model name is the directory's, also when --model is relative: `--model .` named
// the model "." in ModelInfo and in every series' label.
TEST_F(ServerLifecycle, ModelNameOfADotDirectoryIsItsName) {
  const std::filesystem::path here = std::filesystem::current_path();
  std::filesystem::current_path(model_);  // the server starts here
  auto dot = ServerProcess::start(".");
  std::filesystem::current_path(here);
  ASSERT_TRUE(dot);
  EXPECT_EQ(model_info(*dot).model_name(), std::filesystem::path(model_).filename().string());
  EXPECT_NE(dot->metrics_text().find("model_name=\"" +
                                     std::filesystem::path(model_).filename().string() + "\""),
            std::string::npos);
}

// A second server on a port in use is refused (gRPC's default SO_REUSEPORT would let it start
// and take a share of the first one's connections), and the first keeps serving alone.
TEST_F(ServerLifecycle, PortInUseIsRefused) {
  const std::string err = refused_serve(
      model_, "--host 127.0.0.1 --port " + std::to_string(server_->port()) + " --model-name second",
      1);
  EXPECT_NE(err.find("in use"), std::string::npos) << err;
  EXPECT_EQ(model_info(*server_).model_name(), "model");
}

// Load balancers and meshes check the service by name as well as the whole server.
TEST_F(ServerLifecycle, HealthAnswersForTheServiceName) {
  EXPECT_EQ(health(server_->channel(), "cemlm.v1.Inference"), "SERVING");
  EXPECT_EQ(health(server_->channel(), "no.such.Service"), "error 5");  // NOT_FOUND
}

// --host ::1 serves gRPC and /metrics on the IPv6 loopback; an address the machine does not have
// is refused, naming the port that could not listen.
TEST_F(ServerLifecycle, ServesOnAnIpv6Host) {
  auto v6 = ServerProcess::start(model_, {"--host", "::1"});
  ASSERT_TRUE(v6);
  EXPECT_EQ(v6->addr().rfind("[::1]:", 0), 0u) << v6->addr();
  const Stream s = generate(v6->channel(), ids_request(prompt(4), 3));
  EXPECT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_NE(v6->metrics_text().find("cemlm:generation_tokens_total"), std::string::npos);
  const std::string err = refused_serve(model_, "--host fe80::1", 1);
  EXPECT_NE(err.find(": cannot listen on fe80::1"), std::string::npos) << err;
}

// A request for another path than /metrics is answered 404 and the server goes on: through
// civetweb (100 KiB thread stacks, ~60 KiB of them OpenBLAS's static TLS) the 404 overflowed a
// stack and the next request killed the process.
TEST_F(ServerLifecycle, MetricsPortSurvivesOtherPaths) {
  auto s = ServerProcess::start(model_);
  ASSERT_TRUE(s);
  for (const char* path : {"/favicon.ico", "/", "/metrics/../x"}) {
    const std::string r = testing_server::http_exchange(
        s->host(), s->metrics_port(), std::string("GET ") + path + " HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_EQ(r.rfind("HTTP/1.1 404", 0), 0u) << path << ": " << r;
    EXPECT_NE(s->metrics_text().find("cemlm:generation_tokens_total"), std::string::npos) << path;
  }
  EXPECT_EQ(s->wait_exit(std::chrono::milliseconds(0)), -1) << "the server still runs";
  EXPECT_EQ(health(s->channel()), "SERVING");
}

// --metrics-host puts /metrics on an address of its own (it has no authentication: kept off the
// network while gRPC listens on every interface); by default it is --host's.
TEST_F(ServerLifecycle, MetricsHostBindsTheMetricsApart) {
  auto s = ServerProcess::start(model_, {"--metrics-host", "127.0.0.2"});
  ASSERT_TRUE(s);
  const std::string get = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  const std::string there = testing_server::http_exchange("127.0.0.2", s->metrics_port(), get);
  EXPECT_EQ(there.rfind("HTTP/1.1 200", 0), 0u) << there.substr(0, 80);
  EXPECT_EQ(testing_server::http_exchange(s->host(), s->metrics_port(), get), "")
      << "/metrics answered on --host too";
  EXPECT_NE(s->log().find("metrics=http://127.0.0.2:" + std::to_string(s->metrics_port())),
            std::string::npos)
      << s->log();
}

// --max-connection-age closes a client's connection once it is that old (GOAWAY), so the channel
// goes idle and its next call reconnects (to whichever replica DNS gives); without the flag the
// connection stays up. A negative age is refused, naming the flag.
TEST_F(ServerLifecycle, MaxConnectionAgeMakesClientsReconnect) {
  auto aged = ServerProcess::start(model_, {"--max-connection-age", "0.5"});
  ASSERT_TRUE(aged);
  // Waiting on the channel (not polling GetState) drives its I/O, so a GOAWAY is read at once
  // rather than by gRPC's 5 s backup poller.
  auto state_within = [](const std::shared_ptr<grpc::Channel>& ch, grpc_connectivity_state want,
                         std::chrono::milliseconds limit) {
    const auto end = std::chrono::system_clock::now() + limit;
    for (grpc_connectivity_state s = ch->GetState(false); s != want; s = ch->GetState(false))
      if (!ch->WaitForStateChange(s, end)) return false;
    return true;
  };
  ASSERT_TRUE(generate(aged->channel(), ids_request(prompt(4), 2)).status.ok());
  ASSERT_TRUE(generate(server_->channel(), ids_request(prompt(4), 2)).status.ok());
  EXPECT_TRUE(state_within(aged->channel(), GRPC_CHANNEL_IDLE, 5s));
  EXPECT_FALSE(state_within(server_->channel(), GRPC_CHANNEL_IDLE, 1500ms));
  EXPECT_TRUE(generate(aged->channel(), ids_request(prompt(4), 2)).status.ok());
  const std::string err = refused_serve(model_, "--max-connection-age -1", 2);
  EXPECT_NE(err.find("--max-connection-age -1 must be 0 (no limit) or at least 0.001 seconds"),
            std::string::npos)
      << err;
  // Under a millisecond it was 0 ms to gRPC: every connection closed at once, clients hung.
  const std::string tiny = refused_serve(model_, "--max-connection-age 0.0004", 2);
  EXPECT_NE(tiny.find("--max-connection-age 4e-04 must be 0 (no limit) or at least 0.001"),
            std::string::npos)
      << tiny;
  const std::string grace = refused_serve(model_, "--max-connection-age-grace -1", 2);
  EXPECT_NE(grace.find("--max-connection-age-grace -1 must be in [0, 1e6] seconds"),
            std::string::npos)
      << grace;
}

// A stream still running when its connection reaches --max-connection-age gets
// --max-connection-age-grace to finish, not --shutdown-timeout (which cut long generations at
// every connection age).
TEST(ServerConnectionAge, AStreamOutlivingItsConnectionsAgeGetsTheGrace) {
  auto server =
      ServerProcess::start(make_tiny_model(fresh_temp_dir(), {.max_seq_len = kLongContext}),
                           {"--max-connection-age", "0.5", "--max-connection-age-grace", "600",
                            "--shutdown-timeout", "0.2", "--unread-timeout", "600"});
  ASSERT_TRUE(server);
  const auto channel = small_window_channel(server->addr());  // held on the server: see above
  grpc::ClientContext context;
  auto reader =
      v1::Inference::NewStub(channel)->Generate(&context, ids_request(prompt(12), 1500, 8));
  v1::GenerateResponse m;
  ASSERT_TRUE(reader->Read(&m));
  int tokens = m.token_ids_size();
  std::this_thread::sleep_for(1500ms);  // past the age and any grace of --shutdown-timeout
  for (; reader->Read(&m);) tokens += m.token_ids_size();
  const grpc::Status st = reader->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(tokens, 1500);
}

TEST_F(ServerLifecycle, MetricsExpositionParsesAndCountersMove) {
  const std::map<std::string, std::string> families = {
      {"cemlm:num_requests_running", "gauge"},
      {"cemlm:num_requests_waiting", "gauge"},
      {"cemlm:kv_cache_usage_perc", "gauge"},
      {"cemlm:kv_cache_capacity_tokens", "gauge"},
      {"cemlm:cache_config_info", "gauge"},
      {"cemlm:num_preemptions_total", "counter"},
      {"cemlm:compute_thread_rests_total", "counter"},
      {"cemlm:prompt_tokens_total", "counter"},
      {"cemlm:generation_tokens_total", "counter"},
      {"cemlm:time_to_first_token_seconds", "histogram"},
      {"cemlm:inter_token_latency_seconds", "histogram"},
      {"cemlm:e2e_request_latency_seconds", "histogram"},
      {"cemlm:request_queue_time_seconds", "histogram"},
      {"cemlm:recursion_depth", "histogram"},
      {"cemlm:score_request_latency_seconds", "histogram"},
      {"cemlm:score_tokens_total", "counter"},
      {"cemlm:score_recursion_depth", "histogram"}};
  // Before any request every family is there, with the series dashboards divide by at 0.
  const std::string fresh_text = server_->metrics_text();
  for (const char* name : {"cemlm:request_success_total", "cemlm:request_errors_total",
                           "cemlm:requests_total", "cemlm:prefix_cache_hit_tokens_total"})
    EXPECT_NE(fresh_text.find(std::string("# TYPE ") + name + " counter\n"), std::string::npos)
        << name;
  const auto fresh = parse_metrics(fresh_text);
  for (const char* series :
       {"cemlm:request_success_total{finished_reason=\"stop\",model_name=\"model\"} 0\n",
        "cemlm:request_errors_total{code=\"INTERNAL\",model_name=\"model\"} 0\n",
        "cemlm:requests_total{code=\"OK\",method=\"Score\",model_name=\"model\"} 0\n"})
    EXPECT_NE(fresh_text.find(series), std::string::npos) << series << fresh_text;

  const Stream s = generate(server_->channel(), ids_request(prompt(9), 7, 2));
  ASSERT_TRUE(s.status.ok());
  ASSERT_EQ(generate(server_->channel(), ids_request({}, 3)).status.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(model_info(*server_).model_name(), "model");
  const std::string text = server_->metrics_text();
  for (const auto& [name, type] : families)
    EXPECT_NE(text.find("# TYPE " + name + " " + type + "\n"), std::string::npos) << name;
  const auto m = parse_metrics(text);
  for (const auto& [series, value] : m) {
    if (series.starts_with("cemlm:")) {
      EXPECT_NE(series.find("model_name=\"model\""), std::string::npos) << series;
    }
  }
  EXPECT_EQ(metric(m, "cemlm:prompt_tokens_total"), 9);
  EXPECT_EQ(metric(m, "cemlm:generation_tokens_total"), 7);
  EXPECT_EQ(metric(m, "cemlm:request_success_total", "finished_reason=\"length\""), 1);
  EXPECT_EQ(metric(m, "cemlm:request_errors_total", "code=\"INVALID_ARGUMENT\""), 1);
  // Every RPC counts in requests_total by method and code, OK ones too.
  EXPECT_EQ(metric(m, "cemlm:requests_total", "code=\"OK\",method=\"Generate\""), 1);
  EXPECT_EQ(metric(m, "cemlm:requests_total", "code=\"INVALID_ARGUMENT\",method=\"Generate\""),
            1);
  EXPECT_EQ(metric(m, "cemlm:requests_total", "code=\"OK\",method=\"GetModelInfo\""), 1);
  EXPECT_EQ(metric(m, "cemlm:time_to_first_token_seconds_count"), 1);
  EXPECT_EQ(metric(m, "cemlm:inter_token_latency_seconds_count"), 6);
  EXPECT_EQ(metric(m, "cemlm:e2e_request_latency_seconds_count"), 1);
  EXPECT_EQ(metric(m, "cemlm:request_queue_time_seconds_count"), 1);
  EXPECT_EQ(metric(m, "cemlm:recursion_depth_sum"), 2);
  // The cache as served: its capacity and its configuration, as GetModelInfo says.
  const v1::ModelInfo info = model_info(*server_);
  EXPECT_GT(info.kv_cache_capacity_tokens(), 0);
  EXPECT_EQ(info.kv_cache_capacity_tokens() % 16, 0);  // whole 16-token blocks
  EXPECT_EQ(metric(m, "cemlm:kv_cache_capacity_tokens"), info.kv_cache_capacity_tokens());
  EXPECT_EQ(metric(m, "cemlm:cache_config_info",
                   "device=\"cpu:fp32\",kv_bytes_per_token=\"" +
                       std::to_string(info.kv_bytes_per_token()) + "\",kv_cache_dtype=\"fp32\""),
            1);
  EXPECT_EQ(metric(m, "cemlm:max_num_requests_waiting"), 1024);  // serve's --max-waiting
  // The engine publishes its gauges after the step that finished the request.
  EXPECT_TRUE(wait_for_metrics(*server_, [](const auto& now) {
    return metric(now, "cemlm:num_requests_running") == 0 &&
           metric(now, "cemlm:kv_cache_usage_perc") == 0;
  }));
  EXPECT_EQ(metric(m, "cemlm:e2e_request_latency_seconds_bucket", "le=\"+Inf\""), 1);
  // Finite buckets reach a 20-minute generation (a long one at a high T on a CPU).
  EXPECT_EQ(metric(m, "cemlm:e2e_request_latency_seconds_bucket", "le=\"1280\""), 1);
}

// Each Score call that ends OK counts once in the Score latency and recursion depth histograms
// and its token ids in score_tokens_total; one refused for a bad id counts in none of them, and
// Score calls leave Generate's series (e2e latency, recursion_depth, prompt tokens) alone.
TEST_F(ServerLifecycle, ScoreMetricsCountOkCallsOnly) {
  auto request = [](int n, int depth) {
    v1::ScoreRequest req;
    for (int id : prompt(n)) req.add_ids(id);
    req.set_recursion_depth(depth);
    return req;
  };
  v1::ScoreResponse first, second, refused;
  ASSERT_TRUE(score(server_->channel(), request(12, 5), &first).ok());
  ASSERT_TRUE(score(server_->channel(), request(20, 7), &second).ok());
  v1::ScoreRequest bad = request(8, 1);
  bad.add_ids(-1);
  ASSERT_EQ(score(server_->channel(), bad, &refused).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_EQ(first.token_ids_size() + second.token_ids_size(), 32);
  const auto m = parse_metrics(server_->metrics_text());
  EXPECT_EQ(metric(m, "cemlm:requests_total", "code=\"INVALID_ARGUMENT\",method=\"Score\""), 1);
  EXPECT_EQ(metric(m, "cemlm:score_request_latency_seconds_count"), 2);
  EXPECT_EQ(metric(m, "cemlm:score_request_latency_seconds_bucket", "le=\"+Inf\""), 2);
  EXPECT_EQ(metric(m, "cemlm:score_tokens_total"), 32);
  EXPECT_EQ(metric(m, "cemlm:score_recursion_depth_count"), 2);
  EXPECT_EQ(metric(m, "cemlm:score_recursion_depth_sum"), 5 + 7);
  // Each T up to 8 has its own bucket (5 and 7 fell in 6 and 8 with 4 and 6).
  EXPECT_EQ(metric(m, "cemlm:score_recursion_depth_bucket", "le=\"4\""), 0);
  EXPECT_EQ(metric(m, "cemlm:score_recursion_depth_bucket", "le=\"5\""), 1);
  EXPECT_EQ(metric(m, "cemlm:score_recursion_depth_bucket", "le=\"6\""), 1);
  EXPECT_EQ(metric(m, "cemlm:score_recursion_depth_bucket", "le=\"7\""), 2);
  EXPECT_EQ(metric(m, "cemlm:e2e_request_latency_seconds_count"), 0);
  EXPECT_EQ(metric(m, "cemlm:recursion_depth_count"), 0);
  EXPECT_EQ(metric(m, "cemlm:prompt_tokens_total"), 0);
}

TEST_F(ServerLifecycle, PrefixCacheHitsReachMetrics) {
  const std::vector<int> shared = prompt(40);  // two full 16-token blocks to share
  ASSERT_TRUE(generate(server_->channel(), ids_request(shared, 2, 1)).status.ok());
  const Stream again = generate(server_->channel(), ids_request(shared, 2, 1));
  ASSERT_TRUE(again.status.ok());
  const int cached = again.messages.back().usage().cached_prompt_tokens();
  EXPECT_GE(cached, 16);
  EXPECT_TRUE(wait_for_metrics(*server_, [&](const auto& now) {
    return metric(now, "cemlm:prefix_cache_hit_tokens_total") == cached;
  }));
}

void expect_same_scores(const v1::ScoreResponse& rpc, const std::string& cli_json) {
  const auto cli = nlohmann::json::parse(cli_json);
  ASSERT_EQ(cli.at("tokens").size(), size_t(rpc.token_ids_size()));
  for (int i = 0; i < rpc.token_ids_size(); ++i)
    EXPECT_EQ(cli.at("tokens")[size_t(i)], rpc.token_ids(i));
  ASSERT_EQ(cli.at("logprobs").size(), size_t(rpc.logprobs_size()) + 1);
  EXPECT_TRUE(cli.at("logprobs")[0].is_null());
  for (int i = 0; i < rpc.logprobs_size(); ++i)
    EXPECT_NEAR(rpc.logprobs(i), cli.at("logprobs")[size_t(i) + 1].get<double>(), 1e-4) << i;
  EXPECT_NEAR(rpc.nll(), cli.at("nll").get<double>(), 1e-5);
  EXPECT_NEAR(rpc.perplexity(), cli.at("perplexity").get<double>(), 1e-4 * rpc.perplexity());
}

TEST_F(ServerLifecycle, ScoreEqualsCemlmScore) {
  v1::ScoreRequest by_ids;
  std::string ids;
  for (int id : prompt(40)) {
    by_ids.add_ids(id);
    ids += (ids.empty() ? "" : ",") + std::to_string(id);
  }
  by_ids.set_recursion_depth(3);
  v1::ScoreResponse rpc;
  ASSERT_TRUE(score(server_->channel(), by_ids, &rpc).ok());
  EXPECT_EQ(rpc.recursion_depth(), 3);
  std::string out;
  ASSERT_EQ(run_cemlm({"score", "--model", model_, "--ids", ids, "--recursion", "3"}, &out), 0);
  expect_same_scores(rpc, out);

  const std::string text = "Many a true word is spoken in jest.";
  v1::ScoreRequest by_text;
  by_text.set_text(text);
  ASSERT_TRUE(score(server_->channel(), by_text, &rpc).ok());
  ASSERT_EQ(run_cemlm({"score", "--model", model_, "--text", text}, &out), 0);
  expect_same_scores(rpc, out);
  // `client score --json` prints the local command's shape (it printed the proto's field names,
  // logprobs one shorter): a script reads either.
  std::string client_out;
  ASSERT_EQ(run_cemlm({"client", "score", "--addr", server_->addr(), "--text", text, "--json"},
                      &client_out),
            0);
  expect_same_scores(rpc, client_out);
  const auto local = nlohmann::json::parse(out), client = nlohmann::json::parse(client_out);
  EXPECT_EQ(client.at("recursion"), local.at("recursion"));
  std::vector<std::string> local_keys, client_keys;
  for (const auto& [k, v] : local.items()) local_keys.push_back(k);
  for (const auto& [k, v] : client.items()) client_keys.push_back(k);
  EXPECT_EQ(client_keys, local_keys);
  EXPECT_EQ(rpc.token_ids(0), 1);  // both start the text with the BOS of training documents
  const int with_bos = rpc.token_ids_size();
  by_text.set_add_bos(false);
  ASSERT_TRUE(score(server_->channel(), by_text, &rpc).ok());
  ASSERT_EQ(run_cemlm({"score", "--model", model_, "--text", text, "--no-bos"}, &out), 0);
  expect_same_scores(rpc, out);
  EXPECT_EQ(rpc.token_ids_size(), with_bos - 1);
  EXPECT_NE(rpc.token_ids(0), 1);
  // Flags that do not go together: a usage error (2, as the flag parser's).
  EXPECT_EQ(run_cemlm({"score", "--model", model_, "--ids", "5,6", "--no-bos"}, &out), 2);
  // A logits file that cannot be written is named by its flag, before the forward runs.
  std::string err;
  EXPECT_EQ(run_cemlm({"score", "--model", model_, "--ids", "5,6", "--dump-logits",
                       "/nonexistent_dir/logits.safetensors"},
                      &out, &err),
            1);
  EXPECT_NE(err.find("error: --dump-logits '/nonexistent_dir/logits.safetensors': "
                     "'/nonexistent_dir' does not exist"),
            std::string::npos)
      << err;
  const std::string dir = fresh_temp_dir();
  EXPECT_EQ(run_cemlm({"score", "--model", model_, "--ids", "5,6", "--dump-logits", dir + "/"},
                      &out, &err),
            1);
  EXPECT_NE(err.find("is a directory; name the file to write, like " + dir + "/logits.safetensors"),
            std::string::npos)
      << err;
  // An empty path is refused (it wrote nothing and exited 0), as is a FIFO (replaced by a file).
  EXPECT_EQ(
      run_cemlm({"score", "--model", model_, "--ids", "5,6", "--dump-logits", ""}, &out, &err), 1);
  EXPECT_NE(err.find("--dump-logits is empty; name the file to write, like logits.safetensors"),
            std::string::npos)
      << err;
  // Nor the checkpoint's own files (the logits replaced its weights), by any path to them.
  for (const std::string& own : {model_ + "/model.safetensors", model_ + "/./config.json"}) {
    EXPECT_EQ(
        run_cemlm({"score", "--model", model_, "--ids", "5,6", "--dump-logits", own}, &out, &err),
        1);
    EXPECT_NE(err.find("--dump-logits '" + own + "' is an input of this command"),
              std::string::npos)
        << err;
  }
  ASSERT_TRUE(run_cemlm({"score", "--model", model_, "--ids", "5,6"}, &out) == 0) << out;
  // And `tokenizer train` does not write its model over its text.
  const std::string corpus = dir + "/corpus.txt";
  { std::ofstream(corpus) << "the cat sat on the mat\n"; }
  EXPECT_EQ(run_cemlm({"tokenizer", "train", "--input", corpus, "--out", corpus}, &out, &err), 1);
  EXPECT_NE(err.find("--out '" + corpus + "' is an input of this command"), std::string::npos)
      << err;
  // Nor over a text of an --input directory; a model file there is no input (it is rewritten).
  EXPECT_EQ(run_cemlm({"tokenizer", "train", "--input", dir, "--out", corpus}, &out, &err), 1);
  EXPECT_NE(err.find("--out '" + corpus + "' is an input of this command"), std::string::npos)
      << err;
  {
    std::ifstream in(corpus);
    std::string line;
    std::getline(in, line);
    EXPECT_EQ(line, "the cat sat on the mat");
  }
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0600), 0);
  EXPECT_EQ(run_cemlm({"score", "--model", model_, "--ids", "5,6", "--dump-logits", dir + "/fifo"},
                      &out, &err),
            1);
  EXPECT_NE(err.find("exists and is not a regular file"), std::string::npos) << err;
  EXPECT_TRUE(std::filesystem::is_fifo(dir + "/fifo"));
  // 0 is a depth too (the model's default): the range says so. Below 0 is no model's depth: a
  // usage error, as generate's and grads' (exit 2, before the model loads).
  EXPECT_EQ(
      run_cemlm({"score", "--model", model_, "--ids", "5,6", "--recursion", "-2"}, &out, &err), 2);
  EXPECT_NE(err.find("--recursion = -2 must be >= 0 (0 = the model's recursion.default)"),
            std::string::npos)
      << err;
  EXPECT_EQ(run_cemlm({"score", "--model", model_, "--ids", "5,-6"}, &out, &err), 2);
  EXPECT_NE(err.find("--ids[1] = -6 is not a token id (ids are >= 0)"), std::string::npos) << err;
}

// grpc.reflection.v1alpha list_services, spoken with a generic stub (no reflection client ships
// with Debian's gRPC): the request is field 7 (list_services) = "*".
TEST_F(ServerLifecycle, ReflectionListsTheService) {
  grpc::GenericStub stub(server_->channel());
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 10s);
  auto call = stub.PrepareCall(
      &context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  auto step = [&](int tag) {
    void* got = nullptr;
    bool ok = false;
    return cq.Next(&got, &ok) && got == reinterpret_cast<void*>(intptr_t(tag)) && ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(step(1));
  const std::string request = "\x3a\x01*";
  grpc::Slice slice(request);
  grpc::ByteBuffer out(&slice, 1);
  call->Write(out, reinterpret_cast<void*>(2));
  ASSERT_TRUE(step(2));
  grpc::ByteBuffer in;
  call->Read(&in, reinterpret_cast<void*>(3));
  ASSERT_TRUE(step(3));
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(in.Dump(&slices).ok());
  std::string response;
  for (const auto& s : slices) response.append(reinterpret_cast<const char*>(s.begin()), s.size());
  EXPECT_NE(response.find("cemlm.v1.Inference"), std::string::npos);
  call->WritesDone(reinterpret_cast<void*>(4));
  ASSERT_TRUE(step(4));
  grpc::Status st;
  call->Finish(&st, reinterpret_cast<void*>(5));
  ASSERT_TRUE(step(5));
  EXPECT_TRUE(st.ok()) << st.error_message();
}

TEST_F(ServerLifecycle, CommandLineClientAndBenchServe) {
  const std::string addr = server_->addr();
  std::string out;
  for (const char* sub : {"serve", "client", "bench-serve"}) {
    EXPECT_EQ(run_cemlm({sub, "--help"}, &out), 0) << sub;
    EXPECT_NE(out.find("usage"), std::string::npos) << sub << ": " << out;
  }
  ASSERT_EQ(run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "5,6,7",
                       "--max-new-tokens", "5", "--ignore-eos", "--top-logprobs", "3", "--json"},
                      &out),
            0);
  const auto gen = nlohmann::json::parse(out);
  EXPECT_EQ(gen["ids"].size(), 5u);
  EXPECT_EQ(gen["logprobs"].size(), 5u);
  ASSERT_EQ(gen["top_logprobs"].size(), 5u);  // per token, its 3 best alternatives
  for (const auto& alts : gen["top_logprobs"]) {
    ASSERT_EQ(alts.size(), 3u);
    EXPECT_GE(alts[0]["logprob"].get<double>(), alts[2]["logprob"].get<double>());
    EXPECT_TRUE(alts[0]["id"].is_number_integer());
  }
  EXPECT_EQ(gen["finish_reason"], "length");
  EXPECT_EQ(gen["usage"]["prompt_tokens"], 3);
  // --request-id comes back; a seed reproduces a sample; a negative seed is refused.
  std::string seeded[2];
  for (std::string& o : seeded) {
    ASSERT_EQ(run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "5,6,7",
                         "--max-new-tokens", "6", "--ignore-eos", "--seed", "18446744073709551615",
                         "--request-id", "abc-1", "--json"},
                        &o),
              0);
    EXPECT_EQ(nlohmann::json::parse(o)["request_id"], "abc-1");
  }
  // --cache-salt reaches the request: a salted prompt reuses only what its salt cached.
  auto cached_with = [&](const std::string& salt) {
    std::string o;
    EXPECT_EQ(run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids",
                         "5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21", "--max-new-tokens", "1",
                         "--cache-salt", salt, "--json"},
                        &o),
              0);
    return nlohmann::json::parse(o)["usage"]["cached_prompt_tokens"].get<int>();
  };
  EXPECT_EQ(cached_with("salt-1"), 0);
  EXPECT_EQ(cached_with("salt-1"), 16);
  EXPECT_EQ(cached_with("salt-2"), 0);
  std::string salt_err;  // the server's refusal names the flag, as for every other field
  EXPECT_EQ(run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "5", "--cache-salt",
                       std::string(300, 'a')},
                      &out, &salt_err),
            1);
  EXPECT_NE(salt_err.find("INVALID_ARGUMENT: --cache-salt has 300 bytes"), std::string::npos)
      << salt_err;
  EXPECT_EQ(nlohmann::json::parse(seeded[0])["ids"], nlohmann::json::parse(seeded[1])["ids"]);
  EXPECT_EQ(nlohmann::json::parse(seeded[0])["seed"], 18446744073709551615ull);
  EXPECT_EQ(run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "5", "--seed", "-1"}),
            2);
  // A request id that is not UTF-8 cannot go in the proto string: refused here, by its flag.
  std::string bad_id_err;
  EXPECT_EQ(run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "5", "--request-id",
                       "ab\xff"},
                      &out, &bad_id_err),
            2);
  EXPECT_NE(bad_id_err.find("--request-id is not valid UTF-8 (bad byte at offset 2)"),
            std::string::npos)
      << bad_id_err;
  EXPECT_EQ(bad_id_err.find("libprotobuf"), std::string::npos) << bad_id_err;
  // Unseeded and streamed: the drawn seed is reported on stderr, and sent back gives the text.
  std::string err, again;
  const std::vector<std::string> sample = {"client",       "generate",         "--addr",
                                           addr,           "--prompt-ids",     "5,6,7",
                                           "--ignore-eos", "--max-new-tokens", "8"};
  ASSERT_EQ(run_cemlm(sample, &out, &err), 0) << err;
  unsigned long long seed = 0;
  ASSERT_EQ(std::sscanf(err.c_str(), "seed %llu (--seed", &seed), 1) << err;
  std::vector<std::string> with_seed = sample;
  with_seed.insert(with_seed.end(), {"--seed", std::to_string(seed)});
  ASSERT_EQ(run_cemlm(with_seed, &again), 0);
  EXPECT_EQ(again, out);
  // A negative deadline is refused (it ran with none).
  ASSERT_EQ(
      run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "5", "--timeout", "-1"},
                &out, &err),
      2);
  EXPECT_NE(err.find("--timeout -1 must be a number of seconds >= 0"), std::string::npos) << err;
  EXPECT_EQ(run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "5", "--no-bos"}), 2);
  // An empty --prompt starts from the model's BOS alone, as `cemlm generate` does (it was
  // refused: the server reads an empty prompt_text as none).
  std::string local;
  const std::vector<std::string> from_bos = {"--prompt",      "",  "--max-new-tokens", "4",
                                             "--temperature", "0", "--ignore-eos",     "--json"};
  for (auto* into : {&out, &local}) {
    std::vector<std::string> args =
        into == &out ? std::vector<std::string>{"client", "generate", "--addr", addr}
                     : std::vector<std::string>{"generate", "--model", model_};
    args.insert(args.end(), from_bos.begin(), from_bos.end());
    ASSERT_EQ(run_cemlm(args, into, &err), 0) << err;
  }
  EXPECT_EQ(nlohmann::json::parse(out)["ids"], nlohmann::json::parse(local)["ids"]) << out << local;
  EXPECT_EQ(nlohmann::json::parse(out)["ids"].size(), 4u);
  EXPECT_EQ(
      run_cemlm({"client", "generate", "--addr", addr, "--prompt", "", "--no-bos"}, &out, &err), 2);
  EXPECT_NE(err.find("nothing to generate from"), std::string::npos) << err;
  EXPECT_EQ(run_cemlm({"client", "score", "--addr", addr, "--ids", "5,6", "--no-bos"}), 2);
  // --logit-bias and --min-new-tokens reach the server: a +100 bias makes every greedy token its
  // id; a malformed bias is refused here, an out-of-range one by the server.
  ASSERT_EQ(run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "5,6,7",
                       "--max-new-tokens", "4", "--min-new-tokens", "4", "--temperature", "0",
                       "--logit-bias", "9:100,11:-5", "--json"},
                      &out),
            0);
  EXPECT_EQ(nlohmann::json::parse(out)["ids"], nlohmann::json::array({9, 9, 9, 9})) << out;
  EXPECT_EQ(
      run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "5", "--logit-bias", "9=1"}),
      2);
  // The server's errors name request fields; the client says them as its flags.
  EXPECT_EQ(run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "5", "--logit-bias",
                       "9:101"},
                      &out, &err),
            1);
  EXPECT_NE(err.find("error: INVALID_ARGUMENT: --logit-bias"), std::string::npos) << err;
  EXPECT_EQ(run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "5",
                       "--max-new-tokens", "2", "--min-new-tokens", "3"},
                      &out, &err),
            1);
  EXPECT_NE(err.find("--min-new-tokens must be in [0, --max-new-tokens = 2] (got 3)"),
            std::string::npos)
      << err;
  EXPECT_EQ(run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "5,999"}, &out, &err),
            1);
  EXPECT_NE(err.find("--prompt-ids[1] = 999 is not a token id"), std::string::npos) << err;
  // No model has a negative id or depth: refused here, before a call, as `cemlm generate` does.
  for (const auto& [args, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"generate", "--prompt-ids", "5,-1"}, "--prompt-ids[1] = -1 is not a token id"},
           {{"generate", "--prompt-ids", "5", "--stop-token-ids", "-2"},
            "--stop-token-ids[0] = -2 is not a token id"},
           {{"generate", "--prompt-ids", "5", "--recursion", "-1"},
            "--recursion = -1 must be >= 0"},
           {{"score", "--ids", "5,6", "--recursion", "-1"}, "--recursion = -1 must be >= 0"},
           {{"score", "--ids", "5,-6"}, "--ids[1] = -6 is not a token id"},
           {{"detokenize", "--ids", "-5"}, "--ids[0] = -5 is not a token id"}}) {
    std::vector<std::string> cmd = {"client", args[0], "--addr", addr};
    cmd.insert(cmd.end(), args.begin() + 1, args.end());
    EXPECT_EQ(run_cemlm(cmd, &out, &err), 2) << says;
    EXPECT_NE(err.find(says), std::string::npos) << err;
  }
  EXPECT_EQ(run_cemlm({"client", "score", "--addr", addr, "--ids", "5,6", "--recursion", "99"},
                      &out, &err),
            1);
  EXPECT_NE(err.find("--recursion = 99"), std::string::npos) << err;
  // The text and ids fields are --text and --ids here (as the message's subject only: "token ids"
  // elsewhere in it stays).
  EXPECT_EQ(run_cemlm({"client", "tokenize", "--addr", addr, "--text", "ab\xc3"}, &out, &err), 1);
  EXPECT_NE(err.find("error: INVALID_ARGUMENT: --text is not valid UTF-8"), std::string::npos)
      << err;
  EXPECT_EQ(run_cemlm({"client", "detokenize", "--addr", addr, "--ids", "5,999"}, &out, &err), 1);
  EXPECT_NE(err.find("error: INVALID_ARGUMENT: --ids"), std::string::npos) << err;
  // Logprobs print only in --json: asked for without it, they are refused, not dropped.
  for (const char* flag : {"--logprobs", "--top-logprobs"}) {
    std::vector<std::string> args = {"client",       "generate", "--addr", addr,
                                     "--prompt-ids", "5",        flag};
    if (std::string(flag) == "--top-logprobs") args.push_back("2");
    ASSERT_EQ(run_cemlm(args, &out, &err), 2) << flag;
    EXPECT_NE(err.find(std::string(flag) + " needs --json"), std::string::npos) << err;
  }
  // A second bias for one id is refused here (the request's map would keep one of them).
  ASSERT_EQ(run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "5", "--logit-bias",
                       "9:1,9:2"},
                      &out, &err),
            2);
  EXPECT_NE(err.find("--logit-bias gives token 9 more than once"), std::string::npos) << err;
  // --stop-token-ids ends generation at the forced token; the penalties reach the server, which
  // names each when it is out of range.
  ASSERT_EQ(run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "5,6,7",
                       "--max-new-tokens", "4", "--temperature", "0", "--logit-bias", "9:100",
                       "--stop-token-ids", "3,9", "--json"},
                      &out),
            0);
  EXPECT_EQ(nlohmann::json::parse(out)["ids"], nlohmann::json::array({9})) << out;
  EXPECT_EQ(nlohmann::json::parse(out)["finish_reason"], "stop") << out;
  EXPECT_EQ(run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "5",
                       "--stop-token-ids", "3,x"}),
            2);
  for (const std::string flag :
       {"--repetition-penalty", "--presence-penalty", "--frequency-penalty"}) {
    ASSERT_EQ(run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "5", flag, "1000"},
                        &out, &err),
              1)
        << flag;
    EXPECT_NE(err.find("INVALID_ARGUMENT: " + flag + " must be in"), std::string::npos) << err;
    EXPECT_EQ(out, "") << flag << ": a call that failed before any text printed an empty line";
    ASSERT_EQ(run_cemlm({"client", "generate", "--addr", addr, "--prompt-ids", "5,6,7",
                         "--max-new-tokens", "2", flag, "1.5", "--json"},
                        &out, &err),
              0)
        << err;
  }

  ASSERT_EQ(run_cemlm({"client", "info", "--addr", addr}, &out), 0);
  EXPECT_EQ(nlohmann::json::parse(out)["vocab_size"], 400);
  ASSERT_EQ(run_cemlm({"client", "health", "--addr", addr}, &out), 0);
  EXPECT_EQ(out, "SERVING\n");
  ASSERT_EQ(run_cemlm({"client", "tokenize", "--addr", addr, "--text", "Hello"}, &out), 0);
  std::string ids = out.substr(0, out.size() - 1);
  ASSERT_EQ(run_cemlm({"client", "detokenize", "--addr", addr, "--ids", ids}, &out), 0);
  EXPECT_EQ(out, "Hello\n");
  // Text with a NUL (id 4 is the <0x00> byte piece) comes out whole.
  ASSERT_EQ(run_cemlm({"client", "detokenize", "--addr", addr, "--ids", ids + ",4," + ids}, &out), 0);
  EXPECT_EQ(out, std::string("Hello\0Hello\n", 12));
  EXPECT_EQ(run_cemlm({"client", "score", "--addr", addr, "--ids", "5"}, &out), 1);

  ASSERT_EQ(run_cemlm({"bench-serve", "--addr", addr, "--concurrency", "4", "--requests", "8",
                       "--max-new-tokens", "4", "--prompt-len", "8", "--recursion", "2"},
                      &out),
            0);
  for (const char* row : {"ttft", "inter-token", "e2e (client)", "e2e (engine)", "server overhead",
                          "to 1st token", "connections 1", "ok 8  errors 0", "output tokens/s"})
    EXPECT_NE(out.find(row), std::string::npos) << row << " missing from\n" << out;
  // Streams share the connections asked for.
  ASSERT_EQ(run_cemlm({"bench-serve", "--addr", addr, "--concurrency", "4", "--requests", "6",
                       "--max-new-tokens", "3", "--connections", "2"},
                      &out),
            0);
  EXPECT_NE(out.find("concurrency 4  connections 2"), std::string::npos) << out;
  EXPECT_NE(out.find("ok 6  errors 0"), std::string::npos) << out;
  // More streams than requests: each request once (a --concurrency near INT_MAX wrapped the
  // request counter, and requests went out without end).
  ASSERT_EQ(run_cemlm({"bench-serve", "--addr", addr, "--concurrency", "2147483647", "--requests",
                       "1", "--max-new-tokens", "2"},
                      &out),
            0);
  EXPECT_NE(out.find("ok 1  errors 0"), std::string::npos) << out;
  EXPECT_EQ(run_cemlm({"bench-serve", "--addr", addr, "--connections", "0"}, &out), 2);
  EXPECT_EQ(run_cemlm({"bench-serve", "--addr", addr, "--max-new-tokens", "0"}, &out), 2);
  EXPECT_EQ(run_cemlm({"bench-serve", "--addr", addr, "--prompt-len", "2000000"}, &out), 2);
  // A depth the model does not run is refused before any request is sent (each was an error;
  // failed requests counted by code: bench_serve_test.cc).
  EXPECT_EQ(run_cemlm({"bench-serve", "--addr", addr, "--concurrency", "3", "--requests", "7",
                       "--max-new-tokens", "4", "--recursion", "99"},
                      &out, &err),
            2);
  EXPECT_NE(err.find("--recursion 99 is outside [0, 8]"), std::string::npos) << err;
}

// A client whose server stops answering mid-call (stopped, its host lost) finds out from its
// keepalive pings: UNAVAILABLE within about --keepalive seconds. Without them it waited for its
// deadline, forever by default. (A generation of ~40 s on this model, the server stopped once it
// runs.)
TEST(ClientKeepalive, AServerThatStopsAnsweringFailsTheCall) {
  const std::string dir = fresh_temp_dir();
  std::ofstream(dir + "/config.json") << R"({"architecture": "cemlm", "format_version": 1,
    "vocab_size": 400, "d_model": 256, "n_layers": 8, "n_heads": 2, "head_dim": 16, "d_ff": 1024,
    "max_seq_len": 4096, "embedding": {"type": "table"}, "attention": {"type": "cem",
    "diag": "shared"}, "mlp": {"type": "cem"}, "recursion": {"default": 1, "max": 8}})";
  ASSERT_EQ(run_cemlm({"init", "--config", dir + "/config.json", "--out", dir + "/model"}), 0);
  auto server =
      ServerProcess::start(dir + "/model", {"--threads", "1", "--kv-cache-memory", "64M"});
  ASSERT_TRUE(server);
  CemlmRun client({"client", "generate", "--addr", server->addr(), "--prompt-ids", "5,6,7",
                   "--max-new-tokens", "4000", "--recursion", "8", "--ignore-eos", "--json",
                   "--keepalive", "1", "--timeout", "120"});
  ASSERT_GT(client.pid(), 0);
  ASSERT_TRUE(wait_for_metrics(
      *server, [](const auto& m) { return metric(m, "cemlm:num_requests_running") == 1; }));
  server->signal(SIGSTOP);
  std::string out, err;
  const int rc = client.wait(&out, &err);
  server->signal(SIGCONT);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(err.find("UNAVAILABLE"), std::string::npos) << err;
  EXPECT_NE(err.find("the server stopped answering"), std::string::npos) << err;
}

TEST_F(ServerLifecycle, PythonExampleClient) {
  if (std::system("/usr/bin/python3 -c 'import grpc, google.protobuf' 2>/dev/null") != 0)
    GTEST_SKIP() << "python3-grpcio / python3-protobuf are not installed";
  const std::string cmd = "/usr/bin/python3 " + std::string(std::getenv("CEMLM_SOURCE_DIR")) +
                          "/examples/python_client.py --addr " + server_->addr() +
                          " --max-new-tokens 5 --recursion 2 > /dev/null";
  auto stub_dirs = [] {
    int n = 0;
    for (const auto& e : std::filesystem::directory_iterator(std::filesystem::temp_directory_path()))
      n += e.path().filename().string().starts_with("cemlm_stubs_");
    return n;
  };
  const int dirs_before = stub_dirs();
  EXPECT_EQ(std::system(cmd.c_str()), 0);
  // A failing call ends the script with the status, not a traceback.
  const std::string err = fresh_temp_dir() + "/err.txt";
  EXPECT_NE(std::system((cmd + " --recursion 99 2>'" + err + "'").c_str()), 0);
  std::ifstream in(err);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("INVALID_ARGUMENT: recursion_depth = 99"), std::string::npos) << text;
  EXPECT_EQ(text.find("Traceback"), std::string::npos) << text;
  // So do a --tls-ca that cannot be read and a key gRPC cannot send, read from CEMLM_API_KEY as
  // the other clients read it (it was ignored).
  auto fails_with = [&](const std::string& run, const std::string& says) {
    EXPECT_NE(std::system((run + " 2>'" + err + "'").c_str()), 0) << run;
    std::ifstream e(err);
    const std::string t((std::istreambuf_iterator<char>(e)), std::istreambuf_iterator<char>());
    EXPECT_NE(t.find(says), std::string::npos) << t;
    EXPECT_EQ(t.find("Traceback"), std::string::npos) << t;
  };
  fails_with(cmd + " --tls-ca /nonexistent/ca.pem", "--tls-ca: cannot read '/nonexistent/ca.pem'");
  fails_with("CEMLM_API_KEY=\"$(printf 'key\\r')\" " + cmd,
             "CEMLM_API_KEY holds a character other than printable ASCII");
  // A prompt that is not UTF-8 goes as the bytes given, and the server names the bad one (it was
  // a UnicodeEncodeError in the script).
  fails_with(cmd + " --prompt \"$(printf 'caf\\351')\"",
             "INVALID_ARGUMENT: prompt_text is not valid UTF-8 (bad byte at offset 3)");
  EXPECT_EQ(stub_dirs(), dirs_before) << "the generated stubs were left in the temp directory";
}

}  // namespace
}  // namespace cemlm::testing_server
