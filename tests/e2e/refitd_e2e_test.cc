// End-to-end: the real build/bin/refitd driven by the real build/bin/refitctl
// (and by e2e_stalled_pusher, a trainer that stops mid-push), as separate
// processes. See tests/e2e/e2e_util.h for the ground rules.
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cstring>

#include <algorithm>
#include <map>
#include <regex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client/refit_client.h"
#include "core/version.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/e2e_util.h"
#include "tests/testing/temp_dir.h"

namespace refit::e2e {
namespace {

using ::grpc::health::v1::HealthCheckResponse;
using ::testing::HasSubstr;

class RefitdE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* bin : {"refitd", "refitctl", "refit_make_fixture"}) {
      if (!std::filesystem::exists(BinPath(bin))) {
        GTEST_SKIP() << BinPath(bin) << " is not built";
      }
    }
    char pattern[] = "/tmp/refit_e2e_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
    socket_ = "unix:" + dir_ + "/refitd.sock";
  }

  void TearDown() override {
    watch_.reset();
    children_.clear();  // SIGKILLs whatever still runs
    daemon_.reset();
    if (!dir_.empty() && !HasFailure()) refit::testing::RemoveTree(dir_);
    if (HasFailure()) std::cerr << "e2e: files kept in " << dir_ << "\n";
  }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  // refitd --model=demo with `flag`, which it must refuse at start-up: its
  // exit code (-1 if it did not exit) and stderr.
  std::pair<int, std::string> StartUpRefusal(const std::string& flag) {
    auto child = Child::Start({BinPath("refitd"), "--model=demo", flag}, Path("refused.out"),
                              Path("refused.err"));
    std::optional<int> code = child->Wait();
    return {code.value_or(-1), child->Stderr()};
  }

  // Starts refitd on the demo model with `flags` and waits until it is ready.
  void StartDaemon(std::vector<std::string> flags = {}, bool wait_ready = true) {
    std::vector<std::string> argv = {BinPath("refitd"), "--model=demo"};
    bool has_listen = false;
    for (const std::string& f : flags) has_listen |= absl::StartsWith(f, "--listen");
    if (!has_listen) argv.push_back("--listen=" + socket_);
    argv.insert(argv.end(), flags.begin(), flags.end());
    ++daemon_starts_;
    daemon_log_ = Path(absl::StrCat("refitd-", daemon_starts_, ".log"));
    daemon_ = Child::Start(argv, Path("refitd.out"), daemon_log_);
    ASSERT_NE(daemon_, nullptr);
    if (!wait_ready) return;
    const bool ready = daemon_->AwaitStderr("ready");
    ASSERT_TRUE(ready || !daemon_->running()) << "refitd never logged readiness";
    ASSERT_TRUE(daemon_->running()) << "refitd exited:\n" << daemon_->Stderr();
  }

  // The address refitd logged for a TCP listener or the metrics endpoint.
  std::string LoggedAddress(const std::string& message) {
    std::string found;
    daemon_->AwaitOutput([&](const std::string&, const std::string& err) {
      for (absl::string_view line : absl::StrSplit(err, '\n')) {
        if (!absl::StrContains(line, message)) continue;
        std::smatch m;
        std::string l(line);
        if (std::regex_search(l, m, std::regex("address=([^ ]+)"))) {
          found = m[1];
          return true;
        }
      }
      return false;
    });
    return found;
  }

  std::unique_ptr<client::RefitClient> Client(client::ClientOptions options = {}) {
    if (options.address == "127.0.0.1:50051") options.address = socket_;
    options.timeout = absl::Seconds(30);
    auto c = client::RefitClient::Create(options);
    EXPECT_TRUE(c.ok()) << c.status();
    return *std::move(c);
  }

  // Runs refitctl with --addr (unless given) and `args`.
  CommandResult Ctl(std::vector<std::string> args, const std::string& addr = "") {
    std::vector<std::string> argv = {BinPath("refitctl"),
                                     "--addr=" + (addr.empty() ? socket_ : addr), "--timeout=30s"};
    argv.insert(argv.end(), args.begin(), args.end());
    ++commands_;
    auto child = Child::Start(argv, Path(absl::StrCat("ctl-", commands_, ".out")),
                              Path(absl::StrCat("ctl-", commands_, ".err")));
    CommandResult r;
    std::optional<int> code = child->Wait(absl::Seconds(90));
    r.code = code.value_or(-1);
    r.out = child->Stdout();
    r.err = child->Stderr();
    return r;
  }

  nlohmann::json StatusJson(const std::string& addr = "", std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"status", "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    CommandResult r = Ctl(args, addr);
    EXPECT_EQ(r.code, 0) << r.err;
    return nlohmann::json::parse(r.out, nullptr, false);
  }

  // Writes the fixture model with `seed` and returns its directory.
  std::string Fixture(int seed) {
    std::string out = Path(absl::StrCat("weights-", seed));
    if (std::filesystem::exists(out)) return out;
    auto child =
        Child::Start({BinPath("refit_make_fixture"), "--out=" + out, absl::StrCat("--seed=", seed)},
                     Path("fixture.out"), Path("fixture.err"));
    EXPECT_EQ(child->Wait(), 0) << child->Stderr();
    return out;
  }

  // Starts a trainer that stops halfway through its push, and waits until the
  // daemon shows its refit as active. Returns the refit id. watch_, opened
  // before the push, then carries the refit's later events (aborted,
  // committed).
  std::string StartStalledPush(const std::string& weights, const std::string& token = "") {
    watch_ = WatchStream::Open(socket_, token);
    EXPECT_NE(watch_, nullptr) << "no Watch stream on " << socket_;
    if (watch_ == nullptr) return "";
    std::vector<std::string> argv = {TestBinPath("e2e_stalled_pusher"), socket_, weights};
    if (!token.empty()) argv.push_back(token);
    pusher_ = Child::Start(argv, Path("pusher.out"), Path("pusher.err"), /*stdin_pipe=*/true);
    EXPECT_TRUE(pusher_->AwaitStdout("stalled")) << pusher_->Stderr();
    std::optional<v1::WatchEvent> started = watch_->Next(v1::WatchEvent::TYPE_STAGING_STARTED);
    EXPECT_TRUE(started.has_value()) << "the stalled push never showed up as the active refit";
    if (!started.has_value()) return "";
    // Begin announces staging_started a moment before the daemon files the
    // refit where GetStatus, Abort and shutdown find it; tests that stop the
    // daemon next need it filed. The first answer almost always shows it;
    // asking again covers a daemon thread preempted in between.
    auto client = Client();
    std::string active;
    for (int attempt = 0; attempt < 1000 && active != started->refit_id(); ++attempt) {
      auto status = client->GetStatus();
      if (status.ok()) active = status->active_refit().refit_id();
    }
    EXPECT_EQ(active, started->refit_id())
        << "the stalled push never showed up as the active refit";
    return started->refit_id();
  }

  std::string dir_;
  std::string socket_;
  std::string daemon_log_;
  int daemon_starts_ = 0;
  int commands_ = 0;
  std::unique_ptr<Child> daemon_;
  std::unique_ptr<Child> pusher_;
  std::unique_ptr<WatchStream> watch_;  // opened by StartStalledPush
  std::vector<std::unique_ptr<Child>> children_;
};

