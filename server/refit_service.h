// RefitServiceImpl: the refit.v1.RefitService gRPC service (callback API).
//
// Pipeline position: the front door. Push and Reload drive a
// core::RefitSession per refit; Commit/Abort finish prepared refits (Abort also
// ends running ones); GetStatus, ListTensors, ReadTensor and Watch read the
// ShardStore. Every RPC is authorized first (server/auth.h), and every
// answer's status comes from core through server/grpc_convert.h.
//
// Lifecycle: created by RefitServer with its model groups; BeginShutdown()
// refuses new refits (UNAVAILABLE), aborts the running and prepared ones,
// and ends Watch streams; Join() waits for Reload workers. The service must
// outlive the grpc::Server that serves it (the server is shut down and waited
// for first).
//
// Thread-safety: all handlers may run concurrently on gRPC's threads.
#ifndef REFIT_SERVER_REFIT_SERVICE_H_
#define REFIT_SERVER_REFIT_SERVICE_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "core/safetensors.h"
#include "refit/v1/refit.grpc.pb.h"
#include "server/auth.h"
#include "server/clock.h"
#include "server/metrics.h"
#include "server/model_group.h"
#include "server/push_refit.h"
#include "server/reactor_util.h"
#include "server/server_options.h"

namespace refit::server {

class FleetMember;     // server/fleet_member.h
class AttachService;   // server/attach_service.h
class RegionRegistry;  // server/region_registry.h

// Push is registered raw (grpc::ByteBuffer): its reactor parses messages
// into buffers it reuses (server/push_message.h).
class RefitServiceImpl final
    : public v1::RefitService::WithRawCallbackMethod_Push<v1::RefitService::CallbackService> {
 public:
  // `groups`, `auth` and `metrics` must outlive the service.
  RefitServiceImpl(const ServerOptions& options,
                   const std::map<std::string, std::unique_ptr<ModelGroup>>* groups,
                   const Authenticator* auth, Metrics* metrics);
  ~RefitServiceImpl() override;

  grpc::ServerReadReactor<grpc::ByteBuffer>* Push(grpc::CallbackServerContext* context,
                                                  grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<v1::ReloadProgress>* Reload(grpc::CallbackServerContext* context,
                                                       const v1::ReloadRequest* request) override;
  grpc::ServerUnaryReactor* Commit(grpc::CallbackServerContext* context,
                                   const v1::CommitRequest* request,
                                   v1::CommitResponse* response) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context,
                                  const v1::AbortRequest* request,
                                  v1::AbortResponse* response) override;
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context,
                                      const v1::GetStatusRequest* request,
                                      v1::GetStatusResponse* response) override;
  grpc::ServerUnaryReactor* ListTensors(grpc::CallbackServerContext* context,
                                        const v1::ListTensorsRequest* request,
                                        v1::ListTensorsResponse* response) override;
  grpc::ServerWriteReactor<v1::ReadTensorResponse>* ReadTensor(
      grpc::CallbackServerContext* context, const v1::ReadTensorRequest* request) override;
  grpc::ServerWriteReactor<v1::WatchEvent>* Watch(grpc::CallbackServerContext* context,
                                                  const v1::WatchRequest* request) override;

  void BeginShutdown();
  void Join();
  // GetStatus lists the engines `attach` has attached (set once, before
  // serving; it must outlive the service's RPCs).
  void SetAttachService(const AttachService* attach) { attach_ = attach; }
  // Tests: called in Commit with the (first) refit's id once the refits
  // are taken for the commit (kTaken) and once it returned, before they are
  // given back or done (kReturned); a linked commit that failed, also just
  // before it gives its refits back (kGivingBack). Set before the service
  // takes calls.
  enum class CommitStage { kTaken, kReturned, kGivingBack };
  using CommitHook = std::function<void(CommitStage stage, const std::string& refit_id)>;
  void SetCommitHookForTesting(CommitHook hook) { commit_hook_ = std::move(hook); }
  // Trainers' shared-memory regions, which Push chunks may reference (set
  // once, before serving; nullptr: Chunk.region is FAILED_PRECONDITION).
  void SetRegions(const RegionRegistry* regions) { regions_ = regions; }
  const RegionRegistry* regions() const { return regions_; }
  // The daemon's fleet membership (--fleet), or nullptr. Set once the first
  // version is loaded and cleared before the member goes.
  void SetFleet(FleetMember* fleet) { fleet_.store(fleet); }
  // OK for "" (not a fleet refit); FAILED_PRECONDITION for a fleet refit on
  // a daemon that is in no fleet.
  absl::Status CheckFleetRefit(absl::string_view fleet_refit_id) const;
  bool shutting_down() const { return shutting_down_.load(); }

