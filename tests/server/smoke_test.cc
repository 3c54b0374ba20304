// Fails loudly when the binaries cannot load or run LibTorch, or cannot serve
// gRPC: LibTorch through core/runtime_info and a real in-process gRPC round
// trip, in one process, as refitd itself links them.
#include <memory>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/runtime_info.h"
#include "tests/server/server_test_util.h"

namespace refit::server {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(SmokeTest, LibTorchRunsATensorOpOnTheCpu) {
  EXPECT_THAT(core::TorchVersion(), StartsWith("2."));
  absl::Status status = core::TorchSelfTest("cpu");
  EXPECT_TRUE(status.ok()) << status;
}

TEST(SmokeTest, LibTorchOnEveryVisibleGpu) {
  const int gpus = core::CudaDeviceCount();
  if (gpus == 0) GTEST_SKIP() << "no CUDA device";
  for (int i = 0; i < gpus; ++i) {
    absl::Status status = core::TorchSelfTest(absl::StrCat("cuda:", i));
    EXPECT_TRUE(status.ok()) << status;
  }
}

TEST(SmokeTest, DeviceValidation) {
  EXPECT_EQ(core::ValidateDevice("gpu0").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core::ValidateDevice("cuda:x").code(), absl::StatusCode::kInvalidArgument);
  absl::Status missing = core::ValidateDevice("cuda:999");
  EXPECT_EQ(missing.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(missing.message(), HasSubstr("cuda:999"));
}

TEST(SmokeTest, GrpcRoundTripAgainstInProcessRefitd) {
  const std::string dir = testing::MakeTempDir();
  absl::StatusOr<std::unique_ptr<RefitServer>> server =
      RefitServer::Start(testing::TestOptions(dir));
  ASSERT_TRUE(server.ok()) << server.status();
  std::shared_ptr<grpc::Channel> channel = testing::Connect(**server);
  auto stub = v1::RefitService::NewStub(channel);
  const v1::GetStatusResponse status = testing::Status(stub.get());
  EXPECT_EQ(status.version(), 1u);
  EXPECT_TRUE(status.ready());
  EXPECT_THAT(status.server_version(), HasSubstr(core::TorchVersion()));

  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  grpc::health::v1::HealthCheckRequest request;
  request.set_service("refit.v1.RefitService");
  grpc::health::v1::HealthCheckResponse response;
  ASSERT_TRUE(health->Check(&context, request, &response).ok());
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

}  // namespace
}  // namespace refit::server
