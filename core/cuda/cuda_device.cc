#include "core/cuda/cuda_device.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"

namespace refit::core::cuda {

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

ScopedCudaDevice::ScopedCudaDevice(int device) {
  status_ = CudaStatus(cudaGetDevice(&previous_), "cudaGetDevice");
  if (status_.ok() && previous_ != device) {
    status_ = CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  }
}

ScopedCudaDevice::~ScopedCudaDevice() {
  if (status_.ok()) {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
  }
}

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    // Clear the sticky "no device" error so later calls start clean.
    cudaGetLastError();
    return 0;
  }
  return count;
}

absl::Status CheckCudaDevice(int device) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("CUDA device ", device,
                                               " is not usable: ", cudaGetErrorName(error), " (",
                                               cudaGetErrorString(error), ")"));
  }
  if (device < 0 || device >= count) {
    return absl::UnavailableError(
        absl::StrCat("CUDA device ", device, " does not exist (", count, " device(s) visible)"));
  }
  return absl::OkStatus();
}

}  // namespace refit::core::cuda
