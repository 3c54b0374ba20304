// PushRefit: one refit fed by one or more Push streams, and PushRefits, the
// service's registry of them by refit id.
//
// Pipeline position: the Push stream whose Begin opens a refit (the opener)
// creates its PushRefit with the number of streams that will feed it
// (Begin.streams, 1 by default); the others join it by id
// (Begin.join_refit_id) and share its core::RefitSession, whose Ingest
// serializes their chunks. Each stream's End counts it as ended cleanly; the
// End that completes the count (every stream joined and ended, the opener's
// included) commits or prepares the refit and ends every stream's RPC with
// the result. Any stream failing, disconnecting or being cancelled aborts the
// refit and ends all the streams with the abort's status.
//
// Lifecycle: a PushRefit holds a reference to each member stream until it is
// closed (Close: the refit completed or was aborted); then the registry
// forgets its id, remembering it among the recently finished ones (so that
// a late join gets FAILED_PRECONDITION, not NOT_FOUND).
//
// Thread-safe. Neither class calls out (into a stream or the session) while
// holding its lock.
#ifndef REFIT_SERVER_PUSH_REFIT_H_
#define REFIT_SERVER_PUSH_REFIT_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "core/refit_session.h"
#include "server/model_group.h"
#include "server/region_registry.h"

namespace refit::server {

class PushRefits;

// A Push stream as its PushRefit sees it.
class PushMember {
 public:
  virtual void Ref() = 0;
  virtual void Unref() = 0;

 protected:
  virtual ~PushMember() = default;
};

class PushRefit {
 public:
  // Most streams one refit may have.
  static constexpr int kMaxStreams = 64;

  PushRefit(PushRefits* registry, std::string owner, ModelGroup* group,
            std::shared_ptr<core::RefitSession> session, int streams, bool prepare_only,
            std::shared_ptr<RegionReads> region_reads);
  ~PushRefit();
  PushRefit(const PushRefit&) = delete;
  PushRefit& operator=(const PushRefit&) = delete;

  const std::string& id() const { return session_->refit_id(); }
  const std::string& owner() const { return owner_; }
  ModelGroup* group() const { return group_; }
  const std::shared_ptr<core::RefitSession>& session() const { return session_; }
  int streams() const { return streams_; }
  bool prepare_only() const { return prepare_only_; }
  // The guarded shared-memory regions its chunks came from (the session
  // checks them once it has read its last byte).
  RegionReads* region_reads() const { return region_reads_.get(); }

  // Adds a member stream (the opener first), taking a reference to it.
  // Errors: FAILED_PRECONDITION when the refit is closed or already has all
  // its streams (both named).
  absl::Status Join(PushMember* member);
  // A member sent End. True for the End that leaves no stream to wait for:
  // its caller completes the refit (Commit or Prepare) and then Close()s it.
  bool EndClean();
  // How many streams are still to join or to end (for logs).
  int Outstanding() const;
  // How many streams have joined (the opener included) while some are still
  // to join; nullopt once all have joined or the refit is closed.
  std::optional<int> JoinedWhileWaiting() const;
  // Close() if, in the same look, some stream is still to join: then
  // `*members` are its members (references adopted) and `*joined` their
  // number. False (nothing changed) once all have joined or it is closed,
  // so a refit that is completing is never ended as one that waits.
  bool CloseWhileWaiting(std::vector<PushMember*>* members, int* joined);
  // The first call closes the refit and returns its members (references
  // adopted) so that the caller ends their RPCs; later calls return nothing.
  std::vector<PushMember*> Close();
  bool closed() const;

 private:
  // Closes the refit unless it is closed (or, only_while_waiting, has all
  // its streams); true if this call closed it.
  bool CloseIf(bool only_while_waiting, std::vector<PushMember*>* members, int* joined);

  PushRefits* const registry_;
  const std::string owner_;
  ModelGroup* const group_;
  const std::shared_ptr<core::RefitSession> session_;
  const int streams_;
  const bool prepare_only_;
  const std::shared_ptr<RegionReads> region_reads_;
  mutable absl::Mutex mu_;
  std::vector<PushMember*> members_ ABSL_GUARDED_BY(mu_);
  int ended_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

class PushRefits {
 public:
  // How many finished refit ids are remembered.
  static constexpr int kFinishedRemembered = 1024;

  // INVALID_ARGUMENT unless `id` is 1 to 64 of [A-Za-z0-9._-].
  static absl::Status ValidateId(absl::string_view id);

  // ALREADY_EXISTS when an open refit has `refit->id()`.
  absl::Status Add(std::shared_ptr<PushRefit> refit);
  // ALREADY_EXISTS when an open refit has `id`.
  absl::Status CheckUnused(absl::string_view id) const;
  // The open refit `id`. NOT_FOUND if unknown; FAILED_PRECONDITION if it
  // finished recently.
  absl::StatusOr<std::shared_ptr<PushRefit>> Find(absl::string_view id) const;
  // The refit closed: forget it (if `refit` is the one registered).
  void Finished(const PushRefit* refit);

 private:
  mutable absl::Mutex mu_;
  struct Open {
    const PushRefit* refit;  // identity only; never dereferenced
    std::weak_ptr<PushRefit> ref;
  };
  absl::flat_hash_map<std::string, Open> open_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> finished_order_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> finished_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::server

#endif  // REFIT_SERVER_PUSH_REFIT_H_