  // For the reactors (server/*_reactor.cc).
  const ServerOptions& options() const { return options_; }
  Metrics* metrics() const { return metrics_; }
  IdleWatchdog* watchdog() { return &watchdog_; }
  // The clock of the watchdog: idle deadlines are computed from its Now().
  Clock* clock() const { return clock_; }
  // NOT_FOUND naming the group; "" is the default group.
  absl::StatusOr<ModelGroup*> FindGroup(absl::string_view name) const;
  absl::StatusOr<Principal> Authorize(const grpc::CallbackServerContext* context, Action action,
                                      absl::string_view method) const;
  // UNAVAILABLE while shutting down.
  absl::Status CheckAcceptingRefits() const;
  // Registers a refit that began (ModelGroup::Add) with its --refit-timeout
  // deadline.
  void Register(ModelGroup* group, RefitEntry entry, RefitDriver* driver);
  // ModelGroup::MarkPrepared with the --prepared-timeout deadline.
  void MarkPrepared(ModelGroup* group, absl::string_view refit_id);
  // Open Push streams, ended at shutdown even before their Begin.
  void AddStream(RefitDriver* stream);
  void RemoveStream(RefitDriver* stream);
  // Runs `work` on a thread of its own, joined by Join() (threads that
  // finished are joined by the next RunWorker).
  void RunWorker(std::function<void()> work);
  // Push refits by id (opened, joined by other streams).
  PushRefits* push_refits() { return &push_refits_; }

 private:
  // Commit with CommitRequest.linked: this refit and the linked ones at one
  // commit point (core::RefitSession::CommitLinked), all or none. Refusals
  // (NOT_FOUND for an unknown group or refit, PERMISSION_DENIED for another
  // client's, FAILED_PRECONDITION for one still receiving, INVALID_ARGUMENT
  // for a group named twice; each naming the group) leave every refit as
  // it was; a commit that fails in the store aborts them all.
  // Abort of a refit a Commit holds (waiting for attached engines to
  // quiesce, or copying): the wait ends and that Commit returns ABORTED; a
  // Commit already copying completes, and the Abort is FAILED_PRECONDITION.
  grpc::ServerUnaryReactor* AbortCommitting(grpc::CallbackServerContext* context,
                                            const Principal& caller, ModelGroup* group,
                                            const RefitEntry& entry, const std::string& why,
                                            v1::AbortResponse* response);
  grpc::ServerUnaryReactor* CommitLinked(grpc::CallbackServerContext* context,
                                         const Principal& caller, ModelGroup* first,
                                         const v1::CommitRequest* request,
                                         v1::CommitResponse* response);
  // GetStatus of one group, with `live` its live version.
  void FillStatus(ModelGroup* group, const core::LiveVersion& live,
                  v1::GetStatusResponse* response) const;

  ServerOptions options_;
  const std::string default_group_;  // what model_group "" names
  const std::map<std::string, std::unique_ptr<ModelGroup>>* groups_;
  const Authenticator* auth_;
  Metrics* metrics_;
  const AttachService* attach_ = nullptr;
  const RegionRegistry* regions_ = nullptr;
  std::atomic<bool> shutting_down_{false};
  std::atomic<FleetMember*> fleet_{nullptr};
  // Aborts refits past their deadline (--refit-timeout, --prepared-timeout):
  // one watchdog target for all of them.
  class Deadlines final : public IdleWatchdog::Target {
   public:
    explicit Deadlines(RefitServiceImpl* service) : service_(service) {}
    void Ref() override {}
    void Unref() override {}
    absl::Time IdleDeadline() const override;
    void OnIdle() override;

   private:
    RefitServiceImpl* const service_;
  };

  Clock* const clock_;
  IdleWatchdog watchdog_;
  Deadlines deadlines_{this};
  absl::Mutex streams_mu_;
  absl::flat_hash_set<RefitDriver*> streams_ ABSL_GUARDED_BY(streams_mu_);
  absl::Mutex workers_mu_;
  struct Worker {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<Worker> workers_ ABSL_GUARDED_BY(workers_mu_);
  PushRefits push_refits_;
  CommitHook commit_hook_;  // tests only
};

// Implemented in push_reactor.cc and reload_reactor.cc.
grpc::ServerReadReactor<grpc::ByteBuffer>* NewPushReactor(RefitServiceImpl* service,
                                                          grpc::CallbackServerContext* context,
                                                          grpc::ByteBuffer* response);
grpc::ServerWriteReactor<v1::ReloadProgress>* NewReloadReactor(RefitServiceImpl* service,
                                                               grpc::CallbackServerContext* context,
                                                               const v1::ReloadRequest* request);

// Resolves `path` (a directory or a .safetensors file; a relative path is
// taken relative to `root`) under `root` with realpath, and every
// *.safetensors file of a directory too (symlinks followed). Returns the
// resolved files.
// Errors: PERMISSION_DENIED when the path or any file in it resolves outside
// the root (or there is no root), naming it; NOT_FOUND if it does not exist;
// INVALID_ARGUMENT for other file types or an empty path.
absl::StatusOr<std::vector<std::string>> ResolveReloadPath(const std::string& root,
                                                           const std::string& path);

// Checks that the file Reload actually opened lies under `root`: a file
// swapped for a symlink between ResolveReloadPath and the open is refused.
// Errors: PERMISSION_DENIED naming the file; FAILED_PRECONDITION if the root
// no longer resolves; INTERNAL if the open file cannot be resolved.
absl::Status CheckOpenedUnderRoot(const std::string& root, const core::SafetensorsFile& file);

}  // namespace refit::server

#endif  // REFIT_SERVER_REFIT_SERVICE_H_
