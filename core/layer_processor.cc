#include "core/layer_processor.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/dtype.h"
#include "core/hash_feed.h"
#include "core/parallel.h"
#include "core/scale_hints.h"
#include "core/shard_store.h"
#include "core/xxh3.h"

#ifdef REFIT_WITH_CUDA
#include "core/cuda/cuda_layer_processor.h"
#endif

namespace refit::core {
namespace {

// The attention layer's kernels: float scalars resolved from the scales the
// checkpoint provided (a zero-filled param reads as "not received").
absl::Status KeepAttentionScales(const LayerSpec& spec, const std::vector<StagingBuffer>& params,
                                 std::vector<StagingBuffer>& kernels) {
  auto received = [&](absl::string_view suffix) -> float {
    const int p = spec.ParamIndex(suffix);
    if (p < 0 || params.empty() || params[p].empty()) return 0.0f;
    return LoadAsFloat(params[p].data(), spec.params[p].dtype, 0);
  };
  const AttentionScales scales = ResolveAttentionScales(received("k_scale"), received("v_scale"),
                                                        received("q_scale"), received("kv_scale"));
  for (size_t i = 0; i < spec.kernels.size(); ++i) {
    const KernelSpec& kernel = spec.kernels[i];
    absl::StatusOr<StagingBuffer> buffer = StagingBuffer::HostZeroed(kernel.nbytes(), kernel.name);
    if (!buffer.ok()) return buffer.status();
    if (kernel.nbytes() == static_cast<int64_t>(sizeof(float))) {
      const float value = scales.ForKernel(kernel.suffix);
      std::memcpy(buffer->data(), &value, sizeof(float));
    }
    kernels[i] = *std::move(buffer);
  }
  return absl::OkStatus();
}

// INVALID_ARGUMENT naming the tensor and its element `index` (at `at`), a
// NaN or Inf, as the FP8 quantizer reports one.
absl::Status NonFiniteError(absl::string_view kernel_name, const ParamSpec& param, int64_t index,
                            const uint8_t* at) {
  const char* text = "nan or inf";
  if (IsHighPrecisionFloat(param.dtype)) {
    const float value = LoadAsFloat(at, param.dtype, 0);
    text = std::isinf(value) ? (value > 0 ? "inf" : "-inf") : "nan";
  }
  absl::Status status = absl::InvalidArgumentError(
      absl::StrCat("tensor '", kernel_name, "': element ", index, " is ", text,
                   "; the non-finite policy REJECT refuses non-finite values in every float tensor "
                   "(NON_FINITE_POLICY_VLLM_COMPATIBLE accepts them)"));
  const int64_t cols = param.shape.size() == 2 && param.shape[1] > 0 ? param.shape[1] : 1;
  SetNonFiniteElement(status, index / cols, index % cols);
  return status;
}

// A NaN/Inf a check found at (row, col) (NonFiniteElement) of what was made
// from param `p` of layer `l`, rows counted from the param's row `row0`
// (an expert's part), named `made`: prefixed with the checkpoint tensor that
// filled that row and where the element lies in it. That is what the
// trainer sent; a fused (q/k/v, gate/up) or tensor-parallel kernel's
// coordinates are not.
absl::Status NameCheckpointElement(const ModelLayout& layout, int l, int p, int64_t row0,
                                   absl::string_view made, absl::Status status) {
  const std::optional<std::pair<int64_t, int64_t>> at = NonFiniteElement(status);
  if (!at.has_value()) return status;
  const int64_t row = row0 + at->first;
  for (const CheckpointTensor& t : layout.checkpoint_tensors()) {
    if (t.use != CheckpointTensor::Use::kTarget || t.layer != l || t.param != p) continue;
    const SliceSpec& s = t.slice;
    if (row < s.dst_row || row >= s.dst_row + s.num_rows) continue;
    const int64_t src_row = s.src_row + (row - s.dst_row);
    const int64_t src_col = s.src_col + at->second;
    if (t.name == made && src_row == at->first && src_col == at->second) return status;
    const std::string where = t.shape.size() == 2 ? absl::StrCat("row ", src_row, ", col ", src_col)
                                                  : absl::StrCat("element ", src_row);
    absl::Status named = absl::Status(
        status.code(),
        absl::StrCat("checkpoint tensor '", t.name, "' ", where, ": ", status.message()));
    SetNonFiniteElement(named, at->first, at->second);
    return named;
  }
  return status;
}

// INVALID_ARGUMENT naming the tensor and its first NaN/Inf element.
absl::Status CheckFinite(absl::string_view kernel_name, const ParamSpec& param,
                         const StagingBuffer& bytes) {
  const int64_t esize = static_cast<int64_t>(DTypeSize(param.dtype));
  const int64_t index = FindNonFinite(bytes.data(), param.dtype, bytes.size() / esize);
  if (index < 0) return absl::OkStatus();
  return NonFiniteError(kernel_name, param, index, bytes.data() + index * esize);
}

// Bytes per step of OwnCheckAndHash: in L2 while they are checked and hashed.
constexpr int64_t kKeepStepBytes = int64_t{1} << 16;

// Makes `bytes` (a kernel kept in the checkpoint dtype) own its bytes,
// checks them for NaN/Inf when `check`, and returns their XXH3: one sweep,
// each step copied in (when read in place from a trainer's region),
// checked and hashed while it is in cache, instead of a copy, a scan and a
// hash each reading the whole tensor from memory. Steps run on the bulk
// threads (an embedding or LM head is an eighth of an 8B model's bytes),
// and each is fed to the one hash in order as soon as it and the ones
// before it are through (HashFeed). A non-finite value is named by the
// first one in memory order, as a walk in order would. Device aliases are
// brought over first, whole.
absl::StatusOr<uint64_t> OwnCheckAndHash(absl::string_view kernel_name, const ParamSpec& param,
                                         bool check, StagingBuffer& bytes) {
  if (bytes.has_device_aliases()) {
    if (absl::Status m = bytes.MaterializeAliases(); !m.ok()) return m;
  }
  const int64_t esize = static_cast<int64_t>(DTypeSize(param.dtype));
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> state(XXH3_createState(),
                                                                        &XXH3_freeState);
  if (state == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("tensor '", kernel_name, "': no memory for a hash state"));
  }
  XXH3_64bits_reset(state.get());
  const int64_t step = esize > 0 ? kKeepStepBytes / esize * esize : kKeepStepBytes;
  HashFeed feed(state.get(), bytes.data(), bytes.size(), step);
  absl::Status swept =
      bytes.MaterializeInSteps(step, HashThreads(bytes.size()), [&](int64_t at, int64_t n) {
        const uint8_t* p = bytes.data() + at;
        if (check && esize > 0) {
          const int64_t bad = FindNonFinite(p, param.dtype, n / esize);
          if (bad >= 0)
            return NonFiniteError(kernel_name, param, at / esize + bad, p + bad * esize);
        }
        feed.Written(at / step);
        return absl::OkStatus();
      });
  if (!swept.ok()) return swept;
  feed.Finish();
  return XXH3_64bits_digest(state.get());
}

}  // namespace

