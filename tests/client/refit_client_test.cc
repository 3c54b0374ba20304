#include "client/refit_client.h"

#include <ftw.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/safetensors_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/fake_refit_service.h"

namespace refit::client {
namespace {

using ::grpc::health::v1::HealthCheckResponse;
using ::refit::client::testing::FakeServer;
using ::testing::HasSubstr;

std::unique_ptr<RefitClient> Connect(const FakeServer& server, ClientOptions options = {}) {
  options.address = server.address();
  options.retry.initial_backoff = absl::Milliseconds(1);
  absl::StatusOr<std::unique_ptr<RefitClient>> client = RefitClient::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return *std::move(client);
}

std::vector<uint8_t> Bytes(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 7);
  return v;
}

// Reassembles every tensor of a recorded push from its chunks, checking
// checksums and that chunks follow each other without gaps.
std::map<std::string, std::vector<uint8_t>> Reassemble(
    const testing::FakeRefitService::PushRecord& record) {
  std::map<std::string, std::vector<uint8_t>> out;
  for (const refit::v1::PushRequest& m : record.messages) {
    if (!m.has_chunks()) continue;
    for (const refit::v1::Chunk& c : m.chunks().chunks()) {
      std::vector<uint8_t>& t = out[c.tensor_name()];
      EXPECT_EQ(c.byte_offset(), t.size()) << c.tensor_name();
      if (c.has_xxh3()) {
        EXPECT_EQ(c.xxh3(),
                  ChunkChecksum(absl::MakeConstSpan(
                      reinterpret_cast<const uint8_t*>(c.data().data()), c.data().size())));
      }
      t.insert(t.end(), c.data().begin(), c.data().end());
    }
  }
  return out;
}

TEST(RefitClientTest, PushSendsBeginBucketsAndEnd) {
  FakeServer server;
  refit::v1::RefitResult result;
  result.set_refit_id("r-1");
  result.set_version(8);
  server.service().SetPushResult(result);
  auto client = Connect(server);

  std::vector<uint8_t> a = Bytes(1000, 1), b = Bytes(64, 2), c = Bytes(3000, 3);
  std::vector<TensorRef> tensors = {
      {"a", refit::v1::DTYPE_BF16, {500}, a},
      {"b", refit::v1::DTYPE_F32, {4, 4}, b},
      {"c", refit::v1::DTYPE_F16, {3, 500}, c},
  };
  PushOptions options;
  options.model_group = "target";
  options.base_version = 7;
  options.completion = refit::v1::COMPLETION_MODE_PREPARE;
  options.label = "step-12";
  options.bucket_bytes = 1024;
  options.max_chunk_bytes = 600;
  absl::StatusOr<refit::v1::RefitResult> pushed = client->Push(tensors, options);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(pushed->refit_id(), "r-1");
  EXPECT_EQ(pushed->version(), 8u);

  std::vector<testing::FakeRefitService::PushRecord> pushes = server.service().pushes();
  ASSERT_EQ(pushes.size(), 1u);
  const auto& messages = pushes[0].messages;
  ASSERT_GE(messages.size(), 3u);
  ASSERT_TRUE(messages.front().has_begin());
  EXPECT_EQ(messages.front().begin().model_group(), "target");
  EXPECT_EQ(messages.front().begin().options().completion(), refit::v1::COMPLETION_MODE_PREPARE);
  EXPECT_EQ(messages.front().begin().options().base_version(), 7u);
  EXPECT_EQ(messages.front().begin().options().label(), "step-12");
  EXPECT_EQ(messages.front().begin().options().non_finite(), refit::v1::NON_FINITE_POLICY_REJECT);
  EXPECT_TRUE(messages.back().has_end());
  for (size_t i = 1; i + 1 < messages.size(); ++i) {
    ASSERT_TRUE(messages[i].has_chunks());
    size_t bytes = 0;
    for (const auto& chunk : messages[i].chunks().chunks()) {
      EXPECT_LE(chunk.data().size(), 600u);
      EXPECT_EQ(chunk.byte_offset() % 2, 0u) << "element-aligned";
      EXPECT_TRUE(chunk.has_xxh3());
      bytes += chunk.data().size();
    }
    EXPECT_LE(bytes, 1024u);
  }
  // 4064 bytes in buckets of 1 KiB: 3 full messages plus the rest.
  EXPECT_EQ(messages.size(), 2u + 4u);
  auto got = Reassemble(pushes[0]);
  EXPECT_EQ(got["a"], a);
  EXPECT_EQ(got["b"], b);
  EXPECT_EQ(got["c"], c);
}

TEST(RefitClientTest, PushOverStreamsSplitsTheTensorsByBytes) {
  FakeServer server;
  refit::v1::RefitResult result;
  result.set_refit_id("multi");
  server.service().SetPushResult(result);
  auto client = Connect(server);
  // 3000 + 1000 + 1000 + 600 + 400 bytes: 3000 on one stream, the rest
  // (3000) on the other.
  std::vector<uint8_t> a = Bytes(3000, 1), b = Bytes(1000, 2), c = Bytes(1000, 3),
                       d = Bytes(600, 4), e = Bytes(400, 5);
  std::vector<TensorRef> tensors = {
      {"a", refit::v1::DTYPE_BF16, {1500}, a}, {"b", refit::v1::DTYPE_BF16, {500}, b},
      {"c", refit::v1::DTYPE_BF16, {500}, c},  {"d", refit::v1::DTYPE_BF16, {300}, d},
      {"e", refit::v1::DTYPE_BF16, {200}, e},
  };
  PushOptions options;
  options.streams = 2;
  options.refit_id = "multi";
  options.label = "split";
  std::vector<uint64_t> progress;
  options.on_progress = [&](const PushProgress& p) { progress.push_back(p.bytes_sent); };
  absl::StatusOr<refit::v1::RefitResult> pushed = client->Push(tensors, options);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(pushed->refit_id(), "multi");

  std::vector<testing::FakeRefitService::PushRecord> pushes = server.service().pushes();
  ASSERT_EQ(pushes.size(), 2u);
  std::map<std::string, std::vector<uint8_t>> all;
  int openers = 0;
  for (const auto& push : pushes) {
    ASSERT_TRUE(push.messages.front().has_begin());
    const refit::v1::Begin& begin = push.messages.front().begin();
    if (begin.join_refit_id().empty()) {
      ++openers;
      EXPECT_EQ(begin.refit_id(), "multi");
      EXPECT_EQ(begin.streams(), 2u);
      EXPECT_EQ(begin.options().label(), "split");
    } else {
      EXPECT_EQ(begin.join_refit_id(), "multi");
      EXPECT_FALSE(begin.has_options());
      EXPECT_EQ(begin.model_group(), "");
    }
    EXPECT_TRUE(push.messages.back().has_end());
    size_t bytes = 0;
    for (const auto& [name, data] : Reassemble(push)) {
      bytes += data.size();
      EXPECT_TRUE(all.emplace(name, data).second) << name << " sent on two streams";
    }
    EXPECT_EQ(bytes, 3000u);  // balanced by bytes
  }
  EXPECT_EQ(openers, 1);
  EXPECT_EQ(all["a"], a);
  EXPECT_EQ(all["e"], e);
  EXPECT_EQ(all.size(), 5u);
  ASSERT_FALSE(progress.empty());
  EXPECT_EQ(progress.back(), 6000u);
}

TEST(RefitClientTest, PushOverStreamsRefusesZeroStreamsLocally) {
  FakeServer server;
  auto client = Connect(server);
  std::vector<uint8_t> a = Bytes(4, 1);
  std::vector<TensorRef> tensors = {{"a", refit::v1::DTYPE_BF16, {2}, a}};
  PushOptions options;
  options.streams = 0;
  absl::StatusOr<refit::v1::RefitResult> pushed = client->Push(tensors, options);
  EXPECT_EQ(pushed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pushed.status().message(), HasSubstr("streams must be at least 1"));
  EXPECT_TRUE(server.service().pushes().empty());
}

TEST(RefitClientTest, PushPacksSmallTensorsIntoOneMessage) {
  FakeServer server;
  auto client = Connect(server);
  std::vector<std::vector<uint8_t>> data;
  std::vector<TensorRef> tensors;
  for (int i = 0; i < 10; ++i) data.push_back(Bytes(40, i));
  for (int i = 0; i < 10; ++i) {
    tensors.push_back({"t" + std::to_string(i), refit::v1::DTYPE_F32, {10}, data[i]});
  }
  PushOptions options;
  options.checksums = false;
  ASSERT_TRUE(client->Push(tensors, options).ok());
  auto pushes = server.service().pushes();
  ASSERT_EQ(pushes.size(), 1u);
  ASSERT_EQ(pushes[0].messages.size(), 3u);  // begin, one bucket, end
  EXPECT_EQ(pushes[0].messages[1].chunks().chunks_size(), 10);
  EXPECT_FALSE(pushes[0].messages[1].chunks().chunks(0).has_xxh3());
}

TEST(RefitClientTest, PushReportsProgressAfterEveryMessage) {
  FakeServer server;
  auto client = Connect(server);
  std::vector<uint8_t> a = Bytes(4096, 1);
  std::vector<TensorRef> tensors = {{"a", refit::v1::DTYPE_U8, {4096}, a}};
  std::vector<PushProgress> seen;
  PushOptions options;
  options.bucket_bytes = 1024;
  options.on_progress = [&](const PushProgress& p) { seen.push_back(p); };
  ASSERT_TRUE(client->Push(tensors, options).ok());
  ASSERT_EQ(seen.size(), 4u);
  EXPECT_EQ(seen[0].bytes_sent, 1024u);
  EXPECT_EQ(seen.back().bytes_sent, 4096u);
  EXPECT_EQ(seen.back().bytes_total, 4096u);
  EXPECT_EQ(seen.back().tensors_total, 1u);
  EXPECT_EQ(seen.back().messages_sent, 4u);
}

TEST(RefitClientTest, PushRejectsSizeMismatchWithoutCallingTheDaemon) {
  FakeServer server;
  auto client = Connect(server);
  std::vector<uint8_t> a = Bytes(10, 1);
  std::vector<TensorRef> tensors = {{"w", refit::v1::DTYPE_BF16, {2, 3}, a}};
  absl::StatusOr<refit::v1::RefitResult> r = client->Push(tensors, PushOptions());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("'w' has 10 bytes, its shape needs 12"));
  EXPECT_TRUE(server.service().pushes().empty());
  EXPECT_EQ(client->Push({}, PushOptions()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RefitClientTest, PushIsNeverRetried) {
  FakeServer server;
  server.service().SetPushStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "draining"));
  auto client = Connect(server);
  std::vector<uint8_t> a = Bytes(8, 1);
  std::vector<TensorRef> tensors = {{"a", refit::v1::DTYPE_U8, {8}, a}};
  absl::StatusOr<refit::v1::RefitResult> r = client->Push(tensors, PushOptions());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(r.status().message(), "draining");
  EXPECT_EQ(server.service().pushes().size(), 1u);
}

