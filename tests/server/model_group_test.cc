// ModelGroup's registry of refits (who drives each, which are prepared) and
// its event fan-out to Watch streams, with hand-written drivers and
// subscribers that count references, over a real store of the fixture model.
#include "server/model_group.h"

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "core/fixture_model.h"
#include "core/model_layout.h"
#include "core/refit_session.h"
#include "core/shard_store.h"

namespace refit::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

// Counts references; records cancellations.
class FakeDriver : public RefitDriver {
 public:
  ~FakeDriver() override = default;
  void Ref() override { refs_.fetch_add(1); }
  void Unref() override { refs_.fetch_sub(1); }
  void Cancel(const grpc::Status& status, absl::string_view reason) override {
    absl::MutexLock lock(&mu_);
    cancels_.push_back({status.error_code(), std::string(reason)});
  }
  // References handed out and not yet returned.
  int refs() const { return refs_.load(); }

 private:
  std::atomic<int> refs_{0};
  absl::Mutex mu_;
  std::vector<std::pair<grpc::StatusCode, std::string>> cancels_ ABSL_GUARDED_BY(mu_);
};

// Records delivered events and the status it was closed with.
class FakeSubscriber : public EventSubscriber {
 public:
  ~FakeSubscriber() override = default;
  void Ref() override { refs_.fetch_add(1); }
  void Unref() override { refs_.fetch_sub(1); }
  void Deliver(const core::StoreEvent& event) override {
    absl::MutexLock lock(&mu_);
    events_.push_back(event);
  }
  void Close(const grpc::Status& status) override {
    absl::MutexLock lock(&mu_);
    closed_.push_back(status.error_code());
  }
  std::vector<core::StoreEvent> events() const {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  std::vector<grpc::StatusCode> closed() const {
    absl::MutexLock lock(&mu_);
    return closed_;
  }
  int refs() const { return refs_.load(); }

 private:
  std::atomic<int> refs_{0};
  mutable absl::Mutex mu_;
  std::vector<core::StoreEvent> events_ ABSL_GUARDED_BY(mu_);
  std::vector<grpc::StatusCode> closed_ ABSL_GUARDED_BY(mu_);
};

class ModelGroupTest : public ::testing::Test {
 protected:
  void SetUp() override { group_ = Group("target"); }

  static std::unique_ptr<ModelGroup> Group(const std::string& name) {
    absl::StatusOr<std::shared_ptr<const core::ModelLayout>> layout =
        core::ModelLayout::Build(core::FixtureConfig(), {}, core::QuantScheme::kPerTensor);
    EXPECT_TRUE(layout.ok()) << layout.status();
    if (!layout.ok()) return nullptr;
    core::ShardStoreOptions options;
    options.group = name;
    absl::StatusOr<std::unique_ptr<core::ShardStore>> store =
        core::ShardStore::Create(*layout, options);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? std::make_unique<ModelGroup>(*std::move(store)) : nullptr;
  }

  // A refit really running on the group's store (it holds the store's slot).
  std::shared_ptr<core::RefitSession> BeginSession(const std::string& refit_id) {
    core::RefitOptions options;
    options.refit_id = refit_id;
    absl::StatusOr<std::unique_ptr<core::RefitSession>> session =
        core::RefitSession::Begin(group_->store(), options);
    EXPECT_TRUE(session.ok()) << session.status();
    return session.ok() ? std::shared_ptr<core::RefitSession>(*std::move(session)) : nullptr;
  }

  static RefitEntry Entry(const std::string& refit_id,
                          std::shared_ptr<core::RefitSession> session = nullptr) {
    RefitEntry entry;
    entry.refit_id = refit_id;
    entry.owner = "trainer-0";
    entry.kind = "push";
    entry.label = "step 10";
    entry.session = std::move(session);
    return entry;
  }

