#include "core/safetensors_ingest.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"

namespace refit::core {
namespace {

// Bytes per pread: a few MiB, so the buffer stays in cache between the read
// and the session's copy out of it.
constexpr uint64_t kIngestReadBytes = uint64_t{4} << 20;

}  // namespace

absl::Status IngestSafetensors(const std::vector<std::string>& files, RefitSession& session,
                               const SafetensorsIngestOptions& options) {
  if (files.empty()) return absl::InvalidArgumentError("no safetensors files to load");
  if (options.chunk_bytes == 0) return absl::InvalidArgumentError("chunk_bytes must be positive");
  // Tensors are read (pread) into one reusable buffer and ingested from
  // there; see SafetensorsFile for why not from a mapping.
  const uint64_t read_bytes = std::min(options.chunk_bytes, kIngestReadBytes);
  std::vector<uint8_t> buffer;
  for (const std::string& path : files) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
    if (!file.ok()) return file.status();
    if (options.on_open) {
      if (absl::Status s = options.on_open(**file); !s.ok()) return s;
    }
    for (const TensorEntry& tensor : (*file)->tensors()) {
      const uint64_t elem = DTypeSize(tensor.dtype);
      uint64_t offset = 0;
      do {
        uint64_t n = std::min(read_bytes, tensor.nbytes - offset);
        n -= n % elem;  // whole elements
        if (n == 0 && tensor.nbytes > offset) n = std::min(elem, tensor.nbytes - offset);
        if (buffer.size() < n) buffer.resize(n);
        absl::Span<uint8_t> bytes = absl::MakeSpan(buffer.data(), n);
        if (absl::Status read = (*file)->Read(tensor, offset, bytes); !read.ok()) return read;
        Chunk chunk;
        chunk.name = tensor.name;
        chunk.dtype = tensor.dtype;
        chunk.shape = tensor.shape;
        chunk.offset = offset;
        chunk.data = bytes;
        absl::Status ingested = session.Ingest(chunk);
        if (!ingested.ok()) {
          if (ingested.code() == absl::StatusCode::kAborted) return ingested;
          return absl::Status(ingested.code(), absl::StrCat(path, ": ", ingested.message()));
        }
        offset += n;
      } while (offset < tensor.nbytes);
      if (options.on_tensor) {
        if (absl::Status s = options.on_tensor(tensor); !s.ok()) return s;
      }
    }
    if (options.on_file) options.on_file(session.progress());
  }
  return absl::OkStatus();
}

absl::StatusOr<RefitResult> LoadSafetensors(
    ShardStore* store, const std::vector<std::string>& files, RefitOptions options,
    const std::function<void(const SessionProgress&)>& on_progress) {
  if (files.empty()) return absl::InvalidArgumentError("no safetensors files to load");
  absl::StatusOr<std::unique_ptr<RefitSession>> session = RefitSession::Begin(store, options);
  if (!session.ok()) return session.status();
  SafetensorsIngestOptions ingest;
  ingest.on_file = on_progress;
  absl::Status status = IngestSafetensors(files, **session, ingest);
  if (!status.ok()) {
    (*session)->Abort(status.message());
    return status;
  }
  return (*session)->Commit();
}

}  // namespace refit::core
