#include "core/layer_assembler.h"

#include <xxhash.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/fixture_model.h"
#include "core/model_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/refit_helpers.h"

namespace refit::core {
namespace {

using ::refit::testing::PendingChunk;
using ::refit::testing::ShuffledChunks;
using ::refit::testing::ToChunk;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pair;

std::shared_ptr<const ModelLayout> Layout(const ModelConfig& config, ParallelConfig parallel = {}) {
  absl::StatusOr<std::shared_ptr<const ModelLayout>> layout =
      ModelLayout::Build(config, parallel, QuantScheme::kPerTensor);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return layout.ok() ? *std::move(layout) : nullptr;
}

std::vector<OwnedTensor> Weights(const ModelConfig& config, uint64_t seed) {
  absl::StatusOr<std::vector<OwnedTensor>> w = MakeFixtureWeights(config, seed);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *std::move(w) : std::vector<OwnedTensor>{};
}

const OwnedTensor& Find(const std::vector<OwnedTensor>& tensors, absl::string_view name) {
  for (const OwnedTensor& t : tensors) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no tensor " << name;
  return tensors.front();
}

// Bytes [offset, offset + size) of `t` as one chunk.
Chunk Part(const OwnedTensor& t, uint64_t offset, uint64_t size) {
  return ToChunk(PendingChunk{&t, offset, size});
}
Chunk Whole(const OwnedTensor& t) { return Part(t, 0, t.bytes.size()); }

std::string Str(const StagingBuffer& b) {
  return std::string(reinterpret_cast<const char*>(b.data()), static_cast<size_t>(b.size()));
}

// Rows [r0, r1) of a row-major tensor with `cols` columns, columns [c0, c1).
std::string Block(const OwnedTensor& t, int64_t cols, int64_t r0, int64_t r1, int64_t c0,
                  int64_t c1) {
  const int64_t elem = static_cast<int64_t>(DTypeSize(t.dtype));
  std::string out;
  for (int64_t r = r0; r < r1; ++r) {
    out.append(reinterpret_cast<const char*>(t.bytes.data()) + (r * cols + c0) * elem,
               (c1 - c0) * elem);
  }
  return out;
}

// Records every reserve request and answers with `answer`.
struct ReserveLog {
  std::vector<std::pair<std::string, int64_t>> calls;
  absl::Status answer;
  LayerAssembler::ReserveFn Hook() {
    return [this](const LayerSpec& layer, int64_t bytes) {
      calls.emplace_back(layer.name, bytes);
      return answer;
    };
  }
};

class LayerAssemblerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = FixtureConfig();
    layout_ = Layout(config_);
    ASSERT_NE(layout_, nullptr);
    weights_ = Weights(config_, 1);
    ASSERT_FALSE(weights_.empty());
    assembler_ =
        std::make_unique<LayerAssembler>(*layout_, LayerAssembler::Options{}, reserve_.Hook());
  }

  int LayerIndex(absl::string_view name) const {
    const int l = layout_->FindLayer(name);
    EXPECT_GE(l, 0) << name;
    return l;
  }
  const OwnedTensor& W(absl::string_view name) const { return Find(weights_, name); }

  ModelConfig config_;
  std::shared_ptr<const ModelLayout> layout_;
  std::vector<OwnedTensor> weights_;
  ReserveLog reserve_;
  std::unique_ptr<LayerAssembler> assembler_;
};

TEST_F(LayerAssemblerTest, UnknownNameIsNotFound) {
  const OwnedTensor& norm = W("model.norm.weight");
  Chunk chunk = Whole(norm);
  chunk.name = "model.layers.7.mlp.gate_proj.weight";
  absl::StatusOr<int> r = assembler_->Ingest(chunk);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("unknown tensor"));
  EXPECT_THAT(r.status().message(), HasSubstr("model.layers.7.mlp.gate_proj.weight"));
  EXPECT_EQ(assembler_->bytes_received(), 0);
  EXPECT_THAT(reserve_.calls, IsEmpty());
}

