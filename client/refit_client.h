// refit::client::RefitClient: the C++ client library of refitd.
//
// Used by trainers (push a refit from memory or from safetensors files), by
// refitctl (every subcommand) and by tests. It speaks refit.v1 and
// grpc.health.v1 over one gRPC channel: TCP ("host:port") or a Unix socket
// ("unix:/path"), optionally with TLS / mutual TLS and a bearer token.
//
// Push buckets tensors into large `Chunks` messages (default 32 MiB per
// message, one tensor split over several chunks when it is larger than the
// chunk cap or the room left in a bucket), optionally with an XXH3-64 of each
// chunk's bytes, and reports progress after every message.
//
// Retries: read-only calls (GetStatus, ListTensors, ReadTensor, health Check)
// are retried on UNAVAILABLE with exponential backoff, because repeating them
// cannot change anything on the daemon. Push, Reload, Commit and Abort are
// never retried: a Push that failed with UNAVAILABLE may still have reached
// the daemon and committed (the response was lost, not the refit), so
// repeating it blindly could apply the same update twice on top of a newer
// version; the caller must look at GetStatus (or use base_version) and decide.
//
// Lifecycle: Create once, share freely; every method is thread-safe (gRPC
// channels and stubs are). Callbacks run on the calling thread.
#ifndef REFIT_CLIENT_REFIT_CLIENT_H_
#define REFIT_CLIENT_REFIT_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "refit/v1/refit.grpc.pb.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace refit::client {

inline constexpr size_t kDefaultBucketBytes = size_t{32} << 20;
inline constexpr size_t kDefaultMaxChunkBytes = size_t{32} << 20;
inline constexpr char kReadinessService[] = "refit.v1.RefitService";

struct RetryPolicy {
  int max_attempts = 5;  // 1 means no retry
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(2);
};

struct ClientOptions {
  // "host:port", "dns:///host:port" or "unix:/path/to/socket".
  std::string address = "127.0.0.1:50051";
  // Sent as "authorization: Bearer <token>" on every call except health.
  std::string token;
  // TLS is on when any of these is set. tls_ca_file verifies the server (the
  // system roots when empty); cert + key present a client certificate
  // (mutual TLS).
  bool tls = false;
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // Overrides the name checked against the server certificate.
  std::string tls_server_name;
  // Deadline of unary calls and of each streaming call as a whole, all the
  // attempts of a retried read-only call together; infinite means none.
  absl::Duration timeout = absl::InfiniteDuration();
  // Read-only calls (GetStatus, ListTensors, ReadTensor, HealthCheck, Watch)
  // wait for a daemon that cannot be reached yet (still starting, or
  // restarting) instead of failing at once with UNAVAILABLE: gRPC's
  // wait_for_ready, bounded by the call's deadline (`timeout`; with an
  // infinite timeout a call waits for as long as the daemon stays away).
  // Never for Push, Reload, Commit or Abort. refitctl turns it on.
  bool wait_for_ready = false;
  // gRPC message limits of the channel (both directions).
  int max_message_bytes = 256 << 20;
  RetryPolicy retry;
};

// One tensor to push; `data` must stay valid during the Push call.
struct TensorRef {
  std::string name;
  refit::v1::DType dtype = refit::v1::DTYPE_BF16;
  std::vector<int64_t> shape;
  absl::Span<const uint8_t> data;  // the bytes, in memory
  // Instead of `data`: reads `out.size()` bytes at `offset` of the tensor,
  // which has `size` bytes. PushFiles reads files this way, never through a
  // mapping, so a file truncated during a push fails the push with the
  // reader's error (the stream is cancelled, the daemon aborts the refit)
  // instead of killing the process with SIGBUS.
  std::function<absl::Status(uint64_t offset, absl::Span<uint8_t> out)> read = nullptr;
  uint64_t size = 0;
};

struct PushProgress {
  uint64_t bytes_sent = 0;  // tensor bytes written to the stream so far
  uint64_t bytes_total = 0;
  size_t tensors_done = 0;
  size_t tensors_total = 0;
  size_t messages_sent = 0;
  absl::Duration elapsed;
};

