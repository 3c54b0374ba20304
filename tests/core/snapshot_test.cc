// Snapshots of committed versions: the file format round trip, detection of
// torn and corrupted files, recovery (newest verified one, fallback and fail
// policies, version numbering), and the background writer (coalescing,
// pruning, the version record written before a commit is visible).
#include "core/snapshot.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/fixture_model.h"
#include "core/model_layout.h"
#include "core/refit_session.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/refit_helpers.h"
#include "tests/testing/temp_dir.h"

namespace refit::core {
namespace {

using ::refit::testing::MakeStore;
using ::refit::testing::PushAll;
using ::testing::HasSubstr;

std::vector<OwnedTensor> Weights(uint64_t seed) {
  absl::StatusOr<std::vector<OwnedTensor>> w = MakeFixtureWeights(FixtureConfig(), seed);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *std::move(w) : std::vector<OwnedTensor>{};
}

SnapshotWriterOptions WriterOptions(const std::string& dir) {
  SnapshotWriterOptions options;
  options.dir = dir;
  return options;
}

// POSIX rather than std::filesystem: libtorch.so exports its own copies of
// libstdc++'s filesystem symbols, and the dynamic linker binds ours to them.
std::vector<std::string> Names(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (struct dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

int64_t FileSize(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? st.st_size : -1;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

using ::refit::testing::RemoveTree;

void FlipByte(const std::string& path, int64_t offset_from_end) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-offset_from_end, std::ios::end);
  char c = 0;
  f.get(c);
  f.seekp(-offset_from_end, std::ios::end);
  f.put(static_cast<char>(c ^ 0x5a));
}

class SnapshotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/refit_snapshot_test_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
    store_ = MakeStore(FixtureConfig());
    ASSERT_NE(store_, nullptr);
  }
  void TearDown() override {
    if (!HasFailure()) RemoveTree(dir_);
  }

  // Commits `seed`'s weights to store_ through a writer and waits for its
  // snapshot. Returns the committed version.
  uint64_t CommitAndSnapshot(uint64_t seed, const std::string& label = "") {
    absl::StatusOr<std::unique_ptr<SnapshotWriter>> writer =
        SnapshotWriter::Create(store_.get(), WriterOptions(dir_));
    EXPECT_TRUE(writer.ok()) << writer.status();
    RefitOptions options;
    options.label = label;
    absl::StatusOr<RefitResult> r = PushAll(*store_, Weights(seed), options);
    EXPECT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE((*writer)->AwaitWritten(r->version, absl::Seconds(60)));
    return r->version;
  }

  std::unique_ptr<ShardStore> FreshStore() { return MakeStore(FixtureConfig()); }

  std::string dir_;
  std::unique_ptr<ShardStore> store_;
};

TEST_F(SnapshotTest, RecoveryRestoresTheVersionFingerprintAndBytes) {
  CommitAndSnapshot(1);
  const uint64_t v2 = CommitAndSnapshot(2, "step 2\nwith a newline");
  ASSERT_EQ(v2, 2u);

  std::unique_ptr<ShardStore> restarted = FreshStore();
  absl::StatusOr<RecoveryResult> r =
      RecoverFromSnapshots(restarted.get(), dir_, RecoveryPolicy::kFallback);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->restored.has_value());
  EXPECT_EQ(r->restored->version, 2u);
  EXPECT_EQ(r->restored->label, "step 2\nwith a newline");
  EXPECT_EQ(restarted->version(), 2u);
  EXPECT_EQ(restarted->fingerprint(), store_->fingerprint());
  EXPECT_EQ(refit::testing::Snapshot(*restarted), refit::testing::Snapshot(*store_));

  // The next commit continues the numbering.
  absl::StatusOr<RefitResult> next = PushAll(*restarted, Weights(3));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->version, 3u);
}

