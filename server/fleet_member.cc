#include "server/fleet_member.h"

#include <unistd.h>

#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/log.h"
#include "core/model_layout.h"
#include "server/metrics.h"
#include "server/plain_names.h"
#include "server/refit_server.h"

namespace refit::server {
namespace {

using json = nlohmann::json;

constexpr absl::Duration kTick = absl::Milliseconds(50);
constexpr absl::Duration kRecomputeEvery = absl::Seconds(1);
constexpr size_t kRecentCommits = 16;

json ParseOrEmpty(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  return j.is_discarded() ? json::object() : j;
}

// FNV-1a: a digest that is the same in every build (std::hash is not).
uint64_t Fnv1a(absl::string_view text, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// <hostname>-r<tp rank>, the hostname's characters outside the fleet-name
// rule replaced by '-' and cut to fit it.
std::string DefaultMemberId(int64_t tp_rank) {
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  std::string name = host[0] != '\0' ? host : "refitd";
  for (char& c : name) {
    if (!IsPlainNameChar(c)) c = '-';
  }
  const std::string suffix = absl::StrCat("-r", tp_rank);
  if (name.size() + suffix.size() > kMaxFleetNameBytes) {
    name.resize(kMaxFleetNameBytes - suffix.size());
  }
  return name + suffix;
}

}  // namespace

std::string FleetPrefix(absl::string_view fleet) {
  return absl::StrCat("/refitd/fleet/", fleet, "/");
}

absl::StatusOr<std::unique_ptr<FleetMember>> FleetMember::Start(
    FleetOptions options, ModelGroup* group, Metrics* metrics,
    std::function<void(bool ready)> set_ready) {
  if (absl::Status s = ValidateFleetName("--fleet", "fleet name", options.fleet); !s.ok()) {
    return s;
  }
  if (options.member_id.empty()) {
    options.member_id = DefaultMemberId(group->store()->layout().parallel().tp_rank);
  }
  if (absl::Status s = ValidateFleetName("--fleet-member", "member id", options.member_id);
      !s.ok()) {
    return s;
  }
  EtcdClientOptions etcd_options;
  etcd_options.endpoints = options.etcd_endpoints;
  etcd_options.timeout = options.etcd_timeout;
  etcd_options.tls_ca_file = options.etcd_ca_file;
  etcd_options.tls_cert_file = options.etcd_cert_file;
  etcd_options.tls_key_file = options.etcd_key_file;
  absl::StatusOr<std::unique_ptr<EtcdClient>> etcd = EtcdClient::Create(etcd_options);
  if (!etcd.ok()) return etcd.status();
  std::unique_ptr<FleetMember> member(
      new FleetMember(std::move(options), group, metrics, std::move(set_ready), std::move(*etcd)));
  if (absl::Status s = member->Join(); !s.ok()) return s;
  member->loop_ = std::thread([m = member.get()] { m->Loop(); });
  member->keeper_ = std::thread([m = member.get()] { m->KeepLease(); });
  return member;
}

FleetMember::FleetMember(FleetOptions options, ModelGroup* group, Metrics* metrics,
                         std::function<void(bool)> set_ready, std::unique_ptr<EtcdClient> etcd)
    : options_(std::move(options)),
      prefix_(FleetPrefix(options_.fleet)),
      group_(group),
      metrics_(metrics),
      set_ready_(std::move(set_ready)),
      etcd_(std::move(etcd)) {
  status_.fleet = options_.fleet;
  status_.member_id = options_.member_id;
  status_.not_ready_reason = "joining the fleet";
}

FleetMember::~FleetMember() { Stop(); }

void FleetMember::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    wake_ = true;
  }
  if (loop_.joinable()) loop_.join();
  if (keeper_.joinable()) keeper_.join();
  watch_.reset();
  int64_t lease = 0;
  {
    absl::MutexLock lock(&mu_);
    lease = lease_;  // the keeper may have registered again
  }
  // The registration goes now, not at the lease's expiry.
  if (lease != 0) (void)etcd_->RevokeLease(lease);
}

