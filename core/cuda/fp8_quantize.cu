// Fp8CudaQuantizer (fp8_cuda.h): argument checks, launches of the kernels in
// fp8_kernels.cuh, the per-stream error records, and the one-time check of
// the hardware conversion.
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
#include "core/cuda/fp8_kernels.cuh"

namespace refit::core::cuda {

// The kernels' error record, under the name fp8_cuda.h keeps opaque.
struct Fp8CudaQuantizer::DeviceErrorRecord : fp8_kernels::ErrorRecord {};

namespace {

using namespace ::refit::core::cuda::fp8_kernels;  // NOLINT: this file launches them

constexpr uint32_t kMaxJobsPerSync = 1u << (64 - kIndexBits);

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

template <typename T, bool kReject>
absl::Status LaunchJob(const Fp8CudaJob& job, QuantScheme scheme, bool vllm, ErrorSink sink,
                       cudaStream_t stream, int num_sms, bool hw, unsigned long long seq) {
  const T* src = static_cast<const T*>(job.src);
  const int64_t n = job.rows * job.cols;
  constexpr int kN = Vec16<T>::kN;
  const bool aligned = AlignedForVectors(job.src, job.out_q, kN);
  ClearLastCudaError();
  switch (scheme) {
    case QuantScheme::kPerTensor: {
      // The scale slot doubles as the amax accumulator: no scratch memory, so
      // jobs on different streams never share state. Bits 0 == +0.0f.
      REFIT_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(job.out_scales, 0, sizeof(float), stream),
                                 "cudaMemsetAsync(scale)");
      if (n > 0) {
        const int blocks = FlatBlocks(n, aligned, kN, num_sms);
        AmaxFlatKernel<T, kReject><<<blocks, kThreads, 0, stream>>>(
            src, n, aligned, reinterpret_cast<uint32_t*>(job.out_scales), sink);
        PerTensorScaleKernel<<<1, 1, 0, stream>>>(job.out_scales);
        ConvertFlatKernel<T>
            <<<blocks, kThreads, 0, stream>>>(src, n, aligned, job.out_scales, job.out_q, vllm, hw);
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
      Block128Kernel<T, kReject><<<grid, kThreads, 0, stream>>>(
          src, job.rows, job.cols, vec, job.out_q, job.out_scales, sink, vllm, hw);
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
    REFIT_CUDA_RETURN_IF_ERROR(cudaMemset(count, 0, sizeof(*count)),
                               "cudaMemset(conversion check)");
    ClearLastCudaError();
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

int64_t Fp8CudaQuantizer::HardwareConversionMismatchesForTesting() const { return hw_mismatches_; }

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
  return std::unique_ptr<Fp8CudaQuantizer>(new Fp8CudaQuantizer(device, num_sms, hw, mismatches));
}

Fp8CudaQuantizer::~Fp8CudaQuantizer() {
  ScopedCudaDevice scoped(device_);
  absl::MutexLock lock(&mu_);
  // cudaFree waits for the device, so jobs still running on streams we do
  // not own finish before the records they write to go away.
  for (auto& [stream, state] : streams_) cudaFree(state->device_record);
  for (DeviceErrorRecord* record : free_records_) cudaFree(record);
}

absl::StatusOr<Fp8CudaQuantizer::DeviceErrorRecord*> Fp8CudaQuantizer::AcquireRecord(void* stream) {
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
  const absl::Status status = CudaStatus(
      cudaMemsetAsync(record, 0xFF, sizeof(DeviceErrorRecord), static_cast<cudaStream_t>(stream)),
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
        return Dispatch<float>(job, options.scheme, options.non_finite, sink, cuda_stream, num_sms_,
                               hw_conversion_, seq);
      case DType::kBFloat16:
        return Dispatch<Bf16>(job, options.scheme, options.non_finite, sink, cuda_stream, num_sms_,
                              hw_conversion_, seq);
      default:
        return Dispatch<Fp16>(job, options.scheme, options.non_finite, sink, cuda_stream, num_sms_,
                              hw_conversion_, seq);
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
  absl::Status refused = absl::InvalidArgumentError(absl::StrFormat(
      "tensor '%s': element %d (row %d, col %d) is %s; FP8 quantization rejects non-finite "
      "weights",
      job.tensor_name, index, row, col, text));
  SetNonFiniteElement(refused, row, col);
  return refused;
}

absl::Status Fp8CudaQuantizer::Quantize(const Fp8CudaJob& job, const Fp8QuantizeOptions& options,
                                        void* stream) {
  absl::Status status = Enqueue(job, options, stream);
  if (!status.ok()) return status;
  return Sync(stream);
}

}  // namespace refit::core::cuda
