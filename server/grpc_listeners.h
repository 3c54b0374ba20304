// refitd's own listening sockets for its gRPC server.
//
// gRPC's listener stops accepting on a socket for good once accept4 fails
// with EMFILE or ENFILE (the process or the host out of descriptors, e.g.
// while a local peer holds thousands of connections open): the daemon keeps
// running, but nobody can connect to it again. refitd therefore listens on
// its --listen addresses itself and hands every accepted connection to gRPC
// (ServerBuilder's external connection acceptor); gRPC then runs the
// connection (TLS included) as one it accepted.
//
// Out of descriptors, the accept thread closes a descriptor it keeps spare,
// accepts the waiting connection, closes it at once (its client sees the
// connection close instead of hanging in the backlog) and takes the spare
// back: the listener never stops, and accepts again as soon as descriptors
// are free.
#ifndef REFIT_SERVER_GRPC_LISTENERS_H_
#define REFIT_SERVER_GRPC_LISTENERS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace grpc::experimental {
class ExternalConnectionAcceptor;
}  // namespace grpc::experimental

namespace refit::server {

class GrpcListeners {
 public:
  // Binds and listens on every address: unix:PATH (unix:///abs too; a stale
  // socket file is replaced, one a live process listens on is refused),
  // unix-abstract:NAME, host:port and [ipv6]:port (every address the host
  // resolves to; 0.0.0.0 and [::] listen on both IPv4 and IPv6 where the
  // host has IPv6; port 0 picks one port for them all).
  static absl::StatusOr<std::unique_ptr<GrpcListeners>> Bind(
      const std::vector<std::string>& addresses);
  ~GrpcListeners();

  GrpcListeners(const GrpcListeners&) = delete;
  GrpcListeners& operator=(const GrpcListeners&) = delete;

  // Each address as bound: port 0 replaced by the port chosen.
  const std::vector<std::string>& bound() const { return bound_; }

  // Starts accepting: every connection goes to `acceptor`, whose server must
  // have started.
  void Start(std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor);
  // Stops accepting and closes the listening sockets (new connections are
  // refused; unix: socket files are removed). Call before the gRPC server
  // shuts down. Idempotent.
  void Stop();

  // Connections closed at once because the process was out of descriptors.
  int64_t refused_for_descriptors() const {
    return refused_for_descriptors_.load(std::memory_order_relaxed);
  }

  // Tests: the next time it is out of descriptors, the accept thread gives
  // up its spare descriptor and does not get it back there (as when another
  // thread takes the descriptor it freed).
  void LoseSpareNextTimeForTesting() { drop_spare_for_testing_.store(true); }

 private:
  struct Socket {
    int fd = -1;
    std::string unix_path;  // a unix: socket file, removed by Stop
    uint64_t unix_inode = 0;
  };
  // The advisory lock (flock) on "<socket path>.lock", held while the
  // socket listens: of two processes that find the same stale socket file,
  // only the holder replaces it. Removed and released by Stop.
  struct PathLock {
    int fd = -1;
    std::string path;
    uint64_t dev = 0;
    uint64_t inode = 0;
  };

  GrpcListeners() = default;
  void Run();
  // Accepts what waits on `fd`, up to a bound (poll comes back for more).
  void AcceptAll(int fd);

  std::vector<Socket> sockets_;
  std::vector<PathLock> locks_;
  std::vector<std::string> bound_;
  int wake_fd_ = -1;   // an eventfd: Stop wakes the accept thread with it
  int spare_fd_ = -1;  // given up to accept (and close) when out of descriptors
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> refused_for_descriptors_{0};
  std::atomic<bool> drop_spare_for_testing_{false};
  // Logged once per streak; the accept thread's alone.
  bool out_of_descriptors_ = false;
  absl::Time last_out_of_descriptors_;
};

}  // namespace refit::server

#endif  // REFIT_SERVER_GRPC_LISTENERS_H_
