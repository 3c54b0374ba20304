// FleetMember: this daemon's membership of a fleet coordinated through etcd
// (--fleet NAME --etcd ENDPOINTS [--fleet-member ID]); docs/fleet.md.
//
// Pipeline position: beside the RefitService. A fleet coordinator
// (client/fleet_coordinator.h) prepares a refit on every member with
// RefitOptions.fleet_refit_id, records the decision once in etcd with a
// compare-and-swap, then commits every member. This class makes each member
// follow that decision on its own: a PREPARED fleet refit watches its
// decision key and commits or aborts when it is written, whoever writes it;
// when the fleet prepared deadline passes with no decision it writes "abort"
// with the same compare-and-swap (presumed abort), so exactly one of commit
// and abort is ever recorded.
//
// etcd keys, under /refitd/fleet/NAME/:
//   members/ID      this daemon's registration (JSON), on a lease: it goes
//                   away when the daemon dies
//   served/ID       the fleet version this member last committed, with its
//                   daemon version and fingerprint (no lease)
//   decisions/FRID  "commit" or "abort" of fleet refit FRID (JSON); the
//                   coordinator of a committed refit deletes old ones
//   version         the fleet's last committed version (JSON)
//   lock            the coordinator running a fleet refit (on its lease)
//
// Readiness: a member is ready when it serves the fleet's committed
// version. One that comes back behind it (it lost a prepared refit the
// fleet committed) stays NOT_SERVING with "behind the fleet at version N,
// fleet at M" until a fleet refit or a Reload brings it to the fleet's
// weights (its fingerprint then equals its rank's peers').
//
// Lifecycle: Start (join checks, registration, threads) after the first
// version is loaded; Stop (revokes the lease, joins the threads) at
// shutdown, before the groups go.
//
// Thread-safety: every public method may be called from any thread; etcd
// calls, session calls and the readiness callback run without the lock.
#ifndef REFIT_SERVER_FLEET_MEMBER_H_
#define REFIT_SERVER_FLEET_MEMBER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/refit_session.h"
#include "server/etcd_client.h"
#include "server/metrics.h"
#include "server/model_group.h"

namespace refit::server {

struct FleetOptions {
  std::string fleet;                        // NAME
  std::vector<std::string> etcd_endpoints;  // host:port, comma-separated
  std::string member_id;                    // "": <hostname>-r<tp rank>
  std::string address;                      // how coordinators reach this daemon
  // The registration's lease: a daemon that dies leaves the fleet this long
  // after its last keep-alive.
  absl::Duration lease_ttl = absl::Seconds(10);
  // A fleet refit PREPARED this long with no decision is aborted here, with
  // "abort" written first (presumed abort).
  absl::Duration prepared_timeout = absl::Seconds(30);
  absl::Duration etcd_timeout = absl::Seconds(2);
  // TLS to etcd (EtcdClientOptions).
  std::string etcd_ca_file;
  std::string etcd_cert_file;
  std::string etcd_key_file;
};

// The etcd key prefix of fleet `name`, "/refitd/fleet/NAME/".
std::string FleetPrefix(absl::string_view fleet);

// What GetStatus reports.
struct FleetStatus {
  std::string fleet;
  std::string member_id;
  uint64_t fleet_version = 0;
  bool consistent = false;
  std::string not_ready_reason;  // "" when consistent
};

class FleetMember {
 public:
  // Checks the layout against the live members (FAILED_PRECONDITION naming
  // each differing field and the member it differs from), registers, and
  // starts the keep-alive and the watch. `set_ready` is called with the
  // member's readiness whenever it changes (and once at start).
  // Errors: INVALID_ARGUMENT (no fleet name, bad endpoints), UNAVAILABLE
  // (etcd cannot be reached), FAILED_PRECONDITION (the layout differs).
  static absl::StatusOr<std::unique_ptr<FleetMember>> Start(
      FleetOptions options, ModelGroup* group, Metrics* metrics,
      std::function<void(bool ready)> set_ready);
  ~FleetMember();
  FleetMember(const FleetMember&) = delete;
  FleetMember& operator=(const FleetMember&) = delete;

  // Revokes the registration and stops following decisions. Idempotent.
  void Stop();

  // A refit with this fleet_refit_id became PREPARED (its local prepared
  // deadline is this class's, not --prepared-timeout).
  void OnPrepared(const std::string& refit_id, const std::string& fleet_refit_id);
  // Before a Commit RPC commits a fleet refit: OK with the fleet version the
  // decision records only if that decision is commit. FAILED_PRECONDITION
  // when it is abort or not written (a commit is never taken on the
  // caller's word), UNAVAILABLE when etcd cannot say.
  absl::StatusOr<uint64_t> CheckCommit(const std::string& fleet_refit_id);
  // Before an Abort RPC aborts a PREPARED fleet refit: records "abort"
  // unless a decision exists. OK when the decision is (now) abort;
  // FAILED_PRECONDITION when it is commit; UNAVAILABLE when etcd cannot be
  // reached (nothing aborted: the deadline will).
  absl::Status RecordAbort(const std::string& fleet_refit_id);
  // A fleet refit was committed here (by the Commit RPC).
  void OnCommitted(const std::string& fleet_refit_id, uint64_t fleet_version,
                   const core::RefitResult& result);
  // A Commit RPC found no refit `refit_id`: the result if this member
  // committed it through its decision (the RPC then answers OK).
  std::optional<core::RefitResult> RecentCommit(const std::string& refit_id) const;

