// Helpers of the end-to-end tests: real refitd / refitctl / helper processes
// in a temp dir, on a Unix socket (or on 127.0.0.1:0, the port the daemon
// chose read back from its log, where TLS or metrics need TCP). Tests wait on
// events (a child's output line or exit, a Watch event, a health Watch),
// bounded by generous limits that only matter when something hangs; nothing
// sleeps and nothing asserts on time. Every child is SIGKILLed
// in its destructor if still running.
#ifndef REFIT_TESTS_E2E_E2E_UTIL_H_
#define REFIT_TESTS_E2E_E2E_UTIL_H_

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "refit/v1/refit.grpc.pb.h"

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

// A child process. A thread of the test reads its stdout and stderr as they
// are written (copying them to files, kept when a test fails), so tests wait
// for an output line or for the exit as events, not by polling. The child
// counts as exited once it has been reaped and its output has ended (every
// writer of its pipes is gone), so output read after Wait() is complete.
//
// Thread-safe, except that WriteStdin is for one thread.
class Child {
 public:
  using OutputCondition = std::function<bool(const std::string& out, const std::string& err)>;

  static std::unique_ptr<Child> Start(const std::vector<std::string>& argv,
                                      const std::string& stdout_path,
                                      const std::string& stderr_path, bool stdin_pipe = false) {
    std::unique_ptr<Child> child(new Child());
    // Close-on-exec, so that no other child inherits these pipes and keeps
    // them open past this child's exit.
    int out_fds[2] = {-1, -1}, err_fds[2] = {-1, -1}, in_fds[2] = {-1, -1};
    if (::pipe2(out_fds, O_CLOEXEC) != 0 || ::pipe2(err_fds, O_CLOEXEC) != 0 ||
        (stdin_pipe && ::pipe2(in_fds, O_CLOEXEC) != 0)) {
      return nullptr;
    }
    child->out_file_ = ::open(stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    child->err_file_ = ::open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    pid_t pid = ::fork();
    if (pid == 0) {
      ::dup2(out_fds[1], 1);
      ::dup2(err_fds[1], 2);
      if (stdin_pipe) {
        ::dup2(in_fds[0], 0);
      } else {
        int null = ::open("/dev/null", O_RDONLY);
        ::dup2(null, 0);
      }
      ::execv(args[0], args.data());
      _exit(127);
    }
    ::close(out_fds[1]);
    ::close(err_fds[1]);
    if (pid < 0) {
      ::close(out_fds[0]);
      ::close(err_fds[0]);
      if (stdin_pipe) {
        ::close(in_fds[0]);
        ::close(in_fds[1]);
      }
      return nullptr;
    }
    if (stdin_pipe) {
      ::close(in_fds[0]);
      child->stdin_fd_ = in_fds[1];
    }
    child->pid_ = pid;
    const int out_read = out_fds[0], err_read = err_fds[0];
    child->reader_ =
        std::thread([self = child.get(), out_read, err_read] { self->Drain(out_read, err_read); });
    return child;
  }

  ~Child() {
    if (stdin_fd_ >= 0) ::close(stdin_fd_);
    if (running()) ::kill(pid_, SIGKILL);
    if (reader_.joinable()) reader_.join();
    if (out_file_ >= 0) ::close(out_file_);
    if (err_file_ >= 0) ::close(err_file_);
  }

  pid_t pid() const { return pid_; }
  bool running() const {
    absl::MutexLock lock(&mu_);
    return !exited_;
  }
  void Signal(int signal) {
    if (running()) ::kill(pid_, signal);
  }
  void WriteStdin(const std::string& text) {
    if (stdin_fd_ >= 0) (void)!::write(stdin_fd_, text.data(), text.size());
  }
  // The exit code once it exited normally within `limit`; nullopt if it is
  // still running or died of a signal.
  std::optional<int> Wait(absl::Duration limit = absl::Seconds(60)) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&exited_), limit);
    if (!exited_ || !WIFEXITED(status_)) return std::nullopt;
    return WEXITSTATUS(status_);
  }
  bool KilledBySignal(int signal) const {
    absl::MutexLock lock(&mu_);
    return exited_ && WIFSIGNALED(status_) && WTERMSIG(status_) == signal;
  }
  std::string Stdout() const {
    absl::MutexLock lock(&mu_);
    return out_;
  }
  std::string Stderr() const {
    absl::MutexLock lock(&mu_);
    return err_;
  }

  // Blocks until `condition` holds on the output so far, the child has
  // exited, or `limit` passes; returns whether `condition` holds. It runs
  // under the child's lock: it must only look at its arguments.
  bool AwaitOutput(const OutputCondition& condition, absl::Duration limit = absl::Seconds(60)) {
    struct Done {
      const Child* child;
      const OutputCondition* condition;
      bool operator()() const ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return child->exited_ || (*condition)(child->out_, child->err_);
      }
    } done{this, &condition};
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&done), limit);
    return condition(out_, err_);
  }
  bool AwaitStdout(const std::string& text, absl::Duration limit = absl::Seconds(60)) {
    return AwaitOutput(
        [&](const std::string& out, const std::string&) { return absl::StrContains(out, text); },
        limit);
  }
  bool AwaitStderr(const std::string& text, absl::Duration limit = absl::Seconds(60)) {
    return AwaitOutput(
        [&](const std::string&, const std::string& err) { return absl::StrContains(err, text); },
        limit);
  }

 private:
  Child() = default;

  // The reader thread: copies both pipes until they end, then reaps the child.
  void Drain(int out_fd, int err_fd) {
    pollfd fds[2] = {{out_fd, POLLIN, 0}, {err_fd, POLLIN, 0}};
    int open = 2;
    char buffer[8192];
    while (open > 0) {
      if (::poll(fds, 2, -1) < 0) {
        if (errno == EINTR) continue;
        break;
      }
      for (int i = 0; i < 2; ++i) {
        if (fds[i].fd < 0 || fds[i].revents == 0) continue;
        ssize_t n = ::read(fds[i].fd, buffer, sizeof(buffer));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          ::close(fds[i].fd);
          fds[i].fd = -1;
          --open;
          continue;
        }
        const int file = i == 0 ? out_file_ : err_file_;
        if (file >= 0) (void)!::write(file, buffer, static_cast<size_t>(n));
        absl::MutexLock lock(&mu_);
        (i == 0 ? out_ : err_).append(buffer, static_cast<size_t>(n));
      }
    }
    for (pollfd& fd : fds) {
      if (fd.fd >= 0) ::close(fd.fd);
    }
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    absl::MutexLock lock(&mu_);
    status_ = status;
    exited_ = true;
  }

  pid_t pid_ = -1;
  int stdin_fd_ = -1;
  int out_file_ = -1;
  int err_file_ = -1;
  std::thread reader_;
  mutable absl::Mutex mu_;
  bool exited_ ABSL_GUARDED_BY(mu_) = false;
  int status_ ABSL_GUARDED_BY(mu_) = 0;
  std::string out_ ABSL_GUARDED_BY(mu_);
  std::string err_ ABSL_GUARDED_BY(mu_);
};

