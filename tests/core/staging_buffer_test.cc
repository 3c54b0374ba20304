#include "core/staging_buffer.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::core {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string Message(const absl::Status& status) { return std::string(status.message()); }

// A buffer over `storage` whose release function counts its calls.
StagingBuffer Counted(uint8_t* storage, int64_t size, int* releases, bool on_device = false) {
  return StagingBuffer(storage, size, on_device, [releases] { ++*releases; });
}

bool AllZero(const StagingBuffer& buffer) {
  for (int64_t i = 0; i < buffer.size(); ++i) {
    if (buffer.data()[i] != 0) return false;
  }
  return true;
}

TEST(StagingBufferTest, HostZeroedIsZeroAndHasItsSize) {
  absl::StatusOr<StagingBuffer> buffer = StagingBuffer::HostZeroed(4096, "layer 0 params");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(buffer->size(), 4096);
  EXPECT_FALSE(buffer->empty());
  EXPECT_FALSE(buffer->on_device());
  ASSERT_NE(buffer->data(), nullptr);
  EXPECT_TRUE(AllZero(*buffer));
}

TEST(StagingBufferTest, LargeHostZeroedIsZero) {
  // Large enough that calloc hands out fresh pages instead of clearing.
  constexpr int64_t kSize = int64_t{8} << 20;
  absl::StatusOr<StagingBuffer> buffer = StagingBuffer::HostZeroed(kSize, "embed_tokens");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(buffer->size(), kSize);
  EXPECT_TRUE(AllZero(*buffer));
}

TEST(StagingBufferTest, HostUninitializedHasItsSizeAndIsWritable) {
  absl::StatusOr<StagingBuffer> buffer = StagingBuffer::HostUninitialized(1000, "kernel");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(buffer->size(), 1000);
  EXPECT_FALSE(buffer->empty());
  EXPECT_FALSE(buffer->on_device());
  ASSERT_NE(buffer->data(), nullptr);
  std::memset(buffer->data(), 0xab, 1000);
  EXPECT_EQ(buffer->data()[0], 0xab);
  EXPECT_EQ(buffer->data()[999], 0xab);
}

TEST(StagingBufferTest, EmptyBuffersHaveNoData) {
  StagingBuffer by_default;
  EXPECT_EQ(by_default.data(), nullptr);
  EXPECT_EQ(by_default.size(), 0);
  EXPECT_TRUE(by_default.empty());
  EXPECT_FALSE(by_default.on_device());

  absl::StatusOr<StagingBuffer> zeroed = StagingBuffer::HostZeroed(0, "empty");
  ASSERT_TRUE(zeroed.ok()) << zeroed.status();
  EXPECT_EQ(zeroed->data(), nullptr);
  EXPECT_EQ(zeroed->size(), 0);
  EXPECT_TRUE(zeroed->empty());

  absl::StatusOr<StagingBuffer> uninitialized = StagingBuffer::HostUninitialized(0, "empty");
  ASSERT_TRUE(uninitialized.ok()) << uninitialized.status();
  EXPECT_EQ(uninitialized->data(), nullptr);
  EXPECT_EQ(uninitialized->size(), 0);
  EXPECT_TRUE(uninitialized->empty());
}

TEST(StagingBufferTest, RefusesNegativeSizeAsInvalidArgument) {
  absl::StatusOr<StagingBuffer> zeroed = StagingBuffer::HostZeroed(-1, "layer 3 params");
  EXPECT_EQ(zeroed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(zeroed.status()),
              AllOf(HasSubstr("negative"), HasSubstr("-1"), HasSubstr("layer 3 params")));

  absl::StatusOr<StagingBuffer> uninitialized =
      StagingBuffer::HostUninitialized(std::numeric_limits<int64_t>::min(), "layer 4 kernels");
  EXPECT_EQ(uninitialized.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(uninitialized.status()),
              AllOf(HasSubstr("negative"), HasSubstr("layer 4 kernels")));
}

TEST(StagingBufferTest, ImpossibleSizeIsResourceExhaustedNamingWhat) {
  // 4 EiB: more than any address space holds, so the allocation fails
  // however much memory the machine has.
  constexpr int64_t kImpossible = int64_t{1} << 62;
  absl::StatusOr<StagingBuffer> zeroed = StagingBuffer::HostZeroed(kImpossible, "lm_head");
  EXPECT_EQ(zeroed.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Message(zeroed.status()),
              AllOf(HasSubstr("lm_head"), HasSubstr(std::to_string(kImpossible))));

  absl::StatusOr<StagingBuffer> uninitialized =
      StagingBuffer::HostUninitialized(std::numeric_limits<int64_t>::max(), "layer 7 kernels");
  EXPECT_EQ(uninitialized.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Message(uninitialized.status()), HasSubstr("layer 7 kernels"));
}

