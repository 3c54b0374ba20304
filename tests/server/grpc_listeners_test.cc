// refitd's own listening sockets (server/grpc_listeners.h), with an acceptor
// that records what it is handed in place of gRPC's; real sockets on
// loopback and in a temporary directory.
#include "server/grpc_listeners.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/server_builder.h>

#include "absl/strings/numbers.h"
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

class RecordingAcceptor : public grpc::experimental::ExternalConnectionAcceptor {
 public:
  ~RecordingAcceptor() override {
    for (int fd : fds_) ::close(fd);
  }
  void HandleNewConnection(NewConnectionParameters* p) override {
    absl::MutexLock lock(&mu_);
    fds_.push_back(p->fd);
    listener_fds_.push_back(p->listener_fd);
  }
  // Waits until `n` connections arrived (false after 10 s).
  bool AwaitCount(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&] { return fds_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(10));
  }
  std::vector<int> fds() {
    absl::MutexLock lock(&mu_);
    return fds_;
  }
  std::vector<int> listener_fds() {
    absl::MutexLock lock(&mu_);
    return listener_fds_;
  }
  void CloseAll() {
    absl::MutexLock lock(&mu_);
    for (int fd : fds_) ::close(fd);
    fds_.clear();
    listener_fds_.clear();
  }

 private:
  absl::Mutex mu_;
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
  std::vector<int> listener_fds_ ABSL_GUARDED_BY(mu_);
};

// Starts `listeners` with a recording acceptor, which it owns.
RecordingAcceptor* StartRecording(GrpcListeners& listeners) {
  auto acceptor = std::make_unique<RecordingAcceptor>();
  RecordingAcceptor* raw = acceptor.get();
  listeners.Start(std::move(acceptor));
  return raw;
}

int ConnectUnix(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

int ConnectTcp(int family, int port) {
  sockaddr_storage ss{};
  socklen_t len;
  if (family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    a->sin6_family = AF_INET6;
    a->sin6_addr = in6addr_loopback;
    a->sin6_port = htons(port);
    len = sizeof(*a);
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a->sin_port = htons(port);
    len = sizeof(*a);
  }
  const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&ss), len) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Whether this host can listen on ::1 (containers without IPv6 cannot).
bool HasIpv6Loopback() {
  const int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

bool ResolvesToIpv6(const char* host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host, nullptr, &hints, &found) != 0) return false;
  bool v6 = false;
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) v6 |= ai->ai_family == AF_INET6;
  ::freeaddrinfo(found);
  return v6;
}

int PortOf(const std::string& bound) {
  int port = 0;
  EXPECT_TRUE(absl::SimpleAtoi(bound.substr(bound.rfind(':') + 1), &port)) << bound;
  return port;
}

TEST(GrpcListenersTest, EachConnectionGoesToTheAcceptorNonBlockingAndCloseOnExec) {
  const std::string dir = MakeTempDir();
  absl::StatusOr<std::unique_ptr<GrpcListeners>> listeners =
      GrpcListeners::Bind({absl::StrCat("unix:", dir, "/a.sock"), "127.0.0.1:0"});
  ASSERT_TRUE(listeners.ok()) << listeners.status();
  ASSERT_EQ((*listeners)->bound().size(), 2u);
  EXPECT_EQ((*listeners)->bound()[0], absl::StrCat("unix:", dir, "/a.sock"));
  const int port = PortOf((*listeners)->bound()[1]);
  ASSERT_GT(port, 0);
  EXPECT_EQ((*listeners)->bound()[1], absl::StrCat("127.0.0.1:", port));
  RecordingAcceptor* acceptor = StartRecording(**listeners);
  const int a = ConnectUnix(dir + "/a.sock");
  const int b = ConnectTcp(AF_INET, port);
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  ASSERT_TRUE(acceptor->AwaitCount(2));
  for (int fd : acceptor->fds()) {
    EXPECT_NE(::fcntl(fd, F_GETFL) & O_NONBLOCK, 0);
    EXPECT_NE(::fcntl(fd, F_GETFD) & FD_CLOEXEC, 0);
  }
  const std::vector<int> from = acceptor->listener_fds();
  EXPECT_NE(from[0], from[1]);  // each names the socket it came from
  ::close(a);
  ::close(b);
  (*listeners)->Stop();
  EXPECT_LT(ConnectTcp(AF_INET, port), 0);  // refused once stopped
  EXPECT_LT(ConnectUnix(dir + "/a.sock"), 0);
}

