// Which CUDA devices this process can use. The one question every GPU path
// (and every *_gpu_test) asks before touching the device.
//
// Torch-free and free of CUDA types, so CPU-only code and tests can include
// it; the definitions live in refit_cuda (REFIT_WITH_CUDA builds only).
// Thread-safe.
#ifndef REFIT_CORE_CUDA_CUDA_DEVICE_H_
#define REFIT_CORE_CUDA_CUDA_DEVICE_H_

#include "absl/status/status.h"

namespace refit::core::cuda {

// Number of CUDA devices; 0 when there is no driver or no device (never an
// error: a CPU-only machine is a normal configuration).
int CudaDeviceCount();

// OK if `device` exists and can be used. UNAVAILABLE otherwise (no driver,
// no device, ordinal out of range), with the CUDA error in the message.
absl::Status CheckCudaDevice(int device);

}  // namespace refit::core::cuda

#endif  // REFIT_CORE_CUDA_CUDA_DEVICE_H_
