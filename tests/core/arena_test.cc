// HostArena (the sealed memfd, its header and seqlock), the store's kernels
// in it, and the store's commit coordinator hook with RefitSession's two
// answers to engines that did not quiesce.
#include "core/arena.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/fixture_model.h"
#include "core/model_layout.h"
#include "core/parallel.h"
#include "core/refit_session.h"
#include "core/shard_store.h"
#include "core/snapshot.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/refit_helpers.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

namespace refit::core {
namespace {

using ::testing::HasSubstr;

std::vector<OwnedTensor> Weights(uint64_t seed) {
  absl::StatusOr<std::vector<OwnedTensor>> w = MakeFixtureWeights(FixtureConfig(), seed);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *std::move(w) : std::vector<OwnedTensor>{};
}

TEST(HostArenaTest, HeaderHoldsMagicSizesAndLayoutHash) {
  absl::StatusOr<std::unique_ptr<HostArena>> arena =
      HostArena::Create("test", 1000, 0x1234, /*populate=*/true);
  ASSERT_TRUE(arena.ok()) << arena.status();
  const ArenaHeader& h = (*arena)->header();
  EXPECT_EQ(std::string(h.magic, 8), "REFITAR1");
  EXPECT_EQ(h.format, kArenaFormat);
  EXPECT_EQ(h.header_bytes, 4096u);
  EXPECT_EQ(h.data_offset, 4096u);
  EXPECT_EQ(h.data_bytes, 1000u);
  EXPECT_EQ(h.layout_hash, 0x1234u);
  EXPECT_EQ(h.seq.load(), 0u);
  EXPECT_EQ(h.version.load(), 0u);
  EXPECT_EQ(h.committed_unix_ns.load(), 0u);
  EXPECT_EQ((*arena)->size(), 5096);
  // Zero-filled.
  EXPECT_EQ((*arena)->data()[0], 0);
  EXPECT_EQ((*arena)->data()[999], 0);
}

TEST(HostArenaTest, NegativeSizeIsInvalidArgument) {
  EXPECT_EQ(HostArena::Create("test", -1, 0, false).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(HostArenaTest, ReadOnlyDescriptorMapsReadOnlyOnlyAndSeesWrites) {
  absl::StatusOr<std::unique_ptr<HostArena>> arena = HostArena::Create("test", 4096, 0, true);
  ASSERT_TRUE(arena.ok()) << arena.status();
  absl::StatusOr<int> fd = (*arena)->OpenReadOnly();
  ASSERT_TRUE(fd.ok()) << fd.status();
  const size_t length = static_cast<size_t>((*arena)->size());
  errno = 0;
  EXPECT_EQ(::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0), MAP_FAILED);
  EXPECT_EQ(errno, EACCES);
  void* p = ::mmap(nullptr, length, PROT_READ, MAP_SHARED, *fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  // A read-only shared mapping cannot be made writable either.
  EXPECT_NE(::mprotect(p, length, PROT_READ | PROT_WRITE), 0);
  std::memcpy((*arena)->data(), "hello", 5);
  EXPECT_EQ(std::string(static_cast<char*>(p) + kArenaDataOffset, 5), "hello");
  // Nobody can shrink it under the mappings.
  EXPECT_NE(::ftruncate(*fd, 0), 0);
  const int seals = ::fcntl(*fd, F_GET_SEALS);
  EXPECT_NE(seals & F_SEAL_SHRINK, 0);
  EXPECT_NE(seals & F_SEAL_GROW, 0);
  if ((*arena)->sealed()) {
    EXPECT_NE(seals & F_SEAL_FUTURE_WRITE, 0);
  }
  ::munmap(p, length);
  ::close(*fd);
}

TEST(HostArenaTest, AnEngineThatTakesTheArenasPermissionsAwayDoesNotStopLaterAttaches) {
  // An engine of the daemon's uid may fchmod the memfd through the
  // descriptor it received. Run where that uid has no capability to open
  // past the permissions: a child, as nobody when this test runs as root.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::geteuid() == 0 && ::setresuid(65534, 65534, 65534) != 0) ::_exit(2);
    absl::StatusOr<std::unique_ptr<HostArena>> arena = HostArena::Create("test", 4096, 0, true);
    if (!arena.ok()) ::_exit(3);
    absl::StatusOr<int> engine = (*arena)->OpenReadOnly();
    if (!engine.ok() || ::fchmod(*engine, 0) != 0) ::_exit(4);
    absl::StatusOr<int> next = (*arena)->OpenReadOnly();
    if (!next.ok()) ::_exit(5);
    void* p =
        ::mmap(nullptr, static_cast<size_t>((*arena)->size()), PROT_READ, MAP_SHARED, *next, 0);
    ::_exit(p == MAP_FAILED ? 6 : 0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  // 5: the second attach's descriptor was refused after the fchmod.
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(HostArenaTest, SeqIsOddWhileWritingAndEvenWithTheVersionAfter) {
  absl::StatusOr<std::unique_ptr<HostArena>> arena = HostArena::Create("test", 64, 0, true);
  ASSERT_TRUE(arena.ok()) << arena.status();
  (*arena)->BeginWrite();
  EXPECT_EQ((*arena)->header().seq.load() % 2, 1u);
  (*arena)->EndWrite(7);
  EXPECT_EQ((*arena)->header().seq.load(), 2u);
  EXPECT_EQ((*arena)->header().version.load(), 7u);
}

TEST(HostArenaTest, EndWriteRecordsTheFingerprintAndRefitIdOfANewVersion) {
  absl::StatusOr<std::unique_ptr<HostArena>> arena = HostArena::Create("test", 64, 0, true);
  ASSERT_TRUE(arena.ok()) << arena.status();
  const ArenaHeader& h = (*arena)->header();
  EXPECT_EQ(std::string(h.fingerprint, sizeof h.fingerprint), std::string(32, '\0'));
  EXPECT_EQ(std::string(h.refit_id, sizeof h.refit_id), std::string(128, '\0'));
  (*arena)->BeginWrite();
  (*arena)->EndWrite(1, "0123456789abcdef", "r-one");
  EXPECT_STREQ(h.fingerprint, "0123456789abcdef");
  EXPECT_STREQ(h.refit_id, "r-one");
  // A shorter value leaves no bytes of the longer one behind.
  (*arena)->BeginWrite();
  (*arena)->EndWrite(2, "fe", "r2");
  EXPECT_EQ(std::string(h.fingerprint, 4), std::string("fe\0\0", 4));
  EXPECT_EQ(std::string(h.refit_id, sizeof h.refit_id), "r2" + std::string(126, '\0'));
  // A write that publishes no new version (a failed restore) keeps them.
  (*arena)->BeginWrite();
  (*arena)->EndWrite(2);
  EXPECT_STREQ(h.fingerprint, "fe");
  EXPECT_STREQ(h.refit_id, "r2");
  // What does not fit (with its NUL) is left empty, never cut short: the
  // engine then waits for the stream's Committed.
  (*arena)->BeginWrite();
  (*arena)->EndWrite(3, std::string(32, 'f'), std::string(128, 'r'));
  EXPECT_STREQ(h.fingerprint, "");
  EXPECT_STREQ(h.refit_id, "");
  (*arena)->BeginWrite();
  (*arena)->EndWrite(4, std::string(31, 'f'), std::string(127, 'r'));
  EXPECT_EQ(std::string(h.fingerprint), std::string(31, 'f'));
  EXPECT_EQ(std::string(h.refit_id), std::string(127, 'r'));
}

TEST(StreamingCopyTest, CopiesEveryByteAtAnyAlignmentAndLength) {
  std::vector<char> src(3 << 20);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>((i * 131 + 7) % 251);
  for (size_t length : {0, 1, 63, 64, 4095, 4096, 4097, 65 * 1024 + 3, 2 << 20}) {
    for (size_t offset : {0, 1, 17, 64, 255}) {
      std::vector<char> dst(length + 512, 'x');
      StreamingCopy(dst.data() + offset, src.data() + 3, length);
      EXPECT_EQ(std::string(dst.data() + offset, length), std::string(src.data() + 3, length))
          << length << " bytes at offset " << offset;
      EXPECT_EQ(std::string(dst.data(), offset), std::string(offset, 'x'));
      EXPECT_EQ(dst[offset + length], 'x');
    }
  }
}

TEST(ParallelStreamingCopyTest, SplitsTheBytesOverThreadsAndCopiesEachExactlyOnce) {
  // Copies of odd sizes and alignments, large enough together to be split
  // (boundaries fall inside copies), into one buffer with gaps that must
  // stay untouched.
  const std::vector<size_t> sizes = {5,        (3 << 20) + 17, 64, 1,
                                     4096 + 3, (7 << 20) + 1,  0,  (2 << 20) - 9,
                                     255,      (5 << 20) + 64, 100};
  size_t total = 0;
  for (size_t n : sizes) total += n + 7;
  std::vector<char> src(total), dst(total + 64);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>((i * 37 + 11) % 253);
  for (auto [threads, per_thread] : std::vector<std::pair<int, size_t>>{{1, size_t{4} << 20},
                                                                        {2, size_t{4} << 20},
                                                                        {3, size_t{4} << 20},
                                                                        {8, size_t{4} << 20},
                                                                        {8, size_t{64} << 10},
                                                                        {5, 1}}) {
    std::fill(dst.begin(), dst.end(), 'x');
    std::vector<HostCopy> copies;
    size_t at = 0;
    for (size_t n : sizes) {
      copies.push_back({dst.data() + at + 3, src.data() + at + 1, n});
      at += n + 7;
    }
    ParallelStreamingCopy(copies, threads, per_thread);
    at = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const size_t n = sizes[i];
      ASSERT_EQ(std::memcmp(dst.data() + at + 3, src.data() + at + 1, n), 0)
          << "copy " << i << " with " << threads << " threads, " << per_thread << " bytes each";
      for (size_t k : {size_t{0}, size_t{1}, size_t{2}}) ASSERT_EQ(dst[at + k], 'x');
      for (size_t k = at + 3 + n; k < at + n + 7; ++k) ASSERT_EQ(dst[k], 'x') << "past copy " << i;
      at += n + 7;
    }
  }
}

TEST(ForEachInParallelTest, RunsEveryTaskExactlyOnceOnAtMostTheThreadsAsked) {
  for (auto [n, threads] :
       std::vector<std::pair<int, int>>{{0, 4}, {1, 4}, {7, 1}, {7, 3}, {64, 8}, {3, 16}}) {
    std::vector<std::atomic<int>> runs(static_cast<size_t>(n));
    absl::Mutex mu;
    std::set<std::thread::id> ran_on;
    ForEachInParallel(n, threads, [&](int i) {
      runs[static_cast<size_t>(i)].fetch_add(1);
      absl::MutexLock lock(&mu);
      ran_on.insert(std::this_thread::get_id());
    });
    for (int i = 0; i < n; ++i)
      EXPECT_EQ(runs[static_cast<size_t>(i)].load(), 1) << i << " of " << n;
    EXPECT_LE(static_cast<int>(ran_on.size()), std::max(1, std::min(n, threads))) << n << " tasks";
  }
}

TEST(DeviceArenaSharingTest, ParsesIpcAndVmmAndNamesAnythingElse) {
  EXPECT_EQ(ParseDeviceArenaSharing("ipc").value(), DeviceArenaSharing::kCudaIpc);
  EXPECT_EQ(ParseDeviceArenaSharing("vmm").value(), DeviceArenaSharing::kVmmFd);
  EXPECT_EQ(DeviceArenaSharingName(DeviceArenaSharing::kVmmFd), "vmm");
  EXPECT_EQ(DeviceArenaSharingName(DeviceArenaSharing::kCudaIpc), "ipc");
  absl::StatusOr<DeviceArenaSharing> bad = ParseDeviceArenaSharing("VMM");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), ::testing::HasSubstr("\"VMM\""));
  EXPECT_EQ(DeviceArena::default_sharing(), DeviceArenaSharing::kCudaIpc);
}

// SetHostThreads caps both the quantizer's default and the bulk copies'
// threads; 0 gives back one per core for the quantizer, at most 8 for the rest.
TEST(HostThreadsTest, SetHostThreadsCapsTheQuantizerAndBulkWork) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  EXPECT_EQ(DefaultQuantizeThreads(), cores);
  EXPECT_EQ(BulkThreads(), std::min(cores, 8));
  SetHostThreads(3);
  EXPECT_EQ(DefaultQuantizeThreads(), 3);
  EXPECT_EQ(BulkThreads(), 3);
  SetHostThreads(12);
  EXPECT_EQ(DefaultQuantizeThreads(), 12);
  EXPECT_EQ(BulkThreads(), 12);
  SetHostThreads(0);
  EXPECT_EQ(DefaultQuantizeThreads(), cores);
  EXPECT_EQ(BulkThreads(), std::min(cores, 8));
}

// Whether thread `tid` of this process is blocked in the futex syscall.
bool InFutexWait(pid_t tid) {
  std::ifstream f(absl::StrCat("/proc/self/task/", tid, "/syscall"));
  std::string number;
  f >> number;
  return number == std::to_string(SYS_futex);
}

TEST(HostArenaTest, EndWriteWakesAReaderSleepingOnSeqInAReadOnlyMapping) {
  absl::StatusOr<std::unique_ptr<HostArena>> arena = HostArena::Create("test", 64, 0, true);
  ASSERT_TRUE(arena.ok()) << arena.status();
  absl::StatusOr<int> fd = (*arena)->OpenReadOnly();
  ASSERT_TRUE(fd.ok()) << fd.status();
  const size_t length = static_cast<size_t>((*arena)->size());
  void* p = ::mmap(nullptr, length, PROT_READ, MAP_SHARED, *fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  ::close(*fd);
  (*arena)->BeginWrite();  // seq 1: a commit copies
  std::atomic<pid_t> tid{0};
  std::atomic<bool> returned{false};
  long rc = -2;
  int error = 0;
  std::thread reader([&] {
    tid = static_cast<pid_t>(::syscall(SYS_gettid));
    // What an engine's safe point does: sleep while seq holds the odd value.
    struct timespec limit = {30, 0};
    rc = ::syscall(SYS_futex, static_cast<char*>(p) + 40, FUTEX_WAIT, 1u, &limit, nullptr, 0);
    error = errno;
    returned = true;
  });
  // Until it sleeps (or returned at once: then rc says why).
  while (!returned && (tid == 0 || !InFutexWait(tid))) std::this_thread::yield();
  (*arena)->EndWrite(1);
  reader.join();
  EXPECT_EQ(rc, 0) << std::strerror(error);  // woken, not timed out
  ::munmap(p, length);
}

class StoreArenaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = testing::MakeStore(FixtureConfig());
    ASSERT_NE(store_, nullptr);
  }
  std::unique_ptr<ShardStore> store_;
};

TEST_F(StoreArenaTest, KernelsLieInTheArenaAtAlignedOffsets) {
  const ArenaInfo arena = store_->arena();
  EXPECT_FALSE(arena.on_device);
  EXPECT_EQ(arena.device_index, -1);
  EXPECT_EQ(arena.host_bytes, kArenaDataOffset + arena.data_bytes);
  EXPECT_EQ(absl::StrFormat("%016x", arena.layout_hash), LayoutFingerprint(store_->layout()));
  const std::vector<KernelView> kernels = store_->Kernels();
  ASSERT_FALSE(kernels.empty());
  const char* base = static_cast<const char*>(kernels[0].data) - kernels[0].arena_offset;
  int64_t end = 0;
  for (const KernelView& k : kernels) {
    EXPECT_EQ(k.arena_offset % kArenaAlign, 0) << k.spec->name;
    EXPECT_GE(k.arena_offset, end) << k.spec->name;
    EXPECT_EQ(static_cast<const char*>(k.data), base + k.arena_offset) << k.spec->name;
    end = k.arena_offset + k.nbytes;
  }
  EXPECT_LE(end, arena.data_bytes);
}

TEST_F(StoreArenaTest, AnEngineMappingSeesEachCommitWithItsVersionAndAnEvenSeq) {
  absl::StatusOr<int> fd = store_->OpenArenaReadOnly();
  ASSERT_TRUE(fd.ok()) << fd.status();
  const ArenaInfo arena = store_->arena();
  void* p = ::mmap(nullptr, static_cast<size_t>(arena.host_bytes), PROT_READ, MAP_SHARED, *fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  ::close(*fd);
  const auto* header = static_cast<const ArenaHeader*>(p);
  EXPECT_EQ(header->version.load(), 0u);
  EXPECT_EQ(header->committed_unix_ns.load(), 0u);
  const absl::Time before = absl::Now();
  absl::StatusOr<RefitResult> first = testing::PushAll(*store_, Weights(1));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(header->version.load(), 1u);
  EXPECT_EQ(header->seq.load(), 2u);
  // The whole Committed event: the refit and the content fingerprint.
  EXPECT_EQ(std::string(header->refit_id), first->refit_id);
  EXPECT_FALSE(first->refit_id.empty());
  EXPECT_EQ(std::string(header->fingerprint), first->fingerprint);
  EXPECT_EQ(std::string(header->fingerprint), store_->fingerprint());
  // When the copy ended: within the push, on the wall clock.
  const absl::Time committed =
      absl::FromUnixNanos(static_cast<int64_t>(header->committed_unix_ns.load()));
  EXPECT_GE(committed, before - absl::Milliseconds(1));
  EXPECT_LE(committed, absl::Now() + absl::Milliseconds(1));
  const uint64_t first_commit = header->committed_unix_ns.load();
  const KernelView k = store_->Kernels()[2];
  std::string live;
  ASSERT_TRUE(store_->ReadKernel(k.spec->name, &live, nullptr).ok());
  EXPECT_EQ(std::string(static_cast<const char*>(p) + kArenaDataOffset + k.arena_offset,
                        static_cast<size_t>(k.nbytes)),
            live);
  absl::StatusOr<RefitResult> second = testing::PushAll(*store_, Weights(2));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(header->version.load(), 2u);
  EXPECT_EQ(header->seq.load(), 4u);
  EXPECT_EQ(std::string(header->refit_id), second->refit_id);
  EXPECT_NE(second->refit_id, first->refit_id);
  EXPECT_EQ(std::string(header->fingerprint), second->fingerprint);
  EXPECT_NE(second->fingerprint, first->fingerprint);
  EXPECT_GE(header->committed_unix_ns.load(), first_commit);
  ::munmap(p, static_cast<size_t>(arena.host_bytes));
}

// Records the calls; BeforeCommit answers with `answer`.
class FakeCoordinator : public CommitCoordinator {
 public:
  absl::Status BeforeCommit(absl::string_view refit_id, uint64_t next_version) override {
    before.push_back(absl::StrCat(refit_id, "@", next_version));
    return answer;
  }
  void AfterCommit(absl::string_view refit_id, const absl::StatusOr<CommitStats>& result) override {
    after.push_back(absl::StrCat(refit_id, "@", result.ok() ? result->version : 0));
  }
  absl::Status answer = absl::OkStatus();
  std::vector<std::string> before;
  std::vector<std::string> after;
};

TEST_F(StoreArenaTest, CoordinatorIsToldBeforeAndAfterEachCommit) {
  FakeCoordinator coordinator;
  store_->SetCommitCoordinator(&coordinator);
  RefitOptions options;
  options.refit_id = "r-1";
  ASSERT_TRUE(testing::PushAll(*store_, Weights(1), options).ok());
  EXPECT_THAT(coordinator.before, ::testing::ElementsAre("r-1@1"));
  EXPECT_THAT(coordinator.after, ::testing::ElementsAre("r-1@1"));
  store_->SetCommitCoordinator(nullptr);
}

TEST_F(StoreArenaTest, OnePhaseRefitThatEnginesDidNotQuiesceForIsAbortedNamingThem) {
  FakeCoordinator coordinator;
  coordinator.answer = NotQuiescedError("engine \"e-1\" did not quiesce within 1s");
  store_->SetCommitCoordinator(&coordinator);
  RefitOptions options;
  options.refit_id = "r-1";
  absl::StatusOr<RefitResult> result = testing::PushAll(*store_, Weights(1), options);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(result.status().message(), HasSubstr("refit \"r-1\" aborted: engine \"e-1\""));
  EXPECT_FALSE(IsNotQuiesced(result.status()));
  EXPECT_EQ(store_->version(), 0u);
  EXPECT_EQ(store_->arena().layout_hash != 0, true);
  EXPECT_TRUE(coordinator.after.empty());
  EXPECT_EQ(store_->active_session(), "");  // the slot is free again
  store_->SetCommitCoordinator(nullptr);
}

TEST_F(StoreArenaTest, PreparedRefitThatEnginesDidNotQuiesceForStaysPrepared) {
  FakeCoordinator coordinator;
  coordinator.answer = NotQuiescedError("engine \"e-1\" did not quiesce within 1s");
  store_->SetCommitCoordinator(&coordinator);
  RefitOptions options;
  options.refit_id = "r-1";
  absl::StatusOr<std::unique_ptr<RefitSession>> session =
      RefitSession::Begin(store_.get(), options);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE(testing::IngestAll(**session, Weights(1)).ok());
  ASSERT_TRUE((*session)->Prepare().ok());
  absl::StatusOr<RefitResult> committed = (*session)->Commit();
  EXPECT_EQ(committed.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(committed.status().message(), HasSubstr("engine \"e-1\""));
  EXPECT_THAT(committed.status().message(), HasSubstr("stays PREPARED"));
  EXPECT_EQ((*session)->state(), SessionState::kPrepared);
  EXPECT_EQ(store_->version(), 0u);
  EXPECT_EQ(store_->active_session(), "r-1");
  // Once the engines let it through, the same refit commits.
  coordinator.answer = absl::OkStatus();
  committed = (*session)->Commit();
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->version, 1u);
  EXPECT_EQ((*session)->state(), SessionState::kCommitted);
  store_->SetCommitCoordinator(nullptr);
}

TEST(LayoutIdentityTest, NamesTheFieldsAnEngineChecks) {
  absl::StatusOr<std::shared_ptr<const ModelLayout>> layout =
      ModelLayout::Build(FixtureConfig(), {1, 2}, QuantScheme::kPerChannel);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const LayoutIdentity id = IdentifyLayout(**layout);
  EXPECT_EQ(id.architecture, "LlamaForCausalLM");
  EXPECT_EQ(id.tp_rank, 1);
  EXPECT_EQ(id.tp_size, 2);
  EXPECT_EQ(id.checkpoint_dtype, "bfloat16");
  EXPECT_EQ(id.quantization, "per-channel");
  EXPECT_EQ(id.fingerprint, LayoutFingerprint(**layout));
  EXPECT_EQ(id.tensors_hash.size(), 16u);
  EXPECT_EQ(id.checkpoint_id.size(), 16u);
  absl::StatusOr<std::shared_ptr<const ModelLayout>> other =
      ModelLayout::Build(FixtureConfig(), {1, 2}, QuantScheme::kPerTensor);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(IdentifyLayout(**other).quant_config_hash, id.quant_config_hash);
  EXPECT_EQ(IdentifyLayout(**other).checkpoint_id, id.checkpoint_id);
}

}  // namespace
}  // namespace refit::core
