// RefitSession: one refit transaction against a ShardStore.
//
// Pipeline position: the server's Push handler (one stream = one session), the
// Reload handler and first load from disk all drive the same object:
//   Begin -> Ingest(chunk)* -> Prepare -> Commit      (or Abort at any point)
// Ingest routes each chunk through NameMapper to its layer's high-precision
// staging buffer (allocated on the layer's first chunk, in the checkpoint
// dtype, TP slice only). When a layer's last element arrives it is processed
// at once (FP8 quantization into staged kernel bytes) and the high-precision
// buffer is freed. Prepare finalizes: layers that got nothing keep their old
// values (listed in the result), attention scales are rebuilt, and any
// checkpoint tensor that is incomplete fails the session. Commit copies the
// staged kernels into the live tensors in place and bumps the version.
//
// Guarantees: nothing is visible before Commit; any error or Abort leaves the
// live version unchanged bit for bit and frees all staging. High-precision
// staging is bounded by RefitOptions::staging_budget_bytes
// (RESOURCE_EXHAUSTED beyond it; the session is then aborted).
//
// Errors of Ingest (the session is aborted on any of them, except where
// noted, so that nothing is half-applied):
//   NOT_FOUND           unknown tensor name
//   INVALID_ARGUMENT    dtype not fp32/fp16/bf16 (or not the checkpoint's
//                       for non-float tensors), shape differs from the
//                       layout's, offset or size not element-aligned,
//                       overlapping chunk, checksum mismatch, non-finite
//                       weights under NonFinitePolicy::kReject
//   ALREADY_EXISTS      a chunk repeats a byte range already received
//   OUT_OF_RANGE        chunk runs past the end of the tensor
//   RESOURCE_EXHAUSTED  staging budget exceeded, or out of device memory
//                       while staging on a GPU
//   FAILED_PRECONDITION the session is no longer receiving
// Errors of Prepare: DATA_LOSS for a tensor received only in part;
// FAILED_PRECONDITION for a layer missing whole tensors (unless
// allow_partial_layers).
//
// Thread-safety: all methods may be called from any thread; calls are
// serialized internally, and Abort may be called while another thread is in
// Ingest (it takes effect when that call returns).
#ifndef REFIT_CORE_REFIT_SESSION_H_
#define REFIT_CORE_REFIT_SESSION_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/dtype.h"
#include "core/fp8_quantizer.h"
#include "core/shard_store.h"

namespace refit::core {

struct RefitOptions {
  std::string refit_id;                  // generated when empty
  std::optional<uint64_t> base_version;  // FAILED_PRECONDITION at Begin if live differs
  int64_t staging_budget_bytes = int64_t{4} << 30;
  NonFinitePolicy non_finite = NonFinitePolicy::kReject;
  bool allow_partial_layers = false;  // zero-fill missing tensors (vLLM behaviour)
  int quantize_threads = 0;
  // Quantize complete layers on a worker thread while later chunks arrive.
  // Ingest returns once the worker has taken a completed layer, so at most
  // one complete layer waits on the quantizer (bounded memory).
  bool overlap_processing = true;
};

// A byte range of one checkpoint tensor, as the trainer sends it.
struct Chunk {
  absl::string_view name;
  DType dtype = DType::kBFloat16;
  absl::Span<const int64_t> shape;  // the full tensor's shape
  uint64_t offset = 0;              // byte offset within the full tensor
  absl::Span<const uint8_t> data;
  std::optional<uint64_t> xxh3;  // XXH3-64 of `data`, checked when present
};

enum class SessionState { kReceiving, kPrepared, kCommitted, kAborted };
absl::string_view SessionStateName(SessionState state);

struct PhaseTimings {
  absl::Duration receive;   // Begin to the last Ingest
  absl::Duration quantize;  // total time in layer processing
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
  int64_t peak_staging_bytes = 0;
};

class RefitSessionImpl;

class RefitSession {
 public:
  // ABORTED naming the active refit if the store has one;
  // FAILED_PRECONDITION if options.base_version differs from the live version.
  static absl::StatusOr<std::unique_ptr<RefitSession>> Begin(ShardStore* store,
                                                             RefitOptions options);
  // Aborts unless committed.
  ~RefitSession();
  RefitSession(const RefitSession&) = delete;
  RefitSession& operator=(const RefitSession&) = delete;

  absl::Status Ingest(const Chunk& chunk);
  // Finalizes everything; the session is then PREPARED (nothing visible yet).
  absl::Status Prepare();
  // Prepares if needed, then commits in place.
  absl::StatusOr<RefitResult> Commit();
  // Idempotent. Frees staging and releases the store's session slot.
  void Abort(absl::string_view reason);

  const std::string& refit_id() const;
  SessionState state() const;
  SessionProgress progress() const;
  // The reason of the abort, or OK.
  absl::Status abort_status() const;

 private:
  explicit RefitSession(std::unique_ptr<RefitSessionImpl> impl);
  std::unique_ptr<RefitSessionImpl> impl_;
};

// Loads a checkpoint's safetensors files through a RefitSession: the first
// load and the daemon's Reload share every line after the reader. Tensors are
// fed straight from the mapping in chunks of at most `chunk_bytes`.
// `on_progress` (optional) is called after each file.
absl::StatusOr<RefitResult> LoadSafetensors(
    ShardStore* store, const std::vector<std::string>& files, RefitOptions options,
    const std::function<void(const SessionProgress&)>& on_progress = nullptr,
    bool prepare_only = false, std::unique_ptr<RefitSession>* prepared = nullptr);

}  // namespace refit::core

#endif  // REFIT_CORE_REFIT_SESSION_H_
