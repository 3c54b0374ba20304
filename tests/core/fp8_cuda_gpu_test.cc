// Tests of core/cuda: FP8 quantization on the GPU against the CPU quantizer
// (bytes and scales must be identical), the pinned staging pool and the
// device commit helper.
//
// Two layers:
//  - Fp8CudaMathTest runs everywhere, also without a GPU or without
//    REFIT_WITH_CUDA: it runs the kernels' element math (core/cuda/fp8_math.h)
//    on the host, arranged exactly as the kernels arrange it, and compares
//    with core::QuantizeFp8. A CPU-only machine thus checks the rounding and
//    the non-finite rules the kernels use.
//  - Everything else needs a CUDA device and skips cleanly without one.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/cuda/fp8_math.h"
#include "core/dtype.h"
#include "core/fp8_quantizer.h"
#include "core/model_layout.h"
#include "gtest/gtest.h"

#if REFIT_WITH_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/cuda_device.h"
#include "core/cuda/device_commit.h"
#include "core/cuda/fp8_cuda.h"
#include "core/cuda/pinned_staging.h"
#endif

namespace refit::core {
namespace {

namespace m = fp8_math;

constexpr QuantScheme kSchemes[] = {QuantScheme::kPerTensor, QuantScheme::kPerChannel,
                                    QuantScheme::kBlock128};
constexpr DType kDTypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
constexpr NonFinitePolicy kPolicies[] = {NonFinitePolicy::kReject,
                                         NonFinitePolicy::kVllmCompatible};

at::ScalarType ToTorch(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return at::kBFloat16;
    case DType::kFloat16:
      return at::kHalf;
    default:
      return at::kFloat;
  }
}

std::string CaseName(DType dtype, QuantScheme scheme, NonFinitePolicy policy, int64_t rows,
                     int64_t cols) {
  return absl::StrCat(DTypeName(dtype), " ", QuantSchemeName(scheme), " ",
                      policy == NonFinitePolicy::kReject ? "reject" : "vllm", " [", rows, ", ",
                      cols, "]");
}

// A contiguous CPU tensor of `dtype` whose values span many binades (so the
// e4m3 subnormal range and rounding ties get exercised), seeded.
at::Tensor RandomWeights(int64_t rows, int64_t cols, DType dtype, uint64_t seed) {
  at::manual_seed(seed);
  at::Tensor mantissa = at::randn({rows, cols}, at::kFloat);
  at::Tensor exponent = at::randint(-12, 4, {rows, cols}, at::kFloat);
  return (mantissa * at::exp2(exponent)).to(ToTorch(dtype)).contiguous();
}

struct Quantized {
  absl::Status status;
  std::vector<uint8_t> q;
  std::vector<float> scales;
};

Quantized CpuQuantize(const at::Tensor& src, DType dtype, QuantScheme scheme,
                      NonFinitePolicy policy) {
  const int64_t rows = src.size(0);
  const int64_t cols = src.size(1);
  Quantized out;
  out.q.assign(rows * cols, 0);
  out.scales.assign(Fp8NumScales(scheme, rows, cols), 0.0f);
  Fp8QuantizeOptions options;
  options.scheme = scheme;
  options.non_finite = policy;
  out.status =
      QuantizeFp8(src.data_ptr(), dtype, rows, cols, options, out.q.data(), out.scales.data(), "w");
  return out;
}

// The kernels' algorithm, run on the host with the same element math: the
// amax of a tile as a max over AmaxKey bits, s = ScaleFromAmax, then
// QuantizeValue per element. Non-finite input under kReject yields an error.
Quantized EmulateKernels(const at::Tensor& src, DType dtype, QuantScheme scheme,
                         NonFinitePolicy policy) {
  const int64_t rows = src.size(0);
  const int64_t cols = src.size(1);
  const bool vllm = policy == NonFinitePolicy::kVllmCompatible;
  const uint8_t* base = static_cast<const uint8_t*>(src.data_ptr());
  auto load = [&](int64_t i) -> float {
    uint16_t h;
    switch (dtype) {
      case DType::kBFloat16:
        std::memcpy(&h, base + 2 * i, 2);
        return m::Bf16BitsToFloat(h);
      case DType::kFloat16:
        std::memcpy(&h, base + 2 * i, 2);
        return m::Fp16BitsToFloat(h);
      default: {
        float f;
        std::memcpy(&f, base + 4 * i, 4);
        return f;
      }
    }
  };
  Quantized out;
  out.q.assign(rows * cols, 0);
  out.scales.assign(Fp8NumScales(scheme, rows, cols), 0.0f);
  bool bad = false;
  auto tile = [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1, bool block, float* scale) {
    uint32_t amax = 0;
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = c0; c < c1; ++c) {
        const float x = load(r * cols + c);
        if (vllm) {
          amax = std::max(amax, m::AmaxKey(x));
        } else {
          const uint32_t bits = m::FloatBits(x);
          bad = bad || !m::IsFiniteBits(bits);
          amax = std::max(amax, bits & m::kAbsMask);
        }
      }
    }
    *scale = m::ScaleFromAmax(m::BitsToFloat(amax), block);
    const m::Fp8Scale q_scale = m::MakeFp8Scale(*scale);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = c0; c < c1; ++c) {
        out.q[r * cols + c] = m::QuantizeValue(load(r * cols + c), q_scale, vllm);
      }
    }
  };
  switch (scheme) {
    case QuantScheme::kPerTensor:
      tile(0, rows, 0, cols, false, &out.scales[0]);
      break;
    case QuantScheme::kPerChannel:
      for (int64_t r = 0; r < rows; ++r) tile(r, r + 1, 0, cols, false, &out.scales[r]);
      break;
    default: {
      const int64_t block_cols = (cols + 127) / 128;
      for (int64_t br = 0; br * 128 < rows; ++br) {
        for (int64_t bc = 0; bc * 128 < cols; ++bc) {
          tile(br * 128, std::min(rows, br * 128 + 128), bc * 128, std::min(cols, bc * 128 + 128),
               true, &out.scales[br * block_cols + bc]);
        }
      }
    }
  }
  if (bad) out.status = absl::InvalidArgumentError("non-finite");
  return out;
}

