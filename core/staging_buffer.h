// StagingBuffer: bytes a refit holds before commit — a layer's high-precision
// params while it is assembled, and the kernels made from them until they are
// copied into the live tensors.
//
// Pipeline position: LayerAssembler allocates host buffers for params;
// LayerProcessor turns them into kernel buffers, in host memory (host
// processor) or in device memory (the CUDA processor in core/cuda/, which
// makes device buffers through the same type with a release function of its
// own); RefitSession commits them and drops them.
//
// Lifecycle: move-only; the memory is released when the buffer is destroyed
// or assigned over. Thread-compatible: one owner at a time.
#ifndef REFIT_CORE_STAGING_BUFFER_H_
#define REFIT_CORE_STAGING_BUFFER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace refit::core {

class DeviceSource;

class StagingBuffer {
 public:
  StagingBuffer() = default;
  // Wraps memory released by `release` (called once, when the buffer goes).
  StagingBuffer(void* data, int64_t size, bool on_device, std::function<void()> release);
  StagingBuffer(StagingBuffer&& other) noexcept;
  StagingBuffer& operator=(StagingBuffer&& other) noexcept;
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;
  ~StagingBuffer();

  // Host memory of `size` bytes, all zero. Large buffers get lazily zeroed
  // pages from calloc rather than a memset pass.
  // Errors: RESOURCE_EXHAUSTED naming `what` when the allocation fails;
  // INVALID_ARGUMENT for a negative size.
  static absl::StatusOr<StagingBuffer> HostZeroed(int64_t size, absl::string_view what);
  // Host memory of `size` bytes, contents undefined: for buffers written in
  // full before anyone reads them (no zeroing pass, no zero-page faults).
  // Errors as HostZeroed.
  static absl::StatusOr<StagingBuffer> HostUninitialized(int64_t size, absl::string_view what);
  // As HostUninitialized, from the host staging pool (below) when `size` is
  // at least kPoolMinBytes: for what every refit needs again in the same
  // sizes — a layer's high-precision params while it is assembled, and the
  // kernels made from them until commit.
  static absl::StatusOr<StagingBuffer> HostPooled(int64_t size, absl::string_view what);

  // The host staging pool. A refit stages every layer in buffers of the same
  // few sizes, and a fresh allocation of that size costs a page fault
  // and a kernel zeroing per 4 KiB page (measured: it doubled the daemon's
  // CPU per refit when staging was returned to the system after each one).
  // Released buffers are therefore kept, process-wide, and handed out again
  // for a request of their size (best fit, at most 1/8 larger). Bounds: what
  // the pool keeps plus what is in use never exceeds the most that was in
  // use at once (its high-water mark): a released buffer that would exceed
  // it is freed instead, and a request the pool cannot serve first frees
  // kept buffers of other sizes until the new one fits under it; and a
  // pool not used for its idle period (kDefaultPoolIdle unless set) is
  // emptied by a background thread, so an idle daemon holds no staging.
  static constexpr int64_t kPoolMinBytes = int64_t{1} << 20;
  static constexpr absl::Duration kDefaultPoolIdle = absl::Seconds(30);
  // Sets the idle period; zero (or negative) turns pooling off: HostPooled
  // then allocates like HostUninitialized, and what the pool holds is freed.
  static void SetHostPoolIdle(absl::Duration idle);
  struct PoolStats {
    int64_t pooled_bytes = 0;  // released buffers kept for reuse
    int64_t in_use_bytes = 0;  // pooled-size buffers handed out
    int64_t high_water_bytes = 0;
    int64_t reused = 0;     // requests served from the pool
    int64_t allocated = 0;  // requests that allocated
  };
  static PoolStats HostPoolStats();
  // Frees the pooled buffers when the pool was last used before
  // `now - idle period` (what the background thread does); returns the
  // bytes freed.
  static int64_t TrimHostPool(absl::Time now);

  // Aliases: byte ranges of a host buffer whose bytes are read in place from
  // memory the buffer does not own (a trainer's sealed shared-memory region,
  // or its CUDA allocation: `device` set, the source a device address)
  // instead of being copied in. `keep` keeps that memory valid; it is held
  // until the buffer goes. The owned bytes under an alias are never read.
  // Ranges must not overlap; an alias that continues another one in the
  // buffer and in the source, with the same `keep` and `device`, is merged
  // with it. Readers of a buffer that may have aliases use Pieces(),
  // Segments() or CopyOut(), not data().
  void AddAlias(int64_t offset, const uint8_t* source, int64_t size,
                std::shared_ptr<const void> keep, const DeviceSource* device = nullptr);
  bool has_aliases() const { return !aliases_.empty(); }
  bool has_device_aliases() const;
  // Bytes of the buffer read from aliases.
  int64_t aliased_bytes() const;
  // The buffer's bytes in order, as spans of owned memory and of aliases
  // (one span, data(), when there are no aliases; none for an empty one).
  // Host memory only: a buffer with device aliases materializes them first
  // (MaterializeAliases) or is read through Segments().
  std::vector<absl::Span<const uint8_t>> Pieces() const;
  // Pieces() when every byte lies in host memory, none otherwise.
  std::vector<absl::Span<const uint8_t>> HostPieces() const;
  // The buffer's bytes in order, each range with the device source it lies
  // in (null: host memory).
  struct Segment {
    int64_t offset = 0;  // in the buffer
    const uint8_t* data = nullptr;
    int64_t size = 0;
    const DeviceSource* device = nullptr;
  };
  std::vector<Segment> Segments() const;
  // Copies bytes [offset, offset + n) of the buffer to host memory `dst`
  // (device aliases through their source). Errors: a device source's.
  absl::Status CopyOut(int64_t offset, void* dst, int64_t n) const;
  // Copies every alias into the owned bytes and drops it. Errors: a device
  // source's (the aliases are then kept).
  absl::Status MaterializeAliases();
  // As MaterializeAliases, walking the whole buffer in steps of at most
  // `step` bytes: once a step's bytes are owned, visit(offset, n) may read
  // them at data() + offset, while they are in cache (a check and a hash in
  // the same sweep as the copy). Steps cover every byte, owned ones too.
  // With `threads` > 1 up to that many threads take steps, in increasing
  // order, each the next one free, and `visit` runs for several steps at
  // once; with 1 (and whenever a device alias is left) steps go in order
  // on the calling thread. Errors: a device source's, or `visit`'s: the
  // first one in step order, which ends the walk (steps after it are not
  // visited, or not all); the aliases are then kept (the owned bytes under
  // them are never read).
  absl::Status MaterializeInSteps(
      int64_t step, int threads,
      const std::function<absl::Status(int64_t offset, int64_t n)>& visit);

  // Null for an empty buffer (size 0).
  uint8_t* data() const { return static_cast<uint8_t*>(data_); }
  int64_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  // Device memory (of the store's GPU) rather than host memory.
  bool on_device() const { return on_device_; }

 private:
  void Reset();

  void* data_ = nullptr;
  int64_t size_ = 0;
  bool on_device_ = false;
  std::function<void()> release_;
  struct Alias {
    int64_t offset = 0;
    int64_t size = 0;
    const uint8_t* source = nullptr;
    std::shared_ptr<const void> keep;
    const DeviceSource* device = nullptr;
  };
  std::vector<Alias> aliases_;  // sorted by offset
};

}  // namespace refit::core

#endif  // REFIT_CORE_STAGING_BUFFER_H_
