#include "core/shard_store.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Device.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/log.h"
#include "core/parallel.h"
#include "core/scale_hints.h"
#include "core/shard_store_tensors.h"
#include "core/snapshot.h"
#include "core/text.h"
#include "core/torch_dtype.h"
#include "core/xxh3.h"

#ifdef REFIT_WITH_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/cuda_status.h"
#include "core/cuda/device_commit.h"
#endif

namespace refit::core {
namespace {

uint64_t HashZeros(int64_t nbytes) {
  static const std::vector<uint8_t> zeros(1 << 20, 0);
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  for (int64_t done = 0; done < nbytes;) {
    int64_t n = std::min<int64_t>(nbytes - done, static_cast<int64_t>(zeros.size()));
    XXH3_64bits_update(state, zeros.data(), static_cast<size_t>(n));
    done += n;
  }
  uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return h;
}

absl::StatusOr<c10::Device> ParseDevice(absl::string_view text) {
  try {
    c10::Device device{std::string(text)};
    if (!device.is_cpu() && !device.is_cuda()) {
      return absl::InvalidArgumentError(
          absl::StrCat("device \"", text, "\": only cpu and cuda:N are supported"));
    }
    if (device.is_cuda() && !device.has_index()) device.set_index(0);
    return device;
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(absl::StrCat("device \"", text, "\": not a device name"));
  }
}

}  // namespace

namespace {
constexpr absl::string_view kNotQuiescedPayload = "type.refit.dev/refit.core.NotQuiesced";
}  // namespace

absl::Status NotQuiescedError(absl::string_view message) {
  absl::Status status = absl::DeadlineExceededError(message);
  status.SetPayload(kNotQuiescedPayload, absl::Cord("1"));
  return status;
}

bool IsNotQuiesced(const absl::Status& status) {
  return status.GetPayload(kNotQuiescedPayload).has_value();
}

ShardStoreImpl::ShardStoreImpl(std::shared_ptr<const ModelLayout> shared_layout, c10::Device dev)
    : layout(*shared_layout), device(dev) {
  for (size_t l = 0; l < layout.layers().size(); ++l) {
    for (const KernelSpec& spec : layout.layers()[l].kernels) {
      int index = static_cast<int>(specs.size());
      specs.push_back(&spec);
      kernel_layer.push_back(static_cast<int>(l));
      kernel_index.emplace(spec.name, index);
    }
  }
}

absl::Status ShardStoreImpl::Allocate() {
  std::vector<uint64_t> zero_hashes;
  // Layers repeat: a few distinct sizes cover every kernel.
  absl::flat_hash_map<int64_t, uint64_t> zero_hash_by_size;
  // One arena for every kernel (core/arena.h), laid out once: zero by
  // construction and (unless ShardStoreOptions::prefault_host is false)
  // populated in one call. at::zeros fills FP8 through a parallel loop per
  // tensor (seconds of every start on a loaded host), and a memset after
  // at::empty takes a page fault per 4 KiB.
  int64_t total = 0;
  for (const KernelSpec* spec : specs) {
    arena_offsets.push_back(total);
    total += ArenaAligned(spec->nbytes());
  }
  arena_data_bytes = total;
  layout_hash = std::strtoull(LayoutFingerprint(layout).c_str(), nullptr, 16);
  absl::StatusOr<std::unique_ptr<HostArena>> host = HostArena::Create(
      layout.config().arch_name, device.is_cpu() ? total : 0, layout_hash, prefault_host);
  if (!host.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", layout.kernel_bytes(),
                                                     " bytes of kernel tensors on ", device.str(),
                                                     ": ", host.status().message()));
  }
  host_arena = std::shared_ptr<HostArena>(std::move(*host));
  if (device.is_cuda()) {
    absl::StatusOr<std::unique_ptr<DeviceArena>> dev =
        DeviceArena::Create(static_cast<int>(device.index()), total);
    if (!dev.ok()) {
      if (dev.status().code() == absl::StatusCode::kUnimplemented) {
        // A CPU-only build's device store (tests only): LibTorch's allocator.
        dev = std::unique_ptr<DeviceArena>();
      } else {
        // A device that cannot share the arena the way asked (--cuda-arena)
        // says so; anything else is taken as out of memory.
        return absl::Status(
            dev.status().code() == absl::StatusCode::kFailedPrecondition
                ? absl::StatusCode::kFailedPrecondition
                : absl::StatusCode::kResourceExhausted,
            absl::StrCat("cannot allocate ", layout.kernel_bytes(), " bytes of kernel tensors on ",
                         device.str(), ": ", dev.status().message()));
      }
    }
    device_arena = std::shared_ptr<DeviceArena>(std::move(*dev));
  }
  try {
    for (size_t i = 0; i < specs.size(); ++i) {
      const KernelSpec* spec = specs[i];
      absl::StatusOr<c10::ScalarType> type = ToScalarType(spec->dtype);
      if (!type.ok()) return type.status();
      const at::TensorOptions options = at::TensorOptions().dtype(*type).device(device);
      if (device.is_cpu()) {
        // Each tensor keeps the arena alive, also past the store.
        std::shared_ptr<HostArena> keep = host_arena;
        kernels.push_back(at::from_blob(
            host_arena->data() + arena_offsets[i], spec->shape, [keep](void*) {}, options));
      } else if (device_arena != nullptr) {
        std::shared_ptr<DeviceArena> keep = device_arena;
        kernels.push_back(at::from_blob(
            static_cast<char*>(device_arena->base()) + arena_offsets[i], spec->shape,
            [keep](void*) {}, options));
      } else {
        kernels.push_back(at::zeros(spec->shape, options));
      }
      auto [it, inserted] = zero_hash_by_size.try_emplace(spec->nbytes(), 0);
      if (inserted) it->second = HashZeros(spec->nbytes());
      zero_hashes.push_back(it->second);
    }
  } catch (const c10::Error& e) {
    kernels.clear();
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", layout.kernel_bytes(),
                                                     " bytes of kernel tensors on ", device.str(),
                                                     ": ", e.what_without_backtrace()));
  }
  absl::MutexLock lock(&mu);
  hashes = std::move(zero_hashes);
  fingerprint = ComputeFingerprint(hashes);
  return absl::OkStatus();
}

