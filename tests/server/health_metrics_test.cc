// grpc.health.v1 transitions (Check and Watch) over a daemon's life, and the
// Prometheus /metrics endpoint scraped over HTTP and parsed.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <string>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/version.h"
#include "tests/server/server_test_util.h"

namespace refit::server {
namespace {

using ::grpc::health::v1::Health;
using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;
using ::refit::server::testing::BeginMessage;
using ::refit::server::testing::ChunkMessages;
using ::refit::server::testing::FixtureWeights;
using ::refit::server::testing::FullPush;
using ::refit::server::testing::MakeTempDir;
using ::refit::server::testing::PushMessages;
using ::refit::server::testing::TestOptions;
using ::refit::server::testing::WatchStream;
using ::testing::HasSubstr;

grpc::Status Check(Health::Stub* health, const std::string& service,
                   HealthCheckResponse::ServingStatus* out) {
  grpc::ClientContext context;
  HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  grpc::Status status = health->Check(&context, request, &response);
  *out = response.status();
  return status;
}

TEST(HealthTest, ReadinessFollowsFirstLoadStagingAndShutdown) {
  const std::string dir = MakeTempDir();
  absl::StatusOr<std::unique_ptr<RefitServer>> created = RefitServer::Create(TestOptions(dir));
  ASSERT_TRUE(created.ok()) << created.status();
  RefitServer& server = **created;
  std::shared_ptr<grpc::Channel> channel = testing::Connect(server);
  auto health = Health::NewStub(channel);
  auto stub = v1::RefitService::NewStub(channel);

  HealthCheckResponse::ServingStatus s;
  ASSERT_TRUE(Check(health.get(), "", &s).ok());
  EXPECT_EQ(s, HealthCheckResponse::SERVING);
  ASSERT_TRUE(Check(health.get(), "refit.v1.RefitService", &s).ok());
  EXPECT_EQ(s, HealthCheckResponse::NOT_SERVING);
  EXPECT_FALSE(testing::Status(stub.get()).ready());
  EXPECT_EQ(Check(health.get(), "no.such.Service", &s).error_code(), grpc::StatusCode::NOT_FOUND);

  grpc::ClientContext watch_context;
  HealthCheckRequest watch_request;
  watch_request.set_service("refit.v1.RefitService");
  auto watch = health->Watch(&watch_context, watch_request);
  HealthCheckResponse update;
  ASSERT_TRUE(watch->Read(&update));
  EXPECT_EQ(update.status(), HealthCheckResponse::NOT_SERVING);

  ASSERT_TRUE(server.LoadInitialModel().ok());
  ASSERT_TRUE(watch->Read(&update));
  EXPECT_EQ(update.status(), HealthCheckResponse::SERVING);
  EXPECT_TRUE(testing::Status(stub.get()).ready());

  // Still SERVING while version 2 stages.
  {
    WatchStream events(stub.get());
    grpc::ClientContext push_context;
    v1::PushResponse push_response;
    auto writer = stub->Push(&push_context, &push_response);
    ASSERT_TRUE(writer->Write(BeginMessage()));
    ASSERT_TRUE(writer->Write(ChunkMessages(FixtureWeights(2)).front()));
    events.Next(v1::WatchEvent::TYPE_STAGING_STARTED);
    ASSERT_TRUE(Check(health.get(), "refit.v1.RefitService", &s).ok());
    EXPECT_EQ(s, HealthCheckResponse::SERVING);
    // The chunk was written; wait (bounded) until the daemon has ingested it.
    v1::GetStatusResponse status = testing::Status(stub.get());
    for (const absl::Time end = absl::Now() + absl::Seconds(10);
         status.active_refit().bytes_received() == 0 && absl::Now() < end;) {
      absl::SleepFor(absl::Milliseconds(5));
      status = testing::Status(stub.get());
    }
    EXPECT_TRUE(status.ready());
    EXPECT_EQ(status.version(), 1u);
    EXPECT_EQ(status.active_refit().state(), v1::REFIT_STATE_RECEIVING);
    EXPECT_GT(status.active_refit().bytes_received(), 0u);
    push_context.TryCancel();
    writer->Finish();
  }

  // Shutdown tells the watcher NOT_SERVING and then ends its stream (it does
  // not hold the shutdown until the deadline).
  std::thread stopper([&server] { server.Shutdown(); });
  ASSERT_TRUE(watch->Read(&update));
  EXPECT_EQ(update.status(), HealthCheckResponse::NOT_SERVING);
  while (watch->Read(&update)) {
    EXPECT_EQ(update.status(), HealthCheckResponse::NOT_SERVING);
  }
  EXPECT_EQ(watch->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  stopper.join();
}

TEST(HealthTest, WatchOfAnUnknownServiceReportsServiceUnknown) {
  const std::string dir = MakeTempDir();
  absl::StatusOr<std::unique_ptr<RefitServer>> server = RefitServer::Start(TestOptions(dir));
  ASSERT_TRUE(server.ok()) << server.status();
  auto health = Health::NewStub(testing::Connect(**server));
  grpc::ClientContext context;
  HealthCheckRequest request;
  request.set_service("no.such.Service");
  auto watch = health->Watch(&context, request);
  HealthCheckResponse update;
  ASSERT_TRUE(watch->Read(&update));
  EXPECT_EQ(update.status(), HealthCheckResponse::SERVICE_UNKNOWN);
  context.TryCancel();
  while (watch->Read(&update)) {
  }
  EXPECT_EQ(watch->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

// A tiny HTTP/1.0 GET, enough for one scrape.
std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    ADD_FAILURE() << "connect to metrics port " << port;
    return "";
  }
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: localhost\r\n\r\n");
  EXPECT_EQ(write(fd, request.data(), request.size()), static_cast<ssize_t>(request.size()));
  std::string response;
  char buffer[4096];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0) response.append(buffer, n);
  close(fd);
  return response;
}

// "name{labels}" -> value, for every sample line.
std::map<std::string, double> ParseMetrics(const std::string& http_response) {
  std::map<std::string, double> samples;
  const size_t body = http_response.find("\r\n\r\n");
  EXPECT_NE(body, std::string::npos);
  EXPECT_THAT(http_response.substr(0, body), HasSubstr("200"));
  EXPECT_THAT(http_response.substr(0, body), HasSubstr("text/plain"));
  for (absl::string_view line : absl::StrSplit(http_response.substr(body + 4), '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    EXPECT_NE(space, absl::string_view::npos) << line;
    double value = 0;
    EXPECT_TRUE(absl::SimpleAtod(line.substr(space + 1), &value)) << line;
    samples[std::string(line.substr(0, space))] = value;
  }
  return samples;
}

TEST(MetricsTest, ScrapeReportsRefitsBytesPhasesAndGauges) {
  const std::string dir = MakeTempDir();
  ServerOptions options = TestOptions(dir);
  options.metrics_listen = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<RefitServer>> server = RefitServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->metrics_port(), 0);
  auto stub = v1::RefitService::NewStub(testing::Connect(**server));

  std::map<std::string, double> before =
      ParseMetrics(HttpGet((*server)->metrics_port(), "/metrics"));
  EXPECT_EQ(before["refitd_refits_total{outcome=\"committed\"}"], 1);  // the first load
  // The build: the project version and git description, as --version prints.
  EXPECT_EQ(before[absl::StrCat("refitd_build_info{version=\"", core::Version(), "\",git=\"",
                                core::GitDescribe(), "\"}")],
            1);
  EXPECT_FALSE(core::Version().empty());
  EXPECT_EQ(before["refitd_version{group=\"target\"}"], 1);
  EXPECT_EQ(before["refitd_bytes_received_total"], 0);

  uint64_t pushed = 0;
  for (const core::OwnedTensor& t : FixtureWeights(4)) pushed += t.bytes.size();
  ASSERT_TRUE(PushMessages(stub.get(), FullPush(4)).status.ok());
  // One that is aborted (closed before End).
  std::vector<v1::PushRequest> incomplete = {BeginMessage(), ChunkMessages(FixtureWeights(4))[0]};
  EXPECT_EQ(PushMessages(stub.get(), incomplete).status.error_code(), grpc::StatusCode::ABORTED);

  std::map<std::string, double> after =
      ParseMetrics(HttpGet((*server)->metrics_port(), "/metrics"));
  EXPECT_EQ(after["refitd_refits_total{outcome=\"committed\"}"], 2);
  EXPECT_EQ(after["refitd_refits_total{outcome=\"aborted\"}"], 1);
  EXPECT_EQ(after["refitd_refits_total{outcome=\"failed\"}"], 0);
  EXPECT_EQ(after["refitd_refits_total{outcome=\"prepared\"}"], 0);
  uint64_t aborted_bytes = 0;
  for (const v1::Chunk& c : incomplete[1].chunks().chunks()) aborted_bytes += c.data().size();
  EXPECT_EQ(after["refitd_bytes_received_total"], static_cast<double>(pushed + aborted_bytes));
  EXPECT_EQ(after["refitd_version{group=\"target\"}"], 2);
  EXPECT_EQ(after["refitd_staging_bytes{group=\"target\"}"], 0);
  EXPECT_GE(after["refitd_last_commit_pause_seconds"], 0);
  for (const char* phase : {"receive", "quantize", "finalize", "commit"}) {
    const std::string labels = absl::StrCat("{phase=\"", phase, "\"}");
    EXPECT_EQ(after[absl::StrCat("refitd_phase_seconds_count", labels)], 2) << phase;
    EXPECT_EQ(after[absl::StrCat("refitd_phase_seconds_bucket{phase=\"", phase, "\",le=\"+Inf\"}")],
              2)
        << phase;
    EXPECT_GE(after[absl::StrCat("refitd_phase_seconds_sum", labels)], 0) << phase;
  }
  EXPECT_NE(HttpGet((*server)->metrics_port(), "/other").find("404"), std::string::npos);
}

}  // namespace
}  // namespace refit::server
