#include "core/layer_processor.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/fixture_model.h"
#include "core/fp8_quantizer.h"
#include "core/model_layout.h"
#include "core/parallel.h"
#include "core/scale_hints.h"
#include "core/shard_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/refit_helpers.h"

namespace refit::core {
namespace {

using ::refit::testing::MakeStore;
using ::testing::HasSubstr;

std::shared_ptr<const ModelLayout> Layout(const ModelConfig& config, QuantScheme quant) {
  absl::StatusOr<std::shared_ptr<const ModelLayout>> layout =
      ModelLayout::Build(config, ParallelConfig{}, quant);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return layout.ok() ? *std::move(layout) : nullptr;
}

// The fixture model with biases on every attention projection, so that
// linear layers have a kept bias kernel beside the quantized weight.
ModelConfig BiasedConfig() {
  ModelConfig config = FixtureConfig();
  config.attention_bias = true;
  return config;
}

std::string Str(const StagingBuffer& b) {
  return std::string(reinterpret_cast<const char*>(b.data()), static_cast<size_t>(b.size()));
}

// A layer's params filled with N(0, 0.05) values in each param's dtype, and
// a copy of their bytes to compute expectations from.
struct Params {
  std::vector<StagingBuffer> buffers;
  std::vector<std::string> bytes;
};

Params RandomParams(const LayerSpec& spec, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  Params out;
  for (const ParamSpec& param : spec.params) {
    std::vector<float> values(static_cast<size_t>(param.numel()));
    for (float& v : values) v = normal(rng);
    absl::StatusOr<StagingBuffer> buffer = StagingBuffer::HostUninitialized(param.nbytes(), "test");
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    EXPECT_TRUE(
        ConvertFloats(values.data(), DType::kFloat32, buffer->data(), param.dtype, values.size())
            .ok());
    out.bytes.push_back(Str(*buffer));
    out.buffers.push_back(*std::move(buffer));
  }
  return out;
}

// QuantizeFp8 on the same input: the FP8 bytes and the scale bytes.
std::pair<std::string, std::string> Reference(const std::string& src, DType dtype, int64_t rows,
                                              int64_t cols, QuantScheme scheme,
                                              absl::string_view name) {
  std::string q(static_cast<size_t>(rows * cols), '\0');
  std::vector<float> scales(static_cast<size_t>(Fp8NumScales(scheme, rows, cols)));
  Fp8QuantizeOptions options;
  options.scheme = scheme;
  absl::Status s = QuantizeFp8(src.data(), dtype, rows, cols, options,
                               reinterpret_cast<uint8_t*>(q.data()), scales.data(), name);
  EXPECT_TRUE(s.ok()) << s;
  return {q, std::string(reinterpret_cast<const char*>(scales.data()), scales.size() * 4)};
}

std::unique_ptr<LayerProcessor> Host(const ModelLayout& layout,
                                     NonFinitePolicy policy = NonFinitePolicy::kReject) {
  LayerProcessorOptions options;
  options.non_finite = policy;
  return CreateHostLayerProcessor(layout, options);
}

StagingBuffer Scalar(float value) {
  absl::StatusOr<StagingBuffer> b = StagingBuffer::HostUninitialized(4, "scale");
  EXPECT_TRUE(b.ok());
  std::memcpy(b->data(), &value, 4);
  return *std::move(b);
}

float FloatOf(const StagingBuffer& b) {
  float f = 0;
  EXPECT_EQ(b.size(), 4);
  std::memcpy(&f, b.data(), 4);
  return f;
}

class LayerProcessorSchemeTest : public ::testing::TestWithParam<QuantScheme> {};

TEST_P(LayerProcessorSchemeTest, LinearKernelsEqualQuantizeFp8OfTheParams) {
  const QuantScheme scheme = GetParam();
  std::shared_ptr<const ModelLayout> layout = Layout(BiasedConfig(), scheme);
  ASSERT_NE(layout, nullptr);
  std::unique_ptr<LayerProcessor> processor = Host(*layout);
  int linear = 0;
  for (size_t l = 0; l < layout->layers().size(); ++l) {
    const LayerSpec& spec = layout->layers()[l];
    if (spec.kind != LayerKind::kLinear) continue;
    SCOPED_TRACE(spec.name);
    ++linear;
    Params params = RandomParams(spec, 100 + l);
    absl::StatusOr<ProcessedLayer> out =
        processor->Process(static_cast<int>(l), std::move(params.buffers));
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->layer, static_cast<int>(l));
    ASSERT_EQ(out->kernels.size(), spec.kernels.size());

    const int w = spec.KernelIndex("weight");
    const int s =
        spec.KernelIndex(scheme == QuantScheme::kBlock128 ? "weight_scale_inv" : "weight_scale");
    ASSERT_GE(w, 0);
    ASSERT_GE(s, 0);
    const ParamSpec& weight = spec.params[spec.ParamIndex("weight")];
    const auto [q, scales] =
        Reference(params.bytes[spec.ParamIndex("weight")], weight.dtype, weight.shape[0],
                  weight.shape[1], scheme, spec.kernels[w].name);
    EXPECT_TRUE(Str(out->kernels[w]) == q) << "FP8 weight bytes differ";
    EXPECT_TRUE(Str(out->kernels[s]) == scales) << "scale bytes differ";
    EXPECT_EQ(out->kernels[s].size(), Fp8NumScales(scheme, weight.shape[0], weight.shape[1]) * 4);

    const int b = spec.KernelIndex("bias");
    if (b >= 0) {
      EXPECT_TRUE(Str(out->kernels[b]) == params.bytes[spec.ParamIndex("bias")]) << "bias";
    }
  }
  // Per layer: qkv, o, gate_up, down.
  EXPECT_EQ(linear, 4 * layout->config().num_layers);
}

INSTANTIATE_TEST_SUITE_P(Schemes, LayerProcessorSchemeTest,
                         ::testing::Values(QuantScheme::kPerTensor, QuantScheme::kPerChannel,
                                           QuantScheme::kBlock128),
                         [](const ::testing::TestParamInfo<QuantScheme>& info) {
                           switch (info.param) {
                             case QuantScheme::kPerTensor:
                               return std::string("PerTensor");
                             case QuantScheme::kPerChannel:
                               return std::string("PerChannel");
                             default:
                               return std::string("Block");
                           }
                         });

// Every layer but attention ones, in order, with its params.
struct LayerRun {
  std::vector<int> layers;
  std::vector<Params> params;
};
LayerRun RunOf(const ModelLayout& layout, uint64_t seed) {
  LayerRun run;
  for (size_t l = 0; l < layout.layers().size(); ++l) {
    const LayerSpec& spec = layout.layers()[l];
    if (spec.kind == LayerKind::kAttention || spec.kind == LayerKind::kExperts) continue;
    run.layers.push_back(static_cast<int>(l));
    run.params.push_back(RandomParams(spec, seed + l));
  }
  return run;
}

// Processes `run` in order, each layer shown the (up to) four behind it as
// a LayerWorker shows them; with `decoy`, layer `decoy_at` of the run is
// shown as those buffers instead of its own. Returns every layer's result
// and adds their amax_ahead to *ahead.
std::vector<ProcessedLayer> ProcessLookingAhead(LayerProcessor& processor, LayerRun& run,
                                                int* ahead,
                                                const std::vector<StagingBuffer>* decoy = nullptr,
                                                size_t decoy_at = 0) {
  std::vector<ProcessedLayer> out;
  for (size_t i = 0; i < run.layers.size(); ++i) {
    std::vector<UpcomingLayer> upcoming;
    for (size_t n = i + 1; n < run.layers.size() && n <= i + 4; ++n) {
      UpcomingLayer& u = upcoming.emplace_back();
      u.layer = run.layers[n];
      const std::vector<StagingBuffer>& shown =
          decoy != nullptr && n == decoy_at ? *decoy : run.params[n].buffers;
      for (const StagingBuffer& b : shown) u.params.push_back(b.HostPieces());
    }
    absl::StatusOr<ProcessedLayer> done =
        processor.Process(run.layers[i], std::move(run.params[i].buffers), upcoming);
    EXPECT_TRUE(done.ok()) << done.status();
    if (!done.ok()) return out;
    *ahead += done->amax_ahead;
    out.push_back(*std::move(done));
  }
  return out;
}

// Processes `run` in order, shown nothing ahead (the reference bytes).
std::vector<ProcessedLayer> ProcessPlain(const ModelLayout& layout, LayerRun& run) {
  std::vector<ProcessedLayer> out;
  std::unique_ptr<LayerProcessor> processor = Host(layout);
  for (size_t i = 0; i < run.layers.size(); ++i) {
    absl::StatusOr<ProcessedLayer> done =
        processor->Process(run.layers[i], std::move(run.params[i].buffers));
    EXPECT_TRUE(done.ok()) << done.status();
    if (!done.ok()) return out;
    EXPECT_EQ(done->amax_ahead, 0);
    out.push_back(*std::move(done));
  }
  return out;
}

int Fp8Weights(const ModelLayout& layout) {
  int n = 0;
  for (const LayerSpec& spec : layout.layers()) {
    if (spec.kind == LayerKind::kAttention || spec.kind == LayerKind::kExperts) continue;
    for (const KernelPlan& plan : spec.plan) n += plan.param >= 0 && plan.scale >= 0 ? 1 : 0;
  }
  return n;
}

void ExpectSameKernels(const std::vector<ProcessedLayer>& ours,
                       const std::vector<ProcessedLayer>& expected) {
  ASSERT_EQ(ours.size(), expected.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    ASSERT_EQ(ours[i].kernels.size(), expected[i].kernels.size());
    for (size_t k = 0; k < ours[i].kernels.size(); ++k) {
      EXPECT_EQ(Str(ours[i].kernels[k]), Str(expected[i].kernels[k]))
          << "layer " << ours[i].layer << " kernel " << k;
      EXPECT_EQ(ours[i].hashes[k], expected[i].hashes[k]);
    }
  }
}

// Processing that is shown the layers queued behind it takes each FP8
// weight's amax during the convert of the one before (across the norms in
// between), and makes exactly the bytes of processing that is not.
TEST(LayerProcessorTest, LookingAheadTakesEachAmaxEarlyWithTheSameBytes) {
  std::shared_ptr<const ModelLayout> layout = Layout(BiasedConfig(), QuantScheme::kPerTensor);
  ASSERT_NE(layout, nullptr);
  LayerRun plain = RunOf(*layout, 500);
  LayerRun looking = RunOf(*layout, 500);
  const std::vector<ProcessedLayer> expected = ProcessPlain(*layout, plain);
  int ahead = 0;
  std::vector<ProcessedLayer> ours = ProcessLookingAhead(*Host(*layout), looking, &ahead);
  ExpectSameKernels(ours, expected);
  const int fp8 = Fp8Weights(*layout);
  ASSERT_GT(fp8, 2);
  EXPECT_EQ(ahead, fp8 - 1);  // all but the first
}

// The amax taken ahead is used only by a quantize whose source is the very
// memory it was taken over: a layer processed with other buffers than the
// ones it was shown as gets its own amax (and its own bytes).
TEST(LayerProcessorTest, AnAmaxTakenAheadOfOtherMemoryIsNotUsed) {
  std::shared_ptr<const ModelLayout> layout = Layout(BiasedConfig(), QuantScheme::kPerTensor);
  ASSERT_NE(layout, nullptr);
  LayerRun plain = RunOf(*layout, 600);
  LayerRun looking = RunOf(*layout, 600);
  // The second linear layer is shown as a decoy: the same sizes, larger
  // values (a scale twice as large if it were used).
  size_t second_linear = 0;
  for (size_t i = 0, linear = 0; i < looking.layers.size(); ++i) {
    if (layout->layers()[looking.layers[i]].kind == LayerKind::kLinear && ++linear == 2) {
      second_linear = i;
      break;
    }
  }
  ASSERT_GT(second_linear, 0u);
  Params decoy = RandomParams(layout->layers()[looking.layers[second_linear]], 600);
  for (StagingBuffer& b : decoy.buffers) {
    std::memset(b.data(), 0x3F, static_cast<size_t>(b.size()));  // far above N(0, 0.05)
  }
  const std::vector<ProcessedLayer> expected = ProcessPlain(*layout, plain);
  // The layers before the second linear one are shown the decoy in its place.
  int ahead = 0;
  const std::vector<ProcessedLayer> ours =
      ProcessLookingAhead(*Host(*layout), looking, &ahead, &decoy.buffers, second_linear);
  ASSERT_EQ(ours.size(), looking.layers.size());
  EXPECT_EQ(ours[second_linear].amax_ahead, 0);
  ExpectSameKernels(ours, expected);
  EXPECT_EQ(ahead, Fp8Weights(*layout) - 2);  // neither the first nor the decoyed one
}

// A weight with a scale hint is not read ahead (its own pass reads it once
// when the hint holds); the weight after it still is.
TEST(LayerProcessorTest, AWeightWithAScaleHintIsNotReadAhead) {
  std::shared_ptr<const ModelLayout> layout = Layout(BiasedConfig(), QuantScheme::kPerTensor);
  ASSERT_NE(layout, nullptr);
  std::string hinted;
  for (size_t l = 0, linear = 0; l < layout->layers().size() && hinted.empty(); ++l) {
    const LayerSpec& spec = layout->layers()[l];
    if (spec.kind == LayerKind::kLinear && ++linear == 3) {
      hinted = spec.kernels[spec.KernelIndex("weight")].name;
    }
  }
  ASSERT_FALSE(hinted.empty());
  ScaleHints hints;
  hints.Record(hinted, 0.5f);  // twice: stable, so offered (and wrong)
  hints.Record(hinted, 0.5f);
  ASSERT_GT(hints.Hint(hinted), 0.0f);
  LayerProcessorOptions options;
  options.scale_hints = &hints;
  LayerRun plain = RunOf(*layout, 700);
  LayerRun looking = RunOf(*layout, 700);
  const std::vector<ProcessedLayer> expected = ProcessPlain(*layout, plain);
  int ahead = 0;
  std::vector<ProcessedLayer> ours =
      ProcessLookingAhead(*CreateHostLayerProcessor(*layout, options), looking, &ahead);
  ExpectSameKernels(ours, expected);
  EXPECT_EQ(ahead, Fp8Weights(*layout) - 2);  // neither the first nor the hinted one
}

TEST(LayerProcessorTest, KeptKernelsEqualTheParamsByteForByte) {
  std::shared_ptr<const ModelLayout> layout = Layout(BiasedConfig(), QuantScheme::kPerTensor);
  ASSERT_NE(layout, nullptr);
  std::unique_ptr<LayerProcessor> processor = Host(*layout);
  int checked = 0;
  for (absl::string_view name : {"model.embed_tokens", "model.layers.0.input_layernorm",
                                 "model.layers.1.post_attention_layernorm", "model.norm", "lm_head",
                                 "model.layers.0.self_attn.o_proj"}) {
    SCOPED_TRACE(name);
    const int l = layout->FindLayer(name);
    ASSERT_GE(l, 0);
    const LayerSpec& spec = layout->layers()[l];
    Params params = RandomParams(spec, l);
    absl::StatusOr<ProcessedLayer> out = processor->Process(l, std::move(params.buffers));
    ASSERT_TRUE(out.ok()) << out.status();
    for (size_t k = 0; k < spec.kernels.size(); ++k) {
      const KernelPlan& plan = spec.plan[k];
      if (plan.param < 0 || plan.scale >= 0) continue;  // scales and FP8 weights
      EXPECT_TRUE(Str(out->kernels[k]) == params.bytes[plan.param]) << spec.kernels[k].name;
      ++checked;
    }
  }
  // embed, 3 norms, lm_head, o_proj's bias.
  EXPECT_EQ(checked, 6);
}

// A kept kernel of 4 MiB (an embedding) is made owned, checked and hashed
// on several threads: read partly in place (aliases that start and end
// inside the 64 KiB steps), its kernel is the pushed bytes and its hash
// their XXH3; with two NaNs in it, the error names the first in memory
// order, whichever thread found which.
TEST(LayerProcessorTest, ALargeKeptKernelIsOwnedCheckedAndHashedOnSeveralThreads) {
  ModelConfig config = FixtureConfig();
  config.vocab_size = 16384;  // 16384 x 128 bf16: 4 MiB
  std::shared_ptr<const ModelLayout> layout = Layout(config, QuantScheme::kPerTensor);
  ASSERT_NE(layout, nullptr);
  const int l = layout->FindLayer("model.embed_tokens");
  ASSERT_GE(l, 0);
  const LayerSpec& spec = layout->layers()[l];
  ASSERT_EQ(spec.kernels.size(), 1u);
  for (int threads : {1, 2, 3}) {
    SCOPED_TRACE(threads);
    SetHostThreads(threads);
    for (bool with_nans : {false, true}) {
      SCOPED_TRACE(with_nans);
      Params params = RandomParams(spec, 31);
      std::string& expected = params.bytes[0];
      ASSERT_EQ(expected.size(), size_t{4} << 20);
      constexpr uint16_t kNan = 0x7FC0;
      if (with_nans) {
        for (int64_t e : {int64_t{1500000}, int64_t{100003}}) {
          std::memcpy(expected.data() + 2 * e, &kNan, 2);
          std::memcpy(params.buffers[0].data() + 2 * e, &kNan, 2);
        }
      }
      // Every other 100000 bytes read in place from a copy (a trainer's
      // region); the buffer's own bytes there are zeros until the sweep.
      const std::string region = expected;
      for (int64_t at = 0; at < static_cast<int64_t>(region.size()); at += 200000) {
        const int64_t n = std::min<int64_t>(100000, static_cast<int64_t>(region.size()) - at);
        std::memset(params.buffers[0].data() + at, 0, static_cast<size_t>(n));
        params.buffers[0].AddAlias(at, reinterpret_cast<const uint8_t*>(region.data()) + at, n,
                                   nullptr);
      }
      absl::StatusOr<ProcessedLayer> out = Host(*layout)->Process(l, std::move(params.buffers));
      if (with_nans) {
        EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(out.status().message(),
                    HasSubstr("tensor 'model.embed_tokens.weight': element 100003 is nan"));
        continue;
      }
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_FALSE(out->kernels[0].has_aliases());
      EXPECT_TRUE(Str(out->kernels[0]) == expected);
      EXPECT_EQ(out->hashes[0], XXH3_64bits(expected.data(), expected.size()));
    }
  }
  SetHostThreads(0);
}

TEST(LayerProcessorTest, UnquantizedWeightIsKeptAsIs) {
  std::shared_ptr<const ModelLayout> layout = Layout(FixtureConfig(), QuantScheme::kNone);
  ASSERT_NE(layout, nullptr);
  const int l = layout->FindLayer("model.layers.0.mlp.down_proj");
  const LayerSpec& spec = layout->layers()[l];
  ASSERT_EQ(spec.kernels.size(), 1u);
  Params params = RandomParams(spec, 5);
  absl::StatusOr<ProcessedLayer> out = Host(*layout)->Process(l, std::move(params.buffers));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(spec.kernels[0].dtype, DType::kBFloat16);
  EXPECT_TRUE(Str(out->kernels[0]) == params.bytes[0]);
}

// Kernels are hashed through libxxhash's CPU dispatch (AVX2 / AVX-512) where
// the library has it; the hashes must be the library's default XXH3-64, which
// this test calls, at every length class XXH3 treats apart and at unaligned
// starts.
TEST(LayerProcessorTest, HashBytesIsTheLibrarysXxh3AtEveryLength) {
  std::mt19937_64 rng(7);
  std::vector<uint8_t> bytes((size_t{1} << 20) + 4099);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  for (size_t size : {size_t{0}, size_t{1}, size_t{3}, size_t{4}, size_t{8}, size_t{9}, size_t{16},
                      size_t{17}, size_t{128}, size_t{129}, size_t{240}, size_t{241}, size_t{1023},
                      size_t{1024}, size_t{1025}, size_t{65536} + 5, bytes.size() - 3}) {
    for (size_t offset : {size_t{0}, size_t{1}, size_t{3}}) {
      EXPECT_EQ(HashBytes(bytes.data() + offset, static_cast<int64_t>(size)),
                XXH3_64bits(bytes.data() + offset, size))
          << "size " << size << " offset " << offset;
    }
  }
}

TEST(LayerProcessorTest, HashesAreXxh3OfTheReturnedKernels) {
  std::shared_ptr<const ModelLayout> layout = Layout(BiasedConfig(), QuantScheme::kBlock128);
  ASSERT_NE(layout, nullptr);
  std::unique_ptr<LayerProcessor> processor = Host(*layout);
  for (size_t l = 0; l < layout->layers().size(); ++l) {
    const LayerSpec& spec = layout->layers()[l];
    SCOPED_TRACE(spec.name);
    absl::StatusOr<ProcessedLayer> out =
        processor->Process(static_cast<int>(l), RandomParams(spec, l).buffers);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->hashes.size(), spec.kernels.size());
    ASSERT_EQ(out->kernels.size(), spec.kernels.size());
    for (size_t k = 0; k < spec.kernels.size(); ++k) {
      const StagingBuffer& kernel = out->kernels[k];
      EXPECT_EQ(kernel.size(), spec.kernels[k].nbytes()) << spec.kernels[k].name;
      EXPECT_FALSE(kernel.on_device());
      EXPECT_EQ(out->hashes[k], HashBytes(kernel.data(), kernel.size())) << spec.kernels[k].name;
      EXPECT_EQ(out->hashes[k], XXH3_64bits(kernel.data(), static_cast<size_t>(kernel.size())))
          << spec.kernels[k].name;
    }
  }
}

