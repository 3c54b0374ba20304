// Clock: where refitd's timers read the time and sleep until a deadline.
//
// Pipeline position: ServerOptions::clock reaches RefitServiceImpl, whose
// IdleWatchdog sleeps on it and whose Push reactors arm their idle deadlines
// from Now(). A daemon runs on Clock::Real(); tests pass a fake clock that
// they advance by hand, so an idle timeout fires when the test says so rather
// than after real time has gone by.
//
// Lifecycle: Clock::Real() lives for the whole process. A clock given to a
// server must outlive it.
//
// Thread-safety: implementations are thread-safe.
#ifndef REFIT_SERVER_CLOCK_H_
#define REFIT_SERVER_CLOCK_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace refit::server {

class Clock {
 public:
  virtual ~Clock() = default;

  // The process's real time (absl::Now and absl::Mutex deadlines).
  static Clock* Real();

  virtual absl::Time Now() const = 0;

  // Called with `mu` held: waits until `condition` holds or Now() reaches
  // `deadline`, releasing `mu` while it waits, like
  // absl::Mutex::AwaitWithDeadline but on this clock's time. `mu` is held
  // again on return. Returns whether `condition` holds.
  virtual bool AwaitWithDeadline(absl::Mutex* mu, const absl::Condition& condition,
                                 absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) = 0;
};

}  // namespace refit::server

#endif  // REFIT_SERVER_CLOCK_H_
