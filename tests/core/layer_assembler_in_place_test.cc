// LayerAssembler reading chunks in place (Chunk::keep, a trainer's mapped
// region): the rows of quantized weights (experts' included) are aliased,
// not copied, and every layer's kernels are the bytes of the copying path,
// for every FP8 scheme, with and without tensor parallelism, chunks of
// random size; what cannot be
// read in place (kept tensors, a dtype conversion, row-parallel column
// slices, a misaligned source) is copied; a bad checksum is DATA_LOSS; the
// memory's keep is held exactly as long as staging refers to it.
#include <xxhash.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/fixture_model.h"
#include "core/layer_assembler.h"
#include "core/layer_processor.h"
#include "core/model_config.h"
#include "core/model_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::core {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<const ModelLayout> Layout(QuantScheme scheme, ParallelConfig parallel = {},
                                          Architecture arch = Architecture::kLlama) {
  absl::StatusOr<std::shared_ptr<const ModelLayout>> layout =
      ModelLayout::Build(FixtureConfig(arch), parallel, scheme);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return layout.ok() ? *std::move(layout) : nullptr;
}

std::vector<OwnedTensor> Weights(uint64_t seed, Architecture arch = Architecture::kLlama) {
  absl::StatusOr<std::vector<OwnedTensor>> w = MakeFixtureWeights(FixtureConfig(arch), seed);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *std::move(w) : std::vector<OwnedTensor>{};
}

// One chunk of `t`: bytes [offset, offset + size).
Chunk ChunkOf(const OwnedTensor& t, const uint8_t* data, uint64_t offset, uint64_t size,
              std::shared_ptr<const void> keep) {
  Chunk chunk;
  chunk.name = t.name;
  chunk.dtype = t.dtype;
  chunk.shape = t.shape;
  chunk.offset = offset;
  chunk.data = absl::MakeConstSpan(data + offset, size);
  chunk.keep = std::move(keep);
  return chunk;
}

// Every layer's kernels (as processed when the layer completed) and the
// bytes read in place.
struct Ingested {
  std::vector<std::vector<std::string>> kernels;
  int64_t in_place = 0;
};

// Ingests `tensors` in chunks of random element-aligned sizes (the same for
// every run with the same `seed`), processing each layer on the host as it
// completes, with `keep` on every chunk.
Ingested IngestAll(const ModelLayout& layout, const std::vector<OwnedTensor>& tensors,
                   uint64_t seed, std::shared_ptr<const void> keep) {
  Ingested run;
  run.kernels.resize(layout.layers().size());
  LayerAssembler assembler(layout, {}, nullptr);
  std::unique_ptr<LayerProcessor> processor = CreateHostLayerProcessor(layout, {});
  std::mt19937_64 rng(seed);
  for (const OwnedTensor& t : tensors) {
    const uint64_t elem = DTypeSize(t.dtype);
    for (uint64_t at = 0; at < t.bytes.size();) {
      const uint64_t n = std::min<uint64_t>(t.bytes.size() - at, (1 + rng() % 20000) * elem);
      absl::StatusOr<WorkUnit> done = assembler.IngestUnit(ChunkOf(t, t.bytes.data(), at, n, keep));
      EXPECT_TRUE(done.ok()) << done.status();
      if (!done.ok()) return run;
      at += n;
      if (done->layer < 0) continue;
      // A dense layer, or an expert part (the layer's kernels come with its
      // last part).
      absl::StatusOr<ProcessedLayer> processed =
          done->part >= 0 ? processor->ProcessPart(done->layer, done->part,
                                                   assembler.TakePart(done->layer, done->part))
                          : processor->Process(done->layer, assembler.TakeParams(done->layer));
      EXPECT_TRUE(processed.ok()) << processed.status();
      if (!processed.ok()) return run;
      for (const StagingBuffer& k : processed->kernels) {
        run.kernels[done->layer].emplace_back(reinterpret_cast<const char*>(k.data()),
                                              static_cast<size_t>(k.size()));
      }
    }
  }
  run.in_place = assembler.bytes_in_place();
  return run;
}

