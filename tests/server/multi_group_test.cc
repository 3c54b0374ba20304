// Several model groups in one daemon (a target and a draft of different
// shapes): each group's own version, refit slot, readiness and snapshots, and
// linked commits (CommitRequest.linked) that flip groups at one commit point
// or leave every group as it was.
#include <atomic>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "refit/v1/refit.grpc.pb.h"
#include "server/refit_server.h"
#include "server/server_options.h"
#include "tests/server/server_test_util.h"

namespace refit::server {
namespace {

using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;
using testing::ChunkMessages;
using testing::EndMessage;
using testing::FixtureWeights;
using testing::PushMessages;
using testing::PushOutcome;

// The target as a single-group daemon serves it, and a draft of other
// shapes: tensor parallel rank 0 of 2, block scales, other weights.
ServerOptions TwoGroups(const std::string& dir) {
  ServerOptions options = testing::TestOptions(dir);
  GroupOptions target;
  target.name = "target";
  GroupOptions draft;
  draft.name = "draft";
  draft.tp_size = 2;
  draft.quant = "block";
  draft.demo_seed = 7;
  options.groups = {target, draft};
  return options;
}

std::vector<v1::PushRequest> PushTo(const std::string& group, uint64_t seed,
                                    v1::CompletionMode mode) {
  std::vector<v1::PushRequest> messages = {testing::BeginMessage(mode)};
  messages[0].mutable_begin()->set_model_group(group);
  for (v1::PushRequest& m : ChunkMessages(FixtureWeights(seed))) messages.push_back(std::move(m));
  messages.push_back(EndMessage());
  return messages;
}

class MultiGroupTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(TwoGroups(dir_)); }

  void Start(ServerOptions options) {
    stub_.reset();
    server_.reset();
    absl::StatusOr<std::unique_ptr<RefitServer>> server = RefitServer::Start(std::move(options));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    channel_ = testing::Connect(*server_);
    stub_ = v1::RefitService::NewStub(channel_);
  }

