#include "server/server_options.h"

#include <algorithm>
#include <cctype>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace refit::server {

std::vector<std::string> SplitListenAddresses(const std::vector<std::string>& values) {
  std::vector<std::string> out;
  for (const std::string& value : values) {
    for (absl::string_view part : absl::StrSplit(value, ',', absl::SkipWhitespace())) {
      out.emplace_back(absl::StripAsciiWhitespace(part));
    }
  }
  return out;
}

absl::Status ValidateListenAddress(absl::string_view address, absl::string_view flag) {
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:")) {
    return absl::OkStatus();
  }
  auto invalid = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " address \"", address, "\": ", why));
  };
  absl::string_view host = address, port;
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos || address.substr(close + 1, 1) != ":") {
      return invalid("expected [ipv6]:port");
    }
    host = address.substr(1, close - 1);
    port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos || address.find(':') != colon) {
      return invalid("expected host:port, [ipv6]:port or unix:/path");
    }
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
  }
  int value = -1;
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      !absl::SimpleAtoi(port, &value) || value > 65535) {
    return invalid(absl::StrCat("port \"", port, "\" is not a number in 0..65535"));
  }
  return absl::OkStatus();
}

bool IsLoopbackAddress(absl::string_view address) {
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:")) {
    return true;
  }
  absl::string_view host = address;
  if (absl::StartsWith(host, "[")) {
    const size_t close = host.find(']');
    host = close == absl::string_view::npos ? host.substr(1) : host.substr(1, close - 1);
  } else if (const size_t colon = host.rfind(':'); colon != absl::string_view::npos) {
    host = host.substr(0, colon);
  }
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

absl::StatusOr<int64_t> ParseByteSize(absl::string_view text) {
  absl::string_view s = absl::StripAsciiWhitespace(text);
  size_t digits = 0;
  while (digits < s.size() && std::isdigit(static_cast<unsigned char>(s[digits]))) ++digits;
  int64_t value = 0;
  if (digits == 0 || !absl::SimpleAtoi(s.substr(0, digits), &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("byte size \"", text, "\": expected a number with an optional unit"));
  }
  std::string unit = absl::AsciiStrToLower(absl::StripAsciiWhitespace(s.substr(digits)));
  int shift = 0;
  if (unit.empty() || unit == "b") {
    shift = 0;
  } else if (unit == "k" || unit == "kib" || unit == "kb") {
    shift = 10;
  } else if (unit == "m" || unit == "mib" || unit == "mb") {
    shift = 20;
  } else if (unit == "g" || unit == "gib" || unit == "gb") {
    shift = 30;
  } else if (unit == "t" || unit == "tib" || unit == "tb") {
    shift = 40;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("byte size \"", text, "\": unknown unit \"", unit, "\" (use K, M, G or T)"));
  }
  if (value > (std::numeric_limits<int64_t>::max() >> shift)) {
    return absl::InvalidArgumentError(absl::StrCat("byte size \"", text, "\" is too large"));
  }
  return value << shift;
}

}  // namespace refit::server
