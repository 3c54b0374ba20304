// ModelGroup: one served model ("target"; later drafts) with its ShardStore
// and the registry of the refits that are running or prepared against it.
//
// Pipeline position: the RPC handlers find the group by name, start a
// RefitSession on its store, and register the refit here so that Commit,
// Abort, GetStatus and shutdown can reach it. The store enforces "one refit
// at a time"; the registry records who owns a refit (for the trainer role),
// its session, and the RPC driving it (a Push or Reload stream) so that an
// Abort or a shutdown can end that stream at once.
//
// Lifetime of a driver: a RefitDriver is reference counted. The registry
// hands out drivers with a reference taken under its lock (DriverRef);
// a driver unregisters itself (RemoveDriver) before dropping its own
// reference, so a DriverRef never points at a deleted object.
//
// Thread-safe.
#ifndef REFIT_SERVER_MODEL_GROUP_H_
#define REFIT_SERVER_MODEL_GROUP_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/support/status.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/refit_session.h"
#include "core/shard_store.h"

namespace refit::server {

// The RPC that drives a refit (a Push or Reload reactor).
class RefitDriver {
 public:
  virtual void Ref() = 0;
  virtual void Unref() = 0;
  // Aborts the refit with `reason` and ends the RPC with `status`. Idempotent;
  // callable from any thread without locks held.
  virtual void Cancel(const grpc::Status& status, absl::string_view reason) = 0;

 protected:
  virtual ~RefitDriver() = default;
};

// A reference to a driver; Unrefs on destruction.
class DriverRef {
 public:
  DriverRef() = default;
  explicit DriverRef(RefitDriver* driver) : driver_(driver) {}  // adopts a reference
  DriverRef(DriverRef&& other) noexcept : driver_(other.driver_) { other.driver_ = nullptr; }
  DriverRef& operator=(DriverRef&& other) noexcept;
  ~DriverRef();
  DriverRef(const DriverRef&) = delete;
  DriverRef& operator=(const DriverRef&) = delete;
  RefitDriver* get() const { return driver_; }
  explicit operator bool() const { return driver_ != nullptr; }

 private:
  RefitDriver* driver_ = nullptr;
};

// A Watch stream: receives every store event of the group.
class EventSubscriber {
 public:
  virtual void Ref() = 0;
  virtual void Unref() = 0;
  // Must be cheap and must not block (called on the thread of the event).
  virtual void Deliver(const core::StoreEvent& event) = 0;
  // Ends the stream (shutdown).
  virtual void Close(const grpc::Status& status) = 0;

 protected:
  virtual ~EventSubscriber() = default;
};

struct RefitEntry {
  std::string refit_id;
  std::string owner;  // Principal::name of the caller that started it
  std::string kind;   // "push" | "reload"
  std::string label;
  std::shared_ptr<core::RefitSession> session;
  // RefitOptions.fleet_refit_id; "" outside fleet refits.
  std::string fleet_refit_id;
  bool prepared = false;
  // On the server's Clock: the refit is aborted when the earlier of the two
  // passes (--refit-timeout from its start; --prepared-timeout from
  // PREPARED).
  absl::Time refit_deadline = absl::InfiniteFuture();
  absl::Time prepared_deadline = absl::InfiniteFuture();
  bool expired = false;  // handed out by TakeExpired once
};

class ModelGroup {
 public:
  explicit ModelGroup(std::unique_ptr<core::ShardStore> store);
  ~ModelGroup();
  ModelGroup(const ModelGroup&) = delete;
  ModelGroup& operator=(const ModelGroup&) = delete;

  const std::string& name() const { return store_->group(); }
  core::ShardStore* store() const { return store_.get(); }

  void Add(RefitEntry entry, RefitDriver* driver);
  // The refit stopped at PREPARED: it stays registered without a driver,
  // until Commit / Abort or `prepared_deadline`. A refit whose session is
  // no longer PREPARED (aborted meanwhile) is left to its driver.
  void MarkPrepared(absl::string_view refit_id,
                    absl::Time prepared_deadline = absl::InfiniteFuture());
  // Drops the entry if `driver` still drives it (not after MarkPrepared).
  void RemoveDriver(absl::string_view refit_id, RefitDriver* driver);