std::string ShardStoreImpl::ComputeFingerprint(const std::vector<uint64_t>& kernel_hashes) const {
  return KernelFingerprint(specs, kernel_hashes);
}

uint64_t ShardStoreImpl::NextVersionLocked() const {
  return std::max(version + 1, next_version_floor);
}

absl::Status ShardStoreImpl::CheckStaged(const std::vector<StagedKernel>& staged) const {
  for (const StagedKernel& s : staged) {
    if (s.kernel < 0 || s.kernel >= static_cast<int>(kernels.size()) || s.data == nullptr) {
      return absl::InternalError(absl::StrCat("staged kernel index ", s.kernel, " is invalid"));
    }
    if (s.on_device && !device.is_cuda()) {
      return absl::InternalError(absl::StrCat("staged kernel ", specs[s.kernel]->name,
                                              " is on a device, the store on ", device.str()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<CommitStats> ShardStoreImpl::CommitStaged(const std::vector<StagedKernel>& staged,
                                                         uint64_t set_version,
                                                         absl::string_view refit_id) {
  if (absl::Status checked = CheckStaged(staged); !checked.ok()) return checked;
  absl::MutexLock lock(&mu);
  if (absl::Status prepared = PrepareCommitLocked(staged); !prepared.ok()) return prepared;
  return CopyStagedLocked(staged, set_version, refit_id);
}

absl::Status ShardStoreImpl::PrepareCommitLocked(const std::vector<StagedKernel>& staged) {
#ifdef REFIT_WITH_CUDA
  // Device-staged kernels go through the commit stream and its event,
  // created once, before the pause starts.
  bool any_on_device = false;
  for (const StagedKernel& s : staged) any_on_device = any_on_device || s.on_device;
  if (any_on_device && commit_event == nullptr) return CreateCommitResourcesLocked();
#else
  (void)staged;
#endif
  return absl::OkStatus();
}

CommitStats ShardStoreImpl::CopyStagedLocked(const std::vector<StagedKernel>& staged,
                                             uint64_t set_version, absl::string_view refit_id) {
  CommitStats stats;
#ifdef REFIT_WITH_CUDA
  // Device-staged kernels: one batch of device-to-device copies on the
  // commit stream, then the event.
  std::vector<cuda::DeviceCopy> device_copies;
  bool any_on_device = false;
  for (const StagedKernel& s : staged) any_on_device = any_on_device || s.on_device;
  // Host-staged kernels of a device store (--host-staging) go up with
  // cudaMemcpy from pageable memory, which may return before the DMA has
  // landed: the copies are waited for before the version is published.
  bool host_to_device = false;
  // On the store's device, whichever device this thread had current.
  std::optional<cuda::ScopedCudaDevice> on_device;
  if (device.is_cuda()) on_device.emplace(device.index());
#endif
  // Host kernels: one copy split over helper threads, after the loop.
  std::vector<HostCopy> host_copies;
  const absl::Time start = absl::Now();
  host_arena->BeginWrite();
  try {
    for (const StagedKernel& s : staged) {
      at::Tensor& live = kernels[s.kernel];
      int64_t nbytes = specs[s.kernel]->nbytes();
      if (nbytes == 0) {
        // No storage to copy into.
      } else if (live.is_cpu() && !s.on_device) {
        host_copies.push_back({live.data_ptr(), s.data, static_cast<size_t>(nbytes)});
      } else {
#ifdef REFIT_WITH_CUDA
        if (s.on_device) {
          device_copies.push_back({live.data_ptr(), s.data, nbytes});
        } else {
          host_to_device = true;
          if (cudaMemcpy(live.data_ptr(), s.data, static_cast<size_t>(nbytes),
                         cudaMemcpyHostToDevice) != cudaSuccess) {
            // Some kernels already hold new bytes: a mixed version must
            // never be served, so this is fatal.
            REFIT_LOG(ERROR) << "commit copy of " << specs[s.kernel]->name << " failed";
            std::abort();
          }
        }
#else
        // CPU-only build with a device store: go through LibTorch.
        at::Tensor src = at::from_blob(const_cast<void*>(s.data), live.sizes(),
                                       at::TensorOptions().dtype(live.scalar_type()));
        live.copy_(src);
#endif
      }
      hashes[s.kernel] = s.hash;
      stats.bytes_copied += nbytes;
    }
  } catch (const c10::Error& e) {
    // Unreachable for host copies; a device copy failing mid-way leaves a
    // mixed version, which must never be served.
    REFIT_LOG(ERROR) << "commit copy failed: " << e.what_without_backtrace();
    std::abort();
  }
  ParallelStreamingCopy(host_copies, BulkThreads());
#ifdef REFIT_WITH_CUDA
  if (host_to_device) {
    if (cudaError_t e = cudaStreamSynchronize(cudaStreamLegacy); e != cudaSuccess) {
      REFIT_LOG(ERROR) << "commit copy to " << device.str() << " failed: " << cudaGetErrorString(e);
      std::abort();
    }
  }
  if (any_on_device) {
    // The event marks version N+1 complete; the writer lock is held until
    // it has, so a reader never sees the copies half done.
    absl::Status copied =
        cuda::EnqueueDeviceCopies(device_copies, commit_stream, commit_event.get());
    if (copied.ok()) copied = commit_event->Wait();
    if (!copied.ok()) {
      REFIT_LOG(ERROR) << "device commit failed: " << std::string(copied.message());
      std::abort();
    }
  }
#endif
  version = set_version > 0 ? set_version : NextVersionLocked();
  fingerprint = ComputeFingerprint(hashes);
  host_arena->EndWrite(version, fingerprint, refit_id);
  last_commit = absl::Now();
  stats.pause = last_commit - start;
  stats.version = version;
  stats.fingerprint = fingerprint;
  return stats;
}

namespace {

class HostRestoreTarget : public RestoreTarget {
 public:
  explicit HostRestoreTarget(std::vector<at::Tensor>& kernels) : kernels_(kernels) {}
  char* host_data(int kernel) const override {
    return static_cast<char*>(kernels_[static_cast<size_t>(kernel)].data_ptr());
  }
  absl::Span<char> bounce() const override { return {}; }
  absl::Status Upload(int kernel, int64_t, const char*, int64_t) const override {
    return absl::InternalError(absl::StrCat("upload of kernel ", kernel, " to a host store"));
  }

 private:
  std::vector<at::Tensor>& kernels_;
};

#ifdef REFIT_WITH_CUDA
// Bounded: a few pieces of a kernel at a time, never the whole model.
constexpr int64_t kRestoreBounceBytes = int64_t{16} << 20;

class DeviceRestoreTarget : public RestoreTarget {
 public:
  DeviceRestoreTarget(std::vector<at::Tensor>& kernels, char* bounce, int64_t bounce_bytes)
      : kernels_(kernels), bounce_(bounce), bounce_bytes_(bounce_bytes) {}
  char* host_data(int) const override { return nullptr; }
  absl::Span<char> bounce() const override {
    return absl::MakeSpan(bounce_, static_cast<size_t>(bounce_bytes_));
  }
  absl::Status Upload(int kernel, int64_t offset, const char* src, int64_t n) const override {
    char* dst = static_cast<char*>(kernels_[static_cast<size_t>(kernel)].data_ptr()) + offset;
    cudaError_t error = cudaMemcpy(dst, src, static_cast<size_t>(n), cudaMemcpyHostToDevice);
    if (error != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat("restore upload of kernel ", kernel, ": ", cudaGetErrorString(error)));
    }
    return absl::OkStatus();
  }

 private:
  std::vector<at::Tensor>& kernels_;
  char* bounce_;
  int64_t bounce_bytes_;
};
#endif

}  // namespace

absl::Status ShardStoreImpl::ZeroKernelsLocked() {
#ifdef REFIT_WITH_CUDA
  std::optional<cuda::ScopedCudaDevice> on_device;
  if (device.is_cuda()) {
    on_device.emplace(device.index());
    if (!on_device->status().ok()) return on_device->status();
  }
#endif
  for (size_t i = 0; i < kernels.size(); ++i) {
    const size_t nbytes = static_cast<size_t>(specs[i]->nbytes());
    if (nbytes == 0) continue;
    if (kernels[i].is_cpu()) {
      std::memset(kernels[i].data_ptr(), 0, nbytes);
      continue;
    }
#ifdef REFIT_WITH_CUDA
    if (cudaError_t e = cudaMemset(kernels[i].data_ptr(), 0, nbytes); e != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat("zeroing ", specs[i]->name, ": ", cudaGetErrorString(e)));
    }
#else
    return absl::InternalError(absl::StrCat("zeroing ", specs[i]->name, " on ", device.str(),
                                            " (built without REFIT_WITH_CUDA)"));
#endif
  }
#ifdef REFIT_WITH_CUDA
  if (device.is_cuda()) {
    if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
      return absl::InternalError(absl::StrCat("zeroing the kernels: ", cudaGetErrorString(e)));
    }
  }
#endif
  return absl::OkStatus();
}

absl::StatusOr<CommitStats> ShardStoreImpl::RestoreInPlace(uint64_t set_version,
                                                           RefitSlot::RestoreFill fill) {
  absl::MutexLock lock(&mu);
  const absl::Time start = absl::Now();
  host_arena->BeginWrite();
  absl::StatusOr<std::vector<uint64_t>> filled;
  if (device.is_cpu()) {
    filled = fill(HostRestoreTarget(kernels));
  } else {
#ifdef REFIT_WITH_CUDA
    const int64_t bounce_bytes =
        std::max<int64_t>(1, std::min(kRestoreBounceBytes, layout.kernel_bytes()));
    int previous = -1;
    if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
    void* bounce = nullptr;
    cudaError_t error = cudaSetDevice(device.index());
    if (error == cudaSuccess)
      error = cudaHostAlloc(&bounce, static_cast<size_t>(bounce_bytes), cudaHostAllocDefault);
    if (error != cudaSuccess) {
      if (previous >= 0) cudaSetDevice(previous);
      host_arena->EndWrite(version);  // nothing written
      return absl::InternalError(absl::StrCat("restore bounce buffer of ", bounce_bytes,
                                              " bytes: ", cudaGetErrorString(error)));
    }
    filled = fill(DeviceRestoreTarget(kernels, static_cast<char*>(bounce), bounce_bytes));
    cudaFreeHost(bounce);
    if (previous >= 0) cudaSetDevice(previous);
#else
    host_arena->EndWrite(version);  // nothing written
    return absl::InternalError(
        absl::StrCat("restore into ", device.str(), " (built without REFIT_WITH_CUDA)"));
#endif
  }
  if (filled.ok() && filled->size() != kernels.size()) {
    filled = absl::InternalError(absl::StrCat("restore returned ", filled->size(),
                                              " kernel hashes for ", kernels.size(), " kernels"));
  }
  if (!filled.ok()) {
    // Back to what Create left; `hashes` and the fingerprint never changed.
    if (absl::Status zeroed = ZeroKernelsLocked(); !zeroed.ok()) {
      // Unverified bytes would stay in the live tensors.
      REFIT_LOG(ERROR) << "restore failed and the kernels cannot be zeroed again: "
                       << std::string(zeroed.message());
      std::abort();
    }
    host_arena->EndWrite(version);
    return filled.status();
  }
  hashes = *std::move(filled);
  version = set_version;
  fingerprint = ComputeFingerprint(hashes);
  host_arena->EndWrite(version, fingerprint);
  last_commit = absl::Now();
  CommitStats stats;
  stats.version = version;
  stats.fingerprint = fingerprint;
  stats.pause = last_commit - start;
  stats.bytes_copied = layout.kernel_bytes();
  return stats;
}

#ifdef REFIT_WITH_CUDA
absl::Status ShardStoreImpl::CreateCommitResourcesLocked() {
  const int index = device.index();
  absl::StatusOr<std::unique_ptr<cuda::DeviceEvent>> event = cuda::DeviceEvent::Create(index);
  if (!event.ok()) return event.status();
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  cudaStream_t stream = nullptr;
  cudaError_t error = cudaSetDevice(index);
  // Blocking: ordered after the legacy default stream, where LibTorch zeroed
  // the live tensors and where in-process users of them run by default.
  if (error == cudaSuccess) error = cudaStreamCreateWithFlags(&stream, cudaStreamDefault);
  if (previous >= 0) cudaSetDevice(previous);
  if (error != cudaSuccess) {
    return absl::InternalError(absl::StrCat("creating the commit stream on ", device.str(), ": ",
                                            cudaGetErrorString(error)));
  }
  commit_stream = stream;
  commit_event = *std::move(event);
  return absl::OkStatus();
}
#endif

ShardStoreImpl::~ShardStoreImpl() {
#ifdef REFIT_WITH_CUDA
  absl::MutexLock lock(&mu);
  commit_event.reset();
  if (commit_stream != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(commit_stream));
#endif
}

ShardStore::ShardStore(std::shared_ptr<const ModelLayout> layout, ShardStoreOptions options)
    : layout_(std::move(layout)),
      options_(std::move(options)),
      scale_hints_(std::make_unique<ScaleHints>()) {}

ShardStore::~ShardStore() = default;

absl::StatusOr<std::unique_ptr<ShardStore>> ShardStore::Create(
    std::shared_ptr<const ModelLayout> layout, ShardStoreOptions options) {
  if (layout == nullptr) return absl::InvalidArgumentError("ShardStore needs a layout");
  absl::StatusOr<c10::Device> device = ParseDevice(options.device);
  if (!device.ok()) return device.status();
  if (device->is_cuda()) {
#ifdef REFIT_WITH_CUDA
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
#else
    int count = 0;
#endif
    if (device->index() >= count) {
      return absl::UnavailableError(absl::StrCat("device ", device->str(),
                                                 " is not available: this process sees ", count,
                                                 " CUDA device(s)",
#ifdef REFIT_WITH_CUDA
                                                 ""
#else
                                                 " (built without REFIT_WITH_CUDA)"
#endif
                                                 ));
    }
  }
  options.device = device->str();
  std::unique_ptr<ShardStore> store(new ShardStore(layout, options));
  store->impl_ = std::make_unique<ShardStoreImpl>(layout, *device);
  store->impl_->prefault_host = options.prefault_host;
  absl::Status allocated = store->impl_->Allocate();
  if (!allocated.ok()) return allocated;
  return store;
}

bool ShardStore::on_gpu() const { return impl_->device.is_cuda(); }

int ShardStore::device_index() const {
  return impl_->device.is_cuda() ? static_cast<int>(impl_->device.index()) : -1;
}

uint64_t ShardStore::version() const {
  absl::ReaderMutexLock lock(&impl_->mu);
  return impl_->version;
}

std::string ShardStore::fingerprint() const {
  absl::ReaderMutexLock lock(&impl_->mu);
  return impl_->fingerprint;
}

absl::Time ShardStore::last_commit_time() const {
  absl::ReaderMutexLock lock(&impl_->mu);
  return impl_->last_commit;
}

LiveVersion ShardStore::live_version() const {
  absl::ReaderMutexLock lock(&impl_->mu);
  return LiveVersion{impl_->version, impl_->fingerprint, impl_->last_commit};
}

std::vector<KernelView> ShardStore::Kernels() const {
  std::vector<KernelView> views;
  views.reserve(impl_->specs.size());
  for (size_t i = 0; i < impl_->specs.size(); ++i) {
    KernelView view;
    view.spec = impl_->specs[i];
    view.layer = impl_->kernel_layer[i];
    view.data = impl_->kernels[i].data_ptr();
    view.nbytes = impl_->specs[i]->nbytes();
    view.arena_offset = impl_->arena_offsets[i];
    views.push_back(view);
  }
  return views;
}

ArenaInfo ShardStore::arena() const {
  ArenaInfo info;
  info.host_bytes = impl_->host_arena->size();
  info.data_bytes = impl_->arena_data_bytes;
  info.on_device = impl_->device.is_cuda();
  info.device_index = device_index();
  if (impl_->device_arena != nullptr) {
    info.ipc_handle = impl_->device_arena->ipc_handle();
    info.device_uuid = impl_->device_arena->device_uuid();
    info.device_vmm = impl_->device_arena->sharing() == DeviceArenaSharing::kVmmFd;
    info.device_mapped_bytes = impl_->device_arena->mapped_bytes();
  }
  info.layout_hash = impl_->layout_hash;
  info.sealed = impl_->host_arena->sealed();
  return info;
}

absl::StatusOr<int> ShardStore::OpenArenaReadOnly() const {
  return impl_->host_arena->OpenReadOnly();
}

absl::StatusOr<int> ShardStore::ExportDeviceArenaFd() const {
  if (impl_->device_arena == nullptr) {
    return absl::FailedPreconditionError("the store has no device arena to export");
  }
  return impl_->device_arena->ExportFd();
}

void ShardStore::SetCommitCoordinator(CommitCoordinator* coordinator) {
  coordinator_.store(coordinator, std::memory_order_release);
}

void ShardStore::CancelCommitWait(absl::string_view refit_id, absl::string_view reason) {
  CommitCoordinator* coordinator = coordinator_.load(std::memory_order_acquire);
  if (coordinator != nullptr) coordinator->CancelWait(refit_id, reason);
}

void ShardStore::CancelLinkedCommitWait(absl::string_view refit_id, absl::string_view reason) {
  CommitCoordinator* coordinator = coordinator_.load(std::memory_order_acquire);
  if (coordinator != nullptr) coordinator->CancelLinkedWait(refit_id, reason);
}

void ShardStore::CloseCommits(absl::string_view reason) {
  CommitCoordinator* coordinator = coordinator_.load(std::memory_order_acquire);
  if (coordinator != nullptr) coordinator->Close(reason);
}

absl::Status ShardStore::ReadKernel(absl::string_view name, std::string* out,
                                    uint64_t* version) const {
  auto it = impl_->kernel_index.find(std::string(name));
  if (it == impl_->kernel_index.end()) {
    return absl::NotFoundError(absl::StrCat("no kernel tensor named ", QuoteText(name)));
  }
  absl::ReaderMutexLock lock(&impl_->mu);
  const at::Tensor& live = impl_->kernels[it->second];
  size_t nbytes = static_cast<size_t>(impl_->specs[it->second]->nbytes());
  out->resize(nbytes);
  try {
    if (live.is_cpu()) {
      std::memcpy(out->data(), live.data_ptr(), nbytes);
    } else {
      at::Tensor host = live.cpu();
      std::memcpy(out->data(), host.data_ptr(), nbytes);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("reading ", name, ": ", e.what_without_backtrace()));
  }
  if (version != nullptr) *version = impl_->version;
  return absl::OkStatus();
}

absl::Status ShardStore::ReadKernelRange(absl::string_view name, int64_t offset, int64_t length,
                                         std::string* out, uint64_t* version,
                                         std::string* fingerprint) const {
  auto it = impl_->kernel_index.find(std::string(name));
  if (it == impl_->kernel_index.end()) {
    return absl::NotFoundError(absl::StrCat("no kernel tensor named \"", name, "\""));
  }
  const int64_t nbytes = impl_->specs[it->second]->nbytes();
  if (offset < 0 || offset > nbytes) {
    return absl::OutOfRangeError(absl::StrCat("kernel tensor \"", name, "\" has ", nbytes,
                                              " bytes; offset ", offset, " is past its end"));
  }
  const int64_t n = std::max<int64_t>(0, std::min(length, nbytes - offset));
  absl::ReaderMutexLock lock(&impl_->mu);
  out->resize(static_cast<size_t>(n));
  if (n > 0) {
    const at::Tensor& live = impl_->kernels[it->second];
    try {
      if (live.is_cpu()) {
        std::memcpy(out->data(), static_cast<const uint8_t*>(live.data_ptr()) + offset,
                    static_cast<size_t>(n));
      } else {
        at::Tensor host = live.flatten().view(at::kByte).narrow(0, offset, n).cpu();
        std::memcpy(out->data(), host.data_ptr(), static_cast<size_t>(n));
      }
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("reading ", name, ": ", e.what_without_backtrace()));
    }
  }
  if (version != nullptr) *version = impl_->version;
  if (fingerprint != nullptr) *fingerprint = impl_->fingerprint;
  return absl::OkStatus();
}

void ShardStore::WithReaderLock(absl::FunctionRef<void(uint64_t)> fn) const {
  absl::ReaderMutexLock lock(&impl_->mu);
  fn(impl_->version);
}

absl::StatusOr<ShardStore::KernelCopy> ShardStore::CopyKernels(absl::Span<char> out) const {
  if (static_cast<int64_t>(out.size()) != layout_->kernel_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("kernel copy buffer of ", out.size(),
                                                   " bytes; the kernels take ",
                                                   layout_->kernel_bytes()));
  }
  KernelCopy copy;
  absl::ReaderMutexLock lock(&impl_->mu);
  size_t offset = 0;
  for (size_t i = 0; i < impl_->kernels.size(); ++i) {
    const size_t nbytes = static_cast<size_t>(impl_->specs[i]->nbytes());
    if (nbytes == 0) continue;
    const at::Tensor& live = impl_->kernels[i];
    try {
      if (live.is_cpu()) {
        std::memcpy(out.data() + offset, live.data_ptr(), nbytes);
      } else {
        at::Tensor host = at::from_blob(out.data() + offset, live.sizes(),
                                        at::TensorOptions().dtype(live.scalar_type()));
        host.copy_(live);
      }
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("copying ", impl_->specs[i]->name,
                                              " to host memory: ", e.what_without_backtrace()));
    }
    offset += nbytes;
  }
  copy.version = impl_->version;
  copy.fingerprint = impl_->fingerprint;
  copy.hashes = impl_->hashes;
  copy.commit_time = impl_->last_commit;
  return copy;
}