// A Watch stream on refitd, opened before the action it observes: Next
// blocks for the next event of a type. A thread reads the stream all along,
// as a real watcher does (a client that stopped reading would hold up the
// daemon's shutdown until --shutdown-timeout). The stream has a deadline, so
// an event that never comes fails the wait instead of hanging the test.
class WatchStream {
 public:
  // nullptr if the stream does not deliver its snapshot.
  static std::unique_ptr<WatchStream> Open(const std::string& address,
                                           const std::string& token = "",
                                           absl::Duration limit = absl::Seconds(120)) {
    std::unique_ptr<WatchStream> stream(new WatchStream());
    stream->stub_ = refit::v1::RefitService::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    if (!token.empty()) stream->context_.AddMetadata("authorization", "Bearer " + token);
    stream->context_.set_deadline(absl::ToChronoTime(absl::Now() + limit));
    stream->reader_ = stream->stub_->Watch(&stream->context_, refit::v1::WatchRequest());
    if (!stream->reader_->Read(&stream->snapshot_) ||
        stream->snapshot_.type() != refit::v1::WatchEvent::TYPE_SNAPSHOT) {
      stream->context_.TryCancel();
      refit::v1::WatchEvent ignored;
      while (stream->reader_->Read(&ignored)) {
      }
      stream->reader_->Finish().IgnoreError();
      return nullptr;
    }
    stream->thread_ = std::thread([self = stream.get()] { self->ReadAll(); });
    return stream;
  }

  ~WatchStream() {
    context_.TryCancel();
    thread_.join();
  }

  const refit::v1::WatchEvent& snapshot() const { return snapshot_; }

  // The next event of `type` (earlier ones of other types are skipped);
  // nullopt if the stream ends first.
  std::optional<refit::v1::WatchEvent> Next(refit::v1::WatchEvent::Type type) {
    absl::MutexLock lock(&mu_);
    for (;;) {
      mu_.Await(absl::Condition(this, &WatchStream::HasEventOrEnded));
      if (events_.empty()) return std::nullopt;
      refit::v1::WatchEvent event = std::move(events_.front());
      events_.pop_front();
      if (event.type() == type) return event;
    }
  }

 private:
  WatchStream() = default;

  void ReadAll() {
    refit::v1::WatchEvent event;
    while (reader_->Read(&event)) {
      absl::MutexLock lock(&mu_);
      events_.push_back(event);
    }
    reader_->Finish().IgnoreError();
    absl::MutexLock lock(&mu_);
    ended_ = true;
  }
  bool HasEventOrEnded() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ended_ || !events_.empty();
  }

  std::unique_ptr<refit::v1::RefitService::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<refit::v1::WatchEvent>> reader_;
  refit::v1::WatchEvent snapshot_;
  std::thread thread_;
  absl::Mutex mu_;
  std::deque<refit::v1::WatchEvent> events_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

struct CommandResult {
  int code = -1;  // -1: did not exit normally within the limit
  std::string out;
  std::string err;
};

}  // namespace refit::e2e

#endif  // REFIT_TESTS_E2E_E2E_UTIL_H_
