// Building blocks for refitd's callback-API reactors.
//
// WriteQueue: the queue of messages and the final status of one stream, for
// reactors that keep more state under their own lock (bidirectional ones).
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
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/clock.h"

namespace refit::server {

// Messages a server stream may hold for a client that is slow to read them:
// a client that has stopped reading must not grow the daemon's memory. A
// stream past this ends RESOURCE_EXHAUSTED (engines: their lease ends).
inline constexpr size_t kMaxQueuedMessages = 256;

// The write side of a callback stream, held by a reactor under its own
// mutex (it does not lock): gRPC allows one write in flight, the queue keeps
// the rest, and the final status is handed out once, when no write is in
// flight. A returned message is the one to StartWrite; it stays valid until
// its write completes. After Close, Push is a no-op.
template <typename Msg>
class WriteQueue {
 public:
  // Queues `msg`; with `coalesce`, replaces a queued (not yet written)
  // coalescable message instead of growing the queue (progress updates).
  // Returns the message to start writing now, or null (a write is in
  // flight, or the queue is closed).
  Msg* Push(Msg msg, bool coalesce = false) {
    if (final_.has_value()) return nullptr;
    if (coalesce && !queue_.empty() && queue_.back().second) {
      queue_.back().first = std::move(msg);
    } else {
      queue_.emplace_back(std::move(msg), coalesce);
    }
    if (writing_) return nullptr;
    writing_ = true;
    return PopCurrent();
  }

  // The write in flight completed. Returns the next message to write, or
  // null: the queue is empty, or the write failed (the stream is broken;
  // what was queued is dropped).
  Msg* WriteDone(bool ok) {
    if (!ok) queue_.clear();
    if (queue_.empty()) {
      writing_ = false;
      return nullptr;
    }
    return PopCurrent();
  }

  // Sets the final status (first call wins: false after). With
  // `drop_queue`, what is queued is not written.
  bool Close(grpc::Status status, bool drop_queue) {
    if (final_.has_value()) return false;
    final_ = std::move(status);
    if (drop_queue) queue_.clear();
    return true;
  }
  bool closed() const { return final_.has_value(); }
  // kMaxQueuedMessages wait behind the one in flight: the client is not
  // reading, and the caller ends the stream instead of queuing more.
  bool full() const { return queue_.size() >= kMaxQueuedMessages; }

  // The status to Finish with, once: after Close, when no write is in
  // flight.
  std::optional<grpc::Status> TakeFinish() {
    if (!final_.has_value() || writing_ || finish_taken_) return std::nullopt;
    finish_taken_ = true;
    return final_;
  }

 private:
  Msg* PopCurrent() {
    current_ = std::move(queue_.front().first);
    queue_.pop_front();
    return &current_;
  }

  std::deque<std::pair<Msg, bool>> queue_;  // message, coalescable
  Msg current_;                             // the message in flight
  bool writing_ = false;
  std::optional<grpc::Status> final_;
  bool finish_taken_ = false;
};

template <typename Msg>
class QueuedWriteReactor : public grpc::ServerWriteReactor<Msg> {
 public:
  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  // Queues `msg`. With `coalesce`, replaces a queued (not yet written)
  // coalescable message instead of growing the queue (progress updates).
  // With kMaxQueuedMessages waiting already, the stream ends at once with
  // RESOURCE_EXHAUSTED instead.
  void Enqueue(Msg msg, bool coalesce = false) {
    Msg* start = nullptr;
    bool overflowed = false;
    {
      absl::MutexLock lock(&mu_);
      if (!coalesce && !out_.closed() && out_.full()) {
        overflowed = true;
      } else {
        start = out_.Push(std::move(msg), coalesce);
      }
    }
    if (start != nullptr) this->StartWrite(start);
    if (overflowed) {
      FinishNow(
          grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                       absl::StrCat("the client did not read its stream: ", kMaxQueuedMessages,
                                    " messages waited to be sent to it; call again")));
    }
  }

  // Writes what is queued, then finishes with `status`. First call wins.
  void FinishWhenDrained(grpc::Status status) { SetFinal(std::move(status), false); }
  // Drops what is queued and finishes as soon as no write is in flight.
  void FinishNow(grpc::Status status) { SetFinal(std::move(status), true); }

  void OnWriteDone(bool ok) override {
    Msg* next = nullptr;
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      next = out_.WriteDone(ok);
      if (next == nullptr) finish = out_.TakeFinish();
    }
    if (next != nullptr) this->StartWrite(next);
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
      if (!out_.Close(std::move(status), drop_queue)) return;
      finish = out_.TakeFinish();
    }
    if (finish.has_value()) this->Finish(*finish);
  }

  std::atomic<int> refs_{1};
  absl::Mutex mu_;
  WriteQueue<Msg> out_ ABSL_GUARDED_BY(mu_);
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
