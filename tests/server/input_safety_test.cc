// Untrusted input against a real in-process refitd: Reload paths that try to
// leave --reload-root, non-finite values in tensors that are not quantized,
// hostile tensor names in errors, and bytes that are not a PushRequest.
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "core/fixture_model.h"
#include "core/text.h"
#include "tests/server/server_test_util.h"

namespace refit::server {
namespace {

using ::refit::server::testing::AddChunk;
using ::refit::server::testing::BeginMessage;
using ::refit::server::testing::ChunkMessages;
using ::refit::server::testing::EndMessage;
using ::refit::server::testing::FixtureWeights;
using ::refit::server::testing::MakeTempDir;
using ::refit::server::testing::PushMessages;
using ::refit::server::testing::PushOutcome;
using ::refit::server::testing::Status;
using ::refit::server::testing::TestOptions;
using ::testing::HasSubstr;
using ::testing::Not;

class InputSafetyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<RefitServer>> server = RefitServer::Start(TestOptions(root_));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    channel_ = testing::Connect(*server_);
    stub_ = v1::RefitService::NewStub(channel_);
  }

  grpc::Status Reload(const std::string& path, v1::RefitResult* result = nullptr) {
    grpc::ClientContext context;
    v1::ReloadRequest request;
    request.set_path(path);
    request.mutable_options()->set_completion(v1::COMPLETION_MODE_COMMIT);
    request.mutable_options()->set_non_finite(v1::NON_FINITE_POLICY_REJECT);
    auto reader = stub_->Reload(&context, request);
    v1::ReloadProgress message;
    while (reader->Read(&message)) {
      if (message.has_result() && result != nullptr) *result = message.result();
    }
    return reader->Finish();
  }

  uint64_t Version() { return Status(stub_.get()).version(); }

  std::string root_ = MakeTempDir();
  std::string outside_ = MakeTempDir();
  std::unique_ptr<RefitServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::RefitService::Stub> stub_;
};

TEST_F(InputSafetyTest, ReloadRefusesAShardSymlinkedOutOfTheRoot) {
  // The directory is under the root; one of its shards links out of it.
  ASSERT_TRUE(core::WriteFixtureModel(outside_ + "/secret", core::FixtureConfig(), 5, 1).ok());
  const std::string dir = root_ + "/ckpt";
  ASSERT_TRUE(core::WriteFixtureModel(dir, core::FixtureConfig(), 6, 1).ok());
  const std::string shard = dir + "/model-00001-of-00001.safetensors";
  ASSERT_EQ(::unlink(shard.c_str()), 0);
  ASSERT_EQ(
      ::symlink((outside_ + "/secret/model-00001-of-00001.safetensors").c_str(), shard.c_str()), 0);
  grpc::Status status = Reload(dir);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("model-00001-of-00001.safetensors"));
  EXPECT_THAT(status.error_message(), HasSubstr("outside the reload root"));
  EXPECT_EQ(Version(), 1u);
}

TEST_F(InputSafetyTest, RelativeReloadPathsResolveAgainstTheRoot) {
  ASSERT_TRUE(core::WriteFixtureModel(root_ + "/rel", core::FixtureConfig(), 7, 1).ok());
  v1::RefitResult result;
  grpc::Status status = Reload("rel", &result);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(result.version(), 2u);
  // Leaving the root with ".." is refused like an absolute path outside it.
  ASSERT_TRUE(core::WriteFixtureModel(outside_ + "/up", core::FixtureConfig(), 8, 1).ok());
  const std::string up =
      absl::StrCat("../", outside_.substr(outside_.find_last_of('/') + 1), "/up");
  status = Reload(up);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("outside the reload root"));
  EXPECT_EQ(Version(), 2u);
}

