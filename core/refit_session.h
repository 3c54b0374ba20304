// RefitSession: one refit transaction against a ShardStore — the state
// machine that drives the pipeline's components.
//
// Pipeline position: the server's Push handler (one stream = one session), the
// Reload handler and the first load from disk all drive the same object:
//   Begin -> Ingest(chunk)* -> Prepare -> Commit      (or Abort at any point)
// Ingest hands each chunk to the LayerAssembler, which stages this rank's
// slice of it in the layer's high-precision buffers. When a layer is
// complete, its params go to the LayerWorker (or are processed at once
// without overlap_processing), where the LayerProcessor for the store's
// device makes its kernels (FP8 quantization) and the high-precision buffers
// are freed. Prepare finalizes: layers that got nothing keep their old values
// (listed in the result), attention scales are resolved, and any checkpoint
// tensor that is incomplete fails the session. Commit copies the staged
// kernels into the live tensors in place through the store's RefitSlot and
// bumps the version.
//
// Guarantees: nothing is visible before Commit; any error or Abort leaves the
// live version unchanged bit for bit and frees all staging. High-precision
// staging is bounded by RefitOptions::staging_budget_bytes: when a layer
// needs more, the session first waits for the worker to finish the complete
// layers it holds, then fails with RESOURCE_EXHAUSTED. Events reach the
// store's listeners in order, outside the session's locks, and a session's
// "committed" or "aborted" is delivered before its slot is released, so it
// always precedes the next refit's "staging started".
//
// Thread-safety: all methods may be called from any thread. Ingest, Prepare,
// Commit and Abort are serialized (an Abort from another thread takes effect
// when a running call returns, at most one layer's processing later);
// state(), progress() and abort_status() never wait for them.
#ifndef REFIT_CORE_REFIT_SESSION_H_
#define REFIT_CORE_REFIT_SESSION_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/fp8_quantizer.h"
#include "core/layer_assembler.h"
#include "core/layer_processor.h"
#include "core/layer_worker.h"
#include "core/shard_store.h"

namespace refit::core {

struct RefitOptions {
  std::string refit_id;                  // generated when empty
  std::string label;                     // free text, carried into the refit's events
  std::optional<uint64_t> base_version;  // ABORTED at Begin if the live version differs
  int64_t staging_budget_bytes = int64_t{4} << 30;
  NonFinitePolicy non_finite = NonFinitePolicy::kReject;
  bool allow_partial_layers = false;  // zero-fill missing tensors (vLLM behaviour)
  // Every checkpoint tensor must arrive: Prepare fails when a layer got
  // nothing (it would keep its old values next to new ones elsewhere).
  bool require_complete = false;
  int quantize_threads = 0;
  // Quantize complete layers on a worker thread while later chunks arrive.
  // Ingest returns once the worker has taken a completed layer, so at most
  // one complete layer waits on the quantizer (bounded memory).
  bool overlap_processing = true;
  // For a store on a GPU: stage and quantize on the host instead of the
  // device (same bytes; the commit copies host to device).
  bool host_staging = false;
  // Publish "staging started" from Begin. A caller that registers the refit
  // somewhere others look it up (by its id) turns this off and calls
  // AnnounceStart() once registered, so that whoever sees the event can
  // already find the refit.
  bool announce_start = true;
  // Called by Prepare once every byte the refit reads has been read (the
  // last layer processed), before it reports PREPARED: an error fails the
  // refit with that status. For inputs that can go bad under a read (a
  // trainer's shared-memory region that shrank: its reads came back zeros).
  std::function<absl::Status()> input_check;
};

enum class SessionState { kReceiving, kPrepared, kCommitted, kAborted };
absl::string_view SessionStateName(SessionState state);

struct PhaseTimings {
  absl::Duration receive;   // Begin to the last Ingest
  absl::Duration quantize;  // total time in layer processing
  absl::Duration hashing;   // of `quantize`: hashing the made kernels
  absl::Duration finalize;  // Prepare
  absl::Duration commit;    // the in-place copy (readers' pause)
};

struct SessionProgress {
  std::string refit_id;
  SessionState state = SessionState::kReceiving;
  int64_t layers_total = 0;
  int64_t layers_done = 0;  // processed
  int64_t bytes_received = 0;
  int64_t elements_loaded = 0;
  int64_t elements_expected = 0;
  int64_t staging_bytes = 0;       // high-precision staging now
  int64_t peak_staging_bytes = 0;  // high-precision staging, peak
  int64_t staged_kernel_bytes = 0;
};

struct RefitResult {
  std::string refit_id;
  uint64_t version = 0;
  std::string fingerprint;
  std::vector<std::string> kept_layers;     // got no weights; old values kept
  std::vector<std::string> partial_layers;  // zero-filled (allow_partial_layers)
  PhaseTimings timings;
  int64_t bytes_received = 0;
  // Of bytes_received, read in place from a chunk's memory (Chunk::keep)
  // when the layer was processed instead of being copied at ingest.
  int64_t bytes_read_in_place = 0;
  int64_t peak_staging_bytes = 0;
  // Per-tensor weights the host quantizer read once: their scale came out as
  // the store's hint said (core/scale_hints.h).
  int64_t scales_reused = 0;
  // Per-tensor weights whose amax the convert of the weight before them
  // took (read once by their own quantize; LayerProcessor's look-ahead).
  int64_t amax_ahead = 0;
  // No chunk arrived: Commit makes no new version (version and fingerprint
  // are the live ones).
  bool unchanged = false;
};

class RefitSession {
 public:
  // Opens a refit of `store`.
  // Errors:
  //   INVALID_ARGUMENT  no store; a negative staging budget
  //   ABORTED           another refit is active on the store (named), or
  //                     options.base_version differs from the live version:
  //                     a test-and-set that failed, so the caller re-reads
  //                     the version and retries the whole refit
  //   (device)          the status of setting up GPU staging (UNAVAILABLE,
  //                     RESOURCE_EXHAUSTED, ...), naming the refit and device
  static absl::StatusOr<std::unique_ptr<RefitSession>> Begin(ShardStore* store,
                                                             RefitOptions options);
  // Publishes "staging started" once, for sessions begun with
  // announce_start off; nothing after the session ended.
  void AnnounceStart();
  // Aborts unless committed.
  ~RefitSession();
  RefitSession(const RefitSession&) = delete;
  RefitSession& operator=(const RefitSession&) = delete;

