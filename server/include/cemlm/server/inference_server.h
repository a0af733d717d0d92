// The gRPC server of `cemlm serve`: cemlm.v1.Inference, grpc.health.v1.Health and reflection on
// one port, optional TLS and API keys, and the lifecycle around the engine — NOT_SERVING until
// the engine is ready, then SERVING, then draining on shutdown.
#pragma once
#include <grpc/grpc.h>
#include <grpcpp/server.h>

#include <cstdint>
#include <future>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cemlm/engine/engine.h"
#include "cemlm/server/auth.h"
#include "cemlm/server/metrics.h"

namespace cemlm::server {

class ServerState;
class InferenceService;
class HealthService;

// "host:port" for a listener, an IPv6 host in brackets ("[::]:9400").
std::string host_port(const std::string& host, int port);

struct ServerOptions {
  std::string host = "0.0.0.0";
  int port = 50051;  // 0: any free port (see InferenceServer::port)
  ApiKeys api_keys;
  std::string tls_cert_pem, tls_key_pem;  // both empty: plaintext
  // With tls_reload_interval_s > 0, gRPC reads these files again that often and gives new
  // connections the pair they hold (the PEMs above are then what the caller checked at start;
  // `cemlm serve` gives copies it makes of the files it checks, see server/cli/tls_files.h).
  std::string tls_cert_path, tls_key_path;
  unsigned tls_reload_interval_s = 0;
  std::string model_name = "cemlm";
  // GOAWAY to a connection this old (0: never); its calls in flight get the grace to finish.
  double max_connection_age_s = 0, max_connection_age_grace_s = 30;
  // A connection with calls under way is pinged after this long without a ping (0: never), and
  // closed, its calls cancelled, when a ping goes unanswered for keepalive_timeout_s: a client
  // whose host vanished without closing it (a silent network drop) stops holding the engine.
  double keepalive_time_s = 60, keepalive_timeout_s = 20;
  // Generate streams the engine has finished whose clients have not read all of them yet (they
  // hold their output); while that many wait, new streams are RESOURCE_EXHAUSTED (0: no bound).
  int max_unread_streams = 0;
  // When that many wait, those whose clients have not read them for this long are cancelled to
  // make room (their output undelivered), so that one client that stopped reading cannot keep
  // every other client's streams out.
  double unread_timeout_s = 10;
  // gRPC's resource quota: the memory its transport may hold for all connections together (read
  // buffers, request bodies still arriving). Over it gRPC closes idle connections and resets
  // streams (clients see RESOURCE_EXHAUSTED) until it is back under: without it, clients sending
  // request bodies slowly, with or without a valid key, hold up to 4 MiB a stream for as long as
  // they like. 0: no quota.
  int64_t grpc_memory_bytes = int64_t(256) << 20;
  // The highest request priority a call may ask for, unless its API key's line sets its own.
  int max_priority = INT32_MAX;
  // Texts that Tokenize, Detokenize and Score calls tokenize or decode at once (the others wait
  // for a slot); at least 1.
  int text_slots = 2;
  // Generate calls whose prompt_text waits for its turn to be tokenized, at most: more are
  // RESOURCE_EXHAUSTED (each holds its request; gRPC bounds only the streams per connection).
  // `cemlm serve` sets --max-waiting.
  int max_queued_texts = 1024;
  // Prefix-cache blocks are reused only between requests of the same API key (with keys on), so
  // that no tenant can learn from cached_prompt_tokens or time to first token what another's
  // prompts held; false shares them between all requests. Either way, requests share them only
  // with the same `cache_salt`.
  bool prefix_cache_per_key = true;
};

class InferenceServer {
 public:
  // Listens right away; every Inference call answers UNAVAILABLE until set_engine().
  static absl::StatusOr<std::unique_ptr<InferenceServer>> start(const ServerOptions& opts,
                                                                ServerMetrics* metrics);
  ~InferenceServer();

  int port() const { return port_; }
  // The engine is loaded and warmed: serve it, report SERVING. It must outlive shutdown().
  void set_engine(Engine* engine);
  // Serves the keys of a --api-key-file read again from now on (calls under way keep theirs);
  // each key it held before keeps its own prefix-cache blocks. Only for a server started with
  // keys: one started without installed no key check under TLS.
  void reload_api_keys(ApiKeys keys);
  // Reports NOT_SERVING, stops listening and sends every connection a GOAWAY (so that clients
  // take their new calls to another server; a call that reaches this one anyway is UNAVAILABLE),
  // and waits up to `timeout` for the calls in flight. True when all of them finished.
  bool drain(Clock::duration timeout);
  // Ends the calls still open (after the engine ended their requests) and stops listening.
  void shutdown();

 private:
  InferenceServer() = default;
  std::unique_ptr<ServerState> state_;
  std::unique_ptr<InferenceService> service_;
  std::unique_ptr<HealthService> health_;  // before server_: it outlives the server's calls
  std::unique_ptr<grpc::Server> server_;
  // drain() begins gRPC core's shutdown (GOAWAY; its completion is posted here) and the C++
  // server's Shutdown on a thread of its own, which holds until every call and connection has
  // ended: shutdown() cancels those left.
  grpc_completion_queue* shutdown_cq_ = nullptr;
  std::future<void> goaway_;
  int port_ = 0;
  bool stopped_ = false;
};

}  // namespace cemlm::server
