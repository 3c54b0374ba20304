#include "server/region_registry.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/log.h"
#include "core/text.h"
#include "server/sigbus_guard.h"

namespace refit::server {
namespace {

// Region::SetOpenHookForTesting's hook.
void (*g_open_hook)(int fd) = nullptr;

std::string RandomRegionId() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  std::string out = "rg-";
  for (unsigned char b : bytes) absl::StrAppendFormat(&out, "%02x", b);
  return out;
}

// Whether the file's blocks cover its size (st_blocks): no hole anywhere,
// with one fstat. (A file missing one page has at most its size rounded
// down to pages in blocks, less than its size; some tmpfs implementations,
// gVisor's, count blocks of the size itself, not of whole pages.)
bool EveryPageThere(const struct stat& st) {
  return static_cast<uint64_t>(st.st_blocks) * 512 >= static_cast<uint64_t>(st.st_size);
}

// The offset of the file's first hole at or after `from` (its size when it
// has none), -1 when `from` is past its end. Looked for on a reopened
// descriptor, not a dup (a dup shares the trainer's file offset, which
// lseek moves), closed at once (a region holds one descriptor, as the
// registry's cap on regions counts); on `fd` itself when none can be opened.
off_t FirstHole(int fd, uint64_t from) {
  const int reopened = ::open(absl::StrCat("/proc/self/fd/", fd).c_str(), O_RDONLY | O_CLOEXEC);
  const off_t hole = ::lseek(reopened >= 0 ? reopened : fd, static_cast<off_t>(from), SEEK_HOLE);
  if (reopened >= 0) ::close(reopened);
  return hole;
}

// Whether a page of [0, size) of a shared-memory file is missing (never
// written: a hole). Page-locking touches every page, and such a page would
// then be allocated, zeroed, on refitd's account; that region is not
// page-locked. Pages reserved with fallocate count as there (st_blocks has
// them; SEEK_HOLE does not). Where holes cannot be looked for (no
// SEEK_HOLE), none is assumed.
bool HasHole(int fd, uint64_t size) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return false;
  if (EveryPageThere(st)) return false;
  const off_t hole = FirstHole(fd, 0);
  return hole >= 0 && static_cast<uint64_t>(hole) < size;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Region>> Region::Open(std::string id, int fd, uint64_t size,
                                                     bool pin) {
  std::unique_ptr<Region> region(new Region(std::move(id), fd, size));
  // The seals first, the size after: once F_SEAL_SHRINK is seen the size
  // cannot drop below what fstat then says. (The other order would let a
  // trainer shrink and seal its memfd between the two, and a mapping taken
  // as sealed, so unguarded, would reach past its end: SIGBUS.)
  const int seals = ::fcntl(fd, F_GET_SEALS);
  const bool sealed = seals >= 0 && (seals & F_SEAL_SHRINK) != 0;
  if (g_open_hook != nullptr) g_open_hook(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("region \"", region->id_, "\": fstat: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("region \"", region->id_,
                     "\": the descriptor is not a regular file (send a memfd or a file in "
                     "/dev/shm)"));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  // O_PATH descriptors read as O_RDONLY in O_ACCMODE but cannot be read.
  if (flags < 0 || (flags & O_ACCMODE) == O_WRONLY || (flags & O_PATH) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("region \"", region->id_, "\": the descriptor is not open for reading"));
  }
  struct statfs fs {};
  const bool have_fs = ::fstatfs(fd, &fs) == 0;
  region->shmem_ = have_fs && static_cast<uint64_t>(fs.f_type) == TMPFS_MAGIC;
  if (have_fs && static_cast<uint64_t>(fs.f_type) == HUGETLBFS_MAGIC) {
    // A hole punched in a hugetlbfs file (allowed unless it is sealed
    // against writes, which a trainer's region cannot be) faults the mapping
    // once the huge page pool is empty, and its mappings only unmap in
    // whole huge pages.
    return absl::InvalidArgumentError(absl::StrCat(
        "region \"", region->id_,
        "\": the descriptor is on hugetlbfs (MFD_HUGETLB), which refitd does not map; send a "
        "plain memfd or a file in /dev/shm"));
  }
  if (!region->shmem_) {
    // Reads of a file elsewhere can wait without end (a FUSE server or a
    // network filesystem that does not answer) while they hold the refit,
    // or read what is not a trainer's memory at all (sysfs); shared memory
    // is read at memory speed.
    return absl::InvalidArgumentError(absl::StrCat(
        "region \"", region->id_, "\": the descriptor is not shared memory (",
        have_fs ? absl::StrFormat("a file on a filesystem of type 0x%x, not tmpfs", fs.f_type)
                : absl::StrCat("fstatfs: ", std::strerror(errno)),
        "); send a memfd or a file in /dev/shm"));
  }
  if (static_cast<uint64_t>(st.st_size) < size) {
    return absl::InvalidArgumentError(absl::StrCat("region \"", region->id_, "\" is ", st.st_size,
                                                   " bytes, smaller than its declared size ",
                                                   size));
  }
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    if (!sealed) return region;  // pread (out of address space or mappings)
    return absl::InternalError(
        absl::StrCat("region \"", region->id_, "\": cannot map it: ", std::strerror(errno)));
  }
  if (!sealed) {
    region->guard_slot_ = SigbusGuard::Register(p, size);
    if (region->guard_slot_ < 0) {  // no slot: pread
      ::munmap(p, size);
      return region;
    }
  }
  region->map_ = static_cast<const uint8_t*>(p);
  region->access_ = Access::kMapped;
  region->pin_requested_ = pin;
  if (pin && HasHole(fd, size)) {
    region->pin_declined_ =
        "it has pages the trainer never wrote (page-locking would allocate them on refitd's "
        "account); its refits copy it through the pinned staging pool";
  } else if (pin) {
    region->pinned_ = core::PinnedHostRange::Pin(p, size);
  }
  return region;
}