TEST_F(LayerAssemblerTest, NonFloatDtypeIsInvalidArgument) {
  Chunk chunk = Part(W("model.norm.weight"), 0, 8);
  chunk.dtype = DType::kInt32;
  absl::StatusOr<int> r = assembler_->Ingest(chunk);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("model.norm.weight"));
  EXPECT_THAT(r.status().message(), HasSubstr("is not accepted"));
  EXPECT_THAT(r.status().message(), HasSubstr("F32, F16 or BF16"));
  EXPECT_THAT(reserve_.calls, IsEmpty());
}

TEST_F(LayerAssemblerTest, DtypeDifferingFromEarlierChunksIsInvalidArgument) {
  const OwnedTensor& norm = W("model.norm.weight");
  ASSERT_TRUE(assembler_->Ingest(Part(norm, 0, 4)).ok());
  const OwnedTensor wide = refit::testing::WidenBf16ToF32(norm);
  absl::StatusOr<int> r = assembler_->Ingest(Part(wide, 8, 8));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("model.norm.weight"));
  EXPECT_THAT(r.status().message(),
              HasSubstr("chunk dtype F32 differs from its earlier chunks' BF16"));
}

TEST_F(LayerAssemblerTest, ShapeMismatchIsInvalidArgument) {
  const OwnedTensor& norm = W("model.norm.weight");
  const std::vector<int64_t> wrong = {64, 2};
  Chunk chunk = Part(norm, 0, 8);
  chunk.shape = wrong;
  absl::StatusOr<int> r = assembler_->Ingest(chunk);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("model.norm.weight"));
  EXPECT_THAT(r.status().message(), HasSubstr("shape [64, 2] does not match the model's [128]"));
}

TEST_F(LayerAssemblerTest, MisalignedOffsetOrSizeIsInvalidArgument) {
  const OwnedTensor& norm = W("model.norm.weight");
  for (const auto& [offset, size] : {std::pair<uint64_t, uint64_t>{1, 2}, {0, 3}, {3, 5}}) {
    SCOPED_TRACE(absl::StrCat("offset ", offset, " size ", size));
    absl::StatusOr<int> r = assembler_->Ingest(Part(norm, offset, size));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("model.norm.weight"));
    EXPECT_THAT(r.status().message(), HasSubstr("not aligned to whole BF16 elements"));
  }
  EXPECT_EQ(assembler_->bytes_received(), 0);
}

TEST_F(LayerAssemblerTest, OverlappingChunkIsInvalidArgument) {
  const OwnedTensor& norm = W("model.norm.weight");
  ASSERT_TRUE(assembler_->Ingest(Part(norm, 0, 8)).ok());
  absl::StatusOr<int> r = assembler_->Ingest(Part(norm, 4, 8));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("model.norm.weight"));
  EXPECT_THAT(r.status().message(), HasSubstr("overlap bytes [0, 8) already received"));
  EXPECT_EQ(assembler_->bytes_received(), 8);
}

TEST_F(LayerAssemblerTest, RepeatedChunkIsAlreadyExists) {
  const OwnedTensor& norm = W("model.norm.weight");
  ASSERT_TRUE(assembler_->Ingest(Part(norm, 8, 8)).ok());
  absl::StatusOr<int> r = assembler_->Ingest(Part(norm, 8, 8));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(r.status().message(), HasSubstr("model.norm.weight"));
  EXPECT_THAT(r.status().message(), HasSubstr("duplicate chunk, bytes [8, 16)"));
  EXPECT_EQ(assembler_->elements_loaded(), 4);
}

TEST_F(LayerAssemblerTest, ChunkPastTheEndIsOutOfRange) {
  const OwnedTensor& norm = W("model.norm.weight");
  ASSERT_EQ(norm.bytes.size(), 256u);
  // The chunk's span stays within the source vector; its offset claims more.
  Chunk chunk = Part(norm, 0, 4);
  chunk.offset = 254;
  absl::StatusOr<int> r = assembler_->Ingest(chunk);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(r.status().message(), HasSubstr("model.norm.weight"));
  EXPECT_THAT(r.status().message(), HasSubstr("runs past its end at 256 bytes"));
  EXPECT_THAT(reserve_.calls, IsEmpty());
}