TEST_F(SnapshotTest, WriterKeepsTheNewestTwoAndRecordsTheVersionFirst) {
  for (uint64_t seed = 1; seed <= 4; ++seed) CommitAndSnapshot(seed);
  EXPECT_THAT(Names(dir_),
              ::testing::ElementsAre(SnapshotFileName(3), SnapshotFileName(4), "version"));
  absl::StatusOr<uint64_t> recorded = ReadVersionRecord(dir_);
  ASSERT_TRUE(recorded.ok()) << recorded.status();
  EXPECT_EQ(*recorded, 4u);
  absl::StatusOr<SnapshotManifest> m = ReadSnapshotManifest(dir_ + "/" + SnapshotFileName(4));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->fingerprint, store_->fingerprint());
  EXPECT_EQ(m->layout_fingerprint, LayoutFingerprint(store_->layout()));
  EXPECT_EQ(m->kernel_bytes, store_->layout().kernel_bytes());
}

TEST_F(SnapshotTest, CorruptByteIsDetectedAndThePreviousOneServed) {
  CommitAndSnapshot(1);
  const std::string v1_fingerprint = store_->fingerprint();
  CommitAndSnapshot(2);
  const std::string newest = dir_ + "/" + SnapshotFileName(2);
  FlipByte(newest, 100);  // inside the last kernel's bytes

  std::unique_ptr<char[]> bytes;
  absl::StatusOr<SnapshotManifest> read = ReadSnapshot(newest, store_->layout(), &bytes);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(read.status().message(), HasSubstr("does not match its checksum"));

  std::unique_ptr<ShardStore> restarted = FreshStore();
  absl::StatusOr<RecoveryResult> r =
      RecoverFromSnapshots(restarted.get(), dir_, RecoveryPolicy::kFallback);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->restored.has_value());
  EXPECT_EQ(r->restored->version, 1u);
  EXPECT_EQ(restarted->fingerprint(), v1_fingerprint);
  ASSERT_EQ(r->rejected.size(), 1u);
  EXPECT_THAT(r->rejected[0], HasSubstr(SnapshotFileName(2)));
  EXPECT_TRUE(Exists(newest + ".rejected"));
  // Version 2 was handed out once: the next commit is 3.
  absl::StatusOr<RefitResult> next = PushAll(*restarted, Weights(3));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->version, 3u);
}

TEST_F(SnapshotTest, CorruptSnapshotRestoredInPlaceLeavesTheStoreAsCreated) {
  CommitAndSnapshot(1);
  const std::string path = dir_ + "/" + SnapshotFileName(1);
  FlipByte(path, 100);  // the last kernel: every kernel before it is written first
  std::unique_ptr<ShardStore> restarted = FreshStore();
  const std::string created_fingerprint = restarted->fingerprint();
  const std::map<std::string, std::string> created = refit::testing::Snapshot(*restarted);
  std::vector<const void*> pointers;
  for (const KernelView& k : restarted->Kernels()) pointers.push_back(k.data);

  absl::StatusOr<RecoveryResult> r =
      RecoverFromSnapshots(restarted.get(), dir_, RecoveryPolicy::kFallback);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->restored.has_value());
  ASSERT_EQ(r->rejected.size(), 1u);
  EXPECT_THAT(r->rejected[0], HasSubstr("does not match its checksum"));
  // Nothing of the unverified bytes stays: zeros, version 0, the fingerprint
  // of a new store, in the same tensors.
  EXPECT_EQ(restarted->version(), 0u);
  EXPECT_EQ(restarted->fingerprint(), created_fingerprint);
  EXPECT_TRUE(refit::testing::Snapshot(*restarted) == created);
  for (const auto& [name, bytes] : refit::testing::Snapshot(*restarted)) {
    EXPECT_EQ(bytes.find_first_not_of('\0'), std::string::npos) << name;
  }
  std::vector<KernelView> after = restarted->Kernels();
  for (size_t i = 0; i < after.size(); ++i) EXPECT_EQ(after[i].data, pointers[i]);
  // The fallback, --model, then commits as usual, numbered after version 1.
  absl::StatusOr<RefitResult> next = PushAll(*restarted, Weights(1));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->version, 2u);
  EXPECT_EQ(restarted->fingerprint(), store_->fingerprint());
}

