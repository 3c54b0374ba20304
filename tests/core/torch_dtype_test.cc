// DType <-> LibTorch scalar types: every DType maps and back, and LibTorch
// types refitd has no DType for are refused by name.
#include "core/torch_dtype.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::core {
namespace {

using ::testing::HasSubstr;

TEST(TorchDTypeTest, EveryDTypeRoundTrips) {
  for (DType dtype :
       {DType::kBool, DType::kUInt8, DType::kInt8, DType::kInt16, DType::kUInt16, DType::kInt32,
        DType::kUInt32, DType::kInt64, DType::kUInt64, DType::kFloat8E4M3, DType::kFloat8E5M2,
        DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat64}) {
    absl::StatusOr<c10::ScalarType> type = ToScalarType(dtype);
    ASSERT_TRUE(type.ok()) << DTypeName(dtype) << ": " << type.status();
    EXPECT_EQ(c10::elementSize(*type), DTypeSize(dtype)) << DTypeName(dtype);
    absl::StatusOr<DType> back = FromScalarType(*type);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, dtype) << DTypeName(dtype);
  }
}

TEST(TorchDTypeTest, LibTorchTypesWithoutADTypeAreInvalidArgument) {
  for (c10::ScalarType type :
       {c10::ScalarType::ComplexFloat, c10::ScalarType::QInt8, c10::ScalarType::Float8_e4m3fnuz}) {
    absl::StatusOr<DType> dtype = FromScalarType(type);
    EXPECT_EQ(dtype.status().code(), absl::StatusCode::kInvalidArgument) << c10::toString(type);
    EXPECT_THAT(std::string(dtype.status().message()),
                HasSubstr(std::string("no refitd dtype for LibTorch type ") + c10::toString(type)));
  }
}

}  // namespace
}  // namespace refit::core
