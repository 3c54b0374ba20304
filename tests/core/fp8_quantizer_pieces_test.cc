// QuantizeFp8Pieces: a matrix given as pieces laid end to end (rows read in
// place from a trainer's region, the rest from staging) quantizes to exactly
// the bytes and scales of the contiguous matrix, for every scheme, source
// dtype and split; a non-finite value is named by its index in the whole
// matrix; pieces that are not whole elements or do not add up are refused.
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "core/dtype.h"
#include "core/fp8_quantizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::core {
namespace {

using ::testing::HasSubstr;
using Piece = absl::Span<const uint8_t>;

struct Quantized {
  absl::Status status;
  std::vector<uint8_t> q;
  std::vector<float> scales;
};

// `rows` x `cols` random values of `dtype` (normal, a few large ones).
std::vector<uint8_t> RandomMatrix(DType dtype, int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> values(static_cast<size_t>(rows * cols));
  for (float& v : values) v = normal(rng) * ((rng() % 97 == 0) ? 50.0f : 1.0f);
  std::vector<uint8_t> out(values.size() * DTypeSize(dtype));
  EXPECT_TRUE(ConvertFloats(reinterpret_cast<const uint8_t*>(values.data()), DType::kFloat32,
                            out.data(), dtype, values.size())
                  .ok());
  return out;
}

// Quantizes `pieces` with QuantizeFp8Pieces, or, for the reference
// (`contiguous`, one piece), with QuantizeFp8.
Quantized Quantize(absl::Span<const Piece> pieces, bool contiguous, DType dtype, int64_t rows,
                   int64_t cols, QuantScheme scheme, NonFinitePolicy policy) {
  Quantized out;
  out.q.assign(static_cast<size_t>(rows * cols), 0xAA);
  out.scales.assign(static_cast<size_t>(Fp8NumScales(scheme, rows, cols)), -1.0f);
  Fp8QuantizeOptions options;
  options.scheme = scheme;
  options.non_finite = policy;
  options.num_threads = 2;
  const absl::string_view name = "model.layers.3.mlp.gate_up_proj.weight";
  out.status = contiguous ? QuantizeFp8(pieces[0].data(), dtype, rows, cols, options, out.q.data(),
                                        out.scales.data(), name)
                          : QuantizeFp8Pieces(pieces, dtype, rows, cols, options, out.q.data(),
                                              out.scales.data(), name);
  return out;
}

Quantized QuantizeInPieces(absl::Span<const Piece> pieces, DType dtype, int64_t rows, int64_t cols,
                           QuantScheme scheme, NonFinitePolicy policy = NonFinitePolicy::kReject) {
  return Quantize(pieces, /*contiguous=*/false, dtype, rows, cols, scheme, policy);
}

Quantized Contiguous(const std::vector<uint8_t>& bytes, DType dtype, int64_t rows, int64_t cols,
                     QuantScheme scheme, NonFinitePolicy policy = NonFinitePolicy::kReject) {
  const Piece whole[] = {Piece(bytes.data(), bytes.size())};
  return Quantize(whole, /*contiguous=*/true, dtype, rows, cols, scheme, policy);
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void ExpectSameOutput(const Quantized& got, const Quantized& expected) {
  ASSERT_TRUE(got.status.ok()) << got.status;
  EXPECT_EQ(got.q, expected.q);
  EXPECT_TRUE(SameBits(got.scales, expected.scales));
}

// `bytes` cut at the element positions `cuts` (ascending).
std::vector<Piece> Cut(const std::vector<uint8_t>& bytes, DType dtype,
                       const std::vector<int64_t>& cuts) {
  std::vector<Piece> pieces;
  const size_t esize = DTypeSize(dtype);
  size_t at = 0;
  for (int64_t cut : cuts) {
    pieces.emplace_back(bytes.data() + at, static_cast<size_t>(cut) * esize - at);
    at = static_cast<size_t>(cut) * esize;
  }
  pieces.emplace_back(bytes.data() + at, bytes.size() - at);
  return pieces;
}

TEST(Fp8QuantizerPiecesTest, EverySplitGivesTheBytesAndScalesOfTheContiguousMatrix) {
  // 300 rows: block bands of 128, 128 and 44; 200 columns: a cropped block.
  const int64_t rows = 300;
  const int64_t cols = 200;
  std::mt19937_64 rng(11);
  for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    const std::vector<uint8_t> bytes = RandomMatrix(dtype, rows, cols, 5);
    for (QuantScheme scheme :
         {QuantScheme::kPerTensor, QuantScheme::kPerChannel, QuantScheme::kBlock128}) {
      const Quantized expected = Contiguous(bytes, dtype, rows, cols, scheme);
      ASSERT_TRUE(expected.status.ok()) << expected.status;
      std::vector<int64_t> random;
      for (int64_t at = 0;;) {
        at += 1 + static_cast<int64_t>(rng() % 9000);
        if (at >= rows * cols) break;
        random.push_back(at);
      }
      const std::vector<std::pair<std::string, std::vector<int64_t>>> splits = {
          {"fused q/k/v rows", {128 * cols, 256 * cols}},  // band-aligned
          {"whole rows", {7 * cols, 100 * cols, 101 * cols}},
          {"inside rows", {1, 333, 128 * cols + 5}},
          {"random", random},
          {"empty pieces", {0, 0, 50 * cols, 50 * cols, rows * cols}},
      };
      for (const auto& [what, cuts] : splits) {
        SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " ", QuantSchemeName(scheme), " ", what));
        ExpectSameOutput(QuantizeInPieces(Cut(bytes, dtype, cuts), dtype, rows, cols, scheme),
                         expected);
      }
    }
  }
}

