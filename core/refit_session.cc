#include "core/refit_session.h"

#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/log.h"
#include "core/safetensors.h"
#include "core/shard_store_tensors.h"

#ifdef REFIT_WITH_CUDA
#include <ATen/ops/empty.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include "core/cuda/cuda_device.h"
#include "core/cuda/cuda_status.h"
#include "core/cuda/fp8_cuda.h"
#include "core/cuda/pinned_staging.h"
#endif

namespace refit::core {
namespace {

// A zero-initialized host buffer; calloc so that large buffers get lazily
// zeroed pages instead of a memset pass.
struct Buffer {
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> data;
  int64_t size = 0;

  static absl::StatusOr<Buffer> Zeroed(int64_t size, absl::string_view what) {
    return Allocate(size, what, /*zero=*/true);
  }
  // For buffers that are written in full before anyone reads them (quantizer
  // outputs, params without padding): no zeroing pass, no zero-page faults.
  static absl::StatusOr<Buffer> Uninitialized(int64_t size, absl::string_view what) {
    return Allocate(size, what, /*zero=*/false);
  }

 private:
  static absl::StatusOr<Buffer> Allocate(int64_t size, absl::string_view what, bool zero) {
    Buffer buffer;
    buffer.size = size;
    if (size == 0) return buffer;
    buffer.data.reset(static_cast<uint8_t*>(zero ? std::calloc(static_cast<size_t>(size), 1)
                                                 : std::malloc(static_cast<size_t>(size))));
    if (buffer.data == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", size, " bytes of staging for ", what));
    }
    return buffer;
  }
};

#ifdef REFIT_WITH_CUDA
// A staged kernel buffer in device memory, from LibTorch's CUDA caching
// allocator (so device staging shows in its statistics and is reused across
// refits). Uninitialized; every byte is written before use.
struct DeviceBuffer {
  at::Tensor tensor;
  int64_t size = 0;

  void* data() const { return size == 0 ? nullptr : tensor.data_ptr(); }

  // RESOURCE_EXHAUSTED when the device is out of memory.
  static absl::StatusOr<DeviceBuffer> Allocate(int device, int64_t size, absl::string_view what) {
    DeviceBuffer buffer;
    buffer.size = size;
    if (size == 0) return buffer;
    try {
      buffer.tensor = at::empty(
          {size}, at::TensorOptions().dtype(at::kByte).device(
                      c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device))));
    } catch (const c10::OutOfMemoryError&) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", size, " bytes of device staging on cuda:", device,
                       " for ", what, ": out of device memory"));
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("cannot allocate ", size,
                                              " bytes of device staging on cuda:", device, " for ",
                                              what, ": ", e.what_without_backtrace()));
    }
    return buffer;
  }
};

// What a session needs to stage and quantize on a GPU: the process-wide
// pinned staging pool and FP8 quantizer of the device (created once, shared
// by every session on that device; both are thread-safe and bounded), and a
// stream of the session's own, on which the layer's uploads, quantization
// and read-backs are ordered. Streams are reused by later sessions (the
// quantizer keeps per-stream state, so a new stream per refit would grow it
// without bound); two sessions at once (two stores on one device) never
// share one, so neither sees the other's non-finite errors.
class GpuStaging {
 public:
  static constexpr int64_t kPinnedBufferBytes = int64_t{32} << 20;
  static constexpr int kPinnedBuffers = 4;

  static absl::StatusOr<std::unique_ptr<GpuStaging>> Create(int device) {
    absl::Status usable = cuda::CheckCudaDevice(device);
    if (!usable.ok()) return usable;
    absl::StatusOr<Shared*> shared = GetShared(device);
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
      cuda::ScopedCudaDevice scoped(device);
      if (!scoped.status().ok()) return scoped.status();
      // A blocking stream: it is ordered after the legacy default stream, on
      // which LibTorch's caching allocator may have used a block we now get.
      REFIT_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamDefault),
                                 "creating a refit staging stream");
    }
    return std::unique_ptr<GpuStaging>(new GpuStaging(device, *shared, stream));
  }

  ~GpuStaging() {
    {
      cuda::ScopedCudaDevice scoped(device_);
      cudaStreamSynchronize(stream_);
    }
    absl::MutexLock lock(&shared_->mu);
    shared_->free_streams.push_back(stream_);
  }

  int device() const { return device_; }
  void* stream() const { return stream_; }
  cuda::Fp8CudaQuantizer& quantizer() const { return *shared_->quantizer; }

  // Copies host bytes to `dst` on the device through the pinned pool (a
  // memcpy into a leased pinned buffer, then an async copy on the pool's
  // stream); work enqueued later on stream() waits for it. `src` may be
  // freed on return; `dst` must stay until stream() is synchronized.
  absl::Status Upload(const void* src, int64_t size, void* dst) const {
    const uint8_t* from = static_cast<const uint8_t*>(src);
    uint8_t* to = static_cast<uint8_t*>(dst);
    for (int64_t done = 0; done < size;) {
      absl::StatusOr<cuda::PinnedStagingPool::Lease> lease = shared_->pool->Acquire();
      if (!lease.ok()) return lease.status();
      int64_t n = std::min(size - done, lease->capacity());
      std::memcpy(lease->data(), from + done, static_cast<size_t>(n));
      absl::Status copied = shared_->pool->CopyToDevice(*std::move(lease), to + done, n, stream_);
      if (!copied.ok()) return copied;
      done += n;
    }
    return absl::OkStatus();
  }

  // Enqueues a device-to-host copy on stream(); valid after Synchronize().
  absl::Status Download(const void* src, int64_t size, void* dst) const {
    if (size == 0) return absl::OkStatus();
    return cuda::CudaStatus(cudaMemcpyAsync(dst, src, static_cast<size_t>(size),
                                            cudaMemcpyDeviceToHost, stream_),
                            "reading staged kernel bytes back for hashing");
  }

  absl::Status Synchronize() const {
    return cuda::CudaStatus(cudaStreamSynchronize(stream_), "waiting for the staging stream");
  }

 private:
  struct Shared {
    std::unique_ptr<cuda::PinnedStagingPool> pool;
    std::unique_ptr<cuda::Fp8CudaQuantizer> quantizer;
    absl::Mutex mu;
    std::vector<cudaStream_t> free_streams ABSL_GUARDED_BY(mu);
  };

  GpuStaging(int device, Shared* shared, cudaStream_t stream)
      : device_(device), shared_(shared), stream_(stream) {}

  // Never freed: sessions of any store may use them until the process ends.
  static absl::StatusOr<Shared*> GetShared(int device) {
    static absl::Mutex mu(absl::kConstInit);
    static auto* by_device = new std::map<int, Shared*>();
    absl::MutexLock lock(&mu);
    auto it = by_device->find(device);
    if (it != by_device->end()) return it->second;
    cuda::PinnedStagingOptions pool_options;
    pool_options.device = device;
    pool_options.buffer_bytes = kPinnedBufferBytes;
    pool_options.num_buffers = kPinnedBuffers;
    absl::StatusOr<std::unique_ptr<cuda::PinnedStagingPool>> pool =
        cuda::PinnedStagingPool::Create(pool_options);
    if (!pool.ok()) return pool.status();
    absl::StatusOr<std::unique_ptr<cuda::Fp8CudaQuantizer>> quantizer =
        cuda::Fp8CudaQuantizer::Create(device);
    if (!quantizer.ok()) return quantizer.status();
    auto* shared = new Shared;
    shared->pool = *std::move(pool);
    shared->quantizer = *std::move(quantizer);
    by_device->emplace(device, shared);
    return shared;
  }

  const int device_;
  Shared* const shared_;
  const cudaStream_t stream_;
};

