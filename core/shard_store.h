// ShardStore: owns the live kernel tensors of one model group on one device.
//
// Pipeline position: the end of a refit. RefitSession stages new kernel bytes
// and commits them through its RefitSlot, which copies them into the live tensors in
// place (data pointers never change, so engines holding raw pointers stay
// valid) and bumps the version. Readers (ReadKernel, engines attached through
// the server) see version N or N+1, never a mix: commit holds the writer side
// of a reader/writer lock for exactly the copy.
//
// This header is free of LibTorch so that the gRPC server can include it (the
// torch wheel ships protobuf headers that must never meet the server's).
// Tests and core internals reach the at::Tensor objects through
// core/shard_store_tensors.h.
//
// Lifecycle: Create allocates zeroed kernels, version 0 (nothing loaded).
// Each commit increments the version. One refit at a time holds the store's
// RefitSlot (AcquireRefitSlot); only the holder can publish refit events and
// commit, so a store's version changes only through one transaction at a time.
// Thread-safe.
#ifndef REFIT_CORE_SHARD_STORE_H_
#define REFIT_CORE_SHARD_STORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/model_layout.h"

namespace refit::core {

struct ShardStoreOptions {
  std::string group = "target";
  std::string device = "cpu";  // "cpu" or "cuda:N"
  // Host kernels are zero pages either way; true maps them in at Create (RSS
  // and the cost of faulting 4 KiB pages paid there, not in the first commit).
  // false leaves that to the first write: for a store that a snapshot
  // restore is about to fill anyway.
  bool prefault_host = true;
};

enum class StoreEventType { kStagingStarted, kPrepared, kCommitted, kAborted };

struct StoreEvent {
  StoreEventType type;
  std::string group;
  std::string refit_id;
  uint64_t version = 0;  // live version after the event
  std::string fingerprint;
  std::string message;  // abort reason, ...
  std::string label;    // the refit's label (RefitOptions::label)
  absl::Time time;
};

// A kernel's place in the store, for engines and tests. `data` is a device
// pointer when the store is on a GPU; it is stable for the store's lifetime.
struct KernelView {
  const KernelSpec* spec = nullptr;
  int layer = -1;
  void* data = nullptr;
  int64_t nbytes = 0;
  // Byte offset of the kernel in the store's arena data (see ArenaInfo).
  int64_t arena_offset = 0;
};

// Where the store's kernels live, for handing them to engine processes
// (core/arena.h). Host store: one sealed memfd holding the header and the
// kernels at kArenaDataOffset. GPU store: the same memfd holds only the
// header; the kernels are one device allocation exported as a CUDA IPC
// handle. Kernel i is at KernelView::arena_offset from the data start.
struct ArenaInfo {
  int64_t host_bytes = 0;   // the memfd's length (header + host data)
  int64_t data_bytes = 0;   // the kernels' region, alignment included
  bool on_device = false;   // data in device memory (ipc_handle), else in the memfd
  int device_index = -1;    // CUDA device of the data, -1 on the host
  std::string device_uuid;  // its UUID (16 bytes; empty on the host)
  std::string ipc_handle;   // cudaIpcMemHandle_t of the allocation base (GPU, ipc sharing)
  // GPU, vmm sharing: the allocation goes to engines as a descriptor
  // (ExportDeviceArenaFd) they map read-only, `device_mapped_bytes` long.
  bool device_vmm = false;
  int64_t device_mapped_bytes = 0;
  uint64_t layout_hash = 0;  // LayoutFingerprint as a number, also in the header
  bool sealed = false;       // F_SEAL_FUTURE_WRITE held (see HostArena::sealed)
};

// The live version's identity, read under one lock so that the number and
// the fingerprint always belong to the same version.
struct LiveVersion {
  uint64_t version = 0;
  std::string fingerprint;
  absl::Time last_commit;
};

struct CommitStats {
  uint64_t version = 0;
  std::string fingerprint;
  absl::Duration pause;  // time readers were held off
  int64_t bytes_copied = 0;
};

// Told of every commit of the store around its copy, on the committing
// thread, with no store lock held: the server's engine coordination
// (server/attach_*) quiesces attached engines in BeforeCommit and tells
// them of the new version in AfterCommit. Implementations are thread-safe.
class CommitCoordinator {
 public:
  virtual ~CommitCoordinator() = default;
  // Before the copy of `next_version`. An error stops the commit: nothing
  // is copied and the version stays. Use NotQuiescedError for engines that
  // did not reach their safe point, so that a PREPARED refit stays PREPARED.
  virtual absl::Status BeforeCommit(absl::string_view refit_id, uint64_t next_version) = 0;
  // The asking half of BeforeCommit, for a commit of several stores at one
  // commit point (a linked commit): every store's coordinator is asked
  // first, and then each one's BeforeCommit of the same refit and version
  // only waits, so that the engines of all the stores are asked at once
  // and the wait is one timeout, not one per store. An error is as
  // BeforeCommit's, with nothing asked. After an AskCommit that returned OK
  // comes that BeforeCommit, or AfterCommit with an error. Default: nothing
  // to ask ahead.
  virtual absl::Status AskCommit(absl::string_view refit_id, uint64_t next_version) {
    return absl::OkStatus();
  }
  // After an AskCommit, BeforeCommit returns once this store's engines
  // quiesced but the copy is not under way yet: the other stores' waits
  // come first, and an engine that attaches meanwhile is asked and waited
  // for too. ReadyToCopy: every engine asked has quiesced and no cancel
  // came (else BeforeCommit again, which waits for the newcomers or
  // returns the cancel). StartCopy: the copy begins; from here an engine
  // that attaches holds until Committed, unwaited for.
  virtual bool ReadyToCopy(absl::string_view refit_id) { return true; }
  virtual void StartCopy(absl::string_view refit_id) {}
  // After a commit that BeforeCommit let through: its stats once the new
  // version is visible, or the error that stopped it (nothing copied).
  virtual void AfterCommit(absl::string_view refit_id,
                           const absl::StatusOr<CommitStats>& result) = 0;
  // Ends a BeforeCommit of `refit_id` (empty: of whichever refit) that is
  // waiting, or makes the next one of the store's active refit `refit_id`
  // return at once: it returns ABORTED "refit "ID" aborted: <reason>" and
  // nothing is copied. No effect on a copy under way or done.
  virtual void CancelWait(absl::string_view refit_id, absl::string_view reason) {}
  // Ends the wait of `refit_id`'s commit if one is under way and not yet
  // copying (asked by AskCommit or waiting in BeforeCommit): its
  // BeforeCommit returns ABORTED "refit "ID" aborted: <reason>". Otherwise
  // no effect, and nothing is recorded. For a linked commit whose other
  // refit was aborted: this store's engines are not waited for.
  virtual void CancelLinkedWait(absl::string_view refit_id, absl::string_view reason) {}
  // Refuses every commit from now on (the daemon shuts down and ends the
  // engines' leases while their processes may still map the kernels): a
  // BeforeCommit waiting ends, and every later one returns ABORTED "refit
  // "ID" aborted: <reason>" at once, so that no commit copies without the
  // coordinated engines' ack. No effect on a copy under way or done.
  virtual void Close(absl::string_view reason) {}
};

// DEADLINE_EXCEEDED marked as "engines did not quiesce": RefitSession keeps
// a refit that was PREPARED before its Commit in PREPARED (Commit can be
// retried, or the refit aborted), and aborts a one-phase refit with ABORTED.
absl::Status NotQuiescedError(absl::string_view message);
bool IsNotQuiesced(const absl::Status& status);

// New bytes for one live kernel, staged in host memory or, for a store on a
// GPU, in device memory of the store's device.
struct StagedKernel {
  int kernel = -1;             // flattened kernel index (LayerSpec::first_kernel + k)
  const void* data = nullptr;  // nbytes of the kernel's dtype/shape
  bool on_device = false;      // data is a device pointer on the store's device
  uint64_t hash = 0;           // XXH3-64 of the bytes
};

// Where RefitSlot::RestoreInPlace writes the bytes it restores: straight
// into the live kernels of a host store; on a GPU store through a bounded
// page-locked bounce buffer and an upload per piece.
class RestoreTarget {
 public:
  virtual ~RestoreTarget() = default;
  // The live bytes of kernel `kernel` (flattened index) in host memory, or
  // nullptr for a store on a GPU (use bounce() and Upload()).
  virtual char* host_data(int kernel) const = 0;
  // GPU store: page-locked host memory for pieces of kernels on their way to
  // the device (a few MiB, never more than the kernels); empty for a host
  // store. Not thread-safe: one piece in flight at a time.
  virtual absl::Span<char> bounce() const = 0;
  // GPU store: copies `n` bytes at `src` (host memory) to kernel `kernel` at
  // byte `offset`, synchronously. INTERNAL with the CUDA error.
  virtual absl::Status Upload(int kernel, int64_t offset, const char* src, int64_t n) const = 0;
};

class ShardStore;
class ShardStoreImpl;  // holds the at::Tensor objects; see shard_store_tensors.h
class ScaleHints;

// The right to change a store: held by one refit at a time, released when
// destroyed. Move-only.
class RefitSlot {
 public:
  RefitSlot(RefitSlot&& other) noexcept;
  RefitSlot& operator=(RefitSlot&& other) noexcept;
  RefitSlot(const RefitSlot&) = delete;
  RefitSlot& operator=(const RefitSlot&) = delete;
  ~RefitSlot();