std::string FleetMember::LayoutJson() const {
  const core::ModelLayout& layout = group_->store()->layout();
  uint64_t digest = Fnv1a("");
  for (const core::CheckpointTensor& t : layout.checkpoint_tensors()) {
    digest = Fnv1a(t.name, digest);
    for (int64_t d : t.shape) digest = Fnv1a(absl::StrCat(",", d), digest);
    digest = Fnv1a(core::DTypeName(t.dtype), digest);
  }
  json j;
  j["architecture"] = layout.config().arch_name;
  j["num_layers"] = layout.config().num_layers;
  j["hidden_size"] = layout.config().hidden_size;
  j["vocab_size"] = layout.config().vocab_size;
  j["checkpoint_dtype"] = std::string(core::DTypeName(layout.config().dtype));
  j["quantization"] = std::string(core::QuantSchemeName(layout.quant()));
  j["tp_size"] = layout.parallel().tp_size;
  j["tp_rank"] = layout.parallel().tp_rank;
  j["num_kernel_tensors"] = layout.num_kernels();
  j["kernel_bytes"] = layout.kernel_bytes();
  j["checkpoint_digest"] = absl::StrCat(absl::Hex(digest, absl::kZeroPad16));
  return j.dump();
}

std::string FleetMember::RegistrationJson() const {
  const core::LiveVersion live = group_->store()->live_version();
  FleetStatus status;
  bool ready;
  {
    absl::MutexLock lock(&mu_);
    status = status_;
    ready = ready_;
  }
  json j;
  j["member_id"] = options_.member_id;
  j["address"] = options_.address;
  j["groups"] = json::array({group_->name()});
  j["tp_rank"] = group_->store()->layout().parallel().tp_rank;
  j["tp_size"] = group_->store()->layout().parallel().tp_size;
  j["layout"] = ParseOrEmpty(LayoutJson());
  j["version"] = live.version;
  j["fingerprint"] = live.fingerprint;
  j["fleet_version"] = status.fleet_version;
  j["consistent"] = status.consistent;
  j["ready"] = ready;
  j["not_ready_reason"] = status.not_ready_reason;
  j["pid"] = static_cast<int64_t>(::getpid());
  // A coordinator deletes a decision only once it is older than every
  // member's prepared timeout.
  j["prepared_timeout_seconds"] = absl::ToDoubleSeconds(options_.prepared_timeout);
  return j.dump();
}

absl::Status FleetMember::Join() {
  absl::StatusOr<std::vector<EtcdKeyValue>> members = etcd_->GetPrefix(prefix_ + "members/");
  if (!members.ok()) {
    return absl::UnavailableError(
        absl::StrCat("fleet ", options_.fleet,
                     ": cannot read the members from etcd: ", members.status().message()));
  }
  const json mine = ParseOrEmpty(LayoutJson());
  // Every member of the fleet agrees on these; members of the same rank on
  // the whole layout.
  static const char* const kFleetWide[] = {"architecture", "num_layers",       "hidden_size",
                                           "vocab_size",   "checkpoint_dtype", "quantization",
                                           "tp_size"};
  for (const EtcdKeyValue& kv : *members) {
    const json other = ParseOrEmpty(kv.value);
    const std::string id = other.value("member_id", std::string());
    if (id == options_.member_id) continue;  // our own, from before a restart
    const json& layout = other.contains("layout") ? other["layout"] : json::object();
    const bool same_rank =
        layout.value("tp_rank", int64_t{-1}) == mine.value("tp_rank", int64_t{-2});
    std::vector<std::string> differ;
    for (auto it = mine.begin(); it != mine.end(); ++it) {
      const std::string& field = it.key();
      bool fleet_wide = false;
      for (const char* f : kFleetWide) fleet_wide |= field == f;
      if (!fleet_wide && (!same_rank || field == "tp_rank")) continue;
      const json theirs = layout.contains(field) ? layout[field] : json();
      if (theirs != it.value()) {
        differ.push_back(absl::StrCat(field, " ", it.value().dump(), " here, ", theirs.dump(),
                                      " on member \"", id, "\""));
      }
    }
    if (!differ.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("fleet ", options_.fleet, ": this daemon's layout differs from member \"",
                       id, "\" (tp rank ", layout.value("tp_rank", int64_t{-1}),
                       "): ", absl::StrJoin(differ, "; ")));
    }
  }
  Recompute();
  if (absl::Status s = Register(); !s.ok()) return s;
  StartWatch();
  return absl::OkStatus();
}

absl::Status FleetMember::Register() {
  absl::StatusOr<int64_t> lease = etcd_->GrantLease(options_.lease_ttl);
  if (!lease.ok()) return lease.status();
  {
    absl::MutexLock lock(&mu_);
    lease_ = *lease;
  }
  return WriteRegistration(/*only_if_changed=*/false);
}

