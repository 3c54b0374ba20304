#include "core/layer_assembler.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/xxh3.h"

namespace refit::core {
namespace {

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Columns of the 2-D view a SliceSpec uses: [n] -> [n, 1], [] -> [1, 1],
// [a, b, ...] -> [a, b*...].
int64_t ViewCols(absl::Span<const int64_t> shape) {
  if (shape.size() < 2) return 1;
  int64_t cols = 1;
  for (size_t i = 1; i < shape.size(); ++i) cols *= shape[i];
  return cols;
}

absl::Status ChecksumMismatch(const CheckpointTensor& ct, uint64_t begin, uint64_t size) {
  return absl::DataLossError(absl::StrCat("tensor \"", ct.name,
                                          "\": checksum mismatch in chunk bytes [", begin, ", ",
                                          begin + size, ")"));
}

}  // namespace

LayerAssembler::LayerAssembler(const ModelLayout& layout, Options options, ReserveFn reserve)
    : layout_(layout),
      options_(options),
      reserve_(std::move(reserve)),
      tensors_(layout.checkpoint_tensors().size()),
      layers_(layout.layers().size()) {
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LayerSpec& layer = layout_.layers()[l];
    if (layer.kind != LayerKind::kAttention) elements_expected_ += layer.expected_numel;
    layers_[l].parts.resize(layer.parts.size());
  }
}

