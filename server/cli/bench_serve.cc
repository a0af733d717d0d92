// `cemlm bench-serve`: closed-loop load against `cemlm serve` — N concurrent clients, each sending
// its next request when the previous one ends — and a table of TTFT, inter-token latency,
// end-to-end latency, the engine's share of it (server overhead = client e2e - engine e2e),
// throughput and errors.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include <grpcpp/support/client_callback.h>

#include "cemlm/cli/commands.h"
#include "cemlm/server/status_map.h"
#include "cemlm/v1/inference.grpc.pb.h"
#include "channel.h"

namespace cemlm::cli {
namespace {

using SteadyClock = std::chrono::steady_clock;

constexpr int kMaxConnections = 64;
// Prompt tokens per request at most: each request in flight holds its prompt (4 bytes a token).
constexpr int kMaxPromptLen = 1 << 20;

struct BenchFlags {
  int concurrency = 1, requests = 16, recursion = 0, max_new_tokens = 64, prompt_len = 32;
  int connections = 1;  // TCP connections the streams share
  uint64_t seed = 0;
};

// Milliseconds of everything measured, all requests together.
struct Samples {
  std::vector<double> ttft, itl, e2e, engine_e2e, overhead, first_overhead;
  int64_t tokens = 0;
  std::map<std::string, int> errors;                // by gRPC code name
  std::map<std::string, std::string> first_error;  // code name -> its first message
  void merge(const Samples& o) {
    for (auto [dst, src] : {std::pair{&ttft, &o.ttft},
                            {&itl, &o.itl},
                            {&e2e, &o.e2e},
                            {&engine_e2e, &o.engine_e2e},
                            {&overhead, &o.overhead},
                            {&first_overhead, &o.first_overhead}})
      dst->insert(dst->end(), src->begin(), src->end());
    tokens += o.tokens;
    for (const auto& [code, n] : o.errors) errors[code] += n;
    for (const auto& [code, message] : o.first_error) first_error.try_emplace(code, message);
  }
};

double ms_since(SteadyClock::time_point t) {
  return std::chrono::duration<double, std::milli>(SteadyClock::now() - t).count();
}

v1::GenerateRequest make_request(const BenchFlags& f, int vocab, int index) {
  std::mt19937_64 rng(f.seed * 1000003u + uint64_t(index));
  // Ids from 4 up skip the usual special tokens (unk, bos, eos, pad).
  std::uniform_int_distribution<int> token(std::min(4, vocab - 1), vocab - 1);
  v1::GenerateRequest req;
  for (int i = 0; i < f.prompt_len; ++i) req.add_prompt_ids(token(rng));
  req.set_recursion_depth(f.recursion);
  req.set_request_id("bench-" + std::to_string(index));
  v1::SamplingParams* s = req.mutable_sampling();
  s->set_max_new_tokens(f.max_new_tokens);
  s->set_ignore_eos(true);  // every request generates the same number of tokens
  s->set_seed(uint64_t(index));
  return req;
}

// The closed loop without a thread per client: each stream is a reactor read on gRPC's own
// threads, and the stream that ends starts the next request. (Blocking reads from one thread per
// client would add a thread wake-up per message to every measured latency.)
class Driver {
 public:
  Driver(std::vector<std::unique_ptr<v1::Inference::Stub>>& stubs, const ChannelFlags& c,
         const BenchFlags& f, int vocab)
      : stubs_(stubs), c_(c), f_(f), vocab_(vocab) {}

  Samples run() {
    // At most one stream per request: a --concurrency near INT_MAX wrapped next_ past it, and
    // the loop sent requests without end.
    for (int w = 0; w < std::min(f_.concurrency, f_.requests); ++w) start_next();
    std::unique_lock lock(mu_);
    idle_.wait(lock, [&] { return active_ == 0; });
    return std::move(all_);
  }

