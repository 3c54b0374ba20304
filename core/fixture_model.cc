#include "core/fixture_model.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/model_layout.h"
#include "core/safetensors.h"
#include "nlohmann/json.hpp"

namespace refit::core {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr double kWeightStd = 0.05;
constexpr double kNormNoiseStd = 0.02;

// splitmix64's output function: a strong 64-bit mixer, so that element i of
// a tensor is a pure function of (key, i) and any range can be generated
// independently (in parallel, or file by file).
inline uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

uint64_t HashName(absl::string_view name) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a
  for (char ch : name) {
    h ^= static_cast<uint8_t>(ch);
    h *= 0x100000001b3ULL;
  }
  return h;
}

// Sum of four 16-bit uniforms (Irwin-Hall, n = 4): close enough to a normal
// for test weights, and one mixer call per element keeps multi-GB models fast.
constexpr double kSumMean = 4 * 32767.5;
constexpr double kSumVariance = 4 * (65536.0 * 65536.0 - 1) / 12;

struct Generator {
  uint64_t key;
  float scale;   // std of the noise
  float offset;  // 1 for norms, 0 otherwise

  void Fill(int64_t begin, int64_t n, float* out) const {
    const double a = scale / std::sqrt(kSumVariance);
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t u = Mix(key + static_cast<uint64_t>(begin + i + 1) * kGolden);
      const uint64_t s = (u & 0xFFFF) + ((u >> 16) & 0xFFFF) + ((u >> 32) & 0xFFFF) + (u >> 48);
      out[i] = offset + static_cast<float>((static_cast<double>(s) - kSumMean) * a);
    }
  }
};

// Generates elements [begin, end) into `dst` (already offset to `begin`).
absl::Status FillRange(const Generator& gen, DType dtype, int64_t begin, int64_t end,
                       uint8_t* dst) {
  constexpr int64_t kChunk = 16384;
  float buf[kChunk];
  const size_t elem = DTypeSize(dtype);
  for (int64_t i = begin; i < end; i += kChunk) {
    const int64_t n = std::min(kChunk, end - i);
    uint8_t* out = dst + static_cast<size_t>(i - begin) * elem;
    if (dtype == DType::kFloat32) {
      gen.Fill(i, n, reinterpret_cast<float*>(out));
      continue;
    }
    gen.Fill(i, n, buf);
    if (absl::Status s = ConvertFloats(buf, DType::kFloat32, out, dtype, static_cast<size_t>(n));
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

// Writes tensor `t`'s values (t.nbytes() bytes) to `dst`.
absl::Status FillTensor(const CheckpointTensor& t, bool is_norm, uint64_t seed, uint8_t* dst) {
  const Generator gen{Mix(Mix(seed + kGolden) ^ HashName(t.name)),
                      static_cast<float>(is_norm ? kNormNoiseStd : kWeightStd),
                      is_norm ? 1.0f : 0.0f};
  const int64_t numel = t.numel();
  // Benchmarks make multi-GB models: split big tensors over the cores.
  constexpr int64_t kPerThread = 1 << 20;
  const int64_t threads =
      std::clamp<int64_t>(numel / kPerThread, 1, std::max(1u, std::thread::hardware_concurrency()));
  if (threads == 1) return FillRange(gen, t.dtype, 0, numel, dst);
  std::vector<absl::Status> statuses(threads);
  std::vector<std::thread> workers;
  const int64_t per = (numel + threads - 1) / threads;
  for (int64_t w = 0; w < threads; ++w) {
    const int64_t begin = std::min(numel, w * per);
    const int64_t end = std::min(numel, begin + per);
    uint8_t* out = dst + static_cast<size_t>(begin) * DTypeSize(t.dtype);
    workers.emplace_back(
        [&, w, begin, end, out] { statuses[w] = FillRange(gen, t.dtype, begin, end, out); });
  }
  for (std::thread& worker : workers) worker.join();
  for (const absl::Status& s : statuses) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<OwnedTensor> MakeTensor(const CheckpointTensor& t, bool is_norm, uint64_t seed) {
  OwnedTensor out;
  out.name = t.name;
  out.dtype = t.dtype;
  out.shape = t.shape;
  out.bytes.resize(static_cast<size_t>(t.nbytes()));
  if (absl::Status s = FillTensor(t, is_norm, seed, out.bytes.data()); !s.ok()) return s;
  return out;
}

// The tensors a fixture checkpoint holds: every required target of the
// unsharded, unquantized layout, in checkpoint order.
struct FixtureTensor {
  const CheckpointTensor* tensor;
  bool is_norm;
};

std::vector<FixtureTensor> FixtureTensors(const ModelLayout& layout) {
  std::vector<FixtureTensor> out;
  for (const CheckpointTensor& t : layout.checkpoint_tensors()) {
    if (t.use != CheckpointTensor::Use::kTarget || t.optional) continue;
    out.push_back({&t, layout.layers()[t.layer].kind == LayerKind::kNorm});
  }
  return out;
}

absl::StatusOr<std::shared_ptr<const ModelLayout>> UnshardedLayout(const ModelConfig& config) {
  if (!IsHighPrecisionFloat(config.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fixture model: dtype must be bf16, fp16 or fp32, got ", DTypeName(config.dtype)));
  }
  return ModelLayout::Build(config, {0, 1}, QuantScheme::kNone);
}

// mkdir -p. POSIX rather than std::filesystem: libtorch.so exports its own
// copies of some std::filesystem functions, and binaries that link it can
// bind to those (remove_all crashes that way).
absl::Status MakeDirs(const std::string& dir) {
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    const std::string prefix = dir.substr(0, pos);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::InternalError(absl::StrCat(prefix, ": cannot create: ", std::strerror(errno)));
    }
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(dir, ": not a directory"));
  }
  return absl::OkStatus();
}

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat(path, ": cannot write"));
  return absl::OkStatus();
}

}  // namespace

