// RefitSession::CommitLinked / RefitSlot::CommitLinked: refits of two stores
// (model groups of different shapes) committed at one commit point, or not
// at all.
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/fixture_model.h"
#include "core/model_layout.h"
#include "core/refit_session.h"
#include "core/shard_store.h"
#include "tests/testing/refit_helpers.h"

namespace refit::core {
namespace {

using ::refit::testing::IngestAll;

std::unique_ptr<ShardStore> MakeGroupStore(const std::string& group, ParallelConfig parallel,
                                           QuantScheme quant) {
  absl::StatusOr<std::shared_ptr<const ModelLayout>> layout =
      ModelLayout::Build(FixtureConfig(), parallel, quant);
  EXPECT_TRUE(layout.ok()) << layout.status();
  if (!layout.ok()) return nullptr;
  ShardStoreOptions options;
  options.group = group;
  absl::StatusOr<std::unique_ptr<ShardStore>> store = ShardStore::Create(*layout, options);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

std::vector<OwnedTensor> Weights(uint64_t seed) {
  absl::StatusOr<std::vector<OwnedTensor>> weights = MakeFixtureWeights(FixtureConfig(), seed);
  EXPECT_TRUE(weights.ok()) << weights.status();
  return weights.ok() ? *std::move(weights) : std::vector<OwnedTensor>{};
}

// A session of `store` PREPARED with the fixture weights of `seed` (none
// when `seed` is 0).
std::unique_ptr<RefitSession> Prepared(ShardStore* store, uint64_t seed) {
  absl::StatusOr<std::unique_ptr<RefitSession>> session = RefitSession::Begin(store, {});
  EXPECT_TRUE(session.ok()) << session.status();
  if (!session.ok()) return nullptr;
  if (seed != 0) {
    absl::Status ingested = IngestAll(**session, Weights(seed));
    EXPECT_TRUE(ingested.ok()) << ingested;
  }
  absl::StatusOr<RefitResult> prepared = (*session)->Prepare();
  EXPECT_TRUE(prepared.ok()) << prepared.status();
  return *std::move(session);
}

void CommitAlone(ShardStore* store, uint64_t seed) {
  std::unique_ptr<RefitSession> session = Prepared(store, seed);
  ASSERT_NE(session, nullptr);
  absl::StatusOr<RefitResult> committed = session->Commit();
  ASSERT_TRUE(committed.ok()) << committed.status();
}

class LinkedCommitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    target_ = MakeGroupStore("target", {0, 1}, QuantScheme::kPerTensor);
    draft_ = MakeGroupStore("draft", {0, 2}, QuantScheme::kBlock128);
    ASSERT_NE(target_, nullptr);
    ASSERT_NE(draft_, nullptr);
    CommitAlone(target_.get(), 1);
    CommitAlone(draft_.get(), 1);
  }

  std::unique_ptr<ShardStore> target_;
  std::unique_ptr<ShardStore> draft_;
};

// Records every call of every store's coordinator, in the order they came,
// in one shared log; AskCommit and BeforeCommit answer as set.
class RecordingCoordinator : public CommitCoordinator {
 public:
  RecordingCoordinator(std::string group, std::vector<std::string>* log)
      : group_(std::move(group)), log_(log) {}
  absl::Status AskCommit(absl::string_view refit_id, uint64_t next_version) override {
    log_->push_back(absl::StrCat("ask ", group_, "@", next_version));
    return ask_answer;
  }
  absl::Status BeforeCommit(absl::string_view refit_id, uint64_t next_version) override {
    log_->push_back(absl::StrCat("wait ", group_, "@", next_version));
    return before_answer;
  }
  bool ReadyToCopy(absl::string_view refit_id) override {
    if (not_ready_rounds == 0) return true;
    --not_ready_rounds;
    return false;
  }
  void StartCopy(absl::string_view refit_id) override { log_->push_back("copy " + group_); }
  void AfterCommit(absl::string_view refit_id, const absl::StatusOr<CommitStats>& result) override {
    log_->push_back(absl::StrCat(
        "after ", group_, " ",
        result.ok() ? absl::StrCat("v", result->version) : std::string(result.status().message())));
  }
  absl::Status ask_answer = absl::OkStatus();
  absl::Status before_answer = absl::OkStatus();
  // ReadyToCopy answers false this many times (an engine attached after
  // the wait), then true.
  int not_ready_rounds = 0;