void ShardStore::SetCommitGuard(CommitGuard guard) { commit_guard_ = std::move(guard); }

void ShardStore::SetNextVersionFloor(uint64_t version) {
  absl::MutexLock lock(&impl_->mu);
  impl_->next_version_floor = std::max(impl_->next_version_floor, version);
}

absl::StatusOr<RefitSlot> ShardStore::AcquireRefitSlot(absl::string_view refit_id) {
  absl::MutexLock lock(&session_mu_);
  if (!active_session_.empty()) {
    return absl::AbortedError(absl::StrCat("model group \"", options_.group,
                                           "\" already has an active refit \"", active_session_,
                                           "\"; wait for it or abort it"));
  }
  active_session_ = std::string(refit_id);
  return RefitSlot(this, std::string(refit_id));
}

void ShardStore::ReleaseSlot(absl::string_view refit_id) {
  absl::MutexLock lock(&session_mu_);
  if (active_session_ == refit_id) active_session_.clear();
}

void ShardStore::ReleaseSlotAndPublish(absl::string_view refit_id, std::vector<StoreEvent> events) {
  absl::MutexLock publish(&publish_mu_);
  ReleaseSlot(refit_id);
  for (StoreEvent& event : events) PublishLocked(std::move(event));
}

RefitSlot::RefitSlot(RefitSlot&& other) noexcept
    : store_(std::exchange(other.store_, nullptr)), refit_id_(std::move(other.refit_id_)) {}

