#include "core/fp8_quantizer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "core/fp8_quantizer_internal.h"
#include "core/hash_feed.h"
#include "core/parallel.h"
#include "core/xxh3.h"

// x86-64 gets SSE2 packs and streaming stores, and AVX2 / AVX-512 variants;
// elsewhere (or with REFIT_FP8_GENERIC, to test that path on x86) only the
// generic kernel, with GCC's own narrowing.
#if (defined(__x86_64__) || defined(__i386__)) && !defined(REFIT_FP8_GENERIC)
#define REFIT_FP8_X86 1
#include <immintrin.h>
#else
#define REFIT_FP8_X86 0
#endif

// The kernels are written once with GCC vector extensions and compiled three
// times: baseline x86-64, AVX2 and AVX-512, chosen at run time. Vectors never
// cross a non-inlined call, so GCC's note that passing them by value depends
// on the ISA does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace refit::core {
namespace {

#define REFIT_FP8_INLINE inline __attribute__((always_inline))

// ---------------------------------------------------------------------------
// Encoding. Every path (scalar and each vector ISA) computes the code from the
// float32 bits of |y|, with |y| already clamped to [0, 448], the same way:
//   |y| >= 2^-6 (e4m3 normal): round the 23-bit mantissa to 3 bits, nearest
//     even, in integer arithmetic; the carry may bump the exponent, which is
//     exactly what rounding up to the next binade means. Then rebias 127 -> 7.
//   |y| <  2^-6 (e4m3 subnormal, step 2^-9): add 2^14, whose ulp is 2^-9, so
//     the FPU's round-to-nearest-even does the rounding; the low mantissa bits
//     are then the code 0..8 (8 = 2^-6 is the smallest normal, code 0x08).
// Integer math on IEEE bits and one correctly rounded float add give the same
// result on every ISA, which is what makes the variants byte-identical.

constexpr int32_t kF32AbsMask = 0x7FFFFFFF;
constexpr int32_t kF32InfBits = 0x7F800000;
constexpr int32_t kF32Bits448 = 0x43E00000;
constexpr int32_t kF32BitsFp8MinNormal = 0x3C800000;  // 2^-6
constexpr float kSubnormalRounder = 16384.0f;         // 2^14
constexpr int32_t kSubnormalRounderBits = 0x46800000;
// Added before dropping 20 mantissa bits: half an ulp of what stays, minus
// one (adding the lowest kept bit as well makes exact ties round to even),
// minus the exponent rebias 127 -> 7 in place, so that the shift leaves the
// code. Normal lanes (|y| >= 2^-6) stay non-negative.
constexpr int32_t kNormalBias = 0x7FFFF - ((127 - 7) << 23);
constexpr int32_t kFp8Max = 0x7E;  // 448
constexpr int32_t kFp8Nan = 0x7F;

REFIT_FP8_INLINE int32_t BitsOf(float f) {
  int32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}
REFIT_FP8_INLINE float FloatOf(int32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

REFIT_FP8_INLINE int32_t EncodeAbsScalar(int32_t a) {
  const int32_t normal = (a + kNormalBias + ((a >> 20) & 1)) >> 20;
  const int32_t sub = BitsOf(FloatOf(a) + kSubnormalRounder) - kSubnormalRounderBits;
  return a < kF32BitsFp8MinNormal ? sub : normal;
}

// ---------------------------------------------------------------------------
// Vector kernels, written once with GCC vector extensions and instantiated
// per ISA at that ISA's native width (kBytes = 16 / 32 / 64): wider generic
// vectors than the target has would make GCC scalarize the selects. Lanes are
// int32/float.

template <int kBytes>
struct Simd {
  typedef int32_t I32 __attribute__((vector_size(kBytes)));
  typedef float F32 __attribute__((vector_size(kBytes)));
  typedef uint32_t U32 __attribute__((vector_size(kBytes)));
  typedef uint8_t U8 __attribute__((vector_size(kBytes / 4)));  // one byte per lane
  static constexpr int64_t kLanes = kBytes / 4;
  REFIT_FP8_INLINE static I32 Splat(int32_t v) { return I32{} + v; }
};

// A full vector register of raw source bits, for the amax pass.
template <typename Bits, int kBytes>
struct Wide {
  typedef Bits type __attribute__((vector_size(kBytes)));
};

template <typename S>
REFIT_FP8_INLINE typename S::I32 EncodeAbs(typename S::I32 a) {
  using I32 = typename S::I32;
  using F32 = typename S::F32;
  const I32 normal = (a + kNormalBias + ((a >> 20) & 1)) >> 20;
  const I32 sub =
      reinterpret_cast<I32>(reinterpret_cast<F32>(a) + kSubnormalRounder) - kSubnormalRounderBits;
  return a < S::Splat(kF32BitsFp8MinNormal) ? sub : normal;
}

// Per source type: raw bits, how |x| becomes float32 exactly, where the sign
// is, and the bit pattern of +Inf (|bits| above it are NaN). Comparing the
// absolute bit patterns as unsigned integers orders them like |x|, Inf and NaN
// on top, which is what lets the amax pass find non-finite input for free.
struct Bf16Traits {
  using Bits = uint16_t;
  static constexpr uint32_t kAbsMask = 0x7FFF;
  static constexpr uint32_t kInf = 0x7F80;
  template <typename S>
  REFIT_FP8_INLINE static typename S::F32 AbsToFloat(typename S::I32 abs) {
    return reinterpret_cast<typename S::F32>(abs << 16);
  }
  template <typename S>
  REFIT_FP8_INLINE static typename S::I32 SignByte(typename S::I32 x) {
    return (x >> 8) & 0x80;
  }
  static float AbsBitsToFloat(uint32_t abs) { return FloatOf(static_cast<int32_t>(abs << 16)); }
};

struct Fp16Traits {
  using Bits = uint16_t;
  static constexpr uint32_t kAbsMask = 0x7FFF;
  static constexpr uint32_t kInf = 0x7C00;
  // Normals: move exponent and mantissa into place and rebias 15 -> 127.
  // Subnormals: mantissa * 2^-24 via an exact int -> float conversion, so no
  // float32 denormal is ever formed (denormals-are-zero could not bite).
  // Inf/NaN come out finite; only the kVllmCompatible path sees them, and it
  // overrides their codes.
  template <typename S>
  REFIT_FP8_INLINE static typename S::F32 AbsToFloat(typename S::I32 abs) {
    using F32 = typename S::F32;
    const F32 normal = reinterpret_cast<F32>((abs << 13) + ((127 - 15) << 23));
    const F32 sub = __builtin_convertvector(abs, F32) * 0x1p-24f;
    return abs < S::Splat(0x400) ? sub : normal;
  }
  template <typename S>
  REFIT_FP8_INLINE static typename S::I32 SignByte(typename S::I32 x) {
    return (x >> 8) & 0x80;
  }
  static float AbsBitsToFloat(uint32_t abs) {
    if (abs >= kInf) return std::numeric_limits<float>::infinity();
    if (abs < 0x400) return static_cast<float>(abs) * 0x1p-24f;
    return FloatOf(static_cast<int32_t>((abs << 13) + ((127 - 15) << 23)));
  }
};

struct F32Traits {
  using Bits = uint32_t;
  static constexpr uint32_t kAbsMask = 0x7FFFFFFF;
  static constexpr uint32_t kInf = 0x7F800000;
  template <typename S>
  REFIT_FP8_INLINE static typename S::F32 AbsToFloat(typename S::I32 abs) {
    return reinterpret_cast<typename S::F32>(abs);
  }
  template <typename S>
  REFIT_FP8_INLINE static typename S::I32 SignByte(typename S::I32 x) {
    return (x >> 24) & 0x80;
  }
  static float AbsBitsToFloat(uint32_t abs) { return FloatOf(static_cast<int32_t>(abs)); }
};

// Column blocks one kernel call handles at most (block scheme: a group of
// 128-column blocks; the other schemes: one block spanning the row).
constexpr int64_t kMaxBlocksPerCall = 512;

// How far ahead of its reads a pass asks for the source's cache lines. The
// hardware's stream prefetchers stop at every 4 KiB page boundary, and a
// trainer's shared memory comes in 4 KiB pages: without this, each page's
// first lines are fetched on demand, which on some machines (measured on a
// virtualized Intel Xeon: 1 GiB of bf16 quantized per tensor on 2 threads in
// 230-246 ms without, 153-164 ms with) leaves the passes at two thirds of
// the bandwidth they can get. A prefetch never faults, past the end of a
// mapping included.
constexpr int64_t kPrefetchBytes = 2048;
constexpr int64_t kCacheLine = 64;

// Prefetches the lines kPrefetchBytes ahead of one step's kStepBytes of
// source at `p` (one per step when a step is less than a line).
template <int64_t kStepBytes>
REFIT_FP8_INLINE void PrefetchAhead(const void* p) {
  const char* ahead = static_cast<const char*>(p) + kPrefetchBytes;
  for (int64_t off = 0; off < kStepBytes; off += kCacheLine) __builtin_prefetch(ahead + off);
}

// m = max(m, |a|) lane by lane, on raw source bits; with kIgnoreNan NaNs
// count as 0 (Inf still counts).
template <typename T, int kBytes, bool kIgnoreNan>
REFIT_FP8_INLINE void AbsMaxStep(typename Wide<typename T::Bits, kBytes>::type a,
                                 typename Wide<typename T::Bits, kBytes>::type& m) {
  using Bits = typename T::Bits;
  a &= static_cast<Bits>(T::kAbsMask);
  if constexpr (kIgnoreNan) {
    a = a > static_cast<Bits>(T::kInf) ? decltype(a){} : a;
  }
  m = a > m ? a : m;
}

// The largest lane of `m`.
template <typename W>
REFIT_FP8_INLINE uint32_t LaneMax(const W& m) {
  uint32_t result = 0;
  for (size_t lane = 0; lane < sizeof(W) / sizeof(m[0]); ++lane) {
    result = std::max<uint32_t>(result, m[lane]);
  }
  return result;
}

// out_max[b] = max |bits| over rows [0, nrows) and the b-th `block_cols`-wide
// column block of [0, ncols). Rows are walked in memory order, one vector
// accumulator per block, so the hardware prefetcher sees plain streams. With
// kIgnoreNan (vLLM semantics) NaNs count as 0; Inf still counts.
template <typename T, int kBytes, bool kIgnoreNan>
REFIT_FP8_INLINE void AbsMaxBlocks(const typename T::Bits* src, int64_t stride, int64_t nrows,
                                   int64_t ncols, int64_t block_cols, uint32_t* out_max) {
  using Bits = typename T::Bits;
  using W = typename Wide<Bits, kBytes>::type;
  constexpr int64_t kW = kBytes / sizeof(Bits);
  auto step = [](W a, W & m) __attribute__((always_inline)) {
    AbsMaxStep<T, kBytes, kIgnoreNan>(a, m);
  };
  if (block_cols <= 0) block_cols = 1;  // empty range: no blocks
  const int64_t nblocks = (ncols + block_cols - 1) / block_cols;
  W acc[kMaxBlocksPerCall];
  for (int64_t b = 0; b < nblocks; ++b) acc[b] = W{};
  for (int64_t r = 0; r < nrows; ++r) {
    const Bits* row = src + r * stride;
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t end = std::min(ncols, (b + 1) * block_cols);
      int64_t i = b * block_cols;
      W m0 = acc[b];
      W m1 = {};
      for (; i + 2 * kW <= end; i += 2 * kW) {
        W a, c;
        PrefetchAhead<2 * kBytes>(row + i);
        std::memcpy(&a, row + i, sizeof a);
        std::memcpy(&c, row + i + kW, sizeof c);
        step(a, m0);
        step(c, m1);
      }
      for (; i + kW <= end; i += kW) {
        W a;
        std::memcpy(&a, row + i, sizeof a);
        step(a, m0);
      }
      if (i < end) {
        W a = {};  // zero padding cannot raise the max
        std::memcpy(&a, row + i, (end - i) * sizeof(Bits));
        step(a, m1);
      }
      acc[b] = m1 > m0 ? m1 : m0;
    }
  }
  for (int64_t b = 0; b < nblocks; ++b) out_max[b] = LaneMax(acc[b]);
}

// The code of |x| * inv, given |x| as float32 bits (`abs_f32`).
// |x| * inv == |x * inv| in IEEE arithmetic, so the sign can ride apart.
// With |x| <= amax, inv = 1/(amax/448), each rounded once (and 1/s < 2^128,
// so s has >= 21 significant bits), give |x| * inv <= 448 * (1 + 2^-19),
// far below 464, the first value that would round past 448: the clamp of
// the formula changes no code. It is still done, on the bits (a NaN's are
// above 448's), because the source may change between the amax pass and
// this one (a trainer writing into the region a push reads in place): a
// value above the amax, Inf or NaN then saturates to 448 (with the source's
// sign) instead of giving the NaN code, or a code that spills into the next
// byte. (QuantizeWithInfiniteInverse handles inv = inf; kVllmCompatible
// overrides non-finite sources in QuantizeLanes.)
template <typename S>
REFIT_FP8_INLINE typename S::I32 EncodeProduct(typename S::I32 abs_f32, typename S::F32 inv) {
  using I32 = typename S::I32;
  using F32 = typename S::F32;
  I32 a = reinterpret_cast<I32>(reinterpret_cast<F32>(abs_f32) * inv);
  const I32 max = S::Splat(kF32Bits448);
  a = a < max ? a : max;
  return EncodeAbs<S>(a);
}

template <typename T, typename S, bool kVllm>
REFIT_FP8_INLINE typename S::I32 QuantizeLanes(typename S::I32 x, typename S::F32 inv) {
  using I32 = typename S::I32;
  const I32 abs = x & static_cast<int32_t>(T::kAbsMask);
  I32 code = EncodeProduct<S>(reinterpret_cast<I32>(T::template AbsToFloat<S>(abs)), inv);
  I32 sign = T::template SignByte<S>(x);
  if constexpr (kVllm) {
    // Non-finite sources saturate (Inf keeps its sign, NaN becomes +448)
    // whatever x * inv gave.
    const I32 inf = S::Splat(static_cast<int32_t>(T::kInf));
    code = abs >= inf ? S::Splat(kFp8Max) : code;
    sign = abs > inf ? I32{} : sign;
  }
  return code | sign;
}

// One step of the convert pass: one vector load of raw source bits. 32-bit
// sources give one code per lane. 16-bit sources are not widened (GCC's
// widening is poor); a load holds two elements per lane instead, 2j in the
// low half and 2j+1 in the high half, and the lane returns both codes in the
// same places (bits 0-7 and 16-23; the store narrows each 16-bit half to its
// byte): codes in memory order, and each sign lands in place with one shift.
template <typename T, int kBytes, bool kVllm>
REFIT_FP8_INLINE typename Simd<kBytes>::I32 QuantizeStep(const typename T::Bits* p,
                                                         typename Simd<kBytes>::F32 inv) {
  using S = Simd<kBytes>;
  using I32 = typename S::I32;
  I32 raw;
  std::memcpy(&raw, p, sizeof raw);
  if constexpr (std::is_same_v<T, Bf16Traits> && !kVllm) {
    // bf16 is the upper half of a float32: each element's magnitude, as
    // float32 bits, is one mask (odd) or a shift and a mask (even) of the
    // pair, and both signs (bits 15 and 31) move to bits 7 and 23 with one
    // shift. Same codes as the general path below (the product, its clamp
    // and its encoding are the same), in fewer instructions: on cores where
    // the convert is bound by its arithmetic, this is its speed.
    using U32 = typename S::U32;
    const U32 r = reinterpret_cast<U32>(raw);
    const I32 abs_even = reinterpret_cast<I32>((r << 16) & 0x7FFF0000u);
    const I32 abs_odd = reinterpret_cast<I32>(r & 0x7FFF0000u);
    const I32 signs = reinterpret_cast<I32>((r >> 8) & 0x00800080u);
    return EncodeProduct<S>(abs_even, inv) | (EncodeProduct<S>(abs_odd, inv) << 16) | signs;
  } else if constexpr (sizeof(typename T::Bits) == 2) {
    const I32 even = raw & 0xFFFF;
    const I32 odd = reinterpret_cast<I32>(reinterpret_cast<typename S::U32>(raw) >> 16);
    return QuantizeLanes<T, S, kVllm>(even, inv) | (QuantizeLanes<T, S, kVllm>(odd, inv) << 16);
  } else {
    return QuantizeLanes<T, S, kVllm>(raw, inv);
  }
}

// Stores a step's codes: kOut 1, the low byte of every lane (32-bit
// sources); kOut 2, the low byte of each 16-bit half of every lane (16-bit
// sources, see QuantizeStep). Every code is below 256, so unsigned saturating
// packs narrow exactly. GCC narrows 512-bit vectors well (vpmovdb / vpmovwb)
// but scalarizes narrower ones, so those use SSE2 packs (VEX-encoded inside
// the AVX2 kernels; an AVX2 intrinsic could not be inlined through the
// generic kernel). Stream: dst 16-byte aligned, non-temporal; only the
// 512-bit kernels stream.
template <int kBytes>
struct Halves {
  typedef uint16_t U16 __attribute__((vector_size(kBytes)));    // two per lane
  typedef uint8_t U8 __attribute__((vector_size(kBytes / 2)));  // a byte per half
};

#if REFIT_FP8_X86
template <int kBytes, int kOut>
struct OutStore;

template <int kOut>
struct OutStore<64, kOut> {
  using S = Simd<64>;
  static constexpr bool kCanStream = true;
  REFIT_FP8_INLINE static void Store(uint8_t* dst, S::I32 v) {
    if constexpr (kOut == 1) {
      const S::U8 out = __builtin_convertvector(v, S::U8);
      std::memcpy(dst, &out, sizeof out);
    } else {
      const Halves<64>::U8 out =
          __builtin_convertvector(reinterpret_cast<Halves<64>::U16>(v), Halves<64>::U8);
      std::memcpy(dst, &out, sizeof out);
    }
  }
  REFIT_FP8_INLINE static void Stream(uint8_t* dst, S::I32 v) {
    __m128i out[kOut];
    if constexpr (kOut == 1) {
      const S::U8 narrow = __builtin_convertvector(v, S::U8);
      std::memcpy(out, &narrow, sizeof out);
    } else {
      const Halves<64>::U8 narrow =
          __builtin_convertvector(reinterpret_cast<Halves<64>::U16>(v), Halves<64>::U8);
      std::memcpy(out, &narrow, sizeof out);
    }
    for (int k = 0; k < kOut; ++k) _mm_stream_si128(reinterpret_cast<__m128i*>(dst) + k, out[k]);
  }
};

template <int kOut>
struct OutStore<32, kOut> {
  using S = Simd<32>;
  static constexpr bool kCanStream = false;
  REFIT_FP8_INLINE static void Store(uint8_t* dst, S::I32 v) {
    __m128i halves[2];
    std::memcpy(halves, &v, sizeof halves);
    if constexpr (kOut == 1) {
      const __m128i words = _mm_packs_epi32(halves[0], halves[1]);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(words, words));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(halves[0], halves[1]));
    }
  }
  static void Stream(uint8_t*, S::I32) {}  // never called
};