 private:
  std::string group_;
  std::vector<std::string>* log_;
};

class LinkedCommitCoordinationTest : public LinkedCommitTest {
 protected:
  void SetUp() override {
    LinkedCommitTest::SetUp();
    target_->SetCommitCoordinator(&target_coordinator_);
    draft_->SetCommitCoordinator(&draft_coordinator_);
  }
  void TearDown() override {
    target_->SetCommitCoordinator(nullptr);
    draft_->SetCommitCoordinator(nullptr);
  }
  absl::StatusOr<std::vector<RefitResult>> CommitBoth(RefitSession* t, RefitSession* d) {
    std::vector<RefitSession*> sessions = {t, d};
    return RefitSession::CommitLinked(sessions);
  }

  std::vector<std::string> log_;
  RecordingCoordinator target_coordinator_{"target", &log_};
  RecordingCoordinator draft_coordinator_{"draft", &log_};
};

TEST_F(LinkedCommitCoordinationTest, EveryGroupsEnginesAreAskedBeforeAnyWaitIsAwaited) {
  std::unique_ptr<RefitSession> t = Prepared(target_.get(), 2);
  std::unique_ptr<RefitSession> d = Prepared(draft_.get(), 3);
  ASSERT_TRUE(CommitBoth(t.get(), d.get()).ok());
  // In group-name order: both asked, then both waited for, the copy
  // started in both, then both told.
  EXPECT_THAT(log_, ::testing::ElementsAre("ask draft@2", "ask target@2", "wait draft@2",
                                           "wait target@2", "copy draft", "copy target",
                                           "after draft v2", "after target v2"));
}

TEST_F(LinkedCommitCoordinationTest, AGroupNotReadyAfterTheWaitsSendsTheWaitsRoundAgain) {
  // An engine attached to the draft while the target was waited for: the
  // draft is waited for again (and the target, whose wait returns at once
  // when nothing is left), and only then does the copy start.
  draft_coordinator_.not_ready_rounds = 1;
  std::unique_ptr<RefitSession> t = Prepared(target_.get(), 2);
  std::unique_ptr<RefitSession> d = Prepared(draft_.get(), 3);
  ASSERT_TRUE(CommitBoth(t.get(), d.get()).ok());
  EXPECT_THAT(log_,
              ::testing::ElementsAre("ask draft@2", "ask target@2", "wait draft@2", "wait target@2",
                                     "wait draft@2", "wait target@2", "copy draft", "copy target",
                                     "after draft v2", "after target v2"));
  EXPECT_EQ(target_->version(), 2u);
  EXPECT_EQ(draft_->version(), 2u);
}

TEST_F(LinkedCommitCoordinationTest,
       AGroupWhoseEnginesDoNotQuiesceEndsTheOthersAskLeavingAllPrepared) {
  draft_coordinator_.before_answer = NotQuiescedError("engine \"e-1\" did not quiesce within 1s");
  std::unique_ptr<RefitSession> t = Prepared(target_.get(), 2);
  std::unique_ptr<RefitSession> d = Prepared(draft_.get(), 3);
  absl::StatusOr<std::vector<RefitResult>> results = CommitBoth(t.get(), d.get());
  ASSERT_EQ(results.status().code(), absl::StatusCode::kDeadlineExceeded) << results.status();
  EXPECT_THAT(results.status().message(), ::testing::HasSubstr("model group \"draft\": engine"));
  // The draft's wait ended its own ask; the target, asked and not waited
  // for, is told the commit ended, naming the group that held it up.
  EXPECT_THAT(log_, ::testing::ElementsAre(
                        "ask draft@2", "ask target@2", "wait draft@2",
                        "after target model group \"draft\": engine \"e-1\" did not quiesce "
                        "within 1s"));
  EXPECT_EQ(t->state(), SessionState::kPrepared);
  EXPECT_EQ(d->state(), SessionState::kPrepared);
  EXPECT_EQ(target_->version(), 1u);
  EXPECT_EQ(draft_->version(), 1u);
  // Once the engines let it through, the same refits commit.
  draft_coordinator_.before_answer = absl::OkStatus();
  ASSERT_TRUE(CommitBoth(t.get(), d.get()).ok());
  EXPECT_EQ(target_->version(), 2u);
  EXPECT_EQ(draft_->version(), 2u);
}

TEST_F(LinkedCommitCoordinationTest, AnAskRefusedEndsTheAsksBeforeItAndWaitsForNone) {
  target_coordinator_.ask_answer = absl::AbortedError("refit \"r\" aborted: shutting down");
  std::unique_ptr<RefitSession> t = Prepared(target_.get(), 2);
  std::unique_ptr<RefitSession> d = Prepared(draft_.get(), 3);
  absl::StatusOr<std::vector<RefitResult>> results = CommitBoth(t.get(), d.get());
  ASSERT_EQ(results.status().code(), absl::StatusCode::kAborted) << results.status();
  EXPECT_THAT(log_, ::testing::ElementsAre(
                        "ask draft@2", "ask target@2",
                        "after draft model group \"target\": refit \"r\" aborted: shutting down"));
  EXPECT_EQ(target_->version(), 1u);
  EXPECT_EQ(draft_->version(), 1u);
}

// Waits in BeforeCommit until CancelLinkedWait (or 20 s, then answers "did
// not quiesce"), as a store whose attached engine never reaches its safe
// point does.
class BlockingCoordinator : public RecordingCoordinator {
 public:
  using RecordingCoordinator::RecordingCoordinator;
  absl::Status BeforeCommit(absl::string_view refit_id, uint64_t next_version) override {
    RecordingCoordinator::BeforeCommit(refit_id, next_version).IgnoreError();  // logs the call
    absl::MutexLock lock(&mu_);
    waiting_ = true;
    auto cancelled = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !cancel_.empty(); };
    mu_.AwaitWithTimeout(absl::Condition(&cancelled), absl::Seconds(20));
    waiting_ = false;
    if (cancel_.empty()) return NotQuiescedError("engine \"e-1\" did not quiesce within 20s");
    return absl::AbortedError(absl::StrCat("refit \"", refit_id, "\" aborted: ", cancel_));
  }
  void CancelLinkedWait(absl::string_view refit_id, absl::string_view reason) override {
    absl::MutexLock lock(&mu_);
    if (waiting_) cancel_ = std::string(reason);
  }
  bool waiting() {
    absl::MutexLock lock(&mu_);
    return waiting_;
  }

