// Internal to core/cuda: a commit's device-to-device copies as batches for
// one kernel launch each (copy_kernels.cuh), instead of one cudaMemcpyAsync
// per kernel tensor. A commit is a few hundred copies, half of them 4-byte
// scales; issued one by one, each pays a launch and a drained GPU at its end,
// which adds up to a third of the copy time of an 8 GiB model. One launch over
// all of them keeps the device busy from the first byte to the last.
//
// Each copy is cut into tiles of kTileBytes; thread block b of a launch copies
// tile b of the batch. The batch travels by value as the kernel's parameter
// (CUDA 12.1+ allows 32 KiB of parameters on sm_70 and newer), so a launch
// needs no table in device memory and no upload before it.
//
// Torch-free and free of CUDA types: the planning is plain C++, tested on any machine
// (tests/core/copy_kernels_sim_test.cc runs the kernel in a simulated grid).
#ifndef REFIT_CORE_CUDA_COPY_BATCH_H_
#define REFIT_CORE_CUDA_COPY_BATCH_H_

#include <cstdint>
#include <vector>

#include "core/cuda/device_commit.h"

#if defined(__CUDACC__)
#define REFIT_HOST_DEVICE __host__ __device__
#else
#define REFIT_HOST_DEVICE
#endif

namespace refit::core::cuda::copy_kernels {

inline constexpr int kCopyThreads = 256;
inline constexpr int kCopyBatch = 256;                    // copies per launch
inline constexpr int64_t kTileBytes = int64_t{64} << 10;  // bytes per thread block

struct CopyBatch {
  int count = 0;
  unsigned char* dst[kCopyBatch];
  const unsigned char* src[kCopyBatch];
  int64_t bytes[kCopyBatch];
  // first_tile[i]: the batch's first tile of copy i; first_tile[count] is the
  // number of tiles (the launch's grid size).
  int64_t first_tile[kCopyBatch + 1];
};

// The copy that tile `tile` (< first_tile[count]) belongs to: the last i with
// first_tile[i] <= tile. Every copy has at least one tile, so first_tile is
// strictly increasing.
REFIT_HOST_DEVICE inline int CopyOfTile(const CopyBatch& batch, int64_t tile) {
  int lo = 0, hi = batch.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.first_tile[mid] <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Packs copies (bytes > 0) into batches of at most kCopyBatch, in order.
inline std::vector<CopyBatch> PlanCopyBatches(const std::vector<DeviceCopy>& copies) {
  std::vector<CopyBatch> batches;
  for (const DeviceCopy& c : copies) {
    if (c.bytes <= 0) continue;
    if (batches.empty() || batches.back().count == kCopyBatch) {
      batches.emplace_back();
      batches.back().first_tile[0] = 0;
    }
    CopyBatch& b = batches.back();
    const int i = b.count++;
    b.dst[i] = static_cast<unsigned char*>(c.dst);
    b.src[i] = static_cast<const unsigned char*>(c.src);
    b.bytes[i] = c.bytes;
    b.first_tile[i + 1] = b.first_tile[i] + (c.bytes + kTileBytes - 1) / kTileBytes;
  }
  return batches;
}

}  // namespace refit::core::cuda::copy_kernels

#endif  // REFIT_CORE_CUDA_COPY_BATCH_H_
