// The host LayerProcessor: FP8 quantization on the CPU (QuantizeFp8), every
// kernel in host memory. Used for stores in host memory, and for GPU stores
// with LayerProcessorOptions::host_staging (the commit then copies host to
// device).
#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/fp8_quantizer.h"
#include "core/layer_processor.h"
#include "core/parallel.h"
#include "core/scale_hints.h"

namespace refit::core {
namespace {

using Pieces = std::vector<absl::Span<const uint8_t>>;

// The same memory (not only the same bytes).
bool SamePieces(const Pieces& a, const Pieces& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].data() != b[i].data() || a[i].size() != b[i].size()) return false;
  }
  return true;
}

// The amax one Quantize took ahead (Fp8QuantizeOptions::next) of the
// weight quantized after it, with that weight's pieces: the next Quantize
// whose source is exactly those pieces uses it, and any Quantize drops it.
// A session's layers are processed one at a time, so at most one is
// carried, and those pieces are not freed or written by refitd before
// their Quantize (UpcomingLayer).
class AmaxCarry {
 public:
  // The amax carried for `pieces`, if they are the ones it was taken over.
  std::optional<Fp8Amax> Take(const Pieces& pieces) {
    absl::MutexLock lock(&mu_);
    const Pieces carried = std::exchange(pieces_, {});
    const Fp8Amax amax = std::exchange(amax_, Fp8Amax{});
    if (!amax.valid || carried.empty() || !SamePieces(carried, pieces)) return std::nullopt;
    return amax;
  }
  void Put(Pieces pieces, const Fp8Amax& amax) {
    absl::MutexLock lock(&mu_);
    pieces_ = amax.valid ? std::move(pieces) : Pieces{};
    amax_ = amax.valid ? amax : Fp8Amax{};
  }

 private:
  absl::Mutex mu_;
  Pieces pieces_ ABSL_GUARDED_BY(mu_);
  Fp8Amax amax_ ABSL_GUARDED_BY(mu_);
};

class HostLayerProcessor final : public LayerProcessor {
 public:
  HostLayerProcessor(const ModelLayout& layout, LayerProcessorOptions options)
      : LayerProcessor(layout, options) {}

  bool on_device() const override { return false; }

 private:
  class HostBuild final : public LayerBuild {
   public:
    HostBuild(const HostLayerProcessor& processor, const LayerSpec& spec, AmaxCarry* carry)
        : processor_(processor), spec_(spec), carry_(carry), kernels_(spec.kernels.size()) {}

    void LookAhead(Pieces next) override { ahead_ = std::move(next); }

    absl::Status Quantize(StagingBuffer src, DType src_dtype, int64_t rows, int64_t cols, int k,
                          int s) override {
      const KernelSpec& weight = spec_.kernels[k];
      absl::StatusOr<StagingBuffer> q = StagingBuffer::HostPooled(weight.nbytes(), weight.name);
      if (!q.ok()) return q.status();
      absl::StatusOr<StagingBuffer> scales =
          StagingBuffer::HostPooled(spec_.kernels[s].nbytes(), weight.name);
      if (!scales.ok()) return scales.status();
      Fp8QuantizeOptions qopts;
      qopts.scheme = processor_.layout_.quant();
      qopts.non_finite = processor_.options_.non_finite;
      qopts.num_threads = processor_.options_.quantize_threads;
      Fp8QuantizeStats stats;
      ScaleHints* hints = UseHint(weight.name, &qopts, &stats);
      qopts.stats = &stats;
      // Rows read in place from a trainer's region are quantized where they
      // lie (no copy into staging was made); rows in device memory are
      // brought to the host first.
      if (src.has_device_aliases()) {
        if (absl::Status m = src.MaterializeAliases(); !m.ok()) return m;
      }
      // The quantizer hashes the output as it writes it, while it is in
      // cache: Finish need not read it back from memory.
      uint64_t hash = 0;
      qopts.out_hash = &hash;
      // The amax the previous Quantize took of this source, if it did; and
      // this convert takes the next weight's.
      const std::optional<Fp8Amax> given = carry_->Take(src.HostPieces());
      if (given.has_value()) qopts.amax = &*given;
      const Pieces ahead = std::exchange(ahead_, {});
      Fp8Amax next_amax;
      if (!ahead.empty()) {
        qopts.next = ahead;
        qopts.next_amax = &next_amax;
      }
      absl::Status quantized =
          src.has_aliases()
              ? QuantizeFp8Pieces(src.Pieces(), src_dtype, rows, cols, qopts, q->data(),
                                  reinterpret_cast<float*>(scales->data()), weight.name)
              : QuantizeFp8(src.data(), src_dtype, rows, cols, qopts, q->data(),
                            reinterpret_cast<float*>(scales->data()), weight.name);
      if (!quantized.ok()) return quantized;
      carry_->Put(ahead, next_amax);
      if (stats.amax_given) ++amax_given_;
      RecordHint(hints, weight.name, *reinterpret_cast<const float*>(scales->data()), stats);
      kernels_[k] = *std::move(q);
      kernels_[s] = *std::move(scales);
      hashes_[k] = hash;
      return absl::OkStatus();
    }

