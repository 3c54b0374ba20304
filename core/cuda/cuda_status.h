// Internal to core/cuda: CUDA runtime errors as absl::Status, and a scoped
// current-device switch. Includes cuda_runtime.h, so only core/cuda's own
// sources include it; public headers stay free of CUDA types.
#ifndef REFIT_CORE_CUDA_CUDA_STATUS_H_
#define REFIT_CORE_CUDA_CUDA_STATUS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace refit::core::cuda {

// OK for cudaSuccess. Otherwise a code chosen by what the caller should do:
// RESOURCE_EXHAUSTED for out-of-memory (a refit fails, the daemon lives),
// UNAVAILABLE when there is no usable device/driver, INTERNAL for the rest
// (launch failures, illegal addresses: bugs or a sick device). `what` names
// the operation.
// A failed call's error is consumed here (cudaGetLastError), so that a later
// kernel launch, which learns of its own failure from cudaGetLastError, does
// not report it as its own.
absl::Status CudaStatus(cudaError_t error, absl::string_view what);

// Clears the thread's last error before a kernel launch that is checked with
// cudaGetLastError: an earlier call's unchecked error (a cleanup's, say)
// would otherwise fail the launch. A sticky error (a sick context) stays and
// fails the launch as it should.
inline void ClearLastCudaError() { (void)cudaGetLastError(); }

// Makes `device` current for the scope and restores the previous device, so
// that our calls never change the caller's current device behind its back.
class ScopedCudaDevice {
 public:
  explicit ScopedCudaDevice(int device);
  ~ScopedCudaDevice();
  ScopedCudaDevice(const ScopedCudaDevice&) = delete;
  ScopedCudaDevice& operator=(const ScopedCudaDevice&) = delete;
  // The status of the switch; callers return it when not OK.
  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  absl::Status status_;
};

}  // namespace refit::core::cuda

#define REFIT_CUDA_RETURN_IF_ERROR(expr, what)                                         \
  do {                                                                                 \
    absl::Status _refit_cuda_status = ::refit::core::cuda::CudaStatus((expr), (what)); \
    if (!_refit_cuda_status.ok()) return _refit_cuda_status;                           \
  } while (0)

#endif  // REFIT_CORE_CUDA_CUDA_STATUS_H_
