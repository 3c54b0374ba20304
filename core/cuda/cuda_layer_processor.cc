#include "core/cuda/cuda_layer_processor.h"

#include <ATen/ops/empty.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/cuda/cuda_device.h"
#include "core/cuda/cuda_status.h"
#include "core/cuda/fp8_cuda.h"
#include "core/cuda/pinned_staging.h"

namespace refit::core::cuda {
namespace {

constexpr int64_t kPinnedBufferBytes = int64_t{32} << 20;
constexpr int kPinnedBuffers = 4;

// Uninitialized device bytes from LibTorch's caching allocator; every byte is
// written before use. RESOURCE_EXHAUSTED when the device is out of memory.
absl::StatusOr<StagingBuffer> AllocateDevice(int device, int64_t size, absl::string_view what) {
  if (size == 0) return StagingBuffer();
  try {
    at::Tensor tensor = at::empty({size}, at::TensorOptions().dtype(at::kByte).device(c10::Device(
                                              c10::kCUDA, static_cast<c10::DeviceIndex>(device))));
    void* data = tensor.data_ptr();
    return StagingBuffer(data, size, /*on_device=*/true,
                         [tensor = std::move(tensor)]() mutable { tensor.reset(); });
  } catch (const c10::OutOfMemoryError&) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", size,
                                                     " bytes of device staging on cuda:", device,
                                                     " for ", what, ": out of device memory"));
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("cannot allocate ", size,
                                            " bytes of device staging on cuda:", device, " for ",
                                            what, ": ", e.what_without_backtrace()));
  }
}

// What every session on one device shares: the pinned pool, the quantizer
// (both thread-safe and bounded) and the streams of finished sessions. Never
// freed: sessions of any store may use them until the process ends.
struct DeviceShared {
  std::unique_ptr<PinnedStagingPool> pool;
  std::unique_ptr<Fp8CudaQuantizer> quantizer;
  absl::Mutex mu;
  std::vector<cudaStream_t> free_streams ABSL_GUARDED_BY(mu);
};

absl::StatusOr<DeviceShared*> GetDeviceShared(int device) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* by_device = new std::map<int, DeviceShared*>();
  absl::MutexLock lock(&mu);
  auto it = by_device->find(device);
  if (it != by_device->end()) return it->second;
  PinnedStagingOptions pool_options;
  pool_options.device = device;
  pool_options.buffer_bytes = kPinnedBufferBytes;
  pool_options.num_buffers = kPinnedBuffers;
  absl::StatusOr<std::unique_ptr<PinnedStagingPool>> pool = PinnedStagingPool::Create(pool_options);
  if (!pool.ok()) return pool.status();
  absl::StatusOr<std::unique_ptr<Fp8CudaQuantizer>> quantizer = Fp8CudaQuantizer::Create(device);
  if (!quantizer.ok()) return quantizer.status();
  auto* shared = new DeviceShared;
  shared->pool = *std::move(pool);
  shared->quantizer = *std::move(quantizer);
  by_device->emplace(device, shared);
  return shared;
}

class CudaLayerProcessor final : public LayerProcessor {
 public:
  CudaLayerProcessor(const ModelLayout& layout, LayerProcessorOptions options, int device,
                     DeviceShared* shared, cudaStream_t stream)
      : LayerProcessor(layout, options), device_(device), shared_(shared), stream_(stream) {}

  // The stream goes back to the device's free list for a later session (the
  // quantizer keeps per-stream state, so a new stream per refit would grow
  // it without bound); two sessions at once never share one.
  ~CudaLayerProcessor() override {
    {
      ScopedCudaDevice scoped(device_);
      cudaStreamSynchronize(stream_);
    }
    absl::MutexLock lock(&shared_->mu);
    shared_->free_streams.push_back(stream_);
  }

  bool on_device() const override { return true; }

