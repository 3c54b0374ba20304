#include "core/fp8_quantizer.h"

#include <ATen/ATen.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "core/fp8_quantizer_internal.h"
#include "core/layer_processor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/fp8_isa.h"

namespace refit::core {
namespace {

using internal::Fp8Isa;
using ::testing::HasSubstr;

constexpr uint32_t kF32Bits448 = 0x43E00000;

float FloatOf(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
uint32_t BitsOf(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

std::string Hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

using ::refit::testing::ScopedFp8Isa;
using ::refit::testing::SupportedFp8Isas;

DType OurType(at::ScalarType type) {
  switch (type) {
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      return DType::kFloat32;
  }
}

// torch's own conversion of float32 values, as bytes.
std::vector<uint8_t> TorchToFp8(const std::vector<float>& values) {
  at::Tensor x = at::from_blob(const_cast<float*>(values.data()),
                               {static_cast<int64_t>(values.size())}, at::kFloat);
  at::Tensor q = x.to(at::kFloat8_e4m3fn).view(at::kByte).contiguous();
  const uint8_t* p = q.data_ptr<uint8_t>();
  return std::vector<uint8_t>(p, p + values.size());
}

// Compares Fp8E4M3FromFloat with torch on `values`; reports the first few
// mismatches with their bit patterns.
void ExpectScalarMatchesTorch(const std::vector<float>& values) {
  const std::vector<uint8_t> expected = TorchToFp8(values);
  int reported = 0;
  int64_t mismatches = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const uint8_t ours = Fp8E4M3FromFloat(values[i]);
    if (ours != expected[i]) {
      ++mismatches;
      if (reported++ < 5) {
        ADD_FAILURE() << "value " << values[i] << " (" << Hex(BitsOf(values[i])) << "): ours 0x"
                      << std::hex << int{ours} << ", torch 0x" << int{expected[i]};
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << values.size();
}

struct Quantized {
  absl::Status status;
  std::vector<uint8_t> q;
  std::vector<float> scales;
};

Quantized RunOurs(const at::Tensor& x, QuantScheme scheme,
                  NonFinitePolicy policy = NonFinitePolicy::kReject, int threads = 0,
                  absl::string_view name = "w") {
  at::Tensor c = x.contiguous();
  const int64_t rows = c.size(0);
  const int64_t cols = c.size(1);
  Quantized out;
  out.q.assign(rows * cols, 0xAB);  // poison: every byte must be written
  out.scales.assign(Fp8NumScales(scheme, rows, cols), -1.0f);
  Fp8QuantizeOptions options;
  options.scheme = scheme;
  options.non_finite = policy;
  options.num_threads = threads;
  out.status = QuantizeFp8(c.data_ptr(), OurType(c.scalar_type()), rows, cols, options,
                           out.q.data(), out.scales.data(), name);
  return out;
}

// The LibTorch op chain for the same math (fp8_quantizer.h).
Quantized TorchReference(const at::Tensor& x, QuantScheme scheme) {
  const int64_t rows = x.size(0);
  const int64_t cols = x.size(1);
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor s;
  at::Tensor inv_full;
  if (scheme == QuantScheme::kBlock128) {
    const int64_t br = (rows + 127) / 128;
    const int64_t bc = (cols + 127) / 128;
    at::Tensor padded = at::constant_pad_nd(xf, {0, bc * 128 - cols, 0, br * 128 - rows}, 0);
    at::Tensor amax = padded.abs().reshape({br, 128, bc, 128}).amax({1, 3});
    s = amax.clamp_min(kFp8BlockAmaxFloor) / 448.0;
    at::Tensor inv = s.reciprocal();
    inv_full =
        inv.repeat_interleave(128, 0).repeat_interleave(128, 1).slice(0, 0, rows).slice(1, 0, cols);
  } else {
    at::Tensor amax = scheme == QuantScheme::kPerTensor ? xf.abs().amax().reshape({1, 1})
                                                        : xf.abs().amax({1}, true);
    s = amax / 448.0;
    inv_full = at::where(s == 0, at::zeros_like(s), s.reciprocal());
  }
  at::Tensor q = (xf * inv_full).clamp(-448, 448).to(at::kFloat8_e4m3fn).view(at::kByte);
  q = q.contiguous();
  s = s.contiguous();
  Quantized out;
  out.q.assign(q.data_ptr<uint8_t>(), q.data_ptr<uint8_t>() + rows * cols);
  out.scales.assign(s.data_ptr<float>(), s.data_ptr<float>() + s.numel());
  return out;
}

void ExpectSameBytes(const std::vector<uint8_t>& ours, const std::vector<uint8_t>& expected,
                     int64_t cols) {
  ASSERT_EQ(ours.size(), expected.size());
  int64_t mismatches = 0;
  for (size_t i = 0; i < ours.size(); ++i) {
    if (ours[i] != expected[i] && mismatches++ < 5) {
      ADD_FAILURE() << "byte " << i << " (row " << i / cols << ", col " << i % cols << "): ours 0x"
                    << std::hex << int{ours[i]} << ", expected 0x" << int{expected[i]};
    }
  }
  EXPECT_EQ(mismatches, 0);
}

void ExpectSameScales(const std::vector<float>& ours, const std::vector<float>& expected) {
  ASSERT_EQ(ours.size(), expected.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    ASSERT_EQ(BitsOf(ours[i]), BitsOf(expected[i]))
        << "scale " << i << ": ours " << ours[i] << ", expected " << expected[i];
  }
}

// Random weights with structure: rows of very different magnitude (so that
// per-channel and block scales differ), exact zeros, and elements far below
// the row max (so that some land in the e4m3 subnormal range).
at::Tensor RandomWeights(int64_t rows, int64_t cols, at::ScalarType type, uint64_t seed) {
  at::manual_seed(seed);
  at::Tensor x = at::randn({rows, cols}, at::kFloat);
  at::Tensor row_scale = at::exp(at::randn({rows, 1}, at::kFloat) * 3);
  at::Tensor tiny = at::rand({rows, cols}) < 0.1;
  x = at::where(tiny, x * 1e-4, x) * row_scale;
  x = at::where(at::rand({rows, cols}) < 0.02, at::zeros_like(x), x);
  return x.to(type);
}

constexpr QuantScheme kSchemes[] = {QuantScheme::kPerTensor, QuantScheme::kPerChannel,
                                    QuantScheme::kBlock128};
constexpr at::ScalarType kTypes[] = {at::kBFloat16, at::kHalf, at::kFloat};

// --- Scalar conversion -------------------------------------------------------

TEST(Fp8QuantizerTest, FromFloatMatchesLibTorchOnAllBf16Values) {
  std::vector<float> values;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float v = FloatOf(h << 16);
    if (std::isnan(v) || std::fabs(v) <= 448.0f) values.push_back(v);
  }
  ExpectScalarMatchesTorch(values);
}

TEST(Fp8QuantizerTest, FromFloatMatchesLibTorchOnAllFp16Values) {
  std::vector<float> values;
  at::Tensor all = at::arange(0, 0x10000, at::kInt).to(at::kShort).view(at::kHalf).to(at::kFloat);
  for (int64_t i = 0; i < all.numel(); ++i) {
    const float v = all.data_ptr<float>()[i];
    if (std::isnan(v) || std::fabs(v) <= 448.0f) values.push_back(v);
  }
  ASSERT_EQ(values.size(), 50688u);  // 2 * (23 * 1024 + 0x301) finite + 2 * 1023 NaN
  ExpectScalarMatchesTorch(values);
}

// Uniform over bit patterns, so every binade (subnormal f32 included) is hit
// about equally often.
std::vector<float> RandomFloat32InRange(int64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<uint32_t> abs_bits(0, kF32Bits448);
  std::vector<float> values(count);
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t sign = static_cast<uint32_t>(rng() & 1) << 31;
    values[i] = FloatOf(abs_bits(rng) | sign);
  }
  return values;
}

TEST(Fp8QuantizerTest, FromFloatMatchesLibTorchOnRandomFloat32InRange) {
  ExpectScalarMatchesTorch(RandomFloat32InRange(20'000'000, 42));
}

// Every e4m3 value and every midpoint between neighbours, +-4 ulp, both signs:
// where round-to-nearest-even can go wrong.
std::vector<float> RoundingBoundaryValues() {
  std::vector<float> anchors;
  for (int code = 0; code <= 0x7E; ++code) {
    const float v = Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    anchors.push_back(v);
    if (code < 0x7E) anchors.push_back((v + Fp8E4M3ToFloat(static_cast<uint8_t>(code + 1))) / 2);
  }
  anchors.push_back(0x1p-10f);  // half the smallest subnormal: ties to 0
  std::vector<float> values;
  for (float anchor : anchors) {
    const int64_t bits = BitsOf(anchor);
    for (int64_t d = -4; d <= 4; ++d) {
      const int64_t b = bits + d;
      if (b < 0 || b > kF32Bits448) continue;
      values.push_back(FloatOf(static_cast<uint32_t>(b)));
      values.push_back(-FloatOf(static_cast<uint32_t>(b)));
    }
  }
  return values;
}

TEST(Fp8QuantizerTest, FromFloatMatchesLibTorchAroundEveryRoundingBoundary) {
  const std::vector<float> values = RoundingBoundaryValues();
  ASSERT_GT(values.size(), 4000u);
  ExpectScalarMatchesTorch(values);
  // Spot checks that do not depend on torch.
  EXPECT_EQ(Fp8E4M3FromFloat(0x1p-10f), 0x00);       // tie -> even (0)
  EXPECT_EQ(Fp8E4M3FromFloat(3 * 0x1p-10f), 0x02);   // tie -> even (2 * 2^-9)
  EXPECT_EQ(Fp8E4M3FromFloat(0x1p-9f), 0x01);        // smallest subnormal
  EXPECT_EQ(Fp8E4M3FromFloat(0x1p-6f), 0x08);        // smallest normal
  EXPECT_EQ(Fp8E4M3FromFloat(15 * 0x1p-10f), 0x08);  // 7.5 * 2^-9: tie -> 8 (normal)
  EXPECT_EQ(Fp8E4M3FromFloat(1.0625f), 0x38);        // 1 + 1/16: tie -> 1.0
  EXPECT_EQ(Fp8E4M3FromFloat(1.1875f), 0x3A);        // 1 + 3/16: tie -> 1.25
  EXPECT_EQ(Fp8E4M3FromFloat(-432.0f), 0xFE);        // tie between 416 and 448 -> 448
}

// All 2^31 + 2^30 + ... float32 patterns within [-448, 448] (2 * 0x43E00001),
// through the scalar encoder and through QuantizeFp8's vector kernels (every
// ISA this CPU runs; 448 appended so that s = 1 and QuantizeFp8 is a plain
// conversion). 10-20 s on 2 cores, too slow for every run: run it by hand with
// --gtest_also_run_disabled_tests after touching the encoder or the kernels.
TEST(Fp8QuantizerTest, DISABLED_FromFloatAndKernelsMatchLibTorchOnEveryFloat32InRange) {
  constexpr uint32_t kChunk = 1u << 24;
  std::vector<float> values(kChunk + 1);
  std::vector<uint8_t> kernel_out(kChunk + 1);
  float scale = 0;
  int64_t checked = 0;
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (uint64_t begin = 0; begin <= kF32Bits448; begin += kChunk) {
      const uint64_t end = std::min<uint64_t>(begin + kChunk, uint64_t{kF32Bits448} + 1);
      const int64_t count = static_cast<int64_t>(end - begin);
      values.resize(count);
      for (uint64_t b = begin; b < end; ++b) {
        values[b - begin] = FloatOf(static_cast<uint32_t>(b) | sign);
      }
      const std::vector<uint8_t> expected = TorchToFp8(values);
      int64_t mismatches = 0;
      for (int64_t i = 0; i < count; ++i) {
        if (Fp8E4M3FromFloat(values[i]) != expected[i] && mismatches++ < 5) {
          ADD_FAILURE() << "scalar: " << Hex(BitsOf(values[i])) << " -> 0x" << std::hex
                        << int{Fp8E4M3FromFloat(values[i])} << ", torch 0x" << int{expected[i]};
        }
      }
      values.push_back(448.0f);
      for (Fp8Isa isa : SupportedFp8Isas()) {
        ScopedFp8Isa scoped(isa);
        ASSERT_TRUE(QuantizeFp8(values.data(), DType::kFloat32, 1, count + 1, Fp8QuantizeOptions{},
                                kernel_out.data(), &scale, "all")
                        .ok());
        ASSERT_EQ(scale, 1.0f);
        for (int64_t i = 0; i < count; ++i) {
          if (kernel_out[i] != expected[i] && mismatches++ < 5) {
            ADD_FAILURE() << internal::Fp8IsaName(isa) << ": " << Hex(BitsOf(values[i])) << " -> 0x"
                          << std::hex << int{kernel_out[i]} << ", torch 0x" << int{expected[i]};
          }
        }
      }
      ASSERT_EQ(mismatches, 0) << "chunk " << Hex(static_cast<uint32_t>(begin) | sign);
      checked += count;
    }
  }
  EXPECT_EQ(checked, 2 * (int64_t{kF32Bits448} + 1));
}

TEST(Fp8QuantizerTest, FromFloatSaturatesAndKeepsNanSign) {
  EXPECT_EQ(Fp8E4M3FromFloat(448.0f), 0x7E);
  EXPECT_EQ(Fp8E4M3FromFloat(-448.0f), 0xFE);
  EXPECT_EQ(Fp8E4M3FromFloat(464.0f), 0x7E);  // would round up to the NaN code
  EXPECT_EQ(Fp8E4M3FromFloat(1e30f), 0x7E);
  EXPECT_EQ(Fp8E4M3FromFloat(-1e30f), 0xFE);
  EXPECT_EQ(Fp8E4M3FromFloat(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(Fp8E4M3FromFloat(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(Fp8E4M3FromFloat(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(Fp8E4M3FromFloat(-std::numeric_limits<float>::quiet_NaN()), 0xFF);
  EXPECT_EQ(Fp8E4M3FromFloat(FloatOf(0x7F800001)), 0x7F);  // signalling NaN
  EXPECT_EQ(Fp8E4M3FromFloat(-0.0f), 0x80);
  // NaN with its sign, as torch does it.
  const std::vector<float> nans = {std::numeric_limits<float>::quiet_NaN(),
                                   -std::numeric_limits<float>::quiet_NaN()};
  EXPECT_EQ(TorchToFp8(nans), (std::vector<uint8_t>{0x7F, 0xFF}));
}

TEST(Fp8QuantizerTest, ToFloatMatchesLibTorchOnAll256Codes) {
  at::Tensor codes = at::arange(0, 256, at::kInt).to(at::kByte);
  at::Tensor expected = codes.view(at::kFloat8_e4m3fn).to(at::kFloat).contiguous();
  for (int code = 0; code < 256; ++code) {
    const float ours = Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    const float theirs = expected.data_ptr<float>()[code];
    if (std::isnan(theirs)) {
      EXPECT_TRUE(std::isnan(ours)) << "code " << code;
      EXPECT_EQ(std::signbit(ours), code >= 0x80) << "code " << code;
    } else {
      EXPECT_EQ(BitsOf(ours), BitsOf(theirs))
          << "code " << code << ": ours " << ours << ", torch " << theirs;
    }
  }
  EXPECT_EQ(Fp8E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), 0x1p-9f);
  // Round trip for every non-NaN code.
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;
    EXPECT_EQ(Fp8E4M3FromFloat(Fp8E4M3ToFloat(static_cast<uint8_t>(code))), code);
  }
}

// --- Vector kernels as plain converters --------------------------------------
// A tensor whose amax is 448 has s = 1 and inv = 1, so QuantizeFp8 is then a
// pure conversion: that exposes each ISA's encoder to the same exhaustive
// checks as the scalar one.

void ExpectKernelsConvertLikeTorch(const at::Tensor& values /* 1-D, incl. 448 */) {
  const at::Tensor row = values.reshape({1, values.numel()});
  const std::vector<uint8_t> expected = [&] {
    at::Tensor q = row.to(at::kFloat).to(at::kFloat8_e4m3fn).view(at::kByte).contiguous();
    return std::vector<uint8_t>(q.data_ptr<uint8_t>(), q.data_ptr<uint8_t>() + q.numel());
  }();
  for (Fp8Isa isa : SupportedFp8Isas()) {
    SCOPED_TRACE(std::string(internal::Fp8IsaName(isa)));
    ScopedFp8Isa scoped(isa);
    const Quantized ours = RunOurs(row, QuantScheme::kPerTensor);
    ASSERT_TRUE(ours.status.ok()) << ours.status;
    ASSERT_EQ(ours.scales[0], 1.0f);
    ExpectSameBytes(ours.q, expected, row.size(1));
  }
}

TEST(Fp8QuantizerTest, KernelsConvertLikeLibTorchOnAllBf16AndFp16Values) {
  for (at::ScalarType type : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(std::string(c10::toString(type)));
    at::Tensor all = at::arange(0, 0x10000, at::kInt).to(at::kShort).view(type);
    at::Tensor f = all.to(at::kFloat);
    at::Tensor in_range = all.masked_select(f.abs() <= 448);
    ExpectKernelsConvertLikeTorch(in_range);
  }
}

TEST(Fp8QuantizerTest, KernelsConvertLikeLibTorchOnFloat32Boundaries) {
  std::vector<float> values = RoundingBoundaryValues();
  const std::vector<float> random = RandomFloat32InRange(1'000'000, 7);
  values.insert(values.end(), random.begin(), random.end());
  values.push_back(448.0f);
  ExpectKernelsConvertLikeTorch(
      at::from_blob(values.data(), {static_cast<int64_t>(values.size())}, at::kFloat).clone());
}

// --- QuantizeFp8 against the LibTorch op chain -------------------------------

TEST(Fp8QuantizerTest, MatchesLibTorchOpChainOnOddShapesForAllSchemesAndTypes) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 1}, {3, 5}, {129, 257}, {300, 1000}, {1000, 7}, {128, 128}, {17, 4099}};
  uint64_t seed = 1;
  for (const auto& [rows, cols] : shapes) {
    for (at::ScalarType type : kTypes) {
      const at::Tensor x = RandomWeights(rows, cols, type, seed++);
      for (QuantScheme scheme : kSchemes) {
        SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " " << c10::toString(type)
                                          << " scheme " << static_cast<int>(scheme));
        const Quantized expected = TorchReference(x, scheme);
        for (Fp8Isa isa : SupportedFp8Isas()) {
          SCOPED_TRACE(std::string(internal::Fp8IsaName(isa)));
          ScopedFp8Isa scoped(isa);
          for (NonFinitePolicy policy :
               {NonFinitePolicy::kReject, NonFinitePolicy::kVllmCompatible}) {
            const Quantized ours = RunOurs(x, scheme, policy, /*threads=*/3);
            ASSERT_TRUE(ours.status.ok()) << ours.status;
            ExpectSameScales(ours.scales, expected.scales);
            ExpectSameBytes(ours.q, expected.q, cols);
            if (HasFailure()) return;
          }
        }
      }
    }
  }
}

TEST(Fp8QuantizerTest, ResultDoesNotDependOnThreadCount) {
  // Big enough that several workers get a share in every scheme.
  const at::Tensor x = RandomWeights(1200, 1500, at::kBFloat16, 99);
  for (QuantScheme scheme : kSchemes) {
    SCOPED_TRACE(static_cast<int>(scheme));
    const Quantized expected = TorchReference(x, scheme);
    for (int threads : {1, 2, 4, 7, 0}) {
      const Quantized ours = RunOurs(x, scheme, NonFinitePolicy::kReject, threads);
      ASSERT_TRUE(ours.status.ok()) << ours.status;
      ExpectSameScales(ours.scales, expected.scales);
      ExpectSameBytes(ours.q, expected.q, x.size(1));
    }
  }
}

// Calls from several threads at once: one holds the quantizer's helper
// threads, the others start threads of their own, and every call still gets
// exactly its own bytes, call after call (the helpers are reused).
TEST(Fp8QuantizerTest, ConcurrentCallsEachGetTheirOwnBytes) {
  constexpr int kCallers = 4;
  std::vector<at::Tensor> inputs;
  std::vector<Quantized> expected;
  for (int c = 0; c < kCallers; ++c) {
    inputs.push_back(RandomWeights(700 + 13 * c, 1100, at::kBFloat16, 500 + c));
    expected.push_back(TorchReference(inputs.back(), QuantScheme::kPerTensor));
  }
  std::vector<std::vector<Quantized>> results(kCallers);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int round = 0; round < 20; ++round) {
        for (QuantScheme scheme : kSchemes) {
          Quantized q = RunOurs(inputs[c], scheme, NonFinitePolicy::kReject, 3);
          if (scheme == QuantScheme::kPerTensor) results[c].push_back(std::move(q));
        }
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) {
    SCOPED_TRACE(c);
    ASSERT_EQ(results[c].size(), 20u);
    for (const Quantized& q : results[c]) {
      ASSERT_TRUE(q.status.ok()) << q.status;
      ExpectSameScales(q.scales, expected[c].scales);
      ExpectSameBytes(q.q, expected[c].q, inputs[c].size(1));
    }
  }
}

// Outputs of 16 MiB and more are written with non-temporal stores where the
// destination is 16-byte aligned; odd widths give rows of every alignment,
// and an output offset by one byte forces the fallback throughout.
TEST(Fp8QuantizerTest, LargeOutputsTakeTheStreamingPathWithSameBytes) {
  const int64_t rows = 4097;
  const int64_t cols = 4099;  // rows * cols > 16 Mi
  const at::Tensor x = RandomWeights(rows, cols, at::kBFloat16, 123);
  for (QuantScheme scheme : kSchemes) {
    SCOPED_TRACE(static_cast<int>(scheme));
    const Quantized expected = TorchReference(x, scheme);
    const Quantized ours = RunOurs(x, scheme, NonFinitePolicy::kReject, 2);
    ASSERT_TRUE(ours.status.ok()) << ours.status;
    ExpectSameScales(ours.scales, expected.scales);
    ExpectSameBytes(ours.q, expected.q, cols);
    if (scheme == QuantScheme::kPerTensor) {
      std::vector<uint8_t> shifted(rows * cols + 1, 0xAB);
      std::vector<float> scale(1);
      Fp8QuantizeOptions options;
      ASSERT_TRUE(QuantizeFp8(x.data_ptr(), DType::kBFloat16, rows, cols, options,
                              shifted.data() + 1, scale.data(), "w")
                      .ok());
      ExpectSameBytes(std::vector<uint8_t>(shifted.begin() + 1, shifted.end()), expected.q, cols);
    }
  }
}

// --- Scale hint (per-tensor: one pass when the scale comes out as hinted) ---

struct Hinted {
  Quantized out;
  bool one_pass = false;
};

// The bytes of contiguous `c` as two pieces: its first `split` elements,
// then the rest.
std::array<absl::Span<const uint8_t>, 2> TwoPieces(const at::Tensor& c, int64_t split) {
  const auto* bytes = static_cast<const uint8_t*>(c.data_ptr());
  const size_t esize = c.element_size();
  const size_t total = static_cast<size_t>(c.numel()) * esize;
  return {absl::Span<const uint8_t>(bytes, split * esize),
          absl::Span<const uint8_t>(bytes + split * esize, total - split * esize)};
}

// Per-tensor quantization of `x` with `hint`, as one buffer or, with
// `split`, as two pieces (the first `split` elements, then the rest).
Hinted RunHinted(const at::Tensor& x, float hint, NonFinitePolicy policy, int threads,
                 int64_t split = 0) {
  at::Tensor c = x.contiguous();
  const int64_t rows = c.size(0);
  const int64_t cols = c.size(1);
  Hinted h;
  h.out.q.assign(rows * cols, 0xAB);  // poison: every byte must be written
  h.out.scales.assign(1, -1.0f);
  Fp8QuantizeStats stats;
  stats.one_pass = true;  // must be reset by the call
  Fp8QuantizeOptions options;
  options.non_finite = policy;
  options.num_threads = threads;
  options.scale_hint = hint;
  options.stats = &stats;
  const DType dtype = OurType(c.scalar_type());
  if (split > 0) {
    const std::array<absl::Span<const uint8_t>, 2> pieces = TwoPieces(c, split);
    h.out.status = QuantizeFp8Pieces(pieces, dtype, rows, cols, options, h.out.q.data(),
                                     h.out.scales.data(), "w");
  } else {
    h.out.status = QuantizeFp8(c.data_ptr(), dtype, rows, cols, options, h.out.q.data(),
                               h.out.scales.data(), "w");
  }
  h.one_pass = stats.one_pass;
  return h;
}

TEST(Fp8QuantizerTest, AScaleHintGivesTheSameBytesWhetherItHoldsOrNot) {
  const float inf = std::numeric_limits<float>::infinity();
  for (at::ScalarType type : kTypes) {
    // Odd sizes: vector tails, and ranges that split unevenly.
    const at::Tensor x = RandomWeights(613, 1031, type, 71);
    const Quantized expected = TorchReference(x, QuantScheme::kPerTensor);
    const float s = expected.scales[0];
    const struct {
      float hint;
      bool one_pass;
    } cases[] = {
        {s, true},
        {std::nextafter(s, inf), false},  // the amax of a tensor whose max moved
        {std::nextafter(s, 0.0f), false},
        {s * 2, false},
        {s / 2, false},
        {0.0f, false},
        {-s, false},
        {inf, false},
        {std::numeric_limits<float>::quiet_NaN(), false},
        {1e-45f, false},  // its inverse overflows: never tried
    };
    for (Fp8Isa isa : SupportedFp8Isas()) {
      ScopedFp8Isa scoped(isa);
      for (const auto& c : cases) {
        for (int threads : {1, 3}) {
          for (int64_t split : {int64_t{0}, int64_t{613 * 1031 / 3 + 5}}) {
            SCOPED_TRACE(absl::StrCat(internal::Fp8IsaName(isa), " type ", static_cast<int>(type),
                                      " hint ", c.hint, " threads ", threads, " split ", split));
            const Hinted ours = RunHinted(x, c.hint, NonFinitePolicy::kReject, threads, split);
            ASSERT_TRUE(ours.out.status.ok()) << ours.out.status;
            EXPECT_EQ(ours.one_pass, c.one_pass);
            ExpectSameScales(ours.out.scales, expected.scales);
            ExpectSameBytes(ours.out.q, expected.q, x.size(1));
          }
        }
      }
    }
  }
}

TEST(Fp8QuantizerTest, AScaleHintOnAStreamedOutputGivesTheSameBytes) {
  const int64_t rows = 4097;
  const int64_t cols = 4099;  // rows * cols > 16 Mi: non-temporal stores
  const at::Tensor x = RandomWeights(rows, cols, at::kBFloat16, 124);
  const Quantized expected = TorchReference(x, QuantScheme::kPerTensor);
  for (float hint : {expected.scales[0], expected.scales[0] * 1.5f}) {
    const Hinted ours = RunHinted(x, hint, NonFinitePolicy::kReject, 2);
    ASSERT_TRUE(ours.out.status.ok()) << ours.out.status;
    EXPECT_EQ(ours.one_pass, hint == expected.scales[0]);
    ExpectSameScales(ours.out.scales, expected.scales);
    ExpectSameBytes(ours.out.q, expected.q, cols);
  }
}

TEST(Fp8QuantizerTest, AScaleHintKeepsTheNonFiniteRules) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (at::ScalarType type : kTypes) {
    SCOPED_TRACE(static_cast<int>(type));
    at::Tensor clean = RandomWeights(130, 200, type, 9);
    const Quantized reference = TorchReference(clean, QuantScheme::kPerTensor);
    at::Tensor x = clean.clone();
    x[5][7] = nan;
    clean[5][7] = 0;
    const Quantized zeroed = TorchReference(clean, QuantScheme::kPerTensor);
    for (Fp8Isa isa : SupportedFp8Isas()) {
      SCOPED_TRACE(std::string(internal::Fp8IsaName(isa)));
      ScopedFp8Isa scoped(isa);
      // Reject: the same error, naming the same element, whatever the hint.
      const Hinted rejected =
          RunHinted(x, reference.scales[0], NonFinitePolicy::kReject, 2, 200 * 5);
      EXPECT_EQ(rejected.out.status.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(rejected.out.status.message(),
                  ::testing::HasSubstr("element 1007 (row 5, col 7)"));
      EXPECT_FALSE(rejected.one_pass);
      // vLLM: NaN counts as 0 in the amax and becomes +448, in one pass too.
      Quantized expected = zeroed;
      expected.q[5 * 200 + 7] = 0x7E;
      const Hinted vllm = RunHinted(x, zeroed.scales[0], NonFinitePolicy::kVllmCompatible, 2);
      ASSERT_TRUE(vllm.out.status.ok()) << vllm.out.status;
      EXPECT_TRUE(vllm.one_pass);
      ExpectSameScales(vllm.out.scales, expected.scales);
      ExpectSameBytes(vllm.out.q, expected.q, 200);
      // vLLM with an Inf: the scale becomes inf, never the hint.
      at::Tensor with_inf = clean.clone();
      with_inf[0][3] = inf;
      const Hinted infinite =
          RunHinted(with_inf, zeroed.scales[0], NonFinitePolicy::kVllmCompatible, 2);
      ASSERT_TRUE(infinite.out.status.ok()) << infinite.out.status;
      EXPECT_FALSE(infinite.one_pass);
      EXPECT_THAT(infinite.out.scales, ::testing::Each(inf));
      EXPECT_EQ(infinite.out.q[3], 0x7E);
    }
  }
}

TEST(Fp8QuantizerTest, OtherSchemesIgnoreAScaleHint) {
  const at::Tensor x = RandomWeights(300, 257, at::kBFloat16, 10);
  for (QuantScheme scheme : {QuantScheme::kPerChannel, QuantScheme::kBlock128}) {
    SCOPED_TRACE(static_cast<int>(scheme));
    const Quantized expected = TorchReference(x, scheme);
    Quantized ours;
    ours.q.assign(300 * 257, 0xAB);
    ours.scales.assign(expected.scales.size(), -1.0f);
    Fp8QuantizeStats stats;
    Fp8QuantizeOptions options;
    options.scheme = scheme;
    options.scale_hint = expected.scales[0];
    options.stats = &stats;
    ASSERT_TRUE(QuantizeFp8(x.data_ptr(), DType::kBFloat16, 300, 257, options, ours.q.data(),
                            ours.scales.data(), "w")
                    .ok());
    EXPECT_FALSE(stats.one_pass);
    ExpectSameScales(ours.scales, expected.scales);
    ExpectSameBytes(ours.q, expected.q, 257);
  }
}

// --- Output hash (Fp8QuantizeOptions::out_hash) ------------------------------

// `x` quantized with out_hash set: the bytes and scales must be those of the
// same call without it, and the hash the XXH3 of those bytes, whatever the
// path (one worker hashes as it converts, more hash afterwards).
void ExpectHashedLikeUnhashed(const at::Tensor& x, QuantScheme scheme, NonFinitePolicy policy,
                              int threads, float hint = 0.0f, int64_t split = 0) {
  at::Tensor c = x.contiguous();
  const int64_t rows = c.size(0);
  const int64_t cols = c.size(1);
  const DType dtype = OurType(c.scalar_type());
  const std::array<absl::Span<const uint8_t>, 2> pieces = TwoPieces(c, split);
  Quantized plain;
  Quantized hashed;
  uint64_t hash = 0x5EED;
  for (Quantized* out : {&plain, &hashed}) {
    out->q.assign(rows * cols, 0xAB);
    out->scales.assign(Fp8NumScales(scheme, rows, cols), -1.0f);
    Fp8QuantizeOptions options;
    options.scheme = scheme;
    options.non_finite = policy;
    options.num_threads = threads;
    options.scale_hint = hint;
    options.out_hash = out == &hashed ? &hash : nullptr;
    out->status = split > 0 ? QuantizeFp8Pieces(pieces, dtype, rows, cols, options, out->q.data(),
                                                out->scales.data(), "w")
                            : QuantizeFp8(c.data_ptr(), dtype, rows, cols, options, out->q.data(),
                                          out->scales.data(), "w");
  }
  ASSERT_TRUE(plain.status.ok()) << plain.status;
  ASSERT_TRUE(hashed.status.ok()) << hashed.status;
  ExpectSameScales(hashed.scales, plain.scales);
  ExpectSameBytes(hashed.q, plain.q, cols);
  EXPECT_EQ(hash, HashBytes(plain.q.data(), static_cast<int64_t>(plain.q.size())));
}

TEST(Fp8QuantizerTest, AnOutputHashIsTheHashOfTheBytesWrittenOnEveryPath) {
  // 300 x 1000: several fused steps of 64 Ki elements, the last one short;
  // block bands of 128, 128 and 44 rows.
  for (at::ScalarType type : kTypes) {
    const at::Tensor x = RandomWeights(300, 1000, type, 31);
    const float s = TorchReference(x, QuantScheme::kPerTensor).scales[0];
    for (Fp8Isa isa : SupportedFp8Isas()) {
      ScopedFp8Isa scoped(isa);
      for (int threads : {1, 2, 3}) {
        for (QuantScheme scheme : kSchemes) {
          for (NonFinitePolicy policy :
               {NonFinitePolicy::kReject, NonFinitePolicy::kVllmCompatible}) {
            SCOPED_TRACE(absl::StrCat(internal::Fp8IsaName(isa), " type ", static_cast<int>(type),
                                      " threads ", threads, " scheme ", static_cast<int>(scheme),
                                      " policy ", static_cast<int>(policy)));
            ExpectHashedLikeUnhashed(x, scheme, policy, threads);
            // Split into pieces: inside a row, and on a 128-row band.
            ExpectHashedLikeUnhashed(x, scheme, policy, threads, 0.0f, 1000 * 7 + 13);
            ExpectHashedLikeUnhashed(x, scheme, policy, threads, 0.0f, 1000 * 128);
          }
        }
        // Per-tensor hints: the one pass that holds, and misses that
        // convert again (the hash starts over).
        for (float hint : {s, s * 2, std::nextafter(s, 0.0f)}) {
          SCOPED_TRACE(
              absl::StrCat(internal::Fp8IsaName(isa), " hint ", hint, " threads ", threads));
          ExpectHashedLikeUnhashed(x, QuantScheme::kPerTensor, NonFinitePolicy::kReject, threads,
                                   hint);
          ExpectHashedLikeUnhashed(x, QuantScheme::kPerTensor, NonFinitePolicy::kReject, threads,
                                   hint, 65536 + 3);
        }
      }
    }
  }
}

TEST(Fp8QuantizerTest, AnOutputHashedPerTensorScaleSeesTheMaxInEveryUnit) {
  // With a hash, the amax pass walks 64 Ki-element units last to first: the
  // largest |x| must count wherever it lies (the first and last element, on
  // either side of a unit boundary, the short last unit).
  for (int64_t at : {int64_t{0}, int64_t{65535}, int64_t{65536}, int64_t{131072 + 7},
                     int64_t{262143}, int64_t{262144}, int64_t{299999}}) {
    at::Tensor x = RandomWeights(300, 1000, at::kBFloat16, 44);
    x.view({-1})[at] = -1048576.0f;  // 2^20: above any random weight
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE(absl::StrCat("max at ", at, " threads ", threads));
      ExpectHashedLikeUnhashed(x, QuantScheme::kPerTensor, NonFinitePolicy::kReject, threads);
      std::vector<uint8_t> q(300 * 1000);
      float scale = -1;
      uint64_t hash = 0;
      Fp8QuantizeOptions options;
      options.num_threads = threads;
      options.out_hash = &hash;
      ASSERT_TRUE(
          QuantizeFp8(x.data_ptr(), DType::kBFloat16, 300, 1000, options, q.data(), &scale, "w")
              .ok());
      EXPECT_EQ(scale, 1048576.0f / kFp8E4M3Max);
    }
  }
}

TEST(Fp8QuantizerTest, AnOutputHashCoversTheSpecialOutputs) {
  // Every code 0x7E (vLLM, all zero), the infinite inverse, one element.
  const at::Tensor zeros = at::zeros({70, 1000}, at::kBFloat16);
  const at::Tensor tiny = at::tensor({1e-37f, 0.0f, -1e-37f, 5e-38f}, at::kFloat).reshape({1, 4});
  for (int threads : {1, 2}) {
    for (QuantScheme scheme : kSchemes) {
      for (NonFinitePolicy policy : {NonFinitePolicy::kReject, NonFinitePolicy::kVllmCompatible}) {
        SCOPED_TRACE(absl::StrCat("threads ", threads, " scheme ", static_cast<int>(scheme),
                                  " policy ", static_cast<int>(policy)));
        ExpectHashedLikeUnhashed(zeros, scheme, policy, threads);
        ExpectHashedLikeUnhashed(tiny, scheme, policy, threads);
        ExpectHashedLikeUnhashed(at::ones({1, 1}, at::kHalf), scheme, policy, threads);
      }
    }
  }
  // No elements: the hash of no bytes.
  Fp8QuantizeOptions options;
  uint64_t hash = 0;
  options.out_hash = &hash;
  float scale = -1;
  ASSERT_TRUE(QuantizeFp8(nullptr, DType::kBFloat16, 0, 5, options, nullptr, &scale, "e").ok());
  EXPECT_EQ(hash, HashBytes(nullptr, 0));
}

TEST(Fp8QuantizerTest, AnOutputHashOfALargeOutputSkipsTheStreamingStoresOnOneWorker) {
  const int64_t rows = 4097;
  const int64_t cols = 4099;  // rows * cols > 16 Mi: streamed without a hash
  const at::Tensor x = RandomWeights(rows, cols, at::kBFloat16, 125);
  for (int threads : {1, 2}) {
    for (QuantScheme scheme : kSchemes) {
      SCOPED_TRACE(absl::StrCat("threads ", threads, " scheme ", static_cast<int>(scheme)));
      ExpectHashedLikeUnhashed(x, scheme, NonFinitePolicy::kReject, threads);
    }
  }
}

TEST(Fp8QuantizerTest, AFailedCallLeavesTheOutputHashAlone) {
  at::Tensor x = RandomWeights(40, 3000, at::kBFloat16, 6);
  x[30][2999] = std::numeric_limits<float>::quiet_NaN();
  for (int threads : {1, 2}) {
    for (QuantScheme scheme : kSchemes) {
      std::vector<uint8_t> q(40 * 3000);
      std::vector<float> scales(Fp8NumScales(scheme, 40, 3000));
      uint64_t hash = 0x5EED;
      Fp8QuantizeOptions options;
      options.scheme = scheme;
      options.num_threads = threads;
      options.out_hash = &hash;
      const absl::Status status = QuantizeFp8(x.data_ptr(), DType::kBFloat16, 40, 3000, options,
                                              q.data(), scales.data(), "w");
      EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
      EXPECT_THAT(std::string(status.message()), HasSubstr("element 92999"));
      EXPECT_EQ(hash, 0x5EEDu);
    }
  }
}

// --- Edge cases ---------------------------------------------------------------

TEST(Fp8QuantizerTest, AllZeroTensorUnderRejectGivesZeroScaleAndZeroBytes) {
  for (at::ScalarType type : kTypes) {
    const at::Tensor x = at::zeros({5, 300}, type);
    for (QuantScheme scheme : {QuantScheme::kPerTensor, QuantScheme::kPerChannel}) {
      const Quantized ours = RunOurs(x, scheme, NonFinitePolicy::kReject);
      ASSERT_TRUE(ours.status.ok()) << ours.status;
      EXPECT_THAT(ours.scales, ::testing::Each(0.0f));
      EXPECT_THAT(ours.q, ::testing::Each(0x00));
    }
    // Block scales never reach 0: the amax floor keeps them at 1e-4 / 448.
    const Quantized block = RunOurs(x, QuantScheme::kBlock128, NonFinitePolicy::kReject);
    ASSERT_TRUE(block.status.ok()) << block.status;
    EXPECT_THAT(block.scales, ::testing::Each(kFp8BlockAmaxFloor / 448.0f));
    EXPECT_THAT(block.q, ::testing::Each(0x00));
  }
  // Negative zero keeps its sign, as in the op chain.
  const Quantized neg = RunOurs(-at::zeros({1, 3}), QuantScheme::kPerTensor);
  ASSERT_TRUE(neg.status.ok());
  EXPECT_THAT(neg.q, ::testing::Each(0x80));
}

TEST(Fp8QuantizerTest, AllZeroTensorUnderVllmGivesZeroScaleAndEvery0x7E) {
  for (at::ScalarType type : kTypes) {
    const at::Tensor x = at::zeros({5, 300}, type);
    for (QuantScheme scheme : {QuantScheme::kPerTensor, QuantScheme::kPerChannel}) {
      const Quantized ours = RunOurs(x, scheme, NonFinitePolicy::kVllmCompatible);
      ASSERT_TRUE(ours.status.ok()) << ours.status;
      EXPECT_THAT(ours.scales, ::testing::Each(0.0f));
      EXPECT_THAT(ours.q, ::testing::Each(0x7E));
    }
    const Quantized block = RunOurs(x, QuantScheme::kBlock128, NonFinitePolicy::kVllmCompatible);
    ASSERT_TRUE(block.status.ok());
    EXPECT_THAT(block.scales, ::testing::Each(kFp8BlockAmaxFloor / 448.0f));
    EXPECT_THAT(block.q, ::testing::Each(0x00));
  }
  // Per-channel: only the all-zero row gets 0x7E.
  at::Tensor x = at::ones({2, 4}, at::kFloat);
  x[1].zero_();
  const Quantized ours = RunOurs(x, QuantScheme::kPerChannel, NonFinitePolicy::kVllmCompatible);
  ASSERT_TRUE(ours.status.ok());
  EXPECT_EQ(ours.scales, (std::vector<float>{1.0f / 448.0f, 0.0f}));
  EXPECT_EQ(ours.q, (std::vector<uint8_t>{0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E}));
}

TEST(Fp8QuantizerTest, RejectsNanNamingTensorElementAndValue) {
  for (at::ScalarType type : kTypes) {
    for (QuantScheme scheme : kSchemes) {
      at::Tensor x = RandomWeights(4, 6, type, 5);
      x[1][1] = std::numeric_limits<float>::quiet_NaN();
      x[3][0] = std::numeric_limits<float>::quiet_NaN();
      const Quantized ours =
          RunOurs(x, scheme, NonFinitePolicy::kReject, 0, "layers.0.mlp.gate_up_proj.weight");
      EXPECT_EQ(ours.status.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(ours.status.message()),
                  HasSubstr("tensor 'layers.0.mlp.gate_up_proj.weight': element 7 (row 1, col 1) "
                            "is nan"));
    }
  }
}

TEST(Fp8QuantizerTest, RejectsInfNamingTheFirstBadElementWhateverTheSplit) {
  // Bad elements in several workers' ranges; the message names the lowest.
  at::Tensor x = RandomWeights(1024, 1024, at::kBFloat16, 6);
  x[1000][3] = std::numeric_limits<float>::infinity();
  x[700][1000] = -std::numeric_limits<float>::infinity();
  x[900][5] = std::numeric_limits<float>::quiet_NaN();
  for (Fp8Isa isa : SupportedFp8Isas()) {
    ScopedFp8Isa scoped(isa);
    for (QuantScheme scheme : kSchemes) {
      for (int threads : {1, 4}) {
        const Quantized ours = RunOurs(x, scheme, NonFinitePolicy::kReject, threads, "wq");
        EXPECT_EQ(ours.status.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(std::string(ours.status.message()),
                    HasSubstr("tensor 'wq': element 717800 (row 700, col 1000) is -inf"));
      }
    }
  }
}

// A source written between the amax pass and the convert (a trainer writing
// into the region a push reads in place) gets no NaN code and no code that
// spills into the next byte: values above the amax, Inf and NaN saturate.
struct Overwrite {
  at::Tensor x;
  std::vector<std::pair<int64_t, float>> values;  // (element, value)
};
void OverwriteBetweenPasses(void* arg) {
  auto* o = static_cast<Overwrite*>(arg);
  for (const auto& [at, value] : o->values) o->x.view(-1)[at] = value;
}

TEST(Fp8QuantizerTest, ASourceThatGrowsBetweenThePassesSaturatesInsteadOfGivingNan) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (at::ScalarType type : kTypes) {
    const at::Tensor original = RandomWeights(64, 1000, type, 41);
    const std::vector<std::pair<int64_t, float>> writes = {
        {0, 1e30f},  {1, -1e30f}, {2, 3.0e38f},          {777, inf},
        {778, -inf}, {999, nan},  {64 * 1000 - 1, -5e4f}};
    for (Fp8Isa isa : SupportedFp8Isas()) {
      ScopedFp8Isa scoped(isa);
      for (int threads : {1, 3}) {
        for (bool hash : {false, true}) {
          SCOPED_TRACE(absl::StrCat(internal::Fp8IsaName(isa), " type ", static_cast<int>(type),
                                    " threads ", threads, " hash ", hash));
          Overwrite o{original.clone(), writes};
          std::vector<uint8_t> q(o.x.numel(), 0xAB);
          float scale = -1.0f;
          uint64_t digest = 0;
          Fp8QuantizeOptions options;
          options.num_threads = threads;
          if (hash) options.out_hash = &digest;
          internal::SetBetweenPassesHookForTesting(&OverwriteBetweenPasses, &o);
          const absl::Status status =
              QuantizeFp8(o.x.data_ptr(), OurType(type), 64, 1000, options, q.data(), &scale, "w");
          internal::SetBetweenPassesHookForTesting(nullptr, nullptr);
          ASSERT_TRUE(status.ok()) << status;
          // The scale is the one of the bytes before the writes.
          EXPECT_EQ(scale, RunOurs(original, QuantScheme::kPerTensor).scales[0]);
          const uint8_t expected_at[] = {0x7E, 0xFE, 0x7E, 0x7E, 0xFE, 0x7E};
          for (size_t k = 0; k < 6; ++k) {
            EXPECT_EQ(q[writes[k].first], expected_at[k]) << "element " << writes[k].first;
          }
          EXPECT_EQ(q.back(), 0xFE);
          // Every other byte is what the untouched source gives.
          const std::vector<uint8_t> untouched = RunOurs(original, QuantScheme::kPerTensor).q;
          for (int64_t i = 0; i < o.x.numel(); ++i) {
            if (i < 3 || i == 777 || i == 778 || i == 999 || i == o.x.numel() - 1) continue;
            ASSERT_EQ(q[i], untouched[i]) << "element " << i;
          }
          for (uint8_t b : q) ASSERT_NE(b & 0x7F, 0x7F) << "a NaN code";
        }
      }
    }
  }
}

// Every 16-bit pattern (NaN, Inf, values far above the amax, subnormals,
// both signs) written over the source between the passes: each element's
// code is that of |x| * inv, clamped to 448, with x's sign, as one scalar
// conversion gives it, on every variant and at a scale that is not 1.
struct CopyOver {
  at::Tensor dst;
  at::Tensor src;
};
void CopyBetweenPasses(void* arg) {
  auto* c = static_cast<CopyOver*>(arg);
  c->dst.copy_(c->src);
}

TEST(Fp8QuantizerTest, EverySixteenBitPatternWrittenBetweenThePassesGetsTheScalarCode) {
  for (at::ScalarType type : {at::kBFloat16, at::kHalf}) {
    const at::Tensor every = at::arange(0, 0x10000, at::kInt).to(at::kShort).view(type);
    const at::Tensor original = RandomWeights(256, 256, type, 47);
    const at::Tensor as_float = every.to(at::kFloat);
    for (Fp8Isa isa : SupportedFp8Isas()) {
      ScopedFp8Isa scoped(isa);
      SCOPED_TRACE(absl::StrCat(internal::Fp8IsaName(isa), " type ", static_cast<int>(type)));
      CopyOver c{original.clone(), every.reshape({256, 256})};
      std::vector<uint8_t> q(c.dst.numel(), 0xAB);
      float scale = -1.0f;
      internal::SetBetweenPassesHookForTesting(&CopyBetweenPasses, &c);
      const absl::Status status = QuantizeFp8(c.dst.data_ptr(), OurType(type), 256, 256,
                                              Fp8QuantizeOptions{}, q.data(), &scale, "w");
      internal::SetBetweenPassesHookForTesting(nullptr, nullptr);
      ASSERT_TRUE(status.ok()) << status;
      ASSERT_GT(scale, 0.0f);
      ASSERT_NE(scale, 1.0f);
      const float inv = 1.0f / scale;
      int mismatches = 0;
      for (int64_t i = 0; i < 0x10000; ++i) {
        const float x = as_float.data_ptr<float>()[i];
        const float y = std::fabs(x) * inv;
        const uint8_t expected =
            static_cast<uint8_t>((std::isnan(y) ? 0x7E : Fp8E4M3FromFloat(std::min(y, 448.0f))) |
                                 (std::signbit(x) ? 0x80 : 0));
        if (q[i] != expected && mismatches++ < 5) {
          ADD_FAILURE() << "bits 0x" << std::hex << i << ": 0x" << int{q[i]} << ", expected 0x"
                        << int{expected};
        }
      }
      EXPECT_EQ(mismatches, 0);
    }
  }
}

// A NaN the amax pass saw that is gone when the quantizer looks for it to
// name it: the source changed while it was read (the trainer's doing), which
// is FAILED_PRECONDITION saying so, not INTERNAL.
TEST(Fp8QuantizerTest, ANonFiniteValueThatGoesAwayBeforeItIsNamedIsFailedPrecondition) {
  for (at::ScalarType type : kTypes) {
    at::Tensor x = RandomWeights(64, 1000, type, 43);
    x.view(-1)[4321] = std::numeric_limits<float>::quiet_NaN();
    for (Fp8Isa isa : SupportedFp8Isas()) {
      ScopedFp8Isa scoped(isa);
      for (int threads : {1, 3}) {
        SCOPED_TRACE(absl::StrCat(internal::Fp8IsaName(isa), " threads ", threads));
        Overwrite o{x.clone(), {{4321, 0.0f}}};
        std::vector<uint8_t> q(o.x.numel(), 0);
        float scale = -1.0f;
        Fp8QuantizeOptions options;
        options.num_threads = threads;
        internal::SetBetweenPassesHookForTesting(&OverwriteBetweenPasses, &o);
        const absl::Status status =
            QuantizeFp8(o.x.data_ptr(), OurType(type), 64, 1000, options, q.data(), &scale, "w");
        internal::SetBetweenPassesHookForTesting(nullptr, nullptr);
        EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
        EXPECT_THAT(std::string(status.message()),
                    HasSubstr("tensor 'w': a non-finite value was read, then was not there"));
        EXPECT_THAT(std::string(status.message()),
                    HasSubstr("the source changed while refitd read it"));
      }
    }
  }
}

// vLLM: NaN is ignored by the max and becomes +448; the rest is quantized with
// the scale of the finite values.
TEST(Fp8QuantizerTest, VllmPolicyIgnoresNanInMaxAndSaturatesIt) {
  for (at::ScalarType type : kTypes) {
    at::Tensor x = RandomWeights(130, 200, type, 8);
    std::vector<std::pair<int, int>> nans = {{0, 0}, {5, 7}, {129, 199}, {64, 150}};
    at::Tensor clean = x.clone();
    for (auto [r, c] : nans) {
      clean[r][c] = 0;
      x[r][c] = std::copysign(std::numeric_limits<float>::quiet_NaN(), r % 2 ? -1.0f : 1.0f);
    }
    for (QuantScheme scheme : kSchemes) {
      Quantized expected = TorchReference(clean, scheme);
      for (auto [r, c] : nans) expected.q[r * 200 + c] = 0x7E;
      for (Fp8Isa isa : SupportedFp8Isas()) {
        SCOPED_TRACE(std::string(internal::Fp8IsaName(isa)));
        ScopedFp8Isa scoped(isa);
        const Quantized ours = RunOurs(x, scheme, NonFinitePolicy::kVllmCompatible);
        ASSERT_TRUE(ours.status.ok()) << ours.status;
        ExpectSameScales(ours.scales, expected.scales);
        ExpectSameBytes(ours.q, expected.q, 200);
      }
    }
  }
}

// vLLM: Inf makes s = inf; finite values become (signed) zero, Inf +-448, NaN
// still +448.
TEST(Fp8QuantizerTest, VllmPolicyInfGivesInfiniteScale) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (at::ScalarType type : kTypes) {
    at::Tensor x = at::tensor({1.5f, -2.0f, inf, -inf, nan, 0.0f, 300.0f, -0.0f}, at::kFloat)
                       .reshape({1, 8})
                       .to(type);
    for (QuantScheme scheme : kSchemes) {
      for (Fp8Isa isa : SupportedFp8Isas()) {
        SCOPED_TRACE(std::string(internal::Fp8IsaName(isa)));
        ScopedFp8Isa scoped(isa);
        const Quantized ours = RunOurs(x, scheme, NonFinitePolicy::kVllmCompatible);
        ASSERT_TRUE(ours.status.ok()) << ours.status;
        EXPECT_THAT(ours.scales, ::testing::Each(inf));
        EXPECT_EQ(ours.q, (std::vector<uint8_t>{0x00, 0x80, 0x7E, 0xFE, 0x7E, 0x00, 0x00, 0x80}));
      }
    }
  }
}