// Whether a session on a GPU store stages on the device. The environment
// variable REFIT_HOST_STAGING (any value) keeps the host path (quantize on
// the CPU, host-to-device commit), for diagnosis.
bool UseDeviceStaging() { return std::getenv("REFIT_HOST_STAGING") == nullptr; }
#endif  // REFIT_WITH_CUDA

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// The 2-D view SliceSpec uses: [n] -> [n, 1], [] -> [1, 1], [a, b, ...] -> [a, b*...].
int64_t ViewCols(absl::Span<const int64_t> shape) {
  if (shape.size() < 2) return 1;
  int64_t cols = 1;
  for (size_t i = 1; i < shape.size(); ++i) cols *= shape[i];
  return cols;
}

uint64_t Hash(const void* data, int64_t size) {
  return XXH3_64bits(data, static_cast<size_t>(size));
}

std::string NewRefitId() {
  static std::atomic<uint64_t> counter{0};
  uint64_t n = counter.fetch_add(1) + 1;
  uint64_t t = static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
  return absl::StrFormat("r-%x-%d", t & 0xffffffffff, n);
}

// Received byte ranges of one checkpoint tensor: begin -> end, disjoint.
class RangeSet {
 public:
  // OK, or ALREADY_EXISTS for an exact repeat, INVALID_ARGUMENT for a partial overlap.
  absl::Status Add(uint64_t begin, uint64_t end, absl::string_view name) {
    if (begin == end) return absl::OkStatus();
    auto next = ranges_.lower_bound(begin);
    if (next != ranges_.end() && next->first == begin && next->second == end) {
      return absl::AlreadyExistsError(
          absl::StrCat("tensor \"", name, "\": duplicate chunk, bytes [", begin, ", ", end,
                       ") were already received"));
    }
    auto overlaps = [&](uint64_t b, uint64_t e) { return b < end && begin < e; };
    if (next != ranges_.end() && overlaps(next->first, next->second)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", name, "\": chunk bytes [", begin, ", ", end,
                       ") overlap bytes [", next->first, ", ", next->second,
                       ") already received"));
    }
    if (next != ranges_.begin()) {
      auto prev = std::prev(next);
      if (overlaps(prev->first, prev->second)) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor \"", name, "\": chunk bytes [", begin, ", ", end,
                         ") overlap bytes [", prev->first, ", ", prev->second,
                         ") already received"));
      }
    }
    ranges_.emplace(begin, end);
    received_ += end - begin;
    return absl::OkStatus();
  }
  uint64_t received() const { return received_; }

 private:
  std::map<uint64_t, uint64_t> ranges_;
  uint64_t received_ = 0;
};

struct TensorState {
  RangeSet ranges;
  bool seen = false;
  DType dtype = DType::kBFloat16;  // of the first chunk; later chunks must match
};

struct LayerState {
  int64_t loaded = 0;
  bool processed = false;
  bool queued = false;  // complete, waiting for or in the worker
  std::vector<Buffer> params;  // allocated on the first chunk, freed when processed
  int64_t param_bytes = 0;     // allocated
  // Staged kernel bytes, one per kernel of the layer, once processed.
  std::vector<Buffer> staged;
#ifdef REFIT_WITH_CUDA
  // GPU stores: the staged kernels on the device instead (`staged` is empty).
  std::vector<DeviceBuffer> device_staged;
#endif
  std::vector<uint64_t> hashes;
};

}  // namespace

absl::string_view SessionStateName(SessionState state) {
  switch (state) {
    case SessionState::kReceiving:
      return "receiving";
    case SessionState::kPrepared:
      return "prepared";
    case SessionState::kCommitted:
      return "committed";
    case SessionState::kAborted:
      return "aborted";
  }
  return "unknown";
}

class RefitSessionImpl {
 public:
  RefitSessionImpl(ShardStore* store, RefitOptions options)
      : store_(store),
        impl_(store->impl()),
        layout_(store->layout()),
        options_(std::move(options)),
        layers_(layout_.layers().size()),
        tensors_(layout_.checkpoint_tensors().size()),
        begin_time_(absl::Now()),
        last_ingest_(begin_time_) {
    for (const LayerSpec& layer : layout_.layers()) {
      if (layer.kind != LayerKind::kAttention) expected_ += layer.expected_numel;
    }
  }

  ~RefitSessionImpl() {
    {
      absl::MutexLock lock(&mu_);
      if (state_ == SessionState::kReceiving || state_ == SessionState::kPrepared) {
        AbortLocked(absl::AbortedError("refit session destroyed before commit"));
      }
      StopWorker();
    }
    if (worker_.joinable()) worker_.join();
  }

  const std::string& refit_id() const { return options_.refit_id; }

#ifdef REFIT_WITH_CUDA
  // Before any Ingest: stage and quantize on the store's GPU.
  void SetGpuStaging(std::unique_ptr<GpuStaging> gpu) { gpu_ = std::move(gpu); }
#endif

  SessionState state() const {
    absl::MutexLock lock(&mu_);
    return state_;
  }

  absl::Status abort_status() const {
    absl::MutexLock lock(&mu_);
    return abort_status_;
  }

  SessionProgress progress() const {
    absl::MutexLock lock(&mu_);
    SessionProgress p;
    p.refit_id = options_.refit_id;
    p.state = state_;
    p.layers_total = static_cast<int64_t>(layers_.size());
    for (const LayerState& layer : layers_) p.layers_done += layer.processed ? 1 : 0;
    p.bytes_received = bytes_received_;
    p.elements_loaded = loaded_;
    p.elements_expected = expected_;
    p.staging_bytes = staging_bytes_;
    p.peak_staging_bytes = peak_staging_bytes_;
    p.staged_kernel_bytes = staged_kernel_bytes_;
    return p;
  }

  absl::Status Ingest(const Chunk& chunk) {
    absl::MutexLock lock(&mu_);
    if (state_ != SessionState::kReceiving) return NotReceiving();
    absl::Status status = worker_status_.ok() ? IngestLocked(chunk) : worker_status_;
    last_ingest_ = absl::Now();
    if (!status.ok()) AbortLocked(status);
    return status;
  }

