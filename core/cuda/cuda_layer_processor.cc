#include "core/cuda/cuda_layer_processor.h"

#include <ATen/ops/empty.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/arena.h"
#include "core/cuda/cuda_device.h"
#include "core/cuda/cuda_status.h"
#include "core/cuda/fp8_cuda.h"
#include "core/cuda/pinned_staging.h"
#include "core/parallel.h"
#include "core/xxh3.h"

namespace refit::core::cuda {
namespace {

constexpr int64_t kPinnedBufferBytes = int64_t{32} << 20;
constexpr int kPinnedBuffers = 4;
// One thread's memcpy into pinned memory runs at a fraction of what the
// host-to-device copy behind it moves; a few threads keep up with it.
// Half the cores, 1 to 4, and within the host-threads cap.
int UploadCopyThreads() {
  static const int half =
      static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency() / 2, 1, 4));
  return std::min(half, BulkThreads());
}
// A layer's weights are a few MiB each: split them finely enough that most
// of them use every upload thread.
constexpr size_t kUploadBytesPerThread = size_t{512} << 10;
// Pinned host memory quantized kernels are read back into to be hashed.
constexpr int64_t kReadbackBytes = int64_t{64} << 20;

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
// (both thread-safe and bounded), the streams of finished sessions and the
// pinned read-back buffer. Never freed: sessions of any store may use them
// until the process ends.
struct DeviceShared {
  std::unique_ptr<PinnedStagingPool> pool;
  std::unique_ptr<Fp8CudaQuantizer> quantizer;
  absl::Mutex mu;
  std::vector<cudaStream_t> free_streams ABSL_GUARDED_BY(mu);
  // kReadbackBytes of pinned memory, allocated on first use; one layer's
  // read-back at a time.
  absl::Mutex readback_mu;
  uint8_t* readback ABSL_GUARDED_BY(readback_mu) = nullptr;
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
      // On the store's device whichever thread calls (the build's own
      // scoped_ holds only on the thread that started it).
      ScopedCudaDevice scoped(p_.device_);
      if (!scoped.status().ok()) return scoped.status();
      const KernelSpec& weight = spec_.kernels[k];
      absl::StatusOr<StagingBuffer> on_device = AllocateDevice(p_.device_, src.size(), weight.name);
      if (!on_device.ok()) return on_device.status();
      absl::StatusOr<StagingBuffer> q = AllocateDevice(p_.device_, weight.nbytes(), weight.name);
      if (!q.ok()) return q.status();
      absl::StatusOr<StagingBuffer> scales =
          AllocateDevice(p_.device_, spec_.kernels[s].nbytes(), weight.name);
      if (!scales.ok()) return scales.status();
      absl::StatusOr<bool> up = Upload(src, on_device->data());
      // A failed upload may have enqueued copies that still read `src` and
      // write `on_device`: neither goes back to an allocator (whose next
      // user could be another session) before the stream is idle.
      HoldUntilIdle(std::move(src), !up.ok() || *up);
      if (!up.ok()) {
        HoldUntilIdle(*std::move(on_device), true);
        return up.status();
      }
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
        // What was launched may still read and write these.
        HoldUntilIdle(*std::move(on_device), true);
        HoldUntilIdle(*std::move(q), true);
        HoldUntilIdle(*std::move(scales), true);
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
      // Every path out syncs the stream, so `src` may go on return.
      absl::StatusOr<bool> up = Upload(src, on_device->data());
      if (!up.ok()) {
        cudaStreamSynchronize(p_.stream_);
        return up.status();
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
      const uint64_t hash = HashBytes(bytes.data(), bytes.size());
      return KeepHashed(k, std::move(bytes), hash);
    }

    // Process hashed the host bytes already, in the sweep that checked them.
    absl::Status KeepHashed(int k, StagingBuffer bytes, uint64_t hash) override {
      ScopedCudaDevice scoped(p_.device_);
      if (!scoped.status().ok()) return scoped.status();
      hashes_[k] = hash;
      absl::StatusOr<StagingBuffer> staged =
          AllocateDevice(p_.device_, bytes.size(), spec_.kernels[k].name);
      if (!staged.ok()) return staged.status();
      absl::StatusOr<bool> up = Upload(bytes, staged->data());
      HoldUntilIdle(std::move(bytes), !up.ok() || *up);
      if (!up.ok()) {
        HoldUntilIdle(*std::move(staged), true);  // copies may still write it
        return up.status();
      }
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
      const absl::Time start = absl::Now();
      if (absl::Status s = HashQuantized(); !s.ok()) return s;
      ProcessedLayer out;
      out.hashing = absl::Now() - start;
      out.kernels = std::move(kernels_);
      out.hashes = std::move(hashes_);
      return out;
    }

