// LayerAssembler: checkpoint chunks -> this rank's slice -> each layer's
// high-precision staging.
//
// Pipeline position: the first step of a refit. RefitSession hands it every
// chunk a trainer (or a safetensors file) sends. It validates the chunk
// against the layout (name, dtype, shape, alignment, bounds, repeats,
// checksum), copies the part of it that lies in this rank's TP slice into the
// layer's param buffer (converting to the checkpoint dtype), and counts the
// elements each layer has. When a layer's last element arrives, Ingest says
// so; the session then takes the layer's params (TakeParams) and processes
// them. At Prepare it tells which tensors arrived in part and which whole
// tensors a started layer lacks.
//
// Experts layers (LayerKind::kExperts) go part by part instead: each
// expert's w13 and w2 (LayerSpec::parts) has its own staging, allocated on
// its first chunk, completes on its own (IngestUnit says which) and is handed
// on by TakePart, so a MoE layer never stages more than the parts in flight.
//
// Memory: a layer's params are allocated on the first chunk that touches
// this rank's slice of it, after the `reserve` hook has agreed to the bytes
// (the session's staging budget and backpressure), and are freed or handed
// on by TakeParams.
//
// Lifecycle: one per refit session; Clear() frees everything.
// Thread-compatible: the session serializes all calls.
#ifndef REFIT_CORE_LAYER_ASSEMBLER_H_
#define REFIT_CORE_LAYER_ASSEMBLER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/byte_range_set.h"
#include "core/device_source.h"
#include "core/dtype.h"
#include "core/model_layout.h"
#include "core/staging_buffer.h"

namespace refit::core {

// A byte range of one checkpoint tensor, as the trainer sends it.
struct Chunk {
  absl::string_view name;
  DType dtype = DType::kBFloat16;
  absl::Span<const int64_t> shape;  // the full tensor's shape
  uint64_t offset = 0;              // byte offset within the full tensor
  // The chunk's bytes: `data`, or, when `pieces` is not empty, the pieces
  // one after the other (`data` is then ignored). Pieces let bytes that
  // arrived in several buffers (a gRPC message's slices) be ingested where
  // they lie; a piece may end inside an element.
  absl::Span<const uint8_t> data;
  absl::Span<const absl::Span<const uint8_t>> pieces;
  std::optional<uint64_t> xxh3;  // XXH3-64 of the chunk's bytes, checked when present
  // Set when `data` lies in memory that stays mapped while `keep` is held
  // (a trainer's shared-memory region, sealed against shrinking): rows of a
  // quantized weight are then read in place when the layer is processed,
  // instead of being copied into staging at ingest. The memory must not be
  // written before the refit's Prepare returns; a writer changes only what
  // is quantized, never the daemon's memory safety.
  std::shared_ptr<const void> keep;
  // Set when `data` is a device address range of a trainer's CUDA
  // allocation (kept open by `keep`): the host never dereferences it. Rows
  // that would be read in place are aliased as device rows when the
  // session's processor is on the GPU (Options::device_aliases), and read
  // device to device there; every other byte (kept tensors, conversions,
  // row-parallel slices, a host processor's input) is first copied to the
  // host through `device`. Checksums (xxh3) do not apply to such chunks.
  const DeviceSource* device = nullptr;

  // Bytes of the chunk (of `data` or of all pieces).
  uint64_t size() const {
    if (pieces.empty()) return data.size();
    uint64_t n = 0;
    for (absl::Span<const uint8_t> piece : pieces) n += piece.size();
    return n;
  }
};

// What a chunk completed: a layer (part -1), an expert part of an experts
// layer (part >= 0), or nothing (layer -1).
struct WorkUnit {
  int layer = -1;
  int part = -1;
};

class LayerAssembler {
 public:
  struct Options {
    // Zero every param buffer, so that tensors that never arrive read as
    // zeros (RefitOptions::allow_partial_layers).
    bool zero_fill = false;
    // Rows of chunks in device memory (Chunk::device) may be aliased in
    // staging: the processor reads staging through Segments() on the GPU.
    bool device_aliases = false;
  };
  // Asked before a layer's staging is allocated; a non-OK status refuses the
  // allocation and is what Ingest returns. May block (backpressure).
  using ReserveFn = std::function<absl::Status(const LayerSpec& layer, int64_t bytes)>;

  LayerAssembler(const ModelLayout& layout, Options options, ReserveFn reserve);
  LayerAssembler(const LayerAssembler&) = delete;
  LayerAssembler& operator=(const LayerAssembler&) = delete;

  // Validates `chunk`, records its range and copies its part of this rank's
  // slice into staging. Returns the index of the layer this chunk completed,
  // or -1. Attention layers (optional scales) never complete here: they are
  // processed at Prepare.
  // Errors (the chunk's range is then recorded or not, but the session
  // aborts on any error, so nothing partial is ever used):
  //   NOT_FOUND           unknown tensor name
  //   INVALID_ARGUMENT    dtype not F32/F16/BF16, dtype differing from the
  //                       tensor's earlier chunks, shape differing from the
  //                       layout's, offset or size not element-aligned,
  //                       overlapping an earlier chunk
  //   OUT_OF_RANGE        the chunk runs past the end of the tensor
  //   ALREADY_EXISTS      the chunk repeats a byte range already received
  //   DATA_LOSS           the chunk's XXH3-64 differs from `xxh3`
  //   RESOURCE_EXHAUSTED  what the reserve hook returns, or host memory
  //                       exhausted while allocating staging
  absl::StatusOr<int> Ingest(const Chunk& chunk);
  // As Ingest, but also says when a chunk completed an expert part (Ingest
  // returns -1 then). Same errors.
  absl::StatusOr<WorkUnit> IngestUnit(const Chunk& chunk);

