// The batched copy kernel of a device commit (copy_batch.h), in a header so
// that batched_copy.cu launches it and a host test runs the same code in a
// simulated grid (tests/core/copy_kernels_sim_test.cc).
//
// Internal to core/cuda. Elsewhere than under nvcc the includer must first
// define the CUDA vocabulary it uses (__global__, __device__,
// __forceinline__, __launch_bounds__, threadIdx, blockIdx, blockDim).
#ifndef REFIT_CORE_CUDA_COPY_KERNELS_CUH_
#define REFIT_CORE_CUDA_COPY_KERNELS_CUH_

#include <cstdint>

#include "core/cuda/copy_batch.h"

// As in fp8_kernels.cuh (an identical redefinition is allowed).
#if defined(__CUDACC__)
#define REFIT_UNROLL _Pragma("unroll")
// The batch is read straight from the parameter space: without this, the
// kernel's dynamic indexing into it would copy it to local memory.
#define REFIT_GRID_CONSTANT __grid_constant__
#else
#define REFIT_UNROLL
#define REFIT_GRID_CONSTANT
#endif

namespace refit::core::cuda::copy_kernels {

#if defined(__CUDACC__)
using Vec16 = uint4;
#else
struct alignas(16) Vec16 {
  uint32_t x, y, z, w;
};
#endif

inline constexpr int kCopyUnroll = 4;

// Copies n bytes with the threads of one block: 16-byte loads and stores
// where src and dst are equally aligned (a head and a tail byte by byte),
// bytes otherwise.
__device__ __forceinline__ void CopyRange(unsigned char* dst, const unsigned char* src, int64_t n,
                                          unsigned thread, unsigned threads) {
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst);
  const uintptr_t s = reinterpret_cast<uintptr_t>(src);
  if (((d ^ s) & 15) != 0) {
    for (int64_t i = thread; i < n; i += threads) dst[i] = src[i];
    return;
  }
  int64_t head = static_cast<int64_t>((16 - (d & 15)) & 15);
  if (head > n) head = n;
  for (int64_t i = thread; i < head; i += threads) dst[i] = src[i];
  const int64_t nvec = (n - head) / 16;
  Vec16* vdst = reinterpret_cast<Vec16*>(dst + head);
  const Vec16* vsrc = reinterpret_cast<const Vec16*>(src + head);
  for (int64_t base = thread; base < nvec; base += int64_t{kCopyUnroll} * threads) {
    Vec16 v[kCopyUnroll];
    REFIT_UNROLL
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + int64_t{u} * threads;
      if (i < nvec) v[u] = vsrc[i];
    }
    REFIT_UNROLL
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + int64_t{u} * threads;
      if (i < nvec) vdst[i] = v[u];
    }
  }
  for (int64_t i = head + nvec * 16 + thread; i < n; i += threads) dst[i] = src[i];
}

// One thread block per tile of the batch.
__global__ void __launch_bounds__(kCopyThreads)
    BatchedCopyKernel(const REFIT_GRID_CONSTANT CopyBatch batch) {
  const int64_t tile = blockIdx.x;
  const int c = CopyOfTile(batch, tile);
  const int64_t begin = (tile - batch.first_tile[c]) * kTileBytes;
  int64_t n = batch.bytes[c] - begin;
  if (n > kTileBytes) n = kTileBytes;
  CopyRange(batch.dst[c] + begin, batch.src[c] + begin, n, threadIdx.x, blockDim.x);
}

}  // namespace refit::core::cuda::copy_kernels

#endif  // REFIT_CORE_CUDA_COPY_KERNELS_CUH_