TEST_F(RefitdE2eTest, PushFlipsTheVersionAndVerifyMatches) {
  StartDaemon();
  nlohmann::json before = StatusJson();
  ASSERT_TRUE(before.is_object());
  const uint64_t v0 = before["version"];
  EXPECT_GE(v0, 1u);

  const std::string weights = Fixture(2);
  CommandResult push = Ctl({"push", weights});
  ASSERT_EQ(push.code, 0) << push.err;
  EXPECT_THAT(push.out, HasSubstr(absl::StrCat("version ", v0 + 1)));

  nlohmann::json after = StatusJson();
  EXPECT_EQ(after["version"], v0 + 1);
  EXPECT_NE(after["fingerprint"], before["fingerprint"]);

  CommandResult verify = Ctl({"verify", weights});
  EXPECT_EQ(verify.code, 0) << verify.out << verify.err;
  EXPECT_THAT(verify.out, HasSubstr("verify: OK"));
  EXPECT_THAT(verify.out, HasSubstr("0 mismatch"));

  // Other weights do not match what is live.
  CommandResult other = Ctl({"verify", "--json", Fixture(3)});
  EXPECT_EQ(other.code, 6) << other.err;
  nlohmann::json report = nlohmann::json::parse(other.out, nullptr, false);
  EXPECT_EQ(report["ok"], false);
  EXPECT_EQ(report["fingerprint"]["match"], false);
  EXPECT_GT(report["mismatched"].get<int>(), 0);
}

TEST_F(RefitdE2eTest, TwoPhasePushThenCommit) {
  StartDaemon();
  const uint64_t v0 = StatusJson()["version"];
  CommandResult push = Ctl({"push", "--prepare", "--json", Fixture(2)});
  ASSERT_EQ(push.code, 0) << push.err;
  nlohmann::json prepared = nlohmann::json::parse(push.out, nullptr, false);
  EXPECT_EQ(prepared["state"], "prepared");
  EXPECT_EQ(StatusJson()["version"], v0);
  CommandResult commit = Ctl({"commit", prepared["refit_id"].get<std::string>()});
  ASSERT_EQ(commit.code, 0) << commit.err;
  EXPECT_EQ(StatusJson()["version"], v0 + 1);
  // In text, a prepared refit shows the live version its commit follows,
  // not as a version of its own.
  CommandResult text = Ctl({"push", "--prepare", Fixture(3)});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_THAT(text.out, HasSubstr(absl::StrCat(": live version ", v0 + 1, ", fingerprint")));
  EXPECT_THAT(text.out, HasSubstr("(its commit makes the next version)"));
  ASSERT_EQ(Ctl({"abort"}).code, 0);
  // A stale base version is a conflict (ABORTED): re-read, then retry.
  CommandResult stale = Ctl({"push", "--base-version", std::to_string(v0), Fixture(3)});
  EXPECT_EQ(stale.code, 5) << stale.err;
  EXPECT_THAT(stale.err, HasSubstr("ABORTED: refit expects base version " + std::to_string(v0)));
}

TEST_F(RefitdE2eTest, ReloadFromDiskAndAbortAPreparedOne) {
  const std::string weights = Fixture(2);
  StartDaemon({"--reload-root=" + dir_});
  const uint64_t v0 = StatusJson()["version"];

  CommandResult reload = Ctl({"reload", "--from", weights, "--json"});
  ASSERT_EQ(reload.code, 0) << reload.err;
  EXPECT_EQ(nlohmann::json::parse(reload.out, nullptr, false)["version"], v0 + 1);
  EXPECT_EQ(StatusJson()["version"], v0 + 1);
  EXPECT_EQ(Ctl({"verify", weights}).code, 0);

  // Outside the reload root: PERMISSION_DENIED.
  CommandResult outside = Ctl({"reload", "--from", "/etc"});
  EXPECT_EQ(outside.code, 4) << outside.err;

  // A prepared reload that is aborted changes nothing.
  CommandResult prepared = Ctl({"reload", "--from", Fixture(3), "--prepare", "--json"});
  ASSERT_EQ(prepared.code, 0) << prepared.err;
  const std::string id = nlohmann::json::parse(prepared.out, nullptr, false)["refit_id"];
  CommandResult abort = Ctl({"abort", id, "--reason", "e2e"});
  EXPECT_EQ(abort.code, 0) << abort.err;
  EXPECT_THAT(abort.out, HasSubstr(id));
  EXPECT_EQ(StatusJson()["version"], v0 + 1);
  EXPECT_EQ(Ctl({"commit", id}).code, 3);  // nothing left to commit
  EXPECT_EQ(Ctl({"verify", weights}).code, 0);
}