struct ScalesCase {
  const char* label;
  float k, v, q, kv;  // received; 0 = not received
  float want_k, want_v, want_q;
};

class LayerProcessorAttentionTest : public ::testing::TestWithParam<ScalesCase> {};

TEST_P(LayerProcessorAttentionTest, ScalesFollowResolveAttentionScales) {
  const ScalesCase& c = GetParam();
  std::shared_ptr<const ModelLayout> layout = Layout(FixtureConfig(), QuantScheme::kPerTensor);
  ASSERT_NE(layout, nullptr);
  const int l = layout->FindLayer("model.layers.1.self_attn.attn");
  const LayerSpec& spec = layout->layers()[l];
  std::vector<StagingBuffer> params(spec.params.size());
  params[spec.ParamIndex("k_scale")] = Scalar(c.k);
  params[spec.ParamIndex("v_scale")] = Scalar(c.v);
  params[spec.ParamIndex("q_scale")] = Scalar(c.q);
  params[spec.ParamIndex("kv_scale")] = Scalar(c.kv);
  absl::StatusOr<ProcessedLayer> out = Host(*layout)->Process(l, std::move(params));
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->kernels.size(), 3u);
  const AttentionScales resolved = ResolveAttentionScales(c.k, c.v, c.q, c.kv);
  EXPECT_EQ(FloatOf(out->kernels[spec.KernelIndex("k_scale")]), c.want_k);
  EXPECT_EQ(FloatOf(out->kernels[spec.KernelIndex("v_scale")]), c.want_v);
  EXPECT_EQ(FloatOf(out->kernels[spec.KernelIndex("q_scale")]), c.want_q);
  for (size_t k = 0; k < spec.kernels.size(); ++k) {
    EXPECT_EQ(FloatOf(out->kernels[k]), resolved.ForKernel(spec.kernels[k].suffix))
        << spec.kernels[k].name;
    EXPECT_EQ(out->hashes[k], HashBytes(out->kernels[k].data(), 4));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, LayerProcessorAttentionTest,
    ::testing::Values(ScalesCase{"KAndV", 0.5f, 0.25f, 0.0f, 0.0f, 0.5f, 0.25f, 0.5f},
                      ScalesCase{"KVAndQ", 0.5f, 0.25f, 2.0f, 0.0f, 0.5f, 0.25f, 2.0f},
                      ScalesCase{"None", 0.0f, 0.0f, 0.0f, 0.0f, 1.0f, 1.0f, 1.0f},
                      ScalesCase{"OnlyKvScale", 0.0f, 0.0f, 0.0f, 0.125f, 0.125f, 0.125f, 0.125f},
                      ScalesCase{"OnlyV", 0.0f, 3.0f, 0.0f, 0.0f, 3.0f, 3.0f, 3.0f},
                      ScalesCase{"NegativeKIsMissing", -1.0f, 0.75f, 0.0f, 0.0f, 0.75f, 0.75f,
                                 0.75f}),
    [](const ::testing::TestParamInfo<ScalesCase>& info) { return std::string(info.param.label); });

