// FakeClock: a server::Clock whose time moves only when a test advances it,
// so that tests of timeouts (the Push idle watchdog) neither sleep nor race
// the real clock.
//
// A thread that waits on the clock (AwaitWithDeadline) is registered with its
// deadline; AdvanceTime wakes every waiter whose deadline has been reached.
// AwaitWaiter lets a test block until a timer has been armed (someone waits
// for a given deadline) before it advances the time past that deadline.
//
// Lock order: the clock's mutex, then a waiter's mutex (AdvanceTime); a waiter
// releases its own mutex before it takes the clock's, and Now() takes no lock,
// so callers may read the time under their own locks.
//
// Thread-safe.
#ifndef REFIT_TESTS_TESTING_FAKE_CLOCK_H_
#define REFIT_TESTS_TESTING_FAKE_CLOCK_H_

#include <atomic>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/clock.h"

namespace refit::testing {

class FakeClock final : public server::Clock {
 public:
  // A fixed, arbitrary start far from the epoch and from the real time, so a
  // deadline computed from the real clock by mistake never looks plausible.
  explicit FakeClock(absl::Time start = absl::FromCivil(absl::CivilSecond(2100, 1, 1, 0, 0, 0),
                                                        absl::UTCTimeZone()))
      : now_ns_(absl::ToUnixNanos(start)) {}
  FakeClock(const FakeClock&) = delete;
  FakeClock& operator=(const FakeClock&) = delete;

  absl::Time Now() const override {
    return absl::FromUnixNanos(now_ns_.load(std::memory_order_acquire));
  }

  bool AwaitWithDeadline(absl::Mutex* mu, const absl::Condition& condition, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) override {
    if (condition.Eval()) return true;
    if (Now() >= deadline) return false;
    Waiter waiter{mu, deadline};
    // Registration and AdvanceTime both hold mu_, so a time step either
    // precedes it (seen here) or finds the waiter registered: no lost wakeup.
    mu->Unlock();
    bool expired = false;
    {
      absl::MutexLock lock(&mu_);
      expired = Now() >= deadline;
      if (!expired) waiters_.insert(&waiter);
    }
    mu->Lock();
    if (expired) return condition.Eval();
    struct Wake {
      const absl::Condition* condition;
      const Waiter* waiter;
      bool operator()() const ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return waiter->fired || condition->Eval();
      }
    } wake{&condition, &waiter};
    mu->Await(absl::Condition(&wake));
    mu->Unlock();
    {
      absl::MutexLock lock(&mu_);
      waiters_.erase(&waiter);
    }
    mu->Lock();
    return condition.Eval();
  }

  // Moves the time forward by `step` and wakes the waiters whose deadline it
  // reached.
  void AdvanceTime(absl::Duration step) {
    absl::MutexLock lock(&mu_);
    const absl::Time now = Now() + step;
    now_ns_.store(absl::ToUnixNanos(now), std::memory_order_release);
    for (Waiter* waiter : waiters_) {
      if (waiter->deadline > now) continue;
      absl::MutexLock wake(waiter->mu);
      waiter->fired = true;
    }
  }

  // Blocks until some thread waits on this clock for exactly `deadline` (a
  // timer armed for it), or `limit` of real time passes. Returns whether a
  // waiter showed up.
  bool AwaitWaiter(absl::Time deadline, absl::Duration limit = absl::Seconds(60)) {
    struct Armed {
      const FakeClock* clock;
      absl::Time deadline;
      bool operator()() const ABSL_NO_THREAD_SAFETY_ANALYSIS {
        for (const Waiter* waiter : clock->waiters_) {
          if (waiter->deadline == deadline) return true;
        }
        return false;
      }
    } armed{this, deadline};
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&armed), limit);
  }

 private:
  struct Waiter {
    absl::Mutex* mu;
    absl::Time deadline;
    bool fired = false;  // guarded by *mu
  };

  std::atomic<int64_t> now_ns_;
  absl::Mutex mu_;
  absl::flat_hash_set<Waiter*> waiters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::testing

#endif  // REFIT_TESTS_TESTING_FAKE_CLOCK_H_
