// EngineRegistry: the inference engines attached to one model group's arena,
// and the coordination of that group's commits with them.
//
// Pipeline position: the store's CommitCoordinator (core/shard_store.h).
// Before a commit copies, every coordinated engine is sent CommitPending and
// the commit waits until each has answered Quiesced (it is between forward
// steps), has gone away, or --engine-quiesce-timeout has passed. Then the
// copy runs and every attached engine is sent Committed. When the timeout
// passes first the commit does not happen (NotQuiescedError naming the
// engines: RefitSession keeps a PREPARED refit PREPARED, aborts a one-phase
// one with ABORTED) and the engines that were told are sent Aborted so they
// resume. An engine that detaches is released at once and never blocks a
// commit. A linked commit asks the engines of all its groups at once
// (AskCommit), then waits for each group's; an engine that attaches to a
// group whose wait is over, before the copy starts (StartCopy), is waited
// for as well. The pause of each coordinated
// engine (its Quiesced to its Committed) is observed in Metrics.
//
// Lifecycle: created per group by the AttachService, registered as the
// store's coordinator and listener; the destructor unregisters both.
// Engines are added by their Attach stream and removed when it ends.
//
// Thread-safety: thread-safe. EngineSink::Send is called with the registry's
// lock held, so it must only queue.
#ifndef REFIT_SERVER_ENGINE_REGISTRY_H_
#define REFIT_SERVER_ENGINE_REGISTRY_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/shard_store.h"
#include "refit/v1/engine.pb.h"
#include "server/metrics.h"

namespace refit::server {

// Where an engine's events go (its Attach stream). Send queues; never blocks.
class EngineSink {
 public:
  virtual ~EngineSink() = default;
  // Queues `message`; false, queuing nothing, once the engine's stream holds
  // kMaxQueuedMessages (reactor_util.h) unread: the registry then ends the
  // lease.
  virtual bool Send(v1::DaemonMessage message) = 0;
  // Ends the engine's lease with `status` (from outside the registry's
  // lock); the sink then removes itself. Ref/Unref keep it alive meanwhile.
  virtual void EndLease(const absl::Status& status) = 0;
  virtual void Ref() = 0;
  virtual void Unref() = 0;
};

struct EngineInfo {
  std::string engine_id;
  std::string name;
  int pid = 0;  // from the descriptor socket's peer credentials (0 until then)
  uint32_t uid = 0;
  bool coordinated = false;
  absl::Time attached;
  uint64_t version = 0;  // the last version the engine was told of
};

class EngineRegistry final : public core::CommitCoordinator {
 public:
  // `store` and `metrics` must outlive the registry. At most `max_engines`
  // engines are attached at once.
  EngineRegistry(core::ShardStore* store, absl::Duration quiesce_timeout, Metrics* metrics,
                 int max_engines);
  ~EngineRegistry() override;
  EngineRegistry(const EngineRegistry&) = delete;
  EngineRegistry& operator=(const EngineRegistry&) = delete;

  // Registers an engine and returns its id ("e-N"); RESOURCE_EXHAUSTED with
  // max_engines attached already (nothing sent). `attached` runs with the
  // registry's lock held: it sends the engine its first message and returns
  // the version it told the engine of, so that no commit's Committed falls
  // between the two. `pending` is the commit the engine is asked about at
  // once (below), or null.
  // A coordinated engine that attaches while a commit is pending is sent
  // its CommitPending at once: before the copy the commit waits for its ack
  // too; during the copy it is told to hold until Committed.
  absl::StatusOr<std::string> Add(
      absl::string_view name, bool coordinated, EngineSink* sink,
      absl::FunctionRef<uint64_t(const std::string& engine_id, const v1::CommitPending* pending)>
          attached);
  // Releases the engine: it no longer receives anything, and a commit
  // waiting for it goes on without it.
  void Remove(absl::string_view engine_id);
  void SetPeer(absl::string_view engine_id, int pid, uint32_t uid);
  // The engine reached its safe point for the pending commit of `version`.
  // Acks for another refit, version or attempt (late ones) are ignored.
  void OnQuiesced(absl::string_view engine_id, absl::string_view refit_id, uint64_t version,
                  uint64_t attempt);
  std::vector<EngineInfo> List() const;
  int size() const;

  // core::CommitCoordinator
  absl::Status AskCommit(absl::string_view refit_id, uint64_t next_version) override;
  absl::Status BeforeCommit(absl::string_view refit_id, uint64_t next_version) override;
  void AfterCommit(absl::string_view refit_id,
                   const absl::StatusOr<core::CommitStats>& result) override;
  void CancelWait(absl::string_view refit_id, absl::string_view reason) override;
  void CancelLinkedWait(absl::string_view refit_id, absl::string_view reason) override;
  bool ReadyToCopy(absl::string_view refit_id) override;
  void StartCopy(absl::string_view refit_id) override;
  void Close(absl::string_view reason) override;