  FleetStatus status() const;
  // Prometheus lines of the fleet (version, consistency, last flip skew).
  std::string RenderMetrics() const;

 private:
  struct Decision {
    std::string decision;  // "commit" | "abort" | "" (none)
    uint64_t fleet_version = 0;
  };
  struct Prepared {
    std::string refit_id;
    absl::Time deadline;
    bool check = true;  // read the decision key (it may predate the watch)
    // An etcd revision seen before this member answered PREPARED: a commit
    // of the refit moves the fleet's version key past it.
    int64_t revision = 0;
    // A decided commit that could not happen yet (a Commit RPC held the
    // refit, or its engines did not quiesce): the loop applies it again,
    // past the fleet's prepared deadline too, without asking etcd.
    std::optional<Decision> decided;
  };

  FleetMember(FleetOptions options, ModelGroup* group, Metrics* metrics,
              std::function<void(bool)> set_ready, std::unique_ptr<EtcdClient> etcd);
  absl::Status Join();
  absl::Status Register();
  // Writes the member key (its current registration, on the current lease);
  // with only_if_changed, nothing when it is what was last written.
  absl::Status WriteRegistration(bool only_if_changed);
  std::string RegistrationJson() const;
  std::string LayoutJson() const;
  void Loop();
  void KeepLease();
  void StartWatch();
  void OnWatchEvents(const std::vector<EtcdClient::WatchEvent>& events, int64_t revision);
  static Decision ParseDecision(const std::string& value);
  absl::StatusOr<Decision> ReadDecision(const std::string& fleet_refit_id);
  // Records "abort" for `fleet_refit_id` only if no decision exists and the
  // fleet's version key has not moved since `revision` (a commit moves it,
  // so an abort is never recorded for a commit whose key was deleted).
  // Returns what was recorded or found; decision "" when the key is gone
  // and the version moved (the refit may have been committed: never commit
  // on that guess). UNAVAILABLE when etcd cannot be reached.
  absl::StatusOr<Decision> RecordAbortIfUndecided(const std::string& fleet_refit_id,
                                                  int64_t revision, bool presumed, bool* written);
  // Commits or aborts the prepared refit of `fleet_refit_id` as decided;
  // nothing if it is not (or no longer) prepared here.
  // only_if_undecided (a presumed abort): nothing if a commit decision was
  // read for it meanwhile and is being tried again.
  void Apply(const std::string& fleet_refit_id, const Decision& decision,
             bool only_if_undecided = false);
  void PresumeAbort(const std::string& fleet_refit_id, int64_t revision);
  // Re-reads the fleet version and this member's served entry; updates
  // readiness and the registration.
  void Recompute();
  void WriteServed(uint64_t fleet_version, uint64_t version, const std::string& fingerprint);
  void Wake();

  const FleetOptions options_;
  const std::string prefix_;
  ModelGroup* const group_;
  Metrics* const metrics_;
  const std::function<void(bool)> set_ready_;
  const std::unique_ptr<EtcdClient> etcd_;

  absl::Mutex registration_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::string last_registration_ ABSL_GUARDED_BY(registration_mu_);
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  bool recompute_ ABSL_GUARDED_BY(mu_) = true;
  int64_t lease_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t watch_revision_ ABSL_GUARDED_BY(mu_) = 0;  // last revision seen
  int64_t revision_seen_ ABSL_GUARDED_BY(mu_) = 0;   // the latest etcd revision read or watched
  std::map<std::string, Prepared> prepared_ ABSL_GUARDED_BY(mu_);  // by fleet refit id
  // Fleet refits aborted here at their deadline while etcd could not take
  // the abort: the decision is unknown until etcd answers again.
  // By fleet refit id: its Prepared::revision.
  std::map<std::string, int64_t> unresolved_ ABSL_GUARDED_BY(mu_);
  std::deque<core::RefitResult> recent_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> applying_ ABSL_GUARDED_BY(mu_);  // local refit ids being decided
  FleetStatus status_ ABSL_GUARDED_BY(mu_);
  bool ready_ ABSL_GUARDED_BY(mu_) = false;
  bool ready_told_ ABSL_GUARDED_BY(mu_) = false;
  double last_skew_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<std::pair<uint64_t, core::RefitResult>> pending_served_ ABSL_GUARDED_BY(mu_);

  std::unique_ptr<EtcdClient::Watch> watch_;  // loop thread only
  std::thread loop_;
  std::thread keeper_;  // KeepLease
};

class RefitServer;
struct ServerOptions;
// Joins options.fleet with `server`'s default group (refitd's main, after
// the first version is loaded): the registration's address is
// --fleet-advertise or the first bound address; readiness is the health
// service's gate. The caller clears the service's fleet and stops the
// member before the server goes. Errors: those of FleetMember::Start.
absl::StatusOr<std::unique_ptr<FleetMember>> JoinFleet(const ServerOptions& options,
                                                       RefitServer* server);

}  // namespace refit::server

#endif  // REFIT_SERVER_FLEET_MEMBER_H_
