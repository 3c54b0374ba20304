#include "core/byte_range_set.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::core {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

std::string Message(const absl::Status& status) { return std::string(status.message()); }

TEST(ByteRangeSetTest, EmptyTensorIsCompleteFromTheStart) {
  ByteRangeSet set;
  EXPECT_EQ(set.size(), 0u);
  EXPECT_EQ(set.received(), 0u);
  EXPECT_TRUE(set.complete());
  EXPECT_EQ(set.num_ranges(), 0);
  EXPECT_TRUE(set.Add(0, 0, "w").ok());
  EXPECT_TRUE(set.complete());
  EXPECT_EQ(set.num_ranges(), 0);
}

TEST(ByteRangeSetTest, CountsReceivedBytesUntilComplete) {
  ByteRangeSet set(100);
  EXPECT_FALSE(set.complete());
  ASSERT_TRUE(set.Add(0, 40, "w").ok());
  EXPECT_EQ(set.received(), 40u);
  EXPECT_FALSE(set.complete());
  ASSERT_TRUE(set.Add(60, 40, "w").ok());
  EXPECT_EQ(set.received(), 80u);
  EXPECT_FALSE(set.complete());
  ASSERT_TRUE(set.Add(40, 20, "w").ok());
  EXPECT_EQ(set.received(), 100u);
  EXPECT_TRUE(set.complete());
  EXPECT_EQ(set.num_ranges(), 3);
}

TEST(ByteRangeSetTest, AcceptsAdjacentRangesAndKeepsThemApart) {
  ByteRangeSet set(30);
  ASSERT_TRUE(set.Add(10, 10, "w").ok());
  // Touching on the right, then on the left: [a, b) and [b, c) share no byte.
  ASSERT_TRUE(set.Add(20, 10, "w").ok());
  ASSERT_TRUE(set.Add(0, 10, "w").ok());
  EXPECT_EQ(set.num_ranges(), 3);
  EXPECT_EQ(set.received(), 30u);
  EXPECT_TRUE(set.complete());
}

TEST(ByteRangeSetTest, WholeTensorInOneRangeIsComplete) {
  ByteRangeSet set(4096);
  ASSERT_TRUE(set.Add(0, 4096, "w").ok());
  EXPECT_TRUE(set.complete());
  EXPECT_EQ(set.num_ranges(), 1);
}

TEST(ByteRangeSetTest, RefusesExactDuplicateAsAlreadyExists) {
  ByteRangeSet set(100);
  ASSERT_TRUE(set.Add(10, 20, "model.layers.0.mlp.up_proj.weight").ok());
  absl::Status status = set.Add(10, 20, "model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(status.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(Message(status), AllOf(HasSubstr("model.layers.0.mlp.up_proj.weight"),
                                     HasSubstr("duplicate"), HasSubstr("[10, 30)")));
  EXPECT_EQ(set.received(), 20u);
  EXPECT_EQ(set.num_ranges(), 1);
}

TEST(ByteRangeSetTest, RefusesRangeStartingInsideAnEarlierOne) {
  ByteRangeSet set(100);
  ASSERT_TRUE(set.Add(10, 20, "w").ok());      // [10, 30)
  absl::Status status = set.Add(25, 10, "w");  // [25, 35)
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), AllOf(HasSubstr("\"w\""), HasSubstr("[25, 35)"),
                                     HasSubstr("overlap"), HasSubstr("[10, 30)")));
  EXPECT_EQ(set.received(), 20u);
  EXPECT_EQ(set.num_ranges(), 1);
}

TEST(ByteRangeSetTest, RefusesRangeEndingInsideALaterOne) {
  ByteRangeSet set(100);
  ASSERT_TRUE(set.Add(40, 20, "w").ok());      // [40, 60)
  absl::Status status = set.Add(30, 11, "w");  // [30, 41)
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status),
              AllOf(HasSubstr("[30, 41)"), HasSubstr("overlap"), HasSubstr("[40, 60)")));
  EXPECT_EQ(set.received(), 20u);
  EXPECT_EQ(set.num_ranges(), 1);
}

TEST(ByteRangeSetTest, RefusesRangeContainingAnEarlierOne) {
  ByteRangeSet set(100);
  ASSERT_TRUE(set.Add(40, 10, "w").ok());      // [40, 50)
  absl::Status status = set.Add(30, 30, "w");  // [30, 60)
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), AllOf(HasSubstr("[30, 60)"), HasSubstr("[40, 50)")));
  EXPECT_EQ(set.received(), 10u);
}

