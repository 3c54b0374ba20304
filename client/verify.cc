#include "client/verify.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/dtype.h"
#include "core/fp8_quantizer.h"
#include "core/model_config.h"
#include "core/model_layout.h"
#include "core/safetensors.h"
#include "core/xxh3.h"
#include "nlohmann/json.hpp"

namespace refit::client {
namespace {

using core::CheckpointTensor;
using core::KernelSpec;
using core::LayerKind;
using core::LayerSpec;
using core::ModelLayout;
using core::ParamSpec;

int64_t ViewCols(const std::vector<int64_t>& shape) {
  int64_t cols = 1;
  for (size_t i = 1; i < shape.size(); ++i) cols *= shape[i];
  return cols;
}

// Checkpoint-format buffers of one layer while the files are read.
struct LayerBuffers {
  std::vector<std::vector<uint8_t>> params;
  std::vector<bool> param_seen;
  int64_t loaded = 0;
};

// Copies the part of `src` (a full checkpoint tensor) that belongs to this
// rank into its param buffer, converting to the param's dtype.
absl::Status Scatter(const CheckpointTensor& ct, const core::TensorEntry& src,
                     const uint8_t* src_data, const ParamSpec& param, std::vector<uint8_t>& dst,
                     int64_t* loaded) {
  const core::SliceSpec& s = ct.slice;
  const int64_t cols = ViewCols(src.shape);
  const size_t in = core::DTypeSize(src.dtype);
  const size_t out = core::DTypeSize(param.dtype);
  for (int64_t r = 0; r < s.num_rows; ++r) {
    const uint8_t* from = src_data + ((s.src_row + r) * cols + s.src_col) * in;
    uint8_t* to = dst.data() + ((s.dst_row + r) * s.num_cols) * out;
    if (src.dtype == param.dtype) {
      std::memcpy(to, from, static_cast<size_t>(s.num_cols) * out);
    } else {
      absl::Status converted =
          core::ConvertFloats(from, src.dtype, to, param.dtype, static_cast<size_t>(s.num_cols));
      if (!converted.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor \"", ct.name, "\": ", converted.message()));
      }
    }
  }
  *loaded += s.numel();
  return absl::OkStatus();
}

int ParamIndex(const LayerSpec& spec, absl::string_view suffix) {
  for (size_t i = 0; i < spec.params.size(); ++i) {
    if (spec.params[i].suffix == suffix) return static_cast<int>(i);
  }
  return -1;
}

int KernelIndex(const LayerSpec& spec, absl::string_view suffix) {
  for (size_t i = 0; i < spec.kernels.size(); ++i) {
    if (spec.kernels[i].suffix == suffix) return static_cast<int>(i);
  }
  return -1;
}

// The attention kernels, by the daemon's own rule (core::ResolveAttentionScales).
void AttentionKernels(const LayerSpec& spec, const LayerBuffers& buffers,
                      std::vector<std::string>& kernels) {
  auto received = [&](absl::string_view suffix) -> float {
    int p = ParamIndex(spec, suffix);
    if (p < 0 || buffers.params.empty() || !buffers.param_seen[p]) return 0.0f;
    return core::LoadAsFloat(buffers.params[p].data(), spec.params[p].dtype, 0);
  };
  const core::AttentionScales scales = core::ResolveAttentionScales(
      received("k_scale"), received("v_scale"), received("q_scale"), received("kv_scale"));
  for (size_t i = 0; i < spec.kernels.size(); ++i) {
    const KernelSpec& kernel = spec.kernels[i];
    const float value = scales.ForKernel(kernel.suffix);
    kernels[i].assign(static_cast<size_t>(kernel.nbytes()), '\0');
    if (kernel.nbytes() == static_cast<int64_t>(sizeof(float))) {
      std::memcpy(kernels[i].data(), &value, sizeof(float));
    }
  }
}

// An experts layer's kernels, as the daemon makes them: every expert's w13
// and w2 (core::LayerPart) quantized on its own into its place.
absl::Status ExpertKernels(const ModelLayout& layout, const LayerSpec& spec,
                           const LayerBuffers& buffers, std::vector<std::string>& kernels) {
  for (size_t k = 0; k < spec.kernels.size(); ++k) {
    kernels[k].assign(static_cast<size_t>(spec.kernels[k].nbytes()), '\0');
  }
  for (const core::LayerPart& part : spec.parts) {
    const ParamSpec& param = spec.params[part.param];
    const int64_t elem = static_cast<int64_t>(core::DTypeSize(param.dtype));
    const uint8_t* src = buffers.params[part.param].data() + part.row0 * part.cols * elem;
    char* dst = kernels[part.kernel].data() + part.kernel_offset;
    if (part.scale < 0) {
      std::memcpy(dst, src, static_cast<size_t>(part.kernel_bytes));
      continue;
    }
    core::Fp8QuantizeOptions options;
    options.scheme = layout.quant();
    absl::Status quantized = core::QuantizeFp8(
        src, param.dtype, part.rows, part.cols, options, reinterpret_cast<uint8_t*>(dst),
        reinterpret_cast<float*>(kernels[part.scale].data() + part.scale_offset), part.name);
    if (!quantized.ok()) return quantized;
  }
  return absl::OkStatus();
}