// The bytes this rank reads in place: the quantized weights whose slice is
// whole rows (all of them without TP; the column-parallel ones with it; an
// expert's down_proj is split over its columns too).
int64_t ExpectedInPlace(const ModelLayout& layout, bool tp) {
  int64_t n = 0;
  for (const CheckpointTensor& ct : layout.checkpoint_tensors()) {
    if (!absl::EndsWith(ct.name, "_proj.weight")) continue;
    const bool row_parallel =
        absl::StrContains(ct.name, "o_proj") || absl::StrContains(ct.name, "down_proj");
    if (tp && row_parallel) continue;
    n += ct.slice.numel() * static_cast<int64_t>(DTypeSize(ct.dtype));
  }
  return n;
}

class LayerAssemblerInPlaceArchTest : public ::testing::TestWithParam<Architecture> {};

TEST_P(LayerAssemblerInPlaceArchTest, InPlaceRowsGiveTheKernelsOfCopiedRowsForEverySchemeAndSlice) {
  const std::vector<OwnedTensor> tensors = Weights(3, GetParam());
  ASSERT_FALSE(tensors.empty());
  for (QuantScheme scheme :
       {QuantScheme::kPerTensor, QuantScheme::kPerChannel, QuantScheme::kBlock128}) {
    for (bool tp : {false, true}) {
      SCOPED_TRACE(absl::StrCat(QuantSchemeName(scheme), tp ? " tp 2 rank 1" : " tp 1"));
      const std::shared_ptr<const ModelLayout> layout = Layout(
          scheme, tp ? ParallelConfig{/*tp_rank=*/1, /*tp_size=*/2} : ParallelConfig{}, GetParam());
      ASSERT_NE(layout, nullptr);
      const Ingested copied = IngestAll(*layout, tensors, 17, nullptr);
      auto keep = std::make_shared<int>(0);
      const Ingested in_place = IngestAll(*layout, tensors, 17, keep);
      EXPECT_EQ(copied.in_place, 0);
      EXPECT_EQ(in_place.in_place, ExpectedInPlace(*layout, tp));
      EXPECT_GT(in_place.in_place, 0);
      ASSERT_EQ(in_place.kernels.size(), copied.kernels.size());
      int layers = 0;
      for (size_t l = 0; l < copied.kernels.size(); ++l) {
        EXPECT_EQ(in_place.kernels[l], copied.kernels[l]) << layout->layers()[l].name;
        layers += copied.kernels[l].empty() ? 0 : 1;
      }
      EXPECT_GE(layers, 10);  // every layer but attention completed during ingest
      // Everything processed and the assembler gone: nothing holds the memory.
      EXPECT_EQ(keep.use_count(), 1);
    }
  }
}

// Dense Llama; Qwen3-MoE, whose experts' w13 and w2 are read in place part
// by part.
INSTANTIATE_TEST_SUITE_P(Architectures, LayerAssemblerInPlaceArchTest,
                         ::testing::Values(Architecture::kLlama, Architecture::kQwen3Moe),
                         [](const ::testing::TestParamInfo<Architecture>& info) {
                           return info.param == Architecture::kLlama ? std::string("Llama")
                                                                     : std::string("Qwen3Moe");
                         });