  const std::string& refit_id() const { return refit_id_; }
  ShardStore* store() const { return store_; }

  // Sends `event` to the store's listeners (group and, if unset, time filled
  // in), on the calling thread.
  void Publish(StoreEvent event) const;

  // Copies `staged` into the live tensors in place under the writer lock and
  // bumps the version. Errors (nothing copied, version unchanged):
  //   INTERNAL  an entry with an invalid kernel index, a null pointer, or
  //             device bytes for a store in host memory
  //   (device) the CUDA error of creating the commit stream, as its code
  absl::StatusOr<CommitStats> Commit(const std::vector<StagedKernel>& staged) const;

  // One store's part of a linked commit.
  struct LinkedPart {
    const RefitSlot* slot = nullptr;
    const std::vector<StagedKernel>* staged = nullptr;
  };
  // Commits several stores (the refits of several model groups) at one
  // commit point: every store's commit guard runs first, then the writer
  // locks of all the stores are taken in the order of their group names
  // (the one lock order of every multi-store operation), and they are
  // released only once every store holds its new version. A reader of one
  // store that sees a new version finds the new version in every other store
  // of the commit; a reader that sees an old one read before the commit
  // point. Results in the order of `parts`. Errors (nothing copied in any
  // store, versions unchanged):
  //   INVALID_ARGUMENT  no parts; a released slot; two parts on one store
  //   Commit's errors, and a commit guard's, prefixed with the group
  static absl::StatusOr<std::vector<CommitStats>> CommitLinked(absl::Span<const LinkedPart> parts);

