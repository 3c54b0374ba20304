// RefitSession with device staging (a store on cuda:N in a REFIT_WITH_CUDA
// build): high-precision weights go to the GPU through the pinned pool, FP8
// quantization runs there, commit is device-to-device. These tests check the
// transaction guarantees on that path against the CPU path: same bytes and
// fingerprint, abort and errors leave the live version untouched and free
// every byte of device staging, non-finite weights are named, and an
// out-of-memory while staging is RESOURCE_EXHAUSTED.
// Skips cleanly on machines without a CUDA device (ctest label "gpu").
#include <algorithm>
#include <cstdlib>
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

#ifdef REFIT_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#endif

namespace refit::core {
namespace {

using ::refit::testing::IngestAll;
using ::refit::testing::PushAll;
using ::refit::testing::ShuffledChunks;
using ::refit::testing::Snapshot;
using ::refit::testing::ToChunk;
using ::testing::HasSubstr;

#ifdef REFIT_WITH_CUDA

// Index 0 of the allocator's stat arrays is the aggregate over pools (the
// enum's name and namespace moved between LibTorch versions; the index did not).
constexpr size_t kAggregate = 0;

// Bytes held by LibTorch's caching allocator for live tensors on cuda:0
// (device staging comes from it).
int64_t DeviceAllocatedBytes() {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[kAggregate].current;
}

class RefitSessionGpuTest : public ::testing::TestWithParam<QuantScheme> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    layout_ = ModelLayout::Build(FixtureConfig(), {}, GetParam()).value();
    ShardStoreOptions gpu_options;
    gpu_options.device = "cuda:0";
    gpu_ = ShardStore::Create(layout_, gpu_options).value();
    cpu_ = ShardStore::Create(layout_, {}).value();
    v1_ = MakeFixtureWeights(FixtureConfig(), 1).value();
    v2_ = MakeFixtureWeights(FixtureConfig(), 2).value();
    ASSERT_TRUE(PushAll(*gpu_, v1_).ok());
    ASSERT_TRUE(PushAll(*cpu_, v1_).ok());
    ASSERT_EQ(gpu_->fingerprint(), cpu_->fingerprint());
    Remember();
  }

  // Records the live version that ExpectUnchanged compares against.
  void Remember() {
    live_version_ = gpu_->version();
    live_ = Snapshot(*gpu_);
    fingerprint_ = gpu_->fingerprint();
    baseline_ = DeviceAllocatedBytes();
  }

  // The remembered version is live, bit for bit, the slot is free, and no
  // device staging is left behind.
  void ExpectUnchanged() {
    EXPECT_EQ(gpu_->version(), live_version_);
    EXPECT_EQ(gpu_->fingerprint(), fingerprint_);
    EXPECT_TRUE(Snapshot(*gpu_) == live_) << "live bytes changed";
    EXPECT_EQ(gpu_->active_session(), "");
    EXPECT_EQ(DeviceAllocatedBytes(), baseline_) << "device staging not freed";
  }

  std::shared_ptr<const ModelLayout> layout_;
  std::unique_ptr<ShardStore> gpu_, cpu_;
  std::vector<OwnedTensor> v1_, v2_;
  std::map<std::string, std::string> live_;
  uint64_t live_version_ = 0;
  std::string fingerprint_;
  int64_t baseline_ = 0;
};

TEST_P(RefitSessionGpuTest, ShuffledChunksGiveTheCpuBytesWithAndWithoutOverlap) {
  const void* first = gpu_->Kernels().front().data;
  uint64_t version = 1;
  for (bool overlap : {true, false}) {
    for (uint64_t seed : {3, 4}) {
      std::vector<OwnedTensor> w = MakeFixtureWeights(FixtureConfig(), seed).value();
      RefitOptions options;
      options.overlap_processing = overlap;
      std::unique_ptr<RefitSession> session = RefitSession::Begin(gpu_.get(), options).value();
      for (const auto& chunk : ShuffledChunks(w, seed, 777)) {
        ASSERT_TRUE(session->Ingest(ToChunk(chunk)).ok());
      }
      ASSERT_TRUE(session->Prepare().ok());
      // Every kernel is staged, on the device.
      EXPECT_EQ(session->progress().staged_kernel_bytes, layout_->kernel_bytes());
      EXPECT_GE(DeviceAllocatedBytes() - baseline_, layout_->kernel_bytes());
      absl::StatusOr<RefitResult> result = session->Commit();
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_EQ(result->version, ++version);
      ASSERT_TRUE(PushAll(*cpu_, w).ok());
      EXPECT_EQ(result->fingerprint, cpu_->fingerprint()) << "overlap " << overlap;
      EXPECT_TRUE(Snapshot(*gpu_) == Snapshot(*cpu_)) << "overlap " << overlap;
      session.reset();
      EXPECT_EQ(DeviceAllocatedBytes(), baseline_) << "device staging outlived the commit";
    }
  }
  EXPECT_EQ(gpu_->Kernels().front().data, first);
}