TEST(Fp8QuantizerTest, ExactMaxMapsTo448) {
  at::Tensor x = at::tensor({448.0f, -448.0f, 1.0f, -0.5f}, at::kFloat).reshape({2, 2});
  const Quantized tensor = RunOurs(x, QuantScheme::kPerTensor);
  ASSERT_TRUE(tensor.status.ok());
  EXPECT_EQ(tensor.scales, std::vector<float>{1.0f});
  EXPECT_EQ(tensor.q, (std::vector<uint8_t>{0x7E, 0xFE, 0x38, 0xB0}));
  // Per channel the row max maps to 448 whatever its magnitude.
  const Quantized channel = RunOurs(x, QuantScheme::kPerChannel);
  ASSERT_TRUE(channel.status.ok());
  EXPECT_EQ(channel.scales, (std::vector<float>{1.0f, 1.0f / 448.0f}));
  EXPECT_EQ(channel.q, (std::vector<uint8_t>{0x7E, 0xFE, 0x7E, 0xF6}));  // -0.5 -> -224
}

TEST(Fp8QuantizerTest, SmallValuesAfterScalingBecomeSubnormals) {
  // amax 448 -> s = 1: the other values are already in e4m3's subnormal range.
  at::Tensor x = at::tensor({448.0f, 0x1p-9f, 0x1p-10f, 3 * 0x1p-10f, -0x1p-7f, 0x1p-11f,
                             7 * 0x1p-9f, -0x1p-6f},
                            at::kFloat)
                     .reshape({1, 8});
  for (Fp8Isa isa : SupportedFp8Isas()) {
    SCOPED_TRACE(std::string(internal::Fp8IsaName(isa)));
    ScopedFp8Isa scoped(isa);
    const Quantized ours = RunOurs(x, QuantScheme::kPerTensor);
    ASSERT_TRUE(ours.status.ok());
    EXPECT_EQ(ours.q, (std::vector<uint8_t>{0x7E, 0x01, 0x00, 0x02, 0x84, 0x00, 0x07, 0x88}));
  }
}