TEST_F(LayerAssemblerTest, ChecksumIsVerifiedWhenGiven) {
  const OwnedTensor& norm = W("model.norm.weight");
  Chunk good = Part(norm, 0, 64);
  good.xxh3 = XXH3_64bits(good.data.data(), good.data.size());
  EXPECT_TRUE(assembler_->Ingest(good).ok());

  Chunk bad = Part(norm, 64, 64);
  bad.xxh3 = XXH3_64bits(bad.data.data(), bad.data.size()) + 1;
  absl::StatusOr<int> r = assembler_->Ingest(bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(r.status().message(), HasSubstr("model.norm.weight"));
  EXPECT_THAT(r.status().message(), HasSubstr("checksum mismatch in chunk bytes [64, 128)"));
}

TEST_F(LayerAssemblerTest, ChecksumOverSeveralBlocksIsVerified) {
  // 512000 fp32 bytes: hashed and scattered in more than one 256 KiB block.
  const OwnedTensor wide = refit::testing::WidenBf16ToF32(W("model.embed_tokens.weight"));
  Chunk bad = Whole(wide);
  bad.xxh3 = XXH3_64bits(bad.data.data(), bad.data.size()) ^ 0x1;
  absl::StatusOr<int> r = assembler_->Ingest(bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(r.status().message(), HasSubstr("model.embed_tokens.weight"));
  EXPECT_THAT(r.status().message(), HasSubstr("checksum mismatch in chunk bytes [0, 512000)"));

  LayerAssembler fresh(*layout_, {}, nullptr);
  Chunk good = Whole(wide);
  good.xxh3 = XXH3_64bits(good.data.data(), good.data.size());
  absl::StatusOr<int> ok = fresh.Ingest(good);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, LayerIndex("model.embed_tokens"));
}

TEST_F(LayerAssemblerTest, ReserveErrorIsReturnedAsIsAndNothingIsAllocated) {
  reserve_.answer = absl::ResourceExhaustedError("staging budget of 10 bytes exceeded");
  const OwnedTensor& norm = W("model.norm.weight");
  absl::StatusOr<int> r = assembler_->Ingest(Part(norm, 0, 16));
  EXPECT_EQ(r.status(), reserve_.answer);
  const int l = LayerIndex("model.norm");
  EXPECT_THAT(reserve_.calls, ElementsAre(Pair("model.norm", layout_->layers()[l].param_bytes())));
  EXPECT_EQ(assembler_->staging_bytes(), 0);
  EXPECT_EQ(assembler_->layers_in_flight(), 0);
  EXPECT_EQ(assembler_->elements_loaded(), 0);
  EXPECT_EQ(assembler_->loaded(l), 0);

  // Once the hook agrees, the next chunk allocates.
  reserve_.answer = absl::OkStatus();
  ASSERT_TRUE(assembler_->Ingest(Part(norm, 16, 16)).ok());
  EXPECT_EQ(reserve_.calls.size(), 2u);
  EXPECT_EQ(assembler_->staging_bytes(), layout_->layers()[l].param_bytes());
  EXPECT_EQ(assembler_->loaded(l), 8);
}

TEST_F(LayerAssemblerTest, FusedQkvCompletesOnlyWhenQKAndVHaveAllArrived) {
  const int qkv = LayerIndex("model.layers.0.self_attn.qkv_proj");
  const std::vector<OwnedTensor> parts = {W("model.layers.0.self_attn.q_proj.weight"),
                                          W("model.layers.0.self_attn.k_proj.weight"),
                                          W("model.layers.0.self_attn.v_proj.weight")};
  for (uint64_t seed : {1, 2, 3, 4}) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    LayerAssembler assembler(*layout_, {}, nullptr);
    const std::vector<PendingChunk> chunks = ShuffledChunks(parts, seed, 1 + 300 * seed);
    for (size_t i = 0; i < chunks.size(); ++i) {
      absl::StatusOr<int> r = assembler.Ingest(ToChunk(chunks[i]));
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(*r, i + 1 == chunks.size() ? qkv : -1) << "chunk " << i << " of " << chunks.size();
    }
    EXPECT_EQ(assembler.loaded(qkv), layout_->layers()[qkv].expected_numel);
  }
}

