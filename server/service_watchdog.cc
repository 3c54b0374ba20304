#include "server/service_watchdog.h"

#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/log.h"
#include "openssl/bio.h"
#include "openssl/err.h"
#include "openssl/ssl.h"
#include "server/server_options.h"

namespace refit::server {
namespace {

// What an HTTP/2 client sends first: the connection preface and an empty
// SETTINGS frame. A gRPC server that accepted the connection answers with
// its own SETTINGS.
constexpr char kPreface[] =
    "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    "\x00\x00\x00\x04\x00\x00\x00\x00\x00";
constexpr size_t kPrefaceBytes = sizeof(kPreface) - 1;

// What a TLS client sends first: a ClientHello (offering "h2", as gRPC
// clients do), made fresh by OpenSSL into memory. A TLS listener answers
// with its ServerHello; the probe then closes, which the server takes for a
// client that went away mid-handshake, with no error logged (the HTTP/2
// preface instead would be logged as a failed handshake every round).
absl::StatusOr<std::string> TlsClientHello() {
  SSL_CTX* ctx = ::SSL_CTX_new(::TLS_client_method());
  if (ctx == nullptr) return absl::InternalError("TLS probe: SSL_CTX_new failed");
  std::string hello;
  SSL* ssl = ::SSL_new(ctx);
  BIO* in = ::BIO_new(::BIO_s_mem());
  BIO* out = ::BIO_new(::BIO_s_mem());
  static constexpr unsigned char kAlpn[] = {2, 'h', '2'};
  if (ssl != nullptr && in != nullptr && out != nullptr) {
    ::SSL_set_bio(ssl, in, out);  // ssl owns both from here
    in = out = nullptr;
    ::SSL_set_alpn_protos(ssl, kAlpn, sizeof(kAlpn));
    ::SSL_set_connect_state(ssl);
    ::SSL_do_handshake(ssl);  // writes the ClientHello, then wants to read
    char* data = nullptr;
    const long n = BIO_get_mem_data(::SSL_get_wbio(ssl), &data);
    if (n > 0 && data != nullptr) hello.assign(data, static_cast<size_t>(n));
  }
  ::BIO_free(in);
  ::BIO_free(out);
  ::SSL_free(ssl);
  ::SSL_CTX_free(ctx);
  ::ERR_clear_error();  // this thread's queue: nothing for gRPC to find later
  if (hello.empty()) return absl::InternalError("TLS probe: OpenSSL wrote no ClientHello");
  return hello;
}

int MillisecondsUntil(absl::Time deadline) {
  const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
  return ms <= 0 ? 0 : static_cast<int>(std::min<int64_t>(ms, 60 * 1000));
}

// Closes the descriptor when it goes out of scope.
struct Socket {
  int fd = -1;
  ~Socket() {
    if (fd >= 0) ::close(fd);
  }
};

// Connects `s` (non-blocking) to `address`, and sends `greeting`; then
// waits for any answer or a close. `*connected` tells whether the connect
// itself went through (then a failure is the listener's, not the address's).
absl::Status ConnectAndHear(Socket& s, const sockaddr* address, socklen_t length,
                            absl::string_view name, absl::string_view greeting, absl::Time deadline,
                            bool* connected) {
  *connected = false;
  if (::connect(s.fd, address, length) != 0 && errno != EINPROGRESS) {
    return absl::UnavailableError(
        absl::StrCat("listener ", name, ": connect: ", std::strerror(errno)));
  }
  pollfd p{s.fd, POLLOUT, 0};
  if (::poll(&p, 1, MillisecondsUntil(deadline)) <= 0) {
    return absl::UnavailableError(absl::StrCat("listener ", name, ": connect timed out"));
  }
  int error = 0;
  socklen_t error_length = sizeof(error);
  ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &error, &error_length);
  if (error != 0) {
    return absl::UnavailableError(
        absl::StrCat("listener ", name, ": connect: ", std::strerror(error)));
  }
  *connected = true;
  // All of it: a TLS server answers only a whole ClientHello.
  for (size_t sent = 0; sent < greeting.size();) {
    const ssize_t n = ::send(s.fd, greeting.data() + sent, greeting.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (n < 0 && errno == EAGAIN) {
      p = pollfd{s.fd, POLLOUT, 0};
      if (::poll(&p, 1, MillisecondsUntil(deadline)) <= 0) {
        return absl::UnavailableError(absl::StrCat(
            "listener ", name, ": the connection was not accepted (its greeting did not fit)"));
      }
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      return absl::OkStatus();  // reset at once: something accepted and refused it
    }
  }
  p = pollfd{s.fd, POLLIN, 0};
  if (::poll(&p, 1, MillisecondsUntil(deadline)) <= 0) {
    return absl::UnavailableError(absl::StrCat(
        "listener ", name, ": the connection was not accepted (no answer to a new connection)"));
  }
  return absl::OkStatus();  // bytes, a close or a reset: the server took the connection
}

}  // namespace

std::optional<absl::Duration> WatchdogTimeoutFromEnvironment() {
  const char* usec = std::getenv("WATCHDOG_USEC");
  uint64_t micros = 0;
  if (usec == nullptr || !absl::SimpleAtoi(usec, &micros) || micros == 0) return std::nullopt;
  if (const char* pid = std::getenv("WATCHDOG_PID"); pid != nullptr && *pid != '\0') {
    int64_t watched = 0;
    if (!absl::SimpleAtoi(pid, &watched) || watched != ::getpid()) return std::nullopt;
  }
  return absl::Microseconds(static_cast<int64_t>(micros));
}

absl::Status ProbeListener(absl::string_view address, absl::Time deadline, bool tls) {
  std::string greeting(kPreface, kPrefaceBytes);
  if (tls) {
    absl::StatusOr<std::string> hello = TlsClientHello();
    if (!hello.ok()) return hello.status();
    greeting = *std::move(hello);
  }
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:")) {
    absl::StatusOr<UnixSocketAddress> un = ParseUnixSocketAddress(address);
    if (!un.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("listener ", address, ": ", un.status().message()));
    }
    Socket s{::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)};
    if (s.fd < 0) {
      return absl::UnavailableError(
          absl::StrCat("listener ", address, ": socket: ", std::strerror(errno)));
    }
    bool connected = false;
    return ConnectAndHear(s, reinterpret_cast<const sockaddr*>(&un->sun), un->len, address,
                          greeting, deadline, &connected);
  }
  // The hosts to try, in order: an IPv6 wildcard listener serves IPv4 too
  // (dual stack), and a host may have no IPv6 loopback.
  absl::string_view host, port_text;
  if (!SplitHostPort(address, &host, &port_text)) {
    return absl::InvalidArgumentError(absl::StrCat("listener ", address, ": bad address"));
  }
  const std::string port(port_text);
  std::vector<std::string> hosts = {std::string(host)};
  if (absl::StartsWith(address, "[")) {
    if (host == "::" || host.empty()) hosts = {"::1", "127.0.0.1"};
  } else if (host == "0.0.0.0" || host.empty()) {
    hosts = {"127.0.0.1"};
  }
  absl::Status status = absl::UnavailableError(absl::StrCat("listener ", address, ": no address"));
  for (const std::string& candidate : hosts) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (const int rc = ::getaddrinfo(candidate.c_str(), port.c_str(), &hints, &found); rc != 0) {
      status = absl::UnavailableError(absl::StrCat("listener ", address, ": cannot resolve ",
                                                   candidate, ": ", ::gai_strerror(rc)));
      continue;
    }
    bool connected = false;
    for (addrinfo* a = found; a != nullptr && !connected; a = a->ai_next) {
      Socket s{::socket(a->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)};
      if (s.fd < 0) {
        status = absl::UnavailableError(
            absl::StrCat("listener ", address, ": socket: ", std::strerror(errno)));
        continue;
      }
      status =
          ConnectAndHear(s, a->ai_addr, a->ai_addrlen, address, greeting, deadline, &connected);
      if (status.ok()) break;
    }
    ::freeaddrinfo(found);
    // Answered, or reached and silent: either way the listener's verdict.
    if (status.ok() || connected) break;
  }
  return status;
}

