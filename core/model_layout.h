// What refitd serves: the kernel tensors of one tensor-parallel rank, the
// checkpoint-format buffers they are computed from, and how every checkpoint
// tensor name maps onto them.
//
// Pipeline position: built once from ModelConfig + ParallelConfig +
// QuantConfig when a model group is created; ShardStore allocates the kernel
// tensors from it; RefitSession arms one staging record per layer from it and
// routes every chunk through NameMapper.
//
// Terms (as in vLLM's layerwise reload):
//   layer       a module whose parameters are processed together, e.g.
//               "model.layers.0.self_attn.qkv_proj" (fused q, k, v).
//   param       a checkpoint-format buffer of a layer, e.g. its high-precision
//               "weight" [rows, cols] for this rank (fused, TP-sliced, padded).
//   kernel      a runtime tensor that engines read, e.g. the FP8 "weight" and
//               float32 "weight_scale". Kernel names are "<layer>.<suffix>".
//   checkpoint tensor  a tensor as the trainer / Hugging Face names it, full
//               (unsharded) shape, e.g. "model.layers.0.self_attn.k_proj.weight".
//
// Kernel layout of a quantized linear layer with output rows N, input K:
//   weight        F8_E4M3 [N, K] row-major (vLLM's [K, N] weight is its .t() view)
//   weight_scale  F32 [1] (per-tensor) or [N, 1] (per-channel)
//   weight_scale_inv  F32 [ceil(N/128), ceil(K/128)] (block), replaces weight_scale
//   bias          checkpoint dtype [N], when the model has one
// Embedding / lm_head: "weight" in the checkpoint dtype, [V_pad/t, H] where
// V_pad is the vocabulary rounded up to a multiple of 64 (vLLM's
// VocabParallelEmbedding: pad first, then divide by the TP size, which must
// divide V_pad); rank r holds global rows [r*V_pad/t, (r+1)*V_pad/t), rows at
// or past V zero. Norms: "weight" [H] (or [head_dim] for Qwen3 q/k norms).
// Attention ("model.layers.i.self_attn.attn"): F32 scalars "k_scale",
// "v_scale", "q_scale" ([] shape), set at finalize by ResolveAttentionScales.
//
// Immutable after Build; safe to share between threads.
#ifndef REFIT_CORE_MODEL_LAYOUT_H_
#define REFIT_CORE_MODEL_LAYOUT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/model_config.h"