absl::Status FleetMember::WriteRegistration(bool only_if_changed) {
  // One writer at a time, each writing what is current once it writes: the
  // loop's update and the keeper's re-registration never leave an older
  // registration in etcd after a newer one.
  absl::MutexLock lock(&registration_mu_);
  const std::string registration = RegistrationJson();
  if (only_if_changed && registration == last_registration_) return absl::OkStatus();
  int64_t lease;
  {
    absl::MutexLock state(&mu_);
    lease = lease_;
  }
  absl::StatusOr<int64_t> put =
      etcd_->Put(prefix_ + "members/" + options_.member_id, registration, lease);
  if (!put.ok()) {
    last_registration_.clear();  // written again at the next chance
    return put.status();
  }
  last_registration_ = registration;
  return absl::OkStatus();
}

void FleetMember::Wake() {
  absl::MutexLock lock(&mu_);
  wake_ = true;
}

void FleetMember::StartWatch() {
  int64_t from;
  {
    absl::MutexLock lock(&mu_);
    from = watch_revision_ > 0 ? watch_revision_ + 1 : 0;
  }
  absl::StatusOr<std::unique_ptr<EtcdClient::Watch>> watch = etcd_->WatchPrefix(
      prefix_, from,
      [this](const std::vector<EtcdClient::WatchEvent>& events, int64_t revision) {
        OnWatchEvents(events, revision);
      },
      [this](const absl::Status&) { Wake(); });
  if (!watch.ok()) return;
  watch_ = std::move(*watch);
  // Whatever was decided while no watch ran is read once.
  absl::MutexLock lock(&mu_);
  for (auto& [id, prepared] : prepared_) prepared.check = true;
  recompute_ = true;
}

void FleetMember::OnWatchEvents(const std::vector<EtcdClient::WatchEvent>& events,
                                int64_t revision) {
  const std::string decisions = prefix_ + "decisions/";
  for (const EtcdClient::WatchEvent& event : events) {
    if (event.deleted) continue;
    if (event.kv.key.compare(0, decisions.size(), decisions) == 0) {
      Apply(event.kv.key.substr(decisions.size()), ParseDecision(event.kv.value));
    } else if (event.kv.key == prefix_ + "version") {
      absl::MutexLock lock(&mu_);
      recompute_ = true;
      wake_ = true;
    }
  }
  absl::MutexLock lock(&mu_);
  watch_revision_ = std::max(watch_revision_, revision);
  revision_seen_ = std::max(revision_seen_, revision);
}

FleetMember::Decision FleetMember::ParseDecision(const std::string& value) {
  Decision d;
  const json j = ParseOrEmpty(value);
  if (j.is_object()) {
    d.decision = j.value("decision", std::string());
    d.fleet_version = j.value("fleet_version", uint64_t{0});
  } else {
    d.decision = value;
  }
  if (d.decision != "commit" && d.decision != "abort") d.decision.clear();
  return d;
}

absl::StatusOr<FleetMember::Decision> FleetMember::ReadDecision(const std::string& fleet_refit_id) {
  absl::StatusOr<std::optional<EtcdKeyValue>> kv =
      etcd_->Get(prefix_ + "decisions/" + fleet_refit_id);
  if (!kv.ok()) return kv.status();
  if (!kv->has_value()) return Decision();
  return ParseDecision((*kv)->value);
}

