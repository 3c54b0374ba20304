// CUDA kernels of Fp8CudaQuantizer (fp8_cuda.h). The rounding and the
// non-finite rules live in fp8_math.h; this file only decides which element
// goes where, so bit-identity with the CPU quantizer reduces to "same
// elements, same amax, same float ops" (the amax is an exact max and every
// scale is computed by one correctly rounded division).
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/cuda/cuda_device.h"
#include "core/cuda/cuda_status.h"
#include "core/cuda/fp8_cuda.h"
#include "core/cuda/fp8_math.h"

namespace refit::core::cuda {

// The first non-finite element seen by the jobs of one stream since its last
// Sync: key = (job sequence << 40) | element index, so atomicMin keeps the
// earliest job's lowest index no matter which thread or block finds what.
struct Fp8CudaQuantizer::DeviceErrorRecord {
  unsigned long long first_bad;
  uint32_t value_bits;  // the offending element as float32, filled by FetchBadValue
  uint32_t unused;
};

namespace {

using namespace ::refit::core::fp8_math;  // NOLINT: the math is this file's vocabulary

constexpr int kThreads = 256;
constexpr int kIndexBits = 40;
constexpr unsigned long long kIndexMask = (1ull << kIndexBits) - 1;
constexpr uint32_t kMaxJobsPerSync = 1u << (64 - kIndexBits);
constexpr int kUnroll = 4;

struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(Bf16 x) { return Bf16BitsToFloat(x.bits); }
// __half2float is exact (fp16 is a subset of fp32), so no rounding question.
__device__ __forceinline__ float ToFloat(Fp16 x) { return __half2float(__ushort_as_half(x.bits)); }

// 16 bytes of source: 8 bf16/fp16 or 4 fp32 elements per load.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};

struct ErrorSink {
  Fp8CudaQuantizer::DeviceErrorRecord* record;  // unused unless rejecting
  unsigned long long seq_key;                   // job sequence << kIndexBits
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
__device__ uint32_t BlockMax(uint32_t v) {
  __shared__ uint32_t warp_max[kThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
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
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
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
    return QuantizeValue(x0, scale, true) | (static_cast<uint32_t>(QuantizeValue(x1, scale, true)) << 8);
  }
  return HwCvt2(x0 * scale.inv, x1 * scale.inv);
}

template <typename T>
__device__ __forceinline__ void QuantizeVec(const Vec16<T>& v, const Fp8Scale& scale, bool vllm,
                                            bool hw, uint8_t* out) {
  constexpr int kN = Vec16<T>::kN;
  uint32_t words[kN / 4];
  if (hw) {
#pragma unroll
    for (int w = 0; w < kN / 4; ++w) {
      const uint32_t lo = QuantizePairHw(ToFloat(v.v[4 * w]), ToFloat(v.v[4 * w + 1]), scale, vllm);
      const uint32_t hi =
          QuantizePairHw(ToFloat(v.v[4 * w + 2]), ToFloat(v.v[4 * w + 3]), scale, vllm);
      words[w] = lo | (hi << 16);
    }
  } else {
#pragma unroll
    for (int w = 0; w < kN / 4; ++w) {
      uint32_t word = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        word |= static_cast<uint32_t>(QuantizeValue(ToFloat(v.v[4 * w + k]), scale, vllm)) << (8 * k);
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
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * stride < nvec) v[u] = vsrc[base + u * stride];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * stride;
        if (i < nvec) {
#pragma unroll
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
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * stride < nvec) v[u] = vsrc[base + u * stride];
      }
#pragma unroll
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
#pragma unroll
    for (int k = 0; k < kN; ++k) Observe<kReject>(ToFloat(v.v[k]), row_start + i * kN + k, amax, sink);
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
#pragma unroll
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
      QuantizeVec(*reinterpret_cast<const Vec16<T>*>(src + index), q_scale, vllm, hw,
                  out + index);
    } else {
      const int64_t index = (r0 + r) * cols + c0 + c;
      out[index] = QuantizeValue(ToFloat(src[index]), q_scale, vllm);
    }
  }
}

// Copies the offending element of job `seq` into the record while the
// source is still alive (stream order), so Sync can print its value.
template <typename T>
__global__ void FetchBadValueKernel(const T* src, Fp8CudaQuantizer::DeviceErrorRecord* record,
                                    unsigned long long seq) {
  const unsigned long long key = record->first_bad;
  if (key != ~0ull && (key >> kIndexBits) == seq) {
    record->value_bits = FloatBits(ToFloat(src[key & kIndexMask]));
  }
}

// As core::Fp8NumScales; refit_cuda does not link refit_core (which links
// refit_cuda), so the three-line rule is restated here.
int64_t NumScales(QuantScheme scheme, int64_t rows, int64_t cols) {
  switch (scheme) {
    case QuantScheme::kPerTensor:
      return 1;
    case QuantScheme::kPerChannel:
      return rows;
    case QuantScheme::kBlock128:
      return ((rows + 127) / 128) * ((cols + 127) / 128);
    case QuantScheme::kNone:
      break;
  }
  return 0;
}

bool Aligned(const void* p, size_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

template <typename T, bool kReject>
absl::Status LaunchJob(const Fp8CudaJob& job, QuantScheme scheme, bool vllm, ErrorSink sink,
                       cudaStream_t stream, int num_sms, bool hw, unsigned long long seq) {
  const T* src = static_cast<const T*>(job.src);
  const int64_t n = job.rows * job.cols;
  constexpr int kN = Vec16<T>::kN;
  const bool aligned = Aligned(job.src, 16) && Aligned(job.out_q, kN);
  switch (scheme) {
    case QuantScheme::kPerTensor: {
      // The scale slot doubles as the amax accumulator: no scratch memory, so
      // jobs on different streams never share state. Bits 0 == +0.0f.
      REFIT_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(job.out_scales, 0, sizeof(float), stream),
                                 "cudaMemsetAsync(scale)");
      if (n > 0) {
        const int64_t work = aligned ? std::max<int64_t>(n / kN, 1) : n;
        const int blocks = static_cast<int>(std::min<int64_t>(
            (work + kThreads - 1) / kThreads, static_cast<int64_t>(num_sms) * 8));
        AmaxFlatKernel<T, kReject><<<blocks, kThreads, 0, stream>>>(
            src, n, aligned, reinterpret_cast<uint32_t*>(job.out_scales), sink);
        PerTensorScaleKernel<<<1, 1, 0, stream>>>(job.out_scales);
        ConvertFlatKernel<T><<<blocks, kThreads, 0, stream>>>(src, n, aligned, job.out_scales,
                                                              job.out_q, vllm, hw);
      }
      break;
    }
    case QuantScheme::kPerChannel: {
      if (job.rows == 0) break;
      const bool vec = aligned && job.cols % kN == 0;
      PerChannelKernel<T, kReject><<<static_cast<unsigned>(job.rows), kThreads, 0, stream>>>(
          src, job.cols, vec, job.out_q, job.out_scales, sink, vllm, hw);
      break;
    }
    case QuantScheme::kBlock128: {
      if (n == 0) break;
      const bool vec = aligned && job.cols % kN == 0;
      const dim3 grid(static_cast<unsigned>((job.cols + 127) / 128),
                      static_cast<unsigned>((job.rows + 127) / 128));
      Block128Kernel<T, kReject><<<grid, kThreads, 0, stream>>>(src, job.rows, job.cols, vec,
                                                               job.out_q, job.out_scales, sink,
                                                               vllm, hw);
      break;
    }
    case QuantScheme::kNone:
      return absl::InvalidArgumentError("unreachable: QuantScheme::kNone");
  }
  if (kReject && n > 0) {
    FetchBadValueKernel<T><<<1, 1, 0, stream>>>(src, sink.record, seq);
  }
  return CudaStatus(cudaGetLastError(),
                    absl::StrCat("launching the FP8 kernels for ", job.tensor_name));
}

template <typename T>
absl::Status Dispatch(const Fp8CudaJob& job, QuantScheme scheme, NonFinitePolicy policy,
                      ErrorSink sink, cudaStream_t stream, int num_sms, bool hw,
                      unsigned long long seq) {
  if (policy == NonFinitePolicy::kReject) {
    return LaunchJob<T, true>(job, scheme, /*vllm=*/false, sink, stream, num_sms, hw, seq);
  }
  return LaunchJob<T, false>(job, scheme, /*vllm=*/true, sink, stream, num_sms, hw, seq);
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

// Runs the check once per device per process.
absl::StatusOr<int64_t> HwConversionMismatches(int device, int num_sms) {
  static std::mutex mu;
  static std::vector<int64_t>* results = new std::vector<int64_t>();  // -1: not run
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<int>(results->size()) <= device) results->resize(device + 1, -1);
  if ((*results)[device] >= 0) return (*results)[device];
  unsigned long long* count = nullptr;
  REFIT_CUDA_RETURN_IF_ERROR(cudaMalloc(&count, sizeof(*count)), "cudaMalloc(conversion check)");
  unsigned long long host = 0;
  const absl::Status status = [&] {
    REFIT_CUDA_RETURN_IF_ERROR(cudaMemset(count, 0, sizeof(*count)), "cudaMemset(conversion check)");
    HwConversionCheckKernel<<<num_sms * 8, kThreads>>>(count);
    REFIT_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "launching the conversion check");
    return CudaStatus(cudaMemcpy(&host, count, sizeof(host), cudaMemcpyDeviceToHost),
                      "running the conversion check");
  }();
  cudaFree(count);
  if (!status.ok()) return status;
  (*results)[device] = static_cast<int64_t>(host);
  return (*results)[device];
}

}  // namespace

