#include "core/cuda/pinned_staging.h"

#include <cuda_runtime.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/cuda/cuda_device.h"
#include "core/cuda/cuda_status.h"

namespace refit::core::cuda {

PinnedStagingPool::Lease::Lease(Lease&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      index_(std::exchange(other.index_, -1)),
      data_(std::exchange(other.data_, nullptr)),
      capacity_(std::exchange(other.capacity_, 0)) {}

PinnedStagingPool::Lease& PinnedStagingPool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = std::exchange(other.pool_, nullptr);
    index_ = std::exchange(other.index_, -1);
    data_ = std::exchange(other.data_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

PinnedStagingPool::Lease::~Lease() { Release(); }

void PinnedStagingPool::Lease::Release() {
  if (pool_ != nullptr) pool_->ReturnLeased(index_);
  pool_ = nullptr;
  index_ = -1;
  data_ = nullptr;
  capacity_ = 0;
}

PinnedStagingPool::PinnedStagingPool(const PinnedStagingOptions& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<PinnedStagingPool>> PinnedStagingPool::Create(
    const PinnedStagingOptions& options) {
  if (options.buffer_bytes <= 0 || options.num_buffers < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("pinned staging pool: need buffer_bytes > 0 and num_buffers >= 1, got "
                        "%d bytes x %d",
                        options.buffer_bytes, options.num_buffers));
  }
  absl::Status status = CheckCudaDevice(options.device);
  if (!status.ok()) return status;
  ScopedCudaDevice scoped(options.device);
  if (!scoped.status().ok()) return scoped.status();

  // The destructor frees whatever was allocated if a later step fails.
  std::unique_ptr<PinnedStagingPool> pool(new PinnedStagingPool(options));
  cudaStream_t stream = nullptr;
  REFIT_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                             "creating the staging copy stream");
  pool->copy_stream_ = stream;
  absl::MutexLock lock(&pool->mu_);
  pool->buffers_.resize(options.num_buffers);
  for (Buffer& buffer : pool->buffers_) {
    void* host = nullptr;
    // Portable: the buffers count as pinned for every device's context.
    REFIT_CUDA_RETURN_IF_ERROR(
        cudaHostAlloc(&host, static_cast<size_t>(options.buffer_bytes), cudaHostAllocPortable),
        absl::StrFormat("cudaHostAlloc(%d bytes) for the staging pool", options.buffer_bytes));
    buffer.host = static_cast<uint8_t*>(host);
    cudaEvent_t event = nullptr;
    REFIT_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                               "creating a staging event");
    buffer.done = event;
  }
  return pool;
}

PinnedStagingPool::~PinnedStagingPool() {
  ScopedCudaDevice scoped(options_.device);
  if (copy_stream_ != nullptr) {
    // Copies may still read the buffers; they must finish before the free.
    cudaStreamSynchronize(static_cast<cudaStream_t>(copy_stream_));
  }
  absl::MutexLock lock(&mu_);
  for (Buffer& buffer : buffers_) {
    if (buffer.done != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(buffer.done));
    if (buffer.host != nullptr) cudaFreeHost(buffer.host);
  }
  if (copy_stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(copy_stream_));
}

bool PinnedStagingPool::CanAcquire() const {
  for (const Buffer& buffer : buffers_) {
    if (buffer.state == BufferState::kFree || buffer.state == BufferState::kInFlight) return true;
  }
  return false;
}

absl::StatusOr<PinnedStagingPool::Lease> PinnedStagingPool::Acquire() {
  int index = -1;
  bool must_wait = false;
  void* event = nullptr;
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &PinnedStagingPool::CanAcquire));
    for (int i = 0; i < static_cast<int>(buffers_.size()); ++i) {
      if (buffers_[i].state == BufferState::kFree) {
        index = i;
        break;
      }
    }
    if (index < 0) {
      // Everything is in flight: take the oldest copy, which finishes first
      // because the copy stream runs in order.
      for (int i = 0; i < static_cast<int>(buffers_.size()); ++i) {
        if (buffers_[i].state == BufferState::kInFlight &&
            (index < 0 || buffers_[i].copy_seq < buffers_[index].copy_seq)) {
          index = i;
        }
      }
      buffers_[index].state = BufferState::kReclaiming;
      must_wait = true;
      event = buffers_[index].done;
      ++stats_.acquire_waits;
    } else {
      buffers_[index].state = BufferState::kLeased;
    }
  }
  if (must_wait) {
    // Outside the lock: other threads may acquire other buffers meanwhile.
    absl::Status status = CudaStatus(cudaEventSynchronize(static_cast<cudaEvent_t>(event)),
                                     "waiting for a staging copy");
    absl::MutexLock lock(&mu_);
    if (!status.ok()) {
      buffers_[index].state = BufferState::kInFlight;
      return status;
    }
    buffers_[index].state = BufferState::kLeased;
  }
  absl::MutexLock lock(&mu_);
  return Lease(this, index, buffers_[index].host, options_.buffer_bytes);
}