absl::Status LayerAssembler::Validate(const Chunk& chunk, uint64_t size,
                                      const CheckpointTensor& ct) const {
  if (!IsHighPrecisionFloat(chunk.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor \"", ct.name, "\": dtype ", DTypeName(chunk.dtype),
        " is not accepted; send F32, F16 or BF16 (checkpoint dtype ", DTypeName(ct.dtype), ")"));
  }
  if (!std::equal(chunk.shape.begin(), chunk.shape.end(), ct.shape.begin(), ct.shape.end())) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor \"", ct.name, "\": shape ", ShapeString(chunk.shape),
                     " does not match the model's ", ShapeString(ct.shape)));
  }
  const TensorState& ts = tensors_[&ct - layout_.checkpoint_tensors().data()];
  if (ts.seen && ts.dtype != chunk.dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor \"", ct.name, "\": chunk dtype ", DTypeName(chunk.dtype),
                     " differs from its earlier chunks' ", DTypeName(ts.dtype)));
  }
  const uint64_t elem = DTypeSize(chunk.dtype);
  if (chunk.offset % elem != 0 || size % elem != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor \"", ct.name, "\": chunk at byte ", chunk.offset, " of ", size,
                     " bytes is not aligned to whole ", DTypeName(chunk.dtype), " elements"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> LayerAssembler::Ingest(const Chunk& chunk) {
  absl::StatusOr<WorkUnit> unit = IngestUnit(chunk);
  if (!unit.ok()) return unit.status();
  return unit->part < 0 ? unit->layer : -1;
}

absl::StatusOr<WorkUnit> LayerAssembler::IngestUnit(const Chunk& chunk) {
  absl::StatusOr<int> index = layout_.FindCheckpointTensor(chunk.name);
  if (!index.ok()) return index.status();
  const CheckpointTensor& ct = layout_.checkpoint_tensors()[*index];
  const uint64_t size = chunk.size();
  if (absl::Status valid = Validate(chunk, size, ct); !valid.ok()) return valid;
  TensorState& ts = tensors_[*index];
  const uint64_t elem = DTypeSize(chunk.dtype);
  if (!ts.seen) ts.ranges = ByteRangeSet(static_cast<uint64_t>(ct.numel()) * elem);
  const uint64_t begin = chunk.offset;
  if (absl::Status added = ts.ranges.Add(begin, size, ct.name); !added.ok()) return added;
  ts.seen = true;
  ts.dtype = chunk.dtype;
  bytes_received_ += static_cast<int64_t>(size);

  const bool scatter = ct.use != CheckpointTensor::Use::kIgnored && size > 0;
  WorkUnit completed;
  // The chunk's elements stay where they are, recorded as aliases of the
  // staging; the layer reads them in place when it completes.
  auto read_in_place = [&]() -> absl::StatusOr<WorkUnit> {
    absl::Status s = AliasInPlace(ct, chunk, begin / elem, (begin + size) / elem, &completed);
    if (!s.ok()) return s;
    return completed;
  };
  if (chunk.device != nullptr) {
    if (chunk.xxh3.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", ct.name, "\": chunk at byte ", begin,
          " lies in a CUDA allocation, whose bytes are not checksummed: send it without xxh3"));
    }
    if (!chunk.pieces.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", ct.name, "\": a device chunk comes as one range"));
    }
    if (!scatter) return completed;
    if (options_.device_aliases && CanReadInPlace(ct, chunk)) return read_in_place();
    // Bytes the host must see: one copy to the host, then as any chunk.
    device_bounce_.resize(size);
    if (absl::Status copied = chunk.device->CopyToHost(
            chunk.data.data(), static_cast<int64_t>(size), device_bounce_.data());
        !copied.ok()) {
      return absl::Status(copied.code(),
                          absl::StrCat("tensor \"", ct.name, "\": ", copied.message()));
    }
    absl::Status s = Scatter(ct, chunk.dtype, device_bounce_.data(), begin / elem,
                             (begin + size) / elem, &completed);
    if (!s.ok()) return s;
    return completed;
  }
  if (!scatter && !chunk.xxh3.has_value()) return completed;
  if (scatter && CanReadInPlace(ct, chunk)) {
    if (chunk.xxh3.has_value() &&
        XXH3_64bits(chunk.data.data(), chunk.data.size()) != *chunk.xxh3) {
      return ChecksumMismatch(ct, begin, size);
    }
    return read_in_place();
  }
  const absl::Span<const uint8_t> whole[] = {chunk.data};
  const absl::Span<const absl::Span<const uint8_t>> pieces =
      chunk.pieces.empty() ? absl::MakeConstSpan(whole) : chunk.pieces;
  // Checksum and copy in cache-sized blocks: each block is hashed and then
  // scattered while it is still in cache, one pass over memory instead of
  // two. A mismatch found at the end fails the chunk; what was scattered
  // lives only in staging, and the session aborts, so nothing sees it.
  constexpr uint64_t kBlockBytes = uint64_t{256} << 10;
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> state(nullptr, XXH3_freeState);
  if (chunk.xxh3.has_value()) {
    state.reset(XXH3_createState());
    if (state == nullptr) return absl::ResourceExhaustedError("no memory for an XXH3 state");
    XXH3_64bits_reset(state.get());
  }
  // An element that a piece ends inside is gathered here from the pieces
  // that hold it, then scattered alone.
  uint8_t carry[8];
  uint64_t carried = 0;
  uint64_t done = 0;  // bytes of the chunk scattered
  for (absl::Span<const uint8_t> piece : pieces) {
    for (uint64_t off = 0; off < piece.size(); off += kBlockBytes) {
      const uint8_t* p = piece.data() + off;
      uint64_t n = std::min<uint64_t>(kBlockBytes, piece.size() - off);
      if (state != nullptr) XXH3_64bits_update(state.get(), p, n);
      if (!scatter) continue;
      if (carried > 0) {
        const uint64_t fill = std::min(elem - carried, n);
        std::memcpy(carry + carried, p, fill);
        carried += fill;
        p += fill;
        n -= fill;
        if (carried < elem) continue;
        absl::Status s = Scatter(ct, chunk.dtype, carry, (begin + done) / elem,
                                 (begin + done) / elem + 1, &completed);
        if (!s.ok()) return s;
        done += elem;
        carried = 0;
      }
      const uint64_t aligned = n - n % elem;
      if (aligned > 0) {
        absl::Status s = Scatter(ct, chunk.dtype, p, (begin + done) / elem,
                                 (begin + done + aligned) / elem, &completed);
        if (!s.ok()) return s;
        done += aligned;
      }
      if (n > aligned) {
        std::memcpy(carry, p + aligned, n - aligned);
        carried = n - aligned;
      }
    }
  }
  if (state != nullptr && XXH3_64bits_digest(state.get()) != *chunk.xxh3) {
    return ChecksumMismatch(ct, begin, size);
  }
  return completed;
}

