#include "core/arena.h"

#include <fcntl.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <new>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/parallel.h"
#include "core/snapshot.h"
#include "core/xxh3.h"

#ifdef REFIT_WITH_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>
#endif
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

namespace refit::core {

absl::StatusOr<std::unique_ptr<HostArena>> HostArena::Create(absl::string_view name,
                                                             int64_t data_bytes,
                                                             uint64_t layout_hash, bool populate) {
  if (data_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("arena of ", data_bytes, " bytes"));
  }
  std::unique_ptr<HostArena> arena(new HostArena());
  arena->data_bytes_ = data_bytes;
  const std::string memfd_name = absl::StrCat("refitd:", name);
  arena->fd_ = ::memfd_create(memfd_name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (arena->fd_ < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("memfd_create for the arena of ", name, ": ", std::strerror(errno)));
  }
  const size_t length = static_cast<size_t>(arena->size());
  if (::ftruncate(arena->fd_, static_cast<off_t>(length)) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot size the arena of ", name, " to ",
                                                     length, " bytes: ", std::strerror(errno)));
  }
  const int flags = MAP_SHARED | (populate ? MAP_POPULATE : 0);
  void* p = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, flags, arena->fd_, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot map the arena of ", name, " (", length,
                                                     " bytes): ", std::strerror(errno)));
  }
  arena->base_ = static_cast<char*>(p);
  // Shrinking would make every mapping fault (SIGBUS); a new writable
  // mapping is what a read-only descriptor must never give. Our own mapping
  // exists already and stays writable.
  arena->sealed_ =
      ::fcntl(arena->fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE) == 0;
  if (!arena->sealed_) ::fcntl(arena->fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
  arena->read_only_fd_ =
      ::open(absl::StrCat("/proc/self/fd/", arena->fd_).c_str(), O_RDONLY | O_CLOEXEC);
  if (arena->read_only_fd_ < 0) {
    return absl::InternalError(
        absl::StrCat("cannot open the arena of ", name, " read-only: ", std::strerror(errno)));
  }
  ArenaHeader* h = new (arena->base_) ArenaHeader();
  std::memcpy(h->magic, kArenaMagic, sizeof(kArenaMagic));
  h->format = kArenaFormat;
  h->header_bytes = static_cast<uint32_t>(kArenaHeaderBytes);
  h->data_offset = static_cast<uint64_t>(kArenaDataOffset);
  h->data_bytes = static_cast<uint64_t>(data_bytes);
  h->layout_hash = layout_hash;
  h->seq.store(0, std::memory_order_relaxed);
  h->committed_unix_ns.store(0, std::memory_order_relaxed);
  h->version.store(0, std::memory_order_release);
  return arena;
}

HostArena::~HostArena() {
  if (base_ != nullptr) ::munmap(base_, static_cast<size_t>(size()));
  if (read_only_fd_ >= 0) ::close(read_only_fd_);
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<int> HostArena::OpenReadOnly() const {
  const int fd = ::fcntl(read_only_fd_, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat("cannot reopen the arena read-only: ", std::strerror(errno)));
  }
  return fd;
}

