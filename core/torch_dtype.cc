#include "core/torch_dtype.h"

#include "absl/strings/str_cat.h"

namespace refit::core {
namespace {

struct Pair {
  DType dtype;
  c10::ScalarType type;
};

constexpr Pair kPairs[] = {
    {DType::kBool, c10::ScalarType::Bool},
    {DType::kUInt8, c10::ScalarType::Byte},
    {DType::kInt8, c10::ScalarType::Char},
    {DType::kInt16, c10::ScalarType::Short},
    {DType::kUInt16, c10::ScalarType::UInt16},
    {DType::kInt32, c10::ScalarType::Int},
    {DType::kUInt32, c10::ScalarType::UInt32},
    {DType::kInt64, c10::ScalarType::Long},
    {DType::kUInt64, c10::ScalarType::UInt64},
    {DType::kFloat8E4M3, c10::ScalarType::Float8_e4m3fn},
    {DType::kFloat8E5M2, c10::ScalarType::Float8_e5m2},
    {DType::kFloat16, c10::ScalarType::Half},
    {DType::kBFloat16, c10::ScalarType::BFloat16},
    {DType::kFloat32, c10::ScalarType::Float},
    {DType::kFloat64, c10::ScalarType::Double},
};

}  // namespace

absl::StatusOr<c10::ScalarType> ToScalarType(DType dtype) {
  for (const Pair& p : kPairs) {
    if (p.dtype == dtype) return p.type;
  }
  return absl::InvalidArgumentError(absl::StrCat("no LibTorch type for ", DTypeName(dtype)));
}

absl::StatusOr<DType> FromScalarType(c10::ScalarType type) {
  for (const Pair& p : kPairs) {
    if (p.type == type) return p.dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("no refitd dtype for LibTorch type ", c10::toString(type)));
}

}  // namespace refit::core