ModelConfig FixtureConfig(Architecture arch) {
  ModelConfig c;
  c.arch = arch;
  switch (arch) {
    case Architecture::kLlama:
      c.arch_name = "LlamaForCausalLM";
      break;
    case Architecture::kMistral:
      c.arch_name = "MistralForCausalLM";
      break;
    case Architecture::kQwen2:
      c.arch_name = "Qwen2ForCausalLM";
      c.attention_bias = true;  // Qwen2 always has q/k/v bias
      break;
    case Architecture::kQwen3:
      c.arch_name = "Qwen3ForCausalLM";
      break;
    case Architecture::kQwen3Moe:
      c.arch_name = "Qwen3MoeForCausalLM";
      c.norm_topk_prob = true;
      break;
    case Architecture::kMixtral:
      c.arch_name = "MixtralForCausalLM";
      break;
  }
  c.hidden_size = 128;
  c.intermediate_size = 352;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 32;
  c.vocab_size = 1000;
  c.tie_word_embeddings = false;
  c.dtype = DType::kBFloat16;
  if (c.is_moe()) {
    // 8 experts of 96 (divisible by tp 1, 2, 4 and, in experts, by ep 1, 2, 4, 8).
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 96;
    if (arch == Architecture::kMixtral) c.intermediate_size = 96;
  }
  return c;
}

absl::StatusOr<std::vector<OwnedTensor>> MakeFixtureWeights(const ModelConfig& config,
                                                            uint64_t seed) {
  absl::StatusOr<std::shared_ptr<const ModelLayout>> layout = UnshardedLayout(config);
  if (!layout.ok()) return layout.status();
  std::vector<OwnedTensor> out;
  for (const FixtureTensor& t : FixtureTensors(**layout)) {
    absl::StatusOr<OwnedTensor> owned = MakeTensor(*t.tensor, t.is_norm, seed);
    if (!owned.ok()) return owned.status();
    out.push_back(*std::move(owned));
  }
  return out;
}

absl::Status WriteFixtureModel(const std::string& dir, const ModelConfig& config, uint64_t seed,
                               int num_files) {
  absl::StatusOr<std::shared_ptr<const ModelLayout>> layout = UnshardedLayout(config);
  if (!layout.ok()) return layout.status();
  const std::vector<FixtureTensor> tensors = FixtureTensors(**layout);
  const int64_t n = static_cast<int64_t>(tensors.size());
  if (num_files < 1 || num_files > n) {
    return absl::InvalidArgumentError(
        absl::StrCat("fixture model: num_files must be in [1, ", n, "], got ", num_files));
  }
  if (absl::Status s = MakeDirs(dir); !s.ok()) return s;

  // Split in checkpoint order into files of about equal bytes; every file
  // gets at least one tensor so that no shard is empty.
  int64_t total = 0;
  for (const FixtureTensor& t : tensors) total += t.tensor->nbytes();
  std::vector<int> file_of(n);
  int64_t before = 0;
  int current = 0;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t bytes = tensors[j].tensor->nbytes();
    const int64_t mid = before + bytes / 2;
    const int wanted = total > 0 ? static_cast<int>(mid * num_files / total) : 0;
    const int forced = num_files - static_cast<int>(n - j);  // files still to fill
    if (j > 0 && (wanted > current || forced > current) && current + 1 < num_files) ++current;
    file_of[j] = current;
    before += bytes;
  }

  // One file's tensors live at a time, in one buffer reused for every file:
  // big benchmark models stay within memory, and pages are faulted in once.
  // Not zero-initialized: every byte is generated.
  std::vector<int64_t> file_bytes(num_files, 0);
  for (int64_t k = 0; k < n; ++k) file_bytes[file_of[k]] += tensors[k].tensor->nbytes();
  const int64_t buffer_bytes = *std::max_element(file_bytes.begin(), file_bytes.end());
  std::unique_ptr<uint8_t[]> buffer(new uint8_t[std::max<int64_t>(buffer_bytes, 1)]);

  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  int64_t j = 0;
  for (int f = 0; f < num_files; ++f) {
    const std::string file_name =
        absl::StrFormat("model-%05d-of-%05d.safetensors", f + 1, num_files);
    const int64_t first = j;
    while (j < n && file_of[j] == f) ++j;
    std::vector<TensorToWrite> to_write;
    int64_t offset = 0;
    for (int64_t k = first; k < j; ++k) {
      const CheckpointTensor& t = *tensors[k].tensor;
      uint8_t* dst = buffer.get() + offset;
      if (absl::Status s = FillTensor(t, tensors[k].is_norm, seed, dst); !s.ok()) return s;
      to_write.push_back({t.name, t.dtype, t.shape,
                          absl::Span<const uint8_t>(dst, static_cast<size_t>(t.nbytes()))});
      weight_map[t.name] = file_name;
      offset += t.nbytes();
    }
    if (absl::Status s =
            WriteSafetensors(absl::StrCat(dir, "/", file_name), to_write, {{"format", "pt"}});
        !s.ok()) {
      return s;
    }
  }

  // The index lets transformers (and test oracles) load the sharded files.
  nlohmann::ordered_json index;
  index["metadata"] = {{"total_size", total}};
  index["weight_map"] = std::move(weight_map);
  if (absl::Status s =
          WriteText(absl::StrCat(dir, "/model.safetensors.index.json"), index.dump(2) + "\n");
      !s.ok()) {
    return s;
  }
  // config.json last: a directory with a config is a complete checkpoint.
  return WriteText(absl::StrCat(dir, "/config.json"), config.ToJson());
}

}  // namespace refit::core
