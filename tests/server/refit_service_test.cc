// RefitService over a real in-process refitd: every RPC, its bad inputs and
// their exact status codes, and the transaction semantics (nothing visible
// before commit, aborts leave the live version unchanged).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/fp8_quantizer.h"
#include "core/safetensors.h"
#include "tests/server/server_test_util.h"
#include "tests/testing/fake_clock.h"

namespace refit::server {
namespace {

using ::refit::server::testing::AddChunk;
using ::refit::server::testing::BeginMessage;
using ::refit::server::testing::ChunkMessages;
using ::refit::server::testing::EndMessage;
using ::refit::server::testing::FixtureWeights;
using ::refit::server::testing::FullPush;
using ::refit::server::testing::MakeTempDir;
using ::refit::server::testing::PushMessages;
using ::refit::server::testing::PushOutcome;
using ::refit::server::testing::ReadTensorBytes;
using ::refit::server::testing::Status;
using ::refit::server::testing::TestOptions;
using ::refit::server::testing::WatchStream;
using ::refit::testing::FakeClock;
using ::testing::HasSubstr;

class RefitServiceTest : public testing::ServerTest {
 protected:
  const core::OwnedTensor* Find(const std::vector<core::OwnedTensor>& tensors,
                                const std::string& name) {
    for (const auto& t : tensors) {
      if (t.name == name) return &t;
    }
    ADD_FAILURE() << "fixture has no " << name;
    return nullptr;
  }
};

TEST_F(RefitServiceTest, PushCommitsAndVersionFlips) {
  const v1::GetStatusResponse before = Status(stub_.get());
  EXPECT_EQ(before.version(), 1u);
  EXPECT_TRUE(before.ready());
  PushOutcome push = PushMessages(stub_.get(), FullPush(/*seed=*/7));
  ASSERT_TRUE(push.status.ok()) << push.status.error_message();
  const v1::RefitResult& result = push.response.result();
  EXPECT_EQ(result.state(), v1::REFIT_STATE_COMMITTED);
  EXPECT_EQ(result.version(), 2u);
  EXPECT_FALSE(result.refit_id().empty());
  EXPECT_GT(result.bytes_received(), 0u);
  const v1::GetStatusResponse after = Status(stub_.get());
  EXPECT_EQ(after.version(), 2u);
  EXPECT_EQ(after.fingerprint(), result.fingerprint());
  EXPECT_NE(after.fingerprint(), before.fingerprint());
  EXPECT_FALSE(after.has_active_refit());
}

TEST_F(RefitServiceTest, ReadTensorBytesMatchLocalQuantization) {
  ASSERT_TRUE(PushMessages(stub_.get(), FullPush(/*seed=*/11)).status.ok());
  const std::vector<core::OwnedTensor> weights = FixtureWeights(11);
  const core::OwnedTensor* src = Find(weights, "model.layers.0.mlp.down_proj.weight");
  ASSERT_NE(src, nullptr);
  const int64_t rows = src->shape[0], cols = src->shape[1];
  std::vector<uint8_t> q(rows * cols);
  float scale = 0;
  core::Fp8QuantizeOptions options;
  options.scheme = core::QuantScheme::kPerTensor;
  ASSERT_TRUE(core::QuantizeFp8(src->bytes.data(), src->dtype, rows, cols, options, q.data(),
                                &scale, src->name)
                  .ok());

  std::string weight;
  int messages = 0;
  ASSERT_TRUE(ReadTensorBytes(stub_.get(), "model.layers.0.mlp.down_proj.weight", &weight,
                              /*max_chunk_bytes=*/4096, &messages)
                  .ok());
  EXPECT_EQ(weight.size(), q.size());
  // Chunk sizes under kMinReadChunkBytes are raised to it.
  EXPECT_EQ(messages, static_cast<int>((q.size() + kMinReadChunkBytes - 1) / kMinReadChunkBytes));
  EXPECT_TRUE(std::equal(q.begin(), q.end(), reinterpret_cast<const uint8_t*>(weight.data())));
  std::string scale_bytes;
  ASSERT_TRUE(
      ReadTensorBytes(stub_.get(), "model.layers.0.mlp.down_proj.weight_scale", &scale_bytes).ok());
  ASSERT_EQ(scale_bytes.size(), sizeof(float));
  float served_scale = 0;
  std::memcpy(&served_scale, scale_bytes.data(), sizeof(float));
  EXPECT_EQ(served_scale, scale);
}

TEST_F(RefitServiceTest, ReadTensorFirstMessageCarriesInfoAndVersion) {
  grpc::ClientContext context;
  v1::ReadTensorRequest request;
  request.set_name("model.layers.1.mlp.down_proj.weight_scale");
  auto reader = stub_->ReadTensor(&context, request);
  v1::ReadTensorResponse response;
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.info().name(), "model.layers.1.mlp.down_proj.weight_scale");
  EXPECT_EQ(response.info().dtype(), v1::DTYPE_F32);
  EXPECT_EQ(response.info().layer(), "model.layers.1.mlp.down_proj");
  EXPECT_EQ(response.info().nbytes(), 4u);
  EXPECT_EQ(response.version(), 1u);
  while (reader->Read(&response)) {
  }
  EXPECT_TRUE(reader->Finish().ok());
}

TEST_F(RefitServiceTest, ReadTensorUnknownNameIsNotFound) {
  std::string bytes;
  grpc::Status status = ReadTensorBytes(stub_.get(), "model.layers.9.nope.weight", &bytes);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("model.layers.9.nope.weight"));
}