template <int kOut>
struct OutStore<16, kOut> {
  using S = Simd<16>;
  static constexpr bool kCanStream = false;
  REFIT_FP8_INLINE static void Store(uint8_t* dst, S::I32 v) {
    __m128i x;
    std::memcpy(&x, &v, sizeof x);
    if constexpr (kOut == 1) {
      const __m128i words = _mm_packs_epi32(x, x);
      const int32_t bytes = _mm_cvtsi128_si32(_mm_packus_epi16(words, words));
      std::memcpy(dst, &bytes, sizeof bytes);
    } else {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(x, x));
    }
  }
  static void Stream(uint8_t*, S::I32) {}  // never called
};
#else
template <int kBytes, int kOut>
struct OutStore {
  using S = Simd<kBytes>;
  static constexpr bool kCanStream = false;
  REFIT_FP8_INLINE static void Store(uint8_t* dst, typename S::I32 v) {
    if constexpr (kOut == 1) {
      const typename S::U8 out = __builtin_convertvector(v, typename S::U8);
      std::memcpy(dst, &out, sizeof out);
    } else {
      using H = Halves<kBytes>;
      const typename H::U8 out =
          __builtin_convertvector(reinterpret_cast<typename H::U16>(v), typename H::U8);
      std::memcpy(dst, &out, sizeof out);
    }
  }
  static void Stream(uint8_t*, typename S::I32) {}  // never called
};
#endif  // REFIT_FP8_X86

