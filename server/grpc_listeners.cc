#include "server/grpc_listeners.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <utility>

#include <grpcpp/server_builder.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/log.h"
#include "server/server_options.h"

namespace refit::server {
namespace {

// The kernel caps it at net.core.somaxconn.
constexpr int kBacklog = 4096;

absl::Status ListenError(absl::string_view address, absl::string_view what, int err) {
  return absl::UnavailableError(
      absl::StrCat("cannot listen on ", address, ": ", what, ": ", std::strerror(err)));
}

int ListenOn(int fd, const sockaddr* addr, socklen_t len) {
  if (::bind(fd, addr, len) != 0 || ::listen(fd, kBacklog) != 0) return errno;
  return 0;
}

// Takes the lock beside `path`; FAILED_PRECONDITION when another open
// file holds it (another process, or another listener here, serves it).
absl::Status LockSocketPath(absl::string_view address, const std::string& path, int* fd,
                            uint64_t* dev, uint64_t* inode) {
  const std::string lock_path = path + ".lock";
  // A holder that stops removes the file as it releases the lock: a lock
  // taken on a file no longer at the path is taken again on the new one.
  for (int attempt = 0; attempt < 16; ++attempt) {
    const int lock = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (lock < 0) return ListenError(address, absl::StrCat("open ", lock_path), errno);
    if (::flock(lock, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      ::close(lock);
      if (err == EWOULDBLOCK) {
        return absl::FailedPreconditionError(absl::StrCat("cannot listen on ", address,
                                                          ": another process listens on ", path,
                                                          " (it holds ", lock_path, ")"));
      }
      return ListenError(address, absl::StrCat("flock ", lock_path), err);
    }
    struct stat held, now;
    if (::fstat(lock, &held) == 0 && ::stat(lock_path.c_str(), &now) == 0 &&
        held.st_dev == now.st_dev && held.st_ino == now.st_ino) {
      *fd = lock;
      *dev = held.st_dev;
      *inode = held.st_ino;
      return absl::OkStatus();
    }
    ::close(lock);
  }
  return absl::UnavailableError(absl::StrCat("cannot listen on ", address, ": ", lock_path,
                                             " kept being replaced while it was locked"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcListeners>> GrpcListeners::Bind(
    const std::vector<std::string>& addresses) {
  std::unique_ptr<GrpcListeners> self(new GrpcListeners());
  auto take = [&](int fd) {
    Socket& s = self->sockets_.emplace_back();
    s.fd = fd;
    return &s;
  };
  for (const std::string& address : addresses) {
    if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:")) {
      absl::StatusOr<UnixSocketAddress> a = ParseUnixSocketAddress(address);
      if (!a.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("cannot listen on ", address, ": ", a.status().message()));
      }
      const sockaddr* sa = reinterpret_cast<const sockaddr*>(&a->sun);
      for (const Socket& earlier : self->sockets_) {
        if (!a->path.empty() && earlier.unix_path == a->path) {
          return absl::InvalidArgumentError(
              absl::StrCat("cannot listen on ", address, ": listed twice"));
        }
      }
      if (!a->path.empty()) {
        PathLock& lock = self->locks_.emplace_back();
        lock.path = a->path + ".lock";
        if (absl::Status s = LockSocketPath(address, a->path, &lock.fd, &lock.dev, &lock.inode);
            !s.ok()) {
          self->locks_.pop_back();
          return s;
        }
        // A socket file left by a process that is gone (connecting to it is
        // refused) is replaced, under the lock. Anything else is not taken from its owner: a
        // live listener, a socket of another kind (a datagram socket answers
        // EPROTOTYPE), one this process may not connect to, a file that is
        // not a socket.
        struct stat st;
        if (::lstat(a->path.c_str(), &st) == 0) {
          if (!S_ISSOCK(st.st_mode)) {
            return absl::FailedPreconditionError(absl::StrCat(
                "cannot listen on ", address, ": ", a->path, " exists and is not a socket"));
          }
          const int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
          if (probe < 0) return ListenError(address, "socket", errno);
          const int err = ::connect(probe, sa, a->len) == 0 ? 0 : errno;
          ::close(probe);
          if (err == 0 || err == EAGAIN) {
            return absl::FailedPreconditionError(absl::StrCat(
                "cannot listen on ", address, ": another process listens on ", a->path));
          }
          if (err != ECONNREFUSED && err != ENOENT) {
            return absl::FailedPreconditionError(
                absl::StrCat("cannot listen on ", address, ": ", a->path,
                             " is a socket in use or not ours to replace (connecting to it: ",
                             std::strerror(err), ")"));
          }
          ::unlink(a->path.c_str());
        }
      }
      const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) return ListenError(address, "socket", errno);
      Socket* s = take(fd);
      if (const int err = ListenOn(fd, sa, a->len); err != 0) {
        return ListenError(address, "bind", err);
      }
      struct stat st;
      if (!a->path.empty() && ::stat(a->path.c_str(), &st) == 0) {
        s->unix_path = a->path;
        s->unix_inode = st.st_ino;
      }
      self->bound_.push_back(address);
      continue;
    }
    absl::string_view host, port_text;
    if (!SplitHostPort(address, &host, &port_text)) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot listen on ", address, ": expected host:port or [ipv6]:port"));
    }
    // A wildcard listens on IPv6 and IPv4 alike (one dual-stack socket), or
    // on IPv4 alone where the host has no IPv6; a name on every address it
    // resolves to.
    const bool wildcard = host.empty() || host == "0.0.0.0" || host == "::";
    std::vector<sockaddr_storage> candidates;
    if (wildcard) {
      sockaddr_storage any6{}, any4{};
      any6.ss_family = AF_INET6;
      reinterpret_cast<sockaddr_in6*>(&any6)->sin6_addr = in6addr_any;
      any4.ss_family = AF_INET;
      reinterpret_cast<sockaddr_in*>(&any4)->sin_addr.s_addr = htonl(INADDR_ANY);
      candidates = {any6, any4};
    } else {
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      hints.ai_flags = AI_PASSIVE;
      addrinfo* found = nullptr;
      const int rc = ::getaddrinfo(std::string(host).c_str(), nullptr, &hints, &found);
      if (rc != 0 || found == nullptr) {
        return absl::UnavailableError(absl::StrCat(
            "cannot listen on ", address, ": cannot resolve \"", host, "\": ", ::gai_strerror(rc)));
      }
      for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
        sockaddr_storage ss{};
        std::memcpy(&ss, ai->ai_addr, std::min<size_t>(ai->ai_addrlen, sizeof(ss)));
        candidates.push_back(ss);
      }
      ::freeaddrinfo(found);
    }
    int port = 0;
    if (!absl::SimpleAtoi(port_text, &port) || port < 0 || port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("cannot listen on ", address, ": port \"",
                                                     port_text, "\" is not in 0..65535"));
    }
    const int requested_port = port;
    int listening = 0, last_err = 0;
    std::string last_what;
    for (sockaddr_storage& ss : candidates) {
      const bool v6 = ss.ss_family == AF_INET6;
      if (v6) {
        reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port = htons(port);
      } else {
        reinterpret_cast<sockaddr_in*>(&ss)->sin_port = htons(port);
      }
      const int fd = ::socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) {
        last_err = errno;
        last_what = "socket";
        continue;
      }
      const int one = 1, zero = 0;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      // Accepted connections inherit it: gRPC's frames go out unbatched.
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      // The IPv6 wildcard takes IPv4 too (unless the host forbids it: then
      // the IPv4 wildcard is bound beside it); a named IPv6 address only
      // itself, so that the name's IPv4 address can be bound beside it.
      bool dual_stack = false;
      if (v6) {
        dual_stack =
            wildcard && ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero)) == 0;
        if (!wildcard) ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
      }
      const socklen_t len = v6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
      if (const int err = ListenOn(fd, reinterpret_cast<sockaddr*>(&ss), len); err != 0) {
        ::close(fd);
        // The IPv6 wildcard gives way to the IPv4 one only where the host
        // has no IPv6, not where the port is taken.
        if (wildcard && v6 && err != EADDRNOTAVAIL && err != EAFNOSUPPORT) {
          return ListenError(address, "bind", err);
        }
        last_err = err;
        last_what = "bind";
        continue;
      }
      take(fd);
      ++listening;
      if (port == 0) {  // the port chosen, for the other addresses too
        sockaddr_storage got{};
        socklen_t got_len = sizeof(got);
        if (::getsockname(fd, reinterpret_cast<sockaddr*>(&got), &got_len) == 0) {
          port = got.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&got)->sin6_port)
                                           : ntohs(reinterpret_cast<sockaddr_in*>(&got)->sin_port);
        }
      }
      if (wildcard && (dual_stack || !v6)) break;
    }
    if (listening == 0) return ListenError(address, last_what, last_err);
    if (last_err != 0 && !wildcard) {
      REFIT_LOG(WARNING).Field("address", address)
          << "listening on some of the addresses \"" << host << "\" resolves to; " << last_what
          << ": " << std::strerror(last_err);
    }
    // Port 0 (however written) is replaced by the port chosen.
    self->bound_.push_back(
        requested_port == 0
            ? absl::StrCat(address.substr(0, address.size() - port_text.size()), port)
            : address);
  }
  self->wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (self->wake_fd_ < 0) return ListenError("the gRPC addresses", "eventfd", errno);
  self->spare_fd_ = ::eventfd(0, EFD_CLOEXEC);
  return self;
}