TEST(StagingBufferTest, WrappedMemoryIsReleasedOnceOnDestruction) {
  uint8_t storage[16] = {};
  int releases = 0;
  {
    StagingBuffer buffer = Counted(storage, sizeof storage, &releases, /*on_device=*/true);
    EXPECT_EQ(buffer.data(), storage);
    EXPECT_EQ(buffer.size(), 16);
    EXPECT_TRUE(buffer.on_device());
    EXPECT_EQ(releases, 0);
  }
  EXPECT_EQ(releases, 1);
}

TEST(StagingBufferTest, MoveConstructionTransfersOwnership) {
  uint8_t storage[16] = {};
  int releases = 0;
  StagingBuffer source = Counted(storage, sizeof storage, &releases, /*on_device=*/true);
  {
    StagingBuffer target(std::move(source));
    EXPECT_EQ(target.data(), storage);
    EXPECT_EQ(target.size(), 16);
    EXPECT_TRUE(target.on_device());
    // The moved-from buffer is empty and owns nothing.
    EXPECT_EQ(source.data(), nullptr);  // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(source.size(), 0);
    EXPECT_TRUE(source.empty());
    EXPECT_FALSE(source.on_device());
    EXPECT_EQ(releases, 0);
  }
  EXPECT_EQ(releases, 1);
  source = StagingBuffer();  // destroying or reassigning the husk releases nothing
  EXPECT_EQ(releases, 1);
}

TEST(StagingBufferTest, MoveAssignmentTransfersOwnership) {
  uint8_t storage[16] = {};
  int releases = 0;
  StagingBuffer source = Counted(storage, sizeof storage, &releases);
  {
    StagingBuffer target;
    target = std::move(source);
    EXPECT_EQ(target.data(), storage);
    EXPECT_EQ(target.size(), 16);
    EXPECT_EQ(source.data(), nullptr);  // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(source.size(), 0);
    EXPECT_EQ(releases, 0);
  }
  EXPECT_EQ(releases, 1);
}

TEST(StagingBufferTest, MoveAssignmentOverAFullBufferReleasesTheOldMemoryOnce) {
  uint8_t old_storage[8] = {};
  uint8_t new_storage[32] = {};
  int old_releases = 0;
  int new_releases = 0;
  {
    StagingBuffer target = Counted(old_storage, sizeof old_storage, &old_releases);
    StagingBuffer source =
        Counted(new_storage, sizeof new_storage, &new_releases, /*on_device=*/true);
    target = std::move(source);
    EXPECT_EQ(old_releases, 1);
    EXPECT_EQ(new_releases, 0);
    EXPECT_EQ(target.data(), new_storage);
    EXPECT_EQ(target.size(), 32);
    EXPECT_TRUE(target.on_device());
  }
  EXPECT_EQ(old_releases, 1);
  EXPECT_EQ(new_releases, 1);
}

TEST(StagingBufferTest, SelfMoveAssignmentKeepsTheMemory) {
  uint8_t storage[16] = {};
  int releases = 0;
  {
    StagingBuffer buffer = Counted(storage, sizeof storage, &releases);
    StagingBuffer& alias = buffer;
    buffer = std::move(alias);
    EXPECT_EQ(releases, 0);
    EXPECT_EQ(buffer.data(), storage);
    EXPECT_EQ(buffer.size(), 16);
  }
  EXPECT_EQ(releases, 1);
}

TEST(StagingBufferTest, MovedHostBufferKeepsItsBytes) {
  absl::StatusOr<StagingBuffer> made = StagingBuffer::HostUninitialized(64, "w");
  ASSERT_TRUE(made.ok()) << made.status();
  std::memset(made->data(), 0x5a, 64);
  uint8_t* data = made->data();
  StagingBuffer moved = *std::move(made);
  EXPECT_EQ(moved.data(), data);
  EXPECT_EQ(moved.size(), 64);
  EXPECT_EQ(moved.data()[63], 0x5a);
}