TEST(ByteRangeSetTest, RefusesRangeInsideAnEarlierOne) {
  ByteRangeSet set(100);
  ASSERT_TRUE(set.Add(40, 20, "w").ok());    // [40, 60)
  absl::Status inner = set.Add(45, 5, "w");  // [45, 50)
  EXPECT_EQ(inner.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(inner), AllOf(HasSubstr("[45, 50)"), HasSubstr("[40, 60)")));
  // Same start, different end: not a duplicate, an overlap.
  absl::Status shorter = set.Add(40, 5, "w");
  EXPECT_EQ(shorter.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(shorter), AllOf(HasSubstr("[40, 45)"), HasSubstr("[40, 60)")));
  absl::Status longer = set.Add(40, 30, "w");
  EXPECT_EQ(longer.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(longer), AllOf(HasSubstr("[40, 70)"), HasSubstr("[40, 60)")));
  // Same end, different start.
  absl::Status same_end = set.Add(50, 10, "w");
  EXPECT_EQ(same_end.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(same_end), AllOf(HasSubstr("[50, 60)"), HasSubstr("[40, 60)")));
  EXPECT_EQ(set.received(), 20u);
  EXPECT_EQ(set.num_ranges(), 1);
}

TEST(ByteRangeSetTest, RefusesRangeBridgingTwoEarlierOnes) {
  ByteRangeSet set(100);
  ASSERT_TRUE(set.Add(0, 10, "w").ok());      // [0, 10)
  ASSERT_TRUE(set.Add(20, 10, "w").ok());     // [20, 30)
  absl::Status status = set.Add(5, 20, "w");  // [5, 25)
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), AllOf(HasSubstr("[5, 25)"), HasSubstr("overlap")));
  // The gap between them is still free.
  ASSERT_TRUE(set.Add(10, 10, "w").ok());
  EXPECT_EQ(set.received(), 30u);
  EXPECT_EQ(set.num_ranges(), 3);
}

TEST(ByteRangeSetTest, RefusesRangePastTheEndAsOutOfRange) {
  ByteRangeSet set(100);
  absl::Status status = set.Add(90, 11, "model.embed_tokens.weight");
  EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(Message(status), AllOf(HasSubstr("model.embed_tokens.weight"), HasSubstr("11 bytes"),
                                     HasSubstr("byte 90"), HasSubstr("100 bytes")));
  absl::Status start_past_end = set.Add(101, 0, "w");
  EXPECT_EQ(start_past_end.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(Message(start_past_end), HasSubstr("byte 101"));
  EXPECT_EQ(set.received(), 0u);
  EXPECT_EQ(set.num_ranges(), 0);
  // The last byte itself is in range.
  EXPECT_TRUE(set.Add(99, 1, "w").ok());
  EXPECT_EQ(set.received(), 1u);
}

TEST(ByteRangeSetTest, RefusesOverflowingOffsetsAndLengthsAndRecordsNothing) {
  ByteRangeSet set(100);
  const std::vector<std::pair<uint64_t, uint64_t>> ranges = {
      {kMax, 1},        // offset far past the end
      {kMax, 0},        // empty, but starts far past the end
      {kMax, kMax},     // both huge
      {0, kMax},        // length far past the end
      {1, kMax},        // offset + length wraps to 0
      {50, kMax - 49},  // offset + length wraps to exactly 0
      {50, kMax - 10},  // offset + length wraps to 39, inside the tensor
      {101, kMax - 100},
  };
  for (const auto& [offset, length] : ranges) {
    absl::Status status = set.Add(offset, length, "w");
    EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange) << offset << " + " << length;
    EXPECT_THAT(Message(status), HasSubstr("runs past its end")) << offset << " + " << length;
  }
  EXPECT_EQ(set.received(), 0u);
  EXPECT_EQ(set.num_ranges(), 0);
  // None of them left anything behind: the whole tensor is still free.
  ASSERT_TRUE(set.Add(0, 100, "w").ok());
  EXPECT_TRUE(set.complete());
}

TEST(ByteRangeSetTest, HandlesRangesEndingAtTheLargestSize) {
  ByteRangeSet set(kMax);
  ASSERT_TRUE(set.Add(kMax - 10, 10, "w").ok());
  absl::Status past = set.Add(kMax - 10, 11, "w");
  EXPECT_EQ(past.code(), absl::StatusCode::kOutOfRange);
  absl::Status duplicate = set.Add(kMax - 10, 10, "w");
  EXPECT_EQ(duplicate.code(), absl::StatusCode::kAlreadyExists);
  absl::Status overlap = set.Add(0, kMax, "w");
  EXPECT_EQ(overlap.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(overlap), HasSubstr("overlap"));
  EXPECT_FALSE(set.complete());
  ASSERT_TRUE(set.Add(0, kMax - 10, "w").ok());
  EXPECT_EQ(set.received(), kMax);
  EXPECT_TRUE(set.complete());
}

