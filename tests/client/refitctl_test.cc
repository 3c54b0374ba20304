#include "client/refitctl.h"

#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/progress_bar.h"
#include "client/refit_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/client/fake_refit_service.h"

namespace refit::client {
namespace {

using ::refit::client::testing::FakeServer;
using ::testing::HasSubstr;

// Runs refitctl in-process; returns the exit code, stdout in *out.
int RunCtl(std::vector<std::string> args, std::string* out = nullptr, std::string* err = nullptr) {
  args.insert(args.begin(), "refitctl");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  int code = RunRefitctl(static_cast<int>(argv.size()), argv.data());
  std::string o = ::testing::internal::GetCapturedStdout();
  std::string e = ::testing::internal::GetCapturedStderr();
  if (out != nullptr) *out = o;
  if (err != nullptr) *err = e;
  return code;
}

TEST(RefitctlTest, ExitCodesFollowTheStatusCode) {
  EXPECT_EQ(ExitCodeFor(absl::OkStatus()), 0);
  EXPECT_EQ(ExitCodeFor(absl::InvalidArgumentError("")), 2);
  EXPECT_EQ(ExitCodeFor(absl::InternalError("")), 2);
  EXPECT_EQ(ExitCodeFor(absl::NotFoundError("")), 3);
  EXPECT_EQ(ExitCodeFor(absl::PermissionDeniedError("")), 4);
  EXPECT_EQ(ExitCodeFor(absl::UnauthenticatedError("")), 4);
  EXPECT_EQ(ExitCodeFor(absl::AbortedError("")), 5);
  // Not a conflict: retrying without fixing something first cannot help.
  EXPECT_EQ(ExitCodeFor(absl::FailedPreconditionError("")), 2);
  EXPECT_EQ(ExitCodeFor(absl::AlreadyExistsError("")), 2);
  EXPECT_EQ(ExitCodeFor(absl::DataLossError("")), 2);
  EXPECT_EQ(ExitCodeFor(absl::UnavailableError("")), 7);
  EXPECT_EQ(ExitCodeFor(absl::DeadlineExceededError("")), 7);
}

TEST(RefitctlTest, HelpDocumentsCommandsAndExitCodes) {
  std::string out;
  EXPECT_EQ(RunCtl({"--help"}, &out), 0);
  EXPECT_THAT(out, HasSubstr("verify FILES|DIR"));
  EXPECT_THAT(out, HasSubstr("Exit codes:"));
  EXPECT_THAT(out, HasSubstr("6  verify found mismatches"));
  EXPECT_THAT(out, HasSubstr("5  conflict (ABORTED): another refit is active, the live version is "
                             "not\n     --base-version"));
}

TEST(RefitctlTest, UsageErrorsExitOne) {
  std::string err;
  EXPECT_EQ(RunCtl({}, nullptr, &err), 1);
  EXPECT_THAT(err, HasSubstr("no command given"));
  EXPECT_EQ(RunCtl({"frobnicate"}, nullptr, &err), 1);
  EXPECT_THAT(err, HasSubstr("unknown command 'frobnicate'"));
  EXPECT_EQ(RunCtl({"status", "--no-such-flag"}, nullptr, &err), 1);
  EXPECT_THAT(err, HasSubstr("unknown flag --no-such-flag"));
  EXPECT_EQ(RunCtl({"read"}, nullptr, &err), 1);
  EXPECT_EQ(RunCtl({"push", "x.safetensors", "--base-version", "abc"}, nullptr, &err), 1);
  EXPECT_THAT(err, HasSubstr("--base-version needs a non-negative integer"));
}

TEST(RefitctlTest, StatusJsonHasVersionAndFingerprint) {
  FakeServer server;
  std::string out;
  ASSERT_EQ(RunCtl({"--addr", server.address(), "status", "--json"}, &out), 0);
  nlohmann::json j = nlohmann::json::parse(out);
  EXPECT_EQ(j["version"], 7);
  EXPECT_EQ(j["fingerprint"], "00112233aabbccdd");
  EXPECT_TRUE(j["active_refit"].is_null());
}

TEST(RefitctlTest, StatusHumanOutput) {
  FakeServer server;
  std::string out;
  ASSERT_EQ(RunCtl({"status", "--addr=" + server.address()}, &out), 0);
  EXPECT_THAT(out, HasSubstr("version      7"));
  EXPECT_THAT(out, HasSubstr("active refit none"));
}

TEST(RefitctlTest, HealthExitsZeroOnlyWhenReady) {
  FakeServer server;
  std::string out;
  server.server().GetHealthCheckService()->SetServingStatus(::refit::client::kReadinessService,
                                                            false);
  EXPECT_EQ(RunCtl({"--addr", server.address(), "health"}, &out), 7);
  EXPECT_THAT(out, HasSubstr("ready  NOT_SERVING"));
  server.server().GetHealthCheckService()->SetServingStatus(::refit::client::kReadinessService,
                                                            true);
  EXPECT_EQ(RunCtl({"--addr", server.address(), "health", "--json"}, &out), 0);
  EXPECT_EQ(nlohmann::json::parse(out)["ready"], "SERVING");
}

TEST(RefitctlTest, RefusedPushExitsFiveWithTheDaemonsMessage) {
  FakeServer server;
  server.service().SetPushStatus(
      grpc::Status(grpc::StatusCode::ABORTED, "refit r-9 is active on group target"));
  // POSIX, not std::filesystem: this binary links LibTorch, whose
  // libtorch.so exports broken std::filesystem symbols.
  char pattern[] = "/tmp/refitctl_test_XXXXXX";
  ASSERT_NE(::mkdtemp(pattern), nullptr);
  std::string dir = pattern;
  {
    std::ofstream f(dir + "/m.safetensors", std::ios::binary);
    std::string header = R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
    uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) f.put(static_cast<char>((n >> (8 * i)) & 0xff));
    f << header << "ab";
  }
  std::string err;
  EXPECT_EQ(RunCtl({"--addr", server.address(), "push", dir}, nullptr, &err), 5);
  EXPECT_THAT(err, HasSubstr("ABORTED: refit r-9 is active"));
  EXPECT_EQ(RunCtl({"--addr", server.address(), "push", dir + "/missing"}, nullptr, &err), 3);
  ::unlink((dir + "/m.safetensors").c_str());
  ::rmdir(dir.c_str());
}

TEST(RefitctlTest, CommitOfARefitStillReceivingExitsTwo) {
  FakeServer server;
  server.service().Fail("Commit", grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                               "refit \"r-3\" is still receiving"));
  std::string err;
  EXPECT_EQ(RunCtl({"--addr", server.address(), "commit", "r-3"}, nullptr, &err), 2);
  EXPECT_THAT(err, HasSubstr("FAILED_PRECONDITION: refit \"r-3\" is still receiving"));
}

