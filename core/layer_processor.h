// LayerProcessor: turns one complete layer's high-precision params into the
// kernel bytes engines read (FP8 weights and scales, kept bf16 tensors,
// attention scales), staged for commit, with the XXH3-64 of each kernel.
//
// Pipeline position: after LayerAssembler (a layer is complete) and before
// commit. The layer worker calls Process for layers completed while chunks
// still arrive; the session calls it at Prepare for the rest (attention
// scales, zero-filled partial layers).
//
// How a layer's kernels are made is the same everywhere — the layout's
// KernelPlan says which param each kernel comes from and which weights are
// quantized, and attention scales follow ResolveAttentionScales — so this
// class walks the plan once (Process) and an implementation only says where
// the bytes go: the host processor quantizes on the CPU into host buffers;
// the CUDA processor (core/cuda/cuda_layer_processor.h) uploads, quantizes on
// the store's GPU and leaves every kernel in device memory. Both give the
// same bytes.
//
// Lifecycle: one per refit session, chosen at session creation from the
// store's device (CreateLayerProcessor). Thread-compatible: one Process call
// at a time (the worker, or the session once the worker is drained).
#ifndef REFIT_CORE_LAYER_PROCESSOR_H_
#define REFIT_CORE_LAYER_PROCESSOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/fp8_quantizer.h"
#include "core/model_layout.h"
#include "core/staging_buffer.h"

namespace refit::core {

class ScaleHints;
class ShardStore;

// One processed layer: its kernels in layer order, ready for commit.
struct ProcessedLayer {
  int layer = -1;
  // ProcessPart of an expert part that did not complete its layer: the part,
  // and no kernels yet. -1 for a whole layer.
  int part = -1;
  std::vector<StagingBuffer> kernels;  // sizes equal the layout's kernels
  std::vector<uint64_t> hashes;        // XXH3-64 of each kernel's bytes
  absl::Duration took;
  absl::Duration hashing;  // of `took`: hashing the kernels (with a GPU's read-back)
  // Per-tensor weights quantized in one pass: their scale hint held
  // (ScaleHints).
  int scales_reused = 0;
  // Per-tensor weights quantized with the amax the convert of the weight
  // before them took (Fp8QuantizeOptions::amax): read once by their own call.
  int amax_ahead = 0;
};

struct LayerProcessorOptions {
  NonFinitePolicy non_finite = NonFinitePolicy::kReject;
  int quantize_threads = 0;  // host quantizer threads; 0 = its default
  // A store on a GPU normally stages and quantizes on the device. With this
  // set it uses the host path (CPU quantizer, host-to-device commit): the
  // same bytes, for diagnosis or when device memory is short.
  bool host_staging = false;
  // The model group's scale hints (the host quantizer's per-tensor scheme
  // reads and records them); null: none.
  ScaleHints* scale_hints = nullptr;
};

// A layer a LayerWorker processes after the current one, already queued:
// its index and, per param (LayerSpec::params' order), the host bytes of
// its buffer (none for a buffer with bytes on a device). The bytes stay
// valid, and refitd does not write them, until that layer is processed.
struct UpcomingLayer {
  int layer = -1;
  std::vector<std::vector<absl::Span<const uint8_t>>> params;
};

class LayerProcessor {
 public:
  virtual ~LayerProcessor() = default;
  LayerProcessor(const LayerProcessor&) = delete;
  LayerProcessor& operator=(const LayerProcessor&) = delete;

  // Makes layer `l`'s kernels from `params` (its buffers as LayerSpec::params
  // lists them, filled by the assembler). `params` is consumed.
  // Errors:
  //   INVALID_ARGUMENT    non-finite weights under NonFinitePolicy::kReject,
  //                       naming the tensor
  //   RESOURCE_EXHAUSTED  out of host or device memory for the kernels
  //   INTERNAL            kernel sizes that differ from the layout's (a bug:
  //                       nothing is committed)
  //   (CUDA processor) the CUDA error of an upload, launch or sync
  // Experts layers are processed part by part (ProcessPart); Process of one
  // is INTERNAL.
  // `upcoming`: the layers processed next, in order, as far as known (the
  // host processor's per-tensor quantizer takes the amax of the next FP8
  // weight during the convert of this layer's last one; see
  // Fp8QuantizeOptions::next).
  absl::StatusOr<ProcessedLayer> Process(int l, std::vector<StagingBuffer> params,
                                         absl::Span<const UpcomingLayer> upcoming = {});

  // Quantizes part `p` of experts layer `l` (its rows, LayerSpec::parts)
  // into its place in the layer's kernels, with its own scale(s); `src` is
  // consumed and freed. The layer's kernels are allocated on its first part.
  // Returns the finished layer when this was its last part, else a
  // ProcessedLayer with `part` set and no kernels. Errors: Process's;
  // INTERNAL for a part processed twice or of the wrong size.
  absl::StatusOr<ProcessedLayer> ProcessPart(int l, int p, StagingBuffer src);
  // The live bytes [offset, offset + n) of a kernel, for parts a refit keeps.
  using LiveBytesFn = std::function<absl::Status(const KernelSpec& kernel, int64_t offset,
                                                 int64_t n, std::string* out)>;
  // Finishes experts layer `l` when not all its parts came: the parts never
  // processed keep their live bytes (read through `live`). Errors: `live`'s,
  // and Process's.
  absl::StatusOr<ProcessedLayer> FinishParts(int l, const LiveBytesFn& live);