  // Recovery: copies `staged` (every kernel, verified by the caller) into a
  // store that has never been committed, as version `version`; the next
  // commit is version + 1. Errors: FAILED_PRECONDITION when the store already
  // holds a version or `version` is 0; Commit's errors.
  absl::StatusOr<CommitStats> Restore(const std::vector<StagedKernel>& staged,
                                      uint64_t version) const;

  // Recovery without a staging copy: with the writer lock held (readers of
  // version 0 wait; nothing is served while it runs), `fill` writes every
  // kernel's bytes through the target and returns their XXH3-64s in layout
  // order, having verified them; then the version is published as
  // `version`, as Restore does. When `fill` fails, every kernel is zeroed
  // again (the state Create left: version 0, zero fingerprint), so unverified
  // bytes never stay in the live tensors, and its error is returned as is.
  // `fill` must not call the store. Errors: Restore's FAILED_PRECONDITION;
  // INTERNAL for a hash count that is not the kernel count; the bounce
  // buffer's CUDA error (nothing written); `fill`'s.
  using RestoreFill =
      absl::FunctionRef<absl::StatusOr<std::vector<uint64_t>>(const RestoreTarget&)>;
  absl::StatusOr<CommitStats> RestoreInPlace(uint64_t version, RestoreFill fill) const;