namespace refit::core {

enum class QuantScheme { kNone, kPerTensor, kPerChannel, kBlock128 };
absl::string_view QuantSchemeName(
    QuantScheme scheme);  // "none", "per-tensor", "per-channel", "block"
absl::StatusOr<QuantScheme> ParseQuantScheme(absl::string_view name);

// Tensor parallelism slices every layer over tp_size ranks. Expert
// parallelism (mixture-of-experts models only) gives each of ep_size ranks
// the contiguous experts [ep_rank * E / ep_size, (ep_rank + 1) * E / ep_size),
// whole: as vLLM's FusedMoE under expert parallelism, whose experts are then
// not tensor-parallel (moe tp size 1). With ep_size 1 the experts are
// tensor-parallel over their intermediate size (I_r = I / tp_size).
struct ParallelConfig {
  int64_t tp_rank = 0;
  int64_t tp_size = 1;
  int64_t ep_rank = 0;
  int64_t ep_size = 1;
};

enum class LayerKind {
  kLinear,     // quantized (unless QuantScheme::kNone): weight (+ bias)
  kEmbedding,  // embed_tokens / lm_head: vocab-padded, kept high precision
  kNorm,       // RMSNorm weight, kept high precision
  kAttention,  // k/v/q scales, processed at finalize only
  kRouter,     // MoE router ("<mlp>.gate"): [E, H] in the checkpoint dtype, replicated
  kExperts,    // MoE experts: fused w13 / w2 of E_local experts, processed per part
};

struct KernelSpec {
  std::string name;    // "<layer>.weight", "<layer>.weight_scale", ...
  std::string suffix;  // "weight", "weight_scale", ...
  DType dtype;
  std::vector<int64_t> shape;
  int64_t numel() const;
  int64_t nbytes() const;
};

struct ParamSpec {
  std::string suffix;  // "weight", "bias", "k_scale", ...
  DType dtype;
  std::vector<int64_t> shape;  // this rank's checkpoint-format buffer (2-D or 1-D; [] for scalars)
  int64_t loaded_numel;        // elements the checkpoint fills (padding excluded)
  bool optional = false;       // attention scales: may be absent
  int64_t numel() const;
  int64_t nbytes() const;
};

// How one kernel of a non-attention layer is made: copied from the param
// `param` (same suffix), or, when `scale` >= 0, FP8-quantized from it with
// the scales going to kernel `scale`. Scale kernels have param = -1: they are
// written with their weight.
struct KernelPlan {
  int param = -1;
  int scale = -1;
};

// One expert's w13 (gate rows, then up rows) or w2 in an experts layer: the
// unit that is staged, quantized (its own scale(s), as vLLM's per-expert
// scaled_fp8_quant) and freed on its own. Its rows [row0, row0 + rows) of
// param `param` become the bytes at kernel_offset of kernel `kernel` and its
// scales the bytes at scale_offset of kernel `scale` (-1: not quantized).
struct LayerPart {
  std::string name;    // "<layer>.<global expert>.w13" / ".w2"
  int64_t expert = 0;  // global expert id
  int param = 0;
  int64_t row0 = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  int kernel = -1;
  int scale = -1;
  int64_t kernel_offset = 0;  // bytes
  int64_t kernel_bytes = 0;
  int64_t scale_offset = 0;  // bytes
  int64_t scale_bytes = 0;
  int64_t numel() const { return rows * cols; }
};

struct LayerSpec {
  std::string name;
  LayerKind kind;
  bool quantized = false;
  std::vector<ParamSpec> params;
  std::vector<KernelSpec> kernels;
  std::vector<KernelPlan> plan;  // one per kernel; empty for attention layers
  int first_kernel = 0;          // flattened index of kernels[0] over the layout
  int64_t expected_numel = 0;    // sum of params' loaded_numel (0 for attention)
  // kExperts only: its parts, w13 and w2 of each local expert in turn.
  // Staging, completion and processing go part by part.
  std::vector<LayerPart> parts;
  int64_t param_bytes() const;  // checkpoint-format staging size
  // Checkpoint-format bytes of part `p` (kExperts).
  int64_t part_bytes(int p) const;
  // Index of the param / kernel with this suffix, or -1.
  int ParamIndex(absl::string_view suffix) const;
  int KernelIndex(absl::string_view suffix) const;
};

// Where a checkpoint tensor's elements go. The source is viewed as a 2-D
// row-major matrix [rows, cols] (1-D tensors as [n, 1], scalars as [1, 1]);
// the block [src_row, src_row + num_rows) x [src_col, src_col + num_cols) is
// copied to the param's rows starting at dst_row (param viewed as
// [param_rows, num_cols]).
struct SliceSpec {
  int64_t src_row = 0;
  int64_t num_rows = 0;
  int64_t src_col = 0;
  int64_t num_cols = 0;
  int64_t dst_row = 0;
  int64_t numel() const { return num_rows * num_cols; }
};

struct CheckpointTensor {
  std::string name;
  DType dtype;                 // checkpoint dtype the param expects
  std::vector<int64_t> shape;  // full, unsharded
  // kTarget: loaded into layers[layer].params[param] through `slice`.
  // kIgnored: accepted and dropped (tied lm_head, rotary inv_freq).
  enum class Use { kTarget, kIgnored } use = Use::kTarget;
  int layer = -1;
  int param = -1;
  SliceSpec slice;
  bool optional = false;  // may be absent from a checkpoint (attention scales)
  int part = -1;          // experts layers: the LayerPart it fills (slice.dst_row is param-wide)
  int64_t numel() const;
  int64_t nbytes() const;
};

class ModelLayout {
 public:
  // Errors:
  //   INVALID_ARGUMENT  the parallel config does not fit the model (rank out
  //                     of range, tp_size not dividing the heads, the
  //                     intermediate size or the padded vocabulary, ...), a
  //                     non-positive dimension, a checkpoint dtype that is not
  //                     bf16/fp16/fp32; for MoE: ep_rank out of range,
  //                     ep_size not dividing the experts, tp_size not dividing
  //                     the expert intermediate size (ep_size 1), ep_size > 1
  //                     for a dense model (each naming the numbers)
  //   UNIMPLEMENTED     a dense architecture with experts
  static absl::StatusOr<std::shared_ptr<const ModelLayout>> Build(const ModelConfig& config,
                                                                  ParallelConfig parallel,
                                                                  QuantScheme quant);

