// Server reflection over a real in-process refitd: it describes the API to
// readers (and every other role), refuses callers without a token when
// authentication is on, and leaves health open.
#include <fstream>
#include <memory>
#include <string>

#include <gmock/gmock.h>
#include <google/protobuf/descriptor.pb.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "tests/server/server_test_util.h"

namespace refit::server {
namespace {

using ::grpc::reflection::v1alpha::ServerReflection;
using ::grpc::reflection::v1alpha::ServerReflectionRequest;
using ::grpc::reflection::v1alpha::ServerReflectionResponse;
using ::refit::server::testing::MakeTempDir;
using ::refit::server::testing::TestOptions;
using ::testing::Contains;
using ::testing::HasSubstr;

class ReflectionServiceTest : public ::testing::Test {
 protected:
  void StartServer(bool with_tokens) {
    ServerOptions options = TestOptions(dir_);
    if (with_tokens) {
      std::ofstream(dir_ + "/tokens") << "reader-token reader\ntrainer-token trainer t\n";
      options.auth_tokens_file = dir_ + "/tokens";
    }
    absl::StatusOr<std::unique_ptr<RefitServer>> server = RefitServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    channel_ = testing::Connect(*server_);
  }

  // One request on a fresh stream: its answer and the stream's status.
  grpc::Status Ask(const ServerReflectionRequest& request, const std::string& token,
                   ServerReflectionResponse* response) {
    auto stub = ServerReflection::NewStub(channel_);
    grpc::ClientContext context;
    if (!token.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    auto stream = stub->ServerReflectionInfo(&context);
    stream->Write(request);
    stream->WritesDone();
    bool answered = stream->Read(response);
    ServerReflectionResponse extra;
    while (stream->Read(&extra)) {
    }
    grpc::Status status = stream->Finish();
    if (status.ok() && !answered) {
      return grpc::Status(grpc::StatusCode::INTERNAL, "no answer");
    }
    return status;
  }

  std::string dir_ = MakeTempDir();
  std::unique_ptr<RefitServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

ServerReflectionRequest ListServices() {
  ServerReflectionRequest request;
  request.set_list_services("");
  return request;
}

TEST_F(ReflectionServiceTest, ListsTheServicesAndDescribesTheApi) {
  StartServer(/*with_tokens=*/false);
  ServerReflectionResponse response;
  ASSERT_TRUE(Ask(ListServices(), "", &response).ok());
  std::vector<std::string> names;
  for (const auto& s : response.list_services_response().service()) names.push_back(s.name());
  EXPECT_THAT(names, Contains("refit.v1.RefitService"));
  EXPECT_THAT(names, Contains("grpc.health.v1.Health"));

  ServerReflectionRequest symbol;
  symbol.set_file_containing_symbol("refit.v1.RefitService");
  ASSERT_TRUE(Ask(symbol, "", &response).ok());
  ASSERT_GT(response.file_descriptor_response().file_descriptor_proto_size(), 0);
  google::protobuf::FileDescriptorProto file;
  ASSERT_TRUE(file.ParseFromString(response.file_descriptor_response().file_descriptor_proto(
      response.file_descriptor_response().file_descriptor_proto_size() - 1)));
  EXPECT_EQ(file.name(), "refit/v1/refit.proto");
  EXPECT_EQ(file.package(), "refit.v1");

  ServerReflectionRequest unknown;
  unknown.set_file_containing_symbol("no.such.Symbol");
  ASSERT_TRUE(Ask(unknown, "", &response).ok());
  EXPECT_EQ(response.error_response().error_code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));
  EXPECT_THAT(response.error_response().error_message(), HasSubstr("no.such.Symbol"));
}

TEST_F(ReflectionServiceTest, WithAuthenticationFollowsTheReaderRoleAndHealthStaysOpen) {
  StartServer(/*with_tokens=*/true);
  ServerReflectionResponse response;
  grpc::Status anonymous = Ask(ListServices(), "", &response);
  EXPECT_EQ(anonymous.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Ask(ListServices(), "wrong-token", &response).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(Ask(ListServices(), "reader-token", &response).ok());
  EXPECT_GT(response.list_services_response().service_size(), 0);
  // Exactly who may call GetStatus: a trainer token is not enough.
  EXPECT_EQ(Ask(ListServices(), "trainer-token", &response).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);

  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext context;
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse check;
  EXPECT_TRUE(health->Check(&context, request, &check).ok());
  EXPECT_EQ(check.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

}  // namespace
}  // namespace refit::server
