// RefitServer: the whole daemon in one object, used by main.cc and by the
// in-process tests.
//
// Lifecycle:
//   Create         builds the model group (layout + zeroed ShardStore on the
//                  device), the gRPC server (RefitService, grpc.health.v1
//                  (server/health_service.h), reflection (server/reflection_service.h: the
//                  reader role, like the data it describes)) on every listen address, and the
//                  /metrics endpoint. Liveness ("") is SERVING, readiness
//                  ("refit.v1.RefitService") NOT_SERVING.
//   LoadInitialModel  loads the first version (--model demo: the fixture
//                  model written to a temp dir; else the checkpoint dir) and
//                  turns readiness SERVING.
//   Shutdown       readiness NOT_SERVING, new refits UNAVAILABLE, running and
//                  prepared refits aborted, Watch streams ended, gRPC stopped
//                  (in-flight RPCs cancelled after options.shutdown_timeout),
//                  metrics stopped. Idempotent; the destructor calls it.
//
// Thread-safe: Shutdown may be called from any thread (e.g. a signal waiter).
#ifndef REFIT_SERVER_REFIT_SERVER_H_
#define REFIT_SERVER_REFIT_SERVER_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/snapshot.h"
#include "server/attach_service.h"
#include "server/auth.h"
#include "server/health_service.h"
#include "server/metrics.h"
#include "server/model_group.h"
#include "server/refit_service.h"
#include "server/reflection_service.h"
#include "server/server_options.h"

namespace refit::server {

class RefitServer {
 public:
  // INVALID_ARGUMENT for bad options (device, quant, tp, addresses, TLS
  // files, tokens file), FAILED_PRECONDITION for a non-loopback listen
  // address without authentication and without allow_insecure_remote,
  // UNAVAILABLE if an address cannot be bound, and core's errors for the
  // model (config.json, layout, store).
  static absl::StatusOr<std::unique_ptr<RefitServer>> Create(ServerOptions options);
  // Create + LoadInitialModel.
  static absl::StatusOr<std::unique_ptr<RefitServer>> Start(ServerOptions options);
  ~RefitServer();
  RefitServer(const RefitServer&) = delete;
  RefitServer& operator=(const RefitServer&) = delete;

  // Loads version 1 of the default group and sets readiness SERVING.
  // ABORTED when Shutdown is called meanwhile (from another thread).
  absl::Status LoadInitialModel();
  void Shutdown();
  // Blocks until the gRPC server has stopped (after Shutdown).
  void Wait();

  const ServerOptions& options() const { return options_; }
  // The listen addresses with port 0 replaced by the bound port.
  const std::vector<std::string>& bound_addresses() const { return bound_addresses_; }
  // 0 when /metrics is off.
  int metrics_port() const;
  ModelGroup* default_group() const;
  grpc::Server* grpc_server() const { return server_.get(); }
  // For the fleet membership (server/fleet_member.h), set up by main.
  RefitServiceImpl* service() const { return service_.get(); }
  HealthService* health() const { return health_.get(); }
  Metrics* metrics() { return &metrics_; }
  // The checkpoint files of the first load (for --model demo, in a temp dir
  // that lives as long as the server).
  const std::vector<std::string>& model_files() const { return model_files_; }

 private:
  explicit RefitServer(ServerOptions options);
  absl::Status Init();
  absl::Status BuildModel();
  absl::Status StartGrpc();
  // --state-dir: restores the newest verified snapshot into `group` (true)
  // or leaves it empty (false), then starts the snapshot writer.
  absl::StatusOr<bool> RecoverState(ModelGroup* group);
  // Begin + ingest of model_files_ + Commit, registered in `group` so that
  // Shutdown aborts it (ABORTED).
  absl::StatusOr<core::RefitResult> LoadFirstVersion(ModelGroup* group,
                                                     const core::RefitOptions& options);

  ServerOptions options_;
  std::string demo_dir_;  // removed in the destructor
  std::vector<std::string> model_files_;
  std::map<std::string, std::unique_ptr<ModelGroup>> groups_;
  // --state-dir: snapshots the default group's commits; destroyed before
  // the groups.
  std::unique_ptr<core::SnapshotWriter> snapshot_writer_;
  std::unique_ptr<Authenticator> auth_;
  Metrics metrics_;
  std::unique_ptr<RefitServiceImpl> service_;
  // Engine attach; destroyed before service_ (it uses it) and the groups.
  std::unique_ptr<AttachService> attach_;
  std::unique_ptr<HealthService> health_;
  std::unique_ptr<ReflectionService> reflection_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  std::vector<std::string> bound_addresses_;

  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace refit::server

#endif  // REFIT_SERVER_REFIT_SERVER_H_