TEST(LayerProcessorTest, AttentionLayerWithoutParamsGetsUnitScales) {
  std::shared_ptr<const ModelLayout> layout = Layout(FixtureConfig(), QuantScheme::kPerTensor);
  ASSERT_NE(layout, nullptr);
  const int l = layout->FindLayer("model.layers.0.self_attn.attn");
  absl::StatusOr<ProcessedLayer> out = Host(*layout)->Process(l, {});
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->kernels.size(), 3u);
  for (const StagingBuffer& kernel : out->kernels) EXPECT_EQ(FloatOf(kernel), 1.0f);
}

TEST(LayerProcessorTest, NonFiniteWeightUnderRejectIsInvalidArgumentNamingTheTensor) {
  std::shared_ptr<const ModelLayout> layout = Layout(FixtureConfig(), QuantScheme::kPerChannel);
  ASSERT_NE(layout, nullptr);
  const int l = layout->FindLayer("model.layers.1.mlp.gate_up_proj");
  const LayerSpec& spec = layout->layers()[l];
  for (float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    SCOPED_TRACE(bad);
    Params params = RandomParams(spec, 9);
    const float value = bad;
    ASSERT_TRUE(ConvertFloats(&value, DType::kFloat32, params.buffers[0].data() + 2 * 1000,
                              DType::kBFloat16, 1)
                    .ok());
    absl::StatusOr<ProcessedLayer> out = Host(*layout)->Process(l, std::move(params.buffers));
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(out.status().message(), HasSubstr("model.layers.1.mlp.gate_up_proj.weight"));

    // The vLLM-compatible policy quantizes the same input.
    Params again = RandomParams(spec, 9);
    ASSERT_TRUE(ConvertFloats(&value, DType::kFloat32, again.buffers[0].data() + 2 * 1000,
                              DType::kBFloat16, 1)
                    .ok());
    absl::StatusOr<ProcessedLayer> vllm =
        Host(*layout, NonFinitePolicy::kVllmCompatible)->Process(l, std::move(again.buffers));
    EXPECT_TRUE(vllm.ok()) << vllm.status();
  }
}