RefitSlot& RefitSlot::operator=(RefitSlot&& other) noexcept {
  if (this != &other) {
    Release();
    store_ = std::exchange(other.store_, nullptr);
    refit_id_ = std::move(other.refit_id_);
  }
  return *this;
}

RefitSlot::~RefitSlot() { Release(); }

void RefitSlot::Release() {
  if (store_ != nullptr) std::exchange(store_, nullptr)->ReleaseSlot(refit_id_);
}

void RefitSlot::ReleaseAndPublish(std::vector<StoreEvent> events) {
  if (store_ != nullptr)
    std::exchange(store_, nullptr)->ReleaseSlotAndPublish(refit_id_, std::move(events));
}

void RefitSlot::Publish(StoreEvent event) const {
  if (store_ != nullptr) store_->Publish(std::move(event));
}

absl::StatusOr<CommitStats> RefitSlot::Commit(const std::vector<StagedKernel>& staged) const {
  if (store_ == nullptr) return absl::InternalError("commit through a released refit slot");
  if (store_->commit_guard_) {
    uint64_t next = 0;
    {
      absl::ReaderMutexLock lock(&store_->impl_->mu);
      next = store_->impl_->NextVersionLocked();
    }
    // Only the slot's holder commits: `next` is what CommitStaged publishes.
    if (absl::Status s = store_->commit_guard_(next); !s.ok()) return s;
  }
  CommitCoordinator* coordinator = store_->coordinator_.load(std::memory_order_acquire);
  if (coordinator == nullptr) return store_->impl_->CommitStaged(staged, 0, refit_id_);
  uint64_t next = 0;
  {
    absl::ReaderMutexLock lock(&store_->impl_->mu);
    next = store_->impl_->NextVersionLocked();
  }
  if (absl::Status s = coordinator->BeforeCommit(refit_id_, next); !s.ok()) return s;
  absl::StatusOr<CommitStats> stats = store_->impl_->CommitStaged(staged, 0, refit_id_);
  coordinator->AfterCommit(refit_id_, stats);
  return stats;
}

