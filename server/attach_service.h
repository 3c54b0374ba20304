// AttachService: refit.v1.EngineService — inference engines on the daemon's
// host attach to a model group's arena (core/arena.h) and follow its commits.
//
// Pipeline position: beside RefitService, reading the same model groups. An
// Attach stream is an engine's lease: its first message (AttachRequest) is
// answered with the manifest (every kernel's name, dtype, shape, strides,
// region and offset; the version, fingerprint and layout identity) and a
// ticket for the descriptor socket (server/attach_fd_server.h); from then on
// the stream carries the group's commit events (server/engine_registry.h)
// and the engine's Quiesced acks. The lease ends when the stream ends, for
// whatever reason (the engine closes it, its process dies, shutdown).
//
// Only local callers: a call that did not come over a Unix socket is
// FAILED_PRECONDITION ("attach needs a local Unix socket"). Authorization is
// the reader rule (server/auth.h): reader or operator tokens.
//
// Lifecycle: created by RefitServer after the groups; StartFdSocket binds the
// descriptor socket; Shutdown ends every Attach stream (UNAVAILABLE) and
// stops the socket. Must outlive the grpc::Server; destroyed before the
// groups (its registries are their stores' coordinators).
//
// Thread-safety: thread-safe.
#ifndef REFIT_SERVER_ATTACH_SERVICE_H_
#define REFIT_SERVER_ATTACH_SERVICE_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "refit/v1/engine.grpc.pb.h"
#include "server/attach_fd_server.h"
#include "server/engine_registry.h"
#include "server/metrics.h"
#include "server/refit_service.h"

namespace refit::server {

// The layout identity of `layout` as the proto carries it.
v1::EngineLayout ToProtoLayout(const core::ModelLayout& layout);
// FAILED_PRECONDITION naming every field set in `expect` that differs from
// `actual` (engine's and daemon's values), or OK.
absl::Status CompareLayouts(const v1::EngineLayout& expect, const v1::EngineLayout& actual);
// Whether a gRPC peer string names a Unix-socket peer ("unix:...").
bool IsUnixPeer(absl::string_view peer);

class AttachService final : public v1::EngineService::CallbackService {
 public:
  // `refit` (groups, authorization) and `metrics` must outlive the service.
  // Each model group has at most `max_engines` engines attached at once.
  AttachService(RefitServiceImpl* refit, absl::Duration quiesce_timeout, Metrics* metrics,
                int max_engines);
  ~AttachService() override;
  // Longer engine names are INVALID_ARGUMENT at attach.
  static constexpr size_t kMaxEngineNameBytes = 256;
  AttachService(const AttachService&) = delete;
  AttachService& operator=(const AttachService&) = delete;

  // Binds the descriptor socket at `path` (AttachFdServer::Start's errors);
  // descriptors peers send go to `deposit` (trainers' regions).
  absl::Status StartFdSocket(std::string path, AttachFdServer::Deposit deposit = nullptr);
  const std::string& fd_socket() const { return fd_socket_; }

  grpc::ServerBidiReactor<v1::EngineMessage, v1::DaemonMessage>* Attach(
      grpc::CallbackServerContext* context) override;

  // Engines attached to `group`, for GetStatus and /metrics.
  std::vector<EngineInfo> Engines(absl::string_view group) const;
  // Adds them to a GetStatus response (GetStatusResponse.engines).
  void FillEngines(absl::string_view group, v1::GetStatusResponse* response) const;
  void Shutdown();

  // For the Attach reactor.
  RefitServiceImpl* refit() const { return refit_; }
  // The registry of `group`, created on first use. RefitServer creates one
  // for every group before it serves, so that every commit has its
  // coordinator: an engine attaching mid-commit is then always told.
  EngineRegistry* RegistryFor(ModelGroup* group);
  std::string IssueTicket(absl::string_view group, absl::string_view engine_id);
  void DropTicket(absl::string_view ticket);
  class Reactor;
  // False once shutting down (the reactor ends itself).
  bool Track(Reactor* reactor);
  void Untrack(Reactor* reactor);

 private:
  absl::StatusOr<std::vector<int>> Redeem(absl::string_view ticket, int pid, uint32_t uid);

  RefitServiceImpl* const refit_;
  const absl::Duration quiesce_timeout_;
  Metrics* const metrics_;
  const int max_engines_;
  std::string fd_socket_;
  std::unique_ptr<AttachFdServer> fd_server_;

  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<EngineRegistry>> registries_ ABSL_GUARDED_BY(mu_);
  struct Ticket {
    std::string group;
    std::string engine_id;
  };
  absl::flat_hash_map<std::string, Ticket> tickets_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<Reactor*> reactors_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace refit::server

#endif  // REFIT_SERVER_ATTACH_SERVICE_H_
