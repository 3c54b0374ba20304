// Recovery into a store on a GPU: the snapshot's bytes go through the
// store's pinned bounce buffer into the live device tensors, and a corrupt
// snapshot leaves them zeroed. Skips cleanly without a CUDA device (ctest
// label "gpu").
#include <ftw.h>
#include <stdlib.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "core/fixture_model.h"
#include "core/refit_session.h"
#include "core/runtime_info.h"
#include "core/snapshot.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/refit_helpers.h"

namespace refit::core {
namespace {

using ::refit::testing::PushAll;
using ::refit::testing::Snapshot;

class SnapshotGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    char pattern[] = "/tmp/refit_snapshot_gpu_test_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
    layout_ = ModelLayout::Build(FixtureConfig(), {}, QuantScheme::kPerTensor).value();
    cpu_ = ShardStore::Create(layout_, {}).value();
    SnapshotWriterOptions options;
    options.dir = dir_;
    std::unique_ptr<SnapshotWriter> writer = SnapshotWriter::Create(cpu_.get(), options).value();
    absl::StatusOr<RefitResult> r = PushAll(*cpu_, MakeFixtureWeights(FixtureConfig(), 1).value());
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(writer->AwaitWritten(r->version, absl::Seconds(60)));
  }
  void TearDown() override {
    if (!dir_.empty() && !HasFailure()) {
      ::nftw(
          dir_.c_str(),
          [](const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }, 16,
          FTW_DEPTH | FTW_PHYS);
    }
  }
  std::unique_ptr<ShardStore> GpuStore() {
    ShardStoreOptions options;
    options.device = "cuda:0";
    return ShardStore::Create(layout_, options).value();
  }

  std::string dir_;
  std::shared_ptr<const ModelLayout> layout_;
  std::unique_ptr<ShardStore> cpu_;
};

TEST_F(SnapshotGpuTest, RestoresTheBytesOfAHostSnapshotIntoTheLiveDeviceTensors) {
  std::unique_ptr<ShardStore> gpu = GpuStore();
  std::vector<const void*> pointers;
  for (const KernelView& k : gpu->Kernels()) pointers.push_back(k.data);
  absl::StatusOr<RecoveryResult> r = RecoverFromSnapshots(gpu.get(), dir_, RecoveryPolicy::kFail);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->restored.has_value());
  EXPECT_EQ(gpu->version(), 1u);
  EXPECT_EQ(gpu->fingerprint(), cpu_->fingerprint());
  EXPECT_TRUE(Snapshot(*gpu) == Snapshot(*cpu_));
  std::vector<KernelView> after = gpu->Kernels();
  for (size_t i = 0; i < after.size(); ++i) EXPECT_EQ(after[i].data, pointers[i]);
}

TEST_F(SnapshotGpuTest, ACorruptSnapshotLeavesTheDeviceTensorsZeroed) {
  const std::string path = dir_ + "/" + SnapshotFileName(1);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-100, std::ios::end);  // inside the last kernel
    f.put('\x5a');
  }
  std::unique_ptr<ShardStore> gpu = GpuStore();
  const std::string created = gpu->fingerprint();
  absl::StatusOr<RecoveryResult> r =
      RecoverFromSnapshots(gpu.get(), dir_, RecoveryPolicy::kFallback);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->restored.has_value());
  EXPECT_EQ(gpu->version(), 0u);
  EXPECT_EQ(gpu->fingerprint(), created);
  for (const auto& [name, bytes] : Snapshot(*gpu)) {
    EXPECT_EQ(bytes.find_first_not_of('\0'), std::string::npos) << name;
  }
}

}  // namespace
}  // namespace refit::core
