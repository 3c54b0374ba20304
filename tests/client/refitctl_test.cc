#include "client/refitctl.h"

#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/progress_bar.h"
#include "client/refit_client.h"
#include "core/version.h"
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

TEST(RefitctlTest, AFlagOfAnotherCommandIsAUsageErrorNotIgnored) {
  // verify takes its own pin; --at-version belongs to read.
  std::string err;
  EXPECT_EQ(RunCtl({"verify", "dir", "--at-version", "99"}, nullptr, &err), 1);
  EXPECT_THAT(err, HasSubstr("--at-version is not a flag of 'verify' (its flags: --config, "
                             "--quant, --tp-rank, --tp-size)"));
  EXPECT_EQ(RunCtl({"status", "--prepare"}, nullptr, &err), 1);
  EXPECT_THAT(err, HasSubstr("--prepare is not a flag of 'status'\n"));
  EXPECT_EQ(RunCtl({"reload", "--from", "x", "--streams", "2"}, nullptr, &err), 1);
  EXPECT_THAT(err, HasSubstr("--streams is not a flag of 'reload'"));
  // Global flags go with every command.
  FakeServer server;
  EXPECT_EQ(
      RunCtl({"status", "--addr", server.address(), "--json", "--timeout", "5s"}, nullptr, &err), 0)
      << err;
}

