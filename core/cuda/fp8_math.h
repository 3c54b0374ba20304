// Element-level FP8 (e4m3fn) math shared by the CUDA kernels
// (fp8_quantize.cu) and host code that checks them.
//
// Why a separate header: the kernels must produce exactly the bytes of the
// CPU quantizer (core/fp8_quantizer.h). Keeping every rounding decision in
// plain integer code that compiles for both host and device lets a CPU-only
// test compare this math with core::QuantizeFp8 on machines without a GPU,
// and keeps the device code free of intrinsics whose rounding could differ
// (the conversion is done on the float's bits, never by an FPU instruction).
//
// No CUDA types or headers; pure functions, thread-safe.
#ifndef REFIT_CORE_CUDA_FP8_MATH_H_
#define REFIT_CORE_CUDA_FP8_MATH_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define REFIT_HD __host__ __device__ __forceinline__
#else
#define REFIT_HD inline
#endif

namespace refit::core::fp8_math {

inline constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
inline constexpr uint32_t kInfBits = 0x7F800000u;
inline constexpr uint8_t kFp8MaxBits = 0x7E;  // +448
inline constexpr uint8_t kFp8NanBits = 0x7F;

REFIT_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

REFIT_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

REFIT_HD bool IsNanBits(uint32_t bits) { return (bits & kAbsMask) > kInfBits; }
REFIT_HD bool IsFiniteBits(uint32_t bits) { return (bits & kInfBits) != kInfBits; }

REFIT_HD float Bf16BitsToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

// Exact: every fp16 value (subnormals, Inf, NaN) is representable in float32.
REFIT_HD float Fp16BitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0x1Fu) return BitsToFloat(sign | kInfBits | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return BitsToFloat(sign);
    // Subnormal: normalize so that the leading 1 becomes the implicit bit.
    int e = -14;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    mant &= 0x3FFu;
    return BitsToFloat(sign | (static_cast<uint32_t>(e + 127) << 23) | (mant << 13));
  }
  return BitsToFloat(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

// |x| as an integer that orders like the magnitude (exact, so an atomicMax
// over these bits is an order-independent, deterministic amax). NaN maps to
// 0: it is ignored by the max, as vLLM's kernel ignores it.
REFIT_HD uint32_t AmaxKey(float x) {
  const uint32_t a = FloatBits(x) & kAbsMask;
  return a > kInfBits ? 0u : a;
}

// Round-to-nearest-even float32 -> e4m3fn, on the bits. |x| >= 448 (and
// +-Inf) saturates to +-448; NaN gives 0x7F with the sign kept. Matches
// c10::Float8_e4m3fn for every input in [-448, 448] and NaN.
REFIT_HD uint8_t Fp8E4M3FromFloatBits(uint32_t bits) {
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t a = bits & kAbsMask;
  if (a > kInfBits) return sign | kFp8NanBits;
  if (a >= 0x43E00000u) return sign | kFp8MaxBits;  // 448.0f
  const uint32_t exp = a >> 23;
  if (exp < 121) {
    // Below 2^-6: an e4m3 subnormal, q = round(|x| * 2^9) in [0, 8]; q == 8
    // is the smallest normal (0x08), which the integer encodes by itself.
    // |x| = mant * 2^(e - 150), so |x| * 2^9 = mant >> (141 - e).
    const uint32_t e = exp == 0 ? 1u : exp;  // float subnormals: no implicit 1
    const uint32_t mant = exp == 0 ? (a & 0x7FFFFFu) : ((a & 0x7FFFFFu) | 0x800000u);
    const uint32_t shift = 141u - e;
    if (shift >= 25) return sign;  // mant < 2^24, so |x| * 2^9 < 0.5: zero
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return sign | static_cast<uint8_t>(q);
  }
  // Normal: rebias the exponent (127 -> 7), keep 3 mantissa bits, round the
  // 20 dropped bits to nearest even. A carry out of the mantissa bumps the
  // exponent, which is the correct result.
  uint32_t q = ((exp - 120u) << 3) | ((a >> 20) & 0x7u);
  const uint32_t rem = a & 0xFFFFFu;
  if (rem > 0x80000u || (rem == 0x80000u && (q & 1u))) ++q;
  return sign | static_cast<uint8_t>(q);
}

REFIT_HD uint8_t Fp8E4M3FromFloat(float x) { return Fp8E4M3FromFloatBits(FloatBits(x)); }

// s = amax / 448 (per-tensor, per-channel) or max(amax, 1e-4) / 448 (block).
// Float32 division: correctly rounded on host and device (nvcc's default
// -prec-div=true), so both sides get the same bits.
REFIT_HD float ScaleFromAmax(float amax, bool block) {
  if (block && !(amax >= 1e-4f)) amax = 1e-4f;
  return amax / 448.0f;
}

// The multiplier of a scale, as core/fp8_quantizer.cc uses it: inv = 1/s,
// 0 for s == 0. When amax < ~1.3e-36, 1/s overflows to +Inf and the formula
// is applied literally (x * Inf), as the CPU quantizer does.
struct Fp8Scale {
  float s;
  float inv;
};

REFIT_HD Fp8Scale MakeFp8Scale(float s) { return Fp8Scale{s, s == 0.0f ? 0.0f : 1.0f / s}; }

// q = fp8_rne(clamp(x * inv, -448, 448)), the sign taken from the product.
// A NaN product (0 * Inf when 1/s overflowed) becomes +448, as every NaN
// product does in vLLM's kernel. kVllmCompatible (vLLM's CUDA kernel): NaN
// -> +448, +-Inf -> +-448, and an all-zero tensor or row (s == 0; vLLM
// computes 0 * (1/0) = NaN) -> +448. Under kReject non-finite input never
// gets here (the caller reports it).
REFIT_HD uint8_t QuantizeValue(float x, const Fp8Scale& scale, bool vllm_compatible) {
  if (vllm_compatible) {
    const uint32_t xb = FloatBits(x);
    const uint32_t a = xb & kAbsMask;
    if (a > kInfBits) return kFp8MaxBits;
    if (a == kInfBits) return static_cast<uint8_t>(((xb >> 24) & 0x80u) | kFp8MaxBits);
    if (scale.s == 0.0f) return kFp8MaxBits;
  }
  const uint32_t v = FloatBits(x * scale.inv);
  if (IsNanBits(v)) return kFp8MaxBits;
  // |v| >= 448 (and +-Inf) saturates inside the conversion: that is the clamp.
  return Fp8E4M3FromFloatBits(v);
}

}  // namespace refit::core::fp8_math

#endif  // REFIT_CORE_CUDA_FP8_MATH_H_
