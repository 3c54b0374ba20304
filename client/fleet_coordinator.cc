#include "client/fleet_coordinator.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <random>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/refit_client.h"
#include "server/plain_names.h"

namespace refit::client {
namespace {

using json = nlohmann::json;

// Deadline of a member's Commit (and Abort) call.
constexpr absl::Duration kCommitTimeout = absl::Seconds(30);

json ParseOrEmpty(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  return j.is_discarded() || !j.is_object() ? json::object() : j;
}

std::string NewFleetRefitId() {
  std::random_device device;
  std::mt19937_64 rng((uint64_t{device()} << 32) ^ device() ^
                      static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
  return absl::StrCat("fleet-", absl::FormatTime("%Y%m%dT%H%M%S", absl::Now(), absl::UTCTimeZone()),
                      "-", absl::Hex(rng() & 0xffffffffffull, absl::kZeroPad10));
}

std::string CoordinatorName() {
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  return absl::StrCat(host, ":", ::getpid());
}

// Runs fn(i) for i in [0, n) on n threads and waits for them.
void ForEachParallel(size_t n, const std::function<void(size_t)>& fn) {
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (size_t i = 0; i < n; ++i) threads.emplace_back([&fn, i] { fn(i); });
  for (std::thread& t : threads) t.join();
}

}  // namespace

absl::StatusOr<std::unique_ptr<FleetCoordinator>> FleetCoordinator::Create(
    FleetCoordinatorOptions options) {
  if (options.fleet.empty()) return absl::InvalidArgumentError("--fleet is required");
  // The rule the daemons' --fleet follows: another name has no members.
  if (absl::Status s = server::ValidateFleetName("--fleet", "fleet name", options.fleet); !s.ok()) {
    return s;
  }
  server::EtcdClientOptions etcd_options;
  etcd_options.endpoints = options.etcd;
  etcd_options.tls_ca_file = options.etcd_ca_file;
  etcd_options.tls_cert_file = options.etcd_cert_file;
  etcd_options.tls_key_file = options.etcd_key_file;
  absl::StatusOr<std::unique_ptr<server::EtcdClient>> etcd =
      server::EtcdClient::Create(etcd_options);
  if (!etcd.ok()) return etcd.status();
  return std::unique_ptr<FleetCoordinator>(
      new FleetCoordinator(std::move(options), std::move(*etcd)));
}

FleetCoordinator::FleetCoordinator(FleetCoordinatorOptions options,
                                   std::unique_ptr<server::EtcdClient> etcd)
    : options_(std::move(options)),
      prefix_(absl::StrCat("/refitd/fleet/", options_.fleet, "/")),
      etcd_(std::move(etcd)) {}

ClientOptions FleetCoordinator::MemberClient(const std::string& address,
                                             absl::Duration timeout) const {
  ClientOptions client;
  client.address = address;
  client.token = options_.token;
  client.timeout = timeout;
  client.tls = !options_.tls_ca_file.empty() || !options_.tls_cert_file.empty();
  client.tls_ca_file = options_.tls_ca_file;
  client.tls_cert_file = options_.tls_cert_file;
  client.tls_key_file = options_.tls_key_file;
  client.tls_server_name = options_.tls_server_name;
  return client;
}

void FleetCoordinator::Step(absl::string_view step, int n) {
  if (options_.on_step) options_.on_step(step, n);
}

absl::StatusOr<FleetState> FleetCoordinator::Status() {
  FleetState state;
  state.fleet = options_.fleet;
  absl::StatusOr<std::vector<server::EtcdKeyValue>> members =
      etcd_->GetPrefix(prefix_ + "members/");
  if (!members.ok()) return members.status();
  for (const server::EtcdKeyValue& kv : *members) {
    const json m = ParseOrEmpty(kv.value);
    FleetMemberInfo info;
    info.member_id = m.value("member_id", kv.key.substr(kv.key.rfind('/') + 1));
    info.address = m.value("address", std::string());
    info.tp_rank = m.value("tp_rank", int64_t{0});
    info.tp_size = m.value("tp_size", int64_t{1});
    info.version = m.value("version", uint64_t{0});
    info.fingerprint = m.value("fingerprint", std::string());
    info.fleet_version = m.value("fleet_version", uint64_t{0});
    info.ready = m.value("ready", false);
    info.not_ready_reason = m.value("not_ready_reason", std::string());
    info.prepared_timeout_seconds = m.value("prepared_timeout_seconds", 0.0);
    state.members.push_back(std::move(info));
  }
  absl::StatusOr<std::optional<server::EtcdKeyValue>> version = etcd_->Get(prefix_ + "version");
  if (!version.ok()) return version.status();
  if (version->has_value()) {
    const json v = ParseOrEmpty((*version)->value);
    state.fleet_version = v.value("fleet_version", uint64_t{0});
    state.last_fleet_refit_id = v.value("fleet_refit_id", std::string());
    state.last_flip_skew_seconds = v.value("flip_skew_seconds", 0.0);
  }
  absl::StatusOr<std::optional<server::EtcdKeyValue>> lock = etcd_->Get(prefix_ + "lock");
  if (!lock.ok()) return lock.status();
  if (lock->has_value()) {
    const json l = ParseOrEmpty((*lock)->value);
    state.lock = absl::StrCat(l.value("fleet_refit_id", std::string()), " by ",
                              l.value("coordinator", std::string()));
  }
  state.consistent = !state.members.empty();
  for (const FleetMemberInfo& m : state.members) {
    state.consistent &= m.ready && m.fleet_version == state.fleet_version;
  }
  return state;
}

absl::StatusOr<FleetRefitResult> FleetCoordinator::Push(const std::vector<std::string>& files) {
  std::atomic<bool> sending{false};
  return Run([&](const FleetMemberInfo& member,
                 const std::string& fleet_refit_id) -> absl::StatusOr<std::string> {
    ClientOptions client = MemberClient(member.address, options_.timeout);
    absl::StatusOr<std::unique_ptr<RefitClient>> c = RefitClient::Create(client);
    if (!c.ok()) return c.status();
    PushOptions push;
    push.completion = v1::COMPLETION_MODE_PREPARE;
    push.require_complete = true;
    push.label = options_.label;
    push.fleet_refit_id = fleet_refit_id;
    push.on_progress = [&](const PushProgress&) {
      if (!sending.exchange(true)) Step("sending", 0);
    };
    absl::StatusOr<v1::RefitResult> r = (*c)->PushFiles(files, push);
    if (!r.ok()) return r.status();
    return r->refit_id();
  });
}

absl::StatusOr<FleetRefitResult> FleetCoordinator::Reload(const std::string& path) {
  return Run([&](const FleetMemberInfo& member,
                 const std::string& fleet_refit_id) -> absl::StatusOr<std::string> {
    ClientOptions client = MemberClient(member.address, options_.timeout);
    absl::StatusOr<std::unique_ptr<RefitClient>> c = RefitClient::Create(client);
    if (!c.ok()) return c.status();
    v1::ReloadRequest request;
    request.set_path(path);
    v1::RefitOptions* o = request.mutable_options();
    o->set_completion(v1::COMPLETION_MODE_PREPARE);
    o->set_non_finite(v1::NON_FINITE_POLICY_REJECT);
    o->set_require_complete(true);
    o->set_label(options_.label);
    o->set_fleet_refit_id(fleet_refit_id);
    absl::StatusOr<v1::RefitResult> r = (*c)->Reload(request);
    if (!r.ok()) return r.status();
    return r->refit_id();
  });
}

absl::StatusOr<FleetRefitResult> FleetCoordinator::Run(const PrepareFn& prepare) {
  const absl::Time start = absl::Now();
  absl::StatusOr<FleetState> state = Status();
  if (!state.ok()) return state.status();
  if (state->members.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("fleet ", options_.fleet, " has no members registered in etcd"));
  }
  FleetRefitResult result;
  result.fleet_refit_id = NewFleetRefitId();