uint64_t HashBytes(const void* data, int64_t size) {
  return XXH3_64bits(data, static_cast<size_t>(size));
}

int HashThreads(int64_t bytes) { return bytes < (int64_t{1} << 20) ? 1 : BulkThreads(); }

std::vector<absl::Span<const uint8_t>> LayerProcessor::AheadPieces(
    const LayerSpec& spec, size_t k, DType dtype,
    std::vector<absl::Span<const uint8_t>> pieces) const {
  const KernelPlan& plan = spec.plan[k];
  if (layout_.quant() != QuantScheme::kPerTensor || plan.param < 0 || plan.scale < 0) return {};
  const ParamSpec& param = spec.params[plan.param];
  int64_t total = 0;
  for (absl::Span<const uint8_t> piece : pieces) total += static_cast<int64_t>(piece.size());
  if (param.dtype != dtype || total != param.nbytes() || total == 0) return {};
  if (options_.scale_hints != nullptr && options_.scale_hints->Hint(spec.kernels[k].name) > 0) {
    return {};
  }
  return pieces;
}

std::vector<absl::Span<const uint8_t>> LayerProcessor::AheadInUpcoming(
    absl::Span<const UpcomingLayer> upcoming, DType dtype) const {
  for (const UpcomingLayer& next : upcoming) {
    if (next.layer < 0 || next.layer >= static_cast<int>(layout_.layers().size())) return {};
    const LayerSpec& spec = layout_.layers()[next.layer];
    if (spec.kind == LayerKind::kExperts || next.params.size() != spec.params.size()) return {};
    for (size_t k = 0; k < spec.kernels.size(); ++k) {
      const KernelPlan& plan = spec.plan[k];
      if (plan.param >= 0 && plan.scale >= 0) {
        if (spec.kind != LayerKind::kLinear) return {};
        return AheadPieces(spec, k, dtype, next.params[plan.param]);
      }
    }
    // Nothing quantized in it (a norm, an embedding): look further.
  }
  return {};
}

