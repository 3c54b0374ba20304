// Mixture-of-experts refits with device staging (a store on cuda:0 in a
// REFIT_WITH_CUDA build): each expert's w13 / w2 is uploaded, quantized on
// the GPU into its place in the layer's kernels and its source freed; the
// bytes and fingerprint equal the CPU path's, for whole and partial refits
// (kept experts keep their live bytes). Skips cleanly on machines without a
// CUDA device (ctest label "gpu").
#include <map>
#include <memory>
#include <string>
#include <vector>

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
using ::refit::testing::ShuffledChunks;
using ::refit::testing::Snapshot;
using ::refit::testing::ToChunk;

class MoeGpuTest : public ::testing::TestWithParam<QuantScheme> {};

TEST_P(MoeGpuTest, DeviceStagingGivesTheHostBytesForWholeAndPartialRefits) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (Architecture arch : {Architecture::kQwen3Moe, Architecture::kMixtral}) {
    const ModelConfig config = FixtureConfig(arch);
    for (const ParallelConfig parallel : {ParallelConfig{1, 2, 0, 1}, ParallelConfig{0, 1, 1, 2}}) {
      auto layout = ModelLayout::Build(config, parallel, GetParam());
      ASSERT_TRUE(layout.ok()) << layout.status();
      ShardStoreOptions gpu_options;
      gpu_options.device = "cuda:0";
      auto gpu = ShardStore::Create(*layout, gpu_options);
      auto cpu = ShardStore::Create(*layout, {});
      ASSERT_TRUE(gpu.ok()) << gpu.status();
      ASSERT_TRUE(cpu.ok()) << cpu.status();
      const std::vector<OwnedTensor> v1 = MakeFixtureWeights(config, 1).value();
      const std::vector<OwnedTensor> v2 = MakeFixtureWeights(config, 2).value();
      ASSERT_TRUE(PushAll(**gpu, v1).ok());
      ASSERT_TRUE(PushAll(**cpu, v1).ok());
      // Some experts of layer 0 only: the others keep their live bytes.
      std::vector<OwnedTensor> some;
      for (const OwnedTensor& t : v2) {
        if (t.name.find("layers.0.") != std::string::npos &&
            (t.name.find("experts.5.") != std::string::npos ||
             t.name.find("experts.1.") != std::string::npos)) {
          some.push_back(t);
        }
      }
      ASSERT_TRUE(PushAll(**gpu, some).ok());
      ASSERT_TRUE(PushAll(**cpu, some).ok());
      EXPECT_EQ(Snapshot(**gpu), Snapshot(**cpu));
      EXPECT_EQ((*gpu)->fingerprint(), (*cpu)->fingerprint());
      // Everything, in shuffled chunks of random size.
      for (ShardStore* store : {gpu->get(), cpu->get()}) {
        auto session = RefitSession::Begin(store, {});
        ASSERT_TRUE(session.ok()) << session.status();
        for (const auto& chunk : ShuffledChunks(v2, 11, 5000)) {
          ASSERT_TRUE((*session)->Ingest(ToChunk(chunk)).ok());
        }
        ASSERT_TRUE((*session)->Commit().ok());
      }
      EXPECT_EQ(Snapshot(**gpu), Snapshot(**cpu));
      EXPECT_EQ((*gpu)->fingerprint(), (*cpu)->fingerprint());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Schemes, MoeGpuTest,
                         ::testing::Values(QuantScheme::kPerTensor, QuantScheme::kBlock128,
                                           QuantScheme::kPerChannel, QuantScheme::kNone),
                         [](const ::testing::TestParamInfo<QuantScheme>& info) {
                           std::string name(QuantSchemeName(info.param));
                           return name == "per-tensor"    ? std::string("PerTensor")
                                  : name == "per-channel" ? std::string("PerChannel")
                                  : name == "block"       ? std::string("Block")
                                                          : std::string("None");
                         });

}  // namespace
}  // namespace refit::core
