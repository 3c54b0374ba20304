// EngineRegistry against a real store and hand-made sinks: engines that
// stop reading their stream, and engines whose process has exited but is
// not yet reaped, never hold a coordinated commit up.
#include "server/engine_registry.h"

#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/fixture_model.h"
#include "server/metrics.h"
#include "server/reactor_util.h"
#include "tests/testing/refit_helpers.h"

namespace refit::server {
namespace {

using ::testing::HasSubstr;

// Queues up to `capacity` messages (never written), then refuses as the
// Attach stream's sink does; EndLease records the status and detaches, as
// the stream's end does.
class FakeSink : public EngineSink {
 public:
  FakeSink(EngineRegistry* registry, size_t capacity) : registry_(registry), capacity_(capacity) {}
  bool Send(v1::DaemonMessage message) override {
    absl::MutexLock lock(&mu_);
    if (queued_.size() >= capacity_) return false;
    queued_.push_back(std::move(message));
    return true;
  }
  void EndLease(const absl::Status& status) override {
    {
      absl::MutexLock lock(&mu_);
      if (ended_.has_value()) return;
      ended_ = status;
    }
    registry_->Remove(id);
  }
  void Ref() override {}
  void Unref() override {}

  std::optional<absl::Status> ended() const {
    absl::MutexLock lock(&mu_);
    return ended_;
  }
  // The last CommitPending queued, if any.
  std::optional<v1::CommitPending> pending() const {
    absl::MutexLock lock(&mu_);
    for (auto it = queued_.rbegin(); it != queued_.rend(); ++it) {
      if (it->has_commit_pending()) return it->commit_pending();
    }
    return std::nullopt;
  }
  std::string id;

 private:
  EngineRegistry* registry_;
  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::vector<v1::DaemonMessage> queued_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Status> ended_ ABSL_GUARDED_BY(mu_);
};

class EngineRegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = testing::MakeStore(core::FixtureConfig());
    ASSERT_NE(store_, nullptr);
    ASSERT_TRUE(testing::PushAll(*store_, Weights(1)).ok());
    registry_ = std::make_unique<EngineRegistry>(store_.get(), absl::Seconds(20), &metrics_, 16);
  }
  void TearDown() override { registry_.reset(); }

  static std::vector<core::OwnedTensor> Weights(uint64_t seed) {
    absl::StatusOr<std::vector<core::OwnedTensor>> weights =
        core::MakeFixtureWeights(core::FixtureConfig(), seed);
    EXPECT_TRUE(weights.ok()) << weights.status();
    return weights.ok() ? *std::move(weights) : std::vector<core::OwnedTensor>{};
  }

  // Attaches `sink` with coordination; its id goes into the sink.
  void Attach(FakeSink& sink) {
    absl::StatusOr<std::string> id = registry_->Add(
        "engine", /*coordinated=*/true, &sink,
        [&](const std::string&, const v1::CommitPending*) { return store_->version(); });
    ASSERT_TRUE(id.ok()) << id.status();
    sink.id = *id;
  }

  // A one-phase refit to the weights of `seed`, and how long it took.
  absl::Duration Push(uint64_t seed) {
    const absl::Time start = absl::Now();
    absl::StatusOr<core::RefitResult> pushed = testing::PushAll(*store_, Weights(seed));
    EXPECT_TRUE(pushed.ok()) << pushed.status();
    return absl::Now() - start;
  }

  Metrics metrics_;
  std::unique_ptr<core::ShardStore> store_;
  std::unique_ptr<EngineRegistry> registry_;
};

