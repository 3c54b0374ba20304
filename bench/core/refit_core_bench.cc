// refit_core_bench: the refit engine in process, each figure against a
// reference measured in the same run, reference and subject interleaved,
// medians of several repetitions (the machine is shared and noisy).
//
//   commit     ShardStoreImpl::CommitStaged of every kernel of the 1 GiB model
//              (the readers' pause, CommitStats::pause) vs a plain memcpy of
//              the same staged bytes into the same live tensors.
//   assembler  RefitSession::Ingest of every chunk, then Prepare (so the
//              worker has processed every layer), for QuantScheme::kNone and
//              FP8 per-tensor, vs a memcpy of the same chunk bytes into a
//              pre-faulted buffer of the model's size.
//   scaling    whole refits (Begin, Ingest*, Commit) of synthetic Llama models
//              of about 256 MiB, 1 GiB and 4 GiB (bf16), interleaved by size,
//              with the default RefitOptions and with the staging budget at
//              2 x the largest layer; per-GiB time of each vs the mean over sizes.
//   memory     peak RSS over idle RSS during one more refit of each size and
//              variant (the host staging pool emptied and freed heap returned
//              first with malloc_trim, VmHWM reset through
//              /proc/self/clear_refs, so every staging byte the refit needs
//              is counted, not only what the pool lacked) vs the bound
//              kernel bytes + 2 x largest layer (checkpoint format) + chunk.
//
// A plain main rather than Google Benchmark: Google Benchmark runs one
// benchmark after the other, and on a shared 2-core machine the drift between
// a subject and a reference measured a minute apart is larger than the
// effects we look for. Prints one JSON object on stdout:
//   {"figures": [...], "series": {...}}
// Models use the same shapes at every size (hidden 1024, intermediate 2816,
// 8 heads of 128, 2 kv heads, vocab 8192); only the layer count changes.
// Chunk data comes from a 256 MiB pool of random bf16 (larger than the
// caches), the same pool for every tensor.
#include <malloc.h>

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
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "bench/core/bench_json.h"
#include "core/fixture_model.h"
#include "core/log.h"
#include "core/model_layout.h"
#include "core/refit_session.h"
#include "core/shard_store.h"
#include "core/staging_buffer.h"

ABSL_FLAG(std::string, sizes, "256,1024,4096", "model sizes in MiB (bf16 checkpoint bytes)");
ABSL_FLAG(int, reps, 3, "repetitions of each scaling refit (interleaved by size)");
ABSL_FLAG(int, commit_reps, 9, "repetitions of commit and of its memcpy reference");
ABSL_FLAG(int, assembler_reps, 5, "repetitions of each assembler run and its memcpy");
ABSL_FLAG(int64_t, chunk_bytes, int64_t{32} << 20,
          "largest chunk (the client library's default bucket)");
ABSL_FLAG(std::string, only, "commit,assembler,scaling", "which parts to run");

namespace refit::bench {
namespace {

using core::Chunk;
using core::ModelConfig;
using core::ModelLayout;
using core::QuantScheme;
using core::RefitOptions;
using core::RefitResult;
using core::RefitSession;
using core::ShardStore;
using core::StagingBuffer;

constexpr int64_t kPoolBytes = int64_t{256} << 20;

[[noreturn]] void Die(const absl::Status& status, const std::string& what) {
  std::fprintf(stderr, "refit_core_bench: %s: %s\n", what.c_str(), status.ToString().c_str());
  std::exit(1);
}

// Random bf16 values in about [-0.1, 0.1], all finite.
class SourcePool {
 public:
  SourcePool() : data_(kPoolBytes / 2) {
    std::mt19937_64 rng(42);
    std::uniform_real_distribution<float> dist(-0.1f, 0.1f);
    for (uint16_t& v : data_) {
      float f = dist(rng);
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof(bits));
      v = static_cast<uint16_t>(bits >> 16);
    }
  }
  // `bytes` of pool, starting where the previous call stopped (wrapping), so
  // consecutive tensors read different memory.
  const uint8_t* Take(int64_t bytes) {
    const auto* base = reinterpret_cast<const uint8_t*>(data_.data());
    if (bytes > kPoolBytes) return nullptr;
    if (cursor_ + bytes > kPoolBytes) cursor_ = 0;
    const uint8_t* p = base + cursor_;
    cursor_ += (bytes + 63) / 64 * 64;
    return p;
  }