// A processor whose quantizer reports a NaN/Inf only once its queued work
// has run, at Finish (as a GPU's does), naming the kernel its job was for.
class DeferringProcessor : public LayerProcessor {
 public:
  explicit DeferringProcessor(const ModelLayout& layout)
      : LayerProcessor(layout, LayerProcessorOptions{}) {}
  bool on_device() const override { return false; }

 private:
  class Build : public LayerBuild {
   public:
    Build(const LayerSpec& spec, QuantScheme scheme) : spec_(spec), scheme_(scheme) {}
    absl::Status Quantize(StagingBuffer src, DType src_dtype, int64_t rows, int64_t cols, int k,
                          int s) override {
      (void)s;
      std::vector<uint8_t> q(static_cast<size_t>(rows * cols));
      std::vector<float> scales(static_cast<size_t>(Fp8NumScales(scheme_, rows, cols)));
      Fp8QuantizeOptions options;
      options.scheme = scheme_;
      absl::Status status = QuantizeFp8(src.data(), src_dtype, rows, cols, options, q.data(),
                                        scales.data(), spec_.kernels[k].name);
      if (!status.ok() && deferred_.ok()) deferred_ = status;
      return absl::OkStatus();
    }
    absl::Status Keep(int, StagingBuffer) override { return absl::OkStatus(); }
    absl::Status QuantizeRegion(StagingBuffer, DType, int64_t, int64_t, int, int64_t, int, int64_t,
                                absl::string_view) override {
      return absl::OkStatus();
    }
    absl::Status KeepRegion(int, int64_t, const void*, int64_t) override {
      return absl::OkStatus();
    }
    absl::StatusOr<ProcessedLayer> Finish() override {
      if (!deferred_.ok()) return deferred_;
      return absl::InternalError("the test's processor makes no kernels");
    }