void Region::SetOpenHookForTesting(void (*hook)(int fd)) { g_open_hook = hook; }

bool Region::faulted() const {
  return guard_slot_ >= 0 &&
         (shrunk_.load(std::memory_order_relaxed) || SigbusGuard::Faulted(guard_slot_));
}

void Region::CheckFileSize() const {
  if (guard_slot_ < 0 || shrunk_.load(std::memory_order_relaxed)) return;
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || static_cast<uint64_t>(st.st_size) < size_) {
    shrunk_.store(true, std::memory_order_relaxed);
  }
}

absl::Status Region::CheckIntact(absl::string_view tensor) const {
  if (!faulted()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "tensor ", core::QuoteText(tensor), ": region \"", id_,
      "\" was truncated while in use: its file shrank below the registered size ", size_,
      " while refitd read it (the bytes read are not the trainer's; a memfd sealed with "
      "F_SEAL_SHRINK cannot shrink); register it again"));
}

void RegionReads::Add(const std::shared_ptr<const Region>& region, absl::string_view tensor) {
  if (!region->guarded()) return;
  absl::MutexLock lock(&mu_);
  read_.try_emplace(region.get(), region, tensor);  // the first tensor stays
}

absl::Status RegionReads::Check() const {
  absl::MutexLock lock(&mu_);
  for (const auto& [key, read] : read_) {
    // A device's DMA from page-locked pages of a file that shrank does not
    // fault (it reads the pages the file dropped): the guard cannot see it,
    // the file's size once every read is over does.
    read.first->CheckFileSize();
    if (absl::Status s = read.first->CheckIntact(read.second); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Region>> Region::OpenCudaIpc(std::string id,
                                                            absl::string_view handle,
                                                            absl::string_view device_uuid,
                                                            uint64_t size) {
  absl::StatusOr<std::unique_ptr<core::CudaIpcAllocation>> cuda =
      core::CudaIpcAllocation::Open(handle, device_uuid, size);
  if (!cuda.ok()) {
    return absl::Status(cuda.status().code(),
                        absl::StrCat("region \"", id, "\": ", cuda.status().message()));
  }
  std::unique_ptr<Region> region(new Region(std::move(id), -1, size));
  region->map_ = (*cuda)->base();
  region->cuda_ = *std::move(cuda);
  region->access_ = Access::kCudaIpc;
  return region;
}

Region::~Region() {
  pinned_.reset();
  SigbusGuard::Unregister(guard_slot_);
  if (access_ == Access::kMapped) ::munmap(const_cast<uint8_t*>(map_), size_);
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<absl::Span<const uint8_t>> Region::Read(absl::string_view tensor, uint64_t offset,
                                                       uint64_t length,
                                                       std::vector<uint8_t>* scratch) const {
  if (offset > size_ || length > size_ - offset) {
    return absl::OutOfRangeError(absl::StrCat("tensor ", core::QuoteText(tensor), ": region \"",
                                              id_, "\" offset ", offset, " length ", length,
                                              " reaches past its size ", size_));
  }
  if (absl::Status intact = CheckIntact(tensor); !intact.ok()) return intact;
  if (absl::Status written = CheckWritten(tensor, offset, length); !written.ok()) return written;
  if (access_ != Access::kPread) return absl::MakeConstSpan(map_ + offset, length);
  scratch->resize(length);
  uint64_t done = 0;
  while (done < length) {
    ssize_t n =
        ::pread(fd_, scratch->data() + done, length - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("tensor ", core::QuoteText(tensor), ": region \"", id_,
                       "\" cannot be read: ", std::strerror(errno)));
    }
    if (n == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("tensor ", core::QuoteText(tensor), ": region \"", id_, "\" ends at byte ",
                       offset + done, ", before offset ", offset, " + length ", length,
                       ": it was truncated while in use (its registered size is ", size_, ")"));
    }
    done += static_cast<uint64_t>(n);
  }
  return absl::MakeConstSpan(scratch->data(), length);
}

absl::Status Region::CheckWritten(absl::string_view tensor, uint64_t offset,
                                  uint64_t length) const {
  if (!shmem_ || fd_ < 0 || length == 0) return absl::OkStatus();
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return absl::OkStatus();  // the size checks report a bad file
  if (EveryPageThere(st)) return absl::OkStatus();
  const uint64_t end = offset + length;
  absl::MutexLock lock(&written_mu_);
  if (offset >= written_lo_ && end <= written_hi_) return absl::OkStatus();
  const uint64_t from = offset / page * page;
  const off_t hole = FirstHole(fd_, from);
  // (ENXIO: the range starts past the file's end, which the shrink checks
  // report.)
  if (hole < 0) return absl::OkStatus();
  const uint64_t at = std::max(static_cast<uint64_t>(hole), offset);
  if (at < end) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor ", core::QuoteText(tensor), ": region \"", id_, "\" offset ", offset, " length ",
        length, ": its byte ", at,
        " lies in a page the trainer never wrote (a hole in its shared memory); refitd reads "
        "only written memory, because reading a hole would allocate the page on refitd's "
        "account: write every byte of a tensor before pushing it"));
  }
  const uint64_t hi = static_cast<uint64_t>(hole);
  if (written_hi_ > written_lo_ && from <= written_hi_ && hi >= written_lo_) {
    written_lo_ = std::min(written_lo_, from);
    written_hi_ = std::max(written_hi_, hi);
  } else {
    written_lo_ = from;
    written_hi_ = hi;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> RegionRegistry::Reserve(const std::string& owner, uint64_t size) {
  if (size == 0) return absl::InvalidArgumentError("RegisterRegion: size must be > 0");
  absl::MutexLock lock(&mu_);
  int64_t count = 0;
  int64_t held = 0;  // of `count`: released, still read by an open refit
  uint64_t bytes = 0;
  for (const auto& [id, entry] : entries_) {
    if (entry.owner != owner) continue;
    ++count;
    bytes += entry.size;
  }
  retired_.erase(std::remove_if(retired_.begin(), retired_.end(),
                                [](const Retired& r) { return r.region.expired(); }),
                 retired_.end());
  for (const Retired& r : retired_) {
    if (r.owner != owner) continue;
    ++count;
    ++held;
    bytes += r.size;
  }
  const std::string held_text =
      held > 0 ? absl::StrCat(" (", held, " of them unregistered but still read by an open refit)")
               : "";
  if (count >= limits_.max_regions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "caller ", core::QuoteText(owner), " holds ", count, " shared-memory regions already",
        held_text, " (--max-regions-per-caller ", limits_.max_regions, "): unregister one first"));
  }
  const int64_t total = static_cast<int64_t>(entries_.size() + retired_.size());
  if (limits_.max_total_regions > 0 && total >= limits_.max_total_regions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "refitd holds ", total, " shared-memory regions of all callers, its limit (",
        limits_.max_total_regions,
        ", half its open-file limit: each region holds a descriptor): unregister some first"));
  }
  if (size > static_cast<uint64_t>(limits_.max_bytes) ||
      bytes + size > static_cast<uint64_t>(limits_.max_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "caller ", core::QuoteText(owner), ": a region of ", size, " bytes on top of the ", bytes,
        " it holds", held_text, " exceeds --max-region-bytes-per-caller ", limits_.max_bytes));
  }
  std::string id = RandomRegionId();
  entries_[id] = Entry{owner, size, nullptr};
  return id;
}

