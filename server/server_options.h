// Settings of refitd, one struct with defaults, filled from flags by main.cc
// and directly by tests. Plain values (and the clock the daemon's timers
// run on); thread-compatible.
#ifndef REFIT_SERVER_SERVER_OPTIONS_H_
#define REFIT_SERVER_SERVER_OPTIONS_H_

#include <sys/socket.h>
#include <sys/un.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/clock.h"

namespace refit::server {

inline constexpr char kRefitServiceName[] = "refit.v1.RefitService";
inline constexpr char kDefaultGroup[] = "target";

// The readiness service of one model group: "refit.v1.RefitService/NAME".
inline std::string GroupHealthName(absl::string_view group) {
  return std::string(kRefitServiceName) + "/" + std::string(group);
}

// One model group the daemon serves: its own store, version, fingerprint,
// refit slot, readiness and snapshots (--group NAME=MODEL[,key=value...]).
struct GroupOptions {
  std::string name = kDefaultGroup;  // 1 to 64 of [A-Za-z0-9._-]
  std::string model = "demo";        // "demo" or a checkpoint directory
  uint64_t demo_seed = 0;
  int64_t tp_rank = 0;
  int64_t tp_size = 1;
  int64_t ep_rank = 0;  // expert parallelism (mixture-of-experts models)
  int64_t ep_size = 1;
  std::string device = "cpu";
  std::string quant = "per-tensor";
  bool host_staging = false;
};

struct ServerOptions {
  // The model groups, the default group (a request's model_group "") first.
  // Empty: one group, kDefaultGroup, made of the single-group fields below
  // (model, demo_seed, tp_rank, tp_size, device, quant, host_staging).
  std::vector<GroupOptions> groups;
  // gRPC listen addresses: "host:port" (port 0 picks one) or "unix:/path".
  std::vector<std::string> listen = {"127.0.0.1:50051"};
  // "demo" (the fixture model, written to a temp dir and loaded) or a
  // checkpoint directory (config.json + *.safetensors).
  std::string model = "demo";
  uint64_t demo_seed = 0;
  int64_t tp_rank = 0;
  int64_t tp_size = 1;
  // Expert parallelism (--ep, --ep-rank): this rank serves the contiguous
  // experts [ep_rank * E / ep_size, (ep_rank + 1) * E / ep_size), whole.
  int64_t ep_rank = 0;
  int64_t ep_size = 1;
  std::string device = "cpu";
  std::string quant = "per-tensor";  // per-tensor | per-channel | block | none
  int64_t staging_budget_bytes = int64_t{4} << 30;
  // GPU stores: stage and quantize refits on the host (--host-staging).
  bool host_staging = false;
  // Largest chunk payload of one Push message; gRPC's receive limit is this
  // plus kMessageHeadroomBytes.
  int64_t max_chunk_bytes = int64_t{64} << 20;
  // Payload of one ReadTensor message unless the request asks for less or
  // more (up to max_chunk_bytes). 1 MiB stays under gRPC clients' default
  // 4 MiB receive limit.
  int64_t read_chunk_bytes = int64_t{1} << 20;
  // A Push stream that sends nothing for this long is aborted.
  absl::Duration push_idle_timeout = absl::Seconds(60);
  // A refit not committed this long after it became PREPARED is aborted
  // (it holds the group's only refit slot).
  absl::Duration prepared_timeout = absl::Minutes(10);
  // A refit not finished (committed or aborted) this long after it began is
  // aborted, whatever it is doing: bounds a slow drip that stays just
  // inside push_idle_timeout.
  absl::Duration refit_timeout = absl::Hours(1);
  // What push_idle_timeout and the refit deadlines are measured on; not owned, must outlive the
  // server. Tests pass a clock they advance by hand; nullptr means the real
  // one.
  Clock* clock = Clock::Real();
  // SIGTERM: in-flight RPCs get this long, then they are cancelled.
  absl::Duration shutdown_timeout = absl::Seconds(10);
  // How long a commit waits for coordinated attached engines to answer
  // CommitPending with Quiesced; past it the commit does not happen.
  absl::Duration engine_quiesce_timeout = absl::Seconds(5);
  // Engines attached to one model group at once; more are RESOURCE_EXHAUSTED.
  int max_attached_engines = 1024;
  // Shared-memory regions (RegionService) one caller may hold at once, and
  // their total size.
  int max_regions_per_caller = 1024;
  int64_t max_region_bytes_per_caller = int64_t{256} << 30;
  // Page-lock trainers' regions for DMA when a store is on a GPU, up to
  // max_pinned_region_bytes of them (-1: half the host's memory).
  bool pin_regions = true;
  int64_t max_pinned_region_bytes = -1;
  // Reload reads only below this directory; "" disables Reload.
  std::string reload_root;
  // "token role [name]" lines; "" disables authentication.
  std::string auth_tokens_file;
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;  // set: mutual TLS, client certificates required
  bool allow_insecure_remote = false;
  // "host:port" for the Prometheus /metrics endpoint; "" disables it.
  std::string metrics_listen;
  // metrics_listen may be beyond loopback (so may allow_insecure_remote).
  bool metrics_allow_remote = false;
  // Durable versions (core/snapshot.h): every committed version is
  // snapshotted here and the newest verified snapshot is served at start.
  // "" disables it.
  std::string state_dir;
  // A corrupt snapshot at start: "fallback" (the previous one, then --model)
  // or "fail" (the start fails with the reason).
  std::string state_recovery = "fallback";
  // Fleet membership (server/fleet_member.h, docs/fleet.md); "" fleet: none.
  std::string fleet;
  std::vector<std::string> etcd_endpoints;
  std::string fleet_member;     // "": <hostname>-r<tp rank>
  std::string fleet_advertise;  // the address coordinators dial; "": the first bound one
  absl::Duration fleet_lease_ttl = absl::Seconds(10);
  absl::Duration fleet_prepared_timeout = absl::Seconds(30);
  // TLS to etcd (PEM files): the CA that signed etcd's certificate, and
  // this daemon's client certificate and key when etcd requires one.
  std::string etcd_ca;
  std::string etcd_cert;
  std::string etcd_key;
};

inline constexpr int64_t kMessageHeadroomBytes = int64_t{1} << 20;
// The smallest ReadTensor chunk a request may ask for (smaller requests are
// raised to it).
inline constexpr int64_t kMinReadChunkBytes = int64_t{64} << 10;

// The groups `options` serves: options.groups, or the one default group
// made of its single-group fields.
std::vector<GroupOptions> EffectiveGroups(const ServerOptions& options);

// Parses a --group value, "NAME=MODEL[,key=value...]" (MODEL "demo" or a
// checkpoint directory; keys seed, tp, tp-rank, ep, ep-rank, device,
// quant, host-staging); `defaults` gives what the keys leave out. INVALID_ARGUMENT
// naming the value and the bad part (a name outside [A-Za-z0-9._-]{1,64}, a
// missing model, an unknown key, a malformed number).
absl::StatusOr<GroupOptions> ParseGroupSpec(absl::string_view text, const GroupOptions& defaults);

// OK for 1 to 64 of [A-Za-z0-9._-] (a group name is part of a health
// service name and of a directory name); INVALID_ARGUMENT naming it.
absl::Status ValidateGroupName(absl::string_view name);

// Splits comma-separated entries and drops empty ones.
std::vector<std::string> SplitListenAddresses(const std::vector<std::string>& values);

// OK for "unix:/path", "unix-abstract:name" and "host:port" / "[v6]:port"
// with a decimal port in 0..65535 (0 picks one); INVALID_ARGUMENT naming
// `flag` and the address otherwise (gRPC itself would take port 500510 as
// 500510 mod 65536).
absl::Status ValidateListenAddress(absl::string_view address, absl::string_view flag);

// ValidateListenAddress for each of --listen's addresses, and the Unix
// socket paths checked before anything binds: each fits a socket address,
// and beside the first one the descriptor socket (DescriptorSocketPath)
// fits too.
absl::Status ValidateListenAddresses(const std::vector<std::string>& addresses);

// Where engines and trainers hand over descriptors: "PATH.fd" beside the
// first "unix:PATH" of `addresses`, made absolute against the working
// directory (clients are told it); empty when there is none.
std::string DescriptorSocketPath(const std::vector<std::string>& addresses);

// Splits "host:port" or "[v6]:port" (host without the brackets); false for
// any other shape (no port separator, an unbracketed host with colons).
bool SplitHostPort(absl::string_view address, absl::string_view* host, absl::string_view* port);

// The socket address of "unix:PATH" ("unix:///ABS" too: its authority is
// empty) or "unix-abstract:NAME" (`path` empty); INVALID_ARGUMENT with the
// reason, not the address, when the path or name is empty or does not fit.
struct UnixSocketAddress {
  sockaddr_un sun{};
  socklen_t len = 0;
  std::string path;
};
absl::StatusOr<UnixSocketAddress> ParseUnixSocketAddress(absl::string_view address);

// True for unix: sockets and 127.0.0.0/8, ::1, localhost.
bool IsLoopbackAddress(absl::string_view address);

// "4294967296", "64MiB", "64M", "4GiB", "4G", "512KiB", "512k" (binary
// units). INVALID_ARGUMENT otherwise.
absl::StatusOr<int64_t> ParseByteSize(absl::string_view text);

}  // namespace refit::server

#endif  // REFIT_SERVER_SERVER_OPTIONS_H_
