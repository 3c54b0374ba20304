// RegionRegistry: the shared-memory regions trainers on the daemon's host
// registered (refit.v1.RegionService), and the reads of Push chunks that
// reference them (Chunk.region) instead of carrying bytes.
//
// Pipeline position: between the Push reactor and RefitSession::Ingest. A
// chunk's RegionRef resolves here to the bytes of the caller's region, which
// the session converts, slices and stages in one pass, as it does the bytes
// of a chunk that carries them.
//
// Safety against a hostile or buggy trainer. A region that shrinks while it
// is mapped would kill the daemon with SIGBUS at the first read past its new
// end. A descriptor sealed against shrinking (a memfd with F_SEAL_SHRINK,
// checked with F_GET_SEALS) cannot, and is simply mapped. Any other
// descriptor (a /dev/shm file, torch's share_memory_(), a memfd without the
// seal) is mapped under SigbusGuard (server/sigbus_guard.h): a read past a
// new end reads zeros instead of faulting and flags the region (faulted()).
// Every chunk of either kind is ingested straight from the mapping
// (Access::kMapped, no copy). The refit checks, once it has read its last
// byte (RegionReads, the session's input_check, before Prepare returns),
// that no region it read from faulted and that each guarded one's file is
// still as large as registered (a GPU store reads a page-locked region by
// DMA, which does not fault where the file shrank: the pages it dropped
// stay pinned and are read instead): one that fails either is
// FAILED_PRECONDITION naming the region and a tensor read from it, so the
// refit aborts and nothing live changes; later reads of that region are
// refused. Where no
// guard slot is free the descriptor is read with pread into a buffer of the
// reading thread instead (Access::kPread, one copy; a short read is the
// same FAILED_PRECONDITION). The trainer may still write into its region
// while a refit reads it; that changes the bytes it pushes, never the
// daemon's memory safety. From a mapped region the rows of quantized weights
// are read when their layer is processed (core::Chunk::keep holds the
// Region, and with it the mapping, until then), so what matters is the
// region's bytes until the push's Prepare returns.
//
// A trainer's CUDA allocation is a region too (Access::kCudaIpc): it is
// registered with its IPC handle instead of a descriptor, opened on its GPU
// (core::CudaIpcAllocation, which checks that the allocation holds the
// declared size, so no accepted range can fault on the device), and its
// chunks carry device addresses (core::Chunk::device) that the host never
// dereferences.
//
// Ownership: regions belong to a caller (the principal's name; "anonymous"
// when authentication is off, where the region id, 128 random bits, is what
// keeps others out). A chunk naming a region of another caller is
// PERMISSION_DENIED. Limits per caller: a count and a total size, pending
// registrations included (RESOURCE_EXHAUSTED).
//
// Lifecycle: Reserve (the id, counted against the limits) -> Activate (the
// descriptor arrived: checked, mapped) -> Release. A chunk being read holds
// its region (shared_ptr), and so does staging that aliases its rows, so a
// release during a read or before those rows are quantized unmaps after.
//
// Thread-safety: thread-safe.
#ifndef REFIT_SERVER_REGION_REGISTRY_H_
#define REFIT_SERVER_REGION_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/device_source.h"

namespace refit::server {

class Region {
 public:
  enum class Access { kMapped, kPread, kCudaIpc };

