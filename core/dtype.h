// Element types known to refitd, named as safetensors names them.
//
// Used everywhere in the refit pipeline: the safetensors reader validates
// headers against this list, the session converts incoming chunks between the
// floating types, and the quantizer writes kFloat8E4M3. Plain values, no
// LibTorch; thread-compatible.
#ifndef REFIT_CORE_DTYPE_H_
#define REFIT_CORE_DTYPE_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace refit::core {

enum class DType : uint8_t {
  kBool,
  kUInt8,
  kInt8,
  kInt16,
  kUInt16,
  kInt32,
  kUInt32,
  kInt64,
  kUInt64,
  kFloat8E4M3,  // e4m3fn: max 448, no infinities, NaN = 0x7F/0xFF
  kFloat8E5M2,
  kFloat16,
  kBFloat16,
  kFloat32,
  kFloat64,
};

// Bytes per element.
size_t DTypeSize(DType dtype);
// The safetensors spelling: "BF16", "F8_E4M3", ...
absl::string_view DTypeName(DType dtype);
// Parses the safetensors spelling (case-sensitive).
// Errors:
//   INVALID_ARGUMENT  any other name, quoted in the message ("unknown dtype")
absl::StatusOr<DType> ParseDType(absl::string_view name);
// bf16 / fp16 / fp32: the types a trainer may push.
bool IsHighPrecisionFloat(DType dtype);

// Converts `count` elements between two high-precision float types
// (fp32/fp16/bf16), rounding to nearest even. Same type is a memcpy.
// Errors:
//   INVALID_ARGUMENT  either type is not one of the three (both are named);
//                     nothing is written
absl::Status ConvertFloats(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                           size_t count);

// Reads element `i` of a high-precision float buffer as float32.
float LoadAsFloat(const void* src, DType dtype, size_t i);

// Index of the first NaN or Inf among `count` elements of a floating-point
// buffer (F64, F32, F16, BF16, F8_E5M2; F8_E4M3's NaN), or -1 if every element
// is finite or `dtype` is not a floating type. Scans blocks branch-free, so a
// finite tensor costs about one pass at memory speed.
int64_t FindNonFinite(const void* data, DType dtype, int64_t count);

}  // namespace refit::core

#endif  // REFIT_CORE_DTYPE_H_