TEST_F(LayerAssemblerTest, EveryLayerCompletesAtItsLastChunk) {
  // At tp=1 every element is this rank's: a layer completes exactly when the
  // elements received for it reach its expected count.
  std::vector<int64_t> remaining;
  for (const LayerSpec& layer : layout_->layers()) remaining.push_back(layer.expected_numel);
  std::vector<int> completions(layout_->layers().size(), 0);
  for (const PendingChunk& p : ShuffledChunks(weights_, 7, 2000)) {
    const Chunk chunk = ToChunk(p);
    const CheckpointTensor& ct =
        layout_->checkpoint_tensors()[*layout_->FindCheckpointTensor(chunk.name)];
    absl::StatusOr<int> r = assembler_->Ingest(chunk);
    ASSERT_TRUE(r.ok()) << r.status();
    remaining[ct.layer] -= static_cast<int64_t>(p.size / DTypeSize(p.tensor->dtype));
    ASSERT_EQ(*r, remaining[ct.layer] == 0 ? ct.layer : -1) << chunk.name << " @" << chunk.offset;
    if (*r >= 0) {
      ++completions[*r];
      EXPECT_EQ(assembler_->TakeParams(*r).size(), layout_->layers()[*r].params.size());
    }
  }
  for (size_t l = 0; l < layout_->layers().size(); ++l) {
    const LayerSpec& layer = layout_->layers()[l];
    // Attention layers (optional scales) complete at Prepare, never here.
    EXPECT_EQ(completions[l], layer.kind == LayerKind::kAttention ? 0 : 1) << layer.name;
  }
  EXPECT_EQ(assembler_->elements_loaded(), assembler_->elements_expected());
  EXPECT_EQ(assembler_->staging_bytes(), 0);
  EXPECT_EQ(assembler_->layers_in_flight(), 0);
}

TEST_F(LayerAssemblerTest, AttentionScalesNeverCompleteALayer) {
  const int attn = LayerIndex("model.layers.0.self_attn.attn");
  const float value = 0.5f;
  OwnedTensor scale{"model.layers.0.self_attn.k_proj.output_scale", DType::kFloat32, {}, {}};
  scale.bytes.resize(4);
  std::memcpy(scale.bytes.data(), &value, 4);
  absl::StatusOr<int> r = assembler_->Ingest(Whole(scale));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, -1);
  EXPECT_EQ(assembler_->loaded(attn), 1);
  EXPECT_EQ(assembler_->layers_in_flight(), 1);
}

TEST_F(LayerAssemblerTest, CountsStagingBytesAndElements) {
  int64_t expected = 0;
  for (const LayerSpec& layer : layout_->layers()) {
    if (layer.kind != LayerKind::kAttention) expected += layer.expected_numel;
  }
  EXPECT_EQ(assembler_->elements_expected(), expected);
  EXPECT_EQ(assembler_->elements_loaded(), 0);

  const int l = LayerIndex("model.layers.1.mlp.gate_up_proj");
  const LayerSpec& spec = layout_->layers()[l];
  const OwnedTensor& gate = W("model.layers.1.mlp.gate_proj.weight");
  const OwnedTensor& up = W("model.layers.1.mlp.up_proj.weight");
  ASSERT_EQ(*assembler_->Ingest(Part(gate, 0, 20)), -1);
  EXPECT_THAT(reserve_.calls, ElementsAre(Pair(spec.name, spec.param_bytes())));
  EXPECT_EQ(assembler_->staging_bytes(), spec.param_bytes());
  EXPECT_EQ(assembler_->layers_in_flight(), 1);
  EXPECT_EQ(assembler_->elements_loaded(), 10);
  EXPECT_EQ(assembler_->bytes_received(), 20);
  EXPECT_EQ(assembler_->loaded(l), 10);

  ASSERT_EQ(*assembler_->Ingest(Part(gate, 20, gate.bytes.size() - 20)), -1);
  ASSERT_EQ(*assembler_->Ingest(Whole(up)), l);
  EXPECT_EQ(reserve_.calls.size(), 1u) << "one reservation per layer";
  EXPECT_EQ(assembler_->elements_loaded(), spec.expected_numel);
  EXPECT_EQ(assembler_->bytes_received(),
            static_cast<int64_t>(gate.bytes.size() + up.bytes.size()));
  EXPECT_FALSE(assembler_->taken(l));

  std::vector<StagingBuffer> params = assembler_->TakeParams(l);
  ASSERT_EQ(params.size(), 1u);
  EXPECT_EQ(params[0].size(), spec.params[0].nbytes());
  EXPECT_TRUE(assembler_->taken(l));
  EXPECT_EQ(assembler_->staging_bytes(), 0);
  EXPECT_EQ(assembler_->layers_in_flight(), 0);
  EXPECT_EQ(assembler_->elements_loaded(), spec.expected_numel);

  // Ignored names count as received bytes, never as elements or staging.
  OwnedTensor inv_freq{"model.layers.0.self_attn.rotary_emb.inv_freq", DType::kFloat32, {16}, {}};
  inv_freq.bytes.assign(64, 0);
  ASSERT_EQ(*assembler_->Ingest(Whole(inv_freq)), -1);
  EXPECT_EQ(assembler_->bytes_received(),
            static_cast<int64_t>(gate.bytes.size() + up.bytes.size() + 64));
  EXPECT_EQ(assembler_->elements_loaded(), spec.expected_numel);
  EXPECT_EQ(reserve_.calls.size(), 1u);
}