  absl::Status Prepare() {
    absl::MutexLock lock(&mu_);
    return PrepareLocked();
  }

  absl::StatusOr<RefitResult> Commit() {
    absl::MutexLock lock(&mu_);
    if (state_ == SessionState::kReceiving) {
      absl::Status prepared = PrepareLocked();
      if (!prepared.ok()) return prepared;
    }
    if (state_ != SessionState::kPrepared) return NotReceiving();

    std::vector<StagedKernel> staged;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LayerState& layer = layers_[l];
      if (!layer.processed) continue;
      const std::vector<int>& kernels = impl_.layer_kernels[l];
      for (size_t k = 0; k < kernels.size(); ++k) {
        StagedKernel s;
        s.kernel = kernels[k];
#ifdef REFIT_WITH_CUDA
        if (!layer.device_staged.empty()) {
          s.data = layer.device_staged[k].data();
          s.on_device = true;
        } else {
          s.data = layer.staged[k].data.get();
        }
#else
        s.data = layer.staged[k].data.get();
#endif
        s.hash = layer.hashes[k];
        // A zero-byte kernel has no storage; give memcpy a valid pointer.
        static const uint8_t kEmpty = 0;
        if (s.data == nullptr) s.data = &kEmpty;
        staged.push_back(s);
      }
    }
    absl::StatusOr<CommitStats> stats = impl_.CommitStaged(staged);
    if (!stats.ok()) {
      AbortLocked(stats.status());
      return stats.status();
    }
    timings_.commit = stats->pause;
    state_ = SessionState::kCommitted;
    StopWorker();