TEST(GrpcListenersTest, AWildcardAndANameListenOnEveryAddressWithOnePort) {
  for (const char* host : {"0.0.0.0", "[::]", "localhost"}) {
    SCOPED_TRACE(host);
    absl::StatusOr<std::unique_ptr<GrpcListeners>> listeners =
        GrpcListeners::Bind({absl::StrCat(host, ":0")});
    ASSERT_TRUE(listeners.ok()) << listeners.status();
    const int port = PortOf((*listeners)->bound()[0]);
    RecordingAcceptor* acceptor = StartRecording(**listeners);
    size_t expected = 0;
    const int v4 = ConnectTcp(AF_INET, port);
    EXPECT_GE(v4, 0);
    expected += v4 >= 0;
    int v6 = -1;
    // A name: on IPv6 where it resolves to an IPv6 address (not every
    // /etc/hosts gives localhost ::1).
    if (HasIpv6Loopback() && (std::string(host) != "localhost" || ResolvesToIpv6(host))) {
      v6 = ConnectTcp(AF_INET6, port);
      EXPECT_GE(v6, 0);
      expected += v6 >= 0;
    }
    EXPECT_TRUE(acceptor->AwaitCount(expected));
    if (v4 >= 0) ::close(v4);
    if (v6 >= 0) ::close(v6);
  }
}

