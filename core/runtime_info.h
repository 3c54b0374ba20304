// What the process's LibTorch runtime is and whether it works, without
// exposing any LibTorch type: the server includes this header, and the torch
// wheel's headers must never reach server/ (they ship an old protobuf).
//
// Used by refitd at start (--device validation, the version in logs and
// GetStatus) and by tests/server/smoke_test.cc, which must fail loudly when
// LibTorch cannot be loaded or run. Thread-safe: every function may be called
// from any thread.
#ifndef REFIT_CORE_RUNTIME_INFO_H_
#define REFIT_CORE_RUNTIME_INFO_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace refit::core {

// LibTorch's version string, e.g. "2.11.0".
std::string TorchVersion();

// Number of CUDA devices LibTorch can use; 0 without a GPU or a CUDA build.
int CudaDeviceCount();

// Runs a small real tensor computation on `device` ("cpu" or "cuda:N") and
// checks the result (a matmul and an FP8 e4m3 round trip).
// Errors:
//   INVALID_ARGUMENT  ValidateDevice's: a malformed device string
//   UNAVAILABLE       ValidateDevice's: a GPU this process cannot see
//   INTERNAL          a wrong result (element, got and expected named) or
//                     a LibTorch exception (its text)
absl::Status TorchSelfTest(absl::string_view device = "cpu");

// Checks that `device` is "cpu" or "cuda:N" with N < CudaDeviceCount().
// Errors:
//   INVALID_ARGUMENT  anything else ("gpu", "cuda", "cuda:-1", "cuda:x")
//   UNAVAILABLE       "cuda:N" with N >= CudaDeviceCount() (the count is named)
absl::Status ValidateDevice(absl::string_view device);

}  // namespace refit::core

#endif  // REFIT_CORE_RUNTIME_INFO_H_