  // Whether kernels end up in device memory.
  virtual bool on_device() const = 0;

 protected:
  LayerProcessor(const ModelLayout& layout, LayerProcessorOptions options)
      : layout_(layout), options_(options) {}

  // The bytes of one layer as they are made. Process calls Quantize or Keep
  // once for every kernel (a quantized weight's call covers its scales),
  // then Finish.
  class LayerBuild {
   public:
    virtual ~LayerBuild() = default;
    // Quantizes `src` ([rows, cols] of `src_dtype`) into kernel `k` (FP8)
    // and its scales into kernel `s`; sizes were checked against the layout.
    virtual absl::Status Quantize(StagingBuffer src, DType src_dtype, int64_t rows, int64_t cols,
                                  int k, int s) = 0;
    // The host bytes of the weight quantized after the next Quantize call
    // (same dtype; the per-tensor scheme; no scale hint for it), valid until
    // that weight is quantized: a build may read them ahead
    // (Fp8QuantizeOptions::next). Empty: none.
    virtual void LookAhead(std::vector<absl::Span<const uint8_t>> next) { (void)next; }
    // Host bytes that become kernel `k` as they are.
    virtual absl::Status Keep(int k, StagingBuffer bytes) = 0;
    // As Keep, with the XXH3 of the bytes already taken (by Process, in the
    // sweep that made them owned and checked them); a processor that hashes
    // its kernels on the host uses it instead of reading them again.
    virtual absl::Status KeepHashed(int k, StagingBuffer bytes, uint64_t hash) {
      (void)hash;
      return Keep(k, std::move(bytes));
    }
    // Experts layers: as Quantize, into kernel `k` at byte `k_offset` and
    // its scales into kernel `s` at byte `s_offset` (kernels allocated whole
    // on first use); `src` may be freed on return.
    virtual absl::Status QuantizeRegion(StagingBuffer src, DType src_dtype, int64_t rows,
                                        int64_t cols, int k, int64_t k_offset, int s,
                                        int64_t s_offset, absl::string_view what) = 0;
    // Host bytes copied into kernel `k` at byte `offset`.
    virtual absl::Status KeepRegion(int k, int64_t offset, const void* bytes, int64_t n) = 0;
    // Waits for the layer's work; returns its kernels and their hashes.
    virtual absl::StatusOr<ProcessedLayer> Finish() = 0;
  };
  virtual absl::StatusOr<std::unique_ptr<LayerBuild>> Start(const LayerSpec& spec) = 0;

  const ModelLayout& layout_;
  const LayerProcessorOptions options_;

 private:
  // An experts layer with some parts processed.
  struct OpenLayer {
    std::unique_ptr<LayerBuild> build;
    std::vector<bool> done;
    size_t count = 0;
    absl::Duration took;
  };
  absl::StatusOr<OpenLayer*> Open(int l);
  absl::StatusOr<ProcessedLayer> Close(int l);
  absl::Status CheckMade(const LayerSpec& spec, const ProcessedLayer& out) const;
  // The host bytes of FP8 weight `k` of `spec` (`pieces`: its param's) if a
  // per-tensor quantizer of `dtype` sources may read them ahead
  // (LayerBuild::LookAhead): the same dtype, the whole param, and no scale
  // hint for the weight (a hint reads it once anyway). None otherwise.
  std::vector<absl::Span<const uint8_t>> AheadPieces(
      const LayerSpec& spec, size_t k, DType dtype,
      std::vector<absl::Span<const uint8_t>> pieces) const;
  // AheadPieces of the first FP8 weight in `upcoming`, if the first of
  // those layers that has a weight to make is an FP8 linear layer.
  std::vector<absl::Span<const uint8_t>> AheadInUpcoming(absl::Span<const UpcomingLayer> upcoming,
                                                         DType dtype) const;
  // A NaN/Inf that layer `l`'s Finish reported for one of its FP8 kernels,
  // prefixed with the checkpoint tensor and element it came from.
  absl::Status NameFinishedElement(int l, absl::Status status) const;
  absl::flat_hash_map<int, OpenLayer> open_;
};

// The processor for a session on `store`: the CUDA processor for a store on
// a GPU (unless options.host_staging), the host processor otherwise.
// Errors: the device's status when the GPU cannot be used (UNAVAILABLE, ...);
// RESOURCE_EXHAUSTED when its pinned staging cannot be allocated.
absl::StatusOr<std::unique_ptr<LayerProcessor>> CreateLayerProcessor(const ShardStore& store,
                                                                     LayerProcessorOptions options);

// The host processor alone (CPU quantizer, host buffers).
std::unique_ptr<LayerProcessor> CreateHostLayerProcessor(const ModelLayout& layout,
                                                         LayerProcessorOptions options);

// XXH3-64 of `size` bytes of host memory.
uint64_t HashBytes(const void* data, int64_t size);

// How many threads hash `bytes` in all, spread over several buffers (one
// buffer's hash is sequential): one below a MiB, else up to 8.
int HashThreads(int64_t bytes);

}  // namespace refit::core

#endif  // REFIT_CORE_LAYER_PROCESSOR_H_
