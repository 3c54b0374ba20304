// LayerWorker: processes complete layers on a thread of its own while the
// session keeps receiving the next ones.
//
// Pipeline position: between LayerAssembler and commit. When a chunk
// completes a layer, the session Submits the layer's params; the worker runs
// `process` on them and keeps the result until the session collects it
// (TakeDone). Submit returns once the worker has taken the layer, so at most
// one complete layer waits for the processor while the next one arrives:
// without that, a fast sender queues complete layers (each holding its
// high-precision staging) ahead of the processor, and peak memory grows with
// the model instead of with the largest layer. A layer read in place (or a
// small one) touches little staging, so up to kLightLayersWaiting such
// layers may wait.
//
// Errors: the first failed layer's status is kept; later layers are dropped
// and every later Submit / Drain returns it.
//
// While it processes a layer, `process` is also shown the layers queued
// behind it (UpcomingLayer: their host bytes), so that it can start reading
// the next weight early. Those bytes stay valid meanwhile: only the worker
// takes layers off the queue, and Stop frees the queued ones only once the
// layer in flight is done.
//
// Lifecycle: the thread starts on the first Submit. Stop (or the destructor)
// drops queued layers, waits for the one in flight and joins.
// Thread-safety: all methods may be called from any thread; `process` runs
// on the worker thread with no lock of the worker held, and never calls
// back into the worker.
#ifndef REFIT_CORE_LAYER_WORKER_H_
#define REFIT_CORE_LAYER_WORKER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/layer_processor.h"
#include "core/staging_buffer.h"

namespace refit::core {

class LayerWorker {
 public:
  // `upcoming`: the layers queued behind `layer` (at most
  // kUpcomingLayers, up to the first experts part), in order.
  using ProcessFn = std::function<absl::StatusOr<ProcessedLayer>(
      int layer, std::vector<StagingBuffer> params, absl::Span<const UpcomingLayer> upcoming)>;
  static constexpr size_t kUpcomingLayers = 4;
  // Light layers that may be queued at once (Submit).
  static constexpr size_t kLightLayersWaiting = 3;

  explicit LayerWorker(ProcessFn process);
  ~LayerWorker();
  LayerWorker(const LayerWorker&) = delete;
  LayerWorker& operator=(const LayerWorker&) = delete;

  // Queues layer `layer` (its params hold `bytes` of staging) and waits until
  // the worker has taken it. A `light` layer (one that touches little
  // staging of its own: read in place from a trainer's region, the staging
  // under its aliases never written, or small) may instead wait behind up to
  // kLightLayersWaiting - 1 other queued layers: the caller goes on
  // receiving the next layers while the worker's threads have the cores,
  // instead of the worker waiting for them between layers, and the worker
  // sees the next FP8 weight queued (across a norm) in time to read it ahead
  // (`upcoming`). Errors: the first failed layer's status; CANCELLED after
  // Stop.
  absl::Status Submit(int layer, std::vector<StagingBuffer> params, int64_t bytes,
                      bool light = false);
  // Waits until every submitted layer is processed; the first error, if any.
  absl::Status Drain();
  // Layers processed since the last call, in completion order.
  std::vector<ProcessedLayer> TakeDone();
  // The first failed layer's status, or OK.
  absl::Status status() const;
  // Staging bytes of submitted layers not yet processed (queued or in flight).
  int64_t held_bytes() const;
  // Drops queued layers, waits for the one in flight and joins the thread;
  // results not yet taken (TakeDone) and the in-flight one are dropped too.
  // Idempotent.
  void Stop();

 private:
  struct Job {
    int layer;
    std::vector<StagingBuffer> params;
    int64_t bytes;
  };

  void Loop();

  const ProcessFn process_;
  mutable absl::Mutex mu_;
  std::deque<Job> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<ProcessedLayer> done_ ABSL_GUARDED_BY(mu_);
  int64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  // Started by the first Submit; joined by Stop.
  std::thread thread_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::core

#endif  // REFIT_CORE_LAYER_WORKER_H_