 private:
  absl::Mutex mu_;
  bool waiting_ ABSL_GUARDED_BY(mu_) = false;
  std::string cancel_ ABSL_GUARDED_BY(mu_);
};

TEST_F(LinkedCommitTest, AbortingOneRefitEndsTheWaitForTheOtherGroupsEngines) {
  // The draft's engines are waited for first (group-name order); the
  // target's refit is aborted meanwhile. The abort ends the draft's wait:
  // nothing is copied, both refits abort, and the abort does not wait for
  // the draft's engines.
  std::vector<std::string> log;
  BlockingCoordinator draft_coordinator("draft", &log);
  draft_->SetCommitCoordinator(&draft_coordinator);
  std::unique_ptr<RefitSession> t = Prepared(target_.get(), 2);
  std::unique_ptr<RefitSession> d = Prepared(draft_.get(), 3);
  ASSERT_NE(t, nullptr);
  ASSERT_NE(d, nullptr);
  absl::StatusOr<std::vector<RefitResult>> results;
  std::thread committer([&] {
    std::vector<RefitSession*> sessions = {t.get(), d.get()};
    results = RefitSession::CommitLinked(sessions);
  });
  for (int i = 0; i < 2000 && !draft_coordinator.waiting(); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(draft_coordinator.waiting());
  const absl::Time start = absl::Now();
  t->Abort("the operator aborted it");
  const absl::Duration abort_took = absl::Now() - start;
  committer.join();
  draft_->SetCommitCoordinator(nullptr);
  EXPECT_LT(abort_took, absl::Seconds(10));  // not the 20 s wait
  ASSERT_EQ(results.status().code(), absl::StatusCode::kAborted) << results.status();
  EXPECT_THAT(results.status().message(),
              ::testing::HasSubstr("of model group \"target\", linked to it, was aborted: the "
                                   "operator aborted it"));
  EXPECT_EQ(t->state(), SessionState::kAborted);
  EXPECT_EQ(d->state(), SessionState::kAborted);
  EXPECT_EQ(target_->version(), 1u);
  EXPECT_EQ(draft_->version(), 1u);
}

TEST_F(LinkedCommitTest, CommitsBothStoresWithTheBytesOfSeparateCommits) {
  std::unique_ptr<RefitSession> t = Prepared(target_.get(), 2);
  std::unique_ptr<RefitSession> d = Prepared(draft_.get(), 3);
  std::vector<RefitSession*> sessions = {t.get(), d.get()};
  absl::StatusOr<std::vector<RefitResult>> results = RefitSession::CommitLinked(sessions);
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), 2u);
  EXPECT_EQ((*results)[0].refit_id, t->refit_id());
  EXPECT_EQ((*results)[1].refit_id, d->refit_id());
  EXPECT_EQ(target_->version(), 2u);
  EXPECT_EQ(draft_->version(), 2u);
  EXPECT_EQ((*results)[0].fingerprint, target_->fingerprint());
  EXPECT_EQ((*results)[1].fingerprint, draft_->fingerprint());
  EXPECT_EQ(t->state(), SessionState::kCommitted);
  EXPECT_EQ(d->state(), SessionState::kCommitted);
  EXPECT_EQ(target_->active_session(), "");
  EXPECT_EQ(draft_->active_session(), "");

  // The same weights committed one store at a time give the same bytes.
  std::unique_ptr<ShardStore> target_alone =
      MakeGroupStore("target", {0, 1}, QuantScheme::kPerTensor);
  std::unique_ptr<ShardStore> draft_alone = MakeGroupStore("draft", {0, 2}, QuantScheme::kBlock128);
  CommitAlone(target_alone.get(), 2);
  CommitAlone(draft_alone.get(), 3);
  EXPECT_EQ(target_alone->fingerprint(), target_->fingerprint());
  EXPECT_EQ(draft_alone->fingerprint(), draft_->fingerprint());
}

