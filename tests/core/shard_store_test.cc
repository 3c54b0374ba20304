// ShardStore in host memory, through the API engines and the server use:
// Create, the kernel views, ReadKernel, the reader lock, listeners, and the
// effect of a commit made through RefitSession (the only way a store's
// version changes).
#include "core/shard_store.h"

#include <xxhash.h>

#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/fixture_model.h"
#include "core/model_layout.h"
#include "core/refit_session.h"
#include "core/runtime_info.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/refit_helpers.h"

namespace refit::core {
namespace {

using ::refit::testing::PushAll;
using ::testing::HasSubstr;

std::shared_ptr<const ModelLayout> FixtureLayout() {
  absl::StatusOr<std::shared_ptr<const ModelLayout>> layout =
      ModelLayout::Build(FixtureConfig(), {}, QuantScheme::kPerTensor);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return layout.ok() ? *std::move(layout) : nullptr;
}

std::vector<OwnedTensor> Weights(uint64_t seed) {
  absl::StatusOr<std::vector<OwnedTensor>> w = MakeFixtureWeights(FixtureConfig(), seed);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *std::move(w) : std::vector<OwnedTensor>{};
}

// The fingerprint recomputed from what ReadKernel returns, the way
// `refitctl verify` does it from the daemon's bytes.
std::string FingerprintOfLiveBytes(const ShardStore& store) {
  std::vector<const KernelSpec*> specs;
  std::vector<uint64_t> hashes;
  for (const KernelView& k : store.Kernels()) {
    std::string bytes;
    uint64_t version = 0;
    EXPECT_TRUE(store.ReadKernel(k.spec->name, &bytes, &version).ok()) << k.spec->name;
    specs.push_back(k.spec);
    hashes.push_back(XXH3_64bits(bytes.data(), bytes.size()));
  }
  return KernelFingerprint(specs, hashes);
}

class ShardStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    layout_ = FixtureLayout();
    ASSERT_NE(layout_, nullptr);
    ShardStoreOptions options;
    options.group = "draft";
    absl::StatusOr<std::unique_ptr<ShardStore>> store = ShardStore::Create(layout_, options);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }

  std::vector<void*> DataPointers() const {
    std::vector<void*> pointers;
    for (const KernelView& k : store_->Kernels()) pointers.push_back(k.data);
    return pointers;
  }

  std::shared_ptr<const ModelLayout> layout_;
  std::unique_ptr<ShardStore> store_;
};

TEST_F(ShardStoreTest, CreateGivesZeroedKernelsAtVersionZero) {
  EXPECT_EQ(&store_->layout(), layout_.get());
  EXPECT_EQ(store_->group(), "draft");
  EXPECT_EQ(store_->device(), "cpu");
  EXPECT_FALSE(store_->on_gpu());
  EXPECT_EQ(store_->version(), 0u);
  EXPECT_EQ(store_->last_commit_time(), absl::InfinitePast());
  EXPECT_EQ(store_->active_session(), "");
  ASSERT_EQ(static_cast<int64_t>(store_->Kernels().size()), layout_->num_kernels());
  for (const KernelView& k : store_->Kernels()) {
    std::string bytes;
    uint64_t version = 99;
    ASSERT_TRUE(store_->ReadKernel(k.spec->name, &bytes, &version).ok()) << k.spec->name;
    EXPECT_EQ(version, 0u);
    ASSERT_EQ(static_cast<int64_t>(bytes.size()), k.spec->nbytes()) << k.spec->name;
    EXPECT_EQ(bytes, std::string(bytes.size(), '\0')) << k.spec->name << " is not zeroed";
  }
  // The fingerprint of version 0 is the one of all-zero kernels.
  EXPECT_EQ(store_->fingerprint(), FingerprintOfLiveBytes(*store_));
  EXPECT_EQ(store_->fingerprint().size(), 16u);
}

