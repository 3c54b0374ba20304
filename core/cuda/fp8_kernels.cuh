// The FP8 kernels of Fp8CudaQuantizer (fp8_cuda.h), in a header so that
// fp8_quantize.cu launches them on the GPU and a host test can run the very
// same code in a simulated grid (tests/core/fp8_kernels_sim_test.cc):
// without a GPU, that is how the kernels' indexing, vector and tail paths
// and block reductions get exercised.
//
// Internal to core/cuda. Under nvcc it includes the CUDA headers it needs.
// Elsewhere the includer must first define the CUDA vocabulary it uses
// (__global__, __device__, __forceinline__, __launch_bounds__, threadIdx,
// blockIdx, blockDim, gridDim, __syncthreads, __shfl_xor_sync, atomicMax,
// atomicMin, atomicAdd, max, uint2, make_uint2).
//
// The rounding and the non-finite rules live in fp8_math.h; the kernels only
// decide which element goes where, so bit-identity with the CPU quantizer
// reduces to "same elements, same amax, same float ops" (the amax is an exact
// max and every scale is one correctly rounded division).
#ifndef REFIT_CORE_CUDA_FP8_KERNELS_CUH_
#define REFIT_CORE_CUDA_FP8_KERNELS_CUH_

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

#include "core/cuda/fp8_math.h"

// Unrolling is for nvcc; a host compiler would warn about the pragma.
#if defined(__CUDACC__)
#define REFIT_UNROLL _Pragma("unroll")
#else
#define REFIT_UNROLL
#endif

namespace refit::core::cuda::fp8_kernels {

using namespace ::refit::core::fp8_math;  // NOLINT: the math is this file's vocabulary

// The first non-finite element seen by the jobs of one stream since its last
// Sync: key = (job sequence << 40) | element index, so atomicMin keeps the
// earliest job's lowest index no matter which thread or block finds what.
struct ErrorRecord {
  unsigned long long first_bad;
  uint32_t value_bits;  // the offending element as float32, filled by FetchBadValueKernel
  uint32_t unused;
};

inline constexpr int kThreads = 256;
inline constexpr int kIndexBits = 40;
inline constexpr unsigned long long kIndexMask = (1ull << kIndexBits) - 1;
inline constexpr int kUnroll = 4;

struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(Bf16 x) { return Bf16BitsToFloat(x.bits); }
// __half2float is exact (fp16 is a subset of fp32), so no rounding question.
__device__ __forceinline__ float ToFloat(Fp16 x) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(x.bits));
#else
  return Fp16BitsToFloat(x.bits);  // host simulation (tests)
#endif
}

// 16 bytes of source: 8 bf16/fp16 or 4 fp32 elements per load.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};

struct ErrorSink {
  ErrorRecord* record;         // unused unless rejecting
  unsigned long long seq_key;  // job sequence << kIndexBits
  __device__ __forceinline__ void Record(int64_t index) const {
    atomicMin(&record->first_bad, seq_key | static_cast<unsigned long long>(index));
  }
};

// Folds one element into a thread's amax (as ordered bits). Under kReject a
// non-finite element is recorded; its bits then poison amax, which does not
// matter because the job's output is discarded.
template <bool kReject>
__device__ __forceinline__ void Observe(float x, int64_t index, uint32_t& amax,
                                        const ErrorSink& sink) {
  if constexpr (kReject) {
    const uint32_t bits = FloatBits(x);
    if (!IsFiniteBits(bits)) sink.Record(index);
    amax = max(amax, bits & kAbsMask);
  } else {
    amax = max(amax, AmaxKey(x));
  }
}

// Max over the block; every thread gets the result. blockDim.x == kThreads.
__device__ __forceinline__ uint32_t BlockMax(uint32_t v) {
  __shared__ uint32_t warp_max[kThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1)
    v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? warp_max[lane] : 0u;
    for (int offset = 16; offset > 0; offset >>= 1) {
      v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    if (lane == 0) warp_max[0] = v;
  }
  __syncthreads();
  v = warp_max[0];
  __syncthreads();  // warp_max may be reused by a later call
  return v;
}