    RefitResult result;
    result.refit_id = options_.refit_id;
    result.version = stats->version;
    result.fingerprint = stats->fingerprint;
    result.kept_layers = kept_layers_;
    result.partial_layers = partial_layers_;
    result.timings = timings_;
    result.bytes_received = bytes_received_;
    result.peak_staging_bytes = peak_staging_bytes_;
    FreeAll();
    store_->ReleaseSession(options_.refit_id);
    REFIT_LOG(INFO)
            .Field("refit_id", options_.refit_id)
            .Field("group", store_->group())
            .Field("version", absl::StrCat(stats->version))
            .Field("fingerprint", stats->fingerprint)
            .Field("pause_us", absl::StrCat(absl::ToInt64Microseconds(stats->pause)))
        << "committed";
    StoreEvent event;
    event.type = StoreEventType::kCommitted;
    event.refit_id = options_.refit_id;
    event.version = stats->version;
    event.fingerprint = stats->fingerprint;
    PublishUnlocked(std::move(event));
    return result;
  }

  void Abort(absl::string_view reason) {
    absl::MutexLock lock(&mu_);
    if (state_ == SessionState::kReceiving || state_ == SessionState::kPrepared) {
      AbortLocked(absl::AbortedError(absl::StrCat("refit \"", options_.refit_id,
                                                  "\" aborted: ", reason)));
    }
  }

 private:
  absl::Status NotReceiving() const {
    return absl::FailedPreconditionError(
        absl::StrCat("refit \"", options_.refit_id, "\" is ", SessionStateName(state_),
                     abort_status_.ok() ? "" : absl::StrCat(" (", abort_status_.message(), ")")));
  }

  // Events are published with mu_ released: listeners may call progress().
  void PublishUnlocked(StoreEvent event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    mu_.Unlock();
    store_->Publish(std::move(event));
    mu_.Lock();
  }

  void FreeAll() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    layers_.clear();
    layers_.shrink_to_fit();
    tensors_.clear();
    tensors_.shrink_to_fit();
    staging_bytes_ = 0;
    staged_kernel_bytes_ = 0;
  }

  void AbortLocked(absl::Status reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (state_ == SessionState::kAborted || state_ == SessionState::kCommitted) return;
    state_ = SessionState::kAborted;
    abort_status_ = reason;
    StopWorker();
    FreeAll();
    store_->ReleaseSession(options_.refit_id);
    REFIT_LOG(WARNING)
            .Field("refit_id", options_.refit_id)
            .Field("group", store_->group())
            .Field("version", absl::StrCat(store_->version()))
        << "aborted: " << std::string(reason.message());
    StoreEvent event;
    event.type = StoreEventType::kAborted;
    event.refit_id = options_.refit_id;
    event.version = store_->version();
    event.fingerprint = store_->fingerprint();
    event.message = std::string(reason.message());
    PublishUnlocked(std::move(event));
  }

  absl::Status IngestLocked(const Chunk& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::StatusOr<int> index = impl_.mapper.LookupIndex(chunk.name);
    if (!index.ok()) return index.status();
    const CheckpointTensor& ct = layout_.checkpoint_tensors()[*index];
    TensorState& ts = tensors_[*index];

    if (!IsHighPrecisionFloat(chunk.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor \"", ct.name, "\": dtype ", DTypeName(chunk.dtype),
          " is not accepted; send F32, F16 or BF16 (checkpoint dtype ", DTypeName(ct.dtype), ")"));
    }
    if (!std::equal(chunk.shape.begin(), chunk.shape.end(), ct.shape.begin(), ct.shape.end())) {
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", ct.name, "\": shape ",
                                                     ShapeString(chunk.shape),
                                                     " does not match the model's ",
                                                     ShapeString(ct.shape)));
    }
    if (ts.seen && ts.dtype != chunk.dtype) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", ct.name, "\": chunk dtype ", DTypeName(chunk.dtype),
                       " differs from its earlier chunks' ", DTypeName(ts.dtype)));
    }
    const uint64_t elem = DTypeSize(chunk.dtype);
    const uint64_t total = static_cast<uint64_t>(ct.numel()) * elem;
    const uint64_t begin = chunk.offset;
    const uint64_t size = chunk.data.size();
    if (begin % elem != 0 || size % elem != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", ct.name, "\": chunk at byte ", begin, " of ", size,
                       " bytes is not aligned to whole ", DTypeName(chunk.dtype), " elements"));
    }
    if (begin > total || size > total - begin) {
      return absl::OutOfRangeError(absl::StrCat("tensor \"", ct.name, "\": chunk bytes [", begin,
                                                ", ", begin + size, ") run past its end at ",
                                                total, " bytes"));
    }
    absl::Status added = ts.ranges.Add(begin, begin + size, ct.name);
    if (!added.ok()) return added;
    ts.seen = true;
    ts.dtype = chunk.dtype;
    bytes_received_ += static_cast<int64_t>(size);
    const bool scatter = ct.use != CheckpointTensor::Use::kIgnored && size > 0;
    if (!chunk.xxh3.has_value()) {
      return scatter ? Scatter(ct, chunk, begin / elem, (begin + size) / elem) : absl::OkStatus();
    }
    // Checksum and copy in cache-sized blocks: each block is hashed and then
    // scattered while it is still in cache, one pass over memory instead of
    // two. A mismatch found at the end aborts the refit; what was scattered
    // lives only in staging, so nothing live ever sees it.
    constexpr uint64_t kBlockBytes = uint64_t{256} << 10;
    const uint64_t block = std::max<uint64_t>(elem, kBlockBytes - kBlockBytes % elem);
    std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> state(XXH3_createState(),
                                                                          XXH3_freeState);
    XXH3_64bits_reset(state.get());
    for (uint64_t off = 0; off < size; off += block) {
      const uint64_t n = std::min(block, size - off);
      XXH3_64bits_update(state.get(), chunk.data.data() + off, n);
      if (!scatter) continue;
      Chunk part = chunk;
      part.data = chunk.data.subspan(off, n);
      absl::Status scattered = Scatter(ct, part, (begin + off) / elem, (begin + off + n) / elem);
      if (!scattered.ok()) return scattered;
    }
    if (XXH3_64bits_digest(state.get()) != *chunk.xxh3) {
      return absl::DataLossError(absl::StrCat("tensor \"", ct.name,
                                              "\": checksum mismatch in chunk bytes [", begin, ", ",
                                              begin + size, ")"));
    }
    return absl::OkStatus();
  }

  // Copies the part of elements [e0, e1) of `ct` that lies in its slice into
  // the layer's param buffer, converting to the checkpoint dtype.
  absl::Status Scatter(const CheckpointTensor& ct, const Chunk& chunk, uint64_t e0, uint64_t e1)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const LayerSpec& layer_spec = layout_.layers()[ct.layer];
    LayerState& layer = layers_[ct.layer];
    const ParamSpec& param = layer_spec.params[ct.param];
    const SliceSpec& slice = ct.slice;
    const int64_t cols = ViewCols(ct.shape);
    const int64_t elem_in = static_cast<int64_t>(DTypeSize(chunk.dtype));
    const int64_t elem_out = static_cast<int64_t>(DTypeSize(param.dtype));

    int64_t row_first = static_cast<int64_t>(e0) / cols;
    int64_t row_last = (static_cast<int64_t>(e1) - 1) / cols + 1;  // exclusive
    row_first = std::max(row_first, slice.src_row);
    row_last = std::min(row_last, slice.src_row + slice.num_rows);
    // A processed layer has every element of its slice; the range check
    // already refused anything overlapping it, so the rest is other ranks'.
    if (row_first >= row_last || layer.processed || layer.queued) return absl::OkStatus();
    if (slice.src_col > 0 || slice.num_cols < cols) {
      // Column slice: skip chunks that lie wholly in other ranks' columns.
      bool touches = false;
      for (int64_t r = row_first; r < row_last && !touches; ++r) {
        int64_t a = std::max<int64_t>(static_cast<int64_t>(e0), r * cols) - r * cols;
        int64_t b = std::min<int64_t>(static_cast<int64_t>(e1), (r + 1) * cols) - r * cols;
        touches = std::max(a, slice.src_col) < std::min(b, slice.src_col + slice.num_cols);
      }
      if (!touches) return absl::OkStatus();
    }

    if (layer.params.empty()) {
      absl::Status allocated = AllocateLayer(ct.layer);
      if (!allocated.ok()) return allocated;
    }
    uint8_t* dst_base = layer.params[ct.param].data.get();
    int64_t contributed = 0;
    for (int64_t r = row_first; r < row_last; ++r) {
      int64_t a = std::max<int64_t>(static_cast<int64_t>(e0), r * cols) - r * cols;
      int64_t b = std::min<int64_t>(static_cast<int64_t>(e1), (r + 1) * cols) - r * cols;
      a = std::max(a, slice.src_col);
      b = std::min(b, slice.src_col + slice.num_cols);
      if (a >= b) continue;
      int64_t dst_index = (slice.dst_row + (r - slice.src_row)) * slice.num_cols + (a - slice.src_col);
      const uint8_t* src = chunk.data.data() + ((r * cols + a) - static_cast<int64_t>(e0)) * elem_in;
      absl::Status converted = ConvertFloats(src, chunk.dtype, dst_base + dst_index * elem_out,
                                             param.dtype, static_cast<size_t>(b - a));
      if (!converted.ok()) return converted;
      contributed += b - a;
    }
    layer.loaded += contributed;
    loaded_ += contributed;
    if (contributed > 0 && layer_spec.kind != LayerKind::kAttention &&
        layer.loaded == layer_spec.expected_numel) {
      return EnqueueLayer(ct.layer);
    }
    return absl::OkStatus();
  }

  absl::Status AllocateLayer(int l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const LayerSpec& spec = layout_.layers()[l];
    LayerState& layer = layers_[l];
    int64_t bytes = spec.param_bytes();
    if (staging_bytes_ + bytes > options_.staging_budget_bytes && (!pending_.empty() || busy_)) {
      // Complete layers still hold staging until the worker is through with
      // them: wait for it (backpressure) rather than fail.
      absl::Status drained = DrainWorker();
      if (state_ != SessionState::kReceiving) return NotReceiving();
      if (!drained.ok()) return drained;
    }
    if (staging_bytes_ + bytes > options_.staging_budget_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "staging budget exceeded: layer \"", spec.name, "\" needs ", bytes,
          " bytes of high-precision staging, ", staging_bytes_, " bytes are held by ",
          LayersInFlight(), " incomplete layer(s), budget ", options_.staging_budget_bytes,
          " bytes; send tensors layer by layer or raise the budget"));
    }
    for (const ParamSpec& param : spec.params) {
      // Zeros matter where elements may never be written: padding rows,
      // zero-filled partial layers, attention scales that may not come.
      const bool zero = param.loaded_numel < param.numel() || options_.allow_partial_layers ||
                        spec.kind == LayerKind::kAttention;
      absl::StatusOr<Buffer> buffer = zero ? Buffer::Zeroed(param.nbytes(), spec.name)
                                           : Buffer::Uninitialized(param.nbytes(), spec.name);
      if (!buffer.ok()) return buffer.status();
      layer.params.push_back(*std::move(buffer));
    }
    layer.param_bytes = bytes;
    staging_bytes_ += bytes;
    peak_staging_bytes_ = std::max(peak_staging_bytes_, staging_bytes_);
    return absl::OkStatus();
  }

  int64_t LayersInFlight() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    int64_t n = 0;
    for (const LayerState& layer : layers_) n += (!layer.params.empty() && !layer.processed) ? 1 : 0;
    return n;
  }

  struct Processed {
    std::vector<Buffer> staged;  // one per kernel of the layer
#ifdef REFIT_WITH_CUDA
    std::vector<DeviceBuffer> device_staged;  // instead of `staged` on a GPU
#endif
    std::vector<uint64_t> hashes;
    absl::Duration took;
  };

  // Turns a layer's checkpoint-format params into its kernels. Touches no
  // session state, so the worker runs it without holding mu_.
  absl::StatusOr<Processed> ComputeLayer(int l, std::vector<Buffer> params) const {
#ifdef REFIT_WITH_CUDA
    if (gpu_ != nullptr) return ComputeLayerOnDevice(l, std::move(params));
#endif
    absl::Time start = absl::Now();
    const LayerSpec& spec = layout_.layers()[l];
    Processed out;
    out.staged.resize(spec.kernels.size());
    std::vector<Buffer>& staged = out.staged;
    if (spec.kind == LayerKind::kAttention) {
      absl::Status done = ProcessAttention(spec, params, staged);
      if (!done.ok()) return done;
    } else {
      absl::StatusOr<std::vector<KernelPlan>> plan = PlanKernels(spec);
      if (!plan.ok()) return plan.status();
      for (size_t k = 0; k < spec.kernels.size(); ++k) {
        const KernelSpec& kernel = spec.kernels[k];
        if ((*plan)[k].param < 0) continue;  // a scale, written with its weight
        const int p = (*plan)[k].param;
        const int s = (*plan)[k].scale;
        const ParamSpec& param = spec.params[p];
        if (s >= 0) {
          absl::StatusOr<Buffer> q = Buffer::Uninitialized(kernel.nbytes(), kernel.name);
          if (!q.ok()) return q.status();
          absl::StatusOr<Buffer> scales =
              Buffer::Uninitialized(spec.kernels[s].nbytes(), kernel.name);
          if (!scales.ok()) return scales.status();
          Fp8QuantizeOptions qopts;
          qopts.scheme = layout_.quant();
          qopts.non_finite = options_.non_finite;
          qopts.num_threads = options_.quantize_threads;
          absl::Status quantized = QuantizeFp8(
              params[p].data.get(), param.dtype, param.shape[0], param.shape[1], qopts,
              q->data.get(), reinterpret_cast<float*>(scales->data.get()), kernel.name);
          if (!quantized.ok()) return quantized;
          staged[k] = *std::move(q);
          staged[s] = *std::move(scales);
        } else {
          // Kept in the checkpoint dtype: the param buffer becomes the kernel.
          if (param.nbytes() != kernel.nbytes()) {
            return absl::InternalError(absl::StrCat("layer \"", spec.name, "\": param \"",
                                                    param.suffix, "\" and its kernel differ in size"));
          }
          staged[k] = std::move(params[p]);
        }
      }
    }
    // Processing must reproduce the first load's exact sizes, or nothing commits.
    out.hashes.resize(spec.kernels.size());
    for (size_t k = 0; k < spec.kernels.size(); ++k) {
      if (staged[k].size != spec.kernels[k].nbytes()) {
        return absl::InternalError(absl::StrCat("kernel \"", spec.kernels[k].name, "\": staged ",
                                                staged[k].size, " bytes, live tensor has ",
                                                spec.kernels[k].nbytes()));
      }
      out.hashes[k] = Hash(staged[k].data.get(), staged[k].size);
    }
    out.took = absl::Now() - start;
    return out;
  }