absl::Status LayerAssembler::Scatter(const CheckpointTensor& ct, DType dtype, const uint8_t* data,
                                     uint64_t e0, uint64_t e1, WorkUnit* completed) {
  const LayerSpec& spec = layout_.layers()[ct.layer];
  LayerState& layer = layers_[ct.layer];
  PartState* part = ct.part >= 0 ? &layer.parts[ct.part] : nullptr;
  const ParamSpec& param = spec.params[ct.param];
  const SliceSpec& slice = ct.slice;
  const int64_t cols = ViewCols(ct.shape);
  const int64_t elem_in = static_cast<int64_t>(DTypeSize(dtype));
  const int64_t elem_out = static_cast<int64_t>(DTypeSize(param.dtype));
  const int64_t first = static_cast<int64_t>(e0);
  const int64_t last = static_cast<int64_t>(e1);

  const int64_t row_first = std::max(first / cols, slice.src_row);
  const int64_t row_last = std::min((last - 1) / cols + 1, slice.src_row + slice.num_rows);
  // A taken layer had every element of its slice; the range check already
  // refused anything overlapping those, so the rest is other ranks'.
  if (row_first >= row_last || layer.taken) return absl::OkStatus();
  if (part != nullptr && part->taken) return absl::OkStatus();
  // The columns of row r that [e0, e1) covers, clipped to the slice.
  auto span_of = [&](int64_t r, int64_t* a, int64_t* b) {
    *a = std::max(std::max(first, r * cols) - r * cols, slice.src_col);
    *b = std::min(std::min(last, (r + 1) * cols) - r * cols, slice.src_col + slice.num_cols);
  };
  if (slice.src_col > 0 || slice.num_cols < cols) {
    // Column slice: skip chunks that lie wholly in other ranks' columns
    // without allocating staging for them.
    bool touches = false;
    for (int64_t r = row_first; r < row_last && !touches; ++r) {
      int64_t a, b;
      span_of(r, &a, &b);
      touches = a < b;
    }
    if (!touches) return absl::OkStatus();
  }
  int64_t row_base = 0;
  absl::StatusOr<StagingBuffer*> staging = StagingFor(ct, &row_base);
  if (!staging.ok()) return staging.status();
  uint8_t* dst_base = (*staging)->data();
  int64_t contributed = 0;
  for (int64_t r = row_first; r < row_last; ++r) {
    int64_t a, b;
    span_of(r, &a, &b);
    if (a >= b) continue;
    const int64_t dst_index =
        (slice.dst_row - row_base + (r - slice.src_row)) * slice.num_cols + (a - slice.src_col);
    const uint8_t* src = data + ((r * cols + a) - first) * elem_in;
    absl::Status converted = ConvertFloats(src, dtype, dst_base + dst_index * elem_out, param.dtype,
                                           static_cast<size_t>(b - a));
    if (!converted.ok()) return converted;
    contributed += b - a;
  }
  Count(ct, contributed, completed);
  return absl::OkStatus();
}

absl::StatusOr<StagingBuffer*> LayerAssembler::StagingFor(const CheckpointTensor& ct,
                                                          int64_t* row_base) {
  LayerState& layer = layers_[ct.layer];
  *row_base = 0;
  if (ct.part >= 0) {
    PartState& part = layer.parts[ct.part];
    if (part.buffer.empty()) {
      if (absl::Status s = EnsurePartStaging(ct.layer, ct.part); !s.ok()) return s;
    }
    // A part's buffer holds its own rows of the param.
    *row_base = layout_.layers()[ct.layer].parts[ct.part].row0;
    return &part.buffer;
  }
  if (layer.params.empty()) {
    if (absl::Status s = EnsureStaging(ct.layer); !s.ok()) return s;
  }
  return &layer.params[ct.param];
}

