// EngineService.Attach against an in-process refitd: the manifest, the
// descriptor handover (one-time ticket, read-only memfd, peer credentials in
// GetStatus), the refusals (TCP, layout mismatch, a first message that is not
// attach), and commit coordination in every branch: acked, never acked for a
// one-phase push (ABORTED naming the engine) and for a PREPARED refit
// (DEADLINE_EXCEEDED, stays PREPARED), and an engine that detaches released.
#include "server/attach_service.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/generic/generic_stub.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/arena.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "refit/v1/engine.grpc.pb.h"
#include "tests/server/server_test_util.h"

namespace refit::server::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Redeems `ticket` at the descriptor socket: the fd, or -1 and the daemon's
// refusal in *error.
int ReceiveFd(const std::string& path, const std::string& ticket, std::string* error) {
  std::vector<int> fds = ReceiveFds(path, ticket, error);
  if (fds.empty()) return -1;
  for (size_t i = 1; i < fds.size(); ++i) ::close(fds[i]);
  return fds[0];
}

// One engine's Attach stream.
class Engine {
 public:
  Engine(v1::EngineService::Stub* stub, bool coordinate, v1::EngineLayout expect = {},
         const std::string& name = "test-engine") {
    stream_ = stub->Attach(&context_);
    v1::EngineMessage first;
    first.mutable_attach()->set_coordinate(coordinate);
    first.mutable_attach()->set_engine_name(name);
    *first.mutable_attach()->mutable_expect() = std::move(expect);
    stream_->Write(first);
  }
  ~Engine() { Close(); }

  bool Read(v1::DaemonMessage* message) { return stream_->Read(message); }
  void Quiesced(const v1::CommitPending& pending) {
    v1::EngineMessage ack;
    ack.mutable_quiesced()->set_refit_id(pending.refit_id());
    ack.mutable_quiesced()->set_version(pending.version());
    ack.mutable_quiesced()->set_attempt(pending.attempt());
    stream_->Write(ack);
  }
  grpc::Status Close() {
    if (closed_) return status_;
    closed_ = true;
    stream_->WritesDone();
    v1::DaemonMessage rest;
    while (stream_->Read(&rest)) {
    }
    status_ = stream_->Finish();
    return status_;
  }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::EngineMessage, v1::DaemonMessage>> stream_;
  bool closed_ = false;
  grpc::Status status_;
};

class AttachTest : public ServerTest {
 protected:
  void SetUp() override {
    ServerOptions options = TestOptions(dir_);
    options.engine_quiesce_timeout = absl::Milliseconds(200);
    StartServer(std::move(options));
    engine_stub_ = v1::EngineService::NewStub(Connect(*server_));
  }

  v1::Attached AttachOne(Engine& engine) {
    v1::DaemonMessage message;
    EXPECT_TRUE(engine.Read(&message));
    EXPECT_TRUE(message.has_attached());
    return message.attached();
  }

  std::unique_ptr<v1::EngineService::Stub> engine_stub_;
};

TEST_F(AttachTest, ManifestDescribesEveryKernelAndTheTicketGivesAReadOnlyMemfdOnce) {
  Engine engine(engine_stub_.get(), /*coordinate=*/false);
  const v1::Attached a = AttachOne(engine);
  EXPECT_EQ(a.engine_id(), "e-1");
  EXPECT_EQ(a.model_group(), "target");
  EXPECT_EQ(a.version(), 1u);
  EXPECT_EQ(a.fingerprint(), Status(stub_.get()).fingerprint());
  EXPECT_EQ(a.layout().architecture(), "LlamaForCausalLM");
  EXPECT_EQ(a.layout().quantization(), "per-tensor");
  EXPECT_EQ(a.fd_socket(), absl::StrCat(dir_, "/refitd.sock.fd"));
  ASSERT_EQ(a.regions_size(), 1);
  EXPECT_EQ(a.regions(0).kind(), v1::ArenaRegion::KIND_HOST_MEMFD);
  EXPECT_EQ(a.regions(0).data_offset(), static_cast<uint64_t>(core::kArenaDataOffset));
  const core::ShardStore* store = server_->default_group()->store();
  ASSERT_EQ(a.tensors_size(), static_cast<int>(store->Kernels().size()));
  const v1::ArenaTensor& qkv = a.tensors(2);
  EXPECT_EQ(qkv.name(), "model.layers.0.self_attn.qkv_proj.weight");
  EXPECT_EQ(qkv.dtype(), "float8_e4m3fn");
  EXPECT_THAT(qkv.shape(), ::testing::ElementsAre(256, 128));
  EXPECT_THAT(qkv.strides(), ::testing::ElementsAre(128, 1));
  EXPECT_EQ(qkv.byte_offset() % core::kArenaAlign, 0u);

  std::string error;
  int fd = ReceiveFd(a.fd_socket(), a.ticket(), &error);
  ASSERT_GE(fd, 0) << error;
  const size_t length = a.regions(0).bytes();
  EXPECT_EQ(::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0), MAP_FAILED);
  void* p = ::mmap(nullptr, length, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  ::close(fd);
  const auto* header = static_cast<const core::ArenaHeader*>(p);
  EXPECT_EQ(std::string(header->magic, 8), "REFITAR1");
  EXPECT_EQ(header->version.load(), 1u);
  std::string live;
  ASSERT_TRUE(store->ReadKernel(qkv.name(), &live, nullptr).ok());
  EXPECT_EQ(std::string(static_cast<const char*>(p) + core::kArenaDataOffset + qkv.byte_offset(),
                        qkv.nbytes()),
            live);
  ::munmap(p, length);

  // Once only.
  EXPECT_EQ(ReceiveFd(a.fd_socket(), a.ticket(), &error), -1);
  EXPECT_THAT(error, HasSubstr("unknown attach ticket"));

  const v1::GetStatusResponse status = Status(stub_.get());
  ASSERT_EQ(status.engines_size(), 1);
  EXPECT_EQ(status.engines(0).engine_id(), "e-1");
  EXPECT_EQ(status.engines(0).pid(), ::getpid());
  EXPECT_EQ(status.engines(0).uid(), ::getuid());
  EXPECT_FALSE(status.engines(0).coordinated());
  EXPECT_TRUE(engine.Close().ok());
}