int64_t Fp8CudaQuantizer::HardwareConversionMismatchesForTesting() const {
  return hw_mismatches_;
}

Fp8CudaQuantizer::Fp8CudaQuantizer(int device, int num_sms, bool hw_conversion,
                                   int64_t hw_mismatches)
    : device_(device),
      num_sms_(num_sms),
      hw_conversion_(hw_conversion),
      hw_mismatches_(hw_mismatches) {}

absl::StatusOr<std::unique_ptr<Fp8CudaQuantizer>> Fp8CudaQuantizer::Create(
    int device, const Fp8CudaQuantizerOptions& options) {
  absl::Status status = CheckCudaDevice(device);
  if (!status.ok()) return status;
  ScopedCudaDevice scoped(device);
  if (!scoped.status().ok()) return scoped.status();
  int num_sms = 0;
  REFIT_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device),
      "cudaDeviceGetAttribute(multiprocessor count)");
  num_sms = std::max(num_sms, 1);
  int major = 0;
  REFIT_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
      "cudaDeviceGetAttribute(compute capability)");
  // The conversion instruction exists from sm_89 on; this library is built
  // for sm_90 and newer (PTX), so every device it runs on has it.
  bool hw = options.allow_hardware_conversion && major >= 9 &&
            std::getenv("REFIT_FP8_CUDA_SOFTWARE_CONVERSION") == nullptr;
  int64_t mismatches = -1;
  if (hw) {
    absl::StatusOr<int64_t> checked = HwConversionMismatches(device, num_sms);
    if (!checked.ok()) return checked.status();
    mismatches = *checked;
    hw = mismatches == 0;  // bit-identity first: fall back if anything differs
  }
  return std::unique_ptr<Fp8CudaQuantizer>(
      new Fp8CudaQuantizer(device, num_sms, hw, mismatches));
}

