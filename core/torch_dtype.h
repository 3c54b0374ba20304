// core-internal: DType <-> LibTorch scalar types. Includes LibTorch headers, so
// only core .cc files, tests and benchmarks include it — never a public header.
#ifndef REFIT_CORE_TORCH_DTYPE_H_
#define REFIT_CORE_TORCH_DTYPE_H_

#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace refit::core {

// INVALID_ARGUMENT for types LibTorch has no equivalent of.
absl::StatusOr<c10::ScalarType> ToScalarType(DType dtype);
absl::StatusOr<DType> FromScalarType(c10::ScalarType type);

}  // namespace refit::core

#endif  // REFIT_CORE_TORCH_DTYPE_H_
