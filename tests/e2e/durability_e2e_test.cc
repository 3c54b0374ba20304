// End-to-end: durable versions (--state-dir) with real refitd processes
// killed with SIGKILL after a commit, in the middle of a snapshot write and in
// the middle of a push, and restarted on the same state directory; a snapshot
// with one corrupted byte. See tests/e2e/e2e_util.h for the ground rules.
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/e2e_util.h"
#include "tests/testing/temp_dir.h"

namespace refit::e2e {
namespace {

using ::testing::HasSubstr;

std::string SnapshotName(uint64_t version) {
  char name[64];
  std::snprintf(name, sizeof(name), "snapshot-%020llu.refit",
                static_cast<unsigned long long>(version));
  return name;
}

class DurabilityE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* bin : {"refitd", "refitctl", "refit_make_fixture"}) {
      if (!std::filesystem::exists(BinPath(bin))) {
        GTEST_SKIP() << BinPath(bin) << " is not built";
      }
    }
    char pattern[] = "/tmp/refit_durability_e2e_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
    socket_ = "unix:" + dir_ + "/refitd.sock";
    state_ = dir_ + "/state";
  }

  void TearDown() override {
    pusher_.reset();
    daemon_.reset();
    if (!dir_.empty() && !HasFailure()) refit::testing::RemoveTree(dir_);
    if (HasFailure()) std::cerr << "e2e: files kept in " << dir_ << "\n";
  }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  // Starts refitd on the demo model with --state-dir and `flags`; with
  // `wait_ready`, waits until it is ready. `pause_snapshot_after` >= 0 sets
  // the daemon's snapshot-write test hook.
  void StartDaemon(std::vector<std::string> flags = {}, bool wait_ready = true,
                   int64_t pause_snapshot_after = -1) {
    std::vector<std::string> argv = {BinPath("refitd"), "--model=demo", "--listen=" + socket_,
                                     "--state-dir=" + state_};
    argv.insert(argv.end(), flags.begin(), flags.end());
    ++daemon_starts_;
    if (pause_snapshot_after >= 0) {
      ::setenv("REFIT_TEST_SNAPSHOT_PAUSE_AFTER_BYTES",
               std::to_string(pause_snapshot_after).c_str(), 1);
    }
    daemon_ = Child::Start(argv, Path("refitd.out"),
                           Path(absl::StrCat("refitd-", daemon_starts_, ".log")));
    ::unsetenv("REFIT_TEST_SNAPSHOT_PAUSE_AFTER_BYTES");
    ASSERT_NE(daemon_, nullptr);
    if (!wait_ready) return;
    const bool ready = daemon_->AwaitStderr("; ready");
    ASSERT_TRUE(ready || !daemon_->running()) << "refitd never logged readiness";
    ASSERT_TRUE(daemon_->running()) << "refitd exited:\n" << daemon_->Stderr();
  }

  void KillDaemon() {
    daemon_->Signal(SIGKILL);
    EXPECT_FALSE(daemon_->Wait().has_value());
    EXPECT_TRUE(daemon_->KilledBySignal(SIGKILL));
  }

  // Waits for a log line of the daemon that holds every one of `parts`.
  bool AwaitLogLine(const std::vector<std::string>& parts) {
    return daemon_->AwaitOutput([&](const std::string&, const std::string& err) {
      for (absl::string_view line : absl::StrSplit(err, '\n')) {
        bool all = true;
        for (const std::string& p : parts) all = all && absl::StrContains(line, p);
        if (all) return true;
      }
      return false;
    });
  }
  bool AwaitSnapshot(uint64_t version) {
    return AwaitLogLine({absl::StrCat(" version=", version, " "), "snapshot written"});
  }

  CommandResult Ctl(std::vector<std::string> args) {
    std::vector<std::string> argv = {BinPath("refitctl"), "--addr=" + socket_, "--timeout=30s"};
    argv.insert(argv.end(), args.begin(), args.end());
    ++commands_;
    auto child = Child::Start(argv, Path(absl::StrCat("ctl-", commands_, ".out")),
                              Path(absl::StrCat("ctl-", commands_, ".err")));
    CommandResult r;
    r.code = child->Wait(absl::Seconds(90)).value_or(-1);
    r.out = child->Stdout();
    r.err = child->Stderr();
    return r;
  }

  nlohmann::json Status() {
    CommandResult r = Ctl({"status", "--json"});
    EXPECT_EQ(r.code, 0) << r.err;
    return nlohmann::json::parse(r.out, nullptr, false);
  }

  // Pushes `seed`'s fixture weights; returns the committed version (0 on failure).
  uint64_t Push(int seed) {
    CommandResult push = Ctl({"push", "--json", Fixture(seed)});
    EXPECT_EQ(push.code, 0) << push.err;
    nlohmann::json result = nlohmann::json::parse(push.out, nullptr, false);
    if (!result.is_object() || !result.contains("version")) return 0;
    return result["version"].get<uint64_t>();
  }

  bool Verify(int seed) {
    CommandResult verify = Ctl({"verify", Fixture(seed)});
    EXPECT_THAT(verify.out, HasSubstr("verify: OK")) << verify.out << verify.err;
    return verify.code == 0;
  }

  std::string Fixture(int seed) {
    std::string out = Path(absl::StrCat("weights-", seed));
    if (std::filesystem::exists(out)) return out;
    auto child =
        Child::Start({BinPath("refit_make_fixture"), "--out=" + out, absl::StrCat("--seed=", seed)},
                     Path("fixture.out"), Path("fixture.err"));
    EXPECT_EQ(child->Wait(), 0) << child->Stderr();
    return out;
  }

  std::vector<std::string> StateFiles() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(state_)) {
      names.push_back(e.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  std::string dir_;
  std::string socket_;
  std::string state_;
  int daemon_starts_ = 0;
  int commands_ = 0;
  std::unique_ptr<Child> daemon_;
  std::unique_ptr<Child> pusher_;
};

TEST_F(DurabilityE2eTest, CommittedPushSurvivesSigkill) {
  StartDaemon();
  EXPECT_EQ(Status()["version"], 1u);
  ASSERT_TRUE(AwaitSnapshot(1));
  ASSERT_EQ(Push(2), 2u);
  const nlohmann::json committed = Status();
  ASSERT_TRUE(AwaitSnapshot(2));
  KillDaemon();

  StartDaemon();
  EXPECT_TRUE(AwaitLogLine({"recovered version 2 from its snapshot; ready", SnapshotName(2)}));
  const nlohmann::json recovered = Status();
  EXPECT_EQ(recovered["version"], 2u);
  EXPECT_EQ(recovered["fingerprint"], committed["fingerprint"]);
  EXPECT_TRUE(Verify(2));  // every kernel byte for byte (ReadTensor)
  // The numbering goes on from there.
  EXPECT_EQ(Push(3), 3u);
}

TEST_F(DurabilityE2eTest, SigkillDuringTheSnapshotWriteServesTheLastCompleteOne) {
  StartDaemon();
  ASSERT_EQ(Push(2), 2u);
  ASSERT_TRUE(AwaitSnapshot(2));
  const std::string v2_fingerprint = Status()["fingerprint"];
  KillDaemon();

  // The restarted daemon's snapshot writes stop after 64 KiB of the file.
  StartDaemon({}, true, 64 << 10);
  ASSERT_EQ(Status()["version"], 2u);
  ASSERT_EQ(Push(3), 3u);
  ASSERT_TRUE(AwaitLogLine({"snapshot write paused (test hook)", " version=3 "}));
  KillDaemon();
  EXPECT_THAT(StateFiles(), ::testing::Contains(".snapshot-00000000000000000003.refit.tmp"));

  StartDaemon();
  EXPECT_TRUE(AwaitLogLine({"removing the partial snapshot of an interrupted write"}));
  const nlohmann::json recovered = Status();
  EXPECT_EQ(recovered["version"], 2u);
  EXPECT_EQ(recovered["fingerprint"], v2_fingerprint);
  EXPECT_TRUE(Verify(2));
  // Version 3 was handed out before the crash: never again.
  EXPECT_EQ(Push(4), 4u);
  EXPECT_THAT(StateFiles(),
              ::testing::Not(::testing::Contains(".snapshot-00000000000000000003.refit.tmp")));
}

TEST_F(DurabilityE2eTest, CorruptedSnapshotByteIsDetectedAndNeverServed) {
  StartDaemon();
  ASSERT_EQ(Push(2), 2u);
  ASSERT_TRUE(AwaitSnapshot(2));
  const std::string v2_fingerprint = Status()["fingerprint"];
  ASSERT_EQ(Push(3), 3u);
  ASSERT_TRUE(AwaitSnapshot(3));
  KillDaemon();

  // One byte of version 3's kernels, near the end of the file.
  const std::string v3 = state_ + "/" + SnapshotName(3);
  {
    std::fstream f(v3, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-7, std::ios::end);
    char c = 0;
    f.get(c);
    f.seekp(-7, std::ios::end);
    f.put(static_cast<char>(c ^ 0x01));
  }
  StartDaemon();
  EXPECT_TRUE(AwaitLogLine(
      {"ERROR", SnapshotName(3), "CORRUPT SNAPSHOT, not served", "does not match its checksum"}));
  const nlohmann::json recovered = Status();
  EXPECT_EQ(recovered["version"], 2u);
  EXPECT_EQ(recovered["fingerprint"], v2_fingerprint);
  EXPECT_TRUE(Verify(2));
  EXPECT_TRUE(std::filesystem::exists(v3 + ".rejected"));
  EXPECT_EQ(Push(4), 4u);
  ASSERT_TRUE(AwaitSnapshot(4));
  KillDaemon();

  // --state-recovery=fail: the start fails, naming the file and the reason.
  const std::string v4 = state_ + "/" + SnapshotName(4);
  std::filesystem::resize_file(v4, std::filesystem::file_size(v4) - 1);
  StartDaemon({"--state-recovery=fail"}, /*wait_ready=*/false);
  std::optional<int> code = daemon_->Wait();
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 1);
  EXPECT_THAT(daemon_->Stderr(), HasSubstr("torn snapshot"));
  EXPECT_THAT(daemon_->Stderr(), HasSubstr(SnapshotName(4)));
  EXPECT_THAT(daemon_->Stderr(), HasSubstr("--state-recovery=fail"));
  EXPECT_THAT(daemon_->Stderr(), ::testing::Not(HasSubstr("; ready")));
}