TEST(ByteRangeSetTest, AcceptsEmptyRangesInBoundsAndRecordsNothing) {
  ByteRangeSet set(100);
  ASSERT_TRUE(set.Add(10, 20, "w").ok());  // [10, 30)
  EXPECT_TRUE(set.Add(0, 0, "w").ok());
  EXPECT_TRUE(set.Add(10, 0, "w").ok());   // at the start of a received range
  EXPECT_TRUE(set.Add(20, 0, "w").ok());   // inside one
  EXPECT_TRUE(set.Add(100, 0, "w").ok());  // at the end of the tensor
  EXPECT_EQ(set.received(), 20u);
  EXPECT_EQ(set.num_ranges(), 1);
  // An empty range never blocks a real one at the same offset.
  EXPECT_TRUE(set.Add(0, 10, "w").ok());
  EXPECT_EQ(set.num_ranges(), 2);
}

// Checks every Add against a byte bitmap and the list of ranges received.
TEST(ByteRangeSetTest, AgreesWithABruteForceBitmapOnRandomRanges) {
  constexpr uint64_t kSize = 512;
  std::mt19937_64 rng(0x5eed'b17e);
  std::map<absl::StatusCode, int> seen;
  for (int round = 0; round < 20; ++round) {
    ByteRangeSet set(kSize);
    std::vector<bool> have(kSize, false);
    std::set<std::pair<uint64_t, uint64_t>> added;  // (offset, length)
    uint64_t have_count = 0;
    for (int step = 0; step < 400; ++step) {
      uint64_t offset;
      uint64_t length;
      const uint64_t pick = rng() % 10;
      if (pick == 0 && !added.empty()) {
        // Replays a range received before.
        auto it = added.begin();
        std::advance(it, static_cast<int64_t>(rng() % added.size()));
        offset = it->first;
        length = it->second;
      } else if (pick == 1) {
        // Runs past the end, possibly wrapping around.
        offset = rng() % (kSize + 8);
        length = kSize - std::min(offset, kSize) + 1 + rng() % 4;
        if (rng() % 2 == 0) length = kMax - rng() % 4;
      } else {
        offset = rng() % (kSize + 1);
        length = rng() % 17;
        if (offset + length > kSize) length = kSize - offset;
      }

      absl::StatusCode want = absl::StatusCode::kOk;
      if (offset > kSize || length > kSize - offset) {
        want = absl::StatusCode::kOutOfRange;
      } else if (length == 0) {
        want = absl::StatusCode::kOk;
      } else if (added.count({offset, length}) > 0) {
        want = absl::StatusCode::kAlreadyExists;
      } else {
        for (uint64_t b = offset; b < offset + length; ++b) {
          if (have[b]) {
            want = absl::StatusCode::kInvalidArgument;
            break;
          }
        }
      }

      absl::Status got = set.Add(offset, length, "w");
      ASSERT_EQ(got.code(), want) << "round " << round << " step " << step << ": [" << offset
                                  << ", +" << length << "): " << got;
      ++seen[want];
      if (got.ok() && length > 0) {
        for (uint64_t b = offset; b < offset + length; ++b) have[b] = true;
        have_count += length;
        added.insert({offset, length});
      }
      ASSERT_EQ(set.received(), have_count);
      ASSERT_EQ(set.complete(), have_count == kSize);
      ASSERT_EQ(set.num_ranges(), static_cast<int64_t>(added.size()));
    }

    // Filling every gap the bitmap shows completes the tensor.
    for (uint64_t b = 0; b < kSize;) {
      if (have[b]) {
        ++b;
        continue;
      }
      uint64_t e = b;
      while (e < kSize && !have[e]) ++e;
      ASSERT_TRUE(set.Add(b, e - b, "w").ok()) << "gap [" << b << ", " << e << ")";
      b = e;
    }
    EXPECT_TRUE(set.complete()) << "round " << round;
    EXPECT_EQ(set.received(), kSize);
  }
  // The seed reaches every outcome, so each branch of Add was compared.
  for (absl::StatusCode code :
       {absl::StatusCode::kOk, absl::StatusCode::kOutOfRange, absl::StatusCode::kAlreadyExists,
        absl::StatusCode::kInvalidArgument}) {
    EXPECT_GT(seen[code], 10) << absl::StatusCodeToString(code);
  }
}

}  // namespace
}  // namespace refit::core
