// One refit fed by several Push streams (Begin.streams / join_refit_id):
// the joint commit, chunks of one tensor on different streams, and every way
// a stream can be refused or bring the whole refit down.
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/server/server_test_util.h"

namespace refit::server {
namespace {

using testing::AddChunk;
using testing::BeginMessage;
using testing::EndMessage;
using testing::FixtureWeights;
using ::testing::HasSubstr;
using testing::PushMessages;
using testing::ServerTest;
using testing::WatchStream;

// A Push stream driven message by message.
class Stream {
 public:
  explicit Stream(v1::RefitService::Stub* stub, const std::string& token = "") {
    if (!token.empty()) context_.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    writer_ = stub->Push(&context_, &response_);
  }
  bool Write(const v1::PushRequest& message) { return writer_->Write(message); }
  // After Begin: true once the daemon accepted it (initial metadata
  // "refit-id"), false when it refused it.
  bool Begun() {
    writer_->WaitForInitialMetadata();
    return context_.GetServerInitialMetadata().count("refit-id") == 1;
  }
  // WritesDone, then the RPC's status (blocks until the server ends it).
  grpc::Status Close() {
    writer_->WritesDone();
    return writer_->Finish();
  }
  void Cancel() { context_.TryCancel(); }
  const v1::PushResponse& response() const { return response_; }

 private:
  grpc::ClientContext context_;
  v1::PushResponse response_;
  std::unique_ptr<grpc::ClientWriter<v1::PushRequest>> writer_;
};

v1::PushRequest OpenMessage(const std::string& refit_id, uint32_t streams,
                            v1::CompletionMode mode = v1::COMPLETION_MODE_COMMIT) {
  v1::PushRequest request = BeginMessage(mode);
  request.mutable_begin()->set_refit_id(refit_id);
  request.mutable_begin()->set_streams(streams);
  return request;
}

v1::PushRequest JoinMessage(const std::string& refit_id) {
  v1::PushRequest request;
  request.mutable_begin()->set_join_refit_id(refit_id);
  return request;
}

// The fixture's tensors split over two streams: even tensors on the first,
// odd on the second, and the first tensor's bytes halved between both.
std::vector<v1::PushRequest> SplitChunks(const std::vector<core::OwnedTensor>& tensors, int part) {
  v1::PushRequest message;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const core::OwnedTensor& t = tensors[i];
    if (i == 0) {
      const size_t half = t.bytes.size() / 2;
      AddChunk(t, message.mutable_chunks());
      v1::Chunk* chunk =
          message.mutable_chunks()->mutable_chunks(message.chunks().chunks_size() - 1);
      if (part == 0) {
        chunk->set_data(t.bytes.data(), half);
      } else {
        chunk->set_byte_offset(half);
        chunk->set_data(t.bytes.data() + half, t.bytes.size() - half);
      }
      continue;
    }
    if (static_cast<int>(i % 2) == part) AddChunk(t, message.mutable_chunks());
  }
  return {message};
}

class MultiStreamPushTest : public ServerTest {
 protected:
  // Opens refit `id` of `streams` streams and waits until it is registered.
  std::unique_ptr<Stream> Open(const std::string& id, uint32_t streams,
                               v1::CompletionMode mode = v1::COMPLETION_MODE_COMMIT,
                               const std::string& token = "") {
    WatchStream watch(stub_.get());
    auto stream = std::make_unique<Stream>(stub_.get(), token);
    EXPECT_TRUE(stream->Write(OpenMessage(id, streams, mode)));
    EXPECT_EQ(watch.Next(v1::WatchEvent::TYPE_STAGING_STARTED).refit_id(), id);
    EXPECT_TRUE(stream->Begun());
    return stream;
  }

