// Arena: the one shareable memory region that holds every kernel tensor of a
// model group on one device, so that engine processes on the same host can map
// the daemon's live kernels instead of copying them over gRPC.
//
// Pipeline position: allocated once by ShardStore::Create and never
// reallocated; RefitSlot::Commit copies each new version into it in place.
// The server hands its descriptors to attached engines (server/attach_*).
//
// Host arena: a sealed memfd (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE
// once the daemon's own writable mapping exists), so a descriptor handed to
// another process can only ever be mapped read-only and the region can never
// shrink under anyone's mapping. A page-sized header comes first, the kernels
// follow at kArenaDataOffset, each at a multiple of kArenaAlign.
//
// Device arena: one cudaMalloc'd allocation per store whose base is exported
// as a CUDA IPC handle; kernels are (allocation, offset) pairs. Its header
// lives in a header-only host arena, so an engine reads version and seqlock
// the same way for both.
//
// The header (ArenaHeader, little-endian, fixed offsets so that any language
// can read it with a plain load):
//   0  magic "REFITAR1"      24 data_bytes
//   8  format (1)            32 layout_hash (XXH3-64 of the layout fingerprint)
//   12 header_bytes (4096)   40 seq: odd while a commit copies (seqlock)
//   16 data_offset (4096)    48 version: the version the data holds
//                            56 committed_unix_ns: when the copy of `version`
//                               ended (CLOCK_REALTIME, ns; 0 before the first)
//   64 fingerprint: the content fingerprint of `version` (the Committed
//      event's, ASCII, NUL-padded; empty before the first commit)
//   96 refit_id: the refit that committed `version` (ASCII, NUL-padded;
//      empty for a restore, or for an id longer than 127 bytes)
// With these an engine has the whole Committed event from the header alone,
// as soon as the copy ends, without waiting for it to cross the stream.
// Each commit's end wakes the shared futex on seq's low 32 bits (offset 40),
// so a reader can sleep until a copy ends instead of polling.
// A reader that loads seq (even), reads, and loads seq again (unchanged) read
// one version; a different or odd seq means the read spans a commit. Fields
// are only ever added after the last one (format stays 1).
//
// Thread-safety: BeginWrite/EndWrite are called by the store's single
// committer under its writer lock; everything else is immutable after
// Create. The header's counters are atomics, readable from any process.
#ifndef REFIT_CORE_ARENA_H_
#define REFIT_CORE_ARENA_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/model_layout.h"

namespace refit::core {

inline constexpr char kArenaMagic[8] = {'R', 'E', 'F', 'I', 'T', 'A', 'R', '1'};
inline constexpr uint32_t kArenaFormat = 1;
inline constexpr int64_t kArenaHeaderBytes = 4096;
inline constexpr int64_t kArenaDataOffset = kArenaHeaderBytes;
// Every kernel starts at a multiple of this (vLLM and cuBLAS want >= 256).
inline constexpr int64_t kArenaAlign = 256;

struct ArenaHeader {
  char magic[8];
  uint32_t format;
  uint32_t header_bytes;
  uint64_t data_offset;
  uint64_t data_bytes;
  uint64_t layout_hash;
  std::atomic<uint64_t> seq;
  std::atomic<uint64_t> version;
  std::atomic<uint64_t> committed_unix_ns;
  char fingerprint[32];
  char refit_id[128];
};
static_assert(sizeof(ArenaHeader) == 224, "ArenaHeader's offsets are part of the engine protocol");
static_assert(offsetof(ArenaHeader, fingerprint) == 64 && offsetof(ArenaHeader, refit_id) == 96,
              "ArenaHeader's offsets are part of the engine protocol");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "seqlock needs lock-free 64-bit atomics");

// Rounds `bytes` up to kArenaAlign.
inline int64_t ArenaAligned(int64_t bytes) {
  return (bytes + kArenaAlign - 1) / kArenaAlign * kArenaAlign;
}

