// Fleet refits through a real etcd with 4 real refitd processes, at every
// fault point of the two-phase commit (docs/fleet.md): after each fault,
// every live member serves one version (the old or the new, never a mix) or
// is NOT_SERVING, and the next fleet refit succeeds. Loopback only, in a
// temporary directory; the fleet's deadlines are short (--fleet-prepared-
// timeout 2s, leases 2s) so that presumed aborts come quickly. Waits are
// bounded polls of the members' status (the condition is in the daemons and
// in etcd, not an event this process sees).
#include <signal.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/fleet_coordinator.h"
#include "client/refit_client.h"
#include "client/refitctl.h"
#include "client/safetensors_view.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"
#include "tests/testing/etcd_process.h"
#include "tests/testing/temp_dir.h"

namespace refit::e2e {
namespace {

constexpr int kMembers = 4;
constexpr char kFleet[] = "fault";

// Polls `condition` every 50 ms until it holds or `limit` passes.
bool Eventually(const std::function<bool()>& condition, absl::Duration limit = absl::Seconds(20)) {
  const absl::Time deadline = absl::Now() + limit;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return condition();
}

class FleetFaultTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (refit::testing::EtcdBinary().empty()) return;
    char pattern[] = "/tmp/refit_fleet_XXXXXX";
    if (::mkdtemp(pattern) == nullptr) return;
    dir_ = new std::string(pattern);
    auto etcd = refit::testing::EtcdProcess::Start(*dir_ + "/etcd");
    if (!etcd.ok()) {
      std::cerr << "etcd: " << etcd.status() << "\n";
      return;
    }
    etcd_ = etcd->release();
    members_ = new std::vector<std::unique_ptr<Child>>(kMembers);
    for (int i = 0; i < kMembers; ++i) StartMember(i);
  }
  static void TearDownTestSuite() {
    if (members_ != nullptr) {
      for (auto& m : *members_) m.reset();
      delete members_;
      members_ = nullptr;
    }
    delete etcd_;
    etcd_ = nullptr;
    if (dir_ != nullptr) {
      refit::testing::RemoveTree(*dir_);
      delete dir_;
      dir_ = nullptr;
    }
  }

  void SetUp() override {
    if (refit::testing::EtcdBinary().empty()) {
      GTEST_SKIP() << "no etcd binary (apt-get install etcd-server; scripts/setup.sh does)";
    }
    for (const std::string& bin :
         {BinPath("refitd"), BinPath("refit_make_fixture"), TestBinPath("e2e_fleet_coordinator")}) {
      if (!std::filesystem::exists(bin)) GTEST_SKIP() << bin << " is not built";
    }
    ASSERT_NE(etcd_, nullptr) << "etcd did not start";
    for (int i = 0; i < kMembers; ++i) {
      ASSERT_TRUE((*members_)[i] != nullptr && (*members_)[i]->running())
          << "member " << i << " is not running";
    }
  }

  static std::string Path(const std::string& name) { return *dir_ + "/" + name; }
  static std::string Socket(int i) { return absl::StrCat("unix:", *dir_, "/m", i, ".sock"); }

  // Starts member i and waits until it has joined the fleet.
  static void StartMember(int i) {
    (*members_)[i] =
        Child::Start({BinPath("refitd"), "--model=demo", "--listen=" + Socket(i),
                      absl::StrCat("--fleet=", kFleet), "--etcd=" + etcd_->endpoint(),
                      absl::StrCat("--fleet-member=m", i), "--fleet-prepared-timeout=2s",
                      "--fleet-lease-ttl=2s", "--shutdown-timeout=2s"},
                     Path(absl::StrCat("m", i, ".out")), Path(absl::StrCat("m", i, ".log")));
    if ((*members_)[i] == nullptr || !(*members_)[i]->AwaitStderr("joined the fleet")) {
      std::cerr << "member " << i << " did not join:\n"
                << ((*members_)[i] ? (*members_)[i]->Stderr() : "") << "\n";
    }
  }

  // The fixture model with `seed`, written once.
  static std::string Fixture(int seed) {
    const std::string out = Path(absl::StrCat("weights-", seed));
    if (std::filesystem::exists(out)) return out;
    auto child =
        Child::Start({BinPath("refit_make_fixture"), "--out=" + out, absl::StrCat("--seed=", seed)},
                     Path("fixture.out"), Path("fixture.err"));
    EXPECT_EQ(child->Wait(), 0) << child->Stderr();
    return out;
  }

