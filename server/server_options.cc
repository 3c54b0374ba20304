#include "server/server_options.h"

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstddef>
#include <cstring>
#include <limits>

#include <sys/un.h>
#include <unistd.h>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/plain_names.h"

namespace refit::server {

std::vector<GroupOptions> EffectiveGroups(const ServerOptions& options) {
  if (!options.groups.empty()) return options.groups;
  GroupOptions group;
  group.name = kDefaultGroup;
  group.model = options.model;
  group.demo_seed = options.demo_seed;
  group.tp_rank = options.tp_rank;
  group.tp_size = options.tp_size;
  group.ep_rank = options.ep_rank;
  group.ep_size = options.ep_size;
  group.device = options.device;
  group.quant = options.quant;
  group.host_staging = options.host_staging;
  return {group};
}

absl::Status ValidateGroupName(absl::string_view name) {
  if (IsPlainName(name, 64)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "model group name \"", absl::CHexEscape(name.substr(0, 80)),
      "\" is not 1 to 64 of [A-Za-z0-9._-] (it names a health service and a directory)"));
}

absl::StatusOr<GroupOptions> ParseGroupSpec(absl::string_view text, const GroupOptions& defaults) {
  auto invalid = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--group \"", absl::CHexEscape(text), "\": ", why,
                     " (expected NAME=MODEL[,key=value...], keys "
                     "seed, tp, tp-rank, ep, ep-rank, device, quant, host-staging)"));
  };
  const size_t eq = text.find('=');
  if (eq == absl::string_view::npos) return invalid("no '=' after the group name");
  GroupOptions group = defaults;
  group.name = std::string(text.substr(0, eq));
  if (absl::Status s = ValidateGroupName(group.name); !s.ok()) return invalid(s.message());
  std::vector<std::string> parts = absl::StrSplit(text.substr(eq + 1), ',');
  group.model = parts[0];
  if (group.model.empty()) return invalid("no model (a checkpoint directory or demo)");
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string& part = parts[i];
    const size_t at = part.find('=');
    if (at == std::string::npos) return invalid(absl::StrCat("\"", part, "\" is not key=value"));
    const std::string key = part.substr(0, at);
    const std::string value = part.substr(at + 1);
    auto number = [&](int64_t* out) -> absl::Status {
      if (!absl::SimpleAtoi(value, out) || *out < 0) {
        return invalid(absl::StrCat(key, "=", value, " is not a non-negative integer"));
      }
      return absl::OkStatus();
    };
    if (key == "seed") {
      if (!absl::SimpleAtoi(value, &group.demo_seed)) {
        return invalid(absl::StrCat("seed=", value, " is not a non-negative integer"));
      }
    } else if (key == "tp") {
      if (absl::Status s = number(&group.tp_size); !s.ok()) return s;
    } else if (key == "tp-rank") {
      if (absl::Status s = number(&group.tp_rank); !s.ok()) return s;
    } else if (key == "ep") {
      if (absl::Status s = number(&group.ep_size); !s.ok()) return s;
    } else if (key == "ep-rank") {
      if (absl::Status s = number(&group.ep_rank); !s.ok()) return s;
    } else if (key == "device") {
      group.device = value;
    } else if (key == "quant") {
      group.quant = value;
    } else if (key == "host-staging") {
      if (value != "true" && value != "false") {
        return invalid(absl::StrCat("host-staging=", value, " is not true or false"));
      }
      group.host_staging = value == "true";
    } else {
      return invalid(absl::StrCat("unknown key \"", key, "\""));
    }
  }
  return group;
}

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
  absl::string_view host, port;
  if (!SplitHostPort(address, &host, &port)) {
    return invalid(absl::StartsWith(address, "[")
                       ? "expected [ipv6]:port"
                       : "expected host:port, [ipv6]:port or unix:/path");
  }
  int value = -1;
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      !absl::SimpleAtoi(port, &value) || value > 65535) {
    return invalid(absl::StrCat("port \"", port, "\" is not a number in 0..65535"));
  }
  return absl::OkStatus();
}

absl::Status ValidateListenAddresses(const std::vector<std::string>& addresses) {
  for (const std::string& address : addresses) {
    if (absl::Status s = ValidateListenAddress(address, "--listen"); !s.ok()) return s;
    if (!absl::StartsWith(address, "unix:") && !absl::StartsWith(address, "unix-abstract:")) {
      continue;
    }
    if (absl::Status s = ParseUnixSocketAddress(address).status(); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--listen address \"", address, "\": ", s.message()));
    }
  }
  const std::string fd_path = DescriptorSocketPath(addresses);
  if (!fd_path.empty()) {
    if (absl::Status s = ParseUnixSocketAddress(absl::StrCat("unix:", fd_path)).status(); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--listen: the descriptor socket for engine attach and trainer regions, ", fd_path,
          ", goes beside the first unix: path; ", s.message(), ": use a shorter path"));
    }
  }
  return absl::OkStatus();
}

std::string DescriptorSocketPath(const std::vector<std::string>& addresses) {
  for (const std::string& address : addresses) {
    if (!absl::StartsWith(address, "unix:")) continue;
    absl::StatusOr<UnixSocketAddress> a = ParseUnixSocketAddress(address);
    if (!a.ok()) return std::string();
    // Clients are told this path: relative, it would name a file beside
    // their working directory, not the daemon's. Made absolute where that
    // still fits a socket address; in a working directory too deep for it,
    // it stays relative (clients in the same directory reach it).
    if (!absl::StartsWith(a->path, "/")) {
      char cwd[PATH_MAX];
      if (::getcwd(cwd, sizeof(cwd)) == nullptr) return a->path + ".fd";
      std::string absolute = absl::StrCat(cwd, "/", a->path, ".fd");
      if (absolute.size() >= sizeof(sockaddr_un::sun_path)) return a->path + ".fd";
      return absolute;
    }
    return a->path + ".fd";
  }
  return std::string();
}

bool SplitHostPort(absl::string_view address, absl::string_view* host, absl::string_view* port) {
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos || address.substr(close + 1, 1) != ":") return false;
    *host = address.substr(1, close - 1);
    *port = address.substr(close + 2);
    return true;
  }
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || address.find(':') != colon) return false;
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  return true;
}

absl::StatusOr<UnixSocketAddress> ParseUnixSocketAddress(absl::string_view address) {
  UnixSocketAddress a;
  a.sun.sun_family = AF_UNIX;
  const bool abstract = absl::StartsWith(address, "unix-abstract:");
  absl::string_view name = address.substr(abstract ? 14 : 5);
  if (!abstract && absl::StartsWith(name, "//")) name.remove_prefix(2);
  // An abstract name goes after a NUL byte; a path needs its terminating one.
  const size_t room = sizeof(a.sun.sun_path) - 1;
  if (name.empty() || name.size() > room) {
    return absl::InvalidArgumentError(absl::StrCat("the ", abstract ? "name" : "path", " is ",
                                                   name.size(), " bytes; 1 to ", room,
                                                   " fit a Unix socket"));
  }
  if (abstract) {
    std::memcpy(a.sun.sun_path + 1, name.data(), name.size());
    a.len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  } else {
    std::memcpy(a.sun.sun_path, name.data(), name.size());
    a.len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size() + 1);
    a.path = std::string(name);
  }
  return a;
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