TEST_F(AttachTest, AttachBeforeTheFirstVersionIsUnavailableAndWorksOnceItIsServed) {
  // Listening, first load not done: the arena holds zeros, not weights.
  server_.reset();
  absl::StatusOr<std::unique_ptr<RefitServer>> loading = RefitServer::Create(TestOptions(dir_));
  ASSERT_TRUE(loading.ok()) << loading.status();
  server_ = std::move(*loading);
  engine_stub_ = v1::EngineService::NewStub(Connect(*server_));
  for (bool coordinate : {false, true}) {
    Engine early(engine_stub_.get(), coordinate);
    v1::DaemonMessage message;
    EXPECT_FALSE(early.Read(&message)) << message.DebugString();
    const grpc::Status status = early.Close();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(status.error_message(),
                HasSubstr("model group \"target\" serves no version yet (its first load is "
                          "under way): attach once refitd is ready"));
  }
  ASSERT_TRUE(server_->LoadInitialModel().ok());
  Engine engine(engine_stub_.get(), /*coordinate=*/true);
  EXPECT_EQ(AttachOne(engine).version(), 1u);
}

TEST_F(AttachTest, AttachOverTcpIsFailedPrecondition) {
  ServerOptions options = TestOptions(dir_);
  options.listen.push_back("127.0.0.1:0");
  StartServer(std::move(options));
  auto tcp = v1::EngineService::NewStub(
      grpc::CreateChannel(server_->bound_addresses().back(), grpc::InsecureChannelCredentials()));
  Engine engine(tcp.get(), true);
  v1::DaemonMessage message;
  EXPECT_FALSE(engine.Read(&message));
  const grpc::Status status = engine.Close();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("attach needs a local Unix socket"));
}

TEST_F(AttachTest, LayoutMismatchIsFailedPreconditionNamingTheFields) {
  v1::EngineLayout expect;
  expect.set_tp_size(2);
  expect.set_quantization("block");
  expect.set_architecture("LlamaForCausalLM");  // the same: not named
  Engine engine(engine_stub_.get(), true, expect);
  v1::DaemonMessage message;
  EXPECT_FALSE(engine.Read(&message));
  const grpc::Status status = engine.Close();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("tp_size (engine expects 2, daemon serves 1)"));
  EXPECT_THAT(status.error_message(), HasSubstr("quantization (engine expects \"block\""));
  EXPECT_THAT(status.error_message(), ::testing::Not(HasSubstr("architecture")));
  EXPECT_THAT(status.error_message(), ::testing::Not(HasSubstr("tp_rank")));
  EXPECT_EQ(Status(stub_.get()).engines_size(), 0);
}

TEST_F(AttachTest, CoordinatedEngineQuiescesThenIsToldOfTheCommit) {
  Engine engine(engine_stub_.get(), /*coordinate=*/true);
  AttachOne(engine);
  std::thread pusher([&] {
    const PushOutcome outcome = PushMessages(stub_.get(), FullPush(2));
    EXPECT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  });
  v1::DaemonMessage message;
  ASSERT_TRUE(engine.Read(&message));
  ASSERT_TRUE(message.has_commit_pending());
  EXPECT_EQ(message.commit_pending().version(), 2u);
  // Not copied before the ack.
  EXPECT_EQ(server_->default_group()->store()->version(), 1u);
  engine.Quiesced(message.commit_pending());
  ASSERT_TRUE(engine.Read(&message));
  ASSERT_TRUE(message.has_committed());
  EXPECT_EQ(message.committed().version(), 2u);
  pusher.join();
  EXPECT_EQ(message.committed().fingerprint(), Status(stub_.get()).fingerprint());
  EXPECT_EQ(Status(stub_.get()).engines(0).version(), 2u);
  EXPECT_EQ(Status(stub_.get()).engines(0).name(), "test-engine");
  // Its pause is one observation, ended by the commit.
  const std::string metrics = server_->metrics()->Render({});
  EXPECT_THAT(metrics, HasSubstr("refitd_engine_pause_seconds_count{outcome=\"committed\"} 1\n"));
  EXPECT_THAT(metrics, HasSubstr("refitd_engine_pause_seconds_count{outcome=\"aborted\"} 0\n"));
}

