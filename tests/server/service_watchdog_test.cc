// ServiceWatchdog and ProbeListener against real sockets: a listener that
// accepts (and answers or closes) passes, one whose backlog nobody accepts
// from fails, and the probe greets it as an HTTP/2 or a TLS client would;
// the watchdog pings only while its probe passes.
#include "server/service_watchdog.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"

namespace refit::server {
namespace {

using ::refit::server::testing::MakeTempDir;
using ::refit::server::testing::NoFreeDescriptors;
using ::testing::HasSubstr;

// A listening Unix socket at `path`; accepts (and then closes each
// connection at once) only when `accepting`. With `answering` it first reads
// what the client sent (received() keeps the first connection's) and
// answers one byte.
class UnixListener {
 public:
  UnixListener(const std::string& path, bool accepting, bool answering = false) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    EXPECT_EQ(::listen(fd_, 16), 0);
    if (accepting) {
      thread_ = std::thread([this, answering] {
        for (;;) {
          const int c = ::accept(fd_, nullptr, nullptr);
          if (c < 0) return;  // shut down
          if (answering) {
            pollfd p{c, POLLIN, 0};
            char buffer[4096];
            const ssize_t n = ::poll(&p, 1, 2000) == 1 ? ::recv(c, buffer, sizeof(buffer), 0) : 0;
            {
              absl::MutexLock lock(&mu_);
              if (received_.empty() && n > 0) received_.assign(buffer, static_cast<size_t>(n));
            }
            ::send(c, "x", 1, MSG_NOSIGNAL);
          }
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

  std::string received() {
    absl::MutexLock lock(&mu_);
    return received_;
  }

 private:
  int fd_ = -1;
  absl::Mutex mu_;
  std::string received_ ABSL_GUARDED_BY(mu_);
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

// A TCP listener on 127.0.0.1 that accepts, answers one byte and closes;
// its port.
class TcpAnsweringListener {
 public:
  TcpAnsweringListener() {
    fd_ = TcpListenerThatNeverAccepts(&port_);
    thread_ = std::thread([this] {
      for (;;) {
        const int c = ::accept(fd_, nullptr, nullptr);
        if (c < 0) return;  // shut down
        ::send(c, "x", 1, MSG_NOSIGNAL);
        ::close(c);
      }
    });
  }
  ~TcpAnsweringListener() {
    ::shutdown(fd_, SHUT_RDWR);
    thread_.join();
    ::close(fd_);
  }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::thread thread_;
};

TEST(ProbeListenerTest, AnIpv6WildcardListenerIsAlsoProbedOverIpv4) {
  // Nothing listens on [::1]:port (refused, or no IPv6 loopback at all), so
  // the probe of "[::]:port" must go on to 127.0.0.1, which a dual-stack
  // wildcard listener also serves.
  TcpAnsweringListener v4;
  const absl::Time soon = absl::Now() + absl::Seconds(5);
  EXPECT_TRUE(ProbeListener(absl::StrCat("[::]:", v4.port()), soon).ok());
  EXPECT_TRUE(ProbeListener(absl::StrCat("0.0.0.0:", v4.port()), soon).ok());
  // A listener reached and silent is the verdict: no other address is tried.
  int port = 0;
  const int stuck = TcpListenerThatNeverAccepts(&port);
  const absl::Status status =
      ProbeListener(absl::StrCat("[::]:", port), absl::Now() + absl::Milliseconds(300));
  EXPECT_THAT(status.message(), HasSubstr("the connection was not accepted"));
  ::close(stuck);
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

TEST(ProbeListenerTest, GreetsAPlaintextListenerWithHttp2AndATlsOneWithAClientHello) {
  const std::string dir = MakeTempDir();
  const absl::Time soon = absl::Now() + absl::Seconds(5);
  {
    UnixListener plain(dir + "/p.sock", /*accepting=*/true, /*answering=*/true);
    ASSERT_TRUE(ProbeListener(absl::StrCat("unix:", dir, "/p.sock"), soon).ok());
    EXPECT_EQ(plain.received().substr(0, 24), "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
  }
  UnixListener tls(dir + "/t.sock", /*accepting=*/true, /*answering=*/true);
  ASSERT_TRUE(ProbeListener(absl::StrCat("unix:", dir, "/t.sock"), soon, /*tls=*/true).ok());
  const std::string hello = tls.received();
  // A TLS record (handshake, 22) whose first message is a ClientHello (1),
  // offering ALPN "h2" as a gRPC client does.
  ASSERT_GE(hello.size(), 6u);
  EXPECT_EQ(hello[0], '\x16');
  EXPECT_EQ(hello[1], '\x03');
  EXPECT_EQ(hello[5], '\x01');
  const size_t record = (static_cast<uint8_t>(hello[3]) << 8) | static_cast<uint8_t>(hello[4]);
  EXPECT_EQ(hello.size(), record + 5) << "one whole record";
  EXPECT_THAT(hello, HasSubstr(std::string("\x02h2", 3)));
  // A TLS listener that no longer accepts fails like a plaintext one.
  UnixListener stuck(dir + "/s.sock", /*accepting=*/false);
  const absl::Status status = ProbeListener(absl::StrCat("unix:", dir, "/s.sock"),
                                            absl::Now() + absl::Milliseconds(300), /*tls=*/true);
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("the connection was not accepted"));
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

TEST(ServiceWatchdogTest, LogsEachReasonOfAFailureOnceUntilEveryListenerAnswersAgain) {
  // The probe's answers, round by round; then it passes for good. Two
  // listeners failing in turn alternate reasons: each is logged once.
  const std::vector<std::string> reasons = {"listener x: stuck",
                                            "listener x: stuck",
                                            "listener x: socket: Too many open files",
                                            "listener x: socket: Too many open files",
                                            "listener x: stuck",
                                            "listener x: socket: Too many open files",
                                            "listener x: stuck",
                                            "",
                                            "listener x: stuck"};
  std::atomic<size_t> round{0};
  std::atomic<int> pings{0};
  ::testing::internal::CaptureStderr();
  {
    ServiceWatchdog watchdog(
        absl::Milliseconds(30),
        [&](absl::Time) {
          const size_t r = round.fetch_add(1);
          return r < reasons.size() && !reasons[r].empty() ? absl::UnavailableError(reasons[r])
                                                           : absl::OkStatus();
        },
        [&](absl::string_view) { pings.fetch_add(1); });
    watchdog.Start();
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    while (round.load() < reasons.size() + 2 && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  std::vector<std::string> errors;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StrContains(line, "ERROR watchdog: ")) errors.emplace_back(line);
  }
  ASSERT_EQ(errors.size(), 3u) << log;
  EXPECT_THAT(errors[0], HasSubstr("listener x: stuck; not pinging"));
  EXPECT_THAT(errors[1], HasSubstr("Too many open files; not pinging"));
  EXPECT_THAT(errors[2], HasSubstr("listener x: stuck; not pinging"));  // after a pass
  EXPECT_THAT(log, HasSubstr("every listener answers again"));
  EXPECT_GE(pings.load(), 1);
}

// A process out of descriptors still probes: the watchdog keeps one for its
// probe (refitd's listeners close what they have no room for, so they still
// answer a probe then).
TEST(ServiceWatchdogTest, AProcessOutOfDescriptorsStillProbesWithTheDescriptorItKept) {
  if (testing::kUnderSanitizer) {
    GTEST_SKIP() << "leaves the process no descriptor (see kUnderSanitizer)";
  }
  std::atomic<int> opened{0}, refused{0}, pings{0};
  ServiceWatchdog watchdog(
      absl::Milliseconds(60),
      [&](absl::Time) {
        const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
          refused.fetch_add(1);
          return absl::UnavailableError("socket: no descriptor");
        }
        ::close(fd);
        opened.fetch_add(1);
        return absl::OkStatus();
      },
      [&](absl::string_view) { pings.fetch_add(1); });
  watchdog.Start();
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (pings.load() < 1 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_GE(pings.load(), 1);
  int pinged = 0, outside = 0;
  {
    NoFreeDescriptors none;
    ASSERT_TRUE(none.ok());
    outside = ::dup(0);  // this process has none
    const int before = pings.load();
    while (pings.load() < before + 4 && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    pinged = pings.load() - before;
  }
  watchdog.Stop();
  EXPECT_LT(outside, 0);
  EXPECT_GE(pinged, 4) << refused.load() << " probes found no descriptor";
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
