// Looking ahead in the per-tensor scheme (Fp8QuantizeOptions::next,
// next_amax, amax): the convert pass of one tensor takes the amax of the
// tensor quantized after it, and the call for that one uses it instead of an
// amax pass. Both calls must write exactly the bytes and scales of two plain
// calls, on every instruction-set variant, source type, policy, thread count,
// split into pieces, with and without an output hash; the amax must be the
// true one; an amax that does not fit the call is ignored; a call that makes
// no convert pass over its source hands on nothing.
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/base/casts.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "core/dtype.h"
#include "core/fp8_quantizer.h"
#include "core/fp8_quantizer_internal.h"
#include "core/xxh3.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/fp8_isa.h"

namespace refit::core {
namespace {

using internal::Fp8Isa;
using ::testing::HasSubstr;
using Piece = absl::Span<const uint8_t>;
using ::refit::testing::ScopedFp8Isa;
using ::refit::testing::SupportedFp8Isas;

// `count` values of `dtype`: normal, a few large ones, scaled by `scale`.
std::vector<uint8_t> RandomValues(DType dtype, int64_t count, float scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& v : values) v = scale * normal(rng) * ((rng() % 97 == 0) ? 50.0f : 1.0f);
  std::vector<uint8_t> out(values.size() * DTypeSize(dtype));
  EXPECT_TRUE(ConvertFloats(reinterpret_cast<const uint8_t*>(values.data()), DType::kFloat32,
                            out.data(), dtype, values.size())
                  .ok());
  return out;
}

// The largest |bits| of the elements, NaN counted as 0 when `ignore_nan`:
// the amax as the quantizer defines it, taken the slow way.
uint32_t AbsMaxBits(const std::vector<uint8_t>& bytes, DType dtype, bool ignore_nan) {
  uint32_t m = 0;
  const size_t esize = DTypeSize(dtype);
  for (size_t i = 0; i < bytes.size() / esize; ++i) {
    uint32_t abs, inf;
    if (esize == 2) {
      uint16_t v;
      std::memcpy(&v, bytes.data() + i * 2, 2);
      abs = v & 0x7FFFu;
      inf = dtype == DType::kBFloat16 ? 0x7F80u : 0x7C00u;
    } else {
      std::memcpy(&abs, bytes.data() + i * 4, 4);
      abs &= 0x7FFFFFFFu;
      inf = 0x7F800000u;
    }
    if (ignore_nan && abs > inf) abs = 0;
    m = std::max(m, abs);
  }
  return m;
}

// `bytes` as `n` pieces (the middle ones of uneven sizes, one of them
// empty when n >= 3).
std::vector<Piece> Split(const std::vector<uint8_t>& bytes, DType dtype, int n) {
  const int64_t esize = static_cast<int64_t>(DTypeSize(dtype));
  const int64_t count = static_cast<int64_t>(bytes.size()) / esize;
  std::vector<Piece> pieces;
  int64_t at = 0;
  for (int i = 0; i < n; ++i) {
    int64_t next = i + 1 == n ? count : count * (2 * i + 1) / (2 * n) + 3;
    if (n >= 3 && i == 1) next = at;  // an empty piece
    next = std::min(std::max(next, at), count);
    pieces.push_back(Piece(bytes.data() + at * esize, static_cast<size_t>((next - at) * esize)));
    at = next;
  }
  return pieces;
}

struct Result {
  absl::Status status;
  std::vector<uint8_t> q;
  float scale = -1.0f;
  uint64_t hash = 0;
  Fp8QuantizeStats stats;
};

struct Call {
  DType dtype = DType::kBFloat16;
  NonFinitePolicy policy = NonFinitePolicy::kReject;
  int threads = 1;
  bool hash = false;
  float hint = 0.0f;
  absl::Span<const Piece> next;
  Fp8Amax* next_amax = nullptr;
  const Fp8Amax* amax = nullptr;
};

Call MakeCall(DType dtype, NonFinitePolicy policy, int threads = 1, bool hash = false) {
  Call call;
  call.dtype = dtype;
  call.policy = policy;
  call.threads = threads;
  call.hash = hash;
  return call;
}

// Quantizes `pieces` (per tensor) as `call` says; one piece goes through
// QuantizeFp8, several through QuantizeFp8Pieces.
Result Quantize(absl::Span<const Piece> pieces, int64_t rows, int64_t cols, const Call& call) {
  Result r;
  r.q.assign(static_cast<size_t>(rows * cols), 0xAB);  // poison: every byte must be written
  r.stats.amax_given = true;                           // must be reset by the call
  Fp8QuantizeOptions options;
  options.non_finite = call.policy;
  options.num_threads = call.threads;
  options.scale_hint = call.hint;
  options.stats = &r.stats;
  options.out_hash = call.hash ? &r.hash : nullptr;
  options.next = call.next;
  options.next_amax = call.next_amax;
  options.amax = call.amax;
  r.status = pieces.size() == 1 ? QuantizeFp8(pieces[0].data(), call.dtype, rows, cols, options,
                                              r.q.data(), &r.scale, "w")
                                : QuantizeFp8Pieces(pieces, call.dtype, rows, cols, options,
                                                    r.q.data(), &r.scale, "w");
  return r;
}

uint64_t XXH3OfBytes(const std::vector<uint8_t>& bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

void ExpectSame(const Result& ours, const Result& expected) {
  ASSERT_TRUE(ours.status.ok()) << ours.status;
  ASSERT_TRUE(expected.status.ok()) << expected.status;
  EXPECT_EQ(absl::bit_cast<uint32_t>(ours.scale), absl::bit_cast<uint32_t>(expected.scale));
  ASSERT_EQ(ours.q.size(), expected.q.size());
  for (size_t i = 0; i < ours.q.size(); ++i) {
    ASSERT_EQ(ours.q[i], expected.q[i]) << "byte " << i;
  }
}

TEST(Fp8QuantizerAheadTest, TwoCallsLookingAheadWriteTheBytesOfTwoPlainCalls) {
  struct Shape {
    int64_t rows, cols;
  };
  // The current tensor, and next tensors smaller, larger and tiny.
  const Shape current{613, 1031};
  const Shape nexts[] = {{37, 129}, {1500, 1031}, {1, 5}};
  for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    const std::vector<uint8_t> a = RandomValues(dtype, current.rows * current.cols, 1.0f, 1);
    for (const Shape& shape : nexts) {
      const std::vector<uint8_t> b = RandomValues(dtype, shape.rows * shape.cols, 3.0f, 2);
      for (NonFinitePolicy policy : {NonFinitePolicy::kReject, NonFinitePolicy::kVllmCompatible}) {
        const bool vllm = policy == NonFinitePolicy::kVllmCompatible;
        const Call plain = MakeCall(dtype, policy);
        const Result a_plain = Quantize(Split(a, dtype, 1), current.rows, current.cols, plain);
        const Result b_plain = Quantize(Split(b, dtype, 1), shape.rows, shape.cols, plain);
        for (Fp8Isa isa : SupportedFp8Isas()) {
          ScopedFp8Isa scoped(isa);
          for (int threads : {1, 3}) {
            for (bool hash : {false, true}) {
              for (int a_parts : {1, 3}) {
                for (int b_parts : {1, 2, 4}) {
                  SCOPED_TRACE(absl::StrCat(internal::Fp8IsaName(isa), " ", DTypeName(dtype),
                                            " next [", shape.rows, ", ", shape.cols, "] vllm ",
                                            vllm, " threads ", threads, " hash ", hash, " parts ",
                                            a_parts, "/", b_parts));
                  const std::vector<Piece> b_pieces = Split(b, dtype, b_parts);
                  Fp8Amax ahead;
                  Call first = MakeCall(dtype, policy, threads, hash);
                  first.next = b_pieces;
                  first.next_amax = &ahead;
                  const Result a_ours =
                      Quantize(Split(a, dtype, a_parts), current.rows, current.cols, first);
                  ExpectSame(a_ours, a_plain);
                  EXPECT_FALSE(a_ours.stats.amax_given);
                  ASSERT_TRUE(ahead.valid);
                  EXPECT_EQ(ahead.dtype, dtype);
                  EXPECT_EQ(ahead.elements, shape.rows * shape.cols);
                  EXPECT_EQ(ahead.nan_ignored, vllm);
                  EXPECT_EQ(ahead.bits, AbsMaxBits(b, dtype, vllm));

                  Call second = MakeCall(dtype, policy, threads, hash);
                  second.amax = &ahead;
                  const Result b_ours = Quantize(b_pieces, shape.rows, shape.cols, second);
                  ExpectSame(b_ours, b_plain);
                  EXPECT_TRUE(b_ours.stats.amax_given);
                  if (hash) {
                    EXPECT_EQ(a_ours.hash, XXH3OfBytes(a_plain.q));
                    EXPECT_EQ(b_ours.hash, XXH3OfBytes(b_plain.q));
                  }
                }
              }
            }
          }
        }
      }
    }
  }
}

// The largest element may be anywhere in the next tensor: at its start, its
// end, a piece boundary, in a vector tail. Each position in turn holds it.
TEST(Fp8QuantizerAheadTest, TheAmaxTakenAheadSeesEveryElement) {
  const DType dtype = DType::kBFloat16;
  const int64_t rows = 67, cols = 1031;  // 67 KiB of output: two hash units
  const std::vector<uint8_t> a = RandomValues(dtype, rows * cols, 1.0f, 3);
  for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{257}}) {
    std::vector<uint8_t> b = RandomValues(dtype, n, 1.0f, 4);
    const uint16_t spike = 0x4480;  // 1024: far above every other value
    for (Fp8Isa isa : SupportedFp8Isas()) {
      ScopedFp8Isa scoped(isa);
      for (int threads : {1, 3}) {
        for (bool hash : {false, true}) {
          for (int parts : {1, 3}) {
            for (int64_t at = 0; at < n; ++at) {
              SCOPED_TRACE(absl::StrCat(internal::Fp8IsaName(isa), " n ", n, " at ", at,
                                        " threads ", threads, " hash ", hash, " parts ", parts));
              std::vector<uint8_t> spiked = b;
              std::memcpy(spiked.data() + at * 2, &spike, 2);
              const std::vector<Piece> pieces = Split(spiked, dtype, parts);
              Fp8Amax ahead;
              Call call = MakeCall(dtype, NonFinitePolicy::kReject, threads, hash);
              call.next = pieces;
              call.next_amax = &ahead;
              const Result r = Quantize(Split(a, dtype, 1), rows, cols, call);
              ASSERT_TRUE(r.status.ok()) << r.status;
              ASSERT_TRUE(ahead.valid);
              ASSERT_EQ(ahead.bits, spike & 0x7FFFu);
            }
          }
        }
      }
    }
  }
}