TEST_F(RefitdE2eTest, KilledPusherLeavesTheVersionAndTheNextPushSucceeds) {
  StartDaemon();
  nlohmann::json before = StatusJson();
  const std::string id = StartStalledPush(Fixture(2));
  pusher_->Signal(SIGKILL);
  ASSERT_FALSE(pusher_->Wait().has_value());
  EXPECT_TRUE(pusher_->KilledBySignal(SIGKILL));

  // The daemon notices the dropped stream and aborts the refit.
  std::optional<v1::WatchEvent> aborted = watch_->Next(v1::WatchEvent::TYPE_ABORTED);
  ASSERT_TRUE(aborted.has_value()) << "the killed push's refit stayed active";
  EXPECT_EQ(aborted->refit_id(), id);
  auto client = Client();
  auto status = client->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_FALSE(status->has_active_refit()) << "the killed push's refit stayed active";
  nlohmann::json after = StatusJson();
  EXPECT_EQ(after["version"], before["version"]);
  EXPECT_EQ(after["fingerprint"], before["fingerprint"]);
  EXPECT_EQ(Ctl({"health"}).code, 0);

  CommandResult push = Ctl({"push", Fixture(3)});
  EXPECT_EQ(push.code, 0) << push.err;
  EXPECT_EQ(StatusJson()["version"], before["version"].get<uint64_t>() + 1);
}

TEST_F(RefitdE2eTest, ConcurrentPushIsRefusedNamingTheActiveRefit) {
  StartDaemon();
  const uint64_t v0 = StatusJson()["version"];
  const std::string active = StartStalledPush(Fixture(2));
  ASSERT_FALSE(active.empty());

  CommandResult second = Ctl({"push", Fixture(3)});
  EXPECT_EQ(second.code, 5) << second.err;
  EXPECT_THAT(second.err, HasSubstr(active));

  // The first push, resumed, still commits.
  pusher_->WriteStdin("continue\n");
  ASSERT_EQ(pusher_->Wait(), 0);
  EXPECT_THAT(pusher_->Stdout(), HasSubstr(absl::StrCat("status OK")));
  EXPECT_EQ(StatusJson()["version"], v0 + 1);
}

TEST_F(RefitdE2eTest, SigtermDuringPushAbortsItAndExitsZero) {
  // A short bound keeps the suite fast; the daemon must honour it.
  StartDaemon({"--shutdown-timeout=3s"});
  const uint64_t v0 = StatusJson()["version"];
  const std::string active = StartStalledPush(Fixture(2));

  daemon_->Signal(SIGTERM);
  // The trainer waits for the daemon's verdict on its stream.
  pusher_->WriteStdin("finish\n");
  ASSERT_EQ(pusher_->Wait(), 0);
  EXPECT_THAT(pusher_->Stdout(), HasSubstr("status ABORTED"));
  EXPECT_THAT(pusher_->Stdout(), HasSubstr("shutting down"));

  // The bound is --shutdown-timeout plus slack for a loaded machine.
  std::optional<int> code = daemon_->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value()) << "refitd did not exit after SIGTERM";
  EXPECT_EQ(*code, 0);

  const std::string log = daemon_->Stderr();
  EXPECT_THAT(log, HasSubstr("refitd stopped"));
  EXPECT_THAT(log, HasSubstr(absl::StrCat("version=", v0, " ")));
  EXPECT_THAT(log, ::testing::Not(HasSubstr(absl::StrCat("version=", v0 + 1))));
  EXPECT_THAT(log, HasSubstr(active));
}

TEST_F(RefitdE2eTest, IdlePushIsAbortedAfterTheRealTimeout) {
  // The real clock with a short timeout: here the flag itself is under test
  // (in-process tests run the same watchdog on a fake clock).
  StartDaemon({"--push-idle-timeout=1s"});
  const uint64_t v0 = StatusJson()["version"];
  pusher_ = Child::Start({TestBinPath("e2e_stalled_pusher"), socket_, Fixture(2)},
                         Path("pusher.out"), Path("pusher.err"), /*stdin_pipe=*/true);
  ASSERT_TRUE(pusher_->AwaitStdout("stalled")) << pusher_->Stderr();
  pusher_->WriteStdin("finish\n");  // send nothing more; wait for the verdict
  ASSERT_EQ(pusher_->Wait(), 0) << pusher_->Stderr();
  EXPECT_THAT(pusher_->Stdout(), HasSubstr("status DEADLINE_EXCEEDED"));
  EXPECT_THAT(pusher_->Stdout(), HasSubstr("no message for 1s (--push-idle-timeout)"));
  EXPECT_EQ(StatusJson()["version"], v0);
  CommandResult push = Ctl({"push", Fixture(3)});
  EXPECT_EQ(push.code, 0) << push.err;
  EXPECT_EQ(StatusJson()["version"], v0 + 1);
}