TEST_F(LinkedCommitTest, AFailingCommitOfOneStoreCopiesNothingAnywhereAndAbortsAll) {
  const std::string target_before = target_->fingerprint();
  const std::string draft_before = draft_->fingerprint();
  draft_->SetCommitGuard(
      [](uint64_t) { return absl::UnavailableError("cannot record the version: disk full"); });
  std::unique_ptr<RefitSession> t = Prepared(target_.get(), 2);
  std::unique_ptr<RefitSession> d = Prepared(draft_.get(), 3);
  std::vector<RefitSession*> sessions = {t.get(), d.get()};
  absl::StatusOr<std::vector<RefitResult>> results = RefitSession::CommitLinked(sessions);
  ASSERT_EQ(results.status().code(), absl::StatusCode::kUnavailable) << results.status();
  EXPECT_TRUE(absl::StrContains(results.status().message(), "model group \"draft\""))
      << results.status();
  EXPECT_EQ(target_->version(), 1u);
  EXPECT_EQ(draft_->version(), 1u);
  EXPECT_EQ(target_->fingerprint(), target_before);
  EXPECT_EQ(draft_->fingerprint(), draft_before);
  EXPECT_EQ(t->state(), SessionState::kAborted);
  EXPECT_EQ(d->state(), SessionState::kAborted);
  EXPECT_EQ(target_->active_session(), "");
  EXPECT_EQ(draft_->active_session(), "");
  draft_->SetCommitGuard(nullptr);
}

