// Progress display of `refitctl push` and `refitctl reload` on stderr: bytes,
// throughput, ETA and a detail such as "12/31 layers".
//
// On a terminal the line is redrawn in place and fitted to the terminal's
// width (TIOCGWINSZ, else $COLUMNS, else 80): the bar shrinks first, then the
// least useful fields go, so the line never wraps. Without a terminal (a log,
// a pipe) plain lines are printed, one every few seconds and one at the end.
//
// FormatProgressLine and PlainProgressLine are pure functions (tested);
// ProgressBar adds the throttling, measured on the samples' elapsed time so
// that tests need no clock. Not thread-safe: one bar per command, updated from
// the thread that runs the push.
#ifndef REFIT_CLIENT_PROGRESS_BAR_H_
#define REFIT_CLIENT_PROGRESS_BAR_H_

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "absl/time/time.h"

namespace refit::client {

// "1.5 MiB", "12.0 GiB", "512 B".
std::string FormatBytes(uint64_t bytes);
// "0:07", "1:02:03"; "--:--" when unknown.
std::string FormatEta(absl::Duration eta);

struct ProgressSample {
  // Work done of the total: what the percentage and the ETA are computed
  // from (bytes for a push, tensor elements for a reload).
  uint64_t done = 0;
  uint64_t total = 0;
  // Bytes moved so far, for the byte counts and the rate; bytes_total 0 means
  // unknown (only bytes_done is shown).
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;
  absl::Duration elapsed;
  // Appended last, e.g. "12/31 layers".
  std::string detail;
};

// Columns of the terminal on `fd`: TIOCGWINSZ, else $COLUMNS, else 80.
int TerminalColumns(int fd);

// One line of at most `columns` - 1 characters (the last column is left free
// so the line never wraps):
//   "[#########-----]  45%  120.0 MiB / 266.0 MiB  1.2 GiB/s  ETA 0:03  12/31 layers"
// The bar takes what the fields leave, up to 40 cells; when fewer than 10 are
// left, the rate, then the detail, then the ETA, then the byte counts are
// dropped, and finally the bar.
std::string FormatProgressLine(const ProgressSample& sample, int columns);
// The same fields without a bar, for logs:
//   "45%  120.0 MiB / 266.0 MiB  1.2 GiB/s  ETA 0:03  12/31 layers"
std::string PlainProgressLine(const ProgressSample& sample);

class ProgressBar {
 public:
  enum class Mode {
    kOff,
    kTerminal,  // redrawn in place, at most every 100 ms and at 100%
    kPlain,     // a line every `plain_interval` and one at the end
  };
  // `columns` <= 0: ask the terminal on `out` at every redraw (it may be
  // resized).
  ProgressBar(std::FILE* out, Mode mode, int columns = 0,
              absl::Duration plain_interval = absl::Seconds(2));
  // kOff with `enabled` false, else kTerminal when `out` is a TTY, else kPlain.
  static ProgressBar ForStream(std::FILE* out, bool enabled);

  Mode mode() const { return mode_; }
  void Update(const ProgressSample& sample);
  // The end: `last` is drawn (terminal) or printed (plain) and the line
  // ended. Without `last` (a failure) a drawn terminal line is only ended.
  void Finish(const std::optional<ProgressSample>& last = std::nullopt);

 private:
  void Draw(const ProgressSample& sample);

  std::FILE* out_;
  Mode mode_;
  int columns_;
  absl::Duration plain_interval_;
  bool drawn_ = false;
  std::optional<absl::Duration> last_draw_;
};

}  // namespace refit::client

#endif  // REFIT_CLIENT_PROGRESS_BAR_H_