TEST_F(SnapshotTest, AStoreNotPrefaultedIsZeroAndRestoresLikeAnother) {
  CommitAndSnapshot(1);
  std::shared_ptr<const ModelLayout> layout =
      ModelLayout::Build(FixtureConfig(), {}, QuantScheme::kPerTensor).value();
  ShardStoreOptions options;
  options.prefault_host = false;
  std::unique_ptr<ShardStore> lazy = ShardStore::Create(layout, options).value();
  std::unique_ptr<ShardStore> fresh = FreshStore();
  EXPECT_EQ(lazy->fingerprint(), fresh->fingerprint());
  EXPECT_TRUE(refit::testing::Snapshot(*lazy) == refit::testing::Snapshot(*fresh));
  absl::StatusOr<RecoveryResult> r = RecoverFromSnapshots(lazy.get(), dir_, RecoveryPolicy::kFail);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->restored.has_value());
  EXPECT_EQ(lazy->fingerprint(), store_->fingerprint());
  EXPECT_TRUE(refit::testing::Snapshot(*lazy) == refit::testing::Snapshot(*store_));
}

TEST_F(SnapshotTest, RestoreInPlaceZeroesWhatAFailedFillWrote) {
  std::unique_ptr<ShardStore> fresh = FreshStore();
  const std::string created_fingerprint = fresh->fingerprint();
  absl::StatusOr<RefitSlot> slot = fresh->AcquireRefitSlot("restore-3");
  ASSERT_TRUE(slot.ok());
  const std::vector<KernelView> kernels = fresh->Kernels();
  const size_t count = kernels.size();
  absl::StatusOr<CommitStats> failed = slot->RestoreInPlace(
      3, [&](const RestoreTarget& target) -> absl::StatusOr<std::vector<uint64_t>> {
        EXPECT_TRUE(target.bounce().empty());  // a host store: straight into the kernels
        for (size_t i = 0; i < count; ++i) {
          const KernelView& k = kernels[i];
          if (k.nbytes > 0) std::memset(target.host_data(static_cast<int>(i)), 0x7f, k.nbytes);
        }
        return absl::DataLossError("kernel x does not match its checksum");
      });
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(failed.status().message(), HasSubstr("kernel x"));
  EXPECT_EQ(fresh->version(), 0u);
  EXPECT_EQ(fresh->fingerprint(), created_fingerprint);
  for (const auto& [name, bytes] : refit::testing::Snapshot(*fresh)) {
    EXPECT_EQ(bytes.find_first_not_of('\0'), std::string::npos) << name;
  }
  absl::StatusOr<CommitStats> short_hashes = slot->RestoreInPlace(3, [](const RestoreTarget&) {
    return absl::StatusOr<std::vector<uint64_t>>(std::vector<uint64_t>{1});
  });
  EXPECT_EQ(short_hashes.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(short_hashes.status().message(), HasSubstr("1 kernel hashes for"));
  EXPECT_EQ(fresh->version(), 0u);
  EXPECT_EQ(
      slot->RestoreInPlace(0,
                           [](const RestoreTarget&) {
                             return absl::StatusOr<std::vector<uint64_t>>(std::vector<uint64_t>{});
                           })
          .status()
          .code(),
      absl::StatusCode::kFailedPrecondition);
}

TEST_F(SnapshotTest, FailPolicyRefusesACorruptSnapshot) {
  CommitAndSnapshot(1);
  const std::string path = dir_ + "/" + SnapshotFileName(1);
  FlipByte(path, 1);
  std::unique_ptr<ShardStore> restarted = FreshStore();
  absl::StatusOr<RecoveryResult> r =
      RecoverFromSnapshots(restarted.get(), dir_, RecoveryPolicy::kFail);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(r.status().message(), HasSubstr(SnapshotFileName(1)));
  EXPECT_THAT(r.status().message(), HasSubstr("--state-recovery=fail"));
  EXPECT_EQ(restarted->version(), 0u);
  EXPECT_TRUE(Exists(path));  // left for the operator
}

TEST_F(SnapshotTest, TornAndManifestDamageAreDataLoss) {
  CommitAndSnapshot(1);
  const std::string path = dir_ + "/" + SnapshotFileName(1);
  const int64_t size = FileSize(path);
  const std::string original = ReadAll(path);
  ASSERT_EQ(::truncate(path.c_str(), size - 10), 0);
  absl::StatusOr<SnapshotManifest> torn = ReadSnapshotManifest(path);
  EXPECT_EQ(torn.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(torn.status().message(), HasSubstr("torn snapshot"));

  // A byte of the manifest (the group name, a few bytes into it).
  WriteAll(path, original);
  FlipByte(path, size - 70);
  absl::StatusOr<SnapshotManifest> damaged = ReadSnapshotManifest(path);
  EXPECT_EQ(damaged.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(damaged.status().message(), HasSubstr("manifest checksum mismatch"));
}

TEST_F(SnapshotTest, AnotherLayoutIsSkippedNotServed) {
  CommitAndSnapshot(1);
  std::unique_ptr<ShardStore> other = MakeStore(FixtureConfig(), {}, QuantScheme::kPerChannel);
  ASSERT_NE(other, nullptr);
  EXPECT_NE(LayoutFingerprint(other->layout()), LayoutFingerprint(store_->layout()));
  absl::StatusOr<RecoveryResult> r = RecoverFromSnapshots(other.get(), dir_, RecoveryPolicy::kFail);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->restored.has_value());
  ASSERT_EQ(r->rejected.size(), 1u);
  EXPECT_THAT(r->rejected[0], HasSubstr("another model layout"));
  EXPECT_EQ(other->version(), 0u);
  // A load of the model for this layout is numbered after the version seen.
  absl::StatusOr<RefitResult> first = PushAll(*other, Weights(1));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->version, 2u);
}

TEST_F(SnapshotTest, PartialWriteLeavesThePreviousSnapshot) {
  CommitAndSnapshot(1);
  const std::string v1_fingerprint = store_->fingerprint();
  {
    SnapshotWriterOptions options = WriterOptions(dir_);
    options.hooks.pause_after_bytes = 4096;
    absl::StatusOr<std::unique_ptr<SnapshotWriter>> writer =
        SnapshotWriter::Create(store_.get(), options);
    ASSERT_TRUE(writer.ok()) << writer.status();
    ASSERT_TRUE(PushAll(*store_, Weights(2)).ok());
    // The destructor cancels the paused write, as a crash would leave it.
    EXPECT_FALSE((*writer)->AwaitWritten(2, absl::Milliseconds(1)));
  }
  EXPECT_THAT(Names(dir_), ::testing::Contains(".snapshot-00000000000000000002.refit.tmp"));
  std::unique_ptr<ShardStore> restarted = FreshStore();
  absl::StatusOr<RecoveryResult> r =
      RecoverFromSnapshots(restarted.get(), dir_, RecoveryPolicy::kFail);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->restored.has_value());
  EXPECT_EQ(r->restored->version, 1u);
  EXPECT_EQ(restarted->fingerprint(), v1_fingerprint);
  EXPECT_EQ(r->highest_version, 2u);
  EXPECT_THAT(Names(dir_),
              ::testing::Not(::testing::Contains(".snapshot-00000000000000000002.refit.tmp")));
}