// Quantizes a [nrows, ncols] tile; column block b (of `block_cols`) uses
// inv[b]. With `stream`, output goes out as non-temporal stores where it is
// 16-byte aligned: a large output is not read again by us, and skipping the
// read-for-ownership saves a third of the memory traffic of the pass.
template <typename T, int kBytes, bool kVllm>
REFIT_FP8_INLINE void QuantizeBlocks(const typename T::Bits* src, int64_t stride, int64_t nrows,
                                     int64_t ncols, int64_t block_cols, const float* inv,
                                     bool stream, uint8_t* dst, int64_t dst_stride) {
  using Bits = typename T::Bits;
  using S = Simd<kBytes>;
  constexpr int64_t kStep = kBytes / sizeof(Bits);  // elements (= output bytes) per step
  using Store = OutStore<kBytes, sizeof(Bits) == 2 ? 2 : 1>;
  if (block_cols <= 0) block_cols = 1;  // empty range: no blocks
  const int64_t nblocks = (ncols + block_cols - 1) / block_cols;
  for (int64_t r = 0; r < nrows; ++r) {
    const Bits* in = src + r * stride;
    uint8_t* out = dst + r * dst_stride;
    for (int64_t b = 0; b < nblocks; ++b) {
      const typename S::F32 vinv = typename S::F32{} + inv[b];
      const int64_t end = std::min(ncols, (b + 1) * block_cols);
      int64_t i = b * block_cols;
      if (Store::kCanStream && stream && reinterpret_cast<uintptr_t>(out + i) % 16 == 0) {
        for (; i + kStep <= end; i += kStep) {
          PrefetchAhead<kBytes>(in + i);
          Store::Stream(out + i, QuantizeStep<T, kBytes, kVllm>(in + i, vinv));
        }
      }
      for (; i + kStep <= end; i += kStep) {
        PrefetchAhead<kBytes>(in + i);
        Store::Store(out + i, QuantizeStep<T, kBytes, kVllm>(in + i, vinv));
      }
      if (i < end) {
        Bits tail[kStep] = {};
        std::memcpy(tail, in + i, (end - i) * sizeof(Bits));
        uint8_t bytes[kStep];
        Store::Store(bytes, QuantizeStep<T, kBytes, kVllm>(tail, vinv));
        std::memcpy(out + i, bytes, end - i);
      }
    }
  }
  // Non-temporal stores are weakly ordered: fence before the caller publishes
  // (thread join, return).
#if REFIT_FP8_X86
  if (Store::kCanStream && stream) _mm_sfence();
#endif
}

// The convert pass over `n` contiguous elements with one inverse scale that
// also returns their max |bits| (AbsMaxBlocks' value for one block, NaNs
// counting as 0 under kVllm): the per-tensor quantizer's one pass when the
// scale it was given turns out to be the tensor's own.
template <typename T, int kBytes, bool kVllm>
REFIT_FP8_INLINE uint32_t QuantizeTrackingMax(const typename T::Bits* in, int64_t n, float inv,
                                              bool stream, uint8_t* out) {
  using Bits = typename T::Bits;
  using S = Simd<kBytes>;
  using W = typename Wide<Bits, kBytes>::type;
  constexpr int64_t kStep = kBytes / sizeof(Bits);
  using Store = OutStore<kBytes, sizeof(Bits) == 2 ? 2 : 1>;
  const typename S::F32 vinv = typename S::F32{} + inv;
  W m = {};
  auto track = [&](const Bits* p) __attribute__((always_inline)) {
    W a;
    std::memcpy(&a, p, sizeof a);
    AbsMaxStep<T, kBytes, kVllm>(a, m);
  };
  int64_t i = 0;
  if (Store::kCanStream && stream && reinterpret_cast<uintptr_t>(out) % 16 == 0) {
    for (; i + kStep <= n; i += kStep) {
      PrefetchAhead<kBytes>(in + i);
      track(in + i);
      Store::Stream(out + i, QuantizeStep<T, kBytes, kVllm>(in + i, vinv));
    }
  }
  for (; i + kStep <= n; i += kStep) {
    PrefetchAhead<kBytes>(in + i);
    track(in + i);
    Store::Store(out + i, QuantizeStep<T, kBytes, kVllm>(in + i, vinv));
  }
  if (i < n) {
    Bits tail[kStep] = {};  // zero padding cannot raise the max
    std::memcpy(tail, in + i, (n - i) * sizeof(Bits));
    track(tail);
    uint8_t bytes[kStep];
    Store::Store(bytes, QuantizeStep<T, kBytes, kVllm>(tail, vinv));
    std::memcpy(out + i, bytes, n - i);
  }
#if REFIT_FP8_X86
  if (Store::kCanStream && stream) _mm_sfence();
#endif
  return LaneMax(m);
}

// The convert pass over `n` contiguous elements with one inverse scale that
// also takes the max |bits| of `side_n` elements at `side` (the source of
// the tensor the caller quantizes next, same type; AbsMaxBlocks' value for
// one block): its side loads are spread evenly among the convert's steps, so
// a core bound by the convert's arithmetic reads the next tensor while it
// computes, instead of in a pass of its own that waits on memory.
template <typename T, int kBytes, bool kVllm>
REFIT_FP8_INLINE uint32_t QuantizeWithSideMax(const typename T::Bits* in, int64_t n, float inv,
                                              bool stream, uint8_t* out,
                                              const typename T::Bits* side, int64_t side_n) {
  using Bits = typename T::Bits;
  using S = Simd<kBytes>;
  using W = typename Wide<Bits, kBytes>::type;
  constexpr int64_t kStep = kBytes / sizeof(Bits);
  using Store = OutStore<kBytes, sizeof(Bits) == 2 ? 2 : 1>;
  const typename S::F32 vinv = typename S::F32{} + inv;
  W m = {};
  auto track = [&](const Bits* p) __attribute__((always_inline)) {
    W a;
    std::memcpy(&a, p, sizeof a);
    AbsMaxStep<T, kBytes, kVllm>(a, m);
  };
  const int64_t steps = n / kStep;
  const int64_t side_steps = side_n / kStep;
  // Side steps are owed at side_steps / steps per convert step (Bresenham).
  int64_t owed = 0;
  int64_t j = 0;  // side elements read
  auto side_catch_up = [&]() __attribute__((always_inline)) {
    owed += side_steps;
    while (owed >= steps) {
      owed -= steps;
      PrefetchAhead<kBytes>(side + j);
      track(side + j);
      j += kStep;
    }
  };
  const bool streaming = Store::kCanStream && stream && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  for (int64_t i = 0; i < steps * kStep; i += kStep) {
    PrefetchAhead<kBytes>(in + i);
    if (streaming) {
      Store::Stream(out + i, QuantizeStep<T, kBytes, kVllm>(in + i, vinv));
    } else {
      Store::Store(out + i, QuantizeStep<T, kBytes, kVllm>(in + i, vinv));
    }
    side_catch_up();
  }
  for (; j + kStep <= side_n; j += kStep) track(side + j);
  if (j < side_n) {
    Bits tail[kStep] = {};  // zero padding cannot raise the max
    std::memcpy(tail, side + j, (side_n - j) * sizeof(Bits));
    track(tail);
  }
  const int64_t i = steps * kStep;
  if (i < n) {
    Bits tail[kStep] = {};
    std::memcpy(tail, in + i, (n - i) * sizeof(Bits));
    uint8_t bytes[kStep];
    Store::Store(bytes, QuantizeStep<T, kBytes, kVllm>(tail, vinv));
    std::memcpy(out + i, bytes, n - i);
  }
#if REFIT_FP8_X86
  if (streaming) _mm_sfence();
#endif
  return LaneMax(m);
}

using AbsMaxFn = void (*)(const void* src, int64_t stride, int64_t nrows, int64_t ncols,
                          int64_t block_cols, bool ignore_nan, uint32_t* out_max);
using QuantizeFn = void (*)(const void* src, int64_t stride, int64_t nrows, int64_t ncols,
                            int64_t block_cols, const float* inv, bool vllm, bool stream,
                            uint8_t* dst, int64_t dst_stride);
using QuantizeMaxFn = uint32_t (*)(const void* src, int64_t n, float inv, bool vllm, bool stream,
                                   uint8_t* dst);
using QuantizeSideFn = uint32_t (*)(const void* src, int64_t n, float inv, bool vllm, bool stream,
                                    uint8_t* dst, const void* side, int64_t side_n);