struct PushOptions {
  std::string model_group;  // "" = the daemon's default group
  refit::v1::CompletionMode completion = refit::v1::COMPLETION_MODE_COMMIT;
  std::optional<uint64_t> base_version;
  refit::v1::NonFinitePolicy non_finite = refit::v1::NON_FINITE_POLICY_REJECT;
  bool allow_partial_layers = false;
  // Fail (FAILED_PRECONDITION) unless every checkpoint tensor is pushed.
  // Off here as on the wire; refitctl push turns it on unless --partial.
  bool require_complete = false;
  std::string label;
  // RefitOptions.fleet_refit_id (a fleet coordinator's prepare; needs
  // COMPLETION_MODE_PREPARE): "" outside fleet refits.
  std::string fleet_refit_id;
  // Tensor bytes per Chunks message (a message may hold many small tensors).
  size_t bucket_bytes = kDefaultBucketBytes;
  // Upper bound on one Chunk's bytes; larger tensors are split.
  size_t max_chunk_bytes = kDefaultMaxChunkBytes;
  // Attach an XXH3-64 of every chunk's bytes.
  bool checksums = true;
  // Concurrent Push streams that carry the refit (Begin.streams): the
  // tensors are split among them by tensor, balanced by bytes, each stream
  // sending its share in checkpoint order. Above 1, the refit gets
  // `refit_id` (one is made up when empty) so that the other streams can
  // join it, they start once the daemon has accepted the first stream's
  // Begin, and on_progress is called from the streams' threads (one call at
  // a time). Capped at the number of tensors.
  int streams = 1;
  // The refit's id (Begin.refit_id): 1 to 64 of [A-Za-z0-9._-]; "" lets the
  // daemon choose (for a single stream). ALREADY_EXISTS if in use.
  std::string refit_id;
  std::function<void(const PushProgress&)> on_progress;
};

struct ReadTensorResult {
  refit::v1::TensorInfo info;
  uint64_t version = 0;
  std::string fingerprint;  // of `version`
  std::string data;
};

// XXH3-64 of `data`, as Chunk.xxh3 carries it.
uint64_t ChunkChecksum(absl::Span<const uint8_t> data);

// grpc::Status -> absl::Status (same code, same message).
absl::Status FromGrpcStatus(const class grpc::Status& status);

class RefitClient {
 public:
  // Does not connect yet (channels connect lazily), so an unreachable daemon
  // shows up as UNAVAILABLE on the first call, not here.
  // Errors:
  //   INVALID_ARGUMENT   empty address; a client certificate without its key
  //                      or a key without its certificate
  //   NOT_FOUND          a TLS file (CA, certificate, key) does not exist
  //   PERMISSION_DENIED  a TLS file exists but cannot be read
  static absl::StatusOr<std::unique_ptr<RefitClient>> Create(ClientOptions options);

  RefitClient(const RefitClient&) = delete;
  RefitClient& operator=(const RefitClient&) = delete;

  const ClientOptions& options() const { return options_; }

  // One refit transaction: Begin, the tensors in buckets, End. Returns the
  // daemon's result (COMMITTED, or PREPARED with COMPLETION_MODE_PREPARE).
  // Never retried (see the file comment).
  // Errors found locally, before anything is sent (the message names the
  // tensor):
  //   INVALID_ARGUMENT    no tensors; a zero bucket or chunk size; a tensor
  //                       with an unspecified dtype, a negative dimension, or
  //                       data whose size is not dtype size x shape
  // Errors of the daemon, passed on with its code and message:
  //   ABORTED             another refit is active on the group (its id is
  //                       named); the live version is not base_version (re-read
  //                       it and retry); the refit was aborted by an Abort RPC
  //                       or a shutdown
  //   NOT_FOUND           unknown model group or tensor name
  //   INVALID_ARGUMENT    a dtype, shape or alignment the model does not have,
  //                       overlapping chunks, an X_UNSPECIFIED option,
  //                       non-finite weights under NON_FINITE_POLICY_REJECT
  //   ALREADY_EXISTS      a byte range sent twice
  //   OUT_OF_RANGE        a chunk past the end of its tensor
  //   DATA_LOSS           a chunk's checksum does not match; a tensor sent
  //                       only in part
  //   FAILED_PRECONDITION a layer missing whole tensors (unless
  //                       allow_partial_layers)
  //   RESOURCE_EXHAUSTED  the daemon's staging budget or message size limit
  //   DEADLINE_EXCEEDED   options().timeout passed, or the stream was idle
  //                       longer than the daemon's push idle timeout
  //   UNAVAILABLE         the daemon is unreachable or shutting down (a lost
  //                       answer: the refit may still have committed)
  //   UNAUTHENTICATED     missing or unknown token
  //   PERMISSION_DENIED   the token's role may not push
  // With options.streams > 1, the first error of a stream that is not the
  // ABORTED of the other streams (the cause), e.g. INVALID_ARGUMENT for
  // streams < 1 or a malformed refit_id, ALREADY_EXISTS for a refit_id in
  // use.
  absl::StatusOr<refit::v1::RefitResult> Push(absl::Span<const TensorRef> tensors,
                                              const PushOptions& options);
  // Push of every tensor of the given safetensors files (read with pread
  // straight into each message: the bytes are not loaded twice).
  // Errors: those of SafetensorsView::Open for each file (NOT_FOUND,
  // PERMISSION_DENIED, INVALID_ARGUMENT naming the file); FAILED_PRECONDITION
  // naming the file when one changes while it is pushed; then Push's
  // (INVALID_ARGUMENT "no tensors" when the files hold none).
  absl::StatusOr<refit::v1::RefitResult> PushFiles(const std::vector<std::string>& files,
                                                   const PushOptions& options);

