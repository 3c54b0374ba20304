// Authentication and transport security of a real in-process refitd: the
// bearer-token role matrix on every RPC, ownership of refits, health without
// a token, the loopback rule, and TLS / mutual TLS with certificates made by
// openssl in the test.
#include <stdlib.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "refit/v1/engine.grpc.pb.h"
#include "tests/server/server_test_util.h"

namespace refit::server {
namespace {

using ::refit::server::testing::FullPush;
using ::refit::server::testing::MakeTempDir;
using ::refit::server::testing::PushMessages;
using ::refit::server::testing::TestOptions;
using ::testing::HasSubstr;

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class AuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    WriteText(dir_ + "/tokens",
              "# test tokens\n"
              "alice-token trainer alice\n"
              "bob-token trainer bob\n"
              "ops-token operator ops\n"
              "reader-token reader\n"
              "engine-token engine vllm-0\n");
    ServerOptions options = TestOptions(dir_);
    options.auth_tokens_file = dir_ + "/tokens";
    absl::StatusOr<std::unique_ptr<RefitServer>> server = RefitServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    channel_ = testing::Connect(*server_);
    stub_ = v1::RefitService::NewStub(channel_);
  }

  void Authorize(grpc::ClientContext* context, const std::string& token) {
    if (!token.empty()) context->AddMetadata("authorization", absl::StrCat("Bearer ", token));
  }

  grpc::Status GetStatus(const std::string& token) {
    grpc::ClientContext context;
    Authorize(&context, token);
    v1::GetStatusResponse response;
    return stub_->GetStatus(&context, v1::GetStatusRequest(), &response);
  }

  grpc::Status ListTensors(const std::string& token) {
    grpc::ClientContext context;
    Authorize(&context, token);
    v1::ListTensorsRequest request;
    request.set_layout(v1::ListTensorsRequest::LAYOUT_KERNEL);
    v1::ListTensorsResponse response;
    return stub_->ListTensors(&context, request, &response);
  }

  grpc::Status ReadTensor(const std::string& token) {
    grpc::ClientContext context;
    Authorize(&context, token);
    v1::ReadTensorRequest request;
    request.set_name("model.layers.0.mlp.down_proj.weight_scale");
    auto reader = stub_->ReadTensor(&context, request);
    v1::ReadTensorResponse response;
    while (reader->Read(&response)) {
    }
    return reader->Finish();
  }

  grpc::Status WatchFirstEvent(const std::string& token) {
    grpc::ClientContext context;
    Authorize(&context, token);
    auto reader = stub_->Watch(&context, v1::WatchRequest());
    v1::WatchEvent event;
    if (reader->Read(&event)) {
      EXPECT_EQ(event.type(), v1::WatchEvent::TYPE_SNAPSHOT);
      context.TryCancel();
      while (reader->Read(&event)) {
      }
      reader->Finish();
      return grpc::Status::OK;
    }
    return reader->Finish();
  }

  grpc::Status Reload(const std::string& token) {
    grpc::ClientContext context;
    Authorize(&context, token);
    v1::ReloadRequest request;
    request.set_path("/etc");  // refused by the root check if auth lets it through
    request.mutable_options()->set_completion(v1::COMPLETION_MODE_COMMIT);
    request.mutable_options()->set_non_finite(v1::NON_FINITE_POLICY_REJECT);
    auto reader = stub_->Reload(&context, request);
    v1::ReloadProgress progress;
    while (reader->Read(&progress)) {
    }
    return reader->Finish();
  }

  grpc::Status Commit(const std::string& token, const std::string& id) {
    grpc::ClientContext context;
    Authorize(&context, token);
    v1::CommitRequest request;
    request.set_refit_id(id);
    v1::CommitResponse response;
    return stub_->Commit(&context, request, &response);
  }

  grpc::Status Abort(const std::string& token, const std::string& id) {
    grpc::ClientContext context;
    Authorize(&context, token);
    v1::AbortRequest request;
    request.set_refit_id(id);
    v1::AbortResponse response;
    return stub_->Abort(&context, request, &response);
  }

  std::string Prepare(const std::string& token) {
    testing::PushOutcome push =
        PushMessages(stub_.get(), FullPush(3, v1::COMPLETION_MODE_PREPARE), token);
    EXPECT_TRUE(push.status.ok()) << push.status.error_message();
    return push.response.result().refit_id();
  }

