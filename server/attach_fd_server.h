// AttachFdServer: hands an attached engine the arena's descriptor.
//
// File descriptors cannot travel in gRPC messages, so Attach answers with a
// one-time ticket and the path of this Unix socket, which sits beside the
// daemon's gRPC socket (`<grpc socket>.fd`). The engine connects, sends the
// ticket and a newline, and receives one byte 'K' with the descriptors
// attached (SCM_RIGHTS): the arena's memfd opened read-only, so the engine
// can map it read-only only, and for a GPU arena shared as a virtual-memory
// allocation that allocation's descriptor (which the engine maps with
// read-only access) — or 'E' and the reason; then the connection is closed. The peer's credentials
// (SO_PEERCRED: pid, uid) go to the redeemer, which records them for the engine's status. Only a
// caller that the gRPC service authorized holds a ticket; a ticket works once, and only while its
// Attach stream is open.
//
// The other direction: a trainer registering a shared-memory region
// (server/region_service.h) sends its ticket line with the region's
// descriptor attached (SCM_RIGHTS); the server passes both to the
// depositor and answers 'K', or 'E' and the reason. A region ticket that
// arrives without its descriptor (none sent, or dropped by the kernel
// because this process is out of descriptors) goes to the depositor too,
// so that the registration fails with the reason instead of waiting.
//
// Lifecycle: Start binds and starts the accepting thread; Stop (or the
// destructor) ends it and every connection's thread, and removes the socket
// file. Connections are served at once, each on its own thread, at most
// kMaxConnections together and kMaxConnectionsPerProcess from one peer
// process, or kMaxConnectionsPerUnseenUid from the processes of one uid
// in other PID namespaces (SO_PEERCRED gives them pid 0); one more is
// answered 'E' and closed at once, so one process that holds connections
// open cannot take every slot. A peer has one second in all to send its
// ticket line, so one that stalls or trickles bytes holds only its own
// connection, and only that long: that second is the bound on processes
// that fork to hold more.
//
// Thread-safety: Start/Stop from one thread; the redeemer and the
// depositor are called on connection threads, several at once.
#ifndef REFIT_SERVER_ATTACH_FD_SERVER_H_
#define REFIT_SERVER_ATTACH_FD_SERVER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace refit::server {

class AttachFdServer {
 public:
  // The descriptors for the ticket, 1 to kMaxDescriptors (the server sends
  // them in one message, in this order, and closes them), or an error whose
  // message the engine receives.
  using Redeem = std::function<absl::StatusOr<std::vector<int>>(absl::string_view ticket, int pid,
                                                                uint32_t uid)>;
  static constexpr int kMaxDescriptors = 4;
  // Connections served at once, in all and from one process; the time a
  // peer has to send its ticket line.
  static constexpr int kMaxConnections = 64;
  static constexpr int kMaxConnectionsPerProcess = 4;
  static constexpr int kMaxConnectionsPerUnseenUid = 16;
  static constexpr int kTicketTimeoutMs = 1000;
  // How long the accept loop waits after running out of descriptors.
  static constexpr int kAcceptBackoffMs = 100;
  static constexpr size_t kMaxTicketBytes = 256;

  // Region tickets start with this; the server hands them to the depositor
  // whether or not a descriptor came with them.
  static constexpr absl::string_view kRegionTicketPrefix = "region-";
  // A region ticket and the descriptor the peer sent with it (owned by the
  // callee from then on, closed on error too), or why there is none: the
  // peer sent none (INVALID_ARGUMENT), or it was lost on the way because
  // this process is out of descriptors (RESOURCE_EXHAUSTED). An error's
  // message goes to the peer.
  using Deposit = std::function<absl::Status(absl::string_view ticket, absl::StatusOr<int> fd,
                                             int pid, uint32_t uid)>;

  // Binds `path` (a stale socket file there is replaced; anything else
  // there is FAILED_PRECONDITION). UNAVAILABLE if it cannot be bound.
  // Without `deposit`, a descriptor a peer sends is closed and refused.
  static absl::StatusOr<std::unique_ptr<AttachFdServer>> Start(std::string path, Redeem redeem,
                                                               Deposit deposit = nullptr);
  ~AttachFdServer();
  AttachFdServer(const AttachFdServer&) = delete;
  AttachFdServer& operator=(const AttachFdServer&) = delete;

  const std::string& path() const { return path_; }

  // Tests: the peer credentials the accept loop sees for a connection
  // (what SO_PEERCRED gives otherwise: a peer in another PID namespace has
  // pid 0). nullptr: none.
  static void SetPeerHookForTesting(void (*hook)(int conn, int* pid, uint32_t* uid));
  void Stop();

 private:
  AttachFdServer(std::string path, Redeem redeem, Deposit deposit)
      : path_(std::move(path)), redeem_(std::move(redeem)), deposit_(std::move(deposit)) {}
  // A connection's thread, and whether it has ended (set by the thread).
  struct Connection {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
    int pid = 0;       // the peer's, from SO_PEERCRED (0: another PID namespace)
    uint32_t uid = 0;  // the peer's
  };

  void Run();
  // Joins the connections' threads that have ended; returns how many run.
  size_t ReapConnections();
  void Serve(int conn);
  // Reads the peer's ticket line (without the newline) and the descriptor
  // it sent, if any (-1), within kTicketTimeoutMs in all; *lost when the
  // kernel dropped descriptors the peer sent (this process at its limit).
  // False when the peer sent no whole line (the descriptor is closed then):
  // `why` says why, empty when the peer sent nothing before it closed or
  // Stop came.
  bool ReadTicket(int conn, std::string* ticket, int* received, bool* lost, std::string* why);

  const std::string path_;
  const Redeem redeem_;
  const Deposit deposit_;
  int listen_fd_ = -1;
  // Readable once Stop was called (nobody reads it): wakes every poll.
  int wake_[2] = {-1, -1};
  std::thread thread_;
  std::vector<Connection> connections_;  // only the accepting thread, then Stop
};

}  // namespace refit::server

#endif  // REFIT_SERVER_ATTACH_FD_SERVER_H_