void FleetMember::Apply(const std::string& fleet_refit_id, const Decision& decision,
                        bool only_if_undecided) {
  if (decision.decision.empty()) return;
  std::string refit_id;
  Prepared prepared;
  {
    absl::MutexLock lock(&mu_);
    auto it = prepared_.find(fleet_refit_id);
    if (it == prepared_.end()) return;
    if (only_if_undecided && it->second.decided.has_value()) return;
    prepared = it->second;
    refit_id = prepared.refit_id;
    prepared_.erase(it);
    applying_.insert(refit_id);
  }
  // A commit that could not happen yet (a Commit RPC holds the refit, or
  // the attached engines did not quiesce and the refit stays PREPARED) is
  // tried again from the loop's next tick, until the refit commits or its
  // own --prepared-timeout ends it: the decision is known, so the fleet's
  // prepared deadline no longer applies and etcd is not asked again.
  auto try_again = [&] {
    absl::MutexLock lock(&mu_);
    prepared.decided = decision;
    prepared_.emplace(fleet_refit_id, prepared);
  };
  // A Commit RPC that arrives meanwhile waits for this (RecentCommit).
  struct Done {
    FleetMember* self;
    std::string id;
    ~Done() {
      absl::MutexLock lock(&self->mu_);
      self->applying_.erase(id);
    }
  } done{this, refit_id};
  // The Commit or Abort RPC may have taken it first.
  const bool commit = decision.decision != "abort";
  absl::StatusOr<RefitEntry> entry =
      commit ? group_->TakePreparedToCommit(refit_id) : group_->TakePrepared(refit_id);
  if (!entry.ok()) {
    if (commit && absl::IsFailedPrecondition(entry.status())) try_again();
    return;
  }
  struct EndCommit {
    ModelGroup* group;
    const std::string& id;
    bool commit;
    ~EndCommit() {
      if (commit) group->EndCommit(id);
    }
  } end_commit{group_, refit_id, commit};
  if (!commit) {
    entry->session->Abort(absl::StrCat("fleet refit \"", fleet_refit_id, "\" was decided: abort"));
    metrics_->RecordOutcome("aborted");
    REFIT_LOG(INFO).Field("refit_id", refit_id).Field("fleet_refit_id", fleet_refit_id)
        << "fleet decision abort: prepared refit aborted";
    return;
  }
  absl::StatusOr<core::RefitResult> result = entry->session->Commit();
  if (!result.ok() && entry->session->state() == core::SessionState::kPrepared) {
    REFIT_LOG(WARNING).Field("refit_id", refit_id).Field("fleet_refit_id", fleet_refit_id)
        << "fleet decision commit: not done yet, still prepared, trying again: "
        << std::string(result.status().message());
    group_->Add(*std::move(entry), nullptr);
    try_again();
    return;
  }
  if (!result.ok()) {
    metrics_->RecordOutcome("failed");
    REFIT_LOG(ERROR).Field("refit_id", refit_id).Field("fleet_refit_id", fleet_refit_id)
        << "fleet decision commit: the commit failed: " << std::string(result.status().message());
    absl::MutexLock lock(&mu_);
    recompute_ = true;
    return;
  }
  metrics_->RecordOutcome("committed");
  metrics_->RecordCommitted(result->timings);
  REFIT_LOG(INFO)
          .Field("refit_id", refit_id)
          .Field("fleet_refit_id", fleet_refit_id)
          .Field("version", absl::StrCat(result->version))
          .Field("fleet_version", absl::StrCat(decision.fleet_version))
      << "fleet decision commit: prepared refit committed";
  OnCommitted(fleet_refit_id, decision.fleet_version, *result);
}

void FleetMember::OnPrepared(const std::string& refit_id, const std::string& fleet_refit_id) {
  absl::MutexLock lock(&mu_);
  Prepared& p = prepared_[fleet_refit_id];
  p.refit_id = refit_id;
  p.deadline = absl::Now() + options_.prepared_timeout;
  p.check = true;
  p.revision = revision_seen_;
  wake_ = true;
}

absl::StatusOr<uint64_t> FleetMember::CheckCommit(const std::string& fleet_refit_id) {
  absl::StatusOr<Decision> d = ReadDecision(fleet_refit_id);
  if (!d.ok()) {
    return absl::UnavailableError(
        absl::StrCat("fleet refit \"", fleet_refit_id,
                     "\": cannot read its decision from etcd: ", d.status().message()));
  }
  if (d->decision != "commit") {
    return absl::FailedPreconditionError(absl::StrCat(
        "fleet refit \"", fleet_refit_id, "\" is ",
        d->decision.empty() ? "not decided (or its decision was deleted)" : "decided abort",
        ": a member commits only once etcd records commit"));
  }
  {
    absl::MutexLock lock(&mu_);
    prepared_.erase(fleet_refit_id);
  }
  return d->fleet_version;
}

