// Plain names: model groups (--group), fleets (--fleet) and fleet members
// (--fleet-member). They become health service names, directory names, etcd
// key segments, JSON strings and metric labels, so they are made of the
// characters plain in all of them: [A-Za-z0-9._-], never "." or "..".
// Header-only: the coordinators (refitctl fleet) check fleet names by the
// same rule as the daemon without linking it.
#ifndef REFIT_SERVER_PLAIN_NAMES_H_
#define REFIT_SERVER_PLAIN_NAMES_H_

#include <algorithm>
#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace refit::server {

inline constexpr size_t kMaxFleetNameBytes = 128;

inline bool IsPlainNameChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
}

// 1 to `max_bytes` plain characters, and not "." or "..".
inline bool IsPlainName(absl::string_view name, size_t max_bytes) {
  return !name.empty() && name.size() <= max_bytes && name != "." && name != ".." &&
         std::all_of(name.begin(), name.end(), IsPlainNameChar);
}

// OK, or INVALID_ARGUMENT naming `flag` and `what` ("fleet name",
// "member id") with the offending value escaped.
inline absl::Status ValidateFleetName(absl::string_view flag, absl::string_view what,
                                      absl::string_view name) {
  if (IsPlainName(name, kMaxFleetNameBytes)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(flag, " \"", absl::CHexEscape(name.substr(0, 160)),
                                                 "\": a ", what, " is 1 to ", kMaxFleetNameBytes,
                                                 " of [A-Za-z0-9._-]"));
}

}  // namespace refit::server

#endif  // REFIT_SERVER_PLAIN_NAMES_H_
