// LayerAssembler over chunks whose bytes come in several pieces (a gRPC
// message's slices): whatever the split, staging holds what one contiguous
// chunk of the same bytes gives, and the checksum covers every piece.
#include <xxhash.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/fixture_model.h"
#include "core/layer_assembler.h"
#include "core/model_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/refit_helpers.h"

namespace refit::core {
namespace {

using ::testing::HasSubstr;
using Piece = absl::Span<const uint8_t>;

std::shared_ptr<const ModelLayout> Layout(ParallelConfig parallel = {}) {
  absl::StatusOr<std::shared_ptr<const ModelLayout>> layout =
      ModelLayout::Build(FixtureConfig(), parallel, QuantScheme::kPerTensor);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return layout.ok() ? *std::move(layout) : nullptr;
}

const OwnedTensor& Find(const std::vector<OwnedTensor>& tensors, absl::string_view name) {
  for (const OwnedTensor& t : tensors) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no tensor " << name;
  return tensors.front();
}

std::string Str(const StagingBuffer& b) {
  return std::string(reinterpret_cast<const char*>(b.data()), static_cast<size_t>(b.size()));
}

// The same values in another high-precision dtype.
OwnedTensor Converted(const OwnedTensor& t, DType dtype) {
  OwnedTensor out{t.name, dtype, t.shape, {}};
  const size_t count = t.bytes.size() / DTypeSize(t.dtype);
  out.bytes.resize(count * DTypeSize(dtype));
  EXPECT_TRUE(ConvertFloats(t.bytes.data(), t.dtype, out.bytes.data(), dtype, count).ok());
  return out;
}

// The whole tensor as one chunk of contiguous bytes.
Chunk WholeChunk(const OwnedTensor& t) {
  Chunk chunk;
  chunk.name = t.name;
  chunk.dtype = t.dtype;
  chunk.shape = t.shape;
  chunk.data = t.bytes;
  return chunk;
}

// The whole tensor as one chunk whose bytes are split at `cuts` (ascending
// byte positions; repeated or boundary cuts give empty pieces).
Chunk Split(const OwnedTensor& t, const std::vector<size_t>& cuts, std::vector<Piece>* pieces) {
  pieces->clear();
  size_t at = 0;
  for (size_t cut : cuts) {
    pieces->emplace_back(t.bytes.data() + at, cut - at);
    at = cut;
  }
  pieces->emplace_back(t.bytes.data() + at, t.bytes.size() - at);
  Chunk chunk = WholeChunk(t);
  chunk.pieces = *pieces;  // `data` is ignored when there are pieces
  chunk.xxh3 = XXH3_64bits(t.bytes.data(), t.bytes.size());
  return chunk;
}

class LayerAssemblerPiecesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    layout_ = Layout();
    ASSERT_NE(layout_, nullptr);
    absl::StatusOr<std::vector<OwnedTensor>> w = MakeFixtureWeights(FixtureConfig(), 1);
    ASSERT_TRUE(w.ok()) << w.status();
    weights_ = *std::move(w);
  }

  // What one contiguous chunk of `t` stages for layer `l` of `layout`.
  std::string Staged(const ModelLayout& layout, const Chunk& chunk, int l) {
    LayerAssembler assembler(layout, {}, nullptr);
    absl::StatusOr<int> r = assembler.Ingest(chunk);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return "";
    EXPECT_EQ(*r, l);
    std::string out;
    for (const StagingBuffer& b : assembler.TakeParams(l)) out += Str(b);
    return out;
  }

  std::shared_ptr<const ModelLayout> layout_;
  std::vector<OwnedTensor> weights_;
};

TEST_F(LayerAssemblerPiecesTest, ElementSplitAtEveryPositionStagesAsOneChunk) {
  const OwnedTensor& norm = Find(weights_, "model.layers.0.input_layernorm.weight");
  const int l = layout_->FindLayer("model.layers.0.input_layernorm");
  ASSERT_GE(l, 0);
  for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    const OwnedTensor t = Converted(norm, dtype);
    const std::string expected = Staged(*layout_, WholeChunk(t), l);
    ASSERT_FALSE(expected.empty());
    std::vector<Piece> pieces;
    // Two pieces, cut at every byte; three pieces, the middle one shorter
    // than an element (an element spread over three pieces).
    for (size_t cut = 0; cut <= t.bytes.size(); ++cut) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " cut at ", cut));
      EXPECT_EQ(Staged(*layout_, Split(t, {cut}, &pieces), l), expected);
      if (cut + 1 < t.bytes.size()) {
        EXPECT_EQ(Staged(*layout_, Split(t, {cut, cut + 1}, &pieces), l), expected);
      }
    }
    // Every byte its own piece, and empty pieces between.
    std::vector<size_t> every;
    for (size_t i = 1; i < t.bytes.size(); ++i) every.push_back(i);
    EXPECT_EQ(Staged(*layout_, Split(t, every, &pieces), l), expected) << DTypeName(dtype);
    EXPECT_EQ(Staged(*layout_, Split(t, {0, 0, 6, 6, 6, t.bytes.size()}, &pieces), l), expected)
        << DTypeName(dtype);
  }
}

