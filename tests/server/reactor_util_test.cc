// The reactor building blocks: WriteQueue on its own; QueuedWriteReactor's
// queue, coalescing, finishing and lifetime against a real in-process gRPC
// server on port 0 (through a Watch-shaped server stream whose handler
// scripts the reactor); and IdleWatchdog calling targets whose deadline has
// passed.
#include "server/reactor_util.h"

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "refit/v1/refit.grpc.pb.h"
#include "tests/server/server_test_util.h"
#include "tests/testing/fake_clock.h"

namespace refit::server {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

// Generous: only reached when something hangs.
constexpr absl::Duration kLimit = absl::Seconds(30);

v1::WatchEvent Event(uint64_t version) {
  v1::WatchEvent event;
  event.set_version(version);
  return event;
}

// Counts OnFinished calls and says when the reactor is deleted (after gRPC
// and every other holder dropped their references).
class ScriptedReactor : public QueuedWriteReactor<v1::WatchEvent> {
 public:
  ScriptedReactor(std::atomic<int>* finished, absl::Notification* deleted)
      : finished_(finished), deleted_(deleted) {}

 protected:
  ~ScriptedReactor() override { deleted_->Notify(); }
  void OnFinished() override { finished_->fetch_add(1); }

 private:
  std::atomic<int>* finished_;
  absl::Notification* deleted_;
};

// Serves Watch with a ScriptedReactor; `script` runs in the handler, before
// gRPC has bound the stream, so what it enqueues is in place before the
// first write can complete.
class ScriptedService : public v1::RefitService::CallbackService {
 public:
  std::function<void(ScriptedReactor*)> script;
  std::atomic<int> finished{0};
  absl::Notification deleted;

  grpc::ServerWriteReactor<v1::WatchEvent>* Watch(grpc::CallbackServerContext* context,
                                                  const v1::WatchRequest* request) override {
    auto* reactor = new ScriptedReactor(&finished, &deleted);
    if (script) script(reactor);
    return reactor;
  }
};

class QueuedWriteReactorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::HoldGrpcLibrary();
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    stub_ = v1::RefitService::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }

  struct Received {
    std::vector<uint64_t> versions;
    grpc::Status status;
  };
  // One whole Watch call.
  Received WatchAll() {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + kLimit));
    std::unique_ptr<grpc::ClientReader<v1::WatchEvent>> reader =
        stub_->Watch(&context, v1::WatchRequest());
    Received received;
    v1::WatchEvent event;
    while (reader->Read(&event)) received.versions.push_back(event.version());
    received.status = reader->Finish();
    return received;
  }

  void ExpectReleased() {
    EXPECT_TRUE(service_.deleted.WaitForNotificationWithTimeout(kLimit))
        << "the reactor was never deleted";
    EXPECT_EQ(service_.finished.load(), 1);
  }

  ScriptedService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::RefitService::Stub> stub_;
};

TEST_F(QueuedWriteReactorTest, WritesQueuedMessagesInOrderThenFinishes) {
  service_.script = [](ScriptedReactor* r) {
    for (uint64_t v = 1; v <= 5; ++v) r->Enqueue(Event(v));
    r->FinishWhenDrained(grpc::Status::OK);
  };
  Received received = WatchAll();
  EXPECT_TRUE(received.status.ok()) << received.status.error_message();
  EXPECT_THAT(received.versions, ElementsAre(1, 2, 3, 4, 5));
  ExpectReleased();
}

TEST_F(QueuedWriteReactorTest, CoalescingReplacesOnlyAQueuedCoalescableTail) {
  service_.script = [](ScriptedReactor* r) {
    r->Enqueue(Event(1), /*coalesce=*/true);  // in flight at once: never replaced
    r->Enqueue(Event(2), /*coalesce=*/true);
    r->Enqueue(Event(3), /*coalesce=*/true);  // replaces 2
    r->Enqueue(Event(4));                     // not coalescable: kept, and ends the run
    r->Enqueue(Event(5), /*coalesce=*/true);
    r->Enqueue(Event(6), /*coalesce=*/true);  // replaces 5
    r->Enqueue(Event(7));
    r->Enqueue(Event(8));  // a plain message is never replaced
    r->FinishWhenDrained(grpc::Status::OK);
  };
  Received received = WatchAll();
  EXPECT_TRUE(received.status.ok()) << received.status.error_message();
  EXPECT_THAT(received.versions, ElementsAre(1, 3, 4, 6, 7, 8));
  ExpectReleased();
}