void HostArena::BeginWrite() {
  ArenaHeader* h = mutable_header();
  // The odd seq must be visible before any byte of the new version.
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer does not model fences (GCC refuses them under
  // -fsanitize=thread); the readers are other processes, which it cannot
  // see anyway.
  h->seq.fetch_add(1, std::memory_order_seq_cst);
#else
  h->seq.fetch_add(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
#endif
}

void StreamingCopy(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  if (n < 4096) {
    std::memcpy(d, s, n);
    return;
  }
  // Up to the first 64-byte line of the destination through the cache, then
  // whole lines streamed (four 16-byte stores fill one write-combining
  // buffer), then the tail. SSE2 is part of x86-64; wider stores were no
  // faster (the copy is bound by memory bandwidth).
  const size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  const size_t body = n & ~static_cast<size_t>(63);
  for (size_t i = 0; i < body; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + body, s + body, n - body);
#else
  std::memcpy(dst, src, n);
#endif
}

void ParallelStreamingCopy(const std::vector<HostCopy>& copies, int threads,
                           size_t min_bytes_per_thread) {
  size_t total = 0;
  for (const HostCopy& c : copies) total += c.n;
  const int workers = static_cast<int>(std::max<size_t>(
      1, std::min<size_t>(threads, total / std::max<size_t>(min_bytes_per_thread, 64))));
  // Worker w copies bytes [bound(w), bound(w + 1)) of the copies laid end to
  // end; boundaries on 64-byte multiples of that sequence.
  auto bound = [&](int w) -> size_t {
    if (w >= workers) return total;
    return static_cast<size_t>(static_cast<unsigned __int128>(total) * w / workers) & ~size_t{63};
  };
  RunInParallel(workers, [&](int w) {
    const size_t begin = bound(w), end = bound(w + 1);
    size_t at = 0;  // where the current copy starts in the sequence
    for (const HostCopy& c : copies) {
      const size_t from = std::max(begin, at), to = std::min(end, at + c.n);
      if (from < to) {
        StreamingCopy(static_cast<char*>(c.dst) + (from - at),
                      static_cast<const char*>(c.src) + (from - at), to - from);
      }
      at += c.n;
      if (at >= end) break;
    }
#if defined(__x86_64__)
    _mm_sfence();
#endif
  });
}

namespace {

// `text` NUL-padded into `field`, or an empty field when it does not fit
// (with its terminating NUL): a reader never sees a truncated value.
template <size_t N>
void SetTextField(char (&field)[N], absl::string_view text) {
  std::memset(field, 0, N);
  if (!text.empty() && text.size() < N) std::memcpy(field, text.data(), text.size());
}

}  // namespace

void HostArena::EndWrite(uint64_t version, absl::string_view fingerprint,
                         absl::string_view refit_id) {
#if defined(__x86_64__)
  // Streaming stores are not ordered by the release below.
  _mm_sfence();
#endif
  ArenaHeader* h = mutable_header();
  if (h->version.load(std::memory_order_relaxed) != version) {
    // An engine measures how long after the copy its Committed came, and
    // how old the bytes it serves are, without asking the daemon.
    struct timespec now;
    ::clock_gettime(CLOCK_REALTIME, &now);
    h->committed_unix_ns.store(
        static_cast<uint64_t>(now.tv_sec) * 1000000000u + static_cast<uint64_t>(now.tv_nsec),
        std::memory_order_relaxed);
    // Still inside the odd seq: the release below publishes these with the
    // version.
    SetTextField(h->fingerprint, fingerprint);
    SetTextField(h->refit_id, refit_id);
  }
  h->version.store(version, std::memory_order_relaxed);
  h->seq.fetch_add(1, std::memory_order_release);
#ifdef __linux__
  // Engines blocked in a safe point wait on seq's low 32 bits (a shared
  // futex: the key is the memfd's page, the same in every mapping), so they
  // resume the moment the copy ends rather than when Committed reaches them.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h->seq), FUTEX_WAKE, INT_MAX, nullptr, nullptr,
            0);
#endif
}

namespace {

std::atomic<int> g_default_sharing{static_cast<int>(DeviceArenaSharing::kCudaIpc)};

#ifdef REFIT_WITH_CUDA
// The driver's virtual-memory API, through the runtime's driver entry points
// (the daemon does not link libcuda, so that it starts where there is no
// driver). Resolved once; a missing one leaves the table unusable.
struct VmmApi {
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*device_get_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*,
                          CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                     unsigned long long) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                              unsigned long long) = nullptr;
  CUresult (*address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                  unsigned long long) = nullptr;
  CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*export_handle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                            unsigned long long) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  bool ok = false;
};

const VmmApi& Vmm() {
  static const VmmApi api = [] {
    VmmApi a;
    bool all = true;
    auto get = [&](const char* name, auto& fn) {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult found{};
      if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) !=
              cudaSuccess ||
          found != cudaDriverEntryPointSuccess || p == nullptr) {
        all = false;
        return;
      }
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    get("cuDeviceGet", a.device_get);
    get("cuDeviceGetAttribute", a.device_get_attribute);
    get("cuMemGetAllocationGranularity", a.granularity);
    get("cuMemCreate", a.create);
    get("cuMemRelease", a.release);
    get("cuMemAddressReserve", a.address_reserve);
    get("cuMemAddressFree", a.address_free);
    get("cuMemMap", a.map);
    get("cuMemUnmap", a.unmap);
    get("cuMemSetAccess", a.set_access);
    get("cuMemExportToShareableHandle", a.export_handle);
    get("cuCtxGetCurrent", a.ctx_get_current);
    get("cuCtxSetCurrent", a.ctx_set_current);
    a.ok = all;
    return a;
  }();
  return api;
}

std::string DriverError(const char* call, CUresult r) {
  return absl::StrCat(call, " failed (CUDA driver error ", static_cast<int>(r), ")");
}

// Makes the device's primary context current on this thread for the scope,
// then puts back the context the thread had (none, on a thread that never
// used CUDA: restoring a device instead would create device 0's context
// there). A vmm arena's later driver calls (the export on the descriptor
// server's thread, the release in a destructor) may run on such threads.
class CurrentDevice {
 public:
  explicit CurrentDevice(int device) {
    const VmmApi& api = Vmm();
    saved_ = api.ok && api.ctx_get_current(&previous_) == CUDA_SUCCESS;
    if (cudaSetDevice(device) != cudaSuccess) (void)cudaGetLastError();
  }
  ~CurrentDevice() {
    if (saved_) Vmm().ctx_set_current(previous_);
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  CUcontext previous_ = nullptr;
  bool saved_ = false;
};
#endif  // REFIT_WITH_CUDA

}  // namespace