// Two elements through the hardware conversion (cvt.rn.satfinite.e4m3x2.f32
// on sm_89+): round to nearest even, |v| > 448 saturates to +-448; low byte
// = lo. Fp8CudaQuantizer::Create verifies on the device, for every finite
// float, that this equals fp8_math's integer conversion before enabling it.
__device__ __forceinline__ uint32_t HwCvt2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
#else
  // Host simulation (tests): the integer conversion, in the same byte order.
  return fp8_math::Fp8E4M3FromFloat(lo) |
         (static_cast<uint32_t>(fp8_math::Fp8E4M3FromFloat(hi)) << 8);
#endif
}

// Whether a tile may use the hardware conversion: enabled for the device,
// and 1/s finite. With 1/s finite, x * (1/s) of a finite x is finite (|x| <=
// amax, so |x/s| <= ~448), and the conversion only has to round and
// saturate, where the hardware and the integer code agree. When 1/s
// overflows, 0 * Inf = NaN must become 0x7E: the integer path handles it.
__device__ __forceinline__ bool UseHw(bool hw_enabled, const Fp8Scale& scale) {
  return hw_enabled && IsFiniteBits(FloatBits(scale.inv));
}

// Bytes of two elements. kVllmCompatible special cases (non-finite input,
// s == 0) take the integer path; everything else the hardware one.
__device__ __forceinline__ uint32_t QuantizePairHw(float x0, float x1, const Fp8Scale& scale,
                                                   bool vllm) {
  if (vllm && (!IsFiniteBits(FloatBits(x0)) || !IsFiniteBits(FloatBits(x1)) || scale.s == 0.0f)) {
    return QuantizeValue(x0, scale, true) |
           (static_cast<uint32_t>(QuantizeValue(x1, scale, true)) << 8);
  }
  return HwCvt2(x0 * scale.inv, x1 * scale.inv);
}

template <typename T>
__device__ __forceinline__ void QuantizeVec(const Vec16<T>& v, const Fp8Scale& scale, bool vllm,
                                            bool hw, uint8_t* out) {
  constexpr int kN = Vec16<T>::kN;
  uint32_t words[kN / 4];
  if (hw) {
    REFIT_UNROLL
    for (int w = 0; w < kN / 4; ++w) {
      const uint32_t lo = QuantizePairHw(ToFloat(v.v[4 * w]), ToFloat(v.v[4 * w + 1]), scale, vllm);
      const uint32_t hi =
          QuantizePairHw(ToFloat(v.v[4 * w + 2]), ToFloat(v.v[4 * w + 3]), scale, vllm);
      words[w] = lo | (hi << 16);
    }
  } else {
    REFIT_UNROLL
    for (int w = 0; w < kN / 4; ++w) {
      uint32_t word = 0;
      REFIT_UNROLL
      for (int k = 0; k < 4; ++k) {
        word |= static_cast<uint32_t>(QuantizeValue(ToFloat(v.v[4 * w + k]), scale, vllm))
                << (8 * k);
      }
      words[w] = word;
    }
  }
  if constexpr (kN == 8) {
    *reinterpret_cast<uint2*>(out) = make_uint2(words[0], words[1]);
  } else {
    *reinterpret_cast<uint32_t*>(out) = words[0];
  }
}

// ---- per-tensor: amax over the flat tensor, then scale, then convert ----

template <typename T, bool kReject>
__global__ void __launch_bounds__(kThreads)
    AmaxFlatKernel(const T* __restrict__ src, int64_t n, bool vec, uint32_t* amax_out,
                   ErrorSink sink) {
  uint32_t amax = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail_start = 0;
  if (vec) {
    constexpr int kN = Vec16<T>::kN;
    const int64_t nvec = n / kN;
    const auto* vsrc = reinterpret_cast<const Vec16<T>*>(src);
    for (int64_t base = tid; base < nvec; base += kUnroll * stride) {
      Vec16<T> v[kUnroll];
      REFIT_UNROLL
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * stride < nvec) v[u] = vsrc[base + u * stride];
      }
      REFIT_UNROLL
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * stride;
        if (i < nvec) {
          REFIT_UNROLL
          for (int k = 0; k < kN; ++k) Observe<kReject>(ToFloat(v[u].v[k]), i * kN + k, amax, sink);
        }
      }
    }
    tail_start = nvec * kN;
  }
  for (int64_t i = tail_start + tid; i < n; i += stride) {
    Observe<kReject>(ToFloat(src[i]), i, amax, sink);
  }
  amax = BlockMax(amax);
  if (threadIdx.x == 0 && amax != 0) atomicMax(amax_out, amax);
}