TEST(RefitClientTest, PushReturnsTheDaemonsRefusal) {
  FakeServer server;
  server.service().SetPushStatus(
      grpc::Status(grpc::StatusCode::ABORTED, "refit r-9 is active on group target"));
  auto client = Connect(server);
  std::vector<uint8_t> a = Bytes(8, 1);
  std::vector<TensorRef> tensors = {{"a", refit::v1::DTYPE_U8, {8}, a}};
  absl::StatusOr<refit::v1::RefitResult> r = client->Push(tensors, PushOptions());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(r.status().message(), HasSubstr("r-9"));
}

TEST(RefitClientTest, SendsTheBearerToken) {
  FakeServer server;
  ClientOptions options;
  options.token = "s3cret";
  auto client = Connect(server, options);
  ASSERT_TRUE(client->GetStatus().ok());
  EXPECT_EQ(server.service().last_authorization(), "Bearer s3cret");
}

TEST(RefitClientTest, GetStatusRetriesUnavailable) {
  FakeServer server;
  server.service().FailGetStatus({grpc::Status(grpc::StatusCode::UNAVAILABLE, "busy"),
                                  grpc::Status(grpc::StatusCode::UNAVAILABLE, "busy")});
  auto client = Connect(server);
  absl::StatusOr<refit::v1::GetStatusResponse> status = client->GetStatus("target");
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->version(), 7u);
  EXPECT_EQ(status->model_group(), "target");
  EXPECT_EQ(server.service().status_calls(), 3);
}