  static absl::StatusOr<v1::GetStatusResponse> MemberStatus(int i) {
    client::ClientOptions options;
    options.address = Socket(i);
    options.timeout = absl::Seconds(5);
    auto c = client::RefitClient::Create(options);
    if (!c.ok()) return c.status();
    return (*c)->GetStatus();
  }

  std::unique_ptr<client::FleetCoordinator> Coordinator(int keep_decisions = 16) {
    client::FleetCoordinatorOptions options;
    options.keep_decisions = keep_decisions;
    options.etcd = {etcd_->endpoint()};
    options.fleet = kFleet;
    options.lock_ttl = absl::Seconds(2);
    options.timeout = absl::Seconds(60);
    auto c = client::FleetCoordinator::Create(options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // Waits until no member has an active refit, then checks all-or-nothing:
  // the ready members serve one fingerprint. Returns it ("" if none is
  // ready).
  std::string ExpectOneVersion() {
    EXPECT_TRUE(Eventually([] {
      for (int i = 0; i < kMembers; ++i) {
        if (!(*members_)[i]->running()) continue;
        auto s = MemberStatus(i);
        if (!s.ok() || s->has_active_refit()) return false;
      }
      return true;
    })) << "a member still has an active refit";
    std::set<std::string> fingerprints;
    for (int i = 0; i < kMembers; ++i) {
      if (!(*members_)[i]->running()) continue;
      auto s = MemberStatus(i);
      EXPECT_TRUE(s.ok()) << s.status();
      if (s.ok() && s->ready()) fingerprints.insert(s->fingerprint());
    }
    EXPECT_LE(fingerprints.size(), 1u) << "ready members serve different versions";
    return fingerprints.empty() ? "" : *fingerprints.begin();
  }

  // A fleet refit with `seed`'s weights that succeeds (retried while the
  // lock of a killed coordinator has not expired); then every member is
  // ready at it.
  void ExpectNextRefitSucceeds(int seed, int keep_decisions = 16) {
    auto files = client::ExpandSafetensorsPaths({Fixture(seed)});
    ASSERT_TRUE(files.ok()) << files.status();
    auto coordinator = Coordinator(keep_decisions);
    absl::StatusOr<client::FleetRefitResult> result;
    ASSERT_TRUE(Eventually([&] {
      result = coordinator->Push(*files);
      return result.ok() || !absl::StrContains(result.status().message(), "in progress");
    })) << result.status();
    ASSERT_TRUE(result.ok()) << result.status();
    for (const client::FleetMemberResult& m : result->members) {
      EXPECT_TRUE(m.committed) << m.member_id << ": " << m.error;
    }
    std::string fingerprint;
    EXPECT_TRUE(Eventually([&] {
      std::set<std::string> fps;
      for (int i = 0; i < kMembers; ++i) {
        auto s = MemberStatus(i);
        if (!s.ok() || !s->ready() || !s->fleet().consistent()) return false;
        fps.insert(s->fingerprint());
      }
      if (fps.size() != 1) return false;
      fingerprint = *fps.begin();
      return true;
    })) << "not every member is ready at the fleet's new version";
    absl::StatusOr<client::FleetState> state = coordinator->Status();
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_EQ(state->fleet_version, result->fleet_version);
  }

  // Runs the coordinator process to its end.
  std::unique_ptr<Child> RunCoordinator(int seed, const std::vector<std::string>& faults) {
    std::vector<std::string> argv = {TestBinPath("e2e_fleet_coordinator"), etcd_->endpoint(),
                                     kFleet, Fixture(seed)};
    argv.insert(argv.end(), faults.begin(), faults.end());
    auto child = Child::Start(argv, Path("coordinator.out"), Path("coordinator.err"));
    EXPECT_NE(child, nullptr);
    child->Wait();
    EXPECT_FALSE(child->running());
    return child;
  }

  // The fleet's keys under `sub` ("decisions/", "version").
  static std::vector<server::EtcdKeyValue> EtcdKeys(const std::string& sub) {
    server::EtcdClientOptions options;
    options.endpoints = {etcd_->endpoint()};
    auto etcd = server::EtcdClient::Create(options);
    EXPECT_TRUE(etcd.ok()) << etcd.status();
    if (!etcd.ok()) return {};
    auto kvs = (*etcd)->GetPrefix(absl::StrCat("/refitd/fleet/", kFleet, "/", sub));
    EXPECT_TRUE(kvs.ok()) << kvs.status();
    return kvs.ok() ? *kvs : std::vector<server::EtcdKeyValue>{};
  }

  std::string LiveFingerprint() {
    auto s = MemberStatus(0);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->fingerprint() : "";
  }

  static std::string* dir_;
  static refit::testing::EtcdProcess* etcd_;
  static std::vector<std::unique_ptr<Child>>* members_;
};

std::string* FleetFaultTest::dir_ = nullptr;
refit::testing::EtcdProcess* FleetFaultTest::etcd_ = nullptr;
std::vector<std::unique_ptr<Child>>* FleetFaultTest::members_ = nullptr;

TEST_F(FleetFaultTest, FleetRefitFlipsEveryMemberAndStatusIsConsistent) {
  ExpectNextRefitSucceeds(2);
  absl::StatusOr<client::FleetState> state = Coordinator()->Status();
  ASSERT_TRUE(state.ok());
  EXPECT_TRUE(state->consistent);
  EXPECT_EQ(state->members.size(), static_cast<size_t>(kMembers));
  auto s = MemberStatus(0);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->fleet().fleet(), kFleet);
  EXPECT_EQ(s->fleet().member_id(), "m0");
  EXPECT_EQ(s->fleet().fleet_version(), state->fleet_version);
}

TEST_F(FleetFaultTest, MemberWithADifferentLayoutIsRefusedNamingTheFields) {
  auto odd = Child::Start({BinPath("refitd"), "--model=demo", "--quant=per-channel",
                           "--listen=unix:" + Path("odd.sock"), absl::StrCat("--fleet=", kFleet),
                           "--etcd=" + etcd_->endpoint(), "--fleet-member=odd"},
                          Path("odd.out"), Path("odd.log"));
  ASSERT_NE(odd, nullptr);
  EXPECT_EQ(odd->Wait(), 1) << odd->Stderr();
  EXPECT_TRUE(absl::StrContains(odd->Stderr(), "FAILED_PRECONDITION")) << odd->Stderr();
  EXPECT_TRUE(absl::StrContains(odd->Stderr(),
                                "quantization \"per-channel\" here, "
                                "\"per-tensor\" on member"))
      << odd->Stderr();
  absl::StatusOr<client::FleetState> state = Coordinator()->Status();
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->members.size(), static_cast<size_t>(kMembers));
}

