#include "core/runtime_info.h"

#include <exception>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/version.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace refit::core {

std::string TorchVersion() { return TORCH_VERSION; }

int CudaDeviceCount() {
  try {
    return at::hasCUDA() ? static_cast<int>(at::getNumGPUs()) : 0;
  } catch (const std::exception&) {
    return 0;
  }
}

absl::Status ValidateDevice(absl::string_view device) {
  if (device == "cpu") return absl::OkStatus();
  int index = -1;
  if (!absl::StartsWith(device, "cuda:") || !absl::SimpleAtoi(device.substr(5), &index) ||
      index < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device \"", device, "\": expected \"cpu\" or \"cuda:N\""));
  }
  const int count = CudaDeviceCount();
  if (index >= count) {
    return absl::UnavailableError(
        absl::StrCat("device ", device, ": this process sees ", count, " CUDA device(s)"));
  }
  return absl::OkStatus();
}

absl::Status TorchSelfTest(absl::string_view device) {
  if (absl::Status s = ValidateDevice(device); !s.ok()) return s;
  try {
    const c10::Device dev{std::string(device)};
    // [[1, 2], [3, 4]] @ [[5, 6], [7, 8]] = [[19, 22], [43, 50]], then an FP8
    // round trip (the dtype every refit writes): 50 lies halfway between the
    // e4m3 neighbours 48 and 52 and rounds to even, 48.
    at::Tensor a = at::arange(1, 5, at::kFloat).reshape({2, 2}).to(dev);
    at::Tensor b = at::arange(5, 9, at::kFloat).reshape({2, 2}).to(dev);
    at::Tensor c = at::matmul(a, b).to(at::kCPU).contiguous();
    const float expected[] = {19.0f, 22.0f, 43.0f, 50.0f};
    const float* got = c.data_ptr<float>();
    for (int i = 0; i < 4; ++i) {
      if (got[i] != expected[i]) {
        return absl::InternalError(absl::StrCat("LibTorch self-test on ", device, ": element ", i,
                                                " is ", got[i], ", expected ", expected[i]));
      }
    }
    at::Tensor fp8 = c.to(dev).to(at::kFloat8_e4m3fn).to(at::kFloat).to(at::kCPU).contiguous();
    const float rounded = fp8.data_ptr<float>()[3];
    if (rounded != 48.0f) {
      return absl::InternalError(absl::StrCat("LibTorch self-test on ", device,
                                              ": FP8 e4m3 round trip of 50 gave ", rounded,
                                              ", expected 48"));
    }
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("LibTorch self-test on ", device, " threw: ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace refit::core