 private:
  class CudaBuild final : public LayerBuild {
   public:
    CudaBuild(const CudaLayerProcessor& p, const LayerSpec& spec)
        : p_(p),
          spec_(spec),
          scoped_(p.device_),
          kernels_(spec.kernels.size()),
          hashes_(spec.kernels.size(), 0),
          quantized_(spec.kernels.size(), false) {}

    // Every path out leaves the stream idle (and the quantizer's non-finite
    // record for it cleared), so the device buffers may be freed or
    // committed, and a later layer's Sync never reports this one's jobs.
    ~CudaBuild() override {
      if (jobs_) p_.shared_->quantizer->Sync(p_.stream_).IgnoreError();
      cudaStreamSynchronize(p_.stream_);
    }

    absl::Status status() const { return scoped_.status(); }

    absl::Status Quantize(StagingBuffer src, DType src_dtype, int64_t rows, int64_t cols, int k,
                          int s) override {
      const KernelSpec& weight = spec_.kernels[k];
      absl::StatusOr<StagingBuffer> on_device = AllocateDevice(p_.device_, src.size(), weight.name);
      if (!on_device.ok()) return on_device.status();
      absl::StatusOr<StagingBuffer> q = AllocateDevice(p_.device_, weight.nbytes(), weight.name);
      if (!q.ok()) return q.status();
      absl::StatusOr<StagingBuffer> scales =
          AllocateDevice(p_.device_, spec_.kernels[s].nbytes(), weight.name);
      if (!scales.ok()) return scales.status();
      if (absl::Status up = Upload(src, on_device->data()); !up.ok()) {
        HoldUntilIdle(std::move(src));
        return up;
      }
      // Copied into pinned memory: the host copy can go (not what a device
      // copy still reads).
      HoldUntilIdle(std::move(src));
      Fp8CudaJob job;
      job.src = on_device->data();
      job.src_dtype = src_dtype;
      job.rows = rows;
      job.cols = cols;
      job.out_q = q->data();
      job.out_scales = reinterpret_cast<float*>(scales->data());
      job.tensor_name = weight.name;
      Fp8QuantizeOptions qopts;
      qopts.scheme = p_.layout_.quant();
      qopts.non_finite = p_.options_.non_finite;
      jobs_ = true;
      if (absl::Status e = p_.shared_->quantizer->Enqueue(job, qopts, p_.stream_); !e.ok()) {
        return e;
      }
      sources_.push_back(*std::move(on_device));
      kernels_[k] = *std::move(q);
      kernels_[s] = *std::move(scales);
      quantized_[k] = quantized_[s] = true;
      return absl::OkStatus();
    }

    // Experts layers: one part's quantization into its place in kernel `k`.
    // Synced before returning, so that its high-precision source is freed
    // now and not when the whole layer is done.
    absl::Status QuantizeRegion(StagingBuffer src, DType src_dtype, int64_t rows, int64_t cols,
                                int k, int64_t k_offset, int s, int64_t s_offset,
                                absl::string_view what) override {
      ScopedCudaDevice scoped(p_.device_);
      if (!scoped.status().ok()) return scoped.status();
      if (absl::Status a = AllocateWhole(k); !a.ok()) return a;
      if (absl::Status a = AllocateWhole(s); !a.ok()) return a;
      absl::StatusOr<StagingBuffer> on_device = AllocateDevice(p_.device_, src.size(), what);
      if (!on_device.ok()) return on_device.status();
      absl::Status up = Upload(src, on_device->data());
      if (!up.ok()) {
        cudaStreamSynchronize(p_.stream_);
        return up;
      }
      Fp8CudaJob job;
      job.src = on_device->data();
      job.src_dtype = src_dtype;
      job.rows = rows;
      job.cols = cols;
      job.out_q = kernels_[k].data() + k_offset;
      job.out_scales = reinterpret_cast<float*>(kernels_[s].data() + s_offset);
      job.tensor_name = what;
      Fp8QuantizeOptions qopts;
      qopts.scheme = p_.layout_.quant();
      qopts.non_finite = p_.options_.non_finite;
      if (absl::Status e = p_.shared_->quantizer->Enqueue(job, qopts, p_.stream_); !e.ok()) {
        p_.shared_->quantizer->Sync(p_.stream_).IgnoreError();
        return e;
      }
      // Non-finite input under kReject: INVALID_ARGUMENT naming the part.
      return p_.shared_->quantizer->Sync(p_.stream_);
    }