  // 1. The lock: one fleet refit at a time.
  absl::StatusOr<int64_t> lease = etcd_->GrantLease(options_.lock_ttl);
  if (!lease.ok()) return lease.status();
  const json lock = {{"fleet_refit_id", result.fleet_refit_id},
                     {"coordinator", CoordinatorName()},
                     {"started_unix", absl::ToUnixSeconds(start)}};
  absl::StatusOr<server::EtcdClient::CasResult> locked =
      etcd_->PutIfAbsent(prefix_ + "lock", lock.dump(), *lease);
  if (!locked.ok() || !locked->written) {
    (void)etcd_->RevokeLease(*lease);
    if (!locked.ok()) return locked.status();
    const json holder =
        ParseOrEmpty(locked->existing.has_value() ? locked->existing->value : std::string());
    return absl::AbortedError(absl::StrCat("fleet ", options_.fleet, ": fleet refit ",
                                           holder.value("fleet_refit_id", std::string("?")), " by ",
                                           holder.value("coordinator", std::string("?")),
                                           " is in progress; retry once it has ended"));
  }
  std::atomic<bool> done{false};
  std::thread keepalive([&] {
    while (!done.load()) {
      for (absl::Duration slept; slept < options_.lock_ttl / 3 && !done.load();
           slept += absl::Milliseconds(50)) {
        absl::SleepFor(absl::Milliseconds(50));
      }
      if (!done.load()) (void)etcd_->KeepAlive(*lease);
    }
  });
  auto unlock = [&] {
    done.store(true);
    keepalive.join();
    (void)etcd_->RevokeLease(*lease);
  };
  // Members read again under the lock, and the fleet version the decision
  // moves on from.
  state = Status();
  if (!state.ok()) {
    unlock();
    return state.status();
  }
  absl::StatusOr<std::optional<server::EtcdKeyValue>> version = etcd_->Get(prefix_ + "version");
  if (!version.ok()) {
    unlock();
    return version.status();
  }
  const int64_t version_mod = version->has_value() ? (*version)->mod_revision : 0;
  result.fleet_version = state->fleet_version + 1;
  const std::vector<FleetMemberInfo>& members = state->members;
  result.members.resize(members.size());