TEST(LayerAssemblerInPlaceTest, WhatCannotBeReadInPlaceIsCopied) {
  const std::shared_ptr<const ModelLayout> layout = Layout(QuantScheme::kPerTensor);
  ASSERT_NE(layout, nullptr);
  const std::vector<OwnedTensor> tensors = Weights(4);
  auto keep = std::make_shared<int>(0);
  auto find = [&](absl::string_view name) -> const OwnedTensor& {
    for (const OwnedTensor& t : tensors) {
      if (t.name == name) return t;
    }
    ADD_FAILURE() << name;
    return tensors.front();
  };
  // A kept tensor (a norm), in its dtype and aligned.
  {
    LayerAssembler assembler(*layout, {}, nullptr);
    const OwnedTensor& norm = find("model.layers.0.input_layernorm.weight");
    ASSERT_TRUE(
        assembler.Ingest(ChunkOf(norm, norm.bytes.data(), 0, norm.bytes.size(), keep)).ok());
    EXPECT_EQ(assembler.bytes_in_place(), 0);
  }
  // A quantized weight at an address that is not element-aligned.
  {
    const OwnedTensor& o = find("model.layers.1.self_attn.o_proj.weight");
    std::vector<uint8_t> shifted(o.bytes.size() + 1);
    std::memcpy(shifted.data() + 1, o.bytes.data(), o.bytes.size());
    LayerAssembler assembler(*layout, {}, nullptr);
    absl::StatusOr<int> done =
        assembler.Ingest(ChunkOf(o, shifted.data() + 1, 0, o.bytes.size(), keep));
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(assembler.bytes_in_place(), 0);
    ASSERT_GE(*done, 0);
    std::vector<StagingBuffer> params = assembler.TakeParams(*done);
    ASSERT_EQ(params.size(), 1u);
    EXPECT_FALSE(params[0].has_aliases());
    EXPECT_EQ(std::memcmp(params[0].data(), o.bytes.data(), o.bytes.size()), 0);
  }
  // The same weight sent as F32: converted, so copied.
  {
    const OwnedTensor& o = find("model.layers.1.self_attn.o_proj.weight");
    OwnedTensor wide{o.name, DType::kFloat32, o.shape, {}};
    wide.bytes.resize(o.bytes.size() * 2);
    ASSERT_TRUE(ConvertFloats(o.bytes.data(), o.dtype, wide.bytes.data(), DType::kFloat32,
                              o.bytes.size() / 2)
                    .ok());
    LayerAssembler assembler(*layout, {}, nullptr);
    ASSERT_TRUE(
        assembler.Ingest(ChunkOf(wide, wide.bytes.data(), 0, wide.bytes.size(), keep)).ok());
    EXPECT_EQ(assembler.bytes_in_place(), 0);
  }
  EXPECT_EQ(keep.use_count(), 1);
}

TEST(LayerAssemblerInPlaceTest, ChecksumIsCheckedAndKeepIsHeldUntilTheParamsGo) {
  const std::shared_ptr<const ModelLayout> layout = Layout(QuantScheme::kPerTensor);
  ASSERT_NE(layout, nullptr);
  const std::vector<OwnedTensor> tensors = Weights(5);
  const OwnedTensor* q = nullptr;
  for (const OwnedTensor& t : tensors) {
    if (t.name == "model.layers.0.self_attn.q_proj.weight") q = &t;
  }
  ASSERT_NE(q, nullptr);
  auto keep = std::make_shared<int>(0);
  {
    LayerAssembler assembler(*layout, {}, nullptr);
    Chunk bad = ChunkOf(*q, q->bytes.data(), 0, q->bytes.size(), keep);
    bad.xxh3 = XXH3_64bits(q->bytes.data(), q->bytes.size()) ^ 1;
    absl::StatusOr<int> r = assembler.Ingest(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(r.status().message(),
                HasSubstr(absl::StrCat("tensor \"model.layers.0.self_attn.q_proj.weight\": "
                                       "checksum mismatch in chunk bytes [0, ",
                                       q->bytes.size(), ")")));
  }
  LayerAssembler assembler(*layout, {}, nullptr);
  Chunk good = ChunkOf(*q, q->bytes.data(), 0, q->bytes.size(), keep);
  good.xxh3 = XXH3_64bits(q->bytes.data(), q->bytes.size());
  absl::StatusOr<int> r = assembler.Ingest(good);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, -1);  // k and v still to come
  EXPECT_EQ(assembler.bytes_in_place(), static_cast<int64_t>(q->bytes.size()));
  good.keep.reset();
  EXPECT_EQ(keep.use_count(), 2);  // here and in the staging
  // An aborted refit frees its staging, and with it the memory's keep.
  assembler.Clear();
  EXPECT_EQ(keep.use_count(), 1);
}

}  // namespace
}  // namespace refit::core
