// End-to-end: one real refitd serving two model groups of different shapes (a
// target, and a draft at tensor-parallel rank 0 of 2 with block scales),
// driven by the real refitctl: per-group readiness, a linked push that flips
// both groups and verifies byte for byte in each, a bad draft that leaves both
// groups as they were, and each group's snapshot recovered after a restart.
// See tests/e2e/e2e_util.h for the ground rules.
#include <stdlib.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/daemon_dir_test.h"
#include "tests/e2e/e2e_util.h"

namespace refit::e2e {
namespace {

using ::testing::HasSubstr;

class MultiGroupE2eTest : public DaemonDirTest {
 protected:
  MultiGroupE2eTest() : DaemonDirTest("refit_groups_e2e", {}, absl::Seconds(120)) {}

  // refitd with both groups; returns once every group is ready (the
  // daemon's readiness, which `health --wait` follows).
  void StartDaemon(const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {BinPath("refitd"), "--listen=" + socket_,
                                     "--group=target=demo",
                                     "--group=draft=demo,tp=2,quant=block,seed=5"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    ++starts_;
    daemon_ = Child::Start(argv, Path(absl::StrCat("refitd-", starts_, ".out")),
                           Path(absl::StrCat("refitd-", starts_, ".err")));
    ASSERT_NE(daemon_, nullptr);
    CommandResult health = Ctl({"health", "--wait", "--timeout=120s"});
    ASSERT_EQ(health.code, 0) << health.out << health.err << daemon_->Stderr();
  }

  // The groups of `refitctl status --json`, by name.
  std::map<std::string, nlohmann::json> Groups() {
    CommandResult r = Ctl({"status", "--json"});
    EXPECT_EQ(r.code, 0) << r.err;
    nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
    std::map<std::string, nlohmann::json> out;
    if (j.is_discarded() || !j.contains("groups")) return out;
    for (const nlohmann::json& g : j["groups"]) out[g["model_group"]] = g;
    return out;
  }

  std::string Fixture(int seed, const std::string& arch = "llama") {
    const std::string out = Path(absl::StrCat(arch, "-", seed));
    CommandResult r = Run({BinPath("refit_make_fixture"), "--out=" + out, "--arch=" + arch,
                           absl::StrCat("--seed=", seed)});
    EXPECT_EQ(r.code, 0) << r.err;
    return out;
  }

  int starts_ = 0;
};

TEST_F(MultiGroupE2eTest, GroupsHaveTheirOwnShapesAndReadiness) {
  StartDaemon();
  std::map<std::string, nlohmann::json> groups = Groups();
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups["target"]["model"]["tp_size"], 1);
  EXPECT_EQ(groups["draft"]["model"]["tp_size"], 2);
  EXPECT_EQ(groups["draft"]["model"]["quantization"], "block");
  EXPECT_EQ(groups["target"]["version"], 1);
  EXPECT_EQ(groups["draft"]["version"], 1);
  EXPECT_EQ(Ctl({"--group=draft", "health"}).code, 0);
  CommandResult unknown = Ctl({"--group=eagle", "health"});
  EXPECT_NE(unknown.code, 0);
  CommandResult text = Ctl({"status"});
  EXPECT_THAT(text.out, HasSubstr("group        target"));
  EXPECT_THAT(text.out, HasSubstr("group        draft"));
}

TEST_F(MultiGroupE2eTest, LinkedPushFlipsBothAndEachVerifies) {
  StartDaemon();
  const std::string weights = Fixture(2);
  CommandResult push = Ctl({"push", weights, "--link=draft=" + weights});
  ASSERT_EQ(push.code, 0) << push.out << push.err;
  EXPECT_THAT(push.out, HasSubstr("linked commit of 2 groups"));
  std::map<std::string, nlohmann::json> groups = Groups();
  EXPECT_EQ(groups["target"]["version"], 2);
  EXPECT_EQ(groups["draft"]["version"], 2);
  // Each group's kernels are the checkpoint's, quantized as that group's
  // layout says (the draft: rank 0 of 2, block scales).
  CommandResult target = Ctl({"verify", weights, "--timeout=120s"});
  EXPECT_EQ(target.code, 0) << target.out << target.err;
  EXPECT_THAT(target.out, HasSubstr("verify: OK"));
  CommandResult draft = Ctl({"--group=draft", "verify", weights, "--timeout=120s"});
  EXPECT_EQ(draft.code, 0) << draft.out << draft.err;
  EXPECT_THAT(draft.out, HasSubstr("verify: OK"));
}

TEST_F(MultiGroupE2eTest, ABadDraftAbortsTheTargetsRefitToo) {
  StartDaemon();
  const std::string weights = Fixture(2);
  // A checkpoint of another architecture: its tensors are unknown to the
  // draft, so the draft's push fails after the target's is PREPARED.
  const std::string other = Fixture(2, "qwen3_moe");
  CommandResult push = Ctl({"push", weights, "--link=draft=" + other});
  EXPECT_EQ(push.code, 3) << push.out << push.err;  // NOT_FOUND: an unknown tensor
  EXPECT_THAT(push.err, HasSubstr("model group draft"));
  std::map<std::string, nlohmann::json> groups = Groups();
  EXPECT_EQ(groups["target"]["version"], 1);
  EXPECT_EQ(groups["draft"]["version"], 1);
  EXPECT_TRUE(groups["target"]["active_refit"].is_null()) << groups["target"].dump();
  EXPECT_TRUE(groups["draft"]["active_refit"].is_null()) << groups["draft"].dump();
}

TEST_F(MultiGroupE2eTest, EachGroupRecoversItsSnapshotAfterARestart) {
  const std::string state = "--state-dir=" + Path("state");
  StartDaemon({state});
  const std::string weights = Fixture(2);
  CommandResult push = Ctl({"push", weights, "--link=draft=" + weights});
  ASSERT_EQ(push.code, 0) << push.out << push.err;
  std::map<std::string, nlohmann::json> before = Groups();
  daemon_->Signal(SIGTERM);
  ASSERT_EQ(daemon_->Wait(absl::Seconds(60)).value_or(-1), 0) << daemon_->Stderr();
  StartDaemon({state});
  std::map<std::string, nlohmann::json> after = Groups();
  for (const char* group : {"target", "draft"}) {
    EXPECT_EQ(after[group]["version"], 2) << group;
    EXPECT_EQ(after[group]["fingerprint"], before[group]["fingerprint"]) << group;
  }
  EXPECT_TRUE(std::filesystem::is_directory(Path("state/groups/draft")));
}

}  // namespace
}  // namespace refit::e2e
