// SdNotify against a real AF_UNIX datagram socket standing in for systemd's
// notification socket: what the service manager would receive, byte for byte.
#include "server/sd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tests/server/server_test_util.h"

namespace refit::server {
namespace {

using ::refit::server::testing::MakeTempDir;
using ::testing::HasSubstr;

// A bound datagram socket; Receive returns the next datagram or "" after a
// deadline (SO_RCVTIMEO), so a missing message fails instead of hanging.
class NotifyListener {
 public:
  // `name` is a path, or an abstract name when it starts with '@'.
  explicit NotifyListener(const std::string& name) : name_(name) {
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path, name.data(), name.size());
    const bool abstract = name[0] == '@';
    if (abstract) address.sun_path[0] = '\0';
    const socklen_t length =
        static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size() + (abstract ? 0 : 1));
    bound_ = bind(fd_, reinterpret_cast<const sockaddr*>(&address), length) == 0;
    timeval timeout{5, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  }
  ~NotifyListener() { close(fd_); }

  bool bound() const { return bound_; }
  std::string Receive() {
    char buffer[4096];
    const ssize_t n = recv(fd_, buffer, sizeof(buffer), 0);
    return n < 0 ? std::string() : std::string(buffer, static_cast<size_t>(n));
  }

 private:
  std::string name_;
  int fd_ = -1;
  bool bound_ = false;
};

// Sets NOTIFY_SOCKET for one test and restores what was there.
class ScopedNotifySocket {
 public:
  explicit ScopedNotifySocket(const char* value) {
    const char* old = std::getenv("NOTIFY_SOCKET");
    had_old_ = old != nullptr;
    if (had_old_) old_ = old;
    if (value == nullptr) {
      unsetenv("NOTIFY_SOCKET");
    } else {
      setenv("NOTIFY_SOCKET", value, 1);
    }
  }
  ~ScopedNotifySocket() {
    if (had_old_) {
      setenv("NOTIFY_SOCKET", old_.c_str(), 1);
    } else {
      unsetenv("NOTIFY_SOCKET");
    }
  }

 private:
  bool had_old_ = false;
  std::string old_;
};

TEST(SdNotifyTest, SendsStateToPathSocketFromEnvironment) {
  const std::string path = MakeTempDir() + "/notify";
  NotifyListener listener(path);
  ASSERT_TRUE(listener.bound()) << path;
  ScopedNotifySocket env(path.c_str());

  ASSERT_TRUE(SdNotify("READY=1\nSTATUS=serving version 1").ok());
  EXPECT_EQ(listener.Receive(), "READY=1\nSTATUS=serving version 1");
  ASSERT_TRUE(SdNotify("STOPPING=1").ok());
  EXPECT_EQ(listener.Receive(), "STOPPING=1");
}

TEST(SdNotifyTest, SendsToAbstractSocket) {
  const std::string name = absl::StrCat("@refit-sd-notify-test-", getpid());
  NotifyListener listener(name);
  ASSERT_TRUE(listener.bound()) << name;

  ASSERT_TRUE(SdNotifyTo(name, "READY=1").ok());
  EXPECT_EQ(listener.Receive(), "READY=1");
}

TEST(SdNotifyTest, UnsetOrEmptyNotifySocketSendsNothing) {
  {
    ScopedNotifySocket env(nullptr);
    EXPECT_TRUE(SdNotify("READY=1").ok());
  }
  ScopedNotifySocket env("");
  EXPECT_TRUE(SdNotify("READY=1").ok());
}

TEST(SdNotifyTest, RelativeAddressIsInvalidArgument) {
  const absl::Status status = SdNotifyTo("run/notify", "READY=1");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("run/notify"));
  EXPECT_THAT(status.message(), HasSubstr("absolute path"));
}

TEST(SdNotifyTest, OverlongAddressIsInvalidArgument) {
  const std::string path = "/" + std::string(200, 'x');
  const absl::Status status = SdNotifyTo(path, "READY=1");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("longer than a socket address holds"));
}

TEST(SdNotifyTest, NoListenerIsUnavailable) {
  const std::string path = MakeTempDir() + "/nobody-listens";
  const absl::Status status = SdNotifyTo(path, "READY=1");
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(status.message(), HasSubstr(path));
  EXPECT_THAT(status.message(), HasSubstr("No such file or directory"));
}

}  // namespace
}  // namespace refit::server