absl::Status FleetMember::RecordAbort(const std::string& fleet_refit_id) {
  int64_t revision;
  {
    absl::MutexLock lock(&mu_);
    auto it = prepared_.find(fleet_refit_id);
    revision = it != prepared_.end() ? it->second.revision : revision_seen_;
  }
  bool written = false;
  absl::StatusOr<Decision> d =
      RecordAbortIfUndecided(fleet_refit_id, revision, /*presumed=*/false, &written);
  if (!d.ok()) {
    return absl::UnavailableError(
        absl::StrCat("fleet refit \"", fleet_refit_id,
                     "\": cannot record abort in etcd: ", d.status().message()));
  }
  if (d->decision == "commit") {
    return absl::FailedPreconditionError(absl::StrCat(
        "fleet refit \"", fleet_refit_id, "\" is decided commit: it cannot be aborted"));
  }
  if (d->decision.empty()) {
    // Its decision was deleted after the fleet moved on: aborting here is
    // safe (never a commit on a guess); nothing is recorded.
    REFIT_LOG(WARNING).Field("fleet_refit_id", fleet_refit_id)
        << "fleet refit's decision is no longer in etcd and the fleet's version moved on; "
           "aborting here without recording a decision";
  }
  absl::MutexLock lock(&mu_);
  prepared_.erase(fleet_refit_id);
  return absl::OkStatus();
}

absl::StatusOr<FleetMember::Decision> FleetMember::RecordAbortIfUndecided(
    const std::string& fleet_refit_id, int64_t revision, bool presumed, bool* written) {
  *written = false;
  const std::string key = prefix_ + "decisions/" + fleet_refit_id;
  json abort = {{"decision", "abort"},
                {"by", options_.member_id},
                {"unix_seconds", absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch())}};
  if (presumed) abort["presumed"] = true;
  etcdserverpb::TxnRequest txn;
  etcdserverpb::Compare* absent = txn.add_compare();
  absent->set_result(etcdserverpb::Compare::EQUAL);
  absent->set_target(etcdserverpb::Compare::CREATE);
  absent->set_key(key);
  absent->set_create_revision(0);
  // A commit writes the version key with its decision: a version key
  // modified after `revision` means the refit may have been committed (and
  // its decision since deleted).
  etcdserverpb::Compare* unmoved = txn.add_compare();
  unmoved->set_result(etcdserverpb::Compare::LESS);
  unmoved->set_target(etcdserverpb::Compare::MOD);
  unmoved->set_key(prefix_ + "version");
  unmoved->set_mod_revision(revision + 1);
  etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(abort.dump());
  txn.add_failure()->mutable_request_range()->set_key(key);
  absl::StatusOr<etcdserverpb::TxnResponse> response = etcd_->Txn(txn);
  if (!response.ok()) return response.status();
  Decision d;
  if (response->succeeded()) {
    *written = true;
    d.decision = "abort";
    return d;
  }
  if (response->responses_size() > 0 && response->responses(0).response_range().kvs_size() > 0) {
    d = ParseDecision(response->responses(0).response_range().kvs(0).value());
  }
  return d;
}

void FleetMember::OnCommitted(const std::string& fleet_refit_id, uint64_t fleet_version,
                              const core::RefitResult& result) {
  {
    absl::MutexLock lock(&mu_);
    prepared_.erase(fleet_refit_id);
    recent_.push_back(result);
    while (recent_.size() > kRecentCommits) recent_.pop_front();
    pending_served_ = std::make_pair(fleet_version, result);
    recompute_ = true;
    wake_ = true;
  }
}

std::optional<core::RefitResult> FleetMember::RecentCommit(const std::string& refit_id) const {
  absl::MutexLock lock(&mu_);
  // The decision's own commit of it may be running.
  auto applied = [this, &refit_id]()
                     ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return applying_.count(refit_id) == 0; };
  mu_.AwaitWithTimeout(absl::Condition(&applied), absl::Seconds(30));
  for (const core::RefitResult& r : recent_) {
    if (r.refit_id == refit_id) return r;
  }
  return std::nullopt;
}

void FleetMember::WriteServed(uint64_t fleet_version, uint64_t version,
                              const std::string& fingerprint) {
  json served = {{"fleet_version", fleet_version},
                 {"version", version},
                 {"fingerprint", fingerprint},
                 {"tp_rank", group_->store()->layout().parallel().tp_rank}};
  (void)etcd_->Put(prefix_ + "served/" + options_.member_id, served.dump());
}

