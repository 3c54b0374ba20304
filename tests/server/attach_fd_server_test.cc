#include "server/attach_fd_server.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::server {
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

// Sends `ticket` and returns the descriptors received (up to 8), or none and
// the server's refusal in *error.
std::vector<int> Redeem(const std::string& path, const std::string& ticket, std::string* error) {
  int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    *error = absl::StrCat("connect: ", std::strerror(errno));
    ::close(s);
    return {};
  }
  const std::string line = ticket + "\n";
  (void)!::send(s, line.data(), line.size(), MSG_NOSIGNAL);
  char buf[512];
  iovec iov{buf, sizeof(buf)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = ::recvmsg(s, &msg, MSG_CMSG_CLOEXEC);
  ::close(s);
  std::vector<int> fds;
  if (n > 0 && buf[0] == 'K') {
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      fds.resize(count);
      std::memcpy(fds.data(), CMSG_DATA(c), count * sizeof(int));
    }
    return fds;
  }
  *error = n > 1 ? std::string(buf + 1, static_cast<size_t>(n - 1)) : "nothing";
  return fds;
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
  std::vector<int> fds = Redeem(path_, "two", &error);
  ASSERT_EQ(fds.size(), 2u) << error;
  EXPECT_EQ(Contents(fds[0]), "host arena");
  EXPECT_EQ(Contents(fds[1]), "device arena");
  for (int fd : fds) ::close(fd);
  EXPECT_TRUE(Redeem(path_, "bad", &error).empty());
  EXPECT_THAT(error, HasSubstr("unknown attach ticket"));
  EXPECT_TRUE(Redeem(path_, "none", &error).empty());
  EXPECT_THAT(error, HasSubstr("0 descriptors to send"));
}

}  // namespace
}  // namespace refit::server
