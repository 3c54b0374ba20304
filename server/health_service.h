// HealthService: grpc.health.v1.Health for refitd (Check and Watch).
//
// refitd's own implementation rather than gRPC's built-in one so that
// shutdown is prompt: Shutdown() sends NOT_SERVING to every watcher and then
// ends their streams, instead of leaving them open until the server's
// shutdown deadline. Services: "" (liveness, SERVING while the process runs),
// "refit.v1.RefitService" (readiness: every model group loaded) and
// "refit.v1.RefitService/NAME" (one group's readiness), set by RefitServer. Check of an
// unknown service is NOT_FOUND; Watch of one reports SERVICE_UNKNOWN and
// stays open, as the protocol says.
//
// Thread-safe. Must outlive the grpc::Server it is registered with.
#ifndef REFIT_SERVER_HEALTH_SERVICE_H_
#define REFIT_SERVER_HEALTH_SERVICE_H_

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace refit::server {

class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

  HealthService();
  ~HealthService() override;

  void SetServing(const std::string& service, bool serving);
  // A closed gate makes `service` NOT_SERVING whatever SetServing says; the
  // fleet closes it while this member is behind the fleet's version
  // (server/fleet_member.h). Gates are open until closed.
  void SetGate(const std::string& service, bool open);
  // Everything NOT_SERVING, watchers told and their streams ended; later
  // updates are ignored.
  void Shutdown();

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* context,
                                  const grpc::health::v1::HealthCheckRequest* request,
                                  grpc::health::v1::HealthCheckResponse* response) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* context,
      const grpc::health::v1::HealthCheckRequest* request) override;

  class Watcher;

 private:
  friend class Watcher;
  void Unsubscribe(Watcher* watcher);
  void Update(const std::string& service, std::optional<bool> serving,
              std::optional<bool> gate_open);

  absl::Mutex mu_;
  std::map<std::string, ServingStatus> statuses_ ABSL_GUARDED_BY(mu_);  // what is reported
  std::map<std::string, bool> requested_ ABSL_GUARDED_BY(mu_);          // by SetServing
  std::set<std::string> closed_gates_ ABSL_GUARDED_BY(mu_);
  std::vector<Watcher*> watchers_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace refit::server

#endif  // REFIT_SERVER_HEALTH_SERVICE_H_
