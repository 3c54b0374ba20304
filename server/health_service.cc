#include "server/health_service.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/reactor_util.h"
#include "server/server_options.h"

namespace refit::server {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

class HealthService::Watcher final : public QueuedWriteReactor<HealthCheckResponse> {
 public:
  Watcher(HealthService* service, std::string name) : service_(service), name_(std::move(name)) {}
  const std::string& name() const { return name_; }

  void Send(ServingStatus status) {
    HealthCheckResponse response;
    response.set_status(status);
    Enqueue(std::move(response));
  }

  void OnCancel() override {
    FinishNow(grpc::Status(grpc::StatusCode::CANCELLED, "health Watch cancelled"));
  }

  void set_subscribed(bool subscribed) { subscribed_ = subscribed; }

 private:
  void OnFinished() override {
    if (subscribed_) service_->Unsubscribe(this);
  }

  HealthService* service_;
  std::string name_;
  bool subscribed_ = false;
};

HealthService::HealthService() {
  absl::MutexLock lock(&mu_);
  statuses_[""] = HealthCheckResponse::SERVING;
}

HealthService::~HealthService() = default;

void HealthService::SetServing(const std::string& service, bool serving) {
  Update(service, serving, std::nullopt);
}

void HealthService::SetGate(const std::string& service, bool open) {
  Update(service, std::nullopt, open);
}

void HealthService::Update(const std::string& service, std::optional<bool> serving,
                           std::optional<bool> gate_open) {
  std::vector<Watcher*> targets;
  ServingStatus status;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    if (serving.has_value()) requested_[service] = *serving;
    if (gate_open.has_value()) {
      if (*gate_open) {
        closed_gates_.erase(service);
      } else {
        closed_gates_.insert(service);
      }
    }
    auto requested = requested_.find(service);
    const bool effective =
        requested != requested_.end() && requested->second && closed_gates_.count(service) == 0;
    status = effective ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
    auto it = statuses_.find(service);
    if (it != statuses_.end() && it->second == status) return;
    statuses_[service] = status;
    for (Watcher* w : watchers_) {
      if (w->name() == service) {
        w->Ref();
        targets.push_back(w);
      }
    }
  }
  for (Watcher* w : targets) {
    w->Send(status);
    w->Unref();
  }
}

void HealthService::Shutdown() {
  std::vector<Watcher*> targets;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    for (auto& [name, status] : statuses_) status = HealthCheckResponse::NOT_SERVING;
    for (Watcher* w : watchers_) {
      w->Ref();
      targets.push_back(w);
    }
  }
  for (Watcher* w : targets) {
    w->Send(HealthCheckResponse::NOT_SERVING);
    w->FinishWhenDrained(grpc::Status(grpc::StatusCode::UNAVAILABLE, "refitd is shutting down"));
    w->Unref();
  }
}

void HealthService::Unsubscribe(Watcher* watcher) {
  absl::MutexLock lock(&mu_);
  for (auto it = watchers_.begin(); it != watchers_.end(); ++it) {
    if (*it == watcher) {
      watchers_.erase(it);
      return;
    }
  }
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* context,
                                               const HealthCheckRequest* request,
                                               HealthCheckResponse* response) {
  grpc::Status status;
  {
    absl::MutexLock lock(&mu_);
    auto it = statuses_.find(request->service());
    if (it == statuses_.end()) {
      status = grpc::Status(grpc::StatusCode::NOT_FOUND,
                            absl::StrCat("unknown service \"", request->service(), "\""));
    } else {
      response->set_status(it->second);
    }
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthService::Watch(
    grpc::CallbackServerContext* context, const HealthCheckRequest* request) {
  auto* watcher = new Watcher(this, request->service());
  ServingStatus current = HealthCheckResponse::SERVICE_UNKNOWN;
  bool closed = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = statuses_.find(request->service());
    if (it != statuses_.end()) current = it->second;
    closed = shut_down_;
    if (!closed) {
      watchers_.push_back(watcher);
      watcher->set_subscribed(true);
      // Queued under the lock so that a concurrent SetServing, which sends
      // after taking its own reference under this lock, comes after it.
      watcher->Send(current);
    }
  }
  if (closed) {
    watcher->Send(HealthCheckResponse::NOT_SERVING);
    watcher->FinishWhenDrained(
        grpc::Status(grpc::StatusCode::UNAVAILABLE, "refitd is shutting down"));
  }
  return watcher;
}

}  // namespace refit::server