TEST_F(RefitdE2eTest, AuthMatrix) {
  std::ofstream(Path("tokens")) << "# token role name\n"
                                << "tok-trainer trainer alice\n"
                                << "tok-reader reader bob\n"
                                << "tok-operator operator carol\n";
  for (const char* role : {"trainer", "reader", "operator"}) {
    std::ofstream(Path(absl::StrCat(role, ".token"))) << "tok-" << role << "\n";
  }
  std::ofstream(Path("wrong.token")) << "not-a-token\n";
  StartDaemon({"--auth-tokens=" + Path("tokens")});
  auto token = [&](const std::string& role) { return "--token-file=" + Path(role + ".token"); };
  const std::string weights = Fixture(2);

  // Health needs no token.
  EXPECT_EQ(Ctl({"health"}).code, 0);
  // No token, unknown token: UNAUTHENTICATED.
  CommandResult none = Ctl({"status"});
  EXPECT_EQ(none.code, 4);
  EXPECT_THAT(none.err, HasSubstr("UNAUTHENTICATED"));
  EXPECT_EQ(Ctl({"status", token("wrong")}).code, 4);
  // Wrong role: PERMISSION_DENIED.
  CommandResult reader_push = Ctl({"push", token("reader"), weights});
  EXPECT_EQ(reader_push.code, 4);
  EXPECT_THAT(reader_push.err, HasSubstr("PERMISSION_DENIED"));
  EXPECT_EQ(Ctl({"reload", token("trainer"), "--from", weights}).code, 4);
  // Without an id, abort means the trainer's own active refit: it has none.
  CommandResult no_refit = Ctl({"abort", token("trainer")});
  EXPECT_EQ(no_refit.code, 3) << no_refit.err;
  EXPECT_THAT(no_refit.err, HasSubstr("NOT_FOUND"));
  // Right role.
  EXPECT_EQ(Ctl({"status", token("reader")}).code, 0);
  EXPECT_EQ(Ctl({"tensors", token("reader")}).code, 0);
  CommandResult push = Ctl({"push", token("trainer"), weights});
  EXPECT_EQ(push.code, 0) << push.err;
  EXPECT_EQ(Ctl({"verify", token("reader"), weights}).code, 0);
  EXPECT_EQ(Ctl({"push", token("operator"), Fixture(3)}).code, 0);
  // A trainer commits and aborts its own prepared refit without naming it.
  const uint64_t version = StatusJson("", {token("reader")})["version"];
  CommandResult prepared = Ctl({"push", "--prepare", "--json", token("trainer"), weights});
  ASSERT_EQ(prepared.code, 0) << prepared.err;
  CommandResult commit = Ctl({"commit", token("trainer")});
  EXPECT_EQ(commit.code, 0) << commit.err;
  EXPECT_THAT(commit.out,
              HasSubstr(nlohmann::json::parse(prepared.out)["refit_id"].get<std::string>()));
  EXPECT_EQ(StatusJson("", {token("reader")})["version"], version + 1);
  ASSERT_EQ(Ctl({"push", "--prepare", token("trainer"), Fixture(3)}).code, 0);
  CommandResult abort = Ctl({"abort", token("trainer")});
  EXPECT_EQ(abort.code, 0) << abort.err;
  EXPECT_THAT(abort.out, HasSubstr("unchanged"));
  EXPECT_EQ(StatusJson("", {token("reader")})["version"], version + 1);
  // Refusals are logged.
  EXPECT_THAT(daemon_->Stderr(), HasSubstr("bob"));
}

class TlsE2eTest : public RefitdE2eTest {
 protected:
  // A CA, a server certificate for 127.0.0.1 / localhost and a client
  // certificate, all made here with openssl.
  bool MakeCertificates() {
    const std::string script = absl::StrCat(
        "set -e; cd '", dir_, "'\n",
        "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=refit-test-ca "
        "-keyout ca.key -out ca.pem 2>/dev/null\n",
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > server.ext\n",
        "openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout server.key "
        "-out server.csr 2>/dev/null\n",
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 "
        "-extfile server.ext -out server.pem 2>/dev/null\n",
        "openssl req -newkey rsa:2048 -nodes -subj /CN=trainer -keyout client.key "
        "-out client.csr 2>/dev/null\n",
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 "
        "-out client.pem 2>/dev/null\n",
        "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=other-ca "
        "-keyout other-ca.key -out other-ca.pem 2>/dev/null\n");
    std::ofstream(Path("certs.sh")) << script;
    auto child = Child::Start({"/bin/sh", Path("certs.sh")}, Path("certs.out"), Path("certs.err"));
    std::optional<int> code = child->Wait();
    return code.has_value() && *code == 0;
  }
};

TEST_F(TlsE2eTest, TlsAndMutualTls) {
  ASSERT_TRUE(MakeCertificates()) << ReadFileOrEmpty(Path("certs.err"));
  StartDaemon({"--listen=127.0.0.1:0", "--tls-cert=" + Path("server.pem"),
               "--tls-key=" + Path("server.key")});
  std::string addr = LoggedAddress("refitd listening");
  ASSERT_FALSE(addr.empty()) << daemon_->Stderr();

  EXPECT_EQ(Ctl({"status", "--tls-ca=" + Path("ca.pem")}, addr).code, 0);
  EXPECT_EQ(Ctl({"health", "--tls-ca=" + Path("ca.pem")}, addr).code, 0);
  // Plaintext against a TLS port, and TLS without trusting the CA, fail.
  EXPECT_EQ(Ctl({"status", "--timeout=3s"}, addr).code, 7);
  EXPECT_EQ(Ctl({"status", "--tls-ca=" + Path("other-ca.pem"), "--timeout=3s"}, addr).code, 7);
  EXPECT_EQ(Ctl({"push", "--tls-ca=" + Path("ca.pem"), Fixture(2)}, addr).code, 0);

  // Mutual TLS: a client certificate is required.
  daemon_->Signal(SIGTERM);
  ASSERT_EQ(daemon_->Wait(absl::Seconds(30)), 0);
  StartDaemon({"--listen=127.0.0.1:0", "--tls-cert=" + Path("server.pem"),
               "--tls-key=" + Path("server.key"), "--tls-client-ca=" + Path("ca.pem")});
  addr = LoggedAddress("refitd listening");
  ASSERT_FALSE(addr.empty());
  EXPECT_EQ(Ctl({"status", "--tls-ca=" + Path("ca.pem"), "--timeout=3s"}, addr).code, 7);
  EXPECT_EQ(Ctl({"status", "--tls-ca=" + Path("ca.pem"), "--tls-cert=" + Path("client.pem"),
                 "--tls-key=" + Path("client.key")},
                addr)
                .code,
            0);
}

