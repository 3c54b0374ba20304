// PinnedStagingPool: a bounded set of reused pinned (page-locked) host
// buffers, and the dedicated stream that copies them to the device.
//
// Pipeline position: on a GPU store, RefitSession copies each incoming chunk
// (which arrives in pageable memory: a gRPC message, an mmap'ed safetensors
// file) into a leased pinned buffer and hands it to CopyToDevice, which
// enqueues the host-to-device copy on the pool's copy stream and returns at
// once. With two or more buffers, receiving chunk i+1 overlaps the copy of
// chunk i (double buffering), and quantization (on its own stream, made to
// wait for the copy by an event) overlaps both. The pool never grows: when
// every buffer is in flight, Acquire waits for the oldest copy, which is
// exactly the back-pressure a bounded-memory refit needs.
//
// Lifecycle: Create allocates every buffer up front (pinned allocation is
// slow and fragments the host, so buffers are reused, never freed until the
// pool goes). Acquire -> fill lease.data() -> CopyToDevice(std::move(lease))
// -> the buffer returns to the pool by itself once its copy has completed. A
// lease dropped without a copy returns at once. The destructor waits for
// copies in flight; every lease must be gone by then.
//
// Torch-free, no CUDA types (streams as void*). Thread-safe: any thread may
// Acquire and copy; no lock is held while waiting for the device.
#ifndef REFIT_CORE_CUDA_PINNED_STAGING_H_
#define REFIT_CORE_CUDA_PINNED_STAGING_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace refit::core::cuda {

struct PinnedStagingOptions {
  int device = 0;
  int64_t buffer_bytes = int64_t{64} << 20;
  int num_buffers = 4;  // 2 is double buffering; more absorbs jitter
};

struct PinnedStagingStats {
  int64_t copies = 0;
  int64_t bytes_copied = 0;
  int64_t acquire_waits = 0;  // Acquire calls that reclaimed a buffer from an in-flight copy
};

class PinnedStagingPool {
 public:
  // Exclusive use of one pinned buffer until it is handed to CopyToDevice or
  // dropped. Move-only.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    ~Lease();

    bool valid() const { return pool_ != nullptr; }
    uint8_t* data() const { return data_; }
    int64_t capacity() const { return capacity_; }

   private:
    friend class PinnedStagingPool;
    Lease(PinnedStagingPool* pool, int index, uint8_t* data, int64_t capacity)
        : pool_(pool), index_(index), data_(data), capacity_(capacity) {}
    void Release();

    PinnedStagingPool* pool_ = nullptr;
    int index_ = -1;
    uint8_t* data_ = nullptr;
    int64_t capacity_ = 0;
  };

  // INVALID_ARGUMENT for buffer_bytes <= 0 or num_buffers < 1; UNAVAILABLE
  // if the device cannot be used; RESOURCE_EXHAUSTED if the pinned memory
  // cannot be allocated.
  static absl::StatusOr<std::unique_ptr<PinnedStagingPool>> Create(
      const PinnedStagingOptions& options);
  ~PinnedStagingPool();
  PinnedStagingPool(const PinnedStagingPool&) = delete;
  PinnedStagingPool& operator=(const PinnedStagingPool&) = delete;

  // A free buffer; when all are in flight, waits (without the lock) for the
  // oldest copy to finish; when all are leased, waits for a lease to be
  // handed back. INTERNAL/UNAVAILABLE if waiting on the device fails.
  absl::StatusOr<Lease> Acquire();

  // Enqueues the copy of lease.data()[0, bytes) to `device_dst` on the copy
  // stream and returns without waiting. If `consumer_stream` is not null, the
  // work enqueued on it from now on waits for this copy (an event, not a
  // host wait). `device_dst` must stay valid until the copy is done.
  // INVALID_ARGUMENT for an invalid lease (of another pool, or moved from),
  // bytes < 0 or > capacity, or a null destination; INTERNAL for CUDA
  // errors (the buffer then returns to the pool unused).
  absl::Status CopyToDevice(Lease lease, void* device_dst, int64_t bytes,
                            void* consumer_stream = nullptr);

  // Waits for every copy enqueued so far.
  absl::Status Synchronize();

  // The cudaStream_t of the copies, as void*.
  void* copy_stream() const { return copy_stream_; }
  int device() const { return options_.device; }
  int64_t buffer_bytes() const { return options_.buffer_bytes; }
  int num_buffers() const { return options_.num_buffers; }
  // Pinned host memory held by the pool, for memory accounting.
  int64_t pinned_bytes() const { return options_.buffer_bytes * options_.num_buffers; }
  PinnedStagingStats stats() const;

 private:
  enum class BufferState { kFree, kLeased, kInFlight, kReclaiming };
  struct Buffer {
    uint8_t* host = nullptr;
    void* done = nullptr;  // cudaEvent_t recorded after the buffer's last copy
    BufferState state = BufferState::kFree;
    uint64_t copy_seq = 0;  // order of copies, to reclaim the oldest first
  };

  explicit PinnedStagingPool(const PinnedStagingOptions& options);
  void ReturnLeased(int index);
  bool CanAcquire() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PinnedStagingOptions options_;
  void* copy_stream_ = nullptr;  // cudaStream_t, non-blocking

  mutable absl::Mutex mu_;
  std::vector<Buffer> buffers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_copy_seq_ ABSL_GUARDED_BY(mu_) = 0;
  PinnedStagingStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::core::cuda

#endif  // REFIT_CORE_CUDA_PINNED_STAGING_H_