  // Takes `fd` (closed on error too). INVALID_ARGUMENT when it is not a
  // regular file, is not open for reading (O_WRONLY, O_PATH), is on
  // hugetlbfs, or is smaller than `size`;
  // INTERNAL when a sealed one cannot be mapped. With `pin`, a mapping is
  // also page-locked for the GPUs (core::PinnedHostRange), so a GPU store's
  // refit copies it to the device by DMA; one the driver refuses is used
  // unpinned, and so is one with pages the trainer never wrote (a hole:
  // page-locking would allocate them on refitd's account; pin_declined()).
  static absl::StatusOr<std::unique_ptr<Region>> Open(std::string id, int fd, uint64_t size,
                                                      bool pin = false);
  // A CUDA allocation (kCudaIpc): core::CudaIpcAllocation::Open's errors.
  static absl::StatusOr<std::unique_ptr<Region>> OpenCudaIpc(std::string id,
                                                             absl::string_view handle,
                                                             absl::string_view device_uuid,
                                                             uint64_t size);
  // Tests: `hook(fd)` runs inside Open between reading the seals and the
  // size (what a racing trainer could do there). nullptr: none.
  static void SetOpenHookForTesting(void (*hook)(int fd));
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  const std::string& id() const { return id_; }
  uint64_t size() const { return size_; }
  Access access() const { return access_; }
  // The CUDA allocation of a kCudaIpc region (null otherwise): Read's spans
  // are then device addresses.
  const core::DeviceSource* device() const { return cuda_.get(); }
  // Its GPU in this process (-1 for host regions).
  int cuda_device() const { return cuda_ != nullptr ? cuda_->device() : -1; }
  // Mapped without a seal against shrinking, under SigbusGuard.
  bool guarded() const { return guard_slot_ >= 0; }
  // Page-locked for the GPUs (Open with `pin`).
  bool pinned() const { return pinned_ != nullptr; }
  // Open was asked to page-lock it (pinned() unless the driver refused or
  // pin_declined()).
  bool pin_requested() const { return pin_requested_; }
  // Why Open did not page-lock it although asked to (empty otherwise).
  const std::string& pin_declined() const { return pin_declined_; }
  // A guarded region's file shrank under a read (its mapping reads zeros),
  // or CheckFileSize found it shorter than size(). Sticky.
  bool faulted() const;
  // For a guarded region: marks it faulted when its file is now smaller
  // than size() (a device's DMA from page-locked pages does not fault where
  // the file shrank, so the guard cannot see that). One fstat.
  void CheckFileSize() const;
  // FAILED_PRECONDITION naming `tensor` when faulted(), else OK.
  absl::Status CheckIntact(absl::string_view tensor) const;

  // The bytes [offset, offset + length): a span into the mapping (device
  // addresses for kCudaIpc), or read
  // into *scratch (kPread; resized as needed). OUT_OF_RANGE past size()
  // (naming `tensor`, the region, offset, length and size);
  // FAILED_PRECONDITION when a kPread region ends early (truncated while in
  // use) or cannot be read, or a guarded one faulted before;
  // INVALID_ARGUMENT when the range of a shared-memory (tmpfs, memfd)
  // region has a page the trainer never wrote (CheckWritten).
  absl::StatusOr<absl::Span<const uint8_t>> Read(absl::string_view tensor, uint64_t offset,
                                                 uint64_t length,
                                                 std::vector<uint8_t>* scratch) const;

 private:
  Region(std::string id, int fd, uint64_t size) : id_(std::move(id)), fd_(fd), size_(size) {}

  // A page of shared memory that was never written (a hole) is allocated by
  // the first read of it, through a mapping or not, and charged to the
  // reader: to refitd's memory cgroup, for as long as the trainer keeps the
  // file, however little the trainer itself spent. So a range of a tmpfs
  // or memfd region must be written before refitd reads it. One fstat when
  // every page of the file is there (st_blocks); otherwise lseek(SEEK_HOLE)
  // from the range, on a descriptor of refitd's own (the file offset is
  // shared with the trainer's), remembering the span found written so that
  // the next chunks in it cost nothing.
  absl::Status CheckWritten(absl::string_view tensor, uint64_t offset, uint64_t length) const;

  const std::string id_;
  const int fd_;
  const uint64_t size_;
  Access access_ = Access::kPread;
  const uint8_t* map_ = nullptr;
  int guard_slot_ = -1;
  std::unique_ptr<core::CudaIpcAllocation> cuda_;
  std::unique_ptr<core::PinnedHostRange> pinned_;  // released before the unmap
  bool pin_requested_ = false;
  std::string pin_declined_;
  mutable std::atomic<bool> shrunk_{false};  // CheckFileSize found the file short
  bool shmem_ = false;                       // a tmpfs file or a memfd
  mutable absl::Mutex written_mu_;
  // A span of the file CheckWritten found written, [lo, hi).
  mutable uint64_t written_lo_ ABSL_GUARDED_BY(written_mu_) = 0;
  mutable uint64_t written_hi_ ABSL_GUARDED_BY(written_mu_) = 0;
};

// The guarded regions one refit read from, and the first tensor read from
// each (for the error). Check() runs once the refit has read its last byte. Thread-safe:
// the refit's streams add concurrently.
class RegionReads {
 public:
  // Records `region` when it is guarded (others cannot fault).
  void Add(const std::shared_ptr<const Region>& region, absl::string_view tensor);
  // FAILED_PRECONDITION for the first recorded region that faulted or whose
  // file is now smaller than registered (Region::CheckFileSize).
  absl::Status Check() const;

