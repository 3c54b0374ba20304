#include "core/model_config.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace refit::core {
namespace {

using Json = nlohmann::json;

struct ArchInfo {
  Architecture arch;
  const char* class_name;
  const char* model_type;
};

constexpr ArchInfo kArchs[] = {
    {Architecture::kLlama, "LlamaForCausalLM", "llama"},
    {Architecture::kMistral, "MistralForCausalLM", "mistral"},
    {Architecture::kQwen2, "Qwen2ForCausalLM", "qwen2"},
    {Architecture::kQwen3, "Qwen3ForCausalLM", "qwen3"},
    {Architecture::kQwen3Moe, "Qwen3MoeForCausalLM", "qwen3_moe"},
    {Architecture::kMixtral, "MixtralForCausalLM", "mixtral"},
};

const ArchInfo& InfoOf(Architecture arch) {
  for (const ArchInfo& info : kArchs) {
    if (info.arch == arch) return info;
  }
  return kArchs[0];
}

// Reads the fields of one config.json, naming the file and field in errors.
class FieldReader {
 public:
  FieldReader(const Json& root, absl::string_view source) : root_(root), source_(source) {}

  absl::Status Error(absl::string_view field, absl::string_view problem) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": field '", field, "' ", problem));
  }

  // A required positive integer.
  absl::Status PositiveInt(const char* field, int64_t* out) const {
    auto it = root_.find(field);
    if (it == root_.end() || it->is_null()) return Error(field, "is missing");
    return ParsePositive(field, *it, out);
  }

  // An optional positive integer; absent or null leaves *out unchanged.
  absl::Status OptionalPositiveInt(const char* field, int64_t* out) const {
    auto it = root_.find(field);
    if (it == root_.end() || it->is_null()) return absl::OkStatus();
    return ParsePositive(field, *it, out);
  }

  // An optional non-negative integer (MoE expert counts may be 0).
  absl::Status OptionalCount(const char* field, int64_t* out) const {
    auto it = root_.find(field);
    if (it == root_.end() || it->is_null()) return absl::OkStatus();
    if (!it->is_number_integer() || it->get<int64_t>() < 0) {
      return Error(field, absl::StrCat("must be a non-negative integer, got ", it->dump()));
    }
    *out = it->get<int64_t>();
    return absl::OkStatus();
  }

  absl::Status OptionalBool(const char* field, bool* out) const {
    auto it = root_.find(field);
    if (it == root_.end() || it->is_null()) return absl::OkStatus();
    if (!it->is_boolean())
      return Error(field, absl::StrCat("must be true or false, got ", it->dump()));
    *out = it->get<bool>();
    return absl::OkStatus();
  }

 private:
  absl::Status ParsePositive(const char* field, const Json& value, int64_t* out) const {
    if (!value.is_number_integer() || value.get<int64_t>() <= 0) {
      return Error(field, absl::StrCat("must be a positive integer, got ", value.dump()));
    }
    *out = value.get<int64_t>();
    return absl::OkStatus();
  }

  const Json& root_;
  absl::string_view source_;
};

absl::Status ParseDtypeField(const Json& root, const FieldReader& reader, DType* out) {
  // Newer transformers write "dtype"; older ones "torch_dtype".
  for (const char* field : {"dtype", "torch_dtype"}) {
    auto it = root.find(field);
    if (it == root.end() || it->is_null()) continue;
    if (!it->is_string())
      return reader.Error(field, absl::StrCat("must be a string, got ", it->dump()));
    const std::string name = it->get<std::string>();
    if (name == "bfloat16") {
      *out = DType::kBFloat16;
    } else if (name == "float16") {
      *out = DType::kFloat16;
    } else if (name == "float32") {
      *out = DType::kFloat32;
    } else {
      return reader.Error(field,
                          absl::StrCat("must be bfloat16, float16 or float32, got \"", name, "\""));
    }
    return absl::OkStatus();
  }
  return absl::OkStatus();
}

