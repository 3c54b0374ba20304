#include "core/layer_worker.h"

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "core/layer_processor.h"
#include "core/staging_buffer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::core {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

std::string Message(const absl::Status& status) { return std::string(status.message()); }

// Counts the params released, wherever they are released (the worker thread
// drops params of layers it does not process).
class ReleaseCounter {
 public:
  // One param of `size` bytes (at most kCapacity); every param shares the
  // same storage, which nothing here reads.
  StagingBuffer Param(int64_t size) {
    return StagingBuffer(storage_, size, /*on_device=*/false, [this] { ++released_; });
  }
  std::vector<StagingBuffer> Params(int count, int64_t size) {
    std::vector<StagingBuffer> params;
    for (int i = 0; i < count; ++i) params.push_back(Param(size));
    return params;
  }
  int released() const { return released_.load(); }

  static constexpr int64_t kCapacity = 64;

 private:
  uint8_t storage_[kCapacity] = {};
  std::atomic<int> released_{0};
};

// The processor the worker runs: records each call, holds chosen layers in
// processing until the test releases them, and fails chosen layers. The
// processed layer carries the params as its kernels, so they are released
// when the result is dropped.
class FakeProcess {
 public:
  // Layer `layer` stays in processing until Release(layer).
  void Hold(int layer) {
    absl::MutexLock lock(&mu_);
    held_.insert(layer);
  }
  void Release(int layer) {
    absl::MutexLock lock(&mu_);
    held_.erase(layer);
  }
  // Processing layer `layer` returns `status`.
  void Fail(int layer, absl::Status status) {
    absl::MutexLock lock(&mu_);
    failures_[layer] = std::move(status);
  }
  // Waits until processing of `layer` has begun.
  void AwaitStarted(int layer) {
    absl::MutexLock lock(&mu_);
    auto started = [this, layer]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (int l : calls_) {
        if (l == layer) return true;
      }
      return false;
    };
    mu_.Await(absl::Condition(&started));
  }
  // Layers processed or in processing, in the order processing began.
  std::vector<int> calls() const {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  // Params each call got, in the same order.
  std::vector<int64_t> param_counts() const {
    absl::MutexLock lock(&mu_);
    return param_counts_;
  }

  // The upcoming layers processing `layer` was shown.
  std::vector<UpcomingLayer> upcoming(int layer) const {
    absl::MutexLock lock(&mu_);
    auto it = upcoming_.find(layer);
    return it == upcoming_.end() ? std::vector<UpcomingLayer>{} : it->second;
  }

  LayerWorker::ProcessFn Fn() {
    return [this](int layer, std::vector<StagingBuffer> params,
                  absl::Span<const UpcomingLayer> upcoming) {
      return Process(layer, std::move(params), upcoming);
    };
  }

 private:
  absl::StatusOr<ProcessedLayer> Process(int layer, std::vector<StagingBuffer> params,
                                         absl::Span<const UpcomingLayer> upcoming) {
    absl::MutexLock lock(&mu_);
    calls_.push_back(layer);
    upcoming_[layer].assign(upcoming.begin(), upcoming.end());
    param_counts_.push_back(static_cast<int64_t>(params.size()));
    auto released = [this, layer]()
                        ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return held_.count(layer) == 0; };
    mu_.Await(absl::Condition(&released));
    if (auto it = failures_.find(layer); it != failures_.end()) return it->second;
    ProcessedLayer out;
    out.layer = layer;
    out.kernels = std::move(params);
    return out;
  }

  mutable absl::Mutex mu_;
  std::set<int> held_ ABSL_GUARDED_BY(mu_);
  std::map<int, absl::Status> failures_ ABSL_GUARDED_BY(mu_);
  std::vector<int> calls_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> param_counts_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::vector<UpcomingLayer>> upcoming_ ABSL_GUARDED_BY(mu_);
};

std::vector<int> Layers(const std::vector<ProcessedLayer>& done) {
  std::vector<int> layers;
  for (const ProcessedLayer& p : done) layers.push_back(p.layer);
  return layers;
}

// Waits until the worker holds `bytes`. The worker has no way to wait on its
// byte count, and a Submit blocked in another thread shows itself only there
// (it adds its bytes before it waits), so this polls, yielding the CPU.
void AwaitHeldBytes(const LayerWorker& worker, int64_t bytes) {
  while (worker.held_bytes() != bytes) std::this_thread::yield();
}