TEST_F(FleetFaultTest, FleetNamesAndMemberIdsOutsideThePlainCharactersAreRefusedAtStartUp) {
  // They become etcd keys, JSON strings and metric labels.
  const std::pair<std::string, std::string> bad[] = {
      {"--fleet=fl\"eet", "--fleet \"fl\\\"eet\": a fleet name is 1 to 128 of [A-Za-z0-9._-]"},
      {"--fleet-member=m\n1", "--fleet-member \"m\\n1\": a member id is 1 to 128 of"},
      {"--fleet-member=..", "--fleet-member \"..\": a member id"},
  };
  for (const auto& [flag, message] : bad) {
    SCOPED_TRACE(flag);
    std::vector<std::string> args = {
        BinPath("refitd"), "--model=demo", "--listen=unix:" + Path("bad.sock"),
        absl::StrCat("--fleet=", kFleet), "--etcd=" + etcd_->endpoint()};
    args.push_back(flag);
    auto child = Child::Start(args, Path("bad.out"), Path("bad.log"));
    ASSERT_NE(child, nullptr);
    EXPECT_EQ(child->Wait(), 1) << child->Stderr();
    EXPECT_TRUE(absl::StrContains(child->Stderr(), message)) << child->Stderr();
  }
  absl::StatusOr<client::FleetState> state = Coordinator()->Status();
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->members.size(), static_cast<size_t>(kMembers));
}

TEST_F(FleetFaultTest, CoordinatorKilledBeforeAnyPrepareCompletesChangesNothing) {
  const std::string before = LiveFingerprint();
  auto c = RunCoordinator(3, {"--die-at", "sending:0"});
  EXPECT_TRUE(c->KilledBySignal(SIGKILL)) << c->Stdout();
  EXPECT_EQ(ExpectOneVersion(), before);
  ExpectNextRefitSucceeds(4);
}