// Turns the amax bits (stored in the scale slot) into the scale, in place.
__global__ void PerTensorScaleKernel(float* scale) {
  const uint32_t amax_bits = *reinterpret_cast<const uint32_t*>(scale);
  *scale = ScaleFromAmax(BitsToFloat(amax_bits), /*block=*/false);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    ConvertFlatKernel(const T* __restrict__ src, int64_t n, bool vec, const float* scale,
                      uint8_t* __restrict__ out, bool vllm, bool hw_enabled) {
  const Fp8Scale q_scale = MakeFp8Scale(*scale);
  const bool hw = UseHw(hw_enabled, q_scale);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail_start = 0;
  if (vec) {
    constexpr int kN = Vec16<T>::kN;
    const int64_t nvec = n / kN;
    const auto* vsrc = reinterpret_cast<const Vec16<T>*>(src);
    for (int64_t base = tid; base < nvec; base += kUnroll * stride) {
      Vec16<T> v[kUnroll];
      REFIT_UNROLL
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * stride < nvec) v[u] = vsrc[base + u * stride];
      }
      REFIT_UNROLL
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * stride;
        if (i < nvec) QuantizeVec(v[u], q_scale, vllm, hw, out + i * kN);
      }
    }
    tail_start = nvec * kN;
  }
  for (int64_t i = tail_start + tid; i < n; i += stride) {
    out[i] = QuantizeValue(ToFloat(src[i]), q_scale, vllm);
  }
}

// ---- per-channel: one block per row ----

template <typename T, bool kReject>
__global__ void __launch_bounds__(kThreads)
    PerChannelKernel(const T* __restrict__ src, int64_t cols, bool vec, uint8_t* __restrict__ out,
                     float* scales, ErrorSink sink, bool vllm, bool hw_enabled) {
  const int64_t row = blockIdx.x;
  const int64_t row_start = row * cols;
  const T* rsrc = src + row_start;
  uint8_t* rout = out + row_start;
  constexpr int kN = Vec16<T>::kN;
  const auto* vsrc = reinterpret_cast<const Vec16<T>*>(rsrc);
  const int64_t nvec = vec ? cols / kN : 0;
  const int64_t tail_start = nvec * kN;

  uint32_t amax = 0;
  for (int64_t i = threadIdx.x; i < nvec; i += kThreads) {
    const Vec16<T> v = vsrc[i];
    REFIT_UNROLL
    for (int k = 0; k < kN; ++k)
      Observe<kReject>(ToFloat(v.v[k]), row_start + i * kN + k, amax, sink);
  }
  for (int64_t c = tail_start + threadIdx.x; c < cols; c += kThreads) {
    Observe<kReject>(ToFloat(rsrc[c]), row_start + c, amax, sink);
  }
  amax = BlockMax(amax);
  const float s = ScaleFromAmax(BitsToFloat(amax), /*block=*/false);
  if (threadIdx.x == 0) scales[row] = s;
  const Fp8Scale q_scale = MakeFp8Scale(s);
  const bool hw = UseHw(hw_enabled, q_scale);
  // Second read of the row: it was just read by this block, so it is in L2.
  for (int64_t i = threadIdx.x; i < nvec; i += kThreads) {
    QuantizeVec(vsrc[i], q_scale, vllm, hw, rout + i * kN);
  }
  for (int64_t c = tail_start + threadIdx.x; c < cols; c += kThreads) {
    rout[c] = QuantizeValue(ToFloat(rsrc[c]), q_scale, vllm);
  }
}

// ---- block 128x128: one thread block per tile, edge tiles cropped ----