  struct Found {
    RefitEntry entry;
    DriverRef driver;  // empty for prepared refits
  };
  // `refit_id` "" finds the active refit. NOT_FOUND naming the id otherwise.
  absl::StatusOr<Found> Find(absl::string_view refit_id) const;
  // The active refit if `owner` is "" (a caller who may finish any refit) or
  // started it: what an empty refit id in Commit / Abort means, "the
  // caller's own active refit". NOT_FOUND when the group has no active refit,
  // or when the active one was started by someone else (its id is named, its
  // owner is not).
  absl::StatusOr<Found> FindActive(absl::string_view owner) const;
  // Removes a prepared refit and returns it. NOT_FOUND if unknown;
  // FAILED_PRECONDITION if it is still receiving or a Commit holds it.
  absl::StatusOr<RefitEntry> TakePrepared(absl::string_view refit_id);
  // TakePrepared for a commit: until EndCommit(refit_id), Find and
  // TakePrepared answer FAILED_PRECONDITION ("a Commit holds it") for the
  // refit instead of NOT_FOUND, so that an Abort or a second Commit arriving
  // while the commit waits for attached engines says what is going on.
  absl::StatusOr<RefitEntry> TakePreparedToCommit(absl::string_view refit_id);
  // The commit of `refit_id` returned, and does not give the refit back
  // (PutBack does both). True if an Abort was asked of it meanwhile
  // (AskAbort).
  bool EndCommit(absl::string_view refit_id);
  // A refit a Commit holds: its entry (the Commit keeps the refit; an Abort
  // ends the Commit's wait for attached engines through the session).
  // NOT_FOUND (as Find's) when no Commit holds `refit_id`.
  absl::StatusOr<RefitEntry> Committing(absl::string_view refit_id) const;
  // Records that an Abort asked for the refit a Commit holds, for EndCommit
  // and PutBack. False if no Commit holds it (any more).
  bool AskAbort(absl::string_view refit_id);
  // Whether an Abort asked for the refit a Commit holds.
  bool AbortAsked(absl::string_view refit_id) const;
  // A Commit that did not commit (the engines did not quiesce) gives the
  // refit back: registered PREPARED again, as before the Commit, and
  // EndCommit-ed, at once. Unless an Abort asked for it meanwhile: then
  // false, and nothing is registered (the Abort aborts the session).
  bool PutBack(RefitEntry entry);
  // PutBack for the refits of a linked commit, one per group (groups[i]
  // holds entries[i]; no group twice), all or none, at one instant: if an
  // Abort asked for any of them, none is registered again (the caller
  // aborts those whose Abort did not: an Abort of one refit of a linked
  // commit aborts all of them), and neither is one whose `prepared[i]` is
  // false (its session left PREPARED). Every commit hold ends. Returns
  // whether each was given back; `abort_asked` set if an Abort asked for
  // any.
  static std::vector<bool> PutBackLinked(absl::Span<ModelGroup* const> groups,
                                         absl::Span<const RefitEntry> entries,
                                         const std::vector<bool>& prepared, bool* abort_asked);
  // Removes everything (shutdown): prepared entries and drivers.
  std::vector<Found> TakeAll();
  // The earliest deadline of a refit not yet expired (InfiniteFuture if none).
  absl::Time NextDeadline() const;
  // The refits whose deadline is at or before `now`, each handed out once:
  // prepared ones are removed (the caller aborts them), running ones keep
  // their entry and come with their driver (the caller cancels it).
  std::vector<Found> TakeExpired(absl::Time now);

  // Sessions registered now, for status and metrics.
  std::vector<std::shared_ptr<core::RefitSession>> Sessions() const;

  // Event fan-out to Watch streams. A subscriber removes itself before its
  // last reference goes; Close ends every stream and refuses new ones.
  // Subscribe returns false once closed.
  bool Subscribe(EventSubscriber* subscriber);
  void Unsubscribe(EventSubscriber* subscriber);
  void CloseSubscribers(const grpc::Status& status);

 private:
  void Fanout(const core::StoreEvent& event);
  // NOT_FOUND for an unknown refit; FAILED_PRECONDITION for one a Commit
  // holds.
  absl::Status MissingLocked(absl::string_view refit_id) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::StatusOr<RefitEntry> TakePreparedLocked(absl::string_view refit_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  struct Slot {
    RefitEntry entry;
    RefitDriver* driver = nullptr;
  };
  std::unique_ptr<core::ShardStore> store_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Slot> refits_ ABSL_GUARDED_BY(mu_);
  // Refits a Commit took out of refits_ and is still committing.
  struct CommitHold {
    RefitEntry entry;
    bool abort_asked = false;  // by AskAbort
  };
  absl::flat_hash_map<std::string, CommitHold> committing_ ABSL_GUARDED_BY(mu_);

  int listener_id_ = -1;
  mutable absl::Mutex subscribers_mu_;
  std::vector<EventSubscriber*> subscribers_ ABSL_GUARDED_BY(subscribers_mu_);
  bool closed_ ABSL_GUARDED_BY(subscribers_mu_) = false;
};

}  // namespace refit::server

#endif  // REFIT_SERVER_MODEL_GROUP_H_