TEST(RefitClientTest, GetStatusGivesUpAfterMaxAttempts) {
  FakeServer server;
  server.service().FailGetStatus(
      std::vector<grpc::Status>(10, grpc::Status(grpc::StatusCode::UNAVAILABLE, "busy")));
  ClientOptions options;
  options.retry.max_attempts = 3;
  auto client = Connect(server, options);
  EXPECT_EQ(client->GetStatus().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(server.service().status_calls(), 3);
}

TEST(RefitClientTest, GetStatusDoesNotRetryOtherErrors) {
  FakeServer server;
  server.service().FailGetStatus(
      {grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "role reader needed")});
  auto client = Connect(server);
  absl::StatusOr<refit::v1::GetStatusResponse> status = client->GetStatus();
  EXPECT_EQ(status.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(server.service().status_calls(), 1);
}

TEST(RefitClientTest, UnreachableDaemonIsUnavailable) {
  ClientOptions options;
  options.address = "unix:/nonexistent/refitd.sock";
  options.retry.max_attempts = 2;
  options.retry.initial_backoff = absl::Milliseconds(1);
  options.timeout = absl::Seconds(5);
  auto client = RefitClient::Create(options);
  ASSERT_TRUE(client.ok());
  EXPECT_EQ((*client)->GetStatus().status().code(), absl::StatusCode::kUnavailable);
}

TEST(RefitClientTest, WaitForReadyWaitsUntilTheDeadlineForAnAbsentDaemon) {
  ClientOptions options;
  options.address = "unix:/nonexistent/refitd.sock";
  options.wait_for_ready = true;
  options.timeout = absl::Milliseconds(300);
  auto client = RefitClient::Create(options);
  ASSERT_TRUE(client.ok());
  // Waited for the daemon, then gave up at the call's deadline.
  EXPECT_EQ((*client)->GetStatus().status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ((*client)->HealthCheck("").status().code(), absl::StatusCode::kDeadlineExceeded);
  // Calls that change the daemon never wait.
  EXPECT_EQ((*client)->Commit("", "r-1").status().code(), absl::StatusCode::kUnavailable);
}

TEST(RefitClientTest, WaitUntilServingFollowsReadiness) {
  FakeServer server;
  auto health = server.server().GetHealthCheckService();
  health->SetServingStatus(kReadinessService, false);
  auto client = Connect(server);
  absl::Status early = client->WaitUntilServing(absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(early.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(early.message(), HasSubstr("last seen: NOT_SERVING"));
  std::thread ready([&] { health->SetServingStatus(kReadinessService, true); });
  absl::Status waited = client->WaitUntilServing(absl::Now() + absl::Seconds(60));
  ready.join();
  EXPECT_TRUE(waited.ok()) << waited;
}

TEST(RefitClientTest, WaitUntilServingOfAnAbsentDaemonSaysUnreachable) {
  ClientOptions options;
  options.address = "unix:/nonexistent/refitd.sock";
  auto client = RefitClient::Create(options);
  ASSERT_TRUE(client.ok());
  absl::Status status = (*client)->WaitUntilServing(absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(status.message(), HasSubstr("unix:/nonexistent/refitd.sock"));
  EXPECT_THAT(status.message(), HasSubstr("last seen: unreachable"));
}

TEST(RefitClientTest, WatchEndsAtItsDeadline) {
  FakeServer server;  // its Watch stays open after four events
  auto client = Connect(server);
  int events = 0;
  absl::Status s = client->Watch(
      "",
      [&](const refit::v1::WatchEvent&) {
        ++events;
        return true;
      },
      absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_EQ(events, 4);
}

TEST(RefitClientTest, CreateRejectsPortsOutsideTheRange) {
  for (const char* bad : {"127.0.0.1:500510", "localhost:65536", "dns:///localhost:70000",
                          "[::1]:123456", "127.0.0.1:", "ipv4:127.0.0.1:1,127.0.0.1:99999"}) {
    ClientOptions options;
    options.address = bad;
    absl::StatusOr<std::unique_ptr<RefitClient>> client = RefitClient::Create(options);
    EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(client.status().message(), HasSubstr(absl::StrCat("\"", bad, "\""))) << bad;
  }
  // A Unix socket path longer than a socket address holds (107 bytes).
  const std::string long_unix = "unix:/" + std::string(107, 'd');
  for (const std::string& bad : {long_unix, "unix:///" + std::string(107, 'd')}) {
    ClientOptions options;
    options.address = bad;
    absl::StatusOr<std::unique_ptr<RefitClient>> client = RefitClient::Create(options);
    EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(client.status().message(), HasSubstr("its socket path is 108 bytes")) << bad;
  }
  for (const std::string& ok : std::vector<std::string>{
           "127.0.0.1:0", "127.0.0.1:65535", "localhost", "dns:///localhost:50051", "[::1]:50051",
           "unix:/tmp/x.sock", "unix-abstract:x", "unix:/" + std::string(106, 'd'),
           "unix:r.sock"}) {
    ClientOptions options;
    options.address = ok;
    EXPECT_TRUE(RefitClient::Create(options).ok()) << ok;
  }
}

TEST(RefitClientTest, ReadTensorReassemblesPieces) {
  FakeServer server;
  server.service().SetTensor("model.norm.weight", "0123456789abcdefghij-");
  auto client = Connect(server);
  absl::StatusOr<ReadTensorResult> r = client->ReadTensor("", "model.norm.weight");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->data, "0123456789abcdefghij-");
  EXPECT_EQ(r->version, 7u);
  EXPECT_EQ(r->info.name(), "model.norm.weight");
  EXPECT_EQ(client->ReadTensor("", "nope").status().code(), absl::StatusCode::kNotFound);
}

TEST(RefitClientTest, ReadTensorRejectsMixedVersions) {
  FakeServer server;
  server.service().SetTensor("t", "0123456789abcdefghij", /*mix_versions=*/true);
  auto client = Connect(server);
  absl::StatusOr<ReadTensorResult> r = client->ReadTensor("", "t");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(r.status().message(), HasSubstr("mixes versions 7 and 8"));
}

TEST(RefitClientTest, AnUnpinnedReadACommitInterruptsIsReadAgainAPinnedOneIsNot) {
  FakeServer server;
  server.service().SetTensor("t", "0123456789");
  auto client = Connect(server);
  // Unpinned: any version will do, so it reads again.
  server.service().InterruptReads(2);
  absl::StatusOr<ReadTensorResult> r = client->ReadTensor("", "t");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->data, "0123456789");
  EXPECT_EQ(server.service().read_calls(), 3);
  // ... a bounded number of times.
  server.service().InterruptReads(100);
  r = client->ReadTensor("", "t");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(server.service().read_calls(), 3 + RefitClient::kUnpinnedReadAttempts);
  // Pinned: the version is gone, reading it again cannot help.
  server.service().InterruptReads(1);
  r = client->ReadTensor("", "t", 0, 7);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(server.service().read_calls(), 4 + RefitClient::kUnpinnedReadAttempts);
}

TEST(RefitClientTest, TheAttemptsOfAReadShareOneDeadline) {
  // Each attempt fits the timeout; all of them together do not. A client
  // giving each attempt the whole timeout would end ABORTED (reads) or
  // UNAVAILABLE (GetStatus) after 4 or 10 attempts instead.
  FakeServer server;
  server.service().SetTensor("t", "0123456789");
  server.service().SetDelay(absl::Milliseconds(300));
  ClientOptions options;
  options.timeout = absl::Milliseconds(500);
  options.retry.max_attempts = 10;
  auto client = Connect(server, options);
  server.service().InterruptReads(100);
  absl::StatusOr<ReadTensorResult> r = client->ReadTensor("", "t");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  server.service().FailGetStatus(std::vector<grpc::Status>(
      10, grpc::Status(grpc::StatusCode::UNAVAILABLE, "the daemon is restarting")));
  absl::StatusOr<refit::v1::GetStatusResponse> status = client->GetStatus();
  EXPECT_EQ(status.status().code(), absl::StatusCode::kDeadlineExceeded) << status.status();
}

TEST(RefitClientTest, AFingerprintPinADaemonDoesNotAnswerIsRefused) {
  // A daemon that ignores the pin serves whatever is live: the client checks
  // the fingerprint that comes back (this fake sends none).
  FakeServer server;
  server.service().SetTensor("t", "0123456789");
  auto client = Connect(server);
  absl::StatusOr<ReadTensorResult> r = client->ReadTensor("", "t", 0, 7, "0011223344556677");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("does not answer fingerprint pins"));
}

TEST(RefitClientTest, ReloadStreamsProgressThenResult) {
  FakeServer server;
  auto client = Connect(server);
  refit::v1::ReloadRequest request;
  request.set_path("/ckpt/step-3");
  std::vector<uint32_t> layers;
  absl::StatusOr<refit::v1::RefitResult> r = client->Reload(
      request, [&](const refit::v1::Progress& p) { layers.push_back(p.layers_done()); });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->refit_id(), "reload-of-/ckpt/step-3");
  EXPECT_EQ(layers, (std::vector<uint32_t>{1, 2, 3}));
}

TEST(RefitClientTest, CommitAndAbortPassTheRefitId) {
  FakeServer server;
  auto client = Connect(server);
  absl::StatusOr<refit::v1::RefitResult> c = client->Commit("target", "r-5");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->refit_id(), "r-5");
  EXPECT_EQ(c->state(), refit::v1::REFIT_STATE_COMMITTED);
  absl::StatusOr<refit::v1::AbortResponse> a = client->Abort("target", "r-6", "bad step");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->refit_id(), "r-6");
  EXPECT_EQ(client->Abort("", "unknown", "").status().code(), absl::StatusCode::kNotFound);
}