// The kernels of a complete layer, as the daemon would stage them.
absl::Status LayerKernels(const ModelLayout& layout, const LayerSpec& spec, LayerBuffers& buffers,
                          std::vector<std::string>& kernels) {
  kernels.assign(spec.kernels.size(), std::string());
  if (spec.kind == LayerKind::kAttention) {
    AttentionKernels(spec, buffers, kernels);
    return absl::OkStatus();
  }
  if (spec.kind == LayerKind::kExperts) return ExpertKernels(layout, spec, buffers, kernels);
  for (size_t k = 0; k < spec.kernels.size(); ++k) {
    const KernelSpec& kernel = spec.kernels[k];
    if (kernel.suffix == "weight_scale" || kernel.suffix == "weight_scale_inv") continue;
    int p = ParamIndex(spec, kernel.suffix);
    if (p < 0) {
      return absl::InternalError(
          absl::StrCat("kernel \"", kernel.name, "\" has no checkpoint-format source"));
    }
    const ParamSpec& param = spec.params[p];
    if (spec.quantized && kernel.suffix == "weight") {
      int s = KernelIndex(spec, "weight_scale");
      if (s < 0) s = KernelIndex(spec, "weight_scale_inv");
      if (s < 0 || param.shape.size() != 2) {
        return absl::InternalError(absl::StrCat("layer \"", spec.name, "\": no scale kernel"));
      }
      kernels[k].assign(static_cast<size_t>(kernel.nbytes()), '\0');
      std::vector<float> scales(static_cast<size_t>(spec.kernels[s].nbytes()) / sizeof(float));
      core::Fp8QuantizeOptions options;
      options.scheme = layout.quant();
      absl::Status quantized = core::QuantizeFp8(
          buffers.params[p].data(), param.dtype, param.shape[0], param.shape[1], options,
          reinterpret_cast<uint8_t*>(kernels[k].data()), scales.data(), kernel.name);
      if (!quantized.ok()) return quantized;
      kernels[s].assign(reinterpret_cast<const char*>(scales.data()),
                        scales.size() * sizeof(float));
    } else {
      kernels[k].assign(buffers.params[p].begin(), buffers.params[p].end());
    }
  }
  return absl::OkStatus();
}

std::string FirstDifference(const std::string& expected, const std::string& got) {
  if (expected.size() != got.size()) {
    return absl::StrCat("size differs: expected ", expected.size(), " bytes, daemon has ",
                        got.size());
  }
  size_t first = 0, count = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (expected[i] != got[i]) {
      if (count == 0) first = i;
      ++count;
    }
  }
  return absl::StrFormat("%d of %d bytes differ, first at byte %d (expected 0x%02x, got 0x%02x)",
                         count, expected.size(), first, static_cast<unsigned char>(expected[first]),
                         static_cast<unsigned char>(got[first]));
}

const char* TorchDTypeName(refit::v1::DType dtype) {
  switch (dtype) {
    case refit::v1::DTYPE_F32:
      return "float32";
    case refit::v1::DTYPE_F16:
      return "float16";
    default:
      return "bfloat16";
  }
}

