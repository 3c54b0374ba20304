// Helpers of the end-to-end tests: real refitd / refitctl / helper processes
// in a temp dir, on a Unix socket (or on 127.0.0.1:0, the port the daemon
// chose read back from its log, where TLS or metrics need TCP). Tests wait on
// conditions (health, status, output lines), bounded by generous limits that
// only matter when something hangs; nothing asserts on time. Every child is
// SIGKILLed in its destructor if still running.
#ifndef REFIT_TESTS_E2E_E2E_UTIL_H_
#define REFIT_TESTS_E2E_E2E_UTIL_H_

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace refit::e2e {

inline std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// build/ of this test: $REFIT_BUILD_DIR (ctest sets it) or the parent of
// the test binary's directory (build/tests/..).
inline std::string BuildDir() {
  if (const char* dir = std::getenv("REFIT_BUILD_DIR"); dir != nullptr && *dir != '\0') return dir;
  return std::filesystem::canonical("/proc/self/exe").parent_path().parent_path().string();
}
inline std::string BinPath(const std::string& name) { return BuildDir() + "/bin/" + name; }
inline std::string TestBinPath(const std::string& name) { return BuildDir() + "/tests/" + name; }

// Polls `condition` every 20 ms until it holds or `limit` passes.
inline bool WaitFor(const std::function<bool()>& condition,
                    absl::Duration limit = absl::Seconds(60)) {
  const absl::Time deadline = absl::Now() + limit;
  while (!condition()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

// A child process with stdout and stderr in files, and optionally a pipe to
// its stdin.
class Child {
 public:
  static std::unique_ptr<Child> Start(const std::vector<std::string>& argv,
                                      const std::string& stdout_path,
                                      const std::string& stderr_path, bool stdin_pipe = false) {
    std::unique_ptr<Child> child(new Child());
    child->stdout_path_ = stdout_path;
    child->stderr_path_ = stderr_path;
    int pipe_fds[2] = {-1, -1};
    if (stdin_pipe && ::pipe(pipe_fds) != 0) return nullptr;
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    pid_t pid = ::fork();
    if (pid == 0) {
      int out = ::open(stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      int err = ::open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(out, 1);
      ::dup2(err, 2);
      if (stdin_pipe) {
        ::dup2(pipe_fds[0], 0);
        ::close(pipe_fds[1]);
      } else {
        int null = ::open("/dev/null", O_RDONLY);
        ::dup2(null, 0);
      }
      ::execv(args[0], args.data());
      _exit(127);
    }
    if (stdin_pipe) {
      ::close(pipe_fds[0]);
      child->stdin_fd_ = pipe_fds[1];
    }
    child->pid_ = pid;
    return child;
  }

  ~Child() {
    if (stdin_fd_ >= 0) ::close(stdin_fd_);
    if (running()) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  pid_t pid() const { return pid_; }
  bool running() {
    if (exited_) return false;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      status_ = status;
    }
    return !exited_;
  }
  void Signal(int signal) { ::kill(pid_, signal); }
  void WriteStdin(const std::string& text) {
    if (stdin_fd_ >= 0) (void)!::write(stdin_fd_, text.data(), text.size());
  }
  // The exit code once it exited normally within `limit`; nullopt if it is
  // still running or died of a signal.
  std::optional<int> Wait(absl::Duration limit = absl::Seconds(60)) {
    WaitFor([this] { return !running(); }, limit);
    if (!exited_ || !WIFEXITED(status_)) return std::nullopt;
    return WEXITSTATUS(status_);
  }
  bool KilledBySignal(int signal) const {
    return exited_ && WIFSIGNALED(status_) && WTERMSIG(status_) == signal;
  }
  std::string Stdout() const { return ReadFileOrEmpty(stdout_path_); }
  std::string Stderr() const { return ReadFileOrEmpty(stderr_path_); }

 private:
  Child() = default;
  pid_t pid_ = -1;
  int stdin_fd_ = -1;
  bool exited_ = false;
  int status_ = 0;
  std::string stdout_path_;
  std::string stderr_path_;
};

struct CommandResult {
  int code = -1;  // -1: did not exit normally within the limit
  std::string out;
  std::string err;
};

}  // namespace refit::e2e

#endif  // REFIT_TESTS_E2E_E2E_UTIL_H_