void FleetMember::PresumeAbort(const std::string& fleet_refit_id, int64_t revision) {
  {
    // Its commit decision was read meanwhile (the watch applied it and the
    // commit is being tried again): nothing to presume.
    absl::MutexLock lock(&mu_);
    auto it = prepared_.find(fleet_refit_id);
    if (it == prepared_.end() || it->second.decided.has_value()) return;
  }
  bool written = false;
  absl::StatusOr<Decision> cas =
      RecordAbortIfUndecided(fleet_refit_id, revision, /*presumed=*/true, &written);
  if (cas.ok()) {
    Decision d = *cas;
    if (d.decision.empty()) {
      // The decision key is gone and the fleet moved on: the refit may
      // have been committed elsewhere. Abort, never commit on a guess;
      // readiness then compares this member's version with the fleet's.
      REFIT_LOG(WARNING).Field("fleet_refit_id", fleet_refit_id)
          << "fleet prepared deadline passed; its decision is no longer in etcd and the fleet's "
             "version moved on: aborting here without recording a decision";
      d.decision = "abort";
      absl::MutexLock lock(&mu_);
      recompute_ = true;
    } else {
      REFIT_LOG(WARNING)
              .Field("fleet_refit_id", fleet_refit_id)
              .Field("decision", d.decision)
              .Field("written_here", written ? "yes" : "no")
          << "fleet prepared deadline passed with no decision; following the recorded decision";
    }
    // A presumed abort yields to a commit decision read meanwhile.
    Apply(fleet_refit_id, d, /*only_if_undecided=*/d.decision == "abort");
    return;
  }
  // etcd cannot take the abort: abort here anyway (nothing may stay
  // prepared forever), and stay NOT_SERVING until etcd tells what was
  // decided; a commit recorded before etcd went away makes this member
  // behind the fleet.
  REFIT_LOG(WARNING).Field("fleet_refit_id", fleet_refit_id)
      << "fleet prepared deadline passed and etcd is unreachable (" << cas.status().ToString()
      << "); aborting here, NOT_SERVING until etcd records the decision";
  {
    absl::MutexLock lock(&mu_);
    auto it = prepared_.find(fleet_refit_id);
    if (it != prepared_.end() && it->second.decided.has_value()) return;  // a commit, read
    unresolved_[fleet_refit_id] = revision;
    recompute_ = true;
  }
  Decision d;
  d.decision = "abort";
  Apply(fleet_refit_id, d, /*only_if_undecided=*/true);
}