#ifdef REFIT_WITH_CUDA
  // ComputeLayer on a GPU store. The layer's high-precision weights go to the
  // device through the pinned pool, FP8 weights and scales are quantized
  // there (Fp8CudaQuantizer, bit-identical to QuantizeFp8), and every kernel
  // ends up staged in device memory, ready for a device-to-device commit.
  // Hashes are of the same bytes as the host path: kernels kept in the
  // checkpoint dtype (and attention scales) are hashed from their host copy
  // before upload, quantized kernels from a copy read back from the device.
  // Every return path leaves the session's stream idle, so the device
  // buffers may be freed (or committed) as soon as it returns.
  absl::StatusOr<Processed> ComputeLayerOnDevice(int l, std::vector<Buffer> params) const {
    absl::Time start = absl::Now();
    const LayerSpec& spec = layout_.layers()[l];
    const size_t n = spec.kernels.size();
    cuda::ScopedCudaDevice scoped(gpu_->device());
    if (!scoped.status().ok()) return scoped.status();

    // Quantize jobs in flight on the stream; synced (and their non-finite
    // record cleared) on every path out, so that the shared quantizer never
    // reports this layer's jobs to a later Sync of a stream at this address.
    struct StreamIdle {
      const GpuStaging& gpu;
      bool jobs = false;
      ~StreamIdle() {
        if (jobs) gpu.quantizer().Sync(gpu.stream()).IgnoreError();
        gpu.Synchronize().IgnoreError();
      }
    };

    Processed out;
    out.device_staged.resize(n);
    out.hashes.resize(n);
    std::vector<Buffer> host(n);          // kernels computed or kept on the host
    std::vector<bool> on_device(n, false);  // quantized on the device
    std::vector<DeviceBuffer> sources;    // high-precision weights on the device
    // Declared after the buffers: destroyed (stream synced) before them.
    StreamIdle idle{*gpu_};

    if (spec.kind == LayerKind::kAttention) {
      absl::Status done = ProcessAttention(spec, params, host);
      if (!done.ok()) return done;
    } else {
      absl::StatusOr<std::vector<KernelPlan>> plan = PlanKernels(spec);
      if (!plan.ok()) return plan.status();
      for (size_t k = 0; k < n; ++k) {
        const KernelSpec& kernel = spec.kernels[k];
        if ((*plan)[k].param < 0) continue;  // a scale, written with its weight
        const int p = (*plan)[k].param;
        const int s = (*plan)[k].scale;
        const ParamSpec& param = spec.params[p];
        if (s >= 0) {
          const int64_t rows = param.shape[0];
          const int64_t cols = param.shape[1];
          // The device writes exactly these sizes: check them before it does.
          if (kernel.nbytes() != rows * cols ||
              spec.kernels[s].nbytes() !=
                  Fp8NumScales(layout_.quant(), rows, cols) * static_cast<int64_t>(sizeof(float))) {
            return absl::InternalError(absl::StrCat("kernel \"", kernel.name,
                                                    "\": FP8 kernel or scale sizes do not match ",
                                                    ShapeString(param.shape)));
          }
          absl::StatusOr<DeviceBuffer> src =
              DeviceBuffer::Allocate(gpu_->device(), param.nbytes(), kernel.name);
          if (!src.ok()) return src.status();
          absl::StatusOr<DeviceBuffer> q =
              DeviceBuffer::Allocate(gpu_->device(), kernel.nbytes(), kernel.name);
          if (!q.ok()) return q.status();
          absl::StatusOr<DeviceBuffer> scales =
              DeviceBuffer::Allocate(gpu_->device(), spec.kernels[s].nbytes(), kernel.name);
          if (!scales.ok()) return scales.status();
          absl::Status uploaded = gpu_->Upload(params[p].data.get(), params[p].size, src->data());
          if (!uploaded.ok()) return uploaded;
          params[p] = Buffer();  // copied into pinned memory: the host copy can go
          cuda::Fp8CudaJob job;
          job.src = src->data();
          job.src_dtype = param.dtype;
          job.rows = rows;
          job.cols = cols;
          job.out_q = static_cast<uint8_t*>(q->data());
          job.out_scales = static_cast<float*>(scales->data());
          job.tensor_name = kernel.name;
          Fp8QuantizeOptions qopts;
          qopts.scheme = layout_.quant();
          qopts.non_finite = options_.non_finite;
          idle.jobs = true;
          absl::Status enqueued = gpu_->quantizer().Enqueue(job, qopts, gpu_->stream());
          if (!enqueued.ok()) return enqueued;
          sources.push_back(*std::move(src));
          out.device_staged[k] = *std::move(q);
          out.device_staged[s] = *std::move(scales);
          on_device[k] = on_device[s] = true;
        } else {
          // Kept in the checkpoint dtype: the param buffer becomes the kernel.
          if (param.nbytes() != kernel.nbytes()) {
            return absl::InternalError(absl::StrCat("layer \"", spec.name, "\": param \"",
                                                    param.suffix, "\" and its kernel differ in size"));
          }
          host[k] = std::move(params[p]);
        }
      }
    }
    // Host-side kernels: check, hash, upload (overlapping the quantization
    // already enqueued).
    for (size_t k = 0; k < n; ++k) {
      if (on_device[k]) continue;
      if (host[k].size != spec.kernels[k].nbytes()) {
        return absl::InternalError(absl::StrCat("kernel \"", spec.kernels[k].name, "\": staged ",
                                                host[k].size, " bytes, live tensor has ",
                                                spec.kernels[k].nbytes()));
      }
      out.hashes[k] = Hash(host[k].data.get(), host[k].size);
      absl::StatusOr<DeviceBuffer> staged =
          DeviceBuffer::Allocate(gpu_->device(), host[k].size, spec.kernels[k].name);
      if (!staged.ok()) return staged.status();
      absl::Status uploaded = gpu_->Upload(host[k].data.get(), host[k].size, staged->data());
      if (!uploaded.ok()) return uploaded;
      host[k] = Buffer();
      out.device_staged[k] = *std::move(staged);
    }
    // Non-finite input under kReject: INVALID_ARGUMENT naming the tensor.
    if (idle.jobs) {
      idle.jobs = false;
      absl::Status quantized = gpu_->quantizer().Sync(gpu_->stream());
      if (!quantized.ok()) return quantized;
    }
    // Quantized kernels: hash the bytes the device wrote.
    for (size_t k = 0; k < n; ++k) {
      if (!on_device[k]) continue;
      absl::StatusOr<Buffer> back = Buffer::Zeroed(out.device_staged[k].size, spec.kernels[k].name);
      if (!back.ok()) return back.status();
      absl::Status read = gpu_->Download(out.device_staged[k].data(), back->size, back->data.get());
      if (!read.ok()) return read;
      host[k] = *std::move(back);
    }
    absl::Status synced = gpu_->Synchronize();
    if (!synced.ok()) return synced;
    for (size_t k = 0; k < n; ++k) {
      if (on_device[k]) out.hashes[k] = Hash(host[k].data.get(), host[k].size);
    }
    out.took = absl::Now() - start;
    return out;
  }
