#include "server/attach_fd_server.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"

namespace refit::server::testing {
namespace {

using ::testing::HasSubstr;

// A memfd holding `text`.
int MemfdWith(const std::string& text) {
  int fd = ::memfd_create("attach-fd-test", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
  return fd;
}

std::string Contents(int fd) {
  char buf[64] = {};
  const ssize_t n = ::pread(fd, buf, sizeof(buf), 0);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
}

class AttachFdServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/refit-fdserver-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    path_ = dir_ + "/s.fd";
  }
  void TearDown() override {
    server_.reset();
    ::rmdir(dir_.c_str());
  }
  std::string dir_, path_;
  std::unique_ptr<AttachFdServer> server_;
};

// A GPU arena shared as a virtual-memory allocation goes with a second
// descriptor: every descriptor the redeemer gives arrives, in order, in one
// message. None, or a refusal, is an 'E' line.
TEST_F(AttachFdServerTest, SendsEveryDescriptorInOrderInOneMessage) {
  std::vector<int> given;
  absl::StatusOr<std::unique_ptr<AttachFdServer>> server = AttachFdServer::Start(
      path_, [&](absl::string_view ticket, int, uint32_t) -> absl::StatusOr<std::vector<int>> {
        if (ticket == "none") return std::vector<int>{};
        if (ticket != "two") return absl::PermissionDeniedError("unknown attach ticket");
        given = {MemfdWith("host arena"), MemfdWith("device arena")};
        return given;
      });
  ASSERT_TRUE(server.ok()) << server.status();
  server_ = *std::move(server);
  std::string error;
  std::vector<int> fds = ReceiveFds(path_, "two", &error);
  ASSERT_EQ(fds.size(), 2u) << error;
  EXPECT_EQ(Contents(fds[0]), "host arena");
  EXPECT_EQ(Contents(fds[1]), "device arena");
  for (int fd : fds) ::close(fd);
  EXPECT_TRUE(ReceiveFds(path_, "bad", &error).empty());
  EXPECT_THAT(error, HasSubstr("unknown attach ticket"));
  EXPECT_TRUE(ReceiveFds(path_, "none", &error).empty());
  EXPECT_THAT(error, HasSubstr("0 descriptors to send"));
}

// Everything the server sent on `s` until it closed (or `ms` passed).
// Everything the server sends until it closes (or "<still open>" after `ms`
// of silence); *closed_cleanly, when given: whether the stream ended with an
// orderly close (a reset loses the answer for a peer that reads until the
// end).
std::string ReadAll(int s, int ms, bool* closed_cleanly = nullptr) {
  std::string out;
  char buf[256];
  if (closed_cleanly != nullptr) *closed_cleanly = false;
  for (;;) {
    pollfd p{s, POLLIN, 0};
    if (::poll(&p, 1, ms) <= 0) return out + "<still open>";
    const ssize_t n = ::recv(s, buf, sizeof(buf), 0);
    if (n <= 0) {
      if (closed_cleanly != nullptr) *closed_cleanly = n == 0;
      return out;
    }
    out.append(buf, static_cast<size_t>(n));
  }
}

bool StillOpen(int s) {
  pollfd p{s, POLLIN, 0};
  return ::poll(&p, 1, 0) == 0;
}

// ReceiveFds, tried again every 20 ms for up to `seconds` while the server
// is not serving yet (its earlier connections still ending).
std::vector<int> ReceiveFdsWithin(const std::string& path, const std::string& ticket,
                                  double seconds, std::string* error) {
  std::vector<int> fds;
  for (int waited_ms = 0; fds.empty() && waited_ms <= seconds * 1000; waited_ms += 20) {
    fds = ReceiveFds(path, ticket, error);
    if (fds.empty()) ::usleep(20 * 1000);
  }
  return fds;
}

class AttachFdServerPeersTest : public AttachFdServerTest {
 protected:
  void StartServer() {
    absl::StatusOr<std::unique_ptr<AttachFdServer>> server = AttachFdServer::Start(
        path_, [](absl::string_view ticket, int, uint32_t) -> absl::StatusOr<std::vector<int>> {
          if (ticket != "good") return absl::PermissionDeniedError("unknown attach ticket");
          return std::vector<int>{MemfdWith("arena")};
        });
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
};

// A peer that connects and sends nothing holds only its own connection: an
// engine that comes after it gets its descriptor while the first is still
// waiting, and the silent one is told why it was dropped.
TEST_F(AttachFdServerPeersTest, APeerThatSendsNothingDelaysNoOtherPeer) {
  StartServer();
  std::string error;
  const int silent = ConnectUnix(path_, &error);
  ASSERT_GE(silent, 0) << error;
  std::vector<int> fds = ReceiveFds(path_, "good", &error);
  ASSERT_EQ(fds.size(), 1u) << error;
  EXPECT_EQ(Contents(fds[0]), "arena");
  ::close(fds[0]);
  EXPECT_TRUE(StillOpen(silent));
  EXPECT_THAT(ReadAll(silent, 5000), HasSubstr("Eno ticket line within 1000 ms"));
  ::close(silent);
}

// A peer that trickles its ticket a byte at a time never gets past the one
// second it has in all (bytes that keep coming do not extend it).
TEST_F(AttachFdServerPeersTest, ATricklingPeerIsCutOffAfterOneSecondInAll) {
  StartServer();
  std::string error;
  const int s = ConnectUnix(path_, &error);
  ASSERT_GE(s, 0) << error;
  int sent = 0;
  for (; sent < 40 && StillOpen(s); ++sent) {
    ASSERT_EQ(::send(s, "g", 1, MSG_NOSIGNAL), 1) << "the server closed before answering";
    ::usleep(100 * 1000);
  }
  // 1 s is 10 bytes at 100 ms; 40 (4 s) would mean the deadline moved.
  EXPECT_LT(sent, 40);
  EXPECT_THAT(ReadAll(s, 5000), HasSubstr("Eno ticket line within 1000 ms"));
  ::close(s);
  // The server still serves.
  std::vector<int> fds = ReceiveFds(path_, "good", &error);
  ASSERT_EQ(fds.size(), 1u) << error;
  ::close(fds[0]);
}

// `n` connections to `path` that send nothing, accepted by the server by
// the time this returns (it reads each peer's credentials as it accepts).
std::vector<int> HoldConnections(const std::string& path, int n) {
  std::vector<int> held;
  std::string error;
  for (int i = 0; i < n; ++i) {
    const int s = ConnectUnix(path, &error);
    EXPECT_GE(s, 0) << error;
    if (s >= 0) held.push_back(s);
  }
  ::usleep(100 * 1000);
  return held;
}

// What the server answers one more connection that sends nothing, within
// 900 ms.
std::string OneMoreAnswer(const std::string& path) {
  std::string error;
  const int s = ConnectUnix(path, &error);
  if (s < 0) return "connect: " + error;
  std::string answer = ReadAll(s, 900);
  ::close(s);
  return answer;
}

// A child process that connects `n` times to `path`, sends nothing and
// waits to be killed; returns once its connections are made (its pid), or
// -1.
pid_t HoldConnectionsInChild(const std::string& path, int n) {
  int ready[2];
  if (::pipe(ready) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {  // only async-signal-safe calls from here
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    for (int i = 0; i < n; ++i) {
      const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
      if (s < 0 || ::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) _exit(1);
    }
    (void)!::write(ready[1], "r", 1);
    for (;;) ::pause();
  }
  ::close(ready[1]);
  char byte = 0;
  const bool ok = pid > 0 && ::read(ready[0], &byte, 1) == 1;
  ::close(ready[0]);
  return ok ? pid : -1;
}

void KillChild(pid_t pid) {
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
}

// A process that holds its connections open takes at most
// kMaxConnectionsPerProcess slots: one more of its own is refused at once,
// while another process is still served.
TEST_F(AttachFdServerPeersTest, OneProcessHoldsAtMostItsShareOfTheConnections) {
  StartServer();
  const std::vector<int> held = HoldConnections(path_, AttachFdServer::kMaxConnectionsPerProcess);
  EXPECT_THAT(OneMoreAnswer(path_),
              HasSubstr(absl::StrCat("Etoo many attach connections from process ", ::getpid(),
                                     " at once")));
  const pid_t other = ::fork();
  if (other == 0) {  // another process: served
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path_.c_str(), path_.size() + 1);
    const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
    if (s < 0 || ::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) _exit(2);
    if (::write(s, "good\n", 5) != 5) _exit(3);
    char answer = 0;
    _exit(::read(s, &answer, 1) == 1 && answer == 'K' ? 0 : 4);
  }
  ASSERT_GT(other, 0);
  int status = -1;
  ASSERT_EQ(::waitpid(other, &status, 0), other);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  for (int s : held) ::close(s);
}

// Peers in another PID namespace (engines in other pods of a node daemon)
// have pid 0 in SO_PEERCRED: those of one uid share a larger share of their
// own, so one of them cannot take every slot either, nor other uids'.
TEST_F(AttachFdServerPeersTest, PeersInAnotherPidNamespaceShareASlotCountPerUid) {
  AttachFdServer::SetPeerHookForTesting([](int, int* pid, uint32_t* uid) {
    *pid = 0;
    *uid = 4242;
  });
  StartServer();
  const std::vector<int> held = HoldConnections(path_, AttachFdServer::kMaxConnectionsPerUnseenUid);
  EXPECT_THAT(OneMoreAnswer(path_),
              HasSubstr("Etoo many attach connections from uid 4242 in another PID namespace"));
  std::string error;
  AttachFdServer::SetPeerHookForTesting([](int, int* pid, uint32_t* uid) {
    *pid = 0;
    *uid = 4343;
  });
  std::vector<int> fds = ReceiveFds(path_, "good", &error);  // another uid: served
  AttachFdServer::SetPeerHookForTesting(nullptr);
  ASSERT_EQ(fds.size(), 1u) << error;
  ::close(fds[0]);
  for (int s : held) ::close(s);
}

// At most kMaxConnections peers are served at once: one more is refused at
// once with a reason, and a line that never ends is refused too (its
// answer arrives: the rest of the line is read before the close). None of
// it stops the server.
TEST_F(AttachFdServerPeersTest, ConnectionsBeyondTheCapAndOverlongTicketsAreRefused) {
  StartServer();
  std::string error;
  std::vector<pid_t> holders;
  for (int i = 0; i < AttachFdServer::kMaxConnections / AttachFdServer::kMaxConnectionsPerProcess;
       ++i) {
    holders.push_back(HoldConnectionsInChild(path_, AttachFdServer::kMaxConnectionsPerProcess));
    ASSERT_GT(holders.back(), 0);
  }
  ::usleep(100 * 1000);  // every connection accepted
  EXPECT_THAT(OneMoreAnswer(path_), HasSubstr("Etoo many attach connections at once"));
  for (pid_t pid : holders) KillChild(pid);
  // Once those end (closed by their peers), new ones are served again.
  std::vector<int> fds = ReceiveFdsWithin(path_, "good", 1.0, &error);
  ASSERT_EQ(fds.size(), 1u) << error;
  ::close(fds[0]);
  const int s = ConnectUnix(path_, &error);
  ASSERT_GE(s, 0) << error;
  const std::string long_line(AttachFdServer::kMaxTicketBytes + 20000, 'x');
  ASSERT_EQ(::send(s, long_line.data(), long_line.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(long_line.size()));
  bool closed_cleanly = false;
  EXPECT_THAT(ReadAll(s, 5000, &closed_cleanly), HasSubstr("Eticket too long"));
  EXPECT_TRUE(closed_cleanly) << "reset: " << std::strerror(errno);
  ::close(s);
}

// Out of descriptors, accept fails while the peer stays queued: the server
// waits between tries instead of spinning on a socket that stays readable,
// and serves again once descriptors are free.
TEST_F(AttachFdServerPeersTest, OutOfDescriptorsTheServerWaitsInsteadOfSpinning) {
  if (kUnderSanitizer) GTEST_SKIP() << "leaves the process no descriptor (see kUnderSanitizer)";
  StartServer();
  std::string error;
  const int queued = ConnectUnix(path_, &error);
  ASSERT_GE(queued, 0) << error;
  rusage before{}, after{};
  {
    NoFreeDescriptors none;  // the server's accept fails with EMFILE
    ASSERT_TRUE(none.ok());
    ::getrusage(RUSAGE_SELF, &before);
    ::usleep(500 * 1000);
    ::getrusage(RUSAGE_SELF, &after);
  }
  auto seconds = [](const rusage& u) {
    return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
  };
  // A spinning accept loop burns the whole half second on its core.
  EXPECT_LT(seconds(after) - seconds(before), 0.2);
  ::close(queued);
  std::vector<int> fds = ReceiveFdsWithin(path_, "good", 1.0, &error);
  ASSERT_EQ(fds.size(), 1u) << error;
  ::close(fds[0]);
}

}  // namespace
}  // namespace refit::server::testing