void PinnedStagingPool::ReturnLeased(int index) {
  absl::MutexLock lock(&mu_);
  buffers_[index].state = BufferState::kFree;
}

absl::Status PinnedStagingPool::CopyToDevice(Lease lease, void* device_dst, int64_t bytes,
                                             void* consumer_stream) {
  if (lease.pool_ != this) {
    return absl::InvalidArgumentError("CopyToDevice: the lease is empty or of another pool");
  }
  if (bytes < 0 || bytes > lease.capacity_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "CopyToDevice: %d bytes do not fit a %d-byte staging buffer", bytes, lease.capacity_));
  }
  if (device_dst == nullptr && bytes > 0) {
    return absl::InvalidArgumentError("CopyToDevice: null device destination");
  }
  ScopedCudaDevice scoped(options_.device);
  if (!scoped.status().ok()) return scoped.status();
  void* event = nullptr;
  {
    absl::MutexLock lock(&mu_);
    event = buffers_[lease.index_].done;
  }
  // The lease owns the buffer exclusively, so these enqueue calls (which do
  // not wait for the device) need no lock.
  const cudaStream_t stream = static_cast<cudaStream_t>(copy_stream_);
  absl::Status status =
      CudaStatus(cudaMemcpyAsync(device_dst, lease.data_, static_cast<size_t>(bytes),
                                 cudaMemcpyHostToDevice, stream),
                 absl::StrFormat("staging copy of %d bytes to the device", bytes));
  if (status.ok()) {
    status = CudaStatus(cudaEventRecord(static_cast<cudaEvent_t>(event), stream),
                        "recording a staging event");
  }
  if (!status.ok()) return status;  // ~Lease returns the buffer unused
  if (consumer_stream != nullptr) {
    status = CudaStatus(cudaStreamWaitEvent(static_cast<cudaStream_t>(consumer_stream),
                                            static_cast<cudaEvent_t>(event), 0),
                        "ordering the consumer stream after a staging copy");
  }
  {
    absl::MutexLock lock(&mu_);
    Buffer& buffer = buffers_[lease.index_];
    buffer.state = BufferState::kInFlight;
    buffer.copy_seq = next_copy_seq_++;
    ++stats_.copies;
    stats_.bytes_copied += bytes;
  }
  lease.pool_ = nullptr;  // ownership passed to the in-flight copy
  return status;
}

absl::Status PinnedStagingPool::Synchronize() {
  ScopedCudaDevice scoped(options_.device);
  if (!scoped.status().ok()) return scoped.status();
  return CudaStatus(cudaStreamSynchronize(static_cast<cudaStream_t>(copy_stream_)),
                    "waiting for the staging copies");
}

PinnedStagingStats PinnedStagingPool::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace refit::core::cuda