  v1::GetStatusResponse StatusOf(const std::string& group) {
    grpc::ClientContext context;
    v1::GetStatusRequest request;
    request.set_model_group(group);
    v1::GetStatusResponse response;
    grpc::Status status = stub_->GetStatus(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }

  // A refit of `group` stopped at PREPARED; its id.
  std::string Prepare(const std::string& group, uint64_t seed, const std::string& token = "") {
    PushOutcome push =
        PushMessages(stub_.get(), PushTo(group, seed, v1::COMPLETION_MODE_PREPARE), token);
    EXPECT_TRUE(push.status.ok()) << group << ": " << push.status.error_message();
    EXPECT_EQ(push.response.result().state(), v1::REFIT_STATE_PREPARED);
    return push.response.result().refit_id();
  }

  grpc::Status Commit(const std::string& group, const std::string& id,
                      const std::vector<std::pair<std::string, std::string>>& linked,
                      v1::CommitResponse* response, const std::string& token = "") {
    grpc::ClientContext context;
    if (!token.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    v1::CommitRequest request;
    request.set_model_group(group);
    request.set_refit_id(id);
    for (const auto& [g, refit] : linked) {
      v1::RefitRef* ref = request.add_linked();
      ref->set_model_group(g);
      ref->set_refit_id(refit);
    }
    return stub_->Commit(&context, request, response);
  }

  grpc::Status Abort(const std::string& group, const std::string& id) {
    grpc::ClientContext context;
    v1::AbortRequest request;
    request.set_model_group(group);
    request.set_refit_id(id);
    v1::AbortResponse response;
    return stub_->Abort(&context, request, &response);
  }

  // Both groups as one GetStatus (all_groups) sees them.
  std::pair<uint64_t, uint64_t> Versions() {
    grpc::ClientContext context;
    v1::GetStatusRequest request;
    request.set_all_groups(true);
    v1::GetStatusResponse response;
    grpc::Status status = stub_->GetStatus(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    uint64_t target = 0, draft = 0;
    for (const v1::GetStatusResponse& g : response.groups()) {
      if (g.model_group() == "target") target = g.version();
      if (g.model_group() == "draft") draft = g.version();
    }
    return {target, draft};
  }

  // The refit holding `group`'s slot ("" when idle).
  std::string ActiveRefit(const std::string& group) {
    return StatusOf(group).active_refit().refit_id();
  }

  std::string dir_ = testing::MakeTempDir();
  std::unique_ptr<RefitServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::RefitService::Stub> stub_;
};

TEST_F(MultiGroupTest, EachGroupServesItsOwnLayout) {
  const v1::GetStatusResponse target = StatusOf("");
  const v1::GetStatusResponse draft = StatusOf("draft");
  EXPECT_EQ(target.model_group(), "target");  // the default group is the first
  EXPECT_EQ(draft.model_group(), "draft");
  EXPECT_EQ(target.version(), 1u);
  EXPECT_EQ(draft.version(), 1u);
  EXPECT_EQ(target.model().tp_size(), 1u);
  EXPECT_EQ(draft.model().tp_size(), 2u);
  EXPECT_EQ(draft.model().quantization(), "block");
  EXPECT_LT(draft.model().kernel_bytes(), target.model().kernel_bytes());
  EXPECT_NE(draft.fingerprint(), target.fingerprint());

  grpc::ClientContext context;
  v1::GetStatusRequest request;
  request.set_model_group("nope");
  v1::GetStatusResponse response;
  grpc::Status unknown = stub_->GetStatus(&context, request, &response);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(unknown.error_message(), "\"nope\"")) << unknown.error_message();
}

TEST_F(MultiGroupTest, AllGroupsStatusListsTheDefaultGroupFirst) {
  grpc::ClientContext context;
  v1::GetStatusRequest request;
  request.set_all_groups(true);
  v1::GetStatusResponse response;
  ASSERT_TRUE(stub_->GetStatus(&context, request, &response).ok());
  EXPECT_EQ(response.model_group(), "target");
  ASSERT_EQ(response.groups_size(), 2);
  EXPECT_EQ(response.groups(0).model_group(), "target");
  EXPECT_EQ(response.groups(1).model_group(), "draft");
  EXPECT_EQ(response.groups(1).model().tp_size(), 2u);
  EXPECT_TRUE(response.groups(1).ready());
  // Without all_groups: one group, no list.
  EXPECT_EQ(StatusOf("draft").groups_size(), 0);
}

TEST_F(MultiGroupTest, RefitsOfTwoGroupsAreIndependent) {
  // Both slots held at once: each group has its own.
  const std::string target_id = Prepare("target", 2);
  PushOutcome draft = PushMessages(stub_.get(), PushTo("draft", 3, v1::COMPLETION_MODE_COMMIT));
  ASSERT_TRUE(draft.status.ok()) << draft.status.error_message();
  EXPECT_EQ(draft.response.result().version(), 2u);
  EXPECT_EQ(StatusOf("target").version(), 1u);
  EXPECT_EQ(ActiveRefit("target"), target_id);
  EXPECT_EQ(ActiveRefit("draft"), "");

  ASSERT_TRUE(Abort("target", target_id).ok());
  EXPECT_EQ(StatusOf("target").version(), 1u);
  EXPECT_EQ(StatusOf("draft").version(), 2u);
}

TEST_F(MultiGroupTest, LinkedCommitFlipsBothGroups) {
  const std::string before_target = StatusOf("target").fingerprint();
  const std::string before_draft = StatusOf("draft").fingerprint();
  const std::string target_id = Prepare("target", 2);
  const std::string draft_id = Prepare("draft", 3);
  v1::CommitResponse response;
  grpc::Status status = Commit("target", target_id, {{"draft", draft_id}}, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.result().refit_id(), target_id);
  EXPECT_EQ(response.result().state(), v1::REFIT_STATE_COMMITTED);
  EXPECT_EQ(response.result().version(), 2u);
  ASSERT_EQ(response.linked_size(), 1);
  EXPECT_EQ(response.linked(0).refit_id(), draft_id);
  EXPECT_EQ(response.linked(0).version(), 2u);

  const v1::GetStatusResponse target = StatusOf("target");
  const v1::GetStatusResponse draft = StatusOf("draft");
  EXPECT_EQ(target.version(), 2u);
  EXPECT_EQ(draft.version(), 2u);
  EXPECT_EQ(target.fingerprint(), response.result().fingerprint());
  EXPECT_EQ(draft.fingerprint(), response.linked(0).fingerprint());
  EXPECT_NE(target.fingerprint(), before_target);
  EXPECT_NE(draft.fingerprint(), before_draft);
  EXPECT_EQ(ActiveRefit("target"), "");
  EXPECT_EQ(ActiveRefit("draft"), "");
}

TEST_F(MultiGroupTest, AnAbortOfTheDraftJustBeforeTheLinkedCommitRunsAbortsBothRefits) {
  const std::string target_id = Prepare("target", 2);
  const std::string draft_id = Prepare("draft", 3);
  // The Abort comes once the Commit holds both refits, before it starts:
  // the draft's refit is aborted, and the commit must not leave the
  // target's PREPARED as if nothing happened.
  grpc::Status aborted;
  server_->service()->SetCommitHookForTesting(
      [&](RefitServiceImpl::CommitStage stage, const std::string&) {
        if (stage == RefitServiceImpl::CommitStage::kTaken) aborted = Abort("draft", draft_id);
      });
  v1::CommitResponse response;
  const grpc::Status status = Commit("target", target_id, {{"draft", draft_id}}, &response);
  server_->service()->SetCommitHookForTesting(nullptr);
  ASSERT_TRUE(aborted.ok()) << aborted.error_message();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED) << status.error_message();
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("an Abort asked for one of its refits"));
  EXPECT_EQ(Versions(), std::make_pair(uint64_t{1}, uint64_t{1}));
  EXPECT_EQ(ActiveRefit("target"), "");
  EXPECT_EQ(ActiveRefit("draft"), "");
  EXPECT_EQ(Abort("target", target_id).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Abort("draft", draft_id).error_code(), grpc::StatusCode::NOT_FOUND);
  // Each refit is counted once, as aborted.
  const std::string metrics = server_->metrics()->Render({});
  EXPECT_THAT(metrics, ::testing::HasSubstr("refitd_refits_total{outcome=\"aborted\"} 2\n"));
  EXPECT_THAT(metrics, ::testing::HasSubstr("refitd_refits_total{outcome=\"failed\"} 0\n"));
  // Both groups take their next refits.
  v1::CommitResponse next;
  ASSERT_TRUE(Commit("target", Prepare("target", 4), {{"draft", Prepare("draft", 5)}}, &next).ok());
  EXPECT_EQ(Versions(), std::make_pair(uint64_t{2}, uint64_t{2}));
}