ServiceWatchdog::ServiceWatchdog(absl::Duration timeout, Probe probe, Notify notify)
    : interval_(timeout / 3), probe_(std::move(probe)), notify_(std::move(notify)) {}

ServiceWatchdog::~ServiceWatchdog() { Stop(); }

void ServiceWatchdog::Start() {
  absl::MutexLock lock(&mu_);
  if (stopping_ || thread_.joinable()) return;
  thread_ = std::thread([this] { Run(); });
}

void ServiceWatchdog::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

ServiceWatchdog::Probe ServiceWatchdog::ProbeAll(std::vector<std::string> addresses, bool tls) {
  return [addresses = std::move(addresses), tls](absl::Time deadline) {
    for (const std::string& address : addresses) {
      if (absl::Status s = ProbeListener(address, deadline, tls); !s.ok()) return s;
    }
    return absl::OkStatus();
  };
}

void ServiceWatchdog::Run() {
  // The reasons logged since every listener last answered: each once, so
  // two listeners failing in turn do not log every round. Bounded, as the
  // reasons carry errno texts and addresses.
  absl::flat_hash_set<std::string> logged;
  constexpr size_t kMaxLoggedReasons = 16;
  // A descriptor kept for the probe and the ping, given up for each round: a
  // process out of descriptors (a local peer holding connections open) can
  // still probe its listeners, which close what they have no room for and so
  // still answer, and still ping. Without it the pings would stop, and
  // systemd restart refitd, only because the probe (or sd_notify) could not
  // open its own socket.
  struct Reserve {
    int fd = ::eventfd(0, EFD_CLOEXEC);
    ~Reserve() { Release(); }
    void Release() {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
  } reserve;
  for (;;) {
    const absl::Time round = absl::Now();
    reserve.Release();  // for the probe, and for the ping's own socket
    const absl::Status alive = probe_(round + interval_);
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
    }
    if (alive.ok()) {
      if (!logged.empty()) REFIT_LOG(INFO) << "watchdog: every listener answers again";
      logged.clear();
      notify_("WATCHDOG=1");
    } else if (logged.size() < kMaxLoggedReasons && logged.emplace(alive.message()).second) {
      REFIT_LOG(ERROR) << "watchdog: " << alive.message()
                       << "; not pinging the service manager, which restarts refitd once "
                          "WatchdogSec passes without a ping";
    }
    reserve.fd = ::eventfd(0, EFD_CLOEXEC);
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithDeadline(absl::Condition(&stopping_), round + interval_);
    if (stopping_) return;
  }
}

}  // namespace refit::server
