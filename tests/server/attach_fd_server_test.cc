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

}  // namespace
}  // namespace refit::server::testing
