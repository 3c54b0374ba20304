// ShardStore and RefitSession with the kernels on a GPU (--device cuda:N).
// Skips cleanly on machines without a CUDA device (ctest label "gpu").
#include <string>

#include "core/fixture_model.h"
#include "core/refit_session.h"
#include "core/runtime_info.h"
#include "core/shard_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/refit_helpers.h"

namespace refit::core {
namespace {

using ::refit::testing::PushAll;
using ::refit::testing::Snapshot;

TEST(ShardStoreGpuTest, RejectsAMissingGpuWithUnavailable) {
  std::shared_ptr<const ModelLayout> layout =
      ModelLayout::Build(FixtureConfig(), {}, QuantScheme::kPerTensor).value();
  ShardStoreOptions options;
  options.device = "cuda:" + std::to_string(CudaDeviceCount());  // one past the last
  absl::StatusOr<std::unique_ptr<ShardStore>> store = ShardStore::Create(layout, options);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(store.status().message(), ::testing::HasSubstr(options.device));
  options.device = "tpu:0";
  EXPECT_EQ(ShardStore::Create(layout, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ShardStoreGpuTest, GpuRefitGivesTheBytesOfACpuRefitInPlace) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (QuantScheme scheme :
       {QuantScheme::kPerTensor, QuantScheme::kPerChannel, QuantScheme::kBlock128}) {
    std::shared_ptr<const ModelLayout> layout =
        ModelLayout::Build(FixtureConfig(), {}, scheme).value();
    ShardStoreOptions gpu_options;
    gpu_options.device = "cuda:0";
    std::unique_ptr<ShardStore> gpu = ShardStore::Create(layout, gpu_options).value();
    std::unique_ptr<ShardStore> cpu = ShardStore::Create(layout, {}).value();
    EXPECT_TRUE(gpu->on_gpu());
    std::vector<const void*> pointers;
    for (const KernelView& k : gpu->Kernels()) pointers.push_back(k.data);
    for (uint64_t seed : {1, 2}) {
      std::vector<OwnedTensor> w = MakeFixtureWeights(FixtureConfig(), seed).value();
      ASSERT_TRUE(PushAll(*gpu, w).ok());
      ASSERT_TRUE(PushAll(*cpu, w).ok());
      EXPECT_EQ(gpu->fingerprint(), cpu->fingerprint()) << QuantSchemeName(scheme);
      EXPECT_TRUE(Snapshot(*gpu) == Snapshot(*cpu)) << QuantSchemeName(scheme);
    }
    std::vector<KernelView> after = gpu->Kernels();
    for (size_t i = 0; i < after.size(); ++i) EXPECT_EQ(after[i].data, pointers[i]);
    EXPECT_EQ(gpu->version(), 2u);
  }
}

TEST(ShardStoreGpuTest, ReadKernelRangeOfAGpuKernelMatchesReadKernel) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::shared_ptr<const ModelLayout> layout =
      ModelLayout::Build(FixtureConfig(), {}, QuantScheme::kPerTensor).value();
  ShardStoreOptions gpu_options;
  gpu_options.device = "cuda:0";
  std::unique_ptr<ShardStore> gpu = ShardStore::Create(layout, gpu_options).value();
  ASSERT_TRUE(PushAll(*gpu, MakeFixtureWeights(FixtureConfig(), 3).value()).ok());
  for (const KernelView& k : gpu->Kernels()) {
    std::string whole, pieces;
    ASSERT_TRUE(gpu->ReadKernel(k.spec->name, &whole, nullptr).ok());
    for (int64_t offset = 0; offset < k.nbytes; offset += 4097) {
      std::string piece;
      uint64_t version = 0;
      ASSERT_TRUE(gpu->ReadKernelRange(k.spec->name, offset, 4097, &piece, &version).ok());
      EXPECT_EQ(version, 1u);
      pieces += piece;
    }
    EXPECT_EQ(pieces, whole) << k.spec->name;
  }
}

}  // namespace
}  // namespace refit::core