    absl::Status KeepRegion(int k, int64_t offset, const void* bytes, int64_t n) override {
      ScopedCudaDevice scoped(p_.device_);
      if (!scoped.status().ok()) return scoped.status();
      if (absl::Status a = AllocateWhole(k); !a.ok()) return a;
      if (n == 0) return absl::OkStatus();
      REFIT_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(kernels_[k].data() + offset, bytes, static_cast<size_t>(n),
                          cudaMemcpyHostToDevice, p_.stream_),
          "uploading kept expert bytes");
      REFIT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(p_.stream_),
                                 "waiting for the staging stream");
      return absl::OkStatus();
    }

    absl::Status Keep(int k, StagingBuffer bytes) override {
      hashes_[k] = HashBytes(bytes.data(), bytes.size());
      absl::StatusOr<StagingBuffer> staged =
          AllocateDevice(p_.device_, bytes.size(), spec_.kernels[k].name);
      if (!staged.ok()) return staged.status();
      if (absl::Status up = Upload(bytes, staged->data()); !up.ok()) return up;
      kernels_[k] = *std::move(staged);
      return absl::OkStatus();
    }

    absl::StatusOr<ProcessedLayer> Finish() override {
      // Non-finite input under kReject: INVALID_ARGUMENT naming the tensor.
      if (jobs_) {
        jobs_ = false;
        if (absl::Status s = p_.shared_->quantizer->Sync(p_.stream_); !s.ok()) return s;
      }
      // Quantized kernels: hash the bytes the device wrote.
      std::vector<StagingBuffer> back(kernels_.size());
      for (size_t k = 0; k < kernels_.size(); ++k) {
        if (!quantized_[k] || kernels_[k].empty()) continue;
        absl::StatusOr<StagingBuffer> host =
            StagingBuffer::HostUninitialized(kernels_[k].size(), spec_.kernels[k].name);
        if (!host.ok()) return host.status();
        REFIT_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(host->data(), kernels_[k].data(), static_cast<size_t>(host->size()),
                            cudaMemcpyDeviceToHost, p_.stream_),
            "reading staged kernel bytes back for hashing");
        back[k] = *std::move(host);
      }
      REFIT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(p_.stream_),
                                 "waiting for the staging stream");
      for (size_t k = 0; k < kernels_.size(); ++k) {
        if (quantized_[k]) hashes_[k] = HashBytes(back[k].data(), back[k].size());
      }
      ProcessedLayer out;
      out.kernels = std::move(kernels_);
      out.hashes = std::move(hashes_);
      return out;
    }

   private:
    // Kernel `k` whole in device memory, on its first region; hashed by
    // reading it back at Finish.
    absl::Status AllocateWhole(int k) {
      if (!kernels_[k].empty() || spec_.kernels[k].nbytes() == 0) return absl::OkStatus();
      absl::StatusOr<StagingBuffer> staged =
          AllocateDevice(p_.device_, spec_.kernels[k].nbytes(), spec_.kernels[k].name);
      if (!staged.ok()) return staged.status();
      kernels_[k] = *std::move(staged);
      quantized_[k] = true;
      return absl::OkStatus();
    }

    // `src`'s bytes to `dst` on the device: host bytes through the pinned
    // pool (a memcpy into a leased pinned buffer, then an async copy on the
    // pool's stream), rows aliased to a trainer's CUDA allocation with a
    // device copy on the session's stream (device to device; cudaMemcpyDefault
    // also crosses to another GPU). Work enqueued later on the session's
    // stream waits for both. Host memory of `src` may be freed on return; its
    // device aliases must stay open until the stream is idle (HoldUntilIdle).
    absl::Status Upload(const StagingBuffer& src, void* dst) const {
      uint8_t* to = static_cast<uint8_t*>(dst);
      for (const StagingBuffer::Segment& seg : src.Segments()) {
        if (seg.device != nullptr) {
          REFIT_CUDA_RETURN_IF_ERROR(
              cudaMemcpyAsync(to + seg.offset, seg.data, static_cast<size_t>(seg.size),
                              cudaMemcpyDefault, p_.stream_),
              "copying a trainer's CUDA tensor rows into device staging");
          continue;
        }
        for (int64_t done = 0; done < seg.size;) {
          absl::StatusOr<PinnedStagingPool::Lease> lease = p_.shared_->pool->Acquire();
          if (!lease.ok()) return lease.status();
          const int64_t n = std::min(seg.size - done, lease->capacity());
          // Host rows aliased to a trainer's shared-memory region are read
          // where they lie.
          std::memcpy(lease->data(), seg.data + done, static_cast<size_t>(n));
          absl::Status copied = p_.shared_->pool->CopyToDevice(
              *std::move(lease), to + seg.offset + done, n, p_.stream_);
          if (!copied.ok()) return copied;
          done += n;
        }
      }
      return absl::OkStatus();
    }

    // Keeps `src` (and so the trainer allocations its device aliases point
    // into) until the build's stream is idle.
    void HoldUntilIdle(StagingBuffer src) {
      if (src.has_device_aliases()) held_.push_back(std::move(src));
    }

    const CudaLayerProcessor& p_;
    const LayerSpec& spec_;
    ScopedCudaDevice scoped_;
    std::vector<StagingBuffer> kernels_;
    std::vector<uint64_t> hashes_;
    std::vector<bool> quantized_;
    // High-precision weights on the device; declared after kernels_, so they
    // are freed first, but only after the destructor idled the stream.
    std::vector<StagingBuffer> sources_;
    // Params whose device aliases a copy on the stream may still read;
    // released with the other members, after the destructor idled the
    // stream.
    std::vector<StagingBuffer> held_;
    bool jobs_ = false;  // quantize jobs enqueued and not yet synced
  };

  absl::StatusOr<std::unique_ptr<LayerBuild>> Start(const LayerSpec& spec) override {
    auto build = std::make_unique<CudaBuild>(*this, spec);
    if (absl::Status s = build->status(); !s.ok()) return s;
    return build;
  }

  const int device_;
  DeviceShared* const shared_;
  const cudaStream_t stream_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<LayerProcessor>> CreateCudaLayerProcessor(
    const ModelLayout& layout, int device, LayerProcessorOptions options) {
  if (absl::Status usable = CheckCudaDevice(device); !usable.ok()) return usable;
  absl::StatusOr<DeviceShared*> shared = GetDeviceShared(device);
  if (!shared.ok()) return shared.status();
  cudaStream_t stream = nullptr;
  {
    absl::MutexLock lock(&(*shared)->mu);
    if (!(*shared)->free_streams.empty()) {
      stream = (*shared)->free_streams.back();
      (*shared)->free_streams.pop_back();
    }
  }
  if (stream == nullptr) {
    ScopedCudaDevice scoped(device);
    if (!scoped.status().ok()) return scoped.status();
    // A blocking stream: it is ordered after the legacy default stream, on
    // which LibTorch's caching allocator may have used a block we now get.
    REFIT_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamDefault),
                               "creating a refit staging stream");
  }
  return std::make_unique<CudaLayerProcessor>(layout, options, device, *shared, stream);
}

}  // namespace refit::core::cuda
