#include "core/staging_buffer.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/device_source.h"
#include "core/parallel.h"

namespace refit::core {
namespace {

// The host staging pool (StagingBuffer::HostUninitialized). One per process:
// every store's sessions draw from it.
class HostPool {
 public:
  static HostPool& Get() {
    static HostPool* pool = new HostPool();  // never destroyed: buffers may outlive main
    return *pool;
  }

  // Whether pooling is on (SetHostPoolIdle).
  bool enabled() {
    absl::MutexLock lock(&mu_);
    return idle_ > absl::ZeroDuration();
  }

  void SetIdle(absl::Duration idle) {
    {
      absl::MutexLock lock(&mu_);
      idle_ = idle;
    }
    if (idle <= absl::ZeroDuration()) Trim(absl::InfiniteFuture());
  }

  // A block of at least `size` bytes and its capacity; {nullptr, 0} when
  // the allocation fails.
  std::pair<void*, int64_t> Take(int64_t size) {
    std::vector<void*> evicted;
    {
      absl::MutexLock lock(&mu_);
      last_use_ = absl::Now();
      auto it = free_.lower_bound(size);
      if (it != free_.end() && it->first <= size + size / 8) {
        const std::pair<void*, int64_t> block{it->second, it->first};
        free_.erase(it);
        pooled_bytes_ -= block.second;
        in_use_bytes_ += block.second;
        high_water_bytes_ = std::max(high_water_bytes_, in_use_bytes_);
        ++reused_;
        return block;
      }
      // A miss allocates on top of what the pool keeps. Kept blocks of other
      // sizes are freed first, as many as it takes for kept + in use to stay
      // within the most that was in use at once (or what is in use now, if
      // this request raises that): pooling never adds to a refit's peak.
      const int64_t in_use_after = in_use_bytes_ + size;
      const int64_t limit = std::max(high_water_bytes_, in_use_after);
      while (!free_.empty() && pooled_bytes_ + in_use_after > limit) {
        auto largest = std::prev(free_.end());
        pooled_bytes_ -= largest->first;
        evicted.push_back(largest->second);
        free_.erase(largest);
      }
    }
    for (void* block : evicted) std::free(block);
    void* data = std::malloc(static_cast<size_t>(size));
    if (data == nullptr) return {nullptr, 0};
    absl::MutexLock lock(&mu_);
    in_use_bytes_ += size;
    high_water_bytes_ = std::max(high_water_bytes_, in_use_bytes_);
    ++allocated_;
    StartTrimmerLocked();
    return {data, size};
  }

  void Give(void* data, int64_t capacity) {
    {
      absl::MutexLock lock(&mu_);
      last_use_ = absl::Now();
      in_use_bytes_ -= capacity;
      if (idle_ > absl::ZeroDuration() && pooled_bytes_ + capacity <= high_water_bytes_) {
        free_.emplace(capacity, data);
        pooled_bytes_ += capacity;
        return;
      }
    }
    std::free(data);
  }

  int64_t Trim(absl::Time now) {
    std::multimap<int64_t, void*> freed;
    {
      absl::MutexLock lock(&mu_);
      if (free_.empty() || (idle_ > absl::ZeroDuration() && now - last_use_ < idle_)) return 0;
      freed.swap(free_);
      pooled_bytes_ = 0;
      // The next burst sets its own high-water mark.
      high_water_bytes_ = in_use_bytes_;
    }
    int64_t bytes = 0;
    for (const auto& [capacity, data] : freed) {
      bytes += capacity;
      std::free(data);
    }
    return bytes;
  }

  StagingBuffer::PoolStats Stats() {
    absl::MutexLock lock(&mu_);
    StagingBuffer::PoolStats stats;
    stats.pooled_bytes = pooled_bytes_;
    stats.in_use_bytes = in_use_bytes_;
    stats.high_water_bytes = high_water_bytes_;
    stats.reused = reused_;
    stats.allocated = allocated_;
    return stats;
  }

 private:
  // A detached thread that empties an idle pool; started with the first
  // pooled allocation, so processes that never stage have none.
  void StartTrimmerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (trimmer_started_) return;
    trimmer_started_ = true;
    std::thread([this] {
      while (true) {
        absl::Duration idle;
        {
          absl::MutexLock lock(&mu_);
          idle = idle_;
        }
        absl::SleepFor(std::max(idle / 2, absl::Seconds(1)));
        Trim(absl::Now());
      }
    }).detach();
  }

