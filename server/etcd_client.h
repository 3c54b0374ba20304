// EtcdClient: a small synchronous client of etcd's v3 gRPC API
// (proto/etcd/etcd_rpc.proto), what the fleet code needs and no more: reads
// of a key or a prefix, puts, compare-and-swap transactions, leases and
// watches.
//
// Pipeline position: below the fleet. FleetMember (server/fleet_member.h)
// registers the daemon and records presumed aborts with it; the coordinator
// (client/fleet_coordinator.h) records decisions with it.
//
// Endpoints: "host:port", "http://host:port" or "https://host:port",
// several comma-separated for an etcd cluster. TLS (etcd's
// --cert-file/--key-file, --trusted-ca-file for client certificates) is on
// for an https:// endpoint and for a bare host:port when a CA or client
// certificate is given; http:// is always plaintext. Calls (and the
// creation of a watch) go to one endpoint; one that answers UNAVAILABLE (a
// dead or unreachable member) is replaced by the next, and the call is
// tried once on each; later calls start at the one that answered.
//
// Errors: etcd's gRPC status as an absl::Status with the endpoint and the
// method in the message (UNAVAILABLE when etcd cannot be reached, naming
// every endpoint tried and why; DEADLINE_EXCEEDED after `timeout`).
//
// Thread-safe: calls may run concurrently; a Watch runs on its own thread
// and calls back there.
#ifndef REFIT_SERVER_ETCD_CLIENT_H_
#define REFIT_SERVER_ETCD_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "etcd/etcd_rpc.grpc.pb.h"

namespace refit::server {

struct EtcdClientOptions {
  // Comma-separated endpoints are split too.
  std::vector<std::string> endpoints;
  // Deadline of each call (a Watch has none).
  absl::Duration timeout = absl::Seconds(2);
  // TLS: PEM files. The CA verifies etcd's certificate (the system's roots
  // when empty); cert and key, both or neither, are this client's
  // certificate for an etcd that requires one.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
};

struct EtcdKeyValue {
  std::string key;
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t lease = 0;
};

// The end of the key range that holds every key starting with `prefix`.
std::string EtcdPrefixEnd(absl::string_view prefix);

class EtcdClient {
 public:
  // INVALID_ARGUMENT without an endpoint, for a malformed one, or for a
  // client certificate without its key; NOT_FOUND / PERMISSION_DENIED for
  // a TLS file that cannot be read. Does not contact etcd.
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(EtcdClientOptions options);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // nullopt when the key does not exist.
  absl::StatusOr<std::optional<EtcdKeyValue>> Get(absl::string_view key);
  // Every key under `prefix`, in key order.
  absl::StatusOr<std::vector<EtcdKeyValue>> GetPrefix(absl::string_view prefix);
  // Returns the store revision of the write. lease 0: no lease.
  absl::StatusOr<int64_t> Put(absl::string_view key, absl::string_view value, int64_t lease = 0);
  // Returns how many keys were deleted (0 or 1).
  absl::StatusOr<int64_t> Delete(absl::string_view key);

  struct CasResult {
    bool written = false;
    // When not written: the key as it is (what won).
    std::optional<EtcdKeyValue> existing;
  };
  // Compare-and-swap on absence: writes `key` = `value`, and every pair of
  // `also` with it in the same transaction, only if `key` does not exist.
  // Exactly one of several racing callers writes.
  absl::StatusOr<CasResult> PutIfAbsent(
      absl::string_view key, absl::string_view value, int64_t lease = 0,
      const std::vector<std::pair<std::string, std::string>>& also = {});
  // A raw transaction, for guards PutIfAbsent cannot express.
  absl::StatusOr<etcdserverpb::TxnResponse> Txn(const etcdserverpb::TxnRequest& request);

  // A lease of `ttl` (rounded up to whole seconds; etcd may raise it to
  // its minimum). Returns the lease id.
  absl::StatusOr<int64_t> GrantLease(absl::Duration ttl);
  // One keep-alive. NOT_FOUND when the lease has already expired (its keys
  // are gone). Returns the lease's new TTL.
  absl::StatusOr<absl::Duration> KeepAlive(int64_t lease);
  // Deletes the lease and every key attached to it.
  absl::Status RevokeLease(int64_t lease);

  // A running watch of every key under a prefix; events are delivered on
  // the watch's own thread in revision order. The callback must not destroy
  // the Watch.
  class Watch {
   public:
    ~Watch();  // Cancels and joins.
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;
    // Ends the stream; the thread ends with it.
    void Cancel();
    // True once the stream has ended (error or Cancel); the callback gets
    // no more events then.
    bool done() const { return done_.load(); }

   private:
    friend class EtcdClient;
    Watch() = default;
    grpc::ClientContext context_;
    std::thread thread_;
    std::atomic<bool> done_{false};
  };
  struct WatchEvent {
    bool deleted = false;
    EtcdKeyValue kv;
  };
  // Starts a watch of `prefix` from `start_revision` (0: from now on).
  // `on_events` gets each batch of events (one revision or several);
  // `on_end` the stream's end status (CANCELLED after Cancel) once. Returns
  // once etcd has confirmed the watch: everything written afterwards is
  // delivered. UNAVAILABLE when no endpoint can be reached.
  absl::StatusOr<std::unique_ptr<Watch>> WatchPrefix(
      absl::string_view prefix, int64_t start_revision,
      std::function<void(const std::vector<WatchEvent>&, int64_t revision)> on_events,
      std::function<void(const absl::Status&)> on_end);

  const std::vector<std::string>& endpoints() const { return endpoints_; }

 private:
  EtcdClient(EtcdClientOptions options, std::vector<std::string> endpoints,
             const std::vector<std::shared_ptr<grpc::ChannelCredentials>>& credentials);
  struct Stubs {
    std::string endpoint;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<etcdserverpb::KV::Stub> kv;
    std::unique_ptr<etcdserverpb::Lease::Stub> lease;
    std::unique_ptr<etcdserverpb::Watch::Stub> watch;
  };
  // Runs `call` on the current endpoint, moving on to the next one when it
  // answers UNAVAILABLE.
  absl::Status Call(absl::string_view method,
                    const std::function<grpc::Status(Stubs&, grpc::ClientContext*)>& call);
  void SetDeadline(grpc::ClientContext* context) const;

  const EtcdClientOptions options_;
  const std::vector<std::string> endpoints_;
  std::vector<std::unique_ptr<Stubs>> stubs_;
  absl::Mutex mu_;
  size_t current_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace refit::server

#endif  // REFIT_SERVER_ETCD_CLIENT_H_