TEST_F(RefitdE2eTest, LivenessAndReadinessTransitions) {
  StartDaemon({"--shutdown-timeout=3s"}, /*wait_ready=*/false);
  auto client = Client();
  // Liveness comes first (the daemon serves gRPC once it logs its address);
  // readiness follows once the first version is loaded.
  ASSERT_TRUE(daemon_->AwaitStderr("refitd listening")) << daemon_->Stderr();
  auto live = client->HealthCheck("");
  ASSERT_TRUE(live.ok()) << live.status();
  ASSERT_EQ(*live, HealthCheckResponse::SERVING);
  std::vector<HealthCheckResponse::ServingStatus> seen;
  absl::Status watched = client->HealthWatch(client::kReadinessService, [&](auto status) {
    seen.push_back(status);
    return status != HealthCheckResponse::SERVING;
  });
  ASSERT_TRUE(watched.ok()) << watched;
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back(), HealthCheckResponse::SERVING);
  for (size_t i = 0; i + 1 < seen.size(); ++i) EXPECT_EQ(seen[i], HealthCheckResponse::NOT_SERVING);

  // Readiness stays SERVING while a new version is staging.
  StartStalledPush(Fixture(2));
  EXPECT_EQ(*client->HealthCheck(client::kReadinessService), HealthCheckResponse::SERVING);
  EXPECT_EQ(Ctl({"health"}).code, 0);

  // SIGTERM: a watcher sees NOT_SERVING before the daemon goes away.
  absl::Mutex mu;
  std::vector<HealthCheckResponse::ServingStatus> during_shutdown;
  absl::Notification joined;  // the watcher has its first answer
  std::thread watcher([&] {
    auto c = Client();
    c->HealthWatch(client::kReadinessService, [&](auto status) {
       {
         absl::MutexLock lock(&mu);
         during_shutdown.push_back(status);
       }
       if (!joined.HasBeenNotified()) joined.Notify();
       return status != HealthCheckResponse::NOT_SERVING;
     }).IgnoreError();
  });
  ASSERT_TRUE(joined.WaitForNotificationWithTimeout(absl::Seconds(60)));
  daemon_->Signal(SIGTERM);
  pusher_->WriteStdin("finish\n");  // let its stream end now, not at the shutdown bound
  watcher.join();
  ASSERT_GE(during_shutdown.size(), 2u);
  EXPECT_EQ(during_shutdown.front(), HealthCheckResponse::SERVING);
  EXPECT_EQ(during_shutdown.back(), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(daemon_->Wait(absl::Seconds(30)), 0);
}

// Prometheus text: "name{labels} value" lines; comments start with '#'.
std::map<std::string, double> ParseMetrics(const std::string& text) {
  std::map<std::string, double> samples;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    double value = 0;
    if (!absl::SimpleAtod(line.substr(space + 1), &value)) continue;
    samples[std::string(line.substr(0, space))] = value;
  }
  return samples;
}

// GET /metrics over a plain socket (HTTP/1.0, so the server closes).
std::string HttpGet(const std::string& host_port, const std::string& path) {
  std::vector<std::string> parts = absl::StrSplit(host_port, ':');
  int port = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[1], &port)) return "";
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return "";
  }
  std::string request = "GET " + path + " HTTP/1.0\r\nHost: " + host_port + "\r\n\r\n";
  (void)!::write(fd, request.data(), request.size());
  std::string response;
  char buffer[8192];
  for (ssize_t n; (n = ::read(fd, buffer, sizeof(buffer))) > 0;) response.append(buffer, n);
  ::close(fd);
  return response;
}

TEST_F(RefitdE2eTest, MetricsAreScrapedAndParsed) {
  StartDaemon({"--metrics-listen=127.0.0.1:0"});
  const std::string metrics = LoggedAddress("metrics at /metrics");
  ASSERT_FALSE(metrics.empty()) << daemon_->Stderr();
  ASSERT_EQ(Ctl({"push", Fixture(2)}).code, 0);
  const uint64_t version = StatusJson()["version"];

  std::string response = HttpGet(metrics, "/metrics");
  ASSERT_THAT(response, HasSubstr("200"));
  size_t body = response.find("\r\n\r\n");
  ASSERT_NE(body, std::string::npos);
  std::map<std::string, double> samples = ParseMetrics(response.substr(body + 4));
  EXPECT_GE(samples["refitd_refits_total{outcome=\"committed\"}"], 2.0);  // first load + push
  EXPECT_GT(samples["refitd_bytes_received_total"], 0.0);
  bool found_version = false;
  for (const auto& [name, value] : samples) {
    if (absl::StartsWith(name, "refitd_version{")) {
      EXPECT_EQ(value, static_cast<double>(version)) << name;
      found_version = true;
    }
  }
  EXPECT_TRUE(found_version);
  for (const char* phase : {"receive", "quantize", "finalize", "commit"}) {
    EXPECT_GE(samples[absl::StrCat("refitd_phase_seconds_count{phase=\"", phase, "\"}")], 1.0)
        << phase;
  }
  EXPECT_TRUE(samples.count("refitd_last_commit_pause_seconds"));
}

