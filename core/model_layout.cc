#include "core/model_layout.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "core/text.h"
#include "core/xxh3.h"

namespace refit::core {
namespace {

// vLLM pads the vocabulary of vocab-parallel embeddings to a multiple of 64
// and then divides the padded rows evenly among the TP ranks.
constexpr int64_t kVocabPadMultiple = 64;
// Block-quantization tile (DeepSeek-style 128x128).
constexpr int64_t kQuantBlock = 128;

int64_t Product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t RoundUp(int64_t a, int64_t m) { return CeilDiv(a, m) * m; }

// Block copy of rows [src_row, src_row + num_rows) of a source viewed as
// [*, num_cols] (whole rows).
SliceSpec Rows(int64_t src_row, int64_t num_rows, int64_t num_cols, int64_t dst_row = 0) {
  SliceSpec s;
  s.src_row = src_row;
  s.num_rows = num_rows;
  s.src_col = 0;
  s.num_cols = num_cols;
  s.dst_row = dst_row;
  return s;
}

// Columns [src_col, src_col + num_cols) of every one of `num_rows` rows.
SliceSpec Cols(int64_t num_rows, int64_t src_col, int64_t num_cols) {
  SliceSpec s;
  s.src_row = 0;
  s.num_rows = num_rows;
  s.src_col = src_col;
  s.num_cols = num_cols;
  s.dst_row = 0;
  return s;
}

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("model layout: ", what));
}

}  // namespace

absl::string_view QuantSchemeName(QuantScheme scheme) {
  switch (scheme) {
    case QuantScheme::kNone:
      return "none";
    case QuantScheme::kPerTensor:
      return "per-tensor";
    case QuantScheme::kPerChannel:
      return "per-channel";
    case QuantScheme::kBlock128:
      return "block";
  }
  return "unknown";
}

absl::StatusOr<QuantScheme> ParseQuantScheme(absl::string_view name) {
  for (QuantScheme scheme : {QuantScheme::kNone, QuantScheme::kPerTensor, QuantScheme::kPerChannel,
                             QuantScheme::kBlock128}) {
    if (name == QuantSchemeName(scheme)) return scheme;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown quantization scheme '", name,
                   "' (expected none, per-tensor, per-channel or block)"));
}

int64_t KernelSpec::numel() const { return Product(shape); }
int64_t KernelSpec::nbytes() const { return numel() * static_cast<int64_t>(DTypeSize(dtype)); }
int64_t ParamSpec::numel() const { return Product(shape); }
int64_t ParamSpec::nbytes() const { return numel() * static_cast<int64_t>(DTypeSize(dtype)); }
int64_t CheckpointTensor::numel() const { return Product(shape); }
int64_t CheckpointTensor::nbytes() const {
  return numel() * static_cast<int64_t>(DTypeSize(dtype));
}

int64_t LayerSpec::param_bytes() const {
  int64_t total = 0;
  for (const ParamSpec& p : params) total += p.nbytes();
  return total;
}

int ModelLayout::FindLayer(absl::string_view name) const {
  auto it = layer_index_.find(name);
  return it == layer_index_.end() ? -1 : it->second;
}

int64_t LayerSpec::part_bytes(int p) const {
  return parts[p].numel() * static_cast<int64_t>(DTypeSize(params[parts[p].param].dtype));
}

int64_t ModelLayout::max_unit_param_bytes() const {
  int64_t best = 0;
  for (const LayerSpec& layer : layers_) {
    if (layer.kind != LayerKind::kExperts) {
      best = std::max(best, layer.param_bytes());
      continue;
    }
    for (size_t p = 0; p < layer.parts.size(); ++p) {
      best = std::max(best, layer.part_bytes(static_cast<int>(p)));
    }
  }
  return best;
}

int64_t ModelLayout::staging_bound_bytes() const {
  const int64_t unit = max_unit_param_bytes();
  int64_t expert = 0;
  int64_t attention = 0;
  for (const LayerSpec& layer : layers_) {
    if (layer.kind == LayerKind::kAttention) attention += layer.param_bytes();
    // Parts come in pairs: an expert's w13, then its w2.
    for (size_t p = 0; p + 1 < layer.parts.size(); p += 2) {
      expert = std::max(expert, layer.part_bytes(static_cast<int>(p)) +
                                    layer.part_bytes(static_cast<int>(p + 1)));
    }
  }
  return unit + std::max(unit, expert) + attention;
}