// A NaN in the next tensor does not stop the current one; under kReject
// the call for the next one refuses it as a plain call does, naming the
// element; under kVllmCompatible it is not counted.
TEST(Fp8QuantizerAheadTest, ANonFiniteValueAheadIsRefusedByTheNextTensorsOwnCall) {
  const DType dtype = DType::kFloat16;
  const std::vector<uint8_t> a = RandomValues(dtype, 40 * 100, 1.0f, 5);
  std::vector<uint8_t> b = RandomValues(dtype, 30 * 50, 1.0f, 6);
  const uint16_t nan = 0x7E00;
  std::memcpy(b.data() + (7 * 50 + 9) * 2, &nan, 2);
  for (NonFinitePolicy policy : {NonFinitePolicy::kReject, NonFinitePolicy::kVllmCompatible}) {
    const bool vllm = policy == NonFinitePolicy::kVllmCompatible;
    SCOPED_TRACE(absl::StrCat("vllm ", vllm));
    const std::vector<Piece> b_pieces = Split(b, dtype, 1);
    Fp8Amax ahead;
    Call first = MakeCall(dtype, policy, 2);
    first.next = b_pieces;
    first.next_amax = &ahead;
    const Result a_ours = Quantize(Split(a, dtype, 1), 40, 100, first);
    ExpectSame(a_ours, Quantize(Split(a, dtype, 1), 40, 100, MakeCall(dtype, policy)));
    ASSERT_TRUE(ahead.valid);
    EXPECT_EQ(ahead.bits, AbsMaxBits(b, dtype, vllm));
    Call second = MakeCall(dtype, policy, 2);
    second.amax = &ahead;
    const Result b_ours = Quantize(b_pieces, 30, 50, second);
    const Result b_plain = Quantize(b_pieces, 30, 50, MakeCall(dtype, policy));
    if (vllm) {
      ExpectSame(b_ours, b_plain);
    } else {
      EXPECT_EQ(b_ours.status.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(b_ours.status.message(), HasSubstr("element 359 (row 7, col 9) is nan"));
      EXPECT_EQ(b_ours.status, b_plain.status);
    }
  }
}

// An amax that does not fit the call (another dtype, element count or
// policy, or not valid) is ignored: the call takes its own.
TEST(Fp8QuantizerAheadTest, AnAmaxThatDoesNotFitTheCallIsIgnored) {
  const DType dtype = DType::kBFloat16;
  const std::vector<uint8_t> b = RandomValues(dtype, 30 * 50, 1.0f, 7);
  const Result plain =
      Quantize(Split(b, dtype, 1), 30, 50, MakeCall(dtype, NonFinitePolicy::kReject));
  Fp8Amax right;
  right.valid = true;
  right.dtype = dtype;
  right.elements = 30 * 50;
  right.bits = AbsMaxBits(b, dtype, false);
  Fp8Amax wrong[5] = {right, right, right, right, right};
  wrong[0].valid = false;
  wrong[1].dtype = DType::kFloat16;
  wrong[2].elements = 30 * 50 + 1;
  wrong[3].nan_ignored = true;
  for (Fp8Amax& w : wrong) w.bits = 0x3F80;  // 1.0: a different scale if it were used
  Call call = MakeCall(dtype, NonFinitePolicy::kReject);
  call.amax = &right;
  const Result used = Quantize(Split(b, dtype, 1), 30, 50, call);
  ExpectSame(used, plain);
  EXPECT_TRUE(used.stats.amax_given);
  for (int i = 0; i < 4; ++i) {
    SCOPED_TRACE(i);
    call.amax = &wrong[i];
    const Result r = Quantize(Split(b, dtype, 1), 30, 50, call);
    ExpectSame(r, plain);
    EXPECT_FALSE(r.stats.amax_given);
  }
  // Right but with bits that are not the source's: used as given (the caller
  // vouches for it), so the scale follows the bits.
  wrong[4].bits = right.bits + 0x80;  // twice the amax
  call.amax = &wrong[4];
  const Result trusted = Quantize(Split(b, dtype, 1), 30, 50, call);
  ASSERT_TRUE(trusted.status.ok());
  EXPECT_TRUE(trusted.stats.amax_given);
  EXPECT_EQ(trusted.scale, 2 * plain.scale);
}

// A source whose values grew after its amax was taken ahead (a trainer
// writing into the memory a push reads in place) saturates at +-448, never
// a NaN code.
TEST(Fp8QuantizerAheadTest, ASourceThatGrowsAfterItsAmaxWasTakenSaturates) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (Fp8Isa isa : SupportedFp8Isas()) {
      ScopedFp8Isa scoped(isa);
      SCOPED_TRACE(absl::StrCat(internal::Fp8IsaName(isa), " ", DTypeName(dtype)));
      const std::vector<uint8_t> a = RandomValues(dtype, 20 * 64, 1.0f, 8);
      std::vector<uint8_t> b = RandomValues(dtype, 20 * 64, 1.0f, 9);
      const std::vector<Piece> b_pieces = Split(b, dtype, 1);
      Fp8Amax ahead;
      Call first = MakeCall(dtype, NonFinitePolicy::kReject);
      first.next = b_pieces;
      first.next_amax = &ahead;
      ASSERT_TRUE(Quantize(Split(a, dtype, 1), 20, 64, first).status.ok());
      // Now element 100 becomes -1000 and element 101 +Inf.
      const std::vector<uint8_t> grown = [&] {
        const float values[2] = {-1000.0f, std::numeric_limits<float>::infinity()};
        std::vector<uint8_t> out(2 * DTypeSize(dtype));
        EXPECT_TRUE(ConvertFloats(reinterpret_cast<const uint8_t*>(values), DType::kFloat32,
                                  out.data(), dtype, 2)
                        .ok());
        return out;
      }();
      std::memcpy(b.data() + 100 * DTypeSize(dtype), grown.data(), grown.size());
      Call second = MakeCall(dtype, NonFinitePolicy::kReject);
      second.amax = &ahead;
      const Result r = Quantize(b_pieces, 20, 64, second);
      ASSERT_TRUE(r.status.ok()) << r.status;
      EXPECT_EQ(r.q[100], 0xFE);  // -448
      EXPECT_EQ(r.q[101], 0x7E);  // +448
      for (uint8_t code : r.q) EXPECT_NE(code & 0x7F, 0x7F);
    }
  }
}