// Submit on a thread of its own, for Submits that block.
class BackgroundSubmit {
 public:
  BackgroundSubmit(LayerWorker* worker, int layer, std::vector<StagingBuffer> params, int64_t bytes,
                   bool light = false)
      : thread_([this, worker, layer, params = std::move(params), bytes, light]() mutable {
          status_ = worker->Submit(layer, std::move(params), bytes, light);
          returned_.Notify();
        }) {}
  ~BackgroundSubmit() {
    if (thread_.joinable()) thread_.join();
  }

  bool returned() const { return returned_.HasBeenNotified(); }
  // Waits for Submit to return and gives its status.
  absl::Status Join() {
    thread_.join();
    return status_;
  }

 private:
  absl::Status status_;
  absl::Notification returned_;
  std::thread thread_;
};

TEST(LayerWorkerTest, ProcessesSubmittedLayersAndReturnsThemInOrder) {
  FakeProcess process;
  ReleaseCounter counter;
  LayerWorker worker(process.Fn());
  for (int layer = 0; layer < 5; ++layer) {
    ASSERT_TRUE(worker.Submit(layer, counter.Params(layer + 1, 8), 100).ok());
  }
  ASSERT_TRUE(worker.Drain().ok());
  EXPECT_THAT(process.calls(), ElementsAre(0, 1, 2, 3, 4));
  EXPECT_THAT(process.param_counts(), ElementsAre(1, 2, 3, 4, 5));
  EXPECT_EQ(worker.held_bytes(), 0);
  EXPECT_TRUE(worker.status().ok());

  std::vector<ProcessedLayer> done = worker.TakeDone();
  EXPECT_THAT(Layers(done), ElementsAre(0, 1, 2, 3, 4));
  for (const ProcessedLayer& p : done) {
    EXPECT_EQ(static_cast<int>(p.kernels.size()), p.layer + 1) << "layer " << p.layer;
  }
  EXPECT_EQ(counter.released(), 0);  // the results still own the params
  done.clear();
  EXPECT_EQ(counter.released(), 15);
}

TEST(LayerWorkerTest, TakeDoneReturnsOnlyLayersDoneSinceTheLastCall) {
  FakeProcess process;
  ReleaseCounter counter;
  LayerWorker worker(process.Fn());
  EXPECT_THAT(worker.TakeDone(), IsEmpty());
  ASSERT_TRUE(worker.Submit(0, counter.Params(1, 8), 8).ok());
  ASSERT_TRUE(worker.Submit(1, counter.Params(1, 8), 8).ok());
  ASSERT_TRUE(worker.Drain().ok());
  EXPECT_THAT(Layers(worker.TakeDone()), ElementsAre(0, 1));
  EXPECT_THAT(worker.TakeDone(), IsEmpty());
  ASSERT_TRUE(worker.Submit(2, counter.Params(1, 8), 8).ok());
  ASSERT_TRUE(worker.Drain().ok());
  EXPECT_THAT(Layers(worker.TakeDone()), ElementsAre(2));
}

TEST(LayerWorkerTest, DrainWithNothingSubmittedIsOk) {
  FakeProcess process;
  LayerWorker worker(process.Fn());
  EXPECT_TRUE(worker.Drain().ok());
  EXPECT_EQ(worker.held_bytes(), 0);
  EXPECT_TRUE(worker.status().ok());
  EXPECT_THAT(process.calls(), IsEmpty());
}

TEST(LayerWorkerTest, HeldBytesCountsTheLayerInFlightUntilItIsProcessed) {
  FakeProcess process;
  ReleaseCounter counter;
  LayerWorker worker(process.Fn());
  process.Hold(0);
  ASSERT_TRUE(worker.Submit(0, counter.Params(2, 8), 1000).ok());
  process.AwaitStarted(0);
  EXPECT_EQ(worker.held_bytes(), 1000);
  process.Release(0);
  ASSERT_TRUE(worker.Drain().ok());
  EXPECT_EQ(worker.held_bytes(), 0);
  EXPECT_THAT(Layers(worker.TakeDone()), ElementsAre(0));
}

