#include "core/byte_range_set.h"

#include <iterator>

#include "absl/strings/str_cat.h"

namespace refit::core {

absl::Status ByteRangeSet::Add(uint64_t offset, uint64_t length, absl::string_view name) {
  if (offset > size_ || length > size_ - offset) {
    return absl::OutOfRangeError(absl::StrCat("tensor \"", name, "\": chunk of ", length,
                                              " bytes at byte ", offset, " runs past its end at ",
                                              size_, " bytes"));
  }
  if (length == 0) return absl::OkStatus();
  const uint64_t begin = offset;
  const uint64_t end = offset + length;
  auto next = ranges_.lower_bound(begin);
  if (next != ranges_.end() && next->first == begin && next->second == end) {
    return absl::AlreadyExistsError(absl::StrCat("tensor \"", name, "\": duplicate chunk, bytes [",
                                                 begin, ", ", end, ") were already received"));
  }
  auto overlap = [&](auto it) -> absl::Status {
    if (it->first < end && begin < it->second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\": chunk bytes [", begin,
                                                     ", ", end, ") overlap bytes [", it->first,
                                                     ", ", it->second, ") already received"));
    }
    return absl::OkStatus();
  };
  if (next != ranges_.end()) {
    if (absl::Status s = overlap(next); !s.ok()) return s;
  }
  if (next != ranges_.begin()) {
    if (absl::Status s = overlap(std::prev(next)); !s.ok()) return s;
  }
  ranges_.emplace_hint(next, begin, end);
  received_ += length;
  return absl::OkStatus();
}

}  // namespace refit::core
