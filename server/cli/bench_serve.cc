// `cemlm bench-serve`: closed-loop load against `cemlm serve` — N concurrent clients, each sending
// its next request when the previous one ends — and a table of TTFT, inter-token latency,
// end-to-end latency, the engine's share of it (server overhead = client e2e - engine e2e),
// throughput and errors. Ctrl-C ends the run with the report of what completed.
#include <grpcpp/support/client_callback.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "cemlm/cli/commands.h"
#include "cemlm/server/status_map.h"
#include "cemlm/v1/inference.grpc.pb.h"
#include "channel.h"
#include "generate_stream.h"
#include "latency_summary.h"

namespace cemlm::cli {
namespace {

using SteadyClock = std::chrono::steady_clock;

constexpr int kMaxConnections = 64;
// Streams `cemlm serve` runs at once on one connection (kMaxStreamsPerConnection there): more wait
// in the client's transport, their clocks running, and that wait was reported as server overhead.
constexpr int kStreamsPerConnection = 1000;

// Ctrl-C (SIGINT): stop sending, cancel the streams in flight, report what completed; a second
// one quits at once.
std::atomic<bool> g_interrupted{false};
static_assert(std::atomic<bool>::is_always_lock_free);
void on_interrupt(int) {
  g_interrupted = true;
  std::signal(SIGINT, SIG_DFL);
}
// Prompt tokens per request at most: each request in flight holds its prompt (4 bytes a token).
constexpr int kMaxPromptLen = 1 << 20;

struct BenchFlags {
  int concurrency = 1, requests = 16, recursion = 0, max_new_tokens = 64, prompt_len = 32;
  int connections = 1;  // TCP connections the streams share
  double stall = 120;   // seconds a stream may go without a message (0: forever)
  uint64_t seed = 0;    // of the prompts: the flag's, else drawn (and printed)
};

// Milliseconds of everything measured, all requests together.
struct Samples {
  LatencySummary ttft, itl, e2e, engine_e2e, overhead, first_overhead;
  int64_t tokens = 0;
  int64_t prompt_tokens = 0, cached_prompt_tokens = 0;  // of the requests that completed
  int64_t interrupted = 0;                              // streams Ctrl-C cancelled
  std::map<std::string, int> errors;                // by gRPC code name
  std::map<std::string, std::string> first_error;  // code name -> its first message
  void merge(const Samples& o) {
    for (auto [dst, src] : {std::pair{&ttft, &o.ttft},
                            {&itl, &o.itl},
                            {&e2e, &o.e2e},
                            {&engine_e2e, &o.engine_e2e},
                            {&overhead, &o.overhead},
                            {&first_overhead, &o.first_overhead}})
      dst->merge(*src);
    tokens += o.tokens;
    prompt_tokens += o.prompt_tokens;
    cached_prompt_tokens += o.cached_prompt_tokens;
    interrupted += o.interrupted;
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
  Driver(const std::vector<std::shared_ptr<grpc::Channel>>& channels, const ChannelFlags& c,
         const BenchFlags& f, int vocab)
      : channels_(channels), c_(c), f_(f), vocab_(vocab) {}

  Samples run() {
    begun_ = SteadyClock::now();
    heard_ms_ = 0;
    // At most one stream per request: a --concurrency near INT_MAX wrapped next_ past it, and
    // the loop sent requests without end.
    for (int w = 0; w < std::min(f_.concurrency, f_.requests); ++w) start_next();
    std::unique_lock lock(mu_);
    while (!idle_.wait_for(lock, std::chrono::milliseconds(50), [&] { return active_ == 0; })) {
      if (g_interrupted && !stopping_) {
        stopping_ = true;  // no stream starts another
        for (Stream* s : streams_) s->cancel();
      }
      // A server that stopped answering (stopped, its host lost) left the run waiting forever:
      // --stall-timeout without a message on any stream ends it, every stream in flight counted
      // STALLED. (Not one stream's silence: a request queued behind others, or in a long
      // prefill, is silent while the server answers the rest.)
      if (f_.stall > 0 && !stopping_ && ms_since(begun_) - heard_ms_ >= f_.stall * 1e3) {
        stopping_ = true;
        for (Stream* s : streams_) s->stall();
      }
    }
    return std::move(all_);
  }

 private:
  class Stream final : public grpc::ClientReadReactor<grpc::ByteBuffer> {
   public:
    Stream(Driver* d, v1::GenerateRequest req) : d_(d), req_(std::move(req)) {
      prepare_context(d_->c_, &context_);
    }
    void start(grpc::Channel& channel) {
      start_ = SteadyClock::now();
      generate_raw(channel, &context_, &req_, this);
      StartRead(&raw_);
      StartCall();
    }
    // Before start() too: the call is then cancelled as it starts.
    void cancel() { context_.TryCancel(); }
    void stall() {
      stalled_ = true;
      context_.TryCancel();
    }
    void OnReadDone(bool ok) override {
      if (!ok) return;  // OnDone follows with the status
      d_->heard_ms_ = ms_since(d_->begun_);
      if (!parse_response(raw_, &msg_)) {  // OnDone follows, once the call is cancelled
        unparsed_ = true;
        context_.TryCancel();
        return;
      }
      if (msg_.token_ids_size() > 0) {
        const double now = ms_since(start_);
        const int n = msg_.token_ids_size();
        if (last_ < 0)
          mine_.ttft.add(now);
        else
          mine_.itl.add((now - last_) / n, n);
        last_ = now;
        mine_.tokens += n;
      }
      if (msg_.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {  // the answer is complete
        e2e_ = ms_since(start_);
        engine_e2e_ = msg_.timing().e2e_seconds() * 1e3;
        engine_ttft_ = msg_.timing().first_token_seconds() * 1e3;
        mine_.prompt_tokens = msg_.usage().prompt_tokens();
        mine_.cached_prompt_tokens = msg_.usage().cached_prompt_tokens();
      }
      StartRead(&raw_);
    }
    void OnDone(const grpc::Status& done) override {
      const grpc::Status status = unparsed_ ? unparsed_status() : done;
      if (status.ok()) {
        mine_.e2e.add(e2e_);
        mine_.engine_e2e.add(engine_e2e_);
        mine_.overhead.add(e2e_ - engine_e2e_);
        if (mine_.ttft.count() > 0) mine_.first_overhead.add(mine_.ttft.max() - engine_ttft_);
      } else {
        // A failed stream's partial timings and tokens are not those of an answer: the
        // percentiles and token rate are over the requests that completed ("ok").
        mine_ = {};
        if (stalled_) {
          ++mine_.errors["STALLED"];
          char secs[32];
          std::snprintf(secs, sizeof secs, "%g", d_->f_.stall);
          mine_.first_error.try_emplace(
              "STALLED", std::string("no message on any stream for --stall-timeout ") + secs +
                             " s: the server stopped answering; the run was stopped");
        } else if (status.error_code() == grpc::StatusCode::CANCELLED && g_interrupted) {
          mine_.interrupted = 1;
        } else {
          const std::string code = server::grpc_code_name(status.error_code());
          ++mine_.errors[code];
          mine_.first_error.try_emplace(code, status.error_message());
        }
      }
      Driver* d = d_;
      Samples mine = std::move(mine_);
      d->finished(this, mine);
    }

   private:
    Driver* const d_;
    const v1::GenerateRequest req_;
    grpc::ClientContext context_;
    grpc::ByteBuffer raw_;
    v1::GenerateResponse msg_;
    bool unparsed_ = false;  // a message did not parse: the call was cancelled
    SteadyClock::time_point start_;
    std::atomic<bool> stalled_{false};  // cancelled by the watchdog (it ends the run)
    double last_ = -1, e2e_ = 0, engine_e2e_ = 0, engine_ttft_ = 0;
    Samples mine_;
  };

  // Starts request `next_` if any is left and no Ctrl-C came; false when none was started.
  bool start_next() {
    if (g_interrupted) return false;
    const int64_t i = next_++;
    if (i >= f_.requests) return false;
    auto* s = new Stream(this, make_request(f_, vocab_, int(i)));
    {
      std::lock_guard lock(mu_);
      if (stopping_) {
        delete s;
        return false;
      }
      ++active_;
      streams_.insert(s);  // run() may cancel it from here on
    }
    s->start(*channels_[size_t(i) % channels_.size()]);  // its reactions take mu_
    return true;
  }

  void finished(Stream* done, const Samples& s) {
    {
      std::lock_guard lock(mu_);
      streams_.erase(done);
    }
    delete done;
    start_next();
    std::lock_guard lock(mu_);
    all_.merge(s);
    if (--active_ == 0) idle_.notify_all();
  }

  const std::vector<std::shared_ptr<grpc::Channel>>& channels_;  // requests round-robin
  const ChannelFlags& c_;
  const BenchFlags& f_;
  const int vocab_;
  std::atomic<int64_t> next_{0};  // one past each finished stream's: never near its limit
  std::mutex mu_;
  std::condition_variable idle_;
  int active_ = 0;  // streams started and not yet finished
  bool stopping_ = false;  // Ctrl-C or a stall: what is in flight was cancelled
  SteadyClock::time_point begun_;
  std::atomic<double> heard_ms_{0};  // when a message last came, on any stream (ms after begun_)
  std::set<Stream*> streams_;  // in flight
  Samples all_;
};

void print_row(const char* name, const LatencySummary& v) {
  if (v.count() == 0)
    return (void)std::printf("%-20s %10s %10s %10s %10s %8d\n", name, "-", "-", "-", "-", 0);
  std::printf("%-20s %10.3f %10.3f %10.3f %10.3f %8lld\n", name, v.percentile(50), v.percentile(90),
              v.percentile(99), v.mean(), static_cast<long long>(v.count()));
}

// `default_T`: the model's recursion.default (GetModelInfo), which --recursion 0 asks for.
void print_report(const BenchFlags& f, const std::string& addr, int connections, int default_T,
                  const Samples& s, double wall_s) {
  const std::string T = f.recursion > 0 ? std::to_string(f.recursion)
                                        : std::to_string(default_T) + " (the model's default)";
  std::printf(
      "cemlm bench-serve  addr %s  concurrency %d  connections %d  requests %d  T %s  prompt %d  "
      "new tokens %d  seed %llu\nclient machine: %u cores\n\n",
      addr.c_str(), std::min(f.concurrency, f.requests), connections, f.requests, T.c_str(),
      f.prompt_len, f.max_new_tokens, static_cast<unsigned long long>(f.seed),
      std::thread::hardware_concurrency());
  std::printf("%-20s %10s %10s %10s %10s %8s\n", "latency (ms)", "p50", "p90", "p99", "mean", "n");
  print_row("ttft", s.ttft);
  print_row("inter-token", s.itl);
  print_row("e2e (client)", s.e2e);
  print_row("e2e (engine)", s.engine_e2e);
  print_row("server overhead", s.overhead);
  print_row("  to 1st token", s.first_overhead);
  int errors = 0;
  for (const auto& [code, n] : s.errors) errors += n;
  std::printf("\nok %lld  errors %d", static_cast<long long>(s.e2e.count()), errors);
  for (const auto& [code, n] : s.errors) std::printf("  %s=%d", code.c_str(), n);
  for (const auto& [code, message] : s.first_error)
    std::printf("\n  %s, first: %s", code.c_str(), in_flag_terms(message).c_str());
  // The server's prefix cache serves the prompts it has seen at this T: a run that repeats a seed
  // measures cached prefills.
  std::printf("\nprompt tokens %lld, of which served from the prefix cache %lld",
              static_cast<long long>(s.prompt_tokens),
              static_cast<long long>(s.cached_prompt_tokens));
  if (const int64_t unsent = f.requests - s.e2e.count() - errors - s.interrupted;
      unsent > 0 || g_interrupted) {
    std::printf("\nrun stopped: %lld requests never sent", static_cast<long long>(unsent));
    if (g_interrupted)
      std::printf(" (Ctrl-C; %lld streams cancelled)", static_cast<long long>(s.interrupted));
  }
  std::printf("\nwall %.3f s  output tokens/s %.1f  requests/s %.2f\n", wall_s,
              double(s.tokens) / wall_s, double(s.e2e.count()) / wall_s);
}

// The flag that is out of its range, said as an error (empty: none).
std::string out_of_range(const BenchFlags& f, bool connections_given) {
  auto at_least_1 = [](const char* flag, int v) {
    return v < 1 ? std::string("--") + flag + " " + std::to_string(v) + " must be >= 1" : "";
  };
  for (const auto& [flag, v] : {std::pair{"concurrency", f.concurrency},
                                {"requests", f.requests},
                                {"max-new-tokens", f.max_new_tokens},
                                {"prompt-len", f.prompt_len}})
    if (std::string e = at_least_1(flag, v); !e.empty()) return e;
  if (f.prompt_len > kMaxPromptLen)
    return "--prompt-len " + std::to_string(f.prompt_len) + " must be at most " +
           std::to_string(kMaxPromptLen);
  if (!(f.stall >= 0) || !std::isfinite(f.stall))
    return "--stall-timeout " + std::to_string(f.stall) + " must be seconds >= 0 (0 = forever)";
  if (f.connections < 1 || f.connections > kMaxConnections)
    return "--connections " + std::to_string(f.connections) + " must be in [1, " +
           std::to_string(kMaxConnections) + "]";
  if (const int64_t streams = std::min(f.concurrency, f.requests);
      streams > int64_t(kMaxConnections) * kStreamsPerConnection)
    return "--concurrency " + std::to_string(f.concurrency) + " is more streams than " +
           std::to_string(kMaxConnections) + " connections carry at once (" +
           std::to_string(kStreamsPerConnection) + " each, as cemlm serve allows); lower it";
  if (connections_given &&
      int64_t(std::min(f.concurrency, f.requests)) > int64_t(f.connections) * kStreamsPerConnection)
    return "--concurrency " + std::to_string(f.concurrency) +
           " is more streams than --connections " + std::to_string(f.connections) +
           " carry at once (" + std::to_string(kStreamsPerConnection) +
           " each, as cemlm serve allows: the rest would wait in the client, their wait counted "
           "as server overhead); raise --connections, or leave it out to have enough opened";
  return "";
}

}  // namespace

int cmd_bench_serve(int argc, char** argv) {
  ChannelFlags c;
  BenchFlags f;
  Flags flags(
      "cemlm bench-serve --addr HOST:PORT [--concurrency N] [--requests M] [--recursion T] "
      "[--max-new-tokens N] [--prompt-len N] [--seed S]",
      "Closed-loop load on a running `cemlm serve`: N clients, M requests in all, random\n"
      "prompts, every request generating --max-new-tokens (EOS ignored). Prints TTFT,\n"
      "inter-token and end-to-end latency (p50/p90/p99, to within 0.05%), the server overhead\n"
      "(client e2e minus engine e2e), tokens/s, errors, and the prompt tokens the server's\n"
      "prefix cache served. Ctrl-C stops the run and reports what completed (again: quit at "
      "once).");
  add_channel_flags(&flags, &c);
  flags.add("concurrency", &f.concurrency, "requests in flight at once");
  flags.add("requests", &f.requests, "requests in all");
  flags.add("recursion", &f.recursion, "recursion depth T; 0 = the model's default");
  flags.add("max-new-tokens", &f.max_new_tokens, "tokens generated per request");
  flags.add("prompt-len", &f.prompt_len, "prompt tokens per request");
  flags.add("seed", &f.seed,
            "seed of the random prompts (default: drawn, and printed; the same seed twice sends "
            "the same prompts, which the second time the server's prefix cache serves)");
  flags.add("stall-timeout", &f.stall,
            "seconds without a message on any stream that end the run, the streams in flight "
            "counted STALLED (a server stopped or its host lost kept the run waiting forever); "
            "more than the longest time to a first token; 0 = forever");
  flags.add("connections", &f.connections,
            "TCP connections the streams share round-robin (1 to " +
                std::to_string(kMaxConnections) + "; default: 1 per " +
                std::to_string(kStreamsPerConnection) +
                " streams, as many as cemlm serve runs on one); each adds its own reads and "
                "writes on both sides");
  if (int rc = flags.parse(argc, argv); rc >= 0) return rc;
  if (const std::string e = out_of_range(f, flags.given("connections")); !e.empty()) {
    std::fprintf(stderr, "error: %s\n", e.c_str());
    return 2;
  }
  if (!flags.given("connections"))
    f.connections =
        int(std::min<int64_t>(kMaxConnections, (int64_t(std::min(f.concurrency, f.requests)) +
                                                kStreamsPerConnection - 1) /
                                                   kStreamsPerConnection));
  if (!flags.given("seed")) f.seed = std::random_device{}();
  const int n_conn = f.connections;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < n_conn; ++i) {
    channels.push_back(make_channel(c, /*own_connection=*/true));
    if (!channels.back()) return 2;
  }
  v1::ModelInfo info;
  for (auto& channel : channels) {  // also opens every connection before the clock starts
    grpc::ClientContext context;
    prepare_context(c, &context);
    if (auto st = v1::Inference::NewStub(channel)->GetModelInfo(&context, {}, &info); !st.ok())
      return report_error(st);
  }
  // Every request would be refused, each an error in the report rather than a measurement.
  if (int64_t(f.prompt_len) + f.max_new_tokens > info.max_context()) {
    std::fprintf(stderr,
                 "error: --prompt-len %d + --max-new-tokens %d exceeds the model's context of %d "
                 "tokens (GetModelInfo.max_context); lower them\n",
                 f.prompt_len, f.max_new_tokens, info.max_context());
    return 2;
  }
  if (f.recursion < 0 || f.recursion > info.max_recursion_depth()) {
    std::fprintf(stderr,
                 "error: --recursion %d is outside [0, %d] (GetModelInfo.max_recursion_depth; 0 = "
                 "the model's default, %d)\n",
                 f.recursion, info.max_recursion_depth(), info.default_recursion_depth());
    return 2;
  }
  // Left ignored when the process started so (a background job of a script).
  if (struct sigaction was{}; ::sigaction(SIGINT, nullptr, &was) == 0 && was.sa_handler != SIG_IGN)
    std::signal(SIGINT, on_interrupt);
  const auto start = SteadyClock::now();
  const Samples all = Driver(channels, c, f, info.vocab_size()).run();
  print_report(f, c.addr, n_conn, info.default_recursion_depth(), all, ms_since(start) / 1e3);
  if (g_interrupted) return 130;
  return all.errors.empty() ? 0 : 1;
}

}  // namespace cemlm::cli