absl::StatusOr<std::vector<CommitStats>> RefitSlot::CommitLinked(
    absl::Span<const LinkedPart> parts) {
  if (parts.empty()) return absl::InvalidArgumentError("linked commit of no stores");
  // The order locks are taken in: by group name.
  std::vector<size_t> order(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    order[i] = i;
    if (parts[i].slot == nullptr || parts[i].slot->store_ == nullptr ||
        parts[i].staged == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("linked commit: part ", i, " has no refit slot or no staged kernels"));
    }
  }
  auto store_of = [&](size_t i) { return parts[i].slot->store_; };
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return store_of(a)->group() < store_of(b)->group(); });
  for (size_t k = 1; k < order.size(); ++k) {
    if (store_of(order[k]) == store_of(order[k - 1]) ||
        store_of(order[k])->group() == store_of(order[k - 1])->group()) {
      return absl::InvalidArgumentError(absl::StrCat("linked commit names model group \"",
                                                     store_of(order[k])->group(), "\" twice"));
    }
  }
  for (size_t i : order) {
    ShardStore* store = store_of(i);
    if (absl::Status checked = store->impl_->CheckStaged(*parts[i].staged); !checked.ok()) {
      return absl::Status(checked.code(), absl::StrCat("model group \"", store->group(),
                                                       "\": ", checked.message()));
    }
    if (!store->commit_guard_) continue;
    uint64_t next = 0;
    {
      absl::ReaderMutexLock lock(&store->impl_->mu);
      next = store->impl_->NextVersionLocked();
    }
    if (absl::Status s = store->commit_guard_(next); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("model group \"", store->group(), "\": ", s.message()));
    }
  }
  // Engines attached to any of the stores quiesce before the one copy: the
  // engines of every store are asked first, then each store's wait ends
  // (one --engine-quiesce-timeout in all), so that no store's engines stay
  // paused while another's are only being asked.
  auto coordinator_of = [&](size_t i) {
    return store_of(i)->coordinator_.load(std::memory_order_acquire);
  };
  std::vector<uint64_t> next(parts.size(), 0);
  std::vector<size_t> owed;  // asked: owed an AfterCommit
  // Ends the linked commit before its copy: the reason names the store whose
  // coordinator refused (engine ids are per group), for the trainer and for
  // the other groups' engines, which are told it as their Aborted.
  auto refuse = [&](size_t i, const absl::Status& s) {
    const std::string message =
        absl::StrCat("model group \"", store_of(i)->group(), "\": ", s.message());
    const absl::Status named =
        IsNotQuiesced(s) ? NotQuiescedError(message) : absl::Status(s.code(), message);
    for (size_t j : owed) {
      if (j != i) coordinator_of(j)->AfterCommit(parts[j].slot->refit_id(), named);
    }
    return named;
  };
  for (size_t i : order) {
    CommitCoordinator* coordinator = coordinator_of(i);
    if (coordinator == nullptr) continue;
    {
      absl::ReaderMutexLock lock(&store_of(i)->impl_->mu);
      next[i] = store_of(i)->impl_->NextVersionLocked();
    }
    if (absl::Status s = coordinator->AskCommit(parts[i].slot->refit_id(), next[i]); !s.ok()) {
      return refuse(i, s);
    }
    owed.push_back(i);
  }
  // A BeforeCommit that fails has ended its own store's ask. Until every
  // store's engines have quiesced at once, an engine that attached to a
  // store already waited for (or a cancel) sends the waits round again,
  // within the same deadline.
  for (bool ready = false; !ready;) {
    for (size_t i : owed) {
      absl::Status s = coordinator_of(i)->BeforeCommit(parts[i].slot->refit_id(), next[i]);
      if (!s.ok()) return refuse(i, s);
    }
    ready = true;
    for (size_t i : owed) {
      if (!coordinator_of(i)->ReadyToCopy(parts[i].slot->refit_id())) ready = false;
    }
  }
  for (size_t i : owed) coordinator_of(i)->StartCopy(parts[i].slot->refit_id());
  absl::StatusOr<std::vector<CommitStats>> stats = CommitLinkedLocked(parts, order);
  for (size_t j : owed) {
    coordinator_of(j)->AfterCommit(
        parts[j].slot->refit_id(),
        stats.ok() ? absl::StatusOr<CommitStats>((*stats)[j]) : stats.status());
  }
  return stats;
}