  // 2. Prepare everywhere. Each member's commit client is made here and
  // connected once its prepare is done, so that step 4's calls go out at
  // once on warm connections instead of each dialling its member first.
  absl::Mutex mu;
  int prepared = 0;
  std::vector<absl::Status> errors(members.size());
  std::vector<std::unique_ptr<RefitClient>> commit_clients(members.size());
  ForEachParallel(members.size(), [&](size_t i) {
    FleetMemberResult& r = result.members[i];
    r.member_id = members[i].member_id;
    r.address = members[i].address;
    absl::StatusOr<std::unique_ptr<RefitClient>> commit_client =
        RefitClient::Create(MemberClient(members[i].address, kCommitTimeout));
    absl::StatusOr<std::string> refit_id = prepare(members[i], result.fleet_refit_id);
    if (refit_id.ok() && commit_client.ok()) {
      // Connects the channel (its answer is not needed); a failure here
      // shows again in the Commit call, which reports it.
      (void)(*commit_client)->GetStatus("");
      commit_clients[i] = *std::move(commit_client);
    }
    absl::MutexLock lock(&mu);
    if (!refit_id.ok()) {
      errors[i] = refit_id.status();
      r.error = std::string(refit_id.status().message());
      return;
    }
    r.refit_id = *refit_id;
    Step("prepared", ++prepared);
  });
  result.prepare_time = absl::Now() - start;
  const std::string decision_key = prefix_ + "decisions/" + result.fleet_refit_id;
  auto abort_all = [&](const std::string& why) {
    const json abort = {{"decision", "abort"},
                        {"by", CoordinatorName()},
                        {"why", why},
                        {"unix_seconds", absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch())}};
    (void)etcd_->PutIfAbsent(decision_key, abort.dump());
    ForEachParallel(members.size(), [&](size_t i) {
      if (result.members[i].refit_id.empty()) return;
      if (commit_clients[i] != nullptr) {
        (void)commit_clients[i]->Abort("", result.members[i].refit_id, why);
        return;
      }
      ClientOptions client = MemberClient(members[i].address, kCommitTimeout);
      absl::StatusOr<std::unique_ptr<RefitClient>> c = RefitClient::Create(client);
      if (c.ok()) (void)(*c)->Abort("", result.members[i].refit_id, why);
    });
  };
  std::vector<std::string> failed;
  for (size_t i = 0; i < members.size(); ++i) {
    if (!errors[i].ok()) {
      failed.push_back(absl::StrCat("member \"", members[i].member_id, "\" (", members[i].address,
                                    "): ", errors[i].ToString()));
    }
  }
  if (!failed.empty()) {
    const std::string why =
        absl::StrCat("prepare failed on ", failed.size(), " of ", members.size(), " members");
    abort_all(why);
    unlock();
    return absl::AbortedError(absl::StrCat("fleet refit ", result.fleet_refit_id, " aborted (", why,
                                           "): ", absl::StrJoin(failed, "; ")));
  }

