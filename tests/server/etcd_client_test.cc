// EtcdClient against a real etcd (tests/testing/etcd_process.h).
#include "server/etcd_client.h"

#include <stdlib.h>

#include <atomic>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/synchronization/notification.h"
#include "tests/testing/etcd_process.h"

namespace refit::server {
namespace {

using ::testing::HasSubstr;

class EtcdClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (refit::testing::EtcdBinary().empty()) {
      GTEST_SKIP() << "no etcd binary (apt-get install etcd-server; scripts/setup.sh does)";
    }
    std::string tmpl = ::testing::TempDir() + "/etcd_client_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    absl::StatusOr<std::unique_ptr<refit::testing::EtcdProcess>> etcd =
        refit::testing::EtcdProcess::Start(dir_);
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = std::move(*etcd);
    EtcdClientOptions options;
    options.endpoints = {etcd_->endpoint()};
    absl::StatusOr<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }
  void TearDown() override {
    client_.reset();
    etcd_.reset();
    if (!dir_.empty()) refit::testing::RemoveTree(dir_);
  }

  std::string dir_;
  std::unique_ptr<refit::testing::EtcdProcess> etcd_;
  std::unique_ptr<EtcdClient> client_;
};

TEST(EtcdClientCreateTest, RefusesMissingAndMalformedEndpoints) {
  EXPECT_EQ(EtcdClient::Create({}).status().code(), absl::StatusCode::kInvalidArgument);
  EtcdClientOptions options;
  options.endpoints = {"no-port"};
  absl::Status s = EtcdClient::Create(options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("no-port"));
}

TEST(EtcdClientCreateTest, TlsEndpointsAndFiles) {
  EtcdClientOptions options;
  options.endpoints = {"https://127.0.0.1:2379"};
  EXPECT_TRUE(EtcdClient::Create(options).ok());  // the system's roots
  options.tls_cert_file = "/nonexistent/client.pem";
  absl::Status s = EtcdClient::Create(options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("--etcd-key"));
  options.tls_cert_file.clear();
  options.tls_ca_file = "/nonexistent/ca.pem";
  s = EtcdClient::Create(options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("/nonexistent/ca.pem"));
}

TEST(EtcdClientCreateTest, UnreachableEtcdIsUnavailable) {
  EtcdClientOptions options;
  options.endpoints = {absl::StrCat("127.0.0.1:", refit::testing::PickFreePort())};
  options.timeout = absl::Milliseconds(300);
  absl::StatusOr<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(options);
  ASSERT_TRUE(client.ok());
  absl::Status s = (*client)->Get("/k").status();
  EXPECT_TRUE(s.code() == absl::StatusCode::kUnavailable ||
              s.code() == absl::StatusCode::kDeadlineExceeded)
      << s;
  EXPECT_THAT(s.message(), HasSubstr("Range"));
}

TEST(EtcdClientPrefixEndTest, IncrementsTheLastByte) {
  EXPECT_EQ(EtcdPrefixEnd("/a/"), "/a0");
  EXPECT_EQ(EtcdPrefixEnd("a\xff"), "b");
}

TEST_F(EtcdClientTest, PutGetPrefixAndDelete) {
  ASSERT_TRUE(client_->Put("/f/members/a", "1").ok());
  ASSERT_TRUE(client_->Put("/f/members/b", "2").ok());
  ASSERT_TRUE(client_->Put("/f/other", "3").ok());
  absl::StatusOr<std::optional<EtcdKeyValue>> a = client_->Get("/f/members/a");
  ASSERT_TRUE(a.ok() && a->has_value());
  EXPECT_EQ((*a)->value, "1");
  absl::StatusOr<std::vector<EtcdKeyValue>> members = client_->GetPrefix("/f/members/");
  ASSERT_TRUE(members.ok());
  ASSERT_EQ(members->size(), 2u);
  EXPECT_EQ((*members)[1].key, "/f/members/b");
  EXPECT_EQ(*client_->Delete("/f/members/a"), 1);
  EXPECT_FALSE(client_->Get("/f/members/a")->has_value());
}

