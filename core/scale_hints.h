// ScaleHints: the per-tensor FP8 scale each weight of a model group got the
// last times it was quantized, kept across refits, so that the next refit can
// hand it to the quantizer as a hint (Fp8QuantizeOptions::scale_hint).
//
// Why: a per-tensor scale needs the tensor's amax before the first byte is
// converted, which costs a second read of every weight. Between consecutive
// refits of a training run most weights keep their largest magnitude (an
// optimizer step rarely moves the largest element of a tensor by one bf16
// ulp), and then a convert with the old scale during the amax pass is the
// whole job. A hint is only offered for a weight whose last two scales were
// equal, so a model whose scales change every refit never pays for a hint
// that misses (one extra write of the weight's FP8 bytes), and one that
// changes after being stable pays once. The quantizer checks every hint:
// the bytes are the same with or without one.
//
// Thread-safety: thread-safe.
#ifndef REFIT_CORE_SCALE_HINTS_H_
#define REFIT_CORE_SCALE_HINTS_H_

#include <cstdint>
#include <string>

#include "absl/base/casts.h"
#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace refit::core {

class ScaleHints {
 public:
  // The scale to try for `weight` (its kernel name), or 0 for none.
  float Hint(absl::string_view weight) const {
    absl::MutexLock lock(&mu_);
    auto it = last_.find(weight);
    return it != last_.end() && it->second.stable ? it->second.scale : 0.0f;
  }

  // `weight` was just quantized with `scale`.
  void Record(absl::string_view weight, float scale) {
    absl::MutexLock lock(&mu_);
    auto [it, added] = last_.try_emplace(weight);
    Entry& e = it->second;
    e.stable = !added && absl::bit_cast<uint32_t>(e.scale) == absl::bit_cast<uint32_t>(scale);
    e.scale = scale;
  }

 private:
  struct Entry {
    float scale = 0.0f;
    bool stable = false;  // the scale before it was the same
  };
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> last_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::core

#endif  // REFIT_CORE_SCALE_HINTS_H_
