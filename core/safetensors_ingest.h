// The one path from safetensors files into a refit: the first load from
// --model, the Reload RPC and tools all feed files through IngestSafetensors,
// so chunking, error messages and abort handling are the same everywhere.
//
// Tensors are read with pread and ingested in chunks of at most
// min(`chunk_bytes`, 4 MiB), whole elements each. A file that is truncated or
// rewritten while it is read fails the ingest (FAILED_PRECONDITION naming the
// file), it never faults the process.
//
// Thread-safety: the functions are reentrant; the session serializes itself.
#ifndef REFIT_CORE_SAFETENSORS_INGEST_H_
#define REFIT_CORE_SAFETENSORS_INGEST_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/refit_session.h"
#include "core/safetensors.h"

namespace refit::core {

struct SafetensorsIngestOptions {
  uint64_t chunk_bytes = uint64_t{64} << 20;
  // Called after each tensor with its bytes; a non-OK return stops the
  // ingest with that status (the caller decides whether to abort).
  std::function<absl::Status(const TensorEntry& tensor)> on_tensor;
  // Called when a file has been opened, before any of it is ingested; a
  // non-OK return stops the ingest with that status.
  std::function<absl::Status(const SafetensorsFile& file)> on_open;
  // Called after each file.
  std::function<void(const SessionProgress&)> on_file;
};

// Feeds every tensor of `files` into `session`, in file order.
// Errors: INVALID_ARGUMENT for no files or a zero chunk size; the file's
// SafetensorsFile::Open or Read error (FAILED_PRECONDITION for a file that
// changed while it was read); Ingest's error with the file's path in front
// (except an ABORTED status, which says why the session ended); the status
// on_tensor returned.
absl::Status IngestSafetensors(const std::vector<std::string>& files, RefitSession& session,
                               const SafetensorsIngestOptions& options);

// Begin + IngestSafetensors + Commit: loads a checkpoint into `store` as one
// refit. `on_progress` (optional) is called after each file.
// Errors: those of RefitSession::Begin, IngestSafetensors and
// RefitSession::Commit; the session is aborted on any of them.
absl::StatusOr<RefitResult> LoadSafetensors(
    ShardStore* store, const std::vector<std::string>& files, RefitOptions options,
    const std::function<void(const SessionProgress&)>& on_progress = nullptr);

}  // namespace refit::core

#endif  // REFIT_CORE_SAFETENSORS_INGEST_H_
