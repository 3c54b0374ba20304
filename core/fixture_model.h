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
// Qwen3-MoE and Mixtral: the same, with 8 experts (top 2) of intermediate
// size 96 in every layer.
ModelConfig FixtureConfig(Architecture arch = Architecture::kLlama);

// Every checkpoint tensor of `config` with full shapes, in checkpoint order,
// in config.dtype, values ~ N(0, 0.05) from a counter-based generator keyed by
// (seed, tensor name). Norms are around 1.
// Errors:
//   INVALID_ARGUMENT  config.dtype is not bf16, fp16 or fp32, or sizes the
//                     layout cannot be built from (ModelLayout::Build's)
//   UNIMPLEMENTED     experts in a dense architecture (ModelLayout::Build's)
absl::StatusOr<std::vector<OwnedTensor>> MakeFixtureWeights(const ModelConfig& config,
                                                            uint64_t seed);

// Writes `dir`/config.json and the weights split over `num_files`
// safetensors files (model-0000i-of-0000n.safetensors), plus
// model.safetensors.index.json. Creates `dir` and its parents. config.json is
// written last, so a directory holding one is complete.
// Errors:
//   INVALID_ARGUMENT  MakeFixtureWeights's; num_files below 1 or above the
//                     number of tensors; `dir` exists and is not a directory
//   INTERNAL          a directory or file cannot be created or written
//                     (WriteSafetensors's I/O errors)
absl::Status WriteFixtureModel(const std::string& dir, const ModelConfig& config, uint64_t seed,
                               int num_files = 2);

}  // namespace refit::core

#endif  // REFIT_CORE_FIXTURE_MODEL_H_
