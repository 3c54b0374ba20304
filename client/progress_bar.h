// Terminal progress bar of `refitctl push` and `refitctl reload`: bytes sent,
// throughput and ETA, redrawn in place on stderr when stderr is a TTY.
//
// FormatProgressLine is a pure function (tested); ProgressBar adds the
// throttled redraw. Not thread-safe: one bar per command, updated from the
// thread that runs the push.
#ifndef REFIT_CLIENT_PROGRESS_BAR_H_
#define REFIT_CLIENT_PROGRESS_BAR_H_

#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/time/time.h"

namespace refit::client {

// "1.5 MiB", "12.0 GiB", "512 B".
std::string FormatBytes(uint64_t bytes);
// "0:07", "1:02:03"; "--:--" when unknown.
std::string FormatEta(absl::Duration eta);

// One line: "[#########-----------]  45%  120.0 MiB / 266.0 MiB  1.2 GiB/s  ETA 0:03".
// `bar_width` is the number of cells between the brackets.
std::string FormatProgressLine(uint64_t done, uint64_t total, absl::Duration elapsed,
                               int bar_width = 30);

class ProgressBar {
 public:
  // Draws only when `enabled` (refitctl passes isatty(stderr) && !--json).
  ProgressBar(std::FILE* out, bool enabled) : out_(out), enabled_(enabled) {}
  // Redraws at most every 100 ms, and always when done == total.
  void Update(uint64_t done, uint64_t total, absl::Duration elapsed);
  // Ends the line if anything was drawn.
  void Finish();

 private:
  std::FILE* out_;
  bool enabled_;
  bool drawn_ = false;
  absl::Time last_draw_ = absl::InfinitePast();
};

}  // namespace refit::client

#endif  // REFIT_CLIENT_PROGRESS_BAR_H_