TEST_F(FleetFaultTest, CoordinatorKilledAfterSomePreparesAbortsEverywhereAtTheDeadline) {
  const std::string before = LiveFingerprint();
  auto c = RunCoordinator(5, {"--die-at", "prepared:2"});
  EXPECT_TRUE(c->KilledBySignal(SIGKILL)) << c->Stdout();
  // The prepared members wait for a decision; at their deadline one of them
  // records abort, and all abort.
  EXPECT_EQ(ExpectOneVersion(), before);
  ExpectNextRefitSucceeds(2);
}

TEST_F(FleetFaultTest, CoordinatorKilledAfterTheDecisionCommitsEverywhere) {
  const std::string before = LiveFingerprint();
  auto c = RunCoordinator(3, {"--die-at", "decided:0"});
  EXPECT_TRUE(c->KilledBySignal(SIGKILL)) << c->Stdout();
  // Nobody tells the members to commit: they follow the decision in etcd.
  std::string after;
  EXPECT_TRUE(Eventually([&] {
    after = ExpectOneVersion();
    return after != before;
  }));
  for (int i = 0; i < kMembers; ++i) {
    auto s = MemberStatus(i);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->fingerprint(), after) << "member " << i;
  }
  ExpectNextRefitSucceeds(4);
}

TEST_F(FleetFaultTest, CoordinatorKilledAfterSomeCommitsCommitsEverywhere) {
  const std::string before = LiveFingerprint();
  auto c = RunCoordinator(5, {"--die-at", "committed:2"});
  EXPECT_TRUE(c->KilledBySignal(SIGKILL)) << c->Stdout();
  EXPECT_TRUE(Eventually([&] {
    std::set<std::string> fps;
    for (int i = 0; i < kMembers; ++i) {
      auto s = MemberStatus(i);
      if (!s.ok()) return false;
      fps.insert(s->fingerprint());
    }
    return fps.size() == 1 && *fps.begin() != before;
  }));
  ExpectOneVersion();
  ExpectNextRefitSucceeds(2);
}