#endif  // REFIT_WITH_CUDA

  // Records a processed layer; its high-precision staging is gone by now.
  void PublishLayer(int l, Processed processed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    LayerState& layer = layers_[l];
    for (const Buffer& b : processed.staged) staged_kernel_bytes_ += b.size;
    layer.staged = std::move(processed.staged);
#ifdef REFIT_WITH_CUDA
    for (const DeviceBuffer& b : processed.device_staged) staged_kernel_bytes_ += b.size;
    layer.device_staged = std::move(processed.device_staged);
#endif
    layer.hashes = std::move(processed.hashes);
    staging_bytes_ -= layer.param_bytes;
    layer.param_bytes = 0;
    layer.processed = true;
    layer.queued = false;
    timings_.quantize += processed.took;
  }

  // Processes layer `l` on the calling thread (finalize-time layers).
  absl::Status ProcessLayer(int l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    LayerState& layer = layers_[l];
    if (layer.params.empty()) {
      absl::Status allocated = AllocateLayer(l);
      if (!allocated.ok()) return allocated;
    }
    absl::StatusOr<Processed> processed = ComputeLayer(l, std::move(layer.params));
    layer.params.clear();
    if (!processed.ok()) return processed.status();
    PublishLayer(l, *std::move(processed));
    return absl::OkStatus();
  }

  // A complete layer goes to the worker, so that quantizing it overlaps
  // receiving the next one.
  absl::Status EnqueueLayer(int l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!options_.overlap_processing) return ProcessLayer(l);
    layers_[l].queued = true;
    pending_.push_back(l);
    if (!worker_.joinable()) worker_ = std::thread([this] { WorkerLoop(); });
    // Backpressure: return once the worker has taken the layer, so that at
    // most one complete layer is being processed while the next one arrives.
    // Without it a fast sender queues complete layers (each holding its
    // high-precision staging) ahead of the quantizer, and peak memory grows
    // with the model instead of with the largest layer.
    mu_.Await(absl::Condition(
        +[](RefitSessionImpl* self) {
          return self->pending_.empty() || self->stop_ || !self->worker_status_.ok();
        },
        this));
    if (state_ != SessionState::kReceiving) return NotReceiving();
    return worker_status_;
  }

  void WorkerLoop() {
    absl::MutexLock lock(&mu_);
    while (true) {
      mu_.Await(absl::Condition(
          +[](RefitSessionImpl* self) {
            return self->stop_ || !self->pending_.empty();
          },
          this));
      if (stop_) return;
      int l = pending_.front();
      pending_.pop_front();
      if (!worker_status_.ok()) continue;  // drop work after the first failure
      busy_ = true;
      std::vector<Buffer> params = std::move(layers_[l].params);
      layers_[l].params.clear();
      mu_.Unlock();
      absl::StatusOr<Processed> processed = ComputeLayer(l, std::move(params));
      mu_.Lock();
      busy_ = false;
      if (stop_) return;
      if (!processed.ok()) {
        worker_status_ = processed.status();
        continue;
      }
      PublishLayer(l, *std::move(processed));
    }
  }

  // Waits until the worker has processed everything queued; returns its
  // first error, if any.
  absl::Status DrainWorker() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    mu_.Await(absl::Condition(
        +[](RefitSessionImpl* self) {
          return self->pending_.empty() && !self->busy_;
        },
        this));
    return worker_status_;
  }

  // Stops the worker; the in-flight layer, if any, is finished and dropped.
  void StopWorker() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    stop_ = true;
    mu_.Await(absl::Condition(
        +[](RefitSessionImpl* self) { return !self->busy_; },
        this));
    pending_.clear();
  }

  // Attention scales at finalize: ResolveAttentionScales (REFERENCE.md §4).
  absl::Status ProcessAttention(const LayerSpec& spec, const std::vector<Buffer>& params,
                                std::vector<Buffer>& staged) const {
    auto received = [&](absl::string_view suffix) -> float {
      int p = ParamIndex(spec, suffix);
      if (p < 0 || params.empty()) return 0.0f;
      return LoadAsFloat(params[p].data.get(), spec.params[p].dtype, 0);
    };
    const AttentionScales scales =
        ResolveAttentionScales(received("k_scale"), received("v_scale"), received("q_scale"),
                               received("kv_scale"));
    for (size_t i = 0; i < spec.kernels.size(); ++i) {
      const KernelSpec& kernel = spec.kernels[i];
      const float value = scales.ForKernel(kernel.suffix);
      absl::StatusOr<Buffer> buffer = Buffer::Zeroed(kernel.nbytes(), kernel.name);
      if (!buffer.ok()) return buffer.status();
      if (kernel.nbytes() == static_cast<int64_t>(sizeof(float))) {
        std::memcpy(buffer->data.get(), &value, sizeof(float));
      }
      staged[i] = *std::move(buffer);
    }
    return absl::OkStatus();
  }

  // How each kernel of a non-attention layer is made: copied from the param
  // of the same suffix, or, for a quantized weight, quantized from it with the
  // scales going to the `scale` kernel. Scale kernels get param = -1.
  struct KernelPlan {
    int param = -1;
    int scale = -1;
  };

  static absl::StatusOr<std::vector<KernelPlan>> PlanKernels(const LayerSpec& spec) {
    std::vector<KernelPlan> plan(spec.kernels.size());
    for (size_t k = 0; k < spec.kernels.size(); ++k) {
      const KernelSpec& kernel = spec.kernels[k];
      if (kernel.suffix == "weight_scale" || kernel.suffix == "weight_scale_inv") continue;
      plan[k].param = ParamIndex(spec, kernel.suffix);
      if (plan[k].param < 0) {
        return absl::InternalError(absl::StrCat("layer \"", spec.name, "\": kernel \"",
                                                kernel.suffix, "\" has no source param"));
      }
      if (spec.quantized && kernel.suffix == "weight") {
        plan[k].scale = KernelIndex(spec, "weight_scale");
        if (plan[k].scale < 0) plan[k].scale = KernelIndex(spec, "weight_scale_inv");
        if (plan[k].scale < 0 || spec.params[plan[k].param].shape.size() != 2) {
          return absl::InternalError(
              absl::StrCat("layer \"", spec.name, "\": quantized weight without scale"));
        }
      }
    }
    return plan;
  }

  static int ParamIndex(const LayerSpec& spec, absl::string_view suffix) {
    for (size_t i = 0; i < spec.params.size(); ++i) {
      if (spec.params[i].suffix == suffix) return static_cast<int>(i);
    }
    return -1;
  }

  static int KernelIndex(const LayerSpec& spec, absl::string_view suffix) {
    for (size_t i = 0; i < spec.kernels.size(); ++i) {
      if (spec.kernels[i].suffix == suffix) return static_cast<int>(i);
    }
    return -1;
  }

  absl::Status PrepareLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (state_ != SessionState::kReceiving) return NotReceiving();
    absl::Status status = FinalizeLocked();
    if (!status.ok()) {
      AbortLocked(status);
      return status;
    }
    state_ = SessionState::kPrepared;
    REFIT_LOG(INFO)
            .Field("refit_id", options_.refit_id)
            .Field("group", store_->group())
            .Field("bytes", absl::StrCat(bytes_received_))
            .Field("kept_layers", absl::StrCat(kept_layers_.size()))
        << "prepared";
    StoreEvent event;
    event.type = StoreEventType::kPrepared;
    event.refit_id = options_.refit_id;
    event.version = store_->version();
    event.fingerprint = store_->fingerprint();
    PublishUnlocked(std::move(event));
    return absl::OkStatus();
  }

  absl::Status FinalizeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::Time start = absl::Now();
    timings_.receive = last_ingest_ - begin_time_;
    absl::Status drained = DrainWorker();
    if (!drained.ok()) return drained;
    const std::vector<CheckpointTensor>& cts = layout_.checkpoint_tensors();
    // A tensor received only in part is truncated data, never padding.
    for (size_t i = 0; i < cts.size(); ++i) {
      const TensorState& ts = tensors_[i];
      if (!ts.seen) continue;
      uint64_t total = static_cast<uint64_t>(cts[i].numel()) * DTypeSize(ts.dtype);
      if (ts.ranges.received() != total) {
        return absl::DataLossError(absl::StrCat("tensor \"", cts[i].name, "\" is incomplete: received ",
                                                ts.ranges.received(), " of ", total, " bytes"));
      }
    }
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LayerSpec& spec = layout_.layers()[l];
      LayerState& layer = layers_[l];
      if (layer.processed) continue;
      if (spec.kind == LayerKind::kAttention) {
        absl::Status done = ProcessLayer(static_cast<int>(l));
        if (!done.ok()) return done;
        continue;
      }
      if (spec.expected_numel == 0) continue;  // nothing of it lives on this rank
      if (layer.loaded == 0) {
        kept_layers_.push_back(spec.name);
        REFIT_LOG(WARNING).Field("refit_id", options_.refit_id).Field("layer", spec.name)
            << "received no weights; keeping the live values";
        continue;
      }
      std::vector<std::string> missing = MissingTensors(static_cast<int>(l));
      if (!options_.allow_partial_layers) {
        return absl::FailedPreconditionError(absl::StrCat(
            "layer \"", spec.name, "\" is incomplete: no bytes for ", absl::StrJoin(missing, ", "),
            " (", layer.loaded, " of ", spec.expected_numel,
            " elements); send them or set allow_partial_layers to zero-fill"));
      }
      absl::Status done = ProcessLayer(static_cast<int>(l));
      if (!done.ok()) return done;
      partial_layers_.push_back(spec.name);
      REFIT_LOG(WARNING).Field("refit_id", options_.refit_id).Field("layer", spec.name)
          << "zero-filled missing tensors: " << absl::StrJoin(missing, ", ");
    }
    timings_.finalize = absl::Now() - start;
    return absl::OkStatus();
  }

  std::vector<std::string> MissingTensors(int l) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<std::string> missing;
    const std::vector<CheckpointTensor>& cts = layout_.checkpoint_tensors();
    for (size_t i = 0; i < cts.size(); ++i) {
      if (cts[i].use == CheckpointTensor::Use::kTarget && cts[i].layer == l && !cts[i].optional &&
          !tensors_[i].seen && cts[i].slice.numel() > 0) {
        missing.push_back(cts[i].name);
      }
    }
    return missing;
  }

  ShardStore* const store_;
  ShardStoreImpl& impl_;
  const ModelLayout& layout_;
  const RefitOptions options_;

  mutable absl::Mutex mu_;
  SessionState state_ ABSL_GUARDED_BY(mu_) = SessionState::kReceiving;
  absl::Status abort_status_ ABSL_GUARDED_BY(mu_);
  std::vector<LayerState> layers_ ABSL_GUARDED_BY(mu_);
  std::vector<TensorState> tensors_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_received_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t loaded_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t expected_ = 0;
  int64_t staging_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t peak_staging_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t staged_kernel_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> kept_layers_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> partial_layers_ ABSL_GUARDED_BY(mu_);
  PhaseTimings timings_ ABSL_GUARDED_BY(mu_);
  const absl::Time begin_time_;
  absl::Time last_ingest_ ABSL_GUARDED_BY(mu_);

  // The processing worker (RefitOptions::overlap_processing).
  std::thread worker_;
  std::deque<int> pending_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status worker_status_ ABSL_GUARDED_BY(mu_);

