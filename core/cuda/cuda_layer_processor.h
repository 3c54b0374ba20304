// The CUDA LayerProcessor: a layer's high-precision weights go to the store's
// GPU through a pinned staging pool, FP8 weights and scales are quantized
// there (Fp8CudaQuantizer, bit-identical to the CPU QuantizeFp8), and every
// kernel ends up in device memory, ready for a device-to-device commit.
//
// Hashes are of the same bytes as the host processor's: kernels kept in the
// checkpoint dtype (and attention scales) are hashed from their host copy
// before upload, quantized kernels from a copy read back from the device.
//
// Device staging comes from LibTorch's CUDA caching allocator (so it shows
// in its statistics and is reused across refits). The pinned pool and the
// quantizer are per device and shared by every session on it; each session
// has a stream of its own, reused by later sessions.
//
// Lifecycle and thread-safety as LayerProcessor. Built only with
// REFIT_WITH_CUDA; part of refit_core (it uses LibTorch's allocator).
#ifndef REFIT_CORE_CUDA_CUDA_LAYER_PROCESSOR_H_
#define REFIT_CORE_CUDA_CUDA_LAYER_PROCESSOR_H_

#include <memory>

#include "absl/status/statusor.h"
#include "core/layer_processor.h"
#include "core/model_layout.h"

namespace refit::core::cuda {

// Errors: the device check's status (UNAVAILABLE for a device this process
// cannot use); RESOURCE_EXHAUSTED when the pinned pool cannot be allocated;
// the CUDA error of creating the session's stream.
absl::StatusOr<std::unique_ptr<LayerProcessor>> CreateCudaLayerProcessor(
    const ModelLayout& layout, int device, LayerProcessorOptions options);

}  // namespace refit::core::cuda

#endif  // REFIT_CORE_CUDA_CUDA_LAYER_PROCESSOR_H_