  std::string dir_ = MakeTempDir();
  std::unique_ptr<RefitServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::RefitService::Stub> stub_;
};

TEST_F(AuthTest, MissingOrUnknownTokenIsUnauthenticated) {
  for (const std::string& token : {std::string(""), std::string("wrong-token")}) {
    EXPECT_EQ(GetStatus(token).error_code(), grpc::StatusCode::UNAUTHENTICATED) << token;
    EXPECT_EQ(ListTensors(token).error_code(), grpc::StatusCode::UNAUTHENTICATED) << token;
    EXPECT_EQ(ReadTensor(token).error_code(), grpc::StatusCode::UNAUTHENTICATED) << token;
    EXPECT_EQ(WatchFirstEvent(token).error_code(), grpc::StatusCode::UNAUTHENTICATED) << token;
    EXPECT_EQ(Reload(token).error_code(), grpc::StatusCode::UNAUTHENTICATED) << token;
    EXPECT_EQ(Commit(token, "r-1").error_code(), grpc::StatusCode::UNAUTHENTICATED) << token;
    EXPECT_EQ(Abort(token, "").error_code(), grpc::StatusCode::UNAUTHENTICATED) << token;
    grpc::Status push = PushMessages(stub_.get(), FullPush(1), token).status;
    EXPECT_EQ(push.error_code(), grpc::StatusCode::UNAUTHENTICATED) << token;
  }
  EXPECT_THAT(GetStatus("").error_message(), HasSubstr("authorization"));
}