TEST_F(MultiGroupTest, ReadersNeverSeeOneGroupFlippedWithoutTheOther) {
  std::atomic<bool> done{false};
  std::atomic<int> mixed{0};
  std::atomic<int> reads{0};
  std::thread reader([&] {
    auto stub = v1::RefitService::NewStub(channel_);
    while (!done.load()) {
      grpc::ClientContext context;
      v1::GetStatusRequest request;
      request.set_all_groups(true);
      v1::GetStatusResponse response;
      if (!stub->GetStatus(&context, request, &response).ok()) continue;
      if (response.groups_size() == 2 &&
          response.groups(0).version() != response.groups(1).version()) {
        ++mixed;
      }
      ++reads;
    }
  });
  for (uint64_t round = 0; round < 4; ++round) {
    const std::string target_id = Prepare("target", 10 + round);
    const std::string draft_id = Prepare("draft", 20 + round);
    v1::CommitResponse response;
    grpc::Status status = Commit("draft", draft_id, {{"target", target_id}}, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  done.store(true);
  reader.join();
  EXPECT_EQ(mixed.load(), 0);
  EXPECT_GT(reads.load(), 0);
  EXPECT_EQ(Versions(), std::make_pair(uint64_t{5}, uint64_t{5}));
}

TEST_F(MultiGroupTest, LinkedCommitOfAnUnknownRefitChangesNothing) {
  const std::string target_id = Prepare("target", 2);
  v1::CommitResponse response;
  grpc::Status status = Commit("target", target_id, {{"draft", "no-such-refit"}}, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "model group \"draft\""))
      << status.error_message();
  EXPECT_EQ(Versions(), std::make_pair(uint64_t{1}, uint64_t{1}));
  // The target's refit is still PREPARED: it can be committed alone.
  EXPECT_EQ(ActiveRefit("target"), target_id);
  ASSERT_TRUE(Commit("target", target_id, {}, &response).ok());
  EXPECT_EQ(Versions(), std::make_pair(uint64_t{2}, uint64_t{1}));
}

TEST_F(MultiGroupTest, LinkedCommitOfAnUnknownGroupChangesNothing) {
  const std::string target_id = Prepare("target", 2);
  v1::CommitResponse response;
  grpc::Status status = Commit("target", target_id, {{"eagle", "x"}}, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "\"eagle\"")) << status.error_message();
  EXPECT_EQ(ActiveRefit("target"), target_id);
  EXPECT_EQ(Versions(), std::make_pair(uint64_t{1}, uint64_t{1}));
}