TEST(LayerWorkerTest, SubmitReturnsOnlyOnceTheWorkerHasTakenTheLayer) {
  FakeProcess process;
  ReleaseCounter counter;
  LayerWorker worker(process.Fn());
  process.Hold(0);
  process.Hold(1);
  // The worker takes layer 0 at once and keeps it in processing.
  ASSERT_TRUE(worker.Submit(0, counter.Params(1, 8), 100).ok());
  process.AwaitStarted(0);
  EXPECT_EQ(worker.held_bytes(), 100);

  // Layer 1 is queued behind it: its Submit must wait.
  BackgroundSubmit second(&worker, 1, counter.Params(1, 8), 20);
  AwaitHeldBytes(worker, 120);
  EXPECT_FALSE(second.returned());
  EXPECT_THAT(process.calls(), ElementsAre(0));

  // Finishing layer 0 lets the worker take layer 1, and only then does the
  // second Submit return.
  process.Release(0);
  EXPECT_TRUE(second.Join().ok());
  EXPECT_THAT(Layers(worker.TakeDone()), ElementsAre(0));
  // Layer 1 is in flight (held): its bytes are still counted, layer 0's not.
  EXPECT_EQ(worker.held_bytes(), 20);
  process.AwaitStarted(1);

  process.Release(1);
  ASSERT_TRUE(worker.Drain().ok());
  EXPECT_EQ(worker.held_bytes(), 0);
  EXPECT_THAT(Layers(worker.TakeDone()), ElementsAre(1));
}

// Light layers (read in place, or small) may wait up to
// kLightLayersWaiting at once (their Submits return at once), not one more;
// a layer with staging waits until it is taken, as before.
TEST(LayerWorkerTest, LightLayersMayWaitUpToTheirLimit) {
  static_assert(LayerWorker::kLightLayersWaiting == 3, "the steps below assume 3");
  FakeProcess process;
  ReleaseCounter counter;
  LayerWorker worker(process.Fn());
  for (int l = 0; l < 6; ++l) process.Hold(l);
  ASSERT_TRUE(worker.Submit(0, counter.Params(1, 8), 100, /*light=*/true).ok());
  process.AwaitStarted(0);
  // Layers 1-3 wait for the worker, but their Submits return.
  ASSERT_TRUE(worker.Submit(1, counter.Params(1, 8), 10, /*light=*/true).ok());
  ASSERT_TRUE(worker.Submit(2, counter.Params(1, 8), 20, /*light=*/true).ok());
  ASSERT_TRUE(worker.Submit(3, counter.Params(1, 8), 40, /*light=*/true).ok());
  EXPECT_EQ(worker.held_bytes(), 170);
  // Layer 4 would be the fourth one waiting: its Submit waits.
  BackgroundSubmit fifth(&worker, 4, counter.Params(1, 8), 1, /*light=*/true);
  AwaitHeldBytes(worker, 171);
  EXPECT_FALSE(fifth.returned());
  process.Release(0);
  EXPECT_TRUE(fifth.Join().ok());
  process.AwaitStarted(1);
  // With staging, a layer waits until it is taken even behind light layers.
  BackgroundSubmit sixth(&worker, 5, counter.Params(1, 8), 1000);
  AwaitHeldBytes(worker, 1071);
  EXPECT_FALSE(sixth.returned());
  for (int l = 1; l < 4; ++l) {
    process.Release(l);
    process.AwaitStarted(l + 1);
    EXPECT_FALSE(sixth.returned()) << "layer 5 still waits behind layer " << l + 1;
  }
  process.Release(4);
  EXPECT_TRUE(sixth.Join().ok());
  process.Release(5);
  ASSERT_TRUE(worker.Drain().ok());
  EXPECT_THAT(Layers(worker.TakeDone()), ElementsAre(0, 1, 2, 3, 4, 5));
}