TEST_F(FleetFaultTest, MemberKilledAfterPreparingComesBackNotServingBehindTheFleet) {
  const int victim = 3;
  const std::string before = LiveFingerprint();
  auto c = RunCoordinator(
      3, {"--kill-at", absl::StrCat("prepared:", kMembers, ":", (*members_)[victim]->pid())});
  // The fleet committed; the dead member could not confirm.
  EXPECT_EQ(c->Wait(), client::kExitUnavailable) << c->Stdout();
  ASSERT_TRUE(Eventually([&] { return !(*members_)[victim]->running(); }));
  const std::string after = ExpectOneVersion();
  EXPECT_NE(after, before);
  StartMember(victim);
  ASSERT_TRUE((*members_)[victim]->running());
  auto s = MemberStatus(victim);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->ready());
  EXPECT_FALSE(s->fleet().consistent());
  EXPECT_TRUE(absl::StrContains(s->not_ready_reason(), "behind the fleet at version"))
      << s->not_ready_reason();
  client::ClientOptions options;
  options.address = Socket(victim);
  auto health = client::RefitClient::Create(options);
  ASSERT_TRUE(health.ok());
  auto ready = (*health)->HealthCheck(client::kReadinessService);
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_EQ(*ready, grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  ExpectNextRefitSucceeds(4);
  auto serving = (*health)->HealthCheck(client::kReadinessService);
  ASSERT_TRUE(serving.ok());
  EXPECT_EQ(*serving, grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(FleetFaultTest, EtcdStoppedMidRefitAbortsEverywhereAtTheDeadline) {
  const std::string before = LiveFingerprint();
  auto c = RunCoordinator(5, {"--kill-at", absl::StrCat("prepared:", kMembers, ":", etcd_->pid())});
  EXPECT_EQ(c->Wait(), client::kExitUnavailable) << c->Stdout();
  // No decision can be written: every member aborts at its deadline and,
  // not knowing the decision, is NOT_SERVING; nobody committed.
  EXPECT_TRUE(Eventually([&] {
    for (int i = 0; i < kMembers; ++i) {
      auto s = MemberStatus(i);
      if (!s.ok() || s->has_active_refit() || s->ready()) return false;
    }
    return true;
  })) << "members did not abort at their deadline";
  for (int i = 0; i < kMembers; ++i) {
    auto s = MemberStatus(i);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->fingerprint(), before) << "member " << i << " committed without a decision";
    EXPECT_TRUE(absl::StrContains(s->not_ready_reason(), "etcd")) << s->not_ready_reason();
  }
  ASSERT_TRUE(etcd_->Restart().ok());
  // Back with etcd: abort is recorded, the members serve the old version.
  EXPECT_TRUE(Eventually([&] {
    for (int i = 0; i < kMembers; ++i) {
      auto s = MemberStatus(i);
      if (!s.ok() || !s->ready()) return false;
    }
    return true;
  }));
  EXPECT_EQ(ExpectOneVersion(), before);
  ExpectNextRefitSucceeds(3);
}

TEST_F(FleetFaultTest, TwoCoordinatorsRacingOneWinsTheOtherIsAborted) {
  auto files = client::ExpandSafetensorsPaths({Fixture(5)});
  ASSERT_TRUE(files.ok());
  absl::Status second = absl::OkStatus();
  bool raced = false;
  client::FleetCoordinatorOptions options;
  options.etcd = {etcd_->endpoint()};
  options.fleet = kFleet;
  options.lock_ttl = absl::Seconds(2);
  // The second coordinator starts while the first holds every member
  // prepared.
  options.on_step = [&](absl::string_view step, int n) {
    if (step != "prepared" || n != kMembers || raced) return;
    raced = true;
    auto other = Coordinator();
    second = other->Push(*files).status();
  };
  auto first = client::FleetCoordinator::Create(options);
  ASSERT_TRUE(first.ok());
  absl::StatusOr<client::FleetRefitResult> won = (*first)->Push(*files);
  ASSERT_TRUE(won.ok()) << won.status();
  EXPECT_TRUE(raced);
  EXPECT_EQ(second.code(), absl::StatusCode::kAborted) << second;
  EXPECT_TRUE(absl::StrContains(second.message(), "in progress")) << second;
  EXPECT_NE(ExpectOneVersion(), "");
  ExpectNextRefitSucceeds(2);
}

TEST_F(FleetFaultTest, ACoordinatorSkipsADeadFirstEtcdEndpoint) {
  auto files = client::ExpandSafetensorsPaths({Fixture(4)});
  ASSERT_TRUE(files.ok()) << files.status();
  client::FleetCoordinatorOptions options;
  // The first member of the etcd cluster is down.
  options.etcd = {absl::StrCat("127.0.0.1:", refit::testing::PickFreePort()), etcd_->endpoint()};
  options.fleet = kFleet;
  options.lock_ttl = absl::Seconds(2);
  options.timeout = absl::Seconds(60);
  auto coordinator = client::FleetCoordinator::Create(options);
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  absl::StatusOr<client::FleetRefitResult> result;
  ASSERT_TRUE(Eventually([&] {
    result = (*coordinator)->Push(*files);
    return result.ok() || !absl::StrContains(result.status().message(), "in progress");
  })) << result.status();
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->members.size(), static_cast<size_t>(kMembers));
  for (const client::FleetMemberResult& m : result->members) {
    EXPECT_TRUE(m.committed) << m.member_id << ": " << m.error;
    // Each member's commit: when it ended and how long its copy took.
    EXPECT_GT(m.commit_unix_seconds, 0) << m.member_id;
    EXPECT_GT(m.commit_seconds, 0) << m.member_id;
    EXPECT_LT(m.commit_seconds, 60) << m.member_id;
  }
  absl::StatusOr<client::FleetState> state = (*coordinator)->Status();
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->fleet_version, result->fleet_version);
  EXPECT_NE(ExpectOneVersion(), "");
}