TEST_F(InputSafetyTest, NonFiniteEmbeddingIsRejectedByDefault) {
  std::vector<core::OwnedTensor> weights = FixtureWeights(3);
  for (core::OwnedTensor& t : weights) {
    if (t.name == "model.embed_tokens.weight") {
      t.bytes[0] = 0xC0;  // bf16 NaN
      t.bytes[1] = 0x7F;
    }
  }
  std::vector<v1::PushRequest> messages = {BeginMessage()};
  for (v1::PushRequest& m : ChunkMessages(weights)) messages.push_back(std::move(m));
  messages.push_back(EndMessage());
  PushOutcome push = PushMessages(stub_.get(), messages);
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << push.status.error_message();
  EXPECT_THAT(push.status.error_message(), HasSubstr("model.embed_tokens.weight"));
  EXPECT_THAT(push.status.error_message(), HasSubstr("element 0 is nan"));
  EXPECT_EQ(Version(), 1u);
  // The vLLM-compatible policy serves it.
  messages.front().mutable_begin()->mutable_options()->set_non_finite(
      v1::NON_FINITE_POLICY_VLLM_COMPATIBLE);
  push = PushMessages(stub_.get(), messages);
  EXPECT_TRUE(push.status.ok()) << push.status.error_message();
  EXPECT_EQ(Version(), 2u);
}

TEST_F(InputSafetyTest, HugeTensorNameGivesNotFoundWithTheNameCut) {
  // Before names were bounded, the error carried all 900 KB, more than the
  // client accepts in a status, and the client saw RESOURCE_EXHAUSTED.
  core::OwnedTensor bogus = FixtureWeights(1).front();
  bogus.name = std::string(900 * 1024, 'n');
  v1::PushRequest chunks;
  AddChunk(bogus, chunks.mutable_chunks());
  PushOutcome push = PushMessages(stub_.get(), {BeginMessage(), chunks, EndMessage()});
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::NOT_FOUND) << push.status.error_code();
  EXPECT_THAT(push.status.error_message(), HasSubstr(std::string(core::kMaxQuotedTextBytes, 'n') +
                                                     "\xE2\x80\xA6(921600 bytes)"));
  EXPECT_LT(push.status.error_message().size(), 4096u);
  EXPECT_EQ(Version(), 1u);
}

TEST_F(InputSafetyTest, TensorNameWithControlBytesIsEscapedInTheError) {
  core::OwnedTensor bogus = FixtureWeights(1).front();
  bogus.name = std::string("evil\n2026-01-01T00:00:00Z INFO forged") + std::string(1, '\0') + "x";
  v1::PushRequest chunks;
  AddChunk(bogus, chunks.mutable_chunks());
  PushOutcome push = PushMessages(stub_.get(), {BeginMessage(), chunks, EndMessage()});
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(push.status.error_message(),
              HasSubstr("\"evil\\n2026-01-01T00:00:00Z INFO forged\\x00x\""));
  EXPECT_THAT(push.status.error_message(), Not(HasSubstr("\n")));
}

// Runs one async op on `cq` and waits for it.
bool Await(grpc::CompletionQueue& cq, void* tag) {
  void* got = nullptr;
  bool ok = false;
  EXPECT_TRUE(cq.Next(&got, &ok));
  EXPECT_EQ(got, tag);
  return ok;
}

TEST_F(InputSafetyTest, MalformedPushMessageIsNamedInTheStatus) {
  grpc::GenericStub generic(channel_);
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  int tags[6];
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      generic.PrepareCall(&context, "/refit.v1.RefitService/Push", &cq);
  call->StartCall(&tags[0]);
  ASSERT_TRUE(Await(cq, &tags[0]));
  const std::string begin = BeginMessage().SerializeAsString();
  grpc::Slice begin_slice(begin);
  grpc::ByteBuffer begin_buffer(&begin_slice, 1);
  call->Write(begin_buffer, &tags[1]);
  ASSERT_TRUE(Await(cq, &tags[1]));
  // Field 0 does not exist: no protobuf parser accepts these bytes.
  grpc::Slice junk_slice(std::string("\x02\xff\xff\xff", 4));
  grpc::ByteBuffer junk(&junk_slice, 1);
  call->Write(junk, &tags[2]);
  Await(cq, &tags[2]);
  call->WritesDone(&tags[3]);
  Await(cq, &tags[3]);
  grpc::Status status;
  call->Finish(&status, &tags[4]);
  Await(cq, &tags[4]);
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("not a valid PushRequest (malformed protobuf)"));
  EXPECT_EQ(Version(), 1u);
}

}  // namespace
}  // namespace refit::server
