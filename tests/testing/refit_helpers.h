// Test helpers for driving core refits: build a store for the fixture model,
// push its weights in shuffled chunks, snapshot the live bytes.
#ifndef REFIT_TESTS_TESTING_REFIT_HELPERS_H_
#define REFIT_TESTS_TESTING_REFIT_HELPERS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/fixture_model.h"
#include "core/model_layout.h"
#include "core/refit_session.h"
#include "core/shard_store.h"

namespace refit::testing {

inline std::unique_ptr<core::ShardStore> MakeStore(
    const core::ModelConfig& config, core::ParallelConfig parallel = {},
    core::QuantScheme quant = core::QuantScheme::kPerTensor) {
  absl::StatusOr<std::shared_ptr<const core::ModelLayout>> layout =
      core::ModelLayout::Build(config, parallel, quant);
  if (!layout.ok()) return nullptr;
  absl::StatusOr<std::unique_ptr<core::ShardStore>> store =
      core::ShardStore::Create(*layout, core::ShardStoreOptions{});
  if (!store.ok()) return nullptr;
  return *std::move(store);
}

struct PendingChunk {
  const core::OwnedTensor* tensor;
  uint64_t offset;
  uint64_t size;
};

// Splits every tensor into chunks of random whole-element sizes in
// [1, max_elements] and returns them in a random order (seeded).
inline std::vector<PendingChunk> ShuffledChunks(const std::vector<core::OwnedTensor>& tensors,
                                                uint64_t seed, int64_t max_elements) {
  std::mt19937_64 rng(seed);
  std::vector<PendingChunk> chunks;
  for (const core::OwnedTensor& t : tensors) {
    uint64_t elem = core::DTypeSize(t.dtype);
    uint64_t offset = 0;
    while (offset < t.bytes.size()) {
      uint64_t n = std::uniform_int_distribution<int64_t>(1, max_elements)(rng) * elem;
      n = std::min<uint64_t>(n, t.bytes.size() - offset);
      chunks.push_back({&t, offset, n});
      offset += n;
    }
  }
  std::shuffle(chunks.begin(), chunks.end(), rng);
  return chunks;
}

inline core::Chunk ToChunk(const PendingChunk& p) {
  core::Chunk chunk;
  chunk.name = p.tensor->name;
  chunk.dtype = p.tensor->dtype;
  chunk.shape = p.tensor->shape;
  chunk.offset = p.offset;
  chunk.data = absl::MakeConstSpan(p.tensor->bytes.data() + p.offset, p.size);
  return chunk;
}

// Whole tensors, in order, one chunk each.
inline absl::Status IngestAll(core::RefitSession& session,
                              const std::vector<core::OwnedTensor>& tensors) {
  for (const core::OwnedTensor& t : tensors) {
    absl::Status s = session.Ingest(ToChunk({&t, 0, t.bytes.size()}));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

inline absl::StatusOr<core::RefitResult> PushAll(core::ShardStore& store,
                                                 const std::vector<core::OwnedTensor>& tensors,
                                                 core::RefitOptions options = {}) {
  absl::StatusOr<std::unique_ptr<core::RefitSession>> session =
      core::RefitSession::Begin(&store, std::move(options));
  if (!session.ok()) return session.status();
  absl::Status s = IngestAll(**session, tensors);
  if (!s.ok()) return s;
  return (*session)->Commit();
}

// Every live kernel's bytes, by name.
inline std::map<std::string, std::string> Snapshot(const core::ShardStore& store) {
  std::map<std::string, std::string> bytes;
  for (const core::KernelView& k : store.Kernels()) {
    std::string out;
    uint64_t version = 0;
    if (store.ReadKernel(k.spec->name, &out, &version).ok()) bytes[k.spec->name] = out;
  }
  return bytes;
}

// The same values as a bf16 tensor, widened to fp32 (exact).
inline core::OwnedTensor WidenBf16ToF32(const core::OwnedTensor& t) {
  core::OwnedTensor out{t.name, core::DType::kFloat32, t.shape, {}};
  out.bytes.resize(t.bytes.size() * 2);
  for (size_t i = 0; i < t.bytes.size() / 2; ++i) {
    uint16_t half;
    std::memcpy(&half, t.bytes.data() + 2 * i, 2);
    const uint32_t bits = uint32_t{half} << 16;
    std::memcpy(out.bytes.data() + 4 * i, &bits, 4);
  }
  return out;
}

}  // namespace refit::testing

#endif  // REFIT_TESTS_TESTING_REFIT_HELPERS_H_
