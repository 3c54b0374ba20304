#include "core/staging_buffer.h"

#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace refit::core {
namespace {

absl::StatusOr<StagingBuffer> AllocateHost(int64_t size, absl::string_view what, bool zero) {
  if (size < 0) {
    return absl::InvalidArgumentError(absl::StrCat("negative staging size ", size, " for ", what));
  }
  if (size == 0) return StagingBuffer();
  void* data =
      zero ? std::calloc(static_cast<size_t>(size), 1) : std::malloc(static_cast<size_t>(size));
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", size, " bytes of staging for ", what));
  }
  return StagingBuffer(data, size, /*on_device=*/false, [data] { std::free(data); });
}

}  // namespace

StagingBuffer::StagingBuffer(void* data, int64_t size, bool on_device,
                             std::function<void()> release)
    : data_(data), size_(size), on_device_(on_device), release_(std::move(release)) {}

StagingBuffer::StagingBuffer(StagingBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      on_device_(std::exchange(other.on_device_, false)),
      release_(std::exchange(other.release_, nullptr)) {}

StagingBuffer& StagingBuffer::operator=(StagingBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    on_device_ = std::exchange(other.on_device_, false);
    release_ = std::exchange(other.release_, nullptr);
  }
  return *this;
}

StagingBuffer::~StagingBuffer() { Reset(); }

void StagingBuffer::Reset() {
  if (release_) std::exchange(release_, nullptr)();
  data_ = nullptr;
  size_ = 0;
  on_device_ = false;
}

absl::StatusOr<StagingBuffer> StagingBuffer::HostZeroed(int64_t size, absl::string_view what) {
  return AllocateHost(size, what, /*zero=*/true);
}

absl::StatusOr<StagingBuffer> StagingBuffer::HostUninitialized(int64_t size,
                                                               absl::string_view what) {
  return AllocateHost(size, what, /*zero=*/false);
}

}  // namespace refit::core
