// moe_bench: refits of a mixture-of-experts model against a dense model of
// the same size, in process, interleaved, medians of several repetitions.
//
//   time     whole refits (Begin, Ingest*, Commit; FP8 per-tensor, default
//            RefitOptions) of a Qwen3-MoE model of about 1 GiB (bf16; 16
//            experts a layer) and of a Llama of the same size (refit_core_bench's
//            shapes: hidden 1024, intermediate 2816, more layers): seconds per
//            GiB of the MoE model vs the dense one (target: at most 15% slower;
//            below 0.85 it is faster).
//   staging  the MoE refit's peak high-precision staging (the session's own
//            RefitResult::peak_staging_bytes) vs one whole experts layer in
//            high precision, what layer-granular buffering holds (target
//            <= 0.25), and vs ModelLayout::staging_bound_bytes (<= 1).
//
// Both models are sent in checkpoint order (each expert's tensors together),
// in chunks of --chunk_bytes, from one pool of random bf16. Prints one JSON
// object on stdout, {"figures": [...], "series": {...}}, as refit_core_bench.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "bench/core/bench_json.h"
#include "core/fixture_model.h"
#include "core/log.h"
#include "core/model_layout.h"
#include "core/refit_session.h"
#include "core/shard_store.h"

ABSL_FLAG(int64_t, size_mib, 1024, "model size in MiB (bf16 checkpoint bytes)");
ABSL_FLAG(int64_t, experts, 16, "experts a layer");
ABSL_FLAG(int, reps, 3, "repetitions of each model's refit (interleaved)");
ABSL_FLAG(int64_t, chunk_bytes, int64_t{32} << 20, "largest chunk");
ABSL_FLAG(int, quantize_threads, 0, "RefitOptions::quantize_threads of both refits (0: default)");