TEST_F(FleetFaultTest, OldDecisionsAreDeletedKeepingTheNewestN) {
  constexpr int kKeep = 2;
  for (int seed : {3, 4, 5}) ExpectNextRefitSucceeds(seed, kKeep);
  // Those younger than the prepared timeout stay whatever their number.
  EXPECT_GE(EtcdKeys("decisions/").size(), static_cast<size_t>(kKeep));
  // A decision goes only once it is older than every member's prepared
  // timeout (2s here): the condition is the keys' age, so time passes.
  absl::SleepFor(absl::Milliseconds(2500));
  ExpectNextRefitSucceeds(2, kKeep);
  const std::vector<server::EtcdKeyValue> kept = EtcdKeys("decisions/");
  EXPECT_EQ(kept.size(), static_cast<size_t>(kKeep));
  // The newest, the last refit's, is among them.
  absl::StatusOr<client::FleetState> state = Coordinator()->Status();
  ASSERT_TRUE(state.ok());
  bool newest = false;
  for (const server::EtcdKeyValue& kv : kept) {
    newest |= absl::EndsWith(kv.key, "/" + state->last_fleet_refit_id);
  }
  EXPECT_TRUE(newest) << state->last_fleet_refit_id;
  ExpectOneVersion();
}

TEST_F(FleetFaultTest, PreparedMemberWhoseDecisionIsGoneAbortsAndRecordsNothing) {
  if (EtcdKeys("version").empty()) ExpectNextRefitSucceeds(2);  // run alone: a version to move
  const std::string before = LiveFingerprint();
  const size_t decisions = EtcdKeys("decisions/").size();
  auto c = RunCoordinator(5, {"--die-at", absl::StrCat("prepared:", kMembers)});
  EXPECT_TRUE(c->KilledBySignal(SIGKILL)) << c->Stdout();
  // What a commit whose decision was deleted leaves: the fleet's version
  // moved on, no decision key. Every member is still PREPARED.
  const std::vector<server::EtcdKeyValue> version = EtcdKeys("version");
  ASSERT_EQ(version.size(), 1u);
  nlohmann::json moved = nlohmann::json::parse(version[0].value);
  const uint64_t fleet_version = moved.value("fleet_version", uint64_t{0});
  moved["fleet_version"] = fleet_version + 1;
  moved["fleet_refit_id"] = "fleet-deleted-decision";
  {
    server::EtcdClientOptions options;
    options.endpoints = {etcd_->endpoint()};
    auto etcd = server::EtcdClient::Create(options);
    ASSERT_TRUE(etcd.ok());
    ASSERT_TRUE((*etcd)->Put(version[0].key, moved.dump()).ok());
  }
  // At the deadline nobody commits on a guess and nobody records abort (it
  // may have been a commit): each aborts and, behind the fleet's version,
  // is NOT_SERVING.
  EXPECT_TRUE(Eventually([&] {
    for (int i = 0; i < kMembers; ++i) {
      auto s = MemberStatus(i);
      if (!s.ok() || s->has_active_refit() || s->ready()) return false;
    }
    return true;
  })) << "members did not abort at their deadline";
  for (int i = 0; i < kMembers; ++i) {
    auto s = MemberStatus(i);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->fingerprint(), before) << "member " << i << " committed without a decision";
    EXPECT_TRUE(absl::StrContains(s->not_ready_reason(),
                                  absl::StrCat("behind the fleet at version ", fleet_version)))
        << s->not_ready_reason();
  }
  EXPECT_EQ(EtcdKeys("decisions/").size(), decisions) << "an abort was recorded";
  ExpectNextRefitSucceeds(3);
}

// A fleet over TLS: etcd with TLS and client certificates, members serving
// TLS on loopback TCP, the coordinator (C++ and refitctl) speaking TLS to
// both; certificates made here with openssl.
class FleetTlsTest : public ::testing::Test {
 protected:
  static constexpr int kTlsMembers = 2;