// One non-inlined entry point per (ISA, source type, pass); the kernels above
// are inlined into it and compiled for its target.
#define REFIT_FP8_DEFINE_KERNELS(NAME, BYTES, ATTR)                                               \
  template <typename T>                                                                           \
  ATTR void AbsMax##NAME(const void* src, int64_t stride, int64_t nrows, int64_t ncols,           \
                         int64_t block_cols, bool ignore_nan, uint32_t* out_max) {                \
    const auto* p = static_cast<const typename T::Bits*>(src);                                    \
    if (ignore_nan) {                                                                             \
      AbsMaxBlocks<T, BYTES, true>(p, stride, nrows, ncols, block_cols, out_max);                 \
    } else {                                                                                      \
      AbsMaxBlocks<T, BYTES, false>(p, stride, nrows, ncols, block_cols, out_max);                \
    }                                                                                             \
  }                                                                                               \
  template <typename T>                                                                           \
  ATTR void Quantize##NAME(const void* src, int64_t stride, int64_t nrows, int64_t ncols,         \
                           int64_t block_cols, const float* inv, bool vllm, bool stream,          \
                           uint8_t* dst, int64_t dst_stride) {                                    \
    const auto* p = static_cast<const typename T::Bits*>(src);                                    \
    if (vllm) {                                                                                   \
      QuantizeBlocks<T, BYTES, true>(p, stride, nrows, ncols, block_cols, inv, stream, dst,       \
                                     dst_stride);                                                 \
    } else {                                                                                      \
      QuantizeBlocks<T, BYTES, false>(p, stride, nrows, ncols, block_cols, inv, stream, dst,      \
                                      dst_stride);                                                \
    }                                                                                             \
  }                                                                                               \
  template <typename T>                                                                           \
  ATTR uint32_t QuantizeMax##NAME(const void* src, int64_t n, float inv, bool vllm, bool stream,  \
                                  uint8_t* dst) {                                                 \
    const auto* p = static_cast<const typename T::Bits*>(src);                                    \
    return vllm ? QuantizeTrackingMax<T, BYTES, true>(p, n, inv, stream, dst)                     \
                : QuantizeTrackingMax<T, BYTES, false>(p, n, inv, stream, dst);                   \
  }                                                                                               \
  template <typename T>                                                                           \
  ATTR uint32_t QuantizeSide##NAME(const void* src, int64_t n, float inv, bool vllm, bool stream, \
                                   uint8_t* dst, const void* side, int64_t side_n) {              \
    const auto* p = static_cast<const typename T::Bits*>(src);                                    \
    const auto* q = static_cast<const typename T::Bits*>(side);                                   \
    return vllm ? QuantizeWithSideMax<T, BYTES, true>(p, n, inv, stream, dst, q, side_n)          \
                : QuantizeWithSideMax<T, BYTES, false>(p, n, inv, stream, dst, q, side_n);        \
  }

REFIT_FP8_DEFINE_KERNELS(Portable, 16, )
#if REFIT_FP8_X86
REFIT_FP8_DEFINE_KERNELS(Avx2, 32, __attribute__((target("avx2"))))
REFIT_FP8_DEFINE_KERNELS(Avx512, 64,
                         __attribute__((target("avx512f,avx512bw,avx512vl,"
                                               "prefer-vector-width=512"))))
#endif

struct Kernels {
  AbsMaxFn abs_max;
  QuantizeFn quantize;
  QuantizeMaxFn quantize_max;
  QuantizeSideFn quantize_side;
};

// One row per ISA: kernels for bf16, fp16, fp32 sources.
#define REFIT_FP8_KERNEL_ROW(NAME)                                                               \
  {                                                                                              \
    {&AbsMax##NAME<Bf16Traits>, &Quantize##NAME<Bf16Traits>, &QuantizeMax##NAME<Bf16Traits>,     \
     &QuantizeSide##NAME<Bf16Traits>},                                                           \
        {&AbsMax##NAME<Fp16Traits>, &Quantize##NAME<Fp16Traits>, &QuantizeMax##NAME<Fp16Traits>, \
         &QuantizeSide##NAME<Fp16Traits>},                                                       \
        {&AbsMax##NAME<F32Traits>, &Quantize##NAME<F32Traits>, &QuantizeMax##NAME<F32Traits>,    \
         &QuantizeSide##NAME<F32Traits>},                                                        \
  }

// [isa][source type]. Off x86 the rows of the other ISAs repeat the generic
// kernel; CpuSupports never lets them be selected there.
constexpr Kernels kKernels[3][3] = {
    REFIT_FP8_KERNEL_ROW(Portable),
#if REFIT_FP8_X86
    REFIT_FP8_KERNEL_ROW(Avx2),
    REFIT_FP8_KERNEL_ROW(Avx512),
#else
    REFIT_FP8_KERNEL_ROW(Portable),
    REFIT_FP8_KERNEL_ROW(Portable),
#endif
};

using internal::Fp8Isa;

std::atomic<int> g_isa{-1};
std::atomic<void (*)(void*)> g_between_passes_hook{nullptr};
std::atomic<void*> g_between_passes_arg{nullptr};

bool CpuSupports(Fp8Isa isa) {
#if !REFIT_FP8_X86
  return isa == Fp8Isa::kPortable;
#else
  __builtin_cpu_init();
  switch (isa) {
    case Fp8Isa::kPortable:
      return true;
    case Fp8Isa::kAvx2:
      return __builtin_cpu_supports("avx2");
    case Fp8Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
  }
  return false;
#endif
}

Fp8Isa CurrentIsa() {
  int isa = g_isa.load(std::memory_order_relaxed);
  if (isa < 0) {
    Fp8Isa best = Fp8Isa::kPortable;
    if (CpuSupports(Fp8Isa::kAvx2)) best = Fp8Isa::kAvx2;
    if (CpuSupports(Fp8Isa::kAvx512)) best = Fp8Isa::kAvx512;
    isa = static_cast<int>(best);
    g_isa.store(isa, std::memory_order_relaxed);
  }
  return static_cast<Fp8Isa>(isa);
}

// ---------------------------------------------------------------------------
// Threading: contiguous ranges, one per worker. A call hands its ranges to
// helper threads kept between calls (RangePool) and works on them itself:
// whichever thread is free takes the next range, so the caller never waits
// for a helper that has not woken up yet. Small inputs use fewer ranges.

constexpr int64_t kMinElementsPerWorker = int64_t{1} << 18;

int ResolveThreads(int requested) { return requested > 0 ? requested : DefaultQuantizeThreads(); }

// SetHostThreads' cap; 0: none.
std::atomic<int> g_host_threads{0};

int Cores() {
  static const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return cores;
}

int WorkersFor(int threads, int64_t elements, int64_t tasks) {
  const int64_t by_size = (elements + kMinElementsPerWorker - 1) / kMinElementsPerWorker;
  return static_cast<int>(std::max<int64_t>(1, std::min({int64_t{threads}, by_size, tasks})));
}

// Helper threads for the quantizer, started on first use and kept for the
// life of the process (two passes per tensor used to start a thread each,
// hundreds per refit). One call at a time uses them: a call that finds the
// pool taken (another model group's worker, say) starts threads of its own.
// Helpers wait for work spinning briefly (the next pass or tensor usually
// follows within microseconds), then sleeping.
class RangePool {
 public:
  static RangePool& Get() {
    static RangePool* pool = new RangePool;  // never destroyed: helpers may be waiting at exit
    return *pool;
  }

  // Runs task(i) for every i in [0, ranges), on this thread and on up to
  // `ranges - 1` helpers. False, with nothing run, if another call holds
  // the pool.
  bool TryRun(int ranges, const std::function<void(int)>& task) {
    std::unique_lock<std::mutex> claim(busy_, std::try_to_lock);
    if (!claim.owns_lock()) return false;
    Grow(ranges - 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      task_ = &task;
      ranges_ = ranges;
      next_.store(0, std::memory_order_relaxed);
      pending_.store(ranges, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    // Sleeping helpers, as many as there are ranges to share (spinning ones
    // see the new generation by themselves).
    for (int i = 1; i < ranges; ++i) wake_.notify_one();
    Work();
    // Every range is taken; wait for the helpers still running one. The
    // last check and the reset happen under mu_, where helpers join: none
    // can join this call after it.
    for (int spin = 0; spin < kSpins && pending_.load(std::memory_order_acquire) > 0; ++spin) {
      Pause();
    }
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
    task_ = nullptr;
    return true;
  }

 private:
  static constexpr int kSpins = 1000;  // some tens of microseconds of pause instructions

  static void Pause() {
#if REFIT_FP8_X86
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  // Takes and runs ranges until none is left.
  void Work() {
    const std::function<void(int)>* task = task_;
    const int ranges = ranges_;
    for (int i = next_.fetch_add(1, std::memory_order_relaxed); i < ranges;
         i = next_.fetch_add(1, std::memory_order_relaxed)) {
      (*task)(i);
      Done();
    }
  }

  // One range, or one helper's stay in a call, is over.
  void Done() {
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mu_);
      done_.notify_all();
    }
  }

  void Grow(int helpers) {
    while (static_cast<int>(threads_.size()) < helpers) {
      try {
        threads_.emplace_back([this] { Loop(); });
      } catch (const std::system_error&) {
        return;  // out of threads: the caller runs what no helper takes
      }
    }
  }

  void Loop() {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      int spin = 0;
      while (generation_.load(std::memory_order_acquire) == seen && spin < kSpins) {
        Pause();
        ++spin;
      }
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
        seen = generation_.load(std::memory_order_relaxed);
        // A call that already finished (its ranges all taken) leaves
        // nothing to join.
        if (task_ == nullptr) continue;
        // Holding a range (below) keeps the call, and so task_, alive.
        if (next_.load(std::memory_order_relaxed) >= ranges_) continue;
        pending_.fetch_add(1, std::memory_order_relaxed);  // joined: the call waits for us
      }
      Work();
      Done();
    }
  }

  std::mutex busy_;                   // held by the call using the pool
  std::vector<std::thread> threads_;  // only the call holding busy_ grows it
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::atomic<uint64_t> generation_{0};
  const std::function<void(int)>* task_ = nullptr;  // guarded by mu_ for the helpers' join
  int ranges_ = 0;
  std::atomic<int> next_{0};
  std::atomic<int> pending_{0};  // ranges not yet finished, plus helpers inside Work()
};

// Runs fn(worker, begin, end) for `workers` contiguous ranges covering
// [0, count), every boundary but the last a multiple of `align`.
template <typename Fn>
void ParallelRanges(int workers, int64_t count, int64_t align, const Fn& fn) {
  auto bound = [&](int w) -> int64_t {
    if (w >= workers) return count;
    const int64_t even = static_cast<int64_t>(static_cast<__int128>(count) * w / workers);
    return even / align * align;
  };
  if (workers <= 1) {
    fn(0, 0, count);
    return;
  }
  RunInParallel(workers, [&](int w) { fn(w, bound(w), bound(w + 1)); });
}

// ---------------------------------------------------------------------------

int SourceIndex(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return 0;
    case DType::kFloat16:
      return 1;
    default:
      return 2;
  }
}

uint32_t InfBits(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return Bf16Traits::kInf;
    case DType::kFloat16:
      return Fp16Traits::kInf;
    default:
      return F32Traits::kInf;
  }
}