TEST(Fp8QuantizerTest, SingleElementTensorsSaturate) {
  for (at::ScalarType type : kTypes) {
    for (QuantScheme scheme : kSchemes) {
      for (float v : {5.0f, -5.0f, 1e-3f}) {
        const Quantized ours = RunOurs(at::full({1, 1}, v, type), scheme);
        ASSERT_TRUE(ours.status.ok());
        const Quantized expected = TorchReference(at::full({1, 1}, v, type), scheme);
        ExpectSameScales(ours.scales, expected.scales);
        ExpectSameBytes(ours.q, expected.q, 1);
        if (scheme != QuantScheme::kBlock128) {
          EXPECT_EQ(ours.q[0], v > 0 ? 0x7E : 0xFE);
        }
      }
    }
  }
}

TEST(Fp8QuantizerTest, EmptyTensorIsOkAndWritesNothing) {
  Fp8QuantizeOptions options;
  for (QuantScheme scheme : kSchemes) {
    options.scheme = scheme;
    float scales[4] = {-1, -1, -1, -1};
    EXPECT_TRUE(QuantizeFp8(nullptr, DType::kBFloat16, 0, 0, options, nullptr, scales, "e").ok());
    EXPECT_TRUE(QuantizeFp8(nullptr, DType::kFloat32, 0, 77, options, nullptr, scales, "e").ok());
    EXPECT_EQ(Fp8NumScales(scheme, 0, 77), scheme == QuantScheme::kPerTensor ? 1 : 0);
  }
  // Per-channel rows of zero columns have amax 0.
  options.scheme = QuantScheme::kPerChannel;
  float scales[3] = {-1, -1, -1};
  ASSERT_TRUE(QuantizeFp8(nullptr, DType::kFloat16, 3, 0, options, nullptr, scales, "e").ok());
  EXPECT_THAT(scales, ::testing::Each(0.0f));
}

