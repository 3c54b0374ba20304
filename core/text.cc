#include "core/text.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"

namespace refit::core {
namespace {

// Length of the valid UTF-8 sequence starting at s[i], or 0 if there is none
// (overlong forms, surrogates and code points past U+10FFFF are invalid).
size_t Utf8Length(absl::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t b0 = byte(i);
  size_t n = 0;
  uint32_t min = 0;
  uint32_t cp = 0;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2, cp = b0 & 0x1F, min = 0x80;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    n = 3, cp = b0 & 0x0F, min = 0x800;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4, cp = b0 & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i + k) & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

// Appends s[0, limit) escaped; returns how many input bytes were consumed
// (limit, or less so as not to split a character).
size_t AppendEscaped(absl::string_view s, size_t limit, bool quotes, std::string* out) {
  size_t i = 0;
  while (i < s.size()) {
    const uint8_t c = static_cast<uint8_t>(s[i]);
    if (c >= 0x80) {
      const size_t n = Utf8Length(s, i);
      if (n > 0) {
        if (i + n > limit) break;
        out->append(s.data() + i, n);
        i += n;
        continue;
      }
    }
    if (i + 1 > limit) break;
    ++i;
    switch (c) {
      case '\n':
        out->append("\\n");
        continue;
      case '\r':
        out->append("\\r");
        continue;
      case '\t':
        out->append("\\t");
        continue;
      case '\\':
      case '"':
        if (quotes) out->push_back('\\');
        out->push_back(static_cast<char>(c));
        continue;
      default:
        break;
    }
    if (c < 0x20 || c == 0x7F || c >= 0x80) {
      static constexpr char kHex[] = "0123456789abcdef";
      out->append("\\x");
      out->push_back(kHex[c >> 4]);
      out->push_back(kHex[c & 0xF]);
    } else {
      out->push_back(static_cast<char>(c));
    }
  }
  return i;
}

std::string Bounded(absl::string_view text, size_t max_bytes, bool quotes) {
  std::string out;
  out.reserve(std::min(text.size(), max_bytes) + 16);
  const size_t used = AppendEscaped(text, max_bytes, quotes, &out);
  if (used < text.size()) absl::StrAppend(&out, "\xE2\x80\xA6(", text.size(), " bytes)");
  return out;
}

}  // namespace

std::string EscapeText(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  AppendEscaped(text, text.size(), /*quotes=*/true, &out);
  return out;
}

std::string BoundedText(absl::string_view text, size_t max_bytes) {
  return Bounded(text, max_bytes, /*quotes=*/true);
}

std::string QuoteText(absl::string_view text) {
  return absl::StrCat("\"", BoundedText(text), "\"");
}

std::string SanitizeLogText(absl::string_view text, size_t max_bytes) {
  return Bounded(text, max_bytes, /*quotes=*/false);
}

}  // namespace refit::core