GrpcListeners::~GrpcListeners() {
  Stop();
  if (wake_fd_ >= 0) ::close(wake_fd_);
  if (spare_fd_ >= 0) ::close(spare_fd_);
}

void GrpcListeners::Start(
    std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor) {
  if (thread_.joinable() || stopping_.load()) return;
  acceptor_ = std::move(acceptor);
  thread_ = std::thread([this] { Run(); });
}

void GrpcListeners::Stop() {
  if (stopping_.exchange(true)) return;
  if (thread_.joinable()) {
    const uint64_t one = 1;
    while (::write(wake_fd_, &one, sizeof(one)) < 0 && errno == EINTR) {
    }
    thread_.join();
  }
  for (Socket& s : sockets_) {
    ::close(s.fd);
    // Only the file this listener made: a successor may have replaced it.
    struct stat st;
    if (!s.unix_path.empty() && ::stat(s.unix_path.c_str(), &st) == 0 &&
        st.st_ino == s.unix_inode) {
      ::unlink(s.unix_path.c_str());
    }
  }
  sockets_.clear();
  // Removed while still held, so that no one takes a lock on a file that
  // is no longer at the path (LockSocketPath checks).
  for (PathLock& lock : locks_) {
    struct stat st;
    if (::stat(lock.path.c_str(), &st) == 0 && st.st_dev == lock.dev && st.st_ino == lock.inode) {
      ::unlink(lock.path.c_str());
    }
    ::close(lock.fd);
  }
  locks_.clear();
}