int64_t ModelLayout::num_local_experts() const {
  return config_.is_moe() ? config_.num_experts / std::max<int64_t>(1, parallel_.ep_size) : 0;
}

int64_t ModelLayout::first_local_expert() const { return num_local_experts() * parallel_.ep_rank; }

int64_t ModelLayout::max_layer_param_bytes() const {
  int64_t best = 0;
  for (const LayerSpec& layer : layers_) best = std::max(best, layer.param_bytes());
  return best;
}

// Fills a ModelLayout. Lives in refit::core (not an anonymous namespace) so
// that ModelLayout's friend declaration names it.
class LayoutBuilder {
 public:
  LayoutBuilder(const ModelConfig& config, ParallelConfig parallel, QuantScheme quant)
      : layout_(std::make_shared<ModelLayout>()),
        c_(config),
        rank_(parallel.tp_rank),
        tp_(parallel.tp_size),
        ep_rank_(parallel.ep_rank),
        ep_(parallel.ep_size) {
    layout_->config_ = config;
    layout_->parallel_ = parallel;
    layout_->quant_ = quant;
  }

  absl::Status Validate() const {
    const ModelConfig& c = c_;
    if (tp_ < 1) return Invalid(absl::StrCat("tp_size must be >= 1, got ", tp_));
    if (rank_ < 0 || rank_ >= tp_) {
      return Invalid(absl::StrCat("tp_rank ", rank_, " out of range for tp_size ", tp_));
    }
    const std::pair<const char*, int64_t> positive[] = {{"hidden_size", c.hidden_size},
                                                        {"intermediate_size", c.intermediate_size},
                                                        {"num_hidden_layers", c.num_layers},
                                                        {"num_attention_heads", c.num_heads},
                                                        {"num_key_value_heads", c.num_kv_heads},
                                                        {"head_dim", c.head_dim},
                                                        {"vocab_size", c.vocab_size}};
    for (const auto& [field, value] : positive) {
      if (value <= 0) return Invalid(absl::StrCat(field, " must be positive, got ", value));
    }
    if (c.num_heads % c.num_kv_heads != 0) {
      return Invalid(absl::StrCat("num_attention_heads ", c.num_heads,
                                  " is not a multiple of num_key_value_heads ", c.num_kv_heads));
    }
    if (!IsHighPrecisionFloat(c.dtype)) {
      return Invalid(
          absl::StrCat("checkpoint dtype must be bf16, fp16 or fp32, got ", DTypeName(c.dtype)));
    }
    if (c.num_experts > 0 && !c.is_moe()) {
      return absl::UnimplementedError(absl::StrCat("model layout: mixture-of-experts (num_experts ",
                                                   c.num_experts, ") in dense architecture ",
                                                   c.arch_name, " is not supported"));
    }
    if (c.num_heads % tp_ != 0) {
      return Invalid(
          absl::StrCat("tp_size ", tp_, " does not divide num_attention_heads ", c.num_heads));
    }
    bool any_dense_mlp = false;
    for (int64_t i = 0; i < c.num_layers; ++i) any_dense_mlp |= !c.IsSparseLayer(i);
    if (any_dense_mlp && c.intermediate_size % tp_ != 0) {
      return Invalid(absl::StrCat("tp_size ", tp_, " does not divide intermediate_size ",
                                  c.intermediate_size));
    }
    if (ep_ < 1) return Invalid(absl::StrCat("ep_size must be >= 1, got ", ep_));
    if (ep_rank_ < 0 || ep_rank_ >= ep_) {
      return Invalid(absl::StrCat("ep_rank ", ep_rank_, " out of range for ep_size ", ep_));
    }
    if (!c.is_moe() && ep_ > 1) {
      return Invalid(absl::StrCat("ep_size ", ep_, " needs a mixture-of-experts model; ",
                                  c.arch_name.empty() ? "this model" : c.arch_name,
                                  " has no experts"));
    }
    if (c.is_moe()) {
      if (c.num_experts <= 0 || c.moe_intermediate_size <= 0) {
        return Invalid(absl::StrCat("num_experts ", c.num_experts, " and moe_intermediate_size ",
                                    c.moe_intermediate_size, " must be positive"));
      }
      if (c.num_experts % ep_ != 0) {
        return Invalid(
            absl::StrCat("num_experts ", c.num_experts, " is not divisible by ep_size ", ep_));
      }
      if (ep_ == 1 && c.moe_intermediate_size % tp_ != 0) {
        return Invalid(absl::StrCat("tp_size ", tp_,
                                    " does not divide the expert intermediate size ",
                                    c.moe_intermediate_size));
      }
    }
    const int64_t vocab_padded = RoundUp(c.vocab_size, kVocabPadMultiple);
    if (vocab_padded % tp_ != 0) {
      return Invalid(absl::StrCat("tp_size ", tp_, " does not divide the padded vocabulary ",
                                  vocab_padded, " (vocab_size ", c.vocab_size,
                                  " rounded up to a multiple of ", kVocabPadMultiple, ")"));
    }
    if (c.num_kv_heads % tp_ != 0 && tp_ % c.num_kv_heads != 0) {
      return Invalid(absl::StrCat("num_key_value_heads ", c.num_kv_heads, " and tp_size ", tp_,
                                  ": one must be a multiple of the other"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::shared_ptr<const ModelLayout>> Build() {
    const ModelConfig& c = c_;
    const DType dt = c.dtype;
    const int64_t h = c.hidden_size;
    const int64_t d = c.head_dim;
    const int64_t nh_r = c.num_heads / tp_;
    // When there are fewer kv heads than ranks, each rank holds one kv head,
    // replicated across tp_ / num_kv_heads consecutive ranks.
    const bool kv_replicated = tp_ > c.num_kv_heads;
    const int64_t nkv_r = kv_replicated ? 1 : c.num_kv_heads / tp_;
    const int64_t kv_head0 = kv_replicated ? rank_ / (tp_ / c.num_kv_heads) : rank_ * nkv_r;
    const int64_t i_r = c.intermediate_size / tp_;
    const int64_t qkv_rows = (nh_r + 2 * nkv_r) * d;
    const bool qkv_bias = c.attention_bias || c.arch == Architecture::kQwen2;
    // Qwen2 has q/k/v bias only; Llama-style attention_bias also biases o_proj.
    const bool o_bias = c.attention_bias && c.arch != Architecture::kQwen2;
    const bool qk_norm = c.arch == Architecture::kQwen3 || c.arch == Architecture::kQwen3Moe;

    AddEmbedding("model.embed_tokens", "model.embed_tokens.weight");

    for (int64_t i = 0; i < c.num_layers; ++i) {
      const std::string p = absl::StrCat("model.layers.", i);
      AddNorm(absl::StrCat(p, ".input_layernorm"), h);

      // Fused q/k/v: rows q | k | v of this rank.
      {
        const std::string attn = absl::StrCat(p, ".self_attn.");
        int layer = AddLinear(absl::StrCat(attn, "qkv_proj"), qkv_rows, h, qkv_bias);
        const int64_t q_rows = c.num_heads * d;
        const int64_t kv_rows = c.num_kv_heads * d;
        struct Shard {
          const char* name;
          int64_t full_rows;
          int64_t src_row;
          int64_t num_rows;
          int64_t dst_row;
        };
        const Shard shards[] = {
            {"q_proj", q_rows, rank_ * nh_r * d, nh_r * d, 0},
            {"k_proj", kv_rows, kv_head0 * d, nkv_r * d, nh_r * d},
            {"v_proj", kv_rows, kv_head0 * d, nkv_r * d, (nh_r + nkv_r) * d},
        };
        for (const Shard& s : shards) {
          AddTarget(absl::StrCat(attn, s.name, ".weight"), dt, {s.full_rows, h}, layer, 0,
                    Rows(s.src_row, s.num_rows, h, s.dst_row));
          if (qkv_bias) {
            AddTarget(absl::StrCat(attn, s.name, ".bias"), dt, {s.full_rows}, layer, 1,
                      Rows(s.src_row, s.num_rows, 1, s.dst_row));
          }
        }
        if (qk_norm) {
          AddNorm(absl::StrCat(attn, "q_norm"), d);
          AddNorm(absl::StrCat(attn, "k_norm"), d);
        }
        // Row-parallel o_proj: this rank's input columns; the bias is whole.
        const int64_t o_cols = nh_r * d;
        layer = AddLinear(absl::StrCat(attn, "o_proj"), h, o_cols, o_bias);
        AddTarget(absl::StrCat(attn, "o_proj.weight"), dt, {h, c.num_heads * d}, layer, 0,
                  Cols(h, rank_ * o_cols, o_cols));
        if (o_bias) {
          AddTarget(absl::StrCat(attn, "o_proj.bias"), dt, {h}, layer, 1, Rows(0, h, 1));
        }
        AddAttention(absl::StrCat(attn, "attn"), attn);
      }

      AddNorm(absl::StrCat(p, ".post_attention_layernorm"), h);

      if (c.IsSparseLayer(i)) {
        AddMoe(p);
        AddIgnored(absl::StrCat(p, ".self_attn.rotary_emb.inv_freq"), DType::kFloat32, {d / 2},
                   /*optional=*/true);
        continue;
      }
      const std::string mlp = absl::StrCat(p, ".mlp.");
      int layer = AddLinear(absl::StrCat(mlp, "gate_up_proj"), 2 * i_r, h, false);
      AddTarget(absl::StrCat(mlp, "gate_proj.weight"), dt, {c.intermediate_size, h}, layer, 0,
                Rows(rank_ * i_r, i_r, h, 0));
      AddTarget(absl::StrCat(mlp, "up_proj.weight"), dt, {c.intermediate_size, h}, layer, 0,
                Rows(rank_ * i_r, i_r, h, i_r));
      layer = AddLinear(absl::StrCat(mlp, "down_proj"), h, i_r, false);
      AddTarget(absl::StrCat(mlp, "down_proj.weight"), dt, {h, c.intermediate_size}, layer, 0,
                Cols(h, rank_ * i_r, i_r));

      // Precomputed RoPE frequencies some older checkpoints carry.
      AddIgnored(absl::StrCat(p, ".self_attn.rotary_emb.inv_freq"), DType::kFloat32, {d / 2},
                 /*optional=*/true);
    }

    AddNorm("model.norm", h);
    if (c.tie_word_embeddings) {
      // vLLM shares embed_tokens' storage; a pushed lm_head is dropped.
      AddIgnored("lm_head.weight", dt, {c.vocab_size, h}, /*optional=*/true);
    } else {
      AddEmbedding("lm_head", "lm_head.weight");
    }

    ModelLayout& l = *layout_;
    for (size_t i = 0; i < l.layers_.size(); ++i) {
      LayerSpec& layer = l.layers_[i];
      l.layer_index_[layer.name] = static_cast<int>(i);
      layer.first_kernel = static_cast<int>(l.num_kernels_);
      l.num_kernels_ += static_cast<int64_t>(layer.kernels.size());
      for (const KernelSpec& k : layer.kernels) l.kernel_bytes_ += k.nbytes();
      if (layer.kind != LayerKind::kAttention && layer.kind != LayerKind::kExperts) {
        absl::StatusOr<std::vector<KernelPlan>> plan = PlanKernels(layer);
        if (!plan.ok()) return plan.status();
        layer.plan = *std::move(plan);
      }
    }
    for (CheckpointTensor& t : ignored_) l.checkpoint_.push_back(std::move(t));
    l.checkpoint_index_.reserve(l.checkpoint_.size());
    for (size_t i = 0; i < l.checkpoint_.size(); ++i) {
      l.checkpoint_index_[l.checkpoint_[i].name] = static_cast<int>(i);
    }
    return std::shared_ptr<const ModelLayout>(layout_);
  }

 private:
  // Which param (and, for a quantized weight, which scale kernel) each kernel
  // is made from. INTERNAL if the layer's kernels and params disagree: a
  // layout that cannot be processed is refused before anything is served.
  static absl::StatusOr<std::vector<KernelPlan>> PlanKernels(const LayerSpec& spec) {
    std::vector<KernelPlan> plan(spec.kernels.size());
    for (size_t k = 0; k < spec.kernels.size(); ++k) {
      const KernelSpec& kernel = spec.kernels[k];
      if (kernel.suffix == "weight_scale" || kernel.suffix == "weight_scale_inv") continue;
      plan[k].param = spec.ParamIndex(kernel.suffix);
      if (plan[k].param < 0) {
        return absl::InternalError(absl::StrCat("layer \"", spec.name, "\": kernel \"",
                                                kernel.suffix, "\" has no source param"));
      }
      const ParamSpec& param = spec.params[plan[k].param];
      if (spec.quantized && kernel.suffix == "weight") {
        plan[k].scale = spec.KernelIndex("weight_scale");
        if (plan[k].scale < 0) plan[k].scale = spec.KernelIndex("weight_scale_inv");
        if (plan[k].scale < 0 || param.shape.size() != 2) {
          return absl::InternalError(
              absl::StrCat("layer \"", spec.name, "\": quantized weight without scale"));
        }
      } else if (param.nbytes() != kernel.nbytes()) {
        return absl::InternalError(absl::StrCat("layer \"", spec.name, "\": param \"", param.suffix,
                                                "\" and its kernel differ in size"));
      }
    }
    return plan;
  }

  int AddLayer(std::string name, LayerKind kind, bool quantized) {
    LayerSpec layer;
    layer.name = std::move(name);
    layer.kind = kind;
    layer.quantized = quantized;
    layout_->layers_.push_back(std::move(layer));
    return static_cast<int>(layout_->layers_.size()) - 1;
  }

  int AddParam(int layer, std::string suffix, DType dtype, std::vector<int64_t> shape,
               int64_t loaded_numel, bool optional = false) {
    LayerSpec& l = layout_->layers_[layer];
    ParamSpec p;
    p.suffix = std::move(suffix);
    p.dtype = dtype;
    p.shape = std::move(shape);
    p.loaded_numel = loaded_numel;
    p.optional = optional;
    l.params.push_back(std::move(p));
    // Attention scales are optional extras: a layer with none still counts
    // as complete, so they never arm the layer.
    if (l.kind != LayerKind::kAttention) l.expected_numel += loaded_numel;
    return static_cast<int>(l.params.size()) - 1;
  }

  void AddKernel(int layer, std::string suffix, DType dtype, std::vector<int64_t> shape) {
    LayerSpec& l = layout_->layers_[layer];
    KernelSpec k;
    k.name = absl::StrCat(l.name, ".", suffix);
    k.suffix = std::move(suffix);
    k.dtype = dtype;
    k.shape = std::move(shape);
    l.kernels.push_back(std::move(k));
  }

  void AddTarget(std::string name, DType dtype, std::vector<int64_t> shape, int layer, int param,
                 SliceSpec slice, bool optional = false) {
    CheckpointTensor t;
    t.name = std::move(name);
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.use = CheckpointTensor::Use::kTarget;
    t.layer = layer;
    t.param = param;
    t.slice = slice;
    t.optional = optional;
    layout_->checkpoint_.push_back(std::move(t));
  }

  void AddIgnored(std::string name, DType dtype, std::vector<int64_t> shape, bool optional) {
    CheckpointTensor t;
    t.name = std::move(name);
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.use = CheckpointTensor::Use::kIgnored;
    t.optional = optional;
    ignored_.push_back(std::move(t));
  }

  // A linear layer's params ([n, k] weight, [n] bias) and its kernels.
  int AddLinear(std::string name, int64_t n, int64_t k, bool bias) {
    const QuantScheme quant = layout_->quant_;
    const bool quantized = quant != QuantScheme::kNone;
    const int layer = AddLayer(std::move(name), LayerKind::kLinear, quantized);
    AddParam(layer, "weight", c_.dtype, {n, k}, n * k);
    if (bias) AddParam(layer, "bias", c_.dtype, {n}, n);
    switch (quant) {
      case QuantScheme::kNone:
        AddKernel(layer, "weight", c_.dtype, {n, k});
        break;
      case QuantScheme::kPerTensor:
        AddKernel(layer, "weight", DType::kFloat8E4M3, {n, k});
        AddKernel(layer, "weight_scale", DType::kFloat32, {1});
        break;
      case QuantScheme::kPerChannel:
        AddKernel(layer, "weight", DType::kFloat8E4M3, {n, k});
        AddKernel(layer, "weight_scale", DType::kFloat32, {n, 1});
        break;
      case QuantScheme::kBlock128:
        AddKernel(layer, "weight", DType::kFloat8E4M3, {n, k});
        AddKernel(layer, "weight_scale_inv", DType::kFloat32,
                  {CeilDiv(n, kQuantBlock), CeilDiv(k, kQuantBlock)});
        break;
    }
    if (bias) AddKernel(layer, "bias", c_.dtype, {n});
    return layer;
  }

  // Scales one FP8-quantized [rows, cols] matrix has under the scheme.
  int64_t NumScales(int64_t rows, int64_t cols) const {
    switch (layout_->quant_) {
      case QuantScheme::kNone:
        return 0;
      case QuantScheme::kPerTensor:
        return 1;
      case QuantScheme::kPerChannel:
        return rows;
      case QuantScheme::kBlock128:
        return CeilDiv(rows, kQuantBlock) * CeilDiv(cols, kQuantBlock);
    }
    return 0;
  }

  // A sparse decoder layer's MLP: the router, replicated in the checkpoint
  // dtype, and the experts as vLLM's FusedMoE holds them on this rank:
  // w13_weight [E_l, 2 I_r, H] (gate rows, then up rows, per expert) and
  // w2_weight [E_l, H, I_r], with their per-expert scales.
  void AddMoe(const std::string& p) {
    const ModelConfig& c = c_;
    const DType dt = c.dtype;
    const bool mixtral = c.arch == Architecture::kMixtral;
    const std::string mlp = absl::StrCat(p, mixtral ? ".block_sparse_moe." : ".mlp.");
    const int64_t h = c.hidden_size;
    const int64_t e = c.num_experts;
    const int router = AddLayer(absl::StrCat(mlp, "gate"), LayerKind::kRouter, false);
    AddParam(router, "weight", dt, {e, h}, e * h);
    AddKernel(router, "weight", dt, {e, h});
    AddTarget(absl::StrCat(mlp, "gate.weight"), dt, {e, h}, router, 0, Rows(0, e, h));

    const int64_t full_i = c.moe_intermediate_size;
    const int64_t moe_tp = ep_ > 1 ? 1 : tp_;
    const int64_t moe_rank = ep_ > 1 ? 0 : rank_;
    const int64_t i_r = full_i / moe_tp;
    const int64_t e_l = e / ep_;
    const int64_t e0 = ep_rank_ * e_l;
    const QuantScheme quant = layout_->quant_;
    const bool quantized = quant != QuantScheme::kNone;
    const int layer = AddLayer(absl::StrCat(mlp, "experts"), LayerKind::kExperts, quantized);
    AddParam(layer, "w13_weight", dt, {e_l * 2 * i_r, h}, e_l * 2 * i_r * h);
    AddParam(layer, "w2_weight", dt, {e_l * h, i_r}, e_l * h * i_r);
    const DType kdt = quantized ? DType::kFloat8E4M3 : dt;
    AddKernel(layer, "w13_weight", kdt, {e_l, 2 * i_r, h});
    AddKernel(layer, "w2_weight", kdt, {e_l, h, i_r});
    const char* scale_suffix =
        quant == QuantScheme::kBlock128 ? "_weight_scale_inv" : "_weight_scale";
    switch (quant) {
      case QuantScheme::kNone:
        break;
      case QuantScheme::kPerTensor:
        AddKernel(layer, absl::StrCat("w13", scale_suffix), DType::kFloat32, {e_l});
        AddKernel(layer, absl::StrCat("w2", scale_suffix), DType::kFloat32, {e_l});
        break;
      case QuantScheme::kPerChannel:
        AddKernel(layer, absl::StrCat("w13", scale_suffix), DType::kFloat32, {e_l, 2 * i_r, 1});
        AddKernel(layer, absl::StrCat("w2", scale_suffix), DType::kFloat32, {e_l, h, 1});
        break;
      case QuantScheme::kBlock128:
        AddKernel(layer, absl::StrCat("w13", scale_suffix), DType::kFloat32,
                  {e_l, CeilDiv(2 * i_r, kQuantBlock), CeilDiv(h, kQuantBlock)});
        AddKernel(layer, absl::StrCat("w2", scale_suffix), DType::kFloat32,
                  {e_l, CeilDiv(h, kQuantBlock), CeilDiv(i_r, kQuantBlock)});
        break;
    }
    LayerSpec& spec = layout_->layers_[layer];
    spec.plan.assign(spec.kernels.size(), KernelPlan{});
    spec.plan[0] = {0, quantized ? 2 : -1};
    spec.plan[1] = {1, quantized ? 3 : -1};
    const int64_t kelem = static_cast<int64_t>(DTypeSize(kdt));
    for (int64_t j = 0; j < e_l; ++j) {
      const int64_t global = e0 + j;
      for (int w = 0; w < 2; ++w) {
        LayerPart part;
        part.name = absl::StrCat(mlp, "experts.", global, w == 0 ? ".w13" : ".w2");
        part.expert = global;
        part.param = w;
        part.rows = w == 0 ? 2 * i_r : h;
        part.cols = w == 0 ? h : i_r;
        part.row0 = j * part.rows;
        part.kernel = w;
        part.scale = quantized ? 2 + w : -1;
        part.kernel_bytes = part.numel() * kelem;
        part.kernel_offset = j * part.kernel_bytes;
        part.scale_bytes = NumScales(part.rows, part.cols) * static_cast<int64_t>(sizeof(float));
        part.scale_offset = j * part.scale_bytes;
        spec.parts.push_back(std::move(part));
      }
    }
    const char* names[3] = {"gate_proj", "up_proj", "down_proj"};
    if (mixtral) {
      names[0] = "w1";
      names[1] = "w3";
      names[2] = "w2";
    }
    for (int64_t g = 0; g < e; ++g) {
      const std::string ex = absl::StrCat(mlp, "experts.", g, ".");
      const bool local = g >= e0 && g < e0 + e_l;
      const int64_t j = g - e0;
      // Other ranks' experts are accepted and have nothing on this rank.
      SliceSpec none = Rows(0, 0, h);
      SliceSpec gate = local ? Rows(moe_rank * i_r, i_r, h, j * 2 * i_r) : none;
      SliceSpec up = local ? Rows(moe_rank * i_r, i_r, h, j * 2 * i_r + i_r) : none;
      SliceSpec down = Cols(h, moe_rank * i_r, i_r);
      down.dst_row = j * h;
      if (!local) down = Rows(0, 0, full_i);
      const int p13 = local ? static_cast<int>(2 * j) : -1;
      const int p2 = local ? static_cast<int>(2 * j + 1) : -1;
      AddTarget(absl::StrCat(ex, names[0], ".weight"), dt, {full_i, h}, layer, 0, gate);
      layout_->checkpoint_.back().part = p13;
      AddTarget(absl::StrCat(ex, names[1], ".weight"), dt, {full_i, h}, layer, 0, up);
      layout_->checkpoint_.back().part = p13;
      AddTarget(absl::StrCat(ex, names[2], ".weight"), dt, {h, full_i}, layer, 1, down);
      layout_->checkpoint_.back().part = p2;
    }
  }

  void AddNorm(std::string name, int64_t size) {
    const int layer = AddLayer(name, LayerKind::kNorm, false);
    AddParam(layer, "weight", c_.dtype, {size}, size);
    AddKernel(layer, "weight", c_.dtype, {size});
    AddTarget(absl::StrCat(name, ".weight"), c_.dtype, {size}, layer, 0, Rows(0, size, 1));
  }

  // Vocab-parallel rows: rank r owns padded rows [r * v_r, (r + 1) * v_r),
  // of which those below vocab_size come from the checkpoint.
  void AddEmbedding(std::string name, std::string checkpoint_name) {
    const int64_t v = c_.vocab_size;
    const int64_t h = c_.hidden_size;
    const int64_t v_r = RoundUp(v, kVocabPadMultiple) / tp_;
    const int64_t begin = std::min(rank_ * v_r, v);
    const int64_t end = std::min((rank_ + 1) * v_r, v);
    const int layer = AddLayer(std::move(name), LayerKind::kEmbedding, false);
    AddParam(layer, "weight", c_.dtype, {v_r, h}, (end - begin) * h);
    AddKernel(layer, "weight", c_.dtype, {v_r, h});
    AddTarget(std::move(checkpoint_name), c_.dtype, {v, h}, layer, 0, Rows(begin, end - begin, h));
  }

  void AddAttention(std::string name, const std::string& attn_prefix) {
    const int layer = AddLayer(std::move(name), LayerKind::kAttention, false);
    struct Scale {
      const char* param;
      const char* checkpoint_suffix;
      bool kernel;
    };
    // kv_scale is the legacy single scale for both k and v; it has no
    // kernel of its own.
    const Scale scales[] = {{"k_scale", "k_proj.output_scale", true},
                            {"v_scale", "v_proj.output_scale", true},
                            {"q_scale", "q_proj.output_scale", true},
                            {"kv_scale", "kv_scale", false}};
    for (const Scale& s : scales) {
      const int param = AddParam(layer, s.param, DType::kFloat32, {}, 1, /*optional=*/true);
      AddTarget(absl::StrCat(attn_prefix, s.checkpoint_suffix), DType::kFloat32, {}, layer, param,
                Rows(0, 1, 1), /*optional=*/true);
    }
    for (const Scale& s : scales) {
      if (s.kernel) AddKernel(layer, s.param, DType::kFloat32, {});
    }
  }

  std::shared_ptr<ModelLayout> layout_;
  const ModelConfig& c_;
  const int64_t rank_;
  const int64_t tp_;
  const int64_t ep_rank_;
  const int64_t ep_;
  std::vector<CheckpointTensor> ignored_;
};

absl::StatusOr<std::shared_ptr<const ModelLayout>> ModelLayout::Build(const ModelConfig& config,
                                                                      ParallelConfig parallel,
                                                                      QuantScheme quant) {
  LayoutBuilder builder(config, parallel, quant);
  if (absl::Status s = builder.Validate(); !s.ok()) return s;
  return builder.Build();
}

NameMapper::NameMapper(std::shared_ptr<const ModelLayout> layout) : layout_(std::move(layout)) {}

absl::StatusOr<const CheckpointTensor*> NameMapper::Lookup(absl::string_view name) const {
  absl::StatusOr<int> index = LookupIndex(name);
  if (!index.ok()) return index.status();
  return &layout_->checkpoint_tensors()[*index];
}

absl::StatusOr<int> NameMapper::LookupIndex(absl::string_view name) const {
  return layout_->FindCheckpointTensor(name);
}

int LayerSpec::ParamIndex(absl::string_view suffix) const {
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].suffix == suffix) return static_cast<int>(i);
  }
  return -1;
}

int LayerSpec::KernelIndex(absl::string_view suffix) const {
  for (size_t i = 0; i < kernels.size(); ++i) {
    if (kernels[i].suffix == suffix) return static_cast<int>(i);
  }
  return -1;
}

absl::StatusOr<int> ModelLayout::FindCheckpointTensor(absl::string_view name) const {
  auto it = checkpoint_index_.find(name);
  if (it != checkpoint_index_.end()) return it->second;

  const ModelConfig& c = config_;
  std::string hint;
  absl::string_view rest = name;
  int64_t layer_index = -1;
  if (absl::ConsumePrefix(&rest, "model.layers.")) {
    const size_t dot = rest.find('.');
    if (dot != absl::string_view::npos && absl::SimpleAtoi(rest.substr(0, dot), &layer_index)) {
      rest = rest.substr(dot + 1);
    } else {
      layer_index = -1;
    }
  }
  if (layer_index >= c.num_layers) {
    hint = absl::StrCat(" (layer index ", layer_index, " out of range: model has ", c.num_layers,
                        " layers)");
  } else if (!c.is_moe() &&
             (absl::StrContains(name, ".experts.") || absl::StrContains(name, ".mlp.gate."))) {
    hint = " (mixture-of-experts tensors: this model is dense)";
  } else if (c.is_moe() && absl::StrContains(name, ".experts.")) {
    hint = absl::StrCat(" (the model has ", c.num_experts, " experts, ids 0..", c.num_experts - 1,
                        "; Qwen3-MoE names them mlp.experts.E.{gate,up,down}_proj, Mixtral "
                        "block_sparse_moe.experts.E.{w1,w3,w2})");
  } else if (rest == "self_attn.q_norm.weight" || rest == "self_attn.k_norm.weight") {
    hint = " (q_norm/k_norm exist only in Qwen3 models)";
  } else if (absl::EndsWith(rest, "_proj.bias")) {
    hint = " (this model has no bias on that projection; see attention_bias in config.json)";
  }
  return absl::NotFoundError(absl::StrCat("unknown tensor ", QuoteText(name), " for ",
                                          c.arch_name.empty() ? "this model" : c.arch_name, " (",
                                          c.num_layers, " layers)", hint));
}

float AttentionScales::ForKernel(absl::string_view suffix) const {
  return suffix == "k_scale" ? k : suffix == "v_scale" ? v : q;
}

AttentionScales ResolveAttentionScales(float k, float v, float q, float kv) {
  auto present = [](float x) { return x > 0.0f && x < std::numeric_limits<float>::infinity(); };
  if (!present(k)) k = present(kv) ? kv : 0.0f;
  if (!present(v)) v = present(kv) ? kv : 0.0f;
  AttentionScales scales;
  if (k == 0.0f && v == 0.0f) {
    scales.k = scales.v = 1.0f;
  } else if (k == 0.0f || v == 0.0f) {
    scales.k = scales.v = std::max(k, v);
  } else {
    scales.k = k;
    scales.v = v;
  }
  scales.q = present(q) ? q : scales.k;
  return scales;
}

std::string KernelFingerprint(const std::vector<const KernelSpec*>& specs,
                              const std::vector<uint64_t>& hashes) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  for (size_t i = 0; i < specs.size(); ++i) {
    const KernelSpec& spec = *specs[i];
    XXH3_64bits_update(state, spec.name.data(), spec.name.size() + 1);
    absl::string_view dtype = DTypeName(spec.dtype);
    XXH3_64bits_update(state, dtype.data(), dtype.size());
    for (int64_t dim : spec.shape) XXH3_64bits_update(state, &dim, sizeof(dim));
    XXH3_64bits_update(state, &hashes[i], sizeof(uint64_t));
  }
  uint64_t digest = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return absl::StrFormat("%016x", digest);
}

}  // namespace refit::core