// Pooled host staging: a released buffer is handed out again for a request
// of its size (same memory, no new allocation), not for a much smaller one;
// the pool holds no more than was in use at once, and an idle pool is
// emptied.
std::string Joined(const StagingBuffer& buffer) {
  std::string out;
  for (absl::Span<const uint8_t> piece : buffer.Pieces()) {
    out.append(reinterpret_cast<const char*>(piece.data()), piece.size());
  }
  return out;
}

TEST(StagingBufferAliasTest, AliasedRangesReadFromTheirSourceAndHoldItUntilTheBufferGoes) {
  absl::StatusOr<StagingBuffer> made = StagingBuffer::HostUninitialized(16, "param");
  ASSERT_TRUE(made.ok()) << made.status();
  StagingBuffer buffer = *std::move(made);
  std::memset(buffer.data(), 'o', 16);
  const std::string region = "ABCDEFGHIJKLMNOP";
  const auto* src = reinterpret_cast<const uint8_t*>(region.data());
  auto keep = std::make_shared<int>(0);
  EXPECT_FALSE(buffer.has_aliases());
  ASSERT_EQ(buffer.Pieces().size(), 1u);
  // Out of order; the second continues the first in buffer and source.
  buffer.AddAlias(10, src + 10, 2, keep);
  buffer.AddAlias(2, src + 2, 3, keep);
  buffer.AddAlias(5, src + 5, 1, keep);
  EXPECT_TRUE(buffer.has_aliases());
  EXPECT_EQ(buffer.aliased_bytes(), 6);
  EXPECT_EQ(Joined(buffer), "ooCDEFooooKLoooo");
  // [0,2) owned, [2,6) merged alias, [6,10) owned, [10,12) alias, [12,16).
  EXPECT_EQ(buffer.Pieces().size(), 5u);
  EXPECT_GT(keep.use_count(), 1);

  std::string out(7, '?');
  ASSERT_TRUE(buffer.CopyOut(4, out.data(), 7).ok());
  EXPECT_EQ(out, "EFooooK");

  // Moving carries the aliases and what keeps them.
  StagingBuffer moved = std::move(buffer);
  EXPECT_EQ(Joined(moved), "ooCDEFooooKLoooo");
  ASSERT_TRUE(moved.MaterializeAliases().ok());
  EXPECT_FALSE(moved.has_aliases());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(moved.data()), 16), "ooCDEFooooKLoooo");
  EXPECT_EQ(keep.use_count(), 1);
}

TEST(StagingBufferAliasTest, AdjacentAliasesOfDifferentOwnersStaySeparateAndBothAreHeld) {
  absl::StatusOr<StagingBuffer> buffer = StagingBuffer::HostUninitialized(8, "param");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  const std::string region = "abcdefgh";
  const auto* src = reinterpret_cast<const uint8_t*>(region.data());
  auto first = std::make_shared<int>(1);
  auto second = std::make_shared<int>(2);
  buffer->AddAlias(0, src, 4, first);
  buffer->AddAlias(4, src + 4, 4, second);  // contiguous, but another mapping
  EXPECT_EQ(buffer->Pieces().size(), 2u);
  EXPECT_EQ(Joined(*buffer), "abcdefgh");
  EXPECT_EQ(first.use_count(), 2);
  EXPECT_EQ(second.use_count(), 2);
  *buffer = StagingBuffer();
  EXPECT_EQ(first.use_count(), 1);
  EXPECT_EQ(second.use_count(), 1);
}

TEST(StagingBufferAliasTest, MaterializeInStepsOwnsEachStepBeforeVisitingItAndCoversEveryByte) {
  const std::string region = "ABCDEFGHIJKLMNOPQRSTUVWXYZ";
  const auto* src = reinterpret_cast<const uint8_t*>(region.data());
  for (int64_t step : {1, 3, 4, 7, 26, 100}) {
    SCOPED_TRACE(step);
    absl::StatusOr<StagingBuffer> made = StagingBuffer::HostUninitialized(26, "param");
    ASSERT_TRUE(made.ok()) << made.status();
    StagingBuffer buffer = *std::move(made);
    std::memset(buffer.data(), 'o', 26);
    auto keep = std::make_shared<int>(0);
    // Aliases across step boundaries, one inside a step, owned bytes between.
    buffer.AddAlias(20, src + 20, 6, keep);
    buffer.AddAlias(2, src + 2, 5, keep);
    buffer.AddAlias(9, src + 9, 1, keep);
    std::string seen;
    int64_t next = 0;
    ASSERT_TRUE(buffer
                    .MaterializeInSteps(step, /*threads=*/1,
                                        [&](int64_t at, int64_t n) {
                                          EXPECT_EQ(at, next);  // in order, no gap
                                          EXPECT_LE(n, step);
                                          next = at + n;
                                          seen.append(
                                              reinterpret_cast<const char*>(buffer.data()) + at, n);
                                          return absl::OkStatus();
                                        })
                    .ok());
    EXPECT_EQ(next, 26);
    EXPECT_EQ(seen, "ooCDEFGooJooooooooooUVWXYZ");
    EXPECT_FALSE(buffer.has_aliases());
    EXPECT_EQ(keep.use_count(), 1);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(buffer.data()), 26), seen);
  }
}