// Bitwise comparison (so NaN scales and -0 count), first mismatch reported.
void ExpectSameBytes(const Quantized& want, const Quantized& got, const std::string& what) {
  ASSERT_EQ(want.q.size(), got.q.size()) << what;
  for (size_t i = 0; i < want.q.size(); ++i) {
    if (want.q[i] != got.q[i]) {
      ADD_FAILURE() << what << ": byte " << i << " is 0x" << std::hex << int{got.q[i]}
                    << ", CPU has 0x" << int{want.q[i]};
      return;
    }
  }
  ASSERT_EQ(want.scales.size(), got.scales.size()) << what;
  for (size_t i = 0; i < want.scales.size(); ++i) {
    if (m::FloatBits(want.scales[i]) != m::FloatBits(got.scales[i])) {
      ADD_FAILURE() << what << ": scale " << i << " is " << got.scales[i] << ", CPU has "
                    << want.scales[i];
      return;
    }
  }
}

// Inputs that hit every branch of the math: zeros (also -0), ties, values
// that need the division path (amax < ~1.3e-36), e4m3 subnormals, and, when
// `non_finite`, NaN and +-Inf.
std::vector<at::Tensor> EdgeCases(DType dtype, bool non_finite) {
  std::vector<at::Tensor> cases;
  const at::ScalarType type = ToTorch(dtype);
  cases.push_back(at::zeros({3, 130}, type));
  cases.push_back(-at::zeros({2, 17}, type));
  at::Tensor ties = at::arange(-600, 600, at::kFloat).reshape({8, 150}) * 0.75f;
  cases.push_back(ties.to(type));
  at::Tensor small = at::randn({5, 129}, at::kFloat) * 1e-3f;
  small[0][0] = 1.0f;  // the other values land in e4m3's subnormal range
  cases.push_back(small.to(type));
  if (dtype != DType::kFloat16) {
    // fp16 cannot hold 1e-38; bf16 and fp32 can.
    cases.push_back((at::randn({4, 33}, at::kFloat) * 1e-38f).to(type));
  }
  at::Tensor mixed_rows = RandomWeights(300, 260, dtype, 7);
  mixed_rows[1].zero_();
  cases.push_back(mixed_rows);
  if (non_finite) {
    at::Tensor nan = RandomWeights(129, 257, dtype, 11);
    nan[5][200] = std::numeric_limits<float>::quiet_NaN();
    nan[100][3] = -std::numeric_limits<float>::quiet_NaN();
    cases.push_back(nan);
    at::Tensor inf = RandomWeights(129, 136, dtype, 12);
    inf[1][7] = std::numeric_limits<float>::infinity();
    inf[64][130] = -std::numeric_limits<float>::infinity();
    cases.push_back(inf);
    at::Tensor all_nan = at::full({2, 9}, std::numeric_limits<float>::quiet_NaN(), type);
    cases.push_back(all_nan);
  }
  return cases;
}

constexpr std::pair<int64_t, int64_t> kShapes[] = {
    {1, 1}, {3, 5}, {1, 1001}, {127, 129}, {130, 257}, {256, 384}, {257, 1000}, {513, 67},
};

