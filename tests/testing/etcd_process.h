// EtcdProcess: a real etcd (Debian's etcd-server) for tests, in a temporary
// data directory on loopback ports, started and waited for (a Range that
// answers, bounded), stopped (SIGKILL) in the destructor. Stop() and
// Restart() let fault tests take etcd away mid-refit and bring it back with
// its data.
//
// Tests skip (GTEST_SKIP) when no etcd binary is installed: EtcdBinary()
// returns "" then. scripts/setup.sh installs it, so CI always has it.
#ifndef REFIT_TESTS_TESTING_ETCD_PROCESS_H_
#define REFIT_TESTS_TESTING_ETCD_PROCESS_H_

#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/etcd_client.h"
#include "tests/testing/temp_dir.h"

namespace refit::testing {

// $ETCD_BIN, else etcd on the usual paths; "" when there is none.
inline std::string EtcdBinary() {
  if (const char* bin = std::getenv("ETCD_BIN"); bin != nullptr && *bin != '\0') return bin;
  for (const char* path : {"/usr/bin/etcd", "/usr/local/bin/etcd"}) {
    if (::access(path, X_OK) == 0) return path;
  }
  return "";
}

// A loopback port that was free a moment ago (bound to 0, then closed).
inline int PickFreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return 0;
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

// TLS on etcd's client port (PEM files); empty cert: plaintext.
struct EtcdTls {
  std::string cert_file;  // etcd --cert-file
  std::string key_file;   // etcd --key-file
  std::string ca_file;    // the CA that signed cert_file (the probe trusts it)
  // etcd --client-cert-auth --trusted-ca-file=ca_file, with this client
  // certificate for the probe.
  bool client_cert_auth = false;
  std::string client_cert_file;
  std::string client_key_file;
};

class EtcdProcess {
 public:
  // Starts etcd under `dir` (created) and waits until it answers.
  static absl::StatusOr<std::unique_ptr<EtcdProcess>> Start(const std::string& dir,
                                                            EtcdTls tls = {}) {
    std::unique_ptr<EtcdProcess> etcd(new EtcdProcess());
    etcd->dir_ = dir;
    etcd->tls_ = std::move(tls);
    ::mkdir(dir.c_str(), 0755);  // EEXIST is fine
    etcd->client_port_ = PickFreePort();
    etcd->peer_port_ = PickFreePort();
    if (absl::Status s = etcd->Launch(); !s.ok()) return s;
    return etcd;
  }
  ~EtcdProcess() { Stop(); }
  EtcdProcess(const EtcdProcess&) = delete;
  EtcdProcess& operator=(const EtcdProcess&) = delete;

  // "127.0.0.1:PORT" ("https://127.0.0.1:PORT" with TLS), what --etcd
  // takes.
  std::string endpoint() const {
    return absl::StrCat(tls_.cert_file.empty() ? "" : "https://", "127.0.0.1:", client_port_);
  }
  pid_t pid() const { return pid_; }

  // SIGKILL and reap; idempotent.
  void Stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }
  // The same data directory and ports again.
  absl::Status Restart() {
    Stop();
    return Launch();
  }

 private:
  EtcdProcess() = default;

  absl::Status Launch() {
    const std::string bin = EtcdBinary();
    if (bin.empty()) return absl::NotFoundError("no etcd binary");
    const std::string client =
        absl::StrCat(tls_.cert_file.empty() ? "http" : "https", "://127.0.0.1:", client_port_);
    const std::string peer = absl::StrCat("http://127.0.0.1:", peer_port_);
    std::vector<std::string> argv = {
        bin, "--name=test", "--data-dir=" + dir_ + "/data", "--listen-client-urls=" + client,
        "--advertise-client-urls=" + client, "--listen-peer-urls=" + peer,
        "--initial-advertise-peer-urls=" + peer, "--initial-cluster=test=" + peer,
        // Fast elections and lease checks on one node.
        "--heartbeat-interval=20", "--election-timeout=200", "--log-outputs=stderr"};
    if (!tls_.cert_file.empty()) {
      argv.push_back("--cert-file=" + tls_.cert_file);
      argv.push_back("--key-file=" + tls_.key_file);
      if (tls_.client_cert_auth) {
        argv.push_back("--client-cert-auth");
        argv.push_back("--trusted-ca-file=" + tls_.ca_file);
      }
    }
    const std::string log = dir_ + "/etcd.log";
    pid_t pid = ::fork();
    if (pid == 0) {
      int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
      ::setenv("ETCD_UNSUPPORTED_ARCH", "arm64", 0);
      std::vector<char*> args;
      for (std::string& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      _exit(127);
    }
    if (pid < 0) return absl::InternalError("fork failed");
    pid_ = pid;
    server::EtcdClientOptions options;
    options.endpoints = {endpoint()};
    options.timeout = absl::Milliseconds(500);
    options.tls_ca_file = tls_.ca_file;
    options.tls_cert_file = tls_.client_cert_file;
    options.tls_key_file = tls_.client_key_file;
    absl::StatusOr<std::unique_ptr<server::EtcdClient>> probe = server::EtcdClient::Create(options);
    if (!probe.ok()) return probe.status();
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    absl::Status last;
    while (absl::Now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return absl::InternalError(absl::StrCat("etcd exited at start; see ", log));
      }
      absl::StatusOr<int64_t> put = (*probe)->Put("/probe", "1");
      if (put.ok()) return absl::OkStatus();
      last = put.status();
      absl::SleepFor(absl::Milliseconds(50));  // the next probe; bounded by the deadline
    }
    return absl::DeadlineExceededError(
        absl::StrCat("etcd did not answer within 20s: ", last.ToString(), "; see ", log));
  }

  std::string dir_;
  EtcdTls tls_;
  int client_port_ = 0;
  int peer_port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace refit::testing

#endif  // REFIT_TESTS_TESTING_ETCD_PROCESS_H_