  // A whole single-stream push of `seed`: its fingerprint.
  std::string PushSingle(uint64_t seed) {
    testing::PushOutcome outcome = PushMessages(stub_.get(), testing::FullPush(seed));
    EXPECT_TRUE(outcome.status.ok()) << outcome.status.error_message();
    return outcome.response.result().fingerprint();
  }
};

TEST_F(MultiStreamPushTest, TwoStreamsCommitOnceWithTheSameBytesAsOne) {
  const std::string expected = PushSingle(7);
  PushSingle(8);
  const uint64_t before = Version();
  const std::vector<core::OwnedTensor> weights = FixtureWeights(7);

  std::unique_ptr<Stream> opener = Open("two-streams.1", 2);
  for (const v1::PushRequest& m : SplitChunks(weights, 0)) ASSERT_TRUE(opener->Write(m));
  ASSERT_TRUE(opener->Write(EndMessage()));

  Stream joiner(stub_.get());
  ASSERT_TRUE(joiner.Write(JoinMessage("two-streams.1")));
  for (const v1::PushRequest& m : SplitChunks(weights, 1)) ASSERT_TRUE(joiner.Write(m));
  ASSERT_TRUE(joiner.Write(EndMessage()));

  grpc::Status joined = joiner.Close();
  grpc::Status opened = opener->Close();
  ASSERT_TRUE(opened.ok()) << opened.error_message();
  ASSERT_TRUE(joined.ok()) << joined.error_message();
  EXPECT_EQ(opener->response().result().refit_id(), "two-streams.1");
  EXPECT_EQ(opener->response().result().state(), v1::REFIT_STATE_COMMITTED);
  EXPECT_EQ(opener->response().result().version(), before + 1);
  EXPECT_EQ(opener->response().result().fingerprint(), expected);
  EXPECT_EQ(joiner.response().result().version(), before + 1);
  EXPECT_EQ(Version(), before + 1);
}

TEST_F(MultiStreamPushTest, PreparedByTheLastEndThenCommitted) {
  const std::vector<core::OwnedTensor> weights = FixtureWeights(3);
  std::unique_ptr<Stream> opener = Open("prep", 2, v1::COMPLETION_MODE_PREPARE);
  Stream joiner(stub_.get());
  ASSERT_TRUE(joiner.Write(JoinMessage("prep")));
  for (const v1::PushRequest& m : SplitChunks(weights, 1)) ASSERT_TRUE(joiner.Write(m));
  ASSERT_TRUE(joiner.Write(EndMessage()));
  for (const v1::PushRequest& m : SplitChunks(weights, 0)) ASSERT_TRUE(opener->Write(m));
  ASSERT_TRUE(opener->Write(EndMessage()));
  ASSERT_TRUE(opener->Close().ok());
  ASSERT_TRUE(joiner.Close().ok());
  EXPECT_EQ(opener->response().result().state(), v1::REFIT_STATE_PREPARED);
  EXPECT_EQ(joiner.response().result().state(), v1::REFIT_STATE_PREPARED);

  const uint64_t before = Version();
  grpc::ClientContext context;
  v1::CommitRequest request;
  request.set_refit_id("prep");
  v1::CommitResponse response;
  grpc::Status status = stub_->Commit(&context, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(Version(), before + 1);
}

TEST_F(MultiStreamPushTest, JoinUnknownRefitIsNotFound) {
  Stream joiner(stub_.get());
  joiner.Write(JoinMessage("nobody"));
  EXPECT_FALSE(joiner.Begun());
  grpc::Status status = joiner.Close();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(status.error_message().find("nobody"), std::string::npos) << status.error_message();
}

TEST_F(MultiStreamPushTest, JoinFinishedRefitIsFailedPrecondition) {
  std::unique_ptr<Stream> opener = Open("done.1", 1);
  ASSERT_TRUE(opener->Write(EndMessage()));
  ASSERT_TRUE(opener->Close().ok());
  Stream joiner(stub_.get());
  joiner.Write(JoinMessage("done.1"));
  grpc::Status status = joiner.Close();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(status.error_message().find("finished"), std::string::npos) << status.error_message();
}

TEST_F(MultiStreamPushTest, JoinBeyondStreamsIsFailedPrecondition) {
  const uint64_t before = Version();
  std::unique_ptr<Stream> opener = Open("full", 2);
  Stream first(stub_.get());
  ASSERT_TRUE(first.Write(JoinMessage("full")));
  ASSERT_TRUE(first.Begun());
  Stream second(stub_.get());
  second.Write(JoinMessage("full"));
  grpc::Status refused = second.Close();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(refused.error_message().find("all its 2 streams"), std::string::npos)
      << refused.error_message();
  // The refused join does not disturb the refit.
  ASSERT_TRUE(first.Write(EndMessage()));
  ASSERT_TRUE(opener->Write(EndMessage()));
  EXPECT_TRUE(first.Close().ok());
  EXPECT_TRUE(opener->Close().ok());
  EXPECT_EQ(Version(), before);  // no chunk: unchanged
}

TEST_F(MultiStreamPushTest, JoinWithOptionsOrGroupIsInvalidArgument) {
  std::unique_ptr<Stream> opener = Open("opts", 2);
  for (int variant = 0; variant < 3; ++variant) {
    v1::PushRequest join = JoinMessage("opts");
    if (variant == 0) *join.mutable_begin()->mutable_options() = BeginMessage().begin().options();
    if (variant == 1) join.mutable_begin()->set_model_group("demo");
    if (variant == 2) join.mutable_begin()->set_streams(2);
    Stream joiner(stub_.get());
    joiner.Write(join);
    grpc::Status status = joiner.Close();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << variant;
    EXPECT_NE(status.error_message().find("join_refit_id"), std::string::npos)
        << status.error_message();
  }
  opener->Cancel();
  opener->Close();
}

TEST_F(MultiStreamPushTest, BadRefitIdIsInvalidArgument) {
  for (const std::string& id :
       {std::string("has space"), std::string(65, 'a'), std::string("slash/no")}) {
    Stream stream(stub_.get());
    stream.Write(OpenMessage(id, 2));
    grpc::Status status = stream.Close();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << id;
    EXPECT_NE(status.error_message().find("refit_id"), std::string::npos) << status.error_message();
  }
}

TEST_F(MultiStreamPushTest, RefitIdInUseIsAlreadyExists) {
  std::unique_ptr<Stream> opener = Open("taken", 2);
  Stream again(stub_.get());
  again.Write(OpenMessage("taken", 1));
  grpc::Status status = again.Close();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_NE(status.error_message().find("taken"), std::string::npos) << status.error_message();
  opener->Cancel();
  opener->Close();
}

TEST_F(MultiStreamPushTest, FailingJoinerAbortsTheWholeRefit) {
  const uint64_t before = Version();
  std::unique_ptr<Stream> opener = Open("bad-chunk", 2);
  ASSERT_TRUE(opener->Write(EndMessage()));
  Stream joiner(stub_.get());
  ASSERT_TRUE(joiner.Write(JoinMessage("bad-chunk")));
  v1::PushRequest bad;
  v1::Chunk* chunk = bad.mutable_chunks()->add_chunks();
  chunk->set_tensor_name("no.such.tensor");
  chunk->set_dtype(v1::DTYPE_BF16);
  chunk->add_shape(2);
  chunk->set_data(std::string(4, '\0'));
  joiner.Write(bad);
  grpc::Status failed = joiner.Close();
  grpc::Status aborted = opener->Close();
  EXPECT_EQ(failed.error_code(), grpc::StatusCode::NOT_FOUND) << failed.error_message();
  EXPECT_EQ(aborted.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_NE(aborted.error_message().find("no.such.tensor"), std::string::npos)
      << aborted.error_message();
  EXPECT_EQ(Version(), before);
}

// Streams that never join would hold the group's refit slot until
// --refit-timeout: after a stream's End, the others have --push-idle-timeout
// to join (on the fake clock: the test moves the time, nothing sleeps).
TEST_F(MultiStreamPushTest, StreamsThatNeverJoinEndTheRefitAfterTheIdleTimeout) {
  ServerOptions options = FakeClockOptions();
  options.push_idle_timeout = absl::Seconds(60);
  StartServer(std::move(options));
  const uint64_t before = Version();
  const absl::Time opened = clock_.Now();
  std::unique_ptr<Stream> opener = Open("lonely", 2);
  // The read after Begin is armed for opened + 60 s; step past "now" so
  // that the deadline armed at End is one of its own.
  ASSERT_TRUE(clock_.AwaitWaiter(opened + absl::Seconds(60)));
  clock_.AdvanceTime(absl::Seconds(1));
  ASSERT_TRUE(opener->Write(EndMessage()));
  ASSERT_TRUE(clock_.AwaitWaiter(opened + absl::Seconds(61)));
  clock_.AdvanceTime(absl::Seconds(60));
  const grpc::Status status = opener->Close();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(status.error_message(),
              HasSubstr("refit \"lonely\" aborted: only 1 of its 2 streams joined within 1m "
                        "(--push-idle-timeout) of a stream's End"));
  EXPECT_EQ(Version(), before);
  // The slot is free again.
  EXPECT_TRUE(PushMessages(stub_.get(), testing::FullPush(4)).status.ok());
}

TEST_F(MultiStreamPushTest, AStreamThatJoinsWithinTheIdleTimeoutOfAnEndCompletesTheRefit) {
  ServerOptions options = FakeClockOptions();
  options.push_idle_timeout = absl::Seconds(60);
  StartServer(std::move(options));
  const std::string expected = PushSingle(7);
  PushSingle(8);
  const uint64_t before = Version();
  const std::vector<core::OwnedTensor> weights = FixtureWeights(7);
  const absl::Time opened = clock_.Now();
  std::unique_ptr<Stream> opener = Open("late-joiner", 2);
  // Every chunk goes over the joiner: a chunk read on the opener could arm
  // its idle deadline after the clock moved, and be taken for End's.
  ASSERT_TRUE(clock_.AwaitWaiter(opened + absl::Seconds(60)));
  clock_.AdvanceTime(absl::Seconds(1));
  ASSERT_TRUE(opener->Write(EndMessage()));
  ASSERT_TRUE(clock_.AwaitWaiter(opened + absl::Seconds(61)));
  clock_.AdvanceTime(absl::Seconds(30));
  Stream joiner(stub_.get());
  ASSERT_TRUE(joiner.Write(JoinMessage("late-joiner")));
  ASSERT_TRUE(joiner.Begun());
  // The End's deadline passes with every stream joined: nothing ends.
  ASSERT_TRUE(clock_.AwaitWaiter(opened + absl::Seconds(61)));
  clock_.AdvanceTime(absl::Seconds(30));
  for (int part : {0, 1}) {
    for (const v1::PushRequest& m : SplitChunks(weights, part)) ASSERT_TRUE(joiner.Write(m));
  }
  ASSERT_TRUE(joiner.Write(EndMessage()));
  const grpc::Status joined = joiner.Close();
  const grpc::Status opened_status = opener->Close();
  ASSERT_TRUE(joined.ok()) << joined.error_message();
  ASSERT_TRUE(opened_status.ok()) << opened_status.error_message();
  EXPECT_EQ(opener->response().result().fingerprint(), expected);
  EXPECT_EQ(Version(), before + 1);
}

TEST_F(MultiStreamPushTest, JoinerClosedWithoutEndAbortsTheOpener) {
  std::unique_ptr<Stream> opener = Open("no-end", 2);
  ASSERT_TRUE(opener->Write(EndMessage()));
  Stream joiner(stub_.get());
  ASSERT_TRUE(joiner.Write(JoinMessage("no-end")));
  grpc::Status closed = joiner.Close();  // WritesDone without End
  grpc::Status aborted = opener->Close();
  EXPECT_EQ(closed.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_NE(closed.error_message().find("without End"), std::string::npos)
      << closed.error_message();
  EXPECT_EQ(aborted.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_NE(aborted.error_message().find("no-end"), std::string::npos) << aborted.error_message();
}

TEST_F(MultiStreamPushTest, OpenerCancelledAbortsTheJoiner) {
  std::unique_ptr<Stream> opener = Open("cancel", 2);
  Stream joiner(stub_.get());
  ASSERT_TRUE(joiner.Write(JoinMessage("cancel")));
  ASSERT_TRUE(joiner.Begun());
  opener->Cancel();
  EXPECT_EQ(opener->Close().error_code(), grpc::StatusCode::CANCELLED);
  grpc::Status aborted = joiner.Close();
  EXPECT_EQ(aborted.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_NE(aborted.error_message().find("cancel"), std::string::npos) << aborted.error_message();
}

TEST_F(MultiStreamPushTest, AbortRpcEndsEveryStream) {
  std::unique_ptr<Stream> opener = Open("abort-all", 2);
  Stream joiner(stub_.get());
  ASSERT_TRUE(joiner.Write(JoinMessage("abort-all")));
  ASSERT_TRUE(joiner.Begun());
  ASSERT_TRUE(joiner.Write(EndMessage()));
  grpc::ClientContext context;
  v1::AbortRequest request;
  request.set_refit_id("abort-all");
  v1::AbortResponse response;
  ASSERT_TRUE(stub_->Abort(&context, request, &response).ok());
  EXPECT_EQ(opener->Close().error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(joiner.Close().error_code(), grpc::StatusCode::ABORTED);
}

class MultiStreamAuthTest : public ServerTest {
 protected:
  void SetUp() override {
    std::ofstream(dir_ + "/tokens") << "alice-token trainer alice\n"
                                       "bob-token trainer bob\n"
                                       "ops-token operator ops\n";
    ServerOptions options = testing::TestOptions(dir_);
    options.auth_tokens_file = dir_ + "/tokens";
    StartServer(options);
  }
};

TEST_F(MultiStreamAuthTest, AnotherTrainersRefitIsPermissionDenied) {
  grpc::ClientContext watch_context;
  watch_context.AddMetadata("authorization", "Bearer ops-token");
  std::unique_ptr<grpc::ClientReader<v1::WatchEvent>> watch =
      stub_->Watch(&watch_context, v1::WatchRequest());
  v1::WatchEvent event;
  ASSERT_TRUE(watch->Read(&event));  // the snapshot: subscribed
  Stream opener(stub_.get(), "alice-token");
  ASSERT_TRUE(opener.Write(OpenMessage("alices", 2)));
  while (watch->Read(&event) && event.type() != v1::WatchEvent::TYPE_STAGING_STARTED) {
  }
  ASSERT_EQ(event.refit_id(), "alices");
  Stream bob(stub_.get(), "bob-token");
  bob.Write(JoinMessage("alices"));
  grpc::Status denied = bob.Close();
  EXPECT_EQ(denied.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(denied.error_message().find("another client"), std::string::npos)
      << denied.error_message();
  // Her own second stream may join.
  Stream own(stub_.get(), "alice-token");
  ASSERT_TRUE(own.Write(JoinMessage("alices")));
  ASSERT_TRUE(own.Write(EndMessage()));
  ASSERT_TRUE(opener.Write(EndMessage()));
  EXPECT_TRUE(opener.Close().ok());
  EXPECT_TRUE(own.Close().ok());
  watch_context.TryCancel();
  while (watch->Read(&event)) {
  }
  watch->Finish();
}

}  // namespace
}  // namespace refit::server