TEST(Fp8CudaMathTest, ConversionMatchesCpuForEveryBf16Value) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float x = m::Bf16BitsToFloat(static_cast<uint16_t>(h));
    ASSERT_EQ(m::Fp8E4M3FromFloat(x), Fp8E4M3FromFloat(x)) << "bf16 bits 0x" << std::hex << h;
  }
}

TEST(Fp8CudaMathTest, ConversionMatchesCpuAcrossTheFloatRange) {
  // Every 97th float32 bit pattern below 480, both signs, plus the exact
  // midpoints between neighbouring e4m3 values (the ties).
  for (uint32_t bits = 0; bits < 0x43F00000u; bits += 97) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      const float x = m::BitsToFloat(bits | sign);
      ASSERT_EQ(m::Fp8E4M3FromFloat(x), Fp8E4M3FromFloat(x))
          << "float bits 0x" << std::hex << (bits | sign);
    }
  }
  for (int code = 0; code < 0x7E; ++code) {
    const float mid = (Fp8E4M3ToFloat(code) + Fp8E4M3ToFloat(code + 1)) / 2;
    ASSERT_EQ(m::Fp8E4M3FromFloat(mid), Fp8E4M3FromFloat(mid)) << "tie above code " << code;
    ASSERT_EQ(m::Fp8E4M3FromFloat(-mid), Fp8E4M3FromFloat(-mid)) << "tie below -code " << code;
  }
}

TEST(Fp8CudaMathTest, Fp16DecodingIsExact) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    at::Tensor half = at::empty({1}, at::kHalf);
    const uint16_t bits = static_cast<uint16_t>(h);
    std::memcpy(half.data_ptr(), &bits, 2);
    const float want = half.to(at::kFloat).item<float>();
    const float got = m::Fp16BitsToFloat(bits);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << h;
    } else {
      ASSERT_EQ(m::FloatBits(want), m::FloatBits(got)) << "fp16 bits 0x" << std::hex << h;
    }
  }
}

TEST(Fp8CudaMathTest, KernelAlgorithmMatchesCpuQuantizer) {
  uint64_t seed = 1;
  for (DType dtype : kDTypes) {
    for (QuantScheme scheme : kSchemes) {
      for (NonFinitePolicy policy : kPolicies) {
        std::vector<at::Tensor> inputs;
        for (auto [rows, cols] : kShapes)
          inputs.push_back(RandomWeights(rows, cols, dtype, ++seed));
        for (at::Tensor& edge : EdgeCases(dtype, /*non_finite=*/true)) inputs.push_back(edge);
        for (const at::Tensor& src : inputs) {
          const std::string what = CaseName(dtype, scheme, policy, src.size(0), src.size(1));
          const Quantized cpu = CpuQuantize(src, dtype, scheme, policy);
          const Quantized emulated = EmulateKernels(src, dtype, scheme, policy);
          ASSERT_EQ(cpu.status.code(), emulated.status.code()) << what << ": " << cpu.status;
          if (cpu.status.ok()) ExpectSameBytes(cpu, emulated, what);
        }
      }
    }
  }
}

#if !REFIT_WITH_CUDA

TEST(Fp8CudaGpuTest, SkippedWithoutCudaBuild) {
  GTEST_SKIP() << "built without REFIT_WITH_CUDA; the GPU tests are not compiled";
}

#else  // REFIT_WITH_CUDA

using cuda::CopyMethod;
using cuda::CudaDeviceCount;
using cuda::DeviceCopy;
using cuda::DeviceEvent;
using cuda::EnqueueDeviceCopies;
using cuda::Fp8CudaJob;
using cuda::Fp8CudaQuantizer;
using cuda::PinnedStagingOptions;
using cuda::PinnedStagingPool;