absl::StatusOr<ProcessedLayer> LayerProcessor::Process(int l, std::vector<StagingBuffer> params,
                                                       absl::Span<const UpcomingLayer> upcoming) {
  const absl::Time start = absl::Now();
  const LayerSpec& spec = layout_.layers()[l];
  // The assembler hands over exactly the layer's params; anything else is a
  // bug that must not reach a quantizer reading `rows * cols` elements.
  if (!params.empty() || spec.kind != LayerKind::kAttention) {
    if (params.size() != spec.params.size()) {
      return absl::InternalError(absl::StrCat("layer \"", spec.name, "\": ", params.size(),
                                              " param buffers, layout has ", spec.params.size()));
    }
    for (size_t p = 0; p < params.size(); ++p) {
      if (params[p].size() != spec.params[p].nbytes()) {
        return absl::InternalError(absl::StrCat("layer \"", spec.name, "\": param \"",
                                                spec.params[p].suffix, "\" has ", params[p].size(),
                                                " bytes, layout has ", spec.params[p].nbytes()));
      }
    }
  }
  if (spec.kind == LayerKind::kExperts) {
    return absl::InternalError(
        absl::StrCat("layer \"", spec.name, "\": experts layers are processed part by part"));
  }
  absl::StatusOr<std::unique_ptr<LayerBuild>> build = Start(spec);
  if (!build.ok()) return build.status();
  if (spec.kind == LayerKind::kAttention) {
    std::vector<StagingBuffer> kernels(spec.kernels.size());
    if (absl::Status s = KeepAttentionScales(spec, params, kernels); !s.ok()) return s;
    for (size_t k = 0; k < kernels.size(); ++k) {
      if (absl::Status s = (*build)->Keep(static_cast<int>(k), std::move(kernels[k])); !s.ok()) {
        return s;
      }
    }
  } else {
    // Each FP8 weight's convert may take the amax of the one quantized after
    // it (LayerBuild::LookAhead): the next in this layer, or for the last
    // one the first in the layers queued behind this one.
    std::vector<size_t> fp8;
    for (size_t k = 0; k < spec.kernels.size(); ++k) {
      if (spec.plan[k].param >= 0 && spec.plan[k].scale >= 0) fp8.push_back(k);
    }
    size_t fp8_done = 0;
    for (size_t k = 0; k < spec.kernels.size(); ++k) {
      const KernelPlan& plan = spec.plan[k];
      if (plan.param < 0) continue;  // a scale, written with its weight
      const ParamSpec& param = spec.params[plan.param];
      if (plan.scale < 0) {
        // Kept in the checkpoint dtype: the param buffer becomes the kernel.
        // The reject policy covers these too (embeddings, lm_head, norms):
        // the quantizer only sees the FP8 weights. A kernel owns its bytes:
        // anything read in place is copied in first.
        absl::StatusOr<uint64_t> hash =
            OwnCheckAndHash(spec.kernels[k].name, param,
                            options_.non_finite == NonFinitePolicy::kReject, params[plan.param]);
        if (!hash.ok()) {
          return NameCheckpointElement(layout_, l, plan.param, 0, spec.kernels[k].name,
                                       hash.status());
        }
        absl::Status kept =
            (*build)->KeepHashed(static_cast<int>(k), std::move(params[plan.param]), *hash);
        if (!kept.ok()) return kept;
        continue;
      }
      const int64_t rows = param.shape[0];
      const int64_t cols = param.shape[1];
      const KernelSpec& weight = spec.kernels[k];
      const KernelSpec& scale = spec.kernels[plan.scale];
      // Quantizers write exactly these sizes: check them before they do.
      if (weight.nbytes() != rows * cols ||
          scale.nbytes() !=
              Fp8NumScales(layout_.quant(), rows, cols) * static_cast<int64_t>(sizeof(float))) {
        return absl::InternalError(absl::StrCat("kernel \"", weight.name,
                                                "\": FP8 kernel or scale sizes do not match [",
                                                rows, ", ", cols, "]"));
      }
      ++fp8_done;
      if (fp8_done < fp8.size()) {
        const size_t next = fp8[fp8_done];
        (*build)->LookAhead(
            AheadPieces(spec, next, param.dtype, params[spec.plan[next].param].HostPieces()));
      } else {
        (*build)->LookAhead(AheadInUpcoming(upcoming, param.dtype));
      }
      absl::Status quantized = (*build)->Quantize(std::move(params[plan.param]), param.dtype, rows,
                                                  cols, static_cast<int>(k), plan.scale);
      if (!quantized.ok()) {
        return NameCheckpointElement(layout_, l, plan.param, 0, weight.name, std::move(quantized));
      }
    }
  }
  params.clear();
  absl::StatusOr<ProcessedLayer> out = (*build)->Finish();
  if (!out.ok()) return NameFinishedElement(l, out.status());
  if (absl::Status made = CheckMade(spec, *out); !made.ok()) return made;
  out->layer = l;
  out->took = absl::Now() - start;
  return out;
}