TEST_F(LayerAssemblerTest, EnsureStagingZeroesAttentionScalesAndClearFreesStaging) {
  const int attn = LayerIndex("model.layers.1.self_attn.attn");
  ASSERT_TRUE(assembler_->EnsureStaging(attn).ok());
  ASSERT_TRUE(assembler_->EnsureStaging(attn).ok());
  EXPECT_THAT(reserve_.calls, ElementsAre(Pair("model.layers.1.self_attn.attn", 16)));
  EXPECT_EQ(assembler_->staging_bytes(), 16);
  ASSERT_TRUE(assembler_->Ingest(Part(W("model.norm.weight"), 0, 2)).ok());
  EXPECT_EQ(assembler_->layers_in_flight(), 2);

  std::vector<StagingBuffer> scales = assembler_->TakeParams(attn);
  ASSERT_EQ(scales.size(), 4u);
  for (const StagingBuffer& s : scales) EXPECT_EQ(Str(s), std::string(4, '\0'));

  assembler_->Clear();
  EXPECT_EQ(assembler_->staging_bytes(), 0);
  EXPECT_EQ(assembler_->layers_in_flight(), 0);
}

TEST_F(LayerAssemblerTest, TensorReceivedInPartIsDataLoss) {
  EXPECT_TRUE(assembler_->CheckTensorsComplete().ok());
  const OwnedTensor& norm = W("model.norm.weight");
  ASSERT_TRUE(assembler_->Ingest(Part(norm, 0, 100)).ok());
  absl::Status s = assembler_->CheckTensorsComplete();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("tensor \"model.norm.weight\" is incomplete"));
  EXPECT_THAT(s.message(), HasSubstr("received 100 of 256 bytes"));

  ASSERT_TRUE(assembler_->Ingest(Part(norm, 100, 156)).ok());
  EXPECT_TRUE(assembler_->CheckTensorsComplete().ok());
}

TEST_F(LayerAssemblerTest, MissingTensorsListsExactlyTheAbsentOnes) {
  const int qkv = LayerIndex("model.layers.0.self_attn.qkv_proj");
  EXPECT_THAT(assembler_->MissingTensors(qkv),
              ElementsAre("model.layers.0.self_attn.q_proj.weight",
                          "model.layers.0.self_attn.k_proj.weight",
                          "model.layers.0.self_attn.v_proj.weight"));
  ASSERT_TRUE(assembler_->Ingest(Whole(W("model.layers.0.self_attn.q_proj.weight"))).ok());
  // Part of a tensor counts as arrived here; CheckTensorsComplete reports it.
  ASSERT_TRUE(assembler_->Ingest(Part(W("model.layers.0.self_attn.v_proj.weight"), 0, 2)).ok());
  EXPECT_THAT(assembler_->MissingTensors(qkv),
              ElementsAre("model.layers.0.self_attn.k_proj.weight"));
  // Optional attention scales are never missing.
  EXPECT_THAT(assembler_->MissingTensors(LayerIndex("model.layers.0.self_attn.attn")), IsEmpty());
  EXPECT_THAT(assembler_->MissingTensors(LayerIndex("model.norm")),
              ElementsAre("model.norm.weight"));
}