absl::string_view DeviceArenaSharingName(DeviceArenaSharing sharing) {
  return sharing == DeviceArenaSharing::kVmmFd ? "vmm" : "ipc";
}

absl::StatusOr<DeviceArenaSharing> ParseDeviceArenaSharing(absl::string_view name) {
  if (name == "ipc") return DeviceArenaSharing::kCudaIpc;
  if (name == "vmm") return DeviceArenaSharing::kVmmFd;
  return absl::InvalidArgumentError(
      absl::StrCat("device arena sharing must be ipc or vmm, got \"", name, "\""));
}

void DeviceArena::SetDefaultSharing(DeviceArenaSharing sharing) {
  g_default_sharing.store(static_cast<int>(sharing), std::memory_order_relaxed);
}

DeviceArenaSharing DeviceArena::default_sharing() {
  return static_cast<DeviceArenaSharing>(g_default_sharing.load(std::memory_order_relaxed));
}

absl::StatusOr<std::unique_ptr<DeviceArena>> DeviceArena::Create(int device_index,
                                                                 int64_t data_bytes) {
#ifdef REFIT_WITH_CUDA
  std::unique_ptr<DeviceArena> arena(new DeviceArena());
  arena->device_index_ = device_index;
  arena->data_bytes_ = data_bytes;
  arena->mapped_bytes_ = std::max<int64_t>(data_bytes, 1);
  arena->sharing_ = default_sharing();
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  cudaError_t error = cudaSetDevice(device_index);
  std::string failure;  // a driver call's error, when one failed
  bool unsupported = false;
  if (error == cudaSuccess && arena->sharing_ == DeviceArenaSharing::kVmmFd) {
    // cudaSetDevice made the device's primary context current, which the
    // driver calls below act in.
    const VmmApi& api = Vmm();
    CUdevice dev = 0;
    int vmm = 0, posix_fd = 0;
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device_index;
    size_t granularity = 0;
    CUresult r = CUDA_SUCCESS;
    if (!api.ok) {
      failure = "the CUDA driver lacks the virtual memory management API";
      unsupported = true;
    } else if ((r = api.device_get(&dev, device_index)) != CUDA_SUCCESS) {
      failure = DriverError("cuDeviceGet", r);
    } else if (api.device_get_attribute(&vmm,
                                        CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                        dev) != CUDA_SUCCESS ||
               api.device_get_attribute(
                   &posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                   dev) != CUDA_SUCCESS ||
               vmm == 0 || posix_fd == 0) {
      failure =
          "the device does not support virtual memory allocations exported as POSIX "
          "file descriptors";
      unsupported = true;
    } else if ((r = api.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)) !=
               CUDA_SUCCESS) {
      failure = DriverError("cuMemGetAllocationGranularity", r);
    } else {
      const int64_t g = static_cast<int64_t>(std::max<size_t>(granularity, 1));
      arena->mapped_bytes_ = (std::max<int64_t>(data_bytes, 1) + g - 1) / g * g;
      const size_t size = static_cast<size_t>(arena->mapped_bytes_);
      CUmemGenericAllocationHandle handle = 0;
      CUdeviceptr ptr = 0;
      CUmemAccessDesc access{};
      access.location = prop.location;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      if ((r = api.create(&handle, size, &prop, 0)) != CUDA_SUCCESS) {
        failure = DriverError("cuMemCreate", r);
        if (r == CUDA_ERROR_OUT_OF_MEMORY) error = cudaErrorMemoryAllocation;
      } else if ((r = api.address_reserve(&ptr, size, static_cast<size_t>(g), 0, 0)) !=
                 CUDA_SUCCESS) {
        failure = DriverError("cuMemAddressReserve", r);
        api.release(handle);
      } else if ((r = api.map(ptr, size, 0, handle, 0)) != CUDA_SUCCESS) {
        failure = DriverError("cuMemMap", r);
        api.address_free(ptr, size);
        api.release(handle);
      } else if ((r = api.set_access(ptr, size, &access, 1)) != CUDA_SUCCESS) {
        failure = DriverError("cuMemSetAccess", r);
        api.unmap(ptr, size);
        api.address_free(ptr, size);
        api.release(handle);
      } else {
        arena->vmm_handle_ = handle;
        arena->base_ = reinterpret_cast<void*>(ptr);
      }
    }
    if (!failure.empty() && error == cudaSuccess) error = cudaErrorUnknown;
  } else if (error == cudaSuccess) {
    void* p = nullptr;
    error = cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(data_bytes, 1)));
    if (error == cudaSuccess) arena->base_ = p;
  }
  if (error == cudaSuccess) error = cudaMemset(arena->base_, 0, static_cast<size_t>(data_bytes));
  cudaIpcMemHandle_t handle;
  if (error == cudaSuccess && arena->sharing_ == DeviceArenaSharing::kCudaIpc) {
    error = cudaIpcGetMemHandle(&handle, arena->base_);
  }
  if (error == cudaSuccess) error = cudaDeviceSynchronize();
  if (previous >= 0) cudaSetDevice(previous);
  if (error != cudaSuccess) {
    const std::string what =
        absl::StrCat("device arena of ", data_bytes, " bytes on cuda:", device_index, " (",
                     DeviceArenaSharingName(arena->sharing_),
                     "): ", failure.empty() ? std::string(cudaGetErrorString(error)) : failure);
    if (error == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(what);
    if (unsupported) return absl::FailedPreconditionError(what);
    return absl::InternalError(what);
  }
  if (arena->sharing_ == DeviceArenaSharing::kCudaIpc) {
    arena->ipc_handle_.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device_index) == cudaSuccess) {
    arena->device_uuid_.assign(prop.uuid.bytes, sizeof(prop.uuid.bytes));
  }
  return arena;
