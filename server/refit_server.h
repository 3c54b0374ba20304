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
//   LoadInitialModel  loads the first version of every model group, the
//                  default group first (--model demo: the fixture model
//                  written to a temp dir; else the checkpoint dir; with
//                  --state-dir the newest snapshot), turning each group's
//                  readiness ("refit.v1.RefitService/NAME") SERVING as it
//                  is loaded and the daemon's ("refit.v1.RefitService") once
//                  all are.
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
#include "server/grpc_listeners.h"
#include "server/health_service.h"
#include "server/metrics.h"
#include "server/model_group.h"
#include "server/refit_service.h"
#include "server/reflection_service.h"
#include "server/region_service.h"
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

  // Loads version 1 of every group and sets readiness SERVING.
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
  // nullptr for a group the daemon does not serve.
  ModelGroup* group(const std::string& name) const;
  grpc::Server* grpc_server() const { return server_.get(); }
  // For the fleet membership (server/fleet_member.h), set up by main.
  RefitServiceImpl* service() const { return service_.get(); }
  HealthService* health() const { return health_.get(); }
  Metrics* metrics() { return &metrics_; }
  // The checkpoint files of the first load (for --model demo, in a temp dir
  // that lives as long as the server).
  const std::vector<std::string>& model_files() const;

 private:
  explicit RefitServer(ServerOptions options);
  absl::Status Init();
  // Every group of EffectiveGroups(options_): INVALID_ARGUMENT for a bad or
  // repeated name, and BuildGroup's errors prefixed with the group.
  absl::Status BuildModel();
  absl::Status BuildGroup(const GroupOptions& group);
  // Recovers or loads the first version of `group`.
  absl::Status LoadGroup(ModelGroup* group);
  // Where `group` keeps its snapshots: --state-dir for the default group (as
  // a single-group daemon), --state-dir/groups/NAME for the others.
  std::string StateDirOf(const std::string& group) const;
  absl::Status StartGrpc();
  // --state-dir: restores the newest verified snapshot into `group` (true)
  // or leaves it empty (false), then starts the snapshot writer.
  absl::StatusOr<bool> RecoverState(ModelGroup* group);
  // Begin + ingest of model_files_ + Commit, registered in `group` so that
  // Shutdown aborts it (ABORTED).
  absl::StatusOr<core::RefitResult> LoadFirstVersion(ModelGroup* group,
                                                     const std::vector<std::string>& files,
                                                     const core::RefitOptions& options);

  ServerOptions options_;
  std::string default_group_name_ = kDefaultGroup;
  std::map<std::string, std::unique_ptr<ModelGroup>> groups_;
  // Per group, declared after groups_ so that the snapshot writers go
  // first.
  struct GroupFiles {
    GroupOptions options;
    std::string demo_dir;            // --model demo: removed once loaded, or in the destructor
    std::vector<std::string> files;  // the checkpoint of the first load
    // --state-dir: snapshots the group's commits.
    std::unique_ptr<core::SnapshotWriter> snapshot_writer;
    int metrics_listener = -1;  // the store listener counting outcomes
  };
  std::map<std::string, GroupFiles> group_files_;
  std::unique_ptr<Authenticator> auth_;
  Metrics metrics_;
  std::unique_ptr<RefitServiceImpl> service_;
  // Engine attach; destroyed before service_ (it uses it) and the groups.
  std::unique_ptr<AttachService> attach_;
  // Trainers' shared-memory regions; destroyed after attach_ (whose
  // descriptor socket deposits into it) and service_ (Push reads them).
  std::unique_ptr<RegionService> regions_;
  std::unique_ptr<HealthService> health_;
  std::unique_ptr<ReflectionService> reflection_;
  std::unique_ptr<grpc::Server> server_;
  // The --listen sockets; stopped before server_ shuts down.
  std::unique_ptr<GrpcListeners> listeners_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  std::vector<std::string> bound_addresses_;

  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace refit::server

#endif  // REFIT_SERVER_REFIT_SERVER_H_
