// Durable versions: snapshots of a ShardStore's committed kernels in a state
// directory, so that a restarted daemon serves the version it had committed
// (same number, same fingerprint, same bytes) instead of its --model source.
//
// Pipeline position: after a commit. SnapshotWriter listens to the store's
// "committed" events and, on its own thread, copies the live kernels into
// one host buffer under the store's reader lock (readers go on; only a
// commit that arrives during the copy waits for it), then writes the copy
// without any store lock. At start, RecoverFromSnapshots reads the newest
// snapshot whose layout matches straight into the live kernels of the store
// (which serves nothing yet; a GPU store's through a small pinned bounce
// buffer), verifying each kernel's XXH3 as it is read, and publishes it
// before the daemon turns ready; a snapshot that does not verify leaves the
// kernels zeroed again, as created.
//
// A snapshot is one file, "snapshot-<version, 20 digits>.refit":
//   refit-snapshot v1 <manifest bytes> <XXH3-64 of the manifest>\n
//   manifest: "key value" lines (group, version, fingerprint,
//             layout_fingerprint, refit_id, label, time, kernel_bytes,
//             kernels) and one "kernel <name> <nbytes> <XXH3-64>" line per
//             kernel in layout order (strings C-escaped)
//   the kernel bytes as served, back to back in layout order.
// It is written as ".snapshot-<version>.refit.tmp", fsynced, renamed and the
// directory fsynced; only then are older snapshots removed (the newest
// `keep` complete ones stay). The file "version" records, before a commit
// becomes visible, the highest version the daemon may have handed out, so
// numbers stay monotonic even when a snapshot is lost.
//
// Thread-safety: the free functions are reentrant (one writer per
// directory); SnapshotWriter is thread-safe.
#ifndef REFIT_CORE_SNAPSHOT_H_
#define REFIT_CORE_SNAPSHOT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/model_layout.h"
#include "core/shard_store.h"