Fp8CudaQuantizer::~Fp8CudaQuantizer() {
  ScopedCudaDevice scoped(device_);
  absl::MutexLock lock(&mu_);
  // cudaFree waits for the device, so jobs still running on streams we do
  // not own finish before the records they write to go away.
  for (auto& [stream, state] : streams_) cudaFree(state->device_record);
  for (DeviceErrorRecord* record : free_records_) cudaFree(record);
}

absl::StatusOr<Fp8CudaQuantizer::DeviceErrorRecord*> Fp8CudaQuantizer::AcquireRecord(
    void* stream) {
  DeviceErrorRecord* record = nullptr;
  if (!free_records_.empty()) {
    record = free_records_.back();
    free_records_.pop_back();
  } else {
    // Once per stream plus once per overlapping Sync; not on the hot path.
    REFIT_CUDA_RETURN_IF_ERROR(cudaMalloc(&record, sizeof(DeviceErrorRecord)),
                               "cudaMalloc(FP8 error record)");
  }
  // Reset in stream order: every job enqueued after this sees a clean record.
  const absl::Status status =
      CudaStatus(cudaMemsetAsync(record, 0xFF, sizeof(DeviceErrorRecord),
                                 static_cast<cudaStream_t>(stream)),
                 "cudaMemsetAsync(FP8 error record)");
  if (!status.ok()) {
    free_records_.push_back(record);
    return status;
  }
  return record;
}