float AbsBitsToFloat(DType dtype, uint32_t abs) {
  switch (dtype) {
    case DType::kBFloat16:
      return Bf16Traits::AbsBitsToFloat(abs);
    case DType::kFloat16:
      return Fp16Traits::AbsBitsToFloat(abs);
    default:
      return F32Traits::AbsBitsToFloat(abs);
  }
}

// inv = 1/s, 0 for s == 0.
float InverseScale(float s) { return s == 0.0f ? 0.0f : 1.0f / s; }

// When amax < ~1.3e-36, s is so small that inv = 1/s overflows to inf. The
// formula then gives x * inf: +-448 for non-zero x and NaN for zeros, which
// becomes +448 as every NaN product does in vLLM's kernel. The vector kernels
// do not implement NaN products (under kReject they cannot occur otherwise),
// so such tensors take this scalar path; core/cuda/fp8_math.h does the same,
// so CPU and GPU bytes agree. (The LibTorch op chain would store NaN bytes; no
// real weight gets here.)
bool InverseOverflows(float s) { return s != 0.0f && std::isinf(1.0f / s); }

void QuantizeWithInfiniteInverse(const uint8_t* src, DType dtype, int64_t count, uint8_t* dst) {
  const float inv = std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < count; ++i) {
    const float product = LoadAsFloat(src, dtype, static_cast<size_t>(i)) * inv;
    dst[i] = std::isnan(product) ? kFp8Max : Fp8E4M3FromFloat(product);
  }
}

std::string FloatTypeList() { return "F32, F16 or BF16"; }

// Only runs once a pass has seen a non-finite value: finds the first one in
// memory order (over `pieces`, laid end to end) so that the error names the
// same element however the work was split.
absl::Status NonFiniteError(absl::Span<const absl::Span<const uint8_t>> pieces, DType dtype,
                            int64_t cols, absl::string_view tensor_name) {
  const uint32_t inf = InfBits(dtype);
  const int64_t esize = static_cast<int64_t>(DTypeSize(dtype));
  int64_t index = -1;
  int64_t base = 0;  // element index of the piece's first element
  const uint8_t* at = nullptr;
  for (absl::Span<const uint8_t> piece : pieces) {
    const int64_t n = static_cast<int64_t>(piece.size()) / esize;
    for (int64_t i = 0; i < n && index < 0; ++i) {
      uint32_t abs;
      switch (dtype) {
        case DType::kBFloat16:
        case DType::kFloat16:
          abs = reinterpret_cast<const uint16_t*>(piece.data())[i] & 0x7FFFu;
          break;
        default:
          abs = reinterpret_cast<const uint32_t*>(piece.data())[i] & 0x7FFFFFFFu;
          break;
      }
      if (abs >= inf) {
        index = base + i;
        at = piece.data() + i * esize;
      }
    }
    if (index >= 0) break;
    base += n;
  }
  if (index < 0) {
    // Only a source that changed while it was read (a trainer writing into
    // the shared memory a push reads in place): the caller's doing, so not
    // INTERNAL.
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor '", tensor_name,
        "': a non-finite value was read, then was not there when looked for again: the source "
        "changed while refitd read it (written by the trainer during the push?)"));
  }
  const float value = LoadAsFloat(at, dtype, 0);
  const char* text = std::isnan(value) ? "nan" : (value > 0 ? "inf" : "-inf");
  absl::Status status = absl::InvalidArgumentError(
      absl::StrCat("tensor '", tensor_name, "': element ", index, " (row ", index / cols, ", col ",
                   index % cols, ") is ", text, "; FP8 quantization rejects non-finite weights"));
  SetNonFiniteElement(status, index / cols, index % cols);
  return status;
}

absl::Status NonFiniteError(const void* src, DType dtype, int64_t rows, int64_t cols,
                            absl::string_view tensor_name) {
  const absl::Span<const uint8_t> whole[] = {absl::Span<const uint8_t>(
      static_cast<const uint8_t*>(src), static_cast<size_t>(rows * cols) * DTypeSize(dtype))};
  return NonFiniteError(whole, dtype, cols, tensor_name);
}

struct Job {
  const uint8_t* src;
  DType dtype;
  int64_t esize;
  int64_t rows;
  int64_t cols;
  bool vllm;
  bool stream;
  int threads;
  Kernels k;
  uint8_t* out_q;
  float* out_scales;
  absl::string_view name;
  float scale_hint;
  Fp8QuantizeStats* stats;
  // Fp8QuantizeOptions::out_hash's running hash, fed this job's output in
  // memory order (null: not asked for).
  XXH3_state_t* hash;
  // Per-tensor: Fp8QuantizeOptions::amax when it applies to this source,
  // else null; Fp8QuantizeOptions::next (checked: whole elements, at least
  // one) and next_amax, else empty and null.
  const Fp8Amax* amax;
  absl::Span<const absl::Span<const uint8_t>> next;
  Fp8Amax* next_amax;
};

// Output bytes per unit of hashing: 64 KiB, from 128-256 KiB of source, in
// L2 while it is hashed.
constexpr int64_t kHashUnitBytes = int64_t{1} << 16;

// Feeds `n` output bytes at `out` to the job's hash, if it has one (outputs
// written without a HashFeed).
void FeedHash(const Job& job, const uint8_t* out, int64_t n) {
  if (job.hash != nullptr && n > 0) XXH3_64bits_update(job.hash, out, static_cast<size_t>(n));
}

// Outputs at least this large are written with non-temporal stores: they
// cannot stay in cache anyway, and the caller's next step (copy to the live
// tensor or the GPU) is a separate pass.
constexpr int64_t kStreamingMinBytes = int64_t{16} << 20;

// Elements per backwards step of the per-tensor convert pass (a multiple of
// 64, so that chunk starts keep the output's 16-byte alignment).
constexpr int64_t kReverseChunk = int64_t{1} << 19;

// Calls fn(src, count, at) for the parts of `pieces` (laid end to end) that
// elements [begin, end) cover: `src` the part's first element, `at` its
// index in the whole. Pieces in order, or last first with `reverse`.
template <typename Fn>
void ForEachPart(absl::Span<const absl::Span<const uint8_t>> pieces,
                 absl::Span<const int64_t> first, int64_t esize, int64_t begin, int64_t end,
                 bool reverse, const Fn& fn) {
  const int64_t n = static_cast<int64_t>(pieces.size());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = reverse ? n - 1 - i : i;
    const int64_t lo = std::max(begin, first[p]);
    const int64_t hi = std::min(end, first[p + 1]);
    if (lo < hi) fn(pieces[p].data() + (lo - first[p]) * esize, hi - lo, lo);
  }
}

// Calls fn(src, count, at, side, side_count) over elements [begin, end) of
// `pieces` and elements [side_begin, side_end) of `side_pieces` (each laid
// end to end), in order, each call within one part of either and with a
// share of the side range proportional to its share of [begin, end): the
// side is spread evenly over the main range, whatever the parts.
template <typename Fn>
void ForEachPartWithSide(absl::Span<const absl::Span<const uint8_t>> pieces,
                         absl::Span<const int64_t> first,
                         absl::Span<const absl::Span<const uint8_t>> side_pieces,
                         absl::Span<const int64_t> side_first, int64_t esize, int64_t begin,
                         int64_t end, int64_t side_begin, int64_t side_end, const Fn& fn) {
  const int64_t n = end - begin;
  const int64_t side_n = side_end - side_begin;
  // The side element where main element m's share ends.
  auto side_at = [&](int64_t m) {
    return n == 0
               ? side_end
               : side_begin + static_cast<int64_t>(static_cast<__int128>(m - begin) * side_n / n);
  };
  // The main element where side element x's share ends (at most).
  auto main_at = [&](int64_t x) {
    return side_n == 0
               ? end
               : begin + static_cast<int64_t>(static_cast<__int128>(x - side_begin) * n / side_n);
  };
  size_t p = 0, q = 0;  // the current part of each
  int64_t m = begin, x = side_begin;
  while (m < end || x < side_end) {
    while (p + 1 < first.size() && first[p + 1] <= m && m < end) ++p;
    while (q + 1 < side_first.size() && side_first[q + 1] <= x && x < side_end) ++q;
    const int64_t m_stop = m < end ? std::min(end, first[p + 1]) : m;
    const int64_t x_stop = x < side_end ? std::min(side_end, side_first[q + 1]) : x;
    int64_t m_to = m_stop;
    int64_t x_to = std::max(x, side_at(m_stop));
    if (x_to > x_stop) {  // the side part ends first: take main up to its share
      x_to = x_stop;
      m_to = std::clamp(main_at(x_stop), m, m_stop);
    }
    fn(m < end ? pieces[p].data() + (m - first[p]) * esize : nullptr, m_to - m, m,
       x < side_end ? side_pieces[q].data() + (x - side_first[q]) * esize : nullptr, x_to - x);
    m = m_to;
    x = x_to;
  }
}