  const ModelConfig& config() const { return config_; }
  const ParallelConfig& parallel() const { return parallel_; }
  QuantScheme quant() const { return quant_; }
  const std::vector<LayerSpec>& layers() const { return layers_; }
  // Every checkpoint tensor the layout knows (targets first, then ignored
  // names), in checkpoint order.
  const std::vector<CheckpointTensor>& checkpoint_tensors() const { return checkpoint_; }
  // Index into layers(), or -1.
  int FindLayer(absl::string_view name) const;
  // Index into checkpoint_tensors() of the tensor a checkpoint names `name`.
  // NOT_FOUND naming it (with a hint when it looks like a name of another
  // layer count or architecture).
  absl::StatusOr<int> FindCheckpointTensor(absl::string_view name) const;
  // Kernels of all layers, flattened in layer order, and their total bytes.
  int64_t num_kernels() const { return num_kernels_; }
  int64_t kernel_bytes() const { return kernel_bytes_; }
  // Largest param_bytes() of any layer.
  int64_t max_layer_param_bytes() const;
  // Largest high-precision staging one unit holds: param_bytes() of a
  // non-expert layer or part_bytes() of an expert part.
  int64_t max_unit_param_bytes() const;
  // The documented bound of a refit's peak high-precision staging when the
  // sender keeps each layer's tensors together and each expert's tensors
  // (gate, up, down) together, in any order of layers, experts and chunks:
  // one unit on the worker, plus the larger of one unit or one whole expert
  // (w13 and w2) being assembled, plus the attention scales (a few bytes a
  // layer, held until Prepare). Senders that interleave experts hold every
  // expert they have started: up to a whole experts layer (the staging
  // budget still caps it).
  int64_t staging_bound_bytes() const;
  // Local experts of each experts layer (0 for a dense model) and the first.
  int64_t num_local_experts() const;
  int64_t first_local_expert() const;

 private:
  friend class LayoutBuilder;
  ModelConfig config_;
  ParallelConfig parallel_;
  QuantScheme quant_ = QuantScheme::kPerTensor;
  std::vector<LayerSpec> layers_;
  std::vector<CheckpointTensor> checkpoint_;
  absl::flat_hash_map<std::string, int> layer_index_;
  absl::flat_hash_map<std::string, int> checkpoint_index_;
  int64_t num_kernels_ = 0;
  int64_t kernel_bytes_ = 0;
};

// The fingerprint of a version: XXH3-64 (16 hex digits) over, for every
// kernel in layout order, its name with the terminating NUL, its dtype name,
// its shape as int64s and the XXH3-64 of its bytes (`hashes[i]`). ShardStore
// publishes it; `refitctl verify` recomputes it from local files.
std::string KernelFingerprint(const std::vector<const KernelSpec*>& specs,
                              const std::vector<uint64_t>& hashes);

// The attention layer's kernel scales from what a checkpoint provided, as
// vLLM resolves them when it loads an FP8 KV cache: k and v both present -> used as they are; both
// missing -> 1.0; one missing -> the other; q missing -> k; the legacy kv_scale stands in for
// whichever of k / v is missing. A value that is not positive and finite counts as missing (pass 0
// for a scale that was not received). Shared by RefitSession and `refitctl verify`, which must
// agree byte for byte.
struct AttentionScales {
  float k = 1.0f;
  float v = 1.0f;
  float q = 1.0f;
  // The value of the kernel with this suffix ("k_scale", "v_scale", "q_scale").
  float ForKernel(absl::string_view suffix) const;
};
AttentionScales ResolveAttentionScales(float k, float v, float q, float kv);

// Checkpoint name -> CheckpointTensor, for code that holds a layout by
// shared pointer. Same errors as ModelLayout::FindCheckpointTensor.
class NameMapper {
 public:
  explicit NameMapper(std::shared_ptr<const ModelLayout> layout);
  absl::StatusOr<const CheckpointTensor*> Lookup(absl::string_view name) const;
  // Index into layout->checkpoint_tensors().
  absl::StatusOr<int> LookupIndex(absl::string_view name) const;

 private:
  std::shared_ptr<const ModelLayout> layout_;
};

}  // namespace refit::core

#endif  // REFIT_CORE_MODEL_LAYOUT_H_
