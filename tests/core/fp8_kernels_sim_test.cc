// Runs the CUDA FP8 kernels (core/cuda/fp8_kernels.cuh) on the host, in a
// simulated grid, and compares their bytes and scales with the CPU quantizer.
//
// Why: most machines that build refitd have no GPU, and the device tests in
// fp8_cuda_gpu_test.cc skip there. This test runs the kernels' own code on
// any machine: their indexing, the 16-byte vector paths and the scalar tails,
// the per-block reductions, the edge tiles and the error records. Each
// simulated thread block is 256 real threads with real barriers, so
// __syncthreads and the warp shuffles behave as on a GPU. Only the hardware
// e4m3 conversion instruction is replaced, by the integer conversion that
// Fp8CudaQuantizer::Create checks it against on the device.
//
// It needs no CUDA (not even REFIT_WITH_CUDA) and never skips.
#include <ATen/ATen.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/fp8_quantizer.h"
#include "core/model_layout.h"
#include "gtest/gtest.h"

// ---- a minimal CUDA execution model on host threads ----

namespace refit_cuda_sim {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

// Reusable barrier for a fixed number of threads.
class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const int generation = generation_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation != generation_; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int count_;
  int arrived_ = 0;
  int generation_ = 0;
};

struct BlockContext {
  explicit BlockContext(unsigned threads) : block(threads), shuffle(threads) {
    for (unsigned w = 0; w < (threads + 31) / 32; ++w) {
      warps.push_back(std::make_unique<Barrier>(std::min(32u, threads - 32 * w)));
    }
  }
  Barrier block;
  std::vector<std::unique_ptr<Barrier>> warps;
  std::vector<uint32_t> shuffle;
};

thread_local BlockContext* current_block = nullptr;

}  // namespace refit_cuda_sim

thread_local refit_cuda_sim::Dim3 threadIdx;
thread_local refit_cuda_sim::Dim3 blockIdx;
refit_cuda_sim::Dim3 blockDim;
refit_cuda_sim::Dim3 gridDim;

#define __global__ inline
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
// Blocks run one after another, so one static copy per function is "shared
// memory" of the running block.
#define __shared__ static

inline void __syncthreads() { refit_cuda_sim::current_block->block.Wait(); }

inline uint32_t __shfl_xor_sync(unsigned /*mask*/, uint32_t value, int lane_mask) {
  refit_cuda_sim::BlockContext& block = *refit_cuda_sim::current_block;
  const unsigned warp = threadIdx.x >> 5;
  const unsigned lane = threadIdx.x & 31;
  block.shuffle[threadIdx.x] = value;
  block.warps[warp]->Wait();
  const uint32_t result = block.shuffle[(warp << 5) | (lane ^ static_cast<unsigned>(lane_mask))];
  block.warps[warp]->Wait();  // nobody overwrites a slot before all have read
  return result;
}

inline uint32_t max(uint32_t a, uint32_t b) { return a > b ? a : b; }

template <typename T>
T AtomicUpdate(T* address, T value, bool take_max) {
  T old = __atomic_load_n(address, __ATOMIC_SEQ_CST);
  while ((take_max ? value > old : value < old) &&
         !__atomic_compare_exchange_n(address, &old, value, false, __ATOMIC_SEQ_CST,
                                      __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline uint32_t atomicMax(uint32_t* address, uint32_t value) {
  return AtomicUpdate(address, value, true);
}
inline unsigned long long atomicMin(unsigned long long* address, unsigned long long value) {
  return AtomicUpdate(address, value, false);
}
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}

struct uint2 {
  uint32_t x, y;
};
inline uint2 make_uint2(uint32_t x, uint32_t y) { return uint2{x, y}; }

#include "core/cuda/fp8_kernels.cuh"  // NOLINT: after the simulated CUDA vocabulary

namespace refit_cuda_sim {

// Runs `kernel` (a callable that calls one __global__ function) over `grid`
// with `threads` threads per block: one host thread per CUDA thread, kept
// for the whole grid; blocks run in order.
template <typename Kernel>
void Launch(Dim3 grid, unsigned threads, const Kernel& kernel) {
  gridDim = grid;
  blockDim = Dim3{threads, 1, 1};
  BlockContext context(threads);
  Barrier block_done(static_cast<int>(threads));
  std::vector<std::thread> workers;
  for (unsigned t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      current_block = &context;
      threadIdx = Dim3{t, 0, 0};
      for (unsigned y = 0; y < grid.y; ++y) {
        for (unsigned x = 0; x < grid.x; ++x) {
          blockIdx = Dim3{x, y, 0};
          kernel();
          block_done.Wait();  // the next block starts with fresh "shared memory"
        }
      }
    });
  }
  for (std::thread& worker : workers) worker.join();
}

}  // namespace refit_cuda_sim