  // Gives the slot back now (idempotent); the destructor does the same.
  void Release();

  // Gives the slot back, then publishes `events` (a refit's closing events)
  // before any event of a refit that takes the slot next: a listener that
  // sees the closing event can start the next refit at once.
  void ReleaseAndPublish(std::vector<StoreEvent> events);

 private:
  friend class ShardStore;
  // CommitLinked with the parts checked and `order` sorted by group name.
  static absl::StatusOr<std::vector<CommitStats>> CommitLinkedLocked(
      absl::Span<const LinkedPart> parts,
      const std::vector<size_t>& order) ABSL_NO_THREAD_SAFETY_ANALYSIS;
  RefitSlot(ShardStore* store, std::string refit_id)
      : store_(store), refit_id_(std::move(refit_id)) {}
  ShardStore* store_ = nullptr;
  std::string refit_id_;
};

class ShardStore {
 public:
  // Errors:
  //   INVALID_ARGUMENT    no layout; a malformed device string
  //   UNAVAILABLE         the device is a GPU this process cannot use
  //   RESOURCE_EXHAUSTED  the kernels do not fit
  static absl::StatusOr<std::unique_ptr<ShardStore>> Create(
      std::shared_ptr<const ModelLayout> layout, ShardStoreOptions options);
  ~ShardStore();
  ShardStore(const ShardStore&) = delete;
  ShardStore& operator=(const ShardStore&) = delete;

  const ModelLayout& layout() const { return *layout_; }
  const std::shared_ptr<const ModelLayout>& shared_layout() const { return layout_; }
  const std::string& group() const { return options_.group; }
  const std::string& device() const { return options_.device; }
  bool on_gpu() const;
  // The CUDA device index of a GPU store, -1 for host memory.
  int device_index() const;

  uint64_t version() const;
  // XXH3-64 (16 hex digits) over the kernel layout and bytes of the live version.
  std::string fingerprint() const;
  absl::Time last_commit_time() const;
  // version(), fingerprint() and last_commit_time() of one version.
  LiveVersion live_version() const;

  // Kernels in layout order (flattened over layers).
  std::vector<KernelView> Kernels() const;
  // The arena the kernels live in (fixed for the store's lifetime).
  ArenaInfo arena() const;
  // A new read-only descriptor of the arena's memfd (the caller owns it):
  // what an attached engine maps. INTERNAL with the errno text.
  absl::StatusOr<int> OpenArenaReadOnly() const;
  // A new descriptor of the device arena's allocation (the caller owns it),
  // for an engine to import: only when arena().device_vmm, else
  // FAILED_PRECONDITION.
  absl::StatusOr<int> ExportDeviceArenaFd() const;
  // Every commit from now on goes through `coordinator` (nullptr: none).
  // Set before refits run or while none commits; the coordinator must
  // outlive the store or be reset first.
  void SetCommitCoordinator(CommitCoordinator* coordinator);
  // CommitCoordinator::CancelWait through the store's coordinator, if any:
  // a refit aborted while its commit waits for attached engines ends with
  // nothing copied instead of committing once they answer.
  void CancelCommitWait(absl::string_view refit_id, absl::string_view reason);
  // CommitCoordinator::CancelLinkedWait through the store's coordinator.
  void CancelLinkedCommitWait(absl::string_view refit_id, absl::string_view reason);
  // CommitCoordinator::Close through the store's coordinator, if any: no
  // commit copies from now on (shutdown).
  void CloseCommits(absl::string_view reason);
  // Copies kernel `name` to host memory under the reader lock, so the bytes
  // and *version belong to one version.
  // Errors: NOT_FOUND for unknown names; INTERNAL if copying a GPU kernel
  // back fails.
  absl::Status ReadKernel(absl::string_view name, std::string* out, uint64_t* version) const;
  // Copies bytes [offset, offset + length) of kernel `name` (clamped to its
  // size) under the reader lock, with the version they belong to: a reader
  // streaming a kernel piece by piece holds one piece at a time and compares
  // the versions to detect a commit in between.
  // Errors: NOT_FOUND for unknown names; OUT_OF_RANGE for an offset past the
  // end; INTERNAL if copying a GPU kernel back fails.
  // `fingerprint`, when not null, gets the fingerprint of `version`.
  absl::Status ReadKernelRange(absl::string_view name, int64_t offset, int64_t length,
                               std::string* out, uint64_t* version,
                               std::string* fingerprint = nullptr) const;
  // Runs `fn` with the reader lock held: the live version cannot change.
  void WithReaderLock(absl::FunctionRef<void(uint64_t version)> fn) const;
  // Runs `fn` while no event can go out: a listener registered in `fn` gets
  // every event published after what `fn` read of the store (a watch's
  // snapshot and its stream of events leave no gap). `fn` must not publish.
  void WithEventsHeld(absl::FunctionRef<void()> fn);

