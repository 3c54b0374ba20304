// Reload's read path: IngestSafetensors (pread into a 4 MiB buffer, then
// Ingest) against the memory-mapped reader it replaced (Ingest straight from
// a MAP_PRIVATE mapping), on the same checkpoint in the same run, interleaved.
// The mapping is the reference: it is the copy-free way to read a file, but a
// file truncated under it kills the process with SIGBUS.
//
//   refit_ingest_bench --size_mib=1024 --reps=5 [--dir=/dev/shm/...]
//
// Each run is a whole refit on a host store: Begin, every tensor ingested
// (FP8 quantization of completed layers overlaps it), Prepare, Commit. The
// files sit in tmpfs by default, so both readers copy from the page cache, as
// a Reload of a checkpoint just written does.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "bench/core/bench_json.h"
#include "core/fixture_model.h"
#include "core/log.h"
#include "core/model_layout.h"
#include "core/refit_session.h"
#include "core/safetensors.h"
#include "core/safetensors_ingest.h"
#include "core/shard_store.h"

ABSL_FLAG(int64_t, size_mib, 1024, "checkpoint size in MiB (bf16)");
ABSL_FLAG(int, reps, 5, "repetitions of each reader (interleaved)");
ABSL_FLAG(std::string, dir, "",
          "where the checkpoint is written (default /dev/shm/refit-ingest-<pid>)");

namespace refit::bench {
namespace {

using core::ModelConfig;

[[noreturn]] void Die(const absl::Status& s, const std::string& what) {
  std::fprintf(stderr, "%s: %s\n", what.c_str(), s.ToString().c_str());
  std::exit(1);
}

ModelConfig Config(int64_t target_bytes) {
  ModelConfig c = core::FixtureConfig(core::Architecture::kLlama);
  c.hidden_size = 1024;
  c.intermediate_size = 2816;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 128;
  c.vocab_size = 8192;
  c.tie_word_embeddings = false;
  const int64_t h = c.hidden_size, i = c.intermediate_size;
  const int64_t kv = c.num_kv_heads * c.head_dim;
  const int64_t per_layer = 2 * (h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h);
  const int64_t fixed = 2 * (2 * c.vocab_size * h + h);
  c.num_layers = std::max<int64_t>(1, (target_bytes - fixed + per_layer - 1) / per_layer);
  return c;
}

// The old reader: every tensor ingested from the mapping, 64 MiB chunks.
absl::Status IngestMapped(const std::vector<std::string>& files, core::RefitSession& session) {
  for (const std::string& path : files) {
    absl::StatusOr<std::unique_ptr<core::SafetensorsFile>> file = core::SafetensorsFile::Open(path);
    if (!file.ok()) return file.status();
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    struct stat st;
    ::fstat(fd, &st);
    void* map = ::mmap(nullptr, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    if (map == MAP_FAILED) return absl::InternalError("mmap");
    const uint8_t* base = static_cast<const uint8_t*>(map);
    uint64_t header_len = 0;
    for (int i = 0; i < 8; ++i) header_len |= uint64_t{base[i]} << (8 * i);
    const uint8_t* data = base + 8 + header_len;
    for (const core::TensorEntry& t : (*file)->tensors()) {
      const uint64_t elem = core::DTypeSize(t.dtype);
      const uint64_t cap = (uint64_t{64} << 20) / elem * elem;
      for (uint64_t off = 0; off < t.nbytes; off += cap) {
        core::Chunk c;
        c.name = t.name;
        c.dtype = t.dtype;
        c.shape = t.shape;
        c.offset = off;
        c.data = absl::MakeConstSpan(data + t.offset + off, std::min(cap, t.nbytes - off));
        if (absl::Status s = session.Ingest(c); !s.ok()) {
          ::munmap(map, st.st_size);
          return s;
        }
      }
    }
    ::munmap(map, st.st_size);
  }
  return absl::OkStatus();
}

double Refit(core::ShardStore* store, const std::vector<std::string>& files, bool mapped) {
  const double t0 = NowSeconds();
  absl::StatusOr<std::unique_ptr<core::RefitSession>> session =
      core::RefitSession::Begin(store, core::RefitOptions{});
  if (!session.ok()) Die(session.status(), "Begin");
  absl::Status s =
      mapped ? IngestMapped(files, **session) : core::IngestSafetensors(files, **session, {});
  if (!s.ok()) Die(s, "ingest");
  absl::StatusOr<core::RefitResult> result = (*session)->Commit();
  if (!result.ok()) Die(result.status(), "Commit");
  return NowSeconds() - t0;
}

int Main() {
  core::SetMinLogSeverity(core::LogSeverity::kWarning);
  const int64_t bytes = absl::GetFlag(FLAGS_size_mib) << 20;
  std::string dir = absl::GetFlag(FLAGS_dir);
  if (dir.empty()) dir = absl::StrCat("/dev/shm/refit-ingest-", ::getpid());
  const ModelConfig config = Config(bytes);
  if (absl::Status s = core::WriteFixtureModel(dir, config, 1, 2); !s.ok()) Die(s, "fixture");
  absl::StatusOr<std::vector<std::string>> files = core::ListSafetensorsFiles(dir);
  if (!files.ok()) Die(files.status(), "list");
  absl::StatusOr<std::shared_ptr<const core::ModelLayout>> layout =
      core::ModelLayout::Build(config, core::ParallelConfig{}, core::QuantScheme::kPerTensor);
  if (!layout.ok()) Die(layout.status(), "layout");
  absl::StatusOr<std::unique_ptr<core::ShardStore>> store =
      core::ShardStore::Create(*layout, core::ShardStoreOptions{});
  if (!store.ok()) Die(store.status(), "store");
  Refit(store->get(), *files, false);  // warm-up: first version, page cache, allocator
  std::vector<double> pread_s, mapped_s;
  for (int r = 0; r < absl::GetFlag(FLAGS_reps); ++r) {
    pread_s.push_back(Refit(store->get(), *files, false));
    mapped_s.push_back(Refit(store->get(), *files, true));
  }
  // Not std::filesystem: libtorch.so exports its own copies of its symbols.
  if (std::system(absl::StrCat("rm -rf '", dir, "'").c_str()) != 0)
    Die(absl::InternalError(dir), "rm");
  const double gib = static_cast<double>(bytes) / (1 << 30);
  std::printf("checkpoint %.2f GiB in %zu files, %d reps, medians:\n", gib, files->size(),
              absl::GetFlag(FLAGS_reps));
  std::printf("  pread (IngestSafetensors)  %.3f s  %.2f GiB/s\n", Median(pread_s),
              gib / Median(pread_s));
  std::printf("  mmap (the old reader)      %.3f s  %.2f GiB/s\n", Median(mapped_s),
              gib / Median(mapped_s));
  std::printf("  pread / mmap time          %.3f\n", Median(pread_s) / Median(mapped_s));
  return 0;
}

}  // namespace
}  // namespace refit::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return refit::bench::Main();
}