TEST_P(RefitSessionGpuTest, HostStagingGivesTheSameBytes) {
  // host_staging keeps the host path (CPU quantizer, host-to-device
  // commit); both must agree.
  RefitOptions host_staging;
  host_staging.host_staging = true;
  absl::StatusOr<RefitResult> host = PushAll(*gpu_, v2_, host_staging);
  ASSERT_TRUE(host.ok()) << host.status();
  std::map<std::string, std::string> host_bytes = Snapshot(*gpu_);
  absl::StatusOr<RefitResult> device = PushAll(*gpu_, v2_);
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_EQ(host->fingerprint, device->fingerprint);
  EXPECT_TRUE(Snapshot(*gpu_) == host_bytes);
}

TEST_P(RefitSessionGpuTest, AbortMidwayLeavesTheLiveVersionAndFreesDeviceStaging) {
  RefitOptions options;
  options.overlap_processing = false;  // processed layers are done on return
  std::unique_ptr<RefitSession> session = RefitSession::Begin(gpu_.get(), options).value();
  for (size_t i = 0; i < v2_.size() / 2; ++i) {
    ASSERT_TRUE(session->Ingest(ToChunk({&v2_[i], 0, v2_[i].bytes.size()})).ok());
  }
  SessionProgress midway = session->progress();
  EXPECT_GT(midway.layers_done, 0);
  EXPECT_GT(midway.staged_kernel_bytes, 0);
  EXPECT_GE(DeviceAllocatedBytes() - baseline_, midway.staged_kernel_bytes);
  session->Abort("midway");
  EXPECT_EQ(session->state(), SessionState::kAborted);
  EXPECT_EQ(session->progress().staged_kernel_bytes, 0);
  // After an abort from elsewhere, Ingest says why the refit ended.
  absl::Status late = session->Ingest(ToChunk({&v2_.back(), 0, v2_.back().bytes.size()}));
  EXPECT_EQ(late.code(), absl::StatusCode::kAborted) << late;
  EXPECT_THAT(late.message(), HasSubstr("midway"));
  ExpectUnchanged();
}

TEST_P(RefitSessionGpuTest, AbortWhileTheWorkerIsOnTheDeviceChangesNothing) {
  for (int round = 0; round < 5; ++round) {
    std::unique_ptr<RefitSession> session = RefitSession::Begin(gpu_.get(), {}).value();
    ASSERT_TRUE(IngestAll(*session, v2_).ok());
    session->Abort("round");
    EXPECT_EQ(session->progress().staged_kernel_bytes, 0);
    ExpectUnchanged();
  }
  // And the next refit still works.
  ASSERT_TRUE(PushAll(*gpu_, v2_).ok());
  ASSERT_TRUE(PushAll(*cpu_, v2_).ok());
  EXPECT_EQ(gpu_->fingerprint(), cpu_->fingerprint());
}

