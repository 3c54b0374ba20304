#include "core/layer_worker.h"

#include <utility>

namespace refit::core {

LayerWorker::LayerWorker(ProcessFn process) : process_(std::move(process)) {}

LayerWorker::~LayerWorker() { Stop(); }

absl::Status LayerWorker::Submit(int layer, std::vector<StagingBuffer> params, int64_t bytes,
                                 bool light) {
  absl::MutexLock lock(&mu_);
  if (stop_) return absl::CancelledError("the layer worker is stopped");
  if (!status_.ok()) return status_;
  pending_.push_back(Job{layer, std::move(params), bytes});
  held_bytes_ += bytes;
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
  const size_t may_wait = light ? kLightLayersWaiting : 0;
  auto taken = [this, may_wait]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return pending_.size() <= may_wait || stop_ || !status_.ok();
  };
  mu_.Await(absl::Condition(&taken));
  if (stop_) return absl::CancelledError("the layer worker is stopped");
  return status_;
}

absl::Status LayerWorker::Drain() {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return (pending_.empty() && !busy_) || stop_;
  };
  mu_.Await(absl::Condition(&idle));
  if (stop_ && status_.ok()) return absl::CancelledError("the layer worker is stopped");
  return status_;
}

std::vector<ProcessedLayer> LayerWorker::TakeDone() {
  absl::MutexLock lock(&mu_);
  return std::exchange(done_, {});
}

absl::Status LayerWorker::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

int64_t LayerWorker::held_bytes() const {
  absl::MutexLock lock(&mu_);
  return held_bytes_;
}

void LayerWorker::Stop() {
  std::thread thread;
  std::deque<Job> dropped;
  std::vector<ProcessedLayer> uncollected;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    dropped = std::exchange(pending_, {});
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !busy_; };
    mu_.Await(absl::Condition(&idle));
    held_bytes_ = 0;
    uncollected = std::exchange(done_, {});
    thread = std::move(thread_);
  }
  // Staging is freed outside the lock (device buffers call the runtime).
  dropped.clear();
  uncollected.clear();
  if (thread.joinable()) thread.join();
}

void LayerWorker::Loop() {
  mu_.Lock();
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !pending_.empty(); };
  while (true) {
    mu_.Await(absl::Condition(&ready));
    if (stop_) break;
    Job job = std::move(pending_.front());
    pending_.pop_front();
    if (!status_.ok()) {  // drop work after the first failure
      held_bytes_ -= job.bytes;
      // Freeing staging may call into the device runtime: not under the lock.
      mu_.Unlock();
      job.params.clear();
      mu_.Lock();
      continue;
    }
    busy_ = true;
    // The layers behind this one (negative: an experts part, where the
    // look-ahead ends). Their bytes outlive this call: see the header.
    std::vector<UpcomingLayer> upcoming;
    for (const Job& next : pending_) {
      if (next.layer < 0 || upcoming.size() == kUpcomingLayers) break;
      UpcomingLayer& u = upcoming.emplace_back();
      u.layer = next.layer;
      for (const StagingBuffer& param : next.params) u.params.push_back(param.HostPieces());
    }
    // Processing takes long; Submit, Drain and TakeDone go on meanwhile.
    mu_.Unlock();
    absl::StatusOr<ProcessedLayer> processed = process_(job.layer, std::move(job.params), upcoming);
    job.params.clear();
    mu_.Lock();
    busy_ = false;
    held_bytes_ -= job.bytes;
    if (stop_) {
      mu_.Unlock();
      return;  // `processed` is freed after the unlock
    }
    if (!processed.ok()) {
      status_ = processed.status();
    } else {
      done_.push_back(*std::move(processed));
    }
  }
  mu_.Unlock();
}

}  // namespace refit::core