absl::StatusOr<Fp8CudaQuantizer::StreamState*> Fp8CudaQuantizer::GetStreamState(void* stream) {
  auto it = streams_.find(stream);
  if (it != streams_.end()) return it->second.get();
  absl::StatusOr<DeviceErrorRecord*> record = AcquireRecord(stream);
  if (!record.ok()) return record.status();
  auto state = std::make_unique<StreamState>();
  state->device_record = *record;
  StreamState* raw = state.get();
  streams_.emplace(stream, std::move(state));
  return raw;
}

absl::Status Fp8CudaQuantizer::Enqueue(const Fp8CudaJob& job, const Fp8QuantizeOptions& options,
                                       void* stream) {
  if (job.src_dtype != DType::kFloat32 && job.src_dtype != DType::kFloat16 &&
      job.src_dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", job.tensor_name, "': cannot quantize dtype #",
                     static_cast<int>(job.src_dtype), " to FP8; expected F32, F16 or BF16"));
  }
  if (options.scheme == QuantScheme::kNone) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", job.tensor_name, "': quantization scheme 'none' is not FP8"));
  }
  if (job.rows < 0 || job.cols < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("tensor '%s': negative shape [%d, %d]",
                                                      job.tensor_name, job.rows, job.cols));
  }
  const int64_t n = job.rows * job.cols;
  if (job.cols != 0 && job.rows > static_cast<int64_t>(kIndexMask) / job.cols) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor '%s': [%d, %d] has more than 2^40 elements", job.tensor_name, job.rows, job.cols));
  }
  if (options.scheme == QuantScheme::kPerChannel && job.rows > 0x7FFFFFFF) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor '%s': %d rows exceed the grid limit", job.tensor_name, job.rows));
  }
  if (options.scheme == QuantScheme::kBlock128 && (job.rows + 127) / 128 > 65535) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor '%s': %d rows exceed the block-scheme grid limit", job.tensor_name, job.rows));
  }
  const int64_t num_scales = NumScales(options.scheme, job.rows, job.cols);
  if ((n > 0 && (job.src == nullptr || job.out_q == nullptr)) ||
      (num_scales > 0 && job.out_scales == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", job.tensor_name, "': null device pointer"));
  }

  ScopedCudaDevice scoped(device_);
  if (!scoped.status().ok()) return scoped.status();
  bool must_sync = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = streams_.find(stream);
    must_sync = it != streams_.end() && it->second->pending.size() >= kMaxJobsPerSync;
  }
  if (must_sync) {
    // The job sequence number would overflow its 24 bits: drain first.
    absl::Status status = Sync(stream);
    if (!status.ok()) return status;
  }
  absl::MutexLock lock(&mu_);
  absl::StatusOr<StreamState*> state = GetStreamState(stream);
  if (!state.ok()) return state.status();
  const unsigned long long seq = (*state)->pending.size();
  const ErrorSink sink{(*state)->device_record, seq << kIndexBits};
  const cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
  const absl::Status status = [&] {
    switch (job.src_dtype) {
      case DType::kFloat32:
        return Dispatch<float>(job, options.scheme, options.non_finite, sink, cuda_stream,
                               num_sms_, hw_conversion_, seq);
      case DType::kBFloat16:
        return Dispatch<Bf16>(job, options.scheme, options.non_finite, sink, cuda_stream,
                              num_sms_, hw_conversion_, seq);
      default:
        return Dispatch<Fp16>(job, options.scheme, options.non_finite, sink, cuda_stream,
                              num_sms_, hw_conversion_, seq);
    }
  }();
  if (!status.ok()) return status;
  (*state)->pending.push_back(PendingJob{std::string(job.tensor_name), job.cols});
  return absl::OkStatus();
}