absl::StatusOr<std::vector<CommitStats>> RefitSlot::CommitLinkedLocked(
    absl::Span<const LinkedPart> parts, const std::vector<size_t>& order) {
  // A variable number of locks: beyond what the static analysis follows.
  for (size_t i : order) parts[i].slot->store_->impl_->mu.Lock();
  absl::Status prepared = absl::OkStatus();
  for (size_t i : order) {
    ShardStoreImpl* impl = parts[i].slot->store_->impl_.get();
    prepared = impl->PrepareCommitLocked(*parts[i].staged);
    if (!prepared.ok()) {
      prepared = absl::Status(prepared.code(),
                              absl::StrCat("model group \"", parts[i].slot->store_->group(),
                                           "\": ", prepared.message()));
      break;
    }
  }
  std::vector<CommitStats> stats(parts.size());
  if (prepared.ok()) {
    for (size_t i : order) {
      stats[i] = parts[i].slot->store_->impl_->CopyStagedLocked(*parts[i].staged, 0,
                                                                parts[i].slot->refit_id());
    }
  }
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    parts[*it].slot->store_->impl_->mu.Unlock();
  }
  if (!prepared.ok()) return prepared;
  return stats;
}

absl::StatusOr<CommitStats> RefitSlot::Restore(const std::vector<StagedKernel>& staged,
                                               uint64_t version) const {
  if (store_ == nullptr) return absl::InternalError("restore through a released refit slot");
  if (version == 0) return absl::FailedPreconditionError("restore of version 0");
  if (uint64_t live = store_->version(); live != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("restore into a store that already serves version ", live));
  }
  return store_->impl_->CommitStaged(staged, version);
}