const char* DtypeJsonName(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return "float16";
    case DType::kFloat32:
      return "float32";
    default:
      return "bfloat16";
  }
}

// The expert fields of a Qwen3-MoE or Mixtral config.
absl::Status ParseExperts(const Json& root, const FieldReader& reader, ModelConfig* config) {
  const bool mixtral = config->arch == Architecture::kMixtral;
  const char* count_field = mixtral ? "num_local_experts" : "num_experts";
  if (config->num_experts == 0) return reader.Error(count_field, "is missing or 0");
  if (absl::Status s = reader.PositiveInt("num_experts_per_tok", &config->num_experts_per_tok);
      !s.ok()) {
    return s;
  }
  if (config->num_experts_per_tok > config->num_experts) {
    return reader.Error("num_experts_per_tok",
                        absl::StrCat(config->num_experts_per_tok, " exceeds ", count_field, " ",
                                     config->num_experts));
  }
  if (mixtral) {
    // Mixtral's experts are its MLPs: intermediate_size is the expert size.
    config->moe_intermediate_size = config->intermediate_size;
  } else {
    if (absl::Status s =
            reader.PositiveInt("moe_intermediate_size", &config->moe_intermediate_size);
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            reader.OptionalPositiveInt("decoder_sparse_step", &config->decoder_sparse_step);
        !s.ok()) {
      return s;
    }
    auto it = root.find("mlp_only_layers");
    if (it != root.end() && !it->is_null()) {
      if (!it->is_array()) {
        return reader.Error("mlp_only_layers",
                            absl::StrCat("must be a list of layer indices, got ", it->dump()));
      }
      for (const Json& v : *it) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 ||
            v.get<int64_t>() >= config->num_layers) {
          return reader.Error("mlp_only_layers",
                              absl::StrCat("entry ", v.dump(), " is not a layer index below ",
                                           "num_hidden_layers ", config->num_layers));
        }
        config->mlp_only_layers.push_back(v.get<int64_t>());
      }
    }
  }
  return reader.OptionalBool("norm_topk_prob", &config->norm_topk_prob);
}

}  // namespace