TEST_F(MultiGroupTest, LinkedCommitNamingAGroupTwiceIsRefused) {
  const std::string target_id = Prepare("target", 2);
  v1::CommitResponse response;
  grpc::Status status = Commit("target", target_id, {{"target", target_id}}, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "\"target\" is named twice"))
      << status.error_message();
  EXPECT_EQ(ActiveRefit("target"), target_id);
  EXPECT_EQ(Versions(), std::make_pair(uint64_t{1}, uint64_t{1}));
}

TEST_F(MultiGroupTest, LinkedCommitOfARefitStillReceivingChangesNothing) {
  const std::string target_id = Prepare("target", 2);
  // Watch the draft, so that its refit's start can be waited for.
  grpc::ClientContext watch_context;
  v1::WatchRequest watch_request;
  watch_request.set_model_group("draft");
  std::unique_ptr<grpc::ClientReader<v1::WatchEvent>> watch =
      stub_->Watch(&watch_context, watch_request);
  v1::WatchEvent event;
  ASSERT_TRUE(watch->Read(&event));
  ASSERT_EQ(event.type(), v1::WatchEvent::TYPE_SNAPSHOT);
  // The draft's stream is open: Begin and one message of chunks, no End.
  grpc::ClientContext stream_context;
  v1::PushResponse stream_response;
  std::unique_ptr<grpc::ClientWriter<v1::PushRequest>> writer =
      stub_->Push(&stream_context, &stream_response);
  std::vector<v1::PushRequest> messages = PushTo("draft", 3, v1::COMPLETION_MODE_PREPARE);
  ASSERT_TRUE(writer->Write(messages[0]));
  ASSERT_TRUE(writer->Write(messages[1]));
  // "staging started" goes out once the refit is registered.
  ASSERT_TRUE(watch->Read(&event));
  ASSERT_EQ(event.type(), v1::WatchEvent::TYPE_STAGING_STARTED);
  ASSERT_EQ(event.model_group(), "draft");
  const std::string draft_id = event.refit_id();
  ASSERT_FALSE(draft_id.empty());
  watch_context.TryCancel();
  while (watch->Read(&event)) {
  }
  watch->Finish();

  v1::CommitResponse response;
  grpc::Status status = Commit("target", target_id, {{"draft", draft_id}}, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "model group \"draft\""))
      << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "still receiving"))
      << status.error_message();
  EXPECT_EQ(ActiveRefit("target"), target_id);
  EXPECT_EQ(ActiveRefit("draft"), draft_id);
  EXPECT_EQ(Versions(), std::make_pair(uint64_t{1}, uint64_t{1}));

  // Once the draft is PREPARED the same commit goes through.
  for (size_t i = 2; i < messages.size(); ++i) ASSERT_TRUE(writer->Write(messages[i]));
  writer->WritesDone();
  ASSERT_TRUE(writer->Finish().ok());
  ASSERT_TRUE(Commit("target", target_id, {{"draft", draft_id}}, &response).ok());
  EXPECT_EQ(Versions(), std::make_pair(uint64_t{2}, uint64_t{2}));
}

TEST_F(MultiGroupTest, BadChunkForTheDraftLeavesBothGroupsUnchanged) {
  const std::string target_id = Prepare("target", 2);
  // The draft's push carries a chunk whose checksum does not match.
  std::vector<v1::PushRequest> messages = PushTo("draft", 3, v1::COMPLETION_MODE_PREPARE);
  messages[1].mutable_chunks()->mutable_chunks(0)->set_xxh3(12345);
  PushOutcome draft = PushMessages(stub_.get(), messages);
  EXPECT_EQ(draft.status.error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_EQ(ActiveRefit("draft"), "");
  // The draft's refit is gone: the linked commit cannot happen, and the
  // target stays as it was, PREPARED for the caller to abort (what
  // `refitctl push --link` and the Python client do) or commit alone.
  v1::CommitResponse response;
  grpc::Status status = Commit("target", target_id, {{"draft", ""}}, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "model group \"draft\""))
      << status.error_message();
  EXPECT_EQ(Versions(), std::make_pair(uint64_t{1}, uint64_t{1}));
  ASSERT_TRUE(Abort("target", target_id).ok());
  EXPECT_EQ(ActiveRefit("target"), "");
  EXPECT_EQ(Versions(), std::make_pair(uint64_t{1}, uint64_t{1}));
}

