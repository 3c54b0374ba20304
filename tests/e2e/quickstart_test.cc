// The README's Quickstart block, run with bash as a user pastes it: one block,
// no pauses between the lines. Two things differ from a user's shell, both so
// that the test is hermetic: it runs in a temp dir where build/ links to this
// test's build directory (the block calls build/bin/...) and .venv and client/
// link to the source tree's (the Python ends of the block), and the block's
// /tmp/ paths (socket, weights) point into that temp dir. The block runs with
// bash -e, in a process group of its own that is killed at the end, so a step
// that fails does not leave the daemon behind.
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"
#include "tests/testing/temp_dir.h"

namespace refit::e2e {
namespace {

using ::testing::HasSubstr;

// The first fenced block after the "## Quickstart" heading; "" if none.
std::string QuickstartBlock(const std::string& readme) {
  const size_t heading = readme.find("\n## Quickstart\n");
  if (heading == std::string::npos) return "";
  const size_t open = readme.find("\n```\n", heading);
  if (open == std::string::npos) return "";
  const size_t begin = open + 5;
  const size_t close = readme.find("\n```", begin);
  if (close == std::string::npos) return "";
  return readme.substr(begin, close + 1 - begin);
}

// Kills a process group when it goes out of scope.
struct GroupKiller {
  pid_t group = -1;
  ~GroupKiller() {
    if (group > 0) ::kill(-group, SIGKILL);
  }
};

TEST(QuickstartTest, TheReadmeBlockRunsAsPasted) {
  for (const char* bin : {"refitd", "refitctl", "refit_make_fixture"}) {
    if (!std::filesystem::exists(BinPath(bin))) GTEST_SKIP() << BinPath(bin) << " is not built";
  }
  if (!std::filesystem::exists(REFIT_SOURCE_DIR "/.venv/bin/python")) {
    GTEST_SKIP() << "no .venv (scripts/setup.sh makes it): the block runs the Python client";
  }
  const std::string block = QuickstartBlock(ReadFileOrEmpty(REFIT_SOURCE_DIR "/README.md"));
  ASSERT_THAT(block, HasSubstr("refitd")) << "no Quickstart block in README.md";

  char pattern[] = "/tmp/refit_quickstart_XXXXXX";
  ASSERT_NE(::mkdtemp(pattern), nullptr);
  const std::string dir = pattern;
  std::filesystem::create_directory_symlink(BuildDir(), dir + "/build");
  std::filesystem::create_directory_symlink(REFIT_SOURCE_DIR "/.venv", dir + "/.venv");
  std::filesystem::create_directory_symlink(REFIT_SOURCE_DIR "/client", dir + "/client");
  std::ofstream(dir + "/quickstart.sh") << absl::StrReplaceAll(block, {{"/tmp/", dir + "/"}});
  // Runs the block and reports its exit status; whatever it left running is
  // killed with the group afterwards.
  std::ofstream(dir + "/run.sh") << "cd '" << dir << "' || exit 99\n"
                                 << "bash -e ./quickstart.sh\n"
                                 << "echo \"quickstart exit $?\"\n";
  std::unique_ptr<Child> run = Child::Start({"/usr/bin/setsid", "/bin/bash", dir + "/run.sh"},
                                            dir + "/run.out", dir + "/run.err");
  ASSERT_NE(run, nullptr);
  GroupKiller killer{run->pid()};  // setsid without a fork: the group is the child's pid

  const bool finished = run->AwaitStdout("quickstart exit ", absl::Seconds(240));
  const std::string out = run->Stdout();
  ASSERT_TRUE(finished) << "the Quickstart did not finish\nstdout:\n"
                        << out << "\nstderr:\n"
                        << run->Stderr();
  int code = -1;
  const size_t at = out.find("quickstart exit ");
  const std::string rest = out.substr(at + 16);
  ASSERT_TRUE(absl::SimpleAtoi(rest.substr(0, rest.find('\n')), &code)) << out;
  ::kill(-killer.group, SIGKILL);
  killer.group = -1;
  run->Wait(absl::Seconds(60));
  const std::string err = run->Stderr();

  EXPECT_EQ(code, 0) << "stdout:\n" << out << "\nstderr:\n" << err;
  EXPECT_THAT(out, HasSubstr("ready  SERVING"));
  EXPECT_THAT(out, HasSubstr("\"version\": 2"));
  EXPECT_THAT(out, HasSubstr("verify: OK"));
  EXPECT_THAT(out, HasSubstr("over the shm lane: version 2"));
  EXPECT_THAT(err, HasSubstr("attached e-1: version 2"));
  // The daemon was stopped by the block itself, and cleanly.
  EXPECT_THAT(err, HasSubstr("refitd stopped"));
  if (!::testing::Test::HasFailure()) {
    refit::testing::RemoveTree(dir);
  } else {
    std::cerr << "quickstart: files kept in " << dir << "\n";
  }
}

}  // namespace
}  // namespace refit::e2e
