// The daemon's limits and lifecycle over a real in-process refitd: refit
// deadlines (--refit-timeout, --prepared-timeout) on a FakeClock, a status
// that agrees with the refit slot, version and fingerprint read as one, and a
// shutdown that does not wait for streams that never began a refit.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "tests/server/server_test_util.h"
#include "tests/testing/fake_clock.h"

namespace refit::server {
namespace {

using ::refit::server::testing::BeginMessage;
using ::refit::server::testing::ChunkMessages;
using ::refit::server::testing::EndMessage;
using ::refit::server::testing::FixtureWeights;
using ::refit::server::testing::FullPush;
using ::refit::server::testing::MakeTempDir;
using ::refit::server::testing::PushMessages;
using ::refit::server::testing::PushOutcome;
using ::refit::server::testing::Status;
using ::refit::server::testing::TestOptions;
using ::refit::server::testing::WatchStream;
using ::refit::testing::FakeClock;
using ::testing::HasSubstr;

class RefitLimitsTest : public testing::ServerTest {};

TEST_F(RefitLimitsTest, PreparedRefitNobodyCommitsExpiresAsAborted) {
  ServerOptions options = FakeClockOptions();
  options.prepared_timeout = absl::Minutes(2);
  StartServer(options);
  WatchStream watch(stub_.get());
  const absl::Time start = clock_.Now();
  PushOutcome push = PushMessages(stub_.get(), FullPush(3, v1::COMPLETION_MODE_PREPARE));
  ASSERT_TRUE(push.status.ok()) << push.status.error_message();
  const std::string id = push.response.result().refit_id();
  ASSERT_EQ(push.response.result().state(), v1::REFIT_STATE_PREPARED);
  EXPECT_EQ(Status(stub_.get()).active_refit().refit_id(), id);

  ASSERT_TRUE(clock_.AwaitWaiter(start + absl::Minutes(2)));
  clock_.AdvanceTime(absl::Minutes(2));
  const v1::WatchEvent aborted = watch.Next(v1::WatchEvent::TYPE_ABORTED);
  EXPECT_EQ(aborted.refit_id(), id);
  EXPECT_THAT(aborted.message(), HasSubstr("not committed within 2m of PREPARED"));
  EXPECT_THAT(aborted.message(), HasSubstr("--prepared-timeout"));

  grpc::ClientContext context;
  v1::CommitRequest request;
  request.set_refit_id(id);
  v1::CommitResponse response;
  EXPECT_EQ(stub_->Commit(&context, request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
  const v1::GetStatusResponse after = Status(stub_.get());
  EXPECT_EQ(after.version(), 1u);
  EXPECT_FALSE(after.has_active_refit());
  EXPECT_TRUE(PushMessages(stub_.get(), FullPush(4)).status.ok());
}

TEST_F(RefitLimitsTest, SlowDripWithinTheIdleTimeoutIsAbortedAtTheRefitTimeout) {
  ServerOptions options = FakeClockOptions();
  options.push_idle_timeout = absl::Seconds(60);
  options.refit_timeout = absl::Seconds(90);
  StartServer(options);
  WatchStream watch(stub_.get());
  grpc::ClientContext context;
  v1::PushResponse response;
  auto writer = stub_->Push(&context, &response);
  const absl::Time opened = clock_.Now();
  ASSERT_TRUE(clock_.AwaitWaiter(opened + absl::Seconds(60)));
  clock_.AdvanceTime(absl::Seconds(1));
  ASSERT_TRUE(writer->Write(BeginMessage()));
  const std::string id = watch.Next(v1::WatchEvent::TYPE_STAGING_STARTED).refit_id();
  // The refit deadline (Begin + 90 s) comes before the idle one (+ 60 s) is
  // re-armed past it; the watchdog sleeps for the earlier.
  ASSERT_TRUE(clock_.AwaitWaiter(opened + absl::Seconds(61)));
  clock_.AdvanceTime(absl::Seconds(50));
  std::vector<v1::PushRequest> chunks = ChunkMessages(FixtureWeights(5));
  ASSERT_TRUE(writer->Write(chunks.front()));
  ASSERT_TRUE(clock_.AwaitWaiter(opened + absl::Seconds(91)));
  clock_.AdvanceTime(absl::Seconds(50));  // 40 s after the last chunk: not idle
  grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(status.error_message(),
              HasSubstr(absl::StrCat("refit \"", id,
                                     "\" aborted: not finished within 1m30s of its start "
                                     "(--refit-timeout)")));
  const v1::WatchEvent aborted = watch.Next(v1::WatchEvent::TYPE_ABORTED);
  EXPECT_EQ(aborted.refit_id(), id);
  EXPECT_THAT(aborted.message(), HasSubstr("--refit-timeout"));
  EXPECT_EQ(Status(stub_.get()).version(), 1u);
  EXPECT_TRUE(PushMessages(stub_.get(), FullPush(6)).status.ok());
}

TEST_F(RefitLimitsTest, RefitTimeoutBoundsAPreparedRefitToo) {
  ServerOptions options = FakeClockOptions();
  options.prepared_timeout = absl::Minutes(10);
  options.refit_timeout = absl::Minutes(5);
  StartServer(options);
  WatchStream watch(stub_.get());
  const absl::Time start = clock_.Now();
  PushOutcome push = PushMessages(stub_.get(), FullPush(3, v1::COMPLETION_MODE_PREPARE));
  ASSERT_TRUE(push.status.ok()) << push.status.error_message();
  ASSERT_TRUE(clock_.AwaitWaiter(start + absl::Minutes(5)));
  clock_.AdvanceTime(absl::Minutes(5));
  const v1::WatchEvent aborted = watch.Next(v1::WatchEvent::TYPE_ABORTED);
  EXPECT_EQ(aborted.refit_id(), push.response.result().refit_id());
  EXPECT_THAT(aborted.message(), HasSubstr("--refit-timeout"));
  EXPECT_FALSE(Status(stub_.get()).has_active_refit());
}

TEST_F(RefitLimitsTest, NonPositiveDeadlinesAreInvalidArgument) {
  ServerOptions options = TestOptions(dir_);
  options.prepared_timeout = absl::ZeroDuration();
  absl::StatusOr<std::unique_ptr<RefitServer>> server = RefitServer::Create(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(server.status().message(), HasSubstr("--prepared-timeout"));
  options = TestOptions(dir_);
  options.refit_timeout = absl::Seconds(-1);
  server = RefitServer::Create(options);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(server.status().message(), HasSubstr("--refit-timeout"));
}

// The slot, not the registry, decides whether a Begin can start; GetStatus
// reports its holder, whatever state its session is in.
TEST_F(RefitLimitsTest, GetStatusReportsTheRefitSlotHolderAsActive) {
  core::ShardStore* store = server_->default_group()->store();
  absl::StatusOr<core::RefitSlot> slot = store->AcquireRefitSlot("r-held-by-test");
  ASSERT_TRUE(slot.ok()) << slot.status();
  EXPECT_EQ(Status(stub_.get()).active_refit().refit_id(), "r-held-by-test");
  PushOutcome refused = PushMessages(stub_.get(), FullPush(7));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(refused.status.error_message(), HasSubstr("r-held-by-test"));
  slot->Release();
  EXPECT_FALSE(Status(stub_.get()).has_active_refit());
  EXPECT_TRUE(PushMessages(stub_.get(), FullPush(7)).status.ok());
}

// Version and fingerprint come from one version, also while commits run.
TEST_F(RefitLimitsTest, StatusAndWatchSnapshotPairVersionWithItsFingerprint) {
  std::map<uint64_t, std::string> committed;
  const v1::GetStatusResponse first = Status(stub_.get());
  committed[first.version()] = first.fingerprint();
  absl::Mutex mu;
  bool done = false;
  std::vector<std::pair<uint64_t, std::string>> seen;
  std::thread observer([&] {
    auto stub = v1::RefitService::NewStub(testing::Connect(*server_));
    for (;;) {
      {
        absl::MutexLock lock(&mu);
        if (done) return;
      }
      const v1::GetStatusResponse status = Status(stub.get());
      grpc::ClientContext context;
      auto reader = stub->Watch(&context, v1::WatchRequest());
      v1::WatchEvent snapshot;
      const bool read = reader->Read(&snapshot);
      context.TryCancel();
      v1::WatchEvent ignored;
      while (reader->Read(&ignored)) {
      }
      reader->Finish();
      absl::MutexLock lock(&mu);
      seen.emplace_back(status.version(), status.fingerprint());
      if (read) seen.emplace_back(snapshot.version(), snapshot.fingerprint());
    }
  });
  for (uint64_t seed = 10; seed < 25; ++seed) {
    PushOutcome push = PushMessages(stub_.get(), FullPush(seed));
    ASSERT_TRUE(push.status.ok()) << push.status.error_message();
    committed[push.response.result().version()] = push.response.result().fingerprint();
  }
  {
    absl::MutexLock lock(&mu);
    done = true;
  }
  observer.join();
  ASSERT_FALSE(seen.empty());
  for (const auto& [version, fingerprint] : seen) {
    ASSERT_EQ(committed.count(version), 1u) << version;
    EXPECT_EQ(fingerprint, committed[version]) << "version " << version;
  }
}

TEST_F(RefitLimitsTest, ShutdownEndsAPushThatNeverSentBeginAtOnce) {
  ServerOptions options = FakeClockOptions();
  options.shutdown_timeout = absl::Seconds(60);
  StartServer(options);
  grpc::ClientContext context;
  v1::PushResponse response;
  auto writer = stub_->Push(&context, &response);
  // The stream is open on the server once its idle timer is armed.
  ASSERT_TRUE(clock_.AwaitWaiter(clock_.Now() + options.push_idle_timeout));
  const absl::Time start = absl::Now();
  server_->Shutdown();
  // Without the fix gRPC waits the whole --shutdown-timeout for this stream.
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(status.error_message(), HasSubstr("shutting down"));
}

v1::PushRequest BeginRequiringCompleteness(bool require_complete) {
  v1::PushRequest begin = BeginMessage();
  begin.mutable_begin()->mutable_options()->set_require_complete(require_complete);
  return begin;
}

// The chunks of the tensors whose name contains `part`.
std::vector<v1::PushRequest> ChunksOf(absl::string_view part) {
  std::vector<core::OwnedTensor> some;
  for (core::OwnedTensor& t : FixtureWeights(11)) {
    if (absl::StrContains(t.name, part)) some.push_back(std::move(t));
  }
  return ChunkMessages(some);
}

TEST_F(RefitLimitsTest, PartialPushWithRequireCompleteIsFailedPreconditionNamingTheMissing) {
  const v1::GetStatusResponse before = Status(stub_.get());
  std::vector<v1::PushRequest> messages = {BeginRequiringCompleteness(true)};
  for (v1::PushRequest& m : ChunksOf("model.layers.0.")) messages.push_back(std::move(m));
  messages.push_back(EndMessage());
  PushOutcome push = PushMessages(stub_.get(), messages);
  EXPECT_EQ(push.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(push.status.error_message(), HasSubstr("is incomplete (require_complete)"));
  EXPECT_THAT(push.status.error_message(), HasSubstr("model.embed_tokens.weight"));
  EXPECT_THAT(push.status.error_message(), HasSubstr("more"));
  EXPECT_THAT(push.status.error_message(), ::testing::ContainsRegex("[0-9]+ checkpoint tensor"));
  const v1::GetStatusResponse after = Status(stub_.get());
  EXPECT_EQ(after.version(), before.version());
  EXPECT_EQ(after.fingerprint(), before.fingerprint());
}

TEST_F(RefitLimitsTest, PartialPushWithoutRequireCompleteKeepsTheRest) {
  std::vector<v1::PushRequest> messages = {BeginRequiringCompleteness(false)};
  for (v1::PushRequest& m : ChunksOf("model.layers.0.")) messages.push_back(std::move(m));
  messages.push_back(EndMessage());
  PushOutcome push = PushMessages(stub_.get(), messages);
  ASSERT_TRUE(push.status.ok()) << push.status.error_message();
  EXPECT_EQ(push.response.result().version(), 2u);
  EXPECT_THAT(push.response.result().kept_layers(), ::testing::Contains("model.embed_tokens"));
  EXPECT_FALSE(push.response.result().unchanged());
}

TEST_F(RefitLimitsTest, FullPushWithRequireCompleteCommits) {
  std::vector<v1::PushRequest> messages = FullPush(12);
  messages.front() = BeginRequiringCompleteness(true);
  PushOutcome push = PushMessages(stub_.get(), messages);
  ASSERT_TRUE(push.status.ok()) << push.status.error_message();
  EXPECT_EQ(push.response.result().version(), 2u);
}

TEST_F(RefitLimitsTest, RefitWithNoChunksMakesNoNewVersion) {
  const v1::GetStatusResponse before = Status(stub_.get());
  WatchStream watch(stub_.get());
  for (bool require_complete : {false, true}) {
    PushOutcome push =
        PushMessages(stub_.get(), {BeginRequiringCompleteness(require_complete), EndMessage()});
    ASSERT_TRUE(push.status.ok()) << push.status.error_message();
    EXPECT_EQ(push.response.result().state(), v1::REFIT_STATE_COMMITTED);
    EXPECT_TRUE(push.response.result().unchanged());
    EXPECT_EQ(push.response.result().version(), before.version());
    EXPECT_EQ(push.response.result().fingerprint(), before.fingerprint());
    const v1::WatchEvent committed = watch.Next(v1::WatchEvent::TYPE_COMMITTED);
    EXPECT_EQ(committed.version(), before.version());
    EXPECT_EQ(committed.message(), "unchanged");
  }
  const v1::GetStatusResponse after = Status(stub_.get());
  EXPECT_EQ(after.version(), before.version());
  EXPECT_FALSE(after.has_active_refit());
  // The next real refit is the next version.
  PushOutcome push = PushMessages(stub_.get(), FullPush(13));
  ASSERT_TRUE(push.status.ok()) << push.status.error_message();
  EXPECT_EQ(push.response.result().version(), before.version() + 1);
}

// The largest kernel tensor of the served model: name and bytes.
std::pair<std::string, uint64_t> LargestKernel(v1::RefitService::Stub* stub) {
  grpc::ClientContext context;
  v1::ListTensorsRequest request;
  request.set_layout(v1::ListTensorsRequest::LAYOUT_KERNEL);
  v1::ListTensorsResponse response;
  EXPECT_TRUE(stub->ListTensors(&context, request, &response).ok());
  std::pair<std::string, uint64_t> largest;
  for (const v1::TensorInfo& t : response.tensors()) {
    if (t.nbytes() > largest.second) largest = {t.name(), t.nbytes()};
  }
  return largest;
}

TEST_F(RefitLimitsTest, ReadTensorClampsATinyChunkSizeTo64KiB) {
  const auto [name, nbytes] = LargestKernel(stub_.get());
  ASSERT_GT(nbytes, uint64_t{kMinReadChunkBytes}) << name;
  std::string whole, tiny;
  ASSERT_TRUE(testing::ReadTensorBytes(stub_.get(), name, &whole).ok());
  int messages = 0;
  ASSERT_TRUE(testing::ReadTensorBytes(stub_.get(), name, &tiny, 1, &messages).ok());
  EXPECT_EQ(tiny, whole);
  EXPECT_EQ(whole.size(), nbytes);
  EXPECT_EQ(static_cast<uint64_t>(messages),
            (nbytes + kMinReadChunkBytes - 1) / kMinReadChunkBytes);
}

// A stream is one version: a commit between two of its chunks ends it with
// ABORTED, and what was sent before is the old version's. Unpinned, reading
// the tensor again will do; pinned, the pinned version is gone.
TEST_F(RefitLimitsTest, ReadTensorAcrossACommitIsAborted) {
  const std::string name = LargestKernel(stub_.get()).first;
  // A reader whose flow-control window holds about one chunk: the daemon
  // cannot run ahead of it, so the commit below lands mid-stream.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, static_cast<int>(kMinReadChunkBytes));
  auto slow = v1::RefitService::NewStub(grpc::CreateCustomChannel(
      server_->bound_addresses().front(), grpc::InsecureChannelCredentials(), args));
  enum class Pin { kNone, kVersion, kFingerprint };
  for (const Pin pin : {Pin::kNone, Pin::kVersion, Pin::kFingerprint}) {
    SCOPED_TRACE(static_cast<int>(pin));
    const v1::GetStatusResponse live = Status(stub_.get());
    const uint64_t version = live.version();
    std::string old_bytes;
    ASSERT_TRUE(testing::ReadTensorBytes(stub_.get(), name, &old_bytes).ok());
    grpc::ClientContext context;
    v1::ReadTensorRequest request;
    request.set_name(name);
    request.set_max_chunk_bytes(kMinReadChunkBytes);
    if (pin == Pin::kVersion) request.set_version(version);
    if (pin == Pin::kFingerprint) request.set_fingerprint(live.fingerprint());
    auto reader = slow->ReadTensor(&context, request);
    v1::ReadTensorResponse message;
    ASSERT_TRUE(reader->Read(&message));
    EXPECT_EQ(message.version(), version);
    std::string bytes = message.data();
    ASSERT_TRUE(PushMessages(stub_.get(), FullPush(14 + version)).status.ok());
    while (reader->Read(&message)) bytes.append(message.data());
    grpc::Status status = reader->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED);
    EXPECT_THAT(status.error_message(),
                HasSubstr(absl::StrCat("version ", version + 1, " was committed while version ",
                                       version, " was being read")));
    const std::string pinned_to = pin == Pin::kVersion
                                      ? absl::StrCat("version ", version)
                                      : absl::StrCat("fingerprint \"", live.fingerprint(), "\"");
    EXPECT_THAT(
        status.error_message(),
        HasSubstr(pin == Pin::kNone ? std::string("read the tensor again")
                                    : absl::StrCat("the read was pinned to ", pinned_to,
                                                   ", which is no longer served: read every tensor "
                                                   "again at the live version")));
    // What did arrive is the old version's, from the start.
    EXPECT_LT(bytes.size(), old_bytes.size());
    EXPECT_EQ(bytes, old_bytes.substr(0, bytes.size()));
  }
}

TEST_F(RefitLimitsTest, MetricsBeyondLoopbackNeedMetricsAllowRemote) {
  ServerOptions options = TestOptions(dir_);
  // Beside the fixture's server, which listens on refitd.sock.
  options.listen = {absl::StrCat("unix:", dir_, "/second.sock")};
  options.metrics_listen = "0.0.0.0:0";
  absl::StatusOr<std::unique_ptr<RefitServer>> refused = RefitServer::Create(options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("--metrics-allow-remote"));
  EXPECT_THAT(refused.status().message(), HasSubstr("0.0.0.0:0"));
  options.metrics_allow_remote = true;
  absl::StatusOr<std::unique_ptr<RefitServer>> allowed = RefitServer::Create(options);
  ASSERT_TRUE(allowed.ok()) << allowed.status();
  EXPECT_GT((*allowed)->metrics_port(), 0);
  allowed->reset();
  // --allow-insecure-remote allows it too.
  options.metrics_allow_remote = false;
  options.allow_insecure_remote = true;
  allowed = RefitServer::Create(options);
  ASSERT_TRUE(allowed.ok()) << allowed.status();
  EXPECT_GT((*allowed)->metrics_port(), 0);
}

int ConnectLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Reads until the peer closes or `limit` passes; whether it closed.
bool ReadUntilClosed(int fd, std::string* out, absl::Duration limit) {
  const absl::Time deadline = absl::Now() + limit;
  char buffer[4096];
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <= 0) continue;
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n <= 0) return true;
    out->append(buffer, static_cast<size_t>(n));
  }
}

TEST_F(RefitLimitsTest, SlowHeaderClientsNeitherStarveAScrapeNorStayOpen) {
  ServerOptions options = TestOptions(dir_);
  options.metrics_listen = "127.0.0.1:0";
  StartServer(options);
  const int port = server_->metrics_port();
  ASSERT_GT(port, 0);
  std::vector<int> slow;
  for (int i = 0; i < 40; ++i) {
    const int fd = ConnectLoopback(port);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(write(fd, "GET /metr", 9), 9);
    slow.push_back(fd);
  }
  // A scrape is answered while the 40 hold their connections (with a pool of
  // worker threads each blocked on one of them, it would wait for their read
  // timeouts).
  const int scrape = ConnectLoopback(port);
  ASSERT_GE(scrape, 0);
  const std::string request = "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n";
  ASSERT_EQ(write(scrape, request.data(), request.size()), static_cast<ssize_t>(request.size()));
  std::string response;
  EXPECT_TRUE(ReadUntilClosed(scrape, &response, absl::Seconds(10)));
  EXPECT_THAT(response, HasSubstr("200 OK"));
  EXPECT_THAT(response, HasSubstr("refitd_version{group=\"target\"} 1"));
  close(scrape);
  // The slow ones are closed at the request deadline, with nothing sent.
  for (int fd : slow) {
    std::string nothing;
    EXPECT_TRUE(ReadUntilClosed(fd, &nothing, MetricsHttpServer::kRequestDeadline * 5));
    EXPECT_EQ(nothing, "");
    close(fd);
  }
}

TEST_F(RefitLimitsTest, OversizedMetricsRequestIsRefused) {
  ServerOptions options = TestOptions(dir_);
  options.metrics_listen = "127.0.0.1:0";
  StartServer(options);
  const int fd = ConnectLoopback(server_->metrics_port());
  ASSERT_GE(fd, 0);
  const std::string huge = absl::StrCat("GET /metrics HTTP/1.1\r\nX: ",
                                        std::string(MetricsHttpServer::kMaxRequestBytes, 'x'));
  ASSERT_EQ(write(fd, huge.data(), huge.size()), static_cast<ssize_t>(huge.size()));
  std::string response;
  EXPECT_TRUE(ReadUntilClosed(fd, &response, absl::Seconds(10)));
  EXPECT_THAT(response, HasSubstr("431"));
  close(fd);
}

}  // namespace
}  // namespace refit::server