  absl::Mutex mu_;
  std::multimap<int64_t, void*> free_ ABSL_GUARDED_BY(mu_);  // capacity -> block
  int64_t pooled_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t in_use_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t high_water_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t reused_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t allocated_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_use_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Duration idle_ ABSL_GUARDED_BY(mu_) = StagingBuffer::kDefaultPoolIdle;
  bool trimmer_started_ ABSL_GUARDED_BY(mu_) = false;
};

absl::StatusOr<StagingBuffer> AllocateHost(int64_t size, absl::string_view what, bool zero,
                                           bool pooled = false) {
  if (size < 0) {
    return absl::InvalidArgumentError(absl::StrCat("negative staging size ", size, " for ", what));
  }
  if (size == 0) return StagingBuffer();
  if (pooled && size >= StagingBuffer::kPoolMinBytes && HostPool::Get().enabled()) {
    auto [block, capacity] = HostPool::Get().Take(size);
    if (block == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", size, " bytes of staging for ", what));
    }
    return StagingBuffer(block, size, /*on_device=*/false, [block = block, capacity = capacity] {
      HostPool::Get().Give(block, capacity);
    });
  }
  void* data =
      zero ? std::calloc(static_cast<size_t>(size), 1) : std::malloc(static_cast<size_t>(size));
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", size, " bytes of staging for ", what));
  }
  return StagingBuffer(data, size, /*on_device=*/false, [data] { std::free(data); });
}

// Copies n bytes at `src` (host memory, or an address in `device`) to host
// memory `dst`.
absl::Status CopyBytesToHost(const DeviceSource* device, const uint8_t* src, int64_t n,
                             uint8_t* dst) {
  if (device != nullptr) return device->CopyToHost(src, n, dst);
  std::memcpy(dst, src, static_cast<size_t>(n));
  return absl::OkStatus();
}

}  // namespace

StagingBuffer::StagingBuffer(void* data, int64_t size, bool on_device,
                             std::function<void()> release)
    : data_(data), size_(size), on_device_(on_device), release_(std::move(release)) {}

StagingBuffer::StagingBuffer(StagingBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      on_device_(std::exchange(other.on_device_, false)),
      release_(std::exchange(other.release_, nullptr)),
      aliases_(std::exchange(other.aliases_, {})) {}

StagingBuffer& StagingBuffer::operator=(StagingBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    on_device_ = std::exchange(other.on_device_, false);
    release_ = std::exchange(other.release_, nullptr);
    aliases_ = std::exchange(other.aliases_, {});
  }
  return *this;
}

StagingBuffer::~StagingBuffer() { Reset(); }

void StagingBuffer::Reset() {
  aliases_.clear();
  if (release_) std::exchange(release_, nullptr)();
  data_ = nullptr;
  size_ = 0;
  on_device_ = false;
}

void StagingBuffer::AddAlias(int64_t offset, const uint8_t* source, int64_t size,
                             std::shared_ptr<const void> keep, const DeviceSource* device) {
  if (size <= 0) return;
  Alias added{offset, size, source, std::move(keep), device};
  // `b` continues `a`: it starts where `a` ends, in the buffer and in the
  // same source.
  auto continues = [](const Alias& a, const Alias& b) {
    return a.offset + a.size == b.offset && a.source + a.size == b.source && a.keep == b.keep &&
           a.device == b.device;
  };
  auto it = std::lower_bound(aliases_.begin(), aliases_.end(), offset,
                             [](const Alias& a, int64_t o) { return a.offset < o; });
  if (it != aliases_.begin() && continues(*std::prev(it), added)) {
    Alias& before = *std::prev(it);
    // The one after may continue the added range too: the three become one.
    if (it != aliases_.end() && continues(added, *it)) {
      before.size += size + it->size;
      aliases_.erase(it);
    } else {
      before.size += size;
    }
    return;
  }
  if (it != aliases_.end() && continues(added, *it)) {
    it->offset = offset;
    it->source = source;
    it->size += size;
    return;
  }
  aliases_.insert(it, std::move(added));
}

int64_t StagingBuffer::aliased_bytes() const {
  int64_t n = 0;
  for (const Alias& a : aliases_) n += a.size;
  return n;
}

bool StagingBuffer::has_device_aliases() const {
  for (const Alias& a : aliases_) {
    if (a.device != nullptr) return true;
  }
  return false;
}

std::vector<StagingBuffer::Segment> StagingBuffer::Segments() const {
  std::vector<Segment> segments;
  const uint8_t* owned = data();
  int64_t at = 0;
  for (const Alias& a : aliases_) {
    if (a.offset > at) segments.push_back(Segment{at, owned + at, a.offset - at, nullptr});
    segments.push_back(Segment{a.offset, a.source, a.size, a.device});
    at = a.offset + a.size;
  }
  if (size_ > at) segments.push_back(Segment{at, owned + at, size_ - at, nullptr});
  return segments;
}

