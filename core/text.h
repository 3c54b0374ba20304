// Untrusted text (tensor names, labels, abort reasons, caller names, paths
// from requests) made safe for a log line or a status message.
//
// Clients choose these strings, and they end up in refitd's log and in the
// errors it returns. Unescaped, a newline forges a log record and a NUL or
// invalid UTF-8 reaches the log as is; unbounded, a 900 KB tensor name makes
// the error larger than the client's message limit, so the client sees
// RESOURCE_EXHAUSTED instead of the real status. Every place that puts such a
// string into a message goes through QuoteText (or BoundedText), and the log
// sink escapes control bytes of whole records, so this file is the one place
// that decides how they look.
//
// Escaping is C-style: \n \r \t \\ \" and \xNN for other control bytes, DEL,
// NUL and bytes that are not part of valid UTF-8; valid UTF-8 stays as it is.
// Pure functions; thread-safe.
#ifndef REFIT_CORE_TEXT_H_
#define REFIT_CORE_TEXT_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace refit::core {

// How much of one untrusted string a message shows.
inline constexpr size_t kMaxQuotedTextBytes = 256;

// `text` escaped (see above), whole.
std::string EscapeText(absl::string_view text);

// EscapeText of the first `max_bytes` bytes of `text` (cut at a character
// boundary); when cut, "…(N bytes)" follows, N being the full size.
std::string BoundedText(absl::string_view text, size_t max_bytes = kMaxQuotedTextBytes);

// BoundedText in double quotes: how a message names an untrusted string.
std::string QuoteText(absl::string_view text);

// A log record's text made one line: control bytes, NUL and invalid UTF-8
// escaped as above (quotes and backslashes are left alone, the text is the
// program's own), and cut to `max_bytes` with "…(N bytes)".
std::string SanitizeLogText(absl::string_view text, size_t max_bytes);

}  // namespace refit::core

#endif  // REFIT_CORE_TEXT_H_