  std::unique_ptr<ModelGroup> group_;
};

TEST_F(ModelGroupTest, NameAndStoreAreTheStores) {
  EXPECT_EQ(group_->name(), "target");
  ASSERT_NE(group_->store(), nullptr);
  EXPECT_EQ(group_->store()->group(), "target");
}

TEST_F(ModelGroupTest, FindOfAnUnknownRefitIsNotFoundNamingGroupAndId) {
  absl::StatusOr<ModelGroup::Found> found = group_->Find("r-404");
  EXPECT_EQ(found.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(found.status().message(), HasSubstr("model group \"target\""));
  EXPECT_THAT(found.status().message(), HasSubstr("\"r-404\""));
}

TEST_F(ModelGroupTest, FindOfTheActiveRefitWithNoneRunningIsNotFound) {
  absl::StatusOr<ModelGroup::Found> found = group_->Find("");
  EXPECT_EQ(found.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(found.status().message(), HasSubstr("model group \"target\" has no active refit"));
}

TEST_F(ModelGroupTest, FindReturnsTheEntryAndAReferenceToItsDriver) {
  FakeDriver driver;
  group_->Add(Entry("r-1"), &driver);
  {
    absl::StatusOr<ModelGroup::Found> found = group_->Find("r-1");
    ASSERT_TRUE(found.ok()) << found.status();
    EXPECT_EQ(found->entry.refit_id, "r-1");
    EXPECT_EQ(found->entry.owner, "trainer-0");
    EXPECT_EQ(found->entry.kind, "push");
    EXPECT_EQ(found->entry.label, "step 10");
    EXPECT_FALSE(found->entry.prepared);
    ASSERT_TRUE(found->driver);
    EXPECT_EQ(found->driver.get(), &driver);
    EXPECT_EQ(driver.refs(), 1);
  }
  EXPECT_EQ(driver.refs(), 0) << "DriverRef must give its reference back";
}

TEST_F(ModelGroupTest, DriverRefMovesItsReference) {
  FakeDriver driver;
  group_->Add(Entry("r-1"), &driver);
  absl::StatusOr<ModelGroup::Found> found = group_->Find("r-1");
  ASSERT_TRUE(found.ok()) << found.status();
  DriverRef moved(std::move(found->driver));
  EXPECT_FALSE(found->driver);
  EXPECT_EQ(driver.refs(), 1);
  DriverRef assigned;
  assigned = std::move(moved);
  EXPECT_EQ(assigned.get(), &driver);
  EXPECT_EQ(driver.refs(), 1);
  assigned = DriverRef();
  EXPECT_EQ(driver.refs(), 0);
}

TEST_F(ModelGroupTest, FindOfTheActiveRefitFollowsTheStoresSlot) {
  std::shared_ptr<core::RefitSession> session = BeginSession("r-active");
  ASSERT_NE(session, nullptr);
  FakeDriver driver;
  group_->Add(Entry("r-active", session), &driver);
  absl::StatusOr<ModelGroup::Found> found = group_->Find("");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->entry.refit_id, "r-active");
  EXPECT_EQ(found->entry.session, session);
  EXPECT_EQ(found->driver.get(), &driver);
  session->Abort("test done");
}

TEST_F(ModelGroupTest, ASecondRefitOnTheGroupIsAbortedNamingTheActiveOne) {
  std::shared_ptr<core::RefitSession> first = BeginSession("r-first");
  ASSERT_NE(first, nullptr);
  core::RefitOptions options;
  options.refit_id = "r-second";
  absl::StatusOr<std::unique_ptr<core::RefitSession>> second =
      core::RefitSession::Begin(group_->store(), options);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(second.status().message(), HasSubstr("\"r-first\""));
  first->Abort("test done");
}

TEST_F(ModelGroupTest, RemoveDriverDropsTheEntryOnlyForItsOwnDriver) {
  FakeDriver driver;
  FakeDriver other;
  group_->Add(Entry("r-1"), &driver);
  group_->RemoveDriver("r-1", &other);
  EXPECT_TRUE(group_->Find("r-1").ok()) << "another driver must not remove the entry";
  group_->RemoveDriver("r-unknown", &driver);  // no-op
  group_->RemoveDriver("r-1", &driver);
  EXPECT_EQ(group_->Find("r-1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(driver.refs(), 0);
  EXPECT_EQ(other.refs(), 0);
}

TEST_F(ModelGroupTest, PreparedRefitStaysWithoutADriver) {
  FakeDriver driver;
  group_->Add(Entry("r-1"), &driver);
  group_->MarkPrepared("r-1");
  group_->MarkPrepared("r-unknown");  // no-op
  // The stream that drove it ends; the prepared refit waits for Commit.
  group_->RemoveDriver("r-1", &driver);
  absl::StatusOr<ModelGroup::Found> found = group_->Find("r-1");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_TRUE(found->entry.prepared);
  EXPECT_FALSE(found->driver);
  EXPECT_EQ(driver.refs(), 0);
}

TEST_F(ModelGroupTest, ARefitAbortedBeforeItIsMarkedPreparedIsLeftToItsDriver) {
  // An Abort between the session's prepare and MarkPrepared: the refit must
  // not stay registered as PREPARED (its id taken, a Commit of it failing).
  std::shared_ptr<core::RefitSession> session = BeginSession("r-1");
  ASSERT_NE(session, nullptr);
  FakeDriver driver;
  group_->Add(Entry("r-1", session), &driver);
  session->Abort("an operator's Abort");
  group_->MarkPrepared("r-1");
  absl::StatusOr<ModelGroup::Found> found = group_->Find("r-1");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_FALSE(found->entry.prepared);
  group_->RemoveDriver("r-1", &driver);
  EXPECT_EQ(group_->Find("r-1").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ModelGroupTest, TakePreparedOfAnUnknownRefitIsNotFound) {
  absl::StatusOr<RefitEntry> taken = group_->TakePrepared("r-404");
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(taken.status().message(), HasSubstr("model group \"target\" has no refit \"r-404\""));
}

TEST_F(ModelGroupTest, TakePreparedOfARefitStillReceivingIsFailedPrecondition) {
  FakeDriver driver;
  group_->Add(Entry("r-1"), &driver);
  absl::StatusOr<RefitEntry> taken = group_->TakePrepared("r-1");
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(taken.status().message(), HasSubstr("\"r-1\" is still receiving"));
  EXPECT_THAT(taken.status().message(), HasSubstr("PREPARED"));
  EXPECT_TRUE(group_->Find("r-1").ok()) << "a refused take must keep the refit";
}

TEST_F(ModelGroupTest, TakePreparedRemovesAndReturnsTheRefit) {
  FakeDriver driver;
  group_->Add(Entry("r-1"), &driver);
  group_->MarkPrepared("r-1");
  absl::StatusOr<RefitEntry> taken = group_->TakePrepared("r-1");
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->refit_id, "r-1");
  EXPECT_EQ(taken->owner, "trainer-0");
  EXPECT_TRUE(taken->prepared);
  EXPECT_EQ(group_->Find("r-1").status().code(), absl::StatusCode::kNotFound);
  // A second Commit of the same refit finds nothing.
  EXPECT_EQ(group_->TakePrepared("r-1").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ModelGroupTest, ARefitACommitHoldsIsFoundForAnAbortAndRecordsIt) {
  FakeDriver driver;
  group_->Add(Entry("r-1"), &driver);
  group_->MarkPrepared("r-1");
  ASSERT_TRUE(group_->TakePreparedToCommit("r-1").ok());
  // A second Commit is told why it cannot have the refit.
  absl::StatusOr<RefitEntry> again = group_->TakePrepared("r-1");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.status().message(), HasSubstr("\"r-1\" is being committed"));
  EXPECT_THAT(again.status().message(), HasSubstr("an Abort ends the wait"));
  // An Abort finds it, with its owner for the owner check.
  absl::StatusOr<RefitEntry> held = group_->Committing("r-1");
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(held->refit_id, "r-1");
  EXPECT_EQ(held->owner, "trainer-0");
  EXPECT_EQ(group_->Committing("r-2").status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(group_->AbortAsked("r-1"));
  EXPECT_TRUE(group_->AskAbort("r-1"));
  EXPECT_TRUE(group_->AbortAsked("r-1"));
  EXPECT_FALSE(group_->AskAbort("r-2")) << "no Commit holds it";
  EXPECT_TRUE(group_->EndCommit("r-1")) << "the Commit learns an Abort was asked";
  EXPECT_EQ(group_->Committing("r-1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(group_->Find("r-1").status().code(), absl::StatusCode::kNotFound);
  // A commit no Abort asked about.
  group_->Add(Entry("r-3"), &driver);
  group_->MarkPrepared("r-3");
  ASSERT_TRUE(group_->TakePreparedToCommit("r-3").ok());
  EXPECT_FALSE(group_->EndCommit("r-3"));
  EXPECT_FALSE(group_->EndCommit("r-3")) << "nothing left to end";
}

TEST_F(ModelGroupTest, PutBackRegistersTheRefitAgainUnlessAnAbortAskedForIt) {
  FakeDriver driver;
  group_->Add(Entry("r-1"), &driver);
  group_->MarkPrepared("r-1");
  absl::StatusOr<RefitEntry> taken = group_->TakePreparedToCommit("r-1");
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_TRUE(group_->PutBack(*taken));
  // PREPARED again, and no Commit holds it.
  EXPECT_TRUE(group_->Find("r-1").ok());
  EXPECT_EQ(group_->Committing("r-1").status().code(), absl::StatusCode::kNotFound);
  taken = group_->TakePreparedToCommit("r-1");
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_TRUE(group_->AskAbort("r-1"));
  EXPECT_FALSE(group_->PutBack(*taken)) << "an Abort asked for it: its Abort ends it";
  EXPECT_EQ(group_->Find("r-1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(group_->Committing("r-1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(group_->AskAbort("r-1"));
}

TEST_F(ModelGroupTest, PutBackLinkedGivesBackAllOrNone) {
  std::unique_ptr<ModelGroup> draft = Group("draft");
  ASSERT_NE(draft, nullptr);
  // Listed draft first: the locks go by address, whatever the order.
  const std::vector<ModelGroup*> groups = {draft.get(), group_.get()};
  auto take = [&](std::vector<RefitEntry>* entries) {
    entries->clear();
    for (ModelGroup* g : groups) {
      g->Add(Entry("r-" + g->name()), nullptr);
      g->MarkPrepared("r-" + g->name());
      absl::StatusOr<RefitEntry> taken = g->TakePreparedToCommit("r-" + g->name());
      ASSERT_TRUE(taken.ok()) << taken.status();
      entries->push_back(*std::move(taken));
    }
  };
  std::vector<RefitEntry> entries;
  // No Abort: both registered again, no commit holds them.
  take(&entries);
  bool abort_asked = true;
  EXPECT_THAT(ModelGroup::PutBackLinked(groups, entries, {true, true}, &abort_asked),
              ElementsAre(true, true));
  EXPECT_FALSE(abort_asked);
  for (ModelGroup* g : groups) {
    EXPECT_TRUE(g->Find("r-" + g->name()).ok()) << g->name();
    EXPECT_EQ(g->Committing("r-" + g->name()).status().code(), absl::StatusCode::kNotFound);
  }
  // A session that left PREPARED is not registered; the other one is.
  entries.clear();
  for (ModelGroup* g : groups) entries.push_back(*g->TakePreparedToCommit("r-" + g->name()));
  EXPECT_THAT(ModelGroup::PutBackLinked(groups, entries, {false, true}, &abort_asked),
              ElementsAre(false, true));
  EXPECT_FALSE(abort_asked);
  EXPECT_EQ(draft->Find("r-draft").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(draft->Committing("r-draft").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(group_->Find("r-target").ok());
  ASSERT_TRUE(group_->TakePrepared("r-target").ok());
  // An Abort asked for one of them (the second listed): none is registered
  // again, and no commit holds either.
  take(&entries);
  EXPECT_TRUE(group_->AskAbort("r-target"));
  EXPECT_THAT(ModelGroup::PutBackLinked(groups, entries, {true, true}, &abort_asked),
              ElementsAre(false, false));
  EXPECT_TRUE(abort_asked);
  for (ModelGroup* g : groups) {
    EXPECT_EQ(g->Find("r-" + g->name()).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(g->Committing("r-" + g->name()).status().code(), absl::StatusCode::kNotFound);
  }
}

TEST_F(ModelGroupTest, TakeAllHandsOutDriversAndDropsOnlyPreparedRefits) {
  FakeDriver driver;
  group_->Add(Entry("r-running"), &driver);
  group_->Add(Entry("r-prepared"), nullptr);
  group_->MarkPrepared("r-prepared");
  {
    std::vector<ModelGroup::Found> all = group_->TakeAll();
    std::vector<std::string> ids;
    for (const ModelGroup::Found& f : all) {
      ids.push_back(f.entry.refit_id);
      if (f.entry.refit_id == "r-running") {
        EXPECT_EQ(f.driver.get(), &driver);
      } else {
        EXPECT_FALSE(f.driver);
      }
    }
    EXPECT_THAT(ids, UnorderedElementsAre("r-running", "r-prepared"));
    EXPECT_EQ(driver.refs(), 1);
  }
  EXPECT_EQ(driver.refs(), 0);
  EXPECT_EQ(group_->Find("r-prepared").status().code(), absl::StatusCode::kNotFound);
  // The running refit's driver removes itself once its stream has ended.
  EXPECT_TRUE(group_->Find("r-running").ok());
  group_->RemoveDriver("r-running", &driver);
  EXPECT_EQ(group_->Find("r-running").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ModelGroupTest, SessionsListsEveryRegisteredRefit) {
  std::shared_ptr<core::RefitSession> session = BeginSession("r-1");
  ASSERT_NE(session, nullptr);
  FakeDriver driver;
  group_->Add(Entry("r-1", session), &driver);
  EXPECT_THAT(group_->Sessions(), UnorderedElementsAre(session));
  group_->RemoveDriver("r-1", &driver);
  EXPECT_TRUE(group_->Sessions().empty());
  session->Abort("test done");
}

TEST_F(ModelGroupTest, SubscribersReceiveTheStoresEventsUntilUnsubscribed) {
  FakeSubscriber subscriber;
  ASSERT_TRUE(group_->Subscribe(&subscriber));
  std::shared_ptr<core::RefitSession> session = BeginSession("r-1");
  ASSERT_NE(session, nullptr);
  session->Abort("operator abort");
  std::vector<core::StoreEvent> events = subscriber.events();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].type, core::StoreEventType::kStagingStarted);
  EXPECT_EQ(events[0].refit_id, "r-1");
  EXPECT_EQ(events[0].group, "target");
  EXPECT_EQ(events[1].type, core::StoreEventType::kAborted);
  EXPECT_THAT(events[1].message, HasSubstr("operator abort"));
  EXPECT_EQ(subscriber.refs(), 0) << "fan-out must give its references back";

  group_->Unsubscribe(&subscriber);
  std::shared_ptr<core::RefitSession> next = BeginSession("r-2");
  ASSERT_NE(next, nullptr);
  next->Abort("test done");
  EXPECT_EQ(subscriber.events().size(), 2u);
}

TEST_F(ModelGroupTest, CloseSubscribersEndsEveryStreamAndRefusesNewOnes) {
  FakeSubscriber first;
  FakeSubscriber second;
  ASSERT_TRUE(group_->Subscribe(&first));
  ASSERT_TRUE(group_->Subscribe(&second));
  group_->CloseSubscribers(grpc::Status(grpc::StatusCode::UNAVAILABLE, "refitd is shutting down"));
  EXPECT_THAT(first.closed(), ::testing::ElementsAre(grpc::StatusCode::UNAVAILABLE));
  EXPECT_THAT(second.closed(), ::testing::ElementsAre(grpc::StatusCode::UNAVAILABLE));
  EXPECT_EQ(first.refs(), 0);
  EXPECT_EQ(second.refs(), 0);
  FakeSubscriber late;
  EXPECT_FALSE(group_->Subscribe(&late));
  group_->Unsubscribe(&first);
  group_->Unsubscribe(&second);
}

}  // namespace
}  // namespace refit::server
