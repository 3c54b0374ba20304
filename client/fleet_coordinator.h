// FleetCoordinator: a fleet refit, all members or none, coordinated through
// etcd (the coordinator side of server/fleet_member.h; docs/fleet.md).
//
//   1. Reads the members (FLEET/members/), takes the fleet's lock (a
//      compare-and-swap on FLEET/lock, on a lease: a coordinator that dies
//      frees it at the lease's expiry). A lock already held is ABORTED.
//   2. Prepares every member in parallel: each gets the whole checkpoint
//      (Push of the files, or Reload of a path) with COMPLETION_MODE_PREPARE
//      and the fleet refit id; the daemon takes its rank's slices itself.
//   3. Records the decision once: commit only if no decision exists (a
//      member whose prepared deadline passed may have written abort) and the
//      fleet version is still the one read in 1. Any failed prepare records
//      abort instead.
//   4. Commits every member in parallel (members also commit on their own
//      when they see the decision, whoever is first), on the connections
//      opened in 2, reads back each member's version, fingerprint, commit
//      time and commit duration: the flip skew is the time between the
//      first and the last commit.
//   5. After a commit, deletes old decisions (decisions/FRID): all but the
//      newest keep_decisions, and only those older than every member's
//      prepared timeout (a member still PREPARED for one never finds it
//      gone before its deadline). The commit moved the fleet's version, so
//      no older refit can still record commit, and a member that finds its
//      decision gone aborts (server/fleet_member.h) rather than commit.
//
// Thread-safety: one refit at a time per object; Status may run any time.
#ifndef REFIT_CLIENT_FLEET_COORDINATOR_H_
#define REFIT_CLIENT_FLEET_COORDINATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/etcd_client.h"

namespace refit::client {

struct FleetCoordinatorOptions {
  std::vector<std::string> etcd;  // endpoints
  std::string fleet;
  std::string token;  // bearer token for the members (refitd --auth-tokens)
  // TLS to the members (refitd --tls-cert): the CA, and the name their
  // certificate carries when it is not the registered address's host.
  std::string tls_ca_file;
  std::string tls_server_name;
  // A client certificate for members that require one (refitd
  // --tls-client-ca), both or neither.
  std::string tls_cert_file;
  std::string tls_key_file;
  // TLS to etcd (server::EtcdClientOptions): its CA, and a client
  // certificate for an etcd that requires one.
  std::string etcd_ca_file;
  std::string etcd_cert_file;
  std::string etcd_key_file;
  std::string label;
  // Deadline of each member's prepare (the whole stream) and commit.
  absl::Duration timeout = absl::Minutes(30);
  // The fleet lock's lease.
  absl::Duration lock_ttl = absl::Seconds(10);
  // Decisions kept after a committed refit (the newest, this one
  // included); 0 keeps them all.
  int keep_decisions = 16;
  // Test hook: called at "sending" (a member's first bytes are on their
  // way), "prepared" (n members prepared), "decided" and "committed" (n
  // members committed), on the coordinator's threads, one call at a time.
  std::function<void(absl::string_view step, int n)> on_step;
};

struct FleetMemberInfo {
  std::string member_id;
  std::string address;
  int64_t tp_rank = 0;
  int64_t tp_size = 1;
  uint64_t version = 0;
  std::string fingerprint;
  uint64_t fleet_version = 0;
  bool ready = false;
  std::string not_ready_reason;
  double prepared_timeout_seconds = 0;  // its --fleet-prepared-timeout
};

struct FleetState {
  std::string fleet;
  uint64_t fleet_version = 0;  // 0: no fleet refit committed yet
  std::string last_fleet_refit_id;
  double last_flip_skew_seconds = 0;
  std::string lock;  // the running refit's coordinator, "" when none
  std::vector<FleetMemberInfo> members;
  // Every member ready at fleet_version (and at least one member).
  bool consistent = false;
};

struct FleetMemberResult {
  std::string member_id;
  std::string address;
  std::string refit_id;  // its local refit
  bool committed = false;
  uint64_t version = 0;
  std::string fingerprint;
  double commit_unix_seconds = 0;  // when its commit ended (its GetStatus)
  // How long its commit took (the copy into the live kernels: readers'
  // pause); its commit began commit_seconds before commit_unix_seconds.
  double commit_seconds = 0;
  std::string error;  // why it did not confirm its commit
};

struct FleetRefitResult {
  std::string fleet_refit_id;
  uint64_t fleet_version = 0;
  std::vector<FleetMemberResult> members;
  double flip_skew_seconds = 0;
  int decisions_deleted = 0;  // old decisions removed after the commit
  absl::Duration prepare_time;
  absl::Duration total_time;
};

class FleetCoordinator {
 public:
  // INVALID_ARGUMENT without a fleet name or endpoints.
  static absl::StatusOr<std::unique_ptr<FleetCoordinator>> Create(FleetCoordinatorOptions options);

  // Errors: UNAVAILABLE when etcd cannot be read.
  absl::StatusOr<FleetState> Status();

  // A fleet refit of the given safetensors files (each member gets them
  // all). Returns once the decision is commit and every member was told;
  // a member that did not confirm (it died after preparing) is listed
  // with its error, the others committed.
  // Errors: FAILED_PRECONDITION (no members); ABORTED (another refit holds
  // the lock, a prepare failed, or a member's deadline recorded abort
  // first: nobody committed, retry); UNAVAILABLE (etcd went away before a
  // decision: members abort at their prepared deadline).
  absl::StatusOr<FleetRefitResult> Push(const std::vector<std::string>& files);
  // The same with each member reading `path` under its --reload-root.
  absl::StatusOr<FleetRefitResult> Reload(const std::string& path);

 private:
  struct Member {
    FleetMemberInfo info;
  };
  using PrepareFn = std::function<absl::StatusOr<std::string>(const FleetMemberInfo& member,
                                                              const std::string& fleet_refit_id)>;
  FleetCoordinator(FleetCoordinatorOptions options, std::unique_ptr<server::EtcdClient> etcd);
  absl::StatusOr<FleetRefitResult> Run(const PrepareFn& prepare);
  void Step(absl::string_view step, int n);
  // Step 5. Returns how many decisions were deleted.
  int DeleteOldDecisions(const std::vector<FleetMemberInfo>& members);
  // How to reach a member.
  struct ClientOptions MemberClient(const std::string& address, absl::Duration timeout) const;

  const FleetCoordinatorOptions options_;
  const std::string prefix_;
  std::unique_ptr<server::EtcdClient> etcd_;
};

}  // namespace refit::client

#endif  // REFIT_CLIENT_FLEET_COORDINATOR_H_
