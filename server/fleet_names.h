// Fleet names and member ids: the one rule the daemon (--fleet,
// --fleet-member) and the coordinators (refitctl fleet, FleetCoordinator)
// check alike. They become etcd key segments, JSON strings and metric
// labels, so they are 1 to 128 of the characters plain in all three.
#ifndef REFIT_SERVER_FLEET_NAMES_H_
#define REFIT_SERVER_FLEET_NAMES_H_

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

inline bool IsFleetNameChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
}

// OK, or INVALID_ARGUMENT naming `flag` and `what` ("fleet name",
// "member id") with the offending value escaped.
inline absl::Status ValidateFleetName(absl::string_view flag, absl::string_view what,
                                      absl::string_view name) {
  const bool valid = !name.empty() && name.size() <= kMaxFleetNameBytes && name != "." &&
                     name != ".." && std::all_of(name.begin(), name.end(), IsFleetNameChar);
  if (valid) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(flag, " \"", absl::CHexEscape(name.substr(0, 160)),
                                                 "\": a ", what, " is 1 to ", kMaxFleetNameBytes,
                                                 " of [A-Za-z0-9._-]"));
}

}  // namespace refit::server

#endif  // REFIT_SERVER_FLEET_NAMES_H_