TEST_F(EngineRegistryTest, AnEngineThatStopsReadingLosesItsLeaseAndHoldsNoCommitUp) {
  // A full queue: the next message (its CommitPending) is refused.
  FakeSink stuck(registry_.get(), 0);
  Attach(stuck);
  ASSERT_EQ(registry_->size(), 1);
  EXPECT_LT(Push(2), absl::Seconds(10));  // not the 20 s quiesce timeout
  EXPECT_EQ(store_->version(), 2u);
  ASSERT_TRUE(stuck.ended().has_value());
  EXPECT_EQ(stuck.ended()->code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(stuck.ended()->message(),
              HasSubstr(absl::StrCat("the engine did not read its stream: ", kMaxQueuedMessages,
                                     " messages waited to be sent to it")));
  EXPECT_EQ(registry_->size(), 0);
}

TEST_F(EngineRegistryTest, AnEngineWhoseProcessExitedUnreapedIsReleased) {
  FakeSink engine(registry_.get(), 16);
  Attach(engine);
  // The process that took the engine's descriptors has exited and is not
  // reaped yet (a zombie: its pid still answers kill(pid, 0)).
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT), 0);
  ASSERT_EQ(::kill(child, 0), 0);
  registry_->SetPeer(engine.id, child, ::getuid());
  EXPECT_LT(Push(2), absl::Seconds(10));  // not the 20 s quiesce timeout
  EXPECT_EQ(store_->version(), 2u);
  ASSERT_TRUE(engine.ended().has_value());
  EXPECT_EQ(engine.ended()->code(), absl::StatusCode::kAborted);
  EXPECT_THAT(engine.ended()->message(), HasSubstr("the engine's process"));
  EXPECT_EQ(registry_->size(), 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
}

TEST_F(EngineRegistryTest, AnEngineThatReadsAndAcksIsWaitedFor) {
  // The control: a sink with room and an engine that acks lets the commit
  // through, and its lease stays.
  FakeSink engine(registry_.get(), 16);
  Attach(engine);
  registry_->SetPeer(engine.id, ::getpid(), ::getuid());
  std::thread acker([&] {
    // Acks the pending commit as it was asked, once it is.
    for (int i = 0; i < 2000 && !engine.pending().has_value(); ++i) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    const std::optional<v1::CommitPending> pending = engine.pending();
    if (!pending.has_value()) return;
    registry_->OnQuiesced(engine.id, pending->refit_id(), pending->version(), pending->attempt());
  });
  core::RefitOptions options;
  options.refit_id = "r-acked";
  absl::StatusOr<core::RefitResult> pushed = testing::PushAll(*store_, Weights(2), options);
  acker.join();
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(store_->version(), 2u);
  EXPECT_FALSE(engine.ended().has_value());
  EXPECT_EQ(registry_->size(), 1);
}

TEST_F(EngineRegistryTest, ALinkedCancelEndsTheWaitOfTheCommitUnderWay) {
  // An engine that never acks: the wait ends only by the cancel (sent when
  // another refit of the same linked commit is aborted), not at the 20 s
  // quiesce timeout.
  FakeSink engine(registry_.get(), 16);
  Attach(engine);
  ASSERT_TRUE(registry_->AskCommit("r-linked", 2).ok());
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(200));
    registry_->CancelLinkedWait("r-linked", "the draft's refit was aborted");
  });
  const absl::Time start = absl::Now();
  const absl::Status waited = registry_->BeforeCommit("r-linked", 2);
  canceller.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(waited.code(), absl::StatusCode::kAborted) << waited;
  EXPECT_EQ(waited.message(), "refit \"r-linked\" aborted: the draft's refit was aborted");
  EXPECT_EQ(store_->version(), 1u);
  EXPECT_FALSE(engine.ended().has_value());  // the engine keeps its lease
}

TEST_F(EngineRegistryTest, ALinkedCancelOfNoCommitUnderWayLeavesNoRecord) {
  // No engine: a commit that is not cancelled goes through at once.
  registry_->CancelLinkedWait("r-later", "aborted before its commit");
  ASSERT_TRUE(registry_->AskCommit("r-later", 2).ok());
  EXPECT_TRUE(registry_->BeforeCommit("r-later", 2).ok());
  registry_->AfterCommit("r-later", absl::AbortedError("the copy was not made"));
  // Cancelled while asked, and the commit ended before its wait (another
  // group of the linked commit refused): the refit may commit again.
  ASSERT_TRUE(registry_->AskCommit("r-again", 2).ok());
  registry_->CancelLinkedWait("r-again", "the draft's refit was aborted");
  registry_->AfterCommit("r-again", core::NotQuiescedError("model group \"draft\": ..."));
  ASSERT_TRUE(registry_->AskCommit("r-again", 2).ok());
  EXPECT_TRUE(registry_->BeforeCommit("r-again", 2).ok());
  registry_->AfterCommit("r-again", absl::AbortedError("the copy was not made"));
}

