// FP8 (e4m3fn) quantization on a CUDA device: the GPU twin of
// core::QuantizeFp8 (core/fp8_quantizer.h), producing the same bytes and the
// same float32 scales for the same input, for all three schemes and both
// non-finite policies.
//
// Pipeline position: when kernel tensors live on a GPU, RefitSession copies a
// completed layer's high-precision weight to the device (PinnedStagingPool)
// and enqueues its quantization here, writing the staged FP8 kernel and its
// scales on the device; ShardStore's commit then copies them into the live
// tensors (device_commit.h).
//
// How (so that the results are bit-identical, not merely close):
//   per-tensor   an amax pass (atomicMax on the bits of |x|, exact and
//                order-independent, so deterministic), a one-thread pass
//                that turns amax into s, then a convert pass;
//   per-channel  one thread block per row: block-wide max, s, convert;
//   block 128    one thread block per 128x128 tile, same steps.
// The per-element math is core/cuda/fp8_math.h, integer code shared with a
// host-side check.
//
// Non-finite input under NonFinitePolicy::kReject is detected on the device
// (the first bad element, lowest index, recorded with atomicMin) and read
// back by Sync/Quantize, which then return INVALID_ARGUMENT naming the tensor,
// the element and its value. The output bytes of such a job are garbage and
// must not be used.
//
// Streams are cudaStream_t passed as void* (nullptr = the legacy default
// stream), so this header has no CUDA types and compiles without CUDA.
//
// Lifecycle: Create once per device; Enqueue any number of jobs; Sync(stream)
// to learn whether any job enqueued on that stream since the last Sync saw
// non-finite input (each stream has its own record). Thread-safe: calls are
// serialized on a mutex that is never held while waiting for the device
// (Sync waits outside it); the kernels of different streams run
// concurrently.
#ifndef REFIT_CORE_CUDA_FP8_CUDA_H_
#define REFIT_CORE_CUDA_FP8_CUDA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "core/dtype.h"
#include "core/fp8_quantizer.h"

namespace refit::core::cuda {

// One tensor to quantize. All pointers are device pointers on the
// quantizer's device. Layout as core::QuantizeFp8: row-major [rows, cols]
// source; out_q rows*cols bytes; out_scales Fp8NumScales(scheme, rows, cols)
// floats (block scales row-major [ceil(rows/128), ceil(cols/128)]).
struct Fp8CudaJob {
  const void* src = nullptr;
  DType src_dtype = DType::kBFloat16;
  int64_t rows = 0;
  int64_t cols = 0;
  uint8_t* out_q = nullptr;
  float* out_scales = nullptr;
  absl::string_view tensor_name;  // copied; named in every error
};

struct Fp8CudaQuantizerOptions {
  // Use the GPU's e4m3 conversion instruction (sm_89+) where it provably
  // gives the same bytes: Create checks it against the integer conversion
  // for every finite float32 on this device (once per process, ~10 ms) and
  // falls back to the integer code on any difference. The environment
  // variable REFIT_FP8_CUDA_SOFTWARE_CONVERSION (any value) also disables it.
  bool allow_hardware_conversion = true;
};

class Fp8CudaQuantizer {
 public:
  // UNAVAILABLE if `device` cannot be used; INTERNAL/RESOURCE_EXHAUSTED if
  // the conversion check cannot run.
  static absl::StatusOr<std::unique_ptr<Fp8CudaQuantizer>> Create(
      int device, const Fp8CudaQuantizerOptions& options = {});
  ~Fp8CudaQuantizer();
  Fp8CudaQuantizer(const Fp8CudaQuantizer&) = delete;
  Fp8CudaQuantizer& operator=(const Fp8CudaQuantizer&) = delete;

  int device() const { return device_; }
  // Whether the kernels use the conversion instruction (see the options).
  bool hardware_conversion() const { return hw_conversion_; }
  // Finite floats whose hardware conversion differed from the integer one
  // in Create's check; -1 if the check did not run.
  int64_t HardwareConversionMismatchesForTesting() const;

  // Opaque; defined in fp8_quantize.cu (public only so its kernels can name it).
  struct DeviceErrorRecord;

  // Enqueues the kernels of `job` on `stream` and returns without waiting.
  // options.num_threads is ignored. The source must stay valid until the
  // stream has passed the job. Errors (nothing enqueued): INVALID_ARGUMENT
  // for a dtype other than fp32/fp16/bf16, QuantScheme::kNone, negative
  // sizes, null pointers for a non-empty tensor, more than 2^40 elements;
  // INTERNAL/UNAVAILABLE for a failed launch. Non-finite input is reported by
  // the next Sync on the same stream, not here.
  absl::Status Enqueue(const Fp8CudaJob& job, const Fp8QuantizeOptions& options, void* stream);

  // Waits until `stream` has passed every job enqueued on it, then reports
  // the first job (in enqueue order) that saw non-finite input under
  // kReject: INVALID_ARGUMENT naming the tensor, the element index (row,
  // col) and its value. INTERNAL/UNAVAILABLE for CUDA errors. Clears the
  // record either way, so the next Sync reports only newer jobs.
  absl::Status Sync(void* stream);

  // Enqueue + Sync: the blocking form, errors as both.
  absl::Status Quantize(const Fp8CudaJob& job, const Fp8QuantizeOptions& options, void* stream);

 private:
  struct PendingJob {
    std::string tensor_name;
    int64_t cols = 0;
  };
  // Jobs between two Syncs of one stream share one device error record;
  // a job's index in `pending` is its sequence number in the record's key.
  struct StreamState {
    DeviceErrorRecord* device_record = nullptr;
    std::vector<PendingJob> pending;
  };

  Fp8CudaQuantizer(int device, int num_sms, bool hw_conversion, int64_t hw_mismatches);
  absl::StatusOr<StreamState*> GetStreamState(void* stream) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A record reset (in `stream` order) for the next jobs of `stream`.
  absl::StatusOr<DeviceErrorRecord*> AcquireRecord(void* stream) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int device_;
  const int num_sms_;
  const bool hw_conversion_;
  const int64_t hw_mismatches_;

  // Held while launching, so that a stream's sequence numbers follow its
  // launch order. Launches do not wait for the device.
  absl::Mutex mu_;
  absl::flat_hash_map<void*, std::unique_ptr<StreamState>> streams_ ABSL_GUARDED_BY(mu_);
  std::vector<DeviceErrorRecord*> free_records_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::core::cuda

#endif  // REFIT_CORE_CUDA_FP8_CUDA_H_