  // 3. The decision, once.
  etcdserverpb::TxnRequest txn;
  etcdserverpb::Compare* absent = txn.add_compare();
  absent->set_result(etcdserverpb::Compare::EQUAL);
  absent->set_target(etcdserverpb::Compare::CREATE);
  absent->set_key(decision_key);
  absent->set_create_revision(0);
  etcdserverpb::Compare* unmoved = txn.add_compare();
  unmoved->set_result(etcdserverpb::Compare::EQUAL);
  unmoved->set_target(etcdserverpb::Compare::MOD);
  unmoved->set_key(prefix_ + "version");
  unmoved->set_mod_revision(version_mod);
  json member_ids = json::array();
  for (const FleetMemberInfo& m : members) member_ids.push_back(m.member_id);
  const json decision = {{"decision", "commit"},
                         {"fleet_version", result.fleet_version},
                         {"members", member_ids},
                         {"by", CoordinatorName()},
                         {"unix_seconds", absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch())}};
  json fleet_version = {{"fleet_version", result.fleet_version},
                        {"fleet_refit_id", result.fleet_refit_id}};
  etcdserverpb::PutRequest* put_decision = txn.add_success()->mutable_request_put();
  put_decision->set_key(decision_key);
  put_decision->set_value(decision.dump());
  etcdserverpb::PutRequest* put_version = txn.add_success()->mutable_request_put();
  put_version->set_key(prefix_ + "version");
  put_version->set_value(fleet_version.dump());
  txn.add_failure()->mutable_request_range()->set_key(decision_key);
  absl::StatusOr<etcdserverpb::TxnResponse> decided = etcd_->Txn(txn);
  if (!decided.ok()) {
    // Maybe applied, maybe not: only etcd knows. Abort RPCs are safe (each
    // member records abort only if no decision exists); members that cannot
    // reach etcd abort at their prepared deadline and stay NOT_SERVING
    // until etcd tells them the decision.
    abort_all("the coordinator could not record the decision");
    unlock();
    return absl::UnavailableError(
        absl::StrCat("fleet refit ", result.fleet_refit_id,
                     ": could not record the decision in etcd (", decided.status().message(),
                     "); members abort at their prepared deadline unless etcd recorded commit"));
  }
  if (!decided->succeeded()) {
    std::string existing = "none";
    if (decided->responses_size() > 0 && decided->responses(0).response_range().kvs_size() > 0) {
      existing = ParseOrEmpty(decided->responses(0).response_range().kvs(0).value())
                     .value("decision", std::string("?"));
    }
    abort_all("the fleet decided otherwise first");
    unlock();
    return absl::AbortedError(absl::StrCat(
        "fleet refit ", result.fleet_refit_id, " aborted: ",
        existing == "none" ? "the fleet's version moved on meanwhile"
                           : absl::StrCat("decision already recorded: ", existing,
                                          " (a member's prepared deadline passed first)")));
  }
  Step("decided", 0);

  // 4. Commit everywhere.
  int committed = 0;
  ForEachParallel(members.size(), [&](size_t i) {
    FleetMemberResult& r = result.members[i];
    absl::StatusOr<std::unique_ptr<RefitClient>> c = std::move(commit_clients[i]);
    if (*c == nullptr) c = RefitClient::Create(MemberClient(members[i].address, kCommitTimeout));
    absl::Status status = c.status();
    if (c.ok()) {
      absl::StatusOr<v1::RefitResult> commit = (*c)->Commit("", r.refit_id);
      status = commit.status();
      if (commit.ok()) {
        r.committed = true;
        r.version = commit->version();
        r.fingerprint = commit->fingerprint();
        r.commit_seconds = commit->timings().commit_seconds();
        absl::StatusOr<v1::GetStatusResponse> s = (*c)->GetStatus("");
        if (s.ok()) r.commit_unix_seconds = s->last_commit_unix_seconds();
      }
    }
    absl::MutexLock lock(&mu);
    if (!status.ok()) {
      r.error = status.ToString();
      return;
    }
    Step("committed", ++committed);
  });
  double first = 0, last = 0;
  for (const FleetMemberResult& r : result.members) {
    if (!r.committed || r.commit_unix_seconds <= 0) continue;
    first = first == 0 ? r.commit_unix_seconds : std::min(first, r.commit_unix_seconds);
    last = std::max(last, r.commit_unix_seconds);
  }
  result.flip_skew_seconds = last - first;
  fleet_version["flip_skew_seconds"] = result.flip_skew_seconds;
  (void)etcd_->Put(prefix_ + "version", fleet_version.dump());
  result.decisions_deleted = DeleteOldDecisions(members);
  unlock();
  result.total_time = absl::Now() - start;
  return result;
}