  // Stages one chunk. Any error aborts the session, so that nothing is
  // half-applied.
  // Errors: those of LayerAssembler::Ingest (NOT_FOUND, INVALID_ARGUMENT,
  // OUT_OF_RANGE, ALREADY_EXISTS, DATA_LOSS for a checksum mismatch,
  // RESOURCE_EXHAUSTED for the staging budget, naming the layer and bytes);
  // a failed layer's processing status (INVALID_ARGUMENT for non-finite
  // weights, RESOURCE_EXHAUSTED out of device memory); after an abort, the
  // abort's own status (ABORTED for Abort(), or the error that aborted it);
  // FAILED_PRECONDITION once prepared or committed.
  absl::Status Ingest(const Chunk& chunk);
  // Finalizes everything; the session is then PREPARED (nothing visible yet).
  // Returns the prepared result: the live version and fingerprint (which
  // Commit will replace), kept and partial layers, timings so far.
  // Errors (the session aborts):
  //   DATA_LOSS           a tensor received only in part (named, bytes)
  //   FAILED_PRECONDITION a layer missing whole tensors (named), unless
  //                       allow_partial_layers; with require_complete, any
  //                       checkpoint tensor missing (the first few named,
  //                       and the count), unless no chunk arrived at all;
  //                       or the session is not
  //                       receiving (prepared, committed, aborted: the
  //                       message says which and why)
  //   and the processing errors of Ingest.
  absl::StatusOr<RefitResult> Prepare();
  // Prepares if needed, then commits in place: the new version and
  // fingerprint. A session that received no chunk commits nothing: the
  // result is the live version, `unchanged`, and the "committed" event
  // carries the live version with the message "unchanged".
  // Errors: those of Prepare; FAILED_PRECONDITION when already committed or
  // aborted; INTERNAL if staged sizes disagree with the store (nothing
  // copied).
  absl::StatusOr<RefitResult> Commit();
  // Idempotent. Frees staging and releases the store's refit slot. The
  // session's status becomes ABORTED with `reason`.
  void Abort(absl::string_view reason);

  // Commits PREPARED sessions of different stores (model groups) at one
  // commit point (RefitSlot::CommitLinked): readers see every store's old
  // version or every store's new one. Sessions that received nothing commit
  // unchanged. Results in the order of `sessions`.
  // Errors:
  //   INVALID_ARGUMENT     no sessions; two sessions of one group
  //   FAILED_PRECONDITION  a session that is not PREPARED (named, with its
  //                        group and state); nothing changes, every session
  //                        stays as it was
  //   the store's commit errors (RefitSlot::CommitLinked), naming the group:
  //                        nothing is copied and every session aborts
  static absl::StatusOr<std::vector<RefitResult>> CommitLinked(
      absl::Span<RefitSession* const> sessions);

  const std::string& refit_id() const { return options_.refit_id; }
  SessionState state() const;
  // As of the end of the last Ingest / Prepare / Commit / Abort (and of the
  // last chunk accepted, while its layer is processed). Never waits.
  SessionProgress progress() const;
  // The reason of the abort, or OK.
  absl::Status abort_status() const;

 private:
  // What a call leaves to do once its locks are released: events for the
  // store's listeners and, when the session finished, the slot to release
  // after them.
  struct Outbox {
    std::vector<StoreEvent> events;
    std::shared_ptr<RefitSlot> slot;
    bool release = false;
    void Deliver();
  };

  RefitSession(ShardStore* store, RefitOptions options, std::shared_ptr<RefitSlot> slot,
               std::unique_ptr<LayerProcessor> processor);