TEST_F(RefitServiceTest, FirstMessageNotBeginIsInvalidArgument) {
  std::vector<v1::PushRequest> messages = ChunkMessages(FixtureWeights(1));
  PushOutcome push = PushMessages(stub_.get(), {messages.front()});
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(push.status.error_message(), HasSubstr("first message of a Push must be Begin"));
  PushOutcome end_first = PushMessages(stub_.get(), {EndMessage()});
  EXPECT_EQ(end_first.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(RefitServiceTest, UnspecifiedCompletionModeIsInvalidArgument) {
  PushOutcome push =
      PushMessages(stub_.get(), {BeginMessage(v1::COMPLETION_MODE_UNSPECIFIED), EndMessage()});
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(push.status.error_message(), HasSubstr("COMPLETION_MODE_UNSPECIFIED"));
}

TEST_F(RefitServiceTest, UnspecifiedNonFinitePolicyIsInvalidArgument) {
  v1::PushRequest begin = BeginMessage();
  begin.mutable_begin()->mutable_options()->set_non_finite(v1::NON_FINITE_POLICY_UNSPECIFIED);
  PushOutcome push = PushMessages(stub_.get(), {begin, EndMessage()});
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(push.status.error_message(), HasSubstr("NON_FINITE_POLICY_UNSPECIFIED"));
}

TEST_F(RefitServiceTest, UnspecifiedDTypeIsInvalidArgumentAndAborts) {
  WatchStream watch(stub_.get());
  v1::PushRequest chunks = ChunkMessages(FixtureWeights(1)).front();
  chunks.mutable_chunks()->mutable_chunks(0)->set_dtype(v1::DTYPE_UNSPECIFIED);
  const std::string name = chunks.chunks().chunks(0).tensor_name();
  PushOutcome push = PushMessages(stub_.get(), {BeginMessage(), chunks, EndMessage()});
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(push.status.error_message(), HasSubstr("DTYPE_UNSPECIFIED"));
  EXPECT_THAT(push.status.error_message(), HasSubstr(name));
  EXPECT_EQ(watch.Next(v1::WatchEvent::TYPE_ABORTED).version(), 1u);
  EXPECT_EQ(Version(), 1u);
}

TEST_F(RefitServiceTest, UnknownTensorIsNotFoundAndVersionUnchanged) {
  const std::string fingerprint = Status(stub_.get()).fingerprint();
  core::OwnedTensor bogus{"model.layers.0.mlp.nonexistent.weight",
                          core::DType::kBFloat16,
                          {4},
                          std::vector<uint8_t>(8)};
  v1::PushRequest chunks;
  AddChunk(bogus, chunks.mutable_chunks());
  PushOutcome push = PushMessages(stub_.get(), {BeginMessage(), chunks, EndMessage()});
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(push.status.error_message(), HasSubstr("model.layers.0.mlp.nonexistent.weight"));
  const v1::GetStatusResponse after = Status(stub_.get());
  EXPECT_EQ(after.version(), 1u);
  EXPECT_EQ(after.fingerprint(), fingerprint);
}

TEST_F(RefitServiceTest, WrongShapeIsInvalidArgument) {
  std::vector<core::OwnedTensor> weights = FixtureWeights(1);
  core::OwnedTensor tensor = *Find(weights, "model.layers.0.mlp.down_proj.weight");
  std::swap(tensor.shape[0], tensor.shape[1]);
  v1::PushRequest chunks;
  AddChunk(tensor, chunks.mutable_chunks());
  PushOutcome push = PushMessages(stub_.get(), {BeginMessage(), chunks, EndMessage()});
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(push.status.error_message(), HasSubstr("model.layers.0.mlp.down_proj.weight"));
  EXPECT_THAT(push.status.error_message(), HasSubstr("shape"));
  EXPECT_EQ(Version(), 1u);
}

TEST_F(RefitServiceTest, IncompletePushFailsAtEndWithVersionUnchanged) {
  // q_proj without k_proj and v_proj: the fused layer misses whole tensors,
  // which the pusher must send (or ask to zero-fill).
  std::vector<core::OwnedTensor> weights = FixtureWeights(1);
  v1::PushRequest chunks;
  AddChunk(*Find(weights, "model.layers.0.self_attn.q_proj.weight"), chunks.mutable_chunks());
  PushOutcome push = PushMessages(stub_.get(), {BeginMessage(), chunks, EndMessage()});
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(push.status.error_message(), HasSubstr("layer \"model.layers.0.self_attn.qkv_proj"));
  EXPECT_THAT(push.status.error_message(), HasSubstr("is incomplete: no bytes for"));
  EXPECT_THAT(push.status.error_message(), HasSubstr("k_proj"));
  EXPECT_THAT(push.status.error_message(), HasSubstr("allow_partial_layers"));
  EXPECT_EQ(Version(), 1u);
  // The slot is free again.
  EXPECT_TRUE(PushMessages(stub_.get(), FullPush(2)).status.ok());
  EXPECT_EQ(Version(), 2u);
}

TEST_F(RefitServiceTest, TensorReceivedInPartIsDataLossAtEnd) {
  std::vector<core::OwnedTensor> weights = FixtureWeights(1);
  const core::OwnedTensor& down = *Find(weights, "model.layers.0.mlp.down_proj.weight");
  v1::PushRequest chunks;
  AddChunk(down, chunks.mutable_chunks());
  const size_t half = down.bytes.size() / 2;
  chunks.mutable_chunks()->mutable_chunks(0)->set_data(down.bytes.data(), half);
  PushOutcome push = PushMessages(stub_.get(), {BeginMessage(), chunks, EndMessage()});
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_THAT(push.status.error_message(),
              HasSubstr("tensor \"model.layers.0.mlp.down_proj.weight\" is incomplete"));
  EXPECT_THAT(push.status.error_message(),
              HasSubstr(absl::StrCat("received ", half, " of ", down.bytes.size(), " bytes")));
  EXPECT_EQ(Version(), 1u);
}

TEST_F(RefitServiceTest, StreamClosedWithoutEndIsAborted) {
  std::vector<v1::PushRequest> messages = ChunkMessages(FixtureWeights(1));
  PushOutcome push = PushMessages(stub_.get(), {BeginMessage(), messages.front()});
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(push.status.error_message(), HasSubstr("the stream ended without End"));
  EXPECT_EQ(Version(), 1u);
}

// A lost test-and-set: the pusher re-reads the version and retries, so the
// code is ABORTED (retry the transaction), not FAILED_PRECONDITION.
TEST_F(RefitServiceTest, BaseVersionMismatchIsAborted) {
  std::vector<v1::PushRequest> messages = FullPush(3);
  messages.front().mutable_begin()->mutable_options()->set_base_version(5);
  PushOutcome push = PushMessages(stub_.get(), messages);
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(push.status.error_message(), HasSubstr("base version 5"));
  EXPECT_THAT(push.status.error_message(), HasSubstr("serves version 1"));
  messages.front().mutable_begin()->mutable_options()->set_base_version(1);
  EXPECT_TRUE(PushMessages(stub_.get(), messages).status.ok());
}

TEST_F(RefitServiceTest, UnknownModelGroupIsNotFound) {
  v1::PushRequest begin = BeginMessage();
  begin.mutable_begin()->set_model_group("draft7");
  PushOutcome push = PushMessages(stub_.get(), {begin, EndMessage()});
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(push.status.error_message(), HasSubstr("draft7"));
  grpc::ClientContext context;
  v1::GetStatusRequest request;
  request.set_model_group("draft7");
  v1::GetStatusResponse response;
  EXPECT_EQ(stub_->GetStatus(&context, request, &response).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(RefitServiceTest, OversizedChunkIsRejected) {
  ServerOptions options = TestOptions(dir_);
  options.max_chunk_bytes = 1024;
  StartServer(options);
  std::vector<v1::PushRequest> messages = ChunkMessages(FixtureWeights(1));
  PushOutcome push = PushMessages(stub_.get(), {BeginMessage(), messages.front(), EndMessage()});
  // gRPC's receive limit (1 KiB + 1 MiB headroom) lets the message in; the
  // per-chunk check names the tensor.
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(push.status.error_message(), HasSubstr("--max-chunk-bytes"));
}

TEST_F(RefitServiceTest, MessageBeyondGrpcLimitIsResourceExhausted) {
  ServerOptions options = TestOptions(dir_);
  options.max_chunk_bytes = 1024;  // gRPC limit: 1 KiB + 1 MiB headroom
  StartServer(options);
  // 2 MiB of payload in one message (the tensor's own size does not matter:
  // gRPC refuses the message before the daemon looks at it).
  core::OwnedTensor big{"model.embed_tokens.weight",
                        core::DType::kBFloat16,
                        {1000, 128},
                        std::vector<uint8_t>(2 << 20)};
  v1::PushRequest chunks;
  AddChunk(big, chunks.mutable_chunks());
  PushOutcome push = PushMessages(stub_.get(), {BeginMessage(), chunks, EndMessage()});
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(Version(), 1u);
}

TEST_F(RefitServiceTest, SecondConcurrentPushIsAbortedNamingTheActiveRefit) {
  WatchStream watch(stub_.get());
  grpc::ClientContext first_context;
  v1::PushResponse first_response;
  auto first = stub_->Push(&first_context, &first_response);
  ASSERT_TRUE(first->Write(BeginMessage()));
  const std::string active = watch.Next(v1::WatchEvent::TYPE_STAGING_STARTED).refit_id();
  ASSERT_FALSE(active.empty());

  PushOutcome second = PushMessages(stub_.get(), FullPush(4));
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(second.status.error_message(), HasSubstr(active));

  for (const v1::PushRequest& m : ChunkMessages(FixtureWeights(4))) ASSERT_TRUE(first->Write(m));
  ASSERT_TRUE(first->Write(EndMessage()));
  first->WritesDone();
  ASSERT_TRUE(first->Finish().ok());
  EXPECT_EQ(first_response.result().refit_id(), active);
  EXPECT_EQ(Version(), 2u);
}

TEST_F(RefitServiceTest, ClientCancelMidStreamAbortsAndNextPushWorks) {
  const std::string fingerprint = Status(stub_.get()).fingerprint();
  WatchStream watch(stub_.get());
  {
    grpc::ClientContext context;
    v1::PushResponse response;
    auto writer = stub_->Push(&context, &response);
    ASSERT_TRUE(writer->Write(BeginMessage()));
    std::vector<v1::PushRequest> chunks = ChunkMessages(FixtureWeights(5));
    ASSERT_TRUE(writer->Write(chunks.front()));
    const std::string id = watch.Next(v1::WatchEvent::TYPE_STAGING_STARTED).refit_id();
    context.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
    const v1::WatchEvent aborted = watch.Next(v1::WatchEvent::TYPE_ABORTED);
    EXPECT_EQ(aborted.refit_id(), id);
    EXPECT_EQ(aborted.version(), 1u);
  }
  const v1::GetStatusResponse after = Status(stub_.get());
  EXPECT_EQ(after.version(), 1u);
  EXPECT_EQ(after.fingerprint(), fingerprint);
  EXPECT_TRUE(PushMessages(stub_.get(), FullPush(5)).status.ok());
  EXPECT_EQ(Version(), 2u);
}

// The idle tests run the daemon on a FakeClock: the timeout fires when the
// test moves the time past it, never because the machine was slow, and the
// test does not sleep for it.
TEST_F(RefitServiceTest, IdlePushIsAbortedWithDeadlineExceeded) {
  ServerOptions options = TestOptions(dir_);
  options.push_idle_timeout = absl::Seconds(60);
  options.clock = &clock_;
  StartServer(options);
  WatchStream watch(stub_.get());
  grpc::ClientContext context;
  v1::PushResponse response;
  auto writer = stub_->Push(&context, &response);
  // The stream's timer is armed when it opens; move the clock one second so
  // that the timer armed after Begin has a deadline of its own to wait for
  // (the staging_started event can reach us before the reactor re-arms).
  const absl::Time opened = clock_.Now();
  ASSERT_TRUE(clock_.AwaitWaiter(opened + absl::Seconds(60)));
  clock_.AdvanceTime(absl::Seconds(1));
  ASSERT_TRUE(writer->Write(BeginMessage()));
  const std::string id = watch.Next(v1::WatchEvent::TYPE_STAGING_STARTED).refit_id();
  // Send nothing more. The idle timer is armed for the timeout after Begin;
  // one step of the clock to that deadline ends the stream.
  ASSERT_TRUE(clock_.AwaitWaiter(opened + absl::Seconds(61)));
  clock_.AdvanceTime(absl::Seconds(60));
  grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(status.error_message(),
              HasSubstr(absl::StrCat("refit \"", id,
                                     "\" aborted: no message for 1m (--push-idle-timeout)")));
  const v1::WatchEvent aborted = watch.Next(v1::WatchEvent::TYPE_ABORTED);
  EXPECT_EQ(aborted.refit_id(), id);
  EXPECT_THAT(aborted.message(), HasSubstr("no message for 1m"));
  EXPECT_EQ(Version(), 1u);
  EXPECT_TRUE(PushMessages(stub_.get(), FullPush(6)).status.ok());
}

TEST_F(RefitServiceTest, IdleTimerRestartsWithEveryMessage) {
  ServerOptions options = TestOptions(dir_);
  options.push_idle_timeout = absl::Seconds(60);
  options.clock = &clock_;
  StartServer(options);
  WatchStream watch(stub_.get());
  grpc::ClientContext context;
  v1::PushResponse response;
  auto writer = stub_->Push(&context, &response);
  // As above: a distinct deadline for the timer armed after Begin.
  ASSERT_TRUE(clock_.AwaitWaiter(clock_.Now() + absl::Seconds(60)));
  clock_.AdvanceTime(absl::Seconds(1));
  ASSERT_TRUE(writer->Write(BeginMessage()));
  watch.Next(v1::WatchEvent::TYPE_STAGING_STARTED);
  const absl::Time begun = clock_.Now();
  ASSERT_TRUE(clock_.AwaitWaiter(begun + absl::Seconds(60)));
  clock_.AdvanceTime(absl::Seconds(40));
  for (const v1::PushRequest& chunk : ChunkMessages(FixtureWeights(9))) {
    ASSERT_TRUE(writer->Write(chunk));
  }
  // The chunks re-armed the timer from the time they arrived.
  ASSERT_TRUE(clock_.AwaitWaiter(begun + absl::Seconds(100)));
  // 80 s after Begin but 40 s after the last chunk: still within the timeout.
  clock_.AdvanceTime(absl::Seconds(40));
  ASSERT_TRUE(writer->Write(EndMessage()));
  writer->WritesDone();
  grpc::Status status = writer->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.result().state(), v1::REFIT_STATE_COMMITTED);
  EXPECT_EQ(Version(), 2u);
}

TEST_F(RefitServiceTest, FleetRefitOnADaemonInNoFleetIsFailedPrecondition) {
  std::vector<v1::PushRequest> messages = FullPush(8, v1::COMPLETION_MODE_PREPARE);
  messages[0].mutable_begin()->mutable_options()->set_fleet_refit_id("fleet-1");
  PushOutcome push = PushMessages(stub_.get(), messages);
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(push.status.error_message(), ::testing::HasSubstr("in no fleet"));
  EXPECT_EQ(Version(), 1u);
}

TEST_F(RefitServiceTest, PrepareThenCommit) {
  PushOutcome push = PushMessages(stub_.get(), FullPush(8, v1::COMPLETION_MODE_PREPARE));
  ASSERT_TRUE(push.status.ok()) << push.status.error_message();
  const std::string id = push.response.result().refit_id();
  EXPECT_EQ(push.response.result().state(), v1::REFIT_STATE_PREPARED);
  EXPECT_EQ(push.response.result().version(), 1u);
  const v1::GetStatusResponse prepared = Status(stub_.get());
  EXPECT_EQ(prepared.version(), 1u);
  EXPECT_TRUE(prepared.ready());
  EXPECT_EQ(prepared.active_refit().refit_id(), id);
  EXPECT_EQ(prepared.active_refit().state(), v1::REFIT_STATE_PREPARED);

  grpc::ClientContext context;
  v1::CommitRequest request;
  request.set_refit_id(id);
  v1::CommitResponse response;
  grpc::Status status = stub_->Commit(&context, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.result().state(), v1::REFIT_STATE_COMMITTED);
  EXPECT_EQ(response.result().version(), 2u);
  EXPECT_EQ(Version(), 2u);

  // A second commit of the same refit finds nothing.
  grpc::ClientContext again;
  EXPECT_EQ(stub_->Commit(&again, request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(RefitServiceTest, PrepareThenAbortKeepsVersion) {
  const std::string fingerprint = Status(stub_.get()).fingerprint();
  PushOutcome push = PushMessages(stub_.get(), FullPush(9, v1::COMPLETION_MODE_PREPARE));
  ASSERT_TRUE(push.status.ok()) << push.status.error_message();
  grpc::ClientContext context;
  v1::AbortRequest request;
  request.set_refit_id(push.response.result().refit_id());
  request.set_reason("test");
  v1::AbortResponse response;
  ASSERT_TRUE(stub_->Abort(&context, request, &response).ok());
  EXPECT_EQ(response.refit_id(), push.response.result().refit_id());
  EXPECT_EQ(response.version(), 1u);
  const v1::GetStatusResponse after = Status(stub_.get());
  EXPECT_EQ(after.version(), 1u);
  EXPECT_EQ(after.fingerprint(), fingerprint);
  EXPECT_FALSE(after.has_active_refit());
  EXPECT_TRUE(PushMessages(stub_.get(), FullPush(9)).status.ok());
}

// Holds the commit of the store's next refit right after its copy, where
// the commit delivers the store's events (the commit has not returned), until
// Release (or the end of the scope).
class HoldAfterCopy {
 public:
  explicit HoldAfterCopy(core::ShardStore* store) : store_(store) {
    listener_ = store_->AddListener([this](const core::StoreEvent& event) {
      if (event.type != core::StoreEventType::kCommitted || copied_.HasBeenNotified()) return;
      refit_id_ = event.refit_id;
      copied_.Notify();
      release_.WaitForNotification();
    });
  }
  ~HoldAfterCopy() {
    Release();
    store_->RemoveListener(listener_);
  }
  // The held refit's id, once its copy is done.
  const std::string& WaitForCopy() {
    copied_.WaitForNotification();
    return refit_id_;
  }
  void Release() {
    if (!release_.HasBeenNotified()) release_.Notify();
  }

 private:
  core::ShardStore* const store_;
  int listener_ = -1;
  std::string refit_id_;
  absl::Notification copied_, release_;
};

grpc::Status AbortRefit(v1::RefitService::Stub* stub, const std::string& refit_id) {
  grpc::ClientContext context;
  v1::AbortRequest request;
  request.set_refit_id(refit_id);
  v1::AbortResponse response;
  return stub->Abort(&context, request, &response);
}

TEST_F(RefitServiceTest, AnAbortThatComesOnceItsCommitCopiesSaysTheRefitWasCommitted) {
  PushOutcome push = PushMessages(stub_.get(), FullPush(8, v1::COMPLETION_MODE_PREPARE));
  ASSERT_TRUE(push.status.ok()) << push.status.error_message();
  const std::string id = push.response.result().refit_id();
  HoldAfterCopy hold(server_->default_group()->store());
  grpc::Status commit_status;
  v1::CommitResponse commit_response;
  std::thread committer([&] {
    grpc::ClientContext context;
    v1::CommitRequest request;
    request.set_refit_id(id);
    commit_status = stub_->Commit(&context, request, &commit_response);
  });
  ASSERT_EQ(hold.WaitForCopy(), id);
  const grpc::Status aborted = AbortRefit(stub_.get(), id);
  hold.Release();
  committer.join();
  EXPECT_EQ(aborted.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(aborted.error_message(), HasSubstr(absl::StrCat("refit \"", id, "\" was committed")));
  EXPECT_THAT(aborted.error_message(), HasSubstr("live version 2"));
  ASSERT_TRUE(commit_status.ok()) << commit_status.error_message();
  EXPECT_EQ(commit_response.result().version(), 2u);
  EXPECT_EQ(Version(), 2u);
  // The refit is gone: done, not aborted.
  EXPECT_EQ(AbortRefit(stub_.get(), id).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(RefitServiceTest, AnAbortOfAPushWhoseCommitCopiedSaysThePushWasCommitted) {
  HoldAfterCopy hold(server_->default_group()->store());
  PushOutcome push;
  std::thread pusher([&] { push = PushMessages(stub_.get(), FullPush(8)); });
  const std::string id = hold.WaitForCopy();
  const grpc::Status aborted = AbortRefit(stub_.get(), id);
  hold.Release();
  pusher.join();
  EXPECT_EQ(aborted.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(aborted.error_message(), HasSubstr(absl::StrCat("refit \"", id, "\" was committed")));
  // The push's own RPC keeps its result.
  ASSERT_TRUE(push.status.ok()) << push.status.error_message();
  EXPECT_EQ(push.response.result().version(), 2u);
  EXPECT_EQ(Version(), 2u);
}

TEST_F(RefitServiceTest, AClientThatCancelsItsPushOnceItsCommitCopiedLeavesItCommitted) {
  const std::string before = server_->metrics()->Render({});
  HoldAfterCopy hold(server_->default_group()->store());
  grpc::ClientContext context;
  v1::PushResponse response;
  grpc::Status pushed;
  std::thread pusher([&] {
    std::unique_ptr<grpc::ClientWriter<v1::PushRequest>> writer = stub_->Push(&context, &response);
    for (const v1::PushRequest& message : FullPush(8)) {
      if (!writer->Write(message)) break;
    }
    writer->WritesDone();
    pushed = writer->Finish();
  });
  hold.WaitForCopy();
  context.TryCancel();
  // The daemon learns of the cancel while the commit is held.
  absl::SleepFor(absl::Milliseconds(200));
  hold.Release();
  pusher.join();
  EXPECT_EQ(pushed.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(Version(), 2u);
  // Counted as what it was: committed, not aborted. The client's cancel
  // returned at once; the daemon ends the stream (and counts) once its
  // commit returns.
  const std::string committed = "refitd_refits_total{outcome=\"committed\"} 2\n";
  std::string metrics = server_->metrics()->Render({});
  for (int i = 0; i < 500 && !absl::StrContains(metrics, committed); ++i) {
    absl::SleepFor(absl::Milliseconds(20));
    metrics = server_->metrics()->Render({});
  }
  EXPECT_THAT(metrics, HasSubstr(committed));
  EXPECT_THAT(metrics, HasSubstr("refitd_refits_total{outcome=\"aborted\"} 0\n"));
  EXPECT_THAT(before, HasSubstr("refitd_refits_total{outcome=\"committed\"} 1\n"));
}

TEST_F(RefitServiceTest, CommitOfUnknownRefitIsNotFound) {
  grpc::ClientContext context;
  v1::CommitRequest request;
  request.set_refit_id("r-does-not-exist");
  v1::CommitResponse response;
  grpc::Status status = stub_->Commit(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("r-does-not-exist"));
}

TEST_F(RefitServiceTest, AbortWithNothingActiveIsNotFound) {
  grpc::ClientContext context;
  v1::AbortResponse response;
  EXPECT_EQ(stub_->Abort(&context, v1::AbortRequest(), &response).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(RefitServiceTest, CommitOfReceivingRefitIsFailedPrecondition) {
  WatchStream watch(stub_.get());
  grpc::ClientContext push_context;
  v1::PushResponse push_response;
  auto writer = stub_->Push(&push_context, &push_response);
  ASSERT_TRUE(writer->Write(BeginMessage()));
  const std::string id = watch.Next(v1::WatchEvent::TYPE_STAGING_STARTED).refit_id();
  grpc::ClientContext context;
  v1::CommitRequest request;
  request.set_refit_id(id);
  v1::CommitResponse response;
  EXPECT_EQ(stub_->Commit(&context, request, &response).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  push_context.TryCancel();
  writer->Finish();
}

TEST_F(RefitServiceTest, AbortRpcEndsARunningPush) {
  WatchStream watch(stub_.get());
  grpc::ClientContext push_context;
  v1::PushResponse push_response;
  auto writer = stub_->Push(&push_context, &push_response);
  ASSERT_TRUE(writer->Write(BeginMessage()));
  const std::string id = watch.Next(v1::WatchEvent::TYPE_STAGING_STARTED).refit_id();

  grpc::ClientContext context;
  v1::AbortRequest request;  // refit_id "": whatever is active
  request.set_reason("operator says no");
  v1::AbortResponse response;
  ASSERT_TRUE(stub_->Abort(&context, request, &response).ok());
  EXPECT_EQ(response.refit_id(), id);
  EXPECT_EQ(response.version(), 1u);

  grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(status.error_message(), HasSubstr(id));
  EXPECT_THAT(status.error_message(), HasSubstr("operator says no"));
  EXPECT_EQ(Version(), 1u);
  EXPECT_TRUE(PushMessages(stub_.get(), FullPush(10)).status.ok());
}

TEST_F(RefitServiceTest, GetStatusDescribesModelAndMemory) {
  const v1::GetStatusResponse status = Status(stub_.get());
  EXPECT_EQ(status.model_group(), "target");
  EXPECT_EQ(status.device(), "cpu");
  EXPECT_EQ(status.model().architecture(), "LlamaForCausalLM");
  EXPECT_EQ(status.model().num_layers(), 2u);
  EXPECT_EQ(status.model().tp_size(), 1u);
  EXPECT_EQ(status.model().quantization(), "per-tensor");
  EXPECT_EQ(status.model().checkpoint_dtype(), "BF16");
  EXPECT_GT(status.model().num_kernel_tensors(), 0u);
  EXPECT_EQ(status.memory().kernel_bytes(), status.model().kernel_bytes());
  EXPECT_EQ(status.memory().staging_budget_bytes(), uint64_t{4} << 30);
  EXPECT_GT(status.memory().resident_bytes(), 0u);
  EXPECT_GT(status.last_commit_unix_seconds(), 0);
  EXPECT_THAT(status.server_version(), HasSubstr("refitd"));
  EXPECT_EQ(status.fingerprint().size(), 16u);
}

TEST_F(RefitServiceTest, ListTensorsKernelAndCheckpointLayouts) {
  grpc::ClientContext kernel_context;
  v1::ListTensorsRequest request;
  request.set_layout(v1::ListTensorsRequest::LAYOUT_KERNEL);
  v1::ListTensorsResponse kernels;
  ASSERT_TRUE(stub_->ListTensors(&kernel_context, request, &kernels).ok());
  EXPECT_EQ(kernels.version(), 1u);
  EXPECT_EQ(static_cast<uint32_t>(kernels.tensors_size()),
            Status(stub_.get()).model().num_kernel_tensors());
  bool found_fp8 = false;
  for (const v1::TensorInfo& t : kernels.tensors()) {
    if (t.name() == "model.layers.0.mlp.down_proj.weight") {
      found_fp8 = true;
      EXPECT_EQ(t.dtype(), v1::DTYPE_F8_E4M3);
      EXPECT_EQ(t.layer(), "model.layers.0.mlp.down_proj");
      ASSERT_EQ(t.shape_size(), 2);
      EXPECT_EQ(t.nbytes(), static_cast<uint64_t>(t.shape(0) * t.shape(1)));
    }
  }
  EXPECT_TRUE(found_fp8);

  grpc::ClientContext checkpoint_context;
  request.set_layout(v1::ListTensorsRequest::LAYOUT_CHECKPOINT);
  v1::ListTensorsResponse checkpoint;
  ASSERT_TRUE(stub_->ListTensors(&checkpoint_context, request, &checkpoint).ok());
  const std::vector<core::OwnedTensor> weights = FixtureWeights(1);
  for (const core::OwnedTensor& w : weights) {
    bool listed = false;
    for (const v1::TensorInfo& t : checkpoint.tensors()) {
      if (t.name() != w.name) continue;
      listed = true;
      EXPECT_EQ(t.dtype(), v1::DTYPE_BF16) << w.name;
      EXPECT_EQ(std::vector<int64_t>(t.shape().begin(), t.shape().end()), w.shape) << w.name;
    }
    EXPECT_TRUE(listed) << w.name;
  }

  grpc::ClientContext bad_context;
  request.set_layout(v1::ListTensorsRequest::LAYOUT_UNSPECIFIED);
  v1::ListTensorsResponse bad;
  EXPECT_EQ(stub_->ListTensors(&bad_context, request, &bad).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(RefitServiceTest, WatchStartsWithSnapshotThenReportsARefit) {
  grpc::ClientContext context;
  auto reader = stub_->Watch(&context, v1::WatchRequest());
  v1::WatchEvent event;
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.type(), v1::WatchEvent::TYPE_SNAPSHOT);
  EXPECT_EQ(event.version(), 1u);
  EXPECT_EQ(event.model_group(), "target");
  EXPECT_EQ(event.fingerprint(), Status(stub_.get()).fingerprint());

  PushOutcome push = PushMessages(stub_.get(), FullPush(12));
  ASSERT_TRUE(push.status.ok());
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.type(), v1::WatchEvent::TYPE_STAGING_STARTED);
  EXPECT_EQ(event.refit_id(), push.response.result().refit_id());
  ASSERT_TRUE(reader->Read(&event));
  if (event.type() == v1::WatchEvent::TYPE_PREPARED) {
    ASSERT_TRUE(reader->Read(&event));
  }
  EXPECT_EQ(event.type(), v1::WatchEvent::TYPE_COMMITTED);
  EXPECT_EQ(event.version(), 2u);
  EXPECT_EQ(event.fingerprint(), push.response.result().fingerprint());
  context.TryCancel();
  while (reader->Read(&event)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

TEST_F(RefitServiceTest, AWatchThatIsNotReadEndsResourceExhaustedInsteadOfQueueingWithoutEnd) {
  // A small flow-control window: what the client does not read stays in the
  // daemon's queue after a few events.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  std::unique_ptr<v1::RefitService::Stub> watcher =
      v1::RefitService::NewStub(grpc::CreateCustomChannel(
          server_->bound_addresses().front(), grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext context;
  // Without the bound the stream would never end: DEADLINE_EXCEEDED then.
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = watcher->Watch(&context, v1::WatchRequest());
  v1::WatchEvent event;
  ASSERT_TRUE(reader->Read(&event));
  ASSERT_EQ(event.type(), v1::WatchEvent::TYPE_SNAPSHOT);
  // Refits that change nothing (no chunk), two events each, never read.
  const int refits = 1000;
  for (int i = 0; i < refits; ++i) {
    PushMessages(stub_.get(), {BeginMessage(), EndMessage()});
  }
  int read = 0;
  while (reader->Read(&event)) ++read;
  const grpc::Status ended = reader->Finish();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << ended.error_message();
  EXPECT_THAT(ended.error_message(), HasSubstr("the client did not read its stream"));
  EXPECT_LT(read, 2 * refits);
  // The daemon goes on serving.
  EXPECT_EQ(Status(stub_.get()).version(), 1u);
}

TEST_F(RefitServiceTest, ReloadOutsideRootIsPermissionDenied) {
  for (const std::string& path :
       {std::string("/etc"), dir_ + "/../", dir_ + "/missing", std::string("/no/such/dir")}) {
    grpc::ClientContext context;
    v1::ReloadRequest request;
    request.set_path(path);
    request.mutable_options()->set_completion(v1::COMPLETION_MODE_COMMIT);
    request.mutable_options()->set_non_finite(v1::NON_FINITE_POLICY_REJECT);
    auto reader = stub_->Reload(&context, request);
    v1::ReloadProgress progress;
    while (reader->Read(&progress)) {
    }
    grpc::Status status = reader->Finish();
    if (path == dir_ + "/missing") {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << path;
    } else {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << path;
      EXPECT_THAT(status.error_message(), HasSubstr("outside the reload root"));
    }
  }
  EXPECT_EQ(Version(), 1u);
}

TEST_F(RefitServiceTest, ReloadFromRootStreamsProgressAndCommits) {
  const std::string model_dir = dir_ + "/ckpt";
  ASSERT_TRUE(core::WriteFixtureModel(model_dir, core::FixtureConfig(), 21, 2).ok());
  grpc::ClientContext context;
  v1::ReloadRequest request;
  request.set_path(model_dir);
  request.mutable_options()->set_completion(v1::COMPLETION_MODE_COMMIT);
  request.mutable_options()->set_non_finite(v1::NON_FINITE_POLICY_REJECT);
  auto reader = stub_->Reload(&context, request);
  v1::ReloadProgress message;
  int progress = 0;
  v1::RefitResult result;
  while (reader->Read(&message)) {
    if (message.has_progress()) ++progress;
    if (message.has_result()) result = message.result();
  }
  grpc::Status status = reader->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_GE(progress, 1);
  EXPECT_EQ(result.state(), v1::REFIT_STATE_COMMITTED);
  EXPECT_EQ(result.version(), 2u);

  // The same weights pushed give the same fingerprint.
  PushOutcome push = PushMessages(stub_.get(), FullPush(21));
  ASSERT_TRUE(push.status.ok());
  EXPECT_EQ(push.response.result().fingerprint(), result.fingerprint());
}

TEST_F(RefitServiceTest, ReloadPrepareThenAbort) {
  const std::string model_dir = dir_ + "/ckpt2";
  ASSERT_TRUE(core::WriteFixtureModel(model_dir, core::FixtureConfig(), 22, 1).ok());
  grpc::ClientContext context;
  v1::ReloadRequest request;
  request.set_path(model_dir);
  request.mutable_options()->set_completion(v1::COMPLETION_MODE_PREPARE);
  request.mutable_options()->set_non_finite(v1::NON_FINITE_POLICY_REJECT);
  auto reader = stub_->Reload(&context, request);
  v1::ReloadProgress message;
  v1::RefitResult result;
  while (reader->Read(&message)) {
    if (message.has_result()) result = message.result();
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(result.state(), v1::REFIT_STATE_PREPARED);
  grpc::ClientContext abort_context;
  v1::AbortRequest abort;
  abort.set_refit_id(result.refit_id());
  v1::AbortResponse abort_response;
  ASSERT_TRUE(stub_->Abort(&abort_context, abort, &abort_response).ok());
  EXPECT_EQ(Version(), 1u);
}

TEST_F(RefitServiceTest, ReloadUnspecifiedCompletionIsInvalidArgument) {
  grpc::ClientContext context;
  v1::ReloadRequest request;
  request.set_path(dir_);
  request.mutable_options()->set_non_finite(v1::NON_FINITE_POLICY_REJECT);
  auto reader = stub_->Reload(&context, request);
  v1::ReloadProgress message;
  while (reader->Read(&message)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(RefitServiceTest, ShutdownAbortsAnActivePushAndKeepsVersion) {
  WatchStream watch(stub_.get());
  grpc::ClientContext context;
  v1::PushResponse response;
  auto writer = stub_->Push(&context, &response);
  ASSERT_TRUE(writer->Write(BeginMessage()));
  const std::string id = watch.Next(v1::WatchEvent::TYPE_STAGING_STARTED).refit_id();
  std::thread stopper([this] { server_->Shutdown(); });
  grpc::Status status = writer->Finish();
  stopper.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(status.error_message(), HasSubstr(id));
  EXPECT_THAT(status.error_message(), HasSubstr("shutting down"));
  EXPECT_EQ(server_->default_group()->store()->version(), 1u);
}

}  // namespace
}  // namespace refit::server