TEST_P(RefitSessionGpuTest, NonFiniteWeightUnderRejectFailsNamingTheTensor) {
  for (bool overlap : {true, false}) {
    std::vector<OwnedTensor> w = v2_;
    for (OwnedTensor& t : w) {
      if (t.name == "model.layers.1.mlp.down_proj.weight") {
        t.bytes[10] = 0xC0;  // bf16 0x7FC0 = NaN
        t.bytes[11] = 0x7F;
      }
    }
    RefitOptions options;
    options.overlap_processing = overlap;
    absl::StatusOr<RefitResult> result = PushAll(*gpu_, w, options);
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
    EXPECT_THAT(result.status().message(), HasSubstr("model.layers.1.mlp.down_proj"));
    ExpectUnchanged();
    // A NaN in part of a fused kernel (up of gate_up): the error names the
    // checkpoint tensor and element the trainer sent, in the host store's
    // words.
    std::vector<OwnedTensor> fused = v2_;
    for (OwnedTensor& t : fused) {
      if (t.name == "model.layers.1.mlp.up_proj.weight") {
        t.bytes[10] = 0xC0;
        t.bytes[11] = 0x7F;
      }
    }
    absl::StatusOr<RefitResult> on_gpu = PushAll(*gpu_, fused, options);
    absl::StatusOr<RefitResult> on_cpu = PushAll(*cpu_, fused, options);
    EXPECT_EQ(on_gpu.status().code(), absl::StatusCode::kInvalidArgument) << on_gpu.status();
    EXPECT_THAT(on_gpu.status().message(),
                HasSubstr("checkpoint tensor 'model.layers.1.mlp.up_proj.weight' row 0, col 5"));
    EXPECT_EQ(on_gpu.status().message(), on_cpu.status().message());
    ExpectUnchanged();

    // Under kVllmCompatible the same weights commit, with the CPU's bytes.
    RefitOptions vllm = options;
    vllm.non_finite = NonFinitePolicy::kVllmCompatible;
    absl::StatusOr<RefitResult> gpu_result = PushAll(*gpu_, w, vllm);
    ASSERT_TRUE(gpu_result.ok()) << gpu_result.status();
    ASSERT_TRUE(PushAll(*cpu_, w, vllm).ok());
    EXPECT_EQ(gpu_->fingerprint(), cpu_->fingerprint());
    EXPECT_TRUE(Snapshot(*gpu_) == Snapshot(*cpu_));
    Remember();
  }
}

TEST_P(RefitSessionGpuTest, OutOfDeviceMemoryWhileStagingIsResourceExhausted) {
  // Cap this process's caching allocator (which staging uses) at what it
  // holds now, then take every free byte inside that. Other processes on the
  // device (ctest -j) are not affected.
  c10::cuda::CUDACachingAllocator::emptyCache();
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  const int64_t reserved =
      c10::cuda::CUDACachingAllocator::getDeviceStats(0).reserved_bytes[kAggregate].current;
  c10::cuda::CUDACachingAllocator::setMemoryFraction(
      static_cast<double>(std::max<int64_t>(reserved, 1)) / static_cast<double>(total_bytes), 0);
  std::vector<at::Tensor> filler;
  const auto cuda = at::TensorOptions().dtype(at::kByte).device(at::kCUDA, 0);
  for (int64_t size = int64_t{1} << 26; size >= 512; size /= 2) {
    while (true) {
      try {
        filler.push_back(at::empty({size}, cuda));
      } catch (const c10::Error&) {
        break;
      }
    }
  }
  absl::StatusOr<RefitResult> result = PushAll(*gpu_, v2_);
  filler.clear();
  c10::cuda::CUDACachingAllocator::setMemoryFraction(1.0, 0);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted) << result.status();
  EXPECT_THAT(result.status().message(), HasSubstr("device staging"));
  ExpectUnchanged();
  // With memory back, the same refit goes through.
  ASSERT_TRUE(PushAll(*gpu_, v2_).ok());
  ASSERT_TRUE(PushAll(*cpu_, v2_).ok());
  EXPECT_EQ(gpu_->fingerprint(), cpu_->fingerprint());
}

INSTANTIATE_TEST_SUITE_P(Schemes, RefitSessionGpuTest,
                         ::testing::Values(QuantScheme::kPerTensor, QuantScheme::kPerChannel,
                                           QuantScheme::kBlock128),
                         [](const ::testing::TestParamInfo<QuantScheme>& info) {
                           std::string name(QuantSchemeName(info.param));
                           for (char& c : name) c = c == '-' ? '_' : c;
                           return name;
                         });

#else  // !REFIT_WITH_CUDA

TEST(RefitSessionGpuTest, NeedsACudaBuild) {
  GTEST_SKIP() << "built without REFIT_WITH_CUDA: the session stages on the host";
}

#endif  // REFIT_WITH_CUDA

}  // namespace
}  // namespace refit::core