TEST(RefitClientTest, ListTensorsPassesTheLayout) {
  FakeServer server;
  auto client = Connect(server);
  auto kernel = client->ListTensors("", refit::v1::ListTensorsRequest::LAYOUT_KERNEL);
  ASSERT_TRUE(kernel.ok());
  EXPECT_EQ(kernel->tensors(0).name(), "model.norm.weight");
  auto ckpt = client->ListTensors("", refit::v1::ListTensorsRequest::LAYOUT_CHECKPOINT);
  ASSERT_TRUE(ckpt.ok());
  EXPECT_EQ(ckpt->tensors(0).name(), "model.norm.weight(ckpt)");
}

TEST(RefitClientTest, WatchStopsWhenTheCallbackSaysSo) {
  FakeServer server;
  auto client = Connect(server);
  std::vector<refit::v1::WatchEvent> events;
  absl::Status s = client->Watch("", [&](const refit::v1::WatchEvent& e) {
    events.push_back(e);
    return events.size() < 3;
  });
  EXPECT_TRUE(s.ok()) << s;
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].type(), refit::v1::WatchEvent::TYPE_SNAPSHOT);
  EXPECT_EQ(events[1].type(), refit::v1::WatchEvent::TYPE_COMMITTED);
}

TEST(RefitClientTest, HealthCheckAndWatch) {
  FakeServer server;
  server.server().GetHealthCheckService()->SetServingStatus(kReadinessService, false);
  auto client = Connect(server);
  EXPECT_EQ(*client->HealthCheck(""), HealthCheckResponse::SERVING);
  EXPECT_EQ(*client->HealthCheck(kReadinessService), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(client->HealthCheck("no.such.Service").status().code(), absl::StatusCode::kNotFound);

  std::vector<HealthCheckResponse::ServingStatus> seen;
  absl::Status s = client->HealthWatch(kReadinessService, [&](auto status) {
    seen.push_back(status);
    if (seen.size() == 1) {
      server.server().GetHealthCheckService()->SetServingStatus(kReadinessService, true);
    }
    return status != HealthCheckResponse::SERVING;
  });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(seen, (std::vector<HealthCheckResponse::ServingStatus>{HealthCheckResponse::NOT_SERVING,
                                                                   HealthCheckResponse::SERVING}));
}

TEST(RefitClientTest, CreateRejectsAnEmptyAddressAndHalfAClientCertificate) {
  ClientOptions options;
  options.address = "";
  absl::StatusOr<std::unique_ptr<RefitClient>> client = RefitClient::Create(options);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(client.status().message(), HasSubstr("empty daemon address"));

  char pattern[] = "/tmp/refit_client_tls_XXXXXX";
  ASSERT_NE(::mkdtemp(pattern), nullptr);
  const std::string cert = std::string(pattern) + "/client.pem";
  std::ofstream(cert) << "not a real certificate";
  options.address = "127.0.0.1:1";
  options.tls_cert_file = cert;
  client = RefitClient::Create(options);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(client.status().message(), HasSubstr("needs both --tls-cert and --tls-key"));
  ::unlink(cert.c_str());
  ::rmdir(pattern);
}

TEST(RefitClientTest, CreateWithAMissingTlsFileIsNotFound) {
  ClientOptions options;
  options.tls_ca_file = "/nonexistent/ca.pem";
  absl::StatusOr<std::unique_ptr<RefitClient>> client = RefitClient::Create(options);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(client.status().message(), HasSubstr("TLS CA file /nonexistent/ca.pem"));
}

TEST(RefitClientTest, CreateWithAnUnreadableTlsFileIsPermissionDenied) {
  if (::geteuid() == 0) GTEST_SKIP() << "root reads files regardless of mode";
  char pattern[] = "/tmp/refit_client_tls_XXXXXX";
  ASSERT_NE(::mkdtemp(pattern), nullptr);
  const std::string key = std::string(pattern) + "/key.pem";
  std::ofstream(key) << "secret";
  ASSERT_EQ(::chmod(key.c_str(), 0), 0);
  ClientOptions options;
  options.tls_ca_file = key;
  absl::StatusOr<std::unique_ptr<RefitClient>> client = RefitClient::Create(options);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(client.status().message(), HasSubstr(key));
  ::unlink(key.c_str());
  ::rmdir(pattern);
}

TEST(RefitClientTest, PushRejectsBadTensorsAndSizesLocally) {
  FakeServer server;
  auto client = Connect(server);
  std::vector<uint8_t> a = Bytes(8, 1);
  struct Case {
    TensorRef tensor;
    size_t bucket_bytes;
    const char* message;
  };
  const Case cases[] = {
      {{"w", refit::v1::DTYPE_U8, {8}, a}, 0, "bucket and chunk sizes must be positive"},
      {{"w.unspecified", refit::v1::DTYPE_UNSPECIFIED, {8}, a},
       1024,
       "tensor 'w.unspecified' has an unspecified dtype"},
      {{"w.negative", refit::v1::DTYPE_U8, {-8}, a},
       1024,
       "tensor 'w.negative' has a negative dimension"},
  };
  for (const Case& c : cases) {
    PushOptions options;
    options.bucket_bytes = c.bucket_bytes;
    absl::StatusOr<refit::v1::RefitResult> r = client->Push({c.tensor}, options);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(r.status().message(), HasSubstr(c.message));
  }
  absl::StatusOr<refit::v1::RefitResult> empty = client->Push({}, PushOptions());
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.status().message(), HasSubstr("no tensors"));
  EXPECT_TRUE(server.service().pushes().empty());
}

