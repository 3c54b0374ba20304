// refitctl fleet: usage, and status against a real etcd
// (tests/testing/etcd_process.h). Fleet refits themselves run in
// tests/e2e/fleet_fault_test.cc with real daemons.
#include "client/fleet_command.h"

#include <stdlib.h>

#include <fstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "client/refitctl.h"
#include "nlohmann/json.hpp"
#include "tests/testing/etcd_process.h"

namespace refit::client {
namespace {

using ::testing::HasSubstr;

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

TEST(FleetCommandTest, UsageErrorsExitOne) {
  std::string err;
  EXPECT_EQ(RunCtl({"fleet"}, nullptr, &err), kExitUsage);
  EXPECT_THAT(err, HasSubstr("a subcommand is needed"));
  EXPECT_EQ(RunCtl({"fleet", "status"}, nullptr, &err), kExitUsage);
  EXPECT_THAT(err, HasSubstr("needs --etcd and --fleet"));
  EXPECT_EQ(RunCtl({"fleet", "push", "--etcd=127.0.0.1:1", "--fleet=f"}, nullptr, &err),
            kExitUsage);
  EXPECT_THAT(err, HasSubstr("needs a directory or files"));
  EXPECT_EQ(RunCtl({"fleet", "status", "--etcd=h:1", "--fleet=f", "--bogus=1"}, nullptr, &err),
            kExitUsage);
  EXPECT_THAT(err, HasSubstr("unknown flag --bogus"));
  EXPECT_EQ(
      RunCtl({"fleet", "status", "--etcd=h:1", "--fleet=f", "--keep-decisions=-1"}, nullptr, &err),
      kExitUsage);
  EXPECT_THAT(err, HasSubstr("--keep-decisions: not a count"));
  // Names a daemon's --fleet refuses have no members: refused here too.
  EXPECT_NE(RunCtl({"fleet", "status", "--etcd=127.0.0.1:1", "--fleet=a b"}, nullptr, &err),
            kExitOk);
  EXPECT_THAT(err, HasSubstr("--fleet \"a b\": a fleet name is 1 to 128 of [A-Za-z0-9._-]"));
  std::string out;
  EXPECT_EQ(RunCtl({"fleet", "--help"}, &out), kExitOk);
  EXPECT_THAT(out, HasSubstr("refitctl fleet push DIR"));
}

TEST(FleetCommandTest, FlagsBeforeFleetAreItsOwn) {
  // `refitctl --timeout 1s --json fleet status ...`: the flags are the fleet
  // command's, neither dropped nor taken for the command.
  std::string err;
  EXPECT_EQ(RunCtl({"--timeout", "1s", "--json", "fleet", "status",
                    absl::StrCat("--etcd=127.0.0.1:", refit::testing::PickFreePort()), "--fleet=f"},
                   nullptr, &err),
            kExitUnavailable)
      << err;
  // One the fleet command does not have is its usage error.
  EXPECT_EQ(RunCtl({"--group", "g", "fleet", "status", "--etcd=h:1", "--fleet=f"}, nullptr, &err),
            kExitUsage);
  EXPECT_THAT(err, HasSubstr("unknown flag --group"));
}

TEST(FleetCommandTest, StatusWithEtcdUnreachableExitsSeven) {
  std::string err;
  EXPECT_EQ(RunCtl({"fleet", "status",
                    absl::StrCat("--etcd=127.0.0.1:", refit::testing::PickFreePort()), "--fleet=f"},
                   nullptr, &err),
            kExitUnavailable);
  EXPECT_THAT(err, HasSubstr("etcd"));
}

TEST(FleetCommandTest, StatusOfAnEmptyFleetAndAPushWithNoMembers) {
  if (refit::testing::EtcdBinary().empty()) {
    GTEST_SKIP() << "no etcd binary (apt-get install etcd-server; scripts/setup.sh does)";
  }
  std::string dir = ::testing::TempDir() + "/fleet_command_test.XXXXXX";
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  auto etcd = refit::testing::EtcdProcess::Start(dir);
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  std::string out, err;
  EXPECT_EQ(RunCtl({"fleet", "status", "--etcd=" + (*etcd)->endpoint(), "--fleet=f", "--json"},
                   &out, &err),
            kExitOk)
      << err;
  nlohmann::json j = nlohmann::json::parse(out);
  EXPECT_EQ(j["fleet"], "f");
  EXPECT_EQ(j["fleet_version"], 0);
  EXPECT_EQ(j["consistent"], false);
  EXPECT_TRUE(j["members"].empty());
  // A refit of a fleet with no members: FAILED_PRECONDITION (exit 2) before
  // anything is written.
  const std::string header = R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  file += header + std::string(4, '\0');
  const std::string weights = dir + "/x.safetensors";
  std::ofstream(weights, std::ios::binary) << file;
  EXPECT_EQ(
      RunCtl({"fleet", "push", weights, "--etcd=" + (*etcd)->endpoint(), "--fleet=f"}, &out, &err),
      kExitError);
  EXPECT_THAT(err, HasSubstr("no members"));
  etcd->reset();
  refit::testing::RemoveTree(dir);
}

}  // namespace
}  // namespace refit::client
