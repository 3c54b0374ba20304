// The device arena of a GPU store: one allocation with a CUDA IPC handle,
// every kernel at its offset in it, commits in place with the bytes of a host
// store. Skips cleanly on machines without a CUDA device (ctest label "gpu").
#include <memory>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/fixture_model.h"
#include "core/runtime_info.h"
#include "core/shard_store.h"
#include "gtest/gtest.h"
#include "tests/testing/refit_helpers.h"

namespace refit::core {
namespace {

TEST(ArenaGpuTest, KernelsLieInOneExportedAllocationAndCommitInPlace) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::shared_ptr<const ModelLayout> layout =
      ModelLayout::Build(FixtureConfig(), {}, QuantScheme::kPerTensor).value();
  ShardStoreOptions options;
  options.device = "cuda:0";
  std::unique_ptr<ShardStore> store = ShardStore::Create(layout, options).value();
  const ArenaInfo arena = store->arena();
  EXPECT_TRUE(arena.on_device);
  EXPECT_EQ(arena.device_index, 0);
  EXPECT_EQ(arena.ipc_handle.size(), 64u);
  EXPECT_EQ(arena.host_bytes, kArenaHeaderBytes);  // the memfd holds only the header
  const std::vector<KernelView> kernels = store->Kernels();
  const char* base = static_cast<const char*>(kernels[0].data) - kernels[0].arena_offset;
  for (const KernelView& k : kernels) {
    EXPECT_EQ(k.arena_offset % kArenaAlign, 0) << k.spec->name;
    EXPECT_EQ(static_cast<const char*>(k.data), base + k.arena_offset) << k.spec->name;
  }
  std::vector<OwnedTensor> w = MakeFixtureWeights(FixtureConfig(), 1).value();
  ASSERT_TRUE(testing::PushAll(*store, w).ok());
  absl::StatusOr<std::unique_ptr<ShardStore>> cpu = ShardStore::Create(layout, {});
  ASSERT_TRUE(cpu.ok());
  ASSERT_TRUE(testing::PushAll(**cpu, w).ok());
  EXPECT_EQ(store->fingerprint(), (*cpu)->fingerprint());
  EXPECT_TRUE(testing::Snapshot(*store) == testing::Snapshot(**cpu));
  EXPECT_EQ(store->Kernels()[0].data, kernels[0].data);
}

}  // namespace
}  // namespace refit::core
