// DeviceSource: device memory another process on the host exported and
// refitd opened — a colocated trainer's CUDA tensors, which a refit reads
// device-to-device instead of through host memory (the trainer lane's CUDA
// form: a region registered with a CUDA IPC handle).
//
// Pointers into a DeviceSource are device addresses: the host never
// dereferences them. Host code reads them with CopyToHost; the CUDA layer
// processor copies them on the device (cudaMemcpyDefault: the allocation may
// live on another GPU than the store's).
//
// Lifecycle: a source is owned by its registration (server/region_registry.h);
// chunks and staging that point into it hold that owner (Chunk::keep), so it
// is closed only after the last read. Thread-safe.
#ifndef REFIT_CORE_DEVICE_SOURCE_H_
#define REFIT_CORE_DEVICE_SOURCE_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace refit::core {

class DeviceSource {
 public:
  virtual ~DeviceSource() = default;
  // Copies `n` bytes at device address `src` (inside this source) to host
  // memory `dst` and waits for the copy. Errors: the CUDA error (INTERNAL).
  virtual absl::Status CopyToHost(const uint8_t* src, int64_t n, uint8_t* dst) const = 0;
};

// One CUDA allocation of another process, opened from its IPC handle.
class CudaIpcAllocation final : public DeviceSource {
 public:
  static constexpr size_t kHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)
  static constexpr size_t kUuidBytes = 16;    // sizeof(cudaUUID_t)

  // Opens `handle` (the bytes of a cudaIpcMemHandle_t of an allocation's
  // base) on the visible device whose UUID is `device_uuid`, and checks
  // that the allocation holds `size` bytes from its base, so that no read
  // of an accepted range can fault on the device.
  // Errors: INVALID_ARGUMENT for a handle or UUID of the wrong length, a
  // handle the driver refuses (not an allocation's base, freed, or of this
  // very process), or an allocation smaller than `size`;
  // FAILED_PRECONDITION when no CUDA device is usable or none has that
  // UUID (the daemon's CUDA_VISIBLE_DEVICES hides it); UNIMPLEMENTED in a
  // build without CUDA.
  static absl::StatusOr<std::unique_ptr<CudaIpcAllocation>> Open(absl::string_view handle,
                                                                 absl::string_view device_uuid,
                                                                 uint64_t size);
  ~CudaIpcAllocation() override;
  CudaIpcAllocation(const CudaIpcAllocation&) = delete;
  CudaIpcAllocation& operator=(const CudaIpcAllocation&) = delete;

  // The allocation's base (a device address) and its device ordinal in this
  // process.
  const uint8_t* base() const { return base_; }
  int device() const { return device_; }
  uint64_t allocation_bytes() const { return allocation_bytes_; }

  absl::Status CopyToHost(const uint8_t* src, int64_t n, uint8_t* dst) const override;

 private:
  CudaIpcAllocation() = default;

  const uint8_t* base_ = nullptr;
  int device_ = -1;
  uint64_t allocation_bytes_ = 0;
};

// Host memory page-locked for this process' GPUs (cudaHostRegister,
// read-only): a device copy reads it by DMA, with no bounce through pinned
// staging. For mappings that cannot shrink under the copy (a trainer's
// sealed memfd); unregistered when destroyed, which must happen before the
// memory is unmapped and after every copy from it is done.
class PinnedHostRange {
 public:
  // Null when it cannot be pinned: a build without CUDA, no usable device,
  // or the driver refuses (then the memory is copied through staging).
  static std::unique_ptr<PinnedHostRange> Pin(const void* base, size_t size);
  ~PinnedHostRange();
  PinnedHostRange(const PinnedHostRange&) = delete;
  PinnedHostRange& operator=(const PinnedHostRange&) = delete;

 private:
  explicit PinnedHostRange(void* base) : base_(base) {}
  void* const base_;
};

}  // namespace refit::core

#endif  // REFIT_CORE_DEVICE_SOURCE_H_