#define REFIT_SKIP_WITHOUT_GPU()                                          \
  do {                                                                    \
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device present"; \
  } while (0)

at::Tensor DeviceBytes(int64_t n) {
  return at::zeros({std::max<int64_t>(n, 1)},
                   at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
}

// Runs the GPU quantizer on `src` (copied to the device at `src_offset`
// bytes past a 256-byte boundary and written `out_offset` bytes past one,
// so that misaligned buffers take the scalar path).
Quantized GpuQuantize(Fp8CudaQuantizer& quantizer, const at::Tensor& src, DType dtype,
                      QuantScheme scheme, NonFinitePolicy policy, int64_t src_offset = 0,
                      int64_t out_offset = 0) {
  const int64_t rows = src.size(0);
  const int64_t cols = src.size(1);
  const int64_t nbytes = src.numel() * static_cast<int64_t>(src.element_size());
  at::Tensor dev_src = DeviceBytes(nbytes + src_offset);
  if (nbytes > 0) {
    dev_src.narrow(0, src_offset, nbytes).copy_(at::from_blob(src.data_ptr(), {nbytes}, at::kByte));
  }
  at::Tensor dev_q = DeviceBytes(rows * cols + out_offset);
  const int64_t num_scales = Fp8NumScales(scheme, rows, cols);
  at::Tensor dev_scales = at::full({std::max<int64_t>(num_scales, 1)}, -1.0f,
                                   at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
  Fp8CudaJob job;
  job.src = static_cast<uint8_t*>(dev_src.data_ptr()) + src_offset;
  job.src_dtype = dtype;
  job.rows = rows;
  job.cols = cols;
  job.out_q = static_cast<uint8_t*>(dev_q.data_ptr()) + out_offset;
  job.out_scales = dev_scales.data_ptr<float>();
  job.tensor_name = "w";
  Fp8QuantizeOptions options;
  options.scheme = scheme;
  options.non_finite = policy;
  Quantized out;
  out.status = quantizer.Quantize(job, options, nullptr);
  at::Tensor q = dev_q.narrow(0, out_offset, rows * cols).cpu();
  at::Tensor scales = dev_scales.narrow(0, 0, num_scales).cpu();
  out.q.assign(q.data_ptr<uint8_t>(), q.data_ptr<uint8_t>() + rows * cols);
  out.scales.assign(scales.data_ptr<float>(), scales.data_ptr<float>() + num_scales);
  return out;
}

TEST(CudaDeviceTest, ReportsUnavailableWithoutDevice) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_EQ(cuda::CheckCudaDevice(0).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Fp8CudaQuantizer::Create(0).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(PinnedStagingPool::Create(PinnedStagingOptions{}).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(DeviceEvent::Create(0).status().code(), absl::StatusCode::kUnavailable);
}

TEST(CudaDeviceTest, RejectsMissingOrdinal) {
  REFIT_SKIP_WITHOUT_GPU();
  const absl::Status status = cuda::CheckCudaDevice(CudaDeviceCount());
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(status.message().find("does not exist"), absl::string_view::npos) << status;
}

class Fp8CudaGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    REFIT_SKIP_WITHOUT_GPU();
    absl::StatusOr<std::unique_ptr<Fp8CudaQuantizer> > quantizer = Fp8CudaQuantizer::Create(0);
    ASSERT_TRUE(quantizer.ok()) << quantizer.status();
    quantizer_ = std::move(*quantizer);
    cuda::Fp8CudaQuantizerOptions software;
    software.allow_hardware_conversion = false;
    quantizer = Fp8CudaQuantizer::Create(0, software);
    ASSERT_TRUE(quantizer.ok()) << quantizer.status();
    software_ = std::move(*quantizer);
  }
  // Both conversion paths must give the CPU's bytes.
  std::vector<std::pair<const char*, Fp8CudaQuantizer*> > Quantizers() {
    return {{"hardware conversion", quantizer_.get()}, {"integer conversion", software_.get()}};
  }
  std::unique_ptr<Fp8CudaQuantizer> quantizer_;
  std::unique_ptr<Fp8CudaQuantizer> software_;
};

TEST_F(Fp8CudaGpuTest, HardwareConversionIsBitIdenticalOnThisDevice) {
  // Create compared cvt.rn.satfinite.e4m3x2.f32 with the integer conversion
  // for every finite float32 of both signs.
  EXPECT_EQ(quantizer_->HardwareConversionMismatchesForTesting(), 0);
  EXPECT_TRUE(quantizer_->hardware_conversion());
  EXPECT_FALSE(software_->hardware_conversion());
}

TEST_F(Fp8CudaGpuTest, MatchesCpuOnRandomWeights) {
  uint64_t seed = 100;
  for (DType dtype : kDTypes) {
    for (QuantScheme scheme : kSchemes) {
      for (NonFinitePolicy policy : kPolicies) {
        for (auto [rows, cols] : kShapes) {
          const at::Tensor src = RandomWeights(rows, cols, dtype, ++seed);
          const Quantized cpu = CpuQuantize(src, dtype, scheme, policy);
          ASSERT_TRUE(cpu.status.ok()) << cpu.status;
          for (auto [path, quantizer] : Quantizers()) {
            const std::string what =
                absl::StrCat(CaseName(dtype, scheme, policy, rows, cols), ", ", path);
            const Quantized gpu = GpuQuantize(*quantizer, src, dtype, scheme, policy);
            ASSERT_TRUE(gpu.status.ok()) << what << ": " << gpu.status;
            ExpectSameBytes(cpu, gpu, what);
          }
        }
      }
    }
  }
}

TEST_F(Fp8CudaGpuTest, MatchesCpuOnLargeTensors) {
  // Big enough for many blocks per SM and the grid-stride loops' tails.
  uint64_t seed = 200;
  for (DType dtype : kDTypes) {
    for (QuantScheme scheme : kSchemes) {
      const at::Tensor src = RandomWeights(2053, 4099, dtype, ++seed);
      const std::string what =
          CaseName(dtype, scheme, NonFinitePolicy::kReject, src.size(0), src.size(1));
      const Quantized cpu = CpuQuantize(src, dtype, scheme, NonFinitePolicy::kReject);
      const Quantized gpu = GpuQuantize(*quantizer_, src, dtype, scheme, NonFinitePolicy::kReject);
      ASSERT_TRUE(gpu.status.ok()) << what << ": " << gpu.status;
      ExpectSameBytes(cpu, gpu, what);
    }
  }
}

TEST_F(Fp8CudaGpuTest, MatchesCpuOnEdgeCases) {
  for (DType dtype : kDTypes) {
    for (QuantScheme scheme : kSchemes) {
      for (auto [path, quantizer] : Quantizers()) {
        for (const at::Tensor& src : EdgeCases(dtype, /*non_finite=*/true)) {
          const std::string what = absl::StrCat(
              CaseName(dtype, scheme, NonFinitePolicy::kVllmCompatible, src.size(0), src.size(1)),
              ", ", path);
          const Quantized cpu = CpuQuantize(src, dtype, scheme, NonFinitePolicy::kVllmCompatible);
          ASSERT_TRUE(cpu.status.ok()) << what << ": " << cpu.status;
          const Quantized gpu =
              GpuQuantize(*quantizer, src, dtype, scheme, NonFinitePolicy::kVllmCompatible);
          ASSERT_TRUE(gpu.status.ok()) << what << ": " << gpu.status;
          ExpectSameBytes(cpu, gpu, what);
        }
        for (const at::Tensor& src : EdgeCases(dtype, /*non_finite=*/false)) {
          const std::string what = absl::StrCat(
              CaseName(dtype, scheme, NonFinitePolicy::kReject, src.size(0), src.size(1)), ", ",
              path);
          const Quantized cpu = CpuQuantize(src, dtype, scheme, NonFinitePolicy::kReject);
          const Quantized gpu =
              GpuQuantize(*quantizer, src, dtype, scheme, NonFinitePolicy::kReject);
          ASSERT_TRUE(gpu.status.ok()) << what << ": " << gpu.status;
          ExpectSameBytes(cpu, gpu, what);
        }
      }
    }
  }
}

TEST_F(Fp8CudaGpuTest, MisalignedBuffersTakeTheScalarPathWithSameBytes) {
  for (DType dtype : kDTypes) {
    for (QuantScheme scheme : kSchemes) {
      const at::Tensor src = RandomWeights(131, 264, dtype, 300);
      const std::string what =
          CaseName(dtype, scheme, NonFinitePolicy::kReject, src.size(0), src.size(1));
      const Quantized cpu = CpuQuantize(src, dtype, scheme, NonFinitePolicy::kReject);
      const int64_t esize = static_cast<int64_t>(DTypeSize(dtype));
      for (auto [path, quantizer] : Quantizers()) {
        const Quantized gpu = GpuQuantize(*quantizer, src, dtype, scheme, NonFinitePolicy::kReject,
                                          /*src_offset=*/esize, /*out_offset=*/1);
        ASSERT_TRUE(gpu.status.ok()) << what << ", " << path << ": " << gpu.status;
        ExpectSameBytes(cpu, gpu, absl::StrCat(what, ", ", path));
        // Aligned source, misaligned output: vector loads, scalar path.
        const Quantized half = GpuQuantize(*quantizer, src, dtype, scheme, NonFinitePolicy::kReject,
                                           0, /*out_offset=*/3);
        ASSERT_TRUE(half.status.ok()) << half.status;
        ExpectSameBytes(cpu, half, absl::StrCat(what, ", ", path, ", output offset 3"));
      }
    }
  }
}

TEST_F(Fp8CudaGpuTest, EmptyTensorsGiveZeroScales) {
  for (QuantScheme scheme : kSchemes) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{0, 0}, {4, 0}, {0, 7}}) {
      const at::Tensor src = at::zeros({rows, cols}, at::kBFloat16);
      const Quantized cpu = CpuQuantize(src, DType::kBFloat16, scheme, NonFinitePolicy::kReject);
      const Quantized gpu =
          GpuQuantize(*quantizer_, src, DType::kBFloat16, scheme, NonFinitePolicy::kReject);
      ASSERT_TRUE(gpu.status.ok()) << gpu.status;
      ExpectSameBytes(cpu, gpu,
                      CaseName(DType::kBFloat16, scheme, NonFinitePolicy::kReject, rows, cols));
    }
  }
}