// The second refit stages in the buffers the first one released (the host
// staging pool), the same with the pool off; either way every kernel equals
// the local quantization of what was pushed last. The model is large enough
// (5.5 MiB MLP weights) for its staging to be pooled, which /metrics shows.
// A negative idle period is refused at start-up.
TEST_F(RefitdE2eTest, RefitsThatReuseStagingServeExactlyTheLastPush) {
  auto model = [&](int seed) {
    std::string out = Path(absl::StrCat("wide-", seed));
    auto child = Child::Start(
        {BinPath("refit_make_fixture"), "--out=" + out, absl::StrCat("--seed=", seed), "--layers=2",
         "--hidden=1024", "--intermediate=2816", "--heads=8", "--kv_heads=2", "--vocab=2048"},
        Path("wide.out"), Path("wide.err"));
    EXPECT_EQ(child->Wait(), 0) << child->Stderr();
    return out;
  };
  const std::string first = model(1), second = model(2), third = model(3);
  for (std::string pool : {"--staging-pool-idle=30s", "--staging-pool-idle=0"}) {
    SCOPED_TRACE(pool);
    StartDaemon({"--model=" + first, pool, "--metrics-listen=127.0.0.1:0"});
    const std::string metrics = LoggedAddress("metrics at /metrics");
    ASSERT_FALSE(metrics.empty()) << daemon_->Stderr();
    for (const std::string& weights : {second, third, second}) {
      CommandResult push = Ctl({"push", weights});
      ASSERT_EQ(push.code, 0) << push.err;
    }
    CommandResult verify = Ctl({"verify", second});
    EXPECT_EQ(verify.code, 0) << verify.out << verify.err;
    EXPECT_THAT(verify.out, HasSubstr("0 mismatch"));
    const std::string response = HttpGet(metrics, "/metrics");
    const size_t body = response.find("\r\n\r\n");
    ASSERT_NE(body, std::string::npos);
    std::map<std::string, double> samples = ParseMetrics(response.substr(body + 4));
    ASSERT_TRUE(samples.count("refitd_staging_pool_reused_total")) << response;
    ASSERT_TRUE(samples.count("refitd_staging_pool_allocated_total")) << response;
    if (absl::StrContains(pool, "=0")) {
      EXPECT_EQ(samples["refitd_staging_pool_reused_total"], 0.0);
      EXPECT_EQ(samples["refitd_staging_pool_allocated_total"], 0.0);
      EXPECT_EQ(samples["refitd_staging_pool_bytes"], 0.0);
    } else {
      EXPECT_GT(samples["refitd_staging_pool_allocated_total"], 0.0);
      EXPECT_GT(samples["refitd_staging_pool_bytes"], 0.0);
    }
    daemon_->Signal(SIGTERM);
    EXPECT_EQ(daemon_->Wait(), std::optional<int>(0));
  }
  const auto [code, err] = StartUpRefusal("--staging-pool-idle=-1s");
  EXPECT_EQ(code, 2);
  EXPECT_THAT(err, HasSubstr("--staging-pool-idle must be >= 0"));
}

// --host-threads caps a refit's CPU threads (the start-up line says what the
// quantizer and the bulk copies resolved to), and a refit under the cap
// serves exactly the pushed weights. Out of range is refused at start-up.
TEST_F(RefitdE2eTest, HostThreadsCapsTheRefitsThreadsAndChangesNoByte) {
  StartDaemon({"--host-threads=1"});
  EXPECT_THAT(daemon_->Stderr(), HasSubstr("quantize_threads=1 bulk_threads=1"));
  const std::string weights = Fixture(2);
  CommandResult push = Ctl({"push", weights});
  ASSERT_EQ(push.code, 0) << push.err;
  CommandResult verify = Ctl({"verify", weights});
  EXPECT_EQ(verify.code, 0) << verify.out << verify.err;
  EXPECT_THAT(verify.out, HasSubstr("0 mismatch"));
  for (const char* bad : {"--host-threads=-1", "--host-threads=1025"}) {
    const auto [code, err] = StartUpRefusal(bad);
    EXPECT_EQ(code, 2) << bad;
    EXPECT_THAT(err, HasSubstr("--host-threads must be 0 (one per core) to 1024")) << bad;
  }
}

TEST_F(RefitdE2eTest, AnUnknownCudaArenaSharingIsRefusedAtStartUp) {
  const auto [code, err] = StartUpRefusal("--cuda-arena=shared");
  EXPECT_EQ(code, 2);
  EXPECT_THAT(err, HasSubstr("--cuda-arena must be ipc or vmm, got \"shared\""));
}

TEST_F(RefitdE2eTest, AQuiesceTimeoutThatIsNotPositiveAndFiniteIsRefusedAtStartUp) {
  for (const char* bad : {"--engine-quiesce-timeout=0s", "--engine-quiesce-timeout=-1s",
                          "--engine-quiesce-timeout=inf"}) {
    const auto [code, err] = StartUpRefusal(bad);
    EXPECT_EQ(code, 2) << bad;
    EXPECT_THAT(err, HasSubstr("--engine-quiesce-timeout must be a positive, finite duration"))
        << bad;
  }
}

TEST_F(RefitdE2eTest, APinnedRegionBudgetThatIsNotASizeIsRefusedAtStartUp) {
  const auto [code, err] = StartUpRefusal("--max-pinned-region-bytes=half");
  EXPECT_EQ(code, 2);
  EXPECT_THAT(err, HasSubstr("--max-pinned-region-bytes: "));
  EXPECT_THAT(err, HasSubstr("(or \"auto\")"));
}

TEST_F(RefitdE2eTest, VersionsAreTheBuildsVersion) {
  for (const char* bin : {"refitd", "refitctl"}) {
    auto child = Child::Start({BinPath(bin), "--version"}, Path(absl::StrCat(bin, "-version.out")),
                              Path(absl::StrCat(bin, "-version.err")));
    ASSERT_EQ(child->Wait(), 0) << bin << ": " << child->Stderr();
    EXPECT_EQ(child->Stdout(), absl::StrCat(bin, " ", core::VersionString(), "\n")) << bin;
  }
  StartDaemon();
  EXPECT_THAT(StatusJson()["server_version"].get<std::string>(),
              HasSubstr(absl::StrCat("refitd ", core::VersionString())));
}

TEST_F(RefitdE2eTest, ListenPortOutOfRangeIsRefused) {
  auto child = Child::Start({BinPath("refitd"), "--model=demo", "--listen=127.0.0.1:500510"},
                            Path("bad-listen.out"), Path("bad-listen.err"));
  std::optional<int> code = child->Wait();
  ASSERT_TRUE(code.has_value());
  EXPECT_NE(*code, 0);
  EXPECT_THAT(child->Stderr(), HasSubstr("INVALID_ARGUMENT"));
  EXPECT_THAT(child->Stderr(), HasSubstr("\"127.0.0.1:500510\""));
  CommandResult ctl = Ctl({"status"}, "127.0.0.1:500510");
  EXPECT_EQ(ctl.code, 2) << ctl.err;
  EXPECT_THAT(ctl.err, HasSubstr("\"127.0.0.1:500510\""));
}