// Copies `n` bytes into arena memory with non-temporal (streaming) stores:
// a commit's bytes are for the engines, not for the committer's cache, and
// per-kernel memcpys (each below glibc's non-temporal threshold) take ~1.5x
// as long through the cache. The stores are weakly ordered: EndWrite fences
// them before it publishes the version. Plain memcpy off x86-64.
void StreamingCopy(void* dst, const void* src, size_t n);

// One host copy of a commit.
struct HostCopy {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t n = 0;
};

// StreamingCopy of every copy, their bytes split evenly over up to `threads`
// threads (core/parallel.h): one thread cannot fill a server's memory
// bandwidth. Each thread gets at least `min_bytes_per_thread` (below a few
// MiB a helper's wake-up costs a fair share of what it saves), so small
// totals use one thread. Every thread fences its own stores, so all of them
// are ordered before what the caller stores next.
void ParallelStreamingCopy(const std::vector<HostCopy>& copies, int threads,
                           size_t min_bytes_per_thread = size_t{4} << 20);

class HostArena {
 public:
  // A memfd named "refitd:<name>" of kArenaHeaderBytes + data_bytes, mapped
  // shared and writable here, zero-filled, its pages populated when
  // `populate`. Errors: RESOURCE_EXHAUSTED (memfd_create, ftruncate, mmap
  // failing: the errno text), INVALID_ARGUMENT for negative data_bytes.
  static absl::StatusOr<std::unique_ptr<HostArena>> Create(absl::string_view name,
                                                           int64_t data_bytes, uint64_t layout_hash,
                                                           bool populate);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  char* data() const { return base_ + kArenaDataOffset; }
  int64_t data_bytes() const { return data_bytes_; }
  // Header + data: the length an engine maps.
  int64_t size() const { return kArenaDataOffset + data_bytes_; }
  const ArenaHeader& header() const { return *reinterpret_cast<const ArenaHeader*>(base_); }
  // Whether the seals are on (kernels older than Linux 5.1 lack
  // F_SEAL_FUTURE_WRITE; the read-only descriptor still holds there).
  bool sealed() const { return sealed_; }

  // A new descriptor of the arena opened O_RDONLY: a process that receives
  // it can map it read-only only (PROT_WRITE with MAP_SHARED is EACCES).
  // The caller owns it. INTERNAL with the errno text. It duplicates one
  // opened at creation: reopening the memfd by path each time would be
  // refused once a process of the same uid that holds a descriptor of it
  // took its permissions away (fchmod), and every later attach with it.
  absl::StatusOr<int> OpenReadOnly() const;

  // Seqlock: seq becomes odd before a commit writes into the data, and even
  // again, with the new version, after (and, when the version changed, the
  // time the copy ended, `fingerprint` and `refit_id`; a value that does not
  // fit its field is left empty). EndWrite fences StreamingCopy's stores
  // first. Only the store's committer calls these, under its writer lock.
  void BeginWrite();
  void EndWrite(uint64_t version, absl::string_view fingerprint = {},
                absl::string_view refit_id = {});

 private:
  HostArena() = default;
  ArenaHeader* mutable_header() { return reinterpret_cast<ArenaHeader*>(base_); }

  int fd_ = -1;
  int read_only_fd_ = -1;  // opened O_RDONLY once, at creation
  char* base_ = nullptr;
  int64_t data_bytes_ = 0;
  bool sealed_ = false;
};