TEST(RefitClientTest, PushPassesEveryDaemonCodeAndMessageOn) {
  // What refitd answers a Push with (see the errors on Push's declaration).
  const std::pair<grpc::StatusCode, const char*> refusals[] = {
      {grpc::StatusCode::ABORTED, "base version 5 is not the live version 7"},
      {grpc::StatusCode::NOT_FOUND, "unknown tensor 'model.layers.9.w'"},
      {grpc::StatusCode::INVALID_ARGUMENT, "tensor 'w': shape [2, 3], expected [3, 2]"},
      {grpc::StatusCode::ALREADY_EXISTS, "tensor 'w': bytes [0, 4) received twice"},
      {grpc::StatusCode::OUT_OF_RANGE, "tensor 'w': chunk ends past byte 12"},
      {grpc::StatusCode::DATA_LOSS, "tensor 'w': checksum mismatch"},
      {grpc::StatusCode::FAILED_PRECONDITION, "layer 'model.layers.0.mlp' misses tensors"},
      {grpc::StatusCode::RESOURCE_EXHAUSTED, "staging budget of 1 MiB exceeded"},
      {grpc::StatusCode::DEADLINE_EXCEEDED, "no message for 30s"},
      {grpc::StatusCode::UNAUTHENTICATED, "Push: unknown token"},
      {grpc::StatusCode::PERMISSION_DENIED, "Push: role reader may not push"},
  };
  FakeServer server;
  auto client = Connect(server);
  std::vector<uint8_t> a = Bytes(8, 1);
  std::vector<TensorRef> tensors = {{"a", refit::v1::DTYPE_U8, {8}, a}};
  for (const auto& [code, message] : refusals) {
    server.service().SetPushStatus(grpc::Status(code, message));
    absl::StatusOr<refit::v1::RefitResult> r = client->Push(tensors, PushOptions());
    EXPECT_EQ(r.status().code(), static_cast<absl::StatusCode>(code)) << message;
    EXPECT_EQ(r.status().message(), message);
  }
}

