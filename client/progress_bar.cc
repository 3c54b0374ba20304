#include "client/progress_bar.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace refit::client {
namespace {

constexpr int kMinBar = 10;
constexpr int kMaxBar = 40;

struct Fields {
  std::string percent, bytes, rate, eta, detail;
  double fraction = 0;
};

Fields MakeFields(const ProgressSample& s) {
  Fields f;
  f.fraction = s.total == 0
                   ? 1.0
                   : std::min(1.0, static_cast<double>(s.done) / static_cast<double>(s.total));
  f.percent = absl::StrFormat("%3d%%", static_cast<int>(f.fraction * 100));
  f.bytes = s.bytes_total > 0
                ? absl::StrCat(FormatBytes(s.bytes_done), " / ", FormatBytes(s.bytes_total))
                : FormatBytes(s.bytes_done);
  const double seconds = absl::ToDoubleSeconds(s.elapsed);
  f.rate = "-- B/s";
  absl::Duration eta = absl::InfiniteDuration();
  if (seconds > 0 && s.bytes_done > 0) {
    f.rate = absl::StrCat(
        FormatBytes(static_cast<uint64_t>(static_cast<double>(s.bytes_done) / seconds)), "/s");
  }
  if (seconds > 0 && f.fraction > 0) eta = s.elapsed * ((1.0 - f.fraction) / f.fraction);
  f.eta = absl::StrCat("ETA ", FormatEta(eta));
  f.detail = s.detail;
  return f;
}

std::string Join(const std::vector<const std::string*>& parts) {
  std::string out;
  for (const std::string* p : parts) {
    if (p->empty()) continue;
    if (!out.empty()) out += "  ";
    out += *p;
  }
  return out;
}

}  // namespace

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

int TerminalColumns(int fd) {
  struct winsize size {};
  if (fd >= 0 && ::ioctl(fd, TIOCGWINSZ, &size) == 0 && size.ws_col > 0) return size.ws_col;
  int columns = 0;
  if (const char* env = std::getenv("COLUMNS");
      env != nullptr && absl::SimpleAtoi(env, &columns) && columns > 0) {
    return columns;
  }
  return 80;
}

std::string FormatProgressLine(const ProgressSample& sample, int columns) {
  const Fields f = MakeFields(sample);
  const int limit = std::max(columns - 1, 1);
  // Fields in the order they are given up when the line is too long.
  std::vector<const std::string*> kept = {&f.percent, &f.bytes, &f.rate, &f.eta, &f.detail};
  const std::vector<const std::string*> drop_order = {&f.rate, &f.detail, &f.eta, &f.bytes};
  for (size_t dropped = 0;; ++dropped) {
    const std::string text = Join(kept);
    const int room = limit - static_cast<int>(text.size()) - 3;  // "[", "] "
    if (room >= kMinBar) {
      const int width = std::min(room, kMaxBar);
      const int filled = static_cast<int>(f.fraction * width);
      return absl::StrCat("[", std::string(filled, '#'), std::string(width - filled, '-'), "] ",
                          text);
    }
    if (dropped == drop_order.size()) {
      return text.substr(0, static_cast<size_t>(limit));
    }
    kept.erase(std::find(kept.begin(), kept.end(), drop_order[dropped]));
  }
}

std::string PlainProgressLine(const ProgressSample& sample) {
  const Fields f = MakeFields(sample);
  return Join({&f.percent, &f.bytes, &f.rate, &f.eta, &f.detail});
}

ProgressBar::ProgressBar(std::FILE* out, Mode mode, int columns, absl::Duration plain_interval)
    : out_(out), mode_(mode), columns_(columns), plain_interval_(plain_interval) {}

ProgressBar ProgressBar::ForStream(std::FILE* out, bool enabled) {
  if (!enabled) return ProgressBar(out, Mode::kOff);
  return ProgressBar(out, ::isatty(::fileno(out)) ? Mode::kTerminal : Mode::kPlain);
}

void ProgressBar::Update(const ProgressSample& sample) {
  switch (mode_) {
    case Mode::kOff:
      return;
    case Mode::kTerminal:
      if (sample.done < sample.total && last_draw_.has_value() &&
          sample.elapsed - *last_draw_ < absl::Milliseconds(100)) {
        return;
      }
      break;
    case Mode::kPlain:
      // The first line after one interval, then one per interval; the end is
      // Finish's.
      if (sample.elapsed - last_draw_.value_or(absl::ZeroDuration()) < plain_interval_) return;
      break;
  }
  Draw(sample);
}

void ProgressBar::Draw(const ProgressSample& sample) {
  last_draw_ = sample.elapsed;
  if (mode_ == Mode::kTerminal) {
    const int columns = columns_ > 0 ? columns_ : TerminalColumns(::fileno(out_));
    std::fprintf(out_, "\r%s\x1b[K", FormatProgressLine(sample, columns).c_str());
    drawn_ = true;
  } else {
    std::fprintf(out_, "%s\n", PlainProgressLine(sample).c_str());
  }
  std::fflush(out_);
}

void ProgressBar::Finish(const std::optional<ProgressSample>& last) {
  if (mode_ == Mode::kOff) return;
  if (last.has_value()) Draw(*last);
  if (mode_ == Mode::kTerminal && drawn_) std::fputc('\n', out_);
  drawn_ = false;
  std::fflush(out_);
}

}  // namespace refit::client
