// The part of a Hugging Face config.json that decides refitd's layout.
//
// Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
// Qwen3ForCausalLM (dense decoders) and the mixture-of-experts decoders
// Qwen3MoeForCausalLM and MixtralForCausalLM. A dense class whose config
// names experts is refused as UNIMPLEMENTED. Plain value, thread-compatible.
#ifndef REFIT_CORE_MODEL_CONFIG_H_
#define REFIT_CORE_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"

namespace refit::core {

enum class Architecture { kLlama, kMistral, kQwen2, kQwen3, kQwen3Moe, kMixtral };

struct ModelConfig {
  Architecture arch = Architecture::kLlama;
  std::string arch_name;  // as in "architectures"[0]
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;  // defaults to num_heads
  int64_t head_dim = 0;      // defaults to hidden_size / num_heads
  int64_t vocab_size = 0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;     // q/k/v bias (always on for Qwen2); Llama also has o_proj bias
  DType dtype = DType::kBFloat16;  // "torch_dtype"/"dtype": the checkpoint format
  // Mixture of experts (Qwen3-MoE, Mixtral); num_experts 0 for dense models.
  int64_t num_experts = 0;               // "num_experts" / "num_local_experts"
  int64_t num_experts_per_tok = 0;       // top-k, metadata for engines
  int64_t moe_intermediate_size = 0;     // per expert; Mixtral: "intermediate_size"
  int64_t decoder_sparse_step = 1;       // Qwen3-MoE: every step-th layer is sparse
  std::vector<int64_t> mlp_only_layers;  // Qwen3-MoE: dense layers among sparse ones
  bool norm_topk_prob = false;           // metadata: router renormalizes its top-k

  bool is_moe() const { return arch == Architecture::kQwen3Moe || arch == Architecture::kMixtral; }
  // Whether decoder layer `layer` has experts (vLLM's Qwen3MoeDecoderLayer
  // rule: not in mlp_only_layers, and (layer + 1) % decoder_sparse_step == 0).
  bool IsSparseLayer(int64_t layer) const;

  // Parses config.json text. Every message starts with `source`; those about
  // a field name it ("field 'num_key_value_heads' ...").
  // Errors:
  //   INVALID_ARGUMENT  not valid JSON or not an object; "architectures"
  //                     missing or not a list of names; a required size
  //                     missing or not a positive integer; a mistyped optional
  //                     field (head_dim, num_key_value_heads, booleans, a
  //                     negative expert count); a dtype other than bfloat16,
  //                     float16, float32; num_key_value_heads not dividing
  //                     num_attention_heads; no head_dim and hidden_size not a
  //                     multiple of num_attention_heads; for MoE classes a
  //                     missing expert count / size / top-k, top-k above the
  //                     expert count, a mlp_only_layers entry out of range
  //   UNIMPLEMENTED     an architecture other than the six supported, or a
  //                     dense class whose config names experts
  static absl::StatusOr<ModelConfig> FromJson(absl::string_view text, absl::string_view source);
  // Reads and parses a file; the path is the `source` of FromJson's errors.
  // Errors: FromJson's, and
  //   NOT_FOUND          no such file (or a path component is not a directory)
  //   PERMISSION_DENIED  the file cannot be read
  //   INVALID_ARGUMENT   it cannot be opened for another reason
  //   INTERNAL           reading failed after opening
  static absl::StatusOr<ModelConfig> FromFile(const std::string& path);
  // A config.json that FromJson reads back to an equal config.
  std::string ToJson() const;
};

}  // namespace refit::core

#endif  // REFIT_CORE_MODEL_CONFIG_H_