TEST(RefitClientTest, TimeoutIsDeadlineExceeded) {
  FakeServer server;
  server.service().HangCommit();
  ClientOptions options;
  options.timeout = absl::Milliseconds(50);
  auto client = Connect(server, options);
  absl::StatusOr<refit::v1::RefitResult> c = client->Commit("target", "r-5");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(c.status().message(), HasSubstr("Deadline Exceeded"));
}

TEST(RefitClientTest, ReloadWithoutAResultIsDataLoss) {
  FakeServer server;
  server.service().SetReloadWithoutResult();
  auto client = Connect(server);
  refit::v1::ReloadRequest request;
  request.set_path("/ckpt/step-3");
  int progress = 0;
  absl::StatusOr<refit::v1::RefitResult> r =
      client->Reload(request, [&](const refit::v1::Progress&) { ++progress; });
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(r.status().message(), HasSubstr("ended without a result"));
  EXPECT_EQ(progress, 3);
}

TEST(RefitClientTest, ReloadPassesTheDaemonsRefusalOn) {
  FakeServer server;
  server.service().Fail("Reload", grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                                               "Reload: path /etc resolves outside /models"));
  auto client = Connect(server);
  refit::v1::ReloadRequest request;
  request.set_path("/etc");
  absl::StatusOr<refit::v1::RefitResult> r = client->Reload(request);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(r.status().message(), HasSubstr("outside /models"));
}