TEST(GrpcListenersTest, BadAddressesAreRefusedNamingTheAddressAndWhy) {
  const std::string dir = MakeTempDir();
  const std::string long_path = dir + "/" + std::string(120, 'x');
  absl::StatusOr<std::unique_ptr<GrpcListeners>> listeners =
      GrpcListeners::Bind({"unix:" + long_path});
  EXPECT_EQ(listeners.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(listeners.status().message(), HasSubstr("1 to 107 fit a Unix socket"));
  EXPECT_THAT(listeners.status().message(), HasSubstr(long_path));

  listeners = GrpcListeners::Bind({"127.0.0.1:65536"});
  EXPECT_EQ(listeners.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(listeners.status().message(),
              HasSubstr("cannot listen on 127.0.0.1:65536: port \"65536\" is not in 0..65535"));

  listeners = GrpcListeners::Bind({"no-such-host.invalid:0"});
  EXPECT_EQ(listeners.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(listeners.status().message(),
              HasSubstr("cannot listen on no-such-host.invalid:0: cannot resolve"));

  // A port another socket listens on. A unix: socket bound before it is
  // removed again: nothing is left half-listening.
  absl::StatusOr<std::unique_ptr<GrpcListeners>> first = GrpcListeners::Bind({"127.0.0.1:0"});
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string taken = (*first)->bound()[0];
  listeners = GrpcListeners::Bind({absl::StrCat("unix:", dir, "/b.sock"), taken});
  EXPECT_EQ(listeners.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(
      listeners.status().message(),
      HasSubstr(absl::StrCat("cannot listen on ", taken, ": bind: Address already in use")));
  struct stat st;
  EXPECT_NE(::stat((dir + "/b.sock").c_str(), &st), 0);
}

// A socket file at `path` that nobody listens on (as its process died).
bool MakeStaleSocket(const std::string& path) {
  const int stale = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const bool bound = ::bind(stale, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(stale);
  return bound;
}

TEST(GrpcListenersTest, ALiveSocketIsRefusedAStaleOneReplacedAndOnlyItsOwnFileRemoved) {
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/c.sock";
  absl::StatusOr<std::unique_ptr<GrpcListeners>> live = GrpcListeners::Bind({"unix:" + path});
  ASSERT_TRUE(live.ok()) << live.status();
  absl::StatusOr<std::unique_ptr<GrpcListeners>> second = GrpcListeners::Bind({"unix:" + path});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(), HasSubstr("another process listens on " + path));
  (*live)->Stop();
  struct stat st;
  EXPECT_NE(::stat(path.c_str(), &st), 0) << "Stop leaves its socket file";

  // A socket file nobody listens on (its process died): replaced.
  ASSERT_TRUE(MakeStaleSocket(path));
  absl::StatusOr<std::unique_ptr<GrpcListeners>> replacing = GrpcListeners::Bind({"unix:" + path});
  ASSERT_TRUE(replacing.ok()) << replacing.status();
  RecordingAcceptor* acceptor = StartRecording(**replacing);
  const int fd = ConnectUnix(path);
  EXPECT_GE(fd, 0);
  EXPECT_TRUE(acceptor->AwaitCount(1));
  ::close(fd);

  // Someone else's file at the path by the time it stops: left alone.
  ASSERT_EQ(::unlink(path.c_str()), 0);
  {
    std::ofstream other(path);
    other << "not ours";
  }
  (*replacing)->Stop();
  EXPECT_EQ(::stat(path.c_str(), &st), 0);
}

TEST(GrpcListenersTest, TheLockBesideTheSocketDecidesWhoReplacesAStaleOne) {
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/d.sock";
  const std::string lock_path = path + ".lock";
  // A stale socket file (its process died)...
  ASSERT_TRUE(MakeStaleSocket(path));
  // ...that another process is replacing right now (it holds the lock).
  const int held = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(held, 0);
  ASSERT_EQ(::flock(held, LOCK_EX | LOCK_NB), 0);
  absl::StatusOr<std::unique_ptr<GrpcListeners>> refused = GrpcListeners::Bind({"unix:" + path});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("another process listens on " + path + " (it holds " + lock_path + ")"));
  struct stat st;
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << "the holder's socket file was removed";
  ::close(held);  // the holder died: its lock went with it
  absl::StatusOr<std::unique_ptr<GrpcListeners>> taken = GrpcListeners::Bind({"unix:" + path});
  ASSERT_TRUE(taken.ok()) << taken.status();
  (*taken)->Stop();
  EXPECT_NE(::stat(lock_path.c_str(), &st), 0) << "Stop leaves its lock file";
  EXPECT_NE(::stat(path.c_str(), &st), 0);
}

TEST(GrpcListenersTest, OfListenersRacingForOneStaleSocketExactlyOneWins) {
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/e.sock";
  for (int round = 0; round < 50; ++round) {
    ASSERT_TRUE(MakeStaleSocket(path));
    constexpr int kRacers = 4;
    std::vector<absl::StatusOr<std::unique_ptr<GrpcListeners>>> bound;
    for (int i = 0; i < kRacers; ++i) bound.emplace_back(absl::UnknownError("not run"));
    std::vector<std::thread> racers;
    for (int i = 0; i < kRacers; ++i) {
      racers.emplace_back([&, i] { bound[i] = GrpcListeners::Bind({"unix:" + path}); });
    }
    for (std::thread& t : racers) t.join();
    int winners = 0;
    for (const auto& b : bound) {
      if (b.ok()) {
        ++winners;
      } else {
        EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition) << b.status();
      }
    }
    ASSERT_EQ(winners, 1) << "round " << round;
    // The socket file at the path is the winner's: it accepts.
    for (auto& b : bound) {
      if (!b.ok()) continue;
      RecordingAcceptor* acceptor = StartRecording(**b);
      const int fd = ConnectUnix(path);
      EXPECT_GE(fd, 0);
      EXPECT_TRUE(acceptor->AwaitCount(1));
      ::close(fd);
      (*b)->Stop();
    }
  }
}

// A child process holding `n` connections to a unix socket, so that in this
// process only the accepted ends take descriptors, and nothing but the
// accept thread takes them. This process's open-file limit is lowered to
// `limit` for the child's lifetime; the child keeps the old one.
class FloodChild {
 public:
  FloodChild(const std::string& path, int n, rlim_t limit) {
    EXPECT_EQ(::getrlimit(RLIMIT_NOFILE, &saved_), 0);
    int to_child[2], from_child[2];
    EXPECT_EQ(::pipe2(to_child, O_CLOEXEC), 0);
    EXPECT_EQ(::pipe2(from_child, O_CLOEXEC), 0);
    // Lowered before the fork, so that the accept thread is never past it.
    rlimit low = saved_;
    low.rlim_cur = limit;
    EXPECT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setrlimit(RLIMIT_NOFILE, &saved_);
      std::vector<int> held;
      for (int i = 0; i < n; ++i) held.push_back(ConnectUnix(path));
      // On each byte from the parent: how many of the connections the
      // server closed (end-of-file), as one byte (capped at 255).
      char command;
      while (::read(to_child[0], &command, 1) == 1) {
        int closed = 0;
        for (int fd : held) {
          char byte;
          closed += fd >= 0 && ::recv(fd, &byte, 1, MSG_DONTWAIT) == 0;
        }
        const unsigned char answer = static_cast<unsigned char>(closed > 255 ? 255 : closed);
        (void)!::write(from_child[1], &answer, 1);
      }
      ::_exit(0);
    }
    ::close(to_child[0]);
    ::close(from_child[1]);
    to_child_ = to_child[1];
    from_child_ = from_child[0];
  }
  ~FloodChild() { Release(); }

  // How many of the child's connections the server closed.
  int ClosedByServer() {
    // Asked once it has made every connection (the server closes or
    // accepts them all, so it gets there).
    unsigned char answer = 0;
    if (::write(to_child_, "?", 1) != 1) return -1;
    pollfd answered{from_child_, POLLIN, 0};
    if (::poll(&answered, 1, 20000) != 1 || ::read(from_child_, &answer, 1) != 1) return -1;
    return answer;
  }
  // Ends the child (its connections close) and restores the limit.
  void Release() {
    if (pid_ <= 0) return;
    ::close(to_child_);
    ::close(from_child_);
    ::kill(pid_, SIGKILL);  // it may still be connecting
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    ::setrlimit(RLIMIT_NOFILE, &saved_);
  }

 private:
  rlimit saved_{};
  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
};

bool AwaitRefused(const GrpcListeners& listeners) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (listeners.refused_for_descriptors() == 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  return listeners.refused_for_descriptors() > 0;
}

// Out of descriptors, a waiting connection is taken off the backlog and
// closed (its client sees end-of-file), and the listener accepts again as
// soon as descriptors are free.
TEST(GrpcListenersTest, OutOfDescriptorsConnectionsAreClosedAndAcceptingResumes) {
  if (testing::kUnderSanitizer) {
    GTEST_SKIP() << "leaves the process no descriptor (see kUnderSanitizer)";
  }
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/d.sock";
  absl::StatusOr<std::unique_ptr<GrpcListeners>> listeners = GrpcListeners::Bind({"unix:" + path});
  ASSERT_TRUE(listeners.ok()) << listeners.status();
  RecordingAcceptor* acceptor = StartRecording(**listeners);
  {
    FloodChild flood(path, 400, 256);
    EXPECT_TRUE(AwaitRefused(**listeners));
    // The connections it had no room for were closed, not left hanging.
    EXPECT_GT(flood.ClosedByServer(), 0);
  }
  // Descriptors free again: the next connection is handed over.
  acceptor->CloseAll();
  const int after = ConnectUnix(path);
  ASSERT_GE(after, 0);
  EXPECT_TRUE(acceptor->AwaitCount(1));
  ::close(after);
}

// The spare descriptor given up when out of descriptors can be lost (another
// thread takes the descriptor freed): it is taken back as soon as one is
// free, so connections keep being closed rather than left hanging.
TEST(GrpcListenersTest, ASpareDescriptorLostToAnotherThreadIsTakenBack) {
  if (testing::kUnderSanitizer) {
    GTEST_SKIP() << "leaves the process no descriptor (see kUnderSanitizer)";
  }
  const std::string dir = MakeTempDir();
  const std::string path = dir + "/e.sock";
  absl::StatusOr<std::unique_ptr<GrpcListeners>> listeners = GrpcListeners::Bind({"unix:" + path});
  ASSERT_TRUE(listeners.ok()) << listeners.status();
  RecordingAcceptor* acceptor = StartRecording(**listeners);
  (*listeners)->LoseSpareNextTimeForTesting();
  {
    // The spare is lost at the first EMFILE; the descriptor it freed is
    // taken back before anything else can take it, and the connections
    // still waiting are closed with it.
    FloodChild flood(path, 400, 256);
    EXPECT_TRUE(AwaitRefused(**listeners));
  }
  acceptor->CloseAll();
}

// What is at a unix: path and is not a stale socket of ours to replace is
// left alone: a datagram socket (it answers a stream connect with
// EPROTOTYPE), a file, the same path listed twice.
TEST(GrpcListenersTest, AUnixPathHoldingSomethingElseIsRefusedAndLeftAlone) {
  const std::string dir = MakeTempDir();
  const std::string dgram_path = dir + "/dgram.sock";
  const int dgram = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, dgram_path.c_str(), dgram_path.size() + 1);
  ASSERT_EQ(::bind(dgram, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  struct stat before, after;
  ASSERT_EQ(::stat(dgram_path.c_str(), &before), 0);
  absl::StatusOr<std::unique_ptr<GrpcListeners>> listeners =
      GrpcListeners::Bind({"unix:" + dgram_path});
  EXPECT_EQ(listeners.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(listeners.status().message(),
              HasSubstr(dgram_path + " is a socket in use or not ours to replace"));
  ASSERT_EQ(::stat(dgram_path.c_str(), &after), 0);
  EXPECT_EQ(after.st_ino, before.st_ino);
  ::close(dgram);

  const std::string file = dir + "/file";
  {
    std::ofstream out(file);
    out << "data";
  }
  listeners = GrpcListeners::Bind({"unix:" + file});
  EXPECT_EQ(listeners.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(listeners.status().message(), HasSubstr(file + " exists and is not a socket"));

  listeners = GrpcListeners::Bind({"unix:" + dir + "/twice.sock", "unix:" + dir + "/twice.sock"});
  EXPECT_EQ(listeners.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(listeners.status().message(), HasSubstr("listed twice"));
}

// Port 0 however written is replaced in what is reported (the watchdog
// probes those addresses); the IPv6 wildcard does not fall back to IPv4 alone
// when its port is taken on IPv6.
TEST(GrpcListenersTest, PortZeroIsReportedAsChosenAndATakenIpv6PortIsRefused) {
  absl::StatusOr<std::unique_ptr<GrpcListeners>> zeros = GrpcListeners::Bind({"127.0.0.1:000"});
  ASSERT_TRUE(zeros.ok()) << zeros.status();
  const int port = PortOf((*zeros)->bound()[0]);
  EXPECT_GT(port, 0);
  EXPECT_EQ((*zeros)->bound()[0], absl::StrCat("127.0.0.1:", port));
  if (!HasIpv6Loopback()) GTEST_SKIP() << "no IPv6 loopback here";
  absl::StatusOr<std::unique_ptr<GrpcListeners>> v6 = GrpcListeners::Bind({"[::1]:0"});
  ASSERT_TRUE(v6.ok()) << v6.status();
  const int taken = PortOf((*v6)->bound()[0]);
  absl::StatusOr<std::unique_ptr<GrpcListeners>> wildcard =
      GrpcListeners::Bind({absl::StrCat("[::]:", taken)});
  EXPECT_EQ(wildcard.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(wildcard.status().message(), HasSubstr("bind: Address already in use"));
}

}  // namespace
}  // namespace refit::server