absl::Status LayerProcessor::NameFinishedElement(int l, absl::Status status) const {
  // A device quantizer reports a NaN/Inf once its queued work has run (at
  // Finish), naming the kernel its job was for: the same naming as a check
  // made at Quantize.
  if (!NonFiniteElement(status).has_value()) return status;
  const LayerSpec& spec = layout_.layers()[l];
  for (size_t k = 0; k < spec.kernels.size(); ++k) {
    const KernelPlan& plan = spec.plan[k];
    if (plan.param < 0 || plan.scale < 0) continue;
    const std::string& name = spec.kernels[k].name;
    if (absl::StartsWith(status.message(), absl::StrCat("tensor '", name, "':"))) {
      return NameCheckpointElement(layout_, l, plan.param, 0, name, std::move(status));
    }
  }
  return status;
}

absl::Status LayerProcessor::CheckMade(const LayerSpec& spec, const ProcessedLayer& out) const {
  // Processing must reproduce the first load's exact sizes, or nothing commits.
  if (out.kernels.size() != spec.kernels.size() || out.hashes.size() != spec.kernels.size()) {
    return absl::InternalError(absl::StrCat("layer \"", spec.name, "\": ", out.kernels.size(),
                                            " kernels made, layout has ", spec.kernels.size()));
  }
  for (size_t k = 0; k < spec.kernels.size(); ++k) {
    if (out.kernels[k].size() != spec.kernels[k].nbytes()) {
      return absl::InternalError(absl::StrCat("kernel \"", spec.kernels[k].name, "\": staged ",
                                              out.kernels[k].size(), " bytes, live tensor has ",
                                              spec.kernels[k].nbytes()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<LayerProcessor::OpenLayer*> LayerProcessor::Open(int l) {
  auto it = open_.find(l);
  if (it != open_.end()) return &it->second;
  const LayerSpec& spec = layout_.layers()[l];
  absl::StatusOr<std::unique_ptr<LayerBuild>> build = Start(spec);
  if (!build.ok()) return build.status();
  OpenLayer& open = open_[l];
  open.build = *std::move(build);
  open.done.assign(spec.parts.size(), false);
  return &open;
}

absl::StatusOr<ProcessedLayer> LayerProcessor::Close(int l) {
  OpenLayer open = std::move(open_[l]);
  open_.erase(l);
  const absl::Time start = absl::Now();
  absl::StatusOr<ProcessedLayer> out = open.build->Finish();
  if (!out.ok()) return out.status();
  if (absl::Status made = CheckMade(layout_.layers()[l], *out); !made.ok()) return made;
  out->layer = l;
  out->part = -1;
  out->took = open.took + (absl::Now() - start);
  return out;
}

absl::StatusOr<ProcessedLayer> LayerProcessor::ProcessPart(int l, int p, StagingBuffer src) {
  const absl::Time start = absl::Now();
  const LayerSpec& spec = layout_.layers()[l];
  if (spec.kind != LayerKind::kExperts || p < 0 || p >= static_cast<int>(spec.parts.size()) ||
      src.size() != spec.part_bytes(p)) {
    return absl::InternalError(absl::StrCat("layer \"", spec.name, "\": no part ", p, " of ",
                                            src.size(), " bytes to process"));
  }
  absl::StatusOr<OpenLayer*> open = Open(l);
  if (!open.ok()) return open.status();
  if ((*open)->done[p]) {
    open_.erase(l);
    return absl::InternalError(absl::StrCat("part \"", spec.parts[p].name, "\" processed twice"));
  }
  const LayerPart& part = spec.parts[p];
  const ParamSpec& param = spec.params[part.param];
  absl::Status made;
  if (part.scale < 0) {
    if (options_.non_finite == NonFinitePolicy::kReject) {
      made = CheckFinite(part.name, param, src);
    }
    if (made.ok())
      made = (*open)->build->KeepRegion(part.kernel, part.kernel_offset, src.data(), src.size());
  } else if (part.scale_bytes != Fp8NumScales(layout_.quant(), part.rows, part.cols) *
                                     static_cast<int64_t>(sizeof(float)) ||
             part.kernel_bytes != part.rows * part.cols) {
    made = absl::InternalError(absl::StrCat("part \"", part.name,
                                            "\": FP8 kernel or scale sizes do not match [",
                                            part.rows, ", ", part.cols, "]"));
  } else {
    made = (*open)->build->QuantizeRegion(std::move(src), param.dtype, part.rows, part.cols,
                                          part.kernel, part.kernel_offset, part.scale,
                                          part.scale_offset, part.name);
  }
  if (!made.ok()) {
    open_.erase(l);
    return NameCheckpointElement(layout_, l, part.param, part.row0, part.name, std::move(made));
  }
  (*open)->done[p] = true;
  ++(*open)->count;
  (*open)->took += absl::Now() - start;
  if ((*open)->count == spec.parts.size()) return Close(l);
  ProcessedLayer out;
  out.layer = l;
  out.part = p;
  out.took = absl::Now() - start;
  return out;
}

absl::StatusOr<ProcessedLayer> LayerProcessor::FinishParts(int l, const LiveBytesFn& live) {
  const LayerSpec& spec = layout_.layers()[l];
  absl::StatusOr<OpenLayer*> open = Open(l);
  if (!open.ok()) return open.status();
  std::string bytes;
  for (size_t p = 0; p < spec.parts.size(); ++p) {
    if ((*open)->done[p]) continue;
    const LayerPart& part = spec.parts[p];
    const std::pair<int, std::pair<int64_t, int64_t>> regions[] = {
        {part.kernel, {part.kernel_offset, part.kernel_bytes}},
        {part.scale, {part.scale_offset, part.scale_bytes}}};
    for (const auto& [k, region] : regions) {
      if (k < 0 || region.second == 0) continue;
      absl::Status read = live(spec.kernels[k], region.first, region.second, &bytes);
      if (read.ok() && static_cast<int64_t>(bytes.size()) != region.second) {
        read =
            absl::InternalError(absl::StrCat("kernel \"", spec.kernels[k].name, "\": read ",
                                             bytes.size(), " live bytes, wanted ", region.second));
      }
      if (read.ok())
        read = (*open)->build->KeepRegion(k, region.first, bytes.data(), region.second);
      if (!read.ok()) {
        open_.erase(l);
        return read;
      }
    }
  }
  return Close(l);
}

absl::StatusOr<std::unique_ptr<LayerProcessor>> CreateLayerProcessor(
    const ShardStore& store, LayerProcessorOptions options) {
  if (store.on_gpu() && !options.host_staging) {
#ifdef REFIT_WITH_CUDA
    return cuda::CreateCudaLayerProcessor(store.layout(), store.device_index(), options);
#else
    return absl::UnavailableError(
        absl::StrCat("store on ", store.device(), ": refitd was built without CUDA"));
#endif
  }
  return CreateHostLayerProcessor(store.layout(), options);
}

}  // namespace refit::core