TEST_F(EtcdClientTest, PutIfAbsentHasExactlyOneWinner) {
  std::atomic<int> winners{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      absl::StatusOr<EtcdClient::CasResult> r =
          client_->PutIfAbsent("/f/decision", i % 2 == 0 ? "commit" : "abort");
      ASSERT_TRUE(r.ok()) << r.status();
      if (r->written) {
        ++winners;
      } else {
        ASSERT_TRUE(r->existing.has_value());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(winners.load(), 1);
  absl::StatusOr<EtcdClient::CasResult> late = client_->PutIfAbsent("/f/decision", "abort");
  ASSERT_TRUE(late.ok());
  EXPECT_FALSE(late->written);
  EXPECT_EQ(late->existing->value, client_->Get("/f/decision")->value().value);
}

TEST_F(EtcdClientTest, PutIfAbsentWritesTheOtherKeysInTheSameTransaction) {
  absl::StatusOr<EtcdClient::CasResult> r =
      client_->PutIfAbsent("/f/d", "commit", 0, {{"/f/version", "7"}});
  ASSERT_TRUE(r.ok() && r->written);
  EXPECT_EQ(client_->Get("/f/version")->value().value, "7");
  r = client_->PutIfAbsent("/f/d", "abort", 0, {{"/f/version", "8"}});
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->written);
  EXPECT_EQ(client_->Get("/f/version")->value().value, "7");
}

TEST_F(EtcdClientTest, RevokedLeaseTakesItsKeysAndKeepAliveIsNotFound) {
  absl::StatusOr<int64_t> lease = client_->GrantLease(absl::Seconds(5));
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(client_->Put("/f/members/m", "x", *lease).ok());
  absl::StatusOr<absl::Duration> ttl = client_->KeepAlive(*lease);
  ASSERT_TRUE(ttl.ok()) << ttl.status();
  EXPECT_GT(*ttl, absl::ZeroDuration());
  ASSERT_TRUE(client_->RevokeLease(*lease).ok());
  EXPECT_FALSE(client_->Get("/f/members/m")->has_value());
  EXPECT_EQ(client_->KeepAlive(*lease).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(EtcdClientTest, WatchDeliversPutsAndDeletesUnderThePrefix) {
  absl::Mutex mu;
  std::vector<EtcdClient::WatchEvent> seen;
  absl::Notification ended;
  absl::StatusOr<std::unique_ptr<EtcdClient::Watch>> watch = client_->WatchPrefix(
      "/f/refits/", 0,
      [&](const std::vector<EtcdClient::WatchEvent>& events, int64_t) {
        absl::MutexLock lock(&mu);
        seen.insert(seen.end(), events.begin(), events.end());
      },
      [&](const absl::Status&) { ended.Notify(); });
  ASSERT_TRUE(watch.ok()) << watch.status();
  ASSERT_TRUE(client_->Put("/f/other", "ignored").ok());
  ASSERT_TRUE(client_->Put("/f/refits/r1", "commit").ok());
  ASSERT_TRUE(client_->Delete("/f/refits/r1").ok());
  {
    absl::MutexLock lock(&mu);
    ASSERT_TRUE(mu.AwaitWithTimeout(
        absl::Condition(
            +[](std::vector<EtcdClient::WatchEvent>* s) { return s->size() >= 2; }, &seen),
        absl::Seconds(10)));
    EXPECT_EQ(seen[0].kv.key, "/f/refits/r1");
    EXPECT_EQ(seen[0].kv.value, "commit");
    EXPECT_FALSE(seen[0].deleted);
    EXPECT_TRUE(seen[1].deleted);
  }
  (*watch)->Cancel();
  EXPECT_TRUE(ended.WaitForNotificationWithTimeout(absl::Seconds(10)));
}

TEST_F(EtcdClientTest, WatchEndsWhenEtcdGoesAway) {
  absl::Notification ended;
  absl::Status end;
  absl::StatusOr<std::unique_ptr<EtcdClient::Watch>> watch = client_->WatchPrefix(
      "/f/", 0, [](const std::vector<EtcdClient::WatchEvent>&, int64_t) {},
      [&](const absl::Status& s) {
        end = s;
        ended.Notify();
      });
  ASSERT_TRUE(watch.ok()) << watch.status();
  etcd_->Stop();
  ASSERT_TRUE(ended.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(end.code(), absl::StatusCode::kUnavailable) << end;
}

// A client whose first endpoint is a dead port (a cluster member that is
// down) and whose second is the live etcd.
std::unique_ptr<EtcdClient> DeadFirstClient(const std::string& dead, const std::string& live) {
  EtcdClientOptions options;
  options.endpoints = {absl::StrCat(dead, ",", live)};
  absl::StatusOr<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? std::move(*client) : nullptr;
}

TEST_F(EtcdClientTest, EveryCallFailsOverFromADeadFirstEndpoint) {
  const std::string dead = absl::StrCat("127.0.0.1:", refit::testing::PickFreePort());
  std::unique_ptr<EtcdClient> client = DeadFirstClient(dead, etcd_->endpoint());
  ASSERT_NE(client, nullptr);
  ASSERT_EQ(client->endpoints().size(), 2u);
  EXPECT_EQ(client->endpoints()[0], dead);
  ASSERT_TRUE(client->Put("/f/a", "1").ok());
  absl::StatusOr<std::optional<EtcdKeyValue>> a = client->Get("/f/a");
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(a->has_value());
  EXPECT_EQ((*a)->value, "1");
  absl::StatusOr<EtcdClient::CasResult> cas = client->PutIfAbsent("/f/d", "commit");
  ASSERT_TRUE(cas.ok()) << cas.status();
  EXPECT_TRUE(cas->written);
  absl::StatusOr<int64_t> lease = client->GrantLease(absl::Seconds(5));
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE(client->KeepAlive(*lease).ok());
  EXPECT_TRUE(client->RevokeLease(*lease).ok());
  // What it wrote is in the live etcd.
  EXPECT_EQ(client_->Get("/f/d")->value().value, "commit");
}

TEST_F(EtcdClientTest, AWatchIsCreatedOnTheNextEndpointWhenTheFirstIsDead) {
  const std::string dead = absl::StrCat("127.0.0.1:", refit::testing::PickFreePort());
  // A fresh client: its first call is the watch, on the dead endpoint.
  std::unique_ptr<EtcdClient> client = DeadFirstClient(dead, etcd_->endpoint());
  ASSERT_NE(client, nullptr);
  absl::Notification seen;
  std::string value;
  absl::StatusOr<std::unique_ptr<EtcdClient::Watch>> watch = client->WatchPrefix(
      "/f/decisions/", 0,
      [&](const std::vector<EtcdClient::WatchEvent>& events, int64_t) {
        if (!seen.HasBeenNotified()) {
          value = events[0].kv.value;
          seen.Notify();
        }
      },
      [](const absl::Status&) {});
  ASSERT_TRUE(watch.ok()) << watch.status();
  ASSERT_TRUE(client_->Put("/f/decisions/x", "commit").ok());
  ASSERT_TRUE(seen.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(value, "commit");
}

TEST(EtcdClientCreateTest, EveryEndpointDeadIsUnavailableNamingEachOne) {
  const std::string first = absl::StrCat("127.0.0.1:", refit::testing::PickFreePort());
  const std::string second = absl::StrCat("127.0.0.1:", refit::testing::PickFreePort());
  EtcdClientOptions options;
  options.endpoints = {first, second};
  options.timeout = absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(options);
  ASSERT_TRUE(client.ok());
  absl::Status s = (*client)->Get("/k").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("etcd " + first + " Range"));
  EXPECT_THAT(s.message(), HasSubstr("etcd " + second + " Range"));
  absl::Status w = (*client)
                       ->WatchPrefix(
                           "/f/", 0, [](const std::vector<EtcdClient::WatchEvent>&, int64_t) {},
                           [](const absl::Status&) {})
                       .status();
  EXPECT_EQ(w.code(), absl::StatusCode::kUnavailable) << w;
  EXPECT_THAT(w.message(), HasSubstr("etcd " + first + " Watch"));
  EXPECT_THAT(w.message(), HasSubstr("etcd " + second + " Watch"));
}

}  // namespace
}  // namespace refit::server
