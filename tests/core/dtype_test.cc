#include "core/dtype.h"

#include <ATen/ATen.h>

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

}  // namespace
}  // namespace refit::core