TEST_F(Fp8CudaGpuTest, RejectsNonFiniteInputWithTheCpuMessage) {
  for (DType dtype : kDTypes) {
    for (QuantScheme scheme : kSchemes) {
      for (const at::Tensor& src : EdgeCases(dtype, /*non_finite=*/true)) {
        const Quantized cpu = CpuQuantize(src, dtype, scheme, NonFinitePolicy::kReject);
        if (cpu.status.ok()) continue;
        const Quantized gpu =
            GpuQuantize(*quantizer_, src, dtype, scheme, NonFinitePolicy::kReject);
        EXPECT_EQ(gpu.status.code(), absl::StatusCode::kInvalidArgument);
        // Same first element, same words: callers cannot tell the paths apart.
        EXPECT_EQ(gpu.status.message(), cpu.status.message())
            << CaseName(dtype, scheme, NonFinitePolicy::kReject, src.size(0), src.size(1));
      }
    }
  }
}

TEST_F(Fp8CudaGpuTest, SyncNamesTheFirstBadJobAndThenStartsClean) {
  const at::Tensor good = RandomWeights(64, 64, DType::kFloat32, 1).cuda();
  at::Tensor bad = RandomWeights(64, 64, DType::kFloat32, 2);
  bad[3][4] = std::numeric_limits<float>::infinity();
  bad = bad.cuda();
  at::Tensor q = DeviceBytes(64 * 64);
  at::Tensor scales = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
  Fp8QuantizeOptions options;
  auto job = [&](const at::Tensor& src, const char* name) {
    Fp8CudaJob j;
    j.src = src.data_ptr();
    j.src_dtype = DType::kFloat32;
    j.rows = 64;
    j.cols = 64;
    j.out_q = q.data_ptr<uint8_t>();
    j.out_scales = scales.data_ptr<float>();
    j.tensor_name = name;
    return j;
  };
  ASSERT_TRUE(quantizer_->Enqueue(job(good, "a"), options, nullptr).ok());
  ASSERT_TRUE(quantizer_->Enqueue(job(bad, "b"), options, nullptr).ok());
  ASSERT_TRUE(quantizer_->Enqueue(job(bad, "c"), options, nullptr).ok());
  const absl::Status status = quantizer_->Sync(nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(),
            "tensor 'b': element 196 (row 3, col 4) is inf; FP8 quantization rejects non-finite "
            "weights");
  ASSERT_TRUE(quantizer_->Enqueue(job(good, "d"), options, nullptr).ok());
  EXPECT_TRUE(quantizer_->Sync(nullptr).ok());
}

