// refit_make_fixture: writes a deterministic synthetic checkpoint
// (config.json + safetensors) for tests, the demo and the benchmarks.
//
//   refit_make_fixture --out DIR [--seed N]
//       [--arch llama|mistral|qwen2|qwen3|qwen3_moe|mixtral] [--files N]
//       [--layers N --hidden N --intermediate N --heads N --kv-heads N --vocab N
//        --head-dim N --dtype bf16|fp16|fp32 --tie]
//       [--experts N --experts-per-tok N --moe-intermediate N]   (qwen3_moe, mixtral)
//
// Without size flags it writes the tiny demo model (FixtureConfig); the size
// flags let the benchmarks make models of several GB.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/fixture_model.h"
#include "core/model_layout.h"

ABSL_FLAG(std::string, out, "", "output directory (created)");
ABSL_FLAG(uint64_t, seed, 1, "weights are a pure function of the config and this seed");
ABSL_FLAG(std::string, arch, "llama",
          "llama, mistral, qwen2, qwen3, or the mixture-of-experts qwen3_moe and mixtral");
ABSL_FLAG(int64_t, experts, 0, "qwen3_moe / mixtral: number of experts (0: the fixture's 8)");
ABSL_FLAG(int64_t, experts_per_tok, 0, "qwen3_moe / mixtral: top-k (0: the fixture's 2)");
ABSL_FLAG(int64_t, moe_intermediate, 0,
          "qwen3_moe / mixtral: expert intermediate size (0: the fixture's 96; for mixtral "
          "--intermediate sets it too)");
ABSL_FLAG(int, files, 0,
          "number of safetensors files; 0 picks 2, or more so that files stay near 512 MiB");
ABSL_FLAG(int64_t, layers, 0, "num_hidden_layers (0: the fixture's 2)");
ABSL_FLAG(int64_t, hidden, 0, "hidden_size (0: the fixture's 128)");
ABSL_FLAG(int64_t, intermediate, 0, "intermediate_size (0: the fixture's 352)");
ABSL_FLAG(int64_t, heads, 0, "num_attention_heads (0: the fixture's 4)");
ABSL_FLAG(int64_t, kv_heads, 0, "num_key_value_heads (0: half of the heads, as in the fixture)");
ABSL_FLAG(int64_t, vocab, 0, "vocab_size (0: the fixture's 1000)");
ABSL_FLAG(int64_t, head_dim, 0, "head_dim (0: hidden / heads)");
ABSL_FLAG(std::string, dtype, "bf16", "bf16, fp16 or fp32");
ABSL_FLAG(bool, tie, false, "tie_word_embeddings (no lm_head tensor)");

namespace refit::core {
namespace {

int Fail(const std::string& message) {
  std::fprintf(stderr, "refit_make_fixture: %s\n", message.c_str());
  return 2;
}

int Run() {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return Fail("--out DIR is required");

  const std::string arch = absl::GetFlag(FLAGS_arch);
  Architecture a;
  if (arch == "llama") {
    a = Architecture::kLlama;
  } else if (arch == "mistral") {
    a = Architecture::kMistral;
  } else if (arch == "qwen2") {
    a = Architecture::kQwen2;
  } else if (arch == "qwen3") {
    a = Architecture::kQwen3;
  } else if (arch == "qwen3_moe") {
    a = Architecture::kQwen3Moe;
  } else if (arch == "mixtral") {
    a = Architecture::kMixtral;
  } else {
    return Fail(absl::StrCat(
        "--arch must be llama, mistral, qwen2, qwen3, qwen3_moe or mixtral, got '", arch, "'"));
  }
  ModelConfig config = FixtureConfig(a);

  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype == "bf16") {
    config.dtype = DType::kBFloat16;
  } else if (dtype == "fp16") {
    config.dtype = DType::kFloat16;
  } else if (dtype == "fp32") {
    config.dtype = DType::kFloat32;
  } else {
    return Fail(absl::StrCat("--dtype must be bf16, fp16 or fp32, got '", dtype, "'"));
  }