TEST_F(DurabilityE2eTest, SigkillMidPushServesTheLastCommittedVersion) {
  StartDaemon();
  ASSERT_EQ(Push(2), 2u);
  ASSERT_TRUE(AwaitSnapshot(2));
  const std::string v2_fingerprint = Status()["fingerprint"];

  // A push that stops halfway, then the daemon dies under it.
  std::unique_ptr<WatchStream> watch = WatchStream::Open(socket_);
  ASSERT_NE(watch, nullptr);
  pusher_ = Child::Start({TestBinPath("e2e_stalled_pusher"), socket_, Fixture(3)},
                         Path("pusher.out"), Path("pusher.err"), /*stdin_pipe=*/true);
  ASSERT_TRUE(pusher_->AwaitStdout("stalled")) << pusher_->Stderr();
  ASSERT_TRUE(watch->Next(v1::WatchEvent::TYPE_STAGING_STARTED).has_value());
  KillDaemon();
  watch.reset();
  pusher_.reset();

  StartDaemon();
  const nlohmann::json recovered = Status();
  EXPECT_EQ(recovered["version"], 2u);
  EXPECT_EQ(recovered["fingerprint"], v2_fingerprint);
  EXPECT_TRUE(Verify(2));
  // A new refit works; the interrupted one never took a number.
  EXPECT_EQ(Push(3), 3u);
  EXPECT_TRUE(Verify(3));
}

}  // namespace
}  // namespace refit::e2e