// Per-tensor quantization of `pieces` laid end to end (one piece: the whole
// source): one scale over all of them. Each pass is one parallel call over
// all the elements, whatever the number of pieces (a fused weight whose
// parts lie in separate trainer storages is several). With Job::hash the
// convert goes unit by unit instead (HashFeed), hashing as it writes.
absl::Status QuantizePerTensor(const Job& job, absl::Span<const absl::Span<const uint8_t>> pieces) {
  std::vector<int64_t> first(pieces.size() + 1, 0);  // each piece's first element
  for (size_t p = 0; p < pieces.size(); ++p) {
    first[p + 1] = first[p] + static_cast<int64_t>(pieces[p].size()) / job.esize;
  }
  const int64_t total = first.back();
  const int workers = WorkersFor(job.threads, total, total);
  const bool hashing = job.hash != nullptr;
  // Looking ahead (Fp8QuantizeOptions::next): the convert pass takes the
  // next source's amax, each range of this source with its share of it.
  const bool ahead = job.next_amax != nullptr;
  std::vector<int64_t> next_first(job.next.size() + 1, 0);
  for (size_t p = 0; p < job.next.size(); ++p) {
    next_first[p + 1] = next_first[p] + static_cast<int64_t>(job.next[p].size()) / job.esize;
  }
  const int64_t next_total = next_first.back();
  std::vector<uint32_t> next_partial(workers, 0);
  auto share = [&](int64_t i) {
    return i >= total ? next_total
                      : static_cast<int64_t>(static_cast<__int128>(i) * next_total / total);
  };
  // The convert of output bytes [begin, end) (= elements) with `inv`;
  // returns their max |bits| when `track`.
  auto convert = [&](int64_t begin, int64_t end, float inv, bool track) {
    uint32_t m = 0;
    ForEachPart(
        pieces, first, job.esize, begin, end, /*reverse=*/false,
        [&](const uint8_t* src, int64_t count, int64_t at) {
          if (track) {
            m = std::max(m,
                         job.k.quantize_max(src, count, inv, job.vllm, job.stream, job.out_q + at));
          } else {
            job.k.quantize(src, 0, 1, count, count, &inv, job.vllm, job.stream, job.out_q + at, 0);
          }
        });
    return m;
  };
  // The last convert of elements [begin, end) with `inv`, by worker w.
  auto final_convert = [&](int w, int64_t begin, int64_t end, float inv) {
    if (!ahead) {
      convert(begin, end, inv, false);
      return;
    }
    ForEachPartWithSide(
        pieces, first, job.next, next_first, job.esize, begin, end, share(begin), share(end),
        [&](const uint8_t* src, int64_t count, int64_t at, const uint8_t* side, int64_t side_n) {
          next_partial[w] =
              std::max(next_partial[w], job.k.quantize_side(src, count, inv, job.vllm, job.stream,
                                                            job.out_q + at, side, side_n));
        });
  };
  // With a usable hint, pass 1 converts with the hinted scale while it takes
  // the amax; if the amax gives that same scale, those are the bytes pass 2
  // would write (the clamp-free convert below only needs |x| <= amax, and
  // every code follows from the scale alone), and the tensor was read once.
  // Otherwise its output is overwritten by pass 2, with the amax it found.
  // An amax taken ahead by the call before (Fp8QuantizeOptions::amax) makes
  // pass 1 unnecessary, hint or not.
  const bool given = job.amax != nullptr;
  const bool speculate = !given && job.scale_hint > 0 && std::isfinite(job.scale_hint) &&
                         !InverseOverflows(job.scale_hint);
  std::vector<uint32_t> partial(workers, 0);
  // Pass 1 without a hint: worker w's max |bits| over elements [begin, end).
  auto take_amax = [&](int w, int64_t begin, int64_t end) {
    ForEachPart(pieces, first, job.esize, begin, end, /*reverse=*/false,
                [&](const uint8_t* src, int64_t count, int64_t) {
                  uint32_t m = 0;
                  job.k.abs_max(src, 0, 1, count, count, job.vllm, &m);
                  partial[w] = std::max(partial[w], m);
                });
  };
  if (given) {
    partial[0] = job.amax->bits;
    if (job.stats != nullptr) job.stats->amax_given = true;
  } else if (speculate && hashing) {
    HashFeed feed(job.hash, job.out_q, total, kHashUnitBytes);
    ForEachUnit(workers, feed, [&](int w, int64_t u) {
      const int64_t begin = u * kHashUnitBytes;
      const uint32_t m = convert(begin, std::min(total, begin + kHashUnitBytes),
                                 InverseScale(job.scale_hint), true);
      partial[w] = std::max(partial[w], m);
      return true;
    });
  } else if (hashing && !speculate) {
    // The hashing convert below takes units first to last, so pass 1 walks
    // them last to first: the units it read last, still in cache, are the
    // ones the convert reads first.
    std::atomic<int64_t> next{(total + kHashUnitBytes - 1) / kHashUnitBytes};
    RunInParallel(workers, [&](int w) {
      for (int64_t u = next.fetch_sub(1, std::memory_order_relaxed) - 1; u >= 0;
           u = next.fetch_sub(1, std::memory_order_relaxed) - 1) {
        const int64_t begin = u * kHashUnitBytes;
        take_amax(w, begin, std::min(total, begin + kHashUnitBytes));
      }
    });
  } else {
    ParallelRanges(workers, total, 64, [&](int w, int64_t begin, int64_t end) {
      if (speculate) {
        partial[w] = convert(begin, end, InverseScale(job.scale_hint), true);
        return;
      }
      take_amax(w, begin, end);
    });
  }
  const uint32_t amax_bits = *std::max_element(partial.begin(), partial.end());
  if (auto hook = g_between_passes_hook.load(std::memory_order_acquire); hook != nullptr) {
    hook(g_between_passes_arg.load(std::memory_order_relaxed));
  }
  // (Either way the amax says, for free, whether anything is Inf/NaN.)
  if (!job.vllm && amax_bits >= InfBits(job.dtype)) {
    return NonFiniteError(pieces, job.dtype, job.cols, job.name);
  }
  const float s = AbsBitsToFloat(job.dtype, amax_bits) / kFp8E4M3Max;
  job.out_scales[0] = s;
  if (speculate && absl::bit_cast<uint32_t>(s) == absl::bit_cast<uint32_t>(job.scale_hint)) {
    if (job.stats != nullptr) job.stats->one_pass = true;
    return absl::OkStatus();  // with Job::hash, hashed as it was written
  }
  // Job::hash is fresh on entry (one call per tensor): what pass 1 fed it is
  // rewritten below.
  if (hashing && speculate) XXH3_64bits_reset(job.hash);
  if (InverseOverflows(s)) {
    for (size_t p = 0; p < pieces.size(); ++p) {
      QuantizeWithInfiniteInverse(pieces[p].data(), job.dtype, first[p + 1] - first[p],
                                  job.out_q + first[p]);
    }
    FeedHash(job, job.out_q, total);
    return absl::OkStatus();
  }
  const float inv = InverseScale(s);
  if (job.vllm && s == 0.0f) {  // vLLM: 0 / 0 = NaN -> +448
    std::memset(job.out_q, kFp8Max, total);
    FeedHash(job, job.out_q, total);
    return absl::OkStatus();
  }
  auto done = [&]() {
    if (ahead) {
      *job.next_amax = Fp8Amax{true, job.dtype, next_total, job.vllm,
                               *std::max_element(next_partial.begin(), next_partial.end())};
    }
    return absl::OkStatus();
  };
  if (hashing) {
    HashFeed feed(job.hash, job.out_q, total, kHashUnitBytes);
    ForEachUnit(workers, feed, [&](int w, int64_t u) {
      const int64_t begin = u * kHashUnitBytes;
      final_convert(w, begin, std::min(total, begin + kHashUnitBytes), inv);
      return true;
    });
    return done();
  }
  if (ahead || given) {
    // Forwards: nothing of this source was just read (amax given), or the
    // next source's loads keep up with the convert anyway.
    ParallelRanges(workers, total, 64,
                   [&](int w, int64_t begin, int64_t end) { final_convert(w, begin, end, inv); });
    return done();
  }
  // Pass 2: scale, clamp, convert. Each worker walks its range backwards in
  // chunks: the end of the range is what pass 1 read last, so it may still
  // be in the L3 (all of it, for tensors of up to a few tens of MiB).
  ParallelRanges(workers, total, 64, [&](int, int64_t begin, int64_t end) {
    ForEachPart(pieces, first, job.esize, begin, end, /*reverse=*/true,
                [&](const uint8_t* src, int64_t count, int64_t at) {
                  for (int64_t k = (count - 1) / kReverseChunk; k >= 0; --k) {
                    const int64_t from = k * kReverseChunk;
                    const int64_t n = std::min(kReverseChunk, count - from);
                    job.k.quantize(src + from * job.esize, 0, 1, n, n, &inv, job.vllm, job.stream,
                                   job.out_q + at + from, 0);
                  }
                });
  });
  return absl::OkStatus();
}