void FleetMember::Recompute() {
  // Fleet refits aborted here while etcd was away: learn their decision.
  std::map<std::string, int64_t> unresolved;
  {
    absl::MutexLock lock(&mu_);
    unresolved = unresolved_;
  }
  for (const auto& [id, revision] : unresolved) {
    bool written = false;
    absl::StatusOr<Decision> cas =
        RecordAbortIfUndecided(id, revision, /*presumed=*/true, &written);
    if (!cas.ok()) {
      // Still unreachable: NOT_SERVING until etcd says what was decided.
      bool changed;
      {
        absl::MutexLock lock(&mu_);
        changed = status_.consistent || !ready_told_;
        status_.consistent = false;
        status_.not_ready_reason = absl::StrCat(
            "fleet refit \"", id,
            "\" was aborted here at its prepared deadline while etcd was unreachable; waiting for "
            "etcd to record its decision");
        ready_ = false;
        ready_told_ = true;
      }
      if (changed) {
        REFIT_LOG(WARNING).Field("fleet", options_.fleet).Field("member", options_.member_id)
            << "NOT_SERVING: etcd is unreachable and fleet refit " << id << " is undecided";
        set_ready_(false);
      }
      return;
    }
    absl::MutexLock lock(&mu_);
    unresolved_.erase(id);
  }
  std::optional<std::pair<uint64_t, core::RefitResult>> pending;
  {
    absl::MutexLock lock(&mu_);
    pending = pending_served_;
  }
  if (pending.has_value()) {
    json served = {{"fleet_version", pending->first},
                   {"version", pending->second.version},
                   {"fingerprint", pending->second.fingerprint},
                   {"tp_rank", group_->store()->layout().parallel().tp_rank}};
    if (!etcd_->Put(prefix_ + "served/" + options_.member_id, served.dump()).ok()) return;
    absl::MutexLock lock(&mu_);
    if (pending_served_.has_value() &&
        pending_served_->second.refit_id == pending->second.refit_id) {
      pending_served_.reset();
    }
  }
  absl::StatusOr<std::optional<EtcdKeyValue>> version = etcd_->Get(prefix_ + "version");
  if (!version.ok()) return;
  if (version->has_value()) {
    absl::MutexLock lock(&mu_);
    revision_seen_ = std::max(revision_seen_, (*version)->mod_revision);
  }
  absl::StatusOr<std::optional<EtcdKeyValue>> served =
      etcd_->Get(prefix_ + "served/" + options_.member_id);
  if (!served.ok()) return;
  const core::LiveVersion live = group_->store()->live_version();
  const int64_t rank = group_->store()->layout().parallel().tp_rank;
  uint64_t fleet_version = 0;
  double skew = 0;
  if (version->has_value()) {
    json v = ParseOrEmpty((*version)->value);
    fleet_version = v.value("fleet_version", uint64_t{0});
    skew = v.value("flip_skew_seconds", 0.0);
  }
  // The fleet version this member serves: its own record when it still
  // serves what it recorded; else a peer of its rank at the fleet's version
  // with the same bytes (a Reload of the right checkpoint, a snapshot).
  std::optional<uint64_t> mine;
  if (served->has_value()) {
    json s = ParseOrEmpty((*served)->value);
    if (s.value("version", uint64_t{0}) == live.version &&
        s.value("fingerprint", std::string()) == live.fingerprint) {
      mine = s.value("fleet_version", uint64_t{0});
    }
  }
  if (!mine.has_value() && fleet_version == 0) mine = 0;
  if ((!mine.has_value() || *mine != fleet_version) && fleet_version > 0) {
    absl::StatusOr<std::vector<EtcdKeyValue>> peers = etcd_->GetPrefix(prefix_ + "served/");
    if (!peers.ok()) return;
    for (const EtcdKeyValue& kv : *peers) {
      json p = ParseOrEmpty(kv.value);
      if (p.value("fleet_version", uint64_t{0}) == fleet_version &&
          p.value("tp_rank", int64_t{-1}) == rank &&
          p.value("fingerprint", std::string()) == live.fingerprint) {
        mine = fleet_version;
        WriteServed(fleet_version, live.version, live.fingerprint);
        break;
      }
    }
  }
  FleetStatus status;
  status.fleet = options_.fleet;
  status.member_id = options_.member_id;
  status.fleet_version = fleet_version;
  status.consistent = mine.has_value() && *mine == fleet_version;
  if (!status.consistent) {
    status.not_ready_reason =
        mine.has_value()
            ? absl::StrCat("behind the fleet at version ", *mine, ", fleet at ", fleet_version)
            : absl::StrCat("behind the fleet at version unknown (serves daemon version ",
                           live.version, ", fingerprint ", live.fingerprint,
                           ", which no fleet version records), fleet at ", fleet_version);
  }
  bool changed = false;
  bool ready = false;
  {
    absl::MutexLock lock(&mu_);
    if (!unresolved_.empty() && status.consistent) {
      status.consistent = false;
      status.not_ready_reason = absl::StrCat(
          "fleet refit \"", unresolved_.begin()->first,
          "\" was aborted here at its prepared deadline while etcd was unreachable; waiting for "
          "etcd to record its decision");
    }
    changed = status.consistent != status_.consistent ||
              status.fleet_version != status_.fleet_version ||
              status.not_ready_reason != status_.not_ready_reason || !ready_told_;
    status_ = status;
    ready = status.consistent;
    ready_ = ready;
    ready_told_ = true;
    last_skew_seconds_ = skew;
  }
  metrics_->SetFleetText(RenderMetrics());
  if (changed) {
    if (!status.consistent) {
      REFIT_LOG(WARNING).Field("fleet", options_.fleet).Field("member", options_.member_id)
          << "NOT_SERVING: " << status.not_ready_reason;
    }
    set_ready_(ready);
  }
}

// The lease has a thread of its own: the loop may wait on engines for a
// decided commit (up to --engine-quiesce-timeout per try, tick after tick),
// and a keep-alive behind that could let the registration expire.
void FleetMember::KeepLease() {
  absl::Time next = absl::Now() + options_.lease_ttl / 3;
  for (;;) {
    int64_t lease;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithDeadline(absl::Condition(&stopping_), next);
      if (stopping_) return;
      lease = lease_;
    }
    absl::StatusOr<absl::Duration> ttl = etcd_->KeepAlive(lease);
    if (ttl.ok()) {
      // Nothing else here: the loop writes the registration's changes (a
      // write could wait behind a commit's copy, and the lease with it).
      next = absl::Now() + options_.lease_ttl / 3;
    } else if (ttl.status().code() == absl::StatusCode::kNotFound) {
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return;  // Stop revokes the lease: no new one
      }
      REFIT_LOG(WARNING).Field("fleet", options_.fleet)
          << "the fleet registration's lease expired; registering again";
      next = Register().ok() ? absl::Now() + options_.lease_ttl / 3 : absl::Now() + kTick * 4;
    } else {
      next = absl::Now() + kTick * 4;  // etcd away: try again soon
    }
  }
}