void LayerAssembler::Count(const CheckpointTensor& ct, int64_t contributed, WorkUnit* completed) {
  const LayerSpec& spec = layout_.layers()[ct.layer];
  LayerState& layer = layers_[ct.layer];
  layer.loaded += contributed;
  elements_loaded_ += contributed;
  if (ct.part >= 0) {
    PartState& part = layer.parts[ct.part];
    part.loaded += contributed;
    if (contributed > 0 && part.loaded == spec.parts[ct.part].numel()) {
      completed->layer = ct.layer;
      completed->part = ct.part;
    }
  } else if (contributed > 0 && spec.kind != LayerKind::kAttention &&
             layer.loaded == spec.expected_numel) {
    completed->layer = ct.layer;
    completed->part = -1;
  }
}

bool LayerAssembler::CanReadInPlace(const CheckpointTensor& ct, const Chunk& chunk) const {
  if (chunk.keep == nullptr || !chunk.pieces.empty()) return false;
  const LayerSpec& spec = layout_.layers()[ct.layer];
  if (spec.kind == LayerKind::kAttention) return false;
  const ParamSpec& param = spec.params[ct.param];
  if (chunk.dtype != param.dtype || ct.slice.src_col != 0 ||
      ct.slice.num_cols != ViewCols(ct.shape)) {
    return false;
  }
  if (reinterpret_cast<uintptr_t>(chunk.data.data()) % DTypeSize(chunk.dtype) != 0) return false;
  // Only the quantizer reads aliased rows; kept tensors are copied anyway.
  if (ct.part >= 0) return spec.parts[ct.part].scale >= 0;  // an expert's w13 or w2
  if (spec.kind == LayerKind::kExperts) return false;
  for (const KernelPlan& plan : spec.plan) {
    if (plan.param == ct.param && plan.scale >= 0) return true;
  }
  return false;
}

absl::Status LayerAssembler::AliasInPlace(const CheckpointTensor& ct, const Chunk& chunk,
                                          uint64_t e0, uint64_t e1, WorkUnit* completed) {
  LayerState& layer = layers_[ct.layer];
  if (layer.taken) return absl::OkStatus();
  PartState* part = ct.part >= 0 ? &layer.parts[ct.part] : nullptr;
  if (part != nullptr && part->taken) return absl::OkStatus();
  const SliceSpec& slice = ct.slice;
  const int64_t cols = ViewCols(ct.shape);
  const int64_t elem = static_cast<int64_t>(DTypeSize(chunk.dtype));
  // The slice is whole rows, so its part of the chunk is one range.
  const int64_t lo = std::max(static_cast<int64_t>(e0), slice.src_row * cols);
  const int64_t hi = std::min(static_cast<int64_t>(e1), (slice.src_row + slice.num_rows) * cols);
  if (lo >= hi) return absl::OkStatus();
  int64_t row_base = 0;
  absl::StatusOr<StagingBuffer*> staging = StagingFor(ct, &row_base);
  if (!staging.ok()) return staging.status();
  const int64_t dst = (slice.dst_row - row_base) * cols + (lo - slice.src_row * cols);
  (*staging)->AddAlias(dst * elem, chunk.data.data() + (lo - static_cast<int64_t>(e0)) * elem,
                       (hi - lo) * elem, chunk.keep, chunk.device);
  bytes_in_place_ += (hi - lo) * elem;
  Count(ct, hi - lo, completed);
  return absl::OkStatus();
}

absl::Status LayerAssembler::EnsurePartStaging(int l, int p) {
  PartState& part = layers_[l].parts[p];
  if (!part.buffer.empty() || part.taken) return absl::OkStatus();
  const LayerSpec& spec = layout_.layers()[l];
  const int64_t bytes = spec.part_bytes(p);
  if (reserve_) {
    if (absl::Status s = reserve_(spec, bytes); !s.ok()) return s;
  }
  absl::StatusOr<StagingBuffer> buffer = options_.zero_fill
                                             ? StagingBuffer::HostZeroed(bytes, spec.parts[p].name)
                                             : StagingBuffer::HostPooled(bytes, spec.parts[p].name);
  if (!buffer.ok()) return buffer.status();
  part.buffer = *std::move(buffer);
  staging_bytes_ += bytes;
  return absl::OkStatus();
}