TEST(RefitctlTest, StatusListsTheAttachedEngines) {
  FakeServer server;
  refit::v1::AttachedEngine engine;
  engine.set_engine_id("e-3");
  engine.set_name("vllm \"rank 0\"");
  engine.set_pid(4242);
  engine.set_uid(1000);
  engine.set_coordinated(true);
  engine.set_version(7);
  server.service().SetEngines({engine});
  std::string out;
  ASSERT_EQ(RunCtl({"--addr", server.address(), "status"}, &out), 0);
  EXPECT_THAT(out, HasSubstr("engine       e-3 \"vllm \\\"rank 0\\\"\" pid 4242 uid 1000, "
                             "coordinated, told of version 7\n"));
  ASSERT_EQ(RunCtl({"--addr", server.address(), "status", "--json"}, &out), 0);
  nlohmann::json j = nlohmann::json::parse(out);
  ASSERT_EQ(j["engines"].size(), 1u);
  EXPECT_EQ(j["engines"][0]["engine_id"], "e-3");
  EXPECT_EQ(j["engines"][0]["name"], "vllm \"rank 0\"");
  EXPECT_EQ(j["engines"][0]["pid"], 4242);
  EXPECT_EQ(j["engines"][0]["coordinated"], true);
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

TEST(RefitctlTest, HealthLiveChecksLivenessAloneAndNeedsAnAnsweringServer) {
  FakeServer server;
  std::string out, err;
  server.server().GetHealthCheckService()->SetServingStatus(::refit::client::kReadinessService,
                                                            false);
  EXPECT_EQ(RunCtl({"--addr", server.address(), "health", "--live"}, &out), 0);
  EXPECT_EQ(out, "live   SERVING\n");
  EXPECT_EQ(RunCtl({"--addr", server.address(), "health", "--live", "--json"}, &out), 0);
  EXPECT_EQ(nlohmann::json::parse(out)["live"], "SERVING");
  EXPECT_FALSE(nlohmann::json::parse(out).contains("ready"));
  server.server().GetHealthCheckService()->SetServingStatus("", false);
  EXPECT_EQ(RunCtl({"--addr", server.address(), "health", "--live"}, &out), 7);
  EXPECT_THAT(out, HasSubstr("live   NOT_SERVING"));
  EXPECT_EQ(RunCtl({"--addr", server.address(), "health", "--live", "--group", "g"}, &out, &err),
            2);
  EXPECT_THAT(err, HasSubstr("drop --group"));
  // Nothing answering: the probe fails (exit 7) within its timeout.
  EXPECT_EQ(
      RunCtl({"--addr", "unix:/nonexistent/refitd.sock", "--timeout", "300ms", "health", "--live"},
             nullptr, &err),
      7);
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

TEST(RefitctlTest, PushRequiresACompleteModelUnlessPartial) {
  FakeServer server;
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
  ASSERT_EQ(RunCtl({"--addr", server.address(), "push", dir}), 0);
  ASSERT_EQ(RunCtl({"--addr", server.address(), "push", "--partial", dir}), 0);
  const auto pushes = server.service().pushes();
  ASSERT_EQ(pushes.size(), 2u);
  ASSERT_FALSE(pushes[0].messages.empty());
  EXPECT_TRUE(pushes[0].messages[0].begin().options().require_complete());
  EXPECT_FALSE(pushes[1].messages[0].begin().options().require_complete());
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

TEST(RefitctlTest, ReloadTakesThePushFlagsItSends) {
  FakeServer server;
  std::string err;
  ASSERT_EQ(RunCtl({"--addr", server.address(), "reload", "--from", "/models/step-9",
                    "--vllm-non-finite", "--allow-partial"},
                   nullptr, &err),
            0)
      << err;
  const refit::v1::ReloadRequest sent = server.service().last_reload();
  EXPECT_EQ(sent.options().non_finite(), refit::v1::NON_FINITE_POLICY_VLLM_COMPATIBLE);
  EXPECT_TRUE(sent.options().allow_partial_layers());
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

TEST(RefitctlTest, UnreachableDaemonWithoutATimeoutGivesUpAfterTheDefault) {
  // Read-only commands wait for a starting daemon, but not for ever.
  std::string err;
  EXPECT_EQ(RunCtl({"--addr", "unix:/nonexistent/refitd.sock", "health"}, nullptr, &err), 7);
  EXPECT_THAT(err, HasSubstr("DEADLINE_EXCEEDED"));
}

TEST(RefitctlTest, HealthWaitExitsZeroOnceServingAndSevenAfterTheTimeout) {
  FakeServer server;
  auto health = server.server().GetHealthCheckService();
  health->SetServingStatus(::refit::client::kReadinessService, false);
  std::string out, err;
  EXPECT_EQ(
      RunCtl({"--addr", server.address(), "health", "--wait", "--timeout", "300ms"}, &out, &err),
      7);
  EXPECT_THAT(err, HasSubstr("DEADLINE_EXCEEDED"));
  EXPECT_THAT(err, HasSubstr("NOT_SERVING"));
  std::thread ready([&] { health->SetServingStatus(::refit::client::kReadinessService, true); });
  EXPECT_EQ(RunCtl({"--addr", server.address(), "health", "--wait", "--timeout", "60s"}, &out), 0);
  ready.join();
  EXPECT_THAT(out, HasSubstr("ready  SERVING"));
  // An absent daemon: waited for, then the unavailable exit code.
  EXPECT_EQ(
      RunCtl({"--addr", "unix:/nonexistent/refitd.sock", "health", "--wait", "--timeout", "300ms"},
             nullptr, &err),
      7);
  EXPECT_THAT(err, HasSubstr("last seen: unreachable"));
}

TEST(RefitctlTest, WatchEndsAtTheTimeoutWithExitZero) {
  FakeServer server;  // its Watch stays open after four events
  std::string out;
  ASSERT_EQ(RunCtl({"--addr", server.address(), "watch", "--timeout", "300ms", "--json"}, &out), 0);
  std::vector<std::string> lines = absl::StrSplit(absl::StripTrailingAsciiWhitespace(out), '\n');
  EXPECT_EQ(lines.size(), 4u);
}

TEST(RefitctlTest, ABoundedWatchOfNoDaemonIsUnavailableNotAQuietWatch) {
  // Waited for until the timeout, as every read-only call; a watch that
  // never reached a daemon must not look like one that saw no events.
  std::string err;
  EXPECT_EQ(RunCtl({"--addr", "unix:/nonexistent/refitd.sock", "watch", "--timeout", "300ms"},
                   nullptr, &err),
            7);
  EXPECT_THAT(err, HasSubstr("no refitd answered at unix:/nonexistent/refitd.sock"));
}

TEST(RefitctlTest, CommitAndAbortWithoutAnIdSendTheEmptyId) {
  FakeServer server;
  std::string out;
  ASSERT_EQ(RunCtl({"--addr", server.address(), "commit", "--json"}, &out), 0);
  EXPECT_EQ(nlohmann::json::parse(out)["refit_id"], "");
  ASSERT_EQ(RunCtl({"--addr", server.address(), "abort", "--json"}, &out), 0);
  EXPECT_EQ(nlohmann::json::parse(out)["refit_id"], "");
  // The daemon resolves the id; refitctl no longer looks it up itself.
  EXPECT_EQ(server.service().status_calls(), 0);
}

TEST(RefitctlTest, AddressWithAPortOutOfRangeIsRefused) {
  std::string err;
  EXPECT_EQ(RunCtl({"--addr", "127.0.0.1:500510", "status"}, nullptr, &err), 2);
  EXPECT_THAT(err, HasSubstr("INVALID_ARGUMENT"));
  EXPECT_THAT(err, HasSubstr("\"127.0.0.1:500510\""));
}

TEST(RefitctlTest, VersionIsTheBuildsVersion) {
  std::string out;
  EXPECT_EQ(RunCtl({"--version"}, &out), 0);
  EXPECT_EQ(out, absl::StrCat("refitctl ", core::VersionString(), "\n"));
  EXPECT_THAT(out, HasSubstr(std::string(core::Version())));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("absl")));
}

ProgressSample Sample(uint64_t done, uint64_t total, absl::Duration elapsed,
                      std::string detail = "") {
  ProgressSample s;
  s.done = s.bytes_done = done;
  s.total = s.bytes_total = total;
  s.elapsed = elapsed;
  s.detail = std::move(detail);
  return s;
}

TEST(RefitctlTest, PushOverStreamsOpensTheRefitOnOneAndJoinsItOnTheOther) {
  FakeServer server;
  char pattern[] = "/tmp/refitctl_test_XXXXXX";
  ASSERT_NE(::mkdtemp(pattern), nullptr);
  std::string dir = pattern;
  {
    std::ofstream f(dir + "/m.safetensors", std::ios::binary);
    std::string header = R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                         R"("v":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})";
    uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) f.put(static_cast<char>((n >> (8 * i)) & 0xff));
    f << header << "abcd";
  }
  std::string err;
  ASSERT_EQ(RunCtl({"--addr", server.address(), "push", "--streams", "2", dir}, nullptr, &err), 0)
      << err;
  const auto pushes = server.service().pushes();
  ASSERT_EQ(pushes.size(), 2u);
  std::string opened, joined;
  for (const auto& push : pushes) {
    ASSERT_FALSE(push.messages.empty());
    const refit::v1::Begin& begin = push.messages[0].begin();
    if (begin.join_refit_id().empty()) {
      EXPECT_EQ(begin.streams(), 2u);
      opened = begin.refit_id();
    } else {
      EXPECT_FALSE(begin.has_options());
      joined = begin.join_refit_id();
    }
    EXPECT_TRUE(push.messages.back().has_end());
  }
  EXPECT_FALSE(opened.empty());
  EXPECT_EQ(joined, opened);
  EXPECT_EQ(RunCtl({"--addr", server.address(), "push", "--streams", "0", dir}, nullptr, &err), 1);
  EXPECT_THAT(err, HasSubstr("--streams needs an integer from 1 to 64"));
  ::unlink((dir + "/m.safetensors").c_str());
  ::rmdir(dir.c_str());
}

TEST(ProgressBarTest, FormatsBytesRateAndEta) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
  EXPECT_EQ(FormatBytes(uint64_t{3} << 30), "3.0 GiB");
  EXPECT_EQ(FormatEta(absl::Seconds(7)), "0:07");
  EXPECT_EQ(FormatEta(absl::Seconds(3723)), "1:02:03");
  EXPECT_EQ(FormatEta(absl::InfiniteDuration()), "--:--");
  // 80 columns: the fields take 48, the bar the rest but the last column.
  ProgressSample half = Sample(uint64_t{50} << 20, uint64_t{100} << 20, absl::Seconds(2));
  std::string line = FormatProgressLine(half, 80);
  EXPECT_EQ(line, absl::StrCat("[", std::string(14, '#'), std::string(14, '-'),
                               "]  50%  50.0 MiB / 100.0 MiB  25.0 MiB/s  ETA 0:02"));
  EXPECT_EQ(line.size(), 79u);
  EXPECT_EQ(PlainProgressLine(half), " 50%  50.0 MiB / 100.0 MiB  25.0 MiB/s  ETA 0:02");
  EXPECT_THAT(FormatProgressLine(Sample(0, 100, absl::ZeroDuration()), 80), HasSubstr("ETA --:--"));
  // A byte total that is not known shows the bytes so far.
  ProgressSample reload = Sample(5, 10, absl::Seconds(1), "3/8 layers");
  reload.bytes_done = 2048;
  reload.bytes_total = 0;
  EXPECT_EQ(PlainProgressLine(reload), " 50%  2.0 KiB  2.0 KiB/s  ETA 0:01  3/8 layers");
}