TEST(Fp8QuantizerTest, TinyAmaxFollowsTheInfiniteInverseWithoutNanBytes) {
  // s = amax / 448 is so small that inv = 1 / s overflows: x * inf saturates
  // every non-zero element, and 0 * inf = NaN becomes +448 (as in vLLM's
  // kernel and core/cuda/fp8_math.h), never a NaN byte.
  at::Tensor x = at::tensor({1e-37f, 0.0f, -1e-37f, 5e-38f}, at::kFloat).reshape({1, 4});
  for (QuantScheme scheme : {QuantScheme::kPerTensor, QuantScheme::kPerChannel}) {
    for (NonFinitePolicy policy : {NonFinitePolicy::kReject, NonFinitePolicy::kVllmCompatible}) {
      const Quantized ours = RunOurs(x, scheme, policy);
      ASSERT_TRUE(ours.status.ok());
      EXPECT_EQ(ours.scales[0], 1e-37f / 448.0f);
      EXPECT_EQ(ours.q, (std::vector<uint8_t>{0x7E, 0x7E, 0xFE, 0x7E}));
    }
  }
}

TEST(Fp8QuantizerTest, RejectsNonFloatSourceType) {
  int32_t data[4] = {1, 2, 3, 4};
  uint8_t q[4];
  float scale;
  const absl::Status status =
      QuantizeFp8(data, DType::kInt32, 2, 2, Fp8QuantizeOptions{}, q, &scale, "model.w");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("tensor 'model.w': cannot quantize I32 to FP8"));
}