int FleetCoordinator::DeleteOldDecisions(const std::vector<FleetMemberInfo>& members) {
  if (options_.keep_decisions <= 0) return 0;
  // Older than every member's prepared timeout (30 s, refitd's default,
  // for a member that does not publish it).
  double oldest_deadline = 0;
  for (const FleetMemberInfo& m : members) {
    oldest_deadline = std::max(oldest_deadline,
                               m.prepared_timeout_seconds > 0 ? m.prepared_timeout_seconds : 30.0);
  }
  absl::StatusOr<std::vector<server::EtcdKeyValue>> decisions =
      etcd_->GetPrefix(prefix_ + "decisions/");
  if (!decisions.ok()) return 0;  // the next committed refit tries again
  std::vector<server::EtcdKeyValue> by_age = *decisions;
  std::sort(by_age.begin(), by_age.end(),
            [](const server::EtcdKeyValue& a, const server::EtcdKeyValue& b) {
              return a.create_revision > b.create_revision;  // newest first
            });
  const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  int deleted = 0;
  for (size_t i = static_cast<size_t>(options_.keep_decisions); i < by_age.size(); ++i) {
    const double written = ParseOrEmpty(by_age[i].value).value("unix_seconds", 0.0);
    if (written > 0 && now - written <= oldest_deadline) continue;
    absl::StatusOr<int64_t> n = etcd_->Delete(by_age[i].key);
    if (n.ok()) deleted += static_cast<int>(*n);
  }
  return deleted;
}

}  // namespace refit::client