TEST_F(LayerAssemblerTest, MissingTensorsSkipsTensorsWithNothingOnThisRank) {
  // Vocabulary 10 pads to 64 rows, 32 per rank: rank 1 holds only padding.
  ModelConfig small = config_;
  small.vocab_size = 10;
  std::shared_ptr<const ModelLayout> layout = Layout(small, {1, 2});
  ASSERT_NE(layout, nullptr);
  LayerAssembler assembler(*layout, {}, nullptr);
  EXPECT_THAT(assembler.MissingTensors(layout->FindLayer("model.embed_tokens")), IsEmpty());
  EXPECT_THAT(assembler.MissingTensors(layout->FindLayer("model.norm")),
              ElementsAre("model.norm.weight"));
}

TEST_F(LayerAssemblerTest, ConvertsFp32InputToTheBf16CheckpointDtype) {
  const OwnedTensor& norm = W("model.layers.0.input_layernorm.weight");
  const OwnedTensor wide = refit::testing::WidenBf16ToF32(norm);
  const int l = LayerIndex("model.layers.0.input_layernorm");
  ASSERT_EQ(layout_->layers()[l].params[0].dtype, DType::kBFloat16);
  ASSERT_EQ(*assembler_->Ingest(Part(wide, 0, 200)), -1);
  ASSERT_EQ(*assembler_->Ingest(Part(wide, 200, wide.bytes.size() - 200)), l);
  std::vector<StagingBuffer> params = assembler_->TakeParams(l);
  ASSERT_EQ(params.size(), 1u);
  EXPECT_EQ(Str(params[0]), std::string(norm.bytes.begin(), norm.bytes.end()));

  // Rounding to nearest even: 1 + 2^-8 is halfway between two bf16 values.
  const int post = LayerIndex("model.layers.0.post_attention_layernorm");
  OwnedTensor halfway{"model.layers.0.post_attention_layernorm.weight", DType::kFloat32, {128}, {}};
  std::vector<float> values(128, 1.0f + 1.0f / 256);
  values[1] = 1.0f + 3.0f / 256;  // rounds up to 1 + 4/256
  halfway.bytes.resize(values.size() * 4);
  std::memcpy(halfway.bytes.data(), values.data(), halfway.bytes.size());
  ASSERT_EQ(*assembler_->Ingest(Whole(halfway)), post);
  std::vector<StagingBuffer> rounded = assembler_->TakeParams(post);
  uint16_t first, second;
  std::memcpy(&first, rounded[0].data(), 2);
  std::memcpy(&second, rounded[0].data() + 2, 2);
  EXPECT_EQ(first, 0x3F80);   // 1.0
  EXPECT_EQ(second, 0x3F82);  // 1 + 2/128
}

class LayerAssemblerTpTest : public LayerAssemblerTest {
 protected:
  void SetUp() override {
    LayerAssemblerTest::SetUp();
    tp_layout_ = Layout(config_, {/*tp_rank=*/1, /*tp_size=*/2});
    ASSERT_NE(tp_layout_, nullptr);
    tp_ = std::make_unique<LayerAssembler>(*tp_layout_, LayerAssembler::Options{}, reserve_.Hook());
  }
  int TpLayer(absl::string_view name) const {
    const int l = tp_layout_->FindLayer(name);
    EXPECT_GE(l, 0) << name;
    return l;
  }
  // Ingests every chunk, expecting the last to complete `layer`.
  void IngestAll(const std::vector<PendingChunk>& chunks, int layer) {
    for (size_t i = 0; i < chunks.size(); ++i) {
      absl::StatusOr<int> r = tp_->Ingest(ToChunk(chunks[i]));
      ASSERT_TRUE(r.ok()) << r.status();
      if (*r >= 0) {
        EXPECT_EQ(*r, layer);
        EXPECT_EQ(tp_->loaded(layer), tp_layout_->layers()[layer].expected_numel);
        return;
      }
    }
    FAIL() << "layer " << layer << " never completed";
  }

