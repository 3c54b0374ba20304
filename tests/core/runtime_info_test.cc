// The runtime checks refitd makes at start: device strings, and a real
// LibTorch computation on the CPU.
#include "core/runtime_info.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::core {
namespace {

using ::testing::HasSubstr;

TEST(RuntimeInfoTest, ValidateDeviceAcceptsCpu) {
  EXPECT_TRUE(ValidateDevice("cpu").ok());
  EXPECT_FALSE(TorchVersion().empty());
}

TEST(RuntimeInfoTest, ValidateDeviceRejectsMalformedStrings) {
  for (const char* device : {"gpu", "cuda", "cuda:", "cuda:-1", "cuda:x", "CPU", ""}) {
    absl::Status status = ValidateDevice(device);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << device;
    EXPECT_THAT(std::string(status.message()), HasSubstr(std::string("device \"") + device +
                                                         "\": expected \"cpu\" or \"cuda:N\""));
  }
}

TEST(RuntimeInfoTest, ValidateDeviceOfAGpuThisProcessCannotSeeIsUnavailable) {
  const std::string device = "cuda:" + std::to_string(CudaDeviceCount());
  absl::Status status = ValidateDevice(device);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr(device + ": this process sees " + std::to_string(CudaDeviceCount()) +
                        " CUDA device(s)"));
}

TEST(RuntimeInfoTest, SelfTestRunsOnTheCpu) {
  absl::Status status = TorchSelfTest("cpu");
  EXPECT_TRUE(status.ok()) << status;
}

TEST(RuntimeInfoTest, SelfTestValidatesTheDeviceFirst) {
  absl::Status malformed = TorchSelfTest("tpu:0");
  EXPECT_EQ(malformed.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(malformed.message()), HasSubstr("device \"tpu:0\""));
  const std::string missing = "cuda:" + std::to_string(CudaDeviceCount());
  absl::Status unavailable = TorchSelfTest(missing);
  EXPECT_EQ(unavailable.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(unavailable.message()), HasSubstr(missing));
}

}  // namespace
}  // namespace refit::core
