// A fixture for end-to-end tests that drive one refitd and the command-line
// tools as child processes, all inside a temporary directory of the test's
// own (kept for inspection when the test fails). Skips when the binaries are
// not built.
#ifndef REFIT_TESTS_E2E_DAEMON_DIR_TEST_H_
#define REFIT_TESTS_E2E_DAEMON_DIR_TEST_H_

#include <stdlib.h>

#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"
#include "tests/testing/temp_dir.h"

namespace refit::e2e {

class DaemonDirTest : public ::testing::Test {
 protected:
  // `prefix` names the directory (/tmp/PREFIX_XXXXXX); `ctl_flags` go to
  // every refitctl command before its own arguments; `command_limit` bounds
  // each child command.
  DaemonDirTest(std::string prefix, std::vector<std::string> ctl_flags,
                absl::Duration command_limit)
      : prefix_(std::move(prefix)),
        ctl_flags_(std::move(ctl_flags)),
        command_limit_(command_limit) {}

  void SetUp() override {
    for (const char* bin : {"refitd", "refitctl", "refit_make_fixture"}) {
      if (!std::filesystem::exists(BinPath(bin))) {
        GTEST_SKIP() << BinPath(bin) << " is not built";
      }
    }
    std::string pattern = "/tmp/" + prefix_ + "_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    socket_ = "unix:" + dir_ + "/refitd.sock";
  }

  void TearDown() override {
    daemon_.reset();
    if (!dir_.empty() && !HasFailure()) refit::testing::RemoveTree(dir_);
    if (HasFailure()) std::cerr << "e2e: files kept in " << dir_ << "\n";
  }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  // Runs `argv` to completion, its output in numbered files of the directory.
  CommandResult Run(const std::vector<std::string>& argv) {
    ++commands_;
    auto child = Child::Start(argv, Path(absl::StrCat("cmd-", commands_, ".out")),
                              Path(absl::StrCat("cmd-", commands_, ".err")));
    CommandResult r;
    r.code = child->Wait(command_limit_).value_or(-1);
    r.out = child->Stdout();
    r.err = child->Stderr();
    return r;
  }

  // refitctl against the test's daemon.
  CommandResult Ctl(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {BinPath("refitctl"), "--addr=" + socket_};
    argv.insert(argv.end(), ctl_flags_.begin(), ctl_flags_.end());
    argv.insert(argv.end(), args.begin(), args.end());
    return Run(argv);
  }

  std::string dir_;
  std::string socket_;
  std::unique_ptr<Child> daemon_;

 private:
  const std::string prefix_;
  const std::vector<std::string> ctl_flags_;
  const absl::Duration command_limit_;
  int commands_ = 0;
};

}  // namespace refit::e2e

#endif  // REFIT_TESTS_E2E_DAEMON_DIR_TEST_H_