// A failed runtime call whose error nobody consumed (a cleanup's, say)
// leaves it as the thread's last error. The kernel launches learn of their
// own failures from that error, so they must not report this one.
void LeaveAnUnconsumedOutOfMemoryError() {
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, size_t{1} << 60), cudaErrorMemoryAllocation);
  ASSERT_EQ(cudaPeekAtLastError(), cudaErrorMemoryAllocation);
}

TEST_F(Fp8CudaGpuTest, AnEarlierUnconsumedErrorDoesNotFailTheLaunch) {
  const at::Tensor src = RandomWeights(64, 64, DType::kBFloat16, 7);
  const Quantized cpu =
      CpuQuantize(src, DType::kBFloat16, QuantScheme::kPerTensor, NonFinitePolicy::kReject);
  ASSERT_TRUE(cpu.status.ok()) << cpu.status;
  LeaveAnUnconsumedOutOfMemoryError();
  const Quantized gpu = GpuQuantize(*quantizer_, src, DType::kBFloat16, QuantScheme::kPerTensor,
                                    NonFinitePolicy::kReject);
  ASSERT_TRUE(gpu.status.ok()) << gpu.status;
  ExpectSameBytes(cpu, gpu, "after an unconsumed error");
}

TEST_F(Fp8CudaGpuTest, RejectsBadArgumentsBeforeLaunching) {
  Fp8CudaJob job;
  job.rows = 2;
  job.cols = 2;
  job.tensor_name = "layer.weight";
  Fp8QuantizeOptions options;
  absl::Status status = quantizer_->Enqueue(job, options, nullptr);  // null pointers
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("layer.weight"), absl::string_view::npos) << status;
  job.src_dtype = DType::kInt8;
  status = quantizer_->Enqueue(job, options, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  job.src_dtype = DType::kBFloat16;
  options.scheme = QuantScheme::kNone;
  status = quantizer_->Enqueue(job, options, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("none"), absl::string_view::npos) << status;
}

class PinnedStagingGpuTest : public ::testing::Test {
 protected:
  void SetUp() override { REFIT_SKIP_WITHOUT_GPU(); }
};