TEST_F(LayerAssemblerPiecesTest, ChecksumCoversEveryPiece) {
  const OwnedTensor t = Converted(Find(weights_, "model.norm.weight"), DType::kFloat32);
  std::vector<Piece> pieces;
  Chunk bad = Split(t, {3, 100, 101, 257}, &pieces);
  bad.xxh3 = *bad.xxh3 ^ 0x10;
  LayerAssembler assembler(*layout_, {}, nullptr);
  absl::StatusOr<int> r = assembler.Ingest(bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(r.status().message(), HasSubstr("model.norm.weight"));
  EXPECT_THAT(r.status().message(), HasSubstr(absl::StrCat("checksum mismatch in chunk bytes [0, ",
                                                           t.bytes.size(), ")")));

  LayerAssembler fresh(*layout_, {}, nullptr);
  absl::StatusOr<int> good = fresh.Ingest(Split(t, {3, 100, 101, 257}, &pieces));
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(*good, layout_->FindLayer("model.norm"));
}

TEST_F(LayerAssemblerPiecesTest, SizeIsTheSumOfThePiecesForAlignmentAndRanges) {
  const OwnedTensor& norm = Find(weights_, "model.norm.weight");
  const std::vector<Piece> odd = {Piece(norm.bytes.data(), 3), Piece(norm.bytes.data() + 3, 2)};
  Chunk chunk;
  chunk.name = norm.name;
  chunk.dtype = norm.dtype;
  chunk.shape = norm.shape;
  chunk.pieces = odd;
  EXPECT_EQ(chunk.size(), 5u);
  LayerAssembler assembler(*layout_, {}, nullptr);
  absl::StatusOr<int> r = assembler.Ingest(chunk);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("chunk at byte 0 of 5 bytes is not aligned"));

  const std::vector<Piece> even = {Piece(norm.bytes.data(), 3), Piece(norm.bytes.data() + 3, 5)};
  chunk.pieces = even;
  ASSERT_TRUE(assembler.Ingest(chunk).ok());
  EXPECT_EQ(assembler.bytes_received(), 8);
  EXPECT_EQ(assembler.elements_loaded(), 4);
}

TEST_F(LayerAssemblerPiecesTest, TensorParallelSlicesAcrossPieces) {
  const std::shared_ptr<const ModelLayout> tp = Layout({/*tp_rank=*/1, /*tp_size=*/2});
  ASSERT_NE(tp, nullptr);
  // Row-parallel o_proj and down_proj (this rank's columns of every row)
  // and the vocabulary-parallel lm_head (this rank's rows, padding rows
  // zero), in every input dtype, cut into pieces of random odd sizes.
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"model.layers.1.self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj"},
      {"model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj"},
      {"lm_head.weight", "lm_head"}};
  std::mt19937_64 rng(7);
  for (const auto& [name, layer] : cases) {
    const int l = tp->FindLayer(layer);
    ASSERT_GE(l, 0) << layer;
    for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
      SCOPED_TRACE(absl::StrCat(name, " ", DTypeName(dtype)));
      const OwnedTensor t = Converted(Find(weights_, name), dtype);
      const std::string expected = Staged(*tp, WholeChunk(t), l);
      ASSERT_FALSE(expected.empty());
      std::vector<size_t> cuts;
      for (size_t at = 0;;) {
        at += 1 + 2 * (rng() % 700);  // odd: most cuts fall inside an element
        if (at >= t.bytes.size()) break;
        cuts.push_back(at);
      }
      std::vector<Piece> pieces;
      EXPECT_EQ(Staged(*tp, Split(t, cuts, &pieces), l), expected);
    }
  }
}

}  // namespace
}  // namespace refit::core