// How a device arena is shared with engines.
enum class DeviceArenaSharing {
  // cudaMalloc, exported as a CUDA IPC handle: engines map it read-write
  // (CUDA IPC has no read-only mapping).
  kCudaIpc,
  // A CUDA virtual-memory allocation (cuMemCreate) exported as a POSIX file
  // descriptor: an engine imports it and maps it with read-only access
  // (cuMemSetAccess PROT_READ), so a stray write faults in the engine instead
  // of changing the served weights. Read-only is the importer's choice (the
  // descriptor itself grants read-write): refit_client always maps it so.
  kVmmFd,
};
absl::string_view DeviceArenaSharingName(DeviceArenaSharing sharing);  // "ipc", "vmm"
// Parses "ipc" / "vmm"; INVALID_ARGUMENT naming the value otherwise.
absl::StatusOr<DeviceArenaSharing> ParseDeviceArenaSharing(absl::string_view name);

// A store's kernels on a GPU: one allocation, shared with engines as
// `sharing` says.
class DeviceArena {
 public:
  // How arenas made from now on are shared, process-wide (default kCudaIpc).
  static void SetDefaultSharing(DeviceArenaSharing sharing);
  static DeviceArenaSharing default_sharing();

  // `data_bytes` on `device_index`, zeroed, shared the default way.
  // Errors: RESOURCE_EXHAUSTED when it does not fit; FAILED_PRECONDITION when
  // the device cannot share the vmm way; INTERNAL for other CUDA errors;
  // UNIMPLEMENTED in a build without CUDA.
  static absl::StatusOr<std::unique_ptr<DeviceArena>> Create(int device_index, int64_t data_bytes);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  void* base() const { return base_; }
  int64_t data_bytes() const { return data_bytes_; }
  int device_index() const { return device_index_; }
  DeviceArenaSharing sharing() const { return sharing_; }
  // Bytes an importer maps: the allocation's size (kVmmFd: data_bytes
  // rounded up to the allocation granularity).
  int64_t mapped_bytes() const { return mapped_bytes_; }
  // kCudaIpc: cudaIpcMemHandle_t of base(), 64 bytes; another process opens
  // it with cudaIpcOpenMemHandle and adds each kernel's offset. Empty for
  // kVmmFd.
  const std::string& ipc_handle() const { return ipc_handle_; }
  // The device's UUID (cudaDeviceProp::uuid, 16 bytes): what names the device
  // in another process, whose CUDA_VISIBLE_DEVICES may number it otherwise.
  const std::string& device_uuid() const { return device_uuid_; }
  // kVmmFd: a new descriptor of the allocation (the caller owns it), for
  // cuMemImportFromShareableHandle in another process. FAILED_PRECONDITION
  // for kCudaIpc.
  absl::StatusOr<int> ExportFd() const;

 private:
  DeviceArena() = default;
  void* base_ = nullptr;
  int64_t data_bytes_ = 0;
  int64_t mapped_bytes_ = 0;
  int device_index_ = -1;
  DeviceArenaSharing sharing_ = DeviceArenaSharing::kCudaIpc;
  unsigned long long vmm_handle_ = 0;  // CUmemGenericAllocationHandle (kVmmFd)
  std::string ipc_handle_;
  std::string device_uuid_;
};

// What an engine compares before it trusts an arena's bytes: the fields
// vLLM's weight cache keys on, each hash 16 hex digits of XXH3-64.
struct LayoutIdentity {
  std::string architecture;  // config.json's architectures[0]
  int64_t tp_rank = 0;
  int64_t tp_size = 1;
  std::string checkpoint_dtype;   // "bfloat16", "float16", "float32"
  std::string quantization;       // QuantSchemeName
  std::string quant_config_hash;  // the scheme and its parameters (FP8 format, block)
  std::string tensors_hash;       // every kernel's name, dtype and shape
  std::string checkpoint_id;      // the model config (ModelConfig::ToJson)
  std::string fingerprint;        // LayoutFingerprint: over all of the above
};
LayoutIdentity IdentifyLayout(const ModelLayout& layout);

// torch's name of a kernel dtype ("float8_e4m3fn", "bfloat16", ...).
absl::string_view TorchDTypeName(DType dtype);

}  // namespace refit::core

#endif  // REFIT_CORE_ARENA_H_