// Processing a layer is shown the layers queued behind it, with their host
// bytes, up to the first experts part (a negative job).
TEST(LayerWorkerTest, ProcessingIsShownTheLayersQueuedBehindIt) {
  FakeProcess process;
  ReleaseCounter counter;
  LayerWorker worker(process.Fn());
  for (int l : {0, 1, 2, -5, 3}) process.Hold(l);
  ASSERT_TRUE(worker.Submit(0, counter.Params(1, 8), 1, /*light=*/true).ok());
  process.AwaitStarted(0);
  ASSERT_TRUE(worker.Submit(1, counter.Params(2, 16), 2, /*light=*/true).ok());
  BackgroundSubmit second(&worker, 2, counter.Params(1, 24), 4, /*light=*/true);
  AwaitHeldBytes(worker, 7);
  BackgroundSubmit part(&worker, -5, counter.Params(1, 8), 8, /*light=*/true);
  AwaitHeldBytes(worker, 15);
  BackgroundSubmit third(&worker, 3, counter.Params(1, 8), 16, /*light=*/true);
  AwaitHeldBytes(worker, 31);
  EXPECT_THAT(process.upcoming(0), IsEmpty());  // nothing was queued yet
  for (int l : {0, 1, 2, -5, 3}) {
    process.Release(l);
    if (l != 3) process.AwaitStarted(l == 2 ? -5 : l == -5 ? 3 : l + 1);
  }
  const std::vector<UpcomingLayer> behind_1 = process.upcoming(1);
  ASSERT_EQ(behind_1.size(), 1u);  // layer 2, then the part ends it
  EXPECT_EQ(behind_1[0].layer, 2);
  ASSERT_EQ(behind_1[0].params.size(), 1u);
  ASSERT_EQ(behind_1[0].params[0].size(), 1u);
  EXPECT_EQ(behind_1[0].params[0][0].size(), 24u);
  EXPECT_THAT(process.upcoming(2), IsEmpty());  // the part is next
  const std::vector<UpcomingLayer> behind_part = process.upcoming(-5);
  ASSERT_EQ(behind_part.size(), 1u);
  EXPECT_EQ(behind_part[0].layer, 3);
  EXPECT_TRUE(second.Join().ok());
  EXPECT_TRUE(part.Join().ok());
  EXPECT_TRUE(third.Join().ok());
  ASSERT_TRUE(worker.Drain().ok());
  EXPECT_THAT(Layers(worker.TakeDone()), ElementsAre(0, 1, 2, -5, 3));
}

TEST(LayerWorkerTest, KeepsTheFirstErrorAndDropsLaterLayers) {
  FakeProcess process;
  ReleaseCounter counter;
  LayerWorker worker(process.Fn());
  process.Fail(1, absl::InvalidArgumentError("layer 1: non-finite weight in q_proj"));
  process.Fail(2, absl::DataLossError("layer 2 must not be processed"));
  process.Hold(1);
  ASSERT_TRUE(worker.Submit(0, counter.Params(1, 8), 10).ok());
  ASSERT_TRUE(worker.Submit(1, counter.Params(1, 8), 20).ok());
  process.AwaitStarted(1);

  // Layer 2 waits in the queue while layer 1 fails.
  BackgroundSubmit third(&worker, 2, counter.Params(3, 8), 30);
  AwaitHeldBytes(worker, 50);
  process.Release(1);
  absl::Status third_status = third.Join();
  EXPECT_EQ(third_status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(third_status), HasSubstr("non-finite weight in q_proj"));

  absl::Status drained = worker.Drain();
  EXPECT_EQ(drained.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(drained), HasSubstr("non-finite weight in q_proj"));
  absl::Status status = worker.status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), HasSubstr("layer 1"));

  // Layer 2 was dropped unprocessed; its params are released.
  EXPECT_THAT(process.calls(), ElementsAre(0, 1));
  EXPECT_EQ(worker.held_bytes(), 0);
  EXPECT_THAT(Layers(worker.TakeDone()), ElementsAre(0));
  EXPECT_EQ(counter.released(), 1 + 1 + 3);  // layer 1 failed, layer 2 dropped, layer 0 taken

  // Later Submits return the first error and queue nothing.
  absl::Status later = worker.Submit(3, counter.Params(2, 8), 40);
  EXPECT_EQ(later.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(later), HasSubstr("non-finite weight in q_proj"));
  EXPECT_EQ(worker.held_bytes(), 0);
  EXPECT_EQ(counter.released(), 1 + 1 + 3 + 2);
  EXPECT_EQ(worker.Drain().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(process.calls(), ElementsAre(0, 1));
}

