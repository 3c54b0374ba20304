#include "server/sd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace refit::server {

absl::Status SdNotifyTo(absl::string_view notify_socket, absl::string_view state) {
  if (notify_socket.empty()) return absl::OkStatus();
  const bool abstract = notify_socket[0] == '@';
  if (!abstract && notify_socket[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("NOTIFY_SOCKET \"", notify_socket,
                     "\" is neither an absolute path nor an @abstract socket name"));
  }
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (notify_socket.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("NOTIFY_SOCKET \"", notify_socket,
                                                   "\" is longer than a socket address holds (",
                                                   sizeof(address.sun_path) - 1, " bytes)"));
  }
  std::memcpy(address.sun_path, notify_socket.data(), notify_socket.size());
  // An abstract name starts with a NUL byte and is exactly as long as given.
  if (abstract) address.sun_path[0] = '\0';
  const socklen_t length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) +
                                                  notify_socket.size() + (abstract ? 0 : 1));

  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot create a datagram socket for NOTIFY_SOCKET: ", std::strerror(errno)));
  }
  const ssize_t sent = sendto(fd, state.data(), state.size(), MSG_NOSIGNAL,
                              reinterpret_cast<const sockaddr*>(&address), length);
  const int send_errno = errno;
  close(fd);
  if (sent < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot notify the service manager at NOTIFY_SOCKET \"", notify_socket,
                     "\": ", std::strerror(send_errno)));
  }
  if (static_cast<size_t>(sent) != state.size()) {
    return absl::UnavailableError(absl::StrCat("NOTIFY_SOCKET \"", notify_socket, "\" took ", sent,
                                               " of ", state.size(), " bytes"));
  }
  return absl::OkStatus();
}

absl::Status SdNotify(absl::string_view state) {
  const char* notify_socket = std::getenv("NOTIFY_SOCKET");
  return SdNotifyTo(notify_socket == nullptr ? "" : notify_socket, state);
}

}  // namespace refit::server
