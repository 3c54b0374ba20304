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
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

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
      std::filesystem::remove_all(*dir_);
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

  std::unique_ptr<client::FleetCoordinator> Coordinator() {
    client::FleetCoordinatorOptions options;
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
  void ExpectNextRefitSucceeds(int seed) {
    auto files = client::ExpandSafetensorsPaths({Fixture(seed)});
    ASSERT_TRUE(files.ok()) << files.status();
    auto coordinator = Coordinator();
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

}  // namespace
}  // namespace refit::e2e