TEST_F(EngineRegistryTest, ACancelThatCameAfterTheCopyIsOverOnceTheRefitIsCommitted) {
  // An Abort reaching a refit still active in the store after its copy:
  // the cancel is recorded (the registry cannot tell it from one on the
  // refit's way to its commit), and its Committed event ends the record.
  core::RefitOptions options;
  options.refit_id = "fixed-1";
  absl::StatusOr<std::unique_ptr<core::RefitSession>> session =
      core::RefitSession::Begin(store_.get(), options);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE(testing::IngestAll(**session, Weights(2)).ok());
  registry_->CancelWait("fixed-1", "Abort by op");
  // This commit stands for the one the cancel came too late for.
  store_->SetCommitCoordinator(nullptr);
  ASSERT_TRUE((*session)->Commit().ok());
  store_->SetCommitCoordinator(registry_.get());
  session->reset();
  // A later refit that reuses the id is not aborted by it.
  absl::StatusOr<core::RefitResult> again = testing::PushAll(*store_, Weights(3), options);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->version, 3u);
  // The same cancel reaching the registry after the Committed event, while
  // the store still names the refit active (a session with that id that
  // announces no start stands for the committed one here): late, so not
  // recorded.
  core::RefitOptions unannounced = options;
  unannounced.announce_start = false;
  session = core::RefitSession::Begin(store_.get(), unannounced);
  ASSERT_TRUE(session.ok()) << session.status();
  registry_->CancelWait("fixed-1", "Abort by op, late");
  ASSERT_TRUE(testing::IngestAll(**session, Weights(4)).ok());
  absl::StatusOr<core::RefitResult> late = (*session)->Commit();
  ASSERT_TRUE(late.ok()) << late.status();
  session->reset();
  // Once a refit with that id has started (its staging announced), a cancel
  // on its way to its commit is recorded again: its commit copies nothing.
  session = core::RefitSession::Begin(store_.get(), options);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE(testing::IngestAll(**session, Weights(5)).ok());
  registry_->CancelWait("fixed-1", "Abort by op, in time");
  absl::StatusOr<core::RefitResult> cancelled = (*session)->Commit();
  EXPECT_EQ(cancelled.status().code(), absl::StatusCode::kAborted) << cancelled.status();
  EXPECT_THAT(cancelled.status().message(), HasSubstr("Abort by op, in time"));
  EXPECT_EQ(store_->version(), 4u);
}

TEST_F(EngineRegistryTest, AnEngineThatAttachesAfterALinkedWaitIsWaitedForBeforeTheCopy) {
  // A linked commit: this group was asked and its wait is over (no engine),
  // the copy has not started (the other groups are waited for). An engine
  // that attaches now is asked, and the group is not ready to copy until it
  // acks.
  ASSERT_TRUE(registry_->AskCommit("r-linked", 2).ok());
  ASSERT_TRUE(registry_->BeforeCommit("r-linked", 2).ok());
  ASSERT_TRUE(registry_->ReadyToCopy("r-linked"));
  FakeSink engine(registry_.get(), 16);
  Attach(engine);
  const std::optional<v1::CommitPending> pending = engine.pending();
  ASSERT_TRUE(pending.has_value());
  EXPECT_EQ(pending->refit_id(), "r-linked");
  EXPECT_FALSE(registry_->ReadyToCopy("r-linked"));
  std::thread acker([&] {
    absl::SleepFor(absl::Milliseconds(100));
    registry_->OnQuiesced(engine.id, pending->refit_id(), pending->version(), pending->attempt());
  });
  const absl::Time start = absl::Now();
  EXPECT_TRUE(registry_->BeforeCommit("r-linked", 2).ok());  // waits for the newcomer
  acker.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_TRUE(registry_->ReadyToCopy("r-linked"));
  registry_->StartCopy("r-linked");
  // From the copy on, an engine that attaches holds until Committed and is
  // not waited for.
  FakeSink during_copy(registry_.get(), 16);
  Attach(during_copy);
  EXPECT_TRUE(registry_->ReadyToCopy("r-linked"));
  registry_->AfterCommit("r-linked", absl::AbortedError("the copy was not made"));
}

}  // namespace
}  // namespace refit::server