 private:
  std::vector<uint16_t> data_;
  int64_t cursor_ = 0;
};

ModelConfig BenchConfig(int64_t target_bytes) {
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

struct PlannedChunk {
  const core::CheckpointTensor* tensor;
  uint64_t offset;
  absl::Span<const uint8_t> data;
};

struct Model {
  std::string label;
  std::shared_ptr<const ModelLayout> layout;
  std::unique_ptr<ShardStore> store;
  std::vector<PlannedChunk> chunks;
  int64_t checkpoint_bytes = 0;
  int64_t largest_chunk = 0;
};

Model MakeModel(int64_t target_bytes, QuantScheme scheme, SourcePool& pool, int64_t chunk_bytes) {
  Model m;
  ModelConfig config = BenchConfig(target_bytes);
  absl::StatusOr<std::shared_ptr<const ModelLayout>> layout =
      ModelLayout::Build(config, core::ParallelConfig{}, scheme);
  if (!layout.ok()) Die(layout.status(), "layout");
  m.layout = *layout;
  absl::StatusOr<std::unique_ptr<ShardStore>> store =
      ShardStore::Create(m.layout, core::ShardStoreOptions{});
  if (!store.ok()) Die(store.status(), "store");
  m.store = *std::move(store);
  for (const core::CheckpointTensor& ct : m.layout->checkpoint_tensors()) {
    if (ct.use != core::CheckpointTensor::Use::kTarget || ct.optional) continue;
    const int64_t nbytes = ct.nbytes();
    const uint8_t* src = pool.Take(nbytes);
    if (src == nullptr) Die(absl::InternalError(ct.name), "tensor larger than the pool");
    const int64_t elem = static_cast<int64_t>(core::DTypeSize(ct.dtype));
    const int64_t cap = std::max<int64_t>(chunk_bytes / elem, 1) * elem;
    for (int64_t off = 0; off < nbytes; off += cap) {
      const int64_t n = std::min(cap, nbytes - off);
      m.chunks.push_back({&ct, static_cast<uint64_t>(off), absl::MakeConstSpan(src + off, n)});
      m.largest_chunk = std::max(m.largest_chunk, n);
    }
    m.checkpoint_bytes += nbytes;
  }
  m.label = absl::StrCat(static_cast<int64_t>(m.checkpoint_bytes / kMiB + 0.5), "MiB");
  return m;
}

struct RefitRun {
  double ingest_s = 0;   // Begin .. last Ingest returned
  double prepare_s = 0;  // Prepare (drains the worker, finalizes)
  double commit_s = 0;   // Commit (the copy and bookkeeping)
  double total_s = 0;
  RefitResult result;
  int64_t idle_rss = 0;
  int64_t peak_rss = 0;
};

// commit=false: Prepare then Abort (nothing becomes visible).
// measure_memory: empties the host staging pool (which otherwise keeps the
// previous refit's staging resident, so that the peak would show only what
// this refit adds to it) and returns freed heap to the system (malloc_trim)
// first, so that peak RSS over idle RSS counts every byte the refit needs;
// timing runs skip it, as a daemon would between back-to-back refits.
RefitRun RunRefit(Model& m, bool commit, bool measure_memory, int64_t staging_budget = 0) {
  RefitRun run;
  if (measure_memory) {
    StagingBuffer::TrimHostPool(absl::InfiniteFuture());
    malloc_trim(0);
    ResetPeakRss("self");
    run.idle_rss = ProcStatusBytes("self", "VmRSS");
  }
  RefitOptions options;
  if (staging_budget > 0) options.staging_budget_bytes = staging_budget;
  const double t0 = NowSeconds();
  absl::StatusOr<std::unique_ptr<RefitSession>> session =
      RefitSession::Begin(m.store.get(), options);
  if (!session.ok()) Die(session.status(), "Begin");
  for (const PlannedChunk& p : m.chunks) {
    Chunk c;
    c.name = p.tensor->name;
    c.dtype = p.tensor->dtype;
    c.shape = p.tensor->shape;
    c.offset = p.offset;
    c.data = p.data;
    absl::Status s = (*session)->Ingest(c);
    if (!s.ok()) Die(s, "Ingest");
  }
  const double t1 = NowSeconds();
  absl::Status prepared = (*session)->Prepare().status();
  if (!prepared.ok()) Die(prepared, "Prepare");
  const double t2 = NowSeconds();
  if (commit) {
    absl::StatusOr<RefitResult> result = (*session)->Commit();
    if (!result.ok()) Die(result.status(), "Commit");
    run.result = *result;
  } else {
    (*session)->Abort("benchmark: ingest only");
  }
  const double t3 = NowSeconds();
  session->reset();
  run.ingest_s = t1 - t0;
  run.prepare_s = t2 - t1;
  run.commit_s = t3 - t2;
  run.total_s = t3 - t0;
  if (measure_memory) run.peak_rss = ProcStatusBytes("self", "VmHWM");
  return run;
}

// memcpy of every chunk into `dst` (the chunks' total size, pre-faulted).
double MemcpyChunks(const Model& m, std::vector<uint8_t>& dst) {
  const double t0 = NowSeconds();
  size_t at = 0;
  for (const PlannedChunk& p : m.chunks) {
    std::memcpy(dst.data() + at, p.data.data(), p.data.size());
    at += p.data.size();
  }
  const double t1 = NowSeconds();
  // Keep the copy observable.
  volatile uint8_t sink = dst[at / 2];
  (void)sink;
  return t1 - t0;
}

void RunCommit(Model& m, int reps, std::vector<Figure>& figures, nlohmann::json& series) {
  // The bench holds the store's refit slot, as a session does, and commits
  // through it.
  absl::StatusOr<core::RefitSlot> slot = m.store->AcquireRefitSlot("bench-commit");
  if (!slot.ok()) Die(slot.status(), "AcquireRefitSlot");
  std::vector<core::KernelView> views = m.store->Kernels();
  // Staged bytes: random, touched, one buffer per kernel (as a session holds them).
  std::vector<std::vector<uint8_t>> buffers(views.size());
  std::vector<core::StagedKernel> staged(views.size());
  std::mt19937_64 rng(7);
  int64_t total = 0;
  for (size_t k = 0; k < views.size(); ++k) {
    buffers[k].resize(static_cast<size_t>(std::max<int64_t>(views[k].nbytes, 1)));
    for (size_t b = 0; b + 8 <= buffers[k].size(); b += 4096) {
      const uint64_t r = rng();
      std::memcpy(&buffers[k][b], &r, 8);
    }
    staged[k].kernel = static_cast<int>(k);
    staged[k].data = buffers[k].data();
    staged[k].hash = rng();
    total += views[k].nbytes;
  }
  std::vector<double> pause, wall, copy;
  auto run_commit = [&] {
    const double t0 = NowSeconds();
    absl::StatusOr<core::CommitStats> stats = slot->Commit(staged);
    const double t1 = NowSeconds();
    if (!stats.ok()) Die(stats.status(), "CommitStaged");
    pause.push_back(absl::ToDoubleSeconds(stats->pause));
    wall.push_back(t1 - t0);
  };
  auto run_copy = [&] {
    const double t0 = NowSeconds();
    for (size_t k = 0; k < views.size(); ++k) {
      std::memcpy(views[k].data, staged[k].data, static_cast<size_t>(views[k].nbytes));
    }
    copy.push_back(NowSeconds() - t0);
  };
  run_commit();  // warm-up of both (page tables, caches)
  run_copy();
  pause.clear();
  wall.clear();
  copy.clear();
  for (int r = 0; r < reps; ++r) {
    if (r % 2 == 0) {
      run_commit();
      run_copy();
    } else {
      run_copy();
      run_commit();
    }
  }
  const double p = Median(pause), c = Median(copy), w = Median(wall);
  figures.push_back(MakeFigure(
      "commit pause (" + m.label + " model, " + std::to_string(views.size()) + " kernels, " +
          absl::StrCat(static_cast<int64_t>(total / kMiB + 0.5)) + " MiB)",
      p * 1e3, "ms", "memcpy of the same kernel bytes", c * 1e3, p / c, "<= 1.2",
      absl::StrCat("CommitStaged wall incl. checks: ", w * 1e3, " ms")));
  series["commit"] = {{"kernel_bytes", total},
                      {"pause_s", pause},
                      {"wall_s", wall},
                      {"memcpy_s", copy},
                      {"pause_gbps", total / p / 1e9},
                      {"memcpy_gbps", total / c / 1e9}};
}

void RunAssembler(Model& none_model, Model& fp8_model, int reps, std::vector<Figure>& figures,
                  nlohmann::json& series) {
  std::vector<uint8_t> dst(static_cast<size_t>(fp8_model.checkpoint_bytes));
  std::memset(dst.data(), 1, dst.size());  // pre-fault
  std::vector<double> t_none, t_none_ingest, t_fp8, t_fp8_ingest, t_copy;
  // Warm-up (first-touch of everything, worker thread creation paths).
  RunRefit(none_model, false, false);
  RunRefit(fp8_model, false, false);
  MemcpyChunks(fp8_model, dst);
  for (int r = 0; r < reps; ++r) {
    t_copy.push_back(MemcpyChunks(fp8_model, dst));
    RefitRun a = RunRefit(none_model, false, false);
    t_none.push_back(a.ingest_s + a.prepare_s);
    t_none_ingest.push_back(a.ingest_s);
    RefitRun b = RunRefit(fp8_model, false, false);
    t_fp8.push_back(b.ingest_s + b.prepare_s);
    t_fp8_ingest.push_back(b.ingest_s);
  }
  const double bytes = static_cast<double>(fp8_model.checkpoint_bytes);
  const double copy_gbps = bytes / Median(t_copy) / 1e9;
  const double none_gbps = bytes / Median(t_none) / 1e9;
  const double fp8_gbps = bytes / Median(t_fp8) / 1e9;
  const double fp8_ingest_gbps = bytes / Median(t_fp8_ingest) / 1e9;
  figures.push_back(MakeFigure("assembler Ingest+Prepare, quant none (" + fp8_model.label + ")",
                               none_gbps, "GB/s", "memcpy of the same chunk bytes", copy_gbps,
                               none_gbps / copy_gbps, ""));
  figures.push_back(MakeFigure("assembler Ingest+Prepare, FP8 per-tensor (" + fp8_model.label + ")",
                               fp8_gbps, "GB/s", "memcpy of the same chunk bytes", copy_gbps,
                               fp8_gbps / copy_gbps, "",
                               absl::StrCat("Ingest calls alone: ", fp8_ingest_gbps,
                                            " GB/s (quantization overlaps on the "
                                            "worker)")));
  series["assembler"] = {{"bytes", bytes},           {"memcpy_s", t_copy},
                         {"none_s", t_none},         {"none_ingest_s", t_none_ingest},
                         {"fp8_s", t_fp8},           {"fp8_ingest_s", t_fp8_ingest},
                         {"memcpy_gbps", copy_gbps}, {"none_gbps", none_gbps},
                         {"fp8_gbps", fp8_gbps}};
}

// Two variants, interleaved: the default RefitOptions (4 GiB staging budget),
// and the staging budget at 2 x the largest layer (refitd --staging-budget),
// which makes Ingest wait for the worker instead of queueing layers.
void RunScaling(std::vector<Model>& models, int reps, int64_t chunk_bytes,
                std::vector<Figure>& figures, nlohmann::json& series) {
  const size_t n = models.size();
  auto tight = [&](size_t i) { return 2 * models[i].layout->max_layer_param_bytes(); };
  std::vector<std::vector<RefitRun>> runs(n), runs_tight(n);
  for (size_t i = 0; i < n; ++i) RunRefit(models[i], true, false);  // warm-up
  for (int r = 0; r < reps; ++r) {
    for (size_t i = 0; i < n; ++i) {
      if (r % 2 == 0) {
        runs[i].push_back(RunRefit(models[i], true, false));
        runs_tight[i].push_back(RunRefit(models[i], true, false, tight(i)));
      } else {
        runs_tight[i].push_back(RunRefit(models[i], true, false, tight(i)));
        runs[i].push_back(RunRefit(models[i], true, false));
      }
    }
  }
  // Memory: one more refit of each, with freed heap returned first.
  std::vector<RefitRun> mem_default(n), mem_tight(n);
  for (size_t i = 0; i < n; ++i) {
    mem_default[i] = RunRefit(models[i], true, true);
    mem_tight[i] = RunRefit(models[i], true, true, tight(i));
  }

  nlohmann::json variants = nlohmann::json::object();
  for (int v = 0; v < 2; ++v) {
    const std::string variant = v == 0 ? "default" : "budget_2_layers";
    const std::string what = v == 0 ? "default options" : "staging budget 2 x largest layer";
    std::vector<std::vector<RefitRun>>& rs = v == 0 ? runs : runs_tight;
    std::vector<RefitRun>& mem = v == 0 ? mem_default : mem_tight;
    std::vector<double> per_gib(n);
    double mean = 0;
    nlohmann::json points = nlohmann::json::array();
    for (size_t i = 0; i < n; ++i) {
      std::vector<double> total, ingest, prepare, commit, quantize;
      for (const RefitRun& run : rs[i]) {
        total.push_back(run.total_s);
        ingest.push_back(run.ingest_s);
        prepare.push_back(run.prepare_s);
        commit.push_back(run.commit_s);
        quantize.push_back(absl::ToDoubleSeconds(run.result.timings.quantize));
      }
      const double gib = models[i].checkpoint_bytes / kGiB;
      per_gib[i] = Median(total) / gib;
      mean += per_gib[i] / static_cast<double>(n);
      const ModelLayout& layout = *models[i].layout;
      points.push_back({{"label", models[i].label},
                        {"gib", gib},
                        {"layers", layout.config().num_layers},
                        {"total_s", total},
                        {"ingest_s", ingest},
                        {"prepare_s", prepare},
                        {"commit_s", commit},
                        {"quantize_s", quantize},
                        {"median_total_s", Median(total)},
                        {"extra_rss_bytes", mem[i].peak_rss - mem[i].idle_rss},
                        {"peak_staging_bytes", mem[i].result.peak_staging_bytes},
                        {"kernel_bytes", layout.kernel_bytes()},
                        {"max_layer_param_bytes", layout.max_layer_param_bytes()}});
    }
    for (size_t i = 0; i < n; ++i) {
      Figure f =
          MakeFigure("in-process refit time per GiB, " + what + ", " + models[i].label + " model",
                     per_gib[i], "s/GiB", "mean over sizes", mean, per_gib[i] / mean, "",
                     absl::StrCat(points[i]["layers"].get<int64_t>(), " layers, median ",
                                  points[i]["median_total_s"].get<double>(), " s"));
      f.target = "within +-15% of the mean";
      f.met = std::abs(per_gib[i] / mean - 1.0) <= 0.15;
      figures.push_back(f);
    }
    for (size_t i = 0; i < n; ++i) {
      const ModelLayout& layout = *models[i].layout;
      const double bound = static_cast<double>(layout.kernel_bytes() +
                                               2 * layout.max_layer_param_bytes() + chunk_bytes);
      const double peak = static_cast<double>(mem[i].peak_rss - mem[i].idle_rss);
      figures.push_back(
          MakeFigure("in-process refit peak extra RSS, " + what + ", " + models[i].label + " model",
                     peak / kMiB, "MiB", "kernel + 2 x largest layer + chunk", bound / kMiB,
                     peak / bound, "<= 1.0",
                     absl::StrCat("kernel ", layout.kernel_bytes() / kMiB, " MiB, largest layer ",
                                  layout.max_layer_param_bytes() / kMiB, " MiB, chunk ",
                                  chunk_bytes / kMiB, " MiB; session peak staging ",
                                  mem[i].result.peak_staging_bytes / kMiB, " MiB")));
    }
    variants[variant] = points;
  }
  series["scaling"] = variants["default"];
  series["scaling_budget_2_layers"] = variants["budget_2_layers"];
}

int Run() {
  core::SetMinLogSeverity(core::LogSeverity::kWarning);
  const std::string only = absl::GetFlag(FLAGS_only);
  const int64_t chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  std::vector<int64_t> sizes;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_sizes), ',', absl::SkipEmpty())) {
    int64_t mib = 0;
    if (!absl::SimpleAtoi(s, &mib) || mib <= 0) {
      std::fprintf(stderr, "refit_core_bench: bad --sizes entry '%s'\n", std::string(s).c_str());
      return 2;
    }
    sizes.push_back(mib << 20);
  }
  std::vector<Figure> figures;
  nlohmann::json series = nlohmann::json::object();
  SourcePool pool;
  const int64_t mid = int64_t{1} << 30;

  if (only.find("commit") != std::string::npos || only.find("assembler") != std::string::npos) {
    Model fp8 = MakeModel(mid, QuantScheme::kPerTensor, pool, chunk_bytes);
    if (only.find("commit") != std::string::npos) {
      std::fprintf(stderr, "refit_core_bench: commit (%s)\n", fp8.label.c_str());
      RunCommit(fp8, absl::GetFlag(FLAGS_commit_reps), figures, series);
    }
    if (only.find("assembler") != std::string::npos) {
      Model none = MakeModel(mid, QuantScheme::kNone, pool, chunk_bytes);
      std::fprintf(stderr, "refit_core_bench: assembler (%s)\n", fp8.label.c_str());
      RunAssembler(none, fp8, absl::GetFlag(FLAGS_assembler_reps), figures, series);
    }
  }
  if (only.find("scaling") != std::string::npos && !sizes.empty()) {
    std::vector<Model> models;
    for (int64_t size : sizes) {
      models.push_back(MakeModel(size, QuantScheme::kPerTensor, pool, chunk_bytes));
    }
    std::fprintf(stderr, "refit_core_bench: scaling\n");
    RunScaling(models, absl::GetFlag(FLAGS_reps), chunk_bytes, figures, series);
  }

  nlohmann::json out;
  out["figures"] = nlohmann::json::array();
  for (const Figure& f : figures) out["figures"].push_back(ToJson(f));
  out["series"] = series;
  std::printf("%s\n", out.dump(1).c_str());
  return 0;
}

}  // namespace
}  // namespace refit::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return refit::bench::Run();
}