TEST(RefitctlTest, StaleBaseVersionExitsFive) {
  FakeServer server;
  server.service().Fail("Reload",
                        grpc::Status(grpc::StatusCode::ABORTED,
                                     "base version 4 is not the live version 5; re-read it"));
  std::string err;
  EXPECT_EQ(RunCtl({"--addr", server.address(), "reload", "--from", "/models/step-9",
                    "--base-version", "4"},
                   nullptr, &err),
            5);
  EXPECT_THAT(err, HasSubstr("ABORTED: base version 4"));
}

TEST(RefitctlTest, ReadUnknownTensorExitsThree) {
  FakeServer server;
  server.service().SetTensor("t", "abc");
  EXPECT_EQ(RunCtl({"--addr", server.address(), "read", "nope"}), 3);
  std::string out;
  EXPECT_EQ(RunCtl({"--addr", server.address(), "read", "t", "--json"}, &out), 0);
  EXPECT_EQ(nlohmann::json::parse(out)["nbytes"], 3);
}

TEST(RefitctlTest, WatchStopsAfterCount) {
  FakeServer server;
  std::string out;
  ASSERT_EQ(RunCtl({"--addr", server.address(), "watch", "--count", "2", "--json"}, &out), 0);
  std::vector<std::string> lines = absl::StrSplit(absl::StripTrailingAsciiWhitespace(out), '\n');
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(nlohmann::json::parse(lines[0])["type"], "snapshot");
  EXPECT_EQ(nlohmann::json::parse(lines[1])["type"], "committed");
}

TEST(RefitctlTest, UnreachableDaemonExitsSeven) {
  EXPECT_EQ(RunCtl({"--addr", "unix:/nonexistent/refitd.sock", "--timeout", "2s", "status"}), 7);
}

TEST(ProgressBarTest, FormatsBytesRateAndEta) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
  EXPECT_EQ(FormatBytes(uint64_t{3} << 30), "3.0 GiB");
  EXPECT_EQ(FormatEta(absl::Seconds(7)), "0:07");
  EXPECT_EQ(FormatEta(absl::Seconds(3723)), "1:02:03");
  EXPECT_EQ(FormatEta(absl::InfiniteDuration()), "--:--");
  std::string line = FormatProgressLine(uint64_t{50} << 20, uint64_t{100} << 20, absl::Seconds(2),
                                        /*bar_width=*/10);
  EXPECT_EQ(line, "[#####-----]  50%  50.0 MiB / 100.0 MiB  25.0 MiB/s  ETA 0:02");
  EXPECT_THAT(FormatProgressLine(0, 100, absl::ZeroDuration(), 4), HasSubstr("ETA --:--"));
}

}  // namespace
}  // namespace refit::client