TEST_F(ShardStoreTest, KernelsFollowTheLayoutOrderWithTheirLayerAndSize) {
  const std::vector<KernelView> kernels = store_->Kernels();
  size_t i = 0;
  int64_t total = 0;
  for (size_t l = 0; l < layout_->layers().size(); ++l) {
    const LayerSpec& layer = layout_->layers()[l];
    EXPECT_EQ(layer.first_kernel, static_cast<int>(i)) << layer.name;
    for (const KernelSpec& spec : layer.kernels) {
      ASSERT_LT(i, kernels.size());
      EXPECT_EQ(kernels[i].spec, &spec) << spec.name;
      EXPECT_EQ(kernels[i].layer, static_cast<int>(l)) << spec.name;
      EXPECT_EQ(kernels[i].nbytes, spec.nbytes()) << spec.name;
      if (spec.nbytes() > 0) {
        EXPECT_NE(kernels[i].data, nullptr) << spec.name;
      }
      total += kernels[i].nbytes;
      ++i;
    }
  }
  EXPECT_EQ(i, kernels.size());
  EXPECT_EQ(total, layout_->kernel_bytes());
  // Asking again hands out the same tensors.
  EXPECT_EQ(DataPointers(), DataPointers());
}

TEST_F(ShardStoreTest, ReadKernelOfAnUnknownNameIsNotFoundNamingIt) {
  std::string bytes = "untouched";
  uint64_t version = 7;
  absl::Status status =
      store_->ReadKernel("model.layers.99.mlp.down_proj.weight", &bytes, &version);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr("\"model.layers.99.mlp.down_proj.weight\""));
  EXPECT_EQ(bytes, "untouched");
  EXPECT_EQ(version, 7u);
}

TEST_F(ShardStoreTest, ReadKernelAcceptsANullVersion) {
  const KernelView first = store_->Kernels().front();
  std::string bytes;
  ASSERT_TRUE(store_->ReadKernel(first.spec->name, &bytes, nullptr).ok());
  EXPECT_EQ(static_cast<int64_t>(bytes.size()), first.nbytes);
}

TEST(ShardStoreCreateTest, RejectsAMalformedDeviceWithInvalidArgument) {
  std::shared_ptr<const ModelLayout> layout = FixtureLayout();
  ASSERT_NE(layout, nullptr);
  for (const char* device : {"cuda:x", "gpu0", ""}) {
    ShardStoreOptions options;
    options.device = device;
    absl::StatusOr<std::unique_ptr<ShardStore>> store = ShardStore::Create(layout, options);
    EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument) << device;
    EXPECT_THAT(store.status().message(), HasSubstr(absl::StrCat("device \"", device, "\"")));
  }
}

TEST(ShardStoreCreateTest, RejectsADeviceThatIsNeitherCpuNorCudaWithInvalidArgument) {
  std::shared_ptr<const ModelLayout> layout = FixtureLayout();
  ASSERT_NE(layout, nullptr);
  ShardStoreOptions options;
  options.device = "meta";
  absl::StatusOr<std::unique_ptr<ShardStore>> store = ShardStore::Create(layout, options);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(store.status().message(), HasSubstr("only cpu and cuda:N are supported"));
}

TEST(ShardStoreCreateTest, RejectsAGpuThisProcessCannotUseWithUnavailable) {
  std::shared_ptr<const ModelLayout> layout = FixtureLayout();
  ASSERT_NE(layout, nullptr);
  // One past the last device: missing on every machine, the first GPU on a
  // CPU-only one.
  ShardStoreOptions options;
  options.device = absl::StrCat("cuda:", CudaDeviceCount());
  absl::StatusOr<std::unique_ptr<ShardStore>> store = ShardStore::Create(layout, options);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(store.status().message(), HasSubstr(options.device));
  EXPECT_THAT(store.status().message(), HasSubstr("is not available"));
}

TEST(ShardStoreCreateTest, RejectsAMissingLayoutWithInvalidArgument) {
  absl::StatusOr<std::unique_ptr<ShardStore>> store =
      ShardStore::Create(nullptr, ShardStoreOptions{});
  EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(store.status().message(), HasSubstr("layout"));
}