   private:
    // The hashes of the quantized kernels, of their bytes read back from the
    // device: in batches of up to kReadbackBytes into the device's pinned
    // read-back buffer (a copy per piece, one sync per batch), each batch's
    // pieces then hashed in parallel. A kernel is split over batches at most
    // at a batch's end, so a batch holds at most one piece of each kernel and
    // each kernel's hash streams over its pieces in order.
    absl::Status HashQuantized() {
      std::vector<size_t> quantized;
      for (size_t k = 0; k < kernels_.size(); ++k) {
        if (quantized_[k]) quantized.push_back(k);
      }
      if (quantized.empty()) return absl::OkStatus();
      using State = std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)>;
      std::vector<State> states;
      states.reserve(kernels_.size());
      for (size_t k = 0; k < kernels_.size(); ++k) {
        states.emplace_back(quantized_[k] ? XXH3_createState() : nullptr, XXH3_freeState);
        if (quantized_[k] &&
            (states.back() == nullptr || XXH3_64bits_reset(states.back().get()) != XXH_OK)) {
          return absl::ResourceExhaustedError(
              absl::StrCat("cannot allocate a hash state for ", spec_.kernels[k].name));
        }
      }
      DeviceShared& shared = *p_.shared_;
      absl::MutexLock lock(&shared.readback_mu);
      if (shared.readback == nullptr) {
        void* pinned = nullptr;
        if (cudaHostAlloc(&pinned, static_cast<size_t>(kReadbackBytes), cudaHostAllocDefault) !=
            cudaSuccess) {
          cudaGetLastError();
          return absl::ResourceExhaustedError(absl::StrCat(
              "cannot allocate ", kReadbackBytes,
              " bytes of pinned host memory to read quantized kernels back for hashing"));
        }
        shared.readback = static_cast<uint8_t*>(pinned);
      }
      uint8_t* const buffer = shared.readback;
      struct Piece {
        size_t k;
        int64_t at;  // in the buffer
        int64_t n;
      };
      size_t next = 0;     // in `quantized`
      int64_t offset = 0;  // into kernel quantized[next]
      while (next < quantized.size()) {
        std::vector<Piece> batch;
        int64_t used = 0;
        while (next < quantized.size() && used < kReadbackBytes) {
          const size_t k = quantized[next];
          const int64_t n = std::min(kernels_[k].size() - offset, kReadbackBytes - used);
          if (n > 0) {
            REFIT_CUDA_RETURN_IF_ERROR(
                cudaMemcpyAsync(buffer + used, kernels_[k].data() + offset, static_cast<size_t>(n),
                                cudaMemcpyDeviceToHost, p_.stream_),
                "reading staged kernel bytes back for hashing");
            batch.push_back({k, used, n});
          }
          used += n;
          offset += n;
          if (offset == kernels_[k].size()) {
            ++next;
            offset = 0;
          }
        }
        REFIT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(p_.stream_),
                                   "waiting for the staging stream");
        std::sort(batch.begin(), batch.end(),
                  [](const Piece& a, const Piece& b) { return a.n > b.n; });
        ForEachInParallel(static_cast<int>(batch.size()), HashThreads(used), [&](int b) {
          XXH3_64bits_update(states[batch[b].k].get(), buffer + batch[b].at,
                             static_cast<size_t>(batch[b].n));
        });
      }
      for (size_t k : quantized) hashes_[k] = XXH3_64bits_digest(states[k].get());
      return absl::OkStatus();
    }

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
    // pool's stream), except host bytes already page-locked (a trainer's
    // sealed region the daemon pinned), which are copied from where they lie
    // by DMA on the session's stream; rows aliased to a trainer's CUDA
    // allocation with a device copy on the session's stream (device to
    // device; cudaMemcpyDefault also crosses to another GPU). Work enqueued
    // later on the session's stream waits for all of them. Returns whether
    // copies still read `src`'s memory after the call (its device aliases or
    // page-locked host bytes): then `src` must be kept until the stream is
    // idle (HoldUntilIdle); otherwise it may be freed on return.
    absl::StatusOr<bool> Upload(const StagingBuffer& src, void* dst) const {
      uint8_t* to = static_cast<uint8_t*>(dst);
      bool reads_pending = false;
      for (const StagingBuffer::Segment& seg : src.Segments()) {
        if (seg.device != nullptr) {
          REFIT_CUDA_RETURN_IF_ERROR(
              cudaMemcpyAsync(to + seg.offset, seg.data, static_cast<size_t>(seg.size),
                              cudaMemcpyDefault, p_.stream_),
              "copying a trainer's CUDA tensor rows into device staging");
          reads_pending = true;
          continue;
        }
        if (PageLocked(seg.data)) {
          REFIT_CUDA_RETURN_IF_ERROR(
              cudaMemcpyAsync(to + seg.offset, seg.data, static_cast<size_t>(seg.size),
                              cudaMemcpyHostToDevice, p_.stream_),
              "copying a trainer's page-locked rows into device staging");
          reads_pending = true;
          continue;
        }
        for (int64_t done = 0; done < seg.size;) {
          absl::StatusOr<PinnedStagingPool::Lease> lease = p_.shared_->pool->Acquire();
          if (!lease.ok()) return lease.status();
          const int64_t n = std::min(seg.size - done, lease->capacity());
          // Host rows aliased to a trainer's shared-memory region are read
          // where they lie.
          ParallelStreamingCopy({HostCopy{lease->data(), seg.data + done, static_cast<size_t>(n)}},
                                UploadCopyThreads(), kUploadBytesPerThread);
          absl::Status copied = p_.shared_->pool->CopyToDevice(
              *std::move(lease), to + seg.offset + done, n, p_.stream_);
          if (!copied.ok()) return copied;
          done += n;
        }
      }
      return reads_pending;
    }

    // Whether host memory at `p` is page-locked (registered or allocated
    // pinned), so a device copy can read it directly.
    static bool PageLocked(const void* p) {
      cudaPointerAttributes attributes{};
      if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
        cudaGetLastError();
        return false;
      }
      return attributes.type == cudaMemoryTypeHost;
    }

    // Keeps `src` (and so the trainer memory its aliases point into) until
    // the build's stream is idle, when copies still read it.
    void HoldUntilIdle(StagingBuffer src, bool reads_pending) {
      if (reads_pending) held_.push_back(std::move(src));
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
    // Params whose memory a copy on the stream may still read, and device
    // buffers work on the stream may still write after a failure; released
    // with the other members, after the destructor idled the stream.
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
