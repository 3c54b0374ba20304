// A tiny, deterministic Llama-shaped model written as real safetensors.
//
// Used by tests, by `refitd --model demo` (the embedded default) and by the
// demo script. Weights are a pure function of (config, seed), so two calls
// with the same arguments give identical bytes and a different seed gives a
// different version of the same model. Thread-compatible.
#ifndef REFIT_CORE_FIXTURE_MODEL_H_
#define REFIT_CORE_FIXTURE_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/model_config.h"

namespace refit::core {

struct OwnedTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// The demo model: Llama, hidden 128, intermediate 352, 2 layers, 4 heads,
// 2 kv heads, head_dim 32, vocab 1000 (not a multiple of 64), bf16, untied.
ModelConfig FixtureConfig(Architecture arch = Architecture::kLlama);

// Every checkpoint tensor of `config` with full shapes, in checkpoint order,
// in config.dtype, values ~ N(0, 0.05) from a counter-based generator keyed by
// (seed, tensor name). Norms are around 1.
absl::StatusOr<std::vector<OwnedTensor>> MakeFixtureWeights(const ModelConfig& config,
                                                            uint64_t seed);

// Writes `dir`/config.json and the weights split over `num_files`
// safetensors files (model-0000i-of-0000n.safetensors). Creates `dir`.
absl::Status WriteFixtureModel(const std::string& dir, const ModelConfig& config, uint64_t seed,
                               int num_files = 2);

}  // namespace refit::core

#endif  // REFIT_CORE_FIXTURE_MODEL_H_
