// The batched copy kernel of a device commit (core/cuda/copy_kernels.cuh)
// and its planning (core/cuda/copy_batch.h), run on the host in a simulated
// grid: tiles, the copy each tile belongs to, batches of at most 256 copies,
// and the 16-byte, head, tail and misaligned byte paths. The kernel has no
// barriers, so the simulated threads of a block simply run one after another.
//
// Needs no CUDA and never skips; fp8_cuda_gpu_test.cc runs the same kernel
// on a GPU.
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace refit_copy_sim {
struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
}  // namespace refit_copy_sim

refit_copy_sim::Dim3 threadIdx;
refit_copy_sim::Dim3 blockIdx;
refit_copy_sim::Dim3 blockDim;

#define __global__ inline
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)

#include "core/cuda/copy_kernels.cuh"  // NOLINT: after the simulated CUDA vocabulary

namespace refit::core::cuda::copy_kernels {
namespace {

void RunBatch(const CopyBatch& batch) {
  blockDim.x = kCopyThreads;
  for (int64_t tile = 0; tile < batch.first_tile[batch.count]; ++tile) {
    blockIdx.x = static_cast<unsigned>(tile);
    for (unsigned t = 0; t < kCopyThreads; ++t) {
      threadIdx.x = t;
      BatchedCopyKernel(batch);
    }
  }
}

TEST(CopyBatchPlanTest, TilesCoverEveryCopyAndZeroSizedOnesAreLeftOut) {
  std::vector<unsigned char> buf(1);
  const std::vector<int64_t> sizes = {1, 4, 0, kTileBytes, kTileBytes + 1, 3 * kTileBytes - 7};
  std::vector<DeviceCopy> copies;
  for (int64_t n : sizes) copies.push_back({buf.data(), buf.data(), n});
  const std::vector<CopyBatch> batches = PlanCopyBatches(copies);
  ASSERT_EQ(batches.size(), 1u);
  const CopyBatch& b = batches[0];
  ASSERT_EQ(b.count, 5);
  const std::vector<int64_t> first = {0, 1, 2, 3, 5, 8};
  for (int i = 0; i <= b.count; ++i) EXPECT_EQ(b.first_tile[i], first[i]) << i;
  const std::vector<int> owner = {0, 1, 2, 3, 3, 4, 4, 4};
  for (int64_t tile = 0; tile < 8; ++tile) EXPECT_EQ(CopyOfTile(b, tile), owner[tile]) << tile;
}

TEST(CopyBatchPlanTest, BatchesHoldAtMost256CopiesInOrder) {
  std::vector<unsigned char> buf(600);
  std::vector<DeviceCopy> copies;
  for (int i = 0; i < 600; ++i) copies.push_back({&buf[i], &buf[i], 1});
  const std::vector<CopyBatch> batches = PlanCopyBatches(copies);
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[0].count, 256);
  EXPECT_EQ(batches[1].count, 256);
  EXPECT_EQ(batches[2].count, 88);
  EXPECT_EQ(batches[1].dst[0], &buf[256]);
  EXPECT_EQ(batches[2].dst[87], &buf[599]);
  EXPECT_EQ(batches[2].first_tile[88], 88);
  EXPECT_TRUE(PlanCopyBatches({}).empty());
}

TEST(BatchedCopyKernelTest, CopiesEveryByteOfEveryAlignmentAndNothingElse) {
  // (size, src offset, dst offset) in 16-aligned buffers: equally aligned
  // (vector path with and without a head), misaligned relative to each
  // other (byte path), tiny, one tile, tiles plus a tail.
  struct Case {
    int64_t bytes, src_off, dst_off;
  };
  const std::vector<Case> cases = {{4, 0, 0},
                                   {1, 3, 7},
                                   {15, 1, 1},
                                   {kTileBytes, 0, 0},
                                   {kTileBytes + 17, 5, 5},
                                   {3 * kTileBytes + 1000, 0, 0},
                                   {2 * kTileBytes + 3, 1, 2},
                                   {100000, 9, 9}};
  std::mt19937 rng(7);
  std::vector<std::vector<unsigned char>> srcs, dsts;
  std::vector<DeviceCopy> copies;
  constexpr int64_t kGuard = 64;
  for (const Case& c : cases) {
    srcs.emplace_back(c.bytes + c.src_off + kGuard + 16);
    dsts.emplace_back(c.bytes + c.dst_off + kGuard + 16, 0xEE);
    for (unsigned char& x : srcs.back()) x = static_cast<unsigned char>(rng());
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    // 16-aligned bases inside the vectors.
    auto align = [](unsigned char* p) {
      return p + ((16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15);
    };
    copies.push_back({align(dsts[i].data()) + cases[i].dst_off,
                      align(srcs[i].data()) + cases[i].src_off, cases[i].bytes});
  }
  for (const CopyBatch& batch : PlanCopyBatches(copies)) RunBatch(batch);
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto* src = static_cast<const unsigned char*>(copies[i].src);
    auto* dst = static_cast<unsigned char*>(copies[i].dst);
    int64_t wrong = 0;
    for (int64_t k = 0; k < cases[i].bytes; ++k) wrong += dst[k] != src[k];
    EXPECT_EQ(wrong, 0) << "case " << i;
    for (unsigned char* p = dsts[i].data(); p < dst; ++p) EXPECT_EQ(*p, 0xEE) << "case " << i;
    for (unsigned char* p = dst + cases[i].bytes; p < dsts[i].data() + dsts[i].size(); ++p) {
      ASSERT_EQ(*p, 0xEE) << "case " << i << ": wrote past the end";
    }
  }
}

}  // namespace
}  // namespace refit::core::cuda::copy_kernels