#ifdef REFIT_WITH_CUDA
  // Set on a GPU store (device staging); null on the host path. Used by
  // whichever thread processes a layer: the worker, or the caller at
  // finalize once the worker is drained, never both at once.
  std::unique_ptr<GpuStaging> gpu_;
#endif
};

RefitSession::RefitSession(std::unique_ptr<RefitSessionImpl> impl) : impl_(std::move(impl)) {}
RefitSession::~RefitSession() = default;

absl::StatusOr<std::unique_ptr<RefitSession>> RefitSession::Begin(ShardStore* store,
                                                                  RefitOptions options) {
  if (store == nullptr) return absl::InvalidArgumentError("RefitSession needs a store");
  if (options.refit_id.empty()) options.refit_id = NewRefitId();
  if (options.staging_budget_bytes < 0) {
    return absl::InvalidArgumentError("staging_budget_bytes must not be negative");
  }
  absl::Status acquired = store->AcquireSession(options.refit_id);
  if (!acquired.ok()) return acquired;
  if (options.base_version.has_value() && *options.base_version != store->version()) {
    store->ReleaseSession(options.refit_id);
    return absl::FailedPreconditionError(
        absl::StrCat("refit expects base version ", *options.base_version, " but model group \"",
                     store->group(), "\" serves version ", store->version()));
  }
  std::string id = options.refit_id;
#ifdef REFIT_WITH_CUDA
  std::unique_ptr<GpuStaging> gpu;
  if (store->on_gpu() && UseDeviceStaging()) {
    absl::StatusOr<std::unique_ptr<GpuStaging>> created =
        GpuStaging::Create(store->impl().device.index());
    if (!created.ok()) {
      store->ReleaseSession(id);
      return absl::Status(created.status().code(),
                          absl::StrCat("refit \"", id, "\": cannot set up staging on ",
                                       store->device(), ": ", created.status().message()));
    }
    gpu = *std::move(created);
  }
#endif
  auto impl = std::make_unique<RefitSessionImpl>(store, std::move(options));
#ifdef REFIT_WITH_CUDA
  impl->SetGpuStaging(std::move(gpu));
#endif
  auto session = std::unique_ptr<RefitSession>(new RefitSession(std::move(impl)));
  REFIT_LOG(INFO).Field("refit_id", id).Field("group", store->group())
          .Field("base_version", absl::StrCat(store->version()))
      << "staging started";
  StoreEvent event;
  event.type = StoreEventType::kStagingStarted;
  event.refit_id = id;
  event.version = store->version();
  event.fingerprint = store->fingerprint();
  store->Publish(std::move(event));
  return session;
}