TEST(ProgressBarTest, FitsEveryTerminalWidth) {
  const ProgressSample s =
      Sample(uint64_t{120} << 20, uint64_t{266} << 20, absl::Seconds(3), "12/31 layers");
  for (int columns = 1; columns <= 200; ++columns) {
    const std::string line = FormatProgressLine(s, columns);
    EXPECT_LE(line.size(), static_cast<size_t>(std::max(columns - 1, 1))) << columns;
  }
  // Wide: everything, and the bar at its widest.
  EXPECT_THAT(FormatProgressLine(s, 200), HasSubstr(absl::StrCat("[", std::string(18, '#'))));
  EXPECT_THAT(FormatProgressLine(s, 200), HasSubstr("12/31 layers"));
  // 60 columns: the rate goes first, the bar stays.
  const std::string narrow = FormatProgressLine(s, 60);
  EXPECT_THAT(narrow, ::testing::StartsWith("["));
  EXPECT_THAT(narrow, ::testing::Not(HasSubstr("/s")));
  EXPECT_THAT(narrow, HasSubstr("45%"));
  // 40 columns: the bar and the percentage are what is left.
  EXPECT_THAT(FormatProgressLine(s, 40), ::testing::MatchesRegex("\\[#*-*\\]  45%"));
}

TEST(ProgressBarTest, TerminalColumnsComeFromColumnsWithoutATerminal) {
  const char* saved = std::getenv("COLUMNS");
  const std::string restore = saved != nullptr ? saved : "";
  ::setenv("COLUMNS", "57", 1);
  EXPECT_EQ(TerminalColumns(-1), 57);
  ::unsetenv("COLUMNS");
  EXPECT_EQ(TerminalColumns(-1), 80);
  if (saved != nullptr) ::setenv("COLUMNS", restore.c_str(), 1);
}