 private:
  // A process descriptor, closed with its engine.
  struct ProcessFd {
    ProcessFd() = default;
    ProcessFd(const ProcessFd&) = delete;
    ProcessFd& operator=(const ProcessFd&) = delete;
    ~ProcessFd();
    int fd = -1;
  };
  struct Engine {
    EngineInfo info;
    EngineSink* sink = nullptr;
    absl::Time quiesced_at = absl::InfinitePast();  // during a pending commit
    ProcessFd pidfd;          // the engine's process (pidfd_open), once its pid is known
    bool overflowed = false;  // its sink refused a message: its lease is ending
  };
  // Ends the leases queued in ending_ as a method returns, once the lock is
  // released (declared before the method's MutexLock).
  class EndLeasesOnReturn {
   public:
    explicit EndLeasesOnReturn(EngineRegistry* registry) : registry_(registry) {}
    ~EndLeasesOnReturn() { registry_->EndLeases(); }
    EndLeasesOnReturn(const EndLeasesOnReturn&) = delete;
    EndLeasesOnReturn& operator=(const EndLeasesOnReturn&) = delete;

   private:
    EngineRegistry* registry_;
  };
  // Sends through the engine's sink; a sink that refuses (its engine has
  // stopped reading) is no longer waited for, and its lease is queued to end.
  void SendLocked(Engine& engine, v1::DaemonMessage message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the leases in ending_ (a sink's EndLease takes its own lock and
  // may call back into the registry: never under mu_).
  void EndLeases() ABSL_LOCKS_EXCLUDED(mu_);
  // The engine's process has exited (reaped or not).
  static bool ProcessGone(const Engine& engine);
  void OnStoreEvent(const core::StoreEvent& event);
  // Makes `refit_id`'s commit of `next_version` the pending one and sends
  // every coordinated engine its CommitPending; the wait for their acks
  // ends at ask_deadline_. An error: nothing pending, no engine asked.
  absl::Status AskLocked(absl::string_view refit_id, uint64_t next_version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendPendingLocked(const std::string& id, Engine& engine) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendAbortedLocked(absl::string_view refit_id, absl::string_view reason, bool told_only,
                         const std::set<std::string>* skip = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The engine is released from a commit (`committed`, or aborted): its
  // pause, if it quiesced for it, is observed.
  void EndPauseLocked(const std::string& id, Engine& engine, absl::Time now, bool committed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the engines whose process is gone (their recorded pid exits no
  // more, while something else, a child that inherited the stream, keeps
  // it open) out of the registry and queues their leases to end.
  void TakeGoneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the leases queued in ending_ now, if any, releasing the lock
  // meanwhile (a commit's wait, which holds it, must not delay them).
  void EndLeasesNowLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool NoneWaitingOrCancelledLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return waiting_.empty() || (!pending_refit_.empty() && cancelled_refit_ == pending_refit_);
  }
  // Removes the engine from every set (engines_, told_, waiting_).
  void ForgetLocked(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends Aborted to the engines told of `refit_id`'s commit, and records
  // them, so that the store's kAborted event that follows skips them.
  void TellToldAbortedLocked(absl::string_view refit_id, absl::string_view reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the pending commit: its told engines are sent Aborted.
  void EndPendingLocked(absl::string_view reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  core::ShardStore* const store_;
  const absl::Duration quiesce_timeout_;
  Metrics* const metrics_;
  const int max_engines_;
  int listener_ = -1;

  mutable absl::Mutex mu_;
  std::map<std::string, Engine> engines_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // The commit in AskCommit (or BeforeCommit)..AfterCommit, if any (one at
  // a time: the store's refit slot).
  std::string pending_refit_ ABSL_GUARDED_BY(mu_);
  uint64_t pending_version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t attempt_ ABSL_GUARDED_BY(mu_) = 0;  // of the pending commit, counted per registry
  bool copying_ ABSL_GUARDED_BY(mu_) =
      false;  // the copy may run (BeforeCommit or StartCopy), no AfterCommit yet
  bool asked_ ABSL_GUARDED_BY(mu_) = false;             // AskCommit returned OK, no StartCopy yet
  absl::Time ask_deadline_ ABSL_GUARDED_BY(mu_);        // the pending commit's wait ends here
  std::set<std::string> told_ ABSL_GUARDED_BY(mu_);     // sent CommitPending
  std::set<std::string> waiting_ ABSL_GUARDED_BY(mu_);  // told, not yet quiesced
  // A refit aborted before or during its BeforeCommit (CancelWait), and why.
  std::string cancelled_refit_ ABSL_GUARDED_BY(mu_);
  std::string cancel_message_ ABSL_GUARDED_BY(mu_);
  // The refit whose Committed event came last, until another refit starts
  // or asks to commit: a cancel of it is late (it raced the commit's end),
  // not one on its way to its commit.
  std::string last_committed_ ABSL_GUARDED_BY(mu_);
  // Close's reason: set, every AskCommit and BeforeCommit from then on is
  // refused.
  std::optional<std::string> closed_ ABSL_GUARDED_BY(mu_);
  // The refit whose abort was sent from BeforeCommit, and to which engines:
  // the store's kAborted event that follows is not sent to them again.
  std::string abort_sent_refit_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> abort_sent_to_ ABSL_GUARDED_BY(mu_);
  // Leases to end once the lock is released: the sink (referenced) and
  // why (its engine stopped reading; its process is gone).
  std::vector<std::pair<EngineSink*, absl::Status>> ending_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::server

#endif  // REFIT_SERVER_ENGINE_REGISTRY_H_
