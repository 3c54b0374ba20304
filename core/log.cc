#include "core/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/text.h"

namespace refit::core {
namespace {

LogSeverity InitialSeverity() {
  const char* env = std::getenv("REFIT_LOG_LEVEL");
  if (env == nullptr) return LogSeverity::kInfo;
  if (std::strcmp(env, "debug") == 0) return LogSeverity::kDebug;
  if (std::strcmp(env, "warning") == 0) return LogSeverity::kWarning;
  if (std::strcmp(env, "error") == 0) return LogSeverity::kError;
  return LogSeverity::kInfo;
}

std::atomic<LogSeverity>& MinSeverity() {
  static std::atomic<LogSeverity> severity{InitialSeverity()};
  return severity;
}

absl::string_view SeverityName(LogSeverity severity) {
  switch (severity) {
    case LogSeverity::kDebug:
      return "DEBUG";
    case LogSeverity::kInfo:
      return "INFO";
    case LogSeverity::kWarning:
      return "WARNING";
    case LogSeverity::kError:
      return "ERROR";
  }
  return "INFO";
}

// Fields are short values (ids, names, paths); messages can quote whole
// statuses. Both are bounded so one record stays one readable line.
constexpr size_t kMaxFieldBytes = 256;
constexpr size_t kMaxMessageBytes = 4096;

bool NeedsQuotes(absl::string_view value) {
  if (value.empty()) return true;
  for (char c : value) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (c == ' ' || c == '"' || c == '=' || c == '\\' || u < 0x20 || u >= 0x7F) return true;
  }
  return false;
}

}  // namespace

void SetMinLogSeverity(LogSeverity severity) { MinSeverity().store(severity); }
LogSeverity MinLogSeverity() { return MinSeverity().load(); }

LogRecord::LogRecord(LogSeverity severity)
    : severity_(severity), enabled_(severity >= MinLogSeverity()) {}

LogRecord& LogRecord::Field(absl::string_view key, absl::string_view value) {
  if (!enabled_) return *this;
  if (NeedsQuotes(value)) {
    absl::StrAppend(&fields_, key, "=\"", BoundedText(value, kMaxFieldBytes), "\" ");
  } else {
    absl::StrAppend(&fields_, key, "=", BoundedText(value, kMaxFieldBytes), " ");
  }
  return *this;
}

LogRecord::~LogRecord() {
  if (!enabled_) return;
  std::string line =
      absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::Now(), absl::UTCTimeZone()), " ",
                   SeverityName(severity_), " ", fields_,
                   SanitizeLogText(message_.str(), kMaxMessageBytes), "\n");
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
}

}  // namespace refit::core