void GrpcListeners::Run() {
  std::vector<pollfd> fds;
  for (const Socket& s : sockets_) fds.push_back({s.fd, POLLIN, 0});
  fds.push_back({wake_fd_, POLLIN, 0});
  while (!stopping_.load()) {
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno != EINTR) absl::SleepFor(absl::Milliseconds(10));
      continue;
    }
    if (fds.back().revents != 0) return;
    for (size_t i = 0; i + 1 < fds.size(); ++i) {
      if (fds[i].revents != 0) AcceptAll(fds[i].fd);
    }
  }
}

void GrpcListeners::AcceptAll(int fd) {
  // Bounded, so that a stream of connections on one socket does not keep
  // the others (or Stop) waiting.
  for (int round = 0; round < 64; ++round) {
    // Lost when another thread took the descriptor it freed: taken back as
    // soon as one is free, or the next flood would find none to give up.
    if (spare_fd_ < 0) spare_fd_ = ::eventfd(0, EFD_CLOEXEC);
    const int conn = ::accept4(fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (conn >= 0) {
      // Reset by its client already: gRPC would log its getpeername failing.
      sockaddr_storage peer;
      socklen_t peer_len = sizeof(peer);
      if (::getpeername(conn, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) {
        ::close(conn);
        continue;
      }
      // Over once a second passed without EMFILE: a connection accepted in
      // between (with a descriptor freed for a moment) does not end it, so
      // that a long flood logs one line, not two per accept.
      if (out_of_descriptors_ && absl::Now() - last_out_of_descriptors_ >= absl::Seconds(1)) {
        out_of_descriptors_ = false;
        REFIT_LOG(INFO) << "descriptors free again: accepting connections ("
                        << refused_for_descriptors() << " closed at once so far)";
      }
      grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters p;
      p.listener_fd = fd;
      p.fd = conn;  // gRPC's from here on
      acceptor_->HandleNewConnection(&p);
      continue;
    }
    const int err = errno;
    if (err == EAGAIN || err == EWOULDBLOCK) return;
    if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
    if (err != EMFILE && err != ENFILE) {
      // ENOBUFS, ENOMEM: the kernel is short of memory; try again shortly.
      REFIT_LOG(WARNING) << "accept: " << std::strerror(err);
      absl::SleepFor(absl::Milliseconds(10));
      return;
    }
    // Out of descriptors: the spare one makes room to take the connection
    // off the backlog and close it, so that its client is told at once.
    last_out_of_descriptors_ = absl::Now();
    if (!out_of_descriptors_) {
      out_of_descriptors_ = true;
      REFIT_LOG(WARNING) << "accept: " << std::strerror(err)
                         << ": closing new connections at once until descriptors are free "
                            "(a local peer holding many connections open?)";
    }
    if (spare_fd_ >= 0) ::close(spare_fd_);
    spare_fd_ = -1;
    if (drop_spare_for_testing_.exchange(false)) {
      // The test's stand-in for another thread taking the freed descriptor.
      absl::SleepFor(absl::Milliseconds(10));
      return;
    }
    const int refused = ::accept4(fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (refused >= 0) {
      ::close(refused);
      refused_for_descriptors_.fetch_add(1, std::memory_order_relaxed);
    }
    spare_fd_ = ::eventfd(0, EFD_CLOEXEC);
    // Another thread took the descriptor first: wait rather than spin.
    if (refused < 0 || spare_fd_ < 0) {
      absl::SleepFor(absl::Milliseconds(10));
      return;
    }
  }
}

}  // namespace refit::server