  // Allocates layer `l`'s staging if it has none (zeroed where elements may
  // never be written). Errors: as the reserve hook / allocation above.
  absl::Status EnsureStaging(int l);
  // Hands layer `l`'s params on for processing; later chunks of it are
  // accepted and ignored (the range check refuses anything overlapping what
  // it had, so they are other ranks' bytes).
  std::vector<StagingBuffer> TakeParams(int l);
  // Experts layers: allocates part `p` of layer `l` (zeroed under
  // Options::zero_fill), as EnsureStaging; hands it on, as TakeParams.
  absl::Status EnsurePartStaging(int l, int p);
  StagingBuffer TakePart(int l, int p);
  bool part_taken(int l, int p) const { return layers_[l].parts[p].taken; }
  int64_t part_loaded(int l, int p) const { return layers_[l].parts[p].loaded; }
  // Checkpoint tensors of part `p` of layer `l` of which nothing arrived.
  std::vector<std::string> MissingPartTensors(int l, int p) const;

  // DATA_LOSS naming the first tensor received only in part.
  absl::Status CheckTensorsComplete() const;
  // Checkpoint tensors of layer `l` of which nothing arrived (optional ones
  // and those with nothing on this rank excluded).
  std::vector<std::string> MissingTensors(int l) const;

  bool taken(int l) const { return layers_[l].taken; }
  int64_t loaded(int l) const { return layers_[l].loaded; }
  // Layers with staging that were not yet taken.
  int64_t layers_in_flight() const;
  // Param bytes held by layers not yet taken.
  int64_t staging_bytes() const { return staging_bytes_; }
  int64_t bytes_received() const { return bytes_received_; }
  // Bytes of staging read in place from chunks' memory (Chunk::keep) rather
  // than copied.
  int64_t bytes_in_place() const { return bytes_in_place_; }
  int64_t elements_loaded() const { return elements_loaded_; }
  int64_t elements_expected() const { return elements_expected_; }

  // Frees all staging and what was recorded per tensor and layer, at the
  // end of a refit. Afterwards only the counters (bytes_received,
  // elements_loaded, staging_bytes) may be read.
  void Clear();

 private:
  struct TensorState {
    ByteRangeSet ranges;
    bool seen = false;
    DType dtype = DType::kBFloat16;  // of the first chunk; later chunks must match
  };
  struct PartState {
    StagingBuffer buffer;  // allocated on the part's first chunk
    int64_t loaded = 0;
    bool taken = false;
  };
  struct LayerState {
    std::vector<PartState> parts;  // experts layers
    int64_t loaded = 0;
    bool taken = false;
    std::vector<StagingBuffer> params;  // allocated on the first chunk
    int64_t param_bytes = 0;
  };

  absl::Status Validate(const Chunk& chunk, uint64_t size, const CheckpointTensor& ct) const;
  // Copies elements [e0, e1) of `ct` that lie in its slice. Sets *completed
  // when the layer has all its elements.
  absl::Status Scatter(const CheckpointTensor& ct, DType dtype, const uint8_t* data, uint64_t e0,
                       uint64_t e1, WorkUnit* completed);
  // Whether `chunk`'s bytes of `ct` can be read in place (see Chunk::keep):
  // a quantized weight (of a dense layer, or an expert's w13 / w2),
  // received in its dtype, whose slice is whole rows (so that its part of
  // any chunk is one contiguous range).
  bool CanReadInPlace(const CheckpointTensor& ct, const Chunk& chunk) const;
  // As Scatter, recording elements [e0, e1) of the chunk as an alias of the
  // param's staging instead of copying them.
  absl::Status AliasInPlace(const CheckpointTensor& ct, const Chunk& chunk, uint64_t e0,
                            uint64_t e1, WorkUnit* completed);
  // The staging `ct` is written into (allocated on first use): its layer's
  // param, or its expert part's buffer, whose first row is *row_base of the
  // param. Errors: EnsureStaging's / EnsurePartStaging's.
  absl::StatusOr<StagingBuffer*> StagingFor(const CheckpointTensor& ct, int64_t* row_base);
  // Counts `contributed` elements of `ct`'s layer (or part); sets
  // *completed when that completed it.
  void Count(const CheckpointTensor& ct, int64_t contributed, WorkUnit* completed);

  const ModelLayout& layout_;
  const Options options_;
  const ReserveFn reserve_;
  std::vector<TensorState> tensors_;
  std::vector<LayerState> layers_;
  int64_t staging_bytes_ = 0;
  int64_t bytes_received_ = 0;
  int64_t bytes_in_place_ = 0;
  // Host copy of a device chunk's bytes that are not read in place; kept
  // for the next such chunk, freed by Clear().
  std::vector<uint8_t> device_bounce_;
  int64_t elements_loaded_ = 0;
  int64_t elements_expected_ = 0;
};

}  // namespace refit::core

#endif  // REFIT_CORE_LAYER_ASSEMBLER_H_
