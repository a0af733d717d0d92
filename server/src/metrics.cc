// Server metrics (see metrics.h). Bucket edges reach down to 50 µs because a CPU engine with a
// small model decodes in 0.2 ms per step (the default model's inter-token latency: with 0.5 ms as
// the first edge, 93% of it fell there and its quantiles were guesses within that bucket), and up
// to about 20 minutes because a long generation at a high T on a CPU takes minutes (past the last
// edge, quantiles read as that edge).
#include "cemlm/server/metrics.h"

#include "cemlm/kernels/parallel.h"
#include "cemlm/server/status_map.h"

namespace cemlm::server {
namespace {

using prometheus::Histogram;

const Histogram::BucketBoundaries kLatencyBuckets = {
    0.00005, 0.0001, 0.00015, 0.0002, 0.0003, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025,   0.05,   0.075,   0.1,    0.15,   0.25,   0.5,   0.75,   1.0,   2.5,
    5.0,     7.5,    10.0,    20.0,   40.0,   80.0,   160.0, 320.0,  640.0, 1280.0};
// One bucket per T up to 8 (the usual recursion.max: each T its own bar on the dashboard), then
// coarser up to the largest recursion.max a config may set.
const Histogram::BucketBoundaries kRecursionBuckets = {1, 2,  3,  4,  5,  6,  7,
                                                       8, 12, 16, 24, 32, 48, 64};

}  // namespace

ServerMetrics::ServerMetrics(const std::string& model_name, int max_waiting)
    : model_name_(model_name), registry_(std::make_shared<prometheus::Registry>()) {
  const prometheus::Labels labels = {{"model_name", model_name_}};
  auto gauge = [&](const char* name, const char* help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(*registry_).Add(labels);
  };
  auto counter = [&](const char* name, const char* help) {
    return &prometheus::BuildCounter().Name(name).Help(help).Register(*registry_).Add(labels);
  };
  auto histogram = [&](const char* name, const char* help, const Histogram::BucketBoundaries& b) {
    return &prometheus::BuildHistogram().Name(name).Help(help).Register(*registry_).Add(labels, b);
  };
  running_ = gauge("cemlm:num_requests_running", "Requests decoding in the engine.");
  waiting_ =
      gauge("cemlm:num_requests_waiting",
            "Requests queued in the engine, Score calls waiting for KV cache room included.");
  scoring_ = gauge("cemlm:num_score_calls_running",
                   "Score calls holding their KV cache blocks: their texts prefilling chunk by "
                   "chunk (or waiting for a chunk's turn). Not in num_requests_running.");
  gauge("cemlm:max_num_requests_waiting",
        "The bound on waiting requests (--max-waiting): past it, submissions fail "
        "RESOURCE_EXHAUSTED.")
      ->Set(max_waiting);
  kv_usage_ = gauge("cemlm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).");
  kv_capacity_ = gauge("cemlm:kv_cache_capacity_tokens",
                       "Tokens the KV cache holds at once (its blocks x block size); 0 until the "
                       "model is loaded.");
  cache_config_ = &prometheus::BuildGauge()
                       .Name("cemlm:cache_config_info")
                       .Help(
                           "The KV cache as served: device, kv_cache_dtype (fp32, bf16, int8) and "
                           "kv_bytes_per_token as labels; value 1, once the model is loaded.")
                       .Register(*registry_);
  tls_end_ = &prometheus::BuildGauge()
                  .Name("cemlm:tls_certificate_expiry_timestamp_seconds")
                  .Help(
                      "End of validity (notAfter, Unix seconds) of the TLS certificate that new "
                      "connections get; 0 while the TLS files cannot serve or it is not valid yet; "
                      "absent without TLS.")
                  .Register(*registry_);
  unread_ = gauge("cemlm:num_unread_streams",
                  "Finished Generate streams whose clients have not read all of them (each holds "
                  "its output; at --max-running + --max-waiting new streams are refused).");
  unread_cancelled_ = counter(
      "cemlm:unread_streams_cancelled_total",
      "Finished Generate streams the server cancelled because their client had not read them "
      "for --unread-timeout; they are also counted in requests_total, as OK when the engine "
      "finished them normally.");
  preemptions_ =
      counter("cemlm:num_preemptions_total", "Requests and Score calls preempted by recompute.");
  compute_rests_ = counter(
      "cemlm:compute_thread_rests_total",
      "Times a CPU compute thread was left out of the engine's work for 2-64 ms because it held "
      "a step back or did not come to it (the scheduler kept it off its core: other work on the "
      "server's cores).");
  prompt_tokens_ =
      counter("cemlm:prompt_tokens_total",
              "Prompt tokens of Generate requests, counted at their first token (Score "
              "texts count in score_tokens_total).");
  generation_tokens_ = counter("cemlm:generation_tokens_total",
                               "Tokens the engine generated, counted as each is made (those of "
                               "streams cancelled or never read included).");
  prefix_hit_tokens_ = counter("cemlm:prefix_cache_hit_tokens_total",
                               "Prompt tokens whose KV entries came from the prefix cache, counted "
                               "at their request's first token as prompt_tokens_total is.");
  ttft_ = histogram("cemlm:time_to_first_token_seconds",
                    "Request arrival to its first token, in seconds.", kLatencyBuckets);
  itl_ = histogram("cemlm:inter_token_latency_seconds",
                   "Time between two generated tokens of a request, in seconds.", kLatencyBuckets);
  e2e_ = histogram("cemlm:e2e_request_latency_seconds",
                   "Generate request arrival to its last message, in seconds.", kLatencyBuckets);
  queue_ = histogram("cemlm:request_queue_time_seconds",
                     "Time a Generate request waited in the engine before it was first "
                     "scheduled (until it ended, if never), in seconds; observed at its first "
                     "token, or at its end if it had none.",
                     kLatencyBuckets);
  recursion_ =
      histogram("cemlm:recursion_depth",
                "Recursion depth T of each Generate request the engine ended, however it ended.",
                kRecursionBuckets);
  score_latency_ = histogram("cemlm:score_request_latency_seconds",
                             "Score call arrival to its response, in seconds, of the calls that "
                             "ended OK (failed ones count in requests_total only).",
                             kLatencyBuckets);
  score_tokens_ = counter("cemlm:score_tokens_total",
                          "Token ids of Score calls that ended OK (the first one, which has no "
                          "logprob, included).");
  score_recursion_ =
      histogram("cemlm:score_recursion_depth",
                "Recursion depth T of each Score call that ended OK.", kRecursionBuckets);
  success_ = &prometheus::BuildCounter()
                  .Name("cemlm:request_success_total")
                  .Help("Generations finished normally, by finish reason.")
                  .Register(*registry_);
  errors_ = &prometheus::BuildCounter()
                 .Name("cemlm:request_errors_total")
                 .Help("RPCs that ended with a status other than OK, by gRPC code name.")
                 .Register(*registry_);
  requests_ = &prometheus::BuildCounter()
                   .Name("cemlm:requests_total")
                   .Help("Finished RPCs of cemlm.v1.Inference, by method and gRPC code name.")
                   .Register(*registry_);
  // Every series a dashboard or alert divides by exists from the start at 0, so that a fresh
  // server's panels show 0 rather than "no data" and rates need no `or`.
  for (const char* reason : {"stop", "length"})
    success_->Add({{"model_name", model_name_}, {"finished_reason", reason}});
  for (int code = grpc::StatusCode::CANCELLED; code <= grpc::StatusCode::UNAUTHENTICATED; ++code)
    errors_->Add({{"model_name", model_name_}, {"code", grpc_code_name(grpc::StatusCode(code))}});
  // requests_total by every method and code too: a series born at its first error has no rate
  // there, so a panel of rates by method and code missed each pair's first error.
  for (const char* method : kMethods)
    for (int code = grpc::StatusCode::OK; code <= grpc::StatusCode::UNAUTHENTICATED; ++code)
      requests_->Add({{"model_name", model_name_},
                      {"method", method},
                      {"code", grpc_code_name(grpc::StatusCode(code))}});
}

void ServerMetrics::set_stats_source(std::function<EngineStats()> source) {
  std::lock_guard lock(stats_mu_);
  stats_source_ = std::move(source);
}

void ServerMetrics::set_model_info(const ModelInfo& info) {
  kv_capacity_->Set(double(info.kv_cache_capacity_tokens));
  cache_config_
      ->Add({{"model_name", model_name_},
             {"device", info.device},
             {"kv_cache_dtype", info.kv_cache_dtype},
             {"kv_bytes_per_token", std::to_string(info.kv_bytes_per_token)}})
      .Set(1);
}

void ServerMetrics::set_tls_certificate_end(double unix_seconds) {
  tls_end_->Add({{"model_name", model_name_}}).Set(unix_seconds);
}

void ServerMetrics::observe_first_token(double seconds, double queue_seconds, int prompt_tokens) {
  ttft_->Observe(seconds);
  queue_->Observe(queue_seconds);
  prompt_tokens_->Increment(prompt_tokens);
}
void ServerMetrics::observe_inter_token(double seconds) { itl_->Observe(seconds); }
void ServerMetrics::count_generated(int n) { generation_tokens_->Increment(n); }

void ServerMetrics::observe_finished(const FinishedGeneration& g) {
  if (g.success_reason)
    success_->Add({{"model_name", model_name_}, {"finished_reason", g.success_reason}}).Increment();
  e2e_->Observe(g.e2e);
  if (g.queue) queue_->Observe(*g.queue);
  recursion_->Observe(g.recursion_depth);
}

void ServerMetrics::observe_scored(double seconds, int tokens, int recursion_depth) {
  score_latency_->Observe(seconds);
  score_tokens_->Increment(tokens);
  score_recursion_->Observe(recursion_depth);
}

void ServerMetrics::count_rpc(const char* method, grpc::StatusCode code) {
  const std::string name = grpc_code_name(code);
  requests_->Add({{"model_name", model_name_}, {"method", method}, {"code", name}}).Increment();
  if (code != grpc::StatusCode::OK)
    errors_->Add({{"model_name", model_name_}, {"code", name}}).Increment();
}

void ServerMetrics::set_unread_streams(int n) { unread_->Set(n); }
void ServerMetrics::count_unread_cancelled() { unread_cancelled_->Increment(); }

void ServerMetrics::refresh_gauges() const {
  std::lock_guard lock(stats_mu_);
  const EngineStats s = stats_source_ ? stats_source_() : EngineStats{};
  running_->Set(s.running);
  waiting_->Set(s.waiting);
  scoring_->Set(s.scoring);
  kv_usage_->Set(s.kv_cache_usage);
  // The engine keeps a running total; a Prometheus counter only moves forward by increments.
  if (s.preemptions_total > preemptions_seen_) {
    preemptions_->Increment(double(s.preemptions_total - preemptions_seen_));
    preemptions_seen_ = s.preemptions_total;
  }
  if (s.prefix_cache_hits_total > prefix_hits_seen_) {
    prefix_hit_tokens_->Increment(double(s.prefix_cache_hits_total - prefix_hits_seen_));
    prefix_hits_seen_ = s.prefix_cache_hits_total;
  }
  if (const uint64_t rests = compute_thread_rests(); rests > compute_rests_seen_) {
    compute_rests_->Increment(double(rests - compute_rests_seen_));
    compute_rests_seen_ = rests;
  }
}

std::vector<prometheus::MetricFamily> ServerMetrics::Collect() const {
  refresh_gauges();
  return registry_->Collect();
}

}  // namespace cemlm::server