TEST(StagingBufferAliasTest, AVisitThatFailsEndsTheWalkAndKeepsTheAliases) {
  absl::StatusOr<StagingBuffer> buffer = StagingBuffer::HostUninitialized(12, "param");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::memset(buffer->data(), 'o', 12);
  const std::string region = "abcdefghijkl";
  auto keep = std::make_shared<int>(0);
  buffer->AddAlias(0, reinterpret_cast<const uint8_t*>(region.data()), 12, keep);
  int visits = 0;
  const absl::Status status =
      buffer->MaterializeInSteps(4, /*threads=*/1, [&](int64_t at, int64_t) {
        ++visits;
        return at == 4 ? absl::InvalidArgumentError("element 5 is nan") : absl::OkStatus();
      });
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_EQ(visits, 2);
  // Still read from the region: the half-copied owned bytes are not used.
  EXPECT_TRUE(buffer->has_aliases());
  EXPECT_EQ(Joined(*buffer), "abcdefghijkl");
  EXPECT_EQ(keep.use_count(), 2);
}

// A buffer of 1 MiB, every other 5000-byte range read in place from a
// "region" (so aliases start and end inside steps and span several),
// walked in 4 KiB steps by 1-4 threads: every step is visited exactly
// once, with its bytes owned by then, and the owned bytes end up equal to
// the region's where aliased and the buffer's own elsewhere.
TEST(StagingBufferAliasTest, MaterializeInStepsOnSeveralThreadsVisitsEveryStepOnceOwned) {
  constexpr int64_t kSize = int64_t{1} << 20;
  constexpr int64_t kStep = 4096;
  std::string region(kSize, '\0');
  for (int64_t i = 0; i < kSize; ++i) region[i] = static_cast<char>('A' + i % 26);
  for (int threads : {1, 2, 3, 4}) {
    SCOPED_TRACE(threads);
    absl::StatusOr<StagingBuffer> made = StagingBuffer::HostUninitialized(kSize, "param");
    ASSERT_TRUE(made.ok()) << made.status();
    StagingBuffer buffer = *std::move(made);
    std::memset(buffer.data(), 'o', kSize);
    std::string expected(kSize, 'o');
    auto keep = std::make_shared<int>(0);
    for (int64_t at = 0; at < kSize; at += 10000) {
      const int64_t n = std::min<int64_t>(5000, kSize - at);
      buffer.AddAlias(at, reinterpret_cast<const uint8_t*>(region.data()) + at, n, keep);
      expected.replace(at, n, region, at, n);
    }
    absl::Mutex mu;
    std::vector<int> visits(kSize / kStep, 0);
    const absl::Status status =
        buffer.MaterializeInSteps(kStep, threads, [&](int64_t at, int64_t n) {
          EXPECT_EQ(at % kStep, 0);
          EXPECT_EQ(n, kStep);
          // Owned by now: what the walk copied in is there.
          EXPECT_EQ(std::memcmp(buffer.data() + at, expected.data() + at, n), 0) << at;
          absl::MutexLock lock(&mu);
          ++visits[at / kStep];
          return absl::OkStatus();
        });
    ASSERT_TRUE(status.ok()) << status;
    EXPECT_THAT(visits, ::testing::Each(1));
    EXPECT_FALSE(buffer.has_aliases());
    EXPECT_EQ(keep.use_count(), 1);
    EXPECT_EQ(std::memcmp(buffer.data(), expected.data(), kSize), 0);
  }
}