    absl::Status QuantizeRegion(StagingBuffer src, DType src_dtype, int64_t rows, int64_t cols,
                                int k, int64_t k_offset, int s, int64_t s_offset,
                                absl::string_view what) override {
      if (absl::Status a = Allocate(k); !a.ok()) return a;
      if (absl::Status a = Allocate(s); !a.ok()) return a;
      Fp8QuantizeOptions qopts;
      qopts.scheme = processor_.layout_.quant();
      qopts.non_finite = processor_.options_.non_finite;
      // An expert part is small (a few MiB) and there are many: by default
      // one thread quantizes it, the session's thread receiving the next
      // parts meanwhile; threads spawned per part cost more than they gain
      // (moe_bench: 0.26 vs 0.71 s/GiB of quantization on 2 busy cores).
      qopts.num_threads =
          processor_.options_.quantize_threads > 0 ? processor_.options_.quantize_threads : 1;
      if (src.has_device_aliases()) {
        if (absl::Status m = src.MaterializeAliases(); !m.ok()) return m;
      }
      uint8_t* out_q = kernels_[k].data() + k_offset;
      float* out_scales = reinterpret_cast<float*>(kernels_[s].data() + s_offset);
      // An expert's part has a per-tensor scale of its own, hinted by the
      // part's name.
      Fp8QuantizeStats stats;
      ScaleHints* hints = UseHint(what, &qopts, &stats);
      absl::Status quantized =
          src.has_aliases()
              ? QuantizeFp8Pieces(src.Pieces(), src_dtype, rows, cols, qopts, out_q, out_scales,
                                  what)
              : QuantizeFp8(src.data(), src_dtype, rows, cols, qopts, out_q, out_scales, what);
      if (quantized.ok()) RecordHint(hints, what, out_scales[0], stats);
      return quantized;
    }

    absl::Status KeepRegion(int k, int64_t offset, const void* bytes, int64_t n) override {
      if (absl::Status a = Allocate(k); !a.ok()) return a;
      if (n > 0) std::memcpy(kernels_[k].data() + offset, bytes, static_cast<size_t>(n));
      return absl::OkStatus();
    }

    absl::Status Keep(int k, StagingBuffer bytes) override {
      kernels_[k] = std::move(bytes);
      return absl::OkStatus();
    }

    absl::Status KeepHashed(int k, StagingBuffer bytes, uint64_t hash) override {
      kernels_[k] = std::move(bytes);
      hashes_[k] = hash;
      return absl::OkStatus();
    }

    // The kernels Quantize did not hash are hashed in parallel, the largest
    // first.
    absl::StatusOr<ProcessedLayer> Finish() override {
      const absl::Time start = absl::Now();
      ProcessedLayer out;
      out.hashes.assign(kernels_.size(), 0);
      std::vector<size_t> order;
      int64_t total = 0;
      for (size_t k = 0; k < kernels_.size(); ++k) {
        if (auto it = hashes_.find(static_cast<int>(k)); it != hashes_.end()) {
          out.hashes[k] = it->second;
          continue;
        }
        order.push_back(k);
        total += kernels_[k].size();
      }
      std::sort(order.begin(), order.end(),
                [&](size_t a, size_t b) { return kernels_[a].size() > kernels_[b].size(); });
      ForEachInParallel(static_cast<int>(order.size()), HashThreads(total), [&](int i) {
        const StagingBuffer& kernel = kernels_[order[i]];
        out.hashes[order[i]] = HashBytes(kernel.data(), kernel.size());
      });
      out.kernels = std::move(kernels_);
      out.hashing = absl::Now() - start;
      out.scales_reused = scales_reused_;
      out.amax_ahead = amax_given_;
      return out;
    }

   private:
    // Under the per-tensor scheme: the model group's hints (null otherwise),
    // with `name`'s hint put into *qopts and its stats going to *stats.
    ScaleHints* UseHint(absl::string_view name, Fp8QuantizeOptions* qopts,
                        Fp8QuantizeStats* stats) const {
      ScaleHints* hints =
          qopts->scheme == QuantScheme::kPerTensor ? processor_.options_.scale_hints : nullptr;
      if (hints != nullptr) {
        qopts->scale_hint = hints->Hint(name);
        qopts->stats = stats;
      }
      return hints;
    }

    // `name` was quantized with `scale` (UseHint's hints).
    void RecordHint(ScaleHints* hints, absl::string_view name, float scale,
                    const Fp8QuantizeStats& stats) {
      if (hints == nullptr) return;
      hints->Record(name, scale);
      scales_reused_ += stats.one_pass ? 1 : 0;
    }

    // Kernel `k` whole, on its first region. Uninitialized: the parts of an
    // experts layer tile its kernels, and every part is written (quantized
    // or kept) before Finish.
    absl::Status Allocate(int k) {
      if (!kernels_[k].empty() || spec_.kernels[k].nbytes() == 0) return absl::OkStatus();
      absl::StatusOr<StagingBuffer> buffer =
          StagingBuffer::HostPooled(spec_.kernels[k].nbytes(), spec_.kernels[k].name);
      if (!buffer.ok()) return buffer.status();
      kernels_[k] = *std::move(buffer);
      return absl::OkStatus();
    }

    const HostLayerProcessor& processor_;
    const LayerSpec& spec_;
    AmaxCarry* const carry_;
    std::vector<StagingBuffer> kernels_;
    // Kernels hashed on the way in (Quantize, KeepHashed): Finish skips them.
    absl::flat_hash_map<int, uint64_t> hashes_;
    int scales_reused_ = 0;
    int amax_given_ = 0;
    // LookAhead's pieces, for the next Quantize.
    Pieces ahead_;
  };

  absl::StatusOr<std::unique_ptr<LayerBuild>> Start(const LayerSpec& spec) override {
    return std::make_unique<HostBuild>(*this, spec, &carry_);
  }

  AmaxCarry carry_;
};

}  // namespace

std::unique_ptr<LayerProcessor> CreateHostLayerProcessor(const ModelLayout& layout,
                                                         LayerProcessorOptions options) {
  return std::make_unique<HostLayerProcessor>(layout, options);
}

}  // namespace refit::core