TEST_F(ShardStoreTest, CommitBumpsTheVersionAndFingerprintAndKeepsDataPointers) {
  const std::vector<void*> pointers = DataPointers();
  const std::string zero_fingerprint = store_->fingerprint();
  const absl::Time before = absl::Now();

  absl::StatusOr<RefitResult> first = PushAll(*store_, Weights(/*seed=*/1));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(store_->version(), 1u);
  EXPECT_EQ(first->version, 1u);
  EXPECT_EQ(first->fingerprint, store_->fingerprint());
  EXPECT_NE(store_->fingerprint(), zero_fingerprint);
  EXPECT_EQ(store_->fingerprint(), FingerprintOfLiveBytes(*store_));
  EXPECT_GE(store_->last_commit_time(), before);
  EXPECT_EQ(store_->active_session(), "");
  EXPECT_EQ(DataPointers(), pointers);

  const std::string first_fingerprint = store_->fingerprint();
  absl::StatusOr<RefitResult> second = PushAll(*store_, Weights(/*seed=*/2));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(store_->version(), 2u);
  EXPECT_NE(store_->fingerprint(), first_fingerprint);
  EXPECT_EQ(DataPointers(), pointers);

  // The same bytes again: a new version with the fingerprint of the first.
  absl::StatusOr<RefitResult> again = PushAll(*store_, Weights(/*seed=*/1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(store_->version(), 3u);
  EXPECT_EQ(store_->fingerprint(), first_fingerprint);
}

TEST_F(ShardStoreTest, ReaderLockHoldsTheVersionThatReadKernelReports) {
  ASSERT_TRUE(PushAll(*store_, Weights(/*seed=*/1)).ok());
  const KernelView first = store_->Kernels().front();
  uint64_t locked_version = 0;
  store_->WithReaderLock([&](uint64_t version) { locked_version = version; });
  EXPECT_EQ(locked_version, 1u);
  std::string bytes;
  uint64_t read_version = 0;
  ASSERT_TRUE(store_->ReadKernel(first.spec->name, &bytes, &read_version).ok());
  EXPECT_EQ(read_version, locked_version);
}

TEST_F(ShardStoreTest, ReadKernelRangeGivesPiecesOfTheKernelWithTheirVersion) {
  ASSERT_TRUE(PushAll(*store_, Weights(/*seed=*/1)).ok());
  for (const KernelView& k : store_->Kernels()) {
    std::string whole;
    ASSERT_TRUE(store_->ReadKernel(k.spec->name, &whole, nullptr).ok());
    std::string pieces;
    for (int64_t offset = 0; offset < k.nbytes; offset += 1000) {
      std::string piece;
      uint64_t version = 0;
      ASSERT_TRUE(store_->ReadKernelRange(k.spec->name, offset, 1000, &piece, &version).ok());
      EXPECT_EQ(version, 1u);
      EXPECT_EQ(piece.size(), static_cast<size_t>(std::min<int64_t>(1000, k.nbytes - offset)));
      pieces += piece;
    }
    EXPECT_EQ(pieces, whole) << k.spec->name;
  }
  const KernelView first = store_->Kernels().front();
  std::string piece;
  uint64_t version = 0;
  ASSERT_TRUE(store_->ReadKernelRange(first.spec->name, first.nbytes, 10, &piece, &version).ok());
  EXPECT_EQ(piece, "");
  absl::Status past =
      store_->ReadKernelRange(first.spec->name, first.nbytes + 1, 10, &piece, &version);
  EXPECT_EQ(past.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(past.message(), HasSubstr(first.spec->name));
  EXPECT_EQ(store_->ReadKernelRange("no.such.kernel", 0, 10, &piece, &version).code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ShardStoreTest, LiveVersionIsVersionFingerprintAndCommitTimeOfOneVersion) {
  ASSERT_TRUE(PushAll(*store_, Weights(/*seed=*/1)).ok());
  const LiveVersion live = store_->live_version();
  EXPECT_EQ(live.version, store_->version());
  EXPECT_EQ(live.fingerprint, store_->fingerprint());
  EXPECT_EQ(live.last_commit, store_->last_commit_time());
}

TEST_F(ShardStoreTest, ListenersSeeARefitUntilRemoved) {
  std::vector<StoreEvent> seen;
  const int id = store_->AddListener([&](const StoreEvent& event) { seen.push_back(event); });
  std::vector<StoreEvent> other;
  const int other_id =
      store_->AddListener([&](const StoreEvent& event) { other.push_back(event); });
  EXPECT_NE(id, other_id);

  RefitOptions options;
  options.refit_id = "refit-1";
  ASSERT_TRUE(PushAll(*store_, Weights(/*seed=*/1), options).ok());
  ASSERT_GE(seen.size(), 2u);
  EXPECT_EQ(seen.front().type, StoreEventType::kStagingStarted);
  EXPECT_EQ(seen.front().refit_id, "refit-1");
  EXPECT_EQ(seen.front().group, "draft");
  const StoreEvent& committed = seen.back();
  EXPECT_EQ(committed.type, StoreEventType::kCommitted);
  EXPECT_EQ(committed.refit_id, "refit-1");
  EXPECT_EQ(committed.group, "draft");
  EXPECT_EQ(committed.version, 1u);
  EXPECT_EQ(committed.fingerprint, store_->fingerprint());
  EXPECT_NE(committed.time, absl::Time());
  EXPECT_EQ(other.size(), seen.size());

  store_->RemoveListener(id);
  const size_t before = seen.size();
  options.refit_id = "refit-2";
  ASSERT_TRUE(PushAll(*store_, Weights(/*seed=*/2), options).ok());
  EXPECT_EQ(seen.size(), before);
  ASSERT_FALSE(other.empty());
  EXPECT_EQ(other.back().type, StoreEventType::kCommitted);
  EXPECT_EQ(other.back().refit_id, "refit-2");
  EXPECT_EQ(other.back().version, 2u);

  store_->RemoveListener(other_id);
  store_->RemoveListener(other_id);  // unknown ids are ignored
}

TEST_F(ShardStoreTest, AbortedRefitIsAnnouncedAndChangesNothing) {
  ASSERT_TRUE(PushAll(*store_, Weights(/*seed=*/1)).ok());
  const std::string fingerprint = store_->fingerprint();
  const std::vector<void*> pointers = DataPointers();
  std::vector<StoreEvent> seen;
  const int id = store_->AddListener([&](const StoreEvent& event) { seen.push_back(event); });

  RefitOptions options;
  options.refit_id = "abandoned";
  absl::StatusOr<std::unique_ptr<RefitSession>> session =
      RefitSession::Begin(store_.get(), options);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ(store_->active_session(), "abandoned");
  (*session)->Abort("test abort");
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back().type, StoreEventType::kAborted);
  EXPECT_EQ(seen.back().refit_id, "abandoned");
  EXPECT_EQ(seen.back().version, 1u);
  EXPECT_THAT(seen.back().message, HasSubstr("test abort"));
  EXPECT_EQ(store_->version(), 1u);
  EXPECT_EQ(store_->fingerprint(), fingerprint);
  EXPECT_EQ(DataPointers(), pointers);
  EXPECT_EQ(store_->active_session(), "");
  store_->RemoveListener(id);
}

TEST_F(ShardStoreTest, NoEventGoesOutWhileEventsAreHeld) {
  absl::Mutex mu;
  std::vector<StoreEventType> seen;
  const int id = store_->AddListener([&](const StoreEvent& event) {
    absl::MutexLock lock(&mu);
    seen.push_back(event.type);
  });
  std::thread refit;
  store_->WithEventsHeld([&] {
    refit = std::thread([&] {
      RefitOptions options;
      options.refit_id = "held";
      std::unique_ptr<RefitSession> s = RefitSession::Begin(store_.get(), options).value();
      s->Abort("x");
    });
    // The refit holds the slot and waits to announce itself.
    for (int i = 0; i < 5000 && store_->active_session().empty(); ++i) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_EQ(store_->active_session(), "held");
    absl::SleepFor(absl::Milliseconds(20));
    absl::MutexLock lock(&mu);
    EXPECT_THAT(seen, ::testing::IsEmpty());
  });
  refit.join();
  store_->RemoveListener(id);
  EXPECT_THAT(seen,
              ::testing::ElementsAre(StoreEventType::kStagingStarted, StoreEventType::kAborted));
}

}  // namespace
}  // namespace refit::core