// Several failing steps on several threads: the error is the first one in
// step order, every step before it was visited, and the aliases stay.
TEST(StagingBufferAliasTest, MaterializeInStepsOnSeveralThreadsReportsTheFirstFailingStep) {
  constexpr int64_t kSize = 64 * 1024;
  constexpr int64_t kStep = 1024;
  const std::string region(kSize, 'r');
  for (int threads : {2, 3, 4}) {
    SCOPED_TRACE(threads);
    absl::StatusOr<StagingBuffer> made = StagingBuffer::HostUninitialized(kSize, "param");
    ASSERT_TRUE(made.ok()) << made.status();
    StagingBuffer buffer = *std::move(made);
    auto keep = std::make_shared<int>(0);
    buffer.AddAlias(0, reinterpret_cast<const uint8_t*>(region.data()), kSize, keep);
    absl::Mutex mu;
    std::vector<int> visits(kSize / kStep, 0);
    const absl::Status status = buffer.MaterializeInSteps(kStep, threads, [&](int64_t at, int64_t) {
      const int64_t s = at / kStep;
      {
        absl::MutexLock lock(&mu);
        ++visits[s];
      }
      if (s == 40 || s == 21 || s == 22) {
        return absl::InvalidArgumentError(absl::StrCat("step ", s));
      }
      return absl::OkStatus();
    });
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
    EXPECT_EQ(status.message(), "step 21");
    for (int s = 0; s <= 21; ++s) EXPECT_EQ(visits[s], 1) << s;
    EXPECT_TRUE(buffer.has_aliases());
    EXPECT_EQ(keep.use_count(), 2);
  }
}

TEST(StagingBufferPoolTest, ReleasedBuffersAreReusedBoundedAndTrimmedWhenIdle) {
  constexpr int64_t kLayer = int64_t{3} << 20;
  StagingBuffer::TrimHostPool(absl::InfiniteFuture());
  const StagingBuffer::PoolStats before = StagingBuffer::HostPoolStats();
  EXPECT_EQ(before.pooled_bytes, 0);

  uint8_t* first = nullptr;
  {
    absl::StatusOr<StagingBuffer> a = StagingBuffer::HostPooled(kLayer, "layer 0");
    ASSERT_TRUE(a.ok()) << a.status();
    first = a->data();
    std::memset(a->data(), 1, kLayer);
  }
  EXPECT_EQ(StagingBuffer::HostPoolStats().pooled_bytes, kLayer);
  {
    // The same size, and a slightly smaller one, get the same memory back.
    absl::StatusOr<StagingBuffer> b = StagingBuffer::HostPooled(kLayer, "layer 1");
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->data(), first);
    EXPECT_EQ(b->size(), kLayer);
    EXPECT_EQ(StagingBuffer::HostPoolStats().pooled_bytes, 0);
  }
  {
    absl::StatusOr<StagingBuffer> c = StagingBuffer::HostPooled(kLayer - 4096, "layer 2");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->data(), first);
    EXPECT_EQ(c->size(), kLayer - 4096);
    // A request much smaller than any pooled buffer allocates.
    absl::StatusOr<StagingBuffer> small = StagingBuffer::HostPooled(kLayer / 2, "norm");
    ASSERT_TRUE(small.ok()) << small.status();
    EXPECT_NE(small->data(), first);
  }
  const StagingBuffer::PoolStats after = StagingBuffer::HostPoolStats();
  EXPECT_EQ(after.reused - before.reused, 2);
  EXPECT_EQ(after.allocated - before.allocated, 2);
  EXPECT_EQ(after.in_use_bytes, before.in_use_bytes);
  EXPECT_LE(after.pooled_bytes, after.high_water_bytes);
  EXPECT_EQ(after.pooled_bytes, kLayer + kLayer / 2);

  // Zeroed and unpooled buffers never come from the pool.
  absl::StatusOr<StagingBuffer> zeroed = StagingBuffer::HostZeroed(kLayer, "zero-filled");
  ASSERT_TRUE(zeroed.ok()) << zeroed.status();
  EXPECT_NE(zeroed->data(), first);
  EXPECT_TRUE(AllZero(*zeroed));
  absl::StatusOr<StagingBuffer> kernel = StagingBuffer::HostUninitialized(kLayer, "kernel");
  ASSERT_TRUE(kernel.ok()) << kernel.status();
  EXPECT_NE(kernel->data(), first);
  EXPECT_EQ(StagingBuffer::HostPoolStats().pooled_bytes, kLayer + kLayer / 2);

  // Used just now: not idle, nothing trimmed; idle long enough: all freed.
  EXPECT_EQ(StagingBuffer::TrimHostPool(absl::Now()), 0);
  EXPECT_EQ(
      StagingBuffer::TrimHostPool(absl::Now() + StagingBuffer::kDefaultPoolIdle + absl::Seconds(1)),
      kLayer + kLayer / 2);
  EXPECT_EQ(StagingBuffer::HostPoolStats().pooled_bytes, 0);
}

