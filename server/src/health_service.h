// grpc.health.v1.Health of `cemlm serve`, on the callback API: Check and Watch for the whole
// server ("") and the names given, all with one status. Ours rather than gRPC's default service,
// which starts SERVING: it said so between the server's start and the first SetServingStatus,
// before any model was loaded. This one starts NOT_SERVING.
#pragma once
#include <grpcpp/support/server_callback.h>

#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"

namespace cemlm::server {

class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  using Status = grpc::health::v1::HealthCheckResponse::ServingStatus;

  // `services`: the names answered besides "" (others are NOT_FOUND to Check, SERVICE_UNKNOWN to
  // Watch, as the protocol says).
  // It must outlive the grpc::Server it is registered with (whose Wait() ends every Watch).
  explicit HealthService(std::vector<std::string> services);

  // SERVING or NOT_SERVING, for every name; Watch streams get the change. Ignored after
  // shut_down().
  void set_serving(bool serving);
  // NOT_SERVING for good (a draining server).
  void shut_down();
  // Ends every Watch stream (a stopping server), and those that start from now on at once.
  void end_watches();

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* context,
                                  const grpc::health::v1::HealthCheckRequest* request,
                                  grpc::health::v1::HealthCheckResponse* response) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* context,
      const grpc::health::v1::HealthCheckRequest* request) override;

 private:
  class Watcher;
  void set_status(Status status, bool final);

  const std::set<std::string> services_;
  std::mutex mu_;  // guards what follows and every Watcher's state
  Status status_ = grpc::health::v1::HealthCheckResponse::NOT_SERVING;
  bool shut_down_ = false, watches_ended_ = false;
  std::set<Watcher*> watchers_;
};

}  // namespace cemlm::server
