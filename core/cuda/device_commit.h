// Device-side commit: the in-place copy of staged kernel bytes into the live
// kernel tensors, enqueued on a stream, and the event that marks the new
// version complete.
//
// Pipeline position: the last step of a refit on a GPU store. ShardStore's
// commit holds its writer lock, calls EnqueueDeviceCopies with (live
// data_ptr, staged data_ptr, bytes) for every kernel, and records a
// DeviceEvent; readers in the daemon wait on that event before they read
// version N+1 (so must an engine that reads the live tensors). The live pointers never change, so
// CUDA graphs and IPC mappings stay valid.
//
// Torch-free, no CUDA types (streams and events as void*).
// Thread-safety: DeviceEvent is thread-safe for Wait/IsComplete/
// MakeStreamWait; Record must not race with itself (one committer at a time,
// which ShardStore's session slot guarantees).
#ifndef REFIT_CORE_CUDA_DEVICE_COMMIT_H_
#define REFIT_CORE_CUDA_DEVICE_COMMIT_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace refit::core::cuda {

// One copy of a commit: `bytes` from `src` (staged) to `dst` (live), both
// device pointers (any device of the process; peer copies are allowed).
struct DeviceCopy {
  void* dst = nullptr;
  const void* src = nullptr;
  int64_t bytes = 0;
};

// A CUDA event (no timing) owned by refitd, e.g. "version N+1 is complete".
class DeviceEvent {
 public:
  // UNAVAILABLE if the device cannot be used.
  static absl::StatusOr<std::unique_ptr<DeviceEvent>> Create(int device);
  ~DeviceEvent();
  DeviceEvent(const DeviceEvent&) = delete;
  DeviceEvent& operator=(const DeviceEvent&) = delete;

  // Marks the current end of `stream`'s work. INTERNAL on CUDA errors.
  absl::Status Record(void* stream);
  // Blocks the calling thread until the recorded work is done (immediately
  // if nothing was recorded). INTERNAL on CUDA errors, including errors of
  // the recorded work.
  absl::Status Wait() const;
  // Work enqueued on `stream` from now on waits for the recorded work, on
  // the device; the host does not block.
  absl::Status MakeStreamWait(void* stream) const;
  // True once the recorded work is done; never blocks.
  absl::StatusOr<bool> IsComplete() const;

  int device() const { return device_; }
  void* native_handle() const { return event_; }  // cudaEvent_t

 private:
  DeviceEvent(int device, void* event) : device_(device), event_(event) {}
  const int device_;
  void* const event_;
};

// How EnqueueDeviceCopies moves the bytes.
enum class CopyMethod {
  // Copies whose source and destination are both memory of the stream's
  // device go in one kernel launch per 256 copies; the rest (host memory,
  // another device's) one cudaMemcpyAsync each.
  kBatched,
  // One cudaMemcpyAsync per copy (for comparison in benchmarks).
  kMemcpyEach,
};

// Enqueues every copy on `stream` and, if `done` is not null, records `done`
// after the last one. Returns without waiting. The copies must not overlap
// one another (they may run in any order before `done`). The staged sources
// must stay valid until `done` completes. INVALID_ARGUMENT for a negative
// size or a null pointer with bytes > 0 (nothing is enqueued then); INTERNAL
// for CUDA errors (some copies may have been enqueued: the caller aborts the
// commit and must restore from its staging, which is unchanged).
absl::Status EnqueueDeviceCopies(absl::Span<const DeviceCopy> copies, void* stream,
                                 DeviceEvent* done, CopyMethod method = CopyMethod::kBatched);

}  // namespace refit::core::cuda

#endif  // REFIT_CORE_CUDA_DEVICE_COMMIT_H_