namespace refit::core {
namespace {

namespace k = cuda::fp8_kernels;
using refit_cuda_sim::Dim3;
using refit_cuda_sim::Launch;

// Few SMs: small flat grids, so the grid-stride loops and their tails run.
constexpr int kSimSms = 2;

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

at::Tensor RandomWeights(int64_t rows, int64_t cols, DType dtype, uint64_t seed) {
  at::manual_seed(seed);
  at::Tensor mantissa = at::randn({rows, cols}, at::kFloat);
  at::Tensor exponent = at::randint(-12, 4, {rows, cols}, at::kFloat);
  return (mantissa * at::exp2(exponent)).to(ToTorch(dtype)).contiguous();
}

struct Result {
  bool rejected = false;
  int64_t bad_index = -1;
  std::vector<uint8_t> q;
  std::vector<float> scales;
};

// A copy of `src` at `offset` bytes past a 64-byte boundary.
struct OffsetBuffer {
  OffsetBuffer(size_t bytes, size_t offset) : storage(bytes + offset + 64) {
    const uintptr_t base = reinterpret_cast<uintptr_t>(storage.data());
    data = storage.data() + ((64 - base % 64) % 64) + offset;
  }
  std::vector<uint8_t> storage;
  uint8_t* data;
};

// What Fp8CudaQuantizer::Enqueue launches (fp8_quantize.cu, LaunchJob), with
// the same grid and path decisions, on the simulated grid.
template <typename T, bool kReject>
Result RunKernels(const at::Tensor& src_tensor, QuantScheme scheme, bool hw, size_t src_offset,
                  size_t out_offset) {
  const int64_t rows = src_tensor.size(0);
  const int64_t cols = src_tensor.size(1);
  const int64_t n = rows * cols;
  const bool vllm = !kReject;
  OffsetBuffer src_buffer(n * sizeof(T), src_offset);
  if (n > 0) std::memcpy(src_buffer.data, src_tensor.data_ptr(), n * sizeof(T));
  OffsetBuffer out_buffer(n, out_offset);
  const T* src = reinterpret_cast<const T*>(src_buffer.data);
  uint8_t* out = out_buffer.data;
  std::vector<float> scales(std::max<int64_t>(Fp8NumScales(scheme, rows, cols), 1), -1.0f);
  k::ErrorRecord record;
  std::memset(&record, 0xFF, sizeof(record));
  const k::ErrorSink sink{&record, 0};
  constexpr int kN = k::Vec16<T>::kN;
  const bool aligned = k::AlignedForVectors(src, out, kN);
  switch (scheme) {
    case QuantScheme::kPerTensor: {
      scales[0] = 0.0f;
      if (n == 0) break;
      const unsigned blocks = static_cast<unsigned>(k::FlatBlocks(n, aligned, kN, kSimSms));
      Launch(Dim3{blocks}, k::kThreads, [&] {
        k::AmaxFlatKernel<T, kReject>(src, n, aligned, reinterpret_cast<uint32_t*>(scales.data()),
                                      sink);
      });
      Launch(Dim3{1}, 1, [&] { k::PerTensorScaleKernel(scales.data()); });
      Launch(Dim3{blocks}, k::kThreads,
             [&] { k::ConvertFlatKernel<T>(src, n, aligned, scales.data(), out, vllm, hw); });
      break;
    }
    case QuantScheme::kPerChannel: {
      if (rows == 0) break;
      const bool vec = aligned && cols % kN == 0;
      Launch(Dim3{static_cast<unsigned>(rows)}, k::kThreads, [&] {
        k::PerChannelKernel<T, kReject>(src, cols, vec, out, scales.data(), sink, vllm, hw);
      });
      break;
    }
    default: {
      if (n == 0) break;
      const bool vec = aligned && cols % kN == 0;
      const Dim3 grid{static_cast<unsigned>((cols + 127) / 128),
                      static_cast<unsigned>((rows + 127) / 128)};
      Launch(grid, k::kThreads, [&] {
        k::Block128Kernel<T, kReject>(src, rows, cols, vec, out, scales.data(), sink, vllm, hw);
      });
    }
  }
  if (kReject && n > 0) {
    Launch(Dim3{1}, 1, [&] { k::FetchBadValueKernel<T>(src, &record, 0); });
  }
  Result result;
  result.q.assign(out, out + n);
  result.scales.assign(scales.begin(), scales.begin() + Fp8NumScales(scheme, rows, cols));
  if (record.first_bad != ~0ull) {
    result.rejected = true;
    result.bad_index = static_cast<int64_t>(record.first_bad & k::kIndexMask);
  }
  return result;
}

Result Simulate(const at::Tensor& src, DType dtype, QuantScheme scheme, NonFinitePolicy policy,
                bool hw, size_t src_offset = 0, size_t out_offset = 0) {
  const bool reject = policy == NonFinitePolicy::kReject;
  switch (dtype) {
    case DType::kBFloat16:
      return reject ? RunKernels<k::Bf16, true>(src, scheme, hw, src_offset, out_offset)
                    : RunKernels<k::Bf16, false>(src, scheme, hw, src_offset, out_offset);
    case DType::kFloat16:
      return reject ? RunKernels<k::Fp16, true>(src, scheme, hw, src_offset, out_offset)
                    : RunKernels<k::Fp16, false>(src, scheme, hw, src_offset, out_offset);
    default:
      return reject ? RunKernels<float, true>(src, scheme, hw, src_offset, out_offset)
                    : RunKernels<float, false>(src, scheme, hw, src_offset, out_offset);
  }
}

struct CpuResult {
  absl::Status status;
  std::vector<uint8_t> q;
  std::vector<float> scales;
};

CpuResult CpuQuantize(const at::Tensor& src, DType dtype, QuantScheme scheme,
                      NonFinitePolicy policy) {
  const int64_t rows = src.size(0);
  const int64_t cols = src.size(1);
  CpuResult out;
  out.q.assign(rows * cols, 0);
  out.scales.assign(Fp8NumScales(scheme, rows, cols), 0.0f);
  Fp8QuantizeOptions options;
  options.scheme = scheme;
  options.non_finite = policy;
  out.status =
      QuantizeFp8(src.data_ptr(), dtype, rows, cols, options, out.q.data(), out.scales.data(), "w");
  return out;
}

void ExpectSame(const CpuResult& cpu, const Result& sim, const std::string& what) {
  ASSERT_EQ(cpu.q.size(), sim.q.size()) << what;
  for (size_t i = 0; i < cpu.q.size(); ++i) {
    if (cpu.q[i] != sim.q[i]) {
      ADD_FAILURE() << what << ": byte " << i << " is 0x" << std::hex << int{sim.q[i]}
                    << ", CPU has 0x" << int{cpu.q[i]};
      return;
    }
  }
  ASSERT_EQ(cpu.scales.size(), sim.scales.size()) << what;
  for (size_t i = 0; i < cpu.scales.size(); ++i) {
    uint32_t a, b;
    std::memcpy(&a, &cpu.scales[i], 4);
    std::memcpy(&b, &sim.scales[i], 4);
    if (a != b) {
      ADD_FAILURE() << what << ": scale " << i << " is " << sim.scales[i] << ", CPU has "
                    << cpu.scales[i];
      return;
    }
  }
}

constexpr DType kDTypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
constexpr QuantScheme kSchemes[] = {QuantScheme::kPerTensor, QuantScheme::kPerChannel,
                                    QuantScheme::kBlock128};

std::string Name(DType dtype, QuantScheme scheme, const at::Tensor& src, bool hw,
                 const char* extra = "") {
  return absl::StrCat(DTypeName(dtype), " ", QuantSchemeName(scheme), " [", src.size(0), ", ",
                      src.size(1), "] ", hw ? "hw-path" : "int-path", extra);
}

TEST(Fp8KernelsSimTest, MatchCpuOnOddShapesThroughVectorAndScalarPaths) {
  // Shapes: tails in every dimension, cols multiple / not multiple of the
  // vector width, tiles cropped on both edges, rows longer than a block.
  // Per-channel runs one simulated block per row, and a simulated block is
  // slow (256 host threads), so its shapes keep the columns and few rows.
  const std::pair<int64_t, int64_t> shapes[] = {{3, 5}, {2, 1001}, {130, 264}, {257, 136}};
  uint64_t seed = 1;
  for (DType dtype : kDTypes) {
    for (QuantScheme scheme : kSchemes) {
      for (auto [rows, cols] : shapes) {
        if (scheme == QuantScheme::kPerChannel) rows = std::min<int64_t>(rows, 5);
        const at::Tensor src = RandomWeights(rows, cols, dtype, ++seed);
        const CpuResult cpu = CpuQuantize(src, dtype, scheme, NonFinitePolicy::kReject);
        ASSERT_TRUE(cpu.status.ok()) << cpu.status;
        for (bool hw : {true, false}) {
          const Result sim = Simulate(src, dtype, scheme, NonFinitePolicy::kReject, hw);
          EXPECT_FALSE(sim.rejected);
          ExpectSame(cpu, sim, Name(dtype, scheme, src, hw));
        }
        // Misaligned source and output: the scalar paths.
        const Result scalar =
            Simulate(src, dtype, scheme, NonFinitePolicy::kReject, true, DTypeSize(dtype), 1);
        ExpectSame(cpu, scalar, Name(dtype, scheme, src, true, ", misaligned"));
      }
    }
  }
}

TEST(Fp8KernelsSimTest, MatchCpuOnVllmEdgeCases) {
  uint64_t seed = 50;
  for (DType dtype : kDTypes) {
    std::vector<at::Tensor> cases;
    at::Tensor nan_inf = RandomWeights(9, 264, dtype, ++seed);
    nan_inf[0][9] = std::numeric_limits<float>::quiet_NaN();
    nan_inf[8][263] = -std::numeric_limits<float>::infinity();
    nan_inf[7].zero_();
    cases.push_back(nan_inf);
    cases.push_back(at::zeros({5, 24}, ToTorch(dtype)));
    at::Tensor nan_row = RandomWeights(4, 40, dtype, ++seed);
    nan_row[2].fill_(std::numeric_limits<float>::quiet_NaN());
    cases.push_back(nan_row);
    if (dtype != DType::kFloat16) {
      cases.push_back((at::randn({3, 48}, at::kFloat) * 1e-38f).to(ToTorch(dtype)));
    }
    for (QuantScheme scheme : kSchemes) {
      for (const at::Tensor& src : cases) {
        const CpuResult cpu = CpuQuantize(src, dtype, scheme, NonFinitePolicy::kVllmCompatible);
        ASSERT_TRUE(cpu.status.ok()) << cpu.status;
        for (bool hw : {true, false}) {
          const Result sim = Simulate(src, dtype, scheme, NonFinitePolicy::kVllmCompatible, hw);
          ExpectSame(cpu, sim, Name(dtype, scheme, src, hw, ", vllm"));
        }
      }
    }
  }
}

TEST(Fp8KernelsSimTest, RecordsTheFirstNonFiniteElement) {
  for (DType dtype : kDTypes) {
    at::Tensor src = RandomWeights(140, 136, dtype, 99);
    src[139][135] = std::numeric_limits<float>::quiet_NaN();
    src[12][130] = std::numeric_limits<float>::infinity();  // first in memory order
    src[13][0] = -std::numeric_limits<float>::infinity();
    for (QuantScheme scheme : kSchemes) {
      // Per-channel: 20 rows suffice (one simulated block per row is slow).
      const at::Tensor input =
          scheme == QuantScheme::kPerChannel ? src.narrow(0, 0, 20).contiguous() : src;
      const Result sim = Simulate(input, dtype, scheme, NonFinitePolicy::kReject, true);
      EXPECT_TRUE(sim.rejected) << Name(dtype, scheme, input, true);
      EXPECT_EQ(sim.bad_index, 12 * 136 + 130) << Name(dtype, scheme, input, true);
    }
  }
}

}  // namespace
}  // namespace refit::core