  const std::pair<const char*, int64_t> sizes[] = {
      {"layers", absl::GetFlag(FLAGS_layers)},
      {"hidden", absl::GetFlag(FLAGS_hidden)},
      {"intermediate", absl::GetFlag(FLAGS_intermediate)},
      {"heads", absl::GetFlag(FLAGS_heads)},
      {"kv_heads", absl::GetFlag(FLAGS_kv_heads)},
      {"vocab", absl::GetFlag(FLAGS_vocab)},
      {"head_dim", absl::GetFlag(FLAGS_head_dim)},
      {"experts", absl::GetFlag(FLAGS_experts)},
      {"experts_per_tok", absl::GetFlag(FLAGS_experts_per_tok)},
      {"moe_intermediate", absl::GetFlag(FLAGS_moe_intermediate)}};
  for (const auto& [name, value] : sizes) {
    if (value < 0) return Fail(absl::StrCat("--", name, " must be positive, got ", value));
  }
  auto set = [](int64_t flag, int64_t* field) {
    if (flag > 0) *field = flag;
  };
  set(absl::GetFlag(FLAGS_layers), &config.num_layers);
  set(absl::GetFlag(FLAGS_hidden), &config.hidden_size);
  set(absl::GetFlag(FLAGS_intermediate), &config.intermediate_size);
  set(absl::GetFlag(FLAGS_heads), &config.num_heads);
  set(absl::GetFlag(FLAGS_vocab), &config.vocab_size);
  if (config.is_moe()) {
    set(absl::GetFlag(FLAGS_experts), &config.num_experts);
    set(absl::GetFlag(FLAGS_experts_per_tok), &config.num_experts_per_tok);
    // Mixtral's experts are its MLPs: one size.
    if (a == Architecture::kMixtral)
      set(absl::GetFlag(FLAGS_intermediate), &config.moe_intermediate_size);
    set(absl::GetFlag(FLAGS_moe_intermediate), &config.moe_intermediate_size);
    if (a == Architecture::kMixtral) config.intermediate_size = config.moe_intermediate_size;
  } else if (absl::GetFlag(FLAGS_experts) > 0 || absl::GetFlag(FLAGS_moe_intermediate) > 0) {
    return Fail("--experts and --moe-intermediate need --arch qwen3_moe or mixtral");
  }
  if (absl::GetFlag(FLAGS_kv_heads) > 0) {
    config.num_kv_heads = absl::GetFlag(FLAGS_kv_heads);
  } else {
    // Keep the fixture's grouped-query ratio where it still divides.
    config.num_kv_heads = config.num_heads % 2 == 0 ? config.num_heads / 2 : config.num_heads;
  }
  if (absl::GetFlag(FLAGS_head_dim) > 0) {
    config.head_dim = absl::GetFlag(FLAGS_head_dim);
  } else {
    if (config.hidden_size % config.num_heads != 0) {
      return Fail(absl::StrCat("--hidden ", config.hidden_size, " is not a multiple of --heads ",
                               config.num_heads, "; pass --head-dim"));
    }
    config.head_dim = config.hidden_size / config.num_heads;
  }
  config.tie_word_embeddings = absl::GetFlag(FLAGS_tie);

  // The unsharded layout validates the shape and sizes the files.
  absl::StatusOr<std::shared_ptr<const ModelLayout>> layout =
      ModelLayout::Build(config, {0, 1}, QuantScheme::kNone);
  if (!layout.ok()) return Fail(layout.status().ToString());
  int64_t total_bytes = 0;
  int num_tensors = 0;
  for (const CheckpointTensor& t : (*layout)->checkpoint_tensors()) {
    if (t.use != CheckpointTensor::Use::kTarget || t.optional) continue;
    total_bytes += t.nbytes();
    ++num_tensors;
  }
  int files = absl::GetFlag(FLAGS_files);
  if (files == 0) {
    constexpr int64_t kTargetFileBytes = int64_t{512} << 20;
    files = static_cast<int>(std::min<int64_t>(
        num_tensors,
        std::max<int64_t>(2, (total_bytes + kTargetFileBytes - 1) / kTargetFileBytes)));
  }

  const auto start = std::chrono::steady_clock::now();
  if (absl::Status s = WriteFixtureModel(out, config, absl::GetFlag(FLAGS_seed), files); !s.ok()) {
    return Fail(s.ToString());
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("wrote %s: %s, %lld layers, %d tensors, %.1f MiB in %d files, seed %llu, %.2f s\n",
              out.c_str(), config.arch_name.c_str(), static_cast<long long>(config.num_layers),
              num_tensors, total_bytes / 1048576.0, files,
              static_cast<unsigned long long>(absl::GetFlag(FLAGS_seed)), seconds);
  return 0;
}

}  // namespace
}  // namespace refit::core

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Writes a deterministic synthetic checkpoint: refit_make_fixture --out DIR [--seed N] "
      "[--arch llama|mistral|qwen2|qwen3|qwen3_moe|mixtral] [--files N] [--layers N --hidden N "
      "--intermediate N --heads N --kv-heads N --vocab N] [--experts N --experts-per-tok N "
      "--moe-intermediate N]");
  // --help lists this file's flags (absl matches the program name otherwise).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view path) {
    return absl::StrContains(path, "make_fixture_main");
  };
  absl::SetFlagsUsageConfig(usage);
  // Accept --kv-heads as well as absl's --kv_heads spelling.
  std::vector<std::string> args(argv, argv + argc);
  std::vector<char*> normalized;
  for (std::string& arg : args) {
    if (arg.rfind("--", 0) == 0) {
      const size_t end = std::min(arg.find('='), arg.size());
      std::replace(arg.begin() + 2, arg.begin() + static_cast<std::ptrdiff_t>(end), '-', '_');
    }
    normalized.push_back(arg.data());
  }
  absl::ParseCommandLine(static_cast<int>(normalized.size()), normalized.data());
  return refit::core::Run();
}