#else
  (void)device_index;
  (void)data_bytes;
  return absl::UnimplementedError("a device arena needs a build with REFIT_WITH_CUDA");
#endif
}

absl::StatusOr<int> DeviceArena::ExportFd() const {
  if (sharing_ != DeviceArenaSharing::kVmmFd) {
    return absl::FailedPreconditionError(
        "this device arena is shared by CUDA IPC handle, not by file descriptor");
  }
#ifdef REFIT_WITH_CUDA
  const CurrentDevice current(device_index_);
  int fd = -1;
  const CUresult r =
      Vmm().export_handle(&fd, static_cast<CUmemGenericAllocationHandle>(vmm_handle_),
                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (r != CUDA_SUCCESS || fd < 0) {
    return absl::InternalError(DriverError("cuMemExportToShareableHandle", r));
  }
  return fd;
#else
  return absl::UnimplementedError("a device arena needs a build with REFIT_WITH_CUDA");
#endif
}

DeviceArena::~DeviceArena() {
#ifdef REFIT_WITH_CUDA
  if (base_ == nullptr) return;
  if (sharing_ == DeviceArenaSharing::kVmmFd) {
    // Engines that imported the allocation keep its memory until they unmap.
    const CurrentDevice current(device_index_);
    const VmmApi& api = Vmm();
    const CUdeviceptr ptr = reinterpret_cast<CUdeviceptr>(base_);
    const size_t size = static_cast<size_t>(mapped_bytes_);
    api.unmap(ptr, size);
    api.address_free(ptr, size);
    api.release(static_cast<CUmemGenericAllocationHandle>(vmm_handle_));
  } else {
    cudaFree(base_);
  }
#endif
}

namespace {
std::string Hex64(absl::string_view text) {
  return absl::StrFormat("%016x", XXH3_64bits(text.data(), text.size()));
}
}  // namespace

LayoutIdentity IdentifyLayout(const ModelLayout& layout) {
  LayoutIdentity id;
  const ModelConfig& c = layout.config();
  id.architecture = c.arch_name;
  id.tp_rank = layout.parallel().tp_rank;
  id.tp_size = layout.parallel().tp_size;
  id.checkpoint_dtype = std::string(TorchDTypeName(c.dtype));
  id.quantization = std::string(QuantSchemeName(layout.quant()));
  id.quant_config_hash =
      Hex64(absl::StrCat("scheme=", id.quantization, ";fp8=e4m3fn;max=448;block=128x128"));
  std::string tensors;
  for (const LayerSpec& l : layout.layers()) {
    for (const KernelSpec& k : l.kernels) {
      absl::StrAppend(&tensors, k.name, ":", DTypeName(k.dtype), ":");
      for (int64_t d : k.shape) absl::StrAppend(&tensors, d, ",");
      absl::StrAppend(&tensors, ";");
    }
  }
  id.tensors_hash = Hex64(tensors);
  id.checkpoint_id = Hex64(c.ToJson());
  id.fingerprint = LayoutFingerprint(layout);
  return id;
}

absl::string_view TorchDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBool:
      return "bool";
    case DType::kUInt8:
      return "uint8";
    case DType::kInt8:
      return "int8";
    case DType::kInt16:
      return "int16";
    case DType::kUInt16:
      return "uint16";
    case DType::kInt32:
      return "int32";
    case DType::kUInt32:
      return "uint32";
    case DType::kInt64:
      return "int64";
    case DType::kUInt64:
      return "uint64";
    case DType::kFloat8E4M3:
      return "float8_e4m3fn";
    case DType::kFloat8E5M2:
      return "float8_e5m2";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
  }
  return "unknown";
}

}  // namespace refit::core
