#include "core/dtype.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "c10/util/BFloat16.h"
#include "c10/util/Half.h"

namespace refit::core {
namespace {

struct DTypeInfo {
  DType dtype;
  absl::string_view name;
  size_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {DType::kBool, "BOOL", 1},
    {DType::kUInt8, "U8", 1},
    {DType::kInt8, "I8", 1},
    {DType::kInt16, "I16", 2},
    {DType::kUInt16, "U16", 2},
    {DType::kInt32, "I32", 4},
    {DType::kUInt32, "U32", 4},
    {DType::kInt64, "I64", 8},
    {DType::kUInt64, "U64", 8},
    {DType::kFloat8E4M3, "F8_E4M3", 1},
    {DType::kFloat8E5M2, "F8_E5M2", 1},
    {DType::kFloat16, "F16", 2},
    {DType::kBFloat16, "BF16", 2},
    {DType::kFloat32, "F32", 4},
    {DType::kFloat64, "F64", 8},
};

const DTypeInfo& Info(DType dtype) { return kDTypes[static_cast<int>(dtype)]; }

template <typename Src, typename Dst>
void ConvertLoop(const void* src, void* dst, size_t count) {
  const Src* s = static_cast<const Src*>(src);
  Dst* d = static_cast<Dst*>(dst);
  for (size_t i = 0; i < count; ++i) d[i] = static_cast<Dst>(static_cast<float>(s[i]));
}

template <typename Src>
void ConvertFrom(const void* src, void* dst, DType dst_dtype, size_t count) {
  switch (dst_dtype) {
    case DType::kFloat32:
      ConvertLoop<Src, float>(src, dst, count);
      break;
    case DType::kFloat16:
      ConvertLoop<Src, c10::Half>(src, dst, count);
      break;
    default:
      ConvertLoop<Src, c10::BFloat16>(src, dst, count);
      break;
  }
}

// Elements whose exponent bits (`mask`) are all set are Inf or NaN, in every
// IEEE-like format; e4m3fn has no Inf and its NaN sets all seven low bits.
// Every float tensor a refit keeps passes through here, so the scan is
// written for the vectorizer: fixed-size blocks, each reduced with a
// branch-free OR of compare masks (8 bf16 per SSE2 instruction; ~10x the
// scalar loop), and only a block that holds a match is searched again for
// the first index.
template <typename Bits>
int64_t FindAllOnes(const void* data, int64_t count, Bits mask) {
  const Bits* bits = static_cast<const Bits*>(data);
  constexpr int64_t kBlock = 2048;
  auto first_in = [&](int64_t begin, int64_t end) -> int64_t {
    for (int64_t i = begin; i < end; ++i) {
      if ((bits[i] & mask) == mask) return i;
    }
    return -1;
  };
  int64_t begin = 0;
  for (; begin + kBlock <= count; begin += kBlock) {
    const Bits* block = bits + begin;
    Bits any = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      any |= static_cast<Bits>((block[i] & mask) == mask ? static_cast<Bits>(~Bits{0}) : Bits{0});
    }
    if (any != 0) return first_in(begin, begin + kBlock);
  }
  return first_in(begin, count);
}

}  // namespace

size_t DTypeSize(DType dtype) { return Info(dtype).size; }

absl::string_view DTypeName(DType dtype) { return Info(dtype).name; }

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype \"", name, "\""));
}

bool IsHighPrecisionFloat(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

absl::Status ConvertFloats(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                           size_t count) {
  if (!IsHighPrecisionFloat(src_dtype) || !IsHighPrecisionFloat(dst_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("cannot convert ", DTypeName(src_dtype), " to ",
                                                   DTypeName(dst_dtype),
                                                   ": only F32, F16 and BF16 convert"));
  }
  if (src_dtype == dst_dtype) {
    std::memcpy(dst, src, count * DTypeSize(src_dtype));
    return absl::OkStatus();
  }
  switch (src_dtype) {
    case DType::kFloat32:
      ConvertFrom<float>(src, dst, dst_dtype, count);
      break;
    case DType::kFloat16:
      ConvertFrom<c10::Half>(src, dst, dst_dtype, count);
      break;
    default:
      ConvertFrom<c10::BFloat16>(src, dst, dst_dtype, count);
      break;
  }
  return absl::OkStatus();
}

int64_t FindNonFinite(const void* data, DType dtype, int64_t count) {
  switch (dtype) {
    case DType::kFloat64:
      return FindAllOnes<uint64_t>(data, count, uint64_t{0x7FF0000000000000});
    case DType::kFloat32:
      return FindAllOnes<uint32_t>(data, count, 0x7F800000u);
    case DType::kFloat16:
      return FindAllOnes<uint16_t>(data, count, 0x7C00);
    case DType::kBFloat16:
      return FindAllOnes<uint16_t>(data, count, 0x7F80);
    case DType::kFloat8E5M2:
      return FindAllOnes<uint8_t>(data, count, 0x7C);
    case DType::kFloat8E4M3:
      return FindAllOnes<uint8_t>(data, count, 0x7F);
    default:
      return -1;
  }
}

float LoadAsFloat(const void* src, DType dtype, size_t i) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(src)[i];
    case DType::kFloat16:
      return static_cast<float>(static_cast<const c10::Half*>(src)[i]);
    case DType::kBFloat16:
      return static_cast<float>(static_cast<const c10::BFloat16*>(src)[i]);
    default:
      return 0.0f;
  }
}

}  // namespace refit::core
