// Fuzz target: a sequence of chunks and calls against a RefitSession on a CPU
// ShardStore holding a small fixture model (Llama-shaped, the demo model's
// architecture at a quarter of its sizes so that an execution stays well
// under a millisecond; the vocabulary, 100, still needs padding).
//
// Input: one options byte (non-finite policy, partial layers, the worker
// thread, a staging budget), then operations of 7 bytes:
//   [op] [tensor] [variant] [offset hi, lo] [length hi, lo]
// op % 8: 0-3 ingest a chunk, 4 ingest every remaining tensor whole,
// 5 Prepare, 6 Commit, 7 Abort. A chunk is a byte range of one fixture tensor
// (or, by `variant`, of a renamed / re-typed / re-shaped / overlapping one,
// with a right or wrong checksum, or with bytes taken from the input itself).
// The session ends with the input (its destructor aborts it).
//
// Checks, on every input: Begin succeeds (the previous input's session gave
// the refit slot back); a session that did not commit leaves the live
// version and fingerprint as they were; a commit moves the version forward
// and the store's fingerprint is the one the commit returned; every error
// code is one that the session's API lists.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/fixture_model.h"
#include "core/log.h"
#include "core/model_layout.h"
#include "core/refit_session.h"
#include "core/shard_store.h"
#include "fuzz/fuzz_check.h"
#include "xxhash.h"

