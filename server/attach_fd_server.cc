#include "server/attach_fd_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/log.h"

namespace refit::server {
namespace {

// AttachFdServer::SetPeerHookForTesting's hook.
std::atomic<void (*)(int, int*, uint32_t*)> g_peer_hook{nullptr};

void SendAll(int fd, absl::string_view text) {
  while (!text.empty()) {
    ssize_t n = ::send(fd, text.data(), text.size(), MSG_NOSIGNAL);
    if (n <= 0) return;
    text.remove_prefix(static_cast<size_t>(n));
  }
}

// recvmsg of up to `len` bytes into `buf`; the descriptors that came with
// them (SCM_RIGHTS) are appended to `fds`, for the caller to keep or close.
// *lost (if given) is set when the kernel dropped some (MSG_CTRUNC: this
// process is at its descriptor limit, or more came than fit).
ssize_t ReceiveWithDescriptors(int conn, char* buf, size_t len, int flags, std::vector<int>* fds,
                               bool* lost = nullptr) {
  iovec iov{buf, len};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = ::recvmsg(conn, &msg, flags | MSG_CMSG_CLOEXEC);
  if (n < 0) return n;
  if ((msg.msg_flags & MSG_CTRUNC) != 0 && lost != nullptr) *lost = true;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd = -1;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds->push_back(fd);
    }
  }
  return n;
}

// Reads (and drops) what the peer sent that is still queued, closing any
// descriptors: closing a Unix socket with unread bytes would reset the
// peer's read, and an answer just sent with it. Never blocks.
void DrainInput(int conn) {
  for (int i = 0; i < 256; ++i) {  // up to 64 KiB
    char buf[256];
    std::vector<int> fds;
    const ssize_t n = ReceiveWithDescriptors(conn, buf, sizeof(buf), MSG_DONTWAIT, &fds);
    for (int fd : fds) ::close(fd);
    if (n <= 0) break;
  }
}

// Answers `line` on a connection the server will not serve, and closes it.
// Nothing here blocks: a fresh socket's send buffer is empty.
void Refuse(int conn, absl::string_view line) {
  (void)!::send(conn, line.data(), line.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  DrainInput(conn);
  ::close(conn);
}

}  // namespace

void AttachFdServer::SetPeerHookForTesting(void (*hook)(int conn, int* pid, uint32_t* uid)) {
  g_peer_hook.store(hook);
}

absl::StatusOr<std::unique_ptr<AttachFdServer>> AttachFdServer::Start(std::string path,
                                                                      Redeem redeem,
                                                                      Deposit deposit) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("attach socket path \"", path, "\" is empty or too long"));
  }
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("attach socket ", path, " exists and is not a socket"));
    }
    ::unlink(path.c_str());
  }
  std::unique_ptr<AttachFdServer> server(
      new AttachFdServer(std::move(path), std::move(redeem), std::move(deposit)));
  server->listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (server->listen_fd_ < 0) {
    return absl::UnavailableError(absl::StrCat("attach socket: ", std::strerror(errno)));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, server->path_.data(), server->path_.size());
  if (::bind(server->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(server->listen_fd_, 64) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on the attach socket ", server->path_,
                                               ": ", std::strerror(errno)));
  }
  if (::pipe2(server->wake_, O_CLOEXEC) != 0) {
    return absl::UnavailableError(absl::StrCat("attach socket pipe: ", std::strerror(errno)));
  }
  AttachFdServer* self = server.get();
  server->thread_ = std::thread([self] { self->Run(); });
  return server;
}

AttachFdServer::~AttachFdServer() {
  Stop();
  if (wake_[0] >= 0) ::close(wake_[0]);
  if (wake_[1] >= 0) ::close(wake_[1]);
}

void AttachFdServer::Stop() {
  if (thread_.joinable()) {
    const char byte = 'x';
    (void)!::write(wake_[1], &byte, 1);
    thread_.join();
  }
  // The wake byte stays unread: every connection's poll sees it.
  for (Connection& c : connections_) c.thread.join();
  connections_.clear();
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
    ::unlink(path_.c_str());
  }
}

size_t AttachFdServer::ReapConnections() {
  size_t kept = 0;
  for (size_t i = 0; i < connections_.size(); ++i) {
    if (connections_[i].done->load()) {
      connections_[i].thread.join();
    } else {
      // (Moving a running thread onto itself would terminate.)
      if (i != kept) connections_[kept] = std::move(connections_[i]);
      ++kept;
    }
  }
  connections_.resize(kept);
  return kept;
}