TEST_F(PinnedStagingGpuTest, RoundTripsMoreChunksThanBuffers) {
  PinnedStagingOptions options;
  options.buffer_bytes = 1 << 20;
  options.num_buffers = 3;
  absl::StatusOr<std::unique_ptr<PinnedStagingPool> > pool = PinnedStagingPool::Create(options);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*pool)->pinned_bytes(), 3 << 20);

  const int64_t total = (int64_t{11} << 20) + 12345;
  std::vector<uint8_t> host(total);
  std::mt19937 rng(5);
  for (uint8_t& b : host) b = static_cast<uint8_t>(rng());
  at::Tensor device = DeviceBytes(total);
  int64_t offset = 0;
  int copies = 0;
  while (offset < total) {
    absl::StatusOr<PinnedStagingPool::Lease> lease = (*pool)->Acquire();
    ASSERT_TRUE(lease.ok()) << lease.status();
    // Uneven chunk sizes, as gRPC messages arrive.
    const int64_t n = std::min<int64_t>(total - offset, (1 << 20) - (copies % 5) * 4099);
    std::memcpy(lease->data(), host.data() + offset, n);
    ASSERT_TRUE((*pool)
                    ->CopyToDevice(std::move(*lease), device.data_ptr<uint8_t>() + offset, n,
                                   /*consumer_stream=*/nullptr)
                    .ok());
    offset += n;
    ++copies;
  }
  ASSERT_TRUE((*pool)->Synchronize().ok());
  at::Tensor back = device.cpu();
  EXPECT_EQ(std::memcmp(back.data_ptr<uint8_t>(), host.data(), total), 0);
  const cuda::PinnedStagingStats stats = (*pool)->stats();
  EXPECT_EQ(stats.copies, copies);
  EXPECT_EQ(stats.bytes_copied, total);
  EXPECT_GT(stats.acquire_waits, 0);  // 12 copies through 3 buffers: reuse
}

TEST_F(PinnedStagingGpuTest, DroppedLeaseReturnsItsBuffer) {
  PinnedStagingOptions options;
  options.buffer_bytes = 4096;
  options.num_buffers = 1;
  absl::StatusOr<std::unique_ptr<PinnedStagingPool> > pool = PinnedStagingPool::Create(options);
  ASSERT_TRUE(pool.ok()) << pool.status();
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<PinnedStagingPool::Lease> lease = (*pool)->Acquire();
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_TRUE(lease->valid());
    EXPECT_EQ(lease->capacity(), 4096);
  }  // each lease goes out of scope unused; the single buffer comes back
}