namespace {

using refit::core::Chunk;
using refit::core::DType;
using refit::core::OwnedTensor;
using refit::core::RefitSession;
using refit::core::ShardStore;

struct Fixture {
  std::unique_ptr<ShardStore> store;
  std::vector<OwnedTensor> weights;
};

const Fixture& GetFixture() {
  static const Fixture* const fixture = [] {
    // Most inputs abort their refit, each with a warning: keep only errors.
    refit::core::SetMinLogSeverity(refit::core::LogSeverity::kError);
    refit::core::ModelConfig config = refit::core::FixtureConfig();
    config.hidden_size = 64;
    config.intermediate_size = 96;
    config.num_layers = 1;
    config.num_heads = 2;
    config.num_kv_heads = 1;
    config.head_dim = 32;
    config.vocab_size = 100;
    auto layout = refit::core::ModelLayout::Build(config, {}, refit::core::QuantScheme::kPerTensor);
    FUZZ_CHECK(layout.ok());
    auto store = ShardStore::Create(*layout, {});
    FUZZ_CHECK(store.ok());
    auto weights = refit::core::MakeFixtureWeights(config, 1);
    FUZZ_CHECK(weights.ok());
    return new Fixture{*std::move(store), *std::move(weights)};
  }();
  return *fixture;
}

bool Documented(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kFailedPrecondition:
      return true;
    default:
      return false;
  }
}

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool empty() const { return pos_ >= size_; }
  uint8_t Byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  uint16_t U16() { return static_cast<uint16_t>(Byte() << 8 | Byte()); }
  // Up to `n` of the remaining input bytes (consumed).
  absl::Span<const uint8_t> Take(size_t n) {
    n = std::min(n, size_ - std::min(pos_, size_));
    absl::Span<const uint8_t> span(data_ + pos_, n);
    pos_ += n;
    return span;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Fixture& fixture = GetFixture();
  ShardStore* store = fixture.store.get();
  const std::vector<OwnedTensor>& weights = fixture.weights;
  Input in(data, size);

  const uint8_t flags = in.Byte();
  refit::core::RefitOptions options;
  options.non_finite = (flags & 1) ? refit::core::NonFinitePolicy::kVllmCompatible
                                   : refit::core::NonFinitePolicy::kReject;
  options.allow_partial_layers = (flags & 2) != 0;
  options.overlap_processing = (flags & 4) != 0;
  options.quantize_threads = 1;
  if (flags & 8) options.staging_budget_bytes = 16 << 10;  // below the MLP layer
  if (flags & 16) options.base_version = store->version() + ((flags & 32) ? 1 : 0);

  const uint64_t version_before = store->version();
  const std::string fingerprint_before = store->fingerprint();
  auto begun = RefitSession::Begin(store, options);
  if (!begun.ok()) {
    // Only a base_version that is not the live one may refuse: the slot is free.
    FUZZ_CHECK(begun.status().code() == absl::StatusCode::kAborted);
    FUZZ_CHECK(options.base_version.has_value() && *options.base_version != version_before);
    return 0;
  }
  std::unique_ptr<RefitSession> session = *std::move(begun);

  std::vector<bool> sent(weights.size(), false);
  bool committed = false;
  std::string committed_fingerprint;
  uint64_t committed_version = 0;
  std::vector<int64_t> shape;
  std::string name;
  std::vector<uint8_t> bytes;
  for (int ops = 0; !in.empty() && ops < 64; ++ops) {
    const uint8_t op = in.Byte() % 8;
    const uint8_t which = in.Byte();
    const uint8_t variant = in.Byte();
    const uint16_t offset_arg = in.U16();
    const uint16_t length_arg = in.U16();
    absl::Status status;
    if (op <= 3) {
      const size_t index = which % weights.size();
      const OwnedTensor& t = weights[index];
      Chunk chunk;
      name = t.name;
      shape = t.shape;
      chunk.dtype = t.dtype;
      const size_t elem = refit::core::DTypeSize(t.dtype);
      uint64_t offset = (static_cast<uint64_t>(offset_arg) * elem) % (t.bytes.size() + elem);
      uint64_t length = std::min<uint64_t>(static_cast<uint64_t>(length_arg + 1) * elem,
                                           t.bytes.size() - std::min(offset, t.bytes.size()));
      bytes.assign(t.bytes.begin() + std::min(offset, t.bytes.size()),
                   t.bytes.begin() + std::min(offset + length, t.bytes.size()));
      switch (variant % 16) {
        case 0:
          name += "x";
          break;
        case 1:
          name = name.substr(0, name.size() / 2);
          break;
        case 2:
          chunk.dtype = DType::kFloat32;
          break;
        case 3:
          chunk.dtype = DType::kInt8;
          break;
        case 4:
          if (!shape.empty()) shape[0] += 1;
          break;
        case 5:
          shape.push_back(1);
          break;
        case 6:
          offset += 1;
          break;  // not element-aligned
        case 7:
          offset = uint64_t{1} << 62;
          break;   // far past the end
        case 8: {  // the input's own bytes
          absl::Span<const uint8_t> raw = in.Take(length_arg % 512);
          bytes.assign(raw.begin(), raw.end());
          break;
        }
        case 9:
          if (!bytes.empty()) bytes.pop_back();
          break;  // partial element
        default:
          break;
      }
      chunk.name = name;
      chunk.shape = shape;
      chunk.offset = offset;
      chunk.data = absl::MakeConstSpan(bytes);
      if (variant & 0x10) chunk.xxh3 = XXH3_64bits(bytes.data(), bytes.size());
      if (variant & 0x20) chunk.xxh3 = XXH3_64bits(bytes.data(), bytes.size()) ^ 1;
      status = session->Ingest(chunk);
      if (status.ok() && variant % 16 >= 10 && offset == 0 && length == t.bytes.size()) {
        sent[index] = true;
      }
    } else if (op == 4) {
      for (size_t i = 0; i < weights.size() && status.ok(); ++i) {
        if (sent[i]) continue;
        const OwnedTensor& t = weights[i];
        Chunk chunk;
        chunk.name = t.name;
        chunk.dtype = t.dtype;
        chunk.shape = t.shape;
        chunk.data = absl::MakeConstSpan(t.bytes);
        status = session->Ingest(chunk);
        sent[i] = true;
      }
    } else if (op == 5) {
      status = session->Prepare().status();
    } else if (op == 6) {
      absl::StatusOr<refit::core::RefitResult> result = session->Commit();
      status = result.status();
      if (result.ok()) {
        committed = true;
        committed_version = result->version;
        committed_fingerprint = result->fingerprint;
      }
    } else {
      session->Abort("fuzz");
    }
    if (!status.ok()) FUZZ_CHECK(Documented(status));
  }
  session.reset();  // aborts unless committed; gives the slot back

  if (committed) {
    FUZZ_CHECK(committed_version >= version_before);
    FUZZ_CHECK(store->version() == committed_version);
    FUZZ_CHECK(store->fingerprint() == committed_fingerprint);
  } else {
    FUZZ_CHECK(store->version() == version_before);
    FUZZ_CHECK(store->fingerprint() == fingerprint_before);
  }
  return 0;
}