absl::StatusOr<ModelConfig> ModelConfig::FromJson(absl::string_view text,
                                                  absl::string_view source) {
  Json root = Json::parse(text.begin(), text.end(), /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid JSON"));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": expected a JSON object"));
  }
  FieldReader reader(root, source);
  ModelConfig config;

  auto archs = root.find("architectures");
  if (archs == root.end() || !archs->is_array() || archs->empty() || !(*archs)[0].is_string()) {
    return reader.Error("architectures", "must be a non-empty list of class names");
  }
  config.arch_name = (*archs)[0].get<std::string>();

  int64_t experts = 0;
  for (const char* field : {"num_experts", "num_local_experts"}) {
    int64_t n = 0;
    if (absl::Status s = reader.OptionalCount(field, &n); !s.ok()) return s;
    if (n > 0 && experts == 0) experts = n;
  }
  config.num_experts = experts;
  bool known = false;
  for (const ArchInfo& info : kArchs) {
    if (config.arch_name == info.class_name) {
      config.arch = info.arch;
      known = true;
    }
  }
  // A dense class with experts would be served without them: refuse it.
  if (experts > 0 && !(known && config.is_moe())) {
    return absl::UnimplementedError(
        absl::StrCat(source, ": ", config.arch_name, " is a mixture-of-experts model (", experts,
                     " experts); supported mixture-of-experts classes: Qwen3MoeForCausalLM, "
                     "MixtralForCausalLM"));
  }
  if (!known) {
    return absl::UnimplementedError(absl::StrCat(
        source, ": field 'architectures': unsupported architecture \"", config.arch_name,
        "\" (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM)"));
  }

  const std::pair<const char*, int64_t*> required[] = {
      {"hidden_size", &config.hidden_size},      {"intermediate_size", &config.intermediate_size},
      {"num_hidden_layers", &config.num_layers}, {"num_attention_heads", &config.num_heads},
      {"vocab_size", &config.vocab_size},
  };
  for (const auto& [field, out] : required) {
    if (absl::Status s = reader.PositiveInt(field, out); !s.ok()) return s;
  }
  config.num_kv_heads = config.num_heads;
  if (absl::Status s = reader.OptionalPositiveInt("num_key_value_heads", &config.num_kv_heads);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = reader.OptionalPositiveInt("head_dim", &config.head_dim); !s.ok()) {
    return s;
  }
  if (config.head_dim == 0) {
    if (config.hidden_size % config.num_heads != 0) {
      return reader.Error(
          "head_dim", absl::StrCat("is missing and hidden_size ", config.hidden_size,
                                   " is not a multiple of num_attention_heads ", config.num_heads));
    }
    config.head_dim = config.hidden_size / config.num_heads;
  }
  if (config.num_heads % config.num_kv_heads != 0) {
    return reader.Error("num_key_value_heads",
                        absl::StrCat(config.num_kv_heads, " does not divide num_attention_heads ",
                                     config.num_heads));
  }
  if (absl::Status s = reader.OptionalBool("tie_word_embeddings", &config.tie_word_embeddings);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = reader.OptionalBool("attention_bias", &config.attention_bias); !s.ok()) {
    return s;
  }
  // Qwen2's q/k/v projections always carry a bias; its config has no field.
  if (config.arch == Architecture::kQwen2) config.attention_bias = true;
  if (absl::Status s = ParseDtypeField(root, reader, &config.dtype); !s.ok()) return s;
  if (config.is_moe()) {
    if (absl::Status s = ParseExperts(root, reader, &config); !s.ok()) return s;
  }
  return config;
}

bool ModelConfig::IsSparseLayer(int64_t layer) const {
  if (!is_moe() || num_experts == 0) return false;
  for (int64_t dense : mlp_only_layers) {
    if (dense == layer) return false;
  }
  return (layer + 1) % decoder_sparse_step == 0;
}

absl::StatusOr<ModelConfig> ModelConfig::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    const std::string why = std::strerror(err);
    if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError(absl::StrCat(path, ": ", why));
    if (err == EACCES || err == EPERM) {
      return absl::PermissionDeniedError(absl::StrCat(path, ": ", why));
    }
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot open: ", why));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::InternalError(absl::StrCat(path, ": read failed"));
  return FromJson(text.str(), path);
}

std::string ModelConfig::ToJson() const {
  const ArchInfo& info = InfoOf(arch);
  Json j;
  j["architectures"] = Json::array({arch_name.empty() ? info.class_name : arch_name});
  j["model_type"] = info.model_type;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_layers;
  j["num_attention_heads"] = num_heads;
  j["num_key_value_heads"] = num_kv_heads;
  j["head_dim"] = head_dim;
  j["vocab_size"] = vocab_size;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["attention_bias"] = attention_bias;
  j["torch_dtype"] = DtypeJsonName(dtype);
  if (is_moe()) {
    j[arch == Architecture::kMixtral ? "num_local_experts" : "num_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["norm_topk_prob"] = norm_topk_prob;
    if (arch == Architecture::kQwen3Moe) {
      j["moe_intermediate_size"] = moe_intermediate_size;
      j["decoder_sparse_step"] = decoder_sparse_step;
      j["mlp_only_layers"] = mlp_only_layers;
    }
  } else if (num_experts > 0) {
    j["num_experts"] = num_experts;
  }
  // Not part of refitd's layout, but transformers needs them to load the
  // model (test oracles do); the values are the Llama defaults.
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = 1e-5;
  j["max_position_embeddings"] = 4096;
  j["rope_theta"] = 10000.0;
  return j.dump(2) + "\n";
}

}  // namespace refit::core