TEST(LayerWorkerTest, StopDropsQueuedLayersAndWaitsForTheOneInFlight) {
  FakeProcess process;
  ReleaseCounter counter;
  LayerWorker worker(process.Fn());
  process.Hold(0);
  ASSERT_TRUE(worker.Submit(0, counter.Params(1, 8), 100).ok());
  process.AwaitStarted(0);
  BackgroundSubmit queued(&worker, 1, counter.Params(2, 8), 20);
  AwaitHeldBytes(worker, 120);

  absl::Notification stopped;
  std::thread stopper([&] {
    worker.Stop();
    stopped.Notify();
  });
  // Stop drops the queued layer, which wakes its Submit with CANCELLED...
  absl::Status queued_status = queued.Join();
  EXPECT_EQ(queued_status.code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(Message(queued_status), HasSubstr("stopped"));
  // ...while Stop itself still waits for layer 0, which is in processing.
  EXPECT_FALSE(stopped.HasBeenNotified());

  process.Release(0);
  stopper.join();
  EXPECT_TRUE(stopped.HasBeenNotified());
  EXPECT_THAT(process.calls(), ElementsAre(0));
  EXPECT_THAT(worker.TakeDone(), IsEmpty());  // the in-flight result is dropped
  EXPECT_EQ(worker.held_bytes(), 0);
  EXPECT_EQ(counter.released(), 1 + 2);
  EXPECT_TRUE(worker.status().ok());
}

TEST(LayerWorkerTest, StopIsIdempotentAndLaterCallsAreCancelled) {
  FakeProcess process;
  ReleaseCounter counter;
  LayerWorker worker(process.Fn());
  ASSERT_TRUE(worker.Submit(0, counter.Params(1, 8), 10).ok());
  worker.Stop();
  worker.Stop();

  absl::Status submit = worker.Submit(1, counter.Params(1, 8), 10);
  EXPECT_EQ(submit.code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(Message(submit), HasSubstr("stopped"));
  absl::Status drain = worker.Drain();
  EXPECT_EQ(drain.code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(Message(drain), HasSubstr("stopped"));
  EXPECT_EQ(worker.held_bytes(), 0);
  EXPECT_THAT(worker.TakeDone(), IsEmpty());
  EXPECT_EQ(counter.released(), 2);
  // Submit returned once layer 0 was taken, so it was processed (and its
  // result dropped by Stop); layer 1 never reached the processor.
  EXPECT_THAT(process.calls(), ElementsAre(0));
  worker.Stop();
}

TEST(LayerWorkerTest, StopBeforeAnySubmitStartsNothing) {
  FakeProcess process;
  ReleaseCounter counter;
  LayerWorker worker(process.Fn());
  worker.Stop();
  absl::Status submit = worker.Submit(0, counter.Params(1, 8), 10);
  EXPECT_EQ(submit.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(counter.released(), 1);
  EXPECT_THAT(process.calls(), IsEmpty());
}

TEST(LayerWorkerTest, DestructorWithWorkInFlightJoinsCleanly) {
  FakeProcess process;
  ReleaseCounter counter;
  auto worker = std::make_unique<LayerWorker>(process.Fn());
  LayerWorker* raw = worker.get();
  process.Hold(0);
  ASSERT_TRUE(raw->Submit(0, counter.Params(1, 8), 100).ok());
  process.AwaitStarted(0);
  BackgroundSubmit queued(raw, 1, counter.Params(1, 8), 20);
  AwaitHeldBytes(*raw, 120);

  absl::Notification destroyed;
  std::thread destroyer([&] {
    worker.reset();
    destroyed.Notify();
  });
  // The destructor stops the worker: the queued Submit is cancelled, and the
  // destructor waits for layer 0.
  EXPECT_EQ(queued.Join().code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(destroyed.HasBeenNotified());
  process.Release(0);
  destroyer.join();
  EXPECT_TRUE(destroyed.HasBeenNotified());
  EXPECT_THAT(process.calls(), ElementsAre(0));
  EXPECT_EQ(counter.released(), 2);
}

TEST(LayerWorkerTest, DestructorAfterProcessingJoinsCleanly) {
  FakeProcess process;
  ReleaseCounter counter;
  {
    LayerWorker worker(process.Fn());
    ASSERT_TRUE(worker.Submit(0, counter.Params(1, 8), 10).ok());
    ASSERT_TRUE(worker.Drain().ok());
  }
  EXPECT_THAT(process.calls(), ElementsAre(0));
  EXPECT_EQ(counter.released(), 1);  // the untaken result went with the worker
}

}  // namespace
}  // namespace refit::core
