#include "core/device_source.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/base/const_init.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

#ifdef REFIT_WITH_CUDA
#include <cuda.h>  // driver API types only: entry points come through the runtime
#include <cuda_runtime_api.h>
#endif

namespace refit::core {

#ifdef REFIT_WITH_CUDA
namespace {

std::string CudaError(cudaError_t error) {
  return absl::StrCat(cudaGetErrorName(error), ": ", cudaGetErrorString(error));
}

// Switches the calling thread to `device` for the scope, and back.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    error_ = cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  cudaError_t error() const { return error_; }

 private:
  int previous_ = -1;
  cudaError_t error_ = cudaSuccess;
};

// cuMemGetAddressRange through the runtime's driver entry points (the
// daemon does not link libcuda, so that it starts where there is no driver).
using GetAddressRangeFn = CUresult (*)(CUdeviceptr* base, size_t* size, CUdeviceptr ptr);

GetAddressRangeFn AddressRangeFn() {
  static GetAddressRangeFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<GetAddressRangeFn>(nullptr);
    }
    return reinterpret_cast<GetAddressRangeFn>(p);
  }();
  return fn;
}

// The ordinal of the visible device whose UUID is `uuid`, or -1. Each
// device's UUID is read once (cudaGetDeviceProperties takes milliseconds, and
// a trainer registers every allocation of every push); a read that failed is
// tried again at the next lookup.
int DeviceOfUuid(absl::string_view uuid, int count) {
  static absl::Mutex mu(absl::kConstInit);
  static std::vector<std::string>* uuids = new std::vector<std::string>();
  absl::MutexLock lock(&mu);
  if (uuids->size() < static_cast<size_t>(count)) uuids->resize(static_cast<size_t>(count));
  for (int d = 0; d < count; ++d) {
    std::string& known = (*uuids)[static_cast<size_t>(d)];
    if (known.empty()) {
      cudaDeviceProp prop{};
      if (cudaGetDeviceProperties(&prop, d) != cudaSuccess) {
        cudaGetLastError();
        continue;
      }
      known.assign(prop.uuid.bytes, sizeof(prop.uuid.bytes));
    }
    if (known == uuid) return d;
  }
  return -1;
}

}  // namespace
#endif  // REFIT_WITH_CUDA

absl::StatusOr<std::unique_ptr<CudaIpcAllocation>> CudaIpcAllocation::Open(
    absl::string_view handle, absl::string_view device_uuid, uint64_t size) {
  if (handle.size() != kHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a CUDA IPC handle is ", kHandleBytes, " bytes (cudaIpcMemHandle_t), got ", handle.size()));
  }
  if (device_uuid.size() != kUuidBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a CUDA device UUID is ", kUuidBytes, " bytes, got ", device_uuid.size()));
  }
#ifdef REFIT_WITH_CUDA
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA IPC regions need a GPU visible to refitd; it has none (",
                     e == cudaSuccess ? std::string("no device") : CudaError(e), ")"));
  }
  const int device = DeviceOfUuid(device_uuid, count);
  if (device < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the trainer's GPU (UUID given) is not one of the ", count,
        " visible to refitd: run both with the same GPUs visible (CUDA_VISIBLE_DEVICES)"));
  }
  std::unique_ptr<CudaIpcAllocation> out(new CudaIpcAllocation());
  out->device_ = device;
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot use cuda:", device, ": ", CudaError(scope.error())));
  }
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), kHandleBytes);
  void* p = nullptr;
  if (cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
      e != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it for the next call
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot open the CUDA IPC handle on cuda:", device, " (", CudaError(e),
        "): it must be cudaIpcGetMemHandle of a live allocation's base, from another process"));
  }
  out->base_ = static_cast<const uint8_t*>(p);
  GetAddressRangeFn range = AddressRangeFn();
  CUdeviceptr base = 0;
  size_t bytes = 0;
  if (range == nullptr || range(&base, &bytes, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) {
    return absl::InternalError("cannot query the size of the opened CUDA allocation");
  }
  // The handle names an allocation's base; what lies before `p` (if the
  // driver maps it inside a larger range) is not the trainer's to offer.
  out->allocation_bytes_ = bytes - (reinterpret_cast<CUdeviceptr>(p) - base);
  if (out->allocation_bytes_ < size) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CUDA allocation is ", out->allocation_bytes_,
                     " bytes, smaller than the region's declared size ", size));
  }
  return out;
#else
  (void)size;
  return absl::UnimplementedError("CUDA IPC regions need a refitd built with CUDA");
#endif
}

CudaIpcAllocation::~CudaIpcAllocation() {
#ifdef REFIT_WITH_CUDA
  if (base_ != nullptr) {
    DeviceScope scope(device_);
    cudaIpcCloseMemHandle(const_cast<uint8_t*>(base_));
  }
#endif
}

absl::Status CudaIpcAllocation::CopyToHost(const uint8_t* src, int64_t n, uint8_t* dst) const {
  if (n <= 0) return absl::OkStatus();
#ifdef REFIT_WITH_CUDA
  DeviceScope scope(device_);
  cudaError_t e = scope.error();
  if (e == cudaSuccess) e = cudaMemcpy(dst, src, static_cast<size_t>(n), cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) {
    return absl::InternalError(absl::StrCat(
        "reading ", n, " bytes of a CUDA IPC region on cuda:", device_, ": ", CudaError(e)));
  }
  return absl::OkStatus();
#else
  (void)src;
  (void)dst;
  return absl::UnimplementedError("CUDA IPC regions need a refitd built with CUDA");
#endif
}

std::unique_ptr<PinnedHostRange> PinnedHostRange::Pin(const void* base, size_t size) {
#ifdef REFIT_WITH_CUDA
  if (base == nullptr || size == 0) return nullptr;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return nullptr;
  }
  // Read-only: the mapping is PROT_READ, and the devices only read it.
  void* p = const_cast<void*>(base);
  if (cudaHostRegister(p, size, cudaHostRegisterPortable | cudaHostRegisterReadOnly) !=
      cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return std::unique_ptr<PinnedHostRange>(new PinnedHostRange(p));
#else
  (void)base;
  (void)size;
  return nullptr;
#endif
}

PinnedHostRange::~PinnedHostRange() {
#ifdef REFIT_WITH_CUDA
  cudaHostUnregister(base_);
#endif
}

}  // namespace refit::core
