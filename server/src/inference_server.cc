// Builds and runs the gRPC server (see inference_server.h): listening port and credentials,
// the health status through the lifecycle, and the two-step shutdown.
#include "cemlm/server/inference_server.h"

#include <grpc/grpc.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/auth_metadata_processor.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <grpcpp/server_builder.h>

#include <algorithm>
#include <climits>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "health_service.h"
#include "inference_service.h"

namespace cemlm::server {
namespace {

constexpr int kMaxStreamsPerConnection = 1000;      // a client opens more connections for more
constexpr int kMaxConnectionIdleMs = 10 * 60 * 1000;  // clients reconnect when they call again
constexpr int kHandshakeTimeoutMs = 10 * 1000;
// gRPC's default, set here so that it is a choice: no valid request comes near it (a prompt holds
// at most the model's max_seq_len tokens). gRPC refuses a larger body itself, RESOURCE_EXHAUSTED,
// before any interceptor or handler sees the call.
constexpr int kMaxRequestBytes = 4 << 20;
// Client keepalive pings on a connection whose calls have nothing to send yet (a queued request, a
// Score waiting for cache room, a long prefill): gRPC's default allows one per 5 minutes, and
// after a few faster ones closes the connection (GOAWAY too_many_pings), failing its calls with
// UNAVAILABLE "Too many pings". A ping a second costs nothing; gRPC-Go and Java clients ping
// every 10 s at most.
constexpr int kMinClientPingIntervalMs = 1000;
// A call's headers past gRPC's 8 KB default (a large bearer token, tracing baggage) fail not only
// that call: gRPC 1.51's HTTP/2 parser fails its whole connection, and every stream on it ends
// RESOURCE_EXHAUSTED (fixed in gRPC 1.53.2). 64 KB leaves room for any header a client means.
constexpr int kMaxMetadataBytes = 64 << 10;

// Runs ServerState::check_at_headers on each call's headers, in gRPC's auth filter: a call it
// refuses ends there, its body unread.
class KeyCheckAtHeaders final : public grpc::AuthMetadataProcessor {
 public:
  explicit KeyCheckAtHeaders(ServerState* state) : state_(state) {}
  bool IsBlocking() const override { return false; }  // a lookup: no thread of its own
  grpc::Status Process(const InputMetadata& metadata, grpc::AuthContext*, OutputMetadata*,
                       OutputMetadata*) override {
    return state_->check_at_headers(metadata);
  }

 private:
  ServerState* const state_;
};

std::shared_ptr<grpc::ServerCredentials> credentials(const ServerOptions& opts,
                                                     ServerState* state) {
  if (opts.tls_cert_pem.empty()) return grpc::InsecureServerCredentials();
  std::shared_ptr<grpc::ServerCredentials> creds;
  if (opts.tls_reload_interval_s > 0) {
    // gRPC's file watcher: no client certificate asked for, as with the static pair below.
    grpc::experimental::TlsServerCredentialsOptions tls(
        std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
            opts.tls_key_path, opts.tls_cert_path, opts.tls_reload_interval_s));
    tls.watch_identity_key_cert_pairs();
    tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    creds = grpc::experimental::TlsServerCredentials(tls);
  } else {
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({opts.tls_key_pem, opts.tls_cert_pem});
    creds = grpc::SslServerCredentials(ssl);
  }
  // Only under TLS: gRPC runs no auth filter on a plaintext port (the service checks keys there).
  if (opts.api_keys.enabled())
    creds->SetAuthMetadataProcessor(std::make_shared<KeyCheckAtHeaders>(state));
  return creds;
}

}  // namespace

