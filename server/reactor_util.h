// Building blocks for refitd's callback-API reactors.
//
// QueuedWriteReactor: a server-streaming reactor with a message queue that any
// thread may feed (Enqueue) and end (FinishWhenDrained / FinishNow). gRPC
// allows one write in flight; the queue keeps the rest, and Finish is only
// issued once the in-flight write has completed. The reactor is reference
// counted: gRPC holds one reference until OnDone, and code on other threads
// (event fan-out, workers) holds its own, so a reactor is never deleted while
// someone is about to call it. After Finish every Enqueue is a no-op.
//
// FailedWriteStream: a server-streaming reactor that finishes at once with a
// status, for RPCs refused before any work starts.
//
// IdleWatchdog: one thread that calls OnIdle() on targets whose deadline has
// passed (Push streams that went quiet), without polling: it sleeps until the
// earliest deadline. Deadlines are times on the watchdog's Clock (the real
// one in a daemon, a hand-advanced one in tests); targets compute theirs from
// the same clock's Now().
#ifndef REFIT_SERVER_REACTOR_UTIL_H_
#define REFIT_SERVER_REACTOR_UTIL_H_

#include <atomic>
#include <deque>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/clock.h"

namespace refit::server {

template <typename Msg>
class QueuedWriteReactor : public grpc::ServerWriteReactor<Msg> {
 public:
  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  // Queues `msg`. With `coalesce`, replaces a queued (not yet written)
  // coalescable message instead of growing the queue (progress updates).
  void Enqueue(Msg msg, bool coalesce = false) {
    bool start = false;
    {
      absl::MutexLock lock(&mu_);
      if (final_.has_value()) return;
      if (coalesce && !queue_.empty() && queue_.back().second) {
        queue_.back().first = std::move(msg);
      } else {
        queue_.emplace_back(std::move(msg), coalesce);
      }
      if (!writing_) {
        writing_ = true;
        current_ = std::move(queue_.front().first);
        queue_.pop_front();
        start = true;
      }
    }
    if (start) this->StartWrite(&current_);
  }

  // Writes what is queued, then finishes with `status`. First call wins.
  void FinishWhenDrained(grpc::Status status) { SetFinal(std::move(status), false); }
  // Drops what is queued and finishes as soon as no write is in flight.
  void FinishNow(grpc::Status status) { SetFinal(std::move(status), true); }

  void OnWriteDone(bool ok) override {
    bool start = false;
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      if (!ok) queue_.clear();
      if (!queue_.empty()) {
        current_ = std::move(queue_.front().first);
        queue_.pop_front();
        start = true;
      } else {
        writing_ = false;
        if (final_.has_value() && !finish_called_) {
          finish_called_ = true;
          finish = *final_;
        }
      }
    }
    if (start) this->StartWrite(&current_);
    if (finish.has_value()) this->Finish(*finish);
  }

  void OnDone() override {
    OnFinished();
    Unref();
  }

 protected:
  ~QueuedWriteReactor() override = default;
  // Called once from OnDone, before gRPC's reference is dropped: unregister
  // from whatever hands out references to this reactor.
  virtual void OnFinished() {}

 private:
  void SetFinal(grpc::Status status, bool drop_queue) {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      if (final_.has_value()) return;
      final_ = std::move(status);
      if (drop_queue) queue_.clear();
      if (!writing_ && !finish_called_) {
        finish_called_ = true;
        finish = *final_;
      }
    }
    if (finish.has_value()) this->Finish(*finish);
  }

  std::atomic<int> refs_{1};
  absl::Mutex mu_;
  std::deque<std::pair<Msg, bool>> queue_ ABSL_GUARDED_BY(mu_);
  Msg current_;  // the message in flight; touched only by the writer of the moment
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> final_ ABSL_GUARDED_BY(mu_);
  bool finish_called_ ABSL_GUARDED_BY(mu_) = false;
};

template <typename Msg>
grpc::ServerWriteReactor<Msg>* FailedWriteStream(const grpc::Status& status) {
  class Failed final : public grpc::ServerWriteReactor<Msg> {
   public:
    explicit Failed(const grpc::Status& status) { this->Finish(status); }
    void OnDone() override { delete this; }
  };
  return new Failed(status);
}

class IdleWatchdog {
 public:
  class Target {
   public:
    virtual void Ref() = 0;
    virtual void Unref() = 0;
    // absl::InfiniteFuture() while busy or finished.
    virtual absl::Time IdleDeadline() const = 0;
    // Called without the watchdog's lock, with a reference held.
    virtual void OnIdle() = 0;

   protected:
    virtual ~Target() = default;
  };

  // `clock` must outlive the watchdog.
  explicit IdleWatchdog(Clock* clock = Clock::Real());
  ~IdleWatchdog();  // Stop()
  IdleWatchdog(const IdleWatchdog&) = delete;
  IdleWatchdog& operator=(const IdleWatchdog&) = delete;

  void Add(Target* target);
  void Remove(Target* target);
  // A target's deadline moved earlier than the watchdog may be sleeping for.
  void Wake();
  void Stop();

 private:
  void Run();
  Clock* const clock_;
  absl::Mutex mu_;
  absl::flat_hash_set<Target*> targets_ ABSL_GUARDED_BY(mu_);
  bool changed_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace refit::server

#endif  // REFIT_SERVER_REACTOR_UTIL_H_
