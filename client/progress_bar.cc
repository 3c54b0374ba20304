#include "client/progress_bar.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace refit::client {

std::string FormatBytes(uint64_t bytes) {
  static const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  double value = static_cast<double>(bytes) / 1024.0;
  int unit = 0;
  while (value >= 1024.0 && unit < 3) {
    value /= 1024.0;
    ++unit;
  }
  return absl::StrFormat("%.1f %s", value, kUnits[unit]);
}

std::string FormatEta(absl::Duration eta) {
  if (eta < absl::ZeroDuration() || eta == absl::InfiniteDuration()) return "--:--";
  int64_t s = absl::ToInt64Seconds(eta + absl::Milliseconds(500));
  if (s >= 3600) return absl::StrFormat("%d:%02d:%02d", s / 3600, (s / 60) % 60, s % 60);
  return absl::StrFormat("%d:%02d", s / 60, s % 60);
}

std::string FormatProgressLine(uint64_t done, uint64_t total, absl::Duration elapsed,
                               int bar_width) {
  const double fraction =
      total == 0 ? 1.0 : std::min(1.0, static_cast<double>(done) / static_cast<double>(total));
  const int filled = static_cast<int>(fraction * bar_width);
  std::string bar =
      absl::StrCat("[", std::string(filled, '#'), std::string(bar_width - filled, '-'), "]");
  const double seconds = absl::ToDoubleSeconds(elapsed);
  std::string rate = "-- B/s";
  absl::Duration eta = absl::InfiniteDuration();
  if (seconds > 0 && done > 0) {
    const double per_second = static_cast<double>(done) / seconds;
    rate = absl::StrCat(FormatBytes(static_cast<uint64_t>(per_second)), "/s");
    eta = absl::Seconds(static_cast<double>(total - std::min(done, total)) / per_second);
  }
  return absl::StrFormat("%s %3d%%  %s / %s  %s  ETA %s", bar, static_cast<int>(fraction * 100),
                         FormatBytes(done), FormatBytes(total), rate, FormatEta(eta));
}

void ProgressBar::Update(uint64_t done, uint64_t total, absl::Duration elapsed) {
  if (!enabled_) return;
  absl::Time now = absl::Now();
  if (done < total && now - last_draw_ < absl::Milliseconds(100)) return;
  last_draw_ = now;
  std::fprintf(out_, "\r%s\x1b[K", FormatProgressLine(done, total, elapsed).c_str());
  std::fflush(out_);
  drawn_ = true;
}

void ProgressBar::Finish() {
  if (drawn_) std::fputc('\n', out_);
  drawn_ = false;
}

}  // namespace refit::client