std::vector<absl::Span<const uint8_t>> StagingBuffer::Pieces() const {
  std::vector<absl::Span<const uint8_t>> pieces;
  for (const Segment& s : Segments()) {
    // A device address is never handed out as a host span.
    if (s.device != nullptr) std::abort();
    pieces.emplace_back(s.data, static_cast<size_t>(s.size));
  }
  return pieces;
}

std::vector<absl::Span<const uint8_t>> StagingBuffer::HostPieces() const {
  if (on_device_ || has_device_aliases()) return {};
  return Pieces();
}

absl::Status StagingBuffer::CopyOut(int64_t offset, void* dst, int64_t n) const {
  uint8_t* out = static_cast<uint8_t*>(dst);
  for (const Segment& s : Segments()) {
    const int64_t end = s.offset + s.size;
    const int64_t from = std::max(offset, s.offset);
    const int64_t to = std::min(offset + n, end);
    if (from < to) {
      absl::Status copied =
          CopyBytesToHost(s.device, s.data + (from - s.offset), to - from, out + (from - offset));
      if (!copied.ok()) return copied;
    }
    if (end >= offset + n) break;
  }
  return absl::OkStatus();
}

absl::Status StagingBuffer::MaterializeAliases() {
  for (const Alias& a : aliases_) {
    absl::Status copied = CopyBytesToHost(a.device, a.source, a.size, data() + a.offset);
    if (!copied.ok()) return copied;
  }
  aliases_.clear();
  return absl::OkStatus();
}

absl::Status StagingBuffer::MaterializeInSteps(
    int64_t step, int threads,
    const std::function<absl::Status(int64_t offset, int64_t n)>& visit) {
  step = std::max<int64_t>(step, 1);
  const int64_t steps = (size_ + step - 1) / step;
  // Copies in the aliased bytes of step s, then visits it. Aliases are
  // sorted and disjoint (each byte of a buffer is taken in once), so only
  // the one before the first starting at or after the step can reach into it.
  auto one = [&](int64_t s) -> absl::Status {
    const int64_t at = s * step;
    const int64_t end = std::min(size_, at + step);
    auto it = std::lower_bound(aliases_.begin(), aliases_.end(), at,
                               [](const Alias& a, int64_t o) { return a.offset < o; });
    if (it != aliases_.begin() && std::prev(it)->offset + std::prev(it)->size > at) --it;
    for (; it != aliases_.end() && it->offset < end; ++it) {
      const int64_t from = std::max(at, it->offset);
      const int64_t to = std::min(end, it->offset + it->size);
      if (from >= to) continue;
      absl::Status copied =
          CopyBytesToHost(it->device, it->source + (from - it->offset), to - from, data() + from);
      if (!copied.ok()) return copied;
    }
    return visit(at, end - at);
  };
  // Device copies stay on one thread.
  const int workers =
      has_device_aliases()
          ? 1
          : static_cast<int>(std::clamp<int64_t>(threads, 1, std::max<int64_t>(steps, 1)));
  // Steps go out in increasing order (one worker: on this thread, in
  // order); a failed one stops the hand-out. Every step below a failed one
  // was handed out before it and runs to its end, so the lowest failure is
  // the walk's first error.
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> failed{steps};  // the lowest failed step so far
  absl::Mutex mu;
  absl::Status first;  // its error
  RunInParallel(workers, [&](int) {
    for (int64_t s = next.fetch_add(1); s < steps && s < failed.load(); s = next.fetch_add(1)) {
      absl::Status status = one(s);
      if (status.ok()) continue;
      absl::MutexLock lock(&mu);
      if (s < failed.load()) {
        failed.store(s);
        first = std::move(status);
      }
      return;
    }
  });
  if (!first.ok()) return first;
  aliases_.clear();
  return absl::OkStatus();
}

absl::StatusOr<StagingBuffer> StagingBuffer::HostZeroed(int64_t size, absl::string_view what) {
  return AllocateHost(size, what, /*zero=*/true);
}

absl::StatusOr<StagingBuffer> StagingBuffer::HostUninitialized(int64_t size,
                                                               absl::string_view what) {
  return AllocateHost(size, what, /*zero=*/false);
}

absl::StatusOr<StagingBuffer> StagingBuffer::HostPooled(int64_t size, absl::string_view what) {
  return AllocateHost(size, what, /*zero=*/false, /*pooled=*/true);
}

StagingBuffer::PoolStats StagingBuffer::HostPoolStats() { return HostPool::Get().Stats(); }

int64_t StagingBuffer::TrimHostPool(absl::Time now) { return HostPool::Get().Trim(now); }

void StagingBuffer::SetHostPoolIdle(absl::Duration idle) { HostPool::Get().SetIdle(idle); }

}  // namespace refit::core