TEST(Fp8QuantizerTest, RejectsSchemeNone) {
  float data[4] = {1, 2, 3, 4};
  uint8_t q[4];
  float scale;
  Fp8QuantizeOptions options;
  options.scheme = QuantScheme::kNone;
  const absl::Status status = QuantizeFp8(data, DType::kFloat32, 2, 2, options, q, &scale, "w1");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("tensor 'w1': quantization scheme \"none\" is not an FP8 scheme"));
}

TEST(Fp8QuantizerTest, RejectsBadShapesBuffersAndThreadCounts) {
  float data[4] = {1, 2, 3, 4};
  uint8_t q[4];
  float scale;
  Fp8QuantizeOptions options;
  absl::Status status = QuantizeFp8(data, DType::kFloat32, -1, 2, options, q, &scale, "w2");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("tensor 'w2': invalid shape [-1, 2]"));
  status = QuantizeFp8(data, DType::kFloat32, 2, 2, options, nullptr, &scale, "w3");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("tensor 'w3': null buffer"));
  options.num_threads = -2;
  status = QuantizeFp8(data, DType::kFloat32, 2, 2, options, q, &scale, "w4");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("tensor 'w4': num_threads -2"));
}

TEST(Fp8QuantizerTest, NumScalesFollowsTheLayout) {
  EXPECT_EQ(Fp8NumScales(QuantScheme::kPerTensor, 300, 1000), 1);
  EXPECT_EQ(Fp8NumScales(QuantScheme::kPerChannel, 300, 1000), 300);
  EXPECT_EQ(Fp8NumScales(QuantScheme::kBlock128, 300, 1000), 3 * 8);
  EXPECT_EQ(Fp8NumScales(QuantScheme::kBlock128, 128, 128), 1);
  EXPECT_EQ(Fp8NumScales(QuantScheme::kNone, 300, 1000), 0);
}

TEST(Fp8QuantizerTest, RejectsShapesWhoseSizeOverflows) {
  float data[1] = {1};
  uint8_t q[1];
  float scale;
  const int64_t big = int64_t{1} << 32;
  const absl::Status status =
      QuantizeFp8(data, DType::kFloat32, big, big, Fp8QuantizeOptions{}, q, &scale, "w5");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("tensor 'w5': invalid shape [4294967296, 4294967296]"));
}

}  // namespace
}  // namespace refit::core