 private:
  mutable absl::Mutex mu_;
  // Each region, held, with the first tensor read from it.
  std::map<const Region*, std::pair<std::shared_ptr<const Region>, std::string>> read_
      ABSL_GUARDED_BY(mu_);
};

class RegionRegistry {
 public:
  struct Limits {
    int max_regions = 1024;                  // per caller
    int64_t max_bytes = int64_t{256} << 30;  // per caller
    // All callers together (each region holds a descriptor of the daemon's
    // own); 0: no cap of its own.
    int max_total_regions = 0;
    // With `pin`: the bytes of registered regions that may be page-locked,
    // all callers together; a region that would go past it is mapped
    // without (its refits copy it through the pinned staging pool). -1: no
    // cap.
    int64_t max_pinned_bytes = -1;
  };
  struct Totals {
    int64_t regions = 0;  // registered (descriptor received), all callers
    int64_t bytes = 0;
    int64_t pending = 0;       // reserved, descriptor not yet received
    int64_t pinned_bytes = 0;  // of regions page-locked for the GPUs
    // What counts against max_pinned_bytes: regions opened to be
    // page-locked (also those the driver refused, retired ones a refit
    // still reads, and ones opening now).
    int64_t pin_budget_used_bytes = 0;
  };

  // `pin`: page-lock mapped regions for the GPUs (Region::Open's `pin`),
  // for a daemon that serves a store on a GPU.
  explicit RegionRegistry(Limits limits, bool pin = false) : limits_(limits), pin_(pin) {}

  // A new region id for `owner`, counted against its limits until Release,
  // and after it for as long as a refit still reads the region (it keeps its
  // descriptor and mapping until then). INVALID_ARGUMENT size 0;
  // RESOURCE_EXHAUSTED over a limit (naming the flag).
  absl::StatusOr<std::string> Reserve(const std::string& owner, uint64_t size);
  // The descriptor of a reserved region arrived: the region, opened.
  // Region::Open's errors (the reservation stays until Release); NOT_FOUND
  // if it was released.
  absl::StatusOr<std::shared_ptr<const Region>> Activate(const std::string& id, int fd);
  // As Activate, for a region registered with a CUDA IPC handle.
  absl::StatusOr<std::shared_ptr<const Region>> ActivateCudaIpc(const std::string& id,
                                                                absl::string_view handle,
                                                                absl::string_view device_uuid);
  // Forgets the region (reserved or active); a no-op for an unknown id.
  void Release(const std::string& id);
  // OK if `id` is `owner`'s; NOT_FOUND unknown (or released),
  // PERMISSION_DENIED another caller's.
  absl::Status CheckOwner(const std::string& owner, const std::string& id) const;
  // An active region of `owner`: CheckOwner's errors, and NOT_FOUND for one
  // whose descriptor has not arrived yet.
  absl::StatusOr<std::shared_ptr<const Region>> Find(const std::string& owner,
                                                     const std::string& id) const;
  Totals totals() const;
  // refitd_trainer_regions / refitd_trainer_region_bytes /
  // refitd_trainer_region_pinned_bytes (Prometheus text).
  std::string RenderMetrics() const;

 private:
  struct Entry {
    std::string owner;
    uint64_t size = 0;
    std::shared_ptr<const Region> region;  // null while pending
    bool pin = false;  // opened to be page-locked: counted against max_pinned_bytes
  };

  // Opens the region, page-locked when `pin`.
  using Opener = std::function<absl::StatusOr<std::unique_ptr<Region>>(uint64_t size, bool pin)>;
  absl::StatusOr<std::shared_ptr<const Region>> ActivateWith(
      const std::string& id, bool may_pin, const Opener& open,
      const std::function<void()>& on_not_waiting);
  // Bytes of the regions, live, retired or opening, that count against
  // max_pinned_bytes.
  uint64_t PinnedBytesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Released regions a refit still holds: they keep counting against their
  // owner (and the total) until the last reference goes.
  struct Retired {
    std::string owner;
    uint64_t size = 0;
    std::weak_ptr<const Region> region;
    bool pin = false;
  };

  const Limits limits_;
  const bool pin_;
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::vector<Retired> retired_ ABSL_GUARDED_BY(mu_);
  uint64_t pinning_ ABSL_GUARDED_BY(mu_) = 0;  // bytes of regions being opened to be pinned
};

}  // namespace refit::server

#endif  // REFIT_SERVER_REGION_REGISTRY_H_