TEST_F(LinkedCommitTest, ASessionNotPreparedChangesNothing) {
  std::unique_ptr<RefitSession> t = Prepared(target_.get(), 2);
  absl::StatusOr<std::unique_ptr<RefitSession>> d = RefitSession::Begin(draft_.get(), {});
  ASSERT_TRUE(d.ok()) << d.status();
  std::vector<RefitSession*> sessions = {t.get(), d->get()};
  absl::StatusOr<std::vector<RefitResult>> results = RefitSession::CommitLinked(sessions);
  ASSERT_EQ(results.status().code(), absl::StatusCode::kFailedPrecondition) << results.status();
  EXPECT_TRUE(absl::StrContains(results.status().message(), "model group \"draft\" is receiving"))
      << results.status();
  EXPECT_EQ(t->state(), SessionState::kPrepared);
  EXPECT_EQ((*d)->state(), SessionState::kReceiving);
  EXPECT_EQ(target_->version(), 1u);
  EXPECT_EQ(draft_->version(), 1u);
  // Either can still finish on its own.
  ASSERT_TRUE(t->Commit().ok());
  EXPECT_EQ(target_->version(), 2u);
}

TEST_F(LinkedCommitTest, OneGroupTwiceIsInvalid) {
  std::unique_ptr<RefitSession> t = Prepared(target_.get(), 2);
  std::vector<RefitSession*> sessions = {t.get(), t.get()};
  absl::StatusOr<std::vector<RefitResult>> results = RefitSession::CommitLinked(sessions);
  ASSERT_EQ(results.status().code(), absl::StatusCode::kInvalidArgument) << results.status();
  EXPECT_TRUE(absl::StrContains(results.status().message(), "\"target\" twice"))
      << results.status();
  EXPECT_EQ(t->state(), SessionState::kPrepared);
}

TEST_F(LinkedCommitTest, ASessionThatReceivedNothingCommitsUnchanged) {
  std::unique_ptr<RefitSession> t = Prepared(target_.get(), 2);
  std::unique_ptr<RefitSession> d = Prepared(draft_.get(), 0);
  const std::string draft_before = draft_->fingerprint();
  std::vector<RefitSession*> sessions = {t.get(), d.get()};
  absl::StatusOr<std::vector<RefitResult>> results = RefitSession::CommitLinked(sessions);
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_EQ(target_->version(), 2u);
  EXPECT_EQ(draft_->version(), 1u);
  EXPECT_TRUE((*results)[1].unchanged);
  EXPECT_EQ(draft_->fingerprint(), draft_before);
  EXPECT_EQ(d->state(), SessionState::kCommitted);
}

TEST_F(LinkedCommitTest, AReaderThatSeesOneNewVersionSeesTheOtherNewToo) {
  std::atomic<bool> done{false};
  std::atomic<int> violations{0};
  std::atomic<uint64_t> reads{0};
  // Both reading orders: target then draft, and draft then target. Each
  // linked commit adds one to both versions, which start equal.
  auto reader = [&](ShardStore* first, ShardStore* second) {
    while (!done.load()) {
      const uint64_t a = first->version();
      const uint64_t b = second->version();
      if (b < a) ++violations;
      ++reads;
    }
  };
  std::thread r1(reader, target_.get(), draft_.get());
  std::thread r2(reader, draft_.get(), target_.get());
  for (uint64_t round = 0; round < 5; ++round) {
    std::unique_ptr<RefitSession> t = Prepared(target_.get(), 10 + round);
    std::unique_ptr<RefitSession> d = Prepared(draft_.get(), 20 + round);
    std::vector<RefitSession*> sessions = {d.get(), t.get()};
    ASSERT_TRUE(RefitSession::CommitLinked(sessions).ok());
  }
  done.store(true);
  r1.join();
  r2.join();
  EXPECT_EQ(violations.load(), 0);
  EXPECT_GT(reads.load(), 0u);
  EXPECT_EQ(target_->version(), 6u);
  EXPECT_EQ(draft_->version(), 6u);
}

}  // namespace
}  // namespace refit::core