void AttachFdServer::Run() {
  absl::Time warned = absl::InfinitePast();  // the last accept failure logged
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    int conn = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // Out of descriptors or memory: the pending peer stays queued and
        // the socket stays readable, so polling again at once would spin.
        // Wait a little (or for Stop) before trying again.
        if (absl::Now() - warned > absl::Seconds(10)) {
          warned = absl::Now();
          REFIT_LOG(WARNING) << "attach socket: cannot accept: " << std::strerror(errno);
        }
        pollfd wake = {wake_[0], POLLIN, 0};
        if (::poll(&wake, 1, kAcceptBackoffMs) > 0) return;
      }
      continue;
    }
    if (ReapConnections() >= static_cast<size_t>(kMaxConnections)) {
      Refuse(conn, "Etoo many attach connections at once; retry\n");
      continue;
    }
    // The peer's process, or (pid 0: a process in another PID namespace,
    // as engines in other pods are) its uid, with a share of its own.
    ucred cred{};
    socklen_t cred_len = sizeof(cred);
    if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0) {
      cred = ucred{0, static_cast<uid_t>(-1), static_cast<gid_t>(-1)};
    }
    int pid = cred.pid;
    uint32_t uid = cred.uid;
    if (auto* hook = g_peer_hook.load(); hook != nullptr) hook(conn, &pid, &uid);
    const auto same_peer = [&](const Connection& c) {
      return pid > 0 ? c.pid == pid : c.pid <= 0 && c.uid == uid;
    };
    const int share = pid > 0 ? kMaxConnectionsPerProcess : kMaxConnectionsPerUnseenUid;
    if (std::count_if(connections_.begin(), connections_.end(), same_peer) >= share) {
      Refuse(conn, pid > 0 ? absl::StrCat("Etoo many attach connections from process ", pid,
                                          " at once; retry\n")
                           : absl::StrCat("Etoo many attach connections from uid ", uid,
                                          " in another PID namespace at once; retry\n"));
      continue;
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::thread thread;
    try {
      thread = std::thread([this, conn, done] {
        Serve(conn);
        ::close(conn);
        done->store(true);
      });
    } catch (const std::system_error& e) {
      // Out of threads (a process limit): this peer is refused, the
      // daemon goes on.
      REFIT_LOG(WARNING) << "attach socket: no thread for a connection: " << e.what();
      Refuse(conn, "Erefitd cannot serve this connection now (no thread); retry\n");
      continue;
    }
    connections_.push_back(Connection{std::move(thread), std::move(done), pid, uid});
  }
}

bool AttachFdServer::ReadTicket(int conn, std::string* ticket, int* received, bool* lost,
                                std::string* why) {
  *received = -1;
  *lost = false;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(kTicketTimeoutMs);
  char buf[128];
  while (ticket->find('\n') == std::string::npos) {
    if (ticket->size() >= kMaxTicketBytes) {
      *why = "ticket too long";
      break;
    }
    const auto left =
        std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      *why = absl::StrCat("no ticket line within ", kTicketTimeoutMs, " ms");
      break;
    }
    pollfd fds[2] = {{conn, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    const int ready = ::poll(fds, 2, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0 || fds[1].revents != 0) break;  // Stop: no answer
    if (ready == 0) continue;                     // the deadline, checked above
    std::vector<int> passed;                      // (none when n < 0: errno is recvmsg's)
    const ssize_t n = ReceiveWithDescriptors(conn, buf, sizeof(buf), MSG_DONTWAIT, &passed, lost);
    for (int fd : passed) {
      if (*received < 0) {
        *received = fd;
      } else {
        ::close(fd);  // one descriptor per ticket
      }
    }
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (n <= 0) break;  // closed
    ticket->append(buf, static_cast<size_t>(n));
  }
  const size_t newline = ticket->find('\n');
  if (newline == std::string::npos) {
    if (*received >= 0) ::close(*received);
    *received = -1;
    return false;
  }
  ticket->resize(newline);
  return true;
}

void AttachFdServer::Serve(int conn) {
  timeval timeout{1, 0};
  ::setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  std::string ticket;
  int received = -1;  // a descriptor the peer sent (a region's), kept until handed on
  bool lost = false;  // descriptors the peer sent that the kernel dropped
  std::string why;
  if (!ReadTicket(conn, &ticket, &received, &lost, &why)) {
    if (!why.empty()) {
      SendAll(conn, absl::StrCat("E", why, "\n"));
      DrainInput(conn);  // a long ticket's rest: the peer reads the answer
    }
    return;
  }
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    if (received >= 0) ::close(received);
    SendAll(conn, "Eno peer credentials\n");
    return;
  }
  if (received >= 0 || absl::StartsWith(ticket, kRegionTicketPrefix)) {
    if (deposit_ == nullptr) {
      if (received >= 0) ::close(received);
      SendAll(conn, "Ethis socket takes no descriptors\n");
      return;
    }
    absl::StatusOr<int> fd = received;
    if (received < 0 && lost) {
      fd = absl::ResourceExhaustedError(
          "the region's descriptor was lost on the way: refitd is out of file descriptors "
          "(raise its limit, or register fewer regions)");
    } else if (received < 0) {
      fd = absl::InvalidArgumentError(
          "the region ticket came without its descriptor (send the memfd with SCM_RIGHTS, on "
          "the same message as the ticket)");
    }
    absl::Status deposited = deposit_(ticket, std::move(fd), cred.pid, cred.uid);
    SendAll(conn,
            deposited.ok() ? std::string("K\n") : absl::StrCat("E", deposited.message(), "\n"));
    return;
  }
  absl::StatusOr<std::vector<int>> fds = redeem_(ticket, cred.pid, cred.uid);
  if (fds.ok() && (fds->empty() || fds->size() > static_cast<size_t>(kMaxDescriptors))) {
    for (int fd : *fds) ::close(fd);
    fds = absl::InternalError(absl::StrCat(fds->size(), " descriptors to send"));
  }
  if (!fds.ok()) {
    REFIT_LOG(WARNING).Field("pid", absl::StrCat(cred.pid)).Field("uid", absl::StrCat(cred.uid))
        << "attach descriptor refused: " << std::string(fds.status().message());
    SendAll(conn, absl::StrCat("E", fds.status().message(), "\n"));
    return;
  }
  char ok = 'K';
  iovec iov{&ok, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxDescriptors)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds->size());
  cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds->size());
  std::memcpy(CMSG_DATA(cmsg), fds->data(), sizeof(int) * fds->size());
  if (::sendmsg(conn, &msg, MSG_NOSIGNAL) != 1) {
    REFIT_LOG(WARNING).Field("pid", absl::StrCat(cred.pid))
        << "attach descriptor not delivered: " << std::strerror(errno);
  }
  for (int fd : *fds) ::close(fd);
}

}  // namespace refit::server