TEST_F(AuthTest, ReaderReadsButMayNotChangeAnything) {
  const std::string reader = "reader-token";
  EXPECT_TRUE(GetStatus(reader).ok());
  EXPECT_TRUE(ListTensors(reader).ok());
  EXPECT_TRUE(ReadTensor(reader).ok());
  EXPECT_TRUE(WatchFirstEvent(reader).ok());
  grpc::Status push = PushMessages(stub_.get(), FullPush(1), reader).status;
  EXPECT_EQ(push.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(push.error_message(), HasSubstr("reader"));
  EXPECT_EQ(Reload(reader).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Commit(reader, "r-1").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Abort(reader, "").error_code(), grpc::StatusCode::PERMISSION_DENIED);
}

// Attach's first message and the stream's status: OK once the manifest
// came, else the refusal.
grpc::Status AttachWith(v1::EngineService::Stub* stub, const std::string& token, bool coordinate) {
  grpc::ClientContext context;
  context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
  auto stream = stub->Attach(&context);
  v1::EngineMessage first;
  first.mutable_attach()->set_coordinate(coordinate);
  stream->Write(first);
  v1::DaemonMessage message;
  const bool attached = stream->Read(&message) && message.has_attached();
  stream->WritesDone();
  while (stream->Read(&message)) {
  }
  const grpc::Status status = stream->Finish();
  if (attached && status.ok()) return grpc::Status::OK;
  return status.ok() ? grpc::Status(grpc::StatusCode::UNKNOWN, "no manifest") : status;
}

TEST_F(AuthTest, OnlyEngineAndOperatorTokensAttachWithCoordination) {
  // A coordinated engine holds up every commit until it acks: a reader may
  // map the weights, not veto refits.
  auto engines = v1::EngineService::NewStub(channel_);
  EXPECT_TRUE(AttachWith(engines.get(), "reader-token", false).ok());
  const grpc::Status refused = AttachWith(engines.get(), "reader-token", true);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(refused.error_message(),
              HasSubstr("Attach: role reader may not hold up commits (Attach with coordinate): "
                        "attach without it, or with an engine or operator token"));
  for (const char* token : {"engine-token", "ops-token"}) {
    EXPECT_TRUE(AttachWith(engines.get(), token, true).ok()) << token;
    EXPECT_TRUE(AttachWith(engines.get(), token, false).ok()) << token;
  }
  EXPECT_EQ(AttachWith(engines.get(), "alice-token", false).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // An engine token reads as a reader does, and changes nothing.
  const std::string engine = "engine-token";
  EXPECT_TRUE(GetStatus(engine).ok());
  EXPECT_TRUE(ReadTensor(engine).ok());
  EXPECT_TRUE(WatchFirstEvent(engine).ok());
  EXPECT_EQ(PushMessages(stub_.get(), FullPush(1), engine).status.error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Reload(engine).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Abort(engine, "").error_code(), grpc::StatusCode::PERMISSION_DENIED);
}

TEST_F(AuthTest, TrainerPushesAndFinishesOnlyItsOwnRefits) {
  const std::string alice = "alice-token", bob = "bob-token";
  EXPECT_TRUE(PushMessages(stub_.get(), FullPush(1), alice).status.ok());
  EXPECT_EQ(Reload(alice).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(GetStatus(alice).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // An empty id is the caller's own active refit: alice has none.
  grpc::Status none = Abort(alice, "");
  EXPECT_EQ(none.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(none.error_message(), HasSubstr("has no active refit"));

  const std::string id = Prepare(alice);
  grpc::Status bob_commit = Commit(bob, id);
  EXPECT_EQ(bob_commit.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(bob_commit.error_message(), HasSubstr(id));
  EXPECT_EQ(Abort(bob, id).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(Commit(alice, id).ok());

  const std::string second = Prepare(alice);
  EXPECT_TRUE(Abort(alice, second).ok());
}

TEST_F(AuthTest, EmptyRefitIdIsTheTrainersOwnActiveRefit) {
  const std::string alice = "alice-token", bob = "bob-token";
  const std::string id = Prepare(alice);
  // bob's own active refit: none, whatever alice has going.
  grpc::Status bob_commit = Commit(bob, "");
  EXPECT_EQ(bob_commit.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(bob_commit.error_message(), HasSubstr("no active refit of \"bob\""));
  EXPECT_THAT(bob_commit.error_message(), HasSubstr(id));
  EXPECT_EQ(Abort(bob, "").error_code(), grpc::StatusCode::NOT_FOUND);
  // alice's: the prepared one, committed and then gone.
  EXPECT_TRUE(Commit(alice, "").ok());
  EXPECT_EQ(Commit(alice, "").error_code(), grpc::StatusCode::NOT_FOUND);
  const std::string second = Prepare(alice);
  grpc::ClientContext context;
  Authorize(&context, alice);
  v1::AbortRequest request;
  v1::AbortResponse response;
  ASSERT_TRUE(stub_->Abort(&context, request, &response).ok());
  EXPECT_EQ(response.refit_id(), second);
  EXPECT_EQ(Abort(alice, "").error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(AuthTest, OperatorMayDoEverything) {
  const std::string ops = "ops-token";
  EXPECT_TRUE(GetStatus(ops).ok());
  EXPECT_TRUE(ListTensors(ops).ok());
  EXPECT_TRUE(ReadTensor(ops).ok());
  EXPECT_TRUE(WatchFirstEvent(ops).ok());
  // Authorized; then refused by the reload root, not by auth.
  grpc::Status reload = Reload(ops);
  EXPECT_EQ(reload.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(reload.error_message(), HasSubstr("outside the reload root"));
  EXPECT_TRUE(PushMessages(stub_.get(), FullPush(1), ops).status.ok());
  Prepare("alice-token");  // a trainer's refit, aborted by the operator
  EXPECT_TRUE(Abort(ops, "").ok());
  const std::string again = Prepare("alice-token");
  EXPECT_TRUE(Commit(ops, again).ok());
}

TEST_F(AuthTest, HealthNeedsNoToken) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  for (const char* service : {"", "refit.v1.RefitService"}) {
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    ASSERT_TRUE(health->Check(&context, request, &response).ok()) << service;
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING) << service;
  }
}

TEST(ListenPolicyTest, NonLoopbackWithoutAuthNeedsExplicitFlag) {
  const std::string dir = MakeTempDir();
  ServerOptions options = TestOptions(dir);
  options.listen = {"0.0.0.0:0"};
  absl::StatusOr<std::unique_ptr<RefitServer>> refused = RefitServer::Create(options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("--allow-insecure-remote"));
  options.allow_insecure_remote = true;
  absl::StatusOr<std::unique_ptr<RefitServer>> allowed = RefitServer::Create(options);
  EXPECT_TRUE(allowed.ok()) << allowed.status();
}

TEST(ListenPolicyTest, PortOutOfRangeIsRefusedNamingTheAddress) {
  const std::string dir = MakeTempDir();
  ServerOptions options = TestOptions(dir);
  options.listen = {"127.0.0.1:500510"};
  absl::StatusOr<std::unique_ptr<RefitServer>> refused = RefitServer::Create(options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("--listen address \"127.0.0.1:500510\""));
  options = TestOptions(dir);
  options.metrics_listen = "127.0.0.1:70000";
  refused = RefitServer::Create(options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("--metrics-listen address \"127.0.0.1:70000\""));
}

TEST(ListenPolicyTest, NonLoopbackWithTokensIsAllowed) {
  const std::string dir = MakeTempDir();
  WriteText(dir + "/tokens", "t operator\n");
  ServerOptions options = TestOptions(dir);
  options.listen = {"0.0.0.0:0"};
  options.auth_tokens_file = dir + "/tokens";
  absl::StatusOr<std::unique_ptr<RefitServer>> server = RefitServer::Create(options);
  EXPECT_TRUE(server.ok()) << server.status();
}

TEST(ListenPolicyTest, BadTokensFileFailsStart) {
  const std::string dir = MakeTempDir();
  WriteText(dir + "/tokens", "t superuser\n");
  ServerOptions options = TestOptions(dir);
  options.auth_tokens_file = dir + "/tokens";
  absl::StatusOr<std::unique_ptr<RefitServer>> server = RefitServer::Create(options);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(server.status().message(), HasSubstr("superuser"));
}

// CA, server certificate for "localhost" and a client certificate, by openssl.
class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string script = absl::StrCat(
        "set -e; cd ", dir_,
        "; openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1"
        " -subj /CN=refit-test-ca 2>/dev/null"
        "; for who in server client; do"
        "   openssl req -newkey rsa:2048 -nodes -keyout $who.key -out $who.csr"
        "     -subj /CN=localhost 2>/dev/null;"
        "   printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > $who.ext;"
        "   openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key -CAcreateserial"
        "     -out $who.pem -days 1 -extfile $who.ext 2>/dev/null;"
        " done");
    ASSERT_EQ(system(script.c_str()), 0) << "openssl failed";
  }

  absl::StatusOr<std::unique_ptr<RefitServer>> StartTls(bool mutual) {
    ServerOptions options = TestOptions(dir_);
    options.listen = {"127.0.0.1:0"};
    options.tls_cert = dir_ + "/server.pem";
    options.tls_key = dir_ + "/server.key";
    if (mutual) options.tls_client_ca = dir_ + "/ca.pem";
    return RefitServer::Start(options);
  }

  grpc::Status GetStatusOver(const RefitServer& server, bool client_cert) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = ReadText(dir_ + "/ca.pem");
    if (client_cert) {
      ssl.pem_private_key = ReadText(dir_ + "/client.key");
      ssl.pem_cert_chain = ReadText(dir_ + "/client.pem");
    }
    grpc::ChannelArguments args;
    args.SetSslTargetNameOverride("localhost");
    auto channel = grpc::CreateCustomChannel(server.bound_addresses().front(),
                                             grpc::SslCredentials(ssl), args);
    auto stub = v1::RefitService::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::GetStatusResponse response;
    return stub->GetStatus(&context, v1::GetStatusRequest(), &response);
  }

  std::string dir_ = MakeTempDir();
};

TEST_F(TlsTest, ServerTls) {
  absl::StatusOr<std::unique_ptr<RefitServer>> server = StartTls(/*mutual=*/false);
  ASSERT_TRUE(server.ok()) << server.status();
  grpc::Status status = GetStatusOver(**server, /*client_cert=*/false);
  EXPECT_TRUE(status.ok()) << status.error_message();
  // A plaintext client cannot talk to it.
  auto plain = v1::RefitService::NewStub(grpc::CreateChannel((*server)->bound_addresses().front(),
                                                             grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::GetStatusResponse response;
  EXPECT_EQ(plain->GetStatus(&context, v1::GetStatusRequest(), &response).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, MutualTlsRequiresAClientCertificate) {
  absl::StatusOr<std::unique_ptr<RefitServer>> server = StartTls(/*mutual=*/true);
  ASSERT_TRUE(server.ok()) << server.status();
  grpc::Status with_cert = GetStatusOver(**server, /*client_cert=*/true);
  EXPECT_TRUE(with_cert.ok()) << with_cert.error_message();
  grpc::Status without = GetStatusOver(**server, /*client_cert=*/false);
  EXPECT_EQ(without.error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, ClientCaWithoutServerCertificateIsRejected) {
  ServerOptions options = TestOptions(dir_);
  options.tls_client_ca = dir_ + "/ca.pem";
  EXPECT_EQ(RefitServer::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace refit::server