// A request the pool cannot serve frees kept buffers of other sizes before
// it allocates, so that kept + in use stays within the most that was in use
// at once: pooling never raises a refit's peak.
TEST(StagingBufferPoolTest, AMissFreesKeptBuffersSoThePoolNeverAddsToThePeak) {
  constexpr int64_t kLayer = int64_t{4} << 20;
  constexpr int64_t kSmall = int64_t{2} << 20;
  StagingBuffer::TrimHostPool(absl::InfiniteFuture());
  const int64_t base = StagingBuffer::HostPoolStats().in_use_bytes;
  {
    absl::StatusOr<StagingBuffer> a = StagingBuffer::HostPooled(kLayer, "layer 0");
    absl::StatusOr<StagingBuffer> b = StagingBuffer::HostPooled(kLayer, "layer 1");
    ASSERT_TRUE(a.ok() && b.ok());
  }
  StagingBuffer::PoolStats stats = StagingBuffer::HostPoolStats();
  ASSERT_EQ(stats.pooled_bytes, 2 * kLayer);
  ASSERT_EQ(stats.high_water_bytes, base + 2 * kLayer);

  // 2 MiB fits no kept 4 MiB buffer: one of them goes, total 6 <= 8 MiB.
  absl::StatusOr<StagingBuffer> c = StagingBuffer::HostPooled(kSmall, "norms");
  ASSERT_TRUE(c.ok()) << c.status();
  stats = StagingBuffer::HostPoolStats();
  EXPECT_EQ(stats.pooled_bytes, kLayer);
  EXPECT_LE(stats.pooled_bytes + stats.in_use_bytes, stats.high_water_bytes);
  // Another 2 MiB: total 8 MiB, still at the mark, nothing freed.
  absl::StatusOr<StagingBuffer> d = StagingBuffer::HostPooled(kSmall, "norms");
  ASSERT_TRUE(d.ok()) << d.status();
  stats = StagingBuffer::HostPoolStats();
  EXPECT_EQ(stats.pooled_bytes, kLayer);
  EXPECT_EQ(stats.pooled_bytes + stats.in_use_bytes, stats.high_water_bytes);
  // A third would make it 10 MiB, past the mark: the last kept buffer goes.
  absl::StatusOr<StagingBuffer> e = StagingBuffer::HostPooled(kSmall, "norms");
  ASSERT_TRUE(e.ok()) << e.status();
  stats = StagingBuffer::HostPoolStats();
  EXPECT_EQ(stats.pooled_bytes, 0);
  EXPECT_EQ(stats.in_use_bytes, base + 3 * kSmall);
  EXPECT_LE(stats.in_use_bytes, stats.high_water_bytes);
}

// Pooling off (an idle period of zero): nothing is kept, and what was kept
// is freed at once.
TEST(StagingBufferPoolTest, IdlePeriodZeroTurnsPoolingOff) {
  constexpr int64_t kLayer = int64_t{2} << 20;
  StagingBuffer::TrimHostPool(absl::InfiniteFuture());
  { ASSERT_TRUE(StagingBuffer::HostPooled(kLayer, "layer 0").ok()); }
  EXPECT_EQ(StagingBuffer::HostPoolStats().pooled_bytes, kLayer);
  StagingBuffer::SetHostPoolIdle(absl::ZeroDuration());
  EXPECT_EQ(StagingBuffer::HostPoolStats().pooled_bytes, 0);
  const int64_t reused = StagingBuffer::HostPoolStats().reused;
  {
    absl::StatusOr<StagingBuffer> a = StagingBuffer::HostPooled(kLayer, "layer 1");
    ASSERT_TRUE(a.ok()) << a.status();
  }
  EXPECT_EQ(StagingBuffer::HostPoolStats().pooled_bytes, 0);
  EXPECT_EQ(StagingBuffer::HostPoolStats().reused, reused);
  StagingBuffer::SetHostPoolIdle(StagingBuffer::kDefaultPoolIdle);
  { ASSERT_TRUE(StagingBuffer::HostPooled(kLayer, "layer 2").ok()); }
  EXPECT_EQ(StagingBuffer::HostPoolStats().pooled_bytes, kLayer);
}

}  // namespace
}  // namespace refit::core