TEST(RefitClientTest, CommitPassesTheDaemonsCodesOn) {
  FakeServer server;
  server.service().Fail(
      "Commit", grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                             "refit \"r-5\" is still receiving; it can be committed once it is "
                             "PREPARED"));
  auto client = Connect(server);
  absl::StatusOr<refit::v1::RefitResult> c = client->Commit("target", "r-5");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(c.status().message(), HasSubstr("\"r-5\" is still receiving"));
  server.service().Fail("Commit", grpc::Status(grpc::StatusCode::NOT_FOUND,
                                               "model group \"target\" has no refit \"r-6\""));
  c = client->Commit("target", "r-6");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr("no refit \"r-6\""));
}

TEST(RefitClientTest, AbortPassesTheDaemonsCodesOn) {
  FakeServer server;
  auto client = Connect(server);
  absl::StatusOr<refit::v1::AbortResponse> a = client->Abort("", "unknown", "");
  EXPECT_EQ(a.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(a.status().message(), HasSubstr("no refit 'unknown'"));
  server.service().Fail("Abort", grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                                              "Abort: refit r-7 belongs to trainer-a"));
  a = client->Abort("", "r-7", "");
  EXPECT_EQ(a.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(a.status().message(), HasSubstr("r-7 belongs to trainer-a"));
}

TEST(RefitClientTest, ListTensorsPassesTheDaemonsCodesOn) {
  FakeServer server;
  server.service().Fail("ListTensors", grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                                    "ListTensors: layout must be LAYOUT_KERNEL or "
                                                    "LAYOUT_CHECKPOINT"));
  auto client = Connect(server);
  auto r = client->ListTensors("", refit::v1::ListTensorsRequest::LAYOUT_UNSPECIFIED);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("LAYOUT_KERNEL or LAYOUT_CHECKPOINT"));
}

TEST(RefitClientTest, GetStatusOfAnUnknownGroupIsNotFound) {
  FakeServer server;
  server.service().FailGetStatus(
      {grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown model group \"draft\"")});
  auto client = Connect(server);
  absl::StatusOr<refit::v1::GetStatusResponse> status = client->GetStatus("draft");
  EXPECT_EQ(status.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.status().message(), HasSubstr("\"draft\""));
  EXPECT_EQ(server.service().status_calls(), 1);
}

TEST(RefitClientTest, ReadTensorRejectsGapsShortAndEmptyStreams) {
  FakeServer server;
  auto client = Connect(server);
  server.service().SetTensor("t", "0123456789abcdefghij-");
  absl::StatusOr<ReadTensorResult> nope = client->ReadTensor("", "nope");
  EXPECT_EQ(nope.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(nope.status().message(), HasSubstr("no tensor nope"));

  server.service().SetReadFault(testing::FakeRefitService::ReadFault::kGap);
  absl::StatusOr<ReadTensorResult> r = client->ReadTensor("", "t");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(r.status().message(), HasSubstr("read t: piece at offset 10, expected 5"));

  server.service().SetReadFault(testing::FakeRefitService::ReadFault::kShort);
  r = client->ReadTensor("", "t");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(r.status().message(), HasSubstr("read t: got 21 bytes, expected 22"));

  server.service().SetReadFault(testing::FakeRefitService::ReadFault::kEmptyStream);
  r = client->ReadTensor("", "t");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(r.status().message(), HasSubstr("read t: empty stream"));
}

TEST(RefitClientTest, WatchReturnsTheStreamsError) {
  FakeServer server;
  server.service().Fail("Watch",
                        grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown model group \"draft\""));
  auto client = Connect(server);
  int events = 0;
  absl::Status s = client->Watch("draft", [&](const refit::v1::WatchEvent&) {
    ++events;
    return true;
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("\"draft\""));
  EXPECT_EQ(events, 0);
}

TEST(RefitClientTest, EveryCallToAnUnreachableDaemonIsUnavailable) {
  ClientOptions options;
  options.address = "unix:/nonexistent/refitd.sock";
  options.retry.max_attempts = 2;
  options.retry.initial_backoff = absl::Milliseconds(1);
  options.timeout = absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<RefitClient>> created = RefitClient::Create(options);
  ASSERT_TRUE(created.ok()) << created.status();
  RefitClient& client = **created;
  std::vector<uint8_t> a = Bytes(8, 1);
  std::vector<TensorRef> tensors = {{"a", refit::v1::DTYPE_U8, {8}, a}};
  EXPECT_EQ(client.Push(tensors, PushOptions()).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client.Reload(refit::v1::ReloadRequest()).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(client.Commit("", "r-1").status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client.Abort("", "r-1", "").status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client.ListTensors("", refit::v1::ListTensorsRequest::LAYOUT_KERNEL).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(client.ReadTensor("", "t").status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client.HealthCheck("").status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client.Watch("", [](const refit::v1::WatchEvent&) { return true; }).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(client.HealthWatch("", [](auto) { return true; }).code(),
            absl::StatusCode::kUnavailable);
}

// A safetensors file written by hand: 8-byte length, JSON, data.
std::string WriteSafetensors(const std::string& path, const std::string& header,
                             const std::string& data) {
  std::ofstream out(path, std::ios::binary);
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
  out << header << data;
  return path;
}

// POSIX, not std::filesystem: this directory's tests link LibTorch (through
// refitctl_lib), and libtorch.so exports broken std::filesystem symbols.
class PushFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/refit_client_test_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    ::nftw(
        dir_.c_str(),
        [](const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }, 8,
        FTW_DEPTH | FTW_PHYS);
  }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

TEST_F(PushFilesTest, PushesEveryTensorOfTheFiles) {
  WriteSafetensors(Path("model-1.safetensors"),
                   R"({"__metadata__":{"format":"pt"},)"
                   R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]},)"
                   R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                   "AAAABBBB");
  WriteSafetensors(Path("model-2.safetensors"),
                   R"({"c":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}})", "CCC");
  absl::StatusOr<std::vector<std::string>> files = ExpandSafetensorsPaths({dir_});
  ASSERT_TRUE(files.ok()) << files.status();
  ASSERT_EQ(files->size(), 2u);

  FakeServer server;
  auto client = Connect(server);
  ASSERT_TRUE(client->PushFiles(*files, PushOptions()).ok());
  auto pushes = server.service().pushes();
  ASSERT_EQ(pushes.size(), 1u);
  ASSERT_EQ(pushes[0].messages.size(), 3u);
  const auto& chunks = pushes[0].messages[1].chunks().chunks();
  ASSERT_EQ(chunks.size(), 3);
  EXPECT_EQ(chunks[0].tensor_name(), "a");  // data-offset order
  EXPECT_EQ(chunks[0].dtype(), refit::v1::DTYPE_F32);
  EXPECT_EQ(chunks[1].tensor_name(), "b");
  EXPECT_EQ(chunks[1].data(), "BBBB");
  EXPECT_EQ(chunks[2].tensor_name(), "c");
  EXPECT_EQ(chunks[2].shape(0), 3);
}