  std::shared_ptr<const ModelLayout> tp_layout_;
  std::unique_ptr<LayerAssembler> tp_;
};

TEST_F(LayerAssemblerTpTest, ChunksWhollyInTheOtherRanksRowsAllocateNothing) {
  // Column-parallel q_proj: rank 1 holds rows [64, 128) of 128.
  const OwnedTensor& q = W("model.layers.0.self_attn.q_proj.weight");
  const uint64_t row = 128 * 2;
  absl::StatusOr<int> r = tp_->Ingest(Part(q, 0, 64 * row));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, -1);
  EXPECT_THAT(reserve_.calls, IsEmpty());
  EXPECT_EQ(tp_->staging_bytes(), 0);
  EXPECT_EQ(tp_->layers_in_flight(), 0);
  EXPECT_EQ(tp_->elements_loaded(), 0);
  EXPECT_EQ(tp_->loaded(TpLayer("model.layers.0.self_attn.qkv_proj")), 0);
  EXPECT_EQ(tp_->bytes_received(), static_cast<int64_t>(64 * row));

  // One element of rank 1's rows allocates the layer.
  ASSERT_EQ(*tp_->Ingest(Part(q, 64 * row, 2)), -1);
  EXPECT_EQ(reserve_.calls.size(), 1u);
  EXPECT_EQ(tp_->elements_loaded(), 1);
}

TEST_F(LayerAssemblerTpTest, ChunksWhollyInTheOtherRanksColumnsAllocateNothing) {
  // Row-parallel o_proj: rank 1 holds columns [64, 128) of every row.
  const OwnedTensor& o = W("model.layers.0.self_attn.o_proj.weight");
  const uint64_t row = 128 * 2;
  for (uint64_t r = 0; r < 16; ++r) {
    absl::StatusOr<int> got = tp_->Ingest(Part(o, r * row, 64 * 2));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, -1);
  }
  EXPECT_THAT(reserve_.calls, IsEmpty());
  EXPECT_EQ(tp_->staging_bytes(), 0);
  EXPECT_EQ(tp_->elements_loaded(), 0);
  EXPECT_EQ(tp_->loaded(TpLayer("model.layers.0.self_attn.o_proj")), 0);

  // A chunk from column 63 to 64 of row 16 reaches into rank 1's columns.
  ASSERT_EQ(*tp_->Ingest(Part(o, 16 * row + 63 * 2, 4)), -1);
  EXPECT_EQ(reserve_.calls.size(), 1u);
  EXPECT_EQ(tp_->elements_loaded(), 1);
}

TEST_F(LayerAssemblerTpTest, RowParallelParamsAreThisRanksColumns) {
  const OwnedTensor& o = W("model.layers.1.self_attn.o_proj.weight");
  const int l = TpLayer("model.layers.1.self_attn.o_proj");
  IngestAll(ShuffledChunks({o}, 3, 50), l);
  std::vector<StagingBuffer> params = tp_->TakeParams(l);
  ASSERT_EQ(params.size(), 1u);
  EXPECT_EQ(Str(params[0]), Block(o, 128, 0, 128, 64, 128));

  const OwnedTensor& down = W("model.layers.1.mlp.down_proj.weight");
  const int d = TpLayer("model.layers.1.mlp.down_proj");
  IngestAll(ShuffledChunks({down}, 4, 100), d);
  std::vector<StagingBuffer> down_params = tp_->TakeParams(d);
  EXPECT_EQ(Str(down_params[0]), Block(down, 352, 0, 128, 176, 352));
}