namespace refit::bench {
namespace {

using core::ModelConfig;
using core::ModelLayout;

constexpr int64_t kPoolBytes = int64_t{256} << 20;

[[noreturn]] void Die(const absl::Status& status, const std::string& what) {
  std::fprintf(stderr, "moe_bench: %s: %s\n", what.c_str(), status.ToString().c_str());
  std::exit(1);
}

struct Chunked {
  const core::CheckpointTensor* tensor;
  uint64_t offset;
  absl::Span<const uint8_t> data;
};

struct Model {
  std::string label;
  std::shared_ptr<const ModelLayout> layout;
  std::unique_ptr<core::ShardStore> store;
  std::vector<Chunked> chunks;
  int64_t bytes = 0;
};

// Same hidden size, heads and vocabulary; the layer count makes the size.
ModelConfig Config(bool moe, int64_t experts, int64_t target_bytes) {
  ModelConfig c =
      core::FixtureConfig(moe ? core::Architecture::kQwen3Moe : core::Architecture::kLlama);
  c.hidden_size = 1024;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 128;
  c.vocab_size = 8192;
  const int64_t expert_i = 768;
  c.intermediate_size = moe ? experts * expert_i : 2816;
  if (moe) {
    c.num_experts = experts;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = expert_i;
  }
  const int64_t h = c.hidden_size;
  const int64_t kv = c.num_kv_heads * c.head_dim;
  const int64_t per_layer = 2 * (h * (h + 2 * kv) + h * h + 3 * h * c.intermediate_size);
  const int64_t fixed = 2 * 2 * c.vocab_size * h;
  c.num_layers = std::max<int64_t>(1, (target_bytes - fixed + per_layer / 2) / per_layer);
  return c;
}

Model MakeModel(bool moe, int64_t experts, int64_t target_bytes, const std::vector<uint16_t>& pool,
                int64_t chunk_bytes) {
  Model m;
  absl::StatusOr<std::shared_ptr<const ModelLayout>> layout = ModelLayout::Build(
      Config(moe, experts, target_bytes), core::ParallelConfig{}, core::QuantScheme::kPerTensor);
  if (!layout.ok()) Die(layout.status(), "layout");
  m.layout = *layout;
  absl::StatusOr<std::unique_ptr<core::ShardStore>> store =
      core::ShardStore::Create(m.layout, core::ShardStoreOptions{});
  if (!store.ok()) Die(store.status(), "store");
  m.store = *std::move(store);
  const auto* base = reinterpret_cast<const uint8_t*>(pool.data());
  int64_t cursor = 0;
  for (const core::CheckpointTensor& ct : m.layout->checkpoint_tensors()) {
    if (ct.use != core::CheckpointTensor::Use::kTarget || ct.optional) continue;
    const int64_t nbytes = ct.nbytes();
    if (nbytes > kPoolBytes) Die(absl::InternalError(ct.name), "tensor larger than the pool");
    if (cursor + nbytes > kPoolBytes) cursor = 0;
    const uint8_t* src = base + cursor;
    cursor += (nbytes + 63) / 64 * 64;
    for (int64_t off = 0; off < nbytes; off += chunk_bytes) {
      const int64_t n = std::min(chunk_bytes, nbytes - off);
      m.chunks.push_back({&ct, static_cast<uint64_t>(off), absl::MakeConstSpan(src + off, n)});
    }
    m.bytes += nbytes;
  }
  m.label =
      absl::StrCat(moe ? "moe" : "dense", "-", static_cast<int64_t>(m.bytes / kMiB + 0.5), "MiB");
  return m;
}

core::RefitOptions Options() {
  core::RefitOptions options;
  options.quantize_threads = absl::GetFlag(FLAGS_quantize_threads);
  return options;
}

core::RefitResult Refit(Model& m, double* seconds) {
  const double t0 = NowSeconds();
  absl::StatusOr<std::unique_ptr<core::RefitSession>> session =
      core::RefitSession::Begin(m.store.get(), Options());
  if (!session.ok()) Die(session.status(), "Begin");
  for (const Chunked& p : m.chunks) {
    core::Chunk c;
    c.name = p.tensor->name;
    c.dtype = p.tensor->dtype;
    c.shape = p.tensor->shape;
    c.offset = p.offset;
    c.data = p.data;
    if (absl::Status s = (*session)->Ingest(c); !s.ok()) Die(s, "Ingest");
  }
  absl::StatusOr<core::RefitResult> result = (*session)->Commit();
  if (!result.ok()) Die(result.status(), "Commit");
  *seconds = NowSeconds() - t0;
  return *result;
}

int Run() {
  core::SetMinLogSeverity(core::LogSeverity::kWarning);
  const int64_t target = absl::GetFlag(FLAGS_size_mib) << 20;
  const int64_t experts = absl::GetFlag(FLAGS_experts);
  const int64_t chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  std::vector<uint16_t> pool(kPoolBytes / 2);
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<float> dist(-0.1f, 0.1f);
  for (uint16_t& v : pool) {
    const float f = dist(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    v = static_cast<uint16_t>(bits >> 16);
  }
  Model dense = MakeModel(false, experts, target, pool, chunk_bytes);
  Model moe = MakeModel(true, experts, target, pool, chunk_bytes);
  std::fprintf(stderr, "moe_bench: %s vs %s, %d repetitions\n", moe.label.c_str(),
               dense.label.c_str(), absl::GetFlag(FLAGS_reps));
  // A first refit of each (the first load: kernels faulted in), untimed.
  double ignored = 0;
  Refit(dense, &ignored);
  Refit(moe, &ignored);
  std::vector<double> dense_s, moe_s;
  // Per-phase seconds per GiB (RefitResult::timings), for where time goes.
  std::vector<double> dense_quantize, moe_quantize, dense_finalize, moe_finalize;
  core::RefitResult last;
  for (int r = 0; r < absl::GetFlag(FLAGS_reps); ++r) {
    double s = 0;
    core::RefitResult d = Refit(dense, &s);
    dense_s.push_back(s / (dense.bytes / kGiB));
    dense_quantize.push_back(absl::ToDoubleSeconds(d.timings.quantize) / (dense.bytes / kGiB));
    dense_finalize.push_back(absl::ToDoubleSeconds(d.timings.finalize) / (dense.bytes / kGiB));
    last = Refit(moe, &s);
    moe_s.push_back(s / (moe.bytes / kGiB));
    moe_quantize.push_back(absl::ToDoubleSeconds(last.timings.quantize) / (moe.bytes / kGiB));
    moe_finalize.push_back(absl::ToDoubleSeconds(last.timings.finalize) / (moe.bytes / kGiB));
  }
  int64_t layer_bytes = 0;
  for (const core::LayerSpec& l : moe.layout->layers()) {
    if (l.kind == core::LayerKind::kExperts) layer_bytes = std::max(layer_bytes, l.param_bytes());
  }
  const double t_moe = Median(moe_s), t_dense = Median(dense_s);
  const double ratio = t_moe / t_dense;
  std::vector<Figure> figures;
  Figure time = MakeFigure(
      "moe_refit_s_per_gib", t_moe, "s/GiB", "dense_refit_s_per_gib", t_dense, ratio, "<= 1.15",
      absl::StrCat(moe.label, " (", experts, " experts a layer) vs ", dense.label,
                   "; met: not more than 15% slower (a ratio below 0.85 "
                   "means the MoE refit is faster)"));
  figures.push_back(time);
  const double peak = static_cast<double>(last.peak_staging_bytes);
  figures.push_back(MakeFigure("moe_peak_staging_bytes", peak, "bytes", "moe_layer_bf16_bytes",
                               static_cast<double>(layer_bytes), peak / layer_bytes, "<= 0.25",
                               "peak high-precision staging vs one whole experts layer"));
  const double bound = static_cast<double>(moe.layout->staging_bound_bytes());
  figures.push_back(MakeFigure("moe_peak_staging_vs_bound", peak, "bytes",
                               "ModelLayout::staging_bound_bytes", bound, peak / bound, "<= 1"));
  nlohmann::json out;
  out["figures"] = nlohmann::json::array();
  for (const Figure& f : figures) out["figures"].push_back(ToJson(f));
  out["series"] = {{"moe_s_per_gib", moe_s},
                   {"dense_s_per_gib", dense_s},
                   {"moe_quantize_s_per_gib", moe_quantize},
                   {"dense_quantize_s_per_gib", dense_quantize},
                   {"moe_finalize_s_per_gib", moe_finalize},
                   {"dense_finalize_s_per_gib", dense_finalize}};
  std::printf("%s\n", out.dump(1).c_str());
  return 0;
}

}  // namespace
}  // namespace refit::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return refit::bench::Run();
}