StagingBuffer LayerAssembler::TakePart(int l, int p) {
  PartState& part = layers_[l].parts[p];
  part.taken = true;
  staging_bytes_ -= part.buffer.size();
  return std::exchange(part.buffer, StagingBuffer());
}

std::vector<std::string> LayerAssembler::MissingPartTensors(int l, int p) const {
  std::vector<std::string> missing;
  const std::vector<CheckpointTensor>& cts = layout_.checkpoint_tensors();
  for (size_t i = 0; i < cts.size(); ++i) {
    if (cts[i].layer == l && cts[i].part == p && !tensors_[i].seen) missing.push_back(cts[i].name);
  }
  return missing;
}

absl::Status LayerAssembler::EnsureStaging(int l) {
  LayerState& layer = layers_[l];
  if (!layer.params.empty() || layer.taken) return absl::OkStatus();
  const LayerSpec& spec = layout_.layers()[l];
  // Experts layers stage part by part (EnsurePartStaging).
  if (spec.kind == LayerKind::kExperts) return absl::OkStatus();
  const int64_t bytes = spec.param_bytes();
  if (reserve_) {
    if (absl::Status s = reserve_(spec, bytes); !s.ok()) return s;
  }
  std::vector<StagingBuffer> params;
  params.reserve(spec.params.size());
  for (const ParamSpec& param : spec.params) {
    // Zeros matter where elements may never be written: padding rows,
    // zero-filled partial layers, attention scales that may not come.
    const bool zero = param.loaded_numel < param.numel() || options_.zero_fill ||
                      spec.kind == LayerKind::kAttention;
    absl::StatusOr<StagingBuffer> buffer =
        zero ? StagingBuffer::HostZeroed(param.nbytes(), spec.name)
             : StagingBuffer::HostPooled(param.nbytes(), spec.name);
    if (!buffer.ok()) return buffer.status();
    params.push_back(*std::move(buffer));
  }
  layer.params = std::move(params);
  layer.param_bytes = bytes;
  staging_bytes_ += bytes;
  return absl::OkStatus();
}

std::vector<StagingBuffer> LayerAssembler::TakeParams(int l) {
  LayerState& layer = layers_[l];
  layer.taken = true;
  staging_bytes_ -= layer.param_bytes;
  layer.param_bytes = 0;
  return std::exchange(layer.params, {});
}

absl::Status LayerAssembler::CheckTensorsComplete() const {
  const std::vector<CheckpointTensor>& cts = layout_.checkpoint_tensors();
  for (size_t i = 0; i < cts.size(); ++i) {
    const TensorState& ts = tensors_[i];
    if (!ts.seen || ts.ranges.complete()) continue;
    // A tensor received only in part is truncated data, never padding.
    return absl::DataLossError(absl::StrCat("tensor \"", cts[i].name, "\" is incomplete: received ",
                                            ts.ranges.received(), " of ", ts.ranges.size(),
                                            " bytes"));
  }
  return absl::OkStatus();
}

std::vector<std::string> LayerAssembler::MissingTensors(int l) const {
  std::vector<std::string> missing;
  const std::vector<CheckpointTensor>& cts = layout_.checkpoint_tensors();
  for (size_t i = 0; i < cts.size(); ++i) {
    if (cts[i].use == CheckpointTensor::Use::kTarget && cts[i].layer == l && !cts[i].optional &&
        !tensors_[i].seen && cts[i].slice.numel() > 0) {
      missing.push_back(cts[i].name);
    }
  }
  return missing;
}

int64_t LayerAssembler::layers_in_flight() const {
  int64_t n = 0;
  for (const LayerState& layer : layers_) {
    bool staged = !layer.params.empty();
    for (const PartState& part : layer.parts) staged |= !part.buffer.empty();
    n += staged ? 1 : 0;
  }
  return n;
}

void LayerAssembler::Clear() {
  tensors_.clear();
  tensors_.shrink_to_fit();
  layers_.clear();
  layers_.shrink_to_fit();
  device_bounce_ = {};
  staging_bytes_ = 0;
}

}  // namespace refit::core