TEST_F(MultiGroupTest, StaleBaseVersionOfTheDraftLeavesBothGroupsUnchanged) {
  const std::string target_id = Prepare("target", 2);
  std::vector<v1::PushRequest> messages = PushTo("draft", 3, v1::COMPLETION_MODE_PREPARE);
  messages[0].mutable_begin()->mutable_options()->set_base_version(7);
  PushOutcome draft = PushMessages(stub_.get(), messages);
  EXPECT_EQ(draft.status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_TRUE(absl::StrContains(draft.status.error_message(), "model group \"draft\""))
      << draft.status.error_message();
  EXPECT_EQ(ActiveRefit("target"), target_id);
  EXPECT_EQ(Versions(), std::make_pair(uint64_t{1}, uint64_t{1}));
}

TEST_F(MultiGroupTest, EachGroupHasItsOwnReadinessService) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  for (const std::string service : {"", "refit.v1.RefitService", "refit.v1.RefitService/target",
                                    "refit.v1.RefitService/draft"}) {
    grpc::ClientContext context;
    HealthCheckRequest request;
    request.set_service(service);
    HealthCheckResponse response;
    grpc::Status status = health->Check(&context, request, &response);
    ASSERT_TRUE(status.ok()) << service << ": " << status.error_message();
    EXPECT_EQ(response.status(), HealthCheckResponse::SERVING) << service;
  }
  grpc::ClientContext context;
  HealthCheckRequest request;
  request.set_service("refit.v1.RefitService/eagle");
  HealthCheckResponse response;
  EXPECT_EQ(health->Check(&context, request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(MultiGroupTest, EachGroupRecoversItsOwnSnapshot) {
  ServerOptions options = TwoGroups(dir_);
  options.state_dir = dir_ + "/state";
  Start(options);
  const std::string target_id = Prepare("target", 2);
  const std::string draft_id = Prepare("draft", 3);
  v1::CommitResponse response;
  ASSERT_TRUE(Commit("target", target_id, {{"draft", draft_id}}, &response).ok());
  PushOutcome draft = PushMessages(stub_.get(), PushTo("draft", 4, v1::COMPLETION_MODE_COMMIT));
  ASSERT_TRUE(draft.status.ok()) << draft.status.error_message();
  const std::string target_fingerprint = StatusOf("target").fingerprint();
  const std::string draft_fingerprint = StatusOf("draft").fingerprint();
  server_->Shutdown();  // writes the pending snapshots

  // The default group where a single-group daemon keeps its snapshots, the
  // draft in its own directory.
  EXPECT_TRUE(
      std::ifstream(dir_ + "/state/groups/draft/snapshot-00000000000000000003.refit").good());
  EXPECT_TRUE(std::ifstream(dir_ + "/state/snapshot-00000000000000000002.refit").good());
  Start(options);
  EXPECT_EQ(StatusOf("target").version(), 2u);
  EXPECT_EQ(StatusOf("target").fingerprint(), target_fingerprint);
  EXPECT_EQ(StatusOf("draft").version(), 3u);
  EXPECT_EQ(StatusOf("draft").fingerprint(), draft_fingerprint);
}

TEST_F(MultiGroupTest, LinkedCommitOfAnotherClientsRefitIsRefused) {
  {
    std::ofstream tokens(dir_ + "/tokens");
    tokens << "alice-token trainer alice\nbob-token trainer bob\nreader-token reader\n";
  }
  ServerOptions options = TwoGroups(dir_);
  options.auth_tokens_file = dir_ + "/tokens";
  Start(options);
  const std::string target_id = Prepare("target", 2, "alice-token");
  const std::string draft_id = Prepare("draft", 3, "bob-token");
  v1::CommitResponse response;
  grpc::Status status =
      Commit("target", target_id, {{"draft", draft_id}}, &response, "alice-token");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "model group \"draft\""))
      << status.error_message();
  // Both still PREPARED, versions unchanged.
  grpc::ClientContext context;
  context.AddMetadata("authorization", "Bearer reader-token");
  v1::GetStatusRequest request;
  request.set_all_groups(true);
  v1::GetStatusResponse all;
  ASSERT_TRUE(stub_->GetStatus(&context, request, &all).ok());
  ASSERT_EQ(all.groups_size(), 2);
  EXPECT_EQ(all.groups(0).version(), 1u);
  EXPECT_EQ(all.groups(1).version(), 1u);
  EXPECT_EQ(all.groups(0).active_refit().refit_id(), target_id);
  EXPECT_EQ(all.groups(1).active_refit().refit_id(), draft_id);
}

}  // namespace
}  // namespace refit::server