absl::Status QuantizePerChannel(const Job& job) {
  const int workers = WorkersFor(job.threads, job.rows * job.cols, job.rows);
  std::vector<char> bad(workers, 0);
  // Both passes per row while the row is in cache; false at a non-finite
  // value (kReject).
  auto rows = [&](int w, int64_t begin, int64_t end) {
    const uint32_t inf = InfBits(job.dtype);
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* row = job.src + r * job.cols * job.esize;
      uint8_t* out = job.out_q + r * job.cols;
      uint32_t amax_bits;
      job.k.abs_max(row, 0, 1, job.cols, job.cols, job.vllm, &amax_bits);
      if (!job.vllm && amax_bits >= inf) {
        bad[w] = 1;
        return false;
      }
      const float s = AbsBitsToFloat(job.dtype, amax_bits) / kFp8E4M3Max;
      job.out_scales[r] = s;
      if (job.vllm && s == 0.0f) {
        std::memset(out, kFp8Max, job.cols);
      } else if (InverseOverflows(s)) {
        QuantizeWithInfiniteInverse(row, job.dtype, job.cols, out);
      } else {
        const float inv = InverseScale(s);
        job.k.quantize(row, 0, 1, job.cols, job.cols, &inv, job.vllm, job.stream, out, 0);
      }
    }
    return true;
  };
  if (job.hash != nullptr) {
    // Units of whole rows, about kHashUnitBytes of output each.
    const int64_t unit_rows = std::max<int64_t>(1, kHashUnitBytes / std::max<int64_t>(job.cols, 1));
    HashFeed feed(job.hash, job.out_q, job.rows * job.cols, unit_rows * job.cols);
    ForEachUnit(workers, feed, [&](int w, int64_t u) {
      return rows(w, u * unit_rows, std::min(job.rows, (u + 1) * unit_rows));
    });
  } else {
    ParallelRanges(workers, job.rows, 1,
                   [&](int w, int64_t begin, int64_t end) { rows(w, begin, end); });
  }
  if (std::find(bad.begin(), bad.end(), 1) != bad.end()) {
    return NonFiniteError(job.src, job.dtype, job.rows, job.cols, job.name);
  }
  return absl::OkStatus();
}

// Blocks are handled in groups along a 128-row band: the amax pass over the
// group, then the convert pass while the group is still in cache (L3). Groups
// are as wide as possible, whole bands up to 8 MiB: then the amax pass reads
// one contiguous stream, which the hardware prefetcher serves at full speed,
// instead of 128 short row segments (measured: 30% less CPU time).
constexpr int64_t kBlockGroupBytes = int64_t{8} << 20;

absl::Status QuantizeBlock128(const Job& job) {
  const int64_t block_rows = (job.rows + kFp8BlockSize - 1) / kFp8BlockSize;
  const int64_t block_cols = (job.cols + kFp8BlockSize - 1) / kFp8BlockSize;
  const int64_t per_group = std::clamp<int64_t>(
      kBlockGroupBytes / (kFp8BlockSize * kFp8BlockSize * job.esize), 1, kMaxBlocksPerCall);
  const int64_t groups_per_band = (block_cols + per_group - 1) / per_group;
  const int64_t tasks = block_rows * groups_per_band;
  // Tasks [begin, end) (task t: group t % groups_per_band of band
  // t / groups_per_band); false at a non-finite value (kReject).
  auto run = [&](char& bad, int64_t begin, int64_t end) {
    const uint32_t inf = InfBits(job.dtype);
    uint32_t amax_bits[kMaxBlocksPerCall];
    float inv[kMaxBlocksPerCall];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t br = t / groups_per_band;
      const int64_t bc0 = t % groups_per_band * per_group;
      const int64_t nblocks = std::min(per_group, block_cols - bc0);
      const int64_t r0 = br * kFp8BlockSize;
      const int64_t c0 = bc0 * kFp8BlockSize;
      const int64_t nrows = std::min(kFp8BlockSize, job.rows - r0);
      const int64_t ncols = std::min(nblocks * kFp8BlockSize, job.cols - c0);
      const uint8_t* src = job.src + (r0 * job.cols + c0) * job.esize;
      job.k.abs_max(src, job.cols, nrows, ncols, kFp8BlockSize, job.vllm, amax_bits);
      for (int64_t b = 0; b < nblocks; ++b) {
        if (!job.vllm && amax_bits[b] >= inf) {
          bad = 1;
          return false;
        }
        const float amax = std::max(AbsBitsToFloat(job.dtype, amax_bits[b]), kFp8BlockAmaxFloor);
        const float s = amax / kFp8E4M3Max;  // >= 2.2e-7: 1/s never overflows
        job.out_scales[br * block_cols + bc0 + b] = s;
        inv[b] = InverseScale(s);
      }
      job.k.quantize(src, job.cols, nrows, ncols, kFp8BlockSize, inv, job.vllm, job.stream,
                     job.out_q + r0 * job.cols + c0, job.cols);
    }
    return true;
  };
  std::vector<char> bad;
  if (job.hash != nullptr) {
    // A band's output is contiguous (a group's is not, unless it spans the
    // band): the units are bands.
    const int workers = WorkersFor(job.threads, job.rows * job.cols, block_rows);
    bad.assign(workers, 0);
    HashFeed feed(job.hash, job.out_q, job.rows * job.cols, kFp8BlockSize * job.cols);
    ForEachUnit(workers, feed, [&](int w, int64_t band) {
      return run(bad[w], band * groups_per_band, (band + 1) * groups_per_band);
    });
  } else {
    const int workers = WorkersFor(job.threads, job.rows * job.cols, tasks);
    bad.assign(workers, 0);
    ParallelRanges(workers, tasks, 1,
                   [&](int w, int64_t begin, int64_t end) { run(bad[w], begin, end); });
  }
  if (std::find(bad.begin(), bad.end(), 1) != bad.end()) {
    return NonFiniteError(job.src, job.dtype, job.rows, job.cols, job.name);
  }
  return absl::OkStatus();
}

}  // namespace

uint8_t Fp8E4M3FromFloat(float value) {
  const int32_t bits = BitsOf(value);
  const int32_t abs = bits & kF32AbsMask;
  const int32_t sign = (bits >> 24) & 0x80;
  if (abs > kF32InfBits) return static_cast<uint8_t>(kFp8Nan | sign);
  return static_cast<uint8_t>(EncodeAbsScalar(std::min(abs, kF32Bits448)) | sign);
}

float Fp8E4M3ToFloat(uint8_t bits) {
  const int exponent = (bits >> 3) & 0xF;
  const int mantissa = bits & 0x7;
  float magnitude;
  if (exponent == 0xF && mantissa == 0x7) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = static_cast<float>(mantissa) * 0x1p-9f;
  } else {
    magnitude = FloatOf(((exponent + 120) << 23) | (mantissa << 20));
  }
  return (bits & 0x80) ? -magnitude : magnitude;
}

int64_t Fp8NumScales(QuantScheme scheme, int64_t rows, int64_t cols) {
  if (rows < 0 || cols < 0) return 0;
  switch (scheme) {
    case QuantScheme::kNone:
      return 0;
    case QuantScheme::kPerTensor:
      return 1;
    case QuantScheme::kPerChannel:
      return rows;
    case QuantScheme::kBlock128:
      return ((rows + kFp8BlockSize - 1) / kFp8BlockSize) *
             ((cols + kFp8BlockSize - 1) / kFp8BlockSize);
  }
  return 0;
}

namespace {

absl::Status CheckArgs(const void* src, DType src_dtype, int64_t rows, int64_t cols,
                       const Fp8QuantizeOptions& options, const uint8_t* out_q,
                       const float* out_scales, absl::string_view tensor_name) {
  if (!IsHighPrecisionFloat(src_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor_name, "': cannot quantize ",
                                                   DTypeName(src_dtype), " to FP8; expected ",
                                                   FloatTypeList()));
  }
  if (options.scheme != QuantScheme::kPerTensor && options.scheme != QuantScheme::kPerChannel &&
      options.scheme != QuantScheme::kBlock128) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", tensor_name, "': quantization scheme \"", QuantSchemeName(options.scheme),
        "\" is not an FP8 scheme (expected per-tensor, per-channel or block)"));
  }
  if (rows < 0 || cols < 0 || (cols > 0 && rows > std::numeric_limits<int64_t>::max() / cols)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", tensor_name, "': invalid shape [", rows, ", ", cols, "]"));
  }
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor_name, "': num_threads ",
                                                   options.num_threads, " is negative"));
  }
  const int64_t n = rows * cols;
  const int64_t num_scales = Fp8NumScales(options.scheme, rows, cols);
  if ((n > 0 && (src == nullptr || out_q == nullptr)) ||
      (num_scales > 0 && out_scales == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", tensor_name, "': null buffer for [", rows, ", ", cols, "] (src ",
        src != nullptr, ", out_q ", out_q != nullptr, ", out_scales ", out_scales != nullptr, ")"));
  }
  return absl::OkStatus();
}

// Whether Fp8QuantizeOptions::next can be read: whole elements, at least
// one, no null piece.
bool UsableNext(absl::Span<const absl::Span<const uint8_t>> next, int64_t esize) {
  int64_t total = 0;
  for (absl::Span<const uint8_t> piece : next) {
    const int64_t size = static_cast<int64_t>(piece.size());
    if (size % esize != 0 || (size > 0 && piece.data() == nullptr)) return false;
    total += size;
  }
  return total > 0;
}

Job MakeJob(const void* src, DType src_dtype, int64_t rows, int64_t cols,
            const Fp8QuantizeOptions& options, uint8_t* out_q, float* out_scales,
            absl::string_view tensor_name, XXH3_state_t* hash) {
  Job job;
  job.src = static_cast<const uint8_t*>(src);
  job.dtype = src_dtype;
  job.esize = static_cast<int64_t>(DTypeSize(src_dtype));
  job.rows = rows;
  job.cols = cols;
  job.vllm = options.non_finite == NonFinitePolicy::kVllmCompatible;
  // Streamed output would have to come back from memory to be hashed.
  job.stream = rows * cols >= kStreamingMinBytes && hash == nullptr;
  job.threads = ResolveThreads(options.num_threads);
  job.k = kKernels[static_cast<int>(CurrentIsa())][SourceIndex(src_dtype)];
  job.out_q = out_q;
  job.out_scales = out_scales;
  job.name = tensor_name;
  job.scale_hint = options.scheme == QuantScheme::kPerTensor ? options.scale_hint : 0.0f;
  job.stats = options.stats;
  if (job.stats != nullptr) *job.stats = Fp8QuantizeStats{};
  job.hash = hash;
  job.amax = nullptr;
  job.next = {};
  job.next_amax = nullptr;
  if (options.scheme == QuantScheme::kPerTensor) {
    const Fp8Amax* given = options.amax;
    if (given != nullptr && given->valid && given->dtype == src_dtype &&
        given->elements == rows * cols && given->nan_ignored == job.vllm) {
      job.amax = given;
    }
    if (options.next_amax != nullptr && UsableNext(options.next, job.esize)) {
      job.next = options.next;
      job.next_amax = options.next_amax;
    }
  }
  return job;
}