template <typename T, bool kReject>
__global__ void __launch_bounds__(kThreads)
    Block128Kernel(const T* __restrict__ src, int64_t rows, int64_t cols, bool vec,
                   uint8_t* __restrict__ out, float* scales, ErrorSink sink, bool vllm,
                   bool hw_enabled) {
  constexpr int kTile = 128;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tile_rows = static_cast<int>(rows - r0 < kTile ? rows - r0 : kTile);
  const int tile_cols = static_cast<int>(cols - c0 < kTile ? cols - c0 : kTile);
  constexpr int kN = Vec16<T>::kN;
  // vec implies cols % kN == 0, hence tile_cols % kN == 0.
  const int per_row = vec ? tile_cols / kN : tile_cols;
  const int total = tile_rows * per_row;

  uint32_t amax = 0;
  for (int t = threadIdx.x; t < total; t += kThreads) {
    const int r = t / per_row;
    const int c = t - r * per_row;
    if (vec) {
      const int64_t index = (r0 + r) * cols + c0 + static_cast<int64_t>(c) * kN;
      const Vec16<T> v = *reinterpret_cast<const Vec16<T>*>(src + index);
      REFIT_UNROLL
      for (int k = 0; k < kN; ++k) Observe<kReject>(ToFloat(v.v[k]), index + k, amax, sink);
    } else {
      const int64_t index = (r0 + r) * cols + c0 + c;
      Observe<kReject>(ToFloat(src[index]), index, amax, sink);
    }
  }
  amax = BlockMax(amax);
  const float s = ScaleFromAmax(BitsToFloat(amax), /*block=*/true);
  if (threadIdx.x == 0) scales[static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x] = s;
  const Fp8Scale q_scale = MakeFp8Scale(s);
  const bool hw = UseHw(hw_enabled, q_scale);
  for (int t = threadIdx.x; t < total; t += kThreads) {
    const int r = t / per_row;
    const int c = t - r * per_row;
    if (vec) {
      const int64_t index = (r0 + r) * cols + c0 + static_cast<int64_t>(c) * kN;
      QuantizeVec(*reinterpret_cast<const Vec16<T>*>(src + index), q_scale, vllm, hw, out + index);
    } else {
      const int64_t index = (r0 + r) * cols + c0 + c;
      out[index] = QuantizeValue(ToFloat(src[index]), q_scale, vllm);
    }
  }
}

// Copies the offending element of job `seq` into the record while the
// source is still alive (stream order), so Sync can print its value.
template <typename T>
__global__ void FetchBadValueKernel(const T* src, ErrorRecord* record, unsigned long long seq) {
  const unsigned long long key = record->first_bad;
  if (key != ~0ull && (key >> kIndexBits) == seq) {
    record->value_bits = FloatBits(ToFloat(src[key & kIndexMask]));
  }
}

// Compares the hardware conversion with the integer one for every finite
// float32 of both signs (4.3e9 conversions, ~10 ms on an H100), in pairs so
// that the byte order of the x2 instruction is checked too.
__global__ void HwConversionCheckKernel(unsigned long long* mismatches) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (uint64_t a = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       a <= 0x7F7FFFFFull; a += stride) {
    const uint32_t bits = static_cast<uint32_t>(a);
    const float v = BitsToFloat(bits);
    const uint32_t want = Fp8E4M3FromFloatBits(bits) |
                          (static_cast<uint32_t>(Fp8E4M3FromFloatBits(bits | 0x80000000u)) << 8);
    bad += HwCvt2(v, -v) != want;
  }
  if (bad != 0) atomicAdd(mismatches, bad);
}

// Whether the 16-byte vector paths may run: the source 16-byte aligned and
// the output aligned to one vector's worth of bytes. (Rows and tiles also
// need cols % elems_per_vec == 0.)
inline bool AlignedForVectors(const void* src, const void* out, int elems_per_vec) {
  return reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(out) % static_cast<uintptr_t>(elems_per_vec) == 0;
}

// Grid size of the flat (per-tensor) kernels: enough blocks to cover the
// work, at most 32 per SM (grid-stride loops do the rest). Only 5 or 6 of
// these blocks fit on an SM at once (their registers), so a grid of 8 per SM
// ran as one full wave and a second partial one: on an H200, 8192x8192 bf16,
// amax + convert took 105-106 us at 8 per SM, 97-98 us at 32 per SM (many
// short waves), against a 70 us device copy of the source.
inline int FlatBlocks(int64_t n, bool vec, int elems_per_vec, int num_sms) {
  const int64_t work = vec ? (n / elems_per_vec > 0 ? n / elems_per_vec : 1) : n;
  const int64_t needed = (work + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(num_sms) * 32;
  return static_cast<int>(needed < cap ? needed : cap);
}

}  // namespace refit::core::cuda::fp8_kernels

#endif  // REFIT_CORE_CUDA_FP8_KERNELS_CUH_