  // One version of every kernel, copied to host memory under the reader lock
  // (readers go on; a commit waits for the copy): `out` holds the kernels in
  // layout order, back to back (layout().kernel_bytes() bytes).
  struct KernelCopy {
    uint64_t version = 0;
    std::string fingerprint;
    std::vector<uint64_t> hashes;  // XXH3-64 per kernel, layout order
    absl::Time commit_time;
  };
  // Errors: INVALID_ARGUMENT if `out` is not kernel_bytes() long; INTERNAL
  // if copying a GPU kernel back fails.
  absl::StatusOr<KernelCopy> CopyKernels(absl::Span<char> out) const;

  // Called by every commit before it takes the writer lock, with the version
  // it will publish; an error fails the commit (nothing copied, version
  // unchanged). For recording versions durably before they become visible.
  // Set before the first refit; not thread-safe against running commits.
  using CommitGuard = std::function<absl::Status(uint64_t next_version)>;
  void SetCommitGuard(CommitGuard guard);
  // The next commit publishes at least `version` (a daemon that recovered
  // skips the numbers its previous run may have handed out).
  void SetNextVersionFloor(uint64_t version);

  // The store's refit slot for `refit_id`. ABORTED, naming the active refit,
  // if another refit holds it.
  absl::StatusOr<RefitSlot> AcquireRefitSlot(absl::string_view refit_id);
  // The refit id holding the slot, or "".
  std::string active_session() const;
  // The per-tensor FP8 scales its refits made, as hints for the next ones
  // (core/scale_hints.h). Thread-safe.
  ScaleHints* scale_hints() const { return scale_hints_.get(); }

  // Events go to every listener, one event at a time in the order they were
  // published, on the thread that caused them. Listeners must be cheap, must
  // not block and must not publish (nor begin a refit) themselves.
  using Listener = std::function<void(const StoreEvent&)>;
  int AddListener(Listener listener);
  void RemoveListener(int id);

 private:
  friend class RefitSlot;
  ShardStore(std::shared_ptr<const ModelLayout> layout, ShardStoreOptions options);
  void Publish(StoreEvent event);
  void PublishLocked(StoreEvent event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(publish_mu_);
  void ReleaseSlot(absl::string_view refit_id);
  void ReleaseSlotAndPublish(absl::string_view refit_id, std::vector<StoreEvent> events);

  std::shared_ptr<const ModelLayout> layout_;
  ShardStoreOptions options_;
  std::unique_ptr<ShardStoreImpl> impl_;
  const std::unique_ptr<ScaleHints> scale_hints_;
  CommitGuard commit_guard_;
  std::atomic<CommitCoordinator*> coordinator_{nullptr};

  mutable absl::Mutex session_mu_;
  std::string active_session_ ABSL_GUARDED_BY(session_mu_);

  // Held while events go out, so that listeners see them in one order.
  absl::Mutex publish_mu_ ABSL_ACQUIRED_BEFORE(session_mu_, listeners_mu_);
  mutable absl::Mutex listeners_mu_;
  std::vector<std::pair<int, Listener>> listeners_ ABSL_GUARDED_BY(listeners_mu_);
  int next_listener_id_ ABSL_GUARDED_BY(listeners_mu_) = 0;
};

}  // namespace refit::core

#endif  // REFIT_CORE_SHARD_STORE_H_
