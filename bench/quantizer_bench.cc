// FP8 quantizer throughput on 256 MiB of bf16 ([8192, 16384]), per scheme:
//   Ours      core::QuantizeFp8 with `threads` threads
//   TorchOps  the LibTorch op chain of the same math (as the unit tests'
//             reference, with in-place ops where the math allows, which only
//             helps torch), at::set_num_threads(threads)
//   Memcpy    copying the 256 MiB input, split over `threads` threads
// bytes_per_second counts input + output bytes (bf16 in, fp8 out) for the
// quantizers and bytes read + written for memcpy, so Ours / Memcpy is the
// fraction of copy bandwidth the quantizer reaches.
//
// Default run: 20-60 s on a 2-core machine; the ratios (ours / torch, ours /
// memcpy at the same thread count) are printed after the table. Arguments:
// scheme (0 per tensor, 1 per channel, 2 block), threads. Figures from a busy
// machine are noise: use --benchmark_repetitions=5 (ratios use the medians).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <map>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/fp8_quantizer.h"
#include "core/fp8_quantizer_internal.h"

namespace refit::core {
namespace {

constexpr int64_t kRows = 8192;
constexpr int64_t kCols = 16384;
constexpr int64_t kInputBytes = kRows * kCols * 2;
constexpr int64_t kOutputBytes = kRows * kCols;

constexpr QuantScheme kSchemes[] = {QuantScheme::kPerTensor, QuantScheme::kPerChannel,
                                    QuantScheme::kBlock128};

struct Data {
  at::Tensor x;            // bf16 [kRows, kCols]
  std::vector<uint8_t> q;  // our output (pages touched up front)
  std::vector<float> scales;
  std::vector<uint8_t> copy;  // memcpy destination
};

Data& GetData() {
  static Data* data = [] {
    auto* d = new Data;
    at::manual_seed(0);
    d->x = at::empty({kRows, kCols}, at::kBFloat16);
    // In slices, so that setup never holds a float32 copy of the whole input.
    for (int64_t r = 0; r < kRows; r += 1024) {
      d->x.slice(0, r, r + 1024).copy_(at::randn({1024, kCols}, at::kFloat) * 0.02);
    }
    d->q.assign(kOutputBytes, 0);
    d->scales.assign(Fp8NumScales(QuantScheme::kBlock128, kRows, kCols) + kRows, 0.0f);
    d->copy.assign(kInputBytes, 0);
    return d;
  }();
  return *data;
}

int DefaultThreads() {
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

void RunOurs(benchmark::State& state, QuantScheme scheme, int threads) {
  Data& data = GetData();
  Fp8QuantizeOptions options;
  options.scheme = scheme;
  options.num_threads = threads;
  for (auto _ : state) {
    absl::Status status = QuantizeFp8(data.x.data_ptr(), DType::kBFloat16, kRows, kCols, options,
                                      data.q.data(), data.scales.data(), "bench");
    if (!status.ok()) {
      state.SkipWithError(std::string(status.message()).c_str());
      break;
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * (kInputBytes + kOutputBytes));
  state.SetLabel(absl::StrCat(QuantSchemeName(scheme), " threads=", threads,
                              " isa=", internal::Fp8IsaName(internal::ActiveFp8Isa())));
}

void BM_Ours(benchmark::State& state) {
  RunOurs(state, kSchemes[state.range(0)], static_cast<int>(state.range(1)));
}

// A model's weights, one call each, as a refit quantizes them: the 47 layers
// of the 1 GiB benchmark model (hidden 1024, intermediate 2816, 8 heads, 2 of
// them for k/v): q/k/v [1536, 1024], o [1024, 1024], gate/up [5632, 1024] and
// down [1024, 2816], laid end to end in 1 GiB of bf16, so every call reads
// from memory as a push does. Per-tensor, `threads` threads, the output
// hashed as a refit hashes it when the second argument is 1. Against
// BM_Ours/0 (one 256 MiB tensor) it shows what 188 calls of a few MiB cost.
struct ModelWeights {
  std::vector<std::pair<int64_t, int64_t>> shapes;  // rows, cols of each weight
  std::vector<uint16_t> input;                      // bf16 bits, end to end
  std::vector<uint8_t> output;
  std::vector<float> scales;
  int64_t elements = 0;
};

ModelWeights& GetModelWeights() {
  static ModelWeights* data = [] {
    auto* d = new ModelWeights;
    for (int layer = 0; layer < 47; ++layer) {
      for (auto shape :
           {std::pair<int64_t, int64_t>{1536, 1024}, {1024, 1024}, {5632, 1024}, {1024, 2816}}) {
        d->shapes.push_back(shape);
        d->elements += shape.first * shape.second;
      }
    }
    // Values spread over [-0.02, 0.02): a multiplicative hash of the index.
    d->input.resize(d->elements);
    for (int64_t i = 0; i < d->elements; ++i) {
      const uint32_t h = static_cast<uint32_t>(i) * 2654435761u;
      const float v = (static_cast<float>(h >> 16) / 65536.0f - 0.5f) * 0.04f;
      uint32_t bits;
      std::memcpy(&bits, &v, sizeof bits);
      d->input[i] = static_cast<uint16_t>(bits >> 16);
    }
    d->output.assign(d->elements, 0);
    d->scales.assign(d->shapes.size(), 0.0f);
    return d;
  }();
  return *data;
}

void BM_OursModel(benchmark::State& state) {
  ModelWeights& data = GetModelWeights();
  Fp8QuantizeOptions options;
  options.scheme = QuantScheme::kPerTensor;
  options.num_threads = static_cast<int>(state.range(0));
  uint64_t hash = 0;
  if (state.range(1) != 0) options.out_hash = &hash;
  // Looking ahead, as a refit's layer processing does: each call takes the
  // next weight's amax during its convert, and the next call uses it.
  const bool ahead = state.range(2) != 0;
  Fp8Amax next_amax;
  for (auto _ : state) {
    int64_t at = 0;
    next_amax = Fp8Amax{};
    for (size_t w = 0; w < data.shapes.size(); ++w) {
      const auto [rows, cols] = data.shapes[w];
      const Fp8Amax given = next_amax;
      absl::Span<const uint8_t> next[1];
      if (ahead) {
        options.amax = &given;
        options.next_amax = &next_amax;
        if (w + 1 < data.shapes.size()) {
          const auto [next_rows, next_cols] = data.shapes[w + 1];
          next[0] = absl::Span<const uint8_t>(
              reinterpret_cast<const uint8_t*>(data.input.data() + at + rows * cols),
              static_cast<size_t>(next_rows * next_cols) * sizeof(data.input[0]));
          options.next = next;
        } else {
          options.next = {};
        }
      }
      absl::Status status = QuantizeFp8(data.input.data() + at, DType::kBFloat16, rows, cols,
                                        options, data.output.data() + at, &data.scales[w], "bench");
      if (!status.ok()) {
        state.SkipWithError(std::string(status.message()).c_str());
        return;
      }
      at += rows * cols;
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * data.elements * 3);
  state.SetLabel(absl::StrCat("per-tensor, 188 weights, threads=", state.range(0),
                              state.range(1) != 0 ? ", output hashed" : "",
                              ahead ? ", next amax taken ahead" : ""));
}

at::Tensor TorchOpChain(const at::Tensor& x, QuantScheme scheme) {
  at::Tensor xf = x.to(at::kFloat);
  switch (scheme) {
    case QuantScheme::kPerTensor: {
      at::Tensor s = xf.abs().amax() / 448.0;
      at::Tensor inv = at::where(s == 0, at::zeros_like(s), s.reciprocal());
      return xf.mul_(inv).clamp_(-448, 448).to(at::kFloat8_e4m3fn);
    }
    case QuantScheme::kPerChannel: {
      at::Tensor s = xf.abs().amax({1}, true) / 448.0;
      at::Tensor inv = at::where(s == 0, at::zeros_like(s), s.reciprocal());
      return xf.mul_(inv).clamp_(-448, 448).to(at::kFloat8_e4m3fn);
    }
    default: {
      // The shape is a multiple of 128: no padding or cropping needed.
      at::Tensor blocks = xf.view({kRows / 128, 128, kCols / 128, 128});
      at::Tensor s = blocks.abs().amax({1, 3}, true).clamp_min(kFp8BlockAmaxFloor) / 448.0;
      return blocks.mul_(s.reciprocal()).clamp_(-448, 448).to(at::kFloat8_e4m3fn);
    }
  }
}

void BM_TorchOps(benchmark::State& state) {
  Data& data = GetData();
  const QuantScheme scheme = kSchemes[state.range(0)];
  const int threads = static_cast<int>(state.range(1));
  const int previous = at::get_num_threads();
  at::set_num_threads(threads);
  for (auto _ : state) {
    at::Tensor q = TorchOpChain(data.x, scheme);
    benchmark::DoNotOptimize(q.data_ptr());
  }
  at::set_num_threads(previous);
  state.SetBytesProcessed(state.iterations() * (kInputBytes + kOutputBytes));
  state.SetLabel(absl::StrCat(QuantSchemeName(scheme), " threads=", threads));
}

void BM_Memcpy(benchmark::State& state) {
  Data& data = GetData();
  const int threads = static_cast<int>(state.range(0));
  const auto* src = static_cast<const uint8_t*>(data.x.data_ptr());
  uint8_t* dst = data.copy.data();
  auto copy_range = [&](int t) {
    const int64_t begin = kInputBytes / threads * t;
    const int64_t end = t + 1 == threads ? kInputBytes : kInputBytes / threads * (t + 1);
    std::memcpy(dst + begin, src + begin, end - begin);
  };
  for (auto _ : state) {
    std::vector<std::thread> workers;
    for (int t = 1; t < threads; ++t) workers.emplace_back(copy_range, t);
    copy_range(0);
    for (std::thread& w : workers) w.join();
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * kInputBytes);
  state.SetLabel(absl::StrCat("threads=", threads));
}

// Each kernel variant, per-tensor, to show what the dispatch buys.
void BM_OursIsa(benchmark::State& state) {
  const auto isa = static_cast<internal::Fp8Isa>(state.range(0));
  if (!internal::Fp8IsaSupported(isa)) {
    state.SkipWithError("ISA not supported on this CPU");
    return;
  }
  const internal::Fp8Isa previous = internal::SetFp8IsaForTesting(isa);
  RunOurs(state, kSchemes[state.range(1)], static_cast<int>(state.range(2)));
  internal::SetFp8IsaForTesting(previous);
}

void SchemeArgs(benchmark::internal::Benchmark* b) {
  for (int64_t scheme = 0; scheme < 3; ++scheme) b->Args({scheme, DefaultThreads()});
  b->Args({0, 1});  // single-threaded, per-tensor
}

BENCHMARK(BM_Ours)->Apply(SchemeArgs)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_OursModel)
    ->Args({DefaultThreads(), 0, 0})
    ->Args({DefaultThreads(), 1, 0})
    ->Args({DefaultThreads(), 1, 1})
    ->Args({1, 0, 0})
    ->Args({1, 1, 0})
    ->Args({1, 1, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_TorchOps)->Apply(SchemeArgs)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Memcpy)->Arg(DefaultThreads())->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_OursIsa)
    ->Args({0, 0, DefaultThreads()})
    ->Args({1, 0, DefaultThreads()})
    ->Args({2, 0, DefaultThreads()})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Prints the table as usual, then the ratios the performance claims are made
// of, from the runs of this process (the median when repeated).
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  explicit RatioReporter(OutputOptions options) : ConsoleReporter(options) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.error_occurred) continue;
      if (run.run_type == Run::RT_Aggregate && run.aggregate_name != "median") continue;
      const auto it = run.counters.find("bytes_per_second");
      if (it == run.counters.end()) continue;
      rates_[run.run_name.function_name + "/" + run.run_name.args] = it->second.value;
    }
  }

  void Finalize() override {
    ConsoleReporter::Finalize();
    std::ostream& out = GetOutputStream();
    out << std::fixed << std::setprecision(2);
    std::vector<int> thread_counts = {DefaultThreads()};
    if (DefaultThreads() != 1) thread_counts.push_back(1);
    for (int64_t scheme = 0; scheme < 3; ++scheme) {
      for (int threads : thread_counts) {
        const std::string args = absl::StrCat(scheme, "/", threads);
        const double ours = Rate("BM_Ours/" + args);
        const double torch = Rate("BM_TorchOps/" + args);
        const double copy = Rate(absl::StrCat("BM_Memcpy/", threads));
        if (ours == 0 || (torch == 0 && copy == 0)) continue;
        out << QuantSchemeName(kSchemes[scheme]) << " threads=" << threads << ":";
        if (torch > 0) out << " " << ours / torch << "x the LibTorch op chain;";
        if (copy > 0) out << " " << ours / copy << "x memcpy bandwidth;";
        out << "\n";
      }
    }
  }

 private:
  double Rate(const std::string& name) const {
    const auto it = rates_.find(name);
    return it == rates_.end() ? 0 : it->second;
  }

  std::map<std::string, double> rates_;
};

}  // namespace
}  // namespace refit::core

int main(int argc, char** argv) {
  // The ratio summary is for people; with --benchmark_format=json|csv (as
  // scripts/bench.sh asks) stdout must be exactly the library's output.
  bool console = true;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--benchmark_format=", 0) == 0 && arg != "--benchmark_format=console") {
      console = false;
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  if (!console) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    // Colours only on a terminal, as the default reporter does.
    refit::core::RatioReporter reporter(isatty(fileno(stdout))
                                            ? benchmark::ConsoleReporter::OO_Defaults
                                            : benchmark::ConsoleReporter::OO_Tabular);
    benchmark::RunSpecifiedBenchmarks(&reporter);
  }
  benchmark::Shutdown();
  return 0;
}