  void SetUp() override {
    if (refit::testing::EtcdBinary().empty()) GTEST_SKIP() << "no etcd binary";
    for (const std::string& bin :
         {BinPath("refitd"), BinPath("refitctl"), BinPath("refit_make_fixture")}) {
      if (!std::filesystem::exists(bin)) GTEST_SKIP() << bin << " is not built";
    }
    char pattern[] = "/tmp/refit_fleet_tls_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
    ASSERT_TRUE(MakeCertificates()) << Read("certs.err");
    refit::testing::EtcdTls tls;
    tls.cert_file = Path("server.pem");
    tls.key_file = Path("server.key");
    tls.ca_file = Path("ca.pem");
    tls.client_cert_auth = true;
    tls.client_cert_file = Path("client.pem");
    tls.client_key_file = Path("client.key");
    auto etcd = refit::testing::EtcdProcess::Start(Path("etcd"), tls);
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = std::move(*etcd);
    ASSERT_TRUE(absl::StartsWith(etcd_->endpoint(), "https://")) << etcd_->endpoint();
    for (int i = 0; i < kTlsMembers; ++i) {
      addresses_.push_back(absl::StrCat("127.0.0.1:", refit::testing::PickFreePort()));
      members_.push_back(Member(i, Path("ca.pem")));
      ASSERT_TRUE(members_.back() != nullptr && members_.back()->AwaitStderr("joined the fleet"))
          << (members_.back() ? members_.back()->Stderr() : "");
    }
  }
  void TearDown() override {
    members_.clear();
    etcd_.reset();
    if (!dir_.empty() && !HasFailure()) refit::testing::RemoveTree(dir_);
  }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string Read(const std::string& name) const {
    std::ifstream in(Path(name));
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  // A CA; a certificate for 127.0.0.1 / localhost signed by it (etcd's and
  // the members'); a client certificate (the members' and the
  // coordinator's to etcd); an unrelated CA.
  bool MakeCertificates() {
    const std::string script = absl::StrCat(
        "set -e; cd '", dir_, "'\n",
        "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=refit-test-ca "
        "-keyout ca.key -out ca.pem\n",
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > server.ext\n",
        "openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout server.key "
        "-out server.csr\n",
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 "
        "-extfile server.ext -out server.pem\n",
        "openssl req -newkey rsa:2048 -nodes -subj /CN=refitd -keyout client.key "
        "-out client.csr\n",
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 "
        "-out client.pem\n",
        "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=other-ca "
        "-keyout other-ca.key -out other-ca.pem\n");
    std::ofstream(Path("certs.sh")) << script;
    auto child = Child::Start({"/bin/sh", Path("certs.sh")}, Path("certs.out"), Path("certs.err"));
    std::optional<int> code = child->Wait();
    return code.has_value() && *code == 0;
  }

  std::unique_ptr<Child> Member(int i, const std::string& etcd_ca) {
    return Child::Start(
        {BinPath("refitd"), "--model=demo", "--listen=" + addresses_[i],
         "--tls-cert=" + Path("server.pem"), "--tls-key=" + Path("server.key"), "--fleet=tls",
         "--etcd=" + etcd_->endpoint(), "--etcd-ca=" + etcd_ca, "--etcd-cert=" + Path("client.pem"),
         "--etcd-key=" + Path("client.key"), absl::StrCat("--fleet-member=t", i),
         "--fleet-prepared-timeout=5s", "--fleet-lease-ttl=2s", "--shutdown-timeout=2s"},
        Path(absl::StrCat("t", i, ".out")), Path(absl::StrCat("t", i, ".log")));
  }

  client::FleetCoordinatorOptions Options() const {
    client::FleetCoordinatorOptions options;
    options.etcd = {etcd_->endpoint()};
    options.fleet = "tls";
    options.etcd_ca_file = Path("ca.pem");
    options.etcd_cert_file = Path("client.pem");
    options.etcd_key_file = Path("client.key");
    options.tls_ca_file = Path("ca.pem");
    options.lock_ttl = absl::Seconds(2);
    options.timeout = absl::Seconds(60);
    return options;
  }

  std::string Fixture(int seed) {
    const std::string out = Path(absl::StrCat("weights-", seed));
    auto child =
        Child::Start({BinPath("refit_make_fixture"), "--out=" + out, absl::StrCat("--seed=", seed)},
                     Path("fixture.out"), Path("fixture.err"));
    EXPECT_EQ(child->Wait(), 0) << child->Stderr();
    return out;
  }

  std::unique_ptr<Child> Ctl(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {BinPath("refitctl"), "fleet"};
    argv.insert(argv.end(), args.begin(), args.end());
    auto child = Child::Start(argv, Path("ctl.out"), Path("ctl.err"));
    EXPECT_NE(child, nullptr);
    child->Wait();
    return child;
  }

  std::string dir_;
  std::unique_ptr<refit::testing::EtcdProcess> etcd_;
  std::vector<std::string> addresses_;
  std::vector<std::unique_ptr<Child>> members_;
};

TEST_F(FleetTlsTest, FleetRefitOverTlsToEtcdAndMembers) {
  auto files = client::ExpandSafetensorsPaths({Fixture(3)});
  ASSERT_TRUE(files.ok()) << files.status();
  auto coordinator = client::FleetCoordinator::Create(Options());
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  absl::StatusOr<client::FleetRefitResult> result = (*coordinator)->Push(*files);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->members.size(), static_cast<size_t>(kTlsMembers));
  for (const client::FleetMemberResult& m : result->members) {
    EXPECT_TRUE(m.committed) << m.member_id << ": " << m.error;
  }
  // refitctl with the same flags: a second refit, then a consistent fleet.
  const std::vector<std::string> tls = {"--etcd=" + etcd_->endpoint(),
                                        "--fleet=tls",
                                        "--etcd-ca=" + Path("ca.pem"),
                                        "--etcd-cert=" + Path("client.pem"),
                                        "--etcd-key=" + Path("client.key"),
                                        "--tls-ca=" + Path("ca.pem"),
                                        "--lock-ttl=2s"};
  std::vector<std::string> push = {"push", Fixture(4)};
  push.insert(push.end(), tls.begin(), tls.end());
  auto pushed = Ctl(push);
  EXPECT_EQ(pushed->Wait(), 0) << pushed->Stdout() << pushed->Stderr();
  EXPECT_TRUE(absl::StrContains(pushed->Stdout(), "2 of 2 members confirmed")) << pushed->Stdout();
  std::vector<std::string> status = {"status", "--json"};
  status.insert(status.end(), tls.begin(), tls.end());
  auto shown = Ctl(status);
  ASSERT_EQ(shown->Wait(), 0) << shown->Stderr();
  nlohmann::json j = nlohmann::json::parse(shown->Stdout(), nullptr, false);
  EXPECT_EQ(j.value("fleet_version", 0), 2) << shown->Stdout();
}