absl::Status RefitSession::Ingest(const Chunk& chunk) { return impl_->Ingest(chunk); }
absl::Status RefitSession::Prepare() { return impl_->Prepare(); }
absl::StatusOr<RefitResult> RefitSession::Commit() { return impl_->Commit(); }
void RefitSession::Abort(absl::string_view reason) { impl_->Abort(reason); }
const std::string& RefitSession::refit_id() const { return impl_->refit_id(); }
SessionState RefitSession::state() const { return impl_->state(); }
SessionProgress RefitSession::progress() const { return impl_->progress(); }
absl::Status RefitSession::abort_status() const { return impl_->abort_status(); }

absl::StatusOr<RefitResult> LoadSafetensors(
    ShardStore* store, const std::vector<std::string>& files, RefitOptions options,
    const std::function<void(const SessionProgress&)>& on_progress, bool prepare_only,
    std::unique_ptr<RefitSession>* prepared) {
  constexpr uint64_t kChunkBytes = uint64_t{64} << 20;
  if (files.empty()) return absl::InvalidArgumentError("no safetensors files to load");
  absl::StatusOr<std::unique_ptr<RefitSession>> session = RefitSession::Begin(store, options);
  if (!session.ok()) return session.status();
  for (const std::string& path : files) {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
    if (!file.ok()) {
      (*session)->Abort(file.status().message());
      return file.status();
    }
    for (const TensorEntry& tensor : (*file)->tensors()) {
      uint64_t offset = 0;
      do {
        uint64_t n = std::min(kChunkBytes, tensor.nbytes - offset);
        // Keep chunks whole elements.
        uint64_t elem = DTypeSize(tensor.dtype);
        n -= n % elem;
        if (n == 0 && tensor.nbytes > 0) n = std::min<uint64_t>(elem, tensor.nbytes - offset);
        Chunk chunk;
        chunk.name = tensor.name;
        chunk.dtype = tensor.dtype;
        chunk.shape = tensor.shape;
        chunk.offset = offset;
        chunk.data = absl::MakeConstSpan(tensor.data + offset, n);
        absl::Status ingested = (*session)->Ingest(chunk);
        if (!ingested.ok()) {
          return absl::Status(ingested.code(),
                              absl::StrCat((*file)->path(), ": ", ingested.message()));
        }
        offset += n;
      } while (offset < tensor.nbytes);
    }
    if (on_progress) on_progress((*session)->progress());
  }
  if (prepare_only) {
    absl::Status status = (*session)->Prepare();
    if (!status.ok()) return status;
    RefitResult result;
    result.refit_id = (*session)->refit_id();
    SessionProgress progress = (*session)->progress();
    result.version = store->version();
    result.fingerprint = store->fingerprint();
    result.bytes_received = progress.bytes_received;
    result.peak_staging_bytes = progress.peak_staging_bytes;
    if (prepared != nullptr) *prepared = *std::move(session);
    return result;
  }
  return (*session)->Commit();
}

}  // namespace refit::core
