// End-to-end: a mixture-of-experts demo model (Qwen3-MoE, Mixtral) in a real
// refitd, refitted over Push and Reload by the real refitctl, which then
// verifies every kernel byte for byte (expert-parallel and tensor-parallel
// ranks). See tests/e2e/e2e_util.h for the ground rules.
#include <stdlib.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/refit_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/daemon_dir_test.h"
#include "tests/e2e/e2e_util.h"

namespace refit::e2e {
namespace {

using ::testing::HasSubstr;

class MoeE2eTest : public DaemonDirTest {
 protected:
  MoeE2eTest() : DaemonDirTest("refit_moe_e2e", {"--timeout=30s"}, absl::Seconds(90)) {}

  void StartDaemon(const std::vector<std::string>& flags) {
    std::vector<std::string> argv = {BinPath("refitd"), "--listen=" + socket_,
                                     "--reload-root=" + dir_};
    argv.insert(argv.end(), flags.begin(), flags.end());
    daemon_ = Child::Start(argv, Path("refitd.out"), Path("refitd.err"));
    ASSERT_NE(daemon_, nullptr);
    const bool ready = daemon_->AwaitStderr("ready");
    ASSERT_TRUE(ready && daemon_->running()) << "refitd did not start:\n" << daemon_->Stderr();
  }

  nlohmann::json Status() {
    CommandResult r = Ctl({"status", "--json"});
    EXPECT_EQ(r.code, 0) << r.err;
    return nlohmann::json::parse(r.out, nullptr, false);
  }

  // The demo MoE fixture with `seed` (what `--model demo:ARCH` serves at seed 0).
  std::string Fixture(const std::string& arch, int seed) {
    const std::string out = Path(absl::StrCat(arch, "-", seed));
    CommandResult r = Run({BinPath("refit_make_fixture"), "--out=" + out, "--arch=" + arch,
                           absl::StrCat("--seed=", seed)});
    EXPECT_EQ(r.code, 0) << r.err;
    return out;
  }

  // Push, verify, Reload, verify; other weights mismatch.
  void RefitAndVerify(const std::string& arch) {
    const uint64_t v0 = Status()["version"];
    const std::string pushed = Fixture(arch, 2);
    CommandResult push = Ctl({"push", pushed});
    ASSERT_EQ(push.code, 0) << push.err;
    EXPECT_EQ(Status()["version"], v0 + 1);
    CommandResult verify = Ctl({"verify", pushed});
    EXPECT_EQ(verify.code, 0) << verify.out << verify.err;
    EXPECT_THAT(verify.out, HasSubstr("verify: OK"));
    EXPECT_THAT(verify.out, HasSubstr("0 mismatch"));

    const std::string reloaded = Fixture(arch, 3);
    CommandResult reload = Ctl({"reload", "--from", reloaded});
    ASSERT_EQ(reload.code, 0) << reload.err;
    EXPECT_EQ(Status()["version"], v0 + 2);
    CommandResult again = Ctl({"verify", reloaded});
    EXPECT_EQ(again.code, 0) << again.out << again.err;
    EXPECT_THAT(again.out, HasSubstr("0 mismatch"));

    CommandResult other = Ctl({"verify", pushed});
    EXPECT_EQ(other.code, 6) << other.out << other.err;
  }
};

TEST_F(MoeE2eTest, Qwen3MoeTensorParallelRankRefitsOverPushAndReloadAndVerifies) {
  StartDaemon({"--model=" + Fixture("qwen3_moe", 1), "--tp-size=2", "--tp-rank=1"});
  client::ClientOptions options;
  options.address = socket_;
  options.timeout = absl::Seconds(30);
  auto c = client::RefitClient::Create(options);
  ASSERT_TRUE(c.ok()) << c.status();
  auto status = (*c)->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->model().architecture(), "Qwen3MoeForCausalLM");
  EXPECT_EQ(status->model().num_experts(), 8u);
  EXPECT_EQ(status->model().experts_per_token(), 2u);
  EXPECT_EQ(status->model().ep_rank(), 0u);
  EXPECT_EQ(status->model().ep_size(), 1u);
  RefitAndVerify("qwen3_moe");
}

TEST_F(MoeE2eTest, MixtralBlockScalesRefitOverPushAndReloadAndVerify) {
  StartDaemon({"--model=" + Fixture("mixtral", 1), "--quant=block"});
  RefitAndVerify("mixtral");
}

// --ep and the MoE demo models.
TEST_F(MoeE2eTest, ExpertParallelDemoRankRefitsAndVerifies) {
  StartDaemon({"--model=demo:qwen3_moe", "--ep=2", "--ep-rank=1"});
  client::ClientOptions options;
  options.address = socket_;
  options.timeout = absl::Seconds(30);
  auto c = client::RefitClient::Create(options);
  ASSERT_TRUE(c.ok()) << c.status();
  auto status = (*c)->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->model().ep_rank(), 1u);
  EXPECT_EQ(status->model().ep_size(), 2u);
  // refitctl shows them too.
  nlohmann::json j = Status();
  EXPECT_EQ(j["model"]["num_experts"], status->model().num_experts());
  EXPECT_EQ(j["model"]["ep_rank"], 1);
  EXPECT_EQ(j["model"]["ep_size"], 2);
  CommandResult text = Ctl({"status"});
  EXPECT_EQ(text.code, 0) << text.err;
  EXPECT_THAT(text.out, HasSubstr(absl::StrCat("experts      ", status->model().num_experts(),
                                               " per layer, ")));
  EXPECT_THAT(text.out, HasSubstr("ep 1/2"));
  RefitAndVerify("qwen3_moe");
}

TEST_F(MoeE2eTest, ExpertsNotDivisibleByEpStopTheStartNamingTheNumbers) {
  CommandResult r =
      Run({BinPath("refitd"), "--listen=" + socket_, "--model=demo:mixtral", "--ep=3"});
  EXPECT_NE(r.code, 0);
  EXPECT_THAT(r.err, HasSubstr("num_experts 8 is not divisible by ep_size 3"));
}

}  // namespace
}  // namespace refit::e2e