// Calls that make no convert pass over their source hand on no amax, and
// leave none from an earlier call behind; so do calls whose next pieces are
// not whole elements, and the other schemes.
TEST(Fp8QuantizerAheadTest, CallsWithoutAConvertPassHandOnNoAmax) {
  const DType dtype = DType::kBFloat16;
  const std::vector<uint8_t> b = RandomValues(dtype, 16 * 16, 1.0f, 10);
  const std::vector<Piece> b_pieces = Split(b, dtype, 1);
  const std::vector<uint8_t> a = RandomValues(dtype, 32 * 32, 1.0f, 11);
  const Result a_plain =
      Quantize(Split(a, dtype, 1), 32, 32, MakeCall(dtype, NonFinitePolicy::kReject));
  std::vector<uint8_t> zeros(32 * 32 * 2, 0);
  std::vector<uint8_t> tiny(32 * 32 * 2, 0);
  const uint16_t denormal = 0x0001;  // amax so small that 1/s overflows
  std::memcpy(tiny.data(), &denormal, 2);
  std::vector<uint8_t> with_nan = a;
  const uint16_t nan = 0x7FC0;
  std::memcpy(with_nan.data() + 6, &nan, 2);
  const Piece odd_piece[] = {Piece(b.data(), 3)};
  struct Case {
    std::string what;
    const std::vector<uint8_t>* source;
    NonFinitePolicy policy;
    float hint;
    absl::Span<const Piece> next;
    bool ok;
  } cases[] = {
      {"a hint that holds", &a, NonFinitePolicy::kReject, a_plain.scale, b_pieces, true},
      {"all zero under vllm", &zeros, NonFinitePolicy::kVllmCompatible, 0.0f, b_pieces, true},
      {"an infinite inverse", &tiny, NonFinitePolicy::kReject, 0.0f, b_pieces, true},
      {"a refused NaN", &with_nan, NonFinitePolicy::kReject, 0.0f, b_pieces, false},
      {"next not whole elements", &a, NonFinitePolicy::kReject, 0.0f, odd_piece, true},
      {"no next elements", &a, NonFinitePolicy::kReject, 0.0f, {}, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Fp8Amax ahead;
    ahead.valid = true;  // left from an earlier call: must be cleared
    Call call = MakeCall(dtype, c.policy, 2, true);
    call.hint = c.hint;
    call.next = c.next;
    call.next_amax = &ahead;
    const Result r = Quantize(Split(*c.source, dtype, 1), 32, 32, call);
    EXPECT_EQ(r.status.ok(), c.ok) << r.status;
    EXPECT_FALSE(ahead.valid);
  }
  for (QuantScheme scheme : {QuantScheme::kPerChannel, QuantScheme::kBlock128}) {
    Fp8Amax ahead;
    ahead.valid = true;
    Fp8QuantizeOptions options;
    options.scheme = scheme;
    options.next = b_pieces;
    options.next_amax = &ahead;
    std::vector<uint8_t> q(32 * 32);
    std::vector<float> scales(static_cast<size_t>(Fp8NumScales(scheme, 32, 32)));
    ASSERT_TRUE(QuantizeFp8(a.data(), dtype, 32, 32, options, q.data(), scales.data(), "w").ok());
    EXPECT_FALSE(ahead.valid);
  }
}

}  // namespace
}  // namespace refit::core
