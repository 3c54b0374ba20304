#include "server/reactor_util.h"

namespace refit::server {

IdleWatchdog::IdleWatchdog(Clock* clock) : clock_(clock), thread_([this] { Run(); }) {}

IdleWatchdog::~IdleWatchdog() { Stop(); }

void IdleWatchdog::Add(Target* target) {
  absl::MutexLock lock(&mu_);
  targets_.insert(target);
  changed_ = true;
}

void IdleWatchdog::Remove(Target* target) {
  absl::MutexLock lock(&mu_);
  targets_.erase(target);
}

void IdleWatchdog::Wake() {
  absl::MutexLock lock(&mu_);
  changed_ = true;
}

void IdleWatchdog::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void IdleWatchdog::Run() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    const absl::Time now = clock_->Now();
    absl::Time earliest = absl::InfiniteFuture();
    std::vector<Target*> expired;
    for (Target* target : targets_) {
      const absl::Time deadline = target->IdleDeadline();
      if (deadline <= now) {
        target->Ref();
        expired.push_back(target);
      } else if (deadline < earliest) {
        earliest = deadline;
      }
    }
    if (!expired.empty()) {
      mu_.Unlock();
      for (Target* target : expired) {
        target->OnIdle();
        target->Unref();
      }
      mu_.Lock();
      continue;
    }
    changed_ = false;
    clock_->AwaitWithDeadline(&mu_,
                              absl::Condition(
                                  +[](IdleWatchdog* self) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                    return self->stop_ || self->changed_;
                                  },
                                  this),
                              earliest);
  }
}

}  // namespace refit::server