TEST_F(AttachTest, AnEngineHeldByACommitThatIsAbortedHasItsPauseCounted) {
  // One engine acks, the other never does: the push is aborted at the
  // timeout, and the first engine was paused from its ack until Aborted.
  // A timeout long enough for the ack to beat it on a slow (sanitized) build.
  ServerOptions options = TestOptions(dir_);
  options.engine_quiesce_timeout = absl::Seconds(2);
  StartServer(std::move(options));
  engine_stub_ = v1::EngineService::NewStub(Connect(*server_));
  Engine acking(engine_stub_.get(), /*coordinate=*/true);
  AttachOne(acking);
  Engine silent(engine_stub_.get(), /*coordinate=*/true);
  AttachOne(silent);
  std::thread pusher([&] {
    const PushOutcome outcome = PushMessages(stub_.get(), FullPush(2));
    EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::ABORTED);
  });
  v1::DaemonMessage message;
  ASSERT_TRUE(acking.Read(&message));
  ASSERT_TRUE(message.has_commit_pending());
  acking.Quiesced(message.commit_pending());
  ASSERT_TRUE(acking.Read(&message));
  EXPECT_TRUE(message.has_aborted());
  pusher.join();
  EXPECT_EQ(Version(), 1u);
  const std::string metrics = server_->metrics()->Render({});
  EXPECT_THAT(metrics, HasSubstr("refitd_engine_pause_seconds_count{outcome=\"aborted\"} 1\n"));
  EXPECT_THAT(metrics, HasSubstr("refitd_engine_pause_seconds_count{outcome=\"committed\"} 0\n"));
  // Paused for most of the 2 s the daemon waited for the other engine.
  EXPECT_THAT(metrics,
              HasSubstr("refitd_engine_pause_seconds_bucket{outcome=\"aborted\",le=\"0.05\"} 0\n"));
}

TEST_F(AttachTest, OnePhasePushWithAnEngineThatNeverAcksIsAbortedNamingIt) {
  Engine engine(engine_stub_.get(), /*coordinate=*/true);
  AttachOne(engine);
  const PushOutcome outcome = PushMessages(stub_.get(), FullPush(2));
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(outcome.status.error_message(), HasSubstr("engine \"e-1\" (\"test-engine\")"));
  EXPECT_THAT(outcome.status.error_message(),
              HasSubstr("did not quiesce within 200ms (--engine-quiesce-timeout)"));
  EXPECT_EQ(Version(), 1u);
  v1::DaemonMessage message;
  ASSERT_TRUE(engine.Read(&message));
  EXPECT_TRUE(message.has_commit_pending());
  ASSERT_TRUE(engine.Read(&message));
  EXPECT_TRUE(message.has_aborted());
  EXPECT_EQ(message.aborted().version(), 1u);
}