absl::StatusOr<CommitStats> RefitSlot::RestoreInPlace(uint64_t version, RestoreFill fill) const {
  if (store_ == nullptr) return absl::InternalError("restore through a released refit slot");
  if (version == 0) return absl::FailedPreconditionError("restore of version 0");
  if (uint64_t live = store_->version(); live != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("restore into a store that already serves version ", live));
  }
  return store_->impl_->RestoreInPlace(version, fill);
}

std::string ShardStore::active_session() const {
  absl::MutexLock lock(&session_mu_);
  return active_session_;
}

int ShardStore::AddListener(Listener listener) {
  absl::MutexLock lock(&listeners_mu_);
  int id = next_listener_id_++;
  listeners_.emplace_back(id, std::move(listener));
  return id;
}

void ShardStore::RemoveListener(int id) {
  absl::MutexLock lock(&listeners_mu_);
  for (auto it = listeners_.begin(); it != listeners_.end(); ++it) {
    if (it->first == id) {
      listeners_.erase(it);
      return;
    }
  }
}

void ShardStore::Publish(StoreEvent event) {
  absl::MutexLock publish(&publish_mu_);
  PublishLocked(std::move(event));
}

void ShardStore::WithEventsHeld(absl::FunctionRef<void()> fn) {
  absl::MutexLock publish(&publish_mu_);
  fn();
}

void ShardStore::PublishLocked(StoreEvent event) {
  event.group = options_.group;
  if (event.time == absl::Time()) event.time = absl::Now();
  std::vector<Listener> copy;
  {
    absl::MutexLock lock(&listeners_mu_);
    for (const auto& [id, listener] : listeners_) copy.push_back(listener);
  }
  for (const Listener& listener : copy) listener(event);
}

}  // namespace refit::core