TEST_F(LayerAssemblerTpTest, ColumnParallelParamsAreThisRanksRowsFused) {
  const OwnedTensor& q = W("model.layers.1.self_attn.q_proj.weight");
  const OwnedTensor& k = W("model.layers.1.self_attn.k_proj.weight");
  const OwnedTensor& v = W("model.layers.1.self_attn.v_proj.weight");
  const int qkv = TpLayer("model.layers.1.self_attn.qkv_proj");
  IngestAll(ShuffledChunks({q, k, v}, 5, 100), qkv);
  std::vector<StagingBuffer> params = tp_->TakeParams(qkv);
  ASSERT_EQ(params.size(), 1u);
  // Rank 1: q heads 2-3 (rows 64-127), kv head 1 (rows 32-63 of k and v).
  EXPECT_EQ(Str(params[0]), Block(q, 128, 64, 128, 0, 128) + Block(k, 128, 32, 64, 0, 128) +
                                Block(v, 128, 32, 64, 0, 128));

  const OwnedTensor& gate = W("model.layers.0.mlp.gate_proj.weight");
  const OwnedTensor& up = W("model.layers.0.mlp.up_proj.weight");
  const int gu = TpLayer("model.layers.0.mlp.gate_up_proj");
  IngestAll(ShuffledChunks({gate, up}, 6, 100), gu);
  EXPECT_EQ(Str(tp_->TakeParams(gu)[0]),
            Block(gate, 128, 176, 352, 0, 128) + Block(up, 128, 176, 352, 0, 128));
}

TEST_F(LayerAssemblerTpTest, VocabRowsPastTheVocabularyAreZero) {
  // Vocabulary 1000 pads to 1024: rank 1 holds rows [512, 1000) and 24 zero rows.
  const OwnedTensor& head = W("lm_head.weight");
  const int l = TpLayer("lm_head");
  IngestAll(ShuffledChunks({head}, 8, 5000), l);
  EXPECT_EQ(Str(tp_->TakeParams(l)[0]),
            Block(head, 128, 512, 1000, 0, 128) + std::string(24 * 128 * 2, '\0'));
}

TEST_F(LayerAssemblerTpTest, ChunksAfterTakeParamsAreIgnored) {
  const OwnedTensor& o = W("model.layers.0.self_attn.o_proj.weight");
  const int l = TpLayer("model.layers.0.self_attn.o_proj");
  const uint64_t row = 128 * 2;
  for (uint64_t r = 0; r < 128; ++r) {
    absl::StatusOr<int> got = tp_->Ingest(Part(o, r * row + 64 * 2, 64 * 2));
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(*got, r == 127 ? l : -1);
  }
  ASSERT_EQ(tp_->TakeParams(l).size(), 1u);
  for (uint64_t r = 0; r < 128; ++r) {
    absl::StatusOr<int> got = tp_->Ingest(Part(o, r * row, 64 * 2));
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(*got, -1);
  }
  EXPECT_EQ(reserve_.calls.size(), 1u);
  EXPECT_EQ(tp_->staging_bytes(), 0);
  EXPECT_EQ(tp_->layers_in_flight(), 0);
  EXPECT_EQ(tp_->elements_loaded(), 128 * 64);
  EXPECT_TRUE(tp_->CheckTensorsComplete().ok());
}

TEST_F(LayerAssemblerTpTest, WholeModelLoadsEveryElementOfThisRank) {
  std::vector<int> completions(tp_layout_->layers().size(), 0);
  for (const PendingChunk& p : ShuffledChunks(weights_, 11, 3000)) {
    absl::StatusOr<int> r = tp_->Ingest(ToChunk(p));
    ASSERT_TRUE(r.ok()) << r.status();
    if (*r >= 0) {
      ++completions[*r];
      tp_->TakeParams(*r);
    }
  }
  for (size_t l = 0; l < tp_layout_->layers().size(); ++l) {
    const LayerSpec& layer = tp_layout_->layers()[l];
    EXPECT_EQ(completions[l], layer.kind == LayerKind::kAttention ? 0 : 1) << layer.name;
  }
  EXPECT_EQ(tp_->elements_loaded(), tp_->elements_expected());
  EXPECT_EQ(tp_->staging_bytes(), 0);
  EXPECT_TRUE(tp_->CheckTensorsComplete().ok());
}

}  // namespace
}  // namespace refit::core