  // Server-streamed reload from a path the daemon reads itself. Progress
  // messages go to `on_progress`; the final result is returned. Never retried.
  // Errors:
  //   DATA_LOSS           the stream ended OK but without a result
  //   and the daemon's: PERMISSION_DENIED (the path resolves outside
  //   --reload-root, the daemon has no reload root, or the role is not
  //   operator), NOT_FOUND (no such path under the root, unknown model
  //   group), INVALID_ARGUMENT (empty path, malformed files), and every
  //   Push error of the tensors the daemon reads (ABORTED for an active
  //   refit or a stale base_version, ...), UNAVAILABLE, UNAUTHENTICATED.
  absl::StatusOr<refit::v1::RefitResult> Reload(
      const refit::v1::ReloadRequest& request,
      const std::function<void(const refit::v1::Progress&)>& on_progress = nullptr);
  // Commits a refit pushed with COMPLETION_MODE_PREPARE; "" = the caller's
  // own active refit (a trainer's own, any for an operator). Never retried.
  // Errors (the daemon's):
  //   NOT_FOUND           unknown model group or refit id; for "", no active
  //                       refit of the caller's
  //   FAILED_PRECONDITION the refit is still receiving (not PREPARED yet)
  //   PERMISSION_DENIED   a trainer committing another trainer's refit
  //   UNAVAILABLE         unreachable, or shutting down
  //   UNAUTHENTICATED     missing or unknown token
  absl::StatusOr<refit::v1::RefitResult> Commit(const std::string& model_group,
                                                const std::string& refit_id);
  // Commits the refit `refit_id` of `model_group` and the PREPARED refits
  // `linked` (model group, refit id) of other groups at one commit point:
  // all of them or none. Never retried. The response holds the results in
  // the order of the request (result, then linked).
  // Errors (the daemon's, each naming the group): Commit's, and
  //   INVALID_ARGUMENT    a group named twice
  //   FAILED_PRECONDITION one of them is still receiving (nothing changes)
  struct RefitRef {
    std::string model_group;
    std::string refit_id;
  };
  absl::StatusOr<refit::v1::CommitResponse> CommitLinked(const std::string& model_group,
                                                         const std::string& refit_id,
                                                         const std::vector<RefitRef>& linked);
  // Aborts a prepared or running refit; "" = the caller's own active refit
  // (a trainer's own, any for an operator). Never retried.
  // Errors (the daemon's):
  //   NOT_FOUND           unknown model group or refit id; for "", no active
  //                       refit of the caller's
  //   PERMISSION_DENIED   a trainer aborting another trainer's refit, or a
  //                       reader
  //   UNAVAILABLE         unreachable
  //   UNAUTHENTICATED     missing or unknown token
  absl::StatusOr<refit::v1::AbortResponse> Abort(const std::string& model_group,
                                                 const std::string& refit_id,
                                                 const std::string& reason);

  // Read-only; retried on UNAVAILABLE.
  // Errors (the daemon's):
  //   NOT_FOUND           unknown model group
  //   UNAVAILABLE         still unreachable after retry.max_attempts
  //   DEADLINE_EXCEEDED   options().timeout passed
  //   UNAUTHENTICATED / PERMISSION_DENIED  missing token / role may not read
  absl::StatusOr<refit::v1::GetStatusResponse> GetStatus(const std::string& model_group = "");
  // GetStatus of `model_group` with `groups` holding every group the daemon
  // serves (GetStatusRequest.all_groups), all as of one instant.
  absl::StatusOr<refit::v1::GetStatusResponse> GetStatusAllGroups(
      const std::string& model_group = "");
  // Read-only; retried on UNAVAILABLE.
  // Errors: as GetStatus, and INVALID_ARGUMENT for LAYOUT_UNSPECIFIED.
  absl::StatusOr<refit::v1::ListTensorsResponse> ListTensors(
      const std::string& model_group, refit::v1::ListTensorsRequest::Layout layout);
  // The whole tensor, all of one version. Read-only; retried on UNAVAILABLE.
  // An unpinned read that a commit interrupts (ABORTED) is read again, up to
  // kUnpinnedReadAttempts times in all. `fingerprint` pins the content too
  // (GetStatus.fingerprint): a version number alone does not survive a
  // restart of a daemon without --state-dir.
  // Errors:
  //   DATA_LOSS           the stream is empty, mixes versions, has a gap, or
  //                       its pieces do not add up to info.nbytes (the message
  //                       names the tensor and expected vs got)
  //   NOT_FOUND           unknown kernel tensor or model group (the daemon's)
  //   ABORTED             with `version` or `fingerprint`: another version is
  //                       live, or a commit landed during the read (reads of
  //                       several tensors pinned to one version never mix
  //                       versions); without: commits kept interrupting it
  //   and GetStatus's UNAVAILABLE, DEADLINE_EXCEEDED, UNAUTHENTICATED,
  //   PERMISSION_DENIED.
  static constexpr int kUnpinnedReadAttempts = 4;
  absl::StatusOr<ReadTensorResult> ReadTensor(
      const std::string& model_group, const std::string& name, uint32_t max_chunk_bytes = 0,
      std::optional<uint64_t> version = std::nullopt,
      std::optional<std::string> fingerprint = std::nullopt);