// The hash a call's Fp8QuantizeOptions::out_hash asks for: a running XXH3
// state the jobs feed, digested into *out_hash once the call succeeded.
// Without memory for the state, the output is hashed whole at the end.
class OutputHash {
 public:
  explicit OutputHash(uint64_t* out)
      : out_(out), state_(out != nullptr ? XXH3_createState() : nullptr) {
    if (state_ != nullptr) XXH3_64bits_reset(state_);
  }
  ~OutputHash() {
    if (state_ != nullptr) XXH3_freeState(state_);
  }
  OutputHash(const OutputHash&) = delete;
  OutputHash& operator=(const OutputHash&) = delete;

  XXH3_state_t* state() const { return state_; }

  // `status`, after filling *out_hash on success (`out_q`: the n bytes written).
  absl::Status Finish(absl::Status status, const uint8_t* out_q, int64_t n) const {
    if (!status.ok() || out_ == nullptr) return status;
    *out_ =
        state_ != nullptr ? XXH3_64bits_digest(state_) : XXH3_64bits(out_q, static_cast<size_t>(n));
    return status;
  }

 private:
  uint64_t* const out_;
  XXH3_state_t* const state_;
};

absl::Status RunJob(const Job& job, QuantScheme scheme) {
  switch (scheme) {
    case QuantScheme::kPerTensor: {
      const absl::Span<const uint8_t> whole[] = {
          absl::Span<const uint8_t>(job.src, static_cast<size_t>(job.rows * job.cols * job.esize))};
      return QuantizePerTensor(job, whole);
    }
    case QuantScheme::kPerChannel:
      return QuantizePerChannel(job);
    default:
      return QuantizeBlock128(job);
  }
}

}  // namespace

absl::Status QuantizeFp8(const void* src, DType src_dtype, int64_t rows, int64_t cols,
                         const Fp8QuantizeOptions& options, uint8_t* out_q, float* out_scales,
                         absl::string_view tensor_name) {
  if (options.next_amax != nullptr) *options.next_amax = Fp8Amax{};
  if (absl::Status s =
          CheckArgs(src, src_dtype, rows, cols, options, out_q, out_scales, tensor_name);
      !s.ok()) {
    return s;
  }
  const OutputHash hash(options.out_hash);
  if (rows * cols == 0) {
    // Nothing to read; rows of zero columns have amax 0.
    if (options.scheme != QuantScheme::kBlock128) {
      std::fill_n(out_scales, Fp8NumScales(options.scheme, rows, cols), 0.0f);
    }
    return hash.Finish(absl::OkStatus(), out_q, 0);
  }
  return hash.Finish(RunJob(MakeJob(src, src_dtype, rows, cols, options, out_q, out_scales,
                                    tensor_name, hash.state()),
                            options.scheme),
                     out_q, rows * cols);
}

absl::Status QuantizeFp8Pieces(absl::Span<const absl::Span<const uint8_t>> pieces, DType src_dtype,
                               int64_t rows, int64_t cols, const Fp8QuantizeOptions& options,
                               uint8_t* out_q, float* out_scales, absl::string_view tensor_name) {
  if (options.next_amax != nullptr) *options.next_amax = Fp8Amax{};
  const void* first = pieces.empty() ? nullptr : pieces[0].data();
  if (absl::Status s =
          CheckArgs(first, src_dtype, rows, cols, options, out_q, out_scales, tensor_name);
      !s.ok()) {
    return s;
  }
  const int64_t esize = static_cast<int64_t>(DTypeSize(src_dtype));
  int64_t total = 0;
  for (absl::Span<const uint8_t> piece : pieces) {
    const int64_t size = static_cast<int64_t>(piece.size());
    if (size % esize != 0 || (size > 0 && piece.data() == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", tensor_name, "': a source piece of ", size, " bytes at byte ",
                       total, " is not whole ", DTypeName(src_dtype), " elements"));
    }
    total += size;
  }
  const int64_t n = rows * cols;
  if (total != n * esize) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", tensor_name, "': source pieces of ", total, " bytes for [", rows,
                     ", ", cols, "] of ", DTypeName(src_dtype), " (", n * esize, " bytes)"));
  }
  if (pieces.size() == 1 || n == 0) {
    return QuantizeFp8(first, src_dtype, rows, cols, options, out_q, out_scales, tensor_name);
  }
  const OutputHash hash(options.out_hash);
  const Job whole =
      MakeJob(first, src_dtype, rows, cols, options, out_q, out_scales, tensor_name, hash.state());
  if (options.scheme == QuantScheme::kPerTensor) {
    return hash.Finish(QuantizePerTensor(whole, pieces), out_q, n);
  }
  // Per-channel and block scales are local to a row / a 128-row band: pieces
  // that end on such a boundary are quantized one by one, in place.
  const int64_t unit_rows = options.scheme == QuantScheme::kPerChannel ? 1 : kFp8BlockSize;
  const int64_t unit_bytes = unit_rows * cols * esize;
  bool aligned = true;
  for (size_t i = 0; i + 1 < pieces.size(); ++i) {
    aligned &= static_cast<int64_t>(pieces[i].size()) % unit_bytes == 0;
  }
  if (!aligned) {
    // Otherwise the pieces are gathered first (one copy).
    std::unique_ptr<uint8_t[]> gathered(new (std::nothrow) uint8_t[static_cast<size_t>(total)]);
    if (gathered == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "tensor '", tensor_name, "': no host memory to gather ", total, " bytes to quantize"));
    }
    int64_t at = 0;
    for (absl::Span<const uint8_t> piece : pieces) {
      if (!piece.empty()) std::memcpy(gathered.get() + at, piece.data(), piece.size());
      at += static_cast<int64_t>(piece.size());
    }
    return hash.Finish(RunJob(MakeJob(gathered.get(), src_dtype, rows, cols, options, out_q,
                                      out_scales, tensor_name, hash.state()),
                              options.scheme),
                       out_q, n);
  }
  const int64_t block_cols = (cols + kFp8BlockSize - 1) / kFp8BlockSize;
  int64_t row0 = 0;
  for (absl::Span<const uint8_t> piece : pieces) {
    const int64_t piece_rows = static_cast<int64_t>(piece.size()) / (cols * esize);
    if (piece_rows == 0) continue;
    Job job = whole;
    job.src = piece.data();
    job.rows = piece_rows;
    job.out_q = out_q + row0 * cols;
    job.out_scales = out_scales + (unit_rows == 1 ? row0 : row0 / kFp8BlockSize * block_cols);
    absl::Status s = RunJob(job, options.scheme);
    if (absl::IsInvalidArgument(s)) {
      // A non-finite value: named by its index in the whole tensor.
      return NonFiniteError(pieces, src_dtype, cols, tensor_name);
    }
    if (!s.ok()) return s;
    row0 += piece_rows;
  }
  return hash.Finish(absl::OkStatus(), out_q, n);
}

void RunInParallel(int n, const std::function<void(int)>& task) {
  if (n <= 0) return;
  if (n == 1) {
    task(0);
    return;
  }
  if (RangePool::Get().TryRun(n, task)) return;
  // Another call holds the pool: threads of this call's own.
  std::vector<std::thread> threads;
  threads.reserve(n - 1);
  int started = 1;
  for (; started < n; ++started) {
    try {
      threads.emplace_back([&task, started] { task(started); });
    } catch (const std::system_error&) {
      break;  // out of threads: the remaining tasks run here
    }
  }
  task(0);
  for (int i = started; i < n; ++i) task(i);
  for (std::thread& t : threads) t.join();
}

void ForEachInParallel(int n, int threads, const std::function<void(int)>& task) {
  if (n <= 0) return;
  std::atomic<int> next{0};
  RunInParallel(std::clamp(threads, 1, n), [&](int) {
    for (int i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      task(i);
    }
  });
}

int BulkThreads() {
  const int cap = g_host_threads.load(std::memory_order_relaxed);
  return cap > 0 ? cap : std::min(Cores(), 8);
}

int DefaultQuantizeThreads() {
  const int cap = g_host_threads.load(std::memory_order_relaxed);
  return cap > 0 ? cap : Cores();
}

void SetHostThreads(int threads) {
  g_host_threads.store(std::max(threads, 0), std::memory_order_relaxed);
}

namespace internal {

absl::string_view Fp8IsaName(Fp8Isa isa) {
  switch (isa) {
    case Fp8Isa::kPortable:
      return "portable";
    case Fp8Isa::kAvx2:
      return "avx2";
    case Fp8Isa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

bool Fp8IsaSupported(Fp8Isa isa) { return CpuSupports(isa); }

Fp8Isa ActiveFp8Isa() { return CurrentIsa(); }

Fp8Isa SetFp8IsaForTesting(Fp8Isa isa) {
  const Fp8Isa previous = CurrentIsa();
  if (CpuSupports(isa)) g_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
  return previous;
}

void SetBetweenPassesHookForTesting(void (*hook)(void* arg), void* arg) {
  g_between_passes_arg.store(arg, std::memory_order_relaxed);
  g_between_passes_hook.store(hook, std::memory_order_release);
}

}  // namespace internal
}  // namespace refit::core