absl::Status Fp8CudaQuantizer::Sync(void* stream) {
  ScopedCudaDevice scoped(device_);
  if (!scoped.status().ok()) return scoped.status();
  const cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
  // Swap in a fresh record under the lock (no waiting there), then read the
  // old one without the lock: jobs enqueued meanwhile use the fresh record
  // and belong to the next Sync.
  std::vector<PendingJob> jobs;
  DeviceErrorRecord* old_record = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = streams_.find(stream);
    if (it == streams_.end() || it->second->pending.empty()) {
      return CudaStatus(cudaStreamSynchronize(cuda_stream), "waiting for the FP8 kernels");
    }
    absl::StatusOr<DeviceErrorRecord*> fresh = AcquireRecord(stream);
    if (!fresh.ok()) return fresh.status();
    old_record = it->second->device_record;
    it->second->device_record = *fresh;
    jobs = std::move(it->second->pending);
    it->second->pending.clear();
  }
  DeviceErrorRecord host{};
  // To pageable memory: returns only after the stream has passed the jobs.
  const absl::Status status = [&] {
    REFIT_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(&host, old_record, sizeof(host), cudaMemcpyDeviceToHost, cuda_stream),
        "reading back the FP8 error record");
    return CudaStatus(cudaStreamSynchronize(cuda_stream), "waiting for the FP8 kernels");
  }();
  {
    absl::MutexLock lock(&mu_);
    free_records_.push_back(old_record);  // reset when it is handed out again
  }
  if (!status.ok()) return status;
  if (host.first_bad == ~0ull) return absl::OkStatus();
  const uint64_t seq = host.first_bad >> kIndexBits;
  const int64_t index = static_cast<int64_t>(host.first_bad & kIndexMask);
  if (seq >= jobs.size()) {
    return absl::InternalError(
        absl::StrFormat("FP8 error record names job %d of %d", seq, jobs.size()));
  }
  const PendingJob& job = jobs[seq];
  const int64_t row = job.cols > 0 ? index / job.cols : 0;
  const int64_t col = job.cols > 0 ? index % job.cols : 0;
  // Worded as core::QuantizeFp8 words it, so callers see one message.
  const float value = BitsToFloat(host.value_bits);
  const char* text = IsNanBits(host.value_bits) ? "nan" : (value > 0 ? "inf" : "-inf");
  return absl::InvalidArgumentError(absl::StrFormat(
      "tensor '%s': element %d (row %d, col %d) is %s; FP8 quantization rejects non-finite "
      "weights",
      job.tensor_name, index, row, col, text));
}

absl::Status Fp8CudaQuantizer::Quantize(const Fp8CudaJob& job, const Fp8QuantizeOptions& options,
                                        void* stream) {
  absl::Status status = Enqueue(job, options, stream);
  if (!status.ok()) return status;
  return Sync(stream);
}

}  // namespace refit::core::cuda
