#include "core/dtype.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace refit::core {
namespace {

TEST(DTypeTest, ParsesSafetensorsNames) {
  EXPECT_EQ(*ParseDType("BF16"), DType::kBFloat16);
  EXPECT_EQ(*ParseDType("F8_E4M3"), DType::kFloat8E4M3);
  EXPECT_EQ(DTypeSize(DType::kFloat64), 8u);
  absl::StatusOr<DType> bad = ParseDType("F12");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("F12"), std::string_view::npos);
}

TEST(DTypeTest, ConvertsLikeLibTorch) {
  at::Tensor x = at::randn({1023}, at::kFloat) * 100;
  at::Tensor ours = at::empty({1023}, at::kBFloat16);
  ASSERT_TRUE(
      ConvertFloats(x.data_ptr(), DType::kFloat32, ours.data_ptr(), DType::kBFloat16, 1023).ok());
  EXPECT_TRUE(at::equal(ours, x.to(at::kBFloat16)));
  at::Tensor half = at::empty({1023}, at::kHalf);
  ASSERT_TRUE(
      ConvertFloats(ours.data_ptr(), DType::kBFloat16, half.data_ptr(), DType::kFloat16, 1023)
          .ok());
  EXPECT_TRUE(at::equal(half, ours.to(at::kHalf)));
}

TEST(DTypeTest, ParsingIsCaseSensitive) {
  absl::StatusOr<DType> lower = ParseDType("bf16");
  EXPECT_EQ(lower.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(lower.status().message().find("unknown dtype \"bf16\""), std::string_view::npos);
}

TEST(DTypeTest, ConvertRejectsTypesOtherThanTheThreeFloats) {
  int32_t src[2] = {1, 2};
  uint16_t dst[2] = {0xAAAA, 0xAAAA};
  absl::Status status = ConvertFloats(src, DType::kInt32, dst, DType::kBFloat16, 2);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("cannot convert I32 to BF16"), std::string_view::npos);
  EXPECT_EQ(dst[0], 0xAAAA);  // nothing written
  float f[2] = {1, 2};
  uint8_t fp8[2] = {};
  status = ConvertFloats(f, DType::kFloat32, fp8, DType::kFloat8E4M3, 2);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("cannot convert F32 to F8_E4M3"), std::string_view::npos);
}

// The scan goes block by block: a NaN/Inf at every position around block
// edges and in the tail is found, and the first of several is the one
// reported, in every width.
TEST(FindNonFiniteTest, FirstMatchAtBlockEdgesAndInTheTail) {
  const int64_t count = 3 * 2048 + 37;
  const std::vector<int64_t> positions = {0,    1,    2046, 2047, 2048,
                                          2049, 4095, 6143, 6144, count - 1};
  std::vector<uint16_t> bf16(count, 0x3F80);  // 1.0
  std::vector<uint32_t> f32(count, 0x3F800000u);
  std::vector<uint8_t> e4m3(count, 0x38);  // 1.0
  for (int64_t at : positions) {
    bf16[at] = 0xFF81;      // a negative NaN
    f32[at] = 0x7F800000u;  // +Inf
    e4m3[at] = 0xFF;        // NaN
    EXPECT_EQ(FindNonFinite(bf16.data(), DType::kBFloat16, count), at);
    EXPECT_EQ(FindNonFinite(f32.data(), DType::kFloat32, count), at);
    EXPECT_EQ(FindNonFinite(e4m3.data(), DType::kFloat8E4M3, count), at);
    // A later one does not hide it.
    bf16[count - 1] = 0x7F80;
    EXPECT_EQ(FindNonFinite(bf16.data(), DType::kBFloat16, count), at);
    bf16[count - 1] = 0x3F80;
    bf16[at] = 0x3F80;
    f32[at] = 0x3F800000u;
    e4m3[at] = 0x38;
  }
  EXPECT_EQ(FindNonFinite(bf16.data(), DType::kBFloat16, count), -1);
  EXPECT_EQ(FindNonFinite(f32.data(), DType::kFloat32, count), -1);
  // Largest finite values are not matches: every exponent bit but one set.
  std::vector<uint16_t> big(count, 0x7F7F);
  EXPECT_EQ(FindNonFinite(big.data(), DType::kBFloat16, count), -1);
  // Only `count` elements are read.
  bf16[2048] = 0x7F80;
  EXPECT_EQ(FindNonFinite(bf16.data(), DType::kBFloat16, 2048), -1);
  EXPECT_EQ(FindNonFinite(bf16.data(), DType::kBFloat16, 2049), 2048);
}

}  // namespace
}  // namespace refit::core