  // Calls `on_event` for every event (the first is a snapshot) until it
  // returns false, the stream ends or `deadline` passes. Returns OK when the
  // callback stopped it, otherwise the stream's status. Not retried;
  // options().timeout does not apply (a watch runs until stopped), the
  // deadline does.
  // Errors: DEADLINE_EXCEEDED (`deadline` passed after the watch reached the
  // daemon), NOT_FOUND (unknown model group), UNAVAILABLE (unreachable until
  // `deadline`, or the daemon shut down while watching),
  // UNAUTHENTICATED / PERMISSION_DENIED.
  absl::Status Watch(const std::string& model_group,
                     const std::function<bool(const refit::v1::WatchEvent&)>& on_event,
                     absl::Time deadline = absl::InfiniteFuture());

  // grpc.health.v1 Check ("" = liveness, kReadinessService = readiness).
  // Sends no token. Retried on UNAVAILABLE.
  // Errors:
  //   NOT_FOUND           the daemon does not know the service
  //   UNAVAILABLE         still unreachable after retry.max_attempts
  //   DEADLINE_EXCEEDED   options().timeout passed
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> HealthCheck(
      const std::string& service);
  // Blocks until liveness ("") and readiness (kReadinessService) are both
  // SERVING, waiting for a daemon that cannot be reached yet and following
  // readiness with a health Watch (through a restart, too), or until
  // `deadline`. For scripts and init systems that start refitd and then use
  // it. Sends no token.
  // Errors:
  //   DEADLINE_EXCEEDED   not SERVING by `deadline`; the message says what
  //                       was seen last (unreachable, NOT_SERVING)
  //   NOT_FOUND           the daemon does not know the readiness service
  //   UNIMPLEMENTED       the server has no health service
  // `readiness`: the service to wait for, e.g. one model group's
  // ("refit.v1.RefitService/draft").
  absl::Status WaitUntilServing(absl::Time deadline,
                                const std::string& readiness = kReadinessService);
  // grpc.health.v1 Watch; same contract as Watch. An unknown service is not
  // an error: it is reported as SERVICE_UNKNOWN until the daemon learns it.
  // Errors: UNAVAILABLE (unreachable, or the daemon shut down).
  absl::Status HealthWatch(
      const std::string& service,
      const std::function<bool(grpc::health::v1::HealthCheckResponse::ServingStatus)>& on_status);

 private:
  RefitClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options);
  // `read_only` calls wait for the daemon when options().wait_for_ready.
  // The call ends at `deadline` (a CallDeadline()) or, without one,
  // options().timeout from now.
  void PrepareContext(class grpc::ClientContext* context, bool with_token, bool read_only = false,
                      absl::Time deadline = absl::InfiniteFuture()) const;
  // options().timeout from now: the end of one method call of this client,
  // all its attempts together.
  absl::Time CallDeadline() const;
  // A unary read-only call (`rpc` on a context prepared for it), retried as
  // RetryReadOnly under one CallDeadline().
  absl::Status UnaryReadOnly(
      bool with_token, const std::function<grpc::Status(class grpc::ClientContext*)>& rpc) const;
  // Runs `call` up to retry.max_attempts times while it returns UNAVAILABLE,
  // every attempt (and the backoff between them) before `deadline`.
  absl::Status RetryReadOnly(const std::function<absl::Status(absl::Time deadline)>& call,
                             absl::Time deadline) const;
  absl::StatusOr<refit::v1::GetStatusResponse> GetStatusOf(const std::string& model_group,
                                                           bool all_groups);

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<refit::v1::RefitService::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_stub_;
};

}  // namespace refit::client

#endif  // REFIT_CLIENT_REFIT_CLIENT_H_
