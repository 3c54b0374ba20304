// ByteRangeSet: which bytes of one checkpoint tensor a refit has received.
//
// Pipeline position: LayerAssembler keeps one per checkpoint tensor and adds
// every chunk's range before copying it, so that a repeated or overlapping
// chunk is refused before it can overwrite staging, and Prepare can tell a
// tensor received in full from one received in part.
//
// Ranges are half-open [offset, offset + length) within a tensor of `size`
// bytes; adjacent ranges are kept apart (nothing needs them merged) and
// lookups are O(log n). Thread-compatible.
#ifndef REFIT_CORE_BYTE_RANGE_SET_H_
#define REFIT_CORE_BYTE_RANGE_SET_H_

#include <cstdint>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace refit::core {

class ByteRangeSet {
 public:
  explicit ByteRangeSet(uint64_t size = 0) : size_(size) {}

  // Records [offset, offset + length). `name` is the tensor's, for messages.
  // An empty range is accepted and records nothing (when in bounds).
  // Errors (nothing recorded):
  //   OUT_OF_RANGE      the range runs past `size` (overflow-safe: any
  //                     offset/length, however large)
  //   ALREADY_EXISTS    exactly this range was received before
  //   INVALID_ARGUMENT  the range overlaps one received before
  absl::Status Add(uint64_t offset, uint64_t length, absl::string_view name);

  uint64_t size() const { return size_; }
  // Bytes received so far; == size() once the tensor is complete.
  uint64_t received() const { return received_; }
  bool complete() const { return received_ == size_; }
  int64_t num_ranges() const { return static_cast<int64_t>(ranges_.size()); }

 private:
  uint64_t size_;
  std::map<uint64_t, uint64_t> ranges_;  // begin -> end, disjoint
  uint64_t received_ = 0;
};

}  // namespace refit::core

#endif  // REFIT_CORE_BYTE_RANGE_SET_H_
