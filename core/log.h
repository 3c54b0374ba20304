// Structured, line-oriented logging for refitd (Debian's Abseil has no
// absl/log). One line per record on stderr:
//   2026-11-29T21:00:00.123456Z INFO refit_id=r-1 group=target committed version 4
// Fields come before the message so that every line about a refit carries its
// id and can be grepped. Thread-safe: each record is written with one write().
//
//   REFIT_LOG(INFO).Field("refit_id", id) << "committed version " << v;
#ifndef REFIT_CORE_LOG_H_
#define REFIT_CORE_LOG_H_

#include <sstream>
#include <string>

#include "absl/strings/string_view.h"

namespace refit::core {

enum class LogSeverity { kDebug, kInfo, kWarning, kError };

// Records below this are dropped (default kInfo; REFIT_LOG_LEVEL=debug|info|warning|error).
void SetMinLogSeverity(LogSeverity severity);
LogSeverity MinLogSeverity();

class LogRecord {
 public:
  explicit LogRecord(LogSeverity severity);
  ~LogRecord();
  LogRecord(const LogRecord&) = delete;
  LogRecord& operator=(const LogRecord&) = delete;

  LogRecord& Field(absl::string_view key, absl::string_view value);
  template <typename T>
  LogRecord& operator<<(const T& value) {
    if (enabled_) message_ << value;
    return *this;
  }
  LogRecord& operator<<(absl::string_view value) {
    if (enabled_) message_ << std::string(value);
    return *this;
  }

 private:
  LogSeverity severity_;
  bool enabled_;
  std::string fields_;
  std::ostringstream message_;
};

}  // namespace refit::core

#define REFIT_LOG_SEVERITY_DEBUG ::refit::core::LogSeverity::kDebug
#define REFIT_LOG_SEVERITY_INFO ::refit::core::LogSeverity::kInfo
#define REFIT_LOG_SEVERITY_WARNING ::refit::core::LogSeverity::kWarning
#define REFIT_LOG_SEVERITY_ERROR ::refit::core::LogSeverity::kError
#define REFIT_LOG(severity) ::refit::core::LogRecord(REFIT_LOG_SEVERITY_##severity)

#endif  // REFIT_CORE_LOG_H_
