// Fuzz target: config.json -> ModelConfig -> ModelLayout, what refitd does
// with an operator's --model directory before anything else.
// Input: config.json text.
//
// Checks: errors are INVALID_ARGUMENT or UNIMPLEMENTED (FromJson's and
// Build's documented codes); an accepted config survives ToJson -> FromJson
// unchanged; a layout built from it is self-consistent (its kernel total is
// the sum of its layers' kernels, every checkpoint tensor's layer and param
// exist) for one and two tensor-parallel ranks and every quantization scheme.
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "core/model_config.h"
#include "core/model_layout.h"
#include "fuzz/fuzz_check.h"

namespace {

using refit::core::ModelConfig;
using refit::core::ModelLayout;

bool ErrorCodeIsDocumented(const absl::Status& status) {
  return status.code() == absl::StatusCode::kInvalidArgument ||
         status.code() == absl::StatusCode::kUnimplemented;
}

void CheckLayout(const ModelLayout& layout) {
  int64_t kernels = 0;
  for (const auto& layer : layout.layers()) kernels += static_cast<int64_t>(layer.kernels.size());
  FUZZ_CHECK(kernels == layout.num_kernels());
  FUZZ_CHECK(layout.kernel_bytes() >= 0);
  for (const auto& t : layout.checkpoint_tensors()) {
    auto found = layout.FindCheckpointTensor(t.name);
    FUZZ_CHECK(found.ok());
    if (t.use != refit::core::CheckpointTensor::Use::kTarget) continue;
    FUZZ_CHECK(t.layer >= 0 && t.layer < static_cast<int>(layout.layers().size()));
    const auto& layer = layout.layers()[t.layer];
    FUZZ_CHECK(t.param >= 0 && t.param < static_cast<int>(layer.params.size()));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<ModelConfig> config = ModelConfig::FromJson(text, "config.json");
  if (!config.ok()) {
    FUZZ_CHECK(ErrorCodeIsDocumented(config.status()));
    return 0;
  }
  const std::string json = config->ToJson();
  absl::StatusOr<ModelConfig> again = ModelConfig::FromJson(json, "ToJson");
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(again->ToJson() == json);

  // A layout holds a few records per layer and per checkpoint tensor; past
  // these sizes a build only costs the fuzzer time and memory (a real
  // model's limits are the daemon's memory, not the parser's).
  if (config->num_layers > 256 || config->vocab_size > (int64_t{1} << 24)) return 0;
  for (auto quant : {refit::core::QuantScheme::kPerTensor, refit::core::QuantScheme::kBlock128,
                     refit::core::QuantScheme::kNone}) {
    for (int64_t tp_size : {1, 2}) {
      absl::StatusOr<std::shared_ptr<const ModelLayout>> layout =
          ModelLayout::Build(*config, {tp_size - 1, tp_size}, quant);
      if (!layout.ok()) {
        FUZZ_CHECK(ErrorCodeIsDocumented(layout.status()));
        continue;
      }
      CheckLayout(**layout);
    }
  }
  return 0;
}