absl::StatusOr<std::shared_ptr<const Region>> RegionRegistry::Activate(const std::string& id,
                                                                       int fd) {
  return ActivateWith(
      id, /*may_pin=*/pin_,
      [&](uint64_t size, bool pin) { return Region::Open(id, fd, size, pin); },
      [fd] { ::close(fd); });
}

absl::StatusOr<std::shared_ptr<const Region>> RegionRegistry::ActivateCudaIpc(
    const std::string& id, absl::string_view handle, absl::string_view device_uuid) {
  return ActivateWith(
      id, /*may_pin=*/false,
      [&](uint64_t size, bool) { return Region::OpenCudaIpc(id, handle, device_uuid, size); },
      [] {});
}

uint64_t RegionRegistry::PinnedBytesLocked() const {
  uint64_t bytes = pinning_;
  for (const auto& [id, entry] : entries_) {
    if (entry.pin) bytes += entry.size;
  }
  for (const Retired& r : retired_) {
    if (r.pin && !r.region.expired()) bytes += r.size;
  }
  return bytes;
}

absl::StatusOr<std::shared_ptr<const Region>> RegionRegistry::ActivateWith(
    const std::string& id, bool may_pin, const Opener& open,
    const std::function<void()>& on_not_waiting) {
  uint64_t size = 0;
  bool pin = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(id);
    if (it == entries_.end() || it->second.region != nullptr) {
      on_not_waiting();
      return absl::NotFoundError(
          absl::StrCat("region \"", id, "\" is not waiting for its descriptor"));
    }
    size = it->second.size;
    // Page-locked memory cannot be swapped or reclaimed: trainers get at
    // most max_pinned_bytes of it, the host keeps the rest (an engine's
    // own pinned buffers, the page cache). Counted from here (pinning_
    // while the open runs, even if the region is released meanwhile), so
    // that regions opening at once cannot all pass.
    if (may_pin) {
      const uint64_t pinned = PinnedBytesLocked();
      pin = limits_.max_pinned_bytes < 0 ||
            (size <= static_cast<uint64_t>(limits_.max_pinned_bytes) &&
             pinned <= static_cast<uint64_t>(limits_.max_pinned_bytes) - size);
      if (pin) {
        pinning_ += size;
      } else {
        REFIT_LOG(INFO).Field("region", id).Field("bytes", absl::StrCat(size))
            << "not page-locked: the trainers' page-locked regions (" << pinned
            << " bytes) would pass --max-pinned-region-bytes " << limits_.max_pinned_bytes
            << "; its refits copy it through the pinned staging pool";
      }
    }
  }
  // Outside the lock: fstat and mmap of a large region (or opening a CUDA
  // allocation) are not instant.
  absl::StatusOr<std::unique_ptr<Region>> opened = open(size, pin);
  std::shared_ptr<const Region> region;
  if (opened.ok()) region = *std::move(opened);
  absl::MutexLock lock(&mu_);
  if (pin) pinning_ -= size;
  if (!opened.ok()) return opened.status();
  auto it = entries_.find(id);
  // Released meanwhile: `region` is closed outside the lock, on return.
  if (it == entries_.end()) {
    return absl::NotFoundError(absl::StrCat("region \"", id, "\" was released meanwhile"));
  }
  it->second.region = region;
  // A region Open declined to page-lock (pages nobody wrote) takes none of
  // the budget.
  it->second.pin = pin && region->pin_declined().empty();
  return region;
}

