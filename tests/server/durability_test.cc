// --state-dir in process: a graceful shutdown writes the pending snapshot,
// and a daemon restarted on the same directory stays NOT_SERVING (nothing
// loaded) until LoadInitialModel has restored the committed version, which
// it then serves with its number and fingerprint. (Crashes: tests/e2e.)
#include <sys/stat.h>

#include <memory>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/snapshot.h"
#include "tests/server/server_test_util.h"

namespace refit::server {
namespace {

using ::grpc::health::v1::Health;
using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;
using ::refit::server::testing::Connect;
using ::refit::server::testing::FullPush;
using ::refit::server::testing::MakeTempDir;
using ::refit::server::testing::PushMessages;
using ::refit::server::testing::PushOutcome;
using ::refit::server::testing::TestOptions;

HealthCheckResponse::ServingStatus Readiness(Health::Stub* health) {
  grpc::ClientContext context;
  HealthCheckRequest request;
  request.set_service(kRefitServiceName);
  HealthCheckResponse response;
  EXPECT_TRUE(health->Check(&context, request, &response).ok());
  return response.status();
}

TEST(DurabilityTest, RestartServesTheCommittedVersionOnlyOnceRecovered) {
  const std::string dir = MakeTempDir();
  ServerOptions options = TestOptions(dir);
  options.state_dir = dir + "/state";
  std::string fingerprint;
  {
    absl::StatusOr<std::unique_ptr<RefitServer>> server = RefitServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    auto stub = v1::RefitService::NewStub(Connect(**server));
    PushOutcome push = PushMessages(stub.get(), FullPush(2));
    ASSERT_TRUE(push.status.ok()) << push.status.error_message();
    ASSERT_EQ(push.response.result().version(), 2u);
    fingerprint = testing::Status(stub.get()).fingerprint();
    // A graceful stop writes version 2's snapshot if it is still pending.
    (*server)->Shutdown();
  }
  struct stat st;
  EXPECT_EQ(::stat((options.state_dir + "/" + core::SnapshotFileName(2)).c_str(), &st), 0);

  options.listen = {absl::StrCat("unix:", dir, "/refitd-2.sock")};
  absl::StatusOr<std::unique_ptr<RefitServer>> restarted = RefitServer::Create(options);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  std::shared_ptr<grpc::Channel> channel = Connect(**restarted);
  auto health = Health::NewStub(channel);
  auto stub = v1::RefitService::NewStub(channel);
  EXPECT_EQ(Readiness(health.get()), HealthCheckResponse::NOT_SERVING);
  v1::GetStatusResponse before = testing::Status(stub.get());
  EXPECT_FALSE(before.ready());
  EXPECT_EQ(before.version(), 0u);

  ASSERT_TRUE((*restarted)->LoadInitialModel().ok());
  EXPECT_EQ(Readiness(health.get()), HealthCheckResponse::SERVING);
  v1::GetStatusResponse after = testing::Status(stub.get());
  EXPECT_TRUE(after.ready());
  EXPECT_EQ(after.version(), 2u);
  EXPECT_EQ(after.fingerprint(), fingerprint);
  // The next commit is numbered after it.
  PushOutcome next = PushMessages(stub.get(), FullPush(3));
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_EQ(next.response.result().version(), 3u);
}

}  // namespace
}  // namespace refit::server
