// Launches of the batched copy kernel (copy_kernels.cuh) for device_commit.cc.
#include <cuda_runtime.h>

#include "core/cuda/copy_kernels.cuh"
#include "core/cuda/cuda_status.h"

namespace refit::core::cuda::copy_kernels {

cudaError_t LaunchCopyBatch(const CopyBatch& batch, cudaStream_t stream) {
  const int64_t tiles = batch.first_tile[batch.count];
  if (tiles == 0) return cudaSuccess;
  if (tiles > 0x7fffffff) return cudaErrorInvalidValue;
  ClearLastCudaError();  // an earlier call's error is not this launch's
  BatchedCopyKernel<<<static_cast<unsigned>(tiles), kCopyThreads, 0, stream>>>(batch);
  return cudaGetLastError();
}

}  // namespace refit::core::cuda::copy_kernels