TEST_F(QueuedWriteReactorTest, FinishNowDropsWhatIsQueuedButNotTheWriteInFlight) {
  service_.script = [](ScriptedReactor* r) {
    r->Enqueue(Event(1));
    r->Enqueue(Event(2));
    r->Enqueue(Event(3));
    r->FinishNow(grpc::Status(grpc::StatusCode::ABORTED, "refit r-1 aborted by operator"));
  };
  Received received = WatchAll();
  EXPECT_EQ(received.status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(received.status.error_message(), "refit r-1 aborted by operator");
  EXPECT_THAT(received.versions, ElementsAre(1));
  ExpectReleased();
}

TEST_F(QueuedWriteReactorTest, FirstFinishWinsAndLaterMessagesAreDropped) {
  service_.script = [](ScriptedReactor* r) {
    r->Enqueue(Event(1));
    r->FinishWhenDrained(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "first finish"));
    r->FinishNow(grpc::Status(grpc::StatusCode::CANCELLED, "second finish"));
    r->Enqueue(Event(2));
  };
  Received received = WatchAll();
  EXPECT_EQ(received.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(received.status.error_message(), "first finish");
  EXPECT_THAT(received.versions, ElementsAre(1));
  ExpectReleased();
}

TEST_F(QueuedWriteReactorTest, FinishWithNothingQueuedEndsTheStreamAtOnce) {
  service_.script = [](ScriptedReactor* r) {
    r->FinishWhenDrained(grpc::Status(grpc::StatusCode::NOT_FOUND, "no model group \"x\""));
  };
  Received received = WatchAll();
  EXPECT_EQ(received.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(received.status.error_message(), "no model group \"x\"");
  EXPECT_THAT(received.versions, IsEmpty());
  ExpectReleased();
}

// A holder on another thread (event fan-out) feeds the stream while the
// client reads, and keeps the reactor alive past OnDone until it lets go.
class HeldReactor {
 public:
  void Set(ScriptedReactor* reactor) {
    reactor->Ref();
    absl::MutexLock lock(&mu_);
    reactor_ = reactor;
  }
  ScriptedReactor* Wait() {
    absl::MutexLock lock(&mu_);
    auto set = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return reactor_ != nullptr; };
    mu_.AwaitWithTimeout(absl::Condition(&set), kLimit);
    return reactor_;
  }

 private:
  absl::Mutex mu_;
  ScriptedReactor* reactor_ ABSL_GUARDED_BY(mu_) = nullptr;
};

TEST_F(QueuedWriteReactorTest, AnotherThreadFeedsTheStreamAndHoldsTheReactorPastOnDone) {
  HeldReactor held;
  service_.script = [&held](ScriptedReactor* r) { held.Set(r); };
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kLimit));
  std::unique_ptr<grpc::ClientReader<v1::WatchEvent>> reader =
      stub_->Watch(&context, v1::WatchRequest());
  ScriptedReactor* reactor = held.Wait();
  ASSERT_NE(reactor, nullptr);

  v1::WatchEvent event;
  reactor->Enqueue(Event(1));
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.version(), 1u);
  // Nothing else is queued, so a coalescable message is written as it is.
  reactor->Enqueue(Event(2), /*coalesce=*/true);
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.version(), 2u);
  reactor->FinishWhenDrained(grpc::Status::OK);
  EXPECT_FALSE(reader->Read(&event));
  grpc::Status status = reader->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();

  // The holder's reference keeps the reactor after the call is done; an
  // Enqueue now is a no-op rather than a write on a finished stream.
  reactor->Enqueue(Event(3));
  EXPECT_FALSE(service_.deleted.HasBeenNotified());
  reactor->Unref();
  ExpectReleased();
}