  absl::Status IngestLocked(const Chunk& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  absl::StatusOr<RefitResult> PrepareLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  absl::StatusOr<RefitResult> CommitLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  // The bytes to copy: every processed kernel.
  std::vector<StagedKernel> StagedKernelsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  // The committed session's result, state and event, after the store's copy.
  RefitResult CommittedLocked(const CommitStats& stats) ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  // CommitLinked with every session's call_mu_ taken in `order`.
  static absl::StatusOr<std::vector<RefitResult>> CommitLinkedLocked(
      absl::Span<RefitSession* const> sessions, const std::vector<size_t>& order,
      std::vector<Outbox>& outboxes) ABSL_NO_THREAD_SAFETY_ANALYSIS;
  // Commit of a session that received nothing: no copy, no new version.
  absl::StatusOr<RefitResult> CommitUnchangedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  // The committed state: staging freed, the slot released after the call.
  void EndCommittedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  // require_complete: FAILED_PRECONDITION naming checkpoint tensors of
  // layers that got nothing.
  absl::Status CheckAllLayersLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  absl::Status FinalizeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  // Aborts with `reason` unless already finished.
  void FailLocked(absl::Status reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  // Hands a complete layer to the worker, or processes it here.
  absl::Status ProcessCompleteLocked(int layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  absl::Status ProcessHereLocked(int layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  // An expert part (LayerSpec::parts) to the worker, or processed here.
  absl::Status ProcessPartLocked(int layer, int part) ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  absl::Status ProcessPartHereLocked(int layer, int part) ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  // Prepare of an experts layer some of whose experts came: the missing
  // ones keep their live bytes (listed as kept), partial ones fail or are
  // zero-filled as partial layers are.
  absl::Status FinishExpertsLocked(int layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  void RecordLocked(ProcessedLayer processed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  void CollectDoneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  // The assembler's hook before it allocates a layer's staging.
  absl::Status ReserveStagingLocked(const LayerSpec& layer, int64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  // The one place a RefitResult is built.
  RefitResult ResultLocked(uint64_t version, std::string fingerprint) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  void QueueEventLocked(StoreEventType type, std::string message = "")
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  // Refreshes the progress snapshot and takes the outbox; every public call
  // ends with it.
  Outbox EndCallLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  void RefreshProgressLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(call_mu_);
  absl::Status NotReceiving() const;
  SessionState StateNow() const;
  void SetState(SessionState state, absl::Status reason = absl::OkStatus());

  ShardStore* const store_;
  const ModelLayout& layout_;
  const RefitOptions options_;
  const absl::Time begin_time_;

  // Serializes the calls that change the session; held for their whole
  // duration, including waits for the worker. Taken before mu_.
  absl::Mutex call_mu_;
  std::shared_ptr<RefitSlot> slot_ ABSL_GUARDED_BY(call_mu_);
  // Used by the worker while it processes a layer, and by calls (at Prepare)
  // only once the worker is drained: never by two threads at once.
  const std::unique_ptr<LayerProcessor> processor_;
  LayerAssembler assembler_ ABSL_GUARDED_BY(call_mu_);
  LayerWorker worker_;                                               // thread-safe
  std::vector<ProcessedLayer> processed_ ABSL_GUARDED_BY(call_mu_);  // by layer; layer -1: none
  int64_t layers_done_ ABSL_GUARDED_BY(call_mu_) = 0;
  int64_t staged_kernel_bytes_ ABSL_GUARDED_BY(call_mu_) = 0;
  int64_t scales_reused_ ABSL_GUARDED_BY(call_mu_) = 0;
  int64_t amax_ahead_ ABSL_GUARDED_BY(call_mu_) = 0;
  int64_t peak_staging_bytes_ ABSL_GUARDED_BY(call_mu_) = 0;
  std::vector<std::string> kept_layers_ ABSL_GUARDED_BY(call_mu_);
  std::vector<std::string> partial_layers_ ABSL_GUARDED_BY(call_mu_);
  PhaseTimings timings_ ABSL_GUARDED_BY(call_mu_);
  absl::Time last_ingest_ ABSL_GUARDED_BY(call_mu_);
  Outbox outbox_ ABSL_GUARDED_BY(call_mu_);
  bool announced_ ABSL_GUARDED_BY(call_mu_) = false;

  // During a linked commit: the other refits of it (their stores and refit
  // ids). An Abort of this refit ends their waits for attached engines too,
  // so that it does not wait for them (the linked commit aborts as a
  // whole). Taken before the coordinators' locks.
  absl::Mutex linked_mu_;
  std::vector<std::pair<ShardStore*, std::string>> linked_ ABSL_GUARDED_BY(linked_mu_);

  // What other threads read without waiting for a call.
  mutable absl::Mutex mu_;
  SessionState state_ ABSL_GUARDED_BY(mu_) = SessionState::kReceiving;
  absl::Status abort_status_ ABSL_GUARDED_BY(mu_);
  SessionProgress progress_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::core

#endif  // REFIT_CORE_REFIT_SESSION_H_
