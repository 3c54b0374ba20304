// core-internal: DType <-> LibTorch scalar types. Includes LibTorch headers, so
// only core .cc files, tests and benchmarks include it — never a public header.
#ifndef REFIT_CORE_TORCH_DTYPE_H_
#define REFIT_CORE_TORCH_DTYPE_H_

#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace refit::core {

// Every DType has a LibTorch type today; the error keeps a DType added
// later from mapping to the wrong one.
// Errors:
//   INVALID_ARGUMENT  a DType LibTorch has no equivalent of (named)
absl::StatusOr<c10::ScalarType> ToScalarType(DType dtype);
// Errors:
//   INVALID_ARGUMENT  a LibTorch type refitd has no DType for (e.g. complex,
//                     quantized or bits types; named)
absl::StatusOr<DType> FromScalarType(c10::ScalarType type);

}  // namespace refit::core

#endif  // REFIT_CORE_TORCH_DTYPE_H_