TEST_F(PushFilesTest, FileTruncatedDuringThePushFailsItInsteadOfCrashing) {
  // With the files mapped, the truncation below made the next chunk's read
  // fault (SIGBUS) and killed the pushing process.
  const std::string path = Path("model.safetensors");
  WriteSafetensors(path,
                   R"({"a":{"dtype":"U8","shape":[4096],"data_offsets":[0,4096]},)"
                   R"("b":{"dtype":"U8","shape":[4096],"data_offsets":[4096,8192]}})",
                   std::string(8192, 'x'));
  FakeServer server;
  auto client = Connect(server);
  PushOptions options;
  options.bucket_bytes = 4096;  // one tensor per message
  bool truncated = false;
  options.on_progress = [&](const PushProgress&) {
    if (!truncated) truncated = ::truncate(path.c_str(), 100) == 0;
  };
  absl::StatusOr<refit::v1::RefitResult> result = client->PushFiles({path}, options);
  EXPECT_TRUE(truncated);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition) << result.status();
  EXPECT_THAT(result.status().message(), HasSubstr(path));
  EXPECT_THAT(result.status().message(), HasSubstr("tensor 'b'"));
  EXPECT_THAT(result.status().message(), HasSubstr("changed while being read"));
}

TEST_F(PushFilesTest, MalformedFilesAreInvalidArgumentNamingTheTensor) {
  WriteSafetensors(Path("bad.safetensors"),
                   R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}})", "XXXX");
  auto view = SafetensorsView::Open(Path("bad.safetensors"));
  EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(view.status().message(), HasSubstr("tensor 'w'"));

  WriteSafetensors(Path("past.safetensors"),
                   R"({"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})", "XXXX");
  view = SafetensorsView::Open(Path("past.safetensors"));
  EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(view.status().message(), HasSubstr("outside the data section"));

  WriteSafetensors(Path("json.safetensors"), "{not json", "");
  view = SafetensorsView::Open(Path("json.safetensors"));
  EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument);

  EXPECT_EQ(SafetensorsView::Open(Path("missing.safetensors")).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(ExpandSafetensorsPaths({Path("nothing-here")}).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(PushFilesTest, PassesOpenErrorsOnAndRefusesFilesWithoutTensors) {
  FakeServer server;
  auto client = Connect(server);
  absl::StatusOr<refit::v1::RefitResult> r =
      client->PushFiles({Path("missing.safetensors")}, PushOptions());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr(Path("missing.safetensors")));

  WriteSafetensors(Path("bad.safetensors"),
                   R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}})", "XXXX");
  r = client->PushFiles({Path("bad.safetensors")}, PushOptions());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("tensor 'w'"));

  WriteSafetensors(Path("empty.safetensors"), R"({"__metadata__":{"format":"pt"}})", "");
  r = client->PushFiles({Path("empty.safetensors")}, PushOptions());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("no tensors"));
  EXPECT_TRUE(server.service().pushes().empty());
}

}  // namespace
}  // namespace refit::client