void FleetMember::Loop() {
  absl::Time next_recompute = absl::Now();
  for (;;) {
    std::vector<std::string> check;
    std::vector<std::pair<std::string, Decision>> retry;
    std::vector<std::pair<std::string, int64_t>> expired;
    bool recompute = false;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&wake_), kTick);
      wake_ = false;
      if (stopping_) return;
      const absl::Time now = absl::Now();
      for (auto& [id, p] : prepared_) {
        if (p.decided.has_value()) {
          retry.emplace_back(id, *p.decided);
        } else if (p.deadline <= now) {
          expired.emplace_back(id, p.revision);
        } else if (p.check) {
          check.push_back(id);
          p.check = false;
        }
      }
      recompute = recompute_ || now >= next_recompute;
      recompute_ = false;
    }
    for (const std::string& id : check) {
      absl::StatusOr<Decision> d = ReadDecision(id);
      if (d.ok()) {
        Apply(id, *d);
      } else {
        absl::MutexLock lock(&mu_);
        auto it = prepared_.find(id);
        if (it != prepared_.end()) it->second.check = true;
      }
    }
    for (const auto& [id, decision] : retry) Apply(id, decision);
    for (const auto& [id, revision] : expired) PresumeAbort(id, revision);
    if (watch_ == nullptr || watch_->done()) {
      watch_.reset();
      StartWatch();
    }
    if (recompute) {
      Recompute();
      next_recompute = absl::Now() + kRecomputeEvery;
    }
    (void)WriteRegistration(/*only_if_changed=*/true);
  }
}

FleetStatus FleetMember::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

std::string FleetMember::RenderMetrics() const {
  absl::MutexLock lock(&mu_);
  const std::string labels =
      absl::StrCat("{fleet=\"", PrometheusLabelValue(options_.fleet), "\",member=\"",
                   PrometheusLabelValue(options_.member_id), "\"}");
  return absl::StrCat(
      "# HELP refitd_fleet_version The fleet's last committed version.\n"
      "# TYPE refitd_fleet_version gauge\n"
      "refitd_fleet_version",
      labels, " ", status_.fleet_version,
      "\n# HELP refitd_fleet_consistent 1 when this member serves the fleet's version.\n"
      "# TYPE refitd_fleet_consistent gauge\n"
      "refitd_fleet_consistent",
      labels, " ", status_.consistent ? 1 : 0,
      "\n# HELP refitd_fleet_flip_skew_seconds Time between the first and the last member's "
      "commit of the fleet's last refit.\n"
      "# TYPE refitd_fleet_flip_skew_seconds gauge\n"
      "refitd_fleet_flip_skew_seconds",
      labels, " ", last_skew_seconds_, "\n");
}

absl::StatusOr<std::unique_ptr<FleetMember>> JoinFleet(const ServerOptions& options,
                                                       RefitServer* server) {
  FleetOptions fleet;
  fleet.fleet = options.fleet;
  fleet.etcd_endpoints = options.etcd_endpoints;
  fleet.member_id = options.fleet_member;
  fleet.address = options.fleet_advertise;
  if (fleet.address.empty() && !server->bound_addresses().empty()) {
    fleet.address = server->bound_addresses().front();
  }
  const std::string fleet_address = fleet.address;
  fleet.lease_ttl = options.fleet_lease_ttl;
  fleet.prepared_timeout = options.fleet_prepared_timeout;
  fleet.etcd_ca_file = options.etcd_ca;
  fleet.etcd_cert_file = options.etcd_cert;
  fleet.etcd_key_file = options.etcd_key;
  HealthService* health = server->health();
  absl::StatusOr<std::unique_ptr<FleetMember>> member =
      FleetMember::Start(std::move(fleet), server->default_group(), server->metrics(),
                         [health](bool ready) { health->SetGate(kRefitServiceName, ready); });
  if (!member.ok()) return member.status();
  server->service()->SetFleet(member->get());
  // Logged once the service reports the membership (tests wait for it).
  REFIT_LOG(INFO)
          .Field("fleet", options.fleet)
          .Field("member", (*member)->status().member_id)
          .Field("address", fleet_address)
      << "joined the fleet";
  return member;
}

}  // namespace refit::server