TEST_F(PinnedStagingGpuTest, RejectsOversizedCopyAndKeepsTheBuffer) {
  PinnedStagingOptions options;
  options.buffer_bytes = 4096;
  options.num_buffers = 1;
  absl::StatusOr<std::unique_ptr<PinnedStagingPool> > pool = PinnedStagingPool::Create(options);
  ASSERT_TRUE(pool.ok()) << pool.status();
  at::Tensor device = DeviceBytes(8192);
  absl::StatusOr<PinnedStagingPool::Lease> lease = (*pool)->Acquire();
  ASSERT_TRUE(lease.ok());
  const absl::Status status =
      (*pool)->CopyToDevice(std::move(*lease), device.data_ptr<uint8_t>(), 8192);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*pool)->Acquire().ok());  // would block forever had the buffer leaked
  EXPECT_EQ(PinnedStagingPool::Create({0, 0, 2}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

class DeviceCommitGpuTest : public ::testing::Test {
 protected:
  void SetUp() override { REFIT_SKIP_WITHOUT_GPU(); }
};

TEST_F(DeviceCommitGpuTest, CopiesInPlaceAndSignalsTheEvent) {
  const at::TensorOptions byte_options = at::TensorOptions().dtype(at::kByte).device(at::kCUDA);
  std::vector<at::Tensor> live, staged;
  std::vector<DeviceCopy> copies;
  for (int64_t n : {int64_t{1}, int64_t{4}, int64_t{1000}, int64_t{3} << 20}) {
    live.push_back(at::zeros({n}, byte_options));
    staged.push_back(at::randint(0, 256, {n}, byte_options));
    copies.push_back({live.back().data_ptr(), staged.back().data_ptr(), n});
  }
  std::vector<void*> pointers_before;
  for (const at::Tensor& t : live) pointers_before.push_back(t.data_ptr());
  absl::StatusOr<std::unique_ptr<DeviceEvent> > done = DeviceEvent::Create(0);
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_TRUE(EnqueueDeviceCopies(copies, nullptr, done->get()).ok());
  ASSERT_TRUE((*done)->Wait().ok());
  absl::StatusOr<bool> complete = (*done)->IsComplete();
  ASSERT_TRUE(complete.ok());
  EXPECT_TRUE(*complete);
  for (size_t i = 0; i < live.size(); ++i) {
    EXPECT_EQ(live[i].data_ptr(), pointers_before[i]);
    EXPECT_TRUE(at::equal(live[i].cpu(), staged[i].cpu())) << "copy " << i;
  }
}

TEST_F(DeviceCommitGpuTest, BatchedKernelAndMemcpyEachGiveTheSameBytesForEveryKindOfCopy) {
  // Device copies of every alignment go to the batched kernel; a pinned host
  // source goes to cudaMemcpyAsync; both methods must write the same bytes
  // and nothing outside the destinations.
  const at::TensorOptions device_bytes = at::TensorOptions().dtype(at::kByte).device(at::kCUDA);
  const int64_t kTile = int64_t{64} << 10;
  struct Case {
    int64_t bytes, src_off, dst_off;
    bool host_src;
  };
  const std::vector<Case> cases = {{4, 0, 0, false},
                                   {1, 3, 7, false},
                                   {kTile + 17, 5, 5, false},
                                   {3 * kTile + 1000, 0, 0, false},
                                   {2 * kTile + 3, 1, 2, false},
                                   {(int64_t{5} << 20) + 9, 0, 0, false},
                                   {70000, 0, 0, true}};
  for (CopyMethod method : {CopyMethod::kBatched, CopyMethod::kMemcpyEach}) {
    std::vector<at::Tensor> live, staged;
    std::vector<DeviceCopy> copies;
    for (const Case& c : cases) {
      live.push_back(at::full({c.bytes + c.dst_off + 64}, 0xEE, device_bytes));
      at::Tensor src =
          at::randint(0, 256, {c.bytes + c.src_off}, at::TensorOptions().dtype(at::kByte));
      staged.push_back(c.host_src ? src.pin_memory() : src.to(at::kCUDA));
      copies.push_back({static_cast<uint8_t*>(live.back().data_ptr()) + c.dst_off,
                        static_cast<const uint8_t*>(staged.back().data_ptr()) + c.src_off,
                        c.bytes});
    }
    absl::StatusOr<std::unique_ptr<DeviceEvent> > done = DeviceEvent::Create(0);
    ASSERT_TRUE(done.ok()) << done.status();
    ASSERT_TRUE(EnqueueDeviceCopies(copies, nullptr, done->get(), method).ok());
    ASSERT_TRUE((*done)->Wait().ok());
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      at::Tensor out = live[i].cpu();
      at::Tensor want = staged[i].cpu().narrow(0, c.src_off, c.bytes);
      EXPECT_TRUE(at::equal(out.narrow(0, c.dst_off, c.bytes), want))
          << "case " << i << (method == CopyMethod::kBatched ? " batched" : " memcpy");
      EXPECT_EQ(out.narrow(0, 0, c.dst_off).ne(0xEE).sum().item<int64_t>(), 0) << "case " << i;
      EXPECT_EQ(out.narrow(0, c.dst_off + c.bytes, 64).ne(0xEE).sum().item<int64_t>(), 0)
          << "case " << i << ": wrote past the end";
    }
  }
}

TEST_F(DeviceCommitGpuTest, AnEarlierUnconsumedErrorDoesNotFailTheCopies) {
  const at::TensorOptions byte_options = at::TensorOptions().dtype(at::kByte).device(at::kCUDA);
  at::Tensor live = at::zeros({70000}, byte_options);
  at::Tensor staged = at::randint(0, 256, {70000}, byte_options);
  const std::vector<DeviceCopy> copies = {{live.data_ptr(), staged.data_ptr(), 70000}};
  absl::StatusOr<std::unique_ptr<DeviceEvent> > done = DeviceEvent::Create(0);
  ASSERT_TRUE(done.ok()) << done.status();
  LeaveAnUnconsumedOutOfMemoryError();
  const absl::Status enqueued = EnqueueDeviceCopies(copies, nullptr, done->get());
  ASSERT_TRUE(enqueued.ok()) << enqueued;
  ASSERT_TRUE((*done)->Wait().ok());
  EXPECT_TRUE(at::equal(live.cpu(), staged.cpu()));
}

TEST_F(DeviceCommitGpuTest, RejectsInvalidCopiesWithoutEnqueuingAny) {
  const at::TensorOptions byte_options = at::TensorOptions().dtype(at::kByte).device(at::kCUDA);
  at::Tensor live = at::zeros({16}, byte_options);
  at::Tensor staged = at::ones({16}, byte_options);
  const std::vector<DeviceCopy> copies = {{live.data_ptr(), staged.data_ptr(), 16},
                                          {nullptr, staged.data_ptr(), 16}};
  const absl::Status status = EnqueueDeviceCopies(copies, nullptr, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("copy 1 of 2"), absl::string_view::npos) << status;
  EXPECT_EQ(live.sum().item<int64_t>(), 0);  // the valid first copy did not run either
}

#endif  // REFIT_WITH_CUDA

}  // namespace
}  // namespace refit::core