void RegionRegistry::Release(const std::string& id) {
  std::shared_ptr<const Region> last;  // unmapped outside the lock
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  last = std::move(it->second.region);
  if (last != nullptr && last.use_count() > 1) {  // a refit still reads it
    retired_.push_back(Retired{it->second.owner, it->second.size, last, it->second.pin});
  }
  entries_.erase(it);
}

absl::Status RegionRegistry::CheckOwner(const std::string& owner, const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    return absl::NotFoundError(
        absl::StrCat("unknown shared-memory region ", core::QuoteText(id),
                     " (never registered, unregistered, or its lease ended)"));
  }
  if (it->second.owner != owner) {
    return absl::PermissionDeniedError(
        absl::StrCat("shared-memory region ", core::QuoteText(id), " belongs to another caller"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Region>> RegionRegistry::Find(const std::string& owner,
                                                                   const std::string& id) const {
  if (absl::Status s = CheckOwner(owner, id); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second.region == nullptr) {
    return absl::NotFoundError(absl::StrCat("shared-memory region ", core::QuoteText(id),
                                            " has not received its descriptor"));
  }
  return it->second.region;
}

RegionRegistry::Totals RegionRegistry::totals() const {
  Totals t;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, entry] : entries_) {
    if (entry.region == nullptr) {
      ++t.pending;
      continue;
    }
    ++t.regions;
    t.bytes += static_cast<int64_t>(entry.size);
    if (entry.region->pinned()) t.pinned_bytes += static_cast<int64_t>(entry.size);
  }
  t.pin_budget_used_bytes = static_cast<int64_t>(PinnedBytesLocked());
  return t;
}

std::string RegionRegistry::RenderMetrics() const {
  const Totals t = totals();
  return absl::StrCat(
      "# HELP refitd_trainer_regions Shared-memory regions trainers registered (RegionService).\n"
      "# TYPE refitd_trainer_regions gauge\n"
      "refitd_trainer_regions ",
      t.regions,
      "\n"
      "# HELP refitd_trainer_region_bytes Bytes of the registered shared-memory regions.\n"
      "# TYPE refitd_trainer_region_bytes gauge\n"
      "refitd_trainer_region_bytes ",
      t.bytes,
      "\n"
      "# HELP refitd_trainer_region_pinned_bytes Bytes of registered regions page-locked for a "
      "GPU store's DMA (when a store is on a GPU).\n"
      "# TYPE refitd_trainer_region_pinned_bytes gauge\n"
      "refitd_trainer_region_pinned_bytes ",
      t.pinned_bytes,
      "\n"
      "# HELP refitd_trainer_region_pin_budget_used_bytes Bytes counted against "
      "--max-pinned-region-bytes: regions opened to be page-locked, retired ones a refit still "
      "reads, and ones opening now.\n"
      "# TYPE refitd_trainer_region_pin_budget_used_bytes gauge\n"
      "refitd_trainer_region_pin_budget_used_bytes ",
      t.pin_budget_used_bytes, "\n");
}

}  // namespace refit::server