   private:
    const LayerSpec& spec_;
    const QuantScheme scheme_;
    absl::Status deferred_;
  };
  absl::StatusOr<std::unique_ptr<LayerBuild>> Start(const LayerSpec& spec) override {
    return std::make_unique<Build>(spec, layout_.quant());
  }
};

TEST(LayerProcessorTest, ANonFiniteElementReportedAtFinishNamesTheCheckpointTensorAsAtQuantize) {
  std::shared_ptr<const ModelLayout> layout = Layout(FixtureConfig(), QuantScheme::kPerChannel);
  ASSERT_NE(layout, nullptr);
  // A fused kernel (gate and up): the NaN lies in the up projection's rows.
  const int l = layout->FindLayer("model.layers.1.mlp.gate_up_proj");
  const LayerSpec& spec = layout->layers()[l];
  const ParamSpec& param = spec.params[0];
  const int64_t cols = param.shape[1];
  const int64_t row = param.shape[0] / 2 + 3;  // the up projection's row 3
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto poisoned = [&] {
    Params params = RandomParams(spec, 11);
    EXPECT_TRUE(ConvertFloats(&nan, DType::kFloat32,
                              params.buffers[0].data() + (row * cols + 5) * 2, DType::kBFloat16, 1)
                    .ok());
    return params;
  };
  absl::StatusOr<ProcessedLayer> host = Host(*layout)->Process(l, poisoned().buffers);
  ASSERT_EQ(host.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(host.status().message(),
              HasSubstr("checkpoint tensor 'model.layers.1.mlp.up_proj.weight' row 3, col 5: "));

  DeferringProcessor deferring(*layout);
  absl::StatusOr<ProcessedLayer> late = deferring.Process(l, poisoned().buffers);
  ASSERT_EQ(late.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(late.status().message(), host.status().message());
}

TEST(LayerProcessorTest, KeptParamOfTheWrongSizeIsInternal) {
  std::shared_ptr<const ModelLayout> layout = Layout(FixtureConfig(), QuantScheme::kPerTensor);
  ASSERT_NE(layout, nullptr);
  const int l = layout->FindLayer("model.norm");
  std::vector<StagingBuffer> params;
  params.push_back(*StagingBuffer::HostZeroed(10, "short"));
  absl::StatusOr<ProcessedLayer> out = Host(*layout)->Process(l, std::move(params));
  // Refused before anything reads it.
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(out.status().message(), HasSubstr("model.norm"));
  EXPECT_THAT(out.status().message(), HasSubstr("param \"weight\" has 10 bytes, layout has 256"));
}

TEST(LayerProcessorTest, MissingOrShortParamsOfAQuantizedLayerAreInternal) {
  std::shared_ptr<const ModelLayout> layout = Layout(FixtureConfig(), QuantScheme::kPerTensor);
  ASSERT_NE(layout, nullptr);
  const int l = layout->FindLayer("model.layers.0.mlp.down_proj");
  absl::StatusOr<ProcessedLayer> none = Host(*layout)->Process(l, {});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(none.status().message(), HasSubstr("0 param buffers, layout has 1"));
  std::vector<StagingBuffer> params;
  params.push_back(*StagingBuffer::HostZeroed(16, "short"));
  absl::StatusOr<ProcessedLayer> shorter = Host(*layout)->Process(l, std::move(params));
  EXPECT_EQ(shorter.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(shorter.status().message(), HasSubstr("has 16 bytes"));
}

TEST(LayerProcessorTest, HostProcessorIsNotOnDevice) {
  std::shared_ptr<const ModelLayout> layout = Layout(FixtureConfig(), QuantScheme::kPerTensor);
  ASSERT_NE(layout, nullptr);
  EXPECT_FALSE(Host(*layout)->on_device());
}

TEST(LayerProcessorTest, CpuStoreGetsTheHostProcessor) {
  std::unique_ptr<ShardStore> store = MakeStore(FixtureConfig());
  ASSERT_NE(store, nullptr);
  ASSERT_FALSE(store->on_gpu());
  absl::StatusOr<std::unique_ptr<LayerProcessor>> processor =
      CreateLayerProcessor(*store, LayerProcessorOptions{});
  ASSERT_TRUE(processor.ok()) << processor.status();
  EXPECT_FALSE((*processor)->on_device());
  std::unique_ptr<LayerProcessor> host = Host(store->layout());
  EXPECT_TRUE(typeid(**processor) == typeid(*host));

  const int l = store->layout().FindLayer("model.layers.0.self_attn.qkv_proj");
  const LayerSpec& spec = store->layout().layers()[l];
  absl::StatusOr<ProcessedLayer> a = (*processor)->Process(l, RandomParams(spec, 3).buffers);
  absl::StatusOr<ProcessedLayer> b = host->Process(l, RandomParams(spec, 3).buffers);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->hashes, b->hashes);
}

}  // namespace
}  // namespace refit::core
