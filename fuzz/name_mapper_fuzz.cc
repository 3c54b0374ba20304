// Fuzz target: NameMapper, checkpoint tensor name -> where it goes, which
// every pushed chunk's name passes through. Input: one byte choosing a layout
// (the fixture model in each supported architecture, tied or not, one or two
// tensor-parallel ranks, each quantization scheme), then the name.
//
// Checks: a name is found only as itself (the entry found carries the very
// name asked for, and its layer and param exist); anything else is NOT_FOUND
// with a message that names the tensor (its first bytes, as escaping may
// change the rest).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "core/fixture_model.h"
#include "core/model_layout.h"
#include "fuzz/fuzz_check.h"

namespace {

using refit::core::Architecture;
using refit::core::ModelLayout;
using refit::core::NameMapper;

std::vector<std::shared_ptr<const ModelLayout>> BuildLayouts() {
  std::vector<std::shared_ptr<const ModelLayout>> layouts;
  for (Architecture arch :
       {Architecture::kLlama, Architecture::kMistral, Architecture::kQwen2, Architecture::kQwen3}) {
    for (bool tied : {false, true}) {
      for (int64_t tp_size : {1, 2}) {
        for (auto quant :
             {refit::core::QuantScheme::kPerTensor, refit::core::QuantScheme::kPerChannel,
              refit::core::QuantScheme::kBlock128, refit::core::QuantScheme::kNone}) {
          refit::core::ModelConfig config = refit::core::FixtureConfig(arch);
          config.tie_word_embeddings = tied;
          auto layout = ModelLayout::Build(config, {tp_size - 1, tp_size}, quant);
          FUZZ_CHECK(layout.ok());
          layouts.push_back(*layout);
        }
      }
    }
  }
  return layouts;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto* const kLayouts =
      new std::vector<std::shared_ptr<const ModelLayout>>(BuildLayouts());
  if (size == 0) return 0;
  const auto& layout = (*kLayouts)[data[0] % kLayouts->size()];
  const NameMapper mapper(layout);
  const std::string name(reinterpret_cast<const char*>(data) + 1, size - 1);
  absl::StatusOr<const refit::core::CheckpointTensor*> found = mapper.Lookup(name);
  if (!found.ok()) {
    FUZZ_CHECK(found.status().code() == absl::StatusCode::kNotFound);
    // A plain name is quoted as it is; only its first bytes, as a long one
    // may be truncated in the message.
    bool plain = !name.empty();
    for (char c : name.substr(0, 16)) plain &= (c >= 'a' && c <= 'z') || c == '.' || c == '_';
    if (plain) FUZZ_CHECK(absl::StrContains(found.status().message(), name.substr(0, 16)));
    return 0;
  }
  const refit::core::CheckpointTensor& t = **found;
  FUZZ_CHECK(t.name == name);
  absl::StatusOr<int> index = mapper.LookupIndex(name);
  FUZZ_CHECK(index.ok());
  FUZZ_CHECK(&layout->checkpoint_tensors()[*index] == &t);
  if (t.use == refit::core::CheckpointTensor::Use::kTarget) {
    FUZZ_CHECK(t.layer >= 0 && t.layer < static_cast<int>(layout->layers().size()));
    FUZZ_CHECK(t.param >= 0 && t.param < static_cast<int>(layout->layers()[t.layer].params.size()));
  }
  return 0;
}
