#include "core/cuda/device_commit.h"

#include <cuda_runtime.h>

#include <vector>

#include "absl/strings/str_format.h"
#include "core/cuda/copy_batch.h"
#include "core/cuda/cuda_device.h"
#include "core/cuda/cuda_status.h"

namespace refit::core::cuda {
namespace copy_kernels {
// batched_copy.cu
cudaError_t LaunchCopyBatch(const CopyBatch& batch, cudaStream_t stream);
}  // namespace copy_kernels

absl::StatusOr<std::unique_ptr<DeviceEvent>> DeviceEvent::Create(int device) {
  absl::Status status = CheckCudaDevice(device);
  if (!status.ok()) return status;
  ScopedCudaDevice scoped(device);
  if (!scoped.status().ok()) return scoped.status();
  cudaEvent_t event = nullptr;
  // No timing: cheaper to record, and the only question asked is "done?".
  REFIT_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                             "creating a commit event");
  return std::unique_ptr<DeviceEvent>(new DeviceEvent(device, event));
}

DeviceEvent::~DeviceEvent() {
  ScopedCudaDevice scoped(device_);
  cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

absl::Status DeviceEvent::Record(void* stream) {
  ScopedCudaDevice scoped(device_);
  if (!scoped.status().ok()) return scoped.status();
  return CudaStatus(
      cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream)),
      "recording a commit event");
}

absl::Status DeviceEvent::Wait() const {
  return CudaStatus(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)),
                    "waiting for a commit event");
}

absl::Status DeviceEvent::MakeStreamWait(void* stream) const {
  return CudaStatus(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event_), 0),
      "ordering a stream after a commit event");
}

absl::StatusOr<bool> DeviceEvent::IsComplete() const {
  const cudaError_t error = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (error == cudaErrorNotReady) return false;
  absl::Status status = CudaStatus(error, "querying a commit event");
  if (!status.ok()) return status;
  return true;
}

namespace {

// True if `ptr` is memory of `device` that a kernel there can address.
bool OnDevice(const void* ptr, int device) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
    cudaGetLastError();  // not ours to keep as the thread's last error
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice && attributes.device == device;
}

absl::StatusOr<int> StreamDevice(cudaStream_t stream) {
  int device = -1;
  if (stream == nullptr) {
    REFIT_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device), "device commit: cudaGetDevice");
  } else {
    REFIT_CUDA_RETURN_IF_ERROR(cudaStreamGetDevice(stream, &device),
                               "device commit: cudaStreamGetDevice");
  }
  return device;
}

}  // namespace

absl::Status EnqueueDeviceCopies(absl::Span<const DeviceCopy> copies, void* stream,
                                 DeviceEvent* done, CopyMethod method) {
  for (size_t i = 0; i < copies.size(); ++i) {
    const DeviceCopy& copy = copies[i];
    if (copy.bytes < 0 || (copy.bytes > 0 && (copy.dst == nullptr || copy.src == nullptr))) {
      return absl::InvalidArgumentError(
          absl::StrFormat("device commit: copy %d of %d is invalid (%d bytes, dst %p, src %p)", i,
                          copies.size(), copy.bytes, copy.dst, copy.src));
    }
  }
  const cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
  std::vector<DeviceCopy> batched;
  int device = -1;
  if (method == CopyMethod::kBatched) {
    absl::StatusOr<int> stream_device = StreamDevice(cuda_stream);
    if (!stream_device.ok()) return stream_device.status();
    device = *stream_device;
  }
  for (size_t i = 0; i < copies.size(); ++i) {
    const DeviceCopy& copy = copies[i];
    if (copy.bytes == 0) continue;
    if (method == CopyMethod::kBatched && OnDevice(copy.dst, device) &&
        OnDevice(copy.src, device)) {
      batched.push_back(copy);
      continue;
    }
    // cudaMemcpyDefault: unified addressing tells the direction, so a
    // staged buffer on another device (peer copy) also works.
    REFIT_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(copy.dst, copy.src, static_cast<size_t>(copy.bytes), cudaMemcpyDefault,
                        cuda_stream),
        absl::StrFormat("device commit: copy %d of %d (%d bytes)", i, copies.size(), copy.bytes));
  }
  if (!batched.empty()) {
    ScopedCudaDevice scoped(device);
    if (!scoped.status().ok()) return scoped.status();
    const std::vector<copy_kernels::CopyBatch> batches = copy_kernels::PlanCopyBatches(batched);
    for (const copy_kernels::CopyBatch& batch : batches) {
      REFIT_CUDA_RETURN_IF_ERROR(
          copy_kernels::LaunchCopyBatch(batch, cuda_stream),
          absl::StrFormat("device commit: batched copy kernel (%d copies)", batch.count));
    }
  }
  if (done != nullptr) return done->Record(stream);
  return absl::OkStatus();
}

}  // namespace refit::core::cuda
