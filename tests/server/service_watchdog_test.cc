// ServiceWatchdog and ProbeListener against real sockets: a listener that
// accepts (and answers or closes) passes, one whose backlog nobody accepts
// from fails; the watchdog pings only while its probe passes.
#include "server/service_watchdog.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"

namespace refit::server {
namespace {

using ::refit::server::testing::MakeTempDir;
using ::testing::HasSubstr;

// A listening Unix socket at `path`; accepts (and then closes each
// connection at once) only when `accepting`.
class UnixListener {
 public:
  UnixListener(const std::string& path, bool accepting) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    EXPECT_EQ(::listen(fd_, 16), 0);
    if (accepting) {
      thread_ = std::thread([this] {
        for (;;) {
          const int c = ::accept(fd_, nullptr, nullptr);
          if (c < 0) return;  // shut down
          ::close(c);
        }
      });
    }
  }
  ~UnixListener() {
    ::shutdown(fd_, SHUT_RDWR);
    if (thread_.joinable()) thread_.join();
    ::close(fd_);
  }

 private:
  int fd_ = -1;
  std::thread thread_;
};

// A TCP listener on 127.0.0.1 that never accepts; its port.
int TcpListenerThatNeverAccepts(int* port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  EXPECT_EQ(::listen(fd, 16), 0);
  socklen_t length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  *port = ntohs(address.sin_port);
  return fd;
}

TEST(ProbeListenerTest, AListenerThatAcceptsPassesOneThatDoesNotFails) {
  const std::string dir = MakeTempDir();
  const absl::Time soon = absl::Now() + absl::Seconds(5);
  {
    UnixListener accepting(dir + "/a.sock", /*accepting=*/true);
    EXPECT_TRUE(ProbeListener(absl::StrCat("unix:", dir, "/a.sock"), soon).ok());
    EXPECT_TRUE(ProbeListener(absl::StrCat("unix://", dir, "/a.sock"), soon).ok());
  }
  UnixListener stuck(dir + "/s.sock", /*accepting=*/false);
  const absl::Time start = absl::Now();
  const absl::Status status =
      ProbeListener(absl::StrCat("unix:", dir, "/s.sock"), start + absl::Milliseconds(300));
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("the connection was not accepted"));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));  // it waited for an answer
  int port = 0;
  const int tcp = TcpListenerThatNeverAccepts(&port);
  const absl::Status on_tcp =
      ProbeListener(absl::StrCat("0.0.0.0:", port), absl::Now() + absl::Milliseconds(200));
  EXPECT_THAT(on_tcp.message(), HasSubstr("the connection was not accepted"));
  ::close(tcp);
  const absl::Status refused = ProbeListener(absl::StrCat("127.0.0.1:", port), soon);
  EXPECT_TRUE(absl::IsUnavailable(refused)) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("connect"));
  EXPECT_TRUE(absl::IsUnavailable(ProbeListener(absl::StrCat("unix:", dir, "/none.sock"), soon)));
  EXPECT_TRUE(absl::IsInvalidArgument(ProbeListener("no-port", soon)));
  EXPECT_TRUE(absl::IsInvalidArgument(ProbeListener("unix:", soon)));
}

TEST(ServiceWatchdogTest, PingsOnlyWhileItsProbePasses) {
  std::atomic<bool> alive{true};
  absl::Mutex mu;
  std::vector<std::string> sent;
  auto count = [&] {
    absl::MutexLock lock(&mu);
    return sent.size();
  };
  ServiceWatchdog watchdog(
      absl::Milliseconds(60),
      [&](absl::Time) {
        return alive.load() ? absl::OkStatus() : absl::UnavailableError("listener x: stuck");
      },
      [&](absl::string_view state) {
        absl::MutexLock lock(&mu);
        sent.emplace_back(state);
      });
  watchdog.Start();
  absl::SleepFor(absl::Milliseconds(300));  // a ping every 20 ms
  EXPECT_GE(count(), 3u);
  alive.store(false);
  absl::SleepFor(absl::Milliseconds(60));  // the round in flight may still ping
  const size_t before = count();
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(count(), before);
  alive.store(true);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_GE(count(), before + 3);
  watchdog.Stop();
  const size_t stopped = count();
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(count(), stopped);
  absl::MutexLock lock(&mu);
  for (const std::string& s : sent) EXPECT_EQ(s, "WATCHDOG=1");
}

TEST(ServiceWatchdogTest, TheTimeoutComesFromTheEnvironmentForThisProcessOnly) {
  ::unsetenv("WATCHDOG_PID");
  ::unsetenv("WATCHDOG_USEC");
  EXPECT_FALSE(WatchdogTimeoutFromEnvironment().has_value());
  ::setenv("WATCHDOG_USEC", "30000000", 1);
  EXPECT_EQ(WatchdogTimeoutFromEnvironment(), absl::Seconds(30));
  ::setenv("WATCHDOG_PID", absl::StrCat(::getpid()).c_str(), 1);
  EXPECT_EQ(WatchdogTimeoutFromEnvironment(), absl::Seconds(30));
  ::setenv("WATCHDOG_PID", absl::StrCat(::getpid() + 1).c_str(), 1);
  EXPECT_FALSE(WatchdogTimeoutFromEnvironment().has_value());  // meant for another process
  ::unsetenv("WATCHDOG_PID");
  for (const char* bad : {"0", "-5", "soon", ""}) {
    ::setenv("WATCHDOG_USEC", bad, 1);
    EXPECT_FALSE(WatchdogTimeoutFromEnvironment().has_value()) << bad;
  }
  ::unsetenv("WATCHDOG_USEC");
}

}  // namespace
}  // namespace refit::server
