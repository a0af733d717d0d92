// The health service (see health_service.h). Every Watcher's state is guarded by the service's
// mutex, and the reactor operations are started under it: gRPC runs a write reactor's reactions
// (OnWriteDone, OnCancel, OnDone) on its own threads, never inline, so none can wait on the lock
// its caller holds; OnDone takes the lock before the Watcher leaves the set and is deleted.
#include "health_service.h"

namespace cemlm::server {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// One Watch stream: the status when it starts, then each change (a change during a write is
// sent when it completes, the latest only). It ends when its client cancels, or when the server
// stops (UNAVAILABLE, after the latest status).
class HealthService::Watcher final : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  // Under the service's lock.
  Watcher(HealthService* service, bool known) : service_(service), known_(known) {
    service_->watchers_.insert(this);
    update();
    if (service_->watches_ended_) end();
  }

  // Under the service's lock: sends the status now, unless a write is under way (its
  // OnWriteDone sends it then) or it was sent last.
  void update() {
    if (writing_ || finished_) return;
    const Status now = known_ ? service_->status_ : HealthCheckResponse::SERVICE_UNKNOWN;
    if (sent_any_ && now == sent_) return;
    response_.set_status(now);
    sent_ = now;
    sent_any_ = writing_ = true;
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard lock(service_->mu_);
    writing_ = false;
    if (!ok || cancelled_) return finish();  // the client is gone, or going
    update();
    if (!writing_ && ending_) finish();  // the latest status is out: the stopping server's end
  }

  void OnCancel() override {
    std::lock_guard lock(service_->mu_);
    cancelled_ = true;
    if (!writing_) finish();  // else once the write completes
  }

  // Under the service's lock: the server stops. The stream ends once the latest status is out (a
  // change met a write under way: NOT_SERVING was lost behind SERVING's write).
  void end() {
    ending_ = true;
    update();
    if (!writing_) finish();
  }

  void OnDone() override {
    {
      std::lock_guard lock(service_->mu_);
      service_->watchers_.erase(this);
    }
    delete this;
  }

 private:
  void finish() {
    if (finished_) return;
    finished_ = true;
    Finish(ending_ && !cancelled_
               ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down")
               : grpc::Status::CANCELLED);
  }

  HealthService* const service_;
  const bool known_;
  HealthCheckResponse response_;
  Status sent_ = HealthCheckResponse::UNKNOWN;
  bool sent_any_ = false, writing_ = false, cancelled_ = false, ending_ = false, finished_ = false;
};

HealthService::HealthService(std::vector<std::string> services)
    : services_(services.begin(), services.end()) {}

void HealthService::set_serving(bool serving) {
  set_status(serving ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING, false);
}

void HealthService::shut_down() { set_status(HealthCheckResponse::NOT_SERVING, true); }

void HealthService::end_watches() {
  std::lock_guard lock(mu_);
  watches_ended_ = true;
  for (Watcher* w : watchers_) w->end();
}

void HealthService::set_status(Status status, bool final) {
  std::lock_guard lock(mu_);
  if (shut_down_) return;
  shut_down_ = final;
  status_ = status;
  for (Watcher* w : watchers_) w->update();
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* context,
                                               const HealthCheckRequest* request,
                                               HealthCheckResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (!request->service().empty() && !services_.contains(request->service())) {
    reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service"));
    return reactor;
  }
  {
    std::lock_guard lock(mu_);
    response->set_status(status_);
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthService::Watch(
    grpc::CallbackServerContext*, const HealthCheckRequest* request) {
  std::lock_guard lock(mu_);
  return new Watcher(this, request->service().empty() || services_.contains(request->service()));
}

}  // namespace cemlm::server