// A config.json equivalent, from the daemon's checkpoint layout (full
// shapes) and model summary. Head counts are not visible in shapes; any
// factorization gives the same layout at tp_size 1 (only the fused row
// counts matter), so the head size is taken from Qwen3's q_norm or as the
// gcd of the q and k rows. With tensor parallelism the factorization decides
// the k/v slices, so --config is required there.
absl::StatusOr<core::ModelConfig> ConfigFromDaemon(RefitClient& client, const std::string& group,
                                                   const refit::v1::GetStatusResponse& status) {
  if (status.model().tp_size() > 1) {
    return absl::FailedPreconditionError(
        "no config.json beside the files and the daemon is tensor-parallel: pass --config");
  }
  absl::StatusOr<refit::v1::ListTensorsResponse> list =
      client.ListTensors(group, refit::v1::ListTensorsRequest::LAYOUT_CHECKPOINT);
  if (!list.ok()) return list.status();
  std::map<std::string, const refit::v1::TensorInfo*> tensors;
  for (const refit::v1::TensorInfo& t : list->tensors()) tensors[t.name()] = &t;
  auto find = [&](const std::string& name, bool loaded_only) -> const refit::v1::TensorInfo* {
    auto it = tensors.find(name);
    if (it == tensors.end()) return nullptr;
    if (loaded_only && it->second->layer().empty()) return nullptr;  // accepted and ignored
    return it->second;
  };
  const refit::v1::TensorInfo* embed = find("model.embed_tokens.weight", true);
  const refit::v1::TensorInfo* q = find("model.layers.0.self_attn.q_proj.weight", true);
  const refit::v1::TensorInfo* k = find("model.layers.0.self_attn.k_proj.weight", true);
  const refit::v1::TensorInfo* gate = find("model.layers.0.mlp.gate_proj.weight", true);
  if (embed == nullptr || q == nullptr || k == nullptr || gate == nullptr ||
      embed->shape_size() != 2 || q->shape_size() != 2 || k->shape_size() != 2 ||
      gate->shape_size() != 2) {
    return absl::FailedPreconditionError(
        "no config.json beside the files, and the daemon's checkpoint layout is not a dense "
        "decoder this tool can read: pass --config");
  }
  const int64_t q_rows = q->shape(0), k_rows = k->shape(0);
  int64_t head_dim = std::gcd(q_rows, k_rows);
  if (const refit::v1::TensorInfo* q_norm = find("model.layers.0.self_attn.q_norm.weight", true);
      q_norm != nullptr && q_norm->shape_size() == 1) {
    head_dim = q_norm->shape(0);
  }
  int64_t num_layers = status.model().num_layers();
  if (num_layers == 0) {
    while (find(absl::StrCat("model.layers.", num_layers, ".self_attn.q_proj.weight"), true)) {
      ++num_layers;
    }
  }
  nlohmann::json config = {
      {"architectures", {status.model().architecture()}},
      {"hidden_size", embed->shape(1)},
      {"intermediate_size", gate->shape(0)},
      {"num_hidden_layers", num_layers},
      {"num_attention_heads", q_rows / head_dim},
      {"num_key_value_heads", k_rows / head_dim},
      {"head_dim", head_dim},
      {"vocab_size", embed->shape(0)},
      {"tie_word_embeddings", find("lm_head.weight", true) == nullptr},
      {"attention_bias", find("model.layers.0.self_attn.q_proj.bias", true) != nullptr},
      {"torch_dtype", TorchDTypeName(embed->dtype())},
  };
  return core::ModelConfig::FromJson(config.dump(), "the daemon's checkpoint layout");
}

}  // namespace

