// HashFeed: one XXH3 over bytes that several threads produce in pieces, fed
// in memory order while the pieces are still in cache (the FP8 quantizer's
// output as it converts; a kept kernel as it is copied in and checked).
#ifndef REFIT_CORE_HASH_FEED_H_
#define REFIT_CORE_HASH_FEED_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "core/parallel.h"
#include "core/xxh3.h"

namespace refit::core {

// Feeds bytes that workers write (or take in) unit by unit, in any order,
// to one running XXH3 in memory order. A worker marks each unit it
// wrote, then feeds whatever is ready from where the hash stands, unless
// another worker is doing that; a unit marked meanwhile is fed by whoever
// gets there next, or by Finish. So the hash reads each unit right after it
// was written, from cache, instead of the whole output back from memory.
// Units tile the bytes: unit u is [u * unit, (u + 1) * unit). The result
// is XXH3_64bits of all of them once every unit was marked and Finish ran.
//
// Thread-safety: Written from any number of threads, each unit once.
class HashFeed {
 public:
  HashFeed(XXH3_state_t* state, const uint8_t* out, int64_t bytes, int64_t unit)
      : state_(state),
        out_(out),
        bytes_(bytes),
        unit_(std::max<int64_t>(unit, 1)),
        units_((bytes + unit_ - 1) / unit_),
        ready_(new std::atomic<bool>[static_cast<size_t>(units_)]) {
    for (int64_t u = 0; u < units_; ++u) ready_[u].store(false, std::memory_order_relaxed);
  }

  int64_t units() const { return units_; }

  // Unit u is written.
  void Written(int64_t u) {
    ready_[u].store(true);
    Drain();
  }

  // Once every worker is done: feeds the units still waiting (all of them,
  // unless the pass stopped early on an error).
  void Finish() { Drain(); }

 private:
  // The flag stores and loads are sequentially consistent: a worker that
  // finds busy_ taken marked its unit before the holder's last look at it.
  void Drain() {
    for (;;) {
      if (busy_.exchange(true)) return;
      int64_t next = next_;
      while (next < units_ && ready_[next].load()) {
        const int64_t at = next * unit_;
        XXH3_64bits_update(state_, out_ + at, static_cast<size_t>(std::min(unit_, bytes_ - at)));
        ++next;
      }
      next_ = next;
      busy_.store(false);
      if (next >= units_ || !ready_[next].load()) return;
    }
  }

  XXH3_state_t* const state_;
  const uint8_t* const out_;
  const int64_t bytes_;
  const int64_t unit_;
  const int64_t units_;
  std::unique_ptr<std::atomic<bool>[]> ready_;
  std::atomic<bool> busy_{false};
  int64_t next_ = 0;  // the first unit not fed; only the holder of busy_ touches it
};

// Runs fn(worker, unit) for every unit in [0, units), in increasing order as
// `workers` workers take them (each the next one free), and feeds each to
// `feed` once fn returned true for it; stops handing out units after a
// false.
template <typename Fn>
void ForEachUnit(int workers, HashFeed& feed, const Fn& fn) {
  std::atomic<int64_t> next{0};
  std::atomic<bool> stop{false};
  RunInParallel(workers, [&](int w) {
    for (int64_t u = next.fetch_add(1, std::memory_order_relaxed);
         u < feed.units() && !stop.load(std::memory_order_relaxed);
         u = next.fetch_add(1, std::memory_order_relaxed)) {
      if (!fn(w, u)) {
        stop.store(true, std::memory_order_relaxed);
        return;
      }
      feed.Written(u);
    }
  });
  feed.Finish();
}

}  // namespace refit::core

#endif  // REFIT_CORE_HASH_FEED_H_