TEST(Fp8QuantizerPiecesTest, NonFiniteValueIsNamedByItsIndexInTheWholeMatrix) {
  const int64_t rows = 256;
  const int64_t cols = 64;
  std::vector<uint8_t> bytes = RandomMatrix(DType::kBFloat16, rows, cols, 3);
  const int64_t bad = 200 * cols + 9;  // in the third piece
  const uint16_t inf = 0x7F80;
  std::memcpy(bytes.data() + bad * 2, &inf, 2);
  const std::vector<Piece> pieces = Cut(bytes, DType::kBFloat16, {128 * cols, 160 * cols});
  for (QuantScheme scheme :
       {QuantScheme::kPerTensor, QuantScheme::kPerChannel, QuantScheme::kBlock128}) {
    SCOPED_TRACE(QuantSchemeName(scheme));
    const Quantized got = QuantizeInPieces(pieces, DType::kBFloat16, rows, cols, scheme);
    EXPECT_EQ(got.status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(got.status.message(),
                HasSubstr(absl::StrCat("tensor 'model.layers.3.mlp.gate_up_proj.weight': element ",
                                       bad, " (row 200, col 9) is inf")));
    // Under the vLLM-compatible policy the same bytes as contiguous.
    ExpectSameOutput(
        QuantizeInPieces(pieces, DType::kBFloat16, rows, cols, scheme,
                         NonFinitePolicy::kVllmCompatible),
        Contiguous(bytes, DType::kBFloat16, rows, cols, scheme, NonFinitePolicy::kVllmCompatible));
  }
}

TEST(Fp8QuantizerPiecesTest, PiecesThatAreNotWholeElementsOrDoNotAddUpAreInvalidArgument) {
  const int64_t rows = 4;
  const int64_t cols = 8;
  const std::vector<uint8_t> bytes = RandomMatrix(DType::kBFloat16, rows, cols, 1);
  const std::vector<Piece> odd = {Piece(bytes.data(), 3), Piece(bytes.data() + 3, 61)};
  Quantized got = QuantizeInPieces(odd, DType::kBFloat16, rows, cols, QuantScheme::kPerTensor);
  EXPECT_EQ(got.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.status.message(),
              HasSubstr("a source piece of 3 bytes at byte 0 is not whole BF16 elements"));

  const std::vector<Piece> short_pieces = {Piece(bytes.data(), 32), Piece(bytes.data() + 32, 30)};
  got = QuantizeInPieces(short_pieces, DType::kBFloat16, rows, cols, QuantScheme::kPerChannel);
  EXPECT_EQ(got.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.status.message(), HasSubstr("source pieces of 62 bytes for [4, 8] of BF16 (64 "
                                              "bytes)"));

  got = QuantizeInPieces({}, DType::kBFloat16, rows, cols, QuantScheme::kPerTensor);
  EXPECT_EQ(got.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.status.message(), HasSubstr("null buffer"));
}

}  // namespace
}  // namespace refit::core