TEST_F(AttachTest, PreparedRefitStaysPreparedUntilTheSilentEngineDetaches) {
  auto engine = std::make_unique<Engine>(engine_stub_.get(), /*coordinate=*/true);
  AttachOne(*engine);
  const PushOutcome prepared = PushMessages(stub_.get(), FullPush(2, v1::COMPLETION_MODE_PREPARE));
  ASSERT_TRUE(prepared.status.ok()) << prepared.status.error_message();
  const std::string refit_id = prepared.response.result().refit_id();
  v1::CommitRequest request;
  request.set_refit_id(refit_id);
  {
    grpc::ClientContext context;
    v1::CommitResponse response;
    const grpc::Status status = stub_->Commit(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    EXPECT_THAT(status.error_message(), HasSubstr("engine \"e-1\""));
    EXPECT_THAT(status.error_message(), HasSubstr("stays PREPARED"));
  }
  const v1::GetStatusResponse status = Status(stub_.get());
  EXPECT_EQ(status.version(), 1u);
  EXPECT_EQ(status.active_refit().refit_id(), refit_id);
  EXPECT_EQ(status.active_refit().state(), v1::REFIT_STATE_PREPARED);
  // The engine goes: released, and the same refit commits.
  EXPECT_TRUE(engine->Close().ok());
  engine.reset();
  grpc::ClientContext context;
  v1::CommitResponse response;
  const grpc::Status committed = stub_->Commit(&context, request, &response);
  ASSERT_TRUE(committed.ok()) << committed.error_message();
  EXPECT_EQ(response.result().version(), 2u);
  EXPECT_EQ(Status(stub_.get()).engines_size(), 0);
}

TEST_F(AttachTest, AnAbortAsTheCommitTimesOutAbortsTheRefitInsteadOfGivingItBack) {
  Engine engine(engine_stub_.get(), /*coordinate=*/true);  // never acks
  AttachOne(engine);
  const PushOutcome prepared = PushMessages(stub_.get(), FullPush(2, v1::COMPLETION_MODE_PREPARE));
  ASSERT_TRUE(prepared.status.ok()) << prepared.status.error_message();
  const std::string refit_id = prepared.response.result().refit_id();
  // The Abort comes after the wait timed out, before the Commit gives the
  // refit back as PREPARED.
  grpc::Status aborted;
  server_->service()->SetCommitHookForTesting(
      [&](RefitServiceImpl::CommitStage stage, const std::string& id) {
        if (stage != RefitServiceImpl::CommitStage::kReturned) return;
        grpc::ClientContext context;
        v1::AbortRequest request;
        request.set_refit_id(id);
        request.set_reason("engine stuck");
        v1::AbortResponse response;
        aborted = stub_->Abort(&context, request, &response);
      });
  grpc::ClientContext context;
  v1::CommitRequest request;
  request.set_refit_id(refit_id);
  v1::CommitResponse response;
  const grpc::Status status = stub_->Commit(&context, request, &response);
  server_->service()->SetCommitHookForTesting(nullptr);
  ASSERT_TRUE(aborted.ok()) << aborted.error_message();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("an Abort came as"));
  EXPECT_THAT(status.error_message(), HasSubstr("did not quiesce"));
  EXPECT_THAT(status.error_message(), Not(HasSubstr("stays PREPARED")));
  // Not registered again: nothing to commit or abort, the group is free.
  const v1::GetStatusResponse after = Status(stub_.get());
  EXPECT_EQ(after.version(), 1u);
  EXPECT_FALSE(after.has_active_refit());
  grpc::ClientContext again;
  EXPECT_EQ(stub_->Commit(&again, request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  const std::string metrics = server_->metrics()->Render({});
  EXPECT_THAT(metrics, HasSubstr("refitd_refits_total{outcome=\"aborted\"} 1\n"));
  EXPECT_THAT(metrics, HasSubstr("refitd_refits_total{outcome=\"failed\"} 0\n"));
}

// A linked commit whose engines did not quiesce gives its refits back all
// or none: an Abort of one of them that comes as they are given back
// aborts both, as one during the wait does (the other one was given back
// PREPARED).
TEST_F(AttachTest, AnAbortOfOneLinkedRefitAsItsCommitGivesThemBackAbortsBoth) {
  ServerOptions options = TestOptions(dir_);
  options.engine_quiesce_timeout = absl::Milliseconds(200);
  GroupOptions target;
  target.name = "target";
  GroupOptions draft;
  draft.name = "draft";
  options.groups = {target, draft};
  StartServer(std::move(options));
  engine_stub_ = v1::EngineService::NewStub(Connect(*server_));
  Engine engine(engine_stub_.get(), /*coordinate=*/true);  // the target's; never acks
  AttachOne(engine);
  auto prepare = [&](const std::string& group, uint64_t seed) {
    std::vector<v1::PushRequest> messages = FullPush(seed, v1::COMPLETION_MODE_PREPARE);
    messages[0].mutable_begin()->set_model_group(group);
    const PushOutcome outcome = PushMessages(stub_.get(), messages);
    EXPECT_TRUE(outcome.status.ok()) << outcome.status.error_message();
    return outcome.response.result().refit_id();
  };
  const std::string target_id = prepare("target", 2);
  const std::string draft_id = prepare("draft", 3);
  auto abort = [&](const std::string& group, const std::string& id) {
    grpc::ClientContext context;
    v1::AbortRequest request;
    request.set_model_group(group);
    request.set_refit_id(id);
    v1::AbortResponse response;
    return stub_->Abort(&context, request, &response);
  };
  grpc::Status aborted;
  server_->service()->SetCommitHookForTesting(
      [&](RefitServiceImpl::CommitStage stage, const std::string&) {
        if (stage == RefitServiceImpl::CommitStage::kGivingBack) aborted = abort("draft", draft_id);
      });
  grpc::ClientContext context;
  v1::CommitRequest request;
  request.set_model_group("target");
  request.set_refit_id(target_id);
  v1::RefitRef* linked = request.add_linked();
  linked->set_model_group("draft");
  linked->set_refit_id(draft_id);
  v1::CommitResponse response;
  const grpc::Status status = stub_->Commit(&context, request, &response);
  server_->service()->SetCommitHookForTesting(nullptr);
  ASSERT_TRUE(aborted.ok()) << aborted.error_message();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("an Abort asked for one of its refits"));
  EXPECT_THAT(status.error_message(), HasSubstr("did not quiesce"));
  // Neither is PREPARED: nothing left to abort, both groups free.
  EXPECT_EQ(abort("target", target_id).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(abort("draft", draft_id).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_FALSE(Status(stub_.get()).has_active_refit());
  EXPECT_EQ(Status(stub_.get()).version(), 1u);
  const std::string metrics = server_->metrics()->Render({});
  EXPECT_THAT(metrics, HasSubstr("refitd_refits_total{outcome=\"aborted\"} 2\n"));
  EXPECT_THAT(metrics, HasSubstr("refitd_refits_total{outcome=\"failed\"} 0\n"));
}

TEST_F(AttachTest, AnAbortWithNoRefitIdEndsTheWaitOfTheActiveRefitsCommit) {
  ServerOptions options = TestOptions(dir_);
  options.engine_quiesce_timeout = absl::Seconds(60);
  StartServer(std::move(options));
  engine_stub_ = v1::EngineService::NewStub(Connect(*server_));
  Engine silent(engine_stub_.get(), /*coordinate=*/true);
  AttachOne(silent);
  const PushOutcome prepared = PushMessages(stub_.get(), FullPush(2, v1::COMPLETION_MODE_PREPARE));
  ASSERT_TRUE(prepared.status.ok()) << prepared.status.error_message();
  grpc::Status committed;
  std::thread committer([&] {
    grpc::ClientContext context;
    v1::CommitRequest request;
    request.set_refit_id(prepared.response.result().refit_id());
    v1::CommitResponse response;
    committed = stub_->Commit(&context, request, &response);
  });
  v1::DaemonMessage pending;
  ASSERT_TRUE(silent.Read(&pending));
  ASSERT_TRUE(pending.has_commit_pending());
  grpc::ClientContext context;
  v1::AbortRequest request;  // refit_id "": the active refit
  v1::AbortResponse response;
  const grpc::Status aborted = stub_->Abort(&context, request, &response);
  committer.join();
  ASSERT_TRUE(aborted.ok()) << aborted.error_message();
  EXPECT_EQ(response.refit_id(), prepared.response.result().refit_id());
  EXPECT_EQ(committed.error_code(), grpc::StatusCode::ABORTED) << committed.error_message();
  EXPECT_FALSE(Status(stub_.get()).has_active_refit());
}

TEST_F(AttachTest, AnEngineAttachingWhileACommitWaitsIsAskedAndWaitedForToo) {
  ServerOptions options = TestOptions(dir_);
  options.engine_quiesce_timeout = absl::Seconds(30);
  StartServer(std::move(options));
  engine_stub_ = v1::EngineService::NewStub(Connect(*server_));
  Engine first(engine_stub_.get(), /*coordinate=*/true);
  AttachOne(first);
  std::thread pusher([&] {
    const PushOutcome outcome = PushMessages(stub_.get(), FullPush(2));
    EXPECT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  });
  v1::DaemonMessage message;
  ASSERT_TRUE(first.Read(&message));
  ASSERT_TRUE(message.has_commit_pending());
  const v1::CommitPending pending = message.commit_pending();

  // The commit is waiting for `first`; a second engine attaches now.
  Engine second(engine_stub_.get(), /*coordinate=*/true);
  const v1::Attached attached = AttachOne(second);
  EXPECT_EQ(attached.version(), 1u);
  // In the manifest already, so that the engine holds at its first safe
  // point however late it reads the message below.
  EXPECT_EQ(attached.pending().version(), 2u);
  EXPECT_EQ(attached.pending().attempt(), pending.attempt());
  ASSERT_TRUE(second.Read(&message));
  ASSERT_TRUE(message.has_commit_pending());
  EXPECT_EQ(message.commit_pending().version(), 2u);
  EXPECT_EQ(message.commit_pending().attempt(), pending.attempt());

  // The first ack alone does not let the copy run.
  first.Quiesced(pending);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(server_->default_group()->store()->version(), 1u);
  second.Quiesced(message.commit_pending());
  pusher.join();
  EXPECT_EQ(Version(), 2u);
  for (Engine* engine : {&first, &second}) {
    ASSERT_TRUE(engine->Read(&message));
    ASSERT_TRUE(message.has_committed());
    EXPECT_EQ(message.committed().version(), 2u);
  }
}

// Waits (up to 20 s) until the default group has no active refit.
void AwaitNoActiveRefit(v1::RefitService::Stub* stub) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (Status(stub).has_active_refit() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
}

TEST_F(AttachTest, APushCancelledWhileEnginesQuiesceIsAbortedThenAndALateAckCopiesNothing) {
  // The client goes away while the commit waits for an engine: the refit
  // aborts at once (not when the engine acks, or after the quiesce timeout,
  // with the commit made behind the client's back), and the engine is told
  // once.
  ServerOptions options = TestOptions(dir_);
  options.engine_quiesce_timeout = absl::Seconds(60);
  StartServer(std::move(options));
  engine_stub_ = v1::EngineService::NewStub(Connect(*server_));
  Engine engine(engine_stub_.get(), /*coordinate=*/true);
  AttachOne(engine);
  grpc::ClientContext push_context;
  grpc::Status pushed;
  std::thread pusher([&] {
    v1::PushResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::PushRequest>> writer =
        stub_->Push(&push_context, &response);
    for (const v1::PushRequest& message : FullPush(2)) {
      if (!writer->Write(message)) break;
    }
    writer->WritesDone();
    pushed = writer->Finish();
  });
  v1::DaemonMessage message;
  ASSERT_TRUE(engine.Read(&message));
  ASSERT_TRUE(message.has_commit_pending());
  const v1::CommitPending pending = message.commit_pending();
  const absl::Time cancelled = absl::Now();
  push_context.TryCancel();
  pusher.join();
  EXPECT_EQ(pushed.error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(engine.Read(&message));
  ASSERT_TRUE(message.has_aborted()) << message.DebugString();
  EXPECT_LT(absl::Now() - cancelled, absl::Seconds(20));
  EXPECT_EQ(message.aborted().refit_id(), pending.refit_id());
  EXPECT_THAT(message.aborted().reason(), HasSubstr("the client cancelled the Push"));
  engine.Quiesced(pending);  // late: lets nothing through
  AwaitNoActiveRefit(stub_.get());
  EXPECT_EQ(Version(), 1u);

  // What the engine reads next is the next refit's CommitPending, not a
  // second Aborted for this one.
  std::thread next([&] {
    const PushOutcome outcome = PushMessages(stub_.get(), FullPush(3));
    EXPECT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  });
  ASSERT_TRUE(engine.Read(&message));
  ASSERT_TRUE(message.has_commit_pending()) << message.DebugString();
  engine.Quiesced(message.commit_pending());
  ASSERT_TRUE(engine.Read(&message));
  EXPECT_TRUE(message.has_committed()) << message.DebugString();
  next.join();
  EXPECT_EQ(Version(), 2u);
}

TEST_F(AttachTest, ShutdownEndsACommitWaitingForEnginesWithoutCopying) {
  // Both kinds of commit: a one-phase Push, and a two-phase Commit (whose
  // refit is no longer among the group's refits while it commits).
  for (bool two_phase : {false, true}) {
    SCOPED_TRACE(two_phase ? "Commit" : "Push");
    ServerOptions options = TestOptions(dir_);
    options.engine_quiesce_timeout = absl::Seconds(60);
    StartServer(std::move(options));
    engine_stub_ = v1::EngineService::NewStub(Connect(*server_));
    auto engine = std::make_unique<Engine>(engine_stub_.get(), /*coordinate=*/true);
    AttachOne(*engine);
    std::string refit_id;
    if (two_phase) {
      const PushOutcome prepared =
          PushMessages(stub_.get(), FullPush(2, v1::COMPLETION_MODE_PREPARE));
      ASSERT_TRUE(prepared.status.ok()) << prepared.status.error_message();
      refit_id = prepared.response.result().refit_id();
    }
    grpc::Status committed;
    std::thread committer([&] {
      if (two_phase) {
        grpc::ClientContext context;
        v1::CommitRequest request;
        request.set_refit_id(refit_id);
        v1::CommitResponse response;
        committed = stub_->Commit(&context, request, &response);
      } else {
        committed = PushMessages(stub_.get(), FullPush(2)).status;
      }
    });
    v1::DaemonMessage message;
    ASSERT_TRUE(engine->Read(&message));
    ASSERT_TRUE(message.has_commit_pending());
    const absl::Time start = absl::Now();
    server_->Shutdown();
    EXPECT_LT(absl::Now() - start, absl::Seconds(20));
    committer.join();
    EXPECT_FALSE(committed.ok());
    EXPECT_THAT(committed.error_message(), HasSubstr("shutting down"));
    EXPECT_EQ(server_->default_group()->store()->version(), 1u);
    engine.reset();
  }
}

// A Commit that took its refit but had not asked the engines yet when
// shutdown began (shutdown then ends the engines' leases, though their
// processes may still read the kernels) is refused when it gets there: it
// must not copy without their ack. Shutdown's first step, CloseCommits, is
// taken here on its own, so the Commit reliably comes after it.
TEST_F(AttachTest, ACommitThatReachesTheEnginesAfterShutdownBeganCopiesNothing) {
  Engine engine(engine_stub_.get(), /*coordinate=*/true);
  AttachOne(engine);
  const PushOutcome prepared = PushMessages(stub_.get(), FullPush(2, v1::COMPLETION_MODE_PREPARE));
  ASSERT_TRUE(prepared.status.ok()) << prepared.status.error_message();
  core::ShardStore* store = server_->default_group()->store();
  const std::string fingerprint = store->fingerprint();
  store->CloseCommits("refitd is shutting down");
  grpc::ClientContext context;
  v1::CommitRequest request;
  request.set_refit_id(prepared.response.result().refit_id());
  v1::CommitResponse response;
  const grpc::Status committed = stub_->Commit(&context, request, &response);
  EXPECT_EQ(committed.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(committed.error_message(),
              HasSubstr(absl::StrCat("refit \"", prepared.response.result().refit_id(),
                                     "\" aborted: refitd is shutting down")));
  EXPECT_EQ(store->version(), 1u);
  EXPECT_EQ(store->fingerprint(), fingerprint);
  // The engine was never asked to quiesce: what it hears of the refit is
  // its end.
  v1::DaemonMessage message;
  ASSERT_TRUE(engine.Read(&message));
  EXPECT_FALSE(message.has_commit_pending());
  EXPECT_TRUE(message.has_aborted());
}

TEST_F(AttachTest, AnEngineWhoseProcessIsGoneIsReleasedThoughItsStreamStaysOpen) {
  // The process that took the engine's descriptors exits while another (a
  // child that inherited the stream, here this test) keeps the stream open:
  // no one is left to ack, so a commit does not wait for it, and its lease
  // ends.
  ServerOptions options = TestOptions(dir_);
  options.engine_quiesce_timeout = absl::Seconds(60);
  StartServer(std::move(options));
  engine_stub_ = v1::EngineService::NewStub(Connect(*server_));
  Engine engine(engine_stub_.get(), /*coordinate=*/true);
  const v1::Attached a = AttachOne(engine);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::string error;
    ::_exit(ReceiveFd(a.fd_socket(), a.ticket(), &error) >= 0 ? 0 : 1);
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0);
  ASSERT_EQ(Status(stub_.get()).engines(0).pid(), child);

  const absl::Time start = absl::Now();
  const PushOutcome pushed = PushMessages(stub_.get(), FullPush(2));
  ASSERT_TRUE(pushed.status.ok()) << pushed.status.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  EXPECT_EQ(Version(), 2u);
  EXPECT_EQ(Status(stub_.get()).engines_size(), 0);
  v1::DaemonMessage message;
  while (engine.Read(&message)) {
  }
  const grpc::Status ended = engine.Close();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(ended.error_message(), HasSubstr("the engine's process"));
}

TEST_F(AttachTest, AnAckForAnEarlierAttemptDoesNotCountForTheRetry) {
  Engine engine(engine_stub_.get(), /*coordinate=*/true);
  AttachOne(engine);
  const PushOutcome prepared = PushMessages(stub_.get(), FullPush(2, v1::COMPLETION_MODE_PREPARE));
  ASSERT_TRUE(prepared.status.ok()) << prepared.status.error_message();
  v1::CommitRequest request;
  request.set_refit_id(prepared.response.result().refit_id());
  auto commit = [&] {
    grpc::ClientContext context;
    v1::CommitResponse response;
    return stub_->Commit(&context, request, &response);
  };
  // Attempt 1: no ack in time; the refit stays PREPARED.
  EXPECT_EQ(commit().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  v1::DaemonMessage message;
  ASSERT_TRUE(engine.Read(&message));
  ASSERT_TRUE(message.has_commit_pending());
  const v1::CommitPending stale = message.commit_pending();
  ASSERT_TRUE(engine.Read(&message));
  ASSERT_TRUE(message.has_aborted());

  // Attempt 2 (same refit, same version): the first attempt's ack, arriving
  // late, is not this attempt's.
  grpc::Status retried;
  std::thread committer([&] { retried = commit(); });
  ASSERT_TRUE(engine.Read(&message));
  ASSERT_TRUE(message.has_commit_pending());
  EXPECT_EQ(message.commit_pending().version(), stale.version());
  EXPECT_NE(message.commit_pending().attempt(), stale.attempt());
  engine.Quiesced(stale);
  committer.join();
  EXPECT_EQ(retried.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(Version(), 1u);
  ASSERT_TRUE(engine.Read(&message));
  ASSERT_TRUE(message.has_aborted());

  // Attempt 3, acked as asked: committed.
  std::thread last([&] { retried = commit(); });
  ASSERT_TRUE(engine.Read(&message));
  ASSERT_TRUE(message.has_commit_pending());
  engine.Quiesced(message.commit_pending());
  last.join();
  EXPECT_TRUE(retried.ok()) << retried.error_message();
  EXPECT_EQ(Version(), 2u);
}

TEST_F(AttachTest, EnginesThatHoldUpACommitAreNamedUpToEightAndCounted) {
  // The reason goes to the trainer (a gRPC status, bounded in size) and to
  // every engine: with many silent engines it names eight and counts the rest.
  std::vector<std::unique_ptr<Engine>> engines;
  for (int i = 0; i < 11; ++i) {
    engines.push_back(std::make_unique<Engine>(engine_stub_.get(), /*coordinate=*/true,
                                               v1::EngineLayout(), std::string(200, 'n')));
    AttachOne(*engines.back());
  }
  const PushOutcome outcome = PushMessages(stub_.get(), FullPush(2));
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(outcome.status.error_message(), HasSubstr("engine \"e-1\""));
  EXPECT_THAT(outcome.status.error_message(), HasSubstr(", and 3 more engines did not quiesce"));
  EXPECT_LT(outcome.status.error_message().size(), 4000u);
  EXPECT_EQ(Version(), 1u);
  v1::DaemonMessage message;
  ASSERT_TRUE(engines[10]->Read(&message));
  ASSERT_TRUE(message.has_commit_pending());
  ASSERT_TRUE(engines[10]->Read(&message));
  ASSERT_TRUE(message.has_aborted());
  EXPECT_THAT(message.aborted().reason(), HasSubstr("and 3 more engines"));
}

TEST_F(AttachTest, EnginesPastTheLimitAreResourceExhaustedUntilOneDetaches) {
  ServerOptions options = TestOptions(dir_);
  options.max_attached_engines = 2;
  StartServer(std::move(options));
  engine_stub_ = v1::EngineService::NewStub(Connect(*server_));
  auto first = std::make_unique<Engine>(engine_stub_.get(), /*coordinate=*/false);
  AttachOne(*first);
  Engine second(engine_stub_.get(), /*coordinate=*/true);
  AttachOne(second);
  {
    Engine third(engine_stub_.get(), /*coordinate=*/false);
    const grpc::Status status = third.Close();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(status.error_message(),
                HasSubstr("has 2 engines attached, its limit (--max-attached-engines)"));
  }
  EXPECT_EQ(Status(stub_.get()).engines_size(), 2);
  ASSERT_TRUE(first->Close().ok());
  first.reset();
  // The daemon releases a detached engine as its stream ends.
  for (int i = 0; i < 100 && Status(stub_.get()).engines_size() != 1; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  Engine again(engine_stub_.get(), /*coordinate=*/false);
  EXPECT_TRUE(AttachOne(again).has_layout());
}

TEST_F(AttachTest, AnEngineNameLongerThanTheLimitIsInvalidArgument) {
  Engine engine(engine_stub_.get(), /*coordinate=*/false, {},
                std::string(AttachService::kMaxEngineNameBytes + 1, 'n'));
  const grpc::Status status = engine.Close();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("engine_name is 257 bytes; at most 256"));
  EXPECT_EQ(Status(stub_.get()).engines_size(), 0);
}

TEST_F(AttachTest, FirstMessageThatIsNotAttachIsFailedPrecondition) {
  grpc::ClientContext context;
  auto stream = engine_stub_->Attach(&context);
  v1::EngineMessage ack;
  ack.mutable_quiesced()->set_version(1);
  stream->Write(ack);
  stream->WritesDone();
  v1::DaemonMessage message;
  EXPECT_FALSE(stream->Read(&message));
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("first message of Attach must be attach"));
}

TEST_F(AttachTest, FirstMessageThatIsNotAnEngineMessageIsInvalidArgument) {
  grpc::GenericStub generic(Connect(*server_));
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  int tags[4];
  auto await = [&](void* tag) {
    void* got = nullptr;
    bool ok = false;
    EXPECT_TRUE(cq.Next(&got, &ok));
    EXPECT_EQ(got, tag);
    return ok;
  };
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      generic.PrepareCall(&context, "/refit.v1.EngineService/Attach", &cq);
  call->StartCall(&tags[0]);
  ASSERT_TRUE(await(&tags[0]));
  // Field 0 does not exist: no protobuf parser accepts these bytes.
  grpc::Slice junk_slice(std::string("\x02\xff\xff\xff", 4));
  grpc::ByteBuffer junk(&junk_slice, 1);
  call->Write(junk, &tags[1]);
  await(&tags[1]);
  call->WritesDone(&tags[2]);
  await(&tags[2]);
  grpc::Status status;
  call->Finish(&status, &tags[3]);
  await(&tags[3]);
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("not a valid EngineMessage"));
  EXPECT_EQ(Status(stub_.get()).engines_size(), 0);
}

TEST_F(AttachTest, AStreamClosedBeforeAttachingIsInvalidArgument) {
  grpc::ClientContext context;
  auto stream = engine_stub_->Attach(&context);
  stream->WritesDone();
  v1::DaemonMessage message;
  EXPECT_FALSE(stream->Read(&message));
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("Attach ended before an attach message"));
}

TEST(CompareLayoutsTest, UnsetFieldsAreNotCompared) {
  v1::EngineLayout actual;
  actual.set_architecture("LlamaForCausalLM");
  actual.set_tp_size(1);
  EXPECT_TRUE(CompareLayouts(v1::EngineLayout(), actual).ok());
  EXPECT_TRUE(IsUnixPeer("unix:/tmp/x.sock"));
  // A rank other than 0 is compared without tp_size (0 is "not set").
  v1::EngineLayout rank;
  rank.set_tp_rank(3);
  const absl::Status status = CompareLayouts(rank, actual);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("tp_rank (engine expects 3, daemon serves 0)"));
  rank.set_tp_rank(0);
  EXPECT_TRUE(CompareLayouts(rank, actual).ok());
  EXPECT_FALSE(IsUnixPeer("ipv4:127.0.0.1:5000"));
}

}  // namespace
}  // namespace refit::server::testing