TEST_F(FleetTlsTest, AWrongCaFailsNamingTheEndpoint) {
  const std::string endpoint = etcd_->endpoint().substr(std::string("https://").size());
  // etcd's certificate is not signed by the given CA.
  client::FleetCoordinatorOptions wrong_etcd = Options();
  wrong_etcd.etcd_ca_file = Path("other-ca.pem");
  auto coordinator = client::FleetCoordinator::Create(wrong_etcd);
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  absl::StatusOr<client::FleetState> state = (*coordinator)->Status();
  ASSERT_FALSE(state.ok());
  EXPECT_EQ(state.status().code(), absl::StatusCode::kUnavailable) << state.status();
  EXPECT_TRUE(absl::StrContains(state.status().message(), endpoint)) << state.status();
  auto ctl = Ctl({"status", "--etcd=" + etcd_->endpoint(), "--fleet=tls",
                  "--etcd-ca=" + Path("other-ca.pem"), "--etcd-cert=" + Path("client.pem"),
                  "--etcd-key=" + Path("client.key")});
  EXPECT_EQ(ctl->Wait(), client::kExitUnavailable) << ctl->Stderr();
  EXPECT_TRUE(absl::StrContains(ctl->Stderr(), endpoint)) << ctl->Stderr();
  // A daemon given the wrong CA for etcd does not join: it exits naming
  // the endpoint.
  addresses_.push_back(absl::StrCat("127.0.0.1:", refit::testing::PickFreePort()));
  auto odd = Member(kTlsMembers, Path("other-ca.pem"));
  ASSERT_NE(odd, nullptr);
  EXPECT_NE(odd->Wait(), 0);
  EXPECT_TRUE(absl::StrContains(odd->Stderr(), endpoint)) << odd->Stderr();
  // The members' certificates are not signed by the given CA: nobody is
  // prepared, the refit is ABORTED naming each member's address.
  client::FleetCoordinatorOptions wrong_members = Options();
  wrong_members.tls_ca_file = Path("other-ca.pem");
  wrong_members.timeout = absl::Seconds(5);
  auto files = client::ExpandSafetensorsPaths({Fixture(5)});
  ASSERT_TRUE(files.ok());
  auto refit = client::FleetCoordinator::Create(wrong_members);
  ASSERT_TRUE(refit.ok());
  absl::StatusOr<client::FleetRefitResult> result = (*refit)->Push(*files);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kAborted) << result.status();
  for (int i = 0; i < kTlsMembers; ++i) {
    EXPECT_TRUE(absl::StrContains(result.status().message(),
                                  absl::StrCat("\"t", i, "\" (", addresses_[i], ")")))
        << result.status();
  }
}

}  // namespace
}  // namespace refit::e2e