std::string Lines(ProgressBar::Mode mode, const std::vector<ProgressSample>& samples,
                  const std::optional<ProgressSample>& last) {
  char* buffer = nullptr;
  size_t size = 0;
  std::FILE* out = ::open_memstream(&buffer, &size);
  {
    ProgressBar bar(out, mode, /*columns=*/60, /*plain_interval=*/absl::Seconds(2));
    for (const ProgressSample& s : samples) bar.Update(s);
    bar.Finish(last);
  }
  std::fclose(out);
  std::string text(buffer, size);
  std::free(buffer);
  return text;
}

TEST(ProgressBarTest, WithoutATerminalPrintsAPlainLineEveryIntervalAndAtTheEnd) {
  std::vector<ProgressSample> samples;
  for (int ms = 0; ms <= 5000; ms += 250) {
    samples.push_back(Sample(static_cast<uint64_t>(ms), 5000, absl::Milliseconds(ms)));
  }
  const std::string text = Lines(ProgressBar::Mode::kPlain, samples, samples.back());
  std::vector<std::string> lines = absl::StrSplit(absl::StripTrailingAsciiWhitespace(text), '\n');
  // At 2 s, at 4 s, and the end.
  ASSERT_EQ(lines.size(), 3u) << text;
  EXPECT_THAT(lines[0], ::testing::StartsWith(" 40%"));
  EXPECT_THAT(lines[1], ::testing::StartsWith(" 80%"));
  EXPECT_THAT(lines[2], ::testing::StartsWith("100%"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("\r")));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("[")));
  // A failure prints no final line.
  EXPECT_EQ(Lines(ProgressBar::Mode::kPlain, {samples[0]}, std::nullopt), "");
  EXPECT_EQ(Lines(ProgressBar::Mode::kOff, samples, samples.back()), "");
}

TEST(ProgressBarTest, OnATerminalRedrawsInPlaceWithinTheWidth) {
  const std::string text = Lines(
      ProgressBar::Mode::kTerminal,
      {Sample(0, 10, absl::ZeroDuration()), Sample(5, 10, absl::Milliseconds(50)),  // throttled
       Sample(10, 10, absl::Milliseconds(60))},
      Sample(10, 10, absl::Milliseconds(70), "4/4 layers"));
  std::vector<std::string> draws = absl::StrSplit(text, '\r', absl::SkipEmpty());
  ASSERT_EQ(draws.size(), 3u) << text;
  EXPECT_THAT(draws[0], HasSubstr("  0%"));
  EXPECT_THAT(draws[1], HasSubstr("100%"));
  EXPECT_THAT(draws[2], HasSubstr("4/4 layers"));
  EXPECT_EQ(text.back(), '\n');
  for (std::string draw : draws) {
    draw = draw.substr(0, draw.find("\x1b[K"));
    EXPECT_LE(draw.size(), 59u) << draw;
  }
}

}  // namespace
}  // namespace refit::client