TEST_F(QueuedWriteReactorTest, ReactorIsReleasedWhenTheClientCancels) {
  HeldReactor held;
  service_.script = [&held](ScriptedReactor* r) { held.Set(r); };
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kLimit));
  std::unique_ptr<grpc::ClientReader<v1::WatchEvent>> reader =
      stub_->Watch(&context, v1::WatchRequest());
  ScriptedReactor* reactor = held.Wait();
  ASSERT_NE(reactor, nullptr);
  reactor->Enqueue(Event(1));
  v1::WatchEvent event;
  ASSERT_TRUE(reader->Read(&event));

  context.TryCancel();
  // Writes after the cancellation fail and the queue is dropped; the reactor
  // still has to finish for gRPC to let it go.
  reactor->Enqueue(Event(2));
  reactor->Enqueue(Event(3));
  reactor->FinishNow(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
  while (reader->Read(&event)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  reactor->Unref();
  ExpectReleased();
}

// A watchdog target whose deadline the test sets; OnIdle notifies.
class FakeTarget : public IdleWatchdog::Target {
 public:
  void Ref() override { refs_.fetch_add(1); }
  void Unref() override { refs_.fetch_sub(1); }
  absl::Time IdleDeadline() const override {
    absl::MutexLock lock(&mu_);
    return deadline_;
  }
  void OnIdle() override {
    EXPECT_GT(refs_.load(), 0) << "OnIdle must be called with a reference held";
    {
      absl::MutexLock lock(&mu_);
      deadline_ = absl::InfiniteFuture();  // as a Push stream does once it is ended
    }
    idle_.Notify();
  }

  void set_deadline(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    deadline_ = deadline;
  }
  absl::Notification& idle() { return idle_; }
  int refs() const { return refs_.load(); }

 private:
  std::atomic<int> refs_{0};
  mutable absl::Mutex mu_;
  absl::Time deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Notification idle_;
};

// WriteQueue on its own, as the bidirectional reactors (Attach, regions)
// drive it under their locks.
TEST(WriteQueueTest, OneWriteInFlightTheRestInOrder) {
  WriteQueue<v1::WatchEvent> q;
  v1::WatchEvent* first = q.Push(Event(1));
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(first->version(), 1u);
  EXPECT_EQ(q.Push(Event(2)), nullptr);  // a write is in flight
  EXPECT_EQ(q.Push(Event(3)), nullptr);
  v1::WatchEvent* next = q.WriteDone(true);
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(next->version(), 2u);
  next = q.WriteDone(true);
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(next->version(), 3u);
  EXPECT_EQ(q.WriteDone(true), nullptr);
  // Idle again: the next message starts at once.
  next = q.Push(Event(4));
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(next->version(), 4u);
}

TEST(WriteQueueTest, CoalescingReplacesOnlyAQueuedCoalescableTail) {
  WriteQueue<v1::WatchEvent> q;
  ASSERT_NE(q.Push(Event(1), /*coalesce=*/true), nullptr);  // in flight: not replaced
  EXPECT_EQ(q.Push(Event(2), /*coalesce=*/true), nullptr);
  EXPECT_EQ(q.Push(Event(3), /*coalesce=*/true), nullptr);  // replaces 2
  EXPECT_EQ(q.Push(Event(4)), nullptr);
  EXPECT_EQ(q.Push(Event(5), /*coalesce=*/true), nullptr);  // after a plain one: queued
  std::vector<uint64_t> written;
  for (v1::WatchEvent* m = q.WriteDone(true); m != nullptr; m = q.WriteDone(true)) {
    written.push_back(m->version());
  }
  EXPECT_THAT(written, ElementsAre(3, 4, 5));
}

TEST(WriteQueueTest, AFailedWriteDropsWhatIsQueued) {
  WriteQueue<v1::WatchEvent> q;
  ASSERT_NE(q.Push(Event(1)), nullptr);
  EXPECT_EQ(q.Push(Event(2)), nullptr);
  EXPECT_EQ(q.WriteDone(false), nullptr);
  ASSERT_TRUE(q.Close(grpc::Status(grpc::StatusCode::UNAVAILABLE, "broke"), false));
  std::optional<grpc::Status> finish = q.TakeFinish();
  ASSERT_TRUE(finish.has_value());
  EXPECT_EQ(finish->error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST(WriteQueueTest, FinishComesOnceAndOnlyWithNoWriteInFlight) {
  WriteQueue<v1::WatchEvent> q;
  EXPECT_FALSE(q.TakeFinish().has_value());  // not closed
  ASSERT_NE(q.Push(Event(1)), nullptr);
  EXPECT_EQ(q.Push(Event(2)), nullptr);
  ASSERT_TRUE(q.Close(grpc::Status(grpc::StatusCode::ABORTED, "first"), /*drop_queue=*/true));
  EXPECT_TRUE(q.closed());
  EXPECT_FALSE(q.Close(grpc::Status::OK, false));  // first call wins
  EXPECT_EQ(q.Push(Event(3)), nullptr);            // closed: dropped
  EXPECT_FALSE(q.TakeFinish().has_value());        // 1 is still being written
  EXPECT_EQ(q.WriteDone(true), nullptr);           // 2 was dropped with the queue
  std::optional<grpc::Status> finish = q.TakeFinish();
  ASSERT_TRUE(finish.has_value());
  EXPECT_EQ(finish->error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(finish->error_message(), "first");
  EXPECT_FALSE(q.TakeFinish().has_value());
}

TEST(WriteQueueTest, CloseWithoutDroppingWritesTheQueueFirst) {
  WriteQueue<v1::WatchEvent> q;
  ASSERT_NE(q.Push(Event(1)), nullptr);
  EXPECT_EQ(q.Push(Event(2)), nullptr);
  ASSERT_TRUE(q.Close(grpc::Status::OK, /*drop_queue=*/false));
  v1::WatchEvent* next = q.WriteDone(true);
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(next->version(), 2u);
  EXPECT_FALSE(q.TakeFinish().has_value());
  EXPECT_EQ(q.WriteDone(true), nullptr);
  EXPECT_TRUE(q.TakeFinish().has_value());
}

TEST(IdleWatchdogTest, CallsATargetWhoseDeadlineHasPassed) {
  IdleWatchdog watchdog;
  FakeTarget target;
  target.set_deadline(absl::InfinitePast());
  watchdog.Add(&target);
  EXPECT_TRUE(target.idle().WaitForNotificationWithTimeout(kLimit));
  watchdog.Remove(&target);
  watchdog.Stop();
  EXPECT_EQ(target.refs(), 0);
}

TEST(IdleWatchdogTest, WakeMakesItSeeADeadlineThatMovedEarlier) {
  IdleWatchdog watchdog;
  FakeTarget busy;  // InfiniteFuture: the watchdog sleeps with no deadline
  watchdog.Add(&busy);
  FakeTarget quiet;
  watchdog.Add(&quiet);
  quiet.set_deadline(absl::InfinitePast());
  watchdog.Wake();
  EXPECT_TRUE(quiet.idle().WaitForNotificationWithTimeout(kLimit));
  EXPECT_FALSE(busy.idle().HasBeenNotified());
  watchdog.Remove(&busy);
  watchdog.Remove(&quiet);
  watchdog.Stop();
  watchdog.Stop();  // idempotent; the destructor stops again
}

TEST(IdleWatchdogTest, FiresWhenItsClockReachesTheDeadline) {
  ::refit::testing::FakeClock clock;
  IdleWatchdog watchdog(&clock);
  FakeTarget target;
  const absl::Time deadline = clock.Now() + absl::Seconds(10);
  target.set_deadline(deadline);
  watchdog.Add(&target);
  // The watchdog sleeps on its clock until the deadline, not on real time.
  ASSERT_TRUE(clock.AwaitWaiter(deadline, kLimit));
  clock.AdvanceTime(absl::Seconds(9));
  EXPECT_FALSE(target.idle().HasBeenNotified());  // a step short of it wakes nothing
  clock.AdvanceTime(absl::Seconds(1));
  EXPECT_TRUE(target.idle().WaitForNotificationWithTimeout(kLimit));
  watchdog.Remove(&target);
  watchdog.Stop();
  EXPECT_EQ(target.refs(), 0);
}

}  // namespace
}  // namespace refit::server