absl::StatusOr<std::unique_ptr<InferenceServer>> InferenceServer::start(const ServerOptions& opts,
                                                                        ServerMetrics* metrics) {
  if (opts.tls_cert_pem.empty() != opts.tls_key_pem.empty())
    return absl::InvalidArgumentError("--tls-cert and --tls-key must be given together");
  std::unique_ptr<InferenceServer> s(new InferenceServer());
  s->state_ = std::make_unique<ServerState>(
      opts.api_keys, opts.model_name, metrics, opts.max_unread_streams,
      std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(opts.unread_timeout_s)),
      opts.max_priority, opts.text_slots, opts.max_queued_texts, opts.prefix_cache_per_key);
  s->service_ = std::make_unique<InferenceService>(s->state_.get());
  // The service's own name too (load balancers and meshes ask for it). NOT_SERVING from the
  // start: gRPC's default health service starts SERVING, before any model is loaded.
  s->health_ = std::make_unique<HealthService>(
      std::vector<std::string>{std::string(v1::Inference::service_full_name())});

  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string address = host_port(opts.host, opts.port);
  builder.AddListeningPort(address, credentials(opts, s->state_.get()), &s->port_);
  // gRPC sets SO_REUSEPORT by default: a second server on a port in use would start and take a
  // share of the first one's connections. A busy port is an error instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // gRPC's defaults leave a connection's streams unbounded, idle connections open for good and
  // a TLS handshake 120 s to finish: each an easy way for a client to hold server memory.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxStreamsPerConnection);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, kMaxConnectionIdleMs);
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, kHandshakeTimeoutMs);
  builder.SetMaxReceiveMessageSize(kMaxRequestBytes);
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, kMaxMetadataBytes);
  // The builder keeps a reference to the quota's core object: this one can go out of scope.
  grpc::ResourceQuota quota("cemlm-grpc");
  if (opts.grpc_memory_bytes > 0) {
    quota.Resize(size_t(opts.grpc_memory_bytes));
    builder.SetResourceQuota(quota);
  }
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             kMinClientPingIntervalMs);
  // On a connection without calls too: a client keeping its channel warm between calls (Go's
  // PermitWithoutStream, Java's keepAliveWithoutCalls) was cut off after a few pings, as gRPC
  // allows those only every 2 hours. The server then pings such connections as well; idle ones
  // still close after kMaxConnectionIdleMs.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  auto ms = [](double s) { return int(std::min(s * 1e3, double(INT_MAX))); };
  if (opts.keepalive_time_s > 0) {
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, ms(opts.keepalive_time_s));
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms(opts.keepalive_timeout_s));
    // gRPC stops pinging after two pings with no data sent between them, which is the state of
    // a stream whose client has stopped reading: the one that most needs the check.
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  }
  if (opts.max_connection_age_s > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, ms(opts.max_connection_age_s));
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                               ms(opts.max_connection_age_grace_s));
  }
  builder.RegisterService(s->service_.get());
  builder.RegisterService(s->health_.get());
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(malformed_body_interceptors(s->state_.get()));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  s->server_ = builder.BuildAndStart();
  if (!s->server_ || s->port_ == 0)
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", address, " (--host/--port: in use or not an address here?",
        opts.tls_cert_pem.empty()
            ? ")"
            : "; or --tls-cert and --tls-key are not a valid certificate chain and its private "
              "key: gRPC's log line above says which)"));
  return s;
}

std::string host_port(const std::string& host, int port) {
  const bool ipv6 = host.find(':') != std::string::npos && host.front() != '[';
  return ipv6 ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
}

InferenceServer::~InferenceServer() { shutdown(); }

void InferenceServer::set_engine(Engine* engine) {
  state_->set_engine(engine);
  health_->set_serving(true);
}

void InferenceServer::reload_api_keys(ApiKeys keys) { state_->reload_keys(std::move(keys)); }

namespace {

// How long calls the engine has ended get to write their last messages (to slow readers too).
constexpr auto kLastWrites = std::chrono::seconds(2);

}  // namespace

bool InferenceServer::drain(Clock::duration timeout) {
  health_->shut_down();  // NOT_SERVING for good (to the Watch streams open now)
  // GOAWAY at once, as Go's GracefulStop: a client's next call goes to a new connection, which a
  // load balancer sends elsewhere (refused here). Only refusing them kept every client on its
  // connection to this server failing UNAVAILABLE for the whole drain (a Kubernetes Service's
  // clients: all of a rollout's). gRPC core's shutdown, begun here, sends it and stops listening;
  // the C++ server's Shutdown, on its own thread as it blocks, then waits for every call and
  // connection, until shutdown() cancels what is left.
  if (!shutdown_cq_ && !stopped_) {
    shutdown_cq_ = grpc_completion_queue_create_for_pluck(nullptr);
    grpc_server_shutdown_and_notify(server_->c_server(), shutdown_cq_, &shutdown_cq_);
    try {
      goaway_ = std::async(std::launch::async, [this] { server_->Shutdown(); });
    } catch (const std::system_error&) {
      // No thread to spare: shutdown() runs the C++ Shutdown itself, with the same grace.
    }
  }
  return state_->drain(timeout);
}

void InferenceServer::shutdown() {
  if (stopped_ || !server_) return;
  stopped_ = true;
  // Calls the engine has ended are writing their last messages: give them a moment. gRPC's
  // Shutdown then waits until its deadline for clients to close their connections, which an
  // idle client keeping its channel never does, so once no call of ours is left it only waits
  // long enough for the last unary responses to go out.
  const bool idle = state_->drain(kLastWrites);
  state_->stop_calls();
  health_->end_watches();
  const auto grace = idle ? std::chrono::milliseconds(100) : std::chrono::milliseconds(0);
  if (shutdown_cq_) {
    // Connections idle or silent (a client keeping its channel, a reflection stream, a host gone)
    // would hold the drain's Shutdown for good: cut, as gRPC's deadline does. Legal from any
    // thread once core's shutdown has begun, which drain() made sure of.
    if (goaway_.valid()) {
      if (goaway_.wait_for(grace) != std::future_status::ready)
        grpc_server_cancel_all_calls(server_->c_server());
      goaway_.get();
    } else {
      server_->Shutdown(std::chrono::system_clock::now() + grace);  // cancels past the grace
    }
    // Core posted drain()'s tag when its shutdown completed.
    grpc_completion_queue_pluck(shutdown_cq_, &shutdown_cq_, gpr_inf_future(GPR_CLOCK_REALTIME),
                                nullptr);
    grpc_completion_queue_shutdown(shutdown_cq_);
    grpc_completion_queue_destroy(shutdown_cq_);
    shutdown_cq_ = nullptr;
  } else {
    server_->Shutdown(std::chrono::system_clock::now() + grace);
  }
  server_->Wait();
}

}  // namespace cemlm::server