TEST_F(RefitdE2eTest, ReadOnlyCommandsWaitForAStartingDaemon) {
  // Started before the daemon: they wait for it instead of failing.
  std::vector<std::unique_ptr<Child>> early;
  for (const char* command : {"health", "status"}) {
    std::vector<std::string> argv = {BinPath("refitctl"), "--addr=" + socket_, "--timeout=120s",
                                     command};
    if (std::string(command) == "health") argv.push_back("--wait");
    early.push_back(Child::Start(argv, Path(absl::StrCat("early-", command, ".out")),
                                 Path(absl::StrCat("early-", command, ".err"))));
  }
  StartDaemon({}, /*wait_ready=*/false);
  for (auto& child : early) {
    EXPECT_EQ(child->Wait(absl::Seconds(150)), 0) << child->Stderr();
  }
  EXPECT_THAT(early[0]->Stdout(), HasSubstr("ready  SERVING"));
  // status answers as soon as the daemon listens: it may find the first
  // version still loading (version 0, not ready) or loaded.
  EXPECT_THAT(early[1]->Stdout(), ::testing::ContainsRegex("version      [01]\n"));
  // No daemon at all: the unavailable exit code once --timeout passes.
  CommandResult none =
      Ctl({"health", "--wait", "--timeout=500ms"}, "unix:" + Path("nobody-here.sock"));
  EXPECT_EQ(none.code, 7) << none.err;
  EXPECT_THAT(none.err, HasSubstr("DEADLINE_EXCEEDED"));
}

TEST_F(RefitdE2eTest, ReloadProgressEndsWithEveryLayerAndPlainLinesWithoutATerminal) {
  const std::string weights = Fixture(2);
  StartDaemon({"--reload-root=" + dir_});
  CommandResult reload = Ctl({"reload", "--from", weights});
  ASSERT_EQ(reload.code, 0) << reload.err;
  // No terminal: plain lines, no carriage returns; the last one is 100% with
  // every layer done (the fixture covers them all) and bytes, not elements.
  EXPECT_THAT(reload.err, ::testing::Not(HasSubstr("\r")));
  const size_t last = reload.err.rfind("100%");
  ASSERT_NE(last, std::string::npos) << reload.err;
  const std::string line = reload.err.substr(last, reload.err.find('\n', last) - last);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(line, m, std::regex("  ([0-9]+)/([0-9]+) layers$"))) << line;
  EXPECT_EQ(m[1], m[2]) << line;
  EXPECT_NE(m[1], "0") << line;
  // Bytes read, not elements, and no "/ total" that the daemon does not report.
  EXPECT_TRUE(std::regex_search(line, std::regex("^100%  [0-9.]+ (B|KiB|MiB|GiB)  "))) << line;
}

TEST_F(RefitdE2eTest, ReadAndTensorsAndWatch) {
  StartDaemon();
  CommandResult tensors = Ctl({"tensors", "--json"});
  ASSERT_EQ(tensors.code, 0) << tensors.err;
  nlohmann::json list = nlohmann::json::parse(tensors.out, nullptr, false);
  ASSERT_FALSE(list["tensors"].empty());
  const std::string name = list["tensors"][0]["name"];
  CommandResult read = Ctl({"read", name, "--out", Path("t.bin")});
  ASSERT_EQ(read.code, 0) << read.err;
  EXPECT_EQ(ReadFileOrEmpty(Path("t.bin")).size(), list["tensors"][0]["nbytes"].get<size_t>());
  EXPECT_EQ(Ctl({"read", "no.such.tensor"}).code, 3);
  EXPECT_EQ(Ctl({"tensors", "--checkpoint"}).code, 0);

  // watch: the snapshot, then staging_started, prepared and committed of one push.
  std::vector<std::string> argv = {BinPath("refitctl"), "--addr=" + socket_, "watch", "--json",
                                   "--count=4"};
  auto watch = Child::Start(argv, Path("watch.out"), Path("watch.err"));
  ASSERT_TRUE(watch->AwaitStdout("snapshot")) << watch->Stderr();
  ASSERT_EQ(Ctl({"push", Fixture(2)}).code, 0);
  ASSERT_EQ(watch->Wait(), 0) << watch->Stderr();
  std::string out = watch->Stdout();
  EXPECT_THAT(out, HasSubstr("\"staging_started\""));
  EXPECT_THAT(out, HasSubstr("\"committed\""));
}

// SIGTERM while the first version loads: the load is aborted and the daemon
// exits 0 (a signal that reached a thread not blocking it used to end the
// process with the signal's default action).
TEST_F(RefitdE2eTest, SigtermDuringTheFirstLoadExitsZero) {
  const std::string model = Path("big");
  auto make = Child::Start({BinPath("refit_make_fixture"), "--out=" + model, "--layers=4",
                            "--hidden=1024", "--intermediate=4096", "--vocab=8192"},
                           Path("big.out"), Path("big.err"));
  ASSERT_EQ(make->Wait(absl::Seconds(120)), 0) << make->Stderr();
  StartDaemon({"--model=" + model, "--shutdown-timeout=3s"}, /*wait_ready=*/false);
  ASSERT_TRUE(daemon_->AwaitStderr("loading the first version")) << daemon_->Stderr();
  daemon_->Signal(SIGTERM);
  std::optional<int> code = daemon_->Wait(absl::Seconds(30));
  EXPECT_FALSE(daemon_->KilledBySignal(SIGTERM)) << daemon_->Stderr();
  ASSERT_TRUE(code.has_value()) << "refitd did not exit after SIGTERM:\n" << daemon_->Stderr();
  EXPECT_EQ(*code, 0) << daemon_->Stderr();
  EXPECT_THAT(daemon_->Stderr(), HasSubstr("refitd stopped"));
}