namespace refit::core {

// XXH3-64 (16 hex digits) over what decides the kernel layout: the model
// config (architecture, sizes, checkpoint dtype, tied embeddings, biases),
// the tensor-parallel rank and size, the quant scheme, and every kernel's
// name, dtype and shape in layout order. A snapshot serves only a layout
// with the same value.
std::string LayoutFingerprint(const ModelLayout& layout);

struct SnapshotKernel {
  std::string name;
  int64_t nbytes = 0;
  uint64_t hash = 0;  // XXH3-64 of the bytes
};

struct SnapshotManifest {
  std::string group;
  uint64_t version = 0;
  std::string fingerprint;  // ShardStore::fingerprint() of the version
  std::string layout_fingerprint;
  std::string refit_id;
  std::string label;
  absl::Time time;  // when the version was committed
  int64_t kernel_bytes = 0;
  std::vector<SnapshotKernel> kernels;
};

// "snapshot-00000000000000000002.refit".
std::string SnapshotFileName(uint64_t version);

// A manifest for the copy of `store`'s kernels in `copy`.
SnapshotManifest ManifestFor(const ShardStore& store, const ShardStore::KernelCopy& copy,
                             std::string refit_id, std::string label);

struct SnapshotWriteHooks {
  // Test hook: after this many bytes of the file, log "snapshot write paused
  // (test hook)" and block until `cancelled` returns true; the write then
  // fails with CANCELLED, leaving the temporary file as a crash would.
  int64_t pause_after_bytes = -1;
  std::function<bool()> cancelled;  // polled while paused
};

// Writes `bytes` (manifest.kernel_bytes, the kernels back to back) as
// dir/SnapshotFileName(manifest.version), crash-safely (see above). Returns
// the path. Errors: INVALID_ARGUMENT if `bytes` has another size; INTERNAL
// for a failed create/write/fsync/rename (naming the file and errno; the
// temporary file is removed); CANCELLED from the test hook.
absl::StatusOr<std::string> WriteSnapshot(const std::string& dir, const SnapshotManifest& manifest,
                                          absl::Span<const char> bytes,
                                          const SnapshotWriteHooks& hooks = {});

// Reads the manifest of `path` (not the kernel bytes). Errors: NOT_FOUND /
// INTERNAL for I/O; DATA_LOSS for a file that is not a complete snapshot
// (header unreadable, manifest checksum mismatch, size not what the manifest
// says), naming what mismatched.
absl::StatusOr<SnapshotManifest> ReadSnapshotManifest(const std::string& path);

// Reads `path` into `bytes` (the kernel bytes, back to back) and verifies it
// against `layout`: every kernel's bytes against its recorded XXH3-64 and the
// version fingerprint against the recomputed one. Errors:
// ReadSnapshotManifest's; FAILED_PRECONDITION for a snapshot of another
// layout (layout fingerprints named); DATA_LOSS naming the kernel whose bytes
// do not match, or the fingerprint that does not.
absl::StatusOr<SnapshotManifest> ReadSnapshot(const std::string& path, const ModelLayout& layout,
                                              std::unique_ptr<char[]>* bytes);

// The highest version recorded in dir/version; 0 without the file.
// DATA_LOSS for a file that does not parse; INTERNAL for I/O.
absl::StatusOr<uint64_t> ReadVersionRecord(const std::string& dir);
// Replaces dir/version crash-safely. INTERNAL naming the failed step.
absl::Status WriteVersionRecord(const std::string& dir, uint64_t version);

enum class RecoveryPolicy {
  kFallback,  // a corrupt snapshot: log it, set it aside, try the previous one
  kFail,      // a corrupt snapshot: fail the start (nothing is renamed)
};
// "fallback" | "fail"; INVALID_ARGUMENT otherwise.
absl::StatusOr<RecoveryPolicy> ParseRecoveryPolicy(absl::string_view name);

struct RecoveryResult {
  std::optional<SnapshotManifest> restored;  // empty: nothing usable, load the model
  std::string path;                          // of the restored snapshot
  uint64_t highest_version = 0;              // seen in the directory (record, files)
  std::vector<std::string> rejected;         // "path: reason"
  absl::Duration read_time;                  // reading, verifying, restoring the restored one
};

// At start, before anything is committed to `store`: creates `dir` if
// needed, removes temporary files of interrupted writes, and restores the
// newest snapshot of `store`'s layout that verifies, as its own version
// (RefitSlot::RestoreInPlace: no staging copy; a snapshot that fails to
// verify leaves the store as Create left it).
// Snapshots of other layouts are skipped (WARNING). A corrupt one is logged
// as an ERROR naming the file and what mismatched; with kFallback it is
// renamed to "<name>.rejected" and the next older one is tried. Either way
// the store's next commit is numbered above every version seen
// (SetNextVersionFloor). Errors: INTERNAL for a directory that cannot be
// created or read; with kFail, DATA_LOSS naming the corrupt snapshot;
// Restore's errors.
absl::StatusOr<RecoveryResult> RecoverFromSnapshots(ShardStore* store, const std::string& dir,
                                                    RecoveryPolicy policy);

struct SnapshotWriterOptions {
  std::string dir;
  int keep = 2;  // complete snapshots kept: the newest and the one before
  SnapshotWriteHooks hooks;
};

// Snapshots every committed version of one store. Create installs a commit
// guard on the store (dir/version is updated before each commit becomes
// visible) and a listener for "committed" events. Commits that arrive while
// a snapshot is being written are coalesced: the writer then snapshots the
// newest version only. Extra memory: one host buffer of the store's
// kernel_bytes, allocated at the first snapshot and kept. The thread runs at
// nice 10 and the lowest best-effort I/O priority.
class SnapshotWriter {
 public:
  // Errors: INTERNAL when `options.dir` cannot be created or written.
  static absl::StatusOr<std::unique_ptr<SnapshotWriter>> Create(ShardStore* store,
                                                                SnapshotWriterOptions options);
  // Stop(), then removes the guard and the listener.
  ~SnapshotWriter();
  SnapshotWriter(const SnapshotWriter&) = delete;
  SnapshotWriter& operator=(const SnapshotWriter&) = delete;

  // Writes what is pending, then stops the thread. Idempotent.
  void Stop();
  // Blocks until version >= `version` is on disk, or `limit` passes.
  bool AwaitWritten(uint64_t version, absl::Duration limit) const;
  uint64_t last_written_version() const;

 private:
  struct Pending {
    uint64_t version = 0;
    std::string refit_id;
    std::string label;
  };
  SnapshotWriter(ShardStore* store, SnapshotWriterOptions options);
  void Notify(const StoreEvent& event);
  void Run();
  void WriteOne(const Pending& pending);
  void Prune(uint64_t newest);
  absl::Status Guard(uint64_t next_version);

  ShardStore* const store_;
  const SnapshotWriterOptions options_;
  int listener_id_ = -1;
  std::thread thread_;
  std::vector<char> buffer_;  // used by the thread only

  absl::Mutex record_mu_;  // commits are serialized by the slot; this orders them with Create
  uint64_t recorded_ ABSL_GUARDED_BY(record_mu_) = 0;

  mutable absl::Mutex mu_;
  std::optional<Pending> pending_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t written_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace refit::core

#endif  // REFIT_CORE_SNAPSHOT_H_