TEST_F(SnapshotTest, CommitFailsWhenTheVersionCannotBeRecorded) {
  absl::StatusOr<std::unique_ptr<SnapshotWriter>> writer =
      SnapshotWriter::Create(store_.get(), WriterOptions(dir_));
  ASSERT_TRUE(writer.ok()) << writer.status();
  // A directory where the record's temporary file must go.
  ASSERT_EQ(::mkdir((dir_ + "/.version.tmp").c_str(), 0755), 0);
  absl::StatusOr<RefitResult> r = PushAll(*store_, Weights(1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("cannot record version 1"));
  EXPECT_EQ(store_->version(), 0u);
}

TEST_F(SnapshotTest, RestoreNeedsAnEmptyStore) {
  ASSERT_TRUE(PushAll(*store_, Weights(1)).ok());
  absl::StatusOr<RefitSlot> slot = store_->AcquireRefitSlot("restore");
  ASSERT_TRUE(slot.ok());
  absl::StatusOr<CommitStats> s = slot->Restore({}, 5);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.status().message(), HasSubstr("already serves version 1"));
}

TEST(RecoveryPolicyTest, ParsesTheTwoNames) {
  EXPECT_EQ(*ParseRecoveryPolicy("fallback"), RecoveryPolicy::kFallback);
  EXPECT_EQ(*ParseRecoveryPolicy("fail"), RecoveryPolicy::kFail);
  EXPECT_EQ(ParseRecoveryPolicy("model").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace refit::core