 private:
  class Stream final : public grpc::ClientReadReactor<v1::GenerateResponse> {
   public:
    Stream(Driver* d, v1::Inference::Stub& stub, v1::GenerateRequest req)
        : d_(d), req_(std::move(req)) {
      prepare_context(d_->c_, &context_);
      start_ = SteadyClock::now();
      stub.async()->Generate(&context_, &req_, this);
      StartRead(&msg_);
      StartCall();
    }
    void OnReadDone(bool ok) override {
      if (!ok) return;  // OnDone follows with the status
      if (msg_.token_ids_size() > 0) {
        const double now = ms_since(start_);
        const int n = msg_.token_ids_size();
        if (last_ < 0) mine_.ttft.push_back(now);
        else mine_.itl.insert(mine_.itl.end(), size_t(n), (now - last_) / n);
        last_ = now;
        mine_.tokens += n;
      }
      if (msg_.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {  // the answer is complete
        e2e_ = ms_since(start_);
        engine_e2e_ = msg_.timing().e2e_seconds() * 1e3;
        engine_ttft_ = msg_.timing().first_token_seconds() * 1e3;
      }
      StartRead(&msg_);
    }
    void OnDone(const grpc::Status& status) override {
      if (status.ok()) {
        mine_.e2e.push_back(e2e_);
        mine_.engine_e2e.push_back(engine_e2e_);
        mine_.overhead.push_back(e2e_ - engine_e2e_);
        if (!mine_.ttft.empty()) mine_.first_overhead.push_back(mine_.ttft.back() - engine_ttft_);
      } else {
        // A failed stream's partial timings and tokens are not those of an answer: the
        // percentiles and token rate are over the requests that completed ("ok").
        mine_.ttft.clear();
        mine_.itl.clear();
        mine_.tokens = 0;
        const std::string code = server::grpc_code_name(status.error_code());
        ++mine_.errors[code];
        mine_.first_error.try_emplace(code, status.error_message());
      }
      Driver* d = d_;
      Samples mine = std::move(mine_);
      delete this;
      d->finished(mine);
    }

   private:
    Driver* const d_;
    const v1::GenerateRequest req_;
    grpc::ClientContext context_;
    v1::GenerateResponse msg_;
    SteadyClock::time_point start_;
    double last_ = -1, e2e_ = 0, engine_e2e_ = 0, engine_ttft_ = 0;
    Samples mine_;
  };

  // Starts request `next_` if any is left; false when all have been started.
  bool start_next() {
    const int64_t i = next_++;
    if (i >= f_.requests) return false;
    {
      std::lock_guard lock(mu_);
      ++active_;
    }
    new Stream(this, *stubs_[size_t(i) % stubs_.size()], make_request(f_, vocab_, int(i)));
    return true;
  }

  void finished(const Samples& s) {
    start_next();
    std::lock_guard lock(mu_);
    all_.merge(s);
    if (--active_ == 0) idle_.notify_all();
  }