absl::StatusOr<VerifyReport> Verify(RefitClient& client, const VerifyOptions& options) {
  if (options.files.empty()) return absl::InvalidArgumentError("verify: no files");
  absl::StatusOr<refit::v1::GetStatusResponse> status = client.GetStatus(options.model_group);
  if (!status.ok()) return status.status();

  std::string config_path = options.config_path;
  if (config_path.empty()) {
    // Not std::filesystem: see ExpandSafetensorsPaths.
    const std::string& first = options.files.front();
    const size_t slash = first.rfind('/');
    config_path =
        slash == std::string::npos ? "config.json" : first.substr(0, slash + 1) + "config.json";
  }
  absl::StatusOr<core::ModelConfig> config = core::ModelConfig::FromFile(config_path);
  VerifyReport report;
  report.config_source = config_path;
  if (config.status().code() == absl::StatusCode::kNotFound && options.config_path.empty()) {
    config = ConfigFromDaemon(client, options.model_group, *status);
    report.config_source = "the daemon's checkpoint layout";
  }
  if (!config.ok()) return config.status();
  core::ParallelConfig parallel;
  parallel.tp_rank = options.tp_rank >= 0 ? options.tp_rank : status->model().tp_rank();
  parallel.tp_size =
      options.tp_size > 0 ? options.tp_size : std::max<int64_t>(1, status->model().tp_size());
  // Expert parallelism as the daemon serves it.
  parallel.ep_rank = status->model().ep_rank();
  parallel.ep_size = std::max<int64_t>(1, status->model().ep_size());
  std::string quant_name = !options.quant.empty() ? options.quant : status->model().quantization();
  if (quant_name.empty()) quant_name = "per-tensor";
  absl::StatusOr<core::QuantScheme> quant = core::ParseQuantScheme(quant_name);
  if (!quant.ok()) return quant.status();
  absl::StatusOr<std::shared_ptr<const ModelLayout>> built =
      ModelLayout::Build(*config, parallel, *quant);
  if (!built.ok()) return built.status();
  const ModelLayout& layout = **built;
  core::NameMapper mapper(*built);

  report.version = status->version();
  report.daemon_fingerprint = status->fingerprint();

  // Read every file into the layers' checkpoint-format buffers.
  std::vector<LayerBuffers> layers(layout.layers().size());
  std::vector<std::unique_ptr<core::SafetensorsFile>> files;
  for (const std::string& path : options.files) {
    absl::StatusOr<std::unique_ptr<core::SafetensorsFile>> file = core::SafetensorsFile::Open(path);
    if (!file.ok()) return file.status();
    for (const core::TensorEntry& t : (*file)->tensors()) {
      absl::StatusOr<const CheckpointTensor*> ct = mapper.Lookup(t.name);
      if (!ct.ok()) {
        report.problems.push_back(absl::StrCat(path, ": ", ct.status().message()));
        continue;
      }
      if ((*ct)->use != CheckpointTensor::Use::kTarget) continue;
      if (t.shape != (*ct)->shape) {
        report.problems.push_back(
            absl::StrCat(path, ": tensor \"", t.name, "\" has a shape the model does not have"));
        continue;
      }
      const LayerSpec& spec = layout.layers()[(*ct)->layer];
      LayerBuffers& buffers = layers[(*ct)->layer];
      if (buffers.params.empty()) {
        for (const ParamSpec& p : spec.params) {
          buffers.params.emplace_back(static_cast<size_t>(p.nbytes()), 0);
        }
        buffers.param_seen.assign(spec.params.size(), false);
      }
      buffers.param_seen[(*ct)->param] = true;
      // Read, not mapped: a file truncated under refitctl is an error, not
      // SIGBUS.
      absl::StatusOr<std::string> bytes = (*file)->ReadAll(t);
      if (!bytes.ok()) return bytes.status();
      absl::Status copied =
          Scatter(**ct, t, reinterpret_cast<const uint8_t*>(bytes->data()),
                  spec.params[(*ct)->param], buffers.params[(*ct)->param], &buffers.loaded);
      if (!copied.ok()) return copied;
    }
    files.push_back(*std::move(file));
  }

  // Expected kernels of every covered layer, compared with the daemon's.
  std::vector<const KernelSpec*> specs;
  std::vector<uint64_t> hashes;
  for (size_t l = 0; l < layout.layers().size(); ++l) {
    const LayerSpec& spec = layout.layers()[l];
    LayerBuffers& buffers = layers[l];
    const bool complete = spec.kind == LayerKind::kAttention ||
                          (buffers.loaded > 0 && buffers.loaded == spec.expected_numel);
    std::vector<std::string> expected;
    std::string why_skipped;
    if (complete) {
      absl::Status made = LayerKernels(layout, spec, buffers, expected);
      if (!made.ok()) return made;
    } else if (buffers.loaded == 0) {
      why_skipped = "layer not in the files (the daemon keeps its values)";
    } else {
      why_skipped = absl::StrCat("layer incomplete in the files (", buffers.loaded, " of ",
                                 spec.expected_numel, " elements)");
    }
    for (size_t k = 0; k < spec.kernels.size(); ++k) {
      const KernelSpec& kernel = spec.kernels[k];
      // Pinned to the version GetStatus reported, and to its fingerprint
      // (the same version number after a daemon restart may be other
      // weights): a commit during verify fails it (ABORTED: run it again)
      // rather than comparing a mix.
      absl::StatusOr<ReadTensorResult> got = client.ReadTensor(
          options.model_group, kernel.name, 0, report.version, report.daemon_fingerprint);
      if (!got.ok()) return got.status();
      if (got->version != report.version) {
        report.problems.push_back(absl::StrCat("the daemon's version changed from ", report.version,
                                               " to ", got->version, " during verify"));
        report.version = got->version;
      }
      VerifyEntry entry;
      entry.name = kernel.name;
      const std::string* bytes = &got->data;
      if (!complete) {
        entry.state = VerifyEntry::State::kSkipped;
        entry.detail = why_skipped;
        ++report.skipped;
      } else if (expected[k] == got->data) {
        entry.state = VerifyEntry::State::kMatch;
        ++report.matched;
        bytes = &expected[k];
      } else {
        entry.state = VerifyEntry::State::kMismatch;
        entry.detail = FirstDifference(expected[k], got->data);
        ++report.mismatched;
        bytes = &expected[k];
      }
      specs.push_back(&kernel);
      hashes.push_back(XXH3_64bits(bytes->data(), bytes->size()));
      report.entries.push_back(std::move(entry));
    }
  }
  report.expected_fingerprint = core::KernelFingerprint(specs, hashes);
  return report;
}

}  // namespace refit::client