// refitctl push of one file of a two-file checkpoint: refused (a mixed model
// otherwise) naming what is missing, unless --partial.
TEST_F(RefitdE2eTest, PushOfPartOfTheModelNeedsPartial) {
  StartDaemon();
  const std::string weights = Path("two-files");
  auto make =
      Child::Start({BinPath("refit_make_fixture"), "--out=" + weights, "--seed=5", "--files=2"},
                   Path("two.out"), Path("two.err"));
  ASSERT_EQ(make->Wait(), 0) << make->Stderr();
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(weights)) {
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path().string());
  }
  ASSERT_EQ(files.size(), 2u);
  std::sort(files.begin(), files.end());
  const uint64_t v0 = StatusJson()["version"];
  CommandResult refused = Ctl({"push", files[0]});
  EXPECT_EQ(refused.code, 2) << refused.err;
  EXPECT_THAT(refused.err, HasSubstr("FAILED_PRECONDITION"));
  EXPECT_THAT(refused.err, HasSubstr("require_complete"));
  EXPECT_EQ(StatusJson()["version"], v0);
  CommandResult partial = Ctl({"push", "--partial", "--json", files[0]});
  ASSERT_EQ(partial.code, 0) << partial.err;
  EXPECT_EQ(StatusJson()["version"], v0 + 1);
  CommandResult whole = Ctl({"push", weights});
  ASSERT_EQ(whole.code, 0) << whole.err;
  EXPECT_EQ(StatusJson()["version"], v0 + 2);
}

int CountOf(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// A local peer that holds more connections open than refitd has descriptors:
// refitd closes the connections it has no room for at once (their clients see
// the close instead of hanging) and accepts again the moment descriptors are
// free. (gRPC's own listener stopped accepting for good after one EMFILE.)
TEST_F(RefitdE2eTest, ConnectionsBeyondTheDescriptorLimitAreClosedAndTheListenerRecovers) {
  StartDaemon({"--metrics-listen=127.0.0.1:0"});
  const std::string metrics = LoggedAddress("metrics at /metrics");
  ASSERT_FALSE(metrics.empty()) << daemon_->Stderr();
  EXPECT_THAT(HttpGet(metrics, "/metrics"),
              HasSubstr("\nrefitd_connections_closed_for_descriptors_total 0\n"));
  ASSERT_TRUE(Client()->GetStatus().ok());
  // refitd raised its own limit at start-up; lowered from here, it has a few
  // dozen descriptors to spare.
  const rlimit few{128, 128};
  ASSERT_EQ(::prlimit(daemon_->pid(), RLIMIT_NOFILE, &few, nullptr), 0) << std::strerror(errno);
  const std::string path = dir_ + "/refitd.sock";
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  std::vector<int> flood;
  for (int i = 0; i < 300; ++i) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    ASSERT_GE(fd, 0);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      ::close(fd);  // the backlog is full: refitd is behind; enough
      break;
    }
    flood.push_back(fd);
  }
  ASSERT_TRUE(daemon_->AwaitStderr("closing new connections at once")) << daemon_->Stderr();
  // Some of the flood was closed by refitd: reading it gives end-of-file.
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  int closed = 0;
  while (closed == 0 && absl::Now() < give_up) {
    for (int fd : flood) {
      char byte;
      closed += ::recv(fd, &byte, 1, MSG_DONTWAIT) == 0;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_GT(closed, 0);
  for (int fd : flood) ::close(fd);
  // Descriptors free again (once gRPC has closed its ends of the flood: on a
  // busy machine that takes a while): a new client is served, and once a
  // second passed without running out, the next connection says so in the
  // log.
  auto client = Client();
  bool served = false;
  for (const absl::Time until = absl::Now() + absl::Seconds(20); !served && absl::Now() < until;) {
    served = client->GetStatus().ok();
    if (!served) absl::SleepFor(absl::Milliseconds(100));  // bounded retry
  }
  EXPECT_TRUE(served) << daemon_->Stderr();
  absl::SleepFor(absl::Milliseconds(1100));
  // (A raw connection: gRPC's channels would share the client's.)
  const int late = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_EQ(::connect(late, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_TRUE(daemon_->AwaitStderr("descriptors free again")) << daemon_->Stderr();
  ::close(late);
  EXPECT_EQ(CountOf(daemon_->Stderr(), "closing new connections at once"), 1) << daemon_->Stderr();
  ASSERT_TRUE(daemon_->running());
  const std::string scraped = HttpGet(metrics, "/metrics");
  EXPECT_THAT(scraped, HasSubstr("\nrefitd_connections_closed_for_descriptors_total "));
  EXPECT_THAT(scraped, ::testing::Not(HasSubstr("_closed_for_descriptors_total 0\n")));
}

// Two daemons on one socket path: the second is refused and the first keeps
// its socket (gRPC's listener replaced any socket file, live or not).
TEST_F(RefitdE2eTest, ASecondDaemonOnALiveSocketIsRefusedAndAStaleSocketIsReplaced) {
  StartDaemon();
  auto second = Child::Start({BinPath("refitd"), "--model=demo", "--listen=" + socket_},
                             Path("second.out"), Path("second.err"));
  ASSERT_NE(second, nullptr);
  EXPECT_NE(second->Wait(), std::optional<int>(0));
  EXPECT_THAT(second->Stderr(), HasSubstr("another process listens on " + dir_ + "/refitd.sock"));
  EXPECT_TRUE(Client()->GetStatus().ok());
  // Killed, refitd leaves its socket file behind: the next one replaces it.
  daemon_->Signal(SIGKILL);
  daemon_->Wait();
  ASSERT_TRUE(std::filesystem::exists(dir_ + "/refitd.sock"));
  StartDaemon();
  EXPECT_TRUE(Client()->GetStatus().ok());
  // Stopped, it removes the file.
  daemon_->Signal(SIGTERM);
  EXPECT_EQ(daemon_->Wait(), std::optional<int>(0)) << daemon_->Stderr();
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/refitd.sock"));
}

}  // namespace
}  // namespace refit::e2e