  std::vector<std::unique_ptr<v1::Inference::Stub>>& stubs_;  // requests round-robin
  const ChannelFlags& c_;
  const BenchFlags& f_;
  const int vocab_;
  std::atomic<int64_t> next_{0};  // one past each finished stream's: never near its limit
  std::mutex mu_;
  std::condition_variable idle_;
  int active_ = 0;  // streams started and not yet finished
  Samples all_;
};

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t rank = size_t(std::ceil(p / 100.0 * double(v.size())));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

void print_row(const char* name, const std::vector<double>& v) {
  double mean = 0;
  for (double x : v) mean += x;
  mean = v.empty() ? 0 : mean / double(v.size());
  std::printf("%-20s %10.3f %10.3f %10.3f %10.3f %8zu\n", name, percentile(v, 50),
              percentile(v, 90), percentile(v, 99), mean, v.size());
}

// `default_T`: the model's recursion.default (GetModelInfo), which --recursion 0 asks for.
void print_report(const BenchFlags& f, const std::string& addr, int connections, int default_T,
                  const Samples& s, double wall_s) {
  const std::string T = f.recursion > 0 ? std::to_string(f.recursion)
                                        : std::to_string(default_T) + " (the model's default)";
  std::printf(
      "cemlm bench-serve  addr %s  concurrency %d  connections %d  requests %d  T %s  prompt %d  "
      "new tokens %d\nclient machine: %u cores\n\n",
      addr.c_str(), std::min(f.concurrency, f.requests), connections, f.requests, T.c_str(),
      f.prompt_len, f.max_new_tokens, std::thread::hardware_concurrency());
  std::printf("%-20s %10s %10s %10s %10s %8s\n", "latency (ms)", "p50", "p90", "p99", "mean", "n");
  print_row("ttft", s.ttft);
  print_row("inter-token", s.itl);
  print_row("e2e (client)", s.e2e);
  print_row("e2e (engine)", s.engine_e2e);
  print_row("server overhead", s.overhead);
  print_row("  to 1st token", s.first_overhead);
  int errors = 0;
  for (const auto& [code, n] : s.errors) errors += n;
  std::printf("\nok %zu  errors %d", s.e2e.size(), errors);
  for (const auto& [code, n] : s.errors) std::printf("  %s=%d", code.c_str(), n);
  for (const auto& [code, message] : s.first_error)
    std::printf("\n  %s, first: %s", code.c_str(), message.c_str());
  std::printf("\nwall %.3f s  output tokens/s %.1f  requests/s %.2f\n", wall_s,
              double(s.tokens) / wall_s, double(s.e2e.size()) / wall_s);
}

}  // namespace

int cmd_bench_serve(int argc, char** argv) {
  ChannelFlags c;
  BenchFlags f;
  Flags flags(
      "cemlm bench-serve --addr HOST:PORT --concurrency N --requests M [--recursion T] "
      "[--max-new-tokens N] [--prompt-len N]",
      "Closed-loop load on a running `cemlm serve`: N clients, M requests in all, random\n"
      "prompts, every request generating --max-new-tokens (EOS ignored). Prints TTFT,\n"
      "inter-token and end-to-end latency (p50/p90/p99), the server overhead (client e2e\n"
      "minus engine e2e), tokens/s and errors.");
  add_channel_flags(&flags, &c);
  flags.add("concurrency", &f.concurrency, "requests in flight at once");
  flags.add("requests", &f.requests, "requests in all");
  flags.add("recursion", &f.recursion, "recursion depth T; 0 = the model's default");
  flags.add("max-new-tokens", &f.max_new_tokens, "tokens generated per request");
  flags.add("prompt-len", &f.prompt_len, "prompt tokens per request");
  flags.add("seed", &f.seed, "seed of the random prompts");
  flags.add("connections", &f.connections,
            "TCP connections the streams share round-robin (1 to " +
                std::to_string(kMaxConnections) +
                "); each adds its own reads and writes on both sides");
  if (int rc = flags.parse(argc, argv); rc >= 0) return rc;
  if (f.concurrency < 1 || f.requests < 1 || f.max_new_tokens < 1 || f.prompt_len < 1 ||
      f.prompt_len > kMaxPromptLen || f.connections < 1 || f.connections > kMaxConnections) {
    std::fprintf(stderr,
                 "error: --concurrency, --requests and --max-new-tokens must be >= 1, "
                 "--prompt-len in [1, %d], --connections in [1, %d]\n",
                 kMaxPromptLen, kMaxConnections);
    return 2;
  }
  const int n_conn = f.connections;
  std::vector<std::unique_ptr<v1::Inference::Stub>> stubs;
  for (int i = 0; i < n_conn; ++i) {
    auto channel = make_channel(c, /*own_connection=*/true);
    if (!channel) return 2;
    stubs.push_back(v1::Inference::NewStub(channel));
  }
  v1::ModelInfo info;
  for (auto& stub : stubs) {  // also opens every connection before the clock starts
    grpc::ClientContext context;
    prepare_context(c, &context);
    if (auto st = stub->GetModelInfo(&context, {}, &info); !st.ok()) return report_error(st);
  }
  // Every request would be refused, each an error in the report rather than a measurement.
  if (int64_t(f.prompt_len) + f.max_new_tokens > info.max_context()) {
    std::fprintf(stderr,
                 "error: --prompt-len %d + --max-new-tokens %d exceeds the model's context of %d "
                 "tokens (GetModelInfo.max_context); lower them\n",
                 f.prompt_len, f.max_new_tokens, info.max_context());
    return 2;
  }
  const auto start = SteadyClock::now();
  const Samples all = Driver(stubs, c, f, info.vocab_size()).run();
  print_report(f, c.addr, n_conn, info.default_recursion_depth(), all, ms_since(start) / 1e3);
  return all.errors.empty() ? 0 : 1;
}

}  // namespace cemlm::cli
