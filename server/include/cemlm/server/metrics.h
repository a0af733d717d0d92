// Prometheus metrics of the server, with the names dashboards know (DESIGN.md): request counters
// and latency histograms recorded by the handlers, and engine gauges refreshed from
// Engine::stats() at every scrape. Every series carries the label model_name.
#pragma once
#include <grpcpp/support/status.h>
#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cemlm/engine/engine.h"

namespace cemlm::server {

// What one finished generation (whatever its end) contributes to the metrics (times in seconds).
struct FinishedGeneration {
  const char* success_reason = nullptr;  // "stop" | "length"; null when it did not end normally
  int recursion_depth = 0;
  double e2e = 0;
  // Submitted to first scheduled, for a generation that ended before its first token (those with
  // one were observed at it, by observe_first_token).
  std::optional<double> queue;
};

class ServerMetrics : public prometheus::Collectable {
 public:
  static constexpr const char* kMethods[] = {"Generate", "Score", "Tokenize", "Detokenize",
                                             "GetModelInfo"};

  // max_waiting: the engine's bound on waiting requests (--max-waiting), exported as
  // max_num_requests_waiting so that alerts can tell a full queue at any bound.
  ServerMetrics(const std::string& model_name, int max_waiting);

  // Where the gauges come from; unset (before the model is loaded) they read zero.
  void set_stats_source(std::function<EngineStats()> source);
  // The loaded model's KV cache: its capacity in tokens (kv_cache_capacity_tokens) and the
  // cache_config_info series (device, dtype, bytes per token as labels; value 1).
  void set_model_info(const ModelInfo& info);

  // Under TLS: the end of the certificate new connections get (Unix seconds), 0 while the TLS
  // files cannot serve or the certificate is not valid yet.
  void set_tls_certificate_end(double unix_seconds);

  // A generation's first tokens: its prompt is through prefill, after `queue_seconds` in the
  // engine's queue. Then `n` tokens of it streamed.
  void observe_first_token(double seconds, double queue_seconds, int prompt_tokens);
  void observe_inter_token(double seconds);
  void count_generated(int n);
  void observe_finished(const FinishedGeneration& g);
  // A Score call that ended OK for its client: arrival to response, its token ids, its T.
  void observe_scored(double seconds, int tokens, int recursion_depth);
  // Every finished RPC of cemlm.v1.Inference (method: one of kMethods), OK or not.
  void count_rpc(const char* method, grpc::StatusCode code);
  // Finished Generate streams whose clients have not read all of them (they hold their output).
  void set_unread_streams(int n);
  // One of those cancelled unread after --unread-timeout (at the bound or in a drain): its client
  // sees CANCELLED, but requests_total counted it already, as the engine finished it.
  void count_unread_cancelled();

  // Refreshes the engine gauges, then returns every family (called by the /metrics exposer).
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  void refresh_gauges() const;

  std::string model_name_;
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Gauge *running_, *waiting_, *scoring_, *kv_usage_, *kv_capacity_, *unread_;
  prometheus::Family<prometheus::Gauge>* cache_config_;
  prometheus::Family<prometheus::Gauge>* tls_end_;
  prometheus::Counter *preemptions_, *prompt_tokens_, *generation_tokens_, *prefix_hit_tokens_,
      *unread_cancelled_, *score_tokens_, *compute_rests_;
  prometheus::Histogram *ttft_, *itl_, *e2e_, *queue_, *recursion_, *score_latency_,
      *score_recursion_;
  prometheus::Family<prometheus::Counter>* success_;
  prometheus::Family<prometheus::Counter>* errors_;
  prometheus::Family<prometheus::Counter>* requests_;

  mutable std::mutex stats_mu_;  // guards the source and the engine totals' high-water marks
  std::function<EngineStats()> stats_source_;
  mutable int64_t preemptions_seen_ = 0, prefix_hits_seen_ = 0;
  mutable uint64_t compute_rests_seen_ = 0;
};

}  // namespace cemlm::server
